"""Start-up cost of the commands people type, next to nvitop's ``nvisel -c 1``.

    .venv/bin/python bench/startup.py            # 8 simulated GPUs, median of 11 runs each
    .venv/bin/python bench/startup.py --runs 5 --skip-nvisel   # ours only (no nvitop venv)

Each command runs as a fresh process on the same simulated 8-GPU host: ``gpu-exporter recommend
--simulate S``, ``status --simulate S`` and ``--version`` from the project's environment;
``nvisel -c 1`` from nvitop's (the virtual environment bench/benchmark.py makes, created on
first use), with the same simulation installed in pynvml before nvitop is imported (nvitop calls
pynvml itself; see bench/global_nvml.py). Wall time from fork to exit, median and minimum, the
commands taking turns (one run of each per round), and for reference a bare ``python -c pass``
and the simulation alone (import the driver, read the scenario, start and stop it) with each
interpreter: a command's "own" time is its median less that floor. The repository's modules are
compiled to bytecode first, as an installed package's are (pip compiles them; an editable
checkout with PYTHONDONTWRITEBYTECODE set would compile every module on every start). Nothing is
asserted: the table is for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GPUS = 8
#: Run nvisel in nvitop's environment on the simulation (nvitop's own NVML calls are answered).
NVISEL = """
import sys
sys.path[:0] = [{repo!r}, {bench!r}]
from global_nvml import install_globally
from exporter.simulate.driver import simulate
driver = simulate({scenario!r})
undo = install_globally(driver)
from nvitop.select import main
sys.argv = ["nvisel", "-c", "1"]
try:
    code = main()
finally:
    undo()
    driver.stop()
sys.exit(code or 0)
"""


#: What both sides pay for the simulation alone: import the simulated driver, read the
#: scenario, start and stop it (no command, no nvitop). Run by each side's interpreter.
FLOOR = """
import sys
sys.path[:0] = [{repo!r}]
from exporter.simulate.driver import simulate
simulate({scenario!r}).stop()
"""


def scenario(folder: str) -> str:
    """An 8-GPU host, each GPU a little busier than the last."""
    path = os.path.join(folder, "startup.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("gpus:\n")
        for i in range(GPUS):
            handle.write(
                f"  - {{name: NVIDIA H100 80GB HBM3, memory_used: {i * 5}GiB, "
                f"utilization: {i / 10:.1f}}}\n"
            )
    return path


def timed(commands: dict[str, list[str]], runs: int) -> dict[str, tuple[float, float]]:
    """Median and minimum wall seconds of each command (output thrown away), run in rounds of
    one run each, so that the machine's drift (a noisy VM) falls on every row alike."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, command in commands.items():
            started = time.perf_counter()
            subprocess.run(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
            )
            times[name].append(time.perf_counter() - started)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def nvitop_python() -> str:
    """nvitop's interpreter, from the virtual environment bench/benchmark.py keeps."""
    spec = importlib.util.spec_from_file_location("benchmark", HERE / "benchmark.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmark"] = module
    spec.loader.exec_module(module)
    return str(module.nvitop_python(module.default_nvitop_venv(), print))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--skip-nvisel", action="store_true", help="ours only")
    args = parser.parse_args()
    ours = str(Path(sys.executable).parent / "gpu-exporter")
    for folder in (REPO / "exporter", HERE):
        compileall.compile_dir(str(folder), quiet=1)
    with tempfile.TemporaryDirectory(prefix="gpu-exporter-startup-") as folder:
        path = scenario(folder)
        floor = FLOOR.format(repo=str(REPO), scenario=path)
        ours_floor = ("simulation alone (ours)", [sys.executable, "-c", floor])
        rows = [
            ("python -c pass (ours)", [sys.executable, "-c", "pass"], None),
            (*ours_floor, None),
            ("gpu-exporter --version", [ours, "--version"], None),
            ("gpu-exporter recommend", [ours, "recommend", "--simulate", path], ours_floor[0]),
            ("gpu-exporter status", [ours, "status", "--simulate", path], ours_floor[0]),
        ]
        if not args.skip_nvisel:
            python = nvitop_python()
            code = NVISEL.format(repo=str(REPO), bench=str(HERE), scenario=path)
            rows += [
                ("python -c pass (nvitop)", [python, "-c", "pass"], None),
                ("simulation alone (nvitop)", [python, "-c", floor], None),
                ("nvisel -c 1", [python, "-c", code], "simulation alone (nvitop)"),
            ]
        results = timed({name: command for name, command, _ in rows}, args.runs)
    print(f"{GPUS} simulated GPUs, {args.runs} runs each, wall time from fork to exit")
    print("own: the median less its interpreter's 'simulation alone' median (the part that is")
    print("the command's own, not the simulated driver's; on a real host NVML's start replaces it)")
    head = f"{'median':>9} {'min':>9} {'of nvisel':>10} {'own':>9} {'own of nvisel':>14}"
    print(f"{'command':<26} {head}")
    anchor = results.get("nvisel -c 1", (0.0, 0.0))[0]
    owns = {name: results[name][0] - results[base][0] for name, _, base in rows if base is not None}
    anchor_own = owns.get("nvisel -c 1", 0.0)
    for name, (median, fastest) in results.items():
        ratio = f"{median / anchor:.2f}" if anchor else "-"
        own = f"{owns[name] * 1000:.0f}ms" if name in owns else ""
        own_ratio = f"{owns[name] / anchor_own:.2f}" if name in owns and anchor_own > 0 else ""
        print(
            f"{name:<26} {median * 1000:>7.0f}ms {fastest * 1000:>7.0f}ms {ratio:>10}"
            f" {own:>9} {own_ratio:>14}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
