"""Training speed of ``kimi_k3.train`` at its preset: the eager step against the compiled one.

Each path runs the same training step (``kimi_k3.train.make_step``: loss, gradients,
clipping, AdamW, the routers' balancing) on the same batches from the same initial model;
``compiled`` is the step as one ``mx.compile``d function. Both paths are timed in the same
process, interleaved round by round (``timing.interleaved``), after ``--warmup`` untimed
steps each (the first steps compile and allocate). A round is ``--steps`` steps evaluated
one at a time, as ``train run`` does; the table gives the median round and the range.

Model FLOPs per token are counted from the model (``model_flops_per_token``): the matmul
weights a token goes through (the routed experts' ``top_k / num_experts`` share), the MLA
scores and values over the causal context and the KDA recurrence, times 3 for the forward
and backward pass. Model FLOP utilisation is those FLOPs per second over ``--peak-tflops``
(the device's dense fp32 peak, given by the user; without it the column is left out).
"peak GB" is MLX's peak memory over a path's warm-up steps, the other path's model held too:
what decides the largest batch that fits.

    python -m benchmarks.bench_train --out bench_train.md               # the preset, batch 32
    python -m benchmarks.bench_train --quick                            # a tiny model, seconds
    python -m benchmarks.bench_train --peak-tflops 67                   # MFU against 67 TFLOP/s
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from benchmarks import timing
from kimi_k3 import train
from kimi_k3.cli import markdown_table
from kimi_k3.convert.synth import PRESETS
from kimi_k3.kernels.dispatch import reference_paths

QUICK = dict(PRESETS["tiny"], num_experts=8, num_experts_per_token=2)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="steps in a timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per path")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense fp32 peak")
    parser.add_argument("--quick", action="store_true", help="a tiny model, batch 4 x 32")
    parser.add_argument("--out", help="write the markdown table here")
    return parser


def model_flops_per_token(model, seq: int) -> float:
    """Training FLOPs per token (forward and backward, 3x the forward's): 2 per weight of
    every matmul a token goes through (embedding lookups excluded, routed experts at
    their ``top_k / num_experts`` share, depthwise convolutions at their window), plus MLA's
    scores and values over the mean causal context ``(seq + 1) / 2`` and KDA's recurrence
    (decay, the state's read of ``k``, its rank-1 update and the readout: 7 H K V)."""
    args = model.args
    share = args.num_experts_per_token / args.num_experts
    weights = 0.0
    for name, p in tree_flatten(model.parameters()):
        if "embed_tokens" in name or p.ndim < 2:
            continue
        weights += p.size * (share if ".experts." in name else 1.0)
    attention = 0.0
    context = (seq + 1) / 2
    for layer in model.layers:
        if layer.is_linear:
            heads, dim = args.kda_heads, args.kda_head_dim
            attention += 7 * heads * dim * dim
        else:
            qk = args.qk_nope_head_dim + args.qk_rope_head_dim
            attention += 2 * args.num_attention_heads * (qk + args.v_head_dim) * context
    return 3 * (2 * weights + attention)


def _path(preset: dict, compiled: bool, batch: int, seq: int, seed: int = 0):
    """A model and one training step of it on the next batch: ``(model, run_one)``."""
    model = train.init_model(preset, seed=seed)
    opt = train.make_optimizer(3e-3)
    step = train.make_step(model, opt, 1e-3, compiled)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, preset["vocab_size"] - 256, 1 << 16).astype(np.int32)
    data = train.batches(tokens, batch, seq, seed)

    def run_one():
        b = next(data)
        loss, loads = step(b[:, :-1], b[:, 1:])
        mx.eval(model.parameters(), opt.state, loss, loads)
        return loss.item()

    return model, run_one


def measure(preset: dict, batch: int, seq: int, steps: int, rounds: int, warmup: int) -> dict:
    """The eager and compiled steps timed interleaved: ``{"flops_per_token": F, "rounds":
    {path: [seconds a round, ...]}, "failed": {path: error}}``."""
    paths, flops, peak = {}, None, {}
    for name, compiled in (("eager (train run)", False), ("compiled (train run --compile)", True)):
        model, run_one = _path(preset, compiled, batch, seq)
        flops = flops or model_flops_per_token(model, seq)
        mx.reset_peak_memory()
        for _ in range(warmup):
            run_one()
        peak[name] = mx.get_peak_memory() / 1e9  # this path's model and steps, and the other's
        paths[name] = run_one

    def job(run_one):
        def timed():
            mx.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                run_one()
            mx.synchronize()
            return time.perf_counter() - t0

        return timed

    results, failed = timing.interleaved({n: job(r) for n, r in paths.items()}, rounds)
    return {"flops_per_token": flops, "rounds": results, "failed": failed, "peak_gb": peak}


def table(m: dict, batch: int, seq: int, steps: int, peak_tflops: float | None) -> str:
    tokens = batch * seq * steps
    header = ["path", "ms / step (median, range)", "tokens/s", "model TFLOP/s", "peak GB"]
    if peak_tflops:
        header.append(f"MFU (of {peak_tflops:g} TFLOP/s)")
    header.append("vs eager")
    base = None
    rows = []
    for name, times in m["rounds"].items():
        if name in m["failed"]:
            rows.append(
                [name, f"failed: {m['failed'][name]}", "", "", "", *([""] * bool(peak_tflops)), ""]
            )
            continue
        med = statistics.median(times)
        base = base or med
        rate = tokens / med
        tflops = rate * m["flops_per_token"] / 1e12
        ms = [1e3 * t / steps for t in (med, min(times), max(times))]
        row = [
            name,
            f"{ms[0]:.1f} ({ms[1]:.1f}-{ms[2]:.1f})",
            f"{rate:,.0f}",
            f"{tflops:.4f}",
            f"{m['peak_gb'].get(name, 0.0):.2f}",
        ]
        if peak_tflops:
            row.append(f"{100 * tflops / peak_tflops:.2f}%")
        row.append(f"{base / med:.2f}x")
        rows.append(row)
    return markdown_table(header, rows)


def main(argv=None) -> str:
    args = setup_arg_parser().parse_args(argv)
    preset, batch, seq = train.PRESET, args.batch, args.seq
    if args.quick:
        preset, batch, seq = QUICK, 4, 32
        args.steps, args.rounds, args.warmup = 2, 2, 1
    with reference_paths():  # the paths training differentiates
        m = measure(preset, batch, seq, args.steps, args.rounds, args.warmup)
    text = (
        f"{timing.environment()}; batch {batch} x {seq} tokens, {args.steps} steps a round, "
        f"{args.rounds} rounds, {args.warmup} warm-up steps a path; "
        f"{m['flops_per_token'] / 1e6:.1f} MFLOP a token (training)\n\n"
        + table(m, batch, seq, args.steps, args.peak_tflops)
    )
    timing.emit(text, args.out)
    return text


if __name__ == "__main__":
    main()
