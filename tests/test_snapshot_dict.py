"""``Snapshot.from_dict``: the exact inverse of ``to_dict`` on Snapshots of simulated hosts
(processes, MIG, XIDs, allocations, failed readings, a lost GPU, no NVML), tolerant of what
``/snapshot`` adds, and a ValueError naming the key on a malformed document."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.core.snapshot import Allocation, Gpu, GpuProcess, HostInfo, Snapshot
from exporter.core.xid import XidEvent, XidLog
from exporter.sampling.collect import Collector
from exporter.sampling.events import XidWatcher
from tests.helpers import until
from tests.test_mig import LAYOUT, A

BUILTIN = (Path(__file__).parent.parent / "exporter/scenarios/builtin.yaml").read_text()
FAILING = """
driver: {version: "535.104.05", cuda_version: "12.2"}
gpus:
  - name: NVIDIA A100-SXM4-80GB
    errors:
      - {field: power, error: Timeout}
      - {field: temperature, error: Unknown}
    processes: [{pid: 1, memory: 1GiB}]
  - errors: [{error: GpuIsLost}]
  - {}
"""


def assert_round_trip(snapshot: Snapshot) -> dict[str, Any]:
    """from_dict(to_dict) is the Snapshot again, through JSON too; the document."""
    document = snapshot.to_dict()
    assert Snapshot.from_dict(document) == snapshot
    assert Snapshot.from_dict(document).to_dict() == document
    through_json = json.loads(json.dumps(document))
    assert Snapshot.from_dict(through_json).to_dict() == document
    return document


def test_the_builtin_scenario_round_trips_processes_nvlink_gpm_and_all(simulated, collector, clock):
    simulated(BUILTIN)
    collector.sample()
    clock.advance(400)  # the RTX 4090's XID time, GPU 1 hot and throttling
    snapshot = collector.sample()
    document = assert_round_trip(snapshot)
    assert any(gpu.processes for gpu in snapshot.gpus)
    assert any(gpu.nvlink for gpu in snapshot.gpus) and any(gpu.fields for gpu in snapshot.gpus)
    assert document["gpus"][0]["info"]["temperature_thresholds"]


def test_mig_devices_and_their_processes_round_trip(simulated, collector, clock):
    simulated(LAYOUT)
    snapshot = collector.sample()
    assert snapshot.gpus[0].mig_devices and snapshot.gpus[0].info.mig_uuids
    assert any(A in proc.mig_uuids for proc in snapshot.gpus[0].processes)
    assert_round_trip(snapshot)


def test_xids_with_their_mig_instances_round_trip(simulated, clock):
    simulated(LAYOUT.replace("  - {}\n", "  - {xids: [{at: 2s, code: 79}]}\n"))
    nvml = Nvml(library=simulated.library)
    watcher = XidWatcher(nvml, XidLog(), timeout_ms=200, backoff_initial=0.05)
    collector = Collector(nvml, ProcFs(), monotonic=clock, xids=watcher)
    watcher.start()
    try:
        until(lambda: collector.sample().gpus[1].xid_events_supported, "registration")
        clock.advance(5)
        snapshot = until(lambda: (s := collector.sample()).gpus[1].xids and s, "the XID")
    finally:
        assert watcher.stop(2.0)
        collector.close()
    assert dict(snapshot.gpus[1].xid_counts) == {79: 1}
    assert_round_trip(snapshot)
    on_mig = dataclasses.replace(
        snapshot.gpus[0],
        xids=(XidEvent(1.7e9, 13, "restart_app", "GRAPHICS_ENGINE_EXCEPTION", 1, 0),),
        xid_counts={13: 1},
    )
    again = Snapshot.from_dict(dataclasses.replace(snapshot, gpus=(on_mig,)).to_dict())
    assert again.gpus[0].xids[0].gpu_instance == 1 and again.gpus[0].xid_counts == {13: 1}


def test_allocations_and_their_owners_round_trip(simulated, clock, tmp_path):
    simulated("gpus: [{processes: [{pid: 1, memory: 1GiB}]}, {}]\n")
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "0").write_text("4242 1000\n")
    collector = Collector(
        Nvml(library=simulated.library), ProcFs(), monotonic=clock, slurm_job_dir=str(jobs)
    )
    try:
        snapshot = collector.sample()
    finally:
        collector.close()
    assert snapshot.gpus[0].allocations == (Allocation("4242"),)
    assert snapshot.gpus[0].allocations_known
    assert_round_trip(snapshot)
    gpu = snapshot.gpus[1]
    pod = Allocation(source="kubelet", namespace="ml", pod="train-0", container="trainer")
    owned = GpuProcess(
        7, "compute", 1 << 30, True, name="python3", uid=1000, cmdline=("python3", "train.py"),
        slurm_job="77", slurm_step="batch", namespace="ml", pod="train-0", container="trainer",
        outside_allocation=True, sm_utilization_ratio=0.5, gpu_idle_seconds=12.5,
    )  # fmt: skip
    dressed = dataclasses.replace(
        gpu,
        allocations=(pod, Allocation("9", mig_uuid=A)),
        processes=(owned,),
        reserved_by=4242,
        reserved_by_user="bob",
    )
    assert_round_trip(dataclasses.replace(snapshot, gpus=(snapshot.gpus[0], dressed)))


def test_failed_readings_a_lost_gpu_and_no_nvml_round_trip(simulated, collector):
    simulated(FAILING)
    snapshot = collector.sample()
    assert snapshot.errors and not snapshot.gpus[1].up and snapshot.gpus[1].error
    assert snapshot.gpus[0].temperature_celsius is None
    assert_round_trip(snapshot)
    assert_round_trip(snapshot.without_processes())
    down = Snapshot(3, 1.7e9, 5.0, 0.0, False, HostInfo("h"), nvml_error="DriverNotLoaded")
    assert_round_trip(down)


def test_what_snapshot_adds_is_ignored_and_defaults_fill_what_is_missing(simulated, collector):
    simulated("gpus: [{processes: [{pid: 1, memory: 1GiB}]}]\n")
    snapshot = collector.sample()
    document = snapshot.to_dict()
    served = copy.deepcopy(document)  # as web/routes.py's /snapshot serves it
    served["health"] = {"ok": True, "reason": "", "stale": False}
    served["gpus"][0]["health"] = {"verdict": "ok", "level": 0, "checks": {}}
    served["gpus"][0]["waste"] = None
    served["gpus"][0]["processes"][0]["reaper"] = {"class": None, "decision": None}
    served["gpus"][0]["processes"][0]["waste"] = None
    assert Snapshot.from_dict(served) == snapshot
    minimal = {
        "seq": 1,
        "timestamp": 1.7e9,
        "monotonic": 1.0,
        "duration_seconds": 0.01,
        "nvml_up": True,
        "host": {"hostname": "h"},
        "gpus": [{"index": 0, "uuid": "GPU-0", "up": True}],
    }
    assert Snapshot.from_dict(minimal) == Snapshot(
        1, 1.7e9, 1.0, 0.01, True, HostInfo("h"), (Gpu(0, "GPU-0", True),)
    )


#: One GPU with readings, an XID count and a process: what the malformed cases change.
VALID = Snapshot(
    1,
    1.7e9,
    1.0,
    0.01,
    True,
    HostInfo("h"),
    (
        Gpu(
            0,
            "GPU-0",
            True,
            fields={"power": 100.0},
            xid_counts={13: 1},
            processes=(GpuProcess(42, "compute", 1 << 30, True),),
        ),
    ),
)
GONE = object()  # the key removed
G, P = ("gpus", 0), ("gpus", 0, "processes", 0)


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        (("host",), GONE, "missing required key 'host'"),
        (("seq",), "1", "seq: expected an integer, got '1'"),
        (("nvml_up",), 1, "nvml_up: expected true or false, got 1"),
        (("timestamp",), None, "timestamp: expected a number, got null"),
        (("host",), "h", "host: expected an object, got 'h'"),
        (("gpus",), {}, "gpus: expected a list, got an object"),
        (("gpus",), [1], "gpus[0]: expected an object, got 1"),
        ((*G, "uuid"), GONE, "gpus[0]: missing required key 'uuid'"),
        ((*G, "temperature_celsius"), "hot", "gpus[0].temperature_celsius: expected a number"),
        ((*G, "utilization_ratio"), True, "gpus[0].utilization_ratio: expected a number or null"),
        ((*G, "fields", "power"), "100", "gpus[0].fields.power: expected a number, got '100'"),
        ((*G, "xid_counts"), {"x": 1}, "gpus[0].xid_counts: expected integer keys, got 'x'"),
        ((*G, "xid_counts"), {" 13": 1}, "gpus[0].xid_counts: expected integer keys"),
        ((*G, "nvlink"), {"0": {"nvlink_up": "yes"}}, "gpus[0].nvlink.0.nvlink_up: expected"),
        ((*G, "nvlink"), [], "gpus[0].nvlink: expected an object, got a list"),
        ((*G, "xids"), [{"xid": 13}], "gpus[0].xids[0]: missing required key 'timestamp'"),
        ((*G, "processes"), {}, "gpus[0].processes: expected a list or null, got an object"),
        ((*P, "pid"), True, "gpus[0].processes[0].pid: expected an integer, got True"),
        ((*P, "cmdline"), "python", "gpus[0].processes[0].cmdline: expected a list"),
        ((*P, "cmdline"), [1], "gpus[0].processes[0].cmdline[0]: expected a string, got 1"),
        ((*G, "info"), {"index": 0}, "gpus[0].info: missing required key 'uuid'"),
        (("errors",), [{"source": "gpu"}], "errors[0]: missing required key 'error'"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_a_malformed_document_says_which_key_is_wrong(where: tuple, value: Any, message: str):
    document = VALID.to_dict()
    *path, last = where
    target: Any = document
    for step in path:
        target = target[step]
    if value is GONE:
        del target[last]
    else:
        target[last] = value
    with pytest.raises(ValueError) as raised:
        Snapshot.from_dict(document)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("document", [None, [], "{}", 1])
def test_a_document_that_is_no_object_is_refused(document: Any):
    with pytest.raises(ValueError, match="the document: expected an object"):
        Snapshot.from_dict(document)


def test_the_nested_types_decode_alone():
    proc = GpuProcess(42, "compute", None, False, cmdline=("python3",), mig_uuids=(A,))
    assert GpuProcess.from_dict(json.loads(json.dumps(dataclasses.asdict(proc)))) == proc
    assert Allocation.from_dict({"slurm_job": "5", "extra": 1}) == Allocation("5")
    with pytest.raises(ValueError, match="missing required key 'visible'"):
        GpuProcess.from_dict({"pid": 1, "type": "compute", "used_memory_bytes": None})
