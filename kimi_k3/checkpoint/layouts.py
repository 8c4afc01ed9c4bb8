"""The checkpoint layouts Kimi K3 loads from, and the mapping of mlx-lm's into this tree.

- ``published``: Moonshot's layout (``language_model.model.layers.N.block_sparse_moe.experts.E
  .w1.weight_packed`` ...), read by name (``kimi_k3.model.model.sanitize_weights``).
- ``pack``: this project's converted layout (``python -m kimi_k3.convert``): dense shards
  already in this module tree's names, routed experts in an expert pack
  (``kimi_k3.checkpoint.expert_pack``).
- ``mlx-lm``: a directory written by mlx-lm for ``mlx_lm.models.kimi_k3`` (``mlx_lm.convert``
  or ``save_model``): fused ``qkv_proj``/``qkv_conv``, MLA ``kv_b_proj`` split into
  ``embed_q``/``unembed_out``, experts stacked in ``mlp.switch_mlp``, MoE blocks named ``mlp``.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

from kimi_k3.checkpoint.expert_pack import is_pack_dir
from kimi_k3.checkpoint.files import CheckpointError, read_header, read_index
from kimi_k3.model.config import ConfigError, ModelArgs, naming, read_config_json
from kimi_k3.model.experts import expert_format

LAYOUTS = ("published", "pack", "mlx-lm")
_MLX_LM_MARKS = (".switch_mlp.", ".qkv_proj.", ".qkv_conv.", ".embed_q.", ".unembed_out.")
_LAYER = re.compile(r"^(language_model\.model\.layers\.(\d+)\.)(.+)$")
_SWITCH = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_FUSED = (
    "self_attn.qkv_",
    "self_attn.q_conv.",
    "self_attn.k_conv.",
    "self_attn.v_conv.",
    "self_attn.embed_q.",
    "self_attn.unembed_out.",
)


def tensor_names(path: str | Path) -> list[str]:
    """The tensor names of a checkpoint directory (from its index, else the shard headers)."""
    path = Path(path)
    weight_map = read_index(path)
    if weight_map is not None:
        return list(weight_map)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no model.safetensors.index.json and no *.safetensors")
    return [n for f in files for n in read_header(f)]


def detect(path: str | Path) -> str:
    """Which layout ``path`` holds: ``"published"``, ``"pack"`` or ``"mlx-lm"``."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model directory")
    read_config_json(path)  # FileNotFoundError without one, else a regular JSON object
    if is_pack_dir(path):
        return "pack"
    if any(m in n for n in tensor_names(path) for m in _MLX_LM_MARKS):
        return "mlx-lm"
    return "published"


def read_args(path: str | Path, layout: str) -> ModelArgs:
    """``ModelArgs`` of a directory; mlx-lm's own ``quantization_config`` copy is set aside.
    The experts' format (``kimi_k3.model.experts.expert_format``: the converter's
    ``quantization.routed_experts`` entry) is checked here, an error naming the file."""
    if layout != "mlx-lm":
        args = ModelArgs.from_path(path)
        with naming(Path(path) / "config.json"):
            expert_format(args)
        return args
    config = read_config_json(path)
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and "quant_method" not in qc:
        config.pop("quantization_config")  # mlx-lm writes its `quantization` entry here too
    quant = config.pop("quantization", None)
    with naming(Path(path) / "config.json"):
        if quant is not None and not isinstance(quant, dict):
            raise ConfigError(f"config value quantization={quant!r:.60} must be an object")
        args = ModelArgs.from_dict(config)
    if quant:
        # Per-path entries use mlx-lm's module names; the tensors' shapes say the same.
        args.quantization = {k: quant[k] for k in ("group_size", "bits", "mode") if k in quant}
    return args


def mlx_lm_expert_names(layer: int) -> dict[str, str]:
    """The stacked mlx-lm tensors ([E, ...]) holding a layer's experts, by record name.

    Keys are the pack's record names (``w1.weight``, ``w1.scales``, ...). For the
    streamer: expert ``e`` of a stacked tensor of ``nbytes`` bytes is the byte range
    ``[e * nbytes / E, (e + 1) * nbytes / E)`` of that tensor's data.
    """
    base = f"language_model.model.layers.{layer}.mlp.switch_mlp"
    return {
        f"{w}.{kind}": f"{base}.{proj}.{kind}"
        for proj, w in _SWITCH.items()
        for kind in ("weight", "scales")
    }


def from_mlx_lm(args: ModelArgs, weights: dict) -> dict:
    """Rename and reshape mlx-lm ``kimi_k3`` tensors into this module tree.

    Inverts mlx-lm's sanitize: the fused ``qkv_proj`` rows (and their ``scales``/``biases``)
    split into ``q/k/v_proj``; ``qkv_conv.conv.weight`` [3P, W, 1] -> ``q/k/v_conv1d.weight``
    [P, 1, W]; ``embed_q`` [H, r, n] and ``unembed_out`` [H, v, r] (dequantized if
    quantized) -> ``kv_b_proj.weight`` [H*(n+v), r]; ``mlp.switch_mlp.{gate,up,down}_proj``
    -> ``block_sparse_moe.experts.{w1,w3,w2}``; other MoE ``mlp.*`` -> ``block_sparse_moe.*``
    with ``e_score_correction_bias`` under ``gate``. AttnRes ``_proj``/``_norm`` names are
    left to ``sanitize_weights``.
    """
    out, fused = {}, {}
    for key, value in weights.items():
        m = _LAYER.match(key)
        if m is None:
            out[key] = value
        elif m.group(3).startswith(_FUSED):
            fused.setdefault(m.group(1), {})[m.group(3)[len("self_attn.") :]] = value
        else:
            out[m.group(1) + _rename(args, int(m.group(2)), m.group(3), key, value)] = value
    for base, parts in fused.items():
        out.update(_unfuse(args, base, parts))
    return out


def _rename(args: ModelArgs, layer: int, rest: str, key: str, value) -> str:
    if not (args.is_moe(layer) and rest.startswith("mlp.")):
        return rest
    rest = rest[len("mlp.") :]
    if rest == "e_score_correction_bias":
        return "block_sparse_moe.gate.e_score_correction_bias"
    if rest.startswith("switch_mlp."):
        _, proj, kind = rest.split(".")
        if kind == "biases" or (kind == "scales" and value.dtype != mx.uint8):
            raise CheckpointError(
                f"{key}: affine-quantized routed experts are not supported; "
                "Kimi K3 experts are MXFP4 (uint8 scales, no biases)"
            )
        return f"block_sparse_moe.experts.{_SWITCH[proj]}.{kind}"
    return f"block_sparse_moe.{rest}"


def _unfuse(args: ModelArgs, base: str, parts: dict) -> dict:
    out = {}
    for kind in ("weight", "scales", "biases"):
        if f"qkv_proj.{kind}" in parts:
            for name, a in zip("qkv", mx.split(parts[f"qkv_proj.{kind}"], 3, axis=0), strict=True):
                out[f"{base}self_attn.{name}_proj.{kind}"] = a
    convs = {}
    if "qkv_conv.conv.weight" in parts:
        convs = dict(zip("qkv", mx.split(parts["qkv_conv.conv.weight"], 3, axis=0), strict=True))
    for name in "qkv":
        convs.setdefault(name, parts.get(f"{name}_conv.conv.weight"))
        if convs[name] is not None:
            out[f"{base}self_attn.{name}_conv1d.weight"] = convs[name].moveaxis(1, 2)
    if "embed_q.weight" in parts:
        # embed_q is [H, rank, nope]; kv_b_proj rows are per head nope keys then values.
        wk = _dense(parts, "embed_q", base, args.qk_nope_head_dim).swapaxes(-1, -2)
        wv = _dense(parts, "unembed_out", base, args.kv_lora_rank)  # [H, v, rank]
        kv_b = mx.concatenate([wk, wv], axis=1)
        out[f"{base}self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
    return out


def _dense(parts: dict, name: str, base: str, in_dims: int) -> mx.array:
    """A (possibly affine-quantized) mlx-lm MultiLinear weight as a float array."""
    if f"{name}.weight" not in parts:
        raise CheckpointError(
            f"{base}self_attn.{name}.weight is missing (needed with "
            "embed_q/unembed_out to rebuild kv_b_proj)"
        )
    w = parts[f"{name}.weight"]
    if f"{name}.scales" not in parts:
        return w
    s, b = parts[f"{name}.scales"], parts.get(f"{name}.biases")
    if b is None:
        raise CheckpointError(
            f"{base}self_attn.{name}: only affine quantization (scales and "
            "biases) is supported for embed_q/unembed_out"
        )
    spec = {"group_size": in_dims // s.shape[-1], "bits": w.shape[-1] * 32 // in_dims}
    return dequantize_f32(w, s, b, spec)


def dequantize_f32(w: mx.array, scales: mx.array, biases: mx.array | None, spec: dict):
    """Dequantize exactly: float scales and biases are widened first (mlx computes in their
    dtype), so the fp32 result equals what a quantized matmul uses."""
    if mx.issubdtype(scales.dtype, mx.floating):
        scales = scales.astype(mx.float32)
    if biases is not None:
        biases = biases.astype(mx.float32)
    return mx.dequantize(
        w,
        scales,
        biases,
        group_size=spec["group_size"],
        bits=spec["bits"],
        mode=spec.get("mode", "affine"),
        dtype=mx.float32,
    )
