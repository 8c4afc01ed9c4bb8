"""Every example in the README and the docs runs as written, and prints no reserved token.

The fenced blocks of ``README.md`` and ``docs/*.md`` are read as they stand. Each block names
its language: ``python`` and ``bash`` blocks are examples, ``text`` and ``json`` are output,
diagrams and file formats. A Python block runs as a script from the repository's folder. A
bash block runs command by command in one ``bash -e`` from the repository's folder, its
standard input empty, except the commands ``NOT_RUN`` lists with the reason; those that are
``python -m kimi_k3.X`` commands still have their flags parsed by the command's own parser,
so a renamed flag fails here. Every rule of ``NOT_RUN`` matches some command.

The real model's directory, ``~/models/Kimi-K3``, is a synthetic checkpoint in the published
layout (random weights, K3's tensor names and dtypes): ``HOME`` is a temporary folder that
holds one; the user cache (``XDG_CACHE_HOME``) is one temporary folder for all. ``/tmp/``,
``/data/`` and ``$(mktemp -d)`` in a command stand for folders in the test's temporary
folder.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kimi_k3.convert.synth import write_checkpoint

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LANGUAGES = {"python", "bash", "text", "json"}
RESERVED = "<|reserved_token_"

# Commands not run here, by a regular expression that finds them, with the reason.
NOT_RUN = [
    (r"^git clone |^python -m kimi_k3\.generate$", ".ci/run runs the README's first commands"),
    (r"^python3 -m venv |^pip install ", "installs: .ci/run does, in a fresh venv"),
    (r"-m pytest", "the test suite itself (.ci/run)"),
    (r"-m kimi_k3\.server |^curl ", "a server, serving until stopped: tests/test_server_http.py"),
    (r"-m kimi_k3\.doctor", "K3's shapes, tens of seconds or more on a CPU: tests/test_doctor.py"),
    (r"--set num_experts=896", "full-width layers of 896 experts: 31 GB on disk"),
    (r"--preset small --seed 1|/tmp/k3e\b", "K3's expert size: 2.25 GB on disk"),
    (r"^mlx\.launch ", "several ranks or machines: tests/test_distributed.py"),
    (r"-m benchmarks\.", "a benchmark: minutes, or a GPU (docs/benchmarks.md)"),
    (r"^bash (\$R/)?benchmarks/", "GPU runs, on a lent GPU machine"),
    (r"-m kimi_k3\.corpus ", "downloads the corpus from package registries"),
    (r"-m kimi_k3\.train |^R=|^LD_LIBRARY_PATH=|train\.prepare", "training: minutes to hours"),
    (r"-m kimi_k3\.eval", "minutes over the default model and its variants"),
    (r"examples/explore_kimi_k3|jupyter execute", "tests/test_examples.py runs the notebook"),
]
NOT_RUN_PYTHON = {
    "README.md": "tests/test_python_api.py runs it as written and checks its stats",
}


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(Block(doc.relative_to(REPO).as_posix(), line, m[1], m[2]))
    return out


def _open_quote(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # no closing quotation
        return True
    return False


def commands(code: str) -> list[str]:
    """A bash block's commands: continuation lines joined (and the lines of a quoted string,
    as they are), blank and comment lines dropped; a ``for`` loop up to its ``done`` is one
    command."""
    out, cur, loop = [], "", False
    for line in code.splitlines():
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        if _open_quote(cur + line):
            cur += line + "\n"
            continue
        text, cur = (cur + line).strip(), ""
        if not text or text.startswith("#"):
            continue
        if loop:
            out[-1] += "\n" + text
            loop = text != "done"
        else:
            out.append(text)
            loop = text.startswith("for ")
    return out


def not_run(command: str) -> str | None:
    """Why ``command`` is not run, or None."""
    return next((why for rule, why in NOT_RUN if re.search(rule, command, re.M)), None)


PYTHON = [b for b in blocks() if b.lang == "python"]
BASH = [b for b in blocks() if b.lang == "bash"]
RUN_PYTHON = [b for b in PYTHON if b.doc not in NOT_RUN_PYTHON]


@pytest.fixture(scope="module")
def user_cache(tmp_path_factory) -> Path:
    """One user cache for the module's examples: the demo model is copied there once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def home(tmp_path, user_cache) -> dict:
    """The environment the examples run in: ``HOME`` with ``models/Kimi-K3`` a synthetic
    checkpoint, ``python`` this interpreter, no ``KIMI_K3_*`` variable."""
    home = tmp_path / "home"
    # experts of 64 x 64: a multiple of every group size the converter's --expert-bits takes
    write_checkpoint(home / "models" / "Kimi-K3", "tiny", moe_intermediate_size=64)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_K3_")}
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(user_cache),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        MPLBACKEND="Agg",
    )
    return env


def _local(command: str, tmp: Path) -> str:
    """``command`` with ``/tmp/``, ``/data/`` and ``$(mktemp -d)`` in ``tmp``. (``TMPDIR``
    stays as it is: MLX keeps the CPU kernels it compiles in the temporary folder.)"""
    for old, new in (
        ("/tmp/", f"{tmp}/t/"),
        ("/data/", f"{tmp}/data/"),
        ("$(mktemp -d)", f"{tmp}/m"),
    ):
        command = command.replace(old, new)
    return command


def _ran(proc, what: str):
    assert proc.returncode == 0, f"{what}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert RESERVED not in proc.stdout + proc.stderr, proc.stdout[-3000:]


def test_every_block_names_its_language():
    bad = [f"{b.id}: ```{b.lang}" for b in blocks() if b.lang not in LANGUAGES]
    assert not bad, "fenced blocks need one of " + ", ".join(sorted(LANGUAGES)) + f": {bad}"


def test_every_rule_finds_a_command():
    found = [c for b in BASH for c in commands(b.code)]
    unused = [rule for rule, _ in NOT_RUN if not any(re.search(rule, c, re.M) for c in found)]
    assert not unused, f"NOT_RUN rules that match no command: {unused}"
    assert set(NOT_RUN_PYTHON) <= {b.doc for b in PYTHON}


def test_commands_split():
    code = "a \\\n  b  # c\n# only a comment\n\nfor r in 0 1; do\n  x $r\ndone\nlast\n"
    assert commands(code) == ["a    b  # c", "for r in 0 1; do\nx $r\ndone", "last"]
    code = "python -c '\nfor i in x:\n    f(i)'\nnext\n"
    assert commands(code) == ["python -c '\nfor i in x:\n    f(i)'", "next"]


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN_PYTHON, ids=lambda b: b.id)
def test_python_example_runs(block, home, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=REPO,
        env=home,
        capture_output=True,
        text=True,
        timeout=600,
    )
    _ran(proc, f"{block.id} failed")


RUN_BASH = [b for b in BASH if any(not_run(c) is None for c in commands(b.code))]


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN_BASH, ids=lambda b: b.id)
def test_bash_example_runs(block, home, tmp_path):
    """The block's commands that ``NOT_RUN`` leaves, in order, in one shell."""
    for name in ("t", "data", "m"):
        (tmp_path / name).mkdir()
    script = "\n".join(_local(c, tmp_path) for c in commands(block.code) if not_run(c) is None)
    proc = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=REPO,
        env=home,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    _ran(proc, f"{block.id} failed:\n{script}")


def _parser(module: str, argv: list[str]):
    """``(parser, argv)``: the argparse parser of ``python -m module ARGV`` and the arguments
    it parses, or ``(None, argv)`` where the module builds its parser inside ``main``."""
    import importlib

    if module == "kimi_k3.convert" and argv[:1] == ["synth"]:
        return importlib.import_module("kimi_k3.convert.synth").setup_arg_parser(), argv[1:]
    if module == "kimi_k3.convert":
        return importlib.import_module("kimi_k3.convert.convert").setup_arg_parser(), argv
    m = importlib.import_module(module)
    return (m.setup_arg_parser() if hasattr(m, "setup_arg_parser") else None), argv


def skipped_commands() -> list[tuple[str, str]]:
    """``(block id, command)`` of each ``python -m kimi_k3.X`` command not run, written as a
    plain command (no shell variable, pipe, loop or ``[...]``/``...`` synopsis), whose
    module has a parser to hand (``kimi_k3.corpus`` has not)."""
    out = []
    for b in BASH:
        for c in commands(b.code):
            plain = not re.search(r"[$|;\[]|\.\.\.", c)
            if not_run(c) and plain and re.match(r"^python -m kimi_k3\.", c):
                module, *argv = shlex.split(c, comments=True)[2:]
                if _parser(module, argv)[0] is not None:
                    out.append((b.id, c))
    return out


@pytest.mark.parametrize("where, command", skipped_commands(), ids=lambda x: x[:40])
def test_commands_not_run_have_valid_flags(where, command, capsys):
    module, *argv = shlex.split(command, comments=True)[2:]
    parser, argv = _parser(module, argv)
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: {command}\n{capsys.readouterr().err} (exit {e.code})")
