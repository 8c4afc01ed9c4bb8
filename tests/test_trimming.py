"""Dynamic expert trimming (``kimi_k3.model.routing``): the rule against a numpy reference, off
is bitwise the untrimmed model, streamed trimmed equals resident trimmed bit for bit while
reading fewer experts, and the settings reach the model from every entry point."""

import math

import mlx.core as mx
import numpy as np
import pytest
from test_streaming import PROMPT, STEPS, budget_gb, greedy

import kimi_k3
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.model import routing
from kimi_k3.streaming import get_stats

TOKENS = mx.array(np.random.default_rng(5).integers(0, 1500, (1, 24)))


@pytest.fixture(scope="module")
def small(ckpt_factory):
    return ckpt_factory("small", num_experts=64)  # test_streaming's: top-4 of 64


def reference_trim(logits, bias, k, scale, renormalize, top_p, min_weight):
    """The rule of ``kimi_k3.model.routing``, per token in float64: ``{expert: weight}`` kept."""
    out = []
    for row in logits:
        s = 1 / (1 + np.exp(-row.astype(np.float64)))
        chosen = np.argsort(-(s + bias), kind="stable")[:k]
        r = s[chosen] / s[chosen].sum()
        order = np.argsort(-r, kind="stable")
        keep, mass = [], 0.0
        for i in order:
            if keep and (mass >= top_p or r[i] < min_weight):
                break
            keep.append(chosen[i])
            mass += r[i]
        kept_s = s[keep]
        w = kept_s / kept_s.sum() if renormalize else kept_s
        out.append(dict(zip(keep, w * scale, strict=True)))
    return out


@pytest.mark.parametrize(
    "top_p,min_weight,renormalize,scale",
    [(0.5, 0.0, True, 1.0), (0.8, 0.12, True, 2.5), (1.0, 0.2, False, 1.0), (0.3, 0.0, False, 3.0)],
)
def test_rule_matches_a_numpy_reference(top_p, min_weight, renormalize, scale):
    """Kept experts and weights per token; dropped choices copy the first with weight 0."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (96, 16)).astype(np.float32)
    bias = rng.normal(0, 0.5, 16).astype(np.float32)
    inds, w = routing.route_trimmed(
        mx.array(logits), mx.array(bias), 6, scale, renormalize, top_p, min_weight
    )
    inds, w = np.array(inds), np.array(w)
    want = reference_trim(logits, bias, 6, scale, renormalize, top_p, min_weight)
    kept = routing.kept(inds)
    counts = kept.sum(-1)
    assert 1 <= counts.min() and counts.max() <= 6 and counts.min() < counts.max()
    for row, wrow, mask, ref in zip(inds, w, kept, want, strict=True):
        assert dict(zip(row[mask].tolist(), wrow[mask].tolist())) == pytest.approx(ref, rel=1e-5)
        assert mask[: mask.sum()].all()  # kept first, by decreasing weight
        assert np.all(np.diff(wrow[mask]) <= 0)
        assert (row[~mask] == row[0]).all() and (wrow[~mask] == 0).all()


def test_check_names_the_bad_value():
    assert routing.check(1, 0) == (1.0, 0.0)
    for p, w, words in [
        (0, 0, "top_p must be above 0 and at most 1, got 0"),
        (1.5, 0, "top_p must be above 0"),
        (math.nan, 0, "top_p must be above 0"),
        (1, -0.1, "min_weight must be at least 0 and below 1, got -0.1"),
        (1, 1, "min_weight must be at least 0 and below 1"),
        (1, math.nan, "min_weight must be at least 0"),
        ("0.9", 0, "top_p must be a number, got '0.9'"),
    ]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            routing.check(p, w)
    with pytest.raises(ValueError, match="^expert_top_p must be above 0"):
        kimi_k3.load("/no/such/model", expert_top_p=2)  # checked before anything is read


def test_off_is_the_untrimmed_model_bit_for_bit(small):
    """top_p 1 and min_weight 0 compute exactly the untrimmed model; trimming that keeps
    every expert (a tiny min_weight) computes it within fp32 rounding (the pairs are added in
    another order); and only the columns no token keeps are cut."""
    model = load_model(small, dtype=mx.float32)
    want = model(TOKENS)
    kimi_k3.set_expert_trimming(model, top_p=0.5)
    trimmed = model(TOKENS)
    kimi_k3.set_expert_trimming(model, top_p=1.0, min_weight=0.0)
    assert kimi_k3.expert_trimming(model) == (1.0, 0.0)
    assert mx.array_equal(model(TOKENS), want).item()
    kimi_k3.set_expert_trimming(model, min_weight=1e-30)
    all_kept = model(TOKENS)
    assert mx.abs(all_kept - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    kimi_k3.set_expert_trimming(model, top_p=0.5)
    assert mx.array_equal(model(TOKENS), trimmed).item()
    uncut = _without_cutting(model)
    assert mx.abs(uncut - trimmed).max().item() <= 1e-5 * mx.abs(trimmed).max().item()
    assert mx.abs(trimmed - want).max().item() > 1e-2  # trimming changed the model
    with pytest.raises(ValueError, match="top_p must be above 0"):
        kimi_k3.set_expert_trimming(model, top_p=0)


def _without_cutting(model):
    """The model's logits on TOKENS with every [N, k] column computed (zero pairs too)."""
    cut = routing.used_columns
    routing.used_columns = lambda inds, weights: (inds, weights)
    try:
        return model(TOKENS)
    finally:
        routing.used_columns = cut


@pytest.mark.slow
def test_streamed_trimmed_equals_resident_trimmed_and_reads_less(small):
    """At 16 slots of 64 (misses, and a prefill run in groups): the trimmed streamed model's
    fp32 logits equal the trimmed resident model's bit for bit, and on the same tokens it
    reads fewer experts than the untrimmed streamed model; get_stats counts experts kept."""
    resident = load_model(small, dtype=mx.float32, expert_min_weight=0.2, expert_top_p=0.6)
    want = greedy(resident, PROMPT, STEPS)
    gb = budget_gb(small, 16)
    model = load_model(small, dtype=mx.float32, expert_cache_gb=gb, expert_top_p=0.6)
    kimi_k3.set_expert_trimming(model, top_p=0.6, min_weight=0.2)
    assert mx.array_equal(greedy(model, PROMPT, STEPS), want).item()
    trimmed = get_stats(model)
    assert 1 <= trimmed["experts_per_token"] < 4
    assert trimmed["bytes_read"] == trimmed["misses"] * trimmed["expert_bytes"]
    reads = {}
    for top_p in (1.0, 0.6):
        streamed = load_model(small, dtype=mx.float32, expert_cache_gb=gb, expert_top_p=top_p)
        mx.eval(streamed(TOKENS[:, :8], cache=(cache := streamed.make_cache())))
        for t in range(8, TOKENS.shape[1]):
            mx.eval(streamed(TOKENS[:, t : t + 1], cache=cache))
        reads[top_p] = get_stats(streamed)
    full, cut = reads[1.0], reads[0.6]
    assert full["experts_per_token"] == 4 and cut["experts_per_token"] < 4
    assert cut["misses"] < full["misses"] and cut["bytes_read"] < full["bytes_read"]


def test_cli_flags_reach_the_model(tiny_ckpt, capsys, monkeypatch):
    """``generate`` loads with the flags and its stats line gives the experts kept; the
    server hands the same flags to the loader."""
    from kimi_k3 import server
    from kimi_k3.checkpoint.files import CheckpointError
    from kimi_k3.generate import main

    argv = ["--model", str(tiny_ckpt), "--max-tokens", "3", "--expert-cache-gb", "0.001"]
    assert main([*argv, "--expert-top-p", "0.6", "--expert-min-weight", "0.05"]) == 0
    err = capsys.readouterr().err
    assert "trimmed: top-p 0.6, min weight 0.05)" in err
    kept = float(err.split(" of 2 a token")[0].rsplit(", ", 1)[1])
    assert 1 <= kept <= 2
    seen = []

    def fake_load(path, expert_cache_gb, verify, plan=None, **trim):
        seen.append(trim)
        raise CheckpointError("stop here")

    monkeypatch.setattr(server, "load_for_cli", fake_load)
    server_argv = ["--model", str(tiny_ckpt), "--port", "0", "--expert-min-weight", "0.1"]
    assert server.main(server_argv) == 1
    assert seen == [{"expert_top_p": 1.0, "expert_min_weight": 0.1, "shed_misses": 1.0}]
