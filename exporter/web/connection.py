"""One HTTP/1.1 connection on the server's event loop: an asyncio Protocol and its deadlines.

The connection is a small state machine (:class:`Phase`). Bytes go to the sans-I/O
``http1.Connection``; a whole request head goes to the server (:class:`Service`), which answers at
once (the fast path: pre-rendered ``/metrics``, an auth cache hit) or later from a worker thread
(``done``). Meanwhile, and while a response is not all handed to the kernel, the connection reads
nothing more (``pause_reading``), so a client that pipelines without reading makes the server hold
one response and one read, not more.

TLS is a layer inside the connection (:class:`TlsLayer`: an ``ssl.SSLObject`` over memory BIOs
on the plain transport), not asyncio's TLS transport: the handshake runs under the head's
deadline from accept, and a refused handshake still sends its alert (a client certificate from
an unknown CA is told so, not just cut off).

Deadlines: one timer per connection, moved lazily (a later deadline only updates a field; the
timer, when it fires early, sets itself again), so a keep-alive request costs no timer work.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from exporter.web.http1 import Connection, HttpError, Limits, Request
from exporter.web.stats import HttpStats

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Where a connection is, and what its deadline means."""

    HEAD = "a request head is arriving: 408 at the deadline"
    IDLE = "between requests: closed without a word at the deadline"
    BUSY = "a request is being answered: no deadline"
    WRITE = "a response is being sent: cut off at the deadline"
    LINGER = "half-closed after the last response: closed at the deadline"
    CLOSED = "closed"


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase may take (see the server's module docstring)."""

    head: float
    keepalive: float
    write: float
    error_write: float
    linger: float
    linger_bytes: int


@dataclass
class Reply:
    """A response to send: status, reason, headers (Content-Length among them), body parts.

    ``path`` is counted in ``gpu_exporter_http_requests_total`` (None: not a request, as a
    refused head). ``close``: the connection ends after it.
    """

    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    body: list[bytes]
    path: str | None
    close: bool = False


class Service(Protocol):
    """What a connection needs of its server."""

    stats: HttpStats
    limits: Limits
    deadlines: Deadlines

    @property
    def closing(self) -> bool:
        """The server is stopping: no more keep-alive."""

    def respond(self, request: Request, peer: Any, done: Callable[[Reply], None]) -> Reply | None:
        """The reply to ``request`` now, or None when it comes later through ``done``
        (called on the loop's thread)."""

    def error_reply(self, status: int, message: str) -> Reply:
        """A plain-text error response that closes the connection."""

    def opened(self, connection: HttpConnection) -> None:
        """``connection`` has a transport (after a TLS handshake, when there is one)."""

    def closed(self, connection: HttpConnection) -> None:
        """``connection``'s transport is gone."""


class TlsLayer:
    """Server-side TLS over memory BIOs: ciphertext in, plaintext out, and back."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self.ready = False  # the handshake is done
        self.closed = False  # the client sent close_notify

    def receive(self, data: bytes) -> bytes:
        """The plaintext that ``data`` completes (b"" during the handshake); raises
        ssl.SSLError for a failed handshake or a bad record."""
        self._incoming.write(data)
        if not self.ready:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                return b""
            self.ready = True
        chunks = []
        while True:
            try:
                chunk = self._tls.read(65536)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def encrypt(self, data: bytes) -> bytes:
        """``data`` as TLS records (and whatever else is due to be sent)."""
        self._tls.write(data)
        return self._outgoing.read()

    def close_notify(self) -> bytes:
        """Our close_notify, to send (the client's is not waited for: the linger drains it)."""
        with contextlib.suppress(ssl.SSLError):  # SSLWantReadError: theirs has not come
            self._tls.unwrap()
        return self._outgoing.read()

    def outgoing(self) -> bytes:
        """What the handshake or the reads have to send (alerts included)."""
        return self._outgoing.read()


class HttpConnection(asyncio.Protocol):
    """Serves the requests of one connection, in order, under the deadlines.

    ``head_deadline`` (loop time): when the first request head must be whole, counted from
    accept, so a TLS handshake (with ``ssl_context``) spends from it.
    """

    def __init__(
        self,
        service: Service,
        loop: asyncio.AbstractEventLoop,
        peer: Any,
        head_deadline: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.service = service
        self.loop = loop
        self.peer = peer
        self.deadlines = service.deadlines
        self.http = Connection(service.limits)
        self.transport: asyncio.Transport | None = None
        self.tls = TlsLayer(ssl_context) if ssl_context is not None else None
        self.phase = Phase.HEAD
        self.deadline = head_deadline
        self._timer: asyncio.TimerHandle | None = None
        self._eof = False  # the client half-closed
        self._reading = True
        self._write_paused = False
        self._drained = 0  # bytes discarded while lingering
        self._released = False

    # -- asyncio's callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's: duck-typed
        transport.set_write_buffer_limits(high=0)  # pause_writing until all is with the kernel
        self.service.opened(self)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            log.debug("%s: connection dropped: %s", self.peer, exc)
        self.phase = Phase.CLOSED
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.service.closed(self)
        self.release()

    def data_received(self, data: bytes) -> None:
        if self.phase in (Phase.LINGER, Phase.CLOSED):
            self._drain(len(data))
            return
        if self.tls is not None:
            data = self._decrypt(data)
            if self.phase is Phase.CLOSED:
                return
        if data:
            self.http.receive(data)
            if self.phase in (Phase.HEAD, Phase.IDLE):
                self._serve()
            else:  # answering: what follows waits (pipelined requests, or a body never read)
                self._pause_reading()
        if self.tls is not None and self.tls.closed and not self._eof:
            self._client_done()

    def eof_received(self) -> bool:
        self._client_done()
        return self.phase is not Phase.CLOSED  # answer what came, then close

    def _client_done(self) -> None:
        """The client sends nothing more (FIN, or TLS close_notify): close, unless requests
        it sent are being answered (then after them)."""
        self._eof = True
        if self.phase in (Phase.HEAD, Phase.IDLE, Phase.LINGER):
            if self.phase is not Phase.LINGER and self.http.started:
                log.debug("%s: client closed the connection mid-head", self.peer)
            self._close()

    def _decrypt(self, data: bytes) -> bytes:
        """The plaintext in ``data``; on a TLS error the alert is sent and the connection
        closed (a failed handshake counts as rejected)."""
        tls = self.tls
        transport = self.transport
        assert tls is not None and transport is not None
        try:
            plain = tls.receive(data)
        except ssl.SSLError as exc:
            log.debug("%s: TLS error: %s", self.peer, exc)
            if not tls.ready:
                self.service.stats.reject()
            plain = b""
            self.phase = Phase.CLOSED
        if out := tls.outgoing():
            transport.write(out)
        if self.phase is Phase.CLOSED:
            transport.close()  # after the alert
        return plain

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.phase is Phase.WRITE and self._after_response():
            self._serve()

    # -- the server's side ----------------------------------------------------------------

    def release(self) -> None:
        """Count the connection closed in the stats, once (also when it never got a transport)."""
        if not self._released:
            self._released = True
            self.service.stats.close()

    def shutdown(self) -> None:
        """The server is stopping: close now unless a response is on its way (that one ends
        the connection when it is sent) or the connection lingers (it ends on its own)."""
        if self.phase in (Phase.HEAD, Phase.IDLE):
            self._close()

    def abort(self) -> None:
        """Drop the connection at once."""
        if self.transport is not None:
            self.transport.abort()

    # -- requests ---------------------------------------------------------------------------

    def _serve(self) -> None:
        """Answer the whole requests received, in order, as long as each is answered at once."""
        transport = self.transport
        assert transport is not None
        while not transport.is_closing():
            try:
                request = self.http.next_request()
            except HttpError as exc:
                log.debug("%s: %d %s", self.peer, exc.status, exc)
                self.service.stats.reject()
                self._send(self.service.error_reply(exc.status, str(exc)), error=True)
                return
            if request is None:
                self._wait_for_more()
                return
            self.phase = Phase.BUSY
            reply = self.service.respond(request, self.peer, self._replied)
            if reply is None:  # answered later, off the loop: read nothing meanwhile
                self._pause_reading()
                return
            if not self._send(reply):
                return

    def _wait_for_more(self) -> None:
        if self.http.started and self.phase is Phase.IDLE:  # a keep-alive request's first byte
            self._set_deadline(Phase.HEAD, self.deadlines.head)
        if self._eof:
            if self.http.started:
                log.debug("%s: client closed the connection mid-head", self.peer)
            self._close()
        else:
            self._resume_reading()

    def _replied(self, reply: Reply) -> None:
        """A reply made off the loop, now on it."""
        if self.phase is Phase.BUSY and self._send(reply):
            self._serve()

    def _send(self, reply: Reply, *, error: bool = False) -> bool:
        """Send ``reply``; True when the connection is ready for the next request now."""
        transport = self.transport
        assert transport is not None
        if transport.is_closing():
            return False
        keep = not reply.close and self.deadlines.keepalive > 0 and not self.service.closing
        parts = self.http.response(
            reply.status, reply.reason, reply.headers, reply.body, close=not keep
        )
        if reply.path is not None:  # counted first: a client may read it before write returns
            self.service.stats.request(reply.path, reply.status)
        self._write(b"".join(parts))  # one send for head and body
        if self._write_paused:  # not all with the kernel yet: resume_writing goes on
            self._pause_reading()
            self._set_deadline(
                Phase.WRITE, self.deadlines.error_write if error else self.deadlines.write
            )
            return False
        return self._after_response()

    def _after_response(self) -> bool:
        """The response is with the kernel: ready for the next request, or linger and close."""
        if not self.http.keep_alive or self.service.closing:
            self._linger()
            return False
        self.http.next_cycle()
        self._set_deadline(Phase.IDLE, self.deadlines.keepalive)
        return True

    # -- closing ----------------------------------------------------------------------------

    def _linger(self) -> None:
        """Half-close (TLS: close_notify), then discard what the client still sends until it
        closes, for a bounded time and size, so unread bytes do not turn the close into a reset
        that would cut the response short."""
        transport = self.transport
        assert transport is not None
        self.phase = Phase.LINGER
        if self._eof:  # the client sends nothing more: nothing to wait for
            self._close()
            return
        self._resume_reading()
        if self.tls is not None:
            transport.write(self.tls.close_notify())
        transport.write_eof()
        self._set_deadline(Phase.LINGER, self.deadlines.linger)

    def _write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(self.tls.encrypt(data) if self.tls is not None else data)

    def _drain(self, size: int) -> None:
        self._drained += size
        if self._drained > self.deadlines.linger_bytes:
            self._close()

    def _close(self) -> None:
        self.phase = Phase.CLOSED
        if self.transport is not None:
            self.transport.close()

    def _pause_reading(self) -> None:
        if self._reading and not self._eof and self.transport is not None:
            self._reading = False
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if not self._reading and not self._eof and self.transport is not None:
            self._reading = True
            self.transport.resume_reading()

    # -- the deadline ---------------------------------------------------------------------

    def _set_deadline(self, phase: Phase, seconds: float) -> None:
        self.phase = phase
        self.deadline = self.loop.time() + seconds
        self._arm()

    def _arm(self) -> None:
        """A timer that fires no later than the deadline (a later deadline waits for it)."""
        timer = self._timer
        if timer is None or timer.when() > self.deadline:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(self.deadline, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self.phase in (Phase.BUSY, Phase.CLOSED):
            return
        if self.deadline - self.loop.time() > 0.001:  # the deadline moved on meanwhile
            self._arm()
            return
        if self.phase is Phase.HEAD and self.tls is not None and not self.tls.ready:
            log.debug("%s: TLS handshake not done within %gs", self.peer, self.deadlines.head)
            self.service.stats.reject()
            self._close()
        elif self.phase is Phase.HEAD:
            log.debug("%s: request head not received within %gs", self.peer, self.deadlines.head)
            self.service.stats.reject()
            self.phase = Phase.BUSY
            self._send(
                self.service.error_reply(408, "request head not received in time"), error=True
            )
        elif self.phase is Phase.WRITE:
            log.debug("%s: response not sent within its deadline", self.peer)
            self.abort()
        else:  # IDLE, LINGER
            self._close()
