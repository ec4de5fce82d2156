"""What the reaper has seen of GPU processes: the evidence that a job has ended.

A process is an orphan only on evidence the agent gathered itself. Its *job process* is the
process that was its parent when the reaper first saw it, or the leader of its process group.
The evidence is that the job process:

1. was seen by the reaper, at an earlier run, in NVML's process list of the same GPU (it had a
   CUDA context there: it was doing GPU work, not merely probing the GPU), and
2. has exited since, as seen through a pidfd opened while it was alive (a hidden or reused PID
   never passes for an exit; an agent that cannot open pidfds gathers no evidence).

A process whose parent or group leader was never seen on the GPU (a shell, a daemonizer, a
supervisor, a container runtime) is a detached job: no evidence, never an orphan. So is every
process the reaper did not see before its job process exited (after an agent restart, say).
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from exporter.core.procfs import ProcessInfo

#: At most this many processes are watched (each holds one pidfd), and never more than a quarter
#: of the descriptors the agent may open; past it, new processes are not watched, so they can
#: never be evidence (the safe side).
MAX_WATCHED = 4096


def _watch_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_WATCHED if soft == resource.RLIM_INFINITY else max(0, min(MAX_WATCHED, soft // 4))


def pidfd_exited(pidfd: int) -> bool:
    """True once the process behind ``pidfd`` has exited (its pidfd polls readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


@dataclass
class Watched:
    """A GPU process as the reaper first saw it, and when it saw it exit."""

    pid: int
    start_ticks: int
    ppid: int  # its parent when first seen: later it may be re-parented to init
    pgid: int
    pidfd: int | None
    #: GPUs on whose NVML process list it was seen (a CUDA context there)
    listed_on: set[str] = field(default_factory=set)
    ended_at: float | None = None  # monotonic time of the run that saw it exit
    ended_seq: int = 0  # the Snapshot of that run

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start_ticks)

    def leads_group(self) -> bool:
        return self.pgid == self.pid


@dataclass(frozen=True)
class JobEnd:
    """The evidence that a process's job has ended: which process ended, how it was related."""

    process: Watched
    relation: str  # "parent" or "group leader"


class JobWatch:
    """Remembers the GPU processes seen at each run and notices when they exit."""

    def __init__(
        self,
        *,
        open_pidfd: Callable[[int], int] = os.pidfd_open,
        exited: Callable[[int], bool] = pidfd_exited,
        limit: int | None = None,
    ) -> None:
        self._open_pidfd = open_pidfd
        self._exited = exited
        self._limit = _watch_limit() if limit is None else limit
        self._watched: dict[tuple[int, int], Watched] = {}
        self.full = False  # the limit was reached at the last run

    def observe(
        self,
        seen: Iterable[tuple[ProcessInfo, set[str]]],
        still_same: Callable[[ProcessInfo], bool],
        now: float,
        seq: int,
        *,
        trusted: bool,
    ) -> None:
        """One run's GPU processes: each live one with the GPUs NVML lists it on.

        ``still_same`` re-reads a process after its pidfd is opened (the pidfd must pin the
        process that was seen, not a newer one with its PID). With ``trusted`` False (PIDs
        here are not the agent's own) no pidfd is opened, so no evidence can come of it.
        """
        current: set[tuple[int, int]] = set()
        for info, listed_on in seen:
            key = (info.pid, info.start_ticks)
            current.add(key)
            known = self._watched.get(key)
            if known is None:
                if len(self._watched) >= self._limit:
                    self.full = True
                    continue
                known = self._watched[key] = Watched(
                    info.pid,
                    info.start_ticks,
                    info.ppid,
                    info.pgid,
                    self._pin(info, still_same) if trusted else None,
                )
            known.listed_on |= listed_on
        for watched in self._watched.values():
            if (
                watched.ended_at is None
                and watched.pidfd is not None
                and self._exited(watched.pidfd)
            ):
                watched.ended_at, watched.ended_seq = now, seq
                self._close(watched)
        self._prune(current)

    def _pin(self, info: ProcessInfo, still_same: Callable[[ProcessInfo], bool]) -> int | None:
        try:
            pidfd = self._open_pidfd(info.pid)
        except OSError:  # gone already, an old kernel, out of descriptors: no evidence
            return None
        if still_same(info):
            return pidfd
        os.close(pidfd)
        return None

    def _prune(self, current: set[tuple[int, int]]) -> None:
        """Keep what is seen now and the job processes that the processes seen now refer to."""
        referenced: set[int] = set()
        for key in current:
            watched = self._watched.get(key)
            if watched is not None:
                referenced.update((watched.ppid, watched.pgid))
        for key, watched in list(self._watched.items()):
            if key not in current and watched.pid not in referenced:
                self._close(watched)
                del self._watched[key]
        self.full = self.full and len(self._watched) >= self._limit

    def job_end(self, info: ProcessInfo, uuid: str) -> JobEnd | None:
        """The evidence that the job of ``info``, which holds GPU ``uuid``, has ended; None when
        there is none (its job lives, or it was never seen on that GPU)."""
        me = self._watched.get((info.pid, info.start_ticks))
        if me is None:
            return None
        found: list[JobEnd] = []
        for watched in self._watched.values():
            if (  # most have not ended: that is asked first, it is the cheapest
                watched.ended_at is None
                or watched is me
                or uuid not in watched.listed_on
                or watched.start_ticks > me.start_ticks  # started after it: not its job
            ):
                continue
            if watched.pid == me.ppid:
                found.append(JobEnd(watched, "parent"))
            elif watched.pid == me.pgid and watched.leads_group() and me.pid != me.pgid:
                found.append(JobEnd(watched, "group leader"))
        # the latest end: the longest wait before acting
        return max(found, key=lambda end: end.process.ended_at or 0.0, default=None)

    def seen_exit(self, pid: int, seq: int | None = None) -> bool:
        """True when the reaper saw the process with this PID exit (at the run of Snapshot
        ``seq``, when given): NVML may list a process a little after its exit, and its parent
        may not have reaped it yet; that is no finding."""
        return any(
            w.pid == pid and w.ended_at is not None and seq in (None, w.ended_seq)
            for w in self._watched.values()
        )

    def _close(self, watched: Watched) -> None:
        if watched.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(watched.pidfd)
            watched.pidfd = None

    def close(self) -> None:
        """Release every pidfd and forget everything."""
        for watched in self._watched.values():
            self._close(watched)
        self._watched.clear()
