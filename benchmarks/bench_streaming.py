"""Expert streaming: read efficiency against the same reads made raw, the path into MLX,
prefetch on the trained default, hit rate and decode tokens/s against cache size (LRU vs
LFU), prefetch and overlap on and off, and (``--sections formats``) the bytes a decode token
reads per expert format at the same cache size. (The projection for the full K3 is
``benchmarks/project_k3.py``.)

    python -m benchmarks.bench_streaming --out bench_streaming.md --plot docs/streaming_cache.png
    python -m benchmarks.bench_streaming --sections formats --out formats.md
    python -m benchmarks.bench_streaming --quick --work /tmp/bs_quick   # small sizes: seconds

About 20 minutes on a 2-core VM. Writes two synthetic checkpoints under ``--work`` (kept for
reruns): ``k3-experts``, two MoE layers of 64 experts at K3's exact expert size (17,547,264
bytes; 2.25 GB of experts), for the read tests; ``sweep``, five MoE layers with K3's routing
shape (896 experts, top-16) and experts scaled down 42x (0.42 MB), for the cache tests; the
formats section converts ``sweep`` into expert packs at 4, 3 and 2 bits (``sweep-pack4`` ...;
requantizing takes a few minutes the first time).
``--quick`` runs every section once on small experts (64 of 256 x 256 for the reads, 64 of
64 x 64 for the cache), two thread counts and two cache sizes: a smoke run, not a
measurement. The page cache is dropped before every disk run when the process may (root on
Linux); direct reads bypass it anyway.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from benchmarks import timing
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.convert.convert import Settings, convert
from kimi_k3.convert.synth import write_checkpoint
from kimi_k3.model.config import ModelArgs
from kimi_k3.model.experts import FORMATS
from kimi_k3.streaming import get_stats, readrate, reset_stats
from kimi_k3.streaming.io import STAGES, open_file
from kimi_k3.streaming.readrate import aligned_buffer
from kimi_k3.streaming.sources import expert_bytes, expert_shapes, open_source
from kimi_k3.streaming.store import SlotPool, find_streamer

K3_EXPERTS = dict(
    num_hidden_layers=3,
    full=(3,),
    num_experts=64,
    num_experts_per_token=16,
    routed_expert_hidden_size=3584,
    moe_intermediate_size=3072,
)
SWEEP = dict(
    num_experts=896,
    num_experts_per_token=16,
    routed_expert_hidden_size=512,
    moe_intermediate_size=512,
)
SWEEP_SLOTS = (16, 32, 64, 128, 224)  # 1/56 of the experts (the top-k floor) .. 1/4
QUICK_READS = dict(K3_EXPERTS, routed_expert_hidden_size=256, moe_intermediate_size=256)
QUICK_SWEEP = dict(SWEEP, num_experts=64, routed_expert_hidden_size=64, moe_intermediate_size=64)


def drop_caches() -> bool:
    """Empty the page cache (needs root on Linux); False where not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def checkpoint(work: Path, name: str, overrides: dict) -> Path:
    """A synthetic checkpoint under ``work`` (rewritten if an old one has other settings)."""
    path = work / name
    config = path / "config.json"
    if config.exists():
        text = json.loads(config.read_text())["text_config"]
        if all(text.get(k) == v for k, v in overrides.items() if k != "full"):
            return path
        shutil.rmtree(path)
    print(f"writing {path} ...", file=sys.stderr)
    write_checkpoint(path, "small", seed=1, tokenizer=False, **overrides)
    return path


def raw_read(files: list[Path], threads: int, block: int = 16 << 20) -> float:
    """GB/s reading ``files`` front to back in ``block``-byte direct reads; with several
    threads each takes the next block (a parallel sequential scan)."""
    drop_caches()
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, block)]
    lock, total = threading.Lock(), [0]

    def worker():
        buf = aligned_buffer(block)
        fds = {f: open_file(f, True)[0] for f in files}
        while True:
            with lock:
                if not jobs:
                    break
                f, off = jobs.pop(0)
            n = os.preadv(fds[f], [buf], off)
            with lock:
                total[0] += n
        for fd in fds.values():
            os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return total[0] / 1e9 / (time.perf_counter() - t0)


def _streamed(path: Path, slots: int, **opts):
    return load_model(path, dtype=mx.float32, expert_cache_gb=_budget_gb(path, slots), **opts)


def expert_read(path: Path, pattern: str, threads: int, direct: bool, calls: int = 6) -> dict:
    """Expert reads through the streamer (no compute), the calls of ``_calls``; GB/s over
    the run's wall time and the reader threads' seconds per stage."""
    gc.collect()
    drop_caches()
    E = 64
    model = _streamed(path, E if pattern == "all" else 16, io_threads=threads, direct_io=direct)
    streamer = find_streamer(model)
    plan = readrate.plan(E, streamer.order, pattern, calls)
    t0 = time.perf_counter()
    for call in plan:
        streamer.preload(call[0][0], [e for _, e in call])
    wall = time.perf_counter() - t0
    s = get_stats(model)
    return {
        "pattern": pattern,
        "threads": threads,
        "direct": s["direct_io"],
        "gb": s["bytes_read"] / 1e9,
        "busy_gbps": s["read_gbps"],
        "wall_gbps": s["bytes_read"] / 1e9 / wall,
        "reads": s["reads"],
        **{k: s[f"reader_{k}_seconds"] / wall for k in STAGES},
    }


def raw_expert_read(path: Path, pattern: str, threads: int, calls: int = 6) -> dict:
    """The same expert reads as ``expert_read`` in the same order at the same queue depth
    (``threads`` reads in flight, a call's reads by file offset, all done before the next
    call's start), as plain direct reads of each expert's byte range
    (``readrate.raw_read``). GB/s counts the experts' own bytes."""
    args = ModelArgs.from_path(path)
    layers = list(range(args.first_k_dense_replace, args.num_hidden_layers))
    source = open_source(path, None, args, layers)
    plan = readrate.plan(args.num_experts, layers, pattern, calls)
    if pattern == "decode":
        plan = readrate.misses(plan)
    gc.collect()
    drop_caches()
    return readrate.raw_read(source, plan, threads)


def _slot_writes(layout: dict, src: np.ndarray, slots: int, mode: str) -> dict:
    """Write ``src`` into every slot of a fresh pool the way the readers do; time it."""
    pool = SlotPool(layout, slots, mode)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    for s in range(slots):
        dest, pos = pool.dest(s), 0
        for d in dest.values():
            np.copyto(d, src[pos : pos + d.size])
            pos += d.size
        pool.commit(s, dest)
        mx.eval(list(pool.arrays.values()))
    dt = (time.perf_counter() - t0) / slots
    growth = max(mx.get_peak_memory() - base, 0) / 1e6  # the peak only moves on allocation
    back = [np.array(a[slots - 1]).view(np.uint8).ravel() for a in pool.arrays.values()]
    return {
        "mode": mode,
        "copies": 1 if mode == "view" else 2,
        "ms": dt * 1e3,
        "gbps": src.size / 1e9 / dt,
        "peak_growth_mb": growth,
        "bytes_ok": bool(np.array_equal(np.concatenate(back), src)),
    }


def mlx_path(slots: int = 16) -> list[dict]:
    """Cost of putting one K3 expert (17.5 MB) into each of ``slots`` cache slots, per write
    mode, and how much MLX peak memory grows beyond the pool while doing it."""
    layout = expert_shapes(
        SimpleNamespace(routed_expert_hidden_size=3584, moe_intermediate_size=3072)
    )
    src = aligned_buffer(expert_bytes(layout))  # stands in for a thread's aligned read buffer
    src[:] = np.random.default_rng(0).integers(0, 256, src.size, dtype=np.uint8)
    rows = []
    for mode in ("view", "mlx"):
        gc.collect()
        mx.clear_cache()
        rows.append(_slot_writes(layout, src, slots, mode))
    return rows


def decode_run(
    path: Path, slots: int | None, prompt: int, tokens: int, budget_gb=None, **opts
) -> dict:
    """Prefill ``prompt`` random tokens, then decode ``tokens`` single-token steps fed with
    random tokens (no repetition loop of a random model inflating reuse). ``slots=None``:
    every expert resident (no streaming); ``budget_gb``: that cache size instead of
    ``slots``' (the slots its experts' size gives)."""
    gc.collect()
    drop_caches()
    if budget_gb is not None:
        model = load_model(path, dtype=mx.float32, expert_cache_gb=budget_gb, **opts)
    elif slots is None:
        model = load_model(path, dtype=mx.float32)
    else:
        model = _streamed(path, slots, **opts)
    vocab = model.args.vocab_size - 256
    rng = np.random.default_rng(42)
    cache = model.make_cache()
    mx.eval(model(mx.array(rng.integers(0, vocab, (1, prompt))), cache=cache))
    # one untimed step first: on a GPU it compiles the decode kernels (seconds of JIT)
    mx.eval(model(mx.array([[int(rng.integers(0, vocab))]]), cache=cache))
    reset_stats(model)
    steps = rng.integers(0, vocab, tokens)
    t0 = time.perf_counter()
    for t in steps:
        mx.eval(model(mx.array([[int(t)]]), cache=cache))
    dt = time.perf_counter() - t0
    s = get_stats(model) or {}
    return {
        "slots": s.get("slots_per_layer", slots),
        "tok_s": tokens / dt,
        "hit_rate": s.get("hit_rate"),
        "mb_per_token": s.get("bytes_read", 0) / 1e6 / tokens,
        "read_gbps": s.get("read_gbps"),
        "wait_share": s.get("wait_seconds", 0) / dt,
        "prefetch_accuracy": s.get("prefetch_accuracy"),
        "prediction_recall": s.get("prediction_recall"),
        **opts,
    }


def repeated(fn, reps: int, key: str) -> dict:
    """Run ``fn`` ``reps`` times; the row of the median ``key``, with its min and max."""
    rows = sorted((fn() for _ in range(reps)), key=lambda r: r[key])
    row = dict(rows[len(rows) // 2])
    row[f"{key}_range"] = f"{rows[0][key]:.3g}-{rows[-1][key]:.3g}"
    return row


def routing_skew(path: Path, tokens: int, top: float) -> float:
    """Share of decode routing choices that go to each layer's ``top`` most used experts
    (flat routing: ``top``), from the resident model on random input tokens."""
    import kimi_k3.model.experts as ke

    model, counts, glu = load_model(path, dtype=mx.float32), [], ke.expert_glu

    def record(z, w, inds, weights, beta, cap):
        counts.append(np.bincount(np.array(inds).ravel(), minlength=w["w1"][0].shape[0]))
        return glu(z, w, inds, weights, beta, cap)

    ke.expert_glu = record
    try:
        cache = model.make_cache()
        for t in np.random.default_rng(42).integers(0, model.args.vocab_size - 256, tokens):
            mx.eval(model(mx.array([[int(t)]]), cache=cache))
    finally:
        ke.expert_glu = glu
    layers = len(model.layers) - 1  # calls come in layer order, one per MoE layer
    per_layer = np.stack([np.sum(counts[i::layers], axis=0) for i in range(layers)])
    n = max(1, round(top * per_layer.shape[1]))
    top_share = np.sort(per_layer, axis=1)[:, ::-1][:, :n].sum(axis=1) / per_layer.sum(axis=1)
    return float(top_share.mean())


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(h for h, _ in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(_fmt(r.get(k)) for _, k in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def plot(curves: dict, resident: float, E: int, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for policy, rows in curves.items():
        f = [r["slots"] / E for r in rows]
        a.plot(f, [r["hit_rate"] for r in rows], "o-", label=policy.upper())
        b.plot(f, [r["tok_s"] for r in rows], "o-", label=policy.upper())
    f = [r["slots"] / E for r in next(iter(curves.values()))]
    a.plot(f, f, "k--", label="flat routing, no reuse (h = f)")
    b.axhline(resident, color="k", ls="--", label="all experts resident")
    for ax, y in ((a, "decode hit rate"), (b, "decode tokens/s (2-core CPU)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache size / all experts")
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Synthetic Kimi K3 (random weights), 5 MoE layers x 896 experts, top-16")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def read_section(big: Path, reps: int, threads=(1, 4, 16, 32)) -> list[str]:
    """Raw reads of the checkpoint's files, and expert reads through the streamer beside
    the same reads made raw at the same queue depth (``raw_expert_read``): each streamer
    row at 16 threads (or the most below) is compared with its raw twin."""
    files = sorted(big.glob("*.safetensors"))
    many = max(t for t in threads if t <= 16)
    runs = {
        "raw sequential (1 thread, 16 MiB direct reads)": lambda: {"wall_gbps": raw_read(files, 1)},
        f"raw parallel ({many} threads, 16 MiB direct reads)": lambda: {
            "wall_gbps": raw_read(files, many)
        },
    }
    twins = {}
    for pattern, what in (("decode", "decode (16 per layer call)"), ("all", "all")):
        raw = f"raw, experts, {what}, {many} threads"
        runs[raw] = lambda p=pattern: raw_expert_read(big, p, many)
        for t in (many,) if pattern == "decode" else threads:
            name = f"streamer, experts, {what}, {t} threads, direct"
            runs[name] = lambda p=pattern, t=t: expert_read(big, p, t, True)
            if t == many:
                twins[name] = raw
    buffered = f"streamer, experts, all, {many} threads, buffered"
    runs[buffered] = lambda: expert_read(big, "all", many, False)
    twins[buffered] = f"raw, experts, all, {many} threads"
    # interleaved, so drift on a shared disk hits every run alike
    samples, failed = timing.interleaved(runs, reps)
    if failed:
        raise RuntimeError(f"read runs failed: {failed}")
    med = {n: float(np.median([r["wall_gbps"] for r in v])) for n, v in samples.items()}
    rows = []
    for name, v in samples.items():
        gbps = [r["wall_gbps"] for r in v]
        row = {"run": name, "gbps": med[name], "range": f"{min(gbps):.2f}-{max(gbps):.2f}"}
        row["eff"] = med[name] / med[twins[name]] if name in twins else None
        if "read" in v[0]:
            row["stages"] = " / ".join(f"{np.median([r[k] for r in v]):.2f}" for k in STAGES)
        rows.append(row)
    args = ModelArgs.from_path(big)
    one = expert_bytes(expert_shapes(args))
    total = one * args.num_experts * (args.num_hidden_layers - args.first_k_dense_replace)
    text = [
        f"## Expert reads against the raw drive (experts of {one / 1e6:.2f} MB, one read each)",
        "",
        f"{total / 1e9:.2f} GB of experts; median of {reps} interleaved runs, page cache "
        "dropped before each. GB/s = experts' bytes / wall time of the run. The streamer "
        "reads into the cache slots with its defaults (checksums checked, tiles where the "
        "backend's kernels read them; no compute); each `raw, experts` row makes the same "
        "reads at the same queue depth as plain direct reads into an aligned buffer, and "
        "the streamer's row beside it is compared with it. Reader seconds per wall second "
        "(summed over threads): in read calls / checking checksums / placing into slots.",
        "",
        table(
            rows,
            [
                ("run", "run"),
                ("GB/s (median)", "gbps"),
                ("min-max", "range"),
                ("vs raw, same reads and depth", "eff"),
                ("reader s/s: read / verify / place", "stages"),
            ],
        ),
        "",
    ]
    return text


def mlx_section(slots: int = 16) -> list[str]:
    rows = mlx_path(slots)
    return [
        f"## Into MLX: one K3 expert (17.5 MB) into a cache slot ({slots} slots, "
        f"{slots * 17.5e-3:.2f} GB pool)",
        "",
        "From a page-aligned buffer (where a direct read lands) into the slot the "
        "kernels read. `view`: numpy view of the MLX buffer, the one copy (what the "
        "streamer uses where MLX exposes host memory); `mlx`: `pool[slot] = mx.array(buf)` "
        "(two copies; the fallback). A cache hit copies nothing.",
        "",
        table(
            rows,
            [
                ("write mode", "mode"),
                ("copies after the read", "copies"),
                ("ms / expert", "ms"),
                ("GB/s", "gbps"),
                ("MLX peak growth beyond the pool (MB)", "peak_growth_mb"),
                ("bytes verified", "bytes_ok"),
            ],
        ),
        "",
    ]


def cache_section(sweep: Path, args) -> tuple[list[str], dict, float]:
    E = args.sweep["num_experts"]
    mb = expert_bytes(expert_shapes(ModelArgs.from_path(sweep))) / 1e6
    run = lambda slots, **o: repeated(  # noqa: E731
        lambda: decode_run(sweep, slots, args.prompt, args.tokens, **o), args.reps, "tok_s"
    )
    resident = run(None)["tok_s"]
    skew = routing_skew(sweep, args.tokens, 1 / 16)
    curves = {p: [run(s, policy=p) for s in args.slots] for p in ("lru", "lfu")}
    rows = [{**r, "policy": p, "f": r["slots"] / E} for p, rs in curves.items() for r in rs]
    text = [
        f"## Hit rate and decode tokens/s against cache size (experts "
        f"{E // max(args.slots)}x to {E // min(args.slots)}x the budget)",
        "",
        f"Five MoE layers x {E} experts of {mb:.2g} MB (top-16), fp32, {args.tokens} decode "
        f"steps after a {args.prompt}-token prefill, random input tokens; tokens/s median "
        f"of {args.reps}. All experts resident: {resident:.1f} tokens/s. Routing skew of "
        f"this random-weight model: the top 1/16 of each layer's experts take "
        f"{skew:.0%} of decode choices (flat routing: 6%), so its hit rates exceed the "
        "flat h = cache fraction that K3's balanced routing gives.",
        "",
        table(
            rows,
            [
                ("policy", "policy"),
                ("slots / layer", "slots"),
                ("cache / experts", "f"),
                ("hit rate", "hit_rate"),
                ("MB read / token", "mb_per_token"),
                ("read GB/s", "read_gbps"),
                ("time waiting on reads", "wait_share"),
                ("tokens/s", "tok_s"),
                ("tokens/s min-max", "tok_s_range"),
            ],
        ),
        "",
    ]
    slots = args.switch_slots
    switches = [
        run(slots, policy="lru", **o)
        for o in ({}, {"prefetch": True}, {"overlap": True}, {"prefetch": True, "overlap": True})
    ]
    text += [
        f"## Prefetch and overlap ({slots} slots per layer = 1/{E // slots} of the experts, LRU)",
        "",
        table(
            switches,
            [
                ("prefetch", "prefetch"),
                ("overlap", "overlap"),
                ("hit rate", "hit_rate"),
                ("MB read / token", "mb_per_token"),
                ("prediction recall", "prediction_recall"),
                ("prefetch accuracy", "prefetch_accuracy"),
                ("time waiting on reads", "wait_share"),
                ("tokens/s", "tok_s"),
                ("tokens/s min-max", "tok_s_range"),
            ],
        ),
        "",
    ]
    return text, curves, resident


def trained_run(slots: int, prompt: int, tokens: int, **opts) -> dict:
    """The trained default model, its experts streamed into ``slots`` per layer: prefill
    ``prompt`` held-out tokens, then ``tokens`` decode steps fed the text's next tokens
    (teacher forcing: real routing, the same steps in every run)."""
    import kimi_k3
    from kimi_k3.default_model import ensure_default_model
    from kimi_k3.eval import heldout_ids

    gc.collect()
    drop_caches()
    path = ensure_default_model()
    model, _ = kimi_k3.load(path, expert_cache_gb=_budget_gb(path, slots), **opts)
    ids = [int(t) for t in heldout_ids(path)[: prompt + tokens + 1]]
    cache = model.make_cache()
    mx.eval(model(mx.array(ids[:prompt])[None], cache=cache))
    mx.eval(model(mx.array([[ids[prompt]]]), cache=cache))  # untimed: compiles, warms up
    reset_stats(model)
    t0 = time.perf_counter()
    for t in ids[prompt + 1 : prompt + 1 + tokens]:
        mx.eval(model(mx.array([[t]]), cache=cache))
    dt = time.perf_counter() - t0
    s = get_stats(model)
    return {
        "slots": slots,
        "prefetch": bool(opts.get("prefetch")),
        "tok_s": tokens / dt,
        "hit_rate": s["hit_rate"],
        "kb_per_token": s["bytes_read"] / 1e3 / tokens,
        "demand_kb_per_token": (s["bytes_read"] - s["prefetch_bytes"]) / 1e3 / tokens,
        "wait_share": s["wait_seconds"] / dt,
        "prediction_recall": s["prediction_recall"],
        "prefetch_accuracy": s["prefetch_accuracy"],
    }


def _budget_gb(path: Path, slots: int) -> float:
    """The budget that gives every MoE layer of ``path`` ``slots`` slots."""
    args = ModelArgs.from_path(path)
    layers = args.num_hidden_layers - args.first_k_dense_replace
    return slots * layers * expert_bytes(expert_shapes(args)) / 1e9


def trained_section(args) -> list[str]:
    """Prefetch off and on, on the trained default's routing, at two cache sizes; runs
    interleaved, medians of ``args.reps``."""
    from kimi_k3.default_model import ensure_default_model

    margs = ModelArgs.from_path(ensure_default_model())
    E, k = margs.num_experts, margs.num_experts_per_token
    runs = {
        (slots, pf): (lambda s=slots, p=pf: trained_run(s, args.prompt, args.tokens, prefetch=p))
        for slots in (k, E // 4)
        for pf in (False, True)
    }
    samples, failed = timing.interleaved(runs, args.reps)
    if failed:
        raise RuntimeError(f"trained-model runs failed: {failed}")
    rows = []
    for v in samples.values():
        row = dict(sorted(v, key=lambda r: r["tok_s"])[len(v) // 2])
        row["tok_s_range"] = f"{min(r['tok_s'] for r in v):.3g}-{max(r['tok_s'] for r in v):.3g}"
        row["f"] = row["slots"] / E
        rows.append(row)
    kb = expert_bytes(expert_shapes(margs)) / 1e3
    return [
        f"## Prefetch on the trained default ({E} experts of {kb:.1f} KB, top-{k})",
        "",
        f"`kimi_k3/default` in its own dtype, experts streamed; a {args.prompt}-token "
        f"held-out prefill, then {args.tokens} decode steps fed the held-out text's next "
        f"tokens; tokens/s median of {args.reps} interleaved runs. KB read / token counts "
        "demand reads and reads ahead; demand KB / token the demand reads alone.",
        "",
        table(
            rows,
            [
                ("slots / layer", "slots"),
                ("cache / experts", "f"),
                ("prefetch", "prefetch"),
                ("hit rate", "hit_rate"),
                ("KB read / token", "kb_per_token"),
                ("demand KB / token", "demand_kb_per_token"),
                ("prediction recall", "prediction_recall"),
                ("prefetch accuracy", "prefetch_accuracy"),
                ("time waiting on reads", "wait_share"),
                ("tokens/s", "tok_s"),
                ("tokens/s min-max", "tok_s_range"),
            ],
        ),
        "",
    ]


def format_packs(work: Path, sweep: Path) -> dict[int, Path]:
    """``sweep`` converted into an expert pack per ``--expert-bits`` (dense weights kept),
    under ``work`` (a finished conversion is kept; the converter checks it is the same)."""
    out = {}
    for bits in sorted(FORMATS, reverse=True):
        out[bits] = work / f"{sweep.name}-pack{bits}"
        settings = Settings(dense_bits=16, expert_bits=bits)
        convert(sweep, out[bits], settings, workers=os.cpu_count() or 1)
    return out


def formats_section(work: Path, sweep: Path, args) -> list[str]:
    """Decode at the same cache sizes (the budgets that give MXFP4 ``args.format_slots``
    slots a layer) with the experts in each format: the smaller the experts, the more
    slots the budget buys; the bytes a token reads follow from both."""
    packs = format_packs(work, sweep)
    margs = ModelArgs.from_path(packs[4])
    E = margs.num_experts
    rows = []
    for slots in args.format_slots:
        gb = _budget_gb(packs[4], slots)
        base = None
        for bits, path in packs.items():
            row = repeated(
                lambda p=path, g=gb: decode_run(p, None, args.prompt, args.tokens, budget_gb=g),
                args.reps,
                "tok_s",
            )
            one = expert_bytes(expert_shapes(ModelArgs.from_path(path)))
            base = base or row["mb_per_token"]
            rows.append(
                {
                    **row,
                    "gb": gb,
                    "format": str(FORMATS[bits]),
                    "kb": one / 1e3,
                    "f": row["slots"] / E,
                    "vs": row["mb_per_token"] / base,
                }
            )
    mb = expert_bytes(expert_shapes(margs)) / 1e6
    sizes = [expert_bytes(expert_shapes(ModelArgs.from_path(p))) for p in packs.values()]
    pages = (
        "whole pages in every format, as K3's are, so the disk reads these bytes"
        if all(n % 4096 == 0 for n in sizes)
        else "not whole pages here: a direct read rounds each up to 4 KB pages"
    )
    return [
        "## Bytes read per decode token by expert format, at the same cache size",
        "",
        f"The sweep model's experts ({E} of {mb:.2g} MB in MXFP4, top-"
        f"{margs.num_experts_per_token}, five MoE layers) in expert packs at each "
        "`--expert-bits`, dense weights kept; per cache size (GB, the budgets that give "
        f"MXFP4 {', '.join(map(str, args.format_slots))} slots a layer) {args.tokens} decode "
        f"steps after a {args.prompt}-token prefill, random input tokens, LFU; medians of "
        f"{args.reps}. MB read / token counts the experts' bytes read (the records are {pages}); "
        "the last column divides it by MXFP4's at the same cache size.",
        "",
        table(
            rows,
            [
                ("cache GB", "gb"),
                ("experts", "format"),
                ("KB / expert", "kb"),
                ("slots / layer", "slots"),
                ("cache / experts", "f"),
                ("hit rate", "hit_rate"),
                ("MB read / token", "mb_per_token"),
                ("vs MXFP4", "vs"),
                ("tokens/s", "tok_s"),
                ("tokens/s min-max", "tok_s_range"),
            ],
        ),
        "",
    ]


def setup_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/kimi_k3_bench_streaming"))
    ap.add_argument("--out", type=Path, help="write the markdown tables here")
    ap.add_argument("--plot", type=Path, help="write the cache-size plot (PNG) here")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per cache run")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (medians reported)")
    ap.add_argument("--quick", action="store_true", help="small experts, every section once")
    ap.add_argument(
        "--sections",
        default="reads,mlx,trained,cache",
        help="comma-separated sections to run: reads, mlx, trained, cache, formats "
        "(default: all but formats)",
    )
    return ap


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    reads, args.sweep, args.slots, args.switch_slots = K3_EXPERTS, SWEEP, SWEEP_SLOTS, 64
    threads, pool, args.format_slots = (1, 4, 16, 32), 16, (16, 64)
    if args.quick:
        reads, args.sweep, args.slots, args.switch_slots = QUICK_READS, QUICK_SWEEP, (16, 32), 32
        args.reps, args.prompt, args.tokens, threads, pool = 1, 8, 4, (1, 2), 2
        args.format_slots = (16,)
    sections = set(args.sections.split(","))
    if not sections or sections - {"reads", "mlx", "trained", "cache", "formats"}:
        raise SystemExit(
            f"error: --sections {args.sections!r}: expected names from reads, mlx, trained, "
            "cache, formats"
        )
    args.work.mkdir(parents=True, exist_ok=True)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    out = [
        f"Command: `python -m benchmarks.bench_streaming {command}`",
        "",
        f"Machine: {os.cpu_count()} cores, a shared VM disk; {timing.environment()}; page "
        f"cache dropped between runs: {drop_caches()}.",
        "",
    ]
    if "reads" in sections:
        big = checkpoint(args.work, "k3-experts-quick" if args.quick else "k3-experts", reads)
        out += read_section(big, args.reps, threads)
    if "mlx" in sections:
        out += mlx_section(pool)
    if "trained" in sections:
        out += trained_section(args)
    if "cache" in sections:
        sweep = checkpoint(args.work, "sweep-quick" if args.quick else "sweep", args.sweep)
        cache, curves, resident = cache_section(sweep, args)
        E = args.sweep["num_experts"]
        out += cache
        if args.plot:
            plot(curves, resident, E, args.plot)
    if "formats" in sections:
        sweep = checkpoint(args.work, "sweep-quick" if args.quick else "sweep", args.sweep)
        out += formats_section(args.work, sweep, args)
    text = "\n".join(out)
    timing.emit(text + "\n", args.out)
    return text


if __name__ == "__main__":
    main()
