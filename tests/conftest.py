"""Shared fixtures: simulated GPUs from inline scenarios, with a clock the test moves; a
subreaper for tests that make orphans."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from exporter.config.yamlconf import parse_document
from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.sampling.collect import Collector
from exporter.simulate.driver import SimulatedDriver, parse_scenario

PR_SET_CHILD_SUBREAPER = 36


def pytest_report_header() -> str:
    """Which nvidia-ml-py the NVML layer runs on (test.sh runs it on the oldest allowed too)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("nvidia-ml-py")
    except PackageNotFoundError:
        installed = "?"
    return f"pynvml: {pynvml.__file__} (nvidia-ml-py {installed})"


class FakeClock:
    """A monotonic clock that only moves when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class Simulations:
    """``simulated(text)``: a simulated driver started from an inline YAML scenario (stopped
    after the test). ``library`` is the driver started last (pynvml before the first): what
    the ``collector`` fixture's NVML module calls, made before the test gives its scenario."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.started: list[SimulatedDriver] = []
        self.library = _Latest(self)

    def __call__(self, text: str) -> SimulatedDriver:
        scenario = parse_scenario(parse_document(textwrap.dedent(text), "test.yaml").root())
        driver = SimulatedDriver(scenario, self.clock).start()
        self.started.append(driver)
        return driver


class _Latest:
    """A pynvml-shaped library that is the driver a Simulations started last."""

    def __init__(self, simulations: Simulations) -> None:
        self._simulations = simulations

    def __getattr__(self, name: str) -> Any:
        started = self._simulations.started
        return getattr(started[-1] if started else pynvml, name)


@pytest.fixture
def simulated(clock: FakeClock) -> Iterator[Simulations]:
    """Simulated drivers from inline YAML scenarios; stopped after the test."""
    simulations = Simulations(clock)
    yield simulations
    for driver in simulations.started:
        driver.stop()


@pytest.fixture
def collector(simulated: Simulations, clock: FakeClock) -> Iterator[Collector]:
    """A Collector on the test's simulated driver and the real /proc, timed by the fake clock."""
    made = Collector(
        Nvml(library=simulated.library),
        ProcFs("/proc"),
        monotonic=clock,
        clock=lambda: 1.7e9 + clock.now,
    )
    yield made
    made.close()


@pytest.fixture
def dev(tmp_path) -> str:
    """A folder of stand-ins for the device nodes ``nvidia0`` and ``nvidia1`` (``paths.dev``)."""
    root = tmp_path / "dev"
    root.mkdir()
    for minor in range(2):
        (root / f"nvidia{minor}").write_text("")
    return str(root)


@pytest.fixture
def subreaper() -> Iterator[list[int]]:
    """Orphans of this test become its children; every pid appended is killed and reaped."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@pytest.fixture
def host(tmp_path: Path) -> tuple[Path, Path]:
    """A two-GPU scenario (test_launcher's TWO_GPUS) and an empty lock directory."""
    from tests.test_launcher import TWO_GPUS

    scenario = tmp_path / "two.yaml"
    scenario.write_text(TWO_GPUS)
    locks = tmp_path / "locks"
    locks.mkdir()
    return scenario, locks
