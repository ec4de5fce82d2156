"""recommend, run and reserve on simulated GPUs, with real processes and real locks."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exporter.core.locks import LockError, held_locks, try_lock
from exporter.core.snapshot import Gpu, GpuInfo
from exporter.core.visible import visible_uuids
from exporter.launcher.acquire import NoGpusAvailable
from exporter.launcher.api import reserve, select_devices
from tests.agent import clean_env, healthz_until, http_get, serve, stderr_of
from tests.agent import exporter_cli as cli
from tests.helpers import samples

TWO_GPUS = """
gpus:
  - {name: GPU A, memory_total: 80GiB}
  - {name: GPU B, memory_total: 80GiB}
"""
#: Exit statuses documented in exporter/launcher/cli.py.
NO_GPUS, WAIT_TIMEOUT = 75, 124


RUN = (sys.executable, "-m", "exporter", "run", "--simulate")


def run_cli(host: tuple[Path, Path], *args: str, **kwargs):
    """``gpu-exporter run`` on the host's simulated GPUs and lock directory."""
    scenario, locks = host
    return cli("run", "--simulate", str(scenario), "--lock-dir", str(locks), *args, **kwargs)


def recommend_cli(host: tuple[Path, Path], *args: str, **kwargs):
    """``gpu-exporter recommend`` on the host's simulated GPUs and lock directory."""
    scenario, locks = host
    return cli("recommend", "--simulate", str(scenario), "--lock-dir", str(locks), *args, **kwargs)


def start_run(scenario: Path, locks: Path, *args: str, job: tuple[str, ...]) -> subprocess.Popen:
    return subprocess.Popen(
        [*RUN, str(scenario), "--lock-dir", str(locks), *args, "--", *job],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(TMPDIR=str(locks.parent)),  # tests kill it: its temp folder goes with theirs
    )


#: A job that prints its GPUs and its pid, then sleeps.
SLEEPER = (
    sys.executable,
    "-c",
    "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES'], os.getpid(), flush=True);"
    " time.sleep(30)",
)


def wait_locked(locks: Path, count: int) -> dict[str, int]:
    deadline = time.monotonic() + 20
    while len(held := held_locks(str(locks))) < count:
        assert time.monotonic() < deadline, held
        time.sleep(0.05)
    return held


def uuids(scenario: Path, locks: Path) -> list[str]:
    result = cli("status", "--simulate", str(scenario), "--json", "--lock-dir", str(locks))
    return [gpu["uuid"] for gpu in json.loads(result.stdout)["gpus"]]


# -- run -------------------------------------------------------------------------------------------


def test_two_jobs_get_different_gpus_a_third_waits_or_fails(host, tmp_path):
    scenario, locks = host
    first = start_run(scenario, locks, job=SLEEPER)
    second = start_run(scenario, locks, job=SLEEPER)
    try:
        seen = {first.stdout.readline().split()[0], second.stdout.readline().split()[0]}
        assert len(seen) == 2 and all(s.startswith("GPU-") for s in seen)
        held = wait_locked(locks, 2)
        assert set(held) == seen
        third = run_cli(host, "--", "true")
        assert third.returncode == NO_GPUS and third.stdout == ""
        assert third.stderr.count("reserved by a launcher lock") == 2
        waited = run_cli(
            host,
            "--wait",
            "1s",
            "--",
            "true",
        )
        assert waited.returncode == WAIT_TIMEOUT
        assert waited.stderr.startswith("gpu-exporter: waiting up to 1s: 0 of 1 GPU(s) qualify")
        assert waited.stderr.count("waiting up to") == 1  # one progress line

        with serve(tmp_path, "--simulate", str(scenario), "--lock-dir", str(locks)) as (
            agent,
            port,
        ):
            healthz_until(agent, port)
            found = samples(http_get(f"http://127.0.0.1:{port}/metrics")[1].encode())
            assert [s.value for s in found["gpu_reserved"]] == [1.0, 1.0]
            snapshot = json.loads(http_get(f"http://127.0.0.1:{port}/snapshot")[1])
            assert {g["reserved_by"] for g in snapshot["gpus"]} == {first.pid, second.pid}
            status, body = http_get(f"http://127.0.0.1:{port}/recommend")
            assert status == 409 and "reserved by a launcher lock" in body
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=5) == 0, stderr_of(agent)
    finally:
        for job in (first, second):
            job.kill()
            job.wait()


def test_a_killed_job_frees_its_gpu_at_once(host):
    scenario, locks = host
    job = start_run(scenario, locks, "--count", "2", job=SLEEPER)
    try:
        worker = int(job.stdout.readline().split()[1])
        wait_locked(locks, 2)
        busy = recommend_cli(host)
        assert busy.returncode == NO_GPUS and busy.stdout == ""
        os.kill(worker, signal.SIGKILL)  # the job dies
        assert job.wait(timeout=5) == 128 + 9
        assert held_locks(str(locks)) == {}  # freed at once: nothing to clean up
        free = cli(
            "recommend", "--simulate", str(scenario), "--lock-dir", str(locks), "--count", "2"
        )
        assert free.returncode == 0 and free.stdout.count("GPU-") == 2
    finally:
        job.kill()
        job.wait()


def test_the_lock_outlives_the_launcher_while_the_job_lives(host):
    scenario, locks = host
    job = start_run(scenario, locks, job=SLEEPER)
    try:
        gpu, worker = job.stdout.readline().split()
        held = wait_locked(locks, 1)
        assert held[gpu] == job.pid  # the launcher took it
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        assert gpu in held_locks(str(locks))  # the orphaned job still holds the inherited lock
        os.kill(int(worker), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while gpu in held_locks(str(locks)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        job.kill()
        job.wait()


@pytest.mark.parametrize(
    ("job", "status"),
    [
        (("sh", "-c", "exit 3"), 3),
        (("sh", "-c", "kill -KILL $$"), 128 + 9),
        (("sh", "-c", "kill -TERM $$"), 128 + 15),
        (("/nonexistent/program",), 127),
    ],
    ids=["exit-3", "sigkill", "sigterm", "not-found"],
)
def test_exit_status_is_the_jobs(host, job, status):
    result = run_cli(host, "--", *job)
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signals_are_forwarded_to_the_job(host, signum):
    scenario, locks = host
    job = start_run(
        scenario,
        locks,
        job=(sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"),
    )
    try:
        assert job.stdout.readline().strip() == "up"
        job.send_signal(signum)
        assert job.wait(timeout=5) == 128 + signum
    finally:
        job.kill()
        job.wait()


def test_restarts_stop_after_max_restarts(host):
    locks = host[1]
    counter = locks.parent / "attempts"
    result = run_cli(
        host,
        "--restart",
        "on-failure",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        f"echo x >> {counter}; exit 4",
    )
    assert result.returncode == 4
    assert counter.read_text().count("x") == 2
    assert "restart 1 of 1" in result.stderr and "not restarting" in result.stderr
    ok = run_cli(
        host,
        "--restart",
        "on-failure",
        "--",
        "sh",
        "-c",
        f"echo y >> {counter}",
    )
    assert ok.returncode == 0 and counter.read_text().count("y") == 1  # success: no restart


def test_no_restart_onto_a_lost_gpu(host, tmp_path):
    scenario = host[0]
    scenario.write_text(
        "gpus:\n  - {name: GPU A, errors: [{field: '*', error: GpuIsLost, from: 3s}]}\n"
    )
    result = run_cli(
        host,
        "--restart",
        "always",
        "--",
        "sh",
        "-c",
        "sleep 3.5; exit 1",
    )
    assert result.returncode == 1
    assert "is down or lost" in result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--restart", "sometimes"), "--restart"),
        (("--max-restarts", "-1"), "--max-restarts"),
        (("--wait", "soon"), "--wait"),
        (("--count", "0"), "--count"),
        (("--min-free-memory", "lots"), "--min-free-memory"),
        (("--policy", "nope"), "--policy"),
        (("--restart-reset", "0"), "--restart-reset"),
        (("--restart-reset", "soon"), "--restart-reset"),
        (("--max-restarts", "infinite"), "--max-restarts"),
        (("--wait", "inf"), "--wait"),
        (("--min-free-memory", "20"), "did you mean 20GiB?"),
        (("--from", "localhost:9402"), "--from"),
    ],
)
def test_bad_flags_exit_2(host, args, needle):
    result = run_cli(host, *args, "--", "true")
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr


# -- recommend -------------------------------------------------------------------------------------


def test_recommend_formats(host):
    scenario, locks = host
    base = ("recommend", "--simulate", str(scenario), "--lock-dir", str(locks), "--count", "2")
    all_uuids = uuids(scenario, locks)
    assert cli(*base).stdout.strip() == ",".join(all_uuids)
    assert cli(*base, "--format", "index").stdout.strip() == "0,1"
    env = cli(*base, "--format", "env").stdout.splitlines()
    assert env == [
        f"export CUDA_VISIBLE_DEVICES={','.join(all_uuids)}",
        "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "export GPU_EXPORTER_GPUS=0,1",
    ]
    data = json.loads(cli(*base, "--format", "json").stdout)
    assert data["ok"] and [c["index"] for c in data["chosen"]] == [0, 1]


def test_recommend_too_few_prints_nothing_and_exits_75(host):
    result = recommend_cli(host, "--count", "3")
    assert result.returncode == NO_GPUS and result.stdout == ""
    assert "2 of the 3 GPU(s)" in result.stderr
    result = recommend_cli(
        host,
        "--min-free-memory",
        "100GiB",
    )
    assert result.returncode == NO_GPUS and result.stdout == ""
    assert result.stderr.count("below 100.0GiB") == 2


@pytest.mark.parametrize("form", ["index", "uuid", "prefix"])
def test_cuda_visible_devices_limits_the_choice(host, form):
    scenario, locks = host
    second = uuids(scenario, locks)[1]
    value = {"index": "1", "uuid": second, "prefix": second[:12]}[form]
    result = recommend_cli(
        host,
        env=clean_env(CUDA_VISIBLE_DEVICES=value),
    )
    assert result.returncode == 0 and result.stdout.strip() == second
    hidden = recommend_cli(
        host,
        "--count",
        "2",
        env=clean_env(CUDA_VISIBLE_DEVICES=value),
    )
    assert hidden.returncode == NO_GPUS and "hidden by CUDA_VISIBLE_DEVICES" in hidden.stderr


def test_recommend_from_a_running_agent(host, tmp_path):
    scenario, locks = host
    with serve(tmp_path, "--simulate", str(scenario), "--lock-dir", str(locks)) as (agent, port):
        healthz_until(agent, port)
        url = f"http://127.0.0.1:{port}"
        result = cli("recommend", "--from", url, "--count", "2", "--format", "index")
        assert result.returncode == 0 and result.stdout.strip() == "0,1"
        limited = cli(
            "recommend",
            "--from",
            url,
            "--format",
            "index",
            env=clean_env(CUDA_VISIBLE_DEVICES="1"),
        )
        assert limited.stdout.strip() == "1"
        too_many = cli("recommend", "--from", url, "--count", "3")
        assert too_many.returncode == NO_GPUS and too_many.stdout == ""
    gone = cli("recommend", "--from", url)
    assert gone.returncode == 1 and "cannot reach the agent" in gone.stderr


# -- the Python API and the locks ------------------------------------------------------------------


def test_reserve_is_exclusive_and_sets_the_environment(host, monkeypatch):
    scenario, locks = host
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.setenv(name, "")  # so that the end of the test restores them, set or not
        monkeypatch.delenv(name)
    options = {"simulate": str(scenario), "lock_dir": str(locks)}
    with reserve(1, **options) as first:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == first[0].uuid
        assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        with reserve(1, **options) as second:
            assert second[0].uuid != first[0].uuid
            with pytest.raises(NoGpusAvailable), reserve(1, **options):
                pass
    assert held_locks(str(locks)) == {}
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert len(select_devices(2, **options)) == 2


def test_locks_are_all_or_nothing_and_refuse_symlinks(tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    held = try_lock(str(locks), ["GPU-b"])
    assert held is not None
    assert try_lock(str(locks), ["GPU-a", "GPU-b"]) is None
    again = try_lock(str(locks), ["GPU-a"])  # GPU-a was released when GPU-b failed
    assert again is not None
    again.release()
    held.release()
    target = tmp_path / "target"
    target.write_text("precious")
    (locks / "GPU-c.lock").symlink_to(target)
    with pytest.raises(LockError, match="symbolic link"):
        try_lock(str(locks), ["GPU-c"])
    assert target.read_text() == "precious"
    with pytest.raises(LockError, match="invalid GPU UUID"):
        try_lock(str(locks), ["../escape"])
    created = try_lock(str(locks), ["GPU-d"])
    assert stat.S_IMODE(os.stat(locks / "GPU-d.lock").st_mode) == 0o644
    created.release()


def test_visible_device_forms():
    gpus = [
        Gpu(0, "GPU-aaaa-1", True, GpuInfo(0, "GPU-aaaa-1")),
        Gpu(1, "GPU-aaab-2", True, GpuInfo(1, "GPU-aaab-2", mig_uuids=("MIG-xyz-1",))),
    ]
    assert visible_uuids(None, gpus) == (None, "")
    assert visible_uuids("MIG-xyz-1", gpus)[0] == {
        "GPU-aaab-2": "MIG-xyz-1"
    }  # CUDA needs the MIG id
    assert set(visible_uuids("", gpus)[0]) == set()
    assert set(visible_uuids("1", gpus)[0]) == {"GPU-aaab-2"}
    assert set(visible_uuids("GPU-aaab", gpus)[0]) == {"GPU-aaab-2"}
    assert set(visible_uuids("MIG-xyz-1", gpus)[0]) == {"GPU-aaab-2"}
    assert set(visible_uuids("MIG-GPU-aaaa-1/1/0", gpus)[0]) == {"GPU-aaaa-1"}
    visible, note = visible_uuids("0,GPU-aaa,1", gpus)  # an ambiguous prefix: CUDA stops there
    assert set(visible) == {"GPU-aaaa-1"} and "'GPU-aaa'" in note
    assert set(visible_uuids("-1,0", gpus)[0]) == set()


def test_restart_waits_until_the_last_attempt_is_gone(host):
    locks = host[1]
    log = locks.parent / "order"
    # each attempt leaves a background process behind that keeps the lock (and so the GPU)
    job = f"(sleep 2; echo leftover-done >> {log}) & echo attempt >> {log}; exit 1"
    result = run_cli(
        host,
        "--restart",
        "on-failure",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        job,
    )
    assert result.returncode == 1
    deadline = time.monotonic() + 5
    while log.read_text().count("leftover-done") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert log.read_text().split() == ["attempt", "leftover-done", "attempt", "leftover-done"]
