"""The one-launch MXFP4 decode (kernels/mxfp4_one.py) on the Metal emulator and on CUDA (the
``backend`` fixture; K3's sizes on CUDA alone): the bits of the three-launch ``mxfp4_mma``
decode, its counters, and mutations of its meeting points that must fail (a wait that never
ends gives NaN, not a hang)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import broken, on_cuda, rel_err
from test_mxfp4_kernels import K3, MMA_CASES, TOL, assert_broken, case

from kimi_k3.kernels import mxfp4_mma, mxfp4_one

# mxfp4_mma's emulator cases without the K3-size one (slow here; the CUDA tests run K3): rows
# of 4 and 8 groups, a partial last row block in both roles (I = 1152: 72 gate/up units in
# blocks of 8 = 9; D = 1280: 40 down units, 5 blocks), top-16 over 20 experts.
CASES = [c for c in MMA_CASES if c[1:3] != K3]
K3_CASES = [
    on_cuda(*c)
    for c in [
        *(c for c in MMA_CASES if c[1:3] == K3),
        (16, *K3, 1, 16, "bfloat16"),
        (16, *K3, 2, 16, "bfloat16"),
        (16, *K3, 8, 16, "float32"),
    ]
]
# launches compared per backend: on the GPU a race would show as a difference in some
LAUNCHES = {"emulator": 1, "cuda": 5}


@pytest.mark.slow
@pytest.mark.parametrize("E,D,I,N,k,dtype", CASES + K3_CASES)
def test_one_launch_gives_the_three_launches_bits(backend, E, D, I, N, k, dtype):
    """mxfp4_one (gate/up, down and the sum in one grid, meeting through counters): the
    three-launch decode's bits at every launch, and the oracle."""
    args, want = case(E, D, I, N, k, dtype)
    three = np.array(mxfp4_mma.expert_glu_decode(*args, backend=backend))
    for _ in range(LAUNCHES[backend]):
        got = mxfp4_one.expert_glu_decode(*args, backend=backend)
        assert got.dtype == mx.float32 and got.shape == (N, D)
        assert np.array_equal(np.array(got), three)
    assert rel_err(got, want) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("E,D,I,N,k,dtype", CASES[1:3] + [on_cuda(16, *K3, 1, 16, "bfloat16")])
def test_one_launch_on_the_tiled_layout_gives_the_same_bits(backend, E, D, I, N, k, dtype):
    """``mxfp4_one.tiled_layout`` (dispatched for tiled stores) only moves both roles' load
    addresses."""
    from kimi_k3.kernels import expert_layout

    (z, w, *rest), _ = case(E, D, I, N, k, dtype)
    plain = mxfp4_one.expert_glu_decode(z, w, *rest, backend=backend)
    wt = expert_layout.tile(w)
    got = mxfp4_one.expert_glu_decode_tiled(z, wt, *rest, backend=backend)
    assert np.array_equal(np.array(got), np.array(plain))
    wrong = mxfp4_one.expert_glu_decode(z, wt, *rest, backend=backend)  # untiled reads
    assert not np.array_equal(np.array(wrong), np.array(plain))


@pytest.mark.slow
@pytest.mark.parametrize(
    "E,D,I,N,k,dtype", [(4, 1280, 1152, 2, 2, "float32"), on_cuda(16, *K3, 4, 16, "bfloat16")]
)
def test_every_threadgroup_counts_once(backend, E, D, I, N, k, dtype):
    """counts: every ticket taken; each pair's gate/up row blocks done; each (token, down row
    block) summed over its k pairs."""
    args, _ = case(E, D, I, N, k, dtype)
    rt, sk = mxfp4_one.shape_for(backend, D, I)[:2]
    y, h, part, counts = mxfp4_one.launch(
        mxfp4_one.dispatched_kernel(rt, sk), *args, backend=backend
    )
    xg, xd = -(-(I // 16) // rt), -(-(D // 32) // rt)
    pairs = N * k
    want = [(xg + xd) * pairs] + [xg] * pairs + [k] * (N * xd)
    assert np.array(counts).tolist() == want
    assert np.array_equal(np.array(part).reshape(N, k, D).sum(1), np.array(y))


@pytest.mark.slow
@pytest.mark.parametrize(
    "old, new",
    [
        ("      ATOMIC_ADD(&cnt[1 + p], 1u);\n", ""),
        ("    if (s_ticket[0] == K - 1 && ", "    if (s_ticket[0] == 0 && "),
        ("h + (size_t)p * KD", "h + (size_t)(p / K) * KD"),
    ],
    ids=["gate-up-never-done", "first-pair-sums", "down-reads-the-tokens-first-h"],
)
def test_a_broken_one_launch_kernel_fails(monkeypatch, old, new):
    monkeypatch.setattr(mxfp4_one, "MXFP4_ONE", broken(mxfp4_one.MXFP4_ONE, old, new))
    args, want = case(4, 256, 384, 2, 2, "float32")
    assert_broken(lambda: mxfp4_one.expert_glu_decode(*args, backend="emulator"), want)


def test_a_wait_that_gives_up_makes_nan():
    kernel = broken(mxfp4_one.MXFP4_ONE, "      ATOMIC_ADD(&cnt[1 + p], 1u);\n", "")
    args, _ = case(3, 128, 128, 1, 2, "float32")
    y = mxfp4_one.launch(kernel, *args, backend="emulator")[0]
    assert np.isnan(np.array(y)).all()


def test_both_projections_must_share_the_threadgroup(monkeypatch):
    monkeypatch.setitem(mxfp4_mma.LAUNCH, "down", (4, 2, 8, True))
    with pytest.raises(ValueError, match="mxfp4_mma.LAUNCH"):
        mxfp4_one.shape_for("cuda", 3584, 3072)
    monkeypatch.setitem(mxfp4_mma.LAUNCH, "down", mxfp4_mma.LAUNCH["gate_up"])
    monkeypatch.setitem(mxfp4_mma.MIN_BLOCKS, "down", 1)
    with pytest.raises(ValueError, match="MIN_BLOCKS"):
        mxfp4_one.dispatched_kernel(8, 1)
