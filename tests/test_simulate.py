"""The simulated driver itself: scenario validation, time, restoration, spawned processes."""

from __future__ import annotations

import os
import textwrap
import time

import pynvml
import pytest

from exporter.config.yamlconf import ConfigError, parse_document
from exporter.simulate.driver import SimulatedDriver, Value, load_scenario, parse_scenario


def parse(text: str):
    return parse_scenario(parse_document(textwrap.dedent(text), "s.yaml").root())


def test_builtin_scenario_loads():
    scenario = load_scenario("builtin")
    assert len({g.name for g in scenario.gpus}) >= 3
    assert any(g.processes for g in scenario.gpus)
    assert any(g.temperature.to is not None for g in scenario.gpus)  # one GPU warms up


@pytest.mark.parametrize(
    ("text", "where", "needle"),
    [
        ("gpus:\n  - name: A\n    temprature: 50\n", "s.yaml:3", "gpus[0].temprature: unknown key"),
        ("gpus:\n  - errors: [{error: Bogus}]\n", "s.yaml:2", "unknown NVML error 'Bogus'"),
        ("gpus:\n  - errors: [{field: nope}]\n", "s.yaml:2", "unknown field 'nope'"),
        ("gpus:\n  - utilization: 1.5\n", "s.yaml:2", "must be from 0 to 1"),
        ("gpus:\n  - memory_total: lots\n", "s.yaml:2", "gpus[0].memory_total"),
        ("gpus:\n  - processes: [{memory: 1GiB}]\n", "s.yaml:2", "exactly one of pid and spawn"),
        ("gpus:\n  - processes: [{pid: -3}]\n", "s.yaml:2", "positive PID"),
        (
            "gpus:\n  - processes: [{pid: 1, sm_utilization: 1.5}]\n",
            "s.yaml:2",
            "sm_utilization: must be from 0 to 1",
        ),
        ("gpus:\n  - temperature: {from: 40}\n", "s.yaml:2", "needs both 'from' and 'to'"),
        ("gpus:\n  - present: {from: 5s, until: 1s}\n", "s.yaml:2", "later than from"),
        ("driver:\n  cuda_version: twelve\n", "s.yaml:2", "CUDA version"),
        ("gpus: 3\n", "s.yaml:1", "must be a list"),
        ("- a\n- b\n", "s.yaml:1", "must be a mapping"),
        ("gpus:\n  - name: A\n    name: B\n", "s.yaml:3", "duplicate key"),
        ("gpus: [\n", "s.yaml:2", "invalid YAML"),
    ],
)
def test_bad_scenarios_name_line_key_and_why(text, where, needle):
    with pytest.raises(ConfigError) as failed:
        parse(text)
    message = str(failed.value)
    assert message.startswith(where) and needle in message, message


def test_values_over_time():
    ramp = Value(40, to=80, start=10, over=40)
    assert [ramp.at(t) for t in (0, 10, 30, 50, 100)] == [40, 40, 60, 80, 80]
    wave = Value(50, amplitude=10, period=4)
    assert wave.at(1) == pytest.approx(60) and wave.at(3) == pytest.approx(40)


def test_unimplemented_functions_raise_function_not_found_and_uninstall_restores():
    original = pynvml.nvmlDeviceGetCount
    driver = SimulatedDriver(parse("gpus: [{}]\n")).install()
    try:
        pynvml.nvmlInit()
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml.nvmlDeviceGetBAR1MemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        assert pynvml.nvmlDeviceGetCount() == 1
    finally:
        driver.uninstall()
    assert pynvml.nvmlDeviceGetCount is original


def test_calls_before_init_raise_uninitialized():
    with SimulatedDriver(parse("gpus: [{}]\n")), pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_spawned_processes_are_real_and_stopped_on_uninstall():
    driver = SimulatedDriver(
        parse('gpus: [{processes: [{spawn: [python3, -c, "import time; time.sleep(60)"]}]}]\n')
    ).install()
    try:
        pid = driver._pids[(0, 0)]
        assert os.path.exists(f"/proc/{pid}")
        pynvml.nvmlInit()
        listed = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
        assert [p.pid for p in listed] == [pid]
    finally:
        driver.uninstall()
    assert not os.path.exists(f"/proc/{pid}")


def test_call_latency_is_paid_per_call():
    with SimulatedDriver(parse("driver: {call_latency: 2ms}\ngpus: [{}]\n")):
        pynvml.nvmlInit()
        started = time.perf_counter()
        for _ in range(10):
            pynvml.nvmlDeviceGetCount()
        assert time.perf_counter() - started >= 0.02


def test_spawned_processes_hold_their_device_and_orphans_lose_their_job():
    from exporter.core.procfs import ProcFs, file_identity, scan_fd_holders

    driver = SimulatedDriver(
        parse(
            "gpus:\n"
            "  - processes:\n"
            '      - {spawn: [python3, -c, "import time; time.sleep(60)"]}\n'
            '      - {spawn: [python3, -c, "import time; time.sleep(60)"], orphan: true,'
            " orphan_after: 300ms}\n"
            '      - {spawn: [python3, -c, "import time; time.sleep(60)"], holds_device: false}\n'
        )
    ).install()
    try:
        held, orphan, free = (driver._pids[(0, i)] for i in range(3))
        procfs = ProcFs()
        leader = procfs.process(orphan).pgid  # the job's leader holds the GPU while it lives
        device = file_identity(f"{driver.dev_root}/nvidia0")
        holders, unreadable = scan_fd_holders("/proc", {device: "gpu0"})
        assert holders["gpu0"] == {held, orphan, leader}
        assert not {held, orphan, free} & unreadable
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        listed = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        assert sorted(listed) == sorted([held, leader, orphan, free])
        deadline = time.monotonic() + 5
        while leader in [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]:
            assert time.monotonic() < deadline, "the job leader did not exit"
            time.sleep(0.02)
        info = procfs.process(orphan)
        assert info.cmdline[:2] == (info.cmdline[0], "-c")  # the program itself, not the shell
        assert procfs.process(info.pgid) is None and procfs.process(info.sid) is None
        assert procfs.process(held).ppid == os.getpid()
        assert procfs.process(free) is not None  # alive, and not among the holders
    finally:
        driver.uninstall()
    assert not os.path.exists(driver.dev_root)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{orphan}") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{orphan}") or ProcFs().process(orphan).state == "Z"


def test_a_line_through_points():
    scenario = parse(
        "gpus:\n  - temperature: {points: [[0s, 40], [10s, 90], [20s, 90], [30s, 50]]}\n"
    )
    line = scenario.gpus[0].temperature
    assert [line.at(t) for t in (-1, 0, 5, 15, 25, 30, 99)] == [40, 40, 65, 90, 70, 50, 50]
    with pytest.raises(ConfigError, match="in time order"):
        parse("gpus:\n  - temperature: {points: [[10s, 40], [0s, 90]]}\n")
    with pytest.raises(ConfigError, match="stands alone"):
        parse("gpus:\n  - temperature: {points: [[0s, 40]], base: 3}\n")


def test_c_symbols_serve_pynvmls_own_struct_code():
    """Tools that call NVML's C symbols (nvitop does) get the same simulated answers."""
    driver = SimulatedDriver(
        parse(
            "gpus: [{memory_total: 80GiB, memory_reserved: 1GiB,"
            " processes: [{pid: self, memory: 2GiB}]}]\n"
        )
    ).install()
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        real = driver._saved  # pynvml's own functions, which call the C symbols
        (proc,) = real["nvmlDeviceGetComputeRunningProcesses_v3"](handle)
        assert (proc.pid, proc.usedGpuMemory) == (os.getpid(), 2 * 1024**3)
        memory = real["nvmlDeviceGetMemoryInfo"](handle, version=pynvml.nvmlMemory_v2)
        assert (memory.total, memory.reserved, memory.used) == (80 * 1024**3, 1024**3, 2 * 1024**3)
        assert real["nvmlDeviceGetTemperature"](handle, 0) == 35
        assert real["nvmlDeviceGetMPSComputeRunningProcesses_v3"](handle) == []
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml._nvmlGetFunctionPointer("nvmlDeviceGetBAR1MemoryInfo")
    finally:
        driver.uninstall()


def _listed(handle) -> list[int]:
    return [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]


def test_a_churning_pid_is_a_new_pid_every_period(simulated, clock):
    simulated(
        "gpus:\n"
        "  - processes:\n"
        "      - {pid: 5000000, churn: 1s}\n"
        "      - {pid: 6000000, churn: 250ms, from: 2s}\n"
    )
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    seen = []
    for _ in range(7):  # t = 0, 0.5, ... 3 s
        seen.append(_listed(handle))
        clock.advance(0.5)
    assert seen == [
        [5000000],
        [5000000],
        [5000001],
        [5000001],
        [5000002, 6000000],  # the second from 2 s, counting its periods from there
        [5000002, 6000002],
        [5000003, 6000004],
    ]


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


def test_a_churning_spawn_is_a_new_child_every_period_and_the_old_one_is_reaped(simulated, clock):
    driver = simulated(
        "gpus:\n"
        "  - processes:\n"
        '      - {spawn: [python3, -c, "import time; time.sleep(60)"], churn: 1s}\n'
    )
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    (first,) = _listed(handle)
    clock.advance(0.5)
    assert _listed(handle) == [first]  # the same process within its period
    clock.advance(0.6)
    (second,) = _listed(handle)
    assert second != first
    assert _state(first) is None  # killed and reaped: not even a zombie
    assert _state(second) in ("R", "S")
    assert [c.pid for c in driver._children] == [second]  # no Popen kept for the old one
    driver.uninstall()
    assert _state(second) is None


def test_a_churning_spawn_that_exits_early_is_started_again(simulated, clock):
    simulated("gpus:\n  - processes:\n      - {spawn: [python3, -c, pass], churn: 1h}\n")
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    (first,) = _listed(handle)
    deadline = time.monotonic() + 10
    while _state(first) not in ("Z", None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(first) == "Z"  # exited, not yet reaped: the next listing reaps it
    (second,) = _listed(handle)
    assert second != first and _state(first) is None


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ("{pid: self, churn: 1s}", "numeric pid or spawn"),
        ("{pid: 7, churn: 0s}", "longer than 0s"),
        ("{spawn: [sleep, '9'], orphan: true, churn: 1s}", "an orphan cannot churn"),
        ("{pid: 7, churn: often}", "churn"),
    ],
)
def test_bad_churn_is_refused_with_its_key(entry, needle):
    with pytest.raises(ConfigError) as failed:
        parse(f"gpus:\n  - processes: [{entry}]\n")
    message = str(failed.value)
    assert message.startswith("s.yaml:2") and needle in message, message


def test_process_utilization_answers_like_a_driver(simulated, clock):
    driver = simulated(
        """
        gpus:
          - processes:
              - {pid: self, sm_utilization: {points: [[0s, 0.2], [2s, 0.9], [3s, 0]]}}
              - {pid: parent}
          - unsupported: [process_utilization]
            processes: [{pid: self, sm_utilization: 1}]
        """
    )
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    clock.advance(2.5)
    (sample,) = pynvml.nvmlDeviceGetProcessUtilization(handle, 0)  # idle processes: no sample
    assert isinstance(sample, pynvml.c_nvmlProcessUtilizationSample_t)
    assert (sample.pid, sample.smUtil) == (os.getpid(), 90)  # the busiest moment, at 2 s
    assert sample.timeStamp == pytest.approx(driver.wall() * 1e6, abs=200_000)  # last moment
    clock.advance(1)  # idle from 3 s
    (later,) = pynvml.nvmlDeviceGetProcessUtilization(handle, sample.timeStamp)
    assert later.smUtil < 90 and later.timeStamp > sample.timeStamp
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(handle, later.timeStamp)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetProcessUtilization(pynvml.nvmlDeviceGetHandleByIndex(1), 0)
