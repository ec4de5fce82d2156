"""An HTTP/1.1 server for one WSGI app on one asyncio event loop, built to survive hostile clients.

One thread runs the loop (uvloop's where installed, see :func:`new_loop`): it accepts, reads,
parses and writes for every connection, with non-blocking sockets, so a slow client never stalls
another one and no connection waits for the GIL to come back from another connection's thread.
Request heads are parsed by llhttp (``exporter.web.http1``); a connection is an asyncio Protocol
(``exporter.web.connection``).
What may block runs off the loop: a request the app does not say it answers at once (its
``inline(environ)``; ``/snapshot``, ``/recommend``, a basic-auth check that needs bcrypt) goes to
a few worker threads, and its connection waits for the answer without holding anyone else up.

Limits (:class:`Options`, from the ``web.*`` settings; the module constants are the defaults):

- ``head_timeout``: from ``accept`` to a complete first request head (TLS handshake, request
  line and headers), a total deadline, not a per-read timeout: a client that trickles a byte
  at a time cannot stretch it. Past it the client gets ``408`` (when it finished a TLS handshake)
  and the connection is closed. Every later request on a keep-alive connection has the same time
  from its first byte.
- ``keepalive_timeout``: how long a connection may stay idle between requests; then it is closed
  without a word. 0: no keep-alive (every response says ``Connection: close``).
- ``write_timeout``: the whole response must be handed to the kernel within it, else the
  connection is dropped. Meanwhile the connection reads nothing more, so a client that never
  reads holds one response in the server, not more.
- ``max_connections``: connections open at once (idle keep-alive ones and TLS handshakes too);
  beyond it a new connection is closed at once, without a response (and with TLS before a
  handshake).
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

``reconfigure`` (any thread; a web config reload's) swaps the app, the extra headers and the TLS
context while serving: a request reads the app and headers once, so it sees one configuration;
a connection takes the TLS context at accept, so open ones keep theirs and new ones get the new.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import logging
import queue
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

from exporter.web.connection import Deadlines, HttpConnection, Reply
from exporter.web.http1 import HttpError, Limits, Request
from exporter.web.stats import HttpStats

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
Environ = dict[str, Any]

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
#: Threads for the requests the app does not answer at once (bcrypt runs one at a time anyway).
WORKERS = 4
#: On close, how long responses on their way may take before their connections are dropped.
CLOSE_GRACE = 1.0
#: Connections accepted per wake-up of the loop, at most.
_ACCEPT_BATCH = 64
#: accept() errors that say the process or host is out of a resource: wait, then go on.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_RESOURCE_PAUSE = 0.05
#: Response headers the server sets itself; an app's are dropped.
_HOP_BY_HOP = frozenset({"connection", "date", "transfer-encoding", "keep-alive"})
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


class _Workers:
    """Daemon threads for the requests that may block (started on first use): a job's answer
    goes back to the loop's thread. Daemon, as the connection threads were: a route that hangs
    does not hold the process at exit."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._jobs: queue.SimpleQueue[tuple[Any, Callable[[], Reply], Any] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []

    def submit(
        self,
        loop: asyncio.AbstractEventLoop,
        job: Callable[[], Reply],
        done: Callable[[Reply], None],
    ) -> None:
        if not self._threads:
            for i in range(self.count):
                thread = threading.Thread(target=self._run, name=f"http-worker-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        self._jobs.put((loop, job, done))

    def stop(self) -> None:
        """Let the threads end after the jobs queued (their answers go nowhere)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            loop, job, done = item
            reply = job()
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(done, reply)


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (libuv sets connections up and down in C:
    about 15 % more requests/s with ``Connection: close``, docs/benchmarks.md), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _never(environ: Environ) -> bool:
    return False


def _exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A socket or TLS error that reached the loop is a client's doing: debug only."""
    if isinstance(context.get("exception"), OSError):
        log.debug("%s: %s", context.get("message"), context.get("exception"))
        return
    loop.default_exception_handler(context)


@dataclass(frozen=True)
class _Site:
    """What a request is answered with, swapped whole by ``reconfigure``: the app, its
    ``inline`` and the extra response headers."""

    app: WsgiApp
    inline: Callable[[Environ], bool]
    headers: tuple[tuple[bytes, bytes], ...]

    @classmethod
    def of(cls, app: WsgiApp, headers: Sequence[tuple[str, str]]) -> _Site:
        inline = getattr(app, "inline", None)
        return cls(
            app,
            inline if callable(inline) else _never,
            tuple((name.encode("latin-1"), value.encode("latin-1")) for name, value in headers),
        )


class HttpServer:
    """Serves a WSGI app on ``host:port`` from one event loop thread, with the limits above.

    ``start`` runs the loop on a daemon thread; ``close`` stops accepting, closes idle
    connections at once, lets responses on their way finish for up to ``CLOSE_GRACE`` seconds,
    then drops the rest and returns when the loop ended. ``stats`` counts connections and
    requests (``gpu_exporter_http_*``).

    An app with an ``inline(environ) -> bool`` method is called on the loop's thread for the
    requests it says it answers at once (reads of what is already computed); every other
    request goes to a worker thread. An app without one is always called on a worker.
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
        self._site = _Site.of(app, options.headers)
        #: Read at each accept: new connections get the context of the latest reconfigure.
        self.ssl_context = ssl_context
        self.stats = stats or HttpStats()
        self.max_connections = _default(options.max_connections, MAX_CONNECTIONS)
        self.head_timeout = _default(options.head_timeout, HEAD_DEADLINE)
        self.keepalive_timeout = _default(options.keepalive_timeout, KEEPALIVE_TIMEOUT)
        self.write_timeout = _default(options.write_timeout, WRITE_DEADLINE)
        self.deadlines = Deadlines(
            head=self.head_timeout,
            keepalive=self.keepalive_timeout,
            write=self.write_timeout,
            error_write=ERROR_WRITE_DEADLINE,
            linger=LINGER,
            linger_bytes=_LINGER_BYTES,
        )
        max_head = _default(options.max_head, MAX_HEAD)
        self.limits = Limits(
            max_head=max_head,
            max_request_line=min(MAX_REQUEST_LINE, max_head),
            max_header_line=min(MAX_HEADER_LINE, max_head),
            max_headers=MAX_HEADERS,
        )
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
        self._base_environ: Environ = {
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
        self._loop = new_loop()
        self._connections: set[HttpConnection] = set()
        self._workers = _Workers(WORKERS)
        self._closing = False  # the loop is stopping (read on the loop's thread)
        self._stopped = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="http-loop", daemon=True)

    @property
    def app(self) -> WsgiApp:
        """The app requests are answered by now."""
        return self._site.app

    @property
    def extra_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """Added to every response now."""
        return self._site.headers

    def reconfigure(
        self,
        app: WsgiApp,
        ssl_context: ssl.SSLContext | None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Answer with ``app`` and add ``headers`` from the next request on, and hand
        ``ssl_context`` to the connections accepted from now on (open ones keep theirs).
        Any thread. TLS cannot be switched on or off: ValueError."""
        if (ssl_context is None) != (self.ssl_context is None):
            raise ValueError("TLS cannot be switched on or off while serving")
        self._site = _Site.of(app, headers)  # one reference: a request reads it once
        self.ssl_context = ssl_context

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

    @property
    def closing(self) -> bool:
        """The server is stopping: responses say ``Connection: close``."""
        return self._closing

    def start(self) -> HttpServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and serving; returns when the loop ended (see the class)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._shutdown)
            self._thread.join()
        else:
            self._loop.close()
        self._workers.stop()
        self.socket.close()

    # -- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        loop.set_exception_handler(_exception_handler)
        loop.add_reader(self.socket.fileno(), self._accept)
        try:
            loop.run_forever()
        finally:
            self._finish()

    def _shutdown(self) -> None:
        """On the loop: stop accepting, close idle connections, stop when the rest are gone."""
        self._closing = True
        self._loop.remove_reader(self.socket.fileno())
        for connection in list(self._connections):
            connection.shutdown()
        self._loop.call_later(CLOSE_GRACE, self._stop)
        if not self._connections:
            self._stop()

    def _stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._loop.stop()

    def _finish(self) -> None:
        """After the loop stopped: drop what is left, end the handshakes, close the loop."""
        loop = self._loop
        self._stopped = True
        for connection in list(self._connections):
            connection.abort()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        for _ in range(3):  # the transports' connection_lost callbacks
            loop.run_until_complete(asyncio.sleep(0))
        loop.close()

    # -- accepting ------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, peer = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # aborted connections, network errors: try the next one
                log.debug("accept failed: %s", exc)
                if exc.errno in _RESOURCE_ERRNOS:  # out of descriptors or memory: let some go
                    self._loop.remove_reader(self.socket.fileno())
                    self._loop.call_later(_RESOURCE_PAUSE, self._resume_accepting)
                    return
                continue
            if not self.stats.open(self.max_connections):
                log.debug("closing a connection from %s: %d open", peer, self.stats.connections)
                conn.close()
                continue
            deadline = self._loop.time() + self.head_timeout
            connection = HttpConnection(self, self._loop, peer, deadline, self.ssl_context)
            self._loop.create_task(self._connect(conn, connection))

    def _resume_accepting(self) -> None:
        if not self._closing:
            self._loop.add_reader(self.socket.fileno(), self._accept)

    async def _connect(self, conn: socket.socket, connection: HttpConnection) -> None:
        """Give ``conn`` a transport; ``connection`` takes over from there."""
        try:
            await self._loop.connect_accepted_socket(lambda: connection, conn)
        except OSError as exc:  # a client gone already
            log.debug("%s: connection dropped: %s", connection.peer, exc)
            connection.release()
            conn.close()
        except asyncio.CancelledError:  # the server is closing
            connection.release()
            conn.close()
            raise

    def opened(self, connection: HttpConnection) -> None:
        self._connections.add(connection)

    def closed(self, connection: HttpConnection) -> None:
        self._connections.discard(connection)
        if self._closing and not self._connections:
            self._stop()

    # -- answering ------------------------------------------------------------------------

    def respond(self, request: Request, peer: Any, done: Callable[[Reply], None]) -> Reply | None:
        """The app's answer now when it says it answers ``request`` at once; else None, and
        the answer comes from a worker thread through ``done``."""
        try:
            environ = self._environ(request, peer)
        except HttpError as exc:  # a target llhttp took but the URL parser does not
            reply = self.error_reply(exc.status, str(exc))
            reply.path = ""
            return reply
        site = self._site
        if site.inline(environ):
            return self._call_app(site, environ, request)
        self._workers.submit(self._loop, lambda: self._call_app(site, environ, request), done)
        return None

    def error_reply(self, status: int, message: str) -> Reply:
        body = (message + "\n").encode()
        headers = [
            (b"Content-Type", b"text/plain; charset=utf-8"),
            (b"Content-Length", str(len(body)).encode()),
            (b"Date", self._date()),
            *self._site.headers,
        ]
        return Reply(status, _REASONS.get(status, b""), headers, [body], None, close=True)

    def _call_app(self, site: _Site, environ: Environ, request: Request) -> Reply:
        """``site``'s answer to ``environ``; a 500 when its app raises."""
        started: list[Any] = []

        def start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], None]:
            started[:] = [status, headers]
            return lambda data: None  # the legacy write() callable: unused by our app

        try:
            result = site.app(environ, start_response)
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
            headers, sized = _own_headers(started[1])
        except Exception:
            log.exception("error serving %r", request.target)
            body = [b"internal error\n"]
            status, reason, headers = (
                500,
                "Internal Server Error",
                [(b"Content-Type", b"text/plain")],
            )
            sized = False
        if not sized:
            headers.append((b"Content-Length", str(sum(map(len, body))).encode()))
        headers.append((b"Date", self._date()))
        headers.extend(site.headers)
        return Reply(status, reason.encode("latin-1"), headers, body, environ["PATH_INFO"])

    def _environ(self, request: Request, peer: Any) -> Environ:
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


def _own_headers(headers: list[tuple[str, str]]) -> tuple[list[tuple[bytes, bytes]], bool]:
    """The app's headers as bytes, less those the server sets itself; and whether they hold a
    Content-Length (one pass: this runs for every request)."""
    out = []
    sized = False
    for name, value in headers:
        lower = name.lower()
        if lower in _HOP_BY_HOP:
            continue
        sized = sized or lower == "content-length"
        out.append((name.encode("latin-1"), value.encode("latin-1")))
    return out, sized


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value
