"""The simulated driver itself: scenario validation, time, restoration, spawned processes."""

from __future__ import annotations

import os
import textwrap
import time

import pynvml
import pytest

from exporter.simulate import SimulatedDriver, Value, load_scenario, parse_scenario
from exporter.yamlconf import ConfigError, parse_document


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
    from exporter.procfs import ProcFs, file_identity, scan_fd_holders

    driver = SimulatedDriver(
        parse(
            "gpus:\n"
            "  - processes:\n"
            '      - {spawn: [python3, -c, "import time; time.sleep(60)"]}\n'
            '      - {spawn: [python3, -c, "import time; time.sleep(60)"], orphan: true}\n'
            '      - {spawn: [python3, -c, "import time; time.sleep(60)"], holds_device: false}\n'
        )
    ).install()
    try:
        held, orphan, free = (driver._pids[(0, i)] for i in range(3))
        device = file_identity(f"{driver.dev_root}/nvidia0")
        holders, unreadable = scan_fd_holders("/proc", {device: "gpu0"})
        assert holders["gpu0"] == {held, orphan}
        assert not {held, orphan, free} & unreadable
        procfs = ProcFs()
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
