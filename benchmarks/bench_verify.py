"""What checking checksums costs the expert streamer: read GB/s and decode tokens/s with and
without verification, measured in one run (rounds interleaved, medians reported).

    python -m benchmarks.bench_verify [--quick] [--layout shards|pack]

A synthetic checkpoint (the ``small`` preset, experts resized by ``--expert-dim``) is
written to a temporary directory. Reads: every expert of every MoE layer read into an
empty cache that holds them all. Decode: greedy steps on a cache of top-k slots per layer,
so most experts are read again each step. Once written, the files sit in the page cache:
the reads are memory-bound, the worst case for the checks' share of the time.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks import timing
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.cli import markdown_table
from kimi_k3.convert.synth import write_checkpoint
from kimi_k3.model.config import ModelArgs
from kimi_k3.streaming import clear_cache
from kimi_k3.streaming.sources import expert_bytes, expert_shapes
from kimi_k3.streaming.store import find_streamer


def make_checkpoint(out: Path, layout: str, expert_dim: int, experts: int) -> Path:
    """The ``small`` preset with ``experts`` experts of width ``expert_dim``; with ``layout``
    ``"pack"``, converted (dense kept bf16, experts in an expert pack)."""
    src = write_checkpoint(
        out / "published",
        "small",
        num_experts=experts,
        moe_intermediate_size=expert_dim,
        routed_expert_hidden_size=expert_dim,
    )
    if layout == "shards":
        return src
    from kimi_k3.convert.convert import Settings, convert

    convert(src, out / "pack", Settings(dense_bits=16), stream=io.StringIO())
    return out / "pack"


def read_gbps(model) -> float:
    """Every expert of every MoE layer into the emptied cache; GB/s over the wall time."""
    streamer = find_streamer(model)
    clear_cache(model)
    everyone = np.arange(streamer.num_experts)
    t0 = time.perf_counter()
    for layer in streamer.order:
        streamer.preload(layer, everyone)
    seconds = time.perf_counter() - t0
    per = expert_bytes(expert_shapes(model.args))
    return len(streamer.order) * len(everyone) * per / seconds / 1e9


def decode_tps(model, tokens: int) -> float:
    """Greedy decode steps after an 8-token prompt, from an emptied cache."""
    clear_cache(model)
    cache = model.make_cache()
    prompt = mx.array(np.random.default_rng(0).integers(0, 1000, (1, 8)))
    y = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(tokens):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    return tokens / (time.perf_counter() - t0)


def measure(path: Path, rounds: int, tokens: int) -> dict:
    """``{(what, verify): [values per round]}``, the two settings alternating in each round."""
    args = ModelArgs.from_path(path)
    layers = args.num_hidden_layers - args.first_k_dense_replace
    per = expert_bytes(expert_shapes(args))
    all_gb = layers * args.num_experts * per / 1e9
    top_k_gb = layers * args.num_experts_per_token * per / 1e9
    models = {
        (what, verify): load_model(path, expert_cache_gb=gb, verify_checksums=verify)
        for what, gb in (("read", all_gb), ("decode", top_k_gb))
        for verify in (False, True)
    }
    out = {key: [] for key in models}
    for _ in range(rounds):
        for verify in (False, True):
            out[("read", verify)].append(read_gbps(models[("read", verify)]))
            out[("decode", verify)].append(decode_tps(models[("decode", verify)], tokens))
    return out


def table(results: dict) -> str:
    rows = []
    for what, unit in (("read", "GB/s"), ("decode", "tokens/s")):
        off = statistics.median(results[(what, False)])
        on = statistics.median(results[(what, True)])
        rows.append([f"{what} {unit}", f"{off:.3g}", f"{on:.3g}", f"{100 * (on / off - 1):+.1f}%"])
    header = ["", "without verification", "with verification", "change"]
    return markdown_table(header, rows)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_verify", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small experts, few rounds (CI)")
    p.add_argument("--layout", choices=("shards", "pack"), default="shards")
    p.add_argument("--expert-dim", type=int, default=1024, help="moe and latent width")
    p.add_argument("--experts", type=int, default=32, help="experts per MoE layer")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32, help="decode steps per round")
    p.add_argument("--out", help="write the markdown table here")
    return p


def main(argv: list[str] | None = None) -> int:
    a = setup_arg_parser().parse_args(argv)
    if a.quick:
        a.expert_dim, a.experts, a.rounds, a.tokens = 256, 16, 2, 4
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp), a.layout, a.expert_dim, a.experts)
        results = measure(path, a.rounds, a.tokens)
    head = (
        f"{a.layout}: {a.experts} experts of width {a.expert_dim} per MoE layer, "
        f"{a.rounds} rounds (medians); {timing.environment()}"
    )
    timing.emit(head + "\n\n" + table(results), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
