"""Shared fixtures: small synthetic checkpoints in the published layout, written once."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from kimi_k3.convert.synth import write_checkpoint

# MLX_ENABLE_TF32 is left as the user has it: on CUDA, MLX's default lets fp32 matmuls run as
# TF32, and the kernels must pass in that environment (their references run on the CPU);
# benchmarks/h200.sh runs the CUDA tests once as they come and once with TF32 off.

# The kernel tests check each kernel against the reference themselves; the first-use check
# (kimi_k3.kernels.verdict), which would record verdicts in the user's cache, is off for the
# suite and on in tests/test_doctor.py, with a temporary cache.
os.environ.setdefault("KIMI_K3_KERNEL_CHECK", "0")

NEEDS_CUDA = "needs MLX's CUDA backend"  # the skip reason CI accepts (.ci/run)


@pytest.fixture(params=["emulator", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request) -> str:
    """The kernel backend a kernel test runs on: the Metal source on the CPU emulator, and
    MLX's CUDA backend (skipped where absent). A case marked ``cuda`` (K3's sizes, which the
    emulator would take minutes over) runs on CUDA alone."""
    return request.param


@pytest.fixture(autouse=True)
def _environment_kept():
    """Each test leaves the environment as it found it: entry points run in-process
    (``kimi_k3.train``, ``kimi_k3.eval``, ``benchmarks.bench_train``) set
    ``KIMI_K3_REFERENCE``, which would send later tests in the same worker to the reference."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """``ckpt_factory(preset, **overrides)`` -> directory of a synthetic checkpoint (cached)."""
    made = {}

    def make(preset: str = "tiny", seed: int = 0, **overrides):
        key = (preset, seed, repr(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"ckpt-{preset}")
            made[key] = write_checkpoint(out, preset, seed=seed, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_ckpt(ckpt_factory):
    return ckpt_factory("tiny")


@pytest.fixture(scope="session")
def tiny_b_ckpt(ckpt_factory):
    return ckpt_factory("tiny-b")


# The tiny preset with experts whose widths split into the lower-bit formats' groups of 64.
FORMAT_SHAPES = dict(moe_intermediate_size=64)


@pytest.fixture(scope="session")
def lower_bit(ckpt_factory, tmp_path_factory):
    """``lower_bit(bits, preset="tiny", ranks=1, rank=0, **overrides)`` -> that synthetic
    checkpoint (``FORMAT_SHAPES`` applied) converted with ``--expert-bits bits --dense-bits
    16``, one rank's pack where ``ranks`` > 1 (cached)."""
    from kimi_k3.convert.convert import Settings, convert

    made = {}

    def make(bits: int, preset: str = "tiny", ranks: int = 1, rank: int = 0, **overrides):
        overrides = {**FORMAT_SHAPES, **overrides}
        key = (bits, preset, ranks, rank, repr(sorted(overrides.items())))
        if key not in made:
            src = ckpt_factory(preset, **overrides)
            out = tmp_path_factory.mktemp(f"bits{bits}") / "out"
            settings = Settings(dense_bits=16, expert_bits=bits, ranks=ranks, rank=rank)
            with open(os.devnull, "w") as log:
                convert(src, out, settings, stream=log)
            made[key] = out
        return made[key]

    return make


def published_experts(path) -> dict:
    """``{layer: [{"w1.weight_packed": u8 array, ...} per expert]}`` read from a checkpoint's
    shards: the input ``kimi_k3.checkpoint.expert_pack.write_pack`` takes."""
    from kimi_k3.checkpoint.files import CheckpointIndex
    from kimi_k3.model.config import ModelArgs
    from kimi_k3.model.experts import expert_keys

    args = ModelArgs.from_path(path)
    index = CheckpointIndex(path)
    return {
        layer: [
            {k.split(".experts.")[1].split(".", 1)[1]: index.read_numpy(k) for k in keys}
            for keys in (expert_keys(layer, e) for e in range(args.num_experts))
        ]
        for layer in range(args.first_k_dense_replace, args.num_hidden_layers)
    }


def rel_err(a, b) -> float:
    """Norm-relative error ||a - b|| / ||b|| in float64."""
    a = np.asarray(a.astype(mx.float32) if isinstance(a, mx.array) else a, dtype=np.float64)
    b = np.asarray(b.astype(mx.float32) if isinstance(b, mx.array) else b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run on an NVIDIA GPU with MLX's CUDA backend (the lent H200) and
    are skipped elsewhere with the one reason CI accepts. The emulator instance of a
    ``backend`` test is dropped where the test or its case is marked ``cuda``."""
    emulated = [
        item
        for item in items
        if getattr(item, "callspec", None) is not None
        and item.callspec.params.get("backend") == "emulator"
        and item.get_closest_marker("cuda") is not None
    ]
    if emulated:
        dropped = set(map(id, emulated))
        items[:] = [item for item in items if id(item) not in dropped]
        config.hook.pytest_deselected(items=emulated)
    if mx.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NEEDS_CUDA)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def dispatch_defaults(monkeypatch):
    """No environment variable overrides the dispatcher: the backend's own kernels, decode
    and prefill choices and expert layout."""
    for var in (
        "KIMI_K3_REFERENCE",
        "KIMI_K3_KERNEL_BACKEND",
        "KIMI_K3_EXPERT_DECODE",
        "KIMI_K3_EXPERT_PREFILL",
        "KIMI_K3_EXPERT_LAYOUT",
    ):
        monkeypatch.delenv(var, raising=False)


def broken(kernel, old: str, new: str):
    """A copy of the ``source.Kernel`` ``kernel`` with the one occurrence of ``old`` in its body
    replaced by ``new``: a mutation the kernel tests must catch."""
    from dataclasses import replace

    from kimi_k3.kernels.source import swap

    body = swap(kernel.body, [(old, new)], f"mutation of {kernel.name}")
    return replace(kernel, name=kernel.name + "_broken", body=body, _built={})
