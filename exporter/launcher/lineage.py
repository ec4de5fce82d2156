"""The launcher's descendants, however they were started: the launcher is their subreaper.

Linux gives an orphaned process to its nearest living ancestor that is a "child subreaper"
(``prctl(PR_SET_CHILD_SUBREAPER)``) instead of to init. A launcher that is one therefore stays the
ancestor of every process of its job (a ``spawn`` worker, a double-forked daemon, a child that
called ``setsid``) until that process has exited, and can wait for the last of them.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Collection

PR_SET_CHILD_SUBREAPER = 36


def set_subreaper(on: bool = True) -> str:
    """Make (or stop making) this process the subreaper of its descendants: '' when done, else
    why not."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0:
            return ""
        return os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as exc:  # no libc, or no prctl (not Linux)
        return str(exc)


def _processes(proc_root: str) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process under ``proc_root``."""
    table: dict[int, tuple[int, str]] = {}
    try:
        names = [name for name in os.listdir(proc_root) if name.isdigit()]
    except OSError:
        return table
    for name in names:
        try:
            with open(f"{proc_root}/{name}/stat", "rb") as handle:
                raw = handle.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")" ends it
        fields = raw[raw.rfind(b")") + 2 :].split()
        if len(fields) >= 2:
            table[int(name)] = (int(fields[1]), fields[0].decode(errors="replace"))
    return table


def children(pid: int, proc_root: str = "/proc") -> set[int]:
    """The living (not zombie) children of ``pid``."""
    return {
        child
        for child, (parent, state) in _processes(proc_root).items()
        if parent == pid and state != "Z"
    }


def descendants(pid: int, skip: Collection[int] = (), proc_root: str = "/proc") -> list[int]:
    """The living descendants of ``pid``, sorted, not looking below the pids in ``skip``."""
    table = _processes(proc_root)
    below: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        below.setdefault(parent, []).append(child)
    seen = {pid, *skip}  # a pid reused during the scan could otherwise make a loop
    todo = [pid]
    found: list[int] = []
    while todo:
        for child in below.get(todo.pop(), ()):
            if child in seen:
                continue
            seen.add(child)
            todo.append(child)
            if table[child][1] != "Z":
                found.append(child)
    return sorted(found)
