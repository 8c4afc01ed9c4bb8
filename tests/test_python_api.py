"""The Python route of the README on the embedded default model: its example runs as
written, and ``kimi_k3.reserved_token_mask`` keeps reserved ids out of mlx-lm's
generation while leaving every other logit as it was."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate

import kimi_k3

README = Path(__file__).resolve().parents[1] / "README.md"
NEVER = ("[BOS]", "[PAD]", "[UNK]")


@pytest.fixture(scope="module")
def default_path(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KIMI_K3_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield kimi_k3.ensure_default_model()


def readme_python() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 1, "the README has one Python example"
    return blocks[0]


def test_readme_python_example_runs_as_written(tmp_path):
    """The README's Python block, verbatim, on a fresh cache: it completes the prompt and
    prints the streamer's stats as its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", readme_python()],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "KIMI_K3_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr
    *text, last = proc.stdout.rstrip("\n").split("\n")
    stats = ast.literal_eval(last)
    assert stats["misses"] > 0 and stats["bytes_read"] > 0, stats
    assert "".join(text).strip() and "<|reserved" not in proc.stdout, proc.stdout


def _banned(tokenizer) -> list[int]:
    return sorted(
        i
        for i, t in tokenizer.added_tokens_decoder.items()
        if t.content in NEVER or t.content.startswith("<|reserved_token_")
    )


def test_reserved_token_mask_in_stream_generate(default_path):
    """Reserved ids are lured with a +1e4 logit: without the mask greedy decoding picks
    only them, with it none, and the mask leaves every allowed logit bit-identical."""
    model, tok = kimi_k3.load(default_path)
    banned = _banned(tok)
    assert len(banned) > 200
    prompt = tok.encode("import os\n")

    def lure(tokens, logits):
        row = np.zeros(logits.shape[-1], np.float32)
        row[banned] = 1e4
        return logits + mx.array(row)

    lured = [r.token for r in stream_generate(model, tok, prompt, 6, logits_processors=[lure])]
    assert lured and set(lured) <= set(banned), lured

    seen = []

    def spy(tokens, logits):
        seen.append(np.array(logits.astype(mx.float32)))
        return logits

    processors = [lure, spy, kimi_k3.reserved_token_mask(tok), spy]
    ids = [r.token for r in stream_generate(model, tok, prompt, 6, logits_processors=processors)]
    assert len(ids) == 6 and not set(ids) & set(banned), ids
    assert len(seen) >= 2 * len(ids) and len(seen) % 2 == 0  # mlx-lm computes one step ahead
    allowed = np.setdiff1d(np.arange(seen[0].shape[-1]), banned)
    for before, after in zip(seen[::2], seen[1::2], strict=True):
        assert np.array_equal(after[..., allowed], before[..., allowed])
        assert np.all(after[..., banned] == -np.inf)
