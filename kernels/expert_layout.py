"""The tiled layout of MXFP4 expert stacks, which the CUDA kernels read faster than MLX's.

MLX's layout keeps each row's codes contiguous (``weight`` uint32 [E, R, K/8], ``scales``
uint8 [E, R, K/32]), so a warp's load of 16 bytes per lane touches 8 rows x 64 bytes. The
tiled layout has the same shapes and bytes, permuted within each expert: its rows cut into
16-row tiles, each tile into blocks of 4 scale groups, a block's 16 rows x 64 bytes of codes
contiguous, so the same warp load is 512 contiguous bytes. A kernel lane (g, tq) (lane =
4 g + tq) reads group tq of rows g and g + 8 of each block; its scale bytes of two blocks
in a row (an 8-group step of the decode kernels) are one 32-bit word. Index of row r =
16 t + 8 h + g, scale group j = 4 b + tq of expert e, G = K / 32 groups, nb = G / 4 blocks::

    codes (16-byte words):  ((e * R / 16 + t) * nb + b) * 64 + 32 h + 4 g + tq
    scales (bytes):         (e * R / 16 + t) * 16 G + 128 (b / 2) + o,
                            o = 4 (4 g + tq) + 2 (b % 2) + h   (blocks 2i, 2i + 1: a word)
                            o = 2 (4 g + tq) + h               (the last block, where nb is odd)

On the H200 the one-launch decode (``mxfp4_one``) is faster on tiles than on MLX's layout
(docs/benchmarks.md#decode-the-tiled-store-against-mlxs-layout; the scale words:
docs/benchmarks.md#mxfp4-decode-parameters), so the expert store holds tiles where CUDA's
kernels serve it (``kimi_k3.model.experts.store_layout``, ``kernels_read``). A stack in
this layout is a ``TiledStacks``: every consumer either reads tiles (``mxfp4_one``,
``mxfp4_mma``, ``mxfp4_prefill_mma``, each with its ``tiled`` variant) or calls ``untile``
first (``expert_glu_reference``), so tiles are never read as MLX's layout by mistake.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .mxfp4_mma import eligible_dims

LAYOUTS = ("auto", "mlx", "tiled")


class TiledStacks(dict):
    """Expert stacks ``{"w1": (weight, scales), "w3": ..., "w2": ...}`` in the tiled layout
    (a ``dict``, so code that only passes stacks along needs no change)."""


def is_tiled(w) -> bool:
    return isinstance(w, TiledStacks)


def supports(dim: int, hidden: int) -> bool:
    """Whether stacks of latent ``dim`` and expert ``hidden`` size can be tiled: rows in
    whole 16-row tiles and scale groups in whole blocks of 4 (both multiples of 128)."""
    return dim % 128 == 0 and hidden % 128 == 0


def kernels_read(dim: int, hidden: int) -> bool:
    """Whether CUDA's tensor-core kernels read tiled stacks of these dims (their
    ``mxfp4_mma.eligible_dims``, which implies ``supports``): where ``expert_layout="auto"``
    tiles the store on CUDA."""
    return eligible_dims(dim, hidden)


def _check(name: str, q, s):
    E, R, W = q.shape
    if R % 16 or W % 16 or s.shape != (E, R, W // 4):
        raise ValueError(
            f"expert stack {name}: weight {tuple(q.shape)} and scales {tuple(s.shape)} "
            "cannot be tiled (rows must be a multiple of 16, scale groups of 4)"
        )
    return E, R, W // 4


def _permute(a, E: int, R: int, G: int, unit: int, inverse: bool = False):
    """``a`` [E, R, G * unit] (mx or numpy: each row G scale groups of ``unit`` elements) with
    each expert's (16-row tile, 4-group block) pairs swapped into the tiled order, or back
    where ``inverse`` (the codes' order)."""
    split = (E, R // 16, G // 4, 16, 4 * unit) if inverse else (E, R // 16, 16, G // 4, 4 * unit)
    return a.reshape(split).transpose(0, 1, 3, 2, 4).reshape(E, R, G * unit)


def _permute_scales(s, E: int, R: int, G: int, inverse: bool = False):
    """Scale bytes ``s`` [E, R, G] (mx or numpy) in the tiled order (module docstring: per
    16-row tile, blocks in pairs of 128 bytes, lane 4 g + tq's word holding rows g, g + 8 of
    both blocks' group tq; an odd last block 64 bytes of halfwords), or back where ``inverse``."""
    T, nb = R // 16, G // 4
    pairs = nb // 2
    cat = mx.concatenate if isinstance(s, mx.array) else np.concatenate
    if not inverse:
        # [E, T, h, g, block, tq] -> pairs [E, T, i, g, tq, b % 2, h], a lone block [E, T, g, tq, h]
        a = s.reshape(E, T, 2, 8, nb, 4)
        head = a[:, :, :, :, : 2 * pairs].reshape(E, T, 2, 8, pairs, 2, 4)
        parts = [head.transpose(0, 1, 4, 3, 6, 5, 2).reshape(E, T, 128 * pairs)]
        if nb % 2:
            parts.append(a[:, :, :, :, nb - 1].transpose(0, 1, 3, 4, 2).reshape(E, T, 64))
        return cat(parts, axis=2).reshape(E, R, G)
    a = s.reshape(E, T, 16 * G)
    head = a[:, :, : 128 * pairs].reshape(E, T, pairs, 8, 4, 2, 2)
    parts = [head.transpose(0, 1, 6, 3, 2, 5, 4).reshape(E, T, 2, 8, 8 * pairs)]
    if nb % 2:
        parts.append(a[:, :, 128 * pairs :].reshape(E, T, 8, 4, 2).transpose(0, 1, 4, 2, 3))
    return cat(parts, axis=4).reshape(E, R, G)


def tile_pair(q: mx.array, s: mx.array, name: str = "stack") -> tuple:
    """One stack (weight uint32 [E, R, W], scales uint8 [E, R, W / 4]) in the tiled layout."""
    E, R, G = _check(name, q, s)
    return _permute(q, E, R, G, 4), _permute_scales(s, E, R, G)


def untile_pair(q: mx.array, s: mx.array, name: str = "stack") -> tuple:
    """``tile_pair``'s inverse."""
    E, R, G = _check(name, q, s)
    return _permute(q, E, R, G, 4, inverse=True), _permute_scales(s, E, R, G, inverse=True)


def tile(w: dict) -> TiledStacks:
    """Stacks in MLX's layout -> ``TiledStacks`` (lazy MLX ops: one copy when evaluated)."""
    if is_tiled(w):
        raise ValueError("expert stacks are already tiled")
    return TiledStacks({n: tile_pair(q, s, n) for n, (q, s) in w.items()})


def untile(w: dict) -> dict:
    """``TiledStacks`` -> stacks in MLX's layout; stacks already in MLX's layout unchanged."""
    if not is_tiled(w):
        return w
    return {n: untile_pair(q, s, n) for n, (q, s) in w.items()}


def tile_expert_bytes(codes: np.ndarray, scales: np.ndarray, rows: int):
    """One expert matrix's bytes (codes uint8 [rows * K / 2], scales uint8 [rows * K / 32],
    MLX's layout, contiguous) rewritten in place in the tiled layout (numpy)."""
    G = scales.size // rows if rows else 0
    if scales.size != rows * G or codes.size != 16 * rows * G:
        raise ValueError(
            f"expert bytes: {codes.size} code and {scales.size} scale bytes are no "
            f"{rows}-row matrix in whole tiles"
        )
    tile_expert_piece("codes", codes, rows)
    tile_expert_piece("scales", scales, rows)


def tile_expert_piece(kind: str, dst: np.ndarray, rows: int, src: np.ndarray | None = None):
    """One expert matrix's ``"codes"`` (uint8 [rows * K / 2]) or ``"scales"`` (uint8
    [rows * K / 32]) in MLX's layout written into ``dst`` in the tiled layout: from ``src``
    (one strided copy, no temporary for the codes: the streamer's reader threads place a
    read buffer's bytes into a slot so), or in place where ``src`` is None."""
    per_group = 16 if kind == "codes" else 1
    G = dst.size // (rows * per_group) if rows else 0
    if kind not in ("codes", "scales") or rows % 16 or G % 4 or dst.size != rows * G * per_group:
        raise ValueError(
            f"expert bytes: {dst.size} {kind} bytes are no {rows}-row matrix in whole tiles"
        )
    if src is None or np.shares_memory(src, dst):
        src = dst.copy()
    elif src.size != dst.size:
        raise ValueError(f"expert bytes: {src.size} {kind} bytes to place in {dst.size}")
    if kind == "scales":
        dst[:] = _permute_scales(src, 1, rows, G).reshape(-1)
        return
    # the codes' tiled order as a view of ``dst``, so one strided copy fills it
    tiled = dst.reshape(rows // 16, G // 4, 16, 64)
    np.copyto(tiled, src.reshape(rows // 16, 16, G // 4, 64).transpose(0, 2, 1, 3))
