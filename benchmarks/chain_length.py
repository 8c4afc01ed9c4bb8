"""A decode call's time as a function of the chain it sits in: chains of L dependent calls
(``bench_mxfp4.time_chain``'s links) at several L, and the least-squares line through the
best total time of each, whose slope is the steady cost of one more call and whose intercept
is what one evaluation costs whatever its length (the host encoding the first kernels before
the GPU has any, and the final wait).

``bench_mxfp4`` reports total / L at L = 20 (its ``--calls``), which carries 1/20 of the
intercept in every call. A decode step of K3 runs 92 MoE layers one after another, so the
slope is the cost that a layer's experts add to a step; both are reported, side by side,
for ``gather_qmm``, the three-launch decode (``mxfp4_mma``), the one-launch decode
(``mxfp4_one``, each place for its counters), with ``--tiled`` both on ``expert_layout``'s
tiles (what a tiled store dispatches), with ``--read-limit`` the read limits, and a chain
of links alone (the cast and one trivial op a call) as the floor of a dependent call.

Each timing also records how long ``mx.async_eval`` took to return (the host's encoding and
submission of the chain): a chain whose submission takes as long as its whole evaluation is
bound by the host, not the GPU.

    python -m benchmarks.chain_length --lengths 10 20 40 80 160 --out chain_length.md
"""

from __future__ import annotations

import argparse
import functools
import math
import platform
import time

import mlx.core as mx
import numpy as np

from benchmarks.bench_kda import emit
from benchmarks.bench_mxfp4 import (
    BETA,
    CAP,
    chain_output,
    expert_bytes,
    k3_shape_args,
    random_experts,
    rel_err,
    routing,
)


def link_only(z, w, inds, weights, beta, cap):
    """No expert work: the latent as fp32 (one trivial kernel; with the link's cast, two
    dependent kernels a call)."""
    return z.astype(mx.float32) * 1.0


def fp32_reference(z, w, inds, weights, beta, cap):
    """``gather_qmm`` on the latent as fp32 (the oracle of the decodes' chains)."""
    from kimi_k3.experts import expert_glu_reference

    return expert_glu_reference(z.astype(mx.float32), w, inds, weights, beta, cap)


def jobs(read_limit: bool, tiled: bool = False) -> list[tuple[str, object]]:
    from kimi_k3.experts import expert_glu_reference
    from kimi_k3.kernels import mxfp4_mma, mxfp4_one

    out = [
        ("links only (cast + one trivial op a call)", link_only),
        ("gather_qmm", expert_glu_reference),
        ("mxfp4_mma (three launches)", mxfp4_mma.expert_glu_decode),
    ]
    for counts, how in (
        ("output", "counters in its output (one fill)"),
        ("input", "counters in a zero input (one fill)"),
        ("chained", "counters zeroed by the call before (no fill)"),
    ):
        fn = functools.partial(mxfp4_one.expert_glu_decode, counts=counts)
        out.append((f"mxfp4_one (one launch, {how})", fn))
    if tiled:
        from benchmarks.bench_mxfp4 import tiled_decode

        out.append(("mxfp4_mma (three launches) on the tiled layout", tiled_decode()))
        one_tiled = tiled_decode(mxfp4_one.expert_glu_decode_tiled)
        out.append(("mxfp4_one (counters in its output) on the tiled layout", one_tiled))
    if read_limit:
        from benchmarks.read_limit import read_call

        out += [
            ("read limit, one launch", lambda *a: read_call(*a, launches=1)),
            ("read limit, two launches", lambda *a: read_call(*a, launches=2)),
        ]
    return out


def time_chain_split(fn, inputs: list, length: int, repeats: int) -> tuple[float, float]:
    """Best (total seconds, seconds until ``mx.async_eval`` returned) of ``repeats``
    evaluations of ``bench_mxfp4.chain_output``'s chain of ``length`` calls."""
    mx.eval(fn(*inputs[0]))
    best = (math.inf, math.inf)
    for _ in range(repeats):
        out = chain_output(fn, inputs, length)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.synchronize()
        t2 = time.perf_counter()
        best = min(best, (t2 - t0, t1 - t0))
    return best


def fit(lengths, totals) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line total = intercept + slope * length."""
    slope, intercept = np.polyfit(np.asarray(lengths, float), np.asarray(totals, float), 1)
    return float(slope), float(intercept)


def run(args, todo=None) -> list[dict]:
    """One dict per job (``todo``'s (label, function) pairs, default ``jobs``' filtered by
    ``--only``): its label, best totals and submission times per length (seconds), slope and
    intercept (seconds), and bytes a call."""
    dtype = getattr(mx, args.dtype)
    w = random_experts(args.experts, args.dim, args.hidden, args.seed)
    rng = np.random.default_rng(args.seed)
    inputs = []
    for _ in range(args.calls):
        inds, weights = routing(args.tokens, args.experts, args.topk, rng)
        z = mx.random.normal((args.tokens, args.dim)).astype(dtype)
        inputs.append((z, w, inds, weights, BETA, CAP))
    mx.eval([a[:4] for a in inputs])
    nbytes = np.mean([len(np.unique(np.array(a[2]))) for a in inputs])
    nbytes *= expert_bytes(args.dim, args.hidden)
    if todo is None:
        todo = [
            (label, fn)
            for label, fn in jobs(args.read_limit, args.tiled)
            if not args.only or label in args.only
        ]
    best = {label: {n: (math.inf, math.inf) for n in args.lengths} for label, _ in todo}
    for _ in range(args.rounds):  # rounds one after another, so drifts reach every job alike
        for label, fn in todo:
            for n in args.lengths:
                t = time_chain_split(fn, inputs, n, args.repeats)
                best[label][n] = min(best[label][n], t)
    # each decode's first call against gather_qmm in fp32 on the same latent (a kernel that
    # computed something else would show here, not in the times; a longer chain would not
    # do: its bf16 links turn rounding differences into different latents)
    ref = fp32_reference(*inputs[0])
    errs = {}
    for label, fn in todo:
        if label.startswith("mxfp4_"):
            errs[label] = rel_err(fn(*inputs[0]), ref)
    rows = []
    for label, _ in todo:
        totals = [best[label][n][0] for n in args.lengths]
        slope, intercept = fit(args.lengths, totals)
        rows.append(
            dict(
                label=label,
                totals=totals,
                submits=[best[label][n][1] for n in args.lengths],
                slope=slope,
                intercept=intercept,
                nbytes=0 if label.startswith("links") else nbytes,
                err=errs.get(label),
            )
        )
    return rows


def markdown(rows: list[dict], args) -> str:
    head = (
        f"### Decode chains by length, {args.tokens} token(s), {args.topk} of {args.experts} "
        f"experts, D={args.dim}, I={args.hidden}, {args.dtype}, {mx.default_device()} "
        f"({platform.machine()}, mlx {mx.__version__})\n\n"
        f"Best of {args.rounds} rounds x {args.repeats} repeats per length. Per call: total / "
        "L (what `bench_mxfp4` reports at L = 20); slope and intercept: the least-squares "
        "line through the totals; submit: `mx.async_eval`'s return, per call; error: one call "
        "against gather_qmm in fp32 on the same latent (relative L2, `bench_mxfp4.rel_err`; "
        "CUDA's fp32 matmuls need `MLX_ENABLE_TF32=0` for it to mean anything). Peak "
        f"{args.peak_gbps:.0f} GB/s.\n"
    )
    cols = [f"L={n} per call (submit)" for n in args.lengths]
    lines = [
        "| job | " + " | ".join(cols) + " | slope | intercept | slope GB/s, of peak | error |",
        "|---|" + "---:|" * (len(cols) + 4),
    ]
    for r in rows:
        cells = [
            f"{1e3 * t / n:.4f} ms ({1e3 * s / n:.4f})"
            for n, t, s in zip(args.lengths, r["totals"], r["submits"])
        ]
        rate = ""
        if r["nbytes"] and r["slope"] > 0:
            gbps = r["nbytes"] / r["slope"] / 1e9
            rate = f"{gbps:.0f}, {100 * gbps / args.peak_gbps:.0f}%"
        lines.append(
            f"| {r['label']} | "
            + " | ".join(cells)
            + f" | {1e3 * r['slope']:.4f} ms | {1e3 * r['intercept']:.3f} ms | {rate} | "
            + ("" if r["err"] is None else f"{r['err']:.1e}")
            + " |"
        )
    return head + "\n" + "\n".join(lines) + "\n"


def chain_args(ap, rounds: int = 3):
    """``run``'s options (the call's shape, the chains, rounds and repeats, dtype, seed, peak),
    shared with the scripts that time their own jobs through it (``one_sweep``)."""
    k3_shape_args(ap)
    ap.add_argument("--calls", type=int, default=20, help="distinct input sets, taken in turn")
    ap.add_argument("--lengths", type=int, nargs="+", default=[10, 20, 40, 80, 160])
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM datasheet peak")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    chain_args(ap)
    ap.add_argument("--read-limit", action="store_true", help="also time the read limits")
    ap.add_argument("--tiled", action="store_true", help="also time both decodes on tiled stacks")
    ap.add_argument("--only", nargs="+", default=None, help="time only the jobs of these labels")
    ap.add_argument("--out", default=None, help="append the markdown table here")
    args = ap.parse_args(argv)
    if len(set(args.lengths)) < 2:
        ap.error("--lengths: at least two different lengths are needed for a line")
    rows = run(args)
    text = markdown(rows, args)
    emit(text, args.out, append=True)
    return rows


if __name__ == "__main__":
    main()
