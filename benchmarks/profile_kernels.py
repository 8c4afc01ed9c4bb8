"""Launch every kernel of this project once per round at K3's shapes, for a profiler.

Meant to run under NVIDIA's ``ncu`` on the H200 (``benchmarks/h200.sh profile``), which then
reports each kernel's GPU time, registers and DRAM bytes:

    ncu --metrics gpu__time_duration.sum,dram__bytes.sum,launch__registers_per_thread \\
        python -m benchmarks.profile_kernels

With ``--ptxas`` it instead compiles every kernel's CUDA rendering with ``nvcc -Xptxas -v``
and prints registers, stack frame and spills per kernel (no GPU needed, only nvcc).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np


def ptxas(kernel, instances=None, timeout=None):
    """``nvcc -Xptxas -v`` (sm_90, -O3, to a cubin) of the kernel's CUDA translation unit.
    Returns (return code, stderr, [(entry function, registers, (stack, spill stores, spill
    loads))]); registers and the triple are None where ptxas did not report them."""
    from kimi_k3.kernels import source

    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / f"{kernel.name}.cu"
        cu.write_text(source.cuda_translation_unit(kernel, instances))
        cmd = ["nvcc", "-arch=sm_90", "-std=c++17", "-O3", "-Xptxas", "-v", "--cubin", str(cu)]
        res = subprocess.run(
            cmd + ["-o", str(cu.with_suffix(".cubin"))],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
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
    return res.returncode, res.stderr, entries


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
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", help="comma-separated subset of the kernel groups to run")
    args = parser.parse_args()
    if args.ptxas:
        ptxas_report()
    else:
        run_kernels(args.rounds, args.only)


if __name__ == "__main__":
    main()
