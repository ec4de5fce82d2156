"""Who holds each GPU: its allocations and the owner of each of its processes.

Allocations come from what the node knows: the kubelet's pod-resources API (a container per
device), a prolog's job-mapping directory (a Slurm job per GPU), else a GPU whose processes all
run in one Slurm job's cgroup.

A process's Slurm job is in its cgroup (procfs). Its pod is known by UID from its cgroup, but
the kubelet names pods, not UIDs: a UID is named by the one pod a GPU it runs on is allocated
to (time-sliced GPUs shared by several pods name none), and a container ID by the one container
likewise. Once named, the UID names the pod's processes on every GPU, including those it was not
given.

A process is *outside its allocation* when its job or pod was given GPUs, but not the one (or
the MIG device) it runs on; or when it runs on a GPU given only to other jobs or pods. Nothing
is judged without an answer from the kubelet or the job-mapping directory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from exporter.core.kubelet import PodDevice
from exporter.core.snapshot import Allocation, Gpu, GpuProcess

#: Whose an allocation is: ("slurm", job) or ("pod", namespace, pod).
Owner = tuple[str, ...]
#: Where a process runs, or what an allocation covers: (GPU uuid, MIG uuid or "" for the GPU).
Place = tuple[str, str]


def attribute(
    gpus: tuple[Gpu, ...],
    jobs: Mapping[str, tuple[str, ...]] | None,
    pods: tuple[PodDevice, ...] | None,
) -> tuple[Gpu, ...]:
    """``gpus`` with their allocations and their processes' owners.

    ``jobs``: the job-mapping directory (GPU index or UUID -> jobs), ``pods``: the kubelet's
    devices; None for a source that is off or did not answer.
    """
    placed = _place(gpus, pods or ())
    gpus = tuple(_with_allocations(gpu, jobs or {}, placed.get(gpu.uuid, ())) for gpu in gpus)
    uids, containers = _pod_names(gpus)
    known = jobs is not None or pods is not None
    given = _given(gpus)
    named = set(uids.values())
    return tuple(_with_owners(gpu, uids, containers, given, named, known) for gpu in gpus)


def _place(gpus: Iterable[Gpu], pods: Iterable[PodDevice]) -> dict[str, list[Allocation]]:
    """The kubelet's devices as allocations, by GPU uuid. Device IDs are GPU or MIG UUIDs,
    ``MIG-GPU-<uuid>/<gi>/<ci>`` (older device plugins), or GPU indices."""
    targets: dict[str, Place] = {}
    for gpu in gpus:
        targets[gpu.uuid] = targets[str(gpu.index)] = (gpu.uuid, "")
        for device in gpu.mig_devices:
            targets[device.uuid] = (gpu.uuid, device.uuid)
            key = f"MIG-{gpu.uuid}/{device.gpu_instance}/{device.compute_instance}"
            targets[key] = (gpu.uuid, device.uuid)
    found: dict[str, list[Allocation]] = {}
    for one in pods:
        target = targets.get(one.device)
        if target is not None:
            allocation = Allocation(
                mig_uuid=target[1],
                source="kubelet",
                namespace=one.namespace,
                pod=one.pod,
                container=one.container,
            )
            found.setdefault(target[0], []).append(allocation)
    return found


def _with_allocations(
    gpu: Gpu, jobs: Mapping[str, tuple[str, ...]], from_kubelet: Iterable[Allocation]
) -> Gpu:
    """``gpu`` with its allocations: the job-mapping directory's and the kubelet's, else the
    one Slurm job whose cgroup holds all of its processes."""
    found = [
        Allocation(job)
        for key in dict.fromkeys((str(gpu.index), gpu.uuid))
        for job in jobs.get(key, ())
    ]
    found += [Allocation(job, d.uuid) for d in gpu.mig_devices for job in jobs.get(d.uuid, ())]
    found += from_kubelet
    if not found and gpu.processes:
        owners = {p.slurm_job for p in gpu.processes}
        if len(owners) == 1 and "" not in owners:
            found = [Allocation(owners.pop(), source="processes")]
    return replace(gpu, allocations=tuple(dict.fromkeys(found))) if found else gpu


def _places(gpu: Gpu, process: GpuProcess) -> tuple[Place, ...]:
    return tuple((gpu.uuid, m) for m in process.mig_uuids) or ((gpu.uuid, ""),)


def _covering(gpu: Gpu, process: GpuProcess) -> list[Allocation]:
    """The allocations of ``gpu`` that cover where ``process`` runs."""
    places = {m for _, m in _places(gpu, process)}
    return [a for a in gpu.allocations if not a.mig_uuid or a.mig_uuid in places]


def _covers(gpu: Gpu, process: GpuProcess, places: set[Place]) -> bool:
    """Whether ``places`` cover where ``process`` runs: its GPU, or its MIG device (any of the
    GPU's when NVML did not say which)."""
    if (gpu.uuid, "") in places:
        return True
    if gpu.mig_devices and not process.mig_uuids:
        return any(uuid == gpu.uuid for uuid, _ in places)
    return bool(set(_places(gpu, process)) & places)


def _pod_names(gpus: Iterable[Gpu]) -> tuple[dict[str, Owner], dict[str, Allocation]]:
    """Pod UID -> (``pod``, namespace, pod) and container ID -> its kubelet allocation, for
    those the allocations name without doubt.

    Where a GPU (or MIG device) is allocated to pods that are not named yet and runs processes
    of UIDs that are not named yet, one of each names the UID; repeated until nothing changes,
    so a UID named on its own GPU is no candidate on another GPU it runs on."""
    seen: dict[tuple[Place, ...], tuple[set[Owner], set[str]]] = {}
    for gpu in gpus:
        for process in gpu.processes or ():
            if not process.pod_uid:
                continue
            pods = _pods_covering(gpu, process)
            if pods:
                place = seen.setdefault(_places(gpu, process), (pods, set()))
                place[1].add(process.pod_uid)
    uids: dict[str, Owner] = {}
    changed = True
    while changed:
        changed = False
        taken = set(uids.values())
        for pods, here in seen.values():
            left_uids, left_pods = here - uids.keys(), pods - taken
            if len(left_uids) == 1 and len(left_pods) == 1:
                uid, pod = next(iter(left_uids)), next(iter(left_pods))
                uids[uid] = pod
                taken.add(pod)
                changed = True
    containers: dict[str, set[Allocation]] = {}
    for gpu in gpus if uids else ():
        for process in gpu.processes or ():
            owner = uids.get(process.pod_uid)
            if owner is None or not process.container_id:
                continue
            mine = {
                replace(a, mig_uuid="")
                for a in _covering(gpu, process)
                if a.source == "kubelet" and ("pod", a.namespace, a.pod) == owner
            }
            if len(mine) == 1:
                containers.setdefault(process.container_id, set()).update(mine)
    return uids, {cid: next(iter(s)) for cid, s in containers.items() if len(s) == 1}


def _pods_covering(gpu: Gpu, process: GpuProcess) -> set[Owner]:
    """The pods the kubelet gave where ``process`` runs."""
    return {("pod", a.namespace, a.pod) for a in _covering(gpu, process) if a.source == "kubelet"}


def _owner(allocation: Allocation) -> Owner | None:
    if allocation.source == "processes":
        return None  # inferred from the processes: no evidence of what was given
    if allocation.pod:
        return ("pod", allocation.namespace, allocation.pod)
    return ("slurm", allocation.slurm_job)


def _given(gpus: Iterable[Gpu]) -> dict[Owner, set[Place]]:
    """What each job and pod was given."""
    given: dict[Owner, set[Place]] = {}
    for gpu in gpus:
        for allocation in gpu.allocations:
            owner = _owner(allocation)
            if owner is not None:
                given.setdefault(owner, set()).add((gpu.uuid, allocation.mig_uuid))
    return given


def _with_owners(
    gpu: Gpu,
    uids: Mapping[str, Owner],
    containers: Mapping[str, Allocation],
    given: Mapping[Owner, set[Place]],
    named: set[Owner],
    known: bool,
) -> Gpu:
    if not gpu.processes:
        return replace(gpu, allocations_known=known) if known else gpu
    processes = []
    changed = known != gpu.allocations_known
    for original in gpu.processes:
        process = original
        pod = uids.get(process.pod_uid) if process.pod_uid else None
        if pod is not None:
            container = containers.get(process.container_id)
            same = container is not None and (container.namespace, container.pod) == pod[1:]
            process = replace(
                process,
                namespace=pod[1],
                pod=pod[2],
                container=container.container if same and container else "",
            )
        if known:
            outside = _outside(gpu, process, pod, given, named)
            if outside != process.outside_allocation:
                process = replace(process, outside_allocation=outside)
        changed = changed or process is not original
        processes.append(process)
    if not changed:  # the common case: nothing to name (one Gpu less made each sample)
        return gpu
    return replace(gpu, processes=tuple(processes), allocations_known=known)


def _outside(
    gpu: Gpu,
    process: GpuProcess,
    pod: Owner | None,
    given: Mapping[Owner, set[Place]],
    named: set[Owner],
) -> bool:
    """Whether ``process`` runs where neither its job nor its pod was given anything."""
    owners = [o for o in (pod, ("slurm", process.slurm_job) if process.slurm_job else None) if o]
    mine = [given[o] for o in owners if o in given]
    if mine:
        return not any(_covers(gpu, process, places) for places in mine)
    if process.pod_uid and pod is None:
        # a pod not named: outside where every pod given this GPU is named, by another UID
        pods = _pods_covering(gpu, process)
        if pods and pods <= named:
            return True
    # given nothing known: outside when this GPU is given to other jobs or pods of its kind
    kinds = {owner[0] for owner in owners}
    return any(
        (o := _owner(a)) is not None and o[0] in kinds and o not in owners
        for a in _covering(gpu, process)
    )
