"""The Kimi K3 chat format (XTML): render messages, encode them safely, parse replies.

A conversation is a list of segments ``(text, is_marker)``. Only the four markers
``<|open|>``, ``<|close|>``, ``<|sep|>`` and ``<|end_of_msg|>`` become special ids; tag names,
attributes and all message text are encoded as plain text, so a user who types ``<|open|>``
gets the BPE tokens of those eight characters, never the marker.

An element is ``<|open|>TAG attrs<|sep|>`` ... ``<|close|>TAG<|sep|>``; a message is an
element ``message`` followed by ``<|end_of_msg|>`` (docs/model.md#chat-format). Choices
where the format is silent:

- an assistant message holds ``think`` only when it has reasoning, then always ``response``
  (possibly empty), then ``tools`` when it has calls; ``thinking`` only picks the
  generation prompt;
- a tool-call argument that is a string has ``type="string"`` and its raw value; any other
  value is JSON (``ensure_ascii=False``) with its JSON-schema type name (``integer``,
  ``number``, ``boolean``, ``null``, ``array``, ``object``);
- call ``index`` counts from 1 within the assistant message; a tool result takes the index
  of the call it answers (by ``tool_call_id``), else its position after that message;
- the tool declaration is the ``tools`` list as JSON (``ensure_ascii=False``), in a system
  message ``type="tool-declare"`` before every other message.
"""

from __future__ import annotations

import codecs
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END)

Segment = tuple[str, bool]

_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (list, "array"))
_MARKER_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
_ATTR = re.compile(r'([\w-]+)="([^"]*)"')


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def open_tag(tag: str, **attrs) -> list[Segment]:
    """``<|open|>TAG k="v"...<|sep|>``, values escaped."""
    head = "".join(f' {k}="{escape_attr(str(v))}"' for k, v in attrs.items())
    return [(OPEN, True), (tag + head, False), (SEP, True)]


def close_tag(tag: str) -> list[Segment]:
    return [(CLOSE, True), (tag, False), (SEP, True)]


def element(tag: str, body: list[Segment] | str, **attrs) -> list[Segment]:
    if isinstance(body, str):
        body = [(body, False)] if body else []
    return open_tag(tag, **attrs) + body + close_tag(tag)


def message(body: list[Segment] | str, **attrs) -> list[Segment]:
    return element("message", body, **attrs) + [(END, True)]


# Messages in: native and OpenAI-style dicts, normalized to one shape.


@dataclass
class _Msg:
    role: str
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    name: str | None = None
    index: int | None = None
    tool_call_id: str | None = None


def _text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str) or p.get("type") != "text":
                raise ValueError(f"only text content parts are supported, got {p!r}")
            parts.append(p["text"])
        return "".join(parts)
    raise ValueError(f"message content must be a string or a list of parts, got {content!r}")


def _normalize_call(call: dict) -> dict:
    fn = call.get("function", call)
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {args!r}")
    if not isinstance(fn.get("name"), str):
        raise ValueError(f"tool call has no name: {call!r}")
    return {"name": fn["name"], "arguments": args, "id": call.get("id")}


def _normalize(m: dict) -> _Msg:
    role = m.get("role")
    if role not in ("system", "user", "assistant", "tool"):
        raise ValueError(f"unknown message role {role!r}")
    reasoning = m.get("reasoning", m.get("reasoning_content")) or ""
    return _Msg(
        role=role,
        content=_text_of(m.get("content")),
        reasoning=reasoning,
        tool_calls=[_normalize_call(c) for c in m.get("tool_calls") or []],
        name=m.get("name"),
        index=m.get("index"),
        tool_call_id=m.get("tool_call_id"),
    )


# Rendering.


def _argument(key: str, value) -> list[Segment]:
    if isinstance(value, str):
        return element("argument", value, key=key, type="string")
    kind = "object" if isinstance(value, dict) else "null" if value is None else None
    kind = kind or next((t for cls, t in _JSON_TYPES if isinstance(value, cls)), None)
    if kind is None:
        raise ValueError(f"tool argument {key!r} is not JSON: {value!r}")
    return element("argument", json.dumps(value, ensure_ascii=False), key=key, type=kind)


def _tool_call(index: int, call: dict) -> list[Segment]:
    body = [seg for k, v in call["arguments"].items() for seg in _argument(k, v)]
    return element("call", body, tool=call["name"], index=index)


def _assistant(m: _Msg, final: bool) -> list[Segment]:
    """An assistant message; ``final`` leaves its response open for the model to continue."""
    body = element("think", m.reasoning) if m.reasoning else []
    if final:
        return open_tag("message", role="assistant") + body + open_tag("response") + _plain(m)
    body += element("response", m.content)
    if m.tool_calls:
        calls = [seg for i, c in enumerate(m.tool_calls, 1) for seg in _tool_call(i, c)]
        body += element("tools", calls)
    return message(body, role="assistant")


def _plain(m: _Msg) -> list[Segment]:
    return [(m.content, False)] if m.content else []


def _tool_result(m: _Msg, calls: list[dict], position: int) -> list[Segment]:
    index = m.index
    if index is None and m.tool_call_id is not None:
        ids = [c.get("id") for c in calls]
        index = ids.index(m.tool_call_id) + 1 if m.tool_call_id in ids else None
    index = index if index is not None else position
    name = m.name
    if name is None and 0 < index <= len(calls):
        name = calls[index - 1]["name"]
    if name is None:
        raise ValueError(f"tool result {position} names no tool and answers no known call")
    return message(m.content, role="tool", tool=name, index=index)


def generation_prompt(thinking: bool = True) -> list[Segment]:
    section = "think" if thinking else "response"
    return open_tag("message", role="assistant") + open_tag(section)


def render_messages(
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    thinking: bool = True,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[Segment]:
    """The segments ``(text, is_marker)`` of a conversation.

    ``messages`` are native (``reasoning``, ``tool_calls=[{"name", "arguments": dict}]``,
    tool results with ``name`` and ``index``) or OpenAI-style (``tool_calls`` with
    ``function.arguments`` a JSON string, ``tool_call_id``). ``tools`` become a leading
    ``tool-declare`` system message. With ``continue_final_message`` the last message, an
    assistant's, is left open inside its response; otherwise ``add_generation_prompt``
    appends the assistant opening with ``think`` (``thinking``) or ``response``.
    """
    msgs = [_normalize(m) for m in messages]
    if continue_final_message and (not msgs or msgs[-1].role != "assistant"):
        raise ValueError("continue_final_message needs a final assistant message")
    segs: list[Segment] = []
    if tools:
        decl = json.dumps(list(tools), ensure_ascii=False)
        segs += message(decl, role="system", type="tool-declare")
    calls: list[dict] = []
    position = 0
    for i, m in enumerate(msgs):
        if m.role == "assistant":
            segs += _assistant(m, final=continue_final_message and i == len(msgs) - 1)
            calls, position = m.tool_calls, 0
        elif m.role == "tool":
            position += 1
            segs += _tool_result(m, calls, position)
        else:
            segs += message(m.content, role=m.role)
    if add_generation_prompt and not continue_final_message:
        segs += generation_prompt(thinking)
    return segs


def render_text(
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    thinking: bool = True,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The conversation as one string, for display and golden tests (markers inline)."""
    segs = render_messages(messages, tools, thinking, add_generation_prompt, continue_final_message)
    return "".join(text for text, _ in segs)


def encode_ordinary(tokenizer, text: str) -> list[int]:
    """Plain BPE ids of ``text``: special-token names inside it stay text.

    Runs the backend's pre-tokenizer and model directly, without its added-token matcher,
    so it changes no tokenizer state (unlike ``split_special_tokens``).
    """
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pieces = backend.pre_tokenizer.pre_tokenize_str(text)
    return [t.id for piece, _ in pieces for t in backend.model.tokenize(piece)]


def marker_ids(tokenizer) -> dict[str, int]:
    ids = {m: tokenizer.convert_tokens_to_ids(m) for m in MARKERS}
    missing = [m for m, i in ids.items() if i is None or tokenizer.convert_ids_to_tokens(i) != m]
    if missing:
        raise ValueError(f"tokenizer lacks the XTML markers {missing}")
    return ids


def encode_segments(tokenizer, segments: Sequence[Segment]) -> list[int]:
    """Markers as their special ids; each run of text between them as plain BPE."""
    specials = marker_ids(tokenizer)
    ids: list[int] = []
    run: list[str] = []
    for text, is_marker in [*segments, ("", True)]:
        if not is_marker:
            run.append(text)
            continue
        if run:
            ids += encode_ordinary(tokenizer, "".join(run))
            run = []
        if text:
            ids.append(specials[text])
    return ids


def encode_chat(
    tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    thinking: bool = True,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """Token ids of a conversation (see ``render_messages``); no BOS."""
    segs = render_messages(messages, tools, thinking, add_generation_prompt, continue_final_message)
    return encode_segments(tokenizer, segs)


# Parsing a generated reply.


@dataclass
class Element:
    tag: str
    attrs: dict[str, str] = field(default_factory=dict)
    children: list = field(default_factory=list)
    closed: bool = False

    def text(self) -> str:
        return "".join(c for c in self.children if isinstance(c, str))

    def find_all(self, tag: str) -> list[Element]:
        found = []
        for c in self.children:
            if isinstance(c, Element):
                found += [c] if c.tag == tag else []
                found += c.find_all(tag)
        return found


@dataclass
class Reply:
    thinking: str
    response: str
    tool_calls: list[dict]
    finished: bool


def split_markers(text: str) -> list[Segment]:
    """Segments of a decoded string; a marker's text always counts as the marker."""
    parts = _MARKER_SPLIT.split(text)
    return [(p, i % 2 == 1) for i, p in enumerate(parts) if p]


def segments_from_ids(tokenizer, ids: Sequence[int]) -> list[Segment]:
    """Segments of token ids; only the marker ids are markers, decoded text never is."""
    by_id = {i: m for m, i in marker_ids(tokenizer).items()}
    segs: list[Segment] = []
    run: list[int] = []
    for i in [*ids, None]:
        if i is not None and i not in by_id:
            run.append(int(i))
            continue
        if run:
            segs.append((tokenizer.decode(run), False))
            run = []
        if i is not None:
            segs.append((by_id[i], True))
    return segs


def _parse_head(head: str) -> tuple[str, dict[str, str]]:
    tag, _, rest = head.strip().partition(" ")
    return tag, {k: unescape_attr(v) for k, v in _ATTR.findall(rest)}


def parse_segments(segments: Sequence[Segment], open_tags: Sequence[str] = ()) -> Element:
    """The element tree of XTML segments, starting inside ``open_tags`` (outermost first).

    Tolerant: a close without a matching open is ignored, a close ends any elements opened
    inside it, and whatever is cut off stays open (``closed=False``). ``<|end_of_msg|>``
    ends parsing.
    """
    root = Element("")
    stack = [root]
    for tag in open_tags:
        stack.append(Element(tag))
        stack[-2].children.append(stack[-1])
    i = 0
    while i < len(segments):
        text, is_marker = segments[i]
        if not is_marker:
            stack[-1].children.append(text)
            i += 1
            continue
        if text == END:
            root.closed = True
            break
        if text == SEP:
            i += 1
            continue
        head, complete = _tag_head(segments, i)
        if not complete:
            i += 2 if i + 1 < len(segments) and not segments[i + 1][1] else 1
            continue
        i += 3
        tag, attrs = _parse_head(head)
        if text == OPEN:
            stack.append(Element(tag, attrs))
            stack[-2].children.append(stack[-1])
        elif tag in [e.tag for e in stack[1:]]:
            while stack[-1].tag != tag:
                stack.pop()
            stack.pop().closed = True
    return root


def _tag_head(segments: Sequence[Segment], i: int) -> tuple[str, bool]:
    """The tag text after the marker at ``i``, and whether ``TEXT<|sep|>`` follows it."""
    if i + 2 < len(segments) and not segments[i + 1][1] and segments[i + 2] == (SEP, True):
        return segments[i + 1][0], True
    return "", False


def _argument_value(arg: Element):
    raw = arg.text()
    if arg.attrs.get("type", "string") == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _call(call: Element) -> dict | None:
    name = call.attrs.get("tool")
    if not name or not call.closed:
        return None
    blocks = [j for j in call.find_all("json") if j.closed]
    if blocks:
        args = json.loads(blocks[0].text())
    else:
        args = {a.attrs["key"]: _argument_value(a) for a in call.find_all("argument") if a.closed}
    return {"name": name, "arguments": args}


def tool_calls_of(tree: Element) -> list[dict]:
    """Complete calls (``<|close|>call<|sep|>`` seen) in order; malformed ones are skipped."""
    calls = []
    for c in tree.find_all("call"):
        try:
            parsed = _call(c)
        except (json.JSONDecodeError, KeyError):
            continue
        if parsed is not None and isinstance(parsed["arguments"], dict):
            calls.append(parsed)
    return calls


def parse_tool_calls(text: str) -> list[dict]:
    """Calls in a tools section's text, with or without its own open/close tags."""
    return tool_calls_of(parse_segments(split_markers(text)))


def parse_reply(reply: str | Sequence[int], tokenizer=None, thinking: bool = True) -> Reply:
    """Split a reply generated after ``generation_prompt(thinking)`` into its parts.

    ``reply`` is decoded text (then any marker string counts as a marker) or token ids
    with the ``tokenizer`` (then only marker ids do). Cut-off sections keep what they
    hold; a cut-off tool call is dropped. ``finished`` is true once the message closed.
    """
    if isinstance(reply, str):
        segments = split_markers(reply)
    else:
        if tokenizer is None:
            raise ValueError("parse_reply needs the tokenizer to parse token ids")
        segments = segments_from_ids(tokenizer, reply)
    tree = parse_segments(segments, ["message", "think" if thinking else "response"])
    msg = tree.children[0]
    return Reply(
        thinking="".join(e.text() for e in msg.find_all("think")),
        response="".join(e.text() for e in msg.find_all("response")),
        tool_calls=tool_calls_of(msg),
        finished=msg.closed or tree.closed,
    )


class FieldText:
    """One text field of a streamed reply, held as pieces: appending costs the piece, not
    the text. Readers that need to know whether text they have seen is still there
    ``watch`` it under a name; ``rewritten(name)`` is the lowest index changed other than
    by appending since that name last asked (None: only appends). ``cut`` truncates it
    for good: later text is ignored."""

    def __init__(self):
        self.pieces: list[str] = []
        self.length = 0
        self.frozen = False
        self.marks: dict[str, int | None] = {}
        self._joined: str | None = ""

    def __str__(self) -> str:
        if self._joined is None:
            self._joined = "".join(self.pieces)
            self.pieces = [self._joined] if self._joined else []
        return self._joined

    def watch(self, name: str):
        self.marks[name] = None

    def rewritten(self, name: str) -> int | None:
        low, self.marks[name] = self.marks[name], None
        return low

    def _rewrite(self, at: int):
        for name, low in self.marks.items():
            self.marks[name] = at if low is None else min(low, at)

    def edit(self, drop: int, add: str):
        """Drop the last ``drop`` characters, then append ``add``."""
        if self.frozen or not (drop or add):
            return
        if drop:
            self._rewrite(self.length - drop)
        _edit_pieces(self.pieces, drop, add)
        self.length += len(add) - drop
        self._joined = None

    def set(self, text: str):
        """Replace the whole text (a rewrite from index 0)."""
        if not self.frozen:
            self.edit(self.length, text)

    def cut(self, at: int):
        """Keep the first ``at`` characters only, from now on."""
        self.edit(self.length - at, "")
        self.frozen = True

    def since(self, start: int) -> str:
        """The text from index ``start`` on, in work proportional to its length."""
        parts, need = [], self.length - start
        for piece in reversed(self.pieces):
            if need <= 0:
                break
            parts.append(piece)
            need -= len(piece)
        text = "".join(reversed(parts))
        return text[len(text) - (self.length - start) :]


class _ByteRun:
    """A text run's decoding from its tokens' bytes, one token at a time: the text is what
    ``decode`` gives for the run so far (an unfinished UTF-8 character at its end reads
    as one U+FFFD until its last byte arrives, as ``decode`` renders it)."""

    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        self.reset()

    def reset(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.partial = False

    def push(self, token: int) -> tuple[int, str]:
        """``(drop, add)``: characters to drop from the run's end, then text to append."""
        data = self.token_bytes[token] if token < len(self.token_bytes) else b""
        add = self.decoder.decode(data)
        drop = 1 if self.partial else 0
        self.partial = bool(self.decoder.getstate()[0])
        return drop, add + ("\ufffd" if self.partial else "")


class _WholeRun:
    """A text run decoded again in full at each token: for tokenizers without a byte
    table (``_ByteRun`` needs one)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.reset()

    def reset(self):
        self.ids: list[int] = []
        self.length = 0

    def push(self, token: int) -> tuple[int, str]:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        drop, self.length = self.length, len(text)
        return drop, text


def _run_decoder(tokenizer):
    table = getattr(getattr(tokenizer, "detokenizer", None), "token_bytes", None)
    return _ByteRun(table) if table is not None else _WholeRun(tokenizer)


SECTIONS = {"think": "reasoning", "response": "content"}


class ReplyStream:
    """A reply parsed from its token ids as they arrive, in work per token that does not
    grow with the reply.

    ``reasoning``, ``content`` and ``tool_calls`` so far: with ``chat`` the think and
    response sections of ``parse_reply`` (markers only where the ids are markers), else
    the decoded text. Special ids other than the markers (``[BOS]``, reserved ids) are
    not text and are dropped. ``add`` runs ``parse_segments``' rules one segment at a time:
    a text run is decoded token by token (``_ByteRun``) and goes to the innermost open
    element, a marker waits for the tag head and ``<|sep|>`` it needs; the fields
    (``field(name)``) grow at their end, and only text for a section nested in an earlier
    one of its kind (which the chat format never writes) makes a field be joined again.
    """

    def __init__(self, tokenizer, thinking: bool = True, chat: bool = True):
        self.tokenizer, self.thinking, self.chat = tokenizer, thinking, chat
        specials = set(getattr(tokenizer, "added_tokens_decoder", {}))
        self.markers = {i: m for m, i in marker_ids(tokenizer).items()} if chat else {}
        self.hidden = specials - set(self.markers)
        self.ids: list[int] = []
        self.fields = {"reasoning": FieldText(), "content": FieldText()}
        self.run = _run_decoder(tokenizer)
        self._start()

    def _start(self):
        for f in self.fields.values():
            f.frozen = False
            f.set("")
        self.tool_calls: list[dict] = []
        self.run.reset()
        self._run: list[str] = []  # the text run being read
        self._run_tokens = 0
        self._done = False  # <|end_of_msg|> seen
        self._msg_open = False
        self._pending = None  # an <|open|> or <|close|> waiting for its head and <|sep|>
        self._head: str | None = None  # that head, once a text run followed the marker
        self._root = Element("")
        self._stack = [self._root]
        self._on_stack: Counter = Counter()  # tags of the open elements
        # Elements inside the message, by id (``Element`` compares by value), in order.
        self._sections = {tag: [] for tag in SECTIONS}
        self._in_section: set[int] = set()
        self._calls: dict[int, int] = {}  # id(call) -> its position
        self._parsed: dict[int, dict] = {}  # position -> the call, once closed and valid
        self._msg = self._open("message", {})
        self._msg_open = True
        self._open("think" if self.thinking else "response", {})

    @property
    def reasoning(self) -> str:
        return str(self.fields["reasoning"])

    @property
    def content(self) -> str:
        return str(self.fields["content"])

    @property
    def finished(self) -> bool:
        return self._msg.closed or self._root.closed

    def field(self, name: str) -> FieldText:
        """``"reasoning"`` or ``"content"``."""
        return self.fields[name]

    def add(self, token: int):
        self.ids.append(token)
        if token not in self.hidden:
            self._feed(token)
        self.changed()

    def update(self):
        """Parse ``ids`` again from the start (``add`` keeps the parse current; after
        appending to ``ids`` directly, call this once)."""
        self._start()
        for token in self.ids:
            if token not in self.hidden:
                self._feed(token)
        self.changed()

    def changed(self):
        """Called after every ``add`` and ``update``; subclasses act on the new text."""

    def _feed(self, token: int):
        if not self.chat:
            self.fields["content"].edit(*self.run.push(token))
        elif self._done:
            return
        elif token in self.markers:
            self._marker(self.markers[token])
        else:
            self._text(*self.run.push(token))

    # The parse (parse_segments, one segment at a time).

    def _text(self, drop: int, add: str):
        self._run_tokens += 1
        _edit_pieces(self._run, drop, add)
        if self._pending is not None:
            return  # a tag head: never text
        top = self._stack[-1]
        name = SECTIONS.get(top.tag)
        if name is None or id(top) not in self._in_section:
            return
        if top is self._sections[top.tag][-1]:
            self.fields[name].edit(drop, add)
        else:  # text inside an earlier section than the last of its kind
            live = "".join(self._run)
            texts = (e.text() + (live if e is top else "") for e in self._sections[top.tag])
            self.fields[name].set("".join(texts))

    def _end_run(self) -> str | None:
        """The finished run's text (None if there was none); the run starts over."""
        if not self._run_tokens:
            return None
        text = "".join(self._run)
        self._run, self._run_tokens = [], 0
        self.run.reset()
        return text

    def _marker(self, marker: str):
        text = self._end_run()
        if self._pending is None and text is not None:
            self._stack[-1].children.append(text)
        if self._pending is not None:
            head, kind = text, self._pending
            self._pending = None
            if head is not None and marker == SEP:
                self._tag(kind, head)
                return
        if marker == END:
            self._root.closed = self._done = True
        elif marker != SEP:
            self._pending = marker

    def _tag(self, kind: str, head: str):
        tag, attrs = _parse_head(head)
        if kind == OPEN:
            self._open(tag, attrs)
        elif self._on_stack[tag]:
            while (e := self._stack.pop()).tag != tag:
                self._popped(e)
            self._popped(e)
            e.closed = True
            if id(e) in self._calls:
                self._call_closed(e)

    def _open(self, tag: str, attrs: dict) -> Element:
        e = Element(tag, attrs)
        self._stack[-1].children.append(e)
        self._stack.append(e)
        self._on_stack[tag] += 1
        if self._msg_open and tag in SECTIONS:  # created inside the message: part of it
            self._sections[tag].append(e)
            self._in_section.add(id(e))
        elif self._msg_open and tag == "call":
            self._calls[id(e)] = len(self._calls)
        return e

    def _popped(self, e: Element):
        self._on_stack[e.tag] -= 1
        if e is self._msg:
            self._msg_open = False

    def _call_closed(self, e: Element):
        try:
            parsed = _call(e)
        except (json.JSONDecodeError, KeyError):
            return
        if parsed is None or not isinstance(parsed["arguments"], dict):
            return
        self._parsed[self._calls[id(e)]] = parsed
        self.tool_calls = [self._parsed[i] for i in sorted(self._parsed)]

    @staticmethod
    def stable(text: str) -> str:
        """``text`` without a trailing unfinished UTF-8 character (it may still change)."""
        return text.rstrip("\ufffd")


def _edit_pieces(pieces: list[str], drop: int, add: str):
    """Drop the last ``drop`` characters of the text ``pieces`` hold, then append ``add``."""
    while drop:
        last = pieces.pop()
        if len(last) > drop:
            pieces.append(last[:-drop])
        drop = max(drop - len(last), 0)
    if add:
        pieces.append(add)
