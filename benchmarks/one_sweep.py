"""The one-launch decode on tiles (``mxfp4_one``, what the dispatcher runs at one token) at
launch settings other than ``mxfp4_mma``'s dispatched ones, timed as chains by length
(``chain_length``: the slope is what one more call costs in a long chain).

``mxfp4_one`` takes its threadgroup shape, code-load hints and launch bound from
``mxfp4_mma``'s three-launch settings, which were swept for the three launches (sessions
12-27), never for the one grid. Here each setting is a row: (RT row tiles, SK splits, GW1
and GW2 groups a step, PP double buffering (from 2 on: a ring of PP single blocks), the
launch bound in threadgroups per SM, CS1 and CS2 the evict-first code loads of gate/up and
down, then optionally two probes: packed scale words, both steps' loads before the
staging). Every row's first call is compared with the dispatched row's, to the bit where
the setting keeps the sums' order (SK = 1), and with ``gather_qmm`` in fp32.

    python -m benchmarks.one_sweep --settings 8,1,8,8,1,2,1,0 4,1,8,8,1,4,1,0 --out one_sweep.md
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from benchmarks import chain_length
from benchmarks.bench_kda import emit
from benchmarks.bench_mxfp4 import k3_shape_args, tiled_decode

DISPATCHED = "dispatched (mxfp4_mma's settings)"

# A probe: each lane's four scale bytes of a step (two 4-group blocks, rows g and g + 8) as one
# 32-bit word, so a step loads two scale words instead of eight bytes (``pack_scales`` lays
# the tiled scales out so; steps of 8 groups only).
PACKED = (
    (
        "      sc[4 * u] = ea[16 * (bb) + 64 * u];",
        "      if (u == 0) sc[0] = *(const DEVICE uint*)(ea + 3 * lane + 16 * (bb));",
        2,
    ),
    (
        "      sc[4 * u + 1] = ea[32 + 16 * (bb) + 64 * u];",
        "      if (u == 0) sc[1] = *(const DEVICE uint*)(eb + 3 * lane + 16 * (bb));",
        2,
    ),
    ("      sc[4 * u + 2] = eb[16 * (bb) + 64 * u];", "", 2),
    ("      sc[4 * u + 3] = eb[32 + 16 * (bb) + 64 * u];", "", 2),
    ("uint sx[4 * NB], sy[4 * NB];", "uint sx[2], sy[2];", 2),
    ("kk_e8m0_bits(sc[4 * u])", "kk_e8m0_bits((sc[0] >> (16 * u)) & 255u)", 2),
    ("kk_e8m0_bits(sc[4 * u + 1])", "kk_e8m0_bits((sc[0] >> (16 * u + 8)) & 255u)", 2),
    ("kk_e8m0_bits(sc[4 * u + 2])", "kk_e8m0_bits((sc[1] >> (16 * u)) & 255u)", 2),
    ("kk_e8m0_bits(sc[4 * u + 3])", "kk_e8m0_bits((sc[1] >> (16 * u + 8)) & 255u)", 2),
)


# A probe: both register buffers' loads (two steps) go out before the activations' staging
# (and before down's wait), where the dispatched body sends one step and the second at the
# loop's first turn.
EARLY = (
    (
        "  if (work) KK_LOAD(qx, sx, b0);\n",
        "  if (work) KK_LOAD(qx, sx, b0);\n"
        "  if (work && PP && b0 + GW < b1) KK_LOAD(qy, sy, b0 + GW);\n",
        2,
    ),
    (
        "      if (second) KK_LOAD(qy, sy, b + GW);",
        "      if (second && b > b0) KK_LOAD(qy, sy, b + GW);",
        2,
    ),
)


# A probe: the code registers as a ring of RB single 4-group blocks on tiles (a block's 1 KB
# of codes is contiguous there): a block's loads go out again, for the block RB ahead, as
# soon as its MMAs have read it, so RB - 1 blocks stay in flight during a block's math (the
# dispatched double buffer has one to two 8-group steps). Session 27 measured such a ring
# 35-50% slower on MLX's layout, where a block is half of every row's 128-byte line.
_PP_LOOP = """\
  if (work && PP) {
    for (uint b = b0; b < b1; b += 2 * GW) {
      const bool second = b + GW < b1;            // the whole warp agrees
      if (second) KK_LOAD(qy, sy, b + GW);
      KK_STEP(qx, sx, frag, b, NB);
      if (second) {
        if (b + 2 * GW < b1) KK_LOAD(qx, sx, b + 2 * GW);
        KK_STEP(qy, sy, frag, b + GW, NB);
      }
    }
  }
"""
_NO_PP_LOOP = """\
  if (work && !PP) {
    for (uint b = b0; b < b1; b += GW) {
      if (b > b0) KK_LOAD(qx, sx, b);
      KK_STEP(qx, sx, frag, b, NB);
    }
  }
"""
_RING_FILL = """\
  uint4 qr[4 * RB];
  uint sr[4 * RB];
#define KK_LOADB(j, bb)                                                             \\
  {                                                                                 \\
    qr[4 * (j)] = KK_Q(qa, 16 * (bb));                                              \\
    qr[4 * (j) + 1] = KK_Q(qa, 32 + 16 * (bb));                                     \\
    qr[4 * (j) + 2] = KK_Q(qb, 16 * (bb));                                          \\
    qr[4 * (j) + 3] = KK_Q(qb, 32 + 16 * (bb));                                     \\
    sr[4 * (j)] = ea[16 * (bb)];                                                    \\
    sr[4 * (j) + 1] = ea[32 + 16 * (bb)];                                           \\
    sr[4 * (j) + 2] = eb[16 * (bb)];                                                \\
    sr[4 * (j) + 3] = eb[32 + 16 * (bb)];                                           \\
  }
  const uint nbk = work ? (b1 - b0) / 4 : 0;      // blocks of this split
  _Pragma("unroll") for (int j = 0; j < RB; ++j) {
    if ((uint)j < nbk) KK_LOADB(j, b0 + 4 * j);
  }
"""


def _ring_loop():
    from kimi_k3.kernels.mxfp4_mma import mma_block

    block = (
        "#define KK_BLOCK(j, bb) \\\n  { \\\n"
        + mma_block(
            "frag[(bb) / 4 * 32 + 8 * pq + g]",
            ("sr[4 * (j)]", "sr[4 * (j) + 1]", "sr[4 * (j) + 2]", "sr[4 * (j) + 3]"),
            "const uint4 wa0 = qr[4 * (j)], wa8 = qr[4 * (j) + 1], wb0 = qr[4 * (j) + 2], "
            "wb8 = qr[4 * (j) + 3];",
        )
        + "  }\n"
    )
    return (
        block
        + """\
  for (uint i = 0; i < nbk; i += RB) {
    _Pragma("unroll") for (int j = 0; j < RB; ++j) {
      if (i + j < nbk) {
        KK_BLOCK(j, b0 + 4 * (i + j));
        if (i + j + RB < nbk) KK_LOADB(j, b0 + 4 * (i + j + RB));
      }
    }
  }
#undef KK_LOADB
#undef KK_BLOCK
"""
    )


def ring_kernel(kernel, rb: int):
    from kimi_k3.kernels.source import swap

    fill = f"  constexpr int RB = {rb};\n" + _RING_FILL
    rules = (
        ("  uint4 qx[4 * NB], qy[4 * NB];\n", "", 2),
        ("  uint sx[4 * NB], sy[4 * NB];\n", "", 2),
        ("  if (work) KK_LOAD(qx, sx, b0);\n", fill, 2),
        (_NO_PP_LOOP, "", 2),
        (_PP_LOOP, _ring_loop(), 2),
    )
    body = swap(kernel.body, rules, "one_sweep ring")
    return kernel.variant(f"_ring{rb}", body=body)


def early_kernel(kernel):
    from kimi_k3.kernels.source import swap

    return kernel.variant("_early", body=swap(kernel.body, EARLY, "one_sweep early loads"))


def packed_kernel(kernel):
    from kimi_k3.kernels.source import swap

    return kernel.variant("_pks", body=swap(kernel.body, PACKED, "one_sweep packed scales"))


def pack_scales(s: mx.array) -> mx.array:
    """Tiled scales [E, R, G] -> each 16-row tile's 8-group super-blocks as 32 words, word
    ``lane`` = (block 0 row g, block 0 row g + 8, block 1 row g, block 1 row g + 8) of group
    ``tq`` (lane = 4 g + tq)."""
    E, R, G = s.shape
    if G % 8:
        raise ValueError(f"packed scales need whole 8-group steps, got {G} groups")
    t = s.reshape(E, R // 16, G // 8, 2, 2, 8, 4).transpose(0, 1, 2, 5, 6, 3, 4)
    return t.reshape(E, R, G)


def setting_kernel(rt, sk, bound):
    """``mxfp4_one``'s kernel (counters in its output) at ``bound`` threadgroups of
    ``32 rt sk`` threads per SM, with ``mxfp4_mma``'s dispatched decode, on tiles."""
    from kimi_k3.kernels import mxfp4_mma, mxfp4_one

    threads = 32 * rt * sk
    base = mxfp4_one.MXFP4_ONE
    kernel = base.variant(f"_lb{threads}x1", launch_bounds=(threads, 1)) if bound <= 1 else None
    kernel = kernel or base.bounded(threads, bound)
    (decode,) = set(mxfp4_mma.DECODE.values())
    if decode == "byte permute":
        kernel = mxfp4_mma.byte_permute_decode(kernel)
    return mxfp4_one.tiled_layout(kernel)


def setting_job(setting):
    """A decode function (``expert_glu_decode``'s signature, on tiles converted once) at
    ``setting`` = (rt, sk, gw1, gw2, pp, bound, cs1, cs2, packed scales)."""
    from kimi_k3.kernels import expert_layout, mxfp4_one

    rt, sk, gw1, gw2, pp, bound, cs1, cs2, packed, early = setting
    kernel = setting_kernel(rt, sk, bound)
    if pp >= 2:
        if packed or early:
            raise ValueError(f"setting {setting}: the ring (pp >= 2) takes no other probe")
        kernel = ring_kernel(kernel, pp)
    if packed:
        kernel = packed_kernel(kernel)
    if early:
        kernel = early_kernel(kernel)

    def decode(z, w, inds, weights, beta, cap):
        out = mxfp4_one.launch(
            kernel,
            z,
            w,
            inds,
            weights,
            beta,
            cap,
            shape=(rt, sk, gw1, gw2, bool(pp)),
            streams=(bool(cs1), bool(cs2)),
        )
        return out[0]

    if not packed:
        return tiled_decode(decode)
    held = {}  # id(w): (w, its tiled copy with packed scales)

    def on_packed(z, w, inds, weights, beta, cap):
        if id(w) not in held:
            t = expert_layout.tile(w)
            t = expert_layout.TiledStacks({n: (q, pack_scales(s)) for n, (q, s) in t.items()})
            mx.eval(t)
            held[id(w)] = (w, t)
        return decode(z, held[id(w)][1], inds, weights, beta, cap)

    return on_packed


def label(setting) -> str:
    rt, sk, gw1, gw2, pp, bound, cs1, cs2, packed, early = setting
    return (
        f"RT {rt}, SK {sk}, GW {gw1}/{gw2}, "
        + (f"a ring of {pp} blocks" if pp >= 2 else f"PP {int(bool(pp))}")
        + f", {bound} per SM, "
        f"CS {int(bool(cs1))}/{int(bool(cs2))}"
        + (", packed scales" if packed else "")
        + (", both steps' loads before staging" if early else "")
    )


def parse(text: str) -> tuple:
    vals = tuple(int(v) for v in text.split(","))
    if not 8 <= len(vals) <= 10:
        raise argparse.ArgumentTypeError(
            f"{text!r}: rt,sk,gw1,gw2,pp,bound,cs1,cs2[,packed scales[,early loads]]"
        )
    return vals + (0,) * (10 - len(vals))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    k3_shape_args(ap)
    ap.add_argument("--settings", type=parse, nargs="+", required=True)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--lengths", type=int, nargs="+", default=[10, 20, 40, 80, 160])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-gbps", type=float, default=4800.0)
    ap.add_argument("--read-limit", action="store_true", help="also time the one-launch read")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from kimi_k3.kernels import mxfp4_one

    todo = [(f"mxfp4_one, {DISPATCHED}", tiled_decode(mxfp4_one.expert_glu_decode_tiled))]
    todo += [(f"mxfp4_one, {label(s)}", setting_job(s)) for s in args.settings]
    if args.read_limit:
        from benchmarks.read_limit import read_call

        todo.append(("read limit, one launch", lambda *a: read_call(*a, launches=1)))
    rows = chain_length.run(args, todo)
    # every setting's first call against the dispatched one's (the same inputs)
    mx.random.seed(args.seed)
    from benchmarks.bench_mxfp4 import BETA, CAP, random_experts, routing

    w = random_experts(args.experts, args.dim, args.hidden, args.seed)
    inds, weights = routing(args.tokens, args.experts, args.topk, np.random.default_rng(1))
    z = mx.random.normal((args.tokens, args.dim)).astype(getattr(mx, args.dtype))
    outs = {
        lab: np.asarray(fn(z, w, inds, weights, BETA, CAP))
        for lab, fn in todo
        if lab.startswith("mxfp4_one")
    }
    ref = outs[todo[0][0]]
    text = chain_length.markdown(rows, args)
    text += "\nMax |difference| from the dispatched row's output (0: the same bits):\n\n"
    for lab, o in outs.items():
        text += f"- {lab}: {float(np.max(np.abs(o - ref))):.3e}\n"
    emit(text, args.out, append=True)
    return rows


if __name__ == "__main__":
    main()
