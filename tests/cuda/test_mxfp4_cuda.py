"""MXFP4 expert kernels on MLX's CUDA backend (the lent H200): the emulator suite's small cases,
then K3-size cases with more experts and tokens, against the same float64 oracle. The K3-size
cases share one 16-expert stack, so the oracle (on the host CPU) dequantizes each expert once."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_mxfp4_kernels import (  # noqa: E402
    DECODE_CASES,
    MMA_CASES,
    PREFILL_CASES,
    PREFILL_MMA_CASES,
    TOL,
    case,
    check_mma_large_and_tiny,
    check_reads_cache_slots,
    rel_err,
)

from kimi_k3.experts import expert_glu, expert_glu_reference  # noqa: E402
from kimi_k3.kernels import (  # noqa: E402
    dispatch,
    expert_layout,
    mxfp4_mma,
    mxfp4_one,
    mxfp4_prefill_mma,
)
from kimi_k3.kernels.mxfp4_decode import expert_glu_decode  # noqa: E402
from kimi_k3.kernels.mxfp4_prefill import expert_glu_prefill  # noqa: E402
from kimi_k3.kernels.mxfp4_prefill_mma import expert_glu_prefill_mma  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend"),
]

K3 = (3584, 3072)
SMALL_DECODE = [c for c in DECODE_CASES if c[1:3] != K3]
SMALL_PREFILL = [c for c in PREFILL_CASES if c[1:3] != K3]


@pytest.mark.parametrize("E,D,I,N,k,dtype", SMALL_DECODE + [(16, *K3, 4, 16, "bfloat16")])
def test_decode_matches_oracle(E, D, I, N, k, dtype):
    args, want = case(E, D, I, N, k, dtype)
    got = expert_glu_decode(*args, backend="cuda")
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize(
    "E,D,I,N,k,dtype", MMA_CASES + [(16, *K3, 4, 16, "bfloat16"), (16, *K3, 8, 16, "float32")]
)
def test_mma_decode_matches_oracle(E, D, I, N, k, dtype):
    """The tensor-core decode kernels: fp16 MMAs with fp32 accumulators, activations split
    into fp16 hi + lo, against the float64 oracle at the fp32 kernels' tolerance."""
    args, want = case(E, D, I, N, k, dtype)
    got = mxfp4_mma.expert_glu_decode(*args, backend="cuda")
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize(
    "E,D,I,N,k,dtype",
    MMA_CASES
    + [(16, *K3, 1, 16, "bfloat16"), (16, *K3, 2, 16, "bfloat16"), (16, *K3, 8, 16, "float32")],
)
def test_one_launch_gives_the_three_launches_bits(E, D, I, N, k, dtype):
    """mxfp4_one (gate/up, down and the sum in one grid, meeting through counters): the
    three-launch decode's bits at every one of five launches (a race would show as a
    difference in some), and the oracle."""
    args, want = case(E, D, I, N, k, dtype)
    three = np.array(mxfp4_mma.expert_glu_decode(*args, backend="cuda"))
    for _ in range(5):
        got = mxfp4_one.expert_glu_decode(*args, backend="cuda")
        assert got.dtype == mx.float32 and got.shape == (N, D)
        assert np.array_equal(np.array(got), three)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("N", [1, 2, 3])
def test_dispatched_decode_at_k3_size(monkeypatch, N):
    """The model's expert call (``kimi_k3.experts.expert_glu``) at K3 size: one launch at 16
    and 32 pairs, three at 48 (``dispatch.expert_decode_choice``), the three launches' bits
    either way, and the oracle."""
    monkeypatch.delenv("KIMI_K3_EXPERT_DECODE", raising=False)
    monkeypatch.delenv("KIMI_K3_REFERENCE", raising=False)
    args, want = case(16, *K3, N, 16, "bfloat16")
    fn = dispatch.expert_glu_kernel(*args[:3])
    one = N * 16 <= dispatch.EXPERT_ONE_LAUNCH_MAX_PAIRS
    assert fn.func is (mxfp4_one.expert_glu_decode if one else mxfp4_mma.expert_glu_decode)
    got = np.array(expert_glu(*args))
    assert np.array_equal(got, np.array(mxfp4_mma.expert_glu_decode(*args, backend="cuda")))
    assert rel_err(mx.array(got), want) < TOL


def test_one_launch_tiled_layout_same_bits():
    """``mxfp4_one.tiled_layout`` (what a tiled store dispatches) gives the one launch's
    bits at K3 size."""
    (z, w, *rest), _ = case(16, *K3, 1, 16, "bfloat16")
    plain = np.array(mxfp4_one.expert_glu_decode(z, w, *rest, backend="cuda"))
    wt = expert_layout.tile(w)
    got = mxfp4_one.expert_glu_decode_tiled(z, wt, *rest, backend="cuda")
    assert np.array_equal(np.array(got), plain)


def test_one_launch_counts_at_k3_size():
    N, k = 4, 16
    args, _ = case(16, *K3, N, k, "bfloat16")
    rt, sk = mxfp4_one.shape_for("cuda", *K3)[:2]
    counts = mxfp4_one.launch(mxfp4_one.dispatched_kernel(rt, sk), *args, backend="cuda")[3]
    xg, xd = -(-(K3[1] // 16) // rt), -(-(K3[0] // 32) // rt)
    want = [(xg + xd) * N * k] + [xg] * (N * k) + [k] * (N * xd)
    assert np.array(counts).tolist() == want


@pytest.mark.parametrize("N", [1, 4])
def test_mma_tiled_layout_same_bits(N):
    """The dispatched kernels reading ``expert_layout``'s tiles (``mxfp4_mma.tiled_layout``)
    give the same bits as on MLX's layout, at K3 size."""
    args, want = case(16, *K3, N, 16, "bfloat16")
    z, w, *rest = args
    plain = np.array(mxfp4_mma.expert_glu_decode(*args, backend="cuda"))
    got = mxfp4_mma.expert_glu_decode_tiled(z, expert_layout.tile(w), *rest, backend="cuda")
    assert np.array_equal(np.array(got), plain)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("blocks", [{"gate_up": 2, "down": 2}, {"gate_up": 1, "down": 2}])
def test_mma_decode_with_launch_bounds(monkeypatch, blocks):
    """The tensor-core decode compiled with __launch_bounds__ (mxfp4_mma.MIN_BLOCKS; ptxas
    caps it at 128 registers and spills a few bytes): NVRTC takes the bound, and the result
    is the same to the last bit as without it."""
    args, want = case(16, *K3, 4, 16, "bfloat16")
    monkeypatch.setattr(mxfp4_mma, "MIN_BLOCKS", {"gate_up": 1, "down": 1})
    plain = mxfp4_mma.expert_glu_decode(*args, backend="cuda")
    for proj, b in blocks.items():
        monkeypatch.setitem(mxfp4_mma.MIN_BLOCKS, proj, b)
    got = mxfp4_mma.expert_glu_decode(*args, backend="cuda")
    assert rel_err(got, want) < TOL
    assert mx.array_equal(got, plain).item()


@pytest.mark.parametrize("bound", [1, 2])
def test_byte_permute_decode_with_launch_bounds(monkeypatch, bound):
    """``mxfp4_mma`` with its codes decoded by byte permutes (``DECODE``, the dispatcher's; at
    a bound of 2 per SM gate/up fits 128 registers without spills): the shift decode's result
    to the last bit, at K3 size."""
    args, want = case(16, *K3, 4, 16, "bfloat16")
    monkeypatch.setattr(mxfp4_mma, "MIN_BLOCKS", {"gate_up": bound, "down": bound})
    monkeypatch.setattr(mxfp4_mma, "DECODE", {"gate_up": "shift", "down": "shift"})
    plain = mxfp4_mma.expert_glu_decode(*args, backend="cuda")
    monkeypatch.setattr(mxfp4_mma, "DECODE", {"gate_up": "byte permute", "down": "byte permute"})
    got = mxfp4_mma.expert_glu_decode(*args, backend="cuda")
    assert rel_err(got, want) < TOL
    assert mx.array_equal(got, plain).item()


def test_prefill_mma_past_65535_pairs():
    """4096 tokens x 16: the down projection's 65536 rows of B fragments (the launch that
    failed with cuGraphAddKernelNode's invalid argument while they ran along y)."""
    E, D, I, N, k = 64, 256, 128, 4096, 16
    args, want = case(E, D, I, N, k, "bfloat16")
    got = expert_glu_prefill_mma(*args, backend="cuda")
    assert got.shape == (N, D) and rel_err(got, want) < TOL


def test_mma_decode_handles_large_and_tiny_activations():
    check_mma_large_and_tiny("cuda")


@pytest.mark.parametrize(
    "E,D,I,N,k,dtype,tm",
    SMALL_PREFILL + [(16, *K3, 257, 4, "bfloat16", tm) for tm in (16, 32, 64)],
)
def test_prefill_matches_oracle(E, D, I, N, k, dtype, tm):
    args, want = case(E, D, I, N, k, dtype)
    got = expert_glu_prefill(*args, tile_tokens=tm, backend="cuda")
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize(
    "E,D,I,N,k,dtype,tm",
    PREFILL_MMA_CASES + [(16, *K3, 257, 4, "bfloat16", tm) for tm in (16, 32)],
)
def test_prefill_mma_matches_oracle(E, D, I, N, k, dtype, tm):
    """The tensor-core grouped GEMM (mxfp4_prefill_mma), K3's sizes included."""
    args, want = case(E, D, I, N, k, dtype)
    got = expert_glu_prefill_mma(*args, tile_tokens=tm, backend="cuda")
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("tm, launch", [(16, (8, 8)), (32, (8, 4)), (32, (2, 6))])
def test_prefill_mma_launch_shapes(tm, launch):
    args, want = case(16, *K3, 257, 4, "bfloat16")
    got = expert_glu_prefill_mma(*args, tile_tokens=tm, backend="cuda", launch=launch)
    assert rel_err(got, want) < TOL


def test_dispatcher_uses_cuda_kernels(monkeypatch):
    """Decode and prefill: the kernels (gather_qmm is wrong at K3 scale on CUDA, see
    dispatch.expert_prefill_choice), unless KIMI_K3_EXPERT_PREFILL=reference."""
    monkeypatch.delenv("KIMI_K3_REFERENCE", raising=False)
    monkeypatch.delenv("KIMI_K3_KERNEL_BACKEND", raising=False)
    monkeypatch.delenv("KIMI_K3_EXPERT_PREFILL", raising=False)
    (z, w, inds, wts, beta, cap), want = case(20, 64, 96, 1, 16, "bfloat16")
    fn = dispatch.expert_glu_kernel(z, w, inds)
    assert fn.keywords["backend"] == "cuda" and fn.func is expert_glu_decode
    assert rel_err(expert_glu(z, w, inds, wts, beta, cap), want) < TOL
    (z, w, inds, wts, beta, cap), want = case(20, 64, 96, 40, 16, "bfloat16")
    fn = dispatch.expert_glu_kernel(z, w, inds)
    assert fn.keywords["backend"] == "cuda" and fn.func is expert_glu_prefill_mma
    assert rel_err(expert_glu(z, w, inds, wts, beta, cap), want) < TOL
    monkeypatch.setenv("KIMI_K3_EXPERT_PREFILL", "reference")
    assert dispatch.expert_glu_kernel(z, w, inds) is None


def test_decode_and_prefill_agree_with_gather_qmm():
    """Same K3-size inputs through both kernels and MLX's quantized ops (float32 latents)."""
    args, want = case(16, *K3, 8, 16, "float32")
    ref = expert_glu_reference(*args)
    decoders = (
        expert_glu_decode,
        mxfp4_mma.expert_glu_decode,
        mxfp4_one.expert_glu_decode,
    )
    for fn in (*decoders, expert_glu_prefill, expert_glu_prefill_mma):
        got = fn(*args, backend="cuda")
        assert rel_err(got, want) < TOL
        assert rel_err(got, ref) < 1e-3  # gather_qmm may take TF32 paths on CUDA


def test_reads_cache_slots_as_given():
    check_reads_cache_slots("cuda")


@pytest.fixture(scope="module")
def k3_layer():
    """One K3 layer's stack: 896 experts at K3 dims (about 16 GB), built on the GPU. Past
    2^31 4-bit elements per matrix, where MLX's gather_qmm and the kernels disagree."""
    from benchmarks.bench_mxfp4 import random_experts

    w = random_experts(896, *K3, seed=0)
    yield w
    del w
    mx.clear_cache()


@pytest.mark.parametrize("lo", [0, 384, 880])
def test_k3_layer_scale_against_dense_oracle(k3_layer, monkeypatch, lo):
    """Tokens routed to experts lo..lo+15 of 896 (byte offsets past 2^31 and 2^32 for the
    higher bands): the decode kernel, the prefill kernel and the dispatcher's choice
    against an fp32 dense oracle (mx.dequantize, no matmul)."""
    from benchmarks.bench_mxfp4 import BETA as B
    from benchmarks.bench_mxfp4 import CAP as C
    from benchmarks.bench_mxfp4 import oracle

    monkeypatch.delenv("KIMI_K3_REFERENCE", raising=False)
    monkeypatch.delenv("KIMI_K3_KERNEL_BACKEND", raising=False)
    monkeypatch.delenv("KIMI_K3_EXPERT_PREFILL", raising=False)
    w, N, k = k3_layer, 9, 16
    inds = (lo + (mx.arange(N * k, dtype=mx.int32) * 7) % 16).reshape(N, k)
    wts = mx.softmax(mx.random.normal((N, k), key=mx.random.key(lo)), axis=-1)
    z = mx.random.normal((N, K3[0]), key=mx.random.key(lo + 1)).astype(mx.bfloat16)
    want = oracle(z, w, inds, wts)
    got = expert_glu_decode(z[:1], w, inds[:1], wts[:1], B, C, backend="cuda")
    assert rel_err(got, want[:1]) < 1e-5
    got = mxfp4_mma.expert_glu_decode(z[:4], w, inds[:4], wts[:4], B, C, backend="cuda")
    assert rel_err(got, want[:4]) < 1e-5
    got = mxfp4_one.expert_glu_decode(z[:1], w, inds[:1], wts[:1], B, C, backend="cuda")
    assert rel_err(got, want[:1]) < 1e-5
    assert dispatch.expert_glu_kernel(z[:4], w, inds[:4]).func is mxfp4_mma.expert_glu_decode
    assert rel_err(expert_glu_prefill(z, w, inds, wts, B, C, backend="cuda"), want) < 1e-5
    got = expert_glu_prefill_mma(z, w, inds, wts, B, C, backend="cuda")
    assert rel_err(got, want) < 1e-5
    assert rel_err(expert_glu(z, w, inds, wts, B, C), want) < 1e-5  # N*k > 128: prefill path


@pytest.mark.parametrize("scales", [None, *mxfp4_prefill_mma.SCALES])  # None: as dispatched
@pytest.mark.parametrize("tm", [16, 32])
def test_prefill_mma_tiled_layout_same_bits(monkeypatch, tm, scales):
    """The grouped GEMM on ``expert_layout``'s tiles (what a tiled store's prefill runs),
    each way of loading the scale bytes, gives the bits it gives on MLX's layout, at K3
    size."""
    if scales:
        monkeypatch.setattr(mxfp4_prefill_mma, "TILED_SCALES", scales)
    (z, w, *rest), want = case(16, *K3, 257, 4, "bfloat16")
    plain = np.array(expert_glu_prefill_mma(z, w, *rest, tile_tokens=tm, backend="cuda"))
    wt = expert_layout.tile(w)
    got = expert_glu_prefill_mma(z, wt, *rest, tile_tokens=tm, backend="cuda")
    assert np.array_equal(np.array(got), plain)
    assert rel_err(got, want) < TOL


def test_prefill_mma_pairs_do_not_depend_on_the_call():
    """A pair's output from the tensor-core GEMM is the same bits at either tile size and
    with other pairs beside it (what ``Streamer._grouped`` relies on), at K3 size."""
    (z, w, inds, wts, beta, cap), _ = case(16, *K3, 257, 4, "bfloat16")
    whole = np.array(expert_glu_prefill_mma(z, w, inds, wts, beta, cap, 16, backend="cuda"))
    wide = expert_glu_prefill_mma(z, w, inds, wts, beta, cap, 32, backend="cuda")
    assert np.array_equal(np.array(wide), whole)
    part = expert_glu_prefill_mma(z[40:90], w, inds[40:90], wts[40:90], beta, cap, 16, "cuda")
    assert np.array_equal(np.array(part), whole[40:90])


@pytest.mark.parametrize("N", [1, 4, 64])
def test_dispatched_on_tiled_stacks_same_bits(monkeypatch, N):
    """``expert_glu`` on ``TiledStacks`` (one launch at 16 pairs, three at 64, the grouped
    GEMM at 1024) gives the bits it gives on MLX's layout; the reference on tiles agrees
    with the reference on MLX's layout."""
    for var in ("KIMI_K3_REFERENCE", "KIMI_K3_EXPERT_DECODE", "KIMI_K3_KERNEL_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    (z, w, *rest), want = case(16, *K3, N, 16, "bfloat16")
    wt = expert_layout.tile(w)
    fn = dispatch.expert_glu_kernel(z, wt, rest[0])
    assert fn.func in (
        mxfp4_one.expert_glu_decode_tiled,
        mxfp4_mma.expert_glu_decode_tiled,
        expert_glu_prefill_mma,
    )
    got = np.array(expert_glu(z, wt, *rest))
    assert np.array_equal(got, np.array(expert_glu(z, w, *rest)))
    assert rel_err(mx.array(got), want) < TOL
    ref = expert_glu_reference(z, wt, *rest)
    assert mx.array_equal(ref, expert_glu_reference(z, w, *rest)).item()
