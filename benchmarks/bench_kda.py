"""KDA kernels at Kimi K3's shape (96 heads x 128) against the alternatives, one run on a GPU.

Decode (one token, one layer): our single-launch kernel (the whole mixer: conv window, SiLU,
L2 norms, gates, state update and readout, output RMSNorm and gate) against the time the fp32
state takes to read and write at the memory bandwidth, ``mx.fast.gated_delta_update``
(scalar gate, recurrence only), mlx-lm's ``gated_delta_update`` (per-channel gate, recurrence
only) and the pure-MLX reference mixer, each measured two ways: a single call evaluated and
synchronized on its own (which includes MLX's per-eval launch and sync latency), and chained:
``CHAIN`` independent layers (each with its own state, conv window and inputs) built into one
graph and evaluated once, the time divided by ``CHAIN``; that is what one KDA layer costs in a
model's decode step (93 layers in one graph, one eval). Prefill (T = 1024, 8192): our chunk
kernels (the recurrence; every state-pass variant), our whole mixer and each kernel alone,
against fla's Triton ``chunk_kda`` (torch on the same GPU, bf16 q/k/v as fla is usually run,
fp32 gate) and the pure-MLX chunked reference. Every
comparator runs in its own try/except: a failure is a row that says so.

    python -m benchmarks.bench_kda --out bench_kda.md
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import mlx.core as mx

from kimi_k3.kda import kda_chunked, kda_mix_reference, l2norm
from kimi_k3.kernels import kda_decode, kda_prefill, source

H, K, W = 96, 128, 4
STATE_MMA_SWEEP = (2, 4, 8)  # kda_chunk_state_mma launch shapes timed beside the default


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs (median)")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (H200 HBM3e)")
    parser.add_argument("--chain", type=int, default=CHAIN, help="layers in the chained decode")
    parser.add_argument("--skip-slow", action="store_true", help="skip comparators over 1 s")
    parser.add_argument("--no-decode", action="store_true", help="prefill sections only")
    parser.add_argument(
        "--cases", nargs="+", help="prefill rows to time: those whose name contains one of these"
    )
    return parser


def median_time(run, repeats: int) -> float:
    """Median seconds of ``run()`` after two warm-ups; fewer repeats when a run is slow."""
    for _ in range(2):
        run()
    first = time.perf_counter()
    run()
    once = time.perf_counter() - first
    n = max(1, min(repeats, int(2.0 / max(once, 1e-6))))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def mlx_run(fn):
    def run():
        mx.eval(fn())
        mx.synchronize()

    return run


def layer():
    P = H * K
    return dict(
        q_conv=mx.random.normal((P, 1, W)) * 0.5,
        k_conv=mx.random.normal((P, 1, W)) * 0.5,
        v_conv=mx.random.normal((P, 1, W)) * 0.5,
        A_log=mx.random.normal((H,)) * 0.5,
        dt_bias=mx.random.normal((P,)),
        o_norm=mx.ones((K,)),
        heads=H,
        head_dim=K,
        lower_bound=-5.0,
        eps=1e-5,
    )


def mixer_inputs(T: int, dtype=mx.bfloat16):
    P = H * K
    xs = [mx.random.normal((1, T, P)).astype(dtype) for _ in range(4)]
    conv = mx.random.normal((1, W - 1, 3 * P)).astype(dtype)
    state = mx.random.normal((1, H, K, K)) * 0.05
    return (
        *xs,
        mx.random.normal((1, T, H)).astype(dtype),
        mx.random.normal((1, T, P)).astype(dtype),
        conv,
        state,
    )


def recurrence_inputs(T: int):
    q = l2norm(mx.random.normal((1, T, H, K))) * K**-0.5
    k = l2norm(mx.random.normal((1, T, H, K)))
    v = mx.random.normal((1, T, H, K))
    g = -5.0 * mx.sigmoid(mx.random.normal((1, T, H, K)) + 2.0)
    beta = mx.sigmoid(mx.random.normal((1, T, H)))
    state = mx.random.normal((1, H, K, K)) * 0.05
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


CHAIN = 64  # independent layers per graph in the chained decode measurement


def decode_layer():
    """One layer's decode inputs for every comparator: (p, mixer inputs, recurrence inputs)."""
    p, x = layer(), mixer_inputs(1)
    q, k, v, g, beta, state = recurrence_inputs(1)
    rec = dict(
        q=q,
        k=k,
        v=v,
        beta=beta,
        state_vk=state.swapaxes(-1, -2),
        gamma=mx.exp(g.mean(-1)),
        a=mx.random.normal((1, 1, H, K)),
    )
    mx.eval(p, x, rec)
    return p, x, rec


def decode_fns(backend):
    """name -> fn(p, x, rec) running one layer's decode step; every comparator."""

    def mlx_lm_path(p, x, r):
        from mlx_lm.models.gated_delta import gated_delta_update

        return gated_delta_update(
            r["q"],
            r["k"],
            r["v"],
            r["a"],
            x[4],
            p["A_log"].reshape(H, 1),
            p["dt_bias"].reshape(H, K),
            r["state_vk"],
            lower_bound=-5.0,
        )

    def fast_gdu(p, x, r):
        return mx.fast.gated_delta_update(
            r["q"], r["k"], r["v"], r["gamma"], r["beta"], r["state_vk"]
        )

    return [
        (
            "ours: kda_decode (whole mixer, 1 launch)",
            lambda p, x, r: kda_decode.kda_decode(backend, p, *x),
        ),
        ("mx.fast.gated_delta_update (scalar gate)", fast_gdu),
        ("mlx-lm gated_delta_update (vector gate)", mlx_lm_path),
        ("pure-MLX reference mixer", lambda p, x, r: kda_mix_reference(p, *x)),
    ]


def decode_cases(backend, bandwidth):
    """Single call: one layer, evaluated and synchronized on its own."""
    p, x, rec = decode_layer()
    limit = 2 * x[-1].nbytes / bandwidth
    cases = [(name, mlx_run(lambda fn=fn: fn(p, x, rec))) for name, fn in decode_fns(backend)]
    return cases[:1] + [("state read + write at bandwidth", limit)] + cases[1:]


def chained_run(fn, layers):
    """One graph of ``len(layers)`` independent decode steps, evaluated once; the run's time
    divided by the number of layers is the per-layer cost."""

    def run():
        mx.eval([fn(*lay) for lay in layers])
        mx.synchronize()

    return run


def chained_decode_cases(backend, bandwidth, L=CHAIN):
    """Chained: L independent layers (own state, conv window and inputs) in one graph."""
    layers = [decode_layer() for _ in range(L)]
    limit = 2 * layers[0][1][-1].nbytes / bandwidth
    cases = [(name, chained_run(fn, layers), 1.0 / L) for name, fn in decode_fns(backend)]
    return cases[:1] + [("state read + write at bandwidth", limit)] + cases[1:]


def fla_run(T: int, bf16: bool = True):
    import torch
    from fla.ops.kda import chunk_kda

    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1)
    v = torch.randn(1, T, H, K, device=dev)
    g = -5.0 * torch.sigmoid(torch.randn(1, T, H, K, device=dev) + 2.0)
    beta = torch.sigmoid(torch.randn(1, T, H, device=dev))
    h0 = torch.randn(1, H, K, K, device=dev) * 0.05
    if bf16:
        q, k, v, beta = (t.to(torch.bfloat16) for t in (q, k, v, beta))

    def run():
        with torch.inference_mode():
            chunk_kda(q, k, v, g, beta, scale=K**-0.5, initial_state=h0, output_final_state=True)
        torch.cuda.synchronize()

    return run


def state_pass(backend, kind: str, fn, warps: int | None = None):
    """``fn`` built with ``kda_prefill.STATE_PASS[backend]`` set to ``kind`` (fma or mma) and,
    where given, ``kda_prefill.STATE_MMA_WARPS`` to ``warps``."""

    def call():
        old = kda_prefill.STATE_PASS.get(backend), kda_prefill.STATE_MMA_WARPS
        kda_prefill.STATE_PASS[backend] = kind
        kda_prefill.STATE_MMA_WARPS = warps or old[1]
        try:
            return fn()
        finally:
            kda_prefill.STATE_PASS[backend], kda_prefill.STATE_MMA_WARPS = old

    return call


def prefill_cases(backend, T: int, skip_slow: bool, only=None):
    p, x = layer(), mixer_inputs(T)
    r = recurrence_inputs(T)
    mx.eval(p, x)
    # Inputs of the state pass and kda_post alone, evaluated beforehand.
    prep = kda_prefill.chunk_prep(backend, *r[:5])
    o = mx.random.normal((1, T, H, K))
    mx.eval(prep, o)

    def state_only(precision="fp32"):
        return kda_prefill.chunk_state(backend, prep, r[5], T, precision)

    cases = [
        ("ours: chunk kernels (recurrence)", mlx_run(lambda: kda_prefill.kda_chunk(backend, *r))),
        (
            "ours: chunk kernels (recurrence, tf32 state pass: bf16 models)",
            mlx_run(lambda: kda_prefill.kda_chunk(backend, *r, precision="tf32")),
        ),
        (
            "ours: kda_prefill (whole mixer, bf16: tf32 state pass)",
            mlx_run(lambda: kda_prefill.kda_prefill(backend, p, *x)),
        ),
        (
            "ours, alone: kda_pre (conv, norms, gates)",
            mlx_run(lambda: kda_prefill.pre(backend, p, *x[:5], x[6])),
        ),
        ("ours, alone: kda_chunk_prep", mlx_run(lambda: kda_prefill.chunk_prep(backend, *r[:5]))),
        (
            f"ours, alone: state pass ({kda_prefill.STATE_PASS.get(backend)})",
            mlx_run(state_only),
        ),
        (
            "ours, alone: state pass (mma, tf32)",
            mlx_run(state_pass(backend, "mma", lambda: state_only("tf32"))),
        ),
        *[
            (
                f"ours, alone: state pass ({kind})",
                mlx_run(state_pass(backend, kind, state_only)),
            )
            for kind in ("fma", "mma")
            if kind != kda_prefill.STATE_PASS.get(backend)
        ],
        *[
            (
                f"ours, alone: state pass (mma, {w} simdgroups per threadgroup)",
                mlx_run(state_pass(backend, "mma", state_only, w)),
            )
            for w in STATE_MMA_SWEEP
            if w != kda_prefill.STATE_MMA_WARPS
        ],
        (
            "ours, alone: kda_post (RMSNorm x gate)",
            mlx_run(lambda: kda_prefill.post(backend, p, o, x[5])),
        ),
        ("fla chunk_kda (Triton, bf16 q/k/v)", lambda: fla_run(T)),
        ("fla chunk_kda (Triton, fp32)", lambda: fla_run(T, bf16=False)),
        ("pure-MLX kda_chunked (recurrence)", mlx_run(lambda: kda_chunked(*r))),
    ]
    if not skip_slow:
        gamma = mx.exp(r[3].mean(-1))
        state_vk = r[5].swapaxes(-1, -2)
        cases.append(
            (
                "mx.fast.gated_delta_update (scalar gate)",
                mlx_run(lambda: mx.fast.gated_delta_update(*r[:3], gamma, r[4], state_vk)),
            )
        )
    if only:
        cases = [c for c in cases if any(s in c[0] for s in only)]
    return cases


def measure(cases, repeats):
    """[(name, microseconds or None, note)] with each comparator isolated."""
    rows = []
    for case in cases:
        name, run, scale = case if len(case) == 3 else (*case, 1.0)
        if isinstance(run, float):
            rows.append((name, run * 1e6, "bound, not measured"))
            continue
        try:
            if name.startswith("fla"):
                run = run()
            rows.append((name, median_time(run, repeats) * scale * 1e6, ""))
        except Exception as e:  # a comparator failing is a result, not a crash
            traceback.print_exc()
            rows.append((name, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
    return rows


def table(sections) -> str:
    lines = [
        "| case | implementation | time (us) | time / ours | note |",
        "|---|---|---:|---:|---|",
    ]
    for case, rows in sections:
        ours = rows[0][1]
        for name, us, note in rows:
            t = f"{us:,.1f}" if us is not None else "-"
            ratio = f"{us / ours:.2f}x" if us and ours and name != rows[0][0] else ""
            lines.append(f"| {case} | {name} | {t} | {ratio} | {note} |")
    return "\n".join(lines) + "\n"


def kernel_backend() -> str:
    """``source.backend()``, or exit: these benchmarks need Metal or CUDA."""
    backend = source.backend()
    if backend is None:
        raise SystemExit("no kernel backend here (needs Metal or CUDA)")
    return backend


def emit(text: str, out: str | None, append: bool = False):
    """Print a result table and, with ``--out``, write it there (after what the file holds,
    and a blank line, where ``append``)."""
    print(text, flush=True)
    if out:
        with open(out, "a" if append else "w") as f:
            f.write(text + ("\n" if append else ""))


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    backend = kernel_backend()
    mx.random.seed(0)
    sections = []
    if not args.no_decode:
        sections += [
            (
                "decode, 1 token, single call (eval + sync per layer)",
                measure(decode_cases(backend, args.bandwidth), args.repeats),
            ),
            (
                f"decode, 1 token, chained ({args.chain} layers, one eval; per layer)",
                measure(chained_decode_cases(backend, args.bandwidth, args.chain), args.repeats),
            ),
        ]
    for T in args.lengths:
        sections.append(
            (
                f"prefill T={T}",
                measure(prefill_cases(backend, T, args.skip_slow, args.cases), args.repeats),
            )
        )
    try:
        device = mx.device_info().get("device_name", "")
    except Exception:
        device = str(mx.default_device())
    text = f"KDA at {H} heads x {K}, backend {backend}, {device}, MLX {mx.__version__}\n\n"
    text += table(sections)
    emit(text, args.out)


if __name__ == "__main__":
    main()
