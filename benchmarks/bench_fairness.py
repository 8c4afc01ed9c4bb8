"""A one-line chat beside N long prompts: its time to first token while they prefill,
and what serving it costs them, with the server's scheduling and without it.

    python -m benchmarks.bench_fairness                    # the embedded default model
    python -m benchmarks.bench_fairness --model DIR --long 1500 --counts 1 4 8
    python -m benchmarks.bench_fairness --quick            # a tiny synthetic model (tests)

Two settings, each a server (``python -m kimi_k3.server``) on the model, one after the
other in one invocation:

- the server's defaults: at most half of ``--max-batch`` long prompts prefill at once
  (``--max-long-prefills``), a step's prompt chunks bounded in time together
  (``--prefill-step-seconds``);
- without them: every slot may take a long prompt (``--max-long-prefills`` =
  ``--max-batch``) and chunks are bounded in tokens only (``--prefill-step-seconds 0``).

For each N in ``--counts``, ``--rounds`` times: N completions of ``--long`` distinct token
ids each (1 token of reply) are sent together; once the engine runs them (``/health``),
``--short`` one-line chats (1 token of reply) are sent one after another, each timed from
its send to its answer (its time to first token). Then N long prompts (other ids: no
prefix reuse) are sent with no chat beside them. The table gives the chats' median and
largest time over the rounds, a chat's time alone, and the long prompts' wall time (the
last one's answer) with and without the chats beside them: medians and ranges. A row
whose long prompts all ended before the last chat of a round says so (raise ``--long``).
One untimed long prompt and chat first (the first passes of each shape compile).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import timing
from benchmarks.bench_server import Server, completion, in_threads, latency
from kimi_k3.cli import markdown_table

CHAT = {"messages": [{"role": "user", "content": "Say hello in one line."}], "max_tokens": 1}
MAX_BATCH = 8  # the server's default --max-batch


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: the embedded default)")
    p.add_argument("--long", type=int, default=1500, help="tokens of each long prompt")
    p.add_argument(
        "--counts", type=int, nargs="+", default=[1, 4, 8], help="long prompts sent together"
    )
    p.add_argument("--short", type=int, default=3, help="chats timed beside each set")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of each count, with the chats and without"
    )
    p.add_argument(
        "--defaults-only",
        action="store_true",
        help="the server's defaults only (a server of another version, say)",
    )
    p.add_argument("--quick", action="store_true", help="a tiny synthetic model, small counts")
    p.add_argument("--out", help="also write the table here")
    return p


class Prompts:
    """Long prompts of distinct token ids (no two share a prefix the server could reuse)."""

    def __init__(self, vocab: int, length: int):
        self.vocab, self.length, self.made = vocab, length, 0

    def next(self) -> list[int]:
        self.made += 1
        k = self.made
        return [(k * 131 + 7 * i) % (self.vocab - 300) + 1 for i in range(self.length)]


def chat(server: Server) -> tuple[int, dict]:
    return server.post("/v1/chat/completions", CHAT)


def long_prompts(server: Server, prompts: Prompts, n: int, short: int) -> dict:
    """``n`` long prompts sent together, and ``short`` chats timed one after another once
    the engine runs them (none: the long prompts alone); their wall time, the chats'
    times, and whether a long prompt was still unanswered after the last chat."""
    bodies = [prompts.next() for _ in range(n)]
    done = []
    t0 = time.perf_counter()

    def send_all():
        in_threads([lambda b=b: completion(server, b, 1) for b in bodies])
        done.append(time.perf_counter() - t0)

    background = threading.Thread(target=send_all)
    background.start()
    while server.get("/health")["running"] == 0:
        time.sleep(0.01)
    times = [latency(lambda: chat(server)) for _ in range(short)]
    overlapped = background.is_alive()
    background.join()
    return {"times": times, "overlapped": overlapped, "long_s": done[0]}


def measure(path: Path, a, vocab: int) -> str:
    settings = {
        "server's defaults": [],
        "without (--max-long-prefills 8 --prefill-step-seconds 0)": [
            "--max-long-prefills",
            MAX_BATCH,
            "--prefill-step-seconds",
            0,
        ],
    }
    rows = []
    for name, flags in list(settings.items())[: 1 if a.defaults_only else None]:
        prompts = Prompts(vocab, a.long)
        with Server(path, None, "--max-batch", MAX_BATCH, *flags) as server:
            long_prompts(server, prompts, 1, 1)  # warm-up: each shape's first passes compile
            alone = statistics.median(latency(lambda s=server: chat(s)) for _ in range(3))
            for n in a.counts:
                times, quiet, beside, overlapped = [], [], [], True
                for _ in range(a.rounds):  # each round: with the chats, then without
                    r = long_prompts(server, prompts, n, a.short)
                    times += r["times"]
                    beside.append(r["long_s"])
                    overlapped = overlapped and r["overlapped"]
                    quiet.append(long_prompts(server, prompts, n, 0)["long_s"])
                note = "" if overlapped else " (the long prompts ended first)"
                mid_quiet, mid_beside = statistics.median(quiet), statistics.median(beside)
                rows.append(
                    [
                        name + note,
                        n,
                        f"{alone:.2f}",
                        f"{statistics.median(times):.2f}",
                        f"{max(times):.2f}",
                        f"{mid_quiet:.1f} ({min(quiet):.1f}-{max(quiet):.1f})",
                        f"{mid_beside:.1f} ({min(beside):.1f}-{max(beside):.1f})",
                        f"{mid_beside / mid_quiet:.2f}x",
                    ]
                )
    header = [
        "scheduling",
        "long prompts",
        "chat alone, s",
        "chat beside them: median s",
        "largest s",
        "long prompts alone, s (range)",
        "with the chats, s (range)",
        "cost",
    ]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> str:
    a = setup_arg_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if a.quick:
            from kimi_k3.convert.synth import write_checkpoint

            path = write_checkpoint(Path(tmp) / "ckpt", "tiny")
            a.long, a.short, a.counts, a.rounds = min(a.long, 300), 1, [1, 2], 1
        elif a.model:
            path = Path(a.model)
        else:
            from kimi_k3.default_model import ensure_default_model

            path = ensure_default_model()
        from kimi_k3.model.config import ModelArgs

        vocab = ModelArgs.from_path(path).vocab_size
        head = f"{path.name}, {a.long}-token long prompts; {timing.environment()}"
        text = head + "\n\n" + measure(path, a, vocab)
    timing.emit(text, a.out)
    return text


if __name__ == "__main__":
    main()
