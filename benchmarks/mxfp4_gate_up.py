"""Why gate/up streamed slower than down: the same bytes through variants of the one kernel.

The dispatched gate/up kernel streamed its bytes at 2.3-2.7 TB/s where the dispatched down
kernel, the same body, reached 2.8-3.0 (docs/benchmarks.md, sessions 21-23). Session 25
took the differences apart one at a time: the gate and up stacks read from one interleaved
stack, the latent staged once per pair, the epilogue. This times, in one process and
interleaved rounds, chains of one launch a call at K3's size (16 pairs of one token), and
checks every variant's bits against the dispatched kernels first:

- ``gate/up``: the dispatched gate/up + SiTU-GLU kernel, its epilogue's parameters (beta,
  cap) staged in threadgroup memory before the main loop (``mxfp4_mma.PARAMS``);
- ``gate/up, parameters read in the epilogue``: the kernel as it was before session 25;
- ``gate/up, constants in the epilogue``: SiTU-GLU with beta and cap as literals (no loads);
- ``gate/up, one interleaved stack`` (``--layouts``): the same kernel over ``w13`` [E, 2I,
  D/8], whose 32-row units are a unit's 16 gate rows then its 16 up rows, and that stack
  read by the down kernel (no GLU; it returns gate and up's sums);
- ``down`` and ``down, its weight read in the epilogue``;
- ``decode call`` (gate/up, down, the ordered sum) as dispatched, as before and with the
  literals.

    python3 -m benchmarks.mxfp4_gate_up                   # on the H200, about 30 s
    python3 -m benchmarks.mxfp4_gate_up --only 0 1 --calls 10 --rounds 1 --repeats 1  # for ncu
    KIMI_K3_KERNEL_BACKEND=emulator python3 -m benchmarks.mxfp4_gate_up --dim 256 \\
        --hidden 256 --experts 8 --topk 2 --calls 2 --repeats 1 --rounds 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import statistics

import mlx.core as mx
import numpy as np

from benchmarks.bench_mxfp4 import (
    BETA,
    CAP,
    add_layer_args,
    copy_gbps,
    random_experts,
    rel_err,
    time_chain,
)
from benchmarks.kda_prep_probes import rewrite
from kimi_k3.experts import situ_glu
from kimi_k3.kernels import mxfp4_mma, source
from kimi_k3.kernels.source import constant

# The gate/up kernel's row addresses, and the same over one interleaved stack [E, 2I, D/8]:
# unit u's gate rows at 32 u, its up rows at 32 u + 16.
ROWS = """  const size_t ra = (size_t)inds[p] * NR + (GLU ? 16 : 32) * (active ? unit : 0) + g;
  const size_t rb = GLU ? ra : ra + 16;
"""
ROWS_INTERLEAVED = """  const size_t ra = (size_t)inds[p] * (2 * NR) + 32 * (active ? unit : 0) + g;
  const size_t rb = ra + 16;
"""
INTERLEAVED = ((ROWS, ROWS_INTERLEAVED),)
# The epilogues as they were before session 25 (parameters read from global memory there).
GLU_PARAMS = "kk_situ_glu(gate * unscale, upv * unscale, s_par[0], s_par[1])"
PARAMS_AT_END = (
    (GLU_PARAMS, "kk_situ_glu(gate * unscale, upv * unscale, params[0], params[1])"),
    ("s_par[0] * (total * unscale)", "params[p] * (total * unscale)"),
)
# SiTU-GLU with K3's beta and cap as literals.
LITERALS = ((GLU_PARAMS, f"kk_situ_glu(gate * unscale, upv * unscale, {BETA}f, {CAP}f)"),)


def interleave(a: mx.array, b: mx.array, rows: int = 16) -> mx.array:
    """[E, R, C] and [E, R, C] as one [E, 2R, C] stack of ``rows`` rows of ``a`` then the same
    ``rows`` rows of ``b``, unit after unit."""
    E, R, C = a.shape
    both = mx.stack([a.reshape(E, R // rows, rows, C), b.reshape(E, R // rows, rows, C)], 2)
    return both.reshape(E, 2 * R, C)


def kernel_for(edits=(), suffix: str = ""):
    """``mxfp4_mma``'s ``kernel_for(glu, shape)``: the dispatched kernel with ``edits``
    ((old, new) pairs, ``kda_prep_probes.rewrite``) applied, named ``<name><suffix>``; made
    once per (glu, shape)."""

    @functools.cache
    def fn(glu, shape):
        kernel = mxfp4_mma.dispatched_kernel(glu, shape)
        if not edits:
            return kernel
        return rewrite(kernel, edits, kernel.name + suffix, f"{kernel.name}{suffix}")

    return fn


def projection(glu: bool, cs: bool | None = None, edits=(), suffix: str = ""):
    """``fn(x, wa, sa, wb, sb, inds, params, KD, NR, k)``: one dispatched projection kernel
    (gate/up with ``glu``, else down's), with its code loads' hint ``cs`` (None: as
    dispatched) and ``edits`` to its body (``kernel_for``)."""
    backend = source.backend() or "cuda"
    tmpl = functools.partial(mxfp4_mma.template, cs=cs)
    kf = kernel_for(edits, suffix)

    def fn(x, wa, sa, wb, sb, inds, params, KD, NR, k):
        shape = mxfp4_mma.dispatched_shape(backend, KD, glu)
        kernel = kf(glu, shape)
        args = (x, wa, sa, wb, sb, inds, params, KD, NR, k, glu)
        return mxfp4_mma._launch(kernel, tmpl, shape, backend, *args)

    return fn


def decode(w, k, edits=(), suffix: str = ""):
    """``fn(z, inds, wts)``: one token's decode call through ``mxfp4_mma._decode`` with both
    projections' kernels given ``edits`` (``kernel_for``)."""
    backend = source.backend() or "cuda"
    kf = kernel_for(edits, suffix)

    def fn(z, inds, wts):
        args = (backend, z, w, inds[None], wts[None], BETA, CAP)
        return mxfp4_mma._decode(kf, mxfp4_mma.template, mxfp4_mma.dispatched_shape, *args)

    return fn


def link(out: mx.array, args: tuple) -> tuple:
    """The next call's activations made to depend on this call's output (two tiny ops)."""
    x = args[0]
    return (x + (out[:1, :1] * 0).astype(x.dtype), *args[1:])


# What a job's output is, for ``check`` and for its byte count: gate/up's (the GLU output),
# gate and up's sums (the interleaved stack read as down), down's, or a whole decode call's.
GATE_UP, SUMS, DOWN, CALL = "gate/up", "sums", "down", "call"


def jobs_for(w, w13, D, I, k, layouts: bool) -> dict:
    """name: (function, its inputs from one call's (z, zk, h, inds, wts), its output's kind)."""
    glu_params = constant((BETA, CAP))
    ones = mx.ones((k,), mx.float32)

    def gate_up(fn):
        return (
            fn,
            lambda z, zk, h, inds, wts: (z, *w["w1"], *w["w3"], inds, glu_params, D, I, k),
            GATE_UP,
        )

    def down(fn):
        return fn, lambda z, zk, h, inds, wts: (h, *w["w2"], *w["w2"], inds, wts, I, D, k), DOWN

    def call(fn):
        return fn, lambda z, zk, h, inds, wts: (z, inds, wts), CALL

    jobs = {
        "gate/up (dispatched)": gate_up(projection(True)),
        "gate/up, parameters read in the epilogue (before)": gate_up(
            projection(True, edits=PARAMS_AT_END, suffix="_parend")
        ),
        "gate/up, constants in the epilogue": gate_up(
            projection(True, edits=LITERALS, suffix="_literals")
        ),
    }
    if layouts:
        jobs["gate/up, one interleaved stack"] = (
            projection(True, edits=INTERLEAVED, suffix="_il"),
            lambda z, zk, h, inds, wts: (z, *w13, *w13, inds, glu_params, D, I, k),
            GATE_UP,
        )
        jobs["one interleaved stack read as down (no GLU), evict-first codes"] = (
            projection(False, cs=True),
            lambda z, zk, h, inds, wts: (zk, *w13, *w13, inds, ones, D, 2 * I, k),
            SUMS,
        )
    jobs["down (dispatched)"] = down(projection(False))
    jobs["down, its weight read in the epilogue (before)"] = down(
        projection(False, edits=PARAMS_AT_END[1:], suffix="_parend")
    )
    jobs["decode call (dispatched)"] = call(decode(w, k))
    jobs["decode call, parameters read in the epilogues (before)"] = call(
        decode(w, k, PARAMS_AT_END, "_parend")
    )
    jobs["decode call, constants in gate/up's epilogue"] = call(decode(w, k, LITERALS, "_literals"))
    return jobs


def check(jobs: dict, inputs: dict, I: int, k: int) -> None:
    """Every variant computes the bits of the first job of its kind (the dispatched kernel);
    gate and up's sums give gate/up's output through SiTU-GLU to rounding."""
    ref = {}
    for name, (fn, _, kind) in jobs.items():
        got = fn(*inputs[name][0])
        if kind == SUMS:
            sums = got.reshape(k, I // 16, 2, 16)
            gate, up = sums[:, :, 0].reshape(k, I), sums[:, :, 1].reshape(k, I)
            err = rel_err(situ_glu(gate, up, BETA, CAP), ref[GATE_UP])
            print(f"{name}: through SiTU-GLU, rel err {err:.1e} against gate/up")
            if not err < 1e-5:
                raise SystemExit(f"{name}: does not compute gate/up's sums")
        elif kind not in ref:
            ref[kind] = got
        elif not mx.array_equal(got, ref[kind]).item():
            raise SystemExit(f"{name}: not the dispatched kernel's bits")
    print("every variant: the dispatched kernels' bits")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_args(p, rounds=5)
    p.add_argument("--layouts", action="store_true", help="also the interleaved-stack rows")
    p.add_argument("--only", type=int, nargs="*", help="time only these jobs (table order)")
    args = p.parse_args()
    D, I, E, k = args.dim, args.hidden, args.experts, args.topk
    w = random_experts(E, D, I, 0)
    w13 = None
    if args.layouts:
        w13 = (interleave(w["w1"][0], w["w3"][0]), interleave(w["w1"][1], w["w3"][1]))
        mx.eval(w13)
    jobs = jobs_for(w, w13, D, I, k, args.layouts)
    rng = np.random.default_rng(0)
    inputs = {n: [] for n in jobs}
    for _ in range(args.calls):
        inds = mx.array(rng.permutation(E)[:k].astype(np.int32))
        z = mx.random.normal((1, D)).astype(mx.bfloat16)
        zk = mx.broadcast_to(z, (k, D)) + 0
        h = mx.random.normal((k, I)).astype(mx.float32)
        wts = mx.random.uniform(shape=(k,))
        wts = wts / wts.sum()
        for n, (_, make, _) in jobs.items():
            inputs[n].append(make(z, zk, h, inds, wts))
    mx.eval(list(inputs.values()))
    check(jobs, inputs, I, k)

    print(f"device copy: {copy_gbps(1 << 31, args.repeats):.0f} GB/s (read + write)")
    names = list(jobs)
    if args.only is not None:
        names = [names[j] for j in args.only]
    gu_bytes = k * 2 * (I * D // 2 + I * D // 32)
    times = {n: [] for n in names}
    for _ in range(args.rounds):
        for n in names:
            fn = jobs[n][0]
            times[n].append(time_chain(lambda *a, fn=fn: fn(*a), inputs[n], args.repeats, link))
    print("| chain of calls | best us | median us | GB/s at best | rounds (us) |")
    print("|---|---:|---:|---:|---|")
    for n in names:
        nbytes = {DOWN: gu_bytes // 2, CALL: gu_bytes * 3 // 2}.get(jobs[n][2], gu_bytes)
        best, med = min(times[n]), statistics.median(times[n])
        rounds = ", ".join(f"{t * 1e6:.1f}" for t in times[n])
        gbps = nbytes / best / 1e9
        print(f"| {n} | {best * 1e6:.1f} | {med * 1e6:.1f} | {gbps:.0f} | {rounds} |")


if __name__ == "__main__":
    main()
