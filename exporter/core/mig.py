"""Which MIG device each process of a GPU in MIG mode runs on, and what can be said of its
activity there.

NVML lists a MIG GPU's processes on the parent GPU, each entry with the GPU and compute instance
it runs on: that pair names one MIG device. NVML gives no per-process utilization in MIG mode,
so a process's SM activity is its MIG device's GPM activity when it is the only process on that
device (and on no other); otherwise it is unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from exporter.core.nvml import UNKNOWN_UTILIZATION, NvmlProcess, ProcessUtilization
from exporter.core.snapshot import MigDevice


def process_devices(
    processes: Iterable[NvmlProcess], devices: Sequence[MigDevice]
) -> dict[int, tuple[str, ...]]:
    """PID -> the UUIDs of the MIG devices it runs on (in the devices' order)."""
    by_instances = {(d.gpu_instance, d.compute_instance): d.uuid for d in devices}
    by_gpu_instance: dict[int | None, list[str]] = {}
    for device in devices:
        by_gpu_instance.setdefault(device.gpu_instance, []).append(device.uuid)
    found: dict[int, set[str]] = {}
    for proc in processes:
        if proc.gpu_instance is None:
            continue
        uuid = by_instances.get((proc.gpu_instance, proc.compute_instance))
        # an entry without a compute instance: its GPU instance's device, if it has one only
        candidates = [uuid] if uuid else by_gpu_instance.get(proc.gpu_instance, [])
        if len(candidates) == 1:
            found.setdefault(proc.pid, set()).add(candidates[0])
    order = {d.uuid: n for n, d in enumerate(devices)}
    return {pid: tuple(sorted(uuids, key=order.__getitem__)) for pid, uuids in found.items()}


def device_utilization(
    on: Mapping[int, tuple[str, ...]], devices: Sequence[MigDevice]
) -> dict[int, ProcessUtilization]:
    """PID -> its utilization from its MIG device's GPM (SM activity only) when it is the
    device's only process and runs on that one device; unknown otherwise."""
    sharing: dict[str, int] = {}
    for uuids in on.values():
        for uuid in uuids:
            sharing[uuid] = sharing.get(uuid, 0) + 1
    active = {d.uuid: d.fields.get("sm_active") for d in devices}
    out = {}
    for pid, uuids in on.items():
        alone = len(uuids) == 1 and sharing[uuids[0]] == 1
        sm = active.get(uuids[0]) if alone else None
        out[pid] = ProcessUtilization(sm=sm) if sm is not None else UNKNOWN_UTILIZATION
    return out
