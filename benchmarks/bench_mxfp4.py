"""MXFP4 expert kernels against MLX's ``gather_qmm`` at Kimi K3 size (run on a GPU).

Decode: effective GB/s over the selected experts' bytes, against a device copy measured in the
same run and the HBM datasheet peak, and against ``expert_glu_reference`` (``gather_qmm``) on the
same inputs; the decode kernels of one token count are timed in interleaved rounds (each
round times every kernel once), and a row gives its best round and lists them all. A decode
row's time is per call of a dependent chain (``time_chain``: each call's latent is the call
before's output, as layers follow each other; the Python calls that build the graph are not
timed); ``--timing batch`` times independent calls with their Python calls, as the tables
before 2026-12-02's fifth session did. Prefill:
tokens/s of one MoE layer's routed experts. Every comparator runs in its own try/except, so
one failure is a row that says so, not a crash.

    python -m benchmarks.bench_mxfp4 --out bench_mxfp4.md
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import time
import traceback

import mlx.core as mx
import numpy as np

from kimi_k3.experts import expert_glu_reference
from kimi_k3.kernels import mxfp4_prefill_mma
from kimi_k3.kernels.mxfp4_decode import expert_glu_decode
from kimi_k3.kernels.mxfp4_prefill import expert_glu_prefill, tile_tokens_for
from kimi_k3.kernels.mxfp4_prefill_mma import expert_glu_prefill_mma

BETA, CAP = 4.0, 25.0


def k3_shape_args(ap):
    """The one-call shape options (``--dim --hidden --experts --topk --tokens``, K3's by
    default) of the scripts that time single expert calls (chain_length, dispatch_host)."""
    ap.add_argument("--dim", type=int, default=3584)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=3584, help="latent width D")
    p.add_argument("--hidden", type=int, default=3072, help="expert width I")
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--decode-experts", type=int, default=64, help="stack the decode picks from")
    p.add_argument("--decode-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--prefill-experts", type=int, default=896, help="one layer's experts")
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=[512, 4096])
    p.add_argument(
        "--tiles",
        type=int,
        nargs="*",
        default=[],
        help="LUT prefill kernel: tokens-per-tile values to time besides its choice",
    )
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM datasheet peak")
    p.add_argument("--calls", type=int, default=20, help="calls per timed batch")
    p.add_argument("--repeats", type=int, default=5, help="timed batches (best is reported)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds, each timing every kernel once (decode and prefill)",
    )
    p.add_argument(
        "--timing",
        default="chain",
        choices=["chain", "batch"],
        help="decode: chain (each call on the previous one's output, the graph built before "
        "the clock; time_chain) or batch (independent calls, Python's calls timed too; the "
        "decode tables before 2026-12-02's fifth session)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", action="store_true", help="also time other decode kernels")
    p.add_argument(
        "--occupancy", action="store_true", help="also time OCCUPANCY_ROWS (in --variants too)"
    )
    p.add_argument(
        "--fused", action="store_true", help="also time mxfp4_fused's one-launch decodes"
    )
    p.add_argument(
        "--one",
        action="store_true",
        help="also time mxfp4_one's one-launch decodes (each place for its counters)",
    )
    p.add_argument(
        "--tiled",
        action="store_true",
        help="also time the dispatched kernels on expert_layout's tiles (the "
        "stacks converted once, before timing)",
    )
    p.add_argument(
        "--read-limit",
        action="store_true",
        help="also time READ_LIMIT_ROWS: the call's weight bytes read and nothing else "
        "(benchmarks/read_limit.py), the decode's ceiling",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="also time STREAM_ROWS: the streamed-ring decode (kernels/mxfp4_stream.py) at "
        "several launches, and its probe without products",
    )
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument(
        "--no-lut", action="store_true", help="prefill: leave out the LUT kernel's rows (Metal's)"
    )
    p.add_argument("--out", default=None, help="write the markdown table here")
    return p


def add_layer_args(p: argparse.ArgumentParser, rounds: int, rounds_help: str | None = None):
    """The one-layer decode benchmarks' common options (``mxfp4_sweep``, ``gpu_time``,
    ``mxfp4_gate_up``): K3's expert shape, the stack the calls pick from, calls per timing,
    timings per job and rounds (default ``rounds``)."""
    p.add_argument("--dim", type=int, default=3584)
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=rounds, help=rounds_help)


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


def routing(tokens: int, experts: int, topk: int, rng: np.random.Generator):
    """Distinct top-k experts per token (flat popularity, as K3's router is trained to give)."""
    inds = np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk].astype(np.int32)
    weights = rng.random((tokens, topk)).astype(np.float32)
    weights /= weights.sum(axis=1, keepdims=True)
    return mx.array(inds), mx.array(weights)


def batch_splits(fn, inputs: list, repeats: int) -> list[tuple[float, float]]:
    """Per batch (``repeats`` of them, after a warm-up): seconds per call spent building the
    graph of every input set (Python's calls), then evaluating it once."""
    mx.eval([fn(*a) for a in inputs[:2]])
    splits = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [fn(*a) for a in inputs]
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t2 = time.perf_counter()
        splits.append(((t1 - t0) / len(inputs), (t2 - t1) / len(inputs)))
    return splits


def time_batch(fn, inputs: list, repeats: int) -> float:
    """Best seconds per call: each batch enqueues every input set, then evaluates once."""
    return min(build + run for build, run in batch_splits(fn, inputs, repeats))


def chain_link(out: mx.array, args: tuple) -> tuple:
    """The next decode call's inputs made to depend on this one's output: its latent is the
    output (fp32 [N, D]) cast to the latent's dtype (one small kernel)."""
    return (out.astype(args[0].dtype), *args[1:])


def chain_output(fn, inputs: list, length: int, link=chain_link) -> mx.array:
    """The last output of a chain of ``length`` calls on ``inputs`` taken in turn, each call
    but the first on ``link(previous output, its inputs)`` (built, not evaluated)."""
    out = None
    for i in range(length):
        a = inputs[i % len(inputs)]
        out = fn(*(a if out is None else link(out, a)))
    return out


def time_chain(fn, inputs: list, repeats: int, link=chain_link) -> float:
    """Best seconds per call of a chain of calls, each on ``link(previous output, its
    inputs)``, so that call i + 1 cannot start before call i is done, as in a model's
    forward pass. The graph is built before the clock starts: the time is the evaluation
    (the CPU encodes kernels while the GPU runs the ones before), not Python's calls. Unlike
    ``time_batch`` (independent calls, which MLX's CUDA graphs may run side by side, and
    whose Python calls are timed), this is what a layer's expert kernels take in a decode."""
    mx.eval(fn(*inputs[0]))
    best = math.inf
    for _ in range(repeats):
        out = chain_output(fn, inputs, len(inputs), link)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        best = min(best, (time.perf_counter() - t0) / len(inputs))
    return best


def time_rounds(
    fns: list, inputs: list, rounds: int, repeats: int, width: int = 80, timer=time_batch
):
    """Every ``fns[j]`` timed once per round (``timer``: ``time_batch`` or ``time_chain``), the
    rounds one after another, so a drift of the clocks over the run reaches all alike. Returns
    (``times[j]``: seconds per call of each round, ``failed``: {j: the first error, whitespace
    folded, ``width`` chars})."""
    times, failed = [[] for _ in fns], {}
    for _ in range(rounds):
        for j, fn in enumerate(fns):
            if j in failed:
                continue
            try:
                times[j].append(timer(fn, inputs, repeats))
            except Exception as e:  # noqa: BLE001 - a launch that fails is a row
                failed[j] = re.sub(r"\s+", " ", str(e))[:width]
    return times, failed


def copy_gbps(nbytes: int, repeats: int) -> float:
    """Device copy bandwidth (read + write) of a ``nbytes`` buffer: the practical ceiling."""
    x = random_words((nbytes // 4,), mx.random.key(0))
    one = mx.array(1, dtype=mx.uint32)
    mx.eval(x)
    t = time_batch(lambda a: a ^ one, [(x,)] * 4, repeats)
    return 2 * nbytes / t / 1e9


def rel_err(a: mx.array, b: mx.array) -> float:
    a = np.asarray(a.astype(mx.float32), dtype=np.float64)
    b = np.asarray(b.astype(mx.float32), dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


class Table:
    def __init__(self):
        self.rows: list[tuple[str, ...]] = []

    def add(self, *cells):
        self.rows.append(tuple(str(c) for c in cells))
        print(" | ".join(self.rows[-1]), flush=True)

    def markdown(self, header: tuple[str, ...]) -> str:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines)


def attempt(table: Table, label: str, fn, *args):
    """``fn(*args)`` for one comparator; a failure becomes a row with the error, not an abort."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - every comparator failure is reported, none fatal
        traceback.print_exc()
        table.add(label, "FAILED", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", "", "")
        return None


def decode_row(table, label, times: list, nbytes, args, copy):
    """A decode row: the best of ``times`` (seconds per call, one per round), its rates, and
    every round in the check column."""
    t = min(times)
    gbps = nbytes / t / 1e9
    of_copy = f"{100 * gbps / copy:.0f}% of copy" if copy else "copy n/a"
    of_peak = f"{100 * gbps / args.peak_gbps:.0f}% of peak, {of_copy}"
    rounds = "rounds (ms): " + ", ".join(f"{x * 1e3:.3f}" for x in times)
    table.add(label, f"{t * 1e3:.3f} ms", f"{gbps:.0f} GB/s", of_peak, rounds)
    return t


def compare(table, label, ours, ref, t_ours, t_ref, inputs):
    """A speed-up row with the relative error of ours against the reference on one input."""
    if t_ours and t_ref:
        err = rel_err(ours(*inputs[0]), ref(*inputs[0]))
        table.add(label, f"{t_ref / t_ours:.2f}x faster", "", "", f"rel err {err:.1e}")


def with_settings(module, fn=None, **tables):
    """A decode kernel module's ``expert_glu_decode`` (or ``fn``) with each per-projection
    dict of ``module`` named in ``tables`` (``LAUNCH``: launch shapes; ``MIN_BLOCKS``: launch
    bounds; ``DECODE``) set to its (gate/up, down) values."""

    def run(*a):
        saved = {name: dict(getattr(module, name)) for name in tables}
        for name, (gate_up, down) in tables.items():
            getattr(module, name).update(gate_up=gate_up, down=down)
        try:
            return (fn or module.expert_glu_decode)(*a)
        finally:
            for name, values in saved.items():
                getattr(module, name).update(values)

    return run


def with_setting(module, table: str, gate_up, down):
    """``with_settings`` for one table."""
    return with_settings(module, **{table: (gate_up, down)})


# Decode rows at other __launch_bounds__ than the default (mxfp4_mma.MIN_BLOCKS): threadgroups
# per SM for (gate/up, down); 1 is no bound.
MIN_BLOCK_ROWS = [(1, 1), (1, 2)]


# Launch shapes of the tensor-core decode kernels that --variants times: (gate/up, down),
# each (row tiles, splits of a row, groups per step, double-buffered loads).
MMA_SHAPES = [
    ((8, 1, 4, True), (4, 2, 4, True)),
    ((8, 1, 8, True), (4, 2, 8, True)),
    ((8, 1, 8, False), (4, 2, 8, False)),
    ((4, 1, 8, True), (2, 2, 8, True)),
    ((8, 1, 16, True), (8, 1, 16, True)),
    # gate/up's 384 threadgroups are 1.45 waves of the 264 that fit (two per SM); with its
    # groups split over two warps they are 768, 2.9 waves
    ((4, 2, 8, True), (8, 1, 8, True)),
]


# Launches that keep every threadgroup of gate/up resident at once (at two per SM its 384
# threadgroups are a wave of 264 and a second of 120, and the SMs idle 26% of the kernel):
# ((gate/up shape, threadgroups per SM), (down shape, threadgroups per SM)). 4-group steps
# without double buffering fit 72-78 registers (3 per SM: 396 slots); 128-thread
# threadgroups of 8-group steps fit 80 at 6 per SM (768 threadgroups, 792 slots; ptxas, no
# spill with the shift decode, 36 bytes with byte permutes).
OCCUPANCY_ROWS = [
    (((8, 1, 4, False), 3), ((8, 1, 8, True), 2)),
    (((4, 1, 8, False), 6), ((8, 1, 8, True), 2)),
    (((8, 1, 8, False), 3), ((8, 1, 8, True), 2)),
    (((8, 1, 4, False), 3), ((8, 1, 4, False), 3)),
]


_TILED: dict = {}  # (id(w), tile): (w, its copy); w is kept so that its id is not reused


def tiled_copy(w: dict, tile=None) -> dict:
    """``tile(w)`` (default ``expert_layout.tile``), evaluated, made once per stack and tiling
    (the timers' warm-up makes it, not a timed call)."""
    from kimi_k3.kernels import expert_layout

    tile = tile or expert_layout.tile
    key = (id(w), tile)
    if key not in _TILED:
        t = tile(w)
        mx.eval(t)
        _TILED[key] = (w, t)
    return _TILED[key][1]


def tiled_decode(decode=None):
    """``decode`` (default: the three-launch kernels, ``mxfp4_mma``'s
    ``expert_glu_decode_tiled``; or any function that reads ``TiledStacks`` as tiles) reading
    the stacks in ``expert_layout``'s tiles (a warp load is 512 contiguous bytes),
    each stack converted once (``tiled_copy``)."""
    from kimi_k3.kernels import mxfp4_mma

    decode = decode or mxfp4_mma.expert_glu_decode_tiled

    def fn(z, w, inds, weights, beta, cap):
        return decode(z, tiled_copy(w), inds, weights, beta, cap)

    return fn


# mxfp4_one's rows (--one) per place for its counters (mxfp4_one.COUNTS).
ONE_ROWS = {
    "output": "one launch (mxfp4_one: gate/up, down and the sum meeting through counters in "
    "its zero-filled output)",
    "input": "one launch, counters in a zero input",
    "chained": "one launch, counters left zeroed by the call before (no fill)",
}


def decode_variants(
    sweep: bool,
    occupancy: bool = False,
    fused: bool = False,
    one: bool = False,
    tiled: bool = False,
) -> dict:
    """The decode kernels at their launch shapes: tensor cores (``mxfp4_mma``, what the
    dispatcher picks on CUDA) and the LUT kernels (``mxfp4_decode``, Metal's), plus
    (``--variants``) other launch shapes of both, (``--occupancy``) ``OCCUPANCY_ROWS`` and
    (``--fused``) the one-launch kernels of ``mxfp4_fused`` (gate/up, SiTU-GLU and a slice of
    down per threadgroup, then the sum: two launches a call instead of three) and (``--one``)
    ``mxfp4_one`` (gate/up, down and the sum in one grid) with each place for its counters,
    and (``--tiled``) the dispatched kernels on ``expert_layout``'s tiles (``tiled_decode``)."""
    from kimi_k3.kernels import mxfp4_decode, mxfp4_mma, mxfp4_one

    bounds = tuple(mxfp4_mma.MIN_BLOCKS[p] for p in ("gate_up", "down"))
    decodes = tuple(mxfp4_mma.DECODE[p] for p in ("gate_up", "down"))
    how = decodes[0] if decodes[0] == decodes[1] else " / ".join(decodes)
    default = f"decode kernel (tensor cores, {how} decode, at least {bounds} per SM)"
    out = {
        default: mxfp4_mma.expert_glu_decode,
        "decode kernel (tensor cores, async copies)": mxfp4_mma.expert_glu_decode_ac,
        "decode kernel (LUT)": expert_glu_decode,
    }
    for decode in [d for d in mxfp4_mma.DECODES if d not in decodes]:
        label = f"tensor cores, {decode} decode, at least {bounds} per SM"
        out[label] = with_setting(mxfp4_mma, "DECODE", decode, decode)
    for gu, dn in [b for b in MIN_BLOCK_ROWS if b != bounds]:
        label = f"tensor cores, threadgroups per SM at least ({gu}, {dn})"
        out[label] = with_setting(mxfp4_mma, "MIN_BLOCKS", gu, dn)
    if sweep or occupancy:
        for (gu, gb), (dn, db) in OCCUPANCY_ROWS:
            label = f"tensor cores, launch {gu} {dn} at ({gb}, {db}) per SM"
            out[label] = with_settings(mxfp4_mma, LAUNCH=(gu, dn), MIN_BLOCKS=(gb, db))
    if fused:
        from benchmarks.mxfp4_fused_sweep import prmt_decode, with_bound
        from kimi_k3.kernels import mxfp4_fused

        one = mxfp4_fused.expert_glu_decode
        out["one launch + sum (mxfp4_fused)"] = one
        out["one launch + sum (mxfp4_fused, byte permute, 2 per SM)"] = prmt_decode(
            with_bound(one, 2), mxfp4_fused, "MXFP4_FUSED"
        )
        out["one launch + sum (mxfp4_fused, bulk copies)"] = mxfp4_fused.expert_glu_decode_bulk
    if tiled:
        out[default.replace("decode kernel", "decode kernel on the tiled layout")] = tiled_decode()
    if one:
        for counts, label in ONE_ROWS.items():
            out[label] = functools.partial(mxfp4_one.expert_glu_decode, counts=counts)
        out[ONE_ROWS["chained"] + ", no launch bound"] = with_settings(
            mxfp4_mma,
            functools.partial(mxfp4_one.expert_glu_decode, counts="chained"),
            MIN_BLOCKS=(1, 1),
        )
    if sweep:
        for gu, dn in MMA_SHAPES:
            out[f"tensor cores, launch {gu} {dn}"] = with_setting(mxfp4_mma, "LAUNCH", gu, dn)
        for gu, dn in [((2, 8, 96), (4, 8, 128)), ((1, 8, 192), (4, 4, 64))]:
            out[f"LUT, launch {gu} {dn}"] = with_setting(mxfp4_decode, "LAUNCH", gu, dn)
    return out


# The decode call's weight bytes read and nothing else (benchmarks/read_limit.py): (launches,
# read-once loads, read_mats' threadgroup shape) per row. The last four hold the threads per
# SM to the decode kernels' 512 (128-thread threadgroups, four per SM by 47 KB of threadgroup
# memory each), with 8, 4, 16 and 24 loads of 16 bytes in flight per thread (ptxas: 48, 34,
# 80 and 116 registers, so four threadgroups still fit; 24 loads bring the bytes in flight
# per SM to three quarters of the unrestricted rows' 2048 threads at 8).
READ_LIMIT_ROWS = {
    "read limit: the call's weight bytes in one launch, loads only": (1, False, {}),
    "read limit: one launch, loads read once (as gate/up's)": (1, True, {}),
    "read limit: two launches (gate and up, then down)": (2, False, {}),
    "read limit: two launches, 512 threads per SM, 8 loads in flight": (
        2,
        False,
        dict(threads=128, unroll=8, pad_kb=47),
    ),
    "read limit: two launches, 512 threads per SM, 4 loads in flight": (
        2,
        False,
        dict(threads=128, unroll=4, pad_kb=47),
    ),
    "read limit: two launches, 512 threads per SM, 16 loads in flight": (
        2,
        False,
        dict(threads=128, unroll=16, pad_kb=47),
    ),
    "read limit: two launches, 512 threads per SM, 24 loads in flight": (
        2,
        False,
        dict(threads=128, unroll=24, pad_kb=47),
    ),
}


# The streamed-ring decode (kernels/mxfp4_stream.py): (gate/up, down) as (warps per
# threadgroup, ring stages, rows of a unit's 32 brought by bulk copies; the rest by 16-byte
# asynchronous copies from every thread), one threadgroup per SM. A unit's row has 28 4-group
# blocks in gate/up and 24 in down: 8 warps take 3-4 and 3, 14 and 12 take 2, 16 take 1-2.
STREAM_ROWS = {
    "streamed ring (8, 3, 32) (8, 3, 32)": ((8, 3, 32), (8, 3, 32)),
    "streamed ring (14, 3, 32) (12, 3, 32)": ((14, 3, 32), (12, 3, 32)),
    "streamed ring (8, 3, 0) (8, 3, 0)": ((8, 3, 0), (8, 3, 0)),
    "streamed ring (14, 3, 0) (12, 3, 0)": ((14, 3, 0), (12, 3, 0)),
    "streamed ring (16, 3, 0) (16, 3, 0)": ((16, 3, 0), (16, 3, 0)),
    "streamed ring (8, 3, 16) (8, 3, 16)": ((8, 3, 16), (8, 3, 16)),
    "streamed ring (14, 3, 16) (12, 3, 16)": ((14, 3, 16), (12, 3, 16)),
}
# The same rings without the products (not decodes): what their copies alone stream.
STREAM_PROBES = {
    "streamed ring (8, 3, 32), probe without products": (8, 3, 32),
    "streamed ring (8, 3, 0), probe without products": (8, 3, 0),
    "streamed ring (16, 3, 0), probe without products": (16, 3, 0),
}


def stream_decode(gate_up, down, math=True):
    """``mxfp4_stream.expert_glu_decode`` at the given (warps, stages, bulk rows) launches."""
    from kimi_k3.kernels import mxfp4_stream

    launch = {"gate_up": gate_up, "down": down}
    return functools.partial(mxfp4_stream.expert_glu_decode, launch=launch, math=math)


def stream_variants() -> dict:
    return {label: stream_decode(gu, dn) for label, (gu, dn) in STREAM_ROWS.items()}


def stream_probe_jobs() -> list:
    return [(label, stream_decode(ln, ln, math=False)) for label, ln in STREAM_PROBES.items()]


def read_limit_jobs() -> list:
    from benchmarks.read_limit import read_call

    return [
        (label, lambda *a, n=n, s=s, k=k: read_call(*a, launches=n, stream=s, **k))
        for label, (n, s, k) in READ_LIMIT_ROWS.items()
    ]


def with_attr(fn, module, name: str, value):
    """``fn`` run with ``module.name`` set to ``value`` (restored after): while it builds its
    graph, which is when a kernel is chosen."""

    def run(*a):
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn(*a)
        finally:
            setattr(module, name, saved)

    return run


def with_tile(tile, fn=expert_glu_prefill):
    return lambda *a: fn(*a, tile_tokens=tile)


def bench_decode(args, table: Table, copy: float | None):
    dtype = getattr(mx, args.dtype)
    w = random_experts(args.decode_experts, args.dim, args.hidden, args.seed)
    rng = np.random.default_rng(args.seed)
    per_expert = expert_bytes(args.dim, args.hidden)
    for n in args.decode_tokens:
        inputs = []
        for _ in range(args.calls):
            inds, weights = routing(n, args.decode_experts, args.topk, rng)
            z = mx.random.normal((n, args.dim)).astype(dtype)
            inputs.append((z, w, inds, weights, BETA, CAP))
        mx.eval([a[:4] for a in inputs])
        nbytes = np.mean([len(np.unique(np.array(a[2]))) for a in inputs]) * per_expert
        variants = decode_variants(args.variants, args.occupancy, args.fused, args.one, args.tiled)
        if args.stream:
            variants.update(stream_variants())
        jobs = [
            ("gather_qmm", expert_glu_reference),
            *variants.items(),
            *(read_limit_jobs() if args.read_limit else []),
            *(stream_probe_jobs() if args.stream else []),
            ("prefill kernel (LUT)", expert_glu_prefill),
            ("prefill kernel (tensor cores)", expert_glu_prefill_mma),
        ]
        # one round times every job once, rounds one after another: the first job of a run
        # is no longer the one that meets the clocks cold
        timer = time_chain if args.timing == "chain" else time_batch
        fns = [fn for _, fn in jobs]
        times, failed = time_rounds(fns, inputs, args.rounds, args.repeats, timer=timer)
        timed = {}
        for j, ((name, _), ts) in enumerate(zip(jobs, times)):
            label = f"decode N={n}: {name}"
            if j in failed:
                table.add(label, "FAILED", failed[j], "", "")
                timed[name] = None
            else:
                timed[name] = decode_row(table, label, ts, nbytes, args, copy)
        for name, fn in variants.items():
            compare(
                table,
                f"decode N={n}: {name} vs gather_qmm",
                fn,
                expert_glu_reference,
                timed[name],
                timed["gather_qmm"],
                inputs,
            )


def bench_prefill(args, table: Table):
    """One layer's prefill at each ``--prefill-tokens``: ``gather_qmm`` (sorted), the
    tensor-core GEMM at both tile sizes (its choice marked), the LUT kernel (Metal's) unless
    ``--no-lut``, and the tensor-core GEMM on ``expert_layout``'s tiles (what a tiled store
    runs on CUDA), timed in ``--rounds`` interleaved rounds (``time_rounds``) so that a drift
    of the clocks reaches every row alike; a row's time is its best round."""
    dtype = getattr(mx, args.dtype)
    w = random_experts(args.prefill_experts, args.dim, args.hidden, args.seed + 1)
    rng = np.random.default_rng(args.seed + 1)
    for n in args.prefill_tokens:
        inds, weights = routing(n, args.prefill_experts, args.topk, rng)
        z = mx.random.normal((n, args.dim)).astype(dtype)
        mx.eval(z, inds, weights)
        inputs = [(z, w, inds, weights, BETA, CAP)] * max(1, args.calls // 10)
        default = tile_tokens_for(n * args.topk, args.prefill_experts)  # both kernels' rule
        jobs = [(f"prefill N={n}: gather_qmm (sorted)", expert_glu_reference)]
        kernels = [
            (expert_glu_prefill_mma, "tensor-core kernel", (16, 32)),
            (expert_glu_prefill, "LUT kernel", tuple(args.tiles)),
        ][: 1 if args.no_lut else 2]
        for fn, name, tiles in kernels:
            for tile in sorted({default, *tiles}):
                mark = " (its choice)" if tile == default else ""
                label = f"prefill N={n}: {name}, {tile} pairs/tile{mark}"
                jobs.append((label, with_tile(tile, fn)))
        on_tiles = tiled_decode(functools.partial(expert_glu_prefill_mma, tile_tokens=default))
        label = f"prefill N={n}: tensor-core kernel on the tiled layout, {default} pairs/tile"
        jobs.append((label, on_tiles))
        # the other ways of loading the tiles' scale bytes (mxfp4_prefill_mma.SCALES)
        for scales in mxfp4_prefill_mma.SCALES:
            if scales != mxfp4_prefill_mma.scales_for(default):
                fn = with_attr(on_tiles, mxfp4_prefill_mma, "TILED_SCALES", scales)
                jobs.append((f"{label}, scales loaded as {scales}", fn))
        times, failed = time_rounds([fn for _, fn in jobs], inputs, args.rounds, args.repeats)
        t_ref = None
        for j, ((label, fn), ts) in enumerate(zip(jobs, times)):
            if j in failed:
                table.add(label, "FAILED", failed[j], "", "")
                continue
            t = min(ts)
            rounds = "rounds (ms): " + ", ".join(f"{x * 1e3:.2f}" for x in ts)
            table.add(label, f"{t * 1e3:.2f} ms", f"{n / t:.0f} tok/s", "", rounds)
            if j == 0:
                t_ref = t
            else:
                ref = expert_glu_reference
                compare(table, f"{label} vs gather_qmm", fn, ref, t, t_ref, inputs)
        attempt(table, f"prefill N={n}: oracle", oracle_rows, table, n, inputs[0])


def oracle_rows(table, n, inputs, tokens: int = 4):
    """Both sides against an fp32 dense oracle on the first tokens (mxfp4_diag's), so a
    disagreement says which side is wrong."""
    from benchmarks.mxfp4_diag import oracle

    z, w, inds, weights, beta, cap = inputs
    want = oracle(z[:tokens], w, inds[:tokens], weights[:tokens])
    for name, fn in (
        ("kernel", expert_glu_prefill),
        ("tensor-core kernel", expert_glu_prefill_mma),
        ("gather_qmm", expert_glu_reference),
    ):
        got = fn(z, w, inds, weights, beta, cap)[:tokens]
        table.add(
            f"prefill N={n}: {name} vs fp32 oracle ({tokens} tokens)",
            "",
            "",
            "",
            f"rel err {rel_err(got, want):.1e}",
        )


def main():
    args = setup_arg_parser().parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}, dtype {args.dtype}", flush=True)
    table = Table()
    copy = attempt(table, "device copy", copy_gbps, 2 << 30, args.repeats)
    if copy:
        table.add(
            "device copy (2 GiB, read + write)",
            "",
            f"{copy:.0f} GB/s",
            f"{100 * copy / args.peak_gbps:.0f}% of peak",
            "",
        )
    attempt(table, "decode", bench_decode, args, table, copy)
    mx.clear_cache()
    if not args.skip_prefill:
        attempt(table, "prefill", bench_prefill, args, table)
    header = ("case", "time", "rate", "of HBM", "check")
    md = (
        f"MXFP4 experts, D={args.dim}, I={args.hidden}, top-{args.topk}, {args.dtype} inputs, "
        f"mlx {mx.__version__} on {mx.default_device()}; decode picks from "
        f"{args.decode_experts} experts ({args.timing} timing), prefill from "
        f"{args.prefill_experts}; peak "
        f"{args.peak_gbps:.0f} GB/s.\n\n" + table.markdown(header) + "\n"
    )
    print("\n" + md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
