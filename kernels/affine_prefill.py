"""Affine expert prefill: (token, choice) pairs grouped by expert, one grouped GEMM per matrix,
for the lower-bit experts (MLX ``affine``, 2 or 3 bits; ``affine_decode`` describes them).

The pairs, their sorting, the tiles (``mxfp4_prefill.group_by_expert``, ``tile_tokens_for``)
and the threadgroup's work are ``mxfp4_prefill``'s: 256 threads per (tile, block of output
rows), a block of weight rows read once per tile of tokens. Per 32-wide step of the reduction
axis the tile's inputs are staged in fp32 (``xs``: 32 x TM), each staging thread loads the
step's ``BITS`` code words and the group's scale and bias of its 4 weight rows, and per
eighth of the step (8 codes: ``8 BITS`` bits at a fixed place in those words) the threads
decode their codes to ``s q + b`` into ``ws`` (8 x 8 TX, fp32) and every thread accumulates
its RT tokens x 8 rows.

Launch 1 (``NMAT = 2``) computes gate and up of the same rows and writes SiTU-GLU ``h`` [P, I]
in sorted order; launch 2 (``NMAT = 1``, two slabs of w2 rows) writes ``y`` [P, D] times each
pair's routing weight; a gather and a sum over the choices finish the call.
"""

from __future__ import annotations

import mlx.core as mx

from .affine_decode import BITS, params
from .mxfp4_decode import HEADER, K3
from .mxfp4_prefill import (
    THREADS,
    TILE_SHAPES,
    group_by_expert,
    rows_per_group,
    tile_tokens_for,
)
from .source import Instance, Kernel, constant
from .source import backend as default_backend

BODY = """
  constexpr int W = KD * BITS / 32;   // uint32 words per weight row
  constexpr int G = KD / GS;          // scale groups per weight row
  constexpr int TY = TM / RT;         // thread rows (tokens)
  constexpr int TX = 256 / TY;        // thread columns (4 weight rows per slab each)
  constexpr int SLAB = 4 * TX;        // weight rows per slab
  constexpr int BN = NMAT == 2 ? SLAB : 2 * SLAB;   // output rows per threadgroup
  constexpr int XQ = 32 * TM / 4;     // staging items of xs: (k, 4 tokens)
  constexpr uint MASK = (1u << BITS) - 1u;
  SHARED float4 xs[32 * TM / 4];      // [k][token / 4]
  SHARED float4 ws[8 * 2 * TX];       // [code of the eighth][staged row / 4]

  const uint tid = THREAD_INDEX;
  const int start = tiles[3 * GROUP_POS.x];
  const int len = tiles[3 * GROUP_POS.x + 1];
  const size_t expert = (size_t)tiles[3 * GROUP_POS.x + 2];
  if (len == 0) return;               // the whole threadgroup leaves together
  const uint tx = tid % TX;
  const uint ty = tid / TX;
  const uint rbase = GROUP_POS.y * BN;

  // Staging: 2*TX groups of 4 weight rows (two slabs); SPLIT threads share a group, each
  // decoding JS of the 8 codes of every eighth, so all threads take part.
  constexpr int SPLIT = 256 / (2 * TX);
  constexpr int JS = 8 / SPLIT;
  const uint stage = tid % (2 * TX);
  const uint jpart = tid / (2 * TX);
  const uint slab = stage / TX;
  const uint srow = rbase + (NMAT == 2 ? 0 : slab * SLAB) + 4 * (stage % TX);
  const bool second = NMAT == 2 && slab == 1;
  const size_t first_row = expert * NOUT + srow;
  const DEVICE uint32_t* wq = (second ? wb : wa) + first_row * W;
  const DEVICE S* wsc = (second ? sb : sa) + first_row * G;
  const DEVICE S* wbi = (second ? bb : ba) + first_row * G;

  float acc[RT][8];
#pragma unroll
  for (int i = 0; i < RT; ++i) {
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[i][c] = 0.0f;
  }

  for (int g = 0; g < KD / 32; ++g) {
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
    float4 xv[(XQ + 255) / 256];
#pragma unroll
    for (int s = 0; s < (XQ + 255) / 256; ++s) {
      const uint item = tid + 256 * s;
      const uint k = item % 32;
      const uint t0 = 4 * (item / 32);
      float v[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int tok = int(t0) + t;
        v[t] = 0.0f;
        if (item < XQ && tok < len) {
          const size_t row = NMAT == 2 ? (size_t)xrow[start + tok] : (size_t)(start + tok);
          v[t] = static_cast<float>(x[row * KD + 32 * g + k]);
        }
      }
      xv[s].x = v[0]; xv[s].y = v[1]; xv[s].z = v[2]; xv[s].w = v[3];
    }
    BARRIER();                        // the previous step's readers are done
#pragma unroll
    for (int s = 0; s < (XQ + 255) / 256; ++s) {
      const uint item = tid + 256 * s;
      if (item < XQ) xs[(item % 32) * (TM / 4) + item / 32] = xv[s];
    }
#pragma unroll
    for (int eighth = 0; eighth < 4; ++eighth) {
      if (eighth > 0) BARRIER();      // the previous eighth's readers are done
      // its 8 codes: bits 8 BITS eighth .. of the step's words (fixed once unrolled)
      constexpr int SPAN = 8 * BITS;
      const int lo = (SPAN * eighth) / 32;
      const int sh = (SPAN * eighth) % 32;
      uint v[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        v[r] = u[r][lo] >> sh;
        if (sh + SPAN > 32) v[r] |= u[r][(lo + 1) % BITS] << (32 - sh);
        v[r] >>= BITS * JS * jpart;
      }
#pragma unroll
      for (int j = 0; j < JS; ++j) {
        float4 d;
        d.x = float((v[0] >> (BITS * j)) & MASK) * sc[0] + bi[0];
        d.y = float((v[1] >> (BITS * j)) & MASK) * sc[1] + bi[1];
        d.z = float((v[2] >> (BITS * j)) & MASK) * sc[2] + bi[2];
        d.w = float((v[3] >> (BITS * j)) & MASK) * sc[3] + bi[3];
        ws[(JS * jpart + j) * 2 * TX + stage] = d;
      }
      BARRIER();
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 b0 = ws[j * 2 * TX + tx];
        const float4 b1 = ws[j * 2 * TX + TX + tx];
        const int k = 8 * eighth + j;
#pragma unroll
        for (int i4 = 0; i4 < RT / 4; ++i4) {
          const float4 a = xs[k * (TM / 4) + ty * (RT / 4) + i4];
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const float av = t == 0 ? a.x : t == 1 ? a.y : t == 2 ? a.z : a.w;
            const int i = 4 * i4 + t;
            acc[i][0] += av * b0.x; acc[i][1] += av * b0.y;
            acc[i][2] += av * b0.z; acc[i][3] += av * b0.w;
            acc[i][4] += av * b1.x; acc[i][5] += av * b1.y;
            acc[i][6] += av * b1.z; acc[i][7] += av * b1.w;
          }
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < RT; ++i) {
    const int tok = int(ty) * RT + i;
    if (tok < len) {
      DEVICE float* dst = out + (size_t)(start + tok) * NOUT;
      if (NMAT == 2) {
        const uint row = rbase + 4 * tx;
        if (row < NOUT) {
          float4 o;
          o.x = kk_situ_glu(acc[i][0], acc[i][4], act[0], act[1]);
          o.y = kk_situ_glu(acc[i][1], acc[i][5], act[0], act[1]);
          o.z = kk_situ_glu(acc[i][2], acc[i][6], act[0], act[1]);
          o.w = kk_situ_glu(acc[i][3], acc[i][7], act[0], act[1]);
          *(DEVICE float4*)(dst + row) = o;
        }
      } else {
        const float pw = pair_w[start + tok];
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const uint row = rbase + s * SLAB + 4 * tx;
          if (row < NOUT) {
            float4 o;
            o.x = acc[i][4 * s] * pw; o.y = acc[i][4 * s + 1] * pw;
            o.z = acc[i][4 * s + 2] * pw; o.w = acc[i][4 * s + 3] * pw;
            *(DEVICE float4*)(dst + row) = o;
          }
        }
      }
    }
  }
"""

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
    backend = backend or default_backend()
    N, k = inds.shape
    D = z.shape[-1]
    E, I = w["w1"][0].shape[:2]
    bits, gs = params(w)
    tm = tile_tokens or tile_tokens_for(inds.size, E)
    order, tiles = group_by_expert(inds.reshape(-1).astype(I32), E, tm)
    xrow, pair_w = order // k, weights.reshape(-1).astype(F32)[order]
    act = constant((beta, cap))

    def launch(x, a, b, kd, nout, nmat):
        bn = rows_per_group(nmat, tm)
        (out,) = AFFINE_GROUPED(
            backend,
            inputs=[x, xrow, tiles, *a, *b, pair_w, act],
            output_shapes=[(inds.size, nout)],
            output_dtypes=[F32],
            grid=(THREADS * tiles.shape[0], -(-nout // bn), 1),
            threadgroup=(THREADS, 1, 1),
            template=template(x.dtype, kd, nout, nmat, tm, bits, gs),
        )
        return out

    h = launch(z, w["w1"], w["w3"], D, I, 2)
    y = launch(h, w["w2"], w["w2"], I, D, 1)
    return y[mx.argsort(order)].reshape(N, k, D).sum(axis=1)
