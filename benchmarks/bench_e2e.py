"""End-to-end prefill and decode tokens/s: kimi_k3 vs mlx-lm's kimi_k3, same weights, one run.

A synthetic checkpoint (``kimi_k3.convert.synth``, ``--preset`` with ``--set`` overrides) is
loaded by both implementations in each dtype; each runs a prompt in one call, then greedy
single-token decode steps. Prefill is the median of ``--repeats`` runs, decode the median
of as many runs' decode steps. With ``--expert-cache-gb`` this project also runs with its
experts streamed from disk into a cache of that size, and the row gives the cache's
counters over one run's decode steps.

    python -m benchmarks.bench_e2e --preset small --out bench_e2e.md
    python -m benchmarks.bench_e2e --quick        # float32, 8 + 2 tokens, one run: seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model as mlx_lm_load_model

from benchmarks import timing
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.convert.synth import parse_override, write_checkpoint
from kimi_k3.streaming import get_stats, reset_stats


def prefill(model, prompt: mx.array):
    """A new cache holding ``prompt``, run through ``model`` in one call."""
    cache = model.make_cache()
    mx.eval(model(prompt, cache=cache))
    return cache


def decode_steps(model, cache, steps: int) -> float:
    """Seconds of ``steps`` greedy single-token steps after what ``cache`` holds."""
    tok = mx.array([[1]])
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)[:, None]
        mx.eval(tok)
    return time.perf_counter() - t0


def measure(model, prompt: mx.array, decode: int, repeats: int) -> tuple[float, float, str]:
    """(prefill tok/s, decode tok/s, experts) of one greedy run: prompt in one call, then
    ``decode`` single-token steps. ``experts``: "resident", or the streamer's counters over
    the decode steps of one more run (hit rate, GB read per token, the reads' GB/s)."""

    def run_decode(after_prefill=None):
        cache = prefill(model, prompt)
        if after_prefill:
            after_prefill()
        return decode_steps(model, cache, decode)

    t_pre = timing.median_time(lambda: prefill(model, prompt), repeats, warmup=1, budget_s=None)
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


def setup_arg_parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--quick", action="store_true", help="float32, 8 + 2 tokens, one run")
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.decode_tokens, args.repeats, args.dtypes = 8, 2, 1, "float32"
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
    command = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"### End-to-end, synthetic `{args.preset}` preset; {timing.environment()}",
        "",
        f"Command: `python -m benchmarks.bench_e2e {command}`",
        f"Prompt {args.prompt_tokens} tokens in one call; {args.decode_tokens} greedy decode "
        f"steps; median of {args.repeats}. Streamed rows: the expert cache's counters over the "
        "decode steps of one more run.",
        "",
        "| dtype | implementation | prefill tok/s | decode tok/s | experts while decoding |",
        "|---|---|---:|---:|---|",
    ]
    lines += [f"| {d} | {label} | {p} | {t} | {x} |" for d, label, p, t, x in rows]
    text = "\n".join(lines) + "\n"
    timing.emit(text, args.out)
    return text


if __name__ == "__main__":
    main()
