"""Model configuration, read from a checkpoint's ``config.json`` (nested or flat)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path

from kimi_k3.checkpoint.files import MAX_CONFIG_BYTES, load_json_object, read_capped

INT_MAX = 2**31 - 1  # MLX shapes are int32
# Config values by kind: what each must be (checked before anything uses them).
POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "attn_res_block_size",
    "moe_layer_freq",
    "num_experts",
    "num_experts_per_token",
    "num_shared_experts",
    "moe_intermediate_size",
    "routed_expert_hidden_size",
    "num_expert_group",
    "topk_group",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "max_position_embeddings",
)
COUNTS = ("first_k_dense_replace", "num_nextn_predict_layers")
POSITIVE_FLOATS = (
    "rms_norm_eps",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "routed_scaling_factor",
)
BOOLS = (
    "latent_moe_use_norm",
    "moe_renormalize",
    "mla_use_nope",
    "mla_use_output_gate",
    "tie_word_embeddings",
)
STRINGS = ("hidden_act", "moe_router_activation_func", "topk_method")


class ConfigError(ValueError):
    """A config value this implementation cannot honour; the message names the key."""


@dataclass
class ModelArgs:
    model_type: str = "kimi_k3"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    intermediate_size: int = 33792
    rms_norm_eps: float = 1e-5
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    attn_res_block_size: int = 12
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_attention_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    linear_attn_config: dict = field(default_factory=dict)
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int = 163584
    eos_token_id: int | list = 163586
    pad_token_id: int = 163839
    quantization: dict | None = None  # MLX's own per-model quantization entry, if any
    # Derived in __post_init__ from linear_attn_config.
    kda_heads: int = 0
    kda_head_dim: int = 0
    conv_size: int = 4
    gate_lower_bound: float = -5.0
    kda_layers: tuple = ()
    full_attn_layers: tuple = ()

    @classmethod
    def from_dict(cls, config: dict) -> ModelArgs:
        """Build from a ``config.json`` dict: the text model is ``text_config`` if present."""
        if not isinstance(config, dict):
            raise ConfigError(f"the config must be a JSON object, got {type(config).__name__}")
        if not isinstance(config.get("text_config", {}), dict):
            raise ConfigError(f"text_config must be an object, got {config['text_config']!r:.60}")
        text = dict(config.get("text_config") or config)
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
            if key in config and key not in text:
                text[key] = config[key]
        if "quantization" in config:
            text["quantization"] = config["quantization"]
        _check_quantization(config.get("quantization_config") or text.get("quantization_config"))
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in text.items() if k in names and k != "model_type"})

    @classmethod
    def from_path(cls, path: str | Path) -> ModelArgs:
        """From ``path/config.json``; every error names that file and the key."""
        config = read_config_json(path)
        with naming(Path(path) / "config.json"):
            return cls.from_dict(config)

    def __post_init__(self):
        self._check_values()
        _require(self, "hidden_act", self.hidden_act == "situ", "only 'situ' is implemented")
        _require(
            self,
            "moe_router_activation_func",
            self.moe_router_activation_func == "sigmoid",
            "only a sigmoid router is implemented",
        )
        _require(self, "mla_use_nope", self.mla_use_nope is True, "only NoPE MLA exists in K3")
        _require(self, "topk_method", self.topk_method == "noaux_tc", "only 'noaux_tc' routing")
        _require(
            self,
            "num_expert_group",
            self.num_expert_group == 1 and self.topk_group == 1,
            "grouped routing is not used by K3",
        )
        _require(
            self,
            "moe_layer_freq",
            self.moe_layer_freq == 1,
            "every layer after the first_k_dense_replace is MoE in K3",
        )
        _require(
            self,
            "latent_moe_use_norm",
            self.latent_moe_use_norm is True,
            "Stable LatentMoE normalises the latent sum",
        )
        _require(
            self,
            "num_nextn_predict_layers",
            self.num_nextn_predict_layers == 0,
            "no multi-token-prediction head is implemented",
        )
        _require(self, "mla_use_output_gate", self.mla_use_output_gate, "K3's MLA output is gated")
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(
                f"num_experts_per_token={self.num_experts_per_token} exceeds "
                f"num_experts={self.num_experts}"
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace={self.first_k_dense_replace} exceeds "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        for key in ("moe_intermediate_size", "routed_expert_hidden_size"):
            _check(key, getattr(self, key), getattr(self, key) % 32 == 0, "MXFP4 groups are 32")
        self._read_linear_attn_config()

    def _check_values(self):
        """Type, range and finiteness of every value, before any is used."""
        for key in POSITIVE_INTS:
            _check(key, getattr(self, key), _is_int(getattr(self, key), 1), "a positive integer")
        for key in COUNTS:
            _check(key, getattr(self, key), _is_int(getattr(self, key), 0), "an integer >= 0")
        for key in POSITIVE_FLOATS:
            v = getattr(self, key)
            _check(key, v, _is_real(v) and v > 0, "a finite number > 0")
        for key in BOOLS:
            _check(key, getattr(self, key), isinstance(getattr(self, key), bool), "true or false")
        for key in STRINGS:
            _check(key, getattr(self, key), isinstance(getattr(self, key), str), "a string")
        for key in ("bos_token_id", "pad_token_id"):
            v = getattr(self, key)
            _check(key, v, v is None or _is_int(v, 0), "a token id (integer >= 0) or null")
        eos = self.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        _check("eos_token_id", eos, ids and all(_is_int(i, 0) for i in ids), "token id(s)")
        q = self.quantization
        _check("quantization", q, q is None or isinstance(q, dict), "an object or null")
        cfg = self.linear_attn_config
        _check("linear_attn_config", cfg, isinstance(cfg, dict), "an object")

    def _read_linear_attn_config(self):
        cfg = self.linear_attn_config
        for key in ("num_heads", "head_dim", "kda_layers", "full_attn_layers"):
            if key not in cfg:
                raise ConfigError(f"linear_attn_config.{key} is missing")
        self.kda_heads = cfg["num_heads"]
        self.kda_head_dim = cfg["head_dim"]
        self.conv_size = cfg.get("short_conv_kernel_size", 4)
        self.gate_lower_bound = cfg.get("gate_lower_bound", -5.0)
        if self.gate_lower_bound is None:
            raise ConfigError(
                "linear_attn_config.gate_lower_bound=None: only the "
                "lower-bounded KDA gate is implemented"
            )
        for key, value in (
            ("num_heads", self.kda_heads),
            ("head_dim", self.kda_head_dim),
            ("short_conv_kernel_size", self.conv_size),
        ):
            _check(f"linear_attn_config.{key}", value, _is_int(value, 1), "a positive integer")
        lb = self.gate_lower_bound
        _check("linear_attn_config.gate_lower_bound", lb, _is_real(lb) and lb < 0, "finite, < 0")
        for key in ("kda_layers", "full_attn_layers"):
            v = cfg[key]
            ok = isinstance(v, list) and all(_is_int(i, 1) for i in v)
            _check(f"linear_attn_config.{key}", v, ok, "a list of 1-based layer numbers")
        if cfg.get("use_full_rank_gate", True) is not True:
            raise ConfigError(
                "linear_attn_config.use_full_rank_gate="
                f"{cfg['use_full_rank_gate']!r}: only the full-rank output gate"
            )
        self.kda_layers = tuple(cfg["kda_layers"])
        self.full_attn_layers = tuple(cfg["full_attn_layers"])
        both = set(self.kda_layers) & set(self.full_attn_layers)
        if both:
            raise ConfigError(
                f"layers {sorted(both)} are in both linear_attn_config.kda_layers "
                "and full_attn_layers"
            )
        every = set(range(1, self.num_hidden_layers + 1))
        missing = every - set(self.kda_layers) - set(self.full_attn_layers)
        if missing:
            raise ConfigError(
                f"layers {sorted(missing)} (1-based) are in neither "
                "linear_attn_config.kda_layers nor full_attn_layers"
            )
        extra = (set(self.kda_layers) | set(self.full_attn_layers)) - every
        if extra:
            raise ConfigError(
                f"linear_attn_config lists layers {sorted(extra)} beyond "
                f"num_hidden_layers={self.num_hidden_layers}"
            )

    def is_kda(self, layer: int) -> bool:
        """Whether the 0-based ``layer`` is a KDA layer (the config lists are 1-based)."""
        return (layer + 1) in self.kda_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def starts_block(self, layer: int) -> bool:
        return layer % self.attn_res_block_size == 0

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return list(e) if isinstance(e, (list, tuple)) else [e]


def read_config_json(path: str | Path) -> dict:
    """The ``config.json`` of a checkpoint directory (a JSON object), with errors that name
    the file: ``FileNotFoundError`` without one, ``CheckpointError`` when it is not a
    regular file of at most ``MAX_CONFIG_BYTES`` (``read_capped``), else ``ConfigError``."""
    file = Path(path) / "config.json"
    try:
        raw = read_capped(file, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise FileNotFoundError(f"{file}: no config.json (not a model directory?)") from None
    return load_json_object(raw, file, ConfigError)


@contextlib.contextmanager
def naming(file: Path):
    """Prefix a ``ConfigError`` raised inside with ``file``."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None


def _is_int(v, low: int) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and low <= v <= INT_MAX


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _check(key: str, value, ok, want: str):
    if not ok:
        raise ConfigError(f"config value {key}={value!r:.60} is not valid: must be {want}")


def _require(args, key, ok, why):
    if not ok:
        raise ConfigError(f"unsupported config value {key}={getattr(args, key)!r}: {why}")


def _check_quantization(qc: dict | None):
    """Accept the published compressed-tensors MXFP4 entry; reject any other format."""
    if not qc:
        return
    _check("quantization_config", qc, isinstance(qc, dict), "an object")
    groups = qc.get("config_groups") or {}
    ok = isinstance(groups, dict) and all(
        isinstance(g, dict) and isinstance(g.get("weights", {}), dict) for g in groups.values()
    )
    _check("quantization_config.config_groups", groups, ok, "an object of groups")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(
            f"unsupported quantization_config.quant_method={method!r}: "
            "only the published 'compressed-tensors' MXFP4 experts are read"
        )
    fmt = qc.get("format")
    if fmt != "mxfp4-pack-quantized":
        raise ConfigError(
            f"unsupported quantization_config.format={fmt!r}: only 'mxfp4-pack-quantized' is read"
        )
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights", {})
        if w.get("group_size", 32) != 32 or w.get("num_bits", 4) != 4:
            raise ConfigError(
                "unsupported quantization_config.config_groups weights "
                f"{w!r}: MXFP4 is 4-bit with group size 32"
            )
