"""Read the Grafana dashboard (grafana/gpu-exporter.json): its panels and their PromQL queries.

``dashboard_queries`` gives every query with the dashboard's variables replaced, ready to be sent
to a real Prometheus: ``$instance`` and ``$gpu`` match everything, and the interval variables are
one minute.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana" / "gpu-exporter.json"

#: Query variables: ``$name``, ``${name}`` or ``${name:format}``, here always inside =~"...".
_MATCH_ALL = re.compile(r"\$(?:\{(?:instance|gpu)(?::\w+)?\}|(?:instance|gpu)\b)")
#: Grafana's interval variables, ``$__rate_interval`` or ``${__rate_interval}`` and the like.
_INTERVAL = re.compile(r"\$(?:\{__(?:rate_)?interval\}|__(?:rate_)?interval\b)")


def load(path: str | Path = DASHBOARD) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels a collapsed row holds."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def substitute(expr: str) -> str:
    """``expr`` with the dashboard's variables replaced by values any Prometheus accepts."""
    expr = _MATCH_ALL.sub(".*", expr)
    return _INTERVAL.sub("1m", expr)


def dashboard_queries(path: str | Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every target of every panel, variables replaced."""
    out = []
    for panel in iter_panels(load(path)):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel.get("title", ""), substitute(target["expr"])))
    return out
