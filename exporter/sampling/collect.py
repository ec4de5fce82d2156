"""One sample: NVML and procfs in, one immutable Snapshot out.

Keeps what must survive between samples: NVML's state and init backoff, and each GPU's static
facts (read once per initialisation, and again when a failed GPU comes back).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from exporter.core.activity import IdleTimes
from exporter.core.jobmap import read_job_dir
from exporter.core.kubelet import PodResourcesClient
from exporter.core.locks import UNKNOWN_HOLDER, LockError, held_locks, provision
from exporter.core.mig import device_utilization, process_devices
from exporter.core.nvml import (
    UNKNOWN_UTILIZATION,
    GpuFailed,
    Nvml,
    NvmlProcess,
    NvmlUnavailable,
    ProcessUtilization,
)
from exporter.core.procfs import ProcessInfo, ProcFs
from exporter.core.snapshot import (
    Gpu,
    GpuInfo,
    GpuProcess,
    HostInfo,
    MigDevice,
    SampleError,
    Snapshot,
)
from exporter.core.xid import XidLog
from exporter.sampling.events import XidWatcher
from exporter.sampling.owners import attribute

log = logging.getLogger(__name__)
_SOURCE_NAMES = {"slurm": "Slurm job mapping", "kubelet": "Kubelet pod resources"}
#: What a launcher lock can reserve: a GPU, or one of its MIG devices.
GpuOrDevice = TypeVar("GpuOrDevice", Gpu, MigDevice)


class Collector:
    """Builds Snapshots; owns NVML initialisation, re-initialisation and backoff."""

    def __init__(
        self,
        nvml: Nvml,
        procfs: ProcFs,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        lock_dir: str | None = None,
        expose_cmdline: bool = False,
        provision_locks: bool = False,
        xids: XidWatcher | None = None,
        slurm_job_dir: str | None = None,
        kubelet: PodResourcesClient | None = None,
    ) -> None:
        self.nvml = nvml
        #: A prolog's job-mapping directory (core.jobmap); None: not read.
        self.slurm_job_dir = slurm_job_dir
        #: The kubelet's pod-resources API; None: not asked.
        self.kubelet = kubelet
        #: source -> the last problem logged, so that each is logged once
        self._problems: dict[str, str] = {}
        self._outside: set[tuple[str, int, float | None]] = set()  # processes logged as outside
        #: The XID thread (the agent's; None for one-shot commands, which see no XIDs): told
        #: which GPUs to watch after every sample, its log read into every Snapshot.
        self.xids = xids
        self.procfs = procfs
        self.lock_dir = lock_dir
        #: Only the agent makes each GPU's lock file its own; commands that only read (status,
        #: recommend, the launcher's sample) never write in the lock directory.
        self.provision_locks = provision_locks
        #: Command lines may hold secrets (tokens in argv): off, Snapshots never carry them.
        self.expose_cmdline = expose_cmdline
        self._clock = clock
        self._monotonic = monotonic
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._backoff = backoff_initial
        self._next_init = 0.0
        self._nvml_error = ""
        self._host = HostInfo(hostname=os.uname().nodename)
        self._infos: dict[int, GpuInfo] = {}
        self._last_known: dict[int, GpuInfo] = {}  # identity for labels while a GPU is down
        self._count: int | None = None
        self._seq = 0
        self._idle = IdleTimes()
        #: index (-1: the host) -> (when, delay): static facts that a transient error left
        #: incomplete are read again then, the delay doubling while they stay incomplete.
        self._reread: dict[int, tuple[float, float]] = {}
        self._provisioned: set[str] = set()  # GPUs whose lock file was made or checked

    def sample(self) -> Snapshot:
        """Take one sample. Never raises for NVML, GPU or procfs trouble: it is in the Snapshot."""
        wall, started = self._clock(), self._monotonic()
        calls_before = self.nvml.calls
        errors: list[SampleError] = []
        if self.kubelet is not None:
            self.kubelet.begin()  # it answers while NVML is read
        gpus: tuple[Gpu, ...] = ()
        if not self.nvml.initialized and started >= self._next_init:
            self._initialize(errors, started)
        if self.nvml.initialized:
            try:
                if self._due(-1, started):
                    self._host = self.nvml.read_host()
                    self._note_statics(-1, started)
                gpus = self._sample_gpus(errors)
            except NvmlUnavailable as exc:
                self._lost(exc, errors, started)
        if self.lock_dir and gpus:
            holders = held_locks(self.lock_dir, self.procfs.root)
            gpus = tuple(self._reserved(g, holders.get(g.uuid), holders) for g in gpus)
        gpus = self._allocated(gpus, errors)
        if self.xids is not None:
            gpus = self._with_xids(gpus, self.xids.xids)
        self._idle.end_sample()
        self._seq += 1
        return Snapshot(
            seq=self._seq,
            timestamp=wall,
            monotonic=started,
            duration_seconds=self._monotonic() - started,
            nvml_up=self.nvml.initialized,
            host=self._host,
            gpus=gpus,
            errors=tuple(errors),
            nvml_error="" if self.nvml.initialized else self._nvml_error,
            nvml_calls=self.nvml.calls - calls_before,
        )

    def _allocated(self, gpus: tuple[Gpu, ...], errors: list[SampleError]) -> tuple[Gpu, ...]:
        """``gpus`` with their allocations and their processes' owners (sampling.owners)."""
        jobs: dict[str, tuple[str, ...]] | None = None
        if self.slurm_job_dir:
            files = read_job_dir(self.slurm_job_dir)
            self._problem(errors, "slurm", "JobMapping", "slurm_job_dir", files.problem)
            if files.jobs or not files.problem:  # a bad file spoils only itself
                jobs = files.jobs
        pods = self.kubelet.finish() if self.kubelet is not None else None
        if pods is not None:
            self._problem(errors, "kubelet", "PodResources", "kubelet_socket", pods.problem)
        found = attribute(gpus, jobs, pods.devices if pods and not pods.problem else None)
        self._log_outside(found)
        return found

    def _problem(
        self, errors: list[SampleError], source: str, error: str, what: str, problem: str
    ) -> None:
        """Record ``problem`` of an attribution source in the sample; log it when it is new."""
        name = _SOURCE_NAMES[source]
        if problem:
            errors.append(SampleError(source, error, None, what, problem))
            if problem != self._problems.get(source):
                log.warning("%s: %s", name, problem)
        elif self._problems.get(source):
            log.info("%s: read again", name)
        self._problems[source] = problem

    def _log_outside(self, gpus: tuple[Gpu, ...]) -> None:
        """Log each process found outside its allocation once."""
        now: set[tuple[str, int, float | None]] = set()
        for gpu in gpus:
            for process in gpu.processes or ():
                if not process.outside_allocation:
                    continue
                key = (gpu.uuid, process.pid, process.start_time)
                now.add(key)
                if key not in self._outside:
                    owner = (
                        f"job {process.slurm_job}"
                        if process.slurm_job
                        else f"pod {process.namespace}/{process.pod}"
                    )
                    log.warning(
                        "process %d (%s) runs on GPU %d (%s), which its %s was not given",
                        process.pid,
                        process.name or "?",
                        gpu.index,
                        gpu.uuid,
                        owner,
                    )
        self._outside = now

    def _with_xids(self, gpus: tuple[Gpu, ...], log: XidLog) -> tuple[Gpu, ...]:
        """``gpus`` with their XIDs; the XID thread told to watch the GPUs that answer."""
        assert self.xids is not None
        self.xids.want(
            self.nvml.generation if self.nvml.initialized else 0,
            tuple((g.index, g.uuid) for g in gpus if g.up),
        )
        out = []
        for gpu in gpus:
            state = log.state(gpu.uuid) if gpu.uuid else None
            if state is None or (state.supported is None and not state.counts):
                out.append(gpu)
                continue
            out.append(
                replace(
                    gpu,
                    xid_events_supported=state.supported,
                    xid_counts=state.counts,
                    xids=state.recent,
                )
            )
        return tuple(out)

    def close(self, timeout: float = 1.0) -> bool:
        """Shut NVML down (and close the kubelet's channel); False when a hung call prevented
        it."""
        if self.kubelet is not None:
            self.kubelet.close()
        self.procfs.close()
        return self.nvml.shutdown(timeout)

    # -- NVML lifecycle -----------------------------------------------------------------------

    def _initialize(self, errors: list[SampleError], now: float) -> None:
        try:
            self._host = self.nvml.init()
        except NvmlUnavailable as exc:
            self._down(exc, errors, now)
            return
        self._infos.clear()
        self._reread.clear()
        self._note_statics(-1, now)
        if self._nvml_error:
            log.warning("NVML is back: driver %s", self._host.driver_version or "?")
        else:
            log.info(
                "NVML initialised: driver %s, CUDA %s",
                self._host.driver_version or "?",
                self._host.cuda_version or "?",
            )
        self._nvml_error = ""
        self._backoff = self._backoff_initial

    def _lost(self, exc: NvmlUnavailable, errors: list[SampleError], now: float) -> None:
        self.nvml.shutdown()
        self._infos.clear()
        self._backoff = self._backoff_initial
        self._down(exc, errors, now)

    def _down(self, exc: NvmlUnavailable, errors: list[SampleError], now: float) -> None:
        message = str(exc)
        errors.append(SampleError("nvml", exc.error, message=message))
        if message != self._nvml_error:
            log.error(
                "NVML unavailable: %s; retrying with backoff (at most every %.0fs)",
                message,
                self._backoff_max,
            )
        else:
            log.debug("NVML still unavailable: %s", message)
        self._nvml_error = message
        self._next_init = now + self._backoff
        self._backoff = min(self._backoff * 2, self._backoff_max)

    def _due(self, index: int, now: float) -> bool:
        """Whether incomplete static facts of ``index`` (-1: the host) are to be read again."""
        due = self._reread.get(index)
        return due is not None and now >= due[0]

    def _note_statics(self, index: int, now: float) -> None:
        """After a static read: schedule the next try when it came back incomplete."""
        if index in self.nvml.incomplete:
            delay = self._reread[index][1] * 2 if index in self._reread else self._backoff_initial
            delay = min(delay, self._backoff_max)
            self._reread[index] = (now + delay, delay)
        else:
            self._reread.pop(index, None)

    def _reserved(
        self, gpu: GpuOrDevice, holder: int | None, holders: dict[str, int] | None = None
    ) -> GpuOrDevice:
        """``gpu`` (and each of its MIG devices, by ``holders``) with the launcher lock's
        holder and its user (when visible here); reserved by ``UNKNOWN_HOLDER`` (0), with no
        user, when the lock is held by a process not visible from this PID namespace."""
        if holders and isinstance(gpu, Gpu) and any(d.uuid in holders for d in gpu.mig_devices):
            devices = tuple(self._reserved(d, holders.get(d.uuid)) for d in gpu.mig_devices)
            gpu = replace(gpu, mig_devices=devices)
        if holder is None:
            return gpu
        if holder == UNKNOWN_HOLDER:
            return replace(gpu, reserved_by=UNKNOWN_HOLDER, reserved_by_user="")
        info = self.procfs.process(holder)
        return replace(gpu, reserved_by=holder, reserved_by_user=info.user if info else "")

    def _provision_lock(self, uuid: str) -> None:
        """Make the GPU's lock file the agent's own, once per GPU (see ``locks.provision``)."""
        if not self.lock_dir or not self.provision_locks or uuid in self._provisioned:
            return
        self._provisioned.add(uuid)
        try:
            warning = provision(self.lock_dir, uuid)
        except OSError as exc:
            if exc.errno == errno.EROFS:  # a --read-only image, a read-only mount of the host's
                # directory: the agent only reads the locks there, and a lock file that a
                # launcher makes there is still checked at the next start (provision: its owner).
                log.debug("lock directory is read-only; %s has no lock file yet", uuid)
                return
            warning = f"cannot make the lock file of {uuid}: {exc}"
        except LockError as exc:
            warning = f"cannot make the lock file of {uuid}: {exc}"
        if warning:
            log.warning("%s", warning)

    # -- GPUs ---------------------------------------------------------------------------------

    def _sample_gpus(self, errors: list[SampleError]) -> tuple[Gpu, ...]:
        count = self.nvml.device_count()
        if count != self._count:  # GPUs came or went: indices may now name other GPUs
            self._infos.clear()
            self._last_known.clear()
            self._count = count
        seen: dict[int, ProcessInfo | None] = {}  # procfs is read once per pid per sample
        gpus = tuple(self._sample_gpu(index, errors, seen) for index in range(count))
        self.procfs.retain(set(seen))
        answering = {gpu.uuid: gpu.index for gpu in gpus if gpu.up}
        return tuple(  # a failed GPU labelled from memory never takes a UUID another reports
            replace(gpu, uuid="", info=None)
            if not gpu.up and answering.get(gpu.uuid, gpu.index) != gpu.index
            else gpu
            for gpu in gpus
        )

    def _sample_gpu(
        self, index: int, errors: list[SampleError], seen: dict[int, ProcessInfo | None]
    ) -> Gpu:
        info = self._infos.get(index)
        now = self._monotonic()
        if info is not None and self._due(index, now):
            info = None
        try:
            if info is None:
                info = self.nvml.read_info(index)
                self._note_statics(index, now)
                known = self._last_known.get(index)
                if known is not None and known.uuid != info.uuid:
                    log.warning("GPU %d is now %s (was %s)", index, info.uuid, known.uuid)
                self._infos[index] = self._last_known[index] = info
                self._provision_lock(info.uuid)
                for other in [i for i, o in self._infos.items() if o.uuid == info.uuid]:
                    if other != index:  # it moved here (one left, one came): read that one again
                        del self._infos[other]
            reading = self.nvml.read_gpu(info, now)
        except GpuFailed as exc:
            if self._infos.pop(index, None) is not None:
                log.error("GPU %d (%s) failed: %s", index, info.uuid if info else "?", exc)
            errors.append(SampleError("gpu", exc.error, index, message=str(exc)))
            known = self._last_known.get(index)
            if exc.uuid and known is not None and known.uuid != exc.uuid:
                known = None  # another GPU now answers at this index
            return Gpu(
                index=index,
                uuid=exc.uuid or (known.uuid if known else ""),
                up=False,
                info=known,
                error=str(exc),
            )
        errors.extend(reading.errors)
        if reading.processes is None:
            return reading.gpu
        processes = self._enrich(info.uuid, reading.processes, seen, now, reading.gpu.mig_devices)
        return replace(reading.gpu, processes=processes)

    def _enrich(
        self,
        uuid: str,
        listed: list[NvmlProcess],
        seen: dict[int, ProcessInfo | None],
        now: float,
        mig_devices: tuple[MigDevice, ...] = (),
    ) -> tuple[GpuProcess, ...]:
        merged: dict[tuple[int, str], int | None] = {}
        for proc in listed:  # one entry per (pid, type): MIG lists a pid once per instance
            key = (proc.pid, proc.type)
            if key in merged and merged[key] is not None and proc.used_memory_bytes is not None:
                merged[key] = merged[key] + proc.used_memory_bytes  # type: ignore[operator]
            elif key not in merged:
                merged[key] = proc.used_memory_bytes
        utilization = {proc.pid: proc.utilization for proc in listed}  # one per pid
        on_mig = process_devices(listed, mig_devices) if mig_devices else {}
        if mig_devices:  # no per-process utilization in MIG mode: the device's, if alone
            utilization = {**utilization, **device_utilization(on_mig, mig_devices)}
        out = []
        for (pid, kind), used in merged.items():
            if pid not in seen:
                seen[pid] = self.procfs.process(pid, keep=True)
            known = seen[pid]
            usage = utilization.get(pid, UNKNOWN_UTILIZATION)
            start = known.start_ticks if known is not None else 0
            idle = self._idle.observe((uuid, pid, start), usage.sm, now)
            out.append(
                to_gpu_process(
                    pid,
                    kind,
                    used,
                    known,
                    self.expose_cmdline,
                    usage,
                    gpu_idle_seconds=idle,
                    mig_uuids=on_mig.get(pid, ()),
                )
            )
        return tuple(out)


def to_gpu_process(
    pid: int,
    kind: str,
    used: int | None,
    info: ProcessInfo | None,
    cmdline: bool = False,
    utilization: ProcessUtilization = UNKNOWN_UTILIZATION,
    gpu_idle_seconds: float | None = None,
    mig_uuids: tuple[str, ...] = (),
) -> GpuProcess:
    """A Snapshot process from NVML's view (memory, utilization) and procfs' (None: not visible
    under the root); its command line only when ``cmdline``. A sample makes one per GPU
    process: its fields are given in their order (test_to_gpu_process_fills_every_field_by_name
    holds this to the names): some 15 % less than by keyword, and no dict to build."""
    sm, memory, encoder, decoder = utilization
    if info is None:
        return GpuProcess(
            pid, kind, used, False, "", "", None, (), "", None, None, None, None, "", "", "", "",
            "", "", "", False, "", sm, memory, encoder, decoder, mig_uuids, gpu_idle_seconds,
        )  # fmt: skip
    return GpuProcess(
        pid, kind, used, True, info.name, info.user, info.uid,
        info.cmdline if cmdline else (), info.state, info.ppid, info.pgid, info.sid,
        info.start_time, info.container_id, info.pod_uid, info.slurm_job, info.slurm_step,
        "", "", "", False, info.script, sm, memory, encoder, decoder, mig_uuids, gpu_idle_seconds,
    )  # fmt: skip
