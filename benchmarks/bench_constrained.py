"""Grammar-constrained decoding: llguidance against outlines-core on the project's
tokenizers, the numbers behind the library choice in docs/constrained.md.

    python -m benchmarks.bench_constrained [--k3-vocab] [--repeats N] [--out FILE.md]

Tokenizers: the embedded default model's (4,096 ids) and, with ``--k3-vocab``, a
synthetic one of K3's size (163,840 ids, ``write_synthetic_tokenizer``; building it takes
a while the first time, then it is cached). Grammars: any JSON object, and a small JSON
schema (three required keys: a bounded string, an integer range, an enum array).

Each cell teacher-forces a fixed JSON document (its tokens under the tokenizer) through a
fresh matcher: per token, the allowed-token mask as a bool array over the vocabulary, then
the matcher advanced by the token. Per-token time is the mean over the document's tokens,
the best of ``--repeats`` passes (each after a reset). Setup: the tokenizer's conversion
(once per tokenizer) and the grammar's compile (once per request); for llguidance also the
server's whole cost of a request's grammar (``constrained.json_schema``: the schema's
bounds, the compile and first mask in a worker process already started, the compile in
the server). "apply" is the cost of
turning the bool mask into the masked logits on the MLX device (``mx.where`` on [1, V]),
which does not depend on the library.

The second table puts the cost in context: the default model's greedy decode after its demo
prompt, free and under the small schema's processor (llguidance), in ms per generated token
(the best of ``--repeats`` runs; the two decode different text, so per-token time is what
compares), and the processor's own host time per call once the sampled token it reads is
evaluated (mask, advance, building the masked logits).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks.timing import emit, environment, median_time
from kimi_k3.cli import markdown_table
from kimi_k3.default_model import ensure_default_model
from kimi_k3.serve import constrained
from kimi_k3.serve.grammar_check import parser_limits
from kimi_k3.text.tokenizer import load_tokenizer, write_synthetic_tokenizer

K3_VOCAB = 163840
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
        "tags": {"type": "array", "items": {"enum": ["math", "engines", "poetry"]}},
    },
    "required": ["name", "year", "tags"],
    "additionalProperties": False,
}
CASES = {
    "json_object": (
        {"type": "object"},
        '{"name": "Ada Lovelace", "year": 1843, "notes": {"engine": "analytical", '
        '"ratio": 0.5, "ok": true}, "tags": ["math", "engines"]}',
    ),
    "json_schema": (SCHEMA, '{"name": "Ada Lovelace", "year": 1843, "tags": ["math", "engines"]}'),
}


def _best_pass(step, reset, ids: list[int], repeats: int) -> float:
    """Best mean seconds per token over ``repeats`` teacher-forced passes of ``ids``."""
    best = float("inf")
    for _ in range(repeats):
        reset()
        start = time.perf_counter()
        for token in ids:
            step(token)
        best = min(best, (time.perf_counter() - start) / len(ids))
    return best


def bench_llguidance(tok, schema: dict, ids: list[int], repeats: int) -> dict:
    """The library's own numbers (its tokenizer, a matcher compiled in this process), and
    what the server spends on a request's grammar (``constrained.json_schema``: bounds,
    the compile and first mask in a worker process already started, then the compile
    here)."""
    constrained._LL_TOKENIZERS.clear()
    start = time.perf_counter()
    ll = constrained.ll_tokenizer(tok)
    tokenizer_s = time.perf_counter() - start
    llg, grammar = constrained._llguidance(), constrained.json_schema_grammar(tok, schema)
    start = time.perf_counter()
    llg.LLMatcher(ll, grammar, log_level=0, limits=parser_limits(llg))
    compile_s = time.perf_counter() - start
    constrained.checker(tok).check(grammar)  # the worker's start, untimed
    start = time.perf_counter()
    proc = constrained.json_schema(tok, schema)
    served_s = time.perf_counter() - start

    def step(token):
        proc.allowed()
        proc.advance([token])

    def reset():
        proc.matcher.reset()

    per_token = _best_pass(step, reset, ids, repeats)
    if not proc.done:
        raise RuntimeError(f"llguidance did not accept the document: {proc.matcher.get_error()}")
    return {
        "tokenizer_s": tokenizer_s,
        "compile_s": compile_s,
        "served_s": served_s,
        "per_token_s": per_token,
    }


def bench_outlines(tok, schema: dict, ids: list[int], repeats: int) -> dict:
    import outlines_core

    token_bytes = tok.detokenizer.token_bytes
    specials = set(getattr(tok, "added_tokens_decoder", {}))
    vocab_size = len(token_bytes)
    start = time.perf_counter()
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes):
        if i not in specials:
            by_bytes.setdefault(b, []).append(i)
    vocabulary = outlines_core.Vocabulary(tok.eos_token_id, by_bytes)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    compile_s = time.perf_counter() - start
    words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def step(token):
        guide.write_mask_into(words.ctypes.data, words.size, 4)
        np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)
        guide.advance(token, return_tokens=False)

    per_token = _best_pass(step, guide.reset, ids, repeats)
    if not guide.is_finished():
        raise RuntimeError("outlines-core did not accept the document")
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "per_token_s": per_token}


def apply_time(vocab_size: int) -> float:
    """Median seconds of masking [1, V] bf16 logits with a bool mask from host memory."""
    logits = mx.random.normal((1, vocab_size)).astype(mx.bfloat16)
    allowed = np.random.default_rng(0).random(vocab_size) < 0.5
    neg = mx.array(-mx.inf, dtype=mx.bfloat16)

    def run():
        mx.eval(mx.where(mx.array(allowed), logits, neg))

    return median_time(run, repeats=200)


def decode_rows(tokens: int, repeats: int) -> list[list]:
    """The default model's greedy decode (``stream_generate``, ``tokens`` after its demo
    prompt), free and under the ``SCHEMA`` processor: ms per generated token (best of
    ``repeats``), and the processor's own host time per call."""
    from mlx_lm import stream_generate

    import kimi_k3
    from kimi_k3.default_model import PROMPT

    model, tok = kimi_k3.load(ensure_default_model())
    rows = []
    for label in ("free", "json_schema"):
        best, host = float("inf"), 0.0
        for _ in range(repeats):
            procs, spent = None, []
            if label != "free":
                proc = constrained.json_schema(tok, SCHEMA)

                def timed(tokens, logits, proc=proc, spent=spent):
                    mx.eval(tokens)  # the sampled token: waiting for it is the model's time
                    start = time.perf_counter()
                    out = proc(tokens, logits)
                    spent.append(time.perf_counter() - start)
                    return out

                procs = [timed]
            start = time.perf_counter()
            n = sum(1 for _ in stream_generate(model, tok, PROMPT, tokens, logits_processors=procs))
            took = (time.perf_counter() - start) / n
            if took < best:
                best, host = took, (sum(spent) / len(spent) if spent else 0.0)
        rows.append([label, n, f"{best * 1e3:.3f}", f"{host * 1e6:.1f}" if host else "-"])
    return rows


def k3_tokenizer():
    """The synthetic K3-size tokenizer, written once into the temp dir and reused."""
    path = Path(tempfile.gettempdir()) / f"kimi_k3_bench_tokenizer_{K3_VOCAB}"
    if not (path / "tokenizer_config.json").is_file():
        write_synthetic_tokenizer(path, K3_VOCAB)
    return load_tokenizer(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k3-vocab", action="store_true", help="also a 163,840-id tokenizer")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--libraries", default="llguidance,outlines-core")
    ap.add_argument(
        "--decode-tokens",
        type=int,
        default=60,
        help="tokens of the default model's decode, free and constrained (0: skip)",
    )
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    tokenizers = {"default model": load_tokenizer(ensure_default_model())}
    if args.k3_vocab:
        tokenizers["K3-size synthetic"] = k3_tokenizer()
    benches = {"llguidance": bench_llguidance, "outlines-core": bench_outlines}
    rows = []
    for label, tok in tokenizers.items():
        vocab = len(tok.detokenizer.token_bytes)
        apply_us = apply_time(vocab) * 1e6
        for case, (schema, doc) in CASES.items():
            ids = tok.encode(doc)
            for lib in args.libraries.split(","):
                r = benches[lib](tok, schema, ids, args.repeats)
                rows.append(
                    [
                        lib,
                        f"{label} ({vocab:,})",
                        case,
                        len(ids),
                        f"{r['tokenizer_s'] * 1e3:.1f}",
                        f"{r['compile_s'] * 1e3:.1f}",
                        f"{r['served_s'] * 1e3:.1f}" if "served_s" in r else "-",
                        f"{r['per_token_s'] * 1e6:.1f}",
                        f"{apply_us:.1f}",
                    ]
                )
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
    header = [
        "library",
        "tokenizer (ids)",
        "grammar",
        "doc tokens",
        "tokenizer setup ms",
        "grammar compile ms",
        "as the server takes it ms",
        "mask + advance µs/token",
        "apply µs/token",
    ]
    text = environment() + "\n\n" + markdown_table(header, rows)
    if args.decode_tokens:
        head = ["default model decode", "tokens", "ms/token", "processor host µs/call"]
        text += "\n" + markdown_table(head, decode_rows(args.decode_tokens, args.repeats))
    emit(text, args.out)


if __name__ == "__main__":
    main()
