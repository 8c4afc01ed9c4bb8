"""Generate from Kimi K3 through the Python API: ``kimi_k3.load`` + ``mlx_lm.stream_generate``.

    python examples/generate_api.py --model path/to/Kimi-K3 --prompt "Hello" --max-tokens 64

Without ``--model`` a tiny random-weight checkpoint is written to a temporary directory: the
whole path runs, the text is gibberish.
"""

from __future__ import annotations

import argparse

from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

import kimi_k3
from kimi_k3.convert.synth import checkpoint_or_synthetic
from kimi_k3.text.chat import encode_chat


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny synthetic one)")
    parser.add_argument("--prompt", default="Write a haiku about experts on an SSD.")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument(
        "--expert-cache-gb",
        type=float,
        default=None,
        help="stream experts from disk into a cache of this size",
    )
    return parser


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    with checkpoint_or_synthetic(args.model) as path:
        model, tokenizer = kimi_k3.load(path, expert_cache_gb=args.expert_cache_gb)
        # Chat prompts go in as ids: only the XTML markers may become special tokens.
        ids = encode_chat(
            tokenizer, [{"role": "user", "content": args.prompt}], thinking=args.thinking
        )
        last = None
        for last in stream_generate(
            model, tokenizer, ids, max_tokens=args.max_tokens, sampler=make_sampler(temp=args.temp)
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
