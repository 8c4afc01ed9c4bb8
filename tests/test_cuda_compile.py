"""Every kernel's CUDA rendering compiles with nvcc as MLX's cuda_kernel would wrap it.

Kernels are found generically: every ``source.Kernel`` at module level in every module of
``kimi_k3.kernels``, each of its ``instances`` compiled for sm_90 (the H200). MLX's own device
utils header is not available here; standard CUDA headers stand in for it
(``source.cuda_translation_unit``). Skipped where nvcc is not on PATH.
"""

import importlib
import pkgutil
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

import kimi_k3.kernels as pkg
from kimi_k3.kernels import source


def all_kernels():
    found = {}
    for mod in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{mod.name}")
        for obj in vars(module).values():
            if isinstance(obj, source.Kernel):
                found[obj.name] = obj
    return sorted(found.values(), key=lambda k: k.name)


KERNELS = all_kernels()
SHARED_LIMIT = 48 * 1024  # static shared memory per block without an opt-in


def test_kernels_are_found_and_list_instances():
    names = {k.name for k in KERNELS}
    assert {"kda_decode", "kda_chunk_prep", "kda_chunk_state"} <= names
    for k in KERNELS:
        assert k.instances, f"{k.name} lists no instances to compile-check"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_renderings_use_only_their_backends_words(kernel):
    cuda = source.render_header(kernel.header, "cuda") + kernel.source("cuda")
    metal = source.render_header(kernel.header, "metal") + kernel.source("metal")
    words = set(source.WORDS) | set(source.CALLS)
    for text in (cuda, metal):
        assert not words & set(re.findall(r"\b[A-Z_]+\b", text))
    assert not re.search(r"\bthreadgroup\b|simd_|metal::|\bdevice\b", cuda)
    assert not re.search(r"__shared__|__syncthreads|threadIdx|__shfl", metal)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_renderings_compile(tmp_path):
    jobs = [(k, i, inst) for k in KERNELS for i, inst in enumerate(k.instances)]

    def compile_one(job):
        kernel, i, inst = job
        cu = tmp_path / f"{kernel.name}_{i}.cu"
        cu.write_text(source.cuda_translation_unit(kernel, inst))
        cmd = ["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(cu), "-o", str(cu.with_suffix(".o")),
               "-Xptxas", "-v"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        return kernel.name, i, res

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(compile_one, jobs))
    for name, i, res in results:
        assert res.returncode == 0, f"{name} instance {i}:\n{res.stderr[-4000:]}"
        smem = [int(m) for m in re.findall(r"(\d+) bytes smem", res.stderr)]
        assert all(s <= SHARED_LIMIT for s in smem), f"{name}: {smem} bytes of shared memory"
        assert "spill" not in res.stderr or " 0 bytes spill stores" in res.stderr, res.stderr
