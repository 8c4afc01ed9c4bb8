"""The serving engine: many sequences decoded together, long prompts prefilled in chunks
between decode steps, conversation prefixes reused from snapshots of the caches.

One thread owns the model. Each step it prefills one chunk of the waiting prompt with the
fewest tokens left (so a short request is not held behind a long one), then decodes one
token for every sequence whose prompt is in its cache, all in one batched forward pass
(with streamed experts, the union of the batch's experts is read once). Sequences join
the batch at step boundaries and leave it when they finish or are cancelled.

Each sequence keeps its own per-layer caches (B = 1). A batched step stacks them: the KDA
conv windows and states side by side, the MLA latents left-padded to the longest with a
mask over the padding (``PaddedLatents``); afterwards each sequence takes its row back.
Batching is exact up to floating-point summation order: a greedy sequence decodes the same
tokens alone or in a batch.

Across ranks (``kimi_k3.distributed``'s splits) every rank must run every forward pass. Rank
0's engine sends each pass to the others before it runs it (``Peers``: the kind, the
sequences and their input tokens, by all-sum), and the other ranks repeat it on caches of
their own (``follow``); only rank 0 samples. Prefix reuse is off there.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

log = logging.getLogger("kimi_k3.serving")


class QueueFull(Exception):
    """The engine's waiting queue is full; try again later."""


@dataclass
class Sequence:
    """One request to the engine. Events arrive on ``out``: ``("token", id)`` for each
    generated token (stop tokens excluded), then one ``("done", reason)`` with reason
    ``"stop"``, ``"length"`` or ``"cancelled"``, or ``("error", message)``."""

    prompt: list[int]
    max_tokens: int
    sampler: Callable
    processors: list = field(default_factory=list)
    stop_ids: frozenset = frozenset()
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache: list | None = None
    key: int = -1  # the engine's number for it (what the other ranks know it by)
    fed: int = 0  # prompt tokens in the cache
    tokens: list[int] = field(default_factory=list)
    reused: int = 0  # prompt tokens restored from a snapshot

    def cancel(self):
        self.cancelled.set()

    @property
    def prefilled(self) -> bool:
        return self.fed >= len(self.prompt) - 1


def fresh_cache(model) -> list:
    """Per-layer caches of one sequence with zero KDA state (the state of an empty prefix)."""
    args = model.args
    P, K = args.kda_heads * args.kda_head_dim, args.kda_head_dim
    dtype = model.layers[0].input_layernorm.weight.dtype  # the activations' dtype
    caches = model.make_cache()
    for c in caches:
        if isinstance(c, ArraysCache):
            c[0] = mx.zeros((1, args.conv_size - 1, 3 * P), dtype=dtype)
            c[1] = mx.zeros((1, args.kda_heads, K, K), dtype=mx.float32)
    return caches


class PaddedLatents:
    """The MLA caches of a batch for one decode step: latents left-padded to the longest
    sequence, with ``mask`` [B, 1, 1, L+1] true on real positions (the layer reads it)."""

    def __init__(self, caches: list[KVCache]):
        self.offset = max(c.offset for c in caches)
        self.new = None
        self.keys = self.values = self.mask = None
        if self.offset == 0:
            return
        ref = next(c for c in caches if c.offset > 0)
        self.keys = mx.concatenate([self._padded(c, c.keys, ref.keys) for c in caches])
        self.values = mx.concatenate([self._padded(c, c.values, ref.values) for c in caches])
        starts = mx.array([self.offset - c.offset for c in caches])
        self.mask = (mx.arange(self.offset + 1)[None] >= starts[:, None])[:, None, None, :]

    def _padded(self, c: KVCache, a: mx.array | None, ref: mx.array) -> mx.array:
        pad = mx.zeros((1, ref.shape[1], self.offset - c.offset, ref.shape[3]), ref.dtype)
        if c.offset == 0:
            return pad
        return mx.concatenate([pad, a[..., : c.offset, :]], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.new = (keys, values)
        if self.keys is None:
            return keys, values
        return (
            mx.concatenate([self.keys, keys.astype(self.keys.dtype)], axis=2),
            mx.concatenate([self.values, values.astype(self.values.dtype)], axis=2),
        )


def batch_caches(caches: list[list]) -> list:
    """One batched cache per layer from the per-sequence caches ``caches[seq][layer]``."""
    out = []
    for layer in zip(*caches):
        if isinstance(layer[0], ArraysCache):
            b = ArraysCache(2)
            b[0] = mx.concatenate([c[0] for c in layer])
            b[1] = mx.concatenate([c[1] for c in layer])
        else:
            b = PaddedLatents(layer)
        out.append(b)
    return out


def unbatch_caches(batched: list, caches: list[list]):
    """Give each sequence its row of the batched caches after a step."""
    for layer, b in enumerate(batched):
        for i, seq in enumerate(caches):
            if isinstance(b, ArraysCache):
                seq[layer][0], seq[layer][1] = b[0][i : i + 1], b[1][i : i + 1]
            else:
                k, v = b.new
                seq[layer].update_and_fetch(k[i : i + 1], v[i : i + 1])


# Snapshots and prefix reuse.


def snapshot(caches: list) -> list:
    """The caches' contents as arrays (MLX arrays are immutable: nothing is copied)."""
    out = []
    for c in caches:
        if isinstance(c, ArraysCache):
            out.append(("kda", c[0], c[1]))
        else:
            k, v = (
                (None, None)
                if c.offset == 0
                else (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
            )
            out.append(("mla", k, v))
    return out


def restore(model, snap: list) -> list:
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


def forward(model, caches: list[list], tokens: list[int]):
    """One decode pass: token ``tokens[i]`` after ``caches[i]``; the last position's logits,
    with the caches evaluated."""
    inputs = mx.array(tokens)[:, None]
    if len(caches) == 1:
        logits = model(inputs, cache=caches[0])[:, -1]
    else:
        batched = batch_caches(caches)
        logits = model(inputs, cache=batched)[:, -1]
        unbatch_caches(batched, caches)
    return logits


def prefill(model, cache: list, tokens: list[int]):
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])


def follow(model, group):
    """A rank other than 0: repeat rank 0's forward passes until it stops."""
    peers, caches = Peers(group), {}
    while True:
        kind, keys, tokens = peers.receive()
        if kind == STOP:
            return
        if kind == DROP:
            for k in keys:
                caches.pop(k, None)
            continue
        held = [caches.setdefault(k, fresh_cache(model)) for k in keys]
        if kind == PREFILL:
            prefill(model, held[0], tokens)
        else:
            logits = forward(model, held, tokens)
            mx.eval(logits, [c.state for cache in held for c in cache])


# The engine.


class Engine:
    """Runs sequences on ``model`` in a thread of its own; see the module docstring.

    ``max_batch`` sequences are decoded together; up to ``max_waiting`` more wait (then
    ``submit`` raises ``QueueFull``); ``prefill_step_size`` prompt tokens per prefill chunk;
    ``reuse_bytes`` bounds the prefix snapshots (0 turns reuse off). With ``start`` the
    loop runs in a thread of its own; otherwise the caller runs ``run()`` (the server runs
    it in the main thread: MLX's compiled functions used from another thread abort the
    process at exit).
    """

    def __init__(
        self,
        model,
        max_batch: int = 8,
        max_waiting: int = 32,
        prefill_step_size: int = 512,
        reuse_bytes: int = 1 << 30,
        start: bool = True,
        group=None,
    ):
        self.model = model
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.prefill_step_size = prefill_step_size
        self.peers = Peers(group) if group is not None and group.size() > 1 else None
        self.prefixes = PrefixCache(0 if self.peers else reuse_bytes)
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

    def _drop(self, seqs: list[Sequence]):
        if self.peers and seqs:
            self.peers.send(DROP, [s.key for s in seqs])

    def run(self):
        """Steps until ``stop()``."""
        while True:
            with self.cond:
                while not self.stopped and not self.waiting and not self.active:
                    self.cond.wait()
                if self.stopped:
                    return
                self._admit()
            try:
                self.step()
            except Exception as e:  # a failed step ends its sequences; the engine lives on
                log.exception("generation step failed")
                for s in self.active:
                    s.out.put(("error", f"{type(e).__name__}: {e}"))
                self._drop(self.active)
                self.active = []

    def _admit(self):
        while self.waiting and len(self.active) < self.max_batch:
            s = self.waiting.popleft()
            if s.cancelled.is_set():
                s.out.put(("done", "cancelled"))
                continue
            s.key, self.keys = self.keys, self.keys + 1
            s.reused, snap = self.prefixes.longest(s.prompt)
            s.cache = fresh_cache(self.model) if snap is None else restore(self.model, snap)
            s.fed = s.reused
            self.active.append(s)

    def step(self):
        """One prefill chunk (if any prompt is waiting for one), then one decode step."""
        dropped = [s for s in self.active if self._dropped(s)]
        self._drop(dropped)
        self.active = [s for s in self.active if s not in dropped]
        prefilling = [s for s in self.active if not s.prefilled]
        if prefilling:
            self._prefill_chunk(min(prefilling, key=lambda s: len(s.prompt) - s.fed))
        ready = [s for s in self.active if s.prefilled]
        if ready:
            self._decode(ready)

    def _dropped(self, s: Sequence) -> bool:
        if s.cancelled.is_set():
            s.out.put(("done", "cancelled"))
            return True
        return False

    def _prefill_chunk(self, s: Sequence):
        n = min(self.prefill_step_size, len(s.prompt) - 1 - s.fed)
        chunk = s.prompt[s.fed : s.fed + n]
        if self.peers:
            self.peers.send(PREFILL, [s.key], chunk)
        prefill(self.model, s.cache, chunk)
        s.fed += n

    def _decode(self, ready: list[Sequence]):
        tokens = [s.tokens[-1] if s.tokens else s.prompt[-1] for s in ready]
        if self.peers:
            self.peers.send(DECODE, [s.key for s in ready], tokens)
        logits = forward(self.model, [s.cache for s in ready], tokens)
        picks = [self._sample(s, logits[i : i + 1]) for i, s in enumerate(ready)]
        mx.eval(picks, [c.state for s in ready for c in s.cache])
        for s, pick in zip(ready, picks):
            self._emit(s, pick.item())

    def _sample(self, s: Sequence, logits: mx.array) -> mx.array:
        if s.processors:
            context = mx.array(s.prompt + s.tokens)
            for p in s.processors:
                logits = p(context, logits)
        return s.sampler(logits - mx.logsumexp(logits, keepdims=True))

    def _emit(self, s: Sequence, token: int):
        if not s.tokens and self.prefixes.max_bytes:  # the cache holds exactly the prompt
            self.prefixes.put(s.prompt, snapshot(s.cache))
        s.tokens.append(token)
        if token in s.stop_ids:
            self._finish(s, "stop")
            return
        s.out.put(("token", token))
        if len(s.tokens) >= s.max_tokens:
            self._finish(s, "length")

    def _finish(self, s: Sequence, reason: str):
        if len(s.tokens) > 1 and self.prefixes.max_bytes:  # prompt + all tokens but the last
            self.prefixes.put(s.prompt + s.tokens[:-1], snapshot(s.cache))
        self.active.remove(s)
        self._drop([s])
        s.out.put(("done", reason))
