"""The per-machine kernel verdicts (first-use check, fallback) and ``python -m kimi_k3.doctor``.

Faults are injected by monkeypatching: a kernel that returns wrong values, one whose build
(compile) raises, one that returns NaN. Each must give the reference's outputs, one warning
line, a recorded verdict, and no check again on the next load (a fresh process: the
in-process answers dropped). Kernels run on the Metal emulator; the verdicts go to a
temporary user cache.
"""

from __future__ import annotations

import json
import threading

import mlx.core as mx
import numpy as np
import pytest

from kimi_k3 import doctor, projection
from kimi_k3.kernels import (
    affine_decode,
    checks,
    kda_decode,
    metal_emulator,
    mxfp4_decode,
    source,
    verdict,
)
from kimi_k3.model.experts import expert_glu
from kimi_k3.model.kda import kda_mix

WARNING = "kimi_k3: warning: kernel"


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """The emulator as the kernel backend, the first-use check on, a fresh user cache (the
    emulator's compiled kernels kept where they are)."""
    monkeypatch.setenv("KIMI_K3_EMULATOR_CACHE", str(metal_emulator.cache_dir()))
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "emulator")
    monkeypatch.setenv(verdict.CHECK_ENV, "1")
    monkeypatch.delenv("KIMI_K3_REFERENCE", raising=False)
    verdict.forget()
    yield tmp_path / "cache" / verdict.FILE
    verdict.forget()


def kda_call():
    p, args = checks.kda_layer(2, 64, seed=5), checks.kda_inputs(1, 1, 2, 64, seed=6)
    return lambda: kda_mix(p, *args)


def expert_call():
    w = checks.random_experts(8, 128, 128, seed=5)
    inds, wts = checks.routing(3, 8, 4, seed=6)
    z = mx.array(np.random.default_rng(7).standard_normal((3, 128)).astype(np.float32))
    return lambda: expert_glu(z, w, inds, wts, checks.BETA, checks.CAP)


def affine_call():
    w = checks.random_affine_experts(8, 128, 128, 2, seed=5)
    inds, wts = checks.routing(3, 8, 4, seed=6)
    z = mx.array(np.random.default_rng(7).standard_normal((3, 128)).astype(np.float32))
    return lambda: expert_glu(z, w, inds, wts, checks.BETA, checks.CAP)


PARTS = {
    "kda_decode": (kda_call, "kda", kda_decode, "kda_decode"),
    "mxfp4_decode": (expert_call, "experts", mxfp4_decode, "expert_glu_decode"),
    "affine2_decode": (affine_call, "experts", affine_decode, "expert_glu_decode"),
}


def reference_of(monkeypatch, call, part):
    monkeypatch.setenv("KIMI_K3_REFERENCE", part)
    want = [np.array(a) for a in _list(call())]
    monkeypatch.delenv("KIMI_K3_REFERENCE")
    return want


def _list(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def inject(monkeypatch, fault: str, module, fn: str) -> list:
    """Break the kernel ``module.fn`` in the way ``fault`` says; the returned list counts
    the calls that reach it."""
    calls = []
    real = getattr(module, fn)
    if fault == "compile":

        def get(self, backend):
            calls.append(self.name)
            raise RuntimeError(f"{self.name}: compile failed (injected)")

        monkeypatch.setattr(source.Kernel, "get", get)
        return calls
    scale = 1.5 if fault == "wrong" else float("nan")

    def broken(*a, **k):
        calls.append(1)
        out = real(*a, **k)
        if isinstance(out, (list, tuple)):
            return type(out)([out[0] * scale, *out[1:]])
        return out * scale

    monkeypatch.setattr(module, fn, broken)
    return calls


@pytest.mark.parametrize(
    "fault, reason", [("wrong", "mismatch"), ("compile", "error"), ("nan", "non-finite")]
)
@pytest.mark.parametrize("name", sorted(PARTS))
def test_a_faulty_kernel_falls_back_once_and_for_good(
    machine, monkeypatch, capsys, name, fault, reason
):
    make, part, module, fn = PARTS[name]
    call = make()
    want = reference_of(monkeypatch, call, part)
    calls = inject(monkeypatch, fault, module, fn)
    for _ in range(2):
        got = _list(call())
        assert all(np.array_equal(np.array(g), w) for g, w in zip(got, want, strict=True))
    assert calls, "the check ran the kernel"
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if WARNING in line]
    assert len(lines) == 1 and f"kernel {name} " in lines[0] and "kimi_k3.doctor" in lines[0]
    rec = json.loads(machine.read_text())[verdict.machine_key(name, "emulator")]
    assert rec["verdict"] == "fail" and rec["reason"] == reason
    assert rec["checked_by"] == "first use"

    verdict.forget()  # the next load: the verdict comes from the file
    seen = len(calls)
    got = _list(call())
    assert all(np.array_equal(np.array(g), w) for g, w in zip(got, want, strict=True))
    assert len(calls) == seen, "no check again, and the kernel not used"
    assert sum(WARNING in line for line in capsys.readouterr().err.splitlines()) == 1


@pytest.mark.parametrize("name", sorted(PARTS))
def test_a_good_kernel_passes_and_serves(machine, monkeypatch, capsys, name):
    make, part, module, fn = PARTS[name]
    call = make()
    calls = []
    monkeypatch.setattr(module, fn, _counting(calls, getattr(module, fn)))
    want = reference_of(monkeypatch, call, part)
    got = _list(call())
    assert len(calls) == 2  # the check, then the call itself
    assert all(np.allclose(np.array(g), w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want))
    assert WARNING not in capsys.readouterr().err
    rec = json.loads(machine.read_text())[verdict.machine_key(name, "emulator")]
    assert rec["verdict"] == "pass" and rec["err"] <= rec["tol"]


def _counting(calls, real):
    def fn(*a, **k):
        calls.append(1)
        return real(*a, **k)

    return fn


def test_skip_and_reference_forced(machine, monkeypatch, capsys):
    call = kda_call()
    calls = inject(monkeypatch, "wrong", kda_decode, "kda_decode")
    monkeypatch.setenv("KIMI_K3_REFERENCE", "kda")
    call()
    assert not calls and not machine.exists()  # forced reference: nothing checked
    monkeypatch.setenv("KIMI_K3_REFERENCE", "0")
    monkeypatch.setenv(verdict.CHECK_ENV, "0")
    call()
    assert len(calls) == 1 and not machine.exists()  # no check: the kernel serves as is
    assert WARNING not in capsys.readouterr().err
    monkeypatch.setenv(verdict.CHECK_ENV, "yes")
    verdict.forget()
    with pytest.raises(ValueError, match=verdict.CHECK_ENV):
        call()


def test_threads_at_first_use_check_once(machine, monkeypatch):
    calls = []
    real = kda_decode.kda_decode
    monkeypatch.setattr(kda_decode, "kda_decode", _counting(calls, real))
    answers = []
    ts = [
        threading.Thread(target=lambda: answers.append(verdict.usable("kda_decode", "emulator")))
        for _ in range(4)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert answers == [True] * 4 and len(calls) == 1


def test_another_mlx_or_source_is_checked_again(machine, monkeypatch):
    key = verdict.machine_key("kda_decode", "emulator")
    other = key.replace(f"|{mx.__version__}|", "|0.0.1|")
    verdict.record({other: {"verdict": "fail", "reason": "mismatch", "detail": ""}})
    assert verdict.usable("kda_decode", "emulator")  # checked here, and passed
    data = json.loads(machine.read_text())
    assert data[key]["verdict"] == "pass" and data[other]["verdict"] == "fail"
    assert verdict.source_hash("mxfp4_prefill", "metal") != verdict.source_hash(
        "mxfp4_decode", "metal"
    )
    assert verdict.kernel_files("mxfp4_prefill") >= verdict.kernel_files("mxfp4_decode")


def test_an_unreadable_verdict_file_is_rebuilt(machine):
    machine.parent.mkdir(parents=True)
    machine.write_text("{not json")
    assert verdict.usable("kda_decode", "emulator")
    assert json.loads(machine.read_text())[verdict.machine_key("kda_decode", "emulator")]


# --- the doctor ---------------------------------------------------------------------------


def test_doctor_emulated_kernels_pass_and_are_recorded(machine, capsys):
    assert doctor.main(["--emulate", "--small", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "kernel backend: emulator" in out and f"MLX {mx.__version__}" in out
    for name in checks.KERNELS["emulator"]:
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        assert row.endswith("| pass |")
    n = len(checks.KERNELS["emulator"])
    assert f"all {n} checks pass" in out
    data = json.loads(machine.read_text())
    assert {v["checked_by"] for v in data.values()} == {"doctor"} and len(data) == n


def test_doctor_reports_a_broken_kernel(machine, monkeypatch, capsys):
    inject(monkeypatch, "wrong", mxfp4_decode, "expert_glu_decode")
    assert doctor.main(["--emulate", "--small", "--reps", "1", "--no-record"]) == 1
    out = capsys.readouterr().out
    assert "| mxfp4_decode |" in out and "MISMATCH: error" in out
    assert "FAILED: mxfp4_decode." in out and not machine.exists()


def test_doctor_without_a_gpu_checks_the_reference(monkeypatch, capsys, tiny_ckpt):
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "none")
    assert doctor.main(["--small", "--reps", "1", "--model", str(tiny_ckpt)]) == 0
    out = capsys.readouterr().out
    assert "no GPU" in out and "all 2 checks pass" in out
    assert "| shards |" in out and "## How fast K3 would run here" in out
    assert (
        f"Recommended: --expert-cache-gb {projection.recommended_budget(doctor.ram_gb())} " in out
    )


@pytest.mark.parametrize(
    "argv, what",
    [
        (["--reps", "0"], "--reps 0"),
        (["--read-gb", "-1"], "--read-gb -1"),
        (["--model", "/nonexistent/dir"], "--model /nonexistent/dir"),
        (["--expert-cache-gb", "nan"], "--expert-cache-gb nan"),
    ],
)
def test_doctor_bad_arguments(capsys, argv, what):
    assert doctor.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {what}")


def test_recommended_budget_leaves_room_for_the_dense_weights_and_buffers():
    assert projection.expert_budget_gb(128) == 128 - 30 - 16
    # 16 readers x (17,547,264 + 8,192) bytes = 0.28 GB of buffers: 82 - 0.28 -> 81
    assert projection.recommended_budget(128) == 81
    assert projection.recommended_budget(128, io_threads=64) == 80  # 1.12 GB of buffers
    assert projection.recommended_budget(46.2) == 0 and projection.recommended_budget(32) == 0


def test_projection_of_k3_sizes_is_the_default():
    mac = projection.Mac("m", 128, 13.5, 614)
    assert projection.project(mac, 1, 0.1, 1.0, 1.0, 0.63) == projection.project(
        mac, 1, 0.1, 1.0, 1.0, 0.63, sizes=projection.K3
    )
    half = projection.Sizes(92, 896, 8, 17_547_264, 30.0)  # top-8: the same as keeping half
    assert projection.project(mac, 1, 0.1, 1.0, 1.0, 0.63, sizes=half) == projection.project(
        mac, 1, 0.1, 0.5, 1.0, 0.63
    )


def test_streamer_and_raw_reads_make_the_same_reads(tiny_ckpt):
    """The doctor's two read runs read the same bytes: every byte range of the plan's
    experts, each once."""
    from kimi_k3.model.config import ModelArgs
    from kimi_k3.streaming import readrate
    from kimi_k3.streaming.sources import expert_shapes, open_source

    args = ModelArgs.from_path(tiny_ckpt)
    layers = list(range(args.first_k_dense_replace, args.num_hidden_layers))
    source = open_source(tiny_ckpt, None, args, layers, "shards")
    calls = readrate.plan(args.num_experts, layers, "decode", 3, args.num_experts_per_token)
    calls = readrate.misses(calls)
    assert all(len(set(c)) == len(c) for c in calls)
    want = sum(e.nbytes for call in calls for c in call for e in source.extents(*c))
    streamed = readrate.streamer_read(source, expert_shapes(args), calls, 4, True)
    raw = readrate.raw_read(source, calls, 4)
    assert round(streamed["gb"] * 1e9) == round(raw["gb"] * 1e9) == want
    assert streamed["wall_gbps"] > 0 and raw["wall_gbps"] > 0 and not streamed["checked"]


def test_the_read_test_keeps_to_its_budget(tiny_ckpt):
    """Two layer calls of top-k experts at the least; otherwise no more than ``read_gb``."""
    from kimi_k3.model.config import ModelArgs
    from kimi_k3.streaming.sources import expert_bytes, expert_shapes

    args = ModelArgs.from_path(tiny_ckpt)
    call = expert_bytes(expert_shapes(args)) * args.num_experts_per_token / 1e9
    least = doctor.read_rates(tiny_ckpt, "shards", 1e-12, 1, lambda _: None)
    assert 0 < least["gb"] <= 2 * call + 1e-12
    some = doctor.read_rates(tiny_ckpt, "shards", 5 * call, 1, lambda _: None)
    assert least["gb"] < some["gb"] <= 5 * call + 1e-12


def test_a_recorded_failure_holds_in_a_later_process(machine, monkeypatch, tmp_path):
    """A fresh process finds the failed verdict and uses the reference, checking nothing
    (its kernel is sound: only the file says otherwise)."""
    import os
    import subprocess
    import sys

    inject(monkeypatch, "wrong", kda_decode, "kda_decode")
    kda_call()()
    recorded = machine.read_text()
    script = (
        "import numpy as np, os\n"
        "from kimi_k3.kernels import checks\n"
        "from kimi_k3.model.kda import kda_mix\n"
        "p, a = checks.kda_layer(2, 64, seed=5), checks.kda_inputs(1, 1, 2, 64, seed=6)\n"
        "got = np.array(kda_mix(p, *a)[0])\n"
        "os.environ['KIMI_K3_REFERENCE'] = 'kda'\n"
        "want = np.array(kda_mix(p, *a)[0])\n"
        "print(np.array_equal(got, want))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ)
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True"
    assert sum(WARNING in line for line in res.stderr.splitlines()) == 1
    assert machine.read_text() == recorded  # nothing checked again


def test_doctor_reports_a_reference_path_that_disagrees(monkeypatch, capsys):
    import kimi_k3.model.experts as experts

    real = experts.expert_glu_reference
    monkeypatch.setattr(experts, "expert_glu_reference", lambda *a: real(*a) * 1.01)
    monkeypatch.setenv("KIMI_K3_KERNEL_BACKEND", "none")
    assert doctor.main(["--small", "--reps", "1"]) == 1
    out = capsys.readouterr().out
    assert "| experts reference: gather_qmm vs dense |" in out and "MISMATCH: error 1.0" in out
    assert "MLX's own operations disagree on this machine" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", checks.KERNELS["cuda"][2:])
def test_cuda_variants_pass_their_first_use_case_on_the_emulator(name):
    """CUDA's tensor-core variants have Metal renderings the emulator runs: their small
    cases (what the first-use check runs on an NVIDIA GPU) must pass there, so that a sound
    kernel is not turned off by its own check."""
    res = checks.run_case(checks.small_case(name, "emulator"))
    assert res.ok, res.detail


# --- TF32: the reference's precision on a GPU is not the kernel's ----------------------


def _tf32(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to TF32 (10 mantissa bits), as a GPU's TF32 matmul reads its operands."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _product_case(kernel_tf32: bool, reference_tf32: bool, oracle: bool) -> checks.Case:
    """A KDA-tolerance case whose outputs are one fp32 product of K3's head width (128),
    computed exactly or with TF32 operands, as a kernel or a reference on a GPU would."""
    r = np.random.default_rng(0)
    a = r.standard_normal((64, 128)).astype(np.float32)
    b = r.standard_normal((128, 64)).astype(np.float32)

    def product(t32: bool):
        x, y = (_tf32(a), _tf32(b)) if t32 else (a, b)
        return lambda: [mx.array((x.astype(np.float64) @ y).astype(np.float32))]

    exact = product(False)
    return checks.Case(
        "kda_prefill",
        "64x128 @ 128x64",
        product(kernel_tf32),
        product(reference_tf32),
        checks.KDA_TOL,
        oracle=exact if oracle else None,
    )


def test_tf32_sized_errors_are_above_the_kda_tolerance():
    """The premise: a TF32 product at head width 128 is off by a few 1e-4 (the CUDA doctor
    saw 3.9e-4 to 4.2e-4 on kda_prefill), above KDA_TOL, far above an exact kernel's."""
    res = checks.run_case(_product_case(False, True, oracle=False))
    assert res.verdict == "mismatch" and 2e-4 < res.err < 1e-3, res


def test_a_correct_kernel_passes_against_the_exact_oracle_whatever_the_reference():
    """The reference on the device runs its matmuls in TF32 (MLX's default on CUDA); the
    verdict compares with the oracle (the reference in fp32), so the exact kernel passes."""
    res = checks.run_case(_product_case(False, True, oracle=True), reps=1)
    assert res.ok and res.err < 1e-6, res
    assert res.reference_ms is not None  # the device reference is still what gets timed


def test_a_kernel_that_loses_fp32_is_still_caught():
    """A kernel that computes in TF32 where its contract is fp32 is off by TF32's error
    against the exact oracle: demoted."""
    res = checks.run_case(_product_case(True, True, oracle=True))
    assert res.verdict == "mismatch" and res.err > checks.KDA_TOL, res


def test_kda_cases_compare_with_an_fp32_oracle_on_a_gpu(monkeypatch):
    """On the CPU the reference is exact already (no oracle); where a GPU is the default
    device, the oracle is the same reference run on the CPU stream."""
    assert checks.exact(lambda: []) is None
    assert checks.kda_case("kda_prefill", "emulator", 1, 65, 2, 64).oracle is None
    monkeypatch.setattr(checks.mx, "default_device", lambda: mx.gpu)
    streams, stream = [], mx.stream

    def recorded(device):
        streams.append(device)
        return stream(device)

    monkeypatch.setattr(checks.mx, "stream", recorded)
    out = checks.exact(lambda: [mx.ones((2,))])()
    assert len(out) == 1 and streams == [mx.cpu]


def test_the_tf32_setting_is_part_of_the_verdict_key(monkeypatch):
    monkeypatch.delenv(verdict.TF32_ENV, raising=False)
    default = verdict.machine_key("kda_prefill", "cuda")
    monkeypatch.setenv(verdict.TF32_ENV, "0")
    off = verdict.machine_key("kda_prefill", "cuda")
    monkeypatch.setenv(verdict.TF32_ENV, "1")
    on = verdict.machine_key("kda_prefill", "cuda")
    assert default == on != off
    assert default.endswith("|tf32") and off.endswith("|fp32")
