"""Lower-bit experts: the formats (``kimi_k3.model.experts.ExpertFormat``), the requantization
from MXFP4 (``kimi_k3.convert.requant``), ``python -m kimi_k3.convert --expert-bits``, and the
converted model resident and streamed (the pure-MLX reference on the CPU; the kernels on it:
tests/test_affine_kernels.py, tests/test_model_kernels.py)."""

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
import numpy as np
import pytest
from conftest import FORMAT_SHAPES, rel_err
from test_streaming import budget_gb

from kimi_k3 import eval as k3eval
from kimi_k3.checkpoint.expert_pack import (
    TENSORS,
    ExpertPack,
    PackError,
    RecordLayout,
    source_name,
)
from kimi_k3.checkpoint.files import CheckpointError, CheckpointIndex
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.convert import requant
from kimi_k3.convert.convert import (
    KILL_ENV,
    MANIFEST,
    STATE,
    ConvertError,
    Settings,
    convert,
    verify_output,
)
from kimi_k3.convert.convert import main as convert_main
from kimi_k3.model.config import ConfigError
from kimi_k3.model.experts import (
    FORMATS,
    MXFP4,
    ExpertFormat,
    expert_glu_reference,
    format_from_json,
    stack_format,
)
from kimi_k3.model.moe import moe_blocks
from kimi_k3.streaming import ExpertReadError, get_stats

TOKENS = mx.array([[1, 5, 9, 100, 7, 3, 44, 2, 900, 17, 64]])
K3 = (3584, 3072)  # latent, hidden


def gaussian_mxfp4(rows: int, cols: int, seed: int = 0):
    """Gaussian weights through MXFP4, as compressed-tensors bytes (packed u8, scales u8)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.02
    q, s = mx.quantize(mx.array(w), group_size=32, bits=4, mode="mxfp4")
    return np.array(q).view(np.uint8), np.array(s)


# --- formats and requantization ----------------------------------------------------------


def test_formats_and_k3_record_sizes():
    assert FORMATS[4] == MXFP4 and str(MXFP4) == "MXFP4"
    assert [(f.mode, f.bits, f.group_size) for f in (FORMATS[3], FORMATS[2])] == [
        ("affine", 3, 64),
        ("affine", 2, 64),
    ]
    sizes = {b: RecordLayout.from_format(f, *K3).data_bytes for b, f in FORMATS.items()}
    assert sizes == {4: 17_547_264, 3: 14_450_688, 2: 10_321_920}
    assert sizes[2] / sizes[4] <= 0.6 and sizes[2] % 4096 == 0  # no padding at K3's size
    assert FORMATS[2].bits_per_weight() == 2.5 and MXFP4.bits_per_weight() == 4.25
    published = {
        "w1.weight_packed": (K3[1], K3[0] // 2),
        "w1.weight_scale": (K3[1], K3[0] // 32),
        "w2.weight_packed": (K3[0], K3[1] // 2),
        "w2.weight_scale": (K3[0], K3[1] // 32),
        "w3.weight_packed": (K3[1], K3[0] // 2),
        "w3.weight_scale": (K3[1], K3[0] // 32),
    }
    assert RecordLayout.from_format(MXFP4, *K3) == RecordLayout.from_published(published)


@pytest.mark.parametrize("bits", [2, 3])
def test_codes_are_packed_as_mlx_packs_them(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (4, 192)).astype(np.uint8)
    packed = requant.pack_codes(codes, bits)
    assert packed.shape == (4, 192 * bits // 32) and packed.dtype == np.uint32
    assert np.array_equal(requant.unpack_codes(packed, bits), codes)
    ones, zeros = mx.ones((4, 3), mx.float32), mx.zeros((4, 3), mx.float32)
    got = mx.dequantize(mx.array(packed), ones, zeros, group_size=64, bits=bits)
    assert np.array_equal(np.array(got), codes.astype(np.float32))


def test_mxfp4_is_decoded_exactly():
    q, s = gaussian_mxfp4(64, 256)
    want = mx.dequantize(
        mx.array(q.view(np.uint32)), mx.array(s), group_size=32, bits=4, mode="mxfp4"
    ).astype(mx.float32)
    assert np.array_equal(requant.dequantize_mxfp4(q, s), np.array(want))


@pytest.mark.parametrize("bits", [2, 3])
def test_the_fit_is_no_worse_than_min_max_and_codes_are_nearest(bits):
    """Every group's squared error is at most that of the min/max grid (mx.quantize's),
    both with float16 scale and bias, and the codes are the nearest levels of the stored
    grid; the whole matrix is clearly better. MLX dequantizes the result to the same values."""
    w = requant.dequantize_mxfp4(*gaussian_mxfp4(96, 512, seed=bits))
    fit = requant.quantize_affine(w, bits, 64)
    base = requant.quantize_affine(w, bits, 64, search="minmax")
    err = [(requant.dequantize_affine(*f, bits) - w).reshape(-1, 64) for f in (fit, base)]
    per_group = [np.square(e).sum(1) for e in err]
    assert np.all(per_group[0] <= per_group[1] * (1 + 1e-3) + 1e-12)
    assert per_group[0].sum() < 0.8 * per_group[1].sum()
    packed, scales, biases = fit
    s, b = (a.astype(np.float64).repeat(64, axis=1) for a in (scales, biases))
    codes = requant.unpack_codes(packed, bits).astype(np.float64)
    here = np.abs(w - (s * codes + b))
    top = (1 << bits) - 1
    for step in (-1, 1):
        other = np.abs(w - (s * np.clip(codes + step, 0, top) + b))
        assert np.all(here <= other + 1e-7)
    mlx = mx.dequantize(*(mx.array(a) for a in fit), group_size=64, bits=bits)  # float16 arithmetic
    assert rel_err(mlx, requant.dequantize_affine(*fit, bits)) < 1e-3


def test_a_matrix_the_format_cannot_hold_is_named():
    q, s = gaussian_mxfp4(64, 128)
    six = {}
    for w in ("w1", "w2", "w3"):
        six[f"{w}.weight_packed"], six[f"{w}.weight_scale"] = q, s.copy()
    six["w2.weight_scale"][3, 1] = 255
    with pytest.raises(CheckpointError, match=r"where\.w2: cannot be requantized .*NaN"):
        requant.requantize_record(six, FORMATS[2], "where")
    six["w2.weight_scale"][3, 1] = 127 + 40  # weights of 2^40: beyond float16
    with pytest.raises(CheckpointError, match=r"where\.w2: .*beyond float16"):
        requant.requantize_record(six, FORMATS[3], "where")


def test_format_entries_are_checked(tmp_path):
    assert format_from_json({"mode": "affine", "bits": 2, "group_size": 64}, "x") == FORMATS[2]
    for bad in ({"mode": "affine", "bits": 4, "group_size": 64}, {"bits": 2}, "2", None):
        with pytest.raises(ValueError, match="x: expert format .* is not one of"):
            format_from_json(bad, "x")


def test_reference_reads_affine_stacks_like_the_dequantized_weights():
    """``expert_glu_reference`` (``gather_qmm``) on requantized stacks against dense fp32
    matmuls of the dequantized weights."""
    w = {
        n: gaussian_mxfp4(*shape, seed=i)
        for i, (n, shape) in enumerate(
            {"w1": (128, 192), "w3": (128, 192), "w2": (192, 128)}.items()
        )
    }
    stacks = requant.requantize_stacks(
        {n: (mx.array(q.view(np.uint32)[None]), mx.array(s[None])) for n, (q, s) in w.items()},
        FORMATS[3],
    )
    assert stack_format(stacks) == FORMATS[3]
    dense = {
        n: requant.dequantize_affine(*(np.array(a[0]) for a in t), 3) for n, t in stacks.items()
    }
    z = np.random.default_rng(5).standard_normal((3, 192)).astype(np.float32)
    inds, wts = mx.zeros((3, 1), mx.int32), mx.ones((3, 1), mx.float32)
    got = expert_glu_reference(mx.array(z), stacks, inds, wts, 4.0, 25.0)
    g, u = z @ dense["w1"].T, z @ dense["w3"].T
    h = 4.0 * np.tanh(g / 4.0) / (1 + np.exp(-g)) * 25.0 * np.tanh(u / 25.0)
    assert rel_err(got, h @ dense["w2"].T) < 1e-5


# --- the converter -------------------------------------------------------------------------


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in ("kimi_k3_checksums.json", MANIFEST)
    }


def _convert(src, out, **settings) -> str:
    log = io.StringIO()
    convert(src, out, Settings(dense_bits=16, **settings), stream=log)
    return log.getvalue()


def test_expert_bits_4_writes_the_published_bytes(ckpt_factory, lower_bit, tmp_path):
    """``--expert-bits 4`` is the default: the pack holds the published MXFP4 bytes, its
    index is version 1 and names no format, the config names none; only the manifest's
    settings record the flag."""
    src = ckpt_factory("tiny", **FORMAT_SHAPES)
    _convert(src, tmp_path / "default")
    out = lower_bit(4)
    assert _files(out) == _files(tmp_path / "default")
    index = json.loads((out / "experts/index.json").read_text())
    assert index["version"] == 1 and "expert_format" not in index
    assert "quantization" not in json.loads((out / "config.json").read_text())
    assert json.loads((out / MANIFEST).read_text())["settings"]["expert_bits"] == 4
    pack, source = ExpertPack(out), CheckpointIndex(src)
    record = pack.read(2, 3)
    for name in TENSORS:
        key = f"language_model.model.layers.2.block_sparse_moe.experts.3.{source_name(name)}"
        assert record[name].tobytes() == source.read_numpy(key).tobytes()


@pytest.mark.parametrize("bits", [3, 2])
def test_lower_bits_load_as_the_model_requantized_in_memory(ckpt_factory, lower_bit, bits):
    """The converted checkpoint (dense weights kept: ``--dense-bits 16``) gives, bit for bit,
    the published checkpoint with its experts requantized in memory; its records hold
    ``requantize``'s arrays of the source tensors, its index and config name the format,
    and it is smaller."""
    fmt = FORMATS[bits]
    src, out = ckpt_factory("tiny", **FORMAT_SHAPES), lower_bit(bits)
    model = load_model(out, dtype=mx.float32)
    moe = next(iter(moe_blocks(model).values()))
    assert moe.experts.format == fmt and stack_format(moe.experts.tensors()) == fmt
    want = requant.requantize_model(load_model(src, dtype=mx.float32), fmt)(TOKENS)
    assert mx.array_equal(model(TOKENS), want).item()
    index = json.loads((out / "experts/index.json").read_text())
    assert index["version"] == 2 and index["expert_format"] == fmt.to_json()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"routed_experts": fmt.to_json()}
    pack, source = ExpertPack(out), CheckpointIndex(src)
    assert pack.format == fmt
    record = pack.read(3, 5, verify=True)
    base = "language_model.model.layers.3.block_sparse_moe.experts.5."
    for w in ("w1", "w2", "w3"):
        q, s = (source.read_numpy(base + f"{w}.{k}") for k in ("weight_packed", "weight_scale"))
        for kind, a in zip(fmt.kinds, requant.requantize(q, s, fmt), strict=True):
            assert np.array_equal(record[f"{w}.{kind}"], a)
    data = [_pack_index(d)[1]["layers"]["1"]["data_bytes"] for d in (out, lower_bit(4))]
    assert data[0] < data[1]  # (tiny records: each still one 4096-byte page or two)


@pytest.mark.parametrize("bits", [3, 2])
def test_streamed_gives_the_resident_bits(lower_bit, bits):
    """Streamed through few slots (a prompt's chunk runs in groups), with an overflow area,
    in both write modes, and trimmed: the resident model's fp32 logits bit for bit."""
    out = lower_bit(bits, num_experts_per_token=4)
    resident = load_model(out, dtype=mx.float32)(TOKENS)
    for slots, overflow, mode in ((4, 0, "view"), (5, 0, "mlx"), (4, 6, "auto")):
        model = load_model(
            out,
            dtype=mx.float32,
            expert_cache_gb=budget_gb(out, slots),
            overflow_experts=overflow,
            write_mode=mode,
        )
        assert mx.array_equal(model(TOKENS), resident).item(), (slots, overflow, mode)
        stats = get_stats(model)
        assert stats["misses"] > 0 and stats["expert_format"] == str(FORMATS[bits])
        assert (
            stats["expert_bytes"]
            == ExpertPack(out).layout(1)["w3.biases"]["offset"]
            + (ExpertPack(out).layout(1)["w3.biases"]["nbytes"])
        )
    trim = dict(expert_top_p=0.5)
    resident = load_model(out, dtype=mx.float32, **trim)(TOKENS)
    streamed = load_model(out, dtype=mx.float32, expert_cache_gb=budget_gb(out, 4), **trim)
    assert mx.array_equal(streamed(TOKENS), resident).item()
    assert get_stats(streamed)["experts_per_token"] < 4


def test_checksums_catch_a_flipped_byte(lower_bit, tmp_path):
    """``--verify`` and the streamer's read check both name the layer and expert of a
    damaged record of a lower-bit pack."""
    out = shutil.copytree(lower_bit(2), tmp_path / "o")
    assert verify_output(out, stream=io.StringIO()) > 0
    pack = ExpertPack(out)
    file, offset, _ = pack.record(2, 5)
    data = bytearray(file.read_bytes())
    data[offset + 100] ^= 1
    file.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=rf"{file.name}: checksum mismatch .*layer 2 expert 5"
    ):
        verify_output(out, stream=io.StringIO())
    model = load_model(out, dtype=mx.float32, expert_cache_gb=budget_gb(out, 8))
    with pytest.raises(ExpertReadError, match=r"layer 2 expert 5"):
        for layer, moe in moe_blocks(model).items():
            if layer == 2:
                moe.experts.streamer.preload(layer, [5])


def test_bad_settings_are_refused(ckpt_factory, lower_bit, tmp_path, capsys):
    src = ckpt_factory("tiny", **FORMAT_SHAPES)
    with pytest.raises(ConvertError, match="holds a conversion from another source or with other"):
        _convert(src, lower_bit(2), expert_bits=3)
    with pytest.raises(ConvertError, match="moe_intermediate_size=32 is not a multiple of 64"):
        _convert(ckpt_factory("tiny"), tmp_path / "o", expert_bits=2)
    with pytest.raises(ConvertError, match="--expert-bits 5: use 4, 3 or 2"):
        _convert(src, tmp_path / "o5", expert_bits=5)
    for bad in ("5", "two", "8"):
        with pytest.raises(SystemExit) as e:
            convert_main(
                ["--hf-path", str(src), "--out", str(tmp_path / "x"), "--expert-bits", bad]
            )
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            e.value.code == 2
            and len(err) == 1
            and err[0].startswith("error: argument --expert-bits")
        )
    assert not (tmp_path / "x").exists()


def test_dry_run_names_the_format_and_its_size(ckpt_factory, capsys):
    src = ckpt_factory("small")  # 128-wide experts: records of whole pages at every width
    sizes = {}
    for bits in (4, 2):
        assert (
            convert_main(
                [
                    "--hf-path",
                    str(src),
                    "--out",
                    "/nonexistent/x",
                    "--dry-run",
                    "--expert-bits",
                    str(bits),
                ]
            )
            == 0
        )
        line = capsys.readouterr().err
        assert f"experts ({FORMATS[bits]})" in line
        sizes[bits] = line.split(f"experts ({FORMATS[bits]}): ")[1].split(";")[0]
    assert sizes == {4: "1 pack files, 4.6 MB", 2: "1 pack files, 2.6 MB"}  # 7 and 4 pages


def test_a_pack_for_one_rank(lower_bit):
    """``--ranks 2 --rank 1 --expert-bits 2``: the pack holds rank 1's half of every layer's
    experts, in the format, and they are the whole conversion's records."""
    part, whole = ExpertPack(lower_bit(2, ranks=2, rank=1)), ExpertPack(lower_bit(2))
    assert part.format == FORMATS[2] and part.held(1) == range(4, 8)
    for e in part.held(1):
        assert part.read_bytes(1, e) == whole.read_bytes(1, e)


def _pack_index(out: Path) -> tuple[Path, dict]:
    file = out / "experts/index.json"
    return file, json.loads(file.read_text())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("expert_format"), "expert format None is not one of"),
        (
            lambda d: d.update(expert_format={"mode": "affine", "bits": 5, "group_size": 64}),
            "is not one of",
        ),
        (lambda d: d.update(version=1), "a version 1 pack names no expert_format"),
        (lambda d: d.update(expert_format=MXFP4.to_json()), "a version 2 pack of MXFP4 experts"),
        (lambda d: d.update(version=3), "version 3, expected"),
    ],
)
def test_a_bad_pack_index_is_named(lower_bit, tmp_path, change, message):
    out = shutil.copytree(lower_bit(2), tmp_path / "o")
    file, doc = _pack_index(out)
    change(doc)
    file.write_text(json.dumps(doc))
    with pytest.raises(PackError, match=message) as e:
        load_model(out, dtype=mx.float32)
    assert str(file) in str(e.value)


def test_a_pack_and_config_that_disagree_are_named(lower_bit, tmp_path):
    out = shutil.copytree(lower_bit(2), tmp_path / "o")
    config = json.loads((out / "config.json").read_text())
    config["quantization"]["routed_experts"] = FORMATS[3].to_json()
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"holds 2-bit affine.* config.json says 3-bit"):
        load_model(out, dtype=mx.float32)
    config["quantization"]["routed_experts"] = {"mode": "affine", "bits": 1, "group_size": 64}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json: config value quantization.routed_experts"):
        load_model(out, dtype=mx.float32)


def test_published_experts_named_lower_bit_are_refused(ckpt_factory, tmp_path):
    src = shutil.copytree(ckpt_factory("tiny", **FORMAT_SHAPES), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"routed_experts": FORMATS[2].to_json()}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match="names 2-bit affine, groups of 64 experts, which only"
    ):
        load_model(src, dtype=mx.float32, expert_cache_gb=0.01)


@pytest.mark.slow
def test_killed_lower_bit_conversion_resumes_to_identical_bytes(ckpt_factory, lower_bit, tmp_path):
    src, out = ckpt_factory("tiny", **FORMAT_SHAPES), tmp_path / "o"
    cmd = [sys.executable, "-m", "kimi_k3.convert", "--hf-path", str(src), "--out", str(out)]
    cmd += ["--dense-bits", "16", "--expert-bits", "2", "--workers", "1"]
    cmd += ["--pack-file-mb", "0.02", "--shard-mb", "0.05"]
    killed = subprocess.run(cmd, env={**os.environ, KILL_ENV: "300000"}, capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    done = json.loads((out / STATE).read_text())["done"]
    assert done and not (out / MANIFEST).exists()
    resumed = subprocess.run(cmd, capture_output=True, text=True)
    assert resumed.returncode == 0 and f"resuming: {len(done)} of" in resumed.stderr
    whole = tmp_path / "whole"
    _convert(
        src, whole, expert_bits=2, pack_file_bytes=int(0.02 * 2**20), shard_bytes=int(0.05 * 2**20)
    )
    assert _files(out) == _files(whole)


# --- the evaluation's rows -----------------------------------------------------------------


def test_eval_rows_per_format(ckpt_factory, lower_bit):
    src = ckpt_factory("tiny", **FORMAT_SHAPES)
    rows = k3eval.expert_format_variants(src)
    assert list(rows) == [
        "experts 3-bit affine, groups of 64 (--expert-bits 3)",
        "experts 2-bit affine, groups of 64 (--expert-bits 2)",
    ]
    for bits, model in zip((3, 2), rows.values(), strict=True):
        assert mx.array_equal(
            model(TOKENS), load_model(lower_bit(bits), dtype=mx.float32)(TOKENS)
        ).item()
    assert k3eval.expert_format_variants(lower_bit(2)) == {}  # nothing left to requantize
    table = k3eval.format_table(
        {"reference": {"ppl": 10.0, "kl": 0.0}, "experts 2-bit": {"ppl": 11.0, "kl": 0.01}}
    )
    assert "| experts 2-bit | 11.00 | 2.3979 | +0.0953 | 0.0100 |" in table


def test_requantize_model_needs_resident_mxfp4(lower_bit):
    with pytest.raises(ValueError, match="requantizing needs resident MXFP4 experts"):
        requant.requantize_model(load_model(lower_bit(2), dtype=mx.float32), FORMATS[3])


def test_expert_format_is_a_value():
    assert ExpertFormat("affine", 2, 64) == FORMATS[2]
    assert FORMATS[3].shapes(8, 128) == {
        "weight": ((8, 12), np.uint32),
        "scales": ((8, 2), np.float16),
        "biases": ((8, 2), np.float16),
    }
