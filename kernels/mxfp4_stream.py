"""MXFP4 expert decode streamed through a deep ring in threadgroup memory (CUDA, sm_90).

Same contract and launches as ``mxfp4_mma`` (gate/up + SiTU-GLU, down weighted by the routing
weight, then the ordered sum ``sum_pairs``), the same tensor-core body (``mma_block``), and a
different way of getting the weights to it. The register kernels hold their loads in
registers: at 128 registers a thread two 256-thread threadgroups fit an SM, and their bytes
in flight were taken to be what limits them (session 23's read limit, corrected in session
24: docs/benchmarks.md, "a streamed ring, and the read limit corrected"). Here the bytes in
flight live in threadgroup memory instead, and many more of them:

* **Persistent threadgroups.** ``NUM_GROUPS.x`` threadgroups (one per SM: ``ctas``) split the
  projection's units evenly; a unit is 16 rows of gate and the same 16 of up (gate/up) or 32
  rows of down (as in ``mxfp4_mma``), every scale group of them. Threadgroup b takes units
  ``[U b / n, U (b + 1) / n)``, pair-major, so no SM waits on a second wave.
* **A ring of S whole units.** A unit's 32 rows of code words (``G`` 16-byte chunks each)
  and its two tiles' scale bytes (16 rows x G bytes each, contiguous in MLX's layout) are
  one ring stage (rows land at a stride of ``RS`` chunks, ``RS`` = 4 mod 8, so the MMA's rows
  g and g + 1 read opposite halves of the banks). ``FILL`` of the 32 rows come by the copy
  engine, one ``BULK_COPY`` of a whole row per lane of warp 0 (and the scales as two more
  where ``FILL`` is 32); the rest by 16-byte ``ASYNC_COPY16``s from every thread. All are
  counted on the stage's barrier (``MBAR_EXPECT``, ``MBAR_ASYNC_ARRIVE``). At K3's size a
  stage is 63 KB (gate/up) or 54 KB (down); three stages keep two units (about 120 KB) in
  flight per SM. The ring is dynamic shared memory on CUDA (``Kernel.shared_memory``, over
  the 48 KB of static arrays); Metal and the emulator declare it as a threadgroup array
  (32 KB there, so only small shapes run on them).
* **Split of a unit over the warps.** Warp w takes 4-group blocks ``[NBK w / NW, NBK (w + 1)
  / NW)`` of every row of the unit, with ``mxfp4_mma``'s fragment layout and decode; the
  warps' partial sums meet in threadgroup memory (``red``, two buffers), and after the one
  barrier per unit the stage just read is refilled with the unit S ahead. Results repeat
  to the bit (no atomics; the sums over warps are in a fixed order).
* The activations' B fragments are staged as in ``mxfp4_mma`` (``staging``), again only
  when a unit's row of activations differs from the one staged (for one token, gate/up
  stages its latent once per threadgroup).

``MATH = false`` (``expert_glu_decode(..., math=False)``, a benchmark probe) keeps the ring
and the barriers and drops the products: what the copy engine and this ring alone stream.
"""

from __future__ import annotations

import mlx.core as mx

from .mxfp4_decode import K3, sum_pairs
from .mxfp4_mma import (
    F32,
    I32,
    LANES,
    MMA_HEADER,
    U8,
    U32,
    _proj,
    byte_permute_decode,
    mma_block,
    projection_template,
    staging,
)
from .source import Instance, Kernel, constant
from .source import backend as default_backend

HEADER = (
    MMA_HEADER
    + """
// Word i (0-3, known at run time) of a uint4, by selects.
HELPER uint kk_word_at(uint4 v, uint i) {
  const uint lo = (i & 1u) ? v.y : v.x;
  const uint hi = (i & 1u) ? v.w : v.z;
  return (i & 2u) ? hi : lo;
}
"""
)

BODY = """
  constexpr int G = KD / 32;                      // scale groups (16-byte chunks) per row
  constexpr int NBK = G / 4;                      // 4-group blocks per row
  constexpr int RS = G + (12 - G % 8) % 8;        // ring row stride in chunks (= 4 mod 8)
  constexpr int TR = GLU ? NR / 16 : NR / 32;     // units per pair
  constexpr int CODES = 32 * RS;                  // a stage's code chunks (32 rows)
  constexpr int STAGE = CODES + 2 * G;            // ... and its scale chunks (2 x 16 rows x G)
  constexpr uint TBYTES = FILL * G * 16u + (FILL == 32 ? 2u * 16u * G : 0u);  // bulk bytes
  constexpr uint ACH = FILL == 32 ? 0u : (32 - FILL) * G + 2 * G;  // async 16-byte chunks
  constexpr int U = P * TR;                       // units
  SHARED_DYNAMIC(uint4, ring, S * STAGE);        // dynamic on CUDA (Kernel.shared_memory)
  SHARED uint4 frag[G * 8];
  SHARED float red[2 * NW * 32];
  SHARED float s_max[NW];
  SHARED MBAR_T bars[S];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const uint g = lane / 4;
  const uint tq = lane % 4;
  const bool bcol = g / 2 == tq;                  // this lane's B column is in its group
  const uint nt = NUM_GROUPS.x;
  const uint u0 = uint((U * GROUP_POS.x) / nt);
  const uint u1 = uint((U * (GROUP_POS.x + 1)) / nt);
  const uint kb0 = warp * NBK / NW;               // this warp's 4-group blocks of a row
  const uint kb1 = (warp + 1) * NBK / NW;

  // Unit u into stage st (every thread calls it). Rows 0 .. FILL - 1 of the unit (tile A's
  // rows 0-15, then tile B's as rows 16-31) come by bulk copies, one row per lane of warp 0,
  // with the scales too where FILL is 32; the other rows and the scales come by 16-byte
  // asynchronous copies spread over all threads (consecutive threads, consecutive chunks of a
  // row), each thread's counted on the stage's barrier once they land.
#define KS_ISSUE(u, st)                                                                   \\
  {                                                                                       \\
    const uint p_ = (u) / TR;                                                             \\
    const size_t r_ = (size_t)inds[p_] * NR + (GLU ? 16 : 32) * ((u) % TR);              \\
    const size_t rb_ = GLU ? r_ : r_ + 16;                                                \\
    const uint base_ = (st) * STAGE;                                                      \\
    if (FILL > 0 && warp == 0) {                                                          \\
      if (lane == 0) MBAR_EXPECT(&bars[st], TBYTES);                                      \\
      SIMD_BARRIER();                                                                     \\
      if (lane < uint(FILL)) {                                                            \\
        const DEVICE uint4* src_ = lane < 16                                              \\
            ? (const DEVICE uint4*)w_a + (r_ + lane) * G                                  \\
            : (const DEVICE uint4*)w_b + (rb_ + lane - 16) * G;                           \\
        BULK_COPY(&ring[base_ + lane * RS], src_, uint(G * 16), &bars[st]);               \\
      }                                                                                   \\
      if (FILL == 32 && lane == 0)                                                        \\
        BULK_COPY(&ring[base_ + CODES], (const DEVICE uint4*)(s_a + r_ * G),             \\
                  uint(16 * G), &bars[st]);                                               \\
      if (FILL == 32 && lane == 1)                                                        \\
        BULK_COPY(&ring[base_ + CODES + G], (const DEVICE uint4*)(s_b + rb_ * G),        \\
                  uint(16 * G), &bars[st]);                                               \\
    }                                                                                     \\
    if (FILL < 32) {                                                                      \\
      for (uint c_ = tid; c_ < ACH; c_ += NW * 32) {                                      \\
        if (c_ < (32 - FILL) * G) {                                                       \\
          const uint row_ = FILL + c_ / G, col_ = c_ % G;                                 \\
          const DEVICE uint4* src_ = row_ < 16                                            \\
              ? (const DEVICE uint4*)w_a + (r_ + row_) * G + col_                         \\
              : (const DEVICE uint4*)w_b + (rb_ + row_ - 16) * G + col_;                  \\
          ASYNC_COPY16(ring[base_ + row_ * RS + col_], src_, true);                       \\
        } else {                                                                          \\
          const uint c2_ = c_ - (32 - FILL) * G;                                          \\
          const DEVICE uint4* src_ = c2_ < uint(G)                                        \\
              ? (const DEVICE uint4*)(s_a + r_ * G) + c2_                                 \\
              : (const DEVICE uint4*)(s_b + rb_ * G) + (c2_ - G);                         \\
          ASYNC_COPY16(ring[base_ + CODES + c2_], src_, true);                            \\
        }                                                                                 \\
      }                                                                                   \\
      MBAR_ASYNC_ARRIVE(&bars[st]);                                                       \\
    }                                                                                     \\
  }
  // The scale byte of row r (0-31) and group 4 kb + tq from stage base sb (the word picked
  // by selects, not branches).
#define KS_SCALE(sb, r, kb) ((kk_word_at(ring[(sb) + ((r) * G + 4 * (kb)) / 16],          \\
                                         (((r) * G + 4 * (kb)) / 4) % 4) >> (8 * tq)) & 255u)

  if (tid == 0) {
    // one arrival with the bulk copies' bytes, one per thread for its asynchronous copies
    for (int s = 0; s < S; ++s) MBAR_INIT(&bars[s], (FILL > 0 ? 1 : 0) + (FILL < 32 ? NW * 32 : 0));
  }
  BARRIER();
  for (uint s = 0; s < uint(S) && u0 + s < u1; ++s) KS_ISSUE(u0 + s, s);
"""

BODY += (
    LANES
    + """
  uint staged = 0xffffffffu;                      // the activation row in frag
  float unscale_u = 0.0f;
  for (uint u = u0; u < u1; ++u) {
    const uint i = u - u0;
    const uint p = u / TR;
    const uint xrow = GLU ? p / K : p;
    if (xrow != staged) {
      const DEVICE T* xr = x + (size_t)xrow * KD;
"""
    + staging("frag", "KD", "xr", "s_max")
    + """      unscale_u = unscale;
      staged = xrow;
      BARRIER();
    }
    const uint st = i % S;
    MBAR_WAIT(&bars[st], (i / S) & 1u);
    float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;  // A row g, g+8; B row g, g+8
    if (MATH) {
      const uint sb = st * STAGE + CODES;
      _Pragma("unroll 2") for (uint kb = kb0; kb < kb1; ++kb) {
        const uint cc = st * STAGE + 4 * kb + tq;
        const uint4 wa0 = ring[cc + g * RS], wa8 = ring[cc + (g + 8) * RS];
        const uint4 wb0 = ring[cc + (16 + g) * RS], wb8 = ring[cc + (24 + g) * RS];
        const uint ea0 = KS_SCALE(sb, g, kb), ea8 = KS_SCALE(sb, g + 8, kb);
        const uint eb0 = KS_SCALE(sb, 16 + g, kb), eb8 = KS_SCALE(sb, 24 + g, kb);
"""
    + mma_block("frag[kb * 32 + pq * 8 + g]", ("ea0", "ea8", "eb0", "eb8"), "", "        ")
    + """      }
      KK_LANES();
    }
    const uint rd = (i % 2) * (NW * 32);          // partial sums: two buffers in turn
    if (tq == 0) {
      red[rd + warp * 32 + g] = acc0;
      red[rd + warp * 32 + 8 + g] = acc1;
      red[rd + warp * 32 + 16 + g] = acc2;
      red[rd + warp * 32 + 24 + g] = acc3;
    }
    BARRIER();                                    // stage st and frag read by every warp
    if (u + S < u1) KS_ISSUE(u + S, st);
    // Entry e of the unit's 32 sums: tile A rows 0-15, then tile B rows 0-15.
    const uint t = u % TR;
    if (tid < 32) {
      float tot = 0.0f;
      for (int w = 0; w < NW; ++w) tot += red[rd + w * 32 + tid];
      if (GLU) {
        float upv = 0.0f;
        for (int w = 0; w < NW; ++w) upv += red[rd + w * 32 + 16 + (tid % 16)];
        if (tid < 16)
          out[(size_t)p * NR + 16 * t + tid] =
              kk_situ_glu(tot * unscale_u, upv * unscale_u, params[0], params[1]);
      } else {
        out[(size_t)p * NR + 32 * t + tid] = params[p] * (tot * unscale_u);
      }
    }
  }
#undef KS_ISSUE
#undef KS_SCALE
#undef KK_LANES
"""
)

# (warps per threadgroup, ring stages, rows of a unit's 32 brought by bulk copies) per
# projection; the other rows and (below 32) the scales come by 16-byte asynchronous copies.
LAUNCH = {"gate_up": (8, 3, 32), "down": (8, 3, 32)}
FILLS = (0, 16, 32)
# Persistent threadgroups: one per SM. No MLX call reports the SM count; 132 is the H200's
# (and the H100 SXM's). A different count only changes how evenly the units spread.
CTAS = 132
# Threadgroup memory a threadgroup may hold: sm_90's 227 KB (static arrays plus the dynamic
# ring); Metal's and the emulator's 32 KB.
SHARED_LIMIT = {"cuda": 227 * 1024, "metal": 32 * 1024, "emulator": 32 * 1024}


def row_stride(G: int) -> int:
    """Ring row stride in 16-byte chunks: at least G, and 4 mod 8."""
    return G + (12 - G % 8) % 8


def ring_bytes(KD: int, s: int) -> int:
    """The ring of s stages (codes of 32 rows at ``row_stride`` plus two tiles' scales)."""
    G = KD // 32
    return s * (32 * row_stride(G) + 2 * G) * 16


def shared_bytes(KD: int, nw: int, s: int) -> int:
    """All threadgroup memory of a launch: ring, fragments, partial sums, maxima, barriers."""
    return ring_bytes(KD, s) + 4 * KD + 2 * nw * 32 * 4 + nw * 4 + 8 * s


def fit(backend, KD, launch) -> tuple:
    """``launch`` (warps, stages, bulk rows) with fewer stages (at least 2) where the
    threadgroup memory would pass the backend's; a shape that does not fit at 2 stages, or
    bulk rows other than 0, 16 or 32, are refused."""
    nw, s, fill = launch
    if fill not in FILLS:
        raise ValueError(f"mxfp4_stream: {fill} rows by bulk copies; one of {FILLS}")
    limit = SHARED_LIMIT.get(backend, 32 * 1024)
    while shared_bytes(KD, nw, s) > limit and s > 2:
        s -= 1
    if shared_bytes(KD, nw, s) > limit:
        raise ValueError(
            f"mxfp4_stream: rows of {KD} need {shared_bytes(KD, nw, s)} bytes of threadgroup "
            f"memory at 2 stages, over {backend}'s {limit}"
        )
    return nw, s, fill


def template(dtype, KD, NR, K, glu, P, nw, s, fill, math=True):
    return projection_template(dtype, KD, NR, K, glu) + [
        ("P", P),
        ("NW", nw),
        ("S", s),
        ("FILL", fill),
        ("MATH", math),
    ]


def _instances() -> list:
    """gate/up (bf16 latent) and down at K3's size, 16 pairs, the default launches."""
    gu = LAUNCH["gate_up"]
    dn = LAUNCH["down"]
    return [
        Instance(
            [mx.bfloat16, U32, U8, U32, U8, I32, F32],
            [F32],
            template(mx.bfloat16, K3["D"], K3["I"], 16, True, 16, *gu),
        ),
        Instance(
            [F32, U32, U8, U32, U8, I32, F32],
            [F32],
            template(F32, K3["I"], K3["D"], 16, False, 16, *dn),
        ),
    ]


INPUTS = ["x", "w_a", "s_a", "w_b", "s_b", "inds", "params"]
MXFP4_STREAM = byte_permute_decode(
    Kernel("mxfp4_stream", INPUTS, ["out"], BODY, header=HEADER, instances=_instances())
)


def kernel_for(backend: str, KD: int, s: int) -> Kernel:
    """The kernel with its ring as dynamic shared memory on CUDA (sized for KD and s)."""
    if backend != "cuda":
        return MXFP4_STREAM
    return MXFP4_STREAM.variant(f"_ring{ring_bytes(KD, s)}", shared_memory=ring_bytes(KD, s))


def project(
    backend, x, wa, sa, wb, sb, inds, params, KD, NR, k, glu, launch=None, ctas=None, math=True
):
    """One projection for every (token, choice) pair in ``inds`` (flat int32)."""
    nw, s, fill = fit(backend, KD, launch or LAUNCH[_proj(glu)])
    pairs = inds.size
    units = pairs * (NR // 16 if glu else NR // 32)
    n = max(1, min(units, ctas or CTAS))
    (out,) = kernel_for(backend, KD, s)(
        backend,
        inputs=[x, wa, sa, wb, sb, inds, params],
        output_shapes=[(pairs, NR)],
        output_dtypes=[F32],
        grid=(32 * nw * n, 1, 1),
        threadgroup=(32 * nw, 1, 1),
        template=template(x.dtype, KD, NR, k, glu, pairs, nw, s, fill, math),
    )
    return out


def expert_glu_decode(
    z, w, inds, weights, beta, cap, backend: str | None = None, launch=None, ctas=None, math=True
):
    """``mxfp4_mma.expert_glu_decode`` through the streamed ring (same shapes and return: fp32
    [N, D]). ``launch``: {"gate_up": (warps, stages, bulk rows), "down": ...} (default
    ``LAUNCH``);
    ``ctas``: persistent threadgroups (default ``CTAS``); ``math=False``: the probe without
    products (wrong results, the ring's own time)."""
    backend = backend or default_backend()
    launch = launch or LAUNCH
    N, k = inds.shape
    D = z.shape[-1]
    I = w["w1"][0].shape[-2]
    flat = inds.reshape(-1).astype(I32)
    h = project(
        backend,
        z,
        *w["w1"],
        *w["w3"],
        flat,
        constant((beta, cap)),
        D,
        I,
        k,
        True,
        launch["gate_up"],
        ctas,
        math,
    )
    wts = weights.reshape(-1).astype(F32)
    part = project(
        backend, h, *w["w2"], *w["w2"], flat, wts, I, D, k, False, launch["down"], ctas, math
    )
    return sum_pairs(backend, part, N, k)
