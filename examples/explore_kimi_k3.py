# %% [markdown]
# # Looking inside Kimi K3
#
# Run a prompt under `kimi_k3.trace` and plot what the model did: which experts each token
# went to, how the Attention Residuals mix weighs earlier blocks, how fast the Kimi Delta
# Attention layers forget, how spread out the MLA heads attend, and how the expert cache's
# hit rate grows with its budget.
#
# By default this looks at the embedded default model, a small Kimi K3 trained on the
# Python standard library (docs/training.md), so the routing and the mixes are learned
# ones; it completes a line of Python. `KIMI_K3_PRESET=small` (or `tiny`) builds a
# random-weight checkpoint of that preset instead, to compare. Set
# `KIMI_K3_MODEL=/path/to/Kimi-K3` to look at a real checkpoint (its experts are then
# streamed with a cache of `KIMI_K3_CACHE_GB`, default 64). The same code is
# `explore_kimi_k3.py` (a script) and `explore_kimi_k3.ipynb` (a notebook, rebuilt with
# `python examples/build_notebook.py`).
# Figures are saved as PNG files next to it, or in `KIMI_K3_PLOT_DIR`.

# %%
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import mlx.core as mx
import numpy as np

import kimi_k3
from kimi_k3.checkpoint.files import CheckpointIndex
from kimi_k3.checkpoint.loader import load_model
from kimi_k3.text.chat import encode_chat
from kimi_k3.text.tokenizer import load_tokenizer
from kimi_k3.trace import trace

MODEL = os.environ.get("KIMI_K3_MODEL")
PRESET = os.environ.get("KIMI_K3_PRESET")
DECODE_STEPS = int(os.environ.get("KIMI_K3_DECODE_STEPS", "12"))
HERE = Path(__file__).parent if "__file__" in globals() else Path.cwd()
PLOTS = Path(os.environ.get("KIMI_K3_PLOT_DIR") or HERE)
PLOTS.mkdir(parents=True, exist_ok=True)

CHAT = True  # the default model completes text; the others take a chat prompt
if MODEL is None and PRESET is None:
    from kimi_k3.default_model import ensure_default_model

    MODEL, CHAT = str(ensure_default_model()), False
    DTYPE, CACHE_GB = mx.float32, None
elif MODEL is None:
    from kimi_k3.convert.synth import write_checkpoint

    workdir = tempfile.TemporaryDirectory(prefix="kimi-k3-")  # removed when Python exits
    MODEL = str(write_checkpoint(workdir.name, PRESET))
    DTYPE, CACHE_GB = mx.float32, None
else:
    DTYPE, CACHE_GB = mx.bfloat16, float(os.environ.get("KIMI_K3_CACHE_GB", "64"))

model = load_model(MODEL, dtype=DTYPE, expert_cache_gb=CACHE_GB)
tokenizer = load_tokenizer(MODEL)
args = model.args
print(
    f"{MODEL}: {args.num_hidden_layers} layers, {args.num_experts} experts "
    f"(top-{args.num_experts_per_token}), AttnRes blocks of {args.attn_res_block_size}"
)

# %% [markdown]
# ## Run a prompt under the trace
# A prefill and a few greedy decode steps, through one prompt cache; the trace concatenates
# every call along the token axis. The default model gets the start of a Python function.

# %%
if CHAT:
    messages = [{"role": "user", "content": "Why does a mixture of experts need a router?"}]
    prompt = encode_chat(tokenizer, messages, thinking=False)
else:
    code = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def pop(self):"
    prompt = tokenizer.encode(code)


mask = kimi_k3.reserved_token_mask(tokenizer)  # no reserved, [BOS], [PAD] or [UNK] ids


def generate(model, prompt, steps):
    """Greedy: prefill, then ``steps`` decode steps; returns the generated ids."""
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(steps):
        out.append(mx.argmax(mask(mx.array(prompt + out), logits[0, -1])).item())
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


with trace(model, channels=True) as t:
    reply = generate(model, prompt, DECODE_STEPS)
T = len(t.tokens)
print(f"traced {T} tokens ({len(prompt)} prompt + {DECODE_STEPS} decoded)")
print("reply:", repr(tokenizer.decode(reply)))

# %% [markdown]
# ## Expert routing
# Left: one MoE layer, the routing weight of every expert for every token (zero where the
# expert was not chosen). Right: how often each expert was chosen, per layer. K3's router
# was trained to be flat, so a real checkpoint shows no hot set; the default model's router
# was balanced the same way (its correction bias), so its choices depend on the token while
# each expert's share over a long text stays near even (`python -m kimi_k3.eval` measures
# both).

# %%
moe_layers = sorted(t.routing)
layer = moe_layers[0]
inds, weights = t.routing[layer]
dense = np.zeros((T, args.num_experts))
np.put_along_axis(dense, inds, weights, axis=1)
counts = np.stack(
    [np.bincount(t.routing[i][0].ravel(), minlength=args.num_experts) for i in moe_layers]
)

fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
im = a.imshow(dense.T, aspect="auto", cmap="viridis", interpolation="nearest")
a.set(title=f"layer {layer}: routing weights", xlabel="token", ylabel="expert")
fig.colorbar(im, ax=a)
im = b.imshow(counts, aspect="auto", cmap="magma", interpolation="nearest")
b.set(
    title="times chosen",
    xlabel="expert",
    ylabel="MoE layer",
    yticks=range(len(moe_layers)),
    yticklabels=moe_layers,
)
fig.colorbar(im, ax=b)
fig.tight_layout()
fig.savefig(PLOTS / "routing.png", dpi=120)

# %% [markdown]
# ## AttnRes: what each mix draws from
# Every layer mixes the block snapshots (the embedding, then one summary per closed
# block) and the running partial sum of the current block, once before attention and once
# before the MLP. Each row is one mix, averaged over tokens; blank cells are snapshots that
# do not exist yet at that depth.

# %%
n_src = t.attn_res_out.shape[0]
rows, labels = [], []
for i in sorted(t.attn_res):
    for side in ("attn", "mlp"):
        rows.append(t.attn_res[i][side].mean(axis=1))
        labels.append(f"L{i} {side}")
rows.append(t.attn_res_out.mean(axis=1))
labels.append("output")
grid = np.full((len(rows), n_src), np.nan)
for r, w in enumerate(rows):
    grid[r, : len(w) - 1] = w[:-1]  # snapshots, oldest first
    grid[r, -1] = w[-1]  # the partial sum, always last
sources = ["embedding"] + [f"block {j}" for j in range(1, n_src - 1)] + ["partial"]

fig, ax = plt.subplots(figsize=(1.2 * n_src + 3, 0.22 * len(rows) + 1.5))
im = ax.imshow(grid, aspect="auto", cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
ax.set(
    title="AttnRes mixing weights (mean over tokens)",
    xticks=range(n_src),
    xticklabels=sources,
    yticks=range(len(rows)),
    yticklabels=labels,
)
ax.tick_params(axis="y", labelsize=7)
fig.colorbar(im, ax=ax)
fig.tight_layout()
fig.savefig(PLOTS / "attn_res.png", dpi=120)

# %% [markdown]
# ## KDA decay spectrum
# `alpha = exp(g)` is the fraction of each state channel kept per token. Left: every
# channel's mean decay, sorted, one line per KDA layer; the right axis gives the implied
# half-life in tokens. Right: mean decay per head.

# %%
kda_layers = sorted(t.kda)
fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
for i in kda_layers:
    spectrum = np.sort(t.kda[i]["alpha"].mean(axis=0).ravel())[::-1]
    a.plot(spectrum, label=f"layer {i}")
a.set(title="decay per channel (sorted)", xlabel="channel rank", ylabel="alpha", ylim=(0, 1))
a.legend(fontsize=7)
half_lives = [0.25, 0.5, 1, 2, 5, 20]  # alpha ** h = 1/2
half = a.twinx()
half.set(
    ylim=(0, 1),
    yticks=[0.5 ** (1 / h) for h in half_lives],
    yticklabels=half_lives,
    ylabel="half-life (tokens)",
)
heads = np.stack([t.kda[i]["alpha_mean"].mean(axis=0) for i in kda_layers])
im = b.imshow(heads, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
b.set(
    title="mean decay per head",
    xlabel="head",
    ylabel="KDA layer",
    xticks=range(heads.shape[1]),
    yticks=range(len(kda_layers)),
    yticklabels=kda_layers,
)
fig.colorbar(im, ax=b)
fig.tight_layout()
fig.savefig(PLOTS / "kda_decay.png", dpi=120)
for i in kda_layers:
    print(f"layer {i}: state norm per head {np.round(t.kda[i]['state_norm'], 2)}")

# %% [markdown]
# ## MLA attention entropy
# Entropy of each head's attention over the visible tokens, averaged over heads; the
# dashed line is uniform attention (log of the number of visible tokens).

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
for i, ent in sorted(t.mla_entropy.items()):
    ax.plot(ent.mean(axis=0), label=f"layer {i}")
ax.plot(np.log(np.arange(1, T + 1)), "k--", label="uniform")
ax.set(title="MLA attention entropy", xlabel="token", ylabel="nats")
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(PLOTS / "mla_entropy.png", dpi=120)

# %% [markdown]
# ## Expert cache: hit rate against budget
# Load the model again with experts streamed from disk into caches of a few sizes and run
# the same prompt under a trace, whose `expert_cache` splits the streamer's counters per
# call: the prefill (which needs nearly every expert once) and the decode steps, where the
# cache lives on short-range reuse. Skipped for a real checkpoint unless `KIMI_K3_SWEEP=1`
# (each point reloads the model).

# %%
try:
    from kimi_k3.streaming import get_stats
except ImportError:
    get_stats = None
sweep = os.environ.get("KIMI_K3_SWEEP", "1" if CACHE_GB is None else "0") == "1"
if get_stats is None:
    print("The expert streamer (kimi_k3.streaming.get_stats) is not in this build: no sweep.")
elif sweep:
    index = CheckpointIndex(MODEL)
    expert_bytes = sum(info.nbytes for name, info in index.tensors.items() if ".experts." in name)
    fractions = [0.25, 0.5, 0.75, 1.0]
    rates = {"prefill": [], "decode": []}
    for f in fractions:
        streamed = load_model(MODEL, dtype=DTYPE, expert_cache_gb=f * expert_bytes / 1e9)
        with trace(streamed) as ts:
            generate(streamed, prompt, DECODE_STEPS)
        hits, misses = ts.expert_cache["hits"], ts.expert_cache["misses"]
        for name, calls in (("prefill", slice(0, 1)), ("decode", slice(1, None))):
            rates[name].append(hits[calls].sum() / max(hits[calls].sum() + misses[calls].sum(), 1))
        del streamed
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, r in rates.items():
        ax.plot([100 * f for f in fractions], r, "o-", label=name)
    ax.set(
        title="expert cache hit rate",
        xlabel="budget (% of all expert bytes)",
        ylabel="hit rate",
        ylim=(0, 1),
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOTS / "cache_hit_rate.png", dpi=120)
    for i, f in enumerate(fractions):
        print(
            f"budget {f:.0%}: prefill hit rate {rates['prefill'][i]:.3f}, "
            f"decode hit rate {rates['decode'][i]:.3f}"
        )
