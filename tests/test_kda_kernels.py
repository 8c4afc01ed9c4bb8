"""KDA kernels against the pure-MLX reference (computed on the CPU): the Metal rendering run
by the emulator, and the CUDA rendering on MLX's CUDA backend (the ``backend`` fixture)."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import broken

from kimi_k3.kernels import dispatch, kda_decode, kda_prefill
from kimi_k3.model.kda import kda_mix, kda_mix_reference

FLA = Path(__file__).parent / "data" / "kda_fla_vectors.npz"
W = 4


def layer(H, K, seed=0):
    mx.random.seed(seed)
    P = H * K
    return dict(
        q_conv=mx.random.normal((P, 1, W)) * 0.5,
        k_conv=mx.random.normal((P, 1, W)) * 0.5,
        v_conv=mx.random.normal((P, 1, W)) * 0.5,
        A_log=mx.random.normal((H,)) * 0.5,
        dt_bias=mx.random.normal((P,)),
        o_norm=1 + 0.1 * mx.random.normal((K,)),
        heads=H,
        head_dim=K,
        lower_bound=-5.0,
        eps=1e-5,
    )


def activations(B, T, H, K, dtype, with_state, seed=1):
    mx.random.seed(seed)
    P = H * K
    x = [mx.random.normal((B, T, P)).astype(dtype) for _ in range(4)]
    b_logits = mx.random.normal((B, T, H)).astype(dtype)
    gate = mx.random.normal((B, T, P)).astype(dtype)
    conv = mx.random.normal((B, W - 1, 3 * P)).astype(dtype) if with_state else None
    state = mx.random.normal((B, H, K, K)) * 0.1 if with_state else None
    return (*x, b_logits, gate, conv, state)


def rel_err(a, b):
    a, b = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (a, b))
    return np.sqrt(((a - b) ** 2).mean()) / max(np.sqrt((b**2).mean()), 1e-30)


def reference(p, args):
    """``kda_mix_reference`` on the CPU (the same ops on either backend)."""
    with mx.stream(mx.cpu):
        out = kda_mix_reference(p, *args)
        mx.eval(out)
    return out


# Relative RMS error bounds (outputs, state) per backend and activation dtype. On CUDA, bf16
# gets a looser state bound because the SiLU before the recurrence (in kda_pre / kda_decode,
# with CUDA's expf) may round a bf16 value differently on the GPU than the CPU reference does.
TOLS = {
    ("emulator", mx.float32): (1e-5, 1e-5),
    ("emulator", mx.bfloat16): (1e-2, 1e-5),
    ("cuda", mx.float32): (2e-5, 2e-5),
    ("cuda", mx.bfloat16): (1e-2, 2e-3),
}


def check(out, ref, dtype, backend="emulator", s_tol=None):
    """Outputs, conv window (exact: it is copies) and fp32 state (to ``s_tol``, else the
    backend's bound in ``TOLS``)."""
    y_tol, state_tol = TOLS[backend, dtype]
    mx.eval(out)
    assert out[0].dtype == ref[0].dtype and out[0].shape == ref[0].shape
    assert rel_err(out[0], ref[0]) < y_tol
    assert mx.array_equal(out[1], ref[1])
    assert out[2].dtype == mx.float32 and rel_err(out[2], ref[2]) < (s_tol or state_tol)


DTYPES = [mx.float32, mx.bfloat16]
CUDA = pytest.mark.cuda  # K3's and other large shapes: on CUDA only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("B, H, K", [(2, 3, 32), (1, 2, 64), (1, 96, 128)])
def test_decode_matches_reference(backend, B, H, K, dtype, with_state):
    p = layer(H, K)
    args = activations(B, 1, H, K, dtype, with_state)
    check(kda_decode.kda_decode(backend, p, *args), reference(p, args), dtype, backend)


def test_decode_layer_cache_follows_the_layer():
    """The wrapper caches a layer's fp32 weights and params; a changed weight or scalar in the
    same dict (and bf16 weights, converted once) must still give the reference result."""
    p = layer(2, 64)
    args = activations(1, 1, 2, 64, mx.float32, True)
    check(kda_decode.kda_decode("emulator", p, *args), kda_mix_reference(p, *args), mx.float32)
    (packed,) = kda_decode._layer_inputs(p)
    assert packed.dtype == mx.float32 and packed.size == 3 * 128 * W + 2 + 128 + 64 + 2
    assert kda_decode._layer_inputs(dict(p))[0] is packed  # a fresh dict, the same weights
    p["lower_bound"] = -3.0  # the same weight arrays, another scalar
    check(kda_decode.kda_decode("emulator", p, *args), kda_mix_reference(p, *args), mx.float32)
    assert kda_decode._layer_inputs(p)[0] is not packed
    p["o_norm"] = p["o_norm"] * 1.5
    p["A_log"] = p["A_log"] + 0.3
    check(
        kda_decode.kda_decode("emulator", dict(p), *args), kda_mix_reference(p, *args), mx.float32
    )
    p["q_conv"] = p["q_conv"].astype(mx.bfloat16)
    check(kda_decode.kda_decode("emulator", p, *args), kda_mix_reference(p, *args), mx.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("T", [2, 7, 63, 64, 65, 257, 1000])
@pytest.mark.parametrize(
    "H, K", [(2, 64), pytest.param(3, 128, marks=CUDA), pytest.param(96, 128, marks=CUDA)]
)
def test_prefill_matches_reference(backend, H, K, T, dtype, with_state):
    p = layer(H, K)
    args = activations(1, T, H, K, dtype, with_state)
    check(kda_prefill.kda_prefill(backend, p, *args), reference(p, args), dtype, backend)


@pytest.mark.slow
@pytest.mark.parametrize("B, T, H, K", [(2, 65, 3, 64), (1, 130, 2, 128), (1, 65, 96, 128)])
def test_prefill_other_shapes(B, T, H, K):
    p = layer(H, K)
    args = activations(B, T, H, K, mx.float32, True)
    check(kda_prefill.kda_prefill("emulator", p, *args), kda_mix_reference(p, *args), mx.float32)


def test_chunk_kernels_match_fla():
    """An oracle nobody here wrote: flash-linear-attention's naive recurrence (the one case
    with K == V in the kernels' head sizes)."""
    case = "T130_H4_K128_V128_h0"
    data = np.load(FLA)
    get = lambda n: mx.array(data[f"{case}/{n}"])  # noqa: E731
    K = data[f"{case}/q"].shape[-1]
    h0 = get("h0") if f"{case}/h0" in data else None
    o, S = kda_prefill.kda_chunk(
        "emulator", get("q") * K**-0.5, get("k"), get("v"), get("g"), get("beta"), h0
    )
    assert rel_err(o, get("o")) < 1e-5 and rel_err(S, get("S")) < 1e-5


def test_state_carries_across_calls():
    p = layer(2, 64)
    args = activations(1, 100, 2, 64, mx.float32, True)
    ref = kda_mix_reference(p, *args)
    first = [a[:, :37] for a in args[:6]]
    y1, conv, state = kda_prefill.kda_prefill("emulator", p, *first, *args[6:])
    y2, conv, state = kda_prefill.kda_prefill(
        "emulator", p, *[a[:, 37:] for a in args[:6]], conv, state
    )
    check((mx.concatenate([y1, y2], axis=1), conv, state), ref, mx.float32)


def test_kda_mix_dispatches_to_the_kernels(monkeypatch):
    """The model's entry point, prefill then decode, with kernels vs the reference chain."""
    p = layer(2, 64)
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    x = activations(1, 68, 2, 64, mx.bfloat16, False)
    assert dispatch.kda_mix_kernel(p, x[0][:, :1], None, None).func is kda_decode.kda_decode
    assert dispatch.kda_mix_kernel(p, x[0], None, None).func is kda_prefill.kda_prefill
    got = ref = (None, None)
    for lo, hi in [(0, 65), (65, 66), (66, 67), (67, 68)]:
        step = [a[:, lo:hi] for a in x[:6]]
        got_y, *got = kda_mix(p, *step, *got)
        ref_y, *ref = kda_mix_reference(p, *step, *ref)
        check((got_y, *got), (ref_y, *ref), mx.bfloat16)
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "none")
    assert dispatch.kda_mix_kernel(p, x[0], None, None) is None


def test_dispatch_keeps_the_reference_where_kernels_do_not_apply(monkeypatch):
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    x = mx.zeros((1, 1, 2 * 48))
    assert dispatch.kda_mix_kernel(layer(2, 48), x, None, None) is None  # head_dim % 32
    assert dispatch.kda_mix_kernel(layer(2, 32), x.astype(mx.float16)[..., :64], None, None) is None
    x32 = mx.zeros((1, 5, 2 * 32))
    assert dispatch.kda_mix_kernel(layer(2, 32), x32[:, :1], None, None) is not None  # decode
    assert dispatch.kda_mix_kernel(layer(2, 32), x32, None, None) is None  # prefill: 64, 128
    with pytest.raises(ValueError):
        kda_prefill.kda_chunk("emulator", *[mx.zeros((1, 5, 2, 32))] * 4, mx.zeros((1, 5, 2)), None)
    monkeypatch.delenv("KIMI_K3_KERNEL_BACKEND")
    assert dispatch.kda_mix_kernel(layer(2, 32), x[..., :64], None, None) is None  # CPU


@pytest.mark.parametrize(
    "old, new",
    [
        ("Sm[3 * K]);\n  }\n  BARRIER();", "Sm[3 * K]);\n  }"),
        ("s_oo[SIMDGROUP] = oo;\n  BARRIER();", "s_oo[SIMDGROUP] = oo;"),
        ("Sm[0], Sm[K], Sm[2 * K], Sm[3 * K]", "Sm[0], Sm[K], Sm[2 * K + 1], Sm[3 * K]"),
        ("for (uint o = 1; o < R; o <<= 1)", "for (uint o = 2; o < R; o <<= 1)"),
    ],
    ids=["missing-barrier", "missing-rms-barrier", "off-by-one", "partial-column-sum"],
)
def test_a_broken_decode_kernel_fails(monkeypatch, old, new):
    monkeypatch.setattr(kda_decode, "KDA_DECODE", broken(kda_decode.KDA_DECODE, old, new))
    p = layer(2, 64)
    args = activations(1, 1, 2, 64, mx.float32, True)
    with pytest.raises(AssertionError):
        check(kda_decode.kda_decode("emulator", p, *args), kda_mix_reference(p, *args), mx.float32)


def assert_prefill_breaks(monkeypatch, name: str, old: str, new: str, T: int):
    """With prefill kernel ``name`` mutated (``old`` -> ``new``), the whole prefill mixer on
    T tokens (2 heads x 64, with state, fp32) no longer passes ``check``."""
    monkeypatch.setattr(kda_prefill, name, broken(getattr(kda_prefill, name), old, new))
    p = layer(2, 64)
    args = activations(1, T, 2, 64, mx.float32, True)
    with pytest.raises(AssertionError):
        check(
            kda_prefill.kda_prefill("emulator", p, *args), kda_mix_reference(p, *args), mx.float32
        )


@pytest.mark.parametrize(
    "old, new",
    [
        ("landed (the next tile's may be in flight)\n    BARRIER();", "landed"),
        (
            "if (rl == 7) sm4[OSEG + 4 * warp + dq] = Gv;  // the warp's totals\n    BARRIER();",
            "if (rl == 7) sm4[OSEG + 4 * warp + dq] = Gv;",
        ),
        ("j4 < (i + 3) / 4; ++j4", "j4 < (i + 2) / 4; ++j4"),
        (
            "const uint from = rl >= d ? lane - 4 * d : lane;",
            "const uint from = rl >= d ? lane - d : lane;",
        ),
        ("for (int i = 0; i < C; ++i) x[i] *= s_beta[i];", ""),  # U's right-hand side
        # the asynchronous tile copies: the tile read before its copies land, a wait one
        # group short, the next tile copied over this one, the last group never committed
        ("ASYNC_WAIT(1);", ""),
        ("ASYNC_WAIT(1);", "ASYNC_WAIT(2);"),
        ("const int NQ = 512 - OQ;", "const int NQ = OQ;"),
        ("    ASYNC_COMMIT();  // (empty", "    // (empty"),
    ],
    ids=[
        "missing-barrier",
        "missing-scan-barrier",
        "off-by-one",
        "scan-lane",
        "rhs-without-beta",
        "no-wait",
        "wait-too-short",
        "same-buffer",
        "missing-commit",
    ],
)
def test_a_broken_prefill_kernel_fails(monkeypatch, old, new):
    """The emulator lands asynchronous copies at once or at their wait (half each), so the
    pipeline slips fail too; T = 130: three chunks of the 2 x 64 layer."""
    assert_prefill_breaks(monkeypatch, "KDA_CHUNK_PREP", old, new, T=130)


@pytest.mark.parametrize(
    "kernel, old, new",
    [
        ("KDA_PRE", "wq[i][j] = wq[i][j + 1];", "wq[i][j] = wq[i][j];"),  # window not sliding
        ("KDA_PRE", "const int u = ta + j;", "const int u = ta + j + 1;"),  # window start
        ("KDA_PRE", "const int u = n_tok + j;", "const int u = n_tok + j - 1;"),  # conv_out
        ("KDA_PRE", "sk = SIMD_SUM(sk);", ""),  # a lane's partial |k|^2 only
        (
            "KDA_PRE",
            "    s_w[e] = w[c * W + j];\n  }\n  BARRIER();",
            "    s_w[e] = w[c * W + j];\n  }",
        ),
        ("KDA_POST", "x[i] = o[base + LANE + 32 * i];", "x[i] = o[base + LANE + 32 * i + 1];"),
        # the next token's inputs: the current token's loaded again
        ("KDA_PRE", "x_k[row + P + c]", "x_k[row + c]"),
        ("KDA_PRE", "b_logits[((size_t)b * n_tok + t + 1)", "b_logits[((size_t)b * n_tok + t)"),
    ],
    ids=[
        "pre-window-shift",
        "pre-window-start",
        "pre-conv-out",
        "pre-norm",
        "pre-missing-barrier",
        "post-off-by-one",
        "pre-stale-next-token",
        "pre-stale-next-beta",
    ],
)
def test_a_broken_pre_or_post_kernel_fails(monkeypatch, kernel, old, new):
    assert_prefill_breaks(monkeypatch, kernel, old, new, T=70)


@pytest.mark.parametrize(
    "old, new",
    [
        ("      st[sk * CP + sq] = na;\n      BARRIER();", "      st[sk * CP + sq] = na;"),
        ("const DEVICE float* Wx = Wn + C * K + sbase;", "const DEVICE float* Wx = Wn + sbase;"),
        ("if (s0 + ST < K) {", "if (s0 + ST < K - ST) {"),
    ],
    ids=["missing-barrier", "stale-next-chunk-prefetch", "short-prefetch"],
)
def test_a_broken_state_kernel_fails(monkeypatch, old, new):
    """The register prefetch of the state kernel: each slip changes the result."""
    assert_prefill_breaks(monkeypatch, "KDA_CHUNK_STATE", old, new, T=130)


@pytest.mark.cuda
def test_kda_mix_uses_the_cuda_kernels():
    """The model's entry point at K3's shape on CUDA (the default backend there), prefill
    then decode, against the reference chain."""
    p = layer(96, 128)
    x = activations(1, 130, 96, 128, mx.bfloat16, False)
    assert dispatch.kda_mix_kernel(p, x[0], None, None) is not None
    got = ref = (None, None)
    for lo, hi in [(0, 129), (129, 130)]:
        step = [a[:, lo:hi] for a in x[:6]]
        got_y, *got = kda_mix(p, *step, *got)
        ref_y, *ref = reference(p, (*step, *ref))
        check((got_y, *got), (ref_y, *ref), mx.bfloat16, "cuda")


@pytest.mark.cuda
def test_prefill_state_pass_k3_shape(backend):
    """The state pass at K3's shape, several chunks."""
    p = layer(96, 128)
    args = activations(1, 257, 96, 128, mx.float32, True)
    check(kda_prefill.kda_prefill(backend, p, *args), reference(p, args), mx.float32, backend)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["fma", "mma"])
@pytest.mark.parametrize("T, H, K", [(65, 2, 64), (1000, 3, 128), (257, 96, 128)])
def test_state_passes(backend, monkeypatch, kind, T, H, K):
    """Both state passes on the GPU: the tensor-core one (CUDA's default) and the fp32 FMA one
    (Metal's, also compiled and run there)."""
    monkeypatch.setitem(kda_prefill.STATE_PASS, backend, kind)
    p = layer(H, K)
    args = activations(1, T, H, K, mx.float32, True)
    check(kda_prefill.kda_prefill(backend, p, *args), reference(p, args), mx.float32, backend)


def test_state_pass_at_head_dim_128():
    p = layer(2, 128)
    args = activations(1, 130, 2, 128, mx.float32, True)
    check(kda_prefill.kda_prefill("emulator", p, *args), kda_mix_reference(p, *args), mx.float32)


# The tensor-core state pass (kda_chunk_state_mma, CUDA's): its Metal rendering spells each
# MMA out with shuffles, exact but slow, so Metal dispatches the FMA one; here the emulator
# checks its fragment bookkeeping, staging and barriers on a few shapes.
MMA_STATE_CASES = [
    (1, 2, 2, 64, mx.float32, True),
    (1, 65, 2, 64, mx.float32, True),
    (1, 64, 2, 64, mx.float32, False),
    (1, 130, 1, 128, mx.float32, True),
    (1, 100, 2, 64, mx.bfloat16, True),
    (2, 70, 3, 64, mx.float32, True),
]


def mma_state_pass(monkeypatch, warps=None):
    monkeypatch.setitem(kda_prefill.STATE_PASS, "emulator", "mma")
    if warps is not None:
        monkeypatch.setattr(kda_prefill, "STATE_MMA_WARPS", warps)


# The tf32 state pass (one MMA per product, kda_prefill.MMA_PRECISION's choice for bf16
# activations) measured 2.4e-4 / 2.5e-4 relative RMS error in the state (bf16 / fp32
# activations, 130 tokens, 1 x 128) on the emulator; its stated bound is 1e-3.
TF32_STATE_TOL = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("B, T, H, K, dtype, with_state", MMA_STATE_CASES)
def test_mma_state_pass_matches_reference(monkeypatch, B, T, H, K, dtype, with_state):
    mma_state_pass(monkeypatch)
    p = layer(H, K)
    args = activations(B, T, H, K, dtype, with_state)
    s_tol = TF32_STATE_TOL if kda_prefill.MMA_PRECISION[dtype] == "tf32" else 1e-5
    out = kda_prefill.kda_prefill("emulator", p, *args)
    check(out, kda_mix_reference(p, *args), dtype, s_tol=s_tol)


@pytest.mark.slow
@pytest.mark.parametrize("K", [64, 128])
def test_tf32_state_pass_is_one_mma_per_product(monkeypatch, K):
    """precision="tf32" runs the single-MMA pass (within its bound, but visibly less exact
    than the 3xTF32 one), "fp32" the 3xTF32 pass; bf16 activations pick tf32 unless
    MMA_PRECISION or KIMI_K3_KDA_PRECISION says otherwise; unknown precisions are refused."""
    mma_state_pass(monkeypatch)
    p = layer(2, K)
    args = activations(1, 100, 2, K, mx.float32, True)
    ref = kda_mix_reference(p, *args)
    r = kda_prefill.pre("emulator", p, *args[:5], args[6])[:5]
    errs = {}
    for precision in kda_prefill.PRECISIONS:
        o, S = kda_prefill.kda_chunk("emulator", *r, args[7], precision=precision)
        errs[precision] = rel_err(S, ref[2])
    assert errs["fp32"] < 1e-5 < errs["tf32"] < TF32_STATE_TOL, errs
    bf = activations(1, 100, 2, K, mx.bfloat16, True)
    _, _, S_bf = kda_prefill.kda_prefill("emulator", p, *bf)
    monkeypatch.setenv("KIMI_K3_KDA_PRECISION", "fp32")  # the variable overrides the table
    _, _, S_env = kda_prefill.kda_prefill("emulator", p, *bf)
    monkeypatch.delenv("KIMI_K3_KDA_PRECISION")
    monkeypatch.setitem(kda_prefill.MMA_PRECISION, mx.bfloat16, "fp32")
    _, _, S_fp = kda_prefill.kda_prefill("emulator", p, *bf)
    ref_bf = kda_mix_reference(p, *bf)[2]
    assert rel_err(S_fp, ref_bf) < 1e-5 < rel_err(S_bf, ref_bf) < TF32_STATE_TOL
    assert mx.array_equal(S_env, S_fp)
    with pytest.raises(ValueError, match="precision"):
        kda_prefill.kda_chunk("emulator", *r, args[7], precision="fp16")
    monkeypatch.setenv("KIMI_K3_KDA_PRECISION", "fp64")
    with pytest.raises(ValueError, match="KIMI_K3_KDA_PRECISION='fp64'"):
        kda_prefill.kda_prefill("emulator", p, *bf)


@pytest.mark.slow
@pytest.mark.parametrize("warps, K", [(2, 128), (8, 128), (8, 64)])
def test_mma_state_pass_launch_shapes(monkeypatch, warps, K):
    """2, 4 and 8 simdgroups per threadgroup (8 is capped to the head's K / 16 = 4 at K =
    64: a threadgroup's simdgroups share one head's staged data)."""
    mma_state_pass(monkeypatch, warps)
    p = layer(2, K)
    args = activations(1, 70, 2, K, mx.float32, True)
    check(kda_prefill.kda_prefill("emulator", p, *args), kda_mix_reference(p, *args), mx.float32)


def test_mma_state_pass_refuses_a_threadgroup_across_heads(monkeypatch):
    mma_state_pass(monkeypatch, 3)
    p = layer(2, 64)
    args = activations(1, 70, 2, 64, mx.float32, True)
    with pytest.raises(ValueError, match="STATE_MMA_WARPS"):
        kda_prefill.kda_prefill("emulator", p, *args)


@pytest.mark.slow
def test_mma_state_pass_matches_fla(monkeypatch):
    mma_state_pass(monkeypatch)
    test_chunk_kernels_match_fla()


@pytest.mark.slow
@pytest.mark.parametrize(
    "old, new",
    [
        (
            "FLOAT4(S[kk].x, S[kk].z, S[kk].y, S[kk].w)",
            "FLOAT4(S[kk].x, S[kk].y, S[kk].z, S[kk].w)",
        ),
        ("      BARRIER();        // everyone's have;", "      // everyone's have;"),
        ("jt <= it; ++jt", "jt < it; ++jt"),
        ("st + 2 < NST ? n : n + 1;", "st + 2 < NST ? n : n;"),
        ("ASYNC_WAIT(1);    // this thread's", "ASYNC_WAIT(2);    // this thread's"),
        ("const uint cur = (gs % 3) * SB;", "const uint cur = (gs % 2) * SB;"),
        ("((4 * k2 + tq) ^ KK_SWZ(8 * j + g))", "(4 * k2 + tq)"),
        ("(g & 1) ? FLOAT2(k0.y, k1.y)", "(g & 1) ? FLOAT2(k0.x, k1.y)"),
        ("d.x * S[s].z, d.y * S[s].w", "S[s].z, d.y * S[s].w"),
    ],
    ids=[
        "unpermuted-a",
        "missing-barrier",
        "causal-bound",
        "stale-next-chunk",
        "wait-too-short",
        "ring-of-two",
        "unswizzled-read",
        "kd-parity",
        "decay",
    ],
)
def test_a_broken_mma_state_kernel_fails(monkeypatch, old, new):
    mma_state_pass(monkeypatch)
    assert_prefill_breaks(monkeypatch, "KDA_CHUNK_STATE_MMA", old, new, T=130)


def test_mma_tf32_layout(backend):
    """SIMD_MMA_TF32 on one simdgroup with the layout kernels/README.md documents: A 16x8 and
    B 8x8 (tf32 values) in, C = A B out, against float64."""
    from kimi_k3.kernels.source import Instance, Kernel

    body = """
  const uint l = LANE, g = l / 4, t = l % 4;
  const float4 a = FLOAT4(A[g * 8 + t], A[(g + 8) * 8 + t], A[g * 8 + t + 4],
                          A[(g + 8) * 8 + t + 4]);
  const float2 b = FLOAT2(B[t * 8 + g], B[(t + 4) * 8 + g]);
  const float4 c = SIMD_MMA_TF32(FLOAT4(0.0f, 0.0f, 0.0f, 0.0f), a, b, l);
  out[g * 8 + 2 * t] = c.x;
  out[g * 8 + 2 * t + 1] = c.y;
  out[(g + 8) * 8 + 2 * t] = c.z;
  out[(g + 8) * 8 + 2 * t + 1] = c.w;
"""
    kernel = Kernel(
        "mma_tf32_layout",
        ["A", "B"],
        ["out"],
        body,
        instances=[Instance([mx.float32] * 2, [mx.float32])],
    )
    rng = np.random.default_rng(0)
    tf32 = lambda x: (x.astype(np.float32).view(np.uint32) & 0xFFFFE000).view(np.float32)  # noqa: E731
    A, B = tf32(rng.normal(size=(16, 8))), tf32(rng.normal(size=(8, 8)))
    (out,) = kernel(
        backend,
        inputs=[mx.array(A), mx.array(B)],
        output_shapes=[(16, 8)],
        output_dtypes=[mx.float32],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
    )
    want = A.astype(np.float64) @ B.astype(np.float64)
    assert np.abs(np.array(out) - want).max() < 1e-5 * np.abs(want).max()
