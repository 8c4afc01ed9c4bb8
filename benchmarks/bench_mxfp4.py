"""MXFP4 expert kernels at Kimi K3 size against MLX's ``gather_qmm`` and the read limit.

Decode (``--decode-tokens``, one by default; top-16 of 64 experts, D = 3584, I = 3072): each
job is timed as chains of dependent calls (each call's latent is the previous call's output,
as a model's layers run them) of several lengths, and its time per call is the slope of the
least-squares line through the chains' best totals (``timing.chain_slope``): what one
layer's experts add to a decode step. The jobs, in interleaved rounds:

- ``gather_qmm``: ``expert_glu_reference`` (MLX's quantized ops), on MLX's layout;
- the dispatched decode: ``kimi_k3.model.experts.expert_glu``, which runs the kernel
  ``kernels/dispatch.py`` picks, on the layout the expert store holds
  (``experts.store_layout``: tiles where CUDA's kernels read them, ``kernels/expert_layout.py``);
- the read limit: ``read_limit.read_call``, one launch that reads the same weight bytes and
  does nothing else, the ceiling of any decode call.

GB/s are over the distinct experts' bytes a call reads (scales included), and % of the HBM
datasheet peak; each kernel's first call is compared with ``gather_qmm`` in fp32 on the same
latent (relative L2; CUDA needs ``MLX_ENABLE_TF32=0`` for that to mean anything).

Prefill (one layer of 896 experts, 512 and 4096 tokens): ``gather_qmm`` (sorted) and the
dispatched grouped kernel, timed in interleaved rounds (each the best of batches of calls);
each path's output on the first tokens against an fp32 dense oracle (``oracle``: each expert
dequantized by ``mx.dequantize`` and applied by elementwise products, no matmul).

``--formats 3 2`` adds, in the same rounds and on the same routing, the lower-bit experts
(``python -m kimi_k3.convert --expert-bits``: MLX ``affine``, groups of 64) as random stacks
of each width: ``gather_qmm`` and the dispatched kernel (``affine_decode``,
``affine_prefill``); GB/s over that format's bytes, errors against its own ``gather_qmm`` in
fp32 (decode) and its dense oracle (prefill).

    python -m benchmarks.bench_mxfp4 --out bench_mxfp4.md                    # on the GPU
    python -m benchmarks.bench_mxfp4 --formats 3 2 --out bench_formats.md    # with 3, 2 bits
    KIMI_K3_KERNEL_BACKEND=emulator python -m benchmarks.bench_mxfp4 --quick  # CPU, seconds
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from benchmarks import timing
from benchmarks.read_limit import read_call
from kimi_k3.cli import markdown_table
from kimi_k3.kernels import dispatch, expert_layout, source
from kimi_k3.kernels.checks import BETA, CAP, rel_err
from kimi_k3.model.experts import (
    FORMATS,
    expert_glu,
    expert_glu_reference,
    situ_glu,
    stack_format,
    store_layout,
)

QUICK = dict(
    dim=128,
    hidden=128,
    topk=4,
    decode_experts=8,
    decode_tokens=[1],
    lengths=[2, 4],
    prefill_experts=8,
    prefill_tokens=[40],
    calls=2,
    repeats=1,
    rounds=2,
    oracle_tokens=2,
)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=3584, help="latent width D")
    p.add_argument("--hidden", type=int, default=3072, help="expert width I")
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--decode-experts", type=int, default=64, help="stack the decode picks from")
    p.add_argument("--decode-tokens", type=int, nargs="+", default=[1])
    p.add_argument("--lengths", type=int, nargs="+", default=[10, 20, 40, 80, 160])
    p.add_argument("--prefill-experts", type=int, default=896, help="one layer's experts")
    p.add_argument("--prefill-tokens", type=int, nargs="*", default=[512, 4096])
    p.add_argument("--calls", type=int, default=20, help="distinct input sets a decode takes")
    p.add_argument("--repeats", type=int, default=3, help="timings per job and round (best)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each timing every job once")
    p.add_argument("--oracle-tokens", type=int, default=4, help="prefill tokens the oracle checks")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM datasheet peak")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--formats",
        type=int,
        nargs="*",
        default=[],
        choices=[3, 2],
        help="also time the lower-bit experts of these widths (--expert-bits)",
    )
    p.add_argument("--quick", action="store_true", help="small dims, one round: a smoke run")
    p.add_argument("--out", default=None, help="write the markdown tables here")
    return p


def expert_bytes(dim: int, hidden: int) -> int:
    """Bytes of one expert: three [hidden x dim] MXFP4 matrices (packed codes + E8M0 scales)."""
    return 3 * (hidden * dim // 2 + hidden * dim // 32)


def random_words(shape, key) -> mx.array:
    """Uniform random uint32 words (8 random E2M1 codes each), built from two 16-bit draws."""
    lo, hi = mx.random.split(key, 2)
    a = mx.random.randint(0, 1 << 16, shape, dtype=mx.int32, key=lo).astype(mx.uint32)
    b = mx.random.randint(0, 1 << 16, shape, dtype=mx.int32, key=hi).astype(mx.uint32)
    return (b << 16) | a


def fixed_scales(cols: int) -> tuple[int, int]:
    """E8M0 scale bytes in [119, 123): near 2^-6, which keeps the gate and up outputs O(1)
    for unit-variance inputs at K3 width."""
    return 119, 123


def random_experts(n: int, dim: int, hidden: int, seed: int, scales=fixed_scales) -> dict:
    """A stack of ``n`` random MXFP4 experts in MLX's layout, built on the device; scale
    bytes uniform in ``scales(cols)`` (a half-open range, by reduction width)."""
    ks = mx.random.split(mx.random.key(seed), 6)

    def quant(k1, k2, rows, cols):
        wq = random_words((n, rows, cols // 8), k1)
        sc = mx.random.randint(*scales(cols), (n, rows, cols // 32), key=k2).astype(mx.uint8)
        return wq, sc

    w = {
        "w1": quant(ks[0], ks[1], hidden, dim),
        "w3": quant(ks[2], ks[3], hidden, dim),
        "w2": quant(ks[4], ks[5], dim, hidden),
    }
    mx.eval(w)
    return w


def random_affine(n: int, dim: int, hidden: int, bits: int, seed: int) -> dict:
    """A stack of ``n`` random experts in ``FORMATS[bits]`` (MLX ``affine``), built on the
    device: uniform codes, float16 scales near 2^-6 / (2^bits - 1) x 2 (weights of about the
    MXFP4 stacks' size), biases centring each group's grid."""
    fmt = FORMATS[bits]
    ks = mx.random.split(mx.random.key(seed), 9)
    top = (1 << bits) - 1

    def quant(k1, k2, k3, rows, cols):
        shape = (n, rows, cols // fmt.group_size)
        wq = random_words((n, rows, cols * bits // 32), k1)
        s = mx.random.uniform(0.75, 1.25, shape, key=k2) * (2.0**-5 / top)
        b = -s * top / 2 * mx.random.uniform(0.8, 1.2, shape, key=k3)
        return wq, s.astype(mx.float16), b.astype(mx.float16)

    w = {
        "w1": quant(*ks[0:3], hidden, dim),
        "w3": quant(*ks[3:6], hidden, dim),
        "w2": quant(*ks[6:9], dim, hidden),
    }
    mx.eval(w)
    return w


def format_bytes(bits: int, dim: int, hidden: int) -> int:
    """Bytes of one expert in ``FORMATS[bits]`` (what a call reads per distinct expert)."""
    shapes = [FORMATS[bits].shapes(*d) for d in ((hidden, dim), (hidden, dim), (dim, hidden))]
    return sum(int(np.prod(s)) * np.dtype(t).itemsize for m in shapes for s, t in m.values())


def routing(tokens: int, experts: int, topk: int, rng: np.random.Generator):
    """Distinct top-k experts per token (flat popularity, as K3's router is trained to give)."""
    inds = np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk].astype(np.int32)
    weights = rng.random((tokens, topk)).astype(np.float32)
    weights /= weights.sum(axis=1, keepdims=True)
    return mx.array(inds), mx.array(weights)


def dequant(stack: tuple, fmt=None) -> mx.array:
    """One expert's matrix -> fp32: MXFP4 ``(uint32 [rows, cols / 8], uint8 [rows, cols /
    32])``, or an affine ``fmt``'s ``(codes, scales, biases)``."""
    if fmt is None or fmt.mode == "mxfp4":
        return mx.dequantize(*stack, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    q, s, b = stack
    return mx.dequantize(
        q, s.astype(mx.float32), b.astype(mx.float32), group_size=fmt.group_size, bits=fmt.bits
    )


def oracle(z, w, inds, weights) -> mx.array:
    """fp32 dense, without matmuls: per token, its k experts dequantized and applied by
    elementwise products and sums (no TF32 path, no grouped kernel).

    Shapes: z: [N, D]; w: stacks in MLX's layout; inds, weights: [N, k] -> [N, D] fp32."""
    out, fmt = [], stack_format(w)
    for t in range(inds.shape[0]):
        e = inds[t]
        x = z[t].astype(mx.float32)
        w1, w3, w2 = (dequant(tuple(a[e] for a in w[n]), fmt) for n in ("w1", "w3", "w2"))
        h = situ_glu((w1 * x).sum(-1), (w3 * x).sum(-1), BETA, CAP)  # [k, I]
        y = (w2 * h[:, None, :]).sum(-1)  # [k, D]
        out.append((y * weights[t].astype(mx.float32)[:, None]).sum(0))
        mx.eval(out[-1])
    return mx.stack(out)


def store(w: dict, dim: int, hidden: int) -> dict:
    """``w`` in the layout the expert store holds for these dims (``store_layout``)."""
    if store_layout(None, dim, hidden, stack_format(w)) != "tiled":
        return w
    tiled = expert_layout.tile(w)
    mx.eval(tiled)
    return tiled


def kernel_name(z, w, inds) -> str:
    """The function ``dispatch.expert_glu_kernel`` picks for these inputs, or the reference."""
    fn = dispatch.expert_glu_kernel(z, w, inds)
    if fn is None:
        return "reference (no kernel serves it here)"
    fn = getattr(fn, "func", fn)
    return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"


def fp32_reference(z, w, inds, weights, beta, cap):
    """``gather_qmm`` on the latent as fp32: what each decode's first call is checked against."""
    return expert_glu_reference(z.astype(mx.float32), w, inds, weights, beta, cap)


def decode_inputs(args, tokens: int, w: dict, rng) -> list[tuple]:
    dtype = getattr(mx, args.dtype)
    inputs = []
    for _ in range(args.calls):
        inds, weights = routing(tokens, args.decode_experts, args.topk, rng)
        z = mx.random.normal((tokens, args.dim)).astype(dtype)
        inputs.append((z, w, inds, weights, BETA, CAP))
    mx.eval([a[:4] for a in inputs])
    return inputs


def decode_table(args) -> str:
    """The decode section: one row per job and token count."""
    w = random_experts(args.decode_experts, args.dim, args.hidden, args.seed)
    ws = store(w, args.dim, args.hidden)
    formats = {
        b: random_affine(args.decode_experts, args.dim, args.hidden, b, args.seed)
        for b in args.formats
    }
    rng = np.random.default_rng(args.seed)
    rows = []
    for n in args.decode_tokens:
        inputs = decode_inputs(args, n, w, rng)
        on_store = [(a[0], ws, *a[2:]) for a in inputs]
        z, _, inds, weights, beta, cap = inputs[0]
        name = kernel_name(z, ws, inds)
        layout = "tiles" if expert_layout.is_tiled(ws) else "MLX's layout"
        nbytes = np.mean([len(np.unique(np.array(a[2]))) for a in inputs])
        mxfp4 = nbytes * expert_bytes(args.dim, args.hidden)
        ref = fp32_reference(*inputs[0])
        jobs = {
            "MLX gather_qmm": (expert_glu_reference, inputs, mxfp4, ref),
            f"dispatched: {name}, on {layout}": (expert_glu, on_store, mxfp4, ref),
            "read limit (reads the same bytes, one launch)": (read_call, inputs, mxfp4, None),
        }
        for bits, wf in formats.items():
            on_fmt = [(a[0], wf, *a[2:]) for a in inputs]
            fbytes = nbytes * format_bytes(bits, args.dim, args.hidden)
            fref = fp32_reference(*on_fmt[0])
            tag = FORMATS[bits]
            jobs[f"MLX gather_qmm, {tag}"] = (expert_glu_reference, on_fmt, fbytes, fref)
            label = f"dispatched: {kernel_name(z, wf, inds)}, {tag}"
            jobs[label] = (expert_glu, on_fmt, fbytes, fref)
        results, failed = timing.interleaved(
            {
                label: lambda fn=fn, a=a: timing.chain_slope(fn, a, args.lengths, args.repeats)
                for label, (fn, a, _, _) in jobs.items()
            },
            args.rounds,
        )
        first = next(iter(jobs))
        base = None if first in failed else min(results[first])[0]
        for label, (fn, a, nbytes, ref) in jobs.items():
            if label in failed:
                rows.append((n, label, "FAILED", "", "", "", "", failed[label]))
                continue
            slope, intercept = min(results[label])
            gbps = nbytes / slope / 1e9
            err = "" if ref is None else f"{rel_err(fn(*a[0]), ref):.1e}"
            rows.append(
                (
                    n,
                    label,
                    f"{slope * 1e3:.4f}",
                    f"{intercept * 1e3:.3f}",
                    f"{gbps:.0f}",
                    f"{100 * gbps / args.peak_gbps:.0f}%",
                    f"{base / slope:.2f}x" if base else "",
                    err,
                )
            )
    header = (
        "tokens",
        "job",
        "ms per call (slope)",
        "intercept (ms)",
        "GB/s",
        "of HBM peak",
        "vs gather_qmm",
        "rel err vs gather_qmm fp32 (its format's)",
    )
    return (
        f"### Decode: top-{args.topk} of {args.decode_experts} experts, chains of "
        f"{', '.join(map(str, args.lengths))} calls, best of {args.rounds} rounds x "
        f"{args.repeats}\n\n" + markdown_table(header, rows)
    )


def prefill_table(args) -> str:
    """The prefill section: gather_qmm and the dispatched kernel per token count, then each
    against the fp32 oracle."""
    dtype = getattr(mx, args.dtype)
    w = random_experts(args.prefill_experts, args.dim, args.hidden, args.seed + 1)
    ws = store(w, args.dim, args.hidden)
    rng = np.random.default_rng(args.seed + 1)
    rows = []
    for n in args.prefill_tokens:
        inds, weights = routing(n, args.prefill_experts, args.topk, rng)
        z = mx.random.normal((n, args.dim)).astype(dtype)
        mx.eval(z, inds, weights)
        layout = "tiles" if expert_layout.is_tiled(ws) else "MLX's layout"
        jobs = {
            "MLX gather_qmm (sorted)": (expert_glu_reference, w, w),
            f"dispatched: {kernel_name(z, ws, inds)}, on {layout}": (expert_glu, ws, w),
        }
        for bits in args.formats:
            wf = random_affine(args.prefill_experts, args.dim, args.hidden, bits, args.seed + 1)
            jobs[f"MLX gather_qmm (sorted), {FORMATS[bits]}"] = (expert_glu_reference, wf, wf)
            label = f"dispatched: {kernel_name(z, wf, inds)}, {FORMATS[bits]}"
            jobs[label] = (expert_glu, wf, wf)
        results, failed = timing.interleaved(
            {
                label: lambda fn=fn, a=[(z, s, inds, weights, BETA, CAP)] * 2: (
                    timing.best_batch_time(fn, a, args.repeats)
                )
                for label, (fn, s, _) in jobs.items()
            },
            args.rounds,
        )
        m = min(args.oracle_tokens, n)
        wants = {}
        first = next(iter(jobs))
        base = None if first in failed else min(results[first])
        for label, (fn, s, plain) in jobs.items():
            if label in failed:
                rows.append((n, label, "FAILED", "", "", failed[label]))
                continue
            if id(plain) not in wants:
                wants[id(plain)] = oracle(z[:m], plain, inds[:m], weights[:m])
            t = min(results[label])
            err = rel_err(fn(z, s, inds, weights, BETA, CAP)[:m], wants[id(plain)])
            ratio = f"{base / t:.2f}x" if base else ""
            rows.append((n, label, f"{t * 1e3:.2f}", f"{n / t:,.0f}", ratio, f"{err:.1e}"))
    header = ("tokens", "job", "ms", "tok/s", "vs gather_qmm", "rel err vs fp32 oracle")
    return (
        f"### Prefill: one layer of {args.prefill_experts} experts, top-{args.topk}; best of "
        f"{args.rounds} interleaved rounds; oracle on the first {args.oracle_tokens} tokens\n\n"
        + markdown_table(header, rows)
    )


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    mx.random.seed(args.seed)
    text = (
        f"## MXFP4 experts, D={args.dim}, I={args.hidden}, {args.dtype} latents, kernel "
        f"backend {source.backend()}; {timing.environment()}; HBM peak {args.peak_gbps:.0f} "
        "GB/s\n\n" + decode_table(args)
    )
    mx.clear_cache()
    if args.prefill_tokens:
        text += "\n" + prefill_table(args)
    timing.emit(text, args.out)
    return text


if __name__ == "__main__":
    main()
