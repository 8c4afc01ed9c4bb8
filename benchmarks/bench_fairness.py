"""Short requests beside a long prefill: time to the first token of one-token requests
sent while a long prompt prefills, with the engine's prefill chunks bounded in time
(``--prefill-step-seconds``, the server's default) and without a bound (0).

    python -m benchmarks.bench_fairness                    # the embedded default, 30k tokens
    python -m benchmarks.bench_fairness --model DIR --long 30000 --short 8
    python -m benchmarks.bench_fairness --quick            # a tiny synthetic model (tests)

For each setting a server (``python -m kimi_k3.server``) is started on the model; a
``--long``-token prompt is sent, and once the engine runs it (``/health``), ``--short``
one-token completions are sent one after another, each timed from its send to its
answer. The table gives each setting's median and largest latency and how far the long
prompt had got; a setting whose long prompt finished before its short requests did is
reported as such (raise ``--long``). Both settings run in one invocation, one after the
other, on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import timing
from benchmarks.bench_server import Server, completion, latency
from kimi_k3.cli import markdown_table


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: the embedded default)")
    p.add_argument("--long", type=int, default=30000, help="tokens of the long prompt")
    p.add_argument("--short", type=int, default=5, help="short requests timed per setting")
    p.add_argument(
        "--bounded",
        type=float,
        default=None,
        help="the bounded setting's --prefill-step-seconds (default: the server's)",
    )
    p.add_argument("--quick", action="store_true", help="a tiny synthetic model, small counts")
    p.add_argument("--out", help="also write the table here")
    return p


def beside_long_prefill(server: Server, long: int, short: int, vocab: int) -> dict:
    """Latencies of ``short`` one-token requests sent while a ``long``-token prompt
    prefills, and whether the long prompt was still in its prefill after the last."""
    ids = [(7 * i) % (vocab - 300) + 1 for i in range(long)]
    background = threading.Thread(target=lambda: completion(server, ids, 1))
    t0 = time.perf_counter()
    background.start()
    while server.get("/health")["running"] == 0:
        time.sleep(0.01)
    times = [latency(lambda: completion(server, "Hello", 1)) for _ in range(short)]
    overlapped = background.is_alive()
    background.join()
    return {"times": times, "overlapped": overlapped, "long_s": time.perf_counter() - t0}


def measure(path: Path, a, vocab: int) -> str:
    settings = {"bounded (default)" if a.bounded is None else f"bounded, {a.bounded} s": a.bounded}
    settings["unbounded (--prefill-step-seconds 0)"] = 0.0
    rows = []
    for name, seconds in settings.items():
        flags = [] if seconds is None else ["--prefill-step-seconds", seconds]
        with Server(path, None, *flags) as server:
            alone = latency(lambda s=server: completion(s, "Hello", 1))
            r = beside_long_prefill(server, a.long, a.short, vocab)
        note = "" if r["overlapped"] else " (the long prompt ended first: raise --long)"
        rows.append(
            [
                name + note,
                f"{alone:.2f}",
                f"{statistics.median(r['times']):.2f}",
                f"{max(r['times']):.2f}",
                f"{r['long_s']:.1f}",
            ]
        )
    header = [
        "prefill chunks",
        "1-token request alone, s",
        f"beside a {a.long}-token prefill: median s",
        "largest s",
        "long prompt's request, s",
    ]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> str:
    a = setup_arg_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if a.quick:
            from kimi_k3.convert.synth import write_checkpoint

            path = write_checkpoint(Path(tmp) / "ckpt", "tiny")
            a.long, a.short = min(a.long, 2000), min(a.short, 2)
        elif a.model:
            path = Path(a.model)
        else:
            from kimi_k3.default_model import ensure_default_model

            path = ensure_default_model()
        from kimi_k3.model.config import ModelArgs

        vocab = ModelArgs.from_path(path).vocab_size
        text = f"{path.name}; {timing.environment()}\n\n" + measure(path, a, vocab)
    timing.emit(text, a.out)
    return text


if __name__ == "__main__":
    main()
