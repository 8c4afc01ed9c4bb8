"""Grammars compiled first in a child process, so that a grammar that crashes the compiler,
or takes too long or too much memory to compile, fails its own request and nothing else.

llguidance compiles a grammar recursively: a JSON schema nested deep enough (through
``$ref`` chains, say) overflows the compiling thread's stack and the process dies with
SIGSEGV. ``GrammarChecker`` hands each grammar to a worker process
(``python -m kimi_k3.serve.grammar_check``) first, which compiles it in a thread with a
stack of ``WORKER_STACK`` bytes (smaller than any thread of the server's: 8 MB on Linux,
16 MB on macOS), under an address-space limit of ``COMPILE_MEMORY`` bytes (Linux), within
``COMPILE_SECONDS``, and computes its first token mask (a grammar whose language is empty,
a schema no JSON value satisfies, fails there). A grammar the worker compiled is then safe
to compile in the server; one that crashed the worker, ran past the time or memory, or
failed is refused (the caller names its field), and a fresh worker takes the next.

The worker reads one JSON line per request on stdin and writes one per answer on stdout:
first ``{"tokenizer": <tokenizers JSON>, "eos": [ids]}`` (answered ``{"ready": true}``),
then ``{"grammar": <Lark text>}`` (answered ``{"error": null}`` or ``{"error": "..."}``).
It exits at the end of its input, so it never outlives the server.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import select
import signal
import subprocess
import sys
import threading
import time

WORKERS = 2  # grammars checked at once; more wait for a free worker
COMPILE_SECONDS = 10.0  # one grammar's compile and first mask
COMPILE_MEMORY = 4 << 30  # the worker's address space, bytes (Linux enforces it)
WORKER_STACK = 2 << 20  # the compiling thread's stack, bytes
START_SECONDS = 120.0  # a worker's start: Python, llguidance and the tokenizer
MESSAGE_CHARS = 300  # the longest error message passed on
WORKER_MODULE = "kimi_k3.serve.grammar_check"


def bounded(text: str, limit: int = MESSAGE_CHARS) -> str:
    """``text``'s first line, at most ``limit`` characters (llguidance's errors may go on
    to quote the whole grammar)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def parser_limits(llguidance):
    """llguidance's default limits, with errors that do not quote the grammar."""
    return llguidance.LLParserLimits(verbose_errors=False)


# The worker process.


def compile_error(llguidance, tokenizer, grammar: str) -> str | None:
    """Why ``grammar`` cannot constrain a reply (llguidance's error, or a first mask that
    allows nothing), or None."""
    matcher = llguidance.LLMatcher(
        tokenizer, grammar, log_level=0, limits=parser_limits(llguidance)
    )
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        error = matcher.get_error()
        if "NoExtensionBias" in error or not error.strip():
            return "no text satisfies it (a schema that no JSON value matches, say)"
        return bounded(error)
    return None


def worker_main(memory: int, stack: int) -> int:
    """The worker: answer requests on stdin until it ends (see the module docstring)."""
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    except (ValueError, OSError):  # macOS does not enforce an address-space limit
        pass
    import llguidance

    threading.stack_size(stack)
    tokenizer = None
    for line in sys.stdin:
        request = json.loads(line)
        if "tokenizer" in request:
            tokenizer = llguidance.LLTokenizer(request["tokenizer"], eos_token=request["eos"])
            answer = {"ready": True}
        else:
            result = {}

            def run(grammar=request["grammar"], result=result, tokenizer=tokenizer):
                result["error"] = compile_error(llguidance, tokenizer, grammar)

            thread = threading.Thread(target=run)  # with the small stack set above
            thread.start()
            thread.join()
            answer = {"error": result["error"]}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


# The server's side.


class WorkerFailed(Exception):
    """The worker died or ran out of time; its message says which."""


class Worker:
    """One worker process, started on first use and again after it dies."""

    def __init__(self, header: bytes, memory: int):
        self.header, self.memory = header, memory
        self.proc: subprocess.Popen | None = None
        self.pending = b""

    def _start(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, str(self.memory), str(WORKER_STACK)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.pending = b""
        try:
            self._ask(self.header, START_SECONDS, "start")
        except WorkerFailed as e:  # the server's failure, not a request's
            raise RuntimeError(f"the grammar checker did not start: {e}") from None

    def stop(self):
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                pipe.close()
            self.proc = None

    def check(self, grammar: str, seconds: float) -> str | None:
        """llguidance's error for ``grammar`` (None: it compiles and has a first mask);
        ``WorkerFailed`` if the worker died on it or ran past ``seconds``."""
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
        line = json.dumps({"grammar": grammar}).encode() + b"\n"
        return self._ask(line, seconds, "compile")["error"]

    def _ask(self, line: bytes, seconds: float, what: str) -> dict:
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._failed(what, seconds)
        deadline = time.monotonic() + seconds
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self._failed(what, seconds, timed_out=True)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._failed(what, seconds)
            self.pending += chunk
        answer, _, self.pending = self.pending.partition(b"\n")
        return json.loads(answer)

    def _failed(self, what: str, seconds: float, timed_out: bool = False):
        if timed_out:
            self.stop()
            raise WorkerFailed(f"its {what} took more than {seconds:g} s")
        self.proc.wait()
        code = self.proc.returncode
        self.stop()
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            raise WorkerFailed(
                f"its {what} crashed the grammar compiler ({name}: too deep or too large)"
            )
        raise WorkerFailed(f"its {what} ended the grammar compiler (exit status {code})")


class GrammarChecker:
    """Checks grammars for one tokenizer in ``workers`` worker processes (see the module
    docstring). ``tokenizer_json``: the tokenizers library's JSON of the tokenizer;
    ``eos``: the ids that end a reply."""

    def __init__(
        self,
        tokenizer_json: str,
        eos: list[int],
        workers: int = WORKERS,
        seconds: float = COMPILE_SECONDS,
        memory: int = COMPILE_MEMORY,
    ):
        header = json.dumps({"tokenizer": tokenizer_json, "eos": list(eos)}).encode() + b"\n"
        self.seconds = seconds
        # the worker used last first: one started is reused, another starts only for a
        # grammar that comes while every started one is busy
        self.free: queue.LifoQueue[Worker] = queue.LifoQueue()
        for _ in range(workers):
            self.free.put(Worker(header, memory))

    def check(self, grammar: str) -> str | None:
        """Why ``grammar`` cannot constrain a reply (llguidance's error, a first mask that
        allows nothing, or a worker that crashed or ran out of time on it), or None."""
        worker = self.free.get()
        try:
            return worker.check(grammar, self.seconds)
        except WorkerFailed as e:
            return f"refused: {e}"
        finally:
            self.free.put(worker)

    def close(self):
        """Stop the workers (they also stop at the end of the server: their input ends)."""
        while not self.free.empty():
            self.free.get().stop()


if __name__ == "__main__":
    sys.exit(worker_main(int(sys.argv[1]), int(sys.argv[2])))
