"""benchmarks/one_sweep.py's variants of the one-launch decode on the Metal emulator: other
launch settings and its probes (loads before the staging, a persistent grid looping over
tickets) compute the dispatched kernel's bits, so its H200 rows time the same work."""

from __future__ import annotations

import argparse
import shutil

import numpy as np
import pytest
from test_mxfp4_kernels import case

from benchmarks import one_sweep
from kimi_k3.kernels import expert_layout, mxfp4_one

# 4 tickets of gate/up and 2-3 of down a pair; 4-group down steps (I = 768: 24 groups)
CASES = [(6, 512, 256, 2, 3, "bfloat16"), (4, 1024, 768, 1, 4, "float32")]


def run_setting(setting, z, wt, inds, wts, beta, cap):
    rt, sk, gw1, gw2, pp, bound, cs1, cs2, early, groups, reuse = setting
    return mxfp4_one.launch(
        one_sweep.setting_kernel_full(setting),
        z,
        wt,
        inds,
        wts,
        beta,
        cap,
        backend="emulator",
        shape=(rt, sk, gw1, gw2, bool(pp)),
        streams=(bool(cs1), bool(cs2)),
        groups=groups or None,
    )


@pytest.mark.parametrize("E,D,I,N,k,dtype", CASES)
def test_settings_and_probes_give_the_dispatched_bits(E, D, I, N, k, dtype):
    (z, w, inds, wts, beta, cap), _ = case(E, D, I, N, k, dtype)
    wt = expert_layout.tile(w)
    want = np.array(mxfp4_one.expert_glu_decode_tiled(z, wt, inds, wts, beta, cap, "emulator"))
    rt, sk, gw1, gw2, pp = mxfp4_one.shape_for("cuda", D, I)
    tickets = N * k * (-(-(I // 16) // rt) + -(-(D // 32) // rt))
    for setting in [
        (rt, sk, gw1, gw2, pp, 2, 1, 0, 1, 0, 0),  # both steps' loads before the staging
        (rt, sk, gw1, gw2, pp, 2, 1, 0, 0, 1, 0),  # one threadgroup takes every ticket
        (rt, sk, gw1, gw2, pp, 2, 1, 1, 0, 3, 0),
        (rt, sk, gw1, gw2, pp, 2, 1, 0, 0, 1, 1),  # and keeps its staging where it can
        (rt, sk, gw1, gw2, pp, 2, 1, 0, 0, 3, 1),
        (4, 1, gw1, gw2, pp, 4, 1, 0, 0, 0, 0),
    ]:
        y, _, _, counts = run_setting(setting, z, wt, inds, wts, beta, cap)
        assert np.array_equal(np.array(y), want), setting
        groups = setting[-2]
        if groups:  # every ticket taken once, and one past the end by each threadgroup
            assert int(np.array(counts)[0]) == tickets + groups


def differs_from_dispatched(kernel, groups: int) -> bool:
    """Whether ``kernel`` (a broken probe) on ``CASES[0]`` (two tokens) with ``groups``
    threadgroups gives other numbers than the dispatched kernel."""
    (z, w, inds, wts, beta, cap), _ = case(*CASES[0])
    wt = expert_layout.tile(w)
    want = np.array(mxfp4_one.expert_glu_decode_tiled(z, wt, inds, wts, beta, cap, "emulator"))
    shape = mxfp4_one.shape_for("cuda", *CASES[0][1:3])
    y = mxfp4_one.launch(
        kernel, z, wt, inds, wts, beta, cap, "emulator", shape=shape, groups=groups
    )
    return not np.array_equal(np.array(y[0]), want)


def test_a_staging_kept_for_another_token_is_caught():
    """A threadgroup that kept its staging across tokens (the key made constant) computes the
    second token from the first one's latent."""
    kernel = mxfp4_one.persistent(one_sweep.setting_kernel(8, 1, 2), keep=True)
    body = kernel.body.replace("staged_ = (p / K)", "staged_ = 0u")
    body = body.replace("staged_ != (p / K)", "staged_ != 0u")
    assert body != kernel.body
    assert differs_from_dispatched(kernel.variant("_nokey", body=body), groups=1)


def test_a_persistent_grid_that_stops_early_is_caught():
    """Threadgroups that stop after their first ticket leave work undone."""
    kernel = mxfp4_one.persistent(one_sweep.setting_kernel(8, 1, 2))
    body = kernel.body.replace("  ticket_ = s_next[0];", "  ticket_ = (XG + XD) * pairs;", 1)
    assert body != kernel.body
    assert differs_from_dispatched(kernel.variant("_stop", body=body), groups=2)


def test_settings_parse():
    assert one_sweep.parse("8,1,8,8,1,2,1,0") == (8, 1, 8, 8, 1, 2, 1, 0, 0, 0, 0)
    assert one_sweep.parse("8,1,8,8,1,2,1,0,0,264")[-2] == 264
    with pytest.raises(argparse.ArgumentTypeError, match="rt,sk,gw1"):
        one_sweep.parse("8,1,8")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_ptxas_rows_report_each_settings_registers(tmp_path):
    """``--ptxas``: ptxas's registers per setting, no GPU (the dispatched row first)."""
    out = tmp_path / "regs.md"
    rows = one_sweep.main(["--ptxas", "--settings", "8,1,8,8,1,2,1,0", "--out", str(out)])
    setting = one_sweep.parse("8,1,8,8,1,2,1,0")
    assert [lab for lab, _ in rows] == [one_sweep.DISPATCHED, one_sweep.label(setting)]
    assert all(regs.startswith("128") for _, regs in rows)  # the launch bound: 2 x 256 threads
    assert "| setting | registers" in out.read_text()


def test_timed_rows_at_toy_size(tmp_path, monkeypatch):
    """The timing mode (what ``h200.sh issue5_decode`` runs) at toy size on the emulator:
    gather_qmm first, the dispatched row, each setting, the read limit; every setting's
    first call with the dispatched row's bits."""
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    out = tmp_path / "sweep.md"
    argv = ["--dim", "256", "--hidden", "256", "--experts", "8", "--topk", "2", "--calls", "2"]
    argv += ["--lengths", "1", "2", "--rounds", "1", "--repeats", "1", "--gather-qmm"]
    argv += ["--read-limit", "--settings", "8,1,8,8,1,2,1,0,0,2", "8,1,8,8,1,2,1,0,0,2,1"]
    rows = one_sweep.main(argv + ["--out", str(out)])
    labels = [r["label"] for r in rows]
    assert labels[0] == "gather_qmm" and labels[1] == f"mxfp4_one, {one_sweep.DISPATCHED}"
    assert labels[-1] == "read limit, one launch" and len(labels) == 5
    assert all(r["err"] < 1e-5 for r in rows if r["label"].startswith("mxfp4_one"))
    text = out.read_text()
    assert text.count(": 0.000e+00\n") == 3  # the dispatched row and both grids: same bits
