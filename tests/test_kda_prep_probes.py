"""The cut-down copies of kda_chunk_prep that benchmarks/kda_prep_probes.py times: each cut
still finds its text in the kernel, removes real work (the result changes) and leaves a
kernel that runs on the emulator and compiles with nvcc (where nvcc is on PATH)."""

import shutil

import mlx.core as mx
import numpy as np
import pytest

from benchmarks import kda_prep_probes
from benchmarks.profile_kernels import register_count
from kimi_k3.kernels import kda_prefill


def inputs(T=70, H=2, K=64):
    mx.random.seed(3)
    q, k = (mx.random.normal((1, T, H, K)) * 0.1 for _ in range(2))
    v = mx.random.normal((1, T, H, K))
    g = -mx.sigmoid(mx.random.normal((1, T, H, K)))
    beta = mx.sigmoid(mx.random.normal((1, T, H)))
    return q, k, v, g, beta


# cut: (outputs it must change, outputs it must leave alone); outputs are (Aqk, W, U, Qd,
# Kd, decay). Score cuts change Aqk (and through L, W and U).
EFFECTS = {
    "no solve": ({1, 2}, {0, 3, 4, 5}),
    "no scores": ({0}, {3, 4, 5}),
    "no sub-block loop": ({0}, {3, 4, 5}),
    "no cumsum": ({0, 3, 4, 5}, set()),
    "no pass-1 stores": ({3, 4, 5}, {0, 2}),
    "no pass 2": ({1, 2}, {0, 3, 4, 5}),
}


def test_every_cut_has_its_effects_listed():
    assert set(EFFECTS) == set(kda_prep_probes.CUTS)


@pytest.mark.parametrize("name", list(kda_prep_probes.CUTS))
def test_probe_cuts_real_work(name):
    args = inputs()
    full = kda_prefill.chunk_prep("emulator", *args)
    cut = kda_prefill.chunk_prep("emulator", *args, kernel=kda_prep_probes.probe(name))
    mx.eval(full, cut)
    changed = [not np.allclose(np.array(a), np.array(b)) for a, b in zip(full, cut)]
    must, stay = EFFECTS[name]
    assert all(changed[i] for i in must), changed
    assert not any(changed[i] for i in stay), changed


@pytest.mark.parametrize("T", [70, 130])
@pytest.mark.parametrize("name", list(kda_prep_probes.VARIANTS))
def test_variants_match_the_kernel(name, T):
    """The variants are the same computation: every output equal to ``kda_chunk_prep``'s."""
    args = inputs(T=T, H=3)
    full = kda_prefill.chunk_prep("emulator", *args)
    var = kda_prefill.chunk_prep("emulator", *args, kernel=kda_prep_probes.variant(name))
    mx.eval(full, var)
    for a, b in zip(full, var):
        if name in kda_prep_probes.REORDERED:
            np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(np.array(a), np.array(b))


def test_pre_before_is_the_same_computation():
    """kda_pre with its loads back in their token: same outputs, different kernel text."""
    from test_kda_kernels import activations, layer

    before = kda_prep_probes.pre_before()
    assert before.body != kda_prefill.KDA_PRE.body
    assert "x_q[row + P + c]" not in before.body
    p = layer(2, 64)
    x_q, x_k, x_v, g_raw, b_logits, _, conv, _ = activations(1, 70, 2, 64, mx.float32, True)
    args = (x_q, x_k, x_v, g_raw, b_logits, conv)
    new = kda_prefill.pre("emulator", p, *args)
    old = kda_prefill.pre("emulator", p, *args, kernel=before)
    mx.eval(new, old)
    for a, b in zip(new, old):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_post_before_is_the_same_computation():
    from test_kda_kernels import activations, layer

    before = kda_prep_probes.post_before()
    assert before.body != kda_prefill.KDA_POST.body
    assert "gate[base + d]" in before.body
    p = layer(2, 64)
    mx.random.seed(4)
    o = mx.random.normal((1, 70, 2, 64))
    gate = activations(1, 70, 2, 64, mx.bfloat16, False)[5]
    new = kda_prefill.post("emulator", p, o, gate, kernel=before)
    old = kda_prefill.post("emulator", p, o, gate)
    np.testing.assert_array_equal(
        np.array(new.astype(mx.float32)), np.array(old.astype(mx.float32))
    )


def test_variants_change_the_kernel():
    for name in kda_prep_probes.VARIANTS:
        assert kda_prep_probes.variant(name).body != kda_prefill.KDA_CHUNK_PREP.body


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("name", list(kda_prep_probes.CUTS) + list(kda_prep_probes.VARIANTS))
def test_probe_compiles_for_cuda(name):
    make = kda_prep_probes.probe if name in kda_prep_probes.CUTS else kda_prep_probes.variant
    assert register_count(make(name)) != "?"
