"""Where a decode call's wall time goes: building the graph, evaluating it, the kernels.

``bench_mxfp4`` and ``mxfp4_sweep`` time a batch of calls as build + evaluate: the Python
calls that put the kernels into the graph (``fn(*inputs)``) run inside the timed region,
before the GPU gets its first kernel. This splits that time, per call and per job, into

- ``build``: the Python calls alone (nothing is evaluated);
- ``eval``: ``mx.eval`` of the already built outputs of the whole batch (the CPU encodes
  kernel after kernel while the GPU runs the ones before);
- ``build + eval``: what the other benchmarks report;

for the dispatched decode (gate/up + SiTU-GLU, down, the ordered sum), each of its two
projection kernels alone, MLX's ``gather_qmm`` path and a one-element op (the floor of a
launch). GB/s are over the expert weights a call reads (scales included).

The GPU's own time per kernel comes from Nsight Compute, which serializes kernels and reads
each one's duration (``--cache-control none``: L2 as the previous kernel left it, as in a
real decode). ``--summarize`` turns its CSV into a table of the median per kernel:

    python3 -m benchmarks.gpu_time                                   # on the H200
    ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv \\
        --log-file ncu.csv python3 -m benchmarks.gpu_time --calls 10 --rounds 1 --repeats 1
    python3 -m benchmarks.gpu_time --summarize ncu.csv
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics

import mlx.core as mx
import numpy as np

from benchmarks.bench_mxfp4 import (
    BETA,
    CAP,
    add_layer_args,
    batch_splits,
    expert_bytes,
    random_experts,
    routing,
)
from benchmarks.mxfp4_sweep import launch, projection_inputs
from kimi_k3.experts import expert_glu_reference
from kimi_k3.kernels import mxfp4_mma, source
from kimi_k3.kernels.dispatch import expert_glu_kernel


def split_batch(fn, inputs: list, repeats: int) -> tuple[float, float]:
    """Best (build, eval) seconds per call over ``repeats`` batches of every input set
    (``bench_mxfp4.batch_splits``)."""
    splits = batch_splits(fn, inputs, repeats)
    return min(b for b, _ in splits), min(e for _, e in splits)


def projection(glu: bool):
    """One projection of the dispatched decode alone: the dispatcher's kernel, launch shape,
    bound and decode (``mxfp4_mma.dispatched_kernel``, ``dispatched_shape``), launched as
    ``mxfp4_sweep`` launches its jobs."""

    def fn(z, w, inds, wts, h):
        D, I, k = z.shape[-1], w["w1"][0].shape[-2], inds.shape[-1]
        a = projection_inputs(
            "gate_up" if glu else "down", w, z, h, inds.reshape(-1), wts.reshape(-1)
        )
        KD, NR = (D, I) if glu else (I, D)
        shape = mxfp4_mma.dispatched_shape(source.backend(), KD, glu)
        return launch(mxfp4_mma.dispatched_kernel(glu, shape), *a, KD, NR, k, glu, shape)

    return fn


# ncu's time units in microseconds
MICROSECONDS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def summarize(path: str) -> None:
    """Median, min and count of gpu__time_duration per kernel (name up to its first '(')."""
    rows = {}
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for rec in csv.DictReader(lines):
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = rec["Kernel Name"].split("(")[0]
        value = float(rec["Metric Value"].replace(",", ""))
        unit = rec["Metric Unit"]
        if unit not in MICROSECONDS:
            raise ValueError(f"{path}: unknown time unit {unit!r} for {name}")
        rows.setdefault(name, []).append(value * MICROSECONDS[unit])
    if not rows:
        print(f"{path}: no gpu__time_duration.sum rows (did the profiled command fail?)")
        return
    print("| kernel | launches | median (us) | min (us) |")
    print("|---|---:|---:|---:|")
    for name, ts in rows.items():
        short = re.sub(r"^custom_kernel_", "", name)[:90]
        print(f"| {short} | {len(ts)} | {statistics.median(ts):.1f} | {min(ts):.1f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_args(p, rounds=3)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--summarize", metavar="NCU_CSV", help="summarize an ncu --csv log instead")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return

    D, I, k = args.dim, args.hidden, args.topk
    w = random_experts(args.experts, D, I, 0)
    rng = np.random.default_rng(0)
    sets = []
    for _ in range(args.calls):
        inds, wts = routing(args.tokens, args.experts, k, rng)
        z = mx.random.normal((args.tokens, D)).astype(mx.bfloat16)
        h = mx.random.normal((args.tokens * k, I)).astype(mx.float32)
        sets.append((z, w, inds, wts, h))
    mx.eval([s[:1] + s[2:] for s in sets])
    used = np.mean([len(np.unique(np.array(s[2]))) for s in sets])
    per = expert_bytes(D, I) / 3
    one = mx.array(1, dtype=mx.uint32)
    jobs = {
        "decode, dispatched": (
            lambda z, w, i, wt, h: expert_glu_kernel(z, w, i)(z, w, i, wt, BETA, CAP),
            3 * per,
        ),
        "gate/up alone": (projection(True), 2 * per),
        "down alone": (projection(False), per),
        "gather_qmm (MLX)": (
            lambda z, w, i, wt, h: expert_glu_reference(z, w, i, wt, BETA, CAP),
            3 * per,
        ),
        "one-element op": (lambda z, w, i, wt, h: one ^ i[0, 0].astype(mx.uint32), 0),
    }
    times = {name: [] for name in jobs}
    for _ in range(args.rounds):
        for name, (fn, _) in jobs.items():
            times[name].append(split_batch(fn, sets, args.repeats))
    print(f"{args.tokens} token(s), {k} of {args.experts} experts, {args.calls} calls a batch")
    print(
        "| job | build (us/call) | eval (us/call) | build + eval | GB/s on eval | "
        "eval, every round |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name, (_, nbytes) in jobs.items():
        b = min(t[0] for t in times[name])
        e = min(t[1] for t in times[name])
        both = min(t[0] + t[1] for t in times[name])
        gbps = f"{used * nbytes / e / 1e9:.0f}" if nbytes else ""
        every = ", ".join(f"{t[1] * 1e6:.1f}" for t in times[name])
        print(f"| {name} | {b * 1e6:.1f} | {e * 1e6:.1f} | {both * 1e6:.1f} | {gbps} | {every} |")


if __name__ == "__main__":
    main()
