"""The expert cache: one byte budget split into per-layer slots, and eviction policies.

Each MoE layer owns a fixed number of slots (at least its top-k, so no layer starves and a
decode step always fits); a ``SlotCache`` maps experts to slots and asks its policy which
resident experts to evict. Policies rank experts by id with numpy arrays over the layer's
experts, so choosing victims costs microseconds even with 896 experts.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx
import numpy as np

GB = 1e9  # budgets are decimal gigabytes, like drive and RAM sizes


class LRU:
    """Least recently used. Every use advances a clock; the experts of one call are stamped
    in id order, so ties never depend on hashing or argsort stability."""

    name = "lru"

    def __init__(self, num_experts: int):
        self.last = np.zeros(num_experts, np.int64)
        self.clock = 0

    def _stamp(self, experts: np.ndarray):
        n = len(experts)
        self.last[experts] = self.clock + 1 + np.arange(n)
        self.clock += n

    def use(self, experts: np.ndarray):
        """``experts`` (sorted ids) were used by one call."""
        self._stamp(experts)

    def loaded(self, experts: np.ndarray):
        """``experts`` were read ahead (prefetch): recent, but not a use."""
        self._stamp(experts)

    def victims(self, candidates: np.ndarray, m: int) -> np.ndarray:
        """The ``m`` candidates to evict first."""
        return candidates[np.argsort(self.last[candidates], kind="stable")[:m]]


class LFU(LRU):
    """Least frequently used, with ageing: each use adds 1 to the expert's count (kept while
    it is out of the cache too), every ``half_life`` uses all counts halve, so a pattern
    that fades is forgotten. Ties go to the least recently used."""

    name = "lfu"

    def __init__(self, num_experts: int, half_life: int):
        super().__init__(num_experts)
        self.freq = np.zeros(num_experts, np.float64)
        self.half_life, self.uses = half_life, 0

    def use(self, experts: np.ndarray):
        self._stamp(experts)
        self.freq[experts] += 1.0
        self.uses += len(experts)
        while self.uses >= self.half_life:
            self.freq *= 0.5
            self.uses -= self.half_life

    def victims(self, candidates: np.ndarray, m: int) -> np.ndarray:
        order = np.lexsort((self.last[candidates], self.freq[candidates]))
        return candidates[order[:m]]


POLICIES = ("lru", "lfu")


def make_policy(name: str, num_experts: int, slots: int, half_life: int | None = None):
    """The policy ``name`` for a layer of ``num_experts`` and ``slots`` slots; ``half_life``
    (LFU: uses between halvings) defaults to 4 x slots."""
    if name == "lru":
        return LRU(num_experts)
    if name == "lfu":
        if half_life is not None and half_life < 1:
            raise ValueError(f"lfu_half_life={half_life!r}: expected at least 1 use")
        return LFU(num_experts, half_life or 4 * slots)
    raise ValueError(f"policy={name!r}: expected one of {POLICIES}")


class SlotCache:
    """Which expert sits in which slot of one layer's pool.

    A slot is free, holds a resident expert, holds one being read (``jobs``), or is held by a
    read that timed out (``zombies``) until that read ends, so a late write can never land
    in a slot given to another expert.
    """

    def __init__(self, slots: int, policy):
        self.slots, self.policy = slots, policy
        self.slot_of: dict[int, int] = {}
        self.expert_at = np.full(slots, -1, np.int64)
        self.free = list(range(slots - 1, -1, -1))
        self.jobs: dict[int, object] = {}  # slot -> read in flight
        self.zombies: dict[int, object] = {}
        self.prefetched: set[int] = set()  # slots read ahead and not used yet

    def lookup(self, experts: np.ndarray) -> np.ndarray:
        """Slot of each expert, -1 where absent."""
        return np.array([self.slot_of.get(int(e), -1) for e in experts], np.int64)

    def evictable(self, pinned) -> np.ndarray:
        """Resident experts that may be evicted: not pinned and not being read."""
        busy = set(pinned) | set(self.jobs)
        return np.array([e for e, s in self.slot_of.items() if s not in busy], np.int64)

    def room(self, pinned) -> int:
        return len(self.free) + len(self.evictable(pinned))

    def assign(self, experts: np.ndarray, pinned) -> np.ndarray:
        """Give each expert a slot: free ones first, then the policy's victims."""
        need = len(experts) - len(self.free)
        if need > 0:
            cand = self.evictable(pinned)
            if len(cand) < need:  # callers check ``room`` first
                raise ValueError(
                    f"{len(experts)} experts for {len(self.free)} free and "
                    f"{len(cand)} evictable slots"
                )
            for v in self.policy.victims(cand, need):
                self.release(self.slot_of[int(v)])
        out = np.empty(len(experts), np.int64)
        for i, e in enumerate(experts):
            s = self.free.pop()
            self.slot_of[int(e)] = s
            self.expert_at[s] = e
            out[i] = s
        return out

    def release(self, slot: int):
        """Forget the slot's expert and free the slot."""
        self._unmap(slot)
        self.free.append(slot)

    def hold(self, slot: int, job):
        """The read into ``slot`` timed out: keep the slot out of use until it ends."""
        self._unmap(slot)
        self.zombies[slot] = job

    def _unmap(self, slot: int):
        e = int(self.expert_at[slot])
        if e >= 0:
            del self.slot_of[e]
        self.expert_at[slot] = -1
        self.jobs.pop(slot, None)
        self.prefetched.discard(slot)

    def reap(self):
        """Free the slots of timed-out reads that have ended."""
        for s, job in list(self.zombies.items()):
            if job.done.is_set():
                del self.zombies[s]
                self.free.append(s)

    def clear(self):
        for s in list(self.slot_of.values()):
            if s not in self.jobs:
                self.release(s)


def call_groups(cache: SlotCache, experts: np.ndarray) -> list[np.ndarray]:
    """A call's ``experts`` (sorted) in groups of at most the layer's slots, for a call
    needing more experts than slots: the ones in the cache first, on their own (they need no
    read), then the others. Keeping the cached ones apart leaves every slot but theirs free
    for the first reads, so the reads take as few rounds as the misses need:
    ``ceil(misses / slots)``, not ``ceil(experts / slots)``. The streamer and the simulator
    both group so."""
    cached = cache.lookup(experts) >= 0
    missing, size = experts[~cached], cache.slots
    groups = [experts[cached]] if cached.any() else []
    return groups + [missing[i : i + size] for i in range(0, len(missing), size)]


def overflow_split(
    cache: SlotCache, experts: np.ndarray, overflow: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """A call's ``experts`` (sorted, more than the layer's slots) split for a store with an
    overflow area of ``overflow`` experts: ``(first, over)``, ``first`` the experts in the
    cache and as many misses as the slots not holding them take (lowest ids first), read
    into the cache; ``over`` the other misses, read into the overflow area and not cached.
    None where ``over`` would not fit there (the call then runs in ``call_groups``). The
    streamer and the simulator both split so."""
    cached = cache.lookup(experts) >= 0
    room = cache.slots - int(cached.sum())
    over = experts[~cached][room:]
    if not 0 < len(over) <= overflow:
        return None
    return experts[~np.isin(experts, over)], over


def slots_per_layer(
    budget_bytes: int, expert_bytes: int, layers: int, top_k: int, num_experts: int
) -> int:
    """Slots each MoE layer gets from the budget; at least ``top_k`` or a ``ValueError``."""
    slots = min(budget_bytes // (expert_bytes * layers), num_experts)
    if slots < top_k:
        need = expert_bytes * layers * top_k
        raise ValueError(
            f"expert_cache_gb={budget_bytes / GB:.4g} holds {budget_bytes // expert_bytes} "
            f"experts of {expert_bytes / 1e6:.2f} MB; {layers} MoE layers x top-{top_k} need "
            f"at least {layers * top_k} (expert_cache_gb >= {need / GB:.4g})"
        )
    return int(slots)


def available_memory() -> int:
    """Bytes this process may still use: ``MemAvailable`` on Linux; on macOS physical memory,
    capped by Metal's recommended working set where MLX reports it."""
    if sys.platform.startswith("linux"):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        total = min(total, int(mx.device_info()["max_recommended_working_set_size"]))
    except (KeyError, AttributeError, RuntimeError):
        pass
    return total


def default_cache_gb(
    model_dense_bytes: int, reserve_gb: float = 4.0, fraction: float = 0.9
) -> float:
    """An expert-cache budget in GB (1e9 bytes) sized from the memory available now.

    ``fraction`` of what is left after the dense weights and ``reserve_gb`` (OS, activations,
    KV caches, read buffers); 0.0 when nothing is left. Call it before loading the model.
    """
    left = available_memory() - model_dense_bytes - reserve_gb * GB
    return max(left * fraction, 0.0) / GB
