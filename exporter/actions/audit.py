"""Append-only audit log: one JSON line per decision, flushed and fsynced before it counts.

The file is created 0600 and opened without following symlinks; another user's file or one that
is not a regular file is refused, and a wider mode is narrowed to 0600. A write that fails (disk
full, permissions) returns False so the caller does not act on a decision it could not record.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
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
            start: int | None = None
            try:
                fd = self._open()
                start = os.fstat(fd).st_size
                data = line.encode()
                while data:
                    written = os.write(fd, data)
                    data = data[written:]
                os.fsync(fd)
            except OSError as exc:
                self.failures += 1
                if start is not None:  # a disk that fills mid-line: leave no half line behind
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, start)
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
            # O_NONBLOCK: a FIFO planted at the path fails at once instead of blocking the agent
            fd = os.open(self.path, flags | os.O_NONBLOCK, 0o600)  # type: ignore[arg-type]
            try:
                _check_private(fd, str(self.path))
            except OSError:
                os.close(fd)
                raise
            self._fd = fd
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


def _check_private(fd: int, path: str) -> None:
    """An audit log must be a regular file of the agent's user that only it can read or write:
    other kinds of file are refused, and a wider mode (from an older file, or a logrotate
    ``create`` line) is narrowed to 0600 with a warning."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise OSError(errno.EINVAL, "not a regular file")
    if info.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"owned by uid {info.st_uid}, not by the agent's user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.fchmod(fd, 0o600)
        log.warning(
            "the audit log %s was mode %04o; made it 0600", path, stat.S_IMODE(info.st_mode)
        )
