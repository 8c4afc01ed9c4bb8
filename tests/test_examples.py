"""Every example runs: the notebook end to end (nbclient, kernel ``python3``), the scripts as
subprocesses with small arguments, and none prints a reserved special token. About 20 s on 2
CPU cores, mostly interpreter start-up."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import nbformat
import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from nbclient import NotebookClient

import kimi_k3
from kimi_k3 import default_model
from kimi_k3.text.chat import encode_chat
from kimi_k3.text.tokenizer import load_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import build_notebook  # noqa: E402
import chat_loop  # noqa: E402

PLOTS = {"routing.png", "attn_res.png", "kda_decay.png", "mla_entropy.png"}


RESERVED = "<|reserved_token_"


def run(script: str, *args: str, stdin: str = "", env: dict | None = None, timeout=120):
    """The example script in a subprocess; whatever it prints holds no reserved token."""
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert RESERVED not in r.stdout + r.stderr, r.stdout
    return r


def _has_streamer() -> bool:
    try:
        from kimi_k3.streaming import get_stats  # noqa: F401
    except ImportError:
        return False
    return True


def test_notebook_matches_script():
    stored = nbformat.read(EXAMPLES / "explore_kimi_k3.ipynb", as_version=4)
    built = build_notebook.notebook((EXAMPLES / "explore_kimi_k3.py").read_text())
    assert [(c.cell_type, c.source) for c in stored.cells] == [
        (c.cell_type, c.source) for c in built.cells
    ], "run python examples/build_notebook.py"
    for cell in stored.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "stored with outputs"


@pytest.mark.slow
def test_notebook_executes(tmp_path, monkeypatch):
    """By default on the trained default model (copied into a private cache)."""
    monkeypatch.setenv("KIMI_K3_PLOT_DIR", str(tmp_path))
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KIMI_K3_PRESET", raising=False)
    monkeypatch.setenv("KIMI_K3_DECODE_STEPS", "4")
    monkeypatch.delenv("KIMI_K3_MODEL", raising=False)
    nb = nbformat.read(EXAMPLES / "explore_kimi_k3.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    ).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert RESERVED not in text
    assert re.search(r"traced \d+ tokens \(\d+ prompt \+ 4 decoded\)", text)
    assert "default-" in text and "8 layers, 64 experts (top-4)" in text
    made = {p.name for p in tmp_path.glob("*.png")}
    assert PLOTS <= made
    if _has_streamer():
        assert "cache_hit_rate.png" in made
    else:
        assert "streamer (kimi_k3.streaming.get_stats) is not in this build" in text
    images = sum(
        "image/png" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    assert images >= len(PLOTS)


@pytest.mark.slow
def test_explore_script(tmp_path):
    r = run(
        "explore_kimi_k3.py",
        env={
            "KIMI_K3_PLOT_DIR": str(tmp_path),
            "KIMI_K3_PRESET": "tiny",
            "KIMI_K3_DECODE_STEPS": "3",
        },
    )
    assert r.returncode == 0, r.stderr
    assert PLOTS <= {p.name for p in tmp_path.glob("*.png")}


@pytest.mark.slow
def test_generate_api(tiny_ckpt):
    prompt = "Name three rivers."
    r = run("generate_api.py", "--model", str(tiny_ckpt), "--prompt", prompt, "--max-tokens", "5")
    assert r.returncode == 0, r.stderr
    tokenizer = load_tokenizer(tiny_ckpt)
    n_prompt = len(encode_chat(tokenizer, [{"role": "user", "content": prompt}], thinking=False))
    m = re.search(r"prompt: (\d+) tokens.*generation: (\d+) tokens", r.stdout)
    assert m and int(m.group(1)) == n_prompt and 1 <= int(m.group(2)) <= 5, r.stdout


@pytest.mark.slow
def test_generate_api_default_model(tmp_path):
    """No --model: the demo model continues the demo prompt, shown first, as raw text."""
    r = run("generate_api.py", "--max-tokens", "12", env={"KIMI_K3_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    shown = f"prompt (raw text):\n{default_model.PROMPT.rstrip()}\nreply:\n"
    assert r.stdout.startswith(shown), r.stdout
    n = len(load_tokenizer(default_model.package_dir()).encode(default_model.PROMPT))
    m = re.search(rf"^prompt: {n} tokens, .*generation: (\d+) tokens", r.stdout, re.M)
    assert m and 1 <= int(m[1]) <= 12, r.stdout


@pytest.mark.slow
def test_chat_loop_reads_turns_from_stdin():
    r = run("chat_loop.py", "--max-tokens", "6", stdin="Hello there\nAnd then?\n\nignored\n")
    assert r.returncode == 0, r.stderr
    assert re.findall(r"^> (.*)$", r.stdout, re.M) == ["Hello there", "And then?"]
    fed = [tuple(map(int, m)) for m in re.findall(r"\[fed (\d+) tokens, (\d+) reused", r.stdout)]
    assert len(fed) == 2 and fed[0][1] == 0 and fed[1][1] > fed[0][0]


def test_chat_loop_cache_matches_a_fresh_prefill(tiny_ckpt):
    """Turn 2 through the kept prompt cache = turn 2 from a fresh prefill of the history."""
    model, tokenizer = kimi_k3.load(tiny_ckpt, dtype=mx.float32)
    greedy, out = make_sampler(temp=0.0), io.StringIO()
    cache, history = make_prompt_cache(model), []
    turn = [{"role": "user", "content": "What is an expert?"}]
    # One token: the reply is cut short, so the loop closes the message itself and those
    # closing tokens are not yet in the cache.
    chat_loop.chat_turn(model, tokenizer, cache, history, turn, 1, greedy, False, out)
    assert chat_loop.cached_tokens(cache, history) < len(history)
    turn = [{"role": "user", "content": "And a router?"}]
    before = history + encode_chat(tokenizer, turn, thinking=False)
    reply = chat_loop.chat_turn(model, tokenizer, cache, history, turn, 6, greedy, False, out)
    fresh = [
        r.token
        for r in stream_generate(
            model,
            tokenizer,
            before,
            max_tokens=6,
            sampler=greedy,
            prompt_cache=make_prompt_cache(model),
            logits_processors=[kimi_k3.reserved_token_mask(tokenizer)],
        )
    ]
    assert reply == fresh
    assert history[: len(before)] == before


@pytest.mark.slow
def test_train_tiny():
    r = run("train_tiny.py", "--steps", "4", "--seq", "16", "--batch", "2")
    assert r.returncode == 0, r.stderr
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", r.stdout).groups())
    assert last < first


@pytest.mark.slow
def test_convert_checkpoint():
    r = run("convert_checkpoint.py", timeout=300)
    if importlib.util.find_spec("kimi_k3.convert.convert") is None:
        assert r.returncode == 2 and "no converter" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    err = float(re.search(r"relative difference ([\d.e+-]+)", r.stdout).group(1))
    assert err == 0.0  # 16-bit dense and bit-exact experts: identical logits
