"""KDA prefill: the chunkwise recurrence (chunk 64, 16-token sub-blocks) in two kernels.

``kda_chunk_prep`` runs on every (batch, head, chunk) at once. For one 64-token chunk, with G
the in-chunk cumulative sum of g (``kimi_k3.kda.kda_chunked`` has the algebra):

    Aqk = lower(q_i . k_j exp(G_i - G_j))          Qd = exp(G) q,  Kd = exp(G_last - G) k
    L   = strict_lower(beta_i k_i . k_j exp(G_i - G_j)),  X = (I + L)^-1
    W   = X (beta exp(G) k),  U = X (beta v),  decay = exp(G_last)

Scores use a reference row per 16-row sub-block (the first one), so every exponent is a
difference of cumulative sums: <= 0, or at most one sub-block's decay inside the diagonal.

``kda_chunk_state`` carries the state through the chunks in order, one threadgroup per
(batch, head, 32 state columns), the state in registers:

    V' = U - W S,   O = Qd S + Aqk V',   S = decay * S + Kd^T V'

Any T works: rows past the end of the input are zero (zero g, k, v, beta leave S alone).
"""

from __future__ import annotations

import mlx.core as mx

from .source import VEC4_HELPERS, Instance, Kernel

CHUNK = 64

PREP_BODY = """
  constexpr int C = 64;             // chunk
  constexpr int DT = 16;            // channels per pass-1 tile
  constexpr int NT = 256;           // threads
  constexpr int RQ = DT / 4 + 1;    // float4 per padded tile row (the pad avoids bank conflicts)
  // sm4 regions, in float4. Pass 1: q, k, G tiles; left factors of a sub-block; right factors;
  // scan partials. Pass 2: L, one row of 16 float4 per chunk row (zero on and above the diagonal).
  constexpr int OQ = 0, OK = C * RQ, OG = 2 * C * RQ, OLQ = 3 * C * RQ, OLK = OLQ + 16 * RQ;
  constexpr int ORK = OLK + 16 * RQ, OSEG = ORK + C * RQ, OL = 0;
  SHARED float4 sm4[OSEG + 64];
  SHARED float s_beta[C];

  const int T = dims[0];
  const int N = dims[1];
  const uint t = THREAD_INDEX;
  const uint n = GROUP_POS.x % N;
  const uint bh = GROUP_POS.x / N;
  const uint b = bh / H;
  const uint h = bh % H;
  const int t0 = n * C;
  const int rows = T - t0 < C ? T - t0 : C;         // valid rows in this chunk
  const size_t tok = (size_t)H * K;                 // token stride of q, k, v, g
  const size_t in0 = ((size_t)b * T + t0) * tok + h * K;
  const size_t ch = (size_t)bh * N + n;
  DEVICE float* W_out = Wc + ch * C * K;
  DEVICE float* U_out = Uc + ch * C * K;

  if (t < C) s_beta[t] = (int)t < rows ? beta[((size_t)b * T + t0 + t) * H + h] : 0.0f;

  // Entry (i, j) = (16 I + ii, 16 m + jj) of both score matrices lives in acc[I * 4 + m].
  const uint ii = t / 16;
  const uint jj = t % 16;
  float accq[16];
  float acck[16];
  for (int e = 0; e < 16; ++e) {
    accq[e] = 0.0f;
    acck[e] = 0.0f;
  }
  const uint row = t / 4;       // this thread's tile row and float4 column
  const uint dq = t % 4;

  for (int d0 = 0; d0 < K; d0 += DT) {
    {
      const size_t src = in0 + row * tok + d0 + 4 * dq;
      const bool ok = (int)row < rows;
      sm4[OQ + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(q + src) : kk_zero4();
      sm4[OK + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(k + src) : kk_zero4();
      sm4[OG + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(g + src) : kk_zero4();
    }
    BARRIER();
    // Cumulative sum down the rows: 16 segments of 4 rows, one thread per (segment, float4).
    if (t < 64) {
      float4 run = kk_zero4();
      for (uint r = 0; r < 4; ++r) run = kk_add4(run, sm4[OG + (4 * row + r) * RQ + dq]);
      sm4[OSEG + t] = run;
    }
    BARRIER();
    if (t < 64) {
      float4 off = kk_zero4();
      for (uint s2 = 0; s2 < row; ++s2) off = kk_add4(off, sm4[OSEG + 4 * s2 + dq]);
      for (uint r = 0; r < 4; ++r) {
        off = kk_add4(off, sm4[OG + (4 * row + r) * RQ + dq]);
        sm4[OG + (4 * row + r) * RQ + dq] = off;
      }
    }
    BARRIER();
    {
      const float4 G = sm4[OG + row * RQ + dq];
      const float4 G_last = sm4[OG + (C - 1) * RQ + dq];
      const float4 eG = kk_exp4(G);
      const float4 kv = sm4[OK + row * RQ + dq];
      const size_t o = ch * C * K + row * K + d0 + 4 * dq;
      *reinterpret_cast<DEVICE float4*>(Qd + o) = kk_mul4(sm4[OQ + row * RQ + dq], eG);
      *reinterpret_cast<DEVICE float4*>(Kd + o) = kk_mul4(kv, kk_exp4(kk_sub4(G_last, G)));
      // beta exp(G) k, solved into W in pass 2
      *reinterpret_cast<DEVICE float4*>(Wc + o) = kk_scale4(s_beta[row], kk_mul4(kv, eG));
      if (t < 4) *reinterpret_cast<DEVICE float4*>(decay + ch * K + d0 + 4 * t) = kk_exp4(G_last);
    }

#pragma unroll
    for (int I = 0; I < 4; ++I) {
      const int r0 = I * 16;              // reference row of sub-block I
      if (t < 64) {                       // left factors exp(G_i - G_r) of its 16 rows
        const uint i = r0 + row;
        const float4 f = kk_exp4(kk_sub4(sm4[OG + i * RQ + dq], sm4[OG + r0 * RQ + dq]));
        sm4[OLQ + row * RQ + dq] = kk_mul4(sm4[OQ + i * RQ + dq], f);
        sm4[OLK + row * RQ + dq] = kk_mul4(sm4[OK + i * RQ + dq], f);
      }
      if ((int)row < r0 + 16) {           // right factors exp(G_r - G_j), columns up to its end
        const float4 f = kk_exp4(kk_sub4(sm4[OG + r0 * RQ + dq], sm4[OG + row * RQ + dq]));
        sm4[ORK + row * RQ + dq] = kk_mul4(sm4[OK + row * RQ + dq], f);
      }
      BARRIER();
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        if (m <= I) {
          const uint j = m * 16 + jj;
          float aq = 0.0f, ak = 0.0f;
#pragma unroll
          for (int c = 0; c < DT / 4; ++c) {
            const float4 rk = sm4[ORK + j * RQ + c];
            aq += kk_dot4(sm4[OLQ + ii * RQ + c], rk);
            ak += kk_dot4(sm4[OLK + ii * RQ + c], rk);
          }
          accq[I * 4 + m] += aq;
          acck[I * 4 + m] += ak;
        }
      }
      BARRIER();
    }
  }

  // Aqk (lower, with the diagonal) out; L = beta_i * (k scores), strictly lower, to sm4.
#define KK_SET_L(i, j, val)                                  \\
  switch ((j) & 3) {                                         \\
    case 0: sm4[OL + (i) * 16 + (j) / 4].x = (val); break;   \\
    case 1: sm4[OL + (i) * 16 + (j) / 4].y = (val); break;   \\
    case 2: sm4[OL + (i) * 16 + (j) / 4].z = (val); break;   \\
    default: sm4[OL + (i) * 16 + (j) / 4].w = (val); break;  \\
  }
#pragma unroll
  for (int I = 0; I < 4; ++I) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const uint i = I * 16 + ii;
      const uint j = m * 16 + jj;
      Aqk[ch * C * C + i * C + j] = j <= i ? accq[I * 4 + m] : 0.0f;
      KK_SET_L(i, j, j < i ? s_beta[i] * acck[I * 4 + m] : 0.0f);
    }
  }
#undef KK_SET_L
  // Pass 1 wrote W_out (beta exp(G) k) by rows; pass 2 reads it by columns.
  BARRIER_DEVICE();

  // Pass 2: solve (I + L) X = RHS down the chunk, one column per thread, the column in
  // registers: W (RHS = beta exp(G) k) for t < K, U (RHS = beta v) for K <= t < 2K.
  if ((int)t < 2 * K) {
    const uint d = t % K;
    const bool is_w = (int)t < K;
    DEVICE float* out = is_w ? W_out : U_out;
    float x[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      x[i] = is_w ? W_out[i * K + d] : (i < rows ? s_beta[i] * v[in0 + i * tok + d] : 0.0f);
    }
#pragma unroll
    for (int i = 1; i < C; ++i) {
      float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
      for (int j4 = 0; j4 < (i + 3) / 4; ++j4) {   // L is zero from the diagonal on
        const float4 l = sm4[OL + i * 16 + j4];
        a0 += l.x * x[4 * j4] + l.y * x[4 * j4 + 1];
        a1 += l.z * x[4 * j4 + 2] + l.w * x[4 * j4 + 3];
      }
      x[i] -= a0 + a1;
    }
#pragma unroll
    for (int i = 0; i < C; ++i) out[i * K + d] = x[i];
  }
"""

STATE_BODY = """
  constexpr int C = 64;
  constexpr int VT = 32;            // state columns per threadgroup
  constexpr int NT = 128;           // threads: 16 row groups x 8 column quads
  constexpr int KM = K / 16;        // state rows per thread (a multiple of 4)
  constexpr int ST = 8;             // rows staged per step
  constexpr int CP = C / 4 + 1;     // float4 per padded staged row of C values
  SHARED float4 sS[K * VT / 4];     // S of the chunk start [K][VT]
  SHARED float4 sV[C * VT / 4];     // V' [C][VT]
  SHARED float4 st[2 * ST * CP];    // staged W^T and Qd^T slices, A^T slices, Kd rows

  const int T = dims[0];
  const int N = dims[1];
  const uint t = THREAD_INDEX;
  const uint tr = t / 8;            // row group: chunk rows 4tr.., state rows KM tr..
  const uint tc = t % 8;            // column quad: columns 4tc.. of the tile
  const uint nvt = K / VT;
  const uint vt = GROUP_POS.x % nvt;
  const uint bh = GROUP_POS.x / nvt;
  const uint b = bh / H;
  const uint h = bh % H;
  const uint col = vt * VT + 4 * tc;      // first state column of this thread
  const uint i0 = 4 * tr;
  const uint k0 = KM * tr;

  float4 S[KM];
#pragma unroll
  for (int a = 0; a < KM; ++a) {
    S[a] = *reinterpret_cast<const DEVICE float4*>(state + ((size_t)bh * K + k0 + a) * K + col);
    sS[(k0 + a) * (VT / 4) + tc] = S[a];
  }

  for (int n = 0; n < N; ++n) {
    const size_t ch = (size_t)bh * N + n;
    const DEVICE float* Wn = Wc + ch * C * K;
    const DEVICE float* Qn = Qd + ch * C * K;
    const DEVICE float* Kn = Kd + ch * C * K;
    const DEVICE float* Un = Uc + ch * C * K;
    const DEVICE float* An = Aqk + ch * C * C;

    // P1 = W S and P2 = Qd S for rows i0.. and columns col..: W^T, Qd^T staged ST rows at a time.
    float4 P1[4];
    float4 P2[4];
    for (int a = 0; a < 4; ++a) {
      P1[a] = kk_zero4();
      P2[a] = kk_zero4();
    }
    for (int s0 = 0; s0 < K; s0 += ST) {
      {
        const uint kk = t % ST;           // one float4 (4 chunk rows) of each transpose
        const uint iq = t / ST;
        const uint base = 4 * iq * K + s0 + kk;
        st[kk * CP + iq] = FLOAT4(Wn[base], Wn[base + K], Wn[base + 2 * K], Wn[base + 3 * K]);
        st[(ST + kk) * CP + iq] =
            FLOAT4(Qn[base], Qn[base + K], Qn[base + 2 * K], Qn[base + 3 * K]);
      }
      BARRIER();
#pragma unroll
      for (int kk = 0; kk < ST; ++kk) {
        const float4 w = st[kk * CP + tr];
        const float4 q4 = st[(ST + kk) * CP + tr];
        const float4 s = sS[(s0 + kk) * (VT / 4) + tc];
        P1[0] = kk_fma4(w.x, s, P1[0]);
        P1[1] = kk_fma4(w.y, s, P1[1]);
        P1[2] = kk_fma4(w.z, s, P1[2]);
        P1[3] = kk_fma4(w.w, s, P1[3]);
        P2[0] = kk_fma4(q4.x, s, P2[0]);
        P2[1] = kk_fma4(q4.y, s, P2[1]);
        P2[2] = kk_fma4(q4.z, s, P2[2]);
        P2[3] = kk_fma4(q4.w, s, P2[3]);
      }
      BARRIER();
    }
    for (int a = 0; a < 4; ++a) {   // V' = U - W S
      const float4 u = *reinterpret_cast<const DEVICE float4*>(Un + (i0 + a) * K + col);
      sV[(i0 + a) * (VT / 4) + tc] = kk_sub4(u, P1[a]);
    }
    // O = Qd S + Aqk V' (Aqk is zero above the diagonal): A^T staged ST columns at a time.
    for (int j0 = 0; j0 < C; j0 += ST) {
      {
        const uint jj = t % ST;
        const uint iq = t / ST;
        const uint base = 4 * iq * C + j0 + jj;
        st[jj * CP + iq] = FLOAT4(An[base], An[base + C], An[base + 2 * C], An[base + 3 * C]);
      }
      BARRIER();
      if (j0 <= (int)i0 + 3) {
#pragma unroll
        for (int jj = 0; jj < ST; ++jj) {
          const float4 a4 = st[jj * CP + tr];
          const float4 v4 = sV[(j0 + jj) * (VT / 4) + tc];
          P2[0] = kk_fma4(a4.x, v4, P2[0]);
          P2[1] = kk_fma4(a4.y, v4, P2[1]);
          P2[2] = kk_fma4(a4.z, v4, P2[2]);
          P2[3] = kk_fma4(a4.w, v4, P2[3]);
        }
      }
      BARRIER();
    }
    for (int a = 0; a < 4; ++a) {
      const int tk = n * C + i0 + a;
      const size_t at = (((size_t)b * T + tk) * H + h) * K + col;
      if (tk < T) *reinterpret_cast<DEVICE float4*>(o + at) = P2[a];
    }
    // S = decay S + Kd^T V': Kd staged ST rows at a time.
#pragma unroll
    for (int a4 = 0; a4 < KM / 4; ++a4) {
      const float4 dk = *reinterpret_cast<const DEVICE float4*>(decay + ch * K + k0 + 4 * a4);
      S[4 * a4] = kk_scale4(dk.x, S[4 * a4]);
      S[4 * a4 + 1] = kk_scale4(dk.y, S[4 * a4 + 1]);
      S[4 * a4 + 2] = kk_scale4(dk.z, S[4 * a4 + 2]);
      S[4 * a4 + 3] = kk_scale4(dk.w, S[4 * a4 + 3]);
    }
    for (int i0s = 0; i0s < C; i0s += ST) {
      for (uint e = t; e < ST * K / 4; e += NT) {
        st[e] = *reinterpret_cast<const DEVICE float4*>(Kn + i0s * K + 4 * e);
      }
      BARRIER();
#pragma unroll
      for (int ii = 0; ii < ST; ++ii) {
        const float4 v4 = sV[(i0s + ii) * (VT / 4) + tc];
#pragma unroll
        for (int a4 = 0; a4 < KM / 4; ++a4) {
          const float4 kd = st[ii * (K / 4) + k0 / 4 + a4];
          S[4 * a4] = kk_fma4(kd.x, v4, S[4 * a4]);
          S[4 * a4 + 1] = kk_fma4(kd.y, v4, S[4 * a4 + 1]);
          S[4 * a4 + 2] = kk_fma4(kd.z, v4, S[4 * a4 + 2]);
          S[4 * a4 + 3] = kk_fma4(kd.w, v4, S[4 * a4 + 3]);
        }
      }
      BARRIER();
    }
    for (int a = 0; a < KM; ++a) sS[(k0 + a) * (VT / 4) + tc] = S[a];
  }
  for (int a = 0; a < KM; ++a) {
    *reinterpret_cast<DEVICE float4*>(state_out + ((size_t)bh * K + k0 + a) * K + col) = S[a];
  }
"""


def _prep_instance(H, K):
    return Instance([mx.float32] * 5 + [mx.int32], [mx.float32] * 6, [("H", H), ("K", K)])


def _state_instance(H, K):
    return Instance([mx.float32] * 7 + [mx.int32], [mx.float32] * 2, [("H", H), ("K", K)])


KDA_CHUNK_PREP = Kernel(
    "kda_chunk_prep",
    ["q", "k", "v", "g", "beta", "dims"],
    ["Aqk", "Wc", "Uc", "Qd", "Kd", "decay"],
    PREP_BODY,
    header=VEC4_HELPERS,
    instances=[_prep_instance(96, 128)],
)

KDA_CHUNK_STATE = Kernel(
    "kda_chunk_state",
    ["Aqk", "Wc", "Uc", "Qd", "Kd", "decay", "state", "dims"],
    ["o", "state_out"],
    STATE_BODY,
    header=VEC4_HELPERS,
    instances=[_state_instance(96, 128)],
)


def eligible(heads: int, head_dim: int) -> bool:
    """Shapes the kernels serve: head_dim 64 or 128 (float4 tiles of 16 rows, 32 KB of
    threadgroup memory)."""
    return head_dim in (64, 128)


def kda_chunk(backend: str, q, k, v, g, beta, state):
    """``kimi_k3.kda.kda_chunked`` on the kernels; same contract (o, state), K == V.

    Shapes: q, k, v, g: [B, T, H, K] (q scaled and normalised); beta: [B, T, H];
    state: [B, H, K, K] fp32 or None. Returns (o [B, T, H, K] fp32, state fp32).
    """
    B, T, H, K = k.shape
    if not eligible(H, K) or v.shape[-1] != K:
        raise ValueError(f"kda_chunk kernels need K == V in (64, 128), got {K}, {v.shape[-1]}")
    N = -(-T // CHUNK)
    f32 = mx.float32
    q, k, v, g, beta = (x if x.dtype == f32 else x.astype(f32) for x in (q, k, v, g, beta))
    if state is None:
        state = mx.zeros((B, H, K, K), dtype=f32)
    dims = mx.array([T, N], dtype=mx.int32)
    mat = (B, H, N, CHUNK, K)
    prep = KDA_CHUNK_PREP(
        backend,
        inputs=[q, k, v, g, beta, dims],
        output_shapes=[(B, H, N, CHUNK, CHUNK), mat, mat, mat, mat, (B, H, N, K)],
        output_dtypes=[f32] * 6,
        grid=(256 * B * H * N, 1, 1),
        threadgroup=(256, 1, 1),
        template=[("H", H), ("K", K)],
    )
    o, state = KDA_CHUNK_STATE(
        backend,
        inputs=[*prep, state.astype(f32), dims],
        output_shapes=[(B, T, H, K), (B, H, K, K)],
        output_dtypes=[f32, f32],
        grid=(128 * B * H * (K // 32), 1, 1),
        threadgroup=(128, 1, 1),
        template=[("H", H), ("K", K)],
    )
    return o, state


def kda_prefill(backend: str, p: dict, x_q, x_k, x_v, g_raw, b_logits, gate, conv_state, state):
    """``kimi_k3.kda.kda_mix_reference`` with the recurrence on the chunk kernels.

    The short convolutions, L2 norms, gates and the output norm stay MLX ops (elementwise);
    same shapes and return contract as the reference.
    """
    from kimi_k3.kda import kda_gate, l2norm, rms_norm_gate, short_conv

    B, T, P = x_q.shape
    H, K = p["heads"], p["head_dim"]
    cs = [None] * 3 if conv_state is None else mx.split(conv_state, 3, axis=-1)
    q, cq = short_conv(x_q, p["q_conv"], cs[0])
    k, ck = short_conv(x_k, p["k_conv"], cs[1])
    v, cv = short_conv(x_v, p["v_conv"], cs[2])
    shape = (B, T, H, K)
    q = l2norm(q.reshape(shape)) * (K**-0.5)
    k = l2norm(k.reshape(shape))
    g = kda_gate(g_raw.reshape(shape), p["A_log"], p["dt_bias"], p["lower_bound"])
    beta = mx.sigmoid(b_logits.astype(mx.float32))
    o, state = kda_chunk(backend, q, k, v.reshape(shape), g, beta, state)
    y = rms_norm_gate(o, p["o_norm"], gate.reshape(shape), p["eps"])
    return y.reshape(B, T, P).astype(x_q.dtype), mx.concatenate([cq, ck, cv], axis=-1), state
