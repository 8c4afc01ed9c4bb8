"""benchmarks/decode_split.py on the CPU at toy size: both implementations measured, a
checkpoint written once and read again, the profile printed."""

from benchmarks import decode_split


def test_decode_split_rows(tmp_path, capsys):
    out = tmp_path / "split.md"
    ck = tmp_path / "ckpt"
    argv = ["--preset", "small", "--device", "cpu", "--prompt-tokens", "8", "--dtype", "float32"]
    argv += ["--decode-tokens", "2", "--rounds", "1", "--checkpoint", str(ck), "--out", str(out)]
    rows = decode_split.main(argv + ["--profile", "5"])
    assert [r[0] for r in rows] == ["kimi_k3 (this project)", "mlx-lm kimi_k3"]
    assert all(build > 0 and wait > 0 for _, build, wait in rows)
    assert "cumulative" in capsys.readouterr().out  # pstats' header of the profile
    assert (ck / "config.json").exists()
    again = decode_split.main(argv + ["--no-mlx-lm"])  # the checkpoint is read, not rewritten
    assert [r[0] for r in again] == ["kimi_k3 (this project)"]
    table = out.read_text()
    assert table.count("| kimi_k3 (this project) |") == 2 and "| mlx-lm kimi_k3 |" in table
