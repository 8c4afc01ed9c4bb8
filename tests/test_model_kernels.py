"""The whole model with its kernels (Metal source, run by the CPU emulator) equals the model
on the pure-MLX reference: prefill in uneven chunks, then decode; streamed experts give the
resident model's bits on the kernels too."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import rel_err
from model_kernel_check import KERNEL_SHAPES, compare, prompt_of, run


def test_model_with_metal_kernels_matches_reference(ckpt_factory, monkeypatch):
    path = ckpt_factory("tiny", **KERNEL_SHAPES)
    out, ref, counts = compare(monkeypatch, path, "emulator", mx.float32, prompt_len=70, steps=2)
    assert counts["kda"] > 0 and counts["experts"] > 0
    assert rel_err(out, ref) < 1e-4
    assert mx.array_equal(mx.argmax(out, -1), mx.argmax(ref, -1))


@pytest.mark.parametrize("prompt_len", [40, 200], ids=["decode-kernel-chunks", "gemm-chunks"])
def test_streamed_in_groups_gives_the_resident_bits_on_the_kernels(
    ckpt_factory, monkeypatch, prompt_len
):
    """Experts streamed into fewer slots than a chunk's experts (the chunk runs in groups,
    ``Streamer._grouped``) give the resident model's logits bit for bit on the kernels, at
    top-4 (a sum of four in another order differs): chunks of 26-108 pairs (decode kernels)
    and of 264-536 (the grouped GEMM, whose groups of few pairs must not take the decode
    kernels)."""
    from test_streaming import budget_gb

    from kimi_k3.loader import load_model
    from kimi_k3.streaming import get_stats

    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    monkeypatch.delenv("KIMI_K3_REFERENCE", raising=False)
    path = ckpt_factory("tiny", num_experts_per_token=4, **KERNEL_SHAPES)
    prompt = mx.array(np.random.default_rng(0).integers(0, 700, (1, prompt_len)))
    want = run(load_model(path, dtype=mx.float32), prompt, 2)
    for slots, overflow in ((4, 0), (5, 0), (4, 60)):  # (4, 60): the overflow area's groups
        model = load_model(
            path,
            dtype=mx.float32,
            expert_cache_gb=budget_gb(path, slots),
            overflow_experts=overflow,
        )
        assert mx.array_equal(run(model, prompt, 2), want).item(), (slots, overflow)
        assert (get_stats(model)["overflow_misses"] > 0) == (overflow > 0)


def test_trimmed_routing_on_the_kernels(ckpt_factory, monkeypatch):
    """Trimmed experts (``kimi_k3.trimming``): a chunk whose tokens keep different numbers of
    experts hands the kernels zero-weight pairs; a prefill in chunks of 30 tokens (the decode
    kernels) and 60 (the grouped GEMM), then decode. The reference's logits within 1e-4, and
    streamed into fewer slots than a chunk's experts the resident model's bits."""
    from test_streaming import budget_gb

    from kimi_k3.loader import load_model
    from kimi_k3.streaming import get_stats

    path = ckpt_factory("tiny", num_experts_per_token=4, **KERNEL_SHAPES)
    trim = {"expert_top_p": 0.6}
    out, ref, counts = compare(monkeypatch, path, "emulator", mx.float32, 90, 2, **trim)
    assert counts["experts"] > 0
    assert rel_err(out, ref) < 1e-4
    model = load_model(path, dtype=mx.float32, expert_cache_gb=budget_gb(path, 4), **trim)
    assert mx.array_equal(run(model, prompt_of(90), 2), out).item()
    assert 1 < get_stats(model)["experts_per_token"] < 4
