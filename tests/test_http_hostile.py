"""Hostile HTTP clients against the real server on loopback, over simulated GPUs.

Methods, malformed or oversized heads and queries, path traversal, floods of idle connections,
slowloris clients and TLS clients that never handshake. The routes' own errors are covered in
tests/test_http.py; this file adds what a hostile client can send. The parsing is llhttp's
(exporter/web/http1.py); the limits and deadlines are the server's.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import resource
import select
import shutil
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator

import bcrypt
import pytest

import exporter.web.server
from exporter.exposition.metrics import render
from exporter.sampling.sampler import Sampler
from exporter.web.http1 import Connection, HttpError, Limits, Request
from exporter.web.routes import App, Response, Route, Server, serve
from exporter.web.server import Options
from exporter.web.webconfig import WebConfig
from tests.test_http import Agent, wait_for

SCENARIO = "gpus: [{name: GPU A}, {name: GPU B}]\n"


@pytest.fixture(autouse=True)
def no_tracebacks(capfd, caplog) -> Iterator[None]:
    """Client misbehaviour is never a traceback on stderr, nor a warning in the log."""
    caplog.set_level(logging.DEBUG, logger="exporter")
    yield
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]


@pytest.fixture
def start(simulated, collector) -> Iterator[Callable[..., Server]]:
    """Start the real server over a sampled simulated host; closed after the test."""
    simulated(SCENARIO)
    sampler = Sampler(collector, interval=60, deadline=60, render=render)
    sampler.sample_once()
    started: list[Server] = []

    def run(
        options: Options | None = None,
        *,
        make_app: Callable[[Sampler], App] = App,
        web: WebConfig | None = None,
        **tls: str,
    ) -> Server:
        server = serve(make_app(sampler), "127.0.0.1", 0, options=options, web=web, **tls)
        started.append(server)
        return server

    yield run
    for server in started:
        server.close()


@pytest.fixture
def server(start) -> Server:
    return start()


def exchange(port: int, data: bytes, timeout: float = 5) -> bytes:
    """Send ``data`` raw and half-close (the server answers what it got, then sees the end and
    closes, keep-alive or not), then read until the server closes; what it answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        return read_to_eof(sock)


def read_to_eof(sock: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    assert answer.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")), answer[:200]
    return int(answer.split(b" ", 2)[1])


def head_and_body(answer: bytes) -> tuple[dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.decode().partition(":")
        headers[name.lower()] = value.strip()
    return headers, body


def get(port: int, target: str, method: str = "GET", extra: bytes = b"") -> bytes:
    return exchange(port, f"{method} {target} HTTP/1.1\r\nHost: x\r\n".encode() + extra + b"\r\n")


# -- methods ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"]
)
@pytest.mark.parametrize("path", ["/metrics", "/snapshot", "/", "/nope"])
def test_every_method_but_get_and_head_gets_405(server, method, path):
    answer = get(server.port, path, method)
    headers, body = head_and_body(answer)
    assert status_of(answer) == 405, answer
    assert headers["allow"] == "GET, HEAD" and f"{method} is not allowed".encode() in body


@pytest.mark.parametrize("method", ["BREW", "get", "G-T"])
def test_a_method_the_parser_does_not_know_gets_400(server, method):
    """llhttp knows the registered methods only: anything else is a malformed request line."""
    answer = get(server.port, "/metrics", method)
    assert status_of(answer) == 400 and b"unknown or invalid method" in answer, answer


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_the_answer_reaches_a_client_that_sent_a_body(server, method):
    """The body the server never reads does not turn its close into a reset that cuts the answer.

    The client's small receive window keeps most of the answer in the server's send queue,
    which a reset would throw away.
    """
    body = b"x" * 200_000
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(5)
        sock.connect(("127.0.0.1", server.port))
        head = f"{method} /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        time.sleep(0.2)  # the server has answered and closed by now
        answer = read_to_eof(sock)
    headers, got = head_and_body(answer)
    assert status_of(answer) == (405 if method == "POST" else 200)
    assert len(got) == int(headers["content-length"]) and (method == "POST" or len(got) > 8192)
    assert headers["connection"] == "close"  # the unread body ends the connection


# -- queries, request lines and headers -----------------------------------------------------


@pytest.mark.parametrize(
    ("target", "status", "needle"),
    [
        ("/metrics?" + "a" * 5000, 414, b"query string longer than 4096"),
        ("/snapshot?gpu=" + "0" * 6000, 414, b"query string longer than 4096"),
        ("/snapshot?gpu=%zz", 400, b"bad %-escape"),
        ("/snapshot?gpu=%4", 400, b"bad %-escape"),
        ("/snapshot?gpu=0%", 400, b"bad %-escape"),
        ("/snapshot?gpu=1&&", 400, b"malformed query string"),
        ("/snapshot?a=1&&", 400, b"malformed query string"),
        ("/snapshot?gpu=%00", 400, b"control character"),
        ("/snapshot?gpu%00=0", 400, b"control character"),
        ("/snapshot?gpu=%0a", 400, b"control character"),
        ("/snapshot?gpu=%ff", 400, b"malformed query string"),
        ("/snapshot?" + "gpu=0&" * 100, 400, b"malformed query string"),
        ("/snapshot?gpu=0&GPU=1", 400, b"unknown query parameter 'GPU'"),
        ("/healthz?verbose=1", 400, b"unknown query parameter 'verbose'"),
        ("/?x", 400, b"malformed query string"),
        ("/snapshot?gpu=\x00", 400, b"malformed request target"),
        ("/snapshot?gpu=\x7f", 400, b"malformed request target"),
        ("/snapshot?gpu=\xe9", 400, b"malformed request target"),
    ],
)
def test_malformed_and_huge_queries(server, target, status, needle):
    answer = get(server.port, target)
    assert status_of(answer) == status and needle in head_and_body(answer)[1], answer[:300]


@pytest.mark.parametrize("target", ["/metrics?" + "a" * 10_000, "/" + "a" * 100_000])
def test_request_line_over_the_limit_gets_414(server, target):
    answer = get(server.port, target)
    assert status_of(answer) == 414 and b"request line over 8192 bytes" in answer


def test_414_comes_before_the_line_ends(server):
    """A request line that never ends is refused once it passes the limit, not at the deadline."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /" + b"a" * 9000)  # no line end; the head deadline is 10 s
        assert status_of(read_to_eof(sock)) == 414


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (b"X-Big: " + b"a" * 10_000 + b"\r\n", b"header line over 8192 bytes"),
        (b"".join(b"X-%d: a\r\n" % i for i in range(101)), b"more than 100 headers"),
        (b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(90)), b"head over 65536"),
    ],
)
def test_huge_headers_get_431(server, extra, needle):
    answer = get(server.port, "/metrics", extra=extra)
    assert status_of(answer) == 431 and needle in answer


def test_the_head_limits_come_from_the_settings(start):
    """``web.max_head_bytes``: the head, and the request and header lines with it."""
    server = start(Options(max_head=2048))
    assert status_of(get(server.port, "/metrics", extra=b"X: " + b"a" * 1900 + b"\r\n")) == 200
    answer = get(server.port, "/metrics", extra=(b"X: " + b"a" * 1100 + b"\r\n") * 2)
    assert status_of(answer) == 431 and b"request head over 2048 bytes" in answer
    answer = get(server.port, "/" + "a" * 2100)
    assert status_of(answer) == 414 and b"request line over 2048 bytes" in answer


# -- the head limits, exactly ---------------------------------------------------------------

MAX_HEAD = exporter.web.server.MAX_HEAD
MAX_LINE = exporter.web.server.MAX_REQUEST_LINE
LIMITS = Limits(MAX_HEAD, MAX_LINE, exporter.web.server.MAX_HEADER_LINE)


def head_of(size: int, target: str = "/metrics") -> bytes:
    """A valid request head of exactly ``size`` bytes (line ends included), padded with headers
    of at most 8000 bytes."""
    start = f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
    pad = size - len(start) - 2
    count = -(-pad // 8000)
    lines = []
    for i in range(count):
        length = pad // count + (i < pad % count)  # each line's bytes, "X-Pad-NN: " and CRLF too
        lines.append(b"X-Pad-%02d: " % i + b"a" * (length - 12) + b"\r\n")
    head = start + b"".join(lines) + b"\r\n"
    assert len(head) == size
    return head


def pieces(data: bytes, delivery: str) -> list[bytes]:
    """``data`` cut as a client might send it: whole, in small pieces, or cut just before the
    head limit (so that one read holds bytes both sides of it)."""
    if delivery == "whole":
        return [data]
    if delivery == "small":
        return [data[i : i + 997] for i in range(0, len(data), 997)]
    assert delivery == "straddling"
    return [data[: MAX_HEAD - 3], data[MAX_HEAD - 3 :]]


DELIVERIES = ["whole", "small", "straddling"]


@pytest.mark.parametrize("delivery", DELIVERIES)
@pytest.mark.parametrize(
    ("size", "status"), [(MAX_HEAD - 1, 200), (MAX_HEAD, 200), (MAX_HEAD + 1, 431)]
)
def test_the_head_limit_is_exact(server, size, status, delivery):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece in pieces(head_of(size), delivery):
            sock.sendall(piece)
        answer = read_to_eof(sock)
    assert status_of(answer) == status, answer[:300]
    assert (b"gpu_up{" if status == 200 else b"request head over 65536 bytes") in answer


def read_scripted(chunks: list[bytes]) -> Request:
    """The first request in ``chunks``, fed one at a time as reads would deliver them."""
    http = Connection(LIMITS)
    for chunk in chunks:
        http.receive(chunk)
        request = http.next_request()
        if request is not None:
            return request
    raise AssertionError("no whole request head in the chunks")


def by_bytes(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


@pytest.mark.parametrize("delivery", [*DELIVERIES, "bytes"])
def test_read_head_limit_is_exact_however_the_bytes_arrive(delivery):
    cut = by_bytes if delivery == "bytes" else lambda data: pieces(data, delivery)
    for size in (MAX_HEAD - 1, MAX_HEAD):
        body = b"x" * 20_000  # what follows the head is no part of it
        assert read_scripted(cut(head_of(size) + body)).target == b"/metrics"
    with pytest.raises(HttpError, match="request head over 65536") as refused:
        read_scripted(cut(head_of(MAX_HEAD + 1)))
    assert refused.value.status == 431


def test_an_over_long_head_is_refused_before_its_end():
    """The head is refused once it is known to be too long, not when it ends (or never)."""
    head = head_of(MAX_HEAD + 1)
    assert head[MAX_HEAD:] == b"\n"  # the final LF, never fed
    http = Connection(LIMITS)
    http.receive(head[:MAX_HEAD])
    with pytest.raises(HttpError, match="request head over"):
        http.next_request()


@pytest.mark.parametrize("delivery", ["whole", "bytes"])
def test_a_small_head_in_one_read_meets_the_same_limits(delivery):
    """A head that arrives whole is taken without a line-by-line scan when it is small: the
    header count and an earlier empty line still decide, as for a head read byte by byte."""
    cut = by_bytes if delivery == "bytes" else (lambda data: [data])
    headers = b"".join(b"X-%d: a\r\n" % i for i in range(99))
    assert len(read_scripted(cut(b"GET / HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")).headers)
    with pytest.raises(HttpError, match="more than 100 headers"):
        read_scripted(cut(b"GET / HTTP/1.1\r\nHost: x\r\nX-99: a\r\n" + headers + b"\r\n"))
    for early_end in (b"\n\n", b"\n\r\n"):  # an empty line after a bare LF ends the head
        pipelined = b"GET /a HTTP/1.0" + early_end + b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n"
        with pytest.raises(HttpError, match="Expected CRLF after version") as refused:
            read_scripted(cut(pipelined))
        assert refused.value.status == 400


def request_line_of(length: int) -> bytes:
    target = b"/" + b"a" * (length - len(b"GET / HTTP/1.1"))
    line = b"GET " + target + b" HTTP/1.1"
    assert len(line) == length
    return line


@pytest.mark.parametrize("delivery", ["whole", "bytes", "split CRLF"])
def test_request_and_header_line_limits_are_exact(delivery):
    def cut(data: bytes) -> list[bytes]:
        if delivery == "bytes":
            return by_bytes(data)
        if delivery == "split CRLF":  # the CR of the first line end in one read, its LF in the next
            first = data.index(b"\r\n") + 1
            return [data[:first], data[first:]]
        return [data]

    at_limit = request_line_of(MAX_LINE) + b"\r\nHost: x\r\n\r\n"
    assert len(read_scripted(cut(at_limit)).target) == MAX_LINE - len("GET  HTTP/1.1")
    with pytest.raises(HttpError, match="request line over") as refused:
        read_scripted(cut(request_line_of(MAX_LINE + 1) + b"\r\nHost: x\r\n\r\n"))
    assert refused.value.status == 414
    header = b"X: " + b"a" * (exporter.web.server.MAX_HEADER_LINE - 3)
    at_limit = header + b"\r\n\r\n"
    assert read_scripted([b"GET / HTTP/1.0\r\n", *cut(at_limit)]).headers[0][0] == b"X"
    with pytest.raises(HttpError, match="header line over") as refused:
        read_scripted([b"GET / HTTP/1.0\r\n", *cut(b"a" + at_limit)])
    assert refused.value.status == 431


@pytest.mark.parametrize(
    ("raw", "status", "needle"),
    [
        (b"GET /metrics\r\n\r\n", 400, b"HTTP/0.9"),
        (b"GARBAGE\r\n\r\n", 400, b"malformed request line"),
        (b"\r\n\r\n\r\n", None, None),  # empty lines only: no request yet; client closes
        (b"GET /metrics HTTP/1.1 x\r\nHost: x\r\n\r\n", 400, b"malformed request head"),
        (b"GET /metrics HTTP/2.0\r\nHost: x\r\n\r\n", 505, b"HTTP/2.0 is not supported"),
        (b"GET /metrics HTTP/1\r\nHost: x\r\n\r\n", 400, b"malformed request head"),
        (b"GET /metrics FTP/1.1\r\nHost: x\r\n\r\n", 400, b"malformed request head"),
        (b"G(T /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"malformed request line"),
        (b"GET /met\x01rics HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"malformed request target"),
        (b"GET /m\xe9trics HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"malformed request target"),
        (b"GET http://[::1/metrics HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"malformed request target"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, b"malformed request line"),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nno colon\r\n\r\n", 400, b"malformed request head"),
        (
            b"GET /metrics HTTP/1.1\r\nBad Name: a\r\nHost: x\r\n\r\n",
            400,
            b"malformed request head",
        ),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400, b"malformed request head"),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX: a\r\n folded\r\n\r\n", 400, b"whitespace"),
        (b"GET /metrics HTTP/1.1\nHost: x\n\n", 400, b"malformed request head"),  # bare LFs
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n", 400, b"Content-Length"),
        (
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
            400,
            b"Transfer-Encoding",
        ),
        # The three the issue names:
        (b"GET /metrics HTTP/1.1\r\n\r\n", 400, b"HTTP/1.1 request without a Host header"),
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, b"more than one Host header"),
        (
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nabc",
            400,
            b"Transfer-Encoding can't be present with Content-Length",
        ),
    ],
)
def test_malformed_heads_get_400(server, raw, status, needle):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(raw)
        if status is None:
            sock.shutdown(socket.SHUT_WR)
            assert read_to_eof(sock) == b""
            return
        answer = read_to_eof(sock)  # no SHUT_WR: the server must answer on its own, and close
    assert status_of(answer) == status and needle in head_and_body(answer)[1], answer
    assert head_and_body(answer)[0]["connection"] == "close" and answer.count(b"\r\nDate: ") == 1


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /metrics HTTP/1.0\r\n\r\n",
        b"\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",  # a stray line end before it
        b"GET http://example.com/metrics HTTP/1.1\r\nHost: example.com\r\n\r\n",
        b"GET  /metrics HTTP/1.1\r\nHost: x\r\n\r\n",  # two spaces: llhttp takes them
    ],
)
def test_odd_but_valid_heads_are_served(server, raw):
    answer = exchange(server.port, raw)
    assert status_of(answer) == 200 and b"gpu_up{" in answer


def test_pipelined_requests_are_answered_in_order(server):
    """Two requests in one send: both answered, in order, on the one connection."""
    two = b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\nGET /snapshot?gpu=7 HTTP/1.1\r\nHost: x\r\n\r\n"
    answer = exchange(server.port, two)
    assert answer.count(b"HTTP/1.1 404 ") == 2, answer
    assert answer.index(b"no such path '/nope'") < answer.index(b"no GPU '7'")
    assert b"connection: close" not in answer.lower()


def test_head(server):
    headers, body = head_and_body(
        exchange(server.port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    )
    assert body == b"" and int(headers["content-length"]) > 0


def test_client_resets_and_early_closes_are_quiet(server):
    for data in (b"", b"GET /metr", b"GET /metrics HTTP/1.1\r\nHost:"):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(data)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # SO_LINGER 0: a reset
    wait_for(lambda: server.httpd.connections == 0)
    assert status_of(get(server.port, "/metrics")) == 200


# -- path traversal ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/../../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/..%2f..%2fetc%2fpasswd",
        "/%2e%2e%5c%2e%2e%5cetc%5cpasswd",
        "//etc/passwd",
        "/metrics/../../etc/passwd",
        "/metrics/",
        "/snapshot%00",
        "/snapshot%00.json",
        "/./metrics",
        "http://x/../../etc/passwd",
        "/../../../../../../../..{secret}",
        "/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e{secret}",
    ],
)
def test_no_path_traversal(server, tmp_path, target):
    secret = tmp_path / "secret.txt"
    secret.write_text("sentinel-3f9c1 root:x:0:0\n")
    answer = get(server.port, target.format(secret=secret))
    assert status_of(answer) == 404, answer[:300]
    assert b"sentinel-3f9c1" not in answer and b"root:x:0:0" not in answer
    assert b"no such path" in answer


# -- floods and slow clients ---------------------------------------------------------------


@pytest.fixture
def many_files() -> Iterator[None]:
    """Room for 500 client and 500 server sockets in this one process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 1500
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {needed}")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def scrape(port: int) -> tuple[int, bytes]:
    status, _, body = Agent(None, port).get("/metrics")  # a 5 s timeout: a liveness bound
    return status, body


def test_500_idle_connections_do_not_stop_a_scrape(start, many_files):
    server = start(Options(head_timeout=60.0))  # they stay open meanwhile
    idle: list[socket.socket] = []
    try:
        for i in range(500):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            if i % 2:  # half send the start of a request and stop
                sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            idle.append(sock)
        wait_for(lambda: server.httpd.connections >= 500, timeout=10)  # all held by the server
        status, body = scrape(server.port)
        assert status == 200 and b"gpu_up{" in body
        assert server.httpd.connections >= 500  # they were still open during the scrape
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: server.httpd.connections == 0, timeout=10)


class Trickler(threading.Thread):
    """Clients that send a request head one byte per round and never finish it.

    Records when the server closed each one (a read sees EOF or a reset, or a send fails), and
    what the server said first.
    """

    HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "

    def __init__(self, port: int, count: int, period: float, give_up: float) -> None:
        super().__init__(daemon=True)
        self.socks = [
            socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)
        ]
        self.period, self.give_up = period, give_up
        self.sent = dict.fromkeys(self.socks, 0)
        self.closed_after: dict[socket.socket, float] = {}
        self.said: dict[socket.socket, bytes] = {}
        self.started = time.monotonic()

    def run(self) -> None:
        while time.monotonic() - self.started < self.give_up:
            open_socks = [s for s in self.socks if s not in self.closed_after]
            if not open_socks:
                return
            readable, _, _ = select.select(open_socks, [], [], 0)
            for sock in readable:
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if data:
                    self.said.setdefault(sock, data)
                else:
                    self.closed_after[sock] = time.monotonic() - self.started
            for sock in open_socks:
                if sock in self.closed_after:
                    continue
                n = self.sent[sock]
                byte = self.HEAD[n : n + 1] or b"a"
                try:
                    sock.send(byte)
                except OSError:
                    self.closed_after[sock] = time.monotonic() - self.started
                self.sent[sock] = n + 1
            time.sleep(self.period)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def test_slowloris_clients_do_not_stop_scrapes_and_are_cut_at_the_head_deadline(start):
    server = start(Options(head_timeout=3.0))
    # A byte every 0.1 s: a per-read timeout of any length would never fire.
    slow = Trickler(server.port, 50, period=0.1, give_up=15)
    slow.start()
    try:
        wait_for(lambda: min(slow.sent.values()) >= 2)
        held = server.httpd.connections
        for _ in range(3):
            status, body = scrape(server.port)
            assert status == 200 and b"gpu_up{" in body
        slow.join(20)
        assert held >= 50
        assert len(slow.closed_after) == 50, "slow clients still open while they kept sending"
        assert min(slow.closed_after.values()) >= 3.0 - 0.5  # not before the deadline
        assert all(said.startswith(b"HTTP/1.1 408 ") for said in slow.said.values()), slow.said
    finally:
        slow.close()
    wait_for(lambda: server.httpd.connections == 0)


def test_a_client_that_never_reads_is_cut_off_at_the_write_deadline(start):
    """Pipelined requests from a client that reads nothing: the server answers while the kernel
    takes the bytes, then stops (it reads no more requests while an answer waits) and drops the
    connection at the write deadline; other scrapes go on meanwhile."""
    server = start(Options(write_timeout=1.0))
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.send(request * 5000)  # far more answers than the kernel's buffers hold
        started = time.monotonic()
        assert scrape(server.port)[0] == 200
        wait_for(lambda: server.httpd.connections == 0, timeout=10)  # while it is still open
        assert time.monotonic() - started >= 1.0 - 0.3


def test_408_to_a_client_that_stops_mid_head(start):
    server = start(Options(head_timeout=0.5))
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        answer = read_to_eof(sock)
    assert status_of(answer) == 408 and b"request head not received in time" in answer


def test_connections_beyond_the_cap_are_closed_at_once(start):
    server = start(Options(max_connections=5))
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(5)]
    try:
        wait_for(lambda: server.httpd.connections == 5)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            extra.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            assert read_to_eof(extra) == b""  # closed without an answer, before the deadline
        assert server.httpd.rejected >= 1 and server.httpd.connections == 5
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: server.httpd.connections == 0)
    assert scrape(server.port)[0] == 200


# -- slow work stays off the loop -----------------------------------------------------------


class GatedApp(App):
    """``/snapshot`` waits for ``gate`` (a route stuck in slow work); ``entered`` says it is."""

    def __init__(self, sampler: Sampler, gate: threading.Event, entered: threading.Event) -> None:
        super().__init__(sampler)
        self.gate, self.entered = gate, entered

    def snapshot(self, params, environ):
        self.entered.set()
        self.gate.wait(20)
        return super().snapshot(params, environ)


def answered(sock: socket.socket) -> bool:
    """Whether the server has sent something on ``sock`` (without waiting)."""
    return bool(select.select([sock], [], [], 0)[0])


def test_a_request_stuck_in_a_slow_route_does_not_delay_another_connection(start):
    gate, entered = threading.Event(), threading.Event()
    server = start(make_app=lambda sampler: GatedApp(sampler, gate, entered))
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as stuck:
        stuck.sendall(b"GET /snapshot HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            assert entered.wait(5)
            for _ in range(3):
                started = time.monotonic()
                status, body = scrape(server.port)
                assert status == 200 and b"gpu_up{" in body
                assert time.monotonic() - started < 1.0
                assert status_of(get(server.port, "/healthz")) in (200, 503)
            assert not answered(stuck)  # still stuck meanwhile
        finally:
            gate.set()
        stuck.shutdown(socket.SHUT_WR)
        answer = read_to_eof(stuck)
    assert status_of(answer) == 200 and b'"gpus"' in answer


def test_a_route_that_says_nothing_runs_on_a_worker_thread(start):
    """A route declared without ``inline`` (the default) blocks a worker, not the loop: while
    it waits, scrapes and /healthz on other connections are answered, and its connection is
    answered once it returns."""
    gate, entered = threading.Event(), threading.Event()
    ran_on: list[str] = []

    def slow(params, environ) -> Response:
        ran_on.append(threading.current_thread().name)
        entered.set()
        gate.wait(20)
        return Response("200 OK", "text/plain", b"done\n")

    server = start(make_app=lambda sampler: App(sampler, routes={"/slow": Route(slow)}))
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as stuck:
        stuck.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            assert entered.wait(5)
            status, body = scrape(server.port)  # on the loop it would wait for the gate
            assert status == 200 and b"gpu_up{" in body
            assert status_of(get(server.port, "/healthz")) in (200, 503)
            assert not answered(stuck)
        finally:
            gate.set()
        stuck.shutdown(socket.SHUT_WR)
        answer = read_to_eof(stuck)
    assert status_of(answer) == 200 and answer.endswith(b"done\n")
    assert ran_on and ran_on[0] != "http-loop", ran_on


def test_close_is_prompt_whatever_the_connections_are_doing(start):
    """Idle and half-sent connections are closed at once; one whose answer is stuck in a route
    is dropped after a short grace: close() returns, and the clients see their end."""
    gate, entered = threading.Event(), threading.Event()
    server = start(make_app=lambda sampler: GatedApp(sampler, gate, entered))
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(3)]
    idle, partial, stuck = socks
    try:
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(65536).startswith(b"HTTP/1.1 ")
        partial.sendall(b"GET /metrics HTTP/1.1\r\n")
        stuck.sendall(b"GET /snapshot HTTP/1.1\r\nHost: x\r\n\r\n")
        assert entered.wait(5)
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 3
        assert read_to_eof(idle) == b"" and read_to_eof(partial) == b""
        assert read_to_eof(stuck) == b""
    finally:
        gate.set()
        for sock in socks:
            sock.close()


def basic(user: str, password: str) -> bytes:
    return b"Authorization: Basic " + base64.b64encode(f"{user}:{password}".encode()) + b"\r\n"


def test_bcrypt_checks_do_not_delay_a_scrape_whose_password_is_remembered(start):
    """Wrong passwords cost a bcrypt check each (one at a time, ~0.25 s here); a scraper whose
    password passed lately is answered at once, not after the checks queued before it."""
    hashed = bcrypt.hashpw(b"wonderland", bcrypt.gensalt(12))
    server = start(web=WebConfig(path="web.yml", users={"alice": hashed}))
    good = get(server.port, "/metrics", extra=basic("alice", "wonderland"))
    assert status_of(good) == 200  # checked once; remembered from now on
    bad = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3)]
    try:
        for sock in bad:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + basic("alice", "x") + b"\r\n")
        select.select(bad, [], [], 10)  # the first check is done: the others are queued
        answer = get(server.port, "/metrics", extra=basic("alice", "wonderland"))
        assert status_of(answer) == 200 and b"gpu_up{" in answer
        assert not all(answered(sock) for sock in bad), "the scrape waited for the checks"
        for sock in bad:
            sock.shutdown(socket.SHUT_WR)
            assert status_of(read_to_eof(sock)) == 401
    finally:
        for sock in bad:
            sock.close()


# -- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    from tests.test_tls import _make_pki

    return _make_pki(tmp_path_factory.mktemp("pki"))


def test_tls_client_that_never_handshakes_does_not_block_others(start, pki):
    server = start(
        Options(head_timeout=2.0),
        cert_file=pki["server.pem"],
        key_file=pki["server.key"],
        client_ca_file=pki["ca.pem"],
    )
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3)]
    half = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    half.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello, cut short
    try:
        context = ssl.create_default_context(cafile=pki["ca.pem"])
        context.load_cert_chain(pki["client.pem"], pki["client.key"])
        for _ in range(2):
            with (
                socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw,
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = read_to_eof(tls)
            assert status_of(answer) == 200 and b"gpu_up{" in answer
        # The silent ones are cut at the deadline, not held forever.
        for sock in [*silent, half]:
            assert read_to_eof(sock) == b""
    finally:
        for sock in [*silent, half]:
            sock.close()
    wait_for(lambda: server.httpd.connections == 0)


def test_tls_handshake_sent_byte_by_byte_is_cut_at_the_deadline(start, pki):
    """The head deadline covers the whole handshake, not each read of it."""
    server = start(
        Options(head_timeout=1.0), cert_file=pki["server.pem"], key_file=pki["server.key"]
    )
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = ssl.create_default_context(cafile=pki["ca.pem"]).wrap_bio(
        incoming, outgoing, server_hostname="127.0.0.1"
    )
    with contextlib.suppress(ssl.SSLWantReadError):
        client.do_handshake()
    hello = outgoing.read()  # a real ClientHello, some hundreds of bytes
    assert len(hello) > 100
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        for i in range(len(hello)):  # 0.05 s a byte: the whole hello would take > 5 s
            try:
                sock.send(hello[i : i + 1])
            except OSError:
                break
            if select.select([sock], [], [], 0.05)[0]:
                assert read_to_eof(sock) == b""
                break
        closed_after = time.monotonic() - started
    assert i < len(hello) - 1, "the server waited for the whole trickled handshake"
    assert closed_after >= 1.0 - 0.3
    wait_for(lambda: server.httpd.connections == 0)


def test_tls_errors_are_quiet(start, pki):
    server = start(
        cert_file=pki["server.pem"], key_file=pki["server.key"], client_ca_file=pki["ca.pem"]
    )
    assert exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n") == b""  # plain HTTP on TLS
    anonymous = ssl.create_default_context(cafile=pki["ca.pem"])  # no client certificate
    with (
        socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw,
        contextlib.suppress(ssl.SSLError, ConnectionError),
        anonymous.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        assert not tls.recv(100).startswith(b"HTTP/")
    wait_for(lambda: server.httpd.connections == 0)


def test_without_uvloop_the_server_runs_on_asyncios_loop(start, monkeypatch):
    """uvloop is optional: where it is missing, asyncio's own loop serves alike."""
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    loop = exporter.web.server.new_loop()
    assert type(loop).__module__.startswith("asyncio")
    loop.close()
    server = start(Options(head_timeout=0.5))
    pipelined = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 3
    answer = exchange(server.port, pipelined)
    assert answer.count(b"HTTP/1.1 200 OK") == 3 and answer.count(b"gpu_up{") >= 3
    assert status_of(get(server.port, "/nope")) == 404
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finished: refused at the deadline
        assert status_of(read_to_eof(sock)) == 408
