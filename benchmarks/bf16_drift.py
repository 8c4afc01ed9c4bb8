"""How far bfloat16 moves the next-token distribution from float32: this project against
mlx-lm's ``kimi_k3``, on the same synthetic checkpoints and prompts, in one run.

For each preset and checkpoint seed, both models are loaded in float32 and in bfloat16 (the
default dtype); the table gives the mean KL(fp32 || bf16) over every position of each
prompt, and greedy top-1 agreement, per implementation. One prompt is a small sample: a
random tiny MoE flips routing choices under bf16 rounding, and each flip moves the logits
in a lump, so compare means over many checkpoints and prompts.

    python -m benchmarks.bf16_drift --out bf16_drift.md
    python -m benchmarks.bf16_drift --modules
    python -m benchmarks.bf16_drift --quick       # one tiny checkpoint, one prompt: seconds

``--modules`` compares block by block instead: each layer's token mixer and feed-forward
block, fed the same random bf16 input, against this project's fp32 block on that input
(relative RMS error; the fp32 models agree within 2e-6), for both implementations, and for
this project's KDA mixer once more with its conv outputs left in fp32 (mlx-lm's choice)
instead of rounded to bf16.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model as mlx_lm_load_model

from benchmarks import timing
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.convert.synth import write_checkpoint


def kl_and_top1(a: mx.array, b: mx.array) -> tuple[float, float]:
    la = a - mx.logsumexp(a, -1, keepdims=True)
    lb = b - mx.logsumexp(b, -1, keepdims=True)
    kl = float(mx.mean(mx.sum(mx.exp(la) * (la - lb), axis=-1)))
    return kl, float(mx.mean(mx.argmax(a, -1) == mx.argmax(b, -1)))


def drift(path: Path, prompts: list) -> dict:
    """{implementation: [(kl, top1) per prompt]}."""
    ours = load_model(path, dtype=mx.float32), load_model(path)
    ref32, _ = mlx_lm_load_model(path)
    ref32.set_dtype(mx.float32)
    ref16, _ = mlx_lm_load_model(path)
    out = {}
    for name, (m32, m16) in {"kimi_k3": ours, "mlx-lm": (ref32, ref16)}.items():
        out[name] = [kl_and_top1(m32(p), m16(p).astype(mx.float32)) for p in prompts]
    return out


def _rel(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.sqrt(mx.sum((a - b) ** 2) / mx.sum(b * b)))


def module_errors(path: Path, inputs: int, tokens: int) -> dict:
    """{block kind: [(ours, mlx-lm, ours with fp32 conv outputs or None)]}."""
    import kimi_k3.model.kda as kda

    o32, o16 = load_model(path, dtype=mx.float32), load_model(path)
    r16, _ = mlx_lm_load_model(path)  # the fp32 reference is ours (= mlx-lm's within 2e-6)
    layers = zip(*(m.language_model.model.layers for m in (o32, o16, r16)))
    mask = mx.tril(mx.ones((tokens, tokens), dtype=mx.bool_))
    out: dict = {}
    for a32, a16, b16 in layers:
        m = None if b16.is_linear else mask
        for s in range(inputs):
            x = mx.random.normal((1, tokens, o32.args.hidden_size), key=mx.random.key(s))
            x = x.astype(mx.bfloat16)
            xf = x.astype(mx.float32)
            want = a32.self_attn(a32.input_layernorm(xf), None)
            ours = _rel(a16.self_attn(a16.input_layernorm(x), None), want)
            theirs = _rel(b16.self_attn(b16.input_layernorm(x), m, None), want)
            alt = None
            if a16.is_linear:
                saved = kda.short_conv
                kda.short_conv = functools.partial(saved, out_dtype=mx.float32)
                try:
                    alt = _rel(a16.self_attn(a16.input_layernorm(x), None), want)
                finally:
                    kda.short_conv = saved
            kind = "KDA mixer" if a16.is_linear else "MLA"
            out.setdefault(kind, []).append((ours, theirs, alt))
            want = a32.ffn(a32.post_attention_layernorm(xf))
            ours = _rel(a16.ffn(a16.post_attention_layernorm(x)), want)
            theirs = _rel(b16.mlp(b16.post_attention_layernorm(x)), want)
            kind = "MoE" if "block_sparse_moe" in a16 else "dense MLP"
            out.setdefault(kind, []).append((ours, theirs, None))
    return out


def modules_table(args, command: str) -> str:
    every: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for seed in range(args.seeds):
                path = write_checkpoint(Path(tmp) / f"{preset}-{seed}", preset, seed=seed)
                for kind, rows in module_errors(path, args.prompts, args.tokens).items():
                    every.setdefault(kind, []).extend(rows)
    lines = [
        f"Command: `python -m benchmarks.bf16_drift {command}` ({args.prompts} random inputs "
        f"of {args.tokens} tokens per layer and checkpoint; {timing.environment()})",
        "",
        "| block | bf16 error, kimi_k3 | bf16 error, mlx-lm | kimi_k3, conv outputs in fp32 | n |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind, rows in every.items():
        ours = np.mean([r[0] for r in rows])
        theirs = np.mean([r[1] for r in rows])
        alts = [r[2] for r in rows if r[2] is not None]
        alt = f"{np.mean(alts):.2e}" if alts else ""
        lines.append(f"| {kind} | {ours:.2e} | {theirs:.2e} | {alt} | {len(rows)} |")
    return "\n".join(lines)


def setup_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "tiny-b"])
    ap.add_argument("--seeds", type=int, default=3, help="checkpoints per preset")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per checkpoint")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per prompt")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--modules", action="store_true", help="block-by-block errors instead")
    ap.add_argument("--quick", action="store_true", help="one tiny checkpoint, one prompt")
    return ap


def drift_table(args, command: str) -> str:
    prompts = [
        mx.array(np.random.default_rng(i).integers(0, 700, (1, args.tokens)))
        for i in range(args.prompts)
    ]
    rows, every = [], {"kimi_k3": [], "mlx-lm": []}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for seed in range(args.seeds):
                path = write_checkpoint(Path(tmp) / f"{preset}-{seed}", preset, seed=seed)
                d = drift(path, prompts)
                for name, vals in d.items():
                    every[name] += vals
                rows.append((preset, seed, d))
    lines = [
        f"Command: `python -m benchmarks.bf16_drift {command}` ({args.prompts} prompts of "
        f"{args.tokens} tokens per checkpoint; {timing.environment()})",
        "",
        "| preset | seed | KL kimi_k3 | KL mlx-lm | top-1 kimi_k3 | top-1 mlx-lm |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for preset, seed, d in rows + [("all", "", every)]:
        d = {n: d[n] for n in ("kimi_k3", "mlx-lm")}
        k = [np.mean([v[0] for v in vals]) for vals in d.values()]
        t = [np.mean([v[1] for v in vals]) for vals in d.values()]
        lines.append(f"| {preset} | {seed} | {k[0]:.4f} | {k[1]:.4f} | {t[0]:.3f} | {t[1]:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    if args.quick:
        args.presets, args.seeds, args.prompts, args.tokens = ["tiny"], 1, 1, 8
    command = " ".join(sys.argv[1:] if argv is None else argv)
    text = modules_table(args, command) if args.modules else drift_table(args, command)
    timing.emit(text + "\n", args.out)
    return text


if __name__ == "__main__":
    main()
