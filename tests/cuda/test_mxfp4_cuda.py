"""MXFP4 expert kernels on MLX's CUDA backend (the lent H200): the emulator suite's small cases,
then K3-size cases with more experts and tokens, against the same float64 oracle. The K3-size
cases share one 16-expert stack, so the oracle (on the host CPU) dequantizes each expert once."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_mxfp4_kernels import (  # noqa: E402
    DECODE_CASES,
    PREFILL_CASES,
    TOL,
    case,
    check_reads_cache_slots,
    rel_err,
)

from kimi_k3.experts import expert_glu, expert_glu_reference  # noqa: E402
from kimi_k3.kernels import dispatch  # noqa: E402
from kimi_k3.kernels.mxfp4_decode import expert_glu_decode  # noqa: E402
from kimi_k3.kernels.mxfp4_prefill import expert_glu_prefill  # noqa: E402

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
    "E,D,I,N,k,dtype,tm",
    SMALL_PREFILL + [(16, *K3, 257, 4, "bfloat16", tm) for tm in (16, 32, 64)],
)
def test_prefill_matches_oracle(E, D, I, N, k, dtype, tm):
    args, want = case(E, D, I, N, k, dtype)
    got = expert_glu_prefill(*args, tile_tokens=tm, backend="cuda")
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


def test_dispatcher_uses_cuda_kernels(monkeypatch):
    monkeypatch.delenv("KIMI_K3_REFERENCE", raising=False)
    monkeypatch.delenv("KIMI_K3_KERNEL_BACKEND", raising=False)
    for N in (1, 40):
        (z, w, inds, wts, beta, cap), want = case(20, 64, 96, N, 16, "bfloat16")
        fn = dispatch.expert_glu_kernel(z, w, inds)
        assert fn.keywords["backend"] == "cuda"
        assert fn.func is (expert_glu_decode if N == 1 else expert_glu_prefill)
        assert rel_err(expert_glu(z, w, inds, wts, beta, cap), want) < TOL


def test_decode_and_prefill_agree_with_gather_qmm():
    """Same K3-size inputs through both kernels and MLX's quantized ops (float32 latents)."""
    args, want = case(16, *K3, 8, 16, "float32")
    ref = expert_glu_reference(*args)
    for fn in (expert_glu_decode, expert_glu_prefill):
        got = fn(*args, backend="cuda")
        assert rel_err(got, want) < TOL
        assert rel_err(got, ref) < 1e-3  # gather_qmm may take TF32 paths on CUDA


def test_reads_cache_slots_as_given():
    check_reads_cache_slots("cuda")
