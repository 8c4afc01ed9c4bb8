"""The expert pack: routed experts laid out for streaming reads from an SSD.

A converted model directory holds ``experts/index.json`` and pack files
``experts/experts-00001-of-000NN.pack``. A pack file is a run of records in (layer, expert)
order, one per routed expert; every record starts at a multiple of ``ALIGN`` (4096) bytes and
is zero-padded to the next multiple, so one aligned read fetches one expert. A record holds
the expert's six tensors back to back, the bytes exactly as in the published checkpoint:

    w1.weight  (experts.E.w1.weight_packed)  u8 [I, D/2]  read as uint32 [I, D/8]
    w1.scales  (experts.E.w1.weight_scale)   u8 [I, D/32]
    w2.weight  (experts.E.w2.weight_packed)  u8 [D, I/2]  read as uint32 [D, I/8]
    w2.scales  (experts.E.w2.weight_scale)   u8 [D, I/32]
    w3.weight, w3.scales                     like w1

The packed bytes viewed as uint32 are MLX ``mode="mxfp4"`` weights (see ``kimi_k3.model.experts``).
``index.json`` (format ``kimi-k3-expert-pack``, version 1) names the files and, per MoE layer,
each tensor's offset, byte count, dtype and shape within a record, and each expert's
``[file number, offset, crc32]``.

A pack of requantized experts (``python -m kimi_k3.convert --expert-bits 3`` or ``2``: MLX
``affine``) is version 2: its index names the format (``"expert_format": {"mode", "bits",
"group_size"}``) and each record holds ``wN.weight`` (uint32 codes), ``wN.scales`` and
``wN.biases`` (float16) for w1, w2, w3 in that order. docs/converter.md describes the layout
in full.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kimi_k3.checkpoint.files import (
    MAX_LISTING_BYTES,
    CheckpointError,
    load_json_object,
    open_regular,
    read_capped,
    write_text_atomic,
)
from kimi_k3.model.experts import MXFP4, ExpertFormat, format_from_json

ALIGN = 4096
PACK_DIR = "experts"
INDEX = "index.json"
FORMAT, VERSION = "kimi-k3-expert-pack", 1
FORMAT_VERSION = 2  # the version of a pack whose experts are not MXFP4 (it names the format)
# Record order, and the published tensor each record slot holds.
TENSORS = ("w1.weight", "w1.scales", "w2.weight", "w2.scales", "w3.weight", "w3.scales")
SOURCE = {"weight": "weight_packed", "scales": "weight_scale"}
_NP = {"uint32": np.uint32, "uint8": np.uint8, "float16": np.float16}


class PackError(CheckpointError):
    """An expert pack that is missing, malformed or corrupted; names the file and record."""


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def source_name(name: str) -> str:
    """``w1.weight`` -> ``w1.weight_packed``: the published tensor a record slot holds."""
    w, kind = name.split(".")
    return f"{w}.{SOURCE[kind]}"


@dataclass(frozen=True)
class RecordLayout:
    """Where one expert's six tensors sit within its record (the same for a whole layer)."""

    tensors: dict  # name -> {"offset", "nbytes", "dtype", "shape"}
    data_bytes: int  # bytes of tensor data (what the crc32 covers)

    @property
    def record_bytes(self) -> int:
        return aligned(self.data_bytes)

    @classmethod
    def from_published(cls, shapes: dict[str, tuple], where: str = "") -> RecordLayout:
        """Build from the published u8 shapes keyed ``w1.weight_packed``, ``w1.weight_scale``...

        Shapes: ``wN.weight_packed`` [O, I/2] and ``wN.weight_scale`` [O, I/32] (I % 32 == 0).
        """
        tensors, offset = {}, 0
        for name in TENSORS:
            src = source_name(name)
            if src not in shapes:
                raise PackError(f"{where}: expert tensor {src} is missing")
            shape = tuple(shapes[src])
            if len(shape) != 2:
                raise PackError(f"{where}: expert tensor {src} has shape {list(shape)}, want 2-D")
            nbytes = shape[0] * shape[1]
            if name.endswith(".weight"):
                if shape[1] % 16:
                    raise PackError(
                        f"{where}: expert tensor {src} has {shape[1]} bytes per "
                        "row; MXFP4 rows are whole groups of 32 codes (16 bytes)"
                    )
                dtype, view = "uint32", [shape[0], shape[1] // 4]
            else:
                packed = shapes[source_name(name.replace("scales", "weight"))]
                if shape != (packed[0], packed[1] // 16):
                    raise PackError(
                        f"{where}: expert tensor {src} has shape {list(shape)}, "
                        f"expected {[packed[0], packed[1] // 16]} (one scale per "
                        "32 codes)"
                    )
                dtype, view = "uint8", list(shape)
            tensors[name] = {"offset": offset, "nbytes": nbytes, "dtype": dtype, "shape": view}
            offset += nbytes
        return cls(tensors, offset)

    @classmethod
    def from_format(cls, fmt: ExpertFormat, dim: int, hidden: int) -> RecordLayout:
        """The record of an expert of latent ``dim`` and hidden size ``hidden`` in ``fmt``:
        ``fmt.record_tensors`` back to back."""
        dims = {"w1": (hidden, dim), "w2": (dim, hidden), "w3": (hidden, dim)}
        tensors, offset = {}, 0
        for name in fmt.record_tensors:
            w, kind = name.split(".")
            shape, dtype = fmt.shapes(*dims[w])[kind]
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            tensors[name] = {
                "offset": offset,
                "nbytes": nbytes,
                "dtype": np.dtype(dtype).name,
                "shape": list(shape),
            }
            offset += nbytes
        return cls(tensors, offset)

    def to_json(self) -> dict:
        return {
            "data_bytes": self.data_bytes,
            "record_bytes": self.record_bytes,
            "tensors": self.tensors,
        }


def file_name(i: int, n: int) -> str:
    return f"experts-{i + 1:05d}-of-{n:05d}.pack"


def plan_files(layers: dict[int, tuple[RecordLayout, int]], file_bytes: int) -> list[list]:
    """Split the records, in (layer, expert) order, into files of at most ``file_bytes``.

    ``layers`` maps a layer to ``(layout, num_experts)`` or ``(layout, range of experts)``.
    A record never straddles two files; a file holds at least one record. Returns per file
    the list of ``(layer, expert)``.
    """
    files, current, size = [], [], 0
    for layer in sorted(layers):
        layout, n = layers[layer]
        for e in range(n) if isinstance(n, int) else n:
            if current and size + layout.record_bytes > file_bytes:
                files.append(current)
                current, size = [], 0
            current.append((layer, e))
            size += layout.record_bytes
    if current:
        files.append(current)
    return files


class RecordWriter:
    """Appends page-aligned records to a binary file, hashing the whole file as it goes."""

    def __init__(self, f):
        self.f = f
        self.size = 0
        self.sha256 = hashlib.sha256()

    def add(self, data) -> tuple[int, int]:
        """Write one record's data bytes plus padding; returns ``(offset, crc32)``."""
        offset, n = self.size, len(data)
        pad = bytes(aligned(n) - n)
        self.f.write(data)
        self.f.write(pad)
        self.sha256.update(data)
        self.sha256.update(pad)
        self.size += n + len(pad)
        return offset, zlib.crc32(data)


def index_json(
    layouts: dict[int, RecordLayout],
    files: list[str],
    file_bytes: list[int],
    records: dict[tuple[int, int], tuple[int, int, int]],
    experts: range | None = None,
    fmt: ExpertFormat = MXFP4,
) -> dict:
    """The ``index.json`` document. ``records[(layer, e)] = (file number, offset, crc32)``;
    ``experts``: the range of every layer's experts a pack for one rank holds; ``fmt``: the
    experts' format (a pack of MXFP4 experts is version 1 and does not name it)."""
    counts = Counter(layer for layer, _ in records)
    layers = {}
    for layer in sorted(layouts):
        held = experts if experts is not None else range(counts[layer])
        entry = layouts[layer].to_json()
        entry["records"] = [list(records[(layer, e)]) for e in held]
        layers[str(layer)] = entry
    extra = {} if experts is None else {"expert_range": [experts.start, experts.stop]}
    if fmt != MXFP4:
        extra["expert_format"] = fmt.to_json()
    return {
        **extra,
        "format": FORMAT,
        "version": VERSION if fmt == MXFP4 else FORMAT_VERSION,
        "align": ALIGN,
        "checksum": "crc32",
        "files": files,
        "file_bytes": file_bytes,
        "layers": layers,
    }


def write_pack(out: str | Path, experts: dict[int, list[dict]], file_bytes: int = 4 << 30) -> Path:
    """Write a whole pack from in-memory experts (tests, small models); returns the pack dir.

    ``experts[layer][e]`` maps the published names (``w1.weight_packed``, ...) to u8 arrays.
    The converter streams instead, with the same pieces (``plan_files``, ``RecordWriter``).
    """
    pack = Path(out) / PACK_DIR
    pack.mkdir(parents=True, exist_ok=True)
    layouts = {
        l: RecordLayout.from_published({k: v.shape for k, v in ex[0].items()}, f"layer {l}")
        for l, ex in experts.items()
    }
    plan = plan_files({l: (layouts[l], len(ex)) for l, ex in experts.items()}, file_bytes)
    names = [file_name(i, len(plan)) for i in range(len(plan))]
    records, sizes = {}, []
    for i, recs in enumerate(plan):
        with open(pack / names[i], "wb") as f:
            w = RecordWriter(f)
            for layer, e in recs:
                data = b"".join(
                    np.ascontiguousarray(experts[layer][e][source_name(t)]).tobytes()
                    for t in TENSORS
                )
                records[(layer, e)] = (i, *w.add(data))
        sizes.append(w.size)
    doc = index_json(layouts, names, sizes, records)
    write_text_atomic(pack / INDEX, json.dumps(doc, separators=(",", ":")))
    return pack


def is_pack_dir(path: str | Path) -> bool:
    """Whether ``path`` is a converted model directory (or its ``experts`` dir) with a pack
    (an index there that is not a regular file still counts: ``ExpertPack`` refuses it by
    name)."""
    path = Path(path)
    return (path / PACK_DIR / INDEX).exists() or (path.name == PACK_DIR and (path / INDEX).exists())


class ExpertPack:
    """Read-only access to an expert pack: byte ranges for the streamer, arrays for loaders.

    ``path`` is the converted model directory or its ``experts`` directory. Reads use
    ``os.pread`` on file descriptors opened once, so they are safe from several threads.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        self.dir = path / PACK_DIR if (path / PACK_DIR / INDEX).exists() else path
        file = self.dir / INDEX
        try:
            raw = read_capped(file, MAX_LISTING_BYTES)
        except FileNotFoundError:
            raise PackError(f"{file}: no expert pack index (not a converted model?)") from None
        doc = load_json_object(raw, file, PackError)
        if doc.get("format") != FORMAT or doc.get("version") not in (VERSION, FORMAT_VERSION):
            raise PackError(
                f"{file}: format {doc.get('format')!r} version "
                f"{doc.get('version')!r}, expected {FORMAT!r} version {VERSION} or "
                f"{FORMAT_VERSION}"
            )
        if doc["version"] == VERSION:
            if "expert_format" in doc:
                raise PackError(f"{file}: a version {VERSION} pack names no expert_format")
            self.format = MXFP4
        else:
            try:
                self.format = format_from_json(doc.get("expert_format"), f"{file}")
            except ValueError as e:
                raise PackError(str(e)) from None
            if self.format == MXFP4:
                raise PackError(f"{file}: a version {FORMAT_VERSION} pack of MXFP4 experts")
        self.index_file = file
        self.files = [self.dir / name for name in doc["files"]]
        self.file_bytes = doc["file_bytes"]
        self._layers = {int(l): v for l, v in doc["layers"].items()}
        # A pack written for one rank holds experts [first, first + n) of every layer.
        self.partial = "expert_range" in doc
        self.first = int(doc.get("expert_range", [0])[0])
        self._fds: dict[int, int] = {}

    @property
    def layers(self) -> list[int]:
        return sorted(self._layers)

    def _layer(self, layer: int) -> dict:
        try:
            return self._layers[layer]
        except KeyError:
            raise PackError(
                f"{self.index_file}: layer {layer} has no routed experts in the "
                f"pack (layers {self.layers[0]}..{self.layers[-1]})"
            ) from None

    def num_experts(self, layer: int) -> int:
        return len(self._layer(layer)["records"])

    def held(self, layer: int) -> range:
        """The experts of ``layer`` the pack holds (all of them unless written for one rank)."""
        return range(self.first, self.first + self.num_experts(layer))

    def _entry(self, layer: int, expert: int) -> list:
        recs = self._layer(layer)["records"]
        if expert not in self.held(layer):
            held = self.held(layer)
            raise PackError(
                f"{self.index_file}: layer {layer} has no expert {expert} (it holds experts "
                f"{held.start}..{held.stop - 1})"
            )
        return recs[expert - self.first]

    def record(self, layer: int, expert: int) -> tuple[Path, int, int]:
        """``(file, offset, nbytes)`` of one expert's data; ``offset`` is a multiple of 4096."""
        f, offset, _ = self._entry(layer, expert)
        return self.files[f], offset, self._layer(layer)["data_bytes"]

    def checksum(self, layer: int, expert: int) -> int:
        """crc32 (``zlib.crc32``) of the record's data bytes."""
        return self._entry(layer, expert)[2]

    def layout(self, layer: int) -> dict:
        """Per tensor name: ``{"offset", "nbytes", "dtype", "shape"}`` within a record."""
        return self._layer(layer)["tensors"]

    def record_bytes(self, layer: int) -> int:
        """A record's size including padding (its data size rounded up to 4096)."""
        return self._layer(layer)["record_bytes"]

    def decode(self, layer: int, buf) -> dict[str, np.ndarray]:
        """Split one record's bytes into its arrays (zero-copy views of ``buf``).

        Shapes (MXFP4, mlx ``mode="mxfp4"``): ``w1.weight``/``w3.weight`` uint32 [I, D/8],
        ``w1.scales``/``w3.scales`` uint8 [I, D/32], ``w2.weight`` uint32 [D, I/8],
        ``w2.scales`` uint8 [D, I/32]; affine (``self.format``) as its ``shapes``, with
        ``wN.biases``.
        """
        raw = np.frombuffer(buf, dtype=np.uint8)
        out = {}
        for name, t in self.layout(layer).items():
            a = raw[t["offset"] : t["offset"] + t["nbytes"]]
            out[name] = a.view(_NP[t["dtype"]]).reshape(t["shape"])
        return out

    def _fd(self, f: int) -> int:
        fd = self._fds.get(f)
        if fd is None:
            try:
                fd, _ = open_regular(self.files[f])
            except FileNotFoundError:
                raise PackError(f"{self.files[f]}: expert pack file is missing") from None
            fd = self._fds.setdefault(f, fd)
        return fd

    def read_bytes(self, layer: int, expert: int) -> bytes:
        """One record's data bytes (one ``pread``)."""
        f, offset, _ = self._entry(layer, expert)
        n = self._layer(layer)["data_bytes"]
        data = os.pread(self._fd(f), n, offset)
        if len(data) != n:
            raise PackError(
                f"{self.files[f]}: truncated: layer {layer} expert {expert} needs "
                f"bytes {offset}..{offset + n}"
            )
        return data

    def read(self, layer: int, expert: int, verify: bool = False) -> dict[str, np.ndarray]:
        """One expert's six arrays (see ``decode``); ``verify`` checks its crc32 first."""
        data = self.read_bytes(layer, expert)
        if verify:
            self._check(layer, expert, data)
        return self.decode(layer, data)

    def read_layer(
        self, layer: int, verify: bool = False, experts: range | None = None
    ) -> dict[str, np.ndarray]:
        """The experts of one layer (all the pack holds, or ``experts``) stacked: name ->
        [E, ...] (what ``ResidentExperts`` holds); ``verify`` checks each record's crc32."""
        experts = self.held(layer) if experts is None else experts
        lay = self.layout(layer)
        out = {k: np.empty([len(experts), *t["shape"]], _NP[t["dtype"]]) for k, t in lay.items()}
        for i, e in enumerate(experts):
            for k, a in self.read(layer, e, verify).items():
                out[k][i] = a
        return out

    def _check(self, layer: int, expert: int, data: bytes):
        if zlib.crc32(data) != self.checksum(layer, expert):
            f, offset, _ = self.record(layer, expert)
            raise PackError(
                f"{f}: checksum mismatch in the record of layer {layer} expert "
                f"{expert} (bytes {offset}..{offset + len(data)}): the pack is "
                "corrupted; reconvert or re-copy this file"
            )

    def verify_file(self, f: int, progress: Callable[[int], None] | None = None) -> str:
        """Re-read pack file ``f`` in order: check its size and every record's crc32.

        Returns the file's sha256 (hex). Raises ``PackError`` naming the file, layer and
        expert of the first bad record.
        """
        path, size = self.files[f], self.file_bytes[f]
        if not path.is_file():
            raise PackError(f"{path}: expert pack file is missing")
        if path.stat().st_size != size:
            raise PackError(f"{path}: {path.stat().st_size} bytes, the index says {size}")
        sha, pos, fd = hashlib.sha256(), 0, self._fd(f)
        for offset, layer, e in self._by_file()[f]:
            n, padded = self._layer(layer)["data_bytes"], self.record_bytes(layer)
            if offset != pos:
                raise PackError(
                    f"{self.index_file}: layer {layer} expert {e} starts at byte "
                    f"{offset} of {path.name}, expected {pos}"
                )
            data = os.pread(fd, padded, offset)
            if len(data) != padded:
                raise PackError(f"{path}: truncated in the record of layer {layer} expert {e}")
            self._check(layer, e, data[:n])
            sha.update(data)
            pos += padded
            if progress:
                progress(padded)
        if pos != size:
            raise PackError(f"{path}: records end at byte {pos}, the file has {size}")
        return sha.hexdigest()

    def verify(self, progress: Callable[[int], None] | None = None) -> int:
        """``verify_file`` for every file; returns the number of records checked."""
        for f in range(len(self.files)):
            self.verify_file(f, progress)
        return sum(len(r) for r in self._by_file().values())

    def _by_file(self) -> dict[int, list[tuple[int, int, int]]]:
        if not hasattr(self, "_files_records"):
            by: dict[int, list] = {f: [] for f in range(len(self.files))}
            for layer, e in self.records():
                f, offset, _ = self._entry(layer, e)
                by[f].append((offset, layer, e))
            self._files_records = {f: sorted(v) for f, v in by.items()}
        return self._files_records

    def records(self) -> Iterable[tuple[int, int]]:
        for layer in self.layers:
            for e in self.held(layer):
                yield layer, e

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        if hasattr(self, "_fds"):
            self.close()
