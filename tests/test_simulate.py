"""The simulated driver itself: scenario validation, time, spawned processes, and that it is
handed to the NVML module, never patched into pynvml."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from exporter.config.yamlconf import ConfigError, parse_document
from exporter.simulate.driver import SimulatedDriver, Value, load_scenario, parse_scenario
from tests.helpers import load_script

REPO = Path(__file__).resolve().parent.parent


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
        (
            "gpus:\n  - processes: [{memory: 1GiB}]\n",
            "s.yaml:2",
            "exactly one of pid, spawn and holders",
        ),
        ("gpus:\n  - processes: [{pid: -3}]\n", "s.yaml:2", "positive PID"),
        (
            "gpus:\n  - processes: [{pid: 1, sm_utilization: 1.5}]\n",
            "s.yaml:2",
            "sm_utilization: must be from 0 to 1",
        ),
        ("gpus:\n  - temperature: {from: 40}\n", "s.yaml:2", "needs both 'from' and 'to'"),
        ("gpus:\n  - present: {from: 5s, until: 1s}\n", "s.yaml:2", "later than from"),
        ("driver:\n  cuda_version: twelve\n", "s.yaml:2", "CUDA version"),
        ("gpus:\n  - processes: [{holders: true, pid: 3}]\n", "s.yaml:2", "pid: not with holders"),
        ("driver:\n  device_folder: dev\n", "s.yaml:2", "expected an absolute path"),
        ("driver:\n  device_folder: /nonexistent\n", "s.yaml:2", "not an existing directory"),
        ("driver:\n  utilization_pid_offset: -1\n", "s.yaml:2", "from 0 to 4194304"),
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


def _real_functions() -> dict[str, Any]:
    """pynvml's functions as they are now, by name."""
    return {name: value for name, value in vars(pynvml).items() if callable(value)}


def _unpatched(before: dict[str, Any]) -> list[str]:
    """The names of pynvml's functions that are no longer those of ``before``."""
    now = _real_functions()
    return sorted(n for n in before.keys() | now.keys() if before.get(n) is not now.get(n))


def test_unimplemented_functions_raise_function_not_found_and_pynvml_is_untouched():
    before = _real_functions()
    with SimulatedDriver(parse("gpus: [{}]\n")) as driver:
        driver.nvmlInit()
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            driver.nvmlDeviceGetBAR1MemoryInfo(driver.nvmlDeviceGetHandleByIndex(0))
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):  # a wrapper of pynvml's
            driver.nvmlDeviceGetBoardPartNumber(driver.nvmlDeviceGetHandleByIndex(0))
        assert driver.nvmlDeviceGetCount() == 1
        assert _unpatched(before) == []
    assert _unpatched(before) == []


def test_the_driver_has_pynvmls_own_classes_and_constants_but_none_of_its_functions():
    with SimulatedDriver(parse("gpus: [{memory_total: 80GiB}]\n")) as driver:
        assert driver.NVMLError is pynvml.NVMLError
        assert driver.NVMLError_GpuIsLost is pynvml.NVMLError_GpuIsLost
        assert driver.nvmlMemory_v2 == pynvml.nvmlMemory_v2
        assert driver.NVML_TEMPERATURE_GPU == pynvml.NVML_TEMPERATURE_GPU
        for name in ("_nvmlGetFunctionPointer", "_LoadNvmlLibrary", "nvmlNoSuchFunction"):
            with pytest.raises(AttributeError):
                getattr(driver, name)
        driver.nvmlInit()
        memory = driver.nvmlDeviceGetMemoryInfo(
            driver.nvmlDeviceGetHandleByIndex(0), version=pynvml.nvmlMemory_v2
        )
        assert isinstance(memory, pynvml.c_nvmlMemory_v2_t) and memory.total == 80 * 1024**3


def test_calls_before_init_raise_uninitialized():
    with (
        SimulatedDriver(parse("gpus: [{}]\n")) as driver,
        pytest.raises(pynvml.NVMLError_Uninitialized),
    ):
        driver.nvmlDeviceGetCount()


def test_spawned_processes_are_real_and_stopped_on_stop():
    driver = SimulatedDriver(
        parse('gpus: [{processes: [{spawn: [python3, -c, "import time; time.sleep(60)"]}]}]\n')
    ).start()
    try:
        pid = driver.processes.pids[(0, 0)]
        assert os.path.exists(f"/proc/{pid}")
        driver.nvmlInit()
        listed = driver.nvmlDeviceGetComputeRunningProcesses(driver.nvmlDeviceGetHandleByIndex(0))
        assert [p.pid for p in listed] == [pid]
    finally:
        driver.stop()
    assert not os.path.exists(f"/proc/{pid}")


def _holder(path: Path) -> subprocess.Popen[bytes]:
    """A process outside the simulation that opens ``path`` and keeps it open, as a CUDA
    program keeps /dev/nvidiaN open; it says when it has."""
    code = "import sys, time; f = open(sys.argv[1]); print(flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"\n"
    return child


def test_holders_are_the_processes_outside_the_simulation_that_open_a_stand_in(tmp_path):
    driver = SimulatedDriver(
        parse(
            f"driver: {{device_folder: {tmp_path}}}\n"
            "gpus:\n"
            "  - processes:\n"
            "      - {holders: true, memory: 2GiB, sm_utilization: 0.5}\n"
            '      - {spawn: [python3, -c, "import time; time.sleep(60)"], memory: 1GiB}\n'
            "  - processes: [{holders: true}]\n"
        )
    ).start()
    job = None
    try:
        assert driver.dev_root == str(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["nvidia0", "nvidia1"]
        assert (tmp_path / "nvidia0").stat().st_mode & 0o777 == 0o666  # other users' jobs too
        driver.nvmlInit()
        first, second = (driver.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
        spawned = driver.processes.pids[(0, 1)]  # holds nvidia0 too, listed once by its entry
        assert _listed(driver, first) == [spawned]
        job = _holder(tmp_path / "nvidia0")
        listed = {}
        deadline = time.monotonic() + 5
        while job.pid not in listed:
            assert time.monotonic() < deadline, "the holder was not listed"
            time.sleep(0.02)
            listed = {
                p.pid: p.usedGpuMemory for p in driver.nvmlDeviceGetComputeRunningProcesses(first)
            }
        assert listed == {job.pid: 2 << 30, spawned: 1 << 30}
        assert _listed(driver, second) == []
        busy = driver.nvmlDeviceGetProcessUtilization(first, 0)
        assert {(s.pid, s.smUtil) for s in busy} == {(job.pid, 50)}
        job.kill()
        job.wait()
        deadline = time.monotonic() + 5
        while job.pid in _listed(driver, first):
            assert time.monotonic() < deadline, "an ended holder stayed listed"
            time.sleep(0.02)
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait()
        driver.stop()
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []  # its folder, kept empty


def test_a_utilization_pid_offset_stamps_samples_with_other_pids(simulated, clock):
    driver = simulated(
        "driver: {utilization_pid_offset: 4000000}\n"
        "gpus: [{processes: [{pid: self, sm_utilization: 0.3}]}]\n"
    )
    driver.nvmlInit()
    handle = driver.nvmlDeviceGetHandleByIndex(0)
    assert _listed(driver, handle) == [os.getpid()]
    (sample,) = driver.nvmlDeviceGetProcessUtilization(handle, 0)
    assert (sample.pid, sample.smUtil) == (os.getpid() + 4000000, 30)


def test_call_latency_is_paid_per_call():
    with SimulatedDriver(parse("driver: {call_latency: 2ms}\ngpus: [{}]\n")) as driver:
        driver.nvmlInit()
        started = time.perf_counter()
        for _ in range(10):
            driver.nvmlDeviceGetCount()
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
    ).start()
    try:
        held, orphan, free = (driver.processes.pids[(0, i)] for i in range(3))
        procfs = ProcFs()
        leader = procfs.process(orphan).pgid  # the job's leader holds the GPU while it lives
        device = file_identity(f"{driver.dev_root}/nvidia0")
        holders, unreadable = scan_fd_holders("/proc", {device: "gpu0"})
        assert holders["gpu0"] == {held, orphan, leader}
        assert not {held, orphan, free} & unreadable
        driver.nvmlInit()
        handle = driver.nvmlDeviceGetHandleByIndex(0)
        listed = _listed(driver, handle)
        assert sorted(listed) == sorted([held, leader, orphan, free])
        deadline = time.monotonic() + 5
        while leader in _listed(driver, handle):
            assert time.monotonic() < deadline, "the job leader did not exit"
            time.sleep(0.02)
        info = procfs.process(orphan)
        assert info.cmdline[:2] == (info.cmdline[0], "-c")  # the program itself, not the shell
        assert procfs.process(info.pgid) is None and procfs.process(info.sid) is None
        assert procfs.process(held).ppid == os.getpid()
        assert procfs.process(free) is not None  # alive, and not among the holders
    finally:
        driver.stop()
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
    """Tools that call NVML's C symbols (nvitop does) get the same simulated answers, once the
    benchmark installed the simulation globally; uninstalled, pynvml is as it was."""
    global_nvml = load_script(REPO / "bench" / "global_nvml.py")
    before = _real_functions()
    real = dict(before)  # pynvml's own functions, which call the C symbols
    driver = SimulatedDriver(
        parse(
            "gpus: [{memory_total: 80GiB, memory_reserved: 1GiB,"
            " processes: [{pid: self, memory: 2GiB}]}]\n"
        )
    ).start()
    uninstall = global_nvml.install_globally(driver)
    try:
        pynvml.nvmlInit()
        assert driver.calls["nvmlInit"] == 1
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        (proc,) = real["nvmlDeviceGetComputeRunningProcesses_v3"](handle)
        assert (proc.pid, proc.usedGpuMemory) == (os.getpid(), 2 * 1024**3)
        memory = real["nvmlDeviceGetMemoryInfo"](handle, version=pynvml.nvmlMemory_v2)
        assert (memory.total, memory.reserved, memory.used) == (80 * 1024**3, 1024**3, 2 * 1024**3)
        assert real["nvmlDeviceGetTemperature"](handle, 0) == 35
        assert real["nvmlDeviceGetMPSComputeRunningProcesses_v3"](handle) == []
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml._nvmlGetFunctionPointer("nvmlDeviceGetBAR1MemoryInfo")
    finally:
        uninstall()
        driver.stop()
    assert _unpatched(before) == []


def _listed(driver: SimulatedDriver, handle) -> list[int]:
    return [p.pid for p in driver.nvmlDeviceGetComputeRunningProcesses(handle)]


def test_a_churning_pid_is_a_new_pid_every_period(simulated, clock):
    driver = simulated(
        "gpus:\n"
        "  - processes:\n"
        "      - {pid: 5000000, churn: 1s}\n"
        "      - {pid: 6000000, churn: 250ms, from: 2s}\n"
    )
    driver.nvmlInit()
    handle = driver.nvmlDeviceGetHandleByIndex(0)
    seen = []
    for _ in range(7):  # t = 0, 0.5, ... 3 s
        seen.append(_listed(driver, handle))
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
    driver.nvmlInit()
    handle = driver.nvmlDeviceGetHandleByIndex(0)
    (first,) = _listed(driver, handle)
    clock.advance(0.5)
    assert _listed(driver, handle) == [first]  # the same process within its period
    clock.advance(0.6)
    (second,) = _listed(driver, handle)
    assert second != first
    assert _state(first) is None  # killed and reaped: not even a zombie
    assert _state(second) in ("R", "S", "D")  # alive (D: still paging its program in)
    assert [c.pid for c in driver.processes.children] == [second]  # no Popen kept for the old one
    driver.stop()
    assert _state(second) is None


def test_a_churning_spawn_that_exits_early_is_started_again(simulated, clock):
    driver = simulated("gpus:\n  - processes:\n      - {spawn: [python3, -c, pass], churn: 1h}\n")
    driver.nvmlInit()
    handle = driver.nvmlDeviceGetHandleByIndex(0)
    (first,) = _listed(driver, handle)
    deadline = time.monotonic() + 10
    while _state(first) not in ("Z", None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(first) == "Z"  # exited, not yet reaped: the next listing reaps it
    (second,) = _listed(driver, handle)
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
    driver.nvmlInit()
    handle = driver.nvmlDeviceGetHandleByIndex(0)
    clock.advance(2.5)
    (sample,) = driver.nvmlDeviceGetProcessUtilization(handle, 0)  # idle processes: no sample
    assert isinstance(sample, pynvml.c_nvmlProcessUtilizationSample_t)
    assert (sample.pid, sample.smUtil) == (os.getpid(), 90)  # the busiest moment, at 2 s
    assert sample.timeStamp == pytest.approx(driver.wall() * 1e6, abs=200_000)  # last moment
    clock.advance(1)  # idle from 3 s
    (later,) = driver.nvmlDeviceGetProcessUtilization(handle, sample.timeStamp)
    assert later.smUtil < 90 and later.timeStamp > sample.timeStamp
    with pytest.raises(pynvml.NVMLError_NotFound):
        driver.nvmlDeviceGetProcessUtilization(handle, later.timeStamp)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        driver.nvmlDeviceGetProcessUtilization(driver.nvmlDeviceGetHandleByIndex(1), 0)


# -- injected, never patched -----------------------------------------------------------------------


def test_status_simulate_leaves_pynvml_alone(tmp_path, monkeypatch, capsys):
    """``gpu-exporter status --simulate`` in this process: pynvml's functions stay pynvml's,
    while the simulated sample is taken and after."""
    from exporter import cli
    from exporter.sampling import collect

    before = _real_functions()
    during: list[list[str]] = []

    class Watching(collect.Collector):
        def sample(self):
            during.append(_unpatched(before))
            return super().sample()

    monkeypatch.setattr(collect, "Collector", Watching)  # status imports it when it runs
    for name in [n for n in os.environ if n.startswith("GPU_EXPORTER_")]:
        monkeypatch.delenv(name)
    assert cli.main(["status", "--simulate", "--json", "--lock-dir", str(tmp_path)]) == 0
    assert len(json.loads(capsys.readouterr().out)["gpus"]) == len(load_scenario("builtin").gpus)
    assert during == [[]]
    assert _unpatched(before) == []


_RESERVE = """
import sys
import pynvml
from exporter.launcher.api import reserve

before = {name: value for name, value in vars(pynvml).items() if callable(value)}

def changed():
    now = {name: value for name, value in vars(pynvml).items() if callable(value)}
    return sorted(n for n in before.keys() | now.keys() if before.get(n) is not now.get(n))

with reserve(1, simulate="builtin", lock_dir=sys.argv[1]) as devices:
    print(len(devices), changed())
print(changed())
"""


def test_reserve_with_a_simulation_leaves_pynvml_alone(tmp_path):
    """A training script that reserves simulated GPUs keeps the real pynvml."""
    locks = tmp_path / "locks"
    locks.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_EXPORTER_", "CUDA_"))}
    done = subprocess.run(
        [sys.executable, "-c", _RESERVE, str(locks)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["1 []", "[]"]


def _patches(tree: ast.AST) -> list[int]:
    """Lines that change the pynvml module: set or delete one of its attributes (``pynvml.x =``,
    ``setattr``, ``delattr``, ``del``) or an item of its ``vars()`` or ``__dict__``."""
    names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name == "pynvml"
    }

    def is_pynvml(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in names

    def is_namespace(node: ast.AST) -> bool:  # vars(pynvml) or pynvml.__dict__
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "vars":
            return bool(node.args) and is_pynvml(node.args[0])
        return isinstance(node, ast.Attribute) and node.attr == "__dict__" and is_pynvml(node.value)

    def changes(node: ast.AST) -> bool:
        if isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del)):  # x.a = , del x[k]
            if isinstance(node, ast.Attribute):
                return is_pynvml(node.value)
            return isinstance(node, ast.Subscript) and is_namespace(node.value)
        if not isinstance(node, ast.Call):
            return False
        if getattr(node.func, "id", "") in ("setattr", "delattr"):
            return bool(node.args) and is_pynvml(node.args[0])
        return (  # vars(pynvml).update(...), pynvml.__dict__.pop(...)
            isinstance(node.func, ast.Attribute)
            and node.func.attr in ("update", "pop", "setdefault", "clear", "__setitem__")
            and is_namespace(node.func.value)
        )

    return sorted(node.lineno for node in ast.walk(tree) if changes(node))


def test_no_module_of_the_package_patches_pynvml():
    found = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted((REPO / "exporter").rglob("*.py"))
        for line in _patches(ast.parse(path.read_text(), str(path)))
    ]
    assert found == []


def test_the_check_for_patches_finds_each_way_of_patching():
    text = (
        "import pynvml as nv\n"
        "nv.nvmlInit = None\n"
        "setattr(nv, 'nvmlShutdown', None)\n"
        "del nv.nvmlDeviceGetCount\n"
        "vars(nv)['x'] = 1\n"
        "nv.__dict__.update(y=2)\n"
        "value = vars(nv).get('x')\n"  # reading is fine
        "nv.nvmlInit()\n"
    )
    assert _patches(ast.parse(text)) == [2, 3, 4, 5, 6]


def test_the_simulation_starts_processes_without_preexec_fn():
    """No code between fork and exec: the sampler's thread starts processes while others run."""
    for path in sorted((REPO / "exporter" / "simulate").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        keywords = [node.arg for node in ast.walk(tree) if isinstance(node, ast.keyword)]
        assert "preexec_fn" not in keywords, path


_KILLED = """
import sys, time
from exporter.simulate.driver import simulate

driver = simulate(sys.argv[1])
print(driver.processes.pids[(0, 0)], flush=True)
time.sleep(60)
"""


def test_spawned_processes_end_when_the_simulating_process_is_killed(tmp_path):
    """SIGKILL leaves the simulation no time to stop its processes: its guard does."""
    scenario = tmp_path / "one.yaml"
    scenario.write_text('gpus: [{processes: [{spawn: [sleep, "60"]}]}]\n')
    simulating = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(scenario)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert simulating.stdout is not None
        child = int(simulating.stdout.readline())
        assert _state(child) in ("R", "S")
    finally:
        simulating.kill()
        simulating.wait()
        assert simulating.stdout is not None
        simulating.stdout.close()
    deadline = time.monotonic() + 10
    while _state(child) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _state(child) in (None, "Z")


def test_processes_start_from_another_thread(simulated, clock):
    """Churn restarts happen in the sampler's thread, while others run."""
    driver = simulated("gpus:\n  - processes:\n      - {spawn: [sleep, '60'], churn: 1s}\n")
    driver.nvmlInit()
    handle = driver.nvmlDeviceGetHandleByIndex(0)
    (first,) = _listed(driver, handle)
    clock.advance(1)
    listed: list[list[int]] = []
    worker = threading.Thread(target=lambda: listed.append(_listed(driver, handle)))
    worker.start()
    worker.join(10)
    ((second,),) = listed
    assert second != first and _state(second) in ("R", "S")


def test_a_scenario_file_is_read_once_while_it_is_unchanged(tmp_path):
    path = tmp_path / "host.yaml"
    path.write_text("gpus:\n  - {name: A}\n")
    first = load_scenario(str(path))
    assert load_scenario(str(path)) is first  # checked by the settings, then simulated
    path.write_text("gpus:\n  - {name: B}\n  - {name: C}\n")
    changed = load_scenario(str(path))
    assert [gpu.name for gpu in changed.gpus] == ["B", "C"]
    path.unlink()
    with pytest.raises(ConfigError):
        load_scenario(str(path))
