"""Where the tensor-core MXFP4 decode kernels lose time: each projection timed alone.

For the gate/up and the down launch of ``mxfp4_mma`` at K3 size (16 experts of 64, one
token), this times every launch shape given (with the relative difference of its result to
the first shape's), and with ``--probe`` the same grid with the math taken out:

- ``probe``: the kernel's own loads, addresses, staging and occupancy, the MMAs and decoding
  replaced by an XOR of the loaded words;
- ``probe, no staging``: the same without the activation staging and its barriers;
- ``probe, no scales``: the same without the scale-byte loads;
- ``stream``: each warp's code bytes read as 16 rows x GW groups at a time (GW = 0: whole
  rows), lane l taking 16-byte words l, l + 32, ... of that order (the scales not read);
- with ``--hints``, the kernel with its code-word loads given a cache hint (CUDA only):
  ``plain`` (none, whatever the kernel's CS flag), ``ldg`` (ld.global.nc), ``ldcg`` (L2
  only, no L1 allocation), ``ldcs`` (evict first), ``L2::256B`` (the L2 fetches 256 bytes
  per miss), ``nc, no L1, L2::256B``, and ``ldcs`` on the scale bytes too; with
  ``--ac-shapes`` also ``mxfp4_mma_ac`` (asynchronous copies) with L2's evict-first policy;
- with ``--prmt``, each ``mxfp4_mma`` row (bounded ones too) again with its codes decoded by
  byte permutes (``kk_e2m1_pair_prmt``; at a bound of 2 per SM it fits 128 registers
  without spills for gate/up, ``profile_kernels --sass``): "mma, 2 per SM, byte permute" is
  the dispatcher's kernel (``mxfp4_mma.DECODE``, ``MIN_BLOCKS``);
- with ``--min-blocks N``, ``mxfp4_mma`` compiled with ``__launch_bounds__(threads, N)``
  (the compiler caps its registers so that N threadgroups fit an SM);
- with ``--ac-shapes``, ``mxfp4_mma_ac`` (code words and scales brought into threadgroup
  memory by asynchronous copies) at those shapes (rt, sk, gw, stages);
- with ``--projections gate_rows``, the gate matrix read the way down is (the kernel without
  GLU: one matrix, 32-row units, fp32 activations of width D), which tells whether gate/up
  streams slower than down because of its two matrices per warp and bf16 latents or because
  of its rows.

The "mma" rows decode by shifts and run the dispatcher's launch shapes and load hints
(gate/up with CS, streaming code loads; down without). The probes keep the kernel's CS
flag.

Beside them: a device copy, and ptxas's register count per shape (nvcc -Xptxas -v, sm_90,
when nvcc is on PATH). GB/s are over the weight bytes, scales included.

    python3 -m benchmarks.mxfp4_sweep                     # on the H200
    python3 -m benchmarks.mxfp4_sweep --probe --shapes 8,1,8,1 8,1,8,2
    python3 -m benchmarks.mxfp4_sweep --hints --shapes 8,1,8,1 --ac-shapes 2,1,8,3 1,1,8,4
    python3 -m benchmarks.mxfp4_sweep --shapes 8,1,8,1 --min-blocks 2 --rounds 3
"""

from __future__ import annotations

import argparse
import re
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from benchmarks.bench_mxfp4 import (
    BETA,
    CAP,
    add_layer_args,
    copy_gbps,
    random_experts,
    routing,
    time_rounds,
)
from benchmarks.profile_kernels import register_count
from kimi_k3.kernels import mxfp4_mma, source
from kimi_k3.kernels.source import Instance, Kernel, constant

# Per projection: (GLU, inner width KD, rows NR) from the latent width D and expert width I.
PROJ_DIMS = {
    "gate_up": lambda D, I: (True, D, I),
    "down": lambda D, I: (False, I, D),
    "gate_rows": lambda D, I: (False, D, I),
}

DEFAULT_SHAPES = ["8,1,8,1", "4,1,8,1", "16,1,8,1", "4,2,8,1", "8,1,8,0", "2,2,8,1"]

PROBE_STEP = r"""#define KK_STEP(q, sc, frag, bb, NBL)                                   \
  _Pragma("unroll") for (int u = 0; u < NBL; ++u) {                                   \
    const uint4 v0 = q[4 * u], v1 = q[4 * u + 1], v2 = q[4 * u + 2], v3 = q[4 * u + 3]; \
    const uint x = v0.x ^ v0.y ^ v0.z ^ v0.w ^ v1.x ^ v1.y ^ v1.z ^ v1.w ^ v2.x ^ v2.y \
        ^ v2.z ^ v2.w ^ v3.x ^ v3.y ^ v3.z ^ v3.w                                     \
        ^ sc[4 * u] ^ sc[4 * u + 1] ^ sc[4 * u + 2] ^ sc[4 * u + 3];                  \
    acc0 += AS_FLOAT(x & 0x3f7fffffu);                                                \
  }
"""


def _variant(name: str, body: str, helpers: str = "") -> Kernel:
    """A kernel with ``mxfp4_mma``'s inputs, outputs and header (plus ``helpers``), and
    another body."""
    mma = mxfp4_mma.MXFP4_MMA
    header = mxfp4_mma.MMA_HEADER + helpers
    return Kernel(name, mma.input_names, mma.output_names, body, header=header)


def probe_kernel() -> Kernel:
    """``mxfp4_mma`` with its step's math replaced by an XOR of the step's words."""
    body = mxfp4_mma.BODY
    start = body.index("#define KK_STEP(q, sc, frag, bb, NBL)")
    end = body.index("  // PP: two register buffers")
    return _variant("mxfp4_probe", body[:start] + PROBE_STEP + body[end:])


def template_of(kernel: Kernel):
    """``mxfp4_mma.template_ac`` for the asynchronous-copy kernels (their shape's last entry
    is the ring's stages), else ``mxfp4_mma.template``."""
    is_ac = kernel.name.startswith(("mxfp4_mma_ac", "mxfp4_ac"))
    return mxfp4_mma.template_ac if is_ac else mxfp4_mma.template


def registers(kernel: Kernel, dtype, KD, NR, k, glu, shape) -> str:
    """ptxas's register count for one instance (sm_90), with its spill stores if any, or '?'."""
    x_dt = dtype if glu else mx.float32
    tmpl = template_of(kernel)(x_dt, KD, NR, k, glu, *shape)
    inst = Instance(
        [x_dt, mx.uint32, mx.uint8, mx.uint32, mx.uint8, mx.int32, mx.float32], [mx.float32], tmpl
    )
    return register_count(kernel, [inst])


def nostage_kernel() -> Kernel:
    """The probe without the activation staging and its barriers (warps start at once)."""
    body = probe_kernel().body
    start = body.index("  const DEVICE T* xr")
    end = body.index("  float acc0")
    return _variant(
        "mxfp4_probe_nostage", body[:start] + "  const float unscale = 1.0f;\n" + body[end:]
    )


def noscale_kernel() -> Kernel:
    """The probe without the scale-byte loads (the code words only)."""
    body = probe_kernel().body
    for lhs in ("sc[4 * u]", "sc[4 * u + 1]", "sc[4 * u + 2]", "sc[4 * u + 3]"):
        i = body.index(lhs + " = e")
        body = body[:i] + lhs + " = 0u" + body[body.index(";", i) :]
    return _variant("mxfp4_probe_noscale", body)


# The same bytes per warp (its 16 rows of both matrices, or 32 rows of one), without the math,
# visited GW groups (16 bytes each) of every row at a time (GW = 0: whole rows, one
# contiguous stream), lane l taking 16-byte words l, l + 32, ... of the visit order, eight
# loads in flight per matrix: what the memory system gives each visit size.
STREAM_BODY = """
  constexpr int G = KD / 32;
  constexpr int GV = GW ? GW : G;                 // groups per row visit
  const uint lane = LANE;
  const uint warp = SIMDGROUP;
  const uint p = GROUP_POS.y;
  const uint unit = GROUP_POS.x * RT + warp % RT;
  constexpr int UNITS = GLU ? NR / 16 : NR / 32;
  if (unit >= UNITS) return;
  const size_t r0 = (size_t)inds[p] * NR + (GLU ? 16 : 32) * unit;
  const DEVICE uint4* qa = (const DEVICE uint4*)w_a + r0 * G;
  const DEVICE uint4* qb = (const DEVICE uint4*)w_b + (GLU ? r0 : r0 + 16) * G;
  uint acc = 0;
  for (int i = lane; i < 16 * G; i += 32 * 8) {
    uint4 a[8], b[8];
    _Pragma("unroll") for (int j = 0; j < 8; ++j) {
      const int e = i + 32 * j < 16 * G ? i + 32 * j : i;
      const int s = e / (16 * GV), r = e % (16 * GV);
      const int at = (r / GV) * G + s * GV + r % GV;
      a[j] = qa[at];
      b[j] = qb[at];
    }
    _Pragma("unroll") for (int j = 0; j < 8; ++j) acc ^= a[j].x ^ a[j].y ^ a[j].z ^ a[j].w
        ^ b[j].x ^ b[j].y ^ b[j].z ^ b[j].w;
  }
  out[(size_t)p * NR + (GLU ? 16 : 32) * unit + lane % 16] = AS_FLOAT(acc & 0x3f7fffffu);
"""


def stream_kernel() -> Kernel:
    return _variant("mxfp4_probe_stream", STREAM_BODY)


# 16-byte loads with a cache hint (CUDA only: benchmark variants, never dispatched).
HINT_HELPERS = """
__device__ inline uint4 kk_ld_l2_256(const uint4* p) {
  uint4 v;
  asm("ld.global.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ inline uint4 kk_ld_nc_256(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
"""
HINTS = {
    "plain": "",
    "ldg": "__ldg",
    "ldcg": "__ldcg",
    "ldcs": "__ldcs",
    "L2::256B": "kk_ld_l2_256",
    "nc, no L1, L2::256B": "kk_ld_nc_256",
}


EF_HELPER = """
__device__ inline void kk_cp_async16_ef(const void* dst, const void* src, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(s),
               "l"(src), "r"(valid ? 16 : 0), "l"(pol)
               : "memory");
}
"""


def ac_evict_first_kernel() -> Kernel:
    """``mxfp4_mma_ac`` with its code copies given L2's evict-first policy (CUDA only)."""
    old = "ASYNC_COPY16(ring[dst + 32 * i], src, true);"
    assert mxfp4_mma.BODY_AC.count(old) == 1
    body = mxfp4_mma.BODY_AC.replace(old, "kk_cp_async16_ef(&ring[dst + 32 * i], src, true);")
    return _variant("mxfp4_ac_ef", body, EF_HELPER)


def scales_hinted_kernel() -> Kernel:
    """``mxfp4_mma`` with ``__ldcs`` on its code words and its scale bytes."""
    body, n = re.subn(r"= (e[ab])\[([^\]]*)\];", r"= __ldcs(&\1[\2]);", _with_load("__ldcs"))
    assert n == 4, n
    return _variant("mxfp4_hint_ldcs_all", body)


def _with_load(fn: str) -> str:
    """``mxfp4_mma``'s body with its code-word loads ``KK_Q(q, i)`` spelled ``fn(&q[i])``
    (``fn`` empty: a plain load), whatever its CS flag."""
    old = "#define KK_Q(q, i) (CS ? LOAD_STREAM(&(q)[i]) : (q)[i])"
    assert mxfp4_mma.BODY.count(old) == 1
    new = f"#define KK_Q(q, i) {fn}(&(q)[i])" if fn else "#define KK_Q(q, i) (q)[i]"
    return mxfp4_mma.BODY.replace(old, new)


def hinted_kernel(hint: str) -> Kernel:
    """``mxfp4_mma`` with every code-word load given the hint's load function ("plain": no
    hint, whatever the kernel's CS flag)."""
    body = _with_load("" if hint == "plain" else HINTS[hint])
    name = "mxfp4_hint_" + re.sub(r"[^a-z0-9]+", "_", hint.lower()).strip("_")
    return _variant(name, body, HINT_HELPERS)


def projection_inputs(proj: str, w, z, h, inds, wts, hg=None) -> tuple:
    """``launch``'s (x, wa, sa, wb, sb, inds, params) for one projection: gate/up (latent
    ``z``, SiTU-GLU's beta and cap), down (``h``, the routing weights) or gate_rows (``hg``
    through the gate matrix as down reads its matrix). ``inds``, ``wts``: flat per pair."""
    if proj == "gate_up":
        return (z, *w["w1"], *w["w3"], inds, constant((BETA, CAP)))
    if proj == "down":
        return (h, *w["w2"], *w["w2"], inds, wts)
    return (hg, *w["w1"], *w["w1"], inds, wts)


def launch(kernel, x, wa, sa, wb, sb, inds, params, KD, NR, k, glu, shape):
    args = (x, wa, sa, wb, sb, inds, params, KD, NR, k, glu)
    backend = source.backend() or "cuda"  # KIMI_K3_KERNEL_BACKEND=emulator: a CPU smoke run
    return mxfp4_mma._launch(kernel, template_of(kernel), shape, backend, *args)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="rt,sk,gw,pp each")
    p.add_argument("--probe", action="store_true", help="also time the load-only probes")
    p.add_argument("--hints", action="store_true", help="also time cache-hinted code loads")
    p.add_argument(
        "--ac-shapes",
        nargs="*",
        default=[],
        help="rt,sk,gw,stages each: also time mxfp4_mma_ac (async copies) at these shapes",
    )
    p.add_argument(
        "--min-blocks",
        nargs="*",
        type=int,
        default=[],
        help="also time mxfp4_mma with __launch_bounds__(threads, N) for each N (CUDA only)",
    )
    p.add_argument(
        "--prmt",
        action="store_true",
        help="also time every mxfp4_mma row (bounded ones too) with the byte-permute decode",
    )
    p.add_argument("--tokens", type=int, default=1, help="tokens per call (k pairs each)")
    p.add_argument(
        "--projections",
        nargs="+",
        default=["gate_up", "down"],
        choices=list(PROJ_DIMS),
    )
    add_layer_args(p, rounds=1, rounds_help="time every job this many times")
    args = p.parse_args()

    D, I, k = args.dim, args.hidden, args.topk
    w = random_experts(args.experts, D, I, 0)
    rng = np.random.default_rng(0)
    sets = []
    for _ in range(args.calls):
        n = args.tokens
        inds, wts = routing(n, args.experts, k, rng)
        z = mx.random.normal((n, D)).astype(mx.bfloat16)
        h = mx.random.normal((n * k, I)).astype(mx.float32)
        hg = None  # gate_rows' activations, made only for that projection
        if "gate_rows" in args.projections:
            hg = mx.random.normal((n * k, D)).astype(mx.float32)
        sets.append((z, h, inds.reshape(-1).astype(mx.int32), wts.reshape(-1), hg))
    mx.eval(sets)
    # bytes of the distinct experts a call reads (mean over the calls)
    used = np.mean([len(np.unique(np.array(st[2]))) for st in sets])
    gu_bytes = used * 2 * (I * D // 2 + I * D // 32)
    dn_bytes = used * (I * D // 2 + I * D // 32)
    print(f"device copy: {copy_gbps(1 << 31, args.repeats):.0f} GB/s (read + write)")
    kernels = {"mma": mxfp4_mma.MXFP4_MMA}
    if args.probe:
        kernels["probe"] = probe_kernel()
        kernels["probe, no staging"] = nostage_kernel()
        kernels["probe, no scales"] = noscale_kernel()
        kernels["stream"] = stream_kernel()
    if args.hints:
        for hint in HINTS:
            kernels[f"mma, {hint}"] = hinted_kernel(hint)
        kernels["mma, ldcs codes and scales"] = scales_hinted_kernel()
    jobs = []
    for spec in args.shapes:
        rt, sk, gw, pp = (int(v) for v in spec.split(","))
        if 32 * rt * sk > 1024:
            continue
        shape_kernels = dict(kernels)
        for b in args.min_blocks:
            if 65536 // (32 * rt * sk * b) < 72:  # below 72 registers: hundreds of bytes spilt
                continue
            bound = mxfp4_mma.MXFP4_MMA.bounded(32 * rt * sk, b)
            shape_kernels[f"mma, {b} per SM"] = bound
        if args.prmt:
            for name in [n for n in shape_kernels if n == "mma" or n.endswith("per SM")]:
                shape_kernels[f"{name}, byte permute"] = mxfp4_mma.byte_permute_decode(
                    shape_kernels[name]
                )
        for name, kern in shape_kernels.items():
            for proj in args.projections:
                glu, KD, NR = PROJ_DIMS[proj](D, I)
                # whole steps of GW groups; GW = 0 (whole rows) is a stream visit size only
                if (gw and (KD // 32) % gw) or (gw == 0 and name != "stream"):
                    continue
                jobs.append((name, kern, proj, glu, KD, NR, (rt, sk, gw, bool(pp))))
    for spec in args.ac_shapes:
        rt, sk, gw, st = (int(v) for v in spec.split(","))
        for name, kern in (
            ("mma_ac", mxfp4_mma.MXFP4_MMA_AC),
            ("mma_ac, evict first", ac_evict_first_kernel()),
        ):
            if name != "mma_ac" and not args.hints:
                continue
            for proj in args.projections:
                glu, KD, NR = PROJ_DIMS[proj](D, I)
                if mxfp4_mma.shared_bytes_ac(KD, rt, sk, gw, st) > mxfp4_mma.SHARED_LIMIT["cuda"]:
                    continue
                jobs.append((name, kern, proj, glu, KD, NR, (rt, sk, gw, st)))
    with ThreadPoolExecutor(8) as pool:
        regs = list(
            pool.map(lambda j: registers(j[1], mx.bfloat16, j[4], j[5], k, j[3], j[6]), jobs)
        )
    print(
        "| kernel | proj | shape (rt, sk, gw, pp) | registers | threadgroups | us | GB/s | "
        "rel diff to the first shape | us, every round |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    # Every job is timed once per round (time_rounds); a row reports its best round.
    fns = []
    for _, kern, proj, glu, KD, NR, shape in jobs:

        def fn(z, h, inds, wts, hg, proj=proj, glu=glu, KD=KD, NR=NR, kern=kern, shape=shape):
            a = projection_inputs(proj, w, z, h, inds, wts, hg)
            return launch(kern, *a, KD, NR, k, glu, shape)

        fns.append(fn)
    times, failed = time_rounds(fns, sets, args.rounds, args.repeats)
    first = {}
    for j, ((name, _, proj, glu, _, NR, shape), reg) in enumerate(zip(jobs, regs)):
        units = NR // 16 if glu else NR // 32
        tgs = -(-units // shape[0]) * k * args.tokens
        row = f"| {name} | {proj} | {shape} | {reg} | {tgs} |"
        if j in failed:
            print(row, f"failed: {failed[j]} | | |", flush=True)
            continue
        t = min(times[j])
        nbytes = gu_bytes if glu else dn_bytes
        check = " |"
        if name.startswith("mma"):  # against the first shape's result on the same inputs
            got = np.array(fns[j](*sets[0]))
            ref = first.setdefault(proj, got)
            check = f" {np.linalg.norm(got - ref) / np.linalg.norm(ref):.1e} |"
        every = ", ".join(f"{x * 1e6:.1f}" for x in times[j])
        print(row, f"{t * 1e6:.1f} | {nbytes / t / 1e9:.0f} |{check} {every} |", flush=True)


if __name__ == "__main__":
    main()
