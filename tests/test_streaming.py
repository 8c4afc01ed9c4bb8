"""Streamed experts against resident ones: the same logits bit for bit at any budget,
counters that match an independent cache simulation, and memory within the budget."""

import gc
from collections import OrderedDict

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import kimi_k3.model.experts
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.model.config import ModelArgs
from kimi_k3.streaming import attach_streamer, clear_cache, get_stats, reset_stats
from kimi_k3.streaming.sources import expert_bytes, expert_shapes

PROMPT = mx.array(np.random.default_rng(7).integers(0, 1500, (1, 16)))
STEPS = 6


def greedy(model, prompt, steps):
    """Prefill, then ``steps`` greedy tokens; returns the last-position logits of each call."""
    cache = model.make_cache()
    out = [model(prompt, cache=cache)[:, -1]]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1], axis=-1)[:, None], cache=cache)[:, -1])
    logits = mx.stack(out, axis=1)
    mx.eval(logits)
    return logits


def budget_gb(path, slots: int) -> float:
    """The budget that gives every MoE layer ``slots`` slots."""
    args = ModelArgs.from_path(path)
    layers = args.num_hidden_layers - args.first_k_dense_replace
    return slots * layers * expert_bytes(expert_shapes(args)) / 1e9


@pytest.fixture(scope="module")
def small(ckpt_factory):
    return ckpt_factory("small", num_experts=64)  # 5 MoE layers, top-4 of 64, 26 KB experts


@pytest.fixture(scope="module")
def reference(small):
    return greedy(load_model(small, dtype=mx.float32), PROMPT, STEPS)


def _check_accounting(stats):
    """Every read is one whole expert: demand reads are the misses, the rest reads ahead
    that no reader had taken when they were cancelled; each read ahead was used, read in
    vain or cancelled."""
    ahead = stats["prefetch_issued"] - stats["prefetch_cancelled"]
    assert stats["bytes_read"] == (stats["misses"] + ahead) * stats["expert_bytes"]
    settled = stats["prefetch_hits"] + stats["prefetch_unused"] + stats["prefetch_cancelled"]
    assert stats["prefetch_issued"] == settled
    assert stats["prefetch_unused_bytes"] == stats["prefetch_unused"] * stats["expert_bytes"]
    assert stats["cache_bytes"] <= stats["budget_bytes"]


@pytest.mark.parametrize("slots", [64, 16, 4], ids=["100%", "25%", "top-k"])
def test_streamed_logits_equal_resident(small, reference, slots):
    """Bitwise equal fp32 logits over a 16-token prefill and 6 greedy steps; with 16 and 4
    slots the prefill needs more experts than a layer holds and runs in groups."""
    model = load_model(small, dtype=mx.float32, expert_cache_gb=budget_gb(small, slots))
    logits = greedy(model, PROMPT, STEPS)
    assert mx.array_equal(logits, reference).item()
    stats = get_stats(model)
    assert stats["slots_per_layer"] == slots and stats["source"] == "shards"
    assert stats["tokens"] == 16 + STEPS and stats["passes"] == 1 + STEPS
    assert stats["misses"] > 0 and stats["read_gbps"] > 0
    _check_accounting(stats)
    assert not any(k for k, _ in tree_flatten(model.parameters()) if ".experts." in k)


@pytest.mark.parametrize(
    "opts",
    [
        {"prefetch": True},
        {"policy": "lfu"},
        {"overlap": True},
        {"write_mode": "mlx"},
        {"direct_io": False},
        {"io_threads": 1},
        {"prefetch": True, "policy": "lru"},
        {"prefetch": True, "prefetch_limit": 1},
        {"overflow_experts": 48, "prefetch": True},
        {"overflow_experts": 48, "io_threads": 1},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_options_never_change_the_output(small, reference, opts):
    model = load_model(small, dtype=mx.float32, expert_cache_gb=budget_gb(small, 16), **opts)
    assert mx.array_equal(greedy(model, PROMPT, STEPS), reference).item()
    clear_cache(model)  # reads ahead still in flight end first
    stats = get_stats(model)
    _check_accounting(stats)
    if opts.get("prefetch"):
        assert 0 < stats["prefetch_hits"] <= stats["prefetch_issued"]
        assert 0.0 < stats["prediction_recall"] <= 1.0
        assert 0.0 < stats["prediction_precision"] <= 1.0
        limit = opts.get("prefetch_limit", 4)  # top-k
        predicted_calls = stats["passes"] * (stats["layers"] - 1)  # the last layer has no next
        assert stats["prefetch_issued"] <= limit * predicted_calls
    else:
        assert stats["prefetch_issued"] == 0 and stats["prediction_recall"] is None
    assert (stats["overflow_misses"] > 0) == ("overflow_experts" in opts)  # the prefill chunk


def test_a_read_cancelled_before_a_reader_takes_it_is_never_read(small, tmp_path):
    """``ReadJob.cancel``: a job cancelled while queued is answered at once, its destination
    never written and nothing counted read; a job a reader has finished cannot be
    cancelled."""
    from kimi_k3.streaming.io import FileTable, ReadJob, ReadPool
    from kimi_k3.streaming.store import find_streamer

    model = load_model(small, dtype=mx.float32, expert_cache_gb=budget_gb(small, 4))
    streamer = find_streamer(model)
    layer = streamer.order[0]
    pool = ReadPool(FileTable(streamer.source.files, True), 1)
    try:
        views = streamer.stores[layer].pool.views
        dest = {n: np.full(v.shape[1], 7, np.uint8) for n, v in views.items()}
        extents, checksum = streamer._where(layer, 3)
        dropped = ReadJob(layer, 3, extents, dest, checksum)
        assert dropped.cancel() and dropped.done.is_set() and dropped.error is None
        read = ReadJob(layer, 3, extents, {n: v.copy() for n, v in dest.items()}, checksum)
        pool.submit([dropped, read])
        read.wait(30)
        assert all((v == 7).all() for v in dest.values())  # never written
        assert not all((v == 7).all() for v in read.dest.values())
        assert pool.meter.snapshot()[1] == 1  # one read
        assert not read.cancel()
    finally:
        pool.close()


def _routing_trace(model, tokens) -> list[list[np.ndarray]]:
    """Per call, per MoE layer, the sorted distinct experts the resident model routes to."""
    calls = []
    glu = kimi_k3.model.experts.expert_glu

    def record(z, w, inds, weights, beta, cap):
        calls[-1].append(np.unique(np.array(inds)))
        return glu(z, w, inds, weights, beta, cap)

    kimi_k3.model.experts.expert_glu = record
    try:
        cache = model.make_cache()
        for t in tokens:
            calls.append([])
            mx.eval(model(mx.array([[t]]), cache=cache))
    finally:
        kimi_k3.model.experts.expert_glu = glu
    return calls


def _simulate(trace, slots: int, policy: str) -> tuple[int, int]:
    """Hits and misses of per-layer caches of ``slots`` experts, written independently of the
    streamer: LRU as an OrderedDict; LFU as counts halved every 4*slots uses, ties to LRU."""
    hits = misses = 0
    layers = len(trace[0])
    state = [
        {"lru": OrderedDict(), "freq": {}, "last": {}, "clock": 0, "uses": 0} for _ in range(layers)
    ]
    for call in trace:
        for st, need in zip(state, call, strict=True):
            need = need.tolist()
            cached = st["lru"]
            hit = [e for e in need if e in cached]
            miss = [e for e in need if e not in cached]
            hits, misses = hits + len(hit), misses + len(miss)
            over = len(cached) + len(miss) - slots
            cand = [e for e in cached if e not in need]  # LRU order, oldest first
            if policy == "lfu":
                cand.sort(key=lambda e: (st["freq"].get(e, 0.0), st["last"][e]))
            for e in cand[: max(over, 0)]:
                del cached[e]
            for e in need:  # ascending ids: the streamer's tie order
                cached[e] = True
                cached.move_to_end(e)
                st["clock"] += 1
                st["last"][e] = st["clock"]
                st["freq"][e] = st["freq"].get(e, 0.0) + 1
            st["uses"] += len(need)
            while st["uses"] >= 4 * slots:
                st["freq"] = {e: f / 2 for e, f in st["freq"].items()}
                st["uses"] -= 4 * slots
    return hits, misses


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("slots", [4, 9])
def test_counters_match_a_cache_simulation(small, policy, slots):
    """Token-by-token decode of 24 tokens: hits and misses equal an independent simulation
    of the policy on the resident model's routing (so eviction does what it says)."""
    tokens = np.random.default_rng(3).integers(0, 1500, 24).tolist()
    trace = _routing_trace(load_model(small, dtype=mx.float32), tokens)
    model = load_model(
        small, dtype=mx.float32, expert_cache_gb=budget_gb(small, slots), policy=policy
    )
    cache = model.make_cache()
    for t in tokens:
        mx.eval(model(mx.array([[t]]), cache=cache))
    stats = get_stats(model)
    assert (stats["hits"], stats["misses"]) == _simulate(trace, slots, policy)
    _check_accounting(stats)


def _distinct_in_prefill(path) -> list[int]:
    """Distinct experts per MoE layer of the resident model's pass over ``PROMPT``."""
    glu, seen = kimi_k3.model.experts.expert_glu, []

    def record(z, w, inds, weights, beta, cap):
        seen.append(len(np.unique(np.array(inds))))
        return glu(z, w, inds, weights, beta, cap)

    kimi_k3.model.experts.expert_glu = record
    try:
        mx.eval(load_model(path, dtype=mx.float32)(PROMPT))
    finally:
        kimi_k3.model.experts.expert_glu = glu
    return seen


@pytest.mark.parametrize("slots", [64, 4])
def test_prefill_reads_each_distinct_expert_once(small, slots):
    """A cold 16-token prefill reads every distinct expert of each layer exactly once, also
    when the chunk needs more experts than the layer's slots (groups)."""
    seen = _distinct_in_prefill(small)
    model = load_model(small, dtype=mx.float32, expert_cache_gb=budget_gb(small, slots))
    mx.eval(model(PROMPT))
    stats = get_stats(model)
    assert max(seen) > 4 * 4  # a chunk needs more experts than 4 slots hold
    assert (stats["hits"], stats["misses"]) == (0, sum(seen))
    _check_accounting(stats)


@pytest.mark.parametrize("overflow", [0, 6, 60])
def test_overflow_area_gives_the_resident_bits(small, reference, overflow):
    """Top-k slots and an overflow area: too small for the prefill's misses (6: rounds
    of slots) or holding them (60: one round, two groups); the resident logits bit for
    bit, every distinct expert of the prefill read once, and the area's bytes reported."""
    model = load_model(
        small, dtype=mx.float32, expert_cache_gb=budget_gb(small, 4), overflow_experts=overflow
    )
    mx.eval(model(PROMPT))
    cold = get_stats(model)
    assert (cold["hits"], cold["misses"]) == (0, sum(_distinct_in_prefill(small)))
    assert (cold["overflow_misses"] > 0) == (overflow == 60)  # 6 is too few: rounds
    clear_cache(model)
    reset_stats(model)
    assert mx.array_equal(greedy(model, PROMPT, STEPS), reference).item()
    stats = get_stats(model)
    assert stats["overflow_experts"] == overflow
    assert stats["overflow_bytes"] == overflow * stats["expert_bytes"]
    _check_accounting(stats)


@pytest.mark.slow
def test_overflow_area_in_a_batch_decode(small):
    """Four rows decoded together (a step needs up to 16 experts of a layer, the cache
    holds 4): with an overflow area of 12 every step reads its experts in one round, and
    the logits equal the resident model's bit for bit (slots written through views, or by
    MLX assignment, or holding CUDA's tiles); the same without the area."""
    prompt = mx.array(np.random.default_rng(11).integers(0, 1500, (4, 6)))
    want = greedy(load_model(small, dtype=mx.float32), prompt, 4)
    for overflow, mode, layout in (
        (12, "auto", "mlx"),
        (12, "mlx", "mlx"),
        (12, "auto", "tiled"),
        (0, "auto", "mlx"),
    ):
        model = load_model(
            small,
            dtype=mx.float32,
            expert_cache_gb=budget_gb(small, 4),
            overflow_experts=overflow,
            write_mode=mode,
            expert_layout=layout,
        )
        assert get_stats(model)["expert_layout"] == layout
        assert mx.array_equal(greedy(model, prompt, 4), want).item(), (overflow, mode, layout)
        assert (get_stats(model)["overflow_misses"] > 0) == (overflow > 0)


def test_overflow_sizing_and_bad_values(small):
    from kimi_k3.streaming.store import StreamOptions, find_streamer, overflow_for_batch

    model = load_model(small, dtype=mx.float32, expert_cache_gb=budget_gb(small, 9))
    streamer = find_streamer(model)
    # top-4 of 64 experts, 9 slots: one row needs at most 4, eight rows 32, 20 rows 64
    assert [overflow_for_batch(streamer, r) for r in (1, 2, 3, 8, 20)] == [0, 0, 3, 23, 55]
    streamer.set_overflow(1000)  # at most the experts streamed
    assert get_stats(model)["overflow_experts"] == 64
    streamer.set_overflow(0)
    assert get_stats(model)["overflow_bytes"] == 0
    with pytest.raises(ValueError, match="overflow_experts=-1"):
        streamer.set_overflow(-1)
    with pytest.raises(ValueError, match="overflow_experts"):
        StreamOptions(overflow_experts=-1)


def test_stats_api(small, tiny_ckpt):
    assert get_stats(load_model(tiny_ckpt, dtype=mx.float32)) is None
    model = load_model(small, dtype=mx.float32, expert_cache_gb=budget_gb(small, 8))
    greedy(model, PROMPT, 2)
    stats = get_stats(model)
    for key in (
        "hits",
        "misses",
        "hit_rate",
        "bytes_read",
        "read_seconds",
        "read_gbps",
        "prefetch_hits",
        "prefetch_issued",
        "prefetch_accuracy",
        "cache_bytes",
        "budget_bytes",
        "wait_seconds",
        "compute_seconds",
        "per_token",
        "last_pass",
    ):
        assert key in stats, key
    assert stats["hit_rate"] == stats["hits"] / (stats["hits"] + stats["misses"])
    assert stats["per_token"]["bytes_read"] == stats["bytes_read"] / stats["tokens"]
    assert stats["last_pass"]["tokens"] == 1 and stats["last_pass"]["passes"] == 1
    reset_stats(model)
    zero = get_stats(model)
    assert (zero["hits"], zero["misses"], zero["bytes_read"], zero["tokens"]) == (0, 0, 0, 0)
    # An emptied cache: one token misses its 4 experts in each of the 5 MoE layers.
    clear_cache(model)
    mx.eval(model(PROMPT[:, :1], cache=model.make_cache()))
    stats = get_stats(model)
    assert (stats["hits"], stats["misses"]) == (0, 20)


def test_budget_below_top_k_per_layer_is_refused(small):
    with pytest.raises(ValueError, match="5 MoE layers x top-4 need at least 20"):
        load_model(small, dtype=mx.float32, expert_cache_gb=budget_gb(small, 4) * 0.99)


def test_attach_to_a_loaded_model_drops_resident_experts(small, reference):
    model = load_model(small, dtype=mx.float32)
    before = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    attach_streamer(model, small, None, budget_gb(small, 16))
    after = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert before - after == 5 * 64 * get_stats(model)["expert_bytes"]
    assert mx.array_equal(greedy(model, PROMPT, STEPS), reference).item()


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                vals[line.split(":")[0]] = int(line.split()[1]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def _peak_during(fn) -> tuple[int, int, int, int]:
    """(MLX active before, MLX peak, RSS before, RSS peak) around ``fn()``."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    active, rss = mx.get_active_memory(), _rss()[0]
    fn()
    return active, mx.get_peak_memory(), rss, _rss()[1]


def _resident_peak(path):
    resident = load_model(path, dtype=mx.float32)
    return _peak_during(lambda: greedy(resident, PROMPT, 4))


@pytest.mark.slow
@pytest.mark.skipif(
    not __import__("os").path.exists("/proc/self/clear_refs"),
    reason="needs Linux /proc to reset the peak RSS",
)
def test_memory_stays_within_dense_plus_budget(ckpt_factory):
    """Experts 4x the budget (53 MB of experts, 13 MB budget). Streamed: MLX memory after
    loading is the dense weights plus the pools, and the peak during generation grows by no
    more than the resident model's activations plus the grouped-prefill buffers (+1 MB);
    the process RSS grows by no more than that, the read buffers and 16 MB."""
    path = ckpt_factory(
        "small",
        num_hidden_layers=3,
        full=(3,),
        num_experts=64,
        routed_expert_hidden_size=512,
        moe_intermediate_size=512,
    )
    all_experts = 2 * 64 * expert_bytes(expert_shapes(ModelArgs.from_path(path)))
    r_active, r_peak, _, _ = _resident_peak(path)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()  # whatever earlier tests left alive in this process
    model = load_model(path, dtype=mx.float32, expert_cache_gb=all_experts / 4 / 1e9)
    stats = get_stats(model)
    dense = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert stats["cache_bytes"] <= stats["budget_bytes"] == all_experts // 4
    greedy(model, PROMPT, 4)  # warm: MLX caches compiled kernels and buffers
    active, peak, rss, rss_peak = _peak_during(lambda: greedy(model, PROMPT, 4))
    assert active - before <= dense + stats["cache_bytes"] + (1 << 20)
    grouped = 2 * 16 * 4 * 512 * 4  # [N*k, Dl] fp32 sums, two alive at once
    activations = (r_peak - r_active) + grouped + (1 << 20)
    assert peak - active <= activations
    assert rss_peak - rss <= activations + stats["overhead_bytes"] + (16 << 20)
