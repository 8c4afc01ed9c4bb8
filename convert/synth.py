"""Seeded random Kimi K3 checkpoints in exactly the published layout.

Tensor names and dtypes, ``model-0000N-of-0000M.safetensors`` shards plus the index,
``config.json`` with ``text_config`` and ``quantization_config``, MXFP4 experts with real
E2M1 codes and E8M0 scales (an expert's six tensors back to back), and a tokenizer. Tests,
benchmarks and the embedded default model are built from these.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kimi_k3.checkpoint.files import ShardWriter, bf16_bits, write_text_atomic
from kimi_k3.text.tokenizer import write_synthetic_tokenizer

PREFIX = "language_model.model"


def _layers(n: int, full: list[int]) -> dict:
    return {"kda_layers": [i for i in range(1, n + 1) if i not in full], "full_attn_layers": full}


def _tiny(**over) -> dict:
    cfg = dict(
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=5,
        intermediate_size=128,
        attn_res_block_size=2,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        routed_expert_hidden_size=64,
        num_attention_heads=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        kda_heads=2,
        kda_head_dim=16,
        full=[3, 5],
    )
    cfg.update(over)
    return cfg


PRESETS = {
    # 5 layers (KDA 1,2,4; MLA 3,5), AttnRes blocks of 2: boundaries inside the stack.
    "tiny": _tiny(),
    # 4 layers, blocks of 3, MLA first, the other AttnRes spelling and another router size.
    "tiny-b": _tiny(
        num_hidden_layers=4,
        attn_res_block_size=3,
        full=[1, 4],
        num_experts=12,
        num_experts_per_token=4,
        kda_heads=3,
        res_spelling="underscore",
    ),
    # More experts and width: streaming tests and CPU benchmarks.
    "small": _tiny(
        vocab_size=2048,
        hidden_size=256,
        num_hidden_layers=6,
        intermediate_size=512,
        attn_res_block_size=3,
        num_experts=32,
        num_experts_per_token=4,
        moe_intermediate_size=128,
        routed_expert_hidden_size=128,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        kda_heads=4,
        kda_head_dim=32,
        full=[3, 6],
    ),
    # Full K3 width, two layers: layer 0 KDA + dense MLP, layer 1 MLA + MoE (benchmarks).
    "k3-layers": dict(
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=2,
        intermediate_size=33792,
        attn_res_block_size=12,
        num_experts=64,
        num_experts_per_token=16,
        num_shared_experts=2,
        moe_intermediate_size=3072,
        routed_expert_hidden_size=3584,
        num_attention_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        kda_heads=96,
        kda_head_dim=128,
        full=[2],
    ),
}


def make_config(p: dict) -> dict:
    """The published ``config.json`` shape for preset ``p``."""
    n = p["num_hidden_layers"]
    text = {
        k: v
        for k, v in p.items()
        if k not in ("full", "kda_heads", "kda_head_dim", "res_spelling", "shard_mb")
    }
    vocab = p["vocab_size"]
    text.update(
        model_type="kimi_linear",
        rms_norm_eps=1e-5,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        latent_moe_use_norm=True,
        moe_renormalize=True,
        moe_router_activation_func="sigmoid",
        topk_method="noaux_tc",
        num_expert_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        mla_use_nope=True,
        mla_use_output_gate=True,
        num_nextn_predict_layers=0,
        max_position_embeddings=1048576,
        tie_word_embeddings=False,
        linear_attn_config={
            "num_heads": p["kda_heads"],
            "head_dim": p["kda_head_dim"],
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            **_layers(n, p["full"]),
        },
    )
    specials = vocab - 256
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": specials,
        "eos_token_id": specials + 2,
        "pad_token_id": specials + 255,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "text_config": text,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "float",
                        "group_size": 32,
                        "strategy": "group",
                        "scale_dtype": "uint8",
                    },
                }
            },
            "ignore": [
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp.*",
                "lm_head",
                "re:.*gate$",
                "re:.*routed_expert_(up|down)_proj$",
            ],
        },
    }


class _Rand:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def linear(self, out_dims: int, in_dims: int) -> np.ndarray:
        return bf16_bits(
            self.rng.standard_normal((out_dims, in_dims), np.float32) / math.sqrt(in_dims)
        )

    def norm(self, n: int) -> np.ndarray:
        return bf16_bits(1.0 + 0.1 * self.rng.standard_normal(n, np.float32))

    def f32(self, shape, scale: float, loc: float = 0.0) -> np.ndarray:
        return (loc + scale * self.rng.standard_normal(shape)).astype(np.float32)

    def mxfp4(self, out_dims: int, in_dims: int) -> tuple[np.ndarray, np.ndarray]:
        """Random E2M1 codes (2 per byte) and E8M0 scales sized for unit-variance outputs."""
        packed = self.rng.integers(0, 256, (out_dims, in_dims // 2), dtype=np.uint8)
        centre = 127 - round(math.log2(math.sqrt(in_dims) * 2.93))
        scales = self.rng.integers(centre - 1, centre + 2, (out_dims, in_dims // 32))
        return packed, scales.astype(np.uint8)


def _attn_res(w: ShardWriter, r: _Rand, base: str, name: str, D: int, spelling: str):
    proj, norm = r.linear(1, D), r.norm(D)
    if spelling == "underscore":
        w.add(f"{base}{name}_proj.weight", proj, "BF16")
        w.add(f"{base}{name}_norm.weight", norm, "BF16")
    else:
        w.add(f"{base}{name}.proj_weight", proj, "BF16")
        w.add(f"{base}{name}.norm_weight", norm, "BF16")


def _kda(w, r, a, p, D):
    H, K = p["kda_heads"], p["kda_head_dim"]
    P = H * K
    for n in ("q", "k", "v", "g"):
        w.add(f"{a}{n}_proj.weight", r.linear(P, D), "BF16")
    for n in ("q", "k", "v"):
        w.add(f"{a}{n}_conv1d.weight", r.f32((P, 1, 4), 0.5), "F32")
    w.add(f"{a}f_a_proj.weight", r.linear(K, D), "BF16")
    w.add(f"{a}f_b_proj.weight", r.linear(P, K), "BF16")
    w.add(f"{a}b_proj.weight", r.linear(H, D), "BF16")
    a_log = np.zeros(max(H, K), np.float32)  # published: per-head values, zero padded
    a_log[:H] = np.log(r.rng.uniform(1.0, 16.0, H))
    w.add(f"{a}A_log", a_log, "F32")
    w.add(f"{a}dt_bias", r.f32(P, 0.5), "F32")
    w.add(f"{a}o_norm.weight", r.norm(K), "BF16")
    w.add(f"{a}o_proj.weight", r.linear(D, P), "BF16")


def _mla(w, r, a, p, D):
    H = p["num_attention_heads"]
    qk = p["qk_nope_head_dim"] + p["qk_rope_head_dim"]
    w.add(f"{a}q_a_proj.weight", r.linear(p["q_lora_rank"], D), "BF16")
    w.add(f"{a}q_a_layernorm.weight", r.norm(p["q_lora_rank"]), "BF16")
    w.add(f"{a}q_b_proj.weight", r.linear(H * qk, p["q_lora_rank"]), "BF16")
    w.add(
        f"{a}kv_a_proj_with_mqa.weight",
        r.linear(p["kv_lora_rank"] + p["qk_rope_head_dim"], D),
        "BF16",
    )
    w.add(f"{a}kv_a_layernorm.weight", r.norm(p["kv_lora_rank"]), "BF16")
    w.add(
        f"{a}kv_b_proj.weight",
        r.linear(H * (p["qk_nope_head_dim"] + p["v_head_dim"]), p["kv_lora_rank"]),
        "BF16",
    )
    w.add(f"{a}o_proj.weight", r.linear(D, H * p["v_head_dim"]), "BF16")
    w.add(f"{a}g_proj.weight", r.linear(H * p["v_head_dim"], D), "BF16")


def _glu(w, r, a, D, hidden):
    w.add(f"{a}gate_proj.weight", r.linear(hidden, D), "BF16")
    w.add(f"{a}up_proj.weight", r.linear(hidden, D), "BF16")
    w.add(f"{a}down_proj.weight", r.linear(D, hidden), "BF16")


def _moe(w, r, a, p, D):
    E, Dl, I = p["num_experts"], p["routed_expert_hidden_size"], p["moe_intermediate_size"]
    w.add(f"{a}gate.weight", r.linear(E, D), "BF16")
    w.add(f"{a}gate.e_score_correction_bias", r.f32(E, 0.1), "F32")
    w.add(f"{a}routed_expert_down_proj.weight", r.linear(Dl, D), "BF16")
    w.add(f"{a}routed_expert_up_proj.weight", r.linear(D, Dl), "BF16")
    w.add(f"{a}routed_expert_norm.weight", r.norm(Dl), "BF16")
    _glu(w, r, f"{a}shared_experts.", D, I * p["num_shared_experts"])
    for e in range(E):
        for name, (o, i) in (("w1", (I, Dl)), ("w2", (Dl, I)), ("w3", (I, Dl))):
            packed, scales = r.mxfp4(o, i)
            w.add(f"{a}experts.{e}.{name}.weight_packed", packed, "U8")
            w.add(f"{a}experts.{e}.{name}.weight_scale", scales, "U8")


# The config.json key that marks a checkpoint as synthetic (random weights), so that every
# entry point can say so.
SYNTHETIC_KEY = "kimi_k3_synthetic"


def write_checkpoint(
    out: str | Path,
    preset: str | dict = "tiny",
    seed: int = 0,
    shard_mb: int | None = None,
    tokenizer: bool = True,
    **overrides,
) -> Path:
    """Write a synthetic checkpoint; returns its directory. ``overrides`` change preset keys."""
    p = dict(PRESETS[preset] if isinstance(preset, str) else preset)
    p.update(overrides)
    out = Path(out)
    D = p["hidden_size"]
    r = _Rand(seed)
    w = ShardWriter(out, shard_bytes=(shard_mb or p.get("shard_mb", 2048)) << 20)
    spelling = p.get("res_spelling", "dot")
    w.add(f"{PREFIX}.embed_tokens.weight", bf16_bits(r.f32((p["vocab_size"], D), 1.0)), "BF16")
    full = set(p["full"])
    for i in range(p["num_hidden_layers"]):
        base = f"{PREFIX}.layers.{i}."
        w.add(f"{base}input_layernorm.weight", r.norm(D), "BF16")
        w.add(f"{base}post_attention_layernorm.weight", r.norm(D), "BF16")
        _attn_res(w, r, base, "self_attention_res", D, spelling)
        _attn_res(w, r, base, "mlp_res", D, spelling)
        (_mla if (i + 1) in full else _kda)(w, r, f"{base}self_attn.", p, D)
        if i == 0:
            _glu(w, r, f"{base}mlp.", D, p["intermediate_size"])
        else:
            _moe(w, r, f"{base}block_sparse_moe.", p, D)
    _attn_res(w, r, f"{PREFIX}.", "output_attn_res", D, spelling)
    w.add(f"{PREFIX}.norm.weight", r.norm(D), "BF16")
    w.add("language_model.lm_head.weight", r.linear(p["vocab_size"], D), "BF16")
    w.close()
    config = make_config(p)
    config[SYNTHETIC_KEY] = {"seed": seed, "note": "random weights: the output is gibberish"}
    write_text_atomic(out / "config.json", json.dumps(config, indent=1))
    if tokenizer:
        write_synthetic_tokenizer(out, p["vocab_size"], seed=seed)
    return out


@contextmanager
def checkpoint_or_synthetic(path: str | None, preset: str = "tiny"):
    """``path`` itself, or (when None) a synthetic checkpoint in a temporary directory."""
    if path:
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield str(write_checkpoint(tmp, preset))


def parse_override(text: str):
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def setup_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="python -m kimi_k3.convert synth", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out", help="output directory")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-mb", type=int, default=None, help="shard size limit (MB)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a preset key, e.g. --set num_experts=896",
    )
    return parser


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    overrides = dict(parse_override(s) for s in args.set)
    out = write_checkpoint(args.out, args.preset, args.seed, args.shard_mb, **overrides)
    print(f"wrote a random-weight {args.preset} Kimi K3 checkpoint to {out}")
