"""The embedded default model: a small random-weight Kimi K3, built once into the user cache.

``python -m kimi_k3.generate`` without ``--model`` runs this, so the whole path (published
layout on disk, experts streamed from the SSD through a bounded cache, the tokenizer and
the chat format) works with no download. Its weights are random: the text is gibberish.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from kimi_k3.convert.synth import PRESETS

# The "small" preset's layer plan with a narrower trunk (fast on a CPU) and more, larger
# experts: 5 MoE layers x 64 experts of about 104 KB, 33 MB of experts in all.
PRESET = dict(
    PRESETS["small"],
    hidden_size=128,
    intermediate_size=256,
    num_experts=64,
    moe_intermediate_size=256,
    routed_expert_hidden_size=256,
)
SEED = 0
# The expert cache holds this share of the expert bytes, so decoding really reads experts
# from disk.
CACHE_FRACTION = 0.25
NOTICE = (
    "kimi_k3: no --model given, using the built-in demo model: its weights are random, "
    "so its output is gibberish"
)


def version() -> str:
    """Package version plus a hash of the preset: a changed preset gets a fresh build."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        v = package_version("kimi-k3")
    except PackageNotFoundError:
        v = "dev"
    spec = json.dumps([PRESET, SEED], sort_keys=True).encode()
    return f"{v}-{hashlib.sha256(spec).hexdigest()[:8]}"


def default_dir() -> Path:
    """``<cache>/default-<version>``, the cache being ``kimi_k3.cache_dir()``
    (``$KIMI_K3_CACHE``, else ``$XDG_CACHE_HOME/kimi_k3``, else ``~/.cache/kimi_k3``)."""
    from kimi_k3 import cache_dir

    return cache_dir() / f"default-{version()}"


def ensure_default_model() -> Path:
    """The default checkpoint's directory, built on first use.

    The build goes to a temporary directory beside the final one and is renamed into
    place, so an interrupted build leaves nothing half-written and two concurrent first
    runs both end with one complete checkpoint.
    """
    from kimi_k3.convert.synth import write_checkpoint

    final = default_dir()
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", suffix=".tmp", dir=final.parent))
    try:
        write_checkpoint(tmp, PRESET, seed=SEED)
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():  # not just a concurrent build that won
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def expert_bytes(path: str | Path) -> int:
    """Bytes of routed-expert tensors in a checkpoint (any layout)."""
    from kimi_k3.checkpoint import CheckpointIndex

    return sum(t.nbytes for n, t in CheckpointIndex(path).tensors.items() if ".experts." in n)


def default_cache_gb(path: str | Path) -> float:
    """The default model's expert budget: ``CACHE_FRACTION`` of its expert bytes, in GB."""
    return CACHE_FRACTION * expert_bytes(path) / 1e9
