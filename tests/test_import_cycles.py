"""The package's module graph, imports inside functions included: no import cycle beyond the
one the model layer still has (``kimi_k3.model.moe``, ``kimi_k3.model.routing`` and
``kimi_k3.distributed`` import one another), so a change that adds a cycle fails here, and
one that removes that cycle updates ``KNOWN``. The kernels' package imports none of the
model: the references its checks run are registered by ``kimi_k3.model.kda`` and
``kimi_k3.model.experts``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package name -> directory (pyproject.toml's package-dir)
PACKAGES = {"kimi_k3": ROOT / "kimi_k3", "kimi_k3.kernels": ROOT / "kernels"}
PACKAGES["kimi_k3.convert"] = ROOT / "convert"
KNOWN = {frozenset({"kimi_k3.distributed", "kimi_k3.model.moe", "kimi_k3.model.routing"})}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "kimi_k3" and parts and parts[0] in ("kernels", "convert"):
                continue
            out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its source (functions too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in known] or [base]
        for t in targets:
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> set[frozenset]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def graph() -> dict[str, set[str]]:
    """Module -> the modules it imports. A module importing a package it lies in (the root
    package's ``cache_dir``) is no edge: Python has run that package's ``__init__`` before
    the module, so no import of it can wait on the module."""
    mods = modules()
    out = {}
    for n, p in mods.items():
        out[n] = {t for t in imports(n, p, set(mods)) if not n.startswith(t + ".")}
    return out


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, sorted(sorted(c) for c in found)


# What the model layer and the kernels may import of the package: each other's modules and
# the checkpoint's file reading (errors, safetensors headers), which imports nothing of it.
BELOW_THE_MODEL = ("kimi_k3.kernels", "kimi_k3.checkpoint.files")


def _outside(deps: set[str], allowed: tuple[str, ...]) -> set[str]:
    return {d for d in deps if not any(d == a or d.startswith(a + ".") for a in allowed)}


def test_the_model_layer_imports_nothing_above_it():
    g = graph()
    model = [n for n in g if n.startswith("kimi_k3.model.")]
    assert "kimi_k3.model.moe" in model and "kimi_k3.model.parallel" in model
    for name in model:
        assert not _outside(g[name], ("kimi_k3.model", *BELOW_THE_MODEL)), name


def test_the_kernels_import_none_of_the_model():
    g = graph()
    for name, deps in g.items():
        if name.startswith("kimi_k3.kernels"):
            assert not _outside(deps, BELOW_THE_MODEL), (name, _outside(deps, BELOW_THE_MODEL))


# docs/architecture.md's layers, top to bottom: a module imports modules of its own layer or
# of those below it. A package's ``__init__`` is left out (each only names its modules).
LAYERS = [
    (
        "commands",
        (
            "generate",
            "server",
            "eval",
            "train",
            "corpus",
            "doctor",
            "projection",
            "convert.convert",
            "convert.__main__",
        ),
    ),
    ("shared CLI", ("cli", "distributed")),
    ("serving", ("serve.",)),
    (
        "loading",
        (
            "checkpoint.loader",
            "checkpoint.layouts",
            "checkpoint.expert_pack",
            "checkpoint.checksums",
            "streaming.",
            "trace",
            "default_model",
            "convert.synth",
            "convert.requant",
        ),
    ),
    ("model", ("model.",)),
    ("bottom", ("kernels.", "checkpoint.files", "text.", "progress")),
]


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of ``module`` (0 the top), or None for a package."""
    name = module.removeprefix("kimi_k3.")
    for i, (_, members) in enumerate(LAYERS):
        if any(name == m or (m.endswith(".") and name.startswith(m)) for m in members):
            return i
    return None


def test_every_module_has_a_layer():
    packages = {n for n, p in modules().items() if p.name == "__init__.py"}
    assert {n for n in modules() if layer_of(n) is None} == packages


def upward(g: dict[str, set[str]]) -> list[str]:
    """The imports in ``g`` that reach a layer above the importer's."""
    bad = []
    for name, deps in g.items():
        mine = layer_of(name)
        for d in deps:
            theirs = layer_of(d)
            if mine is not None and theirs is not None and theirs < mine:
                bad.append(f"{name} ({LAYERS[mine][0]}) imports {d} ({LAYERS[theirs][0]})")
    return bad


def test_each_layer_imports_only_its_own_and_those_below():
    assert not upward(graph())


def test_an_import_from_a_layer_above_is_found():
    g = {"kimi_k3.model.moe": {"kimi_k3.model.routing", "kimi_k3.streaming.store"}}
    g["kimi_k3.cli"] = {"kimi_k3.model.moe", "kimi_k3.distributed"}
    assert upward(g) == ["kimi_k3.model.moe (model) imports kimi_k3.streaming.store (loading)"]


def test_the_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    assert cycles({"a": {"b"}, "b": set()}) == set()


def test_an_upward_import_fails_the_layer_check():
    deps = {"kimi_k3.model.config", "kimi_k3.streaming.store", "kimi_k3.kernels.dispatch"}
    assert _outside(deps, ("kimi_k3.model", *BELOW_THE_MODEL)) == {"kimi_k3.streaming.store"}


def test_every_package_is_installed():
    """Each package folder is in pyproject.toml's ``packages``: a wheel without one would
    import in the source tree and fail once installed."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'^\s*"(kimi_k3[\w.]*)",?\s*$', text, re.M))
    packages = {n for n, p in modules().items() if p.name == "__init__.py"}
    assert packages <= listed, sorted(packages - listed)
