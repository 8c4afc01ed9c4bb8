"""Quality of a Kimi K3 checkpoint on held-out text: perplexity, KL and learned routing.

    python -m kimi_k3.eval                          # the embedded default and its variants
    python -m kimi_k3.eval --model DIR --tokens 8192
    python -m kimi_k3.eval --state OUT/train_state.safetensors   # adds the fp32 trained rows

Perplexity is ``exp`` of the mean next-token negative log-likelihood over non-overlapping
windows of ``--seq`` tokens of the held-out text (each window predicted from its own
context only). KL is the mean over tokens of ``KL(reference || variant)`` between the two
next-token distributions, the reference being the checkpoint as given, computed in fp32.
Variants: the same checkpoint computed in bf16, with its dense weights quantized to 8 and
4 bits (MLX affine, group 64; experts, AttnRes and conv kernels untouched), its routed
experts requantized from MXFP4 to 3 and 2 bits as ``python -m kimi_k3.convert
--expert-bits`` does (``kimi_k3.convert.requant``; the rows sit beside the routed-expert
ablation, which bounds what any expert format can cost on this checkpoint), the fp32 model
before MXFP4 and bf16 rounding (``--state``), and a random-weight model of the same
shape. Ablations say what the parts of the MoE carry: every routed expert's output zeroed
(the shared experts alone), the shared experts zeroed, and each token's routed experts
cut to the top half of its choices (``top_k // 2``, weights renormalised as the router
does).

Routing, per MoE layer, over the held-out windows: the load (share of routed choices per
expert: max and min over the mean), its entropy over ``log(num_experts)`` (1 = uniform),
the share of a token's experts that the previous token also chose (random routing gives
``k / num_experts``), and the mean distance back to the last token that chose the same
expert (within a window; choices seen first in their window are not counted).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kimi_k3 import train
from kimi_k3.checkpoint.files import CheckpointError
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.convert.requant import requantize_model
from kimi_k3.convert.synth import write_checkpoint
from kimi_k3.default_model import ensure_default_model, heldout_text
from kimi_k3.kernels.dispatch import reference_paths
from kimi_k3.model.config import ConfigError, read_config_json
from kimi_k3.model.experts import FORMATS, MXFP4, expert_format
from kimi_k3.model.model import Model
from kimi_k3.model.moe import moe_blocks, route_hooks
from kimi_k3.progress import Progress, duration
from kimi_k3.text.tokenizer import RANK_FILE, load_tokenizer, read_ranks


def windows(ids: np.ndarray, seq: int, max_tokens: int | None = None) -> np.ndarray:
    """Non-overlapping windows of ``seq + 1`` ids (the last id of one is the first of the
    next), at most ``max_tokens`` predicted tokens. Shapes: returns int32 [n, seq + 1]."""
    n = (len(ids) - 1) // seq
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq))
    if n < 1:
        raise ValueError(f"{len(ids)} tokens make no window of {seq + 1}")
    return np.stack([ids[i * seq : i * seq + seq + 1] for i in range(n)]).astype(np.int32)


def _logprobs(model: Model, x: mx.array) -> mx.array:
    logits = model(x).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def compare(
    reference: Model,
    variants: dict,
    wins: np.ndarray,
    batch: int = 4,
    progress=None,
    token_bytes: np.ndarray | None = None,
) -> dict[str, dict]:
    """Perplexity of the reference and of each variant, and each variant's mean per-token
    KL from the reference. ``variants`` maps names to models. Returns
    ``{name: {"ppl": ..., "kl": ...}}`` with the reference first (KL 0); with
    ``token_bytes`` (each id's length in bytes, ``token_byte_lengths``) also
    ``"nats_per_byte"``: the NLL over the bytes of the predicted text, which compares
    models whose tokenizers differ. ``progress``, if given, is called as
    ``progress(done, total)`` in windows after each batch."""
    nll = {name: 0.0 for name in ["reference", *variants]}
    kl = dict.fromkeys(nll, 0.0)
    count = 0
    for i in range(0, len(wins), batch):
        w = mx.array(wins[i : i + batch])
        x, y = w[:, :-1], w[:, 1:]
        ref = _logprobs(reference, x)
        pr = mx.exp(ref)
        nll["reference"] += _nll_sum(ref, y)
        for name, model in variants.items():
            lp = _logprobs(model, x)
            nll[name] += _nll_sum(lp, y)
            kl[name] += (pr * (ref - lp)).sum().item()
        count += y.size
        if progress is not None:
            progress(min(i + batch, len(wins)), len(wins))
    out = {n: {"ppl": math.exp(nll[n] / count), "kl": kl[n] / count} for n in nll}
    if token_bytes is not None:
        nbytes = int(token_bytes[wins[:, 1:]].sum())
        for n in out:
            out[n]["nats_per_byte"] = nll[n] / nbytes
    return out


def token_byte_lengths(path: str | Path, vocab_size: int) -> np.ndarray:
    """Each token id's length in bytes under the tokenizer of the checkpoint at ``path``
    (special and unused ids: 0, they stand for no text). Shapes: returns int64 [V]."""
    lengths = np.zeros(vocab_size, np.int64)
    ranks = read_ranks(Path(path) / RANK_FILE)
    lengths[: len(ranks)] = [len(r) for r in ranks[:vocab_size]]
    return lengths


def _nll_sum(lp: mx.array, y: mx.array) -> float:
    return -mx.take_along_axis(lp, y[..., None], axis=-1).sum().item()


def perplexity(model: Model, wins: np.ndarray, batch: int = 4) -> float:
    """``exp`` of the mean next-token NLL over ``wins`` [n, seq + 1]."""
    total, count = 0.0, 0
    for i in range(0, len(wins), batch):
        w = mx.array(wins[i : i + batch])
        total += _nll_sum(_logprobs(model, w[:, :-1]), w[:, 1:])
        count += w[:, 1:].size
    return math.exp(total / count)


def routing_choices(model: Model, wins: np.ndarray, batch: int = 4) -> dict[int, np.ndarray]:
    """The router's choices on ``wins``: ``{layer: inds [n, seq, k]}``."""
    seq = wins.shape[1] - 1
    seen: dict[int, list] = {}

    def hook(moe, flat):
        seen.setdefault(moe.layer_index, []).append(moe.gate(flat)[0])

    with route_hooks(model, hook):
        for i in range(0, len(wins), batch):
            model(mx.array(wins[i : i + batch, :-1]))
            for chunks in seen.values():
                mx.eval(chunks[-1])
    return {
        layer: np.concatenate([np.array(c) for c in chunks]).reshape(-1, seq, chunks[0].shape[-1])
        for layer, chunks in seen.items()
    }


def moe_output_rms(model: Model, wins: np.ndarray, batch: int = 4) -> dict[int, dict]:
    """Per MoE layer, the root mean square over tokens and channels of the two parts the
    block adds: the routed part (``up(RMSNorm(routed sum))``, whose size the latent norm
    bounds) and the shared experts' output. Returns ``{layer: {"routed", "shared"}}``."""
    sums: dict[int, list] = {}  # layer -> [routed sum of squares, shared's, elements]

    def hook(moe, flat):
        inds, weights = moe.gate(flat)
        y = moe.experts(moe.routed_expert_down_proj(flat), inds, weights)
        routed = moe.routed_expert_up_proj(moe.routed_expert_norm(y.astype(flat.dtype)))
        acc = sums.setdefault(moe.layer_index, [0.0, 0.0, 0])
        for j, t in enumerate((routed, moe.shared_experts(flat))):
            acc[j] = acc[j] + mx.square(t.astype(mx.float32)).sum()
        acc[2] += flat.size

    with route_hooks(model, hook):
        for i in range(0, len(wins), batch):
            mx.eval(model(mx.array(wins[i : i + batch, :-1])), [a[:2] for a in sums.values()])
    return {
        layer: {"routed": math.sqrt(float(r) / n), "shared": math.sqrt(float(s) / n)}
        for layer, (r, s, n) in sorted(sums.items())
    }


def routing_stats(inds: np.ndarray, num_experts: int) -> dict:
    """Load balance and temporal reuse of one layer's choices ``inds`` [n, seq, k]."""
    n, seq, k = inds.shape
    load = np.bincount(inds.reshape(-1), minlength=num_experts) / inds.size
    p = load[load > 0]
    chosen = np.zeros((n, seq, num_experts), bool)
    np.put_along_axis(chosen, inds, True, axis=-1)
    overlap = (chosen[:, 1:] & chosen[:, :-1]).sum(-1).mean() / k
    last = np.full((n, num_experts), -1)
    dists = []
    for t in range(seq):
        prev = np.take_along_axis(last, inds[:, t], axis=-1)
        dists.append(np.where(prev >= 0, t - prev, 0)[prev >= 0])
        np.put_along_axis(last, inds[:, t], t, axis=-1)
    dists = np.concatenate(dists)
    return {
        "max_load": float(load.max() * num_experts),
        "min_load": float(load.min() * num_experts),
        "load_entropy": float(-(p * np.log(p)).sum() / math.log(num_experts)),
        "prev_token_overlap": float(overlap),
        "mean_reuse_distance": float(dists.mean()) if dists.size else float("nan"),
    }


def quantized_dense(path: str | Path, bits: int) -> Model:
    """The checkpoint with its dense weights MLX-quantized (affine, group 64) to ``bits``;
    the model's ``quant_predicate`` picks the layers (never the experts)."""
    model = load_model(path, dtype=mx.float32)
    predicate = model.quant_predicate

    def pick(p, m):
        choice = predicate(p, m)
        return {"group_size": 64, "bits": bits} if choice is True else choice

    nn.quantize(model, group_size=64, bits=bits, class_predicate=pick)
    return model


def variants(path: str | Path, state: str | Path | None = None, random: bool = True) -> dict:
    """``{name: model}``: the checkpoint at ``path`` computed in fp32 (``"reference"``) and
    its variants (see the module docstring)."""
    out = {"reference": load_model(path, dtype=mx.float32)}
    if state is not None:
        fp32 = train.load_state(state)
        out["fp32 trained (float experts)"] = fp32
        out["MXFP4 experts, fp32 dense"] = _mxfp4_experts(train.load_state(state))
    out["bf16 compute"] = load_model(path, dtype=mx.bfloat16)
    out["8-bit dense"] = quantized_dense(path, 8)
    out["4-bit dense"] = quantized_dense(path, 4)
    out.update(expert_format_variants(path))
    out["routed experts zeroed (shared only)"] = without_routed_experts(
        load_model(path, dtype=mx.float32)
    )
    out["shared experts zeroed"] = without_shared_experts(load_model(path, dtype=mx.float32))
    half = load_model(path, dtype=mx.float32)
    k = set_top_k(half, max(1, half.args.num_experts_per_token // 2))
    out[f"top-k halved ({half.args.num_experts_per_token} -> {k})"] = half
    if random:
        out["random weights"] = random_model(path)
    return out


def expert_format_variants(path: str | Path, bits=(3, 2)) -> dict:
    """``{name: model}``: the checkpoint in fp32 with its routed experts requantized to each
    of ``bits`` (``FORMATS``), as the converter writes them; none for a checkpoint whose
    experts are not MXFP4 (a converted lower-bit one): there is nothing to requantize."""
    out = {}
    for b in bits:
        model = load_model(path, dtype=mx.float32, expert_layout="mlx")
        if expert_format(model.args) != MXFP4:
            return {}
        out[f"experts {FORMATS[b]} (--expert-bits {b})"] = requantize_model(model, FORMATS[b])
    return out


class ZeroRouted(nn.Module):
    """An expert store whose every expert outputs zero: the routed sum is zero, and so
    is the latent norm's output (``RMSNorm(0) = 0``), so the MoE block gives its shared
    experts' output alone."""

    def __call__(self, z: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        return mx.zeros(z.shape, mx.float32)


class _ZeroShared(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return mx.zeros_like(x)


def without_routed_experts(model: Model) -> Model:
    """``model`` with every routed expert's output zeroed (in place): the shared experts
    alone. What the routed experts carry is the NLL this costs."""
    for moe in moe_blocks(model).values():
        moe.experts = ZeroRouted()
    return model


def without_shared_experts(model: Model) -> Model:
    """``model`` with every MoE layer's shared experts zeroed (in place)."""
    for moe in moe_blocks(model).values():
        moe.shared_experts = _ZeroShared()
    return model


def set_top_k(model: Model, k: int) -> int:
    """Route each token to its ``k`` best experts instead of ``num_experts_per_token`` (in
    place; the router renormalises the kept weights as it does at full ``k``). Returns k."""
    if not 1 <= k <= model.args.num_experts:
        raise ValueError(f"top-k {k} is outside 1..{model.args.num_experts}")
    for moe in moe_blocks(model).values():
        moe.gate.top_k = k
    return k


def _mxfp4_experts(model: Model) -> Model:
    for moe in moe_blocks(model).values():
        e = moe.experts
        e.w1, e.w2, e.w3 = (train.dequantize_mxfp4(w) for w in (e.w1, e.w2, e.w3))
    mx.eval(model.parameters())
    return model


def random_model(path: str | Path, seed: int = 0) -> Model:
    """A random-weight model of the same shape as the checkpoint at ``path`` (seeded)."""
    preset = train.preset_of(read_config_json(path)["text_config"])
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, preset, seed=seed, tokenizer=False)
        model = load_model(tmp, dtype=mx.float32, verify_checksums=False)
        mx.eval(model.parameters())
    return model


def heldout_ids(path: str | Path, text_file: str | Path | None = None) -> np.ndarray:
    """The held-out text (default: the one shipped with the default model) as token ids of
    the checkpoint's tokenizer."""
    text = Path(text_file).read_text(encoding="utf-8") if text_file else heldout_text()
    return np.asarray(load_tokenizer(path).encode(text), dtype=np.int32)


def format_table(results: dict[str, dict]) -> str:
    """The variants' table: perplexity, NLL (nats/token, the log of the perplexity) and its
    change from the reference (the first row), KL from the reference, and nats/byte where
    given."""
    per_byte = all("nats_per_byte" in r for r in results.values())
    head = (
        "| variant | perplexity | NLL (nats/token) | NLL change | KL from reference (nats/token) |"
    )
    rows = [
        head + (" nats/byte |" if per_byte else ""),
        "|---|---:|---:|---:|---:|" + "---:|" * per_byte,
    ]
    base = math.log(next(iter(results.values()))["ppl"])
    for n, r in results.items():
        nll = math.log(r["ppl"])
        row = f"| {n} | {r['ppl']:.2f} | {nll:.4f} | {nll - base:+.4f} | {r['kl']:.4f} |"
        rows.append(row + (f" {r['nats_per_byte']:.4f} |" if per_byte else ""))
    return "\n".join(rows)


def format_routing(stats: dict[str, dict[int, dict]]) -> str:
    head = (
        "| model | layer | max load / mean | min load / mean | load entropy | "
        "overlap with previous token | mean reuse distance |"
    )
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for name, layers in stats.items():
        for layer, s in layers.items():
            rows.append(
                f"| {name} | {layer} | {s['max_load']:.2f} | {s['min_load']:.2f} | "
                f"{s['load_entropy']:.3f} | {s['prev_token_overlap']:.3f} | "
                f"{s['mean_reuse_distance']:.1f} |"
            )
    return "\n".join(rows)


def format_moe_parts(parts: dict[int, dict]) -> str:
    rows = [
        "| layer | routed part RMS | shared experts RMS | routed / shared |",
        "|---:|---:|---:|---:|",
    ]
    rows += [
        f"| {layer} | {p['routed']:.3f} | {p['shared']:.3f} | {p['routed'] / p['shared']:.2f} |"
        for layer, p in parts.items()
    ]
    return "\n".join(rows)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kimi_k3.eval", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", help="checkpoint directory (default: the embedded default)")
    parser.add_argument("--text", help="held-out text file (default: the shipped sample)")
    parser.add_argument("--state", help="a training state (kimi_k3.train) for the fp32 rows")
    parser.add_argument("--tokens", type=int, default=8192, help="held-out tokens to score")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--no-random", action="store_true", help="skip the random-weight rows")
    parser.add_argument("--json", help="also write the results here")
    return parser


def main(argv=None) -> int:
    """Returns the exit status: 0, or 1 after one ``error:`` line for a checkpoint, text or
    state file that cannot be used (bad flags exit 2 through argparse)."""
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    for flag in ("tokens", "seq"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")

    try:
        with reference_paths():  # the oracle's paths, for this call alone
            _evaluate(args)
    except (CheckpointError, ConfigError, OSError, UnicodeDecodeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _evaluate(args):
    if args.model is None:
        args.model = ensure_default_model()
    wins = windows(heldout_ids(args.model, args.text), args.seq, args.tokens)
    print(f"loading {args.model} and its variants ...", file=sys.stderr, flush=True)
    models = variants(args.model, args.state, random=not args.no_random)
    reference = models.pop("reference")
    print(
        f"scoring {wins.size - len(wins)} tokens with the reference and {len(models)} variants",
        file=sys.stderr,
        flush=True,
    )
    lengths = token_byte_lengths(args.model, reference.args.vocab_size)
    with Progress(len(wins), "scoring", "window") as bar:
        results = compare(reference, models, wins, progress=bar.to, token_bytes=lengths)
    passes = 2 + ("random weights" in models)  # routing of each model, the MoE parts
    left = (time.perf_counter() - bar.start) * passes / (1 + len(models))
    print(
        f"routing and MoE statistics: {passes} more passes, about {duration(left)}",
        file=sys.stderr,
        flush=True,
    )
    print(f"{wins.size - len(wins)} held-out tokens in windows of {args.seq}\n")
    print(format_table(results))
    E = reference.args.num_experts
    routing = {"trained": _routing(reference, wins, E)}
    if "random weights" in models:
        routing["random weights"] = _routing(models["random weights"], wins, E)
    print()
    print(format_routing(routing))
    parts = moe_output_rms(reference, wins)
    print()
    print(format_moe_parts(parts))
    if args.json:
        out = {"perplexity": results, "routing": routing, "moe_output_rms": parts}
        Path(args.json).write_text(json.dumps(out))


def _routing(model: Model, wins: np.ndarray, num_experts: int) -> dict[int, dict]:
    choices = routing_choices(model, wins)
    return {layer: routing_stats(inds, num_experts) for layer, inds in sorted(choices.items())}


if __name__ == "__main__":
    sys.exit(main())
