"""The whole model with its kernels equals the model on the pure-MLX reference: prefill in
uneven chunks, then decode; streamed experts give the resident model's bits on the kernels
too. The kernels run as Metal source on the CPU emulator, and on MLX's CUDA backend (fp32
exact there: MLX_ENABLE_TF32=0, tests/conftest.py), where the expert store holds tiles."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import dispatch_defaults, rel_err
from model_kernel_check import KERNEL_SHAPES, compare, prompt_of, run
from test_streaming import budget_gb

from kimi_k3.checkpoint.loader import load_model
from kimi_k3.kernels import expert_layout
from kimi_k3.streaming import get_stats

# (prompt tokens, decode steps) per backend: the emulator runs the kernels' threads one by one
LENGTHS = {"emulator": (70, 2), "cuda": (200, 8)}


def test_model_with_kernels_matches_reference(ckpt_factory, monkeypatch, backend):
    path = ckpt_factory("tiny", **KERNEL_SHAPES)
    out, ref, counts = compare(monkeypatch, path, backend, mx.float32, *LENGTHS[backend])
    assert counts["kda"] > 0 and counts["experts"] > 0
    assert rel_err(out, ref) < 1e-4
    assert mx.array_equal(mx.argmax(out, -1), mx.argmax(ref, -1))


@pytest.mark.cuda
def test_model_with_cuda_kernels_bf16(ckpt_factory, monkeypatch):
    """bf16 agrees with the reference by KL divergence and top-1."""
    path = ckpt_factory("tiny", **KERNEL_SHAPES)
    out, ref, _ = compare(monkeypatch, path, "cuda", mx.bfloat16, *LENGTHS["cuda"])
    a, b = ref.astype(mx.float32), out.astype(mx.float32)
    la = a - mx.logsumexp(a, -1, keepdims=True)
    lb = b - mx.logsumexp(b, -1, keepdims=True)
    kl = float(mx.mean(mx.sum(mx.exp(la) * (la - lb), axis=-1)))
    assert kl < 0.05
    assert float(mx.mean(mx.argmax(a, -1) == mx.argmax(b, -1))) >= 0.75


@pytest.mark.slow
@pytest.mark.parametrize("prompt_len", [40, 200], ids=["decode-kernel-chunks", "gemm-chunks"])
def test_streamed_in_groups_gives_the_resident_bits_on_the_kernels(
    ckpt_factory, monkeypatch, prompt_len
):
    """Experts streamed into fewer slots than a chunk's experts (the chunk runs in groups,
    ``Streamer._grouped``) give the resident model's logits bit for bit on the kernels, at
    top-4 (a sum of four in another order differs): chunks of 26-108 pairs (decode kernels)
    and of 264-536 (the grouped GEMM, whose groups of few pairs must not take the decode
    kernels)."""
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
    """Trimmed experts (``kimi_k3.model.routing``): a chunk whose tokens keep different numbers of
    experts hands the kernels zero-weight pairs; a prefill in chunks of 30 tokens (the decode
    kernels) and 60 (the grouped GEMM), then decode. The reference's logits within 1e-4, and
    streamed into fewer slots than a chunk's experts the resident model's bits."""
    path = ckpt_factory("tiny", num_experts_per_token=4, **KERNEL_SHAPES)
    trim = {"expert_top_p": 0.6}
    out, ref, counts = compare(monkeypatch, path, "emulator", mx.float32, 90, 2, **trim)
    assert counts["experts"] > 0
    assert rel_err(out, ref) < 1e-4
    model = load_model(path, dtype=mx.float32, expert_cache_gb=budget_gb(path, 4), **trim)
    assert mx.array_equal(run(model, prompt_of(90), 2), out).item()
    assert 1 < get_stats(model)["experts_per_token"] < 4


@pytest.mark.slow
@pytest.mark.parametrize("bits", [3, pytest.param(2, marks=pytest.mark.cuda)])
def test_lower_bit_experts_on_the_kernels(lower_bit, monkeypatch, backend, bits):
    """Experts converted to fewer bits (``--expert-bits``) on the affine kernels: the
    reference's logits within 1e-4, and streamed into fewer slots than a chunk's experts the
    resident model's bits: chunks of 52-108 pairs in groups (the decode kernels), of 132-268
    in the overflow area's two groups (the grouped GEMM). 3 bits on the emulator (codes that
    straddle words), both widths on CUDA."""
    path = lower_bit(bits, num_experts_per_token=4, **KERNEL_SHAPES)
    out, ref, counts = compare(monkeypatch, path, backend, mx.float32, *LENGTHS[backend])
    assert counts["experts"] > 0 and rel_err(out, ref) < 1e-4
    for prompt_len, overflow in ((40, 0), (100, 60)):
        prompt = prompt_of(prompt_len)
        want = run(load_model(path, dtype=mx.float32), prompt, 1)
        budget = budget_gb(path, 4)
        model = load_model(
            path, dtype=mx.float32, expert_cache_gb=budget, overflow_experts=overflow
        )
        assert mx.array_equal(run(model, prompt, 1), want).item(), prompt_len


TILE_SHAPES = dict(KERNEL_SHAPES, moe_intermediate_size=128, routed_expert_hidden_size=128)


@pytest.mark.cuda
def test_model_with_a_tiled_store(ckpt_factory, monkeypatch):
    """On CUDA the expert store holds tiles by default (``expert_layout="auto"``) and gives
    the MLX layout's logits bit for bit, resident and streamed alike (streamed with every
    expert in the cache, and with fewer slots than a chunk's experts, where the streamer runs
    the chunk in groups on the kernel one call of the whole chunk takes, so bit for bit
    too, also with the overflow area's two groups); against the reference path as the test
    above (fp32)."""
    dispatch_defaults(monkeypatch)
    path = ckpt_factory("tiny", **TILE_SHAPES)
    prompt = prompt_of(200)
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
    out, ref, counts = compare(monkeypatch, path, "cuda", mx.float32, *LENGTHS["cuda"])
    assert counts["experts"] > 0 and rel_err(out, ref) < 1e-4


@pytest.mark.cuda
def test_trimmed_streamed_equals_trimmed_resident(ckpt_factory, monkeypatch):
    """Expert trimming on the CUDA kernels and a tiled store: streamed (with misses, and in
    groups) gives the resident model's trimmed logits bit for bit, computes fewer experts a
    token than untrimmed, and top-p 1 is the untrimmed model."""
    dispatch_defaults(monkeypatch)
    path = ckpt_factory("tiny", **TILE_SHAPES)
    prompt = prompt_of(200)
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
