"""MXFP4 expert decode: the chosen experts of a few tokens, every weight byte read once per pair.

Three launches per MoE layer, for ``N * k`` (token, choice) pairs:

1. ``mxfp4_gate_up``: one threadgroup per (pair, tile of ``TILE`` rows of I). It stages the
   token's latent once in fp32 (a padded layout, free of bank conflicts on both sides); each
   simdgroup walks its sets of ``R`` rows of gate and of up, and for a set issues every
   128-bit load (a whole 32-code scale group per lane) and every scale byte before any math.
   Codes decode through a 16-entry E2M1 table in threadgroup memory, scales from their
   exponent bits. One SIMD sum per row, then SiTU-GLU: ``h [N*k, I]`` fp32.
2. ``mxfp4_down``: the same per (pair, tile of rows of D) with the pair's ``h`` staged once,
   each row scaled by the pair's routing weight: ``part [N*k, D]`` fp32.
3. ``mxfp4_sum``: ``y [N, D]``, the k pairs of each token added in order (no atomics, so
   results do not depend on scheduling).

The first version (one threadgroup per 32 rows, the latent staged per threadgroup, the k
choices of the down projection meeting in threadgroup memory) and two others were measured
slower on the H200 (docs/benchmarks.md) and removed; ``LAUNCH`` holds the launch shape the
same measurement picked.

Weights are read where they lie: ``w`` may be the resident stack or the streamer's cache
slots, and ``inds`` indexes its leading axis.
"""

from __future__ import annotations

import mlx.core as mx

from .expert_bodies import DOWN, GATE_UP, fill
from .source import Instance, Kernel, constant
from .source import backend as default_backend

# Shared with mxfp4_prefill: the E2M1 table entry for a code, SiTU-GLU (which the affine
# kernels take from here too), and one word's dot product with 8 latent values held as two
# float4 (the table is the body's `lut` array).
HEADER = """
HELPER float kk_e2m1(uint c) {
  uint m = c & 7u;
  float mag = m < 4u ? 0.5f * float(m) : (m < 6u ? float(m) - 2.0f : 2.0f * float(m) - 8.0f);
  return (c & 8u) ? -mag : mag;
}
HELPER float kk_situ_glu(float g, float u, float beta, float cap) {
  return beta * TANH(g / beta) / (1.0f + EXP(-g)) * cap * TANH(u / cap);
}
HELPER float kk_e8m0(uint s) { return ldexp(1.0f, int(s) - 127); }
// E8M0 from its exponent bits (2^-127, the one subnormal, by ldexp)
HELPER float kk_e8m0_bits(uint s) { return s ? AS_FLOAT(s << 23) : ldexp(1.0f, -127); }
#define KK_DOT8(q, a, b)                                                                \\
  ((a).x * lut[(q) & 15u] + (a).y * lut[((q) >> 4) & 15u] + (a).z * lut[((q) >> 8) & 15u] + \\
   (a).w * lut[((q) >> 12) & 15u] + (b).x * lut[((q) >> 16) & 15u] +                    \\
   (b).y * lut[((q) >> 20) & 15u] + (b).z * lut[((q) >> 24) & 15u] + (b).w * lut[(q) >> 28])
"""

# Gate and up: a threadgroup owns a tile of TILE rows of one pair and stages its latent
# once; each simdgroup walks its sets of R rows, every 128-bit code load and scale byte of
# a set issued before any math (2 R IT loads in flight per lane).
GATE_UP_BODY = fill(
    GATE_UP,
    "mxfp4_gate_up",
    STAGE="""\
  constexpr int G = D / 32;           // 16-byte chunks (scale groups) per row
  constexpr int IT = (G + 31) / 32;   // chunks per lane per row
  constexpr int GP = G + 1;           // padded stride of the staged latent
  SHARED float lut[16];
  SHARED float4 zs[8 * GP];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint p = GROUP_POS.y;
  if (tid < 16) lut[tid] = kk_e2m1(tid);
  for (uint i = tid; i < D / 4; i += GROUP_SIZE.x) {
    const DEVICE T* src = z + (size_t)(p / K) * D + 4 * i;
    float4 a;
    a.x = static_cast<float>(src[0]); a.y = static_cast<float>(src[1]);
    a.z = static_cast<float>(src[2]); a.w = static_cast<float>(src[3]);
    zs[(i % 8) * GP + i / 8] = a;
  }
  BARRIER();
""",
    LOADS="""\
    uint4 qg[R][IT], qu[R][IT];
    uint sg[R][IT], su[R][IT];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool ok = row0 + r < tile1;
      const size_t row = e0 + row0 + (ok ? r : 0);
      const DEVICE uint4* q1 = (const DEVICE uint4*)(w1 + row * (D / 8));
      const DEVICE uint4* q3 = (const DEVICE uint4*)(w3 + row * (D / 8));
#pragma unroll
      for (int it = 0; it < IT; ++it) {
        const uint g = lane + 32 * it;
        const bool in = ok && g < G;
        const uint gg = in ? g : 0;
        qg[r][it] = q1[gg];
        qu[r][it] = q3[gg];
        sg[r][it] = in ? uint(s1[row * G + gg]) : 0u;
        su[r][it] = in ? uint(s3[row * G + gg]) : 0u;
      }
    }
""",
    DOTS="""\
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const uint g = lane + 32 * it;
      if (g < G) {
        float dg[R], du[R];
#pragma unroll
        for (int r = 0; r < R; ++r) dg[r] = du[r] = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float4 a = zs[(2 * j) * GP + g];
          const float4 b = zs[(2 * j + 1) * GP + g];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint4 vg = qg[r][it];
            const uint4 vu = qu[r][it];
            const uint wg = j == 0 ? vg.x : j == 1 ? vg.y : j == 2 ? vg.z : vg.w;
            const uint wu = j == 0 ? vu.x : j == 1 ? vu.y : j == 2 ? vu.z : vu.w;
            dg[r] += KK_DOT8(wg, a, b);
            du[r] += KK_DOT8(wu, a, b);
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          gate[r] += kk_e8m0_bits(sg[r][it]) * dg[r];
          up[r] += kk_e8m0_bits(su[r][it]) * du[r];
        }
      }
    }
""",
)

# The down projection: per (pair, tile of TILE rows of D) with the pair's h staged once, the
# same loads-first row sets; each pair's rows, scaled by its routing weight, land in
# ``part [N*k, D]``, and ``mxfp4_sum`` adds the k pairs of each token in order (no atomics).
DOWN_BODY = fill(
    DOWN,
    "mxfp4_down",
    STAGE="""\
  constexpr int G = I / 32;
  constexpr int IT = (G + 31) / 32;
  constexpr int GP = G + 1;
  SHARED float lut[16];
  SHARED float4 hs[8 * GP];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint p = GROUP_POS.y;
  if (tid < 16) lut[tid] = kk_e2m1(tid);
  for (uint i = tid; i < I / 4; i += GROUP_SIZE.x) {
    hs[(i % 8) * GP + i / 8] = ((const DEVICE float4*)(h + (size_t)p * I))[i];
  }
  BARRIER();
""",
    LOADS="""\
    uint4 q[R][IT];
    uint sc[R][IT];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool ok = row0 + r < tile1;
      const size_t row = e0 + row0 + (ok ? r : 0);
      const DEVICE uint4* q2 = (const DEVICE uint4*)(w2 + row * (I / 8));
#pragma unroll
      for (int it = 0; it < IT; ++it) {
        const uint g = lane + 32 * it;
        const bool in = ok && g < G;
        const uint gg = in ? g : 0;
        q[r][it] = q2[gg];
        sc[r][it] = in ? uint(s2[row * G + gg]) : 0u;
      }
    }
""",
    DOTS="""\
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const uint g = lane + 32 * it;
      if (g < G) {
        float d[R];
#pragma unroll
        for (int r = 0; r < R; ++r) d[r] = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float4 a = hs[(2 * j) * GP + g];
          const float4 b = hs[(2 * j + 1) * GP + g];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint4 v = q[r][it];
            const uint qw = j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
            d[r] += KK_DOT8(qw, a, b);
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += kk_e8m0_bits(sc[r][it]) * d[r];
      }
    }
""",
)

# y[n, d] = sum over the k pairs of token n, in order.
SUM_BODY = """
  const uint d = GRID_X;
  const uint n = GROUP_POS.y;
  if (d < D) {
    float total = 0.0f;
    for (int j = 0; j < K; ++j) total += part[((size_t)n * K + j) * D + d];
    y[(size_t)n * D + d] = total;
  }
"""

K3 = {"D": 3584, "I": 3072, "K": 16}
U32, U8, F32, I32 = mx.uint32, mx.uint8, mx.float32, mx.int32


# Launch shape: rows per simdgroup set, simdgroups, rows per threadgroup tile (measured).
LAUNCH = {"gate_up": (1, 8, 96), "down": (4, 8, 128)}


def launch_template(shape: tuple) -> list:
    """A launch shape (``LAUNCH``'s values) as template values."""
    R, NSG, TILE = shape
    return [("R", R), ("NSG", NSG), ("TILE", TILE)]


def gate_up_template(dtype, D, I, K):
    return [("T", dtype), ("D", D), ("I", I), ("K", K)] + launch_template(LAUNCH["gate_up"])


def down_template(D, I, K):
    return [("D", D), ("I", I)] + launch_template(LAUNCH["down"])


MXFP4_GATE_UP = Kernel(
    "mxfp4_gate_up",
    ["z", "w1", "s1", "w3", "s3", "inds", "act"],
    ["h"],
    GATE_UP_BODY,
    header=HEADER,
    instances=[
        Instance([dt, U32, U8, U32, U8, I32, F32], [F32], gate_up_template(dt, **K3))
        for dt in (mx.bfloat16, mx.float16, mx.float32)
    ],
)

MXFP4_DOWN = Kernel(
    "mxfp4_down",
    ["h", "w2", "s2", "inds", "weights"],
    ["part"],
    DOWN_BODY,
    header=HEADER,
    instances=[Instance([F32, U32, U8, I32, F32], [F32], down_template(**K3))],
)

MXFP4_SUM = Kernel(
    "mxfp4_sum",
    ["part"],
    ["y"],
    SUM_BODY,
    instances=[Instance([F32], [F32], [("D", K3["D"]), ("K", K3["K"])])],
)


def expert_glu_decode(z, w, inds, weights, beta, cap, backend: str | None = None):
    """``kimi_k3.model.experts.expert_glu_reference`` in three launches, for few tokens.

    Shapes: z [N, D]; w as ``expert_glu_reference`` (leading axis: experts or cache slots);
    inds [N, k]; weights [N, k]. Returns fp32 [N, D]. The 128-bit loads need 16-byte aligned
    weight rows, which whole experts or slots of a stack are.
    """
    gate_up, down = (MXFP4_GATE_UP, gate_up_template), (MXFP4_DOWN, down_template)
    return glu_decode(backend or default_backend(), gate_up, down, z, w, inds, weights, beta, cap)


def glu_decode(backend: str, gate_up, down, z, w, inds, weights, beta, cap):
    """The three decode launches, whatever the experts' format: ``gate_up`` = (kernel, its
    template for ``(dtype, D, I, K)``) writes ``h [N*k, I]``, ``down`` = (kernel, its template
    for ``(D, I, K)``) writes the weighted ``part [N*k, D]``, and ``sum_pairs`` adds each
    token's pairs. The kernels take ``MXFP4_GATE_UP``'s and ``MXFP4_DOWN``'s inputs with each
    matrix as ``w`` holds it; a grid follows its template's ``NSG`` and ``TILE``."""
    N, k = inds.shape
    D = z.shape[-1]
    I = w["w1"][0].shape[-2]
    flat = inds.reshape(-1).astype(I32)

    def launch(kernel, template, inputs, rows):
        nsg, tile = dict(template)["NSG"], dict(template)["TILE"]
        (out,) = kernel(
            backend,
            inputs=inputs,
            output_shapes=[(N * k, rows)],
            output_dtypes=[F32],
            grid=(32 * nsg * -(-rows // tile), N * k, 1),
            threadgroup=(32 * nsg, 1, 1),
            template=template,
        )
        return out

    act = constant((beta, cap))
    h = launch(gate_up[0], gate_up[1](z.dtype, D, I, k), [z, *w["w1"], *w["w3"], flat, act], I)
    wts = weights.reshape(-1).astype(F32)
    part = launch(down[0], down[1](D, I, k), [h, *w["w2"], flat, wts], D)
    return sum_pairs(backend, part, N, k)


def sum_pairs(backend: str, part, N: int, k: int):
    """``mxfp4_sum``: ``y [N, D]`` from the weighted pairs ``part [N*k, D]``, k per token in
    order."""
    D = part.shape[-1]
    (y,) = MXFP4_SUM(
        backend,
        inputs=[part],
        output_shapes=[(N, D)],
        output_dtypes=[F32],
        grid=(256 * -(-D // 256), N, 1),
        threadgroup=(256, 1, 1),
        template=[("D", D), ("K", k)],
    )
    return y


def eligible(z, w, inds) -> bool:
    """Inputs both expert kernels serve: 2-D float latents, MLX mxfp4 stacks of matching
    shapes (D and I multiples of 32), a latent that fits threadgroup memory in fp32."""
    if z.ndim != 2 or z.dtype not in (mx.float32, mx.bfloat16, mx.float16) or inds.ndim != 2:
        return False
    N, D = z.shape
    (q1, e1), (q3, e3), (q2, e2) = w["w1"], w["w3"], w["w2"]
    E, I = q1.shape[:2]
    shapes_ok = (
        q1.shape == q3.shape == (E, I, D // 8)
        and e1.shape == e3.shape == (E, I, D // 32)
        and q2.shape == (E, D, I // 8)
        and e2.shape == (E, D, I // 32)
    )
    dtypes_ok = all(q.dtype == U32 and e.dtype == U8 for q, e in (w["w1"], w["w3"], w["w2"]))
    return (
        shapes_ok
        and dtypes_ok
        and D % 32 == 0
        and I % 32 == 0
        and 4 * D <= 28 * 1024
        and inds.shape[0] == N
    )
