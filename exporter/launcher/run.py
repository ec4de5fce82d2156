"""``gpu-exporter run``: hold the GPUs' locks, run the job on them, forward signals, restart.

The launcher holds the locks until the job's last process has exited: it is the subreaper of the
job's processes (see ``lineage``), so every process the job leaves behind, however it was
started, stays its descendant, and it waits for all of them. The job also inherits the lock
descriptors, so processes that keep them keep the GPUs even if the launcher is killed; with them
goes each lock's mark (``core.locks``), so that a reader in another PID namespace, which cannot
see the dead launcher's ``flock``, still sees the GPUs reserved. The exit status is the job's
main process's (128+N when a signal N ended it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from exporter.core.locks import SUFFIX as LOCK_SUFFIX
from exporter.core.locks import Reservation
from exporter.core.procfs import file_identity, scan_fd_holders
from exporter.core.units import format_duration
from exporter.core.visible import job_environment
from exporter.launcher.acquire import Device, LocalGpus
from exporter.launcher.lineage import children, descendants, set_subreaper

RESTART_POLICIES = ("never", "on-failure", "always")
#: Backoff before restart N (N from 1) is min(BACKOFF_INITIAL * 2**(N-1), BACKOFF_MAX) seconds.
BACKOFF_INITIAL = 1.0
BACKOFF_MAX = 60.0
#: An attempt that ran at least this long was healthy: the restart count (and with it the
#: backoff) starts again from zero, as systemd's start-limit window (``--restart-reset``).
RESTART_RESET = 600.0
#: How long to wait, under the lock, for a finished attempt's GPU memory to come back.
RELEASE_TIMEOUT = 60.0
EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE = 127, 126
#: Signals passed on to the job (and, once its main process has exited, to what it left).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Signals a terminal sends to its whole foreground process group: an interactive job (which
#: stays in our group) got them already.
TERMINAL = (signal.SIGINT, signal.SIGHUP)
#: Why the launcher does not restart after a signal.
_SIGNALLED = "stopped by a signal"
#: Leftover processes named at most in the line that says the launcher waits for them.
SHOWN_PIDS = 10


@dataclass(frozen=True)
class RunOptions:
    """How to supervise the job."""

    command: Sequence[str]
    restart: str = "never"
    max_restarts: int | None = 3  # None: no limit
    restart_reset: float | None = RESTART_RESET  # None: the count never starts again
    backoff_initial: float = BACKOFF_INITIAL
    backoff_max: float = BACKOFF_MAX
    release_timeout: float = RELEASE_TIMEOUT


class _CannotStart(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def exit_status(returncode: int) -> int:
    """A shell's view of a child's end: its code, or 128+N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Runs the job (again, by the restart policy) with signals forwarded to it, and holds the
    locks until the last process of each attempt has exited."""

    def __init__(
        self,
        gpus: LocalGpus,
        reservation: Reservation,
        devices: Sequence[Device],
        options: RunOptions,
        stderr: TextIO = sys.stderr,
    ) -> None:
        self.gpus = gpus
        self.reservation = reservation
        self.devices = list(devices)
        self.options = options
        self.stderr = stderr
        self._child: subprocess.Popen[bytes] | None = None
        self._running = False  # the job's main process is not reaped yet
        self._lingering = False  # it is, and the launcher waits for what it left
        #: A signal got before the wait for leftovers, and the process group that got it already.
        self._pending: tuple[int, int | None] | None = None
        self._others: set[int] = set()  # our children that are not the job's (a simulation's)
        self._own_group = not _interactive()
        self._stopping = threading.Event()
        self._between = False  # no attempt runs: after one, before the next
        self._interrupt: int | None = None  # the signal that came between two attempts
        self._ran = 0.0  # seconds the last attempt's main process ran

    def say(self, message: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # a terminal hung up: no one to tell
            self.stderr.write(f"gpu-exporter: {message}\n")
            self.stderr.flush()

    def run(self) -> int:
        """Run until the job is done for good; returns its exit status."""
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        # An inherited SIG_IGN would make the kernel reap the job without telling its status.
        previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        why = set_subreaper(True)
        if why:
            self.say(
                f"cannot keep track of the job's processes ({why}): processes it leaves behind "
                "keep its GPUs only if they kept the lock descriptors"
            )
        try:
            return self._loop()
        finally:
            if not why:
                set_subreaper(False)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.reservation.release()

    def _loop(self) -> int:
        env = {**os.environ, **job_environment(self.devices)}
        attempt = restarts = 0
        while True:
            attempt += 1
            self._between = False
            try:
                status = self._attempt(env)
            except _CannotStart as exc:
                self.say(str(exc))
                return exc.status
            finally:
                self._between = True
            ran = self._ran
            if self._healthy(ran):
                restarts = 0
            reason = self._no_restart(status, restarts)
            if reason == _SIGNALLED and self._interrupt is not None:  # between two attempts
                return self._interrupted(attempt, status)
            if reason:
                if self.options.restart != "never":
                    self.say(f"not restarting: {reason}")
                return status
            restarts += 1
            delay = min(
                self.options.backoff_initial * 2 ** (restarts - 1), self.options.backoff_max
            )
            self.say(self._restarting(attempt, status, ran, restarts, delay))
            if self._stopping.wait(delay):
                return self._interrupted(attempt, status)

    def _healthy(self, ran: float) -> bool:
        """Whether an attempt that ran ``ran`` seconds resets the restart count."""
        reset = self.options.restart_reset
        return reset is not None and ran >= reset

    def _restarting(
        self, attempt: int, status: int, ran: float, restarts: int, delay: float
    ) -> str:
        """The line that says a restart is coming: the attempt, its status, the delay."""
        limit = "unlimited" if self.options.max_restarts is None else self.options.max_restarts
        reset = ""
        if self._healthy(ran):
            after = format_duration(self.options.restart_reset or 0.0)
            reset = f" (at least --restart-reset {after}: the restart count starts again)"
        return (
            f"attempt {attempt} ended with status {status} after {_took(ran)}{reset}; "
            f"restart {restarts} of {limit} in {delay:g}s"
        )

    def _interrupted(self, attempt: int, status: int) -> int:
        """Stop between two attempts on a signal: say so, and exit 128+N."""
        signum = self._interrupt if self._interrupt is not None else signal.SIGTERM
        self.say(
            f"stopped by {signal.Signals(signum).name} between attempts; not restarting "
            f"(attempt {attempt} ended with status {status})"
        )
        return 128 + signum

    def _attempt(self, env: dict[str, str]) -> int:
        """Run the job once; its main process's status, once every process of it has exited."""
        self.reservation.inheritable()
        self._others = children(os.getpid())
        self._pending = None
        group: dict[str, Any] = {}
        if self._own_group:  # signals reach the job's workers too, once
            group = (
                {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
            )
        try:
            self._child = subprocess.Popen(
                list(self.options.command), env=env, pass_fds=self.reservation.fds, **group
            )
        except FileNotFoundError:
            raise _CannotStart(
                EXIT_NOT_FOUND, f"command not found: {self.options.command[0]}"
            ) from None
        except PermissionError:
            raise _CannotStart(
                EXIT_NOT_EXECUTABLE, f"command not executable: {self.options.command[0]}"
            ) from None
        self._running, started = True, time.monotonic()
        status = self._wait_main(self._child)
        self._ran = time.monotonic() - started
        self._wait_leftovers(status)
        return status

    def _wait_main(self, child: subprocess.Popen[bytes]) -> int:
        """Reap children until the job's main process is among them; its exit status."""
        while True:
            try:
                pid, raw = os.waitpid(-1, 0)  # also reaps leftovers that end meanwhile
            except ChildProcessError:  # not ours to wait for after all: Popen knows
                self._running = False
                return exit_status(child.wait())
            self._others.discard(pid)  # reaped: its pid may now name a process of the job
            if pid == child.pid:
                child.returncode = os.waitstatus_to_exitcode(raw)
                self._running = False
                return exit_status(child.returncode)

    def _leftovers(self) -> list[int]:
        """The living processes of the job once its main process has exited."""
        return descendants(os.getpid(), skip=self._others)

    def _wait_leftovers(self, status: int) -> None:
        """Hold the locks until no process of the job is left, reaping each as it ends."""
        self._lingering = True  # from now on a signal goes to the leftovers
        try:
            left = self._leftovers()
            if left:
                self._announce(status, left)
            pending, self._pending = self._pending, None
            if left and pending:  # stopped while it ran: what it left must stop too
                self._to_leftovers(*pending)
            while self._job_may_be_left():
                try:
                    pid, _ = os.waitpid(-1, 0)
                except ChildProcessError:
                    return  # no child left: every process of the job has been reaped
                self._others.discard(pid)
        finally:
            self._lingering = False

    def _announce(self, status: int, left: list[int]) -> None:
        more = ", ..." if len(left) > SHOWN_PIDS else ""
        self.say(
            f"the job ended with status {status}; waiting for its {len(left)} leftover "
            f"process(es) ({', '.join(map(str, left[:SHOWN_PIDS]))}{more}), which keep its GPUs "
            "locked until they exit"
        )

    def _job_may_be_left(self) -> bool:
        """Whether to wait on: with no other children, until waitpid finds none (which needs no
        view of /proc: a process of the job may be hidden there); with others (a simulation's),
        while /proc shows a process of the job."""
        return not self._others or bool(self._leftovers())

    def _no_restart(self, status: int, restarts: int) -> str:
        """Why not to restart now ('' to restart)."""
        if self.options.restart == "never":
            return "restart never"
        if self.options.restart == "on-failure" and status == 0:
            return "the job succeeded"
        limit = self.options.max_restarts
        if limit is not None and restarts >= limit:
            return f"{restarts} restart(s) done, --max-restarts {limit}"
        if self._stopping.is_set():
            return _SIGNALLED
        return self._gpus_ready()

    def _gpus_ready(self) -> str:
        """Wait under the lock until the last attempt's GPU memory is released; '' when it is.

        Released means: no process of the job is left (none holds our lock descriptors but us),
        and NVML no longer lists any process of it on our GPUs (the driver frees a context a
        little after its process ends).
        """
        deadline = time.monotonic() + self.options.release_timeout
        mine = {d.uuid for d in self.devices}
        held = (file_identity(f"/proc/self/fd/{fd}") for fd in self.reservation.fds)
        locks = {identity: "job" for identity in held if identity is not None}
        job = {self._child.pid} if self._child is not None else set()
        while True:
            snapshot = self.gpus.sample()
            by_uuid = {g.uuid: g for g in snapshot.gpus}
            for uuid in mine:
                gpu = by_uuid.get(uuid)
                if gpu is None or not gpu.up:
                    return f"GPU {uuid} is down or lost ({gpu.error if gpu else 'gone'})"
            holders, _ = scan_fd_holders(self.gpus.proc_root, locks, (LOCK_SUFFIX,))
            left = holders.get("job", set()) - {os.getpid()}
            job |= left  # every process seen holding the job's locks is the job's
            listed = [p.pid for u in mine for p in by_uuid[u].processes or () if p.pid in job]
            if not left and not listed:
                return ""
            if time.monotonic() >= deadline:
                limit = self.options.release_timeout
                return f"GPU memory of the last attempt not released after {limit:g}s"
            if self._stopping.wait(0.5):
                return _SIGNALLED

    def _forward(self, signum: int, _frame: Any) -> None:
        """Pass a signal on: to the job while its main process runs (its whole process group when
        it has its own), to every process it left behind while the launcher waits for them."""
        self._stopping.set()
        if self._between and self._interrupt is None:  # no job to pass it to: stop
            self._interrupt = signum
            return
        if self._lingering:
            self._to_leftovers(signum, self._terminal_group(signum))
            return
        reached = self._terminal_group(signum)
        if self._running and self._child is not None:
            reached = self._to_job(self._child.pid, signum)
        self._pending = (signum, reached)  # for what the job leaves behind

    def _to_job(self, pid: int, signum: int) -> int | None:
        """Send ``signum`` to the job's main process ``pid``, or its process group when it has its
        own; the process group that got it (from us or from the terminal), if any."""
        if not self._own_group and signum in TERMINAL:
            return os.getpgrp()  # the terminal sent it to the job's (and our) group already
        with contextlib.suppress(OSError):  # gone, or not ours to signal any more (setuid)
            if self._own_group:
                os.killpg(pid, signum)
            else:
                os.kill(pid, signum)
        return pid if self._own_group else None

    def _terminal_group(self, signum: int) -> int | None:
        """The process group a terminal sent ``signum`` to already, if it may have."""
        return os.getpgrp() if not self._own_group and signum in TERMINAL else None

    def _to_leftovers(self, signum: int, reached: int | None) -> None:
        """Send ``signum`` to every leftover process of the job, except those of the process
        group ``reached``, which got it already."""
        for pid in self._leftovers():
            with contextlib.suppress(OSError):  # gone, or not ours to signal (setuid)
                if reached is None or os.getpgid(pid) != reached:
                    os.kill(pid, signum)


def _took(seconds: float) -> str:
    """``0.4s``, ``12s``, ``3m20s``, ``2h5m``: how long an attempt ran."""
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60}s"
    return f"{whole // 3600}h{whole % 3600 // 60}m"


def _interactive() -> bool:
    """A job on a terminal stays in our process group, so it can read from the terminal."""
    try:
        return os.isatty(sys.stdin.fileno()) and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False
