"""A Metal emulator for CI: runs ``mx.fast.metal_kernel`` sources on the CPU.

``metal_kernel(...)`` takes the same arguments as ``mx.fast.metal_kernel`` and returns an
object called like the one MLX returns. A call writes the source MLX would generate (header,
template line, the ``[[kernel]]`` signature with MLX's parameter order, address spaces and
thread attributes, the body, the explicit instantiation), compiles it with g++ against
``emulator/metal_shim.h`` into a shared library cached by source hash, and runs the grid with
``emulator/runtime.h``: every threadgroup's threads are fibers with real barriers, threadgroup
memory and 32-lane simdgroup operations. See docs/kernels.md for what it checks.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import stat
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

from kimi_k3 import cache_dir as user_cache

SHIM_DIR = Path(__file__).parent / "emulator"
CXXFLAGS = ["-O2", "-U_FORTIFY_SOURCE", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes", "-w"]
MAX_CONSTANT_ARRAY_SIZE = 8  # inputs with fewer elements go to the constant address space
THREADGROUP_MEMORY = 32 * 1024 + 64  # Apple GPUs: 32 KB, plus the C runtime's few bss bytes
CANARY = 4096  # bytes of 0xFF around every buffer: reads past the end see NaN
CUDA_MAX_BLOCKS = (2**31 - 1, 65535, 65535)  # gridDim.x, .y, .z limits of a CUDA launch

# (MSL type, numpy storage dtype) per MLX dtype, as MLX's get_type_string names them.
TYPES = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.bool_: ("bool", np.bool_),
    mx.int8: ("int8_t", np.int8),
    mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.uint64: ("uint64_t", np.uint64),
}

# MLX's thread attributes, in its order, with their types.
ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]

# C++ expressions (over the runtime's state) giving each attribute's value for the current fiber.
_CEIL = "(({a}) + ({b}) - 1) / ({b})"
_N = "kk::rt->nthreads"
ATTRIBUTE_VALUES = {
    "dispatch_quadgroups_per_threadgroup": _CEIL.format(a=_N, b=4),
    "dispatch_simdgroups_per_threadgroup": _CEIL.format(a=_N, b=32),
    "dispatch_threads_per_threadgroup": "uint3(kk::rt->tg.x, kk::rt->tg.y, kk::rt->tg.z)",
    "grid_origin": "uint3(0u, 0u, 0u)",
    "grid_size": "uint3(kk::rt->grid.x, kk::rt->grid.y, kk::rt->grid.z)",
    "quadgroup_index_in_threadgroup": "kk::me().lin / 4",
    "quadgroups_per_threadgroup": _CEIL.format(a=_N, b=4),
    "simdgroup_index_in_threadgroup": "kk::me().lin / 32",
    "simdgroups_per_threadgroup": _CEIL.format(a=_N, b=32),
    "thread_execution_width": "32u",
    "thread_index_in_quadgroup": "kk::me().lin % 4",
    "thread_index_in_simdgroup": "kk::me().lin % 32",
    "thread_index_in_threadgroup": "kk::me().lin",
    "thread_position_in_grid": (
        "uint3(kk::rt->group.x * kk::rt->tg.x + kk::me().pos.x, "
        "kk::rt->group.y * kk::rt->tg.y + kk::me().pos.y, "
        "kk::rt->group.z * kk::rt->tg.z + kk::me().pos.z)"
    ),
    "thread_position_in_threadgroup": "uint3(kk::me().pos.x, kk::me().pos.y, kk::me().pos.z)",
    "threadgroup_position_in_grid": "uint3(kk::rt->group.x, kk::rt->group.y, kk::rt->group.z)",
    "threadgroups_per_grid": "uint3(kk::rt->groups.x, kk::rt->groups.y, kk::rt->groups.z)",
    "threads_per_grid": "uint3(kk::rt->grid.x, kk::rt->grid.y, kk::rt->grid.z)",
    "threads_per_simdgroup": "32u",
    "threads_per_threadgroup": "uint3(kk::rt->size.x, kk::rt->size.y, kk::rt->size.z)",
}


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$KIMI_K3_EMULATOR_CACHE``, else ``metal_emulator``
    in the user's cache (``kimi_k3.cache_dir()``), created with mode 0700. A library found
    there is loaded into this process, so the directory must be private (``check_private``)."""
    path = Path(os.environ.get("KIMI_K3_EMULATOR_CACHE") or user_cache() / "metal_emulator")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(path, directory=True)
    return path


def check_private(path: Path, directory: bool = False) -> None:
    """Raise unless ``path`` is this user's own (a directory or a regular file, no symlink)
    and no one else may write to it."""
    st = os.lstat(path)
    kind = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(
            f"[metal_emulator] {path}: compiled kernels are loaded from here, so it must be "
            f"this user's own {'directory' if directory else 'file'}, writable by no one else "
            f"(owner {st.st_uid}, mode {stat.filemode(st.st_mode)}); set "
            "KIMI_K3_EMULATOR_CACHE to a private directory"
        )


def template_text(template) -> str:
    """``<1, float>`` as MLX's write_template prints template arguments."""
    parts = []
    for _, arg in template:
        if isinstance(arg, mx.Dtype):
            parts.append(TYPES[arg][0])
        elif isinstance(arg, bool):
            parts.append(str(int(arg)))
        else:
            parts.append(str(int(arg)))
    return "<" + ", ".join(parts) + ">"


def kernel_name(name: str, inputs, output_dtypes, template) -> str:
    """The function name MLX gives a custom kernel instantiation."""
    out = "custom_kernel_" + name
    if template:
        out += "_" + re.sub(r"<|>|(, )", "_", template_text(template))[:-1]
    for x in inputs:
        out += "_" + TYPES[x.dtype][0]
        if x.ndim == 0:
            out += "s"
        elif x.size < MAX_CONSTANT_ARRAY_SIZE:
            out += "c"
    for dt in output_dtypes:
        out += "_" + TYPES[dt][0]
    return out


def shape_infos(source: str, input_names) -> list[tuple[bool, bool, bool]]:
    return [
        (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def attributes(source: str) -> list[tuple[str, str]]:
    """The thread attributes whose names occur in the source, in MLX's order."""
    return [(a, t) for a, t in ATTRIBUTES if a in source]


def metal_source(
    fname,
    header,
    source,
    input_names,
    inputs,
    output_names,
    output_dtypes,
    template,
    atomic_outputs,
) -> str:
    """The Metal source MLX compiles for this call (its write_signature + instantiation)."""
    text = header
    if template:
        kinds = [
            "typename" if isinstance(a, mx.Dtype) else "bool" if isinstance(a, bool) else "int"
            for _, a in template
        ]
        params = (f"{k} {n}" for k, (n, _) in zip(kinds, template, strict=True))
        text += "template <" + ", ".join(params) + ">\n"
    text += f"[[kernel]] void {fname}(\n"
    attrs = attributes(source)
    index = 0
    for name, x, info in zip(input_names, inputs, shape_infos(source, input_names), strict=True):
        space = "constant" if x.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if x.ndim == 0 else "*"
        text += f"  const {space} {TYPES[x.dtype][0]}{ref} {name} [[buffer({index})]],\n"
        index += 1
        if x.ndim > 0:
            for present, decl in zip(
                info,
                (
                    "const constant int* {}_shape",
                    "const constant int64_t* {}_strides",
                    "const constant int& {}_ndim",
                ),
                strict=True,
            ):
                if present:
                    text += "  " + decl.format(name) + f" [[buffer({index})]],\n"
                    index += 1
    for name, dt in zip(output_names, output_dtypes, strict=True):
        type_ = TYPES[dt][0]
        type_ = f"atomic<{type_}>" if atomic_outputs else type_
        text += f"  device {type_}* {name} [[buffer({index})]]"
        last = index >= len(inputs) + len(output_names) - 1 and not attrs
        text += ") {\n" if last else ",\n"
        index += 1
    for i, (attr, type_) in enumerate(attrs):
        text += f"  {type_} {attr} [[{attr}]]"
        text += ") {\n" if i == len(attrs) - 1 else ",\n"
    text += source + "\n}\n"
    if template:
        inst = fname + template_text(template)
        text += f'\ntemplate [[host_name("{fname}")]] [[kernel]] decltype({inst}) {inst};\n'
    return text


_THREADGROUP_DECL = re.compile(r"\bthreadgroup\b(?!_)([^;{}]*);")
# an array, optionally aligned: ``float2 sm[N] __attribute__((aligned(16)))``
_ARRAY_DECL = re.compile(
    r"^\s*[\w:<>, ]+?\s+\w+\s*(\[[^\]]+\]\s*)+(__attribute__\(\(aligned\(\d+\)\)\)\s*)?$"
)


def check_threadgroup_declarations(text: str) -> None:
    """The shim turns ``threadgroup`` into ``static``: fine for arrays, wrong for pointers."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
    for m in _THREADGROUP_DECL.finditer(text):
        if not _ARRAY_DECL.match(m.group(1)):
            raise ValueError(
                "[metal_emulator] only threadgroup array declarations are supported, got "
                f"'threadgroup{m.group(1)};' (index the array instead of a threadgroup pointer)"
            )


def _entry_code(fname, inputs, input_names, source, output_dtypes, template, atomic) -> str:
    """The C++ that calls the kernel for the current fiber, and the exported launcher."""
    args = []
    k = 0
    for x, info in zip(inputs, shape_infos(source, input_names), strict=True):
        type_ = TYPES[x.dtype][0]
        args.append(f"*({type_}*)kk_bufs[{k}]" if x.ndim == 0 else f"({type_}*)kk_bufs[{k}]")
        k += 1
        if x.ndim > 0:
            for present, type_ in zip(info, ("int*", "int64_t*", "int&"), strict=True):
                if present:
                    args.append(
                        f"*(int*)kk_bufs[{k}]" if type_ == "int&" else f"({type_})kk_bufs[{k}]"
                    )
                    k += 1
    for dt in output_dtypes:
        type_ = f"atomic<{TYPES[dt][0]}>" if atomic else TYPES[dt][0]
        args.append(f"({type_}*)kk_bufs[{k}]")
        k += 1
    args += [ATTRIBUTE_VALUES[a] for a, _ in attributes(source)]
    call = fname + (template_text(template) if template else "")
    return (
        "\nstatic void** kk_bufs = (void**)1;  // initialised: bss is threadgroup memory\n"
        f"static void kk_entry() {{ {call}(\n      " + ",\n      ".join(args) + "); }\n"
        'extern "C" int kk_launch(void** bufs, const unsigned* grid, const unsigned* tg,\n'
        "                         int strict, unsigned tg_limit, char* err, int errlen) {\n"
        "  kk_bufs = bufs;\n"
        "  return kk::launch(kk_entry, grid, tg, strict, tg_limit, err, errlen);\n}\n"
    )


def _compile(unit: str) -> ctypes.CDLL:
    shims = "".join((SHIM_DIR / f).read_text() for f in ("metal_shim.h", "runtime.h"))
    key = hashlib.sha256((unit + shims + " ".join(CXXFLAGS)).encode()).hexdigest()[:24]
    lib = cache_dir() / f"k_{key}.so"
    if not lib.exists():
        cpp = cache_dir() / f"k_{key}.cpp"
        cpp.write_text(unit)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = ["g++", *CXXFLAGS, f"-I{SHIM_DIR}", str(cpp), "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"[metal_emulator] compile failed ({cpp}):\n{res.stderr[-6000:]}")
        os.replace(tmp, lib)
    check_private(lib)
    dll = ctypes.CDLL(str(lib))
    dll.kk_launch.restype = ctypes.c_int
    return dll


def check_cuda_grid(grid, threadgroup) -> None:
    """Raise if CUDA could not launch this grid: MLX's cuda_kernel launches
    ``ceil(grid / threadgroup)`` blocks per dimension, and CUDA allows at most
    ``CUDA_MAX_BLOCKS`` (65535 in y and z). Metal has no such limit."""
    for axis, g, t, limit in zip("xyz", grid, threadgroup, CUDA_MAX_BLOCKS, strict=True):
        blocks = -(-int(g) // max(1, min(int(t), int(g))))
        if blocks > limit:
            raise RuntimeError(
                f"[metal_emulator] {blocks} threadgroups along {axis} (CUDA allows {limit})"
            )


class _Buffer:
    """A numpy buffer surrounded by 0xFF canaries (NaN if read, checked after the launch)."""

    def __init__(self, data: np.ndarray):
        raw = np.full(data.nbytes + 2 * CANARY, 0xFF, dtype=np.uint8)
        raw[CANARY : CANARY + data.nbytes] = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.raw, self.dtype, self.shape = raw, data.dtype, data.shape

    def pointer(self) -> int:
        return self.raw.ctypes.data + CANARY

    def array(self) -> np.ndarray:
        return self.raw[CANARY : self.raw.size - CANARY].view(self.dtype).reshape(self.shape)

    def canaries_intact(self) -> bool:
        return bool((self.raw[:CANARY] == 0xFF).all() and (self.raw[-CANARY:] == 0xFF).all())


def _to_numpy(x: mx.array) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return np.array(x)


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


class MetalKernel:
    """The emulator's stand-in for the object ``mx.fast.metal_kernel`` returns."""

    def __init__(
        self,
        name,
        input_names,
        output_names,
        source,
        header="",
        ensure_row_contiguous=True,
        atomic_outputs=False,
        compile_options=None,
        strict=False,
    ):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.atomic_outputs = atomic_outputs
        self.strict = strict  # also demand what CUDA needs: full simdgroups, exact grids
        self._libs: dict[str, ctypes.CDLL] = {}

    def generated_source(self, inputs, output_dtypes, template=()) -> str:
        """The exact Metal source MLX would compile for these inputs."""
        fname = kernel_name(self.name, inputs, output_dtypes, template)
        return metal_source(
            fname,
            self.header,
            self.source,
            self.input_names,
            inputs,
            self.output_names,
            output_dtypes,
            template,
            self.atomic_outputs,
        )

    def _library(self, inputs, output_dtypes, template) -> ctypes.CDLL:
        text = self.generated_source(inputs, output_dtypes, template)
        if text not in self._libs:
            check_threadgroup_declarations(self.header + self.source)
            fname = kernel_name(self.name, inputs, output_dtypes, template)
            unit = '#include "metal_shim.h"\n' + text
            unit += _entry_code(
                fname,
                inputs,
                self.input_names,
                self.source,
                output_dtypes,
                template,
                self.atomic_outputs,
            )
            self._libs[text] = _compile(unit)
        return self._libs[text]

    def __call__(
        self,
        *,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        verbose=False,
        stream=None,
    ):
        template = list(template or [])
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)}"
            )
        if verbose:
            print(self.generated_source(inputs, output_dtypes, template))
        if self.strict:
            check_cuda_grid(grid, threadgroup)
        lib = self._library(inputs, output_dtypes, template)
        buffers = []
        for x, info in zip(inputs, shape_infos(self.source, self.input_names), strict=True):
            buffers.append(_Buffer(_to_numpy(x)))
            if x.ndim > 0:
                strides = np.cumprod((1,) + tuple(x.shape[::-1]))[:-1][::-1]
                extra = (
                    np.array(x.shape, np.int32),
                    np.array(strides, np.int64),
                    np.array(x.ndim, np.int32),
                )
                buffers += [_Buffer(e) for present, e in zip(info, extra, strict=True) if present]
        outputs = []
        for shape, dt in zip(output_shapes, output_dtypes, strict=True):
            out = _Buffer(np.zeros(tuple(shape), TYPES[dt][1]))
            if init_value is None:
                out.raw[:] = 0xFF
            else:
                out.array()[...] = _to_numpy(mx.full(tuple(shape), init_value, dt))
            outputs.append(out)
        ptrs = (ctypes.c_void_p * (len(buffers) + len(outputs)))(
            *[b.pointer() for b in buffers + outputs]
        )
        err = ctypes.create_string_buffer(512)
        status = lib.kk_launch(
            ptrs,
            (ctypes.c_uint * 3)(*grid),
            (ctypes.c_uint * 3)(*threadgroup),
            int(self.strict),
            THREADGROUP_MEMORY,
            err,
            len(err),
        )
        if status != 0:
            raise RuntimeError(f"[metal_emulator] {self.name}: {err.value.decode()}")
        for b in buffers + outputs:
            if not b.canaries_intact():
                raise RuntimeError(f"[metal_emulator] {self.name}: write outside a buffer")
        pairs = zip(outputs, output_dtypes, strict=True)
        return [_from_numpy(o.array().copy(), dt) for o, dt in pairs]


# Same arguments as ``mx.fast.metal_kernel`` (plus ``strict``); runs on the CPU.
metal_kernel = MetalKernel
