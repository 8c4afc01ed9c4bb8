"""Single-source kernels: one body in a small dialect, rendered for Metal or CUDA.

A kernel body is C++ that both Metal and CUDA accept, plus the dialect's words below for
the only things that differ: thread indexing, SIMD/warp operations, barriers, shared memory
and address-space qualifiers, and the few math functions whose names differ. ``render``
swaps each word for its backend's spelling; a word is an identifier (matched whole), a
function-like word is followed by ``(``. kernels/README.md documents the dialect.

``Kernel`` holds one kernel: its body, the names of its inputs and outputs, and the
instances it is launched with (so compile checks can render every one). ``Kernel.get`` builds
the backend's kernel object lazily (``mx.fast.metal_kernel`` raises on Linux).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import mlx.core as mx

BACKENDS = ("metal", "cuda")

_LINEAR = "(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z))"

# word: (Metal, CUDA)
WORDS = {
    # indexing (uint3 values: use .x/.y/.z)
    "THREAD_POS": ("thread_position_in_threadgroup", "threadIdx"),
    "GROUP_POS": ("threadgroup_position_in_grid", "blockIdx"),
    "GROUP_SIZE": ("threads_per_threadgroup", "blockDim"),
    "NUM_GROUPS": ("threadgroups_per_grid", "gridDim"),
    # indexing (scalars)
    "THREAD_INDEX": ("thread_index_in_threadgroup", _LINEAR),
    "GRID_X": ("thread_position_in_grid.x", "(blockIdx.x * blockDim.x + threadIdx.x)"),
    "GRID_Y": ("thread_position_in_grid.y", "(blockIdx.y * blockDim.y + threadIdx.y)"),
    "GRID_Z": ("thread_position_in_grid.z", "(blockIdx.z * blockDim.z + threadIdx.z)"),
    "LANE": ("thread_index_in_simdgroup", f"({_LINEAR} & 31u)"),
    "SIMDGROUP": ("simdgroup_index_in_threadgroup", f"({_LINEAR} >> 5)"),
    "SIMD_WIDTH": ("32u", "32u"),
    # memory
    "SHARED": ("threadgroup", "__shared__"),
    "DEVICE": ("device", ""),
    "BFLOAT16": ("bfloat16_t", "__nv_bfloat16"),
    "HELPER": ("inline", "__device__ inline"),
}

# function-like word: (Metal, CUDA) spelling of the callee
CALLS = {
    "BARRIER": ("threadgroup_barrier", "__syncthreads"),
    "SIMD_BARRIER": ("simdgroup_barrier", "__syncwarp"),
    "SIMD_SUM": ("metal::simd_sum", "kk_warp_sum"),
    "SIMD_MAX": ("metal::simd_max", "kk_warp_max"),
    "SIMD_MIN": ("metal::simd_min", "kk_warp_min"),
    "SIMD_SHUFFLE": ("metal::simd_shuffle", "kk_warp_shuffle"),
    "SIMD_SHUFFLE_XOR": ("metal::simd_shuffle_xor", "kk_warp_shuffle_xor"),
    "SIMD_SHUFFLE_DOWN": ("metal::simd_shuffle_down", "kk_warp_shuffle_down"),
    "SIMD_BROADCAST": ("metal::simd_broadcast", "kk_warp_shuffle"),
    "EXP": ("metal::exp", "expf"),
    "LOG": ("metal::log", "logf"),
    "SQRT": ("metal::sqrt", "sqrtf"),
    "RSQRT": ("metal::rsqrt", "rsqrtf"),
    "TANH": ("metal::tanh", "tanhf"),
    "FMAX": ("metal::fmax", "fmaxf"),
    "FMIN": ("metal::fmin", "fminf"),
    "FABS": ("metal::abs", "fabsf"),
}

# Barrier words take no arguments in the dialect; Metal needs the memory flags.
_BARRIER_ARGS = {"BARRIER": "mem_flags::mem_threadgroup", "SIMD_BARRIER": "mem_flags::mem_threadgroup"}

# Helpers the CUDA spellings rely on; prepended to the header of every CUDA kernel.
CUDA_PRELUDE = """
template <typename T> __device__ inline T kk_warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename T> __device__ inline T kk_warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <typename T> __device__ inline T kk_warp_min(T v) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <typename T> __device__ inline T kk_warp_shuffle(T v, int lane) {
  return __shfl_sync(0xffffffffu, v, lane);
}
template <typename T> __device__ inline T kk_warp_shuffle_xor(T v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
template <typename T> __device__ inline T kk_warp_shuffle_down(T v, int delta) {
  return __shfl_down_sync(0xffffffffu, v, delta);
}
"""

_WORD_RE = re.compile(r"\b(" + "|".join(sorted(WORDS, key=len, reverse=True)) + r")\b")
_CALL_RE = re.compile(r"\b(" + "|".join(sorted(CALLS, key=len, reverse=True)) + r")\s*\(")


def render(text: str, backend: str) -> str:
    """``text`` (a body or header in the dialect) in the backend's spelling."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    i = BACKENDS.index(backend)

    def call(m):
        word = m.group(1)
        name = CALLS[word][i]
        if word in _BARRIER_ARGS and backend == "metal":
            return f"{name}({_BARRIER_ARGS[word]}"
        return name + "("

    text = _CALL_RE.sub(call, text)
    return _WORD_RE.sub(lambda m: WORDS[m.group(1)][i], text)


def render_header(header: str, backend: str) -> str:
    """The header handed to MLX: the backend's helpers, then the rendered header."""
    return (CUDA_PRELUDE if backend == "cuda" else "") + render(header, backend)


def backend() -> str | None:
    """The kernel backend for this process: ``metal``, ``cuda`` or None (reference ops).

    ``KIMI_K3_KERNEL_BACKEND`` overrides it (``emulator`` runs the Metal sources on the CPU,
    for tests; ``none`` disables kernels).
    """
    forced = os.environ.get("KIMI_K3_KERNEL_BACKEND")
    if forced:
        return None if forced == "none" else forced
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


@dataclass
class Instance:
    """One way a kernel is launched: the dtypes of its inputs and outputs, its template."""

    input_dtypes: list
    output_dtypes: list
    template: list = field(default_factory=list)


@dataclass
class Kernel:
    """A kernel written once in the dialect.

    ``instances`` lists the dtype/template combinations the project launches it with; the
    CUDA compile check (tests/test_cuda_compile.py) renders and compiles each of them.
    """

    name: str
    input_names: list
    output_names: list
    body: str
    header: str = ""
    instances: list = field(default_factory=list)
    shared_memory: int = 0  # dynamic shared memory bytes (CUDA only)
    _built: dict = field(default_factory=dict, repr=False)

    def source(self, backend: str) -> str:
        return render(self.body, backend)

    def get(self, backend: str):
        """The backend's kernel object, built on first use."""
        if backend not in self._built:
            self._built[backend] = self._build(backend)
        return self._built[backend]

    def _build(self, backend: str):
        if backend == "cuda":
            return mx.fast.cuda_kernel(
                self.name, self.input_names, self.output_names, self.source("cuda"),
                header=render_header(self.header, "cuda"), shared_memory=self.shared_memory,
            )
        args = (self.name, self.input_names, self.output_names, self.source("metal"))
        header = render_header(self.header, "metal")
        if backend == "metal":
            return mx.fast.metal_kernel(*args, header=header)
        if backend == "emulator":
            from .metal_emulator import metal_kernel

            return metal_kernel(*args, header=header, strict=True)
        raise ValueError(f"no kernels for backend {backend!r}")

    def __call__(self, backend: str, **launch):
        """Launch on ``backend`` with ``mx.fast.metal_kernel``'s call arguments."""
        return self.get(backend)(**launch)
