"""What every action is: a job over recent Snapshots that publishes its findings as metrics.

An action never calls NVML. It reads the Snapshots it is given (oldest first; the last is the
latest) and the time of the run; what it concludes it keeps until the next run and exposes
through :meth:`Action.families`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

from prometheus_client.core import Metric

from exporter.core.snapshot import Snapshot


class Action(abc.ABC):
    """A scheduled job over Snapshots."""

    #: The name under ``actions:`` in the config and the ``action`` label of its metrics.
    name: ClassVar[str]

    @abc.abstractmethod
    def run(self, snapshots: Sequence[Snapshot], now: float) -> None:
        """Evaluate the Snapshots (oldest first) at ``now`` on the monotonic clock (the clock of
        ``Snapshot.monotonic``: durations never follow a wall-clock step); may raise."""

    @abc.abstractmethod
    def families(self) -> list[Metric]:
        """The metric families of the latest findings (none before the first run)."""
