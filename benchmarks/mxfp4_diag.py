"""Which side is wrong at scale: MXFP4 prefill kernel, ``gather_qmm`` reference, dense oracle.

Builds one layer's worth of random MXFP4 experts (default 896 at K3 dims, about 16 GB), routes
N tokens top-16, and runs:

- ``kernel``: ``expert_glu_prefill`` (the grouped kernels);
- ``gather_qmm``: ``expert_glu_reference`` (MLX's quantized ops);
- ``oracle``: for a few tokens only, each used expert dequantized with ``mx.dequantize`` to
  fp32 and applied with elementwise products and sums (no matmul, so no TF32 path).
  ``mx.dequantize`` itself is checked against a decode written here from the E2M1/E8M0
  definitions, on the highest expert used.

It prints the three pairwise errors, then the same for tokens routed only to one band of
expert indices each (e.g. 176-191 vs 208-223 vs 400-415 vs 880-895): an error that appears
only above some expert index points to 32-bit offset arithmetic (``e * I * D`` 4-bit elements
passes 2^31 at e = 195, and 2^31 bytes at e = 390, for K3's w1).

    python -m benchmarks.mxfp4_diag            # on the H200, < 60 s
    python -m benchmarks.mxfp4_diag --experts 40 --dim 64 --hidden 96 --tokens 64 \\
        --bands 0 24 --backend emulator        # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from benchmarks.bench_mxfp4 import random_experts
from benchmarks.bench_mxfp4 import rel_err as rel
from kimi_k3.experts import expert_glu, expert_glu_reference, situ_glu
from kimi_k3.kernels import source
from kimi_k3.kernels.mxfp4_prefill import expert_glu_prefill

BETA, CAP = 4.0, 25.0
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def unit_scales(cols: int) -> tuple[int, int]:
    """Scale bytes around 1 / (2.9 sqrt(cols)), spread over 5 octaves: outputs near unit."""
    base = 127 - int(np.round(np.log2(np.sqrt(cols) * 2.9)))
    return base - 2, base + 3


def dequant(q: mx.array, s: mx.array) -> mx.array:
    """MXFP4 stack [..., rows, cols/8] uint32 + [..., rows, cols/32] uint8 -> fp32, by MLX."""
    return mx.dequantize(q, s, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)


def dequant_here(q: mx.array, s: mx.array) -> mx.array:
    """The same, from the definitions: code j of a word is bits 4j..4j+3; scale 2^(s-127)."""
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    codes = (q[..., None] >> shifts) & mx.array(15, mx.uint32)
    vals = mx.array(E2M1, mx.float32)[codes.astype(mx.int32)]
    vals = vals.reshape(*q.shape[:-1], -1)
    scale = mx.power(mx.array(2.0), s.astype(mx.float32) - 127.0)
    return (vals.reshape(*s.shape, 32) * scale[..., None]).reshape(vals.shape)


def oracle(z, w, inds, weights) -> mx.array:
    """fp32 dense: per token, its k experts dequantized and applied without matmuls."""
    out = []
    for t in range(inds.shape[0]):
        e = inds[t]
        x = z[t].astype(mx.float32)
        w1, w3, w2 = (dequant(w[n][0][e], w[n][1][e]) for n in ("w1", "w3", "w2"))
        g = (w1 * x).sum(-1)  # [k, I]
        u = (w3 * x).sum(-1)
        h = situ_glu(g, u, BETA, CAP)
        y = (w2 * h[:, None, :]).sum(-1)  # [k, D]
        out.append((y * weights[t].astype(mx.float32)[:, None]).sum(0))
        mx.eval(out[-1])
    return mx.stack(out)


def compare(label, z, w, inds, wts, backend, n_oracle):
    ker = expert_glu_prefill(z, w, inds, wts, BETA, CAP, backend=backend)
    ref = expert_glu_reference(z, w, inds, wts, BETA, CAP)
    mx.eval(ker, ref)
    m = min(n_oracle, inds.shape[0])
    orc = oracle(z[:m], w, inds[:m], wts[:m])
    print(
        f"{label}: kernel vs gather_qmm {rel(ker, ref):.2e} (all {inds.shape[0]} tokens) | "
        f"first {m}: kernel vs oracle {rel(ker[:m], orc):.2e}, "
        f"gather_qmm vs oracle {rel(ref[:m], orc):.2e}, kernel vs gather_qmm "
        f"{rel(ker[:m], ref[:m]):.2e}",
        flush=True,
    )
    return ker, ref, orc


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=896)
    p.add_argument("--dim", type=int, default=3584)
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--oracle-tokens", type=int, default=8)
    p.add_argument(
        "--bands",
        type=int,
        nargs="*",
        default=[0, 176, 208, 368, 400, 880],
        help="first expert of each band of topk consecutive experts",
    )
    p.add_argument("--backend", default=None, help="cuda, metal or emulator (default: auto)")
    args = p.parse_args()
    backend = args.backend or source.backend()
    t0 = time.perf_counter()
    print(
        f"mlx {mx.__version__} on {mx.default_device()}, kernel backend {backend}; "
        f"{args.experts} experts D={args.dim} I={args.hidden}, N={args.tokens} "
        f"top-{args.topk}",
        flush=True,
    )
    w = random_experts(args.experts, args.dim, args.hidden, 0, scales=unit_scales)
    elems = args.experts * args.hidden * args.dim
    print(f"w1 stack: {elems:.3e} 4-bit elements, {elems // 2:.3e} bytes (2^31 = 2.147e9)")
    rng = np.random.default_rng(1)
    inds = np.argsort(rng.random((args.tokens, args.experts)), axis=1)[:, : args.topk]
    wts = rng.random((args.tokens, args.topk)).astype(np.float32) + 0.1
    wts /= wts.sum(axis=1, keepdims=True)
    z = mx.random.normal((args.tokens, args.dim), key=mx.random.key(2)).astype(mx.bfloat16)
    inds, wts = mx.array(inds.astype(np.int32)), mx.array(wts)
    print(f"setup {time.perf_counter() - t0:.1f} s", flush=True)

    top = int(mx.max(inds[: args.oracle_tokens]).item())
    a, b = dequant(w["w1"][0][top], w["w1"][1][top]), dequant_here(w["w1"][0][top], w["w1"][1][top])
    print(
        f"mx.dequantize vs decode from the definitions, expert {top} w1: "
        f"max abs diff {mx.max(mx.abs(a - b)).item():.3e}"
    )

    compare("flat routing", z, w, inds, wts, backend, args.oracle_tokens)
    y = expert_glu(
        z[: args.oracle_tokens], w, inds[: args.oracle_tokens], wts[: args.oracle_tokens], BETA, CAP
    )
    orc = oracle(z[: args.oracle_tokens], w, inds[: args.oracle_tokens], wts[: args.oracle_tokens])
    print(
        f"dispatcher (expert_glu), first {args.oracle_tokens} tokens vs oracle: {rel(y, orc):.2e}"
    )
    for lo in args.bands:
        if lo + args.topk > args.experts:
            continue
        band = mx.broadcast_to(mx.arange(lo, lo + args.topk, dtype=mx.int32), (2, args.topk))
        compare(f"experts {lo}-{lo + args.topk - 1}", z[:2], w, band, wts[:2], backend, 2)
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
