"""The real ``gpu-exporter serve`` as a child process, for tests that need the whole agent."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without GPU_EXPORTER_* and CUDA_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_EXPORTER_", "CUDA_"))}
    env.update(extra)
    return env


def exporter_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``python -m exporter ARGS`` to its end, output captured, in :func:`clean_env` unless
    ``env`` is given."""
    return subprocess.run(
        [sys.executable, "-m", "exporter", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env() if env is None else env,
        stdin=subprocess.DEVNULL,
        **kwargs,
    )


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a GET; HTTP errors are answers too."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@contextlib.contextmanager
def serve(
    tmp_path: Path, *args: str, preexec_fn: Callable[[], None] | None = None
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A running ``gpu-exporter serve ARGS`` on a free loopback port (``preexec_fn`` runs in the
    child before it starts, to drop privileges); stopped and reaped after."""
    port = free_port()
    err = (tmp_path / f"serve-{port}-{time.monotonic_ns()}.err").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "serve", "--listen", f"127.0.0.1:{port}", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=err,
        text=True,
        env=clean_env(TMPDIR=str(tmp_path)),  # its simulated device folder goes with the test's
        preexec_fn=preexec_fn,
    )
    proc.stderr_path = err.name  # type: ignore[attr-defined]
    try:
        yield proc, port
    finally:
        stop(proc, 3)  # SIGTERM first: it stops its simulated processes and cleans up
        err.close()


def stop(proc: subprocess.Popen[Any], timeout: float) -> None:
    """SIGTERM ``proc`` (unless it has ended), SIGKILL it after ``timeout`` s, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def stderr_of(proc: subprocess.Popen[str]) -> str:
    """What a process started by :func:`serve` has written to standard error so far."""
    return Path(proc.stderr_path).read_text()  # type: ignore[attr-defined]


def logged_until(
    proc: subprocess.Popen[str], text: str, count: int = 1, timeout: float = 10
) -> str:
    """Wait until the agent's standard error holds ``text`` ``count`` times; returns it."""
    deadline = time.monotonic() + timeout
    while (log := stderr_of(proc)).count(text) < count:
        assert proc.poll() is None, f"server exited {proc.returncode}: {log}"
        assert time.monotonic() < deadline, f"{text!r} not logged {count} times: {log}"
        time.sleep(0.02)
    return log


def healthz_until(
    proc: subprocess.Popen[str], port: int, wanted: str = "ok", timeout: float = 10
) -> int:
    """Poll /healthz until its body starts with ``wanted``; returns the status."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited {proc.returncode}: {stderr_of(proc)}"
        try:
            status, body = http_get(f"http://127.0.0.1:{port}/healthz")
        except OSError as exc:  # not listening yet
            last = exc
        else:
            if body.startswith(wanted):
                return status
            last = (status, body)
        time.sleep(0.05)
    raise AssertionError(f"/healthz never said {wanted!r} (last: {last}): {stderr_of(proc)}")


@contextlib.contextmanager
def running(argv: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """A server process (Prometheus, Alertmanager) with its output in ``log``, stopped (and
    killed when it does not stop within 10 s) at the end."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            stop(proc, 10)
