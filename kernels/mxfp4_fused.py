"""MXFP4 expert decode in one launch per layer (plus a small sum): gate/up, SiTU-GLU and the
down projection of a slice of ``h``, on tensor cores.

``mxfp4_mma`` makes three launches: gate/up writes ``h [pairs, I]``, down reads all of it,
then the k pairs are summed. Down cannot start on a pair before its whole ``h`` exists, so
the two projections are separate grids with a drain, a launch gap and a tail between them.
Here the down projection is split along its inner dimension instead: a threadgroup owns a
slice of ``SL`` rows of I for one pair,

1. computes those ``SL`` entries of ``h`` (gate and up rows, SiTU-GLU) into threadgroup
   memory, with the body of ``mxfp4_mma`` (codes to fp16 in registers, fp16 hi/lo
   activations, four scale groups side by side, two register buffers taking turns);
2. multiplies them by the matching ``SL`` columns of the pair's down matrix (every row of D),
   weighted by the routing weight: a partial ``[D]`` of that pair and slice;

and ``mxfp4_fused_sum`` adds the ``k * I / SL`` partials of each token in a fixed order (no
atomics: results do not depend on scheduling). Every weight byte is still read once per
pair; the partials add ``2 * 4 * D * k * I / SL`` bytes per token (2% of the weights at
``SL = 256``). The first loads of the down phase go out before the threadgroup waits for its
``h`` slice, so the load pipe does not drain between the phases.

Launch (``LAUNCH``): ``SL`` rows of I per threadgroup, ``NW`` warps, scale groups per step in
the gate/up phase (``GW``) and in the down phase (``GW2``; a down row of the slice has
``SL / 32`` groups). Same exactness contract as ``mxfp4_mma`` (fp32 accumulation of exact
products; activations to 22 significant bits, scaled by a power of two per vector: the
latent, then each threadgroup's slice of ``h``).

Two variants of the same two phases: ``expert_glu_decode_bulk`` brings the weights into
per-warp rings in threadgroup memory by bulk copies (the TMA engine, ``BULK_COPY`` and the
``MBAR_*`` barriers), and ``tiled=True`` (both kernels) reads stacks re-laid out by
``tile`` below (16-row tiles of 4-group blocks, 1 KB of codes and 64 scale bytes contiguous
each: ``expert_layout``'s tiles as they were until session 31, when the store's scale bytes
became a word per lane and step, a layout these kernels do not read).

None of these is dispatched. On the H200 (docs/benchmarks.md, "MXFP4: one launch, bulk
copies and a tiled layout") the register kernel matched or beat ``mxfp4_mma`` by up to 9% at
one token and lost 4-18% at eight; the bulk kernel was slower (the copy engine took about
20 cycles per 64-byte copy per SM; tiled, 1.4-1.6x faster but still behind); the tiled
layout gave the register kernel up to 14% within one run. They stay as tested variants for
the 60%-of-HBM goal that the issue leaves open.
"""

from __future__ import annotations

import mlx.core as mx

from .mxfp4_decode import K3
from .mxfp4_mma import LANES, MMA_HEADER, SHARED_LIMIT, STEP_MACRO, mma_block, staging
from .source import Instance, Kernel, constant
from .source import backend as default_backend

U32, U8, F32, I32 = mx.uint32, mx.uint8, mx.float32, mx.int32


# Both fused kernels' shape constants (template values KD, NI, SL), threadgroup arrays and
# roles: the latent's and the slice's B fragments, the slice of h, each warp's maxima; the
# (token, choice) pair and slice of the threadgroup, the lane's (g, tq) in the MMA.
ROLES = """\
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const uint p = GROUP_POS.y;                   // the (token, choice) pair
  const uint js = GROUP_POS.x;                  // the slice of I
  const uint g = lane / 4;
  const uint tq = lane % 4;
  const bool bcol = g / 2 == tq;                // this lane's B column is in its group
  const size_t ex = (size_t)inds[p];
  // Unit m of a warp is unit warp + NW m: its steps, T1 in gate/up, T2 in down (S1, S2 per
  // unit; the whole warp agrees).
  const int T1 = (warp < U1 ? (U1 - 1 - (int)warp) / NW + 1 : 0) * S1;
  const int T2 = (warp < U2 ? (U2 - 1 - (int)warp) / NW + 1 : 0) * S2;
"""
CONSTANTS = """\
  constexpr int G1 = KD / 32;                   // scale groups per gate/up row
  constexpr int G2 = NI / 32;                   // scale groups per down row
  constexpr int GS = SL / 32;                   // down groups in a slice
  constexpr int J = NI / SL;                    // slices per pair
  constexpr int U1 = SL / 16;                   // gate/up units: 16 rows of gate and of up
  constexpr int U2 = KD / 32;                   // down units: 32 rows (two 16-row tiles)
"""
# Both kernels' ends of a unit (after KK_LANES is defined): gate/up unit u's rows g, g + 8
# become h (SiTU-GLU) in threadgroup memory; down unit u's rows g, g + 8, 16 + g, 24 + g go
# to this slice's partial, weighted by the pair's routing weight.
UNIT_ENDS = """\
#define KK_END1(u)                                                                     \\
  {                                                                                    \\
    KK_LANES();                                                                        \\
    if (tq == 0) {                                                                     \\
      const uint row = 16 * (warp + NW * uint(u));                                     \\
      hs[row + g] = kk_situ_glu(acc0 * unscale1, acc2 * unscale1, s_par[0], s_par[1]);   \\
      hs[row + 8 + g] = kk_situ_glu(acc1 * unscale1, acc3 * unscale1, s_par[0], s_par[1]); \\
    }                                                                                  \\
    acc0 = acc2 = 0.0f, acc1 = acc3 = 0.0f;                                            \\
  }
#define KK_END2(u)                                                                     \\
  {                                                                                    \\
    KK_LANES();                                                                        \\
    if (tq == 0) {                                                                     \\
      const float f = s_par[2] * unscale2;                                             \\
      DEVICE float* o = part + ((size_t)p * J + js) * KD + 32 * (warp + NW * uint(u)); \\
      o[g] = f * acc0;                                                                 \\
      o[8 + g] = f * acc1;                                                             \\
      o[16 + g] = f * acc2;                                                            \\
      o[24 + g] = f * acc3;                                                            \\
    }                                                                                  \\
    acc0 = acc1 = acc2 = acc3 = 0.0f;                                                  \\
  }
"""
DECLS = (
    """\
  SHARED uint4 frag1[G1 * 8];
  SHARED uint4 frag2[GS * 8];
  SHARED float hs[SL];
  SHARED float s_max1[NW];
  SHARED float s_max2[NW];
  SHARED float s_par[3];
"""
    + ROLES
)

# The unit ends' parameters (SiTU-GLU's beta and cap, the pair's routing weight) go to
# threadgroup memory s_par before the latent staging's barrier, as in mxfp4_mma (PARAMS):
# read from global memory at every unit end (until session 26), each read waited behind the
# streaming loads in the middle of the pipeline.
PARAMS = """\
  if (tid == 0) {
    s_par[0] = params[0];
    s_par[1] = params[1];
    s_par[2] = wts[p];
  }
"""

BODY = (
    "\n"
    + CONSTANTS
    + """  constexpr int S1 = G1 / GW;                   // steps per gate/up unit
  constexpr int S2 = GS / GW2;                  // steps per down unit
  constexpr int NB = (GW > GW2 ? GW : GW2) / 4; // 4-group blocks a register buffer holds
"""
    + DECLS
    + """
  // A step is GW (GW2) groups of the lane's rows g, g + 8 of both tiles.
  // Plain layout (MLX's): row r's group c at r G + c (16-byte words and scale bytes alike).
  // Tiled (TL, tile()): 16-row tiles of 4-group blocks, 1 KB of codes each, row r of
  // the tile at 64 r bytes; lane (g, tq)'s word of a block is its 16 bytes at 16 lane (scale
  // byte: lane), so a warp load is 512 contiguous bytes.
  constexpr int BS = TL ? 64 : 4;               // words from a 4-group block to the next
  constexpr int RS1 = TL ? 32 : 8 * G1;         // words from row g to row g + 8
  constexpr int RS2 = TL ? 32 : 8 * G2;
  const size_t r1 = TL ? ((ex * NI + (size_t)js * SL) / 16 + warp) * (G1 / 4) * 64 + lane
                       : (ex * NI + (size_t)js * SL + 16 * warp + g) * G1 + tq;
  const DEVICE uint4* q1 = (const DEVICE uint4*)w1 + r1;
  const DEVICE uint4* q3 = (const DEVICE uint4*)w3 + r1;
  const DEVICE uint8_t* e1 = s1 + r1;
  const DEVICE uint8_t* e3 = s3 + r1;
#define KK_OFF1(t) \
  (uint((t) / S1) * (TL ? NW * (G1 / 4) * 64 : 16 * NW * G1) + uint((t) % S1) * (GW / 4) * BS)
#define KK_OFF2(t) \
  (uint((t) / S2) * (TL ? 2 * NW * (G2 / 4) * 64 : 32 * NW * G2) + uint((t) % S2) * (GW2 / 4) * BS)
#define KK_Q(q, i) (CS ? LOAD_STREAM(&(q)[i]) : (q)[i])
  // A step's code words and scale bytes: NBL blocks of rows g, g + 8 of tiles A and B.
#define KK_LOAD(q, sc, qa, qb, ea, eb, RS, off, NBL, LD)                         \\
  {                                                                             \\
    const uint o_ = (off);                                                    \\
    _Pragma("unroll") for (int u = 0; u < NBL; ++u) {                           \\
      q[4 * u] = LD(qa, o_ + BS * u);                                           \\
      q[4 * u + 1] = LD(qa, o_ + (RS) + BS * u);                                \\
      q[4 * u + 2] = LD(qb, o_ + BS * u);                                       \\
      q[4 * u + 3] = LD(qb, o_ + (RS) + BS * u);                                \\
      sc[4 * u] = ea[o_ + BS * u];                                              \\
      sc[4 * u + 1] = ea[o_ + (RS) + BS * u];                                   \\
      sc[4 * u + 2] = eb[o_ + BS * u];                                          \\
      sc[4 * u + 3] = eb[o_ + (RS) + BS * u];                                   \\
    }                                                                           \\
  }
#define KK_PLAIN(q, i) (q)[i]
#define KK_LOAD1(q, sc, t) KK_LOAD(q, sc, q1, q3, e1, e3, RS1, KK_OFF1(t), GW / 4, KK_Q)
#define KK_LOAD2(q, sc, t) \\
  KK_LOAD(q, sc, q2, (q2 + TB2), e2, (e2 + TB2), RS2, KK_OFF2(t), GW2 / 4, KK_PLAIN)
  // KK_STEP (mxfp4_mma.STEP_MACRO): bb is the step's first group within the unit's row (or
  // the slice's first group of a down row).
"""
    + STEP_MACRO
    + LANES
    + UNIT_ENDS
    + """  // The last step of a unit ends it (KK_END1, KK_END2).
#define KK_STEP1(q, sc, t)                                                             \\
  {                                                                                    \\
    KK_STEP(q, sc, frag1, ((t) % S1) * GW, GW / 4);                                    \\
    if ((t) % S1 == S1 - 1) KK_END1((t) / S1);                                         \\
  }
#define KK_STEP2(q, sc, t)                                                             \\
  {                                                                                    \\
    KK_STEP(q, sc, frag2, ((t) % S2) * GW2, GW2 / 4);                                  \\
    if ((t) % S2 == S2 - 1) KK_END2((t) / S2);                                         \\
  }
  // Two register buffers take turns: a step's loads go out before the previous step's math.
#define KK_PIPE(NT, LOADF, STEPF)                                                      \\
  for (int t = 0; t < (NT); t += 2) {                                                  \\
    if (t + 1 < (NT)) LOADF(qy, sy, t + 1);                                            \\
    STEPF(qx, sx, t);                                                                  \\
    if (t + 1 < (NT)) {                                                                \\
      if (t + 2 < (NT)) LOADF(qx, sx, t + 2);                                           \\
      STEPF(qy, sy, t + 1);                                                            \\
    }                                                                                  \\
  }

  uint4 qx[4 * NB], qy[4 * NB];
  uint sx[4 * NB], sy[4 * NB];
  float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;  // A row g, g+8; B row g, g+8
  if (T1 > 0) KK_LOAD1(qx, sx, 0);
  const DEVICE T* xr = x + (size_t)(p / K) * KD;
"""
    + PARAMS
    + staging("frag1", "KD", "xr", "s_max1", "1")
    + """\
  BARRIER();

  // Phase 1: this slice's gate and up rows, SiTU-GLU into hs.
  KK_PIPE(T1, KK_LOAD1, KK_STEP1);
  // The down phase's first loads go out before waiting for the whole slice of h.
  const size_t r2 = TL ? ((ex * KD / 16 + 2 * warp) * (G2 / 4) + js * (GS / 4)) * 64 + lane
                       : (ex * KD + 32 * warp + g) * G2 + js * GS + tq;
  constexpr int TB2 = TL ? (G2 / 4) * 64 : 16 * G2;  // words from tile A's rows to tile B's
  const DEVICE uint4* q2 = (const DEVICE uint4*)w2 + r2;
  const DEVICE uint8_t* e2 = s2 + r2;
  if (T2 > 0) KK_LOAD2(qx, sx, 0);
  BARRIER();
"""
    + staging("frag2", "SL", "hs", "s_max2", "2", shared=True)
    + """\
  BARRIER();

  // Phase 2: every down row times this slice of h, weighted by the pair's routing weight.
  KK_PIPE(T2, KK_LOAD2, KK_STEP2);
#undef KK_OFF1
#undef KK_OFF2
#undef KK_Q
#undef KK_LOAD
#undef KK_PLAIN
#undef KK_LOAD1
#undef KK_LOAD2
#undef KK_STEP
#undef KK_LANES
#undef KK_END1
#undef KK_END2
#undef KK_STEP1
#undef KK_STEP2
#undef KK_PIPE
"""
)

# The partials of each token in a fixed order: a threadgroup owns 32 columns of D (a lane
# each); warp w adds partials w, w + NWS, ... in order, then the warps' sums in order.
SUM_BODY = """
  SHARED float red[NWS * 32];
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const uint d = GROUP_POS.x * 32 + lane;
  const uint n = GROUP_POS.y;
  float total = 0.0f;
  if (d < D) {
    for (int r = warp; r < R; r += NWS) total += part[((size_t)n * R + r) * D + d];
  }
  red[warp * 32 + lane] = total;
  BARRIER();
  if (warp == 0 && d < D) {
    float y0 = red[lane];
    for (int w = 1; w < NWS; ++w) y0 += red[w * 32 + lane];
    y[(size_t)n * D + d] = y0;
  }
"""

# Rows of I per threadgroup (SL), warps (NW), scale groups per step in gate/up (GW) and in
# down (GW2). Where SL does not divide I, the largest multiple of 128 that does (slice_for).
LAUNCH = (256, 8, 8, 8)
# Threadgroups per SM that CUDA must leave registers for (__launch_bounds__; 1: no bound).
MIN_BLOCKS = 1
SUM_WARPS = 8
# Gate/up's code words are read once: loaded with LOAD_STREAM (evict first), as mxfp4_mma.
STREAM_LOADS = True

INPUTS = ["x", "w1", "s1", "w3", "s3", "w2", "s2", "inds", "wts", "params"]


def slice_for(I: int, sl: int) -> int:
    """Rows of I per threadgroup: the largest multiple of 128 that divides I and is at most
    ``sl`` (128 where none is larger; ``mxfp4_mma.eligible`` inputs have I % 128 == 0)."""
    best = 128
    for cand in range(128, min(sl, I) + 1, 128):
        if I % cand == 0:
            best = cand
    return best


def shape_for(D: int, I: int, launch=None) -> tuple:
    """``launch`` (default ``LAUNCH``) fitted to D and I: the slice divides I, each step size
    divides its rows' groups (4 where the asked one does not)."""
    sl, nw, gw, gw2 = launch or LAUNCH
    sl = slice_for(I, sl)
    gw = gw if (D // 32) % gw == 0 else 4
    gw2 = gw2 if (sl // 32) % gw2 == 0 else 4
    return sl, nw, gw, gw2


def _template(dtype, D, I, k, sl, nw) -> list:
    """Both fused kernels' template values: latent dtype, D, I, top-k, slice, warps."""
    return [("T", dtype), ("KD", D), ("NI", I), ("K", k), ("SL", sl), ("NW", nw)]


def template(dtype, D, I, k, sl, nw, gw, gw2, cs=None, tiled=False):
    return _template(dtype, D, I, k, sl, nw) + [
        ("GW", gw),
        ("GW2", gw2),
        ("CS", STREAM_LOADS if cs is None else cs),
        ("TL", tiled),
    ]


def _instances(template_fn, shape) -> list:
    """The launches at K3's size at ``shape``, for each latent dtype."""
    return [
        Instance(
            [dt, U32, U8, U32, U8, U32, U8, I32, F32, F32],
            [F32],
            template_fn(dt, K3["D"], K3["I"], K3["K"], *shape),
        )
        for dt in (mx.bfloat16, mx.float16, mx.float32)
    ]


MXFP4_FUSED = Kernel(
    "mxfp4_fused",
    INPUTS,
    ["part"],
    BODY,
    header=MMA_HEADER,
    instances=_instances(template, shape_for(K3["D"], K3["I"])),
)
MXFP4_FUSED_SUM = Kernel(
    "mxfp4_fused_sum",
    ["part"],
    ["y"],
    SUM_BODY,
    instances=[
        Instance(
            [F32],
            [F32],
            [("D", K3["D"]), ("R", K3["K"] * K3["I"] // LAUNCH[0]), ("NWS", SUM_WARPS)],
        )
    ],
)


def sum_slices(backend: str, part, N: int):
    """``y [N, D]``: each token's partials (``part [N * r, D]``, token-major) in a fixed order."""
    r, D = part.shape[0] // N, part.shape[-1]
    (y,) = MXFP4_FUSED_SUM(
        backend,
        inputs=[part],
        output_shapes=[(N, D)],
        output_dtypes=[F32],
        grid=(32 * SUM_WARPS * -(-D // 32), N, 1),
        threadgroup=(32 * SUM_WARPS, 1, 1),
        template=[("D", D), ("R", r), ("NWS", SUM_WARPS)],
    )
    return y


def _launch(kernel, tmpl, sl, nw, backend, z, w, inds, weights, beta, cap):
    """One fused launch (``kernel`` at template ``tmpl``, ``sl`` rows of I and ``nw`` warps
    per threadgroup): ``part [N * k * I / sl, D]`` fp32, pair-major, then slice."""
    D = z.shape[-1]
    I = w["w1"][0].shape[-2]
    pairs = inds.size
    (part,) = kernel(
        backend,
        inputs=[
            z,
            *w["w1"],
            *w["w3"],
            *w["w2"],
            inds.reshape(-1).astype(I32),
            weights.reshape(-1).astype(F32),
            constant((beta, cap)),
        ],
        output_shapes=[(pairs * (I // sl), D)],
        output_dtypes=[F32],
        grid=(32 * nw * (I // sl), pairs, 1),
        threadgroup=(32 * nw, 1, 1),
        template=tmpl,
    )
    return part


def tile(w: dict) -> dict:
    """Stacks in MLX's layout -> the layout ``tiled=True`` reads: the codes in
    ``expert_layout``'s tiles, each block's 16 rows x 4 scale bytes contiguous beside them
    (64 bytes a block, in the codes' order; lazy MLX ops)."""
    from .expert_layout import _check, _permute

    out = {}
    for n, (q, s) in w.items():
        E, R, G = _check(n, q, s)
        out[n] = (_permute(q, E, R, G, 4), _permute(s, E, R, G, 1))
    return out


def partials(z, w, inds, weights, beta, cap, backend: str | None = None, launch=None, tiled=False):
    """The fused launch alone: ``part [N * k * I / SL, D]`` fp32 (pair-major, then slice).
    ``tiled``: ``w`` is in ``tile``'s layout."""
    backend = backend or default_backend()
    D, I, k = z.shape[-1], w["w1"][0].shape[-2], inds.shape[-1]
    sl, nw, gw, gw2 = shape_for(D, I, launch)
    kernel = MXFP4_FUSED.bounded(32 * nw, MIN_BLOCKS)
    tmpl = template(z.dtype, D, I, k, sl, nw, gw, gw2, tiled=tiled)
    return _launch(kernel, tmpl, sl, nw, backend, z, w, inds, weights, beta, cap)


def expert_glu_decode(
    z, w, inds, weights, beta, cap, backend: str | None = None, launch=None, tiled=False
):
    """``mxfp4_mma.expert_glu_decode`` in two launches (same shapes and return: fp32 [N, D]).
    Needs ``mxfp4_mma.eligible`` inputs (D, I multiples of 128); ``tiled``: ``w`` is in
    ``tile``'s layout."""
    backend = backend or default_backend()
    part = partials(z, w, inds, weights, beta, cap, backend, launch, tiled)
    return sum_slices(backend, part, inds.shape[0])


# The same two phases with the code words and scale bytes brought into threadgroup memory by
# the copy engine: each warp has a ring of S stages (its 32 rows x 4 scale groups: 64 bytes of
# codes and 4 scale bytes per row), filled S steps ahead. A lane issues one bulk copy (its
# row's 64 bytes, BULK_COPY) and one 4-byte asynchronous copy (its row's scales) per step, all
# counted on the stage's barrier; the ring runs on from the gate/up steps into the down steps,
# so the first down rows are in flight while the slice of h is finished.
BODY_BULK = (
    "\n"
    + CONSTANTS
    + """  constexpr int S1 = G1 / 4;                    // steps (4 groups) per gate/up unit
  constexpr int S2 = GS / 4;                    // steps per down unit
"""
    + """  SHARED uint4 ring[NW * S * 128];              // stage: 32 rows x 64 bytes
  SHARED uint sring[NW * S * 32];               // stage: 32 rows x 4 scale bytes
  SHARED MBAR_T bars[NW * S];
"""
    + DECLS
    + """  const int TT = T1 + T2;

  // Step t's copies, one row per lane (slot = lane): gate/up steps take gate rows (slots
  // 0-15) and up rows (16-31) of unit t / S1; down steps 32 rows of unit (t - T1) / S2.
  const DEVICE uint4* c1 = (const DEVICE uint4*)(lane < 16 ? w1 : w3);
  const DEVICE uint8_t* e1 = lane < 16 ? s1 : s3;
  const size_t row1 = ex * NI + (size_t)js * SL + 16 * warp + lane % 16;
  const size_t row2 = ex * KD + 32 * warp + lane;
  // Tiled (TL, tile()): the warp's first 16-row tile of gate/up and of down.
  const size_t tile1 = (ex * NI + (size_t)js * SL) / 16 + warp;
  const size_t tile2 = ex * KD / 16 + 2 * warp;
#define KB_ISSUE(t)                                                                       \
  {                                                                                       \
    const int st_ = (t) % S;                                                             \
    const uint b_ = warp * S + st_;                                                       \
    if (TL) {                                                                             \
      /* Tiled: the stage is two 1 KB blocks of codes and two 64-byte blocks of scales. */ \
      size_t ba_, bb_;                                                                    \
      const DEVICE uint4* ca_;                                                            \
      const DEVICE uint4* cb_;                                                            \
      const DEVICE uint8_t* ea_;                                                          \
      const DEVICE uint8_t* eb_;                                                          \
      if ((t) < T1) {                                                                     \
        ba_ = bb_ = (tile1 + NW * (size_t)((t) / S1)) * (G1 / 4) + (t) % S1;              \
        ca_ = (const DEVICE uint4*)w1, cb_ = (const DEVICE uint4*)w3, ea_ = s1, eb_ = s3;  \
      } else {                                                                            \
        const int t2_ = (t) - T1;                                                         \
        ba_ = (tile2 + 2 * NW * (size_t)(t2_ / S2)) * (G2 / 4) + js * (GS / 4) + t2_ % S2; \
        bb_ = ba_ + G2 / 4;                                                               \
        ca_ = cb_ = (const DEVICE uint4*)w2, ea_ = eb_ = s2;                              \
      }                                                                                   \
      if (lane == 0) {                                                                    \
        MBAR_EXPECT(&bars[b_], 2 * 1024 + 2 * 64);                                        \
        BULK_COPY(&ring[b_ * 128], ca_ + 64 * ba_, 1024, &bars[b_]);                      \
      } else if (lane == 1) {                                                             \
        BULK_COPY(&ring[b_ * 128 + 64], cb_ + 64 * bb_, 1024, &bars[b_]);                 \
      } else if (lane == 2) {                                                             \
        BULK_COPY(&sring[b_ * 32], (const DEVICE uint*)(ea_ + 64 * ba_), 64, &bars[b_]);  \
      } else if (lane == 3) {                                                             \
        BULK_COPY(&sring[b_ * 32 + 16], (const DEVICE uint*)(eb_ + 64 * bb_), 64, &bars[b_]); \
      }                                                                                   \
    } else {                                                                              \
      const DEVICE uint4* cs_;                                                            \
      const DEVICE uint* es_;                                                             \
      if ((t) < T1) {                                                                     \
        const size_t o_ = (row1 + 16 * NW * (size_t)((t) / S1)) * G1 + ((t) % S1) * 4;    \
        cs_ = c1 + o_;                                                                    \
        es_ = (const DEVICE uint*)(e1 + o_);                                              \
      } else {                                                                            \
        const int t2_ = (t) - T1;                                                         \
        const size_t o_ = (row2 + 32 * NW * (size_t)(t2_ / S2)) * G2 + js * GS + (t2_ % S2) * 4; \
        cs_ = (const DEVICE uint4*)w2 + o_;                                               \
        es_ = (const DEVICE uint*)(s2 + o_);                                              \
      }                                                                                   \
      if (lane == 0) MBAR_EXPECT(&bars[b_], 32 * 64);                                     \
      BULK_COPY(&ring[b_ * 128 + lane * 4], cs_, 64, &bars[b_]);                          \
      ASYNC_COPY4(sring[b_ * 32 + lane], es_, true);                                      \
      MBAR_ASYNC_ARRIVE(&bars[b_]);                                                       \
    }                                                                                     \
  }
  // Step t's eight MMAs per tile from its stage (rows g, g + 8 of tiles A and B; the lane's
  // group tq), then each row's result times its group's scale (fb: the step's 4-group block
  // of the B fragments).
#define KB_STEP(t, frag, fb)                                                              \\
  {                                                                                       \\
    const uint b_ = warp * S + (t) % S;                                                   \\
    MBAR_WAIT(&bars[b_], uint((t) / S) & 1u);                                             \\
    const uint c_ = b_ * 128 + tq;                                                        \\
    const uint4 wa0 = ring[c_ + 4 * g], wa8 = ring[c_ + 4 * (g + 8)];                     \\
    const uint4 wb0 = ring[c_ + 4 * (16 + g)], wb8 = ring[c_ + 4 * (24 + g)];             \\
    const uint sh_ = 8 * tq;                                                              \\
    const uint ea0 = (sring[b_ * 32 + g] >> sh_) & 255u;                                  \\
    const uint ea8 = (sring[b_ * 32 + 8 + g] >> sh_) & 255u;                              \\
    const uint eb0 = (sring[b_ * 32 + 16 + g] >> sh_) & 255u;                             \\
    const uint eb8 = (sring[b_ * 32 + 24 + g] >> sh_) & 255u;                             \\
"""
    + mma_block(
        "frag[(fb) * 32 + pq * 8 + g]",
        ("ea0", "ea8", "eb0", "eb8"),
        "",
        "    ",
    )
    + """    SIMD_BARRIER();                                                                   \\
    if ((t) + S < TT) KB_ISSUE((t) + S);                                              \\
  }
"""
    + LANES
    + UNIT_ENDS
    + """
  if (lane == 0) {
    // One arrival with the bytes expected, plus (plain layout) one per lane's scale copy.
    for (int s = 0; s < S; ++s) MBAR_INIT(&bars[warp * S + s], TL ? 1 : 33);
  }
  SIMD_BARRIER();
  for (int t = 0; t < S && t < TT; ++t) KB_ISSUE(t);
  float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;  // A row g, g+8; B row g, g+8
  const DEVICE T* xr = x + (size_t)(p / K) * KD;
"""
    + PARAMS
    + staging("frag1", "KD", "xr", "s_max1", "1")
    + """\
  BARRIER();

  // Phase 1: this slice's gate and up rows, SiTU-GLU into hs.
  for (int t = 0; t < T1; ++t) {
    KB_STEP(t, frag1, t % S1);
    if (t % S1 == S1 - 1) KK_END1(t / S1);
  }
  BARRIER();
"""
    + staging("frag2", "SL", "hs", "s_max2", "2", shared=True)
    + """\
  BARRIER();

  // Phase 2: every down row times this slice of h, weighted by the pair's routing weight.
  for (int t = T1; t < TT; ++t) {
    const int t2 = t - T1;
    KB_STEP(t, frag2, t2 % S2);
    if (t2 % S2 == S2 - 1) KK_END2(t2 / S2);
  }
#undef KB_ISSUE
#undef KB_STEP
#undef KK_LANES
#undef KK_END1
#undef KK_END2
"""
)

# Rows of I per threadgroup (SL), warps (NW), ring stages per warp (S).
LAUNCH_BULK = (128, 2, 6)


def shared_bytes_bulk(D: int, sl: int, nw: int, s: int) -> int:
    """Threadgroup memory of one bulk launch: fragments, h, maxima, the unit ends'
    parameters, rings, barriers."""
    return 4 * D + 8 * sl + 8 * nw + 12 + nw * s * (2048 + 128 + 8)


def shape_for_bulk(D: int, I: int, launch=None, backend: str = "cuda") -> tuple:
    """``launch`` (default ``LAUNCH_BULK``) fitted: the slice divides I, and fewer stages
    (then warps) where threadgroup memory would pass the backend's (``SHARED_LIMIT``: 48 KB
    on CUDA without an opt-in, 32 KB on Metal)."""
    sl, nw, s = launch or LAUNCH_BULK
    sl = slice_for(I, sl)
    limit = SHARED_LIMIT.get(backend, 32 * 1024)
    while shared_bytes_bulk(D, sl, nw, s) > limit:
        if s > 2:
            s -= 1
        elif nw > 1:
            nw //= 2
        else:
            raise ValueError(f"mxfp4_fused_bulk: D={D} leaves no room for a ring")
    return sl, nw, s


def template_bulk(dtype, D, I, k, sl, nw, s, tiled=False):
    return _template(dtype, D, I, k, sl, nw) + [("S", s), ("TL", tiled)]


MXFP4_FUSED_BULK = Kernel(
    "mxfp4_fused_bulk",
    INPUTS,
    ["part"],
    BODY_BULK,
    header=MMA_HEADER,
    instances=_instances(template_bulk, shape_for_bulk(K3["D"], K3["I"])),
)


def partials_bulk(
    z, w, inds, weights, beta, cap, backend: str | None = None, launch=None, tiled=False
):
    """``partials`` through the bulk-copy kernel (``tiled``: ``w`` in ``tile``'s layout, a
    stage is then four copies: two 1 KB blocks of codes, two of scales)."""
    backend = backend or default_backend()
    D, I, k = z.shape[-1], w["w1"][0].shape[-2], inds.shape[-1]
    sl, nw, s = shape_for_bulk(D, I, launch, backend)
    tmpl = template_bulk(z.dtype, D, I, k, sl, nw, s, tiled)
    return _launch(MXFP4_FUSED_BULK, tmpl, sl, nw, backend, z, w, inds, weights, beta, cap)


def expert_glu_decode_bulk(z, w, inds, weights, beta, cap, backend=None, launch=None, tiled=False):
    """``expert_glu_decode`` with the weights brought in by bulk copies (``BODY_BULK``)."""
    backend = backend or default_backend()
    part = partials_bulk(z, w, inds, weights, beta, cap, backend, launch, tiled)
    return sum_slices(backend, part, inds.shape[0])
