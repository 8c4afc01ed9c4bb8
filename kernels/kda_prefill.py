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

from .source import Instance, Kernel

CHUNK = 64

PREP_BODY = """
  constexpr int C = 64;             // chunk
  constexpr int DT = 16;            // channels per tile
  constexpr int NT = 256;           // threads
  // sm regions. Pass 1: q, k, G tiles, sub-block left factors, right factors, scan partials.
  constexpr int OQ = 0, OK = 1024, OG = 2048, OLQ = 3072, OLK = 3328, ORK = 3584, OSEG = 4608;
  // Solve and pass 2: L and X = (I + L)^-1 packed strictly-lower (row i at i(i-1)/2), tile.
  constexpr int OL = 0, OX = 2016, OTILE = 0;
  SHARED float sm[4864];
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
  DEVICE float* A_out = Aqk + ch * C * C;
  DEVICE float* W_out = Wc + ch * C * K;
  DEVICE float* U_out = Uc + ch * C * K;
  DEVICE float* Q_out = Qd + ch * C * K;
  DEVICE float* K_out = Kd + ch * C * K;

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

  for (int d0 = 0; d0 < K; d0 += DT) {
    for (uint e = t; e < C * DT; e += NT) {
      const uint i = e / DT;
      const size_t src = in0 + i * tok + d0 + e % DT;
      const bool ok = (int)i < rows;
      sm[OQ + e] = ok ? q[src] : 0.0f;
      sm[OK + e] = ok ? k[src] : 0.0f;
      sm[OG + e] = ok ? g[src] : 0.0f;
    }
    BARRIER();
    {  // cumulative sum down each column: 16 segments of 4 rows per column
      const uint d = t % DT;
      const uint seg = t / DT;
      float run = 0.0f;
      for (int r = 0; r < 4; ++r) run += sm[OG + (seg * 4 + r) * DT + d];
      sm[OSEG + seg * DT + d] = run;
      BARRIER();
      float off = 0.0f;
      for (uint s2 = 0; s2 < seg; ++s2) off += sm[OSEG + s2 * DT + d];
      for (int r = 0; r < 4; ++r) {
        const uint idx = OG + (seg * 4 + r) * DT + d;
        off += sm[idx];
        sm[idx] = off;
      }
    }
    BARRIER();
    for (uint e = t; e < C * DT; e += NT) {
      const uint i = e / DT;
      const uint d = e % DT;
      const float G = sm[OG + e];
      const float G_last = sm[OG + (C - 1) * DT + d];
      const size_t o = i * K + d0 + d;
      Q_out[o] = sm[OQ + e] * EXP(G);
      K_out[o] = sm[OK + e] * EXP(G_last - G);
      W_out[o] = s_beta[i] * sm[OK + e] * EXP(G);   // beta exp(G) k, solved in pass 2
    }
    if (t < DT) decay[ch * K + d0 + t] = EXP(sm[OG + (C - 1) * DT + t]);

#pragma unroll
    for (int I = 0; I < 4; ++I) {
      const int r0 = I * 16;              // reference row of sub-block I
      {
        const uint e = t;                 // 16 rows x DT = NT left factors
        const uint i = r0 + e / DT;
        const uint d = e % DT;
        const float f = EXP(sm[OG + i * DT + d] - sm[OG + r0 * DT + d]);
        sm[OLQ + e] = sm[OQ + i * DT + d] * f;
        sm[OLK + e] = sm[OK + i * DT + d] * f;
      }
      for (uint e = t; e < (uint)(r0 + 16) * DT; e += NT) {
        const uint d = e % DT;
        sm[ORK + e] = sm[OK + e] * EXP(sm[OG + r0 * DT + d] - sm[OG + e]);
      }
      BARRIER();
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        if (m <= I) {
          const uint j = m * 16 + jj;
          float aq = 0.0f, ak = 0.0f;
          for (int d = 0; d < DT; ++d) {
            const float rk = sm[ORK + j * DT + d];
            aq += sm[OLQ + ii * DT + d] * rk;
            ak += sm[OLK + ii * DT + d] * rk;
          }
          accq[I * 4 + m] += aq;
          acck[I * 4 + m] += ak;
        }
      }
      BARRIER();
    }
  }

  // Aqk (lower, with the diagonal) out; L = beta_i * (k scores), strictly lower, to sm.
#pragma unroll
  for (int I = 0; I < 4; ++I) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const uint i = I * 16 + ii;
      const uint j = m * 16 + jj;
      A_out[i * C + j] = j <= i ? accq[I * 4 + m] : 0.0f;
      if (j < i) sm[OL + i * (i - 1) / 2 + j] = s_beta[i] * acck[I * 4 + m];
    }
  }
  BARRIER();
  if (t < C) {  // X = (I + L)^-1 by forward substitution, one column per thread
    const uint c = t;
    for (uint i = c + 1; i < C; ++i) {
      float acc = sm[OL + i * (i - 1) / 2 + c];
      for (uint j = c + 1; j < i; ++j) acc += sm[OL + i * (i - 1) / 2 + j] * sm[OX + j * (j - 1) / 2 + c];
      sm[OX + i * (i - 1) / 2 + c] = -acc;
    }
  }
  // Pass 2: W = X (beta exp(G) k) in place, U = X (beta v). Each thread reloads the W
  // elements it wrote in pass 1 (same e -> thread mapping); the device barrier is for clarity.
  BARRIER_DEVICE();
  for (int pass = 0; pass < 2; ++pass) {
    DEVICE float* out = pass == 0 ? W_out : U_out;
    for (int d0 = 0; d0 < K; d0 += DT) {
      for (uint e = t; e < C * DT; e += NT) {
        const uint i = e / DT;
        const uint d = e % DT;
        if (pass == 0) {
          sm[OTILE + e] = W_out[i * K + d0 + d];
        } else {
          sm[OTILE + e] = (int)i < rows ? s_beta[i] * v[in0 + i * tok + d0 + d] : 0.0f;
        }
      }
      BARRIER();
      for (uint e = t; e < C * DT; e += NT) {
        const uint i = e / DT;
        const uint d = e % DT;
        float acc = sm[OTILE + e];
        for (uint j = 0; j < i; ++j) acc += sm[OX + i * (i - 1) / 2 + j] * sm[OTILE + j * DT + d];
        out[i * K + d0 + d] = acc;
      }
      BARRIER();
    }
  }
"""

STATE_BODY = """
  constexpr int C = 64;
  constexpr int VT = 32;            // state columns per threadgroup: one per lane
  constexpr int R = K / KR;         // row groups (simdgroups), KR rows each
  constexpr int NT = R * 32;
  constexpr int RB = 4;             // chunk rows staged per step
  SHARED float sW[RB * K];
  SHARED float sQ[RB * K];
  SHARED float sKd[RB * K];
  SHARED float s_part[2 * R * RB * VT];
  SHARED float sV[C * VT];          // V' of the chunk
  SHARED float sO[C * VT];          // Qd S of the chunk

  const int T = dims[0];
  const int N = dims[1];
  const uint t = THREAD_INDEX;
  const uint rg = t / 32;
  const uint lane = t % 32;
  const uint nvt = K / VT;
  const uint vt = GROUP_POS.x % nvt;
  const uint bh = GROUP_POS.x / nvt;
  const uint b = bh / H;
  const uint h = bh % H;
  const uint v = vt * VT + lane;

  float s[KR];
  float acc[KR];
  const DEVICE float* S0 = state + (size_t)bh * K * K;
  for (int j = 0; j < KR; ++j) s[j] = S0[(rg * KR + j) * K + v];

  for (int n = 0; n < N; ++n) {
    const size_t ch = (size_t)bh * N + n;
    const DEVICE float* Wn = Wc + ch * C * K;
    const DEVICE float* Qn = Qd + ch * C * K;
    const DEVICE float* Kn = Kd + ch * C * K;
    const DEVICE float* Un = Uc + ch * C * K;
    const DEVICE float* An = Aqk + ch * C * C;
    for (int j = 0; j < KR; ++j) acc[j] = 0.0f;
    for (int i0 = 0; i0 < C; i0 += RB) {
      for (uint e = t; e < RB * K; e += NT) {
        sW[e] = Wn[i0 * K + e];
        sQ[e] = Qn[i0 * K + e];
        sKd[e] = Kn[i0 * K + e];
      }
      BARRIER();
      for (int ib = 0; ib < RB; ++ib) {  // this row group's part of (W S) and (Qd S)
        float pw = 0.0f, pq = 0.0f;
        for (int j = 0; j < KR; ++j) {
          pw += sW[ib * K + rg * KR + j] * s[j];
          pq += sQ[ib * K + rg * KR + j] * s[j];
        }
        s_part[(rg * RB + ib) * VT + lane] = pw;
        s_part[((R + rg) * RB + ib) * VT + lane] = pq;
      }
      BARRIER();
      for (uint e = t; e < RB * VT; e += NT) {
        const uint ib = e / VT;
        const uint l = e % VT;
        const uint i = i0 + ib;
        float pw = 0.0f, pq = 0.0f;
        for (int r2 = 0; r2 < R; ++r2) {
          pw += s_part[(r2 * RB + ib) * VT + l];
          pq += s_part[((R + r2) * RB + ib) * VT + l];
        }
        sV[i * VT + l] = Un[i * K + vt * VT + l] - pw;
        sO[i * VT + l] = pq;
      }
      BARRIER();
      for (int ib = 0; ib < RB; ++ib) {  // Kd^T V' for this thread's rows
        const float vv = sV[(i0 + ib) * VT + lane];
        for (int j = 0; j < KR; ++j) acc[j] += sKd[ib * K + rg * KR + j] * vv;
      }
      BARRIER();
    }
    for (uint i = rg; i < C; i += R) {
      float o_i = sO[i * VT + lane];
      for (uint j = 0; j <= i; ++j) o_i += An[i * C + j] * sV[j * VT + lane];
      const int tk = n * C + i;
      if (tk < T) o[(((size_t)b * T + tk) * H + h) * K + v] = o_i;
    }
    const DEVICE float* dn = decay + ch * K;
    for (int j = 0; j < KR; ++j) s[j] = dn[rg * KR + j] * s[j] + acc[j];
    BARRIER();
  }
  DEVICE float* S1 = state_out + (size_t)bh * K * K;
  for (int j = 0; j < KR; ++j) S1[(rg * KR + j) * K + v] = s[j];
"""

STATE_ROWS = 32  # KR of kda_chunk_state: state rows per thread


def _prep_instance(H, K):
    return Instance([mx.float32] * 5 + [mx.int32], [mx.float32] * 6, [("H", H), ("K", K)])


def _state_instance(H, K):
    f32 = mx.float32
    return Instance([f32] * 7 + [mx.int32], [f32, f32], [("H", H), ("K", K), ("KR", STATE_ROWS)])


KDA_CHUNK_PREP = Kernel(
    "kda_chunk_prep", ["q", "k", "v", "g", "beta", "dims"],
    ["Aqk", "Wc", "Uc", "Qd", "Kd", "decay"], PREP_BODY,
    instances=[_prep_instance(96, 128)],
)

KDA_CHUNK_STATE = Kernel(
    "kda_chunk_state", ["Aqk", "Wc", "Uc", "Qd", "Kd", "decay", "state", "dims"],
    ["o", "state_out"], STATE_BODY,
    instances=[_state_instance(96, 128)],
)


def eligible(heads: int, head_dim: int) -> bool:
    """Shapes the kernels serve: head_dim a multiple of 32 (whole lanes and tiles), up to 256."""
    return head_dim % 32 == 0 and head_dim <= 256


def kda_chunk(backend: str, q, k, v, g, beta, state):
    """``kimi_k3.kda.kda_chunked`` on the kernels; same contract (o, state), K == V.

    Shapes: q, k, v, g: [B, T, H, K] (q scaled and normalised); beta: [B, T, H];
    state: [B, H, K, K] fp32 or None. Returns (o [B, T, H, K] fp32, state fp32).
    """
    B, T, H, K = k.shape
    N = -(-T // CHUNK)
    f32 = mx.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
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
    nt = K // STATE_ROWS * 32
    o, state = KDA_CHUNK_STATE(
        backend,
        inputs=[*prep, state.astype(f32), dims],
        output_shapes=[(B, T, H, K), (B, H, K, K)],
        output_dtypes=[f32, f32],
        grid=(nt * B * H * (K // 32), 1, 1),
        threadgroup=(nt, 1, 1),
        template=[("H", H), ("K", K), ("KR", STATE_ROWS)],
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
