"""The fused MXFP4 decode (``mxfp4_fused``: gate/up, SiTU-GLU and a slice of down in one
launch, then the sum) against the three-launch ``mxfp4_mma`` and ``gather_qmm``.

At K3 size (16 experts of 64 per token, D = 3584, I = 3072) and each token count given, this
times: ``gather_qmm`` (``expert_glu_reference``), ``mxfp4_mma`` as dispatched, and
``mxfp4_fused`` at every launch (rows of I per threadgroup, warps, groups per step in gate/up
and in down), launch bound and code decode given (``--decodes``: byte permutes by default;
with ``shift``, also ``mxfp4_mma`` decoding by shifts); ``--launch-only`` adds the fused
launch without its sum, ``--params-at-end`` the first fused row's kernel as it was before
session 26 (its unit ends reading beta, cap and the routing weight from global memory).
Calls are timed as chains (``--timing chain``, the default since session 26: each call on
the previous one's output, as in a model's forward pass) or in batches of independent calls
(``--timing batch``, the default before). Every job is timed once per round, rounds one after
another (a clock drift reaches all jobs alike); a row reports its best round and lists them
all. GB/s are over the distinct experts' weight bytes (scales included), against the
datasheet peak and the device copy of the same run. Each row's output is compared with
``mxfp4_mma``'s.

    python3 -m benchmarks.mxfp4_fused_sweep --rounds 3
    python3 -m benchmarks.mxfp4_fused_sweep --tokens 1 --launches 256,8,8,8 --min-blocks 1 2
    python3 -m benchmarks.mxfp4_fused_sweep --launches 256,8,8,8 --bulk-launches 128,2,6
    python3 -m benchmarks.mxfp4_fused_sweep --launches 256,8,8,8 --bulk-launches --tiled

``mxfp4_fused_bulk`` rows (the same two phases, weights brought in by bulk copies) give
(rows of I per threadgroup, warps, ring stages) in the launch column. ``--tiled`` adds the
fused kernel reading the same experts in ``mxfp4_fused.tile``'s layout (16-row tiles of 4-group
blocks: a warp load is 512 contiguous bytes), converted once before timing.
"""

from __future__ import annotations

import argparse
import re
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from benchmarks.bench_mxfp4 import (
    copy_gbps,
    expert_bytes,
    random_experts,
    rel_err,
    routing,
    tiled_copy,
    time_batch,
    time_chain,
    time_rounds,
    with_attr,
    with_setting,
)
from benchmarks.kda_prep_probes import rewrite
from benchmarks.profile_kernels import register_count
from kimi_k3.experts import expert_glu_reference
from kimi_k3.kernels import mxfp4_fused, mxfp4_mma
from kimi_k3.kernels.source import Instance

BETA, CAP = 4.0, 25.0
DEFAULT_LAUNCHES = ["384,8,8,4", "256,8,8,8", "128,4,8,4", "256,4,8,8", "512,8,8,8"]
# (SL, NW, S) of the bulk-copy kernel: rows of I per threadgroup, warps, ring stages.
BULK_LAUNCHES = ["128,2,6", "128,4,3", "128,1,12", "256,2,6", "128,2,4"]


def registers(kernel, tmpl: list) -> str:
    """ptxas's registers (and spill stores) of a fused kernel at template ``tmpl`` (its
    inputs as the bf16 decode launches them)."""
    dts = [mx.bfloat16, mx.uint32, mx.uint8, mx.uint32, mx.uint8, mx.uint32, mx.uint8]
    inst = Instance(dts + [mx.int32, mx.float32, mx.float32], [mx.float32], tmpl)
    return register_count(kernel, [inst])


def fused_registers(launch, bound: int, D: int, I: int, k: int) -> str:
    """``registers`` of the fused kernel at this launch and bound."""
    sl, nw, gw, gw2 = mxfp4_fused.shape_for(D, I, launch)
    kernel = mxfp4_fused.MXFP4_FUSED.bounded(32 * nw, bound)
    return registers(kernel, mxfp4_fused.template(mx.bfloat16, D, I, k, sl, nw, gw, gw2))


def bulk_registers(launch, D: int, I: int, k: int, tiled: bool = False) -> str:
    """``registers`` of the bulk-copy kernel at this launch."""
    shape = mxfp4_fused.shape_for_bulk(D, I, launch)
    tmpl = mxfp4_fused.template_bulk(mx.bfloat16, D, I, k, *shape, tiled)
    return registers(mxfp4_fused.MXFP4_FUSED_BULK, tmpl)


def tiled_stack(w: dict) -> dict:
    """``mxfp4_fused.tile(w)`` (the layout its ``tiled=True`` reads), built once per stack
    (outside the timed batches after the first)."""
    return tiled_copy(w, mxfp4_fused.tile)


def decode_job(decode, launch, tiled: bool = False):
    """``decode`` (a fused ``expert_glu_decode*``) at ``launch``, on ``tiled_stack``'s copy of
    the experts where ``tiled``."""

    def run(z, w, inds, wts, beta, cap):
        wt = tiled_stack(w) if tiled else w
        return decode(z, wt, inds, wts, beta, cap, launch=launch, tiled=tiled)

    return run


def with_bound(fn, bound: int):
    """``fn`` run with ``mxfp4_fused.MIN_BLOCKS`` set to ``bound``."""
    return with_attr(fn, mxfp4_fused, "MIN_BLOCKS", bound)


def prmt_decode(fn, module, name):
    """``fn`` with ``module.name``'s codes decoded by byte permutes
    (``mxfp4_mma.byte_permute_decode``); for ``mxfp4_mma`` itself that is its ``DECODE``."""
    return with_attr(fn, module, name, mxfp4_mma.byte_permute_decode(getattr(module, name)))


# The fused kernel as it was before session 26: its unit ends read SiTU-GLU's beta and cap
# and the pair's routing weight from global memory (not from s_par, mxfp4_fused.PARAMS).
PARAMS_AT_END = (
    (mxfp4_fused.PARAMS, ""),
    (re.compile(r"s_par\[0\], s_par\[1\]\)"), "params[0], params[1])"),
    ("s_par[2] * unscale2", "wts[p] * unscale2"),
)


def params_at_end(kernel):
    """``kernel`` (``mxfp4_fused.MXFP4_FUSED`` or a variant) with ``PARAMS_AT_END``."""
    return rewrite(kernel, PARAMS_AT_END, kernel.name + "_parend", "mxfp4_fused params at end")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--launches", nargs="+", default=DEFAULT_LAUNCHES, help="SL,NW,GW,GW2")
    p.add_argument("--min-blocks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--bulk-launches", nargs="*", default=BULK_LAUNCHES, help="SL,NW,S")
    p.add_argument("--launch-only", action="store_true", help="also time the fused launch alone")
    p.add_argument(
        "--tiled", action="store_true", help="also the fused kernel on mxfp4_fused.tile's layout"
    )
    p.add_argument(
        "--decodes",
        nargs="+",
        choices=mxfp4_mma.DECODES,
        default=["byte permute"],
        help="how the fused rows decode codes (each launch and bound at each); with shift, "
        "also mxfp4_mma decoding by shifts",
    )
    p.add_argument(
        "--params-at-end",
        action="store_true",
        help="also the first fused row's kernel with its unit ends reading their parameters "
        "from global memory (as before session 26)",
    )
    p.add_argument(
        "--timing",
        default="chain",
        choices=["chain", "batch"],
        help="chain (each call on the previous one's output: bench_mxfp4.time_chain) or "
        "batch (independent calls, time_batch; the default until session 26)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=40, help="input sets per batch")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dim", type=int, default=3584)
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM datasheet peak")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    D, I, k = args.dim, args.hidden, args.topk
    w = random_experts(args.experts, D, I, args.seed)
    copy = copy_gbps(1 << 30, args.repeats)
    print(f"device copy: {copy:.0f} GB/s (read + write); HBM peak {args.peak_gbps:.0f} GB/s\n")
    launches = [tuple(int(v) for v in s.split(",")) for s in args.launches]
    regs = {}
    with ThreadPoolExecutor(8) as pool:
        keys = [(lc, b) for lc in launches for b in args.min_blocks]
        for key, r in zip(keys, pool.map(lambda kb: fused_registers(*kb, D, I, k), keys)):
            regs[key] = r

    jobs = [
        ("gather_qmm", "", "", expert_glu_reference),
        ("mxfp4_mma (dispatched)", "", "", mxfp4_mma.expert_glu_decode),
    ]
    fused, bulk = mxfp4_fused.expert_glu_decode, mxfp4_fused.expert_glu_decode_bulk
    if "shift" in args.decodes:
        fn = with_setting(mxfp4_mma, "DECODE", "shift", "shift")
        jobs.append(("mxfp4_mma, shift decode", "", "", fn))

    def fused_row(lc, decode, kernel=mxfp4_fused.MXFP4_FUSED):
        if decode == "byte permute":
            kernel = mxfp4_mma.byte_permute_decode(kernel)
        return with_attr(decode_job(fused, lc), mxfp4_fused, "MXFP4_FUSED", kernel)

    first_fused = len(jobs)  # --params-at-end follows the first fused row
    for lc in launches:
        shape = mxfp4_fused.shape_for(D, I, lc)
        for b in args.min_blocks:
            for dec in args.decodes:
                label = f"mxfp4_fused, {dec} decode"
                jobs.append(
                    (label, shape, f"{b} ({regs[(lc, b)]})", with_bound(fused_row(lc, dec), b))
                )
                if args.params_at_end and len(jobs) == first_fused + 1:
                    fn = with_bound(fused_row(lc, dec, params_at_end(mxfp4_fused.MXFP4_FUSED)), b)
                    jobs.append((f"{label}, parameters read at the unit ends", shape, f"{b}", fn))
                if args.tiled:
                    fn = with_bound(decode_job(fused, lc, tiled=True), b)
                    jobs.append(("mxfp4_fused, tiled layout", shape, f"{b}", fn))
                if args.launch_only:

                    def part(*a, lc=lc):
                        return mxfp4_fused.partials(*a, launch=lc)

                    jobs.append(("fused launch only", shape, f"{b}", with_bound(part, b)))

    for spec in args.bulk_launches:
        lc = tuple(int(v) for v in spec.split(","))
        shape = mxfp4_fused.shape_for_bulk(D, I, lc)
        for tiled in (False, True) if args.tiled else (False,):
            label = "mxfp4_fused_bulk, tiled layout" if tiled else "mxfp4_fused_bulk (SL, NW, S)"
            regs_b = f"({bulk_registers(lc, D, I, k, tiled)})"
            jobs.append((label, shape, regs_b, decode_job(bulk, lc, tiled)))

    rng = np.random.default_rng(args.seed)
    per_expert = expert_bytes(D, I)
    for n in args.tokens:
        sets = []
        for _ in range(args.calls):
            inds, wts = routing(n, args.experts, k, rng)
            z = mx.random.normal((n, D)).astype(mx.bfloat16)
            sets.append((z, w, inds, wts, BETA, CAP))
        mx.eval([s[:4] for s in sets])
        if args.tiled:
            tiled_stack(w)
        nbytes = np.mean([len(np.unique(np.array(s[2]))) for s in sets]) * per_expert
        ref = mxfp4_mma.expert_glu_decode(*sets[0])
        fns = [fn for *_, fn in jobs]
        timer = time_chain if args.timing == "chain" else time_batch
        times, failed = time_rounds(fns, sets, args.rounds, args.repeats, 100, timer)
        diffs = {}
        for j, (name, _, _, fn) in enumerate(jobs):
            if j not in failed and name != "fused launch only":
                diffs[j] = rel_err(fn(*sets[0]), ref)
        t_ref = min(times[0]) if times[0] else float("nan")
        print(f"### N = {n} token(s), {nbytes / 1e6:.1f} MB of expert weights per call\n")
        print(
            "| kernel | launch (SL, NW, GW, GW2) | threadgroups per SM at least (registers) "
            "| us | GB/s | of HBM peak | of device copy | x gather_qmm | rel diff to mxfp4_mma "
            "| us, every round |"
        )
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
        for j, (name, shape, bound, _) in enumerate(jobs):
            if j in failed:
                print(f"| {name} | {shape} | {bound} | failed: {failed[j]} | | | | | | |")
                continue
            t = min(times[j])
            gbps = nbytes / t / 1e9
            rounds = ", ".join(f"{x * 1e6:.1f}" for x in times[j])
            diff = f"{diffs[j]:.1e}" if j in diffs else ""
            print(
                f"| {name} | {shape} | {bound} | {t * 1e6:.1f} | {gbps:.0f} | "
                f"{gbps / args.peak_gbps:.1%} | {gbps / copy:.1%} | {t_ref / t:.2f}x | {diff} "
                f"| {rounds} |"
            )
        print()


if __name__ == "__main__":
    main()
