"""The whole model with its CUDA kernels equals the model on the pure-MLX reference (fp32,
run with MLX_ENABLE_TF32=0), and bf16 agrees by KL divergence and top-1."""

import mlx.core as mx
import pytest
from conftest import rel_err
from model_kernel_check import KERNEL_SHAPES, compare

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")


def test_model_with_cuda_kernels_matches_reference_fp32(ckpt_factory, monkeypatch):
    path = ckpt_factory("tiny", **KERNEL_SHAPES)
    out, ref, counts = compare(monkeypatch, path, "cuda", mx.float32, prompt_len=200, steps=8)
    assert counts["kda"] > 0 and counts["experts"] > 0
    assert rel_err(out, ref) < 1e-4


def test_model_with_cuda_kernels_bf16(ckpt_factory, monkeypatch):
    path = ckpt_factory("tiny", **KERNEL_SHAPES)
    out, ref, _ = compare(monkeypatch, path, "cuda", mx.bfloat16, prompt_len=200, steps=8)
    a, b = ref.astype(mx.float32), out.astype(mx.float32)
    la = a - mx.logsumexp(a, -1, keepdims=True)
    lb = b - mx.logsumexp(b, -1, keepdims=True)
    kl = float(mx.mean(mx.sum(mx.exp(la) * (la - lb), axis=-1)))
    assert kl < 0.05
    assert float(mx.mean(mx.argmax(a, -1) == mx.argmax(b, -1))) >= 0.75
