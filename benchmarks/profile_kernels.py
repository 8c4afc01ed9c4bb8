"""Launch every kernel the dispatchers select once per round, for a profiler; or compile them.

Meant to run under NVIDIA's ``ncu`` on the GPU (``benchmarks/h200.sh profile``), which then
reports each kernel's GPU time, registers and DRAM bytes (K3's shapes; the MXFP4 kernels on
the layout the expert store holds there, tiles on CUDA):

    ncu --metrics gpu__time_duration.sum,dram__bytes.sum,launch__registers_per_thread \\
        python -m benchmarks.profile_kernels
    python -m benchmarks.profile_kernels --only mxfp4_one,mxfp4_mma   # some kernels only
    KIMI_K3_KERNEL_BACKEND=emulator python -m benchmarks.profile_kernels --quick  # CPU smoke

With ``--ptxas`` it instead compiles every kernel's CUDA rendering with ``nvcc -Xptxas -v``
and prints registers, stack frame and spills per kernel (no GPU needed, only nvcc).

With ``--sass`` it disassembles the dispatched MXFP4 decode kernels' sm_90 code (nvcc, then
NVIDIA's ``nvdisasm``: on PATH, or from the ``nvidia-cuda-nvdisasm`` wheel) and counts the
instructions of each one's main loop (first to last tensor-core instruction): a static cost
per MMA, no GPU needed.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np


def ptxas(kernel, instances=None, timeout=None, disassemble=None):
    """``nvcc -Xptxas -v`` (sm_90, -O3, to a cubin) of the kernel's CUDA translation unit.
    Returns (return code, stderr, [(entry function, registers, (stack, spill stores, spill
    loads))]); registers and the triple are None where ptxas did not report them. With
    ``disassemble`` (an ``nvdisasm`` path) the stderr slot holds the cubin's SASS instead."""
    from kimi_k3.kernels import source

    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / f"{kernel.name}.cu"
        cu.write_text(source.cuda_translation_unit(kernel, instances))
        cmd = ["nvcc", "-arch=sm_90", "-std=c++17", "-O3", "-Xptxas", "-v", "--cubin", str(cu)]
        cubin = cu.with_suffix(".cubin")
        res = subprocess.run(
            cmd + ["-o", str(cubin)], capture_output=True, text=True, timeout=timeout
        )
        text = res.stderr
        if disassemble and res.returncode == 0:
            dis = [disassemble, "-c", str(cubin)]
            text = subprocess.run(dis, capture_output=True, text=True, timeout=timeout).stdout
    entries = []
    for fn, body in re.findall(
        r"Compiling entry function '([^']+)'.*?\n(.*?)(?=ptxas info    : Compiling|\Z)",
        res.stderr,
        re.S,
    ):
        regs = re.search(r"Used (\d+) registers", body)
        stack = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", body
        )
        entries.append((fn, regs and regs.group(1), stack and stack.groups()))
    return res.returncode, text, entries


def register_count(kernel, instances=None, timeout=300) -> str:
    """ptxas's register count for the first entry of ``ptxas(kernel, instances)``, with its
    spill stores if any (" (spill N)"), or "?" where nvcc is missing, fails or says nothing."""
    try:
        _, _, entries = ptxas(kernel, instances, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    if not entries or entries[0][1] is None:
        return "?"
    _, regs, stack = entries[0]
    return regs + (f" (spill {stack[1]})" if stack and stack[1] != "0" else "")


def nvdisasm() -> str | None:
    """NVIDIA's disassembler: on PATH, else from the ``nvidia-cuda-nvdisasm`` wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    for root in map(Path, sys.path):
        for hit in sorted(root.glob("nvidia/*/bin/nvdisasm")):
            return str(hit)
    return None


_SASS_LINE = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Instructions from the first to the last tensor-core instruction (HMMA, IMMA) of one
    function's SASS (``nvdisasm -c``): the main loop of a decode kernel whose prologue and
    epilogue have none. Returns (count, opcode counts), (0, empty) without MMAs."""
    ops = [m.group(1) for m in map(_SASS_LINE.match, sass.splitlines()) if m]
    mma = [i for i, op in enumerate(ops) if op in ("HMMA", "IMMA")]
    if not mma:
        return 0, collections.Counter()
    body = ops[mma[0] : mma[-1] + 1]
    return len(body), collections.Counter(body)


def static_cost_instances():
    """(label, kernel, instance) of the dispatched decode kernels on tiles at K3's size, bf16
    latents: ``mxfp4_mma``'s two projections (the three-launch decode) and ``mxfp4_one``."""
    from kimi_k3.kernels import mxfp4_mma, mxfp4_one

    gate_up, _, _, down = mxfp4_mma.MXFP4_MMA.instances
    out = []
    for label, glu, inst in (("mxfp4_mma gate/up", True, gate_up), ("mxfp4_mma down", False, down)):
        shape = mxfp4_mma.dispatched_shape("cuda", dict(inst.template)["KD"], glu)
        kernel = mxfp4_mma.tiled_layout(mxfp4_mma.dispatched_kernel(glu, shape))
        out.append((label, kernel, inst))
    inst = mxfp4_one.MXFP4_ONE.instances[0]
    t = dict(inst.template)
    one = mxfp4_one.tiled_layout(mxfp4_one.dispatched_kernel(t["RT"], t["SK"]))
    out.append(("mxfp4_one", one, inst))
    return out


def sass_report():
    tool = nvdisasm()
    if tool is None or shutil.which("nvcc") is None:
        raise SystemExit("--sass needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm)")
    print(
        "| kernel | registers | spill stores (bytes) | loop instructions | MMAs | per MMA | "
        "most frequent |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for label, kernel, inst in static_cost_instances():
        code, sass, entries = ptxas(kernel, [inst], disassemble=tool)
        if code or not entries:
            print(f"| {label} | failed | | | | | |")
            continue
        _, regs, stack = entries[0]
        n, ops = loop_mix(sass)
        mma = ops["HMMA"] + ops["IMMA"]
        top = ", ".join(f"{op} {c}" for op, c in ops.most_common(6))
        spill = stack[1] if stack else "?"
        print(f"| {label} | {regs} | {spill} | {n} | {mma} | {n / max(mma, 1):.1f} | {top} |")


def ptxas_report():
    from tests.test_cuda_compile import KERNELS

    for kernel in KERNELS:
        code, err, entries = ptxas(kernel)
        for fn, regs, stack in entries:
            print(f"{fn[:90]:90s} regs {regs or '?':>4s} stack/spill-st/spill-ld {stack or '?'}")
        if code:
            print(kernel.name, "FAILED", err[-2000:])


# (D, I, decode experts, prefill experts, top-k, prefill tokens, KDA heads, head dim, T)
K3 = (3584, 3072, 32, 96, 16, 512, 96, 128, 1024)
QUICK = (128, 128, 8, 8, 4, 40, 2, 64, 64)


def kernel_runs(dims=K3) -> dict:
    """name -> a call of that kernel on random inputs (built, not evaluated); every kernel
    the dispatchers select on this backend's path. The MXFP4 kernels on the expert store's
    layout; the CUDA-only ones are left out elsewhere, Metal's LUT ones on CUDA too."""
    from benchmarks.bench_kda import decode_layer, layer, mixer_inputs
    from benchmarks.bench_mxfp4 import BETA, CAP, random_experts, routing, store
    from kimi_k3.kernels import (
        kda_decode,
        kda_prefill,
        mxfp4_decode,
        mxfp4_mma,
        mxfp4_one,
        mxfp4_prefill,
        mxfp4_prefill_mma,
        source,
    )
    from kimi_k3.kernels.expert_layout import is_tiled

    D, I, E1, EP, k, T, H, K, TK = dims
    backend = source.backend()
    if backend is None:
        raise SystemExit("no kernel backend here: Metal, CUDA or KIMI_K3_KERNEL_BACKEND=emulator")
    p, x, _ = decode_layer(H, K)
    pl, xs = layer(H, K), mixer_inputs(H, K, TK)
    rng = np.random.default_rng(0)
    w1, wP = (store(random_experts(e, D, I, s), D, I) for s, e in enumerate((E1, EP)))
    inds1, wts1 = routing(1, E1, k, rng)
    indsP, wtsP = routing(T, EP, k, rng)
    z1 = mx.random.normal((1, D)).astype(mx.bfloat16)
    zP = mx.random.normal((T, D)).astype(mx.bfloat16)
    mx.eval(xs, z1, zP, inds1, wts1, indsP, wtsP)
    one, prefill = (z1, w1, inds1, wts1, BETA, CAP), (zP, wP, indsP, wtsP, BETA, CAP)
    tiled = is_tiled(w1)
    runs = {
        "kda_decode": lambda: kda_decode.kda_decode(backend, p, *x),
        "kda_prefill": lambda: kda_prefill.kda_prefill(backend, pl, *xs),
        "mxfp4_mma": lambda: (
            mxfp4_mma.expert_glu_decode_tiled if tiled else mxfp4_mma.expert_glu_decode
        )(*one, backend=backend),
        "mxfp4_one": lambda: (
            mxfp4_one.expert_glu_decode_tiled if tiled else mxfp4_one.expert_glu_decode
        )(*one, backend=backend),
        "mxfp4_prefill_mma": lambda: mxfp4_prefill_mma.expert_glu_prefill_mma(
            *prefill, backend=backend, tiled=tiled
        ),
    }
    if backend != "cuda":
        runs["mxfp4_decode"] = lambda: mxfp4_decode.expert_glu_decode(*one, backend=backend)
        runs["mxfp4_prefill"] = lambda: mxfp4_prefill.expert_glu_prefill(*prefill, backend=backend)
    return runs


def run_kernels(rounds: int, only: str | None = None, dims=K3) -> list[str]:
    """Every kernel of ``kernel_runs`` (or those named in ``only``, comma-separated) launched
    and evaluated once per round; returns the names run."""
    runs = kernel_runs(dims)
    names = [n for n in runs if only is None or n in only.split(",")]
    for _ in range(rounds):
        for name in names:
            mx.eval(runs[name]())
        mx.synchronize()
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ptxas", action="store_true")
    parser.add_argument("--sass", action="store_true", help="decode kernels' loop costs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", help="comma-separated subset of the kernels to run")
    parser.add_argument("--quick", action="store_true", help="small shapes, one round")
    args = parser.parse_args(argv)
    if args.ptxas:
        ptxas_report()
    elif args.sass:
        sass_report()
    else:
        dims = QUICK if args.quick else K3
        names = run_kernels(1 if args.quick else args.rounds, args.only, dims)
        print("launched:", ", ".join(names))
        return names


if __name__ == "__main__":
    main()
