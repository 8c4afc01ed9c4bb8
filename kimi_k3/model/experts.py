"""Routed experts: the one interface the MoE block talks to, and the resident store.

An expert store is called as ``store(z, inds, weights)`` and returns the routing-weighted
sum of the chosen experts' SiTU-GLU outputs. The MoE block never sees where the weights
live: the resident store keeps them stacked in memory, the streamer (``kimi_k3.streaming``)
reads them from disk into a bounded cache, and both compute with ``expert_glu``.

MXFP4 layout (MLX ``mode="mxfp4"``, identical bytes to compressed-tensors): per expert
``w1`` (gate) and ``w3`` (up) are ``weight`` uint32 [I, D/8] + ``scales`` uint8 [I, D/32];
``w2`` (down) is ``weight`` uint32 [D, I/8] + ``scales`` uint8 [D, I/32]. Experts the
converter requantized to 3 or 2 bits (``ExpertFormat``, MLX ``mode="affine"``) hold per
matrix ``weight`` uint32 [O, In * bits / 32] and float16 ``scales`` and ``biases`` [O, In / 64].

Where CUDA's kernels serve the experts, the stores hold the same bytes permuted into 16-row
tiles (``kimi_k3.kernels.expert_layout``; ``store_layout`` decides, ``KIMI_K3_EXPERT_LAYOUT``
overrides): the stacks they hand to ``expert_glu`` are then ``TiledStacks``, which the
dispatcher gives to the kernels' tiled variants and the reference untiles.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kimi_k3.kernels import checks, dispatch, expert_layout, source
from kimi_k3.model.config import ConfigError

GROUP = 32
EXPERT_TENSORS = ("w1", "w2", "w3")
# The key of the config's ``quantization`` entry that names a lower-bit expert format.
FORMAT_KEY = "routed_experts"


@dataclass(frozen=True)
class ExpertFormat:
    """How the routed experts' weights are stored: MLX ``mxfp4`` (the published format: E2M1
    codes, one E8M0 scale per 32 weights) or MLX ``affine`` at ``bits`` (codes, a float16
    scale and bias per ``group_size`` weights: ``s q + b``), which the converter writes with
    ``--expert-bits 3`` or ``2`` (``kimi_k3.convert.requant``)."""

    mode: str
    bits: int
    group_size: int

    @property
    def kinds(self) -> tuple[str, ...]:
        """The tensors of one matrix: ``weight`` and ``scales``, and ``biases`` if affine."""
        return ("weight", "scales", "biases") if self.mode == "affine" else ("weight", "scales")

    @property
    def record_tensors(self) -> tuple[str, ...]:
        """An expert's tensors in the order of its expert-pack record."""
        return tuple(f"{w}.{k}" for w in ("w1", "w2", "w3") for k in self.kinds)

    def shapes(self, rows: int, cols: int) -> dict[str, tuple[tuple, type]]:
        """``{kind: (shape, numpy dtype)}`` of one ``rows x cols`` matrix."""
        weight = ((rows, cols * self.bits // 32), np.uint32)
        groups = (rows, cols // self.group_size)
        if self.mode == "mxfp4":
            return {"weight": weight, "scales": (groups, np.uint8)}
        return {"weight": weight, "scales": (groups, np.float16), "biases": (groups, np.float16)}

    def bits_per_weight(self) -> float:
        return self.bits + (8 if self.mode == "mxfp4" else 32) / self.group_size

    def to_json(self) -> dict:
        return {"mode": self.mode, "bits": self.bits, "group_size": self.group_size}

    def __str__(self) -> str:
        if self.mode == "mxfp4":
            return "MXFP4"
        return f"{self.bits}-bit affine, groups of {self.group_size}"


MXFP4 = ExpertFormat("mxfp4", 4, GROUP)
# ``--expert-bits`` -> the format (docs/converter.md#lower-bit-experts: chosen by measurement).
FORMATS = {4: MXFP4, 3: ExpertFormat("affine", 3, 64), 2: ExpertFormat("affine", 2, 64)}


def format_from_json(entry, where: str) -> ExpertFormat:
    """The format an index or config entry names (``to_json``'s dict); one of ``FORMATS``,
    else ``ValueError`` naming ``where``."""
    known = {_json_key(f.to_json()): f for f in FORMATS.values()}
    fmt = known.get(_json_key(entry)) if isinstance(entry, dict) else None
    if fmt is None:
        names = "; ".join(str(f.to_json()) for f in FORMATS.values())
        raise ValueError(f"{where}: expert format {entry!r:.120} is not one of: {names}")
    return fmt


def _json_key(entry: dict) -> tuple:
    return tuple(entry.get(k) for k in ("mode", "bits", "group_size"))


def expert_format(args) -> ExpertFormat:
    """The experts' format of a model: the config's ``quantization.routed_experts`` entry
    (written by the converter for lower-bit experts), else MXFP4. An entry naming no known
    format raises ``ConfigError`` naming the key. ``args`` is a ``ModelArgs``, or any object
    with the fields read (one without ``quantization`` has MXFP4 experts)."""
    entry = (getattr(args, "quantization", None) or {}).get(FORMAT_KEY)
    if entry is None:
        return MXFP4
    try:
        return format_from_json(entry, f"config value quantization.{FORMAT_KEY}")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def stack_format(w: dict) -> ExpertFormat:
    """The format of expert stacks ``w`` (``{"w1": (weight, scales[, biases]), ...}``), read
    off the arrays: affine where there are biases, ``bits`` from the weight's width and the
    latent size (``w2``'s rows), the group from the scales' width."""
    q1, s1 = w["w1"][0], w["w1"][1]
    dim = w["w2"][0].shape[-2]
    bits = q1.shape[-1] * 32 // dim
    if len(w["w1"]) == 3:
        return ExpertFormat("affine", bits, dim // s1.shape[-1])
    return MXFP4


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


def _qmm(x, stack, fmt: ExpertFormat, idx, sorted_indices):
    w, s, b = (*stack, None)[:3]
    return mx.gather_qmm(
        x,
        w,
        s,
        b,
        rhs_indices=idx,
        transpose=True,
        group_size=fmt.group_size,
        bits=fmt.bits,
        mode=fmt.mode,
        sorted_indices=sorted_indices,
    )


def expert_glu_reference(
    z: mx.array, w: dict, inds: mx.array, weights: mx.array, beta: float, cap: float
) -> mx.array:
    """Weighted sum of SiTU-GLU experts with MLX's quantized ops (the reference).

    ``w`` maps ``w1``/``w2``/``w3`` to ``(weight, scales)`` (MXFP4) or ``(weight, scales,
    biases)`` (affine, ``ExpertFormat``) stacked over a leading expert (or cache slot) axis
    that ``inds`` indexes.

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
    fmt = stack_format(w)
    gate = _qmm(xs, w["w1"], fmt, idx, sorted_ok)
    h = situ_glu(gate, _qmm(xs, w["w3"], fmt, idx, sorted_ok), beta, cap)
    y = _qmm(h.astype(z.dtype), w["w2"], fmt, idx, sorted_ok)[:, 0, :].astype(mx.float32)
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


def store_layout(choice: str | None, dim: int, hidden: int, fmt: ExpertFormat = MXFP4) -> str:
    """``"tiled"`` or ``"mlx"``: the layout an expert store of latent ``dim`` and expert
    ``hidden`` size in format ``fmt`` holds. ``choice`` ``None`` reads
    ``KIMI_K3_EXPERT_LAYOUT`` (default ``"auto"``); ``"auto"`` is tiles where CUDA's
    tensor-core kernels read them (MXFP4 on the CUDA backend, dims
    ``expert_layout.kernels_read`` accepts), else MLX's layout. Asking for tiles the format or
    the dims cannot have is an error; any other value too."""
    if choice is None:
        choice = source.env_choice("KIMI_K3_EXPERT_LAYOUT", expert_layout.LAYOUTS, "auto")
    if choice not in expert_layout.LAYOUTS:
        raise ValueError(f"expert_layout={choice!r}: one of {expert_layout.LAYOUTS}")
    if choice == "auto":
        cuda = source.backend() == "cuda" and fmt == MXFP4
        return "tiled" if cuda and expert_layout.kernels_read(dim, hidden) else "mlx"
    if choice == "tiled" and fmt != MXFP4:
        raise ValueError(f"expert_layout='tiled': {fmt} experts are not tiled (MXFP4 only)")
    if choice == "tiled" and not expert_layout.supports(dim, hidden):
        raise ValueError(
            f"expert_layout='tiled': experts of latent size {dim} and hidden size {hidden} "
            "cannot be tiled (both must be multiples of 128)"
        )
    return choice


def expert_glu(z, w, inds, weights, beta, cap):
    """Dispatcher: the expert kernel for the stacks' format where eligible, else
    ``expert_glu_reference``."""
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


_MX = {np.dtype(np.uint32): mx.uint32, np.dtype(np.uint8): mx.uint8}
_MX[np.dtype(np.float16)] = mx.float16


class _Quant(nn.Module):
    def __init__(self, n: int, out_dims: int, in_dims: int, fmt: ExpertFormat):
        super().__init__()
        for kind, (shape, dtype) in fmt.shapes(out_dims, in_dims).items():
            self[kind] = mx.zeros((n, *shape), dtype=_MX[np.dtype(dtype)])


class ResidentExperts(nn.Module):
    """All of one layer's routed experts in memory, stacked: ``w1``, ``w2``, ``w3``, each
    ``weight``, ``scales`` (and ``biases`` for an affine ``fmt``).

    ``set_layout("tiled")`` permutes the stacks into ``expert_layout``'s tiles, held under the
    names ``tiled_weight`` / ``tiled_scales``, so that saving or loading the parameters by
    their checkpoint names (``weight`` / ``scales``) fails loudly instead of reading tiles as
    MLX's layout; ``set_layout("mlx")`` turns them back.
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        beta: float,
        cap: float,
        fmt: ExpertFormat = MXFP4,
    ):
        super().__init__()
        self.w1 = _Quant(num_experts, hidden, dim, fmt)
        self.w3 = _Quant(num_experts, hidden, dim, fmt)
        self.w2 = _Quant(num_experts, dim, hidden, fmt)
        self._act = (beta, cap)
        self._tiled = False
        self.format = fmt

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
        if self.format != MXFP4:
            raise ValueError(f"ResidentExperts.set_layout('tiled'): {self.format} is not tiled")
        src, dst = _NAMES[self.layout], _NAMES[layout]
        move = expert_layout.tile_pair if layout == "tiled" else expert_layout.untile_pair
        for n in EXPERT_TENSORS:
            q = getattr(self, n)
            pair = move(q[src[0]], q[src[1]], n)
            del q[src[0]], q[src[1]]
            q[dst[0]], q[dst[1]] = pair
        self._tiled = layout == "tiled"

    def tensors(self) -> dict:
        if self._tiled:
            a, b = _NAMES["tiled"]
            return expert_layout.TiledStacks(
                {n: (getattr(self, n)[a], getattr(self, n)[b]) for n in EXPERT_TENSORS}
            )
        return {n: tuple(getattr(self, n)[k] for k in self.format.kinds) for n in EXPERT_TENSORS}

    def __call__(self, z: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        return expert_glu(z, self.tensors(), inds, weights, *self._act)


_NAMES = {"mlx": ("weight", "scales"), "tiled": ("tiled_weight", "tiled_scales")}


checks.REFERENCES["expert_glu_reference"] = expert_glu_reference  # the kernels' oracle
