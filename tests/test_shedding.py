"""Shedding misses (``kimi_k3.model.routing.shed``): the rule against a plain-Python reference,
off and nothing-to-drop are bitwise the unshed model, a streamed shedding model equals the
resident model given the same cache states bit for bit, a dropped expert is never read, and
the setting reaches the model from ``load``, ``generate`` and ``server``."""

import math

import mlx.core as mx
import numpy as np
import pytest
from test_streaming import PROMPT, STEPS, budget_gb, greedy

import kimi_k3
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.model import routing
from kimi_k3.model.moe import moe_blocks
from kimi_k3.streaming import get_stats
from kimi_k3.streaming.store import find_streamer


@pytest.fixture(scope="module")
def small(ckpt_factory):
    return ckpt_factory("small", num_experts=64)  # test_streaming's: top-4 of 64


def reference_keep(ids, w, cached, p):
    """The rule per call in plain Python (float64): which choices are kept."""
    N, k = ids.shape
    real = [[j == 0 or ids[n, j] != ids[n, 0] for j in range(k)] for n in range(N)]
    r = []
    for n in range(N):
        total = sum(float(w[n, j]) for j in range(k) if real[n][j])
        r.append([float(w[n, j]) / total if real[n][j] else 0.0 for j in range(k)])
    avail = {int(ids[n, j]) for n in range(N) for j in range(k) if real[n][j] and cached[n, j]}
    for n in range(N):
        avail.add(int(ids[n, max(range(k), key=lambda j: (r[n][j], -j))]))
    while True:
        forced = set()
        for n in range(N):
            mass = sum(r[n])
            out = [j for j in range(k) if real[n][j] and int(ids[n, j]) not in avail]
            out.sort(key=lambda j, n=n: (r[n][j], j))
            for i, j in enumerate(out):
                if mass - r[n][j] < p:
                    forced |= {int(ids[n, jj]) for jj in out[i:]}
                    break
                mass -= r[n][j]
        if not forced:
            break
        avail |= forced
    return np.array([[real[n][j] and int(ids[n, j]) in avail for j in range(k)] for n in range(N)])


def _routing(rng, N, E=32, k=6):
    logits = rng.normal(0, 2, (N, E)).astype(np.float32)
    inds, w = routing.route(mx.array(logits), mx.zeros((E,)), k, 2.5, True)
    return np.array(inds), np.array(w)


@pytest.mark.parametrize("p", [0.0, 0.5, 0.7, 0.9])
def test_rule_matches_a_reference(p):
    """Per call of 1 and of 12 tokens, with trimmed choices among them: the kept choices,
    weights renormalised over them, and dropped ones as zero-weight copies of the first."""
    rng = np.random.default_rng(int(p * 10))
    for N in (1, 1, 1, 12):
        ids, w = _routing(rng, N)
        ids[0, 5], w[0, 5] = ids[0, 0], 0.0  # a choice trimming dropped, as trimming
        w[0] *= 2.5 / w[0].sum()  # renormalises the rest
        cached = rng.random(ids.shape) < 0.4
        keep = routing.shed_keep(ids, w, cached, p)
        assert (keep == reference_keep(ids, w, cached, p)).all()
        assert keep[np.arange(N), w.argmax(-1)].all()  # the heaviest, cached or not
        assert (keep | ~cached | ~routing.kept(ids)).all()  # nothing cached is dropped
        inds, weights, pairs, mass = routing.shed(
            mx.array(ids), mx.array(w), lambda _, c=cached: c, p, 2.5, True
        )
        got_ids, got_w = np.array(inds), np.array(weights)
        mask = routing.kept(got_ids)
        assert pairs == int((routing.kept(ids) & ~keep).sum())
        r = w / w.sum(-1, keepdims=True)
        assert mass == pytest.approx(float(r[routing.kept(ids) & ~keep].sum()))
        for n in range(N):
            want = {int(e): float(x) for e, x in zip(ids[n][keep[n]], w[n][keep[n]], strict=True)}
            total = sum(want.values())
            want = {e: x / total * 2.5 for e, x in want.items()}
            got = dict(zip(got_ids[n][mask[n]].tolist(), got_w[n][mask[n]].tolist()))
            assert got == pytest.approx(want, rel=1e-5)
            if pairs:  # else the routing as it came (see the next test)
                assert np.all(np.diff(got_w[n][mask[n]]) <= 0)  # kept first, heaviest first
            assert (got_ids[n][~mask[n]] == got_ids[n, 0]).all()
            assert (got_w[n][~mask[n]] == 0).all()
        assert got_ids.shape[1] == keep.sum(-1).max()  # the unused columns cut


def test_a_chunk_keeps_what_it_reads_anyway():
    """Two tokens: the first must keep its uncached heaviest expert 9, so it is read, and the
    second, which alone would drop 9, keeps it too; it drops its own uncached light expert."""
    ids = np.array([[9, 1, 2, 3], [4, 5, 9, 7]])
    w = np.array([[0.7, 0.1, 0.1, 0.1], [0.4, 0.3, 0.2, 0.1]], np.float32)
    cached = np.array([[False, True, True, True], [True, True, False, False]])
    keep = routing.shed_keep(ids, w, cached, 0.5)
    assert keep.tolist() == [[True, True, True, True], [True, True, True, False]]
    alone = routing.shed_keep(ids[1:], w[1:], cached[1:], 0.5)
    assert alone.tolist() == [[True, True, False, False]]


def test_check_names_the_bad_value():
    assert routing.check_shed(0) == 0.0 and routing.check_shed(1) == 1.0
    for value, words in [
        (1.5, "shed_misses must be at least 0 and at most 1, got 1.5"),
        (-0.1, "shed_misses must be at least 0"),
        (math.nan, "shed_misses must be at least 0"),
        ("0.9", "shed_misses must be a number, got '0.9'"),
        (True, "shed_misses must be a number"),
    ]:
        with pytest.raises(ValueError, match=words):
            routing.check_shed(value)
    with pytest.raises(ValueError, match="^shed_misses must be at least 0"):
        kimi_k3.load("/no/such/model", shed_misses=-1)  # checked before anything is read


def test_off_and_nothing_to_drop_are_the_unshed_model(small):
    """Shedding off computes exactly the unshed model, and so does shedding on resident
    experts (every expert cached: nothing to drop); with trimming on as well, exactly the
    trimmed model."""
    model = load_model(small, dtype=mx.float32)
    tokens = PROMPT[:, :12]
    want = model(tokens)
    routing.set_shed_misses(model, 0.0)
    assert routing.shed_misses(model) == 0.0
    assert mx.array_equal(model(tokens), want).item()
    kimi_k3.set_expert_trimming(model, top_p=0.6)
    trimmed = model(tokens)
    routing.set_shed_misses(model)
    assert routing.shed_misses(model) == 1.0
    assert mx.array_equal(model(tokens), trimmed).item()
    with pytest.raises(ValueError, match="p must be at least 0"):
        routing.set_shed_misses(model, 2)


def _record_cache_states(model) -> list:
    """Wrap every streamed store's ``cached`` to record (layer, ids, answer) in call order."""
    seen = []
    for layer, moe in moe_blocks(model).items():
        store, ask = moe.experts, moe.experts.cached

        def cached(ids, layer=layer, ask=ask):
            got = ask(ids)
            seen.append((layer, ids.copy(), got.copy()))
            return got

        store.cached = cached
    return seen


def _replay_cache_states(model, seen: list):
    """Give every resident store a ``cached`` that answers as the recorded calls did."""
    queue = list(seen)

    def make(layer):
        def cached(ids):
            got_layer, got_ids, answer = queue.pop(0)
            assert got_layer == layer and (got_ids == ids).all()
            return answer

        return cached

    for layer, moe in moe_blocks(model).items():
        moe.experts.cached = make(layer)
    return queue


@pytest.mark.parametrize("p", [0.5, 0.0])
def test_streamed_equals_resident_in_the_same_cache_states(small, p):
    """At 16 slots of 64 (misses, a prefill chunk run in groups), the shedding streamed
    model's fp32 logits equal the resident model's bit for bit when the resident stores
    answer ``cached`` as the streamed cache did; shedding dropped choices, every read was of
    a kept expert, and the run read fewer bytes than the unshed streamed model."""
    gb = budget_gb(small, 16)
    model = load_model(small, dtype=mx.float32, expert_cache_gb=gb)
    routing.set_shed_misses(model, p)
    seen = _record_cache_states(model)
    streamer = find_streamer(model)
    reads, submit = [], streamer.io.submit

    def watched(jobs, *rest):
        reads.extend((j.layer, j.expert) for j in jobs)
        return submit(jobs, *rest)

    streamer.io.submit = watched
    kept = []
    run = streamer.run

    def watched_run(store, z, inds, weights):
        ids = np.array(inds)
        kept.append((store.layer, set(ids[routing.kept(ids)].tolist())))
        return run(store, z, inds, weights)

    streamer.run = watched_run
    got = greedy(model, PROMPT, STEPS)
    stats = get_stats(model)
    assert stats["shed_pairs"] > 0 and 0 < stats["shed_mass_share"] < 1
    assert stats["experts_per_token"] < 4
    needed = {}
    for layer, experts in kept:
        needed.setdefault(layer, set()).update(experts)
    assert reads and all(e in needed[layer] for layer, e in reads)

    resident = load_model(small, dtype=mx.float32)
    routing.set_shed_misses(resident, p)
    left = _replay_cache_states(resident, seen)
    assert mx.array_equal(greedy(resident, PROMPT, STEPS), got).item()
    assert not left  # every recorded state was asked for, in order

    unshed = load_model(small, dtype=mx.float32, expert_cache_gb=gb)
    greedy(unshed, PROMPT, STEPS)
    assert stats["bytes_read"] < get_stats(unshed)["bytes_read"]


def test_load_and_cli_flags_reach_the_model(small, tiny_ckpt, capsys, monkeypatch):
    """``load(shed_misses=)`` sets it; ``generate`` loads with ``--shed-misses``, says so and
    gives the experts kept a token; the server hands it to the loader; a bad value is one
    ``error:`` line and exit status 2."""
    from kimi_k3 import server
    from kimi_k3.checkpoint.files import CheckpointError
    from kimi_k3.generate import main

    model, _ = kimi_k3.load(small, expert_cache_gb=budget_gb(small, 8), shed_misses=0.3)
    assert kimi_k3.shed_misses(model) == 0.3
    argv = ["--model", str(tiny_ckpt), "--max-tokens", "3", "--expert-cache-gb", "0.001"]
    assert main([*argv, "--shed-misses", "0"]) == 0
    err = capsys.readouterr().err
    assert "shedding misses down to 0 of the weight" in err
    kept = float(err.split(" of 2 a token")[0].rsplit(", ", 1)[1])
    assert 1 <= kept <= 2
    assert main(["--model", str(tiny_ckpt), "--max-tokens", "1", "--shed-misses", "0.5"]) == 0
    assert "nothing to shed: every expert is resident" in capsys.readouterr().err
    seen = []

    def fake_load(path, expert_cache_gb, verify, plan=None, **options):
        seen.append(options)
        raise CheckpointError("stop here")

    monkeypatch.setattr(server, "load_for_cli", fake_load)
    assert server.main(["--model", str(tiny_ckpt), "--port", "0", "--shed-misses", "0.7"]) == 1
    assert seen == [{"expert_top_p": 1.0, "expert_min_weight": 0.0, "shed_misses": 0.7}]
    capsys.readouterr()
    for command in (main, server.main):
        for bad in ("1.5", "-0.1", "nan", "x"):
            try:
                status = command(["--model", str(tiny_ckpt), "--shed-misses", bad])
            except SystemExit as e:  # argparse's own (not a number)
                status = e.code
            assert status == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("error:") and "--shed-misses" in err[0]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_replay_with_shedding_matches_the_streamer(small, policy):
    """A shedding streamed run (a prefill in chunks of 8 needing more experts than the 9
    slots, then greedy steps) and the replay of its recorded routing with the same shedding
    count the same hits, misses, pairs kept and weight dropped."""
    from kimi_k3.streaming.simulate import counts, hit_rates, record

    model = load_model(small, dtype=mx.float32, expert_cache_gb=budget_gb(small, 9), policy=policy)
    routing.set_shed_misses(model, 0.4)
    prompt = np.random.default_rng(5).integers(0, 1500, 25).tolist()
    trace = record(model, [prompt], prefill_step_size=8, decode_tokens=6)
    stats = get_stats(model)
    assert stats["shed_pairs"] > 0
    got = counts(trace, policy, 9, shed=0.4, detail=True)
    both = got["prefill"] + got["decode"]
    assert (stats["hits"], stats["misses"], stats["pairs"]) == tuple(both[:3].astype(int))
    assert both[3] == pytest.approx(stats["shed_mass"])
    unshed = counts(trace, policy, 9, detail=True)
    assert unshed["decode"][2] > got["decode"][2]  # without shedding every choice is kept
    (_, shed_rate), (_, rate) = hit_rates(trace, policy, [9], shed=0.4) + hit_rates(
        trace, policy, [9]
    )
    assert shed_rate > rate
    with pytest.raises(ValueError, match="no Belady replay"):
        counts(trace, "belady", 9, shed=0.4)
