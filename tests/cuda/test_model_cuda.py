"""The whole model with its CUDA kernels equals the model on the pure-MLX reference (fp32,
run with MLX_ENABLE_TF32=0), and bf16 agrees by KL divergence and top-1."""

import mlx.core as mx
import pytest
from conftest import rel_err
from model_kernel_check import KERNEL_SHAPES, compare

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")


def test_model_with_cuda_kernels_matches_reference_fp32(ckpt_factory, monkeypatch):
    path = ckpt_factory("tiny", **KERNEL_SHAPES)
    out, ref, counts = compare(monkeypatch, path, "cuda", mx.float32, prompt_len=200, steps=8)
    assert counts["kda"] > 0 and counts["experts"] > 0
    assert rel_err(out, ref) < 1e-4


def test_model_with_cuda_kernels_bf16(ckpt_factory, monkeypatch):
    path = ckpt_factory("tiny", **KERNEL_SHAPES)
    out, ref, _ = compare(monkeypatch, path, "cuda", mx.bfloat16, prompt_len=200, steps=8)
    a, b = ref.astype(mx.float32), out.astype(mx.float32)
    la = a - mx.logsumexp(a, -1, keepdims=True)
    lb = b - mx.logsumexp(b, -1, keepdims=True)
    kl = float(mx.mean(mx.sum(mx.exp(la) * (la - lb), axis=-1)))
    assert kl < 0.05
    assert float(mx.mean(mx.argmax(a, -1) == mx.argmax(b, -1))) >= 0.75


TILE_SHAPES = dict(KERNEL_SHAPES, moe_intermediate_size=128, routed_expert_hidden_size=128)


def test_model_with_a_tiled_store(ckpt_factory, monkeypatch):
    """On CUDA the expert store holds tiles by default (``expert_layout="auto"``) and gives
    the MLX layout's logits bit for bit, resident and streamed alike (streamed with every
    expert in the cache, and with fewer slots than a chunk's experts, where the streamer runs
    the chunk in groups on the kernel one call of the whole chunk takes, so bit for bit
    too, also with the overflow area's two groups); against the reference path as the test
    above (fp32)."""
    import numpy as np
    from model_kernel_check import run
    from test_streaming import budget_gb

    from kimi_k3.kernels import expert_layout
    from kimi_k3.loader import load_model
    from kimi_k3.streaming import get_stats

    for var in ("KIMI_K3_REFERENCE", "KIMI_K3_KERNEL_BACKEND", "KIMI_K3_EXPERT_LAYOUT"):
        monkeypatch.delenv(var, raising=False)
    path = ckpt_factory("tiny", **TILE_SHAPES)
    prompt = mx.array(np.random.default_rng(0).integers(0, 700, (1, 200)))
    tiled = load_model(path, dtype=mx.float32)
    moe = tiled.layers[1].block_sparse_moe
    assert moe.experts.layout == "tiled" and expert_layout.is_tiled(moe.experts.tensors())
    out = run(tiled, prompt, 8)
    plain = run(load_model(path, dtype=mx.float32, expert_layout="mlx"), prompt, 8)
    assert mx.array_equal(out, plain).item()
    for slots, overflow in ((8, 0), (3, 0), (3, 8)):  # (3, 8): the overflow area's groups
        streamed = load_model(
            path,
            dtype=mx.float32,
            expert_cache_gb=budget_gb(path, slots),
            overflow_experts=overflow,
        )
        got = run(streamed, prompt, 8)
        assert get_stats(streamed)["expert_layout"] == "tiled"
        assert mx.array_equal(got, out).item(), (slots, overflow)
        assert (get_stats(streamed)["overflow_misses"] > 0) == (overflow > 0)
    out, ref, counts = compare(monkeypatch, path, "cuda", mx.float32, prompt_len=200, steps=8)
    assert counts["experts"] > 0 and rel_err(out, ref) < 1e-4


def test_trimmed_streamed_equals_trimmed_resident(ckpt_factory, monkeypatch):
    """Expert trimming on the CUDA kernels and a tiled store: streamed (with misses, and in
    groups) gives the resident model's trimmed logits bit for bit, computes fewer experts a
    token than untrimmed, and top-p 1 is the untrimmed model."""
    import numpy as np
    from model_kernel_check import run
    from test_streaming import budget_gb

    from kimi_k3.loader import load_model
    from kimi_k3.streaming import get_stats

    for var in ("KIMI_K3_REFERENCE", "KIMI_K3_KERNEL_BACKEND", "KIMI_K3_EXPERT_LAYOUT"):
        monkeypatch.delenv(var, raising=False)
    path = ckpt_factory("tiny", **TILE_SHAPES)
    prompt = mx.array(np.random.default_rng(0).integers(0, 700, (1, 200)))
    untrimmed = run(load_model(path, dtype=mx.float32), prompt, 8)
    same = run(load_model(path, dtype=mx.float32, expert_top_p=1.0), prompt, 8)
    assert mx.array_equal(same, untrimmed).item()
    trim = dict(expert_top_p=0.5, expert_min_weight=0.1)
    resident = run(load_model(path, dtype=mx.float32, **trim), prompt, 8)
    assert not mx.array_equal(resident, untrimmed).item()
    for slots in (8, 3):
        budget = budget_gb(path, slots)
        streamed = load_model(path, dtype=mx.float32, expert_cache_gb=budget, **trim)
        assert mx.array_equal(run(streamed, prompt, 8), resident).item(), slots
        full = load_model(path, dtype=mx.float32, expert_cache_gb=budget)
        run(full, prompt, 8)
        kept, every = (get_stats(m)["experts_per_token"] for m in (streamed, full))
        assert kept < every, slots
