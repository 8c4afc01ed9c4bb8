"""The model split over an ``mx.distributed`` group: pipeline stages, tensor parallel dense
projections, and expert parallel ranges of the routed experts, with the collectives they
need (``agree``: every rank learns whether any failed).

The model owns these (``TextModel.pipeline``, ``Model.shard``, ``LatentMoE`` with a
``sharding_group``), as mlx-lm's models own ``shard`` and ``pipeline``. Forming the group,
the commands' ``--split`` flags and per-rank output are ``kimi_k3.distributed``'s;
docs/distributed.md describes the splits.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import mlx.core as mx
import numpy as np
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_flatten

from kimi_k3.checkpoint.files import CheckpointError
from kimi_k3.model.attention import GatedMLA
from kimi_k3.model.experts import ResidentExperts
from kimi_k3.model.routing import kept

MESSAGE_BYTES = 2048  # an error message as exchanged between ranks


class DistributedError(RuntimeError):
    """A rank failed or the group could not form; the message names the rank."""


# Partitions.


def expert_range(num_experts: int, size: int, rank: int) -> range:
    """Rank ``rank``'s contiguous share of ``num_experts`` experts (low ranks take the
    remainder): 896 over 3 ranks is 0..298, 299..597, 598..895."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    if size > num_experts:
        raise ValueError(f"{num_experts} experts cannot be split over {size} ranks")
    base, extra = divmod(num_experts, size)
    lo = rank * base + min(rank, extra)
    return range(lo, lo + base + (rank < extra))


def balanced_split(sizes: list[int], parts: int) -> list[int]:
    """Cut ``sizes`` (bytes per layer, in order) into ``parts`` contiguous non-empty runs
    whose largest sum is as small as possible; returns the run lengths in layer order."""
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"{n} layers cannot be split into {parts} pipeline stages")
    prefix = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for j in range(1, parts + 1):
        for i in range(j, n - parts + j + 1):
            for c in range(j - 1, i):
                cost = max(best[j - 1][c], prefix[i] - prefix[c])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, c
    runs, i = [], n
    for j in range(parts, 0, -1):
        runs.append(i - cut[j][i])
        i = cut[j][i]
    return runs[::-1]


def layer_bytes(layers) -> list[int]:
    return [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in layers]


# Pipeline.


def pipeline_stage(text, group, split: list[int] | None = None):
    """``TextModel.pipeline``: keep rank ``group.rank()``'s layers. ``split[r]`` is rank r's
    layer count; rank r runs the layers after those of ranks r+1 .. size-1."""
    size, rank = group.size(), group.rank()
    n = len(text.layers)
    if split is None:
        split = balanced_split(layer_bytes(text.layers), size)[::-1]
    if len(split) != size or sum(split) != n or min(split) < 1:
        raise ValueError(
            f"pipeline split {list(split)}: need {size} positive layer counts summing to {n}"
        )
    start = sum(split[rank + 1 :])
    end = start + split[rank]
    layers = list(text.layers[:end])
    layers[:start] = [None] * start
    text.layers = layers
    text.start_idx, text.end_idx = start, end
    text.pipeline_group = group if size > 1 else None


def run_stage(text, p: mx.array, cache) -> mx.array:
    """One pipelined forward pass: receive the snapshots and partial sum from the previous
    stage (rank + 1), run this stage's layers, hand on (rank - 1) or finish (rank 0)."""
    group = text.pipeline_group
    rank, size = group.rank(), group.size()
    layers = text.pipeline_layers
    cache = cache or [None] * len(layers)
    dtype, snaps = p.dtype, []
    if rank < size - 1:
        n = sum(text.args.starts_block(i) for i in range(text.start_idx))
        packed = mx.distributed.recv((n + 1, *p.shape), dtype, rank + 1, group=group)
        snaps, p = [packed[i] for i in range(n)], packed[n]
    for layer, c in zip(layers, cache):
        p, snaps = layer(p, snaps, c)
    if rank > 0:
        packed = mx.distributed.send(mx.stack([*snaps, p]).astype(dtype), rank - 1, group=group)
        _after(cache[-1], packed)
        h = packed[-1]
    else:
        h = text.output_attn_res(snaps, p)
    h = mx.distributed.all_gather(h.astype(dtype), group=group)[: h.shape[0]]
    return text.norm(h)


def _after(cache, sent: mx.array):
    """Make evaluating ``cache`` (mlx-lm evaluates only the caches of a prefill chunk) also
    perform the send, so the next stage is never left waiting."""
    if cache is None:
        return
    if hasattr(cache, "keys") and not callable(cache.keys):
        cache.keys = mx.depends(cache.keys, sent)
    else:
        cache[1] = mx.depends(cache[1], sent)


# Tensor and expert parallel.


def shard_model(model, group=None, experts: bool = True):
    """``Model.shard``: tensor parallel dense projections and, with ``experts``, the routed
    experts split into contiguous ranges, over ``group`` (the global group by default)."""
    group = group or mx.distributed.init()
    if group.size() == 1:
        return
    for layer in model.layers:
        mixer = layer.self_attn
        (_shard_mla if isinstance(mixer, GatedMLA) else _shard_kda)(mixer, group)
        if "block_sparse_moe" not in layer:
            _shard_mlp(layer.mlp, group, partial=False)
            continue
        moe = layer.block_sparse_moe
        if experts:
            partition_experts(moe, group)
        moe.shared_partial = moe.sharding_group is group
        _shard_mlp(moe.shared_experts, group, partial=moe.shared_partial)


def partition_experts(moe, group):
    """Keep rank ``group.rank()``'s contiguous range of ``moe``'s routed experts; the MoE
    block then adds the ranks' parts with one all-sum."""
    held = expert_range(len(moe.expert_range), group.size(), group.rank())
    if moe.sharding_group is not None:
        raise ValueError(f"layer {moe.layer_index}: its experts are already split")
    if not isinstance(moe.experts, ResidentExperts):
        raise ValueError(
            "streamed experts are split when loading: kimi_k3.load(..., expert_group=group) "
            "(or tensor_group=group) streams only this rank's experts"
        )
    for name in ("w1", "w2", "w3"):
        q = getattr(moe.experts, name)
        for key, value in list(q.items()):
            q[key] = value[held.start : held.stop]
    moe.expert_range, moe.sharding_group = held, group


def _heads(n: int, group, what: str) -> int:
    if n % group.size():
        raise ValueError(f"tensor parallel over {group.size()} ranks: {n} {what} do not split")
    return n // group.size()


def _rows(a: mx.array, group) -> mx.array:
    n = a.shape[0] // group.size()
    return a[group.rank() * n : (group.rank() + 1) * n]


def _shard_kda(a, group):
    a.heads = _heads(a.heads, group, "KDA heads")
    for name in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "b_proj"):
        setattr(a, name, shard_linear(getattr(a, name), "all-to-sharded", group=group))
    for conv in (a.q_conv1d, a.k_conv1d, a.v_conv1d):
        conv.weight = _rows(conv.weight, group)
    a.A_log, a.dt_bias = _rows(a.A_log, group), _rows(a.dt_bias, group)
    a.o_proj = shard_linear(a.o_proj, "sharded-to-all", group=group)


def _shard_mla(a, group):
    a.heads = _heads(a.heads, group, "MLA heads")
    a.q_b_proj = shard_linear(a.q_b_proj, "all-to-sharded", group=group)
    a.g_proj = shard_linear(a.g_proj, "all-to-sharded", group=group)
    shard_inplace(a.kv_b_proj, "all-to-sharded", group=group)  # read per head, never called
    a.o_proj = shard_linear(a.o_proj, "sharded-to-all", group=group)


def _shard_mlp(mlp, group, partial: bool):
    """Gate and up split by hidden unit; down's partial output is summed by its own all-sum,
    or, ``partial``, left for the MoE block's all-sum."""
    _heads(mlp.gate_proj.weight.shape[0], group, "MLP hidden units")
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    if partial:
        shard_inplace(mlp.down_proj, "sharded-to-all", group=group)
    else:
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def moe_parts(moe, flat: mx.array, z: mx.array, inds: mx.array, weights: mx.array):
    """An expert-parallel MoE layer's routed sum (fp32 [N, Dl]) and shared output, both
    summed over the ranks with one all-sum.

    The sum carries one more column: 1 from a rank whose experts could not be read (it adds
    zeros instead of raising, so no other rank is left waiting in this all-sum). The next
    MoE layer, whose routing evaluated this sum, sees it on every rank and all of them stop
    together (``check_failures``) with the failed rank's error."""
    group = moe.sharding_group
    check_failures(group)
    try:
        y = held_experts(moe.experts, moe.expert_range, z, inds, weights)
    except CheckpointError as e:  # ExpertReadError: a file vanished, changed, failed a check
        _FAILED[id(group)] = e
        y = mx.zeros((z.shape[0], z.shape[-1]), mx.float32)
    shared = moe.shared_experts(flat)
    flag = mx.full((z.shape[0], 1), float(id(group) in _FAILED), mx.float32)
    parts = [y, shared.astype(mx.float32)] if moe.shared_partial else [y]
    both = mx.distributed.all_sum(mx.concatenate([*parts, flag], axis=-1), group=group)
    _PENDING[id(group)] = (group, both[:1, -1])
    d = y.shape[-1]
    if not moe.shared_partial:
        return both[:, :d], shared
    return both[:, :d], both[:, d:-1].astype(shared.dtype)


_FAILED: dict = {}  # id(group) -> this rank's read error


_PENDING: dict = {}  # id(group) -> (group, the failure column of the last MoE all-sum)


def check_failures(group=None):
    """Raise on every rank once an earlier MoE all-sum carried a failure: ``agree`` then
    gives each rank the failed ranks' errors (naming the file, layer and expert)."""
    for key, (g, column) in list(_PENDING.items()):
        if group is not None and g is not group:
            continue
        del _PENDING[key]
        if float(column.item()) > 0:
            agree(g, _FAILED.pop(key, None))


def held_experts(store, held: range, z, inds, weights) -> mx.array:
    """This rank's part of the routed sum: the (token, choice) pairs whose expert is in
    ``held``, run on ``store`` (local expert numbers) as one choice each and added back
    per token; choices that trimming dropped (``kimi_k3.model.routing``: zero-weight copies of
    the token's first) are skipped. Shapes: z [N, Dl]; inds, weights [N, k]. Returns fp32
    [N, Dl]."""
    ids = np.array(inds)
    rows, cols = np.nonzero((ids >= held.start) & (ids < held.stop) & kept(ids))
    y = mx.zeros((ids.shape[0], z.shape[-1]), mx.float32)
    if len(rows) == 0:
        return y
    local = mx.array((ids[rows, cols] - held.start).astype(np.int32)[:, None])
    r = mx.array(rows.astype(np.int32))
    w = weights[r, mx.array(cols.astype(np.int32))][:, None]
    return y.at[r].add(store(z[r], local, w))


# Failures across ranks.


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """End this process with an error naming ``what`` if the block runs past ``seconds``:
    a collective whose peer never answers cannot be interrupted any other way."""
    done = threading.Event()

    def watch():
        if not done.wait(seconds):
            sys.__stderr__.write(f"error: {what} did not complete within {seconds:g} s\n")
            sys.__stderr__.flush()
            os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    finally:
        done.set()


def agree(group, error: BaseException | None, timeout: float = 300.0):
    """Every rank tells every other whether it failed; if any did, raise on every rank a
    ``DistributedError`` listing each failed rank and its message (which names the file)."""
    buf = np.zeros((1, MESSAGE_BYTES), np.uint8)
    if error is not None:
        text = (str(error) or type(error).__name__).encode()[: MESSAGE_BYTES - 1]
        buf[0, : len(text)] = np.frombuffer(text, np.uint8)
    with deadline(timeout, f"rank {group.rank()}: waiting for the other ranks to load"):
        everyone = mx.distributed.all_gather(mx.array(buf), group=group, stream=mx.cpu)
        rows = np.array(everyone)
    failed = [f"rank {r} failed: {_text(row)}" for r, row in enumerate(rows) if row.any()]
    if failed:
        raise DistributedError("; ".join(failed))


def _text(row: np.ndarray) -> str:
    return bytes(row).rstrip(b"\0").decode(errors="replace")


# Loading: before any tensor is read.


def prepare(model, pipeline_group=None, expert_group=None):
    """Before any tensor is read: keep this rank's pipeline stage and expert range, so the
    loader reads only those layers' tensors and those experts."""
    if pipeline_group is not None:
        model.model.pipeline(pipeline_group)
    if expert_group is not None and expert_group.size() > 1:
        for layer in model.layers:
            if "block_sparse_moe" in layer:
                partition_experts(layer.block_sparse_moe, expert_group)
