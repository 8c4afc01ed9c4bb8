"""The expert pack format: layout arithmetic, round trips, checksums, clear errors."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from kimi_k3.checkpoint.expert_pack import (
    ALIGN,
    TENSORS,
    ExpertPack,
    PackError,
    RecordLayout,
    is_pack_dir,
    plan_files,
    source_name,
    write_pack,
)
from kimi_k3.checkpoint.files import CheckpointError


def _expert(rng, inter: int, dim: int) -> dict:
    out = {}
    for w, (o, i) in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
        out[f"{w}.weight_packed"] = rng.integers(0, 256, (o, i // 2), dtype=np.uint8)
        out[f"{w}.weight_scale"] = rng.integers(0, 256, (o, i // 32), dtype=np.uint8)
    return out


@pytest.fixture
def experts():
    rng = np.random.default_rng(0)
    # Two layers with different (awkward) shapes: records are not page multiples.
    return {
        1: [_expert(rng, 32, 96) for _ in range(5)],
        3: [_expert(rng, 64, 160) for _ in range(4)],
    }


def test_k3_record_is_page_aligned():
    shapes = {
        "w1.weight_packed": (3072, 1792),
        "w1.weight_scale": (3072, 112),
        "w2.weight_packed": (3584, 1536),
        "w2.weight_scale": (3584, 96),
        "w3.weight_packed": (3072, 1792),
        "w3.weight_scale": (3072, 112),
    }
    lay = RecordLayout.from_published(shapes)
    assert lay.data_bytes == lay.record_bytes == 17_547_264  # docs/model.md: one expert
    assert lay.tensors["w1.weight"]["shape"] == [3072, 448]  # uint32 view [I, D/8]
    assert lay.tensors["w2.scales"]["shape"] == [3584, 96]
    assert [t["offset"] for t in lay.tensors.values()] == sorted(
        t["offset"] for t in lay.tensors.values()
    )


def test_layout_rejects_bad_scale_shape():
    shapes = {
        "w1.weight_packed": (8, 16),
        "w1.weight_scale": (8, 2),
        "w2.weight_packed": (16, 4),
        "w2.weight_scale": (16, 1),
        "w3.weight_packed": (8, 16),
        "w3.weight_scale": (8, 1),
    }
    with pytest.raises(PackError, match=r"layer 7: expert tensor w1.weight_scale .*\[8, 1\]"):
        RecordLayout.from_published(shapes, "layer 7")


def test_plan_files_bounds_size_and_keeps_records_whole():
    lay = RecordLayout.from_published(
        {k: v.shape for k, v in _expert(np.random.default_rng(0), 32, 64).items()}
    )
    files = plan_files({1: (lay, 5), 2: (lay, 6)}, file_bytes=3 * ALIGN)
    assert [len(f) for f in files] == [3, 3, 3, 2]
    assert [r for f in files for r in f] == [(1, e) for e in range(5)] + [(2, e) for e in range(6)]
    # A file bound smaller than a record still makes progress: one record per file.
    assert len(plan_files({1: (lay, 5)}, file_bytes=1)) == 5


def test_round_trip(tmp_path, experts):
    write_pack(tmp_path, experts, file_bytes=5 * ALIGN)
    assert is_pack_dir(tmp_path) and is_pack_dir(tmp_path / "experts")
    assert not is_pack_dir(tmp_path / "experts" / "nothing")
    pack = ExpertPack(tmp_path)
    assert pack.layers == [1, 3] and pack.num_experts(1) == 5 and pack.num_experts(3) == 4
    assert len(pack.files) > 1
    for layer, ex in experts.items():
        for e, want in enumerate(ex):
            file, offset, nbytes = pack.record(layer, e)
            assert offset % ALIGN == 0 and file.stat().st_size % ALIGN == 0
            raw = file.read_bytes()[offset : offset + nbytes]
            assert raw == b"".join(want[source_name(t)].tobytes() for t in TENSORS)
            got = pack.read(layer, e, verify=True)
            for name in TENSORS:
                assert got[name].view(np.uint8).tobytes() == want[source_name(name)].tobytes()
            assert got["w1.weight"].dtype == np.uint32 and got["w2.scales"].dtype == np.uint8
    stacked = pack.read_layer(3)
    assert stacked["w2.weight"].shape == (4, 160, 8)
    assert stacked["w3.scales"][2].tobytes() == experts[3][2]["w3.weight_scale"].tobytes()
    assert pack.verify() == 9


def test_flipped_byte_is_named(tmp_path, experts):
    write_pack(tmp_path, experts, file_bytes=5 * ALIGN)
    pack = ExpertPack(tmp_path)
    file, offset, nbytes = pack.record(3, 2)
    data = bytearray(file.read_bytes())
    data[offset + nbytes // 2] ^= 0x10
    file.write_bytes(bytes(data))
    with pytest.raises(PackError, match=rf"{file.name}: checksum mismatch .*layer 3 expert 2"):
        ExpertPack(tmp_path).verify()
    with pytest.raises(PackError, match="layer 3 expert 2"):
        ExpertPack(tmp_path).read(3, 2, verify=True)
    ExpertPack(tmp_path).read(3, 1, verify=True)  # its neighbours are fine


def test_truncated_and_missing_files(tmp_path, experts):
    write_pack(tmp_path, experts, file_bytes=5 * ALIGN)
    pack = ExpertPack(tmp_path)
    last, offset, _ = pack.record(3, 3)
    with open(last, "r+b") as f:
        f.truncate(offset + 100)
    with pytest.raises(PackError, match=rf"{last.name}: truncated: layer 3 expert 3"):
        ExpertPack(tmp_path).read(3, 3)
    with pytest.raises(PackError, match=rf"{last.name}: .* bytes, the index says"):
        ExpertPack(tmp_path).verify()
    first, _, _ = pack.record(1, 0)
    first.unlink()
    with pytest.raises(PackError, match=rf"{first.name}: expert pack file is missing"):
        ExpertPack(tmp_path).read(1, 0)


def test_bad_index_and_lookups(tmp_path, experts):
    write_pack(tmp_path, experts)
    pack = ExpertPack(tmp_path)
    with pytest.raises(PackError, match="layer 2 has no routed experts"):
        pack.record(2, 0)
    with pytest.raises(PackError, match="layer 1 has no expert 5"):
        pack.read(1, 5)
    index = tmp_path / "experts" / "index.json"
    doc = json.loads(index.read_text())
    index.write_text(json.dumps(dict(doc, version=99)))
    with pytest.raises(PackError, match=r"index.json: format .* version 99"):
        ExpertPack(tmp_path)
    index.write_text("{not json")
    with pytest.raises(PackError, match="index.json: not valid JSON"):
        ExpertPack(tmp_path)
    with pytest.raises(PackError, match="no expert pack index"):
        ExpertPack(tmp_path / "elsewhere")


def _in_thread(fn, timeout: float | None = None) -> tuple[list, float]:
    """Run ``fn`` in a daemon thread (so a blocked open cannot hang the suite), waiting at
    most ``timeout`` seconds: ``([its exception or None], seconds)``, or ``([], seconds)``
    where it is still running."""
    out = []

    def run():
        try:
            fn()
            out.append(None)
        except Exception as e:
            out.append(e)

    t0 = time.perf_counter()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return out, time.perf_counter() - t0


def _within(baseline: float, fn):
    """``fn()``'s exception (or None), failing the test if it blocks: it must end within
    1000 times ``baseline``, what the same call on regular files (which reads more) took in a
    thread in this run."""
    out, seconds = _in_thread(fn, 1000 * baseline)
    assert out, f"blocked for {seconds:.3f} s (the call on regular files: {baseline:.6f} s)"
    return out[0]


def _baseline(fn) -> float:
    """Seconds ``fn()`` takes in a thread; it must succeed."""
    out, seconds = _in_thread(fn)
    assert out == [None], out
    return seconds


def test_index_and_pack_files_must_be_regular(tmp_path, experts):
    """A FIFO as the pack's index or as a pack file: refused by name, without blocking."""
    write_pack(tmp_path, experts)
    pack_file, _, _ = ExpertPack(tmp_path).record(1, 0)
    read = lambda: ExpertPack(tmp_path).read(1, 0)  # noqa: E731
    read_s, open_s = _baseline(read), _baseline(lambda: ExpertPack(tmp_path))
    pack_file.unlink()
    os.mkfifo(pack_file)
    e = _within(read_s, read)
    assert isinstance(e, CheckpointError), e
    assert str(e) == f"{pack_file}: a named pipe (FIFO), not a regular file"
    index = tmp_path / "experts" / "index.json"
    index.unlink()
    os.mkfifo(index)
    assert is_pack_dir(tmp_path)
    e = _within(open_s, lambda: ExpertPack(tmp_path))
    assert isinstance(e, CheckpointError), e
    assert str(e) == f"{index}: a named pipe (FIFO), not a regular file"
