"""Expert-cache policies against the optimum (Belady) on routing traces of the trained model.

    python -m benchmarks.bench_cache_policy --out cache_policy.md --plot docs/cache_policy.png
    python -m benchmarks.bench_cache_policy --quick    # seconds: a smoke run, not a measurement

Records the routing of the shipped default model (``kimi_k3/default``: 7 MoE layers x 64
experts, top-4) with its experts resident, over ``--prompts`` windows of ``--prompt-tokens``
held-out tokens, the demo prompt and a chat prompt. Each prompt is prefilled in chunks as the
generator does (512 tokens, and 128 for a second prefill table), then decoded for
``--tokens`` steps, sampled at temperature 0.6 and 1 (numpy seed 0) and greedy. The traces are
replayed through ``kimi_k3.streaming.simulate`` (the shipped ``SlotCache`` and policies,
each prompt from an empty cache) at five slots-per-layer budgets. Hit rates are counts: they
do not depend on timing or load, only on the model, the prompts and MLX's arithmetic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from benchmarks import timing
from kimi_k3 import default_model
from kimi_k3.cli import markdown_table
from kimi_k3.streaming.cache import LRU, make_policy
from kimi_k3.streaming.simulate import RoutingTrace, counts, record, replay

SLOTS = (4, 8, 16, 24, 32)  # the top-k floor to half of the 64 experts
DEFAULT = "lfu"  # StreamOptions.policy
# The decode traces: (title, sampling temperature; 0 is greedy).
DECODES = (
    ("decode, sampled at temperature 0.6", 0.6),
    ("decode, sampled at temperature 1", 1.0),
    ("decode, greedy", 0.0),
)
CHAT = "Write a Python function that reads a CSV file and returns its rows as dictionaries."
# (label, policy, half-life in units of slots or None for the policy's default)
POLICY_ROWS = (
    ("lru", "lru", None),
    ("lfu, half-life 4 x slots (default)", "lfu", None),
    ("lfu, half-life 1 x slots", "lfu", 1),
    ("lfu, half-life 16 x slots", "lfu", 16),
    ("belady (optimum)", "belady", None),
)


def prompts(n: int, tokens: int) -> list[list[int]]:
    """``n`` held-out windows spread over the held-out text, the demo prompt, a chat prompt."""
    from kimi_k3.eval import heldout_ids, windows
    from kimi_k3.text.chat import encode_chat
    from kimi_k3.text.tokenizer import load_tokenizer

    path = default_model.package_dir()
    tok = load_tokenizer(path)
    out = []
    if n:
        wins = windows(heldout_ids(path), tokens)
        out = [wins[i].tolist() for i in np.linspace(0, len(wins) - 1, n).round().astype(int)]
    out.append(tok.encode(default_model.PROMPT, add_special_tokens=False))
    out.append(encode_chat(tok, [{"role": "user", "content": CHAT}]))
    return out


def traces(args) -> dict:
    """Per decode temperature (``DECODES``) a trace prefilled in chunks of ``args.chunks[0]``,
    and under ``"prefill"`` one prefilled in chunks of ``args.chunks[1]`` (one decode step)."""
    from kimi_k3.checkpoint.loader import load_model

    model = load_model(default_model.package_dir())
    ps = prompts(args.prompts, args.prompt_tokens)
    big, small = args.chunks
    out = {temp: record(model, ps, big, args.tokens, temp=temp, seed=0) for _, temp in DECODES}
    out["prefill"] = record(model, ps, small, 1)
    return out


def rate(trace: RoutingTrace, policy: str, slots: int, phase: str, **kw) -> tuple[float, int]:
    """(hit rate, misses) of ``phase`` over the trace."""
    hits, misses = counts(trace, policy, slots, **kw)[phase]
    return hits / max(hits + misses, 1), int(misses)


def policy_table(trace: RoutingTrace, phase: str, slots=SLOTS) -> tuple[str, dict]:
    """Hit rate per policy (rows) and budget (columns), with the flat baseline first."""
    E = trace.num_experts
    header = ["policy"] + [f"{s} slots ({s / E:.3g})" for s in slots]
    body = [["flat routing (h = cache fraction)"] + [f"{s / E:.3f}" for s in slots]]
    found = {}
    for label, policy, half in POLICY_ROWS:
        cells = []
        for s in slots:
            kw = {} if half is None else {"half_life": half * s}
            found[label, s] = rate(trace, policy, s, phase, **kw)
            cells.append(f"{found[label, s][0]:.3f}")
        body.append([label] + cells)
    return markdown_table(header, body), found


def gap_table(found: dict[str, dict], traces: dict, E: int, slots=SLOTS) -> str:
    """The default against the optimum and against LRU, per phase and budget; ``traces``
    maps each of ``found``'s titles to its (trace, phase)."""
    d, b, lru = POLICY_ROWS[1][0], POLICY_ROWS[-1][0], POLICY_ROWS[0][0]
    header = [
        "phase",
        "slots / layer",
        "cache fraction",
        "default (lfu) hit rate",
        "belady hit rate",
        "gap (points)",
        "default misses / belady misses",
        "lru misses / default misses",
        "prompts where the default misses no more than lru",
    ]
    body = []
    for title, f in found.items():
        trace, phase = traces[title]
        for s in slots:
            (hd, md), (hb, mb), (_, ml) = f[d, s], f[b, s], f[lru, s]
            body.append(
                [title, s, f"{s / E:.3f}", f"{hd:.3f}", f"{hb:.3f}", f"{100 * (hb - hd):.1f}"]
                + [f"{md / max(mb, 1):.2f}", f"{ml / max(md, 1):.3f}"]
                + [_prompts_no_worse(trace, phase, s)]
            )
    return markdown_table(header, body)


def _prompts_no_worse(trace: RoutingTrace, phase: str, slots: int) -> str:
    no_worse = 0
    for run in trace.runs:
        one = RoutingTrace(trace.num_experts, trace.top_k, [run])
        misses = {p: counts(one, p, slots)[phase][1] for p in (DEFAULT, "lru")}
        no_worse += misses[DEFAULT] <= misses["lru"]
    return f"{no_worse}/{len(trace.runs)}"


# Candidate policies, tried on the traces and not shipped (see docs/streaming.md). They
# follow the policy interface of ``kimi_k3.streaming.cache``; ``at(t)`` is told the call.


class LRU2(LRU):
    """LRU-K with K = 2: evict the oldest second-to-last use (one use only: first, by LRU)."""

    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.prev = np.zeros(num_experts, np.int64)

    def use(self, experts):
        self.prev[experts] = self.last[experts]
        super().use(experts)

    def victims(self, candidates, m):
        return candidates[np.lexsort((self.last[candidates], self.prev[candidates]))[:m]]


class Decayed(LRU):
    """A score per expert that decays by ``decay`` per call and grows by 1 per use (LRFU),
    or by the router weight the call gave the expert, summed over its tokens (``weights``:
    per call, a [num_experts] array); ties to the least recent."""

    def __init__(self, num_experts: int, decay: float, weights=None):
        super().__init__(num_experts)
        self.score = np.zeros(num_experts)
        self.decay, self.weights, self.t = decay, weights, 0

    def at(self, t: int):
        self.t = t
        self.score *= self.decay

    def use(self, experts):
        super().use(experts)
        self.score[experts] += 1.0 if self.weights is None else self.weights[self.t][experts]

    def victims(self, candidates, m):
        return candidates[np.lexsort((self.last[candidates], self.score[candidates]))[:m]]


def weight_sums(run, layer: int, E: int) -> list[np.ndarray]:
    out = []
    for inds, w in run.routing[layer]:
        a = np.zeros(E)
        np.add.at(a, inds.reshape(-1), w.reshape(-1))
        out.append(a)
    return out


CANDIDATES = {
    "lru-2 (LRU-K, K = 2)": lambda run, layer, E: LRU2(E),
    "lrfu: score x 0.97 per call, +1 per use": lambda run, layer, E: Decayed(E, 0.97),
    "router weight: score x 0.97 per call, + weight": lambda run, layer, E: Decayed(
        E, 0.97, weight_sums(run, layer, E)
    ),
}


def decode_hits(trace: RoutingTrace, make, slots: int) -> tuple[int, int]:
    """(hits, decode calls' distinct experts) of a policy built per run and layer."""
    hits = total = 0
    for run in trace.runs:
        decode = np.array(run.phases) == "decode"
        for layer in run.routing:
            got = replay(run.calls(layer), slots, make(run, layer, trace.num_experts))
            hits += int(got[decode, 0].sum())
            total += int(got[decode].sum())
    return hits, total


def uneven_split(trace: RoutingTrace, slots: int, policy: str = DEFAULT) -> float:
    """Decode hit rate when each layer's share of ``layers x slots`` follows its own hit-rate
    curve (greedy on the marginal gain, at least top-k each), chosen on half of the runs and
    scored on the other half (two folds)."""
    runs = range(len(trace.runs))
    folds = [tuple(runs[0::2]), tuple(runs[1::2])]
    hits = total = 0
    for fit, score in (folds, folds[::-1]):
        for layer, s in _allocate(trace, fit, slots, policy).items():
            h, t = _layer_hits(trace, score, layer, s, policy)
            hits, total = hits + h, total + t
    return hits / max(total, 1)


_HITS: dict[tuple, tuple[int, int]] = {}  # the curves, shared by the budgets


def _layer_hits(trace, runs: tuple, layer: int, slots: int, policy: str) -> tuple[int, int]:
    """(hits, distinct experts) of ``layer``'s decode calls over ``runs``."""
    key = (id(trace), runs, layer, slots, policy)
    if key not in _HITS:
        hits = total = 0
        for r in runs:
            run = trace.runs[r]
            decode = np.array(run.phases) == "decode"
            got = replay(run.calls(layer), slots, make_policy(policy, trace.num_experts, slots))
            hits, total = hits + int(got[decode, 0].sum()), total + int(got[decode].sum())
        _HITS[key] = hits, total
    return _HITS[key]


def _allocate(trace, runs: tuple, slots: int, policy: str) -> dict[int, int]:
    """Slots per layer, ``slots`` on average: top-k each, then one at a time to the layer
    whose hits on ``runs`` grow most (ties to the lower layer)."""
    split = {layer: trace.top_k for layer in trace.layers}
    while sum(split.values()) < slots * len(split):
        gain = {
            layer: _layer_hits(trace, runs, layer, s + 1, policy)[0]
            - _layer_hits(trace, runs, layer, s, policy)[0]
            for layer, s in split.items()
            if s < trace.num_experts
        }
        split[max(gain, key=lambda layer: (gain[layer], -layer))] += 1
    return split


def candidate_table(trace: RoutingTrace, found: dict, slots=SLOTS) -> str:
    E = trace.num_experts
    header = ["policy"] + [f"{s} slots ({s / E:.3g})" for s in slots]
    body = [
        [label] + [f"{found[label, s][0]:.3f}" for s in slots]
        for label, _, _ in (POLICY_ROWS[0], POLICY_ROWS[1])
    ]
    for label, make in CANDIDATES.items():
        cells = []
        for s in slots:
            h, t = decode_hits(trace, make, s)
            cells.append(f"{h / max(t, 1):.3f}")
        body.append([label] + cells)
    body.append(
        ["default (lfu), per-layer slots by each layer's curve (cross-validated)"]
        + [f"{uneven_split(trace, s):.3f}" for s in slots]
    )
    return markdown_table(header, body)


def describe(trace: RoutingTrace, name: str) -> str:
    calls = {p: sum(r.phases.count(p) for r in trace.runs) for p in ("prefill", "decode")}
    return (
        f"{name}: {len(trace.runs)} prompts, {calls['prefill']} prefill and "
        f"{calls['decode']} decode calls per MoE layer in all, {len(trace.layers)} MoE layers"
    )


def plot(found: dict, E: int, out: Path, slots=SLOTS):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(DECODES), figsize=(14, 4), sharey=True)
    f = [s / E for s in slots]
    for ax, (title, _) in zip(axes, DECODES, strict=True):
        for label, _, half in POLICY_ROWS:
            if half is None:
                ax.plot(f, [found[title][label, s][0] for s in slots], "o-", label=label)
        ax.plot(f, f, "k--", label="flat routing (h = cache fraction)")
        ax.set_title(title)
        ax.set_xlabel("cache size / all experts")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hit rate")
    axes[0].legend(fontsize=8)
    fig.suptitle("Trained default model (7 MoE layers x 64 experts, top-4): cache policies")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def setup_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the markdown tables here")
    ap.add_argument("--plot", type=Path, help="write the hit-rate plot (PNG) here")
    ap.add_argument("--prompts", type=int, default=4, help="held-out windows (plus 2 prompts)")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="tokens per window")
    ap.add_argument("--tokens", type=int, default=256, help="decode steps per prompt")
    ap.add_argument(
        "--quick", action="store_true", help="the two short prompts only, 4 decode steps"
    )
    return ap


def main(argv=None) -> str:
    args = setup_arg_parser().parse_args(argv)
    args.chunks, args.slots = (512, 128), SLOTS
    if args.quick:
        args.slots = SLOTS[:3]
        args.prompts, args.tokens, args.chunks = 0, 4, (32, 16)
    big, small = args.chunks
    t = traces(args)
    first = t[DECODES[0][1]]
    E = first.num_experts
    command = " ".join(sys.argv[1:] if argv is None else argv)
    out = [
        f"Command: `python -m benchmarks.bench_cache_policy {command}`",
        "",
        f"{timing.environment()}.",
        "",
        describe(first, f"Chunks of {big}"),
        "",
    ]
    tables = [(title, t[temp], "decode") for title, temp in DECODES]
    tables += [(f"prefill, chunks of {big}", first, "prefill")]
    tables += [(f"prefill, chunks of {small}", t["prefill"], "prefill")]
    found, where = {}, {}
    for title, trace, phase in tables:
        text, found[title] = policy_table(trace, phase, args.slots)
        where[title] = trace, phase
        out += [f"## Hit rate, {title}", "", text]
    gaps = {k: v for k, v in found.items() if k != f"prefill, chunks of {small}"}
    out += ["## The default against the optimum", "", gap_table(gaps, where, E, args.slots)]
    head = DECODES[0][0]
    out += [
        f"## Candidates not shipped ({head})",
        "",
        candidate_table(first, found[head], args.slots),
    ]
    text = "\n".join(out)
    timing.emit(text, args.out)
    if args.plot:
        plot(found, E, args.plot, args.slots)
    return text


if __name__ == "__main__":
    main()
