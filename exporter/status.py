"""The one-shot ``status`` view of a Snapshot: a table of GPUs and their processes."""

from __future__ import annotations

import time

from exporter.core.snapshot import Gpu, GpuProcess, Snapshot
from exporter.core.units import format_bytes

_GPU_ROW = "{:>3}  {:<26} {:>5} {:>5} {:>21} {:>9} {:>13}  {}"
_PROCESS_ROW = "{:>3}  {:>8} {:<12} {:<8} {:>9}  {}"
_HEADER = _GPU_ROW.format(
    "GPU", "NAME", "TEMP", "UTIL", "MEMORY USED / TOTAL", "FREE", "POWER", "THROTTLE"
)
_PROCESS_HEADER = _PROCESS_ROW.format("", "PID", "USER", "TYPE", "MEMORY", "COMMAND")


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _throttle(gpu: Gpu) -> str:
    active = gpu.clock_events_active()
    if active is None:
        return "-"
    names = [name for name, on in active.items() if on and name != "gpu_idle"]
    return ",".join(names) or "none"


def _gpu_line(gpu: Gpu) -> str:
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
    row = _GPU_ROW.format(gpu.index, name[:26], temp, util, memory, free, power, _throttle(gpu))
    if gpu.reserved_by is not None:
        who = f"{gpu.reserved_by_user} " if gpu.reserved_by_user else ""
        row += f"\n     reserved by a launcher lock: {who}(pid {gpu.reserved_by})"
    return row


def _process_line(proc: GpuProcess) -> str:
    if not proc.visible:
        command = "(not visible here: another PID namespace, or it exited)"
    elif proc.cmdline:  # only with expose_cmdline
        command = " ".join(proc.cmdline)
    else:
        command = f"{proc.name} {proc.script}" if proc.script else proc.name
    if len(command) > 60:
        command = command[:57] + "..."
    user = (proc.user or "?")[:12]
    memory = format_bytes(proc.used_memory_bytes)
    return _PROCESS_ROW.format("", proc.pid, user, proc.type, memory, command)


def format_status(snapshot: Snapshot) -> str:
    """A gpustat-like table of every GPU and its processes."""
    host = snapshot.host
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.timestamp))
    driver, cuda = host.driver_version or "?", host.cuda_version or "?"
    lines = [
        f"{host.hostname}  {when}  driver {driver}  CUDA {cuda}",
        _HEADER,
    ]
    for gpu in snapshot.gpus:
        lines.append(_gpu_line(gpu))
        if gpu.processes:
            lines.append(_PROCESS_HEADER)
            lines.extend(_process_line(proc) for proc in sorted(gpu.processes, key=lambda p: p.pid))
    if not snapshot.gpus:
        lines.append(
            "  no GPUs: the driver answers but lists none (in a container, was it started with "
            "the GPUs, e.g. --gpus all?)"
        )
    return "\n".join(lines)
