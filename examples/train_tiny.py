"""Train a small Kimi K3 config: dense weights learn, the MXFP4 routed experts stay frozen.

    python examples/train_tiny.py --steps 30 --save tiny-trained.safetensors

Without ``--model`` a tiny random-weight checkpoint is written to a temporary directory.
The batch is fixed (windows of a short built-in text), so the loss falls as the model
memorises it. Gradients run through the pure-MLX reference path (KDA's chunked form,
MLX's quantized expert matmuls); ``main`` sets ``KIMI_K3_REFERENCE=1`` so custom kernels,
which have no backward pass, stay out of the way on GPUs.
"""

from __future__ import annotations

import argparse
import os

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from kimi_k3.checkpoint.loader import load_model
from kimi_k3.convert.synth import checkpoint_or_synthetic
from kimi_k3.text.tokenizer import load_tokenizer

TEXT = (
    "Kimi K3 mixes two kinds of attention. Most layers use Kimi Delta Attention, a linear "
    "recurrence whose state forgets each channel at its own rate; every fourth layer uses "
    "multi-head latent attention with no positional encoding. Between them, attention "
    "residuals replace the plain residual stream with a learned mix of block summaries, "
    "and each mixture-of-experts layer sends every token to sixteen of its experts. "
)


def freeze_experts(model: nn.Module) -> nn.Module:
    """Make only dense weights trainable.

    Routed experts are MXFP4 (packed integers: no gradient exists), and the router's
    ``e_score_correction_bias`` is set by load balancing, not by gradients.
    """
    model.unfreeze()
    for layer in model.layers:
        if "block_sparse_moe" in layer:
            layer.block_sparse_moe.experts.freeze()
            layer.block_sparse_moe.gate.freeze(keys=["e_score_correction_bias"])
    return model


def fixed_batch(ids: list[int], batch: int, seq: int) -> mx.array:
    """``batch`` windows of ``seq + 1`` tokens, evenly spaced over ``ids`` (repeated if short).

    Shapes: returns int32 [batch, seq + 1].
    """
    while len(ids) < seq + 1:
        ids = ids + ids
    starts = np.linspace(0, len(ids) - seq - 1, batch).astype(int)
    return mx.array(np.stack([ids[s : s + seq + 1] for s in starts]), dtype=mx.int32)


def loss_fn(model, x: mx.array, y: mx.array) -> mx.array:
    """Mean next-token cross entropy. Shapes: x, y [B, T]."""
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def train(model, batch: mx.array, steps: int, lr: float, log=print) -> list[float]:
    """Adam on a fixed batch; returns the loss of every step."""
    freeze_experts(model).train()
    opt = optim.Adam(learning_rate=lr)
    step = nn.value_and_grad(model, loss_fn)
    losses = []
    for i in range(steps):
        loss, grads = step(model, batch[:, :-1], batch[:, 1:])
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
        log(f"step {i + 1:3d}  loss {losses[-1]:.4f}")
    return losses


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny synthetic one)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--save", help="write the trained dense weights here (.safetensors)")
    return parser


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    # The KDA dispatcher reads this on every call: the reference path, which has gradients.
    os.environ.setdefault("KIMI_K3_REFERENCE", "1")
    with checkpoint_or_synthetic(args.model) as path:
        model = load_model(path, dtype=mx.float32)
        ids = load_tokenizer(path).encode(TEXT)
    batch = fixed_batch(ids, args.batch, args.seq)
    n = sum(v.size for _, v in tree_flatten(freeze_experts(model).trainable_parameters()))
    print(f"{n:,} trainable parameters; batch {tuple(batch.shape)}")
    losses = train(model, batch, args.steps, args.lr)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if args.save:
        mx.save_safetensors(args.save, dict(tree_flatten(model.trainable_parameters())))
        print(f"saved the dense weights to {args.save}")


if __name__ == "__main__":
    main()
