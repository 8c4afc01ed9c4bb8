"""Kimi Delta Attention (KDA): the pure-MLX reference, in recurrent and chunked form.

The recurrence, per head, with a fp32 state ``S`` of shape ``[K, V]``::

    S = Diag(alpha_t) S
    S = S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T q_t

``alpha_t = exp(g_t)`` is a per-channel decay, ``g_t <= 0``. The chunked form computes the
same function 64 tokens at a time (the WY/UT form, docs/model.md#kimi-delta-attention),
exponentiating only differences of in-chunk cumulative sums, each ``<= 0`` or bounded by one
16-token sub-block.

This module is the oracle for the custom kernels and the path used on the CPU. ``kda_mix``
is the one dispatcher: it runs the whole token mixer after the projections (short conv,
normalisation, gates, recurrence, output norm and gate) and is where kernels plug in.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from kimi_k3.kernels import checks, dispatch
from kimi_k3.kernels.dispatch import with_reference_vjp

CHUNK = 64
SUB = 16
RECURRENT_MAX_T = 16


def short_conv(
    x: mx.array, weight: mx.array, state: mx.array | None, out_dtype=None
) -> tuple[mx.array, mx.array]:
    """Causal depthwise convolution followed by SiLU, computed in fp32 and returned in
    ``out_dtype`` (default: x's dtype, as a bf16 model run through fla's ShortConvolution).

    Shapes:
        x: [B, T, C]; weight: [C, 1, W] (checkpoint layout); state: [B, W-1, C] or None.
        Returns (y [B, T, C], new_state [B, W-1, C]).
    """
    B, T, C = x.shape
    W = weight.shape[-1]
    if state is None:
        state = mx.zeros((B, W - 1, C), dtype=x.dtype)
    xs = mx.concatenate([state.astype(x.dtype), x], axis=1)
    w = weight.reshape(C, W).astype(mx.float32)
    acc = sum(xs[:, j : j + T, :].astype(mx.float32) * w[:, j] for j in range(W))
    return (acc * mx.sigmoid(acc)).astype(out_dtype or x.dtype), xs[:, T:, :]


def l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, in fp32."""
    x = x.astype(mx.float32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def kda_gate(g_raw: mx.array, A_log: mx.array, dt_bias: mx.array, lower_bound: float) -> mx.array:
    """Per-channel log decay ``lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))``.

    Shapes:
        g_raw: [B, T, H, K]; A_log: [H]; dt_bias: [H*K]. Returns fp32 [B, T, H, K].
    """
    H, K = g_raw.shape[-2:]
    a = mx.exp(A_log.astype(mx.float32)).reshape(H, 1)
    z = a * (g_raw.astype(mx.float32) + dt_bias.astype(mx.float32).reshape(H, K))
    return lower_bound * mx.sigmoid(z)


def kda_recurrent(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None
) -> tuple[mx.array, mx.array]:
    """Token-by-token KDA recurrence (reference form for decode and short inputs).

    ``q`` is expected already scaled (``head_dim ** -0.5``) and ``q``, ``k`` normalised.

    Shapes:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] (log decay);
        beta: [B, T, H]; state: [B, H, K, V] fp32 or None.
        Returns (o [B, T, H, V] in v's dtype, state [B, H, K, V] fp32).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = mx.zeros((B, H, K, V), mx.float32) if state is None else state.astype(mx.float32)
    qf, kf, vf = (t.astype(mx.float32) for t in (q, k, v))
    alpha = mx.exp(g.astype(mx.float32))
    bf = beta.astype(mx.float32)
    outs = []
    for t in range(T):
        S = S * alpha[:, t, :, :, None]
        kt = kf[:, t]
        pred = (kt[..., None] * S).sum(axis=-2)  # S^T k: [B, H, V]
        delta = bf[:, t, :, None] * (vf[:, t] - pred)
        S = S + kt[..., None] * delta[..., None, :]
        outs.append((qf[:, t][..., None] * S).sum(axis=-2))
    return mx.stack(outs, axis=1).astype(v.dtype), S


def _unit_lower_inverse(L: mx.array) -> mx.array:
    """``(I + L)^-1`` for a strictly lower-triangular ``L`` [..., C, C], C a power of two.

    Recursive block inversion, all blocks of a level at once: ``X`` starts as ``I``, the
    inverse of ``I + L``'s diagonal blocks of size 1; with ``X`` the inverse of its diagonal
    blocks of size ``s``, the blocks of size ``2s`` are ``[[A, 0], [C, B]]``, whose inverse
    adds ``-B^-1 C A^-1`` below the diagonal, so ``X <- X - X L_s X`` with ``L_s`` the ``C``
    parts of ``L`` (rows in a block's second half, columns in its first). Two matmuls a
    level, ``log2 C`` levels: the same triangular solve as forward substitution, in 12
    batched matmuls for C = 64 rather than 63 dependent row updates.
    """
    C = L.shape[-1]
    if C & (C - 1):
        raise ValueError(f"_unit_lower_inverse: C = {C} is not a power of two")
    X = mx.broadcast_to(mx.eye(C, dtype=L.dtype), L.shape)
    idx = mx.arange(C)
    s = 1
    while s < C:
        same = (idx[:, None] // (2 * s)) == (idx[None, :] // (2 * s))
        lower_half = (idx[:, None] // s) > (idx[None, :] // s)
        Ls = mx.where(same & lower_half, L, 0.0)
        X = X - X @ Ls @ X
        s *= 2
    return X


def _decayed_scores(left: mx.array, right: mx.array, G: mx.array, strict: bool) -> mx.array:
    """``A[i, j] = sum_d left_i[d] right_j[d] exp(G_i[d] - G_j[d])`` for j <= i (j < i if strict).

    Each 16-row sub-block ``I`` uses its first row ``r`` as reference, so the left factor
    ``exp(G_i - G_r)`` is <= 1 and the right factor ``exp(G_r - G_j)`` is <= 1 for earlier
    sub-blocks and at most one sub-block's decay (<= 80 nats) inside ``I``; columns after
    ``I`` are zeroed before exponentiation.

    Shapes: left, right, G: [..., C, K] with C a multiple of 16. Returns [..., C, C].
    """
    C, K = G.shape[-2:]
    n = C // SUB
    Gr = G[..., ::SUB, :]  # [..., n, K]
    Gb = G.reshape(G.shape[:-2] + (n, SUB, K))
    lf = left.reshape(Gb.shape) * mx.exp(Gb - Gr[..., None, :])
    col = mx.arange(C)
    last = (mx.arange(n) + 1) * SUB - 1
    live = col[None, :] <= last[:, None]  # [n, C]
    expo = mx.where(live[..., None], Gr[..., :, None, :] - G[..., None, :, :], -mx.inf)
    rf = right[..., None, :, :] * mx.exp(expo)  # [..., n, C, K]
    A = (lf @ rf.swapaxes(-1, -2)).reshape(G.shape[:-2] + (C, C))
    row = mx.arange(C)[:, None]
    keep = (row > col[None, :]) if strict else (row >= col[None, :])
    return mx.where(keep, A, 0.0)


def kda_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """Chunkwise-parallel KDA (the WY/UT form); same contract as ``kda_recurrent``.

    Per chunk, with ``G`` the inclusive cumsum of ``g`` inside the chunk::

        L = strict_lower(beta_i * k_i . k_j * exp(G_i - G_j));  M = (I + L)^-1 Diag(beta)
        W = M (exp(G) * K);  U = M V;  V' = U - W S
        O = (exp(G) * Q) S + lower(q_i . k_j * exp(G_i - G_j)) V'
        S = Diag(exp(G_C)) S + (exp(G_C - G) * K)^T V'

    Any T works: the tail is zero-padded (zero k, v, g and beta leave state and outputs alone).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    pad = (-T) % chunk
    N = (T + pad) // chunk

    def blocks(x):
        x = x.astype(mx.float32)
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        # [B, T, H, D] -> [B, H, N, C, D]
        x = x.reshape((B, N, chunk, H) + x.shape[3:])
        return mx.moveaxis(x, 3, 1)

    qb, kb, vb, gb = blocks(q), blocks(k), blocks(v), blocks(g)
    bb = blocks(beta[..., None])  # [B, H, N, C, 1]
    G = mx.cumsum(gb, axis=-2)
    Lkk = bb * _decayed_scores(kb, kb, G, strict=True)
    Aqk = _decayed_scores(qb, kb, G, strict=False)
    Tinv = _unit_lower_inverse(Lkk)
    M = Tinv * bb.swapaxes(-1, -2)  # column scale: (I+L)^-1 Diag(beta)
    W = M @ (mx.exp(G) * kb)
    U = M @ vb
    Qd = mx.exp(G) * qb
    Gl = G[..., -1:, :]  # [B, H, N, 1, K]
    Kd = mx.exp(Gl - G) * kb
    decay = mx.exp(Gl).swapaxes(-1, -2)  # [B, H, N, K, 1]

    S = mx.zeros((B, H, K, V), mx.float32) if state is None else state.astype(mx.float32)
    outs = []
    for n in range(N):
        Vp = U[:, :, n] - W[:, :, n] @ S
        outs.append(Qd[:, :, n] @ S + Aqk[:, :, n] @ Vp)
        S = decay[:, :, n] * S + Kd[:, :, n].swapaxes(-1, -2) @ Vp
    o = mx.stack(outs, axis=2).reshape(B, H, N * chunk, V)[:, :, :T]
    return mx.moveaxis(o, 1, 2).astype(v.dtype), S


def kda_reference(q, k, v, g, beta, state=None):
    """The reference recurrence, in whichever form suits ``T`` (recurrent if short)."""
    if q.shape[1] <= RECURRENT_MAX_T:
        return kda_recurrent(q, k, v, g, beta, state)
    return kda_chunked(q, k, v, g, beta, state)


def rms_norm_gate(o: mx.array, weight: mx.array, gate: mx.array, eps: float) -> mx.array:
    """Per-head ``RMSNorm(o) * weight * sigmoid(gate)`` in fp32.

    Shapes: o, gate: [B, T, H, V]; weight: [V]. Returns fp32 [B, T, H, V].
    """
    of = o.astype(mx.float32)
    of = of * mx.rsqrt((of * of).mean(axis=-1, keepdims=True) + eps)
    return of * weight.astype(mx.float32) * mx.sigmoid(gate.astype(mx.float32))


def kda_mix_reference(p: dict, x_q, x_k, x_v, g_raw, b_logits, gate, conv_state, state):
    """The KDA token mixer after its input projections, in pure MLX ops.

    ``p`` holds the layer's constants: ``q_conv``, ``k_conv``, ``v_conv`` ([P, 1, W]),
    ``A_log`` [H], ``dt_bias`` [H*K], ``o_norm`` [K], ``heads``, ``head_dim``,
    ``lower_bound``, ``eps``.

    Shapes:
        x_q, x_k, x_v, g_raw, gate: [B, T, H*K]; b_logits: [B, T, H];
        conv_state: [B, W-1, 3*H*K] or None (q, k, v windows side by side);
        state: [B, H, K, K] fp32 or None.
        Returns (y [B, T, H*K] in x_q's dtype, conv_state, state).
    """
    B, T, P = x_q.shape
    H, K = p["heads"], p["head_dim"]
    cs = [None] * 3 if conv_state is None else mx.split(conv_state, 3, axis=-1)
    q, cq = short_conv(x_q, p["q_conv"], cs[0])
    k, ck = short_conv(x_k, p["k_conv"], cs[1])
    v, cv = short_conv(x_v, p["v_conv"], cs[2])
    shape = (B, T, H, K)
    q = l2norm(q.reshape(shape)) * (K**-0.5)
    k = l2norm(k.reshape(shape))
    v = v.reshape(shape).astype(mx.float32)
    g = kda_gate(g_raw.reshape(shape), p["A_log"], p["dt_bias"], p["lower_bound"])
    beta = mx.sigmoid(b_logits.astype(mx.float32))
    o, state = kda_reference(q, k, v, g, beta, state)
    y = rms_norm_gate(o, p["o_norm"], gate.reshape(shape), p["eps"])
    return y.reshape(B, T, P).astype(x_q.dtype), mx.concatenate([cq, ck, cv], axis=-1), state


def kda_mix(p: dict, x_q, x_k, x_v, g_raw, b_logits, gate, conv_state, state):
    """Dispatcher for the KDA token mixer: a custom kernel where one is eligible, else the
    reference. Same contract as ``kda_mix_reference``."""
    fn = dispatch.kda_mix_kernel(p, x_q, conv_state, state)
    if fn is not None:
        return _kernel_with_reference_grad(
            fn, p, x_q, x_k, x_v, g_raw, b_logits, gate, conv_state, state
        )
    if x_q.shape[1] == 1 and conv_state is not None and state is not None:
        step = _compiled_step(p["heads"], p["head_dim"], p["lower_bound"], p["eps"])
        arrays = {k: v for k, v in p.items() if isinstance(v, mx.array)}
        return step(arrays, x_q, x_k, x_v, g_raw, b_logits, gate, conv_state, state)
    return kda_mix_reference(p, x_q, x_k, x_v, g_raw, b_logits, gate, conv_state, state)


def _kernel_with_reference_grad(fn, p, *inputs):
    """Run the kernel ``fn``; gradients (training) come from ``kda_mix_reference``."""
    B, _, P = inputs[0].shape
    conv_state, state = inputs[-2:]
    if conv_state is None:  # zeros are what both paths assume for a fresh sequence
        conv_state = mx.zeros((B, p["q_conv"].shape[-1] - 1, 3 * P), dtype=inputs[0].dtype)
    if state is None:
        K = p["head_dim"]
        state = mx.zeros((B, p["heads"], K, K), dtype=mx.float32)
    names = [k for k, v in p.items() if isinstance(v, mx.array)]
    consts = {k: v for k, v in p.items() if k not in names}
    n = len(names)

    def call(impl):
        return lambda *xs: impl({**consts, **dict(zip(names, xs[:n]))}, *xs[n:])

    primals = [p[k] for k in names] + [*inputs[:-2], conv_state, state]
    return tuple(with_reference_vjp(call(fn), call(kda_mix_reference), primals))


@cache
def _compiled_step(heads: int, head_dim: int, lower_bound: float, eps: float):
    """The reference mixer for one decode token, compiled (many small ops fused)."""
    consts = {"heads": heads, "head_dim": head_dim, "lower_bound": lower_bound, "eps": eps}

    def step(arrays, *inputs):
        return kda_mix_reference({**arrays, **consts}, *inputs)

    return mx.compile(step)


checks.REFERENCES["kda_mix_reference"] = kda_mix_reference  # the kernels' oracle
