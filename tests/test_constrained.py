"""``kimi_k3.serve.constrained`` on the embedded default model, which writes Python and never JSON
or the chat format by itself: greedy decoding under a grammar gives a JSON object, a value
of a schema, a tool call of the forced function, the same tokens through the serving
engine as through mlx-lm; the mask never allows a special id the grammar does not name;
the chat format's own rendering of a reply is what the grammars accept; bad requests fail
naming their field."""

import json
import re
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate

import kimi_k3
from kimi_k3.default_model import PROMPT, ensure_default_model
from kimi_k3.serve import constrained, grammar_check
from kimi_k3.serve.engine import Engine, Sequence
from kimi_k3.text.chat import (
    CLOSE,
    close_tag,
    encode_chat,
    encode_segments,
    marker_ids,
    open_tag,
    parse_reply,
)
from kimi_k3.text.tokenizer import stop_ids

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "debug": {"type": "boolean"},
    },
    "required": ["name", "size", "debug"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Rome"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "units": {"type": ["string", "null"], "enum": ["C", "F", None]},
                },
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def demo():
    """The default model in fp32 (the engine and mlx-lm then pick the same tokens)."""
    return kimi_k3.load(ensure_default_model(), dtype=mx.float32)


@pytest.fixture(scope="module")
def tok(demo):
    return demo[1]


def generate(demo, prompt, processors, n=120) -> list[int]:
    """Greedy tokens after ``prompt`` (text or ids), stop ids removed."""
    model, tok = demo
    out = [r.token for r in stream_generate(model, tok, prompt, n, logits_processors=processors)]
    return [t for t in out if t not in stop_ids(tok)]


def parses_to_dict(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def chat_prompt(tok):
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    return encode_chat(tok, messages, tools=TOOLS, thinking=False)


def test_json_object_output_parses(demo, tok):
    free = tok.decode(generate(demo, PROMPT, None, 60))
    assert not parses_to_dict(free)
    text = tok.decode(generate(demo, PROMPT, [constrained.json_object(tok)]))
    assert parses_to_dict(text), text


def test_json_schema_output_validates(demo, tok):
    jsonschema = pytest.importorskip("jsonschema")
    prompt = 'config = {"name": "x", "size": 3}\nsettings = '
    free = tok.decode(generate(demo, prompt, None, 60))
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), SCHEMA)
    text = tok.decode(generate(demo, prompt, [constrained.json_schema(tok, SCHEMA)]))
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.slow
def test_tool_call_forces_the_named_function(demo, tok):
    prompt = chat_prompt(tok)
    free = generate(demo, prompt, None, 60)
    assert parse_reply(free, tok, thinking=False).tool_calls == []
    for name in ("get_weather", "ping"):
        ids = generate(demo, prompt, [constrained.tool_call(tok, TOOLS, name)], 200)
        reply = parse_reply(ids, tok, thinking=False)
        assert reply.finished and reply.response == ""
        assert [c["name"] for c in reply.tool_calls] == [name]
        args = reply.tool_calls[0]["arguments"]
        if name == "get_weather":
            assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7
            assert set(args) <= {"city", "days", "units"}


def test_tool_choice_required_calls_one_of_the_tools(demo, tok):
    proc = constrained.processor_for(tok, None, "required", TOOLS)
    calls = parse_reply(generate(demo, chat_prompt(tok), [proc], 200), tok, thinking=False)
    assert calls.tool_calls and all(c["name"] in ("get_weather", "ping") for c in calls.tool_calls)


def allowed_along(proc, ids):
    """The allowed-token mask before each of ``ids`` and after the last, fed in turn."""
    masks = []
    for token in ids:
        masks.append(proc.allowed().copy())
        proc.advance([token])
    masks.append(proc.allowed().copy())
    return masks


def special_ids(tok):
    return set(tok.added_tokens_decoder)


def test_mask_never_allows_specials_inside_the_grammar(tok):
    stops = set(stop_ids(tok))
    doc = tok.encode('{"a": [1, 2.5, null], "b": {"c": "d"}}')
    masks = allowed_along(constrained.json_object(tok), doc)
    for mask in masks[:-1]:
        assert not set(np.flatnonzero(mask)) & special_ids(tok)
    assert set(np.flatnonzero(masks[-1])) == stops
    # The processor's logits: -inf exactly where the mask is off.
    proc = constrained.json_object(tok)
    logits = mx.zeros((1, len(masks[0])))
    out = np.array(proc(mx.array(tok.encode("x = ")), logits))[0]
    assert np.array_equal(np.isfinite(out), masks[0])


def rendered_call(tok, name="get_weather", args=None, thinking=False) -> list[int]:
    """The ids of an assistant message with one call (and reasoning, with ``thinking``) as
    the chat format renders it, after its generation prompt, up to ``<|end_of_msg|>``
    (which is cut)."""
    args = {"city": "Rome", "days": 3, "units": None} if args is None else args
    msg = {"role": "assistant", "content": "", "tool_calls": [{"name": name, "arguments": args}]}
    if thinking:
        msg["reasoning"] = "Rome, 3 days."
    full = encode_chat(tok, [msg], add_generation_prompt=False)
    prompt = encode_chat(tok, [], thinking=thinking)
    assert full[: len(prompt)] == prompt and full[-1] in stop_ids(tok)
    return full[len(prompt) : -1]


@pytest.mark.parametrize("thinking", [False, True])
def test_grammars_accept_the_chat_formats_own_rendering(tok, thinking):
    """The rendered call is accepted; along it the only specials allowed are the chat
    markers (in the reasoning only ``<|close|>``), the stops only at the end."""
    stops = set(stop_ids(tok))
    markers = set(marker_ids(tok).values()) - stops
    reply = rendered_call(tok, thinking=thinking)
    proc = constrained.tool_call(tok, TOOLS, "get_weather", thinking=thinking)
    masks = allowed_along(proc, reply)
    assert proc.done
    for mask in masks[:-1]:
        assert set(np.flatnonzero(mask)) & special_ids(tok) <= markers
    assert set(np.flatnonzero(masks[-1])) == stops
    if thinking:  # before any reasoning: text or the end of the think section
        assert set(np.flatnonzero(masks[0])) & special_ids(tok) == {
            tok.convert_tokens_to_ids(CLOSE)
        }
    wrong = constrained.tool_call(tok, TOOLS, "ping", thinking=thinking)
    with pytest.raises(ValueError, match="outside the grammar"):
        wrong.advance(reply)
    if thinking:
        segs = [("Plan: a JSON object.", False), *close_tag("think")]
        segs += open_tag("response") + [('{"ok": true}', False)]
        proc = constrained.json_object(tok, thinking=True)
        proc.advance(encode_segments(tok, segs))
        assert proc.done


def test_engine_gives_the_tokens_of_stream_generate(demo, tok):
    model, _ = demo
    prompt = tok.encode(PROMPT)
    want = generate(demo, prompt, [constrained.json_object(tok)])
    engine = Engine(model, reuse_bytes=0)
    try:
        seq = Sequence(
            prompt,
            120,
            processors=[constrained.json_object(tok)],
            stop_ids=frozenset(stop_ids(tok)),
        )
        engine.submit(seq)
        got = []
        while (event := seq.out.get(timeout=60))[0] == "token":
            got.append(event[1])
    finally:
        engine.stop()
    assert event == ("done", "stop")
    assert got == want and parses_to_dict(tok.decode(got))


def test_processor_for_maps_the_openai_fields(tok):
    assert constrained.processor_for(tok, None, None, None) is None
    assert constrained.processor_for(tok, {"type": "text"}, "auto", TOOLS) is None
    assert constrained.processor_for(tok, None, "none", TOOLS) is None
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    proc = constrained.processor_for(tok, fmt, None, None)
    proc.advance(tok.encode('{"name": "a", "size": 1, "debug": true}'))
    assert proc.done
    named = {"type": "function", "function": {"name": "ping"}}
    proc = constrained.processor_for(tok, {"type": "json_object"}, named, TOOLS)
    assert "ping" in proc.grammar and "get_weather" not in proc.grammar


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda t: constrained.processor_for(t, {"type": "xml"}, None, None),
            "response_format.type 'xml' is not supported",
        ),
        (
            lambda t: constrained.processor_for(
                t,
                {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "array", "uniqueItems": True}},
                },
                None,
                None,
            ),
            r"response_format\.json_schema\.schema: .*uniqueItems",
        ),
        (lambda t: constrained.json_schema(t, {"type": "string", "format": "colour"}), "colour"),
        (
            lambda t: constrained.processor_for(
                t, None, {"type": "function", "function": {"name": "nope"}}, TOOLS
            ),
            "tool_choice.function.name 'nope' is not among the tools",
        ),
        (lambda t: constrained.processor_for(t, None, "required", None), "tools"),
        (lambda t: constrained.processor_for(t, None, "always", TOOLS), "tool_choice 'always'"),
        (
            lambda t: constrained.tool_call(
                t,
                [
                    {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"d": {"type": "string", "format": "date"}},
                        },
                    }
                ],
            ),
            r"tools\[0\]\.function\.parameters\.properties\.d\.format",
        ),
        (
            lambda t: constrained.tool_call(
                t,
                [
                    {
                        "name": "f",
                        "parameters": {"properties": {"n": {"type": "array", "uniqueItems": True}}},
                    }
                ],
            ),
            r"parameters\.properties\.n: .*uniqueItems",
        ),
        (
            lambda t: constrained.tool_call(t, [{"name": "f", "parameters": {"anyOf": []}}]),
            r"parameters\.anyOf",
        ),
    ],
)
def test_bad_requests_name_their_field(tok, call, message):
    with pytest.raises(ValueError, match=message):
        call(tok)


def test_processor_needs_the_sequence_tokens(tok):
    with pytest.raises(ValueError, match="one sequence"):
        constrained.json_object(tok)(None, mx.zeros((1, 4096)))
    proc = constrained.json_object(tok)
    proc(mx.array(tok.encode("a = 1\nb = ")), mx.zeros((1, 4096)))
    with pytest.raises(ValueError, match="one sequence"):
        proc(mx.array(tok.encode("c")), mx.zeros((1, 4096)))


def test_missing_library_is_a_clear_import_error(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match="pip install llguidance"):
        constrained.json_object(tok)


RICH = [
    {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                "b": {"enum": ["x", 2, True]},
                "c": {"type": "array", "items": {"type": "string"}},
                "d": {"type": "string", "pattern": "[a-z]+"},
                "e": {"type": "number"},
            },
            "required": ["a", "b", "c", "d"],
        },
    }
]


@pytest.mark.parametrize(
    "args, ok",
    [
        ({"a": None, "b": "x", "c": ["p", "q"], "d": "abc"}, True),
        ({"a": 5, "b": 2, "c": [], "d": "z", "e": 0.5}, True),
        ({"a": 5, "b": True, "c": [], "d": "z"}, True),
        ({"a": "s", "b": "x", "c": [], "d": "z"}, False),  # a: not an integer or null
        ({"a": 1, "b": "y", "c": [], "d": "z"}, False),  # b: not in the enum
        ({"a": 1, "b": "x", "c": [], "d": "Z"}, False),  # d: does not match the pattern
        ({"a": 1, "b": "x", "c": [1], "d": "z"}, False),  # c: items are strings
        ({"b": "x", "a": 1, "c": [], "d": "z"}, False),  # declaration order
        ({"a": 1, "b": "x", "c": []}, False),  # d is required
    ],
)
def test_tool_call_arguments_follow_the_parameters_schema(tok, args, ok):
    """A call rendered by the chat format is accepted exactly when its arguments are valid."""
    proc = constrained.tool_call(tok, RICH)
    if ok:
        proc.advance(rendered_call(tok, "f", args))
        assert proc.done
    else:
        with pytest.raises(ValueError, match="outside the grammar"):
            proc.advance(rendered_call(tok, "f", args))


def test_undeclared_parameters_take_any_key_and_keys_are_escaped(tok):
    proc = constrained.tool_call(tok, TOOLS, "ping")
    proc.advance(rendered_call(tok, "ping", {"x": 1, "note": 'say "hi" & go', "deep": {"a": []}}))
    assert proc.done
    odd = [{"name": "g", "parameters": {"properties": {'a"&b': {"type": "integer"}}}}]
    proc = constrained.tool_call(tok, odd)
    proc.advance(rendered_call(tok, "g", {'a"&b': 7}))
    assert proc.done
    closed = [{"name": "h", "parameters": {"type": "object", "additionalProperties": False}}]
    with pytest.raises(ValueError, match="outside the grammar"):
        constrained.tool_call(tok, closed).advance(rendered_call(tok, "h", {"x": 1}))


def test_benchmark_table(capsys):
    from benchmarks import bench_constrained

    bench_constrained.main(["--libraries", "llguidance", "--repeats", "1", "--decode-tokens", "0"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| llguidance")]
    assert [r.split(" | ")[2] for r in rows] == ["json_object", "json_schema"]


# Grammars from hostile requests: bounded before compiling, compiled first in a worker.


def ref_chain(depth: int) -> dict:
    """Objects nested ``depth`` deep through a chain of ``$ref``s, an integer at the end."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
            "required": ["a"],
        }
        for i in range(depth)
    }
    return {"$defs": {**defs, f"d{depth}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def objects(n: int, prefix: str = "k") -> list[dict]:
    """``n`` object schemas, each with one required key of its own."""
    return [
        {
            "type": "object",
            "properties": {f"{prefix}{i}": {"type": "integer"}},
            "required": [f"{prefix}{i}"],
        }
        for i in range(n)
    ]


WHERE = "response_format.json_schema.schema"


@pytest.mark.parametrize(
    "schema, message",
    [
        (ref_chain(1000), r"\.\$defs\.d\d+: subschemas nested more than 32 deep"),
        ({"anyOf": objects(2500)}, r": 2500 object or array alternatives"),
        (
            {"type": "object", "properties": {"x": {"anyOf": [{"anyOf": objects(50)}] * 50}}},
            r"\.properties\.x: 2500 object or array alternatives",
        ),
        ({"allOf": [{"anyOf": objects(30, "a")}, {"anyOf": objects(30, "b")}]}, "900 object"),
        (
            {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(300)}},
            r"\.properties: 300 properties; at most 256",
        ),
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, ": no text satisfies it"),
        ({"$ref": "#"}, ": no text satisfies it"),
    ],
)
def test_schemas_over_the_bounds_are_refused_naming_the_place(tok, schema, message):
    """A schema nested too deep through ``$ref`` (1,000 deep overflows llguidance's stack),
    with too many object alternatives for one value (2,500 compile, then fail at the first
    token), too many properties, or that no JSON value matches (llguidance's matcher then
    allows only a stop id: an empty reply) is refused naming its place."""
    for thinking in (False, True):
        with pytest.raises(ValueError, match=rf"^{re.escape(WHERE)}.*{message}") as e:
            constrained.json_schema(tok, schema, thinking, WHERE)
        assert len(str(e.value)) < 400


def test_bounds_leave_recursive_and_wide_scalar_schemas_alone(tok):
    """A schema that refers to itself through an array (a tree), and scalar enums and unions
    of thousands of values (llguidance lexes those), compile; a depth of 10 through ``$ref``
    too."""
    tree = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "kids": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["name"],
    }
    wide = {
        "type": "object",
        "properties": {
            "tz": {"enum": [f"Zone/City{i}" for i in range(3000)]},
            "n": {"anyOf": [{"const": i} for i in range(3000)]},
        },
    }
    for schema in (tree, wide, ref_chain(10)):
        proc = constrained.json_schema(tok, schema)
        assert proc.allowed().any()


def test_the_same_chain_in_a_tool_parameter_is_refused(tok):
    params = {"type": "object", "properties": {"x": ref_chain(1000)}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters\.properties\.x"):
        constrained.processor_for(tok, None, "required", tools)
    with pytest.raises(ValueError, match="at most 128"):
        constrained.processor_for(tok, None, "required", [TOOLS[1]] * 129)


def test_a_grammar_that_crashes_the_compiler_fails_alone(tok):
    """The 1,000-deep chain, its bounds skipped, crashes the worker that compiles it (a
    stack overflow in llguidance), not this process; the next grammar gets a new worker."""
    grammar = constrained._start(tok, constrained._json_rule(ref_chain(1000)), False)
    error = constrained.checker(tok).check(grammar)
    assert error.startswith("refused: its compile crashed the grammar compiler"), error
    assert constrained.checker(tok).check(constrained._start(tok, "%json{}", False)) is None
    with pytest.raises(ValueError, match=r"^tools: refused: its compile crashed"):
        constrained.GrammarProcessor(tok, grammar, "tools")


def test_a_grammar_past_its_time_fails_alone(tok):
    """A compile that runs past the checker's time limit is cut off (its worker killed)."""
    slow = {"anyOf": objects(2500)}  # about 0.4 s to compile on a 2-core x86 machine
    grammar = constrained._start(tok, constrained._json_rule(slow), False)
    checker = grammar_check.GrammarChecker(
        constrained._tokenizer_json(tok._tokenizer), stop_ids(tok), workers=1, seconds=0.005
    )
    try:
        assert checker.check(grammar) == "refused: its compile took more than 0.005 s"
        checker.seconds = 60
        assert checker.check(grammar) is None
    finally:
        checker.close()


def test_a_limit_reached_while_generating_is_a_grammar_error_naming_the_field(tok):
    """2,500 object alternatives below a key (the bounds skipped) compile and pass the first
    mask, then reach llguidance's limit of 2,000 items a row a few tokens in: the processor
    raises ``GrammarError`` naming its field, in a message that does not quote the grammar."""
    schema = {"type": "object", "properties": {"x": {"anyOf": [{"anyOf": objects(50)}] * 50}}}
    proc = constrained.GrammarProcessor(
        tok, constrained._start(tok, constrained._json_rule(schema), False), WHERE
    )
    with pytest.raises(constrained.GrammarError) as e:
        for token in tok.encode('{"x": {"k', add_special_tokens=False):
            proc.advance([token])
            proc.allowed()
    assert e.value.param == WHERE and "max is 2000" in str(e.value)
    assert len(str(e.value)) < 400
