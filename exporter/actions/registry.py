"""The registry of actions: each action module declares an ``ActionType`` (name, default
schedule, settings, parser, factory; see ``base``), and the engine builds, configures and
schedules whatever is listed here. Adding an action touches its own module and ``ACTIONS``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exporter.actions.base import ActionType
from exporter.actions.health import ACTION as HEALTH
from exporter.actions.reaper.action import ACTION as REAPER
from exporter.actions.recommend import ACTION as RECOMMEND
from exporter.actions.thermal import ACTION as THERMAL
from exporter.actions.waste import ACTION as WASTE

#: Every action, in the order they are configured and listed.
ACTIONS: tuple[ActionType[Any], ...] = (REAPER, THERMAL, HEALTH, RECOMMEND, WASTE)
BY_NAME: Mapping[str, ActionType[Any]] = {action.name: action for action in ACTIONS}
