"""Routed experts requantized from MXFP4 to fewer bits (the converter's ``--expert-bits``).

The published experts are MXFP4: E2M1 codes with one E8M0 scale per 32 weights. A lower-bit
format (``kimi_k3.model.experts.ExpertFormat``, MLX's ``affine`` mode) stores per group of
``group_size`` weights a float16 scale ``s`` and bias ``b`` and ``bits``-bit codes ``q``, the
weight being ``s q + b``. The source values are decoded exactly (``dequantize_mxfp4``) and each
group is fitted to minimise its squared error (``quantize_affine``):

1. Candidates: for each of ``SHRINK``'s factors, the grid spanning that share of the group's
   range around its midpoint; every weight takes its nearest level (codes clipped to
   ``0 .. 2^bits - 1``).
2. Each candidate's codes are kept and ``(s, b)`` refitted by least squares (a 2 x 2 solve
   from the group's sums); the candidate with the least squared error wins.
3. ``REFITS`` rounds of: every weight to its nearest level, then ``(s, b)`` refitted.
4. ``s`` and ``b`` rounded to float16, and every weight to its nearest level of the rounded
   grid (so the codes are the best for the stored scale and bias).

Each step keeps a group's error from growing (steps 2 and 3 are a coordinate descent), so
the fit is never worse than the min/max grid (the first candidate, the range
``mx.quantize`` spans) but for float16 rounding; ``benchmarks/expert_formats.py`` measures it
against ``mx.quantize``. Everything is numpy on float32 (a group's sums in float32, the
solve in float64), row block by row block, so a converter's worker threads run it in
parallel (numpy releases the GIL) in bounded memory.

Codes are packed as MLX packs them: a little-endian bit stream, weight ``j`` of a row at bits
``bits * j ..`` of the row's bytes (2 bits: 16 codes a uint32; 3 bits: 8 codes in 3 bytes).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kimi_k3.checkpoint.files import CheckpointError
from kimi_k3.model.experts import EXPERT_TENSORS, MXFP4, ExpertFormat, ResidentExperts
from kimi_k3.model.moe import moe_blocks

E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
# Per width, the shares of a group's range the candidate grids span (1: min to max, as
# mx.quantize does): four levels fit best well inside the range, eight nearer its ends (on
# Gaussian weights at K3's widths, a 2-bit grid reaching down to 0.5 of the range fits
# about 1% better than one stopping at 0.7, and 3-bit steps of 0.05 about 0.7% better than
# steps of 0.1).
SHRINK = {2: (1.0, 0.9, 0.8, 0.7, 0.6, 0.5), 3: (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)}
REFITS = 1
ROWS = 256  # rows quantized at once (bounds the working memory: a few MB at K3's widths)
F16_MAX = float(np.finfo(np.float16).max)


def dequantize_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """compressed-tensors MXFP4 -> float32, exactly (every value fits float32).

    Shapes: packed uint8 [R, C/2] (the even element in the low nibble); scales uint8
    [R, C/32] (E8M0: ``2^(s - 127)``; 255, which the format reserves for NaN, raises).
    Returns [R, C].
    """
    if np.any(scales == 255):
        raise ValueError("an E8M0 scale of 255 (NaN)")
    R = packed.shape[0]
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(R, -1)
    scale = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    vals = E2M1.astype(np.float32)[codes].reshape(R, -1, 32)
    return (vals * scale[..., None]).reshape(R, -1)


def _sums(w, q):
    """Per group of ``w``, ``q`` [n, g] float32: the sums of q, q^2 and q w (float32 over a
    group's few dozen terms, float64 after)."""
    return (
        q.sum(1).astype(np.float64),
        np.einsum("ij,ij->i", q, q).astype(np.float64),
        np.einsum("ij,ij->i", q, w).astype(np.float64),
    )


def _fit(g, sw, sww, sq, sqq, sqw):
    """Least-squares ``(s, b)`` for a group's codes (from its sums: ``g`` weights, their
    sum ``sw`` and sum of squares ``sww``) and the squared error it leaves. A group whose
    codes are all equal gets ``s = 0`` and ``b`` its mean."""
    det = g * sqq - sq * sq
    ok = det > 0
    s = np.where(ok, (g * sqw - sq * sw) / np.where(ok, det, 1.0), 0.0)
    b = (sw - s * sq) / g
    return s, b, sww - s * sqw - b * sw  # the residual of a least-squares fit


def _assign(w, s, b, top):
    """Nearest codes (float32) of the grid ``s q + b``, q in 0..top, for groups ``w`` [n, g]."""
    inv = np.where(s != 0, 1.0 / np.where(s != 0, s, 1.0), 0.0)
    q = w - b[:, None].astype(np.float32)
    q *= inv[:, None].astype(np.float32)
    np.rint(q, out=q)
    np.clip(q, 0, top, out=q)
    return q


def _fit_groups(w: np.ndarray, bits: int, search: str):
    """Scale, bias (float16) and codes (uint8) of groups ``w`` [n, g] float32."""
    top = (1 << bits) - 1
    g = w.shape[1]
    lo, hi = w.min(1).astype(np.float64), w.max(1).astype(np.float64)
    if search == "minmax":
        s, b = (hi - lo) / top, lo
    else:
        sw = w.sum(1).astype(np.float64)
        sww = np.einsum("ij,ij->i", w, w).astype(np.float64)
        mid, half = (hi + lo) / 2, (hi - lo) / 2
        best = None
        for f in SHRINK[bits]:
            q = _assign(w, 2 * f * half / top, mid - f * half, top)
            fit = _fit(g, sw, sww, *_sums(w, q))
            if best is None:
                best = list(fit)
            else:
                better = fit[2] < best[2]
                best = [np.where(better, a, c) for a, c in zip(fit, best, strict=True)]
        s, b = best[0], best[1]
        for _ in range(REFITS):
            s, b, _ = _fit(g, sw, sww, *_sums(w, _assign(w, s, b, top)))
    if not (np.all(np.abs(s) <= F16_MAX) and np.all(np.abs(b) <= F16_MAX)):
        raise ValueError("weights beyond float16's range")
    s16, b16 = s.astype(np.float16), b.astype(np.float16)
    q = _assign(w, s16.astype(np.float64), b16.astype(np.float64), top)
    return s16, b16, q.astype(np.uint8)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes uint8 [R, C] (each below ``2^bits``) -> MLX's packing, uint32 [R, C * bits / 32]."""
    R, C = codes.shape
    if (C * bits) % 32:
        raise ValueError(f"{C} codes of {bits} bits are no whole uint32 words")
    planes = ((codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(R, C * bits)
    return np.packbits(planes, axis=1, bitorder="little").view(np.uint32)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """``pack_codes``' inverse: uint32 [R, W] -> uint8 [R, 32 W / bits]."""
    R = packed.shape[0]
    planes = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")
    planes = planes.reshape(R, -1, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(-1, dtype=np.uint8)


def quantize_affine(
    w: np.ndarray, bits: int, group_size: int, search: str = "lsq"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w`` [R, C] float32 -> MLX ``affine`` (packed codes uint32 [R, C * bits / 32], scales
    and biases float16 [R, C / group_size]), fitted as the module docstring says (``search``
    ``"lsq"``), or on the min/max grid (``"minmax"``, for comparison)."""
    R, C = w.shape
    if C % group_size:
        raise ValueError(f"rows of {C} weights are no whole groups of {group_size}")
    G = C // group_size
    packed = np.empty((R, C * bits // 32), np.uint32)
    scales = np.empty((R, G), np.float16)
    biases = np.empty((R, G), np.float16)
    for r in range(0, R, ROWS):
        block = np.ascontiguousarray(w[r : r + ROWS], dtype=np.float32)
        n = block.shape[0]
        s, b, q = _fit_groups(block.reshape(n * G, group_size), bits, search)
        scales[r : r + n], biases[r : r + n] = s.reshape(n, G), b.reshape(n, G)
        packed[r : r + n] = pack_codes(q.reshape(n, C), bits)
    return packed, scales, biases


def dequantize_affine(packed, scales, biases, bits: int) -> np.ndarray:
    """MLX ``affine`` -> float32 [R, C] (``s q + b`` per group)."""
    q = unpack_codes(packed, bits).astype(np.float32)
    R, C = q.shape
    G = scales.shape[1]
    s = scales.astype(np.float32)[..., None]
    b = biases.astype(np.float32)[..., None]
    return (q.reshape(R, G, -1) * s + b).reshape(R, C)


def requantize(packed: np.ndarray, scales: np.ndarray, fmt: ExpertFormat, search: str = "lsq"):
    """One MXFP4 matrix (``weight_packed`` uint8 [R, C/2], ``weight_scale`` uint8 [R, C/32])
    in ``fmt``: ``(weight, scales)`` unchanged for MXFP4, else ``quantize_affine``'s three
    arrays."""
    if fmt == MXFP4:
        return packed.view(np.uint32), scales
    return quantize_affine(dequantize_mxfp4(packed, scales), fmt.bits, fmt.group_size, search)


def requantize_record(six: dict[str, np.ndarray], fmt: ExpertFormat, where: str = "") -> bytes:
    """One expert's record in ``fmt``: ``six`` maps the published names (``w1.weight_packed``,
    ``w1.weight_scale``, ...) to their uint8 arrays; the record holds ``fmt.record_tensors``
    back to back. A matrix ``fmt`` cannot hold (a NaN scale, weights beyond float16) raises
    ``CheckpointError`` naming ``where`` and the tensor."""
    parts = {}
    for w in EXPERT_TENSORS:
        try:
            arrays = requantize(six[f"{w}.weight_packed"], six[f"{w}.weight_scale"], fmt)
        except ValueError as e:
            raise CheckpointError(f"{where}.{w}: cannot be requantized to {fmt}: {e}") from None
        parts.update(zip((f"{w}.{k}" for k in fmt.kinds), arrays, strict=True))
    return b"".join(np.ascontiguousarray(parts[n]).tobytes() for n in fmt.record_tensors)


def requantize_stacks(w: dict, fmt: ExpertFormat, search: str = "lsq") -> dict:
    """MXFP4 expert stacks ``{"w1": (weight uint32 [E, O, In/8], scales uint8 [E, O, In/32]),
    ...}`` (mx arrays, MLX's layout) in ``fmt``: ``{"w1": (weight, scales, biases), ...}``
    stacked the same way, each expert requantized as the converter does."""
    out = {}
    for name, (q, s) in w.items():
        q, s = np.array(q).view(np.uint8), np.array(s)
        parts = [requantize(q[e], s[e], fmt, search) for e in range(q.shape[0])]
        out[name] = tuple(mx.array(np.stack(a)) for a in zip(*parts, strict=True))
    return out


def requantize_model(model, fmt: ExpertFormat, search: str = "lsq"):
    """``model``'s resident MXFP4 experts requantized to ``fmt`` in place (every MoE layer's
    store replaced by a ``ResidentExperts`` of that format): the model a conversion with
    ``--expert-bits`` gives, without the files. Returns ``model``."""
    for moe in moe_blocks(model).values():
        old = moe.experts
        if not isinstance(old, ResidentExperts) or old.format != MXFP4 or old.layout != "mlx":
            raise ValueError(
                f"layer {moe.layer_index}: requantizing needs resident MXFP4 experts in MLX's "
                "layout"
            )
        stacks = requantize_stacks(old.tensors(), fmt, search)
        E, I, _ = old.w1.weight.shape
        new = ResidentExperts(E, old.w2.weight.shape[1], I, *old._act, fmt)
        for name, arrays in stacks.items():
            for kind, a in zip(fmt.kinds, arrays, strict=True):
                getattr(new, name)[kind] = a
        moe.experts = new
    mx.eval(model.parameters())
    return model
