"""The agent's own counters, kept by the sampler across samples (exported by exposition)."""

from __future__ import annotations

from dataclasses import dataclass, field

from exporter.core.snapshot import Snapshot


@dataclass
class SelfStats:
    """The agent's own counters, kept by the sampler across samples."""

    interval_seconds: float
    samples_total: int = 0
    deadline_exceeded_total: int = 0
    errors_total: dict[tuple[str, str], int] = field(default_factory=dict)

    def count(self, snapshot: Snapshot, deadline: float) -> None:
        """Add one finished sample to the counters."""
        self.samples_total += 1
        if snapshot.duration_seconds > deadline:
            self.deadline_exceeded_total += 1
        for error in snapshot.errors:
            key = (error.source, error.error)
            self.errors_total[key] = self.errors_total.get(key, 0) + 1
