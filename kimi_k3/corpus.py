"""The training corpus of the embedded default model, and its byte-level BPE tokenizer.

The corpus is the Python standard library's own source (``.py`` files: code, comments and
docstrings), PSF-licensed. Which files: every ``*.py`` under the standard library directory
except the test suites (``test/``, ``tests/``, ``idle_test/``) and installed third-party
packages (``site-packages``, ``dist-packages``), and the machine-generated character-map
codec tables (``encodings/cp1252.py`` and the like: 256-line lookup tables, marked
``GENERATED_MARK``). The split is by file: a file whose path
(relative to the library root) hashes to 0 modulo ``HOLDOUT_MOD`` is held out for evaluation,
so the split does not depend on which other files exist.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on the training files, using
K3's pre-tokenizer regex, and written as K3 writes its own: a tiktoken rank file plus
``tokenizer_config.json`` naming the 256 special tokens (``kimi_k3.tokenizer``).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from kimi_k3.tokenizer import (
    KIMI_PATTERN,
    NUM_SPECIAL_TOKENS,
    byte_to_unicode,
    write_tokenizer_files,
)

HOLDOUT_MOD = 20  # one file in 20 is held out
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
DOC_SEPARATOR = "\n\n\n"  # between files in the token stream
GENERATED_MARK = "Python Character Mapping Codec"  # gencodec.py's header line


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
    """Whether the file at relative path ``rel`` belongs to the evaluation split."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % HOLDOUT_MOD == 0


def read_split(root: str | Path | None = None) -> tuple[list[str], list[str]]:
    """``(train_texts, heldout_texts)``: file contents, decoded as UTF-8 (undecodable
    files skipped)."""
    root = Path(root or stdlib_root())
    train, heldout = [], []
    for path in corpus_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if GENERATED_MARK in text[:400]:
            continue
        rel = path.relative_to(root).as_posix()
        (heldout if is_heldout(rel) else train).append(text)
    return train, heldout


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
