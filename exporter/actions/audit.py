"""Append-only audit log: one JSON line per decision, flushed and fsynced before it counts.

The file is created 0600 and opened without following symlinks. A write that fails (disk full,
permissions) returns False so the caller does not act on a decision it could not record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class AuditLog:
    """JSON lines to ``path``; with no path, to the agent's log at INFO."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._failing = False
        self.failures = 0

    def write(self, event: dict[str, Any]) -> bool:
        """Record one event; True once it is durably written."""
        now = time.time()
        record = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
            + f".{int(now % 1 * 1000):03d}Z",
            **event,
        }
        line = json.dumps(record, sort_keys=False, default=str) + "\n"
        if self.path is None:
            log.info("audit: %s", line.rstrip())
            return True
        with self._lock:
            try:
                fd = self._open()
                data = line.encode()
                while data:
                    written = os.write(fd, data)
                    data = data[written:]
                os.fsync(fd)
            except OSError as exc:
                self.failures += 1
                self._close()
                if not self._failing:
                    log.error(
                        "cannot write the audit log %s: %s; no process will be signalled "
                        "until it can",
                        self.path,
                        exc.strerror or exc,
                    )
                self._failing = True
                return False
        if self._failing:
            log.warning("the audit log %s is writable again", self.path)
            self._failing = False
        return True

    def _open(self) -> int:
        if self._fd is None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            self._fd = os.open(self.path, flags, 0o600)  # type: ignore[arg-type]
        return self._fd

    def _close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Close the file (it is reopened on the next write)."""
        with self._lock:
            self._close()
