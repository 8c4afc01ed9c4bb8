"""``python -m kimi_k3.server``: an OpenAI-compatible HTTP server for Kimi K3.

The port is bound first (a port in use fails before the model loads), then the one
checkpoint given is loaded with ``kimi_k3.load``; requests are served by
``kimi_k3.serving.Engine`` (continuous batching, chunked prefill, prefix reuse).

Every request is checked before it reaches the model: the ``Host`` header against the
bound address, any ``Origin`` against ``--allowed-origins`` (none by default), the body's
size, encoding and JSON, and every field (token ids against the vocabulary, messages,
limits against the context). A refusal is OpenAI-style JSON
``{"error": {"message", "type", "param", "code"}}`` with the status that fits. The server
never opens a URL or a file named by a request: image parts are refused, the model is
text-only. Replies are parsed from token ids (``kimi_k3.chat.parse_reply``), so marker
spellings the model writes as plain text stay text.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``"stream": true``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import logging
import math
import queue
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kimi_k3 import distributed
from kimi_k3.chat import ReplyStream, encode_chat
from kimi_k3.checkpoint import CheckpointError
from kimi_k3.config import ConfigError
from kimi_k3.generate import (
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
    fail,
    load_for_cli,
    never_sample,
    positive,
    resolve_model,
    trimming_options,
)

log = logging.getLogger("kimi_k3.server")

DEMO_MODEL_ID = "kimi-k3-demo"
ROLES = ("system", "user", "assistant", "tool")
LOG_PREFIX = 200  # characters of a request line or body quoted in a log line
MAX_STOP = 4
MAX_SEED = 2**63 - 1  # OpenAI's seed is a 64-bit integer; MLX keys take it unsigned


class ApiError(Exception):
    """A refused request: its HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        return {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def quote(text: str | bytes) -> str:
    """At most ``LOG_PREFIX`` characters of ``text``, for logs."""
    if isinstance(text, bytes):
        text = text[:LOG_PREFIX].decode("utf-8", "replace")
    return repr(text[:LOG_PREFIX]) + ("..." if len(text) > LOG_PREFIX else "")


# Request fields.


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def number_field(body: dict, name: str, default, low: float, high: float, integer=False):
    """``body[name]`` (or ``default``) checked to lie in ``[low, high]``."""
    v = body.get(name)
    if v is None:
        return default
    if not (_is_int(v) if integer else _is_number(v)) or not low <= v <= high:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"{name} must be {kind} from {low} to {high}, got {v!r}", name)
    return v


def token_id(v, vocab: int, param: str) -> int:
    """``v`` as a token id in ``[0, vocab)``; ids outside the vocabulary are refused."""
    if isinstance(v, str) and v.lstrip("-").isdigit():
        v = int(v)
    if not _is_int(v) or not 0 <= v < vocab:
        raise ApiError(400, f"{param}: {v!r} is not a token id (0..{vocab - 1})", param)
    return v


def logit_bias_field(body: dict, vocab: int) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ApiError(400, "logit_bias must be an object of token id -> bias", "logit_bias")
    out = {}
    for key, value in bias.items():
        tid = token_id(key, vocab, "logit_bias")
        if not _is_number(value) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{key}]: bias must be from -100 to 100", "logit_bias")
        out[tid] = float(value)
    return out


def stop_field(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise ApiError(400, f"stop must be a string or up to {MAX_STOP} non-empty strings", "stop")
    return stop


@dataclass
class Limits:
    """What the server allows: its context, reply lengths, vocabulary, defaults."""

    context: int
    vocab: int
    max_tokens: int
    max_tokens_limit: int
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    thinking: bool = True


@dataclass
class Job:
    """A checked generation request."""

    prompt: list[int]
    max_tokens: int
    sampling: dict
    logit_bias: dict[int, float]
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool
    thinking: bool = True


def common_fields(body: dict, limits: Limits) -> dict:
    """Sampling, stop, stream and length fields shared by both endpoints."""
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: one choice per request", "n")
    if body.get("logprobs"):
        raise ApiError(400, "logprobs are not supported", "logprobs")
    for name in ("stream",):
        if not isinstance(body.get(name, False), bool):
            raise ApiError(400, f"{name} must be true or false", name)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return dict(
        max_tokens=number_field(body, name, limits.max_tokens, 1, limits.max_tokens_limit, True),
        sampling=dict(
            temp=number_field(body, "temperature", limits.temp, 0, 2),
            top_p=number_field(body, "top_p", limits.top_p, 0, 1),
            top_k=number_field(body, "top_k", limits.top_k, 0, limits.vocab, True),
            min_p=number_field(body, "min_p", limits.min_p, 0, 1),
            presence_penalty=number_field(body, "presence_penalty", 0.0, -2, 2),
            frequency_penalty=number_field(body, "frequency_penalty", 0.0, -2, 2),
            seed=number_field(body, "seed", None, 0, MAX_SEED, integer=True),
        ),
        logit_bias=logit_bias_field(body, limits.vocab),
        stop=stop_field(body),
        stream=body.get("stream", False),
        include_usage=bool(options.get("include_usage")),
    )


def fit_context(prompt: list[int], fields: dict, limits: Limits, param: str) -> dict:
    """Refuse a prompt that leaves no room in the context; cut ``max_tokens`` to fit."""
    if not prompt:
        raise ApiError(400, f"{param} is empty", param)
    room = limits.context - len(prompt)
    if room < 1:
        raise ApiError(
            400,
            f"the prompt is {len(prompt)} tokens, but the context holds {limits.context} "
            "(prompt and reply together)",
            param,
            "context_length_exceeded",
        )
    return dict(fields, max_tokens=min(fields["max_tokens"], room))


def check_content(content, where: str):
    """Text, or a list of text parts; anything else (images, audio, files) is refused."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: content must be a string or a list of parts", where)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"{where}[{j}]: {kind or type(part).__name__} parts are not supported: "
                "the model reads text only",
                f"{where}[{j}]",
            )


def check_messages(messages) -> list[dict]:
    """``messages`` as a non-empty list of known roles with text content (``developer``
    counts as ``system``)."""
    if not isinstance(messages, list):
        raise ApiError(400, "messages must be a list of message objects", "messages")
    if not messages:
        raise ApiError(400, "messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object", where)
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            known = ", ".join(ROLES + ("developer",))
            raise ApiError(400, f"{where}.role: unknown role {m.get('role')!r} ({known})", where)
        check_content(m.get("content"), f"{where}.content")
        out.append(dict(m, role=role))
    return out


def thinking_field(body: dict, default: bool) -> bool:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    value = kwargs.get("thinking", kwargs.get("enable_thinking", default))
    if not isinstance(value, bool):
        raise ApiError(400, "chat_template_kwargs.thinking must be true or false", "thinking")
    return value


def chat_job(body: dict, tokenizer, limits: Limits) -> Job:
    messages = check_messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ApiError(400, "tools must be a list of tool objects", "tools")
    fields = common_fields(body, limits)
    thinking = thinking_field(body, limits.thinking)
    try:
        prompt = encode_chat(tokenizer, messages, tools=tools or None, thinking=thinking)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ApiError(400, f"messages: {e}", "messages") from None
    return Job(
        prompt, chat=True, thinking=thinking, **fit_context(prompt, fields, limits, "messages")
    )


def completion_job(body: dict, tokenizer, limits: Limits) -> Job:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, list) and all(not isinstance(t, str) for t in prompt):
        ids = [token_id(t, limits.vocab, "prompt") for t in prompt]
    else:
        raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")
    fields = common_fields(body, limits)
    return Job(ids, chat=False, **fit_context(ids, fields, limits, "prompt"))


# Replies.


def usage(job: Job, generated: int, reused: int) -> dict:
    return {
        "prompt_tokens": len(job.prompt),
        "completion_tokens": generated,
        "total_tokens": len(job.prompt) + generated,
        "prompt_tokens_details": {"cached_tokens": reused},
    }


def tool_call_json(calls: list[dict]) -> list[dict]:
    return [
        {
            "index": i,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
        }
        for i, c in enumerate(calls)
    ]


class ReplyText(ReplyStream):
    """``ReplyStream`` with the request's stop strings cutting ``content`` (at the first
    place one occurs, for good); ``stable`` also holds back text that may be the start of
    a stop string. Each token's text is searched where a new occurrence can be: from the
    longest stop string's length before the new text."""

    def __init__(self, job: Job, tokenizer):
        self.stop = job.stop
        self.longest = max(map(len, self.stop), default=0)
        self.stopped = False
        self.checked = 0  # content before this index holds no stop string
        super().__init__(tokenizer, job.thinking, job.chat)
        self.field("content").watch("stop")

    def changed(self):
        content = self.field("content")
        low = content.rewritten("stop")
        if self.stopped or not self.stop:
            return
        if low is not None:
            self.checked = min(self.checked, low)
        start = max(0, self.checked - self.longest + 1)
        text = content.since(start)
        cut = None
        for s in self.stop:  # each in what the ones before it left
            if (at := text[:cut].find(s)) >= 0:
                cut = at
        if cut is None:
            self.checked = content.length
        else:
            content.cut(start + cut)
            self.stopped = True

    def update(self):
        self.stopped, self.checked = False, 0
        super().update()

    def stable(self, text: str) -> str:
        if self.stopped:
            return text
        text = ReplyStream.stable(text)
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    return text[:-n]
        return text


@dataclass
class Outcome:
    reply: ReplyText
    finish: str
    generated: int
    reused: int


def finish_reason(outcome: Outcome) -> str:
    if outcome.reply.tool_calls:
        return "tool_calls"
    return "stop" if outcome.reply.stopped else outcome.finish


def chat_message(reply: ReplyText, job: Job) -> dict:
    message = {"role": "assistant", "content": reply.content}
    if job.thinking:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = tool_call_json(reply.tool_calls)
    return message


def response_body(job: Job, outcome: Outcome, model_id: str) -> dict:
    reason = finish_reason(outcome)
    if job.chat:
        choice = {"index": 0, "message": chat_message(outcome.reply, job), "logprobs": None}
        kind, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": outcome.reply.content, "logprobs": None}
        kind, prefix = "text_completion", "cmpl"
    choice["finish_reason"] = reason
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model_id,
        "choices": [choice],
        "usage": usage(job, outcome.generated, outcome.reused),
    }


# The server.


@dataclass
class ServerState:
    """What every request handler shares."""

    engine: object
    tokenizer: object
    model_id: str
    limits: Limits
    max_body: int
    allowed_hosts: set[str] | None
    allowed_origins: set[str]
    created: int = field(default_factory=lambda: int(time.time()))


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


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kimi_k3"
    state: ServerState  # set on the subclass made by make_handler

    # Plumbing.

    def log_message(self, format, *args):
        log.info("%s %s", self.address_string(), quote(format % args))

    def send_json(self, status: int, body: dict, headers: dict | None = None):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self._cors_headers()
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, e: ApiError, headers: dict | None = None):
        log.info("refused (%d): %s", e.status, quote(e.message))
        self.send_json(e.status, e.body(), headers)

    def _cors_headers(self):
        origin = self.headers.get("Origin")
        if origin and self._origin_allowed(origin):
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")

    def _origin_allowed(self, origin: str) -> bool:
        allowed = self.state.allowed_origins
        return "*" in allowed or origin in allowed

    def check_caller(self):
        """The ``Host`` header must name this server and an ``Origin`` must be allowed:
        a web page the user opens cannot reach the server (DNS rebinding included)."""
        hosts, host = self.state.allowed_hosts, self.headers.get("Host")
        if hosts is not None and host is not None and host_of(host) not in hosts:
            raise ApiError(403, f"Host {quote(host)} is not this server (--allowed-hosts)")
        origin = self.headers.get("Origin")
        if origin is not None and not self._origin_allowed(origin):
            raise ApiError(403, f"Origin {quote(origin)} is not allowed (--allowed-origins)")

    def read_json(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise ApiError(411 if length is None else 400, "a Content-Length header is required")
        if int(length) > self.state.max_body:
            self.close_connection = True  # the body stays unread
            raise ApiError(
                413,
                f"the body is {length} bytes; the limit is {self.state.max_body} (--max-body-mb)",
            )
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ApiError(400, f"the body is not UTF-8 (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise ApiError(400, f"the body is not valid JSON: {e.msg} at {e.pos}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def handle_safely(self, route):
        try:
            self.check_caller()
            route()
        except ApiError as e:
            self.send_error_json(e, {"Retry-After": "1"} if e.status == 429 else None)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # Routes.

    def do_OPTIONS(self):
        origin = self.headers.get("Origin")
        if origin is None or not self._origin_allowed(origin):
            self.send_error_json(
                ApiError(403, "cross-origin requests are not allowed (--allowed-origins)")
            )
            return
        self.send_response(204)
        self._cors_headers()
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "Content-Type, Authorization")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self.handle_safely(self.route_get)

    def do_POST(self):
        self.handle_safely(self.route_post)

    def route_get(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            running, waiting = self.state.engine.load()
            self.send_json(200, {"status": "ok", "running": running, "waiting": waiting})
        elif path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [self.model_card()]})
        elif path.startswith("/v1/models/"):
            self.check_model(path[len("/v1/models/") :])
            self.send_json(200, self.model_card())
        else:
            raise ApiError(404, f"no such path: GET {quote(path)}")

    def route_post(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        make = {"/v1/chat/completions": chat_job, "/v1/completions": completion_job}.get(path)
        if make is None:
            raise ApiError(404, f"no such path: POST {quote(path)}")
        body = self.read_json()
        if body.get("model") is not None:
            self.check_model(body["model"])
        job = make(body, self.state.tokenizer, self.state.limits)
        self.generate(job)

    def model_card(self) -> dict:
        return {
            "id": self.state.model_id,
            "object": "model",
            "created": self.state.created,
            "owned_by": "kimi_k3",
        }

    def check_model(self, name):
        if name != self.state.model_id:
            raise ApiError(
                404,
                f"model {quote(str(name))} does not exist; this server serves "
                f"{self.state.model_id!r}",
                "model",
                "model_not_found",
            )

    # Generation.

    def generate(self, job: Job):
        from kimi_k3.serving import QueueFull

        seq = make_sequence(job, self.state)
        try:
            self.state.engine.submit(seq)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy ({e}); retry later") from None
        try:
            if job.stream:
                self.stream(job, seq)
            else:
                outcome = self.collect(job, seq)
                self.send_json(200, response_body(job, outcome, self.state.model_id))
        finally:
            seq.cancel()  # a no-op once finished; stops the work of a vanished client

    def events(self, seq, whole: bool = False):
        """The sequence's events; cancels it when the client goes away. ``whole``: wait
        for the end, then give them all (no wake-up per token)."""
        while whole and not seq.ended.wait(0.2):
            self._check_client(seq)
        while True:
            try:
                kind, value = seq.out.get(timeout=0.2)
            except queue.Empty:
                self._check_client(seq)
                continue
            yield kind, value
            if kind != "token":
                return

    def _check_client(self, seq):
        if self.client_gone():
            seq.cancel()
            raise ConnectionResetError("client disconnected") from None

    def client_gone(self) -> bool:
        conn = self.connection
        try:
            readable, _, _ = select.select([conn], [], [], 0)
            return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def collect(self, job: Job, seq) -> Outcome:
        reply = ReplyText(job, self.state.tokenizer)
        finish = "length"
        for kind, value in self.events(seq, whole=not job.stop):
            if kind == "error":
                raise ApiError(503, f"generation failed: {value}")
            if kind == "done":
                finish = value
            elif job.stop:  # stop strings are looked for as the text grows
                reply.add(value)
                if reply.stopped:
                    seq.cancel()
            else:
                reply.ids.append(value)
        reply.update()
        return Outcome(reply, finish, len(seq.tokens), seq.reused)

    def stream(self, job: Job, seq):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self._cors_headers()
        self.end_headers()
        self.close_connection = True
        chunks = StreamChunks(job, self.state.model_id)
        reply = ReplyText(job, self.state.tokenizer)
        if job.chat:
            self.sse(chunks.chat({"role": "assistant", "content": ""}))
        finish = "length"
        for kind, value in self.events(seq):
            if kind == "error":
                self.sse(ApiError(503, f"generation failed: {value}").body())
                break
            if kind == "done":
                finish = value
                continue
            reply.add(value)
            for delta in chunks.deltas(reply):
                self.sse(delta)
            if reply.stopped:
                seq.cancel()
        outcome = Outcome(reply, finish, len(seq.tokens), seq.reused)
        for chunk in chunks.final(outcome):
            self.sse(chunk)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def sse(self, body: dict):
        self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
        self.wfile.flush()


class StreamChunks:
    """The SSE chunks of one streamed reply: deltas of what became stable, then the end."""

    def __init__(self, job: Job, model_id: str):
        self.job, self.model_id = job, model_id
        self.id = f"{'chatcmpl' if job.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent = {"reasoning_content": Sent(), "content": Sent()}

    def _chunk(self, choice: dict | None, **extra) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.job.chat else "text_completion",
            "created": self.created,
            "model": self.model_id,
            "choices": [] if choice is None else [choice],
            **extra,
        }

    def chat(self, delta: dict, reason=None) -> dict:
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason})

    def text(self, text: str, reason=None) -> dict:
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": reason})

    def deltas(self, reply: ReplyText, final: bool = False) -> list[dict]:
        out = []
        for key, name in (("reasoning_content", "reasoning"), ("content", "content")):
            piece = self.sent[key].next(reply, name, final)
            if piece:
                out.append(self.chat({key: piece}) if self.job.chat else self.text(piece))
        return out

    def final(self, outcome: Outcome) -> list[dict]:
        out = self.deltas(outcome.reply, final=True)
        reason = finish_reason(outcome)
        if self.job.chat:
            calls = tool_call_json(outcome.reply.tool_calls)
            out.append(self.chat({"tool_calls": calls} if calls else {}, reason))
        else:
            out.append(self.text("", reason))
        if self.job.include_usage:
            out.append(self._chunk(None, usage=usage(self.job, outcome.generated, outcome.reused)))
        return out


class Sent:
    """What a stream has sent of one reply field. A delta is the field's stable text
    (``ReplyText.stable``; all of it at the end) past what was sent, when that extends
    what was sent. While the field only grows, that needs only its text since the sent
    part (less the longest stop string, which ``stable`` looks back over); after a
    rewrite below the sent part, the whole text is compared."""

    def __init__(self):
        self.pieces: list[str] = []
        self.length = 0
        self.suspect = False  # the field was rewritten before the sent part's end
        self.watching = None

    def next(self, reply: ReplyText, name: str, final: bool) -> str:
        field = reply.field(name)
        if self.watching is not field:
            field.watch("stream")
            self.watching = field
        low = field.rewritten("stream")
        self.suspect = self.suspect or (low is not None and low < self.length)
        start = 0 if self.suspect else max(0, self.length - max(reply.longest - 1, 0))
        text = field.since(start)
        value = text if final else reply.stable(text)
        if len(value) <= self.length - start:
            return ""
        if self.suspect:
            if not value.startswith("".join(self.pieces)):
                return ""
            self.suspect = False
        piece = value[self.length - start :]
        self.pieces.append(piece)
        self.length += len(piece)
        return piece


def make_sequence(job: Job, state: ServerState):
    """The engine's sequence for ``job`` (the engine keeps reserved ids out of every reply:
    ``serve_model``)."""
    from mlx_lm.sample_utils import make_logits_processors

    from kimi_k3.serving import Sampling, Sequence

    s = job.sampling
    processors = make_logits_processors(
        logit_bias=job.logit_bias or None,
        presence_penalty=s["presence_penalty"] or None,
        frequency_penalty=s["frequency_penalty"] or None,
    )
    sampling = Sampling(s["temp"], s["top_p"], s["min_p"], s["top_k"], s["seed"])
    return Sequence(
        prompt=job.prompt,
        max_tokens=job.max_tokens,
        sampling=sampling,
        processors=processors,
        stop_ids=frozenset(state.tokenizer.eos_token_ids),
    )


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
        "--prompt-cache-gb",
        float,
        1.0,
        "GB of cache snapshots kept for prefix reuse across requests (0: none)",
    ),
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
        default=True,
        help="default for chat requests; a request overrides it with "
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
    for name in ("max_tokens", "max_tokens_limit", "max_context", "max_batch", "prefill_step_size"):
        positive(args, name)
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


def bind(host: str, port: int) -> ThreadingHTTPServer:
    """A server bound to ``host``:``port`` (IPv4 or IPv6); ``UserError`` naming both if the
    address cannot be bound. Its handler is set once the model is up."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        attrs = {"address_family": family, "daemon_threads": True, "request_queue_size": 128}
        server_class = type("Server", (ThreadingHTTPServer,), attrs)
        return server_class((host, port), Handler)
    except OSError as e:
        why = (
            "is already in use"
            if e.errno == errno.EADDRINUSE
            else f"cannot be bound ({e.strerror or e})"
        )
        raise UserError(f"--host {host} --port {port}: the address {why}") from None


def size_overflow(model, args):
    """Give streamed experts the overflow area ``--expert-overflow`` asks for (default: what
    ``--max-batch`` sequences can need, ``overflow_for_batch``), announced on stderr."""
    from kimi_k3.streaming.store import find_streamer, overflow_for_batch

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


def make_handler(state: ServerState) -> type:
    return type("KimiHandler", (Handler,), {"state": state})


def serve_model(args, httpd, plan=None) -> ServerState:
    """Load the model and start the engine for an already bound server (on rank 0 of
    ``plan``'s group under ``--split``)."""
    from kimi_k3.generate import context_limit
    from kimi_k3.serving import Engine

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
    )
    limits = Limits(
        context=context_limit(model, args.max_context)[0],
        vocab=model.args.vocab_size,
        max_tokens=args.max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        thinking=args.thinking,
    )
    name = args.served_model_name or (Path(model_path).name if model_path else DEMO_MODEL_ID)
    return ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_id=name,
        limits=limits,
        max_body=int(args.max_body_mb * 1e6),
        allowed_hosts=allowed_hosts(httpd.server_address[0], args.allowed_hosts),
        allowed_origins=set(args.allowed_origins),
    )


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    try:
        check_arguments(args)
    except UserError as e:
        return fail(str(e), USAGE_ERROR)
    state = None
    try:
        plan = distributed.from_args(args)
        if plan is not None and plan.rank != 0:
            return follow_rank(args, plan)
        with distributed.agreed(plan):  # a port in use ends every rank, before loading
            httpd = bind(args.host, args.port)
        state = serve_model(args, httpd, plan)
    except (UserError, ConfigError, CheckpointError, OSError, distributed.DistributedError) as e:
        return fail(str(e), USAGE_ERROR if isinstance(e, ArgumentError) else 1)
    except KeyboardInterrupt:
        return INTERRUPTED
    httpd.RequestHandlerClass = make_handler(state)
    host, port = httpd.server_address[:2]
    print(f"serving {state.model_id!r} on http://{host}:{port}", file=sys.stderr, flush=True)
    http_thread = threading.Thread(target=httpd.serve_forever, name="kimi-k3-http", daemon=True)
    http_thread.start()
    try:
        state.engine.run()  # in the main thread, until Ctrl-C
    except KeyboardInterrupt:
        pass
    finally:
        httpd.shutdown()
        httpd.server_close()
        state.engine.release_peers()
    return 0


def follow_rank(args, plan) -> int:
    """A rank other than 0 under ``--split``: load its share, agree on the port, then
    repeat rank 0's forward passes (``kimi_k3.serving.follow``) until rank 0 stops."""
    from kimi_k3.serving import follow

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
