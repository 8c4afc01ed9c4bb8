"""KDA kernels at Kimi K3's shape (96 heads x 128) against fla and MLX's alternatives.

Decode (one token, one layer): the single-launch kernel (``kda_decode``: the whole mixer:
conv window, SiLU, L2 norms, gates, state update and readout, output RMSNorm and gate)
against the time the fp32 state takes to read and write at the memory bandwidth,
``mx.fast.gated_delta_update`` (scalar gate, recurrence only), mlx-lm's
``gated_delta_update`` (per-channel gate, recurrence only) and the pure-MLX reference mixer,
each measured two ways: a single call evaluated and synchronized on its own (MLX's per-eval
launch and sync latency included), and chained: ``--chain`` independent layers (each with
its own state, conv window and inputs) built into one graph and evaluated once, the time
divided by the layers; that is what one KDA layer costs in a model's decode step.

Prefill (``--lengths``): the chunk kernels (the recurrence, fp32 and tf32 state pass) and the
whole mixer (``kda_prefill``), against fla's Triton ``chunk_kda`` (torch on the same GPU; bf16
q/k/v as fla is usually run, and fp32), the pure-MLX chunked reference and, unless
``--skip-slow``, ``mx.fast.gated_delta_update``. The fla rows need torch with CUDA and fla
installed; the kernel rows need a kernel backend (Metal, CUDA, or the emulator with
``KIMI_K3_KERNEL_BACKEND=emulator``). Every comparator runs in its own try/except: a failure
is a row that says so. Times are medians (``timing.median_time``).

    python -m benchmarks.bench_kda --out bench_kda.md                       # on the GPU
    KIMI_K3_KERNEL_BACKEND=emulator python -m benchmarks.bench_kda --quick  # CPU, seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import traceback

import mlx.core as mx

from benchmarks import timing
from kimi_k3.cli import markdown_table
from kimi_k3.kernels import kda_decode, kda_prefill, source
from kimi_k3.model.kda import kda_chunked, kda_mix_reference, l2norm

W = 4  # conv window
QUICK = dict(heads=2, head_dim=64, lengths=[64], chain=2, repeats=1, skip_slow=True)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs (median)")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (H200 HBM3e)")
    parser.add_argument("--chain", type=int, default=64, help="layers in the chained decode")
    parser.add_argument("--skip-slow", action="store_true", help="skip comparators over 1 s")
    parser.add_argument("--no-decode", action="store_true", help="prefill sections only")
    parser.add_argument("--quick", action="store_true", help="two small heads, T = 64")
    parser.add_argument("--out", help="write the markdown table here")
    return parser


def layer(H: int, K: int) -> dict:
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


def mixer_inputs(H: int, K: int, T: int, dtype=mx.bfloat16) -> tuple:
    """(x_q, x_k, x_v, g_raw, b_logits, gate, conv_state, state) of one sequence."""
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


def recurrence_inputs(H: int, K: int, T: int) -> tuple:
    """(q, k, v, g, beta, state) of the recurrence alone: q and k normalised, g < 0."""
    q = l2norm(mx.random.normal((1, T, H, K))) * K**-0.5
    k = l2norm(mx.random.normal((1, T, H, K)))
    v = mx.random.normal((1, T, H, K))
    g = -5.0 * mx.sigmoid(mx.random.normal((1, T, H, K)) + 2.0)
    beta = mx.sigmoid(mx.random.normal((1, T, H)))
    state = mx.random.normal((1, H, K, K)) * 0.05
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def decode_layer(H: int, K: int) -> tuple:
    """One layer's decode inputs for every comparator: (p, mixer inputs, recurrence inputs)."""
    p, x = layer(H, K), mixer_inputs(H, K, 1)
    q, k, v, g, beta, state = recurrence_inputs(H, K, 1)
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


def decode_fns(backend) -> list:
    """(name, fn(p, x, rec)) running one layer's decode step, for every comparator."""

    def mlx_lm_path(p, x, r):
        from mlx_lm.models.gated_delta import gated_delta_update

        H, K = p["heads"], p["head_dim"]
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

    def ours(p, x, r):
        return kda_decode.kda_decode(backend, p, *x)

    return ([("ours: kda_decode (whole mixer, 1 launch)", ours)] if backend else []) + [
        ("mx.fast.gated_delta_update (scalar gate)", fast_gdu),
        ("mlx-lm gated_delta_update (vector gate)", mlx_lm_path),
        ("pure-MLX reference mixer", lambda p, x, r: kda_mix_reference(p, *x)),
    ]


def decode_cases(backend, args, chain: int) -> list:
    """One layer evaluated on its own (``chain`` 1), or ``chain`` independent layers in one
    graph, evaluated once (time per layer); the state's read + write at the bandwidth second."""
    layers = [decode_layer(args.heads, args.head_dim) for _ in range(chain)]
    cases = [
        (name, timing.mlx_run(lambda fn=fn: [fn(*lay) for lay in layers]), 1.0 / chain)
        for name, fn in decode_fns(backend)
    ]
    bound = 2 * layers[0][1][-1].nbytes / args.bandwidth
    return cases[:1] + [("state read + write at bandwidth", bound)] + cases[1:]


def fla_run(H: int, K: int, T: int, bf16: bool = True):
    """fla's ``chunk_kda`` on random inputs of this shape, one call and a CUDA sync."""
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


def fla_available() -> bool:
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def prefill_cases(backend, args, T: int) -> list:
    H, K = args.heads, args.head_dim
    p, x = layer(H, K), mixer_inputs(H, K, T)
    r = recurrence_inputs(H, K, T)
    mx.eval(p, x)
    cases = []
    if backend:
        cases += [
            (
                "ours: chunk kernels (recurrence, fp32 state pass)",
                timing.mlx_run(lambda: kda_prefill.kda_chunk(backend, *r)),
            ),
            (
                "ours: chunk kernels (recurrence, tf32 state pass: bf16 models)",
                timing.mlx_run(lambda: kda_prefill.kda_chunk(backend, *r, precision="tf32")),
            ),
            (
                "ours: kda_prefill (whole mixer, bf16)",
                timing.mlx_run(lambda: kda_prefill.kda_prefill(backend, p, *x)),
            ),
        ]
    if fla_available():
        cases += [
            ("fla chunk_kda (Triton, bf16 q/k/v)", fla_run(H, K, T)),
            ("fla chunk_kda (Triton, fp32)", fla_run(H, K, T, bf16=False)),
        ]
    else:
        cases.append(("fla chunk_kda", "needs fla and torch with CUDA"))
    cases.append(("pure-MLX kda_chunked (recurrence)", timing.mlx_run(lambda: kda_chunked(*r))))
    if not args.skip_slow:
        gamma = mx.exp(r[3].mean(-1))
        state_vk = r[5].swapaxes(-1, -2)
        cases.append(
            (
                "mx.fast.gated_delta_update (scalar gate)",
                timing.mlx_run(lambda: mx.fast.gated_delta_update(*r[:3], gamma, r[4], state_vk)),
            )
        )
    return cases


def measure(cases, repeats: int) -> list:
    """[(name, microseconds or None, note)], each comparator isolated. A case is (name, run
    [, scale]); a float run is a bound, a string a reason it was not run."""
    rows = []
    for case in cases:
        name, run, scale = case if len(case) == 3 else (*case, 1.0)
        if isinstance(run, float):
            rows.append((name, run * 1e6, "bound, not measured"))
        elif isinstance(run, str):
            rows.append((name, None, f"not run: {run}"))
        else:
            try:
                rows.append((name, timing.median_time(run, repeats) * scale * 1e6, ""))
            except Exception as e:  # noqa: BLE001 - a comparator failing is a row, not a crash
                traceback.print_exc()
                note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                rows.append((name, None, note))
    return rows


def table(sections) -> str:
    """One markdown table; each section's times also as a ratio to its first row."""
    rows = []
    for case, section in sections:
        first = section[0] if section[0][1] else None
        for name, us, note in section:
            t = f"{us:,.2f}" if us is not None else "-"
            ratio = f"{us / first[1]:.2f}x" if us and first and first[0] != name else ""
            rows.append((case, name, t, ratio, note))
    header = ("case", "implementation", "time (us)", "vs first row", "note")
    return markdown_table(header, rows)


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    backend = source.backend()
    mx.random.seed(0)
    sections = []
    if not args.no_decode:
        single = decode_cases(backend, args, 1)
        sections.append(("decode, 1 token, single call", measure(single, args.repeats)))
        chained = decode_cases(backend, args, args.chain)
        label = f"decode, 1 token, chained ({args.chain} layers, one eval; per layer)"
        sections.append((label, measure(chained, args.repeats)))
    for T in args.lengths:
        sections.append((f"prefill T={T}", measure(prefill_cases(backend, args, T), args.repeats)))
    text = (
        f"## KDA at {args.heads} heads x {args.head_dim}, kernel backend {backend}; "
        f"{timing.environment()}\n\n" + table(sections)
    )
    timing.emit(text, args.out)
    return text


if __name__ == "__main__":
    main()
