"""Daily use of the launcher: impossible requests fail at once, ``run --from``, restarting like a
supervisor, the units and flags people type, planted lock files, the API's exceptions.

Real processes, real signals and real locks on simulated GPUs; every wait is on a condition.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.cli import build_parser
from exporter.config.yamlconf import ConfigError
from exporter.core.locks import LockError, held_locks, try_lock
from exporter.launcher import api
from exporter.launcher.api import reserve, select_devices
from tests.agent import clean_env, healthz_until, serve
from tests.agent import exporter_cli as cli
from tests.helpers import until
from tests.test_launcher import NO_GPUS, RUN, WAIT_TIMEOUT


def on(host: tuple[Path, Path], command: str, *args: str, **kwargs):
    """``gpu-exporter COMMAND`` on the host's simulated GPUs and lock directory, to its end."""
    scenario, locks = host
    return cli(command, "--simulate", str(scenario), "--lock-dir", str(locks), *args, **kwargs)


def gpu_uuids(host: tuple[Path, Path]) -> list[str]:
    result = on(host, "status", "--json")
    return [gpu["uuid"] for gpu in json.loads(result.stdout)["gpus"]]


@contextlib.contextmanager
def started(host: tuple[Path, Path], *args: str) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """``gpu-exporter run ARGS`` running, its standard error in a file; killed and reaped after
    (it reaps its own children)."""
    scenario, locks = host
    err = locks.parent / f"run-{time.monotonic_ns()}.err"
    with err.open("w") as handle:
        proc = subprocess.Popen(
            [*RUN, str(scenario), "--lock-dir", str(locks), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=handle,
            text=True,
            env=clean_env(TMPDIR=str(locks.parent)),
        )
    try:
        yield proc, err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single line a usage error prints (asserting that there is one, and no traceback)."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# -- 1. impossible requests fail at once -----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "why"),
    [
        (("--count", "3"), {}, "3 GPU(s) asked for, and this host has 2"),
        (
            ("--count", "2"),
            {"CUDA_VISIBLE_DEVICES": "1"},
            "2 GPU(s) asked for, and CUDA_VISIBLE_DEVICES shows 1 of this host's 2",
        ),
        (
            ("--min-free-memory", "100GiB"),
            {},
            "1 GPU(s) with 100.0GiB free asked for, and 0 of the 2 GPU(s) it may use have that "
            "much memory in all (the largest: 80.0GiB)",
        ),
    ],
    ids=["count", "visible", "memory"],
)
@pytest.mark.parametrize("wait", [None, "30m", "forever"])
def test_an_impossible_request_fails_at_once(host, args, env, why, wait):
    waiting = ("--wait", wait) if wait else ()
    begun = time.monotonic()
    result = on(host, "run", *args, *waiting, "--", "true", env=clean_env(**env), timeout=20)
    assert result.returncode == NO_GPUS, result.stderr
    assert time.monotonic() - begun < 15  # not after a wait of 30 minutes
    assert result.stderr.startswith(f"gpu-exporter: impossible on this host: {why}\n")
    assert "waiting" not in result.stderr and "Traceback" not in result.stderr
    if wait is None:
        advice = on(host, "recommend", *args, env=clean_env(**env))
        assert advice.returncode == NO_GPUS and advice.stdout == ""
        assert f"impossible on this host: {why}" in advice.stderr


def test_a_possible_but_busy_request_still_waits(host):
    locks = host[1]
    held = try_lock(str(locks), gpu_uuids(host))  # every GPU taken, but it may come back
    assert held is not None
    try:
        result = on(host, "run", "--wait", "1s", "--", "true")
    finally:
        held.release()
    assert result.returncode == WAIT_TIMEOUT, result.stderr
    assert "impossible" not in result.stderr and "waiting up to 1s" in result.stderr


def test_the_api_raises_impossible_request_at_once(host):
    scenario, locks = host
    options = {"simulate": str(scenario), "lock_dir": str(locks)}
    with pytest.raises(api.ImpossibleRequest) as info:
        select_devices(3, **options)
    assert "this host has 2" in info.value.reason
    begun = time.monotonic()
    with pytest.raises(api.NoGpusAvailable) as waited, reserve(3, wait="forever", **options):
        pass  # pragma: no cover - never entered
    assert isinstance(waited.value, api.ImpossibleRequest) and not waited.value.timed_out
    assert waited.value.exit_code == NO_GPUS
    assert time.monotonic() - begun < 10
    with pytest.raises(api.ImpossibleRequest, match="have that much memory in all"):
        select_devices(1, min_free_memory="81GiB", **options)


# -- 2. run --from ---------------------------------------------------------------------------------


def test_run_from_an_agent_locks_and_checks_here(host, tmp_path):
    scenario, locks = host
    first, second = gpu_uuids(host)
    # A long interval: the agent does not see the lock the test takes after its first sample.
    agent_args = ("--simulate", str(scenario), "--lock-dir", str(locks), "--interval", "10m")
    with serve(tmp_path, *agent_args) as (agent, port):
        healthz_until(agent, port)
        url = f"http://127.0.0.1:{port}"
        job = ("sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"')
        result = on(host, "run", "--from", url, "--", *job)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == first  # the agent's choice: the lowest index of a tie
        held = try_lock(str(locks), [first])  # taken now: the agent's Snapshot does not know
        assert held is not None
        try:
            moved = on(host, "run", "--from", url, "--", *job)
            assert moved.returncode == 0, moved.stderr
            assert moved.stdout.strip() == second  # asked again without the GPU locked here
            busy = on(host, "run", "--from", url, "--count", "2", "--wait", "1s", "--", "true")
            assert busy.returncode == WAIT_TIMEOUT, busy.stderr
            assert "reserved by a launcher lock" in busy.stderr
            impossible = on(
                host, "run", "--from", url, "--count", "3", "--wait", "forever", "--", "true"
            )
            assert impossible.returncode == NO_GPUS, impossible.stderr
            assert "impossible on this host" in impossible.stderr
        finally:
            held.release()
    gone = on(host, "run", "--from", url, "--", "true")
    assert gone.returncode == 1
    assert one_line(gone).startswith(f"gpu-exporter: cannot reach the agent at {url}")
    bad = on(host, "run", "--from", "localhost:9402", "--", "true")
    assert bad.returncode == 2 and "--from: expected an http:// or https:// URL" in one_line(bad)
    assert held_locks(str(locks)) == {}


# -- 3. restarting like a supervisor ---------------------------------------------------------------

#: Runs a Supervisor as ``run`` does, with a chosen backoff (``run`` has no flag for it).
SUPERVISED = """
import sys
from exporter.core.locks import open_lock_dir
from exporter.core.selection import Policy
from exporter.launcher.acquire import LocalGpus, acquire
from exporter.launcher.run import RunOptions, Supervisor

scenario, locks, restart, limit, backoff, *command = sys.argv[1:]
with open_lock_dir(locks) as lock_dir, LocalGpus(simulate=scenario, lock_dir=lock_dir) as gpus:
    reservation, devices = acquire(gpus, Policy("p"), visible_env=None)
    options = RunOptions(
        command,
        restart=restart,
        max_restarts=None if limit == "unlimited" else int(limit),
        backoff_initial=float(backoff),
        backoff_max=float(backoff),
    )
    sys.exit(Supervisor(gpus, reservation, devices, options).run())
"""


def supervised(host, restart, limit, backoff, *command, err: Path) -> subprocess.Popen[str]:
    scenario, locks = host
    with err.open("w") as handle:
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                SUPERVISED,
                *map(str, (scenario, locks, restart, limit)),
                str(backoff),
                *command,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=handle,
            text=True,
            env=clean_env(TMPDIR=str(locks.parent)),
        )


def test_unlimited_restarts_go_on_past_any_number(host):
    counter = host[1].parent / "attempts"
    job = ("sh", "-c", f'echo x >> {counter}; [ "$(wc -l < {counter})" -ge 6 ]')
    err = host[1].parent / "supervised.err"
    proc = supervised(host, "on-failure", "unlimited", 0.01, *job, err=err)
    try:
        assert proc.wait(timeout=60) == 0, err.read_text()
    finally:
        proc.kill()
        proc.wait()
    assert counter.read_text().count("x") == 6
    said = err.read_text()
    for attempt in range(1, 6):  # the attempt, its status, the restart and the delay
        line = rf"attempt {attempt} ended with status 1 after [0-9.]+s; restart {attempt} of "
        assert re.search(line + r"unlimited in 0\.01s", said), said
    assert "not restarting: the job succeeded" in said


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["TERM", "INT"]
)
def test_a_signal_during_the_backoff_stops_at_once(host, signum, status):
    err = host[1].parent / "supervised.err"
    proc = supervised(host, "always", "unlimited", 300, "sh", "-c", "exit 3", err=err)
    try:
        until(lambda: "restart 1 of unlimited in 300s" in err.read_text(), "the backoff")
        proc.send_signal(signum)
        assert proc.wait(timeout=20) == status, err.read_text()  # not after 300 s
    finally:
        proc.kill()
        proc.wait()
    name = signal.Signals(signum).name
    assert (
        f"gpu-exporter: stopped by {name} between attempts; not restarting "
        "(attempt 1 ended with status 3)"
    ) in err.read_text()
    assert held_locks(str(host[1])) == {}


def test_the_restart_count_starts_again_after_a_healthy_attempt(host):
    counter = host[1].parent / "attempts"
    # Attempts 1 and 2 run 0.8 s (healthy for --restart-reset 500ms), attempt 3 fails at once.
    job = (
        "sh",
        "-c",
        f'echo x >> {counter}; [ "$(wc -l < {counter})" -le 2 ] && sleep 0.8; exit 1',
    )
    args = ("--restart", "on-failure", "--max-restarts", "1")
    result = on(host, "run", *args, "--restart-reset", "500ms", "--", *job, timeout=60)
    assert result.returncode == 1, result.stderr
    assert counter.read_text().count("x") == 3  # without the reset: 2
    assert result.stderr.count("the restart count starts again") == 2
    assert re.search(r"attempt 2 ended with status 1 after 0\.\ds \(at least", result.stderr)
    assert "not restarting: 1 restart(s) done, --max-restarts 1" in result.stderr
    counter.unlink()
    never = on(host, "run", *args, "--restart-reset", "never", "--", *job, timeout=60)
    assert never.returncode == 1 and counter.read_text().count("x") == 2


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["TERM", "INT"]
)
def test_a_signal_while_waiting_forever_stops_with_a_reason(host, signum, status):
    locks = host[1]
    held = try_lock(str(locks), gpu_uuids(host))
    assert held is not None
    try:
        with started(host, "--wait", "forever", "--", "true") as (proc, err):
            until(lambda: "waiting with no time limit" in err.read_text(), "the wait")
            proc.send_signal(signum)
            assert proc.wait(timeout=20) == status
        name = signal.Signals(signum).name
        said = err.read_text()
        assert f"gpu-exporter: stopped by {name} while choosing GPUs; nothing was started" in said
        assert "Traceback" not in said
    finally:
        held.release()


# -- 4. units and flags people type ----------------------------------------------------------------


def test_ratios_take_percentages(host):
    for value in ("50%", "0.5"):
        result = on(host, "recommend", "--max-utilization", value, "--format", "json")
        assert result.returncode == 0, result.stderr
    busy = on(host, "recommend", "--max-utilization", "150%")
    assert busy.returncode == 2 and "--max-utilization" in one_line(busy)


def test_a_size_without_a_unit_is_refused_everywhere_with_a_hint(host, tmp_path):
    hint = "20 has no unit: did you mean 20GiB? (write 20B for bytes)"
    flag = on(host, "recommend", "--min-free-memory", "20")
    assert flag.returncode == 2 and one_line(flag) == f"gpu-exporter: --min-free-memory: {hint}"
    config = tmp_path / "policies.yaml"
    config.write_text("actions:\n  recommend:\n    policies:\n      p: {min_free_memory: 20}\n")
    yaml = on(host, "recommend", "--config", str(config), "--policy", "p")
    assert yaml.returncode == 2 and hint in one_line(yaml) and str(config) in yaml.stderr
    spelled = on(host, "recommend", "--min-free-memory", "20B")
    assert spelled.returncode == 0, spelled.stderr
    with pytest.raises(api.BadArgument, match=re.escape(hint)):
        select_devices(1, min_free_memory=20, simulate=str(host[0]), lock_dir=str(host[1]))


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--wait", "-5s"),
        ("--max-restarts", "-1"),
        ("--min-free-memory", "-1GiB"),
        ("--restart-reset", "-10m"),
        ("--wait", "soon"),
        ("--max-restarts", "many"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_flag(host, flag, value):
    result = on(host, "run", flag, value, "--", "true")  # the value as its own argument
    assert result.returncode == 2
    assert one_line(result).startswith(f"gpu-exporter: {flag}: ")


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["run", "--bogus", "--", "true"], "usage: gpu-exporter run [FLAGS] -- CMD ARGS..."),
        (["run", "--wait"], "usage: gpu-exporter run [FLAGS] -- CMD ARGS..."),
        (["recommend", "--bogus"], "usage: gpu-exporter recommend [FLAGS]"),
        (["recommend", "--wait", "1s"], "usage: gpu-exporter recommend [FLAGS]"),
        (["run", "--expose-cmdline", "--", "true"], "usage: gpu-exporter run [FLAGS] -- CMD"),
    ],
)
def test_usage_errors_show_the_subcommands_short_usage(argv, usage):
    result = cli(*argv)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith(usage) and lines[1].startswith(f"gpu-exporter {argv[0]}: error:")


def _flags(command: str) -> set[str]:
    options = build_parser().commands[command].options.values()
    return {flag for action in options for flag in action.option_strings}


SELECTION = {"--count", "--policy", "--min-free-memory", "--max-utilization", "--max-temperature"}
SELECTION |= {"--strategy", "--exclusive", "--mig", "--exclude-unhealthy", "--from"}
SETTINGS = {"-h", "--help", "--config", "--simulate", "--proc", "--lock-dir"}


def test_the_launchers_offer_only_the_flags_they_use():
    fleet = {"--prometheus", "--selector", "--spread"}  # recommend's alone: run locks locally
    assert _flags("recommend") == SETTINGS | SELECTION | {"--format"} | fleet
    run = {"--wait", "--restart", "--max-restarts", "--restart-reset"}
    assert _flags("run") == SETTINGS | SELECTION | run
    shown = cli("run", "--help").stdout
    assert "--expose-cmdline" not in shown and "--restart-reset" in shown


# -- 5. a planted link in the lock directory -------------------------------------------------------


def test_a_planted_link_refuses_that_gpu_loudly(host, tmp_path):
    scenario, locks = host
    first, second = gpu_uuids(host)
    victim = tmp_path / "victim"
    link = locks / f"{first}.lock"
    link.unlink(missing_ok=True)  # made by status (as the agent does): planted instead
    link.symlink_to(victim)
    result = on(host, "run", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"')
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == second  # enough GPUs remain: the job runs on another
    warning = f"gpu-exporter: warning: refusing GPU 0 ({first}): {link} is a symbolic link"
    assert warning in result.stderr and f"(owner uid {os.getuid()}" in result.stderr
    both = on(host, "run", "--count", "2", "--wait", "30m", "--", "true")
    assert both.returncode == 1, both.stderr  # too few remain: exit 1 at once, with the reason
    assert warning in both.stderr
    assert "too few GPUs left once those whose lock file cannot be used are refused" in both.stderr
    assert f"GPU 0 ({first}): lock file refused: {link} is a symbolic link" in both.stderr
    with (
        pytest.raises(api.UnusableLockFile) as info,
        reserve(2, simulate=str(scenario), lock_dir=str(locks)),
    ):
        pass  # pragma: no cover - never entered
    assert isinstance(info.value, LockError) and isinstance(info.value, api.LauncherError)
    assert set(info.value.files) == {first} and info.value.exit_code == 1
    assert not victim.exists() and held_locks(str(locks)) == {}


# -- 6. the Python API's exceptions ----------------------------------------------------------------


def test_every_exception_is_a_launch_error_and_what_it_was():
    assert issubclass(api.NoGpusAvailable, api.LaunchError)
    assert issubclass(api.ImpossibleRequest, api.NoGpusAvailable)
    assert issubclass(api.WaitTimedOut, api.NoGpusAvailable)
    assert issubclass(api.NoDriver, api.LauncherError)
    assert issubclass(api.AgentError, api.LauncherError)
    assert issubclass(api.LockDirError, api.LauncherError) and issubclass(
        api.LockDirError, LockError
    )
    assert issubclass(api.UnusableLockFile, api.LockDirError)
    assert issubclass(api.BadArgument, api.LaunchError) and issubclass(api.BadArgument, ValueError)
    assert issubclass(api.BadConfig, api.BadArgument) and issubclass(api.BadConfig, ConfigError)
    from exporter.launcher.acquire import LauncherError, NoGpusAvailable

    assert (LauncherError, NoGpusAvailable) == (api.LauncherError, api.NoGpusAvailable)


def test_the_api_raises_its_own_exceptions(host, tmp_path):
    scenario, locks = host
    options = {"simulate": str(scenario), "lock_dir": str(locks)}
    with pytest.raises(api.BadArgument, match="no policy 'nope'"):
        select_devices(1, policy="nope", **options)
    with pytest.raises(api.BadArgument, match="max_utilization"):
        select_devices(1, max_utilization=2, **options)
    with pytest.raises(api.BadArgument, match="wait"), reserve(1, wait="soon", **options):
        pass  # pragma: no cover - never entered
    config = tmp_path / "bad.yaml"
    config.write_text("intervall: 1s\n")
    with pytest.raises(api.BadConfig) as bad:
        select_devices(1, config=str(config), **options)
    assert isinstance(bad.value, ConfigError) and bad.value.exit_code == 2
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with (
        pytest.raises(api.LockDirError),
        reserve(1, simulate=str(scenario), lock_dir=str(not_a_dir)),
    ):
        pass  # pragma: no cover - never entered
    with reserve(2, set_environment=False, **options):
        begun = time.monotonic()
        with pytest.raises(api.WaitTimedOut) as waited, reserve(1, wait="1s", **options):
            pass  # pragma: no cover - never entered
        assert waited.value.timed_out and waited.value.exit_code == WAIT_TIMEOUT
        assert time.monotonic() - begun >= 1
    with reserve(1, wait="forever", **options) as gpus:  # free: at once
        assert len(gpus) == 1
    with reserve(1, wait=math.inf, **options) as gpus:
        assert len(gpus) == 1


def test_no_driver_is_its_own_exception(tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    script = textwrap.dedent(
        f"""
        from exporter.launcher.api import NoDriver, select_devices
        try:
            select_devices(1, lock_dir={str(locks)!r})
        except NoDriver as exc:
            print("NoDriver:", exc)
        else:
            print("a driver")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, env=clean_env()
    )
    if done.stdout.startswith("a driver"):
        pytest.skip("this host has a working NVIDIA driver")
    assert done.stdout.startswith("NoDriver: NVML is not available"), done.stdout + done.stderr
