"""``python -m kimi_k3.doctor``: this machine's kernels checked, and how fast K3 would run.

    python -m kimi_k3.doctor                 # the machine, every kernel against the reference
    python -m kimi_k3.doctor --emulate       # the Metal kernels on the CPU emulator (g++)
    python -m kimi_k3.doctor --model DIR     # also: DIR's expert read rate, K3's projection

Prints MLX's version, the device, the kernel backend, memory and the free disk of the
model directory (the user cache without ``--model``). Then, for every kernel variant the
dispatcher can select on this backend (``kimi_k3.kernels.checks.KERNELS``), the variant
against the pure-MLX reference at small shapes and at K3's: the error against the
tolerance, the time of each, and a verdict; the verdicts are recorded for this machine
(``kimi_k3.kernels.verdict``), so that a failed variant is not used. Without a GPU it says
so and checks the reference paths instead. ``--model``: the read rate of DIR's expert files
per format it holds, through the streamer's readers and as raw reads of the same ranges
(``kimi_k3.streaming.readrate``), this machine's memory read rate, and from them the
projection model (``kimi_k3.projection``): the expert cache to give K3, the largest that
leaves room for the dense weights and the OS, and the tokens/s to expect per format and
trimming setting; and the same model's tokens/s for DIR itself.

Exit status: 0 when every check passes, 1 on a mismatch, NaN, compile or launch failure
(the report above says which), 2 on bad arguments.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kimi_k3 import cache_dir
from kimi_k3.checkpoint import checksums
from kimi_k3.checkpoint.files import CheckpointIndex
from kimi_k3.cli import (
    USAGE_ERROR,
    ArgumentError,
    HelpFormatter,
    Parser,
    UserError,
    fail,
    markdown_table,
    ram_gb,
)
from kimi_k3.default_model import CACHE_FRACTION
from kimi_k3.kernels import checks, dispatch, source, verdict
from kimi_k3.model import experts, kda
from kimi_k3.model.config import ModelArgs
from kimi_k3.projection import (
    COLIBRI_KEPT,
    DENSE_GB,
    EXPERTS_GB,
    KERNEL_EFFICIENCY,
    RESERVE_GB,
    Mac,
    Sizes,
    expert_budget_gb,
    hit_at,
    project,
    published_curve,
    recommended_budget,
)
from kimi_k3.streaming import readrate
from kimi_k3.streaming.sources import available, expert_bytes, expert_shapes, open_source
from kimi_k3.streaming.store import StreamOptions


def setup_arg_parser() -> Parser:
    p = Parser(
        prog="python -m kimi_k3.doctor",
        description=__doc__.splitlines()[0].split(": ", 1)[1],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", type=Path, help="a K3 model directory: read rates and projection")
    p.add_argument(
        "--emulate",
        action="store_true",
        help="run the Metal kernels through the CPU emulator (needs g++)",
    )
    p.add_argument("--small", action="store_true", help="small shapes only (skip K3's shapes)")
    p.add_argument("--reps", type=int, default=3, help="timed calls of each case")
    p.add_argument(
        "--read-gb", type=float, default=2.0, help="GB of expert reads per read test, at most"
    )
    p.add_argument(
        "--expert-cache-gb",
        type=float,
        help="DIR's expert cache for its own projected tokens/s (default: a quarter of its "
        "experts, the demo model's share)",
    )
    p.add_argument("--no-record", action="store_true", help="do not record kernel verdicts")
    return p


def check_args(args) -> None:
    if args.reps < 1:
        raise ArgumentError(f"--reps {args.reps}: expected 1 or more")
    if not args.read_gb > 0:
        raise ArgumentError(f"--read-gb {args.read_gb}: expected a positive number")
    if args.expert_cache_gb is not None and not args.expert_cache_gb >= 0:
        raise ArgumentError(f"--expert-cache-gb {args.expert_cache_gb}: expected 0 or more")
    if args.model is not None and not (args.model / "config.json").is_file():
        raise ArgumentError(f"--model {args.model}: not a model directory (no config.json)")
    if args.emulate and shutil.which("g++") is None:
        raise ArgumentError("--emulate: the emulator needs a C++ compiler (g++), none found")


# --- the machine ----------------------------------------------------------------------------


def memory_gbps(mb: int = 256, reps: int = 5) -> float:
    """MLX's read rate of memory on the default device: the best of ``reps`` sums of
    ``mb`` MB of float32."""
    a = mx.ones((mb * 1024 * 1024 // 4,), mx.float32)
    mx.eval(a)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(a.sum())
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / 1e9 / best


def machine_lines(model: Path | None, backend: str | None, emulate: bool) -> list[str]:
    gpu = mx.metal.is_available() or mx.cuda.is_available()
    info = mx.device_info() if gpu else {}
    where = model if model is not None else cache_dir()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 1e9
    if backend is None:
        kernels = "none: no GPU, the pure-MLX reference serves every call"
    elif emulate:
        kernels = "emulator (--emulate: the Metal kernels run on the CPU, for checking)"
    else:
        kernels = backend
    lines = [
        f"kimi_k3 doctor, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        f"MLX {mx.__version__}; Python {platform.python_version()}; "
        f"{platform.system()} {platform.release()} {platform.machine()}",
        f"device: {mx.default_device()}, {verdict.device_name()}"
        + (f" ({', '.join(f'{k}={v}' for k, v in sorted(info.items()))})" if info else ""),
        f"kernel backend: {kernels}",
        f"memory: {ram_gb():.1f} GB",
        f"free disk at {where}: {free:.1f} GB",
    ]
    forced = os.environ.get("KIMI_K3_REFERENCE", "")
    if forced not in ("", "0"):
        lines.append(f"note: KIMI_K3_REFERENCE={forced} forces the reference in model runs")
    if os.environ.get(verdict.CHECK_ENV) == "0":
        lines.append(f"note: {verdict.CHECK_ENV}=0: model runs skip the first-use check")
    return lines


# --- the kernels ----------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def kernel_table(results: list, kernels: bool = True) -> list[str]:
    """One row per result; ``kernels`` off: reference paths, each against another."""
    times = ["kernel ms", "reference ms"] if kernels else ["path ms", "other path ms"]
    head = ["kernel" if kernels else "path", "shape", "error", "tolerance", *times, "x", "verdict"]
    rows = []
    for r in results:
        speed = (
            f"{r.reference_ms / r.kernel_ms:.2f}"
            if r.kernel_ms and r.reference_ms and r.ok
            else "-"
        )
        err = "-" if r.err is None else f"{r.err:.1e}"
        verdict = r.verdict if r.ok else f"{r.verdict.upper()}: {r.detail}"
        rows.append(
            [
                r.kernel,
                r.shape,
                err,
                f"{r.tol:.0e}",
                _ms(r.kernel_ms),
                _ms(r.reference_ms),
                speed,
                verdict,
            ]
        )
    return markdown_table(head, rows).splitlines()


# --- the cases: each kernel variant, and the reference paths where there is no kernel ---


def kernel_cases(backend: str, k3: bool = True) -> list[checks.Case]:
    """The doctor's cases for every variant the dispatcher can select on ``backend``: the
    small case, then (``k3``) K3's shapes at the sizes where the dispatcher picks each
    variant: KDA decode at batch 1 and 4 and chunked prefill of 64 and 300 tokens; expert
    decode at 1 and 2 tokens (the one-launch kernel's range on CUDA) and 8 (128 pairs, the
    per-pair kernels' largest), the grouped prefill at 64 tokens (1024 pairs); the lower-bit
    experts' kernels (``affine2_*``, ``affine3_*``, on random 2- and 3-bit stacks) likewise:
    decode at 1 and 8 tokens, prefill at 64."""
    out = []
    for name in checks.KERNELS[backend]:
        out.append(checks.small_case(name, backend))
        if not k3:
            continue
        if name.startswith("kda"):
            sizes = [(1, 1), (4, 1)] if name == "kda_decode" else [(1, 64), (1, 300)]
            out += [checks.kda_case(name, backend, B, T, **checks.K3_KDA) for B, T in sizes]
            continue
        E, D, I, k = (checks.K3_EXPERTS[x] for x in "EDIk")
        most = dispatch.EXPERT_DECODE_MAX_PAIRS // k
        if "prefill" in name:
            tokens = [64]
        elif name.startswith("mxfp4_one"):
            tokens = [1, dispatch.EXPERT_ONE_LAUNCH_MAX_PAIRS // k]
        elif name.startswith("mxfp4_mma"):
            tokens = [most]
        else:
            tokens = [1, most]
        out += [checks.expert_case(name, backend, E, D, I, N, k) for N in tokens]
    return out


def reference_cases(k3: bool = True) -> list[checks.Case]:
    """The pure-MLX paths a machine without kernels runs, each against another rendering of
    the same maths: the KDA mixer over T tokens at once against T decode steps through
    ``kda.kda_mix`` (the compiled one-token step), carrying the state; the experts' quantized
    matmuls (``gather_qmm``) against dequantized weights in dense fp32 matmuls (the weights
    dequantized on the first call)."""
    shapes = [(1, 2, 64, 16, 16, 128, 128, 8, 4)]
    if k3:
        shapes.append((1, 96, 128, 64, 32, 3584, 3072, 1, 16))
    out = []
    for B, H, K, T, E, D, I, N, k in shapes:
        out.append(_kda_steps_case(B, T, H, K))
        out.append(_dense_experts_case(E, D, I, N, k))
    return out


def _kda_steps_case(B: int, T: int, H: int, K: int) -> checks.Case:
    p, args = checks.kda_layer(H, K), checks.kda_inputs(B, T, H, K)

    def steps():
        x, (conv, state) = args[:6], args[6:]
        ys = []
        for t in range(T):
            y, conv, state = kda.kda_mix(p, *(a[:, t : t + 1] for a in x), conv, state)
            ys.append(y)
        return mx.concatenate(ys, axis=1), conv, state

    shape = f"B={B} T={T} H={H} K={K}"
    return checks.Case(
        "kda reference: T steps vs all T",
        shape,
        steps,
        lambda: kda.kda_mix_reference(p, *args),
        checks.KDA_TOL,
    )


def _dense_experts_case(E: int, D: int, I: int, N: int, k: int) -> checks.Case:
    w = checks.random_experts(E, D, I)
    inds, wts = checks.routing(N, E, k)
    z = mx.array(np.random.default_rng(2).standard_normal((N, D)).astype(np.float32))

    deq = {}  # dequantized once: the other path is the dense products

    def dense():
        if not deq:
            for e in sorted(set(np.array(inds).reshape(-1).tolist())):
                deq[e] = {
                    n: mx.dequantize(q[e], s[e], group_size=32, bits=4, mode="mxfp4")
                    for n, (q, s) in w.items()
                }
            mx.eval(deq)
        rows = []
        for t in range(N):
            acc = mx.zeros((D,), mx.float32)
            for j in range(k):
                d = deq[int(inds[t, j])]
                h = experts.situ_glu(d["w1"] @ z[t], d["w3"] @ z[t], checks.BETA, checks.CAP)
                acc = acc + wts[t, j] * (d["w2"] @ h)
            rows.append(acc)
        return mx.stack(rows)

    shape = f"N={N} k={k} D={D} I={I} E={E}"
    return checks.Case(
        "experts reference: gather_qmm vs dense",
        shape,
        lambda: experts.expert_glu_reference(z, w, inds, wts, checks.BETA, checks.CAP),
        dense,
        checks.EXPERT_TOL,
    )


SLOW_NOTE = {  # on a CPU, by backend: what the cases at K3's shapes cost
    None: ": those at K3's shapes take most of the time, tens of seconds on a CPU "
    "(--small skips them)",
    "emulator": ": those at K3's shapes run the Metal kernels through the CPU emulator and "
    "take minutes (--small skips them)",
}
NO_MODEL_HINT = (
    "How fast K3 would run here: python -m kimi_k3.doctor --model DIR, DIR a K3 checkpoint, "
    "or without one a synthetic checkpoint of K3's expert size "
    "(docs/usage.md#how-fast-k3-would-run-here)"
)


def check_kernels(backend: str | None, k3: bool, reps: int, record: bool, log) -> list:
    """Run every case; record one verdict per variant (all its cases pass, or the first
    failure) unless ``record`` is off or there is no backend."""
    todo = kernel_cases(backend, k3) if backend else reference_cases(k3)
    log(f"{len(todo)} cases" + (SLOW_NOTE.get(backend, "") if k3 else ""))
    results, per_variant = [], {}
    for i, case in enumerate(todo):
        t0 = time.perf_counter()
        res = checks.run_case(case, reps)
        results.append(res)
        seconds = time.perf_counter() - t0
        log(f"  [{i + 1}/{len(todo)}] {res.kernel} {res.shape}: {res.verdict} ({seconds:.1f} s)")
        first = per_variant.get(res.kernel)
        if first is None or (first[0].ok and not res.ok):
            per_variant[res.kernel] = (res, seconds)
    if backend and record:
        verdict.record(
            {
                verdict.machine_key(name, backend): verdict.verdict_record(res, s, "doctor")
                for name, (res, s) in per_variant.items()
            }
        )
    return results


def first_use_line(backend: str) -> str:
    """The time of the first-use check of every variant (its small case, as a model run
    makes it), the kernels already built: what a run pays once per machine."""
    names = checks.KERNELS[backend]
    t0 = time.perf_counter()
    for name in names:
        checks.run_case(checks.small_case(name, backend))
    took = time.perf_counter() - t0
    return (
        f"first-use check of all {len(names)} variants (small cases, kernels built): "
        f"{took:.2f} s (budget 2 s)"
    )


# --- the model directory --------------------------------------------------------------------


def read_rates(
    path: Path, kind: str, read_gb: float, reps: int, log, args=None, index=None
) -> dict:
    """Streamer and raw reads of ``kind``'s experts in ``path``, decode-shaped (top-k a layer
    call, what the last call held not read again), interleaved ``reps`` times; medians.
    ``args``, ``index``: ``path``'s ``ModelArgs`` and ``CheckpointIndex``, where the caller
    has them."""
    args = args or ModelArgs.from_path(path)
    layers = moe_layers(args)
    source = open_source(path, index, args, layers, kind)
    if kind != "pack":
        found = checksums.recorded_file(path)
        source.sums = checksums.read_manifest(found) if found else None
    layout = expert_shapes(args)
    one = expert_bytes(layout)
    k = min(args.num_experts_per_token, args.num_experts)
    # at most read_gb: two rounds over as many layers as that allows, more rounds (up to 64)
    # where every layer fits
    n = max(2, int(read_gb * 1e9 / (one * k)))
    layers = layers[: max(1, min(len(layers), n // 2))]
    rounds = int(np.clip(n // len(layers), 2, 64))
    plan = readrate.misses(readrate.plan(args.num_experts, layers, "decode", rounds, k))
    opts = StreamOptions()
    got = {"streamer": [], "raw": []}
    for _ in range(reps):
        got["streamer"].append(
            readrate.streamer_read(source, layout, plan, opts.io_threads, opts.direct_io)
        )
        got["raw"].append(readrate.raw_read(source, plan, opts.io_threads))
    s, r = got["streamer"][-1], got["raw"][-1]
    out = {
        "format": kind,
        "gb": s["gb"],
        "streamer": float(np.median([x["wall_gbps"] for x in got["streamer"]])),
        "raw": float(np.median([x["wall_gbps"] for x in got["raw"]])),
        "direct_io": s["direct_io"],
        "checked": s["checked"],
    }
    log(
        f"  {kind}: {r['gb']:.3f} GB a run, streamer {out['streamer']:.2f} GB/s, "
        f"raw {out['raw']:.2f} GB/s"
    )
    return out


def moe_layers(args) -> list[int]:
    return [i for i in range(args.num_hidden_layers) if args.is_moe(i)]


def dir_sizes(args, index) -> Sizes:
    """``projection.Sizes`` of a model (its ``ModelArgs`` and ``CheckpointIndex``; dense GB:
    its safetensors bytes that are not routed experts)."""
    dense = sum(
        t.nbytes for n, t in index.tensors.items() if not experts.ROUTED_EXPERT_NAME.search(n)
    )
    return Sizes(
        len(moe_layers(args)),
        args.num_experts,
        args.num_experts_per_token,
        expert_bytes(expert_shapes(args)),
        dense / 1e9,
    )


def model_lines(path: Path, opts, log) -> list[str]:
    args = ModelArgs.from_path(path)
    index = CheckpointIndex(path) if any(path.glob("*.safetensors")) else None
    kinds = available(path, index, moe_layers(args)[0])
    if not kinds:
        raise ValueError(f"--model {path}: no routed experts found (no pack, shards or mlx-lm)")
    log("read rates:")
    rates = [read_rates(path, kind, opts.read_gb, opts.reps, log, args, index) for kind in kinds]
    log("memory read rate ...")
    mem = memory_gbps()
    ram = ram_gb()
    lines = [
        f"## Expert reads of {path}",
        "",
        "Decode-shaped reads (top-k experts a layer call, the previous call's not read again), "
        f"median of {opts.reps} interleaved runs; streamer: its reader threads, direct I/O, "
        "checksums where the directory has them, into cache slots; raw: the same byte "
        "ranges at the same depth into an aligned buffer.",
        "",
    ]
    rows = []
    for r in rates:
        eff = r["streamer"] / r["raw"]
        direct = {True: "direct", False: "buffered (page cache)", None: "-"}[r["direct_io"]]
        rows.append(
            [
                r["format"],
                f"{r['gb']:.3f}",
                f"{r['streamer']:.2f}",
                f"{r['raw']:.2f}",
                f"{eff:.2f}",
                direct,
                "yes" if r["checked"] else "no",
            ]
        )
    lines += markdown_table(
        ["format", "GB a run", "streamer GB/s", "raw GB/s", "efficiency", "I/O", "checksums"],
        rows,
    ).splitlines()
    if any(r["direct_io"] is False for r in rates):
        lines += ["", "Buffered reads may come from the page cache: not the drive's rate."]
    budget = expert_budget_gb(ram)
    lines += [
        "",
        "## How fast K3 would run here",
        "",
        f"memory {ram:.1f} GB; MLX reads memory at {mem:.1f} GB/s (sum over 256 MB); the "
        f"SSD rate is the raw rate above, the read efficiency streamer / raw (capped at 1).",
        f"Largest expert cache that leaves room for K3's dense weights ({DENSE_GB:.0f} GB) "
        f"and the OS, KV cache and activations ({RESERVE_GB:.0f} GB): {budget:.1f} GB.",
        f"Recommended: --expert-cache-gb {recommended_budget(ram, StreamOptions().io_threads)} "
        "(that, less the streamer's read buffers, in whole GB).",
    ]
    if budget <= 0:
        lines.append(
            f"K3 does not fit this machine's {ram:.1f} GB: it needs more than "
            f"{DENSE_GB + RESERVE_GB:.0f} GB. The rows below are with no expert cache."
        )
    rows, b = [], max(budget, 0.0)
    f = min(1.0, b / EXPERTS_GB)
    h = hit_at(published_curve(), f)
    lines += [
        f"Hit rate h = {h:.2f} at f = {f:.3f}, the cache's share of K3's {EXPERTS_GB:.0f} GB "
        "of experts, read off the hit rates published for real K3 decode "
        "(kimi_k3.projection.PUBLISHED_HITS; benchmarks/project_k3.py has the formats, "
        f"shedding and prediction). Kernels at {KERNEL_EFFICIENCY} of the memory rate (the "
        "MXFP4 decode kernels on the H200).",
        "",
    ]
    for r in rates:
        eff = min(1.0, r["streamer"] / r["raw"])
        mac = Mac("here", ram, r["raw"], mem)
        for setting, kept in (("exact", 1.0), ("trimmed to half (top-p 0.5)", COLIBRI_KEPT)):
            got = project(mac, 1, h, kept, eff, KERNEL_EFFICIENCY)
            rows.append(
                [
                    r["format"],
                    setting,
                    f"{b:.1f}",
                    f"{got['ssd_s']:.2f}",
                    f"{got['compute_s']:.2f}",
                    f"{got['tok_s']:.3f}",
                    f"{got['tok_s_overlap']:.3f}",
                ]
            )
    lines += markdown_table(
        [
            "format",
            "experts",
            "expert cache GB",
            "SSD s",
            "compute s",
            "tok/s",
            "tok/s, overlapped",
        ],
        rows,
    ).splitlines()
    lines += ["", *own_lines(path, dir_sizes(args, index), rates, ram, mem, opts)]
    return lines


def own_lines(path: Path, sizes: Sizes, rates: list, ram: float, mem: float, opts) -> list[str]:
    """The projection for the directory's own model (to compare with a measured streamed
    decode of it: ``python -m kimi_k3.generate --model DIR --expert-cache-gb GB``)."""
    gb = opts.expert_cache_gb
    gb = CACHE_FRACTION * sizes.experts_gb if gb is None else gb
    f = min(1.0, gb / sizes.experts_gb)
    rows = []
    for r in rates:
        eff = min(1.0, r["streamer"] / r["raw"])
        got = project(Mac("here", ram, r["raw"], mem), 1, f, 1.0, eff, KERNEL_EFFICIENCY, sizes)
        rows.append([r["format"], f"{got['ssd_gb'] * 1e3:.2f}", f"{got['tok_s']:.1f}"])
    return [
        f"## This directory's own model, streamed with --expert-cache-gb {gb:.4g}",
        "",
        f"{sizes.moe_layers} MoE layers of {sizes.experts} experts of "
        f"{sizes.expert_bytes / 1e6:.3f} MB, top-{sizes.top_k}; dense {sizes.dense_gb:.3f} GB; "
        f"h = f = {f:.2f}; the same model as above, exact. Memory-bound compute: a small "
        "model's decode is bound by per-op overheads instead, so a measured decode is slower.",
        "",
        *markdown_table(["format", "SSD MB / token", "tok/s"], rows).splitlines(),
    ]


# --- main -----------------------------------------------------------------------------------


def main(argv=None) -> int:
    opts = setup_arg_parser().parse_args(argv)

    try:
        check_args(opts)
        backend = "emulator" if opts.emulate else source.backend()
    except (UserError, ValueError) as e:
        return fail(str(e), USAGE_ERROR)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    out = machine_lines(opts.model, backend, opts.emulate)
    print("\n".join(out) + "\n", flush=True)
    log("checking kernels ..." if backend else "no GPU: checking the reference paths ...")
    results = check_kernels(backend, not opts.small, opts.reps, not opts.no_record, log)
    what = "kernel variants against the reference" if backend else "reference paths"
    lines = [f"## {what} ({'small shapes' if opts.small else 'small and K3 shapes'})", ""]
    lines += kernel_table(results, backend is not None)
    bad = [r for r in results if not r.ok]
    lines.append("")
    if bad:
        names = sorted({r.kernel for r in bad})
        then = (
            f"Model runs use the reference for {'them' if len(names) > 1 else 'it'} on this "
            "machine."
            if backend
            else "MLX's own operations disagree on this machine."
        )
        lines.append(
            f"FAILED: {', '.join(names)}. {then} Please report this whole output in an issue."
        )
    else:
        lines.append(f"all {len(results)} checks pass")
    if backend:
        lines.append(first_use_line(backend))
    print("\n".join(lines), flush=True)
    if opts.model is not None:
        try:
            text = model_lines(opts.model, opts, log)
        except (OSError, ValueError) as e:
            return fail(str(e))
        print("\n" + "\n".join(text), flush=True)
    else:
        print("\n" + NO_MODEL_HINT, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
