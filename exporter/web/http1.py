"""HTTP/1.1 without I/O: request heads found in the bytes fed under exact limits and parsed by
llhttp (Node.js's HTTP parser, through httptools); responses with Content-Length.

llhttp (https://github.com/nodejs/llhttp, Python binding https://github.com/MagicStack/httptools)
parses the request line and headers strictly: methods it does not know, control characters,
bare line feeds, obsolete line folding, a Content-Length that is not a number, Content-Length
together with Transfer-Encoding (a smuggling shape, RFC 9112 6.1) and transfer codings other than
chunked are refused (``400``). It says whether the client wants the connection kept (HTTP/1.1
unless ``Connection: close``; HTTP/1.0 only with ``Connection: keep-alive``) and whether a body
follows. This module adds what the parser leaves to its caller:

- **Exact size limits**, checked as the bytes arrive (:class:`HeadScanner`): the request line
  (``414``), each header line, the number of headers and the whole head (``431``), however the
  client cuts its bytes, and before the head ends (a request line that never ends is refused once
  it passes the limit, not at the deadline). The parser only ever sees one whole head.
- **Nothing about time or sockets**: the caller (``exporter.web.connection``) feeds the bytes
  as they arrive and keeps the deadlines; :attr:`Connection.started` says when a request's first
  byte came.
- ``400`` for an HTTP/1.1 request without ``Host`` or with two (RFC 9112 3.2), and ``505`` for a
  version other than HTTP/1.0 and 1.1.
- Empty lines before a request line are skipped (RFC 9112 2.2).
- The response head: status line, the app's headers, ``Connection: close`` when the connection
  ends after it. The app always gives ``Content-Length``.

Request bodies are never read: a request that has one is answered, then the connection closes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import httptools


@dataclass(frozen=True)
class Limits:
    """The largest request head accepted; every count includes what it names and nothing more
    (a line's length leaves out its line end; the head's includes every line end)."""

    max_head: int = 65536
    max_request_line: int = 8192
    max_header_line: int = 8192
    max_headers: int = 100


class HttpError(Exception):
    """The request cannot be served: answer ``status`` with a one-line message, then close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HeadScanner:
    """Finds where a request head ends and raises HttpError as soon as it is over a limit.

    :meth:`feed` takes the bytes as they arrive. A CR at the end of what arrived may be half a
    CRLF: it counts towards its line only once the next byte says it is not.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        #: A head no longer than this is within every size limit, whatever its lines.
        self._small = min(limits.max_head, limits.max_request_line, limits.max_header_line)
        self.reset()

    def reset(self) -> None:
        """Start a new head."""
        self._head = 0  # bytes of the head so far, line ends included
        self._line = 0  # bytes of the current line so far, a CR at its end included
        self._cr = False  # the current line, so far, ends with a CR
        self._headers = 0
        self._started = False  # a byte of the request line arrived
        self._in_request_line = True

    def feed(self, data: bytes) -> tuple[int, int]:
        """Scan ``data``: (where the head starts in it, past empty lines before a request line;
        where it ends, or -1 when it needs more)."""
        start = 0
        if not self._started:
            start = len(data) - len(data.lstrip(b"\r\n"))
            if start == len(data):
                return start, -1
            self._started = True
            end = self._small_head(data, start)
            if end != -1:
                return start, end
        pos = start
        limits = self.limits
        while True:
            newline = data.find(b"\n", pos)
            if newline == -1:
                if len(data) > pos:
                    self._line += len(data) - pos
                    self._head += len(data) - pos
                    self._cr = data[-1:] == b"\r"
                self._check_line(self._line - self._cr)
                if self._head + 1 > limits.max_head:  # the head still needs its last LF
                    raise _head_too_large(limits)
                return start, -1
            cr = data[newline - 1 : newline] == b"\r" if newline > pos else self._cr
            length = self._line + newline - pos - cr  # the line without its line end
            self._head += newline + 1 - pos
            self._check_line(length)
            if self._head > limits.max_head:
                raise _head_too_large(limits)
            pos = newline + 1
            self._line, self._cr = 0, False
            if self._in_request_line:
                self._in_request_line = False
            elif length == 0:
                return start, pos
            else:
                self._headers += 1
                if self._headers > limits.max_headers:
                    raise HttpError(431, f"more than {limits.max_headers} headers")

    def _small_head(self, data: bytes, start: int) -> int:
        """Where a whole head that arrived at once ends, when it is small enough to be within
        every limit and has no bare line feed (a scrape's head, in one ``recv``); else -1, and
        the line-by-line scan decides."""
        end = data.find(b"\r\n\r\n", start)
        if end == -1 or end + 4 - start > self._small:
            return -1
        if b"\n\n" in data[start : end + 2] or data.find(b"\n\r\n", start, end + 3) != -1:
            return -1  # an empty line before it: the head ends earlier
        if data.count(b"\n", start, end) > self.limits.max_headers:
            return -1
        return end + 4

    def _check_line(self, length: int) -> None:
        if self._in_request_line:
            if length > self.limits.max_request_line:
                raise HttpError(414, f"request line over {self.limits.max_request_line} bytes")
        elif length > self.limits.max_header_line:
            raise HttpError(431, f"header line over {self.limits.max_header_line} bytes")


def _head_too_large(limits: Limits) -> HttpError:
    return HttpError(431, f"request head over {limits.max_head} bytes")


@dataclass
class Request:
    """A parsed request head: method, target as sent, version (``1.1``) and headers as sent."""

    method: bytes = b""
    target: bytes = b""
    http_version: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class _Parsed:
    """httptools' callbacks for the request heads of one connection (llhttp starts a new
    message after each complete one, so a keep-alive connection keeps its parser)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.begin()

    def begin(self) -> None:
        """Ready for the next head."""
        self.request = Request()
        self.keep_alive = False
        self.complete = False  # the whole message arrived: there is no body

    def on_url(self, url: bytes) -> None:
        self.request.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.request.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # later, it speaks of the next one

    def on_message_complete(self) -> None:
        self.complete = True


def _from_llhttp(exc: httptools.HttpParserError) -> HttpError:
    """llhttp's messages are its own (it never quotes the client's bytes)."""
    if isinstance(exc, httptools.HttpParserInvalidMethodError):
        return HttpError(400, "malformed request line: unknown or invalid method")
    if isinstance(exc, httptools.HttpParserInvalidURLError):
        return HttpError(400, f"malformed request target: {exc}")
    return HttpError(400, f"malformed request head: {exc}")


class Connection:
    """One server connection's HTTP, without I/O: finds request heads in the bytes fed, writes
    response heads, says whether the connection can go on.

    :meth:`receive` takes the bytes as they arrive; :meth:`next_request` returns the next whole
    request head, parsed, once it is there (the bytes after it stay for the next call: pipelined
    requests); :meth:`response` makes the answer's bytes; :meth:`next_cycle` readies the next.
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._scanner = HeadScanner(limits)
        self._parsed = _Parsed()
        self._unscanned = b""  # bytes received and not yet scanned (a pipelined request)
        self._head: list[bytes] = []  # the current head's bytes so far
        self._started = False
        self.has_body = False  # the current request has a body (which is never read)
        self.method = b""
        self._keep = False
        self._http10 = False

    def receive(self, data: bytes) -> None:
        """Bytes from the client; scanned by the next :meth:`next_request`."""
        self._unscanned = self._unscanned + data if self._unscanned else data

    @property
    def started(self) -> bool:
        """Whether a byte of the next request's head (past empty lines) arrived."""
        return self._started

    @property
    def buffered(self) -> int:
        """Bytes held: the head so far and what came after it."""
        return len(self._unscanned) + sum(map(len, self._head))

    def next_request(self) -> Request | None:
        """The next request's head, parsed, or None while it is not all there.

        Raises HttpError as soon as the head is over a limit (before it ends), and for a bad
        head once it is whole.
        """
        data, self._unscanned = self._unscanned, b""
        if not data:
            return None
        start, end = self._scanner.feed(data)
        if start < len(data):
            self._started = True
        if end == -1:
            self._head.append(data[start:] if start else data)
            return None
        self._head.append(data[start:end])
        self._unscanned = data[end:]
        head = b"".join(self._head)
        self._head, self._started = [], False
        self._scanner.reset()
        return self._parse(head)

    def _parse(self, head: bytes) -> Request:
        parsed = self._parsed
        parsed.begin()
        upgrade = False
        try:
            parsed.parser.feed_data(head)
        except httptools.HttpParserUpgrade:  # CONNECT or Upgrade: the head is whole
            upgrade = True
        except httptools.HttpParserError as exc:
            raise _from_llhttp(exc) from None
        request = parsed.request
        request.method = self.method = parsed.parser.get_method()
        request.http_version = parsed.parser.get_http_version().encode("ascii")
        if request.http_version == b"0.9":
            raise HttpError(400, "HTTP/0.9 requests are not supported")
        if request.http_version not in (b"1.0", b"1.1"):
            version = request.http_version.decode("ascii")
            raise HttpError(505, f"HTTP/{version} is not supported")
        hosts = sum(1 for name, _ in request.headers if name.lower() == b"host")
        if hosts > 1:
            raise HttpError(400, "more than one Host header")
        if hosts == 0 and request.http_version == b"1.1":
            raise HttpError(400, "HTTP/1.1 request without a Host header")
        self.has_body = upgrade or not parsed.complete
        self._keep = parsed.keep_alive and not self.has_body
        self._http10 = request.http_version == b"1.0"
        return request

    def response(
        self,
        status: int,
        reason: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: Iterable[bytes],
        *,
        close: bool = False,
    ) -> list[bytes]:
        """The bytes of a response: its head, then ``body``'s parts as they are (not copied;
        none for HEAD). ``close``, a request body or the client's wish adds ``Connection: close``
        (and :attr:`keep_alive` says False). ``headers`` must hold ``Content-Length``."""
        lines = [b"HTTP/1.1 %d %s" % (status, reason)]
        lines += [name + b": " + value for name, value in headers]
        if close or not self._keep:
            lines.append(b"Connection: close")
            self._keep = False
        elif self._http10:  # HTTP/1.0 keeps a connection only when told so
            lines.append(b"Connection: keep-alive")
        out = [b"\r\n".join(lines) + b"\r\n\r\n"]
        if self.method != b"HEAD":
            out += [part for part in body if part]
        return out

    @property
    def keep_alive(self) -> bool:
        """Whether the connection can carry another request after this response."""
        return self._keep

    def next_cycle(self) -> None:
        """Ready for the next request on this connection (after a response, when keep_alive)."""
        self.has_body = False
        self.method = b""
        self._keep = False
