"""``python -m kimi_k3.convert``: outputs load and match, resumption is byte-identical,
bad input and corrupted output are named, and memory stays bounded."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import convert_log, tree_bytes
from mlx.utils import tree_flatten

from kimi_k3.checkpoint import checksums
from kimi_k3.checkpoint.expert_pack import TENSORS, ExpertPack, source_name
from kimi_k3.checkpoint.files import CheckpointError, CheckpointIndex, ShardWriter
from kimi_k3.checkpoint.layouts import detect
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.convert.convert import (
    KILL_ENV,
    MANIFEST,
    STATE,
    ConvertError,
    Settings,
    verify_output,
)
from kimi_k3.convert.convert import main as convert_main
from kimi_k3.convert.synth import write_checkpoint

TOKENS = mx.array([[1, 5, 9, 100, 7, 3, 44, 2, 900, 17, 64]])
SMALL = Settings(shard_bytes=50_000, pack_file_bytes=20_000)  # several files of each kind


def _rel(a: mx.array, b: mx.array) -> float:
    return float(mx.linalg.norm(a - b) / mx.linalg.norm(b))


@pytest.fixture(scope="module")
def converted(tiny_ckpt, tmp_path_factory):
    """``converted(bits)`` -> the tiny checkpoint converted at that dense width (cached)."""
    made = {}

    def make(bits: int) -> Path:
        if bits not in made:
            out = tmp_path_factory.mktemp(f"conv{bits}") / "out"
            convert_log(
                tiny_ckpt, out, Settings(bits, 64, SMALL.shard_bytes, SMALL.pack_file_bytes)
            )
            made[bits] = out
        return made[bits]

    return make


def test_dense16_gives_identical_logits_and_bit_exact_experts(tiny_ckpt, converted):
    out = converted(16)
    assert detect(out) == "pack" and (out / MANIFEST).is_file() and not (out / STATE).exists()
    want = load_model(tiny_ckpt, dtype=mx.float32)(TOKENS)
    got = load_model(out, dtype=mx.float32)(TOKENS)
    assert mx.array_equal(want, got)
    src, pack = CheckpointIndex(tiny_ckpt), ExpertPack(out)
    assert len(pack.files) > 1
    for layer in pack.layers:
        for e in range(pack.num_experts(layer)):
            record = pack.read(layer, e)
            base = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}."
            for name in TENSORS:
                raw = src.read_numpy(base + source_name(name))
                assert record[name].tobytes() == raw.tobytes()
    for f in ("tiktoken.model", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (tiny_ckpt / f).read_bytes()


def _fake_quantized(src: Path, bits: int) -> nn.Module:
    """The original model with each weight the predicate picks replaced by its dequantized
    affine quantization (from the bf16 weights), computed in fp32."""
    model = load_model(src, dtype=mx.bfloat16)
    for path, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        want = model.quant_predicate(path, m) if "weight" in m else False
        spec = {"group_size": 64, "bits": bits, **(want if isinstance(want, dict) else {})}
        if not want or m.weight.ndim != 2 or m.weight.shape[-1] % spec["group_size"]:
            continue
        q, s, b = mx.quantize(m.weight, spec["group_size"], spec["bits"])
        m.weight = mx.dequantize(
            q, s.astype(mx.float32), b.astype(mx.float32), spec["group_size"], spec["bits"]
        )
    model.update(
        nn.utils.tree_map(
            lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
            model.parameters(),
        )
    )
    return model


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_dense_matches_in_memory_quantization(tiny_ckpt, converted, bits):
    out = converted(bits)
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert (q["group_size"], q["bits"], q["mode"]) == (64, bits, "affine")
    gate = "language_model.model.layers.1.block_sparse_moe.gate"
    assert q[gate] == {"group_size": 64, "bits": 8, "mode": "affine"}  # the router: 8-bit
    assert q["language_model.model.layers.0.self_attn.f_b_proj"] is False  # 16 inputs < group
    model = load_model(out, dtype=mx.float32)
    assert isinstance(model.language_model.lm_head, nn.QuantizedLinear)
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(model.layers[0].self_attn.f_b_proj, nn.Linear)
    weights = CheckpointIndex(out).tensors
    assert not any(
        k.endswith((".scales", ".biases")) and ("_res" in k or "conv1d" in k) for k in weights
    )
    got = model(TOKENS)
    assert _rel(got, _fake_quantized(tiny_ckpt, bits)(TOKENS)) < 1e-5


def test_chunk_size_does_not_change_the_output(tiny_ckpt, converted, tmp_path):
    convert_log(
        tiny_ckpt,
        tmp_path / "o",
        Settings(4, 64, SMALL.shard_bytes, SMALL.pack_file_bytes),
        chunk_bytes=1000,
        workers=3,
    )
    assert tree_bytes(tmp_path / "o") == tree_bytes(converted(4))


@pytest.mark.slow
def test_killed_conversion_resumes_to_identical_bytes(tiny_ckpt, converted, tmp_path):
    out = tmp_path / "o"
    cmd = [
        sys.executable,
        "-m",
        "kimi_k3.convert",
        "--hf-path",
        str(tiny_ckpt),
        "--out",
        str(out),
        "--dense-bits",
        "4",
        "--shard-mb",
        str(SMALL.shard_bytes / 2**20),
        "--pack-file-mb",
        str(SMALL.pack_file_bytes / 2**20),
        "--workers",
        "1",
    ]
    killed = subprocess.run(
        cmd, env={**os.environ, KILL_ENV: "300000"}, capture_output=True, text=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / MANIFEST).exists()
    done = json.loads((out / STATE).read_text())["done"]
    kept = {rel: (out / rel).stat() for rel in done}
    resumed = subprocess.run(cmd, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming: {len(done)} of" in resumed.stderr
    assert "ETA" in resumed.stderr and "KB /" in resumed.stderr
    for rel, st in kept.items():  # complete files are not rewritten
        now = (out / rel).stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert tree_bytes(out) == tree_bytes(converted(4))
    large = list(out.glob("model-*.safetensors")) + list(out.glob("experts/*.pack"))
    assert 0 < len(done) < len(large)
    assert "already converted" in convert_log(tiny_ckpt, out, Settings(4, 64, *_sizes()))


def _sizes():
    return SMALL.shard_bytes, SMALL.pack_file_bytes


def _flip(file: Path, offset: int):
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    file.write_bytes(bytes(data))


def test_verify_catches_flipped_bytes(converted, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(converted(16), out)
    assert verify_output(out, stream=io.StringIO()) > 0
    pack = ExpertPack(out)
    file, offset, nbytes = pack.record(2, 5)
    _flip(file, offset + 3)
    with pytest.raises(
        CheckpointError,
        match=rf"{file.name}: checksum mismatch .*layer 2 "
        r"expert 5",
    ):
        verify_output(out, stream=io.StringIO())
    assert convert_main(["--hf-path", "unused", "--out", str(out), "--verify"]) == 1
    _flip(file, offset + 3)
    _flip(file, offset + nbytes + 1)  # the record's zero padding: only the sha256 sees it
    with pytest.raises(CheckpointError, match=rf"{file.name}: sha256 does not match"):
        verify_output(out, stream=io.StringIO())
    _flip(file, offset + nbytes + 1)
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    _flip(shard, shard.stat().st_size - 5)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: sha256 does not match"):
        verify_output(out, stream=io.StringIO())


def test_cli_verify_after_convert(tiny_ckpt, tmp_path, capsys):
    rc = convert_main(
        ["--hf-path", str(tiny_ckpt), "--out", str(tmp_path / "o"), "--dense-bits", "8", "--verify"]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "verified" in err and "peak RSS" in err


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupted_input_is_named(tiny_ckpt, tmp_path, capsys):
    bad = _copy(tiny_ckpt, tmp_path / "trunc")
    shard = sorted(bad.glob("model-*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    assert convert_main(["--hf-path", str(bad), "--out", str(tmp_path / "o1")]) == 1
    assert f"{shard.name}: truncated" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists()  # nothing written before the source checks out

    bad = _copy(tiny_ckpt, tmp_path / "header")
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff\xfe{["
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupted safetensors header"):
        convert_log(bad, tmp_path / "o2", SMALL)

    name = "language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight_scale"
    bad = _rewrite(tiny_ckpt, tmp_path / "missing", lambda k, a: None if k == name else a)
    with pytest.raises(CheckpointError, match=rf"tensor {name} is missing"):
        convert_log(bad, tmp_path / "o3", SMALL)
    bad = _rewrite(tiny_ckpt, tmp_path / "shape", lambda k, a: a[:-1] if k == name else a)
    with pytest.raises(
        CheckpointError,
        match=rf"tensor {name} is U8\[31, 2\], expected "
        r"U8\[32, 2\]",
    ):
        convert_log(bad, tmp_path / "o4", SMALL)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` with ``edit(name, array)`` applied (None drops it)."""
    index = CheckpointIndex(src)
    writer = ShardWriter(dst)
    for name, info in index.tensors.items():
        a = edit(name, index.read_numpy(name))
        if a is not None:
            writer.add(name, a, info.dtype)
    writer.close()
    for f in src.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    return dst


def test_refuses_foreign_or_mismatched_output(tiny_ckpt, converted, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConvertError, match="exists and is not empty"):
        convert_log(tiny_ckpt, tmp_path / "busy", SMALL)
    with pytest.raises(ConvertError, match="another source or with other settings"):
        convert_log(tiny_ckpt, converted(16), Settings(8, 64, *_sizes()))
    with pytest.raises(ConvertError, match="'pack' layout"):
        convert_log(converted(16), tmp_path / "again", SMALL)


@pytest.mark.slow
def test_memory_stays_bounded(tmp_path):
    """A ~300 MB checkpoint converts in well under 64 MB above the interpreter's baseline."""
    src = write_checkpoint(
        tmp_path / "src",
        "small",
        tokenizer=False,
        shard_mb=64,
        num_experts=128,
        moe_intermediate_size=512,
        routed_expert_hidden_size=512,
        vocab_size=32768,
    )
    size = sum(f.stat().st_size for f in src.iterdir())
    limit_mb = 64
    assert size > 4 * (limit_mb << 20)
    script = (
        "import json, sys\n"
        "from kimi_k3.convert.convert import main, peak_rss_mb\n"
        "base = peak_rss_mb()\n"
        "rc = main(sys.argv[1:])\n"
        "print(json.dumps({'rc': rc, 'base': base, 'peak': peak_rss_mb()}))\n"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "--hf-path",
            str(src),
            "--out",
            str(tmp_path / "out"),
            "--chunk-mb",
            "4",
            "--workers",
            "2",
            "--pack-file-mb",
            "32",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["rc"] == 0
    assert r["peak"] - r["base"] < limit_mb, r


def test_copies_no_code_and_checks_its_dense_shards(tiny_ckpt, tmp_path):
    """Only what a checkpoint needs is copied (a source's ``*.py`` never is); the dense
    shards' crc32, taken as they are written, are checked at the first load."""
    src = _copy(tiny_ckpt, tmp_path / "src")
    (src / "modeling_kimi.py").write_text("raise SystemExit('never run, never copied')\n")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    out = tmp_path / "out"
    convert_log(src, out, Settings(16, 64, SMALL.shard_bytes, SMALL.pack_file_bytes))
    assert not list(out.glob("*.py"))
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    sums = json.loads((out / checksums.NAME).read_text())["files"]
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert sorted(sums) == shards and all(e["mtime_ns"] is None for e in sums.values())
    index = CheckpointIndex(out)
    name = "language_model.model.layers.1.self_attn.q_proj.weight"
    t = index[name]
    data = bytearray(t.file.read_bytes())
    data[t.start] ^= 1  # a bad write: same size
    t.file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{t.file}: tensor {name} does not match"):
        load_model(out)
