"""Read rates of a model directory's expert files: through the streamer's readers, and as
raw reads of the same byte ranges (``python -m kimi_k3.doctor --model``,
``benchmarks/bench_streaming.py``).

A plan is a list of calls, each the ``(layer, expert)`` pairs one MoE layer call makes
resident. ``streamer_read`` runs a plan the way the streamer reads: its reader threads
(``io.ReadPool``), its files (``io.FileTable``, direct I/O where the filesystem has it), its
checksums, into a layer's cache slots (``store.SlotPool``); no compute. ``raw_read`` makes
the same reads in the same order at the same queue depth as plain reads of each expert's
byte range (rounded out to 4096) into an aligned buffer per thread: no copy, no checksum,
no cache. Both count the experts' own bytes over the wall time of the run.
"""

from __future__ import annotations

import mmap
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kimi_k3.streaming.io import ALIGN, FileTable, ReadJob, ReadPool, open_file
from kimi_k3.streaming.store import SlotPool


def plan(E: int, layers: list[int], pattern: str, calls: int, k: int = 16) -> list[list]:
    """The (layer, expert) sets a read run makes resident, one list per layer call: every
    expert of a layer at once (``all``), or ``k`` random experts a call (``decode``, K3's
    per-layer decode need), ``calls`` rounds over the layers."""
    if pattern == "all":
        return [[(layer, e) for e in range(E)] for layer in layers]
    rng = np.random.default_rng(0)
    k = min(k, E)
    return [
        [(layer, int(e)) for e in rng.choice(E, k, replace=False)]
        for _ in range(calls)
        for layer in layers
    ]


def misses(calls: list[list]) -> list[list]:
    """What each call reads when a layer's slots hold exactly its last call."""
    held, out = {}, []
    for call in calls:
        layer = call[0][0]
        out.append([c for c in call if c not in held.get(layer, ())])
        held[layer] = set(call)
    return out


def aligned_buffer(n: int) -> np.ndarray:
    """``n`` page-aligned bytes (an anonymous mmap), touched so that no fault is timed."""
    buf = np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)
    buf[::ALIGN] = 0
    return buf


def raw_read(source, calls: list[list], threads: int) -> dict:
    """``calls`` (after ``misses``) as plain reads (module docstring): ``{"gb",
    "wall_gbps"}``."""
    ranges = {c: source.extents(*c) for call in calls for c in call}
    fds = {f: open_file(f, True)[0] for f in source.files}
    biggest = max(e.nbytes for ex in ranges.values() for e in ex) + 2 * ALIGN
    free = queue.SimpleQueue()  # one aligned buffer per thread
    for _ in range(threads):
        free.put(aligned_buffer(biggest))

    def read(ext):
        buf = free.get()
        start = ext.offset - ext.offset % ALIGN
        end = -(-(ext.offset + ext.nbytes) // ALIGN) * ALIGN
        os.preadv(fds[ext.file], [buf[: end - start]], start)
        free.put(buf)

    done = 0
    try:
        with ThreadPoolExecutor(threads) as ex:
            t0 = time.perf_counter()
            for call in calls:
                # in the streamer's order: by file and offset within a call
                exts = sorted(
                    (e for c in call for e in ranges[c]), key=lambda e: (str(e.file), e.offset)
                )
                for w in [ex.submit(read, e) for e in exts]:
                    w.result()
                done += sum(e.nbytes for e in exts)
            wall = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"gb": done / 1e9, "wall_gbps": done / 1e9 / wall}


def streamer_read(source, layout: dict, calls: list[list], threads: int, direct: bool) -> dict:
    """``calls`` (after ``misses``) through the streamer's readers into one layer's slots
    (module docstring): ``{"gb", "wall_gbps", "direct_io", "checked"}``; ``checked``: whether
    checksums were verified (the source has them: the expert pack, or a recorded manifest)."""
    slots = max(len(c) for c in calls)
    pool = SlotPool(layout, slots, "auto")
    files = FileTable(source.files, direct)
    readers = ReadPool(files, threads)
    dests = [pool.dest(s) for s in range(slots)]
    done, checked = 0, False
    try:
        t0 = time.perf_counter()
        for call in calls:
            jobs = [
                ReadJob(
                    layer,
                    e,
                    source.extents(layer, e),
                    dests[i],
                    source.checksum(layer, e),
                    pool.place,
                )
                for i, (layer, e) in enumerate(call)
            ]
            checked = checked or any(j.checksum is not None for j in jobs)
            readers.submit(jobs)
            for j in jobs:
                j.wait(60.0)
            done += sum(j.nbytes for j in jobs)
        wall = time.perf_counter() - t0
        direct_io = files.direct_io
    finally:
        readers.close()
    return {
        "gb": done / 1e9,
        "wall_gbps": done / 1e9 / wall,
        "direct_io": direct_io,
        "checked": checked,
    }
