"""``python -m kimi_k3.server`` over HTTP: the official ``openai`` client, concurrent
clients, cancellation, limits, hostile requests."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import openai
import pytest
from test_chat import NoDecode
from test_constrained import TOOLS

from kimi_k3.text.chat import encode_chat

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Is <|open|> a marker?"},
]
MODEL_ID = "k3-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt, tmp_path_factory, *flags):
    """A server on a free localhost port; returns ``(url, process, log file)``."""
    port = _free_port()
    env = {**os.environ, "KIMI_K3_CACHE": str(tmp_path_factory.mktemp("cache"))}
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    model = [] if ckpt is None else ["--model", ckpt]  # None: the embedded demo model
    argv = [*model, "--port", port, "--served-model-name", MODEL_ID, *flags]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kimi_k3.server", *map(str, argv)],
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
                    return url, proc, log
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"server did not start:\n{log.read()}")
            time.sleep(0.2)


def stop_server(proc, log):
    """Ctrl-C, as a user stops it: a clean exit, status 0."""
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    log.seek(0)
    text = log.read()
    log.close()
    assert proc.returncode == 0 and "terminate called" not in text, text[-2000:]


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory):
    url, proc, log = start_server(tiny_ckpt, tmp_path_factory, "--log-level", "INFO")
    yield url, proc, log
    stop_server(proc, log)


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def strict(tiny_ckpt, tmp_path_factory):
    """A server with small limits: one sequence at a time, none waiting, 2000 tokens
    of context, prompts of 1800 tokens at most, 20 KB bodies."""
    flags = ["--max-batch", 1, "--max-waiting", 0, "--max-context", 2000, "--max-body-mb", 0.02]
    flags += ["--max-prompt-tokens", 1800]
    url, proc, log = start_server(tiny_ckpt, tmp_path_factory, *flags)
    yield url
    stop_server(proc, log)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    from kimi_k3.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny_ckpt)


def request(url, method="POST", body=None, headers=None, raw: bytes | None = None):
    """``(status, headers (case-insensitive), parsed JSON body)`` of one request, errors
    included."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(method, parts.path, body=data, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.headers, json.loads(r.read() or b"null")
    finally:
        conn.close()


def open_stream(url: str, body: dict, events: int = 1) -> tuple[socket.socket, bytes]:
    """A raw-socket streamed request to ``/v1/chat/completions``, read until ``events``
    server-sent events have arrived; returns the open socket and what was read."""
    parts = urllib.parse.urlsplit(url)
    data = json.dumps({**body, "stream": True}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    sock.sendall(head.encode() + data)
    received = b""
    while received.count(b"data: ") < events:  # the headers may come in a packet of their own
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    return sock, received


def idle_within(url: str, seconds: float) -> bool:
    """Whether the server at ``url`` has no sequence running within ``seconds``."""
    deadline = time.monotonic() + seconds
    while request(f"{url}/health", "GET")[2]["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return request(f"{url}/health", "GET")[2]["running"] == 0


def never_stop(tok) -> dict:
    """A logit_bias that keeps the stop tokens out: only max_tokens ends the reply."""
    return {str(i): -100 for i in tok.eos_token_ids}


def chat(client, **kw):
    kw = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 8, **kw}
    return client.chat.completions.create(**kw)


# The openai client.


def test_openai_chat(client, tok):
    """Content and reasoning_content side by side; usage counts the encode_chat prompt."""
    r = chat(client)
    assert r.model == MODEL_ID
    message = r.choices[0].message
    assert isinstance(message.content, str)
    assert isinstance(message.model_extra["reasoning_content"], str)
    assert message.model_extra["reasoning_content"] or message.content
    assert r.usage.prompt_tokens == len(encode_chat(tok, MESSAGES))
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_openai_chat_stream_equals_non_stream(client):
    whole = chat(client, extra_body={"chat_template_kwargs": {"thinking": False}})
    stream = chat(
        client,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert {c.model for c in chunks} == {MODEL_ID}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_completions(client, tok):
    whole = client.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=6)
    assert whole.usage.prompt_tokens == len(tok.encode("Once upon"))
    streamed = client.completions.create(
        model=MODEL_ID, prompt="Once upon", max_tokens=6, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_chat_logprobs(client, tok):
    """Each generated token with its log-probability and its likeliest alternatives (the
    greedy choice the first of them), through the openai client."""
    r = chat(client, logprobs=True, top_logprobs=3, temperature=0, logit_bias=never_stop(tok))
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and tops[0].logprob == pytest.approx(entry.logprob)
        assert entry.token in {t.token for t in tops if t.logprob == tops[0].logprob}  # ties
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace")
    plain = chat(client, temperature=0, logit_bias=never_stop(tok))
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_completion_echo_and_logprobs_score_the_prompt(client, tok, tiny_ckpt):
    """``echo`` with ``logprobs``: the prompt's tokens first (the first without a
    logprob), each prompt token's log-probability given the ones before it, as the model
    computes it; the reply's text starts with the prompt. What lm-evaluation-harness's
    loglikelihood requests read."""
    import mlx.core as mx

    import kimi_k3

    prompt = "Once upon a time there was"
    r = client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=2, logprobs=2, echo=True, temperature=0
    )
    choice = r.choices[0]
    ids = tok.encode(prompt)
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert "".join(lp.tokens[: len(ids)]) == prompt
    assert lp.text_offset[: len(ids) + 1] == [len(tok.decode(ids[:i])) for i in range(len(ids) + 1)]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(choice.text)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    model, _ = kimi_k3.load(tiny_ckpt)  # bf16, as the server runs it
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    want = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    for j in range(1, len(ids)):
        # bf16 logits: within a few of bf16's steps at their size
        assert lp.token_logprobs[j] == pytest.approx(want[j - 1][ids[j]], rel=2e-2, abs=2e-2)
        assert len(lp.top_logprobs[j]) <= 2
    echo_only = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=2, echo=True)
    assert echo_only.choices[0].text.startswith(prompt) and echo_only.choices[0].logprobs is None


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """A server on the embedded demo model (no ``--model``)."""
    url, proc, log = start_server(None, tmp_path_factory)
    yield url
    stop_server(proc, log)


WEATHER = TOOLS[0]  # get_weather: city "Paris" or "Rome", days 1-7


def test_the_demo_model_answers_chat_in_content(demo_server):
    """The demo model has no chat training: its server does not open a thinking section,
    so a chat's text comes back as ``content``; ``--thinking`` turns that back on."""
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    status, _, reply = request(f"{demo_server}/v1/chat/completions", body=body)
    message = reply["choices"][0]["message"]
    assert status == 200 and message["content"].strip() and "reasoning_content" not in message


def test_response_format_and_tool_choice_are_enforced(demo_server, tok):
    """Grammar-constrained decoding (``kimi_k3.serve.constrained``) on a model that writes
    Python: ``json_object`` gives one JSON object, a ``json_schema`` a value of the schema,
    a named ``tool_choice`` a call of that function with arguments of its schema."""
    url = f"{demo_server}/v1/chat/completions"
    ask = [{"role": "user", "content": "def read_lines(path):"}]
    base = {"messages": ask, "max_tokens": 120, "temperature": 0}
    free = request(url, body=base)[2]["choices"][0]["message"]["content"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)
    status, _, reply = request(url, body={**base, "response_format": {"type": "json_object"}})
    choice = reply["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop", reply
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}
    status, _, reply = request(url, body={**base, "response_format": fmt})
    value = json.loads(reply["choices"][0]["message"]["content"])
    assert set(value) == {"name", "n"} and isinstance(value["n"], int)
    assert isinstance(value["name"], str) and len(value["name"]) <= 20
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {**base, "tools": [WEATHER], "tool_choice": named}
    status, _, reply = request(url, body=body)
    choice = reply["choices"][0]
    assert status == 200 and choice["finish_reason"] == "tool_calls", reply
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert args["city"] in ("Paris", "Rome") and args["days"] in range(1, 8)
    assert set(args) <= {"city", "days", "units"}


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_constraints_that_cannot_be_enforced_are_400(server, fields, param):
    body = {"messages": MESSAGES, "max_tokens": 4, **fields}
    status, _, reply = request(f"{server}/v1/chat/completions", body=body)
    assert status == 400 and reply["error"]["param"] == param, reply


def test_logprobs_and_echo_with_stream_are_400(server):
    for path, body in (
        ("chat/completions", {"messages": MESSAGES, "logprobs": True, "stream": True}),
        ("completions", {"prompt": "x", "logprobs": 0, "stream": True}),
        ("completions", {"prompt": "x", "echo": True, "stream": True}),
    ):
        status, _, reply = request(f"{server}/v1/{path}", body=body)
        assert status == 400 and reply["error"]["param"] in ("logprobs", "echo"), reply


def test_models_and_ids_agree(client):
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="gpt-4")
    assert e.value.body["code"] == "model_not_found"


# Malformed and hostile requests.

BAD_CHAT = [
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": "hi"}, "messages", "must be a list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "unknown role"),
    ({"messages": ["hi"]}, "messages[0]", "must be an object"),
    ({"messages": MESSAGES, "logit_bias": {"99999999": 1}}, "logit_bias", "not a token id"),
    ({"messages": MESSAGES, "logit_bias": {"1024": 1}}, "logit_bias", "not a token id"),
    ({"messages": MESSAGES, "logit_bias": {"-1": 1}}, "logit_bias", "not a token id"),
    ({"messages": MESSAGES, "temperature": -1}, "temperature", "from 0 to 2"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "from 1 to"),
    ({"messages": MESSAGES, "max_tokens": 10**9}, "max_tokens", "from 1 to"),
    ({"messages": MESSAGES, "n": 2}, "n", "must be 1"),
    ({"messages": MESSAGES, "stop": [1]}, "stop", "string"),
    ({"messages": MESSAGES, "seed": -1}, "seed", "an integer from 0 to"),
    ({"messages": MESSAGES, "seed": 2**64}, "seed", "an integer from 0 to"),
    ({"messages": MESSAGES, "seed": 1.5}, "seed", "an integer from 0 to"),
    ({"messages": MESSAGES, "seed": "7"}, "seed", "an integer from 0 to"),
]


@pytest.mark.parametrize("body,param,words", BAD_CHAT)
def test_bad_chat_requests_are_400(server, body, param, words):
    status, _, reply = request(f"{server}/v1/chat/completions", body=body)
    assert status == 400
    assert reply["error"]["param"] == param and words in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"


def test_prompt_token_ids_are_checked(server):
    status, _, reply = request(f"{server}/v1/completions", body={"prompt": [1, 2, 5000]})
    assert status == 400 and reply["error"]["param"] == "prompt"


def test_logit_bias_past_the_vocabulary_keeps_the_server_alive(served):
    """An id just past the vocabulary once scattered out of bounds (and far past it,
    SIGSEGV); now it is refused and the server process keeps serving."""
    url, proc, _ = served
    for tid in ("1024", "99999999"):
        body = {"messages": MESSAGES, "max_tokens": 2, "logit_bias": {tid: 1}}
        assert request(f"{url}/v1/chat/completions", body=body)[0] == 400
    body = {"messages": MESSAGES, "max_tokens": 2, "logit_bias": {"1023": 5}}
    assert request(f"{url}/v1/chat/completions", body=body)[0] == 200
    assert proc.poll() is None


def test_image_parts_are_refused_without_fetching(server):
    """The URL of an image part is never opened: nothing connects to the listener."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    part = {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/x"}}
    body = {"messages": [{"role": "user", "content": [part]}]}
    try:
        status, _, reply = request(f"{server}/v1/chat/completions", body=body)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert status == 400 and "text only" in reply["error"]["message"]
    assert str(port) not in reply["error"]["message"]


def test_host_and_origin_are_checked(server):
    url = f"{server}/v1/chat/completions"
    body = {"messages": MESSAGES, "max_tokens": 1}
    assert request(url, body=body, headers={"Host": "attacker.example:8080"})[0] == 403
    assert request(url, body=body, headers={"Origin": "http://attacker.example"})[0] == 403
    assert request(url, "OPTIONS", headers={"Origin": "http://attacker.example"})[0] == 403
    status, headers, _ = request(url, body=body, headers={"Host": "localhost"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_bad_bodies(served):
    url, _, log = served
    path = f"{url}/v1/chat/completions"
    status, _, reply = request(path, raw=b'{"messages": "\xff\xfe"}')
    assert status == 400 and "not UTF-8" in reply["error"]["message"]
    secret = "X" * 200_000
    status, _, reply = request(path, raw=("{" + secret).encode())
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    assert request(f"{url}/v1/nothing", body={})[0] == 404
    log.flush()
    with open(log.name) as f:
        assert "X" * 1000 not in f.read()  # logs quote a short prefix at most


def test_limits(strict):
    url = f"{strict}/v1/chat/completions"
    status, _, reply = request(url, raw=b"{" + b" " * 30_000 + b"}")
    assert status == 413 and "20000" in reply["error"]["message"]
    long = [{"role": "user", "content": "word " * 2500}]
    status, _, reply = request(url, body={"messages": long})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    message = reply["error"]["message"]
    assert "1800 (--max-prompt-tokens)" in message and "the prompt is 12" in message
    # a prompt within the bound is served, its reply cut to the context's room
    status, _, reply = request(
        f"{strict}/v1/completions", body={"prompt": [5] * 1800, "max_tokens": 500}
    )
    assert status == 200 and reply["usage"]["completion_tokens"] <= 200


def test_queue_full_is_429(strict, tok):
    """With one sequence running and no room to wait, a second request is told to retry.
    The first is a stream of 1900 tokens (stop tokens biased away) whose reply has begun:
    it holds the batch, whatever the machine's speed, until its client leaves."""
    first = {"messages": MESSAGES, "max_tokens": 1900, "logit_bias": never_stop(tok)}
    sock, received = open_stream(strict, first)
    with sock:
        assert received.startswith(b"HTTP/1.1 200 ")
        body = {"messages": MESSAGES, "max_tokens": 4}
        status, headers, reply = request(f"{strict}/v1/chat/completions", body=body)
        assert b"data: [DONE]" not in received + sock.recv(4096)
    assert status == 429 and headers["Retry-After"] == "1"
    assert reply["error"]["type"] == "rate_limit_error"


# Concurrency and cancellation.


def test_concurrent_clients_equal_solo_runs(client):
    """Greedy replies to four requests sent together equal the same requests sent alone."""
    prompts = ["Hello there", "Once upon a time in a land far away", "x", "Tell me about KDA"]

    def ask(p):
        return client.completions.create(model=MODEL_ID, prompt=p, max_tokens=10).choices[0].text

    solo = [ask(p) for p in prompts]
    together = [None] * len(prompts)
    threads = [
        threading.Thread(target=lambda i=i, p=p: together.__setitem__(i, ask(p)))
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == solo


def test_seed_draws_the_same_reply_alone_and_beside_others(client):
    """At temperature 1 a seeded request gets the same reply alone and while other
    requests share its decode steps; another seed gets another reply."""

    def ask(seed, prompt="Once upon"):
        extra = {} if seed is None else {"seed": seed}
        reply = client.completions.create(
            model=MODEL_ID, prompt=prompt, max_tokens=12, temperature=1.0, **extra
        )
        return reply.choices[0].text

    alone = ask(11)
    asks = [lambda: ask(11), lambda: ask(11), lambda: ask(None, "x"), lambda: ask(12)]
    together = [None] * len(asks)
    threads = [
        threading.Thread(target=lambda i=i, f=f: together.__setitem__(i, f()))
        for i, f in enumerate(asks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together[0] == together[1] == alone
    assert together[3] != alone


def test_streamed_reply_equals_the_whole_reply(client, tok):
    """A reply of 64 tokens (stop tokens biased away) streamed, parsed as it grows, adds
    up to the same reply sent whole: reasoning and content (longer replies, without a
    server: ``test_stream_deltas_add_up_to_the_whole_reply``)."""
    never = {str(i): -100 for i in tok.eos_token_ids}
    whole = chat(client, max_tokens=64, logit_bias=never)
    chunks = list(chat(client, max_tokens=64, logit_bias=never, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    message = whole.choices[0].message
    assert "".join(d.content or "" for d in deltas) == message.content
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == message.model_extra["reasoning_content"]
    assert whole.usage.completion_tokens == 64


def test_disconnect_stops_the_work(server, tok):
    """A client that goes away mid-stream frees its place in the batch (the stop tokens
    are biased away, so only the disconnect can end the reply early). The bound is
    relative to this run's speed: the first ``events`` events (each at least one token,
    prefill included) took ``took``; the other 5000 - ``events`` tokens would take at least
    ``(5000 / events - 1) * took``, and the reply must stop in a tenth of that."""
    events = 20
    body = {"messages": MESSAGES, "max_tokens": 5000, "logit_bias": never_stop(tok)}
    start = time.monotonic()
    sock, _ = open_stream(server, body, events=events)
    with sock:
        took = time.monotonic() - start
        health = request(f"{server}/health", "GET")[2]
        assert health["running"] + health["waiting"] == 1
    assert idle_within(server, (5000 / events - 1) * took / 10)


def test_follow_up_turn_reuses_the_prompt(client):
    """Turn 2 of a conversation prefills only its new tokens (usage says how many came from
    the snapshot of turn 1)."""
    first = chat(client, max_tokens=4, extra_body={"chat_template_kwargs": {"thinking": False}})
    history = MESSAGES + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    second = chat(
        client, messages=history, extra_body={"chat_template_kwargs": {"thinking": False}}
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


# Startup.


def test_port_in_use_fails_before_loading(tmp_path, capsys):
    """The port is checked first: with a model that does not exist, the port is named."""
    from kimi_k3.server import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["--model", str(tmp_path / "nowhere"), "--port", str(port)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: --host 127.0.0.1 --port {port}: the address is already in use"]


def test_the_listening_socket_is_tcp():
    """The socket names its protocol, so asyncio sets TCP_NODELAY on every connection it
    accepts (without it, a reply's second write waits for the client's delayed ACK: 44 ms
    a request on loopback)."""
    from kimi_k3.server import bind

    with bind("127.0.0.1", 0) as sock:
        assert sock.proto == socket.IPPROTO_TCP


def test_bad_model_fails_before_listening(tmp_path, capsys):
    from kimi_k3.server import main

    assert main(["--model", str(tmp_path / "nowhere"), "--port", str(_free_port())]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {tmp_path / 'nowhere'}: no such model directory"]


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--max-batch", "0"], "--max-batch"),
        (["--temp", "-1"], "--temp"),
        (["--port", "70000"], "--port"),
        (["--max-body-mb", "0"], "--max-body-mb"),
        (["--expert-cache-gb", "-1"], "--expert-cache-gb"),
        (["--expert-top-p", "1.5"], "--expert-top-p"),
        (["--expert-min-weight", "-1"], "--expert-min-weight"),
        (["--shed-misses", "2"], "--shed-misses"),
        (["--expert-overflow", "-1"], "--expert-overflow"),
        (["--max-connections", "0"], "--max-connections"),
        (["--max-connections", str(10**12)], "--max-connections"),
        (["--timeout-headers", "0"], "--timeout-headers"),
        (["--timeout-body", "nan"], "--timeout-body"),
        (["--timeout-keep-alive", "-1"], "--timeout-keep-alive"),
        (["--timeout-write", "0"], "--timeout-write"),
        (["--prefill-step-seconds", "-1"], "--prefill-step-seconds"),
        (["--prefill-step-seconds", "inf"], "--prefill-step-seconds"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens"),
    ],
)
def test_bad_flags_exit_2(argv, flag, capsys):
    from kimi_k3.server import main

    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag} ")


# Streamed replies, without a server.


@pytest.mark.parametrize("stop", [[], ["zz q"], ["q", "zz q"], ["中文", "nowhere"]])
def test_stream_deltas_add_up_to_the_whole_reply(tok, stop):
    """A 4000-token chat reply streamed id by id (``StreamChunks`` over ``ReplyText``, no
    re-decoding) gives the reasoning and content the reply parsed whole gives, with
    stop strings cutting the content as they do there."""
    from kimi_k3.serve.protocol import Job, Outcome, ReplyText, StreamChunks
    from kimi_k3.text.chat import encode_segments, split_markers

    words = "think 中文 é a b c zz " * 60
    text = f"{words}<|close|>think<|sep|><|open|>response<|sep|>{words * 3}zz q {words}"
    ids = encode_segments(tok, split_markers(text))
    assert len(ids) > 4000
    job = Job(ids, len(ids), {}, {}, stop, stream=True, include_usage=False, chat=True)
    reply, chunks, sent = ReplyText(job, NoDecode(tok)), StreamChunks(job, MODEL_ID), []
    for token in ids:
        reply.add(token)
        sent += chunks.deltas(reply)
    sent += chunks.final(Outcome(reply, "length", len(ids), 0))
    whole = ReplyText(job, tok)
    whole.ids = list(ids)
    whole.update()
    deltas = [c["choices"][0]["delta"] for c in sent if c["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == whole.content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.reasoning
    assert whole.stopped == bool(stop) and len(whole.reasoning) > 500


@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprobs_end_where_a_stop_string_cuts_the_text(tok, echo):
    """``completion_logprobs`` keeps the generated tokens up to the one that starts past the
    reply's text (a stop string cut it there), each offset the length of the text before
    it, whole characters only (a character split across tokens counts once)."""
    from kimi_k3.serve.protocol import Job, Outcome, ReplyText, completion_logprobs

    prompt = tok.encode("x =", add_special_tokens=False)
    gen = tok.encode(" 中文 and é, then STOP and more", add_special_tokens=False)
    job = Job(prompt, 64, {}, {}, ["STOP"], False, False, chat=False, logprobs=0, echo=echo)
    reply = ReplyText(job, tok)
    for t in gen:
        reply.add(t)
    assert reply.content == " 中文 and é, then " and reply.stopped
    pairs = [(-0.5, [])] * len(gen)
    out = completion_logprobs(job, Outcome(reply, "stop", len(gen), 0, gen, pairs), tok)
    n = len(prompt) if echo else 0
    text = "x =" * echo + reply.content
    kept = out["text_offset"][n:]
    assert kept[0] == len("x =") * echo and all(o < len(text) for o in kept)
    assert tok.decode(gen[: len(kept)]).startswith(reply.content)  # every token of the text
    assert not tok.decode(gen[: len(kept) - 1]).startswith(reply.content)  # and no more
    assert len(out["tokens"]) == len(out["token_logprobs"]) == len(out["text_offset"])
    assert out["text_offset"] == sorted(out["text_offset"])
