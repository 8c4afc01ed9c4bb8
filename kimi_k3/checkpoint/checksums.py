"""Recorded checksums of a checkpoint's safetensors files, checked on every read.

The published shards carry no checksums, so they are computed once: the crc32 of every tensor
(per expert for mlx-lm's stacked ``switch_mlp`` tensors, one entry per row of dimension 0)
is kept in ``kimi_k3_checksums.json`` beside the checkpoint, or under ``kimi_k3.cache_dir()``
when the checkpoint's directory is read-only. The converter writes it for its dense shards
(the expert pack holds its own crc32 per record). Each file is recorded with its size and
mtime (none yet for the converter's, which stays byte-identical run after run). At load a
file whose size changed is refused; one whose mtime alone changed (or has none recorded) is
re-read and accepted, its mtime recorded, only if every tensor still matches. New checksums
are never taken from a changed file: deleting the manifest is how a user records anew.
docs/checkpoints.md describes the checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from kimi_k3 import cache_dir
from kimi_k3.checkpoint.files import (
    MAX_LISTING_BYTES,
    NON_TEXT_PREFIXES,
    CheckpointError,
    CheckpointIndex,
    TensorInfo,
    load_json,
    open_regular,
    read_capped,
)

NAME = "kimi_k3_checksums.json"
FORMAT, VERSION = "kimi-k3-checksums", 1
CHUNK = 64 << 20  # bytes read at once while recording


def stacked(name: str) -> bool:
    """mlx-lm's experts stacked ``[E, ...]``: one checksum per expert (row of dimension 0)."""
    return ".switch_mlp." in name


def stamp(file: Path) -> tuple[int, int]:
    st = os.stat(file)
    return st.st_size, st.st_mtime_ns


class Checksums:
    """The recorded crc32 of each tensor: ``of(info)`` -> int, or a list (stacked tensors)."""

    def __init__(self, files: dict, where: Path | None = None):
        self.files, self.where = files, where

    def of(self, t: TensorInfo):
        entry = self.files.get(t.file.name, {}).get("tensors", {}).get(t.name)
        if entry is None:
            raise CheckpointError(
                f"{t.file}: tensor {t.name} has no checksum in {self.where}; delete that "
                "file to record the checksums anew"
            )
        return entry

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "checksum": "crc32", "files": self.files}


class TensorHasher:
    """crc32 per tensor of a byte stream written in order (the converter's shards):
    ``update(data)`` as bytes arrive, after ``skip`` leading bytes (the header)."""

    def __init__(self, tensors: list[tuple[str, int]], skip: int):
        self.tensors, self.skip = tensors, skip
        self.i, self.done, self.crc, self.crcs = 0, 0, 0, {}
        self._close_full()

    def _close_full(self):
        while self.i < len(self.tensors) and self.done == self.tensors[self.i][1]:
            self.crcs[self.tensors[self.i][0]] = self.crc
            self.i, self.done, self.crc = self.i + 1, 0, 0

    def update(self, data: bytes):
        view = memoryview(data)
        cut = min(self.skip, len(view))
        view, self.skip = view[cut:], self.skip - cut
        while len(view):
            if self.i == len(self.tensors):
                raise ValueError(f"{len(view)} bytes past the last tensor")
            take = min(self.tensors[self.i][1] - self.done, len(view))
            self.crc = zlib.crc32(view[:take], self.crc)
            self.done += take
            view = view[take:]
            self._close_full()

    def result(self) -> dict[str, int]:
        if self.i != len(self.tensors):
            raise ValueError(f"tensor {self.tensors[self.i][0]} was not written whole")
        return self.crcs


def _tensor_crc(fd: int, t: TensorInfo):
    rows = t.shape[0] if stacked(t.name) and t.shape and t.shape[0] else 0
    unit = t.nbytes // rows if rows else t.nbytes
    crcs = []
    for start in range(t.start, t.end, unit) if unit else [t.start]:
        crc, pos, end = 0, start, start + unit
        while pos < end:
            data = os.pread(fd, min(CHUNK, end - pos), pos)
            if not data:
                raise CheckpointError(f"{t.file}: short read of tensor {t.name} (truncated?)")
            crc = zlib.crc32(data, crc)
            pos += len(data)
        crcs.append(crc)
    return crcs if rows else crcs[0]


def record_file(file: Path, tensors: list[TensorInfo]) -> dict:
    """``{"bytes", "mtime_ns", "tensors"}`` of one file, read once; a file that changes
    while it is read is refused."""
    before = stamp(file)
    fd, _ = open_regular(file)
    try:
        crcs = {t.name: _tensor_crc(fd, t) for t in sorted(tensors, key=lambda t: t.start)}
    finally:
        os.close(fd)
    if stamp(file) != before:
        raise CheckpointError(f"{file}: changed while its checksums were being recorded")
    return {"bytes": before[0], "mtime_ns": before[1], "tensors": crcs}


def record(index: CheckpointIndex, files: list[Path] | None = None, threads: int = 4) -> dict:
    """Checksums of ``files`` (default: all) of ``index``, by file name."""
    files = index.files if files is None else files
    by_file: dict[Path, list] = {f: [] for f in files}
    for name, t in index.tensors.items():
        if t.file in by_file and not name.startswith(NON_TEXT_PREFIXES):
            by_file[t.file].append(t)
    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        done = pool.map(lambda f: record_file(f, by_file[f]), files)
        return dict(zip((f.name for f in files), done, strict=True))


def manifest_paths(path: Path) -> list[Path]:
    """Where the manifest of checkpoint ``path`` may be: beside it, then in the cache."""
    key = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:24]
    return [Path(path) / NAME, cache_dir() / "checksums" / f"{key}.json"]


def write_manifest(file: Path, sums: Checksums):
    """Atomically (a temporary file renamed over it)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(sums.to_json(), separators=(",", ":")))
        os.replace(tmp, file)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(file: Path) -> Checksums:
    why = "wrong format or version"
    try:
        doc = load_json(read_capped(file, MAX_LISTING_BYTES))
        ok = (
            isinstance(doc, dict)
            and (doc.get("format"), doc.get("version")) == (FORMAT, VERSION)
            and isinstance(doc.get("files"), dict)
            and all(_valid_entry(e) for e in doc["files"].values())
        )
    except (OSError, ValueError) as e:
        ok, why = False, str(e)
    if not ok:
        raise CheckpointError(
            f"{file}: not a {FORMAT} version {VERSION} manifest ({why}); delete it to record "
            "the checksums anew"
        )
    return Checksums(doc["files"], file)


def _valid_entry(e) -> bool:
    def crc(v) -> bool:
        return type(v) is int or (isinstance(v, list) and all(type(x) is int for x in v))

    return (
        isinstance(e, dict)
        and type(e.get("bytes")) is int
        and (type(e.get("mtime_ns")) is int or e.get("mtime_ns") is None)
        and isinstance(e.get("tensors"), dict)
        and all(crc(v) for v in e["tensors"].values())
    )


def recorded_file(path: Path) -> Path | None:
    """The checksum file recorded for the checkpoint at ``path`` (``manifest_paths``' first
    that exists), or None where none is."""
    return next((f for f in manifest_paths(path) if f.is_file()), None)


def obtain(path: Path, index: CheckpointIndex, log=None) -> Checksums:
    """The checkpoint's recorded checksums, checked against its files as they are now; read
    and recorded on first use (announced on ``log``, default stderr)."""
    log = log or sys.stderr
    found = recorded_file(path)
    if found is None:
        total = sum(f.stat().st_size for f in index.files)
        log.write(
            f"recording checksums of {len(index.files)} files ({total / 1e9:.2f} GB), once: "
            "every later read is checked against them\n"
        )
        return _save(path, Checksums(record(index)))
    sums = read_manifest(found)
    names = sorted(f.name for f in index.files)
    if sorted(sums.files) != names:
        raise CheckpointError(
            f"{found}: records checksums of {sorted(sums.files)}, but the checkpoint's "
            f"files are {names}; delete it to record the checksums anew"
        )
    changed = [f for f in index.files if _stamp(sums, f) != stamp(f)]
    if changed:
        log.write(f"checking {len(changed)} files against the checksums in {found}\n")
    for f in changed:
        _recheck(f, index, sums)
    if changed:
        _save(path, sums)
    return sums


def _stamp(sums: Checksums, f: Path) -> tuple[int, int]:
    e = sums.files[f.name]
    return e["bytes"], e["mtime_ns"]


def _recheck(f: Path, index: CheckpointIndex, sums: Checksums):
    """A file whose mtime changed: accepted (with its new mtime) only if its bytes still
    match every recorded checksum; one whose size changed is refused outright."""
    how = f"restore it, or delete {sums.where} to record the checksums anew"
    size, recorded = f.stat().st_size, sums.files[f.name]
    if size != recorded["bytes"]:
        raise CheckpointError(
            f"{f}: {size} bytes, but {recorded['bytes']} when its checksums were recorded in "
            f"{sums.where}: the file changed; {how}"
        )
    now = record(index, [f])[f.name]
    for name, crc in now["tensors"].items():
        if recorded["tensors"].get(name) != crc:
            raise CheckpointError(
                f"{f}: tensor {name} does not match its checksum recorded in {sums.where}: "
                f"the file changed; {how}"
            )
    sums.files[f.name] = now


def _save(path: Path, sums: Checksums) -> Checksums:
    """Write beside the checkpoint, else (read-only directory) in the cache."""
    for file in manifest_paths(path):
        try:
            write_manifest(file, sums)
        except OSError:
            continue
        sums.where = file
        return sums
    sys.stderr.write(f"{path}: checksums could not be saved; they are recorded again next load\n")
    return sums


def array_crc(a, rows: bool):
    """crc32 of an MLX array's bytes (per row of dimension 0 with ``rows``), as recorded."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    data = np.asarray(a)
    if rows:
        return [zlib.crc32(np.ascontiguousarray(r)) for r in data]
    return zlib.crc32(np.ascontiguousarray(data))


def verify_arrays(arrays: dict, index: CheckpointIndex, sums: Checksums):
    """Evaluate each loaded tensor (``name -> mx.array`` as read from its shard) and check
    its bytes against the recorded crc32; ``CheckpointError`` names the file and tensor."""
    for name, a in arrays.items():
        t = index[name]
        want = sums.of(t)
        mx.eval(a)
        if array_crc(a, isinstance(want, list)) != want:
            raise CheckpointError(
                f"{t.file}: tensor {name} does not match its checksum recorded in "
                f"{sums.where}: the file is corrupted or was changed in place"
            )
