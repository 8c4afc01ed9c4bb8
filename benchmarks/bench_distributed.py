"""Expert parallel streaming on 1, 2 and 4 ranks of one machine, with the same expert cache
budget per rank: decode tokens/s, bytes read per rank, hit rate; and the time of one
all-sum of a [1, 7168] activation (what an MoE layer adds per decoded token).

    python -m benchmarks.bench_distributed [--quick] [--ranks 1 2 4] [--out FILE]

A synthetic checkpoint (the ``small`` preset with K3-size experts, 17.5 MB each, unless
``--quick``) is written to a temporary directory; each rank count runs under
``mlx.launch --backend ring`` on localhost (one process for 1), rank 0 reporting every
rank's counters (``kimi_k3.distributed.gather_stats``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from benchmarks import timing
from kimi_k3.cli import markdown_table

K3_EXPERT = {"moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584}
QUICK_EXPERT = {"moe_intermediate_size": 128, "routed_expert_hidden_size": 128}


def decode(model, tokens: int) -> float:
    """Greedy decode tokens/s after an 8-token prompt (the prompt is not timed)."""
    cache = model.make_cache()
    y = mx.argmax(model(mx.array([[3, 14, 15, 92, 65, 35, 89, 79]]), cache)[:, -1], axis=-1)
    mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(tokens):
        y = mx.argmax(model(y[:, None], cache)[:, -1], axis=-1)
        mx.eval(y)
    return tokens / (time.perf_counter() - t0)


def all_sum_seconds(group, repeats: int = 50) -> float:
    x = mx.ones((1, 7168), mx.float32)
    return timing.median_time(lambda: mx.eval(mx.distributed.all_sum(x, group=group)), repeats)


def worker(ckpt: str, out: str, gb: float, tokens: int, distributed: bool) -> None:
    """One rank: load with the experts split over the launch's ranks, decode, report."""
    import kimi_k3
    from kimi_k3 import distributed as dist
    from kimi_k3.streaming import reset_stats

    group = dist.init_group("ring", 120) if distributed else None
    model, _ = kimi_k3.load(
        ckpt, dtype=mx.float32, expert_cache_gb=gb, expert_group=group, verify_checksums=False
    )
    decode(model, 2)  # warm the kernels and the cache
    reset_stats(model)
    tps = decode(model, tokens)
    if group is None:
        from kimi_k3.streaming import get_stats

        s = get_stats(model)
        ranks = [{k: s[k] for k in ("hits", "misses", "bytes_read", "read_seconds")}]
        ranks[0]["hit_rate"] = s["hit_rate"]
        reduce = None
    else:
        ranks = dist.gather_stats(model)
        reduce = all_sum_seconds(group)
    if group is None or group.rank() == 0:
        Path(out).write_text(json.dumps({"tps": tps, "ranks": ranks, "all_sum": reduce}))


def run(n: int, ckpt: Path, tmp: Path, gb: float, tokens: int) -> dict:
    out = tmp / f"ranks{n}.json"
    args = [str(ckpt), str(out), str(gb), str(tokens)]
    if n == 1:
        cmd = [sys.executable, "-m", "benchmarks.bench_distributed", "--worker", *args]
    else:
        launch = str(Path(sys.executable).with_name("mlx.launch"))
        from kimi_k3.distributed import free_ports

        cmd = [launch, "-n", str(n), "--backend", "ring", "--python", sys.executable]
        cmd += ["--starting-port", str(free_ports(n))]
        cmd += ["-m", "benchmarks.bench_distributed", "--worker", *args, "--group"]
    subprocess.run(cmd, check=True, timeout=1800, cwd=Path(__file__).parent.parent)
    return json.loads(out.read_text())


def table(results: dict) -> str:
    rows = []
    for n, r in results.items():
        ranks = r["ranks"]
        gb = [d["bytes_read"] / 1e9 for d in ranks]
        hits = sum(d["hits"] for d in ranks) / max(sum(d["hits"] + d["misses"] for d in ranks), 1)
        reduce = "" if r["all_sum"] is None else f"{r['all_sum'] * 1e6:.0f}"
        rows.append(
            [n, f"{r['tps']:.2f}", " / ".join(f"{g:.2f}" for g in gb), f"{hits:.1%}", reduce]
        )
    header = ["ranks", "decode tokens/s", "GB read per rank", "hit rate", "all-sum [1, 7168] us"]
    return markdown_table(header, rows)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_distributed", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small experts, few tokens (CI)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--experts", type=int, default=16, help="experts per MoE layer")
    p.add_argument(
        "--expert-dim", type=int, default=None, help="moe and latent width (default: K3's)"
    )
    p.add_argument("--tokens", type=int, default=16, help="decode steps timed")
    p.add_argument("--budget-experts", type=int, default=6, help="cache slots per layer per rank")
    p.add_argument("--out", help="write the markdown table here")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--group", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    a = setup_arg_parser().parse_args(argv)
    if a.worker:
        ckpt, out, gb, tokens = a.worker
        worker(ckpt, out, float(gb), int(tokens), a.group)
        return 0
    from kimi_k3.convert.synth import write_checkpoint
    from kimi_k3.model.config import ModelArgs
    from kimi_k3.streaming.sources import expert_bytes, expert_shapes

    dims = QUICK_EXPERT if a.quick else K3_EXPERT
    if a.expert_dim:
        dims = {k: a.expert_dim for k in K3_EXPERT}
    tokens = 3 if a.quick else a.tokens
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = write_checkpoint(tmp / "ckpt", "small", num_experts=a.experts, **dims)
        args = ModelArgs.from_path(ckpt)
        layers = args.num_hidden_layers - args.first_k_dense_replace
        per = expert_bytes(expert_shapes(args))
        gb = layers * a.budget_experts * per / 1e9
        results = {n: run(n, ckpt, tmp, gb, tokens) for n in a.ranks}
        setup = (
            f"{a.experts} experts of {per / 1e6:.2f} MB per MoE layer ({layers} layers), "
            f"top-{args.num_experts_per_token}; {a.budget_experts} slots per layer per rank "
            f"({gb:.2f} GB); {tokens} greedy decode steps"
        )
    timing.emit(f"`small` preset, {setup}; {timing.environment()}\n\n{table(results)}", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
