"""A small JSON file the agent keeps across restarts (the health verdict's critical XIDs).

Made as safely as the lock directory: the directory is created private (0700) when missing and
must be a real directory of this user or root, not writable by group or others; the file is
read without following links, only when it is a regular file of this user, at most
:data:`MAX_BYTES`; it is written whole to a temporary file beside it and renamed over, so a
crash leaves the old file or the new one, never half of either.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from typing import Any

SYSTEM_STATE_FILE = "/var/lib/gpu-exporter/health.json"
MAX_BYTES = 1 << 20


class StateError(Exception):
    """The state file or its directory cannot be used (the message says why, in one line)."""


def default_state_file() -> str:
    """``/var/lib/gpu-exporter/health.json`` for root, else under the user's state directory
    (``$XDG_STATE_HOME``, else ``~/.local/state``)."""
    if os.geteuid() == 0:
        return SYSTEM_STATE_FILE
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "gpu-exporter", "health.json")


def _check_dir(path: str) -> None:
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise StateError(f"cannot use the state directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise StateError(f"the state directory {path} is not a directory (or is a link)")
    if info.st_uid not in (0, os.geteuid()):
        raise StateError(
            f"the state directory {path} belongs to uid {info.st_uid}, not to this agent "
            f"(uid {os.geteuid()}) or root"
        )
    if info.st_mode & 0o022:
        mode = info.st_mode & 0o777
        raise StateError(f"the state directory {path} is writable by others (mode {mode:o})")


def load_state(path: str) -> Any | None:
    """The file's JSON; None when it does not exist. StateError when it cannot be trusted
    (not a regular file, another user's, too big, not JSON)."""
    directory = os.path.dirname(path) or "."
    if not os.path.lexists(directory):
        return None
    _check_dir(directory)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read the state file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise StateError(f"the state file {path} is not a regular file; ignoring it")
        if info.st_uid != os.geteuid():
            raise StateError(
                f"the state file {path} belongs to uid {info.st_uid}, not to this agent "
                f"(uid {os.geteuid()}); ignoring it"
            )
        data = handle.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise StateError(f"the state file {path} is larger than {MAX_BYTES} bytes; ignoring it")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StateError(f"the state file {path} is not valid JSON ({exc}); ignoring it") from None


def save_state(path: str, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` atomically, making its directory (0700) when missing."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise StateError(f"cannot make the state directory {directory}: {exc.strerror}") from None
    _check_dir(directory)
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    body = json.dumps(value, indent=1, sort_keys=True).encode() + b"\n"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)  # left by a crash of this PID's predecessor
        fd = os.open(
            temporary,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        with os.fdopen(fd, "wb") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise StateError(f"cannot write the state file {path}: {exc.strerror}") from None
