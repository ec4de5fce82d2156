"""Shared fixtures: simulated GPUs from inline scenarios, with a clock the test moves."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator

import pytest

from exporter.collect import Collector
from exporter.nvml import Nvml
from exporter.procfs import ProcFs
from exporter.simulate import SimulatedDriver, parse_scenario
from exporter.yamlconf import parse_document


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


@pytest.fixture
def simulated(clock: FakeClock) -> Iterator[Callable[[str], SimulatedDriver]]:
    """Install an inline YAML scenario as pynvml's functions; uninstalled after the test."""
    installed: list[SimulatedDriver] = []

    def install(text: str) -> SimulatedDriver:
        scenario = parse_scenario(parse_document(textwrap.dedent(text), "test.yaml").root())
        driver = SimulatedDriver(scenario, clock).install()
        installed.append(driver)
        return driver

    yield install
    for driver in installed:
        driver.uninstall()


@pytest.fixture
def collector(clock: FakeClock) -> Iterator[Collector]:
    """A Collector on the real NVML module and the real /proc, timed by the fake clock."""
    made = Collector(Nvml(), ProcFs("/proc"), monotonic=clock, clock=lambda: 1.7e9 + clock.now)
    yield made
    made.close()
