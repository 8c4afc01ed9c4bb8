"""A verdict per custom kernel and machine: checked once, kept in the user's cache.

The kernels have a pure-MLX reference (``kimi_k3.kernels.checks``). Before the dispatcher
hands out a kernel variant for the first time in a process, ``usable(name, backend)`` looks
for a verdict on it for this machine in ``<cache>/kernel_verdicts.json`` (the cache being
``kimi_k3.cache_dir()``), keyed by the variant, a hash of the kernel's source files, MLX's
version, the backend, the device's name and the fp32 matmul precision in force
(``MLX_ENABLE_TF32``). Without one it runs the variant's small case
(``checks.small_case``: small shapes, a fraction of a second on a GPU) against the
reference and records the verdict. A variant that fails to compile or launch, returns NaN
or inf, or disagrees with the reference is not used: the dispatcher returns None, so the
reference serves its calls, in this process and (from the recorded verdict) in later ones,
and one warning line names it and how to report it.

``python -m kimi_k3.doctor`` records verdicts too, from its wider cases. A changed kernel
source, another MLX, another device or another TF32 setting has another key, so it is
checked again.
``KIMI_K3_KERNEL_CHECK=0`` skips the check (every variant is used; for those who have run
the doctor); ``1`` or unset checks. ``KIMI_K3_REFERENCE`` still forces the reference before
any of this (``dispatch.reference_forced``).

The answer is kept per process in a dict: after the first call of a variant, a lookup is
one dict read. The first decision takes a lock, so threads calling at once check it once.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

from kimi_k3 import cache_dir
from kimi_k3.checkpoint.files import write_text_atomic

from . import checks
from .source import env_choice

CHECK_ENV = "KIMI_K3_KERNEL_CHECK"
TF32_ENV = "MLX_ENABLE_TF32"
FILE = "kernel_verdicts.json"
REPORT = "to report it, run `python -m kimi_k3.doctor` and paste its report into an issue"

_USABLE: dict = {}  # (variant, backend) -> bool, for this process
_LOCK = threading.Lock()
_HERE = Path(__file__).parent


def usable(name: str, backend: str) -> bool:
    """Whether kernel variant ``name`` (``checks.KERNELS``) may serve calls on ``backend``."""
    hit = _USABLE.get((name, backend))
    if hit is None:
        hit = _decide(name, backend)
    return hit


def _decide(name: str, backend: str) -> bool:
    with _LOCK:
        hit = _USABLE.get((name, backend))
        if hit is not None:
            return hit
        if env_choice(CHECK_ENV, ("0", "1"), "1") == "0":
            ok = True
        else:
            key = machine_key(name, backend)
            rec = load().get(key)
            if rec is None:
                rec = first_use_check(name, backend)
                record({key: rec})
            ok = rec["verdict"] == "pass"
            if not ok:
                warn(name, rec)
        _USABLE[(name, backend)] = ok
        return ok


def first_use_check(name: str, backend: str) -> dict:
    """Run ``name``'s small case against the reference; the verdict as recorded."""
    t0 = time.perf_counter()
    try:
        res = checks.run_case(checks.small_case(name, backend))
    except Exception as e:  # building the inputs failed: no verdict on the kernel
        res = checks.Result(name, "", "error", None, 0.0, f"{type(e).__name__}: {e}")
    return verdict_record(res, time.perf_counter() - t0, "first use")


def verdict_record(res, seconds: float, by: str) -> dict:
    """What the verdict file keeps for a ``checks.Result``."""
    return {
        "verdict": "pass" if res.ok else "fail",
        "reason": res.verdict if not res.ok else "",
        "detail": res.detail,
        "shape": res.shape,
        "err": res.err,
        "tol": res.tol,
        "seconds": round(seconds, 4),
        "checked_by": by,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def warn(name: str, rec: dict) -> None:
    """The one line a failed variant gets per process."""
    sys.stderr.write(
        f"kimi_k3: warning: kernel {name} failed its check on {device_name()} "
        f"({rec['reason']}: {rec['detail']}); the pure-MLX reference serves it instead; "
        f"{REPORT}\n"
    )


def verdicts_path() -> Path:
    return cache_dir() / FILE


def load() -> dict:
    """The recorded verdicts (``{}`` where there is no file, or an unreadable one: a cache,
    rebuilt by checking again)."""
    try:
        data = json.loads(verdicts_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record(entries: dict) -> None:
    """Add ``{key: record}`` to the verdict file (written whole, atomically). A cache that
    cannot be written leaves the verdicts in this process only, with one line saying so."""
    path = verdicts_path()
    data = {**load(), **entries}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        sys.stderr.write(f"kimi_k3: {path}: kernel verdicts not saved ({e.strerror})\n")


def forget() -> None:
    """Drop this process's answers (the next call of each variant reads the file again)."""
    with _LOCK:
        _USABLE.clear()


def device_name() -> str:
    """The device the kernels run on: the GPU's name, or the emulator's host."""
    if mx.metal.is_available() or mx.cuda.is_available():
        info = mx.device_info()
        return str(info.get("device_name") or info.get("architecture") or "gpu")
    return f"{platform.machine()} CPU"


def machine_key(name: str, backend: str) -> str:
    """``variant|source hash|mlx version|backend|device|precision``: one verdict's key.
    The precision is MLX's fp32 matmul setting (``tf32`` unless ``MLX_ENABLE_TF32=0``):
    it changes what the reference computes on a GPU, so a verdict taken under one setting
    is not reused under the other."""
    parts = (name, source_hash(name, backend), mx.__version__, backend, device_name())
    return "|".join((*parts, matmul_precision()))


def matmul_precision() -> str:
    """``fp32`` where ``MLX_ENABLE_TF32=0``, else ``tf32`` (MLX's default: fp32 matmuls may
    run as TF32 on hardware that has it)."""
    return "fp32" if os.environ.get(TF32_ENV, "1").strip() == "0" else "tf32"


_HASHES: dict = {}


def source_hash(name: str, backend: str) -> str:
    """sha256 (16 hex digits) of the files the variant's code comes from: its module and the
    kernel modules it imports, transitively (``source.py`` and ``metal_emulator.py`` among
    them); and the emulator's C++ files for ``emulator``."""
    module = checks.module_of(name)
    key = (module, backend)
    if key not in _HASHES:
        files = sorted(kernel_files(module))
        if backend == "emulator":
            files += sorted((_HERE / "emulator").glob("*"))
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        _HASHES[key] = h.hexdigest()[:16]
    return _HASHES[key]


def kernel_files(module: str, seen: set | None = None) -> set:
    """``kernels/<module>.py`` and the kernel modules it imports (``from . import x``,
    ``from .x import y``, anywhere in the file), transitively."""
    seen = set() if seen is None else seen
    path = _HERE / f"{module}.py"
    if path in seen or not path.exists():
        return seen
    seen.add(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            for n in names:
                kernel_files(n.split(".")[0], seen)
    return seen
