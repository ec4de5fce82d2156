"""The sampler thread: history, health, and stopping while NVML hangs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from exporter.sampler import Sampler


def test_history_ring_and_health(simulated, collector, clock):
    simulated("gpus: [{name: GPU A}]\n")
    sampler = Sampler(collector, interval=5, deadline=2, history=3, monotonic=clock)
    assert sampler.health().reason == "no sample yet"
    for _ in range(5):
        sampler.sample_once()
        clock.advance(5)
    assert [s.seq for s in sampler.history()] == [3, 4, 5]
    assert sampler.latest.snapshot.seq == 5
    clock.advance(-5 + 7)  # 7 s after the last sample started: within interval + deadline
    assert sampler.health().ok
    clock.advance(0.5)
    health = sampler.health()
    assert not health.ok and health.stale and "7.5s ago" in health.reason


def test_nvml_down_is_unhealthy_but_not_stale(simulated, collector, clock):
    simulated("driver: {errors: [{field: init, error: DriverNotLoaded}]}\ngpus: [{}]\n")
    sampler = Sampler(collector, interval=5, deadline=5, monotonic=clock)
    sampler.sample_once()
    health = sampler.health()
    assert not health.ok and not health.stale
    assert health.reason.startswith("NVML down: DriverNotLoaded")


def test_sampler_survives_a_bug_in_a_sample(simulated, collector):
    simulated("gpus: [{name: GPU A}]\n")
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("bug")

    sampler = Sampler(collector, interval=0.01, deadline=1)
    sampler.collector.sample = broken
    sampler.start()
    time.sleep(0.2)
    assert sampler.stop(1)
    assert len(calls) > 2  # it kept trying every interval


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_while_nvml_hangs_exits_0_within_2s(tmp_path):
    scenario = tmp_path / "hang.yaml"
    scenario.write_text("gpus:\n  - errors: [{field: power, hang: 60s, from: 0.5s}]\n")
    port = _free_port()
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exporter",
            "serve",
            "--simulate",
            str(scenario),
            "--listen",
            f"127.0.0.1:{port}",
            "--interval",
            "0.2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while True:  # wait until the agent is stale: the hang has begun
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
            except urllib.error.HTTPError as exc:
                if exc.code == 503 and b"stale" in exc.read():
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "agent never became stale"
            time.sleep(0.1)
        started = time.monotonic()
        os.kill(agent.pid, signal.SIGTERM)
        code = agent.wait(timeout=5)
        elapsed = time.monotonic() - started
    finally:
        agent.kill()
        agent.wait()
        stderr = agent.stderr.read()
    assert code == 0 and elapsed < 2.0, (code, elapsed, stderr)
    assert "Traceback" not in stderr
    assert "not calling nvmlShutdown" in stderr
