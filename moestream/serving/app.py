"""The OpenAI-compatible HTTP API (FastAPI) in front of one `EngineWorker`: the routes `create_app` adds.

Requests are checked here (parameters, model, context length, API key) and refused with OpenAI-style error JSON, as
are those the worker refuses: an answer begins only once its request is admitted. A request whose client goes away is
cancelled. It never runs the engine: the worker's thread does.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from importlib import resources

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from moestream.checkpoint.tokenizer import load_tokenizer
from moestream.errors import MoestreamError
from moestream.runtime.scheduling.scheduler import KvBudgetError
from moestream.serving.generation import Admitted, Request, TextDelta
from moestream.serving.live import LiveStats
from moestream.serving.protocol import ChatBody, CompletionBody, StreamOptions, chunk, error_json, response, usage_chunk
from moestream.serving.sampling import SamplingParams
from moestream.serving.worker import EngineWorker, Overloaded

DEFAULT_MAX_TOKENS = 16
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is there


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class Frontend:
    """Turns checked HTTP bodies into worker requests and worker deltas into OpenAI JSON."""

    def __init__(self, worker: EngineWorker, model_name: str):
        engine = worker.engine
        self.worker, self.model_name = worker, model_name
        self.tokenizer = load_tokenizer(engine.checkpoint.path)  # the event loop's own
        self.vocab_size = engine.model.config.get_text_config().vocab_size
        self.context_len = engine.context_len
        # moestream's own object, beside usage (in a stream's last chunk), in /v1/models and /health: replayed
        # when the routing came from a recorded trace (--replay-routing), for measurement only
        self.info = {"moestream": {"replayed": engine.replay is not None}}

    def prompt_ids(self, body: CompletionBody | ChatBody) -> list[int]:
        if isinstance(body, ChatBody):
            return list(self.tokenizer(self.chat_prompt(body), add_special_tokens=False)["input_ids"])
        if isinstance(body.prompt, str):
            return list(self.tokenizer(body.prompt)["input_ids"])
        if not all(0 <= t < self.vocab_size for t in body.prompt):
            raise ApiError(400, f"prompt token ids must lie in [0, {self.vocab_size})", "prompt")
        return list(body.prompt)

    def chat_prompt(self, body: ChatBody) -> str:
        """The checkpoint's chat template, else one 'role: content' line each and 'assistant:'."""
        if self.tokenizer.chat_template:
            messages = [m.model_dump() for m in body.messages]
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "".join(f"{m.role}: {m.content}\n" for m in body.messages) + "assistant:"

    def check(self, body: CompletionBody | ChatBody, prompt_ids: list[int]) -> SamplingParams:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist", "model", "model_not_found")
        if (refused := body.refused()) is not None:
            raise ApiError(400, refused[1], refused[0])
        if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        if not prompt_ids:
            raise ApiError(400, "the prompt has no tokens", "prompt")
        params = body.sampling_params(DEFAULT_MAX_TOKENS)  # a SamplingError is a MoestreamError: _user_error's 400
        if self.context_len and len(prompt_ids) + params.max_tokens > self.context_len:
            raise ApiError(400, f"this model's maximum context length is {self.context_len} tokens; the prompt "
                           f"has {len(prompt_ids)} and max_tokens is {params.max_tokens}", "max_tokens",
                           "context_length_exceeded")
        return params

    async def answer(self, body: CompletionBody | ChatBody, http: HttpRequest):
        """The answer once the worker has admitted the request: a refusal is an error status, streamed or not."""
        chat = isinstance(body, ChatBody)
        prompt_ids = self.prompt_ids(body)
        params = self.check(body, prompt_ids)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        request = Request(prompt_ids, params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        try:
            self.worker.submit(request)
        except Overloaded as error:
            raise ApiError(429, str(error), code="overloaded") from None
        if not await _admitted(request, events, http, self.worker):
            return Response(status_code=499)  # nobody reads it
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            stream = self._stream(rid, chat, request, events, body.stream_options)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await self._whole(rid, chat, request, events, http)

    async def _whole(self, rid: str, chat: bool, request: Request, events: asyncio.Queue,
                     http: HttpRequest) -> dict | Response:
        pieces, checked = [], time.monotonic()
        try:
            while True:
                delta = _raise_failure(await _next_event(events))
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        return Response(status_code=499)  # nobody reads it; the finally cancels
                if delta is not None:
                    pieces.append(delta.text)
                    if delta.finished:
                        return response(rid, self.model_name, chat, "".join(pieces), delta.finish_reason,
                                        len(request.prompt_ids), request.num_tokens) | self.info
        finally:
            request.cancel()  # a no-op once finished; ends the sequence of a client that went away

    async def _stream(self, rid: str, chat: bool, request: Request, events: asyncio.Queue,
                      options: StreamOptions | None):
        first = True
        try:
            while True:
                event = await events.get()
                if isinstance(event, Exception):
                    yield _sse(error_json(f"generation failed: {event}", "server_error"))
                    break
                piece = chunk(rid, self.model_name, chat, event.text, event.finish_reason, first)
                yield _sse(piece | self.info if event.finished else piece)
                first = False
                if event.finished:
                    if options is not None and options.include_usage:
                        yield _sse(usage_chunk(rid, self.model_name, chat, len(request.prompt_ids), request.num_tokens))
                    break
            yield "data: [DONE]\n\n"
        finally:
            request.cancel()  # the client disconnected (or the stream ended): the sequence stops


async def _admitted(request: Request, events: asyncio.Queue, http: HttpRequest, worker: EngineWorker) -> bool:
    """Waits for the request's first event: True once admitted, False (cancelled) if its client left first;
    a refusal or a stopped engine thread is raised as an ApiError."""
    admitted = False
    try:
        while (event := await _next_event(events)) is None:
            if await http.is_disconnected():
                return False
            if not worker.alive:
                raise ApiError(503, "the engine is not running", code="server_error")
        _raise_failure(event)  # else it is Admitted: the worker's first event says one or the other
        admitted = True
        return True
    finally:
        if not admitted:
            request.cancel()


async def _next_event(events: asyncio.Queue):
    try:
        return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
    except asyncio.TimeoutError:
        return None


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _raise_failure(event: Admitted | TextDelta | Exception | None) -> Admitted | TextDelta | None:
    if isinstance(event, KvBudgetError):
        raise ApiError(400, str(event), "max_tokens", "kv_budget_exceeded")
    if isinstance(event, Overloaded):
        raise ApiError(503, str(event), code="overloaded")
    if isinstance(event, Exception):
        raise ApiError(500, f"generation failed: {event}", code="server_error")
    return event


def create_app(worker: EngineWorker, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app; its lifespan starts the worker's thread and stops it (the engine stays open). The routes
    are module-level functions that find the `Frontend` in app.state: FastAPI caches what it learns of
    each endpoint function for the life of the process, so a route closing over the worker would keep
    every engine a process has served alive."""

    async def lifespan(app):
        app.state.loop = asyncio.get_running_loop()  # Server.tasks() asks it from another thread
        app.state.live.attach()
        worker.start()
        yield
        await asyncio.to_thread(worker.close)
        app.state.live.detach()

    if api_key is not None and not api_key.strip():
        raise MoestreamError("an empty API key would leave the server open: pass None to serve without one")
    handlers = {ApiError: _api_error, RequestValidationError: _invalid_body, MoestreamError: _user_error}
    app = FastAPI(title="moestream", lifespan=lifespan, exception_handlers=handlers)
    app.state.frontend = Frontend(worker, model_name)
    app.state.live = LiveStats(worker)
    authorized = [Depends(_bearer(api_key))] if api_key is not None else []
    app.add_api_route("/v1/completions", _completions, methods=["POST"], dependencies=authorized)
    app.add_api_route("/v1/chat/completions", _chat_completions, methods=["POST"], dependencies=authorized)
    app.add_api_route("/v1/models", _models, methods=["GET"], dependencies=authorized)
    app.add_api_route("/v1/moestream/stats", _live_stats, methods=["GET"], dependencies=authorized)
    app.add_api_route("/dashboard", _dashboard, methods=["GET"], response_class=HTMLResponse)
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    return app


async def _completions(body: CompletionBody, http: HttpRequest):
    return await http.app.state.frontend.answer(body, http)


async def _chat_completions(body: ChatBody, http: HttpRequest):
    return await http.app.state.frontend.answer(body, http)


async def _models(http: HttpRequest):
    frontend = http.app.state.frontend
    model = {"id": frontend.model_name, "object": "model", "owned_by": "moestream"} | frontend.info
    return {"object": "list", "data": [model]}


async def _health(http: HttpRequest):
    return {"status": "ok"} | http.app.state.frontend.info


async def _live_stats(http: HttpRequest):
    return http.app.state.live.snapshot()


async def _dashboard():
    return HTMLResponse(resources.files("moestream").joinpath("data/dashboard.html").read_text())


async def _metrics(http: HttpRequest):
    return Response(http.app.state.frontend.worker.metrics.render(), media_type="text/plain; version=0.0.4")


def _bearer(api_key: str):
    async def check(http: HttpRequest) -> None:
        given = http.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "a valid API key is needed (Authorization: Bearer KEY)", code="invalid_api_key")
    return check


async def _api_error(_, error: ApiError):
    kind = "authentication_error" if error.status == 401 else "invalid_request_error"
    kind = "server_error" if error.status >= 500 else kind
    return JSONResponse(error_json(str(error), kind, error.param, error.code), status_code=error.status)


async def _invalid_body(_, error: RequestValidationError):
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in error.errors())
    return JSONResponse(error_json(f"invalid request: {problems}"), status_code=400)


async def _user_error(_, error: MoestreamError):
    return JSONResponse(error_json(str(error)), status_code=400)
