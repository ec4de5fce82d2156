#!/usr/bin/env python3
"""Write grafana/gpu-exporter.json, the Grafana dashboard of gpu-exporter.

The JSON is generated: edit this file, run ``python grafana/generate.py``, and commit both.
Standard library only. ``--output PATH`` writes somewhere else (the tests compare the two).

Layout: ``ROWS`` below declares every row and panel, in order, with a fixed id each (rows are
100, 200, ...; their panels 101, 102, ...), so that links to a panel survive edits. The ids are
not positions: a new row takes the next free hundred wherever it goes (Health, 500, comes before
Agent health, 400; True utilization, 600, follows Fleet overview). Panels flow left to right in
a 24-column grid and wrap; only width and height are given.

Every query selects ``job="gpu-exporter"`` and the ``$instance`` variable, and GPU series also the
``$gpu`` variable (``sel()``); legends name the GPU as ``{{instance}} GPU {{gpu}}``. Units are the
base units the exporter uses: bytes, celsius, watt, percentunit (0-1 ratios), s; rates of them
are binBps (bytes/s) and cps (events/s).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "gpu-exporter.json"

UID = "gpu-exporter"
TITLE = "GPU exporter"
JOB = "gpu-exporter"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GPU_LEGEND = "{{instance}} GPU {{gpu}}"
NAME_LEGEND = GPU_LEGEND + " {{name}}"  # for queries that join the name from gpu_info
GRID_WIDTH = 24

Panel = dict[str, Any]


# --- queries -------------------------------------------------------------------------------------


def sel(metric: str, extra: str = "", gpu: bool = True) -> str:
    """``metric{job, instance[, gpu][, extra]}``; ``gpu=False`` for series without a gpu label."""
    matchers = [f'job="{JOB}"', 'instance=~"$instance"']
    if gpu:
        matchers.append('gpu=~"$gpu"')
    if extra:
        matchers.append(extra)
    return f"{metric}{{{', '.join(matchers)}}}"


def with_name(expr: str) -> str:
    """``expr`` (per GPU) with the GPU's model name joined in from gpu_info."""
    return f"({expr}) * on (instance, gpu, uuid) group_left (name) {sel('gpu_info')}"


def target(
    expr: str, legend: str = "", ref: str = "A", instant: bool = False, table: bool = False
) -> dict[str, Any]:
    """One Prometheus query. ``table``: instant query in table format (one row per series)."""
    instant = instant or table
    out: dict[str, Any] = {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "format": "table" if table else "time_series",
        "instant": instant,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "refId": ref,
    }
    return out


# --- field config pieces -------------------------------------------------------------------------


def thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    """Absolute thresholds; the first step's value is None (the base color)."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


GREEN = thresholds((None, "green"))


def mapping(*values: tuple[int, str, str]) -> list[dict[str, Any]]:
    """Value mappings: (value, text, color)."""
    options = {str(v): {"color": c, "index": i, "text": t} for i, (v, t, c) in enumerate(values)}
    return [{"options": options, "type": "value"}]


def dashed(ref: str) -> dict[str, Any]:
    """Override: the series of query ``ref`` (a limit or a threshold) as a dashed line."""
    return {
        "matcher": {"id": "byFrameRefID", "options": ref},
        "properties": [
            {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
            {"id": "custom.fillOpacity", "value": 0},
            {"id": "custom.lineWidth", "value": 1},
        ],
    }


def organize(order: list[str], hide: list[str], rename: dict[str, str]) -> dict[str, Any]:
    """Table transformation: column order, hidden columns and new names."""
    return {
        "id": "organize",
        "options": {
            "excludeByName": {name: True for name in hide},
            "indexByName": {name: i for i, name in enumerate(order)},
            "renameByName": rename,
        },
    }


# --- panel kinds ---------------------------------------------------------------------------------


def panel(
    kind: str,
    pid: int,
    title: str,
    targets: list[dict[str, Any]],
    w: int,
    h: int,
    description: str,
    defaults: dict[str, Any],
    options: dict[str, Any],
    overrides: list[dict[str, Any]] | None = None,
) -> Panel:
    return {
        "datasource": DATASOURCE,
        "description": description,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "gridPos": {"h": h, "w": w, "x": 0, "y": 0},
        "id": pid,
        "options": options,
        "targets": targets,
        "title": title,
        "type": kind,
    }


LEGEND = {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True}
REDUCE_LAST = {"calcs": ["lastNotNull"], "fields": "", "values": False}


def timeseries(
    pid: int,
    title: str,
    targets: list[dict[str, Any]],
    unit: str,
    description: str,
    w: int = 12,
    h: int = 8,
    overrides: list[dict[str, Any]] | None = None,
    bars: bool = False,
    stack: bool = False,
    min_value: float | None = None,
    log_scale: bool = False,
) -> Panel:
    """``log_scale``: a log10 y axis, for a value next to a limit orders of magnitude higher."""
    custom: dict[str, Any] = {
        "axisSoftMin": 0,
        "drawStyle": "bars" if bars else "line",
        "fillOpacity": 30 if stack or bars else 10,
        "lineWidth": 1,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stack else "none"},
    }
    if log_scale:
        del custom["axisSoftMin"]  # 0 has no place on a log axis
        custom["scaleDistribution"] = {"type": "log", "log": 10}
    defaults: dict[str, Any] = {
        "color": {"mode": "palette-classic"},
        "custom": custom,
        "thresholds": GREEN,
        "unit": unit,
    }
    if min_value is not None:
        defaults["min"] = min_value
    options = {"legend": LEGEND, "tooltip": {"mode": "multi", "sort": "desc"}}
    return panel("timeseries", pid, title, targets, w, h, description, defaults, options, overrides)


def stat(
    pid: int,
    title: str,
    expr: str,
    unit: str,
    description: str,
    steps: dict[str, Any] = GREEN,
    w: int = 4,
    h: int = 4,
    sparkline: bool = True,
) -> Panel:
    defaults = {"color": {"mode": "thresholds"}, "thresholds": steps, "unit": unit}
    options = {
        "colorMode": "value",
        "graphMode": "area" if sparkline else "none",
        "justifyMode": "auto",
        "orientation": "auto",
        "reduceOptions": REDUCE_LAST,
        "showPercentChange": False,
        "textMode": "auto",
        "wideLayout": True,
    }
    return panel("stat", pid, title, [target(expr)], w, h, description, defaults, options)


def bargauge(
    pid: int,
    title: str,
    expr: str,
    legend: str,
    unit: str,
    description: str,
    steps: dict[str, Any] = GREEN,
    w: int = 8,
    h: int = 8,
    min_value: float | None = None,
    max_value: float | None = None,
) -> Panel:
    defaults: dict[str, Any] = {"color": {"mode": "thresholds"}, "thresholds": steps, "unit": unit}
    if min_value is not None:
        defaults["min"] = min_value
    if max_value is not None:
        defaults["max"] = max_value
    options = {
        "displayMode": "gradient",
        "maxVizHeight": 300,
        "minVizHeight": 16,
        "minVizWidth": 8,
        "namePlacement": "auto",
        "orientation": "horizontal",
        "reduceOptions": REDUCE_LAST,
        "showUnfilled": True,
        "sizing": "auto",
        "valueMode": "color",
    }
    targets = [target(expr, legend, instant=True)]
    return panel("bargauge", pid, title, targets, w, h, description, defaults, options)


def table(
    pid: int,
    title: str,
    expr: str | list[str],
    columns: list[str],
    description: str,
    hide: list[str],
    rename: dict[str, str] | None = None,
    unit: str = "none",
    sort_by: str | None = None,
    w: int = 24,
    h: int = 8,
    units: dict[str, str] | None = None,
    mappings: dict[str, list[dict[str, Any]]] | None = None,
) -> Panel:
    """An instant query in table format: one row per series, its labels as columns.

    Several queries (``expr`` a list; refs A, B, ...) are merged into one row per label set,
    their values in the columns ``Value #A``, ``Value #B``, ...; ``units`` gives a column (by its
    name after ``rename``) a unit of its own, ``mappings`` value mappings (``mapping()``) shown as
    colored text.
    """
    exprs = [expr] if isinstance(expr, str) else expr
    defaults = {
        "color": {"mode": "thresholds"},
        "custom": {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False},
        "thresholds": GREEN,
        "unit": unit,
    }
    options: dict[str, Any] = {
        "cellHeight": "sm",
        "footer": {"countRows": False, "fields": "", "reducer": ["sum"], "show": False},
        "showHeader": True,
    }
    if sort_by:
        options["sortBy"] = [{"desc": True, "displayName": sort_by}]
    targets = [target(e, ref=chr(ord("A") + i), table=True) for i, e in enumerate(exprs)]
    overrides = [
        {"matcher": {"id": "byName", "options": name}, "properties": [{"id": "unit", "value": u}]}
        for name, u in (units or {}).items()
    ]
    overrides += [
        {
            "matcher": {"id": "byName", "options": name},
            "properties": [
                {"id": "mappings", "value": states},
                {"id": "custom.cellOptions", "value": {"type": "color-text"}},
            ],
        }
        for name, states in (mappings or {}).items()
    ]
    out = panel("table", pid, title, targets, w, h, description, defaults, options, overrides)
    # Prometheus' table format already makes each label a column; organize orders and names them.
    always_hidden = ["Time", "__name__", "job"]
    merge = [{"id": "merge", "options": {}}] if len(exprs) > 1 else []
    out["transformations"] = [*merge, organize(columns, always_hidden + hide, rename or {})]
    return out


def heatmap(
    pid: int, title: str, expr: str, unit: str, description: str, w: int = 24, h: int = 9
) -> Panel:
    """One row per series (here per GPU) over time, colored by value; nothing is bucketed."""
    defaults = {
        "custom": {
            "hideFrom": {"legend": False, "tooltip": False, "viz": False},
            "scaleDistribution": {"type": "linear"},
        }
    }
    options = {
        "calculate": False,
        "cellGap": 1,
        "cellValues": {"unit": unit},
        "color": {
            "exponent": 0.5,
            "fill": "dark-orange",
            "max": 1,
            "min": 0,
            "mode": "scheme",
            "reverse": False,
            "scale": "linear",
            "scheme": "Oranges",
            "steps": 64,
        },
        "exemplars": {"color": "rgba(255,0,255,0.7)"},
        "filterValues": {"le": -1e-9},  # show idle (0) cells too
        "legend": {"show": True},
        "rowsFrame": {"layout": "auto"},
        "tooltip": {"mode": "single", "showColorScale": False, "yHistogram": False},
        "yAxis": {"axisPlacement": "left", "reverse": True},
    }
    targets = [target(expr, GPU_LEGEND)]
    out = panel("heatmap", pid, title, targets, w, h, description, defaults, options)
    out["maxDataPoints"] = 200
    return out


def state_timeline(
    pid: int,
    title: str,
    expr: str,
    legend: str,
    states: list[dict[str, Any]],
    description: str,
    w: int = 12,
    h: int = 8,
    show_value: str = "never",
) -> Panel:
    """Each series a lane of states; ``states`` maps values to names and colors.

    ``show_value="always"`` writes each state's name in its lane, so that color is not the only
    cue (Grafana's showValue: never, auto, always).
    """
    defaults = {
        "color": {"mode": "thresholds"},
        "custom": {
            "fillOpacity": 70,
            "hideFrom": {"legend": False, "tooltip": False, "viz": False},
            "lineWidth": 0,
        },
        "mappings": states,
        "thresholds": GREEN,
    }
    options = {
        "alignValue": "left",
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False},
        "mergeValues": True,
        "rowHeight": 0.9,
        "showValue": show_value,
        "tooltip": {"mode": "single", "sort": "none"},
    }
    targets = [target(expr, legend)]
    return panel("state-timeline", pid, title, targets, w, h, description, defaults, options)


# --- the dashboard -------------------------------------------------------------------------------

THERMAL_AND_POWER_REASONS = (
    "sw_power_cap|hw_slowdown|sw_thermal_slowdown|hw_thermal_slowdown|hw_power_brake_slowdown"
)
SLOWDOWN = 'threshold="slowdown"'
LAST_SUCCESS = sel("gpu_exporter_action_last_success_timestamp_seconds", gpu=False)
OFF_ON = mapping((0, "no", "transparent"), (1, "active", "red"))
HTTP_ERRORS = sel("gpu_exporter_http_requests_total", 'code=~"[45].."', gpu=False)
PROCESS_COLUMNS = ["instance", "gpu", "uuid", "pid", "user", "process", "type"]

# --- the Health row: XIDs, memory repair, PCIe, NVLink, clock limits, media engines -------------

GPU_KEY = "instance, gpu, uuid"
XIDS = sel("gpu_xid_errors_total")
#: gpu_recovery_action's values (NVML's nvmlDeviceGpuRecoveryAction_t; 5-7 are NVML 13's).
RECOVERY_ACTIONS = mapping(
    (0, "none", "green"),
    (1, "GPU reset", "orange"),
    (2, "node reboot", "red"),
    (3, "drain P2P", "orange"),
    (4, "drain and reset", "red"),
    (5, "recover IMEX domain", "orange"),
    (6, "bus reset", "orange"),
    (7, "system reboot", "red"),
)
NO_YES = mapping((0, "no", "green"), (1, "yes", "red"))
NO_PENDING = mapping((0, "no", "green"), (1, "pending", "orange"))
#: 1 while a repair waits for a GPU reset (or, for retired pages, a driver reload).
REPAIR_PENDING = (
    "gpu_row_remap_pending",
    "gpu_bank_remap_pending",
    "gpu_retired_pages_pending",
    "gpu_repair_pending",
)
#: 1 when the memory cannot be repaired any more: the board is to be replaced.
REPAIR_FAILED = ("gpu_row_remap_failed", "gpu_memory_unrepairable")
#: gpu_health and gpu_health_check: the health action's verdict per GPU and per check.
VERDICT = mapping((0, "ok", "green"), (1, "warning", "orange"), (2, "critical", "red"))
#: The health action's checks that are not ok now, one series per GPU and check.
FAILING_CHECKS = f"{sel('gpu_health_check')} > 0"


def xids_in(window: str) -> str:
    """XIDs per GPU, code and resolution in the ``window`` up to now.

    A code's series starts at 1 with its first XID, and increase() sees nothing before a
    series' first sample: a series that did not exist ``window`` ago counts whole (as the alert
    rules do).
    """
    return (
        f"sum by ({GPU_KEY}, xid, resolution) "
        f"(({XIDS} unless {XIDS} offset {window}) or increase({XIDS}[{window}]))"
    )


def gpus_with(metrics: tuple[str, ...]) -> str:
    """How many GPUs have any of ``metrics`` at 1 (0 when none)."""
    flags = " or ".join(f"{sel(m)} == 1" for m in metrics)
    return f"count(max by ({GPU_KEY}) ({flags})) or vector(0)"


def per_gpu(metric: str, extra: str = "") -> str:
    """``metric`` with only the GPU's labels (instance, gpu, uuid), for tables that merge."""
    return f"max by ({GPU_KEY}) ({sel(metric, extra)})"


def per_second(metric: str, extra: str = "") -> str:
    """rate() of the counter ``metric``: per second."""
    return f"rate({sel(metric, extra)}[$__rate_interval])"


#: Memory repair per GPU: (column, query, value mappings or None).
MEMORY_REPAIR_COLUMNS: list[tuple[str, str, list[dict[str, Any]] | None]] = [
    ("remapped rows (correctable)", per_gpu("gpu_remapped_rows", 'cause="correctable"'), None),
    (
        "remapped rows (uncorrectable)",
        per_gpu("gpu_remapped_rows", 'cause="uncorrectable"'),
        None,
    ),
    ("row remap pending", per_gpu("gpu_row_remap_pending"), NO_PENDING),
    ("row remap failed", per_gpu("gpu_row_remap_failed"), NO_YES),
    ("retired pages (single bit)", per_gpu("gpu_retired_pages", 'cause="single_bit"'), None),
    ("retired pages (double bit)", per_gpu("gpu_retired_pages", 'cause="double_bit"'), None),
    ("retirement pending", per_gpu("gpu_retired_pages_pending"), NO_PENDING),
    ("bank remap pending", per_gpu("gpu_bank_remap_pending"), NO_PENDING),
    ("channel/TPC repair pending", per_gpu("gpu_repair_pending"), NO_PENDING),
    ("unrepairable", per_gpu("gpu_memory_unrepairable"), NO_YES),
    (
        "uncorrected ECC (lifetime)",
        per_gpu("gpu_ecc_errors_aggregate_total", 'type="uncorrected"'),
        None,
    ),
    ("recovery action", per_gpu("gpu_recovery_action"), RECOVERY_ACTIONS),
]
_MEMORY_VALUES = [f"Value #{chr(ord('A') + i)}" for i in range(len(MEMORY_REPAIR_COLUMNS))]

HEALTH: list[Panel] = [
    stat(
        501,
        "XIDs (24h)",
        f"round(sum({xids_in('1d')})) or vector(0)",
        "none",
        "XID errors the driver reported on the selected GPUs in the last 24 hours, every "
        "resolution (ignore too). XIDs from before the agent started are not seen: dmesg has "
        "them.",
        steps=thresholds((None, "green"), (1, "orange")),
        sparkline=False,
    ),
    stat(
        502,
        "GPUs without XID events",
        f"count({sel('gpu_xid_events_supported')} == 0) or vector(0)",
        "none",
        "GPUs whose driver does not deliver XID events (gpu_xid_events_supported == 0): their "
        "XIDs are not counted here.",
        steps=thresholds((None, "green"), (1, "orange")),
        sparkline=False,
    ),
    stat(
        503,
        "GPUs with a repair pending",
        gpus_with(REPAIR_PENDING),
        "none",
        "GPUs with a row remapping, bank remapping or channel/TPC repair waiting for a GPU "
        "reset, or a page retirement waiting for a driver reload.",
        steps=thresholds((None, "green"), (1, "orange")),
        sparkline=False,
    ),
    stat(
        504,
        "GPUs with failed memory repair",
        gpus_with(REPAIR_FAILED),
        "none",
        "GPUs whose row remapping failed or whose memory the driver marks unrepairable: "
        "the board is to be replaced.",
        steps=thresholds((None, "green"), (1, "red")),
        sparkline=False,
    ),
    stat(
        505,
        "GPUs needing recovery",
        f"count({sel('gpu_recovery_action')} > 0) or vector(0)",
        "none",
        "GPUs for which the driver asks for a recovery action (gpu_recovery_action > 0): "
        "a GPU reset, a node reboot, draining peer-to-peer traffic. See Recovery action.",
        steps=thresholds((None, "green"), (1, "red")),
        sparkline=False,
    ),
    stat(
        506,
        "NVLink links down",
        f"count({sel('gpu_nvlink_up')} == 0) or vector(0)",
        "none",
        "NVLink links of the selected GPUs that are not active (gpu_nvlink_up == 0).",
        steps=thresholds((None, "green"), (1, "red")),
        sparkline=False,
    ),
    timeseries(
        507,
        "XID errors by code",
        [
            target(
                xids_in("$__rate_interval"),
                GPU_LEGEND + " XID {{xid}} {{resolution}}",
            ),
        ],
        "none",
        "XIDs per GPU, code and resolution (what NVIDIA's catalog says to do: restart_app, "
        "reset_gpu, reboot, check_workflow, ignore, unknown). The first XID of a code since "
        "the agent started counts too. No data: no XID since the agent started.",
        bars=True,
        stack=True,
        min_value=0,
    ),
    table(
        508,
        "XID errors in the last 24 hours",
        f"round({xids_in('1d')}) > 0",
        ["instance", "gpu", "uuid", "xid", "resolution", "Value"],
        "XIDs of the last 24 hours by GPU, code and resolution, most first. The catalog's "
        "mnemonic of each is in the agent's log and in /snapshot.",
        hide=[],
        rename={"Value": "XIDs"},
        sort_by="XIDs",
        w=12,
    ),
    table(
        509,
        "Memory repair per GPU",
        [query for _, query, _ in MEMORY_REPAIR_COLUMNS],
        ["instance", "gpu", "uuid", *_MEMORY_VALUES],
        "Memory repair state of every selected GPU, now. Ampere and newer remap rows, older "
        "GPUs retire pages, so one of the two is empty; bank and channel/TPC repairs and "
        "unrepairable need NVML 13. pending: a GPU reset (for retired pages a driver reload) "
        "applies it.",
        hide=[],
        rename=dict(zip(_MEMORY_VALUES, [c for c, _, _ in MEMORY_REPAIR_COLUMNS], strict=True)),
        sort_by="recovery action",
        mappings={c: m for c, _, m in MEMORY_REPAIR_COLUMNS if m is not None},
    ),
    timeseries(
        510,
        "Remapped rows and retired pages",
        [
            target(sel("gpu_remapped_rows"), GPU_LEGEND + " remapped rows {{cause}}"),
            target(sel("gpu_retired_pages"), GPU_LEGEND + " retired pages {{cause}}", ref="B"),
        ],
        "none",
        "Memory rows remapped (Ampere and newer) and pages retired (older GPUs), by the kind "
        "of error behind them. A few correctable ones are normal; uncorrectable ones mean "
        "lost data.",
        w=8,
        min_value=0,
    ),
    timeseries(
        511,
        "ECC errors",
        [
            target(
                f"increase({sel('gpu_ecc_errors_total')}[$__rate_interval])",
                GPU_LEGEND + " {{type}}",
            ),
        ],
        "none",
        "ECC errors (volatile counters, since the driver was loaded) where ECC is on.",
        w=8,
        bars=True,
        min_value=0,
    ),
    state_timeline(
        512,
        "Recovery action",
        sel("gpu_recovery_action"),
        GPU_LEGEND,
        RECOVERY_ACTIONS,
        "What the driver says each GPU needs: none, a GPU reset, a node reboot, draining "
        "peer-to-peer (NVLink) traffic, or draining and a reset (NVML 13 adds IMEX domain "
        "recovery, bus reset, system reboot).",
        w=8,
    ),
    timeseries(
        513,
        "PCIe traffic",
        [
            target(per_second("gpu_pcie_transmit_bytes_total"), GPU_LEGEND + " transmit"),
            target(per_second("gpu_pcie_receive_bytes_total"), GPU_LEGEND + " receive", ref="B"),
        ],
        "binBps",
        "Bytes per second each GPU sends and receives over PCIe.",
        min_value=0,
    ),
    timeseries(
        514,
        "PCIe errors per second",
        [
            target(per_second("gpu_pcie_replay_errors_total"), GPU_LEGEND + " replays"),
            target(per_second("gpu_pcie_errors_total"), GPU_LEGEND + " {{type}}", ref="B"),
        ],
        "cps",
        "PCIe replays (packets sent again after a link error) and PCIe errors by type, per "
        "second. Steady replays or correctable errors point at a riser, a cable or a slot.",
        min_value=0,
    ),
    timeseries(
        515,
        "PCIe link generation vs max",
        [
            target(sel("gpu_pcie_link_generation"), GPU_LEGEND),
            target(sel("gpu_pcie_link_generation_max"), f"{GPU_LEGEND} max", ref="B"),
        ],
        "none",
        "PCIe generation each link runs at; the dashed lines are the highest the GPU and its "
        "slot support. It drops at idle to save power: below the max under load is the sign.",
        overrides=[dashed("B")],
        min_value=0,
    ),
    timeseries(
        516,
        "PCIe link width vs max",
        [
            target(sel("gpu_pcie_link_width"), GPU_LEGEND),
            target(sel("gpu_pcie_link_width_max"), f"{GPU_LEGEND} max", ref="B"),
        ],
        "none",
        "PCIe lanes each link runs with; the dashed lines are the most the GPU and its slot "
        "support. A link narrower than its max has a lane problem (seating, riser, slot).",
        overrides=[dashed("B")],
        min_value=0,
    ),
    timeseries(
        517,
        "NVLink traffic per link",
        [
            target(
                per_second("gpu_nvlink_transmit_bytes_total"),
                GPU_LEGEND + " link {{link}} transmit",
            ),
            target(
                per_second("gpu_nvlink_receive_bytes_total"),
                GPU_LEGEND + " link {{link}} receive",
                ref="B",
            ),
        ],
        "binBps",
        "Data bytes per second each NVLink link sends and receives. GPUs without NVLink have "
        "no series.",
        min_value=0,
    ),
    timeseries(
        518,
        "NVLink errors per link and type",
        [
            target(
                per_second("gpu_nvlink_errors_total"),
                GPU_LEGEND + " link {{link}} {{type}}",
            ),
        ],
        "cps",
        "NVLink errors per second by link and type: flit and data CRC errors, replays, recoveries.",
        min_value=0,
    ),
    timeseries(
        519,
        "NVLink links down per GPU",
        [
            target(f"sum by ({GPU_KEY}) ({sel('gpu_nvlink_up')} == bool 0)", GPU_LEGEND),
        ],
        "none",
        "NVLink links of each GPU that are not active; 0 when all are up.",
        min_value=0,
    ),
    table(
        520,
        "Down NVLink links",
        f"{sel('gpu_nvlink_up')} == 0",
        ["instance", "gpu", "uuid", "link"],
        "Each NVLink link that is not active now. Empty: every link is up.",
        hide=["Value"],
        w=12,
    ),
    timeseries(
        521,
        "Share of time throttled by reason",
        [
            target(per_second("gpu_clock_event_seconds_total"), GPU_LEGEND + " {{reason}}"),
        ],
        "percentunit",
        "rate() of gpu_clock_event_seconds_total: the share of time each reason held the "
        "clocks down. The reasons overlap (total_applications_clocks and total_base_clocks "
        "sum the others), so they are not stacked; low_utilization is an idle GPU.",
        min_value=0,
    ),
    timeseries(
        522,
        "Video encoder and decoder utilization",
        [
            target(sel("gpu_encoder_utilization_ratio"), GPU_LEGEND + " encoder"),
            target(sel("gpu_decoder_utilization_ratio"), GPU_LEGEND + " decoder", ref="B"),
        ],
        "percentunit",
        "Share of time the video encoder (NVENC) and decoder (NVDEC) were busy.",
        min_value=0,
    ),
    state_timeline(
        523,
        "GPU health verdict per GPU over time",
        sel("gpu_health"),
        GPU_LEGEND,
        VERDICT,
        "The health action's verdict per GPU (gpu_health): the worst of its checks, ok, warning "
        "or critical. Which checks: the Failing health checks panels, or gpu-exporter health "
        "--from http://HOST:9402 on the host. No data: the health action is disabled.",
        show_value="always",
    ),
    state_timeline(
        524,
        "Failing health checks over time",
        FAILING_CHECKS,
        GPU_LEGEND + " {{check}}",
        VERDICT,
        "Each check of the health action (gpu_health_check) while it is at warning or critical, "
        "one lane per GPU and check: lost, xid, memory_repair, ecc, recovery_action, pcie, "
        "nvlink, thermal, clocks. Empty: every check of every selected GPU was ok.",
        show_value="always",
    ),
    table(
        525,
        "Failing health checks now",
        FAILING_CHECKS,
        ["instance", "gpu", "uuid", "check", "Value"],
        "The checks at warning or critical now, critical first. The reason of each (which XID, "
        "which repair, which link) is in gpu-exporter health --from http://HOST:9402 and the "
        "agent's /health/gpus. Empty: every check is ok.",
        hide=[],
        rename={"Value": "level"},
        sort_by="level",
        mappings={"level": VERDICT},
        h=6,
    ),
]

# --- the Waste row: idle GPUs and whose they are, memory held by nothing, leak suspects ---------

#: A process's labels, one series per process (a PID listed as compute and graphics is one).
PROCESS_KEY = "instance, gpu, uuid, pid, user, process"
#: The waste rules' idle GPU-seconds of the last 24 hours (rules/README.md#waste), per host and
#: owner: the queries sum them over the selected hosts.
IDLE_24H = "gpu_idle_seconds:sum24h"


def idle_hours(level: str, owner: str) -> str:
    """Idle GPU-hours of the last 24 hours by ``owner``, from the rule at ``level``, most first."""
    rule = sel(f"{level}:{IDLE_24H}", gpu=False)
    return f"sort_desc(sum by ({owner}) ({rule}) / 3600)"


def per_process(metric: str) -> str:
    """``metric`` with only the process's labels, for tables that merge."""
    return f"max by ({PROCESS_KEY}) ({sel(metric)})"


def memory_of(metric: str) -> str:
    """The GPU memory of the processes that have ``metric``, with only the process's labels."""
    return f"{per_process('gpu_process_memory_used_bytes')} and on ({PROCESS_KEY}) {sel(metric)}"


_IDLE_HOURS_NOTE = (
    " An idle GPU is counted by the minute, at or below 5 % activity (GPM's SM activity where "
    "the GPU has it, else its utilization); a GPU shared by several owners counts for each. "
    "Needs the rules of rules/gpu-exporter.rules.yml (group gpu-exporter.waste)."
)

WASTE: list[Panel] = [
    stat(
        701,
        "Idle GPUs now",
        f"sum({sel('instance_gpu:gpu_idle:bool')}) or vector(0)",
        "none",
        "GPUs at or below 5 % activity now, allocated or not (the waste rules' "
        "instance_gpu:gpu_idle:bool).",
        w=6,
    ),
    stat(
        702,
        "Allocated GPUs idle",
        f"count({sel('gpu_allocated_idle')} == 1) or vector(0)",
        "none",
        "GPUs allocated to a pod or a Slurm job that have been idle for the waste action's `for` "
        "(30 minutes by default). GpuAllocatedIdle alerts 30 minutes later.",
        steps=thresholds((None, "green"), (1, "orange")),
        w=6,
    ),
    stat(
        703,
        "Idle memory holders",
        f"sum({sel('gpu_idle_holders')}) or vector(0)",
        "none",
        "Processes holding at least the waste action's min_memory (1 GiB) that have been idle "
        "for its `for`.",
        steps=thresholds((None, "green"), (1, "orange")),
        w=6,
    ),
    stat(
        704,
        "Leak suspects",
        f"sum({sel('gpu_leak_suspects')}) or vector(0)",
        "none",
        "Processes whose GPU memory grew at each of the waste action's last leak.samples samples.",
        steps=thresholds((None, "green"), (1, "orange")),
        w=6,
    ),
    table(
        705,
        "Idle GPU-hours by namespace (24h)",
        idle_hours("instance_namespace", "namespace"),
        ["namespace", "Value"],
        "GPU-hours the whole GPUs allocated to each Kubernetes namespace were idle in the last "
        "24 hours, on the selected hosts." + _IDLE_HOURS_NOTE,
        hide=[],
        rename={"Value": "idle GPU-hours"},
        sort_by="idle GPU-hours",
        w=8,
    ),
    table(
        706,
        "Idle GPU-hours by Slurm job (24h)",
        idle_hours("instance_slurm_job", "slurm_job"),
        ["slurm_job", "Value"],
        "GPU-hours the GPUs allocated to each Slurm job were idle in the last 24 hours, on the "
        "selected hosts." + _IDLE_HOURS_NOTE,
        hide=[],
        rename={"slurm_job": "Slurm job", "Value": "idle GPU-hours"},
        sort_by="idle GPU-hours",
        w=8,
    ),
    table(
        707,
        "Idle GPU-hours by user (24h)",
        idle_hours("instance_user", "user"),
        ["user", "Value"],
        "GPU-hours each user held idle GPUs in the last 24 hours: a GPU counts for a user while "
        "a process of theirs holds at least 1 GiB on it (GPUs in MIG mode and processes whose "
        "user the agent cannot see left out), on the selected hosts." + _IDLE_HOURS_NOTE,
        hide=[],
        rename={"Value": "idle GPU-hours"},
        sort_by="idle GPU-hours",
        w=8,
    ),
    table(
        708,
        "Allocated but idle GPUs",
        f"{sel('gpu_allocation_info')} and on ({GPU_KEY}) {sel('gpu_allocated_idle')} == 1",
        ["instance", "gpu", "uuid", "namespace", "pod", "container", "slurm_job", "mig_uuid"],
        "Every allocation (pod container or Slurm job) of a GPU that the waste action finds "
        "allocated and idle for its `for`, now. The agent's log and /snapshot say the same.",
        hide=["Value"],
        w=12,
    ),
    timeseries(
        709,
        "GPU memory held by no live process",
        [target(sel("gpu_orphaned_memory_bytes"), GPU_LEGEND)],
        "bytes",
        "Memory of PIDs NVML lists that are gone, and used memory no listed process accounts for "
        "beyond orphaned_min_memory (1 GiB). A GPU reset clears it once no job runs. No data: "
        "the agent does not see the host's PID namespace.",
        min_value=0,
    ),
    table(
        710,
        "Idle processes holding GPU memory (waste action)",
        [per_process("gpu_process_idle_seconds"), memory_of("gpu_process_idle_seconds")],
        ["instance", "gpu", "uuid", "pid", "user", "process", "Value #A", "Value #B"],
        "Processes holding at least the waste action's min_memory (1 GiB) that are idle now, and "
        "for how long so far; they are idle holders from its `for` (30 minutes) on.",
        hide=["uuid"],
        rename={"Value #A": "idle for", "Value #B": "memory"},
        unit="s",
        sort_by="idle for",
        w=12,
        units={"memory": "bytes"},
    ),
    table(
        711,
        "Leak suspects: processes whose GPU memory keeps growing",
        [
            per_process("gpu_process_memory_growth_bytes"),
            memory_of("gpu_process_memory_growth_bytes"),
        ],
        ["instance", "gpu", "uuid", "pid", "user", "process", "Value #A", "Value #B"],
        "Processes whose GPU memory grew at each of the waste action's last leak.samples samples "
        "(12 by default), by leak.min_growth (256 MiB) in all: how much over that window, and "
        "what they hold now. GpuLeakSuspect alerts after 15 minutes of it.",
        hide=["uuid"],
        rename={"Value #A": "growth", "Value #B": "memory"},
        unit="bytes",
        sort_by="growth",
        w=12,
    ),
]

# --- the True utilization row: GPM (Hopper and newer), docs/metrics.md#gpm ------------------------

#: GPUs with GPM: the others have none of its metrics.
HAS_GPM = f"on ({GPU_KEY}) {sel('gpu_gpm_supported')} == 1"
GPM_NO_YES = mapping((0, "no", "text"), (1, "yes", "green"))

# MIG devices (docs/metrics.md#mig): every series has the parent GPU's gpu and uuid, and mig_uuid.
MIG_KEY = f"{GPU_KEY}, mig_uuid"
MIG_INFO = sel("gpu_mig_info")
MIG_LEGEND = GPU_LEGEND + " {{profile}} {{mig_uuid}}"


def with_profile(expr: str) -> str:
    """``expr`` (per MIG device) with the device's profile joined in from gpu_mig_info."""
    return f"({expr}) * on ({MIG_KEY}) group_left (profile) {MIG_INFO}"


def per_mig(metric: str) -> str:
    """``metric`` of each MIG device with only its labels and profile, for tables that merge."""
    return f"max by ({MIG_KEY}, profile) ({with_profile(sel(metric))})"


#: MIG devices: (column, query, unit); the first query is the device itself, so that every MIG
#: device has a row, whatever it lacks.
MIG_COLUMNS: list[tuple[str, str, str]] = [
    ("device", f"max by ({MIG_KEY}, profile) ({MIG_INFO})", "none"),
    ("memory used", per_mig("gpu_mig_memory_used_bytes"), "bytes"),
    ("memory total", per_mig("gpu_mig_memory_total_bytes"), "bytes"),
    ("SM active", per_mig("gpu_mig_sm_active_ratio"), "percentunit"),
    ("tensor active", per_mig("gpu_mig_tensor_active_ratio"), "percentunit"),
]
_MIG_VALUES = [f"Value #{chr(ord('A') + i)}" for i in range(len(MIG_COLUMNS))]

TRUE_UTILIZATION: list[Panel] = [
    timeseries(
        601,
        "SM and tensor activity vs utilization",
        [
            target(sel("gpu_sm_active_ratio"), GPU_LEGEND + " SM active"),
            target(sel("gpu_tensor_active_ratio"), GPU_LEGEND + " tensor active", ref="B"),
            target(
                f"{sel('gpu_utilization_ratio')} and {HAS_GPM}",
                GPU_LEGEND + " utilization",
                ref="C",
            ),
        ],
        "percentunit",
        "Share of the SMs at work (gpu_sm_active_ratio) and of the time the tensor cores ran "
        "(gpu_tensor_active_ratio), from GPM; the dashed lines are gpu_utilization_ratio, the "
        "share of time any kernel ran (a kernel on one SM reads 100%). SM activity far below "
        "utilization: busy but inefficient (small kernels or batches, waiting collectives). "
        "Only GPUs with GPM (Hopper and newer).",
        w=24,
        h=9,
        overrides=[dashed("C")],
        min_value=0,
    ),
    timeseries(
        602,
        "DRAM bandwidth utilization",
        [target(sel("gpu_dram_active_ratio"), GPU_LEGEND)],
        "percentunit",
        "Share of the peak memory (DRAM) bandwidth each GPU used, from GPM. High with low SM "
        "activity: the kernels are memory bound.",
        w=8,
        min_value=0,
    ),
    timeseries(
        603,
        "PCIe bandwidth (GPM)",
        [
            target(sel("gpu_pcie_transmit_bytes_per_second"), GPU_LEGEND + " transmit"),
            target(sel("gpu_pcie_receive_bytes_per_second"), GPU_LEGEND + " receive", ref="B"),
        ],
        "binBps",
        "Bytes per second each GPU sent and received over PCIe between two samples, from GPM "
        "(the Health row's PCIe traffic is the same from the byte counters).",
        w=8,
        min_value=0,
    ),
    timeseries(
        604,
        "NVLink bandwidth (GPM)",
        [
            target(sel("gpu_nvlink_transmit_bytes_per_second"), GPU_LEGEND + " transmit"),
            target(sel("gpu_nvlink_receive_bytes_per_second"), GPU_LEGEND + " receive", ref="B"),
        ],
        "binBps",
        "Bytes per second each GPU sent and received over all its NVLink links between two "
        "samples, from GPM.",
        w=8,
        min_value=0,
    ),
    stat(
        605,
        "GPUs with GPM",
        f"count({sel('gpu_gpm_supported')} == 1) or vector(0)",
        "none",
        "Selected GPUs whose SM, tensor and DRAM activity this row shows (gpu_gpm_supported "
        "== 1: Hopper and newer data-center GPUs).",
        h=6,
        sparkline=False,
    ),
    table(
        606,
        "GPM support per GPU",
        with_name(sel("gpu_gpm_supported")),
        ["instance", "gpu", "uuid", "name", "Value"],
        "Whether each selected GPU has GPM (gpu_gpm_supported). The GPUs without it (before "
        "Hopper, most consumer GPUs) have none of this row's metrics; those with it have them "
        "from the agent's second sample on.",
        hide=[],
        rename={"Value": "GPM"},
        mappings={"GPM": GPM_NO_YES},
        w=20,
        h=6,
    ),
    table(
        607,
        "MIG devices",
        [query for _, query, _ in MIG_COLUMNS],
        ["instance", "gpu", "mig_uuid", "profile", *_MIG_VALUES[1:]],
        "Every MIG device of the selected GPUs in MIG mode (gpu_mig_info), now: its profile, its "
        "memory in use and its total (its own: what the GPU's other MIG devices have free is not "
        "available to it), and the share of the SMs at work and of the time the tensor cores ran "
        "in its GPU instance, from GPM (Hopper and newer, from the agent's second sample on; the "
        "compute instances of a GPU instance share it). Empty: no selected GPU is in MIG mode.",
        hide=["uuid", _MIG_VALUES[0]],
        rename=dict(zip(_MIG_VALUES, [c for c, _, _ in MIG_COLUMNS], strict=True)),
        unit="bytes",
        units={c: u for c, _, u in MIG_COLUMNS[3:]},
        w=14,
    ),
    timeseries(
        608,
        "MIG device memory used",
        [
            target(
                with_profile(
                    f"{sel('gpu_mig_memory_used_bytes')}"
                    f" / on ({MIG_KEY}) {sel('gpu_mig_memory_total_bytes')}"
                ),
                MIG_LEGEND,
            ),
        ],
        "percentunit",
        "Fraction of each MIG device's memory in use; the GpuMigMemoryNearlyFull alert fires "
        "above 95 % for 15 minutes. Only GPUs in MIG mode.",
        w=10,
        min_value=0,
    ),
]

ROWS: list[tuple[int, str, list[Panel]]] = [
    (
        100,
        "Fleet overview",
        [
            stat(
                101,
                "GPUs up",
                f"sum({sel('gpu_up')})",
                "none",
                "GPUs whose last sample succeeded (gpu_up == 1).",
            ),
            stat(
                102,
                "GPUs down",
                f"count({sel('gpu_up')} == 0) or vector(0)",
                "none",
                "GPUs that NVML counts but that failed their last sample (gpu_up == 0). A GPU that "
                "fell off the bus has no series at all: watch GPUs up per instance for that.",
                steps=thresholds((None, "green"), (1, "red")),
                sparkline=False,
            ),
            stat(
                103,
                "Memory in use",
                f"sum({sel('gpu_memory_used_bytes')}) / sum({sel('gpu_memory_total_bytes')})",
                "percentunit",
                "GPU memory in use over all selected GPUs.",
                steps=thresholds((None, "green"), (0.8, "orange"), (0.95, "red")),
            ),
            stat(
                104,
                "Average utilization",
                f"avg({sel('gpu_utilization_ratio')})",
                "percentunit",
                "Mean of gpu_utilization_ratio over the selected GPUs.",
            ),
            stat(
                105,
                "GPU processes",
                f"sum({sel('gpu_processes')})",
                "none",
                "Processes NVML lists on the selected GPUs (compute and graphics).",
            ),
            stat(
                106,
                "GPUs reserved",
                f"sum({sel('gpu_reserved')})",
                "none",
                "GPUs a launcher lock holds for a job right now.",
            ),
            table(
                107,
                "GPUs",
                sel("gpu_info"),
                [
                    "instance",
                    "gpu",
                    "uuid",
                    "name",
                    "driver_version",
                    "cuda_version",
                    "pci_bus_id",
                    "serial",
                ],
                "Identity of every selected GPU, from gpu_info.",
                hide=["Value", "minor_number"],
                rename={"driver_version": "driver", "cuda_version": "CUDA"},
                h=7,
            ),
            timeseries(
                108,
                "Memory used vs total",
                [
                    target(sel("gpu_memory_used_bytes"), f"{GPU_LEGEND} used"),
                    target(sel("gpu_memory_total_bytes"), f"{GPU_LEGEND} total", ref="B"),
                ],
                "bytes",
                "Memory in use per GPU; the dashed lines are each GPU's total.",
                w=16,
                overrides=[dashed("B")],
                min_value=0,
            ),
            bargauge(
                109,
                "Memory used (fraction)",
                with_name(f"{sel('gpu_memory_used_bytes')} / {sel('gpu_memory_total_bytes')}"),
                NAME_LEGEND,
                "percentunit",
                "Fraction of each GPU's memory in use, now.",
                steps=thresholds((None, "green"), (0.8, "orange"), (0.95, "red")),
                min_value=0,
                max_value=1,
            ),
            heatmap(
                110,
                "GPU utilization",
                sel("gpu_utilization_ratio"),
                "percentunit",
                "gpu_utilization_ratio per GPU over time: one row per GPU, darker is busier.",
            ),
            timeseries(
                111,
                "Temperature vs slowdown threshold",
                [
                    target(sel("gpu_temperature_celsius"), GPU_LEGEND),
                    target(
                        sel("gpu_temperature_threshold_celsius", SLOWDOWN),
                        f"{GPU_LEGEND} slowdown",
                        ref="B",
                    ),
                ],
                "celsius",
                "GPU core temperature; the dashed lines are each GPU's own slowdown "
                "threshold, where the hardware starts to slow the GPU down.",
                overrides=[dashed("B")],
            ),
            bargauge(
                112,
                "Headroom to slowdown",
                with_name(
                    f"{sel('gpu_temperature_threshold_celsius', SLOWDOWN)}"
                    f" - ignoring (threshold) {sel('gpu_temperature_celsius')}"
                ),
                NAME_LEGEND,
                "celsius",
                "Degrees left before each GPU's slowdown threshold, now.",
                steps=thresholds((None, "red"), (5, "orange"), (15, "green")),
                w=12,
                min_value=0,
            ),
            timeseries(
                113,
                "Power draw vs limit",
                [
                    target(sel("gpu_power_watts"), GPU_LEGEND),
                    target(sel("gpu_power_limit_watts"), f"{GPU_LEGEND} limit", ref="B"),
                ],
                "watt",
                "Power draw per GPU; the dashed lines are each GPU's enforced power limit.",
                overrides=[dashed("B")],
                min_value=0,
            ),
            timeseries(
                114,
                "Average power from the energy counter (5m)",
                [
                    target(f"rate({sel('gpu_energy_joules_total')}[5m])", GPU_LEGEND),
                ],
                "watt",
                "rate() of gpu_energy_joules_total: the mean power over 5 minutes, in watts "
                "(GPUs before Volta have no energy counter).",
                min_value=0,
            ),
            state_timeline(
                115,
                "Throttling (thermal and power)",
                sel("gpu_clock_event_active", f'reason=~"{THERMAL_AND_POWER_REASONS}"'),
                GPU_LEGEND + " {{reason}}",
                OFF_ON,
                "Clock event reasons of heat and power: sw_power_cap is normal under "
                "heavy load; the slowdowns mean heat or a power supply problem.",
                w=24,
                h=12,
            ),
        ],
    ),
    (600, "True utilization", TRUE_UTILIZATION),
    (
        200,
        "Processes",
        [
            table(
                201,
                "GPU processes",
                [sel("gpu_process_memory_used_bytes"), sel("gpu_process_sm_utilization_ratio")],
                [*PROCESS_COLUMNS, "Value #A", "Value #B"],
                "Every process on the selected GPUs with the GPU memory it uses and its SM "
                "utilization (the highest since the previous sample), now. user and process are "
                "empty when the agent cannot see the PID (another PID namespace); SM utilization "
                "is empty where the GPU or driver cannot report it.",
                hide=[],
                rename={"Value #A": "memory", "Value #B": "SM utilization"},
                unit="bytes",
                sort_by="memory",
                h=9,
                units={"SM utilization": "percentunit"},
            ),
            timeseries(
                202,
                "GPU memory by user",
                [
                    target(
                        f"sum by (instance, user) ({sel('gpu_process_memory_used_bytes')})",
                        "{{instance}} {{user}}",
                    ),
                ],
                "bytes",
                "GPU memory of the processes of each user, per instance.",
                w=24,
                stack=True,
                min_value=0,
            ),
            timeseries(
                203,
                "SM utilization by process",
                [
                    target(
                        # A process NVML lists as compute and graphics has two series, one value.
                        f"max by (instance, gpu, uuid, pid, user, process) "
                        f"({sel('gpu_process_sm_utilization_ratio')})",
                        GPU_LEGEND + " {{process}} (pid {{pid}}, {{user}})",
                    ),
                ],
                "percentunit",
                "Share of the GPU's SMs each process kept busy: the highest value NVML reported "
                "for it since the previous sample, 0 when it did nothing. Processes that hold "
                "memory at 0 here are idle.",
                min_value=0,
            ),
            table(
                204,
                "Idle processes holding GPU memory (30m)",
                f"{sel('gpu_process_memory_used_bytes')} > 0"
                f" and on (instance, gpu, uuid, pid, type)"
                f" max_over_time({sel('gpu_process_sm_utilization_ratio')}[30m]) == 0",
                [*PROCESS_COLUMNS, "Value"],
                "Processes that hold GPU memory and did not use the SMs at all in the last 30 "
                "minutes (or since they started, when that is more recent): forgotten notebooks, "
                "hung or finished jobs that did not exit. Processes whose SM utilization is "
                "unknown are not listed.",
                hide=["uuid", "type"],
                rename={"Value": "memory"},
                unit="bytes",
                sort_by="memory",
                w=12,
            ),
        ],
    ),
    (700, "Waste", WASTE),
    (
        300,
        "Actions",
        [
            timeseries(
                301,
                "Zombie processes by class",
                [
                    target(
                        f"sum by (instance, class) ({sel('gpu_zombie_processes')})",
                        "{{instance}} {{class}}",
                    ),
                ],
                "none",
                "Processes of each class holding the selected GPUs at the reaper's last "
                "run; leaked counts GPUs with memory in use and no process.",
                min_value=0,
            ),
            state_timeline(
                302,
                "Thermal hotspots",
                sel("gpu_thermal_hotspot"),
                GPU_LEGEND,
                mapping((0, "ok", "green"), (1, "warning", "orange"), (2, "critical", "red")),
                "Thermal level of each GPU from the thermal action (with hysteresis).",
            ),
            state_timeline(
                303,
                "Thermal outliers",
                sel("gpu_thermal_outlier"),
                GPU_LEGEND,
                mapping((0, "no", "green"), (1, "outlier", "orange")),
                "GPUs running hotter than GPUs at similar utilization.",
            ),
            table(
                304,
                "Recommended GPU per policy",
                with_name(f"{sel('gpu_recommended')} == 1"),
                ["instance", "policy", "gpu", "uuid", "name"],
                "The GPUs each policy of the recommend action chooses for a new job, now.",
                hide=["Value"],
                sort_by=None,
                w=12,
            ),
            bargauge(
                305,
                "Recommended GPUs per policy",
                sel("gpu_recommended_devices", gpu=False),
                "{{instance}} {{policy}}",
                "none",
                "GPUs each policy chooses: its count, or 0 when too few GPUs qualify.",
                steps=thresholds((None, "red"), (1, "green")),
                w=12,
                min_value=0,
            ),
            state_timeline(
                306,
                "Launcher reservations",
                sel("gpu_reserved"),
                GPU_LEGEND,
                mapping((0, "free", "transparent"), (1, "reserved", "blue")),
                "GPUs held for a job by a launcher lock.",
            ),
        ],
    ),
    (500, "Health", HEALTH),
    (
        400,
        "Agent health",
        [
            timeseries(
                401,
                "Sample duration",
                [
                    target(sel("gpu_exporter_sample_duration_seconds", gpu=False), "{{instance}}"),
                ],
                "s",
                "How long the agent's last NVML sample took.",
                w=8,
                min_value=0,
            ),
            timeseries(
                402,
                "Snapshot age",
                [
                    target(sel("gpu_exporter_snapshot_age_seconds", gpu=False), "{{instance}}"),
                ],
                "s",
                "Age of the sample the agent serves, at scrape time. It grows when the sampler "
                "is stuck.",
                w=8,
                min_value=0,
            ),
            state_timeline(
                403,
                "Snapshot stale",
                sel("gpu_exporter_snapshot_stale", gpu=False),
                "{{instance}}",
                mapping((0, "fresh", "green"), (1, "stale", "red")),
                "1 when the served sample is older than interval + deadline.",
                w=8,
            ),
            state_timeline(
                404,
                "NVML up",
                sel("gpu_exporter_nvml_up", gpu=False),
                "{{instance}}",
                mapping((0, "down", "red"), (1, "up", "green")),
                "Whether NVML is initialised and answering on each instance.",
                w=8,
            ),
            timeseries(
                405,
                "Time since last successful action run",
                [
                    target(f"time() - {LAST_SUCCESS}", "{{instance}} {{action}}"),
                ],
                "s",
                "Seconds since each action last completed a run without an exception.",
                w=8,
                min_value=0,
            ),
            timeseries(
                406,
                "Action failures",
                [
                    target(
                        f"increase({sel('gpu_exporter_action_failures_total', gpu=False)}"
                        "[$__rate_interval])",
                        "{{instance}} {{action}}",
                    ),
                ],
                "none",
                "Runs of each action that raised an exception.",
                w=8,
                bars=True,
                min_value=0,
            ),
            timeseries(
                407,
                "Sample errors",
                [
                    # The errors counter has no series before the first error: then 0 per instance.
                    target(
                        f"sum by (instance, source) (increase("
                        f"{sel('gpu_exporter_sample_errors_total', gpu=False)}[$__rate_interval]))"
                        f" or on (instance) (0 * max by (instance) "
                        f"({sel('gpu_exporter_nvml_up', gpu=False)}))",
                        "{{instance}} {{source}}",
                    ),
                    target(
                        f"increase({sel('gpu_exporter_sample_deadline_exceeded_total', gpu=False)}"
                        "[$__rate_interval])",
                        "{{instance}} deadline exceeded",
                        ref="B",
                    ),
                ],
                "none",
                "Errors of samples by source (nvml, gpu, field, sampler) and samples that "
                "took longer than the deadline.",
                w=12,
                bars=True,
                min_value=0,
            ),
            table(
                408,
                "Agents",
                sel("gpu_exporter_build_info", gpu=False),
                ["instance", "version", "python_version"],
                "Version of gpu-exporter and Python on each instance.",
                hide=["Value"],
                w=12,
            ),
            timeseries(
                409,
                "HTTP requests by path and code",
                [
                    target(
                        f"sum by (instance, path, code) (rate("
                        f"{sel('gpu_exporter_http_requests_total', gpu=False)}[$__rate_interval]))",
                        "{{instance}} {{path}} {{code}}",
                    ),
                ],
                "reqps",
                "Requests the agent answered per second, by route and status code; paths it "
                "does not serve count as other. A scrape is counted once its response is sent.",
                w=12,
                min_value=0,
            ),
            timeseries(
                410,
                "HTTP error responses",
                [
                    # A code is a series only once answered: then 0 per instance.
                    target(
                        f"sum by (instance, path, code) (rate({HTTP_ERRORS}[$__rate_interval]))"
                        f" or on (instance) (0 * max by (instance) "
                        f"({sel('gpu_exporter_http_connections', gpu=False)}))",
                        "{{instance}} {{path}} {{code}}",
                    ),
                ],
                "reqps",
                "Requests answered with a 4xx or 5xx status: 401 a client without valid "
                "credentials (web config), 404 paths the agent does not serve, 503 a /healthz "
                "or /snapshot while the sample is stale or NVML is down, 500 a bug (see the "
                "agent's log).",
                w=12,
                min_value=0,
            ),
            timeseries(
                411,
                "HTTP connections open",
                [target(sel("gpu_exporter_http_connections", gpu=False), "{{instance}}")],
                "none",
                "Connections open at scrape time, idle keep-alive ones and the scrape's own "
                "included; new ones are refused once web.max_connections (default 1024) are open.",
                w=8,
                min_value=0,
            ),
            timeseries(
                412,
                "Rejected connections",
                [
                    target(
                        f"increase({sel('gpu_exporter_http_rejected_connections_total', gpu=False)}"
                        "[$__rate_interval])",
                        "{{instance}}",
                    ),
                ],
                "none",
                "Connections refused at web.max_connections, or dropped for a bad or slow "
                "request head or a failed TLS handshake. Scrapes fail while the limit is reached.",
                w=8,
                bars=True,
                min_value=0,
            ),
            timeseries(
                413,
                "Agent memory (RSS)",
                [target(sel("process_resident_memory_bytes", gpu=False), "{{instance}}")],
                "bytes",
                "Resident memory of the agent's process. Steady growth is a leak.",
                w=8,
                min_value=0,
            ),
            timeseries(
                414,
                "Agent CPU",
                [
                    target(
                        f"rate({sel('process_cpu_seconds_total', gpu=False)}[$__rate_interval])",
                        "{{instance}}",
                    ),
                ],
                "percentunit",
                "CPU time the agent's process uses (user and system): 100% is one core.",
                w=8,
                min_value=0,
            ),
            timeseries(
                415,
                "Open file descriptors vs limit",
                [
                    target(sel("process_open_fds", gpu=False), "{{instance}} open"),
                    target(sel("process_max_fds", gpu=False), "{{instance}} limit", ref="B"),
                ],
                "none",
                "File descriptors the agent holds (connections among them); the dashed lines "
                "are its limit (ulimit -n, LimitNOFILE). Log scale.",
                w=8,
                overrides=[dashed("B")],
                log_scale=True,
            ),
            timeseries(
                416,
                "Agent uptime",
                [
                    target(
                        f"time() - {sel('process_start_time_seconds', gpu=False)}",
                        "{{instance}}",
                    ),
                ],
                "s",
                "Time since the agent's process started: a drop is a restart.",
                w=8,
                min_value=0,
            ),
        ],
    ),
]


def variables() -> list[dict[str, Any]]:
    def query(name: str, label: str, expr: str, sort: int) -> dict[str, Any]:
        return {
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "datasource": DATASOURCE,
            "definition": expr,
            "hide": 0,
            "includeAll": True,
            "label": label,
            "multi": True,
            "name": name,
            "options": [],
            "query": {"query": expr, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2,
            "regex": "",
            "skipUrlSync": False,
            "sort": sort,
            "type": "query",
        }

    return [
        {
            "current": {},
            "hide": 0,
            "includeAll": False,
            "label": "Data source",
            "multi": False,
            "name": "datasource",
            "options": [],
            "query": "prometheus",
            "refresh": 1,
            "regex": "",
            "skipUrlSync": False,
            "type": "datasource",
        },
        query("instance", "Instance", f'label_values(gpu_up{{job="{JOB}"}}, instance)', 1),
        query("gpu", "GPU", f'label_values(gpu_up{{job="{JOB}", instance=~"$instance"}}, gpu)', 3),
    ]


def layout(rows: list[tuple[int, str, list[Panel]]]) -> list[Panel]:
    """Rows and their panels in Grafana's flat list, with grid positions filled in."""
    out: list[Panel] = []
    y = 0
    for row_id, title, panels in rows:
        out.append(
            {
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "id": row_id,
                "panels": [],
                "title": title,
                "type": "row",
            }
        )
        y += 1
        x = 0
        line_height = 0
        for item in panels:
            grid = item["gridPos"]
            if x + grid["w"] > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            grid["x"], grid["y"] = x, y
            x += grid["w"]
            line_height = max(line_height, grid["h"])
            out.append(item)
        y += line_height
    return out


def dashboard() -> dict[str, Any]:
    return {
        "__requires": [
            {"id": "grafana", "name": "Grafana", "type": "grafana", "version": "10.0.0"},
            {"id": "prometheus", "name": "Prometheus", "type": "datasource", "version": "1.0.0"},
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "NVIDIA GPUs, true utilization (GPM), processes, waste (idle GPUs and "
        "whose they are), actions, GPU health (XIDs, memory repair, PCIe, NVLink, throttling) and "
        "agent health from gpu-exporter. Generated by grafana/generate.py.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": layout(ROWS),
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["gpu", "nvidia", "gpu-exporter"],
        "templating": {"list": variables()},
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": TITLE,
        "uid": UID,
        "version": 1,
        "weekStart": "",
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", "-o", type=Path, default=OUTPUT, help=f"default {OUTPUT}")
    args = parser.parse_args()
    args.output.write_text(render(), encoding="utf-8")


if __name__ == "__main__":
    main()
