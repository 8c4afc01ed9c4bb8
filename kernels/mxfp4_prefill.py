"""MXFP4 expert prefill: (token, choice) pairs grouped by expert, one grouped GEMM per matrix.

The pairs are sorted by expert (as ``expert_glu_reference`` does) and each expert's run is cut
into tiles of ``TM`` pairs. ``mxfp4_grouped`` runs one threadgroup of 256 threads per (tile,
block of output rows), so a block of weight rows is read once per tile of tokens:

- per 32-wide group of the reduction axis, the tile's inputs go to threadgroup memory
  (``xs``: 32 x TM, fp32), and each thread reads the scales of 4 weight rows;
- per word of that group (8 values), the threads read and decode the word of their 4 rows
  (E2M1 table, E8M0 scale; the threads sharing 4 rows split the 8 codes) into ``ws``
  (8 x 8*TX, fp32), and every thread accumulates its RT tokens x 8 rows in registers.

Tiles hold 16, 32 or 64 pairs; 32 is the largest that stays within 128 registers a thread on
sm_90 (two threadgroups per multiprocessor).

Launch 1 (``NMAT = 2``) computes gate and up of the same rows (slab 0 = w1, slab 1 = w3) and
writes SiTU-GLU ``h`` [P, I] in sorted order; launch 2 (``NMAT = 1``, two slabs of w2 rows)
writes ``y`` [P, D] times each pair's routing weight. The per-token sum is a gather and a sum.
Tile descriptors are computed on the device (no host sync): the grid is sized by the bound
``floor((P + min(E, P) * (TM - 1)) / TM)`` and unused tiles have length 0.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from .expert_bodies import GROUPED, fill
from .mxfp4_decode import HEADER, K3
from .source import Instance, Kernel, constant
from .source import backend as default_backend

# How a weight tile decodes: per 32-wide step of the reduction axis (one scale group) the 4
# scales of a staging thread's rows; per quarter of the step (one uint32 word of 8 codes) the
# word of each row, a code through the E2M1 table times its row's scale.
BODY = fill(
    GROUPED,
    "mxfp4_grouped",
    FORMAT="""\
  constexpr int W = KD / 8;           // uint32 words per weight row
  constexpr int G = KD / 32;          // scale groups per weight row
  SHARED float lut[16];
""",
    SETUP="  if (tid < 16) lut[tid] = kk_e2m1(tid);\n",
    POINTERS="""\
  const DEVICE uint32_t* wq = (second ? wb : wa) + first_row * W;
  const DEVICE uint8_t* wsc = (second ? sb : sa) + first_row * G;
""",
    STEP="""\
    float sc[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) sc[r] = srow + r < NOUT ? kk_e8m0(wsc[r * G + g]) : 0.0f;
""",
    CODES="""\
      uint v[4];  // after the step's first word, L1 hits: a row's 16 bytes share a sector
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        v[r] = srow + r < NOUT ? wq[r * W + 4 * g + quarter] >> (4 * JS * jpart) : 0u;
      }
""",
    DECODE="""\
        d.x = lut[(v[0] >> (4 * j)) & 15u] * sc[0];
        d.y = lut[(v[1] >> (4 * j)) & 15u] * sc[1];
        d.z = lut[(v[2] >> (4 * j)) & 15u] * sc[2];
        d.w = lut[(v[3] >> (4 * j)) & 15u] * sc[3];
""",
)

THREADS = 256
TILE_SHAPES = {16: 4, 32: 8, 64: 8}  # TM (pairs per tile) -> RT (tokens per thread)
INPUTS = ["x", "xrow", "tiles", "wa", "sa", "wb", "sb", "pair_w", "act"]
U32, U8, F32, I32 = mx.uint32, mx.uint8, mx.float32, mx.int32


def template(dtype, KD: int, NOUT: int, NMAT: int, TM: int):
    return [
        ("T", dtype),
        ("KD", KD),
        ("NOUT", NOUT),
        ("NMAT", NMAT),
        ("TM", TM),
        ("RT", TILE_SHAPES[TM]),
    ]


def rows_per_group(NMAT: int, TM: int) -> int:
    """Output rows one threadgroup covers (BN in the body)."""
    slab = 4 * THREADS * TILE_SHAPES[TM] // TM
    return slab if NMAT == 2 else 2 * slab


def _instances():
    out = []
    for TM in TILE_SHAPES:
        for dt in (mx.bfloat16, mx.float16, mx.float32):
            out.append(
                Instance(
                    [dt, I32, I32, U32, U8, U32, U8, F32, F32],
                    [F32],
                    template(dt, K3["D"], K3["I"], 2, TM),
                )
            )
        out.append(
            Instance(
                [F32, I32, I32, U32, U8, U32, U8, F32, F32],
                [F32],
                template(F32, K3["I"], K3["D"], 1, TM),
            )
        )
    return out


MXFP4_GROUPED = Kernel(
    "mxfp4_grouped", INPUTS, ["out"], BODY, header=HEADER, instances=_instances()
)


def tile_tokens_for(pairs: int, experts: int) -> int:
    """Pairs per tile for ``pairs`` spread over ``experts`` (flat routing assumed): 16 when an
    expert's expected run fits, else 32 (64 needs 144 registers a thread on sm_90, so one
    threadgroup per multiprocessor; the benchmark sweeps it)."""
    per_expert = pairs / max(1, min(experts, pairs))
    return 16 if per_expert <= 16 else 32


def group_by_expert(flat: mx.array, num_experts: int, tm: int):
    """Sort pairs by expert and cut each expert's run into tiles of at most ``tm`` pairs.

    Shapes: flat [P] int32 expert ids. Returns (order [P]: pair ids sorted by expert,
    tiles [T, 3] int32 rows (start, length, expert), T the bound in the module docstring;
    rows past the real tiles are (0, 0, 0)).
    """
    P = flat.size
    order = mx.argsort(flat).astype(I32)
    ids = flat[order]
    pos = mx.arange(P, dtype=I32)
    first = mx.concatenate([mx.array([True]), ids[1:] != ids[:-1]])
    run_start = mx.cummax(mx.where(first, pos, 0))
    run_end = mx.cummin(
        mx.concatenate([mx.where(first[1:], pos[1:], P), mx.array([P], I32)]), reverse=True
    )
    opens = (pos - run_start) % tm == 0
    n_tiles = min(P, (P + min(num_experts, P) * (tm - 1)) // tm)
    slot = mx.where(opens, mx.cumsum(opens.astype(I32)) - 1, n_tiles)  # n_tiles: discarded
    desc = mx.stack([pos, mx.minimum(run_end - pos, tm), ids], axis=1)
    desc = mx.where(opens[:, None], desc, 0)
    tiles = mx.zeros((n_tiles + 1, 3), dtype=I32).at[slot].add(desc)
    return order, tiles[:n_tiles]


def grouped_glu(z, w, inds, weights, beta, cap, tm: int, gemm):
    """Pairs sorted by expert and cut into tiles of ``tm``, both grouped launches, and the
    per-token sum: what the prefill kernels share, whatever the experts' format. ``gemm(x, a,
    b, kd, nout, nmat, xrow, tiles, pair_w, act)`` runs one launch (``a``, ``b``: the two
    matrices' tuples as ``w`` holds them) and returns [P, nout] in sorted order."""
    N, k = inds.shape
    D = z.shape[-1]
    E, I = w["w1"][0].shape[:2]
    order, tiles = group_by_expert(inds.reshape(-1).astype(I32), E, tm)
    pairs = (order // k, tiles, weights.reshape(-1).astype(F32)[order], constant((beta, cap)))
    h = gemm(z, w["w1"], w["w3"], D, I, 2, *pairs)
    y = gemm(h, w["w2"], w["w2"], I, D, 1, *pairs)
    return y[mx.argsort(order)].reshape(N, k, D).sum(axis=1)


def expert_glu_prefill(
    z, w, inds, weights, beta, cap, tile_tokens: int | None = None, backend: str | None = None
):
    """``kimi_k3.model.experts.expert_glu_reference`` as two grouped GEMMs, for many tokens.

    Shapes: z [N, D]; w as ``expert_glu_reference`` (leading axis: experts or cache slots);
    inds [N, k]; weights [N, k]. Returns fp32 [N, D].
    """
    tm = tile_tokens or tile_tokens_for(inds.size, w["w1"][0].shape[0])
    gemm = grouped_gemm(MXFP4_GROUPED, backend or default_backend(), partial(template, TM=tm))
    return grouped_glu(z, w, inds, weights, beta, cap, tm, gemm)


def grouped_gemm(kernel: Kernel, backend: str, template):
    """``grouped_glu``'s ``gemm`` for a kernel of ``expert_bodies.GROUPED`` (``MXFP4_GROUPED``'s
    inputs, each matrix as ``w`` holds it); ``template(dtype, KD, NOUT, NMAT)`` gives a
    launch's template values."""

    def gemm(x, a, b, kd, nout, nmat, xrow, tiles, pair_w, act):
        values = template(x.dtype, kd, nout, nmat)
        bn = rows_per_group(nmat, dict(values)["TM"])
        (out,) = kernel(
            backend,
            inputs=[x, xrow, tiles, *a, *b, pair_w, act],
            output_shapes=[(xrow.size, nout)],
            output_dtypes=[F32],
            grid=(THREADS * tiles.shape[0], -(-nout // bn), 1),
            threadgroup=(THREADS, 1, 1),
            template=values,
        )
        return out

    return gemm
