"""What ``CUDA_VISIBLE_DEVICES`` makes visible, as the UUIDs of NVML's GPUs.

CUDA reads the list left to right and stops at the first entry it cannot use, so we do too.
Entries are indices (ASCII digits only, in CUDA's order, which is NVML's only under
``CUDA_DEVICE_ORDER=PCI_BUS_ID``), GPU UUIDs or unique prefixes of them (``GPU-8a3f``), and MIG
devices (``MIG-<uuid>``, or the older ``MIG-GPU-<uuid>/<gi>/<ci>``), which make their parent GPU
visible. An empty value hides every GPU; an unset one hides none.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from exporter.core.snapshot import Gpu

#: Stripped from each entry: ASCII whitespace only (str.strip() would also drop U+00A0 and kin).
_SPACE = " \t\n\r\f\v"
#: An entry in some form CUDA knows, whether or not it names a GPU here: empty, an index (a
#: negative one is the usual way to hide what follows), or a GPU or MIG UUID or prefix.
_WELL_FORMED = re.compile(r"(-?[0-9]+|(GPU|MIG)-[!-~]*)?")  # [!-~]: printable ASCII


def visible_uuids(
    value: str | None, gpus: Sequence[Gpu], order: str | None = "PCI_BUS_ID"
) -> tuple[dict[str, str] | None, str]:
    """The GPUs ``value`` makes visible (None: all), each GPU UUID mapped to what names it to
    CUDA (a MIG entry names the MIG device, not its parent), and a note for the user."""
    if value is None:
        return None, ""
    by_index = {str(gpu.index): gpu for gpu in gpus}
    visible: dict[str, str] = {}
    notes = []
    entries = _entries(value)
    if order != "PCI_BUS_ID" and any(_is_index(entry) for entry in entries):
        notes.append(
            "CUDA_VISIBLE_DEVICES holds indices but CUDA_DEVICE_ORDER is not PCI_BUS_ID; "
            "they are read in PCI bus order, as NVML numbers GPUs"
        )
    for entry in entries:
        uuid = _resolve(entry, gpus, by_index)
        if uuid is None:
            if entry:
                notes.append(_hides_the_rest(entry))
            break
        visible.setdefault(uuid, entry if entry.startswith("MIG-") else uuid)
    return visible, "; ".join(notes)


def visible_mig_devices(value: str | None, gpus: Sequence[Gpu]) -> set[str]:
    """The MIG devices ``value`` names by their UUIDs (or unique prefixes of them), up to the
    first entry CUDA would stop at; GPUs it names whole are :func:`visible_uuids`' part."""
    found: set[str] = set()
    if value is None:
        return found
    by_index = {str(gpu.index): gpu for gpu in gpus}
    devices = [uuid for gpu in gpus for uuid in gpu.mig_uuids()]
    for entry in _entries(value):
        if _resolve(entry, gpus, by_index) is None:
            break
        if entry.startswith("MIG-") and not entry.startswith("MIG-GPU-"):
            matches = [uuid for uuid in devices if uuid.startswith(entry)]
            found.update(matches[:1] if len(matches) == 1 else ())
    return found


def check_well_formed(value: str) -> None:
    """Raise ValueError naming the first entry of ``value`` in no form CUDA knows (``²``, ``0x1``).

    CUDA would stop there as at an index past the last GPU; a caller that wants such typos refused
    rather than read as "hide the rest" checks this first.
    """
    for entry in _entries(value):
        if not _WELL_FORMED.fullmatch(entry):
            raise ValueError(_why_not(entry))


def as_cuda_reads(value: str) -> tuple[str, str]:
    """``value`` up to its first entry in no form CUDA knows (CUDA stops reading there: what
    follows is hidden), and a note naming that entry ("" when there is none). What to send an
    agent, whose ``/recommend`` refuses such an entry, so that it chooses as CUDA would."""
    parts = value.split(",")
    for i, part in enumerate(parts):
        entry = part.strip(_SPACE)
        if not _WELL_FORMED.fullmatch(entry):
            return ",".join(parts[:i]), _hides_the_rest(entry)
    return value, ""


def _hides_the_rest(entry: str) -> str:
    return f"CUDA_VISIBLE_DEVICES: {_why_not(entry)}; it hides the rest"


def _entries(value: str) -> list[str]:
    return [part.strip(_SPACE) for part in value.split(",")]


def _is_index(entry: str) -> bool:
    """ASCII digits only: str.isdigit() also takes ``²`` (int() refuses it) and Arabic ones."""
    return entry.isascii() and entry.isdigit()


def _why_not(entry: str) -> str:
    shown = repr(entry if len(entry) <= 60 else entry[:60] + "...")
    if _WELL_FORMED.fullmatch(entry):
        return f"{shown} names no GPU here"
    return f"{shown} is no GPU index (ASCII digits), GPU UUID or MIG device"


def _resolve(entry: str, gpus: Sequence[Gpu], by_index: dict[str, Gpu]) -> str | None:
    if _is_index(entry):
        gpu = by_index.get(entry.lstrip("0") or "0")  # no int(): it refuses 5000 digits
        return gpu.uuid if gpu is not None and gpu.uuid else None
    if entry.startswith("MIG-GPU-"):  # MIG-GPU-<parent uuid>/<gi>/<ci>
        return _unique(entry[len("MIG-") :].split("/")[0], [g.uuid for g in gpus])
    if entry.startswith("MIG-"):
        parents = [g.uuid for g in gpus if any(m.startswith(entry) for m in g.mig_uuids())]
        return parents[0] if len(parents) == 1 else None
    if entry.startswith("GPU-"):
        return _unique(entry, [g.uuid for g in gpus])
    return None


def _unique(prefix: str, uuids: list[str]) -> str | None:
    matches = [uuid for uuid in uuids if uuid and uuid.startswith(prefix)]
    return matches[0] if len(matches) == 1 else None


class Identified(Protocol):
    """A GPU as a job is bound to it: its NVML index and UUID (``cuda_id`` when it has one)."""

    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str: ...


def job_environment(devices: Sequence[Identified]) -> dict[str, str]:
    """What a job needs to see exactly its GPUs, numbered as NVML numbers them."""
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(getattr(d, "cuda_id", "") or d.uuid for d in devices),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPU_EXPORTER_GPUS": ",".join(str(d.index) for d in devices),
    }
