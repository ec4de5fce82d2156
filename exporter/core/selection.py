"""Recommend GPUs for a new job: which GPUs to put in ``CUDA_VISIBLE_DEVICES``, and why not others.

A *policy* names a strategy (how GPUs are ranked), how many GPUs the job needs, and filters. The
rules, in the order they are applied to every GPU of the latest Snapshot:

1. A GPU must be present and up in the latest Snapshot (else ``down``).
2. These GPUs are always excluded: thermally throttling (``sw_thermal_slowdown`` or
   ``hw_thermal_slowdown`` active in the latest Snapshot: ``thermal throttling``) and reserved by a
   launcher lock (``reserved by a launcher lock``). With ``exclude_hotspots`` (the default), so is
   a GPU at thermal hotspot level 1 or more (``thermal hotspot level N``); with
   ``exclude_zombies`` (the default), a GPU where the zombie reaper's last run found orphaned,
   defunct or leaked holders (``zombie holders: 1 orphan``); with ``exclude_unhealthy``
   ``critical`` (the default), a GPU whose health verdict is critical, or with ``warning``,
   warning or worse (``unhealthy: row remap pending``; ``off`` takes any).
3. Filters: ``min_free_memory``, ``max_utilization``, ``max_temperature`` compare the GPU's
   windowed means; ``exclusive`` wants no process of any user in the latest Snapshot. A value
   that is unknown *fails* its filter (``free memory unknown``): unknown never passes.
4. Scores, higher is better (``weighted`` by default, with the weights 0.7 free memory, 0.3
   idleness, 0 temperature: prefer idle GPUs, as the seeds teach): ``most_free_memory`` = free
   bytes; ``least_utilized`` =
   1 - utilization; ``coolest`` = -temperature; ``weighted`` = (w.free_memory * free/total +
   w.idle * (1 - utilization) + w.temperature_headroom * headroom + w.sm_active * (1 - SM
   activity)) / (sum of the weights), where headroom = clamp((T - temperature) / T, 0, 1) and T
   is the GPU's slowdown threshold, or 90 celsius when unknown, and SM activity is GPM's
   ``sm_active`` where the GPU has GPM, else its utilization. A value the strategy needs that
   is unknown rejects the GPU (``cannot score: utilization unknown``); a weight of 0 does not
   need its value.
5. Ranking is by score, best first; ties go to the lowest NVML index (sort key (-score, index)).
   ``chosen`` is the best ``count`` GPUs, or nothing at all when fewer than ``count`` qualify
   (all or nothing: a job never silently gets fewer GPUs than it asked for).

Windowed values: free memory, utilization, temperature and SM activity are each the mean over
those of the last ``window`` Snapshots (fewer when fewer exist) in which the GPU (matched by
UUID) was up and the value known; when none of them has the value, it is unknown.
``window: 1`` (the default) therefore uses the latest Snapshot only. Down, throttling and
``exclusive`` use the latest Snapshot only.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from exporter.core.health import CRITICAL, WARNING, Verdict
from exporter.core.snapshot import Gpu, MigDevice, Snapshot
from exporter.core.units import format_bytes

STRATEGIES = ("most_free_memory", "least_utilized", "coolest", "weighted")
#: ``exclude_unhealthy`` values, and the verdict level each leaves out (None: none)
UNHEALTHY_LEVELS: Mapping[str, int | None] = MappingProxyType(
    {"critical": CRITICAL, "warning": WARNING, "off": None}
)
DEFAULT_POLICY = "default"
#: The headroom reference of the weighted strategy when a GPU has no slowdown threshold.
DEFAULT_SLOWDOWN_CELSIUS = 90.0
MAX_COUNT = 64
MAX_WINDOW = 1000

_NONE: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Weights:
    """Weights of the ``weighted`` strategy's three terms (each 0 to 1 before weighting)."""

    free_memory: float = 0.7  # the seeds' weights: mostly free memory, then idleness
    idle: float = 0.3
    temperature_headroom: float = 0.0
    #: Idleness of the SMs (GPM's SM activity) where GPM answers, else of the GPU (utilization).
    sm_active: float = 0.0

    @property
    def total(self) -> float:
        return self.free_memory + self.idle + self.temperature_headroom + self.sm_active


@dataclass(frozen=True)
class Policy:
    """How to pick GPUs for one kind of job."""

    name: str
    strategy: str = "weighted"  # free memory share and idleness (the seeds' rule)
    count: int = 1
    min_free_memory: int | None = None  # bytes
    max_utilization: float | None = None  # 0-1
    max_temperature: float | None = None  # celsius
    exclude_hotspots: bool = True
    exclusive: bool = False  # no processes of any user on it
    exclude_zombies: bool = (
        True  # leave out GPUs where the reaper found orphaned, defunct or leaked holders
    )
    window: int = 1  # rank on the mean over the last N Snapshots
    weights: Weights = field(default_factory=Weights)
    #: leave out GPUs whose health verdict is this bad or worse: critical, warning, or off
    exclude_unhealthy: str = "critical"
    #: choose MIG devices (with no process) of GPUs in MIG mode instead of whole GPUs
    mig: bool = False


def with_default(policies: Mapping[str, Policy]) -> Mapping[str, Policy]:
    out = dict(policies)
    if DEFAULT_POLICY not in out:
        out = {DEFAULT_POLICY: Policy(DEFAULT_POLICY), **out}
    return MappingProxyType(out)


# -- recommending ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """A GPU that qualified, with its score."""

    index: int
    uuid: str
    score: float

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "score": self.score}


@dataclass(frozen=True)
class Recommendation:
    """The outcome of one policy over one run's Snapshots."""

    policy: Policy
    #: The best ``policy.count`` qualified GPUs, or none when fewer qualify (all or nothing).
    chosen: tuple[Choice, ...]
    #: Every GPU that passed, best first.
    qualified: tuple[Choice, ...]
    #: uuid -> one-line reason, for every identified GPU that did not qualify.
    rejected: Mapping[str, str]
    #: uuid -> score, for every GPU that could be scored (qualified or not).
    scores: Mapping[str, float]
    #: uuid -> NVML index of every identified GPU in the latest Snapshot.
    indexes: Mapping[str, int] = field(default_factory=lambda: _NONE)

    @property
    def ok(self) -> bool:
        """True when the policy's count of GPUs was chosen."""
        return len(self.chosen) == self.policy.count

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: policy, count, ok, chosen, qualified, rejected."""
        rejected = sorted(self.rejected.items(), key=lambda item: self._index(item[0]))
        return {
            "policy": self.policy.name,
            "count": self.policy.count,
            "ok": self.ok,
            "chosen": [choice.to_dict() for choice in self.chosen],
            "qualified": [choice.to_dict() for choice in self.qualified],
            "rejected": [
                {"index": self.indexes.get(uuid), "uuid": uuid, "reason": reason}
                for uuid, reason in rejected
            ],
        }

    def _index(self, uuid: str) -> tuple[int, str]:
        return (self.indexes.get(uuid, 1 << 30), uuid)


@dataclass(frozen=True)
class _Means:
    """A GPU's values averaged over the policy's window; None when unknown."""

    free: float | None
    utilization: float | None
    temperature: float | None
    sm_active: float | None = None


class _Unknown(Exception):
    """A value a strategy needs is unknown (the message names it)."""


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _means(uuid: str, snapshots: Sequence[Snapshot], window: int) -> _Means:
    found: dict[str, list[float]] = {
        "free": [],
        "utilization": [],
        "temperature": [],
        "sm_active": [],
    }
    for snapshot in snapshots[-window:]:
        for gpu in snapshot.gpus:
            if gpu.uuid != uuid or not gpu.up:
                continue
            for key, value in (
                ("free", gpu.memory_free_bytes),
                ("utilization", gpu.utilization_ratio),
                ("temperature", gpu.temperature_celsius),
                ("sm_active", gpu.fields.get("sm_active")),
            ):
                if value is not None and math.isfinite(value):
                    found[key].append(float(value))
    return _Means(**{key: _mean(values) for key, values in found.items()})


def _pct(value: float) -> str:
    return f"{value * 100:.1f}".rstrip("0").rstrip(".") + "%"


def _deg(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".") + " °C"


def _exclusions(
    gpu: Gpu,
    policy: Policy,
    hotspots: Mapping[str, int],
    locked: Collection[str],
    zombies: Mapping[str, str],
    health: Mapping[str, Verdict],
) -> list[str]:
    reasons = []
    worst = UNHEALTHY_LEVELS[policy.exclude_unhealthy]
    verdict = health.get(gpu.uuid)
    if worst is not None and verdict is not None and verdict.level >= worst:
        texts = [c.reason or c.name for c in verdict.checks if c.level >= worst]
        reasons.append(f"unhealthy: {'; '.join(texts)}")
    if gpu.thermal_throttling():
        reasons.append("thermal throttling")
    if gpu.uuid in locked:
        reasons.append("reserved by a launcher lock")
    elif any(device.uuid in locked for device in gpu.mig_devices):
        reasons.append("a MIG device of it is reserved by a launcher lock")
    if policy.exclude_zombies and gpu.uuid in zombies:
        reasons.append(f"zombie holders: {zombies[gpu.uuid]}")
    level = hotspots.get(gpu.uuid, 0)
    if policy.exclude_hotspots and level >= 1:
        reasons.append(f"thermal hotspot level {level}")
    if policy.exclusive:
        if gpu.processes is None:
            reasons.append("processes unknown")
        elif gpu.processes:
            count = len({proc.pid for proc in gpu.processes})
            reasons.append(f"not exclusive: {count} process{'es' if count > 1 else ''} on it")
    return reasons


def _filters(means: _Means, policy: Policy) -> list[str]:
    reasons = []
    if policy.min_free_memory is not None:
        if means.free is None:
            reasons.append("free memory unknown")
        elif means.free < policy.min_free_memory:
            reasons.append(
                f"free memory {format_bytes(means.free)} below "
                f"{format_bytes(policy.min_free_memory)}"
            )
    if policy.max_utilization is not None:
        if means.utilization is None:
            reasons.append("utilization unknown")
        elif means.utilization > policy.max_utilization:
            reasons.append(
                f"utilization {_pct(means.utilization)} above {_pct(policy.max_utilization)}"
            )
    if policy.max_temperature is not None:
        if means.temperature is None:
            reasons.append("temperature unknown")
        elif means.temperature > policy.max_temperature:
            reasons.append(
                f"temperature {_deg(means.temperature)} above {_deg(policy.max_temperature)}"
            )
    return reasons


def _need(value: float | None, what: str) -> float:
    if value is None:
        raise _Unknown(what)
    return value


def _free_fraction(gpu: Gpu, means: _Means) -> float:
    free = _need(means.free, "free memory")
    total = gpu.info.memory_total_bytes if gpu.info is not None else None
    if not total or total <= 0:
        raise _Unknown("total memory")
    return min(max(free / total, 0.0), 1.0)


def _headroom(gpu: Gpu, means: _Means) -> float:
    temperature = _need(means.temperature, "temperature")
    limit = gpu.info.temperature_thresholds.get("slowdown") if gpu.info is not None else None
    if limit is None or not math.isfinite(limit) or limit <= 0:
        limit = DEFAULT_SLOWDOWN_CELSIUS
    return min(max((limit - temperature) / limit, 0.0), 1.0)


def _weighted(gpu: Gpu, means: _Means, weights: Weights) -> float:
    if weights.total <= 0:
        raise _Unknown("weights (all are 0)")
    score = 0.0
    if weights.free_memory:
        score += weights.free_memory * _free_fraction(gpu, means)
    if weights.idle:
        score += weights.idle * (1.0 - _need(means.utilization, "utilization"))
    if weights.temperature_headroom:
        score += weights.temperature_headroom * _headroom(gpu, means)
    if weights.sm_active:  # GPM's SM activity where it answers, else utilization
        busy = means.sm_active if means.sm_active is not None else means.utilization
        score += weights.sm_active * (1.0 - _need(busy, "utilization"))
    return score / weights.total


def _score(gpu: Gpu, means: _Means, policy: Policy) -> float:
    """The GPU's score under the policy's strategy; raises _Unknown for a missing value."""
    if policy.strategy == "most_free_memory":
        return _need(means.free, "free memory")
    if policy.strategy == "least_utilized":
        return 1.0 - _need(means.utilization, "utilization")
    if policy.strategy == "coolest":
        return -_need(means.temperature, "temperature")
    if policy.strategy == "weighted":
        return _weighted(gpu, means, policy.weights)
    raise ValueError(f"unknown strategy {policy.strategy!r} (use one of {', '.join(STRATEGIES)})")


def _judge(
    gpu: Gpu,
    snapshots: Sequence[Snapshot],
    policy: Policy,
    hotspots: Mapping[str, int],
    locked: Collection[str],
    zombies: Mapping[str, str],
    health: Mapping[str, Verdict],
) -> tuple[float | None, list[str]]:
    """The score of an up GPU (None when it cannot be scored) and why it does not qualify."""
    means = _means(gpu.uuid, snapshots, policy.window)
    reasons = _exclusions(gpu, policy, hotspots, locked, zombies, health)
    reasons += _filters(means, policy)
    try:
        return _score(gpu, means, policy), reasons
    except _Unknown as exc:
        if f"{exc} unknown" not in reasons:
            reasons.append(f"cannot score: {exc} unknown")
        return None, reasons


def recommend(
    policy: Policy,
    snapshots: Sequence[Snapshot],
    *,
    hotspots: Mapping[str, int] = _NONE,
    locked: Collection[str] = (),
    visible: Collection[str] | None = None,
    zombies: Mapping[str, str] = _NONE,
    health: Mapping[str, Verdict] = _NONE,
) -> Recommendation:
    """Rank the GPUs of the latest Snapshot under ``policy`` (rules in the module docstring).

    ``snapshots`` are oldest first; ``hotspots`` maps uuid -> thermal hotspot level; ``locked``
    holds the uuids a launcher lock reserves; ``visible``, when given, the only uuids that may be
    chosen (what ``CUDA_VISIBLE_DEVICES`` makes visible); ``zombies`` maps uuid -> what the
    zombie reaper found holding it (``1 orphan``); ``health`` uuid -> health verdict. Ties
    break by lowest NVML index.
    """
    if policy.mig:
        snapshots, parents = mig_view(snapshots)
        hotspots = _for_devices(hotspots, parents)
        zombies = _for_devices(zombies, parents)
        health = _for_devices(health, parents)
        locked = {*locked, *(d for d, parent in parents.items() if parent in locked)}
        visible = visible_devices(visible, parents)
        policy = replace(policy, exclusive=True)  # a MIG device is taken whole, by one job
    latest = snapshots[-1].gpus if snapshots else ()
    qualified: list[Choice] = []
    rejected: dict[str, str] = {}
    scores: dict[str, float] = {}
    indexes: dict[str, int] = {}
    for gpu in latest:
        if not gpu.uuid:
            continue  # never identified: it can be neither chosen nor named
        indexes[gpu.uuid] = gpu.index
        if visible is not None and gpu.uuid not in visible:
            rejected[gpu.uuid] = "hidden by CUDA_VISIBLE_DEVICES"
            continue
        if not gpu.up:
            rejected[gpu.uuid] = "down"
            continue
        score, reasons = _judge(gpu, snapshots, policy, hotspots, locked, zombies, health)
        if score is not None:
            scores[gpu.uuid] = score
        if reasons:
            rejected[gpu.uuid] = "; ".join(reasons)
        elif score is not None:
            qualified.append(Choice(gpu.index, gpu.uuid, score))
    qualified.sort(key=lambda choice: (-choice.score, choice.index))
    chosen = tuple(qualified[: policy.count]) if len(qualified) >= policy.count else ()
    return Recommendation(
        policy=policy,
        chosen=chosen,
        qualified=tuple(qualified),
        rejected=MappingProxyType(rejected),
        scores=MappingProxyType(scores),
        indexes=MappingProxyType(indexes),
    )


# -- MIG devices as candidates ------------------------------------------------------------------


def mig_view(snapshots: Sequence[Snapshot]) -> tuple[list[Snapshot], dict[str, str]]:
    """``snapshots`` with each GPU in MIG mode replaced by its MIG devices, as GPUs (a device's
    UUID, memory, GPM activity, processes and launcher lock; its GPU's index, model, temperature,
    clocks and state), and the other GPUs left out; and MIG UUID -> its GPU's UUID."""
    parents: dict[str, str] = {}
    out = []
    for snapshot in snapshots:
        gpus = []
        for gpu in snapshot.gpus:
            for device in gpu.mig_devices:
                parents[device.uuid] = gpu.uuid
                gpus.append(_as_gpu(gpu, device))
        out.append(replace(snapshot, gpus=tuple(gpus)))
    return out, parents


def _as_gpu(gpu: Gpu, device: MigDevice) -> Gpu:
    processes = tuple(p for p in gpu.processes or () if device.uuid in p.mig_uuids)
    info = gpu.info
    if info is not None:
        name = f"{info.name} MIG {device.profile}".strip()
        info = replace(
            info, uuid=device.uuid, name=name, memory_total_bytes=device.memory_total_bytes
        )
    busy = device.fields.get("graphics_engine_active")
    if busy is None and gpu.processes is not None and not processes:
        busy = 0.0  # nothing runs on it
    return replace(
        gpu,
        uuid=device.uuid,
        info=info,
        memory_used_bytes=device.memory_used_bytes,
        memory_free_bytes=device.memory_free_bytes,
        utilization_ratio=busy,
        fields=device.fields,
        processes=processes if gpu.processes is not None else None,
        mig_devices=(),
        reserved_by=device.reserved_by,
        reserved_by_user=device.reserved_by_user,
    )


def _for_devices(by_gpu: Mapping[str, Any], parents: Mapping[str, str]) -> Mapping[str, Any]:
    """A mapping by GPU UUID extended to each GPU's MIG devices (hotspots, health, zombies)."""
    return {**by_gpu, **{d: by_gpu[p] for d, p in parents.items() if p in by_gpu}}


def visible_devices(visible: Collection[str] | None, parents: Mapping[str, str]) -> set[str] | None:
    """The MIG devices ``visible`` shows: those it names (``CUDA_VISIBLE_DEVICES=MIG-...``),
    and all of a GPU it names whole. ``visible`` is a collection of UUIDs, or a mapping of
    GPU UUIDs to what names them to CUDA (a GPU's UUID or one of its MIG devices')."""
    if visible is None:
        return None
    named = set(visible) | (set(visible.values()) if isinstance(visible, Mapping) else set())
    whole = {
        p for p in set(parents.values()) & named if not any(d in named for d in _of(p, parents))
    }
    return {device for device, parent in parents.items() if device in named or parent in whole}


def _of(parent: str, parents: Mapping[str, str]) -> list[str]:
    return [device for device, owner in parents.items() if owner == parent]
