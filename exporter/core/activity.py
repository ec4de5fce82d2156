"""How busy a GPU is, and how long each GPU process has shown no SM activity, carried from
sample to sample.

NVML reports per-process SM utilization only for a short window (the samples since the last
read), so "idle since" has to be remembered by the sampler. A process is keyed by GPU, PID and
start time, so a reused PID starts afresh.
"""

from __future__ import annotations

from exporter.core.snapshot import Gpu

#: Used memory no listed process accounts for, up to this, is the driver's and the contexts' own
#: (the waste action's ``orphaned_min_memory`` default).
ORPHANED_MIN_MEMORY = 1 << 30


def gpu_activity(gpu: Gpu) -> float | None:
    """The GPU's activity, 0-1: GPM's SM activity where known, else its utilization (the share
    of time any kernel ran, where one busy SM reads 100 %)."""
    sm_active = gpu.fields.get("sm_active")
    return sm_active if sm_active is not None else gpu.utilization_ratio


def unaccounted_memory(gpu: Gpu) -> int | None:
    """Used memory no listed process accounts for; None where it cannot be told (memory or a
    process's memory unknown)."""
    if gpu.memory_used_bytes is None or gpu.processes is None:
        return None
    listed = [p.used_memory_bytes for p in gpu.processes]
    if any(used is None for used in listed):
        return None
    return max(0, gpu.memory_used_bytes - sum(u for u in listed if u is not None))


ProcessKey = tuple[str, int, int]  # (GPU uuid, pid, start ticks; 0 when not visible)


class IdleTimes:
    """Idle durations of the processes of one sample, remembered for the next."""

    def __init__(self) -> None:
        self._idle_since: dict[ProcessKey, float] = {}
        self._seen: set[ProcessKey] = set()

    def observe(self, key: ProcessKey, utilization: float | None, now: float) -> float | None:
        """Seconds ``key`` has been idle as of ``now`` (monotonic): 0 while it is active,
        counted from the first sample that saw it idle; None when its utilization is unknown
        (which also forgets what was known)."""
        self._seen.add(key)
        if utilization is None:
            self._idle_since.pop(key, None)
            return None
        if utilization > 0:
            self._idle_since.pop(key, None)
            return 0.0
        return now - self._idle_since.setdefault(key, now)

    def end_sample(self) -> None:
        """Forget the processes the sample just taken did not list."""
        self._idle_since = {k: v for k, v in self._idle_since.items() if k in self._seen}
        self._seen = set()
