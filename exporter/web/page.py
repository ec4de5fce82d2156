"""The status page (``/``): the document ``/snapshot`` serves, rendered as HTML tables.

The server renders it whole, so it reads without JavaScript; ``static/page.js`` then redraws
the same tables from ``/snapshot`` (and ``/peers``, ``/history``) every interval. The two
renderers follow the same rules (columns, formatting, half-up rounding); the tests compare both
with ``/snapshot``. Every string is escaped here; the script sets only ``textContent``. No
asset comes from elsewhere: ``CONTENT_SECURITY_POLICY`` allows the agent's own origin only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from html import escape
from importlib.resources import files
from typing import Any

#: The page's, its script's and its stylesheet's own origin; nothing inline, no frames, no forms.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
#: Headers of the page and its assets.
HEADERS: tuple[tuple[str, str], ...] = (
    ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)
LEVELS = ("ok", "warning", "critical")
#: The charts' span: what the page asks ``/history`` for.
CHART_SECONDS = 300


def _asset(name: str) -> bytes:
    return files("exporter.web").joinpath("static").joinpath(name).read_bytes()


#: path -> (content type, body): the script and the stylesheet, read once.
STATIC: Mapping[str, tuple[str, bytes]] = {
    "/static/page.js": ("text/javascript; charset=utf-8", _asset("page.js")),
    "/static/page.css": ("text/css; charset=utf-8", _asset("page.css")),
    "/static/icon.svg": ("image/svg+xml", _asset("icon.svg")),
}


# -- formatting: the same rules as page.js's ------------------------------------------------


def _round(value: float, digits: int) -> float:
    factor = 10**digits
    return math.floor(value * factor + 0.5) / factor


def pct(value: float | None) -> str:
    """``85 %``; ``-`` when unknown."""
    return "-" if value is None else f"{_round(value * 100, 0):.0f} %"


def size(value: float | None) -> str:
    """``61.0 GiB`` (binary units); ``-`` when unknown."""
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{_round(value, 1):.1f} {unit}"
        value /= 1024
    return f"{_round(value, 1):.1f} TiB"


def number(value: float | None, unit: str) -> str:
    """``62 °C``; ``-`` when unknown."""
    return "-" if value is None else f"{_round(value, 0):.0f}{unit}"


def clock(timestamp: float) -> str:
    """``12:03:04 UTC``."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(timestamp))


# -- HTML ---------------------------------------------------------------------------------


def _level(name: str) -> str:
    return f'<span class="level level-{escape(name)}">{escape(name)}</span>'


def _cell(field: str, *parts: str, cls: str = "", span: int = 0) -> str:
    attrs = f' data-field="{field}"' + (f' class="{cls}"' if cls else "")
    attrs += f' colspan="{span}"' if span else ""
    return f"<td{attrs}>{''.join(parts)}</td>"


def _small(text: str, cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<small{attr}>{escape(text)}</small>"


def _rows(rows: Sequence[str], empty: str, columns: int) -> str:
    if rows:
        return "".join(rows)
    return f'<tr><td class="empty" colspan="{columns}">{escape(empty)}</td></tr>'


def gpu_row(gpu: Mapping[str, Any]) -> str:
    """One GPU's row of the GPU table."""
    info = gpu.get("info") or {}
    head = (
        f'<th scope="row">{gpu["index"]} <span class="name">'
        f"{escape(info.get('name') or 'unknown')}</span></th>"
    )
    if not gpu.get("up"):
        error = escape("down: " + (gpu.get("error") or "not answering"))
        down = _cell("error", error, cls="down", span=len(GPU_COLUMNS) - 1)
        return f'<tr data-uuid="{escape(gpu["uuid"])}">{head}{down}</tr>'
    cells = []
    sm = (gpu.get("fields") or {}).get("sm_active")
    util = escape(pct(gpu.get("utilization_ratio")))
    cells.append(_cell("utilization", util, _small("SM " + pct(sm)) if sm is not None else ""))
    total, used = info.get("memory_total_bytes"), gpu.get("memory_used_bytes")
    meter = (
        f'<meter min="0" max="{total}" high="{total * 0.9}" value="{used}"></meter>'
        if total and used is not None
        else "<meter></meter>"
    )
    cells.append(_cell("memory", meter, escape(f"{size(used)} / {size(total)}")))
    thermal = gpu.get("thermal")
    temp = escape(number(gpu.get("temperature_celsius"), " °C"))
    cells.append(
        _cell("temperature", temp, " " + _level(LEVELS[thermal["level"]]) if thermal else "")
    )
    power = f"{number(gpu.get('power_watts'), '')} / {number(info.get('power_limit_watts'), ' W')}"
    cells.append(_cell("power", escape(power)))
    events = gpu.get("clock_events_active")
    active = [k for k, on in events.items() if on and k != "gpu_idle"] if events else None
    cells.append(
        _cell("clock_events", escape("-" if active is None else ", ".join(active) or "none"))
    )
    health = gpu.get("health")
    parts = [_level(health["verdict"]) if health else "-"]
    if health and health["reasons"]:
        parts.append(_small("; ".join(health["reasons"])))
    xids = (gpu.get("xids") or [])[-3:]
    if xids:
        marks = ", ".join(f"{x['xid']} at {clock(x['timestamp'])}" for x in xids)
        parts.append(_small("XID " + marks))
    cells.append(_cell("health", *parts))
    lock = "free"
    taker = gpu.get("reserved_by")
    if taker is not None:
        lock = f"PID {taker}" if taker else "another PID namespace"
        if gpu.get("reserved_by_user"):
            lock += f" ({gpu['reserved_by_user']})"
    cells.append(_cell("lock", escape(lock)))
    chosen = gpu.get("recommended")
    cells.append(_cell("recommended", "-" if chosen is None else "yes" if chosen else "no"))
    return f'<tr data-uuid="{escape(gpu["uuid"])}">{head}{"".join(cells)}</tr>'


def owner(proc: Mapping[str, Any]) -> str:
    """``pod NAMESPACE/NAME``, ``Slurm job ID`` or ``-``."""
    if proc.get("pod"):
        return f"pod {proc.get('namespace', '')}/{proc['pod']}"
    if proc.get("slurm_job"):
        return f"Slurm job {proc['slurm_job']}"
    return "-"


def flags(proc: Mapping[str, Any]) -> str:
    """The reaper's class, the waste action's findings, an allocation broken; ``-`` if none."""
    out = []
    cls = (proc.get("reaper") or {}).get("class")
    if cls:
        out.append(f"zombie: {cls}")
    waste = proc.get("waste") or {}
    if waste.get("idle_holder"):
        out.append("idle holder")
    if waste.get("leak_growth_bytes") is not None:
        out.append("leak suspect")
    if proc.get("outside_allocation"):
        out.append("outside its allocation")
    return ", ".join(out) or "-"


def process_rows(document: Mapping[str, Any]) -> list[str]:
    """A row per GPU process, GPU by GPU. Its cells carry no field names (the column headers
    do: ``PROCESS_FIELDS``): 8 GPUs x 16 processes must stay small."""
    rows = []
    for gpu in document["gpus"]:
        for proc in gpu.get("processes") or ():
            name = escape(proc.get("name") or "-")
            if proc.get("cmdline"):
                name += _small(" ".join(proc["cmdline"]), "cmdline")
            cells = (
                f"<td>{gpu['index']}</td>",
                f'<th scope="row">{proc["pid"]}</th>',
                f"<td>{escape(proc.get('user') or '-')}</td>",
                f"<td>{name}</td>",
                f"<td>{escape(size(proc.get('used_memory_bytes')))}</td>",
                f"<td>{escape(owner(proc))}</td>",
                f"<td>{escape(flags(proc))}</td>",
            )
            rows.append(
                f'<tr data-gpu="{gpu["index"]}" data-pid="{proc["pid"]}">{"".join(cells)}</tr>'
            )
    return rows


def reaper_mode(reaper: Mapping[str, Any] | None) -> str:
    """What the zombie reaper does, in a few words."""
    if not reaper:
        return "off"
    return (
        "dry run (reports, never signals)"
        if reaper["dry_run"]
        else "kill (signals confirmed orphans)"
    )


def decision_rows(reaper: Mapping[str, Any] | None) -> list[str]:
    """The reaper's recent decisions, newest first."""
    rows = []
    for d in reversed((reaper or {}).get("recent") or ()):
        decision = " ".join(w for w in (d["event"], d["signal"], d["reason"]) if w)
        cells = [
            f'<th scope="row">{clock(d["time"])}</th>',
            _cell("gpu", "-" if d["gpu"] is None else str(d["gpu"])),
            _cell("pid", "-" if d["pid"] is None else str(d["pid"])),
            _cell("process", escape(d["process"] or "-")),
            _cell("class", escape(d["class"] or "-")),
            _cell("decision", escape(decision)),
        ]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return rows


def peer_rows(peers: Iterable[Mapping[str, Any]]) -> list[str]:
    """A compact row per peer agent (``web.peers.PeerWatcher``'s summaries)."""
    rows = []
    for p in peers:
        head = (
            f'<th scope="row"><a href="{escape(p["url"])}">'
            f"{escape(p.get('hostname') or p['url'])}</a></th>"
        )
        if not p["up"]:
            state = _cell("state", _level("down"), " " + escape(p["error"]), cls="down", span=5)
            rows.append(f'<tr data-url="{escape(p["url"])}">{head}{state}</tr>')
            continue
        busiest, hottest = p.get("busiest"), p.get("hottest")
        cells = [
            _cell("state", _level("up")),
            _cell("free", f"{p['gpus_free']} / {p['gpus']}"),
            _cell(
                "busiest",
                escape(f"{pct(busiest['utilization_ratio'])} (GPU {busiest['gpu']})")
                if busiest
                else "-",
            ),
            _cell(
                "hottest",
                escape(f"{number(hottest['temperature_celsius'], ' °C')} (GPU {hottest['gpu']})")
                if hottest
                else "-",
            ),
            _cell("health", _level(p["health"]) if p.get("health") else "-"),
        ]
        rows.append(f'<tr data-url="{escape(p["url"])}">{head}{"".join(cells)}</tr>')
    return rows


def _field_attr(field: str) -> str:
    """`` data-field="FIELD"`` ("" for none)."""
    return f' data-field="{field}"' if field else ""


def _table(
    ident: str, caption: str, columns: Sequence[str], rows: str, fields: Sequence[str] = ()
) -> str:
    named = zip(columns, fields or [""] * len(columns), strict=True)
    head = "".join(
        f'<th scope="col"{_field_attr(field)}>{escape(column)}</th>' for column, field in named
    )
    return (
        f'<div class="scroll"><table id="{ident}"><caption>{escape(caption)}</caption>'
        f"<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>"
    )


GPU_COLUMNS = (
    "GPU",
    "Utilization",
    "Memory used / total",
    "Temperature",
    "Power / limit",
    "Clock events",
    "Health",
    "Launcher lock",
    "Recommended",
)
PROCESS_COLUMNS = ("GPU", "PID", "User", "Name", "GPU memory", "Pod or Slurm job", "Flags")
#: The process table's field of each column (named on its header, not on every cell).
PROCESS_FIELDS = ("gpu", "pid", "user", "name", "memory", "owner", "flags")
DECISION_COLUMNS = ("Time", "GPU", "PID", "Process", "Class", "Decision")
HOST_COLUMNS = ("Host", "State", "GPUs free", "Busiest", "Hottest", "Health")
ROUTES = (
    ("metrics", "/metrics"),
    ("snapshot", "/snapshot"),
    ("history", "/history"),
    ("health/gpus", "/health/gpus"),
    ("recommend", "/recommend"),
    ("healthz", "/healthz"),
)


def render(
    document: Mapping[str, Any],
    *,
    version: str,
    interval: float,
    peers: Sequence[Mapping[str, Any]] | None = None,
    now: Callable[[], float] = time.time,
) -> bytes:
    """The whole page for ``document`` (what ``/snapshot`` serves) and, when peers are
    configured, their summaries."""
    host = document["host"]["hostname"]
    health = document.get("health") or {}
    ok = bool(health.get("ok"))
    agent = (
        _level("ok" if ok else "critical")
        + " "
        + escape("healthy" if ok else health.get("reason") or "unknown")
    )
    age = f"{max(0.0, now() - document['timestamp']):.1f} s"
    driver = document["host"].get("driver_version") or "-"
    cuda = document["host"].get("cuda_version") or "-"
    reaper = document.get("reaper")
    hosts = ""
    if peers is not None:
        hosts = (
            "<section><h2>Hosts</h2>"
            + _table(
                "hosts",
                "This agent's peers (config: peers), as the agent last fetched them.",
                HOST_COLUMNS,
                _rows(peer_rows(peers), "No peers.", len(HOST_COLUMNS)),
            )
            + "</section>"
        )
    links = " · ".join(f'<a href="{href}">{escape(name)}</a>' for href, name in ROUTES)
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(host)} · gpu-exporter</title>"
        '<link rel="icon" href="static/icon.svg" type="image/svg+xml">'
        '<link rel="stylesheet" href="static/page.css">'
        '<script src="static/page.js" defer></script></head>'
        f'<body data-interval="{interval:g}" data-history="{CHART_SECONDS}" '
        f'data-peers="{1 if peers is not None else 0}" data-updated="{document["seq"]}">'
        f"<header><h1>{escape(host)} <small>gpu-exporter {escape(version)}</small></h1>"
        f'<p>Agent: <span id="agent-health">{agent}</span> · sample <span id="age">{age}</span>'
        f" old · driver {escape(driver)} · CUDA {escape(cuda)}</p>"
        f'<p>Zombie reaper: <span id="reaper-mode">{escape(reaper_mode(reaper))}</span></p>'
        '<p id="problem" role="status" hidden></p></header><main>'
        + hosts
        + "<section><h2>GPUs</h2>"
        + _table(
            "gpus",
            "Every GPU in the latest sample.",
            GPU_COLUMNS,
            _rows([gpu_row(g) for g in document["gpus"]], "No GPUs.", len(GPU_COLUMNS)),
        )
        + '</section><section><h2>Last minutes</h2><div id="charts" hidden></div>'
        "<noscript><p>The charts need JavaScript; the tables above and below do not.</p>"
        "</noscript></section><section><h2>Processes</h2>"
        + _table(
            "processes",
            "Every process holding a GPU.",
            PROCESS_COLUMNS,
            _rows(process_rows(document), "No GPU processes.", len(PROCESS_COLUMNS)),
            PROCESS_FIELDS,
        )
        + "</section><section><h2>Zombie reaper decisions</h2>"
        + _table(
            "decisions",
            "The reaper's latest decisions, newest first (the audit log has all).",
            DECISION_COLUMNS,
            _rows(decision_rows(reaper), "No decisions yet.", len(DECISION_COLUMNS)),
        )
        + f"</section></main><footer>{links}</footer></body></html>"
    )
    return page.encode()
