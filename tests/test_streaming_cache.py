"""Expert-cache pieces on their own: eviction policies, slot bookkeeping, budget sizing."""

import threading

import numpy as np
import pytest

import kimi_k3.streaming.cache as cache_mod
from kimi_k3.streaming import StreamOptions, default_cache_gb
from kimi_k3.streaming.cache import LFU, LRU, SlotCache, available_memory, slots_per_layer


def _ids(*e):
    return np.array(sorted(e), np.int64)


def test_lru_evicts_least_recently_used():
    p = LRU(8)
    for e in (3, 1, 4, 5):
        p.use(_ids(e))
    p.use(_ids(3))  # 3 is fresh again
    assert p.victims(_ids(1, 3, 4, 5), 2).tolist() == [1, 4]
    assert p.victims(_ids(3, 5), 1).tolist() == [5]


def test_lru_ties_within_one_call_break_by_expert_id():
    p = LRU(8)
    p.use(_ids(6, 2, 4))  # stamped 2, 4, 6
    assert p.victims(_ids(2, 4, 6), 3).tolist() == [2, 4, 6]


def test_lfu_keeps_the_frequent_expert_that_lru_would_drop():
    lru, lfu = LRU(8), LFU(8, half_life=1000)
    for p in (lru, lfu):
        for _ in range(5):
            p.use(_ids(0))
        p.use(_ids(1))
        p.use(_ids(2))
    cand = _ids(0, 1, 2)
    assert lru.victims(cand, 1).tolist() == [0]
    assert lfu.victims(cand, 1).tolist() == [1]  # count 1, older than 2


def test_lfu_ageing_forgets_an_old_favourite():
    p = LFU(4, half_life=4)
    for _ in range(8):
        p.use(_ids(0))  # counts halve at the 4th and 8th use: 4 -> 2, 6 -> 3
    assert p.freq[0] == 3.0
    for _ in range(8):
        p.use(_ids(1))  # two more halvings: expert 0 fades to 0.75, expert 1 ends at 3
    assert (p.freq[0], p.freq[1]) == (0.75, 3.0)
    assert p.victims(_ids(0, 1), 1).tolist() == [0]


def test_lfu_without_ageing_would_keep_the_old_favourite():
    p = LFU(4, half_life=10**9)
    for _ in range(8):
        p.use(_ids(0))
    for _ in range(4):
        p.use(_ids(1))
    assert p.victims(_ids(0, 1), 1).tolist() == [1]


def test_slot_cache_free_slots_first_then_policy_victims():
    c = SlotCache(3, LRU(10))
    s = c.assign(_ids(1, 2, 3), pinned=set())
    assert sorted(s.tolist()) == [0, 1, 2]
    assert c.slot_of == dict(zip([1, 2, 3], s.tolist(), strict=True))
    c.policy.use(_ids(1, 2, 3))
    c.policy.use(_ids(1))
    s4 = c.assign(_ids(4), pinned=set())  # LRU victim: 2
    assert 2 not in c.slot_of and c.slot_of[4] == s4[0] and c.expert_at[s4[0]] == 4


def test_slot_cache_never_evicts_pinned_or_busy_slots():
    c = SlotCache(3, LRU(10))
    c.assign(_ids(1, 2, 3), pinned=set())
    c.jobs[c.slot_of[1]] = object()  # a read in flight
    pinned = {c.slot_of[2]}
    assert c.room(pinned) == 1
    c.assign(_ids(7), pinned)
    assert set(c.slot_of) == {1, 2, 7}
    with pytest.raises(ValueError, match="evictable"):
        c.assign(_ids(8, 9), {c.slot_of[2], c.slot_of[7]})


def test_slot_cache_holds_timed_out_slot_until_read_ends():
    class Job:
        done = threading.Event()

    c = SlotCache(2, LRU(10))
    c.assign(_ids(1, 2), pinned=set())
    slot = c.slot_of[1]
    c.hold(slot, Job)
    assert 1 not in c.slot_of and c.room(set()) == 1  # neither mapped nor free
    c.reap()
    assert slot not in c.free
    Job.done.set()
    c.reap()
    assert slot in c.free and not c.zombies


def test_slots_per_layer_floor_and_cap():
    assert slots_per_layer(10 * 100 * 3, 100, 3, 4, 64) == 10
    assert slots_per_layer(10**12, 100, 3, 4, 64) == 64  # never more slots than experts
    with pytest.raises(ValueError, match=r"3 MoE layers x top-4 need at least 12"):
        slots_per_layer(11 * 100, 100, 3, 4, 64)


def test_default_cache_gb_follows_available_memory(monkeypatch):
    assert available_memory() > 0
    monkeypatch.setattr(cache_mod, "available_memory", lambda: 20 * 10**9)
    assert default_cache_gb(0, reserve_gb=4.0) == pytest.approx(0.9 * 16)
    assert default_cache_gb(6 * 10**9, reserve_gb=4.0) == pytest.approx(0.9 * 10)
    assert default_cache_gb(6 * 10**9, reserve_gb=4.0, fraction=0.5) == pytest.approx(5.0)
    assert default_cache_gb(17 * 10**9) == 0.0


@pytest.mark.parametrize(
    "bad",
    [
        {"policy": "mru"},
        {"source": "hub"},
        {"io_threads": 0},
        {"read_timeout": 0},
        {"write_mode": "mmap"},
    ],
)
def test_stream_options_reject_bad_values(bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=key):
        StreamOptions(**bad)
