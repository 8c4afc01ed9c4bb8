"""Whole model with the custom kernels against the same model on the reference ops.

Used by ``tests/test_model_kernels.py`` (kernels run by the Metal emulator on the CPU, and
CUDA kernels on the GPU) and, for its shapes, ``tests/test_kernel_grads.py``. The
checkpoint's KDA heads are 64 wide so the prefill chunk kernels serve them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

KERNEL_SHAPES = dict(kda_heads=2, kda_head_dim=64, num_hidden_layers=4, full=[3])


def run(model, prompt, steps):
    """Logits of a prefill in two uneven chunks, then ``steps`` greedy decode steps."""
    cache = model.make_cache()
    cut = prompt.shape[1] // 3
    outs = [model(prompt[:, :cut], cache=cache), model(prompt[:, cut:], cache=cache)]
    for _ in range(steps):
        tok = mx.argmax(outs[-1][:, -1], axis=-1)[:, None]
        outs.append(model(tok, cache=cache))
    return mx.concatenate(outs, axis=1)


def prompt_of(length: int) -> mx.array:
    return mx.array(np.random.default_rng(0).integers(0, 700, (1, length)))


def compare(monkeypatch, path, backend: str, dtype, prompt_len=70, steps=3, **load_options):
    """(kernel logits, reference logits, dispatch counts) for one prompt (``prompt_of``);
    ``load_options`` go to ``load_model``."""
    from kimi_k3.checkpoint.loader import load_model
    from kimi_k3.kernels import dispatch

    model = load_model(path, dtype=dtype, **load_options)
    prompt = prompt_of(prompt_len)
    monkeypatch.setenv("KIMI_K3_REFERENCE", "1")
    ref = run(model, prompt, steps)
    mx.eval(ref)
    monkeypatch.setenv("KIMI_K3_REFERENCE", "0")
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", backend)
    counts = {"kda": 0, "experts": 0}
    for name, key in (("kda_mix_kernel", "kda"), ("expert_glu_kernel", "experts")):
        orig = getattr(dispatch, name)

        def counted(*a, _orig=orig, _key=key):
            fn = _orig(*a)
            counts[_key] += fn is not None
            return fn

        monkeypatch.setattr(dispatch, name, counted)
    out = run(model, prompt, steps)
    mx.eval(out)
    return out, ref, counts
