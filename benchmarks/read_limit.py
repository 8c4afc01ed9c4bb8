"""The read limit of an MXFP4 decode call: the selected experts' weight bytes read and
nothing else, a measuring instrument for ``bench_mxfp4``.

A decode call of the experts (``expert_glu``) has to read every code word and scale byte of
its k experts' three matrices once. ``read_call`` reads exactly those bytes in one launch
(same inputs and output as the decode: fp32 ``[N, D]``, here the latent itself) with the
simplest access there is: each threadgroup streams a contiguous chunk of one matrix of one
(token, choice) pair, 16 bytes a lane and eight loads in flight, and XORs what it read into
one word (``parts``, so that no load can be dropped). No decode, no math, no staging. The
loads of a batch that lies wholly inside its chunk carry no per-load predicate, so that the
eight go out together.

The kernel is written in the project's dialect, so the Metal emulator runs it, and
tests/test_read_limit.py checks that ``parts`` is the XOR of exactly the selected bytes.
"""

from __future__ import annotations

import mlx.core as mx

from kimi_k3.kernels.source import Kernel
from kimi_k3.kernels.source import backend as default_backend

U32 = mx.uint32
THREADS = 256  # a threadgroup's threads
UNROLL = 8  # 16-byte loads in flight per thread
CHUNK = 4  # rounds of THREADS * UNROLL loads per threadgroup and matrix

# Threadgroup (c, q): chunk c of matrix q % M of pair q / M (M = number of matrices given:
# 1, 2 or 3), its code words and its share of the scale bytes (16 bytes at a time: a
# matrix's scales per expert are a multiple of 16 bytes, read_mats checks).
BODY = """
  SHARED uint red[THREADS / 32];
  const uint tid = THREAD_INDEX;
  const uint c = GROUP_POS.x;
  const uint nc = NUM_GROUPS.x;
  const uint q = GROUP_POS.y;
  const uint p = q / M;
  const uint m = q % M;
  const size_t e = (size_t)inds[p];
  const DEVICE uint4* cw = (const DEVICE uint4*)(m == 0 ? c0 : (m == 1 ? c1 : c2)) + e * CW4;
  const DEVICE uint4* sw = (const DEVICE uint4*)(m == 0 ? s0 : (m == 1 ? s1 : s2)) + e * SW4;
  uint acc = 0u;
  // code words: chunk c is [c * CH, (c + 1) * CH) of the matrix's CW4 16-byte words
  constexpr uint CH = THREADS * UNROLL * CHUNK;
  const uint end = (c + 1) * CH < CW4 ? (c + 1) * CH : CW4;
  for (uint i = c * CH + tid; i < end; i += THREADS * UNROLL) {
    uint4 v[UNROLL];
    if (i + (UNROLL - 1) * THREADS < end) {
      // the whole batch in range: no predicate per load, so all UNROLL go out at once
      _Pragma("unroll") for (int j = 0; j < UNROLL; ++j) v[j] = cw[i + j * THREADS];
    } else {
      _Pragma("unroll") for (int j = 0; j < UNROLL; ++j) {
        const uint at = i + j * THREADS;
        v[j] = at < end ? cw[at] : UINT4(0u, 0u, 0u, 0u);
      }
    }
    _Pragma("unroll") for (int j = 0; j < UNROLL; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  // scale bytes: an even share of the SW4 16-byte words per chunk
  const uint sh = (SW4 + nc - 1) / nc;
  const uint s_end = (c + 1) * sh < SW4 ? (c + 1) * sh : SW4;
  for (uint i = c * sh + tid; i < s_end; i += THREADS) {
    const uint4 v = sw[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  acc = SIMD_XOR(acc);
  if (LANE == 0) red[SIMDGROUP] = acc;
  BARRIER();
  if (tid == 0) {
    uint total = 0u;
    for (int w = 0; w < THREADS / 32; ++w) total ^= red[w];
    parts[(size_t)q * nc + c] = total;
  }
  if (c == 0 && q == 0) {
    for (uint i = tid; i < NX; i += THREADS) out[i] = static_cast<float>(x[i]);
  }
"""

# XOR across a warp's lanes by shuffles (the dialect has sums and maxima, not XOR).
HEADER = """
HELPER uint kk_simd_xor(uint v) {
  for (int d = 16; d > 0; d /= 2) v ^= SIMD_SHUFFLE_XOR(v, d);
  return v;
}
#define SIMD_XOR(v) kk_simd_xor(v)
"""

READ_LIMIT = Kernel(
    "mxfp4_read_limit",
    ["x", "c0", "s0", "c1", "s1", "c2", "s2", "inds"],
    ["out", "parts"],
    BODY,
    header=HEADER,
)


def chunks(code_words4: int) -> int:
    """Threadgroups per matrix: CHUNK rounds of THREADS * UNROLL 16-byte words each."""
    return -(-code_words4 // (THREADS * UNROLL * CHUNK))


def template(dtype, mats: int, cw4: int, sw4: int, nx: int) -> list:
    """The kernel's template: latent dtype, matrices per launch, 16-byte code and scale words
    per expert and matrix, latent elements."""
    return [
        ("T", dtype),
        ("M", mats),
        ("CW4", cw4),
        ("SW4", sw4),
        ("NX", nx),
        ("THREADS", THREADS),
        ("UNROLL", UNROLL),
        ("CHUNK", CHUNK),
    ]


def read_mats(x, mats, inds, backend: str | None = None):
    """One launch reading ``mats`` (1-3 ``(codes, scales)`` pairs of stacked experts, all the
    same size) of every expert in ``inds``; returns (``x`` as fp32, per-threadgroup XORs).

    Shapes: x: [N, D]; codes: [E, R, C / 8] uint32; scales: [E, R, C / 32] uint8;
    inds: [N, k] -> out [N, D] fp32, parts [N k M chunks] uint32."""
    backend = backend or default_backend()
    if not 1 <= len(mats) <= 3:
        raise ValueError(f"read_mats: 1 to 3 matrices, got {len(mats)}")
    codes, scales = mats[0]
    cbytes, sbytes = codes[0].nbytes, scales[0].nbytes
    for name, n in (("code", cbytes), ("scale", sbytes)):
        if n % 16:
            raise ValueError(f"read_mats: an expert's {name} bytes ({n}) are no multiple of 16")
    for cw, sc in mats[1:]:
        if cw[0].nbytes != cbytes or sc[0].nbytes != sbytes:
            raise ValueError("read_mats: the matrices differ in size")
    flat = inds.reshape(-1).astype(mx.int32)
    padded = list(mats) + [mats[0]] * (3 - len(mats))
    nc = chunks(cbytes // 16)
    groups = flat.size * len(mats)
    out, parts = READ_LIMIT(
        backend,
        inputs=[x, *(a for pair in padded for a in pair), flat],
        output_shapes=[x.shape, (groups * nc,)],
        output_dtypes=[mx.float32, U32],
        grid=(THREADS * nc, groups, 1),
        threadgroup=(THREADS, 1, 1),
        template=template(x.dtype, len(mats), cbytes // 16, sbytes // 16, x.size),
    )
    return out, parts


def read_call(z, w, inds, weights, beta, cap, backend: str | None = None):
    """The decode call's weight bytes read in one launch, with ``expert_glu``'s signature
    and output shape (the output is ``z`` as fp32, [N, D])."""
    return read_mats(z, [w["w1"], w["w3"], w["w2"]], inds, backend)[0]
