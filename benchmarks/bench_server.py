"""The server under load: aggregate tokens/s by concurrent clients, time to first token
beside a long prefill and on a follow-up turn, and a bounded load test.

    python -m benchmarks.bench_server [--quick] [--out FILE]

A synthetic checkpoint (the ``small`` preset; ``--quick``: ``tiny``) is written to a
temporary directory and served by ``python -m kimi_k3.server`` on 127.0.0.1 with its
experts streamed into a cache of a quarter of their bytes (``--cache-fraction``).
Everything goes over HTTP:

- throughput: N clients (1, 4, 8) each send one completion of ``--tokens`` tokens at once
  (the stop ids biased away with ``logit_bias``, so that every reply has them all);
  aggregate tokens/s is every reply's tokens over the wall time of the slowest; ``--rounds``
  interleaved rounds of 1, 4 and 8 clients after ``--warmup`` untimed ones (each batch
  size's first steps compile what later ones reuse, for the server and the forward alone
  alike), the median and range of each, and each N's median against 1 client's. Beside
  it, in the same run, the limit any server has: the model's own batched forward with no
  server (``ForwardAlone``: the same prompts prefilled
  and ``--tokens`` greedy decode steps on the engine's ``Batch``, in this process, while
  the server idles), N rows against 1, and the server's rate over the forward's: the
  median of the rounds' ratios (each round times both) and their range;
- time to first token: a one-token request's latency, alone and while a ``--long``-token
  prompt prefills; a follow-up chat turn's latency after the first turn (its prefix comes
  from the snapshot) and for a conversation of the same length that shares no prefix;
- the overflow area: the streamed forward alone at 1 and 8 rows with the area the server
  sizes and without one (``--expert-overflow 0``), rounds interleaved;
- load: ``--requests`` requests from 16 threads, each with a time limit, against a server
  that runs 4 sequences and queues 4 more; every request must be answered (200) or
  refused (429), and the server must answer ``/health`` and one more request afterwards.

``--profile`` instead shows where a decode step's time goes, in this process, for 1, 4 and
8 sequences, with and without log-probabilities: ms per step of the forward alone and of
the engine (as the server makes it) with and without the overlap of the host's work and
the device's, and the engine's host time per step by part (``StepClock``), streamed and
resident.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks import timing
from kimi_k3.cli import markdown_table
from kimi_k3.convert.synth import write_checkpoint
from kimi_k3.default_model import expert_bytes
from kimi_k3.text.tokenizer import stop_ids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_gb(path: Path, fraction: float | None) -> float | None:
    """The expert cache holding ``fraction`` of ``path``'s expert bytes, in GB (None:
    experts resident)."""
    return None if fraction is None else fraction * expert_bytes(path) / 1e9


def cache_dir(path: Path) -> Path:
    """Where the benchmark's processes keep what they record once (checksums): beside the
    temporary checkpoint, not in the user's cache."""
    return path.parent / "cache"


class Server:
    """``python -m kimi_k3.server`` on a free localhost port, for a ``with`` block."""

    def __init__(self, path: Path, cache_fraction: float | None, *flags):
        """``cache_fraction``: the expert cache's share of the expert bytes; None keeps
        the experts resident."""
        self.url = f"http://127.0.0.1:{free_port()}"
        argv = ["--model", path, "--port", self.url.rsplit(":", 1)[1], *flags]
        if cache_fraction is not None:
            argv += ["--expert-cache-gb", f"{cache_gb(path, cache_fraction):.9g}"]
        env = {**os.environ, "KIMI_K3_CACHE": str(cache_dir(path))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kimi_k3.server", *map(str, argv)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )

    def __enter__(self):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                self.get("/health")
                return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("server did not start in 120 s")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=60)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.load(r)

    def post(self, path: str, body: dict, timeout: float = 600) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)


def completion(server: Server, prompt, tokens: int) -> tuple[int, dict]:
    return server.post("/v1/completions", {"prompt": prompt, "max_tokens": tokens})


def latency(fn) -> float:
    t0 = time.perf_counter()
    status, body = fn()
    if status != 200:
        raise RuntimeError(f"request failed ({status}): {body}")
    return time.perf_counter() - t0


def in_threads(fns) -> list:
    results = [None] * len(fns)
    threads = [
        threading.Thread(target=lambda i=i, f=f: results.__setitem__(i, f()))
        for i, f in enumerate(fns)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def client_prompts(clients: int) -> list[str]:
    return [f"Client {i} asks about attention residuals." for i in range(clients)]


def throughput(server: Server, clients: int, tokens: int, stops: list[int]) -> tuple[float, int]:
    """(aggregate tokens/s, tokens) of ``clients`` completions sent together, each of
    ``tokens`` tokens: its ``stops`` (the stop ids) biased away, so that no reply ends
    early (the forward alone decodes every row to the end)."""
    prompts = client_prompts(clients)
    bias = {str(i): -100 for i in stops}
    body = {"max_tokens": tokens, "logit_bias": bias}
    t0 = time.perf_counter()
    replies = in_threads(
        [lambda p=p: server.post("/v1/completions", {**body, "prompt": p}) for p in prompts]
    )
    seconds = time.perf_counter() - t0
    made = sum(body["usage"]["completion_tokens"] for status, body in replies if status == 200)
    return made / seconds, made


def ttft_beside_long_prefill(server: Server, long: int, rounds: int) -> tuple[float, float]:
    """(alone, while a ``long``-token prompt prefills): median seconds of a 1-token request."""
    short = lambda: completion(server, "Hello", 1)  # noqa: E731
    alone = statistics.median(latency(short) for _ in range(rounds))
    ids = [(7 * i) % 500 + 1 for i in range(long)]
    background = threading.Thread(target=lambda: completion(server, ids, 1))
    background.start()
    while server.get("/health")["running"] == 0:
        time.sleep(0.01)
    beside = [latency(short) for _ in range(rounds)]
    prefill_done = not background.is_alive()
    background.join()
    if prefill_done:
        raise RuntimeError("the long prompt finished before the short requests: raise --long")
    return alone, statistics.median(beside)


def follow_up_ttft(server: Server, system_words: int) -> dict:
    """Seconds to the first token of turn 1, of turn 2 (prefix reused), and of a
    conversation as long as turn 2 that shares no prefix with anything cached."""

    def ask(messages):
        body = {"messages": messages, "max_tokens": 1, "chat_template_kwargs": {"thinking": False}}
        t0 = time.perf_counter()
        status, reply = server.post("/v1/chat/completions", body)
        return time.perf_counter() - t0, reply

    def conversation(tag):
        system = {"role": "system", "content": f"{tag} " + "Notes on layers. " * system_words}
        return [system, {"role": "user", "content": "Summarize the notes."}]

    first = conversation("A")
    t1, r1 = ask(first)
    second = first + [
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Shorter, please."},
    ]
    t2, r2 = ask(second)
    cold = conversation("B") + second[2:]
    t3, r3 = ask(cold)
    return {
        "turn 1": (t1, r1["usage"]),
        "turn 2, prefix reused": (t2, r2["usage"]),
        "turn 2 length, no prefix cached": (t3, r3["usage"]),
    }


def load_test(server: Server, requests: int, limit_s: float) -> dict:
    """``requests`` completions from 16 threads; counts of each outcome."""
    outcomes: list[str] = []
    lock = threading.Lock()
    todo = iter(range(requests))

    def worker():
        for i in iter(lambda: next(todo, None), None):
            try:
                status, _ = server.post(
                    "/v1/completions", {"prompt": f"Load {i}", "max_tokens": 8}, limit_s
                )
                outcome = str(status)
            except OSError as e:
                outcome = f"lost ({type(e).__name__})"
            with lock:
                outcomes.append(outcome)

    t0 = time.perf_counter()
    in_threads([worker] * 16)
    counts = {k: outcomes.count(k) for k in sorted(set(outcomes))}
    counts["seconds"] = time.perf_counter() - t0
    counts["health after"] = server.get("/health")["status"]
    counts["a request after"] = completion(server, "Still there?", 2)[0]
    return counts


CLIENTS = (1, 4, 8)


class ForwardAlone:
    """The model loaded in this process as the server loads it, decoding batches with no
    server: the limit of the server's aggregate tokens/s for N clients."""

    def __init__(self, path: Path, cache_fraction: float | None, rows: int = 8):
        """``rows``: the server's ``--max-batch``, for the overflow area it sizes."""
        import kimi_k3
        from kimi_k3.streaming.store import find_streamer, overflow_for_batch

        gb = cache_gb(path, cache_fraction)
        before = os.environ.get("KIMI_K3_CACHE")
        os.environ["KIMI_K3_CACHE"] = str(cache_dir(path))  # the server's, not the user's
        try:
            self.model, self.tokenizer = kimi_k3.load(path, expert_cache_gb=gb)
        finally:
            if before is None:
                del os.environ["KIMI_K3_CACHE"]
            else:
                os.environ["KIMI_K3_CACHE"] = before
        if (streamer := find_streamer(self.model)) is not None:  # as the server sizes it
            streamer.set_overflow(overflow_for_batch(streamer, rows))

    def decode_steps(self, rows: int, tokens: int) -> list[float]:
        """Seconds of each of ``tokens`` greedy decode steps of ``rows`` client prompts on
        the engine's ``Batch``, prefill not included (``rate``'s loop)."""
        import mlx.core as mx

        from kimi_k3.serve.engine import Batch, fresh_cache, prefill

        model = self.model
        prompts = [self.tokenizer.encode(p) for p in client_prompts(rows)]
        caches = [fresh_cache(model) for _ in prompts]
        for i, p in enumerate(prompts):
            prefill(model, [caches[i]], [p[:-1]])
        batch = Batch(model)
        batch.arrange(list(range(rows)), caches.__getitem__)
        last, times = [p[-1] for p in prompts], []
        for _ in range(tokens):
            t0 = time.perf_counter()
            picks = mx.argmax(batch.step(last), axis=-1)
            mx.eval(picks, batch.state)
            last = picks.tolist()
            times.append(time.perf_counter() - t0)
        return times

    def rate(self, rows: int, tokens: int) -> float:
        """Tokens/s of ``rows`` client prompts prefilled (those of one length in one pass)
        and decoded ``tokens`` greedy steps together on the engine's ``Batch``, prefill
        included, as a client's aggregate includes it."""
        import mlx.core as mx

        from kimi_k3.serve.engine import Batch, fresh_cache, prefill

        model = self.model
        prompts = [self.tokenizer.encode(p) for p in client_prompts(rows)]
        t0 = time.perf_counter()
        caches = [fresh_cache(model) for _ in prompts]
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p), []).append(i)
        for same in by_length.values():
            prefill(model, [caches[i] for i in same], [prompts[i][:-1] for i in same])
        batch = Batch(model)
        batch.arrange(list(range(rows)), caches.__getitem__)
        last = [p[-1] for p in prompts]
        for _ in range(tokens):
            picks = mx.argmax(batch.step(last), axis=-1)
            mx.eval(picks, batch.state)
            last = picks.tolist()
        return rows * tokens / (time.perf_counter() - t0)


def throughput_table(
    server: Server, forward: ForwardAlone, tokens: int, rounds: int, warmup: int = 1
) -> str:
    """The server's aggregate tokens/s by clients beside the forward alone's by rows, in
    interleaved rounds, after ``warmup`` untimed rounds of the same calls (each batch
    size's first steps build and compile what later ones reuse, on both sides)."""
    runs = {n: [] for n in CLIENTS}
    alone = {n: [] for n in CLIENTS}
    for r in range(warmup + rounds):  # interleaved: a slow spell hits every N alike
        for n in CLIENTS:
            served = throughput(server, n, tokens, stop_ids(forward.tokenizer))
            direct = forward.rate(n, tokens)
            if r >= warmup:
                runs[n].append(served)
                alone[n].append(direct)
    base = statistics.median(tps for tps, _ in runs[1])
    base_alone = statistics.median(alone[1])
    rows = []
    for n, results in runs.items():
        tps = [t for t, _ in results]
        mid, mid_alone = statistics.median(tps), statistics.median(alone[n])
        spread = f"{min(tps):.1f}-{max(tps):.1f}"
        ratios = [t / f for t, f in zip(tps, alone[n])]  # each round's, side by side
        rows.append(
            [
                n,
                results[0][1],
                f"{mid:.1f}",
                spread,
                f"{mid / base:.2f}x",
                f"{mid_alone:.1f}",
                f"{min(alone[n]):.1f}-{max(alone[n]):.1f}",
                f"{mid_alone / base_alone:.2f}x",
                f"{statistics.median(ratios):.2f}",
                f"{min(ratios):.2f}-{max(ratios):.2f}",
            ]
        )
    header = [
        "clients",
        "tokens",
        "aggregate tok/s",
        "range",
        "vs 1 client",
        "forward alone tok/s",
        "forward range",
        "forward vs 1 row",
        "server / forward",
        "server / forward, each round",
    ]
    return markdown_table(header, rows)


def overflow_effect(forward: ForwardAlone, tokens: int, rounds: int) -> str:
    """The streamed forward alone (``forward``) at 1 and ``max(CLIENTS)`` rows with the
    overflow area the server sizes and without one (a step whose experts outnumber the
    slots reads in rounds): tokens/s, ``rounds`` rounds, the settings interleaved."""
    from kimi_k3.streaming.store import find_streamer

    streamer = find_streamer(forward.model)
    sized = streamer.stats.info["overflow_experts"]
    n = max(CLIENTS)
    settings = {f"{sized} experts (the server's default)": sized, "none (rounds)": 0}
    runs = {(name, rows): [] for name in settings for rows in (1, n)}
    for r in range(1 + rounds):  # the first round warms each setting up, untimed
        for name, experts in settings.items():
            streamer.set_overflow(experts)
            for rows in (1, n):
                rate = forward.rate(rows, tokens)
                if r:
                    runs[name, rows].append(rate)
    streamer.set_overflow(sized)
    rows = []
    for name in settings:
        one, many = (statistics.median(runs[name, r]) for r in (1, n))
        rows.append([name, f"{one:.1f}", f"{many:.1f}", f"{many / one:.2f}x"])
    header = ["overflow area", "1 row tok/s", f"{n} rows tok/s", f"{n} rows vs 1"]
    return markdown_table(header, rows)


# Where a decode step's time goes (``--profile``).

PARTS = {
    "_inputs": "inputs",
    "step": "forward graph",
    "_sample": "picking",
    "wait": "waiting on the device",
    "entries": "log-probabilities",
    "_hand_out": "handing out",
    "_keep": "snapshots",
}


class StepClock:
    """The engine's decode steps timed, and their parts: ``Engine._decode``'s wall time; the
    host time of building the forward pass (``Batch.step``), of picking (``Engine._sample``:
    the logits processors, the sampling graph), of handing the tokens out
    (``Engine._hand_out``: events to each sequence's queue, ends), of its log-probability
    lists and of snapshots; and the time blocked on the device (the picks evaluated before
    they are handed out). Methods are wrapped on the instance (and ``Pending.entries`` on
    the class, until ``close``)."""

    def __init__(self, engine):
        import mlx.core as mx

        from kimi_k3.serve import engine as serving

        self.steps: list[float] = []
        self.parts = {name: 0.0 for name in PARTS}
        self.serving, self.entries = serving, serving.Pending.entries
        for name in ("_inputs", "_sample", "_keep"):
            setattr(engine, name, self.timed(getattr(engine, name), name))
        engine.batch.step = self.timed(engine.batch.step, "step")
        decode, hand_out = engine._decode, engine._hand_out

        def timed_decode(ready):
            t0 = time.perf_counter()
            decode(ready)
            self.steps.append(time.perf_counter() - t0)

        def timed_hand_out(p):
            t0 = time.perf_counter()
            mx.eval(p.picks, *(a for _, arrays in p.logprobs for a in arrays))
            t1 = time.perf_counter()
            hand_out(p)
            self.parts["wait"] += t1 - t0
            self.parts["_hand_out"] += time.perf_counter() - t1

        engine._decode, engine._hand_out = timed_decode, timed_hand_out
        clock = self

        def entries(pending):
            t0 = time.perf_counter()
            out = list(clock.entries(pending))
            clock.parts["entries"] += time.perf_counter() - t0
            clock.parts["_hand_out"] -= time.perf_counter() - t0
            return iter(out)

        serving.Pending.entries = entries

    def timed(self, fn, name):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[name] += time.perf_counter() - t0

        return run

    def close(self):
        self.serving.Pending.entries = self.entries


def engine_steps(forward: ForwardAlone, rows: int, tokens: int, overlap: bool, logprobs):
    """A ``StepClock`` of an in-process engine (as the server makes it: the reserved-token
    mask as its batch-wide processor) decoding ``rows`` client prompts for ``tokens``
    tokens each, greedy, with no stop ids (every sequence runs its length), each asking
    for ``logprobs`` alternatives (None: none)."""
    from kimi_k3.serve.engine import Engine, Sequence
    from kimi_k3.text.tokenizer import never_sample

    engine = Engine(
        forward.model, start=False, overlap=overlap, processors=[never_sample(forward.tokenizer)]
    )
    clock = StepClock(engine)
    prompts = [forward.tokenizer.encode(p) for p in client_prompts(rows)]
    seqs = [Sequence(p, tokens, logprobs=logprobs) for p in prompts]
    for s in seqs:
        engine.submit(s)
    try:
        while engine.waiting or engine.active:
            engine._admit()
            engine.step()
    finally:
        clock.close()
    return clock


def step_profile(
    path: Path, cache_fraction: float | None, tokens: int, rounds: int, warmup: int = 1
) -> str:
    """Milliseconds a decode step of 1, 4 and 8 sequences takes: the forward alone, the
    engine with and without the overlap of the host's work and the device's, and the
    engine's host time by part (per step, medians of ``rounds`` runs after ``warmup``
    untimed ones); with 5 alternatives' log-probabilities asked too."""
    import statistics as st

    forward = ForwardAlone(path, cache_fraction)
    rows = []
    for n in CLIENTS:
        for logprobs in (None, 5):
            alone, runs = [], {False: [], True: []}
            for r in range(warmup + rounds):
                direct = st.median(forward.decode_steps(n, tokens))
                clocks = {o: engine_steps(forward, n, tokens, o, logprobs) for o in (False, True)}
                if r >= warmup:
                    alone.append(direct)
                    for o, c in clocks.items():
                        runs[o].append(c)
            row = [n, "-" if logprobs is None else logprobs, f"{st.median(alone) * 1e3:.2f}"]
            for o in (False, True):
                row.append(f"{st.median(st.median(c.steps) for c in runs[o]) * 1e3:.2f}")
            for o in (False, True):
                steps = st.median(len(c.steps) for c in runs[o])
                parts = [st.median(c.parts[name] for c in runs[o]) / steps * 1e3 for name in PARTS]
                row.append(" / ".join(f"{v:.2f}" for v in parts))
            rows.append(row)
    head = " / ".join(PARTS.values())
    header = [
        "sequences",
        "log-probabilities",
        "forward alone ms/step",
        "engine, no overlap",
        "engine, overlap",
        f"host ms/step, no overlap: {head}",
        "the same, overlap",
    ]
    return markdown_table(header, rows)


def measure(path: Path, a) -> str:
    out = []
    with Server(path, a.cache_fraction, "--prefill-step-size", a.prefill_step) as server:
        forward = ForwardAlone(path, a.cache_fraction)
        table = throughput_table(server, forward, a.tokens, a.rounds, a.warmup)
        out.append("Experts streamed:\n\n" + table)
        out.append(overflow_effect(forward, a.tokens, a.rounds))
        del forward
        alone, beside = ttft_beside_long_prefill(server, a.long, a.rounds)
        rows = [
            ["alone", f"{alone:.3f}"],
            [f"while a {a.long}-token prompt prefills", f"{beside:.3f}"],
        ]
        out.append(markdown_table(["1-token request", "seconds (median)"], rows))
        turns = follow_up_ttft(server, a.system_words)
        rows = [
            [k, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], f"{t:.3f}"]
            for k, (t, u) in turns.items()
        ]
        header = ["chat request", "prompt tokens", "reused", "first token s"]
        out.append(markdown_table(header, rows))
    with Server(path, a.cache_fraction, "--max-batch", 4, "--max-waiting", 4) as server:
        counts = load_test(server, a.requests, a.limit_s)
    rows = [[k, f"{v:.1f}" if isinstance(v, float) else v] for k, v in counts.items()]
    out.append(markdown_table([f"{a.requests} requests, 16 threads", "count"], rows))
    with Server(path, None) as server:
        table = throughput_table(server, ForwardAlone(path, None), a.tokens, a.rounds, a.warmup)
        out.append("Experts resident:\n\n" + table)
    return "\n".join(out)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny preset, small counts (tests)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per completion (throughput)")
    p.add_argument("--long", type=int, default=12000, help="tokens of the long prompt")
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="throughput rounds, and short requests timed per setting",
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed rounds before the timed ones (--quick: 0)"
    )
    p.add_argument("--system-words", type=int, default=200, help="length of the chat's system note")
    p.add_argument("--requests", type=int, default=100, help="requests in the load test")
    p.add_argument("--limit-s", type=float, default=120.0, help="time limit of one request")
    p.add_argument("--prefill-step", type=int, default=128, help="the server's prefill chunk")
    p.add_argument(
        "--cache-fraction", type=float, default=0.25, help="expert cache size, share of the experts"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="only where a decode step's time goes, in this process (no HTTP): the forward "
        "alone, the engine with and without overlap, the engine's host time by part",
    )
    p.add_argument("--out", default=None, help="also write the tables here")
    return p


def main(argv: list[str] | None = None) -> str:
    a = setup_arg_parser().parse_args(argv)
    preset = "small"
    if a.quick:
        preset, a.tokens, a.long, a.rounds, a.system_words, a.requests = "tiny", 4, 600, 1, 40, 12
        a.warmup = 0
        a.prefill_step, a.cache_fraction = 64, 0.5
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "ckpt", preset)
        if a.profile:
            tables = "\n".join(
                f"{name}:\n\n" + step_profile(path, fraction, a.tokens, a.rounds, a.warmup)
                for name, fraction in (
                    ("Experts streamed", a.cache_fraction),
                    ("Experts resident", None),
                )
            )
        else:
            tables = measure(path, a)
    head = (
        f"{preset} preset, experts streamed ({a.cache_fraction:.0%} of their bytes cached); "
        f"{timing.environment()}"
    )
    text = head + "\n\n" + tables
    timing.emit(text, a.out)
    return text


if __name__ == "__main__":
    main()
