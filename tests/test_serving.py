"""``kimi_k3.serve.engine``: batched decoding equals solo decoding (sequences joining and leaving
the batch at different steps too), seeded sampling is the same in a batch, chunked prefill
lets short requests through, cancellation, prefix reuse equals a cold run, the snapshot
LRU."""

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate

import kimi_k3
from kimi_k3.serve import engine as serving
from kimi_k3.serve.engine import (
    BatchLatents,
    Engine,
    Failure,
    PrefixCache,
    QueueFull,
    Sampling,
    Sequence,
)

PROMPTS = [
    "Hello there, how are you doing today, my friend?",
    "Once upon",
    "x",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
]


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    """fp32, so that different prefill splits cannot flip a near-tie."""
    return kimi_k3.load(tiny_ckpt, dtype=mx.float32)


@pytest.fixture(scope="module")
def prompts(tiny):
    return [tiny[1].encode(p) for p in PROMPTS]


def sequence(prompt, n=10, sampling=None):
    return Sequence(prompt, n, sampling or Sampling())


def collect(seq, timeout=120):
    tokens = []
    while True:
        kind, value = seq.out.get(timeout=timeout)
        if kind != "token":
            return tokens, value
        tokens.append(value)


def run(e, prompts, n=10):
    seqs = [sequence(p, n) for p in prompts]
    for s in seqs:
        e.submit(s)
    return [collect(s) for s in seqs]


def test_solo_equals_stream_generate(tiny, prompts):
    e = Engine(tiny[0], reuse_bytes=0)
    try:
        for p in prompts:
            want = [r.token for r in stream_generate(*tiny, p, max_tokens=10)]
            assert run(e, [p]) == [(want, "length")]
    finally:
        e.stop()


def test_batched_equals_solo(tiny, prompts, monkeypatch):
    """Sequences of different lengths decoded together (left-padded MLA latents, stacked
    KDA states) give the tokens each gives alone."""
    sizes = []
    decode = Engine._decode
    monkeypatch.setattr(
        Engine, "_decode", lambda self, ready: (sizes.append(len(ready)), decode(self, ready))
    )
    e = Engine(tiny[0], reuse_bytes=0, prefill_step_size=7)
    try:
        solo = [run(e, [p], n=24)[0] for p in prompts]
        assert max(sizes) == 1
        assert run(e, prompts, n=24) == solo
        assert max(sizes) == len(prompts)  # all four in one step
    finally:
        e.stop()


def test_joining_and_leaving_at_different_steps_equals_solo(tiny, prompts, monkeypatch):
    """Rows leave at different steps (the longest first, so the batch's latents are cut
    to the rows left) and a sequence joins a batch whose rows are longer and shorter
    than it, while the latents grow 4 columns at a time: every sequence decodes what it
    decodes alone."""
    monkeypatch.setattr(BatchLatents, "STEP", 4)
    e = Engine(tiny[0], reuse_bytes=0, prefill_step_size=5)
    try:
        lengths = [3, 20, 9, 14]
        solo = [run(e, [p], n)[0] for p, n in zip(prompts, lengths)]
        late = prompts[0] + prompts[1]
        late_solo = run(e, [late], 8)[0]
        seqs = [sequence(p, n) for p, n in zip(prompts, lengths)]
        for s in seqs:
            e.submit(s)
        first = collect(seqs[0])
        joiner = sequence(late, 8)
        e.submit(joiner)
        assert [first, *map(collect, seqs[1:])] == solo
        assert collect(joiner) == late_solo
    finally:
        e.stop()


def test_prompts_prefilled_together_equal_solo(tiny, monkeypatch):
    """Prompts of one length arriving together are prefilled in one pass per step (as
    many whole prompts as the step's budget holds, the others in the next step, rather
    than one cut to fit) and decode what each decodes alone."""
    texts = [f"Client {i} asks about attention residuals." for i in range(4)]
    ids = [tiny[1].encode(t) for t in texts]
    assert len({len(p) for p in ids}) == 1
    passes = []
    prefill = serving.prefill
    monkeypatch.setattr(
        serving, "prefill", lambda m, c, chunks: (passes.append(len(c)), prefill(m, c, chunks))
    )
    e = Engine(tiny[0], reuse_bytes=0, prefill_step_size=3 * len(ids[0]) - 4)
    try:
        solo = [run(e, [p])[0] for p in ids]
        passes.clear()
        assert run(e, ids) == solo
        assert passes == [2, 2]
    finally:
        e.stop()


def test_a_burst_on_an_idle_engine_is_prefilled_in_one_pass(tiny, monkeypatch):
    """Requests that come one after another (here 20 ms apart) to an idle engine are
    gathered while they keep coming (``gather_seconds``, made long here), then prefilled
    in one pass and decoded together."""
    ids = [tiny[1].encode(f"Client {i} asks about attention residuals.") for i in range(4)]
    passes = []
    prefill = serving.prefill
    monkeypatch.setattr(
        serving, "prefill", lambda m, c, chunks: (passes.append(len(c)), prefill(m, c, chunks))
    )
    e = Engine(tiny[0], reuse_bytes=0, gather_seconds=0.5, gather_max=10)
    try:
        seqs = [sequence(p, 4) for p in ids]
        for s in seqs:
            e.submit(s)
            threading.Event().wait(0.02)
        assert all(collect(s)[1] == "length" for s in seqs)
        assert passes == [4]
    finally:
        e.stop()


def test_overlapped_steps_give_what_steps_one_after_another_give(tiny, prompts):
    """With ``overlap`` a step's tokens are handed out while the next step's forward pass
    runs (a sequence's stop is seen a step late, its row fed once more and dropped): every
    sequence gets the same tokens, ends and log-probabilities as without, greedy or
    seeded, with a logits processor of its own, stopped by a stop id or by length; and a
    stopped sequence's snapshot (its stop id included, with overlap: its row was fed it)
    continues as a cold run of the conversation does."""
    from mlx_lm.sample_utils import make_logits_processors

    def workload():
        stops = frozenset(run(Engine(tiny[0], reuse_bytes=0), [prompts[2]], n=3)[0][0][1:2])
        bias = make_logits_processors(logit_bias={5: 3.0})
        return [
            Sequence(prompts[0], 12, logprobs=2),
            Sequence(prompts[1], 7, Sampling(temp=1.0, seed=7), logprobs=0),
            Sequence(prompts[2], 9, stop_ids=stops),
            Sequence(prompts[3], 10, processors=bias),
            Sequence(prompts[0] + prompts[1], 1),
        ]

    results, cold = {}, Engine(tiny[0], reuse_bytes=0)
    for overlap in (False, True):
        e = Engine(tiny[0], overlap=overlap)
        try:
            seqs = workload()
            for q in seqs:
                e.submit(q)
            results[overlap] = [(collect(q), q.token_logprobs) for q in seqs]
            stopped = seqs[2]
            assert results[overlap][2][0][1] == "stop"
            held, _ = e.prefixes.longest(stopped.prompt + stopped.tokens + [0])
            assert held == len(stopped.prompt) + len(stopped.tokens) - (0 if overlap else 1)
            follow = sequence(stopped.prompt + stopped.tokens + prompts[1], 6)
            e.submit(follow)
            assert collect(follow) == run(cold, [follow.prompt], n=6)[0]
            assert follow.reused == held
        finally:
            e.stop()
    cold.stop()
    assert results[True] == results[False]


def test_logit_bias_is_added_to_the_whole_batch_as_mlx_lm_adds_it(tiny, prompts):
    """Sequences with a ``logit_bias`` decoded beside one without (one scatter for the
    batch, the greedy rows still one argmax) give what mlx-lm's ``logit_bias`` processor
    gives each alone."""
    from mlx_lm.sample_utils import make_logits_processors

    plain = [run(Engine(tiny[0], reuse_bytes=0), [p], n=8)[0][0] for p in prompts[:3]]
    bias = {plain[0][0]: -100.0, plain[2][0]: -100.0, 7: 4.0}
    want = []
    for p in prompts[:3]:
        procs = make_logits_processors(logit_bias=bias)
        want.append([r.token for r in stream_generate(*tiny, p, 8, logits_processors=procs)])
    assert want[0] != plain[0]
    e = Engine(tiny[0], reuse_bytes=0)
    try:
        seqs = [Sequence(prompts[i], 8, logit_bias=bias if i != 1 else None) for i in range(3)]
        for q in seqs:
            e.submit(q)
        assert [collect(q)[0] for q in seqs] == [want[0], plain[1], want[2]]
    finally:
        e.stop()


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny, prompts):
    """A seeded sequence draws from a key of its own: the same tokens alone, beside greedy
    and other seeded sequences, and again; another seed draws others."""
    hot = Sampling(temp=1.0, top_p=0.95, seed=1234)
    e = Engine(tiny[0], reuse_bytes=0)
    try:
        alone = run_with(e, [(prompts[1], hot)])[0]
        mixed = [(prompts[0], Sampling()), (prompts[1], hot), (prompts[2], Sampling(1.0, seed=7))]
        together = run_with(e, mixed)
        assert together[1] == alone
        assert run_with(e, mixed) == together
        other = run_with(e, [(prompts[1], Sampling(temp=1.0, top_p=0.95, seed=4321))])[0]
        assert other != alone
    finally:
        e.stop()


def run_with(e, pairs, n=16):
    seqs = [sequence(p, n, sampling) for p, sampling in pairs]
    for s in seqs:
        e.submit(s)
    return [collect(s) for s in seqs]


def test_short_request_overtakes_a_long_prefill(tiny, prompts):
    """With chunked prefill, a short request's first token comes while a long prompt is
    still being prefilled."""
    e = Engine(tiny[0], reuse_bytes=0, prefill_step_size=16)
    try:
        long = sequence(prompts[0] * 40, n=2)
        short = sequence(prompts[1], n=2)
        e.submit(long)
        e.submit(short)
        assert short.out.get(timeout=120)[0] == "token"
        assert long.fed < len(long.prompt) - 1
        assert collect(long)[1] == "length"
    finally:
        e.stop()


class PassClock:
    """A clock that a prefill pass advances by ``per_token`` seconds a token fed, or by
    ``cost(tokens)``: the engine's measured pass times are what the test sets, whatever
    the machine."""

    def __init__(self, monkeypatch, per_token: float = 0.0, cost=None):
        self.now, self.chunks = 0.0, []
        cost = cost or (lambda tokens: per_token * tokens)
        prefill = serving.prefill

        def timed(m, caches, chunks):
            prefill(m, caches, chunks)
            self.chunks.append(len(chunks[0]))
            self.now += cost(sum(map(len, chunks)))

        monkeypatch.setattr(serving, "prefill", timed)

    def __call__(self) -> float:
        return self.now


def test_prefill_chunks_are_sized_by_their_measured_times(tiny, prompts, monkeypatch):
    """A long prompt's chunk sizes (``MIN_CHUNK`` doubled up to ``prefill_step_size``) are
    tried from the smallest up while each, scaled from the one below, would fit
    ``prefill_step_seconds``; then the size that fits and fed the most tokens a second is
    kept (the largest, at equal rates); ``MIN_CHUNK`` where none fits; whole chunks
    without a bound. It decodes what it decodes with whole chunks."""
    clock = PassClock(monkeypatch, per_token=1 / 128)  # 16 tokens: 0.125 s, 32: 0.25, 64: 0.5
    long = prompts[0] * 12
    e = Engine(tiny[0], reuse_bytes=0, prefill_step_size=64, prefill_step_seconds=0.25)
    e.clock = clock
    try:
        bounded = run(e, [long], n=4)
        assert clock.chunks[:2] == [16, 32] and set(clock.chunks[2:-1]) == {32}
        assert e.pass_times == {16: 0.125, 32: 0.25}
        clock.chunks.clear()
        e.prefill_step_seconds = 1 / 16  # none fits
        assert run(e, [long], n=4) == bounded
        assert set(clock.chunks[:-1]) == {Engine.MIN_CHUNK}
        clock.chunks.clear()
        e.prefill_step_seconds = None
        assert run(e, [long], n=4) == bounded
        assert set(clock.chunks[:-1]) == {64}
    finally:
        e.stop()


def test_a_chunk_size_that_costs_less_per_token_is_kept(tiny, prompts, monkeypatch):
    """Where a pass of 16 tokens costs 0.05 s and one of more costs 0.4 s and more (as on
    MLX's CPU backend, where the expert and attention paths change with the tokens of a
    pass), 32 is tried once and 16 kept: it feeds the most tokens a second."""
    clock = PassClock(monkeypatch, cost=lambda n: 0.05 if n <= 16 else 0.4 + n / 128)
    e = Engine(tiny[0], reuse_bytes=0, prefill_step_size=64, prefill_step_seconds=0.5)
    e.clock = clock
    try:
        assert run(e, [prompts[0] * 12], n=2)[0][1] == "length"
        assert clock.chunks[:2] == [16, 32] and set(clock.chunks[2:-1]) == {16}
    finally:
        e.stop()


def test_a_request_arriving_mid_prefill_waits_one_bounded_pass(tiny, prompts, monkeypatch):
    """A short request submitted while a long prompt is prefilling (in chunks of 32, what
    fits 0.25 s here) gets its first token after a few of its passes, long before the
    long prompt is in."""
    clock = PassClock(monkeypatch, per_token=1 / 128)
    long, short = sequence(prompts[0] * 40, n=2), sequence(prompts[1], n=2)
    e = Engine(tiny[0], reuse_bytes=0, prefill_step_size=256, prefill_step_seconds=0.25)
    e.clock = clock
    try:
        e.submit(long)
        while long.fed < 16 + 32 + 32:  # its sizes tried (16, 32), and one pass of 32
            assert long.out.empty()
            threading.Event().wait(0.01)
        fed_at_submit = long.fed
        e.submit(short)
        assert short.out.get(timeout=120)[0] == "token"
        # the pass in flight, the one that shares the short one's step, and one that may end
        # between reading ``fed`` and submitting
        assert long.fed - fed_at_submit <= 3 * 32
        assert long.fed < len(long.prompt) - 1
        assert collect(long)[1] == "length"
    finally:
        e.stop()


def test_long_prompts_share_a_step_and_a_short_one_goes_first(tiny, prompts):
    """A step's chunks, the fewest tokens left first: a short prompt whole, then each long
    prompt a chunk of the size that fits the time left of ``prefill_step_seconds`` and fed
    the most tokens a second (the largest, at equal rates), or none where no size fits."""
    e = Engine(tiny[0], start=False, prefill_step_size=512, prefill_step_seconds=0.625)
    long_a, long_b = sequence(prompts[0] * 60), sequence(prompts[3] * 60)
    short = sequence(prompts[1])
    for s in (long_a, long_b, short):
        e.submit(s)
    e._admit()
    long_a.fed, long_b.fed = 100, 40
    assert len(long_a.prompt) - long_a.fed < len(long_b.prompt) - long_b.fed
    e.pass_times = {n: n / 256 for n in e.chunk_sizes}  # 256 tokens a second, every size
    left = len(short.prompt) - 1
    assert left <= 16  # the short prompt leaves 0.625 - left / 256 s: 128 tokens, then 16
    assert e._prefill_plan() == [([short], left), ([long_a], 128), ([long_b], 16)]
    short.fed = left  # prefilled
    assert e._prefill_plan() == [([long_a], 128), ([long_b], 32)]
    e.pass_times[16] = 1 / 64  # 16 tokens for less a token than any other size
    assert e._prefill_plan() == [([long_a], 16), ([long_b], 16)]


def test_a_short_request_is_not_held_behind_long_prompts(tiny, prompts, monkeypatch):
    """Four long prompts fill a batch of four, but at most two of them prefill at once
    (``max_long_prefills``: half the batch by default), so a short request sent after them
    takes a free slot at once: its first token comes before any long prompt has ended, in
    the step that prefills it, before that step's long chunks; every long prompt ends."""
    clock = PassClock(monkeypatch, per_token=1 / 256)
    events = []
    decode, prefill = Engine._decode, Engine._prefill
    monkeypatch.setattr(
        Engine, "_decode", lambda self, ready: (events.append("decode"), decode(self, ready))
    )
    monkeypatch.setattr(
        Engine,
        "_prefill",
        lambda self, group, n: (events.append([id(s) for s in group]), prefill(self, group, n)),
    )
    e = Engine(tiny[0], max_batch=4, reuse_bytes=0, prefill_step_size=32, prefill_step_seconds=0.1)
    e.clock = clock
    try:
        longs = [sequence(prompts[i % 2 * 3] * (6 + i), n=2) for i in range(4)]
        for s in longs:
            e.submit(s)
        while not e.pass_times:
            threading.Event().wait(0.01)
        short = sequence(prompts[1], n=2)
        e.submit(short)
        assert short.out.get(timeout=120)[0] == "token"
        assert not any(s.ended.is_set() for s in longs)
        assert not all(s.prefilled for s in longs)
        fed_short = next(i for i, ev in enumerate(events) if ev != "decode" and id(short) in ev)
        assert events[fed_short + 1] == "decode"
        assert all(collect(s)[1] == "length" for s in longs)
    finally:
        e.stop()


def _top(vec, n):
    ids = np.argsort(-vec, kind="stable")[:n]
    return [(int(i), float(vec[i])) for i in ids]


def test_token_logprobs_match_stream_generate(tiny, prompts):
    """Each generated token's log-probability and its likeliest alternatives, greedy and
    sampled rows decoded in one batch, against mlx-lm's ``stream_generate``'s
    ``logprobs`` for the same tokens."""
    e = Engine(tiny[0], reuse_bytes=0)
    try:
        greedy = Sequence(prompts[0], 6, logprobs=3)
        hot = Sequence(prompts[3], 6, Sampling(temp=1.0, seed=3), logprobs=0)
        plain = Sequence(prompts[1], 6)
        for s in (greedy, hot, plain):
            e.submit(s)
        outs = [collect(s)[0] for s in (greedy, hot, plain)]
        assert plain.token_logprobs == []
        for s, tokens, n_top in ((greedy, outs[0], 3), (hot, outs[1], 0)):
            assert len(s.token_logprobs) == len(tokens)
            # the same tokens fed to mlx-lm: its logprobs at each step are the reference
            for j, (lp, alts) in enumerate(s.token_logprobs):
                context = s.prompt + tokens[:j]
                logits = tiny[0](mx.array([context]))[0, -1].astype(mx.float32)
                want = np.array(logits - mx.logsumexp(logits))
                assert lp == pytest.approx(float(want[tokens[j]]), abs=1e-4)
                assert [i for i, _ in alts] == [i for i, _ in _top(want, n_top)]
                np.testing.assert_allclose(
                    [v for _, v in alts], [v for _, v in _top(want, n_top)], atol=1e-4
                )
    finally:
        e.stop()


def test_prompt_logprobs_match_a_whole_forward_pass(tiny, prompts):
    """Every prompt token after the first gets its log-probability given the tokens
    before it, over several prefill chunks, and a prompt whose prefix is cached is still
    computed whole."""
    e = Engine(tiny[0], prefill_step_size=5)
    try:
        prompt = prompts[0] + prompts[3]
        run(e, [prompt], n=2)  # its prefix is now in the snapshot cache
        s = Sequence(prompt, 2, prompt_logprobs=2)
        e.submit(s)
        collect(s)
        assert s.reused == 0
        logits = tiny[0](mx.array([prompt]))[0].astype(mx.float32)
        want = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        assert len(s.prompt_token_logprobs) == len(prompt) - 1
        for j, (lp, alts) in enumerate(s.prompt_token_logprobs):
            assert lp == pytest.approx(float(want[j, prompt[j + 1]]), abs=1e-4)
            assert [i for i, _ in alts] == [i for i, _ in _top(want[j], 2)]
    finally:
        e.stop()


def test_cancel_ends_within_a_step(tiny, prompts):
    e = Engine(tiny[0], reuse_bytes=0)
    try:
        s = sequence(prompts[0], n=100_000)
        e.submit(s)
        assert s.out.get(timeout=120)[0] == "token"
        s.cancel()
        assert collect(s)[1] == "cancelled"
        assert e.load() == (0, 0)
    finally:
        e.stop()


def test_queue_bound(tiny, prompts):
    e = Engine(tiny[0], max_batch=1, max_waiting=1)
    try:
        running, waiting = sequence(prompts[0], 100_000), sequence(prompts[1])
        e.submit(running)
        e.submit(waiting)
        with pytest.raises(QueueFull):
            e.submit(sequence(prompts[2]))
        running.cancel()
        assert collect(waiting)[1] == "length"
    finally:
        e.stop()


def test_follow_up_reuses_the_prefix_and_matches_a_cold_run(tiny, prompts):
    """Turn 2 starts from the snapshot at the end of turn 1 and decodes the same tokens as
    an engine that prefills the whole conversation."""
    warm, cold = Engine(tiny[0]), Engine(tiny[0], reuse_bytes=0)
    try:
        first, _ = run(warm, [prompts[0]], n=6)[0]
        follow = prompts[0] + first + prompts[1]
        s = sequence(follow)
        warm.submit(s)
        assert collect(s) == run(cold, [follow])[0]
        assert s.reused == len(prompts[0]) + len(first) - 1
    finally:
        warm.stop()
        cold.stop()


def test_prefix_cache_is_an_lru_bounded_in_bytes(tiny, prompts):
    e = Engine(tiny[0])
    try:
        s = sequence(prompts[0], n=2)
        e.submit(s)
        collect(s)
        snap = e.prefixes.longest(prompts[0] + [0])[1]
    finally:
        e.stop()
    size = sum(a.nbytes for _, *arrays in snap for a in arrays if a is not None)
    lru = PrefixCache(max_bytes=2 * size)
    lru.put([1, 2, 3], snap)
    lru.put([1, 2, 3, 4, 5], snap)
    assert lru.longest([1, 2, 3, 4, 5, 6])[0] == 5
    assert lru.longest([1, 2, 3, 9])[0] == 3  # and [1, 2, 3] is now the most recent
    lru.put([7, 8], snap)
    assert lru.bytes <= 2 * size
    assert lru.longest([1, 2, 3, 4, 5, 6])[0] == 3
    assert lru.longest([1, 2, 3])[0] == 0  # a key must leave a token to decode


def test_a_failed_step_ends_its_sequences_and_the_engine_goes_on(tiny, prompts, monkeypatch):
    """The server answers such a sequence with 503; later requests are served."""
    failed = []
    prefill = Engine._prefill

    def fail_once(self, group, n):
        if not failed:
            failed.append(group)
            raise OSError("expert read failed")
        return prefill(self, group, n)

    monkeypatch.setattr(Engine, "_prefill", fail_once)
    e = Engine(tiny[0], reuse_bytes=0)
    try:
        s = sequence(prompts[0])
        e.submit(s)
        assert s.out.get(timeout=120) == ("error", Failure("OSError: expert read failed", 503))
        assert run(e, [prompts[0]])[0][1] == "length"
    finally:
        e.stop()


def test_a_processor_that_fails_ends_its_own_sequence_only(tiny, prompts):
    """A grammar that reaches one of llguidance's limits a few tokens in (2,500 object
    alternatives below a key, its bounds skipped) ends its sequence with a 400 naming its
    field, in a message of one short line that does not quote the grammar; the sequences
    decoded in the same steps go on and give the tokens they give alone."""
    from kimi_k3.serve import constrained

    model, tok = tiny
    alts = [
        {"type": "object", "properties": {f"k{i}": {}}, "required": [f"k{i}"]} for i in range(50)
    ]
    schema = {
        "type": "object",
        "properties": {"x": {"anyOf": [{"anyOf": alts}] * 50}},
        "required": ["x"],
    }
    grammar = constrained._start(tok, constrained._json_rule(schema), False)
    where = "response_format.json_schema.schema"
    e = Engine(model, reuse_bytes=0)
    try:
        others = prompts[1:]
        alone = [run(e, [p], n=24)[0] for p in others]
        bad = Sequence(
            prompts[0], 40, processors=[constrained.GrammarProcessor(tok, grammar, where)]
        )
        seqs = [sequence(p, 24) for p in others]
        for s in [bad, *seqs]:
            e.submit(s)
        tokens, failure = collect(bad)
        assert isinstance(failure, Failure), failure
        assert (failure.status, failure.param) == (400, where)
        assert "max is 2000" in failure.message and "\n" not in failure.message
        assert len(failure.message) <= 300 and "k49" not in failure.message
        assert len(tokens) < 24  # it ended while the others were decoding beside it
        assert [collect(s) for s in seqs] == alone
    finally:
        e.stop()
