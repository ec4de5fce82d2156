"""The real command, run as a subprocess: exit codes, messages, and the server's life cycle."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exporter.core.procfs import ProcFs
from tests.agent import clean_env, healthz_until, http_get, serve, stderr_of
from tests.agent import exporter_cli as run_cli
from tests.helpers import agent_config, line_of, write

BUILTIN_NAMES = [
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA GeForce RTX 4090",
]
#: The script name each built-in GPU's spawned processes carry in their command lines.
BUILTIN_SCRIPTS = [["train.py"], ["finetune.py"], [], ["render.py", "notebook.py"]]


def assert_usage_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def my_user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def gone(pid: int, script: str) -> bool:
    """True when ``pid`` is no longer the simulated process running ``script``."""
    info = ProcFs().process(pid)
    return info is None or info.state == "Z" or script not in info.cmdline


# -- status ---------------------------------------------------------------------------------------


def test_status_simulate_table() -> None:
    result = run_cli("status", "--simulate", "--expose-cmdline")
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "driver 550.54.15" in lines[0]
    assert "CUDA 12.4" in lines[0]
    gpu_rows = [line for line in lines if line[:5].strip().isdigit() and line[3:5] == "  "]
    assert [row[:3].strip() for row in gpu_rows] == ["0", "1", "2", "3"]
    assert [row[5:31].strip() for row in gpu_rows] == BUILTIN_NAMES
    for row, total in zip(gpu_rows, ["80.0GiB", "80.0GiB", "40.0GiB", "24.0GiB"], strict=True):
        assert f"/ {total}" in row
        assert "DOWN" not in row

    process_rows = [line.split(None, 5) for line in lines if line.startswith(" " * 6)]
    process_rows = [row for row in process_rows if row[0].isdigit()]
    assert len(process_rows) == 4, result.stdout
    assert [row[2] for row in process_rows] == ["compute", "compute", "graphics", "compute"]
    pids = [int(row[0]) for row in process_rows]
    assert len(set(pids)) == 4
    assert all(pid > 1 for pid in pids)
    # each one's share of the SMs' time at the scenario's start (NVML's whole buffer)
    assert [row[4] for row in process_rows] == ["80%", "30%", "25%", "0%"]
    for row in process_rows:
        # Read from procfs: the real user and the real command line of a spawned process.
        assert row[1] == my_user()[:12]
        assert "not visible" not in row[5]
        assert row[5].startswith(f"{sys.executable} -c import time"[:40]), row


def test_status_simulate_json() -> None:
    before = time.time()
    with subprocess.Popen(
        [sys.executable, "-m", "exporter", "status", "--simulate", "--json", "--expose-cmdline"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    ) as status:
        try:
            stdout, stderr = status.communicate(timeout=30)
        finally:
            if status.poll() is None:
                status.kill()
                status.wait()
    after = time.time()
    assert "Traceback" not in stderr, stderr
    assert status.returncode == 0, stderr
    data = json.loads(stdout)
    assert data["nvml_up"] is True
    assert data["host"]["driver_version"] == "550.54.15"
    gpus = data["gpus"]
    assert len(gpus) == 4
    assert [gpu["info"]["name"] for gpu in gpus] == BUILTIN_NAMES
    assert len({gpu["uuid"] for gpu in gpus}) == 4
    spawned = []
    for gpu, scripts in zip(gpus, BUILTIN_SCRIPTS, strict=True):
        assert gpu["up"] is True
        assert gpu["uuid"].startswith("GPU-")
        assert gpu["info"]["uuid"] == gpu["uuid"]
        assert 0 <= gpu["memory_used_bytes"] <= gpu["info"]["memory_total_bytes"]
        assert sorted(proc["cmdline"][3] for proc in gpu["processes"]) == sorted(scripts)
        for proc in gpu["processes"]:
            assert proc["visible"] is True
            # The pid existed: procfs read it as a child of the status command itself.
            assert proc["pid"] > 1
            assert proc["ppid"] == status.pid
            assert proc["user"] == my_user()
            assert proc["uid"] == os.geteuid()
            assert proc["cmdline"][0] == sys.executable
            assert before - 2 <= proc["start_time"] <= after + 2
            assert proc["used_memory_bytes"] > 0
            spawned.append((proc["pid"], proc["cmdline"][3]))
    assert len({pid for pid, _ in spawned}) == 4
    for pid, script in spawned:  # and status stopped them before exiting
        assert gone(pid, script), pid


@pytest.fixture(scope="module")
def no_driver() -> None:
    probe = subprocess.run(
        [sys.executable, "-c", "import pynvml; pynvml.nvmlInit()"],
        capture_output=True,
        timeout=30,
    )
    if probe.returncode == 0:
        pytest.skip("NVML works on this machine: the no-driver error cannot happen")


@pytest.mark.usefixtures("no_driver")
def test_status_without_driver() -> None:
    result = run_cli("status")
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "NVML is not available" in lines[0]
    assert "LibraryNotFound" in lines[0] or "not found" in lines[0].lower()
    assert "--simulate" in lines[0]


@pytest.mark.usefixtures("no_driver")
def test_status_json_without_driver() -> None:
    result = run_cli("status", "--json")
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "--simulate" in lines[0]


# -- usage errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["serve", "--interval", "abc"], ["--interval", "abc"]),
        (["serve", "--listen", "nope"], ["--listen", "nope"]),
        (["serve", "--listen", "1.2.3.4:99999"], ["--listen", "99999"]),
        (["serve", "--listen", "::1:9402"], ["--listen", "brackets"]),
        (["serve", "--log-level", "loud"], ["--log-level", "loud"]),
        (["serve", "--history", "0"], ["--history"]),
        (["serve", "--proc", "/nonexistent/proc"], ["--proc", "/nonexistent/proc"]),
        (["status", "--simulate", "/nonexistent.yaml"], ["--simulate", "/nonexistent.yaml"]),
        (["serve", "--config", "/nonexistent.yaml"], ["/nonexistent.yaml", "cannot read"]),
        (["status", "--config", "/nonexistent.yaml"], ["/nonexistent.yaml", "cannot read"]),
        (["serve", "--bogus"], ["--bogus"]),
        (["status", "--interval", "5s"], ["--interval"]),  # a serve-only flag
        (["frobnicate"], ["frobnicate"]),
        ([], ["COMMAND"]),
        (["check-config"], ["FILE"]),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) and value else None,
)
def test_bad_flags(args: list[str], needles: list[str]) -> None:
    assert_usage_error(run_cli(*args, timeout=20), *needles)


@pytest.mark.parametrize(
    ("args", "variable", "value"),
    [
        (["serve"], "GPU_EXPORTER_LISTEN", "nope"),
        (["status", "--simulate"], "GPU_EXPORTER_PATHS_PROC", "/nonexistent/proc"),
        (["status"], "GPU_EXPORTER_SIMULATE", "/nonexistent/scenario.yaml"),
    ],
)
def test_bad_environment(args: list[str], variable: str, value: str) -> None:
    result = run_cli(*args, env=clean_env(**{variable: value}), timeout=20)
    assert_usage_error(result, variable)


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: 1s\nsimulate: nope-such-file.yaml\n", "config.yaml")
    result = run_cli("status", env=clean_env(GPU_EXPORTER_CONFIG=path), timeout=20)
    assert_usage_error(result, f"{path}:2", "simulate")


# -- check-config ---------------------------------------------------------------------------------


def test_check_config_good(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        name="good.yaml",
        text="""
        listen: 127.0.0.1:9402
        interval: 2s
        deadline: 1s
        log_level: debug
        simulate: builtin
        paths:
          proc: /proc
        history: 60
        """,
    )
    result = run_cli("check-config", path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{path}: ok"
    assert result.stderr == ""


def test_check_config_ignores_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: 2s\n", "good.yaml")
    result = run_cli("check-config", path, env=clean_env(GPU_EXPORTER_INTERVAL="bad"))
    assert result.returncode == 0, result.stderr


def test_check_config_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, "listen: :9402\n\nintervall: 5s\n", "bad.yaml")
    result = run_cli("check-config", path)
    assert_usage_error(result, f"{path}:3", "intervall", "unknown key")
    assert len(result.stderr.strip().splitlines()) == 1


def test_check_config_invalid_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: 5s\nlisten: [oops\n", "bad.yaml")
    assert_usage_error(run_cli("check-config", path), path, "invalid YAML")


def test_check_config_huge_number(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: " + "9" * 400 + "\n", "big.yaml")
    assert_usage_error(run_cli("check-config", path), f"{path}:1", "interval")


def test_check_config_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "missing.yaml")
    assert_usage_error(run_cli("check-config", path), path)


# -- scenario errors ------------------------------------------------------------------------------


def test_scenario_unknown_gpu_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        name="bad.yaml",
        text="""
        gpus:
          - name: NVIDIA H100 80GB HBM3
          - name: NVIDIA A100-SXM4-40GB
            temprature: 50
        """,
    )
    result = run_cli("status", "--simulate", path)
    assert_usage_error(result, f"{path}:{line_of(path, 'temprature')}", "temprature")
    assert "gpus[1].temprature" in result.stderr


def test_scenario_unknown_nvml_error(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        name="bad.yaml",
        text="""
        gpus:
          - name: NVIDIA H100 80GB HBM3
            errors:
              - field: temperature
                error: Bogus
        """,
    )
    result = run_cli("status", "--simulate", path)
    assert_usage_error(result, f"{path}:{line_of(path, 'Bogus')}", "error", "Bogus")


def test_scenario_huge_number(tmp_path: Path) -> None:
    path = write(tmp_path, "gpus:\n  - memory_total: " + "9" * 400 + "\n", "big.yaml")
    assert_usage_error(run_cli("status", "--simulate", path), f"{path}:2", "memory_total")


def test_scenario_invalid_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "gpus:\n  - name: [x\n", "bad.yaml")
    assert_usage_error(run_cli("status", "--simulate", path), path, "invalid YAML")


def test_scenario_spawn_of_missing_program(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        name="bad.yaml",
        text="""
        gpus:
          - name: NVIDIA H100 80GB HBM3
            processes:
              - spawn: [/nonexistent/program, --flag]
                memory: 1GiB
        """,
    )
    result = run_cli("status", "--simulate", path)
    assert_usage_error(result, path, "/nonexistent/program")


def test_status_shows_a_failed_gpu(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        name="lost.yaml",
        text="""
        gpus:
          - name: NVIDIA H100 80GB HBM3
          - name: NVIDIA A100-SXM4-40GB
            errors:
              - error: GpuIsLost
        """,
    )
    result = run_cli("status", "--simulate", path)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    rows = {line[:3].strip(): line for line in result.stdout.splitlines()[2:]}
    assert "NVIDIA H100 80GB HBM3" in rows["0"]
    assert "DOWN" not in rows["0"]
    assert "DOWN" in rows["1"]
    assert "GpuIsLost" in rows["1"]


def test_scenario_empty_runs(tmp_path: Path) -> None:
    path = write(tmp_path, "gpus: []\n", "empty.yaml")
    result = run_cli("status", "--simulate", path)
    assert result.returncode == 0, result.stderr
    assert "no GPUs: the driver answers but lists none" in result.stdout


# -- serve ----------------------------------------------------------------------------------------


SERVE = (sys.executable, "-m", "exporter", "serve", "--simulate")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_and_stop_on_signal(tmp_path: Path, signum: signal.Signals) -> None:
    with serve(tmp_path, "--simulate", "--interval", "0.2", "--expose-cmdline") as (proc, port):
        healthz_until(proc, port)
        status, metrics = http_get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        assert "gpu_up" in metrics
        status, body = http_get(f"http://127.0.0.1:{port}/snapshot")
        assert status == 200
        spawned = [
            (proc_["pid"], proc_["cmdline"][3])
            for gpu in json.loads(body)["gpus"]
            for proc_ in gpu["processes"] or ()
        ]
        assert len(spawned) == 4

        sent = time.monotonic()
        proc.send_signal(signum)
        try:
            code = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 2s after {signum.name}: {stderr_of(proc)}")
        assert time.monotonic() - sent < 2
        err = stderr_of(proc)
        assert code == 0, err
        assert "Traceback" not in err, err
        for pid, script in spawned:  # the simulation's processes were stopped too
            assert gone(pid, script), pid


def test_second_server_on_same_port(tmp_path: Path) -> None:
    with serve(tmp_path, "--simulate", "--interval", "0.2") as (first, port):
        healthz_until(first, port)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "exporter",
                "serve",
                "--simulate",
                "--listen",
                f"127.0.0.1:{port}",
                "--interval",
                "0.2",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
        )
        assert "Traceback" not in result.stderr, result.stderr
        assert result.returncode == 1, result.stderr
        assert f"cannot serve on 127.0.0.1:{port}" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        # The first one is unharmed.
        assert first.poll() is None
        assert http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200


def test_a_reload_that_must_wait_for_a_running_action_applies_nothing_yet(tmp_path):
    from types import SimpleNamespace

    from exporter.actions.engine import ActionBusy
    from exporter.cli import _reload, build_parser

    path = write(tmp_path, "interval: 7s\n")
    args = build_parser().parse_args(["serve", "--config", path])
    running = agent_config(path, {}, environ={})
    sampler = SimpleNamespace(
        interval=1.0, deadline=1.0, stats=SimpleNamespace(interval_seconds=1.0), collector=None
    )
    reloads = []

    class Engine:
        busy = True

        def reload(self, actions, timeout=None):
            reloads.append(timeout)
            if self.busy:
                raise ActionBusy("zombie_reaper")

    engine = Engine()
    assert _reload(args, running, sampler, engine) is None  # the caller tries again
    assert sampler.interval == 1.0 and reloads == [1.0]  # bounded wait; nothing applied
    engine.busy = False
    sampler.collector = SimpleNamespace(expose_cmdline=True)
    assert _reload(args, running, sampler, engine, waiting=True).interval == 7.0
    assert sampler.interval == 7.0 and sampler.collector.expose_cmdline is False


@pytest.mark.parametrize(
    "command",
    [
        ("status", "--simulate"),
        ("status", "--simulate", "--json"),
        ("recommend", "--simulate", "--format", "json"),
        ("recommend", "--simulate"),
    ],
    ids=" ".join,
)
def test_a_closed_stdout_ends_quietly(command):
    """``status | head -1``: the reader has gone before the command writes; exit 0, no
    traceback (a pipe closed before the first write is the worst case)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(),
    )
    proc.stdout.close()  # the reader is gone
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err


def test_serve_sleeps_until_a_signal_comes() -> None:
    """The agent's main thread wakes for a signal, not on a timer: SIGHUP is a reload, SIGTERM
    a stop, and the handlers it replaced come back afterwards."""
    from exporter.cli import Signals

    before = signal.getsignal(signal.SIGHUP)
    with Signals() as signals:
        assert signals.wait(0) is False and signals.take_reload() is False
        os.kill(os.getpid(), signal.SIGHUP)
        assert signals.wait(None) is False  # woken by the SIGHUP, not a timeout
        assert signals.take_reload() is True and signals.take_reload() is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.wait(None) is True
        assert signals.wait(None) is True  # a stop stays asked
    assert signal.getsignal(signal.SIGHUP) is before


def test_serving_freezes_start_up_and_collects_the_young_generation_less_often() -> None:
    import gc

    from exporter.cli import YOUNG_GC_THRESHOLD, tune_collector

    before = gc.get_threshold()
    try:
        tune_collector()
        assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
