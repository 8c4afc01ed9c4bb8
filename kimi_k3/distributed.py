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
import json
import os
import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kimi_k3.model.parallel import DistributedError, agree, check_failures, deadline
from kimi_k3.streaming import get_stats

SPLITS = ("pipeline", "tensor", "expert", "tensor+expert")


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


def launched_ranks(environ=None) -> int:
    """How many ranks the launcher that started this process started, from the environment
    it sets (1 when none did): ``mlx.launch``'s ring backend lists one entry per rank in the
    JSON file ``MLX_HOSTFILE`` (empty for one rank), its jaccl backend one per rank in
    ``MLX_IBV_DEVICES``, its nccl backend sets ``MLX_WORLD_SIZE``, and ``mpirun``
    ``OMPI_COMM_WORLD_SIZE``. A file that cannot be read counts as one rank."""
    env = os.environ if environ is None else environ
    for name in ("MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if env.get(name, "").strip().isdigit():
            return max(1, int(env[name]))
    for name in ("MLX_HOSTFILE", "MLX_IBV_DEVICES"):
        if not env.get(name):
            continue
        try:
            with open(env[name]) as f:
                hosts = json.loads(f.read() or "[]")
        except (OSError, ValueError):
            continue
        if isinstance(hosts, list) and len(hosts) > 1:
            return len(hosts)
    return 1


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


def world_of(model):
    """The group spanning this model's ranks, or None for one process."""
    return getattr(model, "distributed_group", None)


def gather_stats(model) -> list[dict] | None:
    """Every rank's streaming counters (hits, misses, bytes read, read seconds), gathered
    to every rank (a collective: every rank calls it); None for one process."""
    group = world_of(model)
    if group is None:
        return None
    check_failures()  # a read failure in the last step
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
