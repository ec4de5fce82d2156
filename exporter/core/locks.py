"""GPU reservations: an exclusive ``flock`` on one file per GPU UUID in a shared lock directory,
marked with an open file description (OFD) read lock that readers in any PID namespace can see.

Taking the ``flock`` is the commit point. The lock belongs to the open file description: the
kernel releases it when the last descriptor of it is closed (by ``run`` once its job's last
process has exited, or by the last process that inherited it), so there are no stale locks to
clean up. Lock files are opened without following symlinks and never truncated or written, so a
hostile file or link in a shared directory cannot make us write anywhere. A launcher resolves its
lock directory once (:func:`open_lock_dir`) and works relative to that open directory from then
on.

Why two locks. Readers (the agent, ``status``, ``recommend``) found a ``flock`` in
``/proc/locks``, which records the PID that took it. In a PID namespace where that PID does not
exist (a container with its own namespace, while the launcher runs outside it or after the
launcher has exited and left the lock to its job) the kernel leaves the line out, and a GPU a
running job holds looked free. ``F_OFD_GETLK`` cannot see a ``flock`` either. So, once it holds a
``flock``, a launcher also takes an OFD read lock (``F_OFD_SETLK``, ``F_RDLCK``, the whole file)
on the same open file description (:func:`_mark`). An OFD lock belongs to the description too:
the job inherits it with the descriptor, and the kernel drops it, with the ``flock``, at the last
close. It has no PID, so it is visible from any namespace: ``F_OFD_GETLK`` reports it (``l_pid``
-1), and ``/proc/locks`` lists it as ``OFDLCK ... -1`` everywhere.

Why this keeps every launcher apart, old and new. On Linux ``flock`` locks and ``fcntl``/OFD
locks are independent: neither conflicts with the other. Exclusion rests on the ``flock`` alone,
which every launcher, of this version or an older one, takes first and without which none goes
on. The OFD lock is only a mark, taken after the ``flock`` succeeded (and the name was checked to
still be the file locked), never instead of it, so no launcher can hold a mark without the
``flock``, and a mark can keep no one off a GPU: read locks are shared, and launchers never take
write locks. A write lock would need a descriptor open for writing, which a user cannot get on
the agent's 0644 lock file, and which lock files are never opened with; it would also be a second
exclusion that older launchers do not take, adding nothing to the ``flock``. The order: ``flock``
then mark, so a reader that sees a mark always sees a real holder; the cost is a moment, between
the two calls, in which a reader in another namespace sees the GPU free, which lets no launcher
onto it (its ``flock`` still fails). On a file system or kernel without OFD locks (some NFS
setups: ``ENOLCK``, ``EINVAL``...) the mark is skipped and the ``flock`` works alone, as before.

What readers see (:func:`held_locks`, which never takes a lock): the ``flock`` holder's PID from
``/proc/locks`` where that PID is visible; otherwise, when a mark is held (probed with
``F_OFD_GETLK`` for a write lock, from a read-only descriptor: the kernel checks no open mode for
a probe, only for taking a lock, and a write-lock probe conflicts with any read lock; or an
``OFDLCK`` line of ``/proc/locks``), :data:`UNKNOWN_HOLDER`. An older launcher's ``flock``, which
has no mark, is still seen where its taker's PID is visible, and only there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

#: The shared, system-wide lock directory (sticky and world-writable, like /tmp).
SYSTEM_LOCK_DIR = "/run/gpu-exporter/locks"
SUFFIX = ".lock"
#: Where the per-user fallback directory goes without XDG_RUNTIME_DIR (a variable for tests).
USER_TMP = "/tmp"
#: The holder :func:`held_locks` reports for a lock that is held while the PID that took it is
#: not visible from here (another PID namespace, or gone). No process has PID 0; the kernel itself
#: reports 0 for a lock holder it cannot name in the reader's namespace.
UNKNOWN_HOLDER = 0

#: ``struct flock`` as 64-bit Linux lays it out (x86_64, aarch64, ppc64le, s390x, riscv64):
#: ``short l_type, l_whence; off_t l_start, l_len; pid_t l_pid``, padded to 32 bytes.
_FLOCK = struct.Struct("hhqqi4x")
_OFD_GETLK: int | None = getattr(fcntl, "F_OFD_GETLK", None)
_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)
#: Whether this platform has OFD locks with that layout; without them, ``flock`` alone.
OFD_LOCKS = (
    sys.platform.startswith("linux")
    and _OFD_GETLK is not None
    and _OFD_SETLK is not None
    and struct.calcsize("P") == 8
)


class LockError(Exception):
    """A lock file or directory that cannot be used safely (message says why)."""


def default_lock_dir() -> str:
    """The system lock directory when it exists or can be made; else a per-user one.

    A per-user directory only keeps one user's jobs apart; the system one keeps everyone's apart.
    """
    if _ensure_system_dir():
        return SYSTEM_LOCK_DIR
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = (
        os.path.join(runtime, "gpu-exporter")
        if runtime
        else os.path.join(USER_TMP, f"gpu-exporter-{os.getuid()}")
    )
    path = os.path.join(base, "locks")
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        info = os.lstat(base)  # another user may have made it first, or planted a link
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise LockError(f"{base} is not a private directory of this user; refusing to use it")
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise LockError(f"cannot make the lock directory {path}: {exc.strerror}") from None
    return path


def _ensure_system_dir() -> bool:
    try:
        if not os.path.isdir(SYSTEM_LOCK_DIR):
            os.makedirs(SYSTEM_LOCK_DIR, mode=0o755, exist_ok=True)
            os.chmod(os.path.dirname(SYSTEM_LOCK_DIR), 0o755)  # whatever root's umask is
            os.chmod(SYSTEM_LOCK_DIR, 0o1777)  # anyone may lock; only a file's owner may remove it
    except OSError:
        return False
    info = os.lstat(SYSTEM_LOCK_DIR)
    unsafe = info.st_mode & 0o002 and not info.st_mode & stat.S_ISVTX
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or unsafe:
        raise LockError(
            f"{SYSTEM_LOCK_DIR} must be a root-owned directory, sticky if world-writable (1777)"
        )
    return True


#: Symbolic links followed at most while resolving a lock directory (the kernel's limit).
MAX_LINKS = 40


@dataclass(frozen=True)
class LockDir:
    """A lock directory resolved and opened once: lock files are opened, and the directory is
    read, relative to ``fd``, so that repointing a link or renaming a directory on its path
    afterwards cannot send this process anywhere else."""

    path: str  # as given, for messages
    fd: int

    def __str__(self) -> str:
        return self.path

    def show(self, name: str) -> str:
        """The path of ``name`` in this directory, for messages."""
        return os.path.join(self.path, name)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __enter__(self) -> LockDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_lock_dir(path: str) -> LockDir:
    """Resolve ``path`` once and open the directory it names, refusing it when another user could
    change what it names (and so let a second job onto a locked GPU).

    Every component is walked (trailing slashes and ``.`` included, ``..`` as the kernel takes
    it): a symbolic link on the way must belong to root or to us, and so must every directory on
    the way, which must also be sticky if others may write to it. The lock directory itself must
    pass the same test.
    """
    fd, entered = _resolve(path)
    try:
        for here, info in entered[:-1]:
            _check_dir(here, info, f"the lock directory {path}")
        _check_dir(path, entered[-1][1], "")
        return LockDir(path, _readable(fd))
    finally:
        os.close(fd)


def check_lock_dir(lock_dir: str) -> None:
    """Raise LockError when ``lock_dir`` is not safe to lock in (see :func:`open_lock_dir`)."""
    open_lock_dir(lock_dir).close()


def _resolve(path: str) -> tuple[int, list[tuple[str, os.stat_result]]]:
    """An ``O_PATH`` descriptor of the directory ``path`` names, and every directory entered on
    the way there (the last one is it), each with its path; links checked as they are met."""
    if not path or "\0" in path:
        raise LockError(f"invalid lock directory {path!r}")
    try:
        full = path if path.startswith("/") else os.path.join(os.getcwd(), path)
    except OSError as exc:
        raise LockError(f"cannot use the lock directory {path}: {exc.strerror}") from None
    pending = full.split("/")
    fd, here = _enter(None, "/", "/", path), "/"
    entered = [(here, os.fstat(fd))]
    links = 0
    try:
        while pending:
            name = pending.pop(0)
            if name in ("", "."):
                continue
            step = os.path.dirname(here) if name == ".." else os.path.join(here, name)
            target = None if name == ".." else _link_target(fd, name, step, path)
            if target is None:
                fd, here = _swap(fd, _enter(fd, name, step, path)), step
                entered.append((here, os.fstat(fd)))
                continue
            links += 1
            if links > MAX_LINKS:
                raise LockError(f"cannot use the lock directory {path}: too many symbolic links")
            pending[:0] = target.split("/")
            if target.startswith("/"):
                fd, here = _swap(fd, _enter(None, "/", "/", path)), "/"
        return fd, entered
    except BaseException:
        os.close(fd)
        raise


def _enter(dir_fd: int | None, name: str, here: str, path: str) -> int:
    """Open the directory ``name`` (in ``dir_fd``) for lookups only, never through a link."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:  # ELOOP: it became a link after it was looked at
        raise _unusable(path, here, exc) from None


def _link_target(dir_fd: int, name: str, here: str, path: str) -> str | None:
    """Where the link ``name`` points, None when it is not a link; LockError for another user's
    link, which that user could point elsewhere at any time."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISLNK(info.st_mode):
            return None
        if info.st_uid not in (0, os.geteuid()):
            where = "" if here.rstrip("/") == path.rstrip("/") else f" (on the way to {path})"
            raise LockError(
                f"{here}{where} is a symbolic link of another user (uid {info.st_uid}), who "
                "could point it elsewhere; refusing to use it as a lock directory"
            )
        return os.readlink(name, dir_fd=dir_fd)
    except OSError as exc:
        raise _unusable(path, here, exc) from None


def _unusable(path: str, here: str, exc: OSError) -> LockError:
    """Why the lock directory ``path`` cannot be used: ``exc`` met at ``here`` on the way."""
    where = "" if here.rstrip("/") == path.rstrip("/") else f"{here}: "
    return LockError(f"cannot use the lock directory {path}: {where}{exc.strerror}")


def _swap(old: int, new: int) -> int:
    os.close(old)
    return new


def _check_dir(here: str, info: os.stat_result, of: str) -> None:
    """Refuse a directory whose entries another user could remove or replace: it must belong to
    root or to us, and be sticky if others may write to it. ``of``: what it leads to, if not
    itself the lock directory."""
    if of:
        if info.st_uid not in (0, os.geteuid()):
            raise LockError(
                f"{here}, on the way to {of}, belongs to another user (uid {info.st_uid}), who "
                "could replace what it holds; refusing to use it"
            )
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise LockError(
                f"{here}, on the way to {of}, is writable by other users and not sticky: they "
                "could replace what it holds; refusing to use it"
            )
        return
    if info.st_uid not in (0, os.geteuid()):
        raise LockError(
            f"{here} belongs to another user (uid {info.st_uid}), who could remove or replace "
            "its lock files; use a root-owned directory (mode 1777) or one of your own"
        )
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise LockError(
            f"{here} is writable by other users and not sticky: they could remove or replace "
            "lock files; make it sticky (mode 1777) or writable by its owner only"
        )


def _readable(fd: int) -> int:
    """The directory of the ``O_PATH`` descriptor ``fd`` opened for reading its entries too (a
    new descriptor); a copy of ``fd`` when it may only be searched."""
    try:
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    except PermissionError:
        return os.dup(fd)


def _plain(lock_dir: str) -> LockDir:
    """``lock_dir`` opened as it is, without the safety checks (for reading, as the agent does)."""
    try:
        return LockDir(lock_dir, os.open(lock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except OSError as exc:
        raise LockError(f"cannot use the lock directory {lock_dir}: {exc.strerror}") from None


@contextlib.contextmanager
def _opened(lock_dir: str | LockDir, strict: bool) -> Iterator[LockDir]:
    """``lock_dir`` as a LockDir: as it is, or opened for the block (checked when ``strict``)."""
    if isinstance(lock_dir, LockDir):
        yield lock_dir
        return
    with open_lock_dir(lock_dir) if strict else _plain(lock_dir) as opened:
        yield opened


def lock_name(uuid: str) -> str:
    """The name of the GPU ``uuid``'s lock file; refuses names that could escape the directory."""
    if not uuid or "/" in uuid or uuid.startswith(".") or "\0" in uuid:
        raise LockError(f"invalid GPU UUID {uuid!r}")
    return uuid + SUFFIX


def lock_path(lock_dir: str | LockDir, uuid: str) -> str:
    """The path of the GPU ``uuid``'s lock file (for messages)."""
    return os.path.join(str(lock_dir), lock_name(uuid))


def _open(lock_dir: LockDir, name: str) -> int:
    """Open (creating if needed) a lock file read-only, never through a symlink."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    path = lock_dir.show(name)
    for _ in range(3):
        try:
            fd = os.open(name, flags, dir_fd=lock_dir.fd)
        except FileNotFoundError:
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=lock_dir.fd)
                os.fchmod(fd, 0o644)  # whatever the umask: everyone must be able to open it
            except FileExistsError:
                continue  # someone else created it just now: open theirs
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LockError(f"{path} is a symbolic link; refusing to use it") from None
            owner = _owner(lock_dir, name)
            raise LockError(f"cannot open {path}: {exc.strerror}{owner}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise LockError(f"{path} is not a regular file; refusing to use it")
        return fd
    raise LockError(f"cannot open {path}: it keeps being replaced")


def provision(lock_dir: str | LockDir, uuid: str) -> str:
    """Create the lock file of ``uuid`` when it does not exist; a warning when it is not safe.

    In the shared sticky directory only a file's owner (and root) may remove it. A lock file that
    a job's user created can be removed by that user while another user's job holds its lock;
    the next launcher then locks a new file, and two jobs share the GPU. Made by the agent (root,
    or the directory's owner) no user can remove it. Returns "" when the file is the agent's,
    root's or the directory owner's, else a one-line warning. Never takes the lock.
    """
    name = lock_name(uuid)
    with _opened(lock_dir, strict=False) as opened:
        path = opened.show(name)
        try:
            info = os.stat(name, dir_fd=opened.fd, follow_symlinks=False)
        except FileNotFoundError:
            os.close(_open(opened, name))  # creates it, 0644, never through a link
            info = os.stat(name, dir_fd=opened.fd, follow_symlinks=False)
        except OSError as exc:
            raise LockError(f"cannot check {path}: {exc.strerror}") from None
        trusted = {0, os.geteuid(), os.fstat(opened.fd).st_uid}
    if stat.S_ISREG(info.st_mode) and info.st_uid in trusted:
        return ""
    kind = "" if stat.S_ISREG(info.st_mode) else " (not a regular file)"
    return (
        f"{path}{kind} belongs to uid {info.st_uid}, who can remove it while another user's job "
        "holds the GPU (two jobs could then share it); remove it while no job uses the GPU, "
        "and the agent makes its own"
    )


def _owner(lock_dir: LockDir, name: str) -> str:
    """The owner and mode of ``name`` for messages, in parentheses; empty when unreadable."""
    try:
        info = os.stat(name, dir_fd=lock_dir.fd, follow_symlinks=False)
    except OSError:
        return ""
    return f" (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"


def _lock(lock_dir: LockDir, name: str) -> int | None:
    """Open and flock ``name``: the descriptor, or None when another process holds the lock."""
    for _ in range(3):
        fd = _open(lock_dir, name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:  # a filesystem without flock (some NFS setups)
            os.close(fd)
            raise LockError(f"cannot lock {lock_dir.show(name)}: {exc.strerror}") from None
        if _still_named(fd, lock_dir, name):
            _mark(fd)
            return fd
        # Removed or replaced between open and flock: a lock on that file guards nothing, since
        # the next launcher opens whatever the name is now.
        os.close(fd)
    raise LockError(f"cannot lock {lock_dir.show(name)}: it keeps being removed or replaced")


def _whole_file(kind: int) -> bytes:
    """A ``struct flock`` for ``kind`` (``F_RDLCK``, ``F_WRLCK``) over the whole file; ``l_pid``
    0, as the OFD commands require."""
    return _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0)


def _mark(fd: int) -> bool:
    """Take an OFD read lock on ``fd``'s open file description, which must hold the ``flock``
    already: the mark that readers in any PID namespace see (see the module's docstring).

    False when it could not be taken: no OFD locks on this platform, kernel or file system
    (``EINVAL``, ``ENOLCK``, ``EOPNOTSUPP``), or someone holds a write lock on the file (which a
    probe sees anyway). The ``flock`` alone still keeps every launcher off the GPU, as before.
    """
    if not OFD_LOCKS:
        return False
    assert _OFD_SETLK is not None
    try:
        fcntl.fcntl(fd, _OFD_SETLK, _whole_file(fcntl.F_RDLCK))
    except OSError:
        return False
    return True


def _marked(lock_dir: LockDir, name: str, key: tuple[int, int, int]) -> bool:
    """Whether an OFD lock is held on the lock file ``name`` (the file ``key`` names), probed
    with ``F_OFD_GETLK``, which takes nothing.

    The probe asks about a write lock, which any read or write lock of another open file
    description conflicts with; the kernel checks no open mode for a probe, so a read-only
    descriptor can ask (on a file the reader may only read). A POSIX lock (``l_pid`` not -1) is not
    a launcher's and does not count; it could hide a mark from the probe, which
    ``/proc/locks`` then still shows. False when the file cannot be opened (unreadable,
    replaced by another kind of file since it was listed) or probed.
    """
    if not OFD_LOCKS:
        return False
    assert _OFD_GETLK is not None
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=lock_dir.fd)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        same = (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino) == key
        if not stat.S_ISREG(info.st_mode) or not same:
            return False
        answer = fcntl.fcntl(fd, _OFD_GETLK, _whole_file(fcntl.F_WRLCK))
    except OSError:
        return False
    finally:
        os.close(fd)
    kind, _, _, _, pid = _FLOCK.unpack(answer)
    return kind != fcntl.F_UNLCK and pid == -1


def _still_named(fd: int, lock_dir: LockDir, name: str) -> bool:
    held = os.fstat(fd)
    try:
        named = os.stat(name, dir_fd=lock_dir.fd, follow_symlinks=False)
    except OSError:
        return False
    return held.st_nlink > 0 and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


@dataclass
class Reservation:
    """Locks held on some GPUs; ``fds`` are what a job must inherit to keep them (each one's
    ``flock`` and mark belong to its open file description)."""

    uuids: tuple[str, ...]
    fds: tuple[int, ...]

    def inheritable(self) -> None:
        """Let child processes inherit the lock descriptors (``exec`` keeps them)."""
        for fd in self.fds:
            os.set_inheritable(fd, True)

    def release(self) -> None:
        """Drop this process's hold; the lock ends when no process holds it any more."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = ()


def try_lock(lock_dir: str | LockDir, uuids: Iterable[str]) -> Reservation | None:
    """Lock every GPU in ``uuids`` (in sorted order), or none: None when one is held already.

    A path is resolved and checked first (see :func:`open_lock_dir`); a LockDir is used as it is.
    """
    taken: list[int] = []
    ordered = tuple(sorted(set(uuids)))
    with _opened(lock_dir, strict=True) as opened:
        try:
            for uuid in ordered:
                fd = _lock(opened, lock_name(uuid))
                if fd is None:
                    for held in taken:
                        os.close(held)
                    return None
                taken.append(fd)
        except BaseException:
            for held in taken:
                os.close(held)
            raise
    return Reservation(ordered, tuple(taken))


def _lock_files(lock_dir: LockDir) -> dict[tuple[int, int, int], str]:
    """(major, minor, inode) -> GPU UUID of the regular lock files in ``lock_dir``."""
    files: dict[tuple[int, int, int], str] = {}
    for entry in list(os.scandir(lock_dir.fd)):
        if not entry.name.endswith(SUFFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)  # relative to lock_dir.fd: keep it open
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            key = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
            files[key] = entry.name[: -len(SUFFIX)]
    return files


def held_locks(lock_dir: str | LockDir, proc_root: str = "/proc") -> dict[str, int]:
    """GPU UUID -> pid of the process that took its lock, or :data:`UNKNOWN_HOLDER` when the lock
    is held but that process is not visible from here. Reading never takes a lock, so it cannot
    get in a launcher's way.

    The pid comes from the ``flock``'s line in ``<proc>/locks``: a ``run`` launcher holds its
    job's locks until the job's last process has exited, so it names the launcher for as long as
    the launcher lives. The kernel leaves that line out in a PID namespace where the pid does not
    exist; the launcher's OFD mark says the GPU is held all the same, found by probing the file
    with ``F_OFD_GETLK`` (without ``<proc>/locks``, too) or by its ``OFDLCK`` line there (see the
    module's docstring). An older launcher's ``flock`` has no mark: seen only where its pid is.
    """
    try:
        with _opened(lock_dir, strict=False) as opened:
            files = _lock_files(opened)
            holders = {
                uuid: UNKNOWN_HOLDER
                for key, uuid in files.items()
                if _marked(opened, uuid + SUFFIX, key)
            }
    except (OSError, LockError):
        return {}
    if not files:
        return {}
    try:
        with open(f"{proc_root}/locks", encoding="ascii", errors="replace") as handle:
            lines = handle.readlines()
    except OSError:
        return holders
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF", "2: OFDLCK ADVISORY  READ -1 ...";
        # waiters have "->" after the number
        if len(parts) < 6 or parts[1] not in ("FLOCK", "OFDLCK"):
            continue
        if parts[1] == "FLOCK" and parts[3] != "WRITE":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
            pid = int(parts[4])
        except ValueError:
            continue
        uuid = files.get(key)
        if uuid is None:
            continue
        if parts[1] == "FLOCK" and pid > 0:  # remote (NFS) locks have none
            holders[uuid] = pid
        else:
            holders.setdefault(uuid, UNKNOWN_HOLDER)
    return holders
