"""What every action is: a job over recent Snapshots that publishes its findings as metrics.

An action never calls NVML. It reads the Snapshots it is given (oldest first; the last is the
latest) and the time of the run; what it concludes it keeps until the next run and exposes
through :meth:`Action.families`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from exporter.config.yamlconf import Section
from exporter.core.findings import Findings
from exporter.core.procfs import ProcFs
from exporter.core.snapshot import Snapshot
from exporter.exposition.metrics import AnyFamily


class Action(abc.ABC):
    """A scheduled job over Snapshots."""

    #: The name under ``actions:`` in the config and the ``action`` label of its metrics.
    name: ClassVar[str]
    #: The kinds of finding (``core.findings``) it publishes; withdrawn when it stops.
    publishes: ClassVar[tuple[type, ...]] = ()

    @abc.abstractmethod
    def run(self, snapshots: Sequence[Snapshot], now: float) -> None:
        """Evaluate the Snapshots (oldest first) at ``now`` on the monotonic clock (the clock of
        ``Snapshot.monotonic``: durations never follow a wall-clock step); may raise."""

    @abc.abstractmethod
    def families(self) -> list[AnyFamily]:
        """The metric families of the latest findings (none before the first run)."""

    def reconfigure(self, settings: Any) -> bool:
        """Take new settings in place, keeping what is under way; False (the default) when
        the action should rather be made anew if its settings changed."""
        del settings
        return False

    def close(self, reason: str = "agent_stopped") -> None:
        """Release what the action holds; ``reason``: ``disabled``, ``agent_stopped``."""
        del reason


S = TypeVar("S")


@dataclass(frozen=True)
class Context:
    """What the engine offers an action it makes."""

    procfs: ProcFs
    dev_root: str
    lock_dir: str | None
    #: where actions publish their findings and read each other's
    findings: Findings
    #: uuids of the GPUs a launcher lock holds, as of the latest Snapshot
    reserved: Callable[[], frozenset[str]]
    #: the health action's state file (None: the default; "": none, kept in memory only)
    state_file: str | None = None


@dataclass(frozen=True)
class ActionType(Generic[S]):
    """One kind of action: how to read its settings and how to make it."""

    name: str  # its key under ``actions:`` and its ``action`` label
    every: float  # seconds between runs when neither ``every`` nor ``cron`` is given
    settings: Callable[[], S]  # its settings when the config says nothing
    parse: Callable[[Section], S]  # its own keys (``enabled``, ``every``, ``cron`` are common)
    make: Callable[[S, Context], Action]


class SnapshotCursor:
    """Which of the Snapshots an action is handed it has not processed yet, for actions that
    carry state from Snapshot to Snapshot. The sampler's sequence starts over when the agent
    restarts sampling (a new Collector): then everything is new and the state is stale."""

    def __init__(self) -> None:
        self._last: tuple[int, float] | None = None  # (seq, timestamp) of the last processed

    def new(self, snapshots: Sequence[Snapshot]) -> tuple[list[Snapshot], bool]:
        """(the Snapshots to process, oldest first; whether the sequence started over, so that
        what the action remembers must be forgotten first)."""
        current = _latest_sequence(snapshots)
        if not current:
            return [], False
        restarted = self._restarted(current)
        if restarted:
            self._last = None
        if self._last is None:
            return current, restarted
        return [snapshot for snapshot in current if snapshot.seq > self._last[0]], False

    def processed(self, snapshot: Snapshot) -> None:
        """Remember ``snapshot`` as the last one processed."""
        self._last = (snapshot.seq, snapshot.timestamp)

    def _restarted(self, current: list[Snapshot]) -> bool:
        if self._last is None:
            return False
        seq, timestamp = self._last
        if current[-1].seq < seq:
            return True
        return any(s.timestamp != timestamp for s in current if s.seq == seq)


def _latest_sequence(snapshots: Sequence[Snapshot]) -> list[Snapshot]:
    """The Snapshots after the last place where ``seq`` goes backwards (all when it never does)."""
    start = 0
    for i in range(1, len(snapshots)):
        if snapshots[i].seq <= snapshots[i - 1].seq:
            start = i
    return list(snapshots[start:])
