"""Affine expert decode: lower-bit experts (2 or 3 bits) for a few tokens, each weight byte
read once per (token, choice) pair.

The experts the converter requantizes (``--expert-bits 3`` or ``2``) are MLX ``affine``
stacks: per matrix ``weight`` uint32 [E, O, In * BITS / 32] (a little-endian bit stream of
codes, MLX's packing), float16 ``scales`` and ``biases`` [E, O, In / GS]; weight = s q + b.
A group's dot product is ``s * sum_j q_j x_j + b * sum_j x_j``, so the latent's sum per group
is taken once per pair and a code costs one multiply-add.

Three launches, as ``mxfp4_decode``'s:

1. ``affine_gate_up``: one threadgroup per (pair, tile of ``TILE`` rows of I). It stages the
   token's latent once in fp32 (group-major with a pad, free of bank conflicts on both
   sides) and each group's sum. Lane ``l`` takes groups ``l, l + 32, ...`` of a row; for a set
   of ``R`` rows it issues every code load (``GS * BITS / 64`` 8-byte loads a group) and
   scale and bias load before any math, and takes codes out of the words with shifts fixed
   at compile time. One SIMD sum per row, then SiTU-GLU: ``h [N*k, I]`` fp32.
2. ``affine_down``: the same per (pair, tile of rows of D) with the pair's ``h`` staged once,
   each row scaled by the pair's routing weight: ``part [N*k, D]`` fp32.
3. ``mxfp4_decode.sum_pairs``: the k pairs of each token added in order.

Weights are read where they lie (the resident stacks or the streamer's slots); ``inds``
indexes their leading axis. The launch shape is ``mxfp4_decode``'s, not tuned for these
formats.
"""

from __future__ import annotations

import mlx.core as mx

from .mxfp4_decode import HEADER, K3, sum_pairs
from .source import Instance, Kernel, constant
from .source import backend as default_backend

BITS = (2, 3)  # the code widths the kernels take
GROUPS = (64, 128)  # group sizes: a group's codes are whole 8-byte words at both widths

# Code c of a group's words q[]: BITS bits from bit BITS c of the stream (c a constant once
# the loops unroll, so the word and the shift are too).
CODE = """
#define KK_BIT(c) (BITS * (c))
#define KK_SPILL(q, c) \\
  (KK_BIT(c) % 32 + BITS > 32 ? (q)[(KK_BIT(c) / 32 + 1) % WG] << (32 - KK_BIT(c) % 32) : 0u)
#define KK_CODE(q, c) ((((q)[KK_BIT(c) / 32] >> (KK_BIT(c) % 32)) | KK_SPILL(q, c)) & MASK)
"""

# Staging of a row vector (the latent, or h) and its per-group sums, shared by both bodies.
STAGE = """
  constexpr int G = KD / GS;          // groups per row
  constexpr int IT = (G + 31) / 32;   // groups per lane per row
  constexpr int WG = GS * BITS / 32;  // code words per group (even)
  constexpr int Q = GS / 4;           // float4 per group
  constexpr int GP = G + 1;           // padded stride of the staged vector
  constexpr uint MASK = (1u << BITS) - 1u;
  SHARED float4 xs[Q * GP];
  SHARED float xsum[G];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint p = GROUP_POS.y;
  for (uint i = tid; i < KD / 4; i += GROUP_SIZE.x) {
    const DEVICE T* src = x + (size_t)(XROW) * KD + 4 * i;
    float4 a;
    a.x = static_cast<float>(src[0]); a.y = static_cast<float>(src[1]);
    a.z = static_cast<float>(src[2]); a.w = static_cast<float>(src[3]);
    xs[(i % Q) * GP + i / Q] = a;
  }
  BARRIER();
  for (uint g = tid; g < G; g += GROUP_SIZE.x) {
    float t = 0.0f;
    for (int j = 0; j < Q; ++j) {
      const float4 a = xs[j * GP + g];
      t += (a.x + a.y) + (a.z + a.w);
    }
    xsum[g] = t;
  }
  BARRIER();
"""

# Loads of one matrix's set of R rows (codes, scale, bias of each of a lane's groups), then
# the dot products: MAT names the matrix (its inputs wM, sM, bM), ACC the row sums.
LOADS = """
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const bool ok = row0 + r < tile1;
      const size_t row = e0 + row0 + (ok ? r : 0);
#pragma unroll
      for (int it = 0; it < IT; ++it) {
        const uint g = lane + 32 * it;
        const bool in = ok && g < G;
        const uint gg = in ? g : 0;
        const DEVICE uint2* src = (const DEVICE uint2*)(wMAT + (row * G + gg) * WG);
#pragma unroll
        for (int v = 0; v < WG / 2; ++v) {
          const uint2 pair = src[v];
          qMAT[r][it][2 * v] = pair.x;
          qMAT[r][it][2 * v + 1] = pair.y;
        }
        sMAT_[r][it] = in ? static_cast<float>(sMAT[row * G + gg]) : 0.0f;
        bMAT_[r][it] = in ? static_cast<float>(bMAT[row * G + gg]) : 0.0f;
      }
    }
"""

DOTS = """
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const uint g = lane + 32 * it;
      if (g < G) {
        const float xg = xsum[g];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float d = 0.0f;
#pragma unroll
          for (int j = 0; j < Q; ++j) {
            const float4 a = xs[j * GP + g];
            d += float(KK_CODE(qMAT[r][it], 4 * j)) * a.x;
            d += float(KK_CODE(qMAT[r][it], 4 * j + 1)) * a.y;
            d += float(KK_CODE(qMAT[r][it], 4 * j + 2)) * a.z;
            d += float(KK_CODE(qMAT[r][it], 4 * j + 3)) * a.w;
          }
          ACC[r] += sMAT_[r][it] * d + bMAT_[r][it] * xg;
        }
      }
    }
"""


def _mat(text: str, mat: str, acc: str = "") -> str:
    return text.replace("MAT", mat).replace("ACC", acc)


GATE_UP_BODY = (
    _mat(STAGE, "")
    .replace("XROW", "p / K")
    .replace("const DEVICE T* src = x", "const DEVICE T* src = z")
    + """
  const uint tile0 = GROUP_POS.x * TILE;
  const uint tile1 = tile0 + TILE < I ? tile0 + TILE : I;
  const size_t e0 = (size_t)inds[p] * I;
  for (uint row0 = tile0 + SIMDGROUP * R; row0 < tile1; row0 += NSG * R) {
    uint q1[R][IT][WG], q3[R][IT][WG];
    float s1_[R][IT], b1_[R][IT], s3_[R][IT], b3_[R][IT];
"""
    + _mat(LOADS, "1")
    + _mat(LOADS, "3")
    + """
    float gate[R], up[R];
#pragma unroll
    for (int r = 0; r < R; ++r) gate[r] = up[r] = 0.0f;
"""
    + _mat(DOTS, "1", "gate")
    + _mat(DOTS, "3", "up")
    + """
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
)

DOWN_BODY = (
    _mat(STAGE, "")
    .replace("XROW", "p")
    .replace("const DEVICE T* src = x", "const DEVICE float* src = h")
    + """
  const float wt = weights[p];
  const uint tile0 = GROUP_POS.x * TILE;
  const uint tile1 = tile0 + TILE < D ? tile0 + TILE : D;
  const size_t e0 = (size_t)inds[p] * D;
  for (uint row0 = tile0 + SIMDGROUP * R; row0 < tile1; row0 += NSG * R) {
    uint q2[R][IT][WG];
    float s2_[R][IT], b2_[R][IT];
"""
    + _mat(LOADS, "2")
    + """
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
"""
    + _mat(DOTS, "2", "acc")
    + """
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
)

U32, F16, F32, I32 = mx.uint32, mx.float16, mx.float32, mx.int32
# Launch shape: rows per simdgroup set, simdgroups, rows per threadgroup tile
# (mxfp4_decode's).
LAUNCH = {"gate_up": (1, 8, 96), "down": (4, 8, 128)}


def gate_up_template(dtype, D, I, K, bits, gs):
    R, NSG, TILE = LAUNCH["gate_up"]
    return [
        ("T", dtype),
        ("KD", D),
        ("I", I),
        ("K", K),
        ("BITS", bits),
        ("GS", gs),
        ("R", R),
        ("NSG", NSG),
        ("TILE", TILE),
    ]


def down_template(D, I, bits, gs):
    R, NSG, TILE = LAUNCH["down"]
    return [
        ("KD", I),
        ("D", D),
        ("BITS", bits),
        ("GS", gs),
        ("R", R),
        ("NSG", NSG),
        ("TILE", TILE),
    ]


AFFINE_GATE_UP = Kernel(
    "affine_gate_up",
    ["z", "w1", "s1", "b1", "w3", "s3", "b3", "inds", "act"],
    ["h"],
    GATE_UP_BODY,
    header=HEADER + CODE,
    instances=[
        Instance(
            [dt, U32, F16, F16, U32, F16, F16, I32, F32],
            [F32],
            gate_up_template(dt, K3["D"], K3["I"], K3["K"], bits, 64),
        )
        for dt in (mx.bfloat16, mx.float16, mx.float32)
        for bits in BITS
    ],
)

AFFINE_DOWN = Kernel(
    "affine_down",
    ["h", "w2", "s2", "b2", "inds", "weights"],
    ["part"],
    DOWN_BODY,
    header=HEADER + CODE,
    instances=[
        Instance([F32, U32, F16, F16, I32, F32], [F32], down_template(K3["D"], K3["I"], bits, 64))
        for bits in BITS
    ],
)


def params(w) -> tuple[int, int]:
    """``(bits, group size)`` of affine stacks ``w`` (read off the shapes)."""
    q1, s1 = w["w1"][0], w["w1"][1]
    D = w["w2"][0].shape[-2]
    return q1.shape[-1] * 32 // D, D // s1.shape[-1]


def expert_glu_decode(z, w, inds, weights, beta, cap, backend: str | None = None):
    """``kimi_k3.model.experts.expert_glu_reference`` on affine stacks in three launches.

    Shapes: z [N, D]; w maps ``w1``/``w3``/``w2`` to ``(weight, scales, biases)`` (leading
    axis: experts or cache slots); inds [N, k]; weights [N, k]. Returns fp32 [N, D].
    """
    backend = backend or default_backend()
    N, k = inds.shape
    D = z.shape[-1]
    I = w["w1"][0].shape[-2]
    bits, gs = params(w)
    flat = inds.reshape(-1).astype(I32)
    _, nsg, tile = LAUNCH["gate_up"]
    (h,) = AFFINE_GATE_UP(
        backend,
        inputs=[z, *w["w1"], *w["w3"], flat, constant((beta, cap))],
        output_shapes=[(N * k, I)],
        output_dtypes=[F32],
        grid=(32 * nsg * -(-I // tile), N * k, 1),
        threadgroup=(32 * nsg, 1, 1),
        template=gate_up_template(z.dtype, D, I, k, bits, gs),
    )
    _, nsg, tile = LAUNCH["down"]
    (part,) = AFFINE_DOWN(
        backend,
        inputs=[h, *w["w2"], flat, weights.reshape(-1).astype(F32)],
        output_shapes=[(N * k, D)],
        output_dtypes=[F32],
        grid=(32 * nsg * -(-D // tile), N * k, 1),
        threadgroup=(32 * nsg, 1, 1),
        template=down_template(D, I, bits, gs),
    )
    return sum_pairs(backend, part, N, k)


def eligible(z, w, inds) -> bool:
    """Inputs the affine kernels serve: 2-D float latents, affine stacks (uint32 codes,
    float16 scales and biases) of matching shapes at a width of ``BITS`` and a group size
    of ``GROUPS`` dividing D and I, a latent that fits threadgroup memory in fp32."""
    if z.ndim != 2 or z.dtype not in (mx.float32, mx.bfloat16, mx.float16) or inds.ndim != 2:
        return False
    if any(len(w[n]) != 3 for n in ("w1", "w2", "w3")):
        return False
    N, D = z.shape
    (q1, s1, b1), (q3, s3, b3), (q2, s2, b2) = w["w1"], w["w3"], w["w2"]
    if q2.ndim != 3 or q1.ndim != 3 or q2.shape[-2] != D:
        return False
    bits, gs = params(w)
    E, I = q1.shape[:2]
    if bits not in BITS or gs not in GROUPS or D % gs or I % gs:
        return False
    shapes_ok = (
        q1.shape == q3.shape == (E, I, D * bits // 32)
        and s1.shape == s3.shape == b1.shape == b3.shape == (E, I, D // gs)
        and q2.shape == (E, D, I * bits // 32)
        and s2.shape == b2.shape == (E, D, I // gs)
    )
    dtypes_ok = all(
        q.dtype == U32 and s.dtype == F16 and b.dtype == F16
        for q, s, b in (w["w1"], w["w3"], w["w2"])
    )
    return shapes_ok and dtypes_ok and 4 * D <= 28 * 1024 and inds.shape[0] == N
