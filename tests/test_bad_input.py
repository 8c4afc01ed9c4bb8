"""Broken checkpoints and unsupported configs fail with a message naming the file, tensor or key."""

import json
import shutil
import struct

import mlx.core as mx
import pytest

from kimi_k3.checkpoint.files import CheckpointError, CheckpointIndex
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.model.config import ConfigError, ModelArgs


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    """A private copy of the tiny checkpoint that a test may damage."""
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, out)
    return out


def _shard_of(path, tensor):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][tensor]


def _rewrite_header(file, edit):
    """Apply ``edit`` to the header, then lay the data out again so the file stays a valid
    safetensors file: each entry gets the bytes its data_offsets pointed at, back to back."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    edit(header)
    parts, pos = [], 0
    for meta in sorted(header.values(), key=lambda m: m["data_offsets"][0]):
        a, b = meta["data_offsets"]
        parts.append(data[a:b])
        meta["data_offsets"] = [pos, pos + b - a]
        pos += b - a
    new = json.dumps(header).encode()
    new += b" " * ((-len(new)) % 8)
    file.write_bytes(struct.pack("<Q", len(new)) + new + b"".join(parts))


NAME = "language_model.model.layers.1.self_attn.q_proj.weight"


def test_missing_tensor(ckpt):
    _rewrite_header(_shard_of(ckpt, NAME), lambda h: h.pop(NAME))
    with pytest.raises(CheckpointError, match=rf"{NAME}.*in the index but not in that shard"):
        load_model(ckpt)


def test_missing_tensor_without_index(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][NAME]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _rewrite_header(_shard_of(ckpt, "language_model.model.norm.weight"), lambda h: h.pop(NAME, 0))
    for f in ckpt.glob("*.safetensors"):
        _rewrite_header(f, lambda h: h.pop(NAME, 0))
    with pytest.raises(CheckpointError, match=rf"tensor {NAME} is missing"):
        load_model(ckpt)


def test_wrong_shape(ckpt):
    def shrink(h):
        meta = h[NAME]
        a, b = meta["data_offsets"]
        meta["shape"] = [meta["shape"][0] // 2, meta["shape"][1] * 2]

    shard = _shard_of(ckpt, NAME)
    _rewrite_header(shard, shrink)
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*{NAME} has shape \[16, 128\]"):
        load_model(ckpt)


def test_truncated_shard(ckpt):
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated: tensor .* ends at byte"):
        CheckpointIndex(ckpt)


def test_corrupted_header(ckpt):
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{["
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupted safetensors header"):
        load_model(ckpt)


def test_absurd_header_length(ckpt):
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 60)
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupted safetensors header"):
        load_model(ckpt)


def test_missing_shard(ckpt):
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: shard file is missing"):
        load_model(ckpt)


def test_missing_expert(ckpt):
    bad = "language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight_scale"
    for f in ckpt.glob("model-*.safetensors"):
        _rewrite_header(f, lambda h: h.pop(bad, 0))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][bad]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"tensor {bad} is missing from the checkpoint"):
        load_model(ckpt)


def _config(ckpt):
    return json.loads((ckpt / "config.json").read_text())


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda t: t.update(hidden_act="silu"), "hidden_act='silu'"),
        (lambda t: t.update(moe_router_activation_func="softmax"), "moe_router_activation_func"),
        (lambda t: t.update(mla_use_nope=False), "mla_use_nope=False"),
        (lambda t: t["linear_attn_config"]["kda_layers"].remove(1), r"layers \[1\].*in neither"),
        (lambda t: t["linear_attn_config"]["kda_layers"].append(3), r"layers \[3\].*in both"),
        (lambda t: t["linear_attn_config"].pop("head_dim"), r"linear_attn_config\.head_dim"),
        (lambda t: t.update(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    ],
)
def test_unsupported_config_values(ckpt, edit, key):
    config = _config(ckpt)
    edit(config["text_config"])
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=key):
        load_model(ckpt)


def test_unknown_quantization_format(ckpt):
    config = _config(ckpt)
    config["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quantization_config\.format='nvfp4-pack-quantized'"):
        load_model(ckpt)


def test_unknown_quant_method(ckpt):
    config = _config(ckpt)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quant_method='gptq'"):
        load_model(ckpt)


def test_no_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_flat_config_equals_nested(ckpt):
    nested = _config(ckpt)
    flat = dict(nested["text_config"], quantization_config=nested["quantization_config"])
    flat.update({k: nested[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    a, b = ModelArgs.from_dict(nested), ModelArgs.from_dict(flat)
    assert a == b and a.kda_layers == (1, 2, 4) and a.full_attn_layers == (3, 5)
    assert a.is_kda(0) and not a.is_kda(2)


def test_unexpected_tensor_is_reported(ckpt):
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    extra = "language_model.model.layers.0.self_attn.rotary.inv_freq"

    def add(h):
        h[extra] = dict(h["language_model.model.layers.0.self_attn.o_norm.weight"])

    _rewrite_header(shard, add)
    (ckpt / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{extra} is not part of Kimi K3"):
        load_model(ckpt, dtype=mx.float32)


def test_malformed_header_entry(ckpt):
    shard = _shard_of(ckpt, NAME)

    def bad_shape(h):
        h[NAME]["shape"] = ["16", 64]

    _rewrite_header(shard, bad_shape)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor {NAME}: malformed header"):
        load_model(ckpt)
