"""Where a decode step's time goes: per greedy step, Python's build of the step's graph (the
model call) and the wait in ``mx.eval`` after it, for this project and mlx-lm on the same
synthetic checkpoint; with ``--profile N``, cProfile's top N functions of this project's
builds.

A step whose build is a large share of its time is bound by the host (Python and MLX's
graph encoding), not by the GPU's kernels; ``bench_e2e`` reports only the sum. Session 28
added it to find why ``bench_e2e``'s decode dropped from 428-465 tok/s (sessions 20-21) to
303 (docs/benchmarks.md). To compare with an older commit, lay its tree out as installed
(``kimi_k3``, with ``kernels`` and ``convert`` inside it) and run this script with that
directory first on ``PYTHONPATH`` and ``--checkpoint`` shared, so both read the same bytes.

    python -m benchmarks.decode_split --preset k3-layers --set vocab_size=32768 \\
        --set intermediate_size=4096 --checkpoint /tmp/e2e_ckpt --profile 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import platform
import pstats
import statistics
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model as mlx_lm_load_model

import kimi_k3
from benchmarks.bench_e2e import decode_steps, prefill
from benchmarks.bench_kda import emit
from kimi_k3.convert.synth import parse_override, write_checkpoint
from kimi_k3.loader import load_model


def split_steps(model, prompt: mx.array, steps: int, prof: cProfile.Profile | None = None):
    """(build, wait) seconds per step, averaged over ``steps`` greedy decode steps after a
    prefill of ``prompt`` (``bench_e2e.decode_steps``; ``prof`` profiles the builds only)."""
    build, wait = decode_steps(model, prefill(model, prompt), steps, prof)
    return build / steps, wait / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--checkpoint",
        default=None,
        help="read the synthetic checkpoint here, writing it first if absent (default: a "
        "temporary directory)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--no-mlx-lm", action="store_true", help="time this project only")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--device", choices=["default", "cpu", "gpu"], default="default")
    ap.add_argument("--out", default=None, help="append the markdown table here")
    args = ap.parse_args(argv)
    if args.device != "default":
        mx.set_default_device(getattr(mx, args.device))
    overrides = dict(parse_override(s) for s in args.set)
    with tempfile.TemporaryDirectory() as tmp:
        ck = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "ckpt"
        source = f"checkpoint {ck}, read as found"
        if not (ck / "config.json").exists():
            write_checkpoint(ck, args.preset, tokenizer=False, **overrides)
            source = f"`{args.preset}` preset" + "".join(f", {s}" for s in args.set)
        dtype = getattr(mx, args.dtype)
        prompt = mx.array(np.random.default_rng(0).integers(0, 700, (1, args.prompt_tokens)))
        runs = [("kimi_k3 (this project)", load_model(ck, dtype=dtype))]
        if not args.no_mlx_lm:
            ref, _ = mlx_lm_load_model(ck)
            ref.set_dtype(dtype)
            runs.append(("mlx-lm kimi_k3", ref))
        rows = []
        for label, model in runs:
            split_steps(model, prompt, args.decode_tokens)  # warm-up: kernels built
            splits = [split_steps(model, prompt, args.decode_tokens) for _ in range(args.rounds)]
            build = statistics.median(b for b, _ in splits) * 1e3
            wait = statistics.median(w for _, w in splits) * 1e3
            rows.append((label, build, wait))
        report = ""
        if args.profile:
            prof = cProfile.Profile()
            split_steps(runs[0][1], prompt, args.decode_tokens, prof)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.profile)
            report = s.getvalue()
    where = Path(kimi_k3.__file__).parent
    lines = [
        f"### Decode steps split, {source}, {args.dtype}, {mx.default_device()} "
        f"({platform.machine()}, mlx {mx.__version__}, kimi_k3 from {where})",
        "",
        f"{args.prompt_tokens}-token prompt, {args.decode_tokens} greedy steps, median of "
        f"{args.rounds} rounds (ms per step).",
        "",
        "| implementation | build | eval wait | step | tok/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, build, wait in rows:
        step = build + wait
        lines.append(f"| {label} | {build:.3f} | {wait:.3f} | {step:.3f} | {1e3 / step:.1f} |")
    emit("\n".join(lines) + "\n", args.out, append=True)
    if report:
        print(report)
    return rows


if __name__ == "__main__":
    main()
