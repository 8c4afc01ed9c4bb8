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

BACKENDS = ["emulator"] + (["cuda"] if mx.cuda.is_available() else [])


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stream", [False, True])
def test_one_launch_reads_every_selected_byte(backend, stream):
    # 544 x 640 experts: 174080 code bytes (10880 16-byte words) a matrix, a whole chunk
    # (8192 words) and part of another, whose last round is partial
    w = random_experts(6, 640, 544, seed=3)
    inds = mx.array([[4, 1], [0, 5]], dtype=mx.int32)
    z = mx.random.normal((2, 640)).astype(mx.bfloat16)
    out, parts = read_limit.read_mats(z, [w["w1"], w["w3"], w["w2"]], inds, stream, backend)
    assert parts.size == 4 * 3 * 2  # pairs x matrices x chunks
    assert fold(parts, 12) == expected_xor(w, ("w1", "w3", "w2"), inds)
    assert out.dtype == mx.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(z.astype(mx.float32)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [dict(threads=128, unroll=4, pad_kb=1), dict(threads=64)])
def test_other_shapes_read_the_same(backend, shape):
    # threadgroup size, loads in flight and held threadgroup memory change who reads what
    w = random_experts(3, 640, 544, seed=4)
    inds = mx.array([[2, 0]], dtype=mx.int32)
    z = mx.zeros((1, 640), dtype=mx.float32)
    mats = [w["w1"], w["w2"]]
    _, parts = read_limit.read_mats(z, mats, inds, True, backend, **shape)
    assert parts.size == 2 * 2 * read_limit.chunks(
        544 * 640 // 32, shape["threads"], 4 if "unroll" in shape else read_limit.UNROLL
    )
    assert fold(parts, 4) == expected_xor(w, ("w1", "w2"), inds)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_matrix_and_pair_counts(backend):
    w = random_experts(4, 256, 128, seed=5)
    inds = mx.array([[2, 3]], dtype=mx.int32)
    z = mx.zeros((1, 256), dtype=mx.float32)
    for keys in (("w1",), ("w1", "w3"), ("w2",)):
        _, parts = read_limit.read_mats(z, [w[k] for k in keys], inds, False, backend)
        assert fold(parts, 2 * len(keys)) == expected_xor(w, keys, inds), keys
    # another expert gives another XOR: the expert index is honoured
    _, other = read_limit.read_mats(z, [w["w1"]], mx.array([[0, 3]]), False, backend)
    assert fold(other, 2) == expected_xor(w, ("w1",), [[0, 3]])
    assert fold(other, 2)[0] != expected_xor(w, ("w1",), inds)[0]


def test_two_launches_chain_and_bad_arguments():
    w = random_experts(3, 256, 128, seed=7)
    inds = mx.array([[0, 2]], dtype=mx.int32)
    z = mx.random.normal((1, 256))
    for launches in (1, 2):
        out = read_limit.read_call(z, w, inds, None, 4.0, 25.0, launches, backend="emulator")
        np.testing.assert_array_equal(np.asarray(out), np.asarray(z))
    with pytest.raises(ValueError, match="launches is 1 or 2"):
        read_limit.read_call(z, w, inds, None, 4.0, 25.0, 3, backend="emulator")
    with pytest.raises(ValueError, match="pad_kb 1 holds fewer words than threads"):
        read_limit.read_mats(z, [w["w1"]], inds, False, "emulator", threads=512, pad_kb=1)
    with pytest.raises(ValueError, match="threads 48"):
        read_limit.read_mats(z, [w["w1"]], inds, False, "emulator", threads=48)
    with pytest.raises(ValueError, match="1 to 3 matrices"):
        read_limit.read_mats(z, [], inds, False, "emulator")
    odd = random_experts(3, 32, 8, seed=1)  # 8 scale bytes an expert
    with pytest.raises(ValueError, match="scale bytes \\(8\\) are no multiple of 16"):
        read_limit.read_mats(z, [odd["w1"]], inds, False, "emulator")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_read_limit_compiles_for_cuda():
    cw4 = 3072 * 3584 // 32  # K3's 16-byte code words per expert and matrix
    insts = [
        source.Instance(
            [mx.bfloat16] + [mx.uint32, mx.uint8] * 3 + [mx.int32],
            [mx.float32, mx.uint32],
            read_limit.template(mx.bfloat16, 3, cw4, cw4 // 16, 3584, stream, pad_kb=pad),
        )
        for stream, pad in ((False, 0), (True, 47))
    ]
    code, err, _ = ptxas(read_limit.READ_LIMIT, insts)
    assert code == 0, err[-3000:]
