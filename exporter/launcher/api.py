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

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from exporter.config.policies import policy_with, recommend_policies
from exporter.config.settings import load_config
from exporter.core.locks import default_lock_dir, open_lock_dir
from exporter.core.selection import Policy
from exporter.core.units import parse_duration
from exporter.launcher.acquire import Device, LocalGpus, acquire, choose, devices
from exporter.launcher.run import job_environment

__all__ = ["Device", "policy_for", "reserve", "select_devices"]


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
) -> Policy:
    """The named policy (from ``config``'s ``actions.recommend.policies``) with overrides."""
    policies = load_config(config, actions=recommend_policies).actions
    if policy not in policies:
        raise ValueError(f"no policy {policy!r} (known: {', '.join(sorted(policies))})")
    changes = {  # as strings, so they are checked exactly as the command line's flags are
        "count": count,
        "min_free_memory": min_free_memory,
        "max_utilization": max_utilization,
        "max_temperature": max_temperature,
        "exclusive": exclusive,
        "strategy": strategy,
    }
    return policy_with(policies[policy], {k: str(v) for k, v in changes.items() if v is not None})


def select_devices(
    count: int = 1,
    *,
    lock_dir: str | None = None,
    simulate: str | None = None,
    **filters: Any,
) -> list[Device]:
    """The GPUs ``reserve`` would take now, without taking them (``filters``: see policy_for).

    Raises NoGpusAvailable when fewer than ``count`` qualify.
    """
    from exporter.launcher.acquire import NoGpusAvailable

    policy = policy_for(count, **filters)
    with LocalGpus(simulate=simulate, lock_dir=lock_dir or default_lock_dir()) as gpus:
        snapshots = gpus.samples(policy.window)
        choosing = choose(policy, snapshots, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not choosing.recommendation.ok:
        raise NoGpusAvailable(choosing.recommendation, choosing.note)
    return devices(snapshots[-1], choosing)


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

    ``wait`` (seconds or a duration like ``"10m"``) waits for GPUs to qualify; without it, too few
    GPUs raise NoGpusAvailable at once. The environment is restored when the block ends.
    """
    policy = policy_for(count, **filters)
    seconds = parse_duration(wait) if wait is not None else None
    with (
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
