"""How long each GPU process has shown no SM activity, carried from sample to sample.

NVML reports per-process SM utilization only for a short window (the samples since the last
read), so "idle since" has to be remembered by the sampler. A process is keyed by GPU, PID and
start time, so a reused PID starts afresh.
"""

from __future__ import annotations

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
