"""Kimi K3 in MLX: the model, its loader, and an mlx-lm compatible ``load``.

``import kimi_k3`` stays cheap: MLX, mlx-lm and the tokenizer are imported on first use.

    model, tokenizer = kimi_k3.load("path/to/Kimi-K3", expert_cache_gb=64)
    model, tokenizer = kimi_k3.load(kimi_k3.ensure_default_model())  # the embedded demo
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

__all__ = [
    "load",
    "load_model",
    "Model",
    "ModelArgs",
    "trace",
    "check_checkpoint",
    "cache_dir",
    "ensure_default_model",
    "reserved_token_mask",
    "set_expert_trimming",
    "expert_trimming",
    "set_shed_misses",
    "shed_misses",
]

# Name -> module for the lazily imported public API (PEP 562).
_LAZY = {
    "load_model": "kimi_k3.checkpoint.loader",
    "Model": "kimi_k3.model.model",
    "ModelArgs": "kimi_k3.model.config",
    "trace": "kimi_k3.trace",
    "set_expert_trimming": "kimi_k3.model.routing",
    "expert_trimming": "kimi_k3.model.routing",
    "set_shed_misses": "kimi_k3.model.routing",
    "shed_misses": "kimi_k3.model.routing",
    "ensure_default_model": "kimi_k3.default_model",
}

# model_config keys that change no tensor shape, so they can be set on a built model.
RUNTIME_CONFIG_KEYS = ("max_position_embeddings",)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        # Importing kimi_k3.trace binds the submodule to this name; rebind the function.
        globals()[name] = value = getattr(module, name)
        return value
    raise AttributeError(f"module 'kimi_k3' has no attribute {name!r}")


def cache_dir() -> Path:
    """``$KIMI_K3_CACHE``, else ``$XDG_CACHE_HOME/kimi_k3``, else ``~/.cache/kimi_k3``."""
    if env := os.environ.get("KIMI_K3_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kimi_k3"


def check_checkpoint(path: str | Path) -> dict:
    """The ``config.json`` of a Kimi K3 checkpoint directory, or a clear error.

    Raises ``FileNotFoundError`` (no such directory, no config.json), ``CheckpointError``
    (config.json is not a regular file, or larger than ``MAX_CONFIG_BYTES``) or
    ``ConfigError`` (not UTF-8 JSON, not an object, or another model family) naming the path.
    ``load_model`` and ``load`` start with it.
    """
    from kimi_k3.model.config import ConfigError, read_config_json

    path = Path(path).expanduser()
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such model directory"
        raise FileNotFoundError(f"{path}: {what}")
    file = path / "config.json"
    config = read_config_json(path)
    kind = config.get("model_type")
    if kind != "kimi_k3":
        raise ConfigError(
            f"{file}: model_type is {kind!r}, not 'kimi_k3': this is not a Kimi K3 checkpoint"
        )
    return config


def reserved_token_mask(tokenizer):
    """An mlx-lm logits processor, ``(tokens, logits) -> logits``, that gives the special
    ids no reply may contain (the reserved slots, ``[BOS]``, ``[PAD]`` and ``[UNK]`` of
    ``tokenizer``) a logit of ``-inf`` and leaves every other logit as it is: stop tokens
    and the chat markers stay. The command line and the server sample through it; pass it
    to mlx-lm as ``stream_generate(..., logits_processors=[reserved_token_mask(tokenizer)])``.
    """
    from kimi_k3.text.tokenizer import never_sample

    return never_sample(tokenizer)


def load(
    path: str | Path,
    tokenizer_config: dict | None = None,
    model_config: dict | None = None,
    dtype=None,
    expert_cache_gb: float | None = None,
    lazy: bool = False,
    return_config: bool = False,
    trust_remote_code: bool = False,
    verify_checksums: bool = True,
    pipeline_group=None,
    tensor_group=None,
    expert_group=None,
    expert_top_p: float = 1.0,
    expert_min_weight: float = 0.0,
    shed_misses: float = 1.0,
    **stream_options,
):
    """Load a Kimi K3 checkpoint and its tokenizer, like ``mlx_lm.load``.

    Args:
        path: a checkpoint directory: the published layout, this project's converted
            layout, or an mlx-lm converted one.
        tokenizer_config: ``{"eos_token": str | list}`` adds stop tokens
            (``trust_remote_code`` is ignored); no other keys.
        model_config: overrides for keys that change no tensor shape
            (``RUNTIME_CONFIG_KEYS``); anything else belongs in ``config.json``.
        dtype: dense weight dtype (``mx.bfloat16`` when ``None``).
        expert_cache_gb: ``None`` keeps all routed experts in memory; a number streams
            them from disk into a cache of that size (``kimi_k3.streaming``).
        lazy: leave dense weights unevaluated until first use.
        return_config: also return the ``config.json`` dict.
        trust_remote_code: accepted for mlx-lm compatibility; no remote code is ever run.
        verify_checksums: check every tensor and streamed expert read from disk against its
            recorded crc32 (``kimi_k3.checkpoint.checksums``, recorded at the first load);
            False skips.
        pipeline_group, tensor_group, expert_group: ``mx.distributed`` groups, as
            ``mlx_lm.utils.sharded_load`` takes them: this rank's pipeline stage (reading
            only its layers' tensors), tensor parallel dense projections (routed experts
            whole), and its range of every MoE layer's experts (held or streamed: only those
            are read); the same group as ``tensor_group`` and ``expert_group`` splits both,
            as ``Model.shard`` does. ``kimi_k3.model.parallel`` and docs/distributed.md.
        expert_top_p, expert_min_weight: per-token expert trimming, off by default (1 and
            0): keep a token's routed experts in decreasing renormalised router weight until
            the kept weights reach ``expert_top_p``, drop those below ``expert_min_weight``;
            the first is always kept (``kimi_k3.model.routing``; streamed experts that no token
            keeps are never read). ``set_expert_trimming(model, top_p, min_weight)`` changes
            them later.
        shed_misses: shedding misses, off by default (1): each token keeps its chosen
            experts that are cached and drops uncached ones, lightest first, while the
            renormalised router weight it keeps stays at least ``shed_misses`` (0 to 1); the
            heaviest is always kept and a dropped expert is never read. Resident experts are
            all cached, so it changes only a streamed model (``kimi_k3.model.routing``;
            ``set_shed_misses(model, p)`` changes it later).
        stream_options: passed on to the expert streamer; ``expert_layout=`` (``"auto"``,
            ``"mlx"``, ``"tiled"``) to ``load_model``, for resident and streamed experts alike.

    Returns:
        ``(model, tokenizer)``, or ``(model, tokenizer, config)`` with ``return_config``;
        the tokenizer is an mlx-lm ``TokenizerWrapper``.
    """
    import mlx.core as mx

    from kimi_k3.checkpoint.loader import TRIM_NAMES, load_model
    from kimi_k3.model import routing
    from kimi_k3.text.tokenizer import load_tokenizer

    routing.check(expert_top_p, expert_min_weight, TRIM_NAMES)
    shed_p = routing.check_shed(shed_misses, "shed_misses")
    config = check_checkpoint(path)
    path = Path(path).expanduser()
    overrides = _check_model_config(model_config or {})
    groups = (pipeline_group, tensor_group, expert_group)
    if any(g is not None for g in groups):
        from kimi_k3.model import parallel

        stream_options["prepare"] = partial(
            parallel.prepare,
            pipeline_group=pipeline_group,
            expert_group=expert_group,
        )
    model = load_model(
        path,
        dtype=dtype or mx.bfloat16,
        expert_cache_gb=expert_cache_gb,
        lazy=True if tensor_group is not None else lazy,
        verify_checksums=verify_checksums,
        expert_top_p=expert_top_p,
        expert_min_weight=expert_min_weight,
        **stream_options,
    )
    if tensor_group is not None:
        model.shard(tensor_group, experts=False)
        if not lazy:
            mx.eval(model.parameters())
    if any(g is not None for g in groups):
        model.distributed_group = mx.distributed.init()  # the ranks' stats are gathered over
    routing.set_shed_misses(model, shed_p)
    for key, value in overrides.items():
        setattr(model.args, key, value)
    tokenizer = load_tokenizer(path)
    _apply_tokenizer_config(tokenizer, tokenizer_config or {})
    return (model, tokenizer, config) if return_config else (model, tokenizer)


def _check_model_config(overrides: dict) -> dict:
    from kimi_k3.model.config import ConfigError

    for key in overrides:
        if key not in RUNTIME_CONFIG_KEYS:
            raise ConfigError(
                f"model_config key {key!r} cannot be changed after the "
                f"checkpoint is read; only {list(RUNTIME_CONFIG_KEYS)}"
            )
    return overrides


def _apply_tokenizer_config(tokenizer, config: dict):
    for key, value in config.items():
        if key == "trust_remote_code":
            continue
        if key != "eos_token":
            raise ValueError(f"tokenizer_config key {key!r} is not supported (only 'eos_token')")
        for token in [value] if isinstance(value, str) else value:
            tokenizer.add_eos_token(token)
