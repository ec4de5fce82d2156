"""``recommend --prometheus``: the best host and GPUs across every agent one Prometheus scrapes.

The ranking is not redone here. Each fresh agent's GPUs, as Prometheus holds their series,
become one Snapshot per ``instance`` (with its launcher locks, thermal hotspots, zombie holders
and health verdicts), and :func:`exporter.core.selection.recommend` ranks each host under the
policy, as the agent and the local ``recommend`` do. Then the best host is the one whose chosen
GPUs score highest in sum (ties: the lowest ``instance``), or with ``spread`` the best GPUs of
all hosts together. The PromQL and the freshness rules are in ``docs/fleet.md``.

What keeps it fast (1,000 hosts x 8 GPUs: measured by ``bench/scale.py``, docs/scale.md):

- **A fixed number of queries**, whatever the size of the fleet: one for the fresh hosts, one
  for every per-GPU gauge at once (``{__name__=~"gpu_up|gpu_memory_free_bytes|..."}``), one for
  every per-GPU flag at once (locks, thermal reasons, hotspots, zombies, health checks): 3;
  with a policy ``window`` above 1, one ``avg_over_time`` per averaged value as well (at most
  4 more). Never one per host, never per-process series.
- **Filtered on the server**: the selector and the freshness join (``and on (instance, job)``)
  are in every query, and the flags come back only where they are set (``> 0``): a healthy
  fleet answers that query with nothing.
- **Few labels per series**: ``max by (__name__, instance, gpu, uuid)`` drops ``job`` and
  every target label, so each series is about 200 bytes of JSON (8 MB for 8,000 GPUs).
- **Two round trips**: the fresh query goes first (no fresh agent: no other query); the
  others then run concurrently, at the fresh query's evaluation time, so that all of them read
  one instant of Prometheus' data, whatever the clocks of this host and Prometheus say.
- **Only what the policy reads**: SM activity, the slowdown threshold and the process count are
  asked for only by the policies that weigh or filter on them.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from exporter.core.health import CHECKS, Check, Verdict
from exporter.core.selection import Choice, Policy, Recommendation, recommend
from exporter.core.snapshot import (
    CLOCK_EVENT_REASONS,
    THERMAL_CLOCK_EVENTS,
    Gpu,
    GpuInfo,
    GpuProcess,
    HostInfo,
    Snapshot,
    frozen_map,
)
from exporter.launcher.errors import BadArgument, LauncherError, NoGpusAvailable

#: Seconds one query may take before Prometheus counts as unreachable.
TIMEOUT = 10.0
#: A policy's ``window: N`` is the mean over the last N times this many seconds (N scrapes at
#: Prometheus' default scrape_interval): Prometheus knows scrapes, not the agent's samples.
SCRAPE_SECONDS = 15
#: What ``recommend --prometheus --format`` prints: ``INSTANCE UUID`` lines, or JSON.
FORMATS = ("uuid", "json")
#: The zombie classes that keep a GPU out of recommendations (the reaper's, in its order).
ZOMBIE_CLASSES = ("orphan", "defunct", "leaked")
#: Hosts whose GPUs ``explain_fleet`` lists, best first.
EXPLAINED_HOSTS = 5

#: The values ``selection`` averages over a policy's window, by metric.
AVERAGED = ("gpu_memory_free_bytes", "gpu_utilization_ratio", "gpu_temperature_celsius")
SM_ACTIVE = "gpu_sm_active_ratio"
#: The per-GPU flags, each > 0 where it keeps the GPU out.
FLAGS = (
    "gpu_reserved",
    "gpu_clock_event_active",
    "gpu_thermal_hotspot",
    "gpu_zombie_processes",
    "gpu_health_check",
)
_THERMAL_BITS = {name: bit for name, bit in CLOCK_EVENT_REASONS if name in THERMAL_CLOCK_EVENTS}


class PrometheusError(LauncherError):
    """Prometheus cannot be reached, or did not answer a query (exit 1); ``error_type`` is its
    ``errorType`` (``bad_data``, ``execution``, ...) when it said one."""

    def __init__(self, message: str, error_type: str = "") -> None:
        self.error_type = error_type
        super().__init__(message)


class FleetUsageError(BadArgument):
    """A bad ``--prometheus`` URL or ``--selector`` (exit 2)."""


# -- the selector -------------------------------------------------------------------------------

_STRING = r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'
_MATCHER = re.compile(rf"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*(?:{_STRING})\s*(?:,|\Z)")


def parse_selector(text: str | None) -> str:
    """The label matchers of ``--selector`` without their braces (``{cluster="a"}`` ->
    ``cluster="a"``; "" for none); FleetUsageError unless it is ``{matcher, ...}``."""
    if text is None:
        return ""
    inner = text.strip()
    if not (inner.startswith("{") and inner.endswith("}")):
        raise FleetUsageError(_bad_selector(text, "expected label matchers in braces"))
    inner = inner[1:-1].strip()
    inner = inner[:-1].rstrip() if inner.endswith(",") else inner
    names, at = [], 0
    while at < len(inner):
        match = _MATCHER.match(inner, at)
        if match is None:
            raise FleetUsageError(_bad_selector(text, f"no label matcher at {inner[at:]!r}"))
        names.append(match.group(1))
        at = match.end()
    if "__name__" in names:
        raise FleetUsageError(_bad_selector(text, "it selects targets, not metrics: no __name__"))
    return inner


def _bad_selector(text: str, why: str) -> str:
    return f"--selector: {why}, like '{{cluster=\"a\"}}'; got {text!r}"


def _select(matchers: str, *extra: str) -> str:
    """``{matchers,extra...}``, or "" when there are none."""
    parts = [part for part in (matchers, *extra) if part]
    return "{" + ",".join(parts) + "}" if parts else ""


# -- the queries --------------------------------------------------------------------------------


def _fresh(matchers: str) -> str:
    selector = _select(matchers)
    return f"gpu_exporter_snapshot_stale{selector} == 0 and on (instance, job) up{selector} == 1"


def _names(names: Iterable[str]) -> str:
    return '__name__=~"' + "|".join(names) + '"'


def _gauges(policy: Policy) -> list[str]:
    """The per-GPU gauges ``policy`` reads, in one query (the averaged ones when not averaged)."""
    names = ["gpu_up", "gpu_memory_total_bytes"]
    if policy.window <= 1:
        names += _averaged(policy)
    if policy.exclusive:
        names.append("gpu_processes")
    if _weighs(policy, "temperature_headroom"):
        names.append("gpu_temperature_threshold_celsius")
    return names


def _averaged(policy: Policy) -> list[str]:
    return [*AVERAGED, *([SM_ACTIVE] if _weighs(policy, "sm_active") else [])]


def _weighs(policy: Policy, weight: str) -> bool:
    return policy.strategy == "weighted" and getattr(policy.weights, weight) > 0


def queries(policy: Policy, matchers: str = "") -> dict[str, str]:
    """The PromQL of one fleet recommend under ``policy``, by name: ``fresh`` (asked first),
    ``gauges``, ``flags``, and with a ``window`` above 1 each averaged metric's own."""
    fresh = _fresh(matchers)

    def only_fresh(expr: str, by: str = "__name__, instance, gpu, uuid") -> str:
        return f"max by ({by}) ({expr} and on (instance, job) ({fresh}))"

    gauges = _gauges(policy)
    slowdown = 'threshold=~"|slowdown"' if "gpu_temperature_threshold_celsius" in gauges else ""
    classes = 'class=~"|' + "|".join(ZOMBIE_CLASSES) + '"'
    reasons = 'reason=~"|' + "|".join(_THERMAL_BITS) + '"'
    out = {
        "fresh": f"count by (instance) ({fresh})",
        "gauges": only_fresh(_select(_names(gauges), matchers, slowdown)),
        "flags": only_fresh(
            _select(_names(FLAGS), matchers, classes, reasons) + " > 0",
            "__name__, instance, gpu, uuid, class, check, reason",
        ),
    }
    if policy.window > 1:
        seconds = policy.window * SCRAPE_SECONDS
        for name in _averaged(policy):
            expr = f"avg_over_time({name}{_select(matchers)}[{seconds}s])"
            out[name] = only_fresh(expr, "instance, gpu, uuid")
    return out


# -- the client ---------------------------------------------------------------------------------


class Prometheus:
    """Prometheus' HTTP query API at ``url`` (``/api/v1/query``)."""

    def __init__(self, url: str, timeout: float = TIMEOUT) -> None:
        self.url = _checked(url)
        self.timeout = timeout

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to (at ``at``, seconds since the epoch, or
        Prometheus' now); PrometheusError when it cannot be had."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        target = self.url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(target, timeout=self.timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            raise self._refused(exc.code, exc.read()) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {reason}") from None
        try:
            data = json.loads(body)
            if data["status"] != "success" or data["data"]["resultType"] != "vector":
                raise ValueError(f"status {data['status']!r}, {data['data']['resultType']!r}")
            result = data["data"]["result"]
            if not isinstance(result, list):
                raise TypeError("result is no list")
            return result
        except (ValueError, KeyError, TypeError) as exc:
            raise PrometheusError(
                f"{self.url}: not an answer of Prometheus' query API: {_line(repr(exc))}"
            ) from None

    def _refused(self, code: int, body: bytes) -> PrometheusError:
        try:
            data = json.loads(body)
            error_type, error = str(data["errorType"]), str(data["error"])
        except (ValueError, KeyError, TypeError):
            return PrometheusError(
                f"{self.url}: HTTP {code}: {_line(body.decode(errors='replace'))}"
            )
        return PrometheusError(f"{self.url}: HTTP {code}: {error_type}: {_line(error)}", error_type)


def _checked(url: str) -> str:
    """``url`` if it is an http:// or https:// URL with a host; FleetUsageError if not."""
    try:
        parts = urllib.parse.urlsplit(url)
        fine = parts.scheme in ("http", "https") and bool(parts.hostname)
        fine = fine and parts.port != 0  # .port raises for a port out of range
    except ValueError:  # that, or an unclosed [IPv6 address
        fine = False
    if not fine:
        raise FleetUsageError(f"--prometheus: expected an http:// or https:// URL, got {url!r}")
    return url


def _line(text: str, limit: int = 300) -> str:
    """``text`` on one line, at most ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# -- from series to Snapshots -----------------------------------------------------------------


@dataclass(frozen=True)
class Host:
    """One fresh agent, as Prometheus has it: what ``recommend()`` weighs about its GPUs."""

    instance: str
    snapshot: Snapshot
    locked: frozenset[str] = frozenset()
    hotspots: Mapping[str, int] = field(default_factory=dict)
    zombies: Mapping[str, str] = field(default_factory=dict)
    health: Mapping[str, Verdict] = field(default_factory=dict)

    def recommend(self, policy: Policy) -> Recommendation:
        """``policy`` over this host's GPUs: the agent's own rules."""
        return recommend(
            policy,
            [self.snapshot],  # already the window's means, where the policy has one
            locked=self.locked,
            hotspots=self.hotspots,
            zombies=self.zombies,
            health=self.health,
        )


@dataclass
class _Series:
    """What the answers say about one GPU, gathered before it becomes a ``Gpu``."""

    index: int
    uuid: str
    values: dict[str, float] = field(default_factory=dict)
    thermal: int = 0  # clock-event reason bits
    reserved: bool = False
    hotspot: int = 0
    zombies: dict[str, int] = field(default_factory=dict)
    checks: dict[str, int] = field(default_factory=dict)

    def gpu(self) -> Gpu:
        value = self.values.get
        slowdown = value("gpu_temperature_threshold_celsius")
        info = GpuInfo(
            self.index,
            self.uuid,
            memory_total_bytes=_whole(value("gpu_memory_total_bytes")),
            temperature_thresholds=frozen_map({"slowdown": slowdown} if slowdown else None),
        )
        sm_active = value(SM_ACTIVE)
        return Gpu(
            self.index,
            self.uuid,
            up=value("gpu_up") == 1,
            info=info,
            memory_free_bytes=_whole(value("gpu_memory_free_bytes")),
            utilization_ratio=value("gpu_utilization_ratio"),
            temperature_celsius=value("gpu_temperature_celsius"),
            fields=frozen_map({"sm_active": sm_active} if sm_active is not None else None),
            clock_event_reasons=self.thermal or None,
            processes=_stand_ins(value("gpu_processes")),
        )

    def verdict(self) -> Verdict | None:
        if not self.checks:
            return None
        names = [*CHECKS, *sorted(set(self.checks) - set(CHECKS))]  # a newer agent's too
        return Verdict(self.index, self.uuid, tuple(Check(n, self.checks.get(n, 0)) for n in names))


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


def _stand_ins(count: float | None) -> tuple[GpuProcess, ...] | None:
    """``count`` processes for ``exclusive`` to count (their PIDs are not asked for)."""
    if count is None:
        return None
    return tuple(GpuProcess(-n, "compute", None, visible=False) for n in range(1, int(count) + 1))


class _Fleet:
    """The fresh hosts' GPUs, filled from the answers."""

    def __init__(self, instances: Iterable[str]) -> None:
        self.gpus: dict[str, dict[tuple[int, str], _Series]] = {i: {} for i in instances}

    def _find(self, labels: Mapping[str, str]) -> _Series | None:
        host = self.gpus.get(labels.get("instance", ""))
        if host is None:
            return None  # not among the fresh hosts
        try:
            key = (int(labels.get("gpu", "")), labels.get("uuid", ""))
        except ValueError:
            return None
        found = host.get(key)
        if found is None:
            found = host[key] = _Series(*key)
        return found

    def add(self, series: Sequence[Mapping[str, Any]], name: str | None = None) -> None:
        """Take an answer's series (of ``name``, else of their ``__name__``)."""
        for one in series:
            labels, (_, text) = one["metric"], one["value"]
            metric = name or labels.get("__name__", "")
            value = float(text)
            gpu = self._find(labels)
            if gpu is not None and not math.isnan(value):
                _take(gpu, metric, labels, value)

    def hosts(self) -> list[Host]:
        """A Host per fresh instance, with the GPUs that have a ``gpu_up`` series."""
        return [self._host(instance, gpus) for instance, gpus in sorted(self.gpus.items())]

    @staticmethod
    def _host(instance: str, gpus: Mapping[tuple[int, str], _Series]) -> Host:
        ordered = [gpus[key] for key in sorted(gpus) if "gpu_up" in gpus[key].values]
        snapshot = Snapshot(
            seq=0,
            timestamp=0.0,
            monotonic=0.0,
            duration_seconds=0.0,
            nvml_up=True,
            host=HostInfo(instance),
            gpus=tuple(g.gpu() for g in ordered),
        )
        verdicts = {g.uuid: v for g in ordered if (v := g.verdict()) is not None}
        return Host(
            instance,
            snapshot,
            locked=frozenset(g.uuid for g in ordered if g.reserved),
            hotspots={g.uuid: g.hotspot for g in ordered if g.hotspot},
            zombies={g.uuid: z for g in ordered if (z := _zombies(g.zombies))},
            health=verdicts,
        )


def _take(gpu: _Series, metric: str, labels: Mapping[str, str], value: float) -> None:
    """One series' value into ``gpu``: a flag (all > 0 here) or a gauge."""
    if metric == "gpu_reserved":
        gpu.reserved = True
    elif metric == "gpu_clock_event_active":
        gpu.thermal |= _THERMAL_BITS.get(labels.get("reason", ""), 0)
    elif metric == "gpu_thermal_hotspot":
        gpu.hotspot = int(value)
    elif metric == "gpu_zombie_processes":
        gpu.zombies[labels.get("class", "")] = int(value)
    elif metric == "gpu_health_check":
        gpu.checks[labels.get("check", "")] = min(int(value), 2)
    else:
        gpu.values[metric] = value


def _zombies(counts: Mapping[str, int]) -> str:
    """``1 orphan, 2 leaked``, as the reaper names a GPU's holders ("" for none)."""
    return ", ".join(f"{counts[c]} {c}" for c in ZOMBIE_CLASSES if counts.get(c))


def read_fleet(prometheus: Prometheus, policy: Policy, matchers: str = "") -> list[Host]:
    """Every fresh agent that ``matchers`` select, as Hosts (by ``instance``), from the few
    queries of :func:`queries`."""
    asked = queries(policy, matchers)
    fresh = prometheus.query(asked.pop("fresh"))
    instances = {str(s["metric"].get("instance", "")) for s in fresh} - {""}
    if not instances:
        return []
    at = float(fresh[0]["value"][0])  # the same instant for every other query
    names = list(asked)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        answers = list(pool.map(lambda name: prometheus.query(asked[name], at), names))
    fleet = _Fleet(instances)
    for name, answer in zip(names, answers, strict=True):
        try:
            fleet.add(answer, None if name in ("gauges", "flags") else name)
        except (KeyError, TypeError, ValueError) as exc:
            raise PrometheusError(
                f"{prometheus.url}: not an answer of Prometheus' query API: {_line(repr(exc))}"
            ) from None
    return fleet.hosts()


# -- choosing across hosts ----------------------------------------------------------------------


@dataclass(frozen=True)
class Pick:
    """A chosen GPU and its host."""

    instance: str
    choice: Choice

    def to_dict(self) -> dict[str, Any]:
        return {"instance": self.instance, **self.choice.to_dict()}


@dataclass(frozen=True)
class FleetChoice:
    """The outcome of one fleet recommend."""

    policy: Policy
    spread: bool
    #: The chosen GPUs, best first: ``policy.count`` of one host (of several with ``spread``),
    #: or none when too few qualify.
    chosen: tuple[Pick, ...]
    #: Each fresh host's own recommendation, best host first.
    hosts: Mapping[str, Recommendation]

    @property
    def ok(self) -> bool:
        return len(self.chosen) == self.policy.count

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: policy, count, spread, ok, chosen (with instance), hosts."""
        return {
            "policy": self.policy.name,
            "count": self.policy.count,
            "spread": self.spread,
            "ok": self.ok,
            "chosen": [pick.to_dict() for pick in self.chosen],
            "hosts": [{"instance": i, **rec.to_dict()} for i, rec in self.hosts.items()],
        }


def choose_across(
    policy: Policy, recommendations: Mapping[str, Recommendation], spread: bool = False
) -> FleetChoice:
    """The best host's chosen GPUs (highest sum of scores; ties: lowest instance), or with
    ``spread`` the best ``policy.count`` qualified GPUs of all hosts (ties: instance, index)."""
    if spread:
        picks = sorted(
            (Pick(i, c) for i, rec in recommendations.items() for c in rec.qualified),
            key=lambda p: (-p.choice.score, p.instance, p.choice.index),
        )
        chosen = tuple(picks[: policy.count]) if len(picks) >= policy.count else ()
    else:
        fit = [(i, rec) for i, rec in recommendations.items() if rec.ok]
        best = min(fit, key=lambda item: (-_sum(item[1].chosen), item[0]), default=None)
        chosen = tuple(Pick(best[0], c) for c in best[1].chosen) if best else ()
    ranked = sorted(recommendations.items(), key=lambda item: (-_best(item[1]), item[0]))
    return FleetChoice(policy, spread, chosen, MappingProxyType(dict(ranked)))


def _sum(choices: Iterable[Choice]) -> float:
    return math.fsum(c.score for c in choices)


def _best(recommendation: Recommendation) -> float:
    top = recommendation.qualified[: recommendation.policy.count]
    return _sum(top) if top else -math.inf


def recommend_fleet(
    prometheus: Prometheus, policy: Policy, matchers: str = "", *, spread: bool = False
) -> FleetChoice:
    """Recommend under ``policy`` across the fresh agents ``matchers`` select. A query that
    Prometheus refuses as bad data while a selector is given is the selector's fault: exit 2."""
    try:
        hosts = read_fleet(prometheus, policy, matchers)
    except PrometheusError as exc:
        if exc.error_type == "bad_data" and matchers:
            raise FleetUsageError(
                f"--selector {{{matchers}}}: Prometheus refused it: {exc}"
            ) from None
        raise
    recommendations = {host.instance: host.recommend(policy) for host in hosts}
    return choose_across(policy, recommendations, spread)


# -- what is printed --------------------------------------------------------------------------


def render(fleet: FleetChoice, fmt: str) -> str:
    """``INSTANCE UUID`` per chosen GPU (format ``uuid``), or the JSON of ``fleet``."""
    if fmt == "json":
        return json.dumps(fleet.to_dict(), indent=1)
    return "\n".join(f"{pick.instance} {pick.choice.uuid}" for pick in fleet.chosen)


def explain_fleet(fleet: FleetChoice, where: str) -> str:
    """Why too few GPUs qualify: a summary, then the best hosts' GPUs that did not."""
    policy = fleet.policy
    how = f"(policy {policy.name!r}, strategy {policy.strategy})"
    hosts = len(fleet.hosts)
    if not hosts:
        return (
            f"no fresh agent in {where}: no target has up == 1 and gpu_exporter_snapshot_stale == 0"
        )
    if fleet.spread:
        qualified = sum(len(rec.qualified) for rec in fleet.hosts.values())
        head = f"{qualified} of the {policy.count} GPU(s) asked for qualify on {hosts} host(s)"
    else:
        head = f"none of {hosts} host(s) has {policy.count} GPU(s) that qualify"
    lines = [f"{head} in {where} {how}"]
    for instance, rec in list(fleet.hosts.items())[:EXPLAINED_HOSTS]:
        lines.append(f"  {instance}: {len(rec.qualified)} of {len(rec.indexes)} GPU(s) qualify")
        for item in rec.to_dict()["rejected"]:
            lines.append(f"    GPU {item['index']} ({item['uuid']}): {item['reason']}")
    if hosts > EXPLAINED_HOSTS:
        lines.append(f"  ... and {hosts - EXPLAINED_HOSTS} more host(s)")
    return "\n".join(lines)


class FleetShortage(NoGpusAvailable):
    """Too few GPUs qualify across the fleet (exit 75); ``fleet`` says what each host has."""

    def __init__(self, fleet: FleetChoice, where: str) -> None:
        self.fleet, self.where = fleet, where
        best = next(iter(fleet.hosts.values()), None)
        super().__init__(best if best is not None else _nothing(fleet.policy))

    def _message(self) -> str:
        return explain_fleet(self.fleet, self.where)


def _nothing(policy: Policy) -> Recommendation:
    return Recommendation(policy, (), (), MappingProxyType({}), MappingProxyType({}))


__all__ = [
    "FORMATS",
    "FleetChoice",
    "FleetShortage",
    "FleetUsageError",
    "Host",
    "Prometheus",
    "PrometheusError",
    "choose_across",
    "explain_fleet",
    "parse_selector",
    "queries",
    "read_fleet",
    "recommend_fleet",
    "render",
]
