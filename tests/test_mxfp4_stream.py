"""The streamed-ring MXFP4 decode (kernels/mxfp4_stream.py) through the Metal emulator, against
the float64 oracle of test_mxfp4_kernels: persistent threadgroups over units, a ring of whole
units brought in by bulk copies, a unit's blocks split over the warps."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import broken
from test_mxfp4_kernels import (
    TOL,
    assert_broken,
    case,
    check_mma_large_and_tiny,
    rel_err,
    slot_pool,
)

from kimi_k3.kernels import mxfp4_stream

# (experts, D, I, tokens, top-k, dtype): rows of 4, 8, 12 and 16 groups (ring strides of 4,
# 12, 12 and 20 chunks), several tokens (gate/up restages its latent per token), top-16.
STREAM_CASES = [
    (3, 128, 128, 2, 2, "float32"),
    (5, 256, 384, 3, 2, "bfloat16"),
    (20, 128, 256, 1, 16, "float16"),
    (4, 512, 384, 2, 3, "float32"),
]


@pytest.mark.parametrize("E,D,I,N,k,dtype", STREAM_CASES)
def test_stream_decode_matches_oracle(E, D, I, N, k, dtype):
    args, want = case(E, D, I, N, k, dtype)
    got = mxfp4_stream.expert_glu_decode(*args, backend="emulator", ctas=5)
    assert got.dtype == mx.float32 and got.shape == (N, D)
    assert rel_err(got, want) < TOL


# (warps, stages, bulk rows) for both projections: warps with no block of a row (5 warps, 4
# blocks), an uneven split (3 warps), one warp, two to four stages; rows by bulk copies,
# by asynchronous copies, half each.
@pytest.mark.parametrize(
    "launch",
    [(8, 3, 32), (3, 2, 32), (1, 4, 0), (5, 2, 16), (2, 3, 0), (4, 3, 16), (8, 2, 0)],
)
def test_stream_launches(launch):
    args, want = case(5, 128, 256, 3, 2, "bfloat16")
    got = mxfp4_stream.expert_glu_decode(
        *args, backend="emulator", launch={"gate_up": launch, "down": launch}, ctas=4
    )
    assert rel_err(got, want) < TOL


def test_stream_results_do_not_depend_on_the_grid_or_the_ring():
    """A unit's sums do not depend on which threadgroup takes it or on the ring's depth: one
    threadgroup, a few, more than there are units, and 2 or 4 stages give the same bits."""
    args, want = case(4, 128, 256, 2, 2, "float32")
    runs = [
        mxfp4_stream.expert_glu_decode(
            *args, backend="emulator", ctas=c, launch={"gate_up": (4, s, f), "down": (4, s, f)}
        )
        for c, s, f in ((1, 2, 32), (3, 4, 0), (7, 3, 16), (1000, 2, 32))
    ]
    assert rel_err(runs[0], want) < TOL
    for r in runs[1:]:
        assert np.array_equal(np.array(r), np.array(runs[0]))


def test_stream_handles_large_and_tiny_activations():
    check_mma_large_and_tiny("emulator", mxfp4_stream.expert_glu_decode)


def test_stream_reads_cache_slots_as_given():
    """The streamer's slot pool (experts at scattered slots of a larger array, seen through a
    view with an offset): the same bits as the stacked experts."""
    (z, w, inds, wts, beta, cap), _ = case(4, 128, 256, 3, 2, "float32")
    slots = np.random.default_rng(3).permutation(8)[:4]
    pool = slot_pool(w, slots, 8)
    want = mxfp4_stream.expert_glu_decode(z, w, inds, wts, beta, cap, backend="emulator")
    got = mxfp4_stream.expert_glu_decode(
        z, pool, mx.array(slots)[inds], wts, beta, cap, backend="emulator"
    )
    assert np.array_equal(np.array(got), np.array(want))


def test_stream_probe_without_products_streams_the_same_ring():
    """``math=False`` keeps the copies and barriers and leaves the products out: its output is
    not the oracle's (it is the probe of the ring's own time, not a decode)."""
    args, want = case(3, 128, 128, 2, 2, "float32")
    got = mxfp4_stream.expert_glu_decode(*args, backend="emulator", math=False)
    assert not rel_err(got, want) < 0.5


def test_stream_ring_fits():
    """K3's rows fit sm_90's 227 KB at the default launches (three stages); Metal's and the
    emulator's 32 KB refuse them, naming the bytes; small rows get fewer stages there."""
    for KD, proj in ((3584, "gate_up"), (3072, "down")):
        launch = mxfp4_stream.LAUNCH[proj]
        assert mxfp4_stream.fit("cuda", KD, launch) == launch
        assert mxfp4_stream.shared_bytes(KD, *launch[:2]) <= 227 * 1024
        with pytest.raises(ValueError, match="threadgroup memory"):
            mxfp4_stream.fit("emulator", KD, launch)
    assert mxfp4_stream.fit("emulator", 512, (8, 4, 0)) == (8, 2, 0)
    with pytest.raises(ValueError, match="bulk copies"):
        mxfp4_stream.fit("cuda", 512, (8, 3, 8))
    for G in (4, 8, 12, 96, 112):
        assert mxfp4_stream.row_stride(G) >= G and mxfp4_stream.row_stride(G) % 8 == 4


# Mutations that must fail (with the rows brought by bulk copies, 32, by asynchronous
# copies, 0, or half each, 16): a refill of the stage about to be read (as the barrier's
# absence would allow), the wrong ring stage, rows copied without the ring's stride, tile B's
# scales read or copied as tile A's, no arrival for the asynchronous copies, the asynchronous
# rows over the bulk ones, the latent staged once for every token, one warp's blocks for
# every warp.
MUTATIONS = {
    "refill-the-stage-in-use": (
        "MBAR_WAIT(&bars[st], (i / S) & 1u);",
        "MBAR_WAIT(&bars[st], (i / S) & 1u);\n    if (u + S < u1) KS_ISSUE(u + S, st);",
        (32, 0),
    ),
    "wrong-stage": ("const uint st = i % S;", "const uint st = (i + 1) % S;", (32,)),
    "unstrided-bulk-rows": ("&ring[base_ + lane * RS]", "&ring[base_ + lane * G]", (32,)),
    "unstrided-async-rows": (
        "ring[base_ + row_ * RS + col_]",
        "ring[base_ + row_ * G + col_]",
        (0,),
    ),
    "tile-b-scales-read-as-a": ("&ring[base_ + CODES + G]", "&ring[base_ + CODES]", (32,)),
    "tile-b-scales-copied-from-a": (
        "(const DEVICE uint4*)(s_b + rb_ * G) + (c2_ - G)",
        "(const DEVICE uint4*)(s_a + r_ * G) + (c2_ - G)",
        (0,),
    ),
    "no-async-arrival": ("      MBAR_ASYNC_ARRIVE(&bars[st]);", "", (0,)),
    "async-rows-over-bulk-rows": (
        "const uint row_ = FILL + c_ / G",
        "const uint row_ = c_ / G",
        (16,),
    ),
    "one-latent": ("if (xrow != staged) {", "if (staged == 0xffffffffu) {", (32,)),
    "overlapping-blocks": ("const uint kb0 = warp * NBK / NW;", "const uint kb0 = 0;", (0,)),
}


@pytest.mark.parametrize(
    "name, fill", [(n, f) for n, (_, _, fills) in MUTATIONS.items() for f in fills]
)
def test_a_broken_stream_kernel_fails(monkeypatch, name, fill):
    old, new, _ = MUTATIONS[name]
    monkeypatch.setattr(mxfp4_stream, "MXFP4_STREAM", broken(mxfp4_stream.MXFP4_STREAM, old, new))
    args, want = case(4, 256, 384, 3, 2, "float32")
    launch = {"gate_up": (2, 3, fill), "down": (2, 3, fill)}
    assert_broken(
        lambda: mxfp4_stream.expert_glu_decode(*args, backend="emulator", ctas=3, launch=launch),
        want,
    )


@pytest.mark.parametrize("fill", mxfp4_stream.FILLS)
def test_the_unbroken_stream_kernel_passes_the_mutation_case(fill):
    args, want = case(4, 256, 384, 3, 2, "float32")
    launch = {"gate_up": (2, 3, fill), "down": (2, 3, fill)}
    got = mxfp4_stream.expert_glu_decode(*args, backend="emulator", ctas=3, launch=launch)
    assert rel_err(got, want) < TOL


def test_shared_dynamic_renders_for_each_backend():
    """SHARED_DYNAMIC: a sized threadgroup array on Metal (and so in the emulator), dynamic
    shared memory on CUDA, whose bytes the CUDA kernel object asks for at launch."""
    from kimi_k3.kernels import source

    text = "  SHARED_DYNAMIC(uint4, ring, S * STAGE);  // ring"
    assert source.render(text, "metal") == "  threadgroup uint4 ring[S * STAGE];  // ring"
    assert source.render(text, "cuda") == "  extern __shared__ __align__(16) uint4 ring[];  // ring"
    cuda = mxfp4_stream.kernel_for("cuda", 3584, 3)
    assert cuda.shared_memory == mxfp4_stream.ring_bytes(3584, 3) > 48 * 1024
    assert mxfp4_stream.kernel_for("emulator", 3584, 3).shared_memory == 0
