"""Layout detection, and loading directories written by mlx-lm (plain and quantized)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_lm_load
from mlx_lm.utils import quantize_model, save_config, save_model

from kimi_k3.checkpoint.files import CheckpointError, CheckpointIndex
from kimi_k3.checkpoint.layouts import detect, from_mlx_lm, mlx_lm_expert_names, read_args
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.convert.convert import Settings, convert
from kimi_k3.model.config import ModelArgs

TOKENS = mx.array([[1, 5, 9, 100, 7, 3, 44, 2, 900, 17, 64]])


def _save_mlx_lm(src: Path, out: Path, quantize: dict | None = None) -> Path:
    model, config = mlx_lm_load(src)
    if quantize:
        model, config = quantize_model(model, config, **quantize)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def _rel(a: mx.array, b: mx.array) -> float:
    return float(mx.linalg.norm(a - b) / mx.linalg.norm(b))


@pytest.fixture(scope="module")
def mlx_lm_dir(tiny_ckpt, tmp_path_factory):
    return _save_mlx_lm(tiny_ckpt, tmp_path_factory.mktemp("mlxlm") / "tiny")


def test_detect(tiny_ckpt, mlx_lm_dir, tmp_path):
    assert detect(tiny_ckpt) == "published"
    assert detect(mlx_lm_dir) == "mlx-lm"
    convert(tiny_ckpt, tmp_path / "conv", Settings(16), stream=io.StringIO())
    assert detect(tmp_path / "conv") == "pack"
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        detect(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no .*safetensors"):
        detect(tmp_path / "empty")


def test_mlx_lm_layout_gives_identical_logits(tiny_ckpt, mlx_lm_dir):
    assert (
        json.loads((mlx_lm_dir / "config.json").read_text())["quantization_config"]["mode"]
        == "mxfp4"
    )  # mlx-lm's own entry, which the published-config check would reject
    want = load_model(tiny_ckpt, dtype=mx.float32)(TOKENS)
    got = load_model(mlx_lm_dir, dtype=mx.float32)(TOKENS)
    assert mx.array_equal(want, got)


def test_quantized_mlx_lm_layout_matches_mlx_lm(ckpt_factory, tmp_path):
    """Affine 4-bit dense (fused qkv, split kv_b, 8-bit router) against mlx-lm's own model."""
    src = ckpt_factory("small")
    out = _save_mlx_lm(src, tmp_path / "q", {"group_size": 32, "bits": 4})
    names = CheckpointIndex(out).tensors
    for part in ("qkv_proj.biases", "embed_q.scales", "unembed_out.biases", "mlp.gate.scales"):
        assert any(part in k for k in names), part
    oracle, _ = mlx_lm_load(out)
    oracle.set_dtype(mx.float32)  # floats only: the MXFP4 scales stay uint8
    want = oracle(TOKENS)
    ours = load_model(out, dtype=mx.float32)
    assert ours.layers[1].self_attn.q_proj.bits == 4
    assert _rel(ours(TOKENS), want) < 1e-4


def test_mlx_lm_expert_names_slice_to_published_bytes(tiny_ckpt, mlx_lm_dir):
    stacked, published = CheckpointIndex(mlx_lm_dir), CheckpointIndex(tiny_ckpt)
    layer, e, n = 3, 6, ModelArgs.from_path(tiny_ckpt).num_experts
    for name, key in mlx_lm_expert_names(layer).items():
        t = stacked[key]
        per = t.nbytes // n
        with open(t.file, "rb") as f:
            f.seek(t.start + e * per)
            got = f.read(per)
        kind = "weight_packed" if name.endswith("weight") else "weight_scale"
        src = (
            f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}."
            f"{name.split('.')[0]}.{kind}"
        )
        assert got == published.read_numpy(src).tobytes()


def test_affine_experts_are_refused(mlx_lm_dir):
    args = read_args(mlx_lm_dir, "mlx-lm")
    key = "language_model.model.layers.1.mlp.switch_mlp.up_proj.biases"
    with pytest.raises(CheckpointError, match=rf"{key}: affine-quantized routed experts"):
        from_mlx_lm(args, {key: mx.zeros((8, 32, 2))})
    key = "language_model.model.layers.1.mlp.switch_mlp.up_proj.scales"
    with pytest.raises(CheckpointError, match="affine-quantized routed experts"):
        from_mlx_lm(args, {key: mx.array(np.zeros((8, 32, 2), np.float16))})
