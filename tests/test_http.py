"""The HTTP routes on a real loopback socket, over a real sampler thread."""

from __future__ import annotations

import gzip
import http.client
import json
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.sampler import Sampler
from exporter.web.routes import App, accept_encoding_weights, gzip_preferred, serve

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
    driver = SimulatedDriver(parse_scenario(parse_document(text).root())).install()
    collector = Collector(Nvml(), ProcFs())
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
        driver.uninstall()


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
