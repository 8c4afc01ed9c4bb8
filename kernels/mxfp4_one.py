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

Same exactness contract and bits as ``mxfp4_mma.expert_glu_decode``. On Metal the threads of
a spinning threadgroup hold their core while it waits; like every ``mxfp4_mma`` kernel this
one is dispatched on CUDA only (up to ``dispatch.EXPERT_ONE_LAUNCH_MAX_PAIRS`` pairs, where it
was measured faster than the three launches in chains of dependent calls), and the emulator
(one threadgroup at a time, in ticket order) checks its bookkeeping.
"""

from __future__ import annotations

import mlx.core as mx

from . import mxfp4_mma
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
# One output holds the counters, h, part and y (in that order, each from a multiple of 32
# words), which MLX fills with zeros (init_value fills every output, so one output is one
# fill); y is a view of it. Counters in an output, not an input, keep the kernel safe under
# mx.compile (which may merge two calls' zero inputs into one).
POINTERS = """\
  const uint nc_ = (1 + pairs + (pairs / K) * XD + 31) / 32 * 32;
  DEVICE uint* cnt = (DEVICE uint*)buf;
  DEVICE float* h = buf + nc_;
  DEVICE float* part = h + (size_t)pairs * NI;
  DEVICE float* y = part + (size_t)pairs * D;
"""


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


def _instances() -> list:
    rt, sk, gw1, gw2, pp = shape_for("cuda", K3["D"], K3["I"])
    return [
        Instance(
            [dt, U32, U8, U32, U8, U32, U8, I32, F32, F32],
            [F32],
            template(dt, K3["D"], K3["I"], K3["K"], rt, sk, gw1, gw2, pp),
        )
        for dt in (mx.bfloat16, mx.float16, mx.float32)
    ]


MXFP4_ONE = Kernel(
    "mxfp4_one",
    INPUTS,
    ["buf"],
    BODY.replace("//@POINTERS\n", POINTERS),
    header=MMA_HEADER,
    instances=_instances(),
)


def dispatched_kernel(rt: int, sk: int) -> Kernel:
    """The kernel at ``mxfp4_mma``'s launch bound and code decode (both roles must agree).
    Looks ``MXFP4_ONE`` up at each call, so that a test's replacement of it is what runs."""
    if not _one_setting():
        raise ValueError(
            f"mxfp4_one: one launch needs one bound and one decode for both projections, got "
            f"mxfp4_mma.MIN_BLOCKS {mxfp4_mma.MIN_BLOCKS}, DECODE {mxfp4_mma.DECODE}"
        )
    (decode,) = set(mxfp4_mma.DECODE.values())
    if decode not in mxfp4_mma.DECODES:
        raise ValueError(f"mxfp4_mma.DECODE = {decode!r}: one of {mxfp4_mma.DECODES}")
    (bound,) = set(mxfp4_mma.MIN_BLOCKS.values())
    kernel = MXFP4_ONE.bounded(32 * rt * sk, bound)
    return mxfp4_mma.byte_permute_decode(kernel) if decode == "byte permute" else kernel


def launch(
    kernel, z, w, inds, weights, beta, cap, backend=None, shape=None, streams=None, y_only=False
):
    """One launch of ``kernel`` (``MXFP4_ONE`` or a variant): (y [N, D], h [pairs, I],
    part [pairs, D], the counters) at ``shape`` (default ``shape_for``); ``streams``: (CS1,
    CS2), default ``mxfp4_mma.STREAM_LOADS``'. ``y_only``: y alone (the dispatch path, which
    saves building three views a call)."""
    backend = backend or default_backend()
    N, k = inds.shape
    D = z.shape[-1]
    I = w["w1"][0].shape[-2]
    rt, sk, gw1, gw2, pp = shape or shape_for(backend, D, I)
    pairs = N * k
    xg, xd = -(-(I // 16) // rt), -(-(D // 32) // rt)
    ncounts = 1 + pairs + N * xd
    inputs = [
        z,
        *w["w1"],
        *w["w3"],
        *w["w2"],
        inds.reshape(-1).astype(I32),
        weights.reshape(-1).astype(F32),
        constant((beta, cap, pairs)),
    ]
    # counters, h, part, y in one buffer (h from a multiple of 32 words)
    o_h = -(-ncounts // 32) * 32
    o_p = o_h + pairs * I
    o_y = o_p + pairs * D
    (buf,) = kernel(
        backend,
        inputs=inputs,
        output_shapes=[(o_y + N * D,)],
        output_dtypes=[F32],
        grid=(32 * rt * sk * (xg + xd) * pairs, 1, 1),
        threadgroup=(32 * rt * sk, 1, 1),
        template=template(z.dtype, D, I, k, rt, sk, gw1, gw2, pp, *(streams or (None, None))),
        init_value=0,
    )
    if y_only:
        return buf[o_y:].reshape(N, D)
    return (
        buf[o_y:].reshape(N, D),
        buf[o_h:o_p].reshape(pairs, I),
        buf[o_p:o_y].reshape(pairs, D),
        buf[:ncounts].view(U32),
    )


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


def expert_glu_decode_tiled(z, w, inds, weights, beta, cap, backend=None):
    """``expert_glu_decode`` on stacks ``w`` in ``expert_layout``'s tiles."""
    return _decode(True, z, w, inds, weights, beta, cap, backend)


def expert_glu_decode(z, w, inds, weights, beta, cap, backend: str | None = None):
    """``mxfp4_mma.expert_glu_decode`` in one launch (same shapes, return and bits: fp32
    [N, D]). Needs ``mxfp4_mma.eligible`` inputs."""
    return _decode(False, z, w, inds, weights, beta, cap, backend)


def _decode(tiled, z, w, inds, weights, beta, cap, backend):
    """The dispatched kernel for these dims (on tiles where ``tiled``), launched at the shape
    it was chosen for."""
    backend = backend or default_backend()
    shape = shape_for(backend, z.shape[-1], w["w1"][0].shape[-2])
    kernel = dispatched_kernel(shape[0], shape[1])
    if tiled:
        kernel = tiled_layout(kernel)
    return launch(kernel, z, w, inds, weights, beta, cap, backend, shape, y_only=True)
