"""End-to-end prefill and decode tokens/s: kimi_k3 vs mlx-lm's kimi_k3, same weights, one run.

python benchmarks/bench_e2e.py --preset small --out docs/bench_e2e.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model as mlx_lm_load_model

from kimi_k3.convert.synth import parse_override, write_checkpoint
from kimi_k3.loader import load_model
from kimi_k3.streaming import get_stats, reset_stats


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prefill(model, prompt: mx.array):
    """A new cache holding ``prompt``, run through ``model`` in one call."""
    cache = model.make_cache()
    mx.eval(model(prompt, cache=cache))
    return cache


def decode_steps(model, cache, steps: int, prof=None) -> tuple[float, float]:
    """``steps`` greedy single-token steps after what ``cache`` holds: (build, wait) seconds
    summed over them, build being the model call (and argmax) and wait the ``mx.eval`` after
    it. ``prof`` (a ``cProfile.Profile``, if given) profiles the builds only."""
    tok = mx.array([[1]])
    build = wait = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        tok = mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)[:, None]
        if prof:
            prof.disable()
        t1 = time.perf_counter()
        mx.eval(tok)
        build += t1 - t0
        wait += time.perf_counter() - t1
    return build, wait


def measure(model, prompt: mx.array, decode: int, repeats: int) -> tuple[float, float, str]:
    """(prefill tok/s, decode tok/s, experts) of one greedy run: prompt in one call, then
    ``decode`` single-token steps. ``experts``: "resident", or the streamer's counters over
    the decode steps of one more run (hit rate, GB read per token, the reads' GB/s)."""

    def run_decode(after_prefill=None):
        cache = prefill(model, prompt)
        if after_prefill:
            after_prefill()
        return sum(decode_steps(model, cache, decode))

    t_pre = _time(lambda: prefill(model, prompt), repeats)
    run_decode()
    t_dec = statistics.median(run_decode() for _ in range(repeats))
    return prompt.shape[1] / t_pre, decode / t_dec, decode_experts(model, run_decode, decode)


def decode_experts(model, run_decode, decode: int) -> str:
    """The streamer's counters over one run's decode steps, or "resident"."""
    if get_stats(model) is None:
        return "resident"
    run_decode(after_prefill=lambda: reset_stats(model))
    st = get_stats(model)
    rate = "no lookups" if st["hit_rate"] is None else f"{st['hit_rate']:.0%} hit"
    gbps = "" if st["read_gbps"] is None else f", read at {st['read_gbps']:.2f} GB/s"
    return f"{rate}, {st['bytes_read'] / decode / 1e6:.2f} MB read per token{gbps}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a synthetic preset key (e.g. vocab_size=32768)",
    )
    ap.add_argument(
        "--expert-cache-gb",
        type=float,
        default=None,
        help="also time this project with experts streamed into a cache this big",
    )
    ap.add_argument("--device", choices=["default", "cpu", "gpu"], default="default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device != "default":
        mx.set_default_device(getattr(mx, args.device))
    overrides = dict(parse_override(s) for s in args.set)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "ckpt", args.preset, tokenizer=False, **overrides)
        vocab = 700
        prompt = mx.array(np.random.default_rng(0).integers(0, vocab, (1, args.prompt_tokens)))
        rows = []
        for name in args.dtypes.split(","):
            dtype = getattr(mx, name)
            ours = load_model(path, dtype=dtype)
            ref, _ = mlx_lm_load_model(path)
            ref.set_dtype(dtype)
            runs = [("kimi_k3 (this project)", ours), ("mlx-lm kimi_k3", ref)]
            if args.expert_cache_gb is not None:
                streamed = load_model(path, dtype=dtype, expert_cache_gb=args.expert_cache_gb)
                runs.append(
                    (f"kimi_k3, experts streamed ({args.expert_cache_gb} GB cache)", streamed)
                )
            for label, model in runs:
                try:
                    pre, dec, experts = measure(model, prompt, args.decode_tokens, args.repeats)
                    rows.append((name, label, f"{pre:.1f}", f"{dec:.1f}", experts))
                except Exception as e:  # one failing comparator is a row, not a crash
                    rows.append((name, label, f"failed: {type(e).__name__}: {e}", "", ""))
            del ours, ref, runs
    device = f"{mx.default_device()} ({platform.machine()}, mlx {mx.__version__})"
    lines = [
        f"### End-to-end, synthetic `{args.preset}` preset, {device}",
        "",
        f"Command: `python {' '.join([sys.argv[0]] + (argv or sys.argv[1:]))}`",
        f"Prompt {args.prompt_tokens} tokens in one call; {args.decode_tokens} greedy decode "
        f"steps; median of {args.repeats}. Streamed rows: the expert cache's counters over the "
        "decode steps of one more run.",
        "",
        "| dtype | implementation | prefill tok/s | decode tok/s | experts while decoding |",
        "|---|---|---:|---:|---|",
    ]
    lines += [f"| {d} | {label} | {p} | {t} | {x} |" for d, label, p, t, x in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
