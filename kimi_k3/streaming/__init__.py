"""Routed experts streamed from the SSD into a bounded cache (the disk expert streamer).

``kimi_k3.load_model(path, expert_cache_gb=X, **options)`` calls ``attach_streamer``; each
MoE layer's experts then live in a slot pool filled on demand by parallel direct reads.
Modules: ``sources`` (where an expert's bytes are: published shards, expert pack, mlx-lm),
``io`` (reader threads, direct I/O, checked files), ``cache`` (slots, LFU/LRU, budgets),
``store`` (the expert store and ``attach_streamer``), ``stats`` (counters), ``simulate``
(routing traces replayed through the cache, against the optimum).
docs/streaming.md describes the design and the measured numbers.
"""

from __future__ import annotations

from kimi_k3.streaming.cache import default_cache_gb
from kimi_k3.streaming.io import ExpertReadError
from kimi_k3.streaming.store import StreamOptions, attach_streamer, find_streamer

__all__ = [
    "ExpertReadError",
    "StreamOptions",
    "attach_streamer",
    "clear_cache",
    "default_cache_gb",
    "get_stats",
    "reset_stats",
]


def get_stats(model) -> dict | None:
    """Streaming counters of ``model`` (see ``StreamStats.snapshot``); None if its experts
    are resident. Keys include hits, misses, hit_rate, bytes_read, read_seconds, read_gbps,
    wait_seconds, compute_seconds, prefetch_hits, prefetch_issued, prefetch_accuracy,
    prefetch_unused_bytes (read ahead in vain), prefetch_cancelled, prediction_recall,
    prediction_precision, pairs, experts_per_token (mean experts kept per token and MoE
    layer: k, fewer with ``kimi_k3.model.routing``), shed_pairs, shed_mass_share (weight
    shedding dropped per token and layer), cache_bytes, budget_bytes, tokens, per_token and
    last_pass."""
    streamer = find_streamer(model)
    return None if streamer is None else streamer.snapshot()


def reset_stats(model):
    """Zero the counters (the cache keeps its contents)."""
    streamer = find_streamer(model)
    if streamer is not None:
        streamer.stats.reset()


def clear_cache(model):
    """Empty the expert cache (the next call reads every expert it needs again)."""
    streamer = find_streamer(model)
    if streamer is not None:
        streamer.clear()
