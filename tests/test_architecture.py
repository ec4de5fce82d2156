"""The layers hold: import-linter's contracts pass, fail on a planted back-edge, and the API a
training script imports loads no scheduler, Prometheus client or action."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
needs_linter = pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_linter
def test_the_contracts_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_linter
@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        ("core/units.py", "import exporter.sampling.collect", "Layers"),
        ("sampling/sampler.py", "import exporter.exposition.metrics", "Layers"),
        ("launcher/api.py", "import exporter.actions.engine", "launcher"),
        ("core/snapshot.py", "import prometheus_client", "Prometheus"),
    ],
)
def test_a_planted_back_edge_fails(tmp_path, module, planted, contract):
    shutil.copytree(ROOT / "exporter", tmp_path / "exporter")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "exporter" / module
    target.write_text(target.read_text() + f"\n{planted}  # planted\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and contract in result.stdout.split("Broken contracts")[-1]


def test_the_launcher_api_loads_no_scheduler_prometheus_client_or_action():
    code = (
        "import sys, exporter.launcher.api\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('apscheduler', 'prometheus_client')"
        " or m.startswith(('exporter.actions', 'exporter.web', 'exporter.exposition'))]\n"
        "print(','.join(sorted(heavy)))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert found.stdout.strip() == ""


@pytest.mark.parametrize("command", ["recommend", "status"])
def test_a_command_without_yaml_to_read_loads_no_pyyaml(command):
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('LOADED:', 'yaml' in sys.modules))\n"
        f"sys.argv = ['gpu-exporter', {command!r}]\n"
        "from exporter.entry import main\n"
        "sys.exit(main())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_EXPORTER_")}
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert "LOADED: False" in found.stdout, (found.stdout, found.stderr)
