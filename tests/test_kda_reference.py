"""The pure-MLX KDA reference against flash-linear-attention's vectors; chunked == recurrent."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import rel_err

from kimi_k3.model.kda import kda_chunked, kda_gate, kda_recurrent, short_conv

VECTORS = np.load(__import__("pathlib").Path(__file__).parent / "data" / "kda_fla_vectors.npz")
CASES = sorted({k.split("/")[0] for k in VECTORS.files})


def _case(name):
    get = {k.split("/")[1]: mx.array(VECTORS[k]) for k in VECTORS.files if k.startswith(name + "/")}
    return get


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("form", [kda_recurrent, kda_chunked])
def test_matches_fla_reference(case, form):
    v = _case(case)
    K = v["q"].shape[-1]
    o, S = form(v["q"] * K**-0.5, v["k"], v["v"], v["g"], v["beta"], v.get("h0"))
    assert rel_err(o, v["o"]) < 1e-5
    assert rel_err(S, v["S"]) < 1e-5


@pytest.mark.parametrize("case", CASES)
def test_lower_bound_gate_matches_fla(case):
    v = _case(case)
    g = kda_gate(v["g_raw"], v["A_log"], v["dt_bias"], -5.0)
    assert rel_err(g, v["g"]) < 1e-6


def _inputs(T, H=3, K=32, V=16, seed=0, state=False):
    r = np.random.default_rng(seed)
    q = r.standard_normal((2, T, H, K)).astype(np.float32)
    k = r.standard_normal((2, T, H, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(K)
    v = r.standard_normal((2, T, H, V)).astype(np.float32)
    g = -5.0 / (1 + np.exp(-r.standard_normal((2, T, H, K)))).astype(np.float32)
    beta = 1 / (1 + np.exp(-r.standard_normal((2, T, H)))).astype(np.float32)
    S = r.standard_normal((2, H, K, V)).astype(np.float32) if state else None
    return [mx.array(x) if x is not None else None for x in (q, k, v, g, beta, S)]


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 257])
@pytest.mark.parametrize("state", [False, True])
def test_chunked_equals_recurrent(T, state):
    args = _inputs(T, state=state)
    o1, S1 = kda_recurrent(*args)
    o2, S2 = kda_chunked(*args)
    assert rel_err(o2, o1) < 1e-5
    assert rel_err(S2, S1) < 1e-5


def test_chunked_strong_decay_stays_finite():
    """Every gate at the -5 lower bound: 64 tokens span 320 nats; no overflow allowed."""
    q, k, v, _, beta, S = _inputs(130, state=True)
    g = mx.full(q.shape, -5.0)
    o1, S1 = kda_recurrent(q, k, v, g, beta, S)
    o2, S2 = kda_chunked(q, k, v, g, beta, S)
    assert bool(mx.all(mx.isfinite(o2))) and bool(mx.all(mx.isfinite(S2)))
    assert rel_err(o2, o1) < 1e-5


def test_state_carries_across_calls():
    q, k, v, g, beta, _ = _inputs(100)
    o_full, S_full = kda_chunked(q, k, v, g, beta, None)
    o_a, S_a = kda_chunked(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], None)
    o_b, S_b = kda_chunked(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], S_a)
    assert rel_err(mx.concatenate([o_a, o_b], axis=1), o_full) < 1e-5
    assert rel_err(S_b, S_full) < 1e-5


def test_short_conv_streams_like_one_call():
    r = np.random.default_rng(1)
    x = mx.array(r.standard_normal((1, 9, 5)).astype(np.float32))
    w = mx.array(r.standard_normal((5, 1, 4)).astype(np.float32))
    y_full, st_full = short_conv(x, w, None)
    y1, st = short_conv(x[:, :4], w, None)
    y2, st = short_conv(x[:, 4:], w, st)
    assert rel_err(mx.concatenate([y1, y2], axis=1), y_full) < 1e-6
    assert mx.array_equal(st, st_full)
