"""The asynchronous-copy dialect words on the emulator and on CUDA (cp.async): every copy has
landed after the ASYNC_WAIT that covers its group, invalid rows are zeros, and since the
emulator lands each copy either at once or at that wait, a kernel that reads a copy still in
flight (poisoned threadgroup memory) or refills a buffer still being read shows the bug."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from async_copy_kernels import expected, launch, rotate, rotate_kernel
from conftest import broken

from benchmarks.profile_kernels import ptxas
from kimi_k3.kernels import source


def x256():
    mx.random.seed(0)
    return mx.random.normal((256,))


@pytest.mark.parametrize("valid", [64, 40])
def test_copies_land_at_the_wait(backend, valid):
    """Every copy has landed after its wait; rows past ``valid`` are zeros (on the GPU:
    cp.async)."""
    x = x256()
    np.testing.assert_array_equal(np.array(rotate(backend, x, valid=valid)), expected(x, valid))


def test_a_group_still_in_flight_reads_stale_memory():
    """ASYNC_WAIT(1) leaves the most recent group (the odd threads' copies) in flight: the
    emulator lands about half of the copies at once and holds the others past the wait, so
    some even threads (which read their odd neighbours' rows) see poison; the odd threads
    read the even rows, which have landed."""
    x = x256()
    got = np.array(rotate("emulator", x, wait_n=1)).reshape(64, 4)
    want = expected(x).reshape(64, 4)
    even, odd = got[0::2], got[1::2]  # thread t reads row t + 1
    assert not np.isfinite(even).all()
    np.testing.assert_array_equal(odd, want[1::2])


# Every thread writes its row of buf, then (a bug) refills it by an asynchronous copy while
# its neighbour may still be reading it: no barrier between the neighbour's read and the copy.
REFILL = """
  SHARED float4 buf[64];
  const uint t = THREAD_INDEX;
  buf[t] = FLOAT4(1.0f, 1.0f, 1.0f, 1.0f);
  BARRIER();
  ASYNC_COPY16(buf[t], reinterpret_cast<const DEVICE float4*>(x) + t, true);
  ASYNC_COMMIT();
  const float4 v = buf[(t + 1) % 64];  // meant to be the value before the refill
  ASYNC_WAIT(0);
  out[t] = v.x;
"""


def test_a_buffer_refilled_while_read_is_caught():
    """Copies that land at once (half of them on the emulator) show a buffer refilled before
    its readers are done: some reads see the new data instead of 1."""
    got = launch(source.Kernel("async_refill", ["x"], ["out"], REFILL), "emulator", x256(), 64)
    assert (np.array(got) != 1.0).any()


def test_a_missing_wait_is_caught():
    no_wait = broken(rotate_kernel(0, 64), "ASYNC_WAIT(0);", "")
    got = launch(no_wait, "emulator", x256(), 256)
    assert not np.isfinite(np.array(got)).all()


def test_too_many_copies_in_flight_are_reported():
    body = """
  SHARED float4 buf[256];
  const DEVICE float4* src = reinterpret_cast<const DEVICE float4*>(x);
  for (int i = 0; i < 256; ++i) ASYNC_COPY16(buf[i], src, true);
  out[THREAD_INDEX] = 0.0f;
"""
    k = source.Kernel("async_overflow", ["x"], ["out"], body)
    with pytest.raises(RuntimeError, match="asynchronous copies in flight"):
        launch(k, "emulator", x256(), 32, threads=32)


def test_the_words_render_for_both_backends():
    for backend in source.BACKENDS:
        text = source.render("ASYNC_COPY16(b[0], p, true); ASYNC_COMMIT(); ASYNC_WAIT(1);", backend)
        assert "kk_async_copy16(b[0], p, true)" in text and "kk_async_wait(1)" in text
    assert "cp.async.cg.shared.global" in source.CUDA_PRELUDE


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("wait_n", [0, 1, 2, 3])
def test_the_cuda_spelling_compiles(wait_n):
    code, err, entries = ptxas(rotate_kernel(wait_n, 40))
    assert code == 0 and entries, err[-2000:]
