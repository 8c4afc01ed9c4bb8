"""Damaged and hostile checkpoints: a seeded fuzz of shard headers (100 cases), configs (28)
and shard indexes (15). Every case is one ``CheckpointError``/``ConfigError`` naming the
file (and the key), or a load whose parameters are bit-identical to the clean checkpoint's;
any other exception, or a load that differs, fails."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import kimi_k3
from kimi_k3.checkpoint.files import CheckpointError, load_json, read_capped
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.generate import main as generate_main
from kimi_k3.model.config import ConfigError

SAME_SIZE = {
    "BF16": ["F16", "U16", "I16"],
    "F32": ["I32", "U32"],
    "U8": ["I8", "BOOL", "F8_E4M3"],
}


@pytest.fixture(scope="module")
def work(tiny_ckpt, tmp_path_factory):
    """A private copy of the tiny checkpoint, its checksums recorded, and the clean load."""
    path = shutil.copytree(tiny_ckpt, tmp_path_factory.mktemp("hostile") / "ckpt")
    clean = dict(tree_flatten(load_model(path, dtype=mx.float32).parameters()))
    return path, clean


def _outcome(path, clean, file_name: str, key: str | None = None) -> str:
    """``"error"`` (naming ``file_name`` and ``key``) or ``"identical"``; else the test fails."""
    try:
        model = load_model(path, dtype=mx.float32)
    except (CheckpointError, ConfigError) as e:
        assert file_name in str(e), str(e)
        assert key is None or key in str(e), str(e)
        return "error"
    got = dict(tree_flatten(model.parameters()))
    assert got.keys() == clean.keys()
    for k, v in got.items():
        assert v.dtype == clean[k].dtype and mx.array_equal(v, clean[k]).item(), k
    return "identical"


class Restored:
    """Write damaged bytes to ``file``; put the original bytes and mtime back after."""

    def __init__(self, file):
        self.file, self.data, self.st = file, file.read_bytes(), file.stat()

    def __enter__(self):
        return self.data

    def __exit__(self, *exc):
        self.file.write_bytes(self.data)
        os.utime(self.file, ns=(self.st.st_atime_ns, self.st.st_mtime_ns))


def _split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _dumps(h) -> str:
    return json.dumps(h, separators=(",", ":"))


def _join(header_text: str | bytes, body: bytes, n: int = 0) -> bytes:
    """A file of ``header_text`` padded with spaces to ``n`` bytes if it fits (so the file
    keeps its size and only the checksums can tell), else to a multiple of 8."""
    raw = header_text.encode() if isinstance(header_text, str) else header_text
    raw += b" " * (n - len(raw) if len(raw) <= n else (-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _pick(rng, header, pred=lambda n, m: True) -> str:
    names = sorted(n for n, m in header.items() if n != "__metadata__" and pred(n, m))
    return names[rng.integers(len(names))]


def _nbytes(m) -> int:
    return m["data_offsets"][1] - m["data_offsets"][0]


def _relabel(rng, h, body):
    name = _pick(rng, h, lambda n, m: m["dtype"] in SAME_SIZE)
    alts = SAME_SIZE[h[name]["dtype"]]
    h[name]["dtype"] = alts[rng.integers(len(alts))]
    return _join(json.dumps(h), body)


def _same_size_pair(rng, h):
    """Two tensors of the same byte count whose offsets print as long (so swapping them
    keeps the header's length)."""

    def width(m) -> int:
        return len(str(m["data_offsets"]))

    a = _pick(rng, h, lambda n, m: _nbytes(m) > 0)
    b = _pick(
        rng, h, lambda n, m: n != a and _nbytes(m) == _nbytes(h[a]) and width(m) == width(h[a])
    )
    return a, b


def _overlap(rng, h, body):
    a, b = _same_size_pair(rng, h)
    h[a]["data_offsets"] = list(h[b]["data_offsets"])  # two tensors on the same bytes
    return _join(json.dumps(h), body)


def _swap(rng, h, body, n):
    """A valid header whose two tensors trade bytes: only the checksums can tell."""
    a, b = _same_size_pair(rng, h)
    h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    return _join(_dumps(h), body, n)


def _shift(rng, h, body):
    name = _pick(rng, h, lambda n, m: _nbytes(m) > 0)
    d = int(rng.choice([-2, -1, 1, 2, 8]))
    h[name]["data_offsets"] = [x + d for x in h[name]["data_offsets"]]
    return _join(json.dumps(h), body)


def _duplicate_key(rng, h, body):
    """The name again at the end of the header, pointing at another tensor's bytes."""
    a, b = _same_size_pair(rng, h)
    text = json.dumps(h)[:-1] + f", {json.dumps(a)}: {json.dumps(h[b])}}}"
    return _join(text, body)


def _reshape(rng, h, body):
    name = _pick(rng, h, lambda n, m: len(m["shape"]) == 2 and m["shape"][0] != m["shape"][1])
    h[name]["shape"] = h[name]["shape"][::-1]
    return _join(json.dumps(h), body)


def _resize(rng, h, body):
    name = _pick(rng, h, lambda n, m: len(m["shape"]) >= 1)
    h[name]["shape"][0] += int(rng.choice([-1, 1]))
    return _join(json.dumps(h), body)


def _drop(rng, h, body):
    del h[_pick(rng, h)]
    return _join(json.dumps(h), body)


def _rename(rng, h, body):
    name = _pick(rng, h)
    h[name.replace("layers.", "layers.9", 1) + "x"] = h.pop(name)
    return _join(json.dumps(h), body)


def _deep(rng, h, body):
    depth = int(rng.choice([100, 5000, 200_000]))
    h["__metadata__"] = {"x": "y"}
    text = json.dumps(h)[:-1] + ', "__deep__": ' + "[" * depth + "]" * depth + "}"
    return _join(text, body)


def _metadata(rng, h, body):
    h["__metadata__"] = [{"format": 1}, "x", {"format": {"a": 1}}][rng.integers(3)]
    return _join(json.dumps(h), body)


def _length(rng, h, body):
    text = json.dumps(h).encode()
    text += b" " * ((-len(text)) % 8)
    n = [0, 1, len(text) - 8, len(text) + 8, 1 << 40, (1 << 64) - 1][rng.integers(6)]
    return struct.pack("<Q", n) + text + body


def _flip(rng, h, body, n):
    raw = bytearray(_join(_dumps(h), body, n))
    for _ in range(int(rng.integers(1, 4))):
        raw[8 + rng.integers(n)] = rng.integers(256)
    return bytes(raw)


def _not_utf8(rng, h, body):
    text = json.dumps(h).encode()
    i = int(rng.integers(len(text)))
    return _join(text[:i] + b"\xff\xfe" + text[i + 2 :], body)


def _cut_header(rng, h, body):
    text = json.dumps(h)
    return _join(text[: rng.integers(1, len(text))], body)


def _tail(rng, h, body):
    extra = [b"\0" * 8, b"junk"][rng.integers(2)]
    return _join(json.dumps(h), body[: -len(extra)] if rng.integers(2) else body + extra)


HEADER_CASES = {  # corruption -> cases: 100 in all
    _relabel: 20,
    _overlap: 8,
    _swap: 8,
    _shift: 6,
    _duplicate_key: 8,
    _reshape: 6,
    _resize: 4,
    _drop: 4,
    _rename: 4,
    _deep: 3,
    _metadata: 3,
    _length: 6,
    _flip: 12,
    _not_utf8: 3,
    _cut_header: 3,
    _tail: 2,
}


@pytest.mark.slow
def test_header_fuzz(work):
    path, clean = work
    (shard,) = path.glob("model-*.safetensors")
    rng = np.random.default_rng(37)
    seen = {}
    assert sum(HEADER_CASES.values()) == 100
    for corrupt, n in HEADER_CASES.items():
        for _ in range(n):
            with Restored(shard) as data:
                h, body = _split(data)
                n = len(data) - len(body) - 8
                args = (rng, h, body, n) if corrupt in (_swap, _flip) else (rng, h, body)
                shard.write_bytes(corrupt(*args))
                got = _outcome(path, clean, shard.name)
            seen.setdefault(corrupt.__name__, []).append(got)
    for name in ("_relabel", "_overlap", "_duplicate_key", "_deep", "_swap"):
        assert set(seen[name]) == {"error"}, name  # these can never load as they were


def _set(path: str, value):
    def edit(c):
        *parents, key = path.split(".")
        d = c
        for p in parents:
            d = d[p]
        d[key] = value

    return edit


def _raw(data: bytes):
    return data


CONFIG_CASES = [  # (edit of the parsed config, or raw bytes; the key the error names)
    (_set("text_config.hidden_size", "abc"), "hidden_size"),
    (_set("text_config.hidden_size", 0), "hidden_size"),
    (_set("text_config.hidden_size", -64), "hidden_size"),
    (_set("text_config.hidden_size", 64.5), "hidden_size"),
    (_set("text_config.hidden_size", True), "hidden_size"),
    (_set("text_config.hidden_size", 1 << 40), "hidden_size"),
    (_set("text_config.attn_res_block_size", 0), "attn_res_block_size"),
    (_set("text_config.linear_attn_config", None), "linear_attn_config"),
    (_set("text_config.linear_attn_config.num_heads", "2"), "linear_attn_config.num_heads"),
    (_set("text_config.linear_attn_config.kda_layers", "1,2,4"), "kda_layers"),
    (_set("text_config.linear_attn_config.full_attn_layers", [3.0, 5]), "full_attn_layers"),
    (_set("text_config.linear_attn_config.gate_lower_bound", 2.0), "gate_lower_bound"),
    (_set("text_config.num_experts_per_token", -2), "num_experts_per_token"),
    (_set("text_config.num_experts_per_token", 0), "num_experts_per_token"),
    (_set("text_config.routed_scaling_factor", float("nan")), "routed_scaling_factor"),
    (_set("text_config.routed_scaling_factor", float("inf")), "routed_scaling_factor"),
    (_set("text_config.rms_norm_eps", -1e-5), "rms_norm_eps"),
    (_set("text_config.rms_norm_eps", "1e-5"), "rms_norm_eps"),
    (_set("text_config.vocab_size", None), "vocab_size"),
    (_set("text_config.num_hidden_layers", -1), "num_hidden_layers"),
    (_set("text_config.first_k_dense_replace", 99), "first_k_dense_replace"),
    (_set("text_config.moe_renormalize", "yes"), "moe_renormalize"),
    (_set("eos_token_id", "</s>"), "eos_token_id"),
    (_set("text_config", [1, 2]), "text_config"),
    (_set("quantization_config", "mxfp4"), "quantization_config"),
    (_set("quantization_config.config_groups", [1]), "config_groups"),
    (lambda c: b"\xff\xfe" + json.dumps(c).encode(), None),
    (lambda c: b"[" * 100_000 + b"]" * 100_000, None),
]


def _damage_json(file, edit) -> bytes:
    config = json.loads(file.read_text())
    out = edit(config)
    return out if isinstance(out, bytes) else json.dumps(config).encode()


def test_config_fuzz(work):
    path, clean = work
    file = path / "config.json"
    assert len(CONFIG_CASES) == 28
    for edit, key in CONFIG_CASES:
        with Restored(file):
            file.write_bytes(_damage_json(file, edit))
            assert _outcome(path, clean, "config.json", key) == "error", key


def test_null_config_through_load(work):
    """``kimi_k3.load`` and ``load_model`` run the same checks: a ``null`` config.json."""
    path, _ = work
    file = path / "config.json"
    with Restored(file):
        file.write_text("null")
        for load in (kimi_k3.load, load_model):
            with pytest.raises(ConfigError, match=rf"{file}: not a JSON object"):
                load(path)


def _index_set(key, value):
    def edit(doc):
        if key is None:
            return value
        doc["weight_map"][key] = value

    return edit


def _first(doc) -> str:
    return sorted(doc["weight_map"])[0]


INDEX = "model.safetensors.index.json"
INDEX_CASES = [  # (edit of the parsed index; text the error names besides the file)
    (lambda d: d.update(weight_map=sorted(d["weight_map"])), "weight_map"),
    (lambda d: d.update(weight_map=7), "weight_map"),
    (lambda d: d.update(weight_map="."), "weight_map"),
    (lambda d: d.update(weight_map={}), "weight_map"),
    (lambda d: d.pop("weight_map"), "weight_map"),
    (lambda d: [d], "weight_map"),
    (lambda d: d["weight_map"].update({_first(d): "/etc/passwd"}), "/etc/passwd"),
    (lambda d: d["weight_map"].update({_first(d): "../ckpt/x.safetensors"}), "x.safetensors"),
    (lambda d: d["weight_map"].update({_first(d): "sub/x.safetensors"}), "sub/x.safetensors"),
    (lambda d: d["weight_map"].update({_first(d): "."}), "weight_map"),
    (lambda d: d["weight_map"].update({_first(d): 3}), "weight_map"),
    (lambda d: d["weight_map"].update({_first(d): None}), "weight_map"),
    (lambda d: d["weight_map"].update({_first(d): INDEX}), "weight_map"),
    (lambda d: d["weight_map"].pop(_first(d)), INDEX),
    (lambda d: b'{"weight_map": {"a": "b.safetensors", "a": "c.safetensors"}}', "'a'"),
]


def test_index_fuzz(work, monkeypatch):
    path, clean = work
    file = path / INDEX
    assert len(INDEX_CASES) == 15
    opened, real_open = [], os.open

    def spy(p, *a, **k):
        opened.append(str(p))
        return real_open(p, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    for edit, key in INDEX_CASES:
        with Restored(file):
            doc = json.loads(file.read_text())
            out = edit(doc)
            data = out if isinstance(out, bytes) else json.dumps(doc if out is None else out)
            file.write_bytes(data if isinstance(data, bytes) else data.encode())
            assert _outcome(path, clean, INDEX, key) == "error", key
    assert not any(p.startswith(("/etc", str(path.parent / "x"))) for p in opened)


def test_cli_names_a_relabelled_tensor(work, capsys):
    """The command line's contract: one ``error:`` line naming the shard, exit status 1."""
    path, _ = work
    (shard,) = path.glob("model-*.safetensors")
    with Restored(shard) as data:
        h, body = _split(data)
        name = "language_model.model.layers.1.self_attn.A_log"
        h[name]["dtype"] = "I32"
        shard.write_bytes(_join(json.dumps(h), body))
        assert generate_main(["--model", str(path), "--prompt", "Hi", "--max-tokens", "2"]) == 1
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert out.out == "" and len(errors) == 1, out.err
    assert f"{shard}: tensor {name} is I32" in errors[0]


REPORT_RSS = (
    "import resource, sys; from kimi_k3.generate import main; code = main(sys.argv[1:]); "
    "print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); "
    "sys.exit(code)"
)


def _cli(path, tmp_path, timeout=60) -> tuple[int, list[str], int]:
    """``(exit status, error: lines, peak RSS in KB)`` of the command line on ``path``, run
    as a subprocess so a hang fails (``TimeoutExpired``) instead of blocking the suite."""
    argv = ["--model", str(path), "--prompt", "Hi", "--max-tokens", "2"]
    proc = subprocess.run(
        [sys.executable, "-c", REPORT_RSS, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "KIMI_K3_CACHE": str(tmp_path / "cache")},
    )
    lines = proc.stderr.splitlines()
    assert lines and lines[-1].startswith("maxrss_kb"), proc.stderr
    kb = int(lines[-1].split()[1]) // (1024 if sys.platform == "darwin" else 1)
    return proc.returncode, [line for line in lines if line.startswith("error:")], kb


def _fifo(file):
    os.mkfifo(file)


def _dev_zero(file):
    os.symlink("/dev/zero", file)


def _directory(file):
    file.mkdir()


def _sparse_2gb(file):
    with open(file, "wb") as f:
        f.truncate(2 << 30)  # a hole: no disk used, 2 GiB of zeros when read


SHARD = "model-00001-of-00001.safetensors"
FILE_CASES = [  # (file replaced, what it becomes, the reason the error gives)
    ("config.json", _fifo, "a named pipe (FIFO), not a regular file"),
    (INDEX, _fifo, "a named pipe (FIFO), not a regular file"),
    (SHARD, _fifo, "a named pipe (FIFO), not a regular file"),
    ("tokenizer_config.json", _fifo, "a named pipe (FIFO), not a regular file"),
    ("tiktoken.model", _fifo, "a named pipe (FIFO), not a regular file"),
    ("config.json", _dev_zero, "a character device (a link to /dev/zero)"),
    (INDEX, _dev_zero, "a character device (a link to /dev/zero)"),
    ("config.json", _directory, "a directory, not a regular file"),
    ("config.json", _sparse_2gb, f"{2 << 30} bytes, more than this kind of file may hold"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,make,reason", FILE_CASES, ids=[f"{n}-{m.__name__[1:]}" for n, m, _ in FILE_CASES]
)
def test_cli_refuses_files_that_are_not_regular_or_too_big(tiny_ckpt, tmp_path, name, make, reason):
    """A FIFO, a device, a directory or a 2 GiB config in place of a checkpoint file: one
    ``error:`` line naming it, exit status 1, no hang, and nothing read from it (the peak
    RSS stays far below the 2 GiB the sparse file would take)."""
    path = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    assert (path / name).is_file()
    (path / name).unlink()
    make(path / name)
    code, errors, rss_kb = _cli(path, tmp_path)
    assert code == 1 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: {path / name}: {reason}"), errors
    assert rss_kb < 1 << 20, rss_kb  # under 1 GiB


def test_read_capped_reads_regular_files_through_links(tmp_path):
    """A symlink to a regular file (a Hugging Face cache snapshot) reads as the file."""
    (tmp_path / "blob").write_bytes(b'{"a": 1}')
    (tmp_path / "config.json").symlink_to(tmp_path / "blob")
    assert read_capped(tmp_path / "config.json", 8) == b'{"a": 1}'
    with pytest.raises(CheckpointError, match=r"config.json: 8 bytes, more than .* \(7 bytes\)"):
        read_capped(tmp_path / "config.json", 7)
    with pytest.raises(FileNotFoundError):
        read_capped(tmp_path / "absent.json", 7)


def test_json_depth_is_counted_across_chunks(monkeypatch):
    """``load_json`` scans nesting depth in bounded chunks; depth carries over a boundary."""
    import kimi_k3.checkpoint.files as ckpt

    monkeypatch.setattr(ckpt, "_DEPTH_CHUNK", 7)
    deep = "[" * (ckpt.MAX_JSON_DEPTH + 1) + "]" * (ckpt.MAX_JSON_DEPTH + 1)
    with pytest.raises(ValueError, match=f"nested {ckpt.MAX_JSON_DEPTH + 1} levels deep"):
        load_json(deep)
    ok = '{"a": [' * 20 + "1" + "]}" * 20
    assert load_json(ok) == json.loads(ok)
