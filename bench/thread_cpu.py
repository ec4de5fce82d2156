#!/usr/bin/env python3
"""The agent's CPU by thread, on the benchmark's simulated host, after a burst of scrapes.

Starts gpu-exporter as bench/benchmark.py does (``--gpus`` x ``--processes``, NVML calls costing
50 us), scrapes it from 16 threads 100 times each (the benchmark's concurrent phase), then once a
second for ``--warm-up`` seconds, and reads every thread's user + system time from
``/proc/PID/task`` over ``--seconds`` more of scrapes once a second. Prints the agent's total
and its busiest threads (by id relative to the agent's PID: the sampler's thread is the
busiest). To compare two builds on one machine, copy this file into the other checkout's
``bench/`` (it runs the agent of the checkout it lies in) and run the two alternately.

    .venv/bin/python bench/thread_cpu.py
    .venv/bin/python bench/thread_cpu.py --seconds 120 --warm-up 130   # the history full
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark


def _scrape(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        conn.getresponse().read()
    finally:
        conn.close()


def _ticks(pid: int) -> dict[int, int]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as handle:
                fields = handle.read().rpartition(")")[2].split()
        except OSError:
            continue  # a thread that ended meanwhile
        out[int(tid)] = int(fields[11]) + int(fields[12])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16, help="per GPU")
    parser.add_argument("--warm-up", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    reaper = benchmark.Reaper()
    folder = tempfile.mkdtemp()
    try:
        host = benchmark.make_host(reaper, args.gpus, args.processes, folder)
        port = benchmark._free_port()
        stats = os.path.join(folder, "stats.json")
        argv_ = benchmark.command(benchmark.OURS, sys.executable, host, stats, port, 1.0)
        agent = reaper.popen(argv_, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                _scrape(port)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

        def burst() -> None:
            for _ in range(100):
                _scrape(port)

        threads = [threading.Thread(target=burst) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for _ in range(int(args.warm_up)):
            _scrape(port)
            time.sleep(1)
        before, started = _ticks(agent.pid), time.monotonic()
        for _ in range(int(args.seconds)):
            _scrape(port)
            time.sleep(1)
        after, elapsed = _ticks(agent.pid), time.monotonic() - started
        agent.send_signal(signal.SIGTERM)
        agent.wait(10)
    finally:
        reaper.stop_all()
    hz = os.sysconf("SC_CLK_TCK")
    used = {tid: (ticks - before.get(tid, 0)) / hz for tid, ticks in after.items()}
    busiest = sorted(used.items(), key=lambda item: -item[1])[:4]
    total = 100 * sum(used.values()) / elapsed
    threads_text = ", ".join(f"+{tid - agent.pid}: {100 * s / elapsed:.2f} %" for tid, s in busiest)
    print(f"agent CPU over {elapsed:.0f} s: {total:.2f} % (threads {threads_text})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
