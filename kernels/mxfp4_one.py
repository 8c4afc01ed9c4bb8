"""MXFP4 expert decode in one launch: ``mxfp4_mma``'s gate/up, down and ordered sum in one grid.

``mxfp4_mma`` makes three dependent launches a call (gate/up + SiTU-GLU, down weighted by the
routing weight, the sum over the k choices). Between them the GPU drains: the last
threadgroups of one launch run with the SMs half empty, then the next launch starts with no
loads in flight. Here the same two projection bodies share one grid, and threadgroups meet
through counters in device memory (``counts``, an output filled with zeros):

* **Tickets, not block indices.** A threadgroup's first act is to take a ticket (an atomic
  add on ``counts[0]``). Tickets ``0 .. XG * pairs - 1`` are gate/up work (pair ``t / XG``, row
  block ``t % XG``), the rest down work (pair ``d / XD``, row block ``d % XD``). A down
  ticket is handed out only after every gate/up ticket, to threadgroups already running, and
  gate/up work waits for nothing, so the waits below always end (no assumption about the
  order in which the hardware starts threadgroups).
* **Gate/up** is ``mxfp4_mma``'s body: it writes its 16-row units of ``h [pairs, I]``, then
  (after a barrier, a device fence and an atomic add) counts itself done on ``counts[1 + p]``.
* **Down** issues its first step's weight loads, then waits until all ``XG`` gate/up
  threadgroups of its pair are done (one thread spins on ``LOAD_ACQUIRE``), stages its row of
  ``h`` and runs ``mxfp4_mma``'s down body into ``part [pairs, D]``. It then counts itself on
  its (token, row block) counter; the threadgroup that brings that counter to k adds the k
  pairs' ``part`` rows of its block in order into ``y`` (the sum of ``mxfp4_decode``'s
  ``mxfp4_sum``: the same order, so the same bits as the three launches).

A wait that has not ended after ``SPIN_LIMIT`` reads gives up and makes its rows NaN (it
cannot happen with tickets; a broken count shows as NaN, not as a hang or a wrong number).

**A persistent grid** (``persistent``; dispatched where ``GRID`` or ``KIMI_K3_ONE_GRID`` asks
for one, not by default): fewer threadgroups than tickets, each looping over tickets and
asking for its next one as it starts the current one, so only its first ticket's atomic is
waited for; optionally keeping its staged activations for its next ticket of the same token
(gate/up) or pair (down). Same bits. Not yet timed on the H200 (``h200.sh issue5_decode``);
on the development machine's ptxas its tiled variant spills nothing, where the ticket grid
spills 24 bytes a thread outside its loops.

Same exactness contract and bits as ``mxfp4_mma.expert_glu_decode``. On Metal the threads of
a spinning threadgroup hold their core while it waits; like every ``mxfp4_mma`` kernel this
one is dispatched on CUDA only (up to ``dispatch.EXPERT_ONE_LAUNCH_MAX_PAIRS`` pairs, where it
was measured faster than the three launches in chains of dependent calls), and the emulator
(one threadgroup at a time, in ticket order) checks its bookkeeping.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading

import mlx.core as mx

from . import mxfp4_mma, source
from .mxfp4_decode import K3
from .mxfp4_mma import MMA_HEADER
from .source import Instance, Kernel, constant, derived, swap
from .source import backend as default_backend

U32, U8, F32, I32 = mx.uint32, mx.uint8, mx.float32, mx.int32

# Reads of a counter before a wait gives up (its rows become NaN).
SPIN_LIMIT = 1 << 24


# mxfp4_mma's body without what the one kernel declares once for both roles (threadgroup
# arrays, thread indices, the pair), its threadgroup position as the ticket's row block ``bx``
# and its activation type as ``TX`` (the latent's type in gate/up, float in down).
_COMMON = (
    ("  SHARED uint4 frag[G * 8];\n", ""),
    ("  SHARED float red[SK * RT * 32];\n", ""),
    ("  SHARED float s_max[NW];\n", ""),
    ("  SHARED float s_par[2];\n", ""),
    ("  const uint tid = THREAD_INDEX;\n", ""),
    ("  const uint lane = LANE;\n", ""),
    ("  const uint warp = SIMDGROUP;\n", ""),
    ("  const uint p = GROUP_POS.y;\n", ""),
    ("GROUP_POS.x", "bx", 2),
    ("const DEVICE T* xr", "const DEVICE TX* xr"),
    ("const DEVICE T* src", "const DEVICE TX* src"),
)
_ROLE = swap(mxfp4_mma.BODY, _COMMON, "mxfp4_one (both roles)")

GATE_UP = swap(
    _ROLE,
    (
        ("(const DEVICE uint4*)w_a", "(const DEVICE uint4*)w1"),
        ("(const DEVICE uint4*)w_b", "(const DEVICE uint4*)w3"),
        ("s_a + ra", "s1 + ra"),
        ("s_b + rb", "s3 + rb"),
        ("x + (size_t)(GLU ? p / K : p) * KD", "z + (size_t)(p / K) * KD"),
        (
            mxfp4_mma.PARAMS,
            "  if (tid == 0) {\n    s_par[0] = glu[0];\n    s_par[1] = glu[1];\n  }\n",
        ),
        ("out[(size_t)p * NR", "h[(size_t)p * NR", 2),
    ),
    "mxfp4_one (gate/up)",
)

# Down waits for its pair's gate/up threadgroups between its first loads and the staging of h.
WAIT = """\
  if (tid == 0) {
    s_par[0] = wts[p];
    uint spins = 0;
    while (LOAD_ACQUIRE(&cnt[1 + p]) < (uint)XG) {
      if (++spins == SPIN_LIMIT) {
        s_par[0] = AS_FLOAT(0x7fc00000u);  // NaN: the wait gave up
        break;
      }
    }
    FENCE_DEVICE();
  }
  BARRIER();
"""
DOWN = swap(
    _ROLE,
    (
        ("(const DEVICE uint4*)w_a", "(const DEVICE uint4*)w2"),
        ("(const DEVICE uint4*)w_b", "(const DEVICE uint4*)w2"),
        ("s_a + ra", "s2 + ra"),
        ("s_b + rb", "s2 + rb"),
        ("x + (size_t)(GLU ? p / K : p) * KD", "h + (size_t)p * KD"),
        (mxfp4_mma.PARAMS, WAIT),
        ("out[(size_t)p * NR", "part[(size_t)p * NR", 2),
    ),
    "mxfp4_one (down)",
)

# A role's names for mxfp4_mma's body (its template values there), and its pair and row
# block from its ticket t (x row blocks a pair).
ROLE_HEAD = """\
    typedef {tx} TX;
    constexpr int KD = {kd};
    constexpr int NR = {nr};
    constexpr bool GLU = {glu};
    constexpr int GW = {gw};
    constexpr bool CS = {cs};
    const uint p = {t} / {x};
    const uint bx = {t} % {x};
"""

BODY = (
    """
  constexpr int XG = (NI / 16 + RT - 1) / RT;   // gate/up row blocks per pair
  constexpr int XD = (D / 32 + RT - 1) / RT;    // down row blocks per pair
  constexpr int FG = (D > NI ? D : NI) / 32;    // the wider projection's scale groups
  constexpr uint SPIN_LIMIT = """
    + str(SPIN_LIMIT)
    + """u;
  SHARED uint4 frag[FG * 8];
  SHARED float red[SK * RT * 32];
  SHARED float s_max[RT * SK];
  SHARED float s_par[2];
  SHARED uint s_ticket[1];
  const uint tid = THREAD_INDEX;
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const uint pairs = NUM_GROUPS.x / (XG + XD);
//@POINTERS
  if (tid == 0) s_ticket[0] = ATOMIC_ADD(&cnt[0], 1u);
  BARRIER();
  const uint ticket = s_ticket[0];
  if (ticket < XG * pairs) {
"""
    + ROLE_HEAD.format(tx="T", kd="D", nr="NI", glu="true", gw="GW1", cs="CS1", t="ticket", x="XG")
    + GATE_UP
    + """
    // Done: every thread's h is written (barrier), then made visible before the count.
    BARRIER();
    if (tid == 0) {
      FENCE_DEVICE();
      ATOMIC_ADD(&cnt[1 + p], 1u);
    }
  } else {
"""
    + ROLE_HEAD.format(
        tx="float",
        kd="NI",
        nr="D",
        glu="false",
        gw="GW2",
        cs="CS2",
        t="(ticket - XG * pairs)",
        x="XD",
    )
    + DOWN
    + """
    // The last of the token's k pairs to finish this row block adds them up, in order.
    BARRIER();
    const uint tok = p / K;
    if (tid == 0) {
      FENCE_DEVICE();
      const uint done = ATOMIC_ADD(&cnt[1 + pairs + tok * XD + bx], 1u);
      if (done == K - 1) FENCE_DEVICE();
      s_ticket[0] = done;
    }
    BARRIER();
    const uint row = bx * (RT * 32) + tid;
    if (s_ticket[0] == K - 1 && (int)tid < RT * 32 && row < D) {
      float total = 0.0f;
      for (int j = 0; j < K; ++j) total += part[((size_t)tok * K + j) * D + row];
      y[(size_t)tok * D + row] = total;
    }
  }
"""
)

INPUTS = ["z", "w1", "s1", "w3", "s3", "w2", "s2", "inds", "wts", "glu"]
OUTPUTS = ["y", "h", "part"]
# Where the counters come from (COUNTS):
# - "output": one output holding the counters, h, part and y (in that order, each from a
#   multiple of 32 words), which MLX fills with zeros (init_value fills every output, so
#   one output is one fill); y is a view of it;
# - "input": a zero array made per call (one fill) that the kernel counts in, in place
#   (nothing else holds it);
# - "chained": the zero array left by the previous call of this kernel (its fifth output,
#   CHAIN_WORDS words that ticket 0's threadgroup zeroes), so no fill at all. Each such array
#   is handed to exactly one later call, which therefore runs after the call that made it:
#   the calls of one process form one chain (a dependency between calls that were
#   independent, never a shared counter). A first call, or one needing more words, takes a
#   fresh zero array.
# "input" and "chained" write into an input, which MLX does not expect: under mx.compile
# two calls' zero arrays may be merged into one, and a chained array made inside a compiled
# function would leak out of it. Only "output" is safe there.
COUNTS = "output"
COUNTS_MODES = ("output", "input", "chained")
CHAIN_WORDS = 4096
_POINTERS = {
    "output": """\
  const uint nc_ = (1 + pairs + (pairs / K) * XD + 31) / 32 * 32;
  DEVICE uint* cnt = (DEVICE uint*)buf;
  DEVICE float* h = buf + nc_;
  DEVICE float* part = h + (size_t)pairs * NI;
  DEVICE float* y = part + (size_t)pairs * D;
""",
    "input": "  DEVICE uint* cnt = (DEVICE uint*)counts;\n",
    "chained": "  DEVICE uint* cnt = (DEVICE uint*)counts;\n",
}
# The chained mode's zeroing of the next call's counters.
_ZEROING = (
    "  const uint ticket = s_ticket[0];\n",
    "  const uint ticket = s_ticket[0];\n"
    "  if (ticket == 0) {\n"
    "    for (uint i = tid; i < (uint)NZ; i += RT * SK * 32) zeros[i] = 0u;\n"
    "  }\n",
)
_CHAIN: dict = {}  # backend: the zero array the next chained call counts in
_CHAIN_LOCK = threading.Lock()


def template(dtype, D, I, k, rt, sk, gw1, gw2, pp=True, cs1=None, cs2=None) -> list:
    """The template values: latent dtype, D, I, top-k, row tiles and splits per threadgroup
    (both roles), groups per step of gate/up and of down, double buffering, and whether each
    role's code words are loaded as read once (default: ``mxfp4_mma.STREAM_LOADS``)."""
    return [
        ("T", dtype),
        ("D", D),
        ("NI", I),
        ("K", k),
        ("RT", rt),
        ("SK", sk),
        ("GW1", gw1),
        ("GW2", gw2),
        ("PP", pp),
        ("CS1", mxfp4_mma.STREAM_LOADS["gate_up"] if cs1 is None else cs1),
        ("CS2", mxfp4_mma.STREAM_LOADS["down"] if cs2 is None else cs2),
    ]


def shape_for(backend: str, D: int, I: int) -> tuple:
    """(RT, SK, GW1, GW2, PP): ``mxfp4_mma``'s dispatched launch shapes, which must agree on
    the threadgroup (both roles share it)."""
    gu, dn = _shapes(backend, D, I)
    if not _one_grid(gu, dn):
        raise ValueError(
            f"mxfp4_one: mxfp4_mma.LAUNCH's gate/up {gu} and down {dn} differ in threadgroup"
        )
    return gu[0], gu[1], gu[2], dn[2], gu[3]


def _shapes(backend: str, D: int, I: int) -> tuple:
    """``mxfp4_mma``'s dispatched (gate/up, down) launch shapes for these dims."""
    return mxfp4_mma.dispatched_shape(backend, D, True), mxfp4_mma.dispatched_shape(
        backend, I, False
    )


def _one_grid(gu: tuple, dn: tuple) -> bool:
    """Whether the two launch shapes share a threadgroup and double buffering."""
    return gu[:2] == dn[:2] and gu[3] == dn[3]


def _one_setting() -> bool:
    """Whether ``mxfp4_mma`` has one launch bound and one code decode for both projections."""
    return len(set(mxfp4_mma.MIN_BLOCKS.values())) == 1 and len(set(mxfp4_mma.DECODE.values())) == 1


def agrees(backend: str, D: int, I: int) -> bool:
    """Whether ``mxfp4_mma``'s dispatched settings for these dims can be one grid, which
    ``shape_for`` and ``dispatched_kernel`` otherwise refuse. The dispatcher takes the three
    launches where they cannot (a setting changed by hand). Cheap: no kernel lookup."""
    return _one_grid(*_shapes(backend, D, I)) and _one_setting()


def _io(counts: str) -> tuple:
    """(inputs, outputs) names and dtypes of the kernel for ``counts``."""
    if counts == "output":
        return INPUTS, ["buf"], [], [F32]
    outs = OUTPUTS + (["zeros"] if counts == "chained" else [])
    dts = [F32, F32, F32] + ([U32] if counts == "chained" else [])
    return INPUTS + ["counts"], outs, [U32], dts


def _instances(counts: str) -> list:
    rt, sk, gw1, gw2, pp = shape_for("cuda", K3["D"], K3["I"])
    _, _, extra_in, out_dts = _io(counts)
    nz = [("NZ", CHAIN_WORDS)] if counts == "chained" else []
    return [
        Instance(
            [dt, U32, U8, U32, U8, U32, U8, I32, F32, F32] + extra_in,
            out_dts,
            template(dt, K3["D"], K3["I"], K3["K"], rt, sk, gw1, gw2, pp) + nz,
        )
        for dt in (mx.bfloat16, mx.float16, mx.float32)
    ]


def _kernel(counts: str) -> Kernel:
    ins, outs, _, _ = _io(counts)
    name = "mxfp4_one" + {"output": "", "input": "_cin", "chained": "_chain"}[counts]
    body = BODY.replace(*_ZEROING) if counts == "chained" else BODY
    assert counts != "chained" or body != BODY
    body = body.replace("//@POINTERS\n", _POINTERS[counts])
    return Kernel(name, ins, outs, body, header=MMA_HEADER, instances=_instances(counts))


MXFP4_ONE = _kernel("output")
MXFP4_ONE_CIN = _kernel("input")
MXFP4_ONE_CHAIN = _kernel("chained")
# Looked up by name at dispatch, so that a test's replacement of one is what runs.
_BASE = {"output": "MXFP4_ONE", "input": "MXFP4_ONE_CIN", "chained": "MXFP4_ONE_CHAIN"}


def dispatched_kernel(rt: int, sk: int, counts: str | None = None) -> Kernel:
    """The kernel for ``counts`` (default ``COUNTS``) at ``mxfp4_mma``'s launch bound and code
    decode (both roles must agree)."""
    counts = counts or COUNTS
    if counts not in COUNTS_MODES:
        raise ValueError(f"mxfp4_one.COUNTS = {counts!r}: one of {COUNTS_MODES}")
    if not _one_setting():
        raise ValueError(
            f"mxfp4_one: one launch needs one bound and one decode for both projections, got "
            f"mxfp4_mma.MIN_BLOCKS {mxfp4_mma.MIN_BLOCKS}, DECODE {mxfp4_mma.DECODE}"
        )
    (decode,) = set(mxfp4_mma.DECODE.values())
    if decode not in mxfp4_mma.DECODES:
        raise ValueError(f"mxfp4_mma.DECODE = {decode!r}: one of {mxfp4_mma.DECODES}")
    base = globals()[_BASE[counts]]
    (bound,) = set(mxfp4_mma.MIN_BLOCKS.values())
    kernel = base.bounded(32 * rt * sk, bound)
    return mxfp4_mma.byte_permute_decode(kernel) if decode == "byte permute" else kernel


def launch(
    kernel,
    z,
    w,
    inds,
    weights,
    beta,
    cap,
    backend=None,
    counts=None,
    shape=None,
    streams=None,
    groups=None,
    y_only=False,
):
    """One launch of ``kernel`` (the ``_BASE`` kernel of ``counts``, default ``COUNTS``, or a
    variant): (y [N, D], h [pairs, I], part [pairs, D], the counters) at ``shape`` (default
    ``shape_for``); ``streams``: (CS1, CS2), default ``mxfp4_mma.STREAM_LOADS``'; ``groups``:
    threadgroups in the grid, at most one per ticket (default one per ticket, as every kernel
    here but ``persistent``'s needs; those loop over tickets, so take fewer, and read the
    pair count from its third parameter). ``y_only``: return y alone (the dispatch path,
    which saves building three views a call)."""
    backend = backend or default_backend()
    counts = counts or COUNTS
    N, k = inds.shape
    D = z.shape[-1]
    I = w["w1"][0].shape[-2]
    rt, sk, gw1, gw2, pp = shape or shape_for(backend, D, I)
    pairs = N * k
    xg, xd = -(-(I // 16) // rt), -(-(D // 32) // rt)
    ncounts = 1 + pairs + N * xd
    if counts == "chained" and ncounts > CHAIN_WORDS:
        counts, kernel = "input", dispatched_kernel(rt, sk, "input")
    inputs = [
        z,
        *w["w1"],
        *w["w3"],
        *w["w2"],
        inds.reshape(-1).astype(I32),
        weights.reshape(-1).astype(F32),
        constant((beta, cap, pairs)),
    ]
    tmpl = template(z.dtype, D, I, k, rt, sk, gw1, gw2, pp, *(streams or (None, None)))
    # "output": counters, h, part, y in one buffer (h from a multiple of 32 words)
    o_h = -(-ncounts // 32) * 32
    o_p = o_h + pairs * I
    o_y = o_p + pairs * D
    extra, cnt = {}, None
    with _CHAIN_LOCK if counts == "chained" else contextlib.nullcontext():
        if counts == "output":
            shapes, dtypes = [(o_y + N * D,)], [F32]
            extra["init_value"] = 0
        else:
            shapes, dtypes = [(N, D), (pairs, I), (pairs, D)], [F32, F32, F32]
            if counts == "chained":
                cnt = _CHAIN.pop(backend, None)
                shapes.append((CHAIN_WORDS,))
                dtypes.append(U32)
                tmpl = tmpl + [("NZ", CHAIN_WORDS)]
            if cnt is None:
                # Metal passes inputs of fewer than 8 elements in its constant address space
                cnt = mx.zeros((CHAIN_WORDS if counts == "chained" else max(ncounts, 8),), U32)
            inputs.append(cnt)
        out = kernel(
            backend,
            inputs=inputs,
            output_shapes=shapes,
            output_dtypes=dtypes,
            grid=(32 * rt * sk * min(groups or (xg + xd) * pairs, (xg + xd) * pairs), 1, 1),
            threadgroup=(32 * rt * sk, 1, 1),
            template=tmpl,
            **extra,
        )
        if counts == "chained":
            _CHAIN[backend] = out[-1]
    if counts == "output":
        (buf,) = out
        if y_only:
            return buf[o_y:].reshape(N, D)
        return (
            buf[o_y:].reshape(N, D),
            buf[o_h:o_p].reshape(pairs, I),
            buf[o_p:o_y].reshape(pairs, D),
            buf[:ncounts].view(U32),
        )
    return out[0] if y_only else (*out[:3], cnt)


def tiled_layout(kernel: Kernel) -> Kernel:
    """``kernel`` reading stacks in ``expert_layout``'s tiles
    (``mxfp4_mma.tiled_layout``'s rewrite, once per role), named ``<name>_tiled``: same
    arithmetic in the same order, so the same bits. Dispatched for ``expert_layout.TiledStacks``
    (the expert store's layout where CUDA's kernels serve it)."""
    return derived(kernel, "tiled", _tiled)


# mxfp4_mma's tiled rewrite, each text once in either role
_TILED = tuple((old, new, 2 * (more[0] if more else 1)) for old, new, *more in mxfp4_mma._TILED)


def _tiled(kernel: Kernel) -> Kernel:
    return kernel.variant("_tiled", body=swap(kernel.body, _TILED, "mxfp4_one.tiled_layout"))


def expert_glu_decode_tiled(z, w, inds, weights, beta, cap, backend=None, counts=None):
    """``expert_glu_decode`` on stacks ``w`` in ``expert_layout``'s tiles."""
    return _decode(True, z, w, inds, weights, beta, cap, backend, counts)


def expert_glu_decode(z, w, inds, weights, beta, cap, backend: str | None = None, counts=None):
    """``mxfp4_mma.expert_glu_decode`` in one launch (same shapes, return and bits: fp32
    [N, D]). Needs ``mxfp4_mma.eligible`` inputs. ``counts``: ``COUNTS``' choice."""
    return _decode(False, z, w, inds, weights, beta, cap, backend, counts)


def _decode(tiled, z, w, inds, weights, beta, cap, backend, counts):
    """The dispatched kernel for these dims (on tiles where ``tiled``, on ``grid``'s grid),
    launched at the shape it was chosen for (found once)."""
    backend = backend or default_backend()
    shape = shape_for(backend, z.shape[-1], w["w1"][0].shape[-2])
    kernel = dispatched_kernel(shape[0], shape[1], counts)
    if tiled:
        kernel = tiled_layout(kernel)
    groups, keep = grid()
    if groups:
        kernel = persistent(kernel, keep)
    return launch(
        kernel, z, w, inds, weights, beta, cap, backend, counts, shape, groups=groups, y_only=True
    )


# The dispatched grid, as ``KIMI_K3_ONE_GRID`` spells it (which overrides it per call):
# ``tickets``, a threadgroup per ticket (as timed in sessions 26-31); ``N``, ``persistent``'s
# grid of N threadgroups looping over the tickets; ``N/sm``, N per SM of the device
# (``source.sm_count``; the ticket grid where that is unknown); ``,keep`` after either keeps
# a threadgroup's staging for its next ticket.
GRID = "tickets"


def grid() -> tuple[int | None, bool]:
    """(threadgroups, keep) of ``KIMI_K3_ONE_GRID``, or of ``GRID`` where it is unset: None
    for a threadgroup per ticket. A value not spelt as ``GRID``'s comment says is an error
    naming the variable (or ``mxfp4_one.GRID``)."""
    text = os.environ.get("KIMI_K3_ONE_GRID", "")
    where = "KIMI_K3_ONE_GRID" if text else "mxfp4_one.GRID"
    groups, per_sm, keep = _parse_grid(text or GRID, where)
    if per_sm:
        sms = source.sm_count()
        return (groups * sms if sms else None), keep
    return groups, keep


@functools.lru_cache(maxsize=16)
def _parse_grid(text: str, where: str) -> tuple[int | None, bool, bool]:
    """(N, per SM, keep) of a grid's spelling."""
    if text == "tickets":
        return None, False, False
    m = re.fullmatch(r"([1-9][0-9]*)(/sm)?(,keep)?", text)
    if m is None:
        raise ValueError(
            f"{where}={text!r}: expected tickets, N, N/sm, N,keep or N/sm,keep (N >= 1 "
            "threadgroups, or per SM)" + (", or unset" if where.startswith("KIMI") else "")
        )
    return int(m[1]), bool(m[2]), bool(m[3])


# A persistent grid: ``groups`` threadgroups (two per SM, say) loop over the tickets, each
# asking for its next ticket when it starts on the current one (the atomic's result is
# first used at the ticket's end, so no warp waits for it), where the dispatched grid has a
# threadgroup per ticket, each taking its ticket before its first load. No deadlock: a
# threadgroup's next ticket is later than its current one, so one that holds a gate/up
# ticket it has not started is itself doing gate/up work, which waits for nothing; down
# work waits only for gate/up tickets, all handed out before any down ticket. Each role
# runs in a loop of its own (a threadgroup's tickets are gate/up ones, then down ones):
# with both roles in one loop ptxas spilled 588 bytes a thread, with a loop per role none.
_TICKET = "  const uint ticket = s_ticket[0];\n  if (ticket < XG * pairs) {\n"
_ELSE = "ATOMIC_ADD(&cnt[1 + p], 1u);\n    }\n  } else {\n"
_PAIRS = "  const uint pairs = NUM_GROUPS.x / (XG + XD);\n"


def _loop(bound: str, role: str) -> str:
    return (
        f"  while (ticket_ < {bound}) {{\n"
        "  const uint ticket = ticket_;\n"
        "  uint next_ = 0;\n"
        "  if (tid == 0) next_ = ATOMIC_ADD(&cnt[0], 1u);\n"
        "  {\n" + role + "  }\n"
        "  BARRIER();\n"
        "  if (tid == 0) s_next[0] = next_;\n"
        "  BARRIER();\n"
        "  ticket_ = s_next[0];\n"
        "  BARRIER();\n"
        "  }\n"
    )


def persistent(kernel: Kernel, keep: bool = False) -> Kernel:
    """``kernel`` (``dispatched_kernel``'s for counters in an output or an input, or its tiled
    variant) on a grid of fewer threadgroups than tickets, each looping over tickets (launch
    it with ``launch(groups=...)``; the pair count comes from its third parameter); with
    ``keep``, a threadgroup skips a staging it already holds (gate/up: the token's latent,
    so at one token it stages once; down: the pair's ``h``). Named ``<name>_persist`` (and
    ``_reuse``): the same arithmetic in the same order, so the same bits."""
    made = derived(kernel, "persistent", _persistent)
    return derived(made, "reuse", _reuse) if keep else made


def _persistent(kernel: Kernel) -> Kernel:
    body = kernel.body.rstrip()
    if body.count(_TICKET) != 1 or body.count(_ELSE) != 1 or body.count(_PAIRS) != 1:
        raise ValueError(
            f"mxfp4_one.persistent: {kernel.name} is not the one launch with counters in an "
            "output or an input (the chained counters' zeroing sits where the grid loops)"
        )
    if not body.endswith("}"):
        raise AssertionError("mxfp4_one.persistent: the kernel changed at its end")
    head, rest = body.split(_TICKET)
    cut = rest.index(_ELSE) + len(_ELSE) - len("  } else {\n")
    gate_up, down = rest[:cut], rest[cut + len("  } else {\n") : -1]
    head = head.replace(_PAIRS, "  const uint pairs = (uint)glu[2];\n  SHARED uint s_next[1];\n")
    body = (
        head
        + "  uint ticket_ = s_ticket[0];\n"
        + _loop("XG * pairs", gate_up)
        + _loop("(XG + XD) * pairs", down)
    )
    return kernel.variant("_persist", body=body)


# Staging kept: a threadgroup keeps what it staged (the activations' B fragments and their
# unscale) for its next ticket of the same role and row, keyed by the token (gate/up) or
# the pair (down, its top bit set so the keys never meet).
_STAGE_FROM = "\\\n  float m = 0.0f;\n"
_STAGE_TO = "                     PACK_HALF2(v[3], v[7]));\n  }\n"


def _reuse(kernel: Kernel) -> Kernel:
    body = kernel.body
    decl = "  uint ticket_ = s_ticket[0];\n"
    if body.count(decl) != 1 or body.count(_STAGE_FROM) != 2:
        raise AssertionError("mxfp4_one.persistent(keep=True): the kernel changed")
    body = body.replace(
        decl, decl + "  uint staged_ = 0xffffffffu;\n  float unscale_keep_ = 0.0f;\n"
    )
    out, at = [], 0
    for key in ("(p / K)", "(0x80000000u | p)"):  # gate/up's staging, then down's
        i = body.index(_STAGE_FROM, at)
        j = body.index(_STAGE_TO, i) + len(_STAGE_TO)
        seg = body[i:j]
        if seg.count("  const float unscale = ") != 1:
            raise AssertionError("mxfp4_one.persistent(keep=True): the staging changed")
        seg = seg.replace("  const float unscale = ", "  unscale_keep_ = ")
        out += [
            body[at:i],
            f"  if (staged_ != {key}) {{\n    staged_ = {key};\n",
            seg,
            "  }\n  const float unscale = unscale_keep_;\n",
        ]
        at = j
    out.append(body[at:])
    return kernel.variant("_reuse", body="".join(out))
