"""benchmarks/read_limit.py reads exactly the decode call's weight bytes: the XOR of its
threadgroups' words is the XOR of the selected experts' code words and scale bytes (run by
the Metal emulator; on CUDA where MLX has it), and its output is the latent."""

import shutil
from functools import reduce

import mlx.core as mx
import numpy as np
import pytest

from benchmarks import read_limit
from benchmarks.bench_mxfp4 import random_experts
from benchmarks.profile_kernels import ptxas
from kimi_k3.kernels import source


def expected_xor(w, keys, inds) -> list[int]:
    """Per (pair, matrix), in the kernel's order: the XOR of its code words and scale bytes
    (as 32-bit words)."""
    out = []
    for p in np.asarray(inds).reshape(-1):
        for key in keys:
            codes, scales = (np.asarray(a[int(p)]).reshape(-1) for a in w[key])
            words = (codes.view(np.uint32), scales.view(np.uint32))
            out.append(int(reduce(np.bitwise_xor, (np.bitwise_xor.reduce(a) for a in words))))
    return out


def fold(parts, groups: int) -> list[int]:
    """The threadgroups' words XORed per (pair, matrix)."""
    return [int(v) for v in np.bitwise_xor.reduce(np.asarray(parts).reshape(groups, -1), axis=1)]


def test_one_launch_reads_every_selected_byte(backend):
    # 544 x 640 experts: 174080 code bytes (10880 16-byte words) a matrix, a whole chunk
    # (8192 words) and part of another, whose last round is partial
    w = random_experts(6, 640, 544, seed=3)
    inds = mx.array([[4, 1], [0, 5]], dtype=mx.int32)
    z = mx.random.normal((2, 640)).astype(mx.bfloat16)
    out, parts = read_limit.read_mats(z, [w["w1"], w["w3"], w["w2"]], inds, backend)
    assert parts.size == 4 * 3 * 2  # pairs x matrices x chunks
    assert fold(parts, 12) == expected_xor(w, ("w1", "w3", "w2"), inds)
    assert out.dtype == mx.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(z.astype(mx.float32)))


def test_each_matrix_and_pair_counts(backend):
    w = random_experts(4, 256, 128, seed=5)
    inds = mx.array([[2, 3]], dtype=mx.int32)
    z = mx.zeros((1, 256), dtype=mx.float32)
    for keys in (("w1",), ("w1", "w3"), ("w2",)):
        _, parts = read_limit.read_mats(z, [w[k] for k in keys], inds, backend)
        assert fold(parts, 2 * len(keys)) == expected_xor(w, keys, inds), keys
    # another expert gives another XOR: the expert index is honoured
    _, other = read_limit.read_mats(z, [w["w1"]], mx.array([[0, 3]]), backend)
    assert fold(other, 2) == expected_xor(w, ("w1",), [[0, 3]])
    assert fold(other, 2)[0] != expected_xor(w, ("w1",), inds)[0]


def test_read_call_returns_the_latent_and_bad_arguments_fail():
    w = random_experts(3, 256, 128, seed=7)
    inds = mx.array([[0, 2]], dtype=mx.int32)
    z = mx.random.normal((1, 256))
    out = read_limit.read_call(z, w, inds, None, 4.0, 25.0, backend="emulator")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(z))
    with pytest.raises(ValueError, match="1 to 3 matrices"):
        read_limit.read_mats(z, [], inds, "emulator")
    with pytest.raises(ValueError, match="the matrices differ in size"):
        read_limit.read_mats(z, [w["w1"], random_experts(3, 256, 256, seed=1)["w1"]], inds)
    odd = random_experts(3, 32, 8, seed=1)  # 8 scale bytes an expert
    with pytest.raises(ValueError, match="scale bytes \\(8\\) are no multiple of 16"):
        read_limit.read_mats(z, [odd["w1"]], inds, "emulator")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_read_limit_compiles_for_cuda():
    cw4 = 3072 * 3584 // 32  # K3's 16-byte code words per expert and matrix
    inst = source.Instance(
        [mx.bfloat16] + [mx.uint32, mx.uint8] * 3 + [mx.int32],
        [mx.float32, mx.uint32],
        read_limit.template(mx.bfloat16, 3, cw4, cw4 // 16, 3584),
    )
    code, err, _ = ptxas(read_limit.READ_LIMIT, [inst])
    assert code == 0, err[-3000:]
