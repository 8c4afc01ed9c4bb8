"""``python -m kimi_k3.server`` over HTTP: completion, chat completion, streamed chat."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from mlx_lm import stream_generate

import kimi_k3
from kimi_k3.chat import encode_chat

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Is <|open|> a marker?"},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    """The server on a free localhost port, stopped after the module's tests."""
    port = _free_port()
    env = {**os.environ, "KIMI_K3_CACHE": str(tmp_path_factory.mktemp("cache"))}
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kimi_k3.server",
            "--model",
            str(tiny_ckpt),
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if json.load(r)["status"] == "ok":
                    break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"server did not start:\n{log.read()}")
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def local(tiny_ckpt):
    return kimi_k3.load(tiny_ckpt)


def post(url, body):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=60)


def expected(local, ids, n):
    """Greedy text and finish reason of ``ids`` run in this process."""
    text, last = "", None
    for last in stream_generate(*local, ids, max_tokens=n):
        text += last.text if last.finish_reason != "stop" else ""
    return text, last.finish_reason


def test_completion(server, local):
    with post(f"{server}/v1/completions", {"prompt": "Once upon", "max_tokens": 8}) as r:
        body = json.load(r)
    ids = local[1].encode("Once upon")
    text, reason = expected(local, ids, 8)
    choice = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert (choice["text"], choice["finish_reason"]) == (text, reason)


def test_chat_completion_is_encoded_with_encode_chat(server, local):
    """The prompt is ``encode_chat``'s ids: the typed marker stayed text."""
    body = {"messages": MESSAGES, "max_tokens": 8, "chat_template_kwargs": {"thinking": False}}
    with post(f"{server}/v1/chat/completions", body) as r:
        reply = json.load(r)
    ids = encode_chat(local[1], MESSAGES, thinking=False)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    text, reason = expected(local, ids, 8)
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == text
    assert reply["choices"][0]["finish_reason"] == reason


def test_streaming_chat_completion(server, local):
    """SSE chunks add up to the text of the same request without streaming; thinking (the
    server default) routes the reply into ``reasoning``."""
    body = {
        "messages": MESSAGES,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = []
    with post(f"{server}/v1/chat/completions", body) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                chunks.append(line[len("data: ") :])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    usage = events[-1]["usage"]
    ids = encode_chat(local[1], MESSAGES, thinking=True)
    assert usage["prompt_tokens"] == len(ids)
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    streamed = "".join(d.get("reasoning", "") + (d.get("content") or "") for d in deltas)
    assert streamed == expected(local, ids, 10)[0]
    assert any(d.get("reasoning") for d in deltas)
    assert len(deltas) > 2 and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_models_lists_the_checkpoint(server, tiny_ckpt):
    with urllib.request.urlopen(f"{server}/v1/models", timeout=10) as r:
        models = json.load(r)["data"]
    assert [m["id"] for m in models] == [str(tiny_ckpt.resolve())]


def test_bad_model_fails_before_listening(tmp_path, capsys):
    from kimi_k3.server import main

    assert main(["--model", str(tmp_path / "nowhere"), "--port", str(_free_port())]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {tmp_path / 'nowhere'}: no such model directory"]
