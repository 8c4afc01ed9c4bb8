"""Whole-model behaviour: parity with mlx-lm's own kimi_k3, caches, prefill vs decode."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import rel_err
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model

from kimi_k3.checkpoint.loader import load_model

PRESETS = ["tiny", "tiny-b"]


def _prompt(n, seed=0, vocab=700):
    return mx.array(np.random.default_rng(seed).integers(0, vocab, (1, n)))


def _greedy(model, prompt, steps, cache):
    logits = [model(prompt, cache=cache)[:, -1]]
    for _ in range(steps):
        tok = mx.argmax(logits[-1], axis=-1)[:, None]
        logits.append(model(tok, cache=cache)[:, -1])
    return mx.stack(logits, axis=1)


@pytest.mark.parametrize("preset", PRESETS)
def test_parity_with_mlx_lm(ckpt_factory, preset):
    """fp32 logits within 1e-4 relative of mlx-lm's kimi_k3 on the same checkpoint:
    a 32-token prefill, then 16 greedy decode steps fed with our own argmax tokens."""
    path = ckpt_factory(preset)
    ours = load_model(path, dtype=mx.float32)
    ref, _ = mlx_lm_load_model(path)
    ref.set_dtype(mx.float32)
    prompt = _prompt(32)
    full_ours, full_ref = ours(prompt), ref(prompt)
    assert rel_err(full_ours, full_ref) < 1e-4
    c_ours, c_ref = ours.make_cache(), ref.make_cache()
    a = _greedy(ours, prompt, 16, c_ours)
    toks = mx.argmax(a, axis=-1)
    b = [ref(prompt, cache=c_ref)[:, -1]]
    for i in range(16):
        b.append(ref(toks[:, i : i + 1], cache=c_ref)[:, -1])
    b = mx.stack(b, axis=1)
    for i in range(17):
        assert rel_err(a[:, i], b[:, i]) < 1e-4, f"step {i}"


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_equals_decode_equals_chunks(ckpt_factory, preset):
    model = load_model(ckpt_factory(preset), dtype=mx.float32)
    prompt = _prompt(40, seed=3)
    once = model(prompt)
    cache = model.make_cache()
    steps = mx.concatenate([model(prompt[:, i : i + 1], cache=cache) for i in range(40)], axis=1)
    cache = model.make_cache()
    cuts = [0, 5, 6, 23, 40]
    chunks = mx.concatenate(
        [model(prompt[:, a:b], cache=cache) for a, b in zip(cuts, cuts[1:])], axis=1
    )
    assert rel_err(steps, once) < 1e-5
    assert rel_err(chunks, once) < 1e-5


def test_batch_rows_are_independent(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype=mx.float32)
    p = mx.concatenate([_prompt(12, 1), _prompt(12, 2)], axis=0)
    both = model(p)
    assert rel_err(both[1:], model(p[1:])) < 1e-5


def test_prompt_cache_save_and_load(tiny_ckpt, tmp_path):
    """mlx-lm's make/save/load_prompt_cache round-trip our caches; decoding goes on the same."""
    model = load_model(tiny_ckpt, dtype=mx.float32)
    prompt = _prompt(20, seed=4)
    cache = make_prompt_cache(model)
    model(prompt, cache=cache)
    file = str(tmp_path / "cache.safetensors")
    save_prompt_cache(file, cache)
    loaded = load_prompt_cache(file)
    tok = mx.array([[7]])
    assert mx.array_equal(model(tok, cache=cache), model(tok, cache=loaded))


def test_mla_decode_cache_holds_only_latents(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype=mx.float32)
    cache = model.make_cache()
    model(_prompt(9), cache=cache)
    args = model.args
    for layer, c in zip(model.layers, cache):
        if layer.is_linear:
            conv, state = c[0], c[1]
            P = args.kda_heads * args.kda_head_dim
            assert conv.shape == (1, args.conv_size - 1, 3 * P)
            assert state.shape == (1, args.kda_heads, args.kda_head_dim, args.kda_head_dim)
            assert state.dtype == mx.float32
        else:
            keys, values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            assert keys.shape[-1] == args.kv_lora_rank and values.shape[-1] == args.qk_rope_head_dim
            assert keys.shape[1] == 1 and c.offset == 9


def test_bf16_default_close_to_fp32(tiny_ckpt):
    """bf16 contract: mean KL(fp32 || bf16) of the next-token distribution < 0.05 nats and
    greedy top-1 agreement >= 75%. bf16 rounding flips some top-k routing choices, so
    max |diff| is not a meaningful measure (MLX_KERNELS.md, "Precision on CUDA")."""
    m32 = load_model(tiny_ckpt, dtype=mx.float32)
    m16 = load_model(tiny_ckpt)
    assert m16.language_model.lm_head.weight.dtype == mx.bfloat16
    p = _prompt(24, 5)
    a, b = m32(p), m16(p).astype(mx.float32)
    la = a - mx.logsumexp(a, -1, keepdims=True)
    lb = b - mx.logsumexp(b, -1, keepdims=True)
    kl = float(mx.mean(mx.sum(mx.exp(la) * (la - lb), axis=-1)))
    assert kl < 0.05
    assert float(mx.mean(mx.argmax(a, -1) == mx.argmax(b, -1))) >= 0.75


def test_kept_fp32_parameters(tiny_ckpt):
    model = load_model(tiny_ckpt)
    attn = model.layers[0].self_attn
    assert attn.A_log.dtype == mx.float32 and attn.dt_bias.dtype == mx.float32
    assert attn.q_conv1d.weight.dtype == mx.float32
    assert attn.A_log.shape == (model.args.kda_heads,)
    moe = model.layers[1].block_sparse_moe
    assert moe.gate.e_score_correction_bias.dtype == mx.float32
    assert moe.experts.w1.weight.dtype == mx.uint32


def test_quantized_router_matches_dequantized_weights():
    """The converter stores the router at 8 bits; the loaded QuantizedRouter computes its
    logits from the quantized weight exactly as a dense matmul on the dequantized one."""
    from kimi_k3.model.moe import QuantizedRouter, Router

    router = Router(64, 16, 4, 1.0, True)
    router.weight = mx.random.normal((16, 64), key=mx.random.key(0))
    q = router.to_quantized(group_size=64, bits=8)
    assert isinstance(q, QuantizedRouter) and q.weight.dtype == mx.uint32
    x = mx.random.normal((5, 64), key=mx.random.key(1))
    w = mx.dequantize(q.weight, q.scales, q.biases, group_size=64, bits=8)
    assert rel_err(q.logits(x), x @ w.T) < 1e-5
    inds, weights = q(x)
    assert inds.shape == (5, 4) and bool(mx.allclose(weights.sum(-1), mx.ones(5)))
