"""Kimi K3 over several processes or machines with ``mx.distributed``.

Three splits, alone or combined on one group (``--split`` of the commands, ``SPLITS``):

- ``pipeline``: each rank runs a contiguous stage of the layers (``TextModel.pipeline``,
  mlx-lm's convention: the last rank runs the first layers, rank 0 the last; stages balanced
  by parameter bytes). A stage hands the next one the AttnRes block snapshots and the partial
  sum, rank 0 finishes the stack and an all-gather gives every rank the output.
- ``tensor``: ``Model.shard(group, experts=False)``: KDA and MLA heads, the dense MLP and
  the shared experts split across ranks, an all-sum after each output projection (where
  mlx-lm's sharded models place them); routed experts replicated.
- ``expert``: each MoE layer's routed experts split into contiguous ranges; each rank holds
  or streams only its range, computes its experts' weighted part for every token, and one
  all-sum per MoE layer adds the parts. Dense weights replicated.
- ``tensor+expert``: both; the shared experts' part joins the experts' all-sum, so an MoE
  layer still costs one all-sum.

Every rank runs the router identically (same weights, same input), so the ranks agree on
the routing without communicating it. ``init_group`` forms the group with a deadline,
``agreed`` makes a failure on one rank (a missing expert file) end every rank with an error
naming that rank and the file, and ``gather_stats`` collects each rank's streaming counters.
docs/distributed.md describes how to run it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kimi_k3.checkpoint import CheckpointError

SPLITS = ("pipeline", "tensor", "expert", "tensor+expert")
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
    from mlx.utils import tree_flatten

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
    from kimi_k3.attention import GatedMLA

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
    from kimi_k3.experts import ResidentExperts

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
    from mlx.nn.layers.distributed import shard_linear

    a.heads = _heads(a.heads, group, "KDA heads")
    for name in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "b_proj"):
        setattr(a, name, shard_linear(getattr(a, name), "all-to-sharded", group=group))
    for conv in (a.q_conv1d, a.k_conv1d, a.v_conv1d):
        conv.weight = _rows(conv.weight, group)
    a.A_log, a.dt_bias = _rows(a.A_log, group), _rows(a.dt_bias, group)
    a.o_proj = shard_linear(a.o_proj, "sharded-to-all", group=group)


def _shard_mla(a, group):
    from mlx.nn.layers.distributed import shard_inplace, shard_linear

    a.heads = _heads(a.heads, group, "MLA heads")
    a.q_b_proj = shard_linear(a.q_b_proj, "all-to-sharded", group=group)
    a.g_proj = shard_linear(a.g_proj, "all-to-sharded", group=group)
    shard_inplace(a.kv_b_proj, "all-to-sharded", group=group)  # read per head, never called
    a.o_proj = shard_linear(a.o_proj, "sharded-to-all", group=group)


def _shard_mlp(mlp, group, partial: bool):
    """Gate and up split by hidden unit; down's partial output is summed by its own all-sum,
    or, ``partial``, left for the MoE block's all-sum."""
    from mlx.nn.layers.distributed import shard_inplace, shard_linear

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
    together (``_check_failures``) with the failed rank's error."""
    group = moe.sharding_group
    _check_failures(group)
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


def _check_failures(group=None):
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
    per token; choices that trimming dropped (``kimi_k3.trimming``: zero-weight copies of
    the token's first) are skipped. Shapes: z [N, Dl]; inds, weights [N, k]. Returns fp32
    [N, Dl]."""
    from kimi_k3.trimming import kept

    ids = np.array(inds)
    rows, cols = np.nonzero((ids >= held.start) & (ids < held.stop) & kept(ids))
    y = mx.zeros((ids.shape[0], z.shape[-1]), mx.float32)
    if len(rows) == 0:
        return y
    local = mx.array((ids[rows, cols] - held.start).astype(np.int32)[:, None])
    r = mx.array(rows.astype(np.int32))
    w = weights[r, mx.array(cols.astype(np.int32))][:, None]
    return y.at[r].add(store(z[r], local, w))


# The group, loading and failures.


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


def init_group(backend: str = "any", timeout: float = 300.0):
    """The global group of this launch (``mlx.launch``), every rank checked present by one
    all-sum; a rank missing after ``timeout`` seconds ends the process with an error."""
    rank = os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    try:
        with deadline(timeout, f"rank {rank}: forming the distributed group ({backend})"):
            group = mx.distributed.init(strict=True, backend=backend)
            mx.eval(mx.distributed.all_sum(mx.array(1), group=group, stream=mx.cpu))
    except (RuntimeError, ValueError) as e:
        raise DistributedError(
            f"no distributed group ({backend}): {e}; start every rank with mlx.launch "
            "(docs/distributed.md)"
        ) from None
    return group


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


@contextlib.contextmanager
def agreed(plan: Plan | None):
    """Run the block on every rank; then every rank learns whether any rank failed in it
    (``agree``). No-op without ``plan``."""
    if plan is None:
        yield
        return
    error = None
    try:
        yield
    except Exception as e:  # reported by agree on every rank, naming this one
        error = e
    agree(plan.group, error, plan.timeout)


@dataclass
class Plan:
    """The split chosen on the command line and the group it runs on."""

    split: str
    group: object
    timeout: float = 300.0

    @property
    def rank(self) -> int:
        return self.group.rank()

    def load_kwargs(self) -> dict:
        """``kimi_k3.load`` arguments for this split."""
        parts = set(self.split.split("+"))
        return {
            "pipeline_group": self.group if "pipeline" in parts else None,
            "tensor_group": self.group if "tensor" in parts else None,
            "expert_group": self.group if "expert" in parts else None,
        }


def add_arguments(p):
    """The commands' ``--split``, ``--backend`` and ``--dist-timeout`` flags."""
    p.add_argument(
        "--split",
        choices=SPLITS,
        default=None,
        help="run across the ranks of an mlx.launch group: pipeline stages, tensor "
        "parallel, expert parallel, or tensor+expert (docs/distributed.md)",
    )
    p.add_argument(
        "--backend",
        default="any",
        help="mx.distributed backend with --split: any (default), ring, jaccl, mpi, nccl",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=300.0,
        help="seconds a rank waits for the others to form the group or finish loading",
    )


def from_args(args) -> Plan | None:
    """The ``Plan`` for ``--split`` (None without it): forms the group and, on every rank
    but 0, silences output except ``error:`` lines (which name the rank)."""
    if args.split is None:
        return None
    if args.dist_timeout <= 0:
        raise DistributedError(f"--dist-timeout must be positive, got {args.dist_timeout}")
    group = init_group(args.backend, args.dist_timeout)
    plan = Plan(args.split, group, args.dist_timeout)
    if args.model is not None:  # one directory per rank: --model /data/k3-rank{rank}
        args.model = type(args.model)(str(args.model).replace("{rank}", str(plan.rank)))
    _report_as(plan.rank)
    return plan


def _report_as(rank: int):
    """Rank 0 prints and serves; other ranks print only their ``error:`` lines. Every
    ``error:`` line names its rank, and an error that escapes (a peer lost mid-generation)
    is one such line instead of a traceback."""
    import logging

    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    sys.stderr = _RankLines(sys.__stderr__, rank, errors_only=rank != 0)
    for handler in logging.getLogger().handlers:  # the server's log, set up before
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.__stderr__:
            handler.setStream(sys.stderr)

    def hook(kind, value, tb):
        sys.stderr.write(f"error: {value}\n")

    sys.excepthook = hook


class _RankLines:
    """A text stream that names ``rank`` in each ``error:`` line and, with ``errors_only``,
    drops every other line. Text not starting an error line passes through at once (a
    progress bar redrawn in place stays live)."""

    def __init__(self, out, rank: int, errors_only: bool):
        self.out, self.rank, self.errors_only, self.line = out, rank, errors_only, ""

    def write(self, text: str) -> int:
        if not self.line and not text.startswith("error"):
            if not self.errors_only:
                self.out.write(text)
            return len(text)
        self.line += text
        *lines, self.line = self.line.split("\n")
        for line in lines:
            if line.startswith("error: ") and not line.startswith(f"error: rank {self.rank}:"):
                line = f"error: rank {self.rank}: {line[len('error: ') :]}"
            self.out.write(line + "\n")
        self.out.flush()
        return len(text)

    def flush(self):
        self.out.flush()

    def isatty(self) -> bool:
        return self.out.isatty() and not self.errors_only


def free_ports(n: int, host: str = "127.0.0.1") -> int:
    """A base port with ``n`` consecutive free ports on ``host``, for ``mlx.launch
    --starting-port`` (the ring backend's rank r listens on base + r)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        socks = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no {n} consecutive free ports on {host}")


# Loading and stats.


def prepare(model, pipeline_group=None, expert_group=None):
    """Before any tensor is read: keep this rank's pipeline stage and expert range, so the
    loader reads only those layers' tensors and those experts."""
    if pipeline_group is not None:
        model.model.pipeline(pipeline_group)
    if expert_group is not None and expert_group.size() > 1:
        for layer in model.layers:
            if "block_sparse_moe" in layer:
                partition_experts(layer.block_sparse_moe, expert_group)


def world_of(model):
    """The group spanning this model's ranks, or None for one process."""
    return getattr(model, "distributed_group", None)


def gather_stats(model) -> list[dict] | None:
    """Every rank's streaming counters (hits, misses, bytes read, read seconds), gathered
    to every rank (a collective: every rank calls it); None for one process."""
    from kimi_k3.streaming import get_stats

    group = world_of(model)
    if group is None:
        return None
    _check_failures()  # a read failure in the last step
    # mlx-lm evaluates the next step ahead on its own stream: let it finish first, so its
    # collectives pair with the other ranks' before this gather runs.
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    s = get_stats(model) or {}
    keys = ("hits", "misses", "bytes_read", "read_seconds")
    mine = mx.array([[float(s.get(k, 0)) for k in keys] + [float(bool(s))]], mx.float32)
    rows = np.array(mx.distributed.all_gather(mine, group=group, stream=mx.cpu))
    out = []
    for row in rows:
        d = dict(zip(keys, row[:4].tolist(), strict=True))
        d["streamed"] = bool(row[4])
        seen = d["hits"] + d["misses"]
        d["hit_rate"] = d["hits"] / seen if seen else None
        d["read_gbps"] = d["bytes_read"] / 1e9 / d["read_seconds"] if d["read_seconds"] else None
        out.append(d)
    return out


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.1f} KB"


def stats_text(model) -> str | None:
    """The stats line's expert part with one entry per rank; None for one process."""
    ranks = gather_stats(model)
    if ranks is None:
        return None
    parts = []
    for r, d in enumerate(ranks):
        if not d["streamed"]:
            parts.append(f"rank {r} resident")
            continue
        rate = "no" if d["hit_rate"] is None else f"{d['hit_rate']:.1%}"
        speed = "" if d["read_gbps"] is None else f" at {d['read_gbps']:.2f} GB/s"
        read = _size(d["bytes_read"])
        parts.append(f"rank {r} {rate} hits, {read} read{speed}")
    return "experts: " + "; ".join(parts)
