"""benchmarks/bench_e2e.py's quick mode on the CPU: every row measured, streamed rows with the
expert cache's counters over their decode steps."""

import re

import pytest

from benchmarks import bench_e2e


@pytest.mark.slow
def test_bench_e2e_rows(tmp_path):
    out = tmp_path / "e2e.md"
    argv = ["--quick", "--device", "cpu", "--expert-cache-gb", "0.001", "--out", str(out)]
    bench_e2e.main(argv)
    rows = [r.split("|")[1:-1] for r in out.read_text().splitlines() if r.startswith("| float32")]
    assert [r[1].strip() for r in rows] == [
        "kimi_k3 (this project)",
        "mlx-lm kimi_k3",
        "kimi_k3, experts streamed (0.001 GB cache)",
    ]
    for _, _, pre, dec, _ in rows:
        assert float(pre) > 0 and float(dec) > 0
    assert [r[4].strip() for r in rows[:2]] == ["resident", "resident"]
    # a 1 MB cache cannot hold a layer's experts: decode misses and reads from disk
    pattern = r"(\d+)% hit, ([\d.]+) MB read per token(, read at [\d.]+ GB/s)?"
    m = re.fullmatch(pattern, rows[2][4].strip())
    assert m and int(m.group(1)) < 100 and float(m.group(2)) > 0
