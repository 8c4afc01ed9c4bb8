"""Convert a published-layout Kimi K3 checkpoint with ``python -m kimi_k3.convert``, then
check that the converted directory gives the same logits.

    python examples/convert_checkpoint.py --model path/to/Kimi-K3 --out path/to/K3-q4 \\
        --dense-bits 4 --no-compare

Without ``--model`` a tiny synthetic checkpoint is written first (``python -m
kimi_k3.convert synth``) and both directories live in a temporary directory; the logits of
the original and the converted model are compared on a short prompt.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np


def convert(src: str, out: str, dense_bits: int, group_size: int):
    """Run the converter as its command line does."""
    cmd = [
        sys.executable,
        "-m",
        "kimi_k3.convert",
        "--hf-path",
        src,
        "--out",
        out,
        "--dense-bits",
        str(dense_bits),
        "--group-size",
        str(group_size),
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def compare(src: str, out: str, tokens: int = 16) -> float:
    """Norm-relative difference of the two directories' fp32 logits on a fixed prompt."""
    from kimi_k3.checkpoint.loader import load_model

    a = load_model(src, dtype=mx.float32)
    ids = mx.array(np.random.default_rng(0).integers(0, a.args.vocab_size - 256, (1, tokens)))
    la = np.array(a(ids), np.float64)
    del a
    lb = np.array(load_model(out, dtype=mx.float32)(ids), np.float64)
    return float(np.linalg.norm(la - lb) / np.linalg.norm(la))


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="published-layout checkpoint (default: synthetic)")
    parser.add_argument("--preset", default="tiny", help="synthetic preset without --model")
    parser.add_argument("--out", help="output directory (default: a temporary one)")
    parser.add_argument("--dense-bits", type=int, default=16, choices=(4, 8, 16))
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare logits (default: only for the synthetic checkpoint)",
    )
    return parser


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    if importlib.util.find_spec("kimi_k3.convert.convert") is None:
        print("error: this build has no converter (kimi_k3/convert/convert.py)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        src = args.model
        if src is None:
            src = str(Path(tmp) / "synthetic")
            subprocess.run(
                [sys.executable, "-m", "kimi_k3.convert", "synth", src, "--preset", args.preset],
                check=True,
            )
        out = args.out or str(Path(tmp) / "converted")
        convert(src, out, args.dense_bits, args.group_size)
        if args.compare if args.compare is not None else args.model is None:
            err = compare(src, out)
            print(
                f"logits of {out} vs {src}: relative difference {err:.3e} "
                f"({args.dense_bits}-bit dense)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
