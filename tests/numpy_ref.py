"""An independent float64 numpy reference for every Kimi K3 block.

Written from the formulas in ``docs/model.md`` ("The blocks", "MXFP4"), not from the MLX
code: the MLX modules are checked against it in ``test_blocks_numpy.py``. Everything works
on one sequence (no batch axis) in float64; weights are dicts keyed by the checkpoint's
tensor names relative to the block (``"q_proj.weight"``, ``"A_log"``, ...), so the same
functions run on seeded test weights and on a checkpoint read by ``load_checkpoint``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kimi_k3.checkpoint.files import CheckpointIndex

MLA_EPS = 1e-6  # q_a / kv_a latent norms
L2_EPS = 1e-6  # KDA q, k normalisation (added to the sum of squares)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@dataclass
class RefConfig:
    """The hyperparameters the reference needs, read from a ``config.json`` dict."""

    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    situ_beta: float
    situ_cap: float
    attn_res_block_size: int
    first_k_dense_replace: int
    top_k: int
    routed_scaling_factor: float
    renormalize: bool
    kda_heads: int
    kda_head_dim: int
    gate_lower_bound: float
    full_attn_layers: tuple  # 1-based, as in the config
    mla_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int

    @classmethod
    def from_dict(cls, config: dict) -> RefConfig:
        t = config.get("text_config") or config
        lin = t["linear_attn_config"]
        return cls(
            hidden_size=t["hidden_size"],
            num_hidden_layers=t["num_hidden_layers"],
            rms_norm_eps=t["rms_norm_eps"],
            situ_beta=t["activation_situ_beta"],
            situ_cap=t["activation_situ_linear_beta"],
            attn_res_block_size=t["attn_res_block_size"],
            first_k_dense_replace=t["first_k_dense_replace"],
            top_k=t["num_experts_per_token"],
            routed_scaling_factor=t["routed_scaling_factor"],
            renormalize=t["moe_renormalize"],
            kda_heads=lin["num_heads"],
            kda_head_dim=lin["head_dim"],
            gate_lower_bound=lin["gate_lower_bound"],
            full_attn_layers=tuple(lin["full_attn_layers"]),
            mla_heads=t["num_attention_heads"],
            qk_nope_head_dim=t["qk_nope_head_dim"],
            qk_rope_head_dim=t["qk_rope_head_dim"],
            v_head_dim=t["v_head_dim"],
            kv_lora_rank=t["kv_lora_rank"],
        )


# ---------------------------------------------------------------- elementwise and norms


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|


def silu(x):
    return x * sigmoid(x)


def linear(x, w):
    """Shapes: x [..., in]; w [out, in] -> [..., out]."""
    return x @ w.T


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def situ(g, beta):
    """SiTU: ``b * tanh(g / b) * sigmoid(g)``."""
    return beta * np.tanh(g / beta) * sigmoid(g)


def situ_glu(gate, up, beta, cap):
    """SiTU on the gate branch times the soft-capped up branch ``c * tanh(u / c)``."""
    return situ(gate, beta) * cap * np.tanh(up / cap)


def situ_mlp(x, w, beta, cap):
    """``down(situ(gate x) * c*tanh(up x / c))``; w holds ``{gate,up,down}_proj.weight``."""
    h = situ_glu(linear(x, w["gate_proj.weight"]), linear(x, w["up_proj.weight"]), beta, cap)
    return linear(h, w["down_proj.weight"])


# ---------------------------------------------------------------- KDA


def short_conv(x, weight, state=None):
    """Causal depthwise conv (width W) then SiLU, with a window of the last W-1 inputs.

    Shapes: x [T, C]; weight [C, 1, W]; state [W-1, C] or None (zeros).
    Returns (y [T, C], new state [W-1, C]).
    """
    C, _, W = weight.shape
    T = x.shape[0]
    prev = np.zeros((W - 1, C)) if state is None else state
    xs = np.concatenate([prev, x], axis=0)  # [W-1+T, C]; row W-1+t is token t
    y = np.zeros((T, C))
    for t in range(T):
        y[t] = np.sum(xs[t : t + W].T * weight[:, 0, :], axis=-1)  # tap W-1 is the current one
    return silu(y), xs[T:]


def l2norm(x, eps=L2_EPS):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def kda_gate(g_raw, A_log, dt_bias, lower_bound):
    """Log decay ``lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))``.

    Shapes: g_raw [T, H, K]; A_log [>=H] (first H entries used); dt_bias [H*K].
    """
    _, H, K = g_raw.shape
    a = np.exp(A_log[:H]).reshape(H, 1)
    return lower_bound * sigmoid(a * (g_raw + dt_bias.reshape(H, K)))


def kda_step(S, q, k, v, g, beta):
    """One token of the delta rule with per-channel decay.

    ``S = Diag(exp(g)) S; S = S + beta k (v - S^T k)^T; o = S^T q``.
    Shapes: S [H, K, V]; q, k, g [H, K]; v [H, V]; beta [H]. Returns (o [H, V], S).
    """
    S = S * np.exp(g)[:, :, None]
    pred = np.einsum("hkv,hk->hv", S, k)
    S = S + np.einsum("hk,hv->hkv", k, beta[:, None] * (v - pred))
    return np.einsum("hkv,hk->hv", S, q), S


def kda_sequence(q, k, v, g, beta, S0=None):
    """``kda_step`` over T tokens.

    Shapes: q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; S0 [H, K, V] or None.
    Returns (o [T, H, V], S [H, K, V]).
    """
    T, H, K = k.shape
    S = np.zeros((H, K, v.shape[-1])) if S0 is None else S0
    out = []
    for t in range(T):
        o, S = kda_step(S, q[t], k[t], v[t], g[t], beta[t])
        out.append(o)
    return np.stack(out), S


def head_norm_gate(o, weight, gate, eps):
    """Per-head ``RMSNorm(o) * sigmoid(gate)``. Shapes: o, gate [T, H, V]; weight [V]."""
    return rms_norm(o, weight, eps) * sigmoid(gate)


def kda_attention(x, w, cfg: RefConfig, cache=None):
    """The KDA token mixer.

    ``cache`` is ``None`` or ``(conv_windows, S)`` with ``conv_windows`` a dict
    ``{"q","k","v"} -> [W-1, H*K]`` and ``S`` [H, K, K].
    Shapes: x [T, D]. Returns (y [T, D], new cache).
    """
    T = x.shape[0]
    H, K = cfg.kda_heads, cfg.kda_head_dim
    windows, S = ({}, None) if cache is None else cache
    qkv, new_windows = {}, {}
    for n in ("q", "k", "v"):
        raw = linear(x, w[f"{n}_proj.weight"])
        qkv[n], new_windows[n] = short_conv(raw, w[f"{n}_conv1d.weight"], windows.get(n))
    q = l2norm(qkv["q"].reshape(T, H, K)) * K**-0.5
    k = l2norm(qkv["k"].reshape(T, H, K))
    v = qkv["v"].reshape(T, H, K)
    g_raw = linear(linear(x, w["f_a_proj.weight"]), w["f_b_proj.weight"]).reshape(T, H, K)
    g = kda_gate(g_raw, w["A_log"], w["dt_bias"], cfg.gate_lower_bound)
    beta = sigmoid(linear(x, w["b_proj.weight"]))
    o, S = kda_sequence(q, k, v, g, beta, S)
    gate = linear(x, w["g_proj.weight"]).reshape(T, H, K)
    y = head_norm_gate(o, w["o_norm.weight"], gate, cfg.rms_norm_eps).reshape(T, H * K)
    return linear(y, w["o_proj.weight"]), (new_windows, S)


# ---------------------------------------------------------------- gated NoPE MLA


def mla_attention(x, w, cfg: RefConfig, cache=None):
    """Gated NoPE MLA with causal softmax; decode is ``T = 1`` over a cache.

    The cache holds per token only the normalised latent and the shared key part; keys and
    values are expanded from it with ``kv_b_proj`` (no absorption). Query ``i`` sees cached
    tokens and new tokens up to ``i``.
    ``cache`` is ``None`` or ``(latent [T0, rank], k_shared [T0, pe])``.
    Shapes: x [T, D]. Returns (y [T, D], new cache).
    """
    T = x.shape[0]
    H, nope, pe, vd = cfg.mla_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    r = cfg.kv_lora_rank
    q = linear(
        rms_norm(linear(x, w["q_a_proj.weight"]), w["q_a_layernorm.weight"], MLA_EPS),
        w["q_b_proj.weight"],
    ).reshape(T, H, nope + pe)
    kv = linear(x, w["kv_a_proj_with_mqa.weight"])
    latent = rms_norm(kv[:, :r], w["kv_a_layernorm.weight"], MLA_EPS)
    k_shared = kv[:, r:]
    if cache is not None:
        latent = np.concatenate([cache[0], latent])
        k_shared = np.concatenate([cache[1], k_shared])
    Tk = latent.shape[0]
    kvb = linear(latent, w["kv_b_proj.weight"]).reshape(Tk, H, nope + vd)
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    scores = (
        np.einsum("thd,shd->hts", q[..., :nope], k_nope)
        + np.einsum("thd,sd->hts", q[..., nope:], k_shared)
    ) * (nope + pe) ** -0.5
    pos = Tk - T + np.arange(T)
    scores = np.where(np.arange(Tk)[None, :] <= pos[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = np.einsum("hts,shv->thv", p, v).reshape(T, H * vd)
    y = linear(o * sigmoid(linear(x, w["g_proj.weight"])), w["o_proj.weight"])
    return y, (latent, k_shared)


# ---------------------------------------------------------------- AttnRes


def attn_res_mix(snaps, p, norm_w, proj_w, eps):
    """Softmax mix over the snapshots and the partial sum.

    ``logit_v = (v . (norm_w * proj_w)) / sqrt(mean(v^2) + eps)``; the softmax over the
    vectors weights the raw vectors.
    Shapes: snaps: list of [T, D]; p [T, D]; norm_w [D]; proj_w [1, D]. Returns [T, D].
    """
    vs = np.stack(list(snaps) + [p])  # [n, T, D]
    logits = (vs @ (norm_w * proj_w[0])) / np.sqrt(np.mean(vs * vs, axis=-1) + eps)
    a = np.exp(logits - logits.max(axis=0))
    a /= a.sum(axis=0)
    return np.sum(a[..., None] * vs, axis=0)


# ---------------------------------------------------------------- MXFP4 and LatentMoE


def mxfp4_decode(packed, scales):
    """compressed-tensors MXFP4 -> float64.

    Two E2M1 codes per byte, the even element in the low nibble; bit 3 of a code is the
    sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6. One E8M0 scale ``2^(s-127)`` per 32
    elements; ``s = 255`` is NaN (OCP MX spec).
    Shapes: packed uint8 [O, I/2]; scales uint8 [O, I/32]. Returns [O, I].
    """
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    mag = E2M1[codes & 7]
    vals = np.where(codes & 8, -mag, mag)
    s = scales.astype(np.float64)
    scale = np.where(scales == 255, np.nan, np.exp2(s - 127))
    return vals * np.repeat(scale, 32, axis=-1)


def affine_decode(packed, scales, biases, bits):
    """MLX ``affine`` codes -> float64: ``s q + b`` per group.

    Codes are a little-endian bit stream: weight ``j`` of a row is the ``bits`` bits
    starting at bit ``bits * j`` of the row's bytes (bit ``i`` of byte ``m`` is stream bit
    ``8 m + i``). One scale and bias per group of ``I / scales.shape[1]`` weights.
    Shapes: packed uint32 [O, I * bits / 32]; scales, biases [O, I / group]. Returns [O, I].
    """
    stream = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")
    O, n = stream.shape
    planes = stream.reshape(O, n // bits, bits)
    codes = np.zeros((O, n // bits), np.uint8)
    for i in range(bits):
        codes |= planes[..., i] << i
    G = scales.shape[1]
    groups = codes.reshape(O, G, -1).astype(np.float64)
    out = groups * scales.astype(np.float64)[..., None] + biases.astype(np.float64)[..., None]
    return out.reshape(O, -1)


def route(x, gate_w, bias, top_k, scale, renormalize):
    """Sigmoid router: select by ``score + bias``, weight by the raw scores of the chosen.

    Shapes: x [N, D]; gate_w [E, D]; bias [E].
    Returns (inds [N, k] by descending biased score, weights [N, k], biased [N, E]).
    """
    scores = sigmoid(linear(x, gate_w))
    biased = scores + bias
    inds = np.argsort(-biased, axis=-1, kind="stable")[:, :top_k]
    wts = np.take_along_axis(scores, inds, axis=-1)
    if renormalize:
        wts = wts / wts.sum(axis=-1, keepdims=True)
    return inds, wts * scale, biased


def expert_weights(w, e):
    """Decoded ``(w1, w2, w3)`` of expert ``e`` from ``experts.E.wN.weight_packed/_scale``."""
    return tuple(
        mxfp4_decode(w[f"experts.{e}.{n}.weight_packed"], w[f"experts.{e}.{n}.weight_scale"])
        for n in ("w1", "w2", "w3")
    )


def latent_moe(x, w, cfg: RefConfig):
    """Stable LatentMoE: ``up(RMSNorm(sum_e w_e * GLU_e(down x))) + shared(x)``.

    Shapes: x [N, D]. Returns (out [N, D], inds [N, k], weights [N, k]).
    """
    inds, wts, _ = route(
        x,
        w["gate.weight"],
        w["gate.e_score_correction_bias"],
        cfg.top_k,
        cfg.routed_scaling_factor,
        cfg.renormalize,
    )
    z = linear(x, w["routed_expert_down_proj.weight"])
    decoded = {e: expert_weights(w, e) for e in np.unique(inds)}
    y = np.zeros_like(z)
    for n in range(x.shape[0]):
        for e, we in zip(inds[n], wts[n], strict=True):
            w1, w2, w3 = decoded[e]
            h = situ_glu(linear(z[n], w1), linear(z[n], w3), cfg.situ_beta, cfg.situ_cap)
            y[n] += we * linear(h, w2)
    y = rms_norm(y, w["routed_expert_norm.weight"], cfg.rms_norm_eps)
    shared = situ_mlp(x, sub(w, "shared_experts."), cfg.situ_beta, cfg.situ_cap)
    return linear(y, w["routed_expert_up_proj.weight"]) + shared, inds, wts


# ---------------------------------------------------------------- layer and model


def sub(w: dict, prefix: str) -> dict:
    """The entries of ``w`` under ``prefix``, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}


def decoder_layer(i, p, snaps, w, cfg: RefConfig, cache=None):
    """Layer ``i`` (0-based) with the AttnRes block logic.

    ``h = mix(S, p)``; at a block start append ``p`` to ``S`` and restart ``p`` from zero;
    ``p += attn(input_norm(h))``; ``h = mix(S, p)``; ``p += ffn(post_norm(h))``.
    Shapes: p [T, D]; snaps list of [T, D]. Returns (p, snaps, cache).
    """
    eps = cfg.rms_norm_eps
    h = attn_res_mix(
        snaps, p, w["self_attention_res.norm_weight"], w["self_attention_res.proj_weight"], eps
    )
    if i % cfg.attn_res_block_size == 0:
        snaps = snaps + [p]
        p = np.zeros_like(p)
    attn = mla_attention if (i + 1) in cfg.full_attn_layers else kda_attention
    y, cache = attn(rms_norm(h, w["input_layernorm.weight"], eps), sub(w, "self_attn."), cfg, cache)
    p = p + y
    h = rms_norm(
        attn_res_mix(snaps, p, w["mlp_res.norm_weight"], w["mlp_res.proj_weight"], eps),
        w["post_attention_layernorm.weight"],
        eps,
    )
    if i < cfg.first_k_dense_replace:
        f = situ_mlp(h, sub(w, "mlp."), cfg.situ_beta, cfg.situ_cap)
    else:
        f, _, _ = latent_moe(h, sub(w, "block_sparse_moe."), cfg)
    return p + f, snaps, cache


def model_forward(tokens, w, cfg: RefConfig, caches=None):
    """Embedding -> layers -> output AttnRes mix -> norm -> lm_head.

    ``w`` as returned by ``load_checkpoint`` (names relative to ``language_model.``).
    ``caches``: None, or a list with one entry per layer (None before the first call),
    updated in place.
    Shapes: tokens [T] int. Returns logits [T, vocab].
    """
    m = sub(w, "model.")
    p = m["embed_tokens.weight"][np.asarray(tokens)]
    snaps = []
    for i in range(cfg.num_hidden_layers):
        c = None if caches is None else caches[i]
        p, snaps, c = decoder_layer(i, p, snaps, sub(m, f"layers.{i}."), cfg, c)
        if caches is not None:
            caches[i] = c
    h = attn_res_mix(
        snaps,
        p,
        m["output_attn_res.norm_weight"],
        m["output_attn_res.proj_weight"],
        cfg.rms_norm_eps,
    )
    return linear(rms_norm(h, m["norm.weight"], cfg.rms_norm_eps), w["lm_head.weight"])


_RES_SPELLING = re.compile(r"(self_attention_res|mlp_res|output_attn_res)_(proj|norm)\.weight$")


def load_checkpoint(path) -> tuple[dict, RefConfig]:
    """Every tensor of a checkpoint as numpy: floats as float64, MXFP4 bytes as uint8.

    Names lose the ``language_model.`` prefix; the ``X_proj.weight`` AttnRes spelling
    becomes ``X.proj_weight``.
    """
    path = Path(path)
    cfg = RefConfig.from_dict(json.loads((path / "config.json").read_text()))
    index = CheckpointIndex(path)
    w = {}
    for name, info in index.tensors.items():
        if not name.startswith("language_model."):
            continue
        a = index.read_numpy(name)
        if info.dtype == "BF16":
            a = bf16_to_f32(a)
        if a.dtype.kind == "f":
            a = a.astype(np.float64)
        key = _RES_SPELLING.sub(r"\1.\2_weight", name[len("language_model.") :])
        w[key] = a
    return w, cfg
