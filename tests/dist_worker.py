"""One rank of a distributed check, run by ``mlx.launch`` from tests/test_distributed.py.

    python tests/dist_worker.py CKPT OUT CASE [CASE ...]

A CASE is ``SPLIT`` or ``SPLIT:GB`` (SPLIT one of ``kimi_k3.distributed.SPLITS``, or
``pipeline-call`` / ``shard-call``: mlx-lm's ``model.model.pipeline(group)`` /
``model.shard(group)`` on a model loaded whole; GB streams the experts through a cache of
that size), either followed by ``@P`` to trim experts with ``expert_top_p=P`` or ``%P`` to
shed misses with ``shed_misses=P``. For each
case the rank writes ``OUT/CASE.rankR.npz``: the greedy tokens and fp32 logits of a prefill
and ``STEPS`` decode steps (``run``), and its streaming counters.
``reference`` computes the same in one process. The case ``vanish:GB`` streams with the
expert split, and after one pass rank 1 moves its expert pack file away (to ``.moved``);
each rank writes the error it then stops with to ``OUT/vanish.rankR.txt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

PROMPT = [5, 17, 300, 2, 41, 9, 77, 12, 500, 3, 8]
STEPS = 6


def run(model) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the fp32 logits of the prompt's last position and each step."""
    cache = model.make_cache()
    logits = model(mx.array([PROMPT]), cache)[:, -1]
    tokens, out = [], []
    for _ in range(STEPS):
        out.append(np.array(logits[0].astype(mx.float32)))
        tokens.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[tokens[-1]]]), cache)[:, -1]
    return tokens, np.stack(out)


def reference(ckpt, gb: float | None = None, top_p: float = 1.0):
    import kimi_k3

    model, _ = kimi_k3.load(ckpt, dtype=mx.float32, expert_cache_gb=gb, expert_top_p=top_p)
    return run(model)


def load_case(ckpt, case: str, group):
    import kimi_k3
    from kimi_k3 import distributed

    case, _, shed = case.partition("%")
    case, _, top_p = case.partition("@")
    split, _, gb = case.partition(":")
    gb = float(gb) if gb else None
    kw = {"expert_top_p": float(top_p) if top_p else 1.0, "shed_misses": float(shed or 1.0)}
    if split.endswith("-call"):
        model, _ = kimi_k3.load(ckpt, dtype=mx.float32, expert_cache_gb=gb, **kw)
        if split == "pipeline-call":
            model.model.pipeline(group)
        else:
            model.shard(group)
        model.distributed_group = group
        return model
    plan = distributed.Plan(split, group)
    model, _ = kimi_k3.load(ckpt, dtype=mx.float32, expert_cache_gb=gb, **plan.load_kwargs(), **kw)
    return model


def main(ckpt: str, out: str, cases: list[str]) -> int:
    from kimi_k3 import distributed
    from kimi_k3.streaming import get_stats

    group = distributed.init_group("ring", timeout=60)
    ckpt = ckpt.replace("{rank}", str(group.rank()))  # one directory per rank
    for case in cases:
        if case.startswith("vanish"):
            vanish(ckpt, out, case, group)
            continue
        model = load_case(ckpt, case, group)
        tokens, logits = run(model)
        ranks = distributed.gather_stats(model)
        mine = get_stats(model) or {}
        keys = ("hits", "misses", "bytes_read", "expert_bytes", "shed_pairs")
        stats = {k: mine.get(k) for k in keys}
        np.savez(
            Path(out) / f"{case.replace(':', '_').replace('@', '_at_')}.rank{group.rank()}.npz",
            tokens=np.array(tokens),
            logits=logits,
            stats=json.dumps({"mine": stats, "gathered": ranks}),
        )
    return 0


def vanish(ckpt: str, out: str, case: str, group):
    from kimi_k3.distributed import DistributedError

    model = load_case(ckpt, case.replace("vanish", "expert"), group)
    mx.eval(model(mx.array([PROMPT]), model.make_cache()))
    if group.rank() == 1:
        pack = Path(ckpt) / "experts/experts-00001-of-00001.pack"
        pack.rename(pack.with_suffix(".moved"))
    from kimi_k3.streaming import clear_cache

    clear_cache(model)  # every expert must be read again
    try:
        run(model)
        message = "no error"
    except DistributedError as e:
        message = str(e)
    (Path(out) / f"vanish.rank{group.rank()}.txt").write_text(message)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
