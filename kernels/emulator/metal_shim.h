// The subset of the Metal Shading Language that MLX custom kernels use, as plain C++17, so
// the exact source handed to mx.fast.metal_kernel compiles with g++ and runs on the emulator
// runtime (runtime.h). Address-space qualifiers become nothing, except `threadgroup`, which
// makes a declaration a function static shared by the fibers of a threadgroup (so only
// threadgroup arrays can be declared, no threadgroup pointers: metal_emulator.py checks).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "runtime.h"

// Lets a header tell the emulator from a Metal compiler (the ASYNC_COPY16 helpers use it).
#define KK_METAL_EMULATOR 1

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef _Float16 half;
typedef half float16_t;

// ---- bfloat16_t: 16 stored bits, arithmetic in float (as MLX's bf16.h on older Metal) ----
struct bfloat16_t {
  uint16_t bits_;
  bfloat16_t() = default;
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  bfloat16_t(T x) : bits_(from_float(static_cast<float>(x))) {}
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  operator T() const {
    uint32_t u = uint32_t(bits_) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return static_cast<T>(f);
  }
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += ((u >> 16) & 1) + 0x7FFFu;  // round to nearest even
    return uint16_t(u >> 16);
  }
};
inline float bf(bfloat16_t x) { return static_cast<float>(x); }
inline bfloat16_t operator-(bfloat16_t a) { return -bf(a); }
#define KK_BF16_OP(op)                                                                     \
  inline bfloat16_t operator op(bfloat16_t a, bfloat16_t b) { return bf(a) op bf(b); }     \
  inline float operator op(bfloat16_t a, float b) { return bf(a) op b; }                   \
  inline float operator op(float a, bfloat16_t b) { return a op bf(b); }                   \
  inline bfloat16_t operator op(bfloat16_t a, int b) { return bf(a) op float(b); }         \
  inline bfloat16_t operator op(int a, bfloat16_t b) { return float(a) op bf(b); }         \
  inline bfloat16_t operator op(bfloat16_t a, unsigned b) { return bf(a) op float(b); }    \
  inline bfloat16_t operator op(unsigned a, bfloat16_t b) { return float(a) op bf(b); }    \
  template <typename T>                                                                    \
  inline T& operator op##=(T & a, bfloat16_t b) { return a = static_cast<T>(a op bf(b)); } \
  inline bfloat16_t& operator op##=(bfloat16_t & a, float b) { return a = bf(a) op b; }
KK_BF16_OP(+)
KK_BF16_OP(-)
KK_BF16_OP(*)
KK_BF16_OP(/)
#undef KK_BF16_OP
#define KK_BF16_CMP(op)                                                            \
  inline bool operator op(bfloat16_t a, bfloat16_t b) { return bf(a) op bf(b); } \
  inline bool operator op(bfloat16_t a, float b) { return bf(a) op b; }           \
  inline bool operator op(float a, bfloat16_t b) { return a op bf(b); }
KK_BF16_CMP(<)
KK_BF16_CMP(>)
KK_BF16_CMP(<=)
KK_BF16_CMP(>=)
KK_BF16_CMP(==)
KK_BF16_CMP(!=)
#undef KK_BF16_CMP

// ---- vectors: x/y/z/w fields, elementwise arithmetic ----
template <typename T, int N>
struct kk_vec;
template <typename T>
struct kk_vec<T, 2> {
  T x, y;
  kk_vec() = default;
  kk_vec(T s) : x(s), y(s) {}
  kk_vec(T a, T b) : x(a), y(b) {}
  template <typename U, typename = std::enable_if_t<!std::is_same_v<U, T>>>
  explicit kk_vec(const kk_vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}  // float2(half2) etc.
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
template <typename T>
struct kk_vec<T, 3> {
  T x, y, z;
  kk_vec() = default;
  kk_vec(T s) : x(s), y(s), z(s) {}
  kk_vec(T a, T b, T c) : x(a), y(b), z(c) {}
  template <typename U, typename = std::enable_if_t<!std::is_same_v<U, T>>>
  explicit kk_vec(const kk_vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
template <typename T>
struct kk_vec<T, 4> {
  T x, y, z, w;
  kk_vec() = default;
  kk_vec(T s) : x(s), y(s), z(s), w(s) {}
  kk_vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  template <typename U, typename = std::enable_if_t<!std::is_same_v<U, T>>>
  explicit kk_vec(const kk_vec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  T& operator[](int i) { return (&x)[i]; }
  const T& operator[](int i) const { return (&x)[i]; }
};
#define KK_VEC_OP(op)                                                                  \
  template <typename T, int N>                                                         \
  kk_vec<T, N> operator op(kk_vec<T, N> a, kk_vec<T, N> b) {                           \
    for (int i = 0; i < N; ++i) a[i] = a[i] op b[i];                                   \
    return a;                                                                          \
  }                                                                                    \
  template <typename T, int N, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>> \
  kk_vec<T, N> operator op(kk_vec<T, N> a, S s) {                                      \
    for (int i = 0; i < N; ++i) a[i] = a[i] op T(s);                                   \
    return a;                                                                          \
  }                                                                                    \
  template <typename T, int N, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>> \
  kk_vec<T, N> operator op(S s, kk_vec<T, N> a) {                                      \
    for (int i = 0; i < N; ++i) a[i] = T(s) op a[i];                                   \
    return a;                                                                          \
  }                                                                                    \
  template <typename T, int N, typename B>                                             \
  kk_vec<T, N>& operator op##=(kk_vec<T, N>& a, B b) {                                 \
    return a = a op b;                                                                 \
  }
KK_VEC_OP(+)
KK_VEC_OP(-)
KK_VEC_OP(*)
KK_VEC_OP(/)
#undef KK_VEC_OP
#define KK_VEC_TYPES(T, name) \
  typedef kk_vec<T, 2> name##2; \
  typedef kk_vec<T, 3> name##3; \
  typedef kk_vec<T, 4> name##4;
KK_VEC_TYPES(float, float)
KK_VEC_TYPES(half, half)
KK_VEC_TYPES(int, int)
KK_VEC_TYPES(uint, uint)
KK_VEC_TYPES(short, short)
KK_VEC_TYPES(ushort, ushort)
KK_VEC_TYPES(uchar, uchar)
KK_VEC_TYPES(bool, bool)
#undef KK_VEC_TYPES

namespace metal {

template <typename T, typename U>
T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs equal sizes");
  T t;
  std::memcpy(&t, &u, sizeof(T));
  return t;
}

// ---- math: computed in float, returned in the argument's type ----
#define KK_UNARY(name, expr)                          \
  template <typename T>                               \
  inline T name(T v) {                                \
    float x = static_cast<float>(v);                  \
    return static_cast<T>(expr);                      \
  }
#define KK_MATH_SET                                   \
  KK_UNARY(exp, std::exp(x))                          \
  KK_UNARY(exp2, std::exp2(x))                        \
  KK_UNARY(log, std::log(x))                          \
  KK_UNARY(log2, std::log2(x))                        \
  KK_UNARY(sqrt, std::sqrt(x))                        \
  KK_UNARY(rsqrt, 1.0f / std::sqrt(x))                \
  KK_UNARY(tanh, std::tanh(x))                        \
  KK_UNARY(sin, std::sin(x))                          \
  KK_UNARY(cos, std::cos(x))                          \
  KK_UNARY(abs, std::fabs(x))                         \
  KK_UNARY(fabs, std::fabs(x))                        \
  KK_UNARY(floor, std::floor(x))                      \
  KK_UNARY(ceil, std::ceil(x))                        \
  KK_UNARY(round, std::round(x))                      \
  KK_UNARY(trunc, std::trunc(x))                      \
  KK_UNARY(sign, (x > 0.0f) - (x < 0.0f))             \
  template <typename T>                               \
  inline T pow(T a, T b) {                            \
    return static_cast<T>(std::pow(float(a), float(b))); \
  }                                                   \
  template <typename T>                               \
  inline T fma(T a, T b, T c) {                       \
    return static_cast<T>(std::fma(float(a), float(b), float(c))); \
  }
KK_MATH_SET
namespace precise {
KK_MATH_SET
}
namespace fast {
KK_MATH_SET
}
#undef KK_MATH_SET
#undef KK_UNARY

template <typename T>
inline T max(T a, T b) { return a < b ? b : a; }
template <typename T>
inline T min(T a, T b) { return b < a ? b : a; }
template <typename T>
inline T fmax(T a, T b) { return a < b ? b : a; }
template <typename T>
inline T fmin(T a, T b) { return b < a ? b : a; }
template <typename T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }
template <typename T>
inline bool isnan(T x) { return std::isnan(float(x)); }
template <typename T>
inline bool isinf(T x) { return std::isinf(float(x)); }
template <typename T>
inline T dot(kk_vec<T, 2> a, kk_vec<T, 2> b) { return a.x * b.x + a.y * b.y; }
template <typename T>
inline T dot(kk_vec<T, 3> a, kk_vec<T, 3> b) { return a.x * b.x + a.y * b.y + a.z * b.z; }
template <typename T>
inline T dot(kk_vec<T, 4> a, kk_vec<T, 4> b) {
  return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

template <typename T>
struct numeric_limits {
  static T max() { return std::numeric_limits<float>::max(); }
  static T lowest() { return -std::numeric_limits<float>::max(); }
  static T infinity() { return std::numeric_limits<float>::infinity(); }
};

// ---- barriers ----
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
inline void threadgroup_barrier(mem_flags) { kk::barrier(); }
inline void simdgroup_barrier(mem_flags) { kk::simd_exchange(0); }

// ---- simdgroup functions (all live lanes of the simdgroup must call them) ----
template <typename T>
inline T simd_sum(T v) {
  const kk::SimdOp& op = kk::simd_exchange(v);
  T acc[kk::kLanes];  // butterfly order, as a shuffle-xor reduction adds
  for (unsigned l = 0; l < kk::kLanes; ++l) acc[l] = kk::slot(op, l, T(0));
  for (unsigned o = kk::kLanes / 2; o > 0; o >>= 1) {
    T next[kk::kLanes];
    for (unsigned l = 0; l < kk::kLanes; ++l) next[l] = acc[l] + acc[l ^ o];
    for (unsigned l = 0; l < kk::kLanes; ++l) acc[l] = next[l];
  }
  return acc[kk::lane()];
}
template <typename T, typename F>
inline T kk_simd_fold(T v, F f) {
  const kk::SimdOp& op = kk::simd_exchange(v);
  T r = v;
  for (unsigned l = 0; l < kk::kLanes; ++l) r = f(r, kk::slot(op, l, v));
  return r;
}
template <typename T>
inline T simd_max(T v) { return kk_simd_fold(v, [](T a, T b) { return a < b ? b : a; }); }
template <typename T>
inline T simd_min(T v) { return kk_simd_fold(v, [](T a, T b) { return b < a ? b : a; }); }
inline bool simd_all(bool v) { return kk_simd_fold(v, [](bool a, bool b) { return a && b; }); }
inline bool simd_any(bool v) { return kk_simd_fold(v, [](bool a, bool b) { return a || b; }); }
template <typename T>
inline T simd_product(T v) {
  const kk::SimdOp& op = kk::simd_exchange(v);
  T r = T(1);
  for (unsigned l = 0; l < kk::kLanes; ++l) r = r * kk::slot(op, l, T(1));
  return r;
}
template <typename T>
inline T simd_shuffle(T v, ushort lane) { return kk::slot(kk::simd_exchange(v), lane, v); }
template <typename T>
inline T simd_broadcast(T v, ushort lane) { return kk::slot(kk::simd_exchange(v), lane, v); }
template <typename T>
inline T simd_broadcast_first(T v) {
  const kk::SimdOp& op = kk::simd_exchange(v);
  return kk::slot(op, op.lanes ? __builtin_ctz(op.lanes) : 0, v);
}
template <typename T>
inline T simd_shuffle_xor(T v, ushort mask) {
  return kk::slot(kk::simd_exchange(v), kk::lane() ^ mask, v);
}
template <typename T>
inline T simd_shuffle_down(T v, ushort delta) {
  return kk::slot(kk::simd_exchange(v), kk::lane() + delta, v);
}
template <typename T>
inline T simd_shuffle_up(T v, ushort delta) {
  unsigned src = kk::lane() >= delta ? kk::lane() - delta : kk::kLanes;
  return kk::slot(kk::simd_exchange(v), src, v);
}
template <typename T>
inline T simd_prefix_inclusive_sum(T v) {
  const kk::SimdOp& op = kk::simd_exchange(v);
  T acc = T(0);
  for (unsigned l = 0; l <= kk::lane(); ++l) acc = acc + kk::slot(op, l, T(0));
  return acc;
}
template <typename T>
inline T simd_prefix_exclusive_sum(T v) {
  const kk::SimdOp& op = kk::simd_exchange(v);
  T acc = T(0);
  for (unsigned l = 0; l < kk::lane(); ++l) acc = acc + kk::slot(op, l, T(0));
  return acc;
}

// ---- atomics (fibers of one OS thread never interleave inside an operation) ----
enum memory_order { memory_order_relaxed };
template <typename T>
struct atomic {
  T v;
};
typedef atomic<float> atomic_float;
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
template <typename T, typename U>
inline T atomic_fetch_add_explicit(atomic<T>* a, U x, memory_order) {
  T old = a->v;
  a->v = old + T(x);
  return old;
}
template <typename T, typename U>
inline T atomic_fetch_max_explicit(atomic<T>* a, U x, memory_order) {
  T old = a->v;
  a->v = old < T(x) ? T(x) : old;
  return old;
}
template <typename T, typename U>
inline T atomic_fetch_min_explicit(atomic<T>* a, U x, memory_order) {
  T old = a->v;
  a->v = T(x) < old ? T(x) : old;
  return old;
}
template <typename T>
inline T atomic_load_explicit(atomic<T>* a, memory_order) { return a->v; }
template <typename T, typename U>
inline void atomic_store_explicit(atomic<T>* a, U x, memory_order) { a->v = T(x); }
template <typename T, typename U>
inline T atomic_exchange_explicit(atomic<T>* a, U x, memory_order) {
  T old = a->v;
  a->v = T(x);
  return old;
}
template <typename T, typename U>
inline bool atomic_compare_exchange_weak_explicit(atomic<T>* a, T* expected, U x, memory_order,
                                                  memory_order) {
  if (a->v == *expected) {
    a->v = T(x);
    return true;
  }
  *expected = a->v;
  return false;
}

}  // namespace metal

using namespace metal;

// ---- Metal keywords and attributes ----
#define METAL_FUNC inline
#define device
#define constant
#define thread
#define threadgroup static
