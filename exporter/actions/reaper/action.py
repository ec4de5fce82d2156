"""The zombie reaper action: sort GPU holders into classes; end orphans safely.

Holders of a GPU are the processes with an open descriptor on its device node
(``<paths.dev>/nvidiaN``, N = the GPU's minor number), found by scanning ``<paths.proc>/*/fd``,
together with NVML's process list in the latest Snapshot. Each is put in one class:

- ``orphan``: a live holder whose job has ended on the agent's own evidence (see
  :mod:`exporter.actions.reaper.evidence`: its parent or group leader was seen on NVML's list of
  the same GPU and has exited since), that has not used the GPU since (where the driver reports
  per-process utilization), for at least ``min_age`` and in a later Snapshot. The only class
  that may be signalled (``kill_classes``).
- ``defunct``: state Z (its parent must reap it). ``uninterruptible``: state D.
- ``unverifiable``: NVML lists a PID that is not visible here, or that holds no descriptor on
  that GPU (its PID number may have been reused); or the agent cannot fully see the process
  (procfs of another PID namespace, its group or session outside the namespace, a hidden
  parent or group leader under ``hidepid``).
- ``leaked``: GPU memory in use with no holder at all (a driver-level leak; needs a reset).

A holder with no such evidence (a job that lives, a ``nohup`` job, a daemon, a service) is not
reported and never signalled.

Signalling (``dry_run: false`` only): ``pidfd_open``, compare the start time with the one seen at
detection, write the decision to the audit log, SIGTERM through the pidfd; at a later run past
``grace_period`` SIGKILL; past ``kill_timeout`` after that, report it ``unkillable``. A reload
that would now refuse the signal (dry run, a protection, ``kill_classes``, a lower
``max_kills_per_run``, the reaper disabled) cancels a pending SIGKILL. Once it has exited, a
later Snapshot confirms that NVML no longer lists it on that GPU. Every duration is measured on
the monotonic clock.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from exporter.actions.audit import AuditLog
from exporter.actions.base import Action, ActionType, Context
from exporter.actions.reaper.config import CLASSES, ReaperConfig, parse_reaper
from exporter.actions.reaper.evidence import JobEnd, JobWatch, pidfd_exited
from exporter.core import privileges
from exporter.core.findings import RECENT_DECISIONS, Findings, ZombieHolders
from exporter.core.locks import SUFFIX as LOCK_SUFFIX
from exporter.core.procfs import Credentials, ProcessInfo, ProcFs, file_identity, scan_fd_holders
from exporter.core.snapshot import Gpu, GpuProcess, Snapshot
from exporter.exposition.metrics import GPU_LABELS, AnyFamily, Family, counter, gauge

log = logging.getLogger(__name__)

#: The keys of a recent decision (``ZombieHolders.recent``): always all of them, None when an
#: audit record has no such key.
_RECENT_KEYS: Mapping[str, Any] = dict.fromkeys(
    ("event", "class", "gpu", "uuid", "pid", "process", "user", "reason", "signal", "why")
)


def _recent(record: Mapping[str, Any]) -> dict[str, Any]:
    """What ``ZombieHolders.recent`` keeps of an audit record: its decision, and when."""
    return {"time": time.time(), **{k: record.get(k) for k in _RECENT_KEYS}}


@dataclass
class _Seen:
    """A leak seen before: when and in which Snapshot it was first seen so."""

    since: float
    seq: int


@dataclass
class _Pending:
    """A process being signalled: the pidfd pins it, so a reused PID is never hit."""

    pidfd: int
    info: ProcessInfo
    credentials: Credentials
    gpu: int
    uuid: str
    termed_at: float
    killed_at: float | None = None

    @property
    def pid(self) -> int:
        return self.info.pid


@dataclass
class _Finding:
    gpu: Gpu
    pid: int
    cls: str
    info: ProcessInfo | None
    reason: str = ""


#: The classes that make a GPU one to leave out of recommendations (its memory is held by what
#: no job wants: an orphan, a defunct process, a leak).
_UNWANTED = ("orphan", "defunct", "leaked")
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


def _describe(end: JobEnd, activity_known: bool) -> str:
    job = end.process
    idle = "no GPU activity since" if activity_known else "GPU activity not reported"
    return f"its job's process {job.pid} ({end.relation}) held this GPU and has exited; {idle}"


class ZombieReaper(Action):
    """The ``zombie_reaper`` action."""

    name = "zombie_reaper"
    publishes = (ZombieHolders,)

    def __init__(
        self,
        config: ReaperConfig,
        procfs: ProcFs,
        dev_root: str,
        *,
        audit: AuditLog | None = None,
        lock_dir: str | None = None,
        watch: JobWatch | None = None,
        exited: Callable[[int], bool] = pidfd_exited,
        findings: Findings | None = None,
    ) -> None:
        self.config = config
        self.findings = findings if findings is not None else Findings()
        self.procfs = procfs
        self.dev_root = dev_root
        self.audit = audit or AuditLog(config.audit_log)
        self.lock_dir = lock_dir
        self._watch = watch or JobWatch()
        self._exited = exited  # a seam: whether a signalled process's pidfd says it exited
        self._locked: set[int] = set()  # processes holding a launcher lock: their job is alive
        self._protected_pids = self._self_and_ancestors()
        self._leaks: dict[str, _Seen] = {}  # uuid -> first seen leaking
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._confirm: dict[tuple[int, int], tuple[str, int, float]] = {}
        # never signalled again: "unkillable" (survived SIGKILL) or "signal_failed" (EPERM...)
        self._given_up: dict[tuple[int, int], str] = {}
        self._reported: set[tuple[Any, ...]] = set()
        self._counts: dict[tuple[int, str], dict[str, int]] | None = None
        self._classes: dict[tuple[str, int], str] = {}  # (uuid, pid) -> class, last run
        self._decisions: dict[tuple[str, int], str] = {}  # (uuid, pid) -> last audit event
        self._recent: deque[Mapping[str, Any]] = deque(maxlen=RECENT_DECISIONS)
        self._namespace_warned = False
        self.actions_total: dict[tuple[str, str], int] = {}
        self._caps = privileges.effective()
        self._warn_privileges(None)

    def reconfigure(self, settings: ReaperConfig) -> bool:
        """New settings, always in place: what is being watched carries on under them, and a
        pending signal that they would refuse is cancelled (and audited so)."""
        config = settings
        if config.audit_log != self.config.audit_log:
            self.audit.close()
            self.audit = AuditLog(config.audit_log)
        before, self.config = self.config, config
        self._warn_privileges(before)
        for key, pending in sorted(self._pending.items(), key=lambda item: item[1].termed_at):
            reason = self._refusal(pending.info, pending.credentials, "orphan")
            if reason:
                self._cancel(key, reason)
        waiting = [k for k, p in self._pending.items() if p.killed_at is None]
        for key in sorted(waiting, key=lambda k: self._pending[k].termed_at)[
            config.max_kills_per_run :
        ]:
            self._cancel(key, "max_kills_per_run")
        return True

    def _warn_privileges(self, before: ReaperConfig | None) -> None:
        """Log, once, each thing the settings ask for that the capabilities do not allow."""
        told = set(privileges.reaper_warnings(before.dry_run, self._caps)) if before else set()
        for line in privileges.reaper_warnings(self.config.dry_run, self._caps):
            if line not in told:
                log.warning("%s", line)

    # -- the run --------------------------------------------------------------------------

    def run(self, snapshots: Sequence[Snapshot], now: float) -> None:
        """One pass over the latest Snapshot; ``now`` is the monotonic clock."""
        if not snapshots:
            return
        latest = snapshots[-1]
        self._progress_pending(now)
        self._confirm_released(latest, now)
        findings, considered = self._classify(latest, now)
        counts = {
            (g.index, g.uuid): dict.fromkeys(CLASSES, 0) for g in latest.gpus if g.up and g.uuid
        }
        for finding in findings:
            counts.setdefault((finding.gpu.index, finding.gpu.uuid), dict.fromkeys(CLASSES, 0))
            counts[(finding.gpu.index, finding.gpu.uuid)][finding.cls] += 1
            self._report(finding)
        self._counts = counts
        # what was said of a process (or a leak, pid 0) is not said again while it is still
        # there in any class
        present = considered | {finding.pid for finding in findings}
        self._reported = {key for key in self._reported if key[2] in present}
        self._classes = {(f.gpu.uuid, f.pid): f.cls for f in findings if f.pid}
        self._decisions = {k: v for k, v in self._decisions.items() if k[1] in present}
        self._signal_orphans([f for f in findings if f.cls == "orphan" and f.info], now)
        self.findings.publish(
            ZombieHolders(
                self.holders_found(), self.verdicts(), self.config.dry_run, tuple(self._recent)
            )
        )

    def _classify(self, latest: Snapshot, now: float) -> tuple[list[_Finding], set[int]]:
        """The findings of this run, and every PID looked at (listed or holding a GPU)."""
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
        own_namespace = self.procfs.in_own_pid_namespace()
        if not own_namespace and not self._namespace_warned:
            self._namespace_warned = True
            log.warning(
                "%s shows another PID namespace than the agent's: every GPU process there is "
                "unverifiable and none is signalled (run the agent in the host's PID namespace)",
                self.procfs.root,
            )
        listed = {g.uuid: {p.pid: p for p in g.processes or ()} for g in gpus}
        holding = {g.uuid: holders.get(g.uuid, set()) for g in gpus}
        considered = set().union(*listed.values(), *holding.values())
        infos = {pid: self.procfs.process(pid) for pid in sorted(considered)}
        self._observe(infos, listed, latest, now, trusted=own_namespace)
        hidden = self.procfs.hides_processes()
        findings: list[_Finding] = []
        signalled = {p.pid for p in self._pending.values()}
        ended = {pid for pid, _ in self._confirm}  # exited after our signal: being confirmed
        for gpu in gpus:
            for pid in sorted(listed[gpu.uuid].keys() | holding[gpu.uuid]):
                if pid in signalled:  # still the orphan being signalled, whatever it looks like
                    findings.append(_Finding(gpu, pid, "orphan", None, "being signalled"))
                    continue
                if pid in ended:  # NVML may list it a little longer; not a new finding
                    continue
                finding = self._classify_one(
                    gpu,
                    pid,
                    infos[pid],
                    listed[gpu.uuid].get(pid),
                    pid in holding[gpu.uuid],
                    pid not in unreadable,
                    own_namespace=own_namespace,
                    hidden=hidden,
                    latest=latest,
                    now=now,
                )
                if finding is not None:
                    findings.append(finding)
            leak = self._leak(gpu, set(listed[gpu.uuid]), holding[gpu.uuid], complete, latest, now)
            if leak is not None:
                findings.append(leak)
        return findings, considered

    def _observe(
        self,
        infos: dict[int, ProcessInfo | None],
        listed: dict[str, dict[int, GpuProcess]],
        latest: Snapshot,
        now: float,
        *,
        trusted: bool,
    ) -> None:
        """Feed the evidence: every live GPU process and the GPUs NVML lists it on."""
        seen = []
        for pid, info in infos.items():
            if info is None or info.state == "Z":
                continue
            on = {uuid for uuid, processes in listed.items() if pid in processes}
            seen.append((info, on))
        self._watch.observe(seen, self._still_same, now, latest.seq, trusted=trusted)

    def _still_same(self, info: ProcessInfo) -> bool:
        current = self.procfs.process(info.pid)
        return current is not None and current.start_ticks == info.start_ticks

    def _classify_one(
        self,
        gpu: Gpu,
        pid: int,
        info: ProcessInfo | None,
        listed: GpuProcess | None,
        holding: bool,
        readable: bool,
        *,
        own_namespace: bool,
        hidden: bool,
        latest: Snapshot,
        now: float,
    ) -> _Finding | None:
        if info is None:
            if listed is not None and not self._watch.seen_exit(pid):
                return _Finding(gpu, pid, "unverifiable", None, "listed by NVML, not visible here")
            return None  # a holder that has just exited
        if info.state == "Z":
            if self._watch.seen_exit(pid, latest.seq):
                return None  # it has just exited: defunct only if its parent leaves it so
            return _Finding(
                gpu, pid, "defunct", info, f"defunct; its parent {info.ppid} must reap it"
            )
        if info.state == "D":
            return _Finding(gpu, pid, "uninterruptible", info, "in uninterruptible sleep (D)")
        if not holding:
            why = "holds no descriptor on the GPU" if readable else "descriptors not readable"
            return _Finding(gpu, pid, "unverifiable", info, f"listed by NVML, {why}")
        if not own_namespace:
            why = "in another PID namespace than the agent's"
            return _Finding(gpu, pid, "unverifiable", info, why)
        if info.pgid <= 0 or info.sid <= 0 or (info.ppid <= 0 and pid != 1):
            why = "its parent, process group or session is outside this PID namespace"
            return _Finding(gpu, pid, "unverifiable", info, why)
        end = self._watch.job_end(info, gpu.uuid)
        if end is not None:
            return self._orphan(gpu, info, end, listed, latest, now)
        if hidden and not all(self._visible(p) for p in (info.ppid, info.pgid, info.sid)):
            why = "its parent, group or session leader is hidden (procfs mounted with hidepid)"
            return _Finding(gpu, pid, "unverifiable", info, why)
        return None  # a live job, or a detached one: no evidence its job has ended

    def _visible(self, pid: int) -> bool:
        return self.procfs.process(pid) is not None

    def _orphan(
        self,
        gpu: Gpu,
        info: ProcessInfo,
        end: JobEnd,
        listed: GpuProcess | None,
        latest: Snapshot,
        now: float,
    ) -> _Finding | None:
        """An orphan once ``min_age`` has passed, in a later Snapshot, since its job ended and
        since it last used the GPU (as the sampler saw it); None until then."""
        since = end.process.ended_at or now
        idle = listed.gpu_idle_seconds if listed is not None else None
        if idle is not None:  # it was last active at the Snapshot's time less its idle time
            since = max(since, latest.monotonic - idle)
        if now - since < self.config.min_age or latest.seq <= end.process.ended_seq:
            return None
        return _Finding(gpu, info.pid, "orphan", info, _describe(end, idle is not None))

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

    def _refusal(self, info: ProcessInfo, credentials: Credentials | None, cls: str) -> str:
        """Why the current settings refuse to signal this process; "" when they allow it."""
        config = self.config
        if cls not in config.kill_classes:
            return "kill_classes"
        if info.pid == 1 or info.pid in self._protected_pids:
            return "protected_pid"
        if credentials is None:
            return "identity_unknown"
        names = {info.name, credentials.exe} - {""}
        if any(fnmatch.fnmatchcase(n, p) for n in names for p in config.protect_names):
            return "protected_name"
        for uid in credentials.uids:  # real, effective, saved and filesystem uid
            if (
                str(uid) in config.protect_users
                or self.procfs.user_name(uid) in config.protect_users
            ):
                return "protected_user"
        if self._under_launcher_lock(info):
            return "launcher_lock"
        return "dry_run" if config.dry_run else ""

    def _under_launcher_lock(self, info: ProcessInfo) -> bool:
        """True when the process, or one of its ancestors, holds a launcher lock: its job is
        still supervised (``gpu-exporter run`` is a subreaper: a ``spawn`` worker whose job's
        main process died is re-parented to it, holding no lock itself)."""
        pid, seen = info.pid, set[int]()
        while pid > 1 and pid not in seen and len(seen) < 64:
            if pid in self._locked:
                return True
            seen.add(pid)
            parent = info if pid == info.pid else self.procfs.process(pid)
            if parent is None:
                return False
            pid = parent.ppid
        return False

    def _signal_orphans(self, orphans: list[_Finding], now: float) -> None:
        started = 0
        for finding in orphans:
            info = finding.info
            assert info is not None
            key = (info.pid, info.start_ticks)
            if key in self._pending:
                continue
            credentials = self.procfs.credentials(info.pid, info.start_ticks)
            reason = self._given_up.get(key) or self._refusal(info, credentials, finding.cls)
            if not reason and started >= self.config.max_kills_per_run:
                reason = "max_kills_per_run"
            if reason:
                self._skip(finding, reason)
                continue
            assert credentials is not None
            if self._terminate(finding, credentials, now):
                started += 1

    def _terminate(self, finding: _Finding, credentials: Credentials, now: float) -> bool:
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
            pidfd, info, credentials, finding.gpu.index, finding.gpu.uuid, now
        )
        return True

    def _progress_pending(self, now: float) -> None:
        for key, pending in list(self._pending.items()):
            event = {"gpu": pending.gpu, "uuid": pending.uuid, "pid": pending.pid}
            if self._exited(pending.pidfd):
                self._write({**event, "event": "exited"})
                self._count("signal", "exited")
                self._confirm[key] = (pending.uuid, pending.gpu, now)
            elif pending.killed_at is None and now - pending.termed_at >= self.config.grace_period:
                reason = self._refusal(pending.info, pending.credentials, "orphan")
                if reason:  # settings changed without a reconfigure: still never past them
                    self._cancel(key, reason)
                    continue
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
                log.warning(
                    "sent SIGKILL to orphan pid %d (%s) holding GPU %d: it outlived SIGTERM by "
                    "%.0fs",
                    pending.pid,
                    pending.info.name,
                    pending.gpu,
                    now - pending.termed_at,
                )
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

    def _cancel(self, key: tuple[int, int], reason: str) -> None:
        """Call off the SIGKILL still to come for a process that got SIGTERM."""
        pending = self._pending.get(key)
        if pending is None or pending.killed_at is not None:
            return  # SIGKILL is out already: nothing left to call off
        self._write(
            {
                "gpu": pending.gpu,
                "uuid": pending.uuid,
                "pid": pending.pid,
                "event": "cancelled",
                "signal": "SIGKILL",
                "reason": reason,
                "dry_run": self.config.dry_run,
            }
        )
        self._count("cancel", reason)
        log.warning(
            "called off the SIGKILL of pid %d (%s) on GPU %d: %s",
            pending.pid,
            pending.info.name,
            pending.gpu,
            reason,
        )
        with contextlib.suppress(OSError):
            os.close(pending.pidfd)
        del self._pending[key]

    def _confirm_released(self, latest: Snapshot, now: float) -> None:
        for key, (uuid, index, exited_at) in list(self._confirm.items()):
            if latest.monotonic <= exited_at:
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
        written = self.audit.write({"action": self.name, **record})
        if written and record.get("pid") and record.get("uuid"):  # only what really happened
            words = (record["event"], record.get("signal"), record.get("reason"))
            self._decisions[(record["uuid"], record["pid"])] = " ".join(w for w in words if w)
            self._recent.append(MappingProxyType(_recent(record)))
        return written

    def verdicts(self) -> Mapping[tuple[str, int], tuple[str | None, str | None]]:
        """(uuid, pid) -> (its class at the last run or None, the last decision about it or
        None: ``found``, ``skipped dry_run``, ``signalling SIGTERM``, ``cancelled SIGKILL
        disabled``, ...), for the processes the last run looked at."""
        keys = self._classes.keys() | self._decisions.keys()
        return {key: (self._classes.get(key), self._decisions.get(key)) for key in keys}

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

    def holders_found(self) -> Mapping[str, str]:
        """uuid -> the orphaned, defunct and leaked holders of the last run (``1 orphan``), for
        the recommendations that leave such GPUs out; GPUs with none are absent."""
        found = {}
        for (_, uuid), counts in (self._counts or {}).items():
            parts = [f"{counts[cls]} {cls}" for cls in _UNWANTED if counts.get(cls)]
            if parts:
                found[uuid] = ", ".join(parts)
        return found

    # -- metrics --------------------------------------------------------------------------

    def families(self) -> list[AnyFamily]:
        zombies = gauge(
            "gpu_zombie_processes",
            "Processes (or leaks) of each zombie class on the GPU, from the last reaper run.",
            labels=[*GPU_LABELS, "class"],
        )
        for (index, uuid), counts in sorted((self._counts or {}).items()):
            for cls in CLASSES:
                zombies.add_metric([str(index), uuid, cls], counts[cls])
        actions = counter(
            "gpu_exporter_zombie_actions",
            "Reaper decisions by action (report, skip, signal, cancel, confirm) and outcome.",
            labels=["action", "outcome"],
        )
        for (action, outcome), count in sorted(self.actions_total.items()):
            actions.add_metric([action, outcome], count)
        audit = counter(
            "gpu_exporter_audit_write_failures",
            "Audit log writes that failed (disk full, permissions); no signal follows one.",
            labels=[],
        )
        audit.add_metric([], self.audit.failures)
        caps = _capability_family(self._caps)
        found: list[AnyFamily] = [actions, caps, audit]
        return [zombies, *found] if self._counts is not None else found

    def close(self, reason: str = "agent_stopped") -> None:
        """Call off every pending SIGKILL (audited with ``reason``: ``disabled`` when the
        reaper is switched off), release the pidfds and the audit log."""
        for key in list(self._pending):
            self._cancel(key, reason)
        for pending in self._pending.values():
            with contextlib.suppress(OSError):
                os.close(pending.pidfd)
        self._pending.clear()
        self._watch.close()
        self.audit.close()


def _capability_family(caps: frozenset[str] | None) -> Family:
    """``gpu_exporter_capability{name}``: 1 when the capability is in the effective set."""
    family = gauge(
        "gpu_exporter_capability",
        "1 when the agent has the capability in its effective set (those the zombie reaper "
        "needs), else 0.",
        labels=["name"],
    )
    if caps is not None:
        for name in sorted(privileges.CAPABILITIES):
            family.add_metric([name], 1.0 if name in caps else 0.0)
    return family


def _make(settings: ReaperConfig, context: Context) -> ZombieReaper:
    return ZombieReaper(
        settings,
        context.procfs,
        context.dev_root,
        lock_dir=context.lock_dir,
        findings=context.findings,
    )


ACTION = ActionType("zombie_reaper", 30.0, ReaperConfig, parse_reaper, _make)
