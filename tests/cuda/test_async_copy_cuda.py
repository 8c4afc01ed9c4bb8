"""The asynchronous-copy dialect words on the GPU (cp.async): the kernels of
tests/test_async_copy.py must give what they give once every copy has landed.

Runs only where ``mx.cuda.is_available()`` (the H200 machine); skipped elsewhere.
"""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from async_copy_kernels import expected, rotate  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend"),
]


@pytest.mark.parametrize("valid", [64, 40])
def test_rotate(valid):
    mx.random.seed(0)
    x = mx.random.normal((256,))
    np.testing.assert_array_equal(np.array(rotate("cuda", x, valid=valid)), expected(x, valid))
