"""The agent's own ``process_*`` metrics, as prometheus_client's process collector names them.

The same six families, help texts and values as ``prometheus_client.ProcessCollector`` (every
Python exporter has them, and dashboards and alert rules use them), read more cheaply: the
sampler reads them once per sample. ``process_open_fds`` comes from the size Linux 6.2 and
newer report for ``/proc/self/fd`` (the number of open descriptors) where it does: listing the
directory, as the collector does, makes the kernel build an entry for every descriptor, some
0.35 ms a sample for the agent's four hundred (it keeps GPU processes' procfs files and the
reaper's pidfds open). Older kernels report 0 there: then the directory is listed. The count
is the descriptors open, not one more for the listing's own as the collector's.
"""

from __future__ import annotations

import os

from exporter.exposition.text import Family

_PROC = "/proc/self"


class SelfProcess:
    """Reads ``/proc/self`` for the ``process_*`` families; none when it cannot be read."""

    def __init__(self, proc: str = _PROC) -> None:
        self._proc = proc
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._boot = _boot_time(os.path.join(os.path.dirname(proc) or "/proc", "stat"))
        self._sized = _sized(os.path.join(proc, "fd"))

    def families(self) -> list[Family]:
        """The families, read now (those whose file cannot be read left out)."""
        out: list[Family] = []
        stat = _read(os.path.join(self._proc, "stat"))
        parts = stat.rpartition(b")")[2].split() if stat is not None else []
        if len(parts) > 21 and self._boot is not None:
            ticks = self._ticks
            out += [
                _one("process_virtual_memory_bytes", "Virtual memory size in bytes.", parts[20]),
                _one(
                    "process_resident_memory_bytes",
                    "Resident memory size in bytes.",
                    float(parts[21]) * self._page,
                ),
                _one(
                    "process_start_time_seconds",
                    "Start time of the process since unix epoch in seconds.",
                    float(parts[19]) / ticks + self._boot,
                ),
                _one(
                    "process_cpu_seconds",
                    "Total user and system CPU time spent in seconds.",
                    (float(parts[11]) + float(parts[12])) / ticks,
                    "counter",
                ),
            ]
        limits = _read(os.path.join(self._proc, "limits"))
        max_fds = next(
            (
                line.split()[3]
                for line in (limits or b"").splitlines()
                if line.startswith(b"Max open file")
            ),
            None,
        )
        open_fds = self._open_fds()
        if max_fds is not None and open_fds is not None:
            out.append(_one("process_open_fds", "Number of open file descriptors.", open_fds))
            out.append(_one("process_max_fds", "Maximum number of open file descriptors.", max_fds))
        return out

    def _open_fds(self) -> int | None:
        path = os.path.join(self._proc, "fd")
        try:
            return os.stat(path).st_size if self._sized else len(os.listdir(path))
        except OSError:
            return None


def _sized(path: str) -> bool:
    """Whether the size of the descriptor directory ``path`` is its count of descriptors
    (Linux 6.2 and newer): checked once against a listing (which holds one more, its own)."""
    try:
        listed = len(os.listdir(path))
        size = os.stat(path).st_size
    except OSError:
        return False
    return size > 0 and size in (listed - 1, listed)


def _one(name: str, doc: str, value: float | bytes, kind: str = "gauge") -> Family:
    family = Family(name, doc, kind, ())
    family.add((), float(value))
    return family


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


def _boot_time(path: str) -> float | None:
    """``btime`` of ``/proc/stat``: the host's boot, seconds since the epoch."""
    for line in (_read(path) or b"").splitlines():
        if line.startswith(b"btime "):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None
