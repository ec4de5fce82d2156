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


def visible_uuids(
    value: str | None, gpus: Sequence[Gpu], order: str | None = "PCI_BUS_ID"
) -> tuple[dict[str, str] | None, str]:
    """The GPUs ``value`` makes visible (None: all), each GPU UUID mapped to what names it to
    CUDA (a MIG entry names the MIG device, not its parent), and a note for the user."""
    if value is None:
        return None, ""
    by_index = {gpu.index: gpu for gpu in gpus}
    visible: dict[str, str] = {}
    notes = []
    entries = [part.strip() for part in value.split(",")]
    if order != "PCI_BUS_ID" and any(entry.isdigit() for entry in entries):
        notes.append(
            "CUDA_VISIBLE_DEVICES holds indices but CUDA_DEVICE_ORDER is not PCI_BUS_ID; "
            "they are read in PCI bus order, as NVML numbers GPUs"
        )
    for entry in entries:
        uuid = _resolve(entry, gpus, by_index)
        if uuid is None:
            if entry:
                notes.append(
                    f"CUDA_VISIBLE_DEVICES: {entry!r} names no GPU here; it hides the rest"
                )
            break
        visible.setdefault(uuid, entry if entry.startswith("MIG-") else uuid)
    return visible, "; ".join(notes)


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
