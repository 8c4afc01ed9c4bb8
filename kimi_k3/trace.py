"""Look inside Kimi K3 while it runs: routing, AttnRes mixes, KDA decay, MLA entropy.

``with trace(model) as t: model(ids)`` gives a few of the model's modules a recording
subclass for the duration of the block and restores their own class on exit. Nothing in
the model checks for a tracer, so outside a trace the forward pass runs exactly the code it
runs without this module: no flags, no hooks, no cost. Inside, recorders recompute what
they need from the module's inputs (router choice, mix weights, decay, attention scores);
the model's own outputs are unchanged.

Calls accumulate: a prefill followed by decode steps concatenates along the token axis T.
With a batch, sequence ``seq`` (default 0) of every call is recorded.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from kimi_k3.model.kda import kda_gate
from kimi_k3.model.model import Model
from kimi_k3.streaming import get_stats

# Monotone counters of ``kimi_k3.streaming.get_stats``: recorded as per-call differences.
CACHE_COUNTERS = (
    "hits",
    "misses",
    "bytes_read",
    "read_seconds",
    "prefetch_hits",
    "prefetch_issued",
)


class Trace:
    """What one ``trace`` recorded; numpy arrays, T counting tokens over all traced calls.

    - ``tokens``: [T] input ids.
    - ``routing[layer]``: ``(inds [T, k] int32, weights [T, k] fp32)``, the router's choice.
    - ``attn_res[layer]``: ``{"attn": [n+1, T], "mlp": [m+1, T]}``, softmax weights of the
      two mixes over the block snapshots (oldest first; row 0 is the embedding once a block
      has closed) and, last, the running partial sum. A mix with no snapshot is all ones.
    - ``attn_res_out``: [n+1, T], the output mix before the final norm.
    - ``kda[layer]``: ``{"alpha_mean": [T, H], "beta": [T, H], "state_norm": [H],
      "state_norm_calls": [calls, H]}`` plus ``"alpha": [T, H, K]`` when traced with
      ``channels=True``. ``alpha = exp(g)`` is the per-channel decay (1 keeps, 0 forgets),
      ``beta`` the write strength; ``state_norm`` is the Frobenius norm per head of the
      recurrent state after the last call.
    - ``mla_entropy[layer]``: [H, T], entropy (nats) of each head's attention distribution.
    - ``expert_cache``: ``None`` when experts are resident; else per-call differences of the
      streamer's counters, e.g. ``{"hits": [calls], "misses": [calls], ...}``, plus
      ``"tokens": [calls]``.
    """

    def __init__(self, seq: int = 0, channels: bool = False):
        self.seq, self.channels = seq, channels
        self._rec: dict[tuple, list] = defaultdict(list)  # key -> per-call arrays, T first
        self._fresh: list[mx.array] = []  # recorded since the last evaluation
        self._calls: list[dict] = []
        self._moe_batch: int | None = None

    def _add(self, key: tuple, value: mx.array):
        self._rec[key].append(value)
        self._fresh.append(value)

    def _get(self, key: tuple) -> np.ndarray:
        parts = self._rec.get(key)
        if not parts:
            return np.zeros(0, np.float32)
        return np.concatenate([np.array(a) for a in parts], axis=0)

    def _layers(self, kind: str) -> list[int]:
        return sorted({k[1] for k in self._rec if k[0] == kind})

    @property
    def tokens(self) -> np.ndarray:
        return self._get(("tokens",))

    @property
    def routing(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        return {
            i: (self._get(("routing", i, "inds")), self._get(("routing", i, "weights")))
            for i in self._layers("routing")
        }

    @property
    def attn_res(self) -> dict[int, dict[str, np.ndarray]]:
        return {
            i: {s: self._get(("attn_res", i, s)).T for s in ("attn", "mlp")}
            for i in self._layers("attn_res")
        }

    @property
    def attn_res_out(self) -> np.ndarray:
        return self._get(("attn_res_out",)).T

    @property
    def kda(self) -> dict[int, dict[str, np.ndarray]]:
        out = {}
        for i in self._layers("kda"):
            names = ["alpha_mean", "beta", "state_norm_calls"] + ["alpha"] * self.channels
            out[i] = {n: self._get(("kda", i, n)) for n in names}
            out[i]["state_norm"] = out[i]["state_norm_calls"][-1]
        return out

    @property
    def mla_entropy(self) -> dict[int, np.ndarray]:
        return {i: self._get(("mla", i)).T for i in self._layers("mla")}

    @property
    def expert_cache(self) -> dict[str, np.ndarray] | None:
        calls = [c for c in self._calls if c]
        if not calls:
            return None
        return {k: np.array([c.get(k, 0) for c in calls]) for k in calls[0]}


@contextmanager
def trace(model, seq: int = 0, channels: bool = False):
    """Record what ``model`` does inside the block; yields a ``Trace``.

    Args:
        model: a ``kimi_k3.model.model.Model`` (call the model itself: per-call bookkeeping such as
            ``tokens`` and ``expert_cache`` happens there).
        seq: which sequence of a batch to record.
        channels: also keep KDA's decay per channel (``kda[layer]["alpha"]``, [T, H, K]).
    """
    t = Trace(seq, channels)
    swapped = []
    try:
        for module, recorder in _recorders(model, t):
            swapped.append((module, _swap(module, recorder)))
        yield t
    finally:
        for module, base in reversed(swapped):
            module.__class__ = base


def _swap(module, recorder) -> type:
    """Give ``module`` a subclass whose call is ``recorder(base_call, module, ...)``."""
    base = type(module)
    if getattr(base, "_kimi_k3_traced", False):
        raise RuntimeError(f"{base.__name__} is already being traced (nested trace?)")

    def __call__(self, *args, **kwargs):
        return recorder(base.__call__, self, *args, **kwargs)

    ns = {
        "__call__": __call__,
        "_kimi_k3_traced": True,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
    }
    module.__class__ = type(base.__name__, (base,), ns)
    return base


def _recorders(model, t: Trace):
    if not isinstance(model, Model):
        raise TypeError(f"trace() needs a kimi_k3 Model, got {type(model).__name__}")
    yield model, _model_call(model, t)
    for layer in model.layers:
        i = layer.index
        yield layer.self_attention_res, _attn_res_call(t, ("attn_res", i, "attn"))
        yield layer.mlp_res, _attn_res_call(t, ("attn_res", i, "mlp"))
        yield layer.self_attn, (_kda_call if layer.is_linear else _mla_call)(t, i)
        if "block_sparse_moe" in layer:
            yield layer.block_sparse_moe, _moe_call(t)
            yield layer.block_sparse_moe.gate, _router_call(t, i)
    yield model.language_model.model.output_attn_res, _attn_res_call(t, ("attn_res_out",))


def _model_call(model, t: Trace):
    def record(call, module, inputs, *args, **kwargs):
        before = get_stats(model)
        out = call(module, inputs, *args, **kwargs)
        t._add(("tokens",), inputs[t.seq] if inputs.ndim == 2 else inputs)
        # Evaluate now so recorded arrays hold data, not graphs that pin activations.
        mx.eval(out, *t._fresh)
        t._fresh.clear()
        after = get_stats(model)
        delta = {}
        if before is not None and after is not None:
            delta = {k: after[k] - before[k] for k in CACHE_COUNTERS if k in after}
            delta["tokens"] = inputs.shape[-1]
        t._calls.append(delta)
        return out

    return record


def _attn_res_call(t: Trace, key: tuple):
    def record(call, module, snaps, p):
        if snaps:
            vs = mx.stack(snaps + [p])
            a = mx.softmax(module.logits(vs), axis=0, precise=True)  # [n+1, B, T]
        else:
            a = mx.ones((1,) + p.shape[:-1], mx.float32)
        t._add(key, a[:, t.seq].T)
        return call(module, snaps, p)

    return record


def _moe_call(t: Trace):
    def record(call, module, x, *args, **kwargs):
        t._moe_batch = x.shape[0] if x.ndim == 3 else 1
        try:
            return call(module, x, *args, **kwargs)
        finally:
            t._moe_batch = None

    return record


def _router_call(t: Trace, layer: int):
    def record(call, module, x, *args, **kwargs):
        inds, weights = call(module, x, *args, **kwargs)
        B = t._moe_batch or 1
        k = inds.shape[-1]
        t._add(("routing", layer, "inds"), inds.reshape(B, -1, k)[t.seq])
        t._add(("routing", layer, "weights"), weights.reshape(B, -1, k)[t.seq])
        return inds, weights

    return record


def _kda_call(t: Trace, layer: int):
    def record(call, module, x, cache=None):
        # A private cache when none is given, only to read the final state: with empty
        # conv/state entries the layer computes exactly what it computes without a cache.
        own = ArraysCache(size=2) if cache is None else cache
        y = call(module, x, own)
        alpha, beta = kda_decay(module, x)
        s = own[1][t.seq].astype(mx.float32)  # [H, K, V]
        t._add(("kda", layer, "alpha_mean"), alpha[t.seq].mean(axis=-1))
        t._add(("kda", layer, "beta"), beta[t.seq])
        t._add(("kda", layer, "state_norm_calls"), mx.sqrt((s * s).sum(axis=(-2, -1)))[None])
        if t.channels:
            t._add(("kda", layer, "alpha"), alpha[t.seq])
        return y

    return record


def kda_decay(module, x: mx.array) -> tuple[mx.array, mx.array]:
    """A KDA layer's decay ``alpha = exp(g)`` and write strength ``beta`` for input ``x``.

    Shapes: x [B, T, D] -> (alpha fp32 [B, T, H, K], beta fp32 [B, T, H]).
    """
    B, T, _ = x.shape
    g_raw = module.f_b_proj(module.f_a_proj(x)).reshape(B, T, module.heads, module.head_dim)
    g = kda_gate(g_raw, module.A_log, module.dt_bias, module.lower_bound)
    return mx.exp(g), mx.sigmoid(module.b_proj(x).astype(mx.float32))


def _mla_call(t: Trace, layer: int):
    def record(call, module, x, cache=None):
        offset = 0 if cache is None else cache.offset
        y = call(module, x, cache)
        keys = None
        if cache is not None:  # after the call the cache holds x's tokens too
            n = cache.offset
            keys = (cache.keys[..., :n, :], cache.values[..., :n, :])
        t._add(("mla", layer), mla_entropy(module, x, keys, offset)[t.seq].T)
        return y

    return record


def mla_entropy(module, x: mx.array, keys=None, offset: int = 0) -> mx.array:
    """Entropy (nats) of each MLA head's attention over the visible keys, in fp32.

    ``keys`` is ``(latent [B, 1, Tk, rank], k_pe [B, 1, Tk, pe])`` as held in the layer's
    ``KVCache`` (``offset`` of them precede ``x``), or ``None`` to use ``x``'s own tokens.
    Scores use the absorbed form ``(q_nope W_k) . latent + q_pe . k_pe``, which equals the
    expanded keys' scores.

    Shapes: x [B, T, D] -> [B, H, T].
    """
    m = module
    B, T, _ = x.shape
    q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x))).astype(mx.float32)
    q = q.reshape(B, T, m.heads, m.nope + m.pe).transpose(0, 2, 1, 3)
    if keys is None:
        kv = m.kv_a_proj_with_mqa(x)
        keys = (m.kv_a_layernorm(kv[..., : m.rank])[:, None], kv[..., m.rank :][:, None])
    latent, k_pe = (a.astype(mx.float32) for a in keys)
    wk = m._kv_b()[0].astype(mx.float32)  # [H, nope, rank]
    q_lat = mx.einsum("bhtn,hnr->bhtr", q[..., : m.nope], wk)
    s = (q_lat @ latent.swapaxes(-1, -2) + q[..., m.nope :] @ k_pe.swapaxes(-1, -2)) * m.scale
    Tk = latent.shape[2]
    visible = mx.arange(Tk)[None, :] <= (offset + mx.arange(T))[:, None]  # [T, Tk]
    logp = mx.where(visible, s, -mx.inf)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    return -mx.where(visible, mx.exp(logp) * logp, 0.0).sum(axis=-1)
