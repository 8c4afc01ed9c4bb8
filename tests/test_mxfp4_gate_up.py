"""benchmarks/mxfp4_gate_up.py times variants of the dispatched decode kernels: each variant's
edits must still apply to the kernels as they are, and each must compute their bits (the
interleaved stack read as down: gate and up's sums). Run by the Metal emulator (on CUDA
where MLX has it)."""

import mlx.core as mx
import numpy as np
import pytest

from benchmarks import mxfp4_gate_up as gu
from benchmarks.bench_mxfp4 import random_experts
from kimi_k3.kernels import mxfp4_mma

BACKENDS = ["emulator"] + (["cuda"] if mx.cuda.is_available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_variant_computes_the_dispatched_bits(monkeypatch, backend, capsys):
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", backend)
    D, I, E, k = 256, 128, 4, 2
    w = random_experts(E, D, I, 0)
    w13 = (gu.interleave(w["w1"][0], w["w3"][0]), gu.interleave(w["w1"][1], w["w3"][1]))
    jobs = gu.jobs_for(w, w13, D, I, k, layouts=True)
    assert len(jobs) == 10
    rng = np.random.default_rng(1)
    inds = mx.array(rng.permutation(E)[:k].astype(np.int32))
    z = mx.random.normal((1, D), key=mx.random.key(1)).astype(mx.bfloat16)
    zk = mx.broadcast_to(z, (k, D)) + 0
    h = mx.random.normal((k, I), key=mx.random.key(2))
    wts = mx.array([0.25, 0.75])
    inputs = {n: [make(z, zk, h, inds, wts)] for n, (_, make, _) in jobs.items()}
    gu.check(jobs, inputs, I, k)
    assert "every variant: the dispatched kernels' bits" in capsys.readouterr().out


def test_interleave_puts_a_units_gate_rows_before_its_up_rows():
    a = mx.arange(2 * 32 * 3).reshape(2, 32, 3)
    b = a + 1000
    both = np.asarray(gu.interleave(a, b))
    assert both.shape == (2, 64, 3)
    np.testing.assert_array_equal(both[1, 16:32], np.asarray(b[1, 0:16]))
    np.testing.assert_array_equal(both[1, 32:48], np.asarray(a[1, 16:32]))


def test_an_edit_that_no_longer_applies_is_refused():
    stale = gu.kernel_for((("params[0], params[1])", "0.0f, 0.0f)"),), "_stale")
    with pytest.raises(AssertionError, match="_stale: the kernel changed"):
        stale(True, mxfp4_mma.LAUNCH["gate_up"])
