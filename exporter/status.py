"""The ``status`` view of a Snapshot: a table of GPUs and their processes, once or redrawn
(``--watch``), of this host or of a running agent (``--from``: its ``/snapshot``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from exporter.core.activity import ORPHANED_MIN_MEMORY, unaccounted_memory
from exporter.core.fields import RECOVERY_ACTIONS
from exporter.core.health import LEVELS, Check, HealthTracker, Verdict, assess
from exporter.core.locks import UNKNOWN_HOLDER
from exporter.core.snapshot import Allocation, Gpu, GpuProcess, Snapshot
from exporter.core.units import format_bytes, format_duration
from exporter.core.xid import KEPT_PER_GPU
from exporter.terminal import colour_wanted, paint
from exporter.terminal import watch as redraw

_GPU_ROW = "{:>3}  {:<26} {:>5} {:>5} {:>21} {:>9} {:>13}  {:<14} {}"
_PROCESS_ROW = "{:>3}  {:>8} {:<12} {:<8} {:>9} {:>4}  {}"
_HEADER = _GPU_ROW.format(
    "GPU", "NAME", "TEMP", "UTIL", "MEMORY USED / TOTAL", "FREE", "POWER", "THROTTLE", "HEALTH"
).rstrip()
_ACTIONS = {number: name for number, name, _ in RECOVERY_ACTIONS}
#: XIDs of the last this many seconds count in the HEALTH column.
_XID_WINDOW = 3600.0
_PROCESS_HEADER = _PROCESS_ROW.format("", "PID", "USER", "TYPE", "MEMORY", "SM", "COMMAND")
#: The colour of each verdict (the HEALTH column says the level in words too).
_VERDICT_STYLES = {"ok": "green", "warning": "yellow", "critical": "red", "unknown": "dim"}
#: Temperature is yellow this close below the GPU's slowdown threshold, red at or above it.
_HOT_MARGIN = 10.0
#: Memory is yellow, then red, from these shares of it in use.
_MEMORY_FULL = ((0.98, "red"), (0.90, "yellow"))

#: What a watch shows each frame: a Snapshot and the verdict to show per GPU UUID.
Take = Callable[[], tuple[Snapshot, Mapping[str, Verdict]]]


class Unavailable(Exception):
    """No Snapshot to show: the message says why, in one line."""


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _throttle(gpu: Gpu) -> str:
    active = gpu.clock_events_active()
    if active is None:
        return "-"
    names = [name for name, on in active.items() if on and name != "gpu_idle"]
    return ",".join(names) or "none"


def health_notes(gpu: Gpu, now: float) -> list[str]:
    """What needs attention on ``gpu``, in a few words each: XIDs of the last hour, memory
    repair waiting or failed, what the driver says to do, a degraded PCIe link, NVLink links
    down. Empty when nothing does (or nothing is known)."""
    notes = []
    recent = [x for x in gpu.xids if now - x.timestamp <= _XID_WINDOW]
    if recent:
        codes = ",".join(str(code) for code in sorted({x.xid for x in recent}))
        count = f"{len(recent)}+" if len(recent) == KEPT_PER_GPU else str(len(recent))
        notes.append(f"XID {codes} ({count}/1h)")
    fields = gpu.fields
    if fields.get("row_remap_failed"):
        notes.append("remap failed")
    elif fields.get("row_remap_pending") or fields.get("bank_remap_pending"):
        notes.append("remap pending")
    if fields.get("retired_pages_pending"):
        notes.append("page retirement pending")
    if fields.get("memory_unrepairable"):
        notes.append("memory unrepairable")
    action = fields.get("recovery_action")
    if action:
        notes.append(f"needs {_ACTIONS.get(int(action), f'action {int(action)}')}")
    width, widest = (
        fields.get("pcie_link_width"),
        (gpu.info.fields if gpu.info else {}).get("pcie_link_width_max"),
    )
    if width is not None and widest is not None and width < widest:
        notes.append(f"PCIe x{int(width)}/x{int(widest)}")
    down = [link for link, values in gpu.nvlink.items() if values.get("nvlink_up") == 0]
    if down:
        notes.append(f"NVLink {len(down)}/{len(gpu.nvlink)} down")
    return notes


def _health(gpu: Gpu, now: float, verdict: Verdict | None) -> str:
    """The HEALTH column: the verdict, then what needs attention."""
    notes = health_notes(gpu, now)
    if verdict is None:
        return f"UNKNOWN {', '.join(notes)}" if notes else "unknown"
    if verdict.level == 0:
        return ", ".join(notes) or "ok"
    # the notes are shorter than the checks' reasons; a check they do not cover adds its own
    covered = {"xid", "memory_repair", "recovery_action", "pcie", "nvlink"} if notes else set()
    extra = [c.reason for c in verdict.checks if c.level and c.name not in covered]
    return f"{verdict.status.upper()} " + ", ".join([*notes, *extra])


def _temperature_style(gpu: Gpu) -> str | None:
    """Red at or above the GPU's slowdown threshold, yellow close below it; none where the
    threshold is not known."""
    slowdown = gpu.info.temperature_thresholds.get("slowdown") if gpu.info else None
    celsius = gpu.temperature_celsius
    if slowdown is None or celsius is None:
        return None
    if celsius >= slowdown:
        return "red"
    return "yellow" if celsius >= slowdown - _HOT_MARGIN else None


def _memory_style(used: int | None, total: int | None) -> str | None:
    if used is None or not total:
        return None
    return next((style for share, style in _MEMORY_FULL if used >= share * total), None)


def _gpu_line(gpu: Gpu, now: float, verdict: Verdict | None = None, colour: bool = False) -> str:
    name = gpu.info.name if gpu.info else "?"
    if not gpu.up:
        return f"{gpu.index:>3}  {name[:26]:<26} " + paint(f"DOWN: {gpu.error}", "red", colour)
    total = gpu.info.memory_total_bytes if gpu.info else None
    memory = f"{format_bytes(gpu.memory_used_bytes)} / {format_bytes(total)}"
    limit = gpu.info.power_limit_watts if gpu.info else None
    power = f"{_fmt(gpu.power_watts, '.0f')} / {_fmt(limit, '.0f')} W"
    temp = _fmt(gpu.temperature_celsius, ".0f", "C")
    util = _fmt(
        gpu.utilization_ratio * 100 if gpu.utilization_ratio is not None else None, ".0f", "%"
    )
    free = format_bytes(gpu.memory_free_bytes)
    health = paint(
        _health(gpu, now, verdict),
        _VERDICT_STYLES[verdict.status if verdict is not None else "unknown"],
        colour,
    )
    # padded before painted: the escape sequences take no column
    temp = paint(f"{temp:>5}", _temperature_style(gpu), colour)
    memory = paint(f"{memory:>21}", _memory_style(gpu.memory_used_bytes, total), colour)
    row = _GPU_ROW.format(
        gpu.index, name[:26], temp, util, memory, free, power, _throttle(gpu), health
    ).rstrip()
    if gpu.reserved_by == UNKNOWN_HOLDER:
        row += "\n     reserved by a launcher lock (holder not visible from this PID namespace)"
    elif gpu.reserved_by is not None:
        who = f"{gpu.reserved_by_user} " if gpu.reserved_by_user else ""
        row += f"\n     reserved by a launcher lock: {who}(pid {gpu.reserved_by})"
    holders = ", ".join(dict.fromkeys(_allocation(a) for a in gpu.allocations))
    if holders:
        row += f"\n     allocated to {holders}"
    loose = unaccounted_memory(gpu)
    if loose is not None and loose > ORPHANED_MIN_MEMORY:
        row += f"\n     {format_bytes(loose)} of used memory held by no listed process"
    return row


def _allocation(allocation: Allocation) -> str:
    """``pod ml/train-0 (trainer)`` or ``job 4242``, and the MIG device it names."""
    if allocation.pod:
        who = f"pod {allocation.namespace}/{allocation.pod} ({allocation.container})"
    else:
        who = f"job {allocation.slurm_job}"
    return f"{who} on {allocation.mig_uuid}" if allocation.mig_uuid else who


def _owner(proc: GpuProcess) -> str:
    """Whose the process is, when known: its pod and container, its Slurm job and step."""
    owners = []
    if proc.pod:
        container = f" ({proc.container})" if proc.container else ""
        owners.append(f"pod {proc.namespace}/{proc.pod}{container}")
    if proc.slurm_job:
        owners.append(f"job {proc.slurm_job}" + (f".{proc.slurm_step}" if proc.slurm_step else ""))
    if proc.outside_allocation:
        owners.append("OUTSIDE ITS ALLOCATION")
    return f"  [{', '.join(owners)}]" if owners else ""


def _process_line(proc: GpuProcess) -> str:
    if not proc.visible:
        command = "(not visible here: another PID namespace, or it exited)"
    elif proc.cmdline:  # only with expose_cmdline
        command = " ".join(proc.cmdline)
    else:
        command = f"{proc.name} {proc.script}" if proc.script else proc.name
    if len(command) > 60:
        command = command[:57] + "..."
    command += _owner(proc)
    user = (proc.user or "?")[:12]
    memory = format_bytes(proc.used_memory_bytes)
    sm = proc.sm_utilization_ratio
    share = _fmt(sm * 100 if sm is not None else None, ".0f", "%")  # of the SMs' time
    return _PROCESS_ROW.format("", proc.pid, user, proc.type, memory, share, command)


def format_status(
    snapshot: Snapshot, verdicts: Mapping[str, Verdict] | None = None, colour: bool = False
) -> str:
    """A gpustat-like table of every GPU and its processes. HEALTH shows the verdict
    ``verdicts`` has for the GPU's UUID (an agent's, or a watch's over its samples), else the
    one this Snapshot alone supports (no XID history). ``colour``: the verdicts, temperatures
    near the slowdown threshold and memory near full in ANSI colours (the text stays the same)."""
    host = snapshot.host
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.timestamp))
    driver, cuda = host.driver_version or "?", host.cuda_version or "?"
    lines = [
        f"{host.hostname}  {when}  driver {driver}  CUDA {cuda}",
        paint(_HEADER, "bold", colour),
    ]
    judged = dict(verdicts or {})
    if any(gpu.uuid not in judged for gpu in snapshot.gpus):
        judged = {**assess([snapshot]), **judged}  # what one Snapshot can tell
    for gpu in snapshot.gpus:
        lines.append(_gpu_line(gpu, snapshot.timestamp, judged.get(gpu.uuid), colour))
        if gpu.processes:
            lines.append(_PROCESS_HEADER)
            lines.extend(_process_line(proc) for proc in sorted(gpu.processes, key=lambda p: p.pid))
    if not snapshot.gpus:
        lines.append(
            "  no GPUs: the driver answers but lists none (in a container, was it started with "
            "the GPUs, e.g. --gpus all?)"
        )
    return "\n".join(lines)


def nvml_unavailable(snapshot: Snapshot) -> str:
    """Why this host's Snapshot has no GPUs to show, and what to try."""
    return (
        f"NVML is not available: {snapshot.nvml_error}. Is the NVIDIA driver installed and "
        "loaded? To try gpu-exporter without a GPU: gpu-exporter status --simulate"
    )


# -- a running agent (--from) -------------------------------------------------------------------


def fetch(url: str, timeout: float) -> tuple[dict[str, Any], Snapshot]:
    """The ``/snapshot`` document of the agent at ``url`` and the Snapshot it holds;
    Unavailable saying why, in one line, when it cannot be had (unreachable, an HTTP error with
    the agent's message, not JSON, too large, not a Snapshot, the agent without NVML)."""
    from exporter.web.client import AgentError, get_json  # only --from pays for HTTP

    target = url.rstrip("/") + "/snapshot"
    try:
        document = get_json(target, timeout)
    except AgentError as exc:
        raise Unavailable(str(exc)) from None
    try:
        snapshot = Snapshot.from_dict(document)
    except ValueError as exc:
        raise Unavailable(f"{target}: not a Snapshot: {exc}") from None
    if not snapshot.nvml_up:
        raise Unavailable(f"the agent at {url}: NVML is not available: {snapshot.nvml_error}")
    return document, snapshot


def agent_verdicts(document: Mapping[str, Any]) -> dict[str, Verdict]:
    """The verdicts a ``/snapshot`` document carries (each GPU's ``health``, from the agent's
    health action, which knows the XID history and the thermal action's levels), by UUID. A GPU
    without one (the action off, or not run yet), or with one this version cannot read, is left
    out: :func:`format_status` judges it from the Snapshot."""
    found = {}
    for gpu in document.get("gpus") or ():
        try:
            checks = tuple(
                Check(str(name), LEVELS.index(check["status"]), str(check.get("reason") or ""))
                for name, check in gpu["health"]["checks"].items()
            )
            if checks:
                found[str(gpu["uuid"])] = Verdict(int(gpu["index"]), str(gpu["uuid"]), checks)
        except (TypeError, KeyError, ValueError, AttributeError):
            continue
    return found


def fetched(url: str, timeout: float) -> Take:
    """A watch's frames from the agent at ``url``: one ``/snapshot`` each."""

    def take() -> tuple[Snapshot, Mapping[str, Verdict]]:
        document, snapshot = fetch(url, timeout)
        return snapshot, agent_verdicts(document)

    return take


def sampled(collector: Any) -> Take:
    """A watch's frames from ``collector`` (a ``sampling.collect.Collector``, kept open: one
    NVML session for the whole watch): one sample each, judged with every sample so far."""
    tracker = HealthTracker()

    def take() -> tuple[Snapshot, Mapping[str, Verdict]]:
        snapshot = collector.sample()
        tracker.observe(snapshot)
        if not snapshot.nvml_up:
            raise Unavailable(nvml_unavailable(snapshot))
        return snapshot, tracker.verdicts()

    return take


# -- --watch ------------------------------------------------------------------------------------


class Frames:
    """The frames of ``status --watch``: a header line as watch(1)'s (the interval, the command,
    this host and the time), then the latest table. When a sample or a fetch fails, the line
    under the header says so (in words, and red) and the last table stays; the watch goes on."""

    def __init__(
        self,
        take: Take,
        interval: float,
        command: str,
        colour: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.take = take
        self.title = f"Every {format_duration(interval)}: {command}"
        self.colour = colour
        self.clock = clock
        self.table: list[str] = []
        self.table_at: float | None = None

    def __call__(self, width: int | None) -> list[str]:
        """The next frame's lines, the header fitted to ``width`` columns (None: any)."""
        now = self.clock()
        error = ""
        try:
            snapshot, verdicts = self.take()
        except Unavailable as exc:
            error = str(exc)
        else:
            self.table = format_status(snapshot, verdicts, self.colour).split("\n")
            self.table_at = now
        right = f"{os.uname().nodename}: {_clock(now)}"
        gap = max(2, (width or 0) - 1 - len(self.title) - len(right))
        lines = [self.title + " " * gap + right]
        if error:
            since = f"the table below is from {_clock(self.table_at)}" if self.table_at else ""
            failed = paint(f"failed at {_clock(now)}: {error}", "red", self.colour)
            lines.append(f"{failed}; {since}" if since else failed)
        return [*lines, "", *self.table]


def watch(take: Take, interval: float, command: str, stream: TextIO) -> None:
    """Redraw the table every ``interval`` seconds on ``stream`` until SIGINT or SIGTERM."""
    redraw(Frames(take, interval, command, colour_wanted(stream)), interval, stream)


def _clock(timestamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
