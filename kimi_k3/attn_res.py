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
        w = self.norm_weight.astype(mx.float32) * self.proj_weight.astype(mx.float32)[0]
        vf = vs.astype(mx.float32)
        return (vf @ w) * mx.rsqrt((vf * vf).mean(axis=-1) + self.eps)

    def __call__(self, snaps: list[mx.array], p: mx.array) -> mx.array:
        if not snaps:
            return p
        vs = mx.stack(snaps + [p])
        a = mx.softmax(self.logits(vs), axis=0, precise=True)
        return (a[..., None] * vs.astype(mx.float32)).sum(axis=0).astype(p.dtype)
