"""Where a chained KDA decode step's time goes on the GPU: graph building, MLX's launch
floor, and the kernel itself.

For ``--chain`` independent layers in one graph it times separately: building the graph
(Python + MLX op creation, no evaluation), evaluating the built graph, and both together;
the same for a trivial one-thread kernel (MLX's per-launch floor for a custom kernel), for
a kernel that only copies the fp32 state (the bandwidth part of a decode step, with the
decode kernel's grid) and for our decode kernel.

    python -m benchmarks.kda_decode_diag
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from benchmarks.bench_kda import H, K, decode_layer, median_time
from kimi_k3.kernels import kda_decode, source
from kimi_k3.kernels.source import Kernel

NOOP = Kernel("kk_noop", ["x"], ["y"], "  if (THREAD_INDEX == 0) y[0] = x[0] + 1.0f;\n")

COPY = Kernel(
    "kk_state_copy",
    ["x"],
    ["y"],
    """
  const size_t base = (size_t)GROUP_POS.x * GROUP_SIZE.x * KR + THREAD_INDEX;
  for (int j = 0; j < KR; ++j) y[base + j * GROUP_SIZE.x] = x[base + j * GROUP_SIZE.x] * 0.5f;
""",
)


def split_times(build, L, repeats=20):
    """(build, eval, both) seconds per layer for a graph of L calls made by ``build``."""
    t_build = median_time(build, repeats)

    def eval_only():
        outs = build()
        t = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        return time.perf_counter() - t

    for _ in range(3):
        eval_only()
    t_eval = statistics.median(eval_only() for _ in range(repeats))

    def both():
        mx.eval(build())
        mx.synchronize()

    t_both = median_time(both, repeats)
    return t_build / L, t_eval / L, t_both / L


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chain", type=int, default=64)
    args = parser.parse_args()
    backend = source.backend() or "cuda"
    L = args.chain
    layers = [decode_layer() for _ in range(L)]
    states = [lay[1][-1] for lay in layers]
    W = layers[0][0]["q_conv"].shape[-1]
    dt = layers[0][1][0].dtype
    launch = kda_decode._launch(backend, dt, 1, H, K, W)  # the wrapper's cached launch arguments
    nt = launch["threadgroup"][0]
    rows = []

    xs = [mx.array([float(i)]) for i in range(L)]
    mx.eval(xs)

    def noop():
        return [
            NOOP(
                backend,
                inputs=[x],
                output_shapes=[(1,)],
                output_dtypes=[mx.float32],
                grid=(32, 1, 1),
                threadgroup=(32, 1, 1),
            )[0]
            for x in xs
        ]

    def copy():
        return [
            COPY(
                backend,
                inputs=[s],
                output_shapes=[s.shape],
                output_dtypes=[mx.float32],
                grid=(nt * H, 1, 1),
                threadgroup=(nt, 1, 1),
                template=[("KR", K * K // nt)],
            )[0]
            for s in states
        ]

    def ours():
        return [kda_decode.kda_decode(backend, p, *x) for p, x, _ in layers]

    # the bare kernel call with every input prepared (activations, state, the packed
    # weights): MLX's own per-call cost
    prepared = [list(x) + kda_decode._layer_inputs(p) for p, x, _ in layers]
    mx.eval(prepared)
    kernel = kda_decode.KDA_DECODE.get(backend)

    def bare():
        return [kernel(inputs=inp, **launch)[2] for inp in prepared]

    def ours_dependent():
        # each layer's input state is the previous layer's output: a serial chain on the GPU
        p, x, _ = layers[0]
        s = x[-1]
        outs = []
        for _ in range(L):
            y, c, s = kda_decode.kda_decode(backend, p, *x[:-1], s)
            outs.append(y)
        return outs + [s]

    for name, fn in [
        ("trivial kernel (1 thread)", noop),
        ("state copy kernel (decode grid)", copy),
        ("kda_decode, independent layers", ours),
        ("kda_decode kernel call only, independent layers", bare),
        ("kda_decode, dependent chain", ours_dependent),
    ]:
        b, e, t = split_times(fn, L)
        rows.append((name, b, e, t))
    print(f"chain of {L}, backend {backend}, mlx {mx.__version__}")
    print("| kernel | build (us/layer) | eval (us/layer) | build+eval (us/layer) |")
    print("|---|---:|---:|---:|")
    for name, b, e, t in rows:
        print(f"| {name} | {b * 1e6:.1f} | {e * 1e6:.1f} | {t * 1e6:.1f} |")


if __name__ == "__main__":
    main()
