"""Replay routing traces through the expert cache: the shipped policies against the optimum.

A *call* is one MoE layer invocation (a prefill chunk or a decode step) and needs the set
of distinct experts its tokens chose. ``replay`` runs one layer's calls through the real
``SlotCache`` and policy classes of ``cache.py`` with the streamer's semantics
(``store.Streamer.run``): the experts of a call are looked up together (hits and misses
per distinct expert), those already resident are pinned while the misses take free slots
and then the policy's victims, the policy is told of the use afterwards, and a call that
needs more experts than the layer's slots runs in groups of at most ``slots`` experts,
resident ones first (``cache.call_groups``), or, given an overflow area that holds the
misses the slots cannot, in one round whose extra misses are not cached
(``cache.overflow_split``). ``Belady`` is the offline optimum: it evicts the resident expert
whose next use is farthest in the future. Where every call fits in the slots (decode:
top-k <= slots) that is the optimum under the streamer's rules; a call larger than the
slots counts its hits and misses as the store does and then leaves the experts of the call
needed soonest, which the store's fixed group order cannot always reach, so there Belady
is a bound that no policy under those rules beats.

With shedding misses (``shed`` below 1, ``kimi_k3.model.routing.shed_keep``), each call's
experts are those its tokens keep given what the cache holds when the call comes, as in the
store. A trace records the router's choices; the shedding store's own choices feed its
later routing, so a trace recorded from a shedding store replays exactly, and one recorded
without shedding leaves out how the dropped experts would have changed what came after.

``record`` builds a ``RoutingTrace`` from a model run (chunked prefill, then decode steps,
like the generator); ``hit_rates`` gives the hit rate against cache size from a trace.
Hit rates are exact counts: they do not depend on timing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from kimi_k3.model.moe import moe_blocks, route_hooks
from kimi_k3.model.routing import SHED_OFF, kept, shed_keep
from kimi_k3.streaming.cache import (
    POLICIES,
    SlotCache,
    call_groups,
    make_policy,
    overflow_split,
)

PHASES = ("prefill", "decode")


@dataclass
class Run:
    """One prompt, replayed from an empty cache: per call its phase, per MoE layer per call
    the router's choice.

    Shapes: ``routing[layer][call] = (inds [N, k] int32, weights [N, k] fp32)``, N the
    call's tokens; ``phases[call]`` is ``"prefill"`` or ``"decode"``.
    """

    phases: list[str] = field(default_factory=list)
    routing: dict[int, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)

    def calls(self, layer: int) -> list[np.ndarray]:
        """The sorted distinct experts of each of ``layer``'s calls (what the store reads)."""
        return [np.unique(inds).astype(np.int64) for inds, _ in self.routing[layer]]


@dataclass
class RoutingTrace:
    """Routing of several runs of one model (``num_experts`` per layer, top-``top_k``)."""

    num_experts: int
    top_k: int
    runs: list[Run] = field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        return sorted(self.runs[0].routing) if self.runs else []

    def save(self, path) -> None:
        """One ``.npz`` file; ``RoutingTrace.load`` reads it back."""
        arrays = {"meta": np.array([self.num_experts, self.top_k, len(self.runs)])}
        for r, run in enumerate(self.runs):
            arrays[f"r{r}_phases"] = np.array(run.phases)
            for layer, calls in run.routing.items():
                sizes = np.array([len(i) for i, _ in calls])
                arrays[f"r{r}_l{layer}_sizes"] = sizes
                arrays[f"r{r}_l{layer}_inds"] = np.concatenate([i for i, _ in calls])
                arrays[f"r{r}_l{layer}_weights"] = np.concatenate([w for _, w in calls])
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path) -> RoutingTrace:
        with np.load(path) as f:
            E, k, n = (int(v) for v in f["meta"])
            trace = cls(E, k)
            for r in range(n):
                run = Run(phases=[str(p) for p in f[f"r{r}_phases"]])
                prefix = f"r{r}_l"
                for key in f.files:
                    if key.startswith(prefix) and key.endswith("_sizes"):
                        layer = int(key[len(prefix) : -len("_sizes")])
                        cut = np.cumsum(f[key])[:-1]
                        inds = np.split(f[f"{prefix}{layer}_inds"], cut)
                        weights = np.split(f[f"{prefix}{layer}_weights"], cut)
                        run.routing[layer] = list(zip(inds, weights, strict=True))
                trace.runs.append(run)
        return trace


class Belady:
    """The offline optimum: evict the resident experts whose next use is farthest away
    (never used again counts as farthest; ties go to the lower expert id).

    It knows the layer's whole call sequence; ``at(t)`` says which call runs. ``replay``
    handles a call larger than the slots itself (``_oversized_optimum``).
    """

    name = "belady"

    def __init__(self, calls: Sequence[np.ndarray], num_experts: int):
        never = len(calls)
        self.after = _next_uses(calls, never)  # per call: the next use of each of its experts
        self.next = np.full(num_experts, never, np.int64)
        for t in range(len(calls) - 1, -1, -1):
            self.next[calls[t]] = t  # first use
        self.calls = calls

    def at(self, t: int):
        self.next[self.calls[t]] = self.after[t]

    def use(self, experts: np.ndarray):
        pass

    def loaded(self, experts: np.ndarray):
        pass

    def victims(self, candidates: np.ndarray, m: int) -> np.ndarray:
        order = np.lexsort((candidates, -self.next[candidates]))
        return candidates[order[:m]]


def _next_uses(calls: Sequence[np.ndarray], never: int) -> list[np.ndarray]:
    """Per call, aligned with its experts: the index of the next call using each, or
    ``never``."""
    upcoming: dict[int, int] = {}
    out = [None] * len(calls)
    for t in range(len(calls) - 1, -1, -1):
        out[t] = np.array([upcoming.get(int(e), never) for e in calls[t]], np.int64)
        for e in calls[t]:
            upcoming[int(e)] = t
    return out


def replay(calls: Sequence[np.ndarray], slots: int, policy, overflow: int = 0) -> np.ndarray:
    """Hits and misses of each call through one layer's cache of ``slots`` experts.

    ``calls``: sorted distinct expert ids per call. ``policy``: an instance of a
    ``cache.py`` policy, or ``Belady`` built on the same calls; a policy with an ``at``
    method is told each call's index before the call (``Belady`` reads the future so).
    ``overflow``: the store's overflow area, in experts (``StreamOptions.overflow_experts``).
    Shapes: returns int64 [calls, 2] (hits, misses).
    """
    return _replay(calls, slots, policy, overflow)[:, :2].astype(np.int64)


def _replay(calls, slots: int, policy, overflow: int = 0, shed=None) -> np.ndarray:
    """``replay``; with ``shed`` = ``(routing, p)`` misses are shed at ``p``, each call's
    experts being those its tokens keep (``routing``: per call the router's ``(inds,
    weights)`` [N, k]; not with ``Belady``). Shapes: returns float64 [calls, 4]: hits, misses,
    and with ``shed`` the (token, expert) pairs kept and the renormalised weight dropped."""
    if shed is not None and isinstance(policy, Belady):
        raise ValueError("shedding depends on the cache's state: no Belady replay")
    cache = SlotCache(slots, policy)
    at = getattr(policy, "at", None)
    out = np.zeros((len(calls), 4), np.float64)
    for t, experts in enumerate(calls):
        if at is not None:
            at(t)
        if shed is not None:
            experts, out[t, 2:] = _shed(cache, *shed[0][t], shed[1])
        if len(experts) <= slots:
            out[t, :2] = _fetch(cache, experts)
        elif isinstance(policy, Belady):
            out[t, :2] = _oversized_optimum(cache, experts, policy)
        elif (split := overflow_split(cache, experts, overflow)) is not None:
            first, over = split
            out[t, :2] = _fetch(cache, first)
            out[t, 1] += len(over)
            cache.policy.use(over)
        else:
            out[t, :2] = _grouped(cache, experts)
    return out


def _shed(cache: SlotCache, inds: np.ndarray, weights: np.ndarray, p: float):
    """The experts a call keeps with misses shed at ``p`` given ``cache``, and (pairs kept,
    renormalised weight dropped)."""
    ids = inds.astype(np.int64)
    present = np.zeros(int(ids.max()) + 1, bool)
    resident = [e for e in cache.slot_of if e < len(present)]
    present[resident] = True
    keep = shed_keep(ids, weights, present[ids], p)
    real = kept(ids)
    r = np.where(real, weights.astype(np.float64), 0.0)
    r /= np.maximum(r.sum(axis=-1, keepdims=True), 1e-300)
    return np.unique(ids[keep]), (keep.sum(), r[real & ~keep].sum())


def _grouped(cache: SlotCache, experts: np.ndarray) -> np.ndarray:
    """More experts than slots: the store's groups (``cache.call_groups``), in turn."""
    out = np.zeros(2, np.int64)
    for group in call_groups(cache, experts):
        out += _fetch(cache, group)
    return out


def _oversized_optimum(cache: SlotCache, experts: np.ndarray, policy: Belady) -> np.ndarray:
    """A call needing more experts than slots, for the optimum: its resident experts hit
    and the rest miss, as in the store, and afterwards the layer holds the ``slots``
    experts of the call needed soonest. The store's fixed group order (cached first, then
    the rest by id) may not leave those, so this is a bound no policy under the store's rules
    beats, not a state the store can always reach."""
    hits = int((cache.lookup(experts) >= 0).sum())
    keep = experts[np.lexsort((experts, policy.next[experts]))[: cache.slots]]
    cache.clear()
    cache.assign(np.sort(keep), set())
    return np.array([hits, len(experts) - hits], np.int64)


def _fetch(cache: SlotCache, experts: np.ndarray) -> tuple[int, int]:
    """``Streamer._request`` and ``_fetch`` without the reads: hits stay pinned, misses take
    free slots or the policy's victims, then the policy sees the use."""
    slots = cache.lookup(experts)
    known = slots >= 0
    missing = experts[~known]
    if len(missing):
        cache.assign(missing, set(slots[known].tolist()))
    cache.policy.use(experts)
    return int(known.sum()), int(len(missing))


def new_policy(name: str, calls: Sequence[np.ndarray], num_experts: int, slots: int, **kw):
    """``"belady"`` or one of ``cache.POLICIES`` (``kw`` go to ``make_policy``)."""
    if name == "belady":
        return Belady(calls, num_experts)
    if name not in POLICIES:
        raise ValueError(f"policy={name!r}: expected 'belady' or one of {POLICIES}")
    return make_policy(name, num_experts, slots, **kw)


def counts(
    trace: RoutingTrace,
    policy: str,
    slots: int,
    overflow: int = 0,
    shed: float = SHED_OFF,
    detail: bool = False,
    **kw,
) -> dict[str, np.ndarray]:
    """Hits and misses per phase, summed over runs and layers, each run from an empty cache
    (``overflow``: the store's overflow area, in experts; ``shed``: shed misses at that
    share, below 1; ``kw`` go to ``make_policy``).

    Returns ``{"prefill": [hits, misses], "decode": [hits, misses]}`` (int64 [2] each); with
    ``detail``, float64 [4] each: also the (token, expert) pairs kept and the renormalised
    weight shedding dropped, summed.
    """
    if not trace.top_k <= slots <= trace.num_experts:
        raise ValueError(f"slots={slots}: expected {trace.top_k}..{trace.num_experts}")
    total = {p: np.zeros(4, np.float64) for p in PHASES}
    for run in trace.runs:
        phase = np.array(run.phases)
        for layer in run.routing:
            calls = run.calls(layer)
            how = (run.routing[layer], shed) if shed < SHED_OFF else None
            made = new_policy(policy, calls, trace.num_experts, slots, **kw)
            per_call = _replay(calls, slots, made, overflow, how)
            if how is None:  # every choice kept
                per_call[:, 2] = [kept(i).sum() for i, _ in run.routing[layer]]
            for p in PHASES:
                total[p] += per_call[phase == p].sum(axis=0)
    if detail:
        return total
    return {p: v[:2].astype(np.int64) for p, v in total.items()}


def hit_rates(
    trace: RoutingTrace,
    policy: str,
    slots: Sequence[int],
    phase: str = "decode",
    shed: float = SHED_OFF,
    **kw,
) -> list[tuple[float, float]]:
    """The hit rate against cache size: ``(cache fraction = slots / num_experts, hit rate)``
    at each slots-per-layer count, over ``phase``'s calls (``"prefill"`` or ``"decode"``).

    ``policy``: ``"belady"`` or a ``cache.POLICIES`` name; ``shed``: shed misses at that
    share (the hit rate over the experts kept); ``kw`` go to ``make_policy`` (e.g.
    ``half_life``). The flat-routing baseline is hit rate = cache fraction.
    """
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}: expected one of {PHASES}")
    out = []
    for s in slots:
        hits, misses = counts(trace, policy, s, shed=shed, **kw)[phase]
        out.append((s / trace.num_experts, hits / max(hits + misses, 1)))
    return out


def record(
    model,
    prompts: Sequence[Sequence[int]],
    prefill_step_size: int = 512,
    decode_tokens: int = 64,
    temp: float = 0.0,
    seed: int = 0,
) -> RoutingTrace:
    """The routing of ``model`` over ``prompts``, one ``Run`` each (a fresh KV cache).

    As the generator does: the prompt but its last token in chunks of
    ``prefill_step_size`` (prefill calls), then ``decode_tokens`` one-token calls, the first
    on the prompt's last token, each next token greedy (``temp`` 0) or sampled at ``temp``
    from a numpy generator seeded with ``seed``. The router's choice is recorded through
    each MoE block's ``route_hook`` (a hook already set still runs), so the model may be
    resident or streamed.
    """
    for name, v in (("prefill_step_size", prefill_step_size), ("decode_tokens", decode_tokens)):
        if v < 1:
            raise ValueError(f"{name}={v}: expected at least 1")
    E = model.args.num_experts
    trace = RoutingTrace(E, min(model.args.num_experts_per_token, E))
    pending: dict[int, list] = {layer: [] for layer in moe_blocks(model)}

    def hook(moe, flat):
        pending[moe.layer_index].append(moe.gate(flat))

    rng = np.random.default_rng(seed)
    with route_hooks(model, hook):
        for prompt in prompts:
            trace.runs.append(
                _record_run(
                    model, list(prompt), pending, prefill_step_size, decode_tokens, temp, rng
                )
            )
    return trace


def _record_run(model, ids, pending, step, decode_tokens, temp, rng) -> Run:
    if not ids:
        raise ValueError("record: an empty prompt")
    run = Run(routing={layer: [] for layer in pending})
    cache = model.make_cache()

    def call(tokens: list[int], phase: str) -> np.ndarray:
        logits = model(mx.array([tokens]), cache=cache)[0, -1].astype(mx.float32)
        mx.eval(logits, [p for calls in pending.values() for p in calls])
        for layer, calls in pending.items():
            if len(calls) != 1:
                raise RuntimeError(f"MoE layer {layer} ran {len(calls)} times in one call")
            inds, weights = calls.pop()
            run.routing[layer].append((np.array(inds, np.int32), np.array(weights, np.float32)))
        run.phases.append(phase)
        return np.array(logits)

    for i in range(0, len(ids) - 1, step):
        call(ids[i : min(i + step, len(ids) - 1)], "prefill")
    token = ids[-1]
    for _ in range(decode_tokens):
        token = _next_token(call([token], "decode"), temp, rng)
    return run


def _next_token(logits: np.ndarray, temp: float, rng: np.random.Generator) -> int:
    if temp <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temp
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))
