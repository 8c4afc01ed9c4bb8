"""A chat loop that keeps one prompt cache across turns: each turn feeds only its new tokens.

    echo -e "Hi!\\nTell me more." | python examples/chat_loop.py --model path/to/Kimi-K3

One user turn per stdin line (an empty line or end of input ends the chat). Without
``--model`` a tiny random-weight checkpoint is written to a temporary directory: the cache
at work, the replies gibberish. Sampling goes through ``kimi_k3.reserved_token_mask``, so no
reserved special token is ever generated.
"""

from __future__ import annotations

import argparse
import sys

from mlx_lm import stream_generate
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler

import kimi_k3
from kimi_k3.convert.synth import checkpoint_or_synthetic
from kimi_k3.text.chat import END, close_tag, encode_chat, encode_segments


def cached_tokens(cache: list, history: list[int]) -> int:
    """How many tokens of ``history`` the prompt cache holds: an MLA layer's ``KVCache``
    counts them (mlx-lm may or may not have fed the last sampled token)."""
    return next((c.offset for c in cache if isinstance(c, KVCache)), len(history))


def chat_turn(
    model, tokenizer, cache, history, messages, max_tokens, sampler, thinking, out=sys.stdout
) -> list[int]:
    """Answer ``messages`` (the turn's new messages) continuing ``cache``.

    ``history`` (every token of the conversation so far) is extended in place with the
    turn's prompt and reply. Returns the reply's tokens.
    """
    new = encode_chat(tokenizer, messages, thinking=thinking)
    reused = cached_tokens(cache, history)
    todo = history[reused:] + new
    history += new
    reply = []
    for r in stream_generate(
        model,
        tokenizer,
        todo,
        prompt_cache=cache,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=[kimi_k3.reserved_token_mask(tokenizer)],
    ):
        reply.append(r.token)
        print(r.text, end="", flush=True, file=out)
    print(file=out)
    history += reply
    if not reply or reply[-1] not in tokenizer.eos_token_ids:
        # Cut short by max_tokens: close what the generation prompt opened, so the next
        # turn starts a well-formed message.
        section = "think" if thinking else "response"
        history += encode_segments(
            tokenizer, close_tag(section) + close_tag("message") + [(END, True)]
        )
    print(f"[fed {len(todo)} tokens, {reused} reused from the prompt cache]", file=out, flush=True)
    return reply


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny synthetic one)")
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--expert-cache-gb", type=float, default=None)
    return parser


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    with checkpoint_or_synthetic(args.model) as path:
        model, tokenizer = kimi_k3.load(path, expert_cache_gb=args.expert_cache_gb)
        cache, history = make_prompt_cache(model), []
        sampler = make_sampler(temp=args.temp)
        pending = [{"role": "system", "content": args.system}] if args.system else []
        for line in sys.stdin:
            text = line.rstrip("\n")
            if not text:
                break
            print(f"> {text}", flush=True)
            messages, pending = pending + [{"role": "user", "content": text}], []
            chat_turn(
                model, tokenizer, cache, history, messages, args.max_tokens, sampler, args.thinking
            )


if __name__ == "__main__":
    main()
