"""XID errors: NVIDIA's catalog (code -> what it needs) and the agent's record of those it saw.

The catalog is data, ``xid_catalog.csv`` beside this module (its header says where it comes
from and how to update it). ``resolution`` is a fixed function of the code, so the series of
``gpu_xid_errors_total`` never change shape. :class:`XidLog` is filled by the event thread
(``exporter.sampling.events``) and read by the sampler into every Snapshot.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

#: Every value of the ``resolution`` label.
RESOLUTIONS = ("restart_app", "reset_gpu", "reboot", "check_workflow", "ignore", "unknown")
#: XIDs kept per GPU for /snapshot and status.
KEPT_PER_GPU = 20
_CATALOG = os.path.join(os.path.dirname(__file__), "xid_catalog.csv")


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One code of the catalog."""

    xid: int
    mnemonic: str
    bucket: str  # the catalog's own resolution bucket (RESET_GPU, WORKFLOW_XID_48, ...)
    resolution: str  # one of RESOLUTIONS


@functools.cache
def catalog() -> Mapping[int, XidInfo]:
    """The catalog, read once: code -> XidInfo."""
    entries: dict[int, XidInfo] = {}
    with open(_CATALOG, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.strip()
            if not line or line.startswith("#") or line.startswith("xid,"):
                continue
            code, mnemonic, bucket, resolution = (part.strip() for part in line.split(","))
            if resolution not in RESOLUTIONS or not code.isdigit() or int(code) in entries:
                raise ValueError(f"{_CATALOG}:{number}: bad catalog line {line!r}")
            entries[int(code)] = XidInfo(int(code), mnemonic, bucket, resolution)
    return MappingProxyType(entries)


def describe_xid(code: int) -> XidInfo:
    """The catalog's entry for ``code``; ``unknown`` for a code it lacks."""
    return catalog().get(code) or XidInfo(code, "", "", "unknown")


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One XID NVML delivered: when (wall clock), which code, and what it needs."""

    timestamp: float
    xid: int
    resolution: str
    mnemonic: str = ""
    #: The MIG GPU and compute instance it hit (None: the whole GPU, or not MIG).
    gpu_instance: int | None = None
    compute_instance: int | None = None


@dataclass(frozen=True, slots=True)
class XidState:
    """What is known of one GPU's XIDs, as of a sample."""

    #: Whether the driver delivers XID events for the GPU (None: not asked yet).
    supported: bool | None
    #: XIDs seen since the agent started, by code.
    counts: Mapping[int, int]
    #: The last ``KEPT_PER_GPU``, oldest first.
    recent: tuple[XidEvent, ...]


_EMPTY = XidState(None, MappingProxyType({}), ())


class XidLog:
    """XIDs per GPU UUID, written by the event thread, read by the sampler (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[int, int]] = {}
        self._recent: dict[str, deque[XidEvent]] = {}
        self._supported: dict[str, bool] = {}

    def record(self, uuid: str, event: XidEvent) -> None:
        """Count one XID of the GPU ``uuid``."""
        with self._lock:
            counts = self._counts.setdefault(uuid, {})
            counts[event.xid] = counts.get(event.xid, 0) + 1
            self._recent.setdefault(uuid, deque(maxlen=KEPT_PER_GPU)).append(event)

    def set_supported(self, uuid: str, supported: bool) -> None:
        """Whether XID events of the GPU ``uuid`` are delivered."""
        with self._lock:
            self._supported[uuid] = supported

    def state(self, uuid: str) -> XidState:
        """A copy of what is known of the GPU ``uuid``."""
        with self._lock:
            if uuid not in self._supported and uuid not in self._counts:
                return _EMPTY
            return XidState(
                self._supported.get(uuid),
                MappingProxyType(dict(self._counts.get(uuid, {}))),
                tuple(self._recent.get(uuid, ())),
            )
