"""Kimi K3's language model: decoder layers with AttnRes, and the mlx-lm model protocol.

The module tree mirrors the checkpoint (``language_model.model.layers.N.self_attn.q_proj``
...), so published tensors load by name; ``Model.sanitize`` is the one place that renames
or stacks anything.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

from kimi_k3.checkpoint.files import NON_TEXT_PREFIXES
from kimi_k3.model.attention import GatedMLA, KimiDeltaAttention
from kimi_k3.model.attn_res import AttnResMix
from kimi_k3.model.config import ModelArgs
from kimi_k3.model.experts import PUBLISHED_EXPERT
from kimi_k3.model.moe import LatentMoE, SituMLP
from kimi_k3.model.parallel import pipeline_stage, run_stage, shard_model


class DecoderLayer(nn.Module):
    """One decoder layer. ``state_hook``, if set, is called as ``state_hook(self, snaps, p)``
    with the block snapshots and the partial sum before the layer's FFN (the expert
    streamer's prediction of the next MoE layer, ``kimi_k3.streaming``)."""

    state_hook = None

    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        D, eps = args.hidden_size, args.rms_norm_eps
        self.index = index
        self.is_linear = args.is_kda(index)
        self.starts_block = args.starts_block(index)
        self.self_attn = KimiDeltaAttention(args) if self.is_linear else GatedMLA(args)
        if args.is_moe(index):
            self.block_sparse_moe = LatentMoE(args)
            self.block_sparse_moe.layer_index = index
        else:
            act = (args.activation_situ_beta, args.activation_situ_linear_beta)
            self.mlp = SituMLP(D, args.intermediate_size, *act)
        self.input_layernorm = nn.RMSNorm(D, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(D, eps=eps)
        self.self_attention_res = AttnResMix(D, eps)
        self.mlp_res = AttnResMix(D, eps)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if "block_sparse_moe" in self else self.mlp

    def __call__(self, p: mx.array, snaps: list, cache=None):
        """One layer on the partial sum ``p`` and the block snapshots ``snaps``."""
        h = self.self_attention_res(snaps, p)
        if self.starts_block:
            snaps = snaps + [p]
            p = None
        y = self.self_attn(self.input_layernorm(h), cache)
        p = y if p is None else p + y
        if self.state_hook is not None:
            self.state_hook(self, snaps, p)
        h = self.mlp_res(snaps, p)
        return p + self.ffn(self.post_attention_layernorm(h)), snaps


class TextModel(nn.Module):
    """The decoder stack. ``pipeline(group)`` keeps this process's stage of it (mlx-lm's
    convention: ``start_idx``, ``end_idx``, ``pipeline_layers``; ``kimi_k3.model.parallel``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.output_attn_res = AttnResMix(args.hidden_size, args.rms_norm_eps)
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pipeline_group = None
        self.start_idx, self.end_idx = 0, args.num_hidden_layers

    @property
    def pipeline_layers(self) -> list[DecoderLayer]:
        return self.layers[self.start_idx : self.end_idx]

    def pipeline(self, group, split: list[int] | None = None):
        """Keep only this rank's layers: ``split`` (layers per rank, rank 0 last) or a split
        balanced by parameter bytes. The last rank runs the first layers, rank 0 the last."""
        pipeline_stage(self, group, split)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        p = self.embed_tokens(inputs)
        if self.pipeline_group is not None:
            return run_stage(self, p, cache)
        cache = cache or [None] * len(self.layers)
        snaps: list = []
        for layer, c in zip(self.layers, cache):
            p, snaps = layer(p, snaps, c)
        return self.norm(self.output_attn_res(snaps, p))


class LanguageModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.model = TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.model(inputs, cache)
        if "lm_head" in self:
            return self.lm_head(h)
        return self.model.embed_tokens.as_linear(h)


class Model(nn.Module):
    """Kimi K3 (text). ``model(inputs [B, T] int, cache=None) -> logits [B, T, vocab]``."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = LanguageModel(args)

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.language_model(inputs, cache)

    @property
    def model(self) -> TextModel:
        """The decoder stack, where mlx-lm's ``sharded_load`` looks for ``pipeline``."""
        return self.language_model.model

    @property
    def layers(self) -> list[DecoderLayer]:
        """This process's layers (all of them unless pipelined)."""
        return self.language_model.model.pipeline_layers

    def shard(self, group=None, experts: bool = True):
        """Tensor parallel over ``group`` (mlx-lm's convention): attention and dense MLP
        projections split by heads / hidden units, and with ``experts`` each MoE layer's
        routed experts split into contiguous ranges (``kimi_k3.model.parallel``)."""
        shard_model(self, group, experts)

    def make_cache(self) -> list:
        """Per layer: ``ArraysCache(2)`` (conv window, KDA state) or ``KVCache`` (MLA latents)."""
        return [ArraysCache(size=2) if layer.is_linear else KVCache() for layer in self.layers]

    def sanitize(self, weights: dict) -> dict:
        """Published checkpoint names -> this module tree (see ``sanitize_weights``)."""
        return sanitize_weights(self.args, weights)

    @property
    def cast_predicate(self):
        """Parameters kept in fp32 whatever the model dtype."""
        return lambda path: not path.endswith(KEEP_FP32)

    @property
    def quant_predicate(self):
        """What mlx-lm style dense quantization may touch: not experts, gates or tiny tensors."""

        def predicate(path: str, module) -> bool | dict:
            if ".experts." in path or path.endswith(("_res", "conv1d")):
                return False
            if path.endswith("block_sparse_moe.gate"):
                return {"group_size": 64, "bits": 8}
            return hasattr(module, "to_quantized")

        return predicate


KEEP_FP32 = ("A_log", "dt_bias", "e_score_correction_bias", "conv1d.weight")
_RES = re.compile(r"(self_attention_res|mlp_res|output_attn_res)_(proj|norm)\.weight$")


def sanitize_weights(args: ModelArgs, weights: dict, num_experts: int | None = None) -> dict:
    """Rename the published layout into this module tree (``num_experts`` routed experts
    per layer: the config's, or one rank's share numbered from 0).

    - the AttnRes spelling ``X_proj.weight`` / ``X_norm.weight`` -> ``X.proj_weight`` /
      ``X.norm_weight``;
    - per-expert compressed-tensors MXFP4 (``experts.E.wN.weight_packed`` u8 [O, I/2] and
      ``weight_scale`` u8 [O, I/32]) -> stacked ``experts.wN.weight`` (the same bytes viewed
      as uint32 [E, O, I/8]) and ``experts.wN.scales`` [E, O, I/32];
    - ``A_log`` zero padding dropped (first ``num_heads`` entries kept).
    """
    out, experts = {}, {}
    for key, value in weights.items():
        if key.startswith(NON_TEXT_PREFIXES):
            continue
        key = _RES.sub(lambda m: f"{m.group(1)}.{m.group(2)}_weight", key)
        if m := PUBLISHED_EXPERT.match(key):
            experts.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = value
            continue
        if key.endswith("self_attn.A_log") and value.shape[0] > args.kda_heads:
            value = value.reshape(-1)[: args.kda_heads]
        out[key] = value
    for (prefix, wname, kind), per_expert in experts.items():
        n = args.num_experts if num_experts is None else num_experts
        stacked = stack_experts(per_expert, n, f"{prefix}.experts.*.{wname}.{kind}")
        if kind == "weight_packed":
            out[f"{prefix}.experts.{wname}.weight"] = stacked.view(mx.uint32)
        else:
            out[f"{prefix}.experts.{wname}.scales"] = stacked
    return out


def stack_experts(per_expert: dict, n: int, what: str) -> mx.array:
    missing = [e for e in range(n) if e not in per_expert]
    if missing:
        raise KeyError(f"{what}: experts {missing[:8]}{'...' if len(missing) > 8 else ''} missing")
    return mx.stack([per_expert[e] for e in range(n)])
