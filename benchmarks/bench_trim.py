"""Expert trimming and shedding misses (``kimi_k3.model.routing``) on the trained default
model, every setting in one run: experts kept per token, routed-expert bytes per token,
held-out NLL and KL against the exact model, and decode with streamed experts (experts read
per token, tokens/s).

    python -m benchmarks.bench_trim [--quick] [--out FILE.md] [--plot PNG]
    python -m benchmarks.bench_trim --sections shed --out FILE.md   # shedding only

Sections: ``trim`` (the tables below) and ``shed`` (shedding misses against top-p trimming
at equal bytes, ``shed_section``).

Quality: the held-out text shipped with the model (``kimi_k3.eval``), windows of ``--seq``
tokens, fp32; for each batch the untrimmed model's log-probabilities are computed once and
every setting is compared with them (the same model, its trimming switched between
settings). NLL change = mean over tokens of trimmed minus untrimmed NLL; KL = mean over
tokens of KL(untrimmed || trimmed). Experts kept = mean over held-out tokens and MoE layers.

Speed: the same model with its experts streamed (direct reads) into a cache of
``--cache-fraction`` of their bytes; per setting an emptied cache, a prefill of
``--prompt`` held-out tokens, then ``--steps`` decode steps that feed the following
held-out tokens (the same inputs for every setting, whatever it would have generated).
Rounds interleave the settings; medians and spread over ``--rounds``.

Static rows lower the router's top-k itself (selection by biased score, weights
renormalised over the k kept): a baseline that uses the same count for every token.

Shedding depends on what the cache holds, so its quality is measured where it acts: the
experts streamed into ``--shed-slots`` a layer, fp32, over ``--shed-windows`` held-out
windows of ``--shed-seq`` tokens, each a prefill of ``--prompt`` tokens then one decode
step a token fed the text (teacher forcing; the expert cache carries over from window to
window, as in one long session). KL and NLL change are over the decoded positions against
the exact model's log-probabilities (one pass a window), experts read per decoded token
from ``get_stats``. Top-p trimming runs through the same protocol, and each shedding row
gives the KL top-p reaches at the same bytes (linear between its settings). The routed
experts zeroed (``kimi_k3.eval``'s ablation) is scored on the same positions: a model whose
routed experts carry little cannot rank these settings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks import timing
from kimi_k3 import default_model
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.cli import markdown_table
from kimi_k3.eval import ZeroRouted, heldout_ids, windows
from kimi_k3.model import routing
from kimi_k3.model.moe import moe_blocks, route_hooks
from kimi_k3.streaming import clear_cache, get_stats, reset_stats

NLL_BUDGET = 0.05  # nats per token: the largest cost a recommended setting may have


@dataclass(frozen=True)
class Setting:
    """One row: ``kind`` is ``"top_p"``, ``"min_weight"``, ``"top_k"`` (static), ``"off"``
    (untrimmed) or ``"none"`` (no routed experts: the shared experts alone)."""

    kind: str
    value: float = 0.0

    @property
    def label(self) -> str:
        if self.kind == "off":
            return "untrimmed"
        if self.kind == "none":
            return "no routed experts"
        if self.kind == "top_k":
            return f"static top-{int(self.value)}"
        return f"{self.kind.replace('_', '-')} {self.value:g}"

    @property
    def trims(self) -> bool:
        return self.kind in ("top_p", "min_weight")


# The trained router's renormalised top-4 weights sit between about 0.2 and 0.3 (flat), so
# top-p steps at 0.25, 0.5 and 0.75 and min weight acts between 0.22 and 0.27.
TOP_P = (0.9, 0.8, 0.75, 0.7, 0.5, 0.27, 0.25)
MIN_WEIGHT = (0.22, 0.24, 0.25, 0.26, 0.27)
SETTINGS = (
    [Setting("off")]
    + [Setting("top_p", p) for p in TOP_P]
    + [Setting("min_weight", w) for w in MIN_WEIGHT]
    + [Setting("top_k", k) for k in (3, 2, 1)]
    + [Setting("none")]
)
QUICK = [Setting("off"), Setting("top_p", 0.7), Setting("min_weight", 0.25), Setting("none")]
# Shedding misses against top-p trimming (streamed decode): (label, top_p, shed_misses)
SHED = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.0)
SHED_TOP_P = (0.75, 0.5, 0.25)  # the trained router's steps: 3, 2 and 1 of its 4 experts
SHED_QUICK = (0.5,)
SECTIONS = ("trim", "shed")


def apply(model, setting: Setting, top_k: int):
    """Put ``setting`` on every MoE layer of ``model`` (``top_k``: the model's own)."""
    p = setting.value if setting.kind == "top_p" else 1.0
    w = setting.value if setting.kind == "min_weight" else 0.0
    routing.set_expert_trimming(model, top_p=p, min_weight=w)
    k = int(setting.value) if setting.kind == "top_k" else top_k
    for router in routing.routers(model):
        router.top_k = k


class KeptCounter:
    """Experts each MoE layer keeps per token, counted from its router's output; with
    ``weights``, also every token's routing weights renormalised over its choices, by
    decreasing weight (``profile``)."""

    def __init__(self, model, weights: bool = False):
        self.moes = moe_blocks(model)
        self.hooks = route_hooks(model, self.hook)
        self.pairs = dict.fromkeys(self.moes, 0)
        self.tokens = dict.fromkeys(self.moes, 0)
        self.weights = [] if weights else None

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)

    def hook(self, moe, flat):
        inds, w = moe.gate(flat)
        ids = np.array(inds)
        self.pairs[moe.layer_index] += int(routing.kept(ids).sum())
        self.tokens[moe.layer_index] += ids.shape[0]
        if self.weights is not None:  # the scaling factor cancels
            w = np.array(w)
            self.weights.append(-np.sort(-w / w.sum(axis=-1, keepdims=True), axis=-1))

    def per_layer(self) -> dict[int, float]:
        return {layer: self.pairs[layer] / self.tokens[layer] for layer in self.moes}

    def profile(self) -> np.ndarray:
        """Renormalised weights by rank over tokens and layers: rows mean, 10th and 90th
        percentile. Shapes: returns [3, k]."""
        r = np.concatenate(self.weights)
        return np.stack([r.mean(0), *np.percentile(r, [10, 90], axis=0)])


def _logprobs(model, x: mx.array, setting: Setting) -> mx.array:
    moes = moe_blocks(model)
    stores = {layer: moe.experts for layer, moe in moes.items()}
    if setting.kind == "none":
        for moe in moes.values():
            moe.experts = ZeroRouted()
    try:
        logits = model(x).astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    finally:
        for layer, moe in moes.items():
            moe.experts = stores[layer]


def quality(model, wins: np.ndarray, settings: list[Setting], batch: int) -> tuple[dict, int]:
    """``({setting: {"dnll", "kl", "kept" (per layer)}}, tokens scored)`` over ``wins``; the
    first setting must be ``off``, the reference."""
    if settings[0].kind != "off":
        raise ValueError("the first setting is the untrimmed reference")
    top_k = model.args.num_experts_per_token
    nll = dict.fromkeys(settings, 0.0)
    kl = dict.fromkeys(settings, 0.0)
    counters = {s: KeptCounter(model, weights=s is settings[0]) for s in settings}
    count = 0
    for i in range(0, len(wins), batch):
        w = mx.array(wins[i : i + batch])
        x, y = w[:, :-1], w[:, 1:, None]
        for s in settings:
            apply(model, s, top_k)
            with counters[s]:
                lp = _logprobs(model, x, s)
            if s is settings[0]:
                ref, pr = lp, mx.exp(lp)
            nll[s] -= mx.take_along_axis(lp, y, axis=-1).sum().item()
            kl[s] += (pr * (ref - lp)).sum().item()
        count += y.size
    apply(model, settings[0], top_k)
    out = {}
    for s, counter in counters.items():
        kept = counter.per_layer()
        if s.kind == "none":
            kept = dict.fromkeys(kept, 0.0)
        out[s] = {"dnll": (nll[s] - nll[settings[0]]) / count, "kl": kl[s] / count, "kept": kept}
    out[settings[0]]["profile"] = counters[settings[0]].profile()
    return out, count


def decode_run(model, setting: Setting, ids: np.ndarray, prompt: int, steps: int) -> dict:
    """Emptied cache, prefill ``ids[:prompt]``, then ``steps`` decode steps on the next ids;
    the decode steps' tokens/s, CPU time of the process (reader threads included) and
    streaming counters per token."""
    apply(model, setting, model.args.num_experts_per_token)
    clear_cache(model)
    cache = model.make_cache()
    mx.eval(model(mx.array(ids[None, :prompt]), cache=cache))
    reset_stats(model)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for t in range(prompt, prompt + steps):
        mx.eval(model(mx.array(ids[None, t : t + 1]), cache=cache))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    s = get_stats(model)
    return {
        "tok_s": steps / seconds,
        "cpu_ms": cpu / steps * 1e3,
        "misses": s["misses"] / s["tokens"],
        "bytes_read": s["bytes_read"] / s["tokens"],
        "kept": s["experts_per_token"],
        "direct_io": s["direct_io"],
    }


def speed(model, settings, ids, prompt: int, steps: int, rounds: int) -> dict:
    """``{setting: [decode_run result per round]}``, rounds interleaving the settings, after
    an untimed short run of each (compiles its router)."""
    settings = [s for s in settings if s.kind != "none"]  # nothing to read
    for s in settings:
        decode_run(model, s, ids, prompt, 2)
    jobs = {s.label: (lambda s=s: decode_run(model, s, ids, prompt, steps)) for s in settings}
    results, failed = timing.interleaved(jobs, rounds)
    if failed:
        raise RuntimeError(f"decode failed: {failed}")
    return {s: results[s.label] for s in settings}


def _spread(values: list[float], fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def table(settings, q: dict, runs: dict, expert_bytes: int, layers: int, top_k: int) -> str:
    header = [
        "setting",
        "experts kept / token (mean of layers)",
        "layers min-max",
        "routed-expert KB / token",
        "vs untrimmed",
        "NLL change (nats/token)",
        "KL from untrimmed (nats/token)",
        "experts read / token (decode)",
        "KB read / token (decode)",
        "decode tok/s (median)",
        "tok/s min-max",
        "CPU ms / token (median)",
    ]
    rows = []
    for s in settings:
        per_layer = list(q[s]["kept"].values())
        kept = statistics.mean(per_layer)
        rows.append(
            [
                s.label,
                f"{kept:.3f}",
                _spread(per_layer, ".2f"),
                f"{kept * layers * expert_bytes / 1e3:.1f}",
                f"{kept / top_k:.3f}",
                f"{q[s]['dnll']:+.4f}",
                f"{q[s]['kl']:.2g}",
                *_speed_cells(runs.get(s)),
            ]
        )
    return markdown_table(header, rows)


def _speed_cells(r: list[dict] | None) -> list[str]:
    if r is None:
        return ["-"] * 5
    tok_s = [x["tok_s"] for x in r]
    return [
        f"{statistics.median(x['misses'] for x in r):.2f}",
        f"{statistics.median(x['bytes_read'] for x in r) / 1e3:.1f}",
        f"{statistics.median(tok_s):.1f}",
        _spread(tok_s, ".1f"),
        f"{statistics.median(x['cpu_ms'] for x in r):.1f}",
    ]


def layer_table(settings, q: dict) -> str:
    layers = list(q[settings[0]]["kept"])
    rows = [[s.label, *(f"{q[s]['kept'][i]:.2f}" for i in layers)] for s in settings]
    return markdown_table(["setting", *(f"layer {i}" for i in layers)], rows)


def profile_table(profile: np.ndarray) -> str:
    rows = [
        [name, *(f"{v:.3f}" for v in row)]
        for name, row in zip(("mean", "10th percentile", "90th percentile"), profile, strict=True)
    ]
    ranks = [f"rank {i + 1}" for i in range(profile.shape[1])]
    return markdown_table(["untrimmed router weight, renormalised", *ranks], rows)


def recommend(settings, q: dict) -> Setting | None:
    """The trimming setting keeping the fewest experts whose NLL cost is within budget."""
    ok = [s for s in settings if s.trims and q[s]["dnll"] <= NLL_BUDGET]
    return min(ok, key=lambda s: statistics.mean(q[s]["kept"].values()), default=None)


def plot(settings, q: dict, runs: dict, top_k: int, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, style, name in (
        ("top_p", "o-", "top-p"),
        ("min_weight", "s-", "min weight"),
        ("top_k", "x", "static top-k"),
    ):
        rows = sorted(
            (s for s in settings if s.kind in (kind, "off")),
            key=lambda s: statistics.mean(q[s]["kept"].values()),
        )
        kept = [statistics.mean(q[s]["kept"].values()) for s in rows]
        a.plot(kept, [q[s]["dnll"] for s in rows], style, label=name)
        reads = [statistics.median(x["misses"] for x in runs[s]) for s in rows]
        b.plot(kept, reads, style, label=name)
    none = Setting("none")
    if none in q:
        a.plot([0], [q[none]["dnll"]], "k^", label="no routed experts")
    a.axhline(NLL_BUDGET, color="k", ls="--", lw=0.8, label=f"{NLL_BUDGET} nats")
    a.set(xlabel=f"experts kept per token (of {top_k})", ylabel="held-out NLL change (nats)")
    b.set(
        xlabel=f"experts kept per token (of {top_k})",
        ylabel="experts read from disk per decode token",
    )
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Expert trimming on the trained default model")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def shed_settings(quick: bool) -> list[tuple[str, float, float]]:
    """``(label, top_p, shed_misses)`` rows: exact, top-p trimming, shedding."""
    rows = [("exact", 1.0, 1.0)]
    rows += [(f"top-p {p:g}", p, 1.0) for p in (SHED_TOP_P[1:2] if quick else SHED_TOP_P)]
    rows += [(f"shed misses {p:g}", 1.0, p) for p in (SHED_QUICK if quick else SHED)]
    return rows


def reference_logprobs(model, wins: np.ndarray) -> tuple[list[mx.array], list[mx.array]]:
    """Per window, the exact model's log-probabilities and those with its routed experts
    zeroed (``kimi_k3.eval``'s ablation), each in one pass. Shapes: [seq, vocab] each."""
    exact, zeroed = [], []
    for w in wins:
        x = mx.array(w[None, :-1])
        exact.append(_logprobs(model, x, Setting("off"))[0])
        zeroed.append(_logprobs(model, x, Setting("none"))[0])
        mx.eval(exact[-1], zeroed[-1])
    return exact, zeroed


def _scores(ref: mx.array, lp: mx.array, y: np.ndarray) -> tuple[float, float]:
    """(summed KL(ref || lp), summed NLL change) over positions. Shapes: [T, vocab], y [T]."""
    t = mx.array(y[:, None])
    kl = (mx.exp(ref) * (ref - lp)).sum().item()
    dnll = (mx.take_along_axis(ref, t, -1) - mx.take_along_axis(lp, t, -1)).sum().item()
    return kl, dnll


def shed_run(path, gb: float, wins, refs, prompt: int, top_p: float, shed: float) -> dict:
    """One setting over the windows, streamed (module docstring): KL and NLL change per
    decoded token, experts and bytes read per decoded token, hit rate, weight dropped."""
    model = load_model(path, dtype=mx.float32, expert_cache_gb=gb)
    routing.set_expert_trimming(model, top_p=top_p)
    routing.set_shed_misses(model, shed)
    kl = dnll = 0.0
    tokens = hits = misses = bytes_read = pairs = shed_mass = 0
    for w, ref in zip(wins, refs, strict=True):
        cache = model.make_cache()
        mx.eval(model(mx.array(w[None, :prompt]), cache=cache))
        reset_stats(model)
        steps = [
            model(mx.array(w[None, t : t + 1]), cache=cache)[0] for t in range(prompt, len(w) - 1)
        ]
        lp = mx.concatenate(steps).astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        a, b = _scores(ref[prompt:], lp, w[prompt + 1 :])
        kl, dnll = kl + a, dnll + b
        s = get_stats(model)
        tokens += s["tokens"]
        hits, misses, bytes_read = (
            hits + s["hits"],
            misses + s["misses"],
            bytes_read + s["bytes_read"],
        )
        pairs, shed_mass = pairs + s["pairs"], shed_mass + s["shed_mass"]
    layers = get_stats(model)["layers"]
    return {
        "kl": kl / tokens,
        "dnll": dnll / tokens,
        "kept": pairs / (tokens * layers),
        "read": misses / tokens,
        "kb": bytes_read / tokens / 1e3,
        "hit_rate": hits / max(hits + misses, 1),
        "dropped": shed_mass / (tokens * layers),
    }


def at_equal_bytes(curve: list[tuple[float, float]], kb: float) -> float | None:
    """The KL of a (KB read, KL) curve at ``kb``, linear between its points; None outside."""
    pts = sorted(curve)
    if not pts[0][0] <= kb <= pts[-1][0]:
        return None
    xs, ys = zip(*pts, strict=True)
    return float(np.interp(kb, xs, ys))


def shed_section(args) -> str:
    """Shedding misses against top-p trimming at equal bytes (module docstring)."""
    path = default_model.ensure_default_model()
    ids = heldout_ids(path)
    wins = windows(ids, args.shed_seq, args.shed_windows * args.shed_seq)
    resident = load_model(path, dtype=mx.float32)
    exact, zeroed = reference_logprobs(resident, wins)
    slots, E = args.shed_slots, resident.args.num_experts
    gb = slots / E * default_model.expert_bytes(path) / 1e9
    rows = {
        label: shed_run(path, gb, wins, exact, args.prompt, p, shed)
        for label, p, shed in shed_settings(args.quick)
    }
    decoded = sum(len(w) - 1 - args.prompt for w in wins)
    z = [
        _scores(r[args.prompt :], zr[args.prompt :], w[args.prompt + 1 :])
        for r, zr, w in zip(exact, zeroed, wins, strict=True)
    ]
    ablation = (sum(a for a, _ in z) / decoded, sum(b for _, b in z) / decoded)
    curve = [(r["kb"], r["kl"]) for label, r in rows.items() if not label.startswith("shed")]
    body = []
    for label, r in rows.items():
        same = at_equal_bytes(curve, r["kb"]) if label.startswith("shed") else None
        body.append(
            [
                label,
                f"{r['kept']:.3f}",
                f"{r['dropped']:.3f}",
                f"{r['hit_rate']:.3f}",
                f"{r['read']:.2f}",
                f"{r['kb']:.1f}",
                f"{r['kl']:.2g}",
                f"{r['dnll']:+.4f}",
                "-" if same is None else f"{same:.2g}",
            ]
        )
    body.append(
        [
            "routed experts zeroed (kimi_k3.eval's ablation)",
            "0",
            "1",
            "-",
            "-",
            "0",
            f"{ablation[0]:.2g}",
            f"{ablation[1]:+.4f}",
            "-",
        ]
    )
    head = [
        "setting",
        "experts kept / token and layer",
        "weight dropped / token and layer",
        "hit rate",
        "experts read / token",
        "KB read / token",
        "KL from exact (nats/token)",
        "NLL change (nats/token)",
        "top-p KL at the same KB",
    ]
    return (
        f"Shedding misses against top-p trimming: {slots} slots a layer ({slots / E:.0%} of "
        f"the experts), {len(wins)} held-out windows of {args.shed_seq} tokens, prefill "
        f"{args.prompt}, {decoded} decoded tokens, fp32.\n\n" + markdown_table(head, body)
    )


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True)
        return head.stdout.decode().strip() or "unknown"
    except OSError:
        return "unknown"


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_trim", description=__doc__)
    p.add_argument("--quick", action="store_true", help="four settings, few tokens (CI)")
    p.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored")
    p.add_argument("--seq", type=int, default=256, help="tokens per held-out window")
    p.add_argument("--batch", type=int, default=4, help="windows per forward pass")
    p.add_argument("--prompt", type=int, default=32, help="prefill tokens before decoding")
    p.add_argument("--steps", type=int, default=64, help="decode steps per timed run")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument(
        "--cache-fraction", type=float, default=0.25, help="expert cache, share of expert bytes"
    )
    p.add_argument("--shed-slots", type=int, default=16, help="shed section: slots a layer")
    p.add_argument("--shed-windows", type=int, default=6, help="shed section: windows")
    p.add_argument("--shed-seq", type=int, default=160, help="shed section: tokens a window")
    p.add_argument(
        "--sections", default="trim,shed", help="comma-separated: trim, shed (default both)"
    )
    p.add_argument("--out", type=Path, help="write the markdown here")
    p.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    return p


def main(argv: list[str] | None = None) -> str:
    a = setup_arg_parser().parse_args(argv)
    sections = a.sections.split(",")
    if not sections or set(sections) - set(SECTIONS):
        raise SystemExit(f"error: --sections {a.sections!r}: expected names from trim, shed")
    settings = SETTINGS
    if a.quick:
        settings, a.tokens, a.seq, a.steps, a.rounds, a.prompt = QUICK, 32, 32, 4, 1, 4
        a.shed_windows, a.shed_seq = 1, 12
    if "trim" not in sections:
        return _shed_only(a, argv)
    load_before = os.getloadavg()
    path = default_model.ensure_default_model()
    ids = heldout_ids(path)
    model = load_model(path, dtype=mx.float32)
    top_k = model.args.num_experts_per_token
    q, scored = quality(model, windows(ids, a.seq, a.tokens), settings, a.batch)
    gb = a.cache_fraction * default_model.expert_bytes(path) / 1e9
    streamed = load_model(path, dtype=mx.float32, expert_cache_gb=gb)
    runs = speed(streamed, settings, ids, a.prompt, a.steps, a.rounds)
    info = get_stats(streamed)
    pick = recommend(settings, q)
    head = (
        f"`python -m benchmarks.bench_trim{' ' + ' '.join(argv or sys.argv[1:])}` at commit "
        f"{commit()}; {timing.environment()}; load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after.\n\n"
        f"Trained default model: {info['layers']} MoE layers, top-{top_k} of "
        f"{model.args.num_experts}, {info['expert_bytes']:,} bytes an expert. Quality: "
        f"{scored} held-out tokens in windows of {a.seq}, fp32. Decode: cache "
        f"{info['slots_per_layer']} slots a layer ({a.cache_fraction:.0%} of the experts), "
        f"{'direct' if runs[settings[0]][0]['direct_io'] else 'buffered'} reads, prefill "
        f"{a.prompt} then {a.steps} steps, {a.rounds} interleaved rounds.\n"
    )
    rec = "none within the budget" if pick is None else f"`{pick.label}`"
    text = (
        head
        + "\n"
        + table(settings, q, runs, info["expert_bytes"], info["layers"], top_k)
        + "\nExperts kept per token, by MoE layer:\n\n"
        + layer_table(settings, q)
        + "\nThe untrimmed router's weights over its choices (all MoE layers), by rank:\n\n"
        + profile_table(q[settings[0]]["profile"])
        + f"\nRecommended (fewest experts with an NLL cost <= {NLL_BUDGET} nats): {rec}\n"
    )
    if "shed" in sections:
        text += "\n" + shed_section(a)
    timing.emit(text, a.out)
    if a.plot:
        plot(settings, q, runs, top_k, a.plot)
    return text


def _shed_only(a, argv) -> str:
    load_before = os.getloadavg()
    body = shed_section(a)
    text = (
        f"`python -m benchmarks.bench_trim{' ' + ' '.join(argv or sys.argv[1:])}` at commit "
        f"{commit()}; {timing.environment()}; load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after.\n\n" + body
    )
    timing.emit(text, a.out)
    return text


if __name__ == "__main__":
    main()
