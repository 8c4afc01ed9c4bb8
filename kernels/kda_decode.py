"""KDA decode: one launch per layer per token for the whole token mixer after the projections.

One threadgroup per (batch, head) of ``R * K`` threads (512 at K = 128). It updates the q/k/v
conv windows and applies SiLU, computes the gates (alpha = exp(g), beta), L2-normalises q and
k, updates the fp32 state (read once, written once) and reads it out, then applies the
per-head RMSNorm times the sigmoid output gate. Two barriers in all.

The R consecutive threads of one simdgroup share state column ``v``; thread ``(v, r)`` keeps
rows ``4 (R m + r) + e`` (``m < K / 4R``, ``e < 4``) in registers between the read and the
write, so it reads alpha, k and q of four rows as one float4 from threadgroup memory (the R
threads of a column hit consecutive float4s: no bank conflicts), and the column's partial
k.S and q.S are summed with shuffles, not through threadgroup memory and a barrier. Using
``o = S'^T q = (alpha*S)^T q + delta (q.k)`` the readout needs no second pass over S.

Inputs: the six activations, the conv window, the state, and ``packed``: the layer's fp32
weights and scalars in one array (fewer inputs make MLX's per-call host cost smaller), built
once per layer by ``_layer`` and read at offsets computed from H, K and W:

    q_conv, k_conv, v_conv [3, H*K, W] | A_log [H] | dt_bias [H*K] | o_norm [K] | lower_bound, eps
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from .source import VEC4_HELPERS, Instance, Kernel, as_dtype

# R: threads per state column, each keeping K / R rows in registers (32 at K = 128: 512
# threads, 96 registers). R = 8 (1024 threads, 16 rows, 56 registers) also runs, but is
# slower on the H200 (its simdgroups read and write the state in 16-byte pieces of a 32-byte
# sector; docs/benchmarks.md#kda-decode-parameters), so 4 it is; R must be a power of two >= 4.
ROW_GROUPS = 4

BODY = """
  constexpr int P = H * K;          // channels of q (and of k, v)
  constexpr int M = K / (4 * R);    // float4 row blocks per thread (K / R state rows)
  constexpr int NT = R * K;         // threads per threadgroup
  constexpr int NW = NT / 32;       // simdgroups
  // Offsets into packed: conv weights [3][P][W], A_log [H], dt_bias [P], o_norm [K], params.
  constexpr int A_LOG = 3 * P * W;
  constexpr int DT_BIAS = A_LOG + H;
  constexpr int O_NORM = DT_BIAS + P;
  constexpr int PARAMS = O_NORM + K;  // lower_bound, eps
  const uint t = THREAD_INDEX;
  const uint bh = GROUP_POS.x;
  const uint b = bh / H;
  const uint h = bh % H;
  const uint r = t % R;             // row group
  const uint v = t / R;             // state column

  SHARED float4 s_qka[3 * K / 4];   // q, k (conv + SiLU) and alpha of this head, by 4 rows
  SHARED float s_v[K];
  SHARED float s_beta[1];
  SHARED float s_oo[NW];            // per-simdgroup sums of o^2

  // One item per thread (none from 4K on): the conv + SiLU of a q, k or v channel, or the
  // alpha of one row.
  static_assert(R >= 4, "one thread per q/k/v channel and per alpha");
  const uint which = t / K;         // 0 q, 1 k, 2 v, 3 alpha: one per simdgroup
  const uint c = h * K + t % K;
  const uint col = which * P + c;   // conv window column
  const uint base = b * (W - 1) * 3 * P;
  T win[W];                         // the conv window: W-1 old inputs, then this token
  float wc[W];                      // its weights
  float g_in = 0.0f, a_h = 0.0f, b_in = 0.0f;
  if (which < 3) {
    for (int j = 0; j < W - 1; ++j) win[j] = conv_state[base + j * 3 * P + col];
    win[W - 1] = (which == 0 ? x_q : (which == 1 ? x_k : x_v))[b * P + c];
    for (int j = 0; j < W; ++j) wc[j] = packed[col * W + j];
  } else if (which == 3) {
    g_in = static_cast<float>(g_raw[b * P + c]) + packed[DT_BIAS + c];
    a_h = packed[A_LOG + h];
    if (t == 3 * K) b_in = static_cast<float>(b_logits[b * H + h]);
  }

  // What the column's first thread needs at the end to write y.
  const uint c_out = b * P + h * K + v;
  const float gt = r == 0 ? static_cast<float>(gate[c_out]) : 0.0f;
  const float on = r == 0 ? packed[O_NORM + v] : 0.0f;

  // Conv: the new window is the last W-1 entries of this one; output SiLU(w . window),
  // rounded to T as the reference does. Gate: g = lower_bound * sigmoid(exp(A_log) * g_in),
  // alpha = exp(g); beta = sigmoid(b).
  float f = 0.0f;                  // this item's value
  if (which < 3) {
    float acc = 0.0f;
    for (int j = 0; j < W; ++j) acc += static_cast<float>(win[j]) * wc[j];
    for (int j = 1; j < W; ++j) conv_out[base + (j - 1) * 3 * P + col] = win[j];
    f = static_cast<float>(static_cast<T>(acc / (1.0f + EXP(-acc))));
  } else if (which == 3) {
    f = EXP(packed[PARAMS] / (1.0f + EXP(-EXP(a_h) * g_in)));
    if (t == 3 * K) s_beta[0] = 1.0f / (1.0f + EXP(-b_in));
  }
  // Lane 4n gathers the channels of lanes 4n+1..4n+3 into one float4.
  const float f1 = SIMD_SHUFFLE_DOWN(f, 1);
  const float f2 = SIMD_SHUFFLE_DOWN(f, 2);
  const float f3 = SIMD_SHUFFLE_DOWN(f, 3);
  if (which == 2) {
    s_v[t % K] = f;
  } else if (which < 4 && t % 4 == 0) {
    s_qka[(which == 3 ? 2 : which) * (K / 4) + t % K / 4] = FLOAT4(f, f1, f2, f3);
  }
  // The state: thread (v, r) keeps rows 4 (R m + r) + e of column v. Its loads go out only
  // now: issued before the conv loads they delay those (docs/benchmarks.md#kda-decode-parameters),
  // while the barrier and the norms below still overlap them.
  const DEVICE float* S = state + (size_t)bh * K * K + v;
  float4 s[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const DEVICE float* Sm = S + 4 * (R * m + r) * K;
    s[m] = FLOAT4(Sm[0], Sm[K], Sm[2 * K], Sm[3 * K]);
  }
  BARRIER();

  // |q|^2, |k|^2 and q.k: every simdgroup sums them itself, so no barrier follows.
  float qq = 0.0f, kk = 0.0f, qk = 0.0f;
  for (uint i = LANE; i < K / 4; i += 32) {
    const float4 q4 = s_qka[i];
    const float4 k4 = s_qka[K / 4 + i];
    qq += kk_dot4(q4, q4);
    kk += kk_dot4(k4, k4);
    qk += kk_dot4(q4, k4);
  }
  qq = SIMD_SUM(qq);
  kk = SIMD_SUM(kk);
  qk = SIMD_SUM(qk);
  const float rq = RSQRT(qq + 1e-6f) * RSQRT(static_cast<float>(K));
  const float rk = RSQRT(kk + 1e-6f);
  const float beta = s_beta[0];

  // alpha S, and this thread's part of k.S and q.S; then the column's sum over its R threads.
  float pred = 0.0f, oq = 0.0f;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const uint blk = R * m + r;       // rows 4 blk .. 4 blk + 3
    s[m] = kk_mul4(s[m], s_qka[K / 2 + blk]);
    pred += kk_dot4(s_qka[K / 4 + blk], s[m]);
    oq += kk_dot4(s_qka[blk], s[m]);
  }
  for (uint o = 1; o < R; o <<= 1) {
    pred += SIMD_SHUFFLE_XOR(pred, o);
    oq += SIMD_SHUFFLE_XOR(oq, o);
  }
  const float delta = beta * (s_v[v] - pred * rk);
  const float kd = rk * delta;
  DEVICE float* S_out = state_out + (size_t)bh * K * K + v;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float4 n = kk_fma4(kd, s_qka[K / 4 + R * m + r], s[m]);
    DEVICE float* Sm = S_out + 4 * (R * m + r) * K;
    Sm[0] = n.x;
    Sm[K] = n.y;
    Sm[2 * K] = n.z;
    Sm[3 * K] = n.w;
  }

  // Per-head RMSNorm times sigmoid(gate), written by each column's first thread.
  const float o = oq * rq + delta * qk * rq * rk;
  const float oo = SIMD_SUM(r == 0 ? o * o : 0.0f);
  if (LANE == 0) s_oo[SIMDGROUP] = oo;
  BARRIER();
  const float ss = SIMD_SUM(LANE < NW ? s_oo[LANE] : 0.0f);
  const float rms = RSQRT(ss / K + packed[PARAMS + 1]);
  if (r == 0) y[c_out] = static_cast<T>(o * rms * on / (1.0f + EXP(-gt)));
"""

INPUTS = ["x_q", "x_k", "x_v", "g_raw", "b_logits", "gate", "conv_state", "state", "packed"]
OUTPUTS = ["y", "conv_out", "state_out"]


def _instance(dtype, H, K, W=4):
    f32 = mx.float32
    return Instance([dtype] * 7 + [f32] * 2, [dtype, dtype, f32], template(dtype, H, K, W))


def template(dtype, H, K, W):
    return [("T", dtype), ("H", H), ("K", K), ("W", W), ("R", ROW_GROUPS)]


KDA_DECODE = Kernel(
    "kda_decode",
    INPUTS,
    OUTPUTS,
    BODY,
    header=VEC4_HELPERS,
    instances=[_instance(dt, 96, 128) for dt in (mx.bfloat16, mx.float32)],
)


def eligible(heads: int, head_dim: int) -> bool:
    """Shapes the kernel serves: whole simdgroups, float4 row blocks, at most 1024 threads
    and at most 32 state rows per thread (registers)."""
    R = ROW_GROUPS
    return (
        head_dim % 32 == 0
        and head_dim % (4 * R) == 0
        and head_dim * R <= 1024
        and head_dim <= 32 * R
    )


_WEIGHTS = ("q_conv", "k_conv", "v_conv", "A_log", "dt_bias", "o_norm")
_LAYERS: dict = {}  # id of q_conv -> (scalars, weak refs to the weights, [packed], W)


def _layer(p: dict) -> tuple:
    """The layer's cache entry ``(scalars, weak refs, [packed], W)``: its weights and scalar
    params in one fp32 array (layout in the module docstring), built once per layer.

    Keyed by the identity of the layer's weight arrays (the model builds a fresh ``p`` per
    call), and reused only while those very arrays are alive (weak references) with the same
    scalars, so a changed or new layer rebuilds it and the cache keeps no weight alive. The
    check runs every call, so it is written out plainly (no generators).
    """
    q_conv = p["q_conv"]
    hit = _LAYERS.get(id(q_conv))
    if hit is not None and hit[0] == (p["lower_bound"], p["eps"]):
        for ref, name in zip(hit[1], _WEIGHTS):
            if ref() is not p[name]:
                break
        else:
            return hit
    if len(_LAYERS) > 1024:
        _LAYERS.clear()
    found = [p[n] for n in _WEIGHTS]
    scalars = (p["lower_bound"], p["eps"])
    parts = [as_dtype(w, mx.float32).reshape(-1) for w in found]
    parts.append(mx.array([float(x) for x in scalars], dtype=mx.float32))
    refs = [weakref.ref(w) for w in found]
    hit = _LAYERS[id(q_conv)] = (scalars, refs, [mx.concatenate(parts)], q_conv.shape[-1])
    return hit


def _layer_inputs(p: dict) -> list:
    """``[packed]``, the kernel's last input, for layer ``p`` (cached: ``_layer``)."""
    return _layer(p)[2]


_LAUNCH: dict = {}  # (backend, dtype, B, H, K, W, row groups) -> launch arguments


def _launch(backend, dt, B, H, K, W):
    key = (backend, dt, B, H, K, W, ROW_GROUPS)
    hit = _LAUNCH.get(key)
    if hit is None:
        tpl = template(dt, H, K, W)
        nt = K * ROW_GROUPS
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
    """One decode step (T = 1) of ``kimi_k3.model.kda.kda_mix_reference``, in one launch.

    Shapes as ``kda_mix_reference`` with T = 1: x_*, g_raw, gate [B, 1, H*K]; b_logits [B, 1, H];
    conv_state [B, W-1, 3*H*K] or None; state [B, H, K, K] fp32 or None. Per call it only
    gathers the inputs: weights, scalars and launch arguments are built once per layer/shape.
    """
    B, _, P = x_q.shape
    H, K = p["heads"], p["head_dim"]
    _, _, packed, W = _layer(p)
    dt = x_q.dtype
    if conv_state is None:
        conv_state = mx.zeros((B, W - 1, 3 * P), dtype=dt)
    if state is None:
        state = mx.zeros((B, H, K, K), dtype=mx.float32)
    acts = [x_q, x_k, x_v, g_raw, b_logits, gate, conv_state]
    # written out: a generator over the seven dtypes costs microseconds per call
    if not (
        x_k.dtype == dt
        and x_v.dtype == dt
        and g_raw.dtype == dt
        and b_logits.dtype == dt
        and gate.dtype == dt
        and conv_state.dtype == dt
    ):
        acts = [as_dtype(a, dt) for a in acts]
    if not state.dtype == mx.float32:
        state = state.astype(mx.float32)
    acts.append(state)
    acts += packed
    return KDA_DECODE.get(backend)(inputs=acts, **_launch(backend, dt, B, H, K, W))
