"""The ``waste`` action: GPUs and GPU memory that are held but not used.

- **Idle holder**: a process holding at least ``min_memory`` while its activity stays at or
  below ``max_utilization`` for ``for``. Its activity is its own SM share where NVML reports
  per-process utilization, else its GPU's.
- **Allocated but idle**: a GPU allocated to a pod or a Slurm job (``Gpu.allocations``) whose
  activity stays at or below ``max_utilization`` for ``for``.
- **Memory of the dead**: GPU memory NVML attributes to PIDs that are gone from procfs (listed
  in two Snapshots in a row, so that a process that just exited is not counted), plus used
  memory that no listed process accounts for, when that is more than ``orphaned_min_memory``.
  Only where the agent sees the host's PID namespace: elsewhere NVML lists other containers'
  processes as nothing, or as PIDs procfs cannot name, and both would read as dead. No process
  is there to signal (the zombie reaper's ``leaked`` class); a GPU reset clears it once no job
  runs.
- **Leak suspect**: a process whose memory grew in each of the last ``leak.samples`` Snapshots,
  by ``leak.min_growth`` in all.

A GPU's activity is GPM's SM activity where the GPU has it (``gpu_sm_active_ratio``), else
``gpu_utilization_ratio``: the share of time any kernel ran, where one busy SM reads 100 %.
Idle is at or below a noise floor, not zero: idle GPUs report 1 % now and then. Any activity
above it restarts the timer; an unknown reading stops it. Power draw is shown beside the
finding, never used to decide it. The action never signals anything; each finding is logged
when it starts and when it ends.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from exporter.actions.base import Action, ActionType, Context, SnapshotCursor
from exporter.config.options import option, parse_options
from exporter.config.validate import duration, ratio, size, whole
from exporter.config.yamlconf import Section
from exporter.core.activity import ORPHANED_MIN_MEMORY, gpu_activity, unaccounted_memory
from exporter.core.findings import Findings, GpuWaste, ProcessWaste, Waste
from exporter.core.procfs import in_initial_pid_namespace
from exporter.core.snapshot import Gpu, GpuProcess, Snapshot
from exporter.core.units import format_bytes, format_duration
from exporter.exposition.metrics import GPU_LABELS, AnyFamily, gauge

#: A process: (GPU uuid, pid, start time), so that a reused PID starts afresh.
_Key = tuple[str, int, float | None]
_PROCESS_LABELS = [*GPU_LABELS, "pid", "user", "process"]
_NONE: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True)
class WasteConfig:
    """Settings of ``actions.waste``."""

    min_memory: int = option(size, 1 << 30)
    max_utilization: float = option(ratio, 0.05)
    for_seconds: float = option(duration, 1800.0, key="for")
    orphaned_min_memory: int = option(size, ORPHANED_MIN_MEMORY)
    leak_samples: int = option(whole(2, 10_000), 12, key="leak.samples")
    leak_min_growth: int = option(size, 256 << 20, key="leak.min_growth")


def parse_waste(section: Section) -> WasteConfig:
    """The waste action's own keys (not enabled/every/cron, and without ``done()``)."""
    return parse_options(WasteConfig, section)


@dataclass
class _State:
    """What the action carries between Snapshots."""

    idle_since: dict[str, float] = field(default_factory=dict)  # GPU uuid
    process_idle_since: dict[_Key, float] = field(default_factory=dict)
    memory: dict[_Key, deque[int]] = field(default_factory=dict)  # the last leak.samples + 1
    gone: dict[str, set[int]] = field(default_factory=dict)  # GPU uuid -> PIDs not in procfs
    dead: dict[str, set[int]] = field(default_factory=dict)  # ... in two Snapshots in a row


class WasteAction(Action):
    """Idle holders, allocated-but-idle GPUs, memory of the dead and leak suspects."""

    name: ClassVar[str] = "waste"
    publishes = (Waste,)

    def __init__(
        self,
        config: WasteConfig,
        findings: Findings | None = None,
        log: logging.Logger | None = None,
        host_pid_namespace: bool | None = None,
    ) -> None:
        self.config = config
        self.findings = findings if findings is not None else Findings()
        self.log = log or logging.getLogger(__name__)
        self._host = (
            in_initial_pid_namespace() if host_pid_namespace is None else host_pid_namespace
        )
        self._cursor = SnapshotCursor()
        self._state = _State()
        self._published: Waste | None = None
        #: The families of a published Waste, made once: the engine renders every action's
        #: families after any action runs, a few times between two runs of this one.
        self._families: tuple[Waste | None, list[AnyFamily]] = (None, [])

    def reconfigure(self, settings: Any) -> bool:
        """New thresholds apply from the next run on; the timers and windows carry on."""
        self.config = settings
        return True

    def run(self, snapshots: Sequence[Snapshot], now: float) -> None:
        """Process the Snapshots not yet seen and publish what the latest one shows."""
        new, restarted = self._cursor.new(snapshots)
        if restarted:
            self._state = _State()
        latest: Snapshot | None = None
        for snapshot in new:
            self._track(snapshot)
            self._cursor.processed(snapshot)
            latest = snapshot
        if latest is None:
            return
        found = Waste(
            MappingProxyType({g.uuid: self._judge(g, latest.monotonic) for g in _known(latest)})
        )
        self._log_changes(self._published, found)
        self._published = found
        self.findings.publish(found)

    # -- from Snapshot to Snapshot --------------------------------------------------------------

    def _track(self, snapshot: Snapshot) -> None:
        """Carry the state forward by one Snapshot. The sampler keeps process lists only in
        its latest Snapshot (``Snapshot.without_processes``): a GPU without one here leaves
        what is tracked of its processes as it is (they advance once per run, at the latest)."""
        state, limit, now = self._state, self.config.max_utilization, snapshot.monotonic
        listed: set[str] = set()  # GPUs whose process list this Snapshot has
        seen: set[_Key] = set()
        gpus = _known(snapshot)
        for gpu in gpus:
            busy = gpu_activity(gpu)
            _time(state.idle_since, gpu.uuid, busy is not None and busy <= limit, now)
            if gpu.processes is not None:
                listed.add(gpu.uuid)
            for process in gpu.processes or ():
                key = (gpu.uuid, process.pid, process.start_time)
                seen.add(key)
                own = process.sm_utilization_ratio
                level = own if own is not None else busy
                _time(state.process_idle_since, key, level is not None and level <= limit, now)
                window = state.memory.setdefault(key, deque(maxlen=self.config.leak_samples + 1))
                if process.used_memory_bytes is None:
                    window.clear()
                else:
                    window.append(process.used_memory_bytes)
            if self._host and gpu.processes is not None:
                gone = {p.pid for p in gpu.processes if not p.visible}
                state.dead[gpu.uuid] = gone & state.gone.get(gpu.uuid, set())
                state.gone[gpu.uuid] = gone
            elif gpu.processes is not None or not self._host:
                state.dead.pop(gpu.uuid, None)
                state.gone.pop(gpu.uuid, None)
        uuids = {g.uuid for g in gpus}
        state.gone = {u: g for u, g in state.gone.items() if u in uuids}
        state.dead = {u: d for u, d in state.dead.items() if u in uuids}
        state.idle_since = {u: t for u, t in state.idle_since.items() if u in uuids}

        def kept(key: _Key) -> bool:  # still listed, or its GPU's list not in this Snapshot
            return key in seen or (key[0] in uuids and key[0] not in listed)

        state.process_idle_since = {k: t for k, t in state.process_idle_since.items() if kept(k)}
        state.memory = {k: w for k, w in state.memory.items() if kept(k)}

    # -- the latest Snapshot ---------------------------------------------------------------------

    def _judge(self, gpu: Gpu, now: float) -> GpuWaste:
        config, state = self.config, self._state
        since = state.idle_since.get(gpu.uuid)
        idle = now - since if since is not None else None
        processes: dict[int, ProcessWaste] = {}
        for process in gpu.processes or ():
            judged = self._process(gpu, process, now)
            if judged is not None:
                processes[process.pid] = judged
        orphaned, dead = self._orphaned(gpu)
        return GpuWaste(
            index=gpu.index,
            idle_seconds=idle,
            allocated=bool(gpu.allocations),
            allocated_idle=bool(gpu.allocations)
            and idle is not None
            and idle >= config.for_seconds,
            owners=tuple(dict.fromkeys(_owner(a) for a in gpu.allocations)),
            power_watts=gpu.power_watts,
            processes=MappingProxyType(processes),
            orphaned_memory_bytes=orphaned,
            dead_pids=tuple(sorted(dead)),
        )

    def _process(self, gpu: Gpu, process: GpuProcess, now: float) -> ProcessWaste | None:
        config = self.config
        key = (gpu.uuid, process.pid, process.start_time)
        since = self._state.process_idle_since.get(key)
        used = process.used_memory_bytes or 0
        idle = now - since if since is not None and used >= config.min_memory else None
        window = self._state.memory.get(key, ())
        values = list(window)
        growing = len(values) == config.leak_samples + 1 and all(
            b > a for a, b in itertools.pairwise(values)
        )
        growth = values[-1] - values[0] if growing else 0
        leak = growing and growth >= config.leak_min_growth
        if idle is None and not leak:
            return None
        return ProcessWaste(
            user=process.user,
            name=process.name,
            memory_bytes=process.used_memory_bytes,
            idle_seconds=idle,
            idle_holder=idle is not None and idle >= config.for_seconds,
            growth_bytes=growth if leak else None,
        )

    def _orphaned(self, gpu: Gpu) -> tuple[int | None, set[int]]:
        """(memory held by no live process, the PIDs gone from procfs in two Snapshots in a
        row); (None, nothing) where it cannot be told."""
        if not self._host or gpu.processes is None:
            return None, set()
        dead = self._state.dead.get(gpu.uuid, set())
        held = sum(p.used_memory_bytes or 0 for p in gpu.processes if p.pid in dead)
        loose = unaccounted_memory(gpu)
        if loose is None:
            return (held or None), dead
        return held + (loose if loose > self.config.orphaned_min_memory else 0), dead

    # -- logging ---------------------------------------------------------------------------------

    def _log_changes(self, old: Waste | None, new: Waste) -> None:
        before = old.gpus if old is not None else _NONE
        for uuid, now in new.gpus.items():
            was = before.get(uuid)
            self._log_gpu(uuid, was, now)

    def _log_gpu(self, uuid: str, was: GpuWaste | None, now: GpuWaste) -> None:
        where = f"GPU {now.index} ({uuid})"
        power = f", drawing {now.power_watts:.0f} W" if now.power_watts is not None else ""
        if now.allocated_idle and not (was and was.allocated_idle):
            self.log.warning(
                "%s allocated to %s has been idle for %s (activity at or below %g%s)",
                where,
                ", ".join(now.owners),
                format_duration(now.idle_seconds or 0),
                self.config.max_utilization,
                power,
            )
        elif was and was.allocated_idle and not now.allocated_idle:
            self.log.info("%s allocated to %s is no longer idle", where, ", ".join(was.owners))
        orphaned, had = (
            now.orphaned_memory_bytes or 0,
            (was.orphaned_memory_bytes or 0) if was else 0,
        )
        if orphaned and not had:
            dead = f" (PIDs gone: {', '.join(map(str, now.dead_pids))})" if now.dead_pids else ""
            self.log.warning(
                "%s: %s of GPU memory held by no live process%s; no process is left to signal: "
                "a GPU reset clears it once no job runs (nvidia-smi --gpu-reset -i %d)",
                where,
                format_bytes(orphaned),
                dead,
                now.index,
            )
        elif had and not orphaned:
            self.log.info("%s: the memory held by no live process is free again", where)
        old_processes = was.processes if was else _NONE
        for pid, process in now.processes.items():
            prior = old_processes.get(pid)
            self._log_process(where, pid, prior, process)
        for pid, prior in old_processes.items():
            if pid not in now.processes and (prior.idle_holder or prior.growth_bytes):
                self.log.info(
                    "%s: process %d is no longer an idle holder or leak suspect", where, pid
                )

    def _log_process(
        self, where: str, pid: int, was: ProcessWaste | None, now: ProcessWaste
    ) -> None:
        who = f"process {pid} ({now.name or '?'}, {now.user or '?'})"
        if now.idle_holder and not (was and was.idle_holder):
            self.log.warning(
                "%s: %s holds %s and has been idle for %s",
                where,
                who,
                format_bytes(now.memory_bytes),
                format_duration(now.idle_seconds or 0),
            )
        if now.growth_bytes and not (was and was.growth_bytes):
            self.log.warning(
                "%s: %s may leak GPU memory: it grew in each of the last %d samples, by %s in all",
                where,
                who,
                self.config.leak_samples,
                format_bytes(now.growth_bytes),
            )

    # -- metrics ---------------------------------------------------------------------------------

    def families(self) -> list[AnyFamily]:
        """The waste families of the last run (none before it)."""
        found = self._published
        if found is None:
            return []
        made_for, made = self._families
        if made_for is found:
            return made
        idle = gauge(
            "gpu_process_idle_seconds",
            "How long a process holding at least min_memory has been idle so far (absent "
            "when it is not idle).",
            labels=_PROCESS_LABELS,
        )
        holders = gauge(
            "gpu_idle_holders",
            "Processes holding at least min_memory that have been idle for at least `for`.",
            labels=GPU_LABELS,
        )
        allocated = gauge(
            "gpu_allocated_idle",
            "1 while the GPU is allocated to a pod or a Slurm job and has been idle for at "
            "least `for`, else 0 (absent when it is not allocated).",
            labels=GPU_LABELS,
        )
        orphaned = gauge(
            "gpu_orphaned_memory_bytes",
            "GPU memory held by no live process: of PIDs gone from procfs, and used memory no "
            "listed process accounts for beyond orphaned_min_memory.",
            labels=GPU_LABELS,
        )
        growth = gauge(
            "gpu_process_memory_growth_bytes",
            "How much a leak suspect's GPU memory grew over the last leak.samples samples.",
            labels=_PROCESS_LABELS,
        )
        leaks = gauge(
            "gpu_leak_suspects",
            "Processes whose GPU memory grew in each of the last leak.samples samples.",
            labels=GPU_LABELS,
        )
        for uuid, gpu in found.gpus.items():
            ids = [str(gpu.index), uuid]
            for pid, process in gpu.processes.items():
                labels = [*ids, str(pid), process.user, process.name]
                if process.idle_seconds is not None:
                    idle.add_metric(labels, process.idle_seconds)
                if process.growth_bytes is not None:
                    growth.add_metric(labels, float(process.growth_bytes))
            holders.add_metric(ids, float(sum(p.idle_holder for p in gpu.processes.values())))
            leaks.add_metric(
                ids, float(sum(p.growth_bytes is not None for p in gpu.processes.values()))
            )
            if gpu.allocated:
                allocated.add_metric(ids, 1.0 if gpu.allocated_idle else 0.0)
            if gpu.orphaned_memory_bytes is not None:
                orphaned.add_metric(ids, float(gpu.orphaned_memory_bytes))
        made = [idle, holders, allocated, orphaned, growth, leaks]
        self._families = (found, made)
        return made


def _time(since: dict[Any, float], key: Any, idle: bool, now: float) -> None:
    """Start (or keep) ``key``'s idle timer while ``idle``, else stop it."""
    if idle:
        since.setdefault(key, now)
    else:
        since.pop(key, None)


def _known(snapshot: Snapshot) -> list[Gpu]:
    return [g for g in snapshot.gpus if g.up and g.uuid]


def _owner(allocation: Any) -> str:
    if allocation.pod:
        return f"pod {allocation.namespace}/{allocation.pod}"
    return f"job {allocation.slurm_job}"


def _make(settings: WasteConfig, context: Context) -> WasteAction:
    return WasteAction(settings, context.findings)


ACTION = ActionType("waste", 30.0, WasteConfig, parse_waste, _make)
