"""The cut-down copies of kda_chunk_prep that benchmarks/kda_prep_probes.py times: each cut
still finds its text in the kernel, removes real work (the result changes) and leaves a
kernel that runs on the emulator and compiles with nvcc (where nvcc is on PATH)."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from benchmarks import kda_prep_probes
from benchmarks.profile_kernels import register_count
from kimi_k3.kernels import kda_prefill


def inputs(T=70, H=2, K=64):
    mx.random.seed(3)
    q, k = (mx.random.normal((1, T, H, K)) * 0.1 for _ in range(2))
    v = mx.random.normal((1, T, H, K))
    g = -mx.sigmoid(mx.random.normal((1, T, H, K)))
    beta = mx.sigmoid(mx.random.normal((1, T, H)))
    return q, k, v, g, beta


@pytest.mark.parametrize("name", list(kda_prep_probes.CUTS))
def test_probe_cuts_real_work(name):
    args = inputs()
    full = kda_prefill.chunk_prep("emulator", *args)
    cut = kda_prefill.chunk_prep("emulator", *args, kernel=kda_prep_probes.probe(name))
    mx.eval(full, cut)
    # Aqk (0) for the score cuts, W and U (1, 2) for the solve cut; Qd, Kd, decay stay.
    changed = [not np.allclose(np.array(a), np.array(b)) for a, b in zip(full, cut)]
    assert changed[0] if name != "no solve" else (changed[1] and changed[2])
    assert not any(changed[3:])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("name", list(kda_prep_probes.CUTS))
def test_probe_compiles_for_cuda(name):
    assert register_count(kda_prep_probes.probe(name)) != "?"
