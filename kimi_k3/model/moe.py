"""SiTU-GLU MLPs and the Stable LatentMoE block."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kimi_k3.model.config import ModelArgs
from kimi_k3.model.experts import ResidentExperts, expert_format, situ_glu
from kimi_k3.model.parallel import moe_parts
from kimi_k3.model.routing import OFF, SHED_OFF, is_on, route, route_trimmed, shed, used_columns


class SituMLP(nn.Module):
    """``down(situ(gate(x)) * cap*tanh(up(x)/cap))``: the dense MLP and the shared experts."""

    def __init__(self, dim: int, hidden: int, beta: float, cap: float):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self._act = (beta, cap)

    def __call__(self, x: mx.array) -> mx.array:
        h = situ_glu(self.gate_proj(x), self.up_proj(x), *self._act)
        return self.down_proj(h.astype(x.dtype))


class Router(nn.Module):
    """Sigmoid router; the correction bias steers selection only, never the weights.

    ``top_p`` / ``min_weight`` trim each token's choices, ``shed_p`` sheds the uncached ones
    (``kimi_k3.model.routing``; off at 1 / 0 / 1).
    """

    def __init__(self, dim: int, experts: int, top_k: int, scale: float, renormalize: bool):
        super().__init__()
        self.weight = mx.zeros((experts, dim))
        self.e_score_correction_bias = mx.zeros((experts,), dtype=mx.float32)
        self.top_k, self.scale, self.renormalize = top_k, scale, renormalize
        self.top_p, self.min_weight = OFF
        self.shed_p = SHED_OFF

    @property
    def trims(self) -> bool:
        return is_on(self.top_p, self.min_weight)

    @property
    def sheds(self) -> bool:
        return self.shed_p < SHED_OFF

    def logits(self, x: mx.array) -> mx.array:
        return x @ self.weight.T

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Shapes: x [..., D] -> (inds [..., k] int32, weights [..., k] fp32)."""
        route_args = (self.logits(x), self.e_score_correction_bias, self.top_k, self.scale)
        if self.trims:
            return route_trimmed(*route_args, self.renormalize, self.top_p, self.min_weight)
        return route(*route_args, self.renormalize)

    def to_quantized(self, group_size=None, bits=None, mode="affine", **_) -> QuantizedRouter:
        """The router with an MLX-quantized weight (the converter stores it at 8 bits)."""
        return QuantizedRouter(self, group_size or 64, bits or 8, mode)


class QuantizedRouter(Router):
    """``Router`` whose logits come from ``mx.quantized_matmul`` on a quantized weight."""

    def __init__(self, router: Router, group_size: int, bits: int, mode: str):
        E, D = router.weight.shape
        super().__init__(D, E, router.top_k, router.scale, router.renormalize)
        self.e_score_correction_bias = router.e_score_correction_bias
        self.top_p, self.min_weight = router.top_p, router.min_weight
        self.shed_p = router.shed_p
        q = mx.quantize(router.weight, group_size=group_size, bits=bits, mode=mode)
        self.weight, self.scales = q[0], q[1]
        if mode == "affine":
            self.biases = q[2]
        self.group_size, self.bits, self.mode = group_size, bits, mode

    def logits(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(
            x,
            self.weight,
            self.scales,
            self.get("biases"),
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


class LatentMoE(nn.Module):
    """Stable LatentMoE: experts work in a latent space; the weighted sum is normalised.

    ``out = up(RMSNorm(sum_e w_e * expert_e(down(x)))) + shared(x)``. ``experts`` is an
    expert store (see ``kimi_k3.model.experts``); the resident one by default. ``route_hook``, if
    set, is called as ``route_hook(self, x)`` with the routed input before the experts run.
    With shedding on (``Router.shed_p``), a store's ``cached(ids)`` says which chosen experts
    need no read (a store without it holds every expert), and its ``note_shed(pairs, mass)``,
    if it has one, counts what was dropped.
    """

    route_hook = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        D, Dl = args.hidden_size, args.routed_expert_hidden_size
        act = (args.activation_situ_beta, args.activation_situ_linear_beta)
        self.gate = Router(
            D,
            args.num_experts,
            args.num_experts_per_token,
            args.routed_scaling_factor,
            args.moe_renormalize,
        )
        self.routed_expert_down_proj = nn.Linear(D, Dl, bias=False)
        self.routed_expert_up_proj = nn.Linear(Dl, D, bias=False)
        self.routed_expert_norm = nn.RMSNorm(Dl, eps=args.rms_norm_eps)
        self.shared_experts = SituMLP(D, args.moe_intermediate_size * args.num_shared_experts, *act)
        self.experts = ResidentExperts(
            args.num_experts, Dl, args.moe_intermediate_size, *act, expert_format(args)
        )
        self.layer_index = -1  # set by the model; expert stores and traces key on it
        # Expert parallel (``kimi_k3.model.parallel``): this rank's experts [lo, hi) and the
        # group whose all-sum adds the ranks' parts; ``shared_partial`` when the shared
        # experts are tensor parallel and their part joins that sum.
        self.sharding_group = None
        self.expert_range = range(args.num_experts)
        self.shared_partial = False

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        inds, weights = self.gate(flat)
        if self.gate.sheds and self.may_shed:  # uncached choices dropped, unused columns cut
            g = self.gate
            inds, weights, *dropped = shed(
                inds, weights, self.cached_choices, g.shed_p, g.scale, g.renormalize
            )
            if (note := getattr(self.experts, "note_shed", None)) is not None:
                note(*dropped)
        elif self.gate.trims:  # the columns no token keeps are not computed
            inds, weights = used_columns(inds, weights)
        if self.route_hook is not None:  # traces (kimi_k3.trace, streaming.simulate)
            self.route_hook(self, flat)
        z = self.routed_expert_down_proj(flat)
        if self.sharding_group is not None:
            y, shared = moe_parts(self, flat, z, inds, weights)
        else:
            y, shared = self.experts(z, inds, weights), self.shared_experts(flat)
        y = self.routed_expert_up_proj(self.routed_expert_norm(y.astype(x.dtype)))
        return (y + shared).reshape(shape)

    @property
    def may_shed(self) -> bool:
        """Whether shedding can drop anything here: the store says what it caches, or the
        ranks of expert parallel answer together (a resident store holds every expert)."""
        return hasattr(self.experts, "cached") or self.sharding_group is not None

    def cached_choices(self, ids: np.ndarray) -> np.ndarray:
        """Which of the chosen experts ``ids`` [N, k] need no read (bool [N, k]): the store's
        ``cached`` for this rank's experts (every one where the store has no ``cached``); under
        expert parallel, summed over the ranks, each answering for its own."""
        held = self.expert_range
        mine = (ids >= held.start) & (ids < held.stop)
        ask = getattr(self.experts, "cached", None)
        if ask is not None:
            mine &= np.asarray(ask(np.where(mine, ids - held.start, 0)), bool)
        if self.sharding_group is None:
            return mine
        votes = mx.distributed.all_sum(mx.array(mine.astype(np.int32)), group=self.sharding_group)
        return np.array(votes) > 0


def moe_blocks(model) -> dict:
    """``{layer index: LatentMoE}`` of a Kimi K3 model (the MoE layers this process holds)."""
    return {
        layer.block_sparse_moe.layer_index: layer.block_sparse_moe
        for layer in model.layers
        if "block_sparse_moe" in layer
    }


@contextmanager
def route_hooks(model, hook):
    """Inside the block every MoE block of ``model`` calls ``hook(moe, x)`` with its routed
    input before its experts run (``LatentMoE.route_hook``), then the hook it had, which it
    gets back after."""
    moes = moe_blocks(model)
    old = {layer: moe.route_hook for layer, moe in moes.items()}

    def both(moe, x):
        hook(moe, x)
        if old[moe.layer_index] is not None:
            old[moe.layer_index](moe, x)

    for moe in moes.values():
        moe.route_hook = both
    try:
        yield
    finally:
        for layer, moe in moes.items():
            moe.route_hook = old[layer]
