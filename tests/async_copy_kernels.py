"""Small kernels that exercise the ASYNC_COPY16 / ASYNC_COMMIT / ASYNC_WAIT dialect words,
run by tests/test_async_copy.py on the emulator and on CUDA."""

import mlx.core as mx

from kimi_k3.kernels.source import Instance, Kernel

# Thread t copies float4 t of x into threadgroup memory, in two groups (even threads' copies
# first, then odd threads'); WAIT_N is the wait before the barrier (0: both groups landed;
# 1: the most recent group, the odd threads' copies, may still be in flight). Then thread t
# writes element (t + 1) % n of the buffer: another thread's copy. Rows with t >= VALID are
# copied as zeros.
ROTATE = """
  SHARED float4 buf[64];
  const uint t = THREAD_INDEX;
  const bool valid = (int)t < VALID;
  const DEVICE float4* src = reinterpret_cast<const DEVICE float4*>(x) + (valid ? t : 0);
  if (t % 2 == 0) ASYNC_COPY16(buf[t], src, valid);
  ASYNC_COMMIT();
  if (t % 2 == 1) ASYNC_COPY16(buf[t], src, valid);
  ASYNC_COMMIT();
  ASYNC_WAIT(WAIT_N);
  BARRIER();
  const float4 v = buf[(t + 1) % 64];
  out[4 * t] = v.x;
  out[4 * t + 1] = v.y;
  out[4 * t + 2] = v.z;
  out[4 * t + 3] = v.w;
"""


def rotate_kernel(wait_n: int, valid: int) -> Kernel:
    return Kernel(
        f"async_rotate_{wait_n}_{valid}",
        ["x"],
        ["out"],
        ROTATE.replace("WAIT_N", str(wait_n)).replace("VALID", str(valid)),
        instances=[Instance([mx.float32], [mx.float32])],
    )


def launch(kernel: Kernel, backend: str, x: mx.array, n_out: int, threads: int = 64):
    """One threadgroup of ``threads`` running ``kernel`` on input ``x``: its fp32 output of
    ``n_out`` elements."""
    (out,) = kernel(
        backend,
        inputs=[x],
        output_shapes=[(n_out,)],
        output_dtypes=[mx.float32],
        grid=(threads, 1, 1),
        threadgroup=(threads, 1, 1),
    )
    return out


def rotate(backend: str, x: mx.array, wait_n: int = 0, valid: int = 64) -> mx.array:
    """x: 256 floats. Returns what ROTATE writes (256 floats)."""
    return launch(rotate_kernel(wait_n, valid), backend, x, 256)


def expected(x, valid: int = 64):
    """What ROTATE gives once every copy has landed."""
    import numpy as np

    rows = np.array(x).reshape(64, 4).copy()
    rows[valid:] = 0.0
    return np.roll(rows, -1, axis=0).reshape(-1)
