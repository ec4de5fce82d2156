#!/usr/bin/env python3
"""Profile gpu-exporter's sampler in-process: Collector.sample + metrics.render under cProfile.

The host is the benchmark's (bench/benchmark.py): ``--gpus`` simulated GPUs x ``--processes``
real processes each, NVML calls costing ``--call-latency`` (50us by default; the functions the
simulation lacks answer NotSupported). One warm-up sample reads the static facts, then
``--samples`` samples are profiled back to back, each one what the sampler thread does per
interval: sample, count, render the exposition.

    .venv/bin/python bench/profile_sampler.py                  # 8 x 16, 50 samples
    .venv/bin/python bench/profile_sampler.py --call-latency 0 # without the driver's cost
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmark

from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.stats import SelfStats
from exporter.simulate.driver import simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16, help="per GPU")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--call-latency", default=benchmark.CALL_LATENCY)
    parser.add_argument("--top", type=int, default=30, help="rows of each listing")
    args = parser.parse_args(argv)

    reaper = benchmark.Reaper()
    folder = tempfile.mkdtemp(prefix="gpu-exporter-profile-")
    driver = None
    try:
        host = benchmark.make_host(
            reaper, args.gpus, args.processes, folder, call_latency=args.call_latency
        )
        driver = simulate(host.scenario)
        locks = os.path.join(folder, "locks")
        os.mkdir(locks)
        collector = Collector(Nvml(library=driver), ProcFs("/proc"), lock_dir=locks)
        stats = SelfStats(interval_seconds=1.0)
        collector.sample()  # warm-up: NVML init and the static facts
        # Plain timing first (cProfile inflates the many small calls, the busy wait's too).
        sampling = rendering = 0.0
        for _ in range(args.samples):
            t0 = time.perf_counter()
            snapshot = collector.sample()
            stats.count(snapshot, 1.0)
            t1 = time.perf_counter()
            render(snapshot, stats)
            sampling, rendering = sampling + t1 - t0, rendering + time.perf_counter() - t1
        print(
            f"without the profiler: {sampling / args.samples * 1e3:.2f} ms to sample, "
            f"{rendering / args.samples * 1e3:.2f} ms to render, per sample"
        )
        calls_before = sum(driver.calls.values())
        profiler = cProfile.Profile()
        size = 0
        started = time.perf_counter()
        profiler.enable()
        for _ in range(args.samples):
            snapshot = collector.sample()
            stats.count(snapshot, 1.0)
            size = len(render(snapshot, stats))
        profiler.disable()
        wall = time.perf_counter() - started
        calls = (sum(driver.calls.values()) - calls_before) / args.samples
        print(
            f"{args.gpus} GPUs x {args.processes} processes, NVML calls cost "
            f"{args.call_latency}: {args.samples} samples, {wall / args.samples * 1e3:.2f} ms "
            f"per sample under cProfile (sample + count + render), {calls:.0f} NVML calls per "
            f"sample ({calls * _seconds(args.call_latency) * 1e3:.2f} ms of driver time), "
            f"exposition {size} bytes"
        )
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(order).print_stats(args.top)
            print(f"\n-- sorted by {order} --")
            print(_trim(out.getvalue()))
        collector.close()
    finally:
        if driver is not None:
            driver.stop()
        reaper.stop_all()
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _seconds(duration: str) -> float:
    from exporter.core.units import parse_duration

    return parse_duration(duration)


def _trim(text: str) -> str:
    """pstats' listing without its blank preamble."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "function calls" in line), 0)
    return "\n".join(line.rstrip() for line in lines[start:] if line.strip())


if __name__ == "__main__":
    sys.exit(main())
