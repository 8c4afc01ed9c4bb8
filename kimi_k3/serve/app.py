"""The server's Starlette app: it checks the caller and the request, hands each job to the
engine and answers in OpenAI's format, streamed or whole.

Every request is checked before it reaches the model: its framing (``Transfer-Encoding``
beside ``Content-Length`` is refused), the ``Host`` header against the bound address,
any ``Origin`` against ``--allowed-origins`` (none by default), the body's size, encoding
and JSON, and every field (``kimi_k3.serve.protocol``). A refusal is OpenAI-style JSON
``{"error": {"message", "type", "param", "code"}}`` with the status that fits. The server
never opens a URL or a file named by a request: image parts are refused, the model is
text-only. A client that goes away cancels its sequence.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``"stream": true``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from mlx_lm.sample_utils import make_logits_processors
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kimi_k3.serve.engine import Failure, QueueFull, Sampling, Sequence
from kimi_k3.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Job,
    Limits,
    Outcome,
    ReplyText,
    StreamChunks,
    chat_job,
    completion_job,
    parse_request,
    quote,
    response_body,
)
from kimi_k3.text.tokenizer import stop_ids

log = logging.getLogger("kimi_k3.server")


@dataclass
class ServerState:
    """What every request shares."""

    engine: object
    tokenizer: object
    model_id: str
    limits: Limits
    max_body: int
    allowed_hosts: set[str] | None
    allowed_origins: set[str]
    created: int = field(default_factory=lambda: int(time.time()))
    stop_ids: frozenset = field(init=False)  # the ids that end every reply

    def __post_init__(self):
        self.stop_ids = frozenset(stop_ids(self.tokenizer))

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins


# The caller: framing, Host, Origin, CORS.


class Guard:
    """ASGI middleware run before any route: refuses ambiguous framing, a ``Host`` that
    does not name this server and an ``Origin`` not allowed (a web page the user opens
    cannot reach the server, DNS rebinding included); answers CORS preflights; adds the
    CORS headers an allowed origin needs."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        path = scope["path"]
        if len(path) > 1 and path.endswith("/"):  # /v1/models/ is /v1/models
            scope = {**scope, "path": path.rstrip("/") or "/"}
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value.decode("latin-1"))
        origin = headers.get(b"origin")
        cors = self.cors_headers(origin)
        try:
            self.check(headers, origin)
        except ApiError as e:
            close = {"connection": "close"} if e.code == "ambiguous_framing" else {}
            return await error_json(e, {**cors, **close})(scope, receive, send)
        if scope["method"] == "OPTIONS":
            return await self.preflight(origin, cors)(scope, receive, send)

        async def send_logged(message):
            if message["type"] == "http.response.start":
                log.info("%s %s -> %d", scope["method"], quote(scope["path"]), message["status"])
                extra = [(k.encode(), v.encode()) for k, v in cors.items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_logged)

    def check(self, headers: dict, origin: str | None):
        if b"transfer-encoding" in headers and b"content-length" in headers:
            raise ApiError(
                400,
                "Transfer-Encoding and Content-Length together are ambiguous framing",
                code="ambiguous_framing",
            )
        hosts, host = self.state.allowed_hosts, headers.get(b"host")
        if hosts is not None and host is not None and host_of(host) not in hosts:
            raise ApiError(403, f"Host {quote(host)} is not this server (--allowed-hosts)")
        if origin is not None and not self.state.origin_allowed(origin):
            raise ApiError(403, f"Origin {quote(origin)} is not allowed (--allowed-origins)")

    def cors_headers(self, origin: str | None) -> dict[str, str]:
        if origin is None or not self.state.origin_allowed(origin):
            return {}
        return {"access-control-allow-origin": origin, "vary": "Origin"}

    def preflight(self, origin: str | None, cors: dict) -> Response:
        if origin is None:
            error = ApiError(403, "cross-origin requests are not allowed (--allowed-origins)")
            return error_json(error)
        allow = {
            "access-control-allow-methods": "GET, POST, OPTIONS",
            "access-control-allow-headers": "Content-Type, Authorization",
        }
        return Response(status_code=204, headers={**cors, **allow})


def error_json(error: ApiError, headers: dict | None = None) -> JSONResponse:
    log.info("refused (%d): %s", error.status, quote(error.message))
    retry = {"retry-after": "1"} if error.status == 429 else {}
    return JSONResponse(error.body(), error.status, headers={**retry, **(headers or {})})


# Routes.


def app_for(state: ServerState) -> Starlette:
    """The ASGI app serving ``state``'s model."""

    async def health(request: Request):
        running, waiting = state.engine.load()
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting})

    def card() -> dict:
        return {
            "id": state.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "kimi_k3",
        }

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [card()]})

    async def model(request: Request):
        check_model(state, request.path_params["name"])
        return JSONResponse(card())

    async def chat(request: Request):
        return await generate(request, ChatRequest, chat_job)

    async def completions(request: Request):
        return await generate(request, CompletionRequest, completion_job)

    async def generate(request: Request, kind, make_job) -> Response:
        raw = await read_body(request, state.max_body)
        job = await run_in_threadpool(checked_job, state, raw, kind, make_job)
        return Generation(job, state)

    async def refused(request: Request, exc: Exception):
        if isinstance(exc, ApiError):  # an unread body closes the connection with it
            return error_json(exc, {"connection": "close"} if exc.status in (411, 413) else {})
        if exc.status_code == 404:
            path = f"{request.method} {quote(request.url.path)}"
            return error_json(ApiError(404, f"no such path: {path}"))
        return error_json(ApiError(exc.status_code, f"{request.method}: {exc.detail}"))

    async def failed(request: Request, exc: Exception):
        return error_json(ApiError(500, f"internal error: {type(exc).__name__}"))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    handlers = {ApiError: refused, HTTPException: refused, Exception: failed}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.router.redirect_slashes = False
    return Guard(app, state)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused unless a ``Content-Length`` announces it within ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is None:
        raise ApiError(411, "a Content-Length header is required")
    if int(length) > limit:  # h11 has checked it is digits
        raise ApiError(
            413,
            f"the body is {length} bytes; the limit is {limit} (--max-body-mb)",
        )
    try:
        return await request.body()
    except ClientDisconnect:
        raise ApiError(400, "the client closed the connection before sending its body") from None


def checked_job(state: ServerState, raw: bytes, kind, make_job) -> Job:
    """The body checked by the request model ``kind``, as the engine's job (in a worker
    thread: parsing and tokenising a large body does not hold up other connections)."""
    req = parse_request(kind, raw, state.limits)
    if req.model is not None:
        check_model(state, req.model)
    return make_job(req, state.tokenizer, state.limits)


def check_model(state: ServerState, name: str):
    if name != state.model_id:
        raise ApiError(
            404,
            f"model {quote(name)} does not exist; this server serves {state.model_id!r}",
            "model",
            "model_not_found",
        )


# Generation.


class Events:
    """A sequence's engine events, handed from the engine's thread to the event loop.
    ``each``: wake the loop at every token (streams, stop strings); else only at the end.
    A wake-up already on its way to the loop takes the events put before it runs: the
    engine's thread asks for another only once the loop has taken it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, each: bool):
        self.loop, self.each = loop, each
        self.items: deque = deque()
        self.ready = asyncio.Event()
        self.waking = False  # a wake-up is on its way to the loop

    def put(self, item):  # the engine's thread
        self.items.append(item)
        if (self.each or item[0] != "token") and not self.waking:
            self.waking = True
            try:
                self.loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop has closed: the server is stopping
                pass

    def _wake(self):  # the loop's thread
        self.waking = False
        self.ready.set()

    async def __aiter__(self):
        """Events until the last (``done`` or ``error``)."""
        while True:
            await self.ready.wait()
            self.ready.clear()
            while self.items:
                item = self.items.popleft()
                yield item
                if item[0] != "token":
                    return


class Generation(Response):
    """The reply to one job: submitted to the engine when the response starts, sent whole
    or as server-sent events; the sequence is cancelled when the client goes away."""

    def __init__(self, job: Job, state: ServerState):
        super().__init__()
        self.job, self.state = job, state
        self.events = Events(asyncio.get_running_loop(), each=job.stream or bool(job.stop))
        self.seq = make_sequence(job, state, self.events)
        try:
            state.engine.submit(self.seq)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy ({e}); retry later") from None

    async def __call__(self, scope, receive, send):
        watch = asyncio.create_task(self.watch(receive))
        try:
            if self.job.stream:
                await self.stream(send)
            else:
                await (await self.whole())(scope, receive, send)
        finally:
            self.seq.cancel()  # a no-op once finished; stops the work of a vanished client
            watch.cancel()

    async def watch(self, receive):
        while (await receive())["type"] != "http.disconnect":
            pass
        self.seq.cancel()

    async def whole(self) -> Response:
        job = self.job
        reply = ReplyText(job, self.state.tokenizer)
        finish = "length"
        async for kind, value in self.events:
            if kind == "error":
                return error_json(failure_error(value))
            if kind == "done":
                finish = value
            elif job.stop:  # stop strings are looked for as the text grows
                reply.add(value)
                if reply.stopped:
                    self.seq.cancel()
            else:
                reply.ids.append(value)
        reply.update()
        seq = self.seq
        outcome = Outcome(
            reply,
            finish,
            len(seq.tokens),
            seq.reused,
            tokens=seq.tokens,
            token_logprobs=seq.token_logprobs,
            prompt_logprobs=seq.prompt_token_logprobs,
            stop_ids=seq.stop_ids,
        )
        body = response_body(job, outcome, self.state.model_id, self.state.tokenizer)
        return JSONResponse(body)

    async def stream(self, send):
        job = self.job
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def sse(body: dict | bytes):
            data = body if isinstance(body, bytes) else f"data: {json.dumps(body)}\n\n".encode()
            await send({"type": "http.response.body", "body": data, "more_body": True})

        chunks = StreamChunks(job, self.state.model_id)
        reply = ReplyText(job, self.state.tokenizer)
        if job.chat:
            await sse(chunks.chat({"role": "assistant", "content": ""}))
        finish = "length"
        async for kind, value in self.events:
            if kind == "error":
                await sse(failure_error(value).body())
                break
            if kind == "done":
                finish = value
                continue
            reply.add(value)
            for delta in chunks.deltas(reply):
                await sse(delta)
            if reply.stopped:
                self.seq.cancel()
        outcome = Outcome(reply, finish, len(self.seq.tokens), self.seq.reused)
        for chunk in chunks.final(outcome):
            await sse(chunk)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def failure_error(failure: Failure) -> ApiError:
    """The refusal of a sequence that ended in error (``kimi_k3.serve.engine.Failure``):
    its own field at fault (400), its own processor (500), or a step it was in (503)."""
    if failure.status < 500:
        return ApiError(failure.status, failure.message, failure.param)
    return ApiError(failure.status, f"generation failed: {failure.message}")


def make_sequence(job: Job, state: ServerState, events: Events):
    """The engine's sequence for ``job``, its events going to ``events`` (the engine keeps
    reserved ids out of every reply: ``serve_model``)."""
    s = job.sampling
    processors = make_logits_processors(  # after logit_bias, which the engine adds
        presence_penalty=s["presence_penalty"] or None,
        frequency_penalty=s["frequency_penalty"] or None,
    )
    sampling = Sampling(s["temp"], s["top_p"], s["min_p"], s["top_k"], s["seed"])
    if job.constraint is not None:  # after logit_bias and penalties: it has the last word
        processors = [*processors, job.constraint]
    return Sequence(
        prompt=job.prompt,
        max_tokens=job.max_tokens,
        sampling=sampling,
        processors=processors,
        stop_ids=state.stop_ids,
        logit_bias=job.logit_bias or None,
        out=events,
        logprobs=job.logprobs,
        prompt_logprobs=job.logprobs if job.echo else None,
    )


def host_of(header: str) -> str:
    """The host name of a ``Host`` header value, without port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_hosts(bound: str, extra: list[str]) -> set[str] | None:
    """Host names a request may name: the bound address (with ``localhost`` and the
    loopback addresses for a loopback bind) plus ``extra``; None (any) for a wildcard bind
    without ``extra``."""
    names = {h.lower() for h in extra}
    try:
        ip = ipaddress.ip_address(bound)
    except ValueError:
        return names | {bound.lower()}
    if ip.is_unspecified:
        return names or None
    if ip.is_loopback:
        names |= {"localhost", "127.0.0.1", "::1"}
    return names | {str(ip)}
