"""Where ``kda_chunk_prep``'s time goes: the kernel timed alone beside copies of it with one
part cut out (their results are wrong by design; only their times are reported).

- ``no solve``: pass 2's forward substitution removed (W and U are written unsolved; the
  loads of the right-hand sides and the stores stay);
- ``no scores``: pass 1's score dot products removed (the exponential factors, the
  barriers and everything else stay);
- ``no sub-block loop``: pass 1's loop over the four sub-blocks removed (factors, dot
  products and their 8 barriers per 16-channel tile), one barrier left in its place;
- ``no cumsum``: the in-chunk cumulative sum of g (a shuffle scan and one barrier per tile)
  removed (G is g itself);
- ``no pass-1 stores``: the Qd, Kd, beta exp(G) k and decay stores removed (pass 2 then
  solves whatever W holds);
- ``no pass 2``: the whole solve pass removed (its loads, forward substitution and stores).

Beside the cuts, whole variants (correct kernels, tests/test_kda_prep_probes.py checks them
against ``kda_chunk_prep``) are timed the same way:

- ``before async copy``: the kernel of the session before, for a same-run comparison: each
  tile's q, k and g loaded by every thread straight into padded tiles (no copy in flight
  while the tile before is worked on), the cumulative sum in two passes of 64 threads;
- ``kda_pre before (loads in their token)``: ``kda_pre`` with each token's loads back in
  that token (the session before's fix undone);
- ``kda_post before (gate loaded per column)``: ``kda_post`` with its gate and o_norm loads
  back in the output loop.

Variants timed in earlier sessions and then adopted or dropped (chunk-major grid, next
tile in registers, factors at once, stores by assignment, beta v per load) are in
docs/benchmarks.md with their numbers, and in this file's history.

Inputs are ``bench_kda``'s recurrence inputs at K3's shape (96 heads x 128); ptxas's
registers per kernel where nvcc is on PATH.

    python3 -m benchmarks.kda_prep_probes --lengths 1024 8192 --out kda_prep_probes.md
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

import mlx.core as mx

from benchmarks.bench_kda import (
    H,
    K,
    emit,
    kernel_backend,
    layer,
    median_time,
    mixer_inputs,
    mlx_run,
    recurrence_inputs,
)
from benchmarks.profile_kernels import register_count
from kimi_k3.kernels import kda_prefill
from kimi_k3.kernels.source import swap

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
    "no cumsum": (
        "    // Cumulative sum of g down the chunk",
        "    sm4[OG + row * R4 + dq] = Gv;",
        "",
    ),
    "no pass-1 stores": (
        "      kk_store4(Qd + o",
        "    }\n\n#pragma unroll\n    for (int I = 0; I < 4; ++I) {",
        "",
    ),
    "no pass 2": ("  // Pass 2: solve", None, ""),  # to the end of the body
}


# The kernel before its tiles came by asynchronous copies (the previous session's HEAD, for
# a same-run comparison): q, k and g of each tile loaded by every thread straight into padded
# tiles, then the cumulative sum in two passes of 64 threads (3 barriers before the factors).
_ASYNC_LAYOUT = "  constexpr int R4 = DT / 4;"  # to the s_beta declaration
_ASYNC_HEAD = "  const uint lane = LANE;\n  const uint warp = SIMDGROUP;"  # to the Qd, Kd stores
_OLD_LAYOUT = """\
  constexpr int RQ = DT / 4 + 1;    // float4 per padded tile row (the pad avoids bank conflicts)
  constexpr int OQ = 0, OK = C * RQ, OG = 2 * C * RQ, OLQ = 3 * C * RQ, OLK = OLQ + 16 * RQ;
  constexpr int ORK = OLK + 16 * RQ, OSEG = ORK + C * RQ, OL = 0;
  SHARED float4 sm4[OSEG + 64];
"""
_OLD_HEAD = """\
  for (int d0 = 0; d0 < K; d0 += DT) {
    {
      const size_t src = in0 + row * tok + d0 + 4 * dq;
      const bool ok = (int)row < rows;
      sm4[OQ + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(q + src) : kk_zero4();
      sm4[OK + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(k + src) : kk_zero4();
      sm4[OG + row * RQ + dq] = ok ? *reinterpret_cast<const DEVICE float4*>(g + src) : kk_zero4();
    }
    BARRIER();
    if (t < 64) {
      float4 run = kk_zero4();
      for (uint r = 0; r < 4; ++r) run = kk_add4(run, sm4[OG + (4 * row + r) * RQ + dq]);
      sm4[OSEG + t] = run;
    }
    BARRIER();
    if (t < 64) {
      float4 off = kk_zero4();
      for (uint s2 = 0; s2 < row; ++s2) off = kk_add4(off, sm4[OSEG + 4 * s2 + dq]);
      for (uint r = 0; r < 4; ++r) {
        off = kk_add4(off, sm4[OG + (4 * row + r) * RQ + dq]);
        sm4[OG + (4 * row + r) * RQ + dq] = off;
      }
    }
    BARRIER();
"""
_STORES = "    {\n      const float4 G = sm4[OG + row * R4 + dq];"
# the unpadded tiles' reads in the padded layout
_PADDED = (re.compile(r"sm4\[(OQ|OK|OG) \+ ([^\]]*?) \* R4 \+ dq\]"), r"sm4[\1 + \2 * RQ + dq]")

# name: the rewrites of the kernel's body that make it (see ``rewrite``)
VARIANTS = {
    "before async copy": [
        (_ASYNC_LAYOUT, "  SHARED float s_beta[C];", _OLD_LAYOUT),
        (_ASYNC_HEAD, _STORES, _OLD_HEAD),
        _PADDED,
    ],
}
# variants that add in a different order: equal to the kernel within a tolerance, not bitwise
REORDERED = {"before async copy"}


def rewrite(kernel, rewrites, label: str, what: str):
    """``kernel`` renamed ``label`` with its body rewritten: each rewrite is (old, new), the
    one occurrence of ``old`` replaced; (start, end, fill), [start, end) replaced by
    ``fill`` (``end`` None: to the end); or (regex, repl), every match replaced (at least
    one). ``what`` names the rewrite in the error when the kernel no longer matches."""
    body = kernel.body
    for rw in rewrites:
        if len(rw) == 3:
            start, end, fill = rw
            assert body.count(start) == 1, f"{what}: the kernel changed"
            assert end is None or body.count(end) == 1, f"{what}: the kernel changed"
            a = body.index(start)
            b = len(body) if end is None else body.index(end)
            assert a < b, what
            body = body[:a] + fill + body[b:]
        elif isinstance(rw[0], re.Pattern):
            body, n = rw[0].subn(rw[1], body)
            assert n, f"{what}: the kernel changed"
        else:
            body = swap(body, [rw], what)
    return replace(kernel, name=label, body=body, _built={})


def _label(prefix: str, name: str) -> str:
    return prefix + name.replace(" ", "_").replace("-", "_")


def variant(name: str):
    """``kda_chunk_prep`` rewritten as ``VARIANTS[name]``."""
    return rewrite(
        kda_prefill.KDA_CHUNK_PREP, VARIANTS[name], _label("kda_chunk_prep_var_", name), name
    )


# kda_pre as it was before its token loads went one token ahead: (start, end, what was
# there) of each region that changed.
PRE_BEFORE = [
    (
        "    // A token's inputs are loaded during the token before it",
        "        float aq = 0.0f, ak = 0.0f, av = 0.0f;",
        """    for (int t = ta; t < tb; ++t) {
      const size_t row = xb + (size_t)t * P;
      float yq[CL], yk[CL];
      float sq = 0.0f, sk = 0.0f;
      for (int i = 0; i < CL; ++i) {
        const uint c = h * K + LANE + 32 * i;
        wq[i][W - 1] = static_cast<float>(x_q[row + c]);
        wk[i][W - 1] = static_cast<float>(x_k[row + c]);
        wv[i][W - 1] = static_cast<float>(x_v[row + c]);
""",
    ),
    (
        "        const float z = a_h * (gr[i] + dtb[i]);",
        "\n        g[row + c] = lb",
        "        const float z = a_h * (static_cast<float>(g_raw[row + c]) + dtb[i]);",
    ),
    (
        "        beta[bi] = 1.0f / (1.0f + EXP(-bl));",
        None,
        "        beta[bi] = 1.0f / (1.0f + EXP(-static_cast<float>(b_logits[bi])));\n"
        "      }\n    }\n  }\n",
    ),
]


def pre_before():
    """``kda_pre`` with its token loads back in the token they serve."""
    return rewrite(kda_prefill.KDA_PRE, PRE_BEFORE, "kda_pre_before", "kda_pre before")


def probe(name: str):
    """``kda_chunk_prep`` with the part ``name`` of ``CUTS`` cut out."""
    return rewrite(
        kda_prefill.KDA_CHUNK_PREP, [CUTS[name]], _label("kda_chunk_prep_cut_", name), name
    )


def kernels():
    return (
        [("kda_chunk_prep", kda_prefill.KDA_CHUNK_PREP)]
        + [(f"probe: {name}", probe(name)) for name in CUTS]
        + [(f"variant: {name}", variant(name)) for name in VARIANTS]
    )


# kda_post as it was before its gate and o_norm loads moved beside o's: loaded in the
# output loop, each after the previous column's store (which may alias them as far as the
# compiler knows), so a row waited out the memory latency five times. (was, is) pairs.
_POST_EARLY = [
    (
        "    float x[CL];\n    float ss = 0.0f;\n    for (int i = 0; i < CL; ++i) {\n"
        "      x[i] = o[base + LANE + 32 * i];\n",
        "    float x[CL], gt[CL], on[CL];\n    float ss = 0.0f;\n"
        "    for (int i = 0; i < CL; ++i) {\n"
        "      x[i] = o[base + LANE + 32 * i];\n"
        "      gt[i] = static_cast<float>(gate[base + LANE + 32 * i]);\n"
        "      on[i] = o_norm[LANE + 32 * i];\n",
    ),
    (
        "      const float gt = static_cast<float>(gate[base + d]);\n"
        "      y[base + d] = static_cast<T>(x[i] * rs * o_norm[d] / (1.0f + EXP(-gt)));",
        "      y[base + d] = static_cast<T>(x[i] * rs * on[i] / (1.0f + EXP(-gt[i])));",
    ),
]


POST_BEFORE = [(new, old) for old, new in _POST_EARLY]


def post_before():
    """``kda_post`` with its gate and o_norm loads back in the output loop."""
    return rewrite(kda_prefill.KDA_POST, POST_BEFORE, "kda_post_before", "kda_post before")


def pre_kernels():
    return [
        ("kda_pre", kda_prefill.KDA_PRE),
        ("kda_pre before (loads in their token)", pre_before()),
    ]


def post_kernels():
    return [
        ("kda_post", kda_prefill.KDA_POST),
        ("kda_post before (gate loaded per column)", post_before()),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", nargs="+", help="time only these kernels (names as listed)")
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args(argv)
    backend = kernel_backend()
    mx.random.seed(0)
    every = kernels() + pre_kernels() + post_kernels()
    chosen = [(n, k) for n, k in every if not args.only or n in args.only]
    if args.only and len(chosen) != len(args.only):
        parser.error(f"--only: unknown names among {args.only}; known: {[n for n, _ in every]}")
    regs = {name: register_count(k) for name, k in chosen}
    kinds = {n: "pre" for n, _ in pre_kernels()} | {n: "post" for n, _ in post_kernels()}
    p = layer()
    lines = ["| T | kernel | time (us) | / kernel | registers |", "|---:|---|---:|---:|---:|"]
    for T in args.lengths:
        r = recurrence_inputs(T)
        xs = mixer_inputs(T)
        o = mx.random.normal((1, T, H, K))  # kda_post's input: the recurrence's output
        mx.eval(r, xs, o)
        base = {}
        for name, k in chosen:
            kind = kinds.get(name, "prep")

            def run(k=k, r=r, xs=xs, o=o, kind=kind):
                if kind == "pre":
                    return kda_prefill.pre(backend, p, *xs[:5], xs[6], kernel=k)
                if kind == "post":
                    return kda_prefill.post(backend, p, o, xs[5], kernel=k)
                return kda_prefill.chunk_prep(backend, *r[:5], kernel=k)

            us = median_time(mlx_run(run), args.repeats) * 1e6
            first = base.setdefault(kind, us)
            ratio = f"{us / first:.2f}x" if us != first else ""
            lines.append(f"| {T} | {name} | {us:,.1f} | {ratio} | {regs[name]} |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
