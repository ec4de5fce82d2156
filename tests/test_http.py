"""The HTTP routes on a real loopback socket, over a real sampler thread."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import socket
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.sampler import Sampler
from exporter.web.routes import (
    App,
    Response,
    Route,
    accept_encoding_weights,
    gzip_preferred,
    openmetrics_preferred,
    serve,
)

SCENARIO = """
gpus:
  - name: GPU A
    processes: [{pid: self, memory: 1GiB}]
  - name: GPU B
"""
HANGING = SCENARIO + "    errors: [{field: power, hang: 1.2s, from: 0.6s, until: 0.7s}]\n"


class Agent:
    def __init__(self, sampler: Sampler, port: int) -> None:
        self.sampler, self.port = sampler, port

    def get(self, path: str, method: str = "GET", headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request(method, path, headers=headers or {})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def agent(request) -> Iterator[Agent]:
    from exporter.config.yamlconf import parse_document
    from exporter.simulate.driver import SimulatedDriver, parse_scenario

    text = getattr(request, "param", SCENARIO)
    driver = SimulatedDriver(parse_scenario(parse_document(text).root())).start()
    collector = Collector(Nvml(library=driver), ProcFs())
    sampler = Sampler(collector, interval=0.1, deadline=0.2, render=render)
    server = serve(App(sampler), "127.0.0.1", 0)
    sampler.start()
    wait_for(lambda: sampler.latest is not None)
    try:
        yield Agent(sampler, server.port)
    finally:
        server.close()
        sampler.stop(3)
        collector.close()
        driver.stop()


def test_routes(agent):
    status, headers, body = agent.get("/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {
        "gpu_up",
        "gpu_info",
        "gpu_exporter_snapshot_stale",
        "gpu_process_memory_used_bytes",
    } <= names
    status, _, body = agent.get("/healthz")
    assert (status, body) == (200, b"ok\n")
    status, headers, body = agent.get("/snapshot")
    snap = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert [g["index"] for g in snap["gpus"]] == [0, 1] and snap["health"]["ok"]
    status, _, body = agent.get(f"/snapshot?gpu={snap['gpus'][1]['uuid']}")
    assert status == 200 and [g["index"] for g in json.loads(body)["gpus"]] == [1]
    status, _, body = agent.get("/snapshot?gpu=0&gpu=1")
    assert status == 200 and len(json.loads(body)["gpus"]) == 2
    status, headers, body = agent.get("/")
    assert status == 200 and b"/metrics" in body and headers["Content-Type"].startswith("text/html")


def test_gzip(agent):
    status, headers, body = agent.get("/metrics", headers={"Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert b"gpu_up" in gzip.decompress(body)


@pytest.mark.parametrize(
    ("accept_encoding", "gzipped"),
    [
        (None, False),
        ("", False),
        ("gzip", True),
        ("GZIP", True),
        ("x-gzip", True),
        ("X-Gzip;q=0.5", True),
        ("deflate, gzip, br, zstd", True),  # curl --compressed
        ("gzip, deflate, br", True),  # browsers
        ("gzip;q=0, identity", False),
        ("gzip;q=0", False),
        ("gzip; q=0.000", False),
        ("x-gzip;q=0", False),
        ("gzip;q=0.001", True),
        ("gzip ; Q=1.000", True),
        ("gzip;q = 0.5", True),
        ("\tgzip\t;\tq=1\t", True),
        ("gzip;q=0.5", True),  # identity, unnamed, loses to any coding named
        ("gzip;q=0.5, identity", False),
        ("gzip;q=0.5, identity;q=0.5", True),
        ("gzip;q=0.4, identity;q=0.5", False),
        ("identity;q=0, gzip;q=0.1", True),
        ("identity", False),
        ("x-gzipish", False),
        ("gzipfoo", False),
        ("gzip2, xgzip, agzip", False),
        ("*", True),
        ("*;q=0", False),
        ("*;q=0.5, identity", False),
        ("*, gzip;q=0", False),
        ("*;q=0, gzip", True),
        ("*;q=0.5, identity;q=0.1", True),
        ("deflate", False),
        ("gzip, gzip;q=0", False),  # named twice: the lower weight counts
        (",, gzip ,", True),
        # A malformed weight or parameter: that entry is not acceptable.
        ("gzip;q=2", False),
        ("gzip;q=1.001", False),
        ("gzip;q=0.0001", False),
        ("gzip;q=-1", False),
        ("gzip;q=.5", False),
        ("gzip;q=", False),
        ("gzip;q", False),
        ("gzip;", False),
        ("gzip;q=0.5;q=1", False),
        ("gzip;level=9", False),
        ("gzip;q=0.\u0665", False),  # an Arabic-Indic 5: ASCII digits only
        ("gzip;q=\uff11", False),
        ("gzip;q=1_0", False),
        ("gzip;q=nan", False),
        ("gzip;q=bad, identity", False),
        ("gzip q=1", False),
        ("g\u00e9zip, gzip", True),
    ],
)
def test_gzip_negotiation(accept_encoding, gzipped):
    assert gzip_preferred(accept_encoding) is gzipped


def test_accept_encoding_weights():
    assert accept_encoding_weights("GZip;q=0.5, x-gzip;q=0.7, *, identity;q=bad, x-gzipish") == {
        "gzip": 0.5,
        "*": 1.0,
        "identity": 0.0,
        "x-gzipish": 1.0,
    }


@pytest.mark.parametrize(
    ("accept_encoding", "gzipped"),
    [("gzip;q=0, identity", False), ("x-gzipish", False), ("x-gzip", True), ("*", True)],
)
def test_gzip_only_when_preferred(agent, accept_encoding, gzipped):
    status, headers, body = agent.get("/metrics", headers={"Accept-Encoding": accept_encoding})
    assert status == 200 and ("Content-Encoding" in headers) is gzipped
    assert b"gpu_up" in (gzip.decompress(body) if gzipped else body)


@pytest.mark.parametrize(
    ("path", "method", "status", "needle"),
    [
        ("/nope", "GET", 404, b"no such path"),
        ("/../etc/passwd", "GET", 404, b"no such path"),
        ("/metrics?foo=1", "GET", 400, b"unknown query parameter 'foo'"),
        ("/snapshot?gpu=7", "GET", 404, b"no GPU '7'"),
        ("/snapshot?gpu=", "GET", 404, b"no GPU ''"),
        ("/snapshot?gpu", "GET", 400, b"malformed query string"),
        ("/snapshot?&&=", "GET", 400, b"malformed query string"),
        ("/snapshot?" + "gpu=0&" * 1000, "GET", 414, b"longer than"),
        ("/metrics", "POST", 405, b"POST is not allowed"),
        ("/healthz", "DELETE", 405, b"DELETE is not allowed"),
    ],
)
def test_bad_requests_get_clear_errors(agent, path, method, status, needle):
    got, headers, body = agent.get(path, method)
    assert got == status and needle in body, body
    if status == 405:
        assert headers["Allow"] == "GET, HEAD"


@pytest.fixture
def recommending(simulated, collector) -> Iterator[Agent]:
    """An agent with the action engine, over a sampled simulated host."""
    from exporter.actions.engine import ActionEngine, ActionsConfig

    simulated(SCENARIO)
    sampler = Sampler(collector, interval=60, deadline=60, render=render)
    sampler.sample_once()
    engine = ActionEngine(sampler, ActionsConfig(), ProcFs(), "/nonexistent")
    server = serve(App(sampler, engine), "127.0.0.1", 0)
    try:
        yield Agent(sampler, server.port)
    finally:
        server.close()


@pytest.mark.parametrize(
    "value", ["%C2%B2", "%D9%A0", "%EF%BC%91", "0x1", "0,%C2%B2", "foo", "1" * 4000 + "x"]
)
def test_recommend_refuses_a_malformed_visible(recommending, value):
    status, _, body = recommending.get(f"/recommend?visible={value}")
    assert status == 400 and body.startswith(b"visible: "), body
    assert b"is no GPU index (ASCII digits), GPU UUID or MIG device" in body


@pytest.mark.parametrize(
    ("value", "chosen", "status"),
    [
        ("1", [1], 200),
        ("%201%20", [1], 200),
        ("0,-1,1", [0], 200),
        ("-1", [], 409),
        ("", [], 409),
        ("7", [], 409),
        ("1" * 4000, [], 409),
    ],
)
def test_recommend_reads_visible_as_cuda_does(recommending, value, chosen, status):
    got, _, body = recommending.get(f"/recommend?visible={value}")
    assert got == status and [c["index"] for c in json.loads(body)["chosen"]] == chosen, body


def test_head(agent):
    status, headers, body = agent.get("/metrics", "HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


@pytest.mark.parametrize("agent", [HANGING], indirect=True)
def test_hung_sample_keeps_serving_reports_stale_and_recovers(agent):
    sampler = agent.sampler
    wait_for(lambda: not sampler.health().ok, timeout=5)  # GPU B's power call hangs 1.2 s
    status, _, body = agent.get("/healthz")
    assert status == 503 and body.startswith(b"stale: last sample")
    status, _, body = agent.get("/metrics")
    assert status == 200
    found = {
        s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
    }
    assert found["gpu_exporter_snapshot_stale"] == 1
    assert found["gpu_exporter_snapshot_age_seconds"] > 0.3
    wait_for(lambda: sampler.health().ok, timeout=5)
    assert agent.get("/healthz")[0] == 200
    assert sampler.stats.deadline_exceeded_total >= 1


def test_no_route_calls_nvml_or_procfs(simulated, collector, clock, monkeypatch):
    """Scrapes, /snapshot and /recommend read the published Snapshot only."""
    from exporter.actions.engine import ActionEngine, ActionsConfig
    from exporter.core.procfs import ProcFs

    driver = simulated(SCENARIO)
    sampler = Sampler(collector, interval=60, deadline=60, monotonic=clock, render=render)
    sampler.sample_once()
    engine = ActionEngine(sampler, ActionsConfig(), ProcFs(), "/nonexistent")
    reads = []
    real_open = open

    def counting_open(path, *args, **kwargs):
        if str(path).startswith("/proc"):
            reads.append(path)
        return real_open(path, *args, **kwargs)

    server = serve(App(sampler, engine), "127.0.0.1", 0)
    try:
        calls = sum(driver.calls.values())
        monkeypatch.setattr("builtins.open", counting_open)
        agent = Agent(sampler, server.port)
        for path in ("/metrics", "/snapshot", "/recommend", "/healthz", "/") * 40:
            assert agent.get(path)[0] in (200, 409)
        monkeypatch.undo()
        assert sum(driver.calls.values()) == calls
        assert reads == []
    finally:
        server.close()


# -- keep-alive, the server's own metrics, OpenMetrics ------------------------------------------


@pytest.fixture
def quick(simulated, collector) -> Iterator[Callable[..., Agent]]:
    """``quick(**options)``: the real server with ``Options(**options)`` over a sampled host."""
    from exporter.web.server import Options

    simulated(SCENARIO)
    sampler = Sampler(collector, interval=60, deadline=60, render=render)
    sampler.sample_once()
    started = []

    def start(**options) -> Agent:
        app = App(sampler)
        server = serve(app, "127.0.0.1", 0, options=Options(**options))
        started.append(server)
        agent = Agent(sampler, server.port)
        agent.server, agent.app = server, app
        return agent

    yield start
    for server in started:
        server.close()


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` (EOF) within ``timeout``: waits on the socket."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_keep_alive_serves_requests_on_one_connection(quick):
    agent = quick()
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=5)
    try:
        for path in ("/metrics", "/healthz", "/metrics"):
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
            assert response.status in (200, 503) and response.getheader("Connection") is None
        assert b"gpu_up{" in body
        local = conn.sock.getsockname()
        conn.request("GET", "/metrics")
        conn.getresponse().read()
        assert conn.sock.getsockname() == local  # still the first connection
        assert agent.server.httpd.connections == 1
        totals = dict(((p, c), n) for p, c, n in agent.app.http.snapshot()[2])
        assert totals[("/metrics", 200)] == 3
    finally:
        conn.close()


def test_connection_close_is_honoured(quick):
    agent = quick()
    with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert b"\r\nConnection: close\r\n" in answer and answer.count(b"HTTP/1.1 ") == 1


def test_http_1_0_keeps_the_connection_only_when_asked(quick):
    agent = quick()
    with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):  # to EOF: the server closes
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 ") and b"\r\nConnection: close\r\n" in answer
    with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        answer = sock.recv(65536)
        assert b"\r\nConnection: keep-alive\r\n" in answer
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        second = b""
        while chunk := sock.recv(65536):
            second += chunk
        assert second.startswith(b"HTTP/1.1 ") and b"\r\nConnection: close\r\n" in second


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(quick):
    agent = quick(keepalive_timeout=0.5)
    with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 ")
        started = time.monotonic()
        assert closed_by_server(sock, 5)  # EOF, without a word
        assert 0.4 <= time.monotonic() - started < 3
    wait_for(lambda: agent.server.httpd.connections == 0)


def test_keepalive_timeout_0_closes_after_every_response(quick):
    agent = quick(keepalive_timeout=0)
    _, headers, _ = agent.get("/healthz")
    assert headers["Connection"] == "close"


def test_the_head_deadline_applies_to_every_request_on_a_connection(quick):
    agent = quick(head_timeout=0.5, keepalive_timeout=30)
    with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 ")
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # the second head, never finished
        started = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 ") and 0.4 <= time.monotonic() - started < 3
    assert agent.app.http.rejected == 1


def http_samples(agent: Agent) -> dict:
    _, _, body = agent.get("/metrics")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
        if s.name.startswith(("gpu_exporter_http_", "process_"))
    }


def test_the_server_exports_its_own_state(quick):
    agent = quick(max_connections=3)
    idle = [socket.create_connection(("127.0.0.1", agent.port), timeout=5) for _ in range(2)]
    try:
        wait_for(lambda: agent.server.httpd.connections == 2)
        extra = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
        wait_for(lambda: agent.server.httpd.connections == 3)
        with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as refused:
            assert closed_by_server(refused, 5)  # the fourth: over the cap
        extra.close()
        wait_for(lambda: agent.server.httpd.connections == 2)
        agent.get("/nope")
        wait_for(lambda: agent.server.httpd.connections == 2)  # its connection gone too
        found = http_samples(agent)
    finally:
        for sock in idle:
            sock.close()
    assert found[("gpu_exporter_http_connections", ())] == 3  # two idle and the scrape's
    assert found[("gpu_exporter_http_rejected_connections_total", ())] == 1
    assert found[("gpu_exporter_http_requests_total", (("code", "404"), ("path", "other")))] == 1


def test_only_routes_that_hand_out_bytes_made_before_stay_on_the_event_loop(quick):
    """``App.inline``: the server calls the app on its loop for the routes that say so (the
    exposition, /healthz, the page's assets), and on a worker thread for every other: the
    default, so a new route that does work per request cannot stall the loop. A route made
    inline without changing this test fails it."""
    app = quick().app
    on_loop = {"/metrics", "/healthz", *(p for p in app.routes if p.startswith("/static/"))}
    assert {path for path, route in app.routes.items() if route.inline} == on_loop
    for path in (*on_loop, "/nope"):
        assert app.inline({"PATH_INFO": path, "REQUEST_METHOD": "GET"}), path
    for path in ("/", "/snapshot", "/history", "/recommend", "/health/gpus", "/peers"):
        assert not app.inline({"PATH_INFO": path, "REQUEST_METHOD": "GET"}), path
    assert Route(app.landing).inline is False  # what a route gets when it says nothing


def test_another_module_adds_routes_to_the_table(simulated, collector):
    """``App(routes=...)``: served, counted by their path, placed as they say; a path the app
    serves already is refused."""

    def hello(params, environ) -> Response:
        return Response("200 OK", "text/plain", f"hello {params.get('who', ['?'])[0]}\n".encode())

    simulated(SCENARIO)
    sampler = Sampler(collector, interval=60, deadline=60, render=render)
    sampler.sample_once()
    app = App(sampler, routes={"/hello": Route(hello, frozenset({"who"}))})
    assert not app.inline({"PATH_INFO": "/hello", "REQUEST_METHOD": "GET"})
    server = serve(app, "127.0.0.1", 0)
    try:
        agent = Agent(sampler, server.port)
        assert agent.get("/hello?who=page")[::2] == (200, b"hello page\n")
        assert agent.get("/hello?what=1")[0] == 400  # its own parameters only
        found = http_samples(agent)
    finally:
        server.close()
    assert found[("gpu_exporter_http_requests_total", (("code", "200"), ("path", "/hello")))] == 1
    with pytest.raises(ValueError, match="'/metrics'"):
        App(sampler, routes={"/metrics": Route(hello, inline=True)})


def test_the_path_label_stays_bounded(quick):
    agent = quick()
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=5)
    try:
        for _ in range(100):
            conn.request("GET", "/" + os.urandom(8).hex())
            assert conn.getresponse().read()
    finally:
        conn.close()
    requests = {
        dict(labels)["path"]
        for (name, labels), _ in http_samples(agent).items()
        if name == "gpu_exporter_http_requests_total"
    }
    assert requests == {"other"}  # the scrape that reads them is counted after it


def test_process_metrics_are_served(simulated, collector):
    """The agent's renderer (the sampler's, in ``serve``) adds prometheus_client's process
    collector, read once per sample."""
    from exporter.exposition.metrics import render_with_process

    simulated(SCENARIO)
    sampler = Sampler(collector, interval=60, deadline=60, render=render_with_process)
    sampler.sample_once()
    server = serve(App(sampler), "127.0.0.1", 0)
    try:
        found = {name for name, _ in http_samples(Agent(sampler, server.port))}
    finally:
        server.close()
    assert {
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "process_start_time_seconds",
    } <= found


PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


@pytest.mark.parametrize("encoding", [None, "gzip"])
def test_openmetrics_when_the_scraper_asks(agent, encoding):
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )

    headers = {"Accept": PROMETHEUS_ACCEPT}
    if encoding:
        headers["Accept-Encoding"] = encoding
    status, got, body = agent.get("/metrics", headers=headers)
    if encoding:
        assert got["Content-Encoding"] == "gzip"
        body = gzip.decompress(body)
    assert status == 200
    assert got["Content-Type"] == "application/openmetrics-text; version=1.0.0; charset=utf-8"
    assert body.endswith(b"\n# EOF\n") and body.count(b"# EOF") == 1
    families = {f.name: f for f in openmetrics_families(body.decode())}  # strict: raises
    assert families["gpu_exporter_samples"].type == "counter"
    assert families["gpu_exporter_http_requests"].type == "counter"
    wanted = {"gpu_up", "gpu_exporter_http_connections", "gpu_exporter_snapshot_stale"}
    assert wanted <= families.keys()


@pytest.mark.parametrize(
    ("accept", "openmetrics"),
    [
        (None, False),
        ("", False),
        ("*/*", False),  # curl
        ("text/plain", False),
        (PROMETHEUS_ACCEPT, True),
        ("application/openmetrics-text", True),
        ("Application/OpenMetrics-Text; version=1.0.0", True),
        ("application/openmetrics-text;q=0", False),
        ("application/openmetrics-text;q=0.5, text/plain", False),
        ("application/openmetrics-text;q=0.5, */*", False),
        ("application/openmetrics-text;q=0.5, text/*;q=0.4", True),
        ("application/openmetrics-text, text/plain", True),
        ("application/openmetrics-text;q=bad, text/plain;q=0.1", False),
        ("application/*", False),
        ("text/html, application/openmetrics-text;q=0.9", True),
    ],
)
def test_openmetrics_negotiation(accept, openmetrics):
    assert openmetrics_preferred(accept) is openmetrics
