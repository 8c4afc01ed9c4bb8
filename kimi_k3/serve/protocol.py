"""The OpenAI protocol of ``python -m kimi_k3.server``: request models, the checked job a
request becomes, and the replies (whole bodies and server-sent-event chunks).

A request body is parsed and checked in one step by the pydantic models ``ChatRequest``
and ``CompletionRequest`` (``parse_request``): JSON nested deeper than pydantic's parser
allows, integer literals too long to convert, non-finite numbers, fields of the wrong type
or out of range, token ids outside the vocabulary, unknown fields and fields whose
behaviour this server does not implement are all refused as ``ApiError`` (HTTP 400) naming
the field. Limits that depend on the server (the vocabulary, ``--max-tokens-limit``) come
from the ``Limits`` handed to the models as their validation context.

Replies are parsed from token ids (``kimi_k3.text.chat.ReplyStream``), so marker spellings the
model writes as plain text stay text.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kimi_k3.serve.constrained import processor_for
from kimi_k3.text.chat import ReplyStream, encode_chat

ROLES = ("system", "user", "assistant", "tool")
LOG_PREFIX = 200  # characters of a request line or body quoted in a log line
MAX_STOP = 4
MAX_SEED = 2**63 - 1  # OpenAI's seed is a 64-bit integer; MLX keys take it unsigned
TOKEN_KEY = re.compile(r"-?[0-9]{1,20}")  # a logit_bias key: ASCII digits only


class ApiError(Exception):
    """A refused request: its HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        return {404: "not_found_error", 429: "rate_limit_error"}.get(
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

    def json(self) -> bytes:
        return json.dumps(self.body()).encode()


def quote(value) -> str:
    """``value``'s repr cut to ``LOG_PREFIX`` characters, for logs and error messages."""
    text = repr(value)
    return text[:LOG_PREFIX] + ("..." if len(text) > LOG_PREFIX else "")


@dataclass
class Limits:
    """What the server allows: its context, reply lengths, vocabulary, defaults."""

    context: int
    vocab: int
    max_tokens: int
    max_tokens_limit: int
    max_prompt: int | None = None  # prompt tokens (None: the context's room)
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    thinking: bool = True


# Field types. Each is a validator that takes any JSON value and either returns the
# value the job uses or raises ``invalid`` with a message that follows the field's name.
# JSON null means "not given" throughout, as OpenAI's API reads it.


MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI's API bounds it
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, likewise


def invalid(message: str, param: str | None = None) -> PydanticCustomError:
    """A refusal of a field; ``param`` names it where pydantic's location does not."""
    return PydanticCustomError("request", "{message}", {"message": message, "param": param})


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _limits(info) -> Limits:
    return info.context["limits"]


def Bounded(low: float, high: float | str, integer: bool = False):
    """A number (an integer) from ``low`` to ``high``; a string ``high`` names the
    ``Limits`` attribute that holds it."""
    kind = "an integer" if integer else "a number"

    def check(v, info):
        if v is None:
            return None
        top = getattr(_limits(info), high) if isinstance(high, str) else high
        if not (_is_int(v) if integer else _is_number(v)) or not low <= v <= top:
            raise invalid(f"must be {kind} from {low} to {top}, got {quote(v)}")
        return v

    return Annotated[Any, PlainValidator(check)]


def Unsupported(why: str, *off):
    """A field whose behaviour this server does not implement: only null and the values
    ``off`` that ask for nothing are accepted."""

    def check(v):
        if v is not None and not any(v == o and type(v) is type(o) for o in off):
            raise invalid(f"is not supported: {why}")
        return v

    return Annotated[Any, PlainValidator(check)]


def token_id(v, vocab: int) -> int:
    """``v`` as a token id in ``[0, vocab)``; ids outside the vocabulary are refused."""
    if isinstance(v, str) and TOKEN_KEY.fullmatch(v):
        v = int(v)
    if not _is_int(v) or not 0 <= v < vocab:
        raise invalid(f"holds {quote(v)}, which is not a token id (0..{vocab - 1})")
    return v


def _logit_bias(v, info) -> dict[int, float] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("must be an object of token id -> bias")
    out = {}
    for key, bias in v.items():
        tid = token_id(key, _limits(info).vocab)
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise invalid(f"[{key}]: the bias must be a number from -100 to 100")
        out[tid] = float(bias)
    return out


def _stop(v) -> list[str] | None:
    if v is None:
        return None
    stop = [v] if isinstance(v, str) else v
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise invalid(f"must be a string or up to {MAX_STOP} non-empty strings")
    return stop


def _role(v) -> str:
    if v == "developer":
        return "system"
    if v not in ROLES:
        known = ", ".join(ROLES + ("developer",))
        raise invalid(f"is an unknown role: {quote(v)} ({known})")
    return v


def _content(v):
    """Text, or a list of text parts; anything else (images, audio, files) is refused."""
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise invalid("must be a string or a list of parts")
    for j, part in enumerate(v):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            name = kind if isinstance(kind, str) else type(part).__name__
            raise invalid(
                f"[{j}]: {quote(name)} parts are not supported: the model reads text only"
            )
    return v


def _prompt(v, info) -> list[int] | str:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # one prompt in a list of prompts (a string or a list of ids)
    elif isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        raise invalid(f"holds {len(v)} prompts: send one prompt per request")
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(not isinstance(t, str) for t in v):
        return [token_id(t, _limits(info).vocab) for t in v]
    raise invalid("must be a string or a list of token ids")


def _n(v):
    if v is not None and not (_is_int(v) and v == 1):
        raise invalid("must be 1: one choice per request")
    return v


def _non_finite(value, path: str = "") -> str | None:
    """The place of the first NaN or infinity in a JSON value (``[0].a``), or None. JSON has
    no such numbers, though Python's parser (and pydantic's) reads ``NaN`` and ``Infinity``
    and turns ``1e999`` into one."""
    stack = [(value, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return at
        if isinstance(v, dict):
            stack += [(item, f"{at}.{k}") for k, item in reversed(v.items())]
        elif isinstance(v, list):
            stack += [(item, f"{at}[{i}]") for i, item in reversed(list(enumerate(v)))]
    return None


def _finite(v):
    """A JSON value (tools, a schema) without NaN or infinities, which no JSON holds."""
    at = _non_finite(v)
    if at is not None:
        raise invalid(f"{at[:LOG_PREFIX]} is not a finite number (JSON numbers are finite)")
    return v


Finite = AfterValidator(_finite)


def _tool_choice(v):
    if v is None or v in ("auto", "required"):
        return v
    if v == "none":
        return v  # accepted without tools only (ChatRequest.check_tools)
    if isinstance(v, dict):
        return _finite(v)  # a named function: checked against the tools (serve.constrained)
    raise invalid('must be "auto", "required", "none" or {"type": "function", ...}')


def _response_format(v):
    if v is None or isinstance(v, dict):
        return _finite(v)  # its type and schema are checked by kimi_k3.serve.constrained
    raise invalid("must be an object")


Role = Annotated[Any, PlainValidator(_role)]
Content = Annotated[Any, PlainValidator(_content)]


class Strict(BaseModel):
    """No unknown fields, no type coercion (``"1"`` is not 1, 0 is not false)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Message(Strict):
    role: Role
    content: Content = None
    name: str | None = None
    tool_calls: Annotated[list[dict[str, Any]] | None, Finite] = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier assistant turn's reasoning
    reasoning: str | None = None


class StreamOptions(Strict):
    include_usage: bool = False


class TemplateOptions(Strict):
    """``chat_template_kwargs``: ``thinking`` (or its alias ``enable_thinking``)."""

    thinking: bool | None = None
    enable_thinking: bool | None = None


class GenerationRequest(Strict):
    """The fields both endpoints share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Bounded(1, "max_tokens_limit", integer=True) = None
    max_completion_tokens: Bounded(1, "max_tokens_limit", integer=True) = None
    temperature: Bounded(0, 2) = None
    top_p: Bounded(0, 1) = None
    top_k: Bounded(0, "vocab", integer=True) = None
    min_p: Bounded(0, 1) = None
    presence_penalty: Bounded(-2, 2) = None
    frequency_penalty: Bounded(-2, 2) = None
    seed: Bounded(0, MAX_SEED, integer=True) = None
    logit_bias: Annotated[Any, PlainValidator(_logit_bias)] = None
    stop: Annotated[Any, PlainValidator(_stop)] = None
    n: Annotated[Any, PlainValidator(_n)] = None
    user: str | None = None  # an end-user id for the caller's own records; no effect here

    @model_validator(mode="after")
    def check_logprobs(self):
        if self.stream and self.logprobs is not None and self.logprobs is not False:
            raise invalid("with stream is not supported: ask for the whole reply", "logprobs")
        return self


class ChatRequest(GenerationRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: Annotated[list[dict[str, Any]] | None, Finite] = None
    tool_choice: Annotated[Any, PlainValidator(_tool_choice)] = None
    parallel_tool_calls: Unsupported("the model may call several tools in one reply", True) = None
    chat_template_kwargs: TemplateOptions | None = None
    logprobs: bool | None = None
    top_logprobs: Bounded(0, MAX_TOP_LOGPROBS, integer=True) = None
    response_format: Annotated[Any, PlainValidator(_response_format)] = None

    @model_validator(mode="after")
    def check_tools(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("needs logprobs: true", "top_logprobs")
        if self.tool_choice == "none" and self.tools:
            raise invalid(
                '"none" with tools is not supported: the model decides whether to call a '
                'tool ("auto")',
                "tool_choice",
            )
        return self


class CompletionRequest(GenerationRequest):
    prompt: Annotated[Any, PlainValidator(_prompt)]
    logprobs: Bounded(0, MAX_COMPLETION_LOGPROBS, integer=True) = None
    echo: bool = False
    best_of: Unsupported("one candidate is generated per request", 1) = None
    suffix: Unsupported("the model completes text after the prompt only") = None

    @model_validator(mode="after")
    def check_echo(self):
        if self.echo and self.stream:
            raise invalid("with stream is not supported: ask for the whole reply", "echo")
        return self


# Words for pydantic's own error types (strict types, nested models, required fields).
ERROR_WORDS = {
    "missing": "is required",
    "extra_forbidden": "is not a field this server accepts",
    "model_type": "must be an object",
    "dict_type": "must be an object",
    "list_type": "must be a list",
    "too_short": "must not be empty",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "int_type": "must be an integer",
}


def field_path(loc: tuple) -> str:
    """``("messages", 0, "role")`` as ``messages[0].role``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def refusal(error: ValidationError) -> ApiError:
    """The first of pydantic's errors as a 400 naming the field."""
    first = error.errors(include_url=False, include_input=False)[0]
    kind, loc, ctx = first["type"], first["loc"], first.get("ctx") or {}
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {ctx['error']}")
    if not loc and not ctx.get("param"):
        return ApiError(400, "the body must be a JSON object")
    param = ctx.get("param") or field_path(loc)
    words = first["msg"] if kind == "request" else ERROR_WORDS.get(kind, first["msg"])
    space = "" if words.startswith(("[", ".")) else " "
    return ApiError(400, f"{param}{space}{words}", param)


def parse_request(model: type[GenerationRequest], raw: bytes, limits: Limits) -> GenerationRequest:
    """``raw`` (a request body) checked by ``model``; ``ApiError`` naming what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not UTF-8 (byte {e.start})") from None
    try:
        return model.model_validate_json(text, context={"limits": limits})
    except ValidationError as e:
        raise refusal(e) from None


# Jobs.


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
    constraint: object = None  # the grammar's logits processor (kimi_k3.serve.constrained)
    logprobs: int | None = None  # alternatives a generated token's logprob comes with
    echo: bool = False  # completions: the reply starts with the prompt
    prompt_text: str = ""  # completions with echo: the prompt as text


def common_fields(req: GenerationRequest, limits: Limits) -> dict:
    """Sampling, stop, stream and length fields shared by both endpoints (a field not
    given takes the server's default)."""

    def given(value, default):
        return default if value is None else value

    max_tokens = given(req.max_completion_tokens, given(req.max_tokens, limits.max_tokens))
    return dict(
        max_tokens=max_tokens,
        sampling=dict(
            temp=given(req.temperature, limits.temp),
            top_p=given(req.top_p, limits.top_p),
            top_k=given(req.top_k, limits.top_k),
            min_p=given(req.min_p, limits.min_p),
            presence_penalty=given(req.presence_penalty, 0.0),
            frequency_penalty=given(req.frequency_penalty, 0.0),
            seed=req.seed,
        ),
        logit_bias=req.logit_bias or {},
        stop=req.stop or [],
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


def fit_context(prompt: list[int], fields: dict, limits: Limits, param: str) -> dict:
    """Refuse a prompt over ``--max-prompt-tokens`` or that leaves no room in the context;
    cut ``max_tokens`` to fit."""
    if not prompt:
        raise ApiError(400, f"{param} is empty", param)
    if limits.max_prompt is not None and len(prompt) > limits.max_prompt:
        raise ApiError(
            400,
            f"the prompt is {len(prompt)} tokens, but this server takes at most "
            f"{limits.max_prompt} (--max-prompt-tokens)",
            param,
            "context_length_exceeded",
        )
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


def thinking_of(req: ChatRequest, default: bool) -> bool:
    options = req.chat_template_kwargs
    if options is None:
        return default
    for value in (options.thinking, options.enable_thinking):
        if value is not None:
            return value
    return default


def chat_job(req: ChatRequest, tokenizer, limits: Limits) -> Job:
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    fields = common_fields(req, limits)
    thinking = thinking_of(req, limits.thinking)
    try:
        prompt = encode_chat(tokenizer, messages, tools=req.tools or None, thinking=thinking)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ApiError(400, f"messages: {e}", "messages") from None
    return Job(
        prompt,
        chat=True,
        thinking=thinking,
        constraint=constraint_of(req, tokenizer, thinking),
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        **fit_context(prompt, fields, limits, "messages"),
    )


def constraint_of(req: ChatRequest, tokenizer, thinking: bool):
    """The logits processor that enforces ``response_format`` and ``tool_choice``
    (grammar-constrained decoding, ``kimi_k3.serve.constrained``), or None; a value it cannot
    enforce is a 400 naming the field."""
    if (req.tool_choice == "required" or isinstance(req.tool_choice, dict)) and not req.tools:
        raise ApiError(400, "tool_choice needs tools to choose from", "tool_choice")
    try:
        return processor_for(tokenizer, req.response_format, req.tool_choice, req.tools, thinking)
    except ValueError as e:  # its message starts with the field's path
        field_name = re.match(r"[\w.\[\]$]+", str(e))
        param = field_name.group(0).rstrip(".") if field_name else None
        raise ApiError(400, str(e), param) from None


def completion_job(req: CompletionRequest, tokenizer, limits: Limits) -> Job:
    prompt = req.prompt
    ids = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
    fields = common_fields(req, limits)
    text = "" if not req.echo else prompt if isinstance(prompt, str) else tokenizer.decode(ids)
    return Job(
        ids,
        chat=False,
        logprobs=req.logprobs,
        echo=req.echo,
        prompt_text=text,
        **fit_context(ids, fields, limits, "prompt"),
    )


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
    tokens: list[int] = field(default_factory=list)  # generated ids, a stop token included
    token_logprobs: list = field(default_factory=list)  # the engine's, one a generated id
    prompt_logprobs: list = field(default_factory=list)  # the engine's, prompt ids past the first
    stop_ids: frozenset = frozenset()


def token_text(tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text and its UTF-8 bytes; a token that is part of a character is written
    ``bytes:\\xNN...`` (its text alone is not UTF-8)."""
    table = getattr(getattr(tokenizer, "detokenizer", None), "token_bytes", None)
    raw = table[token] if table is not None and token < len(table) else None
    if raw is None:
        raw = tokenizer.decode([token]).encode("utf-8")
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def chat_logprobs(outcome: Outcome, tokenizer) -> dict:
    """OpenAI's chat ``logprobs``: every generated token (reasoning, reply and tool-call
    tokens alike, a stop token excluded) with its logprob and alternatives."""
    content = []
    for token, (lp, alts) in zip(outcome.tokens, outcome.token_logprobs):
        if token in outcome.stop_ids:
            break
        text, raw = token_text(tokenizer, token)
        top = []
        for i, v in alts:
            t, b = token_text(tokenizer, i)
            top.append({"token": t, "logprob": v, "bytes": b})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(job: Job, outcome: Outcome, tokenizer) -> dict:
    """OpenAI's completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (each position's alternatives, token text to logprob) and ``text_offset`` (each
    token's start in the reply's text: the length of what the tokens before it decode to,
    whole characters only); with ``echo`` the prompt's tokens first, the first
    of them with no logprob. Generated tokens after the reply's text ends (a stop string)
    are left out."""
    ids, lps, tops = [], [], []
    if job.echo:
        ids += job.prompt
        lps.append(None)
        tops.append(None)
        for lp, alts in outcome.prompt_logprobs:
            lps.append(lp)
            tops.append(alts)
    reply_from = len(ids)  # the first generated token's place
    for token, (lp, alts) in zip(outcome.tokens, outcome.token_logprobs):
        if token in outcome.stop_ids:
            break
        ids.append(token)
        lps.append(lp)
        tops.append(alts)
    texts, offsets, at, start = [], [], 0, 0
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i, t in enumerate(ids):  # a token's offset: the text its predecessors decode to
        if i == reply_from:
            start = at
        if i >= reply_from and at - start >= len(outcome.reply.content):
            del ids[i:], lps[i:], tops[i:]  # past a stop string: the text ended before it
            break
        text, raw = token_text(tokenizer, t)
        texts.append(text)
        offsets.append(at)
        at += len(decoder.decode(bytes(raw)))
    top = [
        None if alts is None else {token_text(tokenizer, i)[0]: v for i, v in alts} for alts in tops
    ]
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


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


def response_body(job: Job, outcome: Outcome, model_id: str, tokenizer=None) -> dict:
    """The whole reply's JSON (``tokenizer`` writes the tokens of ``logprobs``)."""
    reason = finish_reason(outcome)
    if job.chat:
        lps = None if job.logprobs is None else chat_logprobs(outcome, tokenizer)
        choice = {"index": 0, "message": chat_message(outcome.reply, job), "logprobs": lps}
        kind, prefix = "chat.completion", "chatcmpl"
    else:
        lps = None if job.logprobs is None else completion_logprobs(job, outcome, tokenizer)
        text = job.prompt_text + outcome.reply.content
        choice = {"index": 0, "text": text, "logprobs": lps}
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
