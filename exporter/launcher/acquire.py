"""Choose GPUs on this host and take their locks: the race-free core of ``run`` and ``reserve``.

Selection reads fresh local Snapshots (one NVML sample each, through the same Collector as the
agent) and the lock directory, or asks a running agent (``run --from``). Taking the locks is the
commit point; under them the chosen GPUs are checked again against a new local Snapshot, so two
launchers that both saw "GPU 2 is free" cannot both end up on it.
"""

from __future__ import annotations

import math
import os
import pwd
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TextIO

from exporter.core.health import assess
from exporter.core.locks import LockDir, LockError, Reservation, lock_name, try_lock
from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.core.selection import (
    Policy,
    Recommendation,
    mig_view,
    recommend,
    visible_devices,
)
from exporter.core.snapshot import Gpu, MigDevice, Snapshot
from exporter.core.units import format_bytes
from exporter.core.visible import visible_mig_devices, visible_uuids
from exporter.launcher.errors import (
    EXIT_NO_GPUS,
    EXIT_WAIT_TIMEOUT,
    ImpossibleRequest,
    LauncherError,
    LockDirError,
    NoDriver,
    NoGpusAvailable,
    UnusableLockFile,
    WaitTimedOut,
    explain,
)
from exporter.sampling.collect import Collector

#: Seconds between two looks while waiting for GPUs.
POLL_SECONDS = 2.0
#: Times in a row the launcher chooses again at once after another one locked a GPU first.
MAX_LOST_RACES = 5
#: Asks a running agent's ``/recommend`` among the GPUs that ``visible`` names (the syntax of
#: ``CUDA_VISIBLE_DEVICES``; None: every GPU); raises LauncherError when it cannot.
Advisor = Callable[[str | None], Recommendation]

__all__ = [  # the exceptions and exit statuses were defined here first: still importable
    "EXIT_NO_GPUS",
    "EXIT_WAIT_TIMEOUT",
    "Advisor",
    "Device",
    "LauncherError",
    "LocalGpus",
    "NoGpusAvailable",
    "acquire",
    "choose",
    "devices",
    "explain",
]


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
            Nvml(library=self._driver),  # None: pynvml
            ProcFs(self.proc_root),
            lock_dir=self.lock_dir,  # type: ignore[arg-type]
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._collector is not None:
            self._collector.close()
        if self._driver is not None:
            self._driver.stop()

    def sample(self) -> Snapshot:
        """One fresh Snapshot; raises NoDriver (a LauncherError) when NVML is unavailable."""
        assert self._collector is not None, "use LocalGpus as a context manager"
        snapshot = self._collector.sample()
        if not snapshot.nvml_up:
            raise NoDriver(
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
    #: Why no set of GPUs on this host could ever satisfy the request ("" when one could).
    never: str = ""

    def cuda_id(self, uuid: str) -> str:
        return self.cuda_ids.get(uuid, uuid)


_NONE: Mapping[str, str] = MappingProxyType({})


def choose(
    policy: Policy,
    snapshots: Sequence[Snapshot],
    visible_env: str | None,
    *,
    mine: int = -1,
    unusable: Mapping[str, str] = _NONE,
    ours: Collection[str] = (),
) -> Choosing:
    """Recommend under ``policy`` among what ``CUDA_VISIBLE_DEVICES`` shows, skipping GPUs locked
    by other processes than ``mine`` (a pid) and those whose lock file is ``unusable`` (UUID ->
    why). GPUs in ``ours`` are locked by this process: never reserved by anyone else."""
    latest = snapshots[-1]
    visible, note = _visible(visible_env, latest)
    locked = set(_reserved(latest, mine, ours)) | set(unusable)
    # the verdict these samples support (no XID history here: docs/launcher.md says what)
    health = assess(snapshots)
    shown: Collection[str] | None = visible
    if policy.mig and visible is not None:  # several MIG devices of one GPU can be named
        shown = {*visible, *visible.values(), *visible_mig_devices(visible_env, latest.gpus)}
    recommendation = recommend(policy, snapshots, locked=locked, visible=shown, health=health)
    recommendation = with_reasons(recommendation, _refused(unusable))
    return Choosing(recommendation, note, visible or {}, never_qualify(policy, latest, shown))


def never_qualify(policy: Policy, latest: Snapshot, visible: Collection[str] | None) -> str:
    """:func:`impossible` for the candidates of ``policy``: the GPUs, or with ``mig`` the MIG
    devices, of ``latest`` that ``visible`` shows."""
    if not policy.mig:
        return impossible(policy, latest.gpus, visible)
    (view,), parents = mig_view([latest])
    return impossible(policy, view.gpus, visible_devices(visible, parents), "MIG device(s)")


def _visible(visible_env: str | None, snapshot: Snapshot) -> tuple[dict[str, str] | None, str]:
    order = os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    return visible_uuids(visible_env, snapshot.gpus, order)


def _reserved(snapshot: Snapshot, mine: int = -1, ours: Collection[str] = ()) -> dict[str, str]:
    """UUID -> reason of the GPUs a launcher lock of another process than ``mine`` holds, less
    ``ours``, whose locks this process holds: a lock whose holder is not visible here (reserved by
    ``UNKNOWN_HOLDER``, the mark of our own lock when ``/proc/locks`` is unreadable) cannot be
    another's on those, since we hold their ``flock``."""
    taken: list[Gpu | MigDevice] = [*snapshot.gpus]
    taken += [device for gpu in snapshot.gpus for device in gpu.mig_devices]
    return {
        g.uuid: "reserved by a launcher lock"
        for g in taken
        if g.uuid and g.reserved_by is not None and g.reserved_by != mine and g.uuid not in ours
    }


def _refused(unusable: Mapping[str, str]) -> dict[str, str]:
    return {uuid: f"lock file refused: {why}" for uuid, why in unusable.items()}


def with_reasons(recommendation: Recommendation, reasons: Mapping[str, str]) -> Recommendation:
    """``recommendation`` with the reason of each rejected GPU in ``reasons`` replaced."""
    changed = {uuid: why for uuid, why in reasons.items() if uuid in recommendation.rejected}
    if not changed:
        return recommendation
    rejected = MappingProxyType({**recommendation.rejected, **changed})
    return replace(recommendation, rejected=rejected)


def impossible(
    policy: Policy, gpus: Sequence[Gpu], visible: Collection[str] | None, what: str = "GPU(s)"
) -> str:
    """Why no ``policy.count`` GPUs of ``gpus`` could ever qualify, whatever runs on them ("" when
    some could): the host has too few, ``CUDA_VISIBLE_DEVICES`` shows too few, or too few have
    ``min_free_memory`` of memory in all. A GPU whose total memory is unknown could. ``what``
    they are, for the message (``MIG device(s)``)."""
    count, here = policy.count, len(gpus)
    shown = [g for g in gpus if visible is None or g.uuid in visible]
    if here < count:
        return f"{count} {what} asked for, and this host has {here}"
    if len(shown) < count:
        return (
            f"{count} {what} asked for, and CUDA_VISIBLE_DEVICES shows {len(shown)} of this "
            f"host's {here}"
        )
    need = policy.min_free_memory
    totals = [_total(g) for g in shown]
    if need is None or sum(t is None or t >= need for t in totals) >= count:
        return ""
    big = sum(t is not None and t >= need for t in totals)
    largest = max((t for t in totals if t is not None), default=None)
    return (
        f"{count} {what} with {format_bytes(need)} free asked for, and {big} of the "
        f"{len(shown)} {what} it may use have that much memory in all "
        f"(the largest: {format_bytes(largest)})"
    )


def _total(gpu: Gpu) -> int | None:
    return gpu.info.memory_total_bytes if gpu.info is not None else None


def devices(snapshot: Snapshot, choosing: Choosing) -> list[Device]:
    """The chosen GPUs (or MIG devices) as Devices, in the order chosen."""
    by_uuid = {g.uuid: g for g in (*snapshot.gpus, *mig_view([snapshot])[0][0].gpus)}
    out = []
    for choice in choosing.recommendation.chosen:
        gpu = by_uuid[choice.uuid]
        total = gpu.info.memory_total_bytes if gpu.info else None
        name = gpu.info.name if gpu.info else ""
        cuda_id = choosing.cuda_id(choice.uuid)
        out.append(Device(choice.index, choice.uuid, name, gpu.memory_free_bytes, total, cuda_id))
    return out


#: What ``_Search.lock`` says when it holds nothing: another launcher was faster, or the chosen
#: GPUs failed the check under the lock (choose again); a lock file was refused (choose again
#: among the others, at once).
_LOST, _REFUSED = "lost", "refused"


def acquire(
    gpus: LocalGpus,
    policy: Policy,
    *,
    visible_env: str | None,
    wait: float | None = None,
    stderr: TextIO | None = None,
    advisor: Advisor | None = None,
) -> tuple[Reservation, list[Device]]:
    """Choose and lock ``policy.count`` GPUs, waiting up to ``wait`` seconds (None or 0: not at
    all; ``math.inf``: as long as it takes).

    With ``advisor`` an agent chooses (``run --from``), and ``policy`` is only what the GPUs are
    checked against here under the lock (the count is the agent's). Raises ImpossibleRequest at
    once when no GPUs on this host could ever qualify, NoGpusAvailable when too few qualify,
    WaitTimedOut when ``wait`` ran out, UnusableLockFile when too few are left once GPUs whose
    lock file cannot be used are refused (each with a warning on ``stderr``).
    """
    out = stderr if stderr is not None else sys.stderr
    search = _Search(gpus, policy, visible_env, advisor, out)
    deadline = time.monotonic() + wait if wait else None
    snapshots = gpus.samples(policy.window)
    announced, lost_races = False, 0
    while True:
        choosing = search.choose(snapshots)
        if choosing.recommendation.ok:
            held = search.lock(choosing)
            if not isinstance(held, str):
                return held
            if held == _LOST:
                lost_races += 1
            if held == _REFUSED or lost_races <= MAX_LOST_RACES:  # choose again at once
                snapshots = [*snapshots[1:], gpus.sample()]
                continue
        _give_up_unless_waiting(search, choosing, deadline, wait)
        if not announced:
            out.write(f"gpu-exporter: waiting {_how_long(wait)}: {_short(choosing)}\n")
            out.flush()
            announced = True
        time.sleep(min(POLL_SECONDS, max(0.0, (deadline or 0.0) - time.monotonic())))
        search.failed.clear()  # the agent's choices that failed here may do now
        snapshots = [*snapshots[1:], gpus.sample()] if policy.window > 1 else [gpus.sample()]


def _give_up_unless_waiting(
    search: _Search, choosing: Choosing, deadline: float | None, wait: float | None
) -> None:
    """Raise the error that ends the search now, if any: the request is impossible, lock files
    were refused, there is no wait, or it ran out."""
    recommendation, note = choosing.recommendation, choosing.note
    if choosing.never:
        raise ImpossibleRequest(recommendation, note, choosing.never)
    if search.unusable:
        raise UnusableLockFile(search.unusable, recommendation, note)
    if deadline is None:
        raise NoGpusAvailable(recommendation, note)
    if time.monotonic() >= deadline:
        raise WaitTimedOut(recommendation, note, wait or 0.0)


def _how_long(wait: float | None) -> str:
    return "with no time limit" if wait is None or math.isinf(wait) else f"up to {wait:g}s"


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


@dataclass
class _Search:
    """One ``acquire``: where choices come from, and what it learnt on the way."""

    gpus: LocalGpus
    policy: Policy  # with an advisor, the flags' only: what is checked here under the lock
    visible_env: str | None
    advisor: Advisor | None
    stderr: TextIO
    #: GPU UUID -> why its lock file cannot be used (a planted link): refused for good.
    unusable: dict[str, str] = field(default_factory=dict)
    #: GPU UUID -> why the agent's choice of it failed here, until the next look.
    failed: dict[str, str] = field(default_factory=dict)

    def choose(self, snapshots: Sequence[Snapshot]) -> Choosing:
        """Choose locally under ``policy``, or ask the agent."""
        if self.advisor is None:
            return choose(self.policy, snapshots, self.visible_env, unusable=self.unusable)
        return self._ask(self.advisor, snapshots[-1])

    def _ask(self, advisor: Advisor, latest: Snapshot) -> Choosing:
        """The agent's choice among the GPUs the caller may use, less those known here to be
        reserved, refused or failed (the agent may not have seen a lock taken just now)."""
        visible, note = _visible(self.visible_env, latest)
        shown = [g.uuid for g in latest.gpus if g.uuid and (visible is None or g.uuid in visible)]
        excluded = {**_reserved(latest), **self.failed, **_refused(self.unusable)}
        excluded = {uuid: why for uuid, why in excluded.items() if uuid in shown}
        # the GPUs by UUID, as CUDA_VISIBLE_DEVICES was read here (by CUDA's rule: the agent's
        # /recommend refuses a malformed entry), less those it may not know are taken
        everyone = visible is None and not excluded
        asked = None if everyone else ",".join(u for u in shown if u not in excluded)
        recommendation = with_reasons(advisor(asked), excluded)
        here = {g.uuid for g in latest.gpus} | {d.uuid for g in latest.gpus for d in g.mig_devices}
        foreign = [c.uuid for c in recommendation.chosen if c.uuid not in here]
        if foreign:
            raise LauncherError(
                f"the agent chose {', '.join(foreign)}, which this host does not have: "
                "ask this host's agent"
            )
        counted = replace(self.policy, count=recommendation.policy.count)
        never = never_qualify(counted, latest, visible)
        return Choosing(recommendation, note, visible or {}, never)

    def lock(self, choosing: Choosing) -> tuple[Reservation, list[Device]] | str:
        """Lock the chosen GPUs and check them again under the locks: the reservation and the
        Devices, or _LOST or _REFUSED."""
        chosen = [choice.uuid for choice in choosing.recommendation.chosen]
        try:
            reservation = try_lock(self.gpus.lock_dir, chosen)
        except LockError as exc:
            uuid = _uuid_in(str(exc), choosing)
            if uuid is None or uuid in self.unusable:  # the directory, not one GPU's file
                raise LockDirError(str(exc)) from None
            self._refuse(uuid, choosing, str(exc))
            return _REFUSED
        if reservation is None:
            return _LOST  # someone took one first
        fresh = self.gpus.sample()  # under the lock: are they still good enough?
        check = replace(self.policy, count=len(chosen), window=1)
        again = choose(check, [fresh], ",".join(chosen), mine=os.getpid(), ours=reservation.uuids)
        if not again.recommendation.ok:
            reservation.release()
            for uuid in chosen:
                if uuid in again.recommendation.rejected:
                    why = again.recommendation.rejected[uuid]
                    self.failed[uuid] = f"chosen by the agent, but here: {why}"
            return _LOST
        return reservation, devices(fresh, choosing)

    def _refuse(self, uuid: str, choosing: Choosing, why: str) -> None:
        """Refuse a GPU whose lock file cannot be used, with a warning naming the file's owner."""
        if "owner uid" not in why:
            why += _owner(self.gpus.lock_dir, uuid)
        self.unusable[uuid] = why
        index = choosing.recommendation.indexes.get(uuid)
        self.stderr.write(f"gpu-exporter: warning: refusing GPU {index} ({uuid}): {why}\n")
        self.stderr.flush()


def _owner(lock_dir: str | LockDir, uuid: str) -> str:
    """`` (owner uid N, name)`` of ``uuid``'s lock file, not following a link; "" if unknown."""
    try:
        name = lock_name(uuid)
        if isinstance(lock_dir, LockDir):
            info = os.stat(name, dir_fd=lock_dir.fd, follow_symlinks=False)
        else:
            info = os.stat(os.path.join(lock_dir, name), follow_symlinks=False)
    except (OSError, LockError):
        return ""
    try:
        user = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        return f" (owner uid {info.st_uid})"
    return f" (owner uid {info.st_uid}, {user})"
