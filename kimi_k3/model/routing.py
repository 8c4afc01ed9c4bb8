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

Shedding misses (``shed``, off by default) drops choices by where the experts are rather
than by weight alone: given which of a token's chosen experts are cached (an expert store's
``cached``), a token keeps every chosen expert that is cached and drops uncached ones,
lightest first, while the renormalised weight it keeps stays at least ``P``; its heaviest
choice is always kept. In a call of several tokens, an expert that some token keeps is read
anyway, so it counts as cached for every token of the call. The kept choices get the
router's weights over themselves, as with trimming, in the same representation, so a
dropped expert is never read. Decisions depend on the cache state and on nothing else: the
same routing and the same cached experts give the same decisions and the same bits on any
store.

docs/streaming.md ("Expert trimming", "Shedding misses") has the measured quality and speed
on the trained default.
"""

from __future__ import annotations

import numbers

import mlx.core as mx
import numpy as np

OFF = (1.0, 0.0)  # (top_p, min_weight): keep every choice
SHED_OFF = 1.0  # shed_misses: keep every uncached choice


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


def check_shed(value: float, name: str = "shed_misses") -> float:
    """``value`` as a float, or ``ValueError`` naming it (``name``): the share of a token's
    renormalised router weight that shedding keeps, from 0 to 1 (1: off)."""
    p = _number(value, name)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be at least 0 and at most 1, got {value}")
    return p


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


def shed_keep(ids: np.ndarray, weights: np.ndarray, cached: np.ndarray, p: float) -> np.ndarray:
    """Which choices shedding keeps (module docstring), on the host in float64.

    ``ids``, ``weights``: a call's routing [N, k] (a choice trimming dropped, a zero-weight
    copy of its token's first, stays dropped); ``cached``: bool [N, k], whether each chosen
    expert needs no read. Per token, with ``r`` the weights renormalised over its choices,
    the uncached ones but the heaviest (ties: the first in the router's order) are dropped
    in increasing ``r`` (ties: the router's order) while the ``r`` kept stays at least ``p``.
    An expert some token keeps counts as cached for every token of the call (it is read
    anyway), until no token keeps another uncached one. Shapes: returns bool [N, k].
    """
    real = kept(ids)
    r = np.where(real, weights.astype(np.float64), 0.0)
    r /= np.maximum(r.sum(axis=-1, keepdims=True), 1e-300)
    total = r.sum(axis=-1, keepdims=True)
    rows = np.arange(ids.shape[0])
    avail = np.zeros(int(ids.max()) + 1, bool)
    avail[ids[cached & real]] = True
    avail[ids[rows, r.argmax(axis=-1)]] = True
    while True:
        candidate = real & ~avail[ids]
        order = np.argsort(np.where(candidate, r, np.inf), axis=-1, kind="stable")
        lightest = np.take_along_axis(r * candidate, order, axis=-1).cumsum(axis=-1)
        drop = np.zeros_like(candidate)
        np.put_along_axis(drop, order, total - lightest >= p, axis=-1)
        forced = candidate & ~drop
        if not forced.any():
            return real & avail[ids]
        avail[ids[forced]] = True


def shed(inds: mx.array, weights: mx.array, cached, p: float, scale: float, renormalize: bool):
    """The router's output with uncached choices shed (``shed_keep``), cut to the columns
    some token keeps; ``cached(ids)`` answers for host ids [N, k] (bool [N, k]).

    Kept choices come first in decreasing weight and get ``w_i / sum_kept w * scale`` when
    ``renormalize`` (the router's ``s_i / sum_kept s * scale``), else their weight; a dropped
    one is the token's first expert with weight 0. Where no token drops anything the
    routing comes back as it was (only trimming's unused columns cut), so the model computes
    what it computes without shedding. Returns ``(inds, weights, dropped pairs, dropped
    mass)``, the mass summed over tokens in renormalised weight. Shapes: [N, k] -> [N, k'].
    """
    ids, w = np.array(inds), np.array(weights)
    real = kept(ids)
    keep = shed_keep(ids, w, np.asarray(cached(ids), bool), p)
    if (keep == real).all():
        width = int(real.sum(axis=-1).max())
        return inds[:, :width], weights[:, :width], 0, 0.0
    r = np.where(real, w.astype(np.float64), 0.0)
    r /= np.maximum(r.sum(axis=-1, keepdims=True), 1e-300)
    dropped = real & ~keep
    order = np.lexsort((-r, ~keep), axis=-1)  # kept first, heaviest first (stable)
    ids, keep = np.take_along_axis(ids, order, -1), np.take_along_axis(keep, order, -1)
    width = int(keep.sum(axis=-1).max())
    ids, keep = np.where(keep, ids, ids[:, :1])[:, :width], keep[:, :width]
    mask = mx.array(keep)
    kw = mx.where(mask, mx.take_along_axis(weights, mx.array(order[:, :width]), axis=-1), 0.0)
    if renormalize:
        kw = kw / (kw.sum(axis=-1, keepdims=True) + 1e-20) * scale
    return mx.array(ids.astype(np.int32)), kw, int(dropped.sum()), float(r[dropped].sum())


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


def set_shed_misses(model, p: float = SHED_OFF) -> None:
    """Shed uncached choices in every MoE layer (module docstring) while the renormalised
    weight a token keeps stays at least ``p``; ``p=1.0`` (the default) turns shedding off.
    Takes effect at the next call; ``ValueError`` naming ``p`` out of [0, 1]. A store whose
    experts are all resident sheds nothing."""
    p = check_shed(p, "p")
    for router in routers(model):
        router.shed_p = p


def shed_misses(model) -> float:
    """The share ``set_shed_misses`` set (``SHED_OFF``: shedding off)."""
    found = routers(model)
    return found[0].shed_p if found else SHED_OFF


def routers(model) -> list:
    """The ``Router`` of every MoE layer of ``model`` held by this process."""
    return [layer.block_sparse_moe.gate for layer in model.layers if "block_sparse_moe" in layer]
