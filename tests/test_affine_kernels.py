"""The lower-bit experts' kernels (``affine_decode``, ``affine_prefill``: MLX ``affine`` at 2
and 3 bits) on the Metal emulator and on MLX's CUDA backend (the ``backend`` fixture; cases
marked ``cuda`` at K3's sizes run on CUDA alone).

The oracle dequantizes with ``numpy_ref.affine_decode`` (the bit stream as MLX packs it,
written from its definition, not from the kernels) and does the matmuls and SiTU-GLU in
float64; ``expert_glu_reference`` (``gather_qmm``, MLX's own affine matmul) is checked against
the same oracle.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from conftest import broken, dispatch_defaults
from numpy_ref import affine_decode, situ_glu

from kimi_k3.kernels import affine_decode as decode_kernels
from kimi_k3.kernels import affine_prefill as prefill_kernels
from kimi_k3.kernels import checks, dispatch
from kimi_k3.kernels.affine_decode import eligible, expert_glu_decode
from kimi_k3.kernels.affine_prefill import expert_glu_prefill
from kimi_k3.model.experts import expert_glu, expert_glu_reference

BETA, CAP = 4.0, 25.0
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
TOL = 2e-6  # kernel vs float64 oracle, RMS-relative; fp32 accumulation
K3 = (3584, 3072)


def on_cuda(*values):
    return pytest.param(*values, marks=pytest.mark.cuda)


def rel_err(a, b) -> float:
    a = np.asarray(a.astype(mx.float32) if isinstance(a, mx.array) else a, dtype=np.float64)
    b = np.asarray(b.astype(mx.float32) if isinstance(b, mx.array) else b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@functools.lru_cache(maxsize=4)
def random_experts(E: int, D: int, I: int, bits: int, gs: int, seed: int) -> dict:
    """``checks.random_affine_experts`` as numpy stacks, kept for the next test."""
    w = checks.random_affine_experts(E, D, I, bits, gs, seed)
    return {n: tuple(np.array(a) for a in t) for n, t in w.items()}


@functools.lru_cache(maxsize=24)
def dequantized(E, D, I, bits, gs, seed, e) -> tuple:
    w = random_experts(E, D, I, bits, gs, seed)
    return tuple(affine_decode(*(a[e] for a in w[n]), bits) for n in ("w1", "w2", "w3"))


def oracle(z, stack, inds, wts):
    """Dequantize, then ``sum_k w_k * down(situ(gate z) * cap*tanh(up z / cap))`` in float64."""
    z = z.astype(np.float64)
    out = np.zeros_like(z)
    for e in np.unique(inds):
        w1, w2, w3 = dequantized(*stack, int(e))
        tok, choice = np.nonzero(inds == e)
        h = situ_glu(z[tok] @ w1.T, z[tok] @ w3.T, BETA, CAP)
        np.add.at(out, tok, wts[tok, choice, None] * (h @ w2.T))
    return out


def case(E, D, I, N, k, dtype, bits, gs=64, seed=0):
    """MLX inputs for one case, and the oracle's output on exactly those (rounded) inputs."""
    w = random_experts(E, D, I, bits, gs, seed)
    inds, wts = (np.array(a) for a in checks.routing(N, E, k, seed + 1))
    z = mx.array(np.random.default_rng(seed + 2).standard_normal((N, D)), dtype=DTYPES[dtype])
    want = oracle(np.array(z.astype(mx.float32)), (E, D, I, bits, gs, seed), inds, wts)
    wm = {n: tuple(mx.array(a) for a in t) for n, t in w.items()}
    return (z, wm, mx.array(inds), mx.array(wts), BETA, CAP), want


def assert_broken(run, want, factor: float = 100):
    """A mutated kernel fails: the emulator refuses the launch, or the result misses the
    oracle by ``factor`` x TOL or more (NaN counts as a miss)."""
    try:
        got = run()
    except RuntimeError:
        return
    assert not rel_err(got, want) < factor * TOL


# (experts, D, I, tokens, top-k, dtype, bits, group): rows of fewer groups than lanes; a
# partial last lane pass (I = 2560: 40 groups in the down projection); rows over several
# tiles (I = 320 against gate/up's 96-row tiles); top-16; groups of 128; K3's dims.
DECODE_CASES = [
    (1, 64, 64, 1, 1, "float32", 2, 64),
    (5, 128, 192, 3, 2, "float32", 3, 64),
    (7, 192, 320, 17, 4, "bfloat16", 2, 64),
    (3, 64, 2560, 2, 2, "float32", 3, 64),
    (20, 64, 128, 1, 16, "float16", 2, 64),
    (4, 256, 384, 2, 2, "float32", 3, 128),
    (896, 64, 64, 4, 16, "bfloat16", 2, 64),
    (2, 3584, 3072, 1, 2, "bfloat16", 3, 64),
]

# (experts, D, I, tokens, top-k, dtype, bits, group, pairs per tile)
PREFILL_CASES = [
    (1, 64, 64, 1, 1, "float32", 2, 64, 16),
    (5, 128, 192, 3, 2, "float32", 3, 64, 16),
    (7, 320, 320, 17, 4, "bfloat16", 2, 64, 32),
    (6, 128, 64, 257, 3, "float32", 3, 64, 16),
    (64, 64, 64, 257, 8, "bfloat16", 2, 64, None),
    (4, 256, 384, 40, 4, "float16", 2, 128, None),
    (2, 3584, 3072, 3, 2, "bfloat16", 2, 64, 16),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "E,D,I,N,k,dtype,bits,gs",
    DECODE_CASES + [on_cuda(16, *K3, 4, 16, "bfloat16", b, 64) for b in (2, 3)],
)
def test_decode_matches_oracle(backend, E, D, I, N, k, dtype, bits, gs):
    args, want = case(E, D, I, N, k, dtype, bits, gs)
    got = expert_glu_decode(*args, backend=backend)
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


@pytest.mark.slow
@pytest.mark.parametrize(
    "E,D,I,N,k,dtype,bits,gs,tm",
    PREFILL_CASES + [on_cuda(64, *K3, 512, 16, "bfloat16", b, 64, None) for b in (2, 3)],
)
def test_prefill_matches_oracle(backend, E, D, I, N, k, dtype, bits, gs, tm):
    args, want = case(E, D, I, N, k, dtype, bits, gs)
    got = expert_glu_prefill(*args, tile_tokens=tm, backend=backend)
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("bits", [2, 3])
def test_small_cases_match_oracle(bits):
    """The quick tier's cases: both kernels at both widths, one case each."""
    args, want = case(5, 128, 192, 3, 2, "float32", bits)
    assert rel_err(expert_glu_decode(*args, backend="emulator"), want) < TOL
    args, want = case(6, 128, 64, 40, 3, "bfloat16", bits)
    assert rel_err(expert_glu_prefill(*args, backend="emulator"), want) < TOL


@pytest.mark.parametrize("bits, gs", [(2, 64), (3, 64), (3, 128)])
def test_oracle_matches_mlx_reference(bits, gs):
    """``expert_glu_reference`` on affine stacks (MLX's ``gather_qmm``) is the oracle's
    maths: the reference the kernels are checked against on a user's machine."""
    args, want = case(6, 256, 128, 5, 3, "float32", bits, gs)
    assert rel_err(expert_glu_reference(*args), want) < 1e-5


def test_reads_cache_slots_as_given():
    """Slots in any order, and an offset view of a larger pool, as the streamer hands them."""
    args, want = case(6, 128, 128, 3, 2, "float32", 2)
    z, w, inds, wts = args[:4]
    slots = np.random.default_rng(3).permutation(10)[:6]  # expert e lives in slot slots[e]
    pool = {}
    for n, t in w.items():
        pool[n] = []
        for a in t:
            big = mx.zeros((11, *a.shape[1:]), a.dtype)
            big[mx.array(slots + 1)] = a
            pool[n].append(big[1:])
    pool = {n: tuple(t) for n, t in pool.items()}
    sinds = mx.array(slots[np.array(inds)].astype(np.int32))
    for fn in (expert_glu_decode, expert_glu_prefill):
        assert rel_err(fn(z, pool, sinds, wts, BETA, CAP, backend="emulator"), want) < TOL


def test_dispatcher(monkeypatch):
    """Affine stacks go to the affine kernels by pair count, on Metal and CUDA alike; each
    width is its own variant; stacks the kernels do not take go to the reference."""
    dispatch_defaults(monkeypatch)
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    seen = []
    monkeypatch.setattr(dispatch, "checked", lambda name, b, fn: seen.append((name, b)) or fn)
    args, _ = case(4, 128, 128, 2, 2, "float32", 3)
    z, w = args[:2]
    fn = dispatch.expert_glu_kernel(z, w, mx.zeros((2, 2), mx.int32))
    assert fn.func is expert_glu_decode and seen[-1] == ("affine3_decode", "emulator")
    fn = dispatch.expert_glu_kernel(z, w, mx.zeros((2, 65), mx.int32))
    assert fn.func is expert_glu_prefill and seen[-1] == ("affine3_prefill", "emulator")
    for backend in ("metal", "cuda"):
        monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", backend)
        assert dispatch.expert_glu_kernel(z, w, mx.zeros((2, 2), mx.int32)).func is (
            expert_glu_decode
        )
    monkeypatch.setenv("KIMI_K3_EXPERT_PREFILL", "reference")
    assert dispatch.expert_glu_kernel(z, w, mx.zeros((2, 65), mx.int32)) is None
    monkeypatch.setenv("KIMI_K3_REFERENCE", "experts")
    assert dispatch.expert_glu_kernel(z, w, mx.zeros((2, 2), mx.int32)) is None
    monkeypatch.delenv("KIMI_K3_REFERENCE")
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "none")
    assert dispatch.expert_glu_kernel(z, w, mx.zeros((2, 2), mx.int32)) is None


def test_eligibility():
    args, _ = case(2, 128, 128, 1, 1, "float32", 2)
    z, w, inds = args[:3]
    assert eligible(z, w, inds)
    bf16 = {n: (q, s.astype(mx.bfloat16), b.astype(mx.bfloat16)) for n, (q, s, b) in w.items()}
    assert not eligible(z, bf16, inds)  # the kernels read float16 scales and biases
    assert not eligible(z.astype(mx.int32), w, inds)
    w4 = {
        n: (mx.zeros((2, q.shape[1], q.shape[2] * 2), mx.uint32), s, b)
        for n, (q, s, b) in w.items()
    }
    assert not eligible(z, w4, inds)  # 4 bits: no affine kernel
    g32 = case(2, 128, 128, 1, 1, "float32", 2, 32)[0][1]
    assert not eligible(z, g32, inds)  # groups of 32: a group's codes are no whole 8 bytes


def header_broken(kernel, old: str, new: str):
    """``kernel`` with ``old`` in its header replaced by ``new``."""
    assert kernel.header.count(old) == 1
    return replace(
        kernel, name=kernel.name + "_broken", header=kernel.header.replace(old, new), _built={}
    )


DECODE_MUTATIONS = [
    (
        "AFFINE_GATE_UP",
        "xs[(i % Q) * GP + i / Q] = a;\n  }\n  BARRIER();",
        "xs[(i % Q) * GP + i / Q] = a;\n  }",
    ),
    ("AFFINE_GATE_UP", "xsum[g] = t;\n  }\n  BARRIER();", "xsum[g] = t;\n  }"),
    ("AFFINE_GATE_UP", "constexpr int IT = (G + 31) / 32;", "constexpr int IT = G / 32;"),
    (
        "AFFINE_GATE_UP",
        "gate[r] += s1_[r][it] * d + b1_[r][it] * xg;",
        "gate[r] += s1_[r][it] * d;",
    ),
    (
        "AFFINE_GATE_UP",
        "const float4 a = xs[j * GP + g];\n            d += float(KK_CODE(q1",
        "const float4 a = xs[j * G + g];\n            d += float(KK_CODE(q1",
    ),
    ("AFFINE_DOWN", "constexpr int IT = (G + 31) / 32;", "constexpr int IT = G / 32;"),
    (
        "AFFINE_DOWN",
        "static_cast<float>(s2[row * G + gg])",
        "static_cast<float>(s2[row * G + gg + 1])",
    ),
    ("AFFINE_DOWN", "row0 += NSG * R)", "row0 += NSG * R + 1)"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, old, new",
    DECODE_MUTATIONS,
    ids=[
        "gate-up-missing-barrier",
        "gate-up-missing-sum-barrier",
        "gate-up-partial-pass-dropped",
        "gate-up-bias-dropped",
        "gate-up-unpadded-read",
        "down-partial-pass-dropped",
        "down-scale-off-by-one",
        "down-row-set-stride",
    ],
)
def test_a_broken_decode_kernel_fails(monkeypatch, name, old, new):
    """Each mutation fails on a 3-bit case whose rows have a partial last lane pass in both
    projections (D = 2560: 40 groups; I = 2304: 36) and span several tiles."""
    monkeypatch.setattr(decode_kernels, name, broken(getattr(decode_kernels, name), old, new))
    args, want = case(4, 2560, 2304, 2, 2, "float32", 3)
    assert_broken(lambda: expert_glu_decode(*args, backend="emulator"), want)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [2, 3])
def test_a_code_read_from_the_wrong_place_fails(monkeypatch, bits):
    """At 3 bits some codes straddle two words (the spill term); at 2 bits none does, and a
    shift of one code's worth is caught instead."""
    kernel = decode_kernels.AFFINE_DOWN
    if bits == 3:
        bad = header_broken(
            kernel, "(32 - KK_BIT(c) % 32) : 0u)", "(32 - KK_BIT(c) % 32) : 0u) * 0u"
        )
    else:
        bad = header_broken(
            kernel, "#define KK_BIT(c) (BITS * (c))", "#define KK_BIT(c) (BITS * (c) + BITS)"
        )
    monkeypatch.setattr(decode_kernels, "AFFINE_DOWN", bad)
    args, want = case(4, 256, 256, 2, 2, "float32", bits)
    assert_broken(lambda: expert_glu_decode(*args, backend="emulator"), want)


def test_the_unbroken_decode_kernels_pass_the_mutation_case():
    args, want = case(4, 2560, 2304, 2, 2, "float32", 3)
    assert rel_err(expert_glu_decode(*args, backend="emulator"), want) < TOL


PREFILL_MUTATIONS = [
    ("u[r][(lo + 1) % BITS] << (32 - sh)", "u[r][lo % BITS] << (32 - sh)"),
    ("* sc[0] + bi[0];", "* sc[0];"),
    ("const int grp = (32 * g) / GS;", "const int grp = g;"),
    ("v[r] >>= BITS * JS * jpart;", "v[r] >>= JS * jpart;"),
    ("if (eighth > 0) BARRIER();", ""),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "old, new",
    PREFILL_MUTATIONS,
    ids=["straddling-word", "bias-dropped", "group-index", "code-share-shift", "missing-barrier"],
)
def test_a_broken_prefill_kernel_fails(monkeypatch, old, new):
    kernel = prefill_kernels.AFFINE_GROUPED
    monkeypatch.setattr(prefill_kernels, "AFFINE_GROUPED", broken(kernel, old, new))
    args, want = case(5, 192, 256, 40, 3, "float32", 3)
    assert_broken(lambda: expert_glu_prefill(*args, tile_tokens=16, backend="emulator"), want)


def test_the_unbroken_prefill_kernel_passes_the_mutation_case():
    args, want = case(5, 192, 256, 40, 3, "float32", 3)
    assert rel_err(expert_glu_prefill(*args, tile_tokens=16, backend="emulator"), want) < TOL


def test_expert_glu_on_affine_stacks_through_the_dispatcher(monkeypatch):
    """``experts.expert_glu`` on affine stacks: the kernel where the backend has one, the
    reference without, both at the oracle."""
    dispatch_defaults(monkeypatch)
    args, want = case(6, 128, 128, 3, 2, "float32", 2)
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    assert rel_err(expert_glu(*args), want) < TOL
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "none")
    assert rel_err(expert_glu(*args), want) < 1e-5
