"""The projection model of full Kimi K3 decode speed (``benchmarks/project_k3.py``,
``python -m kimi_k3.doctor --model``; docs/streaming.md "Projection for the full K3").

Decode time per token = SSD time + compute time (reads and compute in series), with the
overlapped bound ``max`` of the two beside it:

- SSD time = (1 - h) x 25.8 GB x kept / (SSD GB/s x read efficiency): the routed-expert
  bytes one token touches (92 MoE layers x 16 experts x 17,547,264 bytes at MXFP4's 4.25
  bits a weight; ``Sizes.at_bits`` for other formats) times the share of experts kept
  (trimming, shedding), of which the cache misses ``1 - h`` come from the SSD (h the hit
  rate over the experts kept).
- Compute time = (dense trunk 30 GB + 25.8 GB x kept) / (memory GB/s x kernel
  efficiency): decode reads every weight it uses once.
- h, the hit rate at the cache fraction f = expert budget / the experts' bytes: read off a
  curve, the published K3 measurements (``PUBLISHED_HITS``) or a replayed trace.
- Shedding misses at P (``shed_flat``): each of a token's k choices is cached with
  probability h, the weights flat (K3's router is trained for flat expert use); the
  uncached ones but the heaviest are dropped while the weight kept stays at least P.
- Prediction (``predicted``): reads ahead fill the drive while a layer computes; those the
  next layer uses (the precision) save demand reads, at most the share predicted (the
  recall) of them.
- Expert parallel over N machines: each caches its 1/N share of the experts, reads its
  share of the misses from its own SSD, runs the whole dense trunk, and adds 92 all-sums
  of 2 (N - 1) link hops of ``HOP_US`` (twice with shedding: the ranks' cached sets are
  summed too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kimi_k3.streaming.io import read_buffer_bytes

MOE_LAYERS, EXPERTS, TOP_K, EXPERT_BYTES = 92, 896, 16, 17_547_264
MXFP4_BITS = 4.25  # 4-bit codes and an 8-bit scale per 32 weights
EXPERT_WEIGHTS = 3 * 3584 * 3072  # gate, up and down of one expert: EXPERT_BYTES at 4.25 bits
EXPERTS_GB = MOE_LAYERS * EXPERTS * EXPERT_BYTES / 1e9  # 1,447
DENSE_GB = 30.0  # the dense trunk at 4 bits
RESERVE_GB = 16.0  # OS, KV cache, activations
HOP_US = 10.0  # one RDMA link hop of an all-sum
COLIBRI_KEPT = 8 / 16  # colibri's top-p trimming on K3: about 8 of 16 experts, +0.043 nats
KERNEL_EFFICIENCY = 0.63  # MXFP4 decode kernels' share of memory bandwidth (H200)


@dataclass(frozen=True)
class Sizes:
    """What a model's decode reads: MoE layers, experts a layer, top-k, bytes an expert,
    and the dense weights' GB."""

    moe_layers: int
    experts: int
    top_k: int
    expert_bytes: int
    dense_gb: float

    @property
    def token_gb(self) -> float:
        """Routed-expert GB one token touches."""
        return self.moe_layers * self.top_k * self.expert_bytes / 1e9

    @property
    def experts_gb(self) -> float:
        return self.moe_layers * self.experts * self.expert_bytes / 1e9

    def at_bits(self, bits: float) -> Sizes:
        """The same model with its experts at ``bits`` a weight (scales included), the
        expert bytes scaled from MXFP4's 4.25."""
        return replace(self, expert_bytes=round(self.expert_bytes * bits / MXFP4_BITS))


K3 = Sizes(MOE_LAYERS, EXPERTS, TOP_K, EXPERT_BYTES, DENSE_GB)


@dataclass(frozen=True)
class Mac:
    name: str
    ram_gb: float
    ssd_gbps: float
    memory_gbps: float


def expert_budget_gb(ram_gb: float) -> float:
    """The largest expert cache that leaves room for the dense trunk and ``RESERVE_GB``."""
    return ram_gb - DENSE_GB - RESERVE_GB


# Hit rates measured on real K3 decode, exact (no dropping), by the runtime named: (runtime,
# cache fraction f = cache bytes / expert bytes, hit rate, what). Sources in
# docs/streaming.md ("Projection for the full K3").
PUBLISHED_HITS = (
    ("colibri", 8 / 1447, 0.04, "8 GB cache, MXFP4 (1,447 GB of experts)"),
    ("TurboFieldfare", 8 * 2**30 / 1447e9, 8790 / 92736, "8 GiB, MXFP4, 64 tokens greedy"),
    ("TurboFieldfare", 16 * 2**30 / 1447e9, 22541 / 92736, "16 GiB, MXFP4, 64 tokens greedy"),
    ("gmlx", 31 / 799, 0.499, "29-33 GB arena, UD-Q2_K_XL (799 GB of experts)"),
    ("colibri", 96 / 1447, 0.53, "96 GB cache, MXFP4"),
)


def published_curve() -> list[tuple[float, float]]:
    """``PUBLISHED_HITS`` as a curve: sorted by cache fraction, each hit rate at least the
    one before (the runtimes' policies differ; the curve takes the best so far), and
    ``(1, 1)``: past the last measurement a larger cache catches the remaining misses in
    proportion, h = h_last + (1 - h_last) (f - f_last) / (1 - f_last)."""
    pts, best = [], 0.0
    for _, f, h, _ in sorted(PUBLISHED_HITS, key=lambda r: r[1]):
        best = max(best, h)
        pts.append((f, best))
    return pts + [(1.0, 1.0)]


def hit_at(curve: list[tuple[float, float]], f: float) -> float:
    """The curve's hit rate at cache fraction ``f`` (linear between measured fractions;
    below the first, that point's hit rate scaled by ``f``; 1 once everything fits)."""
    fs, hs = np.array(curve).T
    if f >= 1.0:
        return 1.0
    if f < fs[0]:
        return float(hs[0] * f / fs[0])
    return float(np.interp(f, fs, hs))


def shed_flat(h: float, p: float, k: int = TOP_K) -> dict:
    """Shedding misses at ``p`` on a layer of top-``k`` with flat router weights (1/k each)
    and each choice cached with probability ``h``, independently: a token may drop
    ``floor(k (1 - p))`` uncached choices, its heaviest never. Returns the expectations per
    token and layer: ``kept`` experts, ``reads`` (misses), ``dropped`` weight, and
    ``hit_rate`` over the experts kept; ``p = 1`` gives ``k``, ``(1 - h) k``, 0, ``h``."""
    most = math.floor(k * (1.0 - p) + 1e-9)
    q = 1.0 - h
    others = k - 1  # the heaviest is kept whether cached or not
    drops = sum(math.comb(others, u) * q**u * h ** (others - u) * min(u, most) for u in range(k))
    kept = k - drops
    reads = q * k - drops
    return {"kept": kept, "reads": reads, "dropped": drops / k, "hit_rate": 1.0 - reads / kept}


def predicted(ssd_s: float, compute_s: float, precision: float, recall: float) -> dict:
    """Reads ahead during compute (module docstring): the drive reads the next layer's
    predicted experts while a layer computes, at most what it reads in that time; the
    share ``precision`` of them is used (a demand read saved), at most the share ``recall``
    of the misses. Returns the seconds saved a token, and the SSD seconds read in vain."""
    useful = min(precision * compute_s, recall * ssd_s)
    ahead = useful / precision if precision > 0 else 0.0
    return {"saved_s": useful, "vain_s": ahead - useful}


def project(
    mac: Mac,
    n: int,
    h: float,
    kept: float,
    eff: float,
    kernel_eff: float,
    sizes: Sizes = K3,
    prediction: tuple[float, float] | None = None,
    shed: bool = False,
) -> dict:
    """One configuration's decode time per token and tokens/s (module docstring), for a
    model of ``sizes`` (K3's by default); ``h`` is the hit rate over the experts kept,
    ``kept`` their share of top-k. ``prediction``: ``(precision, recall)`` of reads ahead
    (``predicted``); ``shed``: shedding misses (a second all-sum a MoE layer across
    machines)."""
    ssd_gb = (1.0 - h) * sizes.token_gb * kept / n
    ssd_s = ssd_gb / (mac.ssd_gbps * eff)
    compute_s = (sizes.dense_gb + sizes.token_gb * kept / n) / (mac.memory_gbps * kernel_eff)
    link_s = sizes.moe_layers * 2 * (n - 1) * HOP_US / 1e6 * (2 if shed else 1)
    saved = vain_gb = 0.0
    if prediction is not None:
        got = predicted(ssd_s, compute_s, *prediction)
        saved, vain_gb = got["saved_s"], got["vain_s"] * mac.ssd_gbps * eff
    serial = ssd_s + compute_s + link_s - saved
    return {
        "ssd_gb": ssd_gb,
        "ssd_s": ssd_s,
        "compute_s": compute_s + link_s,
        "saved_s": saved,
        "vain_gb": vain_gb,
        "tok_s": 1.0 / serial,
        "tok_s_overlap": 1.0 / (max(ssd_s, compute_s) + link_s),
    }


def recommended_budget(ram_gb: float, io_threads: int = 16) -> int:
    """The ``--expert-cache-gb`` to give K3 on a machine of ``ram_gb``: the largest budget
    that leaves room for the dense weights and the reserve (``expert_budget_gb``), less the
    streamer's direct-I/O read buffers (one expert read per reader thread, outside the
    budget), in whole GB; 0 where nothing is left."""
    buffers = read_buffer_bytes(io_threads, EXPERT_BYTES) / 1e9
    return max(0, math.floor(expert_budget_gb(ram_gb) - buffers))
