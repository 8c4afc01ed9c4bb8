"""``kimi_k3.train``: a run stopped and resumed from its saved state (parameters, optimizer
state, step) reaches the same weights as one run straight through; ``train run`` refuses
to overwrite a state without ``--resume`` and to resume with other flags. Tiny config, a
few seconds on 2 CPU cores."""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kimi_k3 import train
from kimi_k3.checkpoint.files import CheckpointError
from kimi_k3.convert.synth import PRESETS

PRESET = dict(PRESETS["tiny"], num_experts=8, num_experts_per_token=2)


def _tokens():
    return np.random.default_rng(0).integers(0, 700, 2000).astype(np.int32)


def _params(model) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_batches_depend_on_seed_and_step_only():
    tokens = _tokens()
    whole = train.batches(tokens, 3, 16, seed=5)
    seq = [np.array(next(whole)) for _ in range(4)]
    resumed = train.batches(tokens, 3, 16, seed=5, start=2)
    assert np.array_equal(np.array(next(resumed)), seq[2])
    assert np.array_equal(np.array(next(resumed)), seq[3])
    assert not np.array_equal(seq[0], seq[1])


@pytest.mark.slow
def test_resumed_run_equals_an_uninterrupted_one(tmp_path):
    tokens, steps = _tokens(), 6
    kw = dict(lr=3e-3, warmup=2)
    straight = train.init_model(PRESET, seed=1)
    train.train(straight, train.batches(tokens, 4, 32, seed=0), steps, **kw)

    first = train.init_model(PRESET, seed=1)
    opt = train.make_optimizer(kw["lr"])
    # data for 3 of the 6 steps: the call stops there, on the 6-step run's schedule
    data = itertools.islice(train.batches(tokens, 4, 32, seed=0), 3)
    done = train.train(first, data, steps, **kw, optimizer=opt)
    assert len(done) == 3
    path = tmp_path / "state.safetensors"
    info = {"step": 3, "elapsed_s": 1.0}
    train.save_state(first, path, opt, info)

    model, opt_state, got = train.load_training(path, PRESET)
    assert got == info
    opt2 = train.make_optimizer(kw["lr"])
    opt2.state = opt_state
    train.train(
        model,
        train.batches(tokens, 4, 32, seed=0, start=3),
        steps,
        **kw,
        optimizer=opt2,
        start_step=3,
    )
    want, have = _params(straight), _params(model)
    assert want.keys() == have.keys()
    for k in want:
        np.testing.assert_array_equal(have[k], want[k], err_msg=k)


def _rates(steps: int, batches: int) -> list[float]:
    """The learning rates a ``steps``-step run uses when its data ends after ``batches``."""
    seen = []

    class Recorder(train.optim.AdamW):
        def apply_gradients(self, gradients, parameters):
            seen.append(float(self.learning_rate))
            return super().apply_gradients(gradients, parameters)

    data = itertools.islice(train.batches(_tokens(), 2, 16, seed=0), batches)
    model = train.init_model(PRESET, seed=1)
    train.train(model, data, steps, lr=1e-2, warmup=1, optimizer=Recorder(learning_rate=1e-2))
    return seen


def test_schedule_spans_the_whole_run():
    """A 6-step run stopped after 3 steps keeps the 6-step schedule: its learning rates
    are the first three of the uninterrupted run's, not a 3-step run's."""
    stopped, whole, short = _rates(6, 3), _rates(6, 6), _rates(3, 3)
    assert stopped == whole[:3] == pytest.approx([train.lr_at(i, i / 6, 1e-2, 1) for i in range(3)])
    assert short != stopped  # a 3-step run decays faster


def test_load_training_names_a_bad_file(tmp_path):
    bad = tmp_path / "train_state.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="train_state.safetensors"):
        train.load_training(bad, PRESET)
    other = tmp_path / "other.safetensors"
    train.save_state(train.init_model(PRESET, seed=0), other)
    with pytest.raises(CheckpointError, match="do not match the training preset"):
        train.load_training(other, dict(PRESET, num_experts=4))


def test_run_refuses_to_overwrite_or_resume_with_other_flags(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    flags = ["--steps", "10", "--batch", "2", "--seq", "16"]
    state = out / train.STATE_FILE
    train.save_state(train.init_model(seed=0), state)
    assert train.main(["run", str(out), *flags]) == 1
    assert "pass --resume" in capsys.readouterr().err
    # a state with no optimizer state cannot be resumed
    assert train.main(["run", str(out), "--resume", *flags]) == 1
    assert "no optimizer state" in capsys.readouterr().err
    model = train.init_model(seed=0)
    info = {"step": 4, "elapsed_s": 2.0, "flags": {k: None for k in train.RUN_FLAGS}}
    opt = train.make_optimizer(3e-3)
    opt.init(model.trainable_parameters())
    train.save_state(model, state, opt, info)
    assert train.main(["run", str(out), "--resume", *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch 2 differs from the run's None" in err[0]
    assert train.main(["run", str(tmp_path / "fresh"), "--resume"]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_compiled_step_matches_the_eager_one():
    """The ``mx.compile``d training step takes the eager step's path: same losses, same
    balancing moves, parameters equal to fp32 rounding after a few steps."""
    tokens = _tokens()
    runs = {}
    for compiled in (False, True):
        model = train.init_model(PRESET, seed=1)
        losses = train.train(
            model, train.batches(tokens, 4, 32, seed=0), 4, lr=3e-3, warmup=2, compiled=compiled
        )
        runs[compiled] = (losses, _params(model))
    (eager_losses, eager), (comp_losses, comp) = runs[False], runs[True]
    np.testing.assert_allclose(comp_losses, eager_losses, rtol=1e-5)
    for k in eager:
        if k.endswith("e_score_correction_bias"):  # moved by +-rate steps: exactly equal
            np.testing.assert_array_equal(comp[k], eager[k], err_msg=k)
        else:
            np.testing.assert_allclose(comp[k], eager[k], rtol=1e-3, atol=1e-5, err_msg=k)


def test_reference_paths_hold_for_the_call_alone(monkeypatch, tmp_path):
    """``train`` and ``eval`` run on the reference paths without switching the kernels off
    for the rest of the process (a test or a notebook calling them in-process)."""
    import os

    from kimi_k3 import eval as k3eval
    from kimi_k3.kernels.dispatch import reference_paths

    monkeypatch.delenv("KIMI_K3_REFERENCE", raising=False)
    with reference_paths():
        assert os.environ["KIMI_K3_REFERENCE"] == "1"
    assert "KIMI_K3_REFERENCE" not in os.environ
    monkeypatch.setenv("KIMI_K3_REFERENCE", "kda")
    with reference_paths():
        assert os.environ["KIMI_K3_REFERENCE"] == "kda"
    assert os.environ["KIMI_K3_REFERENCE"] == "kda"
    monkeypatch.delenv("KIMI_K3_REFERENCE")
    assert train.main(["run", str(tmp_path / "none"), "--resume"]) == 1
    assert k3eval.main(["--model", str(tmp_path / "none")]) == 1
    assert "KIMI_K3_REFERENCE" not in os.environ


def test_weight_decay_reaches_matrices_not_vectors():
    """``AdamWMatrices``: with a zero gradient, a matrix shrinks by ``lr * weight_decay``
    and a vector (a norm's weight) stays; the state is AdamW's own."""
    params = {"w": mx.ones((2, 3)), "norm": mx.ones((3,))}
    zero = {k: mx.zeros_like(v) for k, v in params.items()}
    opt = train.make_optimizer(0.5)
    new = opt.apply_gradients(zero, params)
    assert np.allclose(np.array(new["w"]), 1 - 0.5 * 0.1)
    assert np.array_equal(np.array(new["norm"]), np.ones(3))
    plain = optim.AdamW(learning_rate=0.5, weight_decay=0.1)
    plain.apply_gradients(zero, params)
    assert {k for k, _ in tree_flatten(opt.state)} == {k for k, _ in tree_flatten(plain.state)}


def test_routed_part_starts_at_zero_and_grows():
    """The routed up-projections start at zero (gain 0: the routed experts add nothing at
    the start), and training grows them; the experts then get gradients and move."""
    model = train.init_model(PRESET, seed=1)
    assert train.routed_gain(model) == [0.0] * len(train.routed_gain(model))
    experts = {k: v for k, v in _params(model).items() if ".experts." in k}
    data = train.batches(_tokens(), 2, 16, seed=0)
    train.train(model, itertools.islice(data, 4), 4, lr=3e-3, warmup=1)
    assert all(g > 0 for g in train.routed_gain(model))
    after = _params(model)
    assert all(not np.array_equal(after[k], v) for k, v in experts.items())
