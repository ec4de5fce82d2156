"""The launcher's Python API: choose GPUs, or reserve them for a block of code.

    from exporter.launcher.api import reserve

    with reserve(count=2, min_free_memory="8GiB") as gpus:
        train(devices=gpus)  # CUDA_VISIBLE_DEVICES names exactly these GPUs in here

``reserve`` is the race-free version of the "probe, pick, export CUDA_VISIBLE_DEVICES" scripts:
the GPUs are locked before they are checked a last time, and stay locked until the block ends
(the locks are held by this process, and by the children it forks or starts with the lock
descriptors passed on; unlike ``gpu-exporter run``, nothing waits for ``spawn`` workers).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from exporter.config.policies import policy_with, recommend_policies
from exporter.config.settings import load_config
from exporter.config.validate import duration_or_forever
from exporter.config.yamlconf import ConfigError
from exporter.core.locks import LockError, default_lock_dir, open_lock_dir
from exporter.core.selection import Policy
from exporter.core.visible import job_environment
from exporter.launcher.acquire import Device, LocalGpus, acquire, choose, devices
from exporter.launcher.errors import (
    AgentError,
    BadArgument,
    BadConfig,
    ImpossibleRequest,
    LauncherError,
    LaunchError,
    LockDirError,
    NoDriver,
    NoGpusAvailable,
    UnusableLockFile,
    WaitTimedOut,
)

__all__ = [
    "AgentError",
    "BadArgument",
    "BadConfig",
    "Device",
    "ImpossibleRequest",
    "LaunchError",
    "LauncherError",
    "LockDirError",
    "NoDriver",
    "NoGpusAvailable",
    "UnusableLockFile",
    "WaitTimedOut",
    "policy_for",
    "reserve",
    "select_devices",
]


@contextmanager
def _launch_errors() -> Iterator[None]:
    """Raise what the layers below raise as the launcher's own exceptions, each still an instance
    of what it was: a ConfigError as BadConfig, a LockError as LockDirError, a ValueError as
    BadArgument."""
    try:
        yield
    except LaunchError:
        raise
    except ConfigError as exc:
        raise BadConfig(exc.where, exc.key, exc.why) from exc
    except LockError as exc:
        raise LockDirError(str(exc)) from exc
    except ValueError as exc:
        raise BadArgument(str(exc)) from exc


def policy_for(
    count: int = 1,
    *,
    policy: str = "default",
    config: str | None = None,
    min_free_memory: int | str | None = None,
    max_utilization: float | None = None,
    max_temperature: float | None = None,
    exclusive: bool | None = None,
    strategy: str | None = None,
    exclude_unhealthy: bool | str | None = None,
    mig: bool | None = None,
) -> Policy:
    """The named policy (from ``config``'s ``actions.recommend.policies``) with overrides.

    Raises BadArgument (a ValueError) for an unknown policy or a bad value, BadConfig (a
    ConfigError) for a bad config file.
    """
    changes = {  # as strings, so they are checked exactly as the command line's flags are
        "count": count,
        "min_free_memory": min_free_memory,
        "max_utilization": max_utilization,
        "max_temperature": max_temperature,
        "exclusive": exclusive,
        "strategy": strategy,
        "exclude_unhealthy": exclude_unhealthy,
        "mig": mig,
    }
    with _launch_errors():
        policies = load_config(config, actions=recommend_policies).actions
        if policy not in policies:
            raise BadArgument(f"no policy {policy!r} (known: {', '.join(sorted(policies))})")
        overrides = {key: str(value) for key, value in changes.items() if value is not None}
        return policy_with(policies[policy], overrides)


def select_devices(
    count: int = 1,
    *,
    lock_dir: str | None = None,
    simulate: str | None = None,
    **filters: Any,
) -> list[Device]:
    """The GPUs ``reserve`` would take now, without taking them (``filters``: see policy_for).

    Raises NoGpusAvailable when fewer than ``count`` qualify (ImpossibleRequest when no GPUs of
    this host ever could), NoDriver without NVML, LockDirError for a bad lock directory,
    BadArgument or BadConfig for a bad value: all LaunchErrors.
    """
    policy = policy_for(count, **filters)
    with (
        _launch_errors(),
        LocalGpus(simulate=simulate, lock_dir=lock_dir or default_lock_dir()) as gpus,
    ):
        snapshots = gpus.samples(policy.window)
        choosing = choose(policy, snapshots, os.environ.get("CUDA_VISIBLE_DEVICES"))
    recommendation, note = choosing.recommendation, choosing.note
    if choosing.never:
        raise ImpossibleRequest(recommendation, note, choosing.never)
    if not recommendation.ok:
        raise NoGpusAvailable(recommendation, note)
    return devices(snapshots[-1], choosing)


def _wait_seconds(wait: float | str | None) -> float | None:
    """``wait`` of ``reserve`` in seconds: None (do not wait), a number of seconds, a duration
    (``"10m"``), or ``"forever"`` (or ``math.inf``); BadArgument otherwise."""
    if wait is None:
        return None
    if isinstance(wait, float) and wait == math.inf:
        return math.inf
    try:
        return duration_or_forever(wait)
    except ValueError as exc:
        raise BadArgument(f"wait: {exc}") from None


@contextmanager
def reserve(
    count: int = 1,
    *,
    wait: float | str | None = None,
    lock_dir: str | None = None,
    simulate: str | None = None,
    set_environment: bool = True,
    **filters: Any,
) -> Iterator[list[Device]]:
    """Lock ``count`` GPUs for the block and set ``CUDA_VISIBLE_DEVICES`` to them.

    ``wait`` (seconds, a duration like ``"10m"``, or ``"forever"``) waits for GPUs to qualify;
    without it, too few GPUs raise NoGpusAvailable at once. A request no GPUs of this host could
    ever meet raises ImpossibleRequest at once, even with ``wait``; a wait that runs out,
    WaitTimedOut. Every error is a LaunchError (see ``exporter.launcher.errors``). The
    environment is restored when the block ends.
    """
    policy = policy_for(count, **filters)
    seconds = _wait_seconds(wait)
    with (
        _launch_errors(),
        open_lock_dir(lock_dir or default_lock_dir()) as opened,  # resolved once
        LocalGpus(simulate=simulate, lock_dir=opened) as gpus,
    ):
        reservation, chosen = acquire(
            gpus, policy, visible_env=os.environ.get("CUDA_VISIBLE_DEVICES"), wait=seconds
        )
    reservation.inheritable()
    saved = {key: os.environ.get(key) for key in job_environment(chosen)}
    try:
        if set_environment:
            os.environ.update(job_environment(chosen))
        yield chosen
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        reservation.release()
