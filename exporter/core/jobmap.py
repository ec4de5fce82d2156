"""Which Slurm job each GPU is allocated to, from a job-mapping directory a prolog writes.

Sites already write one: a prolog writes a file per GPU of the job, an epilog removes it. The
file is named by the GPU, as an index (``0``; nvidia-smi's and NVML's order, which is the PCI
bus order, not the device's minor number) or a UUID (``GPU-...``, ``MIG-...``), and holds the
job: one job per line, its id first (Princeton's jobstats writes ``<jobid> <uid>``,
dcgm-exporter's HPC job mapping the bare id, one line per job sharing the GPU). Nothing else is
read: no Slurm daemon is asked, no process environment looked at.

A directory that is missing, not a directory, a symbolic link or unreadable gives no mapping;
so does a file in no known format (it is skipped and named in the reason).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

#: A Slurm job id: a number, or an array job's ``JOB_TASK``.
_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")
_NAME = re.compile(r"[0-9]+|(?:GPU|MIG)-[0-9A-Za-z-]+")
_MAX_FILES = 1024
_MAX_BYTES = 4096


@dataclass(frozen=True)
class JobFiles:
    """A job-mapping directory's content: GPU (an index as text, or a UUID) -> its jobs, and
    why some or all of it could not be read ("" when all could)."""

    jobs: dict[str, tuple[str, ...]]
    problem: str = ""


def read_job_dir(path: str) -> JobFiles:
    """The job mapping under ``path`` (see the module's docstring)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return JobFiles({}, f"{path}: {exc.strerror or exc}")
    if stat.S_ISLNK(info.st_mode):
        return JobFiles({}, f"{path} is a symbolic link; name the directory itself")
    if not stat.S_ISDIR(info.st_mode):
        return JobFiles({}, f"{path} is not a directory")
    try:
        names = sorted(os.listdir(path))[:_MAX_FILES]
    except OSError as exc:
        return JobFiles({}, f"{path}: {exc.strerror or exc}")
    jobs: dict[str, tuple[str, ...]] = {}
    bad: list[str] = []
    for name in names:
        if name.startswith("."):
            continue  # a prolog's temporary file, renamed into place when written
        found = _read_one(os.path.join(path, name)) if _NAME.fullmatch(name) else None
        if found is None:
            bad.append(name)
        elif found:
            jobs[name] = found
    problem = f"{path}: not a job-mapping file: {', '.join(bad[:5])}" if bad else ""
    return JobFiles(jobs, problem)


def _read_one(path: str) -> tuple[str, ...] | None:
    """The jobs of one file (empty: none now); None for a file in no known format."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return ()  # removed by an epilog meanwhile
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, _MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) > _MAX_BYTES:
        return None
    try:
        lines = raw.decode("ascii").split("\n")
    except UnicodeDecodeError:
        return None
    jobs = []
    for line in lines:
        words = line.split()
        if not words:
            continue
        if not _JOB_ID.fullmatch(words[0]) or len(words) > 2:
            return None
        jobs.append(words[0])
    return tuple(dict.fromkeys(jobs))
