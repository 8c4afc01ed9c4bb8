// Metal emulator runtime: runs one dispatch of a kernel on the CPU, a threadgroup at a time.
//
// Every thread of a threadgroup is a fiber (ucontext). A fiber runs until it reaches a
// threadgroup barrier, a simdgroup operation or its end, then yields to the scheduler. When
// no fiber can run, the scheduler releases a simdgroup whose live lanes all wait at the same
// simdgroup operation, else the whole threadgroup if every live thread waits at a barrier,
// else it reports a deadlock. Fibers run in a seeded, shuffled order that changes every round,
// so a missing barrier reads stale threadgroup memory deterministically. Threadgroup memory
// (`threadgroup` arrays, which the shim makes function statics) is the bss segment of this
// module; it is filled with 0xFF (NaN) before every threadgroup.
#pragma once

#include <link.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace kk {

struct uvec3 {
  unsigned x, y, z;
};

enum State { RUNNABLE, AT_BARRIER, AT_SIMD, DONE };

constexpr int kLanes = 32;
constexpr int kSlot = 16;  // bytes a lane can exchange in one simdgroup operation
constexpr size_t kStack = 256 * 1024;

// An asynchronous copy into threadgroup memory (ASYNC_COPY16), held until an ASYNC_WAIT
// covers its group; src == nullptr: zeros.
struct AsyncCopy {
  void* dst;
  const void* src;
  unsigned bytes;
  unsigned group;
};
constexpr unsigned kAsyncMax = 64;  // copies in flight per thread

struct Fiber {
  ucontext_t ctx;  // its first entry (makecontext)
  jmp_buf jb;      // where it yielded (later entries)
  bool started;
  State state;
  unsigned lin;          // thread_index_in_threadgroup
  uvec3 pos;             // thread_position_in_threadgroup
  unsigned barriers;     // barriers passed
  unsigned simd_ops;     // simdgroup operations entered
  AsyncCopy pending[kAsyncMax];
  unsigned npending;     // copies not yet landed
  unsigned committed;    // groups committed (the open group's number)
};

// One simdgroup operation in flight: the lanes' values and which lanes took part.
struct SimdOp {
  unsigned char slots[kLanes][kSlot];
  uint32_t lanes;
};

struct Runtime {
  // dispatch
  uvec3 grid, tg, groups, group, size;  // size: threads in this (possibly partial) group
  unsigned nthreads;
  bool strict;
  void (*entry)();
  // fibers
  Fiber* fibers;
  char* stacks;
  size_t stack_bytes;
  unsigned cur;
  jmp_buf sched;
  // simdgroup exchange: [simdgroup][parity]
  struct SimdOp* xchg;
  // copies waiting for their barrier (the threadgroup's; its fibers run one at a time)
  // threadgroup memory (this module's bss)
  char* tg_lo;
  char* tg_hi;
  uint64_t rng;
  char* err;
  int errlen;
};

// Switches use _setjmp/_longjmp (no signal-mask syscall); ucontext only starts a fiber.
// Initialised, so it lives in .data: the bss segment is threadgroup memory and gets poisoned.
static Runtime* rt = reinterpret_cast<Runtime*>(1);

inline Fiber& me() { return rt->fibers[rt->cur]; }

inline void block(State s) {
  Fiber& f = me();
  f.state = s;
  if (!_setjmp(f.jb)) _longjmp(rt->sched, 1);
}

inline void barrier() {
  me().barriers++;
  block(AT_BARRIER);
}

inline unsigned lane() { return me().lin % kLanes; }
inline unsigned simdgroup() { return me().lin / kLanes; }

inline bool lane_live(unsigned sg, unsigned l) {
  unsigned t = sg * kLanes + l;
  return t < rt->nthreads && rt->fibers[t].state != DONE;
}

// A simdgroup operation: publish this lane's value, wait for the other live lanes, then
// return the operation's record (double-buffered by operation parity, so a lane that runs
// ahead into the next operation cannot overwrite values others still read).
template <typename T>
const SimdOp& simd_exchange(const T& v) {
  static_assert(sizeof(T) <= kSlot, "simdgroup value too large for the emulator");
  Fiber& f = me();
  SimdOp& op = rt->xchg[2 * simdgroup() + (f.simd_ops++ & 1)];
  std::memcpy(op.slots[lane()], &v, sizeof(T));
  block(AT_SIMD);
  return op;
}

inline bool took_part(const SimdOp& op, unsigned l) { return l < kLanes && (op.lanes >> l) & 1; }

// Lane l's value; a lane that did not take part reads as `fallback`.
template <typename T>
T slot(const SimdOp& op, unsigned l, T fallback) {
  if (!took_part(op, l)) return fallback;
  T v;
  std::memcpy(&v, op.slots[l], sizeof(T));
  return v;
}

inline void fail(const char* msg) {
  if (rt->err[0] == 0) {
    std::snprintf(rt->err, rt->errlen, "%s (threadgroup %u,%u,%u)", msg, rt->group.x,
                  rt->group.y, rt->group.z);
  }
}

inline uint64_t next_random() {
  uint64_t x = rt->rng;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rt->rng = x;
}

inline void land(void* dst, const void* src, unsigned bytes) {
  if (src) std::memcpy(dst, src, bytes);
  else std::memset(dst, 0, bytes);
}

// A copy lands either at once or at the ASYNC_WAIT that covers it (seeded, half each), the
// two ends of what the hardware may do: a kernel that refills a buffer others still read
// sees the early ones, one that reads a copy before its wait sees the late ones.
inline void async_copy(void* dst, const void* src, unsigned bytes) {
  if (next_random() & 1) {
    land(dst, src, bytes);
    return;
  }
  Fiber& f = me();
  if (f.npending == kAsyncMax) {
    fail("more than 64 asynchronous copies in flight in one thread (an ASYNC_WAIT missing?)");
    return;
  }
  f.pending[f.npending++] = {dst, src, bytes, f.committed};
}

inline void async_commit() { me().committed++; }

// Land the copies of every committed group but the n most recent, in issue order.
inline void async_wait(int n) {
  Fiber& f = me();
  unsigned keep = 0;
  for (unsigned i = 0; i < f.npending; ++i) {
    const AsyncCopy& c = f.pending[i];
    if (c.group + unsigned(n) < f.committed) {
      land(c.dst, c.src, c.bytes);
    } else {
      f.pending[keep++] = c;
    }
  }
  f.npending = keep;
}

inline void fiber_main() {
  rt->entry();
  block(DONE);
}

// Release the simdgroups whose live lanes all wait at the same simdgroup operation.
inline bool release_simdgroups() {
  bool any = false;
  unsigned nsg = (rt->nthreads + kLanes - 1) / kLanes;
  for (unsigned sg = 0; sg < nsg; ++sg) {
    bool all = true, some = false, partial = false;
    unsigned ops = 0;
    for (unsigned l = 0; l < kLanes; ++l) {
      if (!lane_live(sg, l)) {
        partial = true;
        continue;
      }
      Fiber& f = rt->fibers[sg * kLanes + l];
      if (f.state != AT_SIMD) {
        all = false;
        break;
      }
      if (some && f.simd_ops != ops) {
        fail("lanes of a simdgroup wait at different simdgroup operations");
        return false;
      }
      ops = f.simd_ops;
      some = true;
    }
    if (!all || !some) continue;
    if (partial && rt->strict) {
      fail("simdgroup operation with inactive lanes (not portable to CUDA full-mask shuffles)");
      return false;
    }
    SimdOp& op = rt->xchg[2 * sg + ((ops - 1) & 1)];
    op.lanes = 0;
    for (unsigned l = 0; l < kLanes; ++l) {
      if (!lane_live(sg, l)) continue;
      rt->fibers[sg * kLanes + l].state = RUNNABLE;
      op.lanes |= 1u << l;
    }
    any = true;
  }
  return any;
}

inline bool release_barrier() {
  bool some = false, exited = false;
  unsigned passed = 0;
  for (unsigned t = 0; t < rt->nthreads; ++t) {
    Fiber& f = rt->fibers[t];
    if (f.state == DONE) {
      exited = true;
      continue;
    }
    if (f.state != AT_BARRIER) return false;
    if (some && f.barriers != passed) {
      fail("threads wait at different threadgroup barriers");
      return false;
    }
    passed = f.barriers;
    some = true;
  }
  if (some && exited && rt->strict) {
    fail("a thread exited while others wait at a threadgroup barrier");
    return false;
  }
  for (unsigned t = 0; t < rt->nthreads; ++t) {
    if (rt->fibers[t].state == AT_BARRIER) rt->fibers[t].state = RUNNABLE;
  }
  return some;
}

inline void run_group(unsigned* order) {
  for (unsigned t = 0; t < rt->nthreads; ++t) {
    Fiber& f = rt->fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = rt->stacks + size_t(t) * kStack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
    f.state = RUNNABLE;
    f.started = false;
    f.barriers = f.simd_ops = 0;
    f.npending = f.committed = 0;
    f.lin = t;
    f.pos = {t % rt->size.x, (t / rt->size.x) % rt->size.y, t / (rt->size.x * rt->size.y)};
    order[t] = t;
  }
  std::memset(rt->tg_lo, 0xFF, rt->tg_hi - rt->tg_lo);
  for (;;) {
    for (unsigned i = rt->nthreads; i > 1; --i) {  // a fresh order every round
      unsigned j = next_random() % i;
      unsigned tmp = order[i - 1];
      order[i - 1] = order[j];
      order[j] = tmp;
    }
    for (unsigned i = 0; i < rt->nthreads; ++i) {
      unsigned t = order[i];
      if (rt->fibers[t].state != RUNNABLE) continue;
      rt->cur = t;
      if (!_setjmp(rt->sched)) {
        Fiber& f = rt->fibers[t];
        if (!f.started) {
          f.started = true;
          setcontext(&f.ctx);
        }
        _longjmp(f.jb, 1);
      }
    }
    if (rt->err[0]) return;
    if (release_simdgroups()) continue;
    if (rt->err[0]) return;
    if (release_barrier()) continue;
    if (rt->err[0]) return;
    for (unsigned t = 0; t < rt->nthreads; ++t) {
      if (rt->fibers[t].state != DONE) {
        fail("deadlock: threads wait at a barrier or simdgroup operation others never reach");
        return;
      }
    }
    return;
  }
}

static int find_bss(struct dl_phdr_info* info, size_t, void* out) {
  char* self = reinterpret_cast<char*>(&find_bss);
  bool mine = false;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& p = info->dlpi_phdr[i];
    char* lo = reinterpret_cast<char*>(info->dlpi_addr + p.p_vaddr);
    if (p.p_type == PT_LOAD && self >= lo && self < lo + p.p_memsz) mine = true;
  }
  if (!mine) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& p = info->dlpi_phdr[i];
    if (p.p_type == PT_LOAD && (p.p_flags & PF_W)) {
      char** range = static_cast<char**>(out);
      range[0] = reinterpret_cast<char*>(info->dlpi_addr + p.p_vaddr + p.p_filesz);
      range[1] = reinterpret_cast<char*>(info->dlpi_addr + p.p_vaddr + p.p_memsz);
      return 1;
    }
  }
  return 0;
}

inline unsigned ceil_div(unsigned a, unsigned b) { return (a + b - 1) / b; }

// Runs the whole grid. Returns 0, or 1 with a message in err.
inline int launch(void (*entry)(), const unsigned* grid, const unsigned* tg, int strict,
                  unsigned tg_limit, char* err, int errlen) {
  Runtime r{};
  rt = &r;
  r.entry = entry;
  r.err = err;
  r.errlen = errlen;
  r.err[0] = 0;
  r.strict = strict != 0;
  r.rng = 0x9E3779B97F4A7C15ull;
  r.grid = {grid[0], grid[1], grid[2]};
  // MLX dispatches min(threadgroup, grid) per dimension.
  r.tg = {tg[0] < grid[0] ? tg[0] : grid[0], tg[1] < grid[1] ? tg[1] : grid[1],
          tg[2] < grid[2] ? tg[2] : grid[2]};
  unsigned max_threads = r.tg.x * r.tg.y * r.tg.z;
  if (max_threads == 0 || max_threads > 1024) {
    std::snprintf(err, errlen, "threadgroup of %u threads (Metal allows 1..1024)", max_threads);
    return 1;
  }
  if (r.strict && (grid[0] % r.tg.x || grid[1] % r.tg.y || grid[2] % r.tg.z)) {
    std::snprintf(err, errlen, "grid is not a multiple of the threadgroup (CUDA would run "
                               "the extra threads)");
    return 1;
  }
  if (r.strict && max_threads % kLanes) {
    std::snprintf(err, errlen, "threadgroup of %u threads is not a multiple of 32", max_threads);
    return 1;
  }
  char* range[2] = {nullptr, nullptr};
  dl_iterate_phdr(find_bss, range);
  r.tg_lo = range[0];
  r.tg_hi = range[1];
  if (size_t(r.tg_hi - r.tg_lo) > tg_limit) {
    std::snprintf(err, errlen, "threadgroup memory of %zu bytes exceeds %u",
                  size_t(r.tg_hi - r.tg_lo), tg_limit);
    return 1;
  }
  r.groups = {ceil_div(grid[0], r.tg.x), ceil_div(grid[1], r.tg.y), ceil_div(grid[2], r.tg.z)};
  r.stack_bytes = size_t(max_threads) * kStack;
  void* mem = mmap(nullptr, r.stack_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    std::snprintf(err, errlen, "cannot map fiber stacks");
    return 1;
  }
  r.stacks = static_cast<char*>(mem);
  Fiber* fibers = new Fiber[max_threads];
  unsigned* order = new unsigned[max_threads];
  SimdOp* xchg = new SimdOp[2 * ceil_div(max_threads, kLanes)];
  r.fibers = fibers;
  r.xchg = xchg;
  for (unsigned gz = 0; gz < r.groups.z && !err[0]; ++gz) {
    for (unsigned gy = 0; gy < r.groups.y && !err[0]; ++gy) {
      for (unsigned gx = 0; gx < r.groups.x && !err[0]; ++gx) {
        r.group = {gx, gy, gz};
        r.size = {std::min(r.tg.x, grid[0] - gx * r.tg.x), std::min(r.tg.y, grid[1] - gy * r.tg.y),
                  std::min(r.tg.z, grid[2] - gz * r.tg.z)};
        r.nthreads = r.size.x * r.size.y * r.size.z;
        run_group(order);
      }
    }
  }
  delete[] xchg;
  delete[] order;
  delete[] fibers;
  munmap(mem, r.stack_bytes);
  rt = reinterpret_cast<Runtime*>(1);
  return err[0] ? 1 : 0;
}

}  // namespace kk
