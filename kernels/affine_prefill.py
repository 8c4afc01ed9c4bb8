"""Affine expert prefill: (token, choice) pairs grouped by expert, one grouped GEMM per matrix,
for the lower-bit experts (MLX ``affine``, 2 or 3 bits; ``affine_decode`` describes them).

The pairs, their sorting, the tiles and the two launches (``mxfp4_prefill.grouped_glu``) and
the threadgroup's work (``expert_bodies.GROUPED``) are ``mxfp4_prefill``'s: 256 threads per
(tile, block of output rows), a block of weight rows read once per tile of tokens. Per
32-wide step of the reduction axis the tile's inputs are staged in fp32 (``xs``: 32 x TM),
each staging thread loads the step's ``BITS`` code words and the group's scale and bias of
its 4 weight rows, and per quarter of the step (8 codes: ``8 BITS`` bits at a fixed place in
those words) the threads decode their codes to ``s q + b`` into ``ws`` (8 x 8 TX, fp32) and
every thread accumulates its RT tokens x 8 rows.

Launch 1 (``NMAT = 2``) computes gate and up of the same rows and writes SiTU-GLU ``h`` [P, I]
in sorted order; launch 2 (``NMAT = 1``, two slabs of w2 rows) writes ``y`` [P, D] times each
pair's routing weight; a gather and a sum over the choices finish the call.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from .affine_decode import BITS, params
from .expert_bodies import GROUPED, fill
from .mxfp4_decode import HEADER, K3
from .mxfp4_prefill import TILE_SHAPES, grouped_gemm, grouped_glu, tile_tokens_for
from .source import Instance, Kernel
from .source import backend as default_backend

# How a weight tile decodes: per 32-wide step of the reduction axis the step's BITS code
# words of each of a staging thread's 4 rows and their group's scale and bias; per quarter of
# the step (8 codes: 8 BITS bits at a fixed place in those words, fixed once the loops
# unroll) a code q of a row becomes s q + b.
BODY = fill(
    GROUPED,
    "affine_grouped",
    FORMAT="""\
  constexpr int W = KD * BITS / 32;   // uint32 words per weight row
  constexpr int G = KD / GS;          // scale groups per weight row
  constexpr uint MASK = (1u << BITS) - 1u;
""",
    SETUP="",
    POINTERS="""\
  const DEVICE uint32_t* wq = (second ? wb : wa) + first_row * W;
  const DEVICE S* wsc = (second ? sb : sa) + first_row * G;
  const DEVICE S* wbi = (second ? bb : ba) + first_row * G;
""",
    STEP="""\
    const int grp = (32 * g) / GS;
    float sc[4], bi[4];
    uint u[4][BITS];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const bool ok = srow + r < NOUT;
      sc[r] = ok ? static_cast<float>(wsc[r * G + grp]) : 0.0f;
      bi[r] = ok ? static_cast<float>(wbi[r * G + grp]) : 0.0f;
#pragma unroll
      for (int b = 0; b < BITS; ++b) u[r][b] = ok ? wq[r * W + BITS * g + b] : 0u;
    }
""",
    CODES="""\
      constexpr int SPAN = 8 * BITS;
      const int lo = (SPAN * quarter) / 32;
      const int sh = (SPAN * quarter) % 32;
      uint v[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        v[r] = u[r][lo] >> sh;
        if (sh + SPAN > 32) v[r] |= u[r][(lo + 1) % BITS] << (32 - sh);
        v[r] >>= BITS * JS * jpart;
      }
""",
    DECODE="""\
        d.x = float((v[0] >> (BITS * j)) & MASK) * sc[0] + bi[0];
        d.y = float((v[1] >> (BITS * j)) & MASK) * sc[1] + bi[1];
        d.z = float((v[2] >> (BITS * j)) & MASK) * sc[2] + bi[2];
        d.w = float((v[3] >> (BITS * j)) & MASK) * sc[3] + bi[3];
""",
)

INPUTS = ["x", "xrow", "tiles", "wa", "sa", "ba", "wb", "sb", "bb", "pair_w", "act"]
U32, F16, F32, I32 = mx.uint32, mx.float16, mx.float32, mx.int32


def template(dtype, KD: int, NOUT: int, NMAT: int, TM: int, bits: int, gs: int):
    return [
        ("T", dtype),
        ("S", F16),
        ("KD", KD),
        ("NOUT", NOUT),
        ("NMAT", NMAT),
        ("TM", TM),
        ("RT", TILE_SHAPES[TM]),
        ("BITS", bits),
        ("GS", gs),
    ]


def _instances():
    out = []
    for bits in BITS:
        for TM in (16, 32):
            for dt in (mx.bfloat16, mx.float16, mx.float32):
                inputs = [dt, I32, I32, U32, F16, F16, U32, F16, F16, F32, F32]
                out.append(Instance(inputs, [F32], template(dt, K3["D"], K3["I"], 2, TM, bits, 64)))
            inputs = [F32, I32, I32, U32, F16, F16, U32, F16, F16, F32, F32]
            out.append(Instance(inputs, [F32], template(F32, K3["I"], K3["D"], 1, TM, bits, 64)))
    return out


AFFINE_GROUPED = Kernel(
    "affine_grouped", INPUTS, ["out"], BODY, header=HEADER, instances=_instances()
)


def expert_glu_prefill(
    z, w, inds, weights, beta, cap, tile_tokens: int | None = None, backend: str | None = None
):
    """``kimi_k3.model.experts.expert_glu_reference`` on affine stacks as two grouped GEMMs.

    Shapes: z [N, D]; w maps ``w1``/``w3``/``w2`` to ``(weight, scales, biases)`` (leading
    axis: experts or cache slots); inds [N, k]; weights [N, k]. Returns fp32 [N, D].
    """
    bits, gs = params(w)
    tm = tile_tokens or tile_tokens_for(inds.size, w["w1"][0].shape[0])
    values = partial(template, TM=tm, bits=bits, gs=gs)
    gemm = grouped_gemm(AFFINE_GROUPED, backend or default_backend(), values)
    return grouped_glu(z, w, inds, weights, beta, cap, tm, gemm)
