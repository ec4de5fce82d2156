"""Kubernetes attribution: the kubelet's pod-resources API (exporter/core/kubelet.py) read from a
fake kubelet, a real gRPC server on a temporary unix socket (tests/kubelet.py); who each GPU and
process belongs to (exporter/sampling/owners.py); a kubelet that is missing, hangs, refuses or
answers garbage: attribution absent, said once, counted, and sampling goes on."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest

from exporter.core.kubelet import PodDevice, PodResourcesClient, resource_names
from exporter.core.nvml import Nvml
from exporter.core.podresources import api_pb2
from exporter.core.procfs import ProcFs
from exporter.core.snapshot import Allocation
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.stats import SelfStats
from tests.agent import healthz_until, http_get, logged_until, serve
from tests.helpers import samples, until
from tests.kubelet import fake_kubelet, raw_socket
from tests.test_procfs import FakeProc

G0, G1 = "GPU-00000000-1111-4000-8000-000000000000", "GPU-11111111-1111-4000-8000-000000000001"
G2 = "GPU-22222222-1111-4000-8000-000000000002"
MIG_A, MIG_B = "MIG-aaaaaaaa-0000-4000-8000-000000000001", "MIG-bbbbbbbb-0000-4000-8000-00000000002"
POD_A, POD_B = "0b3e6f0e-1c2d-4e5f-8a9b-000000000001", "0b3e6f0e-1c2d-4e5f-8a9b-000000000002"
POD_C = "0b3e6f0e-1c2d-4e5f-8a9b-000000000003"
CONTAINER_A = "a" * 64


def _client(path: str, timeout: float = 1.0, resources: tuple[str, ...] = ()) -> PodResourcesClient:
    return PodResourcesClient(path, resources, timeout)


def _read(client: PodResourcesClient):
    client.begin()
    return client.finish()


# -- the API ------------------------------------------------------------------------------------


def test_the_devices_of_gpu_resources_and_of_names_added_in_config(tmp_path):
    pods = [
        ("ml", "train-0", "trainer", "nvidia.com/gpu", [G0, G1]),
        ("ml", "train-0", "sidecar", "example.com/nic", ["eth9"]),  # not a GPU resource
        ("web", "infer", "server", "nvidia.com/gpu.shared", [f"{G2}::0", f"{G2}::3"]),
        ("web", "small", "app", "nvidia.com/mig-1g.10gb", [MIG_A]),
        ("lab", "x", "y", "example.com/gpu", ["7"]),
    ]
    with fake_kubelet(tmp_path, pods) as kubelet:
        client = _client(kubelet.path, resources=resource_names("example.com/gpu"))
        try:
            found = _read(client)
        finally:
            client.close()
    assert found is not None and found.problem == ""
    assert found.devices == (
        PodDevice("ml", "train-0", "trainer", "nvidia.com/gpu", G0),
        PodDevice("ml", "train-0", "trainer", "nvidia.com/gpu", G1),
        PodDevice("web", "infer", "server", "nvidia.com/gpu.shared", G2),  # replicas: one GPU
        PodDevice("web", "small", "app", "nvidia.com/mig-1g.10gb", MIG_A),
        PodDevice("lab", "x", "y", "example.com/gpu", "7"),
    )


def test_no_socket_is_not_a_kubernetes_node_and_no_error(tmp_path):
    client = _client(str(tmp_path / "kubelet.sock"))
    assert _read(client) is None


@pytest.mark.parametrize("value", ["nvidia.com", "a b/c", "/gpu", "x/y/z", "nvidia.com/*gpu"])
def test_bad_resource_names_are_refused(value):
    with pytest.raises(ValueError, match="not a resource name"):
        resource_names(value)


def test_a_path_that_is_not_a_socket(tmp_path):
    path = tmp_path / "kubelet.sock"
    path.write_text("")
    found = _read(_client(str(path)))
    assert found is not None and found.devices == ()
    assert found.problem == f"{path} is not a socket"


def test_a_hung_kubelet_costs_at_most_the_timeout(tmp_path):
    with fake_kubelet(tmp_path) as kubelet:
        kubelet.mode = "hang"
        client = _client(kubelet.path, timeout=0.3)
        try:
            started = time.monotonic()
            found = _read(client)
            took = time.monotonic() - started
        finally:
            client.close()
    assert found is not None and "DEADLINE_EXCEEDED" in found.problem, found
    assert took < 0.3 + 0.5, took


@pytest.mark.parametrize("mode", ["error", "garbage"])
def test_a_kubelet_that_refuses_or_answers_garbage(tmp_path, mode):
    with fake_kubelet(tmp_path, [("a", "b", "c", "nvidia.com/gpu", [G0])]) as kubelet:
        kubelet.mode = mode
        client = _client(kubelet.path)
        try:
            found = _read(client)
            assert found is not None and found.devices == ()
            why = {"error": "UNAVAILABLE: kubelet is restarting", "garbage": "INTERNAL"}[mode]
            assert why in found.problem, found.problem
            kubelet.mode = "ok"  # the same client reads it once it answers
            assert _read(client).devices[0].device == G0
        finally:
            client.close()


def test_a_socket_that_speaks_no_grpc(tmp_path):
    with raw_socket(tmp_path, b"HTTP/1.1 400 Bad Request\r\n\r\n") as path:
        client = _client(path, timeout=0.5)
        try:
            found = _read(client)
        finally:
            client.close()
    assert found is not None and found.devices == () and found.problem.startswith(path)


def test_a_restarted_kubelet_is_found_again(tmp_path):
    client = _client(str(tmp_path / "kubelet.sock"), timeout=0.5)
    try:
        with fake_kubelet(tmp_path, [("a", "b", "c", "nvidia.com/gpu", [G0])]):
            assert _read(client).devices
        assert _read(client) is None  # the socket is gone with it: off
        with fake_kubelet(tmp_path, [("a", "b", "c", "nvidia.com/gpu", [G1])]):
            until(
                lambda: (found := _read(client)) is not None and found.devices != (),
                "the new kubelet to answer",
                timeout=10,
            )
            assert _read(client).devices[0].device == G1
    finally:
        client.close()


def test_the_generated_code_is_the_committed_proto():
    """api_pb2.py was generated from api.proto: every message has the proto's fields, numbered
    as there (regenerate.sh makes both agree again)."""
    proto = (Path(api_pb2.__file__).parent / "api.proto").read_text()
    proto = re.sub(r"//.*", "", proto)
    declared: dict[str, dict[str, int]] = {}
    for name, body in re.findall(r"message (\w+) \{([^}]*)\}", proto):
        fields = re.findall(r"(\w+) = (\d+);", body)
        declared[name] = {field: int(number) for field, number in fields}
    generated = {
        name: {f.name: f.number for f in message.fields}
        for name, message in api_pb2.DESCRIPTOR.message_types_by_name.items()
    }
    assert generated == declared
    (service,) = api_pb2.DESCRIPTOR.services_by_name.values()
    assert service.full_name == "v1.PodResourcesLister"
    assert {m.name for m in service.methods} == set(re.findall(r"rpc (\w+)\(", proto))


# -- who holds the GPUs --------------------------------------------------------------------------


SCENARIO = f"""
gpus:
  - uuid: {G0}
    processes: [{{pid: 5001}}]
  - uuid: {G1}
    processes: [{{pid: 5003}}, {{pid: 5005}}]
  - uuid: {G2}
    processes: [{{pid: 5004}}, {{pid: 5002}}]
"""


def _pod_process(fake: FakeProc, pid: int, pod: str, container: str) -> None:
    cgroup = f"0::/kubepods/besteffort/pod{pod}/{container}\n".encode()
    fake.add(pid, cgroup=cgroup)


def _collector(simulated, clock, proc: Path, kubelet: str, timeout: float = 1.0) -> Collector:
    return Collector(
        Nvml(library=simulated.library),
        ProcFs(str(proc)),
        monotonic=clock,
        kubelet=_client(kubelet, timeout),
    )


def _procs(tmp_path: Path) -> FakeProc:
    (tmp_path / "proc").mkdir()
    fake = FakeProc(tmp_path / "proc")
    _pod_process(fake, 5001, POD_A, CONTAINER_A)
    _pod_process(fake, 5002, POD_B, "b" * 64)
    _pod_process(fake, 5003, POD_A, CONTAINER_A)  # pod A on a GPU it was not given
    fake.add(5004)  # a process of no pod
    _pod_process(fake, 5005, POD_C, "c" * 64)
    return fake


def test_gpus_and_processes_are_named_by_pod_and_container(simulated, clock, tmp_path):
    fake = _procs(tmp_path)
    simulated(SCENARIO)
    pods = [
        ("ml", "train-0", "trainer", "nvidia.com/gpu", [G0]),
        ("ml", "train-0", "logger", "nvidia.com/gpu", [f"{G2}::1"]),
        ("web", "infer", "server", "nvidia.com/gpu", [G1]),
    ]
    with fake_kubelet(tmp_path, pods):
        collector = _collector(simulated, clock, fake.root, str(tmp_path / "kubelet.sock"))
        try:
            snap = collector.sample()
        finally:
            collector.close()
    assert snap.errors == ()
    gpu0, _gpu1, gpu2 = snap.gpus
    assert gpu0.allocations == (Allocation("", "", "kubelet", "ml", "train-0", "trainer"),)
    assert gpu2.allocations == (Allocation("", "", "kubelet", "ml", "train-0", "logger"),)
    owners = {(p.pid, p.namespace, p.pod, p.container) for g in snap.gpus for p in g.processes}
    assert owners == {
        (5001, "ml", "train-0", "trainer"),  # the one UID on the GPU its pod was given
        (5003, "ml", "train-0", "trainer"),  # named by its UID on another GPU
        (5005, "web", "infer", "server"),  # the UID left on web/infer's GPU once A is named
        (5002, "", "", ""),  # pod B was given nothing the kubelet lists: not named
        (5004, "", "", ""),  # not in a pod
    }
    outside = {(g.index, p.pid) for g in snap.gpus for p in g.processes if p.outside_allocation}
    # pod train-0 on web/infer's GPU; pod B on train-0's, whose UID is another
    assert outside == {(1, 5003), (2, 5002)}

    found = samples(render(snap, SelfStats(5)))
    assert _labels(found["gpu_allocation_info"], "gpu", "namespace", "pod", "container") == {
        ("0", "ml", "train-0", "trainer"),
        ("1", "web", "infer", "server"),
        ("2", "ml", "train-0", "logger"),
    }
    assert _labels(found["gpu_process_owner_info"], "gpu", "pid", "pod", "container") == {
        ("0", "5001", "train-0", "trainer"),
        ("1", "5003", "train-0", "trainer"),
        ("1", "5005", "infer", "server"),
    }
    assert {s.labels["gpu"]: s.value for s in found["gpu_processes_outside_allocation"]} == {
        "0": 0,
        "1": 1,
        "2": 1,
    }


def _labels(series: list, *names: str) -> set[tuple[str, ...]]:
    return {tuple(s.labels[name] for name in names) for s in series}


def test_a_gpu_shared_by_pods_names_none_of_its_processes(simulated, clock, tmp_path):
    fake = _procs(tmp_path)
    simulated(SCENARIO)
    pods = [
        ("ml", "a", "c", "nvidia.com/gpu.shared", [f"{G1}::0"]),
        ("ml", "b", "c", "nvidia.com/gpu.shared", [f"{G1}::1"]),
    ]
    with fake_kubelet(tmp_path, pods):
        collector = _collector(simulated, clock, fake.root, str(tmp_path / "kubelet.sock"))
        try:
            gpu1 = collector.sample().gpus[1]
        finally:
            collector.close()
    assert {a.pod for a in gpu1.allocations} == {"a", "b"}
    assert [(p.pod, p.outside_allocation) for p in gpu1.processes] == [("", False), ("", False)]


def test_mig_devices_by_uuid_and_by_the_older_plugins_name(simulated, clock, tmp_path):
    fake = _procs(tmp_path)
    simulated(
        f"""
        gpus:
          - uuid: {G0}
            mig_devices:
              - {{uuid: {MIG_A}, profile: 3g.40gb, gpu_instance: 1, compute_instance: 0}}
              - {{uuid: {MIG_B}, profile: 1g.10gb, gpu_instance: 9, compute_instance: 0}}
            processes: [{{pid: 5001, mig: {MIG_A}}}, {{pid: 5003, mig: {MIG_B}}}]
        """
    )
    pods = [
        ("ml", "big", "c", "nvidia.com/mig-3g.40gb", [MIG_A]),
        ("ml", "small", "c", "nvidia.com/mig-1g.10gb", [f"MIG-{G0}/9/0"]),
    ]
    with fake_kubelet(tmp_path, pods):
        collector = _collector(simulated, clock, fake.root, str(tmp_path / "kubelet.sock"))
        try:
            gpu = collector.sample().gpus[0]
        finally:
            collector.close()
    assert {(a.mig_uuid, a.pod) for a in gpu.allocations} == {(MIG_A, "big"), (MIG_B, "small")}
    # pod A's UID is named "big" by its process on MIG_A; its process on MIG_B is outside.
    assert [(p.pid, p.pod, p.outside_allocation) for p in gpu.processes] == [
        (5001, "big", False),
        (5003, "big", True),
    ]


def test_a_broken_kubelet_is_counted_said_once_and_sampling_goes_on(
    simulated, clock, tmp_path, caplog
):
    fake = _procs(tmp_path)
    simulated(SCENARIO)
    caplog.set_level(logging.INFO)
    with fake_kubelet(tmp_path, [("ml", "a", "c", "nvidia.com/gpu", [G0])]) as kubelet:
        kubelet.mode = "hang"
        collector = _collector(simulated, clock, fake.root, kubelet.path, timeout=0.2)
        try:
            for _ in range(3):
                snap = collector.sample()
                assert all(g.up and g.processes for g in snap.gpus)
                assert all(g.allocations == () and not g.allocations_known for g in snap.gpus)
                assert [(e.source, e.error) for e in snap.errors] == [("kubelet", "PodResources")]
            kubelet.mode = "ok"
            snap = collector.sample()
        finally:
            collector.close()
    assert snap.errors == () and snap.gpus[0].allocations[0].pod == "a"
    said = [r.getMessage() for r in caplog.records if "Kubelet pod resources" in r.getMessage()]
    assert len(said) == 2 and "DEADLINE_EXCEEDED" in said[0] and "read again" in said[1], said
    found = samples(render(snap, SelfStats(5)))
    assert "gpu_processes_outside_allocation" in found


# -- the agent ---------------------------------------------------------------------------------


def test_the_agent_names_pods_and_a_hung_kubelet_never_stalls_it(tmp_path):
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(f"gpus:\n  - uuid: {G0}\n  - uuid: {G1}\n")
    pods = [("ml", "train-0", "trainer", "nvidia.com/gpu", ["1"])]  # by index
    with (
        fake_kubelet(tmp_path, pods) as kubelet,
        serve(
            tmp_path,
            "--simulate",
            str(scenario),
            "--interval",
            "0.2s",
            "--kubelet-socket",
            kubelet.path,
        ) as (agent, port),
    ):
        healthz_until(agent, port)

        def metrics() -> dict:
            return samples(http_get(f"http://127.0.0.1:{port}/metrics")[1].encode())

        until(lambda: "gpu_allocation_info" in metrics(), "the kubelet's allocation")
        (info,) = metrics()["gpu_allocation_info"]
        assert (info.labels["uuid"], info.labels["pod"], info.labels["container"]) == (
            G1,
            "train-0",
            "trainer",
        )
        kubelet.mode = "hang"

        def kubelet_errors() -> float:
            found = metrics().get("gpu_exporter_sample_errors_total", [])
            return sum(s.value for s in found if s.labels["source"] == "kubelet")

        until(lambda: kubelet_errors() >= 3, "samples that counted the hung kubelet")
        assert "gpu_allocation_info" not in metrics()
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200  # every sample on time
        log = logged_until(agent, "Kubelet pod resources: ")
        assert log.count("Kubelet pod resources: ") == 1, log
