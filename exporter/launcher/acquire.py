"""Choose GPUs on this host and take their locks: the race-free core of ``run`` and ``reserve``.

Selection reads fresh local Snapshots (one NVML sample each, through the same Collector as the
agent) and the lock directory. Taking the locks is the commit point; under them the chosen GPUs
are checked again against a new Snapshot, so two launchers that both saw "GPU 2 is free" cannot
both end up on it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

from exporter.core.locks import LockDir, LockError, Reservation, try_lock
from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.core.selection import Policy, Recommendation, recommend
from exporter.core.snapshot import Snapshot
from exporter.core.visible import visible_uuids
from exporter.sampling.collect import Collector

#: Exit status when fewer GPUs than asked for are available now (EX_TEMPFAIL: try again later).
EXIT_NO_GPUS = 75
#: Exit status when ``--wait`` ran out before enough GPUs were available (as timeout(1)).
EXIT_WAIT_TIMEOUT = 124
#: Seconds between two looks while waiting for GPUs.
POLL_SECONDS = 2.0
#: Times in a row the launcher chooses again at once after another one locked a GPU first.
MAX_LOST_RACES = 5


class LauncherError(Exception):
    """The launcher cannot go on (NVML unavailable, a bad lock directory); exit 1."""


class NoGpusAvailable(Exception):
    """Fewer GPUs than asked for qualify; ``reasons`` says why each other GPU did not."""

    def __init__(self, recommendation: Recommendation, note: str = "", timed_out: bool = False):
        self.recommendation = recommendation
        self.timed_out = timed_out
        self.note = note
        super().__init__(explain(recommendation, note))


def explain(recommendation: Recommendation, note: str = "") -> str:
    """Why not enough GPUs qualify: one line per rejected GPU."""
    policy = recommendation.policy
    lines = [
        f"{len(recommendation.qualified)} of the {policy.count} GPU(s) asked for qualify "
        f"(policy {policy.name!r}, strategy {policy.strategy})"
    ]
    for item in recommendation.to_dict()["rejected"]:
        lines.append(f"  GPU {item['index']} ({item['uuid']}): {item['reason']}")
    if note:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Device:
    """A GPU handed to a job."""

    index: int
    uuid: str
    name: str
    memory_free_bytes: int | None
    memory_total_bytes: int | None
    cuda_id: str = ""  # what names it in CUDA_VISIBLE_DEVICES: its UUID, or a MIG device's

    def __post_init__(self) -> None:
        if not self.cuda_id:
            object.__setattr__(self, "cuda_id", self.uuid)


class LocalGpus:
    """This host's GPUs through NVML (or a simulation), sampled on demand.

    ``lock_dir``: a path (read as it is, for advice) or a LockDir opened once (to lock in).
    """

    def __init__(
        self, *, simulate: str | None = None, proc_root: str = "/proc", lock_dir: str | LockDir
    ):
        self.simulate = simulate
        self.lock_dir = lock_dir
        self.proc_root = proc_root
        self._driver: Any = None
        self._collector: Collector | None = None

    def __enter__(self) -> LocalGpus:
        if self.simulate:
            from exporter.simulate.driver import simulate

            self._driver = simulate(self.simulate)
        # The Collector reads locks through held_locks and provision, which take either kind.
        self._collector = Collector(
            Nvml(),
            ProcFs(self.proc_root),
            lock_dir=self.lock_dir,  # type: ignore[arg-type]
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._collector is not None:
            self._collector.close()
        if self._driver is not None:
            self._driver.uninstall()

    def sample(self) -> Snapshot:
        """One fresh Snapshot; raises LauncherError when NVML is unavailable."""
        assert self._collector is not None, "use LocalGpus as a context manager"
        snapshot = self._collector.sample()
        if not snapshot.nvml_up:
            raise LauncherError(
                f"NVML is not available: {snapshot.nvml_error}. Is the NVIDIA driver installed "
                "and loaded? (--simulate runs on simulated GPUs)"
            )
        return snapshot

    def samples(self, count: int, spacing: float = 0.5) -> list[Snapshot]:
        """``count`` Snapshots, ``spacing`` seconds apart (for a policy's window)."""
        out = [self.sample()]
        for _ in range(count - 1):
            time.sleep(spacing)
            out.append(self.sample())
        return out


@dataclass(frozen=True)
class Choosing:
    """A recommendation made on this host, with what the user should know about it."""

    recommendation: Recommendation
    note: str  # about CUDA_VISIBLE_DEVICES entries that were ignored or read as indices
    cuda_ids: Mapping[str, str]  # GPU UUID -> what names it to CUDA (a MIG device's UUID)

    def cuda_id(self, uuid: str) -> str:
        return self.cuda_ids.get(uuid, uuid)


def choose(
    policy: Policy,
    snapshots: Sequence[Snapshot],
    visible_env: str | None,
    *,
    mine: int = -1,
    unusable: Collection[str] = (),
) -> Choosing:
    """Recommend under ``policy`` among what ``CUDA_VISIBLE_DEVICES`` shows, skipping GPUs locked
    by other processes than ``mine`` (a pid) and those whose lock file is ``unusable``."""
    latest = snapshots[-1]
    visible, note = visible_uuids(
        visible_env, latest.gpus, os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    )
    locked = {g.uuid for g in latest.gpus if g.reserved_by is not None and g.reserved_by != mine}
    recommendation = recommend(policy, snapshots, locked=locked | set(unusable), visible=visible)
    return Choosing(recommendation, note, visible or {})


def devices(snapshot: Snapshot, choosing: Choosing) -> list[Device]:
    """The chosen GPUs as Devices, in the order chosen."""
    by_uuid = {g.uuid: g for g in snapshot.gpus}
    out = []
    for choice in choosing.recommendation.chosen:
        gpu = by_uuid[choice.uuid]
        total = gpu.info.memory_total_bytes if gpu.info else None
        name = gpu.info.name if gpu.info else ""
        cuda_id = choosing.cuda_id(choice.uuid)
        out.append(Device(choice.index, choice.uuid, name, gpu.memory_free_bytes, total, cuda_id))
    return out


def acquire(
    gpus: LocalGpus,
    policy: Policy,
    *,
    visible_env: str | None,
    wait: float | None = None,
    stderr: TextIO = sys.stderr,
) -> tuple[Reservation, list[Device]]:
    """Choose and lock ``policy.count`` GPUs, waiting up to ``wait`` seconds (None: not at all).

    Raises NoGpusAvailable when they cannot be had (``timed_out`` after a wait).
    """
    deadline = time.monotonic() + wait if wait else None
    snapshots = gpus.samples(policy.window)
    announced, lost_races = False, 0
    unusable: dict[str, str] = {}  # GPU UUID -> why its lock file cannot be used
    while True:
        choosing = choose(policy, snapshots, visible_env, unusable=unusable)
        if choosing.recommendation.ok:
            try:
                held = _lock_and_check(gpus, policy, choosing)
            except LockError as exc:
                uuid = _uuid_in(str(exc), choosing)
                if uuid is None or uuid in unusable:
                    raise
                unusable[uuid] = str(exc)
                stderr.write(f"gpu-exporter: skipping GPU {uuid}: {exc}\n")
                continue
            if held is not None:
                return held
            lost_races += 1
            if lost_races <= MAX_LOST_RACES:  # another launcher was faster: look again at once
                snapshots = [*snapshots[1:], gpus.sample()]
                continue
        if deadline is None or time.monotonic() >= deadline:
            raise NoGpusAvailable(
                choosing.recommendation, choosing.note, timed_out=deadline is not None
            )
        if not announced:
            stderr.write(f"gpu-exporter: waiting up to {wait:g}s: {_short(choosing)}\n")
            stderr.flush()
            announced = True
        time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        snapshots = [*snapshots[1:], gpus.sample()] if policy.window > 1 else [gpus.sample()]


def _short(choosing: Choosing) -> str:
    recommendation = choosing.recommendation
    wanted = recommendation.policy.count
    why = "; ".join(
        f"GPU {r['index']}: {r['reason']}" for r in recommendation.to_dict()["rejected"]
    )
    summary = f"{len(recommendation.qualified)} of {wanted} GPU(s) qualify"
    return f"{summary} ({why})" if why else summary


def _uuid_in(message: str, choosing: Choosing) -> str | None:
    return next((c.uuid for c in choosing.recommendation.chosen if c.uuid in message), None)


def _lock_and_check(
    gpus: LocalGpus, policy: Policy, choosing: Choosing
) -> tuple[Reservation, list[Device]] | None:
    chosen = [choice.uuid for choice in choosing.recommendation.chosen]
    reservation = try_lock(gpus.lock_dir, chosen)
    if reservation is None:
        return None  # someone took one first: choose again
    fresh = gpus.sample()  # under the lock: are they still good enough?
    check = replace(policy, window=1)
    again = choose(check, [fresh], ",".join(chosen), mine=os.getpid())
    if not again.recommendation.ok:
        reservation.release()
        return None
    return reservation, devices(fresh, choosing)
