"""Where ``kda_chunk_prep``'s time goes: the kernel timed alone beside copies of it with one
part cut out (their results are wrong by design; only their times are reported).

- ``no solve``: pass 2's forward substitution removed (W and U are written unsolved; the
  loads of the right-hand sides and the stores stay);
- ``no scores``: pass 1's score dot products removed (the exponential factors, the
  barriers and everything else stay);
- ``no sub-block loop``: pass 1's loop over the four sub-blocks removed (factors, dot
  products and their 8 barriers per 16-channel tile), one barrier left in its place;
- ``no cumsum``: the in-chunk cumulative sum of g (two passes, two barriers per tile) removed
  (G is g itself);
- ``no pass-1 stores``: the Qd, Kd, beta exp(G) k and decay stores removed (pass 2 then
  solves whatever W holds);
- ``no pass 2``: the whole solve pass removed (its loads, forward substitution and stores).

Beside the cuts, whole variants (correct kernels, tests/test_kda_prep_probes.py checks them
against ``kda_chunk_prep``) are timed the same way:

- ``chunk-major grid``: consecutive threadgroups take the same chunk of consecutive heads
  (a token's q, k, g rows are read whole by the threadgroups in flight) instead of
  consecutive chunks of one head;
- ``next tile in registers``: each thread loads its float4s of the next 16-channel tile
  while the current one is worked on (12 more registers), so no tile waits on DRAM;
- ``factors at once``: pass 1 with all four sub-blocks' exponential factors computed in one
  phase (4 barriers per 16-channel tile instead of 11, 29 KB of threadgroup memory instead
  of 24), q and k kept in registers;
- ``shuffle-scan cumsum``: the in-chunk cumulative sum as a shuffle scan within each
  warp's 8 rows plus the totals of the warps above (2 barriers per tile before the factors
  instead of 3, all 256 threads instead of 64 adding serially);
- ``next tile by async copy``: the next tile's q and k copied into a second pair of tile
  buffers by ``ASYNC_COPY16`` (no registers held) and its g loaded into a register while the
  current tile is worked on, with the shuffle-scan cumulative sum (28 KB of threadgroup
  memory);
- ``stores by assignment``, ``beta v per load``, ``before the two fixes``: the kernel as it
  was before its float4 stores went through ``kk_store4`` and before pass 2's right-hand
  side loads were all issued ahead of their use (one fix undone, or both).

Inputs are ``bench_kda``'s recurrence inputs at K3's shape (96 heads x 128); ptxas's
registers per kernel where nvcc is on PATH.

    python3 -m benchmarks.kda_prep_probes --lengths 1024 8192 --out kda_prep_probes.md
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

import mlx.core as mx

from benchmarks.bench_kda import (
    H,
    K,
    emit,
    kernel_backend,
    layer,
    median_time,
    mixer_inputs,
    mlx_run,
    recurrence_inputs,
)
from benchmarks.profile_kernels import register_count
from kimi_k3.kernels import kda_prefill

# name: (first line of the cut, first line kept after it, what goes in its place)
CUTS = {
    "no solve": (
        "#pragma unroll\n    for (int i = 1; i < C; ++i) {",
        "#pragma unroll\n    for (int i = 0; i < C; ++i) out[i * K + d] = x[i];",
        "",
    ),
    "no scores": (
        "#pragma unroll\n      for (int m = 0; m < 4; ++m) {\n        if (m <= I) {",
        "      BARRIER();\n    }\n  }\n\n  // Aqk (lower",
        "",
    ),
    "no sub-block loop": (
        "#pragma unroll\n    for (int I = 0; I < 4; ++I) {\n      const int r0 = I * 16;",
        "  }\n\n  // Aqk (lower",
        "    BARRIER();\n",
    ),
    "no cumsum": (
        "    // Cumulative sum down the rows",
        "    {\n      const float4 G = sm4[OG + row * RQ + dq];",
        "",
    ),
    "no pass-1 stores": (
        "      kk_store4(Qd + o",
        "    }\n\n#pragma unroll\n    for (int I = 0; I < 4; ++I) {",
        "",
    ),
    "no pass 2": ("  // Pass 2: solve", None, ""),  # to the end of the body
}


_GRID_OLD = "  const uint n = GROUP_POS.x % N;\n  const uint bh = GROUP_POS.x / N;\n"
_GRID_NEW = (
    "  const uint nbh = NUM_GROUPS.x / N;               // batch x heads\n"
    "  const uint n = GROUP_POS.x / nbh;\n"
    "  const uint bh = GROUP_POS.x % nbh;\n"
)
_LOAD_OLD = """  for (int d0 = 0; d0 < K; d0 += DT) {
    {
      const size_t src = in0 + row * tok + d0 + 4 * dq;
      const bool ok = (int)row < rows;
      sm4[OQ + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(q + src) : kk_zero4();
      sm4[OK + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(k + src) : kk_zero4();
      sm4[OG + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(g + src) : kk_zero4();
    }
    BARRIER();
"""
_LOAD_NEW = """  const size_t src = in0 + row * tok + 4 * dq;
  const bool ok = (int)row < rows;
  float4 pq = ok ? *reinterpret_cast<const DEVICE float4*>(q + src) : kk_zero4();
  float4 pk = ok ? *reinterpret_cast<const DEVICE float4*>(k + src) : kk_zero4();
  float4 pg = ok ? *reinterpret_cast<const DEVICE float4*>(g + src) : kk_zero4();
  for (int d0 = 0; d0 < K; d0 += DT) {
    // the previous tile's last reads of these regions were before its last barrier
    sm4[OQ + row * RQ + dq] = pq;
    sm4[OK + row * RQ + dq] = pk;
    sm4[OG + row * RQ + dq] = pg;
    if (ok && d0 + DT < K) {
      pq = *reinterpret_cast<const DEVICE float4*>(q + src + d0 + DT);
      pk = *reinterpret_cast<const DEVICE float4*>(k + src + d0 + DT);
      pg = *reinterpret_cast<const DEVICE float4*>(g + src + d0 + DT);
    }
    BARRIER();
"""
# The kernel before two fixes, for a same-run comparison: its float4 stores written as
# assignments through a cast pointer (nvcc made four 4-byte stores of each), and beta v
# multiplied right after each load (so each of the 64 loads waited out its latency).
_STORES_NEW = (
    "      kk_store4(Qd + o, kk_mul4(sm4[OQ + row * RQ + dq], eG));\n"
    "      kk_store4(Kd + o, kk_mul4(kv, kk_exp4(kk_sub4(G_last, G))));\n"
    "      kk_store4(Wc + o, kk_scale4(s_beta[row], kk_mul4(kv, eG)));  // beta exp(G) k: W's RHS\n"
    "      if (t < 4) kk_store4(decay + ch * K + d0 + 4 * t, kk_exp4(G_last));"
)
_F4 = "*reinterpret_cast<DEVICE float4*>"
_STORES_OLD = (
    f"      {_F4}(Qd + o) = kk_mul4(sm4[OQ + row * RQ + dq], eG);\n"
    f"      {_F4}(Kd + o) = kk_mul4(kv, kk_exp4(kk_sub4(G_last, G)));\n"
    f"      {_F4}(Wc + o) = kk_scale4(s_beta[row], kk_mul4(kv, eG));\n"
    f"      if (t < 4) {_F4}(decay + ch * K + d0 + 4 * t) = kk_exp4(G_last);"
)
_RHS_NEW = """    if (is_w) {
#pragma unroll
      for (int i = 0; i < C; ++i) x[i] = W_out[i * K + d];
    } else {
#pragma unroll
      for (int i = 0; i < C; ++i) x[i] = i < rows ? v[in0 + i * tok + d] : 0.0f;
#pragma unroll
      for (int i = 0; i < C; ++i) x[i] *= s_beta[i];
    }
"""
_RHS_OLD = """#pragma unroll
    for (int i = 0; i < C; ++i) {
      x[i] = is_w ? W_out[i * K + d] : (i < rows ? s_beta[i] * v[in0 + i * tok + d] : 0.0f);
    }
"""
# Landmarks of the kernel's pass 1 that the variants below cut between.
_LAYOUT = "  // sm4 regions, in float4. Pass 1: q, k, G tiles;"  # to the s_beta declaration
_LAYOUT_END = "  SHARED float s_beta[C];"
_TILE_LOOP = "  for (int d0 = 0; d0 < K; d0 += DT) {\n    {\n      const size_t src"
_CUMSUM = "    // Cumulative sum down the rows"
_STORES = "    {\n      const float4 G = sm4[OG + row * RQ + dq];"
_PASS1_END = "  // Aqk (lower, with the diagonal) out;"

# The in-chunk cumulative sum of g as a shuffle scan: each thread holds its float4 of g in
# Gv, scans it down its warp's 8 rows (3 shuffle steps) and adds the totals of the warps
# above (one barrier between); needs lane, warp and rl (the thread's row in its warp).
_SHUFFLE_SCAN = """\
#pragma unroll
    for (uint d = 1; d < 8; d *= 2) {
      const uint from = rl >= d ? lane - 4 * d : lane;
      const float4 up = FLOAT4(SIMD_SHUFFLE(Gv.x, from), SIMD_SHUFFLE(Gv.y, from),
                               SIMD_SHUFFLE(Gv.z, from), SIMD_SHUFFLE(Gv.w, from));
      if (rl >= d) Gv = kk_add4(Gv, up);
    }
    if (rl == 7) sm4[OSEG + 4 * warp + dq] = Gv;  // the warp's totals
    BARRIER();
    for (uint w2 = 0; w2 < warp; ++w2) Gv = kk_add4(Gv, sm4[OSEG + 4 * w2 + dq]);
"""
_SCAN_LANES = """\
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const uint rl = lane / 4;  // the thread's row within its warp's 8 rows
"""

# Pass 1 with every sub-block's exponential factors computed at once (4 barriers per tile
# instead of 11; the session before's commit 0e942fa without its next-tile register loads,
# which took the kernel past 128 registers on the H200): q and k stay in the registers of the
# thread that loaded them, and the right factors of sub-block I for rows up to its end sit at
# ORK + RKOFF(I) rows (16 + 32 + 48 + 64 rows). The cumulative sum is the kernel's.
_FACTORS_LAYOUT = """\
  // sm4 regions, in float4. Pass 1: the G tile; left factors of q and k (each row against
  // its sub-block's first row); right factors of k against each sub-block I's first row,
  // for the rows up to that sub-block's end (from ORK + RKOFF(I) * RQ); scan partials.
  // Pass 2: L, one row of 16 float4 per chunk row (zero on and above the diagonal).
  constexpr int OG = 0, OLQ = C * RQ, OLK = 2 * C * RQ, ORK = 3 * C * RQ;
  constexpr int OSEG = ORK + 160 * RQ, OL = 0;
#define RKOFF(I) (8 * (I) * ((I) + 1))
  SHARED float4 sm4[OSEG + 64];
"""
_FACTORS_LOADS = """\
  const uint r0 = row / 16 * 16;  // the first row of its sub-block
  const size_t src = in0 + row * tok + 4 * dq;
  const bool ok = (int)row < rows;
  for (int d0 = 0; d0 < K; d0 += DT) {
    // (the previous tile's dot products read only the factor regions)
    const float4 qv = ok ? *reinterpret_cast<const DEVICE float4*>(q + src + d0) : kk_zero4();
    const float4 kv = ok ? *reinterpret_cast<const DEVICE float4*>(k + src + d0) : kk_zero4();
    sm4[OG + row * RQ + dq] =
        ok ? *reinterpret_cast<const DEVICE float4*>(g + src + d0) : kk_zero4();
    BARRIER();
"""
_FACTORS_REST = """\
    {
      const float4 G = sm4[OG + row * RQ + dq];
      const float4 G_last = sm4[OG + (C - 1) * RQ + dq];
      const float4 eG = kk_exp4(G);
      const size_t o = ch * C * K + row * K + d0 + 4 * dq;
      kk_store4(Qd + o, kk_mul4(qv, eG));
      kk_store4(Kd + o, kk_mul4(kv, kk_exp4(kk_sub4(G_last, G))));
      kk_store4(Wc + o, kk_scale4(s_beta[row], kk_mul4(kv, eG)));  // beta exp(G) k: W's RHS
      if (t < 4) kk_store4(decay + ch * K + d0 + 4 * t, kk_exp4(G_last));
      const float4 f = kk_exp4(kk_sub4(G, sm4[OG + r0 * RQ + dq]));
      sm4[OLQ + row * RQ + dq] = kk_mul4(qv, f);
      sm4[OLK + row * RQ + dq] = kk_mul4(kv, f);
      for (uint I = r0 / 16; I < 4; ++I) {
        const float4 fr = kk_exp4(kk_sub4(sm4[OG + 16 * I * RQ + dq], G));
        sm4[ORK + (RKOFF(I) + row) * RQ + dq] = kk_mul4(kv, fr);
      }
    }
    BARRIER();
#pragma unroll
    for (int I = 0; I < 4; ++I) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        if (m <= I) {
          const uint i = OLQ + (16 * I + ii) * RQ;
          const uint j = ORK + (RKOFF(I) + m * 16 + jj) * RQ;
          float aq = 0.0f, ak = 0.0f;
#pragma unroll
          for (int c = 0; c < DT / 4; ++c) {
            const float4 rk = sm4[j + c];
            aq += kk_dot4(sm4[i + c], rk);
            ak += kk_dot4(sm4[i + C * RQ + c], rk);
          }
          accq[I * 4 + m] += aq;
          acck[I * 4 + m] += ak;
        }
      }
    }
  }
#undef RKOFF
  BARRIER();  // the factor regions are read until here; L overwrites them

"""

# The cumulative sum as a shuffle scan (2 barriers per tile before the factors instead of
# 3, every thread working instead of 64 threads adding serially). A different order of
# additions, so not bitwise the kernel's G (tests compare with a tolerance).
_SCAN_LOOP = (
    _SCAN_LANES
    + """\
  for (int d0 = 0; d0 < K; d0 += DT) {
    float4 Gv;
    {
      const size_t src = in0 + row * tok + d0 + 4 * dq;
      const bool ok = (int)row < rows;
      sm4[OQ + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(q + src) : kk_zero4();
      sm4[OK + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(k + src) : kk_zero4();
      Gv = ok ? *reinterpret_cast<const DEVICE float4*>(g + src) : kk_zero4();
    }
"""
    + _SHUFFLE_SCAN
    + """\
    sm4[OG + row * RQ + dq] = Gv;
    BARRIER();
"""
)

# Pass 1 with the next tile's q and k arriving by asynchronous copies (ASYNC_COPY16) into a
# second pair of tile buffers while the current tile is worked on, and its g loaded into a
# register (4 registers, not the 12 of "next tile in registers"); the shuffle-scan cumulative
# sum. The q, k and G tiles are unpadded (their reads are one row per 4 threads, no bank
# conflicts), so the kernel's reads of them switch to rows of R4 float4 (_TILE_STRIDE);
# 28 KB of threadgroup memory. The rest of the tile loop is the kernel's.
_ASYNC_LAYOUT = """\
  // sm4 regions, in float4. Pass 1: two q tiles and two k tiles (rows of 4 float4; the next
  // tile's arrive while this one is worked on), the G tile, left factors of a sub-block,
  // right factors (padded rows), the warps' scan totals. Pass 2: L, one row of 16 float4 per
  // chunk row (zero on and above the diagonal).
  constexpr int R4 = DT / 4;        // float4 per unpadded tile row
  constexpr int OG = 1024, OLQ = OG + C * R4, OLK = OLQ + 16 * RQ;
  constexpr int ORK = OLK + 16 * RQ, OSEG = ORK + C * RQ, OL = 0;
  SHARED float4 sm4[OSEG + 32];
"""
_ASYNC_HEAD = (
    _SCAN_LANES
    + """\
  const bool ok = (int)row < rows;
  const size_t src = in0 + (ok ? row : 0) * tok + 4 * dq;   // a readable row where !ok
  ASYNC_COPY16(sm4[row * R4 + dq], reinterpret_cast<const DEVICE float4*>(q + src), ok);
  ASYNC_COPY16(sm4[256 + row * R4 + dq], reinterpret_cast<const DEVICE float4*>(k + src), ok);
  ASYNC_COMMIT();
  float4 gn = ok ? *reinterpret_cast<const DEVICE float4*>(g + src) : kk_zero4();

  for (int d0 = 0; d0 < K; d0 += DT) {
    const int OQ = ((d0 / DT) & 1) * 512, OK = OQ + 256;
    float4 Gv = gn;
    if (d0 + DT < K) {
      // the other buffers were last read before the previous tile's last barrier
      const int NQ = 512 - OQ;
      ASYNC_COPY16(sm4[NQ + row * R4 + dq],
                   reinterpret_cast<const DEVICE float4*>(q + src + d0 + DT), ok);
      ASYNC_COPY16(sm4[NQ + 256 + row * R4 + dq],
                   reinterpret_cast<const DEVICE float4*>(k + src + d0 + DT), ok);
      gn = ok ? *reinterpret_cast<const DEVICE float4*>(g + src + d0 + DT) : kk_zero4();
    }
    ASYNC_COMMIT();  // (empty on the last tile, so the wait below is the same every tile)
"""
    + _SHUFFLE_SCAN
    + """\
    sm4[OG + row * R4 + dq] = Gv;
    ASYNC_WAIT(1);  // this tile's q and k have landed (the next tile's may be in flight)
    BARRIER();
"""
)
_TILE_STRIDE = (
    re.compile(r"sm4\[(OQ|OK|OG) \+ ([^\]]*?) \* RQ \+ dq\]"),
    r"sm4[\1 + \2 * R4 + dq]",
)

# name: the rewrites of the kernel's body that make it (see ``rewrite``)
VARIANTS = {
    "chunk-major grid": [(_GRID_OLD, _GRID_NEW)],
    "next tile in registers": [(_LOAD_OLD, _LOAD_NEW)],
    "stores by assignment": [(_STORES_NEW, _STORES_OLD)],
    "beta v per load": [(_RHS_NEW, _RHS_OLD)],
    "before the two fixes": [(_STORES_NEW, _STORES_OLD), (_RHS_NEW, _RHS_OLD)],
    "factors at once": [
        (_LAYOUT, _LAYOUT_END, _FACTORS_LAYOUT),
        (_TILE_LOOP, _CUMSUM, _FACTORS_LOADS),
        (_STORES, _PASS1_END, _FACTORS_REST),
    ],
    "shuffle-scan cumsum": [(_TILE_LOOP, _STORES, _SCAN_LOOP)],
    "next tile by async copy": [
        (_LAYOUT, _LAYOUT_END, _ASYNC_LAYOUT),
        (_TILE_LOOP, _STORES, _ASYNC_HEAD),
        _TILE_STRIDE,
    ],
}
# variants that add in a different order: equal to the kernel within a tolerance, not bitwise
REORDERED = {"shuffle-scan cumsum", "next tile by async copy"}


def rewrite(kernel, rewrites, label: str, what: str):
    """``kernel`` renamed ``label`` with its body rewritten: each rewrite is (old, new), the
    one occurrence of ``old`` replaced; (start, end, fill), [start, end) replaced by
    ``fill`` (``end`` None: to the end); or (regex, repl), every match replaced (at least
    one). ``what`` names the rewrite in the error when the kernel no longer matches."""
    body = kernel.body
    for rw in rewrites:
        if len(rw) == 3:
            start, end, fill = rw
            assert body.count(start) == 1, f"{what}: the kernel changed"
            assert end is None or body.count(end) == 1, f"{what}: the kernel changed"
            a = body.index(start)
            b = len(body) if end is None else body.index(end)
            assert a < b, what
            body = body[:a] + fill + body[b:]
        elif isinstance(rw[0], re.Pattern):
            body, n = rw[0].subn(rw[1], body)
            assert n, f"{what}: the kernel changed"
        else:
            old, new = rw
            assert body.count(old) == 1, f"{what}: the kernel changed"
            body = body.replace(old, new)
    return replace(kernel, name=label, body=body, _built={})


def _label(prefix: str, name: str) -> str:
    return prefix + name.replace(" ", "_").replace("-", "_")


def variant(name: str):
    """``kda_chunk_prep`` rewritten as ``VARIANTS[name]``."""
    return rewrite(
        kda_prefill.KDA_CHUNK_PREP, VARIANTS[name], _label("kda_chunk_prep_var_", name), name
    )


# kda_pre as it was before its token loads went one token ahead: (start, end, what was
# there) of each region that changed.
PRE_BEFORE = [
    (
        "    // A token's inputs are loaded during the token before it",
        "        float aq = 0.0f, ak = 0.0f, av = 0.0f;",
        """    for (int t = ta; t < tb; ++t) {
      const size_t row = xb + (size_t)t * P;
      float yq[CL], yk[CL];
      float sq = 0.0f, sk = 0.0f;
      for (int i = 0; i < CL; ++i) {
        const uint c = h * K + LANE + 32 * i;
        wq[i][W - 1] = static_cast<float>(x_q[row + c]);
        wk[i][W - 1] = static_cast<float>(x_k[row + c]);
        wv[i][W - 1] = static_cast<float>(x_v[row + c]);
""",
    ),
    (
        "        const float z = a_h * (gr[i] + dtb[i]);",
        "\n        g[row + c] = lb",
        "        const float z = a_h * (static_cast<float>(g_raw[row + c]) + dtb[i]);",
    ),
    (
        "        beta[bi] = 1.0f / (1.0f + EXP(-bl));",
        None,
        "        beta[bi] = 1.0f / (1.0f + EXP(-static_cast<float>(b_logits[bi])));\n"
        "      }\n    }\n  }\n",
    ),
]


def pre_before():
    """``kda_pre`` with its token loads back in the token they serve."""
    return rewrite(kda_prefill.KDA_PRE, PRE_BEFORE, "kda_pre_before", "kda_pre before")


def probe(name: str):
    """``kda_chunk_prep`` with the part ``name`` of ``CUTS`` cut out."""
    return rewrite(
        kda_prefill.KDA_CHUNK_PREP, [CUTS[name]], _label("kda_chunk_prep_cut_", name), name
    )


def kernels():
    return (
        [("kda_chunk_prep", kda_prefill.KDA_CHUNK_PREP)]
        + [(f"probe: {name}", probe(name)) for name in CUTS]
        + [(f"variant: {name}", variant(name)) for name in VARIANTS]
    )


# kda_post with gate and o_norm loaded beside o, before the row's sum: in the kernel they are
# loaded in the output loop, each after the previous column's store (which may alias them
# as far as the compiler knows), so a row waits out the memory latency five times.
POST_EARLY = [
    (
        "    float x[CL];\n    float ss = 0.0f;\n    for (int i = 0; i < CL; ++i) {\n"
        "      x[i] = o[base + LANE + 32 * i];\n",
        "    float x[CL], gt[CL], on[CL];\n    float ss = 0.0f;\n"
        "    for (int i = 0; i < CL; ++i) {\n"
        "      x[i] = o[base + LANE + 32 * i];\n"
        "      gt[i] = static_cast<float>(gate[base + LANE + 32 * i]);\n"
        "      on[i] = o_norm[LANE + 32 * i];\n",
    ),
    (
        "      const float gt = static_cast<float>(gate[base + d]);\n"
        "      y[base + d] = static_cast<T>(x[i] * rs * o_norm[d] / (1.0f + EXP(-gt)));",
        "      y[base + d] = static_cast<T>(x[i] * rs * on[i] / (1.0f + EXP(-gt[i])));",
    ),
]


def post_early():
    """``kda_post`` with its gate and o_norm loads issued beside o's."""
    return rewrite(kda_prefill.KDA_POST, POST_EARLY, "kda_post_early", "kda_post early")


def pre_kernels():
    return [
        ("kda_pre", kda_prefill.KDA_PRE),
        ("kda_pre before (loads in their token)", pre_before()),
    ]


def post_kernels():
    return [("kda_post", kda_prefill.KDA_POST), ("kda_post, gate loaded with o", post_early())]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", nargs="+", help="time only these kernels (names as listed)")
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args(argv)
    backend = kernel_backend()
    mx.random.seed(0)
    every = kernels() + pre_kernels() + post_kernels()
    chosen = [(n, k) for n, k in every if not args.only or n in args.only]
    if args.only and len(chosen) != len(args.only):
        parser.error(f"--only: unknown names among {args.only}; known: {[n for n, _ in every]}")
    regs = {name: register_count(k) for name, k in chosen}
    kinds = {n: "pre" for n, _ in pre_kernels()} | {n: "post" for n, _ in post_kernels()}
    p = layer()
    lines = ["| T | kernel | time (us) | / kernel | registers |", "|---:|---|---:|---:|---:|"]
    for T in args.lengths:
        r = recurrence_inputs(T)
        xs = mixer_inputs(T)
        o = mx.random.normal((1, T, H, K))  # kda_post's input: the recurrence's output
        mx.eval(r, xs, o)
        base = {}
        for name, k in chosen:
            kind = kinds.get(name, "prep")

            def run(k=k, r=r, xs=xs, o=o, kind=kind):
                if kind == "pre":
                    return kda_prefill.pre(backend, p, *xs[:5], xs[6], kernel=k)
                if kind == "post":
                    return kda_prefill.post(backend, p, o, xs[5], kernel=k)
                return kda_prefill.chunk_prep(backend, *r[:5], kernel=k)

            us = median_time(mlx_run(run), args.repeats) * 1e6
            first = base.setdefault(kind, us)
            ratio = f"{us / first:.2f}x" if us != first else ""
            lines.append(f"| {T} | {name} | {us:,.1f} | {ratio} | {regs[name]} |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
