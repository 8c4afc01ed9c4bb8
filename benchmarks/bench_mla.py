"""kv_b_proj's products in one gated MLA layer at Kimi K3's shape (96 heads, rank 512), the
weight quantized as ``kimi_k3.convert --quantize-dense`` writes it: decode's absorbed
products (one token) and prefill's key / value expansion, each with kv_b_proj multiplied as
stored (``mx.quantized_matmul``) beside dequantized on the call, side by side in one run.
The model's choice: as stored in decode, dequantized once per call in prefill.

    python -m benchmarks.bench_mla --out bench_mla.md
    python -m benchmarks.bench_mla --quick          # one dtype, 16 tokens, one run: seconds

Runs on MLX's default device (the CPU here, Metal or CUDA where MLX has them). The rest of
the layer (its other projections and the attention) is the same in both and not timed.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn

from benchmarks import timing
from kimi_k3.model.attention import GatedMLA
from kimi_k3.model.config import ModelArgs

K3_MLA = {
    "vocab_size": 64,
    "hidden_size": 64,  # the projections around kv_b_proj are not timed
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 96,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "linear_attn_config": {  # required by the config; unused by the MLA layer
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "kda_layers": [],
        "full_attn_layers": [1],
    },
}


def layer(dtype, bits: int, group_size: int) -> GatedMLA:
    m = GatedMLA(ModelArgs.from_dict(K3_MLA))
    m.set_dtype(dtype)
    nn.quantize(m, group_size=group_size, bits=bits, class_predicate=lambda p, _: p == "kv_b_proj")
    mx.eval(m.parameters())
    return m


def dequantized(m: GatedMLA, x, part: str, transpose: bool):
    wk, wv = m._kv_b()
    w = wk if part == "k" else wv
    return x @ (w.swapaxes(-1, -2) if transpose else w)


def cases(m: GatedMLA, dtype, prefill: int):
    H, r = m.heads, m.rank
    q_nope = mx.random.normal((1, H, 1, m.nope)).astype(dtype)
    o_lat = mx.random.normal((1, H, 1, r)).astype(dtype)
    latent = mx.random.normal((1, 1, prefill, r)).astype(dtype)
    mx.eval(q_nope, o_lat, latent)

    def decode(mul):
        return lambda: (mul(m, q_nope, "k", False), mul(m, o_lat, "v", True))

    def expand(mul):
        return lambda: (mul(m, latent, "k", True), mul(m, latent, "v", True))

    stored = GatedMLA._kv_b_matmul
    return [
        ("decode, 1 token", "as stored (the model)", decode(stored)),
        ("decode, 1 token", "dequantized per call", decode(dequantized)),
        (f"prefill, {prefill} tokens", "dequantized per call (the model)", expand(dequantized)),
        (f"prefill, {prefill} tokens", "as stored", expand(stored)),
    ]


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", type=int, default=128, help="tokens of the prefill rows")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="float32, 16 tokens, one run")
    parser.add_argument("--out", help="write the markdown table here")
    return parser


def main(argv=None):
    a = setup_arg_parser().parse_args(argv)
    if a.quick:
        a.prefill, a.dtypes, a.repeats = 16, ["float32"], 1
    mx.random.seed(0)
    lines = [
        f"kv_b_proj products, K3 MLA shape (96 heads, rank 512, 12.6M weights), {a.bits}-bit "
        f"affine (group {a.group_size}); {timing.environment()}",
        "",
        "| dtype | case | kv_b_proj | time (us) | / the model's |",
        "|---|---|---|---:|---:|",
    ]
    for name in a.dtypes:
        dtype = getattr(mx, name)
        m = layer(dtype, a.bits, a.group_size)
        first = {}
        for case, impl, fn in cases(m, dtype, a.prefill):
            us = timing.median_time(timing.mlx_run(fn), a.repeats) * 1e6
            ratio = f"{us / first[case]:.2f}x" if case in first else ""
            first.setdefault(case, us)
            lines.append(f"| {name} | {case} | {impl} | {us:,.1f} | {ratio} |")
    text = "\n".join(lines) + "\n"
    timing.emit(text, a.out)
    return text


if __name__ == "__main__":
    main()
