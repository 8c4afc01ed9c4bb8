"""The read limit of a decode call: the selected experts' weight bytes read and nothing else.

A decode call of the MXFP4 experts (``expert_glu_decode``) has to read every code word and
scale byte of its k experts' three matrices once. ``read_call`` reads exactly those bytes
(same inputs and output as the decode: fp32 ``[N, D]``, here the latent itself) with the
simplest access there is: each threadgroup streams a contiguous chunk of one matrix of one
(token, choice) pair, 16 bytes a lane and eight loads in flight, and XORs what it read into
one word (``parts``, so that no load can be dropped). No decode, no math, no staging.

The loads of a batch that lies wholly inside the chunk carry no per-load predicate: with one
predicate each (as until session 24), ptxas gave the kernel 32 registers at 8, 16 and 32
loads, and at 8 its SASS issued them as two batches of four, so the "8 loads in flight" rows
before then had 4. Now 8 loads take 48 registers and go out together. The rows:

- ``launches=1``: the three matrices in one launch, the limit for any decode call;
- ``launches=2``: gate and up in one launch, down in a second that waits for the first (as
  gate/up, then down, wait in the decode): what the launch between them costs;
- ``stream=True``: the loads marked as read once (``LOAD_STREAM``, as gate/up's);
- ``threads``, ``unroll``, ``pad_kb``: threadgroup size, 16-byte loads in flight per thread,
  and threadgroup memory held (unused) per threadgroup, which caps the threadgroups per SM:
  at 128 threads and 47 KB (CUDA allows 48 KB), four per SM (512 threads, as the decode
  kernels at two 256-thread threadgroups), so the bytes in flight per SM match theirs (64 KB
  at eight loads a thread).

``bench_mxfp4`` times these as chains beside the decode kernels (``--read-limit``):

    python3 -m benchmarks.bench_mxfp4 --read-limit --skip-prefill      # on the H200

The kernel is written in the project's dialect, so the emulator runs it and
tests/test_read_limit.py checks that ``parts`` is the XOR of exactly the selected bytes.
"""

from __future__ import annotations

import mlx.core as mx

from kimi_k3.kernels.source import Kernel
from kimi_k3.kernels.source import backend as default_backend

U32 = mx.uint32
THREADS = 256  # a threadgroup's threads (default)
UNROLL = 8  # 16-byte loads in flight per thread (default)
CHUNK = 4  # rounds of THREADS * UNROLL loads per threadgroup and matrix

# Threadgroup (c, q): chunk c of matrix q % M of pair q / M (M = number of matrices given:
# 1, 2 or 3), its code words and its share of the scale bytes (16 bytes at a time: a
# matrix's scales per expert are a multiple of 16 bytes, read_mats checks).
BODY = """
  SHARED uint red[THREADS / 32];
  SHARED uint pad[PAD > 0 ? PAD : 1];             // held only to cap threadgroups per SM
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
      // the whole batch in range: no predicate per load, so all UNROLL go out at once (with
      // one predicate each, ptxas issued them four at a time)
      _Pragma("unroll") for (int j = 0; j < UNROLL; ++j) {
        const uint at = i + j * THREADS;
        v[j] = STREAM ? LOAD_STREAM(&cw[at]) : cw[at];
      }
    } else {
      _Pragma("unroll") for (int j = 0; j < UNROLL; ++j) {
        const uint at = i + j * THREADS;
        v[j] = at < end ? (STREAM ? LOAD_STREAM(&cw[at]) : cw[at]) : UINT4(0u, 0u, 0u, 0u);
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
  if (PAD > 0) {
    for (uint i = tid; i < PAD; i += THREADS) pad[i] = acc;
    BARRIER();
    acc = pad[tid];                                 // its own value (PAD >= THREADS), kept
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


def chunks(code_words4: int, threads: int = THREADS, unroll: int = UNROLL) -> int:
    """Threadgroups per matrix: CHUNK rounds of threads * unroll 16-byte words each."""
    return -(-code_words4 // (threads * unroll * CHUNK))


def template(
    dtype,
    mats: int,
    cw4: int,
    sw4: int,
    nx: int,
    stream: bool,
    threads=THREADS,
    unroll=UNROLL,
    pad_kb=0,
) -> list:
    """The kernel's template: latent dtype, matrices per launch, 16-byte code and scale words
    per expert and matrix, latent elements, read-once loads and the threadgroup shape."""
    return [
        ("T", dtype),
        ("M", mats),
        ("CW4", cw4),
        ("SW4", sw4),
        ("NX", nx),
        ("THREADS", threads),
        ("UNROLL", unroll),
        ("CHUNK", CHUNK),
        ("STREAM", stream),
        ("PAD", pad_kb * 256),
    ]


def read_mats(
    x,
    mats,
    inds,
    stream: bool,
    backend: str | None = None,
    threads: int = THREADS,
    unroll: int = UNROLL,
    pad_kb: int = 0,
):
    """One launch reading ``mats`` (1-3 ``(codes, scales)`` pairs of stacked experts, all the
    same size) of every expert in ``inds``; returns (``x`` as fp32, per-threadgroup XORs)."""
    backend = backend or default_backend()
    if threads % 32 or not 32 <= threads <= 1024 or unroll < 1:
        raise ValueError(f"read_mats: threads {threads} (a multiple of 32), unroll {unroll}")
    if pad_kb and pad_kb * 256 < threads:
        raise ValueError(f"read_mats: pad_kb {pad_kb} holds fewer words than threads ({threads})")
    if not 1 <= len(mats) <= 3:
        raise ValueError(f"read_mats: 1 to 3 matrices, got {len(mats)}")
    codes, scales = mats[0]
    cbytes = codes[0].nbytes
    sbytes = scales[0].nbytes
    for name, n in (("code", cbytes), ("scale", sbytes)):
        if n % 16:
            raise ValueError(f"read_mats: an expert's {name} bytes ({n}) are no multiple of 16")
    for cw, sc in mats[1:]:
        if cw[0].nbytes != cbytes or sc[0].nbytes != sbytes:
            raise ValueError("read_mats: the matrices differ in size")
    flat = inds.reshape(-1).astype(mx.int32)
    padded = list(mats) + [mats[0]] * (3 - len(mats))
    nc = chunks(cbytes // 16, threads, unroll)
    groups = flat.size * len(mats)
    out, parts = READ_LIMIT(
        backend,
        inputs=[x, *(a for pair in padded for a in pair), flat],
        output_shapes=[x.shape, (groups * nc,)],
        output_dtypes=[mx.float32, U32],
        grid=(threads * nc, groups, 1),
        threadgroup=(threads, 1, 1),
        template=template(
            x.dtype, len(mats), cbytes // 16, sbytes // 16, x.size, stream, threads, unroll, pad_kb
        ),
    )
    return out, parts


def read_call(z, w, inds, weights, beta, cap, launches=1, stream=False, backend=None, **shape):
    """The decode call's weight bytes read (signature and output of ``expert_glu_decode``:
    the output is ``z`` as fp32, [N, D]). ``launches``: 1 (all three matrices at once) or 2
    (gate and up, then down on the first launch's output); ``shape``: ``read_mats``'
    ``threads``, ``unroll``, ``pad_kb``."""
    mats = [w["w1"], w["w3"], w["w2"]]
    if launches == 1:
        return read_mats(z, mats, inds, stream, backend, **shape)[0]
    if launches != 2:
        raise ValueError(f"read_call: launches is 1 or 2, got {launches}")
    first, _ = read_mats(z, mats[:2], inds, stream, backend, **shape)
    return read_mats(first, mats[2:], inds, stream, backend, **shape)[0]
