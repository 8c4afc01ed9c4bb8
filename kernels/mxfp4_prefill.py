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

import mlx.core as mx

from .mxfp4_decode import HEADER, K3
from .source import Instance, Kernel, constant
from .source import backend as default_backend

BODY = """
  constexpr int W = KD / 8;           // uint32 words per weight row
  constexpr int G = KD / 32;          // scale groups per weight row
  constexpr int TY = TM / RT;         // thread rows (tokens)
  constexpr int TX = 256 / TY;        // thread columns (4 weight rows per slab each)
  constexpr int SLAB = 4 * TX;        // weight rows per slab
  constexpr int BN = NMAT == 2 ? SLAB : 2 * SLAB;   // output rows per threadgroup
  constexpr int XQ = 32 * TM / 4;     // staging items of xs: (k, 4 tokens)
  SHARED float lut[16];
  SHARED float4 xs[32 * TM / 4];      // [k][token / 4]
  SHARED float4 ws[8 * 2 * TX];       // [code of the word][staged row / 4]

  const uint tid = THREAD_INDEX;
  const int start = tiles[3 * GROUP_POS.x];
  const int len = tiles[3 * GROUP_POS.x + 1];
  const size_t expert = (size_t)tiles[3 * GROUP_POS.x + 2];
  if (len == 0) return;               // the whole threadgroup leaves together
  if (tid < 16) lut[tid] = kk_e2m1(tid);
  const uint tx = tid % TX;
  const uint ty = tid / TX;
  const uint rbase = GROUP_POS.y * BN;

  // Staging: 2*TX groups of 4 weight rows (two slabs); SPLIT threads share a group, each
  // decoding JS of the 8 codes of every word, so all threads take part.
  constexpr int SPLIT = 256 / (2 * TX);
  constexpr int JS = 8 / SPLIT;
  const uint stage = tid % (2 * TX);
  const uint jpart = tid / (2 * TX);
  const uint slab = stage / TX;
  const uint srow = rbase + (NMAT == 2 ? 0 : slab * SLAB) + 4 * (stage % TX);
  const DEVICE uint32_t* wq = (NMAT == 2 && slab == 1 ? wb : wa) + (expert * NOUT + srow) * W;
  const DEVICE uint8_t* wsc = (NMAT == 2 && slab == 1 ? sb : sa) + (expert * NOUT + srow) * G;

  float acc[RT][8];
#pragma unroll
  for (int i = 0; i < RT; ++i) {
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[i][c] = 0.0f;
  }

  for (int g = 0; g < G; ++g) {
    float sc[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) sc[r] = srow + r < NOUT ? kk_e8m0(wsc[r * G + g]) : 0.0f;
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
    BARRIER();                        // the previous group's readers are done
#pragma unroll
    for (int s = 0; s < (XQ + 255) / 256; ++s) {
      const uint item = tid + 256 * s;
      if (item < XQ) xs[(item % 32) * (TM / 4) + item / 32] = xv[s];
    }
#pragma unroll
    for (int word = 0; word < 4; ++word) {
      if (word > 0) BARRIER();        // the previous word's readers are done
      uint u[4];  // after the group's first word, L1 hits: a row's 16 bytes share a sector
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        u[r] = srow + r < NOUT ? wq[r * W + 4 * g + word] >> (4 * JS * jpart) : 0u;
      }
#pragma unroll
      for (int j = 0; j < JS; ++j) {
        float4 d;
        d.x = lut[(u[0] >> (4 * j)) & 15u] * sc[0];
        d.y = lut[(u[1] >> (4 * j)) & 15u] * sc[1];
        d.z = lut[(u[2] >> (4 * j)) & 15u] * sc[2];
        d.w = lut[(u[3] >> (4 * j)) & 15u] * sc[3];
        ws[(JS * jpart + j) * 2 * TX + stage] = d;
      }
      BARRIER();
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 b0 = ws[j * 2 * TX + tx];
        const float4 b1 = ws[j * 2 * TX + TX + tx];
        const int k = 8 * word + j;
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
    per-token sum: what the prefill kernels share. ``gemm(x, wa, sa, wb, sb, kd, nout, nmat,
    xrow, tiles, pair_w, act)`` runs one launch and returns [P, nout] in sorted order."""
    N, k = inds.shape
    D = z.shape[-1]
    E, I = w["w1"][0].shape[:2]
    order, tiles = group_by_expert(inds.reshape(-1).astype(I32), E, tm)
    pairs = (order // k, tiles, weights.reshape(-1).astype(F32)[order], constant((beta, cap)))
    h = gemm(z, *w["w1"], *w["w3"], D, I, 2, *pairs)
    y = gemm(h, *w["w2"], *w["w2"], I, D, 1, *pairs)
    return y[mx.argsort(order)].reshape(N, k, D).sum(axis=1)


def expert_glu_prefill(
    z, w, inds, weights, beta, cap, tile_tokens: int | None = None, backend: str | None = None
):
    """``kimi_k3.model.experts.expert_glu_reference`` as two grouped GEMMs, for many tokens.

    Shapes: z [N, D]; w as ``expert_glu_reference`` (leading axis: experts or cache slots);
    inds [N, k]; weights [N, k]. Returns fp32 [N, D].
    """
    backend = backend or default_backend()
    tm = tile_tokens or tile_tokens_for(inds.size, w["w1"][0].shape[0])

    def launch(x, wa, sa, wb, sb, kd, nout, nmat, xrow, tiles, pair_w, act):
        bn = rows_per_group(nmat, tm)
        (out,) = MXFP4_GROUPED(
            backend,
            inputs=[x, xrow, tiles, wa, sa, wb, sb, pair_w, act],
            output_shapes=[(inds.size, nout)],
            output_dtypes=[F32],
            grid=(THREADS * tiles.shape[0], -(-nout // bn), 1),
            threadgroup=(THREADS, 1, 1),
            template=template(x.dtype, kd, nout, nmat, tm),
        )
        return out

    return grouped_glu(z, w, inds, weights, beta, cap, tm, launch)
