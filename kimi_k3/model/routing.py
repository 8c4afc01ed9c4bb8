"""Routing: the router's choice of experts per token (``select_experts``, ``route``) and
dynamic expert trimming, where each token runs fewer of its routed experts when the router
is sure.

Trimming is off by default. Two thresholds, alone or together, act on the router's *renormalised
weights* ``r_i = s_i / sum_j s_j`` over the token's top-k choices (``s`` the sigmoid scores of the
experts selected by biased score; the weights the router itself hands on are these times
``routed_scaling_factor`` when ``moe_renormalize``). The choices are taken in decreasing ``r`` (ties
in the router's order):

- ``top_p`` (0 < p <= 1): keep choices while the ``r`` of those kept before them sums to
  less than ``p`` (so the kept ones are the fewest whose ``r`` reaches ``p``); 1 keeps all;
- ``min_weight`` (0 <= w < 1): drop choices whose ``r`` is below ``w``; 0 drops none.

The first (heaviest) choice is always kept. The kept ones get the router's weights again,
over themselves: ``s_i / sum_kept s_j * routed_scaling_factor`` when ``moe_renormalize``,
else ``s_i * routed_scaling_factor``. All of it is fp32, the thresholds compared in fp32.

Representation: the router's output keeps its shape ``[N, k]``, ordered by decreasing
weight, and a dropped choice becomes a copy of the token's first expert with weight 0:
a pair whose expert the token needs anyway, so no expert store reads anything for it, and
whose exactly zero product adds nothing (a pair's output is finite: SiTU-GLU is bounded).
Before the experts run, ``LatentMoE`` cuts the columns no token of the call keeps
(``used_columns``, which waits for the routing on the host, as the streamed store always
does): a decoded token computes only its kept experts; in a chunk a token keeping fewer
than the chunk's most computes a few zero pairs. Every expert store, the streamer's
groups, expert parallel and the kernels then see ordinary ``(inds, weights)``, so streamed
and resident trimmed models keep the bitwise contract between them.

docs/streaming.md ("Expert trimming") has the measured quality and speed on the trained
default.
"""

from __future__ import annotations

import numbers

import mlx.core as mx
import numpy as np

OFF = (1.0, 0.0)  # (top_p, min_weight): keep every choice


def select_experts(logits, bias, top_k: int) -> tuple[mx.array, mx.array]:
    """The router's choice: the ``top_k`` experts by sigmoid score plus the correction
    bias, and their sigmoid scores without it. Shapes: logits [..., E] -> (inds [..., k]
    int32, scores [..., k] fp32)."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    biased = scores + bias.astype(mx.float32)
    inds = mx.argpartition(-biased, kth=top_k - 1, axis=-1)[..., :top_k]
    inds = mx.stop_gradient(inds).astype(mx.int32)
    return inds, mx.take_along_axis(scores, inds, axis=-1)


@mx.compile
def route(logits, bias, top_k: int, scale: float, renormalize: bool):
    """The router's output: ``select_experts``' choice and its scores, renormalised over
    the choice when ``renormalize``, times ``scale``. Shapes: logits [..., E] ->
    (inds [..., k] int32, weights [..., k] fp32)."""
    inds, w = select_experts(logits, bias, top_k)
    if renormalize:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return inds, w * scale


def check(top_p: float, min_weight: float, names=("top_p", "min_weight")) -> tuple[float, float]:
    """``(top_p, min_weight)`` as floats, or ``ValueError`` naming the bad one (by ``names``):
    ``top_p`` must be in (0, 1], ``min_weight`` in [0, 1)."""
    p, w = _number(top_p, names[0]), _number(min_weight, names[1])
    if not 0.0 < p <= 1.0:
        raise ValueError(f"{names[0]} must be above 0 and at most 1, got {top_p}")
    if not 0.0 <= w < 1.0:
        raise ValueError(f"{names[1]} must be at least 0 and below 1, got {min_weight}")
    return p, w


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)  # NaN fails the range checks


def is_on(top_p: float, min_weight: float) -> bool:
    return top_p < 1.0 or min_weight > 0.0


@mx.compile
def route_trimmed(
    logits, bias, top_k: int, scale: float, renormalize: bool, top_p: float, min_weight: float
):
    """``route`` with its choices trimmed (module docstring).

    Shapes: logits [..., E] -> (inds [..., k] int32, weights [..., k] fp32), by decreasing
    weight; a dropped choice is the first one's expert with weight 0.
    """
    inds, s = select_experts(logits, bias, top_k)
    r = s / (s.sum(axis=-1, keepdims=True) + 1e-20)
    order = mx.argsort(-r, axis=-1)
    inds = mx.take_along_axis(inds, order, axis=-1)
    s, r = mx.take_along_axis(s, order, axis=-1), mx.take_along_axis(r, order, axis=-1)
    before = mx.cumsum(r, axis=-1, inclusive=False)
    keep = ((before < top_p) & (r >= min_weight)) | (mx.arange(top_k) == 0)
    s = mx.where(keep, s, 0.0)
    w = s / (s.sum(axis=-1, keepdims=True) + 1e-20) if renormalize else s
    return mx.where(keep, inds, inds[..., :1]), w * scale


def used_columns(inds: mx.array, weights: mx.array) -> tuple[mx.array, mx.array]:
    """Trimmed routing cut to the columns some token keeps (evaluates ``inds`` on the host).

    Shapes: inds, weights [N, k] -> [N, k'] with k' the most choices a token keeps.
    """
    k = int(kept(np.array(inds)).sum(axis=-1).max())
    return inds[:, :k], weights[:, :k]


def kept(ids: np.ndarray) -> np.ndarray:
    """Which choices of host routing ``ids`` [N, k] are kept: a dropped choice repeats its
    token's first expert (the top-k choices of a token are distinct, so nothing else does).
    Shapes: returns bool [N, k]."""
    mask = np.ones(ids.shape, bool)
    mask[:, 1:] = ids[:, 1:] != ids[:, :1]
    return mask


def set_expert_trimming(model, top_p: float = 1.0, min_weight: float = 0.0) -> None:
    """Trim every MoE layer's routed experts per token (module docstring); ``top_p=1.0`` and
    ``min_weight=0.0`` (the defaults) turn trimming off, and the model then computes exactly
    what it computes untrimmed. Takes effect at the next call; ``ValueError`` naming the
    argument for a value out of range."""
    top_p, min_weight = check(top_p, min_weight)
    for router in routers(model):
        router.top_p, router.min_weight = top_p, min_weight


def expert_trimming(model) -> tuple[float, float]:
    """``(top_p, min_weight)`` as ``set_expert_trimming`` set them (``OFF``: untrimmed)."""
    found = routers(model)
    return (found[0].top_p, found[0].min_weight) if found else OFF


def routers(model) -> list:
    """The ``Router`` of every MoE layer of ``model`` held by this process."""
    return [layer.block_sparse_moe.gate for layer in model.layers if "block_sparse_moe" in layer]
