"""Parallel expert reads: reader threads, page-aligned buffers, direct I/O, checked files.

An SSD reaches its rated bandwidth only with many reads in flight, so a pool of threads (16
to 32) keeps the queue full; ``os.preadv`` and numpy copies release the GIL. Direct I/O
(``O_DIRECT`` on Linux, ``F_NOCACHE`` on macOS) keeps the page cache from holding a second
copy of experts the streamer caches itself; it needs page-aligned buffers, offsets and
lengths, so a direct read lands in the thread's aligned buffer and is copied once into the
cache slot. A buffered read scatters straight into the slot (``preadv``).

Every failure names the file and the expert: a file that vanished, changed size or mtime,
stopped being a regular file, ended early, failed with an I/O error, held bytes that do not
match their checksum (checked in the reader thread, before the expert is used), or did not
answer within the timeout.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import queue
import stat
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np

from kimi_k3.checkpoint.files import CheckpointError

ALIGN = 4096  # direct I/O alignment: offsets, lengths and buffer addresses
DEMAND, PREFETCH, STOP = 0, 1, 2  # queue priorities


class ExpertReadError(CheckpointError):
    """Reading a routed expert failed; the message names the file and (layer, expert)."""


def open_file(path: Path, direct: bool) -> tuple[int, bool]:
    """Open ``path`` for reading; with ``direct``, past the page cache (``O_DIRECT`` on Linux,
    ``F_NOCACHE`` on macOS; buffered on a filesystem without direct I/O). Returns ``(fd,
    aligned)``: ``aligned`` when reads must use page-aligned buffers."""
    if direct and hasattr(os, "O_DIRECT") and hasattr(os, "preadv"):  # pread's buffer is unaligned
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError as e:  # a filesystem without direct I/O (tmpfs): read buffered
            if e.errno != errno.EINVAL:
                raise
    fd = os.open(path, os.O_RDONLY)
    if direct and sys.platform == "darwin":
        fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
        return fd, True
    return fd, False


class FileTable:
    """The files experts are read from, opened once and checked before every read.

    A file that vanished, is no longer a regular file, or whose size or mtime differs from
    when streaming started raises ``ExpertReadError``; once the original is back (same size
    and mtime: moved back, or copied with ``cp -p``) reads go on, reopening it if needed.
    """

    def __init__(self, files, direct: bool):
        self.direct = direct
        self.lock = threading.Lock()
        self.expected = {}
        for f in files:
            try:
                st = os.stat(f)
            except OSError as e:
                raise ExpertReadError(f"{f}: cannot stat expert file ({e.strerror})") from None
            self.expected[Path(f)] = (st.st_size, st.st_mtime_ns)
        self.fds: dict[Path, tuple[int, bool, int]] = {}  # path -> (fd, aligned, inode)
        self.retired: list[int] = []  # replaced fds, closed with the table (a read may use one)

    def fd(self, path: Path, what: str) -> tuple[int, bool]:
        """An open fd for ``path`` after checking it is the file streaming started with."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ExpertReadError(f"{path}: file vanished while streaming ({what})") from None
        except OSError as e:
            raise ExpertReadError(f"{path}: cannot stat ({e.strerror}) reading {what}") from None
        if not stat.S_ISREG(st.st_mode):
            raise ExpertReadError(f"{path}: no longer a regular file ({what})")
        size, mtime = self.expected[path]
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise ExpertReadError(
                f"{path}: changed while streaming ({what}): {st.st_size} bytes, mtime "
                f"{st.st_mtime_ns} (was {size} bytes, mtime {mtime}); restore the original "
                "file or reload the model"
            )
        with self.lock:
            entry = self.fds.get(path)
            if entry is None or entry[2] != st.st_ino:
                if entry is not None:
                    self.retired.append(entry[0])
                try:
                    entry = (*open_file(path, self.direct), st.st_ino)
                except OSError as e:
                    raise ExpertReadError(f"{path}: cannot open ({e.strerror}), {what}") from None
                self.fds[path] = entry
            return entry[0], entry[1]

    @property
    def direct_io(self) -> bool | None:
        """Whether the files opened so far use direct I/O (None before the first read)."""
        with self.lock:
            flags = {aligned for _, aligned, _ in self.fds.values()}
        return None if not flags else all(flags)

    def close(self):
        with self.lock:
            for fd in [e[0] for e in self.fds.values()] + self.retired:
                os.close(fd)
            self.fds.clear()
            self.retired.clear()


class ReadJob:
    """One expert to read into ``dest`` (tensor -> writable uint8 array); a future.

    Shapes: ``dest[name]`` 1-D uint8 with the tensor's byte count. ``checksum``: None, the
    crc32 of all the bytes in extent order (int), or one per piece (tuple). A direct read
    lands in the reader's aligned buffer, is checked there and then put into ``dest`` by
    ``place(name, src, dst)`` (default: a plain copy; the slot pool's may tile the bytes on
    the way). A buffered read lands in ``dest`` itself and is checked there; ``place`` then
    runs with ``src`` and ``dst`` the same bytes (a transform in place).
    """

    def __init__(
        self, layer: int, expert: int, extents, dest: dict, checksum: int | None, place=None
    ):
        self.layer, self.expert, self.extents, self.dest = layer, expert, extents, dest
        self.checksum, self.place = checksum, place
        self.nbytes = sum(e.nbytes for e in extents)
        self.done = threading.Event()
        self.error: ExpertReadError | None = None
        self._state = threading.Lock()
        self.started = self.cancelled = False

    def begin(self) -> bool:
        """A reader takes the job: False if it was cancelled first (nothing is read)."""
        with self._state:
            self.started = not self.cancelled
            return self.started

    def cancel(self) -> bool:
        """Drop the job if no reader has taken it yet: then nothing is ever written to its
        destination and ``done`` is set at once. False if a reader has it."""
        with self._state:
            if self.started or self.cancelled:
                return self.cancelled
            self.cancelled = True
        self.done.set()
        return True

    @property
    def what(self) -> str:
        return f"layer {self.layer} expert {self.expert}"

    def wait(self, timeout: float):
        """Block until read; raises ``ExpertReadError`` on failure or after ``timeout`` s."""
        if not self.done.wait(max(timeout, 0.0)):
            raise ExpertReadError(
                f"{self.extents[0].file}: no answer after {timeout:.1f} s "
                f"reading {self.what} (read_timeout)"
            )
        if self.error is not None:
            raise self.error


STAGES = ("read", "verify", "place")  # where a reader thread's time goes, per job


class Meter:
    """Bytes read, the wall time during which at least one read was in flight, and the
    reader threads' seconds per stage (summed over threads): ``read`` (the system calls),
    ``verify`` (checksums), ``place`` (copying, and tiling, into the slot)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active, self.t0, self.busy, self.bytes, self.reads = 0, 0.0, 0.0, 0, 0
        self.stages = dict.fromkeys(STAGES, 0.0)

    def start(self):
        with self.lock:
            if self.active == 0:
                self.t0 = time.perf_counter()
            self.active += 1

    def stop(self, nbytes: int, stages: dict):
        with self.lock:
            for k, v in stages.items():
                self.stages[k] += v
            self.active -= 1
            self.bytes += nbytes
            self.reads += 1
            if self.active == 0:
                self.busy += time.perf_counter() - self.t0

    def snapshot(self) -> tuple[int, int, float, dict]:
        """``(bytes, reads, busy seconds, seconds per stage)`` so far."""
        with self.lock:
            busy = self.busy + (time.perf_counter() - self.t0 if self.active else 0.0)
            return self.bytes, self.reads, busy, dict(self.stages)


def read_buffer_bytes(threads: int, largest_read: int) -> int:
    """What the reader threads' aligned buffers hold at most: a read of ``largest_read``
    bytes each, with a block to spare at either end (a direct read starts and ends on block
    boundaries)."""
    return threads * (largest_read + 2 * ALIGN)


class _Buffer:
    """A thread's page-aligned read buffer (anonymous mmap), grown on demand."""

    def __init__(self):
        self.map, self.array = None, None

    def get(self, n: int) -> np.ndarray:
        if self.map is None or len(self.map) < n:
            self.map = mmap.mmap(-1, n)
            self.array = np.frombuffer(self.map, dtype=np.uint8)
        return self.array[:n]


def _preadv(fd: int, views: list, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, views, offset)
    data = os.pread(fd, len(views[0]), offset)  # no preadv here: one buffer, one more copy
    views[0][: len(data)] = np.frombuffer(data, np.uint8)
    return len(data)


def _pread_into(fd: int, views: list, offset: int, need: int, aligned: bool) -> int:
    """``preadv`` until ``need`` bytes are in ``views`` or the file ends; returns the count."""
    got = 0
    while got < need:
        n = _preadv(fd, views, offset + got)
        if n == 0:
            break
        got += n
        if aligned and got % ALIGN:  # a direct read that ends inside a block hit the end
            break
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views[0] = views[0][n:]
    return got


def _short(ext, what: str, got: int) -> ExpertReadError:
    return ExpertReadError(
        f"{ext.file}: short read of {what}: needs bytes {ext.offset}.."
        f"{ext.offset + ext.nbytes}, got {got} (truncated?)"
    )


class _Check:
    """A job's checksum, fed piece by piece in extent order: one crc32 over all the bytes
    (``int``), or one per piece (``tuple``)."""

    def __init__(self, job: ReadJob):
        self.job, self.crc, self.i = job, 0, 0
        self.per_piece = isinstance(job.checksum, tuple)

    def feed(self, ext, name: str, data: np.ndarray, pos: int):
        if not self.per_piece:
            self.crc = zlib.crc32(data, self.crc)
            return
        if zlib.crc32(data) != self.job.checksum[self.i]:
            raise _mismatch(ext.file, self.job.what, f"tensor {name}, ", pos, pos + data.size)
        self.i += 1

    def done(self):
        job = self.job
        if not self.per_piece and self.crc != job.checksum:
            ext = job.extents[0]
            raise _mismatch(ext.file, job.what, "", ext.offset, ext.offset + job.nbytes)


def _mismatch(file, what: str, piece: str, a: int, b: int) -> ExpertReadError:
    return ExpertReadError(
        f"{file}: checksum mismatch for {what} ({piece}bytes {a}..{b}): the file is "
        "corrupted or was changed in place"
    )


def _read_extent(job: ReadJob, ext, fd: int, aligned: bool, buf: _Buffer) -> dict:
    """Read one extent: straight into the job's destinations (buffered), or into ``buf``
    (direct). Returns ``{piece name: its bytes}`` wherever they landed."""
    if not aligned:
        dests = [job.dest[name] for name, _ in ext.pieces]
        got = _pread_into(fd, list(dests), ext.offset, ext.nbytes, False)
        if got < ext.nbytes:
            raise _short(ext, job.what, got)
        return {name: job.dest[name] for name, _ in ext.pieces}
    start = ext.offset - ext.offset % ALIGN
    skip = ext.offset - start
    need = skip + ext.nbytes
    view = buf.get(-(-need // ALIGN) * ALIGN)
    got = _pread_into(fd, [view], start, need, True)
    if got < need:
        raise _short(ext, job.what, max(got - skip, 0))
    out, pos = {}, skip
    for name, n in ext.pieces:
        out[name] = view[pos : pos + n]
        pos += n
    return out


def _copy(name: str, src: np.ndarray, dst: np.ndarray):
    np.copyto(dst, src)


def read_job(job: ReadJob, files: FileTable, buf: _Buffer, stages: dict | None = None):
    """Read every extent of ``job``, check it and put it in place; raises
    ``ExpertReadError`` naming the file and expert. ``stages``, if given, gets the seconds
    spent per stage added (``STAGES``)."""
    stages = {} if stages is None else stages
    check = _Check(job) if job.checksum is not None else None
    for ext in job.extents:
        fd, aligned = files.fd(ext.file, job.what)
        t0 = time.perf_counter()
        try:
            pieces = _read_extent(job, ext, fd, aligned, buf)
        except OSError as e:
            raise ExpertReadError(
                f"{ext.file}: I/O error reading {job.what} (bytes "
                f"{ext.offset}..{ext.offset + ext.nbytes}): {e}"
            ) from None
        t1 = time.perf_counter()
        if check is not None:
            pos = ext.offset
            for name, data in pieces.items():
                check.feed(ext, name, data, pos)
                pos += data.size
        t2 = time.perf_counter()
        if aligned or job.place is not None:  # direct: the one copy, buffer -> cache slot
            place = job.place or _copy
            for name, data in pieces.items():
                place(name, data, job.dest[name])
        t3 = time.perf_counter()
        _add(stages, read=t1 - t0, verify=t2 - t1, place=t3 - t2)
    if check is not None:
        check.done()


def _add(stages: dict, **seconds):
    for k, v in seconds.items():
        stages[k] = stages.get(k, 0.0) + v


def _worker(jobs: queue.PriorityQueue, files: FileTable, meter: Meter):
    buf = _Buffer()
    while True:
        job = jobs.get()[2]
        if job is None:
            return
        if not job.begin():  # cancelled while queued
            continue
        meter.start()
        ok, stages = False, {}
        try:
            read_job(job, files, buf, stages)
            ok = True
        except ExpertReadError as e:
            job.error = e
        except Exception as e:  # never leave a waiter without an answer
            job.error = ExpertReadError(
                f"{job.extents[0].file}: reading {job.what} failed: {type(e).__name__}: {e}"
            )
        finally:
            meter.stop(job.nbytes if ok else 0, stages)
            job.done.set()


class ReadPool:
    """Reader threads serving ``ReadJob``s: demand reads before prefetches, and within one
    submission in file-offset order (sequential runs for the drive)."""

    def __init__(self, files: FileTable, threads: int):
        self.files = files
        self.queue: queue.PriorityQueue = queue.PriorityQueue()
        self.seq = itertools.count()
        self.meter = Meter()
        self.threads = [
            threading.Thread(
                target=_worker,
                args=(self.queue, files, self.meter),
                daemon=True,
                name=f"kimi-k3-expert-reader-{i}",
            )
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def submit(self, jobs: list[ReadJob], priority: int = DEMAND):
        for job in sorted(jobs, key=lambda j: (str(j.extents[0].file), j.extents[0].offset)):
            self.queue.put((priority, next(self.seq), job))

    def close(self, timeout: float = 5.0):
        """Stop the threads once queued reads are done (a stuck read is left behind)."""
        for _ in self.threads:
            self.queue.put((STOP, next(self.seq), None))
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        if not any(t.is_alive() for t in self.threads):
            self.files.close()
