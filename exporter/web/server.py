"""A threaded HTTP/1.1 server for one WSGI app, built to survive hostile clients.

Each accepted connection is served on its own daemon thread, so a slow client never stalls
another one, and the listening thread does nothing but ``accept``: with TLS the handshake runs in
the connection's thread, not in ``accept`` (where one client that never sends a ClientHello would
block every other scraper). Request heads are parsed by llhttp (``exporter.web.http1``).

Limits (:class:`Options`, from the ``web.*`` settings; the module constants are the defaults):

- ``head_timeout``: from ``accept`` to a complete first request head (TLS handshake, request
  line and headers), a total deadline, not a per-``recv`` timeout: a client that trickles a byte
  at a time cannot stretch it. Past it the client gets ``408`` (when it finished a TLS handshake)
  and the connection is closed. Every later request on a keep-alive connection has the same time
  from its first byte.
- ``keepalive_timeout``: how long a connection may stay idle between requests; then it is closed
  without a word. 0: no keep-alive (every response says ``Connection: close``).
- ``write_timeout``: the whole response must be sent within it.
- ``max_connections``: connections open at once (idle keep-alive ones too); beyond it a new
  connection is closed at once, without a response (answering would cost a thread, and with TLS
  a handshake).
- ``limits``: the request line (``414``), header lines, their number and the whole head
  (``431``), exact however the bytes arrive. A malformed head gets ``400``, a version other than
  HTTP/1.0 and 1.1 ``505``.
- Keep-alive for clients that ask (HTTP/1.1 without ``Connection: close``); pipelined requests
  are answered in order. After the last response the server half-closes (with TLS: sends
  close_notify) and discards what the client still sends for up to ``LINGER`` seconds, so an
  unread request body cannot turn the close into a reset that cuts the response short.
- A request body is never read; the routes take none. A request with one is answered, then the
  connection closes.

Client misbehaviour (resets, garbage, TLS errors, timeouts) is logged at debug level only.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import selectors
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote, urlsplit

from exporter.web.http1 import Connection, HttpError, Limits, Request, TimedSocket
from exporter.web.stats import HttpStats

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

#: Seconds from accept to a complete request head, TLS handshake included.
HEAD_DEADLINE = 10.0
#: Seconds a keep-alive connection may stay idle between requests.
KEEPALIVE_TIMEOUT = 120.0
#: Seconds to send a whole response.
WRITE_DEADLINE = 30.0
#: Seconds to send an error response to a client that misbehaved.
ERROR_WRITE_DEADLINE = 2.0
#: After the last response, read and discard what the client still sends for at most this long,
#: so that closing with unread data does not reset the connection before the client read it.
LINGER = 1.0
_LINGER_BYTES = 1 << 20
#: Connections open at once; beyond it new connections are closed at once.
MAX_CONNECTIONS = 1024
MAX_REQUEST_LINE = 8192
MAX_HEADER_LINE = 8192
MAX_HEADERS = 100
MAX_HEAD = 65536
#: accept() errors that say the process or host is out of a resource: wait, then go on.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: Response headers the server sets itself; an app's are dropped.
_HOP_BY_HOP = frozenset({b"connection", b"date", b"transfer-encoding", b"keep-alive"})
_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    505: b"HTTP Version Not Supported",
}


@dataclass(frozen=True)
class Options:
    """The server's limits; ``None`` fields take the module constants when a server is made."""

    max_connections: int | None = None
    head_timeout: float | None = None
    keepalive_timeout: float | None = None
    write_timeout: float | None = None
    max_head: int | None = None
    #: Added to every response (``http_server_config.headers`` of the web config).
    headers: Sequence[tuple[str, str]] = field(default_factory=tuple)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def tls_context(cert_file: str, key_file: str, client_ca_file: str | None) -> ssl.SSLContext:
    """A server context; with ``client_ca_file`` a client certificate signed by it is required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if client_ca_file:
        load_client_ca(context, client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    load_certificate(context, cert_file, key_file)
    return context


def load_client_ca(context: ssl.SSLContext, client_ca_file: str) -> None:
    """Trust ``client_ca_file`` for client certificates; OSError with a plain message."""
    try:
        context.load_verify_locations(client_ca_file)
    except OSError as exc:
        raise OSError(  # plain: str() of an SSLError made from one string is a tuple
            f"cannot load the client CA file {client_ca_file!r}: {exc.strerror or exc}"
        ) from None


def load_certificate(context: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    """Serve ``cert_file`` with ``key_file``; OSError with a plain message."""
    try:
        context.load_cert_chain(certfile=cert_file, keyfile=key_file)
    except OSError as exc:
        raise OSError(
            f"cannot load the certificate {cert_file!r} or its key {key_file!r}: "
            f"{exc.strerror or exc}"
        ) from None


def send_parts(io: TimedSocket, parts: Sequence[bytes], deadline: float) -> None:
    """Send ``parts`` in order before ``deadline`` (a total, whatever the pace the client reads
    at); a plain socket gathers them in one call, without joining them first."""
    if not io.plain:
        data = memoryview(b"".join(parts))
        while data:
            data = data[io.send([data[:262144]], _remaining(deadline)) :]
        return
    views = [memoryview(part) for part in parts if part]
    while views:
        sent = io.send(views[:512], _remaining(deadline))
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


def _linger(io: TimedSocket) -> None:
    """Half-close, then drain until the client closes (bounded), then the caller closes."""
    sock = io.sock
    try:
        if not io.plain:
            # Send close_notify, then wait (bounded) for the client's or for its close.
            sock.settimeout(LINGER)
            sock.unwrap()  # type: ignore[attr-defined]
            return
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER
        drained = 0
        while drained < _LINGER_BYTES:
            data = io.recv(65536, _remaining(deadline))
            if not data:
                return
            drained += len(data)
    except OSError:  # TimeoutError included
        return


class _Date:
    """The Date header's value, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._value = formatdate(now, usegmt=True).encode("ascii")
            self._second = now
        return self._value


class HttpServer:
    """Serves a WSGI app on ``host:port``, a connection per daemon thread, with the limits above.

    ``start`` runs the accept loop on a daemon thread; ``close`` stops it and closes the
    listening socket (connections being served finish on their own, bounded by the deadlines;
    idle keep-alive ones are closed at their next wait). ``stats`` counts connections and
    requests (``gpu_exporter_http_*``).
    """

    def __init__(
        self,
        app: WsgiApp,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 128,
        options: Options | None = None,
        stats: HttpStats | None = None,
    ) -> None:
        options = options or Options()
        self.app = app
        self.ssl_context = ssl_context
        self.stats = stats or HttpStats()
        self.max_connections = _default(options.max_connections, MAX_CONNECTIONS)
        self.head_timeout = _default(options.head_timeout, HEAD_DEADLINE)
        self.keepalive_timeout = _default(options.keepalive_timeout, KEEPALIVE_TIMEOUT)
        self.write_timeout = _default(options.write_timeout, WRITE_DEADLINE)
        max_head = _default(options.max_head, MAX_HEAD)
        self.limits = Limits(
            max_head=max_head,
            max_request_line=min(MAX_REQUEST_LINE, max_head),
            max_header_line=min(MAX_HEADER_LINE, max_head),
            max_headers=MAX_HEADERS,
        )
        self.extra_headers = [
            (name.encode("latin-1"), value.encode("latin-1")) for name, value in options.headers
        ]
        self._date = _Date()
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
        #: What every request's WSGI environ starts with.
        self._base_environ: dict[str, Any] = {
            "SCRIPT_NAME": "",
            "SERVER_NAME": str(self._address[0]),
            "SERVER_PORT": str(self._address[1]),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "https" if ssl_context is not None else "http",
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
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
        """Connections open now."""
        return self.stats.connections

    @property
    def rejected(self) -> int:
        """Connections refused at the cap or dropped for a bad or slow head."""
        return self.stats.rejected

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
        if not self.stats.open(self.max_connections):
            log.debug("closing a connection from %s: %d open", peer, self.stats.connections)
            conn.close()
            return
        try:
            threading.Thread(
                target=self._serve_connection, args=(conn, peer), name="http-conn", daemon=True
            ).start()
        except RuntimeError as exc:  # cannot start a new thread
            log.debug("closing a connection from %s: %s", peer, exc)
            self.stats.close()
            conn.close()

    # -- one connection -------------------------------------------------------------------

    def _serve_connection(self, conn: socket.socket, peer: Any) -> None:
        sock = conn
        try:
            deadline = time.monotonic() + self.head_timeout
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                conn.settimeout(_remaining(deadline))
                # The handshake's timeout is a deadline for the whole handshake (the ssl module
                # carries it across the reads and writes it makes).
                sock = self.ssl_context.wrap_socket(
                    conn, server_side=True, do_handshake_on_connect=False
                )
                try:
                    sock.do_handshake()
                except OSError:
                    self.stats.reject()
                    raise
            self._serve_requests(sock, peer, deadline)
        except OSError as exc:  # timeouts, resets, TLS errors, a client gone away
            log.debug("%s: connection dropped: %s", peer, exc)
        except Exception:  # a bug of ours: logged, and the server goes on
            log.exception("error serving a connection from %s", peer)
        finally:
            try:
                sock.close()
            finally:
                self.stats.close()

    def _serve_requests(self, sock: socket.socket, peer: Any, deadline: float) -> None:
        """Requests on one connection until it closes; the first before ``deadline``."""
        http = Connection(sock, self.limits, self.head_timeout)
        first: float | None = deadline
        while True:
            idle_until = time.monotonic() + self.keepalive_timeout
            try:
                request = http.read_request(first, idle_until)
            except HttpError as exc:
                log.debug("%s: %d %s", peer, exc.status, exc)
                self.stats.reject()
                self._send_error(http, exc.status, str(exc))
                _linger(http.io)
                return
            except TimeoutError:
                log.debug("%s: request head not received within %gs", peer, self.head_timeout)
                self.stats.reject()
                self._send_error(http, 408, "request head not received in time")
                return
            if request is None:  # closed, or idle past the keep-alive timeout
                return
            first = None
            try:
                environ = self._environ(request, sock, peer)
            except HttpError as exc:  # a target llhttp took but the URL parser does not
                self._send_error(http, exc.status, str(exc))
                self.stats.request("", exc.status)
                _linger(http.io)
                return
            keep = self.keepalive_timeout > 0 and not self._closed.is_set()
            status, reason, headers, body = self._call_app(environ, request)
            parts = http.response(status, reason, headers, body, close=not keep)
            send_parts(http.io, parts, time.monotonic() + self.write_timeout)
            self.stats.request(environ["PATH_INFO"], status)
            if not http.keep_alive:
                _linger(http.io)
                return
            http.next_cycle()

    def _send_error(self, http: Connection, status: int, message: str) -> None:
        body = (message + "\n").encode()
        headers = [
            (b"Content-Type", b"text/plain; charset=utf-8"),
            (b"Content-Length", str(len(body)).encode()),
            (b"Date", self._date()),
            *self.extra_headers,
        ]
        with contextlib.suppress(OSError):
            parts = http.response(status, _REASONS.get(status, b""), headers, [body], close=True)
            send_parts(http.io, parts, time.monotonic() + ERROR_WRITE_DEADLINE)

    def _call_app(
        self, environ: dict[str, Any], request: Request
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]], list[bytes]]:
        """(status, reason, headers, body parts) of the app's answer to ``environ``."""
        started: list[Any] = []

        def start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], None]:
            started[:] = [status, headers]
            return lambda data: None  # the legacy write() callable: unused by our app

        try:
            result = self.app(environ, start_response)
            try:
                body = list(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            if not started:
                raise RuntimeError("the app did not call start_response")
            code, _, reason = started[0].partition(" ")
            status = int(code)
            headers = [
                (name.encode("latin-1"), value.encode("latin-1")) for name, value in started[1]
            ]
            if any(name.lower() in _HOP_BY_HOP for name, _ in headers):
                headers = [(n, v) for n, v in headers if n.lower() not in _HOP_BY_HOP]
        except Exception:
            log.exception("error serving %r", request.target)
            body = [b"internal error\n"]
            status, reason, headers = (
                500,
                "Internal Server Error",
                [(b"Content-Type", b"text/plain")],
            )
        if not any(name.lower() == b"content-length" for name, _ in headers):
            headers.append((b"Content-Length", str(sum(map(len, body))).encode()))
        headers.append((b"Date", self._date()))
        headers.extend(self.extra_headers)
        return status, reason.encode("latin-1"), headers, body

    def _environ(self, request: Request, sock: socket.socket, peer: Any) -> dict[str, Any]:
        try:
            target = request.target.decode("ascii")
        except UnicodeDecodeError:
            raise HttpError(400, "malformed request target: not ASCII") from None
        if target[:8].lower().startswith(("http://", "https://")):  # absolute form
            try:
                absolute = urlsplit(target)
            except ValueError:  # a bad IPv6 literal, a bad port
                raise HttpError(400, "malformed request target") from None
            target = (absolute.path or "/") + (f"?{absolute.query}" if absolute.query else "")
        path, _, query = target.partition("?")
        environ = self._base_environ.copy()
        environ["REQUEST_METHOD"] = request.method.decode("ascii")
        environ["PATH_INFO"] = unquote(path, "latin-1") if "%" in path else path
        environ["QUERY_STRING"] = query
        environ["SERVER_PROTOCOL"] = "HTTP/" + request.http_version.decode("ascii")
        environ["REMOTE_ADDR"] = str(peer[0]) if isinstance(peer, tuple) else ""
        environ["wsgi.input"] = io.BytesIO(b"")  # no route reads a body
        for raw_name, raw_value in request.headers:
            name = raw_name.decode("ascii")
            if "_" in name:  # as wsgiref: CONTENT_TYPE and X_FOO must not pose as X-Foo
                continue
            key = name.upper().replace("-", "_")
            if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                key = "HTTP_" + key
            value = raw_value.decode("latin-1")
            environ[key] = f"{environ[key]},{value}" if key in environ else value
        return environ


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value
