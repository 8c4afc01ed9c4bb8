"""Which MoE shape makes the routed experts carry the model: short trials of candidate presets.

Each candidate is ``kimi_k3.train.PRESET`` with its MoE fields replaced, cut to ``--layers``
layers (KDA, KDA, KDA, MLA: K3's pattern, a dense first layer, MoE after it). Every candidate
trains from the same seed on the same batches of the standard library's token stream
(``train run``'s recipe: AdamW, warm-up, cosine decay over ``--steps``, bias balancing), and
every ``--every`` steps the held-out NLL is measured twice, as trained and with every routed
expert's output zeroed (``kimi_k3.eval.ZeroRouted``): the difference is what the routed
experts carry. The table gives it per candidate and step, with each candidate's parameter
counts: routed weights a token goes through over the shared experts' weights (K3: 4x), and
routed experts' share of all parameters (K3: 97%).

    python -m benchmarks.preset_trial OUT                 # OUT keeps the tokenizer and streams
    python -m benchmarks.preset_trial OUT --steps 400 --every 100 --out-md trial.md
    python -m benchmarks.preset_trial OUT --only "128e top-16, 2 shared" --recipes plain k3

``--recipes`` trains each candidate under each recipe: ``k3`` is ``train run``'s (the routed
up-projections start at zero, weight decay on matrices alone), ``plain`` starts them at
random and decays every parameter. Each check also reports the routed gain
(``train.routed_gain``, the mean over MoE layers): the size of the routed part whatever the
experts compute, which falls towards zero when a model switches its routed experts off.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kimi_k3 import eval as k3eval
from kimi_k3 import train
from kimi_k3.cli import markdown_table
from kimi_k3.kernels.dispatch import reference_paths

# name -> the MoE fields that differ from train.PRESET
CANDIDATES = {
    "64e top-4, 2 shared (old)": dict(
        num_experts=64, num_experts_per_token=4, num_shared_experts=2
    ),
    "128e top-16, 2 shared": dict(num_experts=128, num_experts_per_token=16, num_shared_experts=2),
    "128e top-8, 1 shared": dict(num_experts=128, num_experts_per_token=8, num_shared_experts=1),
    "64e top-8 w128, 1 shared": dict(
        num_experts=64, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=128
    ),
}


def candidate(fields: dict, layers: int) -> dict:
    preset = dict(train.PRESET, **fields, num_hidden_layers=layers)
    preset["full"] = [i for i in train.PRESET["full"] if i <= layers]
    return preset


def proportions(preset: dict) -> tuple[float, float, int]:
    """(routed weights a token goes through / shared experts' weights, routed experts'
    share of all parameters, all parameters) for ``preset``."""
    D, L = preset["hidden_size"], preset["routed_expert_hidden_size"]
    inner = preset["moe_intermediate_size"]
    active = preset["num_experts_per_token"] * 3 * L * inner
    shared = 3 * D * inner * preset["num_shared_experts"]
    mx.random.seed(0)
    model = train.init_model(preset)
    sizes = {k: v.size for k, v in tree_flatten(model.parameters())}
    routed = sum(n for k, n in sizes.items() if ".experts." in k)
    return active / shared, routed / sum(sizes.values()), sum(sizes.values())


def heldout_nll(model, wins: np.ndarray, routed: bool) -> float:
    """Mean next-token NLL over ``wins``; with ``routed`` False, the routed experts zeroed."""
    moes = k3eval.moe_blocks(model)
    kept = {i: m.experts for i, m in moes.items()}
    if not routed:
        for m in moes.values():
            m.experts = k3eval.ZeroRouted()
    try:
        return math.log(k3eval.perplexity(model, wins, batch=8))
    finally:
        for i, m in moes.items():
            m.experts = kept[i]


RECIPES = {"k3": dict(plain=False), "plain": dict(plain=True)}


def trial(preset: dict, train_ids, wins, args, log, plain: bool = False) -> list[tuple]:
    """Train ``preset`` for ``args.steps`` steps (``plain``: random routed up-projections,
    decay on every parameter); ``(step, NLL, routed-zeroed NLL, routed gain)`` every
    ``args.every`` steps."""
    model = train.init_model(preset, seed=args.seed, zero_routed_up=not plain)
    opt = train.make_optimizer(args.lr, decay_vectors=plain)
    data = train.batches(train_ids, args.batch, args.seq, args.seed)
    rows, step = [], 0
    t0 = time.time()
    while step < args.steps:
        n = min(args.every, args.steps - step)
        # one schedule over the whole trial: the learning rate depends on step / steps
        losses = train.train(
            model, data, step + n, args.lr, args.warmup, args.bias_rate,
            optimizer=opt, start_step=step, total_steps=args.steps,
        )  # fmt: skip
        step += n
        model.eval()
        full, zeroed = heldout_nll(model, wins, True), heldout_nll(model, wins, False)
        gain = float(np.mean(train.routed_gain(model)))
        rows.append((step, full, zeroed, gain))
        log(
            f"  step {step}: train loss {np.mean(losses):.3f}, held-out NLL {full:.3f}, routed "
            f"zeroed {zeroed:.3f} (+{zeroed - full:.3f}), routed gain {gain:.3f}, "
            f"{time.time() - t0:.0f} s"
        )
    return rows


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.preset_trial", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out", help="directory for the tokenizer and token streams (reused)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--bias-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-tokens", type=int, default=4096)
    parser.add_argument("--only", nargs="*", help="candidate names to run (default: all)")
    parser.add_argument(
        "--recipes", nargs="*", default=["k3"], choices=sorted(RECIPES), help="(default: k3)"
    )
    parser.add_argument("--out-md", help="write the markdown table here")
    return parser


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, train_ids, heldout_ids = train.prepare(out, train.PRESET["vocab_size"])
    wins = k3eval.windows(np.asarray(heldout_ids), args.seq, args.heldout_tokens)
    header = ["candidate", "recipe", "routed active / shared", "routed share", "parameters",
              "step", "held-out NLL", "routed zeroed", "routed carries (nats)",
              "routed gain"]  # fmt: skip
    table = []
    names = args.only or list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise SystemExit(f"error: --only: no candidate {unknown[0]!r} ({sorted(CANDIDATES)})")
    for name in names:
        preset = candidate(CANDIDATES[name], args.layers)
        ratio, share, total = proportions(preset)
        for recipe in args.recipes:
            print(f"{name}, {recipe}: routed/shared {ratio:.1f}x, routed share {share:.0%}, "
                  f"{total:,} params")  # fmt: skip
            with reference_paths():
                rows = trial(preset, train_ids, wins, args, print, **RECIPES[recipe])
            for step, full, zeroed, gain in rows:
                table.append([name, recipe, f"{ratio:.1f}x", f"{share:.0%}", f"{total:,}",
                              str(step), f"{full:.3f}", f"{zeroed:.3f}",
                              f"{zeroed - full:+.3f}", f"{gain:.3f}"])  # fmt: skip
    text = markdown_table(header, table)
    print(text)
    if args.out_md:
        Path(args.out_md).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
