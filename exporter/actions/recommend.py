"""The ``recommend`` action: recommends GPUs under every configured policy at each run and
publishes the choices as metrics. The rules are :mod:`exporter.core.selection`'s."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from exporter.actions.base import Action, ActionType, Context
from exporter.config.policies import parse_policies
from exporter.config.yamlconf import Section
from exporter.core.findings import (
    Findings,
    HealthVerdicts,
    Recommendations,
    ThermalLevels,
    ZombieHolders,
)
from exporter.core.selection import Policy, Recommendation, recommend, with_default
from exporter.core.snapshot import Snapshot
from exporter.exposition.metrics import GPU_LABELS, AnyFamily, gauge

_NONE: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class RecommendConfig:
    """The configured policies by name; always contains ``default``."""

    policies: Mapping[str, Policy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policies", with_default(self.policies))


def parse_recommend(section: Section) -> RecommendConfig:
    """The policies of the ``actions.recommend`` section (reads only its ``policies`` key).

    Every policy's keys are validated and unknown ones are errors; ``section`` itself is left for
    the caller to finish (``enabled``, ``every``, ``cron`` and its own ``done()``).
    """
    return RecommendConfig(parse_policies(section.section("policies")))


@dataclass(frozen=True)
class _Findings:
    recommendations: Mapping[str, Recommendation]
    gpus: tuple[tuple[int, str], ...]  # (index, uuid) of every identified GPU, latest Snapshot


def judgements(findings: Findings) -> dict[str, Mapping[str, Any]]:
    """What the other actions found that recommendations weigh, as ``recommend``'s keyword
    arguments: thermal levels, zombie holders, health verdicts (empty where an action is off)."""
    thermal = findings.get(ThermalLevels)
    zombies = findings.get(ZombieHolders)
    health = findings.get(HealthVerdicts)
    return {
        "hotspots": thermal.levels if thermal is not None else _NONE,
        "zombies": zombies.holders if zombies is not None else _NONE,
        "health": health.verdicts if health is not None else _NONE,
    }


class RecommendAction(Action):
    """Recommends GPUs for every configured policy and publishes the choices as metrics."""

    name: ClassVar[str] = "recommend"
    publishes: ClassVar[tuple[type, ...]] = (Recommendations,)

    def __init__(
        self,
        config: RecommendConfig,
        findings: Findings | None = None,
        locked: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self.config = config
        self.findings = findings if findings is not None else Findings()
        self._locked = locked
        self._findings: _Findings | None = None

    def run(self, snapshots: Sequence[Snapshot], now: float) -> None:
        """Recommend for every policy over ``snapshots`` (oldest first)."""
        locked = frozenset(self._locked())
        recommendations = {
            name: recommend(policy, snapshots, locked=locked, **judgements(self.findings))
            for name, policy in self.config.policies.items()
        }
        gpus = tuple((g.index, g.uuid) for g in (snapshots[-1].gpus if snapshots else ()) if g.uuid)
        self._findings = _Findings(MappingProxyType(recommendations), gpus)
        self.findings.publish(Recommendations(self._findings.recommendations))

    def latest(self) -> Mapping[str, Recommendation]:
        """The last run's recommendation of every policy by name (empty before the first run)."""
        return self._findings.recommendations if self._findings is not None else _NONE

    def families(self) -> list[AnyFamily]:
        """gpu_recommended, gpu_recommendation_score, gpu_recommended_devices."""
        findings = self._findings
        if findings is None:
            return []
        labels = [*GPU_LABELS, "policy"]
        recommended = gauge(
            "gpu_recommended",
            "1 when the policy recommends this GPU for a new job, else 0.",
            labels=labels,
        )
        score = gauge(
            "gpu_recommendation_score",
            "The GPU's score under the policy's strategy, higher is better (absent: no score).",
            labels=labels,
        )
        devices = gauge(
            "gpu_recommended_devices",
            "GPUs the policy recommends: its count, or 0 when too few qualify.",
            labels=["policy"],
        )
        for name, rec in findings.recommendations.items():
            chosen = {choice.uuid for choice in rec.chosen}
            for index, uuid in findings.gpus:
                series = [str(index), uuid, name]
                recommended.add_metric(series, 1.0 if uuid in chosen else 0.0)
                if uuid in rec.scores:
                    score.add_metric(series, rec.scores[uuid])
            devices.add_metric([name], float(len(rec.chosen)))
        return [recommended, score, devices]


def _make(settings: RecommendConfig, context: Context) -> RecommendAction:
    return RecommendAction(settings, context.findings, locked=context.reserved)


ACTION = ActionType("recommend", 10.0, RecommendConfig, parse_recommend, _make)
