"""Load Kimi K3 from the published layout, this project's converted one, or mlx-lm's.

Dense tensors are read lazily (``mx.load`` on validated shards); the compressed-tensors
MXFP4 experts become MLX ``mxfp4`` arrays by viewing their bytes, never re-quantized.
``kimi_k3.checkpoint.layouts`` tells the layouts apart and maps mlx-lm's names into this tree.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kimi_k3 import check_checkpoint
from kimi_k3.checkpoint import checksums
from kimi_k3.checkpoint.expert_pack import ExpertPack
from kimi_k3.checkpoint.files import NON_TEXT_PREFIXES, CheckpointError, CheckpointIndex
from kimi_k3.checkpoint.layouts import dequantize_f32, detect, from_mlx_lm, read_args
from kimi_k3.model import routing
from kimi_k3.model.config import ModelArgs
from kimi_k3.model.experts import ROUTED_EXPERT_NAME, expert_format, store_layout
from kimi_k3.model.model import KEEP_FP32, Model, sanitize_weights
from kimi_k3.model.moe import moe_blocks
from kimi_k3.streaming import attach_streamer
from kimi_k3.streaming.sources import open_source

TRIM_NAMES = ("expert_top_p", "expert_min_weight")  # the loaders' names for the thresholds


def load_model(
    path: str | Path,
    dtype: mx.Dtype = mx.bfloat16,
    expert_cache_gb: float | None = None,
    lazy: bool = False,
    expert_layout: str | None = None,
    verify_checksums: bool = True,
    prepare=None,
    expert_top_p: float = 1.0,
    expert_min_weight: float = 0.0,
    **stream_options,
) -> Model:
    """Build Kimi K3 from a checkpoint directory.

    Args:
        path: directory with ``config.json`` and safetensors shards (+ index), in any layout
            of ``kimi_k3.checkpoint.layouts.detect``: published, converted (expert pack) or mlx-lm.
        dtype: dtype of the dense floating weights (bf16 default; fp32 for tests).
            ``A_log``, ``dt_bias``, conv kernels and router correction biases stay fp32.
        expert_cache_gb: ``None`` keeps every routed expert resident; a number streams
            experts from disk into a cache of that many GB (``kimi_k3.streaming``).
        lazy: leave dense weights unevaluated (read on first use); with ``verify_checksums``
            they are read and checked here.
        expert_layout: how the expert store holds the stacks: ``"auto"`` (tiles where CUDA's
            kernels read them, else MLX's layout), ``"mlx"`` or ``"tiled"``
            (``kimi_k3.model.experts.store_layout``); ``None`` reads ``KIMI_K3_EXPERT_LAYOUT``.
        verify_checksums: check every tensor and every streamed expert read from disk against
            its recorded crc32 (``kimi_k3.checkpoint.checksums``; recorded on first load), raising
            ``CheckpointError`` (``ExpertReadError`` while streaming) naming the file.
        prepare: called as ``prepare(model)`` on the new model before any tensor is read;
            ``kimi_k3.model.parallel.prepare`` keeps one rank's pipeline stage and expert range
            there, and only the tensors of the layers and experts it keeps are then read.
        expert_top_p, expert_min_weight: trim each token's routed experts
            (``kimi_k3.model.routing``): keep them in decreasing renormalised router weight until
            the kept weights reach ``expert_top_p`` (1: keep all), and drop those whose
            renormalised weight is below ``expert_min_weight`` (0: none); the first is
            always kept. ``kimi_k3.set_expert_trimming`` changes them on a loaded model.
        stream_options: passed to the expert streamer (policy, prefetch, ...).
    """
    trim = routing.check(expert_top_p, expert_min_weight, TRIM_NAMES)
    path = Path(path)
    check_checkpoint(path)
    layout = detect(path)
    args = read_args(path, layout)
    index = CheckpointIndex(path)
    model = Model(args)
    if prepare is not None:
        prepare(model)
    held = Held(model)
    stream = expert_cache_gb is not None
    moe = [i for i in held.layers if args.is_moe(i)]
    source = None
    if moe and not stream:  # the experts' dtypes and shapes, named per tensor
        source = open_source(path, index, args, moe, experts=held.experts)
    loaded = _read_tensors(index, skip_experts=stream, held=held)
    raw = {held.name(k): a for k, a in loaded.items()}
    if layout == "mlx-lm":
        raw = held.slice_stacks(from_mlx_lm(args, raw))
    elif layout == "pack" and source is not None:
        raw.update(_pack_experts(source.pack, verify_checksums, held))
    quantize_dense(model, args, raw)
    weights = sanitize_weights(args, raw, len(held.experts))
    _check(model, weights, index, skip_experts=stream)
    sums = checksums.obtain(path, index) if verify_checksums else None
    Dl, I = args.routed_expert_hidden_size, args.moe_intermediate_size
    store = store_layout(expert_layout, Dl, I, expert_format(args))
    if stream:
        attach_streamer(
            model,
            path,
            index,
            expert_cache_gb,
            expert_layout=store,
            verify_checksums=verify_checksums,
            checksums=sums,
            **stream_options,
        )
    if sums is not None:
        checksums.verify_arrays(loaded, index, sums)
    del loaded
    _load(model, weights, dtype)
    del raw, weights  # the model holds what it needs; tiles replace the stacks below
    if not stream:
        for moe in moe_blocks(model).values():
            if store == "tiled":
                moe.experts.set_layout("tiled")
            if not lazy:  # one layer's stacks (and their sources) at a time
                mx.eval(moe.experts.parameters())
    if not lazy:
        mx.eval(model.parameters())
    routing.set_expert_trimming(model, *trim)
    return model


class Held:
    """The layers and experts a model keeps (all, unless ``prepare`` split it): which
    tensors to read, and the experts' local numbers (expert ``e`` is ``e - experts.start``)."""

    _LAYER = re.compile(r"\.layers\.(\d+)\.")
    _EXPERT = re.compile(r"(\.experts\.)(\d+)(\.)")

    def __init__(self, model: Model):
        self.layers = [layer.index for layer in model.layers]
        moes = [layer.block_sparse_moe for layer in model.layers if "block_sparse_moe" in layer]
        self.experts = moes[0].expert_range if moes else range(model.args.num_experts)
        self.all = len(self.layers) == model.args.num_hidden_layers and self.experts == range(
            model.args.num_experts
        )
        self._layers = set(self.layers)

    def name(self, name: str) -> str | None:
        """``name`` as this model holds it (expert renumbered), or None to skip it."""
        if self.all:
            return name
        m = self._LAYER.search(name)
        if m is not None and int(m.group(1)) not in self._layers:
            return None
        e = self._EXPERT.search(name)
        if e is None:
            return name
        if int(e.group(2)) not in self.experts:
            return None
        local = int(e.group(2)) - self.experts.start
        return name[: e.start()] + f"{e.group(1)}{local}{e.group(3)}" + name[e.end() :]

    def slice_stacks(self, weights: dict) -> dict:
        """Stacked experts (mlx-lm's layout) cut to the held range."""
        if self.all:
            return weights
        cut = slice(self.experts.start, self.experts.stop)
        return {k: v[cut] if ".experts." in k else v for k, v in weights.items()}


def _read_tensors(index: CheckpointIndex, skip_experts: bool, held: Held) -> dict:
    out = {}
    for file in index.files:
        try:
            arrays = mx.load(str(file))
        except Exception as e:  # mlx raises RuntimeError/ValueError with no file name
            raise CheckpointError(f"{file}: cannot be read as safetensors ({e})") from None
        for name, a in arrays.items():
            if name.startswith(NON_TEXT_PREFIXES) or (
                skip_experts and ROUTED_EXPERT_NAME.search(name)
            ):
                continue
            if held.name(name) is not None:
                out[name] = a
    return out


def _check(model: Model, weights: dict, index: CheckpointIndex, skip_experts: bool):
    """Every parameter present with its shape, and nothing else (reads no data)."""
    params = {
        k: v
        for k, v in tree_flatten(model.parameters())
        if not (skip_experts and ROUTED_EXPERT_NAME.search(k))
    }
    missing = sorted(k for k in params if k not in weights)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{index.path}: tensor {missing[0]} is missing{more}")
    unexpected = sorted(k for k in weights if k not in params)
    if unexpected:
        raise CheckpointError(
            f"{index.path}: tensor {unexpected[0]} is not part of Kimi K3 "
            f"as configured ({len(unexpected)} unexpected)"
        )
    for key, want in params.items():
        got = weights[key]
        if got.shape != want.shape:
            where = index.tensors[key].file if key in index.tensors else index.path
            raise CheckpointError(
                f"{where}: tensor {key} has shape {list(got.shape)}, expected {list(want.shape)}"
            )


def _load(model: Model, weights: dict, dtype: mx.Dtype):
    """Into ``model``: floating dense tensors in ``dtype`` (``KEEP_FP32``'s in fp32); the
    routed experts as stored (a lower-bit format's float16 scales and biases are part of
    it)."""
    for key, got in weights.items():
        if mx.issubdtype(got.dtype, mx.floating) and not ROUTED_EXPERT_NAME.search(key):
            weights[key] = got.astype(mx.float32 if key.endswith(KEEP_FP32) else dtype)
    model.load_weights(list(weights.items()), strict=False)
    model.eval()


def quantize_dense(model: Model, args: ModelArgs, weights: dict):
    """Swap in ``QuantizedLinear`` where the checkpoint holds MLX-quantized dense weights.

    Parameters come from the config's ``quantization`` entry (per-path overrides first),
    falling back to what the stored tensors imply. A quantized weight whose module cannot be
    quantized (the MoE router) is dequantized into ``weights`` instead.
    """
    q = args.quantization or {}
    names = {k.rsplit(".", 1)[0] for k in weights if k.endswith(".scales") and ".experts." not in k}
    if not names:
        return
    modules = dict(tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))

    def spec(path: str) -> dict:
        if isinstance(q.get(path), dict):
            return q[path]
        return _infer_quant(path, modules[path].weight.shape[-1], weights)

    for path in sorted(names):
        if path in modules and not hasattr(modules[path], "to_quantized"):
            sp = spec(path)
            w, s, b = (weights.pop(f"{path}.{k}", None) for k in ("weight", "scales", "biases"))
            weights[f"{path}.weight"] = dequantize_f32(w, s, b, sp)

    def predicate(path: str, module: nn.Module):
        if path not in names or not hasattr(module, "to_quantized"):
            return False
        return spec(path)

    nn.quantize(
        model,
        group_size=q.get("group_size", 64),
        bits=q.get("bits", 4),
        mode=q.get("mode", "affine"),
        class_predicate=predicate,
    )


_MODES = {(4, 32): "mxfp4", (4, 16): "nvfp4", (8, 32): "mxfp8"}  # modes without biases


def _infer_quant(path: str, in_dims: int, weights: dict) -> dict:
    """Quantization parameters of a stored weight from its shapes (affine iff it has biases)."""
    w, s = weights[f"{path}.weight"], weights[f"{path}.scales"]
    group_size, bits = in_dims // s.shape[-1], w.shape[-1] * 32 // in_dims
    if f"{path}.biases" in weights:
        return {"group_size": group_size, "bits": bits, "mode": "affine"}
    if (bits, group_size) not in _MODES:
        raise CheckpointError(
            f"tensor {path}.weight: {bits}-bit groups of {group_size} without "
            "biases match no MLX quantization mode"
        )
    return {"group_size": group_size, "bits": bits, "mode": _MODES[(bits, group_size)]}


def _pack_experts(pack: ExpertPack, verify: bool, held: Held) -> dict:
    """The held layers' routed experts (the held range) from the expert pack (closed after),
    stacked for ``ResidentExperts``; ``verify`` checks each record's crc32."""
    out = {}
    for layer in pack.layers:
        if layer not in held.layers:
            continue
        base = f"language_model.model.layers.{layer}.block_sparse_moe.experts."
        for name, a in pack.read_layer(layer, verify, held.experts).items():
            out[base + name] = mx.array(a)
    pack.close()
    return out
