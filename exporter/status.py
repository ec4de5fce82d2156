"""The one-shot ``status`` view of a Snapshot: a table of GPUs and their processes."""

from __future__ import annotations

import time

from exporter.core.activity import ORPHANED_MIN_MEMORY, unaccounted_memory
from exporter.core.fields import RECOVERY_ACTIONS
from exporter.core.health import Verdict, assess
from exporter.core.locks import UNKNOWN_HOLDER
from exporter.core.snapshot import Allocation, Gpu, GpuProcess, Snapshot
from exporter.core.units import format_bytes
from exporter.core.xid import KEPT_PER_GPU

_GPU_ROW = "{:>3}  {:<26} {:>5} {:>5} {:>21} {:>9} {:>13}  {:<14} {}"
_PROCESS_ROW = "{:>3}  {:>8} {:<12} {:<8} {:>9} {:>4}  {}"
_HEADER = _GPU_ROW.format(
    "GPU", "NAME", "TEMP", "UTIL", "MEMORY USED / TOTAL", "FREE", "POWER", "THROTTLE", "HEALTH"
).rstrip()
_ACTIONS = {number: name for number, name, _ in RECOVERY_ACTIONS}
#: XIDs of the last this many seconds count in the HEALTH column.
_XID_WINDOW = 3600.0
_PROCESS_HEADER = _PROCESS_ROW.format("", "PID", "USER", "TYPE", "MEMORY", "SM", "COMMAND")


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
    """The HEALTH column: the verdict one Snapshot supports, then what needs attention."""
    notes = health_notes(gpu, now)
    if verdict is None or verdict.level == 0:
        return ", ".join(notes) or "ok"
    # the notes are shorter than the checks' reasons; a check they do not cover adds its own
    covered = {"xid", "memory_repair", "recovery_action", "pcie", "nvlink"} if notes else set()
    extra = [c.reason for c in verdict.checks if c.level and c.name not in covered]
    return f"{verdict.status.upper()} " + ", ".join([*notes, *extra])


def _gpu_line(gpu: Gpu, now: float, verdict: Verdict | None = None) -> str:
    name = gpu.info.name if gpu.info else "?"
    if not gpu.up:
        return f"{gpu.index:>3}  {name[:26]:<26} DOWN: {gpu.error}"
    total = gpu.info.memory_total_bytes if gpu.info else None
    memory = f"{format_bytes(gpu.memory_used_bytes)} / {format_bytes(total)}"
    limit = gpu.info.power_limit_watts if gpu.info else None
    power = f"{_fmt(gpu.power_watts, '.0f')} / {_fmt(limit, '.0f')} W"
    temp = _fmt(gpu.temperature_celsius, ".0f", "C")
    util = _fmt(
        gpu.utilization_ratio * 100 if gpu.utilization_ratio is not None else None, ".0f", "%"
    )
    free = format_bytes(gpu.memory_free_bytes)
    health = _health(gpu, now, verdict)
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


def format_status(snapshot: Snapshot) -> str:
    """A gpustat-like table of every GPU and its processes."""
    host = snapshot.host
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.timestamp))
    driver, cuda = host.driver_version or "?", host.cuda_version or "?"
    lines = [
        f"{host.hostname}  {when}  driver {driver}  CUDA {cuda}",
        _HEADER,
    ]
    verdicts = assess([snapshot])  # what one Snapshot can tell (no XID history)
    for gpu in snapshot.gpus:
        lines.append(_gpu_line(gpu, snapshot.timestamp, verdicts.get(gpu.uuid)))
        if gpu.processes:
            lines.append(_PROCESS_HEADER)
            lines.extend(_process_line(proc) for proc in sorted(gpu.processes, key=lambda p: p.pid))
    if not snapshot.gpus:
        lines.append(
            "  no GPUs: the driver answers but lists none (in a container, was it started with "
            "the GPUs, e.g. --gpus all?)"
        )
    return "\n".join(lines)
