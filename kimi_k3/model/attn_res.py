"""Attention Residuals (AttnRes): the residual stream as a softmax mix of block summaries."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class AttnResMix(nn.Module):
    """``mix(S, p)``: softmax-weighted sum of the snapshots ``S`` and the partial sum ``p``.

    Each vector ``v`` scores ``(v . (norm_weight * proj_weight)) * rsqrt(mean(v^2) + eps)``;
    the softmax over the scores is taken in fp32 and weights the raw vectors.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.proj_weight = mx.zeros((1, dim))
        self.norm_weight = mx.ones((dim,))
        self.eps = eps

    def logits(self, vs: mx.array) -> mx.array:
        """Shapes: vs [n, ..., D] -> fp32 [n, ...]."""
        return _logits(vs, self.norm_weight, self.proj_weight, self.eps)

    def __call__(self, snaps: list[mx.array], p: mx.array) -> mx.array:
        if not snaps:
            return p
        return _mix(snaps + [p], self.norm_weight, self.proj_weight, self.eps)


def _logits(vs, norm_weight, proj_weight, eps):
    w = norm_weight.astype(mx.float32) * proj_weight.astype(mx.float32)[0]
    vf = vs.astype(mx.float32)
    return (vf @ w) * mx.rsqrt((vf * vf).mean(axis=-1) + eps)


@mx.compile
def _mix(vectors: list, norm_weight, proj_weight, eps):
    vs = mx.stack(vectors)
    a = mx.softmax(_logits(vs, norm_weight, proj_weight, eps), axis=0, precise=True)
    return (a[..., None] * vs.astype(mx.float32)).sum(axis=0).astype(vectors[-1].dtype)
