"""``python -m kimi_k3.server`` at the HTTP level, over raw sockets: header, body and
keep-alive deadlines (slowloris), the bound on open connections, ambiguous framing
(request smuggling), malformed bodies and fields the server does not implement. Every
refusal is a 4xx (or 503) OpenAI-style JSON error, or a close after a deadline."""

import http.client
import json
import select
import socket
import time
import urllib.parse

import pytest
from test_server import (
    MESSAGES,
    idle_within,
    never_stop,
    open_stream,
    request,
    start_server,
    stop_server,
)

# Short deadlines so the tests wait little; three connections at most.
TIGHT = ["--timeout-headers", 1, "--timeout-body", 1, "--timeout-keep-alive", 1]
TIGHT += ["--timeout-write", 1]
MAX_CONNECTIONS = 3
HANG = 60  # seconds a socket read may wait before the test fails instead of hanging
APP = "http://app.example"  # the one web origin allowed


@pytest.fixture(scope="module")
def tight(tiny_ckpt, tmp_path_factory):
    flags = [*TIGHT, "--max-connections", MAX_CONNECTIONS, "--log-level", "INFO"]
    flags += ["--allowed-origins", APP]
    url, proc, log = start_server(tiny_ckpt, tmp_path_factory, *flags)
    yield url, proc, log
    stop_server(proc, log)


@pytest.fixture(scope="module")
def server(tight):
    return tight[0]


def connect(url: str) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=HANG)


def host(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


def response(sock: socket.socket):
    """``(status, headers, parsed JSON body)`` of the next response on ``sock``."""
    r = http.client.HTTPResponse(sock)
    r.begin()
    return r.status, r.headers, json.loads(r.read())


def select_readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def closed(sock: socket.socket) -> bool:
    """The server closed ``sock`` (its read ends), with nothing more sent."""
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def refused(sock: socket.socket, status: int, words: str) -> dict:
    """The response on ``sock`` is ``status`` with an OpenAI-style error naming
    ``words``, and the server closed the connection after it."""
    got, headers, body = response(sock)
    assert got == status, body
    assert headers["Content-Type"] == "application/json"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert words in body["error"]["message"], body
    assert closed(sock)
    return body["error"]


def post(url: str, body: bytes, extra: str = "", path: str = "/v1/chat/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host(url)}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


# Deadlines.


def test_slowloris_headers_get_408_and_close(server):
    """Headers sent a byte at a time never finish: the server answers 408 and closes
    long before the client would have sent them all."""
    with connect(server) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host(server)}\r\n".encode())
        header = b"X-Padding: " + b"a" * 2000
        for i, byte in enumerate(header):  # noqa: B007 (i is read after the loop)
            try:
                sock.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.02)
            if select_readable(sock):
                break
        assert i < len(header) - 1, "the server waited for every header byte"
        refused(sock, 408, "--timeout-headers")


def test_silent_connection_is_closed(server):
    """A connection opened and never written to is closed at the header deadline."""
    with connect(server) as sock:
        assert closed(sock)


def test_slow_body_gets_408_and_close(server):
    with connect(server) as sock:
        sock.sendall(post(server, b'{"messages": [')[:-2])  # the body's last bytes never come
        refused(sock, 408, "--timeout-body")


def test_idle_keep_alive_connection_is_closed(server):
    """A connection kept alive after a reply is closed once idle past the keep-alive
    deadline."""
    with connect(server) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host(server)}\r\n\r\n".encode())
        status, headers, body = response(sock)
        assert status == 200 and body["status"] == "ok"
        assert "close" not in headers.get("Connection", "")
        assert closed(sock)


def test_a_client_that_reads_nothing_is_dropped(tight, tok):
    """A stream whose client reads nothing (a small receive window) fills the server's
    buffers; past --timeout-write the server drops the connection, so the client never
    gets the whole reply however long it reads afterwards."""
    url, _, log = tight
    body = {"messages": MESSAGES, "max_tokens": 4000, "stream": True}
    data = post(url, json.dumps({**body, "logit_bias": never_stop(tok)}).encode())
    parts = urllib.parse.urlsplit(url)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(HANG)
        sock.connect((parts.hostname, parts.port))
        sock.sendall(data)
        deadline = time.monotonic() + HANG
        while "--timeout-write" not in open(log.name).read() and time.monotonic() < deadline:
            time.sleep(0.1)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    assert received.startswith(b"HTTP/1.1 200 ")
    assert b"data: [DONE]" not in received


# The bound on open connections.


def test_idle_connections_do_not_lock_out_new_ones(server):
    """Far more idle connections than --max-connections: each new one evicts the one idle
    the longest, so /health is still answered and the idle ones beyond the bound were
    closed."""
    idle = [connect(server) for _ in range(10 * MAX_CONNECTIONS)]
    try:
        status, _, body = request(f"{server}/health", "GET")
        assert status == 200 and body["status"] == "ok"
        evicted = sum(closed(s) for s in idle[: -MAX_CONNECTIONS + 1])
        assert evicted == len(idle) - MAX_CONNECTIONS + 1
    finally:
        for s in idle:
            s.close()


def test_connections_all_busy_get_503(server, tok):
    """With every connection streaming a reply, one more is answered 503 JSON and closed;
    once they end, requests are served again."""
    body = {"messages": MESSAGES, "max_tokens": 4000, "logit_bias": never_stop(tok)}
    busy = []
    try:
        for _ in range(MAX_CONNECTIONS):  # each reply has begun
            busy.append(open_stream(server, body)[0])
        with connect(server) as extra:
            error = refused(extra, 503, "--max-connections")
            assert error["type"] == "server_error"
    finally:
        for sock in busy:
            sock.close()
    assert idle_within(server, HANG)


def test_slow_bodies_do_not_lock_out_new_clients(server):
    """Every connection has sent its headers and one byte of its body: a new client is
    served at once, the connection whose body has been arriving the longest refused 503
    (--timeout-body would free them only after its deadline)."""
    head = post(server, b"{" + b" " * 99)[:-99]  # the headers and the body's first byte
    slow = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = connect(server)
            sock.sendall(head)
            slow.append(sock)
        time.sleep(0.2)  # their headers are read: each is in its body
        status, _, body = request(f"{server}/health", "GET")
        assert status == 200 and body["status"] == "ok"
        error = refused(slow[0], 503, "--max-connections")
        assert "slowest to arrive" in error["message"]
    finally:
        for sock in slow:
            sock.close()


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    from kimi_k3.text.tokenizer import load_tokenizer

    return load_tokenizer(tiny_ckpt)


# Framing (request smuggling).

SMUGGLED = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    "headers,status,words",
    [
        ("Content-Length: 2\r\nContent-Length: 3\r\n", 400, "conflicting Content-Length"),
        ("Content-Length: \u00b2\r\n", 400, "bad Content-Length"),
        ("Content-Length: +2\r\n", 400, "bad Content-Length"),
        ("Content-Length: 2\r\nTransfer-Encoding: chunked\r\n", 400, "ambiguous framing"),
        ("Transfer-Encoding: gzip, chunked\r\n", 501, "Transfer-Encoding"),
        ("Host: other.example\r\nContent-Length: 2\r\n", 400, "multiple Host"),
        ("Transfer-Encoding: chunked\r\n", 411, "Content-Length header is required"),
    ],
)
def test_ambiguous_framing_is_refused_and_closed(server, headers, status, words):
    """Each is refused with JSON and the connection closes: the request behind it on the
    same connection (what a smuggler hides in the body) is never answered."""
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host(server)}\r\n{headers}\r\n"
    with connect(server) as sock:
        sock.sendall(head.encode("utf-8") + b"0\r\n\r\n" + SMUGGLED)
        refused(sock, status, words)


def test_one_content_length_repeated_is_that_length(server):
    """``Content-Length: 2`` twice frames the body one way only (RFC 9110 lets a server
    read it as one value): the request is served, and the next on the connection too."""
    body = b"{}"
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host(server)}\r\nContent-Length: 2\r\n"
    with connect(server) as sock:
        sock.sendall(head.encode() + b"Content-Length: 2\r\n\r\n" + body)
        status, _, reply = response(sock)
        assert status == 400 and reply["error"]["param"] == "prompt"  # the body was {}
        # the next request on the connection starts right after those 2 bytes (sent once the
        # first answer is read: ``response`` reads through a buffer that would also take the
        # next answer's bytes)
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host(server)}\r\n\r\n".encode())
        assert response(sock)[0] == 200


def test_oversized_headers_are_refused(server):
    with connect(server) as sock:
        big = "X-Big: " + "a" * 70_000  # the headers never end
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host(server)}\r\n{big}".encode())
        refused(sock, 431, "malformed HTTP request")


def test_a_header_line_over_the_limit_is_refused_when_it_arrives_whole(server):
    """A request whose 100 KB header line arrives whole in one read (h11 bounds only what
    it buffers of a request not yet whole) is refused too."""
    with connect(server) as sock:
        big = "X-Big: " + "a" * 100_000
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host(server)}\r\n{big}\r\n\r\n".encode())
        error = refused(sock, 431, "the limit is 65536")
        assert len(error["message"]) < 300


def test_unknown_path_and_method_are_json(server):
    status, _, body = request(f"{server}/v1/nothing", body={})
    assert status == 404 and "no such path" in body["error"]["message"]
    status, _, body = request(f"{server}/v1/chat/completions", "GET")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"
    status, _, body = request(f"{server}/v1/models/", "GET")  # a trailing slash is the same
    assert status == 200 and body["object"] == "list"


def test_an_allowed_origin_gets_cors_headers(server):
    status, headers, _ = request(
        f"{server}/v1/chat/completions", "OPTIONS", headers={"Origin": APP}
    )
    assert status == 204 and headers["Access-Control-Allow-Origin"] == APP
    assert "POST" in headers["Access-Control-Allow-Methods"]
    status, headers, _ = request(f"{server}/health", "GET", headers={"Origin": APP})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == APP
    other = {"Origin": "http://other.example"}
    status, headers, body = request(f"{server}/health", "GET", headers=other)
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    assert "--allowed-origins" in body["error"]["message"]


# Malformed bodies: each a 400 JSON error, the server still serving.

DEEP = "[" * 985 + "]" * 985


@pytest.mark.parametrize(
    "raw,words",
    [
        ('{"messages": ' + DEEP + "}", "recursion limit"),
        ('{"messages": [], "seed": ' + "9" * 4400 + "}", "number out of range"),
        ('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_malformed_json_is_400(tight, raw, words):
    url, proc, _ = tight
    status, _, body = request(f"{url}/v1/chat/completions", raw=raw.encode())
    assert status == 400 and words in body["error"]["message"], body
    assert proc.poll() is None
    assert request(f"{url}/health", "GET")[0] == 200


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "1_0", " 5", "1e3", "0x10"])
def test_logit_bias_keys_are_ascii_token_ids(server, key):
    """Keys Python's int() would read (superscript and Arabic-Indic digits, underscores,
    spaces) or that are not decimal are refused, naming logit_bias."""
    body = {"messages": MESSAGES, "max_tokens": 1, "logit_bias": {key: 1}}
    status, _, reply = request(f"{server}/v1/chat/completions", body=body)
    assert status == 400 and reply["error"]["param"] == "logit_bias", reply
    assert "not a token id" in reply["error"]["message"]


# Fields: unknown or not implemented, refused by name; the implemented values accepted.

UNSUPPORTED_CHAT = [
    ("response_format", "json"),
    ("tool_choice", "any"),
    ("parallel_tool_calls", False),
    ("top_logprobs", 2),  # without logprobs: true
    ("n", 2),
    ("functions", [{"name": "f"}]),
    ("store", True),
    ("temperatur", 0.5),
]


@pytest.mark.parametrize("name,value", UNSUPPORTED_CHAT)
def test_chat_fields_not_implemented_are_400(server, name, value):
    body = {"messages": MESSAGES, "max_tokens": 1, name: value}
    status, _, reply = request(f"{server}/v1/chat/completions", body=body)
    assert status == 400, reply
    assert reply["error"]["param"] == name and name in reply["error"]["message"]


UNSUPPORTED_COMPLETION = [
    ("best_of", 2),
    ("suffix", "tail"),
    ("logprobs", 6),  # at most 5, as OpenAI's API
    ("prompt_logprobs", 1),
]


@pytest.mark.parametrize("name,value", UNSUPPORTED_COMPLETION)
def test_completion_fields_not_implemented_are_400(server, name, value):
    body = {"prompt": "Once upon", "max_tokens": 1, name: value}
    status, _, reply = request(f"{server}/v1/completions", body=body)
    assert status == 400, reply
    assert reply["error"]["param"] == name and name in reply["error"]["message"]


def test_a_prompt_in_a_list_of_one_is_that_prompt(server):
    """OpenAI's completions take a list of prompts; a list of one (a string, or a list of
    ids, as lm-evaluation-harness sends them) is that prompt, more than one is refused."""
    url = f"{server}/v1/completions"
    base = {"max_tokens": 2, "temperature": 0}
    plain = request(url, body={**base, "prompt": [5, 6, 7]})[2]["choices"][0]["text"]
    status, _, reply = request(url, body={**base, "prompt": [[5, 6, 7]]})
    assert status == 200 and reply["choices"][0]["text"] == plain
    status, _, reply = request(url, body={**base, "prompt": [[5, 6], [7]]})
    assert status == 400 and reply["error"]["param"] == "prompt"
    assert "2 prompts" in reply["error"]["message"]


def test_tool_choice_none_with_tools_is_400(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    body = {"messages": MESSAGES, "max_tokens": 1, "tools": [tool], "tool_choice": "none"}
    status, _, reply = request(f"{server}/v1/chat/completions", body=body)
    assert status == 400 and reply["error"]["param"] == "tool_choice"


def test_values_that_ask_for_what_the_server_does_are_accepted(server):
    """The default of each field the server does not otherwise implement is accepted, with
    the reply it gives without them."""
    base = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    defaults = {
        "response_format": {"type": "text"},
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "logprobs": False,
        "n": 1,
        "user": "someone",
    }
    plain = request(f"{server}/v1/chat/completions", body=base)
    status, _, reply = request(f"{server}/v1/chat/completions", body={**base, **defaults})
    assert status == 200 and plain[0] == 200
    assert reply["choices"][0]["message"] == plain[2]["choices"][0]["message"]
    body = {"prompt": "Once upon", "max_tokens": 3, "echo": False, "best_of": 1}
    status, _, reply = request(f"{server}/v1/completions", body=body)
    assert status == 200 and reply["usage"]["completion_tokens"] == 3


def test_refusals_are_logged_without_tracebacks(tight):
    """The malformed requests above leave log lines, never a traceback."""
    url, _, log = tight
    with connect(url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
        refused(sock, 400, "multiple Host")
    log.flush()
    with open(log.name) as f:
        text = f.read()
    assert "refused (400)" in text and "Traceback" not in text


def test_an_upgrade_request_is_served_as_http_1_1(server):
    """No WebSocket (or h2c) upgrade: the request is answered as plain HTTP/1.1, within
    the same deadlines and bound as any other."""
    upgrade = (
        "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    )
    with connect(server) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host(server)}\r\n{upgrade}\r\n".encode())
        status, _, body = response(sock)
    assert status == 200 and body["status"] == "ok"
