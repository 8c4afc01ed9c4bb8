"""The command-line plumbing ``python -m kimi_k3.generate`` and ``python -m kimi_k3.server``
share: their error types and exit statuses, the argparse parser and its common flags with
their checks, and loading a checkpoint with progress on stderr (``resolve_model``,
``load_for_cli``)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

import kimi_k3
from kimi_k3 import default_model, distributed
from kimi_k3.checkpoint.expert_pack import PACK_DIR
from kimi_k3.checkpoint.files import CheckpointIndex
from kimi_k3.convert.synth import SYNTHETIC_KEY
from kimi_k3.model import routing
from kimi_k3.model.config import ConfigError, ModelArgs
from kimi_k3.model.experts import ROUTED_EXPERT_NAME
from kimi_k3.streaming.cache import GB, available_memory, default_cache_gb, slots_per_layer
from kimi_k3.streaming.sources import expert_bytes, expert_shapes

RESERVE_GB = 4.0  # memory left for the OS, activations and KV caches
INTERRUPTED = 130
SYNTHETIC_NOTICE = (
    "kimi_k3: {path} is a synthetic checkpoint: its weights are random, so its output is gibberish"
)


USAGE_ERROR = 2
TRIM_FLAGS = ("--expert-top-p", "--expert-min-weight")
SHED_FLAG = "--shed-misses"


class UserError(Exception):
    """Bad input the user can fix; printed as one ``error:`` line."""


class ArgumentError(UserError):
    """An invalid command-line value; exit status ``USAGE_ERROR``."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one ``error:`` line and exit status 2 (no usage dump)."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help, unless the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def add_model_arguments(p: argparse.ArgumentParser):
    """``--model``, ``--expert-cache-gb`` and ``--verify`` (the CLI and the server)."""
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint directory: the published layout, the converter's, or an "
        "mlx-lm converted one (default: the built-in demo model, trained on Python source)",
    )
    p.add_argument(
        "--expert-cache-gb",
        type=float,
        default=None,
        help="stream routed experts from disk into a cache of this many GB "
        "(default: experts resident if the whole checkpoint fits in memory, "
        "else a cache sized from free memory; the demo model caches 25%% of "
        "its experts)",
    )
    add_verify_argument(p)
    add_trimming_arguments(p)


def add_trimming_arguments(p: argparse.ArgumentParser):
    """``--expert-top-p`` and ``--expert-min-weight`` (``kimi_k3.model.routing``)."""
    p.add_argument(
        "--expert-top-p",
        type=float,
        default=1.0,
        help="per token, keep routed experts in decreasing router weight (renormalised over "
        "the top-k) until the kept weights reach this share; 1 keeps all "
        "(docs/streaming.md, Expert trimming)",
    )
    p.add_argument(
        "--expert-min-weight",
        type=float,
        default=0.0,
        help="per token, drop routed experts whose renormalised router weight is below "
        "this; 0 drops none (the heaviest is always kept)",
    )
    p.add_argument(
        SHED_FLAG,
        type=float,
        default=1.0,
        metavar="P",
        help="streamed experts: per token, keep the chosen experts that are cached and drop "
        "uncached ones, lightest first, while the renormalised router weight kept stays at "
        "least P (0 to 1; the heaviest is always kept); 1 drops none "
        "(docs/streaming.md, Shedding misses)",
    )


def add_sampling_arguments(p: argparse.ArgumentParser, seed: bool = True, defaults_for=None):
    """``--temp``, ``--top-p``, ``--top-k``, ``--min-p`` (and ``--seed``)."""
    what = f"; {defaults_for}" if defaults_for else ""
    p.add_argument("--temp", type=float, default=0.0, help=f"sampling temperature, 0 greedy{what}")
    p.add_argument("--top-p", type=float, default=1.0, help=f"nucleus sampling mass, 1 off{what}")
    p.add_argument("--top-k", type=int, default=0, help=f"sample from the k likeliest, 0 off{what}")
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help=f"drop tokens below min-p x the top one, 0 off{what}",
    )
    if seed:
        p.add_argument("--seed", type=int, default=None, help="seed MLX's random generator")


def add_verify_argument(p: argparse.ArgumentParser):
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check every weight and every streamed expert read from disk against its "
        "crc32 (recorded once at the first load, docs/checkpoints.md); "
        "--no-verify reads without checking",
    )


def positive(args, name: str):
    """``ArgumentError`` unless ``args.<name>`` is None or at least 1."""
    value = getattr(args, name)
    if value is not None and value < 1:
        raise ArgumentError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def in_range(args, name: str, low: float, high: float = math.inf, low_open: bool = False):
    """``ArgumentError`` unless ``args.<name>`` is None or a finite number from ``low``
    (above it, with ``low_open``) to ``high``."""
    value = getattr(args, name)
    if value is None:
        return
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bounds = f"{'above' if low_open else 'at least'} {low}" + (
            f" and at most {high}" if math.isfinite(high) else ""
        )
        raise ArgumentError(f"--{name.replace('_', '-')} must be {bounds}, got {value}")


def check_model_arguments(args):
    gb = args.expert_cache_gb
    if gb is not None and not (math.isfinite(gb) and gb > 0):
        raise ArgumentError(f"--expert-cache-gb must be a positive number of GB, got {gb}")
    try:
        routing.check(args.expert_top_p, args.expert_min_weight, TRIM_FLAGS)
        routing.check_shed(args.shed_misses, SHED_FLAG)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    check_split(args)


def check_split(args):
    """``ArgumentError`` naming ``--split`` when a launcher started several ranks and no
    split is chosen: each rank would load and run a whole copy of the model on its own."""
    ranks = distributed.launched_ranks()
    if args.split is None and ranks > 1:
        choices = ", ".join(distributed.SPLITS)
        raise ArgumentError(
            f"this process is one of {ranks} ranks started by a launcher (mlx.launch or "
            f"mpirun), but --split is not given, so every rank would run its own copy of "
            f"the model: give --split ({choices}), or run one process"
        )


def trimming_options(args) -> dict:
    """``kimi_k3.load``'s trimming and shedding arguments from ``--expert-top-p``,
    ``--expert-min-weight`` and ``--shed-misses``."""
    return {
        "expert_top_p": args.expert_top_p,
        "expert_min_weight": args.expert_min_weight,
        "shed_misses": args.shed_misses,
    }


def check_sampling_arguments(args):
    in_range(args, "temp", 0, math.inf)
    in_range(args, "top_p", 0, 1, low_open=True)
    in_range(args, "min_p", 0, 1)
    if args.top_k < 0:
        raise ArgumentError(f"--top-k must be at least 0, got {args.top_k}")


def fail(message: str, status: int = 1) -> int:
    """Print ``error: message`` on stderr; returns ``status``."""
    print(f"error: {message}", file=sys.stderr)
    return status


def resolve_model(path: Path | None, expert_cache_gb: float | None, chat: bool = True):
    """``(path, expert_cache_gb)`` after defaults: no path means the demo model (built on
    first use, one line on stderr saying what it is, ``chat`` or not) with its streaming
    budget. Checks the directory, says so when its weights are random, and checks the
    budget holds a token's experts."""
    demo = path is None
    if demo:
        path = default_model.ensure_default_model()
        print(default_model.describe(path, chat), file=sys.stderr)
        if expert_cache_gb is None:
            expert_cache_gb = default_model.default_cache_gb(path)
    if kimi_k3.check_checkpoint(path).get(SYNTHETIC_KEY) and not demo:
        print(SYNTHETIC_NOTICE.format(path=path), file=sys.stderr)
    if expert_cache_gb is None:
        expert_cache_gb = auto_expert_cache_gb(Path(path))
    else:  # a positive number: check_model_arguments
        check_expert_budget(Path(path), expert_cache_gb)
    return path, expert_cache_gb


def check_expert_budget(path: Path, expert_cache_gb: float):
    """``ArgumentError`` unless the cache holds top-k experts of every MoE layer."""
    try:
        args = ModelArgs.from_path(path)
    except ConfigError:
        return  # a layout ModelArgs does not read directly: the streamer checks at load
    moe_layers = sum(args.is_moe(i) for i in range(args.num_hidden_layers))
    one = expert_bytes(expert_shapes(args))
    try:
        slots_per_layer(
            round(expert_cache_gb * GB),
            one,
            moe_layers,
            args.num_experts_per_token,
            args.num_experts,
        )
    except ValueError:
        need = one * moe_layers * args.num_experts_per_token / GB
        raise ArgumentError(
            f"--expert-cache-gb {expert_cache_gb:g} is too small for {path}: {moe_layers} MoE "
            f"layers x top-{args.num_experts_per_token} experts need at least {need:.4g} GB"
        ) from None


def auto_expert_cache_gb(path: Path) -> float | None:
    """``None`` (experts resident) when the whole checkpoint fits in the memory available
    with ``RESERVE_GB`` to spare; else the streamer's budget for what the dense weights
    leave (``kimi_k3.streaming.default_cache_gb``), announced on stderr."""
    tensors = CheckpointIndex(path).tensors
    dense = sum(t.nbytes for n, t in tensors.items() if not ROUTED_EXPERT_NAME.search(n))
    experts = sum(t.nbytes for t in tensors.values()) - dense
    experts += sum(f.stat().st_size for f in (path / PACK_DIR).glob("*.pack"))
    if dense + experts + RESERVE_GB * 1e9 < available_memory():
        return None
    budget = default_cache_gb(dense, reserve_gb=RESERVE_GB)
    print(
        f"the experts ({experts / 1e9:.1f} GB) do not fit in memory: streaming them through "
        f"a {budget:.1f} GB cache (--expert-cache-gb sets its size)",
        file=sys.stderr,
    )
    return budget


def load_for_cli(
    path: Path,
    expert_cache_gb: float | None,
    verify: bool = True,
    plan=None,
    expert_top_p: float = 1.0,
    expert_min_weight: float = 0.0,
    shed_misses: float = 1.0,
):
    """``(model, tokenizer)`` with a loading bar on stderr (path and budget from
    ``resolve_model``); ``verify``: check the checkpoint's recorded checksums; ``plan``:
    this rank's share (``kimi_k3.distributed.from_args``); ``expert_top_p``,
    ``expert_min_weight``, ``shed_misses``: expert trimming and shedding
    (``trimming_options``)."""
    tic = time.perf_counter()
    with distributed.agreed(plan):
        model, tokenizer = kimi_k3.load(
            path,
            expert_cache_gb=expert_cache_gb,
            lazy=True,
            verify_checksums=verify,
            expert_top_p=expert_top_p,
            expert_min_weight=expert_min_weight,
            shed_misses=shed_misses,
            **(plan.load_kwargs() if plan else {}),
        )
        label = "loading" if expert_cache_gb is None else "loading dense weights"
        materialize(model, Bar(label, sys.stderr))
    where = "resident" if expert_cache_gb is None else f"streamed, {expert_cache_gb:.3g} GB cache"
    where += trimming_text(expert_top_p, expert_min_weight)
    if shed_misses < 1:
        where += (
            ", nothing to shed: every expert is resident"
            if expert_cache_gb is None
            else f", shedding misses down to {shed_misses:g} of the weight"
        )
    print(f"loaded {path} in {time.perf_counter() - tic:.1f}s (experts {where})", file=sys.stderr)
    return model, tokenizer


def trimming_text(top_p: float, min_weight: float) -> str:
    """``", trimmed: top-p 0.9, min weight 0.05"`` (the parts that are on), or ``""``."""
    parts = [f"top-p {top_p:g}"] if top_p < 1 else []
    parts += [f"min weight {min_weight:g}"] if min_weight > 0 else []
    return f", trimmed: {', '.join(parts)}" if parts else ""


def materialize(model, bar: Bar):
    """Evaluate the lazily loaded parameters one layer at a time, advancing ``bar`` by bytes."""
    groups: dict[str, list] = {}
    for name, a in tree_flatten(model.parameters()):
        parts = name.split(".")
        key = ".".join(parts[:4]) if ".layers." in name else parts[-2]
        groups.setdefault(key, []).append(a)
    bar.total = sum(a.nbytes for arrays in groups.values() for a in arrays)
    for arrays in groups.values():
        mx.eval(arrays)
        bar.update(sum(a.nbytes for a in arrays))
    bar.close()


class Bar:
    """A one-line byte progress bar; redrawn in place on a terminal, printed once otherwise."""

    def __init__(self, label: str, stream, width: int = 30):
        self.label, self.stream, self.width = label, stream, width
        self.total, self.done = 0, 0
        self.tty = stream.isatty()

    def update(self, n: int):
        self.done += n
        if self.tty:
            self.stream.write("\r" + self._line())
            self.stream.flush()

    def close(self):
        self.stream.write(("\r" if self.tty else "") + self._line() + "\n")
        self.stream.flush()

    def _line(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = round(frac * self.width)
        unit, scale = ("GB", 1e9) if self.total >= 1e9 else ("MB", 1e6)
        return (
            f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {frac:4.0%} "
            f"{self.done / scale:.2f}/{self.total / scale:.2f} {unit}"
        )


def ram_gb() -> float:
    """Physical memory, GB (the GPU's share where MLX reports one)."""
    info = mx.device_info() if (mx.metal.is_available() or mx.cuda.is_available()) else {}
    if "memory_size" in info:
        return info["memory_size"] / 1e9
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def context_limit(model, max_context: int | None) -> tuple[int, str]:
    """The context size in tokens and where it comes from."""
    limit = model.args.max_position_embeddings
    if max_context and max_context < limit:
        return max_context, "--max-context"
    return limit, "max_position_embeddings"


def markdown_table(header, rows) -> str:
    """A Markdown table of ``header`` and ``rows`` (cells as ``str`` gives them), one line
    per row, ending in a newline."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
