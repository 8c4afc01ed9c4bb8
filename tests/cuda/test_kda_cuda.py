"""KDA kernels on MLX's CUDA backend against the pure-MLX reference (computed on the CPU).

Runs only where ``mx.cuda.is_available()`` (the H200 machine); skipped elsewhere. Run with
``MLX_ENABLE_TF32=0`` so the fp32 MLX ops around the kernels are exact fp32.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_kda_kernels import activations, layer, rel_err  # noqa: E402

from kimi_k3.kda import kda_mix, kda_mix_reference  # noqa: E402
from kimi_k3.kernels import dispatch, kda_decode, kda_prefill  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend"),
]

DTYPES = [mx.float32, mx.bfloat16]


def reference(p, args):
    with mx.stream(mx.cpu):
        out = kda_mix_reference(p, *args)
        mx.eval(out)
    return out


def check_cuda(out, ref, dtype):
    """As on the emulator; bf16 gets a looser state bound because the SiLU before the
    recurrence (in kda_pre / kda_decode, with CUDA's expf) may round a bf16 value differently
    on the GPU than the CPU reference does."""
    y_tol = 2e-5 if dtype == mx.float32 else 1e-2
    s_tol = 2e-5 if dtype == mx.float32 else 2e-3
    mx.eval(out)
    errs = (rel_err(out[0], ref[0]), rel_err(out[2], ref[2]))
    assert out[0].dtype == ref[0].dtype and out[0].shape == ref[0].shape
    assert errs[0] < y_tol and errs[1] < s_tol, f"relative RMS error (y, state) = {errs}"
    assert mx.array_equal(out[1], ref[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("B, H, K", [(2, 3, 32), (1, 2, 64), (1, 96, 128)])
def test_decode(B, H, K, dtype, with_state):
    p = layer(H, K)
    args = activations(B, 1, H, K, dtype, with_state)
    check_cuda(kda_decode.kda_decode("cuda", p, *args), reference(p, args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("T", [2, 7, 63, 64, 65, 257, 1000])
@pytest.mark.parametrize("H, K", [(2, 64), (3, 128), (96, 128)])
def test_prefill(T, H, K, dtype, with_state):
    p = layer(H, K)
    args = activations(1, T, H, K, dtype, with_state)
    check_cuda(kda_prefill.kda_prefill("cuda", p, *args), reference(p, args), dtype)


def test_kda_mix_uses_the_cuda_kernels():
    p = layer(96, 128)
    x = activations(1, 130, 96, 128, mx.bfloat16, False)
    assert dispatch.kda_mix_kernel(p, x[0], None, None) is not None
    got = ref = (None, None)
    for lo, hi in [(0, 129), (129, 130)]:
        step = [a[:, lo:hi] for a in x[:6]]
        got_y, *got = kda_mix(p, *step, *got)
        ref_y, *ref = reference(p, (*step, *ref))
        check_cuda((got_y, *got), (ref_y, *ref), mx.bfloat16)


def test_prefill_state_pass_k3_shape():
    """The state pass at K3's shape, several chunks."""
    p = layer(96, 128)
    args = activations(1, 257, 96, 128, mx.float32, True)
    check_cuda(kda_prefill.kda_prefill("cuda", p, *args), reference(p, args), mx.float32)


@pytest.mark.parametrize("kind", ["fma", "mma"])
@pytest.mark.parametrize("T, H, K", [(65, 2, 64), (1000, 3, 128), (257, 96, 128)])
def test_state_passes(monkeypatch, kind, T, H, K):
    """Both state passes on the GPU: the tensor-core one (CUDA's default) and the fp32 FMA one
    (Metal's, also compiled and run here)."""
    monkeypatch.setitem(kda_prefill.STATE_PASS, "cuda", kind)
    p = layer(H, K)
    args = activations(1, T, H, K, mx.float32, True)
    check_cuda(kda_prefill.kda_prefill("cuda", p, *args), reference(p, args), mx.float32)


def test_mma_tf32_layout():
    """SIMD_MMA_TF32's PTX spelling has the documented fragment layout."""
    from test_kda_kernels import check_mma_tf32_layout

    check_mma_tf32_layout("cuda")
