"""The decode benchmarks' timers (benchmarks/bench_mxfp4.py) and the ncu summary of
benchmarks/gpu_time.py: what they time and parse, checked on the CPU (no timings asserted)."""

import mlx.core as mx
import pytest

from benchmarks import gpu_time
from benchmarks.bench_mxfp4 import (
    Table,
    bench_prefill,
    chain_link,
    setup_arg_parser,
    time_chain,
    time_rounds,
)
from kimi_k3.kernels import mxfp4_prefill_mma


def test_time_chain_feeds_each_call_the_one_befores_output():
    """Call i + 1 runs on link(output of call i, its inputs): five calls that add one to a
    zero latent end at five (a batch of independent calls would end at one)."""
    outs = []

    def fn(z, w):
        outs.append(z + w)
        return outs[-1]

    inputs = [(mx.zeros((1, 4), dtype=mx.bfloat16), mx.array(1.0))] * 5
    t = time_chain(fn, inputs, repeats=2)
    assert t > 0
    assert outs[-1].tolist() == [[5.0] * 4]
    assert outs[-1].dtype == mx.float32  # the output; the link casts it for the next call
    assert chain_link(outs[-1], inputs[0])[0].dtype == mx.bfloat16


def test_time_rounds_takes_the_timer_and_reports_failures():
    def bad(z, w):
        raise RuntimeError("no\n  kernel")

    inputs = [(mx.zeros((1, 4)), mx.array(1.0))] * 3
    times, failed = time_rounds([lambda z, w: z + w, bad], inputs, 2, 1, timer=time_chain)
    assert len(times[0]) == 2 and all(t > 0 for t in times[0])
    assert times[1] == [] and failed == {1: "no kernel"}


def test_bench_prefill_times_every_row_in_each_round(monkeypatch):
    """The prefill table's rows (gather_qmm, the tensor-core GEMM at both tile sizes, the
    same on tiles with each way of loading their scales) each get one time per round, and
    every kernel row agrees with gather_qmm (the emulator runs the kernels at small
    widths)."""
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    args = setup_arg_parser().parse_args(
        "--dim 128 --hidden 128 --topk 2 --prefill-experts 6 --prefill-tokens 5 --calls 10 "
        "--repeats 1 --rounds 2 --no-lut --dtype float32".split()
    )
    table = Table()
    bench_prefill(args, table)
    rows = {r[0]: r for r in table.rows}
    timed = [
        "prefill N=5: gather_qmm (sorted)",
        "prefill N=5: tensor-core kernel, 16 pairs/tile (its choice)",
        "prefill N=5: tensor-core kernel, 32 pairs/tile",
    ]
    on_tiles = "prefill N=5: tensor-core kernel on the tiled layout, 16 pairs/tile"
    timed += [on_tiles] + [
        f"{on_tiles}, scales loaded as {s}"
        for s in mxfp4_prefill_mma.SCALES
        if s != mxfp4_prefill_mma.scales_for(16)
    ]
    for label in timed:
        assert rows[label][1].endswith(" ms"), rows[label]
        assert len(rows[label][4].removeprefix("rounds (ms): ").split(", ")) == 2
    for label in timed[1:]:
        err = float(rows[f"{label} vs gather_qmm"][4].removeprefix("rel err "))
        assert err < 1e-5


def test_split_batch_gives_build_and_eval():
    build, run = gpu_time.split_batch(lambda a: a * 2, [(mx.ones(8),)] * 4, repeats=2)
    assert build > 0 and run > 0


NCU_CSV = """\
==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",\
"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","custom_kernel_mxfp4_mma_x(const float *)","1","14","(256, 1, 1)",\
"(24, 16, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","81.50"
"1","1","python3","h","custom_kernel_mxfp4_mma_x(const float *)","1","14","(256, 1, 1)",\
"(24, 16, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","79,100"
"2","1","python3","h","custom_kernel_mxfp4_mma_x(const float *)","1","14","(256, 1, 1)",\
"(24, 16, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","90"
"3","1","python3","h","void copy_v<float>(float *)","1","14","(256, 1, 1)",\
"(24, 16, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ms","1.2"
==PROF== Disconnected from process 1
"""


def test_summarize_reads_ncu_csv(tmp_path, capsys):
    path = tmp_path / "ncu.csv"
    path.write_text(NCU_CSV)
    gpu_time.summarize(str(path))
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[1:] == [
        "| mxfp4_mma_x | 3 | 81.5 | 79.1 |",
        "| void copy_v<float> | 1 | 1200.0 | 1200.0 |",
    ]


def test_summarize_refuses_an_unknown_unit(tmp_path):
    path = tmp_path / "ncu.csv"
    path.write_text(NCU_CSV.replace('"ms","1.2"', '"cycle","1.2"'))
    with pytest.raises(ValueError, match="unknown time unit 'cycle' for void copy_v<float>"):
        gpu_time.summarize(str(path))
