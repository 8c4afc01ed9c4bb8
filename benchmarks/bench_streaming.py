"""Expert streaming: read efficiency against the raw drive, the path into MLX, hit rate and
decode tokens/s against cache size (LRU vs LFU), prefetch and overlap on and off, and a
projection for the full K3.

    python -m benchmarks.bench_streaming --out bench_streaming.md --plot docs/streaming_cache.png
    python -m benchmarks.bench_streaming --quick --work /tmp/bs_quick   # small sizes: seconds

About 20 minutes on a 2-core VM. Writes two synthetic checkpoints under ``--work`` (kept for
reruns): ``k3-experts``, two MoE layers of 64 experts at K3's exact expert size (17,547,264
bytes; 2.25 GB of experts), for the read tests; ``sweep``, five MoE layers with K3's routing
shape (896 experts, top-16) and experts scaled down 42x (0.42 MB), for the cache tests.
``--quick`` runs every section once on small experts (64 of 256 x 256 for the reads, 64 of
64 x 64 for the cache), two thread counts and two cache sizes: a smoke run, not a
measurement. The page cache is dropped before every disk run when the process may (root on
Linux); direct reads bypass it anyway.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
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
from kimi_k3.config import ModelArgs
from kimi_k3.convert.synth import write_checkpoint
from kimi_k3.loader import load_model
from kimi_k3.streaming import get_stats, reset_stats
from kimi_k3.streaming.sources import expert_bytes, expert_layout
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
K3_TOKEN_GB = 92 * 16 * 17_547_264 / 1e9  # routed-expert bytes one decoded token touches
K3_EXPERTS_GB = 92 * 896 * 17_547_264 / 1e9


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


def _aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


def _open_direct(file: Path) -> int:
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    return os.open(file, flags)


def raw_read(files: list[Path], threads: int, block: int = 16 << 20) -> float:
    """GB/s reading ``files`` front to back in ``block``-byte direct reads; with several
    threads each takes the next block (a parallel sequential scan)."""
    drop_caches()
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, block)]
    lock, total = threading.Lock(), [0]

    def worker():
        buf = _aligned(block)
        fds = {f: _open_direct(f) for f in files}
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
    args = ModelArgs.from_path(path)
    layers = args.num_hidden_layers - args.first_k_dense_replace
    gb = slots * layers * expert_bytes(expert_layout(args)) / 1e9
    return load_model(path, dtype=mx.float32, expert_cache_gb=gb, **opts)


def expert_read(path: Path, pattern: str, threads: int, direct: bool, calls: int = 6) -> dict:
    """Expert reads through the streamer (no compute): ``all`` makes every expert of each
    layer resident in one call; ``decode`` makes 16 random experts resident per call (K3's
    per-layer decode need), with 16 slots so most are misses."""
    gc.collect()
    drop_caches()
    E = 64
    model = _streamed(path, E if pattern == "all" else 16, io_threads=threads, direct_io=direct)
    streamer, rng = find_streamer(model), np.random.default_rng(0)
    t0 = time.perf_counter()
    if pattern == "all":
        for layer in streamer.order:
            streamer.preload(layer, np.arange(E))
    else:
        for _ in range(calls):
            for layer in streamer.order:
                streamer.preload(layer, rng.choice(E, 16, replace=False))
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
    }


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
    layout = expert_layout(
        SimpleNamespace(routed_expert_hidden_size=3584, moe_intermediate_size=3072)
    )
    src = _aligned(expert_bytes(layout))  # stands in for a thread's aligned read buffer
    src[:] = np.random.default_rng(0).integers(0, 256, src.size, dtype=np.uint8)
    rows = []
    for mode in ("view", "mlx"):
        gc.collect()
        mx.clear_cache()
        rows.append(_slot_writes(layout, src, slots, mode))
    return rows


def decode_run(path: Path, slots: int | None, prompt: int, tokens: int, **opts) -> dict:
    """Prefill ``prompt`` random tokens, then decode ``tokens`` single-token steps fed with
    random tokens (no repetition loop of a random model inflating reuse). ``slots=None``:
    every expert resident (no streaming)."""
    gc.collect()
    drop_caches()
    model = load_model(path, dtype=mx.float32) if slots is None else _streamed(path, slots, **opts)
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
        "slots": slots,
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
    import kimi_k3.experts as ke

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


def projection(eff: float, curve: list[dict], E: int) -> list[dict]:
    """Decode tokens/s ceilings of the full K3: SSD_GBps * eff / ((1 - h) * 25.8 GB).

    Budget = RAM - dense trunk (4-bit, about 30 GB) - 16 GB (OS, KV cache, activations);
    f = budget / 1.45 TB of experts. h = f is flat routing without reuse (K3's training
    target); h_syn adds the reuse beyond f measured on the synthetic model at the nearest
    measured fraction (LRU)."""
    excess = sorted((r["slots"] / E, r["hit_rate"] - r["slots"] / E) for r in curve)
    rows = []
    for ram in (128, 256, 512):
        budget = ram - 30 - 16
        f = budget / K3_EXPERTS_GB
        near = min(excess, key=lambda p: abs(np.log(p[0] / f)))
        h_syn = min(f + max(near[1], 0.0), 1.0)
        row = {"ram": ram, "budget": budget, "f": f, "h": f, "h_syn": h_syn}
        for ssd in (7, 14):
            row[f"ceil{ssd}"] = ssd * eff / ((1 - f) * K3_TOKEN_GB)
            row[f"syn{ssd}"] = ssd * eff / ((1 - h_syn) * K3_TOKEN_GB)
        rows.append(row)
    return rows


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


def read_section(big: Path, reps: int, threads=(1, 4, 16, 32)) -> tuple[list[str], float]:
    """Raw reads of the checkpoint's files and expert reads through the streamer at each
    thread count (the efficiency is the run at 16 threads, or the most below that)."""
    files = sorted(big.glob("*.safetensors"))
    many = max(t for t in threads if t <= 16)
    runs = {
        "raw sequential (1 thread, 16 MiB direct reads)": lambda: raw_read(files, 1),
        f"raw parallel ({many} threads, 16 MiB direct reads)": lambda: raw_read(files, many),
    }

    def busy(pattern: str, t: int, direct: bool = True):
        return lambda: expert_read(big, pattern, t, direct)["busy_gbps"]

    for t in threads:
        runs[f"experts, all, {t} threads, direct"] = busy("all", t)
    runs[f"experts, all, {many} threads, buffered"] = busy("all", many, False)
    runs[f"experts, decode (16 per layer call), {many} threads, direct"] = busy("decode", many)
    # interleaved, so drift on a shared disk hits every run alike
    samples, failed = timing.interleaved(runs, reps)
    if failed:
        raise RuntimeError(f"read runs failed: {failed}")
    raw = float(np.median(samples[next(iter(runs))]))
    rows = [
        {
            "run": name,
            "gbps": float(np.median(v)),
            "range": f"{min(v):.2f}-{max(v):.2f}",
            "eff": float(np.median(v)) / raw,
        }
        for name, v in samples.items()
    ]
    eff = next(r["eff"] for r in rows if r["run"] == f"experts, all, {many} threads, direct")
    args = ModelArgs.from_path(big)
    one = expert_bytes(expert_layout(args))
    total = one * args.num_experts * (args.num_hidden_layers - args.first_k_dense_replace)
    text = [
        f"## Expert reads against the raw drive (experts of {one / 1e6:.2f} MB, one read each)",
        "",
        f"{total / 1e9:.2f} GB of experts; median of {reps} interleaved runs, page "
        "cache dropped before each. Expert GB/s = bytes / wall time with any read in "
        "flight, reads straight into the cache slots (no compute).",
        "",
        table(
            rows,
            [
                ("run", "run"),
                ("GB/s (median)", "gbps"),
                ("min-max", "range"),
                ("vs raw sequential", "eff"),
            ],
        ),
        "",
    ]
    return text, eff


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
    mb = expert_bytes(expert_layout(ModelArgs.from_path(sweep))) / 1e6
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


def projection_section(eff: float, curve: list[dict], E: int) -> list[str]:
    rows = projection(eff, curve, E)
    return [
        "## Projection: full K3 decode ceiling from the measured read efficiency",
        "",
        f"Read efficiency {eff:.2f} (experts, 16 threads, direct, vs raw sequential; "
        f"capped at 1); {K3_TOKEN_GB:.1f} GB of routed experts per token; ceiling = SSD "
        "GB/s x efficiency / ((1 - h) x 25.8). Budget = RAM - 30 GB (4-bit dense trunk) - "
        "16 GB (OS, KV cache, activations). `h (flat)` = cache fraction: K3's routing is "
        "trained flat, so this is the estimate to use; `h (synthetic)` adds the extra "
        "reuse of the random-weight model (an upper bound, not a forecast).",
        "",
        table(
            rows,
            [
                ("Mac RAM (GB)", "ram"),
                ("expert budget (GB)", "budget"),
                ("cache / experts", "f"),
                ("tok/s @ 7 GB/s", "ceil7"),
                ("tok/s @ 14 GB/s", "ceil14"),
                ("h (synthetic)", "h_syn"),
                ("tok/s @ 7 (synthetic h)", "syn7"),
                ("tok/s @ 14 (synthetic h)", "syn14"),
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
    return ap


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    reads, args.sweep, args.slots, args.switch_slots = K3_EXPERTS, SWEEP, SWEEP_SLOTS, 64
    threads, pool = (1, 4, 16, 32), 16
    if args.quick:
        reads, args.sweep, args.slots, args.switch_slots = QUICK_READS, QUICK_SWEEP, (16, 32), 32
        args.reps, args.prompt, args.tokens, threads, pool = 1, 8, 4, (1, 2), 2
    args.work.mkdir(parents=True, exist_ok=True)
    big = checkpoint(args.work, "k3-experts-quick" if args.quick else "k3-experts", reads)
    sweep = checkpoint(args.work, "sweep-quick" if args.quick else "sweep", args.sweep)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    out = [
        f"Command: `python -m benchmarks.bench_streaming {command}`",
        "",
        f"Machine: {os.cpu_count()} cores, a shared VM disk; {timing.environment()}; page "
        f"cache dropped between runs: {drop_caches()}.",
        "",
    ]
    read_text, eff = read_section(big, args.reps, threads)
    cache, curves, resident = cache_section(sweep, args)
    E = args.sweep["num_experts"]
    out += read_text + mlx_section(pool) + cache
    out += projection_section(min(eff, 1.0), curves["lru"], E)
    text = "\n".join(out)
    timing.emit(text + "\n", args.out)
    if args.plot:
        plot(curves, resident, E, args.plot)
    return text


if __name__ == "__main__":
    main()
