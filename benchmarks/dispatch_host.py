"""Host time of one MoE expert call on CUDA's dispatch path, without a GPU.

A decode step's graph is built by Python before the GPU runs it (``decode_split.py`` times the
build on the H200); for each MoE layer that build includes choosing the expert kernel and
preparing its launch (``experts.expert_glu`` -> ``dispatch.expert_glu_kernel`` -> the kernel
module). This script times that path with ``KIMI_K3_KERNEL_BACKEND=cuda`` on any machine:
each kernel launch is replaced by making its outputs (``mx.zeros``, lazily: nothing runs), so
what is timed is the project's Python and MLX's graph building, for stacks in MLX's layout
and in tiles (``kernels/expert_layout.py``), at K3's dims by default.

    KIMI_K3_KERNEL_BACKEND=cuda python -m benchmarks.dispatch_host

To time an older commit's code, lay its tree out as installed and put it first on
``PYTHONPATH`` (as ``h200.sh decode_split`` does); stacks in tiles need this session's code.
"""

from __future__ import annotations

import argparse
import timeit

import mlx.core as mx

from benchmarks.bench_mxfp4 import k3_shape_args


def zero_stacks(E: int, D: int, I: int) -> dict:
    """MXFP4 stacks of these shapes, never evaluated (only their shapes are read)."""

    def q(rows, cols):
        return mx.zeros((E, rows, cols // 8), mx.uint32), mx.zeros((E, rows, cols // 32), mx.uint8)

    return {"w1": q(I, D), "w3": q(I, D), "w2": q(D, I)}


def fake_launch(self, backend, *, inputs, output_shapes, output_dtypes, **_):
    return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]


def time_calls(w, tokens: int, topk: int, number: int, repeats: int) -> float:
    """Best seconds per ``expert_glu`` call over ``repeats`` runs of ``number`` calls."""
    from kimi_k3.experts import expert_glu

    z = mx.zeros((tokens, w["w2"][0].shape[1]), mx.bfloat16)
    inds = mx.zeros((tokens, topk), mx.int32)
    wts = mx.ones((tokens, topk))
    best = min(
        timeit.repeat(lambda: expert_glu(z, w, inds, wts, 4.0, 25.0), number=number, repeat=repeats)
    )
    return best / number


def tiles_known() -> bool:
    """Whether the imported kernels package has the tiled store (an older tree laid out first
    on ``PYTHONPATH`` may not; a module found elsewhere does not count)."""
    from pathlib import Path

    import kimi_k3.kernels as kernels

    return (Path(kernels.__file__).parent / "expert_layout.py").exists()


def main(argv=None) -> list[tuple[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    k3_shape_args(ap)
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from kimi_k3.kernels import source

    if source.backend() != "cuda":
        raise SystemExit("set KIMI_K3_KERNEL_BACKEND=cuda: this times CUDA's dispatch path")
    w = zero_stacks(args.experts, args.dim, args.hidden)
    layouts = [("MLX's layout", w)]
    if tiles_known():
        from kimi_k3.kernels import expert_layout

        layouts.append(("tiles", expert_layout.tile(w)))
    real = source.Kernel.__call__
    source.Kernel.__call__ = fake_launch
    try:
        rows = [
            (name, time_calls(ws, args.tokens, args.topk, args.number, args.repeats))
            for name, ws in layouts
        ]
    finally:
        source.Kernel.__call__ = real
    print(f"one expert_glu call, {args.tokens} token(s) x top-{args.topk}, launches faked:")
    for name, t in rows:
        print(f"  {name}: {t * 1e6:.1f} us")
    return rows


if __name__ == "__main__":
    main()
