"""How long a GPU process has been idle, carried by the sampler from sample to sample."""

from __future__ import annotations

from exporter.core.activity import IdleTimes
from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.sampling.collect import Collector
from tests.test_reaper import scenario


def test_idle_time_counts_from_the_first_idle_sample_and_resets_on_activity():
    idle = IdleTimes()
    key = ("GPU-1", 42, 1000)
    readings = [(0.0, 0.5, 0.0), (5.0, 0.0, 0.0), (10.0, 0.0, 5.0), (15.0, 0.2, 0.0)]
    for now, utilization, expected in readings:
        assert idle.observe(key, utilization, now) == expected
        idle.end_sample()
    assert idle.observe(key, 0.0, 20.0) == 0.0  # idle again: counted afresh
    idle.end_sample()
    assert idle.observe(key, None, 25.0) is None  # unknown forgets what was known
    idle.end_sample()
    assert idle.observe(key, 0.0, 30.0) == 0.0


def test_a_process_not_listed_in_a_sample_is_forgotten():
    idle = IdleTimes()
    idle.observe(("GPU-1", 42, 1000), 0.0, 0.0)
    idle.end_sample()
    idle.end_sample()  # a sample without it
    assert idle.observe(("GPU-1", 42, 1000), 0.0, 60.0) == 0.0


def test_the_snapshot_carries_each_process_idle_time(simulated, clock):
    busy_then_idle = "{points: [[0, 0.8], [10, 0.8], [11, 0]]}"
    driver = simulated(scenario([f"{{pid: self, memory: 1GiB, sm_utilization: {busy_then_idle}}}"]))
    # the host's clock moves with the scenario's, as NVML's sample timestamps do
    collector = Collector(Nvml(library=driver, wall=driver.wall), ProcFs(), monotonic=clock)
    seen = []
    try:
        for _ in range(7):
            (process,) = collector.sample().gpus[0].processes
            seen.append(process.gpu_idle_seconds)
            clock.advance(5)
    finally:
        collector.close()
    # active in each window up to 15 s (it used the SMs until 11 s); idle from the 20 s sample
    assert seen == [0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 10.0]


def test_unsupported_utilization_leaves_the_idle_time_unknown(simulated, collector):
    simulated(
        "gpus:\n  - minor_number: 0\n    unsupported: [process_utilization]\n"
        "    processes: [{pid: self, memory: 1GiB}]\n"
    )
    (process,) = collector.sample().gpus[0].processes
    assert process.sm_utilization_ratio is None and process.gpu_idle_seconds is None
