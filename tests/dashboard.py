"""Read the Grafana dashboard (grafana/gpu-exporter.json): its panels and their PromQL queries.

``dashboard_queries`` gives every query with the dashboard's variables replaced, ready to be sent
to a real Prometheus: ``$instance`` and ``$gpu`` match everything, and the interval variables are
one minute.

``HEALTH_GPU`` is a simulated GPU with every health signal the Health row shows (XIDs, memory
repair, a recovery action, PCIe and NVLink traffic and errors, a narrow PCIe link, a link down,
throttling, the media engines): an item of a scenario's ``gpus:`` list, for any test that needs
the row's queries to return data. ``HEALTH_SCENARIO`` is a healthy GPU 0 and that GPU as GPU 1.
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


#: Its values (base units, docs/simulate.md) and rates (per second, from ten-minute ramps) are
#: what the Health row's checks in tests/test_dashboard.py expect.
HEALTH_GPU = """
  # every health signal of the dashboard's Health row (tests/dashboard.py)
  - name: NVIDIA H100 80GB HBM3
    ecc: {uncorrected: {from: 0, to: 600, over: 10m}}  # 1/s
    fields:
      pcie_transmit_bytes: {from: 0, to: 6.0e+11, over: 10m}  # 1 GB/s
      pcie_receive_bytes: {from: 0, to: 3.0e+11, over: 10m}  # 0.5 GB/s
      pcie_replays: {from: 0, to: 600, over: 10m}  # 1/s
      pcie_errors_correctable: {from: 0, to: 1200, over: 10m}  # 2/s
      pcie_link_width: 8  # of 16
      remapped_rows_correctable: 3
      remapped_rows_uncorrectable: 1
      row_remap_pending: 1
      ecc_aggregate_uncorrected: 7
      recovery_action: 1  # GPU reset
      clock_event_seconds_sw_power_cap: {from: 0, to: 150, over: 10m}  # 25 % of the time
      encoder_utilization: 0.4
      decoder_utilization: 0.2
    nvlink:
      links: 4
      down: [{link: 3}]
      per_link:
        0:
          nvlink_transmit_bytes: {from: 0, to: 1.2e+12, over: 10m}  # 2 GB/s
          nvlink_errors_replay: {from: 0, to: 300, over: 10m}  # 0.5/s
    xids:
      - {at: 2s, code: 13}
      - {at: 2500ms, code: 13}
      - {at: 3s, code: 48}
"""
HEALTH_SCENARIO = "gpus:\n  - name: NVIDIA H100 80GB HBM3\n" + HEALTH_GPU


def load(path: str | Path = DASHBOARD) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels a collapsed row holds."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def rows(dashboard: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The panels of each row, by the row's title."""
    out: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        if panel["type"] == "row":
            current = out.setdefault(panel["title"], [])
            current.extend(panel.get("panels", []))  # a collapsed row holds its panels
        else:
            current.append(panel)
    return out


def substitute(expr: str, interval: str = "1m") -> str:
    """``expr`` with the dashboard's variables replaced by values any Prometheus accepts (the
    interval ones by ``interval``)."""
    expr = _MATCH_ALL.sub(".*", expr)
    return _INTERVAL.sub(interval, expr)


def dashboard_queries(path: str | Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every target of every panel, variables replaced."""
    out = []
    for panel in iter_panels(load(path)):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel.get("title", ""), substitute(target["expr"])))
    return out
