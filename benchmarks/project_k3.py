"""Projection of full Kimi K3 decode speed on Macs, per expert format, dropping setting and
prediction, from published K3 hit rates and from the yardstick's replayed routing.

    python -m benchmarks.project_k3 --out OUT.md
    python -m benchmarks.project_k3 --quick          # fewer prompts and tokens: seconds

The model is ``kimi_k3.projection``: decode time per token = SSD time + compute time,
less what reads ahead during compute save (prediction on). Its inputs:

- Machines: one M5 Max 128 GB, M4 Max 128 GB, M3 Ultra 512 GB, and 2 and 4 M5 Max with
  expert parallel (each caches its share of the experts). SSD and memory rates in
  ``MACHINES``, sources in docs/streaming.md.
- Expert formats: ``--format-bits`` bits a weight, scales included (MXFP4 4.25; 3.5 and 2.5
  for 3- and 2-bit affine with a 16-bit scale and bias per 64): the same experts' bytes
  scaled, so the same RAM caches more of them.
- Hit rate h at the cache fraction f, two ways side by side: the published K3 curve
  (``projection.PUBLISHED_HITS``: real K3 decode measured by TurboFieldfare, gmlx and
  colibri), and the yardstick's replay: the trained default's decode routing (sampled at
  temperature 0.6) through the shipped cache policy (``kimi_k3.streaming.simulate``).
- Settings: exact; top-p 0.5 trimming (colibri's share on K3, about 8 of 16 experts); and
  shedding misses at 0.8 and 0.65 (gmlx's working band on K3). For the published curve
  shedding follows ``projection.shed_flat`` (checked against gmlx's measured hit rates and
  dropped weight in the output); for the yardstick, its replay with shedding.
- Prediction: reads ahead fill the drive while a layer computes, at the precision and recall
  the streamer measures on the yardstick (``StreamOptions.prefetch``).
- Quality: KL from the exact model on the yardstick for each setting, streamed at a
  quarter of its experts (``bench_trim.shed_run``), beside the routed experts zeroed
  (``kimi_k3.eval``'s ablation): the yardstick's routed experts carry little, so its KL
  cannot rank these settings for K3.
- Peers: the runtimes that run real K3, their measured figures, and this model's projection
  for their configuration (their machine, bytes and hit rate) beside them.
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import numpy as np

from benchmarks import timing
from kimi_k3.cli import markdown_table
from kimi_k3.projection import (
    COLIBRI_KEPT,
    K3,
    KERNEL_EFFICIENCY,
    MXFP4_BITS,
    PUBLISHED_HITS,
    TOP_K,
    Mac,
    expert_budget_gb,
    hit_at,
    project,
    published_curve,
    shed_flat,
)

DECODE_TEMP = 0.6  # a small model's greedy output repeats itself, which inflates reuse
QUALITY_SLOTS = 16  # the yardstick's cache for the KL rows: a quarter of its experts

# SSD: M5 Max as users measured it; M4 Max and M3 Ultra taken as 7 GB/s (the M1-M4
# generation's 5-7 GB/s). Memory bandwidth as Apple states it.
M5_MAX = Mac("M5 Max 128 GB", 128, 13.5, 614)
M4_MAX = Mac("M4 Max 128 GB", 128, 7.0, 546)
M3_ULTRA = Mac("M3 Ultra 512 GB", 512, 7.0, 819)
MACHINES = ((M5_MAX, 1), (M4_MAX, 1), (M3_ULTRA, 1), (M5_MAX, 2), (M5_MAX, 4))
SHED = (0.8, 0.65)
# (label, top_p, shed_misses)
SETTINGS = (
    ("exact", 1.0, 1.0),
    ("top-p 0.5", 0.5, 1.0),
    *((f"shed misses {p:g}", 1.0, p) for p in SHED),
)

# gmlx's shedding on K3 (UD-Q2_K_XL, M5 Max 128 GB, 29-33 GB arena): (P, weight dropped,
# hit rate, tok/s); lossless first.
GMLX_SHED = ((1.0, 0.0, 0.499, 1.15), (0.8, 0.171, 0.680, 1.19), (0.7, 0.261, 0.719, 1.33),
             (0.65, 0.304, 0.742, 1.39))  # fmt: skip

# The runtimes that run real K3: (runtime, machine, n, experts, bits a weight, dense GB,
# kept share, hit rate (None: read off the published curve at the cache), cache GB,
# measured tok/s, what).
PEERS = (
    ("gmlx", M5_MAX, "UD-IQ2_XXS (662 GB)", MXFP4_BITS * 600 / 1447, 62, 1.0, None, 31, 1.34,
     "no shedding, over 30.8k tokens; cache taken as the 31 GB arena of the run below"),
    ("gmlx", M5_MAX, "UD-Q2_K_XL (861 GB)", MXFP4_BITS * 799 / 1447, 62, 1.0, 0.499, 31, 1.15,
     "lossless, 29-33 GB arena"),
    ("gmlx", M5_MAX, "UD-Q2_K_XL", MXFP4_BITS * 799 / 1447, 62, 1 - 0.304, 0.742, 31, 1.39,
     "miss-shed 0.65 (30.4% of the weight dropped; at 0.60 generated code broke)"),
    ("TurboFieldfare-K3", M5_MAX, "MXFP4", MXFP4_BITS, 32, 1.0, 22541 / 92736, 16 * 2**30 / 1e9,
     0.512, "16 GiB cache, 64 tokens greedy, prediction off"),
    ("TurboFieldfare-K3", M5_MAX, "MXFP4", MXFP4_BITS, 32, 1.0, 8790 / 92736, 8 * 2**30 / 1e9,
     0.461, "8 GiB cache"),
    ("turboquant-mlx", M4_MAX, "3-bit", 3.5, 30, 1.0, 0.533, 84.7, 0.36,
     "84.7 GB cache; bits a weight taken as 3.5"),
    ("turboquant-mlx", M3_ULTRA, "3-bit", 3.5, 30, 1.0, None, 466, 1.18,
     "cache taken as the largest budget"),
    ("turboquant-mlx", M3_ULTRA, "3-bit, top-8", 3.5, 30, 0.5, None, 466, 2.30,
     "8 of 16 experts"),
    ("colibri", M5_MAX, "MXFP4", MXFP4_BITS, 30, 1.0, None, None, 0.28, "cache not stated"),
    ("kimi-k3-in-c", None, "MXFP4", MXFP4_BITS, 30, 1.0, None, None, 1 / 5.6,
     "C on a 124-core CPU, 5.6 s a token"),
)  # fmt: skip


def measure(prompts: int, tokens: int, slot_step: int, quality_windows: int) -> dict:
    """The yardstick's inputs: decode routing replayed per setting (``curves``: setting ->
    [(f, h over kept, kept share)]), Belady's exact curve, the streamer's prediction
    precision and recall, and each setting's KL and NLL change (with the ablation)."""
    from benchmarks.bench_cache_policy import prompts as held_out_prompts
    from benchmarks.bench_prefetch import decode_run
    from benchmarks.bench_trim import reference_logprobs, shed_run
    from kimi_k3 import default_model
    from kimi_k3.checkpoint.loader import load_model
    from kimi_k3.eval import heldout_ids, windows
    from kimi_k3.model.routing import set_expert_trimming
    from kimi_k3.streaming.simulate import counts, hit_rates, record
    from kimi_k3.streaming.store import StreamOptions

    path = default_model.ensure_default_model()
    model = load_model(path)
    ps = held_out_prompts(prompts, 256)
    policy = StreamOptions().policy
    out = {"policy": policy, "curves": {}}
    traces = {}
    for top_p in (1.0, 0.5):
        set_expert_trimming(model, top_p)
        traces[top_p] = record(model, ps, 512, tokens, temp=DECODE_TEMP, seed=0)
    set_expert_trimming(model)
    trace = traces[1.0]
    slots = sorted({*range(trace.top_k, trace.num_experts, slot_step), trace.num_experts})
    out["belady"] = hit_rates(trace, "belady", slots)
    for label, top_p, shed in SETTINGS:
        t = traces[top_p]
        choices = t.top_k * len(t.layers) * sum(r.phases.count("decode") for r in t.runs)
        curve = []
        for s in slots:
            hits, misses, pairs, _ = counts(t, policy, s, shed=shed, detail=True)["decode"]
            curve.append((s / t.num_experts, hits / max(hits + misses, 1), pairs / choices))
        out["curves"][label] = curve
    ids = [int(x) for x in heldout_ids(path)]
    run = decode_run(path, QUALITY_SLOTS, ids, 32, tokens, prefetch=True, dtype=mx.float32)
    out["prediction"] = (run["precision"], run["recall"])
    wins = windows(np.array(ids), 160, quality_windows * 160)
    exact, zeroed = reference_logprobs(load_model(path, dtype=mx.float32), wins)
    gb = QUALITY_SLOTS / trace.num_experts * default_model.expert_bytes(path) / 1e9
    out["quality"] = {
        label: shed_run(path, gb, wins, exact, 32, top_p, shed) for label, top_p, shed in SETTINGS
    }
    out["ablation"] = _ablation(exact, zeroed, wins, 32)
    return out


def _ablation(exact, zeroed, wins, prompt: int) -> tuple[float, float]:
    """(KL, NLL change) per token of the routed experts zeroed, over the decoded positions."""
    from benchmarks.bench_trim import _scores

    scores = [
        _scores(r[prompt:], z[prompt:], w[prompt + 1 :])
        for r, z, w in zip(exact, zeroed, wins, strict=True)
    ]
    n = sum(len(w) - 1 - prompt for w in wins)
    return sum(a for a, _ in scores) / n, sum(b for _, b in scores) / n


def yardstick_at(curve: list[tuple[float, float, float]], f: float) -> tuple[float, float]:
    """(h over kept, kept share) of a replayed curve at cache fraction ``f`` (below its first
    point the hit rate scaled by f, ``projection.hit_at``)."""
    fs, hs, ks = np.array(curve).T
    return hit_at(list(zip(fs, hs, strict=True)), f), float(np.interp(f, fs, ks))


def published_at(setting: str, h: float) -> tuple[float, float]:
    """(h over kept, kept share) on the published curve's h for a setting."""
    if setting.startswith("shed"):
        got = shed_flat(h, float(setting.rsplit(" ", 1)[1]))
        return got["hit_rate"], got["kept"] / TOP_K
    return h, COLIBRI_KEPT if setting == "top-p 0.5" else 1.0


def rows(m: dict, bits: list[float], eff: float, kernel_eff: float) -> list[dict]:
    out = []
    pub = published_curve()
    for mac, n in MACHINES:
        for b in bits:
            sizes = K3.at_bits(b)
            f = min(1.0, expert_budget_gb(mac.ram_gb) / (sizes.experts_gb / n))
            for label, _, shed in SETTINGS:
                h_pub, kept_pub = published_at(label, hit_at(pub, f))
                h_y, kept_y = yardstick_at(m["curves"][label], f)
                for pred in (None, m["prediction"]):
                    kw = dict(sizes=sizes, prediction=pred, shed=shed < 1)
                    p = project(mac, n, h_pub, kept_pub, eff, kernel_eff, **kw)
                    y = project(mac, n, h_y, kept_y, eff, kernel_eff, **kw)
                    out.append(
                        {
                            "config": mac.name if n == 1 else f"{n} x {mac.name}, expert parallel",
                            "format": f"{b:g} bits",
                            "setting": label,
                            "prediction": "on" if pred else "off",
                            "f": f,
                            "h_pub": h_pub,
                            "h_y": h_y,
                            "kept": kept_pub,
                            "kept_y": kept_y,
                            **p,
                            "tok_s_y": y["tok_s"],
                        }
                    )
    return out


def peer_rows(eff: float, kernel_eff: float) -> list[list[str]]:
    out = []
    pub = published_curve()
    for name, mac, experts, bits, dense, kept, h, cache, tok_s, note in PEERS:
        here = "-"
        if mac is not None and cache is not None:
            sizes = K3.at_bits(bits)
            sizes = type(sizes)(**{**sizes.__dict__, "dense_gb": float(dense)})
            f = min(1.0, cache / sizes.experts_gb)
            hh = hit_at(pub, f) if h is None else h
            got = project(mac, 1, hh, kept, eff, kernel_eff, sizes=sizes)
            here = (
                f"{got['tok_s']:.2f} (h {hh:.2f}; measured / projected {tok_s / got['tok_s']:.2f})"
            )
        out.append(
            [name, mac.name if mac else "CPU", experts, f"{bits:.2f}", note, f"{tok_s:.2f}", here]
        )
    return out


def _f(v: float, digits: int = 2) -> str:
    return f"{v:.{digits}f}"


def report(m: dict, args) -> str:
    bits = args.format_bits
    q, (akl, adnll) = m["quality"], m["ablation"]
    pub_rows = [[name, f"{f:.4f}", f"{h:.3f}", what] for name, f, h, what in PUBLISHED_HITS]
    check = []
    for p, dropped, h, _ in GMLX_SHED[1:]:
        got = shed_flat(GMLX_SHED[0][2], p)
        check.append([f"{p:g}", f"{dropped:.3f}", f"{got['dropped']:.3f}", f"{h:.3f}",
                      f"{got['hit_rate']:.3f}"])  # fmt: skip
    quality = [
        [label, f"{q[label]['kl']:.2g}", f"{q[label]['dnll']:+.4f}", f"{q[label]['kept'] / 4:.3f}"]
        for label, _, _ in SETTINGS
    ]
    quality.append(["routed experts zeroed (kimi_k3.eval's ablation)", f"{akl:.2g}",
                    f"{adnll:+.4f}", "0"])  # fmt: skip
    body = [
        [
            r["config"],
            r["format"],
            r["setting"],
            r["prediction"],
            _f(r["f"], 3),
            _f(r["h_pub"]),
            _f(r["h_y"]),
            f"{r['kept']:.2f} / {r['kept_y']:.2f}",
            _f(r["ssd_gb"], 1),
            _f(r["ssd_s"]),
            _f(r["compute_s"]),
            _f(r["saved_s"]),
            _f(r["tok_s"]),
            _f(r["tok_s_y"]),
            _f(r["tok_s_overlap"]),
        ]
        for r in rows(m, bits, args.read_efficiency, args.kernel_efficiency)
    ]
    head = [
        "configuration",
        "experts",
        "setting",
        "prediction",
        "cache / experts",
        "h (published K3)",
        "h (yardstick replay)",
        "kept (published / yardstick)",
        "SSD GB / token",
        "SSD s",
        "compute s",
        "saved by prediction s",
        "tok/s (published h)",
        "tok/s (yardstick h)",
        "tok/s, fully overlapped",
    ]
    precision, recall = m["prediction"]
    peers = peer_rows(args.read_efficiency, args.kernel_efficiency)
    return "\n".join(
        [
            "Published K3 hit rates (exact decode), the curve's points:",
            "",
            markdown_table(["runtime", "cache / experts", "hit rate", "what"], pub_rows),
            "Shedding on the published curve (`projection.shed_flat`) against gmlx's measurement "
            "on K3 at its lossless hit rate of 0.499:",
            "",
            markdown_table(
                ["P", "weight dropped, gmlx", "model", "hit rate, gmlx", "model"], check
            ),
            f"Yardstick (the trained default), streamed at {QUALITY_SLOTS} slots of 64: quality "
            "of each setting against the exact model (decoded tokens):",
            "",
            markdown_table(
                ["setting", "KL (nats/token)", "NLL change (nats/token)", "experts kept / 4"],
                quality,
            ),
            f"Prediction on the yardstick: precision {precision:.3f}, recall {recall:.3f}. "
            f"Read efficiency {args.read_efficiency:g}; kernels at {args.kernel_efficiency:g} "
            f"of the memory bandwidth; cache policy {m['policy']}.",
            "",
            markdown_table(head, body),
            "The runtimes that run real K3, measured, and this model at their configuration:",
            "",
            markdown_table(
                ["runtime", "machine", "experts", "bits / weight", "run", "tok/s measured",
                 "tok/s projected here"],
                peers,
            ),
        ]
    )  # fmt: skip


def _bits(text: str) -> list[float]:
    try:
        out = [float(b) for b in text.split(",")]
    except ValueError:
        raise SystemExit(
            f"error: --format-bits {text!r}: expected numbers, comma-separated"
        ) from None
    if not out or not all(1.0 <= b <= 16.0 for b in out):
        raise SystemExit(f"error: --format-bits {text!r}: each from 1 to 16 bits a weight")
    return out


def setup_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts traced (default 4)")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per prompt (default 64)")
    ap.add_argument(
        "--format-bits",
        default=f"{MXFP4_BITS},3.5,2.5",
        help="expert formats, bits a weight with scales (default: MXFP4 4.25, 3.5, 2.5)",
    )
    ap.add_argument(
        "--quality-windows", type=int, default=4, help="held-out windows of 160 for the KL rows"
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
        help="two short prompts, 4 decode steps, every 16th slot count, one KL window",
    )
    ap.add_argument("--out", help="also write the tables to this markdown file")
    return ap


def main(argv=None) -> str:
    args = setup_arg_parser().parse_args(argv)
    for name in ("read_efficiency", "kernel_efficiency"):
        v = getattr(args, name)
        if not 0.0 < v <= 1.0:
            raise SystemExit(f"error: --{name.replace('_', '-')} {v}: expected a share in (0, 1]")
    for name in ("tokens", "quality_windows"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1")
    args.format_bits = _bits(args.format_bits)
    if args.quick:
        args.prompts, args.tokens, args.quality_windows = 0, 4, 1
    m = measure(args.prompts, args.tokens, 16 if args.quick else 1, args.quality_windows)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    text = (
        f"Command: `python -m benchmarks.project_k3 {command}`; {timing.environment()}\n\n"
        + report(m, args)
    )
    timing.emit(text, args.out)
    return text


if __name__ == "__main__":
    main()
