"""Safetensors checkpoints: validated headers, the shard index, and a streaming writer.

Every error names the file and, where there is one, the tensor: a truncated shard, a
corrupted header, a tensor the index promises but the shard lacks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
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
MAX_JSON_DEPTH = 64  # far below the recursion limit json's parser would hit
# The most bytes each kind of checkpoint file may hold, checked before it is read, so no
# allocation grows with a hostile file's size (docs/checkpoints.md#files). A config (the
# demo's ``config.json`` is 2 KB, its ``tokenizer_config.json`` with 256 special tokens
# 22 KB) gets 4 MiB. A listing with one entry per tensor (the shard index, the checksums
# manifest, the expert pack's index: about 80 MB for K3's 92 MoE layers x 896 experts x 6
# expert tensors at ~110 bytes an entry) gets 256 MiB. The tokenizer's rank file (about
# 17 bytes a rank: ~3 MB for 163,840 ranks) gets 64 MiB. Safetensors shards are opened the
# same way (regular files only); their header is bounded by ``MAX_HEADER``.
MAX_CONFIG_BYTES = 4 << 20
MAX_LISTING_BYTES = 256 << 20
MAX_RANK_FILE_BYTES = 64 << 20
_DEPTH_CHUNK = 1 << 20  # bytes scanned at a time for JSON nesting depth
# What each kind of tensor may hold. Float weights are one 16-bit float type per checkpoint
# (F16 and BF16 bits differ, so a relabelled tensor must not pass) or F32.
FLOAT_DTYPES = ("BF16", "F16", "F32")
# Tensors of the published checkpoint that are not the text model (dropped on load).
NON_TEXT_PREFIXES = ("vision_tower", "vision_model", "multi_modal_projector", "mm_projector")
_PUBLISHED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight_(?:packed|scale)$")
_DEPTH = np.zeros(256, np.int8)
_DEPTH[[ord("["), ord("{")]], _DEPTH[[ord("]"), ord("}")]] = 1, -1
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it claims to be."""


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _check_regular(file: Path, st: os.stat_result):
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _FILE_KINDS if test(st.st_mode)), "not a plain file")
        link = f" (a link to {os.path.realpath(file)})" if os.path.islink(file) else ""
        raise CheckpointError(f"{file}: {kind}{link}, not a regular file")


def open_regular(file: str | Path, max_bytes: int | None = None) -> tuple[int, int]:
    """``(fd, size)`` of ``file`` opened read-only, or ``CheckpointError`` naming it when it
    is not a regular file (a directory, FIFO, device or socket, also through a symlink) or
    holds more than ``max_bytes``. The type is checked before opening (a device is never
    opened) and again with ``fstat`` on the descriptor, which is opened non-blocking so a
    FIFO swapped in between cannot block. ``FileNotFoundError`` and other ``OSError`` pass
    through. The caller closes ``fd``."""
    file = Path(file)
    _check_regular(file, os.stat(file))
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(file, flags)
    try:
        st = os.fstat(fd)
        _check_regular(file, st)
        if max_bytes is not None and st.st_size > max_bytes:
            raise CheckpointError(
                f"{file}: {st.st_size} bytes, more than this kind of file may hold "
                f"({max_bytes} bytes); refused before reading"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_capped(file: str | Path, max_bytes: int) -> bytes:
    """The bytes of regular file ``file`` of at most ``max_bytes`` (``open_regular``); one
    that grows past its size while it is read is refused."""
    fd, size = open_regular(file, max_bytes)
    with os.fdopen(fd, "rb") as f:
        data = f.read(size + 1)
    if len(data) > size:
        raise CheckpointError(f"{file}: grew while it was read (was {size} bytes)")
    return data


def load_json(raw: bytes | str) -> object:
    """Parse JSON (UTF-8) refusing what no checkpoint file holds: nesting deeper than
    ``MAX_JSON_DEPTH`` (so the parser's recursion limit is never reached) and repeated keys.
    Raises ``ValueError`` with the reason; callers add the file name."""
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    brackets = np.frombuffer(_JSON_STRING.sub("", text).encode(), np.uint8)
    depth = level = 0
    for i in range(0, len(brackets), _DEPTH_CHUNK):  # bounded scratch memory
        levels = np.cumsum(_DEPTH[brackets[i : i + _DEPTH_CHUNK]], dtype=np.int64) + level
        depth, level = max(depth, int(levels.max())), int(levels[-1])
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested {depth} levels deep (at most {MAX_JSON_DEPTH})")
    return json.loads(text, object_pairs_hook=_unique_keys)


def load_json_object(raw: bytes | str, where, error: type[Exception] = CheckpointError) -> dict:
    """``load_json`` of a document that must be a JSON object; else ``error`` naming
    ``where``: not valid JSON, or not an object."""
    try:
        doc = load_json(raw)
    except ValueError as e:
        raise error(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise error(f"{where}: not a JSON object (got {type(doc).__name__})")
    return doc


def _unique_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears more than once")
    return out


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
    """Parse and validate one safetensors file's header as strictly as the format: a bounded
    length, unique names, known dtypes, and data offsets that tile the data exactly (sorted,
    back to back, no overlap, ending at the end of the file)."""
    file = Path(file)
    try:
        fd, size = open_regular(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: shard file is missing") from None
    with os.fdopen(fd, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{file}: corrupted safetensors header (length {n}, file {size} bytes)"
            )
        raw = f.read(n)
    if len(raw) < n:
        raise CheckpointError(f"{file}: truncated while its header was read")
    header = load_json_object(raw, f"{file}: corrupted safetensors header")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{file}: __metadata__ must map names to strings, got {meta!r:.80}")
    base = 8 + n
    out = {name: _tensor_info(file, name, m, base, size) for name, m in header.items()}
    _check_tiling(file, sorted(out.values(), key=lambda t: (t.start, t.end)), base, size)
    return out


def _tensor_info(file, name, meta, base, size) -> TensorInfo:
    ok = isinstance(meta, dict)
    if ok:
        dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        ok = (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(x) is int and x >= 0 for x in offsets)
        )
    if not ok:
        raise CheckpointError(f"{file}: tensor {name}: malformed header entry {meta!r:.200}")
    (a, b), shape = offsets, tuple(shape)
    if dtype not in DTYPE_SIZE:
        raise CheckpointError(f"{file}: tensor {name}: unknown dtype {dtype!r}")
    want = math.prod(shape) * DTYPE_SIZE[dtype]
    if b - a != want:
        raise CheckpointError(
            f"{file}: tensor {name}: data_offsets {a}..{b} do not fit "
            f"{dtype}{list(shape)} ({want} bytes)"
        )
    if base + b > size:
        raise CheckpointError(
            f"{file}: truncated: tensor {name} ends at byte {base + b} but the file has {size}"
        )
    return TensorInfo(name, file, dtype, shape, base + a, base + b)


def _check_tiling(file: Path, tensors: list[TensorInfo], base: int, size: int):
    """The tensors' byte ranges, in offset order, must cover the data back to back."""
    pos, prev = base, None
    for t in tensors:
        if t.start < pos:
            raise CheckpointError(
                f"{file}: tensor {t.name}: data_offsets {t.start - base}..{t.end - base} "
                f"overlap tensor {prev.name} (ends at {pos - base})"
            )
        if t.start > pos:
            raise CheckpointError(
                f"{file}: tensor {t.name}: data_offsets start at {t.start - base}, leaving "
                f"bytes {pos - base}..{t.start - base} that no tensor holds"
            )
        pos, prev = t.end, t
    if pos != size:
        raise CheckpointError(
            f"{file}: the tensors end at byte {pos} but the file has {size} bytes "
            "(trailing data no tensor holds)"
        )


def tensor_role(name: str, names) -> tuple[tuple, str]:
    """``(allowed dtypes, what the tensor is)`` for tensor ``name`` of a checkpoint whose
    tensor names are ``names``: MXFP4 expert bytes are U8, MLX-quantized weights U32 (their
    scales U8 or float), everything else a float weight."""
    if _PUBLISHED_EXPERT.search(name):
        return ("U8",), "a packed MXFP4 expert tensor"
    stem, _, kind = name.rpartition(".")
    if kind == "weight" and f"{stem}.scales" in names:
        return ("U32",), "a quantized weight"
    if kind == "scales" and f"{stem}.weight" in names:
        return ("U8", *FLOAT_DTYPES), "quantization scales"
    return FLOAT_DTYPES, "a float weight"


def check_roles(tensors: dict[str, TensorInfo]):
    """Every tensor's dtype is one its role allows, and the 16-bit float weights share one
    dtype (the majority's), so a relabelled tensor is refused, naming its file."""
    halves = {}
    for name, t in tensors.items():
        if name.startswith(NON_TEXT_PREFIXES):
            continue
        allowed, what = tensor_role(name, tensors)
        if t.dtype not in allowed:
            raise CheckpointError(
                f"{t.file}: tensor {name} is {t.dtype}, but {what} is {' or '.join(allowed)}"
            )
        if t.dtype in ("BF16", "F16"):
            halves.setdefault(t.dtype, []).append(t)
    if len(halves) > 1:
        major = max(halves, key=lambda d: (len(halves[d]), d))
        t = next(t for d, ts in halves.items() if d != major for t in ts)
        raise CheckpointError(
            f"{t.file}: tensor {t.name} is {t.dtype}, but the checkpoint's other 16-bit "
            f"float weights are {major} ({len(halves[major])} tensors)"
        )


def read_index(path: Path) -> dict[str, str] | None:
    """The ``weight_map`` of ``path/model.safetensors.index.json`` (None without an index),
    checked: tensor names to plain ``*.safetensors`` file names in ``path``."""
    file = Path(path) / "model.safetensors.index.json"
    try:
        raw = read_capped(file, MAX_LISTING_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror})") from None
    try:
        doc = load_json(raw)
    except ValueError as e:
        raise CheckpointError(f"{file}: not a valid shard index ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{file}: weight_map must be a non-empty object of tensor name to shard file, "
            f"got {weight_map!r:.80}"
        )
    for name, fname in weight_map.items():
        if not _plain_shard_name(fname):
            raise CheckpointError(
                f"{file}: weight_map[{name!r}] = {fname!r:.80} is not a *.safetensors file "
                "name in the checkpoint directory"
            )
    return weight_map


def _plain_shard_name(fname) -> bool:
    return (
        isinstance(fname, str)
        and fname.endswith(".safetensors")
        and fname == os.path.basename(fname)
        and "\\" not in fname
        and not fname.startswith(".")
        and "\0" not in fname
    )


class CheckpointIndex:
    """Every tensor of a checkpoint directory: ``model.safetensors.index.json`` + shards, or a
    single ``model.safetensors``. Headers are validated on open; data is not read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        weight_map = read_index(self.path)
        if weight_map is not None:
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"{self.path}: no model.safetensors.index.json and no *.safetensors files"
                )
        self.tensors: dict[str, TensorInfo] = {}
        for fname in files:
            for name, info in read_header(self.path / fname).items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"{info.file}: tensor {name} is also in {self.tensors[name].file.name}"
                    )
                self.tensors[name] = info
        if weight_map is not None:
            self._check_index(weight_map)
        check_roles(self.tensors)

    def _check_index(self, weight_map: dict):
        for name, fname in weight_map.items():
            info = self.tensors.get(name)
            if info is None or info.file.name != fname:
                raise CheckpointError(
                    f"{self.path / fname}: tensor {name} is in the index but not in that shard"
                )
        for name, info in self.tensors.items():
            if name not in weight_map:
                raise CheckpointError(
                    f"{info.file}: tensor {name} is not in model.safetensors.index.json"
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
        fd, _ = open_regular(t.file)
        with os.fdopen(fd, "rb") as f:
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


def sha256_file(path: str | Path, progress=None) -> str:
    """The hex SHA-256 of the file at ``path``, read in 16 MB blocks; ``progress(n)``, if
    given, is called with each block's size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
            if progress is not None:
                progress(len(block))
    return h.hexdigest()
