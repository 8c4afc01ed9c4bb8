"""The serving engine: many sequences decoded together, long prompts prefilled in chunks
between decode steps, conversation prefixes reused from snapshots of the caches.

One thread owns the model. Each step it prefills waiting prompts, up to
``prefill_step_size`` tokens and about ``prefill_step_seconds`` in all, the prompt with the
fewest tokens left first (so a short request is not held behind a long one, and a burst of
short prompts is prefilled in one step; chunks of one length after as many tokens go
through in one pass), and decodes one token for every sequence whose prompt is in its
cache, all in one batched forward pass (with streamed experts, the union of the batch's
experts is read once). The chunks that finish their prompts run before the decode step, the
others after it. A long prompt's chunks are bounded in time by their passes' measured
times (its passes slow as its context grows, and a request that arrives meanwhile waits for
the pass in flight), and at most ``max_long_prefills`` long prompts are prefilling at once,
so a short request finds a free slot while long prompts prefill (``_admit``). Sequences join
the batch at step boundaries and leave it when they finish or are cancelled; an idle engine
that gets a request waits a moment for the rest of its burst (``_gather``).

A prompt is prefilled into caches of its own (B = 1). Once it is in, the sequence joins the
``Batch``, whose caches hold every decoding sequence as a row and persist from step to step:
the KDA conv windows and states stacked, the MLA latents right-aligned at a common end
(shorter rows left-padded, with a mask over the padding). A step appends one token to every
row in place; nothing is copied per step but what the model writes. Joining copies the
sequence's caches in, leaving copies the other rows out. Batching is exact up to
floating-point summation order: a greedy sequence decodes the same tokens alone or in a
batch.

Sampling: the engine's shared logits processors run on the whole batch's logits; the greedy
rows without processors of their own take one argmax; a sampling row draws with its own
random key when it has a ``seed`` (``Sampling``), so a seeded sequence gives the same
tokens whatever else is in the batch.

Overlap: a decode step's picks are not waited for. The next step queues its forward pass
with them as its input (``mx.async_eval``), and only then are they read and handed out,
their events put and their ends found, while the device computes; then that step's tokens
are sampled (its logits processors see every token before). The host's work of a step
(the forward graph's Python, picking, events, snapshots) thus runs beside the device's.
A sequence's stop is seen a step late: its row was fed once more, and is dropped (its
snapshot holds its stop id, as its row does); a sequence's end by length is known before
the step and takes no row. Its tokens are the same as without overlap (``overlap=False``).
On MLX's CPU backend ``async_eval`` computes most of a graph before it returns, so the
overlap there is small; on a GPU the queued pass runs while the host works.

Failures: a forward pass that raises ends the sequences in it (a prefill pass: its group),
with a ``Failure`` of one short line (503); a sequence whose own logits processor raises
(a grammar's limit, ``GrammarError``: 400 naming the field) ends alone.

Across ranks (``kimi_k3.distributed``'s splits) every rank must run every forward pass. Rank
0's engine sends each pass to the others before it runs it (``Peers``: the kind, the
sequences and their input tokens, by all-sum), and the other ranks repeat it on a batch of
their own (``follow``), which takes the same rows in the same order; only rank 0 samples.
Prefix reuse is off there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

log = logging.getLogger("kimi_k3.serve.engine")


class QueueFull(Exception):
    """The engine's waiting queue is full; try again later."""


MESSAGE_CHARS = 300  # the longest error message a sequence ends with


@dataclass(frozen=True)
class Failure:
    """Why a sequence ended in error, as the server answers it: ``status`` 400 and the
    request's field in ``param`` when its own logits processor refused to go on (a
    grammar reached one of llguidance's limits, say), 500 when its own processor failed
    otherwise, 503 when a forward pass it was in failed (a disk error reading experts).
    ``message`` is at most ``MESSAGE_CHARS`` characters of one line and never holds
    another sequence's content."""

    message: str
    status: int = 503
    param: str | None = None

    @classmethod
    def of(cls, e: Exception, own: bool = False) -> Failure:
        """The failure an exception ends a sequence with (``own``: raised by the sequence's
        own processors)."""
        param = getattr(e, "param", None) if own else None
        status = 503 if not own else 400 if param else 500
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if not param:
            text = f"{type(e).__name__}: {text}" if text else type(e).__name__
        if len(text) > MESSAGE_CHARS:
            text = text[: MESSAGE_CHARS - 3] + "..."
        return cls(text, status, param)


@dataclass(frozen=True)
class Sampling:
    """How a sequence picks its tokens: the likeliest at ``temp`` 0; else a draw at ``temp``
    from the distribution cut by ``top_p``, ``min_p`` and ``top_k`` (mlx-lm's filters, in
    ``make_sampler``'s order). With ``seed`` the draws come from a key of the sequence's
    own (``mx.random.key(seed)``, split at every token); without, from MLX's generator."""

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def key(self) -> mx.array | None:
        """The sequence's first random key (None: MLX's generator)."""
        return None if self.greedy or self.seed is None else mx.random.key(self.seed)

    def pick(self, logprobs: mx.array, key: mx.array | None) -> mx.array:
        """Shapes: logprobs [1, V] -> [1] int."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.random.categorical(logprobs * (1.0 / self.temp), key=key)


@dataclass(eq=False)
class Sequence:
    """One request to the engine. Events arrive on ``out``: ``("token", id)`` for each
    generated token (stop tokens excluded), then one ``("done", reason)`` with reason
    ``"stop"``, ``"length"`` or ``"cancelled"``, or ``("error", Failure)``, after which
    ``ended`` is set (a reader that needs only the whole reply waits on it instead of
    waking at every token).

    ``logit_bias``: ``{token id: bias}`` added to this sequence's logits after the engine's
    shared processors, for every row of a step at once (as mlx-lm's ``logit_bias``
    processor adds it); ``processors``: mlx-lm logits processors of this sequence
    (``(tokens, logits) -> logits``), after those.

    ``logprobs`` (None: off) asks for each generated token's log-probability and the
    ``logprobs`` likeliest alternatives (0: none), appended to ``token_logprobs`` before the
    token's event is put (entry ``i`` is the ``i``-th generated token's; a stop token,
    which gets no event, has the last); ``prompt_logprobs`` (None: off) the same for every
    prompt token after the first, in ``prompt_token_logprobs`` once the prompt is in (its
    prefix is then never restored from a snapshot: every position is computed). A
    log-probability is taken from the distribution the token is drawn from before
    temperature and the ``top_p`` / ``min_p`` / ``top_k`` cuts: the model's, after the
    logits processors."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    processors: list = field(default_factory=list)
    stop_ids: frozenset = frozenset()
    logit_bias: dict[int, float] | None = None
    _bias: tuple | None = field(default=None, init=False, repr=False)  # its arrays, made once
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    cache: list | None = None  # its own caches while its prompt is prefilled
    key: int = -1  # the engine's number for it (what the other ranks know it by)
    fed: int = 0  # prompt tokens in the cache
    tokens: list[int] = field(default_factory=list)
    reused: int = 0  # prompt tokens restored from a snapshot
    rng: mx.array | None = None  # the next random key (seeded sampling)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    token_logprobs: list = field(default_factory=list)  # (logprob, [(id, logprob), ...])
    prompt_token_logprobs: list = field(default_factory=list)  # the same, prompt[1:]

    def cancel(self):
        self.cancelled.set()

    def bias_arrays(self) -> tuple[mx.array, mx.array]:
        """``logit_bias`` as ids [K] and values [K]."""
        if self._bias is None:
            self._bias = (mx.array(list(self.logit_bias)), mx.array(list(self.logit_bias.values())))
        return self._bias

    def end(self, kind: str, value):
        """The last event: ``("done", reason)`` or ``("error", Failure)``."""
        self.out.put((kind, value))
        self.ended.set()

    @property
    def prefilled(self) -> bool:
        return self.fed >= len(self.prompt) - 1


@dataclass(eq=False)
class Pending:
    """A sampled decode step whose tokens are not yet handed out: its rows, their picks
    [B] (queued to compute) and, per number of alternatives, the rows (indices into
    ``rows``) that ask for log-probabilities with their ``logprob_arrays``."""

    rows: list[Sequence]
    picks: mx.array
    logprobs: list[tuple[list[int], list[mx.array]]] = field(default_factory=list)

    def entries(self):
        """``(row, (logprob, alternatives))`` of the rows that ask for log-probabilities."""
        for idx, arrays in self.logprobs:
            yield from zip(idx, logprob_entries(arrays))


def fresh_cache(model) -> list:
    """Per-layer caches of one sequence with zero KDA state (the state of an empty prefix)."""
    args = model.args
    P, K = args.kda_heads * args.kda_head_dim, args.kda_head_dim
    dtype = activation_dtype(model)
    caches = model.make_cache()
    for c in caches:
        if isinstance(c, ArraysCache):
            c[0] = mx.zeros((1, args.conv_size - 1, 3 * P), dtype=dtype)
            c[1] = mx.zeros((1, args.kda_heads, K, K), dtype=mx.float32)
    return caches


def activation_dtype(model):
    return model.layers[0].input_layernorm.weight.dtype


# The batch.


class BatchLatents:
    """One MLA layer's cache for a batch: ``keys`` [B, 1, cap, rank] (latents) and
    ``values`` [B, 1, cap, pe] (shared key parts), every row's tokens ending at column
    ``end``, shorter rows left-padded with zeros. ``GatedMLA`` reads ``mask`` [B, 1, 1, n]
    (true on real positions of the ``n`` columns ``update_and_fetch`` returns); ``Batch``
    sets it and ``span`` (the longest row after the step) before each step."""

    STEP = 256  # columns added at a time

    def __init__(self, rank: int, pe: int, dtype):
        self.dims, self.dtype = (rank, pe), dtype
        self.keys = self.values = self.mask = None
        self.end = self.span = 0

    @property
    def offset(self) -> int:
        return self.end

    @property
    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write one token per row at column ``end``; the last ``span`` columns."""
        if self.end >= self.keys.shape[2]:
            self.keys, self.values = (self._room(a, self.end) for a in self.arrays)
        self.keys[..., self.end : self.end + 1, :] = keys.astype(self.dtype)
        self.values[..., self.end : self.end + 1, :] = values.astype(self.dtype)
        self.end += 1
        lo = self.end - self.span
        return self.keys[..., lo : self.end, :], self.values[..., lo : self.end, :]

    def _room(self, a: mx.array, used: int) -> mx.array:
        """``a``'s first ``used`` columns with room after them (zeros), up to a multiple of
        ``STEP`` above ``used``."""
        cap = (used // self.STEP + 1) * self.STEP
        zeros = mx.zeros((*a.shape[:2], cap - used, a.shape[3]), self.dtype)
        return mx.concatenate([a[..., :used, :], zeros], axis=2)

    def _padded(self, a: mx.array | None, rows: int, dim: int, n: int, end: int) -> mx.array:
        """``rows`` rows whose ``n`` columns ``a`` (None: 0) end at ``end``."""
        pad = mx.zeros((rows, 1, end - n, dim), self.dtype)
        return pad if n == 0 else mx.concatenate([pad, a[..., :n, :].astype(self.dtype)], axis=2)

    def add(self, caches: list[KVCache]):
        """Rows for the sequences' own caches (B = 1), after the rows held."""
        ns = [c.offset for c in caches]
        end = max([self.end, *ns])
        parts = [[], []]
        for j, dim in enumerate(self.dims):
            if self.keys is not None:
                held = self.arrays[j][..., : self.end, :]
                parts[j].append(self._padded(held, held.shape[0], dim, self.end, end))
            for c, n in zip(caches, ns):
                own = (c.keys, c.values)[j] if n else None
                parts[j].append(self._padded(own, 1, dim, n, end))
        self.keys, self.values = (self._room(mx.concatenate(p), end) for p in parts)
        self.end = end

    def take(self, rows: list[int], span: int):
        """Keep ``rows``, whose longest holds ``span`` tokens (columns before it go)."""
        if not rows:
            self.keys = self.values = None
            self.end = 0
            return
        idx = mx.array(rows)
        lo = self.end - span
        self.keys, self.values = (
            self._room(a[idx][..., lo : self.end, :], span) for a in self.arrays
        )
        self.end = span

    def row(self, i: int, n: int) -> tuple[mx.array | None, mx.array | None]:
        """Row ``i``'s ``n`` tokens, copied: [1, 1, n, rank], [1, 1, n, pe]."""
        if n == 0:
            return None, None
        idx = mx.array([i])
        return tuple(mx.take(a[..., self.end - n : self.end, :], idx, axis=0) for a in self.arrays)


class Batch:
    """The caches of the sequences being decoded, one row each, kept from step to step.

    ``members[i]`` owns row i (a ``Sequence`` on rank 0, its key on the other ranks) and
    ``lengths[i]`` is the tokens in it. Per layer: an ``ArraysCache`` of KDA conv windows
    [B, W-1, 3P] and states [B, H, K, K], or a ``BatchLatents``.
    """

    def __init__(self, model):
        self.model = model
        args = model.args
        self.dims = (args.kv_lora_rank, args.qk_rope_head_dim)
        self.members: list = []
        self.lengths: list[int] = []
        self.caches = self._empty()

    def _empty(self) -> list:
        dtype = activation_dtype(self.model)
        return [
            ArraysCache(2) if isinstance(c, ArraysCache) else BatchLatents(*self.dims, dtype)
            for c in self.model.make_cache()
        ]

    @property
    def state(self) -> list[mx.array]:
        """Every array the caches hold (to evaluate after a step)."""
        out = []
        for c in self.caches:
            out += [c[0], c[1]] if isinstance(c, ArraysCache) else c.arrays
        return [a for a in out if a is not None]

    def arrange(self, members: list, own_cache: Callable):
        """Rows for exactly ``members``: the rows of those held stay in their order, the
        rows of those not held are added after them, in ``members``' order, from
        ``own_cache(member)`` (its B = 1 caches, which it no longer needs)."""
        wanted = set(members)
        self.leave([m for m in self.members if m not in wanted])
        held = set(self.members)
        new = [m for m in members if m not in held]
        if new:
            self._add(new, [own_cache(m) for m in new])

    def _add(self, members: list, caches: list[list]):
        for layer, c in enumerate(self.caches):
            own = [cache[layer] for cache in caches]
            if isinstance(c, BatchLatents):
                c.add(own)
                continue
            for j in (0, 1):
                arrays = ([c[j]] if self.members else []) + [o[j] for o in own]
                c[j] = mx.concatenate(arrays)
        self.members += members
        self.lengths += [_tokens_held(cache) for cache in caches]

    def leave(self, members: list):
        """Drop the rows of ``members`` (ones not held are ignored)."""
        gone = set(members)
        keep = [i for i, m in enumerate(self.members) if m not in gone]
        if len(keep) == len(self.members):
            return
        self.members = [self.members[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        if not keep:
            self.caches = self._empty()
            return
        idx = mx.array(keep)
        for c in self.caches:
            if isinstance(c, BatchLatents):
                c.take(keep, max(self.lengths))
            else:
                c[0], c[1] = c[0][idx], c[1][idx]

    def step(self, tokens: list[int] | mx.array) -> mx.array:
        """One decode pass: ``tokens[i]`` after row i (ids, or an array not yet evaluated:
        the last step's picks). Returns logits [B, V] (unevaluated)."""
        lengths = [n + 1 for n in self.lengths]
        span = max(lengths)
        starts = mx.array([span - n for n in lengths])
        mask = (mx.arange(span)[None] >= starts[:, None])[:, None, None, :]
        for c in self.caches:
            if isinstance(c, BatchLatents):
                c.mask, c.span = mask, span
        inputs = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
        logits = self.model(inputs[:, None], cache=self.caches)[:, -1]
        self.lengths = lengths
        return logits

    def snapshot(self, member) -> list:
        """``member``'s row as a snapshot (``restore`` reads it), copied out of the batch."""
        i = self.members.index(member)
        idx = mx.array([i])
        out = []
        for c in self.caches:
            if isinstance(c, BatchLatents):
                out.append(("mla", *c.row(i, self.lengths[i])))
            else:
                out.append(("kda", mx.take(c[0], idx, axis=0), mx.take(c[1], idx, axis=0)))
        return out


def _tokens_held(cache: list) -> int:
    """Tokens in a sequence's own caches (its MLA latents; 0 where this rank has none)."""
    return next((c.offset for c in cache if isinstance(c, KVCache)), 0)


# Snapshots and prefix reuse.


def restore(model, snap: list) -> list:
    """A sequence's own caches holding what the snapshot ``snap`` holds."""
    caches = model.make_cache()
    for c, (kind, a, b) in zip(caches, snap):
        if kind == "kda":
            c[0], c[1] = a, b
        elif a is not None:
            c.keys, c.values, c.offset = a, b, a.shape[2]
    return caches


def snapshot_bytes(snap: list) -> int:
    return sum(a.nbytes for _, *arrays in snap for a in arrays if a is not None)


class PrefixCache:
    """Snapshots keyed by the tokens they hold, least recently used evicted past
    ``max_bytes``. ``longest(prompt)`` finds the longest key that is a proper prefix."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple, tuple[list, int]] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def put(self, tokens: list[int], snap: list):
        key, size = tuple(tokens), snapshot_bytes(snap)
        if size > self.max_bytes:
            return
        with self.lock:
            if key in self.entries:
                self.bytes -= self.entries.pop(key)[1]
            self.entries[key] = (snap, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                self.bytes -= self.entries.popitem(last=False)[1][1]

    def longest(self, prompt: list[int]) -> tuple[int, list | None]:
        """``(n, snapshot)`` of the longest key equal to ``prompt[:n]``, ``n < len(prompt)``."""
        best = None
        with self.lock:
            for key in self.entries:
                n = len(key)
                if n < len(prompt) and (best is None or n > len(best)) and tuple(prompt[:n]) == key:
                    best = key
            if best is None:
                return 0, None
            self.entries.move_to_end(best)
            return len(best), self.entries[best][0]


# Across ranks.

PREFILL, DECODE, DROP, STOP = 1, 2, 3, 4


class Peers:
    """Rank 0's forward passes sent to every rank of ``group``: a header ``[kind, sequences,
    tokens]``, then the sequences' keys and the input tokens, each as an all-sum to which
    only rank 0 adds (every rank takes part in each collective, in the same order)."""

    def __init__(self, group):
        self.group = group
        self.root = group.rank() == 0

    def _share(self, values: list[int], n: int) -> list[int]:
        a = mx.array(values if self.root else [0] * n, dtype=mx.int32)
        return mx.distributed.all_sum(a, group=self.group, stream=mx.cpu).tolist()

    def send(self, kind: int, keys: list[int] = (), tokens: list[int] = ()):
        self._share([kind, len(keys), len(tokens)], 3)
        if keys or tokens:
            self._share([*keys, *tokens], len(keys) + len(tokens))

    def receive(self) -> tuple[int, list[int], list[int]]:
        kind, nk, nt = self._share([], 3)
        body = self._share([], nk + nt) if nk + nt else []
        return kind, body[:nk], body[nk:]


def prefill(model, caches: list[list], chunks: list[list[int]]):
    """Feed ``chunks[i]`` to the sequence whose own caches (B = 1) are ``caches[i]``, all
    in one pass: the chunks are of one length and the caches hold as many tokens each.
    Returns the logits, [B, T, V] (evaluated only if the caller evaluates them).
    Shapes: chunks [B][T]."""
    if len(caches) == 1:
        logits = model(mx.array(chunks), cache=caches[0])
        mx.eval([c.state for c in caches[0]])
        return logits
    stacked = [_stacked(layer) for layer in zip(*caches)]
    logits = model(mx.array(chunks), cache=stacked)
    for i, cache in enumerate(caches):
        idx = mx.array([i])
        for own, c in zip(cache, stacked):
            rows = [mx.take(a, idx, axis=0) for a in _contents(c)]
            if isinstance(c, ArraysCache):
                own[0], own[1] = rows
            else:
                own.keys, own.values = rows
                own.offset = c.offset
    mx.eval([c.state for cache in caches for c in cache])
    return logits


def logprob_arrays(logprobs: mx.array, chosen: mx.array, top: int) -> list[mx.array]:
    """Each row's chosen token's log-probability [N] and, with ``top``, its ``top``
    likeliest tokens and their log-probabilities [N, top], likeliest first (unevaluated).
    Shapes: logprobs [N, V] (normalised); chosen [N] int."""
    picked = mx.take_along_axis(logprobs, chosen[:, None], axis=-1)[:, 0]
    if top == 0:
        return [picked]
    ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
    vals = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return [picked, mx.take_along_axis(ids, order, -1), mx.take_along_axis(vals, order, -1)]


def logprob_entries(arrays: list[mx.array]) -> list[tuple]:
    """``logprob_arrays``' result as ``[(logprob, [(id, logprob), ...]), ...]``."""
    picked = arrays[0].tolist()
    if len(arrays) == 1:
        return [(lp, []) for lp in picked]
    ids, vals = arrays[1].tolist(), arrays[2].tolist()
    return [(lp, list(zip(i, v))) for lp, i, v in zip(picked, ids, vals)]


def token_logprobs(logprobs: mx.array, chosen: mx.array, top: int) -> list[tuple]:
    """Each row's chosen token's log-probability and its ``top`` likeliest tokens:
    ``[(logprob, [(id, logprob), ...]), ...]``, the alternatives likeliest first.
    Shapes: logprobs [N, V] (normalised); chosen [N] int."""
    arrays = logprob_arrays(logprobs, chosen, top)
    mx.eval(arrays)
    return logprob_entries(arrays)


def _contents(c) -> list[mx.array]:
    """A cache's arrays: KDA conv window and state, or the MLA latents in use."""
    if isinstance(c, ArraysCache):
        return [c[0], c[1]]
    return [] if c.keys is None else [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]


def _stacked(layer: tuple):
    """One layer's caches of several sequences (as many tokens each) side by side."""
    arrays = [mx.concatenate(parts) for parts in zip(*map(_contents, layer))]
    if isinstance(layer[0], ArraysCache):
        out = ArraysCache(2)
        out[0], out[1] = arrays
        return out
    out = KVCache()
    if arrays:
        out.keys, out.values = arrays
        out.offset = layer[0].offset
    return out


def follow(model, group):
    """A rank other than 0: repeat rank 0's forward passes until it stops."""
    peers, caches, batch = Peers(group), {}, Batch(model)
    while True:
        kind, keys, tokens = peers.receive()
        if kind == STOP:
            return
        if kind == DROP:
            for k in keys:
                caches.pop(k, None)
            batch.leave(keys)
        elif kind == PREFILL:
            held = [caches.setdefault(k, fresh_cache(model)) for k in keys]
            n = len(tokens) // len(keys)
            prefill(model, held, [tokens[i * n : (i + 1) * n] for i in range(len(keys))])
        else:
            batch.arrange(keys, lambda k: caches.pop(k, None) or fresh_cache(model))
            mx.eval(batch.step(tokens), batch.state)


# The engine.


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities over the last axis."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _greedy(logits: mx.array) -> mx.array:
    """Each row's likeliest token, as ``Sampling.pick`` takes it (on the log-probabilities):
    [B, V] -> [B] int."""
    return mx.argmax(log_softmax(logits), axis=-1)


def _biased(rows: list[Sequence], logits: mx.array) -> mx.array:
    """``logits`` [B, V] with each row's ``logit_bias`` added, all rows in one scatter."""
    biased = [(i, s.bias_arrays()) for i, s in enumerate(rows) if s.logit_bias]
    if not biased:
        return logits
    where = mx.concatenate([mx.full(ids.shape, i, dtype=mx.int32) for i, (ids, _) in biased])
    ids = mx.concatenate([ids for _, (ids, _) in biased])
    values = mx.concatenate([values for _, (_, values) in biased])
    return logits.at[where, ids].add(values)


class Engine:
    """Runs sequences on ``model`` in a thread of its own; see the module docstring.

    ``max_batch`` sequences are decoded together; up to ``max_waiting`` more wait (then
    ``submit`` raises ``QueueFull``); ``prefill_step_size`` prompt tokens per step, in
    chunks of one prompt each; ``reuse_bytes`` bounds the prefix snapshots (0 turns reuse
    off); ``processors``: logits processors applied to every sequence's logits, before its
    own, on the whole batch at once (they get ``None`` for the tokens and must not need
    them). With ``start`` the loop runs in a thread of its own; otherwise the caller runs
    ``run()`` (the server runs it in the main thread: MLX's compiled functions used from
    another thread abort the process at exit). ``prefill_step_seconds`` bounds a step's
    prompt chunks by their passes' measured times (at least ``MIN_CHUNK`` tokens; None:
    no bound);
    ``max_long_prefills`` long prompts prefill at once (``_admit``; default half the
    batch); ``overlap`` runs the host's work of a step beside the next step's forward pass
    (``_decode``). An engine with nothing to do that gets a request waits until none more
    has come for ``gather_seconds``, ``gather_max`` at most, so that a burst of requests
    is prefilled in one pass and decoded together from its first step.
    """

    MIN_CHUNK = 16

    def __init__(
        self,
        model,
        max_batch: int = 8,
        max_waiting: int = 32,
        prefill_step_size: int = 512,
        reuse_bytes: int = 1 << 30,
        start: bool = True,
        group=None,
        processors: list | None = None,
        prefill_step_seconds: float | None = 0.5,
        clock: Callable[[], float] = time.perf_counter,
        max_long_prefills: int | None = None,
        overlap: bool = True,
        gather_seconds: float = 0.002,
        gather_max: float = 0.02,
    ):
        self.model = model
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.max_long_prefills = max_long_prefills or max(1, max_batch // 2)
        self.pass_times: dict[int, float] = {}  # chunk size -> a sequence's last pass, s
        self.prefill_step_size = prefill_step_size
        self.prefill_step_seconds, self.clock = prefill_step_seconds, clock
        self.processors = list(processors or [])
        self.peers = Peers(group) if group is not None and group.size() > 1 else None
        # the host's work of a step beside the next step's forward pass (the other ranks
        # need each step's input ids before it runs: not across ranks)
        self.pipelined = overlap and self.peers is None
        self.pending: Pending | None = None
        self.gather_seconds, self.gather_max = gather_seconds, gather_max
        self.prefixes = PrefixCache(0 if self.peers else reuse_bytes)
        self.batch = Batch(model)
        self.keys = 0
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = None
        if start:
            self.thread = threading.Thread(target=self.run, name="kimi-k3-engine", daemon=True)
            self.thread.start()

    def submit(self, seq: Sequence):
        with self.cond:
            if len(self.waiting) + len(self.active) >= self.max_batch + self.max_waiting:
                raise QueueFull(
                    f"{len(self.active)} sequences running, {len(self.waiting)} waiting"
                )
            self.waiting.append(seq)
            self.cond.notify()

    def load(self) -> tuple[int, int]:
        """``(running, waiting)`` sequences."""
        with self.cond:
            return len(self.active), len(self.waiting)

    def stop(self):
        with self.cond:
            self.stopped = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def release_peers(self):
        """Let the other ranks' ``follow`` return (call once the engine has stopped)."""
        if self.peers:
            self.peers.send(STOP)

    def _leave(self, seqs: list[Sequence]):
        """Take ``seqs`` out of the batch (and out of the other ranks' batches)."""
        if not seqs:
            return
        if self.peers:
            self.peers.send(DROP, [s.key for s in seqs])
        self.batch.leave(seqs)
        self.active = [s for s in self.active if s not in seqs]

    def run(self):
        """Steps until ``stop()``."""
        while True:
            with self.cond:
                while not self.stopped and not self.waiting and not self.active:
                    self.cond.wait()
                if self.stopped:
                    return
                if not self.active:
                    self._gather()
                self._admit()
            try:
                self.step()
            except Exception as e:  # a failed decode step ends its sequences; the engine lives on
                self._fail(list(self.active), e)

    def _gather(self):
        """With the lock held and a request waiting on an idle engine: wait for the rest of
        its burst, until none has come for ``gather_seconds`` (``gather_max`` in all) or
        the batch is full."""
        deadline = time.monotonic() + self.gather_max
        while not self.stopped and len(self.waiting) < self.max_batch:
            left = min(self.gather_seconds, deadline - time.monotonic())
            seen = len(self.waiting)
            if left <= 0 or not self.cond.wait(left) or len(self.waiting) == seen:
                return

    def _fail(self, seqs: list[Sequence], e: Exception):
        """End ``seqs``, whose forward pass raised ``e`` (logged, with its traceback)."""
        log.exception("generation step failed for %d sequences", len(seqs))
        failure = Failure.of(e)
        if self.pending and any(s in seqs for s in self.pending.rows):
            self.pending = None
        self._leave(seqs)
        for s in seqs:
            s.cache = None
            if not s.ended.is_set():  # one its step handed out may have ended already
                s.end("error", failure)

    def _long(self, s: Sequence, fed: int | None = None) -> bool:
        """``s`` has more than ``prefill_step_size`` prompt tokens left to prefill."""
        return len(s.prompt) - 1 - (s.fed if fed is None else fed) > self.prefill_step_size

    def _admit(self):
        """Waiting sequences into free slots, in their order, except that a long prompt
        (``_long``) waits, keeping its place, while ``max_long_prefills`` long prompts are
        prefilling: the sequences behind it go first, so a short request finds a slot
        while long prompts prefill."""
        prefilling = sum(not s.prefilled and self._long(s) for s in self.active)
        held = []
        while self.waiting and len(self.active) < self.max_batch:
            s = self.waiting.popleft()
            if s.cancelled.is_set():
                s.end("done", "cancelled")
                continue
            reused, snap = (
                self.prefixes.longest(s.prompt) if s.prompt_logprobs is None else (0, None)
            )
            if self._long(s, reused):
                if prefilling >= self.max_long_prefills:
                    held.append(s)
                    continue
                prefilling += 1
            s.key, self.keys = self.keys, self.keys + 1
            try:
                s.cache = fresh_cache(self.model) if snap is None else restore(self.model, snap)
                s.rng = s.sampling.key()
            except Exception as e:  # its own start: it alone ends
                log.exception("a sequence could not start")
                s.end("error", Failure.of(e))
                continue
            s.fed = s.reused = reused
            self.active.append(s)
        self.waiting.extendleft(reversed(held))

    def step(self):
        """Prompt chunks (``_prefill_plan``) and one decode step: the chunks that finish
        their prompts first (so a short prompt's first token comes in the step that
        prefills it), then the decode step, then the other chunks."""
        cancelled = [s for s in self.active if s.cancelled.is_set()]
        self._leave(cancelled)
        for s in cancelled:
            s.end("done", "cancelled")
        plan = self._prefill_plan()
        finishing = [(g, n) for g, n in plan if all(s.fed + n >= len(s.prompt) - 1 for s in g)]
        self._prefill_all(finishing)
        ready = [s for s in self.active if s.prefilled]
        if ready or self.pending:
            self._decode(ready)
        self._prefill_all([p for p in plan if p not in finishing])

    def _prefill_all(self, plan: list[tuple[list[Sequence], int]]):
        for group, n in plan:
            try:
                self._prefill(group, n)
            except Exception as e:  # the group's pass: it alone ends
                self._fail(group, e)

    def _prefill_plan(self) -> list[tuple[list[Sequence], int]]:
        """This step's prompt chunks, ``prefill_step_size`` tokens and about
        ``prefill_step_seconds`` in all, the prompts with the fewest tokens left first:
        ``(sequences, n)``, the sequences that feed ``n`` tokens after as many tokens fed
        (one pass for them all). A prompt whose rest fits in one pass, in tokens and in the
        time left (``_pass_time``), takes it whole; a longer one takes a chunk of the size
        whose pass fits the time left (``_chunk_size``), and waits if none does (after the
        step's first chunk), so several long prompts share a step's time rather than each
        taking its own. Joining a pass another prompt at the same point takes costs no
        time (a burst of short prompts is prefilled in one pass). A prompt that the token
        budget would cut waits for the next step when another at the same point got its
        whole chunk (so the two go in one pass there, not in two uneven ones)."""
        budget, seconds, groups = self.prefill_step_size, self.prefill_step_seconds, {}
        waiting = [s for s in self.active if not s.prefilled]
        for s in sorted(waiting, key=lambda s: len(s.prompt) - s.fed):
            left = len(s.prompt) - 1 - s.fed
            if seconds is None:
                n = min(left, self.prefill_step_size)
            elif (s.fed, left) in groups or (
                left <= self.prefill_step_size and self._pass_time(left) <= seconds
            ):
                n = left
            else:
                n = min(left, self._chunk_size(seconds, first=not groups))
            if not n or budget <= 0 or (budget < n and (s.fed, n) in groups):
                continue
            n = min(n, budget)
            if seconds is not None and (s.fed, n) not in groups:
                seconds -= self._pass_time(n)
            groups.setdefault((s.fed, n), []).append(s)
            budget -= n
        return [(group, n) for (_, n), group in groups.items()]

    @property
    def chunk_sizes(self) -> list[int]:
        """The chunk sizes a long prompt is fed in: ``MIN_CHUNK`` doubled up to
        ``prefill_step_size``."""
        sizes, n = [], self.MIN_CHUNK
        while n < self.prefill_step_size:
            sizes.append(n)
            n *= 2
        return [*sizes, self.prefill_step_size]

    def _chunk_size(self, seconds: float | None, first: bool) -> int:
        """The size of a long prompt's chunk with ``seconds`` left in the step (None: no
        bound, ``prefill_step_size``): of the sizes whose last passes fit, the one that fed
        the most tokens a second; before that, sizes are tried from the smallest up while
        the one below fits and this one's time, scaled from it, would too (a pass's time
        need not grow in proportion to its tokens: on MLX's CPU backend a 16-token pass
        can cost a fifth of a 17-token one). 0 where none fits, unless ``first`` (the
        step's first chunk: ``MIN_CHUNK``)."""
        if seconds is None:
            return self.prefill_step_size
        times, below = self.pass_times, None
        for size in self.chunk_sizes:  # a size not yet tried, where the ones below fit
            if size not in times:
                guess = 0.0 if below is None else times[below] * size / below
                if guess <= seconds:
                    return size
                break
            if times[size] > seconds:
                break
            below = size
        fit = [n for n in self.chunk_sizes if n in times and times[n] <= seconds]
        if fit:
            return max(fit, key=lambda n: (n / max(times[n], 1e-9), n))
        return self.MIN_CHUNK if first else 0

    def _pass_time(self, n: int) -> float:
        """Seconds a pass of ``n`` tokens is expected to take (a sequence's share): the
        last time of the nearest size tried, scaled to ``n`` (0 before any)."""
        times = self.pass_times
        if not times:
            return 0.0
        near = min(times, key=lambda size: abs(size - n))
        return times[near] * n / near

    def _prefill(self, group: list[Sequence], n: int):
        chunks = [s.prompt[s.fed : s.fed + n] for s in group]
        if self.peers:
            self.peers.send(PREFILL, [s.key for s in group], [t for c in chunks for t in c])
        start = self.clock()
        logits = prefill(self.model, [s.cache for s in group], chunks)
        if n in self.chunk_sizes:  # a sequence's share of the pass
            self.pass_times[n] = (self.clock() - start) / len(group)
        for i, s in enumerate(group):
            if s.prompt_logprobs is not None:  # position j predicts prompt[fed + j + 1]
                lp = log_softmax(logits[i].astype(mx.float32))
                nxt = mx.array(s.prompt[s.fed + 1 : s.fed + n + 1])
                s.prompt_token_logprobs += token_logprobs(lp, nxt, s.prompt_logprobs)
        for s in group:
            s.fed += n

    def _decode(self, ready: list[Sequence]):
        """One decode step for ``ready``, overlapped with the host's work of the last
        (module docstring: Overlap): the rows whose last step's pick ends them by length
        leave (snapshotted first), the forward pass is queued with the last step's picks
        as input, the last step's tokens are handed out while it runs, then this step's
        tokens are sampled and queued; they are handed out in the next step (at once
        without ``pipelined``)."""
        pending, self.pending = self.pending, None
        last = [
            s
            for s in (pending.rows if pending else [])
            if not s.ended.is_set() and len(s.tokens) + 1 >= s.max_tokens
        ]
        for s in last:
            if s.tokens:  # its row holds the prompt and every token but the pending one
                self._keep(s)
        self._leave(last)
        rows = [s for s in ready if s not in last]
        logits = None
        if rows:
            self.batch.arrange(rows, self._own_cache)
            rows = list(self.batch.members)
            fresh = [s for s in rows if not s.tokens and (not pending or s not in pending.rows)]
            logits = self.batch.step(self._inputs(rows, pending))
            for s in fresh:  # its row now holds exactly the prompt
                self._keep(s)
            mx.async_eval(logits, self.batch.state)
        if pending:
            self._hand_out(pending)
        if logits is None:
            return
        live = [i for i, s in enumerate(rows) if not s.ended.is_set()]
        if len(live) < len(rows):
            logits = logits[mx.array(live)] if live else None
        if logits is not None:
            self.pending = self._sample([rows[i] for i in live], logits)
            if not self.pipelined and self.pending:
                pending, self.pending = self.pending, None
                self._hand_out(pending)

    def _inputs(self, rows: list[Sequence], pending: Pending | None) -> list[int] | mx.array:
        """Each row's input token: its pick of the last step (``pending``'s, still being
        computed), else the last of its prompt or of its tokens."""
        at = {s: i for i, s in enumerate(pending.rows)} if pending else {}
        if not any(s in at for s in rows):
            tokens = [s.tokens[-1] if s.tokens else s.prompt[-1] for s in rows]
            if self.peers:
                self.peers.send(DECODE, [s.key for s in rows], tokens)
            return tokens
        held = [at[s] for s in rows if s in at]  # the batch keeps held rows first, in order
        picks = pending.picks
        if held != list(range(len(pending.rows))):
            picks = picks[mx.array(held)]
        new = [s.prompt[-1] for s in rows[len(held) :]]
        return mx.concatenate([picks, mx.array(new, dtype=picks.dtype)]) if new else picks

    def _hand_out(self, p: Pending):
        """A sampled step's tokens (and log-probabilities) to their sequences, and the ends
        they bring: a sequence still in the batch is snapshotted (its row holds the tokens
        it was fed) and leaves."""
        tokens = p.picks.tolist()
        for i, entry in p.entries():
            p.rows[i].token_logprobs.append(entry)
        ends = []
        for s, t in zip(p.rows, tokens):
            if s.ended.is_set():  # cancelled since it was sampled
                continue
            if reason := self._emit(s, t):
                ends.append((s, reason))
        held = set(self.batch.members)
        for s, _ in ends:
            if s in held and len(s.tokens) > 1:
                self._keep(s)
        self._leave([s for s, _ in ends])
        for s, reason in ends:
            s.end("done", reason)

    @staticmethod
    def _own_cache(s: Sequence) -> list:
        cache, s.cache = s.cache, None  # its rows now live in the batch
        return cache

    def _sample(self, rows: list[Sequence], logits: mx.array) -> Pending | None:
        """This step's picks for ``rows`` (queued to compute: ``mx.async_eval``), with the
        log-probabilities of the rows that ask for them. Rows with processors of their own
        or sampling parameters are picked one by one, the rest by one argmax; a row whose
        own processors raise ends now, alone (``Failure``), and leaves the batch."""
        for p in self.processors:
            logits = p(None, logits)
        logits = _biased(rows, logits)
        alone = [i for i, s in enumerate(rows) if s.processors or not s.sampling.greedy]
        logprobs = {}
        for i, s in enumerate(rows):
            if s.logprobs is not None and i not in alone:
                logprobs[i] = log_softmax(logits[i : i + 1].astype(mx.float32))
        picks = [None] * len(rows)
        if alone:
            rest = sorted(set(range(len(rows))) - set(alone))
            if rest:
                chosen = _greedy(logits[mx.array(rest)])
                for j, i in enumerate(rest):
                    picks[i] = chosen[j : j + 1]
        failed = {}
        for i in alone:
            try:
                picks[i], lp = self._pick(rows[i], logits[i : i + 1])
            except Exception as e:  # its own processors: it alone ends
                log.info("a sequence's logits processor failed: %s", e)
                failed[i] = Failure.of(e, own=True)
                continue
            if rows[i].logprobs is not None:
                logprobs[i] = lp
        if failed:
            self._leave([rows[i] for i in failed])
            for i, failure in failed.items():
                rows[i].end("error", failure)
        keep = [i for i in range(len(rows)) if i not in failed]
        if not alone:
            chosen = _greedy(logits)
        else:
            chosen = mx.concatenate([picks[i] for i in keep]) if keep else None
        pending = Pending([rows[i] for i in keep], chosen)
        where = {i: j for j, i in enumerate(keep)}
        by_top: dict[int, list[int]] = {}  # one evaluation per number of alternatives
        for i in logprobs:
            by_top.setdefault(rows[i].logprobs, []).append(where[i])
        for top, idx in by_top.items():
            lps = mx.concatenate([logprobs[keep[j]] for j in idx])
            pending.logprobs.append((idx, logprob_arrays(lps, chosen[mx.array(idx)], top)))
        if keep:
            mx.async_eval(chosen, *(a for _, arrays in pending.logprobs for a in arrays))
        return pending if keep else None

    @staticmethod
    def _pick(s: Sequence, logits: mx.array) -> tuple[mx.array, mx.array]:
        """``s``'s token, [1], and the log-probabilities it was drawn from, [1, V]."""
        if s.processors:
            context = mx.array(s.prompt + s.tokens)
            for p in s.processors:
                logits = p(context, logits)
        key = None
        if s.rng is not None:
            s.rng, key = mx.random.split(s.rng)
        logprobs = log_softmax(logits)
        return s.sampling.pick(logprobs, key), logprobs

    def _emit(self, s: Sequence, token: int) -> str | None:
        """Hand ``token`` to ``s``; the reason it ends (``"stop"``, ``"length"``), if it does."""
        s.tokens.append(token)
        if token in s.stop_ids:
            return "stop"
        s.out.put(("token", token))
        return "length" if len(s.tokens) >= s.max_tokens else None

    def _keep(self, s: Sequence):
        """Snapshot ``s``'s row for prefix reuse, under the tokens it holds (its prompt,
        then the tokens it was fed), the copy queued to compute."""
        if self.prefixes.max_bytes:
            held = self.batch.lengths[self.batch.members.index(s)]
            snap = self.batch.snapshot(s)
            mx.async_eval([a for _, *arrays in snap for a in arrays if a is not None])
            self.prefixes.put((s.prompt + s.tokens)[:held], snap)
