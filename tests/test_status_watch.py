"""``status --watch`` and ``status --from``: frames redrawn in place on a pseudo-terminal (cursor
home, lines erased, nothing scrolls), colours only there and not with NO_COLOR, plain frames when
piped, Ctrl-C and SIGTERM restoring the terminal with exit 0; a running agent's Snapshot shown
as the same table, and an agent that cannot be had said in one line."""

from __future__ import annotations

import contextlib
import fcntl
import http.server
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from exporter.core.health import Check, Verdict
from exporter.core.snapshot import Gpu, GpuInfo, HostInfo, Snapshot
from exporter.status import agent_verdicts, format_status
from exporter.terminal import cut, plain
from tests.agent import clean_env, exporter_cli, free_port, healthz_until, serve
from tests.helpers import write

HOME, CLEAR_BELOW, SHOW, HIDE, RESET = "\x1b[H", "\x1b[J", "\x1b[?25h", "\x1b[?25l", "\x1b[0m"
GREEN, YELLOW, RED = "\x1b[32m", "\x1b[33m", "\x1b[31m"
#: A colour or another attribute (SGR) other than the reset.
SGR_STYLE = re.compile(r"\x1b\[[1-9][0-9;]*m")
#: Constant readings: two runs on it print the same rows. GPU 1 near its slowdown threshold
#: (89 C) with its memory nearly full, GPU 2 past it.
SCENARIO = """
driver: {version: "550.54.15", cuda_version: "12.4"}
gpus:
  - name: NVIDIA H100 80GB HBM3
    memory_total: 80GiB
    utilization: 0.5
    temperature: 50
    power: 300
    processes: [{pid: 1, memory: 4GiB}]
  - name: NVIDIA A100-SXM4-40GB
    memory_total: 40GiB
    memory_used: 39.5GiB
    temperature: 82
  - name: NVIDIA A100-SXM4-40GB
    memory_total: 40GiB
    temperature: 90
"""
#: Comfortably within these: the frame needs 8 lines and 120 columns here.
ROWS, COLUMNS = 40, 160


@pytest.fixture
def scenario(tmp_path: Path) -> str:
    return write(tmp_path, SCENARIO, "watch.yaml")


class Terminal:
    """The real ``gpu-exporter`` on a pseudo-terminal that is its controlling terminal (so that
    Ctrl-C typed there is a SIGINT to it), and what it wrote there."""

    def __init__(self, args: list[str], rows: int, columns: int, **env: str) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
            env=clean_env(**{"TERM": "xterm-256color", **env}),
        )
        os.close(slave)
        self.output = ""

    def read_until(self, done: Callable[[str], bool], what: str, timeout: float = 30) -> str:
        """Read until ``done(output)`` or the end of the output; fails at the deadline."""
        deadline = time.monotonic() + timeout
        while not done(self.output):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {what}: {self.output[-2000:]!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: the other side is closed
                    data = b""
                if not data:
                    break
                self.output += data.decode(errors="replace")
        return self.output

    def frames(self, count: int) -> list[str]:
        """The first ``count`` complete frames (from cursor home to erase below)."""
        self.read_until(lambda out: out.count(CLEAR_BELOW) >= count, f"{count} frames")
        return [f.split(CLEAR_BELOW)[0] for f in self.output.split(HOME)[1:]][:count]

    def finish(self, timeout: float = 30) -> int:
        """Its exit status, once it has exited and all it wrote is read."""
        self.read_until(lambda _: False, "the end of the output", timeout)
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)


@contextlib.contextmanager
def terminal(
    *args: str, rows: int = ROWS, columns: int = COLUMNS, **env: str
) -> Iterator[Terminal]:
    term = Terminal(list(args), rows, columns, **env)
    try:
        yield term
    finally:
        term.close()


def gpu_rows(text: str) -> list[str]:
    """The table without its first line (the host and the sample's time)."""
    table = text[text.index("GPU  NAME") :]
    return [line.rstrip() for line in table.splitlines() if line.strip()]


# -- on a terminal -----------------------------------------------------------------------------


def test_watch_redraws_in_place_in_colour_and_ctrl_c_restores_the_terminal(scenario):
    with terminal("status", "--simulate", scenario, "--watch", "0.2") as term:
        frames = term.frames(3)
        assert term.output.startswith(HIDE + HOME)
        for frame in frames:
            # no newline after the last line: the frame never scrolls the window
            assert frame.count("\n") < ROWS
            lines = [plain(line) for line in frame.replace("\x1b[K", "").split("\r\n")]
            assert lines[0].startswith("Every 200ms: gpu-exporter status --simulate")
            assert "NVIDIA H100 80GB HBM3" in frame and "HEALTH" in frame
            assert all(len(line) < COLUMNS for line in lines)
            assert frame.count("\x1b[K") == len(lines)  # every line erased to its end
        assert GREEN in frames[0] and YELLOW in frames[0] and RED in frames[0]
        assert "WARNING" in plain(frames[0]) and "CRITICAL" in plain(frames[0])  # not colour alone
        os.write(term.master, b"\x03")  # Ctrl-C, typed
        assert term.finish() == 0
        tail = term.output.rsplit(CLEAR_BELOW, 1)[1]
        assert SHOW in tail and RESET in tail and tail.endswith("\n")
        assert "Traceback" not in term.output


def test_sigterm_ends_the_watch_with_the_terminal_restored(scenario):
    with terminal("status", "--simulate", scenario, "--watch") as term:  # every 2 s
        term.frames(1)
        term.proc.terminate()
        assert term.finish() == 0
        assert term.output.endswith(RESET + SHOW + "\r\n")


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}], ids=str)
def test_no_colour_with_no_color_or_a_dumb_terminal(scenario, env):
    with terminal("status", "--simulate", scenario, "--watch", "0.2", **env) as term:
        (frame,) = term.frames(1)
        assert not SGR_STYLE.search(frame) and "WARNING" in frame
        os.write(term.master, b"\x03")
        assert term.finish() == 0
    with terminal("status", "--simulate", scenario, **env) as term:
        assert term.finish() == 0
        assert "\x1b" not in term.output and "CRITICAL" in term.output


def test_status_once_is_in_colour_on_a_terminal_and_plain_when_piped(scenario):
    with terminal("status", "--simulate", scenario) as term:
        assert term.finish() == 0
    assert GREEN in term.output and RED in term.output
    assert HOME not in term.output and HIDE not in term.output  # once: no redrawing
    piped = exporter_cli("status", "--simulate", scenario)
    assert piped.returncode == 0 and "\x1b" not in piped.stdout
    assert gpu_rows(plain(term.output).replace("\r\n", "\n")) == gpu_rows(piped.stdout)


def test_a_small_window_gets_a_frame_cut_to_fit(scenario):
    with terminal("status", "--simulate", scenario, "--watch", "0.2", rows=6, columns=50) as term:
        frames = term.frames(2)
        for frame in frames:
            lines = [plain(line) for line in frame.replace("\x1b[K", "").split("\r\n")]
            assert len(lines) == 6 and lines[-1].startswith("... ")
            assert lines[-1].endswith(" more lines")
            assert all(len(line) < 50 for line in lines)
        os.write(term.master, b"\x03")
        assert term.finish() == 0


# -- piped -------------------------------------------------------------------------------------


@contextlib.contextmanager
def piped(*args: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(TERM="xterm-256color"),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]


def read_frames(proc: subprocess.Popen[bytes], count: int, timeout: float = 30) -> list[str]:
    """The first ``count`` frames a piped watch printed (a blank line between frames)."""
    fd = proc.stdout.fileno()  # type: ignore[union-attr]
    out = b""
    deadline = time.monotonic() + timeout
    while out.count(b"\n\nEvery ") < count:  # the next frame's start ends the one before
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, f"no {count} frames: {out[-2000:]!r}"
        if select.select([fd], [], [], left)[0]:
            out += os.read(fd, 65536)
    return re.split(r"\n\n(?=Every )", out.decode())[:count]


def test_a_piped_watch_prints_plain_frames_one_after_another(scenario):
    with piped("status", "--simulate", scenario, "--watch", "0.2") as proc:
        frames = read_frames(proc, 3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        rest = proc.stdout.read().decode()  # type: ignore[union-attr]
        err = proc.stderr.read().decode()  # type: ignore[union-attr]
    assert "\x1b" not in "".join(frames) + rest and err == ""
    assert frames[0].startswith("Every 200ms: gpu-exporter status --simulate")
    assert all("NVIDIA H100 80GB HBM3" in frame and "WARNING" in frame for frame in frames)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--watch", "0"], "--watch: must be more than 0s"),
        (["--watch", "abc"], "--watch: expected a duration"),
        (["--watch=-1s"], "--watch: expected a duration"),
        (["--watch", "nan"], "--watch"),
        (["--watch", "--json"], "--watch redraws the table and --json prints one document"),
        (["--from", "http://127.0.0.1:1"], "--from shows a running agent's GPUs and --simulate"),
        (["--from", "localhost:9402"], "--from: expected an http:// or https:// URL"),
        (["--timeout", "0"], "--timeout: must be more than 0s"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_bad_watch_and_from_flags_are_usage_errors(scenario, args, needle):
    done = exporter_cli("status", "--simulate", scenario, *args)
    assert done.returncode == 2, done
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and needle in done.stderr, done.stderr


# -- --from ------------------------------------------------------------------------------------


def test_from_a_running_agent_prints_the_same_table_as_status_here(tmp_path, scenario):
    here = exporter_cli("status", "--simulate", scenario)
    assert here.returncode == 0, here.stderr
    with serve(tmp_path, "--simulate", scenario, "--interval", "200ms") as (proc, port):
        healthz_until(proc, port)
        url = f"http://127.0.0.1:{port}"
        there = exporter_cli("status", "--from", url)
        assert there.returncode == 0 and there.stderr == "", there.stderr
        assert gpu_rows(there.stdout) == gpu_rows(here.stdout)
        assert "NVIDIA H100 80GB HBM3" in there.stdout
        document = exporter_cli("status", "--from", url + "/", "--json")
        assert document.returncode == 0, document.stderr
        data = json.loads(document.stdout)
        assert "health" in data and [g["index"] for g in data["gpus"]] == [0, 1, 2]
        with piped("status", "--from", url, "--watch", "0.2") as watching:
            frames = read_frames(watching, 2)
            watching.terminate()
            assert watching.wait(timeout=30) == 0
        assert frames[0].startswith(f"Every 200ms: gpu-exporter status --from {url}")
        assert gpu_rows(frames[1]) == gpu_rows(here.stdout)


def test_a_failed_fetch_shows_in_the_header_and_the_watch_goes_on():
    url = f"http://127.0.0.1:{free_port()}"
    with piped("status", "--from", url, "--watch", "0.2") as proc:
        frames = read_frames(proc, 2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    for frame in frames:
        header, failed = frame.splitlines()[:2]
        assert header.startswith(f"Every 200ms: gpu-exporter status --from {url}")
        assert failed.startswith("failed at ") and f"cannot reach the agent at {url}" in failed


class _Answer(http.server.BaseHTTPRequestHandler):
    status, body = 200, b""

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def answering(status: int, body: bytes) -> Iterator[str]:
    """An HTTP server on a loopback port that answers every GET with ``status`` and ``body``."""
    handler = type("Handler", (_Answer,), {"status": status, "body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("status", "body", "needle"),
    [
        (None, b"", "cannot reach the agent at http://127.0.0.1:"),
        (500, b"sampler crashed\nbadly\n", "/snapshot: HTTP 500: sampler crashed badly"),
        (503, b"no sample yet\n", "/snapshot: HTTP 503: no sample yet"),
        (200, b"<html>not an agent</html>", "/snapshot: not JSON"),
        (200, b'{"gpus": []}', "/snapshot: not a Snapshot: missing required key 'seq'"),
        (200, b"[1, 2]", "/snapshot: not a Snapshot: the document: expected an object"),
    ],
    ids=["closed port", "500", "503", "not JSON", "not a Snapshot", "a list"],
)
def test_an_agent_that_cannot_be_had_is_one_line_and_exit_1(status, body, needle):
    with contextlib.ExitStack() as stack:
        if status is None:
            url = f"http://127.0.0.1:{free_port()}"
        else:
            url = stack.enter_context(answering(status, body))
        for extra in ([], ["--json"]):
            done = exporter_cli("status", "--from", url, "--timeout", "5s", *extra)
            assert done.returncode == 1 and done.stdout == "", done
            assert done.stderr.startswith("gpu-exporter status: "), done.stderr
            assert done.stderr.count("\n") == 1 and needle in done.stderr, done.stderr
            assert "Traceback" not in done.stderr


# -- the table ---------------------------------------------------------------------------------


def _snapshot(*gpus: Gpu) -> Snapshot:
    return Snapshot(1, 1.7e9, 1.0, 0.01, True, HostInfo("host", "550.54.15", "12.4"), gpus)


def _gpu(index: int, celsius: float, used: int) -> Gpu:
    info = GpuInfo(
        index,
        f"GPU-{index}",
        "NVIDIA A100-SXM4-40GB",
        memory_total_bytes=40 << 30,
        temperature_thresholds={"slowdown": 89.0},
    )
    return Gpu(
        index,
        f"GPU-{index}",
        True,
        info,
        memory_used_bytes=used << 30,
        memory_free_bytes=(40 - used) << 30,
        temperature_celsius=celsius,
    )


def test_colours_do_not_move_a_column():
    snapshot = _snapshot(_gpu(0, 40, 1), _gpu(1, 80, 37), _gpu(2, 95, 40))
    coloured = format_status(snapshot, colour=True)
    assert plain(coloured) == format_status(snapshot)
    rows = coloured.splitlines()[2:]
    assert YELLOW + "  80C" + RESET in rows[1] and RED + "  95C" + RESET in rows[2]
    assert YELLOW + f"{'37.0GiB / 40.0GiB':>21}" + RESET in rows[1]  # padded, then painted
    assert RED + f"{'40.0GiB / 40.0GiB':>21}" + RESET in rows[2]
    cool, health = rows[0].split(GREEN)
    assert "\x1b" not in cool and health == "ok" + RESET
    assert cut(coloured.splitlines()[2], 10) == "  0  NVIDI"  # no sequence kept: none added
    assert plain(cut(rows[2], 60)) == plain(rows[2])[:60] and cut(rows[2], 60).endswith(RESET)


def test_the_agents_verdict_is_shown_over_what_one_snapshot_supports():
    snapshot = _snapshot(_gpu(0, 40, 1), _gpu(1, 40, 1))
    document = snapshot.to_dict()
    critical = Verdict(0, "GPU-0", (Check("lost", 0), Check("xid", 2, "XID 79 (reboot) at 10:00")))
    document["gpus"][0]["health"] = critical.to_dict()
    document["gpus"][1]["health"] = None  # the agent's health action has not run yet
    verdicts = agent_verdicts(document)
    assert list(verdicts) == ["GPU-0"]
    sick, healthy = format_status(snapshot, verdicts).splitlines()[2:4]
    assert sick.endswith("CRITICAL XID 79 (reboot) at 10:00") and healthy.endswith(" ok")
    document["gpus"][0]["health"] = {"checks": {"xid": {"status": "dreadful"}}}
    assert agent_verdicts(document) == {}  # unreadable: the Snapshot's own verdict instead


def test_a_failed_sample_keeps_the_last_table_under_the_failure():
    from exporter.status import Frames, Unavailable

    answers: list[object] = [
        Unavailable("NVML is not available: DriverNotLoaded"),
        (_snapshot(_gpu(0, 40, 1)), {}),
        Unavailable("NVML is not available: Uninitialized"),
    ]

    def take():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    frames = Frames(take, 2.0, "gpu-exporter status", colour=False, clock=lambda: 1.7e9)
    header, failed, blank = frames(None)
    assert header.startswith("Every 2s: gpu-exporter status  ") and blank == ""
    assert failed.endswith(": NVML is not available: DriverNotLoaded")  # no table yet
    assert len(frames(80)[0]) == 79  # the header right-aligned to the width
    header, failed, _, *table = frames(None)
    assert failed.startswith("failed at ") and "Uninitialized; the table below is from " in failed
    assert table[1].startswith("GPU  NAME") and "NVIDIA A100-SXM4-40GB" in table[2]
