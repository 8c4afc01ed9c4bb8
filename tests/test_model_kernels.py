"""The whole model with its kernels (Metal source, run by the CPU emulator) equals the model
on the pure-MLX reference: prefill in uneven chunks, then decode."""

import mlx.core as mx
from conftest import rel_err
from model_kernel_check import KERNEL_SHAPES, compare


def test_model_with_metal_kernels_matches_reference(ckpt_factory, monkeypatch):
    path = ckpt_factory("tiny", **KERNEL_SHAPES)
    out, ref, counts = compare(monkeypatch, path, "emulator", mx.float32, prompt_len=70, steps=2)
    assert counts["kda"] > 0 and counts["experts"] > 0
    assert rel_err(out, ref) < 1e-4
    assert mx.array_equal(mx.argmax(out, -1), mx.argmax(ref, -1))
