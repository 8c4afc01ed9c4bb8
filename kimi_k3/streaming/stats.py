"""Streaming counters: cache hits and misses, bytes and time in reads, prediction and
read-ahead.

Counted per MoE call over distinct experts (a prefill chunk needing expert 7 for ten tokens
counts it once). A *hit* is an expert needing no demand read: resident, or already being
read ahead by the prefetcher; *overflow misses* are the misses read into the overflow area
(``StreamOptions.overflow_experts``), counted in the misses too. A *pass* is one model call
(it starts at the first MoE layer). *Pairs* are the (token, expert) choices the MoE layers
kept: k per token and layer, fewer where trimming or shedding (``kimi_k3.model.routing``)
dropped some; *shed pairs* and *shed mass* are the choices shedding dropped and their
renormalised router weight (``shed_per_token``, ``shed_mass_share``: per token and MoE layer).

Prediction (``StreamOptions.prefetch``), per MoE call it predicted: *recall* is the share of
the experts the call needed that were predicted, *precision* the share of the predicted
experts it needed. Of the experts read ahead for a call, *prefetch hits* are those it used,
*unused* ones were read in vain (``prefetch_unused_bytes``) and *cancelled* ones were
dropped before any reader took them (nothing read).
"""

from __future__ import annotations

import time
from collections import Counter

_COUNTS = (
    "hits",
    "misses",
    "overflow_misses",
    "prefetch_issued",
    "prefetch_hits",
    "prefetch_bytes",
    "prefetch_cancelled",
    "prefetch_unused",
    "prefetch_unused_bytes",
    "predicted_needed",
    "predicted_right",
    "predicted_named",
    "pairs",
    "shed_pairs",
    "shed_mass",
    "tokens",
    "passes",
)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


class StreamStats:
    """Cumulative counters plus the current pass; ``snapshot()`` is what ``get_stats`` returns."""

    def __init__(self, meter, info: dict):
        self.meter, self.info = meter, info
        self.reset()

    def reset(self):
        self.c: Counter = Counter()
        self.wait = 0.0
        self.span = 0.0
        self.io0 = self.meter.snapshot()
        self.pass_t0 = self.pass_end = None
        self.mark = self._now()

    def add(self, **counts):
        self.c.update(counts)

    def waited(self, seconds: float):
        self.wait += seconds

    def begin_pass(self, tokens: int):
        now = time.perf_counter()
        if self.pass_t0 is not None:
            self.span += self.pass_end - self.pass_t0
        self.pass_t0 = self.pass_end = now
        self.mark = self._now()
        self.add(tokens=tokens, passes=1)

    def end_call(self):
        self.pass_end = time.perf_counter()

    def _now(self) -> dict:
        nbytes, reads, busy, stages = self.meter.snapshot()
        span = self.span + (self.pass_end - self.pass_t0 if self.pass_t0 is not None else 0.0)
        return {
            **{k: self.c[k] for k in _COUNTS},
            "bytes_read": nbytes - self.io0[0],
            "reads": reads - self.io0[1],
            "read_seconds": busy - self.io0[2],
            **{f"reader_{k}_seconds": v - self.io0[3][k] for k, v in stages.items()},
            "wait_seconds": self.wait,
            "span_seconds": span,
        }

    def _derived(self, d: dict) -> dict:
        d["hit_rate"] = _ratio(d["hits"], d["hits"] + d["misses"])
        d["experts_per_token"] = _ratio(d["pairs"], d["tokens"] * self.info["layers"])
        d["shed_per_token"] = _ratio(d["shed_pairs"], d["tokens"] * self.info["layers"])
        d["shed_mass_share"] = _ratio(d["shed_mass"], d["tokens"] * self.info["layers"])
        d["read_gbps"] = _ratio(d["bytes_read"] / 1e9, d["read_seconds"])
        d["compute_seconds"] = max(d["span_seconds"] - d["wait_seconds"], 0.0)
        d["prefetch_accuracy"] = _ratio(d["prefetch_hits"], d["prefetch_issued"])
        d["prediction_recall"] = _ratio(d["predicted_right"], d["predicted_needed"])
        d["prediction_precision"] = _ratio(d["predicted_right"], d["predicted_named"])
        return d

    def snapshot(self) -> dict:
        """Cumulative counters, per-token averages and the current (last) pass.

        Times: ``read_seconds`` = wall time with any read in flight (so ``read_gbps`` is the
        drive rate achieved); ``wait_seconds`` = time the model blocked on reads;
        ``span_seconds`` = first MoE layer to last MoE layer, summed over passes;
        ``compute_seconds`` = span minus wait; ``reader_{read,verify,place}_seconds`` = the
        reader threads' time in system calls, checksums, and copying (tiling) into slots,
        summed over threads (so up to ``io_threads`` x the wall time).
        """
        now = self._now()
        out = self._derived(dict(now))
        tokens = now["tokens"]
        out["per_token"] = {
            k: _ratio(now[k], tokens)
            for k in (
                "hits",
                "misses",
                "bytes_read",
                "read_seconds",
                "wait_seconds",
                "span_seconds",
                "prefetch_bytes",
                "prefetch_unused_bytes",
            )
        }
        out["per_token"]["compute_seconds"] = _ratio(out["compute_seconds"], tokens)
        out["last_pass"] = self._derived({k: now[k] - self.mark[k] for k in now})
        out.update(self.info)
        return out
