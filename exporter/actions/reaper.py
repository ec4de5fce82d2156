"""Zombie reaper: find processes that hold GPU memory for a job that is gone; signal them safely.

Holders of a GPU are the processes with an open descriptor on its device node
(``<paths.dev>/nvidiaN``, N = the GPU's minor number), found by scanning ``<paths.proc>/*/fd``,
together with NVML's process list in the latest Snapshot. Each is put in one class:

- ``orphan``: a live holder whose process-group leader and session leader both no longer exist,
  seen so for at least ``min_age`` and in at least two Snapshots. The only class ever signalled.
- ``defunct``: state Z (its parent must reap it). ``uninterruptible``: state D.
- ``unverifiable``: NVML lists a PID that is not visible here, or that holds no descriptor on
  that GPU (its PID number may have been reused).
- ``leaked``: GPU memory in use with no holder at all (a driver-level leak; needs a reset).

Signalling (``dry_run: false`` only): ``pidfd_open``, compare the start time with the one seen at
detection, write the decision to the audit log, SIGTERM through the pidfd; at a later run past
``grace_period`` SIGKILL; past ``kill_timeout`` after that, report it ``unkillable``. Once it has
exited, a later Snapshot confirms that NVML no longer lists it on that GPU.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import select
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from exporter import privileges
from exporter.actions.audit import AuditLog
from exporter.actions.base import Action
from exporter.launcher.locks import SUFFIX as LOCK_SUFFIX
from exporter.metrics import GPU_LABELS
from exporter.procfs import ProcessInfo, ProcFs, file_identity, scan_fd_holders
from exporter.snapshot import Gpu, Snapshot
from exporter.validate import boolean, duration, positive_duration, size, string_list, whole
from exporter.yamlconf import Section

log = logging.getLogger(__name__)

CLASSES = ("orphan", "defunct", "uninterruptible", "unverifiable", "leaked")
DEFAULT_PROTECT_NAMES = (
    "nvidia-persistenced",
    "nv-hostengine",
    "nvidia-fabricmanager",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "Xorg",
    "Xwayland",
    "dcgm*",
)


@dataclass(frozen=True)
class ReaperConfig:
    """Settings of ``actions.zombie_reaper``."""

    dry_run: bool = True
    min_age: float = 60.0
    grace_period: float = 30.0
    kill_timeout: float = 60.0
    max_kills_per_run: int = 4
    protect_names: tuple[str, ...] = DEFAULT_PROTECT_NAMES
    protect_users: tuple[str, ...] = ("root",)
    audit_log: str | None = None
    leaked_min_memory: int = 1024**3


def parse_reaper(section: Section) -> ReaperConfig:
    """The reaper's own keys of ``actions.zombie_reaper`` (not enabled/every/cron)."""
    default = ReaperConfig()

    def audit_path(raw: Any) -> str | None:
        if raw in (None, ""):
            return None
        path = str(raw)
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ValueError(f"directory {parent!r} does not exist")
        return path

    config = ReaperConfig(
        dry_run=section.get("dry_run", boolean, default.dry_run),
        min_age=section.get("min_age", duration, default.min_age),
        grace_period=section.get("grace_period", duration, default.grace_period),
        kill_timeout=section.get("kill_timeout", positive_duration, default.kill_timeout),
        max_kills_per_run=section.get(
            "max_kills_per_run", whole(0, 1000), default.max_kills_per_run
        ),
        protect_names=section.get("protect_names", string_list, default.protect_names),
        protect_users=section.get("protect_users", string_list, default.protect_users),
        audit_log=section.get("audit_log", audit_path, default.audit_log),
        leaked_min_memory=section.get("leaked_min_memory", size, default.leaked_min_memory),
    )
    if not config.dry_run and config.audit_log is None:
        raise section.error("dry_run", "dry_run: false needs audit_log: every signal is recorded")
    return config


@dataclass
class _Seen:
    """A suspect seen before: when and in which Snapshot it was first seen so."""

    since: float
    seq: int


@dataclass
class _Pending:
    """A process being signalled: the pidfd pins it, so a reused PID is never hit."""

    pidfd: int
    pid: int
    start_ticks: int
    gpu: int
    uuid: str
    termed_at: float
    killed_at: float | None = None


@dataclass
class _Finding:
    gpu: Gpu
    pid: int
    cls: str
    info: ProcessInfo | None
    reason: str = ""


_LOCKS = "\0launcher locks"  # the key of lock-file holders in the descriptor scan


def _lock_files(lock_dir: str | None) -> list[str]:
    """The lock files in ``lock_dir``: regular files only, since anyone may plant a link there
    (one to ``/dev/nvidiaN`` would pass every holder of that GPU off as a launcher's job)."""
    if not lock_dir:
        return []
    try:
        return [
            e.path
            for e in os.scandir(lock_dir)
            if e.name.endswith(LOCK_SUFFIX) and e.is_file(follow_symlinks=False)
        ]
    except OSError:
        return []


def _job_gone(procfs: ProcFs, info: ProcessInfo) -> bool:
    """Both the process-group leader and the session leader no longer exist (a reused PID that
    no longer leads that group or session counts as gone)."""

    def leads(pid: int, group: bool) -> bool:
        leader = procfs.process(pid)
        return leader is not None and (leader.pgid if group else leader.sid) == pid

    return not leads(info.pgid, True) and not leads(info.sid, False)


class ZombieReaper(Action):
    """The ``zombie_reaper`` action."""

    name = "zombie_reaper"

    def __init__(
        self,
        config: ReaperConfig,
        procfs: ProcFs,
        dev_root: str,
        *,
        audit: AuditLog | None = None,
        lock_dir: str | None = None,
    ) -> None:
        self.config = config
        self.procfs = procfs
        self.dev_root = dev_root
        self.audit = audit or AuditLog(config.audit_log)
        self.lock_dir = lock_dir
        self._locked: set[int] = set()  # processes holding a launcher lock: their job is alive
        self._protected_pids = self._self_and_ancestors()
        self._suspects: dict[tuple[int, int], _Seen] = {}  # (pid, start ticks) -> first seen
        self._leaks: dict[str, _Seen] = {}  # uuid -> first seen leaking
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._confirm: dict[tuple[int, int], tuple[str, int, float]] = {}
        # never signalled again: "unkillable" (survived SIGKILL) or "signal_failed" (EPERM...)
        self._given_up: dict[tuple[int, int], str] = {}
        self._reported: set[tuple[Any, ...]] = set()
        self._counts: dict[tuple[int, str], dict[str, int]] | None = None
        self.actions_total: dict[tuple[str, str], int] = {}
        self._caps = privileges.effective()
        self._warn_privileges(None)

    def reconfigure(self, config: ReaperConfig) -> None:
        """New settings; what is being watched or signalled carries on under them."""
        if config.audit_log != self.config.audit_log:
            self.audit.close()
            self.audit = AuditLog(config.audit_log)
        before, self.config = self.config, config
        self._warn_privileges(before)

    def _warn_privileges(self, before: ReaperConfig | None) -> None:
        """Log, once, each thing the settings ask for that the capabilities do not allow."""
        told = set(privileges.reaper_warnings(before.dry_run, self._caps)) if before else set()
        for line in privileges.reaper_warnings(self.config.dry_run, self._caps):
            if line not in told:
                log.warning("%s", line)

    # -- the run --------------------------------------------------------------------------

    def run(self, snapshots: Sequence[Snapshot], now: float) -> None:
        if not snapshots:
            return
        latest = snapshots[-1]
        self._progress_pending(now)
        self._confirm_released(latest, now)
        findings = self._classify(latest, now)
        counts = {
            (g.index, g.uuid): dict.fromkeys(CLASSES, 0) for g in latest.gpus if g.up and g.uuid
        }
        for finding in findings:
            counts.setdefault((finding.gpu.index, finding.gpu.uuid), dict.fromkeys(CLASSES, 0))
            counts[(finding.gpu.index, finding.gpu.uuid)][finding.cls] += 1
            self._report(finding)
        self._counts = counts
        present = {f.pid for f in findings}
        self._reported = {key for key in self._reported if key[2] in present}  # (event, uuid, pid…
        self._signal_orphans([f for f in findings if f.cls == "orphan" and f.info], now)

    def _classify(self, latest: Snapshot, now: float) -> list[_Finding]:
        gpus = [g for g in latest.gpus if g.up and g.info is not None]
        wanted = {}
        for gpu in gpus:
            if gpu.info.minor_number is None:  # type: ignore[union-attr]
                continue
            identity = file_identity(f"{self.dev_root}/nvidia{gpu.info.minor_number}")  # type: ignore[union-attr]
            if identity is not None:
                wanted[identity] = gpu.uuid
        for path in _lock_files(self.lock_dir):
            identity = file_identity(path)
            if identity is not None:
                wanted.setdefault(identity, _LOCKS)  # never in place of a GPU's device node
        holders, unreadable = scan_fd_holders(self.procfs.root, wanted, ("nvidia", LOCK_SUFFIX))
        # PID 1 (init, or a container's sandbox) never holds a GPU; some sandboxes hide its fds
        complete = not unreadable - {1}
        self._locked = holders.pop(_LOCKS, set())
        findings: list[_Finding] = []
        seen_suspects: set[tuple[int, int]] = set()
        signalled = {p.pid for p in self._pending.values()}
        ended = {pid for pid, _ in self._confirm}  # exited after our signal: being confirmed
        for gpu in gpus:
            listed = {p.pid for p in gpu.processes or ()}
            holding = holders.get(gpu.uuid, set())
            for pid in sorted(listed | holding):
                if pid in signalled:  # still the orphan being signalled, whatever it looks like
                    findings.append(_Finding(gpu, pid, "orphan", None, "being signalled"))
                    continue
                if pid in ended:  # NVML may list it a little longer; not a new finding
                    continue
                finding = self._classify_one(
                    gpu, pid, pid in listed, pid in holding, pid not in unreadable
                )
                if finding is None:
                    continue
                if finding.cls == "orphan":
                    key = (pid, finding.info.start_ticks)  # type: ignore[union-attr]
                    seen_suspects.add(key)
                    first = self._suspects.setdefault(key, _Seen(now, latest.seq))
                    if now - first.since < self.config.min_age or first.seq == latest.seq:
                        continue  # not yet: seen so for min_age and in two Snapshots
                findings.append(finding)
            leak = self._leak(gpu, listed, holding, complete, latest, now)
            if leak is not None:
                findings.append(leak)
        self._suspects = {k: v for k, v in self._suspects.items() if k in seen_suspects}
        return findings

    def _classify_one(
        self, gpu: Gpu, pid: int, listed: bool, holding: bool, readable: bool
    ) -> _Finding | None:
        info = self.procfs.process(pid)
        if info is None:
            if listed:
                return _Finding(gpu, pid, "unverifiable", None, "listed by NVML, not visible here")
            return None  # a holder that has just exited
        if info.state == "Z":
            return _Finding(
                gpu, pid, "defunct", info, f"defunct; its parent {info.ppid} must reap it"
            )
        if info.state == "D":
            return _Finding(gpu, pid, "uninterruptible", info, "in uninterruptible sleep (D)")
        if not holding:
            why = "holds no descriptor on the GPU" if readable else "descriptors not readable"
            return _Finding(gpu, pid, "unverifiable", info, f"listed by NVML, {why}")
        if _job_gone(self.procfs, info):
            return _Finding(
                gpu,
                pid,
                "orphan",
                info,
                f"process group {info.pgid} and session {info.sid} leaders are gone",
            )
        return None

    def _leak(
        self,
        gpu: Gpu,
        listed: set[int],
        holding: set[int],
        complete: bool,
        latest: Snapshot,
        now: float,
    ) -> _Finding | None:
        used = gpu.memory_used_bytes
        if (
            listed
            or holding
            or not complete
            or used is None
            or used < self.config.leaked_min_memory
        ):
            self._leaks.pop(gpu.uuid, None)
            return None
        first = self._leaks.setdefault(gpu.uuid, _Seen(now, latest.seq))
        if now - first.since < self.config.min_age or first.seq == latest.seq:
            return None
        return _Finding(gpu, 0, "leaked", None, f"{used} bytes in use with no process holding it")

    # -- decisions ------------------------------------------------------------------------

    def _protection(self, info: ProcessInfo) -> str:
        if info.pid == 1 or info.pid in self._protected_pids:
            return "protected_pid"
        if any(fnmatch.fnmatchcase(info.name, pattern) for pattern in self.config.protect_names):
            return "protected_name"
        users = self.config.protect_users
        if info.user in users or (info.uid is not None and str(info.uid) in users):
            return "protected_user"
        if info.pid in self._locked:
            return "launcher_lock"
        return ""

    def _signal_orphans(self, orphans: list[_Finding], now: float) -> None:
        started = 0
        for finding in orphans:
            info = finding.info
            assert info is not None
            key = (info.pid, info.start_ticks)
            if key in self._pending:
                continue
            reason = self._given_up.get(key) or self._protection(info)
            if not reason and self.config.dry_run:
                reason = "dry_run"
            if not reason and started >= self.config.max_kills_per_run:
                reason = "max_kills_per_run"
            if reason:
                self._skip(finding, reason)
                continue
            if self._terminate(finding, now):
                started += 1

    def _terminate(self, finding: _Finding, now: float) -> bool:
        info = finding.info
        assert info is not None
        try:
            pidfd = os.pidfd_open(info.pid)
        except ProcessLookupError:
            self._skip(finding, "vanished")
            return False
        except OSError as exc:  # an old kernel (pidfds need Linux 5.3), out of descriptors
            self._skip(finding, "pidfd_unavailable")
            log.error("cannot open a pidfd for pid %d: %s", info.pid, exc.strerror or exc)
            return False
        current = self.procfs.process(info.pid)
        if current is None or current.start_ticks != info.start_ticks:
            os.close(pidfd)
            self._skip(finding, "pid_reused")
            return False
        if not self._audit(finding, "signalling", signal="SIGTERM"):
            os.close(pidfd)
            self._count("skip", "audit_failed")
            return False
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        except OSError as exc:
            os.close(pidfd)
            self._audit(finding, "signal_failed", signal="SIGTERM", error=exc.strerror or str(exc))
            self._signal_failed((info.pid, info.start_ticks), "SIGTERM", exc)
            return False
        except Exception as exc:  # a bug after the record: record the outcome, keep no pidfd
            os.close(pidfd)
            self._audit(finding, "signal_failed", signal="SIGTERM", error=repr(exc))
            self._count("signal", "error")
            raise
        self._count("signal", "sigterm")
        log.warning(
            "sent SIGTERM to orphan pid %d (%s) holding GPU %d",
            info.pid,
            info.name,
            finding.gpu.index,
        )
        self._pending[(info.pid, info.start_ticks)] = _Pending(
            pidfd, info.pid, info.start_ticks, finding.gpu.index, finding.gpu.uuid, now
        )
        return True

    def _progress_pending(self, now: float) -> None:
        for key, pending in list(self._pending.items()):
            event = {"gpu": pending.gpu, "uuid": pending.uuid, "pid": pending.pid}
            if _exited(pending.pidfd):
                self._write({**event, "event": "exited"})
                self._count("signal", "exited")
                self._confirm[key] = (pending.uuid, pending.gpu, now)
            elif pending.killed_at is None and now - pending.termed_at >= self.config.grace_period:
                if not self._write({**event, "event": "signalling", "signal": "SIGKILL"}):
                    self._count("skip", "audit_failed")
                    continue
                try:
                    signal.pidfd_send_signal(pending.pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it has just exited: the next run sees it so
                except OSError as exc:
                    error = exc.strerror or str(exc)
                    self._write(
                        {**event, "event": "signal_failed", "signal": "SIGKILL", "error": error}
                    )
                    if self._signal_failed(key, "SIGKILL", exc):
                        os.close(pending.pidfd)
                        del self._pending[key]
                    continue  # else SIGKILL again at the next run
                self._count("signal", "sigkill")
                pending.killed_at = now
                continue
            elif (
                pending.killed_at is not None
                and now - pending.killed_at >= self.config.kill_timeout
            ):
                self._write({**event, "event": "unkillable"})
                self._count("signal", "unkillable")
                self._given_up[key] = "unkillable"
                log.error(
                    "pid %d survived SIGKILL for %.0fs: unkillable",
                    pending.pid,
                    now - pending.killed_at,
                )
            else:
                continue
            os.close(pending.pidfd)
            del self._pending[key]

    def _confirm_released(self, latest: Snapshot, now: float) -> None:
        for key, (uuid, index, exited_at) in list(self._confirm.items()):
            if latest.timestamp <= exited_at:
                continue  # need a Snapshot taken after the exit
            gpu = next((g for g in latest.gpus if g.uuid == uuid and g.up), None)
            event = {"gpu": index, "uuid": uuid, "pid": key[0]}
            listed = None if gpu is None or gpu.processes is None else gpu.processes
            if listed is not None and key[0] not in {p.pid for p in listed}:
                self._write(
                    {
                        **event,
                        "event": "memory_released",
                        "gpu_memory_used_bytes": gpu.memory_used_bytes,  # type: ignore[union-attr]
                    }
                )
                self._count("confirm", "memory_released")
                del self._confirm[key]
                continue
            if now - exited_at >= self.config.min_age:
                why = "still listed by NVML" if gpu is not None else "the GPU is not answering"
                self._write({**event, "event": "memory_not_released", "why": why})
                self._count("confirm", "memory_not_released")
                del self._confirm[key]

    # -- records --------------------------------------------------------------------------

    def _report(self, finding: _Finding) -> None:
        if finding.info is None and finding.cls == "orphan":
            return  # being signalled: reported when found
        start = finding.info.start_ticks if finding.info else 0
        key = ("found", finding.gpu.uuid, finding.pid, start, finding.cls)
        if key in self._reported:
            return
        if self._audit(finding, "found"):  # not written: tried again next run
            self._reported.add(key)
            self._count("report", finding.cls)

    def _skip(self, finding: _Finding, reason: str) -> None:
        start = finding.info.start_ticks if finding.info else 0
        key = ("skip", finding.gpu.uuid, finding.pid, start, reason)
        if key not in self._reported and self._audit(finding, "skipped", reason=reason):
            self._reported.add(key)
        self._count("skip", reason)

    def _audit(self, finding: _Finding, event: str, **extra: Any) -> bool:
        info = finding.info
        record: dict[str, Any] = {
            "event": event,
            "class": finding.cls,
            "gpu": finding.gpu.index,
            "uuid": finding.gpu.uuid,
            "pid": finding.pid or None,
            "why": finding.reason,
            "dry_run": self.config.dry_run,
        }
        if info is not None:
            record.update(
                process=info.name,
                user=info.user,
                state=info.state,
                ppid=info.ppid,
                pgid=info.pgid,
                sid=info.sid,
                start_time=info.start_time,
            )
        return self._write({**record, **extra})

    def _write(self, record: dict[str, Any]) -> bool:
        return self.audit.write({"action": self.name, **record})

    def _signal_failed(self, key: tuple[int, int], name: str, exc: OSError) -> bool:
        """Count and log a signal the kernel refused (the caller has audited it). EPERM (no
        CAP_KILL for another user's process) is for good: True, never signalled again."""
        self._count("signal", "error")
        denied = isinstance(exc, PermissionError)
        if denied:
            self._given_up[key] = "signal_failed"
        hint = ""
        if denied and "CAP_KILL" not in (self._caps or {"CAP_KILL"}):
            hint = " (the agent lacks CAP_KILL: see docs/deploy.md)"
        log.error(
            "cannot send %s to orphan pid %d: %s%s%s",
            name,
            key[0],
            exc.strerror or exc,
            hint,
            "; it will not be signalled again" if denied else "",
        )
        return denied

    def _count(self, action: str, outcome: str) -> None:
        key = (action, outcome)
        self.actions_total[key] = self.actions_total.get(key, 0) + 1

    @staticmethod
    def _self_and_ancestors() -> set[int]:
        pids, pid = set(), os.getpid()
        while pid > 1 and pid not in pids:
            pids.add(pid)
            try:
                with open(f"/proc/{pid}/stat", "rb") as handle:
                    pid = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        return pids

    # -- metrics --------------------------------------------------------------------------

    def families(self) -> list[Metric]:
        zombies = GaugeMetricFamily(
            "gpu_zombie_processes",
            "Processes (or leaks) of each zombie class on the GPU, from the last reaper run.",
            labels=[*GPU_LABELS, "class"],
        )
        for (index, uuid), counts in sorted((self._counts or {}).items()):
            for cls in CLASSES:
                zombies.add_metric([str(index), uuid, cls], counts[cls])
        actions = CounterMetricFamily(
            "gpu_exporter_zombie_actions",
            "Reaper decisions by action (report, skip, signal, confirm) and outcome.",
            labels=["action", "outcome"],
        )
        for (action, outcome), count in sorted(self.actions_total.items()):
            actions.add_metric([action, outcome], count)
        audit = CounterMetricFamily(
            "gpu_exporter_audit_write_failures",
            "Audit log writes that failed (disk full, permissions); no signal follows one.",
            labels=[],
        )
        audit.add_metric([], self.audit.failures)
        caps = privileges.capability_family(self._caps)
        found = [actions, caps, audit]
        return [zombies, *found] if self._counts is not None else found

    def close(self) -> None:
        """Release the pidfds of processes still being watched, and the audit log."""
        for pending in self._pending.values():
            with contextlib.suppress(OSError):
                os.close(pending.pidfd)
        self._pending.clear()
        self.audit.close()


def _exited(pidfd: int) -> bool:
    """True once the process behind ``pidfd`` has exited (its pidfd polls readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))
