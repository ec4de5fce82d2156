"""Recommendation policies from YAML (``actions.recommend.policies``) and overrides given as
strings (HTTP query parameters, launcher flags), through the one validator family."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from exporter.config.validate import boolean, celsius, non_negative, ratio, size, switch, whole
from exporter.config.yamlconf import Section
from exporter.core.selection import (
    MAX_COUNT,
    MAX_WINDOW,
    STRATEGIES,
    UNHEALTHY_LEVELS,
    Policy,
    Weights,
    with_default,
)
from exporter.core.units import parse_size

_WEIGHTS, _DEFAULT = Weights(), Policy("")  # the defaults live on the dataclasses


def _strategy(raw: Any) -> str:
    if raw not in STRATEGIES:
        raise ValueError(f"must be one of {', '.join(STRATEGIES)}; got {raw!r}")
    return str(raw)


def unhealthy(raw: Any) -> str:
    """``exclude_unhealthy``: true (critical GPUs), ``warning`` (warning ones too) or false."""
    if isinstance(raw, bool):
        return "critical" if raw else "off"
    text = str(raw).strip().lower()
    if text in UNHEALTHY_LEVELS:
        return text
    try:
        return "critical" if switch(text) else "off"
    except ValueError:
        raise ValueError(
            f"expected true (leave out critical GPUs), warning (warning ones too) or false, "
            f"got {raw!r}"
        ) from None


def _parse_weights(policy: Section) -> Weights:
    section = policy.section("weights")
    weights = Weights(
        free_memory=section.get("free_memory", non_negative, _WEIGHTS.free_memory),
        idle=section.get("idle", non_negative, _WEIGHTS.idle),
        temperature_headroom=section.get(
            "temperature_headroom", non_negative, _WEIGHTS.temperature_headroom
        ),
        sm_active=section.get("sm_active", non_negative, _WEIGHTS.sm_active),
    )
    section.done()
    if weights.total <= 0:
        raise policy.error("weights", "at least one weight must be more than 0")
    return weights


def _parse_policy(name: str, section: Section) -> Policy:
    policy = Policy(
        name=name,
        strategy=section.get("strategy", _strategy, _DEFAULT.strategy),
        count=section.get("count", whole(1, MAX_COUNT), 1),
        min_free_memory=section.get("min_free_memory", size, None),
        max_utilization=section.get("max_utilization", ratio, None),
        max_temperature=section.get("max_temperature", celsius, None),
        exclude_hotspots=section.get("exclude_hotspots", boolean, True),
        exclusive=section.get("exclusive", boolean, False),
        exclude_zombies=section.get("exclude_zombies", boolean, True),
        exclude_unhealthy=section.get("exclude_unhealthy", unhealthy, _DEFAULT.exclude_unhealthy),
        window=section.get("window", whole(1, MAX_WINDOW), 1),
        weights=_parse_weights(section),
        mig=section.get("mig", boolean, False),
    )
    section.done()
    return policy


def parse_policies(section: Section) -> dict[str, Policy]:
    """The policies of a ``policies:`` mapping by name; every key is validated."""
    out: dict[str, Policy] = {}
    for name, value in section.data.items():
        if not isinstance(name, str) or not name.strip():
            raise section.error(name, "a policy name must be a non-empty string")
        if not isinstance(value, dict):
            raise section.error(
                name, f"a policy must be a mapping of settings, got {type(value).__name__}"
            )
        out[name] = _parse_policy(name, section.section(name))
    return out


def recommend_policies(actions: Section) -> Mapping[str, Policy]:
    """The ``actions:`` parser of the launcher: the policies of ``actions.recommend`` (with
    ``default``), the only part of ``actions:`` it reads; the rest is the agent's to check."""
    return with_default(parse_policies(actions.section("recommend").section("policies")))


# -- overrides from a request ' + '-'*70 + '

_PARAMS: Mapping[str, Callable[[str], Any]] = MappingProxyType(
    {
        "count": whole(1, MAX_COUNT),
        "min_free_memory": parse_size,
        "max_utilization": ratio,
        "max_temperature": celsius,
        "strategy": _strategy,
        "exclusive": switch,
        "exclude_zombies": switch,
        "exclude_unhealthy": unhealthy,
        "mig": switch,
    }
)


def policy_with(policy: Policy, params: Mapping[str, str]) -> Policy:
    """``policy`` with overrides given as strings (HTTP query, CLI flags).

    Known parameters: count, min_free_memory (a size like ``8GiB``), max_utilization (0-1),
    max_temperature (celsius), strategy, exclusive, exclude_zombies and mig (true or false),
    exclude_unhealthy (true, warning or false). Raises ValueError naming the
    parameter for a bad value or an unknown parameter.
    """
    changes: dict[str, Any] = {}
    for key, raw in params.items():
        parse = _PARAMS.get(key)
        if parse is None:
            known = ", ".join(sorted(_PARAMS))
            raise ValueError(f"unknown parameter {key!r} (known: {known})")
        if not isinstance(raw, str):
            raise ValueError(f"{key}: expected a string, got {raw!r}")
        try:
            changes[key] = parse(raw)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    return replace(policy, **changes)
