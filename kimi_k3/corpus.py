"""The training corpus of the embedded default model, and its byte-level BPE tokenizer.

Two corpora, both split by file:

- **The standard library** (``STDLIB``, what the shipped model was trained on): the Python
  standard library's own source (``.py`` files: code, comments and docstrings), PSF-licensed.
  Which files: every ``*.py`` under the standard library directory except the test suites
  (``test/``, ``tests/``, ``idle_test/``) and installed third-party packages
  (``site-packages``, ``dist-packages``), and the machine-generated character-map codec
  tables (``encodings/cp1252.py`` and the like: 256-line lookup tables, marked
  ``GENERATED_MARK``). A file whose path relative to the library root hashes to 0 modulo
  ``HOLDOUT_MOD`` is held out for evaluation, so the split does not depend on which other
  files exist.
- **The standard library plus ``SOURCES``**: permissively licensed Python, C and English
  prose from pinned archives of the package registries (PyPI sdists, Debian packages).
  ``python -m kimi_k3.corpus fetch DIR`` downloads them and checks each archive's SHA-256
  against the pinned value; the corpus is then read straight from the archives in ``DIR``
  with no network (``read_corpus``). A source's file is held out when
  ``source/relative_path`` hashes to 0 modulo ``HOLDOUT_MOD``; the standard library keeps
  its own rule above, so its held-out files, the text the project's perplexities are
  measured on, are the same in both corpora.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the training files, using
K3's pre-tokenizer regex, and written as K3 writes its own: a tiktoken rank file plus
``tokenizer_config.json`` naming the 256 special tokens (``kimi_k3.text.tokenizer``).

    python -m kimi_k3.corpus fetch DIR                  # download and verify SOURCES
    python -m kimi_k3.corpus stats DIR [--tokenizer T]  # markdown table per source and split
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from kimi_k3.checkpoint.files import sha256_file
from kimi_k3.progress import Progress
from kimi_k3.text.tokenizer import (
    KIMI_PATTERN,
    NUM_SPECIAL_TOKENS,
    byte_to_unicode,
    load_tokenizer,
    write_tokenizer_files,
)

HOLDOUT_MOD = 20  # one file in 20 is held out
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
DOC_SEPARATOR = "\n\n\n"  # between files in the token stream
GENERATED_MARK = "Python Character Mapping Codec"  # gencodec.py's header line

STDLIB = "stdlib"  # the standard library's source name
KINDS = ("python", "c", "prose")
MANIFEST_FILE = "corpus.json"  # in a training run's directory: which corpus it used
NOTICE_FILE = "NOTICE"  # in an exported checkpoint: the sources, versions and licenses

# Filters for archive sources (the standard library keeps its rules above).
MAX_FILE_BYTES = 1_000_000
MAX_LINE_CHARS = 1_000  # a longer line: minified code or a data blob
MIN_LETTER_SHARE = 0.25  # fewer letters than this among a file's characters: a data table
# A generated file says so near its top, on a line of its own (comment leaders aside).
GENERATED_RE = re.compile(
    r"^[ \t#/*\"'!-]*(?:this file (?:is|was|has been) |file )?"
    r"(?:(?:auto-?|automatically )?generated\b|do not edit|@generated|code generated)",
    re.I | re.M,
)
GENERATED_HEAD_LINES = 10
# Vendored code, test suites, build and packaging metadata: never taken from an archive.
DEFAULT_EXCLUDE = (
    "**/vendor/**",
    "**/vendored/**",
    "**/_vendor/**",
    "**/third_party/**",
    "**/thirdparty/**",
    "**/extern/**",
    "**/node_modules/**",
    "**/test/**",
    "**/tests/**",
    "**/testing/**",
    "**/*.egg-info/**",
    "**/.github/**",
    "**/*.min.*",
)


class CorpusError(Exception):
    """A source's archive is missing, changed, unreadable, or declared wrongly."""


@dataclass(frozen=True)
class Source:
    """One pinned archive of a package registry and the files taken from it.

    ``registry`` is ``"pypi"``: an sdist, fetched by ``pip download``. PyPI never changes
    or withdraws a published file under its name (unlike a distribution's archive, which
    keeps only current versions), so a pinned sdist stays fetchable. ``filename`` and
    ``sha256`` pin the exact archive. Paths are relative to the archive's single top-level
    directory (an sdist's ``NAME-VERSION/``). ``include`` maps globs (``*`` within
    a path segment, ``**`` any number of segments) to a kind in ``KINDS``: a file takes the
    kind of the first glob it matches, unless it matches ``exclude`` or ``DEFAULT_EXCLUDE``.
    ``license_files`` are the archive's own license texts, shipped with a model trained on
    the source (``PATH:FIRST-LAST`` takes those lines of ``PATH``, for a license stated in a
    source file's head); ``license`` is their SPDX expression. ``max_bytes`` caps a file's
    size; ``note`` says what the source leaves out and why, for ``NOTICE``.
    """

    name: str
    registry: str
    package: str
    version: str
    filename: str
    sha256: str
    license: str
    license_files: tuple[str, ...]
    include: tuple[tuple[str, str], ...]
    exclude: tuple[str, ...] = ()
    max_bytes: int = MAX_FILE_BYTES
    keep_generated: bool = False  # for files marked generated that are hand-written code
    note: str = ""

    def __post_init__(self):
        if self.registry != "pypi":
            raise CorpusError(f"source {self.name}: unknown registry {self.registry!r}")
        for pattern, kind in self.include:
            if kind not in KINDS:
                raise CorpusError(
                    f"source {self.name}: kind {kind!r} of {pattern!r} not in {KINDS}"
                )


def _pypi(name, package, version, filename, sha256, license, license_files, include, **kw):
    args = (name, "pypi", package, version, filename, sha256, license, license_files, include)
    return Source(*args, **kw)


PY, C, PROSE = KINDS
SOURCES: tuple[Source, ...] = (
    _pypi(
        "django", "django", "5.2.19", "django-5.2.19.tar.gz",
        "ad03d8abc51dbff95ebf34b27123cf0c26a3b62db7ba0cd520783686362533d1",
        "BSD-3-Clause AND PSF-2.0",
        ("LICENSE", "LICENSE.python", "django/dispatch/license.txt",
         "django/contrib/gis/gdal/LICENSE", "django/contrib/gis/geos/LICENSE"),
        (("django/**/*.py", PY), ("docs/**/*.txt", PROSE)),
        exclude=("**/locale/**", "**/static/**"),
    ),
    _pypi(
        "pytest", "pytest", "9.2.0", "pytest-9.2.0.tar.gz",
        "97c4f3b1f3c7414aa36465e09b8220f1d03627993bd51b1282e193753c80557b",
        "MIT", ("LICENSE",),
        (("src/**/*.py", PY), ("doc/en/**/*.rst", PROSE), ("doc/en/**/*.md", PROSE)),
    ),
    _pypi(
        "scrapy", "scrapy", "2.19.0", "scrapy-2.19.0.tar.gz",
        "34130726582b64c91531162ab277c4053e558876d49ba219cb43679e71d80a87",
        "BSD-3-Clause", ("LICENSE",),
        (("scrapy/**/*.py", PY), ("docs/**/*.rst", PROSE)),
    ),
    _pypi(
        "networkx", "networkx", "3.6.1", "networkx-3.6.1.tar.gz",
        "26b7c357accc0c8cde558ad486283728b65b6a95d85ee1cd66bafab4c8168509",
        "BSD-3-Clause", ("LICENSE.txt",),
        (("networkx/**/*.py", PY), ("doc/**/*.rst", PROSE)),
    ),
    _pypi(
        "celery", "celery", "5.7.0", "celery-5.7.0.tar.gz",
        "6a5dfcf6662287204f009a02002b9e66c83d4105e47ebabdc7079108772fc6f0",
        "BSD-3-Clause", ("LICENSE",),
        (("celery/**/*.py", PY),),
        note="code only: its LICENSE puts the docs under CC BY-SA 3.0",
    ),
    _pypi(
        "tornado", "tornado", "6.6.1", "tornado-6.6.1.tar.gz",
        "28e6311402af59c8b02e3fa0f5e7d8eb465b25081381803b127d97e6a4395d5a",
        "Apache-2.0", ("LICENSE",),
        (("tornado/**/*.py", PY), ("docs/**/*.rst", PROSE)),
    ),
    _pypi(
        "werkzeug", "werkzeug", "3.1.9", "werkzeug-3.1.9.tar.gz",
        "55ca7c70a75689be937aa27f8ff4b018f06ff4838fc73045560bf0f5a1291060",
        "BSD-3-Clause", ("LICENSE.txt",),
        (("src/**/*.py", PY), ("docs/**/*.rst", PROSE), ("CHANGES.rst", PROSE)),
    ),
    _pypi(
        "flask", "flask", "3.1.3", "flask-3.1.3.tar.gz",
        "0ef0e52b8a9cd932855379197dd8f94047b359ca0a78695144304cb45f87c9eb",
        "BSD-3-Clause", ("LICENSE.txt",),
        (("src/**/*.py", PY), ("docs/**/*.rst", PROSE), ("CHANGES.rst", PROSE)),
    ),
    _pypi(
        "click", "click", "8.5.1", "click-8.5.1.tar.gz",
        "9bbfada76703fd1d784b83eea012e3e8c6a001a876543ef104fa56aaaeb072b4",
        "BSD-3-Clause", ("LICENSE.txt",),
        (("src/**/*.py", PY), ("docs/**/*.md", PROSE), ("docs/**/*.rst", PROSE),
         ("CHANGES.md", PROSE)),
    ),
    _pypi(
        "jinja2", "jinja2", "3.1.6", "jinja2-3.1.6.tar.gz",
        "0137fb05990d35f1275a587e9aee6d56da821fc83491a0fb838183be43f66d6d",
        "BSD-3-Clause", ("LICENSE.txt",),
        (("src/**/*.py", PY), ("docs/**/*.rst", PROSE)),
    ),
    _pypi(
        "markdown", "markdown", "3.11.3", "markdown-3.11.3.tar.gz",
        "81eb91631dc97ad1efbc76019ef0f80fe90ca49ddf81546752d79989c3bfff3e",
        "BSD-3-Clause", ("LICENSE.md",),
        (("markdown/**/*.py", PY), ("docs/**/*.md", PROSE)),
    ),
    _pypi(
        "requests", "requests", "2.34.2", "requests-2.34.2.tar.gz",
        "f288924cae4e29463698d6d60bc6a4da69c89185ad1e0bcc4104f584e960b9ed",
        "Apache-2.0", ("LICENSE",),
        (("src/**/*.py", PY), ("HISTORY.md", PROSE)),
    ),
    _pypi(
        "psutil", "psutil", "7.2.2", "psutil-7.2.2.tar.gz",
        "0746f5f8d406af344fd547f1c8daa5f5c33dbc293bb8d6a16d80b4bb88f59372",
        "BSD-3-Clause", ("LICENSE",),
        (("psutil/**/*.py", PY), ("psutil/**/*.c", C), ("psutil/**/*.h", C),
         ("docs/**/*.rst", PROSE), ("HISTORY.rst", PROSE)),
    ),
    _pypi(
        "cffi", "cffi", "2.1.1", "cffi-2.1.1.tar.gz",
        "dd31f52ea1086513bb9df30f8fcee9b8918323ae067a3d5b78bc826a000712be",
        "MIT", ("LICENSE",),
        (("src/cffi/**/*.py", PY), ("src/c/*.c", C), ("src/c/*.h", C), ("src/cffi/*.h", C),
         ("doc/source/**/*.rst", PROSE)),
        note="without src/c/libffi_*/, a vendored libffi",
    ),
    _pypi(
        "zstandard", "zstandard", "0.25.0", "zstandard-0.25.0.tar.gz",
        "7713e1179d162cf5c7906da876ec2ccb9c3a9dcbdffef0cc7f70c3667a205f0b",
        "BSD-3-Clause", ("LICENSE",),
        (("c-ext/*.c", C), ("c-ext/python-zstandard.h", C), ("zstandard/*.py", PY)),
        note="its own bindings only, without the bundled zstd library (zstd/: BSD-3-Clause "
        "OR GPL-2.0-only) and the vendored c-ext/pythoncapi_compat.h",
    ),
    _pypi(
        "sqlite", "sqlean-py", "3.50.4.5", "sqlean_py-3.50.4.5.tar.gz",
        "9764b565e7ab430ab6e9e43cb2816199c2b39926dffc93c212a52f0019278459",
        "blessing", ("sqlite/sqlite3.h:1-10",),
        (("sqlite/sqlite3.c", C), ("sqlite/sqlite3.h", C), ("sqlite/shell.c", C)),
        max_bytes=10_000_000,
        keep_generated=True,
        note="SQLite 3.50.4's public-domain amalgamation as the sqlean-py sdist bundles it; "
        "its files say they are generated, being concatenations of hand-written sources",
    ),
    Source(
        "zlib", "pypi", "zlib-ng", "1.1.0", "zlib_ng-1.1.0.tar.gz",
        "08a3a8468d4f130e3dc80d28ec42fcc7a878a57dfed616233e791066327d78a3",
        "Zlib", ("src/zlib_ng/zlib-ng/LICENSE.md",),
        (("src/zlib_ng/zlib-ng/*.c", C), ("src/zlib_ng/zlib-ng/*.h", C)),
        note="the zlib-ng C library the sdist bundles (Zlib license), not its Python binding",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class Doc:
    """One corpus file: its source, path within the source, kind and text."""

    source: str
    path: str
    kind: str
    text: str

    @property
    def split_key(self) -> str:
        """What the split hashes: the path for the standard library (its rule since the
        shipped model), ``source/path`` for every other source."""
        return self.path if self.source == STDLIB else f"{self.source}/{self.path}"

    @property
    def heldout(self) -> bool:
        return is_heldout(self.split_key)


@dataclass
class SourceReport:
    """What reading one source (None: the standard library) kept and skipped (reason ->
    count)."""

    source: Source | None = None
    archive_bytes: int = 0
    docs: list[Doc] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)


# --- the standard library ----------------------------------------------------------------


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: str | Path | None = None) -> list[Path]:
    """The corpus's ``.py`` files under ``root`` (default: ``stdlib_root()``), sorted."""
    root = Path(root or stdlib_root())
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not SKIP_DIRS.intersection(rel.parts[:-1]) and path.is_file():
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(rel: str) -> bool:
    """Whether the file with split key ``rel`` belongs to the evaluation split."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % HOLDOUT_MOD == 0


def stdlib_report(root: str | Path | None = None) -> SourceReport:
    """The standard library's files as ``Doc``s (undecodable and generated files skipped)."""
    root = Path(root or stdlib_root())
    report = SourceReport()
    for path in corpus_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            report.skipped["not UTF-8"] += 1
            continue
        if GENERATED_MARK in text[:400]:
            report.skipped["generated"] += 1
            continue
        report.docs.append(Doc(STDLIB, path.relative_to(root).as_posix(), PY, text))
    return report


def read_split(root: str | Path | None = None) -> tuple[list[str], list[str]]:
    """The standard library's ``(train_texts, heldout_texts)``: file contents, decoded as
    UTF-8 (undecodable files skipped)."""
    return split_texts(stdlib_report(root).docs)


# --- archives ----------------------------------------------------------------------------


@functools.cache  # the same patterns for every file of every archive
def _glob_regex(pattern: str) -> re.Pattern:
    """``*`` and ``?`` within one path segment, ``**`` a whole number of segments."""
    out = []
    for i, seg in enumerate(pattern.split("/")):
        last = i == pattern.count("/")
        if seg == "**":
            out.append(".*" if last else "(?:[^/]+/)*")
            continue
        body = "".join(
            "[^/]*" if ch == "*" else "[^/]" if ch == "?" else re.escape(ch) for ch in seg
        )
        out.append(body if last else body + "/")
    return re.compile("".join(out) + r"\Z")


def _matches(path: str, patterns: Iterable[str]) -> bool:
    return any(_glob_regex(p).match(path) for p in patterns)


def select_kind(source: Source, path: str) -> str | None:
    """The kind ``path`` is taken as from ``source``, or None when it is not taken."""
    if _matches(path, DEFAULT_EXCLUDE + source.exclude):
        return None
    for pattern, kind in source.include:
        if _glob_regex(pattern).match(path):
            return kind
    return None


def reject_reason(data: bytes, keep_generated: bool = False) -> str | None:
    """Why a selected file's bytes (within the size cap) stay out of the corpus, or None to
    keep it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    if not text.strip():
        return "empty"
    lines = text.splitlines()
    if not keep_generated and GENERATED_RE.search("\n".join(lines[:GENERATED_HEAD_LINES])):
        return "generated"
    if max(map(len, lines)) > MAX_LINE_CHARS:
        return "minified or data (long lines)"
    if sum(ch.isalpha() for ch in text) < MIN_LETTER_SHARE * len(text):
        return "data (few letters)"
    return None


def archive_files(path: str | Path) -> dict[str, tuple[int, Callable[[], bytes]]]:
    """An archive's regular files: relative path -> (size, reader), the single top-level
    directory every member shares stripped. Reads ``.tar.*``/``.tgz`` and ``.zip``."""
    path = Path(path)
    try:
        if path.suffix == ".zip":
            zf = zipfile.ZipFile(path)
            infos = [i for i in zf.infolist() if not i.is_dir()]
            items = {i.filename: (i.file_size, (lambda i=i: zf.read(i))) for i in infos}
        else:
            tf = tarfile.open(path)
            members = [m for m in tf.getmembers() if m.isfile()]
            items = {m.name: (m.size, (lambda m=m: tf.extractfile(m).read())) for m in members}
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as e:
        raise CorpusError(f"{path}: cannot read the archive: {e}") from None
    tops = {name.lstrip("/").split("/", 1)[0] for name in items}
    strip = len(tops) == 1 and all("/" in name.lstrip("/") for name in items)
    return {
        (name.lstrip("/").split("/", 1)[1] if strip else name.lstrip("/")): item
        for name, item in items.items()
    }


def verify(source: Source, path: str | Path) -> Path:
    """``path`` if it is ``source``'s pinned archive; a ``CorpusError`` naming the source
    otherwise."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(
            f"source {source.name}: archive {path} is missing "
            f"(python -m kimi_k3.corpus fetch {path.parent})"
        )
    got = sha256_file(path)
    if got != source.sha256:
        raise CorpusError(
            f"source {source.name}: {path.name} has SHA-256 {got}, but the source list pins "
            f"{source.sha256} for {source.package} {source.version}; refusing a changed archive"
        )
    return path


def read_source(source: Source, corpus_dir: str | Path) -> SourceReport:
    """``source``'s selected files from its verified archive in ``corpus_dir``, filtered."""
    archive = verify(source, Path(corpus_dir) / source.filename)
    files = archive_files(archive)
    report = SourceReport(source, archive.stat().st_size)
    for rel in sorted(files):
        kind = select_kind(source, rel)
        if kind is None:
            continue
        size, read = files[rel]
        if size > source.max_bytes:
            report.skipped["over size cap"] += 1
            continue
        data = read()
        reason = reject_reason(data, source.keep_generated)
        if reason:
            report.skipped[reason] += 1
        else:
            report.docs.append(Doc(source.name, rel, kind, data.decode("utf-8")))
    if not report.docs:
        raise CorpusError(f"source {source.name}: no file of {source.filename} was taken")
    return report


def license_text(source: Source, corpus_dir: str | Path) -> str:
    """``source``'s license files from its verified archive, joined. An entry
    ``PATH:FIRST-LAST`` takes those lines (1-based, inclusive) of ``PATH``."""
    files = archive_files(verify(source, Path(corpus_dir) / source.filename))
    parts = []
    for entry in source.license_files:
        rel, _, lines = entry.partition(":")
        if rel not in files:
            raise CorpusError(f"source {source.name}: license file {rel} not in {source.filename}")
        text = files[rel][1]().decode("utf-8")
        if lines:
            first, last = (int(n) for n in lines.split("-"))
            text = "".join(text.splitlines(keepends=True)[first - 1 : last])
        where = f"{rel}, lines {lines}" if lines else rel
        parts.append(f"{source.package} {source.version}: {where}\n\n{text.rstrip()}\n")
    return "\n\n".join(parts)


# --- the corpus --------------------------------------------------------------------------


def _sources_of(corpus_dir, sources: Iterable[Source] | None) -> list[Source]:
    """The sources beyond the standard library: none without ``corpus_dir``, else
    ``sources`` (default ``SOURCES``)."""
    return [] if corpus_dir is None else list(SOURCES if sources is None else sources)


def read_reports(
    corpus_dir: str | Path | None = None, sources: Iterable[Source] | None = None
) -> dict[str, SourceReport]:
    """Source name -> its report: the standard library, then (with ``corpus_dir``) each of
    ``sources`` read from its archive there."""
    reports = {STDLIB: stdlib_report()}
    for source in _sources_of(corpus_dir, sources):
        reports[source.name] = read_source(source, corpus_dir)
    return reports


def read_corpus(
    corpus_dir: str | Path | None = None, sources: Iterable[Source] | None = None
) -> list[Doc]:
    """Every corpus file: the standard library's alone without ``corpus_dir``."""
    return [d for r in read_reports(corpus_dir, sources).values() for d in r.docs]


def split_texts(docs: list[Doc]) -> tuple[list[str], list[str]]:
    """``(train_texts, heldout_texts)``: every source's training files, and the standard
    library's held-out files (the text the project's perplexities are measured on)."""
    train = [d.text for d in docs if not d.heldout]
    heldout = [d.text for d in docs if d.heldout and d.source == STDLIB]
    return train, heldout


def write_heldout_texts(out: str | Path, docs: list[Doc]) -> list[Path]:
    """The other sources' held-out files, one text per kind (``heldout-python.txt``, ...)
    for ``python -m kimi_k3.eval --text``. Returns the files written."""
    written = []
    for kind in KINDS:
        texts = [d.text for d in docs if d.heldout and d.source != STDLIB and d.kind == kind]
        if texts:
            path = Path(out) / f"heldout-{kind}.txt"
            path.write_text(DOC_SEPARATOR.join(texts), encoding="utf-8")
            written.append(path)
    return written


def manifest(corpus_dir: str | Path | None, sources: Iterable[Source] | None = None) -> dict:
    """Which corpus a run uses: the archive directory and each source's pin."""
    return {
        "corpus_dir": None if corpus_dir is None else str(Path(corpus_dir).resolve()),
        "sources": [
            {"name": s.name, "package": s.package, "version": s.version,
             "license": s.license, "sha256": s.sha256}
            for s in _sources_of(corpus_dir, sources)
        ],
    }  # fmt: skip


def record_manifest(out: str | Path, corpus_dir, sources: Iterable[Source] | None = None) -> dict:
    """Write ``manifest`` to ``out/corpus.json``; refuse when ``out`` already holds a run
    (and its tokenizer) on other sources."""
    path = Path(out) / MANIFEST_FILE
    new = manifest(corpus_dir, sources)
    if path.is_file():
        old = json.loads(path.read_text())
        if old["sources"] != new["sources"]:
            raise CorpusError(
                f"{out} was prepared on another corpus ({path}); train in a new directory"
            )
    path.write_text(json.dumps(new, indent=1))
    return new


def recorded_dir(out: str | Path, corpus_dir=None) -> str | None:
    """The archive directory of the run in ``out``: ``corpus_dir`` when given, else the one
    its manifest records (None: the standard library alone)."""
    if corpus_dir is not None:
        return str(corpus_dir)
    path = Path(out) / MANIFEST_FILE
    return json.loads(path.read_text())["corpus_dir"] if path.is_file() else None


def describe(corpus_dir, sources: Iterable[Source] | None = None) -> str:
    """The sources beyond the standard library, one phrase, for a checkpoint's config."""
    return "; ".join(f"{s.package} {s.version} ({s.license})"
                     for s in _sources_of(corpus_dir, sources))  # fmt: skip


def write_licenses(dest: str | Path, corpus_dir=None, sources: Iterable[Source] | None = None):
    """Into an exported checkpoint: the standard library's ``LICENSE-PSF.txt``, each other
    source's ``LICENSE-<NAME>.txt`` from its archive, and ``NOTICE`` naming them all."""
    dest = Path(dest)
    py = sys.version_info
    license = stdlib_root() / "LICENSE.txt"
    if license.is_file():
        shutil.copyfile(license, dest / "LICENSE-PSF.txt")
    lines = [
        "The model in this directory was trained on the following sources; each one's "
        "license text is in the file named.",
        "",
        f"- Python standard library {py.major}.{py.minor}.{py.micro} source: PSF-2.0, "
        + ("LICENSE-PSF.txt" if license.is_file() else f"(this interpreter has no {license})"),
    ]
    for source in _sources_of(corpus_dir, sources):
        name = f"LICENSE-{source.name.upper()}.txt"
        (dest / name).write_text(license_text(source, corpus_dir), encoding="utf-8")
        lines.append(
            f"- {source.package} {source.version} ({source.registry}: {source.filename}): "
            f"{source.license}, {name}" + (f"\n  ({source.note})" if source.note else "")
        )
    (dest / NOTICE_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")


# --- fetch -------------------------------------------------------------------------------


def download(source: Source, dest: Path) -> None:
    """``source``'s archive into the empty directory ``dest``, from its registry."""
    dest = Path(dest).resolve()  # the commands run inside it: a relative path would nest
    # the sdist itself, never a wheel; its build backend may come as a wheel
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary"]
    cmd += [source.package, "--dest", str(dest), f"{source.package}=={source.version}"]
    proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
    if proc.returncode:
        raise CorpusError(
            f"source {source.name}: {' '.join(cmd[:4])} ... failed:\n{proc.stderr[-2000:]}"
        )


def fetch(
    corpus_dir: str | Path,
    sources: Iterable[Source] | None = None,
    downloader: Callable[[Source, Path], None] = download,
) -> list[Path]:
    """Download every source's archive into ``corpus_dir`` and verify it; an archive
    already there is verified and kept. Returns the archives."""
    corpus_dir = Path(corpus_dir)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    paths, todo = [], list(_sources_of(corpus_dir, sources))
    bar = Progress(len(todo), "fetching", "archive")
    for source in todo:
        target = corpus_dir / source.filename
        if not target.is_file():
            with tempfile.TemporaryDirectory(dir=corpus_dir, prefix=".fetch-") as tmp:
                downloader(source, Path(tmp))
                got = Path(tmp) / source.filename
                if not got.is_file():
                    found = sorted(p.name for p in Path(tmp).iterdir())
                    raise CorpusError(
                        f"source {source.name}: expected {source.filename}, the registry "
                        f"gave {found}"
                    )
                verify(source, got)  # checked before it takes the archive's place
                os.replace(got, target)
        else:
            verify(source, target)
        paths.append(target)
        print(
            f"{source.name}: {target.name} ({target.stat().st_size:,} bytes) verified", flush=True
        )
        bar.update()
    bar.close()
    return paths


# --- stats -------------------------------------------------------------------------------


def stats_table(reports: dict[str, SourceReport], tokenizer=None) -> str:
    """A markdown table: files, characters (and tokens, with a tokenizer) per source, kind
    and split, with totals per kind and overall. A source's package, version, license,
    archive size and skipped files are on its first row."""
    py = sys.version_info
    numeric = ["train files", "train chars", "held-out files", "held-out chars"]
    numeric += ["train tokens", "held-out tokens"] if tokenizer else []
    cols = ["source", "package version", "license", "archive MB", "kind", *numeric, "skipped"]
    rows = [cols, ["---"] * 3 + ["---:", "---"] + ["---:"] * len(numeric) + ["---"]]
    totals = {kind: Counter() for kind in KINDS}

    def counts(docs: list[Doc]) -> Counter:
        c = Counter()
        for d in docs:
            split = "held-out" if d.heldout else "train"
            c[f"{split} files"] += 1
            c[f"{split} chars"] += len(d.text)
            if tokenizer:
                c[f"{split} tokens"] += len(tokenizer.encode(d.text))
        return c

    for name, report in reports.items():
        src = report.source
        first = [
            name,
            f"{src.package} {src.version}" if src else f"Python {py.major}.{py.minor}.{py.micro}",
            src.license if src else "PSF-2.0",
            f"{report.archive_bytes / 1e6:.2f}" if src else "local",
        ]
        skipped = ", ".join(f"{n} {r}" for r, n in sorted(report.skipped.items()))
        for kind in KINDS:
            docs = [d for d in report.docs if d.kind == kind]
            if docs:
                c = counts(docs)
                totals[kind].update(c)
                rows.append(first + [kind] + [f"{c[k]:,}" for k in numeric] + [skipped])
                first, skipped = [""] * 4, ""
    archives = sum(r.archive_bytes for r in reports.values())
    for kind, c in [*totals.items(), ("all", sum(totals.values(), Counter()))]:
        size = f"{archives / 1e6:.2f}" if kind == "all" else ""
        rows.append(["**all**", "", "", size, kind] + [f"{c[k]:,}" for k in numeric] + [""])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m kimi_k3.corpus", description="The default model's training corpus"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download the sources' archives into DIR and verify them")
    f.add_argument("dir")
    s = sub.add_parser("stats", help="files, characters (tokens) per source and split")
    s.add_argument("dir", help="the fetched archives")
    s.add_argument("--tokenizer", help="a tokenizer directory, to count tokens too")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            fetch(args.dir)
        else:
            tok = None
            if args.tokenizer:
                tok = load_tokenizer(args.tokenizer)
            print(stats_table(read_reports(args.dir), tok))
    except CorpusError as e:
        sys.exit(f"error: {e}")


# --- the tokenizer -----------------------------------------------------------------------


def _iter_batches(texts: list[str], size: int = 64) -> Iterator[list[str]]:
    for i in range(0, len(texts), size):
        yield texts[i : i + size]


def train_ranks(texts: list[str], n_ranks: int) -> list[bytes]:
    """Byte-level BPE with ``tokenizers``: the 256 bytes, then learned tokens in merge order.

    A merge's rank is its position in the trainer's merge list, so tiktoken's lowest-rank-first
    merging replays the learned merges.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=n_ranks,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_iter_batches(texts), trainer=trainer, length=len(texts))
    char_to_byte = {c: b for b, c in enumerate(byte_to_unicode())}
    ranks = [bytes([b]) for b in range(256)]
    seen = set(ranks)
    for left, right in _merges(tok):
        token = bytes(char_to_byte[c] for c in left + right)
        if token not in seen:
            seen.add(token)
            ranks.append(token)
    return ranks[:n_ranks]


def _merges(tok: Tokenizer) -> list[tuple[str, str]]:
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def write_corpus_tokenizer(out_dir: str | Path, texts: list[str], vocab_size: int) -> dict:
    """Train on ``texts`` and write ``tiktoken.model`` + ``tokenizer_config.json`` of
    ``vocab_size`` ids (the last 256 special). Returns the model's token-id config keys."""
    return write_tokenizer_files(out_dir, train_ranks(texts, vocab_size - NUM_SPECIAL_TOKENS))


if __name__ == "__main__":
    main()
