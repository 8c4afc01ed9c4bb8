"""``python -m kimi_k3.generate``: chat with or complete text from Kimi K3.

Chat prompts are encoded with ``kimi_k3.chat.encode_chat`` (only the XTML markers become
special ids, so a typed ``<|open|>`` stays text) and handed to mlx-lm's ``stream_generate``
as token ids. Text streams to stdout; loading progress, notices, the stats line and errors
go to stderr. Exit codes: 0 done, 1 error, 2 bad arguments, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import stream_generate
from mlx_lm.models.cache import ArraysCache
from mlx_lm.sample_utils import make_sampler

import kimi_k3
from kimi_k3 import default_model, distributed, trimming
from kimi_k3.chat import (
    END,
    Element,
    ReplyStream,
    close_tag,
    encode_chat,
    encode_segments,
    parse_segments,
    segments_from_ids,
)
from kimi_k3.checkpoint import CheckpointError, CheckpointIndex
from kimi_k3.config import ConfigError
from kimi_k3.expert_pack import PACK_DIR
from kimi_k3.model import ROUTED_EXPERT_NAME
from kimi_k3.streaming import get_stats, reset_stats
from kimi_k3.streaming.cache import available_memory, default_cache_gb
from kimi_k3.tokenizer import BOS_TOKEN, PAD_TOKEN, UNK_TOKEN

DEFAULT_PROMPT = "Hello! Who are you?"
RESERVE_GB = 4.0  # memory left for the OS, activations and KV caches
INTERRUPTED = 130
SYNTHETIC_NOTICE = (
    "kimi_k3: {path} is a synthetic checkpoint: its weights are random, so its output is gibberish"
)


USAGE_ERROR = 2
TRIM_FLAGS = ("--expert-top-p", "--expert-min-weight")


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


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m kimi_k3.generate",
        description="Chat with or complete text from Kimi K3.",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(p)
    p.add_argument(
        "--prompt",
        "-p",
        default=None,
        help="the user message ('-' reads it from stdin); default: a greeting, or for the "
        "demo model the start of a Python function",
    )
    p.add_argument("--system", default=None, help="system message (chat mode)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="wrap the prompt in the chat format and show the reply's text only (default, "
        "except for the demo model, which completes text)",
    )
    mode.add_argument(
        "--raw",
        dest="chat",
        action="store_false",
        help="encode the prompt as is (special-token names become special ids) and print "
        "every generated token, special ones included (default for the demo model, which "
        "has no chat training, when neither --chat nor --raw is given; off for --model)",
    )
    p.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="open the reply with a think section or go straight to the response",
    )
    p.add_argument("--max-tokens", "-m", type=int, default=256, help="most tokens to generate")
    add_sampling_arguments(p)
    p.add_argument(
        "--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill step"
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="cap on prompt + reply tokens (default: max_position_embeddings)",
    )
    p.add_argument(
        "--interactive",
        "-i",
        action="store_true",
        help="a chat loop on stdin that keeps its prompt cache across turns",
    )
    distributed.add_arguments(p)
    return p


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
    """``--expert-top-p`` and ``--expert-min-weight`` (``kimi_k3.trimming``)."""
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


def _in_range(args, name: str, low: float, high: float, low_open: bool = False):
    value = getattr(args, name)
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
        trimming.check(args.expert_top_p, args.expert_min_weight, TRIM_FLAGS)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def trimming_options(args) -> dict:
    """``kimi_k3.load``'s trimming arguments from ``--expert-top-p`` / ``--expert-min-weight``."""
    return {"expert_top_p": args.expert_top_p, "expert_min_weight": args.expert_min_weight}


def check_sampling_arguments(args):
    _in_range(args, "temp", 0, math.inf)
    _in_range(args, "top_p", 0, 1, low_open=True)
    _in_range(args, "min_p", 0, 1)
    if args.top_k < 0:
        raise ArgumentError(f"--top-k must be at least 0, got {args.top_k}")


def check_arguments(args):
    """``ArgumentError`` naming the flag of the first invalid value."""
    check_model_arguments(args)
    check_sampling_arguments(args)
    for name in ("max_tokens", "prefill_step_size", "max_context"):
        positive(args, name)
    if args.system is not None and not args.chat:
        raise ArgumentError("--system needs --chat")


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if args.chat is None:  # the demo model completes Python; other models chat
        args.chat = args.model is not None
        if not args.chat and args.prompt is None:
            args.prompt = default_model.PROMPT
    try:
        check_arguments(args)
        plan = distributed.from_args(args)
        path, budget = resolve_model(args.model, args.expert_cache_gb)
    except (UserError, ConfigError, CheckpointError, OSError, distributed.DistributedError) as e:
        return fail(str(e), USAGE_ERROR if isinstance(e, ArgumentError) else 1)
    try:
        model, tokenizer = load_for_cli(
            path, budget, verify=args.verify, plan=plan, **trimming_options(args)
        )
        if args.seed is not None:
            mx.random.seed(args.seed)
        if args.interactive:
            return chat_loop(model, tokenizer, args)
        return run_once(model, tokenizer, args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return INTERRUPTED
    except (UserError, ConfigError, CheckpointError, OSError, distributed.DistributedError) as e:
        return fail(str(e))


def fail(message: str, status: int = 1) -> int:
    """Print ``error: message`` on stderr; returns ``status``."""
    print(f"error: {message}", file=sys.stderr)
    return status


# Loading.


def resolve_model(path: Path | None, expert_cache_gb: float | None):
    """``(path, expert_cache_gb)`` after defaults: no path means the demo model (built on
    first use, a notice on stderr) with its streaming budget. Checks the directory, says
    so when its weights are random, and checks the budget holds a token's experts."""
    from kimi_k3.convert.synth import SYNTHETIC_KEY

    demo = path is None
    if demo:
        path = default_model.ensure_default_model()
        print(default_model.NOTICE, file=sys.stderr)
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
    from kimi_k3.config import ModelArgs
    from kimi_k3.streaming.cache import GB, slots_per_layer
    from kimi_k3.streaming.sources import expert_bytes, expert_layout

    try:
        args = ModelArgs.from_path(path)
    except ConfigError:
        return  # a layout ModelArgs does not read directly: the streamer checks at load
    moe_layers = sum(args.is_moe(i) for i in range(args.num_hidden_layers))
    try:
        slots_per_layer(
            round(expert_cache_gb * GB),
            expert_bytes(expert_layout(args)),
            moe_layers,
            args.num_experts_per_token,
            args.num_experts,
        )
    except ValueError:
        need = expert_bytes(expert_layout(args)) * moe_layers * args.num_experts_per_token / GB
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
):
    """``(model, tokenizer)`` with a loading bar on stderr (path and budget from
    ``resolve_model``); ``verify``: check the checkpoint's recorded checksums; ``plan``:
    this rank's share (``kimi_k3.distributed.from_args``); ``expert_top_p``,
    ``expert_min_weight``: expert trimming (``trimming_options``)."""
    tic = time.perf_counter()
    with distributed.agreed(plan):
        model, tokenizer = kimi_k3.load(
            path,
            expert_cache_gb=expert_cache_gb,
            lazy=True,
            verify_checksums=verify,
            expert_top_p=expert_top_p,
            expert_min_weight=expert_min_weight,
            **(plan.load_kwargs() if plan else {}),
        )
        materialize(model, Bar("loading", sys.stderr))
    where = "resident" if expert_cache_gb is None else f"streamed, {expert_cache_gb:.3g} GB cache"
    where += trimming_text(expert_top_p, expert_min_weight)
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


# Prompts.


def read_prompt(text: str) -> str:
    return sys.stdin.read() if text == "-" else text


def context_limit(model, max_context: int | None) -> tuple[int, str]:
    """The context size in tokens and where it comes from."""
    limit = model.args.max_position_embeddings
    if max_context and max_context < limit:
        return max_context, "--max-context"
    return limit, "max_position_embeddings"


def check_room(n_prompt: int, in_cache: int, context: tuple[int, str], max_tokens: int) -> int:
    """The reply budget left in the ``context``; ``UserError`` if none is left."""
    limit, source = context
    used = in_cache + n_prompt
    if used >= limit:
        held = f" ({in_cache} already in the conversation)" if in_cache else ""
        raise UserError(
            f"the prompt is {n_prompt} tokens{held}, but the context holds "
            f"{limit} ({source}), leaving no room for a reply"
        )
    return min(max_tokens, limit - used)


def prompt_ids(tokenizer, args) -> list[int]:
    text = read_prompt(DEFAULT_PROMPT if args.prompt is None else args.prompt)
    if args.chat is False:  # --system without --chat: check_arguments refused it
        return tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": text})
    return encode_chat(tokenizer, messages, thinking=args.thinking)


# Generation.


@dataclass
class Reply:
    tokens: list[int] = field(default_factory=list)
    last: object = None  # the last mlx-lm GenerationResponse
    prompt_tokens: int = 0


def generate(model, tokenizer, ids: list[int], args, cache, max_tokens: int, reply: Reply):
    """Stream a reply to ``ids`` on stdout, filling ``reply`` as tokens arrive.

    ``cache`` is extended in place: afterwards it holds ``ids`` and every token of
    ``reply.tokens`` (mlx-lm steps the model on each token before yielding it).
    """
    reset_stats(model)
    reply.prompt_tokens = len(ids)
    sampler = make_sampler(args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    shown = Shown(tokenizer, args.thinking) if args.chat else None
    for r in stream_generate(
        model,
        tokenizer,
        ids,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=[never_sample(tokenizer)],
        prompt_cache=cache,
        prefill_step_size=args.prefill_step_size,
    ):
        reply.tokens.append(r.token)
        reply.last = r
        sys.stdout.write(r.text if shown is None else shown.add(r.token))
        sys.stdout.flush()
    sys.stdout.write("\n" if shown is None else shown.end())


class Shown:
    """What a chat reply prints: the text of its think and response sections (a blank line
    between them), then its tool calls; markers and other special tokens are not shown."""

    def __init__(self, tokenizer, thinking: bool):
        self.reply = ReplyStream(tokenizer, thinking)
        self.printed = {"reasoning": "", "content": ""}

    def add(self, token: int) -> str:
        self.reply.add(token)
        return self._new(final=False)

    def _new(self, final: bool) -> str:
        out = ""
        for key in ("reasoning", "content"):
            text = getattr(self.reply, key)
            text = text if final else ReplyStream.stable(text)
            done = self.printed[key]
            if len(text) > len(done) and text.startswith(done):
                if key == "content" and not done and self.printed["reasoning"]:
                    out += "\n\n"
                out += text[len(done) :]
                self.printed[key] = text
        return out

    def end(self) -> str:
        calls = "".join(
            f"\ntool call: {c['name']} {json.dumps(c['arguments'], ensure_ascii=False)}"
            for c in self.reply.tool_calls
        )
        return self._new(final=True) + calls + "\n"


def never_sampled_ids(tokenizer) -> list[int]:
    """Special ids no reply may contain: the reserved slots, ``[BOS]``, ``[PAD]`` and
    ``[UNK]``. Stop tokens and the chat markers stay."""
    banned = (BOS_TOKEN, PAD_TOKEN, UNK_TOKEN)
    return sorted(
        i
        for i, t in tokenizer.added_tokens_decoder.items()
        if t.content in banned or t.content.startswith("<|reserved_token_")
    )


def never_sample(tokenizer):
    """An mlx-lm logits processor that gives ``never_sampled_ids`` no probability."""
    ids = np.array(never_sampled_ids(tokenizer), dtype=np.int64)
    banned: dict[int, mx.array] = {}  # by vocabulary size: True where banned

    def mask(tokens: mx.array, logits: mx.array) -> mx.array:
        n = logits.shape[-1]
        if n not in banned:
            row = np.zeros(n, bool)
            row[ids[ids < n]] = True
            banned[n] = mx.array(row)
        return mx.where(banned[n], -mx.inf, logits)

    return mask


def run_once(model, tokenizer, args) -> int:
    ids = prompt_ids(tokenizer, args)
    if not ids:
        raise UserError("the prompt is empty")
    context = context_limit(model, args.max_context)
    max_tokens = check_room(len(ids), 0, context, args.max_tokens)
    cache = model.make_cache()
    return _generate_reporting(model, tokenizer, ids, args, cache, max_tokens, Reply(), context)


def _generate_reporting(model, tokenizer, ids, args, cache, max_tokens, reply, context) -> int:
    """``generate`` with the stats line after it, also after Ctrl-C or a disk error, and a
    notice when the ``context`` cut the reply short of ``--max-tokens``."""
    try:
        generate(model, tokenizer, ids, args, cache, max_tokens, reply)
    except KeyboardInterrupt:
        print(f"\n{stats_line(model, reply)} (interrupted)", file=sys.stderr)
        return INTERRUPTED
    except (OSError, CheckpointError) as e:
        sys.stdout.write("\n")
        return fail(f"reading experts from disk failed mid-generation: {e}")
    print(stats_line(model, reply), file=sys.stderr)
    if max_tokens < args.max_tokens and reply.last and reply.last.finish_reason == "length":
        limit, source = context
        print(
            f"notice: the reply was cut at {len(reply.tokens)} tokens: the context holds "
            f"{limit} tokens ({source})",
            file=sys.stderr,
        )
    return 0


def stats_line(model, reply: Reply) -> str:
    r = reply.last
    if r is None:
        parts = [
            f"prompt: {reply.prompt_tokens} tokens, prefill not finished",
            f"peak memory: {mx.get_peak_memory() / 1e9:.3f} GB",
        ]
    else:
        parts = [
            f"prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s",
            f"generation: {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s",
            f"peak memory: {r.peak_memory:.3f} GB",
        ]
    return "stats: " + " | ".join(parts + [_expert_stats(model)])


def _expert_stats(model) -> str:
    if (ranks := distributed.stats_text(model)) is not None:
        return ranks
    stats = get_stats(model)
    if stats is None:
        return "experts: resident"
    rate = stats["hit_rate"]
    rate = "no" if rate is None else f"{rate:.1%}"
    text = f"experts: {rate} hit rate, {stats['bytes_read'] / 1e9:.3f} GB read"
    kept = stats["experts_per_token"]
    if kept is not None and trimming.is_on(*trimming.expert_trimming(model)):
        text += f", {kept:.2f} of {model.args.num_experts_per_token} a token"
    return text


# Interactive chat.


class ChatSession:
    """A conversation whose prompt cache persists across turns.

    The cache holds exactly ``history``: each turn feeds only what is new (the closing of a
    cut-off previous reply, then the user message and the assistant opening).
    """

    def __init__(self, model, tokenizer, system: str | None = None, thinking: bool = True):
        self.model, self.tokenizer, self.system, self.thinking = model, tokenizer, system, thinking
        self.cache = model.make_cache()
        self.history: list[int] = []
        self.last_reply: list[int] = []

    def turn_ids(self, text: str) -> list[int]:
        """The ids to feed for the user message ``text``."""
        first = not self.history
        messages = [{"role": "system", "content": self.system}] if first and self.system else []
        messages.append({"role": "user", "content": text})
        closing = close_reply(self.tokenizer, self.last_reply, self.thinking) if not first else []
        return closing + encode_chat(self.tokenizer, messages, thinking=self.thinking)

    def save(self) -> list:
        """What ``restore`` needs to undo a turn: KDA arrays (immutable) and MLA lengths."""
        return [(c[0], c[1]) if isinstance(c, ArraysCache) else c.offset for c in self.cache]

    def restore(self, saved: list):
        for c, s in zip(self.cache, saved):
            if isinstance(c, ArraysCache):
                c[0], c[1] = s
            else:
                c.offset = s

    def record(self, ids: list[int], reply: list[int]):
        """Note a turn fed ``ids`` and produced ``reply`` (both now in the cache)."""
        self.history += ids + reply
        self.last_reply = reply


def close_reply(tokenizer, reply: list[int], thinking: bool) -> list[int]:
    """Ids that close what a cut-off reply left open, then ``<|end_of_msg|>``.

    A finished reply (ended by ``<|end_of_msg|>``) needs none.
    """
    tree = parse_segments(
        segments_from_ids(tokenizer, reply), ["message", "think" if thinking else "response"]
    )
    if tree.closed:
        return []
    open_tags, node = [], tree
    while (kids := [c for c in node.children if isinstance(c, Element)]) and not kids[-1].closed:
        node = kids[-1]
        open_tags.append(node.tag)
    segments = [s for tag in reversed(open_tags) for s in close_tag(tag)] + [(END, True)]
    return encode_segments(tokenizer, segments)


def chat_loop(model, tokenizer, args) -> int:
    """Read user messages from stdin until EOF or ``/exit``; ``/reset`` clears the history.
    On a terminal, lines are edited and recalled with readline; Ctrl-C stops a reply (the
    turn is dropped) or clears the line, and returns to the prompt."""
    if sys.stdin.isatty():
        import readline  # noqa: F401  (input() gains line editing and history)
    session = ChatSession(model, tokenizer, args.system, args.thinking)
    context = context_limit(model, args.max_context)
    print("chat: type a message; /reset starts over, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            text = input(">> ")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        command = text.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            session = ChatSession(model, tokenizer, args.system, args.thinking)
            print("conversation cleared", file=sys.stderr)
            continue
        if not command:
            continue
        code = chat_turn(session, text, args, context)
        if code not in (0, INTERRUPTED):
            return code


def chat_turn(session: ChatSession, text: str, args, context) -> int:
    """One turn of ``chat_loop``; after Ctrl-C the cache goes back to before the turn."""
    ids = session.turn_ids(text)
    try:
        max_tokens = check_room(len(ids), len(session.history), context, args.max_tokens)
    except UserError as e:
        print(f"error: {e}; /reset to start over", file=sys.stderr)
        return 0
    saved, reply = session.save(), Reply()
    code = _generate_reporting(
        session.model, session.tokenizer, ids, args, session.cache, max_tokens, reply, context
    )
    if code == INTERRUPTED:
        session.restore(saved)
        print("reply stopped; the turn is dropped", file=sys.stderr)
    elif code == 0:
        session.record(ids, reply.tokens)
    return code


if __name__ == "__main__":
    sys.exit(main())
