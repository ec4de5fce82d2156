"""GPU reservations: an exclusive ``flock`` on one file per GPU UUID in a shared lock directory.

Taking the lock is the commit point. The lock belongs to the open file description, so a job that
inherits the descriptor keeps the GPU for as long as any of its processes lives, and the kernel
releases it when the last one exits: there are no stale locks to clean up. Lock files are opened
without following symlinks and never truncated or written, so a hostile file or link in a shared
directory cannot make us write anywhere.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

#: The shared, system-wide lock directory (sticky and world-writable, like /tmp).
SYSTEM_LOCK_DIR = "/run/gpu-exporter/locks"
SUFFIX = ".lock"
#: Where the per-user fallback directory goes without XDG_RUNTIME_DIR (a variable for tests).
USER_TMP = "/tmp"


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


def check_lock_dir(lock_dir: str) -> None:
    """Refuse a lock directory in which another user could remove or replace our lock files
    (and so let a second job onto a locked GPU): it must belong to root or to us, and be sticky
    if others may write to it."""
    me = os.geteuid()
    try:
        link, info = os.lstat(lock_dir), os.stat(lock_dir)
    except OSError as exc:
        raise LockError(f"cannot use the lock directory {lock_dir}: {exc.strerror}") from None
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, me):
        raise LockError(
            f"{lock_dir} is a symbolic link of another user (uid {link.st_uid}); refusing to use it"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise LockError(f"{lock_dir} is not a directory")
    if info.st_uid not in (0, me):
        raise LockError(
            f"{lock_dir} belongs to another user (uid {info.st_uid}), who could remove or replace "
            "its lock files; use a root-owned directory (mode 1777) or one of your own"
        )
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise LockError(
            f"{lock_dir} is writable by other users and not sticky: they could remove or replace "
            "lock files; make it sticky (mode 1777) or writable by its owner only"
        )


def lock_path(lock_dir: str, uuid: str) -> str:
    """The lock file of the GPU ``uuid``; refuses names that could escape the directory."""
    if not uuid or "/" in uuid or uuid.startswith(".") or "\0" in uuid:
        raise LockError(f"invalid GPU UUID {uuid!r}")
    return os.path.join(lock_dir, uuid + SUFFIX)


def _open(path: str) -> int:
    """Open (creating if needed) a lock file read-only, never through a symlink."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    for _ in range(3):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
                os.fchmod(fd, 0o644)  # whatever the umask: everyone must be able to open it
            except FileExistsError:
                continue  # someone else created it just now: open theirs
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LockError(f"{path} is a symbolic link; refusing to use it") from None
            raise LockError(f"cannot open {path}: {exc.strerror}{_owner(path)}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise LockError(f"{path} is not a regular file; refusing to use it")
        return fd
    raise LockError(f"cannot open {path}: it keeps being replaced")


def provision(lock_dir: str, uuid: str) -> str:
    """Create the lock file of ``uuid`` when it does not exist; a warning when it is not safe.

    In the shared sticky directory only a file's owner (and root) may remove it. A lock file that
    a job's user created can be removed by that user while another user's job holds its lock;
    the next launcher then locks a new file, and two jobs share the GPU. Made by the agent (root,
    or the directory's owner) no user can remove it. Returns "" when the file is the agent's,
    root's or the directory owner's, else a one-line warning. Never takes the lock.
    """
    path = lock_path(lock_dir, uuid)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        os.close(_open(path))  # creates it, 0644, never through a link
        info = os.lstat(path)
    except OSError as exc:
        raise LockError(f"cannot check {path}: {exc.strerror}") from None
    trusted = {0, os.geteuid(), os.stat(lock_dir).st_uid}
    if stat.S_ISREG(info.st_mode) and info.st_uid in trusted:
        return ""
    kind = "" if stat.S_ISREG(info.st_mode) else " (not a regular file)"
    return (
        f"{path}{kind} belongs to uid {info.st_uid}, who can remove it while another user's job "
        "holds the GPU (two jobs could then share it); remove it while no job uses the GPU, "
        "and the agent makes its own"
    )


def _owner(path: str) -> str:
    """The owner and mode of ``path`` for messages, in parentheses; empty when unreadable."""
    try:
        info = os.lstat(path)
    except OSError:
        return ""
    return f" (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"


def _lock(path: str) -> int | None:
    """Open and flock ``path``: the descriptor, or None when another process holds the lock."""
    for _ in range(3):
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:  # a filesystem without flock (some NFS setups)
            os.close(fd)
            raise LockError(f"cannot lock {path}: {exc.strerror}") from None
        if _still_named(fd, path):
            return fd
        # Removed or replaced between open and flock: a lock on that file guards nothing, since
        # the next launcher opens whatever the name is now.
        os.close(fd)
    raise LockError(f"cannot lock {path}: it keeps being removed or replaced")


def _still_named(fd: int, path: str) -> bool:
    held = os.fstat(fd)
    try:
        named = os.lstat(path)
    except OSError:
        return False
    return held.st_nlink > 0 and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


@dataclass
class Reservation:
    """Locks held on some GPUs; ``fds`` are what a job must inherit to keep them."""

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


def try_lock(lock_dir: str, uuids: Iterable[str]) -> Reservation | None:
    """Lock every GPU in ``uuids`` (in sorted order), or none: None when one is held already."""
    taken: list[int] = []
    ordered = tuple(sorted(set(uuids)))
    check_lock_dir(lock_dir)
    try:
        for uuid in ordered:
            fd = _lock(lock_path(lock_dir, uuid))
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


def held_locks(lock_dir: str, proc_root: str = "/proc") -> dict[str, int]:
    """GPU UUID -> pid of the process that holds its lock, read from ``<proc>/locks`` (reading
    never takes a lock, so it cannot get in a launcher's way)."""
    files: dict[tuple[int, int, int], str] = {}
    try:
        entries = list(os.scandir(lock_dir))
    except OSError:
        return {}
    for entry in entries:
        if not entry.name.endswith(SUFFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            key = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
            files[key] = entry.name[: -len(SUFFIX)]
    if not files:
        return {}
    holders: dict[str, int] = {}
    try:
        with open(f"{proc_root}/locks", encoding="ascii", errors="replace") as handle:
            lines = handle.readlines()
    except OSError:
        return {}
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"; waiters have "->" after the number
        if len(parts) < 6 or parts[1] != "FLOCK" or parts[3] != "WRITE":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
            pid = int(parts[4])
        except ValueError:
            continue
        if key in files:
            holders[files[key]] = pid
    return holders
