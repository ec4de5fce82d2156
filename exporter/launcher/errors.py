"""Everything the launcher raises, under one base class, each with the exit status it stands for.

    LaunchError                          any failure of reserve(), select_devices() or a command
    ├── NoGpusAvailable          75      fewer GPUs than asked for qualify now
    │   ├── ImpossibleRequest    75      no set of GPUs on this host could ever qualify
    │   └── WaitTimedOut        124      ``wait`` ran out first
    ├── LauncherError             1      the launcher cannot go on
    │   ├── NoDriver              1      NVML is unavailable (no driver, not loaded)
    │   ├── AgentError            1      the agent of ``--from`` cannot be reached or failed
    │   └── LockDirError          1      a lock directory or lock file that is not safe to use
    │       └── UnusableLockFile  1      too few GPUs left once those are refused
    └── BadArgument               2      a bad value: a size, a count, a duration, a policy name
        └── BadConfig             2      a bad config file or scenario

The classes that existed before this module keep working: ``NoGpusAvailable`` and
``LauncherError`` are these classes (also importable from ``exporter.launcher.acquire``),
``LockDirError`` is a ``core.locks.LockError``, ``BadArgument`` a ``ValueError`` and
``BadConfig`` a ``config.yamlconf.ConfigError``, so an ``except`` written for those still
catches them.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.config.yamlconf import ConfigError
from exporter.core.locks import LockError
from exporter.core.selection import Recommendation

#: Exit status when fewer GPUs than asked for are available now (EX_TEMPFAIL: try again later).
EXIT_NO_GPUS = 75
#: Exit status when ``--wait`` ran out before enough GPUs were available (as timeout(1)).
EXIT_WAIT_TIMEOUT = 124
EXIT_FAILURE, EXIT_USAGE = 1, 2


class LaunchError(Exception):
    """Base class of every error of the launcher; ``exit_code`` is what the commands exit with."""

    exit_code = EXIT_FAILURE


class LauncherError(LaunchError):
    """The launcher cannot go on (NVML unavailable, a bad lock directory); exit 1."""


class NoDriver(LauncherError):
    """NVML is unavailable: no NVIDIA driver, or it is not loaded."""


class AgentError(LauncherError):
    """The agent asked with ``--from`` cannot be reached, or answered with an error."""


class LockDirError(LauncherError, LockError):
    """A lock directory or lock file that is not safe to use (also a ``LockError``)."""


class BadArgument(LaunchError, ValueError):
    """A bad value (a size, a count, a duration, a policy name); also a ``ValueError``."""

    exit_code = EXIT_USAGE


class BadConfig(BadArgument, ConfigError):
    """A bad config file or scenario (also a ``ConfigError``, with its ``where``, ``key``)."""

    def __init__(self, where: str, key: str, why: str) -> None:
        ConfigError.__init__(self, where, key, why)


def explain(recommendation: Recommendation, note: str = "") -> str:
    """Why not enough GPUs qualify: one line per rejected GPU."""
    policy = recommendation.policy
    lines = [
        f"{len(recommendation.qualified)} of the {policy.count} GPU(s) asked for qualify "
        f"(policy {policy.name!r}, strategy {policy.strategy})"
    ]
    for item in recommendation.to_dict()["rejected"]:
        lines.append(f"  GPU {item['index']} ({item['uuid']}): {item['reason']}")
    if note:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


class NoGpusAvailable(LaunchError):
    """Fewer GPUs than asked for qualify; ``recommendation.to_dict()`` says why each other GPU
    did not, ``timed_out`` whether a wait ran out."""

    exit_code = EXIT_NO_GPUS

    def __init__(self, recommendation: Recommendation, note: str = "", timed_out: bool = False):
        self.recommendation = recommendation
        self.timed_out = timed_out
        self.note = note
        super().__init__(self._message())

    def _message(self) -> str:
        return explain(self.recommendation, self.note)


class ImpossibleRequest(NoGpusAvailable):
    """No set of GPUs on this host could ever qualify (more GPUs than it has or shows, more free
    memory than any GPU has in all): raised at once, even with a wait. ``reason`` says why."""

    def __init__(self, recommendation: Recommendation, note: str, reason: str) -> None:
        self.reason = reason
        super().__init__(recommendation, note)

    def _message(self) -> str:
        return f"impossible on this host: {self.reason}\n{super()._message()}"


class WaitTimedOut(NoGpusAvailable):
    """``wait`` ran out before enough GPUs qualified; ``waited`` is how long, in seconds."""

    exit_code = EXIT_WAIT_TIMEOUT

    def __init__(self, recommendation: Recommendation, note: str, waited: float) -> None:
        self.waited = waited
        super().__init__(recommendation, note, timed_out=True)

    def _message(self) -> str:
        count = self.recommendation.policy.count
        return f"no {count} GPU(s) within {self.waited:g}s: {super()._message()}"


class UnusableLockFile(LockDirError):
    """The lock files of some GPUs cannot be used safely (a planted symbolic link, a file that
    is not a regular one, one that cannot be opened), and too few GPUs qualify without them.
    ``files`` maps each refused GPU's UUID to why; ``recommendation`` is the choice without
    them."""

    def __init__(self, files: Mapping[str, str], recommendation: Recommendation, note: str = ""):
        self.files = dict(files)
        self.recommendation = recommendation
        super().__init__(
            "too few GPUs left once those whose lock file cannot be used are refused: "
            + explain(recommendation, note)
        )


__all__ = [
    "EXIT_NO_GPUS",
    "EXIT_WAIT_TIMEOUT",
    "AgentError",
    "BadArgument",
    "BadConfig",
    "ImpossibleRequest",
    "LaunchError",
    "LauncherError",
    "LockDirError",
    "NoDriver",
    "NoGpusAvailable",
    "UnusableLockFile",
    "WaitTimedOut",
    "explain",
]
