"""Other agents for the status page's *Hosts* table: the ``peers`` setting's base URLs.

The agent fetches each peer's ``/snapshot`` itself, on a thread per peer, every interval and
with a timeout, and keeps a one-row summary; ``/peers`` and the page read the summaries. The
browser never talks to a peer (the page's Content-Security-Policy stays the agent's own
origin, and no CORS is needed), and the URLs come from the config only, never from a request:
the agent cannot be made a proxy. docs/status-page.md says why.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

#: ``fetch(url, timeout)``: the JSON document at ``url``; raises an exception whose message is
#: one line saying why it could not be had.
Fetch = Callable[[str, float], Mapping[str, Any]]
LEVELS = ("ok", "warning", "critical")


def summarize(url: str, document: Mapping[str, Any], now: float) -> dict[str, Any]:
    """One host's row from its ``/snapshot``: GPUs free (up, no process, no launcher lock),
    the busiest and the hottest GPU, the worst health verdict."""
    gpus = [g for g in document["gpus"] if isinstance(g, Mapping)]
    up = [g for g in gpus if g.get("up")]
    free = [g for g in up if g.get("processes") == [] and g.get("reserved_by") is None]
    busy = [g for g in up if isinstance(g.get("utilization_ratio"), (int, float))]
    hot = [g for g in up if isinstance(g.get("temperature_celsius"), (int, float))]
    busiest = max(busy, key=lambda g: g["utilization_ratio"], default=None)
    hottest = max(hot, key=lambda g: g["temperature_celsius"], default=None)
    verdicts = [(g.get("health") or {}).get("verdict") for g in gpus]
    known = [LEVELS.index(v) for v in verdicts if v in LEVELS]
    if len(up) < len(gpus):
        known.append(LEVELS.index("critical"))  # a GPU down is the worst news
    return {
        "url": url,
        "up": True,
        "error": "",
        "hostname": str(document["host"]["hostname"]),
        "gpus": len(gpus),
        "gpus_free": len(free),
        "busiest": {"gpu": busiest["index"], "utilization_ratio": busiest["utilization_ratio"]}
        if busiest
        else None,
        "hottest": {"gpu": hottest["index"], "temperature_celsius": hottest["temperature_celsius"]}
        if hottest
        else None,
        "health": LEVELS[max(known)] if known else None,
        "sample_age_seconds": max(0.0, now - float(document["timestamp"])),
        "fetched_at": now,
    }


def unreachable(url: str, error: str, now: float) -> dict[str, Any]:
    """A peer that did not answer (or not with a Snapshot): its row says why."""
    return {
        "url": url,
        "up": False,
        "error": error,
        "hostname": "",
        "gpus": None,
        "gpus_free": None,
        "busiest": None,
        "hottest": None,
        "health": None,
        "sample_age_seconds": None,
        "fetched_at": now,
    }


class PeerWatcher:
    """Fetches every peer's ``/snapshot`` every ``interval`` seconds, each within ``timeout``;
    ``summaries()`` are the latest rows, in the configured order."""

    def __init__(
        self,
        urls: Sequence[str],
        fetch: Fetch,
        interval: float,
        timeout: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.urls = tuple(urls)
        self._fetch, self._interval, self._timeout, self._clock = fetch, interval, timeout, clock
        self._rows: dict[str, dict[str, Any]] = {
            url: unreachable(url, "not fetched yet", clock()) for url in self.urls
        }
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch, args=(url,), name=f"peer {url}", daemon=True)
            for url in self.urls
        ]
        self._told: dict[str, str] = {}  # url -> the error last logged

    def start(self) -> PeerWatcher:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self._timeout + 1)

    def poll(self, url: str) -> dict[str, Any]:
        """Fetch ``url`` once now and keep its row (the threads call this)."""
        try:
            document = self._fetch(url + "/snapshot", self._timeout)
            row = summarize(url, document, self._clock())
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            row = unreachable(url, f"not a Snapshot: {exc}", self._clock())
        except Exception as exc:  # the fetch's own errors: one line each
            row = unreachable(url, str(exc) or type(exc).__name__, self._clock())
        if row["error"] != self._told.get(url, ""):
            if row["error"]:
                log.warning("peer %s: %s", url, row["error"])
            else:
                log.info("peer %s answers again", url)
            self._told[url] = row["error"]
        with self._lock:
            self._rows[url] = row
        return row

    def summaries(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._rows[url] for url in self.urls]

    def document(self) -> bytes:
        """``/peers``: the summaries as JSON."""
        return json.dumps(self.summaries(), indent=1).encode()

    def _watch(self, url: str) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll(url)
            self._stop.wait(max(0.0, self._interval - (time.monotonic() - started)))
