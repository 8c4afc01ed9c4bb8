"""The load probes of benchmarks/mxfp4_sweep.py are cut out of the tensor-core decode kernel's
body by text; these tests fail when the kernel changes under them (a marker gone, the math
still in a probe), and, where nvcc is on PATH, compile each probe as MLX's cuda_kernel
would wrap it at K3's shape."""

import shutil

import mlx.core as mx
import pytest

from benchmarks import mxfp4_sweep
from benchmarks.profile_kernels import ptxas
from kimi_k3.kernels import mxfp4_mma, source

PROBES = {
    "probe": mxfp4_sweep.probe_kernel,
    "no staging": mxfp4_sweep.nostage_kernel,
    "no scales": mxfp4_sweep.noscale_kernel,
    "stream": mxfp4_sweep.stream_kernel,
}


@pytest.mark.parametrize("name", PROBES)
def test_probes_keep_the_loads_and_drop_the_math(name):
    body = PROBES[name]().body
    assert "SIMD_MMA" not in body and "kk_e2m1_pair" not in body
    # the code words are still read
    assert all(f"{q}[" in body or f"KK_Q({q}," in body for q in ("qa", "qb"))
    if name in ("probe", "no staging"):
        assert body.count("= ea[") == 2 and body.count("= eb[") == 2  # and the scales
    if name == "no scales":
        assert "= ea[" not in body and "= eb[" not in body
    if name == "no staging":
        assert "frag[it] =" not in body and "s_max" in body


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("name", PROBES)
def test_probes_compile_for_cuda(name):
    kernel = PROBES[name]()
    insts = [
        source.Instance(
            [dt, mx.uint32, mx.uint8, mx.uint32, mx.uint8, mx.int32, mx.float32],
            [mx.float32],
            mxfp4_mma.template(dt, KD, NR, 16, glu, 8, 1, 8, True),
        )
        for dt, KD, NR, glu in ((mx.bfloat16, 3584, 3072, True), (mx.float32, 3072, 3584, False))
    ]
    code, err, _ = ptxas(kernel, insts)
    assert code == 0, err[-3000:]
