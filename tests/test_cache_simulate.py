"""The cache simulator: Belady is the optimum (exhaustive search on small traces, never
beaten on random ones), and replaying a recorded run through the shipped policies gives the
streamer's own hit and miss counts."""

import functools
import itertools

import mlx.core as mx
import numpy as np
import pytest
from test_streaming import budget_gb

from kimi_k3.checkpoint.loader import load_model
from kimi_k3.streaming import StreamOptions, get_stats
from kimi_k3.streaming.cache import make_policy
from kimi_k3.streaming.simulate import (
    Belady,
    RoutingTrace,
    Run,
    counts,
    hit_rates,
    record,
    replay,
)


def random_calls(rng, E: int, T: int, most: int, skew: float) -> list[np.ndarray]:
    """``T`` calls of 1..``most`` draws from a popularity drawn from Dirichlet(``skew``):
    small ``skew`` gives a few hot experts."""
    p = rng.dirichlet(np.full(E, skew))
    return [
        np.unique(rng.choice(E, size=int(rng.integers(1, most + 1)), p=p)).astype(np.int64)
        for _ in range(T)
    ]


def misses(calls, slots: int, policy) -> int:
    return int(replay(calls, slots, policy)[:, 1].sum())


def exhaustive_optimum(calls, slots: int) -> int:
    """Fewest misses over every choice of victims: a call that fits evicts the minimum from
    the resident experts it does not use; a larger call misses what is not resident and may
    leave any ``slots`` of its experts (the bound ``Belady`` claims for such calls)."""
    calls = [frozenset(c.tolist()) for c in calls]

    @functools.cache
    def best(t: int, resident: frozenset) -> int:
        if t == len(calls):
            return 0
        need = calls[t]
        miss = len(need - resident)
        if len(need) > slots:
            leave = itertools.combinations(sorted(need), slots)
            return miss + min(best(t + 1, frozenset(f)) for f in leave)
        over = len(resident) + miss - slots
        if over <= 0:
            return miss + best(t + 1, resident | need)
        drops = itertools.combinations(sorted(resident - need), over)
        return miss + min(best(t + 1, (resident - frozenset(d)) | need) for d in drops)

    return best(0, frozenset())


def test_belady_is_the_exhaustive_optimum():
    """On 300 small traces (3-6 experts, up to 8 calls, calls larger than the slots too)
    Belady's misses equal the exhaustive minimum; LRU's exceed it on some."""
    rng = np.random.default_rng(0)
    lru_worse = 0
    for _ in range(300):
        E = int(rng.integers(3, 7))
        slots = int(rng.integers(1, E))
        calls = random_calls(rng, E, int(rng.integers(1, 9)), E, rng.choice([0.3, 1.0, 5.0]))
        best = exhaustive_optimum(calls, slots)
        assert misses(calls, slots, Belady(calls, E)) == best, (slots, calls)
        lru_worse += misses(calls, slots, make_policy("lru", E, slots)) > best
    assert lru_worse > 20


@pytest.mark.parametrize("seed", range(3))
def test_belady_is_never_beaten(seed):
    """Random traces over 48 experts: skewed and flat popularity, calls that fit and calls
    larger than the slots (grouped), several cache sizes: no shipped policy gets more hits."""
    rng = np.random.default_rng(seed)
    E, gains = 48, 0
    for slots, most, skew in itertools.product((4, 12, 30), (4, 16, 40), (0.1, 1.0, 50.0)):
        most = max(1, min(most, 4 * slots))
        calls = random_calls(rng, E, 80, most, skew)
        opt = misses(calls, slots, Belady(calls, E))
        for name, half in (("lru", None), ("lfu", None), ("lfu", 1), ("lfu", 64)):
            other = misses(calls, slots, make_policy(name, E, slots, half_life=half))
            assert opt <= other, (slots, most, skew, name, half)
            gains += other - opt
    assert gains > 0


def test_flat_routing_hits_the_cache_fraction():
    """Uniform, independent routing: any policy's hit rate is the cache fraction (an expert
    is resident with probability slots / experts); the optimum does better."""
    rng = np.random.default_rng(1)
    E, k = 64, 4
    run = Run(phases=["decode"] * 2000)
    run.routing[1] = [
        (rng.choice(E, k, replace=False)[None].astype(np.int32), np.ones((1, k), np.float32))
        for _ in run.phases
    ]
    trace = RoutingTrace(E, k, [run])
    for policy in ("lru", "lfu"):
        for f, h in hit_rates(trace, policy, (8, 32)):
            assert h == pytest.approx(f, abs=0.02), policy
    ((f, h),) = hit_rates(trace, "belady", (8,))
    assert h > f + 0.05


def test_counts_split_by_phase_and_validate():
    """A prefill of experts 0 and 1, then decode steps on 2 and 0, two slots: LRU evicts 0
    (the older) and misses it again; the optimum evicts 1 (never used again)."""
    call = lambda *e: (np.array(e, np.int32)[:, None], np.ones((len(e), 1), np.float32))  # noqa: E731
    run = Run(["prefill", "decode", "decode"], {3: [call(0, 1), call(2), call(0)]})
    trace = RoutingTrace(4, 1, [run])
    lru, opt = counts(trace, "lru", 2), counts(trace, "belady", 2)
    assert lru["prefill"].tolist() == opt["prefill"].tolist() == [0, 2]
    assert (lru["decode"].tolist(), opt["decode"].tolist()) == ([0, 2], [1, 1])
    assert hit_rates(trace, "belady", (2,)) == [(0.5, 0.5)]
    assert hit_rates(trace, "lru", (2, 4), phase="prefill") == [(0.5, 0.0), (1.0, 0.0)]
    with pytest.raises(ValueError, match="slots=5"):
        counts(trace, "lru", 5)
    with pytest.raises(ValueError, match="phase='train'"):
        hit_rates(trace, "lru", (2,), phase="train")
    with pytest.raises(ValueError, match="policy='mru'"):
        counts(trace, "mru", 2)
    with pytest.raises(ValueError, match="lfu_half_life=0"):
        counts(trace, "lfu", 2, half_life=0)


@pytest.fixture(scope="module")
def small(ckpt_factory):
    return ckpt_factory("small", num_experts=64)  # 5 MoE layers, top-4 of 64


@pytest.mark.slow
def test_record_chunks_like_the_generator(small, tmp_path):
    """The prompt but its last token in chunks, then one call per decoded token; the trace
    survives a save and load."""
    model = load_model(small, dtype=mx.float32)
    prompts = [list(range(5, 15)), [7]]
    trace = record(model, prompts, prefill_step_size=4, decode_tokens=3)
    assert (trace.num_experts, trace.top_k, trace.layers) == (64, 4, [1, 2, 3, 4, 5])
    first, second = trace.runs
    assert first.phases == ["prefill"] * 3 + ["decode"] * 3
    assert [i.shape for i, _ in first.routing[1]] == [(4, 4), (4, 4), (1, 4)] + [(1, 4)] * 3
    assert second.phases == ["decode"] * 3
    assert all(m.route_hook is None for m in (layer.block_sparse_moe for layer in model.layers[1:]))
    trace.save(tmp_path / "t.npz")
    back = RoutingTrace.load(tmp_path / "t.npz")
    assert (back.num_experts, back.top_k, back.layers) == (64, 4, trace.layers)
    for a, b in zip(trace.runs, back.runs, strict=True):
        assert a.phases == b.phases
        for layer in a.routing:
            for (ia, wa), (ib, wb) in zip(a.routing[layer], b.routing[layer], strict=True):
                assert np.array_equal(ia, ib) and np.array_equal(wa, wb)
    with pytest.raises(ValueError, match="prefill_step_size=0"):
        record(model, prompts, prefill_step_size=0)


@pytest.mark.slow
@pytest.mark.parametrize("overflow", [0, 14], ids=["rounds", "overflow-area"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_replay_matches_the_streamer(small, policy, overflow):
    """A streamed run (prefill in chunks of 8 tokens needing more experts than the 9 slots,
    so in groups, or with an overflow area partly in one round, then 6 greedy steps) and
    the replay of its recorded routing through the same policy count the same hits and
    misses."""
    model = load_model(
        small,
        dtype=mx.float32,
        expert_cache_gb=budget_gb(small, 9),
        policy=policy,
        overflow_experts=overflow,
    )
    prompt = np.random.default_rng(5).integers(0, 1500, 25).tolist()
    trace = record(model, [prompt], prefill_step_size=8, decode_tokens=6)
    stats = get_stats(model)
    sizes = [len(c) for c in trace.runs[0].calls(1)]
    assert max(sizes) > 9  # grouped calls happened
    if overflow:  # a call of at most 9 + 14 experts always fits the area; some are larger
        assert min(n for n in sizes if n > 9) <= 9 + overflow < max(sizes)
    got = counts(trace, policy, 9, overflow)
    assert got["prefill"][1] > 0 and got["decode"][1] > 0 and got["decode"][0] > 0
    assert (stats["hits"], stats["misses"]) == tuple(got["prefill"] + got["decode"])


def test_stream_options_default_policy_and_half_life():
    assert StreamOptions().policy == "lfu"
    with pytest.raises(ValueError, match="lfu_half_life"):
        StreamOptions(lfu_half_life=0)
