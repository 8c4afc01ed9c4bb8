"""MXFP4 expert kernels (decode and grouped prefill) on the Metal emulator and on MLX's CUDA
backend (the ``backend`` fixture; cases marked ``cuda``, at K3's sizes with more experts and
tokens, on CUDA alone).

The oracle dequantizes with ``numpy_ref.mxfp4_decode`` (written from the OCP spec, not from
the kernels) and does the matmuls and SiTU-GLU in float64; MLX's ``expert_glu_reference``
(``gather_qmm``) is checked against the same oracle. The K3-size cases share one 16-expert
stack, so the oracle (on the host CPU) dequantizes each expert once.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest
from conftest import broken, dispatch_defaults, header_broken, on_cuda, rel_err
from numpy_ref import mxfp4_decode, routed_experts

from kimi_k3.kernels import (
    checks,
    dispatch,
    expert_bodies,
    expert_layout,
    mxfp4_mma,
    mxfp4_one,
    mxfp4_prefill_mma,
)
from kimi_k3.kernels import mxfp4_decode as decode_kernels
from kimi_k3.kernels.metal_emulator import check_cuda_grid
from kimi_k3.kernels.mxfp4_decode import expert_glu_decode
from kimi_k3.kernels.mxfp4_prefill import expert_glu_prefill, group_by_expert, tile_tokens_for
from kimi_k3.kernels.mxfp4_prefill_mma import expert_glu_prefill_mma
from kimi_k3.model.experts import expert_glu, expert_glu_reference

BETA, CAP = 4.0, 25.0
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
TOL = 2e-6  # kernel vs float64 oracle, RMS-relative; fp32 accumulation over <= 3584 terms
K3 = (3584, 3072)  # K3's expert dims (D, I)


def lazy_stack(E: int, D: int, I: int) -> dict:
    """MXFP4 stacks of these shapes, never evaluated (only their shapes are read)."""

    def q(rows, cols):
        return mx.zeros((E, rows, cols // 8), mx.uint32), mx.zeros((E, rows, cols // 32), mx.uint8)

    return {"w1": q(I, D), "w3": q(I, D), "w2": q(D, I)}


@functools.lru_cache(maxsize=2)
def random_experts(E: int, D: int, I: int, seed: int) -> dict:
    """``checks.random_experts`` (every code equally likely; scales near unit variance for
    unit inputs, spread over 5 octaves so some rows saturate SiTU's tanh and a few reach the
    up branch's cap) as numpy stacks, kept for the next test."""
    w = checks.random_experts(E, D, I, seed)
    return {n: (np.array(q), np.array(sc)) for n, (q, sc) in w.items()}


def routing(N: int, E: int, k: int, seed: int):
    """``checks.routing``: ``k`` distinct experts per token and positive weights summing to
    1, as numpy."""
    inds, wts = checks.routing(N, E, k, seed + 1)
    return np.array(inds), np.array(wts)


@functools.lru_cache(maxsize=24)
def dequantized(E: int, D: int, I: int, seed: int, e: int) -> tuple:
    """Expert ``e`` of ``random_experts(E, D, I, seed)`` as float32 (w1, w2, w3): exact, since
    an E2M1 value times a power of two needs 3 significant bits."""
    w = random_experts(E, D, I, seed)
    return tuple(
        mxfp4_decode(w[n][0][e].view(np.uint8), w[n][1][e]).astype(np.float32)
        for n in ("w1", "w2", "w3")
    )


def oracle(z: np.ndarray, stack: tuple, inds: np.ndarray, wts: np.ndarray) -> np.ndarray:
    """Dequantize, then ``numpy_ref.routed_experts`` in float64. ``stack`` is the
    ``(E, D, I, seed)`` of ``random_experts``."""
    return routed_experts(z, inds, wts, lambda e: dequantized(*stack, e), BETA, CAP)


def case(E, D, I, N, k, dtype, seed=0):
    """MLX inputs for one case, and the oracle's output on exactly those (rounded) inputs."""
    return inputs(random_experts(E, D, I, seed), N, k, dtype, seed, (E, D, I, seed), oracle)


def inputs(w: dict, N: int, k: int, dtype: str, seed: int, stack: tuple, oracle) -> tuple:
    """A case of any expert format: latents and ``routing`` drawn from ``seed`` for the numpy
    stacks ``w`` (a tuple of arrays per matrix), as MLX inputs, and ``oracle(z, stack, inds,
    wts)`` on exactly those (rounded) inputs."""
    E, D = w["w2"][0].shape[:2]
    inds, wts = routing(N, E, k, seed)
    z = mx.array(np.random.default_rng(seed + 2).standard_normal((N, D)), dtype=DTYPES[dtype])
    want = oracle(np.array(z.astype(mx.float32)), stack, inds, wts)
    wm = {n: tuple(mx.array(a) for a in t) for n, t in w.items()}
    return (z, wm, mx.array(inds), mx.array(wts), BETA, CAP), want


def assert_broken(run, want, factor: float = 10) -> None:
    """A mutated kernel fails: the emulator refuses the launch (an out-of-bounds access:
    RuntimeError), or ``run()`` misses the oracle by ``factor`` x TOL or more (NaN, where a
    kernel left output unwritten or read garbage, counts as a miss)."""
    try:
        got = run()
    except RuntimeError:
        return
    err = rel_err(got, want)
    assert not err < factor * TOL, err


# (experts, D, I, tokens, top-k, dtype): one expert; rows of fewer scale groups than lanes
# (D = 32, 64, 320); a last lane pass that is partial in the down projection (I = 1280: 40
# groups) and in gate/up (K3's D = 3584: 112 groups); rows split over several tiles; top-16;
# K3's dims (8 experts, shared with the prefill case so the oracle dequantizes each once).
DECODE_CASES = [
    (1, 32, 32, 1, 1, "float32"),
    (5, 64, 96, 3, 2, "float32"),
    (7, 320, 224, 17, 4, "bfloat16"),
    (3, 64, 1280, 2, 2, "float32"),
    (20, 64, 96, 1, 16, "float16"),
    (9, 96, 64, 64, 3, "bfloat16"),
    (8, 3584, 3072, 1, 8, "bfloat16"),
    (896, 32, 64, 4, 16, "bfloat16"),  # a K3 layer's expert count
]

# (experts, D, I, tokens, top-k, dtype, pairs per tile): I = 288 and D = 320 leave the last
# block of output rows partial; 257 tokens over 6 experts cut each expert's run into 9+ tiles.
PREFILL_CASES = [
    (1, 32, 32, 1, 1, "float32", 16),
    (5, 64, 96, 3, 2, "float32", 16),
    (7, 320, 288, 17, 4, "bfloat16", 32),
    (20, 64, 96, 64, 16, "float16", 64),
    (6, 96, 64, 257, 3, "float32", 16),
    (64, 64, 64, 257, 8, "bfloat16", None),
    (8, 3584, 3072, 3, 2, "bfloat16", 16),
    # K3's prefill structure at small width: 512 tokens, top-16 of 896 experts (1352 tiles,
    # most experts with 9 pairs, some tiles empty)
    (896, 32, 32, 512, 16, "bfloat16", None),
]


@pytest.mark.slow
@pytest.mark.parametrize("E,D,I,N,k,dtype", DECODE_CASES + [on_cuda(16, *K3, 4, 16, "bfloat16")])
def test_decode_matches_oracle(backend, E, D, I, N, k, dtype):
    args, want = case(E, D, I, N, k, dtype)
    got = expert_glu_decode(*args, backend=backend)
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, old, new",
    [
        (
            "MXFP4_GATE_UP",
            "zs[(i % 8) * GP + i / 8] = a;\n  }\n  BARRIER();",
            "zs[(i % 8) * GP + i / 8] = a;\n  }",
        ),
        ("MXFP4_GATE_UP", "constexpr int IT = (G + 31) / 32;", "constexpr int IT = G / 32;"),
        (
            "MXFP4_GATE_UP",
            "const float4 b = zs[(2 * j + 1) * GP + g];",
            "const float4 b = zs[(2 * j + 1) * G + g];",
        ),
        ("MXFP4_DOWN", "constexpr int IT = (G + 31) / 32;", "constexpr int IT = G / 32;"),
        (
            "MXFP4_DOWN",
            "sc[r][it] = in ? uint(s2[row * G + gg]) : 0u;",
            "sc[r][it] = in ? uint(s2[row * G + gg + 1]) : 0u;",
        ),
        ("MXFP4_DOWN", "row0 += NSG * R)", "row0 += NSG * R + 1)"),
        ("MXFP4_SUM", "j < K; ++j", "j < K - 1; ++j"),
    ],
    ids=[
        "gate-up-missing-barrier",
        "gate-up-partial-pass-dropped",
        "gate-up-unpadded-read",
        "down-partial-pass-dropped",
        "down-scale-off-by-one",
        "down-row-set-stride",
        "sum-drops-a-pair",
    ],
)
def test_a_broken_decode_kernel_fails(monkeypatch, name, old, new):
    """Each mutation of a decode kernel makes the oracle comparison fail on one case whose
    rows have a partial last lane pass in both projections and span several tiles."""
    kernel = getattr(decode_kernels, name)
    monkeypatch.setattr(decode_kernels, name, broken(kernel, old, new))
    args, want = case(4, 1280, 1152, 2, 2, "float32")
    assert_broken(lambda: expert_glu_decode(*args, backend="emulator"), want, 100)


def test_the_unbroken_decode_kernels_pass_the_mutation_case():
    args, want = case(4, 1280, 1152, 2, 2, "float32")
    assert rel_err(expert_glu_decode(*args, backend="emulator"), want) < TOL


# The tensor-core decode kernels (mxfp4_mma; D and I multiples of 128). Their Metal rendering
# spells each MMA out with shuffles, so the emulator runs them slowly: small dims, plus one
# pair at K3's. (4, 1280, 1152) splits rows of 40 and 36 groups unevenly over two warps.
MMA_CASES = [
    (3, 128, 128, 2, 2, "float32"),
    (5, 256, 384, 3, 2, "bfloat16"),
    (4, 1280, 1152, 2, 2, "float32"),
    (20, 128, 256, 1, 16, "float16"),
    (896, 128, 128, 2, 16, "bfloat16"),
    (2, 3584, 3072, 1, 1, "bfloat16"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "E,D,I,N,k,dtype",
    MMA_CASES + [on_cuda(16, *K3, 4, 16, "bfloat16"), on_cuda(16, *K3, 8, 16, "float32")],
)
def test_mma_decode_matches_oracle(backend, E, D, I, N, k, dtype):
    """The tensor-core decode kernels: fp16 MMAs with fp32 accumulators, activations split
    into fp16 hi + lo, against the float64 oracle at the fp32 kernels' tolerance."""
    args, want = case(E, D, I, N, k, dtype)
    got = mxfp4_mma.expert_glu_decode(*args, backend=backend)
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch", [(4, 2, 4, True), (8, 1, 8, True), (8, 1, 4, False), (2, 4, 8, False)]
)
def test_mma_decode_launch_shapes(monkeypatch, launch):
    """Every launch shape the benchmark sweeps computes the same thing (warps per row tile
    and per row, groups per step, double-buffered loads or not)."""
    monkeypatch.setitem(mxfp4_mma.LAUNCH, "gate_up", launch)
    monkeypatch.setitem(mxfp4_mma.LAUNCH, "down", launch)
    args, want = case(5, 256, 512, 3, 2, "bfloat16")
    assert rel_err(mxfp4_mma.expert_glu_decode(*args, backend="emulator"), want) < TOL


@pytest.mark.slow
@pytest.mark.parametrize(
    "E,D,I,N,k,dtype",
    [
        MMA_CASES[1],
        MMA_CASES[2],
        on_cuda(16, *K3, 1, 16, "bfloat16"),
        on_cuda(16, *K3, 4, 16, "bfloat16"),
    ],
)
def test_mma_decode_on_the_tiled_layout_gives_the_same_bits(backend, E, D, I, N, k, dtype):
    """``mxfp4_mma.tiled_layout`` (the dispatched kernels on ``expert_layout``'s tiles, what
    a tiled store runs) only moves the loads' addresses."""
    (z, w, *rest), want = case(E, D, I, N, k, dtype)
    plain = mxfp4_mma.expert_glu_decode(z, w, *rest, backend=backend)
    got = mxfp4_mma.expert_glu_decode_tiled(z, expert_layout.tile(w), *rest, backend=backend)
    assert np.array_equal(np.array(got), np.array(plain))
    assert rel_err(got, want) < TOL


def test_mma_decode_handles_large_and_tiny_activations(backend):
    """The power-of-two scaling keeps fp16 fragments in range: latents far above fp16's
    largest value and far below its smallest give the oracle's result, scaled."""
    (z, w, inds, wts, beta, cap), _ = case(3, 128, 128, 2, 2, "float32")
    for s in (2.0**40, 2.0**-40):
        zs = z * s
        want = oracle(np.array(zs), (3, 128, 128, 0), np.array(inds), np.array(wts))
        got = mxfp4_mma.expert_glu_decode(zs, w, inds, wts, beta, cap, backend=backend)
        assert rel_err(got, want) < TOL, s


@pytest.mark.slow
@pytest.mark.parametrize(
    "old, new",
    [
        ("PACK_HALF2(v[3], v[7]));\n  }\n  BARRIER();", "PACK_HALF2(v[3], v[7]));\n  }"),
        ("v[e] -= ROUND_HALF(v[e]);", "v[e] = 0.0f;"),
        ("pq * 8 + g]", "pq * 8 + (g & 6u)]"),
        ("sc[4 * u + 1] = ea[8 * G + (bb) + 4 * u];", "sc[4 * u + 1] = ea[8 * G + 4 * u];"),
        ("kk_e2m1_pair(xa0, 3)", "kk_e2m1_pair(xa0, 2)"),
        ("for (int s = 0; s < SK; ++s) total", "for (int s = 1; s < SK; ++s) total"),
        ("const size_t rb = GLU ? ra : ra + 16;", "const size_t rb = GLU ? ra : ra + 8;"),
        ("const bool bcol = g / 2 == tq;", "const bool bcol = true;"),
        ("acc1 += SIMD_SHUFFLE_XOR(acc1, 2);", ""),
        ("s_par[0] = params[GLU ? 0 : p];", "s_par[0] = params[0];"),
        ("s_par[1] = GLU ? params[1] : 0.0f;", "s_par[1] = GLU ? params[0] : 0.0f;"),
    ],
    ids=[
        "missing-barrier",
        "lo-part-dropped",
        "lo-columns-read-hi",
        "stale-scale",
        "pair-mixed-up",
        "split-dropped",
        "down-second-tile-offset",
        "b-outside-its-group",
        "lane-sum-dropped",
        "first-pair-weight-for-all",
        "cap-is-beta",
    ],
)
def test_a_broken_mma_kernel_fails(monkeypatch, old, new):
    monkeypatch.setattr(mxfp4_mma, "MXFP4_MMA", broken(mxfp4_mma.MXFP4_MMA, old, new))
    args, want = case(4, 1280, 1152, 2, 2, "float32")
    assert_broken(lambda: mxfp4_mma.expert_glu_decode(*args, backend="emulator"), want)


@pytest.mark.slow
@pytest.mark.parametrize(
    "old, new",
    [
        ("(j & 2) ? 0x3414u : 0x2404u", "(j & 2) ? 0x3404u : 0x2404u"),
        ("((w >> 3) & 0x0E0E0E0Eu)", "((w >> 3) & 0x0C0E0E0Eu)"),
    ],
    ids=["prmt-selector", "prmt-odd-mask"],
)
def test_a_broken_byte_permute_decode_fails(monkeypatch, old, new):
    """The dispatched decode (``DECODE``: byte permutes, ``kk_e2m1_pair_prmt`` in the header)
    is what the emulator tests run: a wrong selector or mask is caught."""
    monkeypatch.setattr(mxfp4_mma, "MXFP4_MMA", header_broken(mxfp4_mma.MXFP4_MMA, old, new))
    args, want = case(4, 1280, 1152, 2, 2, "float32")
    assert_broken(lambda: mxfp4_mma.expert_glu_decode(*args, backend="emulator"), want)


@pytest.mark.slow
def test_byte_permute_decode_is_the_same(monkeypatch):
    """``kk_e2m1_pair_prmt`` (BYTE_PERM, what ``mxfp4_mma.DECODE`` picks) decodes every code
    as the shifts do: the decode gives the same result to the last bit, per projection."""
    args, want = case(4, 1280, 1152, 2, 2, "float32")
    assert mxfp4_mma.DECODE == {"gate_up": "byte permute", "down": "byte permute"}
    prmt = mxfp4_mma.expert_glu_decode(*args, backend="emulator")
    assert rel_err(prmt, want) < TOL
    for proj in ("gate_up", "down"):
        monkeypatch.setitem(mxfp4_mma.DECODE, proj, "shift")
        got = mxfp4_mma.expert_glu_decode(*args, backend="emulator")
        assert mx.array_equal(got, prmt).item(), proj
    monkeypatch.setitem(mxfp4_mma.DECODE, "down", "bytes")
    with pytest.raises(ValueError, match=r"DECODE\['down'\] = 'bytes'"):
        mxfp4_mma.expert_glu_decode(*args, backend="emulator")


# The grouped GEMM on tensor cores (mxfp4_prefill_mma): small widths only on the emulator
# (one pair at K3's took 263 s here; CUDA runs K3's sizes). (7, 320, 288) has rows of
# 10 and 9 groups, so the chunks of KC groups end part-way.
PREFILL_MMA_CASES = [
    (1, 32, 32, 1, 1, "float32", 16),
    (5, 64, 96, 3, 2, "float32", 16),
    (7, 320, 288, 17, 4, "bfloat16", 32),
    (20, 64, 96, 64, 16, "float16", 32),
    (6, 96, 64, 257, 3, "float32", 16),
    (896, 32, 32, 512, 16, "bfloat16", None),
]


@pytest.mark.parametrize(
    "fn, shape, rows",
    [
        ("lut", (6, 128, 128, 40, 3, "float32"), (5, 9)),
        ("mma", (6, 128, 128, 40, 3, "float32"), (5, 9)),
        on_cuda("mma", (16, *K3, 257, 4, "bfloat16"), (40, 90)),
    ],
)
def test_prefill_pairs_do_not_depend_on_the_call(backend, fn, shape, rows):
    """A pair's output from the grouped kernels is the same bits whatever the tile size and
    whichever other pairs share the call: what ``Streamer._grouped`` relies on when it runs
    a chunk's pairs in groups (each group a call of its own, of another size)."""
    f = expert_glu_prefill if fn == "lut" else expert_glu_prefill_mma
    (z, w, inds, wts, beta, cap), _ = case(*shape)
    whole = np.array(f(z, w, inds, wts, beta, cap, tile_tokens=16, backend=backend))
    wide = f(z, w, inds, wts, beta, cap, tile_tokens=32, backend=backend)
    assert np.array_equal(np.array(wide), whole)
    lo, hi = rows
    part = f(z[lo:hi], w, inds[lo:hi], wts[lo:hi], beta, cap, tile_tokens=16, backend=backend)
    assert np.array_equal(np.array(part), whole[lo:hi])


@pytest.mark.slow
@pytest.mark.parametrize(
    "E,D,I,N,k,dtype,tm",
    PREFILL_MMA_CASES + [on_cuda(16, *K3, 257, 4, "bfloat16", tm) for tm in (16, 32)],
)
def test_prefill_mma_matches_oracle(backend, E, D, I, N, k, dtype, tm):
    """The tensor-core grouped GEMM (mxfp4_prefill_mma), K3's sizes on CUDA."""
    args, want = case(E, D, I, N, k, dtype)
    got = expert_glu_prefill_mma(*args, tile_tokens=tm, backend=backend)
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, tm, launch",
    [
        ((7, 320, 288, 17, 4), tm, launch)
        for tm, launch in [(16, (1, 1)), (16, (2, 3)), (32, (3, 4)), (32, (8, 6))]
    ]
    + [
        on_cuda((16, *K3, 257, 4), tm, launch)
        for tm, launch in [(16, (8, 8)), (32, (8, 4)), (32, (2, 6))]
    ],
)
def test_prefill_mma_launch_shapes(backend, shape, tm, launch):
    """Warps per threadgroup (some idle past the last row unit) and groups per chunk."""
    args, want = case(*shape, "bfloat16")
    got = expert_glu_prefill_mma(*args, tile_tokens=tm, backend=backend, launch=launch)
    assert rel_err(got, want) < TOL


def test_prefill_mma_scales_each_row_alone():
    """Tokens 2^80 apart in one tile: each row's power-of-two scaling keeps both exact."""
    (z, w, inds, wts, beta, cap), _ = case(3, 64, 96, 4, 2, "float32")
    zs = z * mx.array([2.0**40, 2.0**-40, 1.0, 2.0**20])[:, None]
    want = oracle(np.array(zs), (3, 64, 96, 0), np.array(inds), np.array(wts))
    got = mxfp4_prefill_mma.expert_glu_prefill_mma(
        zs, w, inds, wts, beta, cap, tile_tokens=16, backend="emulator"
    )
    assert rel_err(got[1], want[1]) < TOL and rel_err(got, want) < TOL


def test_prefill_mma_refuses_other_tile_sizes():
    args, _ = case(3, 64, 96, 4, 2, "float32")
    with pytest.raises(ValueError, match="tile_tokens=64"):
        mxfp4_prefill_mma.expert_glu_prefill_mma(*args, tile_tokens=64, backend="emulator")


@pytest.mark.slow
@pytest.mark.parametrize(
    "old, new",
    [
        ("    BARRIER();\n    if (active) {", "    if (active) {"),
        ("if (g0 > 0) BARRIER();", ""),
        ("for (int e = 0; e < 4; ++e) v[e] -= ROUND_HALF(v[e]);", ""),
        ("const uint wsel = tq / 2;", "const uint wsel = tq % 2;"),
        ("acc_a[nt].z += sa8 * ca.z;", "acc_a[nt].z += sa0 * ca.z;"),
        (
            "const int tok = 4 * int(nt) + int(l / 8);",
            "const int tok = 4 * int(nt) + int(l / 4) % 4;",
        ),
        (
            "const size_t rb = NMAT == 2 ? ra : ra + 16;",
            "const size_t rb = NMAT == 2 ? ra : ra + 8;",
        ),
        ("const float un = s_un[tok];", "const float un = s_un[0];"),
        ("v[2] = static_cast<float>(src[1]) * up;", "v[2] = static_cast<float>(src[2]) * up;"),
    ],
    ids=[
        "no-barrier-after-staging",
        "no-barrier-before-restaging",
        "lo-dropped",
        "wrong-word",
        "row-g-scale-for-g8",
        "wrong-token-column",
        "down-second-tile-offset",
        "one-unscale-for-all",
        "k-order-differs-from-a",
    ],
)
def test_a_broken_prefill_mma_kernel_fails(monkeypatch, old, new):
    for name in ("MXFP4_GROUPED_MMA", "MXFP4_BFRAG"):
        kernel = getattr(mxfp4_prefill_mma, name)
        if old in kernel.body:
            monkeypatch.setattr(mxfp4_prefill_mma, name, broken(kernel, old, new))
            break
    else:
        raise AssertionError(f"{old!r} is in neither kernel")
    (z, w, inds, wts, beta, cap), want = case(7, 320, 288, 17, 4, "bfloat16")
    z = z * mx.array([2.0 ** (i % 5 - 2) for i in range(17)])[:, None].astype(z.dtype)
    want = oracle(np.array(z.astype(mx.float32)), (7, 320, 288, 0), np.array(inds), np.array(wts))
    run = functools.partial(
        mxfp4_prefill_mma.expert_glu_prefill_mma,
        *(z, w, inds, wts, beta, cap),
        tile_tokens=32,
        backend="emulator",
    )
    assert_broken(run, want)


@pytest.mark.slow
@pytest.mark.parametrize(
    "E,D,I,N,k,dtype,tm",
    PREFILL_CASES + [on_cuda(16, *K3, 257, 4, "bfloat16", tm) for tm in (16, 32, 64)],
)
def test_prefill_matches_oracle(backend, E, D, I, N, k, dtype, tm):
    args, want = case(E, D, I, N, k, dtype)
    got = expert_glu_prefill(*args, tile_tokens=tm, backend=backend)
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize(
    "E,D,I,N,k,dtype",
    [(5, 64, 96, 3, 2, "float32"), (6, 96, 64, 257, 3, "float32"), (8, 128, 96, 8, 4, "bfloat16")],
)
def test_oracle_matches_mlx_reference(E, D, I, N, k, dtype):
    """The oracle and MLX's quantized ops agree, so both judge the kernels alike; on the
    CPU a bf16 latent is multiplied in fp32 too (MLX's bf16 CPU path, which rounds every
    partial sum to bf16, was 1.2e-2 away)."""
    args, want = case(E, D, I, N, k, dtype)
    assert rel_err(expert_glu_reference(*args), want) < TOL


def slot_pool(w: dict, slots: np.ndarray, size: int) -> dict:
    """The stacks ``w`` as the streamer holds them: expert e at slot ``slots[e]`` of a pool of
    ``size`` slots, seen through a view one slot into a larger array (an offset view)."""
    pool = {}
    for n, arrs in w.items():
        pool[n] = []
        for a in arrs:
            big = mx.zeros((size + 2, *a.shape[1:]), dtype=a.dtype)
            big[mx.array(slots + 1)] = a
            pool[n].append(big[1 : size + 1])
    return pool


def test_reads_cache_slots_as_given(backend):
    """The streamer's layout: experts at scattered slots of a larger pool, seen through a view
    with an offset, ``inds`` remapped to slots. Same bits as the stacked experts, for the LUT
    kernels and (at dims they take) the tensor-core decodes, three launches and one."""
    lut = {"decode": expert_glu_decode, "prefill": expert_glu_prefill}
    mma = {"mxfp4_mma": mxfp4_mma.expert_glu_decode, "mxfp4_one": mxfp4_one.expert_glu_decode}
    for (D, I, N, dtype), fns in (((64, 96, 17, "float32"), lut), ((128, 256, 2, "bfloat16"), mma)):
        (z, w, inds, wts, beta, cap), _ = case(6, D, I, N, 2, dtype)
        slots = np.random.default_rng(3).permutation(10)[:6]  # expert e lives in slot slots[e]
        pool = slot_pool(w, slots, 10)
        slot_inds = mx.array(slots)[inds]
        for name, fn in fns.items():
            want = fn(z, w, inds, wts, beta, cap, backend=backend)
            got = fn(z, pool, slot_inds, wts, beta, cap, backend=backend)
            assert np.array_equal(np.array(got), np.array(want)), name


def test_a_format_fills_every_mark_of_a_shared_body_once():
    """``expert_bodies.fill`` refuses a piece left out or one the body has no mark for, so a
    format's kernel is never built from a body with a hole or without a piece it gave."""
    pieces = {"STAGE": "", "LOADS": "", "DOTS": ""}
    assert "//@" not in expert_bodies.fill(expert_bodies.GATE_UP, "gate/up", **pieces)
    with pytest.raises(AssertionError, match="gate/up: unfilled //@DOTS"):
        expert_bodies.fill(expert_bodies.GATE_UP, "gate/up", STAGE="", LOADS="")
    with pytest.raises(AssertionError, match="down: the kernel changed near '//@CODES"):
        expert_bodies.fill(expert_bodies.DOWN, "down", **pieces, CODES="")


def _tiles_numpy(flat: np.ndarray, tm: int) -> list[tuple[int, int, int]]:
    order = np.argsort(flat, kind="stable")
    ids = flat[order]
    out = []
    for e in np.unique(ids):
        lo, hi = np.searchsorted(ids, e), np.searchsorted(ids, e, side="right")
        out += [(s, min(tm, hi - s), int(e)) for s in range(lo, hi, tm)]
    return out


@pytest.mark.parametrize(
    "P,E,tm", [(1, 1, 16), (7, 3, 16), (100, 5, 16), (257, 64, 32), (300, 4, 64)]
)
def test_group_by_expert_tiles(P, E, tm):
    flat = np.random.default_rng(P).integers(0, E, P).astype(np.int32)
    order, tiles = group_by_expert(mx.array(flat), E, tm)
    order, tiles = np.array(order), np.array(tiles)
    assert np.array_equal(np.sort(order), np.arange(P))
    assert np.all(np.diff(flat[order]) >= 0)  # sorted by expert
    want = _tiles_numpy(flat, tm)
    assert len(tiles) == min(P, (P + min(E, P) * (tm - 1)) // tm) >= len(want)
    assert [tuple(t) for t in tiles[: len(want)]] == want
    assert not tiles[len(want) :].any()  # unused tiles are empty


def test_tile_tokens_for():
    assert tile_tokens_for(16, 64) == 16  # decode-like: one pair per expert
    assert tile_tokens_for(512 * 16, 896) == 16  # 9 pairs per expert
    assert tile_tokens_for(2048 * 16, 896) == 32  # 37 pairs per expert
    assert tile_tokens_for(4096 * 16, 64) == 32


def test_dispatcher(monkeypatch):
    (z, w, inds, wts, beta, cap), want = case(5, 64, 96, 3, 2, "float32")
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    monkeypatch.delenv("KIMI_K3_REFERENCE", raising=False)
    monkeypatch.delenv("KIMI_K3_EXPERT_PREFILL", raising=False)
    assert dispatch.expert_glu_kernel(z, w, inds).func is expert_glu_decode
    many = mx.zeros((dispatch.EXPERT_DECODE_MAX_PAIRS // 2 + 1, 2), dtype=mx.int32)
    assert (
        dispatch.expert_glu_kernel(mx.zeros((many.shape[0], 64)), w, many).func
        is expert_glu_prefill
    )
    assert rel_err(expert_glu(z, w, inds, wts, beta, cap), want) < TOL
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "cuda")  # chosen, not run: no CUDA here
    fn = dispatch.expert_glu_kernel(z, w, inds)  # D 64, I 96: not for mxfp4_mma (128s)
    assert fn.func is expert_glu_decode and fn.keywords["backend"] == "cuda"
    fn = dispatch.expert_glu_kernel(mx.zeros((many.shape[0], 64)), w, many)
    assert fn.func is mxfp4_prefill_mma.expert_glu_prefill_mma and fn.keywords["backend"] == "cuda"
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    assert dispatch.expert_glu_kernel(z.astype(mx.int32), w, inds) is None
    assert dispatch.expert_glu_kernel(z[:, :32], w, inds) is None  # w1 does not fit D = 32
    for value in ("1", "experts"):
        monkeypatch.setenv("KIMI_K3_REFERENCE", value)
        assert dispatch.expert_glu_kernel(z, w, inds) is None
    monkeypatch.setenv("KIMI_K3_REFERENCE", "kda")
    assert dispatch.expert_glu_kernel(z, w, inds) is not None
    monkeypatch.setenv("KIMI_K3_REFERENCE", "expert")  # misspelt: an error, not ignored
    with pytest.raises(ValueError, match="KIMI_K3_REFERENCE='expert'"):
        dispatch.expert_glu_kernel(z, w, inds)
    monkeypatch.setenv("KIMI_K3_REFERENCE", "0")
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "none")
    assert dispatch.expert_glu_kernel(z, w, inds) is None


def test_cuda_decode_launches_by_pairs(monkeypatch):
    """On CUDA (chosen, not run) a decode of up to EXPERT_ONE_LAUNCH_MAX_PAIRS pairs is
    mxfp4_one's one launch, a larger one mxfp4_mma's three, where mxfp4_mma applies; the
    env var forces either; settings the one grid cannot share give three launches."""
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "cuda")
    monkeypatch.delenv("KIMI_K3_REFERENCE", raising=False)
    monkeypatch.delenv("KIMI_K3_EXPERT_DECODE", raising=False)
    w = lazy_stack(8, 128, 256)
    most = dispatch.EXPERT_ONE_LAUNCH_MAX_PAIRS

    def chosen(pairs, k=2):
        inds = mx.zeros((pairs // k, k), mx.int32)
        fn = dispatch.expert_glu_kernel(mx.zeros((pairs // k, 128), mx.bfloat16), w, inds)
        assert fn.keywords["backend"] == "cuda"
        return fn.func

    assert chosen(2) is chosen(most) is mxfp4_one.expert_glu_decode
    assert (
        chosen(most + 2)
        is chosen(dispatch.EXPERT_DECODE_MAX_PAIRS)
        is (mxfp4_mma.expert_glu_decode)
    )
    monkeypatch.setenv("KIMI_K3_EXPERT_DECODE", "three")
    assert chosen(2) is mxfp4_mma.expert_glu_decode
    monkeypatch.setenv("KIMI_K3_EXPERT_DECODE", "one")
    assert chosen(most + 2) is mxfp4_one.expert_glu_decode
    monkeypatch.setenv("KIMI_K3_EXPERT_DECODE", "1")  # not a choice: an error naming it
    with pytest.raises(ValueError, match="KIMI_K3_EXPERT_DECODE='1'"):
        chosen(2)
    monkeypatch.delenv("KIMI_K3_EXPERT_DECODE")
    monkeypatch.setitem(mxfp4_mma.MIN_BLOCKS, "down", mxfp4_mma.MIN_BLOCKS["gate_up"] + 1)
    assert not mxfp4_one.agrees("cuda", 128, 256)
    assert chosen(2) is mxfp4_mma.expert_glu_decode


def test_prefill_dispatch_rules(monkeypatch):
    """Prefill: the kernel on every backend (MLX's CUDA gather_qmm was measured wrong at K3
    scale, see dispatch.expert_prefill_choice); the env var forces either."""
    monkeypatch.delenv("KIMI_K3_EXPERT_PREFILL", raising=False)
    assert dispatch.expert_prefill_choice() == "kernel"
    monkeypatch.setenv("KIMI_K3_EXPERT_PREFILL", "kernel")
    assert dispatch.expert_prefill_choice() == "kernel"
    monkeypatch.setenv("KIMI_K3_EXPERT_PREFILL", "kernal")
    with pytest.raises(ValueError, match="KIMI_K3_EXPERT_PREFILL='kernal'"):
        dispatch.expert_prefill_choice()
    monkeypatch.setenv("KIMI_K3_EXPERT_PREFILL", "reference")
    assert dispatch.expert_prefill_choice() == "reference"
    (z, w, inds, wts, beta, cap), want = case(20, 64, 96, 40, 16, "float32")
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    assert dispatch.expert_glu_kernel(z, w, inds) is None  # forced reference
    assert rel_err(expert_glu(z, w, inds, wts, beta, cap), want) < TOL


def test_cuda_grid_limit_is_enforced():
    """The emulator refuses launches CUDA cannot make: more than 65535 blocks in y or z."""
    check_cuda_grid((256, 65535, 1), (256, 1, 1))
    check_cuda_grid((256 * 70000, 1, 1), (256, 1, 1))  # x allows 2^31 - 1 blocks
    with pytest.raises(RuntimeError, match="along y"):
        check_cuda_grid((256, 65536, 1), (256, 1, 1))
    with pytest.raises(RuntimeError, match="along z"):
        check_cuda_grid((32, 1, 2 * 65536), (32, 1, 2))
    # on CUDA every Kernel call refuses such a grid itself, naming the kernel (checked
    # before the kernel is built, so no GPU is needed to see it)
    with pytest.raises(ValueError, match="mxfp4_bfrag: 65536 threadgroups along y"):
        mxfp4_prefill_mma.MXFP4_BFRAG("cuda", grid=(256, 65536, 1), threadgroup=(256, 1, 1))
    (z, w, inds, wts, beta, cap), _ = case(5, 64, 96, 3, 2, "float32")
    too_many = mx.zeros((65536, 1), dtype=mx.int32)  # 65536 pairs -> 65536 blocks along y
    with pytest.raises(RuntimeError, match="along y"):
        expert_glu_decode(
            mx.zeros((65536, 64)), w, too_many, mx.ones((65536, 1)), beta, cap, backend="emulator"
        )


@pytest.mark.parametrize("tokens", [512, 4096])
def test_launch_geometry_at_k3_scale(monkeypatch, tokens):
    """Every launch the expert kernels make for a K3 layer (896 experts, D 3584, I 3072,
    top-16), LUT and tensor-core, decode and prefill, fits CUDA's grid limits and the tile
    bound: every ``Kernel`` call captured, nothing executed. (At 4096 tokens the down
    projection's B fragments are 65536 rows: ``mxfp4_bfrag`` once put them on y.)"""
    from kimi_k3.kernels import source

    launches = []

    def fake(kernel, backend, **kw):
        launches.append((kernel.name, kw["grid"], kw["threadgroup"]))
        return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(source.Kernel, "__call__", fake)
    E, D, I, k = 896, 3584, 3072, 16
    w = lazy_stack(E, D, I)
    inds, wts = (mx.array(a) for a in routing(tokens, E, k, tokens))
    z = mx.zeros((tokens, D), mx.bfloat16)
    for tm in (None, 16, 32, 64):
        expert_glu_prefill(z, w, inds, wts, BETA, CAP, tile_tokens=tm, backend="cuda")
    for tm in (None, 16, 32):
        mxfp4_prefill_mma.expert_glu_prefill_mma(
            z, w, inds, wts, BETA, CAP, tile_tokens=tm, backend="cuda"
        )
    n = dispatch.EXPERT_DECODE_MAX_PAIRS // k
    expert_glu_decode(z[:n], w, inds[:n], wts[:n], BETA, CAP, backend="cuda")
    mxfp4_mma.expert_glu_decode(z[:n], w, inds[:n], wts[:n], BETA, CAP, backend="cuda")
    names = [name for name, _, _ in launches]
    assert names.count("mxfp4_grouped") == 8 and names.count("mxfp4_bfrag") == 6
    assert names.count("mxfp4_grouped_mma") == 6 and names.count("mxfp4_sum") == 2
    # the tensor-core decode runs with its launch bounds (MIN_BLOCKS) and byte-permute
    # decode (DECODE)
    assert names[-3:] == ["mxfp4_mma_lb256x2_prmt", "mxfp4_mma_lb256x2_prmt", "mxfp4_sum"]
    assert len(launches) == 8 + 12 + 3 + 3
    for name, grid, tg in launches:
        check_cuda_grid(grid, tg)
        assert all(g % t == 0 for g, t in zip(grid, tg)), name
    P = tokens * k
    for tm in (16, 32, 64):
        assert (P + E * (tm - 1)) // tm < 65535  # tiles run along x, but stay small anyway


# On CUDA alone: the dispatcher's choices there, the launch bounds (CUDA's compile option),
# and launches the emulator would take hours over.


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 2, 3])
def test_dispatched_decode_at_k3_size(monkeypatch, N):
    """The model's expert call (``kimi_k3.model.experts.expert_glu``) at K3 size: one launch at 16
    and 32 pairs, three at 48 (``dispatch.expert_decode_choice``), the three launches' bits
    either way, and the oracle."""
    dispatch_defaults(monkeypatch)
    args, want = case(16, *K3, N, 16, "bfloat16")
    fn = dispatch.expert_glu_kernel(*args[:3])
    one = N * 16 <= dispatch.EXPERT_ONE_LAUNCH_MAX_PAIRS
    assert fn.func is (mxfp4_one.expert_glu_decode if one else mxfp4_mma.expert_glu_decode)
    got = np.array(expert_glu(*args))
    assert np.array_equal(got, np.array(mxfp4_mma.expert_glu_decode(*args, backend="cuda")))
    assert rel_err(mx.array(got), want) < TOL


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
def test_prefill_mma_past_65535_pairs():
    """4096 tokens x 16: the down projection's 65536 rows of B fragments (the launch that
    failed with cuGraphAddKernelNode's invalid argument while they ran along y)."""
    E, D, I, N, k = 64, 256, 128, 4096, 16
    args, want = case(E, D, I, N, k, "bfloat16")
    got = expert_glu_prefill_mma(*args, backend="cuda")
    assert got.shape == (N, D) and rel_err(got, want) < TOL


@pytest.mark.cuda
def test_dispatcher_uses_cuda_kernels(monkeypatch):
    """Decode and prefill: the kernels (gather_qmm is wrong at K3 scale on CUDA, see
    dispatch.expert_prefill_choice), unless KIMI_K3_EXPERT_PREFILL=reference."""
    dispatch_defaults(monkeypatch)
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


@pytest.mark.cuda
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


@pytest.fixture(scope="module")
def k3_layer():
    """One K3 layer's stack: 896 experts at K3 dims (about 16 GB), built on the GPU. Past
    2^31 4-bit elements per matrix, where MLX's gather_qmm and the kernels disagree."""
    from benchmarks.bench_mxfp4 import random_experts

    w = random_experts(896, *K3, seed=0)
    yield w
    del w
    mx.clear_cache()


@pytest.mark.slow  # builds a 16 GB stack
@pytest.mark.cuda
@pytest.mark.parametrize("lo", [0, 384, 880])
def test_k3_layer_scale_against_dense_oracle(k3_layer, monkeypatch, lo):
    """Tokens routed to experts lo..lo+15 of 896 (byte offsets past 2^31 and 2^32 for the
    higher bands): the decode kernel, the prefill kernel and the dispatcher's choice
    against an fp32 dense oracle (mx.dequantize, no matmul)."""
    from benchmarks.bench_mxfp4 import BETA as B
    from benchmarks.bench_mxfp4 import CAP as C
    from benchmarks.bench_mxfp4 import oracle

    dispatch_defaults(monkeypatch)
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


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 4, 64])
def test_dispatched_on_tiled_stacks_same_bits(monkeypatch, N):
    """``expert_glu`` on ``TiledStacks`` (one launch at 16 pairs, three at 64, the grouped
    GEMM at 1024) gives the bits it gives on MLX's layout; the reference on tiles agrees
    with the reference on MLX's layout."""
    dispatch_defaults(monkeypatch)
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
