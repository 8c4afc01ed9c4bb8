"""Quality of the converter's dense quantization: KL divergence and top-1 agreement of the
next-token distributions against the unconverted checkpoint.

    python benchmarks/quant_quality.py --out quant_quality.md

A synthetic checkpoint (preset ``small`` by default) is converted at each dense width with
``kimi_k3.convert.convert``; every model runs in fp32 so only the weights differ. Routed
experts are MXFP4 in both (copied bit-exactly), so the table measures the dense trunk alone.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from kimi_k3.convert.convert import Settings, convert
from kimi_k3.convert.synth import write_checkpoint
from kimi_k3.loader import load_model

WIDTHS = ((16, 64), (8, 64), (4, 64), (4, 32))


def dense_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("model-*.safetensors")) / 2**20


def compare(ref: mx.array, got: mx.array) -> tuple[float, float, float]:
    """Mean and max KL(ref || got) in nats per token, and top-1 agreement.

    Shapes: ref, got: [B, T, V] logits.
    """
    lp = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    lq = got - mx.logsumexp(got, axis=-1, keepdims=True)
    kl = (mx.exp(lp) * (lp - lq)).sum(axis=-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).astype(mx.float32).mean()
    return kl.mean().item(), kl.max().item(), top1.item()


def run(preset: str, seqs: int, length: int, seed: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        src = write_checkpoint(Path(tmp) / "src", preset, seed=seed, tokenizer=False)
        ref_model = load_model(src, dtype=mx.float32)
        vocab = ref_model.args.vocab_size
        tokens = mx.array(np.random.default_rng(seed).integers(0, vocab, (seqs, length)))
        ref = ref_model(tokens)
        rows = []
        for bits, gs in WIDTHS:
            out = Path(tmp) / f"q{bits}-{gs}"
            convert(src, out, Settings(bits, gs), stream=io.StringIO())
            got = load_model(out, dtype=mx.float32)(tokens)
            kl, kl_max, top1 = compare(ref, got)
            rows.append({"bits": bits, "group": gs, "dense_mb": dense_mb(out), "kl": kl,
                         "kl_max": kl_max, "top1": top1})
    return rows


def table(rows: list[dict], preset: str, seqs: int, length: int) -> str:
    lines = [f"Dense quantization quality, synthetic `{preset}` checkpoint, {seqs} x {length} "
             "random tokens, fp32 compute; reference: the unconverted checkpoint.", "",
             "| dense bits | group | dense MB | mean KL (nats/token) | max KL | top-1 agreement |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        group = "-" if r["bits"] == 16 else r["group"]
        lines.append(f"| {r['bits']} | {group} | {r['dense_mb']:.2f} | {r['kl']:.3g} | "
                     f"{r['kl_max']:.3g} | {100 * r['top1']:.1f}% |")
    return "\n".join(lines)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the table (and the command) to this file")
    return parser


def main(argv=None):
    a = setup_arg_parser().parse_args(argv)
    text = table(run(a.preset, a.seqs, a.length, a.seed), a.preset, a.seqs, a.length)
    print(text)
    if a.out:
        cmd = "python benchmarks/quant_quality.py " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv)
        Path(a.out).write_text(f"{text}\n\nReproduce: `{cmd.strip()}`\n")


if __name__ == "__main__":
    main()
