"""Every kernel's CUDA rendering compiles with nvcc as MLX's cuda_kernel would wrap it.

Kernels are found generically: every ``source.Kernel`` at module level in every module of
``kimi_k3.kernels``, all of its ``instances`` compiled to PTX for sm_90 (the H200) in one
translation unit per kernel. MLX's own device utils header is not available here; standard
CUDA headers stand in for it (``source.cuda_translation_unit``). Static shared memory per
function is read from the PTX. Skipped where nvcc is not on PATH.
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
    assert {"kda_decode", "kda_chunk_prep", "kda_chunk_state", "kda_chunk_state_mma"} <= names
    for k in KERNELS:
        assert k.instances, f"{k.name} lists no instances to compile-check"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_renderings_use_only_their_backends_words(kernel):
    def code(text):
        return re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)

    cuda = code(source.render_header(kernel.header, "cuda") + kernel.source("cuda"))
    metal = code(source.render_header(kernel.header, "metal") + kernel.source("metal"))
    words = set(source.WORDS) | set(source.CALLS)
    for text in (cuda, metal):
        assert not words & set(re.findall(r"\b[A-Z_]+\b", text))
    assert not re.search(r"\bthreadgroup\b|simd_|metal::|\bdevice\b", cuda)
    assert not re.search(r"__shared__|__syncthreads|threadIdx|__shfl", metal)


def shared_bytes(ptx: str) -> dict[str, int]:
    """Static shared memory of each ``.entry`` in a PTX file."""
    out = {}
    for part in ptx.split(".entry ")[1:]:
        name = part.split("(", 1)[0].strip()
        out[name] = sum(int(n) for n in re.findall(r"\.shared\s[^;]*\[(\d+)\]", part))
    return out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_renderings_compile(tmp_path):
    def compile_one(kernel):
        cu = tmp_path / f"{kernel.name}.cu"
        cu.write_text(source.cuda_translation_unit(kernel))
        ptx = cu.with_suffix(".ptx")
        cmd = ["nvcc", "-arch=sm_90", "-std=c++17", "--ptx", str(cu), "-o", str(ptx)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        return kernel, res, ptx.read_text() if res.returncode == 0 else ""

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(compile_one, KERNELS))
    for kernel, res, ptx in results:
        assert res.returncode == 0, f"{kernel.name}:\n{res.stderr[-4000:]}"
        smem = shared_bytes(ptx)
        assert len(smem) == len({source.cuda_function(kernel, i) for i in kernel.instances})
        assert all(b <= SHARED_LIMIT for b in smem.values()), f"{kernel.name}: {smem}"


def test_launch_bounds_only_in_the_cuda_header():
    from kimi_k3.kernels import mxfp4_mma

    plain = mxfp4_mma.MXFP4_MMA
    bound = plain.bounded(256, 2)
    assert plain.bounded(256, 1) is plain
    assert plain.bounded(256, 2) is bound and bound.name == "mxfp4_mma_lb256x2"
    assert "launch_bounds(256, 2)" in bound.header_for("cuda")
    assert "launch_bounds" not in plain.header_for("cuda")
    assert bound.header_for("metal") == plain.header_for("metal")
    with pytest.raises(ValueError, match="launch bounds"):
        source.cuda_launch_bounds(2048, 1)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_launch_bounds_reach_the_compiler(tmp_path):
    """The redefined ``__global__`` gives the kernel ``.maxntid`` / ``.minnctapersm`` in PTX
    (what ptxas caps the registers by); the kernel without bounds has neither."""
    from kimi_k3.kernels import mxfp4_mma

    down = mxfp4_mma.MXFP4_MMA.instances[-1]
    for kernel, bounded in (
        (mxfp4_mma.MXFP4_MMA.bounded(256, 2), True),
        (mxfp4_mma.MXFP4_MMA, False),
    ):
        cu = tmp_path / f"{kernel.name}.cu"
        cu.write_text(source.cuda_translation_unit(kernel, [down]))
        ptx = cu.with_suffix(".ptx")
        cmd = ["nvcc", "-arch=sm_90", "-std=c++17", "--ptx", str(cu), "-o", str(ptx)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-4000:]
        text = ptx.read_text()
        assert (".maxntid 256, 1, 1" in text) is bounded
        assert (".minnctapersm 2" in text) is bounded


SASS = """
        /*0100*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0110*/                   HMMA.16816.F32 R8, R4, R12, RZ ;
        /*0120*/              @!P0 LOP3.LUT R1, R2, 0x7, RZ, 0xc0, !PT ;
        /*0130*/                   IMAD.SHL.U32 R3, R1, 0x200, RZ ;
        /*0140*/                   HMMA.16816.F32 R8, R4, R14, R8 ;
        /*0150*/                   EXIT ;
"""


def test_loop_mix_counts_from_the_first_to_the_last_mma():
    """``profile_kernels.loop_mix`` (the ``--sass`` report): opcodes of the span between the
    first and last tensor-core instruction, predicates and modifiers stripped."""
    from benchmarks.profile_kernels import loop_mix

    n, ops = loop_mix(SASS)
    assert n == 4 and ops == {"HMMA": 2, "LOP3": 1, "IMAD": 1}
    assert loop_mix("        /*0150*/                   EXIT ;") == (0, {})


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_sass_of_the_decode_loop():
    """The gate/up decode's main loop disassembled (nvdisasm from PATH or its wheel): the
    two double-buffered steps of (8, 1, 8, True) hold 2 x 2 blocks x 2 tiles x 8 MMAs."""
    from benchmarks.profile_kernels import loop_mix, nvdisasm, ptxas
    from kimi_k3.kernels import mxfp4_mma

    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    inst = mxfp4_mma.MXFP4_MMA.instances[0]
    code, sass, entries = ptxas(mxfp4_mma.MXFP4_MMA, [inst], disassemble=tool)
    assert code == 0 and entries
    n, ops = loop_mix(sass)
    assert ops["HMMA"] == 64 and n > 64


def tiled_variants():
    """The kernels a tiled store dispatches (derived from module-level ones, so not in
    ``KERNELS``): the one launch, the three-launch projections and the grouped prefill GEMM
    (each way of loading its scales)."""
    from kimi_k3.kernels import mxfp4_mma, mxfp4_one, mxfp4_prefill_mma

    rt, sk = mxfp4_one.shape_for("cuda", 3584, 3072)[:2]
    gate_up = mxfp4_mma.dispatched_kernel(True, mxfp4_mma.dispatched_shape("cuda", 3584, True))
    down = mxfp4_mma.dispatched_kernel(False, mxfp4_mma.dispatched_shape("cuda", 3072, False))
    kernels = [
        mxfp4_one.tiled_layout(mxfp4_one.dispatched_kernel(rt, sk)),
        mxfp4_mma.tiled_layout(gate_up),
        mxfp4_mma.tiled_layout(down),  # the same kernel as gate/up's while their bounds agree
    ]
    kernels += [
        mxfp4_prefill_mma.tiled_layout(mxfp4_prefill_mma.MXFP4_GROUPED_MMA, scales)
        for scales in mxfp4_prefill_mma.SCALES
    ]
    return list({k.name: k for k in kernels}.values())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_tiled_variants_compile():
    """The tiled rewrites (text swaps of their kernels) compile for sm_90, the decode kernels
    within 128 registers; one instance each (the bf16 latent's, at K3 size)."""
    from benchmarks.profile_kernels import ptxas

    for kernel in tiled_variants():
        code, err, entries = ptxas(kernel, [kernel.instances[0]], timeout=300)
        assert code == 0, f"{kernel.name}:\n{err[-4000:]}"
        assert entries and all(regs is not None for _, regs, _ in entries), kernel.name
        if "grouped" not in kernel.name:
            assert all(int(regs) <= 128 for _, regs, _ in entries), (kernel.name, entries)
