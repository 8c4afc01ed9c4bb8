"""MXFP4 expert decode on tensor cores with whole-line loads: ``mxfp4_mma``'s product, each
warp load covering 4 rows x 128 contiguous bytes.

``mxfp4_mma`` gives lane (g, tq) one 16-byte group of rows g and g + 8, so a warp load
touches 8 rows x 64 bytes: half of 8 cache lines. Its load pattern alone moves 2.4-2.9 TB/s
on the H200, where 4 rows x 128 bytes move 3.2-3.5 (the ``probe`` and ``stream`` rows of
``benchmarks/mxfp4_sweep.py``, docs/benchmarks.md). Here an 8-group block of a weight row
(128 bytes, one line) is split over two MMA rows: MMA row g is half g % 2 of weight row
g / 2, MMA row g + 8 the same half of weight row g / 2 + 4. Lane (g, tq) loads group
4 (g % 2) + tq of its two weight rows, so lanes 8r .. 8r + 7 read row r's whole line.

The B fragments follow: output column 2 tq + h collects lane-slice tq against the
activations of group 4 h + tq (zero outside the slice), so row g finds its own group's dot
product in column 2 tq + g % 2 (the other column holds a product nobody reads). With both
columns of a pair taken by the halves, the activations' lo part (``mxfp4_mma`` puts hi and
lo side by side) needs its own MMAs: ``LO`` adds them, for fp32 activations (fp32 latents,
and ``h`` for down); fp16 hi alone holds a bf16 or fp16 latent exactly (after the
power-of-two scaling, down to 2^-24 of the largest element). At the end each weight row's
sum is spread over 8 lanes (its two halves x four groups): three shuffles.

A warp owns 8 rows of each matrix (gate and up rows, or two 8-row tiles of down) and
``NP`` blocks (8 groups each) per step. Needs D and I multiples of 256.
"""

from __future__ import annotations

import mlx.core as mx

from .mxfp4_decode import K3, sum_pairs
from .mxfp4_mma import LANES, MMA_HEADER, ROLES, STREAM_LOADS, _proj, staging
from .source import Instance, Kernel, constant
from .source import backend as default_backend

U32, U8, F32, I32 = mx.uint32, mx.uint8, mx.float32, mx.int32

# Fragment entry it: hi entries first (4 G), then lo; within each, (block, pq, column) with
# column c holding group 8 block + 4 (c % 2) + c / 2.
PLACE = """\
    const uint e_ = it % (4 * G);
    const uint col = e_ % 8;
    const uint pq = (e_ / 8) % 4;
    const uint grp = (e_ / 32) * 8 + 4 * (col % 2) + col / 2;
"""


def _pick(c: str, row8: bool) -> str:
    """Column 2 tq + hb of an MMA result: row g (x, y) or row g + 8 (z, w)."""
    x, y = ("z", "w") if row8 else ("x", "y")
    return f"(hb ? {c}.{y} : {c}.{x})"


def _step() -> str:
    """KK_STEP(q, sc, bb): NP blocks of 8 groups from the registers q (code words) and sc
    (scale bytes), against the fragments from group bb on."""
    lines = [
        '_Pragma("unroll") for (int u = 0; u < NP; ++u) {',
        "  const uint4 wa0 = q[4 * u], wa8 = q[4 * u + 1], wb0 = q[4 * u + 2], wb8 = q[4 * u + 3];",
        "  float4 ca0 = FLOAT4(0.0f, 0.0f, 0.0f, 0.0f), ca1 = ca0, cb0 = ca0, cb1 = ca0;",
        "  float4 la0 = ca0, la1 = ca0, lb0 = ca0, lb1 = ca0;",
        '  _Pragma("unroll") for (int pq = 0; pq < 4; ++pq) {',
        "    const uint e = ((bb) / 8 + u) * 32 + pq * 8 + g;",
        "    const uint4 f = bcol ? frag[e] : UINT4(0u, 0u, 0u, 0u);",
        "    const uint xa0 = kk_word(wa0, pq), xa8 = kk_word(wa8, pq);",
        "    const uint xb0 = kk_word(wb0, pq), xb8 = kk_word(wb8, pq);",
    ]
    for t in "ab":
        for j in (0, 2):
            pairs = [f"kk_e2m1_pair(x{t}{r}, {jj})" for jj in (j, j + 1) for r in (0, 8)]
            lines.append(f"    const uint4 a{t}{j} = UINT4({', '.join(pairs)});")
    for t in "ab":
        for j in (0, 2):
            fr = "UINT2(f.x, f.y)" if j == 0 else "UINT2(f.z, f.w)"
            lines.append(f"    c{t}{j // 2} = SIMD_MMA(c{t}{j // 2}, a{t}{j}, {fr}, lane);")
    lines += [
        "    if (LO) {",
        "      const uint4 fl = bcol ? frag[4 * G + e] : UINT4(0u, 0u, 0u, 0u);",
    ]
    for t in "ab":
        for j in (0, 2):
            fr = "UINT2(fl.x, fl.y)" if j == 0 else "UINT2(fl.z, fl.w)"
            lines.append(f"      l{t}{j // 2} = SIMD_MMA(l{t}{j // 2}, a{t}{j}, {fr}, lane);")
    lines += ["    }", "  }"]
    for i, (t, row8) in enumerate((("a", False), ("a", True), ("b", False), ("b", True))):
        hi = f"{_pick(f'c{t}0', row8)} + {_pick(f'c{t}1', row8)}"
        lo = f"{_pick(f'l{t}0', row8)} + {_pick(f'l{t}1', row8)}"
        lines.append(
            f"  acc{i} += kk_e8m0_bits(sc[4 * u + {i}]) * (LO ? ({hi}) + ({lo}) : ({hi}));"
        )
    lines.append("}")
    return "#define KK_STEP(q, sc, bb) \\\n" + "".join(f"  {ln} \\\n" for ln in lines) + "\n"


BODY = (
    """
  constexpr int G = KD / 32;                                 // scale groups per row
  constexpr int NW = RT * SK;                                // warps
  constexpr int GW = 8 * NP;                                 // groups per step
  constexpr int GB = ((G + SK - 1) / SK + GW - 1) / GW * GW; // groups per split, whole steps
  constexpr int UNITS = GLU ? NR / 8 : NR / 16;              // row units (one warp's rows)
  SHARED uint4 frag[(LO ? 8 : 4) * G];
  SHARED float red[SK * RT * 16];
  SHARED float s_max[NW];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const uint p = GROUP_POS.y;
"""
    + ROLES
    + """\
  const uint hb = g & 1u;                         // the half of each 8-group block
  // MMA row g: weight row g / 2 of the tile; MMA row g + 8: weight row g / 2 + 4.
  const size_t ra = (size_t)inds[p] * NR + (GLU ? 8 : 16) * (active ? unit : 0) + g / 2;
  const size_t rb = GLU ? ra : ra + 8;
  const DEVICE uint4* qa = (const DEVICE uint4*)w_a + ra * G + 4 * hb + tq;
  const DEVICE uint4* qb = (const DEVICE uint4*)w_b + rb * G + 4 * hb + tq;
  const DEVICE uint8_t* ea = s_a + ra * G + 4 * hb + tq;
  const DEVICE uint8_t* eb = s_b + rb * G + 4 * hb + tq;
  const uint b0 = sk * GB;
  const uint b1 = b0 + GB < G ? b0 + GB : G;
  const bool work = active && b0 < b1;            // the whole warp agrees
  // One step: per block, the lane's group of weight rows g / 2 and g / 2 + 4 of both tiles
  // (4 rows x 128 contiguous bytes per warp load) and their scales. CS: read once.
#define KK_Q(q, i) (CS ? LOAD_STREAM(&(q)[i]) : (q)[i])
#define KK_LOAD(q, sc, bb)                                                          \\
  {                                                                                 \\
    _Pragma("unroll") for (int u = 0; u < NP; ++u) {                                \\
      q[4 * u] = KK_Q(qa, (bb) + 8 * u);                                            \\
      q[4 * u + 1] = KK_Q(qa, 4 * G + (bb) + 8 * u);                                \\
      q[4 * u + 2] = KK_Q(qb, (bb) + 8 * u);                                        \\
      q[4 * u + 3] = KK_Q(qb, 4 * G + (bb) + 8 * u);                                \\
      sc[4 * u] = ea[(bb) + 8 * u];                                                 \\
      sc[4 * u + 1] = ea[4 * G + (bb) + 8 * u];                                     \\
      sc[4 * u + 2] = eb[(bb) + 8 * u];                                             \\
      sc[4 * u + 3] = eb[4 * G + (bb) + 8 * u];                                     \\
    }                                                                               \\
  }
  uint4 qx[4 * NP], qy[4 * NP];
  uint sx[4 * NP], sy[4 * NP];
  if (work) KK_LOAD(qx, sx, b0);
  const DEVICE T* xr = x + (size_t)(GLU ? p / K : p) * KD;
"""
    + staging(
        "frag", "KD", "xr", "s_max", entries="(LO ? 8 : 4) * G", place=PLACE, lo="it >= 4 * G"
    )
    + """  BARRIER();

  float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;  // tile A rows g/2, g/2+4; B
"""
    + _step()
    + """  if (work && !PP) {
    for (uint b = b0; b < b1; b += GW) {
      if (b > b0) KK_LOAD(qx, sx, b);
      KK_STEP(qx, sx, b);
    }
  }
  if (work && PP) {
    for (uint b = b0; b < b1; b += 2 * GW) {
      const bool second = b + GW < b1;            // the whole warp agrees
      if (second) KK_LOAD(qy, sy, b + GW);
      KK_STEP(qx, sx, b);
      if (second) {
        if (b + 2 * GW < b1) KK_LOAD(qx, sx, b + 2 * GW);
        KK_STEP(qy, sy, b + GW);
      }
    }
  }
#undef KK_Q
#undef KK_LOAD
#undef KK_STEP
"""
    + LANES
    + """  KK_LANES();
  // ... and over its two halves (lanes g and g ^ 1).
  acc0 += SIMD_SHUFFLE_XOR(acc0, 4);
  acc1 += SIMD_SHUFFLE_XOR(acc1, 4);
  acc2 += SIMD_SHUFFLE_XOR(acc2, 4);
  acc3 += SIMD_SHUFFLE_XOR(acc3, 4);
  if (tq == 0 && hb == 0) {
    red[(sk * RT + rt) * 16 + g / 2] = acc0;
    red[(sk * RT + rt) * 16 + 4 + g / 2] = acc1;
    red[(sk * RT + rt) * 16 + 8 + g / 2] = acc2;
    red[(sk * RT + rt) * 16 + 12 + g / 2] = acc3;
  }
  BARRIER();

  // Entry i of a unit's 16 sums: tile A rows 0-7, then tile B rows 0-7.
  const uint ru = tid / 16;
  const uint i = tid % 16;
  const uint unit_out = GROUP_POS.x * RT + ru;
  if ((int)tid < RT * 16 && unit_out < UNITS) {
    if (GLU) {
      if (i < 8) {
        float gate = 0.0f, upv = 0.0f;
        for (int s = 0; s < SK; ++s) {
          gate += red[(s * RT + ru) * 16 + i];
          upv += red[(s * RT + ru) * 16 + 8 + i];
        }
        out[(size_t)p * NR + 8 * unit_out + i] =
            kk_situ_glu(gate * unscale, upv * unscale, params[0], params[1]);
      }
    } else {
      float total = 0.0f;
      for (int s = 0; s < SK; ++s) total += red[(s * RT + ru) * 16 + i];
      out[(size_t)p * NR + 16 * unit_out + i] = params[p] * (total * unscale);
    }
  }
"""
)

# Warps per threadgroup as row tiles (RT) x splits of a row's groups (SK), 8-group blocks per
# step (NP), and whether a step's loads go out during the previous step (PP).
LAUNCH = {"gate_up": (8, 1, 2, True), "down": (8, 1, 2, True)}
MIN_BLOCKS = {"gate_up": 1, "down": 1}


def template(dtype, KD, NR, K, glu, rt, sk, np_, pp=True, lo=None, cs=None):
    """``lo`` defaults to the activations' need: fp32 (fp32 latents, and ``h`` for down)."""
    return [
        ("T", dtype),
        ("KD", KD),
        ("NR", NR),
        ("K", K),
        ("GLU", glu),
        ("RT", rt),
        ("SK", sk),
        ("NP", np_),
        ("PP", pp),
        ("CS", STREAM_LOADS[_proj(glu)] if cs is None else cs),
        ("LO", (dtype == F32) if lo is None else lo),
    ]


def _instances() -> list:
    gu = [
        Instance(
            [dt, U32, U8, U32, U8, I32, F32],
            [F32],
            template(dt, K3["D"], K3["I"], 16, True, *LAUNCH["gate_up"]),
        )
        for dt in (mx.bfloat16, mx.float16, mx.float32)
    ]
    down = Instance(
        [F32, U32, U8, U32, U8, I32, F32],
        [F32],
        template(F32, K3["I"], K3["D"], 16, False, *LAUNCH["down"]),
    )
    return gu + [down]


MXFP4_LINES = Kernel(
    "mxfp4_lines",
    ["x", "w_a", "s_a", "w_b", "s_b", "inds", "params"],
    ["out"],
    BODY,
    header=MMA_HEADER,
    instances=_instances(),
)


def whole_steps(KD, shape):
    """``shape`` with one block per step where KD's blocks are no multiple of its NP."""
    rt, sk, np_, pp = shape[:4]
    return (rt, sk, 1 if (KD // 256) % np_ else np_, pp, *shape[4:])


def launch(kernel, shape, backend, x, wa, sa, wb, sb, inds, params, KD, NR, k, glu):
    """One projection for every (token, choice) pair: gate/up + SiTU-GLU, or down."""
    rt, sk = shape[:2]
    units = NR // 8 if glu else NR // 16
    (out,) = kernel(
        backend,
        inputs=[x, wa, sa, wb, sb, inds, params],
        output_shapes=[(inds.size, NR)],
        output_dtypes=[F32],
        grid=(32 * rt * sk * -(-units // rt), inds.size, 1),
        threadgroup=(32 * rt * sk, 1, 1),
        template=template(x.dtype, KD, NR, k, glu, *shape),
    )
    return out


def expert_glu_decode(z, w, inds, weights, beta, cap, backend: str | None = None):
    """``mxfp4_mma.expert_glu_decode`` with whole-line loads (same shapes and return: fp32
    [N, D]). Needs ``eligible`` inputs."""
    backend = backend or default_backend()
    N, k = inds.shape
    D = z.shape[-1]
    I = w["w1"][0].shape[-2]
    flat = inds.reshape(-1).astype(I32)

    def project(x, wa, sa, wb, sb, params, KD, NR, glu):
        proj = _proj(glu)
        shape = whole_steps(KD, LAUNCH[proj])
        kernel = MXFP4_LINES.bounded(32 * shape[0] * shape[1], MIN_BLOCKS[proj])
        return launch(kernel, shape, backend, x, wa, sa, wb, sb, flat, params, KD, NR, k, glu)

    h = project(z, *w["w1"], *w["w3"], constant((beta, cap)), D, I, True)
    wts = weights.reshape(-1).astype(F32)
    part = project(h, *w["w2"], *w["w2"], wts, I, D, False)
    return sum_pairs(backend, part, N, k)


def eligible(z, w, inds) -> bool:
    """What ``mxfp4_mma.eligible`` accepts, with D and I multiples of 256 (whole 8-group
    blocks)."""
    from . import mxfp4_mma

    D = z.shape[-1] if z.ndim == 2 else 0
    I = w["w1"][0].shape[-2]
    return mxfp4_mma.eligible(z, w, inds) and D % 256 == 0 and I % 256 == 0
