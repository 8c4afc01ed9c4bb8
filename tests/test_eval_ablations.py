"""``kimi_k3.eval``'s ablations: the routed experts zeroed, the shared experts zeroed, top-k
halved, and the per-layer size of the MoE block's two parts. Checked against the block's
parts computed directly on a tiny synthetic checkpoint. A few seconds on 2 CPU cores."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kimi_k3 import eval as k3eval
from kimi_k3.checkpoint.loader import load_model


@pytest.fixture(scope="module")
def tiny(tiny_ckpt):
    return tiny_ckpt


def _moes(model):
    return [layer.block_sparse_moe for layer in model.layers if "block_sparse_moe" in layer]


def _routed_part(moe, flat):
    inds, weights = moe.gate(flat)
    y = moe.experts(moe.routed_expert_down_proj(flat), inds, weights)
    return moe.routed_expert_up_proj(moe.routed_expert_norm(y.astype(flat.dtype)))


def _inputs(model, n=12, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(size=(n, model.args.hidden_size)).astype(np.float32))


def test_routed_zeroed_leaves_the_shared_experts_alone(tiny):
    model = load_model(tiny, dtype=mx.float32, verify_checksums=False)
    x = _inputs(model)
    shared = [moe.shared_experts(x) for moe in _moes(model)]
    routed = [_routed_part(moe, x) for moe in _moes(model)]
    assert all(mx.abs(r).max().item() > 0 for r in routed)  # the ablation removes something
    k3eval.without_routed_experts(model)
    for moe, want in zip(_moes(model), shared):
        assert mx.array_equal(moe(x), want)


def test_shared_zeroed_leaves_the_routed_part_alone(tiny):
    model = load_model(tiny, dtype=mx.float32, verify_checksums=False)
    x = _inputs(model)
    routed = [_routed_part(moe, x) for moe in _moes(model)]
    k3eval.without_shared_experts(model)
    for moe, want in zip(_moes(model), routed):
        assert mx.array_equal(moe(x), want)


def test_top_k_halved_routes_to_the_best_half_renormalised(tiny):
    model = load_model(tiny, dtype=mx.float32, verify_checksums=False)
    k = model.args.num_experts_per_token
    x = _inputs(model)
    moe = _moes(model)[0]
    full_inds, _ = moe.gate(x)
    scores = mx.sigmoid(moe.gate.logits(x)) + moe.gate.e_score_correction_bias
    assert k3eval.set_top_k(model, k // 2) == k // 2
    inds, weights = moe.gate(x)
    assert inds.shape[-1] == k // 2
    # the kept experts are the best half of the full choice, by biased score
    best = np.argsort(-np.array(scores), axis=-1)[:, : k // 2]
    assert np.array_equal(np.sort(np.array(inds), -1), np.sort(best, -1))
    assert set(np.array(inds).ravel()) <= set(np.array(full_inds).ravel())
    if model.args.moe_renormalize:
        np.testing.assert_allclose(np.array(weights.sum(-1)), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="top-k 0"):
        k3eval.set_top_k(model, 0)


def test_moe_output_rms_matches_the_parts(tiny):
    model = load_model(tiny, dtype=mx.float32, verify_checksums=False)
    wins = np.random.default_rng(1).integers(0, 200, (2, 9)).astype(np.int32)
    got = k3eval.moe_output_rms(model, wins)
    # the same parts, captured from the block's input in a plain forward pass
    seen = {}

    def hook(moe, flat):
        seen.setdefault(moe.layer_index, []).append(
            (_routed_part(moe, flat), moe.shared_experts(flat))
        )

    for moe in _moes(model):
        moe.route_hook = hook
    model(mx.array(wins[:, :-1]))
    assert sorted(got) == sorted(seen)
    for layer, parts in seen.items():
        for i, name in enumerate(("routed", "shared")):
            want = math.sqrt(np.mean([np.square(np.array(p[i])).mean() for p in parts]))
            assert got[layer][name] == pytest.approx(want, rel=1e-5)


def test_cli_bad_model_and_flags(tmp_path, capsys):
    assert k3eval.main(["--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "missing" in err[0]
    with pytest.raises(SystemExit) as e:
        k3eval.main(["--tokens", "0"])
    assert e.value.code == 2
    assert "--tokens must be at least 1" in capsys.readouterr().err


def test_nats_per_byte_scores_the_text_not_the_tokens(tiny):
    """NLL per byte of predicted text: the per-token NLL times tokens over bytes, with each
    id's bytes read from the tokenizer's rank file."""
    from kimi_k3.text.tokenizer import load_tokenizer

    model = load_model(tiny, dtype=mx.float32, verify_checksums=False)
    tok = load_tokenizer(tiny)
    text = "def read(path):\n    return open(path).read()\n" * 6
    ids = np.asarray(tok.encode(text), np.int32)
    wins = k3eval.windows(ids, 16)
    lengths = k3eval.token_byte_lengths(tiny, model.args.vocab_size)
    for i in set(ids.tolist()):
        assert lengths[i] == len(tok.decode([i]).encode("utf-8"))
    res = k3eval.compare(model, {}, wins, token_bytes=lengths)["reference"]
    predicted = wins[:, 1:]
    want = (
        math.log(res["ppl"])
        * predicted.size
        / len("".join(tok.decode([int(t)]) for t in predicted.ravel()).encode())
    )
    assert res["nats_per_byte"] == pytest.approx(want, rel=1e-9)
