"""Each expert source gives the same bytes: published shards (contiguous or not), the expert
pack, and an mlx-lm-converted directory; a directory without experts is refused."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import published_experts
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import save_model as mlx_lm_save_model

from kimi_k3.checkpoint.expert_pack import write_pack
from kimi_k3.checkpoint.files import CheckpointError, CheckpointIndex, write_safetensors
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.model.config import ModelArgs
from kimi_k3.model.experts import expert_keys
from kimi_k3.streaming import attach_streamer, get_stats
from kimi_k3.streaming.sources import ShardSource, expert_bytes, expert_shapes, open_source

PROMPT = mx.array(np.random.default_rng(11).integers(0, 700, (1, 12)))


def _logits(model):
    cache = model.make_cache()
    a = model(PROMPT, cache=cache)
    b = model(mx.argmax(a[:, -1:], axis=-1), cache=cache)
    out = mx.concatenate([a, b], axis=1)
    mx.eval(out)
    return out


def _min_gb(args) -> float:
    layers = args.num_hidden_layers - args.first_k_dense_replace
    return layers * args.num_experts_per_token * expert_bytes(expert_shapes(args)) / 1e9


@pytest.fixture(scope="module")
def tiny_ref(tiny_ckpt):
    return _logits(load_model(tiny_ckpt, dtype=mx.float32))


def _streamed_from(ckpt, source_dir, **opts):
    """A model with dense weights from ``ckpt`` and experts streamed from ``source_dir``."""
    model = load_model(ckpt, dtype=mx.float32)
    index = None if opts.pop("no_index", False) else CheckpointIndex(source_dir)
    attach_streamer(model, source_dir, index, _min_gb(model.args), **opts)
    return model


def test_published_expert_is_one_read_of_its_six_tensors(tiny_ckpt):
    args = ModelArgs.from_path(tiny_ckpt)
    index = CheckpointIndex(tiny_ckpt)
    layout = expert_shapes(args)
    src = ShardSource(index, layout, [1, 2, 3, 4], args.num_experts)
    assert src.split_experts == 0
    (ext,) = src.extents(3, 5)
    assert ext.nbytes == expert_bytes(layout)
    raw = open(ext.file, "rb").read()[ext.offset : ext.offset + ext.nbytes]
    pieces = {name: n for name, n in ext.pieces}
    want = b"".join(index.read_numpy(k).tobytes() for k in expert_keys(3, 5))
    assert sum(pieces.values()) == len(want) and raw == want


def test_scattered_published_tensors_fall_back_to_one_read_per_run(tiny_ckpt, tiny_ref, tmp_path):
    """Rewrite the shard with each expert's tensors interleaved with other experts'."""
    out = tmp_path / "scattered"
    shutil.copytree(tiny_ckpt, out)
    index = CheckpointIndex(out)
    names = list(index.tensors)
    experts = sorted((n for n in names if ".experts." in n), key=lambda n: n.rsplit(".", 2)[-2:])
    order = [n for n in names if ".experts." not in n] + experts  # grouped by tensor kind
    (shard,) = index.files
    dtypes = {t.name: t.dtype for t in index.tensors.values()}
    tensors = [(n, index.read_numpy(n), dtypes[n]) for n in order]
    write_safetensors(shard, tensors)
    model = _streamed_from(tiny_ckpt, out)
    src = open_source(out, CheckpointIndex(out), model.args, [1, 2, 3, 4])
    assert src.split_experts == 4 * 8 and len(src.extents(1, 0)) == 6
    assert mx.array_equal(_logits(model), tiny_ref).item()


@pytest.mark.parametrize("verify", [False, True])
def test_expert_pack_source(tiny_ckpt, tiny_ref, tmp_path, verify):
    experts = published_experts(tiny_ckpt)
    write_pack(tmp_path, experts, file_bytes=40_000)  # several pack files
    assert len(list((tmp_path / "experts").glob("*.pack"))) > 1
    model = _streamed_from(tiny_ckpt, tmp_path, no_index=True, verify_checksums=verify)
    assert mx.array_equal(_logits(model), tiny_ref).item()
    assert get_stats(model)["source"] == "pack"


def test_mlx_lm_converted_directory(tiny_ckpt, tiny_ref, tmp_path):
    """mlx-lm's own loader + saver write experts stacked under ``mlp.switch_mlp``."""
    mlx_model, config = mlx_lm_load_model(tiny_ckpt)
    mlx_lm_save_model(tmp_path, mlx_model)
    (tmp_path / "config.json").write_text(json.dumps(config))
    index = CheckpointIndex(tmp_path)
    assert "language_model.model.layers.1.mlp.switch_mlp.gate_proj.weight" in index
    model = _streamed_from(tiny_ckpt, tmp_path)
    assert get_stats(model)["source"] == "mlx-lm"
    assert mx.array_equal(_logits(model), tiny_ref).item()


def test_mlx_lm_affine_experts_are_refused(tiny_ckpt, tmp_path):
    mlx_model, _ = mlx_lm_load_model(tiny_ckpt)
    mlx_lm_save_model(tmp_path, mlx_model)
    index = CheckpointIndex(tmp_path)
    key = "language_model.model.layers.2.mlp.switch_mlp.up_proj.biases"
    index.tensors[key] = index.tensors[key.replace("biases", "scales")]
    with pytest.raises(CheckpointError, match=r"up_proj\.biases: affine"):
        open_source(tmp_path, index, ModelArgs.from_path(tiny_ckpt), [1, 2, 3, 4])


def test_no_experts_anywhere_is_a_clear_error(tiny_ckpt, tmp_path):
    index = CheckpointIndex(tiny_ckpt)
    dense = [
        (n, index.read_numpy(n), t.dtype) for n, t in index.tensors.items() if ".experts." not in n
    ]
    write_safetensors(tmp_path / "model.safetensors", dense)
    with pytest.raises(CheckpointError, match="no routed experts found for layer 1"):
        open_source(tmp_path, None, ModelArgs.from_path(tiny_ckpt), [1, 2, 3, 4])


def test_wrong_expert_shape_names_the_tensor(tiny_ckpt):
    args = ModelArgs.from_path(tiny_ckpt)
    args.moe_intermediate_size *= 2
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight_packed is U8\[32, 32\]"):
        open_source(tiny_ckpt, CheckpointIndex(tiny_ckpt), args, [1, 2, 3, 4])


@pytest.mark.parametrize("direct", [True, False])
def test_reads_without_preadv(tiny_ckpt, tiny_ref, monkeypatch, direct):
    """Platforms without ``os.preadv`` read with ``os.pread`` (one more copy), same bytes."""
    import kimi_k3.streaming.io as sio

    monkeypatch.delattr(sio.os, "preadv")
    model = _streamed_from(tiny_ckpt, tiny_ckpt, direct_io=direct)
    assert mx.array_equal(_logits(model), tiny_ref).item()
