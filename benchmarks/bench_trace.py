"""What ``kimi_k3.trace`` costs: tokens/s never imported, imported, after a trace exited, and
inside a trace.

    python -m benchmarks.bench_trace --preset small --out bench_trace.md
    python -m benchmarks.bench_trace --quick      # tiny preset, one process per state: seconds

Each state runs in its own Python process (an import cannot be undone); the states take
turns, ``--rounds`` times. The table gives wall-clock tokens/s (the best run) and tokens
per second of the process's CPU time (the median), which stays steady on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks import timing

STATES = {
    "never": "kimi_k3.trace never imported",
    "imported": "kimi_k3.trace imported, no trace",
    "after": "after a trace has exited",
    "traced": "inside a trace (recording)",
}


def measure(model, prompt: mx.array, decode: int, repeats: int) -> dict[str, list[float]]:
    """Tokens per second of wall-clock time and of this process's CPU time (all threads),
    for prefill and decode, in each of ``repeats`` runs after one warm-up.

    CPU time barely moves when other processes compete for the cores; wall-clock does.
    """
    out: dict[str, list[float]] = {
        k: [] for k in ("prefill", "decode", "prefill_cpu", "decode_cpu")
    }
    for i in range(repeats + 1):
        cache = model.make_cache()
        wall, cpu = time.perf_counter(), time.process_time()
        logits = model(prompt, cache=cache)
        mx.eval(logits)
        pre = (time.perf_counter() - wall, time.process_time() - cpu)
        tok = mx.argmax(logits[:, -1], axis=-1)[:, None]
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(decode):
            tok = mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)[:, None]
            mx.eval(tok)
        dec = (time.perf_counter() - wall, time.process_time() - cpu)
        if i:  # the first run warms up
            out["prefill"].append(prompt.shape[1] / pre[0])
            out["prefill_cpu"].append(prompt.shape[1] / pre[1])
            out["decode"].append(decode / dec[0])
            out["decode_cpu"].append(decode / dec[1])
    return out


def child(state: str, path: str, prompt_tokens: int, decode: int, repeats: int):
    from kimi_k3.checkpoint.loader import load_model

    model = load_model(path, dtype=mx.float32)
    prompt = mx.array(np.random.default_rng(0).integers(0, 700, (1, prompt_tokens)))
    context = nullcontext()
    if state != "never":
        from kimi_k3.trace import trace

        if state == "after":
            with trace(model):
                mx.eval(model(prompt[:, :8]))
        elif state == "traced":
            context = trace(model)
    assert ("kimi_k3.trace" in sys.modules) == (state != "never")
    with context:
        print(json.dumps(measure(model, prompt, decode, repeats)))


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per state")
    parser.add_argument(
        "--quick", action="store_true", help="tiny preset, 16 + 4 tokens, one run per state"
    )
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--child", nargs=2, metavar=("STATE", "PATH"), help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    if args.child:
        return child(*args.child, args.prompt_tokens, args.decode_tokens, args.repeats)
    if args.quick:
        args.preset, args.prompt_tokens, args.decode_tokens = "tiny", 16, 4
        args.repeats, args.rounds = 1, 1
    from kimi_k3.convert.synth import write_checkpoint

    results: dict[str, list[dict]] = {s: [] for s in STATES}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_checkpoint(Path(tmp) / "ckpt", args.preset, tokenizer=False))
        for r in range(args.rounds):
            order = list(STATES)[r % len(STATES) :] + list(STATES)[: r % len(STATES)]
            for state in order:  # a different state goes first each round
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.bench_trace",
                    "--child",
                    state,
                    path,
                    "--prompt-tokens",
                    str(args.prompt_tokens),
                    "--decode-tokens",
                    str(args.decode_tokens),
                    "--repeats",
                    str(args.repeats),
                ]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                results[state].append(json.loads(out.splitlines()[-1]))
    runs = {s: {k: [x for r in rs for x in r[k]] for k in rs[0]} for s, rs in results.items()}
    command = "python -m benchmarks.bench_trace " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"### Tracing cost, synthetic `{args.preset}` preset, float32; {timing.environment()}",
        "",
        f"Command: `{command}`",
        f"Prompt {args.prompt_tokens} tokens in one call, then {args.decode_tokens} greedy "
        f"decode steps; {args.rounds} processes x {args.repeats} runs per state (each "
        "process warms up first). Wall: the best run (other work only slows a run down). "
        "CPU: tokens per second of the process's CPU time, median.",
        "",
        "| state | prefill tok/s wall | CPU | vs never (CPU) | decode tok/s wall | CPU | "
        "vs never (CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {k: statistics.median(runs["never"][k]) for k in ("prefill_cpu", "decode_cpu")}
    for state, label in STATES.items():
        r = runs[state]
        cells = []
        for k in ("prefill", "decode"):
            cpu = statistics.median(r[f"{k}_cpu"])
            cells += [f"{max(r[k]):.1f}", f"{cpu:.1f}", f"{cpu / base[f'{k}_cpu']:.3f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    timing.emit(text, args.out)
    return text


if __name__ == "__main__":
    main()
