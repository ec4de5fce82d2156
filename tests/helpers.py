"""Small helpers shared by the tests: files with known lines, parsed expositions, processes by
command line, and bench scripts as modules."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    """Write dedented ``text`` to ``tmp_path/name``; returns the path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return str(path)


def line_of(path: str, needle: str) -> int:
    """1-based number of the first line of ``path`` that contains ``needle``."""
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in {path}")


def samples(exposition: bytes) -> dict[str, list[Any]]:
    """Samples by name, parsed with prometheus_client's own parser."""
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(exposition.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def one(found: dict[str, list[Any]], name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` with ``labels`` (fails unless exactly one)."""
    matches = [
        s for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, (name, labels, found.get(name))
    return matches[0].value


def pids_running(cmdline: bytes) -> set[int]:
    """PIDs of the processes on this host whose ``/proc/PID/cmdline`` is exactly ``cmdline``."""
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                if handle.read() == cmdline:
                    found.add(int(name))
        except OSError:
            continue
    return found


def load_script(path: Path) -> Any:
    """The module of a script that is not in a package (``bench/*.py``), loaded from ``path``."""
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def agent_config(
    path: str | None,
    flags: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Any:
    """The agent's settings as ``serve`` and ``check-config`` load them: every action's
    settings parsed and a scenario file checked."""
    from exporter.actions.engine import parse_actions
    from exporter.config.settings import load_config
    from exporter.simulate.driver import load_scenario

    return load_config(path, flags, environ, actions=parse_actions, scenario=load_scenario)


def until(check: Callable[[], Any], what: str = "", timeout: float = 20) -> Any:
    """Poll ``check`` until it returns something true; that value (fails after ``timeout``)."""
    end = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < end, f"timed out waiting for {what or check}"
        time.sleep(0.05)
    return value


def as_user(uid: int, action: Callable[[], Any]) -> str:
    """Run ``action`` in a forked child as ``uid``: the repr of what it returned, or
    ``Type: message`` of what it raised."""
    read, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                answer = repr(action())
            except Exception as exc:
                answer = f"{type(exc).__name__}: {exc}"
            os.write(write_end, answer.encode())
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child failed"
    return answer
