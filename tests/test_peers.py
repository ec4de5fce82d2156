"""The status page's peers: the ``peers`` setting, a host's summary row, the watcher."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from exporter.config.validate import base_url, peer_urls
from exporter.web.peers import PeerWatcher, summarize


def gpu(index: int, **values: Any) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-{index}",
        "up": True,
        "utilization_ratio": 0.0,
        "temperature_celsius": 40.0,
        "processes": [],
        "reserved_by": None,
        "health": {"verdict": "ok"},
        **values,
    }


def document(*gpus: dict[str, Any]) -> dict[str, Any]:
    return {"host": {"hostname": "lab-2"}, "timestamp": 1000.0, "gpus": list(gpus)}


def test_a_host_row_counts_free_gpus_and_names_the_busiest_and_hottest() -> None:
    row = summarize(
        "http://lab-2:9402",
        document(
            gpu(0, utilization_ratio=0.9, processes=[{"pid": 1}]),
            gpu(1, temperature_celsius=81.0),
            gpu(2, reserved_by=4242),
            gpu(3, health={"verdict": "warning"}),
        ),
        now=1002.5,
    )
    assert row["up"] and row["hostname"] == "lab-2" and row["error"] == ""
    assert (row["gpus"], row["gpus_free"]) == (4, 2)  # 0 busy, 2 locked by a launcher
    assert row["busiest"] == {"gpu": 0, "utilization_ratio": 0.9}
    assert row["hottest"] == {"gpu": 1, "temperature_celsius": 81.0}
    assert row["health"] == "warning" and row["sample_age_seconds"] == 2.5


def test_a_gpu_down_makes_the_host_critical_and_is_never_free() -> None:
    row = summarize("http://h", document(gpu(0), gpu(1, up=False)), now=1000.0)
    assert row["health"] == "critical" and row["gpus_free"] == 1
    unknown = summarize("http://h", document(gpu(0, health=None)), now=1000.0)
    assert unknown["health"] is None  # no verdict (health action off): not "ok"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("ftp://h:1", "expected http://HOST:PORT"),
        ("http://", "expected http://HOST:PORT"),
        ("http://u:secret@h:1", "no credentials"),
        ("http://h:1/?x=1", "no query"),
        ("http://h:99999", "out of range"),
    ],
)
def test_bad_peer_urls_say_what_is_wrong(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        base_url(value)


def test_peers_take_a_list_or_commas_and_refuse_duplicates() -> None:
    assert peer_urls(["http://a:1/", "https://b"]) == ("http://a:1", "https://b")
    assert peer_urls("http://a:1, http://b:2") == ("http://a:1", "http://b:2")
    assert peer_urls("") == ()
    with pytest.raises(ValueError, match="twice"):
        peer_urls(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="at most 64"):
        peer_urls([f"http://h{i}:1" for i in range(65)])


def test_the_watcher_keeps_a_row_per_peer_and_logs_each_change_once(caplog) -> None:
    answers: dict[str, Any] = {"http://up:1/snapshot": document(gpu(0))}

    def fetch(url: str, timeout: float) -> dict[str, Any]:
        assert timeout == 0.5
        found = answers.get(url)
        if isinstance(found, Exception):
            raise found
        if found is None:
            raise OSError(f"cannot reach the agent at {url}: connection refused")
        return found

    watcher = PeerWatcher(["http://up:1", "http://down:2"], fetch, 60.0, 0.5, clock=lambda: 1001.0)
    before = watcher.summaries()
    assert [r["error"] for r in before] == ["not fetched yet"] * 2
    with caplog.at_level(logging.INFO, logger="exporter.web.peers"):
        for _ in range(3):
            for url in watcher.urls:
                watcher.poll(url)
        answers["http://up:1/snapshot"] = {"gpus": "garbage"}
        watcher.poll("http://up:1")
    up, down = watcher.summaries()
    assert not up["up"] and up["error"].startswith("not a Snapshot")
    assert not down["up"] and "connection refused" in down["error"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "down:2" in w]) == 1  # said once, not every fetch
    assert len([w for w in warnings if "up:1" in w]) == 1


def test_the_watcher_threads_fetch_until_stopped() -> None:
    fetched = threading.Event()

    def fetch(url: str, timeout: float) -> dict[str, Any]:
        fetched.set()
        return document(gpu(0))

    watcher = PeerWatcher(["http://a:1"], fetch, 0.05, 0.5).start()
    try:
        assert fetched.wait(10)
    finally:
        watcher.stop()
    assert all(not t.is_alive() for t in threading.enumerate() if t.name == "peer http://a:1")
