"""A small threaded HTTP/1.1 server for one WSGI app, built to survive hostile clients.

Each accepted connection is served on its own daemon thread, so a slow client never stalls
another one, and the listening thread does nothing but ``accept``: with TLS the handshake runs in
the connection's thread, not in ``accept`` (where one client that never sends a ClientHello would
block every other scraper).

Limits (module constants, read when a server is made):

- ``HEAD_DEADLINE``: from ``accept`` to a complete request head (TLS handshake, request line and
  headers), a total deadline, not a per-``recv`` timeout: a client that trickles a byte at a time
  cannot stretch it. Past it the client gets ``408`` (when it finished a TLS handshake) and the
  connection is closed.
- ``WRITE_DEADLINE``: the whole response must be sent within it.
- ``MAX_CONNECTIONS``: connections being handled at once; beyond it a new connection is closed at
  once, without a response (answering would cost a thread, and with TLS a handshake).
- ``MAX_REQUEST_LINE`` (``414``), ``MAX_HEADER_LINE``, ``MAX_HEADERS`` and ``MAX_HEAD``
  (``431``), exact however the bytes arrive (line ends count in the head, not in a line); a
  malformed request line or header, or an HTTP/0.9 request, gets ``400``; a version other than
  HTTP/1.0 and 1.1 gets ``505``.
- One request per connection: every response says ``Connection: close``. After it the server
  half-closes (with TLS: sends close_notify) and discards what the client still sends for up to
  ``LINGER`` seconds, so an unread request body cannot turn the close into a reset that cuts the
  response short.
- A request body is never read; the routes take none.

Client misbehaviour (resets, garbage, TLS errors, timeouts) is logged at debug level only.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import re
import selectors
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

#: Seconds from accept to a complete request head, TLS handshake included.
HEAD_DEADLINE = 10.0
#: Seconds to send a whole response.
WRITE_DEADLINE = 30.0
#: Seconds to send an error response to a client that misbehaved.
ERROR_WRITE_DEADLINE = 2.0
#: After a response, read and discard what the client still sends for at most this long, so that
#: closing with unread data does not reset the connection before the client read the response.
LINGER = 1.0
_LINGER_BYTES = 1 << 20
#: Connections handled at once; beyond it new connections are closed at once.
MAX_CONNECTIONS = 1024
MAX_REQUEST_LINE = 8192
MAX_HEADER_LINE = 8192
MAX_HEADERS = 100
MAX_HEAD = 65536

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")
#: accept() errors that say the process or host is out of a resource: wait, then go on.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class HttpError(Exception):
    """The request cannot be served: answer ``status`` with a one-line message, then close."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def tls_context(cert_file: str, key_file: str, client_ca_file: str | None) -> ssl.SSLContext:
    """A server context; with ``client_ca_file`` a client certificate signed by it is required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if client_ca_file:
        try:
            context.load_verify_locations(client_ca_file)
        except OSError as exc:
            raise OSError(  # plain: str() of an SSLError made from one string is a tuple
                f"cannot load the client CA file {client_ca_file!r}: {exc.strerror or exc}"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(certfile=cert_file, keyfile=key_file)
    except OSError as exc:
        raise OSError(
            f"cannot load the certificate {cert_file!r} or its key {key_file!r}: "
            f"{exc.strerror or exc}"
        ) from None
    return context


@dataclass
class Request:
    """A parsed request head; ``target`` in origin form (``/path?query``) or as sent."""

    method: str
    target: str
    version: str
    headers: list[tuple[str, str]] = field(default_factory=list)


def parse_request_line(request_line: bytes) -> Request:
    """Parse a request line (without its line end); raises HttpError."""
    try:
        line = request_line.decode("ascii")
    except UnicodeDecodeError:
        raise HttpError("400 Bad Request", "request line is not ASCII") from None
    parts = line.split(" ")
    if len(parts) == 2:
        raise HttpError("400 Bad Request", "HTTP/0.9 requests are not supported")
    if len(parts) != 3:
        raise HttpError("400 Bad Request", "malformed request line")
    method, target, version = parts
    if not _TOKEN.fullmatch(method.encode()):
        raise HttpError("400 Bad Request", "malformed method in the request line")
    if not _VERSION.fullmatch(version):
        raise HttpError("400 Bad Request", "malformed HTTP version in the request line")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise HttpError("505 HTTP Version Not Supported", f"{version} is not supported")
    if not target or _BAD_TARGET.search(target):
        raise HttpError("400 Bad Request", "malformed request target")
    if target[:8].lower().startswith(("http://", "https://")):  # absolute form
        try:
            absolute = urlsplit(target)
        except ValueError:  # a bad IPv6 literal, a bad port
            raise HttpError("400 Bad Request", "malformed request target") from None
        target = (absolute.path or "/") + (f"?{absolute.query}" if absolute.query else "")
    return Request(method, target, version)


def parse_header(line: bytes) -> tuple[str, str]:
    """Parse one header line (without its line end) into (name, value); raises HttpError."""
    if line[:1] in (b" ", b"\t"):
        raise HttpError("400 Bad Request", "obsolete header line folding")
    name, colon, value = line.partition(b":")
    if not colon or not _TOKEN.fullmatch(name):
        raise HttpError("400 Bad Request", "malformed header line")
    value = value.strip(b" \t")
    if _BAD_VALUE.search(value):
        raise HttpError("400 Bad Request", "control character in a header value")
    return name.decode("ascii"), value.decode("latin-1")


def read_head(sock: socket.socket, deadline: float) -> Request:
    """Read and parse a request head from ``sock`` before ``deadline``.

    Each line is checked as soon as it is complete (a bad request line is answered without
    waiting for headers). Raises HttpError on a malformed head or one over the limits,
    TimeoutError past the deadline, and ConnectionError when the client closes first.
    """
    buf = bytearray()
    start = 0  # where the line being read starts in buf
    consumed = 0  # bytes of the head already dropped from buf
    request: Request | None = None
    while True:
        newline = buf.find(b"\n", start)
        while newline != -1:
            line = bytes(buf[start:newline])
            if line.endswith(b"\r"):
                line = line[:-1]
            start = newline + 1
            if request is None:
                if line:  # empty lines before the request line are ignored (RFC 9112 2.2)
                    _check_length(len(line), True)
                    _check_head(consumed + start)
                    request = parse_request_line(line)
            elif not line:
                _check_head(consumed + start)
                return request
            else:
                _check_length(len(line), False)
                _check_head(consumed + start)
                request.headers.append(parse_header(line))
                if len(request.headers) > MAX_HEADERS:
                    raise HttpError(
                        "431 Request Header Fields Too Large", f"more than {MAX_HEADERS} headers"
                    )
            newline = buf.find(b"\n", start)
        partial = len(buf) - start - int(buf.endswith(b"\r"))  # that CR may be half a CRLF
        _check_length(partial, request is None)  # the line being read so far
        _check_head(consumed + len(buf) + 1)  # the head still needs at least its final LF
        del buf[:start]
        consumed += start
        start = 0
        sock.settimeout(_remaining(deadline))
        chunk = sock.recv(16384)
        if not chunk:
            raise ConnectionError("client closed the connection before a complete request head")
        buf += chunk


def _check_head(length: int) -> None:
    """431 when a head of at least ``length`` bytes (line ends included) is over MAX_HEAD."""
    if length > MAX_HEAD:
        raise HttpError(
            "431 Request Header Fields Too Large", f"request head over {MAX_HEAD} bytes"
        )


def _check_length(length: int, is_request_line: bool) -> None:
    if is_request_line and length > MAX_REQUEST_LINE:
        raise HttpError("414 URI Too Long", f"request line over {MAX_REQUEST_LINE} bytes")
    if not is_request_line and length > MAX_HEADER_LINE:
        raise HttpError(
            "431 Request Header Fields Too Large", f"header line over {MAX_HEADER_LINE} bytes"
        )


def send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Send ``data`` before ``deadline`` (a total, whatever the pace the client reads at)."""
    view = memoryview(data)
    while view:
        sock.settimeout(_remaining(deadline))
        sent = sock.send(view[:65536])
        view = view[sent:]


def _linger(sock: socket.socket) -> None:
    """Half-close, then drain until the client closes (bounded), then the caller closes."""
    try:
        if isinstance(sock, ssl.SSLSocket):
            # Send close_notify, then wait (bounded) for the client's or for its close.
            sock.settimeout(LINGER)
            sock.unwrap()
            return
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER
        drained = 0
        while drained < _LINGER_BYTES:
            sock.settimeout(_remaining(deadline))
            data = sock.recv(65536)
            if not data:
                return
            drained += len(data)
    except OSError:  # TimeoutError included
        return


def _response_head(status: str, headers: Iterable[tuple[str, str]], length: int) -> bytes:
    lines = [f"HTTP/1.1 {status}"]
    has_length = False
    for name, value in headers:
        lower = name.lower()
        if lower in ("connection", "date", "transfer-encoding", "keep-alive"):
            continue
        has_length = has_length or lower == "content-length"
        lines.append(f"{name}: {value}")
    if not has_length:
        lines.append(f"Content-Length: {length}")
    lines.append(f"Date: {formatdate(usegmt=True)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class HttpServer:
    """Serves a WSGI app on ``host:port``, a connection per daemon thread, with the limits above.

    ``start`` runs the accept loop on a daemon thread; ``close`` stops it and closes the
    listening socket (connections being served finish on their own, bounded by the deadlines).
    """

    def __init__(
        self,
        app: WsgiApp,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 128,
        max_connections: int | None = None,
        head_deadline: float | None = None,
        write_deadline: float | None = None,
    ) -> None:
        self.app = app
        self.ssl_context = ssl_context
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        self.head_deadline = HEAD_DEADLINE if head_deadline is None else head_deadline
        self.write_deadline = WRITE_DEADLINE if write_deadline is None else write_deadline
        #: Connections refused because ``max_connections`` were being handled.
        self.rejected = 0
        self._active = 0
        self._lock = threading.Lock()
        # The first address getaddrinfo gives (as http.server and prometheus_client do): "::"
        # binds IPv6, and IPv4 too where the host's bindv6only is 0.
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(sockaddr)
            self.socket.listen(backlog)
            self.socket.setblocking(False)
            self._address = tuple(self.socket.getsockname())
        except BaseException:
            self.socket.close()
            raise
        self._wake_r, self._wake_w = socket.socketpair()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="http-accept", daemon=True)

    @property
    def address(self) -> tuple[Any, ...]:
        """The bound address (host, port, ...)."""
        return self._address

    @property
    def port(self) -> int:
        return int(self.address[1])

    @property
    def connections(self) -> int:
        """Connections being handled now."""
        return self._active

    def start(self) -> HttpServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and close the listening socket; returns when the accept loop ended."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join()
        for sock in (self.socket, self._wake_r, self._wake_w):
            sock.close()

    # -- accepting ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed.is_set():
                ready = selector.select()
                if self._closed.is_set():
                    return
                if ready:
                    self._accept_one()

    def _accept_one(self) -> None:
        try:
            conn, peer = self.socket.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # aborted connections, network errors: try the next one
            log.debug("accept failed: %s", exc)
            if exc.errno in _RESOURCE_ERRNOS:  # out of descriptors or memory: let some go
                time.sleep(0.05)
            return
        with self._lock:
            full = self._active >= self.max_connections
            if full:
                self.rejected += 1
            else:
                self._active += 1
        if full:
            log.debug("closing a connection from %s: %d being handled", peer, self._active)
            conn.close()
            return
        try:
            threading.Thread(
                target=self._serve_connection, args=(conn, peer), name="http-conn", daemon=True
            ).start()
        except RuntimeError as exc:  # cannot start a new thread
            log.debug("closing a connection from %s: %s", peer, exc)
            self._release()
            conn.close()

    def _release(self) -> None:
        with self._lock:
            self._active -= 1

    # -- one connection -------------------------------------------------------------------

    def _serve_connection(self, conn: socket.socket, peer: Any) -> None:
        sock = conn
        try:
            deadline = time.monotonic() + self.head_deadline
            conn.settimeout(_remaining(deadline))
            if self.ssl_context is not None:
                # The handshake's timeout is a deadline for the whole handshake (the ssl module
                # carries it across the reads and writes it makes).
                sock = self.ssl_context.wrap_socket(
                    conn, server_side=True, do_handshake_on_connect=False
                )
                sock.do_handshake()
            self._serve_request(sock, peer, deadline)
        except OSError as exc:  # timeouts, resets, TLS errors, a client gone away
            log.debug("%s: connection dropped: %s", peer, exc)
        except Exception:  # a bug of ours: logged, and the server goes on
            log.exception("error serving a connection from %s", peer)
        finally:
            try:
                sock.close()
            finally:
                self._release()

    def _serve_request(self, sock: socket.socket, peer: Any, deadline: float) -> None:
        try:
            request = read_head(sock, deadline)
        except HttpError as exc:
            log.debug("%s: %s %s", peer, exc.status, exc)
            self._send_error(sock, exc.status, str(exc))
            _linger(sock)
            return
        except TimeoutError:
            log.debug("%s: request head not received within %gs", peer, self.head_deadline)
            self._send_error(sock, "408 Request Timeout", "request head not received in time")
            return
        status, headers, body = self._call_app(request, sock, peer)
        send_all(
            sock,
            _response_head(status, headers, len(body)) + body,
            time.monotonic() + self.write_deadline,
        )
        _linger(sock)

    def _send_error(self, sock: socket.socket, status: str, message: str) -> None:
        body = (message + "\n").encode()
        head = _response_head(status, [("Content-Type", "text/plain; charset=utf-8")], len(body))
        with contextlib.suppress(OSError):
            send_all(sock, head + body, time.monotonic() + ERROR_WRITE_DEADLINE)

    def _call_app(
        self, request: Request, sock: socket.socket, peer: Any
    ) -> tuple[str, list[tuple[str, str]], bytes]:
        environ = self._environ(request, sock, peer)
        started: list[Any] = []

        def start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], None]:
            started[:] = [status, headers]
            return lambda data: None  # the legacy write() callable: unused by our app

        try:
            result = self.app(environ, start_response)
            try:
                body = b"".join(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            if not started:
                raise RuntimeError("the app did not call start_response")
        except Exception:
            log.exception("error serving %s %s", request.method, request.target)
            body = b"internal error\n"
            started[:] = ["500 Internal Server Error", [("Content-Type", "text/plain")]]
        return started[0], list(started[1]), body

    def _environ(self, request: Request, sock: socket.socket, peer: Any) -> dict[str, Any]:
        path, _, query = request.target.partition("?")
        server_address = self._address
        environ: dict[str, Any] = {
            "REQUEST_METHOD": request.method,
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote(path, "latin-1"),
            "QUERY_STRING": query,
            "SERVER_NAME": str(server_address[0]),
            "SERVER_PORT": str(server_address[1]),
            "SERVER_PROTOCOL": request.version,
            "REMOTE_ADDR": str(peer[0]) if isinstance(peer, tuple) else "",
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "https" if self.ssl_context is not None else "http",
            "wsgi.input": io.BytesIO(b""),  # no route reads a body
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        for name, value in request.headers:
            if "_" in name:  # as wsgiref: CONTENT_TYPE and X_FOO must not pose as X-Foo
                continue
            key = name.upper().replace("-", "_")
            if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                key = "HTTP_" + key
            environ[key] = f"{environ[key]},{value}" if key in environ else value
        return environ
