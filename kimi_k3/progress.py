"""Progress of the long commands (``eval``, ``doctor``, ``train``, ``corpus fetch``) on stderr,
with the time taken and an estimate of the time left."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


def duration(seconds: float) -> str:
    """``"42 s"``, ``"3.5 min"`` or ``"2.1 h"``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """``total`` units of work (``unit``, a singular noun) done one ``update`` at a time.

    On a terminal: tqdm's bar, redrawn in place, with the rate and the time left. Elsewhere
    (a log, a pipe): a line ``DESC: 3/10 UNITs, 12 s so far, about 28 s left`` after the
    first unit (the first estimate), then at most every ``every`` seconds, and at the end.
    The estimate assumes the units left take as long as those done.
    """

    def __init__(self, total: int, desc: str, unit: str, stream=None, every: float = 30.0):
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.stream = sys.stderr if stream is None else stream
        self.done, self.shown = 0, 0  # units done, and done at the last line printed
        self.start = self.last = time.perf_counter()
        self.bar = None
        if self.stream.isatty():
            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream)

    def update(self, n: int = 1):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if self.done == n or now - self.last >= self.every:
            self._print(now)

    def to(self, done: int, total: int | None = None):
        """Advance to ``done`` units (a ``progress(done, total)`` callback)."""
        if done > self.done:
            self.update(done - self.done)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.done != self.shown:
            self._print(time.perf_counter())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def line(self, now: float) -> str:
        """The line a log gets at time ``now``: units done, time so far, time left."""
        elapsed = now - self.start
        text = f"{self.desc}: {self.done}/{self.total} {self.unit}s, {duration(elapsed)} so far"
        if 0 < self.done < self.total:
            text += f", about {duration(elapsed / self.done * (self.total - self.done))} left"
        return text

    def _print(self, now: float):
        self.last, self.shown = now, self.done
        print(self.line(now), file=self.stream, flush=True)
