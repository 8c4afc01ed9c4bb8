"""``kimi_k3.trace``: recorded values against an independent numpy forward, and no trace left
behind (modules restored, outputs bitwise identical). About 3 s on 2 CPU cores.

The numpy side runs the ``tiny`` checkpoint in float64 through ``numpy_ref``'s blocks and
computes each traced quantity from the layer inputs it sees; MLX runs in float32.
Tolerances: absolute 1e-4 on weights, decays and entropies, 1e-4 relative on state norms;
chosen expert sets must agree exactly.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import numpy_ref as ref
import pytest
from mlx.utils import tree_flatten

from kimi_k3.checkpoint.loader import load_model
from kimi_k3.trace import trace

ATOL = 1e-4
PROMPT = [5, 17, 300, 42, 9, 900, 77, 3]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=mx.float32)


@pytest.fixture(scope="module")
def expected(tiny_ckpt):
    w, cfg = ref.load_checkpoint(tiny_ckpt)
    return numpy_trace(np.array(PROMPT), w, cfg)


def mix_weights(snaps, p, w, prefix, eps):
    """AttnRes softmax weights [n+1, T] (ones when there is no snapshot)."""
    if not snaps:
        return np.ones((1, p.shape[0]))
    vs = np.stack(snaps + [p])
    proj = w[f"{prefix}.norm_weight"] * w[f"{prefix}.proj_weight"][0]
    logits = (vs @ proj) / np.sqrt(np.mean(vs * vs, axis=-1) + eps)
    a = np.exp(logits - logits.max(axis=0))
    return a / a.sum(axis=0)


def mla_entropy(x, w, cfg):
    """Per-head causal attention entropy [H, T] with expanded (not absorbed) keys."""
    T, H = x.shape[0], cfg.mla_heads
    nope, pe, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q = ref.linear(
        ref.rms_norm(ref.linear(x, w["q_a_proj.weight"]), w["q_a_layernorm.weight"], ref.MLA_EPS),
        w["q_b_proj.weight"],
    ).reshape(T, H, nope + pe)
    kv = ref.linear(x, w["kv_a_proj_with_mqa.weight"])
    latent = ref.rms_norm(kv[:, :r], w["kv_a_layernorm.weight"], ref.MLA_EPS)
    k_nope = ref.linear(latent, w["kv_b_proj.weight"]).reshape(T, H, -1)[..., :nope]
    s = (
        np.einsum("thd,shd->hts", q[..., :nope], k_nope)
        + np.einsum("thd,sd->hts", q[..., nope:], kv[:, r:])
    ) * (nope + pe) ** -0.5
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=-1)


def numpy_trace(tokens, w, cfg) -> dict:
    """The traced quantities of one forward pass, from ``numpy_ref`` blocks (float64)."""
    m = ref.sub(w, "model.")
    eps = cfg.rms_norm_eps
    p, snaps, out = m["embed_tokens.weight"][tokens], [], {}
    for i in range(cfg.num_hidden_layers):
        lw = ref.sub(m, f"layers.{i}.")
        aw = ref.sub(lw, "self_attn.")
        out["attn", i] = mix_weights(snaps, p, lw, "self_attention_res", eps)
        h = ref.attn_res_mix(
            snaps,
            p,
            lw["self_attention_res.norm_weight"],
            lw["self_attention_res.proj_weight"],
            eps,
        )
        if i % cfg.attn_res_block_size == 0:
            snaps, p = snaps + [p], np.zeros_like(p)
        x = ref.rms_norm(h, lw["input_layernorm.weight"], eps)
        if (i + 1) in cfg.full_attn_layers:
            out["entropy", i] = mla_entropy(x, aw, cfg)
            y, _ = ref.mla_attention(x, aw, cfg)
        else:
            H, K = cfg.kda_heads, cfg.kda_head_dim
            g_raw = ref.linear(ref.linear(x, aw["f_a_proj.weight"]), aw["f_b_proj.weight"])
            g = ref.kda_gate(
                g_raw.reshape(-1, H, K), aw["A_log"], aw["dt_bias"], cfg.gate_lower_bound
            )
            out["alpha", i] = np.exp(g)
            out["beta", i] = ref.sigmoid(ref.linear(x, aw["b_proj.weight"]))
            y, (_, S) = ref.kda_attention(x, aw, cfg)
            out["state_norm", i] = np.sqrt((S * S).sum(axis=(1, 2)))
        p = p + y
        out["mlp", i] = mix_weights(snaps, p, lw, "mlp_res", eps)
        h = ref.rms_norm(
            ref.attn_res_mix(snaps, p, lw["mlp_res.norm_weight"], lw["mlp_res.proj_weight"], eps),
            lw["post_attention_layernorm.weight"],
            eps,
        )
        if i < cfg.first_k_dense_replace:
            f = ref.situ_mlp(h, ref.sub(lw, "mlp."), cfg.situ_beta, cfg.situ_cap)
        else:
            f, out["inds", i], out["weights", i] = ref.latent_moe(
                h, ref.sub(lw, "block_sparse_moe."), cfg
            )
        p = p + f
    out["out"] = mix_weights(snaps, p, m, "output_attn_res", eps)
    return out


def check_against(t, want: dict, layers: int):
    assert t.tokens.tolist() == PROMPT
    for i in range(layers):
        res = t.attn_res[i]
        np.testing.assert_allclose(res["attn"], want["attn", i], atol=ATOL, err_msg=f"attn {i}")
        np.testing.assert_allclose(res["mlp"], want["mlp", i], atol=ATOL, err_msg=f"mlp {i}")
        if ("inds", i) in want:
            inds, weights = t.routing[i]
            order, want_order = np.argsort(inds, axis=-1), np.argsort(want["inds", i], axis=-1)
            np.testing.assert_array_equal(
                np.take_along_axis(inds, order, -1),
                np.take_along_axis(want["inds", i], want_order, -1),
            )
            np.testing.assert_allclose(
                np.take_along_axis(weights, order, -1),
                np.take_along_axis(want["weights", i], want_order, -1),
                atol=ATOL,
            )
        if ("alpha", i) in want:
            kda = t.kda[i]
            np.testing.assert_allclose(kda["alpha_mean"], want["alpha", i].mean(-1), atol=ATOL)
            np.testing.assert_allclose(kda["beta"], want["beta", i], atol=ATOL)
            np.testing.assert_allclose(kda["state_norm"], want["state_norm", i], rtol=1e-4)
        if ("entropy", i) in want:
            np.testing.assert_allclose(t.mla_entropy[i], want["entropy", i], atol=ATOL)
    np.testing.assert_allclose(t.attn_res_out, want["out"], atol=ATOL)


def test_trace_matches_numpy(model, expected):
    with trace(model, channels=True) as t:
        model(mx.array([PROMPT]))
    check_against(t, expected, len(model.layers))
    kda_layers = [i for i, layer in enumerate(model.layers) if layer.is_linear]
    assert sorted(t.kda) == kda_layers
    assert sorted(t.mla_entropy) == [i for i in range(len(model.layers)) if i not in kda_layers]
    assert sorted(t.routing) == list(range(1, len(model.layers)))
    for i in kda_layers:
        np.testing.assert_allclose(t.kda[i]["alpha"], expected["alpha", i], atol=ATOL)
    H = model.args.kda_heads
    assert t.kda[0]["alpha_mean"].shape == (8, H) and t.kda[0]["state_norm"].shape == (H,)
    assert t.expert_cache is None  # experts are resident


def test_prefill_and_decode_concatenate(model, expected):
    """Prefill 5 tokens, decode 3 with a cache: the same trace as one 8-token call."""
    cache = model.make_cache()
    with trace(model) as t:
        model(mx.array([PROMPT[:5]]), cache=cache)
        for tok in PROMPT[5:]:
            model(mx.array([[tok]]), cache=cache)
    check_against(t, expected, len(model.layers))
    assert t.kda[0]["state_norm_calls"].shape == (4, model.args.kda_heads)


def test_batch_records_the_chosen_sequence(model):
    other = list(reversed(PROMPT))
    with trace(model, seq=1) as batched:
        model(mx.array([PROMPT, other]))
    with trace(model) as single:
        model(mx.array([other]))
    assert batched.tokens.tolist() == other
    for i, (inds, weights) in single.routing.items():
        np.testing.assert_array_equal(np.sort(batched.routing[i][0]), np.sort(inds))
        np.testing.assert_allclose(np.sort(batched.routing[i][1]), np.sort(weights), atol=1e-5)
    for i, ent in single.mla_entropy.items():
        np.testing.assert_allclose(batched.mla_entropy[i], ent, atol=1e-5)
    for i, kda in single.kda.items():
        np.testing.assert_allclose(batched.kda[i]["state_norm"], kda["state_norm"], rtol=1e-5)


def _snapshot(model):
    mods = [(m, type(m), dict(vars(m))) for _, m in model.named_modules()]
    params = [(k, id(v)) for k, v in tree_flatten(model.parameters())]
    return mods, params


def _assert_restored(model, snap):
    mods, params = snap
    for m, cls, attrs in mods:
        assert type(m) is cls
        assert vars(m) == attrs
    assert [(k, id(v)) for k, v in tree_flatten(model.parameters())] == params


def test_untraced_model_is_unchanged(model):
    ids = mx.array([PROMPT])
    before, snap = model(ids), _snapshot(model)
    cache_before = model.make_cache()
    steps_before = [model(ids[:, :6], cache=cache_before), model(ids[:, 6:7], cache=cache_before)]
    with trace(model):
        inside = model(ids)
        assert type(model.layers[1].block_sparse_moe.gate).__call__ is not nn.Module.__call__
    _assert_restored(model, snap)
    cache = model.make_cache()
    steps_after = [model(ids[:, :6], cache=cache), model(ids[:, 6:7], cache=cache)]
    assert mx.array_equal(inside, before).item()
    assert mx.array_equal(model(ids), before).item()
    for a, b in zip(steps_after, steps_before, strict=True):
        assert mx.array_equal(a, b).item()


def test_restored_after_errors(model):
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="boom"), trace(model):
        raise ValueError("boom")
    _assert_restored(model, snap)
    with trace(model), pytest.raises(RuntimeError, match="already being traced"), trace(model):
        pass
    _assert_restored(model, snap)
    with pytest.raises(TypeError, match="kimi_k3 Model"), trace(model.layers[0]):
        pass


def test_expert_cache_counters(tiny_ckpt):
    """Per-call streamer counters sum to the streamer's own totals (when it exists)."""
    try:
        from kimi_k3.streaming import get_stats
    except ImportError:
        get_stats = None
    if get_stats is None:
        model = load_model(tiny_ckpt, dtype=mx.float32)
        with trace(model) as t:
            model(mx.array([PROMPT]))
        assert t.expert_cache is None
        return
    model = load_model(tiny_ckpt, dtype=mx.float32, expert_cache_gb=64e-6)
    start = get_stats(model)
    cache = model.make_cache()
    with trace(model) as t:
        model(mx.array([PROMPT[:5]]), cache=cache)
        model(mx.array([PROMPT[5:6]]), cache=cache)
    end = get_stats(model)
    assert t.expert_cache["tokens"].tolist() == [5, 1]
    for key in ("hits", "misses"):
        assert t.expert_cache[key].sum() == end[key] - start[key]
    assert t.expert_cache["hits"].sum() + t.expert_cache["misses"].sum() > 0
