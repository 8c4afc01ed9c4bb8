"""Single-source kernels: one body in a small dialect, rendered for Metal or CUDA.

A kernel body is C++ that both Metal and CUDA accept, plus the dialect's words below for
the only things that differ: thread indexing, SIMD/warp operations, barriers, shared memory
and address-space qualifiers, and the few math functions whose names differ. ``render``
swaps each word for its backend's spelling; a word is an identifier (matched whole), a
function-like word is followed by ``(``. kernels/README.md documents the dialect.

``Kernel`` holds one kernel: its body, the names of its inputs and outputs, and the
instances it is launched with (so compile checks can render every one). ``Kernel.get`` builds
the backend's kernel object lazily (``mx.fast.metal_kernel`` raises on Linux).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace

import mlx.core as mx

from .metal_emulator import TYPES, check_cuda_grid, metal_kernel

BACKENDS = ("metal", "cuda")

_LINEAR = "(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z))"

# word: (Metal, CUDA)
WORDS = {
    # indexing (uint3 values: use .x/.y/.z)
    "THREAD_POS": ("thread_position_in_threadgroup", "threadIdx"),
    "GROUP_POS": ("threadgroup_position_in_grid", "blockIdx"),
    "GROUP_SIZE": ("threads_per_threadgroup", "blockDim"),
    "NUM_GROUPS": ("threadgroups_per_grid", "gridDim"),
    # indexing (scalars)
    "THREAD_INDEX": ("thread_index_in_threadgroup", _LINEAR),
    "GRID_X": ("thread_position_in_grid.x", "(blockIdx.x * blockDim.x + threadIdx.x)"),
    "GRID_Y": ("thread_position_in_grid.y", "(blockIdx.y * blockDim.y + threadIdx.y)"),
    "GRID_Z": ("thread_position_in_grid.z", "(blockIdx.z * blockDim.z + threadIdx.z)"),
    "LANE": ("thread_index_in_simdgroup", f"({_LINEAR} & 31u)"),
    "SIMDGROUP": ("simdgroup_index_in_threadgroup", f"({_LINEAR} >> 5)"),
    "SIMD_WIDTH": ("32u", "32u"),
    # memory
    "SHARED": ("threadgroup", "__shared__"),
    "DEVICE": ("device", ""),
    "BFLOAT16": ("bfloat16_t", "__nv_bfloat16"),
    "HELPER": ("inline", "__device__ inline"),
}

# function-like word: (Metal, CUDA) spelling of the callee
CALLS = {
    "BARRIER": ("threadgroup_barrier", "__syncthreads"),
    "BARRIER_DEVICE": ("threadgroup_barrier", "__syncthreads"),
    "SIMD_BARRIER": ("simdgroup_barrier", "__syncwarp"),
    "SIMD_SUM": ("metal::simd_sum", "kk_warp_sum"),
    "SIMD_MAX": ("metal::simd_max", "kk_warp_max"),
    "SIMD_MIN": ("metal::simd_min", "kk_warp_min"),
    "SIMD_SHUFFLE": ("metal::simd_shuffle", "kk_warp_shuffle"),
    "SIMD_SHUFFLE_XOR": ("metal::simd_shuffle_xor", "kk_warp_shuffle_xor"),
    "SIMD_SHUFFLE_DOWN": ("metal::simd_shuffle_down", "kk_warp_shuffle_down"),
    "SIMD_BROADCAST": ("metal::simd_broadcast", "kk_warp_shuffle"),
    "FLOAT2": ("float2", "make_float2"),
    "FLOAT4": ("float4", "make_float4"),
    "EXP": ("metal::exp", "expf"),
    "LOG": ("metal::log", "logf"),
    "SQRT": ("metal::sqrt", "sqrtf"),
    "RSQRT": ("metal::rsqrt", "rsqrtf"),
    "TANH": ("metal::tanh", "tanhf"),
    "FMAX": ("metal::fmax", "fmaxf"),
    "FMIN": ("metal::fmin", "fminf"),
    "FABS": ("metal::abs", "fabsf"),
    "AS_FLOAT": ("as_type<float>", "__uint_as_float"),
    "AS_UINT": ("as_type<uint>", "__float_as_uint"),
    "UINT2": ("uint2", "make_uint2"),
    "UINT4": ("uint4", "make_uint4"),
    # fp16 and the tensor-core product (helpers in the preludes below)
    "PACK_HALF2": ("kk_pack_half2", "kk_pack_half2"),
    "ROUND_HALF": ("kk_round_half", "kk_round_half"),
    "SIMD_MMA": ("kk_mma", "kk_mma"),
    "SIMD_MMA_TF32": ("kk_mma_tf32", "kk_mma_tf32"),
    # PTX's prmt: bytes of (x, y) picked by the selector's nibbles (0-3: x's, 4-7: y's)
    "BYTE_PERM": ("kk_byte_perm", "__byte_perm"),
    # a load marked as read once (CUDA: ld.global.cs, evict first; Metal: a plain load)
    "LOAD_STREAM": ("kk_load_stream", "__ldcs"),
    # asynchronous copies into threadgroup memory (helpers in the preludes below)
    "ASYNC_COPY16": ("kk_async_copy16", "kk_async_copy16"),
    "ASYNC_COMMIT": ("kk_async_commit", "kk_async_commit"),
    "ASYNC_WAIT": ("kk_async_wait", "kk_async_wait"),
    # threadgroups of one launch meeting through a uint counter in device memory (an output):
    # ATOMIC_ADD returns the old value; LOAD_ACQUIRE reads it (a spin's read); FENCE_DEVICE
    # orders this thread's device-memory accesses before and after it at device scope
    "ATOMIC_ADD": ("kk_atomic_add", "kk_atomic_add"),
    "LOAD_ACQUIRE": ("kk_load_acquire", "kk_load_acquire"),
    "FENCE_DEVICE": ("kk_fence_device", "__threadfence"),
}

# Barrier words take no arguments in the dialect; Metal needs the memory flags.
_BARRIER_ARGS = {
    "BARRIER": "mem_flags::mem_threadgroup",
    "BARRIER_DEVICE": "mem_flags::mem_device | mem_flags::mem_threadgroup",
    "SIMD_BARRIER": "mem_flags::mem_threadgroup",
}

# Helpers the CUDA spellings rely on; prepended to the header of every CUDA kernel.
CUDA_PRELUDE = """
typedef unsigned int uint;
template <typename T> __device__ inline T kk_warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename T> __device__ inline T kk_warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <typename T> __device__ inline T kk_warp_min(T v) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <typename T> __device__ inline T kk_warp_shuffle(T v, int lane) {
  return __shfl_sync(0xffffffffu, v, lane);
}
template <typename T> __device__ inline T kk_warp_shuffle_xor(T v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
template <typename T> __device__ inline T kk_warp_shuffle_down(T v, int delta) {
  return __shfl_down_sync(0xffffffffu, v, delta);
}
__device__ inline uint kk_pack_half2(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint*>(&v);
}
__device__ inline float kk_round_half(float x) { return __half2float(__float2half_rn(x)); }
// One 16-byte store of four floats at p (16-byte aligned). A float4 assigned through a cast
// pointer can come out of nvcc as four 4-byte stores (kda_chunk_prep's did: a quarter of
// each sector written per store); __stwb gives a vector store but a strong (.STRONG.SM) one.
__device__ inline void kk_store4(float* p, float4 v) {
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w)
               : "memory");
}
// c + A B for one warp: A 16x16 fp16 (4 regs), B 16x8 fp16 (2 regs), C 16x8 fp32 (4 regs),
// in PTX's m16n8k16 fragment layout (SIMD_MMA in kernels/README.md).
__device__ inline float4 kk_mma(float4 c, uint4 a, uint2 b, uint lane) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c.x), "+f"(c.y), "+f"(c.z), "+f"(c.w)
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b.x), "r"(b.y));
  return c;
}
// ASYNC_COPY16(dst, src, valid): 16 bytes from global memory into the threadgroup-memory
// element dst (a float4 or uint4 of a SHARED array), zeros where !valid (src must still be
// a readable address), without holding registers: cp.async (sm_80+). ASYNC_COMMIT() closes a
// group of copies; ASYNC_WAIT(n) (n = 0..3, a literal) waits until at most the n most recent
// committed groups are in flight. Other threads see the data after a BARRIER().
__device__ inline void kk_cp_async16(const void* dst, const void* src, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
template <typename T>
__device__ inline void kk_async_copy16(T& dst, const T* src, bool valid) {
  static_assert(sizeof(T) == 16, "ASYNC_COPY16 copies 16 bytes");
  kk_cp_async16(&dst, src, valid);
}
// The same into a float2 element at an even index and the one after it (a SHARED float2
// array read by float2s).
__device__ inline void kk_async_copy16(float2& dst, const float4* src, bool valid) {
  kk_cp_async16(&dst, src, valid);
}
__device__ inline void kk_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ inline void kk_async_wait(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
  }
}
// ATOMIC_ADD(p, v): the old value (relaxed). LOAD_ACQUIRE(p): ld.acquire.gpu, so what the
// writer made visible before its release is visible after. FENCE_DEVICE() is __threadfence.
__device__ inline uint kk_atomic_add(uint* p, uint v) { return atomicAdd(p, v); }
__device__ inline uint kk_load_acquire(const uint* p) {
  uint v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// c + A B for one warp: A 16x8 tf32 (float4), B 8x8 tf32 (float2), C 16x8 fp32, in PTX's
// m16n8k8 fragment layout (SIMD_MMA_TF32 in kernels/README.md). The operands must already be
// tf32 values (low 13 bits zero).
__device__ inline float4 kk_mma_tf32(float4 c, float4 a, float2 b, uint lane) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c.x), "+f"(c.y), "+f"(c.z), "+f"(c.w)
      : "r"(__float_as_uint(a.x)), "r"(__float_as_uint(a.y)), "r"(__float_as_uint(a.z)),
        "r"(__float_as_uint(a.w)), "r"(__float_as_uint(b.x)), "r"(__float_as_uint(b.y)));
  return c;
}
"""

# The same helpers for Metal. SIMD_MMA here is the product spelled out with simdgroup
# shuffles in the CUDA fragment layout: exact fp32 arithmetic on the fp16 inputs, so the
# emulator can check a kernel's fragment bookkeeping; Metal's simdgroup_matrix is not used
# (kernels that rely on SIMD_MMA for speed are dispatched on CUDA only).
METAL_PRELUDE = """
inline uint kk_pack_half2(float lo, float hi) { return as_type<uint>(half2(half(lo), half(hi))); }
inline float kk_round_half(float x) { return float(half(x)); }
inline void kk_store4(device float* p, float4 v) { *reinterpret_cast<device float4*>(p) = v; }
template <typename T> inline T kk_load_stream(const device T* p) { return *p; }
// ATOMIC_ADD / LOAD_ACQUIRE / FENCE_DEVICE (CUDA's spelling above). The emulator runs one
// threadgroup at a time, so its fence has nothing to order.
inline uint kk_atomic_add(device uint* p, uint v) {
  return atomic_fetch_add_explicit((device atomic_uint*)p, v, memory_order_relaxed);
}
inline uint kk_load_acquire(device uint* p) {
  return atomic_load_explicit((device atomic_uint*)p, memory_order_relaxed);
}
#ifdef KK_METAL_EMULATOR
inline void kk_fence_device() {}
#else
inline void kk_fence_device() {
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
}
#endif
inline uint kk_byte_perm(uint x, uint y, uint s) {
  uint r = 0u;
  for (uint i = 0u; i < 4u; ++i) {
    const uint sel = (s >> (4u * i)) & 7u;
    r |= ((sel < 4u ? x >> (8u * sel) : y >> (8u * (sel - 4u))) & 255u) << (8u * i);
  }
  return r;
}
// ASYNC_COPY16 / ASYNC_COMMIT / ASYNC_WAIT (CUDA's spelling above). Metal copies at once; the
// emulator lands each copy at once or at the ASYNC_WAIT that covers it (half each), the two
// ends of what cp.async may do, so reading a copy too early or refilling a buffer still
// being read gives a wrong result there.
#ifdef KK_METAL_EMULATOR
template <typename T>
inline void kk_async_copy16(T& dst, const T* src, bool valid) {
  static_assert(sizeof(T) == 16, "ASYNC_COPY16 copies 16 bytes");
  kk::async_copy(&dst, valid ? src : nullptr, sizeof(T));
}
inline void kk_async_copy16(float2& dst, const float4* src, bool valid) {
  kk::async_copy(&dst, valid ? src : nullptr, 16);  // dst and the float2 after it
}
inline void kk_async_commit() { kk::async_commit(); }
inline void kk_async_wait(int n) { kk::async_wait(n); }
#else
template <typename T>
inline void kk_async_copy16(threadgroup T& dst, const device T* src, bool valid) {
  dst = valid ? *src : T(0);
}
inline void kk_async_copy16(threadgroup float2& dst, const device float4* src, bool valid) {
  const float4 v = valid ? *src : float4(0.0f);
  (&dst)[0] = v.xy;  // dst and the float2 after it
  (&dst)[1] = v.zw;
}
inline void kk_async_commit() {}
inline void kk_async_wait(int) {}
#endif
inline float2 kk_half2_bits(uint u) { return float2(as_type<half2>(u)); }
inline float4 kk_mma(float4 c, uint4 a, uint2 b, uint lane) {
  const uint g = lane / 4, t = lane % 4;
  for (uint s = 0; s < 4; ++s) {
    const ushort la = ushort(4 * g + s);             // holds rows g, g+8 at k = 2s.., 2s+8..
    const ushort l0 = ushort(8 * t + s);             // holds column 2t at k = 2s.., 2s+8..
    const ushort l1 = ushort(8 * t + 4 + s);         // column 2t+1
    const float2 a0 = kk_half2_bits(metal::simd_shuffle(a.x, la));
    const float2 a1 = kk_half2_bits(metal::simd_shuffle(a.y, la));
    const float2 a2 = kk_half2_bits(metal::simd_shuffle(a.z, la));
    const float2 a3 = kk_half2_bits(metal::simd_shuffle(a.w, la));
    const float2 b00 = kk_half2_bits(metal::simd_shuffle(b.x, l0));
    const float2 b01 = kk_half2_bits(metal::simd_shuffle(b.y, l0));
    const float2 b10 = kk_half2_bits(metal::simd_shuffle(b.x, l1));
    const float2 b11 = kk_half2_bits(metal::simd_shuffle(b.y, l1));
    c.x += a0.x * b00.x + a0.y * b00.y + a2.x * b01.x + a2.y * b01.y;
    c.y += a0.x * b10.x + a0.y * b10.y + a2.x * b11.x + a2.y * b11.y;
    c.z += a1.x * b00.x + a1.y * b00.y + a3.x * b01.x + a3.y * b01.y;
    c.w += a1.x * b10.x + a1.y * b10.y + a3.x * b11.x + a3.y * b11.y;
  }
  return c;
}
inline float4 kk_mma_tf32(float4 c, float4 a, float2 b, uint lane) {
  const uint g = lane / 4, t = lane % 4;
  for (uint s = 0; s < 4; ++s) {
    const ushort la = ushort(4 * g + s);             // A[g][s], A[g+8][s], A[g][s+4], A[g+8][s+4]
    const ushort l0 = ushort(8 * t + s);             // B[s][2t], B[s+4][2t]
    const ushort l1 = ushort(8 * t + 4 + s);         // B[s][2t+1], B[s+4][2t+1]
    const float a0 = metal::simd_shuffle(a.x, la);
    const float a1 = metal::simd_shuffle(a.y, la);
    const float a2 = metal::simd_shuffle(a.z, la);
    const float a3 = metal::simd_shuffle(a.w, la);
    const float b00 = metal::simd_shuffle(b.x, l0);
    const float b01 = metal::simd_shuffle(b.y, l0);
    const float b10 = metal::simd_shuffle(b.x, l1);
    const float b11 = metal::simd_shuffle(b.y, l1);
    c.x += a0 * b00 + a2 * b01;
    c.y += a0 * b10 + a2 * b11;
    c.z += a1 * b00 + a3 * b01;
    c.w += a1 * b10 + a3 * b11;
  }
  return c;
}
"""

# float4 arithmetic both backends accept (CUDA's float4 has no operators). Add to a
# kernel's header when its body uses them.
VEC4_HELPERS = """
HELPER float4 kk_add4(float4 a, float4 b) {
  a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w; return a;
}
HELPER float4 kk_sub4(float4 a, float4 b) {
  a.x -= b.x; a.y -= b.y; a.z -= b.z; a.w -= b.w; return a;
}
HELPER float4 kk_mul4(float4 a, float4 b) {
  a.x *= b.x; a.y *= b.y; a.z *= b.z; a.w *= b.w; return a;
}
HELPER float4 kk_scale4(float s, float4 a) { a.x *= s; a.y *= s; a.z *= s; a.w *= s; return a; }
HELPER float4 kk_fma4(float s, float4 a, float4 acc) {
  acc.x += s * a.x; acc.y += s * a.y; acc.z += s * a.z; acc.w += s * a.w; return acc;
}
HELPER float kk_dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
HELPER float4 kk_exp4(float4 a) { return FLOAT4(EXP(a.x), EXP(a.y), EXP(a.z), EXP(a.w)); }
HELPER float4 kk_zero4() { return FLOAT4(0.0f, 0.0f, 0.0f, 0.0f); }
"""

# fp32 products on tf32 tensor cores ("3xTF32"): x = hi + lo with hi = x rounded to tf32
# (nearest, ties away from zero) and lo = the rest truncated to tf32, and a b = lo_a hi_b +
# hi_a lo_b + hi_a hi_b (the lo lo term and lo's truncation cost about 2^-21 relative).
# Needs SIMD_MMA_TF32; add to a kernel's header (with VEC4_HELPERS before it).
TF32X3_HELPERS = """
HELPER float kk_tf32(float x) { return AS_FLOAT((AS_UINT(x) + 0x1000u) & 0xffffe000u); }
HELPER float kk_tf32_lo(float x, float hi) { return AS_FLOAT(AS_UINT(x - hi) & 0xffffe000u); }
struct kk_split4_t {
  float4 hi;
  float4 lo;
};
HELPER kk_split4_t kk_split4(float4 x) {
  kk_split4_t r;
  r.hi = FLOAT4(kk_tf32(x.x), kk_tf32(x.y), kk_tf32(x.z), kk_tf32(x.w));
  r.lo = FLOAT4(kk_tf32_lo(x.x, r.hi.x), kk_tf32_lo(x.y, r.hi.y), kk_tf32_lo(x.z, r.hi.z),
                kk_tf32_lo(x.w, r.hi.w));
  return r;
}
// c + A B in about fp32 precision: A already split (kk_split4), B split here.
HELPER float4 kk_mma3(float4 c, kk_split4_t a, float2 b, uint lane) {
  const float2 bh = FLOAT2(kk_tf32(b.x), kk_tf32(b.y));
  const float2 bl = FLOAT2(kk_tf32_lo(b.x, bh.x), kk_tf32_lo(b.y, bh.y));
  c = SIMD_MMA_TF32(c, a.lo, bh, lane);
  c = SIMD_MMA_TF32(c, a.hi, bl, lane);
  return SIMD_MMA_TF32(c, a.hi, bh, lane);
}
// c + A B: kk_mma3 where x3, else one tf32 MMA of A's and B's rounded parts (about 1e-3
// relative: for inputs that were bf16; a compile-time x3 leaves no trace of the other).
HELPER float4 kk_mma(float4 c, kk_split4_t a, float2 b, uint lane, bool x3) {
  if (x3) return kk_mma3(c, a, b, lane);
  return SIMD_MMA_TF32(c, a.hi, FLOAT2(kk_tf32(b.x), kk_tf32(b.y)), lane);
}
"""

_WORD_RE = re.compile(r"\b(" + "|".join(sorted(WORDS, key=len, reverse=True)) + r")\b")
_CALL_RE = re.compile(r"\b(" + "|".join(sorted(CALLS, key=len, reverse=True)) + r")\s*\(")


def render(text: str, backend: str) -> str:
    """``text`` (a body or header in the dialect) in the backend's spelling."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    i = BACKENDS.index(backend)

    def call(m):
        word = m.group(1)
        name = CALLS[word][i]
        if word in _BARRIER_ARGS and backend == "metal":
            return f"{name}({_BARRIER_ARGS[word]}"
        return name + "("

    text = _CALL_RE.sub(call, text)
    return _WORD_RE.sub(lambda m: WORDS[m.group(1)][i], text)


def render_header(header: str, backend: str) -> str:
    """The header handed to MLX: the backend's helpers, then the rendered header."""
    return (CUDA_PRELUDE if backend == "cuda" else METAL_PRELUDE) + render(header, backend)


def cuda_launch_bounds(threads: int, blocks: int) -> str:
    """Header text that gives the kernel after it ``__launch_bounds__(threads, blocks)``.

    MLX's cuda_kernel writes the ``__global__`` line itself, after the header, so the header
    redefines the ``__global__`` macro as the attributes it stands for plus the bounds
    (spelled as attributes, so that no other CUDA macro is needed). Only the custom kernel
    follows the header in MLX's generated source.
    """
    if not (0 < threads <= 1024 and 0 < blocks <= 32):
        raise ValueError(f"launch bounds ({threads}, {blocks}): threads 1-1024, blocks 1-32")
    return (
        "\n#ifdef __global__\n#undef __global__\n#endif\n"
        f"#define __global__ __attribute__((global)) "
        f"__attribute__((launch_bounds({threads}, {blocks})))\n"
    )


def as_dtype(x: mx.array, dtype) -> mx.array:
    """``x`` in ``dtype``, converted only where it differs (kernel inputs)."""
    return x if x.dtype == dtype else x.astype(dtype)


_CONSTANTS: dict = {}


def swap(text: str, pairs, what: str) -> str:
    """``text`` (a kernel body built from another's) with each (old, new) of ``pairs``
    replaced; ``old`` must occur exactly once, or as often as a third item says, so that a
    change to the text it comes from is an error naming ``what``, not a silent mismatch."""
    for pair in pairs:
        old, new = pair[:2]
        count = pair[2] if len(pair) > 2 else 1
        if text.count(old) != count:
            raise AssertionError(f"{what}: the kernel changed near {old!r}")
        text = text.replace(old, new)
    return text


def derived(kernel: Kernel, tag: str, make) -> Kernel:
    """``make(kernel)`` (a variant of ``kernel`` built by rewriting its text), made once per
    kernel object and ``tag``: the rewrite, and the hashing of a new text that looking up
    its variant takes, then cost nothing on the calls that dispatch it
    (docs/benchmarks.md#kernel-variants). The kernel is kept with its result, so that its
    ``id`` is never reused while cached."""
    key = (id(kernel), tag)
    hit = _DERIVED.get(key)
    if hit is None or hit[0] is not kernel:
        hit = _DERIVED[key] = (kernel, make(kernel))
    return hit[1]


_DERIVED: dict = {}


def constant(values, dtype=mx.float32) -> mx.array:
    """A small constant kernel input (scalar params, dims), built once per distinct value."""
    key = (tuple(values), dtype)
    hit = _CONSTANTS.get(key)
    if hit is None:
        if len(_CONSTANTS) > 512:
            _CONSTANTS.clear()
        hit = _CONSTANTS[key] = mx.array(list(values), dtype=dtype)
    return hit


def env_choice(name: str, allowed: tuple, default: str = "") -> str:
    """The environment variable ``name``, or ``default`` where it is unset or empty. Any other
    value outside ``allowed`` is an error naming the variable (a misspelt value would
    otherwise be silently ignored)."""
    value = os.environ.get(name, "") or default
    if value != default and value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}, or unset")
    return value


def backend() -> str | None:
    """The kernel backend for this process: ``metal``, ``cuda`` or None (reference ops).

    ``KIMI_K3_KERNEL_BACKEND`` overrides it (``metal``, ``cuda``; ``emulator`` runs the Metal
    sources on the CPU, for tests; ``none`` disables kernels; another value is an error
    naming the variable).
    """
    forced = env_choice("KIMI_K3_KERNEL_BACKEND", ("metal", "cuda", "emulator", "none"))
    if forced:
        return None if forced == "none" else forced
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


@dataclass
class Instance:
    """One way a kernel is launched: the dtypes of its inputs and outputs, its template."""

    input_dtypes: list
    output_dtypes: list
    template: list = field(default_factory=list)


_VARIANTS: dict = {}


@dataclass
class Kernel:
    """A kernel written once in the dialect.

    ``instances`` lists the dtype/template combinations the project launches it with; the
    CUDA compile check (tests/test_cuda_compile.py) renders and compiles each of them.
    """

    name: str
    input_names: list
    output_names: list
    body: str
    header: str = ""
    instances: list = field(default_factory=list)
    # CUDA only: (threads per threadgroup at most, threadgroups per SM at least), given to
    # the compiler as __launch_bounds__ (it then caps the registers a thread may take).
    launch_bounds: tuple | None = None
    _built: dict = field(default_factory=dict, repr=False)

    def source(self, backend: str) -> str:
        return render(self.body, backend)

    def variant(self, suffix: str, **changes) -> Kernel:
        """This kernel with ``changes`` to its fields, named ``<name><suffix>``; made (and so
        built) once per kernel text and changes."""
        key = (self.name, self.body, self.header, self.launch_bounds, suffix, *changes.items())
        if key not in _VARIANTS:
            _VARIANTS[key] = replace(self, name=self.name + suffix, _built={}, **changes)
        return _VARIANTS[key]

    def bounded(self, threads: int, blocks: int) -> Kernel:
        """This kernel compiled for CUDA with ``__launch_bounds__(threads, blocks)``, named
        ``<name>_lb<threads>x<blocks>`` (itself where ``blocks`` is 1; Metal ignores the
        bound)."""
        if blocks <= 1:
            return self
        return self.variant(f"_lb{threads}x{blocks}", launch_bounds=(threads, blocks))

    def header_for(self, backend: str) -> str:
        """The header handed to MLX for ``backend`` (``render_header``), with the launch
        bounds on CUDA."""
        text = render_header(self.header, backend)
        if backend == "cuda" and self.launch_bounds:
            text += cuda_launch_bounds(*self.launch_bounds)
        return text

    def get(self, backend: str):
        """The backend's kernel object, built on first use."""
        if backend not in self._built:
            self._built[backend] = self._build(backend)
        return self._built[backend]

    def _build(self, backend: str):
        if backend == "cuda":
            return mx.fast.cuda_kernel(
                self.name,
                self.input_names,
                self.output_names,
                self.source("cuda"),
                header=self.header_for("cuda"),
            )
        args = (self.name, self.input_names, self.output_names, self.source("metal"))
        header = render_header(self.header, "metal")
        if backend == "metal":
            return mx.fast.metal_kernel(*args, header=header)
        if backend == "emulator":
            return metal_kernel(*args, header=header, strict=True)
        raise ValueError(f"no kernels for backend {backend!r}")

    def __call__(self, backend: str, **launch):
        """Launch on ``backend`` with ``mx.fast.metal_kernel``'s call arguments. On CUDA a
        grid past CUDA's block limits is refused here, naming the kernel (MLX's own error is
        ``cuGraphAddKernelNode ... invalid argument``, at evaluation)."""
        if backend == "cuda":
            try:
                check_cuda_grid(launch["grid"], launch["threadgroup"])
            except RuntimeError as e:
                raise ValueError(f"{self.name}: {str(e).removeprefix('[metal_emulator] ')}") from e
        return self.get(backend)(**launch)


CUDA_TYPES = {
    mx.float32: "float",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}

# What MLX's cuda_kernel puts before the kernel, with standard CUDA headers standing in for
# its device utils header (which defines Shape and Strides as fixed-size arrays).
_CUDA_UNIT_HEAD = """#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cstdint>
#define inf cuda::std::numeric_limits<float>::infinity()
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""


def cuda_kernel_name(name: str, template) -> str:
    """The function name MLX's cuda_kernel gives an instantiation."""
    out = "custom_kernel_" + name
    for _, arg in template:
        if isinstance(arg, bool):
            out += "_t" if arg else "_f"
        elif isinstance(arg, mx.Dtype):
            out += "_" + TYPES[arg][0]
        else:
            out += f"_{int(arg)}"
    return out


def cuda_function(kernel: Kernel, inst: Instance) -> str:
    """The ``__global__`` function ``mx.fast.cuda_kernel`` generates for this instance (MLX's
    build_kernel: template arguments become ``constexpr`` / ``using`` lines in the body)."""
    body = kernel.source("cuda")
    params = []
    for name, dt in zip(kernel.input_names, inst.input_dtypes, strict=True):
        params.append(f"    const {CUDA_TYPES[dt]}* {name}")
        for suffix, type_ in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
            if f"{name}_{suffix}" in body:
                params.append(f"    const __grid_constant__ {type_} {name}_{suffix}")
    params += [
        f"    {CUDA_TYPES[dt]}* {n}"
        for n, dt in zip(kernel.output_names, inst.output_dtypes, strict=True)
    ]
    consts = []
    for name, arg in inst.template:
        if isinstance(arg, bool):
            consts.append(f"  constexpr bool {name} = {str(arg).lower()};")
        elif isinstance(arg, mx.Dtype):
            consts.append(f"  using {name} = {CUDA_TYPES[arg]};")
        else:
            consts.append(f"  constexpr int {name} = {int(arg)};")
    return (
        f"__global__ void {cuda_kernel_name(kernel.name, inst.template)}(\n"
        + ",\n".join(params)
        + ") {\n"
        + ("\n".join(consts) + "\n\n" if consts else "")
        + body
        + "\n}\n"
    )


def cuda_translation_unit(kernel: Kernel, instances=None) -> str:
    """A .cu file with what ``mx.fast.cuda_kernel`` compiles for each instance (default: all
    of the kernel's), standard CUDA headers standing in for MLX's device utils header."""
    functions = {cuda_function(kernel, inst) for inst in instances or kernel.instances}
    return (
        _CUDA_UNIT_HEAD
        + kernel.header_for("cuda")
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        + "\n".join(sorted(functions))
        + "\n} // namespace mlx::core::cu\n"
    )
