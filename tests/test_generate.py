"""``python -m kimi_k3.generate`` end to end, the chat session's cache, the default model."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm import stream_generate
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import save_config, save_model

import kimi_k3
from kimi_k3 import default_model
from kimi_k3.convert.convert import Settings, convert
from kimi_k3.generate import (
    ChatSession,
    Generated,
    Shown,
    close_reply,
    generate,
    main,
    run_once,
    setup_arg_parser,
)
from kimi_k3.text.chat import encode_chat, encode_segments, render_text
from kimi_k3.text.tokenizer import load_tokenizer, never_sample

STATS = re.compile(
    r"stats: prompt: (\d+) tokens, [\d.]+ tok/s \| generation: (\d+) tokens, "
    r"[\d.]+ tok/s \| peak memory: [\d.]+ GB \| experts: (.*)"
)


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    return kimi_k3.load(tiny_ckpt)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "cache"))


def run_cli(*args, stdin=None, env=None, timeout=120):
    """The CLI in a subprocess; output decoded without newline translation (a token may
    be a lone ``\\r``)."""
    out = subprocess.run(
        [sys.executable, "-m", "kimi_k3.generate", *map(str, args)],
        input=stdin and stdin.encode(),
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    out.stdout, out.stderr = out.stdout.decode(), out.stderr.decode()
    return out


def expected_text(model, tokenizer, ids, max_tokens, chat=True):
    """What the CLI prints for greedy mlx-lm generation from ``ids``, with the CLI's mask on
    reserved and unusable specials: in chat mode the reply's text (``Shown``), raw every
    token's text."""
    masked = [never_sample(tokenizer)]
    responses = list(
        stream_generate(model, tokenizer, ids, max_tokens=max_tokens, logits_processors=masked)
    )
    if not chat:
        return "".join(r.text for r in responses) + "\n"
    shown = Shown(tokenizer, thinking=True)
    return "".join(shown.add(r.token) for r in responses) + shown.end()


@pytest.mark.slow
def test_chat_end_to_end(tiny_ckpt, tiny):
    """Text on stdout equals greedy mlx-lm generation from ``encode_chat`` ids; a typed
    marker stays text (the prompt count is that of ``encode_chat``, not of the string)."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say <|open|> please"},
    ]
    ids = encode_chat(tiny[1], messages)
    assert len(ids) != len(tiny[1].encode(render_text(messages)))
    out = run_cli(
        "--model",
        tiny_ckpt,
        "--system",
        "Be brief.",
        "--prompt",
        "Say <|open|> please",
        "--max-tokens",
        12,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected_text(*tiny, ids, 12)
    unmasked = "".join(r.text for r in stream_generate(*tiny, ids, max_tokens=12))
    assert "<|reserved_token_" in unmasked and "<|reserved_token_" not in out.stdout
    stats = STATS.search(out.stderr)
    assert stats, out.stderr
    assert int(stats[1]) == len(ids) and 1 <= int(stats[2]) <= 12
    assert stats[3] == "resident"
    assert "loading [" in out.stderr and "100%" in out.stderr


def test_raw_and_no_thinking(tiny_ckpt, tiny, capsys):
    """In process (``main``), the same path as the subprocess runs."""
    assert (
        main(
            [
                "--model",
                str(tiny_ckpt),
                "--raw",
                "--prompt",
                "Once upon a time",
                "--max-tokens",
                "5",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    ids = tiny[1].encode("Once upon a time", add_special_tokens=False)
    assert int(STATS.search(out.err)[1]) == len(ids)
    assert out.out == expected_text(*tiny, ids, 5, chat=False)
    assert (
        main(["--model", str(tiny_ckpt), "--no-thinking", "--prompt", "Hi", "--max-tokens", "3"])
        == 0
    )
    ids = encode_chat(tiny[1], [{"role": "user", "content": "Hi"}], thinking=False)
    assert int(STATS.search(capsys.readouterr().err)[1]) == len(ids)


@pytest.fixture
def long_context_ckpt(tiny_ckpt, tmp_path):
    """The tiny checkpoint (files linked) with max_position_embeddings = 40."""
    out = tmp_path / "short"
    out.mkdir()
    for f in tiny_ckpt.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 40
    (out / "config.json").write_text(json.dumps(config))
    return out


def _broken(tiny_ckpt, tmp_path):
    out = tmp_path / "broken"
    out.mkdir()
    for f in tiny_ckpt.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    shard = sorted(out.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return out, shard


def _not_k3(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path / "llama"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "not-k3", "broken", "too-long"])
def test_bad_input(case, tiny_ckpt, tmp_path, long_context_ckpt):
    """One ``error:`` line on stderr naming the problem, exit code 1, nothing on stdout."""
    prompt = ["--prompt", "a prompt of a few words, more than forty tokens in chat form"]
    if case == "missing":
        args, want = ["--model", tmp_path / "nowhere"], r"nowhere: no such model directory"
    elif case == "not-k3":
        args, want = ["--model", _not_k3(tmp_path)], r"model_type is 'llama', not 'kimi_k3'"
    elif case == "broken":
        path, shard = _broken(tiny_ckpt, tmp_path)
        args, want = ["--model", path], rf"{re.escape(str(shard))}: truncated"
    else:
        args, want = ["--model", long_context_ckpt], r"holds 40 \(max_position_embeddings\)"
    out = run_cli(*args, *prompt)
    assert out.returncode == 1
    assert out.stdout == ""
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(want, errors[0]), out.stderr


def test_max_context(tiny_ckpt, tiny, capsys):
    """--max-context caps the reply, and refuses a prompt that leaves no room."""
    ids = encode_chat(tiny[1], [{"role": "user", "content": "Hi"}])
    argv = ["--model", str(tiny_ckpt), "--prompt", "Hi", "--max-tokens", "50", "--max-context"]
    assert main(argv + [str(len(ids) + 3)]) == 0
    err = capsys.readouterr().err
    assert int(STATS.search(err)[2]) == 3
    assert f"notice: the reply was cut at 3 tokens: the context holds {len(ids) + 3} " in err
    assert main(argv + [str(len(ids))]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: the prompt is {len(ids)} tokens, but the context holds {len(ids)} "
        "(--max-context), leaving no room for a reply"
    )


BAD_VALUES = [
    (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    (["--prefill-step-size", "-3"], "--prefill-step-size must be at least 1"),
    (["--max-context", "0"], "--max-context must be at least 1"),
    (["--temp", "-1"], "--temp must be at least 0"),
    (["--temp", "nan"], "--temp must be at least 0"),
    (["--top-p", "0"], "--top-p must be above 0 and at most 1"),
    (["--min-p", "1.5"], "--min-p must be at least 0 and at most 1"),
    (["--top-k", "-1"], "--top-k must be at least 0"),
    (["--expert-cache-gb", "0"], "--expert-cache-gb must be a positive number of GB"),
    (["--expert-cache-gb", "-1"], "--expert-cache-gb must be a positive number of GB"),
    (["--expert-cache-gb", "0.0000002"], "--expert-cache-gb 2e-07 is too small for "),
    (["--expert-top-p", "0"], "--expert-top-p must be above 0 and at most 1, got 0.0"),
    (["--expert-top-p", "1.01"], "--expert-top-p must be above 0 and at most 1"),
    (["--expert-top-p", "nan"], "--expert-top-p must be above 0 and at most 1, got nan"),
    (["--expert-min-weight", "-0.1"], "--expert-min-weight must be at least 0 and below 1"),
    (["--expert-min-weight", "1"], "--expert-min-weight must be at least 0 and below 1"),
    (["--expert-min-weight", "nan"], "--expert-min-weight must be at least 0 and below 1"),
    (["--shed-misses", "1.01"], "--shed-misses must be at least 0 and at most 1, got 1.01"),
    (["--shed-misses", "-0.1"], "--shed-misses must be at least 0 and at most 1"),
    (["--max-tokens", "lots"], "argument --max-tokens/-m: invalid int value: 'lots'"),
    (["--chat", "--raw"], "argument --raw: not allowed with argument --chat"),
]


@pytest.mark.parametrize("argv,message", BAD_VALUES)
def test_bad_values_exit_2_before_loading(argv, message, tiny_ckpt, capsys):
    """One ``error:`` line naming the flag, exit status 2, nothing loaded."""
    try:
        code = main(["--model", str(tiny_ckpt), *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "synthetic" not in line]
    assert len(err) == 1 and err[0].startswith("error: " + message), err


@pytest.mark.parametrize("module", ["kimi_k3.generate", "kimi_k3.server"])
def test_every_flag_has_help_and_a_default(module):
    import importlib

    parser = importlib.import_module(module).setup_arg_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
    assert "(default: " in parser.format_help()


def test_synthetic_checkpoints_say_so(tiny_ckpt, capsys):
    from kimi_k3.convert.synth import SYNTHETIC_KEY

    assert json.loads((tiny_ckpt / "config.json").read_text())[SYNTHETIC_KEY]
    assert main(["--model", str(tiny_ckpt), "--max-tokens", "1"]) == 0
    assert "synthetic checkpoint: its weights are random" in capsys.readouterr().err


def test_special_tokens_are_hidden_unless_raw(tiny):
    """Chat output shows the reply's text only; ``[BOS]``, reserved ids and the markers
    with their tag names are not printed."""
    tok = tiny[1]
    specials = {
        name: i for i, name in ((i, t.content) for i, t in tok.added_tokens_decoder.items())
    }
    words = tok.encode("hello", add_special_tokens=False)
    reserved = next(i for name, i in specials.items() if name.startswith("<|reserved_token_"))
    ids = [specials["[BOS]"], *words, reserved]
    ids += encode_segments(tok, [("<|close|>", True), ("think", False), ("<|sep|>", True)])
    ids += encode_segments(tok, [("<|open|>", True), ("response", False), ("<|sep|>", True)])
    ids += words
    shown = Shown(tok, thinking=True)
    text = "".join(shown.add(i) for i in ids) + shown.end()
    assert text == "hello\n\nhello\n"


def test_ctrl_c_prints_stats_and_exits_130(tiny_ckpt):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kimi_k3.generate",
            "--model",
            str(tiny_ckpt),
            "--max-tokens",
            "1000000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.read(1)  # text is streaming
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert STATS.search(err) and "(interrupted)" in err


def test_interactive_keeps_the_cache(tiny_ckpt, tiny):
    """Two turns on stdin: the second feeds only the closing of the first reply plus the new
    message, not the whole conversation."""
    out = run_cli("--model", tiny_ckpt, "-i", "--max-tokens", 6, stdin="first\nsecond\n")
    assert out.returncode == 0, out.stderr
    stats = STATS.findall(out.stderr)
    assert len(stats) == 2
    first = encode_chat(tiny[1], [{"role": "user", "content": "first"}])
    assert int(stats[0][0]) == len(first)
    second = encode_chat(tiny[1], [{"role": "user", "content": "second"}])
    assert len(second) <= int(stats[1][0]) < len(first) + 6 + len(second)


@pytest.mark.slow
def test_chat_ctrl_c_returns_to_the_prompt(tiny_ckpt):
    """Ctrl-C during a reply stops it and drops the turn; the chat goes on (``/reset``
    confirms, ``/exit`` ends with status 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kimi_k3.generate", "--model", str(tiny_ckpt), "-i"]
        + ["--max-tokens", "1000000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        proc.stdin.write("tell me everything\n")
        proc.stdin.flush()
        assert proc.stdout.read(4)  # the reply is streaming
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate("/reset\n/exit\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "(interrupted)" in err
    assert err.index("reply stopped; the turn is dropped") < err.index("conversation cleared")


def _turn(session, text, capsys):
    reply = Generated()
    ids = session.turn_ids(text)
    args = setup_arg_parser().parse_args(["--max-tokens", "7"])
    generate(session.model, session.tokenizer, ids, args, session.cache, 7, reply)
    capsys.readouterr()
    session.record(ids, reply.tokens)
    return ids, reply.tokens


def test_session_continues_like_a_fresh_run(tiny_ckpt, capsys):
    """Turn 2 on the kept cache gives the tokens a fresh run over the whole history gives
    (fp32: in bf16 the different prefill split may flip a near-tie)."""
    model, tok = kimi_k3.load(tiny_ckpt, dtype=mx.float32)
    session = ChatSession(model, tok, system="sys", thinking=True)
    ids1, reply1 = _turn(session, "hello", capsys)
    ids2, reply2 = _turn(session, "and then?", capsys)
    system = encode_chat(tok, [{"role": "system", "content": "sys"}], add_generation_prompt=False)
    assert ids1[: len(system)] == system and ids2[: len(system)] != system
    history = ids1 + reply1 + ids2
    masked = [never_sample(tok)]
    fresh = [
        r.token
        for r in stream_generate(model, tok, history, max_tokens=7, logits_processors=masked)
    ]
    assert reply2 == fresh
    mla = next(
        c for layer, c in zip(model.layers, session.cache, strict=True) if not layer.is_linear
    )
    assert mla.offset == len(session.history)  # the cache holds exactly the history


def test_close_reply(tiny):
    tok = tiny[1]
    cut = encode_segments(
        tok,
        [
            ("I think", False),
            ("<|close|>", True),
            ("think", False),
            ("<|sep|>", True),
            ("<|open|>", True),
            ("response", False),
            ("<|sep|>", True),
            ("Hel", False),
        ],
    )
    closing = close_reply(tok, cut, thinking=True)
    assert tok.decode(closing) == ("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
    done = cut + close_reply(tok, cut, thinking=True)
    assert close_reply(tok, done, thinking=True) == []
    assert tok.decode(close_reply(tok, [], thinking=False)) == (
        "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )


def test_default_model_is_built_once(tmp_path):
    path = default_model.ensure_default_model()
    assert path.parent == tmp_path / "cache" and path.name.startswith("default-")
    mtime = (path / "config.json").stat().st_mtime_ns
    assert default_model.ensure_default_model() == path
    assert (path / "config.json").stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
    experts = default_model.expert_bytes(path)
    assert 0 < default_model.default_cache_gb(path) * 1e9 < experts / 2


@pytest.mark.slow
def test_default_model_cli_streams_experts(tmp_path):
    """No --model: copied fresh under $KIMI_K3_CACHE, says in one line what the model is,
    shows the default Python prompt and completes it, and the stats show experts read from
    disk."""
    out = run_cli("--max-tokens", 40, env={"KIMI_K3_CACHE": str(tmp_path / "fresh")})
    assert out.returncode == 0, out.stderr
    (path,) = (tmp_path / "fresh").glob("default-*")
    assert default_model.describe(path) in out.stderr.splitlines()
    prompt = load_tokenizer(default_model.package_dir()).encode(default_model.PROMPT)
    assert int(STATS.search(out.stderr)[1]) == len(prompt)  # the raw Python prompt
    shown = f"--- prompt: raw text, {len(prompt)} tokens ---\n{default_model.PROMPT}--- reply ---"
    assert shown in out.stderr and default_model.PROMPT not in out.stdout
    # the bar counts the dense weights as loaded, the line the checkpoint's: the same MB
    bar = re.search(r"loading dense weights \[#+\] 100% ([\d.]+)/([\d.]+) MB", out.stderr)
    assert bar and bar[1] == bar[2], out.stderr
    assert f"{float(bar[2]):.1f} MB dense weights" in default_model.describe(path)
    assert list((tmp_path / "fresh").glob("default-*/config.json"))
    experts = STATS.search(out.stderr)[3]
    rate, read = re.fullmatch(r"([\d.]+)% hit rate, ([\d.]+) GB read", experts).groups()
    assert float(read) > 0 and float(rate) < 100


def test_demo_model_says_what_it_is(tmp_path, capsys):
    """The demo's line is read from its checkpoint (layers, experts, dense and expert MB,
    training); in a chat it says the model has no chat training."""
    from kimi_k3 import cli
    from kimi_k3.model.config import ModelArgs

    path, budget = cli.resolve_model(None, None, chat=False)
    line = capsys.readouterr().err.strip()
    assert line == default_model.describe(path) and "\n" not in line
    args = ModelArgs.from_path(path)
    dense, experts = default_model.sizes(path)
    assert f"({args.num_hidden_layers} layers, {args.num_experts} experts a layer" in line
    assert f"{dense / 1e6:.1f} MB dense weights" in line
    assert f"{experts / 1e6:.1f} MB MXFP4 experts streamed" in line
    assert f"{(dense + experts) / 1e6:.1f} MB" in line and "no chat training" in line
    assert budget == pytest.approx(default_model.CACHE_FRACTION * experts / 1e9)
    cli.resolve_model(None, None, chat=True)
    chat_line = capsys.readouterr().err.strip()
    assert chat_line == default_model.describe(path, chat=True) and chat_line != line
    assert "no chat training, so its replies are code-like text, not answers" in chat_line


def test_prompt_is_shown_apart_from_the_reply(tiny_ckpt, tiny, capsys):
    """The prompt goes to stderr between marker lines, before the reply; stdout holds the
    reply alone. In a chat the system message comes first; a long prompt is cut."""
    argv = ["--model", str(tiny_ckpt), "--max-tokens", "3"]
    assert main([*argv, "--raw", "--prompt", "def f(x):\n    return"]) == 0
    out = capsys.readouterr()
    n = len(tiny[1].encode("def f(x):\n    return", add_special_tokens=False))
    shown = f"--- prompt: raw text, {n} tokens ---\ndef f(x):\n    return\n--- reply ---\n"
    assert shown in out.err and "def f" not in out.out
    assert out.err.index(shown) < out.err.index("stats: ")
    assert main([*argv, "--system", "Be brief.", "--no-thinking", "--prompt", "Hi"]) == 0
    out = capsys.readouterr()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    n = len(encode_chat(tiny[1], messages, thinking=False))
    shown = f"--- prompt: a chat, thinking off, {n} tokens ---\nsystem: Be brief.\nuser: Hi\n"
    assert shown + "--- reply ---\n" in out.err and "Hi" not in out.out
    long = "\n".join(f"line {i}" for i in range(30))
    assert main([*argv, "--raw", "--prompt", long]) == 0
    err = capsys.readouterr().err
    assert "line 19\n[... 10 more lines]\n--- reply ---" in err and "line 20" not in err


def test_disk_error_mid_generation(tiny_ckpt, tmp_path, capsys):
    """A shard cut short after loading: the streamer's read fails and the CLI's generation
    path ends with one error line naming the file."""
    path = tmp_path / "ckpt"
    path.mkdir()
    for f in tiny_ckpt.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    model, tok = kimi_k3.load(path, expert_cache_gb=0.001)
    capsys.readouterr()  # loading notices (the copies' new mtimes are checked)
    for shard in path.glob("model-*.safetensors"):
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    args = setup_arg_parser().parse_args(["--prompt", "Hi", "--max-tokens", "5"])
    assert run_once(model, tok, args) == 1
    err = capsys.readouterr().err.splitlines()  # the prompt shown, then the error
    errors = [line for line in err if line.startswith("error")]
    assert errors == err[-1:] and err[-1].startswith(
        "error: reading experts from disk failed mid-generation: "
    )
    assert str(path) in err[-1]


def test_system_needs_chat(tiny_ckpt, capsys):
    assert main(["--model", str(tiny_ckpt), "--raw", "--system", "x"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "error: --system needs --chat"


def _in_layout(tiny_ckpt, out, layout):
    if layout == "pack":
        convert(tiny_ckpt, out, Settings(dense_bits=16), stream=io.StringIO())
        return
    model, config = mlx_lm_load_model(tiny_ckpt)
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(tiny_ckpt / name, out)


@pytest.mark.parametrize("layout", ["pack", "mlx-lm"])
def test_converted_layouts(layout, tiny_ckpt, tiny, tmp_path, capsys):
    """The converter's layout (bf16 dense: the same weights, the same text) and an mlx-lm
    directory run, experts resident and streamed."""
    out = tmp_path / layout
    _in_layout(tiny_ckpt, out, layout)
    ids = encode_chat(tiny[1], [{"role": "user", "content": "Hi"}])
    for extra, where in (([], "resident"), (["--expert-cache-gb", "0.001"], "hit rate")):
        assert main(["--model", str(out), "--prompt", "Hi", "--max-tokens", "6", *extra]) == 0
        got = capsys.readouterr()
        assert int(STATS.search(got.err)[1]) == len(ids) and where in got.err
        if layout == "pack":
            assert got.out == expected_text(*tiny, ids, 6)


def test_auto_budget_streams_what_does_not_fit(tiny_ckpt, monkeypatch, capsys):
    """Without --expert-cache-gb: resident when the checkpoint fits in free memory, else
    streamed, with a notice."""
    import kimi_k3.cli as cli

    assert cli.resolve_model(tiny_ckpt, None) == (tiny_ckpt, None)
    monkeypatch.setattr(cli, "available_memory", lambda: 1000)
    monkeypatch.setattr(cli, "default_cache_gb", lambda dense, reserve_gb: 0.5)
    assert cli.resolve_model(tiny_ckpt, None) == (tiny_ckpt, 0.5)
    assert "do not fit in memory: streaming them through a 0.5 GB cache" in (
        capsys.readouterr().err
    )
    assert cli.resolve_model(tiny_ckpt, 2.0) == (tiny_ckpt, 2.0)


@pytest.mark.slow
def test_chat_line_editing_on_a_terminal(tiny_ckpt):
    """On a terminal the chat reads lines through readline: ``/ext``, left arrow, ``i``
    is the command ``/exit`` (without line editing it would be a message to the model,
    and the chat would wait for the next one)."""
    import pty
    import select
    import time

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kimi_k3.generate", "--model", str(tiny_ckpt), "-i", "-m", "2"],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "TERM": "xterm"},
    )
    os.close(follower)
    seen, deadline = b"", time.monotonic() + 60
    try:
        while b">> " not in seen and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                seen += os.read(leader, 4096)
        os.write(leader, b"/ext\x1b[Di\r")
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    seen += os.read(leader, 4096)
                except OSError:
                    break
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        proc.kill()
        os.close(leader)
    assert proc.returncode == 0, seen.decode(errors="replace")
    assert b"stats:" not in seen, seen.decode(errors="replace")
