"""``python -m kimi_k3.server``: an OpenAI-compatible HTTP server for Kimi K3.

The port is bound first (a port in use fails before the model loads), then the one
checkpoint given is loaded with ``kimi_k3.load``; requests are served by
``kimi_k3.serve.engine.Engine`` (continuous batching, chunked prefill, prefix reuse), which
runs in the main thread while uvicorn serves HTTP from a thread of its own.

This module is the command line: flags, their checks, binding, loading, and the ranks of a
``--split`` run. The parts it puts together are in ``kimi_k3.serve``: connections
(uvicorn's h11 protocol with header and body deadlines, a bound on open connections and
JSON refusals of malformed HTTP) in ``http``; the Starlette app that checks the caller,
reads the body and hands the job to the engine in ``app``; the OpenAI protocol (pydantic
request models, replies) in ``protocol``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``"stream": true``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``.
"""

from __future__ import annotations

import argparse
import errno
import logging
import resource
import socket
import sys
import threading
from pathlib import Path

import uvicorn
from mlx.utils import tree_flatten

from kimi_k3 import distributed
from kimi_k3.checkpoint.files import CheckpointError
from kimi_k3.cli import (
    INTERRUPTED,
    USAGE_ERROR,
    ArgumentError,
    HelpFormatter,
    Parser,
    UserError,
    add_model_arguments,
    add_sampling_arguments,
    check_model_arguments,
    check_sampling_arguments,
    context_limit,
    fail,
    in_range,
    load_for_cli,
    positive,
    ram_gb,
    resolve_model,
    trimming_options,
)
from kimi_k3.model.config import ConfigError
from kimi_k3.serve.app import ServerState, allowed_hosts, app_for
from kimi_k3.serve.engine import Engine, activation_dtype, follow
from kimi_k3.serve.http import ConnectionLimits, protocol_class
from kimi_k3.serve.protocol import Limits
from kimi_k3.streaming.store import find_streamer, overflow_for_batch
from kimi_k3.text.tokenizer import never_sample

log = logging.getLogger("kimi_k3.server")

DEMO_MODEL_ID = "kimi-k3-demo"
FD_RESERVE = 128  # descriptors kept for the checkpoint's files, logs and the engine
# The longest prompt a request may send by default: long context, yet what a machine
# prefills in minutes (the demo model on the 2-core CPU machine: 30,000 tokens in about
# 3.5 minutes, docs/benchmarks.md), so that no one request holds a slot for an hour.
DEFAULT_MAX_PROMPT = 32768


# Command line.

# The server's limits: flag, type, default, help.
LIMIT_FLAGS = [
    ("--max-tokens", int, 512, "max_tokens of a request that omits it"),
    ("--max-tokens-limit", int, 8192, "the largest max_tokens a request may ask"),
    (
        "--max-context",
        int,
        None,
        "prompt + reply tokens of one request (default: the model's max_position_embeddings)",
    ),
    ("--max-body-mb", float, 1.0, "largest request body, in MB"),
    ("--max-batch", int, 8, "sequences decoded together"),
    ("--max-waiting", int, 32, "requests queued beyond the batch (then 429)"),
    ("--prefill-step-size", int, 512, "prompt tokens prefilled per step, in all"),
    (
        "--prefill-step-seconds",
        float,
        0.5,
        "a step's prompt chunks take about this long in all (a long prompt's chunk of the "
        "size whose measured pass fits), so a request arriving meanwhile waits little (0: "
        "chunks of --prefill-step-size whatever they take)",
    ),
    (
        "--max-long-prefills",
        int,
        None,
        "prompts with more than --prefill-step-size tokens to prefill that are prefilled at "
        "once (default: half of --max-batch, at least 1); one more waits, keeping its place, "
        "while shorter requests behind it take the free slots",
    ),
    (
        "--max-prompt-tokens",
        int,
        None,
        f"the longest prompt a request may send (default: {DEFAULT_MAX_PROMPT}, or less where "
        "the caches of --max-batch such prompts would not fit in a quarter of the memory the "
        "model leaves, or the context is shorter)",
    ),
    (
        "--prompt-cache-gb",
        float,
        1.0,
        "GB of cache snapshots kept for prefix reuse across requests (0: none)",
    ),
    (
        "--max-connections",
        int,
        512,
        "open connections; one more closes the one idle the longest, or is answered 503 "
        "when every one has a request in progress",
    ),
    (
        "--timeout-headers",
        float,
        10.0,
        "seconds a request's line and headers may take to arrive (then 408, closed)",
    ),
    (
        "--timeout-body",
        float,
        30.0,
        "seconds a request's body may take to arrive after its headers (then 408, closed)",
    ),
    (
        "--timeout-write",
        float,
        30.0,
        "seconds a reply may wait on a client that reads none of it (then the connection drops)",
    ),
    ("--timeout-keep-alive", float, 5.0, "seconds an idle connection stays open between requests"),
]


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m kimi_k3.server",
        description="An OpenAI-compatible HTTP server for Kimi K3.",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(p)
    p.add_argument(
        "--expert-overflow",
        type=int,
        default=None,
        help="streamed experts: experts a batch's step may read past a layer's cache slots in "
        "one round, into working memory beside the expert cache (default: what --max-batch "
        "sequences can need; 0: none, such a step reads in rounds of the slots)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; another than loopback exposes an unauthenticated server",
    )
    p.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free port)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id in /v1/models and replies (default: the checkpoint directory's "
        f"name, {DEMO_MODEL_ID!r} for the demo model)",
    )
    p.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default for chat requests (default: on; off for the demo model, which has no "
        "chat training, so its text comes back as content); a request overrides it with "
        '"chat_template_kwargs": {"thinking": false}',
    )
    for flag, kind, default, text in LIMIT_FLAGS:
        p.add_argument(flag, type=kind, default=default, help=text)
    add_sampling_arguments(p, seed=False, defaults_for="for requests without the field")
    for flag, what in (
        (
            "--allowed-origins",
            "web origins allowed to call the server (CORS); '*' for any (default: none)",
        ),
        (
            "--allowed-hosts",
            "extra host names a request's Host header may name (default: "
            "the bound address; localhost too for a loopback bind)",
        ),
    ):
        p.add_argument(flag, type=comma_list, default=[], help=f"comma-separated {what}")
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level",
    )
    distributed.add_arguments(p)
    return p


def comma_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def check_arguments(args):
    """``ArgumentError`` naming the flag of the first invalid value."""
    check_model_arguments(args)
    check_sampling_arguments(args)
    for name in (
        "max_tokens",
        "max_tokens_limit",
        "max_context",
        "max_batch",
        "prefill_step_size",
        "max_prompt_tokens",
        "max_long_prefills",
        "max_connections",
    ):
        positive(args, name)
    if args.max_tokens > args.max_tokens_limit:
        raise ArgumentError(
            f"--max-tokens {args.max_tokens} is above --max-tokens-limit {args.max_tokens_limit}"
        )
    for name in ("prefill_step_seconds", "max_waiting", "prompt_cache_gb", "expert_overflow"):
        in_range(args, name, 0)
    in_range(args, "port", 0, 65535)
    timeouts = ("timeout_headers", "timeout_body", "timeout_write", "timeout_keep_alive")
    for name in ("max_body_mb", *timeouts):
        in_range(args, name, 0, low_open=True)


def reserve_descriptors(max_connections: int):
    """Raise the soft limit on open files to what ``--max-connections`` needs (with
    ``FD_RESERVE`` to spare); ``UserError`` if the hard limit is below it."""
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ArgumentError(
                f"--max-connections {max_connections} needs {need} open files, but this "
                f"process may open {hard} at most (its hard limit, which importing mlx-lm "
                "sets to 4096); lower --max-connections"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (IPv4 or IPv6); ``UserError`` naming both if
    the address cannot be bound. uvicorn serves it once the model is up."""
    sock = None
    try:
        family, kind, proto = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][:3]
        # proto named (TCP): asyncio then sets TCP_NODELAY on each connection, so a reply's
        # body or a stream's event is not held back waiting for the client's delayed ACK
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        return sock
    except OSError as e:
        if sock is not None:
            sock.close()
        why = (
            "is already in use"
            if e.errno == errno.EADDRINUSE
            else f"cannot be bound ({e.strerror or e})"
        )
        raise UserError(f"--host {host} --port {port}: the address {why}") from None


def size_overflow(model, args):
    """Give streamed experts the overflow area ``--expert-overflow`` asks for (default: what
    ``--max-batch`` sequences can need, ``overflow_for_batch``), announced on stderr."""
    streamer = find_streamer(model)
    if streamer is None:
        return
    n = args.expert_overflow
    streamer.set_overflow(overflow_for_batch(streamer, args.max_batch) if n is None else n)
    info = streamer.stats.info
    if info["overflow_experts"]:
        print(
            f"expert overflow area: {info['overflow_experts']} experts "
            f"({info['overflow_bytes'] / 1e6:.3g} MB) beside the cache",
            file=sys.stderr,
        )


def cache_bytes_per_token(model) -> int:
    """Bytes one token adds to a sequence's caches: each MLA layer's latent and shared key
    in the activation dtype (KDA layers hold a fixed state, whatever the length)."""
    a = model.args
    mla = sum(not layer.is_linear for layer in model.layers)
    return mla * (a.kv_lora_rank + a.qk_rope_head_dim) * activation_dtype(model).size


def default_max_prompt(model, context: int, sequences: int, expert_cache_gb) -> tuple[int, str]:
    """``DEFAULT_MAX_PROMPT``, or less: the longest prompt whose caches fit, for
    ``sequences`` sequences at once, in a quarter of the memory that the model's resident
    weights and expert cache leave, at least 1, or one less than ``context`` (the reply
    needs a token); with the reason, for the startup line."""
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    left = ram_gb() * 1e9 - weights - (expert_cache_gb or 0) * 1e9
    fit = max(1, int(max(left, 0) / 4 / sequences / max(cache_bytes_per_token(model), 1)))
    return min(
        (DEFAULT_MAX_PROMPT, "the default"),
        (fit, f"a quarter of the memory the model leaves, over {sequences} sequences"),
        (context - 1, "the context, less a token for the reply"),
    )


def serve_model(args, sock: socket.socket, plan=None) -> ServerState:
    """Load the model and start the engine for an already bound server (on rank 0 of
    ``plan``'s group under ``--split``)."""
    model_path = args.model
    args.model, args.expert_cache_gb = resolve_model(args.model, args.expert_cache_gb)
    model, tokenizer = load_for_cli(
        args.model, args.expert_cache_gb, args.verify, plan=plan, **trimming_options(args)
    )
    size_overflow(model, args)
    engine = Engine(
        model,
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        prefill_step_size=args.prefill_step_size,
        reuse_bytes=int(args.prompt_cache_gb * 1e9),
        start=False,
        group=plan.group if plan else None,
        processors=[never_sample(tokenizer)],
        prefill_step_seconds=args.prefill_step_seconds or None,
        max_long_prefills=args.max_long_prefills,
    )
    context = context_limit(model, args.max_context)[0]
    max_prompt, why = args.max_prompt_tokens, "--max-prompt-tokens"
    if max_prompt is None:
        max_prompt, why = default_max_prompt(model, context, args.max_batch, args.expert_cache_gb)
    print(f"prompts of at most {max_prompt:,} tokens ({why})", file=sys.stderr)
    limits = Limits(
        max_prompt=max_prompt,
        context=context,
        vocab=model.args.vocab_size,
        max_tokens=args.max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        thinking=args.thinking if args.thinking is not None else model_path is not None,
    )
    name = args.served_model_name or (Path(model_path).name if model_path else DEMO_MODEL_ID)
    return ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_id=name,
        limits=limits,
        max_body=int(args.max_body_mb * 1e6),
        allowed_hosts=allowed_hosts(sock.getsockname()[0], args.allowed_hosts),
        allowed_origins=set(args.allowed_origins),
    )


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    try:
        check_arguments(args)
    except UserError as e:
        return fail(str(e), USAGE_ERROR)
    try:
        reserve_descriptors(args.max_connections)
        plan = distributed.from_args(args)
        if plan is not None and plan.rank != 0:
            return follow_rank(args, plan)
        with distributed.agreed(plan):  # a port in use ends every rank, before loading
            sock = bind(args.host, args.port)
        state = serve_model(args, sock, plan)
    except (UserError, ConfigError, CheckpointError, OSError, distributed.DistributedError) as e:
        return fail(str(e), USAGE_ERROR if isinstance(e, ArgumentError) else 1)
    except KeyboardInterrupt:
        return INTERRUPTED
    server = http_server_for(args, state)
    host, port = sock.getsockname()[:2]
    print(f"serving {state.model_id!r} on http://{host}:{port}", file=sys.stderr, flush=True)
    http_thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="kimi-k3-http", daemon=True
    )
    http_thread.start()
    try:
        state.engine.run()  # in the main thread, until Ctrl-C
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = server.force_exit = True  # requests in progress are dropped
        http_thread.join(timeout=30)
        sock.close()
        state.engine.release_peers()
    return 0


def http_server_for(args, state: ServerState):
    """uvicorn serving ``state``'s app with the connection limits of ``args``."""
    limits = ConnectionLimits(
        headers=args.timeout_headers,
        body=args.timeout_body,
        write=args.timeout_write,
        max_connections=args.max_connections,
    )
    config = uvicorn.Config(
        app_for(state),
        http=protocol_class(limits),
        loop="asyncio",
        lifespan="off",
        log_config=None,
        access_log=False,  # Guard logs each request, its path quoted short
        proxy_headers=False,
        ws="none",  # no WebSocket upgrades: every connection stays on Connection
        timeout_keep_alive=args.timeout_keep_alive,
        server_header=False,
    )
    return uvicorn.Server(config)


def follow_rank(args, plan) -> int:
    """A rank other than 0 under ``--split``: load its share, agree on the port, then
    repeat rank 0's forward passes (``kimi_k3.serve.engine.follow``) until rank 0 stops."""
    with distributed.agreed(plan):  # rank 0 binds the port here
        pass
    path, budget = resolve_model(args.model, args.expert_cache_gb)
    model, _ = load_for_cli(path, budget, args.verify, plan, **trimming_options(args))
    size_overflow(model, args)
    try:
        follow(model, plan.group)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
