"""Train a small Kimi K3 from scratch, and write it in the published layout.

    python -m kimi_k3.train run OUT [--steps N] [--minutes M]     # train; state in OUT/
    python -m kimi_k3.train run OUT --corpus-dir DIR              # ... on the larger corpus
    python -m kimi_k3.train export OUT CHECKPOINT                 # state -> published layout

The model is Kimi K3's architecture at small width (``PRESET``): KDA and gated NoPE MLA in
K3's 3:1 pattern, AttnRes blocks of 3 layers over 8 layers (two complete blocks and a third
in progress), a dense SiTU-GLU first layer, then Stable LatentMoE layers with 64 routed
experts, top-4, and two shared experts. The corpus and the tokenizer are
``kimi_k3.corpus``'s (the Python standard library's source, PSF license; with
``--corpus-dir``, also the permissively licensed sources of ``kimi_k3.corpus.SOURCES``).

Training runs in fp32 with the routed experts as float stacks (``FloatExperts``); gradients
go through the reference paths (``KIMI_K3_REFERENCE=1``). The router's
``e_score_correction_bias`` is not trained by gradient: after every step each layer's bias
moves by ``bias_rate`` towards balance (up for an expert chosen less than the mean, down
for one chosen more), K3's auxiliary-loss-free balancing. ``export`` quantizes the experts
to MXFP4 after training (``mx.quantize`` mode ``mxfp4``) and stores the dense weights in
bf16; docs/training.md gives the measured cost of both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from kimi_k3.checkpoint import ShardWriter, bf16_bits, write_text_atomic
from kimi_k3.config import ModelArgs
from kimi_k3.convert.synth import PREFIX, make_config
from kimi_k3.experts import situ_glu
from kimi_k3.model import KEEP_FP32, Model

PRESET = dict(
    vocab_size=4096,  # 3840 BPE ranks + 256 specials
    hidden_size=256,
    num_hidden_layers=8,
    intermediate_size=768,
    attn_res_block_size=3,
    num_experts=64,
    num_experts_per_token=4,
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


def init_model(preset: dict = PRESET, seed: int = 0) -> Model:
    """A freshly initialised fp32 model of ``preset`` with ``FloatExperts``."""
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


def batches(tokens: np.ndarray, batch: int, seq: int, seed: int):
    """Endless random windows of ``seq + 1`` tokens. Yields int32 [batch, seq + 1]."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq - 1, batch)
        yield mx.array(np.stack([tokens[s : s + seq + 1] for s in starts]))


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to a tenth of ``peak`` as
    ``progress`` (the share of the run done, 0..1) reaches 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, progress)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(
    model: Model,
    data,
    steps: int,
    lr: float = 2e-3,
    warmup: int = 50,
    bias_rate: float = 1e-3,
    deadline: float | None = None,
    on_step=None,
) -> list[float]:
    """AdamW over ``steps`` batches from ``data``; the router biases balance after each step.
    With a ``deadline`` (``time.time()``) the run ends there or after ``steps``, whichever
    comes first, and the learning rate decays over the wall time. ``on_step(step, loss,
    loads)`` is called after every step. Returns the losses."""
    trainable(model).train()
    start = time.time()
    opt = optim.AdamW(learning_rate=lr, weight_decay=0.1)
    step_fn = nn.value_and_grad(model, loss_fn)
    losses = []
    for step in range(steps):
        batch = next(data)
        progress = step / steps
        if deadline is not None:
            progress = max(progress, (time.time() - start) / (deadline - start))
        opt.learning_rate = lr_at(step, progress, lr, warmup)
        loss, grads = step_fn(model, batch[:, :-1], batch[:, 1:])
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        loads = update_router_bias(model, bias_rate)
        mx.eval(model.parameters(), opt.state, loss, loads)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1], loads)
        if deadline is not None and time.time() > deadline:
            break
    return losses


def save_state(model: Model, path: Path):
    """Every parameter (float experts and router biases included), fp32, atomically."""
    tmp = path.with_suffix(".tmp.safetensors")
    mx.save_safetensors(str(tmp), dict(tree_flatten(model.parameters())))
    os.replace(tmp, path)


def load_state(path: str | Path, preset: dict = PRESET) -> Model:
    """A model from ``save_state``'s file."""
    model = init_model(preset)
    model.update(tree_unflatten(list(mx.load(str(path)).items())))
    mx.eval(model.parameters())
    return model


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
    from kimi_k3.tokenizer import CONFIG_FILE, RANK_FILE

    out = Path(out)
    writer = ShardWriter(out)
    for name, value, dtype in published_tensors(model, model.args):
        writer.add(name, value, dtype)
    writer.close()
    config = make_config(PRESET)
    if info:
        config["training"] = info
    write_text_atomic(out / "config.json", json.dumps(config, indent=1))
    for name in (RANK_FILE, CONFIG_FILE):
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return out


def prepare(out: Path, vocab_size: int, corpus_dir: str | None = None):
    """Corpus split and tokenizer in ``out/tokenizer`` (trained once); returns the
    tokenizer and the train and held-out token streams. With ``corpus_dir`` (fetched
    archives, ``kimi_k3.corpus``) the corpus adds its sources to the standard library; the
    held-out stream stays the standard library's, the other sources' held-out files go to
    ``out/heldout-<kind>.txt``."""
    from kimi_k3 import corpus
    from kimi_k3.tokenizer import load_tokenizer

    corpus.record_manifest(out, corpus_dir)
    docs = corpus.read_corpus(corpus_dir)
    corpus.write_heldout_texts(out, docs)
    train_texts, heldout_texts = corpus.split_texts(docs)
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tiktoken.model").is_file():
        corpus.write_corpus_tokenizer(tok_dir, train_texts, vocab_size)
    tok = load_tokenizer(tok_dir)
    train_ids = encode_texts(tok, train_texts, corpus.DOC_SEPARATOR)
    heldout_ids = encode_texts(tok, heldout_texts, corpus.DOC_SEPARATOR)
    return tok, train_ids, heldout_ids


def run(args) -> Path:
    os.environ.setdefault("KIMI_K3_REFERENCE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    _, train_ids, heldout_ids = prepare(out, PRESET["vocab_size"], args.corpus_dir)
    np.save(out / "heldout_ids.npy", heldout_ids)
    print(f"corpus: {len(train_ids):,} train tokens, {len(heldout_ids):,} held-out tokens")
    model = init_model(seed=args.seed)
    log = open(out / LOG_FILE, "a")
    started = time.time()
    deadline = started + 60 * args.minutes if args.minutes else None

    def on_step(step, loss, loads):
        rec = {"step": step + 1, "loss": round(loss, 4), "elapsed_s": round(time.time() - t0, 1)}
        rec["max_load_ratio"] = round(max(float(ld.max() / ld.mean()) for ld in loads), 2)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if (step + 1) % args.log_every == 0:
            tps = (step + 1) * args.batch * args.seq / (time.time() - started)
            print(f"step {step + 1}  loss {loss:.4f}  {tps:.0f} tok/s", flush=True)
        if (step + 1) % args.save_every == 0:
            save_state(model, out / STATE_FILE)

    data = batches(train_ids, args.batch, args.seq, args.seed)
    losses = train(model, data, args.steps, args.lr, args.warmup, args.bias_rate, deadline, on_step)
    save_state(model, out / STATE_FILE)
    print(
        f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{time.time() - started:.0f} s training, {time.time() - t0:.0f} s in all"
    )
    return out


def export(args) -> Path:
    from kimi_k3 import corpus
    from kimi_k3.default_model import HELDOUT_FILE

    out = Path(args.out)
    corpus_dir = corpus.recorded_dir(out, args.corpus_dir)
    model = load_state(out / STATE_FILE)
    log = [json.loads(line) for line in open(out / LOG_FILE)]
    train_ids = encode_texts(*_tokenizer_and_train(out, corpus_dir))
    info = dict(
        trained=True,
        corpus=" + ".join(filter(None, [CORPUS_NAME, corpus.describe(corpus_dir)])),
        train_tokens=int(train_ids.size),
        steps=len(log),
        tokens_seen=len(log) * args.batch * args.seq,
        final_loss=log[-1]["loss"],
        wall_time_s=log[-1]["elapsed_s"],
    )
    dest = export_checkpoint(model, args.checkpoint, out / "tokenizer", info)
    heldout = corpus.read_split()[1]
    write_text_atomic(dest / HELDOUT_FILE, heldout_sample(heldout, args.heldout_chars))
    corpus.write_licenses(dest, corpus_dir)
    print(f"wrote {dest}")
    return dest


def _tokenizer_and_train(out: Path, corpus_dir: str | None):
    from kimi_k3 import corpus
    from kimi_k3.tokenizer import load_tokenizer

    train_texts = corpus.split_texts(corpus.read_corpus(corpus_dir))[0]
    return load_tokenizer(out / "tokenizer"), train_texts, corpus.DOC_SEPARATOR


def heldout_sample(texts: list[str], max_chars: int) -> str:
    """Whole held-out files, in corpus order, up to ``max_chars`` characters."""
    from kimi_k3.corpus import DOC_SEPARATOR

    kept, size = [], 0
    for text in texts:
        if kept and size + len(text) > max_chars:
            break
        kept.append(text)
        size += len(text) + len(DOC_SEPARATOR)
    return DOC_SEPARATOR.join(kept)


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train; the state and log go to OUT")
    r.add_argument("out")
    r.add_argument("--steps", type=int, default=100000)
    r.add_argument("--minutes", type=float, default=None, help="stop after this wall time")
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


def main(argv=None):
    args = setup_arg_parser().parse_args(argv)
    (run if args.command == "run" else export)(args)


if __name__ == "__main__":
    main()
