"""Faults while streaming: a clear error naming the file and the expert, no hang, and the
model goes on (bit-exact) once the file is back."""

import errno
import os
import shutil
import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import published_experts

import kimi_k3.streaming.io as sio
from kimi_k3.checkpoint.expert_pack import write_pack
from kimi_k3.checkpoint.files import CheckpointIndex
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.model.config import ModelArgs
from kimi_k3.streaming import ExpertReadError, attach_streamer, clear_cache, get_stats
from kimi_k3.streaming.sources import expert_bytes, expert_shapes

PROMPT = mx.array(np.random.default_rng(5).integers(0, 700, (1, 8)))
WHO = r"layer \d+ expert \d+"


def _min_gb(args) -> float:
    layers = args.num_hidden_layers - args.first_k_dense_replace
    return layers * args.num_experts_per_token * expert_bytes(expert_shapes(args)) / 1e9


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    out = load_model(tiny_ckpt, dtype=mx.float32)(PROMPT)
    mx.eval(out)
    return out


@pytest.fixture
def streamed(tiny_ckpt, tmp_path):
    """A private copy of the tiny checkpoint, streamed with top-k slots per layer."""
    path = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    args = ModelArgs.from_path(path)
    model = load_model(path, dtype=mx.float32, expert_cache_gb=_min_gb(args), read_timeout=5.0)
    (shard,) = CheckpointIndex(path).files
    return model, shard


def _fails(model, match):
    """The next call (on an empty cache) raises ``ExpertReadError`` matching ``match``,
    within the read timeout (no hang)."""
    clear_cache(model)
    with pytest.raises(ExpertReadError, match=match):
        mx.eval(model(PROMPT))


def _recovers(model, reference):
    clear_cache(model)
    assert mx.array_equal(model(PROMPT), reference).item()


def test_truncated_shard(streamed, reference, tmp_path):
    model, shard = streamed
    _recovers(model, reference)
    backup = shutil.copy2(shard, tmp_path / "backup")
    os.truncate(shard, shard.stat().st_size // 2)
    _fails(model, rf"{shard}: changed while streaming \({WHO}\)")
    shutil.copy2(backup, shard)  # same bytes, same mtime: the original is back
    _recovers(model, reference)


def test_shard_deleted_mid_run(streamed, reference, tmp_path):
    model, shard = streamed
    _recovers(model, reference)
    os.rename(shard, tmp_path / "moved")
    _fails(model, rf"{shard}: file vanished while streaming \({WHO}\)")
    os.rename(tmp_path / "moved", shard)
    _recovers(model, reference)


def test_shard_replaced_by_a_directory(streamed, reference, tmp_path):
    """Unreadable even for root: the path is now a directory."""
    model, shard = streamed
    os.rename(shard, tmp_path / "moved")
    os.mkdir(shard)
    _fails(model, rf"{shard}: no longer a regular file \({WHO}\)")
    os.rmdir(shard)
    os.rename(tmp_path / "moved", shard)
    _recovers(model, reference)


def test_io_error(streamed, reference, monkeypatch):
    model, shard = streamed
    real = os.preadv

    def eio(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sio.os, "preadv", eio)
    _fails(model, rf"{shard}: I/O error reading {WHO} \(bytes \d+\.\.\d+\): .*Input/output")
    monkeypatch.setattr(sio.os, "preadv", real)
    _recovers(model, reference)


def test_stuck_read_times_out_and_later_recovers(tiny_ckpt, reference, monkeypatch):
    """A read that never answers: ``read_timeout`` turns it into an error; its slot stays
    held until the read ends, then the model goes on."""
    model = load_model(tiny_ckpt, dtype=mx.float32)
    attach_streamer(model, tiny_ckpt, None, _min_gb(model.args), read_timeout=0.5)
    gate, real = threading.Event(), sio._pread_into

    def stuck(*args):
        gate.wait(30)
        return real(*args)

    monkeypatch.setattr(sio, "_pread_into", stuck)
    # Without the timeout the read would answer after 30 s and no error would be raised.
    with pytest.raises(ExpertReadError, match=rf"no answer after 0\.5 s reading {WHO}"):
        mx.eval(model(PROMPT))
    monkeypatch.setattr(sio, "_pread_into", real)
    gate.set()
    _recovers(model, reference)


@pytest.mark.parametrize("fault", ["failed", "stuck"])
def test_overflow_area_read_faults(tiny_ckpt, reference, monkeypatch, fault):
    """Reads into the overflow area (top-k slots, the prefill's other misses in the area)
    that fail or never answer: the call raises the read's error; a stuck read keeps the
    area out of use (calls read in rounds, bit-exact) until it ends; then the area serves
    again, bit-exact."""
    model = load_model(tiny_ckpt, dtype=mx.float32)
    args = model.args
    streamer = attach_streamer(
        model, tiny_ckpt, None, _min_gb(args), read_timeout=0.5, overflow_experts=args.num_experts
    )
    area = list(streamer.overflow.views.values())
    gate, real = threading.Event(), sio.read_job

    def faulty(job, *rest):
        if any(np.shares_memory(d, a) for d in job.dest.values() for a in area):
            if fault == "stuck":
                gate.wait(30)
            else:
                raise ExpertReadError(f"{job.extents[0].file}: reading {job.what} failed")
        return real(job, *rest)

    monkeypatch.setattr(sio, "read_job", faulty)
    want = rf"failed|no answer after 0\.5 s reading {WHO}"
    with pytest.raises(ExpertReadError, match=want):
        mx.eval(model(PROMPT))
    if fault == "stuck":
        served = get_stats(model)["overflow_misses"]
        _recovers(model, reference)  # in rounds: the area waits for its read
        assert not streamer._overflow_free()
        assert get_stats(model)["overflow_misses"] == served
        gate.set()
        assert all(j.done.wait(5) for j in streamer.overflow_reads)
    monkeypatch.setattr(sio, "read_job", real)
    served = get_stats(model)["overflow_misses"]
    _recovers(model, reference)
    assert streamer._overflow_free() and get_stats(model)["overflow_misses"] > served


def _flip_in_place(file, offsets):
    """Flip one byte at each offset, keeping the file's size and mtime."""
    st = file.stat()
    data = bytearray(file.read_bytes())
    for offset in offsets:
        data[offset] ^= 0xFF
    file.write_bytes(bytes(data))
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_corrupted_pack_record_fails_its_checksum(tiny_ckpt, reference, tmp_path):
    """Default settings: every record read is checked against the pack's crc32."""
    experts = published_experts(tiny_ckpt)
    pack_dir = write_pack(tmp_path, experts)
    (pack_file,) = pack_dir.glob("*.pack")
    model = load_model(tiny_ckpt, dtype=mx.float32)
    attach_streamer(model, tmp_path, None, _min_gb(model.args))
    _recovers(model, reference)
    source = model.layers[1].block_sparse_moe.experts.streamer.source
    offsets = [source.extents(1, e)[0].offset + 100 for e in range(len(experts[1]))]
    _flip_in_place(pack_file, offsets)  # one flipped byte in every layer-1 record
    _fails(model, rf"{pack_file}: checksum mismatch for layer 1 expert \d+ .*corrupted")
    _flip_in_place(pack_file, offsets)
    _recovers(model, reference)


def test_corrupted_published_expert_fails_its_recorded_checksum(streamed, reference):
    """Default settings, published shards: each expert read is checked against the crc32
    recorded at the first load; ``verify_checksums=False`` reads the damaged bytes as they are."""
    model, shard = streamed
    _recovers(model, reference)
    source = model.layers[1].block_sparse_moe.experts.streamer.source
    offsets = [source.extents(1, e)[0].offset + 7 for e in range(model.args.num_experts)]
    _flip_in_place(shard, offsets)  # in every layer-1 expert's w1.weight
    _fails(model, rf"{shard}: checksum mismatch for layer 1 expert \d+ \(tensor w1\.weight, bytes")
    unchecked = load_model(
        shard.parent, mx.float32, expert_cache_gb=_min_gb(model.args), verify_checksums=False
    )
    assert not mx.array_equal(unchecked(PROMPT), reference).item()
    _flip_in_place(shard, offsets)
    _recovers(model, reference)
