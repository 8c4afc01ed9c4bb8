"""Where one routed expert's bytes live: the published shards, an expert pack, or mlx-lm.

A source answers ``extents(layer, expert)``: the file byte ranges to read, each listing the
cache tensors its bytes fill, back to back. Every layout holds the bytes the kernels read
(MXFP4 as published, or the converter's lower-bit experts in an expert pack; see
``kimi_k3.model.experts``), so the streamer copies them into its slots without conversion.
Errors name the file and the tensor (or the layer and expert).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kimi_k3.checkpoint.expert_pack import ExpertPack, is_pack_dir, source_name
from kimi_k3.checkpoint.files import CheckpointError, CheckpointIndex
from kimi_k3.checkpoint.layouts import mlx_lm_expert_names
from kimi_k3.model.config import ModelArgs
from kimi_k3.model.experts import MXFP4, ExpertFormat, expert_format, expert_keys

# The six cache tensors of one expert, in the order of the published shards and the pack.
TENSORS = ("w1.weight", "w1.scales", "w2.weight", "w2.scales", "w3.weight", "w3.scales")
_PUBLISHED = {"weight_packed": "weight", "weight_scale": "scales"}


@dataclass(frozen=True)
class Extent:
    """One contiguous byte range of ``file``; ``pieces`` = (tensor, nbytes) back to back."""

    file: Path
    offset: int
    nbytes: int
    pieces: tuple


def expert_shapes(args: ModelArgs) -> dict[str, tuple[tuple, type]]:
    """Per cache tensor of one expert, in record order: ``(shape, numpy dtype)`` in the
    model's expert format (``kimi_k3.model.experts.expert_format``).

    MXFP4 (MLX ``mode="mxfp4"``): ``w1``/``w3``: weight uint32 [I, Dl/8], scales uint8
    [I, Dl/32]; ``w2``: weight uint32 [Dl, I/8], scales uint8 [Dl, I/32] (Dl =
    routed_expert_hidden_size, I = moe_intermediate_size). Affine at ``bits``: weight uint32
    [O, In * bits / 32], scales and biases float16 [O, In / group_size].
    """
    fmt = expert_format(args)
    Dl, I = args.routed_expert_hidden_size, args.moe_intermediate_size
    dims = {"w1": (I, Dl), "w2": (Dl, I), "w3": (I, Dl)}
    out = {}
    for name in fmt.record_tensors:
        w, kind = name.split(".")
        out[name] = fmt.shapes(*dims[w])[kind]
    return out


def expert_bytes(layout: dict) -> int:
    """Bytes of one expert's six tensors (17,547,264 for K3)."""
    return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in layout.values())


def _runs(parts: list[tuple]) -> tuple[Extent, ...]:
    """Merge ``(file, start, nbytes, tensor)`` parts into extents of back-to-back bytes."""
    out = []
    for file, start, n, name in sorted(parts, key=lambda p: (str(p[0]), p[1])):
        if out and out[-1][0] == file and out[-1][1] + out[-1][2] == start:
            out[-1][2] += n
            out[-1][3].append((name, n))
        else:
            out.append([file, start, n, [(name, n)]])
    return tuple(Extent(f, s, n, tuple(p)) for f, s, n, p in out)


class ShardSource:
    """The published layout: ``experts.E.wN.{weight_packed,weight_scale}`` in the shards.

    An expert whose six tensors sit back to back in one shard is one extent (one read);
    otherwise each contiguous run is its own extent.
    """

    kind = "shards"
    sums = None  # the checkpoint's ``kimi_k3.checkpoint.checksums.Checksums``, set to verify reads

    def __init__(
        self, index: CheckpointIndex, layout: dict, layers: list[int], experts: range | int
    ):
        self.index, self.layout = index, layout
        self.split_experts = 0  # experts that need more than one read
        for layer in layers:
            for e in range(experts) if isinstance(experts, int) else experts:
                self.split_experts += len(self.extents(layer, e, check=True)) > 1
        self.files = index.files

    def extents(self, layer: int, expert: int, check: bool = False) -> tuple[Extent, ...]:
        parts = []
        for key in expert_keys(layer, expert):
            t = self.index[key]  # raises CheckpointError naming the missing tensor
            w, kind = key.rsplit(".", 2)[-2:]
            name = f"{w}.{_PUBLISHED[kind]}"
            if check:
                shape, dtype = self.layout[name]
                width = shape[1] * np.dtype(dtype).itemsize
                if t.dtype != "U8" or t.shape != (shape[0], width):
                    raise CheckpointError(
                        f"{t.file}: tensor {key} is {t.dtype}{list(t.shape)}, "
                        f"expected U8{[shape[0], width]}"
                    )
            parts.append((t.file, t.start, t.nbytes, name))
        return _runs(parts)

    def checksum(self, layer: int, expert: int) -> tuple | None:
        """The recorded crc32 of each piece of ``extents(layer, expert)``, in their order."""
        if self.sums is None:
            return None
        base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return tuple(
            self.sums.of(self.index[base + source_name(name)])
            for ext in self.extents(layer, expert)
            for name, _ in ext.pieces
        )


class MlxLmSource:
    """mlx-lm's layout: experts stacked ``[E, ...]`` per tensor in ``mlp.switch_mlp``
    (names from ``kimi_k3.checkpoint.layouts.mlx_lm_expert_names``).

    Expert ``e`` of a stacked tensor is the byte slice ``start + e * n .. start + (e+1) * n``:
    six reads per expert (the six stacked tensors are apart in the file).
    """

    kind = "mlx-lm"
    sums = None  # as ``ShardSource.sums``

    def __init__(self, index: CheckpointIndex, layout: dict, layers: list[int], num_experts: int):
        # Every expert's row of the stacks is checked; any range of them can be read.
        self.index, self.layout, self.tensors = index, layout, {}
        for layer in layers:
            for name, key in mlx_lm_expert_names(layer).items():
                t = index[key]
                shape, dtype = layout[name]
                want = "U32" if dtype == np.uint32 else "U8"
                if t.dtype != want or t.shape != (num_experts, *shape):
                    raise CheckpointError(
                        f"{t.file}: tensor {key} is {t.dtype}{list(t.shape)}, "
                        f"expected {want}{[num_experts, *shape]} (mxfp4)"
                    )
                biases = key.rsplit(".", 1)[0] + ".biases"
                if biases in index:
                    raise CheckpointError(
                        f"{index[biases].file}: tensor {biases}: affine-"
                        "quantized experts; only mxfp4 experts are streamed"
                    )
                self.tensors[(layer, name)] = t
        self.files = sorted({t.file for t in self.tensors.values()})

    def extents(self, layer: int, expert: int) -> tuple[Extent, ...]:
        out = []
        for name in TENSORS:
            t = self.tensors[(layer, name)]
            n = t.nbytes // t.shape[0]
            out.append(Extent(t.file, t.start + expert * n, n, ((name, n),)))
        return tuple(sorted(out, key=lambda x: (str(x.file), x.offset)))

    def checksum(self, layer: int, expert: int) -> tuple | None:
        """The recorded crc32 of the expert's row of each stacked tensor, in extent order."""
        if self.sums is None:
            return None
        return tuple(
            self.sums.of(self.tensors[(layer, ext.pieces[0][0])])[expert]
            for ext in self.extents(layer, expert)
        )


class PackSource:
    """This project's expert pack (``kimi_k3.checkpoint.expert_pack``): one page-aligned record per
    expert, so one aligned read per expert, with a crc32 per record."""

    kind = "pack"

    def __init__(
        self,
        path: Path,
        layout: dict,
        layers: list[int],
        num_experts: int,
        experts: range,
        fmt: ExpertFormat = MXFP4,
    ):
        self.pack = ExpertPack(path)
        self.index, self.records = None, {}
        if self.pack.format != fmt:
            raise CheckpointError(
                f"{self.pack.index_file}: the pack holds {self.pack.format} experts, "
                f"config.json says {fmt}"
            )
        for layer in layers:
            held = self.pack.held(layer)  # raises PackError for a missing layer
            if not self.pack.partial and len(held) != num_experts:
                raise CheckpointError(
                    f"{self.pack.index_file}: layer {layer} has {len(held)} experts, "
                    f"the config says {num_experts}"
                )
            if experts.start < held.start or experts.stop > held.stop:
                raise CheckpointError(
                    f"{self.pack.index_file}: layer {layer}: the pack holds experts "
                    f"{held.start}..{held.stop - 1}, this process serves "
                    f"{experts.start}..{experts.stop - 1} (a pack written for another rank?)"
                )
            self.records[layer] = self._record_layout(layer, layout)
        self.files = self.pack.files

    def _record_layout(self, layer: int, layout: dict) -> tuple[tuple, int]:
        """The record's pieces in offset order, checked against ``layout``."""
        lay = self.pack.layout(layer)
        pieces, end = [], 0
        for name in sorted(lay, key=lambda k: lay[k]["offset"]):
            t = lay[name]
            if name not in layout:
                raise CheckpointError(
                    f"{self.pack.index_file}: layer {layer}: unknown record tensor {name}"
                )
            shape, dtype = layout[name]
            if (t["dtype"], tuple(t["shape"])) != (np.dtype(dtype).name, shape):
                raise CheckpointError(
                    f"{self.pack.index_file}: layer {layer} tensor {name} is "
                    f"{t['dtype']}{t['shape']}, expected "
                    f"{np.dtype(dtype).name}{list(shape)}"
                )
            if t["offset"] != end:
                raise CheckpointError(
                    f"{self.pack.index_file}: layer {layer} tensor {name} "
                    f"starts at {t['offset']}, expected {end} (back to back)"
                )
            pieces.append((name, t["nbytes"]))
            end += t["nbytes"]
        if sorted(lay) != sorted(layout):
            raise CheckpointError(
                f"{self.pack.index_file}: layer {layer} records hold "
                f"{sorted(lay)}, expected {sorted(layout)}"
            )
        return tuple(pieces), end

    def extents(self, layer: int, expert: int) -> tuple[Extent, ...]:
        file, offset, _ = self.pack.record(layer, expert)
        pieces, nbytes = self.records[layer]
        return (Extent(file, offset, nbytes, pieces),)

    def checksum(self, layer: int, expert: int) -> int | None:
        return self.pack.checksum(layer, expert)


SOURCES = ("auto", "shards", "pack", "mlx-lm")


def open_source(
    path: Path,
    index: CheckpointIndex | None,
    args: ModelArgs,
    layers: list[int],
    kind: str = "auto",
    experts: range | None = None,
):
    """The expert source of a model directory: ``kind`` one of ``SOURCES``; ``experts``
    the experts read from it (all by default; one rank's range when expert parallel).

    ``auto`` picks the expert pack when ``path`` has one, else the published per-expert
    tensors, else mlx-lm's stacked ``switch_mlp`` tensors.
    """
    if kind not in SOURCES:
        raise ValueError(f"source={kind!r}: expected one of {SOURCES}")
    layout, E = expert_shapes(args), args.num_experts
    experts = range(E) if experts is None else experts
    if kind == "auto":
        kind = _detect(path, index, layers[0], is_pack_dir(path), experts.start)
    if kind == "pack":
        return PackSource(path, layout, layers, E, experts, expert_format(args))
    if expert_format(args) != MXFP4:
        raise CheckpointError(
            f"{path}: config.json names {expert_format(args)} experts, which only an expert "
            f"pack holds (source={kind!r} holds MXFP4 experts)"
        )
    index = index if index is not None else CheckpointIndex(path)
    if kind == "shards":
        return ShardSource(index, layout, layers, experts)
    return MlxLmSource(index, layout, layers, E)


def available(path: Path, index: CheckpointIndex | None, layer: int, expert: int = 0) -> list:
    """The expert sources ``path`` holds for ``expert`` of ``layer``, in ``auto``'s order of
    preference: the expert pack, the published per-expert tensors, mlx-lm's stacked ones
    (the last two looked up in ``index``; none without one)."""
    out = ["pack"] if is_pack_dir(path) else []
    if index is not None and expert_keys(layer, expert)[0] in index:
        out.append("shards")
    if index is not None and mlx_lm_expert_names(layer)["w1.weight"] in index:
        out.append("mlx-lm")
    return out


def _detect(
    path: Path, index: CheckpointIndex | None, layer: int, has_pack: bool, expert: int = 0
) -> str:
    if has_pack:
        return "pack"
    found = available(path, index if index is not None else CheckpointIndex(path), layer, expert)
    if found:
        return found[0]
    raise CheckpointError(
        f"{path}: no routed experts found for layer {layer}: neither an "
        "expert pack (experts/index.json), nor published experts."
        f"E.w1.weight_packed, nor mlx-lm switch_mlp tensors"
    )
