"""The sampler thread: one sample per interval, published by atomic reference.

Readers (scrapes, /snapshot, actions) take ``sampler.latest`` and never call NVML. A sample that
hangs (NVML can) does not stop them: they keep reading the last Snapshot, which ages past
``interval + deadline`` and is then reported stale.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from exporter.core.snapshot import Snapshot
from exporter.sampling.collect import Collector
from exporter.sampling.stats import SelfStats

#: Renders a Snapshot (and the agent's counters) into what scrapes are served: exposition's
#: ``render``, handed in by the composition root so that sampling never imports exposition.
Renderer = Callable[[Snapshot, SelfStats], bytes]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Published:
    """A Snapshot with its exposition text, rendered once when it was published (empty without
    a renderer)."""

    snapshot: Snapshot
    exposition: bytes


@dataclass(frozen=True)
class Health:
    """Whether the served Snapshot can be trusted, and why not."""

    ok: bool
    reason: str
    age_seconds: float | None
    stale: bool


class Sampler:
    """Runs the Collector every ``interval`` seconds on its own thread."""

    def __init__(
        self,
        collector: Collector,
        *,
        interval: float,
        deadline: float,
        history: int = 120,
        monotonic: Callable[[], float] = time.monotonic,
        render: Renderer | None = None,
    ) -> None:
        self.collector = collector
        self._render = render
        self.interval = interval
        self.deadline = deadline
        self.stats = SelfStats(interval_seconds=interval)
        self._monotonic = monotonic
        self._latest: Published | None = None
        self._history: deque[Snapshot] = deque(maxlen=history)
        self._history_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    @property
    def latest(self) -> Published | None:
        """The last published Snapshot and its exposition (None before the first sample)."""
        return self._latest

    def history(self) -> tuple[Snapshot, ...]:
        """Recent Snapshots, oldest first (for rules that need "sustained for").

        Only the last one keeps its GPUs' process lists; older ones have ``processes`` None
        (see ``Snapshot.without_processes``), so the history's memory does not grow with
        processes x length.
        """
        with self._history_lock:
            return tuple(self._history)

    def sample_once(self) -> Published:
        """Take, count, render and publish one sample on the calling thread."""
        snapshot = self.collector.sample()
        self.stats.count(snapshot, self.deadline)
        if snapshot.duration_seconds > self.deadline:
            log.warning(
                "sample took %.1fs, past its %.1fs deadline",
                snapshot.duration_seconds,
                self.deadline,
            )
        exposition = self._render(snapshot, self.stats) if self._render is not None else b""
        published = Published(snapshot, exposition)
        with self._history_lock:  # readers never see the trimmed previous one as the latest
            if self._history:
                self._history[-1] = self._history[-1].without_processes()
            self._history.append(snapshot)
        self._latest = published  # one reference assignment: readers see old or new, whole
        return published

    def health(self, now: float | None = None) -> Health:
        """Fresh and NVML up: ok. Otherwise a one-line reason."""
        latest = self._latest
        if latest is None:
            return Health(False, "no sample yet", None, True)
        now = self._monotonic() if now is None else now
        age = max(0.0, now - latest.snapshot.monotonic)
        limit = self.interval + self.deadline
        if age > limit:
            return Health(
                False,
                f"stale: last sample {age:.1f}s ago, allowed {limit:.1f}s "
                f"(interval {self.interval:g}s + deadline {self.deadline:g}s); NVML may be hung",
                age,
                True,
            )
        if not latest.snapshot.nvml_up:
            return Health(False, f"NVML down: {latest.snapshot.nvml_error}", age, False)
        return Health(True, "ok", age, False)

    def start(self) -> None:
        """Start sampling on a daemon thread (a hung NVML call must not block exit)."""
        self._thread = threading.Thread(target=self._run, name="gpu-exporter-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> bool:
        """Ask the thread to stop; False when it is still inside a sample after ``timeout``."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        next_tick = self._monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
                self._failing = False
            except Exception as exc:  # a bug must not end sampling; say it once per episode
                key = ("sampler", type(exc).__name__)
                self.stats.errors_total[key] = self.stats.errors_total.get(key, 0) + 1
                if not self._failing:
                    log.exception("sample failed; will try again next interval")
                self._failing = True
            next_tick += self.interval
            now = self._monotonic()
            if next_tick < now:  # the sample overran: skip the missed ticks
                next_tick = now
            self._stop.wait(next_tick - now)
