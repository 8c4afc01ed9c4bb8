"""Which custom kernel, if any, serves a call: by backend, shape and dtype."""

from __future__ import annotations

import mlx.core as mx

KDA_DTYPES = (mx.float32, mx.bfloat16)


def kda_mix_kernel(p, x_q, conv_state, state):
    """The kernel implementation of ``kimi_k3.kda.kda_mix`` for these inputs, or None.

    Metal or CUDA (``source.backend()``), activations in float32 or bfloat16: one decode
    launch for T = 1, the chunk kernels for longer inputs; None (the reference) otherwise.
    """
    from functools import partial

    from . import kda_decode, kda_prefill, source

    backend = source.backend()
    heads, head_dim = p["heads"], p["head_dim"]
    if backend is None or x_q.dtype not in KDA_DTYPES or p["q_conv"].shape[-1] < 2:
        return None
    if x_q.shape[1] == 1 and kda_decode.eligible(heads, head_dim):
        return partial(kda_decode.kda_decode, backend)
    if x_q.shape[1] > 1 and kda_prefill.eligible(heads, head_dim):
        return partial(kda_prefill.kda_prefill, backend)
    return None


EXPERT_DECODE_MAX_PAIRS = 64  # (token, choice) pairs up to which the per-pair decode kernels run


def expert_glu_kernel(z, w, inds):
    """The kernel implementation of ``kimi_k3.experts.expert_glu`` for these inputs, or None.

    Metal or CUDA (``source.backend()``) and inputs ``mxfp4_decode.eligible`` accepts: the
    per-pair decode kernels up to ``EXPERT_DECODE_MAX_PAIRS`` pairs, the grouped (prefill)
    kernels above. ``KIMI_K3_REFERENCE=1`` (or ``experts``) forces the reference.
    """
    import os
    from functools import partial

    from . import mxfp4_decode, mxfp4_prefill, source

    if os.environ.get("KIMI_K3_REFERENCE", "0") in ("1", "all", "experts"):
        return None
    backend = source.backend()
    if backend is None or not mxfp4_decode.eligible(z, w, inds):
        return None
    if inds.size <= EXPERT_DECODE_MAX_PAIRS:
        return partial(mxfp4_decode.expert_glu_decode, backend=backend)
    return partial(mxfp4_prefill.expert_glu_prefill, backend=backend)
