"""The docs name code and files that exist.

Code references (``docs/architecture.md``, ``docs/model.md``) are code spans of the forms

- ``path.py:name`` / ``path.py:Class.member``: the file (a repository path, or the unique
  repository file whose path ends with it) defines ``name`` at module level, or the class
  ``Class`` (or a base class of it in the repository) defines or assigns ``member``;
- ``path.py`` and ``dir/``: the file or folder exists;
- ``module.name`` where ``module`` is the stem of exactly one repository module: that module
  defines ``name``;
- ``Class.member`` (a capitalised first part): the last file of the step defines the class
  with that member, else some repository class of that name does;
- a bare ``name`` joined by ``→`` or `` / `` to the reference before it (the walk's
  convention, "Steps are `file:function`"): the file of that reference defines ``name`` at
  module level, or its class has it as a member.

Names are read from the source with ``ast``; nothing is imported. Relative markdown links
in the docs and the READMEs point to files that exist, and ``#anchor`` links to headings
that exist (GitHub's rule: lowercase, punctuation other than ``-`` and ``_`` dropped,
spaces to hyphens, ``-N`` for the Nth repeat); so do the ``docs/NAME.md#anchor`` citations
in the code, and nothing cites the model brief (``BRIEF``) that is not in the repository.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CODE_ROOTS = ("kimi_k3", "kernels", "convert", "benchmarks", "tests", "examples")
REFERENCE_DOCS = ("docs/architecture.md", "docs/model.md")
LINK_DOCS = ("README.md", *sorted(f"docs/{f.name}" for f in (REPO / "docs").glob("*.md")))

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
PATH_REF = re.compile(r"^(?P<path>[\w./-]+\.py):(?P<qual>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")
FILE_REF = re.compile(r"^[\w./-]+\.py$")
DIR_REF = re.compile(r"^[\w.-]+(?:/[\w.-]+)*/$")
CLASS_MEMBER = re.compile(r"^[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*\.[A-Za-z_]\w*$")  # CamelCase
MODULE_NAME = re.compile(r"^[a-z_][a-z0-9_]*\.(?!(?:json|md|model|npz|safetensors|txt)$)\w+$")
BARE = re.compile(r"^[A-Za-z_]\w*$")
CHAIN = re.compile(r"^\s*(\([^()`]*\))?\s*(→|/)\s*$")  # an arrow, maybe after a remark
MD_REF = re.compile(r"^[\w./-]+\.md$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CITED_DOC = re.compile(r"(?P<path>docs/[\w-]+\.md)(?:#(?P<anchor>[\w-]+))?")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)

# a model brief outside the repository, which nothing may cite; docs/model.md holds its facts
BRIEF = "KIMI_K3" + ".md"


# Python sources: what each file and class defines.


class Source:
    """Module-level names and per-class members of one Python file."""

    def __init__(self, path: Path):
        tree = ast.parse(path.read_text(), str(path))
        self.names: set[str] = set()
        self.classes: dict[str, tuple[set[str], list[str]]] = {}
        for node in tree.body:
            self.names |= _bound(node)
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                self.classes[node.name] = (_members(node), bases)

    def has(self, qual: str) -> bool:
        first, *rest = qual.split(".")
        if first not in self.names:
            return False
        if not rest:
            return True
        if first not in self.classes:  # an imported name: only its binding is checked
            return True
        return len(rest) == 1 and class_has(self, first, rest[0])


def _bound(node: ast.stmt) -> set[str]:
    """Names a module- or class-level statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.If, ast.Try)):
        return {n for s in ast.iter_child_nodes(node) if isinstance(s, ast.stmt) for n in _bound(s)}
    return set()


def _members(cls: ast.ClassDef) -> set[str]:
    """Class-body names plus every ``self.X`` a method assigns."""
    out = {n for node in cls.body for n in _bound(node)}
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for a in ast.walk(t):
                if (
                    isinstance(a, ast.Attribute)
                    and isinstance(a.value, ast.Name)
                    and a.value.id == "self"
                ):
                    out.add(a.attr)
    return out


def class_has(src: Source, cls: str, member: str, seen: frozenset = frozenset()) -> bool:
    """``cls`` of ``src`` (or a repository base class of it) has ``member``."""
    if cls in seen or cls not in src.classes:
        return False
    members, bases = src.classes[cls]
    if member in members:
        return True
    for base in bases:
        for other in [src] + [s for s in all_sources() if s is not src]:
            if base in other.classes and class_has(other, base, member, seen | {cls}):
                return True
    return False


@cache
def code_files() -> tuple[Path, ...]:
    return tuple(sorted(f for r in CODE_ROOTS for f in (REPO / r).rglob("*.py")))


@cache
def source(path: Path) -> Source:
    return Source(path)


def all_sources() -> list[Source]:
    return [source(f) for f in code_files()]


def find_file(ref: str) -> tuple[Path | None, str]:
    """The repository file a doc's path names, or None and why not."""
    if (REPO / ref).is_file():
        return REPO / ref, ""
    hits = [f for f in code_files() if f.relative_to(REPO).as_posix().endswith("/" + ref)]
    if len(hits) == 1:
        return hits[0], ""
    if hits:
        return None, f"ambiguous file {ref} ({', '.join(str(h.relative_to(REPO)) for h in hits)})"
    return None, f"no file {ref}"


def module_file(stem: str) -> Path | None:
    """The one library module (not a test or benchmark) named ``stem``, if there is one."""
    hits = [
        f
        for f in code_files()
        if f.stem == stem and f.relative_to(REPO).parts[0] in ("kimi_k3", "kernels", "convert")
    ]
    return hits[0] if len(hits) == 1 else None


def find_class_member(cls: str, member: str, first: Path | None) -> bool:
    order = ([first] if first else []) + [f for f in code_files() if f != first]
    return any(class_has(source(f), cls, member) for f in order if cls in source(f).classes)


# Code references.


def blocks(text: str) -> list[str]:
    """Steps: paragraphs, list items and table rows, outside fenced code."""
    text = FENCE.sub("", text)
    out, cur = [], []
    for line in text.splitlines():
        starts = re.match(r"^\s*(\d+\.|[-*]|\|)\s", line) or line.startswith("|")
        if not line.strip() or (starts and not line.startswith("   ")):
            if cur:
                out.append("\n".join(cur))
            cur = [line] if line.strip() else []
        else:
            cur.append(line)
    if cur:
        out.append("\n".join(cur))
    return out


def check_references(text: str) -> list[str]:
    """Every code reference in markdown ``text`` that does not resolve, with the reason."""
    bad = []
    for block in blocks(text):
        file: Path | None = None
        cls: str | None = None
        end = 0
        for m in SPAN.finditer(block):
            span, between = m.group(1).strip(), block[end : m.start()]
            end = m.end()
            chained = file is not None and CHAIN.match(between) is not None
            why, file, cls = resolve(span, chained, file, cls)
            if why:
                bad.append(f"`{span}`: {why}")
    return bad


def resolve(span: str, chained: bool, file: Path | None, cls: str | None):
    """``(why it fails or "", file, class)`` for one code span, given the step so far."""
    if m := PATH_REF.match(span):
        path, why = find_file(m["path"])
        if path is None:
            return why, None, None
        if not source(path).has(m["qual"]):
            return f"{path.relative_to(REPO)} defines no {m['qual']}", None, None
        first = m["qual"].split(".")[0]
        return "", path, first if first in source(path).classes else None
    if FILE_REF.match(span):
        path, why = find_file(span)
        return why, path, None
    if DIR_REF.match(span):
        return ("" if (REPO / span).is_dir() else f"no folder {span}"), None, None
    if MD_REF.match(span):
        hits = [f for f in REPO.rglob(span.split("/")[-1]) if f.as_posix().endswith("/" + span)]
        return ("" if hits else f"no file {span} in the repository"), None, None
    if CLASS_MEMBER.match(span):
        name, member = span.split(".")
        if not find_class_member(name, member, file):
            return f"no class {name} with a member {member} in the repository", None, None
        where = file if file and name in source(file).classes else None
        return "", where or _class_file(name), name
    if MODULE_NAME.match(span):
        stem, name = span.split(".")
        path = module_file(stem)
        if path is None:  # not one of ours (mx.*, np.*, mlx_lm.*, ...): an aside in the step
            return "", file, cls
        if not source(path).has(name):
            return f"{path.relative_to(REPO)} defines no {name}", None, None
        return "", path, name if name in source(path).classes else None
    if BARE.match(span):
        if not chained:  # a name in the step: the step's file stays the context
            return "", file, cls
        src = source(file)
        if span in src.names:
            return "", file, span if span in src.classes else cls
        if cls and class_has(src, cls, span):
            return "", file, cls
        return f"{file.relative_to(REPO)} defines no {span} (after →)", None, None
    return "", None, None


def _class_file(name: str) -> Path | None:
    return next((f for f in code_files() if name in source(f).classes), None)


# Links.


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", text)):
        s = slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def check_links(text: str, where: Path) -> list[str]:
    """Every relative link in markdown ``text`` (a file in folder ``where``) that is broken."""
    bad = []
    body = SPAN.sub("", FENCE.sub("", text))
    for m in LINK.finditer(body):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue
        path, _, anchor = target.partition("#")
        dest = (where / path).resolve() if path else None
        if dest is not None and not dest.exists():
            bad.append(f"{target}: no file {path}")
            continue
        if anchor and (dest is None or dest.suffix == ".md"):
            heads = anchors(dest.read_text() if dest else text)
            if anchor not in heads:
                bad.append(f"{target}: no heading #{anchor}")
    return bad


# The tests.


@pytest.mark.parametrize("doc", REFERENCE_DOCS)
def test_code_references_resolve(doc):
    bad = check_references((REPO / doc).read_text())
    assert not bad, f"{doc}: references that do not resolve:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", LINK_DOCS)
def test_links_resolve(doc):
    path = REPO / doc
    bad = check_links(path.read_text(), path.parent)
    assert not bad, f"{doc}: broken links:\n" + "\n".join(bad)


def check_cited_docs(text: str) -> list[str]:
    """Every ``docs/NAME.md`` or ``docs/NAME.md#anchor`` in ``text`` (code, comments) that
    names a missing file or heading."""
    bad = []
    for m in CITED_DOC.finditer(text):
        path, anchor = REPO / m["path"], m["anchor"]
        if not path.is_file():
            bad.append(f"{m[0]}: no file {m['path']}")
        elif anchor and anchor not in anchors(path.read_text()):
            bad.append(f"{m[0]}: no heading #{anchor}")
    return bad


def test_code_cites_docs_that_exist():
    bad = [
        f"{f.relative_to(REPO)}: {b}"
        for f in code_files()
        if f != Path(__file__).resolve()
        for b in check_cited_docs(f.read_text())
    ]
    assert not bad, "citations of docs that do not exist:\n" + "\n".join(bad)


def test_cited_docs_checker():
    good = "see docs/model.md#chat-format and docs/benchmarks.md"
    assert check_cited_docs(good) == []
    bad = check_cited_docs("docs/model.md#no-such-part, docs/nothing.md")
    assert [b.split(":")[0] for b in bad] == ["docs/model.md#no-such-part", "docs/nothing.md"]


def test_no_citation_of_files_outside_the_repository():
    cited = [
        f.relative_to(REPO).as_posix()
        for f in [*code_files(), *REPO.glob("docs/*.md"), REPO / "README.md"]
        if BRIEF in f.read_text() and f != Path(__file__).resolve()
    ]
    assert not cited, f"cite {BRIEF}, which is not in the repository: {cited}"


@pytest.mark.parametrize(
    "text, expect",
    [
        ("`kimi_k3/model/model.py:Model.make_cache`", []),
        ("`kimi_k3/model/model.py:Model.no_such`", ["defines no Model.no_such"]),
        ("`kimi_k3/nowhere.py:f`", ["no file kimi_k3/nowhere.py"]),
        ("`model.py:sanitize_weights`", []),
        ("`attention.py:GatedMLA._decode`", []),
        ("`moe.py:LatentMoE.sharding_group`", []),  # assigned in __init__
        ("`moe.py:QuantizedRouter.trims`", []),  # from its base class
        ("1. `kda.py:kda_mix_reference` → `kda_reference` → `nope`", ["defines no nope"]),
        ("1. `kda.py:kda_mix_reference` (`nope`, no arrow)", []),
        ("`Streamer.run` → `_request` → `_missing`", ["defines no _missing"]),
        ("`layouts.detect`, `layouts.nothing`", ["defines no nothing"]),
        ("`np.unique`, `mx.fast.scaled_dot_product_attention`", []),
        ("`SlotPool.nothing`", ["no class SlotPool with a member nothing"]),
        (f"`config.json`, `X_proj.weight`, `{BRIEF}`", [f"no file {BRIEF}"]),
        ("`kimi_k3/streaming/`, `kimi_k3/nothing/`", ["no folder kimi_k3/nothing/"]),
        ("```\n`kimi_k3/nowhere.py:f`\n```", []),
    ],
)
def test_reference_checker(text, expect):
    bad = check_references(text)
    assert len(bad) == len(expect), bad
    for got, want in zip(bad, expect):
        assert want in got


@pytest.mark.parametrize(
    "text, expect",
    [
        ("[a](architecture.md) [b](https://example.com/x.md)", []),
        ("[a](nothing.md)", ["no file nothing.md"]),
        ("[a](architecture.md#contracts) [b](#here)\n## Here", []),
        ("[a](architecture.md#no-such-heading)", ["no heading #no-such-heading"]),
        ("[a](#gone)\n## Here", ["no heading #gone"]),
        ("[a](../kimi_k3/model/model.py) ![p](cache_policy.png)", []),
        ("`[a](nothing.md)` in code", []),
        ("## A `code` heading, with: punctuation\n[x](#a-code-heading-with-punctuation)", []),
        ("## Tests\n## Tests\n[x](#tests-1) [y](#tests-2)", ["no heading #tests-2"]),
    ],
)
def test_link_checker(text, expect):
    bad = check_links(text, REPO / "docs")
    assert len(bad) == len(expect), bad
    for got, want in zip(bad, expect):
        assert want in got


def test_slug():
    assert slug("MXFP4 (OCP microscaling)") == "mxfp4-ocp-microscaling"
    assert slug("`kernels/mxfp4_mma.py`, CUDA") == "kernelsmxfp4_mmapy-cuda"
    assert slug("Decode: the tiled store against MLX's layout") == (
        "decode-the-tiled-store-against-mlxs-layout"
    )
