"""``python -m kimi_k3.server``: an OpenAI-compatible HTTP server for Kimi K3.

The port is bound first (a port in use fails before the model loads), then the one
checkpoint given is loaded with ``kimi_k3.load``; requests are served by
``kimi_k3.serve.engine.Engine`` (continuous batching, chunked prefill, prefix reuse), which
runs in the main thread while uvicorn serves HTTP from a thread of its own.

The layers are separate modules: connections (uvicorn's h11 protocol with header and
body deadlines, a bound on open connections and JSON refusals of malformed HTTP) in
``kimi_k3.serve.http``; the OpenAI protocol (pydantic request models, replies) in
``kimi_k3.serve.protocol``; here, the command line and the Starlette app that checks the
caller, reads the body and hands the job to the engine.

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

import argparse
import asyncio
import errno
import ipaddress
import json
import logging
import math
import resource
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_logits_processors
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kimi_k3 import distributed
from kimi_k3.checkpoint.files import CheckpointError
from kimi_k3.cli import (
    INTERRUPTED,
    USAGE_ERROR,
    ArgumentError,
    HelpFormatter,
    Parser,
    UserError,
    add_model_arguments,
    add_sampling_arguments,
    check_model_arguments,
    check_sampling_arguments,
    context_limit,
    fail,
    load_for_cli,
    never_sample,
    positive,
    ram_gb,
    resolve_model,
    trimming_options,
)
from kimi_k3.model.config import ConfigError
from kimi_k3.serve.engine import Engine, QueueFull, Sampling, Sequence, activation_dtype, follow
from kimi_k3.serve.http import ConnectionLimits, protocol_class
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
from kimi_k3.streaming.store import find_streamer, overflow_for_batch

log = logging.getLogger("kimi_k3.server")

DEMO_MODEL_ID = "kimi-k3-demo"
FD_RESERVE = 128  # descriptors kept for the checkpoint's files, logs and the engine


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
    ``each``: wake the loop at every token (streams, stop strings); else only at the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, each: bool):
        self.loop, self.each = loop, each
        self.items: deque = deque()
        self.ready = asyncio.Event()

    def put(self, item):  # the engine's thread
        self.items.append(item)
        if self.each or item[0] != "token":
            try:
                self.loop.call_soon_threadsafe(self.ready.set)
            except RuntimeError:  # the loop has closed: the server is stopping
                pass

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
                return error_json(ApiError(503, f"generation failed: {value}"))
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
                await sse(ApiError(503, f"generation failed: {value}").body())
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


def make_sequence(job: Job, state: ServerState, events: Events):
    """The engine's sequence for ``job``, its events going to ``events`` (the engine keeps
    reserved ids out of every reply: ``serve_model``)."""

    s = job.sampling
    processors = make_logits_processors(
        logit_bias=job.logit_bias or None,
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
        stop_ids=frozenset(state.tokenizer.eos_token_ids),
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


# Command line.

# The server's limits: flag, type, default, help.
LIMIT_FLAGS = [
    ("--max-tokens", int, 512, "max_tokens of a request that omits it"),
    ("--max-tokens-limit", int, 8192, "the largest max_tokens a request may ask"),
    (
        "--max-context",
        int,
        None,
        "prompt + reply tokens of one request (default: the model's max_position_embeddings)",
    ),
    ("--max-body-mb", float, 1.0, "largest request body, in MB"),
    ("--max-batch", int, 8, "sequences decoded together"),
    ("--max-waiting", int, 32, "requests queued beyond the batch (then 429)"),
    ("--prefill-step-size", int, 512, "prompt tokens prefilled per step, in all"),
    (
        "--prefill-step-seconds",
        float,
        0.5,
        "a prompt's prefill pass takes about this long at most (its chunk sized by its "
        "measured rate), so a request arriving meanwhile waits little (0: chunks of "
        "--prefill-step-size whatever they take)",
    ),
    (
        "--max-prompt-tokens",
        int,
        None,
        "the longest prompt a request may send (default: what a quarter of the memory the "
        "model leaves holds in caches for --max-batch sequences, at most the context)",
    ),
    (
        "--prompt-cache-gb",
        float,
        1.0,
        "GB of cache snapshots kept for prefix reuse across requests (0: none)",
    ),
    (
        "--max-connections",
        int,
        512,
        "open connections; one more closes the one idle the longest, or is answered 503 "
        "when every one has a request in progress",
    ),
    (
        "--timeout-headers",
        float,
        10.0,
        "seconds a request's line and headers may take to arrive (then 408, closed)",
    ),
    (
        "--timeout-body",
        float,
        30.0,
        "seconds a request's body may take to arrive after its headers (then 408, closed)",
    ),
    (
        "--timeout-write",
        float,
        30.0,
        "seconds a reply may wait on a client that reads none of it (then the connection drops)",
    ),
    ("--timeout-keep-alive", float, 5.0, "seconds an idle connection stays open between requests"),
]


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m kimi_k3.server",
        description="An OpenAI-compatible HTTP server for Kimi K3.",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(p)
    p.add_argument(
        "--expert-overflow",
        type=int,
        default=None,
        help="streamed experts: experts a batch's step may read past a layer's cache slots in "
        "one round, into working memory beside the expert cache (default: what --max-batch "
        "sequences can need; 0: none, such a step reads in rounds of the slots)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; another than loopback exposes an unauthenticated server",
    )
    p.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free port)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id in /v1/models and replies (default: the checkpoint directory's "
        f"name, {DEMO_MODEL_ID!r} for the demo model)",
    )
    p.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default for chat requests (default: on; off for the demo model, which has no "
        "chat training, so its text comes back as content); a request overrides it with "
        '"chat_template_kwargs": {"thinking": false}',
    )
    for flag, kind, default, text in LIMIT_FLAGS:
        p.add_argument(flag, type=kind, default=default, help=text)
    add_sampling_arguments(p, seed=False, defaults_for="for requests without the field")
    for flag, what in (
        (
            "--allowed-origins",
            "web origins allowed to call the server (CORS); '*' for any (default: none)",
        ),
        (
            "--allowed-hosts",
            "extra host names a request's Host header may name (default: "
            "the bound address; localhost too for a loopback bind)",
        ),
    ):
        p.add_argument(flag, type=comma_list, default=[], help=f"comma-separated {what}")
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level",
    )
    distributed.add_arguments(p)
    return p


def comma_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def check_arguments(args):
    """``UserError`` naming the flag of the first invalid value."""
    check_model_arguments(args)
    check_sampling_arguments(args)
    for name in (
        "max_tokens",
        "max_tokens_limit",
        "max_context",
        "max_batch",
        "prefill_step_size",
        "max_prompt_tokens",
    ):
        positive(args, name)
    if not (math.isfinite(args.prefill_step_seconds) and args.prefill_step_seconds >= 0):
        raise UserError(
            f"--prefill-step-seconds must be 0 or more seconds, got {args.prefill_step_seconds}"
        )
    if args.max_tokens > args.max_tokens_limit:
        raise UserError(
            f"--max-tokens {args.max_tokens} is above --max-tokens-limit {args.max_tokens_limit}"
        )
    if args.max_waiting < 0:
        raise UserError(f"--max-waiting must be at least 0, got {args.max_waiting}")
    if not args.max_body_mb > 0:
        raise UserError(f"--max-body-mb must be above 0, got {args.max_body_mb}")
    if not args.prompt_cache_gb >= 0:
        raise UserError(f"--prompt-cache-gb must be at least 0, got {args.prompt_cache_gb}")
    if args.expert_overflow is not None and args.expert_overflow < 0:
        raise UserError(f"--expert-overflow must be at least 0, got {args.expert_overflow}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be from 0 to 65535, got {args.port}")
    positive(args, "max_connections")
    for name in ("timeout_headers", "timeout_body", "timeout_write", "timeout_keep_alive"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"--{name.replace('_', '-')} must be above 0 seconds, got {value}")


def reserve_descriptors(max_connections: int):
    """Raise the soft limit on open files to what ``--max-connections`` needs (with
    ``FD_RESERVE`` to spare); ``UserError`` if the hard limit is below it."""
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ArgumentError(
                f"--max-connections {max_connections} needs {need} open files, but this "
                f"process may open {hard} at most (its hard limit, which importing mlx-lm "
                "sets to 4096); lower --max-connections"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (IPv4 or IPv6); ``UserError`` naming both if
    the address cannot be bound. uvicorn serves it once the model is up."""
    sock = None
    try:
        family, kind, proto = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][:3]
        # proto named (TCP): asyncio then sets TCP_NODELAY on each connection, so a reply's
        # body or a stream's event is not held back waiting for the client's delayed ACK
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        return sock
    except OSError as e:
        if sock is not None:
            sock.close()
        why = (
            "is already in use"
            if e.errno == errno.EADDRINUSE
            else f"cannot be bound ({e.strerror or e})"
        )
        raise UserError(f"--host {host} --port {port}: the address {why}") from None


def size_overflow(model, args):
    """Give streamed experts the overflow area ``--expert-overflow`` asks for (default: what
    ``--max-batch`` sequences can need, ``overflow_for_batch``), announced on stderr."""

    streamer = find_streamer(model)
    if streamer is None:
        return
    n = args.expert_overflow
    streamer.set_overflow(overflow_for_batch(streamer, args.max_batch) if n is None else n)
    info = streamer.stats.info
    if info["overflow_experts"]:
        print(
            f"expert overflow area: {info['overflow_experts']} experts "
            f"({info['overflow_bytes'] / 1e6:.3g} MB) beside the cache",
            file=sys.stderr,
        )


def cache_bytes_per_token(model) -> int:
    """Bytes one token adds to a sequence's caches: each MLA layer's latent and shared key
    in the activation dtype (KDA layers hold a fixed state, whatever the length)."""

    a = model.args
    mla = sum(not layer.is_linear for layer in model.layers)
    return mla * (a.kv_lora_rank + a.qk_rope_head_dim) * activation_dtype(model).size


def default_max_prompt(model, context: int, sequences: int, expert_cache_gb) -> int:
    """The longest prompt whose caches fit, for ``sequences`` sequences at once, in a
    quarter of the memory that the model's resident weights and expert cache leave: at
    least 1, at most one less than ``context`` (the reply needs a token)."""

    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    left = ram_gb() * 1e9 - weights - (expert_cache_gb or 0) * 1e9
    fit = int(max(left, 0) / 4 / sequences / max(cache_bytes_per_token(model), 1))
    return max(1, min(context - 1, fit))


def serve_model(args, sock: socket.socket, plan=None) -> ServerState:
    """Load the model and start the engine for an already bound server (on rank 0 of
    ``plan``'s group under ``--split``)."""

    model_path = args.model
    args.model, args.expert_cache_gb = resolve_model(args.model, args.expert_cache_gb)
    model, tokenizer = load_for_cli(
        args.model, args.expert_cache_gb, args.verify, plan=plan, **trimming_options(args)
    )
    size_overflow(model, args)
    engine = Engine(
        model,
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        prefill_step_size=args.prefill_step_size,
        reuse_bytes=int(args.prompt_cache_gb * 1e9),
        start=False,
        group=plan.group if plan else None,
        processors=[never_sample(tokenizer)],
        prefill_step_seconds=args.prefill_step_seconds or None,
    )
    context = context_limit(model, args.max_context)[0]
    max_prompt, why = args.max_prompt_tokens, "--max-prompt-tokens"
    if max_prompt is None:
        max_prompt = default_max_prompt(model, context, args.max_batch, args.expert_cache_gb)
        why = f"a quarter of the memory the model leaves, over {args.max_batch} sequences"
    print(f"prompts of at most {max_prompt:,} tokens ({why})", file=sys.stderr)
    limits = Limits(
        max_prompt=max_prompt,
        context=context,
        vocab=model.args.vocab_size,
        max_tokens=args.max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        thinking=args.thinking if args.thinking is not None else model_path is not None,
    )
    name = args.served_model_name or (Path(model_path).name if model_path else DEMO_MODEL_ID)
    return ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_id=name,
        limits=limits,
        max_body=int(args.max_body_mb * 1e6),
        allowed_hosts=allowed_hosts(sock.getsockname()[0], args.allowed_hosts),
        allowed_origins=set(args.allowed_origins),
    )


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    try:
        check_arguments(args)
    except UserError as e:
        return fail(str(e), USAGE_ERROR)
    try:
        reserve_descriptors(args.max_connections)
        plan = distributed.from_args(args)
        if plan is not None and plan.rank != 0:
            return follow_rank(args, plan)
        with distributed.agreed(plan):  # a port in use ends every rank, before loading
            sock = bind(args.host, args.port)
        state = serve_model(args, sock, plan)
    except (UserError, ConfigError, CheckpointError, OSError, distributed.DistributedError) as e:
        return fail(str(e), USAGE_ERROR if isinstance(e, ArgumentError) else 1)
    except KeyboardInterrupt:
        return INTERRUPTED
    server = http_server_for(args, state)
    host, port = sock.getsockname()[:2]
    print(f"serving {state.model_id!r} on http://{host}:{port}", file=sys.stderr, flush=True)
    http_thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="kimi-k3-http", daemon=True
    )
    http_thread.start()
    try:
        state.engine.run()  # in the main thread, until Ctrl-C
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = server.force_exit = True  # requests in progress are dropped
        http_thread.join(timeout=30)
        sock.close()
        state.engine.release_peers()
    return 0


def http_server_for(args, state: ServerState):
    """uvicorn serving ``state``'s app with the connection limits of ``args``."""

    limits = ConnectionLimits(
        headers=args.timeout_headers,
        body=args.timeout_body,
        write=args.timeout_write,
        max_connections=args.max_connections,
    )
    config = uvicorn.Config(
        app_for(state),
        http=protocol_class(limits),
        loop="asyncio",
        lifespan="off",
        log_config=None,
        access_log=False,  # Guard logs each request, its path quoted short
        proxy_headers=False,
        ws="none",  # no WebSocket upgrades: every connection stays on Connection
        timeout_keep_alive=args.timeout_keep_alive,
        server_header=False,
    )
    return uvicorn.Server(config)


def follow_rank(args, plan) -> int:
    """A rank other than 0 under ``--split``: load its share, agree on the port, then
    repeat rank 0's forward passes (``kimi_k3.serve.engine.follow``) until rank 0 stops."""

    with distributed.agreed(plan):  # rank 0 binds the port here
        pass
    path, budget = resolve_model(args.model, args.expert_cache_gb)
    model, _ = load_for_cli(path, budget, args.verify, plan, **trimming_options(args))
    size_overflow(model, args)
    try:
        follow(model, plan.group)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
