"""KDA decode: one launch per layer per token for the whole token mixer after the projections.

One threadgroup per (batch, head) of ``R * K`` threads. It updates the q/k/v conv windows and
applies SiLU, L2-normalises q and k, computes the gates (alpha = exp(g), beta), updates the fp32
state (read once, written once) and reads it out, then applies the per-head RMSNorm times the
sigmoid output gate. Thread ``(r, v)`` owns column ``v`` of the state for rows
``r*KR .. r*KR+KR-1`` and keeps them in registers between the read and the write.

Using ``o = S'^T q = (alpha*S)^T q + delta (q.k)`` the readout needs no second pass over S.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from .source import Instance, Kernel, as_dtype, constant

ROWS_PER_THREAD = 32  # KR: state rows a thread keeps in registers

BODY = """
  constexpr int P = H * K;          // channels of q (and of k, v)
  constexpr int R = K / KR;         // row groups
  constexpr int NT = R * K;         // threads per threadgroup
  const uint t = THREAD_INDEX;
  const uint bh = GROUP_POS.x;
  const uint b = bh / H;
  const uint h = bh % H;

  SHARED float s_qkv[3 * K];        // conv + SiLU outputs: q, k, v of this head
  SHARED float s_alpha[K];
  SHARED float s_part[2 * R * K];   // per-row-group partial k.S and q.S
  SHARED float s_out[K];
  SHARED float s_sc[8];             // |q|^2, |k|^2, q.k, beta, 1/rms

  // The state's loads go out first, so their latency overlaps everything before its use.
  const uint r = t / K;
  const uint v = t % K;
  const DEVICE float* S = state + (size_t)bh * K * K;
  float s[KR];
#pragma unroll
  for (int j = 0; j < KR; ++j) s[j] = S[(r * KR + j) * K + v];

  // Conv windows: new window = last W-2 old inputs + this token; output SiLU(w . window).
  for (uint i = t; i < 3 * K; i += NT) {
    const uint which = i / K;
    const uint c = h * K + i % K;
    const DEVICE T* x_in = which == 0 ? x_q : (which == 1 ? x_k : x_v);
    const DEVICE float* w = (which == 0 ? q_conv : (which == 1 ? k_conv : v_conv)) + c * W;
    const uint col = which * P + c;
    const uint base = b * (W - 1) * 3 * P;
    float acc = 0.0f;
    for (int j = 0; j < W - 1; ++j) {
      T old = conv_state[base + j * 3 * P + col];
      acc += static_cast<float>(old) * w[j];
      if (j > 0) conv_out[base + (j - 1) * 3 * P + col] = old;
    }
    T xt = x_in[b * P + c];
    acc += static_cast<float>(xt) * w[W - 1];
    conv_out[base + (W - 2) * 3 * P + col] = xt;
    float y = acc / (1.0f + EXP(-acc));
    s_qkv[i] = static_cast<float>(static_cast<T>(y));  // the reference rounds to T here
  }
  // Gates: g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias)), alpha = exp(g).
  const float a_h = EXP(A_log[h]);
  for (uint i = t; i < K; i += NT) {
    const uint c = h * K + i;
    float z = a_h * (static_cast<float>(g_raw[b * P + c]) + dt_bias[c]);
    s_alpha[i] = EXP(params[0] / (1.0f + EXP(-z)));
  }
  if (t == 0) s_sc[3] = 1.0f / (1.0f + EXP(-static_cast<float>(b_logits[b * H + h])));
  BARRIER();

  // |q|^2, |k|^2 and q.k, one simdgroup each.
  for (uint j = SIMDGROUP; j < 3; j += NT / 32) {
    float acc = 0.0f;
    for (uint i = LANE; i < K; i += 32) {
      float u = s_qkv[(j == 1 ? K : 0) + i];
      float w = s_qkv[(j == 0 ? 0 : K) + i];
      acc += u * w;
    }
    acc = SIMD_SUM(acc);
    if (LANE == 0) s_sc[j] = acc;
  }
  BARRIER();

  const float rq = RSQRT(s_sc[0] + 1e-6f) * RSQRT(static_cast<float>(K));
  const float rk = RSQRT(s_sc[1] + 1e-6f);
  const float beta = s_sc[3];
  float pred = 0.0f, oq = 0.0f;
#pragma unroll
  for (int j = 0; j < KR; ++j) {
    const uint row = r * KR + j;
    s[j] *= s_alpha[row];
    pred += s_qkv[K + row] * s[j];
    oq += s_qkv[row] * s[j];
  }
  s_part[r * K + v] = pred;
  s_part[(R + r) * K + v] = oq;
  BARRIER();

  pred = 0.0f;
  oq = 0.0f;
  for (int j = 0; j < R; ++j) {
    pred += s_part[j * K + v];
    oq += s_part[(R + j) * K + v];
  }
  const float delta = beta * (s_qkv[2 * K + v] - pred * rk);
  DEVICE float* S_out = state_out + (size_t)bh * K * K;
#pragma unroll
  for (int j = 0; j < KR; ++j) {
    const uint row = r * KR + j;
    S_out[row * K + v] = s[j] + s_qkv[K + row] * rk * delta;
  }
  if (r == 0) s_out[v] = oq * rq + delta * s_sc[2] * rq * rk;
  BARRIER();

  // Per-head RMSNorm times sigmoid(gate).
  if (SIMDGROUP == 0) {
    float acc = 0.0f;
    for (uint i = LANE; i < K; i += 32) acc += s_out[i] * s_out[i];
    acc = SIMD_SUM(acc);
    if (LANE == 0) s_sc[4] = RSQRT(acc / K + params[1]);
  }
  BARRIER();
  for (uint i = t; i < K; i += NT) {
    const uint c = b * P + h * K + i;
    float gt = static_cast<float>(gate[c]);
    y[c] = static_cast<T>(s_out[i] * s_sc[4] * o_norm[i] / (1.0f + EXP(-gt)));
  }
"""

INPUTS = [
    "x_q",
    "x_k",
    "x_v",
    "g_raw",
    "b_logits",
    "gate",
    "conv_state",
    "state",
    "q_conv",
    "k_conv",
    "v_conv",
    "A_log",
    "dt_bias",
    "o_norm",
    "params",
]
OUTPUTS = ["y", "conv_out", "state_out"]


def _instance(dtype, H, K, W=4):
    f32 = mx.float32
    return Instance([dtype] * 7 + [f32] * 8, [dtype, dtype, f32], template(dtype, H, K, W))


def template(dtype, H, K, W):
    return [("T", dtype), ("H", H), ("K", K), ("W", W), ("KR", min(K, ROWS_PER_THREAD))]


KDA_DECODE = Kernel(
    "kda_decode",
    INPUTS,
    OUTPUTS,
    BODY,
    instances=[_instance(dt, 96, 128) for dt in (mx.bfloat16, mx.float32)],
)


def eligible(heads: int, head_dim: int) -> bool:
    """Shapes the kernel serves: whole simdgroups and at most 1024 threads."""
    kr = min(head_dim, ROWS_PER_THREAD)
    return head_dim % 32 == 0 and head_dim % kr == 0 and head_dim * head_dim // kr <= 1024


_WEIGHTS = ("q_conv", "k_conv", "v_conv", "A_log", "dt_bias", "o_norm")
_LAYERS: dict = {}  # (id of q_conv, dtype) -> (weak refs to the weights, scalars, inputs)


def _layer_inputs(p: dict, dt) -> list:
    """The layer's fp32 weights and scalar params, converted and built once per layer.

    Keyed by the identity of the layer's weight arrays (the model builds a fresh ``p`` per
    call), and reused only while those very arrays are alive (weak references) with the same
    scalars, so a changed or new layer rebuilds it and the cache keeps no weight alive.
    """
    found = [p[n] for n in _WEIGHTS]
    scalars = (p["lower_bound"], p["eps"])
    key = (id(found[0]), dt)
    hit = _LAYERS.get(key)
    if hit is None or hit[1] != scalars or any(ref() is not w for ref, w in zip(hit[0], found)):
        if len(_LAYERS) > 1024:
            _LAYERS.clear()
        refs = [weakref.ref(w) for w in found]
        hit = _LAYERS[key] = (
            refs,
            scalars,
            [as_dtype(w, mx.float32) for w in found] + [constant(scalars)],
        )
    return hit[2]


_LAUNCH: dict = {}  # (backend, dtype, B, H, K, W, rows per thread) -> launch arguments


def _launch(backend, dt, B, H, K, W):
    key = (backend, dt, B, H, K, W, ROWS_PER_THREAD)
    hit = _LAUNCH.get(key)
    if hit is None:
        tpl = template(dt, H, K, W)
        nt = K * K // tpl[-1][1]
        P = H * K
        hit = _LAUNCH[key] = dict(
            output_shapes=[(B, 1, P), (B, W - 1, 3 * P), (B, H, K, K)],
            output_dtypes=[dt, dt, mx.float32],
            grid=(nt * B * H, 1, 1),
            threadgroup=(nt, 1, 1),
            template=tpl,
        )
    return hit


def kda_decode(backend: str, p: dict, x_q, x_k, x_v, g_raw, b_logits, gate, conv_state, state):
    """One decode step (T = 1) of ``kimi_k3.kda.kda_mix_reference``, in one launch.

    Shapes as ``kda_mix_reference`` with T = 1: x_*, g_raw, gate [B, 1, H*K]; b_logits [B, 1, H];
    conv_state [B, W-1, 3*H*K] or None; state [B, H, K, K] fp32 or None. Per call it only
    gathers the inputs: weights, scalars and launch arguments are built once per layer/shape.
    """
    B, _, P = x_q.shape
    H, K = p["heads"], p["head_dim"]
    W = p["q_conv"].shape[-1]
    dt = x_q.dtype
    if conv_state is None:
        conv_state = mx.zeros((B, W - 1, 3 * P), dtype=dt)
    if state is None:
        state = mx.zeros((B, H, K, K), dtype=mx.float32)
    acts = [x_q, x_k, x_v, g_raw, b_logits, gate, conv_state]
    if any(a.dtype != dt for a in acts):
        acts = [as_dtype(a, dt) for a in acts]
    if state.dtype != mx.float32:
        state = state.astype(mx.float32)
    launch = _launch(backend, dt, B, H, K, W)
    return KDA_DECODE.get(backend)(inputs=acts + [state] + _layer_inputs(p, dt), **launch)
