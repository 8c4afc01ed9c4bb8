"""``python -m kimi_k3.server``: an OpenAI-compatible HTTP server for Kimi K3.

This is mlx-lm's server (``mlx_lm.server``: its request handler, response generator, prompt
cache and SSE streaming) with this project's model provider plugged in:

- the one checkpoint given at startup is loaded with ``kimi_k3.load`` (experts resident or
  streamed) before the port opens, so a bad checkpoint fails at once with one error line;
  every request is served by it whatever ``model`` name the client sends;
- chat requests are encoded by the Kimi tokenizer's ``apply_chat_template``, which calls
  ``kimi_k3.chat.encode_chat`` (markers as special ids, message text always plain);
- requests are served one at a time: mlx-lm's batching left-pads prompts and relies on the
  model to mask the padding, and these KDA and MLA layers take no padding mask.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``"stream": true``), ``GET /v1/models``, ``GET /health``. Binds 127.0.0.1 by default.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
from functools import partial
from http.server import ThreadingHTTPServer
from pathlib import Path

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, get_system_fingerprint

from kimi_k3.checkpoint import CheckpointError
from kimi_k3.config import ConfigError
from kimi_k3.generate import (
    INTERRUPTED,
    UserError,
    add_verify_argument,
    fail,
    load_for_cli,
    resolve_model,
)

# mlx-lm server options this server does not expose, at values that fit Kimi K3.
FIXED_OPTIONS = dict(
    adapter_path=None,
    draft_model=None,
    num_draft_tokens=3,
    trust_remote_code=False,
    chat_template="",
    use_default_chat_template=False,
    decode_concurrency=1,
    prompt_concurrency=1,
    prompt_cache_bytes=None,
    kv_bits=None,
    kv_group_size=64,
    quantized_kv_start=DEFAULT_QUANTIZED_KV_START,
    pipeline=False,
)


class KimiModelProvider(ModelProvider):
    """mlx-lm's model provider holding one Kimi K3 model loaded by ``kimi_k3.load``."""

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if adapter_path is not None:
            raise ValueError("kimi_k3.server does not load adapters")
        if self.model is None:
            args = self.cli_args
            self.model, self.tokenizer = load_for_cli(args.model, args.expert_cache_gb, args.verify)
            self.model_key = (str(args.model), None, None)
            self.processor = None
            self.draft_model = None
            self.is_batchable = False
        return self.model, self.tokenizer


class KimiAPIHandler(APIHandler):
    """mlx-lm's handler; ``/v1/models`` lists the served checkpoint only."""

    def handle_models_request(self):
        self._set_completion_headers(200)
        self.end_headers()
        model = {
            "id": str(Path(self.response_generator.cli_args.model).resolve()),
            "object": "model",
            "created": self.created,
            "owned_by": "kimi_k3",
        }
        self.wfile.write(json.dumps({"object": "list", "data": [model]}).encode())
        self.wfile.flush()


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kimi_k3.server", description="An OpenAI-compatible HTTP server for Kimi K3."
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint directory (default: the built-in demo model, trained on Python source)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--expert-cache-gb",
        type=float,
        default=None,
        help="stream routed experts from disk into a cache of this many GB",
    )
    add_verify_argument(p)
    p.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="default for chat requests; a request overrides it with "
        '"chat_template_kwargs": {"thinking": false}',
    )
    p.add_argument("--max-tokens", type=int, default=512, help="default max_tokens")
    p.add_argument("--temp", type=float, default=0.0, help="default temperature")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="how many conversations' caches to keep for prefix reuse",
    )
    p.add_argument(
        "--allowed-origins",
        type=lambda x: x.split(","),
        default=["*"],
        help="comma-separated CORS origins (default: *)",
    )
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    )
    return p


def _bind(host: str, port: int) -> ThreadingHTTPServer:
    """A server bound to ``host`` (IPv4 or IPv6); its handler is set once the model is up."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("Server", (ThreadingHTTPServer,), {"address_family": family})
    return server_class((host, port), None)


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    args.chat_template_args = {"thinking": args.thinking}
    vars(args).update(FIXED_OPTIONS)
    try:
        args.model, args.expert_cache_gb = resolve_model(args.model, args.expert_cache_gb)
        provider = KimiModelProvider(args)
        provider.load("default_model")
        httpd = _bind(args.host, args.port)
    except (UserError, ConfigError, CheckpointError, OSError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return INTERRUPTED
    generator = ResponseGenerator(provider, LRUPromptCache(args.prompt_cache_size))
    httpd.RequestHandlerClass = partial(
        KimiAPIHandler, generator, system_fingerprint=get_system_fingerprint()
    )
    host, port = httpd.server_address[:2]
    print(f"serving {args.model} on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        generator.stop_and_join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
