"""The connection layer of ``python -m kimi_k3.server``: uvicorn's h11 protocol with the
limits a server exposed to clients it does not trust needs.

* A request's line and headers must arrive within ``headers`` seconds of its first byte
  (of the connection's opening, for its first request), and its body within ``body``
  seconds of its headers; past that the client gets a 408 and the connection closes. A
  connection idle between requests closes after uvicorn's keep-alive timeout.
* A client that reads nothing for ``write`` seconds while a reply waits to be sent (its
  socket's buffers full) is dropped: its reply is not held in memory, nor its connection
  open, for ever.
* At most ``max_connections`` connections are open. One more evicts the connection idle
  the longest (between requests, or still sending headers), else refuses (503) the one
  whose body has been arriving the longest; when every connection has a whole request in
  progress, the new one is answered 503 and closed.
* A request h11 cannot frame unambiguously (two different ``Content-Length`` values, an
  invalid one, two ``Host`` headers, a ``Transfer-Encoding`` other than ``chunked``) or
  whose line and headers pass ``MAX_HEADER_BYTES`` (still unfinished, or whole) is
  answered with h11's status (431 for the size) and the connection closes.
  ``Transfer-Encoding`` beside ``Content-Length``, which h11 frames by the former, is
  refused by the app (``kimi_k3.serve.app``), also closing the connection.

Each refusal is OpenAI-style JSON (``kimi_k3.serve.protocol.ApiError``); only a
connection opened and never written to, and one whose client reads nothing, close
without an answer.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kimi_k3.serve.protocol import LOG_PREFIX, ApiError, quote

log = logging.getLogger("kimi_k3.server")

MAX_HEADER_BYTES = 64 * 1024  # a request line and headers larger than this are refused
LINGER = 2.0  # seconds a refused connection reads (and drops) what the client still sends
# The kernel's send buffer of a connection (Linux doubles it): a reply is tokens of text, so
# this holds seconds of any stream, and a client that reads nothing pins this much kernel
# memory at most (not the autotuned 4 MB), until the write deadline drops it.
SEND_BUFFER = 128 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    headers: float  # seconds for a request's line and headers
    body: float  # seconds for its body, once the headers are in
    write: float  # seconds a reply may wait on a client that reads nothing
    max_connections: int


class _H11(h11.Connection):
    """h11's connection, keeping the protocol error that ended it (for the refusal). h11
    bounds what it buffers of a request not yet whole; a request line and headers that
    arrive whole in one read are measured here, so that ``MAX_HEADER_BYTES`` bounds both."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and header_bytes(event) > MAX_HEADER_BYTES:
                raise h11.RemoteProtocolError(
                    f"the request line and headers are {header_bytes(event)} bytes; the limit "
                    f"is {MAX_HEADER_BYTES}",
                    error_status_hint=431,
                )
            return event
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


def header_bytes(request: h11.Request) -> int:
    """A request's line and headers as sent, in bytes (less any optional whitespace)."""
    line = len(request.method) + len(request.target) + len(b" HTTP/1.1\r\n") + 1
    return line + sum(len(k) + len(v) + 4 for k, v in request.headers.raw_items()) + 2


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response carrying ``error``'s JSON that closes the connection."""
    body = error.json()
    lines = [
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Connection(H11Protocol):
    """One client connection (``protocol_class`` sets ``limits``)."""

    limits: ConnectionLimits

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _H11(h11.SERVER, MAX_HEADER_BYTES)
        self.phase: str | None = None  # "headers" or "body" while a deadline runs
        self.phase_since = self.loop.time()
        self.deadline = None
        self.fresh = True  # no request has started on this connection
        self.draining = False  # refused: what arrives is dropped until the close
        self.idle_since = self.loop.time()
        self.stalled = None  # the write deadline, while the client reads nothing

    # The connection bound.

    def connection_made(self, transport):
        super().connection_made(transport)
        # pause (and start the write deadline) as soon as the socket takes no more
        transport.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        if len(open_) > self.limits.max_connections and not self._evict(open_):
            self.refuse(
                ApiError(
                    503,
                    f"the server is at --max-connections {self.limits.max_connections}, each "
                    "with a request in progress; retry later",
                ),
                {"retry-after": "1"},
            )
            return
        self._watch()

    def idle(self) -> bool:
        """No request in progress: between requests, still receiving headers, or refused."""
        return self.draining or self.cycle is None or self.cycle.response_complete

    def receiving(self) -> bool:
        """Its request's body is still arriving (the app has nothing to work on yet)."""
        return not self.draining and self.phase == "body"

    def _evict(self, connections: list[Connection]) -> bool:
        """Make room: close the connection idle the longest, else refuse the one whose
        body has been arriving the longest (clients that send a byte now and then must not
        hold every connection until ``--timeout-body``); False if every one is busy."""
        others = [c for c in connections if c is not self]
        idle = [c for c in others if c.idle()]
        if idle:
            oldest = min(idle, key=lambda c: c.idle_since)
            log.info("--max-connections reached: closing the connection idle the longest")
            oldest.transport.close()
            return True
        slow = [c for c in others if c.receiving()]
        if not slow:
            return False
        oldest = min(slow, key=lambda c: c.phase_since)
        oldest.refuse(
            ApiError(
                503,
                f"the server is at --max-connections {self.limits.max_connections}, and this "
                "request's body was the slowest to arrive; retry later",
            ),
            {"retry-after": "1"},
        )
        return True

    # Deadlines for a request's headers and body.

    def data_received(self, data: bytes):
        if not self.draining:
            super().data_received(data)

    def handle_events(self):
        super().handle_events()
        self._watch()

    def on_response_complete(self):
        self.idle_since = self.loop.time()
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc):
        self._set_deadline(None)
        if self.stalled is not None:
            self.stalled.cancel()
        super().connection_lost(exc)

    # The write deadline.

    def pause_writing(self):
        super().pause_writing()
        if self.stalled is None:
            self.stalled = self.loop.call_later(self.limits.write, self._drop_stalled)

    def resume_writing(self):
        if self.stalled is not None:
            self.stalled.cancel()
            self.stalled = None
        super().resume_writing()

    def _drop_stalled(self):
        self.stalled = None
        log.info("dropped a client that read nothing for %g s (--timeout-write)", self.limits.write)
        self.transport.abort()

    def _watch(self):
        """Start or stop the deadline for what the connection is receiving."""
        if self.transport.is_closing() or self.draining:
            return
        state = self.conn.their_state
        if state is not h11.IDLE:
            self.fresh = False
        if state is h11.IDLE and (self.fresh or self.conn.trailing_data[0]):
            self._set_deadline("headers")
        elif state is h11.SEND_BODY:
            self._set_deadline("body")
        else:
            self._set_deadline(None)

    def _set_deadline(self, phase: str | None):
        if phase == self.phase:
            return
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.phase, self.phase_since = phase, self.loop.time()
        if phase is not None:
            seconds = getattr(self.limits, phase)
            self.deadline = self.loop.call_later(seconds, self._expire, phase, seconds)

    def _expire(self, phase: str, seconds: float):
        self.deadline, self.phase = None, None
        if self.transport.is_closing() or self.draining:
            return
        answering = self.cycle is not None and self.cycle.response_started
        if (
            answering
            and not self.cycle.response_complete
            or (phase == "headers" and not self.conn.trailing_data[0])
        ):
            self.transport.close()  # mid-answer, or opened and never written to
            return
        flag = "--timeout-headers" if phase == "headers" else "--timeout-body"
        self.refuse(
            ApiError(408, f"the request's {phase} did not arrive within {seconds:g} s ({flag})")
        )

    # Refusals.

    def _unsupported_upgrade_warning(self):
        """An ``Upgrade`` header (WebSocket, h2c): the request is served as plain HTTP/1.1
        (uvicorn's own warning would advise installing a WebSocket library)."""
        log.info("served a request asking to upgrade the protocol as HTTP/1.1")

    def send_400_response(self, msg: str):
        """h11 found the request malformed (uvicorn's ``msg`` says only that)."""
        error = self.conn.error
        status = error.error_status_hint if error is not None else 400
        what = str(error or msg)[:LOG_PREFIX]  # h11 may quote the request line whole
        self.refuse(ApiError(status, f"malformed HTTP request: {what}"))

    def refuse(self, error: ApiError, headers: dict[str, str] | None = None):
        """Answer ``error`` and close, whatever state the request is in. The close waits
        for the client's end (at most ``LINGER`` seconds), dropping what it still sends:
        closing with unread data would reset the connection, and the client could lose
        the answer."""
        log.info("refused (%d): %s", error.status, quote(error.message))
        self._set_deadline(None)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's answer, if any, goes nowhere
            self.cycle.message_event.set()
        self.transport.write(error_response(error, headers))
        self.draining = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER, self.transport.close)


def protocol_class(limits: ConnectionLimits) -> type[Connection]:
    """``Connection`` with ``limits``, for uvicorn's ``http`` setting."""
    return type("LimitedConnection", (Connection,), {"limits": limits})
