"""Kernel source that MXFP4's table-lookup kernels and the affine kernels share.

The decode and prefill kernels of both formats do the same work around their weights: the
same threads walk the same rows, accumulate in the same order and end alike. Only how a
format's weights are loaded and decoded differs. The bodies here are that common source,
with a line ``//@NAME`` marking each place a format fills in (``fill``):

- ``GATE_UP``, ``DOWN``: the decode kernels (``mxfp4_decode``, ``affine_decode``), per
  (pair, tile of ``TILE`` rows). The format stages the pair's row vector (``STAGE``), then each
  simdgroup walks its sets of ``R`` rows: the format issues a set's loads (``LOADS``) and adds
  its dot products into ``gate[R]``/``up[R]`` or ``acc[R]`` (``DOTS``); one SIMD sum per row,
  then SiTU-GLU into ``h`` or the pair's routing weight into ``part``.
- ``GROUPED``: the grouped prefill GEMM (``mxfp4_prefill``, ``affine_prefill``), per (tile of
  pairs, block of ``BN`` output rows), 256 threads (``mxfp4_prefill``'s module docstring
  describes the work). A staging thread decodes 4 weight rows (from ``srow``; ``second``: they
  are slab 1 of gate/up, so the second matrix; ``first_row``: the first of them in the
  stack). The format declares its constants and threadgroup arrays (``FORMAT``), sets up
  once per threadgroup (``SETUP``), points at its rows' weights (``POINTERS``), loads what a
  32-wide step ``g`` of the reduction axis needs (``STEP``), and per ``quarter`` of the step
  (8 codes) takes the thread's codes (``CODES``: ``uint v[4]``, one per row, with the
  thread's ``JS`` codes from bit 0) and decodes code ``j`` of each row into ``float4 d``
  (``DECODE``).
"""

from __future__ import annotations

from .source import swap

GATE_UP = """
//@STAGE
  const uint tile0 = GROUP_POS.x * TILE;
  const uint tile1 = tile0 + TILE < I ? tile0 + TILE : I;
  const size_t e0 = (size_t)inds[p] * I;
  for (uint row0 = tile0 + SIMDGROUP * R; row0 < tile1; row0 += NSG * R) {
//@LOADS
    float gate[R], up[R];
#pragma unroll
    for (int r = 0; r < R; ++r) gate[r] = up[r] = 0.0f;
//@DOTS
#pragma unroll
    for (int r = 0; r < R; ++r) {
      gate[r] = SIMD_SUM(gate[r]);
      up[r] = SIMD_SUM(up[r]);
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (row0 + r < tile1)
          h[(size_t)p * I + row0 + r] = kk_situ_glu(gate[r], up[r], act[0], act[1]);
      }
    }
  }
"""

DOWN = """
//@STAGE
  const float wt = weights[p];
  const uint tile0 = GROUP_POS.x * TILE;
  const uint tile1 = tile0 + TILE < D ? tile0 + TILE : D;
  const size_t e0 = (size_t)inds[p] * D;
  for (uint row0 = tile0 + SIMDGROUP * R; row0 < tile1; row0 += NSG * R) {
//@LOADS
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
//@DOTS
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = SIMD_SUM(acc[r]);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (row0 + r < tile1) part[(size_t)p * D + row0 + r] = wt * acc[r];
      }
    }
  }
"""

GROUPED = """
//@FORMAT
  constexpr int TY = TM / RT;         // thread rows (tokens)
  constexpr int TX = 256 / TY;        // thread columns (4 weight rows per slab each)
  constexpr int SLAB = 4 * TX;        // weight rows per slab
  constexpr int BN = NMAT == 2 ? SLAB : 2 * SLAB;   // output rows per threadgroup
  constexpr int XQ = 32 * TM / 4;     // staging items of xs: (k, 4 tokens)
  SHARED float4 xs[32 * TM / 4];      // [k][token / 4]
  SHARED float4 ws[8 * 2 * TX];       // [code of the quarter][staged row / 4]

  const uint tid = THREAD_INDEX;
  const int start = tiles[3 * GROUP_POS.x];
  const int len = tiles[3 * GROUP_POS.x + 1];
  const size_t expert = (size_t)tiles[3 * GROUP_POS.x + 2];
  if (len == 0) return;               // the whole threadgroup leaves together
//@SETUP
  const uint tx = tid % TX;
  const uint ty = tid / TX;
  const uint rbase = GROUP_POS.y * BN;

  // Staging: 2*TX groups of 4 weight rows (two slabs); SPLIT threads share a group, each
  // decoding JS of the 8 codes of every quarter, so all threads take part.
  constexpr int SPLIT = 256 / (2 * TX);
  constexpr int JS = 8 / SPLIT;
  const uint stage = tid % (2 * TX);
  const uint jpart = tid / (2 * TX);
  const uint slab = stage / TX;
  const uint srow = rbase + (NMAT == 2 ? 0 : slab * SLAB) + 4 * (stage % TX);
  const bool second = NMAT == 2 && slab == 1;
  const size_t first_row = expert * NOUT + srow;
//@POINTERS

  float acc[RT][8];
#pragma unroll
  for (int i = 0; i < RT; ++i) {
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[i][c] = 0.0f;
  }

  for (int g = 0; g < KD / 32; ++g) {
//@STEP
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
    for (int quarter = 0; quarter < 4; ++quarter) {
      if (quarter > 0) BARRIER();     // the previous quarter's readers are done
//@CODES
#pragma unroll
      for (int j = 0; j < JS; ++j) {
        float4 d;
//@DECODE
        ws[(JS * jpart + j) * 2 * TX + stage] = d;
      }
      BARRIER();
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 b0 = ws[j * 2 * TX + tx];
        const float4 b1 = ws[j * 2 * TX + TX + tx];
        const int k = 8 * quarter + j;
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


def fill(body: str, what: str, **pieces: str) -> str:
    """``body`` with each marked line ``//@NAME`` replaced by ``pieces[NAME]`` (C++ lines, each
    ending in a newline, or ""). Every mark must be filled, and filled once: an error naming
    ``what`` otherwise."""
    text = swap(body, [(f"//@{name}\n", piece) for name, piece in pieces.items()], what)
    if "//@" in text:
        raise AssertionError(f"{what}: unfilled {text[text.index('//@') :].splitlines()[0]}")
    return text
