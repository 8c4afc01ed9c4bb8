"""Every MLX block against the independent float64 numpy reference (``numpy_ref``).

MLX runs in float32 with seeded random weights; the reference gets the same float32 values
in float64. Tolerance: blocks agree within TOL = 1e-5, the whole model within 1e-4, both as
a norm-relative error ``||a - b|| / ||b||`` and as a max-abs error scaled by ``max |b|``.
Routing (chosen expert sets) and MXFP4 decoding must agree exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import numpy_ref as ref
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import ArraysCache, KVCache

from kimi_k3.checkpoint.loader import load_model
from kimi_k3.convert.synth import write_checkpoint
from kimi_k3.model import kda
from kimi_k3.model.attention import GatedMLA, KimiDeltaAttention
from kimi_k3.model.attn_res import AttnResMix
from kimi_k3.model.config import ModelArgs
from kimi_k3.model.experts import situ_glu
from kimi_k3.model.moe import LatentMoE, Router, SituMLP

TOL = 1e-5
MODEL_TOL = 1e-4
B = 2
FLA_VECTORS = Path(__file__).parent / "data" / "kda_fla_vectors.npz"

# Awkward sizes on purpose: widths that are not powers of two and straddle 32.
CONFIG = {
    "vocab_size": 64,
    "hidden_size": 40,
    "num_hidden_layers": 2,
    "intermediate_size": 72,
    "rms_norm_eps": 1e-5,
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 12,
    "first_k_dense_replace": 1,
    "num_experts": 12,
    "num_experts_per_token": 4,
    "num_shared_experts": 2,
    "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 64,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "num_attention_heads": 3,
    "q_lora_rank": 24,
    "kv_lora_rank": 36,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "linear_attn_config": {
        "num_heads": 3,
        "head_dim": 20,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "kda_layers": [1],
        "full_attn_layers": [2],
    },
}
ARGS = ModelArgs.from_dict(CONFIG)
CFG = ref.RefConfig.from_dict(CONFIG)
CFG_E = CONFIG["num_experts"]


def f64(a) -> np.ndarray:
    if isinstance(a, mx.array):
        a = np.array(a.astype(mx.float32))
    return np.asarray(a, dtype=np.float64)


def assert_close(got, want, tol=TOL, what=""):
    got, want = f64(got), f64(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    top = np.abs(got - want).max() / np.abs(want).max()
    assert rel <= tol and top <= tol, f"{what}: norm-rel {rel:.2e}, max-abs/max {top:.2e} > {tol}"


def random_params(module, rng) -> dict:
    """Seeded float32 values for every floating parameter of ``module``, set on it."""
    out = {}
    for name, p in tree_flatten(module.parameters()):
        if not mx.issubdtype(p.dtype, mx.floating):
            continue  # MXFP4 expert bytes: set by the test
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            v = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith(("dt_bias", "conv1d.weight")):
            v = 0.5 * rng.standard_normal(shape)
        elif name.endswith("e_score_correction_bias"):
            v = 0.1 * rng.standard_normal(shape)
        elif name.endswith(("norm.weight", "layernorm.weight", "norm_weight")):
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("proj_weight"):  # AttnRes: logits of order one
            v = 2.0 * rng.standard_normal(shape) / math.sqrt(shape[-1])
        else:
            v = rng.standard_normal(shape) / math.sqrt(shape[-1])
        out[name] = v.astype(np.float32)
    module.update(tree_unflatten([(k, mx.array(v)) for k, v in out.items()]))
    return out


def as_ref(params: dict) -> dict:
    return {k: f64(v) for k, v in params.items()}


def randn(rng, *shape, scale=1.0) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


# ---------------------------------------------------------------- SiTU


def test_situ_glu():
    rng = np.random.default_rng(0)
    g, u = randn(rng, 5, 37, scale=20.0), randn(rng, 5, 37, scale=60.0)  # saturating tanh
    got = situ_glu(mx.array(g), mx.array(u), 4.0, 25.0)
    assert_close(got, ref.situ_glu(f64(g), f64(u), 4.0, 25.0), what="situ_glu")


def test_situ_mlp():
    rng = np.random.default_rng(1)
    mlp = SituMLP(40, 72, 4.0, 25.0)
    w = as_ref(random_params(mlp, rng))
    x = randn(rng, B, 6, 40, scale=3.0)
    want = ref.situ_mlp(f64(x), w, 4.0, 25.0)
    assert_close(mlp(mx.array(x)), want, what="SituMLP")


# ---------------------------------------------------------------- KDA pieces


def test_kda_pieces():
    rng = np.random.default_rng(2)
    T, H, K = 7, 3, 20
    x, cw, st = randn(rng, 1, T, H * K), randn(rng, H * K, 1, 4), randn(rng, 1, 3, H * K)
    y, s = kda.short_conv(mx.array(x), mx.array(cw), mx.array(st))
    y_ref, s_ref = ref.short_conv(f64(x[0]), f64(cw), f64(st[0]))
    assert_close(y[0], y_ref, what="short_conv output")
    assert_close(s[0], s_ref, what="short_conv window")
    v = randn(rng, T, H, K)
    assert_close(kda.l2norm(mx.array(v)), ref.l2norm(f64(v)), what="l2norm")
    g_raw, a_log, dt = randn(rng, 1, T, H, K, scale=2.0), randn(rng, H), randn(rng, H * K)
    g = kda.kda_gate(mx.array(g_raw), mx.array(a_log), mx.array(dt), -5.0)
    assert_close(g[0], ref.kda_gate(f64(g_raw[0]), f64(a_log), f64(dt), -5.0), what="kda_gate")
    o, gate, w = randn(rng, 1, T, H, K), randn(rng, 1, T, H, K), randn(rng, K)
    got = kda.rms_norm_gate(mx.array(o), mx.array(w), mx.array(gate), 1e-5)
    assert_close(
        got[0], ref.head_norm_gate(f64(o[0]), f64(w), f64(gate[0]), 1e-5), what="rms_norm_gate"
    )


def test_reference_matches_fla_vectors():
    """The numpy reference itself against flash-linear-attention's recurrence (an outside
    oracle, computed in float32; see tests/data/README.md)."""
    data = np.load(FLA_VECTORS)
    cases = sorted({k.split("/")[0] for k in data.files})
    assert cases
    for case in cases:
        d = {k.split("/")[1]: f64(data[k]) for k in data.files if k.startswith(case + "/")}
        g = ref.kda_gate(d["g_raw"][0], d["A_log"], d["dt_bias"], -5.0)
        assert_close(g, d["g"][0], what=f"{case} gate")
        K = d["q"].shape[-1]
        S0 = d["h0"][0] if "h0" in d else None
        o, S = ref.kda_sequence(
            d["q"][0] * K**-0.5, d["k"][0], d["v"][0], d["g"][0], d["beta"][0], S0
        )
        assert_close(o, d["o"][0], what=f"{case} o")
        assert_close(S, d["S"][0], what=f"{case} S")


def _kda_inputs(rng, T, H=3, K=20, V=12):
    q = ref.l2norm(f64(randn(rng, B, T, H, K))) * K**-0.5
    k = ref.l2norm(f64(randn(rng, B, T, H, K)))
    v = f64(randn(rng, B, T, H, V))
    g = np.stack(
        [
            ref.kda_gate(
                f64(randn(rng, T, H, K, scale=2.0)),
                f64(randn(rng, H)),
                f64(randn(rng, H * K)),
                -5.0,
            )
            for _ in range(B)
        ]
    )
    beta = ref.sigmoid(f64(randn(rng, B, T, H)))
    return [t.astype(np.float32) for t in (q, k, v, g, beta)]


@pytest.mark.parametrize("form", [kda.kda_recurrent, kda.kda_chunked])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 7, 65])
def test_kda_recurrence(form, with_state, T):
    rng = np.random.default_rng(T)
    q, k, v, g, beta = _kda_inputs(rng, T)
    S0 = randn(rng, B, 3, 20, 12, scale=0.5) if with_state else None
    o, S = form(*(mx.array(t) for t in (q, k, v, g, beta)), None if S0 is None else mx.array(S0))
    for b in range(B):
        o_ref, S_ref = ref.kda_sequence(
            f64(q[b]),
            f64(k[b]),
            f64(v[b]),
            f64(g[b]),
            f64(beta[b]),
            None if S0 is None else f64(S0[b]),
        )
        assert_close(o[b], o_ref, what=f"{form.__name__} T={T} output")
        assert_close(S[b], S_ref, what=f"{form.__name__} T={T} state")


def test_kda_step_is_one_token_of_sequence():
    """The reference's own step and sequence agree (fp64, to rounding)."""
    rng = np.random.default_rng(3)
    q, k, v, g, beta = (f64(t)[0] for t in _kda_inputs(rng, 5))
    o_seq, S_seq = ref.kda_sequence(q, k, v, g, beta)
    S = np.zeros_like(S_seq)
    for t in range(5):
        o, S = ref.kda_step(S, q[t], k[t], v[t], g[t], beta[t])
        np.testing.assert_allclose(o, o_seq[t], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(S, S_seq, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- KDA module


@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("T", [1, 7, 65])
def test_kda_module(with_cache, T):
    rng = np.random.default_rng(10 + T)
    attn = KimiDeltaAttention(ARGS)
    w = as_ref(random_params(attn, rng))
    H, K, P = CFG.kda_heads, CFG.kda_head_dim, CFG.kda_heads * CFG.kda_head_dim
    x = randn(rng, B, T, CFG.hidden_size)
    cache = None
    if with_cache:
        conv0, S0 = randn(rng, B, 3, 3 * P), randn(rng, B, H, K, K, scale=0.5)
        cache = ArraysCache(2)
        cache[0], cache[1] = mx.array(conv0), mx.array(S0)
    y = attn(mx.array(x), cache)
    for b in range(B):
        rc = None
        if with_cache:
            rc = (dict(zip("qkv", np.split(f64(conv0[b]), 3, axis=-1), strict=True)), f64(S0[b]))
        y_ref, (windows, S) = ref.kda_attention(f64(x[b]), w, CFG, rc)
        assert_close(y[b], y_ref, what=f"KDA T={T} output")
        if with_cache:
            conv = np.concatenate([windows[n] for n in "qkv"], axis=-1)
            assert_close(cache[0][b], conv, what=f"KDA T={T} conv window")
            assert_close(cache[1][b], S, what=f"KDA T={T} state")


# ---------------------------------------------------------------- MLA


def test_mla_prefill():
    rng = np.random.default_rng(20)
    attn = GatedMLA(ARGS)
    w = as_ref(random_params(attn, rng))
    x = randn(rng, B, 9, CFG.hidden_size)
    y = attn(mx.array(x))
    for b in range(B):
        assert_close(y[b], ref.mla_attention(f64(x[b]), w, CFG)[0], what="MLA prefill")


def test_mla_cached_decode():
    """Prefill 5, decode 1, prefill 3 more over the cache, decode 1: each step against the
    reference run the same way, and the reference against its own uncached prefill."""
    rng = np.random.default_rng(21)
    attn = GatedMLA(ARGS)
    w = as_ref(random_params(attn, rng))
    x = randn(rng, B, 10, CFG.hidden_size)
    full = [ref.mla_attention(f64(x[b]), w, CFG)[0] for b in range(B)]
    cache, ref_cache = KVCache(), [None] * B
    for a, e in ((0, 5), (5, 6), (6, 9), (9, 10)):
        y = attn(mx.array(x[:, a:e]), cache)
        for b in range(B):
            y_ref, ref_cache[b] = ref.mla_attention(f64(x[b, a:e]), w, CFG, ref_cache[b])
            np.testing.assert_allclose(y_ref, full[b][a:e], rtol=1e-10, atol=1e-12)
            assert_close(y[b], y_ref, what=f"MLA tokens {a}..{e} over a cache")
    assert cache.offset == 10
    assert_close(cache.keys[:, 0, :10], np.stack([c[0] for c in ref_cache]), what="MLA latents")
    assert_close(
        cache.values[:, 0, :10], np.stack([c[1] for c in ref_cache]), what="MLA shared keys"
    )


@pytest.mark.parametrize("mode, bits", [("affine", 4), ("affine", 8), ("mxfp4", 4)])
def test_mla_quantized_kv_b_matches_its_dequantized_weights(mode, bits):
    """A quantized kv_b_proj is multiplied as stored (mx.quantized_matmul, no per-call
    dequantization) in prefill and in the absorbed decode: the same outputs, over a cache,
    as the module holding the dequantized weights in a plain Linear."""
    import mlx.nn as nn

    args = ModelArgs.from_dict({**CONFIG, "kv_lora_rank": 64})  # quantizable: 64 inputs
    rng = np.random.default_rng(22)
    plain = GatedMLA(args)
    random_params(plain, rng)
    quant = GatedMLA(args)
    quant.update(plain.parameters())
    nn.quantize(
        quant,
        group_size=32,
        bits=bits,
        mode=mode,
        class_predicate=lambda path, m: path == "kv_b_proj",
    )
    kvb = quant.kv_b_proj
    assert isinstance(kvb, nn.QuantizedLinear)
    plain.kv_b_proj.weight = mx.dequantize(
        kvb.weight, kvb.scales, kvb.get("biases"), kvb.group_size, kvb.bits, kvb.mode
    )
    x = mx.array(randn(rng, B, 10, CFG.hidden_size))
    caches = KVCache(), KVCache()
    for a, e in ((0, 5), (5, 6), (6, 9), (9, 10)):
        want = plain(x[:, a:e], caches[0])
        assert_close(quant(x[:, a:e], caches[1]), want, what=f"{mode}{bits} tokens {a}..{e}")


# ---------------------------------------------------------------- AttnRes


@pytest.mark.parametrize("n_snaps", [0, 1, 3])
def test_attn_res_mix(n_snaps):
    rng = np.random.default_rng(30 + n_snaps)
    D = CFG.hidden_size
    mix = AttnResMix(D, CFG.rms_norm_eps)
    w = as_ref(random_params(mix, rng))
    # Vectors of different scales, so the rsqrt(mean(v^2)) factor matters.
    snaps = [randn(rng, B, 6, D, scale=0.5 + i) for i in range(n_snaps)]
    p = randn(rng, B, 6, D, scale=2.0)
    got = mix([mx.array(s) for s in snaps], mx.array(p))
    for b in range(B):
        want = ref.attn_res_mix(
            [f64(s[b]) for s in snaps],
            f64(p[b]),
            w["norm_weight"],
            w["proj_weight"],
            CFG.rms_norm_eps,
        )
        assert_close(got[b], want, what=f"AttnRes mix with {n_snaps} snapshots")


# ---------------------------------------------------------------- MXFP4 and LatentMoE


def test_mxfp4_decode_bit_exact():
    """Random bytes; every finite E8M0 scale 0..254 (255 is NaN in the OCP spec)."""
    rng = np.random.default_rng(40)
    packed = rng.integers(0, 256, (24, 128), dtype=np.uint8)
    scales = rng.integers(0, 255, (24, 8), dtype=np.uint8)
    scales[0] = [0, 1, 127, 128, 200, 252, 253, 254]
    got = mx.dequantize(
        mx.array(packed.view(np.uint32)),
        mx.array(scales),
        group_size=32,
        bits=4,
        mode="mxfp4",
        dtype=mx.float32,
    )
    with np.errstate(over="ignore"):  # 6 * 2^127 overflows float32 to inf on both sides
        want = ref.mxfp4_decode(packed, scales).astype(np.float32)
    np.testing.assert_array_equal(np.array(got).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("scale,renormalize", [(1.0, True), (2.5, True), (1.0, False)])
def test_router(scale, renormalize):
    rng = np.random.default_rng(50)
    E, k = CFG_E, CFG.top_k
    router = Router(CFG.hidden_size, E, k, scale, renormalize)
    w = as_ref(random_params(router, rng))
    x = randn(rng, 40, CFG.hidden_size, scale=2.0)
    inds, wts = router(mx.array(x))
    r_inds, r_wts, biased = ref.route(
        f64(x), w["weight"], w["e_score_correction_bias"], k, scale, renormalize
    )
    _check_routing(inds, wts, r_inds, r_wts, biased, k)


def _check_routing(inds, wts, r_inds, r_wts, biased, k):
    # The data must not sit on a tie, or fp32 vs fp64 could legitimately pick differently.
    srt = -np.sort(-biased, axis=-1)
    assert (srt[:, k - 1] - srt[:, k]).min() > 1e-5, "ambiguous test data: near-tie at top-k"
    inds, wts = np.array(inds), f64(wts)
    order, r_order = np.argsort(inds, axis=-1), np.argsort(r_inds, axis=-1)
    np.testing.assert_array_equal(
        np.take_along_axis(inds, order, -1), np.take_along_axis(r_inds, r_order, -1)
    )
    assert_close(
        np.take_along_axis(wts, order, -1),
        np.take_along_axis(r_wts, r_order, -1),
        what="routing weights",
    )


def _random_experts(rng, E, Dl, I) -> dict:
    """Checkpoint-layout MXFP4 experts, scales centred for unit-size outputs."""
    out = {}
    for e in range(E):
        for n, (o, i) in (("w1", (I, Dl)), ("w2", (Dl, I)), ("w3", (I, Dl))):
            centre = 127 - round(math.log2(3.0 * math.sqrt(i)))
            out[f"experts.{e}.{n}.weight_packed"] = rng.integers(0, 256, (o, i // 2), np.uint8)
            out[f"experts.{e}.{n}.weight_scale"] = rng.integers(
                centre - 1, centre + 2, (o, i // 32)
            ).astype(np.uint8)
    return out


def test_latent_moe():
    rng = np.random.default_rng(60)
    moe = LatentMoE(ARGS)
    w = as_ref(random_params(moe, rng))
    experts = _random_experts(
        rng, CFG_E, ARGS.routed_expert_hidden_size, ARGS.moe_intermediate_size
    )
    stacked = {}
    for n in ("w1", "w2", "w3"):
        packed = np.stack([experts[f"experts.{e}.{n}.weight_packed"] for e in range(CFG_E)])
        scales = np.stack([experts[f"experts.{e}.{n}.weight_scale"] for e in range(CFG_E)])
        stacked[f"experts.{n}.weight"] = mx.array(packed.view(np.uint32))
        stacked[f"experts.{n}.scales"] = mx.array(scales)
    moe.update(tree_unflatten(list(stacked.items())))
    w.update(experts)
    x = randn(rng, B, 11, CFG.hidden_size, scale=2.0)
    y = moe(mx.array(x))
    inds, wts = moe.gate(mx.array(x.reshape(-1, CFG.hidden_size)))
    y_ref, r_inds, r_wts = ref.latent_moe(f64(x.reshape(-1, CFG.hidden_size)), w, CFG)
    _, _, biased = ref.route(
        f64(x.reshape(-1, CFG.hidden_size)),
        w["gate.weight"],
        w["gate.e_score_correction_bias"],
        CFG.top_k,
        1.0,
        True,
    )
    _check_routing(inds, wts, r_inds, r_wts, biased, CFG.top_k)
    assert_close(y.reshape(-1, CFG.hidden_size), y_ref, what="LatentMoE output")


# ---------------------------------------------------------------- decoder layers and model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tiny-np"), "tiny", tokenizer=False)
    w, cfg = ref.load_checkpoint(path)
    return load_model(path, dtype=mx.float32), w, cfg


PROMPT = [3, 977, 15, 512, 8, 1000, 77, 240]


def test_decoder_layers(tiny):
    """Each layer, fed the same partial sum and snapshots, agrees at block tolerance."""
    model, w, cfg = tiny
    p = model.language_model.model.embed_tokens(mx.array([PROMPT]))
    snaps = []
    for i, layer in enumerate(model.layers):
        want, want_snaps, _ = ref.decoder_layer(
            i, f64(p[0]), [f64(s[0]) for s in snaps], ref.sub(w, f"model.layers.{i}."), cfg
        )
        p, snaps = layer(p, snaps)
        assert len(snaps) == len(want_snaps), f"layer {i}: snapshot count"
        assert_close(p[0], want, what=f"layer {i} partial sum")


def test_model_logits(tiny):
    """Whole model, 8-token prompt: logits within MODEL_TOL; then the same prompt as a
    5-token prefill and 3 cached decode steps, in MLX and in the reference."""
    model, w, cfg = tiny
    want = ref.model_forward(PROMPT, w, cfg)
    assert_close(model(mx.array([PROMPT]))[0], want, MODEL_TOL, what="model logits")
    cache, ref_caches = model.make_cache(), [None] * cfg.num_hidden_layers
    steps = [PROMPT[:5]] + [[t] for t in PROMPT[5:]]
    a = 0
    for toks in steps:
        got = model(mx.array([toks]), cache=cache)[0]
        r = ref.model_forward(toks, w, cfg, ref_caches)
        np.testing.assert_allclose(r, want[a : a + len(toks)], rtol=1e-10, atol=1e-10)
        assert_close(got, r, MODEL_TOL, what=f"cached logits {a}..{a + len(toks)}")
        a += len(toks)
