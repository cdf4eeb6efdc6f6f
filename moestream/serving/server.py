"""Runs the app with uvicorn: in the foreground (`moestream serve`) or on a thread of its own
(tests, benchmarks), with the engine worker started and stopped by the app's lifespan.

The listening socket is bound before anything is announced (`bind`), so a port in use or a host that
does not resolve is one error line. On Ctrl-C or SIGTERM the worker drains first: nothing new is
admitted, running requests may finish within the grace period and then end (finish reason 'abort'),
so uvicorn's graceful shutdown finds no stream to cancel."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from moestream.errors import MoestreamError
from moestream.serving.app import create_app
from moestream.serving.worker import EngineWorker, WorkerConfig

START_TIMEOUT_S = 30.0
DRAIN_GRACE_S = 2.0  # after Ctrl-C, how long running requests may go on before they end


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, or one MoestreamError naming --host or --port."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise MoestreamError(f"--host {host}: cannot resolve it ({error.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise MoestreamError(f"--port {port}: cannot listen on {host}:{port} ({error.strerror})") from None
    return sock


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, but a signal to stop drains the engine worker before uvicorn shuts down."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig, frame) -> None:
        self.worker.drain(DRAIN_GRACE_S)
        super().handle_exit(sig, frame)


class Server:
    """An engine served over HTTP on host:port (port 0: a free one, read back from `port`)."""

    def __init__(self, engine, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, worker_config: WorkerConfig | None = None):
        self.worker = EngineWorker(engine, worker_config)
        self.app = create_app(self.worker, model_name, api_key)
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=DRAIN_GRACE_S + 3)
        self._server = _DrainingServer(config, self.worker)
        self.worker.on_failure = lambda: setattr(self._server, "should_exit", True)
        self._thread: threading.Thread | None = None

    def run(self, sock: socket.socket | None = None) -> None:
        """Serves until interrupted (Ctrl-C, SIGTERM) or the engine fails (its error is raised), on `sock` if given."""
        self._server.run(sockets=[sock] if sock is not None else None)
        if self.worker.failure is not None:
            raise self.worker.failure

    def start(self) -> "Server":
        """Serves on a background thread; returns once it accepts connections."""
        self._thread = threading.Thread(target=self._server.run, name="moestream-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise MoestreamError("the server did not start (is the port taken?)")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self._server.config.host}:{self.port}"

    def tasks(self) -> list[str]:
        """The names of the event loop's tasks (beside the one asking): what a finished run left."""
        async def others() -> list[str]:
            return sorted(t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task())
        return asyncio.run_coroutine_threadsafe(others(), self.app.state.loop).result(START_TIMEOUT_S)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
