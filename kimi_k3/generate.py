"""``python -m kimi_k3.generate``: chat with or complete text from Kimi K3.

Chat prompts are encoded with ``kimi_k3.chat.encode_chat`` (only the XTML markers become
special ids, so a typed ``<|open|>`` stays text) and handed to mlx-lm's ``stream_generate``
as token ids. Text streams to stdout; loading progress, notices, the stats line and errors
go to stderr. Exit codes: 0 done, 1 error, 2 bad arguments, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

import kimi_k3
from kimi_k3 import default_model
from kimi_k3.chat import (
    END,
    Element,
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


class UserError(Exception):
    """Bad input the user can fix; printed as one ``error:`` line."""


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kimi_k3.generate", description="Chat with or complete text from Kimi K3."
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint directory: the published layout, the converter's, or an "
        "mlx-lm converted one (default: the built-in demo model, trained on Python source)",
    )
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
        help="wrap the prompt in the chat format (default, except for the demo model, "
        "which completes text)",
    )
    mode.add_argument(
        "--raw",
        dest="chat",
        action="store_false",
        help="encode the prompt as is (special-token names become special ids)",
    )
    p.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="open the reply with a think section (default) or go straight to the response",
    )
    p.add_argument("--max-tokens", "-m", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
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
    p.add_argument("--prefill-step-size", type=int, default=2048)
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
    return p


def add_verify_argument(p: argparse.ArgumentParser):
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check every weight and every streamed expert read from disk against its "
        "crc32 (default; recorded once at the first load, docs/checkpoints.md); "
        "--no-verify reads without checking",
    )


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    for name in ("max_tokens", "prefill_step_size", "max_context"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return fail(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.model is None and args.chat is None:  # the demo model completes Python
        args.chat = False
        args.prompt = default_model.PROMPT if args.prompt is None else args.prompt
    try:
        model, tokenizer = load_for_cli(
            *resolve_model(args.model, args.expert_cache_gb), verify=args.verify
        )
        if args.seed is not None:
            mx.random.seed(args.seed)
        if args.interactive:
            return chat_loop(model, tokenizer, args)
        return run_once(model, tokenizer, args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return INTERRUPTED
    except (UserError, ConfigError, CheckpointError, OSError) as e:
        return fail(str(e))


def fail(message: str) -> int:
    """Print ``error: message`` on stderr; the exit status for it (1)."""
    print(f"error: {message}", file=sys.stderr)
    return 1


# Loading.


def resolve_model(path: Path | None, expert_cache_gb: float | None):
    """``(path, expert_cache_gb)`` after defaults: no path means the demo model (built on
    first use, a notice on stderr) with its streaming budget. Checks the directory."""
    if path is None:
        path = default_model.ensure_default_model()
        print(default_model.NOTICE, file=sys.stderr)
        if expert_cache_gb is None:
            expert_cache_gb = default_model.default_cache_gb(path)
    kimi_k3.check_checkpoint(path)
    if expert_cache_gb is None:
        expert_cache_gb = auto_expert_cache_gb(Path(path))
    return path, expert_cache_gb


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


def load_for_cli(path: Path, expert_cache_gb: float | None, verify: bool = True):
    """``(model, tokenizer)`` with a loading bar on stderr (path and budget from
    ``resolve_model``); ``verify``: check the checkpoint's recorded checksums."""
    tic = time.perf_counter()
    model, tokenizer = kimi_k3.load(
        path, expert_cache_gb=expert_cache_gb, lazy=True, verify_checksums=verify
    )
    materialize(model, Bar("loading", sys.stderr))
    where = "resident" if expert_cache_gb is None else f"streamed, {expert_cache_gb:.3g} GB cache"
    print(f"loaded {path} in {time.perf_counter() - tic:.1f}s (experts {where})", file=sys.stderr)
    return model, tokenizer


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
    if args.chat is False:
        if args.system:
            raise UserError("--system needs --chat")
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
        sys.stdout.write(r.text)
        sys.stdout.flush()
    sys.stdout.write("\n")


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
    max_tokens = check_room(len(ids), 0, context_limit(model, args.max_context), args.max_tokens)
    return _generate_reporting(model, tokenizer, ids, args, model.make_cache(), max_tokens, Reply())


def _generate_reporting(model, tokenizer, ids, args, cache, max_tokens, reply: Reply) -> int:
    """``generate`` with the stats line after it, also after Ctrl-C or a disk error."""
    try:
        generate(model, tokenizer, ids, args, cache, max_tokens, reply)
    except KeyboardInterrupt:
        print(f"\n{stats_line(model, reply)} (interrupted)", file=sys.stderr)
        return INTERRUPTED
    except (OSError, CheckpointError) as e:
        sys.stdout.write("\n")
        return fail(f"reading experts from disk failed mid-generation: {e}")
    print(stats_line(model, reply), file=sys.stderr)
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
    stats = get_stats(model)
    if stats is None:
        return "experts: resident"
    rate = stats["hit_rate"]
    rate = "no" if rate is None else f"{rate:.1%}"
    return f"experts: {rate} hit rate, {stats['bytes_read'] / 1e9:.3f} GB read"


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
    """Read user messages from stdin until EOF or ``/exit``; ``/reset`` clears the history."""
    session = ChatSession(model, tokenizer, args.system, args.thinking)
    context = context_limit(model, args.max_context)
    print("chat: type a message; /reset starts over, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            text = input(">> ")
        except EOFError:
            return 0
        if text.strip() == "/exit":
            return 0
        if text.strip() == "/reset":
            session = ChatSession(model, tokenizer, args.system, args.thinking)
            continue
        ids = session.turn_ids(text)
        try:
            max_tokens = check_room(len(ids), len(session.history), context, args.max_tokens)
        except UserError as e:
            print(f"error: {e}; /reset to start over", file=sys.stderr)
            continue
        reply = Reply()
        code = _generate_reporting(model, tokenizer, ids, args, session.cache, max_tokens, reply)
        if code:
            return code
        session.record(ids, reply.tokens)


if __name__ == "__main__":
    sys.exit(main())
