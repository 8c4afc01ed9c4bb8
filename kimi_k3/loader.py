"""Load Kimi K3 straight from the published checkpoint layout (or this project's own).

Dense tensors are read lazily (``mx.load`` on validated shards); the compressed-tensors
MXFP4 experts become MLX ``mxfp4`` arrays by viewing their bytes, never re-quantized.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kimi_k3.checkpoint import CheckpointError, CheckpointIndex
from kimi_k3.config import ModelArgs
from kimi_k3.model import KEEP_FP32, Model, sanitize_weights

_IGNORED = ("vision_tower", "vision_model", "multi_modal_projector", "mm_projector")


def load_model(
    path: str | Path,
    dtype: mx.Dtype = mx.bfloat16,
    expert_cache_gb: float | None = None,
    lazy: bool = False,
    **stream_options,
) -> Model:
    """Build Kimi K3 from a checkpoint directory.

    Args:
        path: directory with ``config.json`` and safetensors shards (+ index).
        dtype: dtype of the dense floating weights (bf16 default; fp32 for tests).
            ``A_log``, ``dt_bias``, conv kernels and router correction biases stay fp32.
        expert_cache_gb: ``None`` keeps every routed expert resident; a number streams
            experts from disk into a cache of that many GB (``kimi_k3.streaming``).
        lazy: leave dense weights unevaluated (read on first use).
        stream_options: passed to the expert streamer (policy, prefetch, ...).
    """
    path = Path(path)
    args = ModelArgs.from_path(path)
    index = CheckpointIndex(path)
    model = Model(args)
    stream = expert_cache_gb is not None
    raw = _read_tensors(index, skip_experts=stream)
    quantize_dense(model, args, raw)
    weights = sanitize_weights(args, raw)
    if stream:
        from kimi_k3.streaming import attach_streamer

        attach_streamer(model, path, index, expert_cache_gb, **stream_options)
    _check_and_load(model, weights, index, dtype)
    if not lazy:
        mx.eval(model.parameters())
    return model


def _read_tensors(index: CheckpointIndex, skip_experts: bool) -> dict:
    out = {}
    for file in index.files:
        try:
            arrays = mx.load(str(file))
        except Exception as e:  # mlx raises RuntimeError/ValueError with no file name
            raise CheckpointError(f"{file}: cannot be read as safetensors ({e})") from None
        for name, a in arrays.items():
            if name.startswith(_IGNORED) or (skip_experts and ".experts." in name):
                continue
            out[name] = a
    return out


def _check_and_load(model: Model, weights: dict, index: CheckpointIndex, dtype: mx.Dtype):
    params = dict(tree_flatten(model.parameters()))
    missing = sorted(k for k in params if k not in weights)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{index.path}: tensor {missing[0]} is missing{more}")
    unexpected = sorted(k for k in weights if k not in params)
    if unexpected:
        raise CheckpointError(f"{index.path}: tensor {unexpected[0]} is not part of Kimi K3 "
                              f"as configured ({len(unexpected)} unexpected)")
    for key, want in params.items():
        got = weights[key]
        if got.shape != want.shape:
            where = index.tensors[key].file if key in index.tensors else index.path
            raise CheckpointError(f"{where}: tensor {key} has shape {list(got.shape)}, "
                                  f"expected {list(want.shape)}")
        if mx.issubdtype(got.dtype, mx.floating):
            weights[key] = got.astype(mx.float32 if key.endswith(KEEP_FP32) else dtype)
    model.load_weights(list(weights.items()), strict=False)
    model.eval()


def quantize_dense(model: Model, args: ModelArgs, weights: dict):
    """Swap in ``QuantizedLinear`` where the checkpoint holds MLX-quantized dense weights.

    Parameters come from the config's ``quantization`` entry (per-path overrides first),
    falling back to what the stored shapes imply.
    """
    q = args.quantization
    if not q:
        return
    names = {k.rsplit(".", 1)[0] for k in weights if k.endswith(".scales") and ".experts." not in k}

    def predicate(path: str, module: nn.Module):
        if path not in names or not hasattr(module, "to_quantized"):
            return False
        spec = q.get(path)
        if isinstance(spec, dict):
            return spec
        w, s = weights[f"{path}.weight"], weights[f"{path}.scales"]
        in_dims = module.weight.shape[-1]
        return {"group_size": in_dims // s.shape[-1], "bits": w.shape[-1] * 32 // in_dims,
                "mode": q.get("mode", "affine")}

    nn.quantize(model, group_size=q.get("group_size", 64), bits=q.get("bits", 4),
                mode=q.get("mode", "affine"), class_predicate=predicate)
