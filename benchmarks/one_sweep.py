"""The one-launch decode on tiles (``mxfp4_one``, what the dispatcher runs at one token) at
launch settings other than ``mxfp4_mma``'s dispatched ones, timed as chains by length
(``chain_length``: the slope is what one more call costs in a long chain).

``mxfp4_one`` takes its threadgroup shape, code-load hints and launch bound from
``mxfp4_mma``'s three-launch settings, which were swept for the three launches (sessions
12-27), never for the one grid. Here each setting is a row: (RT row tiles, SK splits, GW1
and GW2 groups a step, PP double buffering, the launch bound in threadgroups per SM, CS1
and CS2 the evict-first code loads of gate/up and down, then optionally two probes: both
steps' loads before the staging, a persistent grid of that many threadgroups, and on it
the staging kept for the next ticket: ``mxfp4_one.persistent``, which ``KIMI_K3_ONE_GRID``
dispatches). Every row's first call is compared with the
dispatched row's, to the bit where the setting keeps the sums' order (SK = 1), and with
``gather_qmm`` in fp32. ``--ptxas`` reports each setting's registers and spills instead
(nvcc, no GPU). Commit d5ade91 also had two probes that are gone: scale bytes packed as a
word per lane and step (what ``expert_layout``'s tiles hold since), and a ring of single
blocks.

    python -m benchmarks.one_sweep --settings 8,1,8,8,1,2,1,0 4,1,8,8,1,4,1,0 --out one_sweep.md
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from benchmarks import chain_length
from benchmarks.bench_kda import emit
from benchmarks.bench_mxfp4 import tiled_decode

DISPATCHED = "dispatched (mxfp4_mma's settings)"

# A probe: both register buffers' loads (two steps) go out before the activations' staging
# (and before down's wait), where the dispatched body sends one step and the second at the
# loop's first turn. Measured 1-3% slower (session 31).
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


def early_kernel(kernel):
    from kimi_k3.kernels.source import swap

    return kernel.variant("_early", body=swap(kernel.body, EARLY, "one_sweep early loads"))


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


def setting_kernel_full(setting):
    """The kernel ``setting_job`` launches for ``setting``."""
    from kimi_k3.kernels import mxfp4_one

    rt, sk, gw1, gw2, pp, bound, cs1, cs2, early, groups, reuse = setting
    kernel = setting_kernel(rt, sk, bound)
    if early:
        kernel = early_kernel(kernel)
    if reuse and not groups:
        raise ValueError(f"setting {setting}: staging reuse needs a persistent grid")
    if groups:
        kernel = mxfp4_one.persistent(kernel, bool(reuse))
    return kernel


def setting_job(setting):
    """A decode function (``expert_glu_decode``'s signature, on tiles converted once) at
    ``setting`` = (rt, sk, gw1, gw2, pp, bound, cs1, cs2, early loads, persistent groups,
    staging reuse)."""
    from kimi_k3.kernels import mxfp4_one

    rt, sk, gw1, gw2, pp, bound, cs1, cs2, early, groups, reuse = setting
    kernel = setting_kernel_full(setting)

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
            groups=groups or None,
        )
        return out[0]

    return tiled_decode(decode)


def label(setting) -> str:
    rt, sk, gw1, gw2, pp, bound, cs1, cs2, early, groups, reuse = setting
    return (
        f"RT {rt}, SK {sk}, GW {gw1}/{gw2}, PP {int(bool(pp))}, {bound} per SM, "
        f"CS {int(bool(cs1))}/{int(bool(cs2))}"
        + (", both steps' loads before staging" if early else "")
        + (f", a persistent grid of {groups} threadgroups" if groups else "")
        + (", staging kept for the next ticket" if reuse else "")
    )


def parse(text: str) -> tuple:
    vals = tuple(int(v) for v in text.split(","))
    if not 8 <= len(vals) <= 11:
        raise argparse.ArgumentTypeError(
            f"{text!r}: rt,sk,gw1,gw2,pp,bound,cs1,cs2[,early[,persistent groups[,reuse]]]"
        )
    return vals + (0,) * (11 - len(vals))


def ptxas_rows(args) -> list[tuple[str, str]]:
    """(label, ``profile_kernels.register_count``) per setting, the dispatched one first."""
    import mlx.core as mx

    from benchmarks.profile_kernels import register_count
    from kimi_k3.kernels import mxfp4_one
    from kimi_k3.kernels.source import Instance

    rows = []
    for setting in [None, *args.settings]:
        if setting is None:
            shape = mxfp4_one.shape_for("cuda", args.dim, args.hidden)
            kernel = mxfp4_one.tiled_layout(mxfp4_one.dispatched_kernel(*shape[:2]))
            streams, lab = (None, None), DISPATCHED
        else:
            shape, streams = setting[:5], setting[6:8]
            kernel, lab = setting_kernel_full(setting), label(setting)
        inst = kernel.instances[0]
        tmpl = mxfp4_one.template(
            mx.bfloat16,
            args.dim,
            args.hidden,
            args.topk,
            *shape[:4],
            bool(shape[4]),
            *(None if c is None else bool(c) for c in streams),
        )
        rows.append(
            (lab, register_count(kernel, [Instance(inst.input_dtypes, inst.output_dtypes, tmpl)]))
        )
    text = "| setting | registers (spill stores, bytes) |\n|---|---|\n"
    text += "".join(f"| {lab} | {regs} |\n" for lab, regs in rows)
    emit(text, args.out, append=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    chain_length.chain_args(ap, rounds=5)
    ap.add_argument("--settings", type=parse, nargs="+", required=True)
    ap.add_argument("--read-limit", action="store_true", help="also time the one-launch read")
    ap.add_argument("--gather-qmm", action="store_true", help="also time MLX's gather_qmm")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--ptxas",
        action="store_true",
        help="instead of timing, each setting's registers and spill stores (nvcc -Xptxas -v "
        "of its K3 bf16 instance with the setting's template; needs nvcc, not a GPU)",
    )
    args = ap.parse_args(argv)
    if args.ptxas:
        return ptxas_rows(args)
    from kimi_k3.kernels import mxfp4_one

    todo = [(f"mxfp4_one, {DISPATCHED}", tiled_decode(mxfp4_one.expert_glu_decode_tiled))]
    todo += [(f"mxfp4_one, {label(s)}", setting_job(s)) for s in args.settings]
    if args.gather_qmm:
        from kimi_k3.experts import expert_glu_reference

        todo.insert(0, ("gather_qmm", expert_glu_reference))
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
    ref = outs[f"mxfp4_one, {DISPATCHED}"]
    text = chain_length.markdown(rows, args)
    text += "\nMax |difference| from the dispatched row's output (0: the same bits):\n\n"
    for lab, o in outs.items():
        text += f"- {lab}: {float(np.max(np.abs(o - ref))):.3e}\n"
    emit(text, args.out, append=True)
    return rows


if __name__ == "__main__":
    main()
