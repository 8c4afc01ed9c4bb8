"""What a newcomer meets first: the README's first commands (clone, venv, install, run, which
``.ci/run`` runs as written from an empty folder), and one style of ``--help`` for every
command the README and the docs name: ``usage: python -m kimi_k3.X``."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

from kimi_k3 import progress

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"python -m (kimi_k3\.\w+)(?: (run|export|fetch|stats|synth)\b)?")


def _quickstart_module():
    spec = importlib.util.spec_from_file_location("quickstart", REPO / ".ci" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_starts_with_clone_venv_install_run():
    """The README's first bash block goes from nothing to the demo model: a clone and its
    folder, a venv, its activation, an install with an extra pyproject defines, the run."""
    qs = _quickstart_module()
    script = qs.quickstart((REPO / "README.md").read_text(encoding="utf-8"))
    commands = [
        c.strip()
        for line in script.splitlines()
        for c in line.split("#", 1)[0].split("&&")
        if c.strip()
    ]
    clone, cd, venv, activate, install, run = commands
    url, folder = shlex.split(clone)[2:]
    assert shlex.split(clone)[:2] == ["git", "clone"] and cd == f"cd {folder}", commands
    assert venv == "python3 -m venv .venv" and activate == "source .venv/bin/activate"
    extras = importlib.metadata.metadata("kimi-k3").get_all("Provides-Extra")
    m = re.fullmatch(r"pip install -e '\.\[(\w+)\]'", install)
    assert m and m[1] in extras, install
    assert run == "python -m kimi_k3.generate"
    local = qs.localized(script, "/some where/kimi-k3")
    assert f"git clone '/some where/kimi-k3' {folder} && cd {folder}" in local
    assert f"git clone {url}" not in local
    ci = (REPO / ".ci" / "run").read_text()
    assert "python3 .ci/quickstart.py README.md" in ci and "bash -eo pipefail quickstart.sh" in ci


def test_quickstart_refuses_a_readme_without_one_clone():
    qs = _quickstart_module()
    with pytest.raises(ValueError, match="no ```bash block"):
        qs.quickstart("# nothing to run\n")
    with pytest.raises(ValueError, match="it has 0 git clone"):
        qs.localized("pip install -e .\n", "/x")


def documented_commands() -> list[tuple[str, ...]]:
    """``(module,)`` or ``(module, subcommand)`` for every ``python -m kimi_k3.X`` in the
    README and the docs."""
    found = set()
    for doc in DOCS:
        for m in COMMAND.finditer(doc.read_text(encoding="utf-8")):
            found.add(tuple(filter(None, m.groups())))
    return sorted(found)


def _main(module: str):
    if module == "kimi_k3.convert":
        return importlib.import_module("kimi_k3.convert.__main__").main
    return importlib.import_module(module).main


@pytest.mark.parametrize("command", documented_commands(), ids=" ".join)
def test_help_usage_line(command, capsys):
    """``--help`` names the command as it is typed: ``usage: python -m kimi_k3.X [SUB]``."""
    module, *sub = command
    with pytest.raises(SystemExit) as done:
        _main(module)([*sub, "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out.splitlines()[0]
    want = "usage: " + " ".join(["python", "-m", module, *sub]) + " "
    assert usage.startswith(want), usage


def test_every_command_is_documented():
    """Each ``kimi_k3`` module that runs as a command appears in the docs (and so in the
    usage-line test above)."""
    runnable = {
        f"kimi_k3.{f.stem}"
        for f in (REPO / "kimi_k3").glob("*.py")
        if 'if __name__ == "__main__":' in f.read_text()
    }
    documented = {c[0] for c in documented_commands()}
    assert runnable <= documented, runnable - documented
    assert "kimi_k3.convert" in documented


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_in_a_log_says_the_time_left(monkeypatch):
    """Off a terminal: a line after the first unit (the first estimate), then at most every
    ``every`` seconds, and one at the end; the estimate is the time per unit so far."""
    clock = iter([0.0, 10.0, 12.0, 40.0, 45.0, 50.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    out = _Stream(tty=False)
    bar = progress.Progress(4, "scoring", "window", stream=out, every=30)  # t = 0
    bar.update()  # t = 10: first unit, a line (10 s a window, 3 left)
    bar.update()  # t = 12: too soon for another
    bar.update()  # t = 40: 30 s since the last line
    bar.to(4)  # t = 45: done, too soon for a line; it comes at close (t = 50)
    bar.close()
    assert out.getvalue().splitlines() == [
        "scoring: 1/4 windows, 10 s so far, about 30 s left",
        "scoring: 3/4 windows, 40 s so far, about 13 s left",
        "scoring: 4/4 windows, 50 s so far",
    ]
    assert progress.duration(125) == "2.1 min" and progress.duration(3 * 3600) == "3.0 h"


def test_progress_on_a_terminal_is_a_bar():
    out = _Stream(tty=True)
    with progress.Progress(3, "fetching", "archive", stream=out) as bar:
        for _ in range(3):
            bar.update()
    assert "fetching: 100%" in out.getvalue() and "3/3" in out.getvalue()


def test_training_says_its_time_left(monkeypatch):
    """The sooner of the steps left at the rate so far, the run's minutes left and this
    process's deadline."""
    from kimi_k3.train import time_left

    monkeypatch.setattr("kimi_k3.train.time.time", lambda: 1000.0)
    # 10 steps in 100 s, 50 left: 500 s; the run's 600 s, 200 of them before: 300 s left
    assert time_left(10, 50, 900.0, None, 0.0, None) == "about 8.3 min left"
    assert time_left(10, 50, 900.0, 600.0, 200.0, None) == "about 5.0 min left"
    assert time_left(10, 50, 900.0, 600.0, 200.0, 1060.0) == "about 60 s left"


def test_doctor_says_how_long_and_how_to_get_the_projection(capsys):
    """It counts its cases up front, numbers each, and without --model ends with how to get
    the "how fast would K3 run here" table."""
    from kimi_k3 import doctor

    assert doctor.main(["--small", "--no-record", "--reps", "1"]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip().endswith(doctor.NO_MODEL_HINT)
    n = len(doctor.reference_cases(k3=False))
    assert f"\n{n} cases\n" in "\n" + out.err and f"[{n}/{n}] " in out.err
    assert "docs/usage.md#how-fast-k3-would-run-here" in doctor.NO_MODEL_HINT
    assert all("--small skips them" in note for note in doctor.SLOW_NOTE.values())


def test_readme_and_usage_describe_the_shipped_demo_model():
    """The demo's numbers where the README shows them (its layers, experts, megabytes:
    all, dense, experts) and the demo's line in docs/usage.md are the shipped checkpoint's,
    read from it: a new default model fails here until they are updated."""
    from kimi_k3 import default_model
    from kimi_k3.model.config import ModelArgs, read_config_json

    path = default_model.package_dir()
    args = ModelArgs.from_path(path)
    dense, experts = default_model.sizes(path)
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    for fact in (
        f"({args.num_hidden_layers} layers of K3's architecture, {args.num_experts} MXFP4 "
        f"routed experts a layer, top-{args.num_experts_per_token})",
        f"Its weights are {(dense + experts) / 1e6:.1f} MB: {dense / 1e6:.1f} MB of dense weights",
        f"and {experts / 1e6:.1f} MB of routed experts",
        f"for {read_config_json(path)['training']['wall_time_s'] / 60:.0f} minutes",
    ):
        assert fact in readme, fact
    usage = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    assert f"\n{default_model.describe(path)}\n" in usage
