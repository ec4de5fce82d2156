"""Run gpu-exporter or nvitop-exporter in-process on simulated GPUs, counting NVML calls.

    python bench/run_simulated.py SCENARIO.yaml STATS.json -- gpu-exporter ARGS...
    python bench/run_simulated.py SCENARIO.yaml STATS.json -- nvitop-exporter ARGS...

The simulated driver (``exporter.simulate.driver``) is started first and installed as the pynvml
module's own functions (``install_globally`` of ``bench/global_nvml.py``, the one place that
patches pynvml), before the exporter or nvitop is imported, so both exporters call the same
simulated functions (nvitop also calls NVML's C symbols through
``pynvml._nvmlGetFunctionPointer``; those are served too). On SIGUSR1 this process writes
``{"calls": N, "by_function": {...}, "seq": K, "time": T}`` to STATS.json (atomically: a
temporary file, then a rename), where N counts every simulated NVML call so far; ``symbols``
counts the C symbols looked up through ``pynvml._nvmlGetFunctionPointer``.

gpu-exporter runs as ``gpu-exporter serve ARGS...`` without ``--simulate`` (its NVML module calls
pynvml, which is the simulation here), with ``--dev`` set to the simulation's device folder and
``--lock-dir`` to a new empty folder unless ARGS give them. nvitop-exporter runs as
``nvitop-exporter ARGS...``. SIGINT or SIGTERM stops either one; pynvml is then restored and the
simulation stopped.

Only ``exporter.simulate`` (pynvml and PyYAML) is imported from this repository before the
exporter starts, so this works in a virtual environment that has nvitop-exporter and PyYAML with
the repository on PYTHONPATH (see bench/benchmark.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from typing import Any

EXPORTERS = ("gpu-exporter", "nvitop-exporter")


def _usage() -> int:
    print(
        "usage: run_simulated.py SCENARIO.yaml STATS.json -- gpu-exporter|nvitop-exporter ARGS...",
        file=sys.stderr,
    )
    return 2


def _count_c_symbols(driver: Any) -> Counter[str]:
    """Count the C symbols looked up through ``pynvml._nvmlGetFunctionPointer`` (nvitop calls
    some NVML functions that way), and make the ones the simulation answers without one of its
    counted functions (the MPS process lists) count and cost ``call_latency`` like any call."""
    import pynvml

    lookup = pynvml._nvmlGetFunctionPointer
    latency = driver.scenario.call_latency
    symbols: Counter[str] = Counter()

    def pay() -> None:
        until = time.perf_counter() + latency
        while time.perf_counter() < until:
            pass

    def pointer(symbol: str) -> Any:
        symbols[symbol] += 1
        fn = lookup(symbol)
        if "MPSCompute" not in symbol:
            return fn  # its shim calls a counted, paid simulated function

        def counted(*args: Any) -> Any:
            driver.calls[symbol] += 1
            pay()
            return fn(*args)

        return counted

    pynvml._nvmlGetFunctionPointer = pointer  # uninstalling puts pynvml's own back
    return symbols


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--" or argv[3] not in EXPORTERS:
        return _usage()
    scenario, stats_path, exporter, args = argv[0], argv[1], argv[3], argv[4:]
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.dirname(here), here):  # the repository, and this folder
        if path not in sys.path:
            sys.path.insert(0, path)

    from global_nvml import install_globally

    from exporter.simulate.driver import simulate  # before nvitop or exporter.core.nvml

    driver = simulate(scenario)
    uninstall = install_globally(driver)
    symbols = _count_c_symbols(driver)
    seq = 0

    def write_stats(_signum: int = 0, _frame: Any = None) -> None:
        nonlocal seq
        seq += 1
        by_function = dict(driver.calls)  # one C-level copy: the sampler thread may be counting
        data = {
            "calls": sum(by_function.values()),
            "by_function": by_function,
            "symbols": dict(symbols),
            "seq": seq,
            "time": time.monotonic(),
            "pid": os.getpid(),
        }
        tmp = f"{stats_path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.replace(tmp, stats_path)

    signal.signal(signal.SIGUSR1, write_stats)
    # nvitop-exporter's main thread is its sampling loop and ends on KeyboardInterrupt: make
    # SIGTERM stop it the same way. gpu-exporter installs its own SIGTERM handler over this.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    lock_dir = tempfile.mkdtemp(prefix="gpu-exporter-bench-locks-")
    write_stats()
    try:
        if exporter == "gpu-exporter":
            from exporter import cli

            extra = []
            if "--dev" not in args:
                extra += ["--dev", driver.dev_root]
            if "--lock-dir" not in args:
                extra += ["--lock-dir", lock_dir]
            return cli.main(["serve", *args, *extra])
        import nvitop_exporter.cli as nvitop_cli

        # Its default --hostname probes a routable address with a UDP socket; nothing is sent,
        # but the benchmark stays on the loopback interface entirely.
        nvitop_cli.get_ip_address = lambda: "127.0.0.1"
        sys.argv = ["nvitop-exporter", *args]
        return int(nvitop_cli.main() or 0)
    except KeyboardInterrupt:
        return 0
    finally:
        uninstall()
        driver.stop()
        shutil.rmtree(lock_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
