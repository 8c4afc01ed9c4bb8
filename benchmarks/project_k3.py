"""Projection of full Kimi K3 decode speed on Macs, from measured inputs.

    python -m benchmarks.project_k3 --out OUT.md
    python -m benchmarks.project_k3 --quick          # fewer prompts and tokens: seconds

The model (``kimi_k3.projection``): decode time per token = SSD time + compute time
(reads and compute in series: prefetch does not pay, ``docs/streaming.md``), with the
overlapped bound beside it. The MXFP4 decode kernels reach ``--kernel-efficiency`` of the
memory bandwidth on the H200 (docs/benchmarks.md). Its inputs here:

- h, the hit rate at the cache fraction f = expert budget / 1.45 TB: replayed by
  ``kimi_k3.streaming.simulate`` from the trained default model's sampled decode routing
  (temperature 0.6; the shipped policy, and Belady's optimum beside it), read off the
  small model's curve at the same cache fraction; below its top-k floor the floor's hit
  rate is scaled by f. ``flat`` is h = f (routing with no reuse).
- kept, from the same model's routing with trimming on (experts a decoded token reads
  over top-k): to half (top-p 0.5, the share colibri keeps on K3: about 8 of 16 for
  +0.043 nats), and at ``--top-p`` (default 0.25, the trained default's recommended
  setting; its quality cost does not transfer to K3, docs/streaming.md).
- Expert parallel over N Macs: each caches its 1/N share of the experts (f = budget /
  share), with link hops of 10 us (Thunderbolt 5 RDMA, docs/benchmarks.md "Across
  machines").
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks import timing
from kimi_k3.cli import markdown_table
from kimi_k3.projection import (
    COLIBRI_KEPT,
    EXPERTS_GB,
    KERNEL_EFFICIENCY,
    Mac,
    expert_budget_gb,
    hit_at,
    project,
)

# Sampled decode: a small model's greedy output repeats itself, which inflates reuse
DECODE_TEMP = 0.6

# M5 Max: 13.5 GB/s SSD and 614 GB/s memory; M3 Ultra: 819 GB/s memory, SSD taken as
# 7 GB/s (sources in docs/streaming.md "Projection for the full K3").
M5_MAX = Mac("M5 Max 128 GB", 128, 13.5, 614)
M3_ULTRA = Mac("M3 Ultra 512 GB", 512, 7.0, 819)

PEERS = [
    ("colibri (C, experts streamed)", "M5 Max 128 GB", 0.28, "hit rate 4-53% for 8-96 GB"),
    ("turboquant-mlx (experts at 3 bits)", "Mac", 0.36, "hit rate 53%"),
    ("kimi-k3-in-c (C, CPU)", "124 cores, 128 GB or more", 1 / 5.6, "5.6 s per token"),
]


def measure(prompts: int, tokens: int, settings: dict, slot_step: int = 1) -> dict:
    """Decode routing of the trained default under each trimming setting (``{name: (top_p,
    min_weight)}``), replayed through the shipped policy and Belady: ``{name: {"kept",
    "policy", "curve", "belady"}}``, a curve being ``[(cache fraction, hit rate)]`` over the
    slot counts from top-k to all experts (every ``slot_step``-th, and all experts)."""
    from benchmarks.bench_cache_policy import prompts as held_out_prompts
    from kimi_k3 import default_model
    from kimi_k3.checkpoint.loader import load_model
    from kimi_k3.model.routing import set_expert_trimming
    from kimi_k3.streaming.simulate import hit_rates, record
    from kimi_k3.streaming.store import StreamOptions

    model = load_model(default_model.package_dir())
    ps = held_out_prompts(prompts, 256)
    policy = StreamOptions().policy
    out = {}
    for name, setting in settings.items():
        set_expert_trimming(model, *setting)
        trace = record(model, ps, 512, tokens, temp=DECODE_TEMP, seed=0)
        calls = [
            np.unique(inds).size
            for run in trace.runs
            for layer in run.routing
            for (inds, _), phase in zip(run.routing[layer], run.phases, strict=True)
            if phase == "decode"
        ]
        slots = sorted({*range(trace.top_k, trace.num_experts, slot_step), trace.num_experts})
        out[name] = {
            "setting": setting,
            "kept": float(np.mean(calls)) / trace.top_k,
            "policy": policy,
            "curve": hit_rates(trace, policy, slots),
            "belady": hit_rates(trace, "belady", slots),
        }
    set_expert_trimming(model)
    return out


def rows(m: dict, eff: float, kernel_eff: float) -> list[dict]:
    out = []
    configs = [(M5_MAX, 1), (M3_ULTRA, 1), (M5_MAX, 2), (M5_MAX, 4)]
    for mac, n in configs:
        budget = expert_budget_gb(mac.ram_gb)
        f = min(1.0, budget / (EXPERTS_GB / n))
        for name, got in m.items():
            h = hit_at(got["curve"], f)
            r = project(mac, n, h, got["kept"], eff, kernel_eff)
            out.append(
                {
                    "config": mac.name if n == 1 else f"{n} x {mac.name}, expert parallel",
                    "quality": name,
                    "f": f,
                    "h": h,
                    "h_opt": hit_at(got["belady"], f),
                    "kept": got["kept"],
                    **r,
                    "tok_s_flat": project(mac, n, f, got["kept"], eff, kernel_eff)["tok_s"],
                }
            )
    return out


def _f(v: float, digits: int = 2) -> str:
    return f"{v:.{digits}f}"


def report(m: dict, args) -> str:
    inputs = [
        [
            "read efficiency (streamer vs raw, same reads and depth)",
            _f(args.read_efficiency),
            "measured, docs/streaming.md (capped at 1)",
        ],
        [
            "kernel share of memory bandwidth",
            _f(args.kernel_efficiency),
            "MXFP4 decode on the H200, docs/benchmarks.md",
        ],
        *[
            [f"experts kept, {name}", f"{got['kept']:.3f}", "decode routing of the trained default"]
            for name, got in m.items()
        ],
        [
            "experts kept by colibri's top-p on K3",
            _f(COLIBRI_KEPT),
            "published: about 8 of 16, for +0.043 nats",
        ],
        ["hit rate policy", m["exact"]["policy"], "the streamer's default"],
    ]
    body = [
        [
            r["config"],
            r["quality"],
            _f(r["f"], 3),
            _f(r["h"]),
            _f(r["h_opt"]),
            _f(r["kept"]),
            _f(r["ssd_gb"], 1),
            _f(r["ssd_s"]),
            _f(r["compute_s"]),
            _f(r["tok_s"]),
            _f(r["tok_s_overlap"]),
            _f(r["tok_s_flat"]),
        ]
        for r in rows(m, args.read_efficiency, args.kernel_efficiency)
    ]
    head = [
        "configuration",
        "experts",
        "cache / experts",
        "h (traces)",
        "h (optimum)",
        "kept",
        "SSD GB / token",
        "SSD s",
        "compute s",
        "tok/s",
        "tok/s, overlapped",
        "tok/s, h flat",
    ]
    peers = [[n, where, _f(t), note] for n, where, t, note in PEERS]
    return "\n".join(
        [
            "Inputs:",
            "",
            markdown_table(["input", "value", "from"], inputs),
            "",
            markdown_table(head, body),
            "",
            "Published figures of the peers, for the same model:",
            "",
            markdown_table(["peer", "machine", "tok/s", "note"], peers),
            "",
        ]
    )


def setup_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts traced (default 4)")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per prompt (default 64)")
    ap.add_argument(
        "--top-p",
        type=float,
        default=0.25,
        help="trimming's top-p (default 0.25: the trained default's recommended setting)",
    )
    ap.add_argument(
        "--min-weight", type=float, default=0.0, help="trimming's min weight (default 0)"
    )
    ap.add_argument(
        "--read-efficiency",
        type=float,
        default=1.0,
        help="measured read efficiency, capped at 1 (default 1.0)",
    )
    ap.add_argument(
        "--kernel-efficiency",
        type=float,
        default=KERNEL_EFFICIENCY,
        help=f"decode kernels' share of memory bandwidth (default {KERNEL_EFFICIENCY})",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="two short prompts, 4 decode steps, every 16th slot count",
    )
    ap.add_argument("--out", help="also write the tables to this markdown file")
    return ap


def main(argv=None) -> str:
    args = setup_arg_parser().parse_args(argv)
    for name in ("read_efficiency", "kernel_efficiency"):
        v = getattr(args, name)
        if not 0.0 < v <= 1.0:
            raise SystemExit(f"error: --{name.replace('_', '-')} {v}: expected a share in (0, 1]")
    if args.quick:
        args.prompts, args.tokens = 0, 4
    settings = {
        "exact": (1.0, 0.0),
        "trimmed to half (top-p 0.5)": (0.5, 0.0),
        f"trimmed (top-p {args.top_p:g}, min weight {args.min_weight:g})": (
            args.top_p,
            args.min_weight,
        ),
    }
    m = measure(args.prompts, args.tokens, settings, 16 if args.quick else 1)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    text = (
        f"Command: `python -m benchmarks.project_k3 {command}`; {timing.environment()}\n\n"
        + report(m, args)
    )
    timing.emit(text, args.out)
    return text


if __name__ == "__main__":
    main()
