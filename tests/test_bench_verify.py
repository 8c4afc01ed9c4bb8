"""``python -m benchmarks.bench_verify --quick``: both settings measured, the table printed."""

import re

import pytest

from benchmarks.bench_verify import main


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["shards", "pack"])
def test_quick(layout, capsys):
    assert main(["--quick", "--layout", layout]) == 0
    out = capsys.readouterr().out
    for what in ("read GB/s", "decode tokens/s"):
        row = re.search(rf"^\| {what} \| ([\d.e+]+) \| ([\d.e+]+) \| [+-][\d.]+% \|$", out, re.M)
        assert row and all(float(v) > 0 for v in row.groups()), out
