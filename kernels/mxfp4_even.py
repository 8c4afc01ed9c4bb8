"""MXFP4 expert decode with the work dealt evenly: ``mxfp4_mma``'s body on a grid of exactly
the threadgroups that fit, each with an equal share of the call's row units.

``mxfp4_mma`` launches one threadgroup per (pair, RT row units). At K3's size and one token
that is 384 gate/up threadgroups where two per SM fit 264 at a time on an H200: a first wave
of 264 and a second of 120, so for the second half of the kernel more than half of the
slots are empty (ncu: SMs active 74% of gate/up's time, docs/benchmarks.md, session 22).
Down's 224 threadgroups fit one wave, but 40 SMs hold one threadgroup and 92 hold two.

Here the grid is ``NT`` threadgroups (the launcher picks how many are resident at once, so
one wave), and the call's ``U = pairs x units`` row units are cut into ``NT`` contiguous
ranges of ``U / NT`` units (rounded either way). Inside a threadgroup, each unit is split
into ``H`` segments of its K range (``S / H`` steps of ``GW`` groups each, ``S`` = steps per
unit), and warp w takes items w, w + NW, w + 2 NW, ... of the range's ``units x H`` items. A
warp's items run as one stream of steps with ``mxfp4_mma``'s double-buffered loads, the
loads of an item's first step going out during the last step of the item before. At an
item's end the warp adds up its lanes (``KK_LANES``) and leaves the item's 32 row sums in
threadgroup memory; after a barrier, the epilogue adds each unit's H segments in order and
applies SiTU-GLU (gate/up) or the pair's routing weight (down).

**Same bits wherever it runs.** A unit's result is always the sum of its H segments, each a
fixed range of steps, in segment order: it does not depend on the grid, on which warp ran a
segment, on the other pairs of the call or on the GPU's SM count. With ``H = 1`` it is the
same computation as ``mxfp4_mma`` (same order, same bits), which the tests check.

A threadgroup's units span at most two activation rows (the token's latent for gate/up, the
pair's ``h`` for down; the launcher keeps ``UPT``, the most units a threadgroup takes, at or
below the units per row), so it stages at most two rows of B fragments.
"""

from __future__ import annotations

import os

import mlx.core as mx

from . import mxfp4_mma
from .mxfp4_decode import sum_pairs
from .mxfp4_mma import (
    F32,
    I32,
    LANES,
    MMA_HEADER,
    STEP_MACRO,
    U8,
    U32,
    byte_permute_decode,
    staging,
)
from .source import Instance, Kernel, constant
from .source import backend as default_backend

BODY = (
    "\n"
    + """\
  constexpr int G = KD / 32;                                 // scale groups per row
  constexpr int NB = GW / 4;                                 // 4-group blocks per step
  constexpr int UNITS = GLU ? NR / 16 : NR / 32;             // row units (one warp's rows)
  constexpr int S = G / GW;                                  // steps per unit
  constexpr int SP = S / H;                                  // steps per segment (item)
  constexpr int NU = P * UNITS;                              // the call's units
  constexpr int RW = GLU ? UNITS * K : UNITS;                // units per activation row
  constexpr int IMAX = (UPT * H + NW - 1) / NW;              // most items a warp takes
  SHARED uint4 frag[2 * G * 8];
  SHARED float red[UPT * H * 32];
  SHARED float s_max[NW];
  SHARED float s_par[2];
  SHARED float s_uns[2];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const uint g = lane / 4;
  const uint tq = lane % 4;
  const bool bcol = g / 2 == tq;                  // this lane's B column is in its group

  // This threadgroup's units [u0, u1) and the activation rows a0 .. a1 they read.
  const uint nt = NUM_GROUPS.x;
  const uint u0 = uint((unsigned long long)GROUP_POS.x * NU / nt);
  const uint u1 = uint((unsigned long long)(GROUP_POS.x + 1) * NU / nt);
  const uint nu = u1 - u0;
  const uint a0 = u0 / RW;
  const uint a1 = nu ? (u1 - 1) / RW : a0;
  // The warp's items and, per item, the first row of its unit (tile A) in the stack.
  const int items = int(nu * H) > int(warp) ? (int(nu * H) - int(warp) + NW - 1) / NW : 0;
  const int steps = items * SP;                   // the whole warp agrees
  uint rowb[IMAX];
  _Pragma("unroll") for (int m = 0; m < IMAX; ++m) {
    const uint j = warp + uint(m) * NW;
    const uint ug = m < items ? u0 + j / H : 0u;
    const uint pp = ug / UNITS;
    rowb[m] = uint(inds[pp]) * NR + (GLU ? 16u : 32u) * (ug % UNITS);
  }
  // Step i of the warp's stream: item m = i / SP, step l = i % SP of its segment.
#define KK_ITEM_ROW(m, r)                                                                \\
  {                                                                                      \\
    r = rowb[0];                                                                         \\
    _Pragma("unroll") for (int k_ = 1; k_ < IMAX; ++k_) if (k_ == int(m)) r = rowb[k_]; \\
  }
#define KK_Q(q, i) (CS ? LOAD_STREAM(&(q)[i]) : (q)[i])
#define KK_LOAD(q, sc, i)                                                                \\
  {                                                                                      \\
    const uint m_ = uint(i) / SP;                                                        \\
    const uint bb = ((warp + m_ * NW) % H * SP + uint(i) % SP) * GW;                     \\
    uint r_;                                                                             \\
    KK_ITEM_ROW(m_, r_);                                                                 \\
    const size_t ra = (size_t)r_ + g;                                                    \\
    const size_t rb = GLU ? ra : ra + 16;                                                \\
    const DEVICE uint4* qa = (const DEVICE uint4*)w_a + ra * G + tq;                     \\
    const DEVICE uint4* qb = (const DEVICE uint4*)w_b + rb * G + tq;                     \\
    const DEVICE uint8_t* ea = s_a + ra * G + tq;                                        \\
    const DEVICE uint8_t* eb = s_b + rb * G + tq;                                        \\
    _Pragma("unroll") for (int u = 0; u < NB; ++u) {                                     \\
      q[4 * u] = KK_Q(qa, bb + 4 * u);                                                   \\
      q[4 * u + 1] = KK_Q(qa, 8 * G + bb + 4 * u);                                       \\
      q[4 * u + 2] = KK_Q(qb, bb + 4 * u);                                               \\
      q[4 * u + 3] = KK_Q(qb, 8 * G + bb + 4 * u);                                       \\
      sc[4 * u] = ea[bb + 4 * u];                                                        \\
      sc[4 * u + 1] = ea[8 * G + bb + 4 * u];                                            \\
      sc[4 * u + 2] = eb[bb + 4 * u];                                                    \\
      sc[4 * u + 3] = eb[8 * G + bb + 4 * u];                                            \\
    }                                                                                    \\
  }
  uint4 qx[4 * NB], qy[4 * NB];
  uint sx[4 * NB], sy[4 * NB];
  if (steps > 0) KK_LOAD(qx, sx, 0);

  // The epilogue's parameters: beta and cap, or the routing weights of rows a0 and a1.
  if (tid == 0) {
    s_par[0] = params[GLU ? 0u : a0];
    s_par[1] = params[GLU ? 1u : a1];
  }
  // Row a0's fragments in frag[0 .. 8G), row a1's (where the range reaches it) after them.
  {
    const DEVICE T* xr = x + (size_t)a0 * KD;
"""
    + staging("frag", "KD", "xr", "s_max", "0")
    + """\
    if (tid == 0) s_uns[0] = unscale0;
  }
  if (a1 != a0) {                                 // the whole threadgroup agrees
    BARRIER();                                    // s_max is reused
    const DEVICE T* xr = x + (size_t)a1 * KD;
"""
    + staging("(frag + G * 8)", "KD", "xr", "s_max", "1")
    + """\
    if (tid == 0) s_uns[1] = unscale1;
  }
  BARRIER();

  float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;  // A row g, g+8; B row g, g+8
"""
    + STEP_MACRO
    + LANES
    + """\
  // Step i with the code words and scales in q, sc; an item's last step leaves its row sums
  // in red (item j = warp + m NW of the threadgroup's range).
#define KK_STEPI(q, sc, i)                                                               \\
  {                                                                                      \\
    const uint m_ = uint(i) / SP;                                                        \\
    const uint j_ = warp + m_ * NW;                                                      \\
    const uint bb = (j_ % H * SP + uint(i) % SP) * GW;                                   \\
    const uint fo_ = ((u0 + j_ / H) / RW - a0) * (G * 8);                               \\
    KK_STEP(q, sc, (frag + fo_), bb, NB);                                                \\
    if (uint(i) % SP == SP - 1) {                                                        \\
      KK_LANES();                                                                        \\
      if (tq == 0) {                                                                     \\
        red[j_ * 32 + g] = acc0;                                                         \\
        red[j_ * 32 + 8 + g] = acc1;                                                     \\
        red[j_ * 32 + 16 + g] = acc2;                                                    \\
        red[j_ * 32 + 24 + g] = acc3;                                                    \\
      }                                                                                  \\
      acc0 = 0.0f;                                                                       \\
      acc1 = 0.0f;                                                                       \\
      acc2 = 0.0f;                                                                       \\
      acc3 = 0.0f;                                                                       \\
    }                                                                                    \\
  }
  for (int i = 0; i < steps; i += 2) {
    const bool second = i + 1 < steps;            // the whole warp agrees
    if (second) KK_LOAD(qy, sy, i + 1);
    KK_STEPI(qx, sx, i);
    if (second) {
      if (i + 2 < steps) KK_LOAD(qx, sx, i + 2);
      KK_STEPI(qy, sy, i + 1);
    }
  }
#undef KK_Q
#undef KK_LOAD
#undef KK_STEP
#undef KK_STEPI
#undef KK_ITEM_ROW
  BARRIER();

  // Each unit's H segments in order, then SiTU-GLU or the pair's routing weight.
  constexpr uint OW = GLU ? 16u : 32u;            // outputs per unit
  for (uint o = tid; o < nu * OW; o += 32 * NW) {
    const uint ul = o / OW;
    const uint i = o % OW;
    const uint ug = u0 + ul;
    const uint slot = ug / RW - a0;
    const uint pp = ug / UNITS;
    if (GLU) {
      float gate = 0.0f, upv = 0.0f;
      for (int h = 0; h < H; ++h) {
        gate += red[(ul * H + h) * 32 + i];
        upv += red[(ul * H + h) * 32 + 16 + i];
      }
      out[(size_t)pp * NR + OW * (ug % UNITS) + i] =
          kk_situ_glu(gate * s_uns[slot], upv * s_uns[slot], s_par[0], s_par[1]);
    } else {
      float total = 0.0f;
      for (int h = 0; h < H; ++h) total += red[(ul * H + h) * 32 + i];
      out[(size_t)pp * NR + OW * (ug % UNITS) + i] = s_par[slot] * (total * s_uns[slot]);
    }
  }
"""
)

INPUTS = ["x", "w_a", "s_a", "w_b", "s_b", "inds", "params"]

# Per projection: warps per threadgroup, scale groups per step, segments per unit (H; at
# most the steps per unit, which it must divide: the launcher takes the largest divisor at
# or below it), threadgroups per SM the grid is sized for (and the compiler bound to).
LAUNCH = {"gate_up": (8, 8, 2, 2), "down": (8, 8, 2, 2)}
# Code words loaded as read once per projection (as mxfp4_mma.STREAM_LOADS).
STREAM_LOADS = {"gate_up": True, "down": False}
# The most units one threadgroup takes (threadgroup memory: 128 H bytes per unit); where a
# call has more than NT x UPT_MAX units, the grid grows past one wave.
UPT_MAX = 32
# SMs of the GPU when MLX does not say (an H200 has 132); KIMI_K3_SMS overrides.
DEFAULT_SMS = 132


def sm_count() -> int:
    """The GPU's SM count: ``KIMI_K3_SMS``, else MLX's device info where it has one, else
    ``DEFAULT_SMS``. Only the grid's size depends on it, never the result."""
    env = os.environ.get("KIMI_K3_SMS")
    if env:
        return int(env)
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 - a backend without device info
        info = {}
    for key in ("num_sms", "multi_processor_count", "sm_count", "multiProcessorCount"):
        if key in info:
            return int(info[key])
    return DEFAULT_SMS


def _proj(glu: bool) -> str:
    return "gate_up" if glu else "down"


def template(dtype, KD, NR, K, glu, P, upt, nw, gw, h, cs=None):
    return [
        ("T", dtype),
        ("KD", KD),
        ("NR", NR),
        ("K", K),
        ("GLU", glu),
        ("P", P),
        ("UPT", upt),
        ("NW", nw),
        ("GW", gw),
        ("H", h),
        ("CS", STREAM_LOADS[_proj(glu)] if cs is None else cs),
    ]


def plan(KD: int, NR: int, k: int, pairs: int, glu: bool, launch=None, sms=None) -> dict:
    """The launch of one projection: ``gw`` (groups per step), ``h`` (segments per unit),
    ``nt`` (threadgroups), ``upt`` (the most units one takes), ``nw``, ``per_sm``."""
    nw, gw, h, per_sm = launch or LAUNCH[_proj(glu)]
    G = KD // 32
    if G % gw:
        gw = 4
    S = G // gw
    h = max(d for d in range(1, min(h, S) + 1) if S % d == 0)
    units = NR // 16 if glu else NR // 32
    total = pairs * units
    row = units * k if glu else units  # units per activation row
    nt = min(total, (sms or sm_count()) * per_sm)
    cap = min(UPT_MAX, row)
    nt = max(nt, -(-total // cap))
    upt = -(-total // nt)
    return {"gw": gw, "h": h, "nt": nt, "upt": upt, "nw": nw, "per_sm": per_sm}


MXFP4_EVEN = Kernel(
    "mxfp4_even",
    INPUTS,
    ["out"],
    BODY,
    header=MMA_HEADER,
    instances=[
        Instance(
            [dt, U32, U8, U32, U8, I32, F32],
            [F32],
            template(dt, 3584, 3072, 16, True, 16, 12, 8, 8, 2),
        )
        for dt in (mx.bfloat16, mx.float16, mx.float32)
    ]
    + [
        Instance(
            [F32, U32, U8, U32, U8, I32, F32],
            [F32],
            template(F32, 3072, 3584, 16, False, 16, 7, 8, 8, 2),
        )
    ],
)


def kernel_for(per_sm: int, nw: int) -> Kernel:
    """The kernel as launched: byte-permute decode, bounded to ``per_sm`` threadgroups of
    ``nw`` warps per SM."""
    return byte_permute_decode(MXFP4_EVEN.bounded(32 * nw, per_sm))


def project(backend, x, wa, sa, wb, sb, flat, params, KD, NR, k, glu, launch=None, sms=None):
    """One projection for every (token, choice) pair in ``flat``: gate/up + SiTU-GLU
    (``h [pairs, NR]``), or down weighted by ``params`` (``part [pairs, NR]``)."""
    pairs = flat.size
    lp = plan(KD, NR, k, pairs, glu, launch, sms)
    (out,) = kernel_for(lp["per_sm"], lp["nw"])(
        backend,
        inputs=[x, wa, sa, wb, sb, flat, params],
        output_shapes=[(pairs, NR)],
        output_dtypes=[F32],
        grid=(32 * lp["nw"] * lp["nt"], 1, 1),
        threadgroup=(32 * lp["nw"], 1, 1),
        template=template(x.dtype, KD, NR, k, glu, pairs, lp["upt"], lp["nw"], lp["gw"], lp["h"]),
    )
    return out


def expert_glu_decode(
    z,
    w,
    inds,
    weights,
    beta,
    cap,
    backend: str | None = None,
    launch=None,
    sms=None,
    even=("gate_up", "down"),
):
    """``mxfp4_mma.expert_glu_decode`` (same inputs, same return: fp32 [N, D]) with the work
    dealt evenly over a one-wave grid. ``launch``: {projection: (warps, groups per step,
    segments per unit, threadgroups per SM)} in place of ``LAUNCH``; ``sms``: the SM count
    the grid is sized for (the result does not depend on it); ``even``: the projections
    launched this way (the others as ``mxfp4_mma`` dispatches them)."""
    backend = backend or default_backend()
    launch = launch or {}
    N, k = inds.shape
    D = z.shape[-1]
    I = w["w1"][0].shape[-2]
    flat = inds.reshape(-1).astype(I32)

    def run(glu, x, wa, sa, wb, sb, params, KD, NR):
        proj = "gate_up" if glu else "down"
        if proj in even:
            args = (x, wa, sa, wb, sb, flat, params, KD, NR, k, glu, launch.get(proj), sms)
            return project(backend, *args)
        shape = mxfp4_mma.dispatched_shape(backend, KD, glu)
        kernel = mxfp4_mma.dispatched_kernel(glu, shape)
        args = (x, wa, sa, wb, sb, flat, params, KD, NR, k, glu)
        return mxfp4_mma._launch(kernel, mxfp4_mma.template, shape, backend, *args)

    h = run(True, z, *w["w1"], *w["w3"], constant((beta, cap)), D, I)
    part = run(False, h, *w["w2"], *w["w2"], weights.reshape(-1).astype(F32), I, D)
    return sum_pairs(backend, part, N, k)
