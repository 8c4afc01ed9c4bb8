"""Grammar-constrained decoding: JSON output and forced tool calls, through llguidance.

A processor here is an mlx-lm logits processor ``(tokens, logits) -> logits`` for one
sequence: every token the grammar does not allow next gets ``-inf``. It is called once per
step with the sequence's tokens so far (prompt and generated, as mlx-lm's ``generate_step``
and ``kimi_k3.serve.engine.Engine`` pass them); the first call's tokens are the prompt, and each
later call feeds the matcher only the tokens generated since. One processor serves one
sequence, once.

What is constrained is the reply after the generation prompt:

- ``json_object`` / ``json_schema``: the response text is one JSON document (an object, or a
  value of the schema), then only a stop id (``<|end_of_msg|>``, ``[EOS]``) may follow;
- ``tool_call``: the response is empty and the message holds a ``tools`` section of calls
  in the K3 chat format (``kimi_k3.text.chat``), each argument an ``argument`` element in the
  order of the function's ``parameters.properties``, its ``type`` attribute and value
  as ``chat._argument`` writes them, then ``<|close|>message<|sep|>`` and a stop id.

With ``thinking`` (the prompt opened ``think``) the reasoning is free text, which the
grammar ends with ``<|close|>think<|sep|><|open|>response<|sep|>``; the constraint applies
from the response on. Special ids are allowed only where the grammar names them (the chat
markers of the format) and stop ids only once the grammar is complete.

A grammar comes from a request, so it is bounded before anything compiles it
(``check_schema``: nesting through ``$ref``, branches, properties, size) and compiled first
in a worker process (``kimi_k3.serve.grammar_check``), where a grammar that crashes the
compiler or runs past its time or memory fails alone; the server compiles it only then.
A matcher that fails while the reply is generated (llguidance's per-token limits) raises
``GrammarError`` naming the request's field, which ends that sequence alone.
"""

from __future__ import annotations

import json
import threading
import weakref
from copy import copy
from urllib.parse import unquote

import mlx.core as mx
import numpy as np

from kimi_k3.serve.grammar_check import GrammarChecker, bounded, parser_limits
from kimi_k3.text.chat import _JSON_TYPES, OPEN, SEP, close_tag, escape_attr, marker_ids, open_tag
from kimi_k3.text.tokenizer import stop_ids

# Calls one ``tool_choice: "required"`` reply may hold (each index is spelled out).
MAX_CALLS = 4
# The JSON-schema types of a tool argument, as ``chat._argument`` names them.
ARGUMENT_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")
# Whitespace allowed between two JSON tokens: a space, or a line break and an indent of at
# most 16 spaces; bounded, so a model fond of whitespace cannot spend its tokens on it.
JSON_SPACE = r"(\x20|\n\x20{0,16})?"
# Keywords a raw (``type="string"``) argument honours; any other is refused.
STRING_KEYWORDS = {"type", "enum", "const", "pattern", "minLength", "maxLength"}
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated"}
PARAMETER_KEYWORDS = {"type", "properties", "required", "additionalProperties", "$schema"}
# Bounds on a schema from a request, checked before anything compiles it (``check_schema``).
MAX_DEPTH = 32  # subschemas nested in each other, through $ref
MAX_BRANCHES = 256  # object or array alternatives of one value (anyOf/oneOf, allOf's products)
MAX_PROPERTIES = 256  # properties of one object
MAX_NODES = 10_000  # subschemas in one schema
MAX_TOOLS = 128  # functions one forced tool call may choose from


def _llguidance():
    # Imported on the first grammar, not with the server: llguidance.hf alone takes about
    # half a second to import, and most requests carry no grammar.
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:
        raise ImportError(
            "grammar-constrained decoding needs the llguidance package "
            "(pip install llguidance; it is a dependency of kimi-k3)"
        ) from e
    return llguidance


_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def _tokenizer_json(hf) -> str:
    """The tokenizers library's JSON of a Hugging Face fast tokenizer, its added tokens
    included, without padding or truncation (what llguidance builds its tokenizer from)."""
    backend = copy(hf.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _llg_state(tokenizer) -> dict:
    """llguidance's tokenizer and the grammar checker for ``tokenizer`` (an mlx-lm
    ``TokenizerWrapper`` or a Hugging Face fast tokenizer), built once per tokenizer
    object: its byte-level BPE, its special ids and the stop ids as end-of-sequence."""
    llg = _llguidance()
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    with _LL_LOCK:  # requests' threads: one state (and one set of workers) per tokenizer
        state = _LL_TOKENIZERS.get(hf)
        if state is None:
            text, eos = _tokenizer_json(hf), stop_ids(tokenizer)
            ll = llg.LLTokenizer(text, eos_token=eos)
            state = _LL_TOKENIZERS[hf] = {"ll": ll, "checker": GrammarChecker(text, eos)}
    return state


def ll_tokenizer(tokenizer):
    """llguidance's view of ``tokenizer`` (see ``_llg_state``)."""
    return _llg_state(tokenizer)["ll"]


def checker(tokenizer) -> GrammarChecker:
    """The worker processes that compile ``tokenizer``'s grammars first."""
    return _llg_state(tokenizer)["checker"]


class GrammarError(ValueError):
    """A grammar a request brought failed while its reply was generated; ``param`` names
    the request's field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class GrammarProcessor:
    """The logits processor of one sequence under a compiled Lark grammar (see the module
    docstring for how it is called)."""

    def __init__(self, tokenizer, grammar: str, where: str = "grammar"):
        llg = _llguidance()
        self.ll = ll_tokenizer(tokenizer)
        self.grammar, self.where = grammar, where
        _check(tokenizer, grammar, where)  # in a worker first: it may crash the compiler
        self.matcher = llg.LLMatcher(self.ll, grammar, log_level=0, limits=parser_limits(llg))
        if self.matcher.is_error():
            raise ValueError(f"{where}: {_first_error(self.matcher.get_error())}")
        self.stops = stop_ids(tokenizer)
        self.fed: int | None = None  # tokens of the sequence the matcher has seen
        self.ended = False  # a stop id followed the complete grammar

    def __call__(self, tokens: mx.array | None, logits: mx.array) -> mx.array:
        if tokens is None:
            raise ValueError(
                "a grammar processor follows one sequence and needs its tokens "
                "(give it as a sequence's processor, not a batch-wide one)"
            )
        n = int(tokens.size)
        if self.fed is None:
            self.fed = n  # the prompt
        if n < self.fed:
            raise ValueError("a grammar processor serves one sequence; make one per sequence")
        new = tokens[self.fed :].tolist() if n > self.fed else []
        self.fed = n
        self.advance(new)
        return self.mask(logits)

    def advance(self, new: list[int]):
        """Feed generated tokens to the matcher; ValueError if the grammar refuses one
        (a token the mask did not allow was sampled). A stop id once the grammar is
        complete ends it (mlx-lm computes one step past the stop token)."""
        for token in new:
            if self.ended or (token in self.stops and self.matcher.is_accepting()):
                self.ended = True
            elif not self.matcher.consume_token(token):
                raise GrammarError(
                    self.where, f"token outside the grammar: {bounded(self.matcher.get_error())}"
                )

    def allowed(self) -> np.ndarray:
        """Bool [tokenizer vocabulary]: the tokens the grammar allows next (after the end,
        only the stop ids)."""
        if self.ended:
            allowed = np.zeros(self.ll.vocab_size, dtype=bool)
            allowed[self.stops] = True
            return allowed
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():  # a limit of llguidance's, reached at this token
            raise GrammarError(self.where, bounded(self.matcher.get_error()))
        return np.unpackbits(bits, bitorder="little")[: self.ll.vocab_size].astype(bool)

    def mask(self, logits: mx.array) -> mx.array:
        """``logits`` [1, V] with every token the grammar does not allow at ``-inf``; ids past
        the tokenizer's vocabulary (padding rows of the embedding) are never allowed."""
        allowed = self.allowed()
        V = logits.shape[-1]
        if allowed.size < V:
            allowed = np.concatenate([allowed, np.zeros(V - allowed.size, dtype=bool)])
        keep = mx.array(allowed[:V])
        return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))

    @property
    def done(self) -> bool:
        """The grammar is complete: only a stop id may follow."""
        return self.matcher.is_accepting()


# Lark text of grammar pieces.


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _lark_segments(tokenizer, segments) -> str:
    """``chat`` segments as Lark: markers as their special ids, text as literals."""
    ids = marker_ids(tokenizer)
    return " ".join(f"<[{ids[t]}]>" if marker else _literal(t) for t, marker in segments if t)


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def _json_rule(schema: dict) -> str:
    """A JSON value of ``schema``, whitespace between its tokens bounded (``JSON_SPACE``)."""
    options = {**schema.get("x-guidance", {}), "whitespace_pattern": JSON_SPACE}
    return "%json" + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def _thinking_prefix(tokenizer) -> str:
    """Free reasoning text, then the think section closed and the response opened."""
    segs = close_tag("think") + open_tag("response")
    return "THINK " + _lark_segments(tokenizer, segs)


def _start(tokenizer, body: str, thinking: bool, extra: list[str] = ()) -> str:
    prefix = _thinking_prefix(tokenizer) + " " if thinking else ""
    rules = [f"start: {prefix}{body}", *extra]
    if thinking:
        rules.append("THINK: /(?s:.*)/")
    return "\n".join(rules) + "\n"


def _first_error(error: str) -> str:
    """llguidance's first error line (it names the schema keyword it does not implement),
    bounded in length."""
    return bounded(error).split("failed to compile JSON schema: ", 1)[-1]


def _check(tokenizer, grammar: str, where: str):
    """ValueError naming ``where`` unless ``grammar`` compiles, and has a first token mask,
    in a worker process (``kimi_k3.serve.grammar_check``)."""
    error = checker(tokenizer).check(grammar)
    if error is not None:
        raise ValueError(f"{where}: {_first_error(error)}")


# Bounds on a schema.

# Keywords whose value is a subschema, an object of subschemas, or a list of them.
ONE_SCHEMA = (
    "items", "additionalProperties", "additionalItems", "contains", "not", "if", "then",
    "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SCALARS = {"string", "number", "integer", "boolean", "null"}


class _Bounds:
    """One walk of a schema (``check_schema``): depth through ``$ref`` (a reference back
    to a schema it is inside is recursion, which the grammar holds as a rule, not
    nesting), object or array branches, properties, nodes."""

    def __init__(self, root: dict, where: str):
        self.root, self.where = root, where
        self.nodes = 0
        self.below: dict[str, int] = {}  # a reference's depth below it, walked once
        self.branches: dict[str, int] = {}  # a reference's branch count

    def fail(self, path: str, what: str):
        if len(path) > 160:  # its start names the field, its end the place
            path = f"{path[:80]}...{path[-77:]}"
        raise ValueError(f"{path}: {what}")

    def walk(self, node, path: str, depth: int = 0, refs: tuple = ()) -> int:
        """The depth of subschemas below ``node``, which is ``depth`` deep (0 for a leaf);
        ValueError past ``MAX_DEPTH``."""
        if not isinstance(node, dict):
            return 0
        if depth > MAX_DEPTH:
            self.fail(path, f"subschemas nested more than {MAX_DEPTH} deep (through $ref too)")
        self.nodes += 1
        if self.nodes > MAX_NODES:
            self.fail(self.where, f"more than {MAX_NODES} subschemas")
        props = node.get("properties")
        if isinstance(props, dict) and len(props) > MAX_PROPERTIES:
            self.fail(f"{path}.properties", f"{len(props)} properties; at most {MAX_PROPERTIES}")
        deepest = 0
        for _, child, at in self._children(node, path):
            deepest = max(deepest, 1 + self.walk(child, at, depth + 1, refs))
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in refs:
            if ref not in self.below:
                self.below[ref] = 0  # a reference reached again inside its own walk
                target = self._resolve(ref)
                at = self._place(ref)
                self.below[ref] = self.walk(target, at, depth + 1, (*refs, ref))
            elif depth + 1 + self.below[ref] > MAX_DEPTH:
                self.fail(path, f"subschemas nested more than {MAX_DEPTH} deep (through $ref too)")
            deepest = max(deepest, 1 + self.below[ref])
        return deepest

    @staticmethod
    def _children(node: dict, path: str):
        for key in ONE_SCHEMA:
            if isinstance(node.get(key), dict):
                yield key, node[key], f"{path}.{key}"
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                for name, child in node[key].items():
                    yield key, child, f"{path}.{key}.{name}"
        for key in SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                for i, child in enumerate(node[key]):
                    yield key, child, f"{path}.{key}[{i}]"

    def _place(self, ref: str) -> str:
        """Where a reference's target is, as a path after the schema's field."""
        return self.where + unquote(ref[1:]).replace("/", ".") if ref.startswith("#") else ref

    def _resolve(self, ref: str):
        """The subschema a local reference (``#/...``) names; None for any other."""
        if not ref.startswith("#"):
            return None
        node = self.root
        for part in filter(None, unquote(ref[1:]).split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def count(self, node, path: str, refs: tuple = ()) -> int:
        """The object or array alternatives a value of ``node`` has: anyOf/oneOf branches
        added (nested unions flattened), allOf parts multiplied, a reference's target's;
        a branch that can only be a scalar counts none (llguidance lexes those)."""
        if not isinstance(node, dict):
            return 1
        n = 1
        for union in ("anyOf", "oneOf"):
            if isinstance(node.get(union), list):
                branches = enumerate(node[union])
                n = sum(self.count(b, f"{path}.{union}[{i}]", refs) for i, b in branches)
        if isinstance(node.get("allOf"), list):
            for i, part in enumerate(node["allOf"]):
                n *= max(1, self.count(part, f"{path}.allOf[{i}]", refs))
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in refs:
            if ref not in self.branches:
                self.branches[ref] = 1
                target = self._resolve(ref)
                self.branches[ref] = self.count(target, self._place(ref), (*refs, ref))
            n *= max(1, self.branches[ref])
        if n > MAX_BRANCHES:
            what = f"{n} object or array alternatives for one value; at most {MAX_BRANCHES}"
            self.fail(path, what)
        return 0 if _scalar_only(node) else n

    def check_branches(self, node, path: str):
        """``count`` at every subschema."""
        if not isinstance(node, dict):
            return
        self.count(node, path)
        for _, child, at in self._children(node, path):
            self.check_branches(child, at)


def _scalar_only(node: dict) -> bool:
    """A subschema whose values can only be scalars (by its type, const or enum)."""
    kind = node.get("type")
    if isinstance(kind, str):
        return kind in SCALARS
    if isinstance(kind, list) and kind:
        return all(k in SCALARS for k in kind)
    values = [node["const"]] if "const" in node else node.get("enum")
    if isinstance(values, list) and values:
        return not any(isinstance(v, (dict, list)) for v in values)
    return False


def check_schema(schema, where: str):
    """ValueError naming the place in ``schema`` (a JSON schema from a request, at
    ``where``) that is over a bound: subschemas nested more than ``MAX_DEPTH`` deep
    (following ``$ref``), more than ``MAX_BRANCHES`` object or array alternatives for one
    value, more than ``MAX_PROPERTIES`` properties in one object, more than ``MAX_NODES``
    subschemas. Checked before any grammar is built from it."""
    if not isinstance(schema, dict):
        return
    bounds = _Bounds(schema, where)
    bounds.walk(schema, where)
    bounds.check_branches(schema, where)


# JSON responses.


def json_schema_grammar(
    tokenizer, schema: dict, thinking: bool = False, where: str = "schema"
) -> str:
    """The Lark grammar of a reply whose response is one JSON value of ``schema`` (compiled,
    and so checked, by the processor that takes it)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(schema).__name__}")
    check_schema(schema, where)
    return _start(tokenizer, _json_rule(schema), thinking)


def json_schema(
    tokenizer, schema: dict, thinking: bool = False, where: str = "schema"
) -> GrammarProcessor:
    """A processor whose response is one JSON value of ``schema`` (llguidance's JSON-schema
    subset; a keyword it does not implement is a ValueError naming it, after ``where``)."""
    grammar = json_schema_grammar(tokenizer, schema, thinking, where)
    if thinking:  # the schema alone, so that one no value satisfies is named as such
        _check(tokenizer, f"start: {_json_rule(schema)}\n", where)
    return GrammarProcessor(tokenizer, grammar, where)


def json_object(tokenizer, thinking: bool = False) -> GrammarProcessor:
    """A processor whose response is one JSON object (any keys and values)."""
    return json_schema(tokenizer, {"type": "object"}, thinking)


# Tool calls.


def _json_type(value) -> str:
    """The JSON-schema type name of a JSON value, as ``chat._argument`` names it."""
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if value is None:
        return "null"
    return next(t for cls, t in _JSON_TYPES if isinstance(value, cls))


def _types_of(schema: dict, where: str) -> list[str]:
    """The argument types ``schema`` allows: its ``type``, else those of its ``enum`` or
    ``const`` values, else all."""
    if "type" in schema:
        kind = schema["type"]
        kinds = [kind] if isinstance(kind, str) else list(kind)
    elif "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        kinds = list(dict.fromkeys(_json_type(v) for v in values))
    else:
        kinds = list(ARGUMENT_TYPES)
    unknown = [k for k in kinds if k not in ARGUMENT_TYPES]
    if unknown or not kinds:
        raise ValueError(f"{where}.type: unsupported type {unknown or kinds!r}")
    return kinds


def _raw_string(schema: dict, where: str) -> str:
    """A ``type="string"`` argument's value: raw text (no quotes, no special ids)."""
    extra = sorted(set(schema) - STRING_KEYWORDS - ANNOTATIONS)
    if extra:
        raise ValueError(
            f"{where}.{extra[0]}: not supported for a string argument (the chat format "
            "writes string arguments as raw text)"
        )
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if choices is not None:
        texts = [c for c in choices if isinstance(c, str)]
        if not texts:
            raise ValueError(f"{where}.enum: no string value")
        return "(" + " | ".join(_literal(t) for t in texts) + ")"
    if "pattern" in schema:
        return _regex(schema["pattern"])
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    return _regex(f"(?s:.{{{low},{'' if high is None else high}}})")


def _argument_rule(tokenizer, key: str | None, schema, where: str) -> str:
    """One ``argument`` element for ``key`` (None: any key): an alternative per JSON type
    ``schema`` allows, with the ``type`` attribute and value as ``chat._argument`` writes
    them (``<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>``)."""
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object")
    check_schema(schema, where)  # its own root: its $ref resolve within it
    for union in ("anyOf", "oneOf"):
        if union in schema and "type" not in schema:
            options = schema[union]
            if not isinstance(options, list) or not all(isinstance(b, dict) for b in options):
                raise ValueError(f"{where}.{union} must be a list of JSON schema objects")
            rest = {k: v for k, v in schema.items() if k != union}
            branches = [
                _argument_rule(tokenizer, key, {**rest, **branch}, f"{where}.{union}[{i}]")
                for i, branch in enumerate(options)
            ]
            return "(" + " | ".join(branches) + ")"
    ids = marker_ids(tokenizer)
    key_rule = "KEY" if key is None else _literal(escape_attr(key))
    tail = _lark_segments(tokenizer, close_tag("argument"))
    alternatives = []
    for kind in _types_of(schema, where):
        if kind == "string":
            value = _raw_string(schema, where)
        else:
            value = _json_rule({**schema, "type": kind})
            _check(tokenizer, f"start: {value}\n", where)
        after_key = _literal(f'" type="{kind}"')
        head = f'<[{ids[OPEN]}]> "argument key=\\"" {key_rule} {after_key} <[{ids[SEP]}]>'
        alternatives.append(f"{head} {value} {tail}")
    return "(" + " | ".join(alternatives) + ")"


def _arguments(tokenizer, params, where: str) -> str:
    """The arguments of a call: the declared properties in order, required ones always."""
    if params is None:
        return ""
    if not isinstance(params, dict):
        raise ValueError(f"{where} must be a JSON schema object")
    check_schema(params, where)
    extra = sorted(set(params) - PARAMETER_KEYWORDS - ANNOTATIONS)
    if extra:
        raise ValueError(f"{where}.{extra[0]}: not supported in tool parameters")
    if params.get("type", "object") != "object":
        raise ValueError(f"{where}.type must be 'object', got {params.get('type')!r}")
    props = params.get("properties") or {}
    required = params.get("required") or []
    missing = [r for r in required if r not in props]
    if missing:
        raise ValueError(f"{where}.required names {missing[0]!r}, which is not in properties")
    if not props:
        if params.get("additionalProperties", True) is False:
            return ""
        return _argument_rule(tokenizer, None, {}, f"{where}.additionalProperties") + "*"
    parts = []
    for key, schema in props.items():
        rule = _argument_rule(tokenizer, key, schema, f"{where}.properties.{key}")
        parts.append(rule if key in required else rule + "?")
    return " ".join(parts)


def _functions(tools) -> list[dict]:
    """``tools`` as ``[{"name", "parameters"}]`` (OpenAI ``{"type": "function",
    "function": {...}}`` entries or the function objects themselves)."""
    if not tools:
        raise ValueError("tools: a forced tool call needs at least one tool")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: {len(tools)} tools; a forced tool call takes at most {MAX_TOOLS}")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] is not a function with a name")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type {tool.get('type')!r} is not supported")
        out.append({"name": fn["name"], "parameters": fn.get("parameters"), "at": i})
    return out


def tool_call_grammar(tokenizer, tools, name: str | None = None, thinking: bool = False) -> str:
    """The Lark grammar of a reply that is a tool call (see ``tool_call``; compiled, and so
    checked, by the processor that takes it)."""
    functions = _functions(tools)
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice.function.name {name!r} is not among the tools")
    rules = []
    for f in functions:
        where = f"tools[{f['at']}].function.parameters"
        rules.append(f"args{f['at']}: {_arguments(tokenizer, f['parameters'], where)}")
    most = 1 if name is not None else MAX_CALLS
    for index in range(1, most + 1):
        calls = []
        for f in functions:
            head = _lark_segments(tokenizer, open_tag("call", tool=f["name"], index=index))
            tail = _lark_segments(tokenizer, close_tag("call"))
            calls.append(f"{head} args{f['at']} {tail}")
        more = f" call{index + 1}?" if index < most else ""
        rules.append(f"call{index}: ({' | '.join(calls)}){more}")
    segs = _lark_segments(tokenizer, close_tag("response") + open_tag("tools"))
    end = _lark_segments(tokenizer, close_tag("tools") + close_tag("message"))
    rules.append('KEY: /([^"&]|&amp;|&quot;)+/')  # an attribute value as escape_attr writes it
    grammar = _start(tokenizer, f"{segs} call1 {end}", thinking, rules)
    return grammar


def tool_call(tokenizer, tools, name: str | None = None, thinking: bool = False):
    """A processor whose reply is a tool call in the K3 chat format: an empty response,
    then ``<|open|>tools<|sep|>`` with calls ``<|open|>call tool="NAME" index="i"<|sep|>``
    of the ``tools`` (OpenAI function entries) and the message closed. With ``name`` one
    call of that function; without, one to ``MAX_CALLS`` calls of any of them.

    Arguments follow each function's ``parameters`` (an object schema): its properties in
    declaration order, required ones always, each as the chat format writes it: a string
    raw (``enum``, ``const``, ``pattern``, ``minLength``, ``maxLength`` honoured), any other
    type JSON constrained by the property's schema through llguidance. A function with no
    declared properties takes arguments of any key unless ``additionalProperties`` is
    false; declared functions never get undeclared arguments."""
    return GrammarProcessor(tokenizer, tool_call_grammar(tokenizer, tools, name, thinking), "tools")


# The OpenAI request fields.


def processor_for(
    tokenizer, response_format: dict | None, tool_choice, tools, thinking: bool = False
) -> GrammarProcessor | None:
    """The processor that enforces a chat request's ``response_format`` and ``tool_choice``
    (plain JSON values as the request holds them), or None when they constrain nothing.

    ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name": N}}``
    forces a call (it wins over ``response_format``, which then has no response to shape);
    ``"auto"``, ``"none"`` or absent leave the reply to ``response_format``: ``text`` or
    absent is free, ``json_object`` one JSON object, ``json_schema`` one value of
    ``json_schema.schema`` (absent: any JSON value). ``thinking``: the prompt opened the
    ``think`` section. Unsupported values raise ValueError naming the field.
    """
    if tool_choice is not None and tool_choice not in ("auto", "none"):
        if tool_choice == "required":
            return tool_call(tokenizer, tools, None, thinking)
        if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
            raise ValueError(f"tool_choice {tool_choice!r} is not supported")
        name = (tool_choice.get("function") or {}).get("name")
        if not isinstance(name, str):
            raise ValueError("tool_choice.function.name is required")
        return tool_call(tokenizer, tools, name, thinking)
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object(tokenizer, thinking)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object")
        where = "response_format.json_schema.schema"
        return json_schema(tokenizer, spec.get("schema", {}), thinking, where)
    raise ValueError(f"response_format.type {kind!r} is not supported")
