"""The projection model of full Kimi K3 decode speed (``benchmarks/project_k3.py``,
``python -m kimi_k3.doctor --model``; docs/streaming.md "Projection for the full K3").

Decode time per token = SSD time + compute time (reads and compute in series), with the
overlapped bound ``max`` of the two beside it:

- SSD time = (1 - h) x 25.8 GB x kept / (SSD GB/s x read efficiency): the routed-expert
  bytes one token touches (92 MoE layers x 16 experts x 17,547,264 bytes) times the share
  of experts trimming keeps, of which the cache misses ``1 - h`` come from the SSD.
- Compute time = (dense trunk 30 GB + 25.8 GB x kept) / (memory GB/s x kernel
  efficiency): decode reads every weight it uses once.
- h, the hit rate at the cache fraction f = expert budget / 1.45 TB.
- Expert parallel over N machines: each caches its 1/N share of the experts, reads its
  share of the misses from its own SSD, runs the whole dense trunk, and adds 92 all-sums
  of 2 (N - 1) link hops of ``HOP_US``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kimi_k3.streaming.io import read_buffer_bytes

MOE_LAYERS, EXPERTS, TOP_K, EXPERT_BYTES = 92, 896, 16, 17_547_264
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


def hit_at(curve: list[tuple[float, float]], f: float) -> float:
    """The curve's hit rate at cache fraction ``f`` (linear between measured fractions;
    below the first, that point's hit rate scaled by ``f``; 1 once everything fits)."""
    fs, hs = np.array(curve).T
    if f >= 1.0:
        return 1.0
    if f < fs[0]:
        return float(hs[0] * f / fs[0])
    return float(np.interp(f, fs, hs))


def project(
    mac: Mac,
    n: int,
    h: float,
    kept: float,
    eff: float,
    kernel_eff: float,
    sizes: Sizes = K3,
) -> dict:
    """One configuration's decode time per token and tokens/s (module docstring), for a
    model of ``sizes`` (K3's by default)."""
    ssd_gb = (1.0 - h) * sizes.token_gb * kept / n
    ssd_s = ssd_gb / (mac.ssd_gbps * eff)
    compute_s = (sizes.dense_gb + sizes.token_gb * kept / n) / (mac.memory_gbps * kernel_eff)
    link_s = sizes.moe_layers * 2 * (n - 1) * HOP_US / 1e6
    serial = ssd_s + compute_s + link_s
    return {
        "ssd_gb": ssd_gb,
        "ssd_s": ssd_s,
        "compute_s": compute_s + link_s,
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
