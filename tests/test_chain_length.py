"""benchmarks/chain_length.py on the CPU at toy size (the kernels through the Metal
emulator): the line fit, every job timed at every length, the decodes' chains checked
against gather_qmm's, and the table."""

import pytest

from benchmarks import chain_length


def test_fit_recovers_a_line():
    slope, intercept = chain_length.fit([10, 20, 40], [0.5 + 0.1 * n for n in (10, 20, 40)])
    assert slope == pytest.approx(0.1) and intercept == pytest.approx(0.5)


def test_rows_at_toy_size(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    out = tmp_path / "chain.md"
    argv = ["--dim", "256", "--hidden", "256", "--experts", "8", "--topk", "2", "--calls", "3"]
    argv += ["--lengths", "1", "3", "--rounds", "1", "--repeats", "1", "--read-limit", "--tiled"]
    rows = chain_length.main(argv + ["--out", str(out)])
    labels = [r["label"] for r in rows]
    assert labels[:2] == ["links only (cast + one trivial op a call)", "gather_qmm"]
    assert len(labels) == 10 and sum(lb.startswith("read limit") for lb in labels) == 2
    assert sum(lb.startswith("mxfp4_one") for lb in labels) == 4
    for r in rows:
        assert len(r["totals"]) == 2 and all(t > 0 for t in r["totals"])
        assert all(0 < s <= t for s, t in zip(r["submits"], r["totals"]))
    decodes = [r for r in rows if r["err"] is not None]
    assert len(decodes) == 6 and all(r["err"] < 1e-5 for r in decodes)
    text = out.read_text()
    assert text.count("\n| ") == 11 and "L=3 per call (submit)" in text


def test_one_length_is_refused():
    with pytest.raises(SystemExit):
        chain_length.main(["--lengths", "20", "20"])
