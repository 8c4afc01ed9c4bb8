"""Recorded checksums (``kimi_k3.checkpoint.checksums``): recorded once, checked on every
load, never re-trusted from a changed file; the ``--no-verify`` switch of both commands."""

from __future__ import annotations

import json
import os
import shutil
import struct

import mlx.core as mx
import pytest

from kimi_k3.checkpoint import checksums
from kimi_k3.checkpoint.files import CheckpointError, CheckpointIndex
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.generate import main as generate_main

NAME = "language_model.model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    """A private copy of the tiny checkpoint without recorded checksums."""
    out = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    (out / checksums.NAME).unlink(missing_ok=True)
    return out


def _shard(path):
    (shard,) = path.glob("model-*.safetensors")
    return shard


def _flip(file, offset: int, keep_mtime: bool = True):
    st = file.stat()
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x40
    file.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_recorded_once_beside_the_checkpoint(ckpt, capsys):
    load_model(ckpt)
    assert "recording checksums of 1 files" in capsys.readouterr().err
    doc = json.loads((ckpt / checksums.NAME).read_text())
    entry = doc["files"][_shard(ckpt).name]
    index = CheckpointIndex(ckpt)
    assert (entry["bytes"], entry["mtime_ns"]) == checksums.stamp(_shard(ckpt))
    assert entry["tensors"].keys() == index.tensors.keys()
    load_model(ckpt)
    assert capsys.readouterr().err == ""  # read, not recorded again


def test_flipped_dense_byte_is_named_unless_verification_is_off(ckpt):
    load_model(ckpt)
    _flip(_shard(ckpt), CheckpointIndex(ckpt)[NAME].start + 5)  # same size, same mtime
    with pytest.raises(CheckpointError, match=rf"{_shard(ckpt)}: tensor {NAME} does not match"):
        load_model(ckpt)
    load_model(ckpt, verify_checksums=False)  # the off switch reads what is there


def test_touched_file_is_rechecked_and_restamped(ckpt, capsys):
    load_model(ckpt, dtype=mx.float32)
    shard = _shard(ckpt)
    os.utime(shard, ns=(1, 10**18))  # same bytes, another mtime
    load_model(ckpt, dtype=mx.float32)
    assert "checking 1 files against the checksums" in capsys.readouterr().err
    entry = json.loads((ckpt / checksums.NAME).read_text())["files"][shard.name]
    assert entry["mtime_ns"] == 10**18


def test_changed_file_is_never_re_trusted(ckpt):
    load_model(ckpt)
    shard = _shard(ckpt)
    _flip(shard, CheckpointIndex(ckpt)[NAME].start, keep_mtime=False)
    for _ in range(2):  # the manifest keeps the old checksums: refused every time
        with pytest.raises(CheckpointError, match=rf"{shard}: tensor {NAME} does not match"):
            load_model(ckpt)
    (ckpt / checksums.NAME).unlink()  # the user's way to record anew
    load_model(ckpt)


def test_resized_file_is_refused(ckpt):
    load_model(ckpt)
    shard = _shard(ckpt)
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n] + b" " * 8  # the same tensors behind a longer header
    shard.write_bytes(struct.pack("<Q", n + 8) + header + raw[8 + n :])
    with pytest.raises(CheckpointError, match=rf"{shard}: {len(raw) + 8} bytes, but {len(raw)}"):
        load_model(ckpt)


def test_read_only_checkpoint_keeps_them_in_the_cache(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "cache"))
    real = checksums.write_manifest

    def read_only(file, sums):
        if file.parent == ckpt:
            raise PermissionError(13, "Permission denied", str(file))
        real(file, sums)

    monkeypatch.setattr(checksums, "write_manifest", read_only)
    load_model(ckpt)
    assert not (ckpt / checksums.NAME).exists()
    (cached,) = (tmp_path / "cache" / "checksums").glob("*.json")
    capsys.readouterr()
    _flip(_shard(ckpt), CheckpointIndex(ckpt)[NAME].start + 1)
    with pytest.raises(CheckpointError, match=rf"does not match its checksum recorded in {cached}"):
        load_model(ckpt)
    assert "recording" not in capsys.readouterr().err


def test_damaged_manifest_is_named(ckpt):
    load_model(ckpt)
    (ckpt / checksums.NAME).write_text('{"format": "kimi-k3-checksums", "version": 1}')
    with pytest.raises(CheckpointError, match=rf"{ckpt / checksums.NAME}: not a kimi-k3-checksums"):
        load_model(ckpt)


def test_generate_no_verify(ckpt, capsys):
    load_model(ckpt)
    _flip(_shard(ckpt), CheckpointIndex(ckpt)[NAME].start + 3)
    argv = ["--model", str(ckpt), "--prompt", "Hi", "--max-tokens", "2"]
    assert generate_main(argv) == 1
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("error:")]
    assert len(errors) == 1 and f"tensor {NAME} does not match" in errors[0]
    assert generate_main([*argv, "--no-verify"]) == 0


def test_server_passes_no_verify(tiny_ckpt, monkeypatch):
    import kimi_k3.server as server

    seen = []

    def fake_load(path, expert_cache_gb, verify, plan=None, **trimming):
        seen.append(verify)
        raise CheckpointError("stop here")

    monkeypatch.setattr(server, "load_for_cli", fake_load)
    for flag, want in (([], True), (["--no-verify"], False)):
        assert server.main(["--model", str(tiny_ckpt), "--port", "0", *flag]) == 1
        assert seen.pop() is want
