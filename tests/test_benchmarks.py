"""Every benchmark's quick mode on the CPU (kernel benchmarks through the Metal emulator), and
the shared timing helpers: the rows each table must have, numbers finite and positive where
they are times, correctness columns within tolerance. No time is asserted."""

import math

import mlx.core as mx
import numpy as np
import pytest

from benchmarks import (
    bench_cache_policy,
    bench_kda,
    bench_mla,
    bench_mxfp4,
    bench_prefetch,
    bench_server,
    bench_streaming,
    bench_trace,
    bench_train,
    bench_trim,
    bf16_drift,
    expert_formats,
    profile_kernels,
    project_k3,
    quant_quality,
    timing,
)
from kimi_k3.cli import markdown_table


def tables(text: str) -> list[list[dict]]:
    """Every markdown table in ``text``: a list of rows, each {header cell: cell}."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, (c.strip() for c in row.strip("|").split("|")))))
            out.append(rows)
    return out


def number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("x%"))


def test_chain_feeds_each_call_the_one_befores_output():
    """Call i + 1 runs on chain_link(output of call i, its inputs): five calls that add one
    to a zero latent end at five (independent calls would end at one)."""
    outs = []

    def fn(z, w):
        outs.append(z.astype(mx.float32) + w)
        return outs[-1]

    inputs = [(mx.zeros((1, 4), dtype=mx.bfloat16), mx.array(1.0))] * 5
    assert timing.chain_total(fn, inputs, 5, repeats=2) > 0
    assert outs[-1].tolist() == [[5.0] * 4]
    assert timing.chain_link(outs[-1], inputs[0])[0].dtype == mx.bfloat16


def test_fit_line_and_chain_slope():
    assert timing.fit_line([10, 20, 40], [1.5, 2.5, 4.5]) == pytest.approx((0.1, 0.5))
    slope, intercept = timing.chain_slope(lambda z: z + 1, [(mx.zeros(4),)], [2, 6], 1)
    assert math.isfinite(slope) and math.isfinite(intercept)
    with pytest.raises(ValueError, match="at least two different lengths"):
        timing.chain_slope(lambda z: z, [(mx.zeros(4),)], [3, 3], 1)


def test_interleaved_rounds_and_failures():
    calls = []

    def bad():
        calls.append("bad")
        raise RuntimeError("no\n  kernel")

    good = lambda: calls.append("good") or 1.0  # noqa: E731
    results, failed = timing.interleaved({"good": good, "bad": bad}, 3)
    assert calls == ["good", "bad", "good", "good"]  # a failed job is not called again
    assert results == {"good": [1.0, 1.0, 1.0], "bad": []}
    assert failed == {"bad": "RuntimeError: no kernel"}


def test_median_time_stops_at_its_budget():
    runs = []
    t = timing.median_time(lambda: runs.append(1), repeats=4, warmup=1)
    assert t >= 0 and len(runs) == 5
    runs.clear()
    timing.median_time(lambda: runs.append(1), repeats=100, warmup=0, budget_s=0.0)
    assert len(runs) == 1


def test_markdown_table_and_environment(tmp_path):
    text = markdown_table(("a", "b"), [(1, "x")])
    assert tables(text) == [[{"a": "1", "b": "x"}]]
    assert mx.__version__ in timing.environment()
    out = tmp_path / "t.md"
    timing.emit("one", out)
    timing.emit("two", out, append=True)
    assert out.read_text() == "onetwo\n"


def test_oracle_agrees_with_gather_qmm_in_fp32():
    w = bench_mxfp4.random_experts(6, 64, 96, seed=2)
    inds, weights = bench_mxfp4.routing(3, 6, 2, np.random.default_rng(0))
    z = mx.random.normal((3, 64), key=mx.random.key(1))
    want = bench_mxfp4.oracle(z, w, inds, weights)
    got = bench_mxfp4.fp32_reference(z, w, inds, weights, bench_mxfp4.BETA, bench_mxfp4.CAP)
    assert bench_mxfp4.rel_err(got, want) < 1e-5


def test_bench_mxfp4_quick(monkeypatch, tmp_path):
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    out = tmp_path / "mxfp4.md"
    text = bench_mxfp4.main(["--quick", "--formats", "2", "--out", str(out)])
    assert out.read_text() == text
    decode, prefill = tables(text)
    jobs = [r["job"] for r in decode]
    two = "2-bit affine, groups of 64"
    assert jobs == [
        "MLX gather_qmm",
        "dispatched: mxfp4_decode.expert_glu_decode, on MLX's layout",
        "read limit (reads the same bytes, one launch)",
        f"MLX gather_qmm, {two}",
        f"dispatched: affine_decode.expert_glu_decode, {two}",
    ]
    for r in decode:
        assert math.isfinite(number(r["ms per call (slope)"]))
        assert math.isfinite(number(r["intercept (ms)"]))
    for i in (1, 4):
        assert number(decode[i]["rel err vs gather_qmm fp32 (its format's)"]) < 1e-5
    assert [r["job"] for r in prefill] == [
        "MLX gather_qmm (sorted)",
        "dispatched: mxfp4_prefill.expert_glu_prefill, on MLX's layout",
        f"MLX gather_qmm (sorted), {two}",
        f"dispatched: affine_prefill.expert_glu_prefill, {two}",
    ]
    for r in prefill:
        assert number(r["ms"]) > 0 and number(r["tok/s"]) > 0
    for i in (0, 2):  # bf16 latents in gather_qmm
        assert number(prefill[i]["rel err vs fp32 oracle"]) < 0.05
    for i in (1, 3):  # the kernels compute in fp32
        assert number(prefill[i]["rel err vs fp32 oracle"]) < 1e-5


@pytest.mark.parametrize("backend", ["emulator", "none"])
def test_bench_kda_quick(monkeypatch, backend):
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", backend)
    (rows,) = tables(bench_kda.main(["--quick"]))
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["implementation"]] = r
    assert list(by_case) == [
        "decode, 1 token, single call",
        "decode, 1 token, chained (2 layers, one eval; per layer)",
        "prefill T=64",
    ]
    decode = ["mx.fast.gated_delta_update (scalar gate)", "mlx-lm gated_delta_update (vector gate)"]
    decode += ["pure-MLX reference mixer", "state read + write at bandwidth"]
    prefill = ["pure-MLX kda_chunked (recurrence)"]
    if backend == "emulator":
        decode.append("ours: kda_decode (whole mixer, 1 launch)")
        prefill += [
            "ours: chunk kernels (recurrence, fp32 state pass)",
            "ours: chunk kernels (recurrence, tf32 state pass: bf16 models)",
            "ours: kda_prefill (whole mixer, bf16)",
        ]
    for case, names in zip(by_case, (decode, decode, prefill)):
        fla = {"fla chunk_kda"} if "prefill" in case else set()
        assert set(by_case[case]) == set(names) | fla
        for name in names:
            assert number(by_case[case][name]["time (us)"]) > 0, (case, name)
            assert not by_case[case][name]["note"].startswith("failed")
    assert by_case["prefill T=64"]["fla chunk_kda"]["note"].startswith("not run")


@pytest.mark.slow
def test_bench_mla_quick():
    (rows,) = tables(bench_mla.main(["--quick"]))
    assert [(r["case"], r["kv_b_proj"]) for r in rows] == [
        ("decode, 1 token", "as stored (the model)"),
        ("decode, 1 token", "dequantized per call"),
        ("prefill, 16 tokens", "dequantized per call (the model)"),
        ("prefill, 16 tokens", "as stored"),
    ]
    assert all(number(r["time (us)"]) > 0 for r in rows)


@pytest.mark.slow
def test_bench_trace_quick():
    (rows,) = tables(bench_trace.main(["--quick"]))
    assert [r["state"] for r in rows] == list(bench_trace.STATES.values())
    assert all(number(v) > 0 for r in rows for k, v in r.items() if k != "state")
    assert rows[0]["vs never (CPU)"] == "1.000"


def test_quant_quality_quick():
    (rows,) = tables(quant_quality.main(["--quick"]))
    by = {r["weights"]: r for r in rows}
    assert list(by) == [
        "dense 16-bit",
        "dense 8-bit, group 64",
        "dense 4-bit, group 64",
        "dense 4-bit, group 32",
        "Gaussian noise (yardstick)",
    ]
    assert number(by["dense 16-bit"]["mean KL (nats/token)"]) == 0
    assert by["dense 16-bit"]["top-1 agreement"] == "100.0%"
    err = [number(by[k]["weight rel. RMS error"]) for k in list(by)[1:3]]
    kl = [number(by[k]["mean KL (nats/token)"]) for k in list(by)[1:3]]
    assert 0 < err[0] < err[1] and 0 < kl[0] < kl[1]  # 8 bits closer than 4
    assert number(by["Gaussian noise (yardstick)"]["weight rel. RMS error"]) == 0.001


@pytest.mark.parametrize("modules", [False, True])
def test_bf16_drift_quick(modules):
    (rows,) = tables(bf16_drift.main(["--quick"] + (["--modules"] if modules else [])))
    if modules:
        assert {r["block"] for r in rows} == {"KDA mixer", "MLA", "MoE", "dense MLP"}
        for r in rows:
            for k in ("bf16 error, kimi_k3", "bf16 error, mlx-lm"):
                assert 0 < number(r[k]) < 0.1, r
        return
    assert [(r["preset"], r["seed"]) for r in rows] == [("tiny", "0"), ("all", "")]
    for r in rows:
        assert 0 <= number(r["KL kimi_k3"]) < 0.1 and 0 <= number(r["KL mlx-lm"]) < 0.1
        assert 0 <= number(r["top-1 kimi_k3"]) <= 1 and 0 <= number(r["top-1 mlx-lm"]) <= 1


@pytest.mark.slow
def test_bench_streaming_quick(tmp_path):
    text = bench_streaming.main(["--quick", "--work", str(tmp_path)])
    reads, into_mlx, trained, cache, switches = tables(text)
    assert len(reads) == 8 and all(number(r["GB/s (median)"]) > 0 for r in reads)
    twins = [r for r in reads if r["vs raw, same reads and depth"] != "-"]
    assert [r["run"].split(",")[0] for r in twins] == ["streamer"] * 3
    assert all(number(r["vs raw, same reads and depth"]) > 0 for r in twins)
    assert len(trained) == 4 and [r["prefetch"] for r in trained] == ["False", "True"] * 2
    assert all(number(r["prediction recall"]) > 0 for r in trained if r["prefetch"] == "True")
    assert [r["write mode"] for r in into_mlx] == ["view", "mlx"]
    assert all(r["bytes verified"] == "True" for r in into_mlx)
    lru = {number(r["slots / layer"]): number(r["hit rate"]) for r in cache if r["policy"] == "lru"}
    assert list(lru) == [16, 32] and 0 <= lru[16] <= lru[32] <= 1  # LRU: more slots, more hits
    assert all(number(r["tokens/s"]) > 0 for r in cache + switches)


def test_bench_streaming_formats_quick(tmp_path):
    """The formats section: at one cache size, the smaller the experts the more slots it
    buys and the fewer bytes a token reads."""
    text = bench_streaming.main(["--quick", "--sections", "formats", "--work", str(tmp_path)])
    (rows,) = tables(text)
    assert [r["experts"] for r in rows] == [
        "MXFP4",
        "3-bit affine, groups of 64",
        "2-bit affine, groups of 64",
    ]
    assert len({r["cache GB"] for r in rows}) == 1
    slots = [number(r["slots / layer"]) for r in rows]
    assert slots[0] < slots[1] < slots[2]
    assert number(rows[0]["vs MXFP4"]) == 1 and number(rows[2]["vs MXFP4"]) < 1
    assert all(number(r["tokens/s"]) > 0 for r in rows)


@pytest.mark.slow
def test_expert_formats_quick(tmp_path):
    """``benchmarks/expert_formats.py --quick``: the candidates, the layer errors (the 2-bit
    format's larger than the 3-bit one's), and the model rows beside the ablation."""
    text = expert_formats.main(["--quick", "--out", str(tmp_path / "f.md")])
    candidates, layers, per_layer, model = tables(text)
    shipped = [r for r in candidates if "(shipped)" in r["format"]]
    assert [r["fit"] for r in shipped] == ["least squares"] * 2
    for r in candidates[1:]:  # least squares beats mx.quantize at every width and group
        if r["fit"] == "least squares":
            twin = next(
                c
                for c in candidates
                if c["format"] == r["format"].replace(" (shipped)", "")
                and c["fit"] == "mx.quantize"
            )
            assert number(r[list(r)[5]]) < number(twin[list(twin)[5]])
    errs = {r["experts"]: number(r["the checkpoint's layers: mean"]) for r in layers}
    assert 0 < errs["3-bit affine, groups of 64"] < errs["2-bit affine, groups of 64"] < 1
    assert len(per_layer) == 7
    assert [r["model"] for r in model] == [
        "MXFP4 experts (the checkpoint)",
        "experts 3-bit affine, groups of 64 (--expert-bits 3)",
        "experts 2-bit affine, groups of 64 (--expert-bits 2)",
        "routed experts zeroed (shared only)",
    ]
    assert all(number(r["KL from MXFP4 (nats/token)"]) >= 0 for r in model)


@pytest.mark.slow
def test_bench_cache_policy_quick(tmp_path):
    """Every table; in each policy table the optimum's hit rate is the highest and every
    rate a fraction; the default misses at least as often as the optimum."""
    out = tmp_path / "cache.md"
    text = bench_cache_policy.main(["--quick", "--out", str(out)])
    assert out.read_text() == text
    *policy_tables, gaps, candidates = tables(text)
    assert len(policy_tables) == len(bench_cache_policy.DECODES) + 2  # and two prefills
    for rows in policy_tables:
        assert [r["policy"] for r in rows] == ["flat routing (h = cache fraction)"] + [
            label for label, _, _ in bench_cache_policy.POLICY_ROWS
        ]
        budgets = [k for k in rows[0] if k != "policy"]
        assert budgets == ["4 slots (0.0625)", "8 slots (0.125)", "16 slots (0.25)"]
        flat = [number(rows[0][k]) for k in budgets]
        assert flat == pytest.approx([4 / 64, 8 / 64, 16 / 64], abs=1e-3)
        for k in budgets:
            rates = [number(r[k]) for r in rows[1:]]
            assert all(0 <= h <= 1 for h in rates) and rates[-1] == max(rates)
    phases = [title for title, _ in bench_cache_policy.DECODES] + ["prefill, chunks of 32"]
    assert sorted({r["phase"] for r in gaps}) == sorted(phases)
    assert all(number(r["default misses / belady misses"]) >= 1 for r in gaps)
    assert all(r["prompts where the default misses no more than lru"][-2:] == "/2" for r in gaps)
    assert len(candidates) == 2 + len(bench_cache_policy.CANDIDATES) + 1


@pytest.mark.slow
def test_profile_kernels_quick(monkeypatch):
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    names = profile_kernels.main(["--quick"])
    assert set(names) == {
        "kda_decode",
        "kda_prefill",
        "mxfp4_mma",
        "mxfp4_one",
        "mxfp4_prefill_mma",
        "mxfp4_decode",
        "mxfp4_prefill",
    }


@pytest.mark.slow
def test_bench_server_quick():
    """Every table of the server benchmark, and the load test lost nothing: each request
    was answered (200) or refused (429), and the server answered afterwards."""
    throughput, overflow, ttft, turns, load, resident = tables(bench_server.main(["--quick"]))
    for table in (throughput, resident):
        assert [r["clients"] for r in table] == ["1", "4", "8"]
        for r in table:
            assert number(r["aggregate tok/s"]) > 0 and number(r["forward alone tok/s"]) > 0
            assert number(r["server / forward"]) > 0
    assert overflow[0]["overflow area"].endswith("(the server's default)")
    assert overflow[1]["overflow area"] == "none (rounds)"
    assert all(number(r["8 rows tok/s"]) > 0 < number(r["1 row tok/s"]) for r in overflow)
    assert len(ttft) == 2 and all(number(r["seconds (median)"]) > 0 for r in ttft)
    assert int(turns[1]["reused"]) >= int(turns[0]["prompt tokens"])
    assert int(turns[2]["reused"]) == 0
    counts = {r[next(iter(r))]: r["count"] for r in load}
    assert set(counts) == {"200", "429", "seconds", "health after", "a request after"} - (
        {"429"} if "429" not in counts else set()
    )
    answered = int(counts["200"]) + int(counts.get("429", 0))
    assert answered == 12
    assert counts["health after"] == "ok" and counts["a request after"] == "200"


@pytest.mark.slow
def test_bench_trim_quick(tmp_path):
    """Every quick setting a row; the untrimmed one keeps all 4 experts at no cost; trimming
    keeps fewer, costs some KL and reads fewer experts on the same decode inputs. Shedding
    misses drops weight, keeps fewer experts and reads fewer bytes than the exact streamed
    decode, beside the routed experts zeroed."""
    out, png = tmp_path / "trim.md", tmp_path / "trim.png"
    text = bench_trim.main(["--quick", "--out", str(out), "--plot", str(png)])
    assert out.read_text() == text and png.stat().st_size > 0
    rows, layers, weights, shed = tables(text)
    labels = [label for label, _, _ in bench_trim.shed_settings(True)]
    assert [r["setting"] for r in shed] == [
        *labels,
        "routed experts zeroed (kimi_k3.eval's ablation)",
    ]
    kb, kl = "KB read / token", "KL from exact (nats/token)"
    exact, cut = shed[0], shed[2]
    assert abs(number(exact[kl])) < 1e-4 and number(exact["weight dropped / token and layer"]) == 0
    assert number(cut["weight dropped / token and layer"]) > 0
    assert number(cut["experts kept / token and layer"]) < 4 and number(cut[kb]) < number(exact[kb])
    assert number(shed[-1][kl]) > 0 and shed[-1][kb] == "0"
    assert bench_trim.at_equal_bytes([(0, 1.0), (10, 0.0)], 2.5) == 0.75
    assert bench_trim.at_equal_bytes([(0, 1.0), (10, 0.0)], 11) is None
    mean = [number(v) for k, v in weights[0].items() if k.startswith("rank")]
    assert mean == sorted(mean, reverse=True) and sum(mean) == pytest.approx(1, abs=0.003)
    by = {r["setting"]: r for r in rows}
    assert list(by) == [s.label for s in bench_trim.QUICK] == [r["setting"] for r in layers]
    kept, read = "experts kept / token (mean of layers)", "experts read / token (decode)"
    kl = "KL from untrimmed (nats/token)"
    off = by["untrimmed"]
    assert number(off[kept]) == 4 and number(off["vs untrimmed"]) == 1
    assert number(off["NLL change (nats/token)"]) == 0 == number(off[kl])
    for label in ("top-p 0.7", "min-weight 0.25"):
        r = by[label]
        assert 1 <= number(r[kept]) < 4 and number(r[kl]) > 0
        assert number(r[read]) < number(off[read]) and number(r["decode tok/s (median)"]) > 0
    assert number(by["no routed experts"][kept]) == 0 and by["no routed experts"][read] == "-"


@pytest.mark.slow
def test_project_k3_quick():
    """A row per machine, format, setting and prediction; each row's tok/s follows from its
    own cells; shedding, trimming, fewer bits and more machines read less a token; the
    published points, gmlx's check, the yardstick's quality beside its ablation, and the
    peers with this model at their configuration."""
    from kimi_k3.projection import PUBLISHED_HITS, shed_flat

    text = project_k3.main(["--quick", "--read-efficiency", "0.9", "--format-bits", "4.25,2.5"])
    published, check, quality, projection, peers = tables(text)
    assert len(published) == len(PUBLISHED_HITS)
    for r in check:
        want = shed_flat(0.499, number(r["P"]))
        assert abs(number(r["model"]) - want["hit_rate"]) < 1e-3
    assert quality[-1]["setting"].startswith("routed experts zeroed")
    assert len(projection) == len(project_k3.MACHINES) * 2 * len(project_k3.SETTINGS) * 2
    rows = {
        (r["configuration"], r["experts"], r["setting"], r["prediction"]): r for r in projection
    }
    exact = rows[("M5 Max 128 GB", "4.25 bits", "exact", "off")]
    # the formula, from the row's own cells: SSD bytes at 13.5 GB/s x 0.9, then compute
    ssd_s = number(exact["SSD GB / token"]) / (13.5 * 0.9)
    assert abs(ssd_s - number(exact["SSD s"])) < 0.01
    assert (
        abs(1 / (ssd_s + number(exact["compute s"])) - number(exact["tok/s (published h)"])) < 0.02
    )
    on = rows[("M5 Max 128 GB", "4.25 bits", "exact", "on")]
    spent = number(on["SSD s"]) + number(on["compute s"]) - number(on["saved by prediction s"])
    assert abs(1 / spent - number(on["tok/s (published h)"])) < 0.02
    assert number(on["tok/s (published h)"]) >= number(exact["tok/s (published h)"])
    for setting in ("top-p 0.5", "shed misses 0.8", "shed misses 0.65"):
        r = rows[("M5 Max 128 GB", "4.25 bits", setting, "off")]
        assert number(r["SSD GB / token"]) < number(exact["SSD GB / token"])
    small = rows[("M5 Max 128 GB", "2.5 bits", "exact", "off")]
    assert number(small["cache / experts"]) > number(exact["cache / experts"])
    assert number(small["SSD GB / token"]) < number(exact["SSD GB / token"])
    four = rows[("4 x M5 Max 128 GB, expert parallel", "4.25 bits", "exact", "off")]
    assert number(four["cache / experts"]) > number(exact["cache / experts"])
    assert [p["tok/s measured"] for p in peers] == [f"{p[8]:.2f}" for p in project_k3.PEERS]
    for bad in (["--read-efficiency", "1.5"], ["--format-bits", "x"], ["--format-bits", "0.5"]):
        with pytest.raises(SystemExit):
            project_k3.main(bad)


@pytest.mark.slow
def test_bench_prefetch_quick(tmp_path):
    """Off and on rows on the trained default and on a (small) slice: reads ahead only with
    prediction on, never more read in vain than read ahead, recall and precision shares."""
    text = bench_prefetch.main(["--quick", "--slice", str(tmp_path / "slice")])
    trained, predictors, sliced = tables(text)
    assert [r["layer L+1's router on"] for r in predictors] == list(bench_prefetch.PREDICTORS)
    for r in predictors:  # recall / precision: recall grows with m
        recall = [number(v.split(" / ")[0]) for k, v in r.items() if k.startswith("m = ")]
        assert recall == sorted(recall) and 0 < recall[-1] <= 1
    for table in (trained, sliced):
        assert [r["prediction"] for r in table] == [label for label, _ in bench_prefetch.SETTINGS]
        ahead = next(k for k in table[0] if k.startswith("read ahead"))
        vain = next(k for k in table[0] if k.startswith("read in vain"))
        off, *on = table
        assert off["recall"] == "-" and number(off[ahead]) == 0
        for r in on:
            assert number(r[vain]) <= number(r[ahead])
            assert 0 < number(r["recall"]) <= 1 and 0 < number(r["precision"]) <= 1
            assert number(r["tok/s"].split()[0]) > 0


@pytest.mark.slow
def test_bench_train_quick():
    (rows,) = tables(bench_train.main(["--quick", "--peak-tflops", "1"]))
    assert [r["path"] for r in rows] == ["eager (train run)", "compiled (train run --compile)"]
    for r in rows:
        assert float(r["tokens/s"].replace(",", "")) > 0
        assert float(r["MFU (of 1 TFLOP/s)"].rstrip("%")) > 0


def test_model_flops_per_token_counts_each_part():
    """The count against the model's parts, summed another way: the linear layers' weights,
    the routed experts at their top-k share, the MLA context term growing with the window."""
    import mlx.nn as nn

    from kimi_k3 import train

    preset = bench_train.QUICK
    model = train.init_model(preset)
    args = model.args
    linear = sum(
        m.weight.size
        for _, m in model.named_modules()
        if isinstance(m, nn.Linear) and m is not model.language_model.model.embed_tokens
    )
    experts = sum(
        layer.block_sparse_moe.experts.w1.size * 3
        for layer in model.layers
        if "block_sparse_moe" in layer
    )
    f1 = bench_train.model_flops_per_token(model, 1)
    f3 = bench_train.model_flops_per_token(model, 3)
    mla = sum(not layer.is_linear for layer in model.layers)
    qkv = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
    # one more token of mean context (seq 1 -> 3) per MLA layer, forward and backward
    assert f3 - f1 == pytest.approx(3 * 2 * args.num_attention_heads * qkv * mla)
    share = args.num_experts_per_token / args.num_experts
    assert f1 > 3 * 2 * (linear + share * experts)
    more_k = train.init_model(dict(preset, num_experts_per_token=4))
    grown = bench_train.model_flops_per_token(more_k, 1) - f1
    assert grown == pytest.approx(3 * 2 * (2 / args.num_experts) * experts)
