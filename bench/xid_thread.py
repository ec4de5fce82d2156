#!/usr/bin/env python3
"""The XID thread at rest and at work: its CPU while no XID comes, how quickly it delivers one,
and how long stopping it takes.

The host is simulated (``--gpus`` GPUs, the agent's own settings: one event set, 1 s waits).
The simulated driver's wait blocks until its timeout or the next XID, as a real driver's does in
the kernel; what is measured is the thread's own cost (a wait a second, and the XIDs).

    .venv/bin/python bench/xid_thread.py                # 8 GPUs, 20 s at rest
    .venv/bin/python bench/xid_thread.py --seconds 60
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.core.xid import XidLog
from exporter.sampling.collect import Collector
from exporter.sampling.events import XidWatcher
from exporter.simulate.driver import simulate


def thread_cpu(tid: int) -> float:
    """CPU seconds (user + system) of thread ``tid`` of this process."""
    with open(f"/proc/self/task/{tid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0, help="time at rest measured")
    parser.add_argument("--xids", type=int, default=200, help="XIDs delivered in a burst")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the burst's XIDs are logged, ten per GPU a minute
    with tempfile.TemporaryDirectory() as folder:
        scenario = Path(folder) / "xid.yaml"
        scenario.write_text("gpus:\n" + "  - {}\n" * args.gpus)
        driver = simulate(str(scenario))
        nvml = Nvml(library=driver)
        watcher = XidWatcher(nvml, XidLog())
        collector = Collector(nvml, ProcFs(), xids=watcher)
        watcher.start()
        try:
            while not all(g.xid_events_supported for g in collector.sample().gpus):
                time.sleep(0.05)
            tid = watcher.native_id
            assert tid is not None
            waits, cpu, started = nvml.event_waits, thread_cpu(tid), time.monotonic()
            time.sleep(args.seconds)  # the measurement: the thread at rest for this long
            rest = time.monotonic() - started
            rest_cpu, rest_waits = thread_cpu(tid) - cpu, nvml.event_waits - waits
            cpu, started = thread_cpu(tid), time.monotonic()
            for n in range(args.xids):
                driver.inject_xid(n % args.gpus, 13)
            while sum(sum(g.xid_counts.values()) for g in collector.sample().gpus) < args.xids:
                time.sleep(0.001)
            burst, burst_cpu = time.monotonic() - started, thread_cpu(tid) - cpu
            started = time.monotonic()
            stopped = watcher.stop(2.0)
            stop = time.monotonic() - started
        finally:
            watcher.stop(2.0)
            collector.close()
            driver.stop()
    print(f"XID thread, {args.gpus} simulated GPUs in one event set, 1 s waits")
    print(
        f"  at rest {rest:.1f} s: {rest_cpu:.3f} s CPU ({100 * rest_cpu / rest:.2f} % of a CPU), "
        f"{rest_waits} NVML waits ({rest_waits / rest:.2f} per second)"
    )
    print(
        f"  {args.xids} XIDs delivered and counted in {burst * 1000:.0f} ms ({burst_cpu:.3f} s CPU)"
    )
    print(f"  stop: {stop * 1000:.0f} ms ({'stopped' if stopped else 'STILL RUNNING'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
