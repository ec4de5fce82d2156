"""What ``CUDA_VISIBLE_DEVICES`` makes visible, as the UUIDs of NVML's GPUs.

CUDA reads the list left to right and stops at the first entry it cannot use, so we do too.
Entries are indices (CUDA's order, which is NVML's only under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``),
GPU UUIDs or unique prefixes of them (``GPU-8a3f``), and MIG devices (``MIG-<uuid>``, or the
older ``MIG-GPU-<uuid>/<gi>/<ci>``), which make their parent GPU visible. An empty value hides
every GPU; an unset one hides none.
"""

from __future__ import annotations

from collections.abc import Sequence

from exporter.snapshot import Gpu


def visible_uuids(value: str | None, gpus: Sequence[Gpu]) -> tuple[set[str] | None, str]:
    """(the UUIDs ``value`` makes visible or None for all, a note when an entry was ignored)."""
    if value is None:
        return None, ""
    by_index = {gpu.index: gpu for gpu in gpus}
    visible: set[str] = set()
    for entry in (part.strip() for part in value.split(",")):
        uuid = _resolve(entry, gpus, by_index)
        if uuid is None:
            note = f"CUDA_VISIBLE_DEVICES: {entry!r} names no GPU here; it and what follows hide"
            return visible, note if entry else ""
        visible.add(uuid)
    return visible, ""


def _resolve(entry: str, gpus: Sequence[Gpu], by_index: dict[int, Gpu]) -> str | None:
    if entry.isdigit():
        gpu = by_index.get(int(entry))
        return gpu.uuid if gpu is not None and gpu.uuid else None
    if entry.startswith("MIG-GPU-"):  # MIG-GPU-<parent uuid>/<gi>/<ci>
        return _unique(entry[len("MIG-") :].split("/")[0], [g.uuid for g in gpus])
    if entry.startswith("MIG-"):
        parents = [
            g.uuid for g in gpus if g.info and any(m.startswith(entry) for m in g.info.mig_uuids)
        ]
        return parents[0] if len(parents) == 1 else None
    if entry.startswith("GPU-"):
        return _unique(entry, [g.uuid for g in gpus])
    return None


def _unique(prefix: str, uuids: list[str]) -> str | None:
    matches = [uuid for uuid in uuids if uuid and uuid.startswith(prefix)]
    return matches[0] if len(matches) == 1 else None
