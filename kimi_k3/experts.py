"""Routed experts: the one interface the MoE block talks to, and the resident store.

An expert store is called as ``store(z, inds, weights)`` and returns the routing-weighted
sum of the chosen experts' SiTU-GLU outputs. The MoE block never sees where the weights
live: the resident store keeps them stacked in memory, the streamer (``kimi_k3.streaming``)
reads them from disk into a bounded cache, and both compute with ``expert_glu``.

MXFP4 layout (MLX ``mode="mxfp4"``, identical bytes to compressed-tensors): per expert
``w1`` (gate) and ``w3`` (up) are ``weight`` uint32 [I, D/8] + ``scales`` uint8 [I, D/32];
``w2`` (down) is ``weight`` uint32 [D, I/8] + ``scales`` uint8 [D, I/32].
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

GROUP = 32
EXPERT_TENSORS = ("w1", "w2", "w3")


@partial(mx.compile, shapeless=True)
def situ_glu(gate: mx.array, up: mx.array, beta: float, cap: float) -> mx.array:
    """``b*tanh(g/b)*sigmoid(g) * c*tanh(u/c)`` in fp32 (SiTU on the gate, soft cap on up)."""
    g = gate.astype(mx.float32)
    u = up.astype(mx.float32)
    return beta * mx.tanh(g / beta) * mx.sigmoid(g) * (cap * mx.tanh(u / cap))


def _qmm(x, w, s, idx, sorted_indices):
    return mx.gather_qmm(
        x,
        w,
        s,
        None,
        rhs_indices=idx,
        transpose=True,
        group_size=GROUP,
        bits=4,
        mode="mxfp4",
        sorted_indices=sorted_indices,
    )


def expert_glu_reference(
    z: mx.array, w: dict, inds: mx.array, weights: mx.array, beta: float, cap: float
) -> mx.array:
    """Weighted sum of SiTU-GLU experts with MLX's quantized ops (the reference).

    ``w`` maps ``w1``/``w2``/``w3`` to ``(weight, scales)`` stacked over a leading expert (or
    cache slot) axis that ``inds`` indexes.

    Shapes: z: [N, D]; inds: [N, k] int; weights: [N, k]. Returns fp32 [N, D].
    """
    N, k = inds.shape
    flat = inds.reshape(-1)
    order = mx.argsort(flat)
    idx = flat[order]
    xs = z[order // k][:, None, :]  # one row per (token, choice), grouped by expert
    sorted_ok = N * k > 1
    h = situ_glu(_qmm(xs, *w["w1"], idx, sorted_ok), _qmm(xs, *w["w3"], idx, sorted_ok), beta, cap)
    y = _qmm(h.astype(z.dtype), *w["w2"], idx, sorted_ok)[:, 0, :].astype(mx.float32)
    y = mx.zeros_like(y).at[order].add(y)  # back to (token, choice) order
    y = y.reshape(N, k, -1)
    return (y * weights.astype(mx.float32)[..., None]).sum(axis=1)


def expert_glu(z, w, inds, weights, beta, cap):
    """Dispatcher: the MXFP4 expert kernel where eligible, else ``expert_glu_reference``."""
    from kimi_k3.kernels import dispatch

    fn = dispatch.expert_glu_kernel(z, w, inds)
    if fn is None:
        return expert_glu_reference(z, w, inds, weights, beta, cap)
    # Kernels forward; gradients w.r.t. z and weights (training) through the reference.
    return dispatch.with_reference_vjp(
        lambda z_, wt: fn(z_, w, inds, wt, beta, cap),
        lambda z_, wt: expert_glu_reference(z_, w, inds, wt, beta, cap),
        [z, weights],
    )


class _Quant(nn.Module):
    def __init__(self, n: int, out_dims: int, in_dims: int):
        super().__init__()
        self.weight = mx.zeros((n, out_dims, in_dims // 8), dtype=mx.uint32)
        self.scales = mx.zeros((n, out_dims, in_dims // GROUP), dtype=mx.uint8)


class ResidentExperts(nn.Module):
    """All of one layer's routed experts in memory, stacked: ``w1``, ``w2``, ``w3``."""

    def __init__(self, num_experts: int, dim: int, hidden: int, beta: float, cap: float):
        super().__init__()
        self.w1 = _Quant(num_experts, hidden, dim)
        self.w3 = _Quant(num_experts, hidden, dim)
        self.w2 = _Quant(num_experts, dim, hidden)
        self._act = (beta, cap)

    def tensors(self) -> dict:
        return {n: (getattr(self, n).weight, getattr(self, n).scales) for n in EXPERT_TENSORS}

    def __call__(self, z: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        return expert_glu(z, self.tensors(), inds, weights, *self._act)
