"""Tests in this folder run on an NVIDIA GPU with MLX's CUDA backend (the lent H200), and
are skipped elsewhere with the one reason CI accepts."""

import mlx.core as mx
import pytest

CUDA = mx.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs MLX's CUDA backend")
    for item in items:
        if "tests/cuda/" in str(item.fspath).replace("\\", "/") and not CUDA:
            item.add_marker(skip)
