"""Quality of the converter's dense quantization: KL divergence and top-1 agreement of the
next-token distributions against the unconverted checkpoint.

    python -m benchmarks.quant_quality --out quant_quality.md
    python -m benchmarks.quant_quality --quick    # tiny preset, 2 x 16 tokens: seconds

A synthetic checkpoint (preset ``small`` by default) is converted at each dense width with
``kimi_k3.convert.convert``; every model runs in fp32 so only the weights differ. Routed
experts are MXFP4 in both (copied bit-exactly), so the table measures the dense trunk alone.
A random-weight model is far more sensitive than a trained one (its next-token distribution
is nearly flat and its routing flips easily), so the table also gives the weight error itself
and, as a yardstick, the same model with Gaussian noise of a known size added to the weights
the quantizer touches.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from benchmarks import timing
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.convert.convert import Settings, convert
from kimi_k3.convert.synth import write_checkpoint

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


def _touched(model) -> dict:
    """The dense weights the converter may quantize, by module path."""
    return {
        p: m
        for p, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
        if "weight" in m and model.quant_predicate(p, m)
    }


def weight_error(ref_model, model) -> float:
    """Relative RMS error over every quantized dense weight (dequantized vs original)."""
    err = norm = 0.0
    ref = _touched(ref_model)
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
            orig = ref[path].weight
            err += ((w - orig) ** 2).sum().item()
            norm += (orig**2).sum().item()
    return (err / norm) ** 0.5 if norm else 0.0


def add_noise(model, eps: float, seed: int):
    """Gaussian noise of relative RMS ``eps`` on every weight the quantizer may touch."""
    key = mx.random.key(seed)
    for m in _touched(model).values():
        key, sub = mx.random.split(key)
        w = m.weight
        m.weight = w + eps * mx.sqrt((w * w).mean()) * mx.random.normal(w.shape, key=sub)
    return model


def run(preset: str, seqs: int, length: int, seed: int, noise: tuple) -> tuple[list, float]:
    with tempfile.TemporaryDirectory() as tmp:
        src = write_checkpoint(Path(tmp) / "src", preset, seed=seed, tokenizer=False)
        ref_model = load_model(src, dtype=mx.float32)
        vocab = ref_model.args.vocab_size
        tokens = mx.array(np.random.default_rng(seed).integers(0, vocab, (seqs, length)))
        ref = ref_model(tokens)
        lp = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
        entropy = -(mx.exp(lp) * lp).sum(-1).mean().item()
        rows = []
        for bits, gs in WIDTHS:
            out = Path(tmp) / f"q{bits}-{gs}"
            convert(src, out, Settings(bits, gs), stream=io.StringIO())
            model = load_model(out, dtype=mx.float32)
            kl, kl_max, top1 = compare(ref, model(tokens))
            rows.append(
                {
                    "what": f"dense {bits}-bit" + (f", group {gs}" if bits < 16 else ""),
                    "dense_mb": f"{dense_mb(out):.2f}",
                    "werr": weight_error(ref_model, model),
                    "kl": kl,
                    "kl_max": kl_max,
                    "top1": top1,
                }
            )
        for eps in noise:
            model = add_noise(load_model(src, dtype=mx.float32), eps, seed)
            kl, kl_max, top1 = compare(ref, model(tokens))
            rows.append(
                {
                    "what": "Gaussian noise (yardstick)",
                    "dense_mb": "-",
                    "werr": eps,
                    "kl": kl,
                    "kl_max": kl_max,
                    "top1": top1,
                }
            )
    return rows, entropy


def table(rows: list[dict], entropy: float, preset: str, seqs: int, length: int) -> str:
    lines = [
        f"Dense quantization quality, synthetic `{preset}` checkpoint (random weights), "
        f"{seqs} x {length} random tokens, fp32 compute; reference: the unconverted "
        f"checkpoint, whose next-token entropy is {entropy:.2f} nats on average.",
        "",
        "| weights | dense MB | weight rel. RMS error | mean KL (nats/token) | max KL "
        "| top-1 agreement |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['what']} | {r['dense_mb']} | {r['werr']:.2g} | {r['kl']:.3g} | "
            f"{r['kl_max']:.3g} | {100 * r['top1']:.1f}% |"
        )
    return "\n".join(lines)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--noise",
        type=float,
        nargs="*",
        default=[1e-4, 1e-3],
        help="relative RMS of the Gaussian yardstick rows",
    )
    parser.add_argument("--quick", action="store_true", help="tiny preset, 2 x 16 tokens")
    parser.add_argument("--out", help="write the table (and the command) to this file")
    return parser


def main(argv=None):
    a = setup_arg_parser().parse_args(argv)
    if a.quick:
        a.preset, a.seqs, a.length, a.noise = "tiny", 2, 16, [1e-3]
    rows, entropy = run(a.preset, a.seqs, a.length, a.seed, tuple(a.noise))
    text = table(rows, entropy, a.preset, a.seqs, a.length)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    text += f"\n\n{timing.environment()}; `python -m benchmarks.quant_quality {command}`\n"
    timing.emit(text, a.out)
    return text


if __name__ == "__main__":
    main()
