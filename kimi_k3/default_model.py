"""The embedded default model: a small Kimi K3 trained on the Python standard library.

``python -m kimi_k3.generate`` without ``--model`` runs this, so the whole path (published
layout on disk, experts streamed from the SSD through a bounded cache, the tokenizer) works
with no download. The checkpoint is package data (``kimi_k3/default/``): K3's architecture
at small width, trained by ``kimi_k3.train`` (docs/training.md), MXFP4 routed experts and
bf16 dense weights, plus its own byte-level BPE tokenizer. It continues Python source with
code-like text; it has never seen the chat format. ``describe`` says what it is in one line,
read from the checkpoint. On first use it is copied into the user cache, where the loader
may record its checksums beside it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from kimi_k3 import cache_dir
from kimi_k3.checkpoint.files import CheckpointIndex
from kimi_k3.model.config import read_config_json
from kimi_k3.model.experts import ROUTED_EXPERT_NAME

# The expert cache holds this share of the expert bytes, so decoding really reads experts
# from disk.
CACHE_FRACTION = 0.25
# The demo model's prompt when none is given: the start of a function, to complete.
PROMPT = 'def read_lines(path):\n    """Return the lines of the file at path."""\n'
HELDOUT_FILE = "heldout.txt"
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors.index.json",
    "tiktoken.model",
    "tokenizer_config.json",
    "tokenizer.json",
)


def package_dir() -> Path:
    """The shipped checkpoint's directory inside the installed package."""
    return Path(str(resources.files("kimi_k3") / "default"))


def _files(src: Path) -> list[Path]:
    return [src / n for n in CHECKPOINT_FILES] + sorted(src.glob("model-*.safetensors"))


def version() -> str:
    """A hash of the shipped checkpoint's config and index: a new checkpoint gets a fresh
    copy in the cache."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        h.update((package_dir() / name).read_bytes())
    return h.hexdigest()[:12]


def default_dir() -> Path:
    """``<cache>/default-<version>``, the cache being ``kimi_k3.cache_dir()``
    (``$KIMI_K3_CACHE``, else ``$XDG_CACHE_HOME/kimi_k3``, else ``~/.cache/kimi_k3``)."""
    return cache_dir() / f"default-{version()}"


def ensure_default_model() -> Path:
    """The default checkpoint's directory in the user cache, copied there on first use.

    The copy goes to a temporary directory beside the final one and is renamed into place,
    so an interrupted copy leaves nothing half-written and two concurrent first runs both
    end with one complete checkpoint.
    """
    final = default_dir()
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", suffix=".tmp", dir=final.parent))
    try:
        for f in _files(package_dir()):
            shutil.copyfile(f, tmp / f.name)
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():  # not just a concurrent copy that won
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def heldout_text() -> str:
    """A sample of the held-out split of the training corpus, shipped for evaluation."""
    return (package_dir() / HELDOUT_FILE).read_text(encoding="utf-8")


def expert_bytes(path: str | Path) -> int:
    """Bytes of routed-expert tensors in a checkpoint (any layout)."""
    return sum(t.nbytes for n, t in CheckpointIndex(path).tensors.items() if ".experts." in n)


def default_cache_gb(path: str | Path) -> float:
    """The default model's expert budget: ``CACHE_FRACTION`` of its expert bytes, in GB."""
    return CACHE_FRACTION * expert_bytes(path) / 1e9


def sizes(path: str | Path) -> tuple[int, int]:
    """``(dense bytes, routed-expert bytes)`` of a checkpoint's safetensors tensors: what a
    load keeps in memory, and what the streamer reads from disk."""
    tensors = CheckpointIndex(path).tensors
    experts = sum(t.nbytes for n, t in tensors.items() if ROUTED_EXPERT_NAME.search(n))
    return sum(t.nbytes for t in tensors.values()) - experts, experts


def describe(path: str | Path, chat: bool = False) -> str:
    """One line on what the demo model at ``path`` is, from its ``config.json`` and index:
    its shape, its bytes (dense, expert), its training and what to expect of it; ``chat``:
    for a chat, where its lack of chat training matters."""
    config = read_config_json(path)
    text, training = config["text_config"], config.get("training") or {}
    dense, experts = sizes(path)
    what = (
        f"a toy Kimi K3 ({text['num_hidden_layers']} layers, {text['num_experts']} experts a "
        f"layer, top-{text['num_experts_per_token']}; {(dense + experts) / 1e6:.1f} MB: "
        f"{dense / 1e6:.1f} MB dense weights in memory, {experts / 1e6:.1f} MB MXFP4 experts "
        "streamed from disk)"
    )
    if training.get("corpus"):
        first, *more = training["corpus"].split(" + ", 1)
        corpus = first.split(",")[0] + (" and more" if more else "")
        minutes = training.get("wall_time_s", 0) / 60
        tokens = training.get("train_tokens", 0) / 1e6
        time = f" for {minutes:.0f} minutes" if minutes else ""
        size = f"{tokens:.1f}M tokens of " if tokens else ""
        what += f" trained{time} on {size}{corpus}"
    then = (
        "it has no chat training, so its replies are code-like text, not answers"
        if chat
        else "it continues source code with code-like text and has no chat training"
    )
    return f"kimi_k3: no --model given, so the built-in demo model runs: {what}; {then}"
