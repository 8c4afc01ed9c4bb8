"""KDA prefill: the whole token mixer after the projections, in four stages of kernels.

``kda_pre`` does the short convs + SiLU, the L2 norms, the q scale, the gate g and beta, and
writes the new conv window. Then the chunkwise recurrence (chunk 64, 16-token sub-blocks),
then ``kda_post`` (per-head RMSNorm x sigmoid(gate)). No MLX elementwise pass runs over the
[T, H*K] tensors.

``kda_chunk_prep`` runs on every (batch, head, chunk) at once (its 16-channel q and k tiles
copied asynchronously one tile ahead). For one 64-token chunk, with G
the in-chunk cumulative sum of g (``kimi_k3.model.kda.kda_chunked`` has the algebra):

    Aqk = lower(q_i . k_j exp(G_i - G_j))          Qd = exp(G) q,  Kd = exp(G_last - G) k
    L   = strict_lower(beta_i k_i . k_j exp(G_i - G_j)),  X = (I + L)^-1
    W   = X (beta exp(G) k),  U = X (beta v),  decay = exp(G_last)

Scores use a reference row per 16-row sub-block (the first one), so every exponent is a
difference of cumulative sums: <= 0, or at most one sub-block's decay inside the diagonal.

The state pass carries the state through the chunks in order, the state in registers:

    V' = U - W S,   O = Qd S + Aqk V',   S = decay * S + Kd^T V'

Two state passes compute O inside the sequential loop. ``kda_chunk_state_mma`` (CUDA's) runs
the four products on tf32 tensor cores, in the 3xTF32 split (about fp32 accuracy) for fp32
activations and in one tf32 MMA each for bf16 / fp16 ones (``MMA_PRECISION``), the state
transposed in each simdgroup's MMA accumulators, the chunk's operands copied asynchronously
into a ring of three threadgroup buffers two stages ahead; its Metal spelling is exact but
made of shuffles, so Metal keeps ``kda_chunk_state`` (fp32 FMAs, a register prefetch of the
next slice).
``STATE_PASS`` picks one per backend. Three other FMA state passes (without the prefetch;
split into a sequential kernel plus an all-chunks output kernel, at 32 or 16 columns per
threadgroup) were measured slower on the H200 (docs/benchmarks.md) and removed.

Any T works: rows past the end of the input are zero (zero g, k, v, beta leave S alone).
"""

from __future__ import annotations

import mlx.core as mx

from .source import (
    TF32X3_HELPERS,
    VEC4_HELPERS,
    Instance,
    Kernel,
    as_dtype,
    constant,
    env_choice,
)

CHUNK = 64

PREP_BODY = """
  constexpr int C = 64;             // chunk
  constexpr int DT = 16;            // channels per pass-1 tile
  constexpr int NT = 256;           // threads
  constexpr int R4 = DT / 4;        // float4 per tile row
  constexpr int RQ = R4 + 1;        // per padded row (the pad avoids bank conflicts)
  // sm4 regions, in float4. Pass 1: q and k tiles for two tiles (tile parity p: q at 512 p,
  // k at 512 p + 256; the next tile's arrive by asynchronous copies while this one is worked
  // on), the G tile, left factors of a sub-block, right factors (padded rows), the warps'
  // scan totals. The q, k and G tiles are read one row per 4 threads, so they need no pad.
  // Pass 2: L, one row of 16 float4 per chunk row (zero on and above the diagonal).
  constexpr int OG = 1024, OLQ = OG + C * R4, OLK = OLQ + 16 * RQ;
  constexpr int ORK = OLK + 16 * RQ, OSEG = ORK + C * RQ, OL = 0;
  SHARED float4 sm4[OSEG + 32];
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

  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const uint rl = lane / 4;     // the thread's row within its warp's 8 rows

  // Tile d0's q and k are copied into threadgroup memory (ASYNC_COPY16: cp.async on CUDA, no
  // registers held while in flight) during tile d0 - DT, into the other pair of buffers;
  // its g is loaded into a register one tile ahead.
  const bool ok = (int)row < rows;
  const size_t src = in0 + (ok ? row : 0) * tok + 4 * dq;   // a readable row where !ok
  ASYNC_COPY16(sm4[row * R4 + dq], reinterpret_cast<const DEVICE float4*>(q + src), ok);
  ASYNC_COPY16(sm4[256 + row * R4 + dq], reinterpret_cast<const DEVICE float4*>(k + src), ok);
  ASYNC_COMMIT();
  float4 gn = ok ? *reinterpret_cast<const DEVICE float4*>(g + src) : kk_zero4();

  for (int d0 = 0; d0 < K; d0 += DT) {
    const int OQ = ((d0 / DT) & 1) * 512, OK = OQ + 256;
    float4 Gv = gn;
    if (d0 + DT < K) {
      // the other buffers were last read before the previous tile's last barrier
      const int NQ = 512 - OQ;
      ASYNC_COPY16(sm4[NQ + row * R4 + dq],
                   reinterpret_cast<const DEVICE float4*>(q + src + d0 + DT), ok);
      ASYNC_COPY16(sm4[NQ + 256 + row * R4 + dq],
                   reinterpret_cast<const DEVICE float4*>(k + src + d0 + DT), ok);
      gn = ok ? *reinterpret_cast<const DEVICE float4*>(g + src + d0 + DT) : kk_zero4();
    }
    ASYNC_COMMIT();  // (empty on the last tile, so the wait below is the same every tile)
    // Cumulative sum of g down the chunk: a shuffle scan of each float4 column over the
    // warp's 8 rows, plus the totals of the warps above.
#pragma unroll
    for (uint d = 1; d < 8; d *= 2) {
      const uint from = rl >= d ? lane - 4 * d : lane;
      const float4 up = FLOAT4(SIMD_SHUFFLE(Gv.x, from), SIMD_SHUFFLE(Gv.y, from),
                               SIMD_SHUFFLE(Gv.z, from), SIMD_SHUFFLE(Gv.w, from));
      if (rl >= d) Gv = kk_add4(Gv, up);
    }
    if (rl == 7) sm4[OSEG + 4 * warp + dq] = Gv;  // the warp's totals
    BARRIER();
    for (uint w2 = 0; w2 < warp; ++w2) Gv = kk_add4(Gv, sm4[OSEG + 4 * w2 + dq]);
    sm4[OG + row * R4 + dq] = Gv;
    ASYNC_WAIT(1);  // this tile's q and k have landed (the next tile's may be in flight)
    BARRIER();
    {
      const float4 G = sm4[OG + row * R4 + dq];
      const float4 G_last = sm4[OG + (C - 1) * R4 + dq];
      const float4 eG = kk_exp4(G);
      const float4 kv = sm4[OK + row * R4 + dq];
      const size_t o = ch * C * K + row * K + d0 + 4 * dq;
      kk_store4(Qd + o, kk_mul4(sm4[OQ + row * R4 + dq], eG));
      kk_store4(Kd + o, kk_mul4(kv, kk_exp4(kk_sub4(G_last, G))));
      kk_store4(Wc + o, kk_scale4(s_beta[row], kk_mul4(kv, eG)));  // beta exp(G) k: W's RHS
      if (t < 4) kk_store4(decay + ch * K + d0 + 4 * t, kk_exp4(G_last));
    }

#pragma unroll
    for (int I = 0; I < 4; ++I) {
      const int r0 = I * 16;              // reference row of sub-block I
      if (t < 64) {                       // left factors exp(G_i - G_r) of its 16 rows
        const uint i = r0 + row;
        const float4 f = kk_exp4(kk_sub4(sm4[OG + i * R4 + dq], sm4[OG + r0 * R4 + dq]));
        sm4[OLQ + row * RQ + dq] = kk_mul4(sm4[OQ + i * R4 + dq], f);
        sm4[OLK + row * RQ + dq] = kk_mul4(sm4[OK + i * R4 + dq], f);
      }
      if ((int)row < r0 + 16) {           // right factors exp(G_r - G_j), columns up to its end
        const float4 f = kk_exp4(kk_sub4(sm4[OG + r0 * R4 + dq], sm4[OG + row * R4 + dq]));
        sm4[ORK + row * RQ + dq] = kk_mul4(sm4[OK + row * R4 + dq], f);
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
    // All 64 loads go out before any is used: a multiply right after each load (beta v)
    // made the U threads wait out the memory latency 64 times.
    float x[C];
    if (is_w) {
#pragma unroll
      for (int i = 0; i < C; ++i) x[i] = W_out[i * K + d];
    } else {
#pragma unroll
      for (int i = 0; i < C; ++i) x[i] = i < rows ? v[in0 + i * tok + d] : 0.0f;
#pragma unroll
      for (int i = 0; i < C; ++i) x[i] *= s_beta[i];
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
  // Every global slice is loaded into registers one step ahead (and the first W / Qd slice
  // of the next chunk during this chunk's state update), so the loads are in flight during
  // the FMAs instead of exposed between two barriers.
  constexpr int C = 64;
  constexpr int VT = 32;            // state columns per threadgroup
  constexpr int NT = 128;           // threads: 16 row groups x 8 column quads
  constexpr int KM = K / 16;        // state rows per thread (a multiple of 4)
  constexpr int ST = 8;             // rows staged per step
  constexpr int CP = C / 4 + 1;     // float4 per padded staged row of C values
  constexpr int KE = ST * K / 4 / NT;   // float4 of a Kd slice per thread
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
  const uint sk = t % ST;                 // staging: one float4 (4 chunk rows) of a transpose
  const uint sq = t / ST;
  const uint sbase = 4 * sq * K + sk;     // + s0: W / Qd element of the slice
  const uint abase = 4 * sq * C + sk;     // + j0: Aqk element of the slice

  float4 S[KM];
#pragma unroll
  for (int a = 0; a < KM; ++a) {
    S[a] = *reinterpret_cast<const DEVICE float4*>(state + ((size_t)bh * K + k0 + a) * K + col);
    sS[(k0 + a) * (VT / 4) + tc] = S[a];
  }
  float4 nw, nq;                    // the next W^T / Qd^T slice
  {
    const DEVICE float* Wn = Wc + (size_t)bh * N * C * K + sbase;
    const DEVICE float* Qn = Qd + (size_t)bh * N * C * K + sbase;
    nw = FLOAT4(Wn[0], Wn[K], Wn[2 * K], Wn[3 * K]);
    nq = FLOAT4(Qn[0], Qn[K], Qn[2 * K], Qn[3 * K]);
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
      st[sk * CP + sq] = nw;
      st[(ST + sk) * CP + sq] = nq;
      BARRIER();
      if (s0 + ST < K) {
        const uint e = sbase + s0 + ST;
        nw = FLOAT4(Wn[e], Wn[e + K], Wn[e + 2 * K], Wn[e + 3 * K]);
        nq = FLOAT4(Qn[e], Qn[e + K], Qn[e + 2 * K], Qn[e + 3 * K]);
      }
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
    float4 na = FLOAT4(An[abase], An[abase + C], An[abase + 2 * C], An[abase + 3 * C]);
    for (int a = 0; a < 4; ++a) {   // V' = U - W S
      const float4 u = *reinterpret_cast<const DEVICE float4*>(Un + (i0 + a) * K + col);
      sV[(i0 + a) * (VT / 4) + tc] = kk_sub4(u, P1[a]);
    }
    // O = Qd S + Aqk V' (Aqk is zero above the diagonal): A^T staged ST columns at a time.
    for (int j0 = 0; j0 < C; j0 += ST) {
      st[sk * CP + sq] = na;
      BARRIER();
      if (j0 + ST < C) {
        const uint e = abase + j0 + ST;
        na = FLOAT4(An[e], An[e + C], An[e + 2 * C], An[e + 3 * C]);
      }
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
    float4 nk[KE];
#pragma unroll
    for (int e = 0; e < KE; ++e) {
      nk[e] = *reinterpret_cast<const DEVICE float4*>(Kn + 4 * (t + e * NT));
    }
    if (n + 1 < N) {                // the next chunk's first W / Qd slice
      const DEVICE float* Wx = Wn + C * K + sbase;
      const DEVICE float* Qx = Qn + C * K + sbase;
      nw = FLOAT4(Wx[0], Wx[K], Wx[2 * K], Wx[3 * K]);
      nq = FLOAT4(Qx[0], Qx[K], Qx[2 * K], Qx[3 * K]);
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
#pragma unroll
      for (int e = 0; e < KE; ++e) st[t + e * NT] = nk[e];
      BARRIER();
      if (i0s + ST < C) {
#pragma unroll
        for (int e = 0; e < KE; ++e) {
          nk[e] = *reinterpret_cast<const DEVICE float4*>(Kn + (i0s + ST) * K + 4 * (t + e * NT));
        }
      }
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

STATE_MMA_BODY = """
  // The state pass on tf32 tensor cores: 3xTF32 (about fp32 precision) where X3, else one
  // tf32 MMA per product (about 1e-3 relative: for bf16 activations). Simdgroup w of a
  // threadgroup owns 16 state columns of one (batch, head); the WG simdgroups of a
  // threadgroup share their head's chunk data through threadgroup memory. Everything is
  // computed transposed, so that each product's A operand (16 state columns x k) is an
  // accumulator the simdgroup already holds: S^T for W S and Qd S, then V'^T for Aqk V' and
  // Kd^T V'. An m16n8k8 accumulator tile holds columns {2tq, 2tq + 1} of rows {g, g + 8}; read
  // as an A tile it is the same 16 x 8 block with its k order permuted (a.y takes c.z, a.z
  // takes c.y), and every B tile is read in that permuted k order.
  //
  // A chunk's data goes through threadgroup memory in 14 stages of 512 float4 (8 KB): 8
  // slices of 16 state rows of W and Qd, 2 halves of Aqk, 4 (K = 128) slices of rows of Kd.
  // Stage gs (= n NST + st, counted over the whole pass) lands in buffer gs % 3 of a ring of
  // three by asynchronous copies (ASYNC_COPY16) issued two stages ahead, so two stages' loads
  // are in flight during the math without holding registers, and one barrier per stage
  // both publishes a stage and frees the buffer that the next copies refill.
  constexpr int C = 64;
  constexpr int NS = K / 8;                 // state row tiles
  constexpr int NC = C / 8;                 // chunk row tiles
  constexpr int NT = 32 * WG;               // threads
  constexpr int PER = 512 / NT;             // float4 of a stage per thread
  constexpr int RW = 16;                    // row (floats) of a W / Qd slice, swizzled:
                                            // its halves swap in rows r with r & 2
  constexpr int RA = 72;                    // of an Aqk half
  constexpr int RK = K + 4;                 // of a Kd slice
  constexpr int JR = 2048 / K;              // chunk rows per Kd slice
  constexpr int NWQ = K / 16;               // W / Qd stages
  constexpr int NST = NWQ + 2 + C / JR;     // stages per chunk
  constexpr int SB = 1152;                  // float2 per buffer: the largest stage (Aqk)
  // 27 KB, 16-byte aligned for the copies (the same attribute spelling in Metal and CUDA)
  SHARED float2 sm[3 * SB] __attribute__((aligned(16)));

  const int T = dims[0];
  const int N = dims[1];
  const uint t = THREAD_INDEX;
  const uint lane = LANE;
  const uint g = lane / 4;
  const uint tq = lane % 4;
  const uint gw = GROUP_POS.x * WG + SIMDGROUP;
  const uint bh = gw / (K / 16);
  const uint b = bh / H;
  const uint h = bh % H;
  const uint ca = (gw % (K / 16)) * 16 + g;   // this lane's two state columns
  const uint cb = ca + 8;

  // S[s] = (S[r][ca], S[r + 1][ca], S[r][cb], S[r + 1][cb]) with r = 8 s + 2 tq.
  float4 S[NS];
  {
    const DEVICE float* s_in = state + (size_t)bh * K * K + 2 * tq * K;
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      const DEVICE float* r = s_in + 8 * s * K;
      S[s] = FLOAT4(r[ca], r[K + ca], r[cb], r[K + cb]);
    }
  }

  // Stage st of chunk n: element e (< 512) of it as a float4 in global memory, and where it
  // goes in sm (float2 index).
#define KK_STAGE_SRC(n, st, e)                                                              \\
  ((st) < NWQ ? ((e) < 256 ? Wc : Qd) + ((size_t)bh * N + (n)) * C * K +                   \\
                    ((e) % 256 / 4) * K + 16 * (st) + 4 * ((e) % 4)                          \\
   : (st) < NWQ + 2 ? Aqk + ((size_t)bh * N + (n)) * C * C + (32 * ((st) - NWQ) + (e) / 16) * C \\
                          + 4 * ((e) % 16)                                                  \\
   : Kd + ((size_t)bh * N + (n)) * C * K + (JR * ((st) - NWQ - 2) + (e) / (K / 4)) * K +     \\
         4 * ((e) % (K / 4)))
#define KK_SWZ(r) (((r) & 2) ? 4 : 0)  // float2 offset that swaps a W / Qd row's halves
#define KK_STAGE_DST(st, e)                                                                 \\
  ((st) < NWQ ? (((e) / 256) * 64 + (e) % 256 / 4) * RW / 2 +                                \\
                    ((2 * ((e) % 4)) ^ KK_SWZ((e) % 256 / 4))                                \\
   : (st) < NWQ + 2 ? ((e) / 16) * RA / 2 + 2 * ((e) % 16)                                   \\
   : ((e) / (K / 4)) * RK / 2 + 2 * ((e) % (K / 4)))
#define KK_ISSUE(n, st, buf)                                                                \\
  for (int r = 0; r < PER; ++r) {                                                           \\
    ASYNC_COPY16(sm[(buf) + KK_STAGE_DST(st, t + NT * r)],                                  \\
                 reinterpret_cast<const DEVICE float4*>(KK_STAGE_SRC(n, st, t + NT * r)), true); \\
  }
  KK_ISSUE(0, 0, 0);                        // stages 0 and 1 (NST >= 6)
  ASYNC_COMMIT();
  KK_ISSUE(0, 1, SB);
  ASYNC_COMMIT();

  for (int n = 0; n < N; ++n) {
    const size_t ch = (size_t)bh * N + n;
    float4 P1[NC];      // (W S)^T, then V'^T = U^T - (W S)^T
    float4 P2[NC];      // (Qd S)^T, then O^T
    kk_split4_t V[NC];  // V'^T split, k-permuted: the A operand of the last two products
#pragma unroll
    for (int j = 0; j < NC; ++j) {
      P1[j] = kk_zero4();
      P2[j] = kk_zero4();
    }
#pragma unroll
    for (int st = 0; st < NST; ++st) {
      const int gs = n * NST + st;
      const uint cur = (gs % 3) * SB;
      ASYNC_WAIT(1);    // this thread's copies of stage gs have landed
      BARRIER();        // everyone's have; everyone is done reading stage gs - 1's buffer
      {                 // stage gs + 2, into that buffer (an empty group past the end)
        const int n2 = st + 2 < NST ? n : n + 1;
        const int s2 = st + 2 < NST ? st + 2 : st + 2 - NST;
        if (n2 < N) KK_ISSUE(n2, s2, ((gs + 2) % 3) * SB);
        ASYNC_COMMIT();
      }
      if (st < NWQ) {
        // P1 += W^T-slice products, P2 += Qd^T-slice: B tiles are float2s of row 8 j + g.
#pragma unroll
        for (int k2 = 0; k2 < 2; ++k2) {
          const int kk = 2 * st + k2;
          const kk_split4_t a = kk_split4(FLOAT4(S[kk].x, S[kk].z, S[kk].y, S[kk].w));
#pragma unroll
          for (int j = 0; j < NC; ++j) {
            const uint i = cur + (8 * j + g) * RW / 2 + ((4 * k2 + tq) ^ KK_SWZ(8 * j + g));
            P1[j] = kk_mma(P1[j], a, sm[i], lane, X3);
            P2[j] = kk_mma(P2[j], a, sm[i + 64 * RW / 2], lane, X3);
          }
        }
        if (st == NWQ - 1) {
          // V'^T = U^T - (W S)^T, split once for the two products that read it.
          const DEVICE float* Un = Uc + ch * C * K + 2 * tq * K;
#pragma unroll
          for (int j = 0; j < NC; ++j) {
            const DEVICE float* u = Un + 8 * j * K;
            V[j] = kk_split4(FLOAT4(u[ca] - P1[j].x, u[cb] - P1[j].z, u[K + ca] - P1[j].y,
                                    u[K + cb] - P1[j].w));
          }
        }
      } else if (st < NWQ + 2) {
        // O^T = P2 + V'^T Aqk^T over j <= i (Aqk is zero above the diagonal), rows of this
        // half; B tiles are float2s of Aqk row 8 it + g.
        const int h2 = st - NWQ;
#pragma unroll
        for (int i4 = 0; i4 < 4; ++i4) {
          const int it = 4 * h2 + i4;
#pragma unroll
          for (int jt = 0; jt <= it; ++jt) {
            const float2 bt = sm[cur + ((8 * i4 + g) * RA + 8 * jt + 2 * tq) / 2];
            P2[it] = kk_mma(P2[it], V[jt], bt, lane, X3);
          }
          const int tk = n * C + 8 * it + 2 * tq;
          if (tk < T) {
            DEVICE float* orow = o + (((size_t)b * T + tk) * H + h) * K;
            orow[ca] = P2[it].x;
            orow[cb] = P2[it].z;
          }
          if (tk + 1 < T) {
            DEVICE float* orow = o + (((size_t)b * T + tk + 1) * H + h) * K;
            orow[ca] = P2[it].y;
            orow[cb] = P2[it].w;
          }
        }
      } else {
        // S^T = S^T decay + V'^T Kd over this slice's chunk rows: B tiles are
        // Kd[8 jt + 2 tq (+1)][8 s + g].
        const int js = st - NWQ - 2;
        if (js == 0) {
          const DEVICE float* dk = decay + ch * K + 2 * tq;
#pragma unroll
          for (int s = 0; s < NS; ++s) {
            const float2 d = *reinterpret_cast<const DEVICE float2*>(dk + 8 * s);
            S[s] = FLOAT4(d.x * S[s].x, d.y * S[s].y, d.x * S[s].z, d.y * S[s].w);
          }
        }
#pragma unroll
        for (int j2 = 0; j2 < JR / 8; ++j2) {
          const int jt = JR / 8 * js + j2;
#pragma unroll
          for (int s = 0; s < NS; ++s) {
            const uint i = (8 * j2 + 2 * tq) * RK + 8 * s + g;
            const float2 k0 = sm[cur + i / 2];
            const float2 k1 = sm[cur + (i + RK) / 2];
            const float2 kb = (g & 1) ? FLOAT2(k0.y, k1.y) : FLOAT2(k0.x, k1.x);
            S[s] = kk_mma(S[s], V[jt], kb, lane, X3);
          }
        }
      }
    }
  }
#undef KK_STAGE_SRC
#undef KK_STAGE_DST
#undef KK_SWZ
#undef KK_ISSUE

  DEVICE float* s_out = state_out + (size_t)bh * K * K + 2 * tq * K;
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    DEVICE float* r = s_out + 8 * s * K;
    r[ca] = S[s].x;
    r[K + ca] = S[s].y;
    r[cb] = S[s].z;
    r[K + cb] = S[s].w;
  }
"""

PRE_BODY = """
  // Everything before the recurrence, per token and head: the q/k/v short convs (window =
  // conv_state followed by x) with SiLU rounded to T as the reference does, L2 norms of q and k
  // (q also times K^-1/2), g = lower_bound sigmoid(exp(A_log) (g_raw + dt_bias)) and
  // beta = sigmoid(b). One simdgroup per TB tokens of one head, lane owns channels
  // LANE + 32 i. The conv window slides through registers; the weights sit in threadgroup
  // memory.
  constexpr int P = H * K;
  constexpr int CL = K / 32;        // channels per lane
  constexpr int TB = 16;            // tokens per simdgroup
  constexpr int NW = 4;             // simdgroups per threadgroup
  const int n_tok = dims[0];
  const int nblk = (n_tok + NW * TB - 1) / (NW * TB);
  const uint blk = GROUP_POS.x % nblk;
  const uint bh = GROUP_POS.x / nblk;
  const uint b = bh / H;
  const uint h = bh % H;
  const int ta = (int)blk * NW * TB + (int)SIMDGROUP * TB;
  const int tb = ta + TB < n_tok ? ta + TB : n_tok;
  const size_t xb = (size_t)b * n_tok * P;               // x[b, t, c] = x[xb + t P + c]
  const size_t cb = (size_t)b * (W - 1) * 3 * P;         // conv_state[b, j, c]
  const float lb = params[0];
  const float a_h = EXP(A_log[h]);
  const float qscale = RSQRT(static_cast<float>(K));
  SHARED float s_w[3 * W * K];      // this head's conv weights, [q/k/v][tap][channel]

  for (uint e = THREAD_INDEX; e < 3 * W * K; e += 32 * NW) {
    const uint which = e / (W * K);
    const uint j = (e / K) % W;
    const uint c = h * K + e % K;
    const DEVICE float* w = which == 0 ? q_conv : (which == 1 ? k_conv : v_conv);
    s_w[e] = w[c * W + j];
  }
  BARRIER();

  // The new conv window: xs[n_tok + j], j < W - 1, of xs = conv_state ++ x (exact copies).
  if (blk == 0 && SIMDGROUP == 0) {
    for (int i = 0; i < CL; ++i) {
      const uint c = h * K + LANE + 32 * i;
      for (int j = 0; j < W - 1; ++j) {
        const int u = n_tok + j;
        const size_t o = cb + (size_t)j * 3 * P + c;
        if (u < W - 1) {
          const size_t s = cb + (size_t)u * 3 * P + c;
          conv_out[o] = conv_state[s];
          conv_out[o + P] = conv_state[s + P];
          conv_out[o + 2 * P] = conv_state[s + 2 * P];
        } else {
          const size_t s = xb + (size_t)(u - (W - 1)) * P + c;
          conv_out[o] = x_q[s];
          conv_out[o + P] = x_k[s];
          conv_out[o + 2 * P] = x_v[s];
        }
      }
    }
  }

  if (ta < n_tok) {                 // the whole simdgroup agrees
    float wq[CL][W], wk[CL][W], wv[CL][W];   // window values; slot W - 1 is the token
    float dtb[CL];
    for (int i = 0; i < CL; ++i) {
      const uint c = h * K + LANE + 32 * i;
      dtb[i] = dt_bias[c];
      for (int j = 0; j < W - 1; ++j) {      // xs[ta + j]
        const int u = ta + j;
        if (u < W - 1) {
          const size_t s = cb + (size_t)u * 3 * P + c;
          wq[i][j] = static_cast<float>(conv_state[s]);
          wk[i][j] = static_cast<float>(conv_state[s + P]);
          wv[i][j] = static_cast<float>(conv_state[s + 2 * P]);
        } else {
          const size_t s = xb + (size_t)(u - (W - 1)) * P + c;
          wq[i][j] = static_cast<float>(x_q[s]);
          wk[i][j] = static_cast<float>(x_k[s]);
          wv[i][j] = static_cast<float>(x_v[s]);
        }
      }
    }
    // A token's inputs are loaded during the token before it: the stores of each token's
    // results may alias the inputs as far as the compiler knows, so it cannot move the next
    // token's loads above them, and each token waited out the memory latency.
    float nq[CL], nk[CL], nv[CL], ng[CL];
    float nb = 0.0f;
    {
      const size_t row = xb + (size_t)ta * P;
      for (int i = 0; i < CL; ++i) {
        const uint c = h * K + LANE + 32 * i;
        nq[i] = static_cast<float>(x_q[row + c]);
        nk[i] = static_cast<float>(x_k[row + c]);
        nv[i] = static_cast<float>(x_v[row + c]);
        ng[i] = static_cast<float>(g_raw[row + c]);
      }
      if (LANE == 0) nb = static_cast<float>(b_logits[((size_t)b * n_tok + ta) * H + h]);
    }
    for (int t = ta; t < tb; ++t) {
      const size_t row = xb + (size_t)t * P;
      float gr[CL];
      for (int i = 0; i < CL; ++i) {
        wq[i][W - 1] = nq[i];
        wk[i][W - 1] = nk[i];
        wv[i][W - 1] = nv[i];
        gr[i] = ng[i];
      }
      const float bl = nb;
      if (t + 1 < tb) {
        for (int i = 0; i < CL; ++i) {
          const uint c = h * K + LANE + 32 * i;
          nq[i] = static_cast<float>(x_q[row + P + c]);
          nk[i] = static_cast<float>(x_k[row + P + c]);
          nv[i] = static_cast<float>(x_v[row + P + c]);
          ng[i] = static_cast<float>(g_raw[row + P + c]);
        }
        if (LANE == 0) nb = static_cast<float>(b_logits[((size_t)b * n_tok + t + 1) * H + h]);
      }
      float yq[CL], yk[CL];
      float sq = 0.0f, sk = 0.0f;
      for (int i = 0; i < CL; ++i) {
        const uint c = h * K + LANE + 32 * i;
        float aq = 0.0f, ak = 0.0f, av = 0.0f;
        const uint d = LANE + 32 * i;
        for (int j = 0; j < W; ++j) {
          aq += wq[i][j] * s_w[j * K + d];
          ak += wk[i][j] * s_w[(W + j) * K + d];
          av += wv[i][j] * s_w[(2 * W + j) * K + d];
        }
        for (int j = 0; j < W - 1; ++j) {
          wq[i][j] = wq[i][j + 1];
          wk[i][j] = wk[i][j + 1];
          wv[i][j] = wv[i][j + 1];
        }
        yq[i] = static_cast<float>(static_cast<T>(aq / (1.0f + EXP(-aq))));
        yk[i] = static_cast<float>(static_cast<T>(ak / (1.0f + EXP(-ak))));
        v[row + c] = static_cast<float>(static_cast<T>(av / (1.0f + EXP(-av))));
        sq += yq[i] * yq[i];
        sk += yk[i] * yk[i];
        const float z = a_h * (gr[i] + dtb[i]);
        g[row + c] = lb / (1.0f + EXP(-z));
      }
      sq = SIMD_SUM(sq);
      sk = SIMD_SUM(sk);
      const float rq = RSQRT(sq + 1e-6f) * qscale;
      const float rk = RSQRT(sk + 1e-6f);
      for (int i = 0; i < CL; ++i) {
        const uint c = h * K + LANE + 32 * i;
        q[row + c] = yq[i] * rq;
        k[row + c] = yk[i] * rk;
      }
      if (LANE == 0) {
        const size_t bi = ((size_t)b * n_tok + t) * H + h;
        beta[bi] = 1.0f / (1.0f + EXP(-bl));
      }
    }
  }
"""

POST_BODY = """
  // Per-head RMSNorm times sigmoid(gate): one simdgroup per (token, head) row of K values.
  constexpr int CL = K / 32;
  const int rows = dims[0];
  const uint r = GROUP_POS.x * 4 + SIMDGROUP;
  if ((int)r < rows) {              // the whole simdgroup agrees
    const size_t base = (size_t)r * K;
    // gate and o_norm are loaded beside o: loaded in the output loop, each would wait for
    // the previous column's store (which may alias it as far as the compiler knows).
    float x[CL], gt[CL], on[CL];
    float ss = 0.0f;
    for (int i = 0; i < CL; ++i) {
      x[i] = o[base + LANE + 32 * i];
      gt[i] = static_cast<float>(gate[base + LANE + 32 * i]);
      on[i] = o_norm[LANE + 32 * i];
      ss += x[i] * x[i];
    }
    ss = SIMD_SUM(ss);
    const float rs = RSQRT(ss / K + params[0]);
    for (int i = 0; i < CL; ++i) {
      const uint d = LANE + 32 * i;
      y[base + d] = static_cast<T>(x[i] * rs * on[i] / (1.0f + EXP(-gt[i])));
    }
  }
"""


def _pre_instance(dtype, H, K, W=4):
    f32 = mx.float32
    return Instance(
        [dtype] * 6 + [f32] * 6 + [mx.int32],
        [f32] * 5 + [dtype],
        [("T", dtype), ("H", H), ("K", K), ("W", W)],
    )


def _post_instance(dtype, K):
    return Instance(
        [mx.float32, dtype, mx.float32, mx.float32, mx.int32], [dtype], [("T", dtype), ("K", K)]
    )


KDA_PRE = Kernel(
    "kda_pre",
    [
        "x_q",
        "x_k",
        "x_v",
        "g_raw",
        "b_logits",
        "conv_state",
        "q_conv",
        "k_conv",
        "v_conv",
        "A_log",
        "dt_bias",
        "params",
        "dims",
    ],
    ["q", "k", "v", "g", "beta", "conv_out"],
    PRE_BODY,
    instances=[_pre_instance(dt, 96, 128) for dt in (mx.bfloat16, mx.float32)],
)

KDA_POST = Kernel(
    "kda_post",
    ["o", "gate", "o_norm", "params", "dims"],
    ["y"],
    POST_BODY,
    instances=[_post_instance(dt, 128) for dt in (mx.bfloat16, mx.float32)],
)


def _prep_instance(H, K):
    return Instance([mx.float32] * 5 + [mx.int32], [mx.float32] * 6, [("H", H), ("K", K)])


def _state_instance(H, K, WG=None, X3=None):
    template = [("H", H), ("K", K)] + ([("WG", WG), ("X3", X3)] if WG is not None else [])
    return Instance([mx.float32] * 7 + [mx.int32], [mx.float32] * 2, template)


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


KDA_CHUNK_STATE_MMA = Kernel(
    "kda_chunk_state_mma",
    ["Aqk", "Wc", "Uc", "Qd", "Kd", "decay", "state", "dims"],
    ["o", "state_out"],
    STATE_MMA_BODY,
    header=VEC4_HELPERS + TF32X3_HELPERS,
    instances=[_state_instance(96, 128, w, x3) for w in (2, 4, 8) for x3 in (True, False)],
)

# Which state pass serves a backend: the tensor-core one needs real MMAs (its Metal spelling
# is exact but slow, made of shuffles), so Metal keeps the fp32 FMA one. Tests set "emulator"
# to "mma" to check the tensor-core kernel's fragment bookkeeping.
STATE_PASS = {"cuda": "mma", "metal": "fma", "emulator": "fma"}
STATE_MMA_WARPS = 8  # simdgroups per threadgroup of kda_chunk_state_mma (2, 4 or 8)
# The tensor-core state pass's precision by the dtype of the layer's activations: "fp32"
# (3xTF32, within 2e-5 of the reference) or "tf32" (one MMA per product, about 3x fewer
# MMAs; about 1e-3 relative, below bf16's own rounding of the layer's output). The FMA state
# pass is fp32 whatever this says. Set an entry to "fp32" for fp32 state passes everywhere.
MMA_PRECISION = {mx.float32: "fp32", mx.bfloat16: "tf32", mx.float16: "tf32"}
PRECISIONS = ("fp32", "tf32")


def state_precision(dtype) -> str:
    """The state pass's precision for activations of ``dtype``: ``KIMI_K3_KDA_PRECISION``
    (fp32 or tf32) where set, else ``MMA_PRECISION`` (fp32 for dtypes it does not list)."""
    return env_choice("KIMI_K3_KDA_PRECISION", PRECISIONS) or MMA_PRECISION.get(dtype, "fp32")


def eligible(heads: int, head_dim: int) -> bool:
    """Shapes the kernels serve: head_dim 64 or 128 (float4 tiles of 16 rows, 32 KB of
    threadgroup memory)."""
    return head_dim in (64, 128)


def _f32(x: mx.array) -> mx.array:
    return as_dtype(x, mx.float32)


def chunk_prep(backend: str, q, k, v, g, beta):
    """``kda_chunk_prep``: (Aqk, W, U, Qd, Kd, decay) of every chunk. Shapes as ``kda_chunk``."""
    B, T, H, K = k.shape
    N = -(-T // CHUNK)
    mat = (B, H, N, CHUNK, K)
    return KDA_CHUNK_PREP(
        backend,
        inputs=[*(_f32(x) for x in (q, k, v, g, beta)), constant([T, N], mx.int32)],
        output_shapes=[(B, H, N, CHUNK, CHUNK), mat, mat, mat, mat, (B, H, N, K)],
        output_dtypes=[mx.float32] * 6,
        grid=(256 * B * H * N, 1, 1),
        threadgroup=(256, 1, 1),
        template=[("H", H), ("K", K)],
    )


def chunk_state(backend: str, prep, state, T: int, precision: str = "fp32"):
    """The state pass over ``chunk_prep``'s outputs: ``kda_chunk_state_mma`` where
    ``STATE_PASS[backend]`` is ``"mma"`` (CUDA), in ``precision`` (``PRECISIONS``; see
    ``MMA_PRECISION``), else ``kda_chunk_state`` (fp32).

    Returns (o [B, T, H, K] fp32, state fp32).
    """
    B, H, N, _, K = prep[1].shape
    if precision not in PRECISIONS:
        raise ValueError(f"state pass precision {precision!r}: expected one of {PRECISIONS}")
    if state is None:
        state = mx.zeros((B, H, K, K), dtype=mx.float32)
    if STATE_PASS.get(backend) == "mma":
        warps = B * H * (K // 16)
        wg = min(STATE_MMA_WARPS, K // 16)  # a threadgroup's simdgroups share one head
        if (K // 16) % wg:
            raise ValueError(
                f"kda_prefill.STATE_MMA_WARPS = {STATE_MMA_WARPS} must divide a head's "
                f"{K // 16} simdgroups (head_dim {K} / 16)"
            )
        return KDA_CHUNK_STATE_MMA(
            backend,
            inputs=[*prep, _f32(state), constant([T, N], mx.int32)],
            output_shapes=[(B, T, H, K), (B, H, K, K)],
            output_dtypes=[mx.float32, mx.float32],
            grid=(32 * warps, 1, 1),
            threadgroup=(32 * wg, 1, 1),
            template=[("H", H), ("K", K), ("WG", wg), ("X3", precision == "fp32")],
        )
    return KDA_CHUNK_STATE(
        backend,
        inputs=[*prep, _f32(state), constant([T, N], mx.int32)],
        output_shapes=[(B, T, H, K), (B, H, K, K)],
        output_dtypes=[mx.float32, mx.float32],
        grid=(128 * B * H * (K // 32), 1, 1),
        threadgroup=(128, 1, 1),
        template=[("H", H), ("K", K)],
    )


def kda_chunk(backend: str, q, k, v, g, beta, state, precision: str = "fp32"):
    """``kimi_k3.model.kda.kda_chunked`` on the kernels; same contract (o, state), K == V.

    Shapes: q, k, v, g: [B, T, H, K] (q scaled and normalised); beta: [B, T, H];
    state: [B, H, K, K] fp32 or None. ``precision``: the tensor-core state pass's
    (``chunk_state``). Returns (o [B, T, H, K] fp32, state fp32).
    """
    B, T, H, K = k.shape
    if not eligible(H, K) or v.shape[-1] != K:
        raise ValueError(f"kda_chunk kernels need K == V in (64, 128), got {K}, {v.shape[-1]}")
    return chunk_state(backend, chunk_prep(backend, q, k, v, g, beta), state, T, precision)


def pre(backend: str, p: dict, x_q, x_k, x_v, g_raw, b_logits, conv_state):
    """``kda_pre``: (q, k, v, g [B, T, H, K] fp32, beta [B, T, H] fp32, new conv_state)."""
    B, T, P = x_q.shape
    H, K = p["heads"], p["head_dim"]
    W = p["q_conv"].shape[-1]
    dt = x_q.dtype
    f32 = mx.float32
    if conv_state is None:
        conv_state = mx.zeros((B, W - 1, 3 * P), dtype=dt)
    acts = [as_dtype(x, dt) for x in (x_q, x_k, x_v, g_raw, b_logits, conv_state)]
    weights = [_f32(p[n]) for n in ("q_conv", "k_conv", "v_conv", "A_log", "dt_bias")]
    shape = (B, T, H, K)
    return KDA_PRE(
        backend,
        inputs=[*acts, *weights, constant([float(p["lower_bound"])]), constant([T], mx.int32)],
        output_shapes=[shape, shape, shape, shape, (B, T, H), (B, W - 1, 3 * P)],
        output_dtypes=[f32] * 5 + [dt],
        grid=(128 * B * H * (-(-T // 64)), 1, 1),
        threadgroup=(128, 1, 1),
        template=[("T", dt), ("H", H), ("K", K), ("W", W)],
    )


def post(backend: str, p: dict, o, gate):
    """``kda_post``: RMSNorm(o) o_norm sigmoid(gate), [B, T, H*K] in gate's dtype."""
    B, T, H, K = o.shape
    rows = B * T * H
    (y,) = KDA_POST(
        backend,
        inputs=[
            o,
            gate,
            _f32(p["o_norm"]),
            constant([float(p["eps"])]),
            constant([rows], mx.int32),
        ],
        output_shapes=[(B, T, H * K)],
        output_dtypes=[gate.dtype],
        grid=(128 * (-(-rows // 4)), 1, 1),
        threadgroup=(128, 1, 1),
        template=[("T", gate.dtype), ("K", K)],
    )
    return y


def kda_prefill(backend: str, p: dict, x_q, x_k, x_v, g_raw, b_logits, gate, conv_state, state):
    """``kimi_k3.model.kda.kda_mix_reference`` on four kernels and no MLX elementwise passes.

    ``kda_pre`` (conv + SiLU, L2 norms, q scale, gate, beta, new conv window), the chunk
    kernels (``kda_chunk_prep``, ``kda_chunk_state``), ``kda_post`` (RMSNorm x sigmoid(gate)).
    Same shapes and return contract as the reference; the state pass's precision follows
    the activations' dtype (``state_precision``).
    """
    q, k, v, g, beta, conv_out = pre(backend, p, x_q, x_k, x_v, g_raw, b_logits, conv_state)
    precision = state_precision(x_q.dtype)
    o, state = kda_chunk(backend, q, k, v, g, beta, state, precision)
    return post(backend, p, o, as_dtype(gate, x_q.dtype)), conv_out, state
