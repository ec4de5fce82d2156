"""``/history``: the last minutes of each GPU from the sampler's history, bounded by it."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

from exporter.exposition.metrics import render
from exporter.sampling.sampler import Sampler
from exporter.web.routes import App, serve
from tests.helpers import one, samples

SCENARIO = """
gpus:
  - name: GPU A
    memory_total: 16GiB
    utilization: {from: 0.0, to: 1.0, over: 10s}
    temperature: {from: 40, to: 50, over: 10s}
    power: 100
    processes: [{pid: self, memory: 1GiB}]
    gpm: true
    fields: {sm_active: 0.25}
  - name: GPU B
    utilization: 0.5
    errors: [{field: utilization, from: 5s, until: 6s}]
"""
KEPT = 5


@pytest.fixture
def port(simulated, collector, clock) -> Iterator[int]:
    """An agent whose sampler kept KEPT samples a second apart (8 were taken)."""
    simulated(SCENARIO)
    sampler = Sampler(collector, interval=1.0, deadline=1.0, history=KEPT, render=render)
    for _ in range(8):
        sampler.sample_once()
        clock.advance(1.0)
    server = serve(App(sampler), "127.0.0.1", 0)
    try:
        yield server.port
    finally:
        server.close()


def get(port: int, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        ctype = response.getheader("Content-Type", "")
        return response.status, json.loads(body) if "json" in ctype else body.decode()
    finally:
        conn.close()


def test_history_is_columns_of_the_kept_samples_oldest_first(port):
    status, doc = get(port, "/history")
    assert status == 200 and doc["version"] == 1 and doc["interval_seconds"] == 1.0
    assert doc["samples"] == KEPT and doc["seconds"] == pytest.approx(KEPT - 1)
    a, b = doc["gpus"]
    assert (a["index"], a["name"], b["index"]) == (0, "GPU A", 1)
    assert a["timestamps"] == sorted(a["timestamps"]) and len(a["timestamps"]) == KEPT
    assert a["timestamps"][-1] == doc["now"]
    utilization = a["utilization_ratio"]
    assert len(utilization) == KEPT and utilization == sorted(utilization)  # it ramps up
    assert a["sm_active_ratio"] == [0.25] * KEPT and a["power_watts"] == [100.0] * KEPT
    assert a["memory_used_bytes"] == [1024**3] * KEPT and a["memory_total_bytes"] == 16 * 1024**3
    assert b["sm_active_ratio"] == [None] * KEPT  # no GPM: unknown, never 0
    assert None in b["utilization_ratio"] and 0.5 in b["utilization_ratio"]  # failed once


def test_seconds_and_gpu_choose_a_part(port):
    status, doc = get(port, "/history?seconds=2")
    assert status == 200 and doc["samples"] == 3 and doc["seconds"] == pytest.approx(2)
    status, doc = get(port, "/history?seconds=100000")  # never more than what is kept
    assert status == 200 and doc["samples"] == KEPT
    status, doc = get(port, "/history?gpu=1")
    assert status == 200 and [g["index"] for g in doc["gpus"]] == [1]
    uuid = get(port, "/snapshot")[1]["gpus"][0]["uuid"]
    status, doc = get(port, f"/history?gpu={uuid}&gpu=1")
    assert status == 200 and [g["index"] for g in doc["gpus"]] == [0, 1]


@pytest.mark.parametrize(
    ("query", "code", "says"),
    [
        ("seconds=0", 400, "seconds: must be more than 0"),
        ("seconds=-5", 400, "seconds: must be more than 0"),
        ("seconds=nan", 400, "seconds: expected a number"),
        ("seconds=inf", 400, "seconds: expected a number"),
        ("seconds=1e999", 400, "seconds: expected a finite number"),
        ("seconds=abc", 400, "seconds: expected a number"),
        ("seconds=1&seconds=2", 400, "more than once"),
        ("gpu=7", 404, "no GPU '7'"),
        ("minutes=3", 400, "unknown query parameter 'minutes'"),
    ],
)
def test_bad_queries_get_a_clear_answer(port, query, code, says):
    status, text = get(port, f"/history?{query}")
    assert status == code and says in text, text


def test_no_history_before_the_first_sample(simulated, collector):
    simulated(SCENARIO)
    server = serve(App(Sampler(collector, interval=1.0, deadline=1.0)), "127.0.0.1", 0)
    try:
        status, text = get(server.port, "/history")
        assert status == 503 and "no sample yet" in text
    finally:
        server.close()


def test_a_gpu_down_in_a_sample_has_nulls_there_and_a_gpu_gone_has_no_entry(
    simulated, collector, clock
):
    simulated(
        """
gpus:
  - name: stays
    power: 100
    errors: [{field: "*", from: 1s, until: 2s}]
  - name: goes
    present: {until: 2s}
"""
    )
    sampler = Sampler(collector, interval=1.0, deadline=1.0, history=KEPT, render=render)
    for _ in range(4):
        sampler.sample_once()
        clock.advance(1.0)
    gone = sampler.history()[0].gpus[1].uuid
    server = serve(App(sampler), "127.0.0.1", 0)
    try:
        status, doc = get(server.port, "/history")
        assert status == 200 and doc["samples"] == 4
        (stays,) = doc["gpus"]  # the GPU that went is in no entry
        assert stays["name"] == "stays" and stays["uuid"] != gone
        assert stays["power_watts"] == [100.0, None, 100.0, 100.0]
        for column in ("utilization_ratio", "memory_used_bytes", "temperature_celsius"):
            assert [v is None for v in stays[column]] == [False, True, False, False], column
        for wanted in ("1", gone):
            status, text = get(server.port, f"/history?gpu={wanted}")
            assert status == 404 and f"no GPU {wanted!r}" in text
    finally:
        server.close()


def test_history_requests_are_counted_by_route(port):
    for query in ("", "?seconds=1", "?seconds=0"):
        get(port, f"/history{query}")
    _, text = get(port, "/metrics")
    found = samples(text.encode())
    requests = "gpu_exporter_http_requests_total"
    assert one(found, requests, path="/history", code="200") == 2
    assert one(found, requests, path="/history", code="400") == 1
