"""The sampler thread: history, health, and stopping while NVML hangs."""

from __future__ import annotations

import signal
import time

import pytest

from exporter.exposition.metrics import render
from exporter.sampling.sampler import Sampler
from tests.agent import healthz_until, http_get, serve, stderr_of


def test_history_ring_and_health(simulated, collector, clock):
    simulated("gpus: [{name: GPU A}]\n")
    sampler = Sampler(collector, interval=5, deadline=2, history=3, monotonic=clock, render=render)
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


def test_history_keeps_process_lists_only_on_the_latest(simulated, collector, clock):
    simulated("gpus: [{processes: [{pid: 4242, memory: 1GiB}]}]\n")
    sampler = Sampler(collector, interval=5, deadline=2, history=3, monotonic=clock, render=render)
    for _ in range(4):
        sampler.sample_once()
        clock.advance(5)
    history = sampler.history()
    assert [gpu.processes for s in history[:-1] for gpu in s.gpus] == [None, None]
    assert [p.pid for p in history[-1].gpus[0].processes] == [4242]
    assert history[-1] is sampler.latest.snapshot  # the published one, whole
    assert history[0].gpus[0].memory_used_bytes is not None  # GPU figures stay


def test_nvml_down_is_unhealthy_but_not_stale(simulated, collector, clock):
    simulated("driver: {errors: [{field: init, error: DriverNotLoaded}]}\ngpus: [{}]\n")
    sampler = Sampler(collector, interval=5, deadline=5, monotonic=clock, render=render)
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

    sampler = Sampler(collector, interval=0.01, deadline=1, render=render)
    sampler.collector.sample = broken
    sampler.start()
    time.sleep(0.2)
    assert sampler.stop(1)
    assert len(calls) > 2  # it kept trying every interval


def test_sigterm_while_nvml_hangs_exits_0_within_2s(tmp_path):
    scenario = tmp_path / "hang.yaml"
    scenario.write_text("gpus:\n  - errors: [{field: power, hang: 60s, from: 0.5s}]\n")
    with serve(tmp_path, "--simulate", str(scenario), "--interval", "0.2") as (agent, port):
        assert healthz_until(agent, port, "stale") == 503  # the hang has begun
        started = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=5)
        elapsed = time.monotonic() - started
        stderr = stderr_of(agent)
    assert code == 0 and elapsed < 2.0, (code, elapsed, stderr)
    assert "Traceback" not in stderr
    assert "not calling nvmlShutdown" in stderr


def _real_nvml_works() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_real_nvml_works(), reason="a real NVIDIA driver answers here")
def test_serve_without_a_driver_stays_up_and_reports_nvml_down(tmp_path):
    with serve(tmp_path, "--interval", "0.1") as (agent, port):
        assert healthz_until(agent, port, "NVML down: LibraryNotFound") == 503
        wanted = 'gpu_exporter_sample_errors_total{error="LibraryNotFound",source="nvml"} 2.0'
        deadline = time.monotonic() + 5
        while wanted not in (body := http_get(f"http://127.0.0.1:{port}/metrics")[1]):
            assert time.monotonic() < deadline, body  # retried at 0 s and 1 s (backoff 1 s, 2 s)
            time.sleep(0.1)
        assert "gpu_exporter_nvml_up 0.0" in body
        assert "gpu_up" not in body
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=3) == 0
        stderr = stderr_of(agent)
    assert stderr.count("NVML unavailable") == 1, stderr
    assert "Traceback" not in stderr
