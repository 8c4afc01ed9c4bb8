"""Training through the custom kernels: forward on the kernels (here the Metal source run by
the emulator), gradients from the reference, equal to training on the reference alone."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from conftest import rel_err
from mlx.utils import tree_flatten
from model_kernel_check import KERNEL_SHAPES

from kimi_k3.checkpoint.loader import load_model


def _loss_and_grads(model, tokens):
    def loss(m):
        logits = m(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")

    value, grads = nn.value_and_grad(model, loss)(model)
    mx.eval(value, grads)
    return value, dict(tree_flatten(grads))


def test_gradients_through_kernels_match_reference(ckpt_factory, monkeypatch):
    path = ckpt_factory("tiny", **KERNEL_SHAPES)
    model = load_model(path, dtype=mx.float32)
    for layer in model.layers:
        if "block_sparse_moe" in layer:
            layer.block_sparse_moe.experts.freeze()  # MXFP4 experts stay frozen
    tokens = mx.array(np.random.default_rng(0).integers(0, 700, (1, 70)))
    monkeypatch.setenv("KIMI_K3_REFERENCE", "1")
    ref_loss, ref_grads = _loss_and_grads(model, tokens)
    monkeypatch.setenv("KIMI_K3_REFERENCE", "0")
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    loss, grads = _loss_and_grads(model, tokens)
    assert abs(float(loss) - float(ref_loss)) < 1e-4 * abs(float(ref_loss))
    assert grads.keys() == ref_grads.keys()
    for key in (
        "language_model.model.layers.0.self_attn.q_proj.weight",
        "language_model.model.layers.0.self_attn.A_log",
        "language_model.model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
        "language_model.model.layers.1.block_sparse_moe.gate.weight",
    ):
        assert float(mx.abs(ref_grads[key]).max()) > 0, key
        assert rel_err(grads[key], ref_grads[key]) < 1e-3, key
