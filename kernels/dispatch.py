"""Which custom kernel, if any, serves a call: by backend, shape and dtype."""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import partial

import mlx.core as mx

from . import (
    affine_decode,
    affine_prefill,
    expert_layout,
    kda_decode,
    kda_prefill,
    mxfp4_decode,
    mxfp4_mma,
    mxfp4_one,
    mxfp4_prefill,
    mxfp4_prefill_mma,
    source,
)
from .source import env_choice
from .verdict import usable

KDA_DTYPES = (mx.float32, mx.bfloat16)


def reference_forced(part: str) -> bool:
    """``KIMI_K3_REFERENCE=1`` (or ``all``, or ``part``: ``kda`` / ``experts``) forces the
    pure-MLX reference for that part of the model; ``0`` or unset forces nothing, and any
    other value is an error (a misspelt part would otherwise be silently ignored)."""
    value = env_choice("KIMI_K3_REFERENCE", ("0", "1", "all", "kda", "experts"), "0")
    return value in ("1", "all", part)


@contextmanager
def reference_paths():
    """Inside the block the pure-MLX reference serves every part, as
    ``KIMI_K3_REFERENCE=1`` asks (a value the environment already gives is kept); the
    variable is restored after, so a caller in the same process is not switched too."""
    before = os.environ.get("KIMI_K3_REFERENCE")
    os.environ.setdefault("KIMI_K3_REFERENCE", "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("KIMI_K3_REFERENCE", None)
        else:
            os.environ["KIMI_K3_REFERENCE"] = before


def checked(name: str, backend: str, fn):
    """``fn`` (kernel variant ``name`` on ``backend``) where its verdict for this machine lets
    it serve, else None (the reference): ``verdict.usable``, checked on first use."""
    return fn if usable(name, backend) else None


def kda_mix_kernel(p, x_q, conv_state, state):
    """The kernel implementation of ``kimi_k3.model.kda.kda_mix`` for these inputs, or None.
    ``KIMI_K3_REFERENCE=1`` (or ``kda``) forces the reference.

    Metal or CUDA (``source.backend()``), activations in float32 or bfloat16: one decode
    launch for T = 1, the chunk kernels for longer inputs; None (the reference) otherwise,
    and where the kernel failed its check on this machine (``checked``).
    """
    backend = source.backend()
    heads, head_dim = p["heads"], p["head_dim"]
    if (
        reference_forced("kda")
        or backend is None
        or x_q.dtype not in KDA_DTYPES
        or p["q_conv"].shape[-1] < 2
    ):
        return None
    if x_q.shape[1] == 1 and kda_decode.eligible(heads, head_dim):
        return checked("kda_decode", backend, partial(kda_decode.kda_decode, backend))
    if x_q.shape[1] > 1 and kda_prefill.eligible(heads, head_dim):
        return checked("kda_prefill", backend, partial(kda_prefill.kda_prefill, backend))
    return None


# (token, choice) pairs up to which the per-pair decode kernels run; the measurement behind it:
# docs/benchmarks.md#dispatch-thresholds.
EXPERT_DECODE_MAX_PAIRS = 128


# (token, choice) pairs up to which CUDA's decode is one launch (``mxfp4_one``: gate/up, down
# and the ordered sum in one grid; the same bits as ``mxfp4_mma``'s three launches); the
# measurement behind it: docs/benchmarks.md#dispatch-thresholds.
EXPERT_ONE_LAUNCH_MAX_PAIRS = 32


def expert_decode_choice(pairs: int) -> str:
    """``"one"`` (``mxfp4_one``) or ``"three"`` (``mxfp4_mma``'s launches) for CUDA's decode of
    ``pairs`` (token, choice) pairs: one launch up to ``EXPERT_ONE_LAUNCH_MAX_PAIRS``.
    ``KIMI_K3_EXPERT_DECODE=one`` / ``three`` forces either (another value is an error); both
    give the same bits."""
    default = "one" if pairs <= EXPERT_ONE_LAUNCH_MAX_PAIRS else "three"
    return env_choice("KIMI_K3_EXPERT_DECODE", ("one", "three"), default)


def expert_prefill_choice() -> str:
    """``"kernel"`` or ``"reference"`` for more than ``EXPERT_DECODE_MAX_PAIRS`` pairs.

    ``KIMI_K3_EXPERT_PREFILL=kernel`` / ``reference`` forces one (another value is an error).
    Otherwise the kernel, on every backend and shape. On the H200 MLX's CUDA ``gather_qmm``
    (mxfp4, sorted indices) is wrong at K3's scale: ``benchmarks/bench_mxfp4.py``'s oracle
    column measures it at relative error 1.06 against an fp32 dense oracle with flat
    routing over 896 experts, while the kernels agreed to 1e-6 (and all agree when only 16
    experts are used). It is also slower than the tensor-core kernel that serves CUDA, as is
    the LUT kernel (Metal's), there (docs/benchmarks.md#dispatch-thresholds).
    """
    return env_choice("KIMI_K3_EXPERT_PREFILL", ("kernel", "reference"), "kernel")


def expert_glu_kernel(z, w, inds):
    """The kernel implementation of ``kimi_k3.model.experts.expert_glu`` for these inputs, or None.

    Metal or CUDA (``source.backend()``) and inputs ``mxfp4_decode.eligible`` accepts: the
    per-pair decode kernels up to ``EXPERT_DECODE_MAX_PAIRS`` pairs (on CUDA the tensor-core
    ones where they apply: ``mxfp4_one``'s one launch up to ``EXPERT_ONE_LAUNCH_MAX_PAIRS``
    pairs (``expert_decode_choice``), then ``mxfp4_mma``'s three; elsewhere the LUT ones of
    ``mxfp4_decode``),
    above that the grouped (prefill) kernels where ``expert_prefill_choice`` says so: on
    CUDA the tensor-core GEMM of ``mxfp4_prefill_mma`` (whose Metal rendering spells the MMA
    out in shuffles), elsewhere the LUT GEMM of ``mxfp4_prefill``.
    Stacks in ``expert_layout``'s tiles (``TiledStacks``) are served by the tiled variants of
    CUDA's tensor-core kernels; where none applies, None (the reference, which untiles).
    Affine stacks (the lower-bit experts) go to their own kernels (``_affine_kernel``).
    ``KIMI_K3_REFERENCE=1`` (or ``experts``) forces the reference; a variant that failed its
    check on this machine gives None too (``checked``).
    """
    if reference_forced("experts"):
        return None
    backend = source.backend()
    if backend is None:
        return None
    if len(w["w1"]) == 3:
        return _affine_kernel(z, w, inds, backend)
    if not mxfp4_decode.eligible(z, w, inds):
        return None
    tiled = expert_layout.is_tiled(w)
    D, I = z.shape[-1], w["w1"][0].shape[-2]
    # mxfp4_mma.eligible, whose mxfp4_decode.eligible part has just passed
    mma = backend == "cuda" and mxfp4_mma.eligible_dims(D, I)
    if tiled and not mma:
        return None
    tail = "_tiled" if tiled else ""
    if inds.size <= EXPERT_DECODE_MAX_PAIRS:
        if mma:
            one = expert_decode_choice(inds.size) == "one"
            if one and mxfp4_one.agrees(backend, D, I):
                fn = mxfp4_one.expert_glu_decode_tiled if tiled else mxfp4_one.expert_glu_decode
                return checked("mxfp4_one" + tail, backend, partial(fn, backend=backend))
            fn = mxfp4_mma.expert_glu_decode_tiled if tiled else mxfp4_mma.expert_glu_decode
            return checked("mxfp4_mma" + tail, backend, partial(fn, backend=backend))
        fn = partial(mxfp4_decode.expert_glu_decode, backend=backend)
        return checked("mxfp4_decode", backend, fn)
    if expert_prefill_choice() == "reference":
        return None
    if backend == "cuda":
        fn = partial(mxfp4_prefill_mma.expert_glu_prefill_mma, backend=backend, tiled=tiled)
        return checked("mxfp4_prefill_mma" + tail, backend, fn)
    return checked(
        "mxfp4_prefill", backend, partial(mxfp4_prefill.expert_glu_prefill, backend=backend)
    )


def _affine_kernel(z, w, inds, backend: str):
    """``expert_glu_kernel`` for affine stacks (the lower-bit experts, ``(weight, scales,
    biases)``), on Metal and CUDA alike: ``affine_decode`` up to ``EXPERT_DECODE_MAX_PAIRS``
    pairs, above that ``affine_prefill``'s grouped GEMM where ``expert_prefill_choice`` says
    so; None where ``affine_decode.eligible`` refuses the inputs. Each width is a variant of
    its own (``affine2_decode``, ``affine3_prefill``, ...), checked on first use."""
    if expert_layout.is_tiled(w) or not affine_decode.eligible(z, w, inds):
        return None
    bits, _ = affine_decode.params(w)
    if inds.size <= EXPERT_DECODE_MAX_PAIRS:
        fn = partial(affine_decode.expert_glu_decode, backend=backend)
        return checked(f"affine{bits}_decode", backend, fn)
    if expert_prefill_choice() == "reference":
        return None
    fn = partial(affine_prefill.expert_glu_prefill, backend=backend)
    return checked(f"affine{bits}_prefill", backend, fn)


def expert_sum_in_order(inds) -> bool:
    """Whether ``expert_glu_kernel(z, w, inds)``'s kernel, where it gives one, adds up a
    token's k weighted pairs in order from zero (the decode kernels' last step, or
    ``mxfp4_one``'s), rather than by MLX's sum over the choice axis (the grouped prefill
    kernels and the reference). ``Streamer._grouped``, which runs a chunk's pairs in groups,
    adds them up the same way, so that its output has the bits of one call."""
    return inds.size <= EXPERT_DECODE_MAX_PAIRS


def with_reference_vjp(kernel_fn, reference_fn, primals: list):
    """``kernel_fn(*primals)`` forward, with the gradient of ``reference_fn(*primals)``.

    The custom kernels have no backward pass; this makes them differentiable (under
    ``mx.grad`` / ``mx.value_and_grad``) by differentiating the reference on the same inputs.
    Both functions take the arrays of ``primals`` positionally and return a tuple of arrays
    or one array. Constants (weights that are not trained, indices) stay in their closures.
    """

    @mx.custom_function
    def f(*xs):
        return kernel_fn(*xs)

    @f.vjp
    def f_vjp(xs, cotangents, outputs):
        cts = list(cotangents) if isinstance(cotangents, (list, tuple)) else [cotangents]
        _, grads = mx.vjp(lambda *a: _as_list(reference_fn(*a)), list(xs), cts)
        return tuple(grads)

    return f(*primals)


def _as_list(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]
