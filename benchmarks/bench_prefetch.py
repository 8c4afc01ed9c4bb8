"""Prediction and read-ahead in the decode path (``StreamOptions.prefetch``): how well the
next MoE layer's experts are predicted, what reading them ahead costs in bytes read in
vain, and the time a decoded token waits on reads and computes, with prediction off and on.

    python -m benchmarks.bench_prefetch --out OUT.md                  # trained default
    python -m benchmarks.bench_prefetch --slice DIR --out OUT.md      # also a K3-width slice
    python -m benchmarks.bench_prefetch --quick                       # seconds: a smoke run

Settings, each from an empty cache: prediction off (the default), and on with at most
top-k, 2 and 1 reads ahead a layer call. The prediction of MoE layer L+1 is its router
applied to layer L's state before L's FFN, mixed and normalised as layer L+1 does
(``Streamer.note_state``); reads ahead go out once layer L's demand reads are in, and those
layer L+1 does not use and no reader has started are cancelled.

The trained default (``kimi_k3/default``) runs in its shipped dtype with its experts
streamed into ``--slots`` a layer: a ``--prompt``-token held-out prefill, one untimed
decode step, then ``--steps`` decode steps fed the held-out text's next tokens (teacher
forcing: the same steps in every run). ``--slice DIR`` also runs a synthetic checkpoint with
K3's expert width (four MoE layers of 64 experts of 17.5 MB, top-16, 4.5 GB; written there
if missing), streamed into 16 slots a layer, on random tokens: random weights route unlike
trained ones, so its prediction figures say nothing of K3's, but its reads and compute are
K3's size. Rounds interleave the settings; medians and min-max over ``--rounds``. Reads are
direct (no page cache). Per decoded token: wait = time the model blocked on reads, compute
= the rest of the time from the first MoE layer to the last (``get_stats``).

Predictors (a count, no timing): on the trained default with its experts resident, over
held-out prompts decoded ``--tokens`` steps sampled at temperature 0.6, the experts layer
L+1 uses against the m most likely by three predictors, each layer L+1's router applied to:
layer L's MoE input; layer L's state before its FFN mixed and normalised as layer L+1 does
(the shipped one); layer L's output, mixed and normalised alike (known only once L's
experts ran, too late to read ahead during them).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks import timing
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.cli import markdown_table
from kimi_k3.model.config import ModelArgs
from kimi_k3.streaming import clear_cache, get_stats, reset_stats
from kimi_k3.streaming.sources import expert_bytes, expert_shapes

# (label, streamer options)
SETTINGS = (
    ("off", {}),
    ("on, top-k reads ahead", {"prefetch": True}),
    ("on, 2 reads ahead", {"prefetch": True, "prefetch_limit": 2}),
    ("on, 1 read ahead", {"prefetch": True, "prefetch_limit": 1}),
)
SLICE = dict(  # four MoE layers (a dense first layer), K3's 3:1 KDA:MLA pattern
    num_hidden_layers=5,
    full=(4,),
    num_experts=64,
    num_experts_per_token=16,
    routed_expert_hidden_size=3584,
    moe_intermediate_size=3072,
)
QUICK_SLICE = dict(SLICE, routed_expert_hidden_size=256, moe_intermediate_size=256)


def budget_gb(path: Path, slots: int) -> float:
    """The budget that gives every MoE layer of ``path`` ``slots`` slots."""
    args = ModelArgs.from_path(path)
    layers = sum(args.is_moe(i) for i in range(args.num_hidden_layers))
    return slots * layers * expert_bytes(expert_shapes(args)) / 1e9


def decode_run(path: Path, slots: int, ids: list[int], prompt: int, steps: int, **opts) -> dict:
    """Prefill ``ids[:prompt]``, one untimed step, then ``steps`` steps fed ``ids``' next
    tokens; per decoded token the streaming counters and the time."""
    gc.collect()
    model = load_model(path, expert_cache_gb=budget_gb(path, slots), **opts)
    cache = model.make_cache()
    mx.eval(model(mx.array([ids[:prompt]]), cache=cache))
    mx.eval(model(mx.array([[ids[prompt]]]), cache=cache))  # untimed: compiles, warms up
    reset_stats(model)
    t0 = time.perf_counter()
    for t in ids[prompt + 1 : prompt + 1 + steps]:
        mx.eval(model(mx.array([[t]]), cache=cache))
    seconds = time.perf_counter() - t0
    clear_cache(model)  # reads ahead still in flight land, and are counted
    s = get_stats(model)
    per = s["per_token"]
    return {
        "tok_s": steps / seconds,
        "wait_ms": per["wait_seconds"] * 1e3,
        "compute_ms": per["compute_seconds"] * 1e3,
        "hit_rate": s["hit_rate"],
        "kb": per["bytes_read"] / 1e3,
        "demand_kb": (s["bytes_read"] - s["prefetch_bytes"]) / s["tokens"] / 1e3,
        "ahead_kb": per["prefetch_bytes"] / 1e3,
        "vain_kb": per["prefetch_unused_bytes"] / 1e3,
        "cancelled": s["prefetch_cancelled"] / s["tokens"],
        "recall": s["prediction_recall"],
        "precision": s["prediction_precision"],
        "accuracy": s["prefetch_accuracy"],
    }


def section(path: Path, slots: int, ids: list[int], args) -> dict[str, list[dict]]:
    """``{label: [decode_run per round]}``, rounds interleaving ``SETTINGS``."""
    jobs = {
        label: (lambda o=opts: decode_run(path, slots, ids, args.prompt, args.steps, **o))
        for label, opts in SETTINGS
    }
    results, failed = timing.interleaved(jobs, args.rounds)
    if failed:
        raise RuntimeError(f"decode runs failed: {failed}")
    return results


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def _cell(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(results: dict[str, list[dict]], kb_unit: str = "KB") -> str:
    """Counts (the same every round up to the reads' timing) and times, medians with
    min-max."""
    scale = 1e3 if kb_unit == "MB" else 1.0
    rows = []
    for label, runs in results.items():
        tok_s = [r["tok_s"] for r in runs]
        wait, compute = [r["wait_ms"] for r in runs], [r["compute_ms"] for r in runs]
        rows.append(
            [
                label,
                _cell(_median(runs, "hit_rate"), ".3f"),
                _cell(_median(runs, "kb") / scale, ".1f"),
                _cell(_median(runs, "demand_kb") / scale, ".1f"),
                _cell(_median(runs, "ahead_kb") / scale, ".1f"),
                _cell(_median(runs, "vain_kb") / scale, ".1f"),
                _cell(_median(runs, "cancelled"), ".2f"),
                _cell(_median(runs, "recall"), ".3f"),
                _cell(_median(runs, "precision"), ".3f"),
                _cell(_median(runs, "accuracy"), ".3f"),
                f"{statistics.median(wait):.1f} ({min(wait):.1f}-{max(wait):.1f})",
                f"{statistics.median(compute):.1f} ({min(compute):.1f}-{max(compute):.1f})",
                f"{statistics.median(tok_s):.2f} ({min(tok_s):.2f}-{max(tok_s):.2f})",
            ]
        )
    head = [
        "prediction",
        "hit rate",
        f"{kb_unit} read / token",
        f"demand {kb_unit} / token",
        f"read ahead {kb_unit} / token",
        f"read in vain {kb_unit} / token",
        "cancelled / token",
        "recall",
        "precision",
        "reads ahead used",
        "wait ms / token",
        "compute ms / token",
        "tok/s",
    ]
    return markdown_table(head, rows)


PREDICTORS = ("L's MoE input", "L's state before its FFN (shipped)", "L's output")


def predictor_counts(prompts: int, tokens: int, ms: tuple[int, ...]) -> dict:
    """``{(predictor, m): [right, needed, named]}`` over sampled decode steps (module
    docstring); the predicted experts by biased router score, top m."""
    from benchmarks.bench_cache_policy import prompts as held_out_prompts
    from kimi_k3.default_model import package_dir
    from kimi_k3.model.moe import moe_blocks, route_hooks
    from kimi_k3.streaming.simulate import _next_token

    model = load_model(package_dir())
    moes = moe_blocks(model)
    order = sorted(moes)
    after = dict(zip(order, order[1:], strict=False))
    decoders = {d.index: d for d in model.layers}
    seen, inner = {}, [False]

    def ranked(layer: int, state: mx.array) -> mx.array:
        gate = moes[layer].gate
        logits = gate.logits(state.reshape(-1, state.shape[-1])).astype(mx.float32)
        return mx.argsort(-(mx.sigmoid(logits) + gate.e_score_correction_bias), axis=-1)[0]

    def state_hook(d, snaps, p):
        nxt = after.get(d.index)
        if nxt is None:
            return
        n = decoders[nxt]
        x = d.post_attention_layernorm(d.mlp_res(snaps, p))
        inner[0] = True
        out = p + d.ffn(x)
        inner[0] = False
        mix = lambda part: n.post_attention_layernorm(  # noqa: E731
            n.mlp_res(snaps + [part] if n.starts_block else snaps, part)
        )
        seen[d.index] = [ranked(nxt, x), ranked(nxt, mix(p)), ranked(nxt, mix(out))]

    def route_hook(moe, flat):
        if not inner[0]:
            seen[("used", moe.layer_index)] = moe.gate(flat)[0]

    for d in decoders.values():
        d.state_hook = state_hook
    found: dict = {}
    rng = np.random.default_rng(0)
    try:
        with route_hooks(model, route_hook):
            for prompt in held_out_prompts(prompts, 256):
                cache = model.make_cache()
                mx.eval(model(mx.array([prompt[:-1]]), cache=cache))
                token = prompt[-1]
                for _ in range(tokens):
                    seen.clear()
                    logits = model(mx.array([[token]]), cache=cache)[0, -1]
                    mx.eval(logits, list(seen.values()))
                    for layer, nxt in after.items():
                        used = np.array(seen[("used", nxt)])[0]
                        for name, pred in zip(PREDICTORS, seen[layer], strict=True):
                            pred = np.array(pred)
                            for m in ms:
                                c = found.setdefault((name, m), [0, 0, 0])
                                c[0] += len(np.intersect1d(pred[:m], used))
                                c[1], c[2] = c[1] + len(used), c[2] + m
                    token = _next_token(np.array(logits.astype(mx.float32)), 0.6, rng)
    finally:
        for d in decoders.values():
            d.state_hook = None
    return found


def predictor_table(found: dict, ms: tuple[int, ...]) -> str:
    rows = []
    for name in PREDICTORS:
        cells = []
        for m in ms:
            right, needed, named = found[(name, m)]
            cells.append(f"{right / needed:.3f} / {right / named:.3f}")
        rows.append([name, *cells])
    return markdown_table(["layer L+1's router on", *(f"m = {m}" for m in ms)], rows)


def slice_checkpoint(path: Path, quick: bool) -> Path:
    """The K3-width slice at ``path``, written there when missing (or of another shape)."""
    from benchmarks.bench_streaming import checkpoint

    return checkpoint(path.parent, path.name, QUICK_SLICE if quick else SLICE)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefetch", description=__doc__)
    p.add_argument("--slots", type=int, default=16, help="slots a layer, trained default")
    p.add_argument("--prompt", type=int, default=32, help="prefill tokens")
    p.add_argument("--steps", type=int, default=128, help="decode steps, trained default")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts, predictors")
    p.add_argument("--tokens", type=int, default=64, help="decode steps a prompt, predictors")
    p.add_argument("--slice", type=Path, help="a K3-width slice here (written if missing)")
    p.add_argument("--slice-steps", type=int, default=12, help="decode steps on the slice")
    p.add_argument("--slice-rounds", type=int, default=3, help="rounds on the slice")
    p.add_argument("--quick", action="store_true", help="few steps, one round (CI)")
    p.add_argument("--out", type=Path, help="also write the tables here")
    return p


def main(argv: list[str] | None = None) -> str:
    from kimi_k3.default_model import ensure_default_model
    from kimi_k3.eval import heldout_ids

    a = setup_arg_parser().parse_args(argv)
    for name in ("slots", "prompt", "steps", "rounds", "tokens", "slice_steps", "slice_rounds"):
        if getattr(a, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1")
    if a.quick:
        a.steps, a.rounds, a.prompt, a.slice_steps, a.slice_rounds = 6, 1, 8, 2, 1
        a.prompts, a.tokens = 0, 4
    path = ensure_default_model()
    margs = ModelArgs.from_path(path)
    if not margs.num_experts_per_token <= a.slots <= margs.num_experts:
        raise SystemExit(
            f"error: --slots {a.slots}: expected {margs.num_experts_per_token}..{margs.num_experts}"
        )
    ids = [int(t) for t in heldout_ids(path)[: a.prompt + a.steps + 1]]
    load_before = os.getloadavg()[0]
    command = " ".join(sys.argv[1:] if argv is None else argv)
    parts = [f"Command: `python -m benchmarks.bench_prefetch {command}`; {timing.environment()}"]
    if a.out is not None:
        a.out.write_text("")
    k = margs.num_experts_per_token
    ms = tuple(sorted({1, 2, k // 2, k, 2 * k} - {0}))
    found = predictor_counts(a.prompts, a.tokens, ms)
    trained = section(path, a.slots, ids, a)
    parts.append(
        f"\n## The trained default: {margs.num_experts} experts of "
        f"{expert_bytes(expert_shapes(margs)) / 1e3:.1f} KB a MoE layer, top-{k}, {a.slots} "
        f"slots a layer; {a.steps} decode steps, {a.rounds} rounds; load average "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after\n\n"
        + table(trained)
        + f"\n## Predictors on the trained default: recall / precision of the m most likely, "
        f"{a.prompts} held-out prompts and two short ones, {a.tokens} decode steps each "
        "sampled at temperature 0.6\n\n" + predictor_table(found, ms)
    )
    timing.emit("\n".join(parts), a.out, append=True)  # kept if the slice does not finish
    if a.slice is not None:
        sl = slice_checkpoint(a.slice, a.quick)
        sargs = ModelArgs.from_path(sl)
        rng = np.random.default_rng(0)
        sids = rng.integers(0, sargs.vocab_size - 256, a.prompt + a.slice_steps + 1).tolist()
        b = argparse.Namespace(**{**vars(a), "steps": a.slice_steps, "rounds": a.slice_rounds})
        before = os.getloadavg()[0]
        found = section(sl, 16, sids, b)
        text = (
            f"\n## A K3-width slice: {sargs.num_experts} experts of "
            f"{expert_bytes(expert_shapes(sargs)) / 1e6:.2f} MB a MoE layer, top-"
            f"{sargs.num_experts_per_token}, 16 slots a layer, random weights and tokens; "
            f"{a.slice_steps} decode steps, {a.slice_rounds} rounds; load average "
            f"{before:.2f} before, {os.getloadavg()[0]:.2f} after\n\n" + table(found, "MB")
        )
        timing.emit(text, a.out, append=True)
        parts.append(text)
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    main()
