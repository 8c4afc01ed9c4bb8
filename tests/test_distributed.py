"""Kimi K3 across processes: real ``mlx.launch --backend ring`` runs on localhost against
one process, on a tiny synthetic checkpoint (tests/dist_worker.py is one rank)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kimi_k3.distributed import free_ports, launched_ranks
from kimi_k3.model.parallel import balanced_split, expert_range

WORKER = Path(__file__).with_name("dist_worker.py")
LAUNCH_TIMEOUT = 120  # seconds: a hung rank fails the test instead of blocking CI
# fp32 logits of a split against one process, max |difference| / max |logit|: the all-sums
# add the ranks' parts in another order (measured: 1.9e-6 for tensor parallel, 0 for the
# pipeline and expert splits on this checkpoint).
LOGIT_TOL = 1e-5


def launch(n: int, *command: str) -> subprocess.CompletedProcess:
    cmd = [
        str(Path(sys.executable).with_name("mlx.launch")),
        "-n",
        str(n),
        "--backend",
        "ring",
        "--starting-port",
        str(free_ports(n)),
        "--python",
        sys.executable,
        *command,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


def results(out: Path, case: str, n: int) -> list[dict]:
    got = []
    for r in range(n):
        d = np.load(out / f"{case.replace(':', '_').replace('@', '_at_')}.rank{r}.npz")
        got.append(
            {"tokens": list(d["tokens"]), "logits": d["logits"], **json.loads(str(d["stats"]))}
        )
    return got


def close(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def per_rank(tiny_ckpt, tmp_path_factory):
    """``per_rank(n)``: the tiny checkpoint converted once per rank of ``n``, each with only
    its rank's experts in its pack; returns the directory pattern with ``{rank}``."""
    from kimi_k3.convert.convert import Settings, convert

    made = {}

    def make(n: int) -> str:
        if n not in made:
            base = tmp_path_factory.mktemp(f"ranks{n}")
            for r in range(n):
                settings = Settings(dense_bits=16, ranks=n, rank=r)
                convert(tiny_ckpt, base / f"rank{r}", settings, stream=open("/dev/null", "w"))
            made[n] = str(base / "rank{rank}")
        return made[n]

    return make


def test_partitions():
    assert [expert_range(896, 3, r) for r in range(3)] == [
        range(0, 299),
        range(299, 598),
        range(598, 896),
    ]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balanced_split([1, 1, 1, 1], 4) == [1, 1, 1, 1]
    assert sum(balanced_split(list(range(1, 94)), 4)) == 93
    with pytest.raises(ValueError, match="cannot be split"):
        expert_range(2, 3, 0)
    with pytest.raises(ValueError, match="pipeline stages"):
        balanced_split([1, 2], 3)


# Expert parallel with trimmed experts (kimi_k3.model.routing), held and streamed, and with
# misses shed: held (every expert cached, nothing to drop) and streamed.
TRIMMED_CASES = ["expert@0.55", "expert:0.001@0.55"]
SHED_CASES = ["expert%0", "expert:0.001%0"]


@pytest.mark.slow
def test_two_ranks_every_split(tiny_ckpt, tmp_path):
    """pipeline, tensor, expert, tensor+expert, streamed experts, and mlx-lm's
    ``model.model.pipeline(group)`` / ``model.shard(group)`` on a loaded model: the greedy
    tokens of one process on every rank, the logits within LOGIT_TOL; and expert parallel
    with trimmed experts against one process trimmed alike; with misses shed, held experts
    give the unshed tokens, and streamed ones the same tokens and logits on both ranks from
    the same decisions (each rank drops the same pairs)."""
    from dist_worker import reference

    cases = ["pipeline", "tensor", "expert", "tensor+expert", "expert:0.001"]
    cases += ["pipeline-call", "shard-call"]
    run = launch(2, str(WORKER), str(tiny_ckpt), str(tmp_path), *cases, *TRIMMED_CASES, *SHED_CASES)
    assert "Traceback" not in run.stderr + run.stdout, run.stderr + run.stdout
    tokens, logits = reference(tiny_ckpt)
    for case in [*cases, "expert%0"]:
        for r, got in enumerate(results(tmp_path, case, 2)):
            assert got["tokens"] == tokens, (case, r)
            assert close(got["logits"], logits) <= LOGIT_TOL, (case, r)
    streamed = results(tmp_path, "expert:0.001", 2)
    for r, got in enumerate(streamed):
        mine, gathered = got["mine"], got["gathered"]
        assert mine["misses"] > 0 and mine["bytes_read"] == mine["misses"] * mine["expert_bytes"]
        assert [g["bytes_read"] for g in gathered] == [s["mine"]["bytes_read"] for s in streamed]
        assert gathered[r]["hits"] == mine["hits"]
    shed = results(tmp_path, "expert:0.001%0", 2)
    assert shed[0]["tokens"] == shed[1]["tokens"]
    assert np.array_equal(shed[0]["logits"], shed[1]["logits"])
    assert shed[0]["mine"]["shed_pairs"] == shed[1]["mine"]["shed_pairs"] > 0
    trimmed = reference(tiny_ckpt, top_p=0.55)
    assert not np.array_equal(trimmed[1], logits)  # trimming changed the model
    for case in TRIMMED_CASES:
        for r, got in enumerate(results(tmp_path, case, 2)):
            assert got["tokens"] == trimmed[0], (case, r)
            assert close(got["logits"], trimmed[1]) <= LOGIT_TOL, (case, r)


@pytest.mark.slow
def test_four_ranks_read_only_their_experts(tiny_ckpt, per_rank, tmp_path):
    """Each of 4 ranks streams (and, resident, holds) its quarter of every layer's experts
    from its own directory, whose pack holds nothing else; and 4 pipeline stages."""
    from dist_worker import reference

    pattern = per_rank(4)
    for r in range(4):
        index = json.loads((Path(pattern.format(rank=r)) / "experts/index.json").read_text())
        assert index["expert_range"] == [2 * r, 2 * r + 2]
    run = launch(4, str(WORKER), pattern, str(tmp_path), "expert:0.001", "expert")
    assert "Traceback" not in run.stderr + run.stdout, run.stderr + run.stdout
    tokens, logits = reference(tiny_ckpt)
    for case in ("expert:0.001", "expert"):
        for got in results(tmp_path, case, 4):
            assert got["tokens"] == tokens and close(got["logits"], logits) <= LOGIT_TOL
    reads = [g["mine"]["bytes_read"] for g in results(tmp_path, "expert:0.001", 4)]
    assert all(b > 0 for b in reads)
    stages = tmp_path / "stages"
    stages.mkdir()
    run = launch(4, str(WORKER), str(tiny_ckpt), str(stages), "pipeline")
    assert "Traceback" not in run.stderr + run.stdout, run.stderr + run.stdout
    for got in results(stages, "pipeline", 4):
        assert got["tokens"] == tokens and close(got["logits"], logits) <= LOGIT_TOL


@pytest.mark.slow
def test_two_ranks_with_lower_bit_experts(lower_bit, tmp_path):
    """2-bit experts (``--expert-bits 2``), each rank's pack written for it (``--ranks 2``):
    held and streamed expert parallel give one process's tokens on the whole conversion,
    logits within LOGIT_TOL, and each rank reads only its pack."""
    from dist_worker import reference

    for r in range(2):
        (tmp_path / f"rank{r}").symlink_to(lower_bit(2, ranks=2, rank=r))
    out = tmp_path / "out"
    out.mkdir()
    run = launch(2, str(WORKER), str(tmp_path / "rank{rank}"), str(out), "expert", "expert:0.001")
    assert "Traceback" not in run.stderr + run.stdout, run.stderr + run.stdout
    tokens, logits = reference(lower_bit(2))
    for case in ("expert", "expert:0.001"):
        for r, got in enumerate(results(out, case, 2)):
            assert got["tokens"] == tokens and close(got["logits"], logits) <= LOGIT_TOL, (case, r)
    for got in results(out, "expert:0.001", 2):
        mine = got["mine"]
        assert mine["misses"] > 0 and mine["bytes_read"] == mine["misses"] * mine["expert_bytes"]


@pytest.mark.slow
def test_generate_cli_stats_per_rank(tiny_ckpt):
    """``python -m kimi_k3.generate --split tensor`` with streamed experts, through mlx-lm's
    generation (which evaluates a step ahead on its own stream): rank 0 alone prints the
    reply and one stats line with each rank's own counters."""
    import re

    run = launch(
        2,
        *("-m", "kimi_k3.generate", "--split", "tensor", "--backend", "ring"),
        *("--model", str(tiny_ckpt), "--expert-cache-gb", "0.001", "--max-tokens", "8"),
        *("--prefill-step-size", "4", "--raw", "--prompt", "a b c d e f g h i j k"),
    )
    out = run.stdout + run.stderr
    lines = [line for line in out.splitlines() if line.startswith("stats: ")]
    assert len(lines) == 1, out
    ranks = re.findall(r"rank (\d) ([\d.]+)% hits, ([\d.]+) [KMG]B read", lines[0])
    assert [r for r, _, _ in ranks] == ["0", "1"], lines[0]
    assert all(0 < float(hit) <= 100 for _, hit, _ in ranks), lines[0]
    assert "error" not in out, out


def test_launched_ranks_from_the_launchers_environment(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["127.0.0.1:5002"]]))
    assert launched_ranks({}) == 1
    assert launched_ranks({"MLX_RANK": "0", "MLX_HOSTFILE": str(hosts)}) == 3
    empty = tmp_path / "empty.json"
    empty.write_text("")  # mlx.launch -n 1 writes no hosts
    assert launched_ranks({"MLX_RANK": "0", "MLX_HOSTFILE": str(empty)}) == 1
    assert launched_ranks({"MLX_HOSTFILE": str(tmp_path / "gone.json")}) == 1
    assert launched_ranks({"MLX_WORLD_SIZE": "4"}) == 4
    assert launched_ranks({"OMPI_COMM_WORLD_SIZE": "2"}) == 2


@pytest.mark.slow
def test_generate_without_split_under_a_launch_is_refused(tiny_ckpt):
    """``mlx.launch -n 2 python -m kimi_k3.generate`` without ``--split``: a rank ends at
    once with a usage error naming the flag (exit 2), before loading anything; the launcher
    then stops the other (mlx.launch itself exits 0 whatever its ranks do)."""
    run = launch(
        2,
        *("-m", "kimi_k3.generate", "--model", str(tiny_ckpt), "--max-tokens", "2"),
        *("--raw", "--prompt", "a b c"),
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors, run.stderr
    assert all("one of 2 ranks" in e and "--split is not given" in e for e in errors), errors
    assert "exited with code 2" in run.stderr, run.stderr
    assert run.stdout == "", run.stdout


@pytest.mark.slow
def test_server_two_ranks(per_rank):
    """``python -m kimi_k3.server --split expert`` on 2 ranks: rank 0 answers a completion
    (the other rank repeats its forward passes), then three at once (two prompts of one
    length prefilled in one pass, all three decoded in one batch) as it answers each
    alone; only rank 0 logs."""
    import os
    import signal
    import threading
    import time
    import urllib.request

    port = free_ports(1)
    cmd = [
        str(Path(sys.executable).with_name("mlx.launch")),
        *("-n", "2", "--backend", "ring", "--starting-port", str(free_ports(2))),
        *("--python", sys.executable, "-m", "kimi_k3.server", "--split", "expert"),
        *("--model", per_rank(2), "--expert-cache-gb", "0.001", "--port", str(port)),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)

        def complete(prompt):
            body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
            req = urllib.request.Request(
                url + "/v1/completions", body, {"Content-Type": "application/json"}
            )
            return json.loads(urllib.request.urlopen(req, timeout=60).read())

        prompts = ["Hi", "Client 1 asks.", "Client 2 asks."]
        alone = [complete(p) for p in prompts]
        together = [None] * 3
        threads = [
            threading.Thread(target=lambda i=i: together.__setitem__(i, complete(prompts[i])))
            for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        log = proc.communicate(timeout=30)[0]
    assert [r["usage"]["completion_tokens"] for r in alone] == [4, 4, 4]
    texts = [r["choices"][0]["text"] for r in alone]
    assert [r and r["choices"][0]["text"] for r in together] == texts, log
    assert log.count("serving ") == 1 and log.count("loaded ") == 1, log


def test_converter_rank_out_of_range(tiny_ckpt, tmp_path):
    from kimi_k3.convert.convert import ConvertError, Settings, convert

    with pytest.raises(ConvertError, match="--rank 2 --ranks 2"):
        convert(tiny_ckpt, tmp_path / "out", Settings(ranks=2, rank=2))


@pytest.mark.slow
def test_bench_quick(tmp_path):
    """``python -m benchmarks.bench_distributed --quick`` on 1 and 2 ranks: its table."""
    from benchmarks import bench_distributed

    out = tmp_path / "table.md"
    assert bench_distributed.main(["--quick", "--ranks", "1", "2", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")][1:]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "2"]


@pytest.mark.slow
def test_missing_expert_file_ends_every_rank(per_rank):
    """Rank 1's expert pack file gone: both ranks of ``python -m kimi_k3.generate --split
    expert`` stop with an error naming rank 1 and the file, and neither hangs."""
    pattern = per_rank(2)
    pack = Path(pattern.format(rank=1)) / "experts/experts-00001-of-00001.pack"
    hidden = pack.with_name("moved.pack")
    pack.rename(hidden)
    try:
        run = launch(
            2,
            "-m",
            "kimi_k3.generate",
            "--split",
            "expert",
            "--backend",
            "ring",
            "--model",
            pattern,
            "--expert-cache-gb",
            "0.001",
            "--max-tokens",
            "2",
        )
    finally:
        hidden.rename(pack)
    out = run.stdout + run.stderr
    for r in (0, 1):
        assert f"error: rank {r}: rank 1 failed: {pack}" in out, out
    assert "Traceback" not in out


@pytest.mark.slow
def test_expert_file_lost_mid_generation(per_rank, tmp_path):
    """Rank 1's pack file vanishes after a pass: rank 1 adds zeros to the MoE all-sum with a
    failure flag, and at the next MoE layer both ranks stop with its error (file, layer,
    expert) instead of rank 0 waiting in a collective."""
    pattern = per_rank(2)
    pack = Path(pattern.format(rank=1)) / "experts/experts-00001-of-00001.pack"
    try:
        run = launch(2, str(WORKER), pattern, str(tmp_path), "vanish:0.001")
    finally:
        if pack.with_suffix(".moved").exists():
            pack.with_suffix(".moved").rename(pack)
    assert "Traceback" not in run.stdout + run.stderr, run.stdout + run.stderr
    for r in (0, 1):
        message = (tmp_path / f"vanish.rank{r}.txt").read_text()
        assert message.startswith(f"rank 1 failed: {pack}: file vanished"), message
