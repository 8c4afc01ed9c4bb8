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
# Stacks of at most this many 4-bit elements per matrix (experts x rows x cols) are ones where
# MLX's CUDA gather_qmm agreed with the float64 oracle (tests/cuda, 16 experts at K3 dims).
# K3's resident 896-expert stack (9.9e9) is past 2^31: its gather_qmm output disagreed with the
# kernel (rel err 1.1, bench_mxfp4 on the H200), and MLX's CUDA qmm code does offset arithmetic
# in 32-bit ints. benchmarks/mxfp4_diag.py says which side is right; until then such stacks keep
# the kernel.
GATHER_QMM_MAX_ELEMENTS = 2**31 - 1


def expert_prefill_choice(backend: str, w) -> str:
    """``"kernel"`` or ``"reference"`` for more than ``EXPERT_DECODE_MAX_PAIRS`` pairs.

    ``KIMI_K3_EXPERT_PREFILL=kernel`` / ``reference`` forces one. Otherwise Metal takes the
    kernel (no Apple GPU measurements exist either way). CUDA takes ``gather_qmm`` (the
    reference), which the H200 measured about 2x faster than the grouped kernel (29 vs 66 ms
    at 512 tokens, 115 vs 226 ms at 4096, 896 experts), but only for stacks within
    ``GATHER_QMM_MAX_ELEMENTS``.
    """
    import os

    forced = os.environ.get("KIMI_K3_EXPERT_PREFILL", "")
    if forced in ("kernel", "reference"):
        return forced
    if backend != "cuda":
        return "kernel"
    q1, q2 = w["w1"][0], w["w2"][0]
    elements = max(8 * q1.size, 8 * q2.size)
    return "reference" if elements <= GATHER_QMM_MAX_ELEMENTS else "kernel"


def expert_glu_kernel(z, w, inds):
    """The kernel implementation of ``kimi_k3.experts.expert_glu`` for these inputs, or None.

    Metal or CUDA (``source.backend()``) and inputs ``mxfp4_decode.eligible`` accepts: the
    per-pair decode kernels up to ``EXPERT_DECODE_MAX_PAIRS`` pairs, above that the grouped
    (prefill) kernels where ``expert_prefill_choice`` says so. ``KIMI_K3_REFERENCE=1`` (or
    ``experts``) forces the reference.
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
    if expert_prefill_choice(backend, w) == "reference":
        return None
    return partial(mxfp4_prefill.expert_glu_prefill, backend=backend)
