"""The waste action (exporter/actions/waste.py): idle holders with a noise floor and GPM's SM
activity, allocated-but-idle GPUs, memory held by no live process, leak suspects, each logged
once per transition, in its metrics and in /snapshot; and its settings' bounds."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

from exporter.actions.waste import WasteAction, WasteConfig, parse_waste
from exporter.config.yamlconf import ConfigError, parse_document
from exporter.core.findings import Findings, Waste
from exporter.core.snapshot import Allocation, Gpu, GpuInfo, GpuProcess, HostInfo, Snapshot
from exporter.exposition.metrics import render_families
from tests.agent import healthz_until, http_get, serve
from tests.helpers import samples, until

GIB = 1 << 30
LOGGER = "test.waste"
CONFIG = WasteConfig(for_seconds=60.0, leak_samples=3, leak_min_growth=GIB)


def proc(pid: int, memory: int | None = 2 * GIB, sm: float | None = None, **values) -> GpuProcess:
    values.setdefault("visible", True)
    return GpuProcess(
        pid, "compute", memory, name="python3", user="alice", sm_utilization_ratio=sm, **values
    )


def gpu(index: int = 0, util: float | None = 0.0, *processes: GpuProcess, **values) -> Gpu:
    uuid = f"GPU-{index:08d}"
    values.setdefault("memory_used_bytes", sum(p.used_memory_bytes or 0 for p in processes))
    return Gpu(
        index,
        uuid,
        True,
        GpuInfo(index, uuid),
        utilization_ratio=util,
        processes=processes,
        **values,
    )


class Feeder:
    """Snapshots 10 s apart, the last few passed at each run as the engine does, and as the
    sampler keeps them: only the latest with its process lists."""

    def __init__(self, config: WasteConfig = CONFIG, host: bool = True) -> None:
        self.findings = Findings()
        self.action = WasteAction(config, self.findings, logging.getLogger(LOGGER), host)
        self.snapshots: list[Snapshot] = []

    def feed(self, *gpus: Gpu, run: bool = True) -> Waste | None:
        """A sample of ``gpus``; then the action's run over the last few, unless not ``run``."""
        t = 10.0 * len(self.snapshots)
        snap = Snapshot(len(self.snapshots) + 1, 1.7e9 + t, t, 0.01, True, HostInfo("h"), gpus)
        if self.snapshots:
            self.snapshots[-1] = self.snapshots[-1].without_processes()
        self.snapshots.append(snap)
        if not run:
            return None
        self.action.run(self.snapshots[-4:], t)
        found = self.findings.get(Waste)
        assert found is not None
        return found

    def metrics(self) -> dict:
        return samples(render_families(self.action.families()))


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_an_idle_holder_after_for_with_a_noise_floor_and_any_activity_restarting_it(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    feeder = Feeder()
    for util in (0.03, 0.0, 0.04, 0.01, 0.05, 0.0, 0.02):  # at or below 0.05: idle, 60 s long
        found = feeder.feed(gpu(0, util, proc(7), proc(8, memory=GIB // 2)))
    waste = found.gpus["GPU-00000000"]
    assert waste.idle_seconds == 60.0
    assert waste.processes[7].idle_holder and waste.processes[7].idle_seconds == 60.0
    assert 8 not in waste.processes  # holds less than min_memory
    m = feeder.metrics()
    assert [s.value for s in m["gpu_idle_holders"]] == [1]
    (idle,) = m["gpu_process_idle_seconds"]
    assert idle.labels == {
        "gpu": "0",
        "uuid": "GPU-00000000",
        "pid": "7",
        "user": "alice",
        "process": "python3",
    }
    said = [m for m in messages(caplog) if "idle for" in m]
    assert said == [
        "GPU 0 (GPU-00000000): process 7 (python3, alice) holds 2.0GiB and has been idle for 1m"
    ]
    found = feeder.feed(gpu(0, 0.06, proc(7)))  # above the floor: the timer starts over
    assert found.gpus["GPU-00000000"].processes == {}
    assert "gpu_process_idle_seconds" not in feeder.metrics()
    assert [s.value for s in feeder.metrics()["gpu_idle_holders"]] == [0]
    assert any("no longer an idle holder" in m for m in messages(caplog))


def test_a_process_own_sm_share_and_gpm_sm_activity_decide_over_utilization():
    feeder = Feeder()
    for _ in range(7):
        # the GPU reads 90 % busy (another process), this one's own share is 0; GPM says the
        # SMs are 3 % active, so the GPU itself is idle too
        found = feeder.feed(
            gpu(0, 0.9, proc(7, sm=0.0), proc(9, sm=0.8), fields={"sm_active": 0.03})
        )
    waste = found.gpus["GPU-00000000"]
    assert waste.processes[7].idle_holder and 9 not in waste.processes
    assert waste.idle_seconds == 60.0


def test_allocated_but_idle_names_its_owners_and_power_is_shown_not_used(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    feeder = Feeder()
    owners = (Allocation(source="kubelet", namespace="ml", pod="train-0", container="c"),)
    for _ in range(7):
        feeder.feed(
            gpu(0, 0.0, allocations=owners, fields={"power": 300.0}),
            gpu(1, 0.0),
            gpu(2, 0.5, allocations=(Allocation("42"),)),
        )
    m = feeder.metrics()
    assert {s.labels["gpu"]: s.value for s in m["gpu_allocated_idle"]} == {"0": 1, "2": 0}
    said = [m for m in messages(caplog) if "allocated to" in m]
    assert said == [
        "GPU 0 (GPU-00000000) allocated to pod ml/train-0 has been idle for 1m (activity at or "
        "below 0.05, drawing 300 W)"
    ]
    found = feeder.findings.get(Waste).gpus["GPU-00000000"].to_dict()
    assert found["allocated_idle"] is True and found["owners"] == ["pod ml/train-0"]
    assert feeder.findings.get(Waste).gpus["GPU-00000001"].to_dict()["allocated_idle"] is None


def test_memory_held_by_dead_pids_and_by_no_listed_process(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    feeder = Feeder()
    dead = proc(99, memory=40 * GIB, visible=False)
    first = feeder.feed(gpu(0, 0.0, dead, proc(7)))
    assert first.gpus["GPU-00000000"].orphaned_memory_bytes == 0  # gone once: it may just exit
    found = feeder.feed(gpu(0, 0.0, dead, proc(7)))
    waste = found.gpus["GPU-00000000"]
    assert (waste.orphaned_memory_bytes, waste.dead_pids) == (40 * GIB, (99,))
    # 3 GiB used that no process accounts for (above orphaned_min_memory), nothing listed
    found = feeder.feed(gpu(0, 0.0, memory_used_bytes=3 * GIB))
    assert found.gpus["GPU-00000000"].orphaned_memory_bytes == 3 * GIB
    found = feeder.feed(gpu(0, 0.0, memory_used_bytes=GIB // 2))  # below: the driver's own
    assert found.gpus["GPU-00000000"].orphaned_memory_bytes == 0
    said = [m for m in messages(caplog) if "no live process" in m]
    assert said == [
        "GPU 0 (GPU-00000000): 40.0GiB of GPU memory held by no live process (PIDs gone: 99); no "
        "process is left to signal: a GPU reset clears it once no job runs (nvidia-smi "
        "--gpu-reset -i 0)",
        "GPU 0 (GPU-00000000): the memory held by no live process is free again",
    ]
    assert [s.value for s in feeder.metrics()["gpu_orphaned_memory_bytes"]] == [0]


def test_outside_the_hosts_pid_namespace_nothing_is_called_dead():
    feeder = Feeder(host=False)
    for _ in range(3):
        found = feeder.feed(gpu(0, 0.0, proc(99, memory=40 * GIB, visible=False)))
    assert found.gpus["GPU-00000000"].orphaned_memory_bytes is None
    assert "gpu_orphaned_memory_bytes" not in feeder.metrics()


def test_a_leak_suspect_grew_in_each_of_the_last_samples(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    feeder = Feeder()
    for memory in (1, 2, 3, 3, 4, 5, 6):  # GiB: a pause, then three growths of 1 GiB each
        found = feeder.feed(gpu(0, 0.9, proc(7, memory=memory * GIB, sm=0.9)))
    waste = found.gpus["GPU-00000000"]
    assert waste.processes[7].growth_bytes == 3 * GIB
    m = feeder.metrics()
    assert [s.value for s in m["gpu_leak_suspects"]] == [1]
    assert [s.value for s in m["gpu_process_memory_growth_bytes"]] == [3 * GIB]
    assert sum("may leak GPU memory" in m for m in messages(caplog)) == 1
    found = feeder.feed(gpu(0, 0.9, proc(7, memory=6 * GIB, sm=0.9)))  # no growth this time
    assert found.gpus["GPU-00000000"].processes == {}


def test_samples_between_runs_without_process_lists_forget_nothing():
    """At its defaults the action runs every 30 s over samples taken every 5 s, and the sampler
    keeps process lists only in the latest: the others must not reset what it tracks."""
    feeder = Feeder(replace(CONFIG, leak_samples=3))
    for memory in (1, 2, 3, 4):  # GiB, one run per three samples: the last has the process list
        for _ in range(2):
            feeder.feed(gpu(0, 0.0, proc(7, memory=memory * GIB, sm=0.0)), run=False)
        found = feeder.feed(gpu(0, 0.0, proc(7, memory=memory * GIB, sm=0.0)))
    assert found is not None
    judged = found.gpus["GPU-00000000"].processes[7]
    assert judged.growth_bytes == 3 * GIB  # grew at each of the last 3 runs' samples
    assert judged.idle_seconds == pytest.approx(9 * 10.0)  # idle since the first run's sample


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("for: -5m", "expected a duration"),
        ("max_utilization: 1.5", "must be from 0 to 1"),
        ("leak: {samples: 1}", "must be from 2 to 10000"),
        ("min_memory: lots", "size"),
        ("leak: {sample: 3}", "unknown key"),
    ],
)
def test_bad_settings_are_refused_with_their_line(text, why):
    doc = parse_document(f"waste:\n  {text}\n", "config.yaml")
    with pytest.raises(ConfigError) as raised:
        section = doc.root().section("waste")
        parse_waste(section)
        section.done()
    assert why in str(raised.value) and "config.yaml:2" in str(raised.value)


def test_the_agent_reports_waste_in_its_metrics_and_snapshot(tmp_path):
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("gpus:\n  - utilization: 0.0\n    processes: [{pid: self, memory: 2GiB}]\n")
    config = tmp_path / "config.yaml"
    config.write_text("actions:\n  waste: {every: 200ms, for: 0s}\n")
    with serve(
        tmp_path, "--simulate", str(scenario), "--config", str(config), "--interval", "0.1s"
    ) as (agent, port):
        healthz_until(agent, port)

        def holders() -> list:
            found = samples(http_get(f"http://127.0.0.1:{port}/metrics")[1].encode())
            return [s for s in found.get("gpu_idle_holders", []) if s.value == 1]

        until(holders, "gpu_idle_holders 1")
        snapshot = json.loads(http_get(f"http://127.0.0.1:{port}/snapshot")[1])
        (gpu0,) = snapshot["gpus"]
        assert gpu0["waste"]["idle_holders"] == 1
        (process,) = gpu0["processes"]
        assert process["waste"]["idle_holder"] is True
