"""The XID thread: NVML pushes XID errors; this thread waits for them and counts them.

One event set holds every GPU the sampler reads. The thread waits on it with a timeout of
``timeout_ms`` (so that stopping takes at most that long), outside the NVML lock, so sampling
goes on meanwhile. It registers again whenever the GPUs the sampler reads change (a GPU came
back, another took its index) or NVML was initialised again, and it never spins: with nothing to
wait on, or after an error, it sleeps, backing off up to ``backoff_max``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from exporter.core.nvml import EventsUnavailable, Nvml, XidArrival
from exporter.core.xid import XidEvent, XidLog, describe_xid

log = logging.getLogger(__name__)

#: XID lines logged per GPU per minute at most; the rest are counted, not logged, and a line
#: says how many were left out (an XID storm must not flood the journal).
LOG_PER_MINUTE = 10
#: The GPUs to watch: (index, UUID) of each, and the NVML initialisation they belong to.
Wanted = tuple[int, tuple[tuple[int, str], ...]]


class XidWatcher:
    """Waits for XID events on its own thread and records them in ``log``."""

    def __init__(
        self,
        nvml: Nvml,
        xids: XidLog,
        *,
        timeout_ms: int = 1000,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.nvml = nvml
        self.xids = xids
        self.timeout_ms = timeout_ms
        self._clock = clock
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._wanted: Wanted = (0, ())
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._stop_requested = 0.0
        self._thread: threading.Thread | None = None
        #: How often the thread waited and got an error (for tests: it must not spin).
        self.waits = 0
        self.errors = 0
        self._logged: dict[str, tuple[float, int, int]] = {}  # uuid -> (minute, logged, left)
        #: Whether the last registration failed for a passing reason (tried again later).
        self._retry = False

    @property
    def native_id(self) -> int | None:
        """The thread's id for the OS (``/proc/self/task/ID``); None before :meth:`start`."""
        return self._thread.native_id if self._thread is not None else None

    def want(self, generation: int, gpus: tuple[tuple[int, str], ...]) -> None:
        """Watch these GPUs (index, UUID) of NVML initialisation ``generation``."""
        wanted = (generation, gpus)
        if wanted != self._wanted:
            self._wanted = wanted
            self._changed.set()

    def start(self) -> None:
        """Start the thread (a daemon: a hung driver must not block exit)."""
        self._thread = threading.Thread(target=self._run, name="gpu-exporter-xid", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the thread to stop at its next turn (its wait ends within ``timeout_ms``)."""
        if not self._stop.is_set():
            self._stop_requested = time.monotonic()
        self._stop.set()
        self._changed.set()

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop the thread; False when it is still inside an NVML call ``timeout`` seconds
        after the stop was first asked for (by this or :meth:`request_stop`)."""
        self.request_stop()
        if self._thread is None:
            return True
        self._thread.join(max(0.0, timeout - (time.monotonic() - self._stop_requested)))
        return not self._thread.is_alive()

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        event_set: Any = None
        registered: Wanted | None = None
        backoff = self._backoff_initial
        retry_at = 0.0
        while not self._stop.is_set():
            wanted = self._wanted
            if wanted != registered:
                self._changed.clear()
                event_set = self._register(event_set, registered, wanted)
                registered = wanted
                retry_at = time.monotonic() + self._backoff_max
            elif self._retry and event_set is not None and time.monotonic() >= retry_at:
                # a GPU failed to register for a passing reason: a new set, with it again
                self._release(event_set, wanted[0])
                event_set = registered = None
                continue
            if event_set is None:  # nothing to wait on: until the GPUs change (or, after a
                # passing failure, a while)
                self._changed.wait(self._backoff_max if self._retry else None)
                if self._retry and self._wanted == registered:
                    registered = None
                continue
            try:
                self.waits += 1
                arrival = self.nvml.wait_event(event_set, self.timeout_ms)
                backoff = self._backoff_initial
            except EventsUnavailable as exc:
                self.errors += 1
                log.debug("waiting for XID events failed: %s; retrying in %.0fs", exc, backoff)
                self._stop.wait(backoff)  # never spin on a failing wait
                backoff = min(backoff * 2, self._backoff_max)
                if exc.error in ("Uninitialized", "InvalidArgument"):
                    # the set went with NVML (or is no longer one): a new one, this not freed
                    event_set = registered = None
                continue
            if arrival is not None:
                self._record(arrival)
        if event_set is not None and registered is not None:
            self._release(event_set, registered[0])

    def _register(self, old: Any, registered: Wanted | None, wanted: Wanted) -> Any:
        """A new event set with ``wanted``'s GPUs (None when none can deliver XIDs); the
        old set is drained into the log and freed when it is of the same NVML."""
        if old is not None and registered is not None:
            self._release(old, registered[0])
        self._retry = False
        generation, gpus = wanted
        if not gpus or generation != self.nvml.generation or not self.nvml.initialized:
            return None
        try:
            event_set = self.nvml.create_event_set()
        except EventsUnavailable as exc:
            log.warning("XID events unavailable: %s; trying again later", exc)
            self._retry = True
            return None
        watching = 0
        for index, uuid in gpus:
            try:
                supported = self.nvml.register_xid_events(event_set, index)
            except EventsUnavailable as exc:
                log.info("GPU %d: cannot register for XID events: %s", index, exc)
                self._retry = True
                continue
            self.xids.set_supported(uuid, supported)
            if supported:
                watching += 1
            else:
                log.info("GPU %d (%s): the driver delivers no XID events", index, uuid)
        if not watching:
            self.nvml.free_event_set(event_set)
            return None
        log.debug("watching %d GPUs for XID events", watching)
        return event_set

    def _release(self, event_set: Any, generation: int) -> None:
        """Record what ``event_set`` still holds, then free it (a set of an NVML since shut
        down went with it: freeing it again is not safe)."""
        if generation != self.nvml.generation or not self.nvml.initialized:
            return
        for _ in range(1000):  # bounded: a set that keeps answering is not drained forever
            try:
                arrival = self.nvml.wait_event(event_set, 0)
            except EventsUnavailable:
                break
            if arrival is None:
                break
            self._record(arrival)
        self.nvml.free_event_set(event_set)

    def _record(self, arrival: XidArrival) -> None:
        info = describe_xid(arrival.xid)
        event = XidEvent(
            timestamp=self._clock(),
            xid=arrival.xid,
            resolution=info.resolution,
            mnemonic=info.mnemonic,
            gpu_instance=arrival.gpu_instance,
            compute_instance=arrival.compute_instance,
        )
        if not arrival.uuid:
            log.warning("XID %d (%s) from a GPU that cannot be told", arrival.xid, info.resolution)
            return
        self.xids.record(arrival.uuid, event)
        self._log(arrival.uuid, event)

    def _log(self, uuid: str, event: XidEvent) -> None:
        """One line per XID, at most ``LOG_PER_MINUTE`` per GPU and minute."""
        minute = event.timestamp // 60
        start, logged, left = self._logged.get(uuid, (minute, 0, 0))
        if start != minute:
            if left:
                log.warning("GPU %s: %d more XIDs in the last minute were not logged", uuid, left)
            start, logged, left = minute, 0, 0
        if logged >= LOG_PER_MINUTE:
            self._logged[uuid] = (start, logged, left + 1)
            return
        where = "" if event.gpu_instance is None else f", MIG instance {event.gpu_instance}"
        name = f" {event.mnemonic}" if event.mnemonic else ""
        index = next((i for i, u in self._wanted[1] if u == uuid), "?")
        log.warning(
            "GPU %s (%s%s): XID %d%s, resolution %s",
            index,
            uuid,
            where,
            event.xid,
            name,
            event.resolution,
        )
        self._logged[uuid] = (start, logged + 1, left)
