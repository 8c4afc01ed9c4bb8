"""Generate from Kimi K3 through the Python API: ``kimi_k3.load`` + ``mlx_lm.stream_generate``.

    python examples/generate_api.py                    # the embedded demo model
    python examples/generate_api.py --model path/to/Kimi-K3 --prompt "Hello" --max-tokens 64

Without ``--model`` this runs the embedded demo model (a toy Kimi K3 trained on source code,
``kimi_k3.ensure_default_model()``), which has no chat training: it continues the prompt as
raw text, a Python function's start unless ``--prompt`` gives another. With ``--model`` the
prompt is a user message in the chat format. Sampling goes through
``kimi_k3.reserved_token_mask``, so no reserved special token is ever generated.
"""

from __future__ import annotations

import argparse

from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

import kimi_k3
from kimi_k3.default_model import PROMPT
from kimi_k3.text.chat import encode_chat


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the demo model)")
    parser.add_argument(
        "--prompt",
        default=None,
        help="a user message (default: a haiku request; for the demo model, raw text to "
        "continue, by default the start of a Python function)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument(
        "--expert-cache-gb",
        type=float,
        default=None,
        help="stream experts from disk into a cache of this size (default: resident)",
    )
    return parser


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    demo = args.model is None
    path = kimi_k3.ensure_default_model() if demo else args.model
    model, tokenizer = kimi_k3.load(path, expert_cache_gb=args.expert_cache_gb)
    if demo:  # no chat training: raw text to continue
        prompt = PROMPT if args.prompt is None else args.prompt
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    else:  # chat prompts go in as ids: only the XTML markers may become special tokens
        prompt = "Write a haiku about experts on an SSD." if args.prompt is None else args.prompt
        messages = [{"role": "user", "content": prompt}]
        ids = encode_chat(tokenizer, messages, thinking=args.thinking)
    print(f"prompt ({'raw text' if demo else 'a user message'}):\n{prompt.rstrip()}\nreply:")
    mask = kimi_k3.reserved_token_mask(tokenizer)  # no reserved, [BOS], [PAD] or [UNK] ids
    last = None
    for last in stream_generate(
        model,
        tokenizer,
        ids,
        max_tokens=args.max_tokens,
        sampler=make_sampler(temp=args.temp),
        logits_processors=[mask],
    ):
        print(last.text, end="", flush=True)
    print()
    if last is not None:
        print(
            f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
            f"generation: {last.generation_tokens} tokens, "
            f"{last.generation_tps:.1f} tok/s | peak memory {last.peak_memory:.3f} GB"
        )


if __name__ == "__main__":
    main()
