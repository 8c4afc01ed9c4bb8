"""``python -m kimi_k3.generate``: chat with or complete text from Kimi K3.

Chat prompts are encoded with ``kimi_k3.text.chat.encode_chat`` (only the XTML markers become
special ids, so a typed ``<|open|>`` stays text) and handed to mlx-lm's ``stream_generate``
as token ids. Text streams to stdout; loading progress, notices, the prompt (between marker
lines, before the reply), the stats line and errors go to stderr. Exit codes: 0 done,
1 error, 2 bad arguments, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.cache import ArraysCache
from mlx_lm.sample_utils import make_sampler

from kimi_k3 import default_model, distributed
from kimi_k3.checkpoint.files import CheckpointError
from kimi_k3.cli import (
    INTERRUPTED,
    USAGE_ERROR,
    ArgumentError,
    HelpFormatter,
    Parser,
    UserError,
    add_model_arguments,
    add_sampling_arguments,
    check_model_arguments,
    check_sampling_arguments,
    context_limit,
    fail,
    load_for_cli,
    positive,
    resolve_model,
    trimming_options,
)
from kimi_k3.model import routing
from kimi_k3.model.config import ConfigError
from kimi_k3.streaming import get_stats, reset_stats
from kimi_k3.text.chat import (
    END,
    Element,
    ReplyStream,
    close_tag,
    encode_chat,
    encode_segments,
    parse_segments,
    segments_from_ids,
)
from kimi_k3.text.tokenizer import never_sample

DEFAULT_PROMPT = "Hello! Who are you?"


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
        path, budget = resolve_model(args.model, args.expert_cache_gb, chat=args.chat)
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


# Prompts.


def read_prompt(text: str) -> str:
    return sys.stdin.read() if text == "-" else text


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


def prompt_ids(tokenizer, args, text: str) -> list[int]:
    """The ids of the prompt ``text``: as is (``--raw``), or a chat of ``--system`` and
    ``text`` as the user message."""
    if args.chat is False:  # --system without --chat: check_arguments refused it
        return tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": text})
    return encode_chat(tokenizer, messages, thinking=args.thinking)


# Generation.


@dataclass
class Generated:
    """One generation's record as it runs: its token ids, the prompt's length and mlx-lm's
    last ``GenerationResponse`` (speed, peak memory). The reply's text and sections are
    ``kimi_k3.text.chat``'s ``Reply`` and ``ReplyStream``."""

    tokens: list[int] = field(default_factory=list)
    last: object = None  # the last mlx-lm GenerationResponse
    prompt_tokens: int = 0


def generate(model, tokenizer, ids: list[int], args, cache, max_tokens: int, reply: Generated):
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


def run_once(model, tokenizer, args) -> int:
    text = read_prompt(DEFAULT_PROMPT if args.prompt is None else args.prompt)
    ids = prompt_ids(tokenizer, args, text)
    if not ids:
        raise UserError("the prompt is empty")
    context = context_limit(model, args.max_context)
    max_tokens = check_room(len(ids), 0, context, args.max_tokens)
    print(prompt_display(text, len(ids), args), file=sys.stderr, flush=True)
    cache = model.make_cache()
    return _generate_reporting(model, tokenizer, ids, args, cache, max_tokens, Generated(), context)


PROMPT_LINES = 20  # a longer prompt is shown cut to its first lines


def prompt_display(text: str, n_tokens: int, args) -> str:
    """The prompt as ``run_once`` shows it on stderr before the reply: between a marker
    line saying how it is encoded and one that opens the reply, cut to ``PROMPT_LINES``
    lines; in a chat the system message first."""
    lines = text.splitlines() or [""]
    if len(lines) > PROMPT_LINES:
        more = len(lines) - PROMPT_LINES
        lines = lines[:PROMPT_LINES] + [f"[... {more} more line{'s' * (more > 1)}]"]
    if not args.chat:
        head = f"--- prompt: raw text, {n_tokens} tokens ---"
        return "\n".join([head, *lines, "--- reply ---"])
    thinking = "thinking on" if args.thinking else "thinking off"
    head = f"--- prompt: a chat, {thinking}, {n_tokens} tokens ---"
    system = [f"system: {args.system}"] if args.system else []
    return "\n".join([head, *system, f"user: {lines[0]}", *lines[1:], "--- reply ---"])


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


def stats_line(model, reply: Generated) -> str:
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
    dropping = routing.is_on(*routing.expert_trimming(model)) or routing.shed_misses(model) < 1
    if kept is not None and dropping:
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
    saved, reply = session.save(), Generated()
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
