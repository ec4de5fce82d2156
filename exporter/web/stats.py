"""The HTTP server's own counters, exported as ``gpu_exporter_http_*`` on ``/metrics``."""

from __future__ import annotations

import threading
from collections.abc import Collection

#: The ``path`` of a request to a path the routes do not know: the label stays bounded.
OTHER = "other"


class HttpStats:
    """Connections open now, connections refused or dropped, and requests by path and status.

    ``paths`` are the known routes; any other path counts as ``other``.
    """

    def __init__(self, paths: Collection[str] = ()) -> None:
        self.paths = frozenset(paths)
        self.connections = 0
        self.rejected = 0
        self.requests: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def open(self, limit: int) -> bool:
        """Count a new connection; False (and counted as rejected) when ``limit`` are open."""
        with self._lock:
            if self.connections >= limit:
                self.rejected += 1
                return False
            self.connections += 1
            return True

    def close(self) -> None:
        with self._lock:
            self.connections -= 1

    def reject(self) -> None:
        """Count a connection dropped for a bad or slow request head (or TLS handshake)."""
        with self._lock:
            self.rejected += 1

    def request(self, path: str, status: int) -> None:
        key = (path if path in self.paths else OTHER, status)
        with self._lock:
            self.requests[key] = self.requests.get(key, 0) + 1

    def snapshot(self) -> tuple[int, int, list[tuple[str, int, int]]]:
        """(connections, rejected, [(path, status, count), ...] sorted)."""
        with self._lock:
            requests = sorted((path, code, n) for (path, code), n in self.requests.items())
            return self.connections, self.rejected, requests


class ReloadStats:
    """The web config file's reloads (``gpu_exporter_web_config_*``): counted by result, whether
    the last one succeeded, and when the running configuration was loaded (at start, then by
    each successful reload). Written by the reloader's thread, read by scrapes."""

    def __init__(self, loaded_at: float) -> None:
        self.successes = 0
        self.failures = 0
        self.last_successful = True  # as Prometheus has it: the load at start succeeded
        self.last_success = loaded_at
        self._lock = threading.Lock()

    def success(self, when: float) -> None:
        with self._lock:
            self.successes += 1
            self.last_successful = True
            self.last_success = when

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            self.last_successful = False

    def snapshot(self) -> tuple[int, int, bool, float]:
        """(successes, failures, last successful, last success as seconds since the epoch)."""
        with self._lock:
            return self.successes, self.failures, self.last_successful, self.last_success
