"""Launch every kernel of this project once per round at K3's shapes, for a profiler.

Meant to run under NVIDIA's ``ncu`` on the H200 (``benchmarks/h200.sh profile``), which then
reports each kernel's GPU time, registers and DRAM bytes:

    ncu --metrics gpu__time_duration.sum,dram__bytes.sum,launch__registers_per_thread \\
        python -m benchmarks.profile_kernels

With ``--ptxas`` it instead compiles every kernel's CUDA rendering with ``nvcc -Xptxas -v``
and prints registers, stack frame and spills per kernel (no GPU needed, only nvcc).

With ``--sass`` it disassembles the MXFP4 decode kernels' sm_90 code (nvcc, then NVIDIA's
``nvdisasm``: on PATH, or from the ``nvidia-cuda-nvdisasm`` wheel) and counts the
instructions of each one's main loop (first to last tensor-core instruction), per decode
(shifts or byte permutes) and launch bound: a static cost per MMA, no GPU needed.
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
    """(label, kernel, instance) for the decode kernels' sm_90 static costs: mxfp4_mma's two
    projections and mxfp4_fused at K3 size, bf16 latents, shift and byte-permute decode,
    without and with a bound of two threadgroups per SM."""
    from kimi_k3.kernels import mxfp4_fused, mxfp4_mma

    gate_up, _, _, down = mxfp4_mma.MXFP4_MMA.instances
    mma_threads = {p: 32 * rt * sk for p, (rt, sk, *_) in mxfp4_mma.LAUNCH.items()}
    base = [  # the instances are the kernels' own (their modules' LAUNCH)
        ("mxfp4_mma gate/up", mxfp4_mma.MXFP4_MMA, gate_up, mma_threads["gate_up"]),
        ("mxfp4_mma down", mxfp4_mma.MXFP4_MMA, down, mma_threads["down"]),
        (
            "mxfp4_fused",
            mxfp4_fused.MXFP4_FUSED,
            mxfp4_fused.MXFP4_FUSED.instances[0],
            32 * mxfp4_fused.LAUNCH[1],
        ),
    ]
    out = []
    for label, kernel, inst, threads in base:
        for decode in ("shift", "byte permute"):
            for blocks in (1, 2):
                k = kernel.bounded(threads, blocks)
                k = mxfp4_mma.byte_permute_decode(k) if decode == "byte permute" else k
                out.append((f"{label}, {decode}, {blocks} per SM", k, inst))
    return out


def sass_report():
    tool = nvdisasm()
    if tool is None or shutil.which("nvcc") is None:
        raise SystemExit("--sass needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm)")
    print(
        "| kernel, decode, bound | registers | spill stores (bytes) | loop instructions | "
        "MMAs | per MMA | most frequent |"
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


def run_kernels(rounds: int, only: str | None = None):
    from benchmarks.bench_kda import decode_layer, layer, mixer_inputs
    from benchmarks.bench_mxfp4 import BETA, CAP, random_experts, routing
    from kimi_k3.kernels import (
        kda_decode,
        kda_prefill,
        mxfp4_decode,
        mxfp4_mma,
        mxfp4_prefill,
        mxfp4_prefill_mma,
        source,
    )

    backend = source.backend()
    p, x, _ = decode_layer()
    pl = layer()
    xs = mixer_inputs(1024)
    w = random_experts(32, 3584, 3072, 0)
    rng = np.random.default_rng(0)
    inds1, wts1 = routing(1, 32, 16, rng)
    z1 = mx.random.normal((1, 3584)).astype(mx.bfloat16)
    w896 = random_experts(96, 3584, 3072, 1)
    indsP, wtsP = routing(512, 96, 16, rng)
    zP = mx.random.normal((512, 3584)).astype(mx.bfloat16)
    mx.eval(xs, z1, zP, inds1, wts1, indsP, wtsP)
    runs = {
        "kda_decode": lambda: kda_decode.kda_decode(backend, p, *x),
        "kda_prefill": lambda: kda_prefill.kda_prefill(backend, pl, *xs),
        "mxfp4_decode": lambda: mxfp4_decode.expert_glu_decode(
            z1, w, inds1, wts1, BETA, CAP, backend
        ),
        "mxfp4_mma": lambda: mxfp4_mma.expert_glu_decode(z1, w, inds1, wts1, BETA, CAP, backend),
        "mxfp4_mma_ac": lambda: mxfp4_mma.expert_glu_decode_ac(
            z1, w, inds1, wts1, BETA, CAP, backend
        ),
        "mxfp4_prefill": lambda: mxfp4_prefill.expert_glu_prefill(
            zP, w896, indsP, wtsP, BETA, CAP, backend=backend
        ),
        "mxfp4_prefill_mma": lambda: mxfp4_prefill_mma.expert_glu_prefill_mma(
            zP, w896, indsP, wtsP, BETA, CAP, backend=backend
        ),
    }
    for _ in range(rounds):
        for name, fn in runs.items():
            if only is None or name in only.split(","):
                mx.eval(fn())
        mx.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ptxas", action="store_true")
    parser.add_argument("--sass", action="store_true", help="decode kernels' loop costs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", help="comma-separated subset of the kernel groups to run")
    args = parser.parse_args()
    if args.ptxas:
        ptxas_report()
    elif args.sass:
        sass_report()
    else:
        run_kernels(args.rounds, args.only)


if __name__ == "__main__":
    main()
