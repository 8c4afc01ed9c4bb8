"""How the benchmarks time and report: one module, imported by every benchmark that times.

- ``median_time``: the median seconds of a callable (each call evaluates its own work);
- ``best_batch_time``: the best seconds per call of batches of independent calls;
- ``chain_slope``: the cost of one more call in a chain of dependent calls (each on the
  previous call's output, as a model's layers run), the slope of the least-squares line
  through the best total times of chains of several lengths;
- ``interleaved``: jobs timed once per round, the rounds one after another, so that a drift
  of the clocks over the run reaches every job alike;
- ``environment``, ``emit``: the line that says where a table was measured, and where the
  table goes (``kimi_k3.cli.markdown_table`` draws it).
"""

from __future__ import annotations

import datetime
import math
import platform
import re
import statistics
import time
import traceback
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np


def mlx_run(fn: Callable) -> Callable[[], None]:
    """``fn()``'s outputs evaluated and the device synchronized: one timed run."""

    def run():
        mx.eval(fn())
        mx.synchronize()

    return run


def median_time(
    run: Callable[[], object], repeats: int, warmup: int = 2, budget_s: float | None = 2.0
) -> float:
    """Median seconds of up to ``repeats`` runs of ``run()`` after ``warmup`` untimed ones;
    the runs stop early once they have taken ``budget_s`` in all (None: no budget)."""
    for _ in range(warmup):
        run()
    times: list[float] = []
    while len(times) < repeats:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        if budget_s is not None and sum(times) > budget_s:
            break
    return statistics.median(times)


def best_batch_time(fn: Callable, inputs: Sequence[tuple], repeats: int) -> float:
    """Best seconds per call over ``repeats`` batches, each batch every input set's call
    built, then evaluated at once (independent calls; Python's calls are timed too)."""
    mx.eval([fn(*a) for a in inputs[:2]])
    best = math.inf
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([fn(*a) for a in inputs])
        mx.synchronize()
        best = min(best, (time.perf_counter() - t0) / len(inputs))
    return best


def chain_link(out: mx.array, args: tuple) -> tuple:
    """The next call's inputs made to depend on this call's output: its first input (the
    latent) is the output cast to the latent's dtype."""
    return (out.astype(args[0].dtype), *args[1:])


def chain_output(fn: Callable, inputs: Sequence[tuple], length: int, link=chain_link):
    """The last output of ``length`` calls on ``inputs`` taken in turn, each call but the
    first on ``link(previous output, its inputs)`` (built, not evaluated)."""
    out = None
    for i in range(length):
        a = inputs[i % len(inputs)]
        out = fn(*(a if out is None else link(out, a)))
    return out


def chain_total(fn: Callable, inputs: Sequence[tuple], length: int, repeats: int) -> float:
    """Best seconds of ``repeats`` evaluations of a chain of ``length`` calls; the graph is
    built before the clock starts, so Python's calls are not timed."""
    mx.eval(fn(*inputs[0]))
    best = math.inf
    for _ in range(repeats):
        out = chain_output(fn, inputs, length)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line y = intercept + slope x."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(slope), float(intercept)


def chain_slope(
    fn: Callable, inputs: Sequence[tuple], lengths: Sequence[int], repeats: int
) -> tuple[float, float]:
    """(slope, intercept) in seconds of the line through the best totals of chains of each
    length: the slope is what one more call costs in a long chain (what a layer adds to a
    model's step), the intercept what one evaluation costs whatever its length."""
    if len(set(lengths)) < 2:
        raise ValueError(f"chain_slope: at least two different lengths, got {list(lengths)}")
    return fit_line(lengths, [chain_total(fn, inputs, n, repeats) for n in lengths])


def interleaved(jobs: dict[str, Callable[[], object]], rounds: int, width: int = 100):
    """Every job called once per round, the rounds one after another. Returns
    (``results[name]``: each round's return value, ``failed[name]``: the first error,
    whitespace folded to ``width`` characters); a job that fails is not called again."""
    results: dict[str, list] = {name: [] for name in jobs}
    failed: dict[str, str] = {}
    for _ in range(rounds):
        for name, job in jobs.items():
            if name in failed:
                continue
            try:
                results[name].append(job())
            except Exception as e:  # noqa: BLE001 - a job that fails is a row that says so
                traceback.print_exc()
                failed[name] = re.sub(r"\s+", " ", f"{type(e).__name__}: {e}")[:width]
    return results, failed


def environment() -> str:
    """Where and when a table was measured: MLX version, device, platform, date."""
    try:
        device = mx.device_info().get("device_name", "") or str(mx.default_device())
    except Exception:  # noqa: BLE001 - older MLX, or no device information
        device = str(mx.default_device())
    return (
        f"mlx {mx.__version__}, {device} ({mx.default_device()}), {platform.machine()} "
        f"{platform.system()}, {datetime.date.today().isoformat()}"
    )


def emit(text: str, out=None, append: bool = False) -> None:
    """Print a result and, with ``out``, write it there (after what the file holds, where
    ``append``)."""
    print(text, flush=True)
    if out:
        with open(out, "a" if append else "w") as f:
            f.write(text + ("\n" if append else ""))
