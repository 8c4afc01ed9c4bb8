"""The two token mixers of Kimi K3: Kimi Delta Attention and gated NoPE MLA."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from kimi_k3.model.config import ModelArgs
from kimi_k3.model.kda import kda_mix

MLA_NORM_EPS = 1e-6  # the latent norms of MLA use a fixed 1e-6, as in DeepSeek-style MLA


class ConvWeight(nn.Module):
    """A depthwise short-conv kernel in the checkpoint's layout ``[C, 1, W]`` (fp32)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, width), dtype=mx.float32)


class KimiDeltaAttention(nn.Module):
    """KDA token mixer: projections around ``kimi_k3.model.kda.kda_mix``.

    Cache: mlx-lm ``ArraysCache(2)`` holding ``[conv window [B, W-1, 3P], state [B, H, K, K]]``.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        H, K, D = args.kda_heads, args.kda_head_dim, args.hidden_size
        P = H * K
        self.heads, self.head_dim = H, K
        for name in ("q_proj", "k_proj", "v_proj", "g_proj"):
            setattr(self, name, nn.Linear(D, P, bias=False))
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(self, name, ConvWeight(P, args.conv_size))
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.A_log = mx.zeros((H,), dtype=mx.float32)
        self.dt_bias = mx.zeros((P,), dtype=mx.float32)
        self.o_norm = nn.RMSNorm(K, eps=args.rms_norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False)
        self.lower_bound = args.gate_lower_bound
        self.eps = args.rms_norm_eps

    def constants(self) -> dict:
        return {
            "q_conv": self.q_conv1d.weight,
            "k_conv": self.k_conv1d.weight,
            "v_conv": self.v_conv1d.weight,
            "A_log": self.A_log,
            "dt_bias": self.dt_bias,
            "o_norm": self.o_norm.weight,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "lower_bound": self.lower_bound,
            "eps": self.eps,
        }

    def __call__(self, x: mx.array, cache=None) -> mx.array:
        conv_state, state = (None, None) if cache is None else (cache[0], cache[1])
        y, conv_state, state = kda_mix(
            self.constants(),
            self.q_proj(x),
            self.k_proj(x),
            self.v_proj(x),
            self.f_b_proj(self.f_a_proj(x)),
            self.b_proj(x),
            self.g_proj(x),
            conv_state,
            state,
        )
        if cache is not None:
            cache[0], cache[1] = conv_state, state
            if hasattr(cache, "advance"):
                cache.advance(x.shape[1])
        return self.o_proj(y)


def causal_mask(T: int, offset: int) -> mx.array | str:
    """Boolean mask [T, offset+T] letting query i see keys up to offset+i."""
    if offset == 0:
        return "causal"
    return mx.arange(offset + T)[None, :] <= (offset + mx.arange(T))[:, None]


class GatedMLA(nn.Module):
    """Gated NoPE multi-head latent attention.

    Prefill expands the cached latents into per-head keys and values. Decode (one token)
    absorbs ``kv_b_proj`` into the query and the output, so it reads only the cache: a 512-d
    latent and a 64-d shared key per token (mlx-lm ``KVCache``: keys = latent
    [B, 1, T, 512], values = shared key part [B, 1, T, 64]).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        D, H = args.hidden_size, args.num_attention_heads
        self.heads = H
        self.nope, self.pe, self.vdim = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        self.rank = args.kv_lora_rank
        self.scale = (self.nope + self.pe) ** -0.5
        self.q_a_proj = nn.Linear(D, args.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(args.q_lora_rank, eps=MLA_NORM_EPS)
        self.q_b_proj = nn.Linear(args.q_lora_rank, H * (self.nope + self.pe), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.rank + self.pe, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.rank, eps=MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.vdim), bias=False)
        self.o_proj = nn.Linear(H * self.vdim, D, bias=False)
        self.g_proj = nn.Linear(D, H * self.vdim, bias=False)

    def _kv_b(self) -> tuple[mx.array, mx.array]:
        """kv_b_proj as per-head key [H, nope, rank] and value [H, v, rank] maps, dequantized
        where it is quantized (prefill and kimi_k3.trace; decode uses ``_kv_b_matmul``)."""
        w = self.kv_b_proj
        if isinstance(w, nn.QuantizedLinear):
            w = mx.dequantize(w.weight, w.scales, w.get("biases"), w.group_size, w.bits, w.mode)
        else:
            w = w.weight
        return self._per_head(w, "k"), self._per_head(w, "v")

    def _per_head(self, a: mx.array, part: str) -> mx.array:
        """The key (``part`` "k") or value ("v") rows of a kv_b_proj array (weight, or a
        quantized one's packed weight, scales or biases) per head: [H, nope or v, ...]."""
        a = a.reshape(self.heads, self.nope + self.vdim, -1)
        return a[:, : self.nope] if part == "k" else a[:, self.nope :]

    def __call__(self, x: mx.array, cache=None) -> mx.array:
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, T, self.heads, self.nope + self.pe).transpose(0, 2, 1, 3)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., : self.rank])[:, None]  # [B, 1, T, rank]
        k_pe = kv[..., self.rank :][:, None]  # [B, 1, T, pe]
        offset = 0 if cache is None else cache.offset
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        if T == 1:
            o = self._decode(q_nope, q_pe, latent, k_pe, getattr(cache, "mask", None))
        else:
            o = self._prefill(q_nope, q_pe, latent, k_pe, offset)
        o = o.transpose(0, 2, 1, 3).reshape(B, T, -1)
        return self.o_proj(o * mx.sigmoid(self.g_proj(x)))

    def _kv_b_matmul(self, x: mx.array, part: str, transpose: bool) -> mx.array:
        """``x`` times kv_b_proj's per-head key map (``part`` "k": [H, nope, rank]) or value map
        ("v": [H, v, rank]), or its transpose; x broadcasts against the heads. A quantized
        kv_b_proj is multiplied as it is stored (``mx.quantized_matmul``), not dequantized:
        decode's path (one token: dequantizing the 12.6M weights per token and layer at K3's
        shape made the two products 4.5x (bf16) to 23x (fp32) slower on the CPU,
        benchmarks/bench_mla.py)."""
        w = self.kv_b_proj
        if isinstance(w, nn.QuantizedLinear):
            biases = w.get("biases")
            return mx.quantized_matmul(
                x,
                self._per_head(w.weight, part),
                self._per_head(w.scales, part),
                None if biases is None else self._per_head(biases, part),
                transpose=transpose,
                group_size=w.group_size,
                bits=w.bits,
                mode=w.mode,
            )
        m = self._per_head(w.weight, part)
        return x @ (m.swapaxes(-1, -2) if transpose else m)

    def _prefill(self, q_nope, q_pe, latent, k_pe, offset):
        Tk = latent.shape[2]
        # A quantized kv_b_proj is dequantized once per call here, amortised over the call's
        # tokens (MLX's CPU quantized_matmul in bf16 took 16x longer than dequantize + matmul
        # at 128 tokens, benchmarks/bench_mla.py).
        wk, wv = self._kv_b()
        k_nope = latent @ wk.swapaxes(-1, -2)  # [B, H, Tk, nope]
        v = latent @ wv.swapaxes(-1, -2)  # [B, H, Tk, v]
        k_pe = mx.broadcast_to(k_pe, (k_pe.shape[0], self.heads, Tk, self.pe))
        q = mx.concatenate([q_nope, q_pe], axis=-1)
        k = mx.concatenate([k_nope, k_pe], axis=-1)
        mask = causal_mask(q.shape[2], offset)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)

    def _decode(self, q_nope, q_pe, latent, k_pe, mask=None):
        """One token. ``mask`` [B, 1, 1, Tk] (bool, or None for all keys) hides the left
        padding of a batch of sequences of different lengths (``kimi_k3.serve.engine``)."""
        q_lat = self._kv_b_matmul(q_nope, "k", transpose=False)  # the key map into the query
        s = q_lat @ latent.swapaxes(-1, -2) + q_pe @ k_pe.swapaxes(-1, -2)
        s = s.astype(mx.float32) * self.scale
        if mask is not None:
            s = mx.where(mask, s, -mx.inf)
        p = mx.softmax(s, axis=-1, precise=True)
        o_lat = p.astype(latent.dtype) @ latent
        return self._kv_b_matmul(o_lat, "v", transpose=True)  # the value map into the output
