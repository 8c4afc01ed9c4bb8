"""Each custom kernel against the pure-MLX reference, on this machine's own backend.

A ``Case`` is one kernel variant at one shape: inputs built from a fixed seed, the kernel's
call (through its module, as the dispatcher calls it) and the reference's, and a tolerance
on the RMS-relative error of the kernel's outputs against the reference's. ``run_case``
runs both and gives a ``Result``: the error, a verdict (``pass``; ``mismatch``;
``non-finite`` for NaN or inf; ``error`` for a compile or launch failure) and, when asked,
the time of each.

The KDA kernels' contract is fp32 whatever MLX's ``MLX_ENABLE_TF32`` says (their tensor-core
state pass splits fp32 operands in three tf32 products), while the pure-MLX reference's
matmuls follow that setting: on a GPU with TF32 allowed (MLX's default on CUDA) the
reference itself is off by about 4e-4. So a KDA case's values to compare with (its
``oracle``) are the reference computed on the CPU (``exact``), where fp32 matmuls are fp32;
the reference on the device is what ``reference_ms`` times. The expert kernels' reference
runs MLX's quantized matmuls, which TF32 does not touch, so it serves as both.

``KERNELS`` names every kernel variant the dispatcher (``kimi_k3.kernels.dispatch``) can
select, per backend; ``small_case(name, backend)`` is the quick case the first-use check
runs (``kimi_k3.kernels.verdict``); ``kda_case`` and ``expert_case`` build a case at any
shape, which ``python -m kimi_k3.doctor`` uses for K3's shapes and for its checks of the
reference paths against other pure-MLX renderings of the same maths.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import expert_layout, kda_decode, kda_prefill

BETA, CAP = 4.0, 25.0  # SiTU's beta and the up branch's cap (K3's values are of this order)
KDA_TOL = 1e-4  # RMS-relative, fp32: the kernels agree to about 1e-6 on the emulator
EXPERT_TOL = 1e-4  # RMS-relative, fp32 accumulation on both sides

# Variants per backend, in the order the dispatcher tries them. ``_tiled``: the kernel on
# stacks in ``expert_layout``'s tiles (CUDA's stores hold those where the dims allow).
# ``affine<bits>_*``: the lower-bit experts' kernels at 2 and 3 bits (one source each, two
# widths: each width has its own verdict).
AFFINE = ("affine2_decode", "affine3_decode", "affine2_prefill", "affine3_prefill")
KERNELS = {
    "metal": ("kda_decode", "kda_prefill", "mxfp4_decode", "mxfp4_prefill", *AFFINE),
    "cuda": (
        "kda_decode",
        "kda_prefill",
        "mxfp4_one",
        "mxfp4_one_tiled",
        "mxfp4_mma",
        "mxfp4_mma_tiled",
        "mxfp4_prefill_mma",
        "mxfp4_prefill_mma_tiled",
        *AFFINE,
    ),
}
KERNELS["emulator"] = KERNELS["metal"]  # the Metal source, run on the CPU

# K3's shapes: KDA 96 heads of 128; experts of latent 3584 and hidden 3072, top-16. The
# doctor's expert stacks hold 32 experts (560 MB): a call reads only the experts it routes to.
K3_KDA = dict(H=96, K=128)
K3_EXPERTS = dict(E=32, D=3584, I=3072, k=16)


@dataclass
class Case:
    """One kernel variant at one shape (module docstring)."""

    kernel: str
    shape: str
    run: Callable[[], list]  # the kernel's outputs
    reference: Callable[[], list]  # the reference's outputs, the same structure
    tol: float
    oracle: Callable[[], list] | None = None  # the values to compare with (else reference's)


@dataclass
class Result:
    kernel: str
    shape: str
    verdict: str  # pass, mismatch, non-finite, error
    err: float | None
    tol: float
    detail: str = ""
    kernel_ms: float | None = None
    reference_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.verdict == "pass"


def rel_err(a: mx.array, b: mx.array) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a = np.asarray(a.astype(mx.float32), dtype=np.float64)
    b = np.asarray(b.astype(mx.float32), dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _outputs(out) -> list:
    out = list(out) if isinstance(out, (list, tuple)) else [out]
    mx.eval(out)
    return out


def _timed(fn: Callable, reps: int) -> tuple[list, float]:
    """``fn``'s outputs, evaluated, and the median milliseconds of ``reps`` more calls."""
    out = _outputs(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _outputs(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return out, float(np.median(times)) if times else None


def run_case(case: Case, reps: int = 0) -> Result:
    """Run ``case``'s kernel and reference (``reps`` timed calls of each after the first)."""
    res = Result(case.kernel, case.shape, "pass", None, case.tol)
    try:
        out, res.kernel_ms = _timed(case.run, reps)
    except Exception as e:  # a compile or launch failure is the verdict, not a crash
        res.verdict, res.detail = "error", f"{type(e).__name__}: {_first_line(e)}"
        return res
    try:
        want, res.reference_ms = _timed(case.reference, reps)
        if case.oracle is not None:
            want = _outputs(case.oracle())
    except Exception as e:  # no verdict on the kernel without the reference's answer
        res.verdict, res.detail = "error", f"the reference failed: {type(e).__name__}: {e}"
        return res
    if len(out) != len(want) or any(o.shape != w.shape for o, w in zip(out, want)):
        got = [tuple(o.shape) for o in out]
        res.verdict = "mismatch"
        res.detail = f"output shapes {got}, reference {[tuple(w.shape) for w in want]}"
        return res
    if not all(bool(mx.all(mx.isfinite(o.astype(mx.float32)))) for o in out):
        res.verdict, res.detail = "non-finite", "NaN or inf in the kernel's output"
        return res
    res.err = max(rel_err(o, w) for o, w in zip(out, want))
    if not res.err <= case.tol:
        res.verdict = "mismatch"
        res.detail = f"error {res.err:.2e} > tolerance {case.tol:.0e}"
    return res


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


# --- KDA ---------------------------------------------------------------------------------


def _normal(seed: int):
    """``normal(shape, scale=1.0)``: fp32 standard normal draws times ``scale``, from one
    generator seeded with ``seed`` (each call draws the next)."""
    r = np.random.default_rng(seed)

    def normal(shape, scale=1.0):
        return mx.array(r.standard_normal(shape).astype(np.float32) * scale)

    return normal


def kda_layer(H: int, K: int, seed: int = 0, W: int = 4) -> dict:
    """A KDA layer's constants (``kimi_k3.model.kda.kda_mix_reference``'s ``p``), random."""
    normal = _normal(seed)
    P = H * K
    p = {n: normal((P, 1, W), 0.5) for n in ("q_conv", "k_conv", "v_conv")}
    p.update(A_log=normal((H,), 0.5), dt_bias=normal((P,)), o_norm=1 + normal((K,), 0.1))
    return {**p, "heads": H, "head_dim": K, "lower_bound": -5.0, "eps": 1e-5}


def kda_inputs(B: int, T: int, H: int, K: int, seed: int = 1, W: int = 4) -> tuple:
    """``kda_mix``'s activations and carried state (a sequence already under way)."""
    normal = _normal(seed)
    P = H * K
    x = [normal((B, T, P)) for _ in range(4)]
    return (
        *x,
        normal((B, T, H)),
        normal((B, T, P)),
        normal((B, W - 1, 3 * P)),
        normal((B, H, K, K), 0.1),
    )


# The pure-MLX references, registered by the model's modules as they are imported
# (``kimi_k3.model.kda``, ``kimi_k3.model.experts``: the only callers of the dispatcher), so
# that the kernels' package imports nothing above it.
REFERENCES: dict[str, Callable] = {}


def reference(name: str) -> Callable:
    """The registered reference ``name`` (``kda_mix_reference``, ``expert_glu_reference``)."""
    try:
        return REFERENCES[name]
    except KeyError:
        raise LookupError(
            f"no reference {name!r} registered: import kimi_k3.model.kda and "
            "kimi_k3.model.experts first"
        ) from None


def exact(fn: Callable[[], list]) -> Callable[[], list] | None:
    """``fn`` run on the CPU, where MLX's fp32 matmuls are fp32 whatever
    ``MLX_ENABLE_TF32`` says; None where the CPU is the default device already."""
    if mx.default_device() == mx.cpu:
        return None

    def on_cpu():
        with mx.stream(mx.cpu):
            return _outputs(fn())

    return on_cpu


def kda_case(name: str, backend: str, B: int, T: int, H: int, K: int) -> Case:
    """``kda_decode`` (T = 1) or ``kda_prefill`` against ``kda_mix_reference``, compared
    with the reference in fp32 (``exact``)."""
    kda_mix_reference = reference("kda_mix_reference")

    p, args = kda_layer(H, K), kda_inputs(B, T, H, K)
    module = kda_decode if name == "kda_decode" else kda_prefill

    def run():
        return getattr(module, name)(backend, p, *args)

    def ref():
        return kda_mix_reference(p, *args)

    return Case(name, f"B={B} T={T} H={H} K={K}", run, ref, KDA_TOL, oracle=exact(ref))


# --- MXFP4 experts -----------------------------------------------------------------------


def random_experts(E: int, D: int, I: int, seed: int = 0) -> dict:
    """``E`` random MXFP4 experts in MLX's layout (``w1``/``w3`` [I, D], ``w2`` [D, I]):
    every code equally likely, scales spread over 5 octaves around the one that puts a
    row's products near unit variance."""
    r = np.random.default_rng(seed)
    out = {}
    for n, (rows, cols) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
        mid = 127 - int(np.round(np.log2(np.sqrt(cols) * 2.9)))
        codes = r.integers(0, 2**32, (E, rows, cols // 8), dtype=np.uint32)
        scales = r.integers(mid - 2, mid + 3, (E, rows, cols // 32)).astype(np.uint8)
        out[n] = (mx.array(codes), mx.array(scales))
    return out


def random_affine_experts(E: int, D: int, I: int, bits: int, group: int = 64, seed: int = 0):
    """``E`` random experts in MLX's ``affine`` layout at ``bits`` (``w1``/``w3`` [I, D],
    ``w2`` [D, I]: codes uint32, float16 scales and biases per ``group``): every code equally
    likely, scales spread over two octaves around the one that puts a row's products near
    unit variance, biases centring each group's grid near zero."""
    r = np.random.default_rng(seed)
    top = (1 << bits) - 1
    out = {}
    for n, (rows, cols) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
        codes = r.integers(0, 2**32, (E, rows, cols * bits // 32), dtype=np.uint32)
        shape = (E, rows, cols // group)
        scale = 2.0 / (top * np.sqrt(cols)) * np.exp2(r.uniform(-1, 1, shape))
        bias = -scale * top / 2 * r.uniform(0.8, 1.2, shape)
        out[n] = tuple(
            mx.array(a) for a in (codes, scale.astype(np.float16), bias.astype(np.float16))
        )
    return out


def routing(N: int, E: int, k: int, seed: int = 1) -> tuple:
    """``k`` distinct experts per token, positive weights summing to one."""
    r = np.random.default_rng(seed)
    inds = np.stack([r.permutation(E)[:k] for _ in range(N)]).astype(np.int32)
    wts = r.random((N, k)) + 0.1
    return mx.array(inds), mx.array((wts / wts.sum(axis=1, keepdims=True)).astype(np.float32))


# variant -> (module, function); the grouped prefill kernels take more than
# ``dispatch.EXPERT_DECODE_MAX_PAIRS`` pairs
_EXPERT_FNS = {
    "mxfp4_decode": ("mxfp4_decode", "expert_glu_decode"),
    "mxfp4_prefill": ("mxfp4_prefill", "expert_glu_prefill"),
    "mxfp4_one": ("mxfp4_one", "expert_glu_decode"),
    "mxfp4_one_tiled": ("mxfp4_one", "expert_glu_decode_tiled"),
    "mxfp4_mma": ("mxfp4_mma", "expert_glu_decode"),
    "mxfp4_mma_tiled": ("mxfp4_mma", "expert_glu_decode_tiled"),
    "mxfp4_prefill_mma": ("mxfp4_prefill_mma", "expert_glu_prefill_mma"),
    "mxfp4_prefill_mma_tiled": ("mxfp4_prefill_mma", "expert_glu_prefill_mma"),
    "affine2_decode": ("affine_decode", "expert_glu_decode"),
    "affine3_decode": ("affine_decode", "expert_glu_decode"),
    "affine2_prefill": ("affine_prefill", "expert_glu_prefill"),
    "affine3_prefill": ("affine_prefill", "expert_glu_prefill"),
}


def module_of(name: str) -> str:
    """The kernel module variant ``name`` lives in (``mxfp4_one_tiled``: ``mxfp4_one``)."""
    return _EXPERT_FNS[name][0] if name in _EXPERT_FNS else name


def expert_case(name: str, backend: str, E: int, D: int, I: int, N: int, k: int) -> Case:
    """An expert kernel variant (MXFP4, or ``affine<bits>_*`` on affine experts of groups of
    64) against ``expert_glu_reference`` (fp32 latents)."""
    expert_glu_reference = reference("expert_glu_reference")

    affine = name.startswith("affine")
    w = random_affine_experts(E, D, I, int(name[6])) if affine else random_experts(E, D, I)
    inds, wts = routing(N, E, k)
    z = mx.array(np.random.default_rng(2).standard_normal((N, D)).astype(np.float32))
    tiled = name.endswith("_tiled")
    wk = expert_layout.tile(w) if tiled else w
    mx.eval(z, inds, wts, w, wk)
    module, fn = _EXPERT_FNS[name]
    mod = importlib.import_module(f"{__package__}.{module}")
    extra = {"tiled": tiled} if module == "mxfp4_prefill_mma" else {}

    def run():
        return getattr(mod, fn)(z, wk, inds, wts, BETA, CAP, backend=backend, **extra)

    def oracle():
        return expert_glu_reference(z, w, inds, wts, BETA, CAP)

    shape = f"N={N} k={k} ({N * k} pairs) D={D} I={I} E={E}"
    return Case(name, shape, run, oracle, EXPERT_TOL)


def small_case(name: str, backend: str) -> Case:
    """The first-use check's case for a variant: small shapes (a fraction of a second on a
    GPU), the variant's own path (one chunk and a partial one for the chunked prefill;
    more pairs than ``EXPERT_DECODE_MAX_PAIRS`` for the grouped prefill)."""
    if name == "kda_decode":
        return kda_case(name, backend, 1, 1, 2, 64)
    if name == "kda_prefill":
        return kda_case(name, backend, 1, 65, 2, 64)
    if "prefill" in name:
        return expert_case(name, backend, 8, 128, 128, 40, 4)
    return expert_case(name, backend, 8, 128, 128, 2, 4)
