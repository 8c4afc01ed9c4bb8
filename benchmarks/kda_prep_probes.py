"""Where ``kda_chunk_prep``'s time goes: the kernel timed alone beside copies of it with one
part cut out (their results are wrong by design; only their times are reported).

- ``no solve``: pass 2's forward substitution removed (W and U are written unsolved; the
  loads of the right-hand sides and the stores stay);
- ``no scores``: pass 1's score dot products removed (the exponential factors, the
  barriers and everything else stay);
- ``no sub-block loop``: pass 1's loop over the four sub-blocks removed (factors, dot
  products and their 8 barriers per 16-channel tile), one barrier left in its place.

Inputs are ``bench_kda``'s recurrence inputs at K3's shape (96 heads x 128); ptxas's
registers per kernel where nvcc is on PATH.

    python3 -m benchmarks.kda_prep_probes --lengths 1024 8192 --out kda_prep_probes.md
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import mlx.core as mx

from benchmarks.bench_kda import emit, kernel_backend, median_time, mlx_run, recurrence_inputs
from benchmarks.profile_kernels import register_count
from kimi_k3.kernels import kda_prefill

# name: (first line of the cut, first line kept after it, what goes in its place)
CUTS = {
    "no solve": (
        "#pragma unroll\n    for (int i = 1; i < C; ++i) {",
        "#pragma unroll\n    for (int i = 0; i < C; ++i) out[i * K + d] = x[i];",
        "",
    ),
    "no scores": (
        "#pragma unroll\n      for (int m = 0; m < 4; ++m) {\n        if (m <= I) {",
        "      BARRIER();\n    }\n  }\n\n  // Aqk (lower",
        "",
    ),
    "no sub-block loop": (
        "#pragma unroll\n    for (int I = 0; I < 4; ++I) {\n      const int r0 = I * 16;",
        "  }\n\n  // Aqk (lower",
        "    BARRIER();\n",
    ),
}


def probe(name: str):
    """``kda_chunk_prep`` with the part ``name`` of ``CUTS`` cut out."""
    kernel = kda_prefill.KDA_CHUNK_PREP
    start, end, fill = CUTS[name]
    body = kernel.body
    assert body.count(start) == 1 and body.count(end) == 1, f"{name}: the kernel changed"
    a, b = body.index(start), body.index(end)
    assert a < b, name
    label = "kda_chunk_prep_probe_" + name.replace(" ", "_").replace("-", "_")
    return replace(kernel, name=label, body=body[:a] + fill + body[b:], _built={})


def kernels():
    return [("kda_chunk_prep", kda_prefill.KDA_CHUNK_PREP)] + [
        (f"probe: {name}", probe(name)) for name in CUTS
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args(argv)
    backend = kernel_backend()
    mx.random.seed(0)
    regs = {name: register_count(k) for name, k in kernels()}
    lines = ["| T | kernel | time (us) | / kernel | registers |", "|---:|---|---:|---:|---:|"]
    for T in args.lengths:
        r = recurrence_inputs(T)
        mx.eval(r)
        base = None
        for name, k in kernels():

            def run(k=k, r=r):
                return kda_prefill.chunk_prep(backend, *r[:5], kernel=k)

            us = median_time(mlx_run(run), args.repeats) * 1e6
            base = base or us
            ratio = f"{us / base:.2f}x" if name != "kda_chunk_prep" else ""
            lines.append(f"| {T} | {name} | {us:,.1f} | {ratio} | {regs[name]} |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
