"""Routed experts: the one interface the MoE block talks to, and the resident store.

An expert store is called as ``store(z, inds, weights)`` and returns the routing-weighted
sum of the chosen experts' SiTU-GLU outputs. The MoE block never sees where the weights
live: the resident store keeps them stacked in memory, the streamer (``kimi_k3.streaming``)
reads them from disk into a bounded cache, and both compute with ``expert_glu``.

MXFP4 layout (MLX ``mode="mxfp4"``, identical bytes to compressed-tensors): per expert
``w1`` (gate) and ``w3`` (up) are ``weight`` uint32 [I, D/8] + ``scales`` uint8 [I, D/32];
``w2`` (down) is ``weight`` uint32 [D, I/8] + ``scales`` uint8 [D, I/32].

Where CUDA's kernels serve the experts, the stores hold the same bytes permuted into 16-row
tiles (``kimi_k3.kernels.expert_layout``; ``store_layout`` decides, ``KIMI_K3_EXPERT_LAYOUT``
overrides): the stacks they hand to ``expert_glu`` are then ``TiledStacks``, which the
dispatcher gives to the kernels' tiled variants and the reference untiles.
"""

from __future__ import annotations

import re
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kimi_k3.kernels import checks, dispatch, expert_layout, source

GROUP = 32
EXPERT_TENSORS = ("w1", "w2", "w3")
# Routed-expert tensor names, published (``.experts.``) or mlx-lm converted (``.switch_mlp.``).
ROUTED_EXPERT_NAME = re.compile(r"\.experts\.|\.switch_mlp\.")
# One published per-expert tensor: (MoE block prefix, expert, w1/w2/w3, packed or scale).
PUBLISHED_EXPERT = re.compile(
    r"(.*\.block_sparse_moe)\.experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale)$"
)


def expert_keys(layer: int, expert: int) -> list[str]:
    """The six published tensor names of one routed expert."""
    base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}"
    return [f"{base}.{w}.{k}" for w in EXPERT_TENSORS for k in ("weight_packed", "weight_scale")]


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

    On the CPU the products run on ``z`` in fp32 whatever its dtype: MLX's CPU quantized
    matmul in bf16 or fp16 adds the products one by one in that dtype, rounding every
    partial sum, and takes about 10x as long per row as in fp32 (a 128 x 128 expert matrix:
    74 against 7 us), whose SIMD path adds in fp32, as the Metal and CUDA kernels do.

    Shapes: z: [N, D]; inds: [N, k] int; weights: [N, k]. Returns fp32 [N, D].
    """
    if z.dtype != mx.float32 and mx.default_device() == mx.cpu:
        z = z.astype(mx.float32)
    if expert_layout.is_tiled(w):
        w, inds = _untiled(w, inds)
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


def _untiled(w, inds):
    """Tiled stacks -> MLX's layout for the reference: the experts ``inds`` reads, copied
    (indices renumbered), where they are fewer than the stack's; else the whole stack."""
    if inds.size >= w["w1"][0].shape[0]:
        return expert_layout.untile(w), inds
    sel = inds.reshape(-1)
    out = {n: expert_layout.untile_pair(q[sel], s[sel], n) for n, (q, s) in w.items()}
    return out, mx.arange(inds.size, dtype=mx.int32).reshape(inds.shape)


def store_layout(choice: str | None, dim: int, hidden: int) -> str:
    """``"tiled"`` or ``"mlx"``: the layout an expert store of latent ``dim`` and expert
    ``hidden`` size holds. ``choice`` ``None`` reads ``KIMI_K3_EXPERT_LAYOUT`` (default
    ``"auto"``); ``"auto"`` is tiles where CUDA's tensor-core kernels read them (the CUDA
    backend, dims ``expert_layout.kernels_read`` accepts), else MLX's layout. Asking for
    tiles the dims cannot have is an error; any other value too."""
    if choice is None:
        choice = source.env_choice("KIMI_K3_EXPERT_LAYOUT", expert_layout.LAYOUTS, "auto")
    if choice not in expert_layout.LAYOUTS:
        raise ValueError(f"expert_layout={choice!r}: one of {expert_layout.LAYOUTS}")
    if choice == "auto":
        cuda = source.backend() == "cuda"
        return "tiled" if cuda and expert_layout.kernels_read(dim, hidden) else "mlx"
    if choice == "tiled" and not expert_layout.supports(dim, hidden):
        raise ValueError(
            f"expert_layout='tiled': experts of latent size {dim} and hidden size {hidden} "
            "cannot be tiled (both must be multiples of 128)"
        )
    return choice


def expert_glu(z, w, inds, weights, beta, cap):
    """Dispatcher: the MXFP4 expert kernel where eligible, else ``expert_glu_reference``."""
    fn = dispatch.expert_glu_kernel(z, w, inds)
    if fn is None:
        return expert_glu_reference(z, w, inds, weights, beta, cap)
    # Kernels forward; gradients w.r.t. z and weights (training) through the reference.
    return dispatch.with_reference_vjp(
        lambda z_, wt: fn(z_, w, inds, wt, beta, cap),
        lambda z_, wt: expert_glu_reference(z_, w, inds, wt, beta, cap),
        [z, weights],
    )


def expert_glu_plan(z, w, ids: np.ndarray):
    """For a caller that computes one call's (token, choice) pairs in several groups (the
    streamer, when a chunk needs more experts than the layer has slots): ``(fn, in_order)``,
    the function one ``expert_glu`` call on host routing ``ids`` [N, k] would compute the
    pairs with (the kernel, else ``expert_glu_reference``; same signature as
    ``expert_glu``), and whether that call adds a token's pairs in choice order
    (``dispatch.expert_sum_in_order``) rather than as ``sum(axis=1)``, so the groups add up
    to that call's bits."""
    fn = dispatch.expert_glu_kernel(z, w, mx.array(ids.astype(np.int32)))
    return fn or expert_glu_reference, fn is not None and dispatch.expert_sum_in_order(ids)


class _Quant(nn.Module):
    def __init__(self, n: int, out_dims: int, in_dims: int):
        super().__init__()
        self.weight = mx.zeros((n, out_dims, in_dims // 8), dtype=mx.uint32)
        self.scales = mx.zeros((n, out_dims, in_dims // GROUP), dtype=mx.uint8)


class ResidentExperts(nn.Module):
    """All of one layer's routed experts in memory, stacked: ``w1``, ``w2``, ``w3``.

    ``set_layout("tiled")`` permutes the stacks into ``expert_layout``'s tiles, held under the
    names ``tiled_weight`` / ``tiled_scales``, so that saving or loading the parameters by
    their checkpoint names (``weight`` / ``scales``) fails loudly instead of reading tiles as
    MLX's layout; ``set_layout("mlx")`` turns them back.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, beta: float, cap: float):
        super().__init__()
        self.w1 = _Quant(num_experts, hidden, dim)
        self.w3 = _Quant(num_experts, hidden, dim)
        self.w2 = _Quant(num_experts, dim, hidden)
        self._act = (beta, cap)
        self._tiled = False

    @property
    def layout(self) -> str:
        return "tiled" if self._tiled else "mlx"

    def set_layout(self, layout: str):
        """Hold the stacks in ``layout`` (``"mlx"`` or ``"tiled"``): lazy MLX ops, one copy
        of the layer's stacks when evaluated."""
        if layout not in ("mlx", "tiled"):
            raise ValueError(f"ResidentExperts.set_layout({layout!r}): 'mlx' or 'tiled'")
        if layout == self.layout:
            return
        src, dst = _NAMES[self.layout], _NAMES[layout]
        move = expert_layout.tile_pair if layout == "tiled" else expert_layout.untile_pair
        for n in EXPERT_TENSORS:
            q = getattr(self, n)
            pair = move(q[src[0]], q[src[1]], n)
            del q[src[0]], q[src[1]]
            q[dst[0]], q[dst[1]] = pair
        self._tiled = layout == "tiled"

    def tensors(self) -> dict:
        a, b = _NAMES[self.layout]
        w = {n: (getattr(self, n)[a], getattr(self, n)[b]) for n in EXPERT_TENSORS}
        return expert_layout.TiledStacks(w) if self._tiled else w

    def __call__(self, z: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        return expert_glu(z, self.tensors(), inds, weights, *self._act)


_NAMES = {"mlx": ("weight", "scales"), "tiled": ("tiled_weight", "tiled_scales")}


checks.REFERENCES["expert_glu_reference"] = expert_glu_reference  # the kernels' oracle
