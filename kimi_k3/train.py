"""Train a small Kimi K3 from scratch, and write it in the published layout.

    python -m kimi_k3.train run OUT [--steps N] [--minutes M]     # train; state in OUT/
    python -m kimi_k3.train run OUT --corpus-dir DIR              # ... on the larger corpus
    python -m kimi_k3.train run OUT --minutes 24 --segment-minutes 9 [--resume]  # in parts
    python -m kimi_k3.train export OUT CHECKPOINT                 # state -> published layout

The model is Kimi K3's architecture at small width (``PRESET``): KDA and gated NoPE MLA in
K3's 3:1 pattern, AttnRes blocks of 3 layers over 8 layers (two complete blocks and a third
in progress), a dense SiTU-GLU first layer, then Stable LatentMoE layers with 128 routed
experts, top-16, and two shared experts: K3's proportions, the routed experts a token goes
through holding 4x the shared experts' weights (latent half the hidden size, shared width
twice an expert's), and the routed experts 80% of the parameters. The corpus and the tokenizer are
``kimi_k3.corpus``'s (the Python standard library's source, PSF license; with
``--corpus-dir``, also the permissively licensed sources of ``kimi_k3.corpus.SOURCES``).

Training runs in fp32 with the routed experts as float stacks (``FloatExperts``); gradients
go through the reference paths (``kernels.dispatch.reference_paths``), each step eager or,
with ``--compile``, one compiled function (``make_step``). The router's
``e_score_correction_bias`` is not trained by gradient: after every step each layer's bias
moves by ``bias_rate`` towards balance (up for an expert chosen less than the mean, down
for one chosen more), K3's auxiliary-loss-free balancing. ``export`` quantizes the experts
to MXFP4 after training (``mx.quantize`` mode ``mxfp4``) and stores the dense weights in
bf16; docs/training.md gives the measured cost of both. The saved state (parameters,
optimizer moments, step, training time, flags) resumes a stopped run exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from kimi_k3 import corpus
from kimi_k3.checkpoint.files import CheckpointError, ShardWriter, bf16_bits, write_text_atomic
from kimi_k3.convert.synth import PREFIX, make_config
from kimi_k3.default_model import HELDOUT_FILE
from kimi_k3.kernels.dispatch import reference_paths
from kimi_k3.model.config import ModelArgs
from kimi_k3.model.experts import situ_glu
from kimi_k3.model.model import KEEP_FP32, Model
from kimi_k3.progress import duration
from kimi_k3.text.tokenizer import CONFIG_FILE, RANK_FILE, load_tokenizer, write_hf_tokenizer

PRESET = dict(
    vocab_size=4096,  # 3840 BPE ranks + 256 specials
    hidden_size=256,
    num_hidden_layers=8,
    intermediate_size=768,
    attn_res_block_size=3,
    num_experts=128,
    num_experts_per_token=16,  # K3's top-k: the routed experts a token uses hold 4x the shared
    num_shared_experts=2,
    moe_intermediate_size=64,
    routed_expert_hidden_size=128,
    num_attention_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    kda_heads=2,
    kda_head_dim=64,
    full=[4, 8],  # 1-based MLA layers: KDA, KDA, KDA, MLA, twice
)
CORPUS_NAME = "Python 3.11 standard library source, *.py without test suites (PSF license)"
STATE_FILE = "train_state.safetensors"
TRAIN_IDS, HELDOUT_IDS = "train_ids.npy", "heldout_ids.npy"  # the token streams
# What ``export`` takes from the corpus, kept in OUT when the corpus is read: the standard
# library's held-out files (a JSON list of texts) and the license files with ``NOTICE``. So
# ``export`` needs neither the archives nor the interpreter whose standard library was read.
HELDOUT_TEXTS, LICENSE_DIR = "heldout-stdlib.json", "licenses"
LOG_FILE = "train_log.jsonl"


class FloatExperts(nn.Module):
    """A layer's routed experts as float stacks, trainable: ``w1`` (gate) and ``w3`` (up)
    [E, I, D], ``w2`` (down) [E, D, I]. Called like the MXFP4 stores; records ``load``, how
    many (token, choice) pairs each expert received in the last call.

    Shapes: z [N, D]; inds [N, k]; weights [N, k]. Returns fp32 [N, D].
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, beta: float, cap: float):
        super().__init__()
        self.w1 = mx.random.normal((num_experts, hidden, dim)) * dim**-0.5
        self.w3 = mx.random.normal((num_experts, hidden, dim)) * dim**-0.5
        self.w2 = mx.random.normal((num_experts, dim, hidden)) * hidden**-0.5
        self._act = (beta, cap)
        self._record = SimpleNamespace(load=None)

    @property
    def load(self) -> mx.array | None:
        return self._record.load

    def __call__(self, z: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        N, k = inds.shape
        flat = inds.reshape(-1)
        order = mx.argsort(flat)
        idx = flat[order].astype(mx.uint32)
        self._record.load = mx.zeros((self.w1.shape[0],), mx.float32).at[flat].add(1.0)
        xs = z[order // k][:, None, :]

        def mm(x, w):
            return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)

        h = situ_glu(mm(xs, self.w1), mm(xs, self.w3), *self._act)
        y = mm(h, self.w2)[:, 0, :]
        y = mx.zeros_like(y).at[order].add(y).reshape(N, k, -1)
        return (y * weights.astype(mx.float32)[..., None]).sum(axis=1)


def model_args(preset: dict = PRESET) -> ModelArgs:
    return ModelArgs.from_dict(make_config(preset))


def preset_of(text_config: dict) -> dict:
    """The preset (``PRESET``'s keys) a checkpoint's ``text_config`` was written from."""
    preset = {k: text_config[k] for k in PRESET if k in text_config}
    attn = text_config["linear_attn_config"]
    preset["full"] = list(attn["full_attn_layers"])
    preset["kda_heads"], preset["kda_head_dim"] = attn["num_heads"], attn["head_dim"]
    return preset


def init_model(preset: dict = PRESET, seed: int = 0, zero_routed_up: bool = True) -> Model:
    """A freshly initialised fp32 model of ``preset`` with ``FloatExperts``; the routed
    up-projections start at zero unless ``zero_routed_up`` is False."""
    mx.random.seed(seed)
    args = model_args(preset)
    model = Model(args)
    for layer in model.layers:
        if layer.is_linear:
            a = layer.self_attn
            a.A_log = mx.log(mx.random.uniform(1.0, 16.0, a.A_log.shape))
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                conv = getattr(a, name)
                conv.weight = mx.random.normal(conv.weight.shape) * 0.5
        if "block_sparse_moe" in layer:
            moe = layer.block_sparse_moe
            moe.gate.weight = mx.random.normal(moe.gate.weight.shape) * args.hidden_size**-0.5
            # the routed part starts at zero and grows as far as it helps: at a random start
            # its noise (RMS about 0.6 per layer) taught the model to turn the routed
            # experts off (docs/training.md)
            up = moe.routed_expert_up_proj
            if zero_routed_up:
                up.weight = mx.zeros_like(up.weight)
            moe.experts = FloatExperts(
                args.num_experts,
                args.routed_expert_hidden_size,
                args.moe_intermediate_size,
                args.activation_situ_beta,
                args.activation_situ_linear_beta,
            )
    model.language_model.model.embed_tokens.weight = mx.random.normal(
        (args.vocab_size, args.hidden_size)
    )
    mx.eval(model.parameters())
    return model


def trainable(model: Model) -> Model:
    """Everything trains except the routers' correction biases (set by balancing)."""
    model.unfreeze()
    for layer in model.layers:
        if "block_sparse_moe" in layer:
            layer.block_sparse_moe.gate.freeze(keys=["e_score_correction_bias"])
    return model


def update_router_bias(model: Model, rate: float) -> list[mx.array]:
    """Auxiliary-loss-free balancing: ``bias += rate * sign(mean_load - load)`` per layer,
    from the loads the experts recorded in the last forward pass. Returns the loads."""
    loads = []
    for layer in model.layers:
        if "block_sparse_moe" not in layer:
            continue
        moe = layer.block_sparse_moe
        load = moe.experts.load
        moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias + rate * mx.sign(
            load.mean() - load
        )
        loads.append(load)
    return loads


def loss_fn(model: Model, x: mx.array, y: mx.array) -> mx.array:
    """Mean next-token cross entropy. Shapes: x, y [B, T]."""
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def encode_texts(tokenizer, texts: list[str], separator: str) -> np.ndarray:
    """The texts as one token stream, ``separator`` between them. Shapes: [n] int32."""
    ids: list[int] = []
    for i, text in enumerate(texts):
        ids.extend(tokenizer.encode((separator if i else "") + text))
    return np.asarray(ids, dtype=np.int32)


def batches(tokens: np.ndarray, batch: int, seq: int, seed: int, start: int = 0):
    """Endless random windows of ``seq + 1`` tokens, from step ``start`` on. Step ``i``'s
    windows depend on ``(seed, i)`` alone, so a resumed run reads what an uninterrupted
    one would. Yields int32 [batch, seq + 1]."""
    step = start
    while True:
        starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - seq - 1, batch)
        yield mx.array(np.stack([tokens[s : s + seq + 1] for s in starts]).astype(np.int32))
        step += 1


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to a tenth of ``peak`` as
    ``progress`` (the share of the run done, 0..1) reaches 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, progress)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


class AdamWMatrices(optim.AdamW):
    """AdamW whose weight decay reaches matrices and stacks alone: the vectors (norm
    weights, ``A_log``, ``dt_bias``) take Adam's step undecayed, so no norm's gain is pulled
    to zero by decay alone. Its state is AdamW's, so a run saved by either resumes under
    the other."""

    def apply_single(self, gradient: mx.array, parameter: mx.array, state: dict) -> mx.array:
        if parameter.ndim < 2:
            return optim.Adam.apply_single(self, gradient, parameter, state)
        return super().apply_single(gradient, parameter, state)


def make_optimizer(lr: float, decay_vectors: bool = False) -> optim.AdamW:
    """AdamW, weight decay 0.1 on the matrices (``AdamWMatrices``), or on every parameter
    with ``decay_vectors``."""
    kind = optim.AdamW if decay_vectors else AdamWMatrices
    return kind(learning_rate=lr, weight_decay=0.1)


def routed_gain(model: Model) -> list[float]:
    """Per MoE layer, the RMS the routed part (``up(RMSNorm(y))``) would have for a latent
    of random direction: ``||up diag(norm weight)||_F / sqrt(hidden)``. The routed part's
    size is this whatever the experts compute (the norm fixes the latent's RMS), so a gain
    near zero means the layer has switched its routed experts off."""
    gains = []
    for layer in model.layers:
        if "block_sparse_moe" in layer:
            moe = layer.block_sparse_moe
            w = moe.routed_expert_up_proj.weight * moe.routed_expert_norm.weight[None, :]
            gains.append(float(mx.sqrt(mx.square(w).sum() / w.shape[0])))
    return gains


def make_step(model: Model, opt: optim.Optimizer, bias_rate: float, compiled: bool = False):
    """One training step as a function ``step(x, y) -> (loss, loads)``: the loss and its
    gradients, clipped to norm 1, the optimizer's update, then the routers' balancing
    (``update_router_bias``). With ``compiled`` the whole step is one ``mx.compile``d
    function over the model's and the optimizer's state (the learning rate, set on the
    optimizer between steps, is part of that state). Sets ``model`` to train with the
    routers' biases frozen (``trainable``). Shapes: x, y int32 [B, T]."""
    trainable(model).train()
    value_and_grad = nn.value_and_grad(model, loss_fn)

    def step(x, y):
        loss, grads = value_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss, update_router_bias(model, bias_rate)

    if not compiled:
        return step
    opt.init(model.trainable_parameters())  # keeps state already there (a resumed run's)
    state = [model.state, opt.state]
    return mx.compile(step, inputs=state, outputs=state)


def train(
    model: Model,
    data,
    steps: int,
    lr: float = 2e-3,
    warmup: int = 50,
    bias_rate: float = 1e-3,
    deadline: float | None = None,
    on_step=None,
    *,
    optimizer: optim.Optimizer | None = None,
    start_step: int = 0,
    seconds: float | None = None,
    elapsed: float = 0.0,
    compiled: bool = False,
    total_steps: int | None = None,
) -> list[float]:
    """AdamW over steps ``start_step .. steps - 1``, a batch from ``data`` each; the router
    biases balance after each step. The learning rate follows ``lr_at`` over the whole run:
    its progress is the larger of ``step / steps`` and, with a training-time budget
    ``seconds``, ``(elapsed + this call's time) / seconds``. The run stops after the last
    step, when ``data`` ends, when the training time reaches ``seconds``, or at ``deadline``
    (a ``time.time()``:
    this call's own limit, which leaves the schedule alone). ``optimizer`` and ``elapsed``
    carry a resumed run's state (``load_state``); ``compiled`` runs each step as one
    ``mx.compile``d function (``make_step``); ``total_steps`` (default ``steps``) is the
    step count the schedule spans, for a run trained in several calls. ``on_step(step,
    loss, loads)`` is called after every step. Returns this call's losses."""
    start = time.time()
    opt = optimizer if optimizer is not None else make_optimizer(lr)
    step_fn = make_step(model, opt, bias_rate, compiled)
    losses = []
    for step in range(start_step, steps):
        batch = next(data, None)
        if batch is None:  # a finite ``data`` ends the call
            break
        progress = step / (total_steps or steps)
        spent = elapsed + time.time() - start
        if seconds is not None:
            progress = max(progress, spent / seconds)
        opt.learning_rate = lr_at(step, progress, lr, warmup)
        loss, loads = step_fn(batch[:, :-1], batch[:, 1:])
        mx.eval(model.parameters(), opt.state, loss, loads)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1], loads)
        now = time.time()
        if seconds is not None and elapsed + now - start >= seconds:
            break
        if deadline is not None and now >= deadline:
            break
    return losses


OPTIMIZER_PREFIX = "optimizer."


def save_state(
    model: Model, path: Path, optimizer: optim.Optimizer | None = None, info: dict | None = None
):
    """Every parameter (float experts and router biases included), fp32, atomically; with
    ``optimizer`` its state too (``optimizer.*`` tensors), and ``info`` (JSON) in the
    file's metadata: what ``load_state`` needs to resume."""
    tensors = dict(tree_flatten(model.parameters()))
    if optimizer is not None:
        tensors.update((OPTIMIZER_PREFIX + k, v) for k, v in tree_flatten(optimizer.state))
    metadata = {"kimi_k3_train": json.dumps(info)} if info is not None else None
    tmp = path.with_suffix(".tmp.safetensors")
    mx.save_safetensors(str(tmp), tensors, metadata=metadata)
    os.replace(tmp, path)


def load_state(path: str | Path, preset: dict = PRESET) -> Model:
    """A model from ``save_state``'s file (its optimizer state, if any, left aside)."""
    return load_training(path, preset)[0]


def load_training(path: str | Path, preset: dict = PRESET):
    """``(model, optimizer state or None, info or None)`` from ``save_state``'s file."""
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable training state ({e})") from e
    params = {k: v for k, v in tensors.items() if not k.startswith(OPTIMIZER_PREFIX)}
    opt = [(k[len(OPTIMIZER_PREFIX) :], v) for k, v in tensors.items() if k not in params]
    model = init_model(preset)
    want = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    have = {k: tuple(v.shape) for k, v in params.items()}
    if have != want:
        wrong = sorted(k for k in want.keys() & have.keys() if want[k] != have[k])
        raise CheckpointError(
            f"{path}: parameters do not match the training preset (missing "
            f"{sorted(want.keys() - have.keys())[:3]}, unexpected "
            f"{sorted(have.keys() - want.keys())[:3]}, other shapes {wrong[:3]})"
        )
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    info = json.loads(metadata["kimi_k3_train"]) if "kimi_k3_train" in metadata else None
    return model, (tree_unflatten(opt) if opt else None), info


def quantize_mxfp4(w: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """Float experts [E, O, I] -> compressed-tensors bytes: packed u8 [E, O, I/2] (two E2M1
    codes a byte, even element low) and E8M0 scales u8 [E, O, I/32]."""
    q, s = mx.quantize(w.astype(mx.float32), group_size=32, bits=4, mode="mxfp4")
    return np.array(q).view(np.uint8), np.array(s)


def dequantize_mxfp4(w: mx.array) -> mx.array:
    """``w`` through MXFP4 and back: the values the shipped experts hold."""
    q, s = mx.quantize(w.astype(mx.float32), group_size=32, bits=4, mode="mxfp4")
    return mx.dequantize(q, s, group_size=32, bits=4, mode="mxfp4")


def published_tensors(model: Model, args: ModelArgs):
    """``(name, array, dtype)`` in the published layout and order: per layer its dense
    tensors, then each routed expert's six tensors back to back; dense weights bf16 except
    K3's fp32 ones; experts MXFP4."""
    params = dict(tree_flatten(model.parameters()))
    layers: dict[int, list[str]] = {}
    top = []
    for name in sorted(params):
        parts = name.split(".")
        if parts[2] == "layers":
            layers.setdefault(int(parts[3]), []).append(name)
        else:
            top.append(name)
    yield from _dense(params, [n for n in top if "embed_tokens" in n], args)
    for i in sorted(layers):
        names = [n for n in layers[i] if ".experts." not in n]
        yield from _dense(params, names, args)
        if "block_sparse_moe" in model.layers[i]:
            yield from _experts(model.layers[i].block_sparse_moe.experts, f"{PREFIX}.layers.{i}.")
    yield from _dense(params, [n for n in top if "embed_tokens" not in n], args)


def _dense(params: dict, names: list[str], args: ModelArgs):
    for name in names:
        value = np.array(params[name].astype(mx.float32))
        if name.endswith("self_attn.A_log"):  # published: per-head values, zero padded
            padded = np.zeros(max(args.kda_heads, args.kda_head_dim), np.float32)
            padded[: value.shape[0]] = value
            value = padded
        if name.endswith(KEEP_FP32):
            yield name, value, "F32"
        else:
            yield name, bf16_bits(value), "BF16"


def _experts(experts, base: str):
    """A float store is quantized to MXFP4; a loaded MXFP4 store gives its bytes as they are."""
    if isinstance(experts, FloatExperts):
        packed = {n: quantize_mxfp4(getattr(experts, n)) for n in ("w1", "w2", "w3")}
    else:
        packed = {
            n: (
                np.array(getattr(experts, n).weight).view(np.uint8),
                np.array(getattr(experts, n).scales),
            )
            for n in ("w1", "w2", "w3")
        }
    for e in range(packed["w1"][0].shape[0]):
        for n in ("w1", "w2", "w3"):
            q, s = packed[n]
            yield f"{base}block_sparse_moe.experts.{e}.{n}.weight_packed", q[e], "U8"
            yield f"{base}block_sparse_moe.experts.{e}.{n}.weight_scale", s[e], "U8"


def export_checkpoint(model: Model, out: str | Path, tokenizer_dir: str | Path, info: dict):
    """Write ``model`` as a published-layout checkpoint in ``out``: shards, index,
    ``config.json`` (``info`` under ``training``), and the tokenizer files of
    ``tokenizer_dir``."""
    out = Path(out)
    writer = ShardWriter(out)
    for name, value, dtype in published_tensors(model, model.args):
        writer.add(name, value, dtype)
    writer.close()
    args = model.args
    config = make_config(preset_of({**vars(args), "linear_attn_config": args.linear_attn_config}))
    if info:
        config["training"] = info
    write_text_atomic(out / "config.json", json.dumps(config, indent=1))
    for name in (RANK_FILE, CONFIG_FILE):
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    write_hf_tokenizer(out)
    return out


def prepare(out: Path, vocab_size: int, corpus_dir: str | None = None):
    """Corpus split and tokenizer in ``out/tokenizer`` (trained once); returns the
    tokenizer and the train and held-out token streams. With ``corpus_dir`` (fetched
    archives, ``kimi_k3.corpus``) the corpus adds its sources to the standard library; the
    held-out stream stays the standard library's, the other sources' held-out files go to
    ``out/heldout-<kind>.txt``. The streams are kept in ``out/TRAIN_IDS`` and
    ``out/HELDOUT_IDS`` (uint16 where the vocabulary allows), so a resumed run (or
    ``export``) reads them instead of tokenizing the corpus again; with them
    ``out/HELDOUT_TEXTS`` and ``out/LICENSE_DIR``, what ``export`` ships. ``out`` so
    prepared trains and exports on another machine, without the archives."""
    corpus.record_manifest(out, corpus_dir)  # the same corpus as the run's, or an error
    tok_dir = out / "tokenizer"
    kept = [out / TRAIN_IDS, out / HELDOUT_IDS]
    done = kept + [out / HELDOUT_TEXTS, out / LICENSE_DIR / corpus.NOTICE_FILE]
    if (tok_dir / "tiktoken.model").is_file() and all(f.is_file() for f in done):
        return load_tokenizer(tok_dir), *(np.load(f, mmap_mode="r") for f in kept)
    docs = corpus.read_corpus(corpus_dir)
    corpus.write_heldout_texts(out, docs)
    train_texts, heldout_texts = corpus.split_texts(docs)
    if not (tok_dir / "tiktoken.model").is_file():
        corpus.write_corpus_tokenizer(tok_dir, train_texts, vocab_size)
    tok = load_tokenizer(tok_dir)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    streams = [
        encode_texts(tok, t, corpus.DOC_SEPARATOR).astype(dtype)
        for t in (train_texts, heldout_texts)
    ]
    for f, ids in zip(kept, streams):
        np.save(f, ids)
    write_text_atomic(out / HELDOUT_TEXTS, json.dumps(heldout_texts))
    (out / LICENSE_DIR).mkdir(exist_ok=True)
    corpus.write_licenses(out / LICENSE_DIR, corpus_dir)
    return tok, *streams


# The flags a resumed run must share with the run it continues.
RUN_FLAGS = ("steps", "minutes", "batch", "seq", "lr", "warmup", "bias_rate", "seed")


def run(args) -> Path:
    """``train run``: a fresh run in an empty ``OUT``, or with ``--resume`` the run whose
    state ``OUT`` holds, continued where it stopped (same flags)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / STATE_FILE
    flags = {k: getattr(args, k) for k in RUN_FLAGS}
    if state_file.exists() and not args.resume:
        raise RunError(
            f"{state_file} exists: pass --resume to continue that run, or choose another OUT"
        )
    if args.resume and not state_file.exists():
        raise RunError(f"--resume: {state_file} does not exist")
    if args.resume:
        model, opt_state, info = load_training(state_file)
        if info is None or opt_state is None:
            raise RunError(f"--resume: {state_file} holds no optimizer state to resume from")
        saved = info.get("flags", {})
        changed = [k for k in RUN_FLAGS if saved.get(k) != flags[k]]
        if changed:
            raise RunError(
                "--resume: "
                + ", ".join(
                    f"--{k.replace('_', '-')} {flags[k]} differs from the run's {saved.get(k)}"
                    for k in changed
                )
            )
        opt = make_optimizer(args.lr)
        opt.state = opt_state
        start_step, elapsed = info["step"], info["elapsed_s"]
        _truncate_log(out / LOG_FILE, start_step)
        print(f"resuming at step {start_step} after {elapsed:.0f} s of training")
    else:
        model, opt = init_model(seed=args.seed), make_optimizer(args.lr)
        start_step, elapsed = 0, 0.0
    t0 = time.time()
    _, train_ids, heldout_ids = prepare(out, PRESET["vocab_size"], args.corpus_dir)
    print(f"corpus: {len(train_ids):,} train tokens, {len(heldout_ids):,} held-out tokens")
    log = open(out / LOG_FILE, "a")
    started = time.time()
    seconds = 60 * args.minutes if args.minutes else None
    deadline = started + 60 * args.segment_minutes if args.segment_minutes else None

    def save(step: int):
        info = {"step": step, "elapsed_s": elapsed + time.time() - started, "flags": flags}
        save_state(model, state_file, opt, info)

    def on_step(step, loss, loads):
        rec = {"step": step + 1, "loss": round(loss, 4), "elapsed_s": round(time.time() - t0, 1)}
        rec["train_s"] = round(elapsed + time.time() - started, 1)
        rec["max_load_ratio"] = round(max(float(ld.max() / ld.mean()) for ld in loads), 2)
        if (step + 1) % args.log_every == 0:
            rec["routed_gain"] = [round(g, 4) for g in routed_gain(model)]
            tps = (step + 1 - start_step) * args.batch * args.seq / (time.time() - started)
            gain = sum(rec["routed_gain"]) / len(rec["routed_gain"])
            left = time_left(step + 1 - start_step, args.steps - step - 1, started, seconds,
                             elapsed, deadline)  # fmt: skip
            line = f"step {step + 1}  loss {loss:.4f}  routed gain {gain:.3f}  {tps:.0f} tok/s"
            print(f"{line}  {left}", flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if (step + 1) % args.save_every == 0:
            save(step + 1)

    limits = [f"step {args.steps}"] + [f"{args.minutes:g} min of training"] * bool(seconds)
    limits += [f"{args.segment_minutes:g} min in this process"] * bool(deadline)
    print(f"training until {' or '.join(limits)}, whichever comes first", flush=True)
    data = batches(train_ids, args.batch, args.seq, args.seed, start=start_step)
    losses = train(
        model,
        data,
        args.steps,
        args.lr,
        args.warmup,
        args.bias_rate,
        deadline,
        on_step,
        optimizer=opt,
        start_step=start_step,
        seconds=seconds,
        elapsed=elapsed,
        compiled=args.compile,
    )
    done = start_step + len(losses)
    save(done)
    finished = done >= args.steps or (
        seconds is not None and elapsed + time.time() - started >= seconds
    )
    if losses:
        print(f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}", end=", ")
    print(
        f"{time.time() - started:.0f} s training, {time.time() - t0:.0f} s in all; step {done}"
        + ("" if finished else " (the run's budget is not spent: --resume continues it)")
    )
    return out


def time_left(done, steps_left, started, seconds, elapsed, deadline) -> str:
    """``"about 12 min left"``: the sooner of the steps left at this process's rate so far
    (``done`` steps since ``started``), the run's training time left (``seconds`` in all,
    ``elapsed`` before this process) and this process's ``deadline``."""
    now = time.time()
    left = steps_left * (now - started) / max(done, 1)
    if seconds is not None:
        left = min(left, seconds - elapsed - (now - started))
    if deadline is not None:
        left = min(left, deadline - now)
    return f"about {duration(max(left, 0))} left"


def _truncate_log(path: Path, step: int):
    """Drop the log records after ``step`` (those of steps a stopped run took after its last
    save, which the resumed run takes again)."""
    if path.exists():
        kept = [line for line in open(path) if json.loads(line)["step"] <= step]
        write_text_atomic(path, "".join(kept))


class RunError(Exception):
    """A ``train run`` that cannot start as asked; printed as one ``error:`` line."""


def export(args) -> Path:
    out = Path(args.out)
    corpus_dir = corpus.recorded_dir(out, args.corpus_dir)
    model, _, state = load_training(out / STATE_FILE)
    log = [json.loads(line) for line in open(out / LOG_FILE)]
    steps = state["step"] if state else len(log)
    batch, seq = (
        (state["flags"]["batch"], state["flags"]["seq"]) if state else (args.batch, args.seq)
    )
    last = [rec for rec in log if rec["step"] <= steps][-1]
    train_ids = prepare(out, PRESET["vocab_size"], corpus_dir)[1]
    info = dict(
        trained=True,
        corpus=" + ".join(filter(None, [CORPUS_NAME, corpus.describe(corpus_dir)])),
        train_tokens=int(train_ids.size),
        steps=steps,
        tokens_seen=steps * batch * seq,
        final_loss=last["loss"],
        wall_time_s=last.get("train_s", last["elapsed_s"]),
    )
    dest = export_checkpoint(model, args.checkpoint, out / "tokenizer", info)
    heldout = json.loads((out / HELDOUT_TEXTS).read_text(encoding="utf-8"))
    write_text_atomic(dest / HELDOUT_FILE, heldout_sample(heldout, args.heldout_chars))
    for f in sorted((out / LICENSE_DIR).iterdir()):
        shutil.copyfile(f, dest / f.name)
    print(f"wrote {dest}")
    return dest


def heldout_sample(texts: list[str], max_chars: int) -> str:
    """Whole held-out files, in corpus order, up to ``max_chars`` characters."""
    kept, size = [], 0
    for text in texts:
        if kept and size + len(text) > max_chars:
            break
        kept.append(text)
        size += len(text) + len(corpus.DOC_SEPARATOR)
    return corpus.DOC_SEPARATOR.join(kept)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kimi_k3.train", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train; the state and log go to OUT")
    r.add_argument("out")
    r.add_argument("--steps", type=int, default=100000)
    r.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="the run's training time (the learning rate decays over it), across resumes",
    )
    r.add_argument(
        "--segment-minutes",
        type=float,
        default=None,
        help="stop this process after this wall time, the state saved; --resume continues",
    )
    r.add_argument("--resume", action="store_true", help="continue the run whose state OUT holds")
    r.add_argument(
        "--compile", action="store_true", help="run each step as one mx.compile'd function"
    )
    r.add_argument("--batch", type=int, default=8)
    r.add_argument("--seq", type=int, default=256)
    r.add_argument("--lr", type=float, default=3e-3)
    r.add_argument("--warmup", type=int, default=30)
    r.add_argument("--bias-rate", type=float, default=1e-3)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--log-every", type=int, default=10)
    r.add_argument("--save-every", type=int, default=25)
    corpus_help = "archives fetched by `python -m kimi_k3.corpus fetch DIR`: the corpus is "
    corpus_help += "the standard library plus kimi_k3.corpus.SOURCES"
    r.add_argument(
        "--corpus-dir", default=None, help=corpus_help + "; default: the standard library alone"
    )
    e = sub.add_parser("export", help="OUT's training state -> a published-layout checkpoint")
    e.add_argument("out")
    e.add_argument("checkpoint")
    e.add_argument("--batch", type=int, default=8, help="the run's batch (for tokens_seen)")
    e.add_argument("--seq", type=int, default=256, help="the run's window")
    e.add_argument("--heldout-chars", type=int, default=100_000)
    e.add_argument("--corpus-dir", default=None, help=corpus_help + "; default: as OUT records")
    return parser


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)

    try:
        with reference_paths():  # gradients through the reference paths, for this call
            (run if args.command == "run" else export)(args)
    except (RunError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
