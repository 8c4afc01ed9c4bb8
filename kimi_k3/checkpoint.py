"""Safetensors checkpoints: validated headers, the shard index, and a streaming writer.

Every error names the file and, where there is one, the tensor: a truncated shard, a
corrupted header, a tensor the index promises but the shard lacks.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DTYPE_SIZE = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "U32": 4,
    "I32": 4,
    "I64": 8,
    "U64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
NP_DTYPE = {
    "F32": np.float32,
    "F16": np.float16,
    "U8": np.uint8,
    "I32": np.int32,
    "U32": np.uint32,
    "BF16": np.uint16,
    "I64": np.int64,
}
MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it claims to be."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header against the file's real size."""
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{file}: corrupted safetensors header (length {n}, file {size} bytes)"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: shard file is missing") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: corrupted safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupted safetensors header (not a JSON object)")
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor_info(file, name, meta, base, size)
    return out


def _tensor_info(file, name, meta, base, size) -> TensorInfo:
    try:
        dtype, shape, (a, b) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        ok = all(type(d) is int and d >= 0 for d in shape) and type(a) is int and type(b) is int
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{file}: tensor {name}: malformed header entry {meta!r}")
    if dtype not in DTYPE_SIZE:
        raise CheckpointError(f"{file}: tensor {name}: unknown dtype {dtype!r}")
    want = math.prod(shape) * DTYPE_SIZE[dtype]
    if b - a != want or a < 0:
        raise CheckpointError(
            f"{file}: tensor {name}: data_offsets {a}..{b} do not fit "
            f"{dtype}{list(shape)} ({want} bytes)"
        )
    if base + b > size:
        raise CheckpointError(
            f"{file}: truncated: tensor {name} ends at byte {base + b} but the file has {size}"
        )
    return TensorInfo(name, file, dtype, shape, base + a, base + b)


class CheckpointIndex:
    """Every tensor of a checkpoint directory: ``model.safetensors.index.json`` + shards, or a
    single ``model.safetensors``. Headers are validated on open; data is not read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid shard index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"{self.path}: no model.safetensors.index.json and no *.safetensors files"
                )
            weight_map = None
        self.tensors: dict[str, TensorInfo] = {}
        for fname in files:
            self.tensors.update(read_header(self.path / fname))
        if weight_map is not None:
            for name, fname in weight_map.items():
                info = self.tensors.get(name)
                if info is None or info.file.name != fname:
                    raise CheckpointError(
                        f"{self.path / fname}: tensor {name} is in the index but not in that shard"
                    )

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(
                f"{self.path}: tensor {name} is missing from the checkpoint"
            ) from None

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    def read_numpy(self, name: str) -> np.ndarray:
        """One tensor as numpy (BF16 as its raw uint16 bits)."""
        t = self[name]
        with open(t.file, "rb") as f:
            f.seek(t.start)
            buf = f.read(t.nbytes)
        if len(buf) != t.nbytes:
            raise CheckpointError(f"{t.file}: short read of tensor {name}")
        return np.frombuffer(buf, dtype=NP_DTYPE[t.dtype]).reshape(t.shape)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + 0x7FFF + ((u >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


class ShardWriter:
    """Writes tensors into size-bounded safetensors shards plus the index, atomically.

    ``add(name, array, dtype)`` buffers up to ``shard_bytes``; a shard is written when full.
    Shard names follow the published ``model-0000N-of-0000M.safetensors`` pattern (renamed
    once the total count is known).
    """

    def __init__(self, out: str | Path, shard_bytes: int = 2 << 30):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self.pending: list[tuple[str, np.ndarray, str]] = []
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []

    def add(self, name: str, array: np.ndarray, dtype: str):
        if self.pending and self.pending_bytes + array.nbytes > self.shard_bytes:
            self.flush()
        self.pending.append((name, np.ascontiguousarray(array), dtype))
        self.pending_bytes += array.nbytes

    def flush(self):
        if not self.pending:
            return
        tmp = self.out / f".shard-{len(self.written):05d}.tmp"
        write_safetensors(tmp, self.pending)
        self.written.append((tmp, [n for n, _, _ in self.pending]))
        self.pending, self.pending_bytes = [], 0

    def close(self) -> list[Path]:
        self.flush()
        total = len(self.written)
        weight_map, files = {}, []
        for i, (tmp, names) in enumerate(self.written):
            final = self.out / f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            os.replace(tmp, final)
            files.append(final)
            weight_map.update({n: final.name for n in names})
        size = sum(f.stat().st_size for f in files)
        index = {"metadata": {"total_size": size}, "weight_map": weight_map}
        write_text_atomic(self.out / "model.safetensors.index.json", json.dumps(index, indent=1))
        return files


def write_safetensors(file: Path, tensors: list[tuple[str, np.ndarray, str]]):
    """Write ``(name, array, dtype)`` triples in order (data back to back, in that order)."""
    header, offset = {}, 0
    for name, arr, dtype in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, arr, _ in tensors:
            f.write(arr.tobytes())


def write_text_atomic(file: Path, text: str):
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, file)
