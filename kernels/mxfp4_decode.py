"""MXFP4 expert decode: the chosen experts of a few tokens, every weight byte read once per pair.

Two launches per MoE layer, for ``N * k`` (token, choice) pairs:

1. ``mxfp4_gate_up``: one threadgroup per (pair, block of ``NSG * R`` rows of I); each
   simdgroup owns ``R`` rows of gate and of up. Each lane takes a whole 32-code scale group
   of a row with one 128-bit load plus its scale byte, for all of its rows before any math;
   codes decode through a 16-entry E2M1 table and scales through a 256-entry E8M0 table in
   threadgroup memory, against the token's latent staged once in fp32. One SIMD sum per
   row, then SiTU-GLU: ``h [N*k, I]`` fp32.
2. ``mxfp4_down``: one threadgroup per (token, ``R`` rows of D); its simdgroups split the k
   choices, read w2 the same way against ``h`` and scale by the routing weight. Partial sums
   meet in threadgroup memory: ``y [N, D]`` fp32, no atomics.

Two other decode variants (one 32-bit word per lane per row; half the rows per simdgroup)
were measured slower on the H200 (docs/benchmarks.md) and removed.

Weights are read where they lie: ``w`` may be the resident stack or the streamer's cache
slots, and ``inds`` indexes its leading axis.
"""

from __future__ import annotations

import mlx.core as mx

from .source import Instance, Kernel
from .source import backend as default_backend

# Shared with mxfp4_prefill: the E2M1 table entry for a code, SiTU-GLU, and one word's dot
# product with 8 latent values held as two float4 (the table is the body's `lut` array).
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
#define KK_DOT8(q, a, b)                                                                \\
  ((a).x * lut[(q) & 15u] + (a).y * lut[((q) >> 4) & 15u] + (a).z * lut[((q) >> 8) & 15u] + \\
   (a).w * lut[((q) >> 12) & 15u] + (b).x * lut[((q) >> 16) & 15u] +                    \\
   (b).y * lut[((q) >> 20) & 15u] + (b).z * lut[((q) >> 24) & 15u] + (b).w * lut[(q) >> 28])
"""

GATE_UP_BODY = """
  constexpr int G = D / 32;           // scale groups (= 16-byte chunks) per row
  SHARED float lut[16];
  SHARED float e8m0[256];
  SHARED float4 zs[D / 4];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint p = GROUP_POS.y;
  if (tid < 16) lut[tid] = kk_e2m1(tid);
  for (uint i = tid; i < 256; i += GROUP_SIZE.x) e8m0[i] = kk_e8m0(i);
  for (uint i = tid; i < D / 4; i += GROUP_SIZE.x) {
    const DEVICE T* src = z + (size_t)(p / K) * D + 4 * i;
    float4 a;
    a.x = static_cast<float>(src[0]); a.y = static_cast<float>(src[1]);
    a.z = static_cast<float>(src[2]); a.w = static_cast<float>(src[3]);
    zs[(i % 8) * G + i / 8] = a;
  }
  BARRIER();

  const uint row0 = (GROUP_POS.x * NSG + SIMDGROUP) * R;
  const size_t first = (size_t)inds[p] * I + row0;
  const DEVICE uint4* q1 = (const DEVICE uint4*)(w1 + first * (D / 8));
  const DEVICE uint4* q3 = (const DEVICE uint4*)(w3 + first * (D / 8));
  const DEVICE uint8_t* e1 = s1 + first * G;
  const DEVICE uint8_t* e3 = s3 + first * G;
  float gate[R], up[R];
#pragma unroll
  for (int r = 0; r < R; ++r) gate[r] = up[r] = 0.0f;
#pragma unroll
  for (int it = 0; it < (G + 31) / 32; ++it) {
    const uint g = lane + 32 * it;
    if (g < G) {
      uint4 qg[R], qu[R];
      float sg[R], su[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (row0 + r < I) {
          qg[r] = q1[r * G + g];
          qu[r] = q3[r * G + g];
          sg[r] = e8m0[e1[r * G + g]];
          su[r] = e8m0[e3[r * G + g]];
        } else {
          qg[r].x = qg[r].y = qg[r].z = qg[r].w = 0u;
          qu[r].x = qu[r].y = qu[r].z = qu[r].w = 0u;
          sg[r] = su[r] = 0.0f;
        }
      }
      float dg[R], du[R];
#pragma unroll
      for (int r = 0; r < R; ++r) dg[r] = du[r] = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 a = zs[(2 * j) * G + g];
        const float4 b = zs[(2 * j + 1) * G + g];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint wg = j == 0 ? qg[r].x : j == 1 ? qg[r].y : j == 2 ? qg[r].z : qg[r].w;
          const uint wu = j == 0 ? qu[r].x : j == 1 ? qu[r].y : j == 2 ? qu[r].z : qu[r].w;
          dg[r] += KK_DOT8(wg, a, b);
          du[r] += KK_DOT8(wu, a, b);
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        gate[r] += sg[r] * dg[r];
        up[r] += su[r] * du[r];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    gate[r] = SIMD_SUM(gate[r]);
    up[r] = SIMD_SUM(up[r]);
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r < I) h[(size_t)p * I + row0 + r] = kk_situ_glu(gate[r], up[r], act[0], act[1]);
    }
  }
"""

# The down projection: the same 128-bit group loads for R rows of w2; h's 32 values of the
# group are 8 global float4 loads (the threadgroups of one token read the same rows of h,
# mostly from L1). Simdgroups split the k choices; partial sums meet in threadgroup memory.
DOWN_BODY = """
  constexpr int G = I / 32;
  SHARED float lut[16];
  SHARED float e8m0[256];
  SHARED float part[NSG * R];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint sg = SIMDGROUP;
  const uint n = GROUP_POS.y;
  const uint row0 = GROUP_POS.x * R;
  if (tid < 16) lut[tid] = kk_e2m1(tid);
  for (uint i = tid; i < 256; i += GROUP_SIZE.x) e8m0[i] = kk_e8m0(i);
  BARRIER();

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (uint j = sg; j < K; j += NSG) {
    const uint p = n * K + j;
    const size_t first = (size_t)inds[p] * D + row0;
    const DEVICE uint4* q2 = (const DEVICE uint4*)(w2 + first * (I / 8));
    const DEVICE uint8_t* e2 = s2 + first * G;
    const DEVICE float4* hv = (const DEVICE float4*)(h + (size_t)p * I);
    float dot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) dot[r] = 0.0f;
#pragma unroll
    for (int it = 0; it < (G + 31) / 32; ++it) {
      const uint g = lane + 32 * it;
      if (g < G) {
        uint4 q[R];
        float sc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (row0 + r < D) {
            q[r] = q2[r * G + g];
            sc[r] = e8m0[e2[r * G + g]];
          } else {
            q[r].x = q[r].y = q[r].z = q[r].w = 0u;
            sc[r] = 0.0f;
          }
        }
        float d[R];
#pragma unroll
        for (int r = 0; r < R; ++r) d[r] = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float4 a = hv[8 * g + 2 * w];
          const float4 b = hv[8 * g + 2 * w + 1];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint qw = w == 0 ? q[r].x : w == 1 ? q[r].y : w == 2 ? q[r].z : q[r].w;
            d[r] += KK_DOT8(qw, a, b);
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) dot[r] += sc[r] * d[r];
      }
    }
    const float wt = weights[p];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += wt * dot[r];
  }
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = SIMD_SUM(acc[r]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) part[sg * R + r] = acc[r];
  }
  BARRIER();
  if (tid < R && row0 + tid < D) {
    float total = 0.0f;
    for (int s = 0; s < NSG; ++s) total += part[s * R + tid];
    y[(size_t)n * D + row0 + tid] = total;
  }
"""

GATE_UP_SIMDGROUPS = 8
GATE_UP_ROWS = 4  # rows of gate and of up per simdgroup
DOWN_ROWS = 4  # rows of D per down threadgroup
DOWN_SIMDGROUPS = 8  # at most; fewer when k is smaller

K3 = {"D": 3584, "I": 3072, "K": 16}
U32, U8, F32, I32 = mx.uint32, mx.uint8, mx.float32, mx.int32


def gate_up_template(dtype, D, I, K):
    return [
        ("T", dtype),
        ("D", D),
        ("I", I),
        ("K", K),
        ("R", GATE_UP_ROWS),
        ("NSG", GATE_UP_SIMDGROUPS),
    ]


def down_template(D, I, K):
    return [("D", D), ("I", I), ("K", K), ("R", DOWN_ROWS), ("NSG", min(K, DOWN_SIMDGROUPS))]


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
    ["y"],
    DOWN_BODY,
    header=HEADER,
    instances=[Instance([F32, U32, U8, I32, F32], [F32], down_template(**K3))],
)

_ACT: dict = {}


def act_params(beta: float, cap: float) -> mx.array:
    """``[beta, cap]`` as the small fp32 input the kernels read (one array per value pair)."""
    key = (float(beta), float(cap))
    if key not in _ACT:
        _ACT[key] = mx.array(key, dtype=mx.float32)
    return _ACT[key]


def expert_glu_decode(z, w, inds, weights, beta, cap, backend: str | None = None):
    """``kimi_k3.experts.expert_glu_reference`` in two launches, for few tokens.

    Shapes: z [N, D]; w as ``expert_glu_reference`` (leading axis: experts or cache slots);
    inds [N, k]; weights [N, k]. Returns fp32 [N, D]. The 128-bit loads need 16-byte aligned
    weight rows, which whole experts or slots of a stack are.
    """
    backend = backend or default_backend()
    N, k = inds.shape
    D = z.shape[-1]
    I = w["w1"][0].shape[-2]
    flat = inds.reshape(-1).astype(I32)
    (h,) = MXFP4_GATE_UP(
        backend,
        inputs=[z, *w["w1"], *w["w3"], flat, act_params(beta, cap)],
        output_shapes=[(N * k, I)],
        output_dtypes=[F32],
        grid=(32 * GATE_UP_SIMDGROUPS * -(-I // (GATE_UP_ROWS * GATE_UP_SIMDGROUPS)), N * k, 1),
        threadgroup=(32 * GATE_UP_SIMDGROUPS, 1, 1),
        template=gate_up_template(z.dtype, D, I, k),
    )
    nsg = min(k, DOWN_SIMDGROUPS)
    (y,) = MXFP4_DOWN(
        backend,
        inputs=[h, *w["w2"], flat, weights.reshape(-1).astype(F32)],
        output_shapes=[(N, D)],
        output_dtypes=[F32],
        grid=(32 * nsg * -(-D // DOWN_ROWS), N, 1),
        threadgroup=(32 * nsg, 1, 1),
        template=down_template(D, I, k),
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
