"""Runs the app with uvicorn: in the foreground (`moestream serve`) or on a thread of its own
(tests, benchmarks), with the engine worker started and stopped by the app's lifespan."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from moestream.errors import MoestreamError
from moestream.serving.app import create_app
from moestream.serving.worker import EngineWorker, WorkerConfig

START_TIMEOUT_S = 30.0


class Server:
    """An engine served over HTTP on host:port (port 0: a free one, read back from `port`)."""

    def __init__(self, engine, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, worker_config: WorkerConfig | None = None):
        self.worker = EngineWorker(engine, worker_config)
        self.app = create_app(self.worker, model_name, api_key)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                                     timeout_graceful_shutdown=5))
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        """Serves until interrupted (Ctrl-C)."""
        self._server.run()

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
    def host(self) -> str:
        """The address it binds."""
        return self._server.config.host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

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
