"""The action engine: APScheduler jobs that run each enabled action over the sampler's Snapshots.

A job that raises is logged and counted; it never stops the scheduler or the exporter. Runs of
one action never overlap (a manual run waits for a scheduled one; missed runs coalesce). After
every run the actions' metrics are rendered once, and scrapes serve those bytes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from apscheduler.executors.pool import BasePoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from exporter.actions.base import Action, ActionType, Context
from exporter.actions.cron import cron_trigger
from exporter.actions.recommend import RecommendConfig, judgements
from exporter.actions.registry import ACTIONS
from exporter.actions.timezone import host_timezone
from exporter.config.policies import policy_with
from exporter.config.validate import boolean, positive_duration
from exporter.config.yamlconf import Section
from exporter.core.findings import Findings
from exporter.core.procfs import ProcFs
from exporter.core.selection import Policy, Recommendation, recommend
from exporter.exposition.metrics import AnyFamily, counter, gauge, render_families
from exporter.sampling.sampler import Sampler

log = logging.getLogger(__name__)

#: Default schedule of each action, seconds between runs.
DEFAULT_EVERY = {action.name: action.every for action in ACTIONS}
S = TypeVar("S")


class _StartedPool(BasePoolExecutor):
    """APScheduler's thread pool with a thread per action, every one started at once.

    concurrent.futures starts a worker only when a job finds none idle, so a pool that starts
    lazily grows the first time several actions' runs overlap, hours in perhaps: a thread count
    that moves then looks like a leak. Runs of one action never overlap, so this many threads
    is all there ever are.
    """

    def __init__(self, workers: int) -> None:
        pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="action")
        started = threading.Barrier(workers)
        for _ in range(workers):
            pool.submit(started.wait)  # each waits for the others: every worker is made
        super().__init__(pool)


@dataclass(frozen=True)
class ActionSettings(Generic[S]):
    """One action's schedule and its own settings (of the type its ActionType declares)."""

    enabled: bool
    every: float | None
    cron: str | None
    options: S


@dataclass(frozen=True)
class ActionsConfig:
    """Settings of every action, by name."""

    actions: Mapping[str, ActionSettings[Any]] = field(
        default_factory=lambda: {
            action.name: ActionSettings(True, action.every, None, action.settings())
            for action in ACTIONS
        }
    )


def _cron(raw: Any) -> str:
    text = str(raw)
    cron_trigger(text)  # ValueError names what is wrong
    return text


def parse_actions(section: Section) -> ActionsConfig:
    """``actions:``: for each action ``enabled``, ``every`` or ``cron``, and its own keys."""
    actions = {}
    for action in ACTIONS:
        name = action.name
        sub = section.section(name)
        enabled = sub.get("enabled", boolean, True)
        every = sub.get("every", positive_duration, None)
        cron = sub.get("cron", _cron, None)
        if every is not None and cron is not None:
            raise sub.error("cron", "give every or cron, not both")
        options = action.parse(sub)
        sub.done()
        actions[name] = ActionSettings(
            enabled, every if every or cron else action.every, cron, options
        )
    section.done()
    return ActionsConfig(actions)


@dataclass
class ActionStats:
    """How an action's runs went since the agent started (``ActionEngine.stats`` copies it)."""

    runs: int = 0
    failures: int = 0
    last_success: float | None = None
    duration: float | None = None
    failing: bool = False


class ActionBusy(Exception):
    """A reload could not wait for the named action's run to end within its timeout."""


class ActionEngine:
    """Builds, schedules and runs the actions; renders their metrics."""

    def __init__(
        self,
        sampler: Sampler,
        config: ActionsConfig,
        procfs: ProcFs,
        dev_root: str,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        lock_dir: str | None = None,
        registry: Sequence[ActionType[Any]] = ACTIONS,
        state_file: str | None = None,
    ) -> None:
        self.sampler = sampler
        self.procfs = procfs
        self.dev_root = dev_root
        self._clock = clock  # wall time, only for timestamps people read
        self._monotonic = monotonic  # what actions measure durations with
        self.lock_dir = lock_dir
        self._registry = {action.name: action for action in registry}
        self._stats = {name: ActionStats() for name in self._registry}
        self._locks = {name: threading.Lock() for name in self._registry}
        #: what the actions found, by kind (``core.findings``): read it, never the actions
        self.findings = Findings()
        self._context = Context(
            procfs, dev_root, lock_dir, self.findings, self.reserved, state_file
        )
        self._render_lock = threading.Lock()
        self._actions: dict[str, Action] = {}
        self.config = ActionsConfig()
        self._scheduler: BackgroundScheduler | None = None
        self._exposition = b""
        self._apply(config)

    # -- configuration ----------------------------------------------------------------------

    def _apply(self, config: ActionsConfig, timeout: float | None = None) -> None:
        # Every action's lock at once: a run in progress ends first, and no run ever sees some
        # actions configured anew and others not (a run holds one lock only: no deadlock).
        # Past ``timeout`` nothing is applied and ActionBusy names the action still running.
        deadline = None if timeout is None else time.monotonic() + timeout
        with contextlib.ExitStack() as held:
            for name, lock in self._locks.items():
                wait = -1 if deadline is None else max(0.0, deadline - time.monotonic())
                if not lock.acquire(timeout=wait):
                    raise ActionBusy(name)
                held.callback(lock.release)
            for name, settings in config.actions.items():
                current = self._actions.get(name)
                if current is not None and settings.enabled:
                    if current.reconfigure(settings.options):  # in place (a kill in progress)
                        continue
                    if self.config.actions[name].options == settings.options:
                        continue  # unchanged: keep its state (timers, levels)
                if current is not None:
                    self._close(current, "disabled" if not settings.enabled else "replaced")
                self._actions.pop(name, None)
                if settings.enabled:
                    self._actions[name] = self._registry[name].make(settings.options, self._context)
            self.config = config
        self._render()

    def reload(self, config: ActionsConfig, timeout: float | None = None) -> None:
        """Apply a new configuration: changed actions start afresh, the others keep state.

        Waits for runs in progress; with ``timeout``, at most that long, then raises ActionBusy
        having applied nothing.
        """
        self._apply(config, timeout)
        if self._scheduler is not None:
            self._schedule()

    # -- scheduling -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduler; interval jobs run once right away."""
        logging.getLogger("apscheduler").setLevel(logging.ERROR)  # we log runs and failures
        self._scheduler = BackgroundScheduler(
            timezone=host_timezone(),
            executors={"default": _StartedPool(len(self._registry))},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
        )
        self._scheduler.start()
        self._schedule()

    def _schedule(self) -> None:
        assert self._scheduler is not None
        self._scheduler.remove_all_jobs()
        for name, settings in self.config.actions.items():
            if not settings.enabled:
                continue
            if settings.cron:
                trigger: Any = cron_trigger(settings.cron)
                first = None
            else:
                trigger = IntervalTrigger(seconds=settings.every, timezone=host_timezone())
                delay = datetime.timedelta(seconds=min(1.0, settings.every or 1.0))
                first = datetime.datetime.now(datetime.timezone.utc) + delay  # after a sample
            self._scheduler.add_job(
                self.run, trigger, args=[name], id=name, name=name, next_run_time=first
            )

    def stop(self) -> None:
        """Stop scheduling; release what the reaper holds."""
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None
        for action in self._actions.values():
            self._close(action, "agent_stopped")

    def _close(self, action: Action, reason: str) -> None:
        action.close(reason)
        for kind in action.publishes:
            self.findings.withdraw(kind)

    def action(self, name: str) -> Action | None:
        """The running action of that name; None while it is disabled."""
        return self._actions.get(name)

    def stats(self, name: str) -> ActionStats:
        """A copy of how the named action's runs went."""
        return dataclasses.replace(self._stats[name])

    # -- running ----------------------------------------------------------------------------

    def run(self, name: str) -> bool:
        """Run one action now over the latest Snapshots; False when it failed or is disabled."""
        with self._locks[name]:
            action = self._actions.get(name)
            if action is None:
                return False
            stats = self._stats[name]
            started = time.monotonic()
            stats.runs += 1
            try:
                action.run(self.sampler.history(), self._monotonic())
                ok = True
            except Exception:
                ok = False
                stats.failures += 1
                if not stats.failing:
                    log.exception("action %s failed; it runs again at its next time", name)
            stats.failing = not ok
            stats.duration = time.monotonic() - started
            if ok:
                stats.last_success = self._clock()
        self._render()
        return ok

    def reserved(self) -> frozenset[str]:
        """UUIDs of the GPUs a launcher lock holds, as of the latest Snapshot."""
        latest = self.sampler.latest
        if latest is None:
            return frozenset()
        return frozenset(g.uuid for g in latest.snapshot.gpus if g.reserved_by is not None)

    def policies(self) -> Mapping[str, Policy]:
        """The configured recommendation policies by name (``default`` always among them)."""
        settings: RecommendConfig = self.config.actions["recommend"].options
        return settings.policies

    def recommend(
        self,
        policy_name: str,
        params: Mapping[str, str],
        visible: Collection[str] | None = None,
    ) -> Recommendation:
        """Recommend now for a known ``policy_name`` with query overrides, among ``visible``
        UUIDs when given; ValueError for a bad parameter."""
        policy = self.policies()[policy_name]
        return recommend(
            policy_with(policy, params),
            self.sampler.history(),
            locked=self.reserved(),
            visible=visible,
            **judgements(self.findings),
        )

    # -- metrics ----------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The actions' metrics as rendered after the last run."""
        return self._exposition

    def _render(self) -> None:
        with self._render_lock:
            families: list[AnyFamily] = [*self._stat_families()]
            for action in list(self._actions.values()):
                families.extend(action.families())
            self._exposition = render_families(families)

    def _stat_families(self) -> list[AnyFamily]:
        labels = ["action"]
        enabled = gauge(
            "gpu_exporter_action_enabled", "1 when the action is enabled.", labels=labels
        )
        runs = counter("gpu_exporter_action_runs", "Runs of the action.", labels=labels)
        failures = counter(
            "gpu_exporter_action_failures", "Runs of the action that raised.", labels=labels
        )
        last = gauge(
            "gpu_exporter_action_last_success_timestamp_seconds",
            "When the action last succeeded, seconds since the epoch.",
            labels=labels,
        )
        duration = gauge(
            "gpu_exporter_action_duration_seconds", "How long the last run took.", labels=labels
        )
        for name, stats in sorted(self._stats.items()):
            enabled.add_metric([name], 1.0 if name in self._actions else 0.0)
            runs.add_metric([name], stats.runs)
            failures.add_metric([name], stats.failures)
            if stats.last_success is not None:
                last.add_metric([name], stats.last_success)
            if stats.duration is not None:
                duration.add_metric([name], stats.duration)
        return [enabled, runs, failures, last, duration]
