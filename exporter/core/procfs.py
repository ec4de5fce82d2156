"""Read what the kernel knows about a process from a procfs root (``/proc``, or ``/host/proc``).

Processes vanish between any two reads: every read tolerates that, and a process whose
``stat`` cannot be read is reported as not visible rather than raising.
"""

from __future__ import annotations

import os
import pwd
import re
import resource
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass

#: A command line longer than this is cut (it may be megabytes; it is for display only).
MAX_CMDLINE_BYTES = 4096
_MAX_FILE_BYTES = 1 << 20  # any other procfs file: far more than a real one holds
_CONTAINER_ID = re.compile(r"(?<![0-9a-f])([0-9a-f]{64})(?![0-9a-f])")
_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)
#: A Slurm job's cgroup, from the task/cgroup plugin: cgroup v1 ``.../slurm/uid_U/job_J/step_S``
#: (``slurm_<nodename>`` on some builds: 22.05 puts it under ``freezer:/slurm_<node>/...``) and
#: cgroup v2 ``.../slurmstepd.scope/job_J/step_S/...``; steps are numbers or batch, extern,
#: interactive.
_SLURM_JOB = re.compile(
    r"(?:/slurm(?:_[^/]+)?/uid_\d+|/slurmstepd\.scope)/job_(\d+)(?:/step_([0-9]+|[a-z]+)\b)?"
)
_COMM_MAX = 15  # the kernel truncates comm to 15 characters


@dataclass(frozen=True)
class ProcessInfo:
    """What procfs says about one live process."""

    pid: int
    name: str
    state: str
    ppid: int
    pgid: int
    sid: int
    start_ticks: int
    start_time: float | None
    uid: int | None
    user: str
    cmdline: tuple[str, ...]
    container_id: str
    pod_uid: str
    #: the script a Python interpreter runs (``train.py``, or the module of ``-m``); "" otherwise
    script: str = ""
    #: the Slurm job and step its cgroup puts it in ("" outside Slurm's task/cgroup plugin)
    slurm_job: str = ""
    slurm_step: str = ""


@dataclass(frozen=True)
class Credentials:
    """Who a process runs as and what it runs: read only when the reaper means to act on it."""

    #: real, effective, saved and filesystem uid (``Uid:`` in ``status``)
    uids: tuple[int, ...]
    #: the file name of its executable (``exe``), "" when it cannot be read
    exe: str


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


def parse_cgroup(text: str) -> tuple[str, str]:
    """(container id, pod uid) from the contents of ``/proc/PID/cgroup``; empty when absent."""
    container, pod = "", ""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        if not container and (matches := _CONTAINER_ID.findall(path)):
            container = matches[-1]
        if not pod and (match := _POD_UID.search(path)):
            pod = match.group(1).replace("_", "-")
    return container, pod


def parse_slurm(text: str) -> tuple[str, str]:
    """(Slurm job id, step) from the contents of ``/proc/PID/cgroup``; empty when absent."""
    for line in text.splitlines():
        found = _SLURM_JOB.search(line.split(":", 2)[-1])
        if found:
            return found.group(1), found.group(2) or ""
    return "", ""


class ProcFs:
    """Process facts from one procfs root, with the user-name lookups cached."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root
        self._ticks_per_second = os.sysconf("SC_CLK_TCK")
        self._boot_time: float | None = None
        self._users: dict[int, str] = {}
        #: pid -> (start ticks, comm, cmdline, its cgroup's owners: container, pod, job, step):
        #: what stays the same for the life of a process (past its exec), so it is read once,
        #: not every sample.
        self._lasting: dict[int, tuple[int, str, tuple[str, ...], tuple[str, str, str, str]]] = {}
        #: pid -> its kept directory and ``stat``, for ``process(pid, keep=True)``
        self._kept: dict[int, _Kept] = {}
        self._kept_limit = _kept_limit() if _is_procfs(root) else 0  # a copy's files don't end
        self._lock = threading.Lock()  # the sampler and the reaper share one ProcFs

    def retain(self, pids: set[int]) -> None:
        """Forget what was remembered about processes other than ``pids`` (and close the files
        kept open for them)."""
        for pid in [pid for pid in self._lasting if pid not in pids]:
            del self._lasting[pid]
        with self._lock:
            for pid in [pid for pid in self._kept if pid not in pids]:
                self._kept.pop(pid).close()

    def close(self) -> None:
        """Close the files kept open; reads after this open them again."""
        with self._lock:
            for kept in self._kept.values():
                kept.close()
            self._kept.clear()

    def _read(self, dirfd: int, name: str) -> bytes | None:
        """The file ``name`` of the process whose directory ``dirfd`` is; None when unreadable."""
        limit = MAX_CMDLINE_BYTES if name == "cmdline" else _MAX_FILE_BYTES
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
        except OSError:  # vanished, permission denied, not a process
            return None
        try:
            data = b""
            while len(data) < limit and (chunk := os.read(fd, limit - len(data))):
                data += chunk
            return data
        except OSError:  # ended while read (ESRCH), or not a file
            return None
        finally:
            os.close(fd)

    def boot_time(self) -> float | None:
        """The host's boot time (``btime`` in ``<root>/stat``), seconds since the epoch."""
        if self._boot_time is None:
            try:
                with open(f"{self.root}/stat", "rb") as handle:
                    for line in handle:
                        if line.startswith(b"btime "):
                            self._boot_time = float(line.split()[1])
                            break
            except (OSError, ValueError, IndexError):
                return None
        return self._boot_time

    def user_name(self, uid: int) -> str:
        """The user name of ``uid``, or the number when this host's passwd does not know it."""
        name = self._users.get(uid)
        if name is None:
            try:  # a name that is not UTF-8 comes back with surrogates: escape it as in comm
                name = _decode(os.fsencode(pwd.getpwuid(uid).pw_name))
            except (KeyError, OverflowError):
                name = str(uid)
            if len(self._users) > 4096:
                self._users.clear()
            self._users[uid] = name
        return name

    def process(self, pid: int, keep: bool = False) -> ProcessInfo | None:
        """Facts about ``pid``, or None when it is not visible under this root.

        ``keep``: keep the process's directory and ``stat`` open (until :meth:`retain` leaves it
        out, or it ends), so that the next call reads one file it already has open instead of
        looking the process up again: the sampler's call for every GPU process, every sample.
        """
        if pid <= 0:
            return None
        with self._lock:
            kept = self._kept.get(pid)
            if kept is not None:
                try:
                    return self._reread(pid, kept)
                except OSError:  # it ended (ESRCH): its PID may be another process's by now
                    self._kept.pop(pid).close()
        try:  # every read goes through the open directory: it stays this process's, even when
            # the process ends and its PID is reused meanwhile (those reads then fail)
            dirfd = os.open(f"{self.root}/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        stat_fd = -1
        try:
            stat_fd = os.open("stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
            kept = _Kept(dirfd, stat_fd)
            info = self._reread(pid, kept)
            if keep and info is not None:
                with self._lock:
                    if pid not in self._kept and len(self._kept) < self._kept_limit:
                        self._kept[pid] = kept
                        dirfd = stat_fd = -1  # now the kept one's to close
            return info
        except OSError:  # vanished, permission denied, not a process
            return None
        finally:
            for fd in (stat_fd, dirfd):
                if fd >= 0:
                    os.close(fd)

    def credentials(self, pid: int, start_ticks: int) -> Credentials | None:
        """The uids and executable of ``pid`` if it is still the process that started at
        ``start_ticks``; None when it is gone, reused or its ``status`` cannot be read."""
        try:
            dirfd = os.open(f"{self.root}/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            stat = self._read(dirfd, "stat")
            status = self._read(dirfd, "status")
            if stat is None or status is None or _start_ticks(stat) != start_ticks:
                return None
            uids = next(
                (
                    tuple(int(part) for part in line.split()[1:])
                    for line in status.splitlines()
                    if line.startswith(b"Uid:")
                ),
                (),
            )
            try:
                exe = os.readlink("exe", dir_fd=dirfd)
            except OSError:  # a kernel thread, or not ours to read
                exe = ""
            name = os.path.basename(exe.removesuffix(" (deleted)"))
            return Credentials(uids, name) if uids else None
        except ValueError:
            return None
        finally:
            os.close(dirfd)

    def hides_processes(self) -> bool:
        """True when this procfs is mounted with ``hidepid``: a process missing from it may
        exist all the same. Read from this process's mount table; unknown counts as hiding."""
        mount = _mount_of(self.root)
        if mount is None:
            return True
        options = mount[1].split(b",")
        values = [o.split(b"=", 1)[1] for o in options if o.startswith(b"hidepid=")]
        return bool(values) and values[-1] not in (b"0", b"off")

    def in_own_pid_namespace(self) -> bool:
        """True when this procfs shows the agent's own PID namespace, so a PID read here is the
        PID a signal reaches (``<root>/self`` names this process by its own PID)."""
        try:
            return os.readlink(f"{self.root}/self") == str(os.getpid())
        except OSError:
            return False

    def _reread(self, pid: int, kept: _Kept) -> ProcessInfo | None:
        """The process of ``kept``'s files as they read now: the ProcessInfo of the last read
        again when nothing it says changed. OSError when the process is gone."""
        uid = os.fstat(kept.dir_fd).st_uid  # the directory's owner is the process's euid, now
        stat = os.pread(kept.stat_fd, _STAT_BYTES, 0)
        close_paren = stat.rfind(b")")
        if close_paren < 0:
            return None  # not a stat line: not visible
        # the name, state, ppid, pgid and sid: what can change while the kept files are the
        # same process's (its start time cannot)
        facts = (stat[:close_paren], *stat[close_paren + 2 :].split(None, 4)[:4], uid)
        if kept.info is None or facts != kept.facts:
            # state, ppid, pgid, sid, ..., start time: the fields up to the 22nd
            rest = stat[close_paren + 2 :].split(None, 20)
            if len(rest) < 21:
                return None  # a zombie's may be cut short: not visible
            kept.facts, kept.info = facts, self._process(pid, kept.dir_fd, stat, rest, uid)
        return kept.info

    def _process(
        self, pid: int, dirfd: int, stat: bytes, rest: list[bytes], uid: int
    ) -> ProcessInfo | None:
        try:
            comm = _decode(stat[stat.index(b"(") + 1 : stat.rindex(b")")])
            state = rest[0].decode("ascii", "replace")
            ppid, pgid, sid = int(rest[1]), int(rest[2]), int(rest[3])
            start_ticks = int(rest[19])
        except (ValueError, IndexError):
            return None
        known = self._lasting.get(pid)
        if known is not None and known[:2] == (start_ticks, comm):
            cmdline, owners = known[2:]
        else:  # first sight of this process (same pid, start time and program): read the rest
            raw_cmdline = self._read(dirfd, "cmdline")
            cgroup = self._read(dirfd, "cgroup")
            if (raw_cmdline is None or cgroup is None) and self._read(dirfd, "stat") is None:
                return None  # it ended meanwhile: not half of what it was
            cmdline = tuple(_decode(part) for part in (raw_cmdline or b"").split(b"\0") if part)
            text = _decode(cgroup) if cgroup else ""
            owners = (*parse_cgroup(text), *parse_slurm(text))
            if cmdline:  # empty: a zombie, or caught inside exec (same start time and maybe the
                # same name afterwards): read again next time instead of remembering nothing
                self._lasting[pid] = (start_ticks, comm, cmdline, owners)
        container, pod, job, step = owners
        boot = self.boot_time()
        return ProcessInfo(
            pid=pid,
            name=_process_name(comm, cmdline),
            state=state,
            ppid=ppid,
            pgid=pgid,
            sid=sid,
            start_ticks=start_ticks,
            start_time=boot + start_ticks / self._ticks_per_second if boot is not None else None,
            uid=uid,
            user=self.user_name(uid),
            cmdline=cmdline,
            container_id=container,
            pod_uid=pod,
            script=python_script(cmdline),
            slurm_job=job,
            slurm_step=step,
        )


#: Interpreter options that take a value as the next argument.
_OPTIONS_WITH_VALUE = ("-X", "-W", "-Q")


def python_script(cmdline: tuple[str, ...]) -> str:
    """The file name of the script a Python interpreter runs (``train.py``), or the module it
    runs with ``-m``; "" for other programs, ``-c`` code and the interactive interpreter. Only a
    name: never an argument of the job."""
    if not cmdline or not os.path.basename(cmdline[0]).startswith("python"):
        return ""
    args = iter(cmdline[1:])
    for arg in args:
        if arg == "-m":
            return next(args, "")
        if arg == "-c" or arg == "-":
            return ""
        if arg in _OPTIONS_WITH_VALUE:
            next(args, None)
        elif not arg.startswith("-"):
            return os.path.basename(arg)
    return ""


#: Far more than a ``stat`` line holds (some 300 bytes; comm is at most 64).
_STAT_BYTES = 4096


def _kept_limit() -> int:
    """How many processes may have their files kept open: two descriptors each, an eighth of
    the agent's descriptor limit in all, at most 512 processes."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(0, min(512, soft // 16))


def _is_procfs(root: str) -> bool:
    """Whether ``root`` is a procfs mount (``/proc``, ``/host/proc``), not a copy of one."""
    mount = _mount_of(root)
    return mount is not None and mount[0] == b"proc"


def _mount_of(path: str) -> tuple[bytes, bytes] | None:
    """(file system type, super options) of the mount on ``path`` in this process's mount
    table (the last one on a path is the one in effect); None when none is, or unreadable."""
    try:
        with open("/proc/self/mountinfo", "rb") as handle:
            table = handle.read(_MAX_FILE_BYTES)
    except OSError:
        return None
    target = os.fsencode(os.path.realpath(path))
    found = None
    for line in table.splitlines():
        head, separator, tail = line.partition(b" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) >= 5 and fields[4] == target and separator:
            found = (rest[0] if rest else b"", rest[-1] if rest else b"")
    return found


class _Kept:
    """A process's directory and ``stat``, kept open, and what they said last."""

    __slots__ = ("dir_fd", "facts", "info", "stat_fd")

    def __init__(self, dir_fd: int, stat_fd: int) -> None:
        self.dir_fd, self.stat_fd = dir_fd, stat_fd
        self.facts: tuple[object, ...] = ()
        self.info: ProcessInfo | None = None

    def close(self) -> None:
        os.close(self.stat_fd)
        os.close(self.dir_fd)


def _start_ticks(stat: bytes) -> int:
    """Field 22 of ``stat`` (start time in clock ticks since boot); ValueError when malformed."""
    try:
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except IndexError:
        raise ValueError("short stat") from None


def _process_name(comm: str, cmdline: tuple[str, ...]) -> str:
    """comm, or the executable's full name when the kernel cut comm to 15 characters."""
    if len(comm) >= _COMM_MAX and cmdline:
        exe = os.path.basename(cmdline[0])
        if exe.startswith(comm):
            return exe
    return comm


#: The inode of the initial PID namespace (the kernel's PROC_PID_INIT_INO): the host's.
_INITIAL_PID_NAMESPACE = 0xEFFFFFFC


def in_initial_pid_namespace() -> bool:
    """True when this process runs in the host's PID namespace (not in a container's or a
    pod's own); True too when that cannot be read (no /proc)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino == _INITIAL_PID_NAMESPACE
    except OSError:
        return True


def file_identity(path: str) -> tuple[str, int, int] | None:
    """What makes a device node the same file in any mount namespace: its device number for a
    character device, else (filesystem, inode); None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISCHR(st.st_mode):
        return ("chr", st.st_rdev, 0)
    return ("file", st.st_dev, st.st_ino)


def scan_fd_holders(
    root: str, wanted: Mapping[tuple[str, int, int], str], hints: tuple[str, ...] = ("nvidia",)
) -> tuple[dict[str, set[int]], set[int]]:
    """Processes under ``root`` with an open descriptor on one of the ``wanted`` files.

    ``wanted`` maps a file identity (see :func:`file_identity`) to a key (a GPU uuid); only
    descriptors whose path contains one of ``hints`` are looked at closely. Returns the holders
    per key, and the PIDs whose descriptors could not be read (permission denied: what they
    hold is unknown). Processes that vanish mid-scan are simply not holders.
    """
    holders: dict[str, set[int]] = {}
    unreadable: set[int] = set()
    try:
        entries = [entry.name for entry in os.scandir(root) if entry.name.isdigit()]
    except OSError:
        return holders, {0}  # no process list at all: nothing is known
    for name in entries:
        pid = int(name)
        try:
            fds = list(os.scandir(f"{root}/{name}/fd"))
        except FileNotFoundError:
            continue
        except OSError:
            unreadable.add(pid)
            continue
        for fd in fds:
            try:
                target = os.readlink(fd.path)
            except FileNotFoundError:
                continue  # closed, or the process ended, meanwhile
            except OSError:  # listed but not readable (CAP_DAC_READ_SEARCH without SYS_PTRACE)
                unreadable.add(pid)
                break
            if not any(hint in target for hint in hints):  # cheap filter before the stat
                continue
            key = wanted.get(file_identity(fd.path))  # type: ignore[arg-type]
            if key is not None:
                holders.setdefault(key, set()).add(pid)
    return holders, unreadable
