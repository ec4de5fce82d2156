"""``/history``: the last minutes of each GPU from the sampler's history, as columns.

Bounded by what the sampler keeps (``history`` samples): whatever ``seconds`` asks, never more.
Only GPUs of the latest Snapshot have an entry; a sample that did not know a value has null.
The shape is ``exporter/schemas/history.schema.json``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from exporter.core.snapshot import Gpu, Snapshot

#: The document's shape version (``history.schema.json``).
VERSION = 1
#: column -> what it reads of a GPU in one sample (None: unknown then)
COLUMNS = {
    "utilization_ratio": lambda g: g.utilization_ratio,
    "sm_active_ratio": lambda g: g.fields.get("sm_active"),
    "memory_used_bytes": lambda g: g.memory_used_bytes,
    "temperature_celsius": lambda g: g.temperature_celsius,
    "power_watts": lambda g: g.power_watts,
}


def history_document(
    snapshots: Sequence[Snapshot],
    interval: float,
    seconds: float | None = None,
    wanted: Collection[str] = (),
) -> dict[str, Any]:
    """The history of the GPUs in the last of ``snapshots`` (oldest first) over the last
    ``seconds`` (all when None), of the GPUs whose index or UUID is in ``wanted`` (all when
    empty). KeyError naming the first of ``wanted`` that no GPU has."""
    latest = snapshots[-1]
    gpus = [g for g in latest.gpus if g.uuid]
    if wanted:
        gpus = [g for g in gpus if str(g.index) in wanted or g.uuid in wanted]
        missing = set(wanted) - {str(g.index) for g in gpus} - {g.uuid for g in gpus}
        if missing:
            raise KeyError(sorted(missing)[0])
    since = latest.timestamp - seconds if seconds is not None else float("-inf")
    kept = [s for s in snapshots if s.timestamp >= since]
    entries = []
    for gpu in gpus:
        rows: list[Gpu | None] = [_find(s, gpu.uuid) for s in kept]
        entry: dict[str, Any] = {
            "index": gpu.index,
            "uuid": gpu.uuid,
            "name": gpu.info.name if gpu.info is not None else "",
            "memory_total_bytes": gpu.info.memory_total_bytes if gpu.info is not None else None,
            "timestamps": [s.timestamp for s in kept],
        }
        for column, read in COLUMNS.items():
            entry[column] = [read(g) if g is not None and g.up else None for g in rows]
        entries.append(entry)
    span = kept[-1].timestamp - kept[0].timestamp if kept else 0.0
    return {
        "version": VERSION,
        "interval_seconds": interval,
        "now": latest.timestamp,
        "seconds": span,
        "samples": len(kept),
        "gpus": entries,
    }


def _find(snapshot: Snapshot, uuid: str) -> Gpu | None:
    return next((g for g in snapshot.gpus if g.uuid == uuid), None)
