"""The streamed expert store: a drop-in for ``ResidentExperts`` that reads experts on demand.

Per MoE call: route (the host needs the indices), find each distinct expert in the layer's
slots, read the misses in parallel into free or evicted slots, then run ``expert_glu`` on
the slot pool with slot indices. The pool is six stacked arrays per layer (the layout the
kernels read); a miss is written into its slot in place through a numpy view of the MLX
buffer, so a hit costs no copy, a miss at most one, and a slot update never copies the pool.

A call needing more experts than the layer's slots (a batch's decode step, a prefill chunk)
runs in groups of at most ``slots`` experts, one round of reads each; with an overflow area
(``StreamOptions.overflow_experts``: working memory beside the cache budget, shared by the
layers, which run one at a time) the misses the slots cannot take are read into it in the
same round and are not cached, so a batch's step reads its experts at once and runs two
groups. Either way the output has the bits of one call over resident experts.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kimi_k3.checkpoint.checksums import obtain as obtain_checksums
from kimi_k3.checkpoint.files import CheckpointIndex
from kimi_k3.kernels import expert_layout as tiles
from kimi_k3.model import routing
from kimi_k3.model.experts import (
    EXPERT_TENSORS,
    expert_format,
    expert_glu,
    expert_glu_plan,
    store_layout,
)
from kimi_k3.model.moe import moe_blocks
from kimi_k3.streaming.cache import (
    GB,
    POLICIES,
    SlotCache,
    call_groups,
    make_policy,
    overflow_split,
    slots_per_layer,
)
from kimi_k3.streaming.io import (
    PREFETCH,
    ExpertReadError,
    FileTable,
    ReadJob,
    ReadPool,
    read_buffer_bytes,
)
from kimi_k3.streaming.sources import SOURCES, expert_bytes, expert_shapes, open_source
from kimi_k3.streaming.stats import StreamStats

_MX = {np.uint32: mx.uint32, np.uint8: mx.uint8, np.float16: mx.float16}


@dataclass
class StreamOptions:
    """What ``attach_streamer(**options)`` accepts.

    policy: ``"lfu"`` (the default: frequency-aware, with ageing; ``lfu_half_life`` uses,
        default 4 x slots) or ``"lru"``; docs/streaming.md compares them with the optimum.
    prefetch: read ahead the next MoE layer's predicted experts while this one computes.
        The prediction is the next layer's router applied to this layer's state before its
        FFN, mixed and normalised as the next layer mixes and normalises its own
        (``DecoderLayer.state_hook``); the reads go out once this layer's demand reads are
        in, most confident first, and those the next layer then does not use and no reader
        has started are cancelled.
    prefetch_limit: read-aheads per layer call, at most (None: the layer's top-k).
    overlap: evaluate the latent ``z`` while this layer's misses are read.
    io_threads: reader threads (reads in flight). direct_io: ``O_DIRECT``/``F_NOCACHE``.
    read_timeout: seconds to wait for one call's reads before raising.
    overflow_experts: experts a call needing more than its layer's slots may read past them
        in one round, into an area shared by the layers and not cached (0: none; such a call
        then reads in rounds of ``slots``). Working memory beside ``expert_cache_gb``
        (``get_stats()["overflow_bytes"]``); the server sizes it for its batch
        (``overflow_for_batch``).
    source: ``"auto"``, ``"shards"``, ``"pack"`` or ``"mlx-lm"``.
    verify_checksums: check every expert read against its crc32 (the expert pack's per
        record, else the checkpoint's recorded checksums, ``kimi_k3.checkpoint.checksums``), in the
        reader thread, before the expert is used.
    write_mode: ``"auto"``, ``"view"`` (write slots through a numpy view of the MLX buffer)
        or ``"mlx"`` (``pool[slot] = array``, for backends whose buffers are not host views).
    expert_layout: how the slots hold an expert: ``"auto"``, ``"mlx"`` or ``"tiled"``
        (``kimi_k3.model.experts.store_layout``: tiles where CUDA's kernels read them), or None
        (the default) for ``KIMI_K3_EXPERT_LAYOUT``'s choice, as ``load_model`` reads it; a
        tiled slot is permuted as it lands, so a hit reads it as it is.
    """

    policy: str = "lfu"
    prefetch: bool = False
    prefetch_limit: int | None = None
    overlap: bool = False
    io_threads: int = 16
    direct_io: bool = True
    read_timeout: float = 60.0
    source: str = "auto"
    verify_checksums: bool = True
    write_mode: str = "auto"
    lfu_half_life: int | None = None
    expert_layout: str | None = None
    overflow_experts: int = 0

    def __post_init__(self):
        for key, ok in (
            ("policy", self.policy in POLICIES),
            ("source", self.source in SOURCES),
            ("write_mode", self.write_mode in ("auto", "view", "mlx")),
            ("io_threads", self.io_threads >= 1),
            ("read_timeout", self.read_timeout > 0),
            ("overflow_experts", self.overflow_experts >= 0),
            ("lfu_half_life", self.lfu_half_life is None or self.lfu_half_life >= 1),
            ("prefetch_limit", self.prefetch_limit is None or self.prefetch_limit >= 0),
            ("expert_layout", self.expert_layout is None or self.expert_layout in tiles.LAYOUTS),
        ):
            if not ok:
                raise ValueError(f"stream option {key}={getattr(self, key)!r} is not valid")


class SlotPool:
    """One layer's slots: per cache tensor an MLX array [slots, ...] the kernels read
    (``layout``, ``sources.expert_shapes``: MXFP4's weight and scales, or an affine format's
    weight, scales and biases per matrix).

    ``dest(slot)`` gives the writable bytes of one slot per tensor; in ``view`` mode they
    are the pool's own memory, in ``mlx`` mode scratch buffers that ``commit`` assigns with
    ``pool[slot] = ...`` (MLX donates the pool buffer, so that too updates in place).
    """

    def __init__(self, layout: dict, slots: int, write_mode: str, tiled: bool = False):
        self.tiled, self.slots = tiled, slots
        self.arrays = {
            n: mx.zeros((slots, *shape), dtype=_MX[dt]) for n, (shape, dt) in layout.items()
        }
        mx.eval(list(self.arrays.values()))
        self.layout, self.last_out = layout, None
        self.views = _host_views(self.arrays) if write_mode != "mlx" else None
        if self.views is None and write_mode == "view":
            raise RuntimeError(
                "write_mode='view': this MLX backend does not expose array "
                "memory to the host; use write_mode='mlx'"
            )
        kinds = [n.split(".")[1] for n in layout if n.startswith("w1.")]
        w = {w: tuple(self.arrays[f"{w}.{k}"] for k in kinds) for w in EXPERT_TENSORS}
        self.w = tiles.TiledStacks(w) if tiled else w

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def dest(self, slot: int) -> dict:
        if self.views is not None:
            return {n: v[slot] for n, v in self.views.items()}
        return {n: np.empty(v.nbytes // v.shape[0], np.uint8) for n, v in self.arrays.items()}

    def place(self, name: str, src: np.ndarray, dst: np.ndarray):
        """``ReadJob.place``: a tensor's read bytes into its slot (``dst``, from
        ``dest(slot)``), tiled on the way where the pool is tiled; ``src`` may be ``dst``
        itself (a buffered read landed there)."""
        if self.tiled:
            kind = "codes" if name.endswith(".weight") else "scales"
            tiles.tile_expert_piece(kind, dst, self.layout[name][0][0], src)
        elif not np.shares_memory(src, dst):
            np.copyto(dst, src)

    def commit(self, slot: int, dest: dict):
        if self.views is not None:
            return
        for n, (shape, dt) in self.layout.items():
            self.arrays[n][slot] = mx.array(dest[n].view(dt).reshape(shape))

    def settle(self):
        """Finish any computation still reading the pool before its bytes change."""
        if self.last_out is not None:
            mx.eval(self.last_out)
            self.last_out = None


def _host_views(arrays: dict) -> dict | None:
    """uint8 [slots, bytes] numpy views sharing each array's memory, or None if the backend
    hands out copies (checked by writing through the view and reading back with MLX)."""
    views = {}
    for n, a in arrays.items():
        try:
            v = np.asarray(memoryview(a)).view(np.uint8).reshape(a.shape[0], -1)
        except (TypeError, ValueError, RuntimeError):
            return None
        if not v.flags.writeable:
            return None
        v.flat[-1] = 1
        seen = a.reshape(-1)[-1].item()
        v.flat[-1] = 0
        if seen == 0:
            return None
        views[n] = v
    return views


class StreamedExperts(nn.Module):
    """One MoE layer's routed experts streamed from disk; called like ``ResidentExperts``.

    Holds no MLX parameters (the pool lives outside the module tree).
    """

    def __init__(self, streamer: Streamer, layer: int, slots: int, act: tuple):
        super().__init__()
        self.streamer, self.layer, self.act = streamer, layer, act
        self.pool = SlotPool(
            streamer.layout, slots, streamer.opts.write_mode, streamer.expert_layout == "tiled"
        )
        self.cache = SlotCache(
            slots,
            make_policy(
                streamer.opts.policy, streamer.num_experts, slots, streamer.opts.lfu_half_life
            ),
        )

    def __call__(self, z: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        """Shapes: z [N, Dl]; inds [N, k] int; weights [N, k]. Returns fp32 [N, Dl]."""
        return self.streamer.run(self, z, inds, weights)

    def cached(self, ids: np.ndarray) -> np.ndarray:
        """Which experts of ``ids`` (store numbers, any shape) need no demand read now:
        resident, or being read ahead (what shedding keeps, ``kimi_k3.model.routing``)."""
        self.streamer._reap(self)
        present = np.zeros(self.streamer.num_experts, bool)
        present[list(self.cache.slot_of)] = True
        return present[ids]

    def note_shed(self, pairs: int, mass: float):
        """Count the (token, choice) pairs shedding dropped and their renormalised weight."""
        self.streamer.stats.add(shed_pairs=pairs, shed_mass=mass)


class Streamer:
    """Shared by every layer's store: the source, the reader pool, options and counters."""

    def __init__(
        self,
        source,
        layout: dict,
        moes: dict,
        slots: int,
        opts: StreamOptions,
        budget_bytes: int,
        args,
        experts: range | None = None,
        decoders: dict | None = None,
    ):
        self.source, self.layout, self.opts = source, layout, opts
        Dl, I = args.routed_expert_hidden_size, args.moe_intermediate_size
        self.format = expert_format(args)
        self.expert_layout = store_layout(opts.expert_layout, Dl, I, self.format)
        # The experts streamed (one rank's range when expert parallel); stores number them
        # from 0, the source by their checkpoint numbers.
        self.held = range(args.num_experts) if experts is None else experts
        self.num_experts = len(self.held)
        self.top_k = min(args.num_experts_per_token, self.num_experts)
        self.files = FileTable(source.files, opts.direct_io)
        self.io = ReadPool(self.files, opts.io_threads)
        self.order = sorted(moes)
        self.next = dict(zip(self.order, self.order[1:], strict=False))
        self.routers = {layer: moe.gate for layer, moe in moes.items()}
        # The model owns the stores; a weak map here leaves no cycle, so a dropped model
        # frees its pools and stops its reader threads (``weakref.finalize`` below).
        self.stores = weakref.WeakValueDictionary()
        act = (args.activation_situ_beta, args.activation_situ_linear_beta)
        for layer, moe in moes.items():
            moe.experts = self.stores[layer] = StreamedExperts(self, layer, slots, act)
        # Prediction (``prefetch``): the next MoE layer's mix, norm and whether it starts a
        # block (the model's modules; none of them refers back to the streamer).
        decoders = decoders or {}
        self.ahead = {
            n: (d.mlp_res, d.post_attention_layernorm, d.starts_block)
            for n, d in decoders.items()
            if n in moes
        }
        for layer, d in decoders.items():
            on = opts.prefetch and self.next.get(layer) in self.ahead
            d.state_hook = self.note_state if on else None
        self.prefetch_limit = self.top_k if opts.prefetch_limit is None else opts.prefetch_limit
        self.plans: dict[tuple[int, int], tuple] = {}  # (layer, expert) -> _where's answer
        self.x: dict[int, tuple] = {}  # per layer, the next layer's predicted routing (lazy)
        self.predicted: dict[int, np.ndarray] = {}
        max_read = max(e.nbytes for e in source.extents(self.order[0], self.held.start))
        info = {
            "budget_bytes": budget_bytes,
            "cache_bytes": sum(s.pool.nbytes for s in self.stores.values()),
            "expert_bytes": expert_bytes(layout),
            "expert_format": str(self.format),
            "expert_layout": self.expert_layout,
            "slots_per_layer": slots,
            "layers": len(self.order),
            "source": source.kind,
            "policy": opts.policy,
            "prefetch": opts.prefetch,
            "prefetch_limit": self.prefetch_limit if opts.prefetch else None,
            "overlap": opts.overlap,
            "io_threads": opts.io_threads,
            # aligned read buffers, one per thread (direct I/O only)
            "overhead_bytes": read_buffer_bytes(opts.io_threads, max_read) if opts.direct_io else 0,
        }
        self.stats = StreamStats(self.io.meter, info)
        self.overflow: SlotPool | None = None
        self.overflow_reads: list[ReadJob] = []  # the area's reads that may still write
        self.set_overflow(opts.overflow_experts)
        weakref.finalize(self, self.io.close, 1.0)

    def set_overflow(self, experts: int):
        """Give the store an overflow area of ``experts`` experts (at most the experts
        streamed; 0 removes it); see ``StreamOptions.overflow_experts``."""
        if experts < 0:
            raise ValueError(f"overflow_experts={experts}: expected at least 0")
        experts = min(experts, self.num_experts)
        self.overflow = None
        if experts:
            tiled = self.expert_layout == "tiled"
            self.overflow = SlotPool(self.layout, experts, self.opts.write_mode, tiled)
        self.stats.info["overflow_experts"] = experts
        self.stats.info["overflow_bytes"] = self.overflow.nbytes if self.overflow else 0

    def note_state(self, decoder, snaps: list, p: mx.array):
        """``DecoderLayer.state_hook`` of a MoE layer L: the next MoE layer's routing
        predicted from L's state before its FFN (lazy, evaluated with L's own routing), as
        the next layer would route it after mixing and normalising it, without its
        attention."""
        nxt = self.next[decoder.index]
        mix, norm, starts_block = self.ahead[nxt]
        x = norm(mix(snaps + [p] if starts_block else snaps, p))
        self.x[decoder.index] = self.routers[nxt](x.reshape(-1, x.shape[-1]))

    def run(self, store: StreamedExperts, z, inds, weights) -> mx.array:
        layer = store.layer
        pred = self.x.pop(layer, None)
        mx.eval(inds if pred is None else [inds, *pred])
        ids = np.array(inds)
        if layer == self.order[0]:
            self.stats.begin_pass(ids.shape[0])
        self.stats.add(pairs=int(routing.kept(ids).sum()))
        uniq = np.unique(ids)
        self._score(layer, uniq)
        self._settle_ahead(store, uniq)
        ahead = None if pred is None else (self.next[layer], _ranked(*pred))
        if len(uniq) <= store.cache.slots:
            slots = self._fetch(store, uniq, ahead, z)
            slot_inds = mx.array(slots[np.searchsorted(uniq, ids)].astype(np.int32))
            y = expert_glu(z, store.pool.w, slot_inds, weights, *store.act)
        else:
            y = self._grouped(store, z, ids, uniq, weights, ahead)
        store.pool.last_out = y
        self.stats.end_call()
        return y

    def _fetch(self, store, experts: np.ndarray, ahead, z=None, then=None) -> np.ndarray:
        """Make ``experts`` resident (reading misses) and return their slots; ``then()``
        runs once their reads are submitted (more reads, queued behind them)."""
        slots, waits = self._request(store, experts)
        if then is not None:
            then()
        if self.opts.overlap and z is not None and waits:
            mx.async_eval(z)
        self._wait(store, waits)
        store.cache.policy.use(experts)
        if ahead is not None:  # the drive is free of this call's reads: read ahead
            self._prefetch(*ahead)
        return slots

    def _request(self, store, experts: np.ndarray) -> tuple[np.ndarray, list]:
        """Slots for ``experts``; demand reads submitted for the misses. Returns the slots
        and the ``(slot, job)`` reads to wait for (misses, and experts being read ahead)."""
        cache = store.cache
        self._reap(store)
        slots = cache.lookup(experts)
        known = slots >= 0
        waits = [(int(s), cache.jobs[s]) for s in slots[known] if s in cache.jobs]
        self.stats.add(hits=int(known.sum()), misses=int((~known).sum()))
        missing = experts[~known]
        if len(missing):
            pinned = set(slots[known].tolist())
            if cache.room(pinned) < len(missing):
                self._make_room(store, pinned, len(missing))
            store.pool.settle()
            new = cache.assign(missing, pinned)
            jobs = self._jobs(store, missing, new)
            self.io.submit(jobs)
            slots[~known] = new
            waits += list(zip(new.tolist(), jobs, strict=True))
        return slots, waits

    def _where(self, layer: int, expert: int) -> tuple:
        """``(extents, checksum)`` of an expert (by checkpoint number), worked out once: a
        batch's step reads dozens of experts, and the index lookups cost more than a read
        of a small expert from the page cache."""
        key = (layer, expert)
        if key not in self.plans:
            verify = self.opts.verify_checksums
            checksum = self.source.checksum(layer, expert) if verify else None
            self.plans[key] = (self.source.extents(layer, expert), checksum)
        return self.plans[key]

    def _job(self, layer: int, expert: int, pool: SlotPool, slot: int) -> ReadJob:
        """The read of ``expert`` (by store number) of ``layer`` into ``pool``'s ``slot``."""
        expert += self.held.start
        extents, checksum = self._where(layer, expert)
        return ReadJob(layer, expert, extents, pool.dest(slot), checksum, pool.place)

    def _jobs(self, store, experts, slots) -> list[ReadJob]:
        jobs = []
        for e, s in zip(experts.tolist(), slots.tolist(), strict=True):
            job = store.cache.jobs[s] = self._job(store.layer, e, store.pool, s)
            jobs.append(job)
        return jobs

    def _prefetch(self, layer: int, ranked: np.ndarray):
        """Read ahead MoE layer ``layer``'s predicted experts (``ranked``: most confident
        first), at most ``prefetch_limit`` reads, into slots not holding another predicted
        one."""
        store = self.stores[layer]
        cache = store.cache
        ranked = ranked[(ranked >= self.held.start) & (ranked < self.held.stop)] - self.held.start
        self.predicted[layer] = ranked
        self._reap(store)
        have = cache.lookup(ranked)
        pinned = set(have[have >= 0].tolist())
        budget = min(self.prefetch_limit, cache.room(pinned))
        missing = ranked[have < 0][:budget]
        if not len(missing):
            return
        store.pool.settle()
        new = cache.assign(missing, pinned)
        cache.policy.loaded(missing)
        cache.prefetched.update(new.tolist())
        jobs = self._jobs(store, missing, new)
        self.io.submit(jobs, PREFETCH)
        self.stats.add(prefetch_issued=len(jobs), prefetch_bytes=sum(j.nbytes for j in jobs))

    def _score(self, layer: int, needed: np.ndarray):
        """Count how the prediction for this call of ``layer`` did: recall over the experts
        it needs, precision over the experts predicted."""
        pred = self.predicted.pop(layer, None)
        if pred is not None:
            right = len(np.intersect1d(needed, pred))
            self.stats.add(
                predicted_needed=len(needed), predicted_right=right, predicted_named=len(pred)
            )

    def _settle_ahead(self, store, needed: np.ndarray):
        """The reads ahead for this call, now that it is known what it needs: each one it
        uses is a prefetch hit; one it does not use is cancelled if no reader has taken it
        (its slot freed), else counted as read in vain. Either way it is then an ordinary
        slot."""
        cache = store.cache
        if not cache.prefetched:
            return
        used = cancelled = 0
        vain = []
        for slot in sorted(cache.prefetched):
            if int(cache.expert_at[slot]) in needed:
                used += 1
            elif (job := cache.jobs.get(slot)) is not None and job.cancel():
                cache.release(slot)
                cancelled += 1
            else:
                vain.append(slot)
        cache.prefetched.clear()
        self.stats.add(
            prefetch_hits=used,
            prefetch_cancelled=cancelled,
            prefetch_unused=len(vain),
            prefetch_unused_bytes=len(vain) * self.stats.info["expert_bytes"],
        )

    def _await(self, jobs: list[ReadJob]) -> list[ExpertReadError | None]:
        """Wait for ``jobs``, all within one ``read_timeout``: each one's error, None where
        it was read (counted as time waited)."""
        t0 = time.perf_counter()
        deadline = t0 + self.opts.read_timeout
        errors = []
        for job in jobs:
            try:
                job.wait(deadline - time.perf_counter())
                errors.append(None)
            except ExpertReadError as e:
                errors.append(e)
        self.stats.waited(time.perf_counter() - t0)
        return errors

    def _wait(self, store, waits: list):
        """Wait for reads; a failed read frees its slot, a timed-out one holds it; then
        raises the first failure."""
        errors = self._await([job for _, job in waits])
        for (slot, job), error in zip(waits, errors, strict=True):
            if error is None:
                self._landed(store, slot, job)
            elif job.done.is_set():
                store.cache.release(slot)
            else:
                store.cache.hold(slot, job)
        _raise_first(errors)

    def _make_room(self, store, pinned: set, need: int):
        """Slots are held by reads ahead or by reads that timed out: let them end."""
        self._wait(store, list(store.cache.jobs.items()))
        deadline = time.perf_counter() + self.opts.read_timeout
        for job in list(store.cache.zombies.values()):
            job.done.wait(max(deadline - time.perf_counter(), 0.0))
        store.cache.reap()
        if store.cache.room(pinned) < need:
            raise ExpertReadError(
                f"layer {store.layer}: {len(store.cache.zombies)} cache slots "
                "are held by reads that never answered; the drive is stuck"
            )

    def _landed(self, store, slot: int, job):
        if store.cache.jobs.get(slot) is job:
            del store.cache.jobs[slot]
            store.pool.commit(slot, job.dest)

    def _reap(self, store):
        """Settle reads that ended on their own (reads ahead): keep good ones, drop failed."""
        cache = store.cache
        cache.reap()
        for slot, job in list(cache.jobs.items()):
            if job.done.is_set():
                if job.error is None:
                    self._landed(store, slot, job)
                else:
                    cache.release(slot)

    def _grouped(self, store, z, ids, uniq, weights, ahead) -> mx.array:
        """A chunk needing more experts than the layer has slots: with room in the overflow
        area, the experts ``cache.overflow_split`` puts in the cache as one group and the
        rest, read into the area in the same round, as another; else groups of at most
        ``slots`` experts (``cache.call_groups``: the cached ones first), each evaluated
        before the next overwrites slots. Each group runs on the kernel that one call of the
        whole chunk would take (``experts.expert_glu_plan``), with weights of one applied
        after (every kernel scales a pair's output by its weight in one multiply), and the
        pairs are added up as that call adds them: the bits of one call, as with every
        expert in the cache."""
        N, k = ids.shape
        flat = ids.reshape(-1)
        call, in_order = expert_glu_plan(z, store.pool.w, ids)
        Y = mx.zeros((N * k, z.shape[-1]), mx.float32)

        def run(group: np.ndarray, w, slots: np.ndarray) -> mx.array:
            rows = np.flatnonzero(np.isin(flat, group))
            sl = slots[np.searchsorted(group, flat[rows])].astype(np.int32)[:, None]
            ones = mx.ones(sl.shape, mx.float32)
            out = call(z[mx.array(rows // k)], w, mx.array(sl), ones, *store.act)
            return Y.at[mx.array(rows)].add(out)

        split = None
        if self.overflow is not None and self._overflow_free():
            split = overflow_split(store.cache, uniq, self.overflow.slots)
        if split is not None:
            first, over = split
            read_over = lambda: self._overflow_read(store, over)  # noqa: E731
            Y = run(first, store.pool.w, self._fetch(store, first, ahead, then=read_over))
            mx.async_eval(Y)  # the cache's group computes while the area's reads land
            self._overflow_wait()
            store.cache.policy.use(over)
            Y = run(over, self.overflow.w, np.arange(len(over)))
        else:
            for i, group in enumerate(call_groups(store.cache, uniq)):
                Y = run(group, store.pool.w, self._fetch(store, group, ahead if i == 0 else None))
                mx.eval(Y)
        parts = Y.reshape(N, k, -1) * weights.astype(mx.float32)[..., None]
        if not in_order:
            y = parts.sum(axis=1)
        else:
            y = mx.zeros((N, z.shape[-1]), mx.float32)
            for j in range(k):
                y = y + parts[:, j]
        if split is not None:
            self.overflow.last_out = y  # evaluated before the area is written again
        return y

    def _overflow_free(self) -> bool:
        """Whether no read into the overflow area is left from a call that gave up on it
        (a read that timed out may still write there)."""
        self.overflow_reads = [j for j in self.overflow_reads if not j.done.is_set()]
        return not self.overflow_reads

    def _overflow_read(self, store, experts: np.ndarray):
        """Submit reads of ``experts`` (by store number) into the overflow area's slots
        0, 1, ...; counted as misses."""
        area = self.overflow
        area.settle()
        jobs = [self._job(store.layer, e, area, slot) for slot, e in enumerate(experts.tolist())]
        self.io.submit(jobs)
        self.overflow_reads = jobs
        self.stats.add(misses=len(jobs), overflow_misses=len(jobs))

    def _overflow_wait(self):
        """Wait for the overflow area's reads and put them in place; raises the first
        failure once every read has answered or timed out."""
        jobs = self.overflow_reads
        _raise_first(self._await(jobs))
        self.overflow_reads = []
        for slot, job in enumerate(jobs):
            self.overflow.commit(slot, job.dest)

    def snapshot(self) -> dict:
        """The counters (``StreamStats.snapshot``) and whether reads bypass the page cache."""
        return {**self.stats.snapshot(), "direct_io": self.files.direct_io}

    def preload(self, layer: int, experts) -> None:
        """Make ``experts`` of MoE ``layer`` resident now (warm-up, benchmarks); counted in
        the stats like a call that needs them."""
        store = self.stores[layer]
        experts = np.unique(np.asarray(experts, np.int64))
        if len(experts) > store.cache.slots:
            raise ValueError(
                f"preload: {len(experts)} experts, layer {layer} has {store.cache.slots} slots"
            )
        self._fetch(store, experts, None)

    def clear(self):
        """Empty every layer's cache (reads in flight finish first; the overflow area holds
        nothing between calls)."""
        for store in self.stores.values():
            self._wait(store, list(store.cache.jobs.items()))
            store.cache.clear()

    def close(self):
        self.io.close()


def attach_streamer(
    model,
    path: str | Path,
    index: CheckpointIndex | None,
    expert_cache_gb: float,
    checksums=None,
    **options,
) -> Streamer:
    """Replace every MoE layer's resident experts by a streamed store reading from ``path``.

    Works before the dense weights are loaded (``kimi_k3.checkpoint.loader.load_model``
    calls it so) or on a loaded model (the resident experts are dropped).
    ``expert_cache_gb`` (1e9 bytes) is split evenly into per-layer slots, at least top-k per
    layer. ``checksums``: the checkpoint's ``kimi_k3.checkpoint.checksums.Checksums``
    (obtained here when needed and not given).
    ``options``: see ``StreamOptions``.
    """
    opts = StreamOptions(**options)
    moes = moe_blocks(model)
    if not moes:
        raise ValueError("attach_streamer: the model has no MoE layers")
    args = model.args
    layout = expert_shapes(args)
    held = next(iter(moes.values())).expert_range  # this rank's experts, or all of them
    source = open_source(Path(path), index, args, sorted(moes), opts.source, held)
    if opts.verify_checksums and source.kind != "pack":
        source.sums = checksums or obtain_checksums(Path(path), source.index)
    budget = round(expert_cache_gb * GB)
    slots = slots_per_layer(
        budget,
        expert_bytes(layout),
        len(moes),
        min(args.num_experts_per_token, len(held)),
        len(held),
    )
    old = find_streamer(model)
    if old is not None:
        old.close()
    decoders = {d.index: d for d in model.layers}
    return Streamer(source, layout, moes, slots, opts, budget, args, held, decoders)


def _ranked(inds: mx.array, weights: mx.array) -> np.ndarray:
    """A predicted routing's distinct experts, most confident first: chosen by the most
    tokens, then by the most weight (a choice trimming dropped, a copy of its token's
    first, is not counted). Shapes: inds, weights [N, k] -> [experts]."""
    ids, w = np.array(inds), np.array(weights, np.float64)
    keep = routing.kept(ids)
    experts, at = np.unique(ids[keep], return_inverse=True)
    votes = np.bincount(at, minlength=len(experts))
    mass = np.bincount(at, weights=w[keep], minlength=len(experts))
    return experts[np.lexsort((-mass, -votes))]


def _raise_first(errors: list):
    """Raise the first error of ``errors`` (None where there was none)."""
    if (error := next((e for e in errors if e is not None), None)) is not None:
        raise error


def overflow_for_batch(streamer: Streamer, rows: int) -> int:
    """The overflow area (experts) that a step of ``rows`` sequences can need: the most
    distinct experts it can choose in a layer (``rows`` x top-k, at most the experts
    streamed) less the layer's slots; 0 where the slots hold them."""
    most = min(rows * streamer.top_k, streamer.num_experts)
    return max(most - streamer.stats.info["slots_per_layer"], 0)


def find_streamer(model) -> Streamer | None:
    for moe in moe_blocks(model).values():
        if isinstance(moe.experts, StreamedExperts):
            return moe.experts.streamer
    return None
