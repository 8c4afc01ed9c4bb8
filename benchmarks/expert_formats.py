"""Lower-bit experts: the error each format makes, and what it costs a model.

    python -m benchmarks.expert_formats --out expert_formats.md     # the embedded default
    python -m benchmarks.expert_formats --model DIR --out OUT.md    # another MXFP4 checkpoint
    python -m benchmarks.expert_formats --quick                     # small sizes: a smoke run

Every quality figure of ``python -m kimi_k3.convert --expert-bits`` in one run (about 10
minutes on a 2-core machine; the model section is most of it):

1. **Candidates**, how the formats were chosen: MLX ``affine`` at 2 and 3 bits, groups of 32,
   64 and 128, fitted by MLX's own ``mx.quantize`` (a min/max grid) or by this project's
   least-squares requantization (``kimi_k3.convert.requant``), against MXFP4: bits per
   weight, the bytes of a K3 expert, and the relative RMS weight error on Gaussian weights
   through MXFP4 at K3's widths and on the checkpoint's own experts.
2. **One expert layer** per shipped format (``FORMATS``): the relative RMS error of the
   routed sum against MXFP4's, for a K3-width layer of random (Gaussian through MXFP4)
   experts, top-16 on random latents, and for each MoE layer of the checkpoint on the
   latents and routing that its held-out text gives; and the time to requantize one K3
   expert on one core.
3. **The model**: perplexity, NLL and KL from the MXFP4 checkpoint on held-out text, a row
   per format, beside the routed-expert ablation (every routed expert zeroed: the shared
   experts alone), which says how much any expert format could cost this checkpoint
   (``kimi_k3.eval``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks import timing
from kimi_k3.checkpoint.expert_pack import RecordLayout
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.cli import markdown_table
from kimi_k3.convert import requant
from kimi_k3.default_model import ensure_default_model
from kimi_k3.eval import (
    compare,
    expert_format_variants,
    heldout_ids,
    token_byte_lengths,
    windows,
    without_routed_experts,
)
from kimi_k3.kernels.dispatch import reference_paths
from kimi_k3.model.experts import FORMATS, MXFP4, ExpertFormat, expert_glu_reference
from kimi_k3.model.moe import moe_blocks, route_hooks

K3 = (3584, 3072)  # latent, expert hidden size
BETA, CAP = 4.0, 25.0


def gaussian_mxfp4(rows: int, cols: int, seed: int):
    """Gaussian weights of variance 1 / cols through MXFP4 (as trained weights become the
    published experts): compressed-tensors bytes (packed u8 [rows, cols/2], scales u8)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)
    q, s = mx.quantize(mx.array(w), group_size=32, bits=4, mode="mxfp4")
    return np.array(q).view(np.uint8), np.array(s)


def weight_error(w: np.ndarray, fmt: ExpertFormat, fit: str) -> float:
    """Relative RMS error of ``w`` (float32, the MXFP4 values) in ``fmt`` fitted by ``fit``:
    ``mx.quantize`` (MLX's grid, float16 scales from float16 weights) or ``lsq``."""
    if fit == "mx.quantize":
        q, s, b = mx.quantize(mx.array(w).astype(mx.float16), fmt.group_size, fmt.bits)
        got = np.array(mx.dequantize(q, s, b, fmt.group_size, fmt.bits).astype(mx.float32))
    else:
        got = requant.dequantize_affine(
            *requant.quantize_affine(w, fmt.bits, fmt.group_size), fmt.bits
        )
    return float(np.linalg.norm(got - w) / np.linalg.norm(w))


def checkpoint_matrices(model) -> list[np.ndarray]:
    """Every routed expert matrix of ``model`` (resident MXFP4) as float32, the rows of the
    matrices of one shape stacked into one array (groups lie within rows, so a format fits
    the stack as it fits each matrix)."""
    by_width: dict[int, list] = {}
    for moe in moe_blocks(model).values():
        for q, s in moe.experts.tensors().values():
            q, s = np.array(q).view(np.uint8), np.array(s)
            rows = requant.dequantize_mxfp4(q.reshape(-1, q.shape[-1]), s.reshape(-1, s.shape[-1]))
            by_width.setdefault(rows.shape[1], []).append(rows)
    return [np.concatenate(v) for v in by_width.values()]


def pooled_error(mats: list[np.ndarray], fmt: ExpertFormat, fit: str) -> float | None:
    """The relative RMS error over ``mats`` taken together (None where the format's groups
    do not divide a width)."""
    if any(m.shape[1] % fmt.group_size for m in mats):
        return None
    num = den = 0.0
    for m in mats:
        e = weight_error(m, fmt, fit) * np.linalg.norm(m)
        num, den = num + e * e, den + float(np.square(m, dtype=np.float64).sum())
    return math.sqrt(num / den)


def candidates_section(model, dims: tuple[int, int]) -> list[str]:
    D, I = dims
    gauss = [
        requant.dequantize_mxfp4(*gaussian_mxfp4(I, D, 0)),
        requant.dequantize_mxfp4(*gaussian_mxfp4(D, I, 1)),
    ]
    own = checkpoint_matrices(model)
    k3 = {b: RecordLayout.from_format(f, *K3).data_bytes for b, f in FORMATS.items()}
    rows = [["MXFP4 (published)", "-", "4.25", f"{k3[4] / 1e6:.2f}", "1.000", "0", "0"]]
    for bits in (3, 2):
        for group in (32, 64, 128):
            fmt = ExpertFormat("affine", bits, group)
            size = RecordLayout.from_format(fmt, *K3).data_bytes
            for fit in ("mx.quantize", "lsq"):
                g = pooled_error(gauss, fmt, fit)
                o = pooled_error(own, fmt, fit)
                shipped = " (shipped)" if fmt in FORMATS.values() and fit == "lsq" else ""
                rows.append(
                    [
                        f"affine {bits}-bit, groups of {group}{shipped}",
                        "least squares" if fit == "lsq" else "mx.quantize",
                        f"{fmt.bits_per_weight():.3g}",
                        f"{size / 1e6:.2f}",
                        f"{size / k3[4]:.3f}",
                        f"{g:.4f}",
                        "- (groups do not divide its widths)" if o is None else f"{o:.4f}",
                    ]
                )
    head = [
        "format",
        "fit",
        "bits / weight",
        "K3 expert MB",
        "vs MXFP4",
        f"weight error, Gaussian {I}x{D} + {D}x{I} through MXFP4",
        "weight error, the checkpoint's experts",
    ]
    return [
        "## Candidates",
        "",
        "Relative RMS error of the weights against their MXFP4 values (what the converter "
        "starts from). `mx.quantize`: MLX's affine quantizer on the float16 weights (a "
        "min/max grid); least squares: `kimi_k3.convert.requant`. K3 expert MB: one record's "
        "data (K3's widths).",
        "",
        markdown_table(head, rows),
    ]


def layer_outputs(stacks: dict, z, inds, weights) -> mx.array:
    return expert_glu_reference(z, stacks, inds, weights, BETA, CAP)


def random_layer_errors(dims: tuple[int, int], experts: int, tokens: int) -> tuple[dict, float]:
    """``{bits: relative error}`` of a random layer's routed sum per format against MXFP4,
    and the CPU seconds to requantize one expert (the mean over the layer and the formats;
    CPU time, not wall time, so other work on the machine does not count)."""
    D, I = dims
    shapes = {"w1": (I, D), "w3": (I, D), "w2": (D, I)}
    mxfp4 = {}
    for i, (n, (r, c)) in enumerate(shapes.items()):
        parts = [gaussian_mxfp4(r, c, 100 * i + e) for e in range(experts)]
        mxfp4[n] = (
            mx.array(np.stack([q.view(np.uint32) for q, _ in parts])),
            mx.array(np.stack([s for _, s in parts])),
        )
    rng = np.random.default_rng(7)
    z = mx.array(rng.standard_normal((tokens, D)).astype(np.float32))
    inds = mx.array(np.stack([rng.permutation(experts) for _ in range(tokens)]).astype(np.int32))
    wts = rng.random((tokens, experts)) + 0.1
    wts = mx.array((wts / wts.sum(1, keepdims=True)).astype(np.float32))
    want = layer_outputs(mxfp4, z, inds, wts)
    errors, secs = {}, []
    for bits, fmt in FORMATS.items():
        if fmt == MXFP4:
            continue
        t0 = time.process_time()  # CPU seconds: numpy here runs on one core
        stacks = requant.requantize_stacks(mxfp4, fmt)
        secs.append((time.process_time() - t0) / experts)
        errors[bits] = rel_err(layer_outputs(stacks, z, inds, wts), want)
    return errors, float(np.mean(secs))


def rel_err(a: mx.array, b: mx.array) -> float:
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def checkpoint_layer_errors(model, wins: np.ndarray) -> dict[int, dict[int, float]]:
    """``{layer: {bits: relative error}}``: each MoE layer's routed sum on the latents and
    routing of the held-out windows, requantized against MXFP4."""
    seen: dict[int, list] = {}

    def hook(moe, flat):
        inds, weights = moe.gate(flat)
        seen.setdefault(moe.layer_index, []).append(
            (moe.routed_expert_down_proj(flat), inds, weights)
        )

    with route_hooks(model, hook):
        for i in range(0, len(wins), 4):
            model(mx.array(wins[i : i + 4, :-1]))
            mx.eval(seen)
    out = {}
    for layer, moe in moe_blocks(model).items():
        z, inds, weights = (mx.concatenate(a) for a in zip(*seen[layer], strict=True))
        stacks = moe.experts.tensors()
        want = layer_outputs(stacks, z, inds, weights)
        out[layer] = {
            b: rel_err(layer_outputs(requant.requantize_stacks(stacks, f), z, inds, weights), want)
            for b, f in FORMATS.items()
            if f != MXFP4
        }
    return out


def layer_section(model, wins, dims, experts, tokens) -> list[str]:
    D, I = dims
    random, secs = random_layer_errors(dims, experts, tokens)
    own = checkpoint_layer_errors(model, wins)
    E, k = model.args.num_experts, model.args.num_experts_per_token
    head = [
        "experts",
        f"random layer, {D} x {I}, top-{experts}",
        "the checkpoint's layers: mean",
        "min-max",
    ]
    rows = []
    for bits in sorted(random, reverse=True):
        errs = [e[bits] for e in own.values()]
        rows.append(
            [
                str(FORMATS[bits]),
                f"{random[bits]:.4f}",
                f"{np.mean(errs):.4f}",
                f"{min(errs):.4f}-{max(errs):.4f}",
            ]
        )
    per = ["MoE layer", *(str(FORMATS[b]) for b in sorted(random, reverse=True))]
    per_rows = [
        [str(layer), *(f"{e[b]:.4f}" for b in sorted(random, reverse=True))]
        for layer, e in own.items()
    ]
    n = wins.shape[0] * (wins.shape[1] - 1)
    return [
        "",
        "## One expert layer",
        "",
        f"Relative RMS error of a layer's routed sum (fp32, the reference path) against "
        f"MXFP4's. Random: {experts} experts at {D} x {I} (Gaussian weights through MXFP4), "
        f"each of {tokens} unit-normal latents routed to all {experts} with random weights. "
        f"The checkpoint: each MoE layer ({E} experts, top-{k}) on the latents and routing of "
        f"{n} held-out tokens. Requantizing one {D} x {I} expert took {secs:.2f} CPU seconds "
        "here (numpy on one core; the converter's writer threads run in parallel).",
        "",
        markdown_table(head, rows),
        markdown_table(per, per_rows),
    ]


def model_section(path, wins, token_bytes) -> list[str]:
    reference = load_model(path, dtype=mx.float32, expert_layout="mlx")
    rows = expert_format_variants(path)
    rows["routed experts zeroed (shared only)"] = without_routed_experts(
        load_model(path, dtype=mx.float32)
    )
    res = compare(reference, rows, wins, token_bytes=token_bytes)
    base = math.log(res["reference"]["ppl"])
    head = ["model", "perplexity", "NLL (nats/token)", "NLL change", "KL from MXFP4 (nats/token)"]
    table = []
    for name, r in res.items():
        nll = math.log(r["ppl"])
        label = "MXFP4 experts (the checkpoint)" if name == "reference" else name
        table.append(
            [label, f"{r['ppl']:.3f}", f"{nll:.4f}", f"{nll - base:+.4f}", f"{r['kl']:.5f}"]
        )
    n = wins.shape[0] * (wins.shape[1] - 1)
    return [
        "",
        "## The model",
        "",
        f"{n} held-out tokens in windows of {wins.shape[1] - 1}, fp32 (`kimi_k3.eval.compare`); "
        "the experts requantized as the converter does. If zeroing every routed expert moves "
        "NLL and KL by no more than a format does, this checkpoint cannot tell the formats "
        "apart.",
        "",
        markdown_table(head, table),
    ]


def setup_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", type=Path, help="an MXFP4 checkpoint (default: the embedded default)"
    )
    ap.add_argument("--tokens", type=int, default=8192, help="held-out tokens for the model rows")
    ap.add_argument(
        "--layer-tokens", type=int, default=1024, help="held-out tokens for the layer rows"
    )
    ap.add_argument("--experts", type=int, default=16, help="experts of the random K3-width layer")
    ap.add_argument("--out", type=Path, help="write the tables here")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    return ap


def main(argv=None) -> str:
    args = setup_arg_parser().parse_args(argv)
    dims, experts, tokens = K3, args.experts, 8
    if args.quick:
        dims, experts, tokens, args.tokens, args.layer_tokens = (256, 128), 2, 4, 256, 256
    path = args.model or ensure_default_model()
    command = " ".join(sys.argv[1:] if argv is None else argv)
    out = [
        f"Command: `python -m benchmarks.expert_formats {command}`",
        "",
        f"Checkpoint: {path}. Machine: {os.cpu_count()} cores; {timing.environment()}.",
        "",
    ]
    with reference_paths():
        model = load_model(path, dtype=mx.float32, expert_layout="mlx")
        ids = heldout_ids(path)
        out += candidates_section(model, dims)
        out += layer_section(model, windows(ids, 256, args.layer_tokens), dims, experts, tokens)
        lengths = token_byte_lengths(path, model.args.vocab_size)
        out += model_section(path, windows(ids, 256, args.tokens), lengths)
    text = "\n".join(out)
    timing.emit(text + "\n", args.out)
    return text


if __name__ == "__main__":
    main()
