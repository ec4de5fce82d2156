"""``gpu-exporter recommend`` and ``gpu-exporter run``.

Exit codes: 0 success (``run``: the job's own status, 128+N when signal N ended it); 75 fewer
GPUs than asked for are available now; 124 ``--wait`` ran out; 1 the launcher could not work
(NVML unavailable, agent unreachable, a bad lock directory); 2 bad usage; 126/127 the command
could not be run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from exporter.config.policies import policy_with
from exporter.config.settings import Config
from exporter.config.validate import whole
from exporter.core.locks import LockError, default_lock_dir, open_lock_dir
from exporter.core.selection import Policy, Recommendation
from exporter.core.units import parse_duration
from exporter.launcher.acquire import (
    EXIT_NO_GPUS,
    EXIT_WAIT_TIMEOUT,
    Device,
    LauncherError,
    LocalGpus,
    NoGpusAvailable,
    acquire,
    choose,
    explain,
)
from exporter.launcher.run import RESTART_POLICIES, RunOptions, Supervisor, job_environment

#: The most restarts --max-restarts takes (a bound, not a goal: use --restart never to stop).
MAX_RESTARTS = 1_000_000

#: The settings the launcher reads: the agent's, with only the recommendation policies of
#: ``actions:`` (see ``config.policies.recommend_policies``).
LauncherConfig = Config[Mapping[str, Policy]]

EXIT_FAILURE, EXIT_USAGE = 1, 2
FORMATS = ("uuid", "index", "json", "env")
_FLAGS = {
    "count": "--count",
    "min_free_memory": "--min-free-memory",
    "max_utilization": "--max-utilization",
    "max_temperature": "--max-temperature",
    "strategy": "--strategy",
    "exclusive": "--exclusive",
}


class UsageError(Exception):
    """A bad flag value: exit 2 with this message."""


def add_selection_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``recommend`` and ``run`` share."""
    parser.add_argument("--count", metavar="N", help="GPUs to choose (default: the policy's, 1)")
    parser.add_argument("--policy", metavar="NAME", default="default", help="recommend policy")
    parser.add_argument("--min-free-memory", metavar="SIZE", help="at least this free (8GiB)")
    parser.add_argument("--max-utilization", metavar="R", help="at most this busy (0-1)")
    parser.add_argument("--max-temperature", metavar="C", help="at most this hot (celsius)")
    parser.add_argument("--strategy", metavar="NAME", help="override the policy's strategy")
    parser.add_argument(
        "--exclusive", action="store_true", help="only GPUs with no process of any user on them"
    )


def _policy(config: LauncherConfig, args: argparse.Namespace) -> Policy:
    policies = config.actions
    if args.policy not in policies:
        known = ", ".join(sorted(policies))
        raise UsageError(f"--policy: no policy {args.policy!r} (known: {known})")
    return _with_flags(policies[args.policy], args)


def _with_flags(policy: Policy, args: argparse.Namespace) -> Policy:
    """``policy`` with the selection flags applied; UsageError naming the flag on a bad value."""
    try:
        return policy_with(policy, _overrides(args))
    except ValueError as exc:
        name, _, why = str(exc).partition(": ")
        raise UsageError(f"{_FLAGS.get(name, name)}: {why or exc}") from None


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    overrides = {
        key: getattr(args, key)
        for key in ("count", "min_free_memory", "max_utilization", "max_temperature", "strategy")
        if getattr(args, key) is not None
    }
    if args.exclusive:
        overrides["exclusive"] = "true"
    return overrides


def _lock_dir(config: LauncherConfig) -> str:
    try:
        return config.lock_dir or default_lock_dir()
    except LockError as exc:
        raise LauncherError(str(exc)) from None


def _print_choice(recommendation: Recommendation, fmt: str, cuda_ids: Mapping[str, str]) -> None:
    chosen = [
        Device(c.index, c.uuid, "", None, None, cuda_ids.get(c.uuid, c.uuid))
        for c in recommendation.chosen
    ]
    env = job_environment(chosen)
    if fmt == "uuid":
        print(env["CUDA_VISIBLE_DEVICES"])
    elif fmt == "index":
        print(env["GPU_EXPORTER_GPUS"])
    elif fmt == "json":
        print(json.dumps(recommendation.to_dict(), indent=1))
    else:
        for key, value in env.items():
            print(f"export {key}={value}")


def cmd_recommend(args: argparse.Namespace, config: LauncherConfig) -> int:
    """Print the GPUs to use, or why there are not enough (exit 75)."""
    if args.format not in FORMATS:
        raise UsageError(f"--format: one of {', '.join(FORMATS)}, got {args.format!r}")
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    cuda_ids: Mapping[str, str] = {}
    if args.source is not None:  # the agent knows its own policies: check the flags only
        _with_flags(Policy("flags"), args)
        recommendation, note = _from_agent(args.source, args.policy, _overrides(args), visible_env)
    else:
        policy = _policy(config, args)
        with LocalGpus(
            simulate=config.simulate, proc_root=config.proc_root, lock_dir=_lock_dir(config)
        ) as gpus:
            choosing = choose(policy, gpus.samples(policy.window), visible_env)
        recommendation, note, cuda_ids = choosing.recommendation, choosing.note, choosing.cuda_ids
    if note:
        print(f"gpu-exporter: {note}", file=sys.stderr)
    if not recommendation.ok:
        print(f"gpu-exporter: {explain(recommendation)}", file=sys.stderr)
        return EXIT_NO_GPUS
    _print_choice(recommendation, args.format, cuda_ids)
    return 0


def _from_agent(
    url: str, policy: str, overrides: dict[str, str], visible_env: str | None
) -> tuple[Recommendation, str]:
    """Ask a running agent's /recommend (it applies its own policies, locks and hotspots)."""
    params = {"policy": policy, **overrides}
    if visible_env is not None:
        params["visible"] = visible_env
    target = url.rstrip("/") + "/recommend?" + urllib.parse.urlencode(params)
    if not target.startswith(("http://", "https://")):
        raise UsageError(f"--from: expected an http:// or https:// URL, got {url!r}")
    try:
        with urllib.request.urlopen(target, timeout=10) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
        if exc.code != 409:  # 409: answered, but too few GPUs qualify
            text = body.decode(errors="replace").strip()
            raise LauncherError(f"{url}: HTTP {exc.code}: {text}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LauncherError(f"cannot reach the agent at {url}: {reason}") from None
    return _recommendation_from_json(json.loads(body)), ""


def _recommendation_from_json(data: dict[str, Any]) -> Recommendation:
    from types import MappingProxyType

    from exporter.core.selection import Choice

    def choices(items: list[dict[str, Any]]) -> tuple[Choice, ...]:
        return tuple(Choice(c["index"], c["uuid"], c["score"]) for c in items)

    rejected = {r["uuid"]: r["reason"] for r in data["rejected"]}
    indexes = {r["uuid"]: r["index"] for r in data["rejected"]}
    for choice in data["qualified"]:
        indexes[choice["uuid"]] = choice["index"]
    return Recommendation(
        policy=Policy(data["policy"], count=data["count"]),
        chosen=choices(data["chosen"]),
        qualified=choices(data["qualified"]),
        rejected=MappingProxyType(rejected),
        scores=MappingProxyType({c["uuid"]: c["score"] for c in data["qualified"]}),
        indexes=MappingProxyType(indexes),
    )


def cmd_run(args: argparse.Namespace, config: LauncherConfig) -> int:
    """Lock GPUs, run the job on them, pass its exit status on."""
    command = list(args.job)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command to run: gpu-exporter run [FLAGS] -- CMD ARGS...")
    if args.restart not in RESTART_POLICIES:
        raise UsageError(f"--restart: one of {', '.join(RESTART_POLICIES)}, got {args.restart!r}")
    wait = _parse(args.wait, "--wait", parse_duration) if args.wait is not None else None
    max_restarts = _parse(args.max_restarts, "--max-restarts", whole(0, MAX_RESTARTS))
    policy = _policy(config, args)
    with (
        open_lock_dir(_lock_dir(config)) as lock_dir,  # resolved once: see locks.open_lock_dir
        LocalGpus(simulate=config.simulate, proc_root=config.proc_root, lock_dir=lock_dir) as gpus,
    ):
        try:
            reservation, devices = acquire(
                gpus, policy, visible_env=os.environ.get("CUDA_VISIBLE_DEVICES"), wait=wait
            )
        except NoGpusAvailable as exc:
            what = f"no {policy.count} GPU(s) within {wait:g}s" if exc.timed_out else ""
            print(f"gpu-exporter: {what + ': ' if what else ''}{exc}", file=sys.stderr)
            return EXIT_WAIT_TIMEOUT if exc.timed_out else EXIT_NO_GPUS
        names = ", ".join(f"{d.index} ({d.uuid})" for d in devices)
        print(f"gpu-exporter: running on GPU {names}", file=sys.stderr)
        options = RunOptions(command, restart=args.restart, max_restarts=max_restarts)
        return Supervisor(gpus, reservation, devices, options).run()


def _parse(raw: str, flag: str, parse: Callable[[str], Any]) -> Any:
    try:
        return parse(raw)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def add_parsers(commands: Any, add_settings: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``recommend`` and ``run`` to the subcommands."""
    recommend = commands.add_parser(
        "recommend", help="print the GPUs to use (exit 75 when too few qualify)"
    )
    add_settings(recommend)
    add_selection_flags(recommend)
    recommend.add_argument(
        "--format", default="uuid", metavar="FORMAT", help=f"one of {', '.join(FORMATS)}"
    )
    recommend.add_argument(
        "--from", dest="source", metavar="URL", help="ask a running agent (its /recommend)"
    )
    run = commands.add_parser("run", help="lock GPUs and run a job on them: run [FLAGS] -- CMD")
    add_settings(run)
    add_selection_flags(run)
    run.add_argument("--wait", metavar="DURATION", help="wait this long for GPUs (10m)")
    run.add_argument(
        "--restart", default="never", metavar="WHEN", help="never, on-failure or always"
    )
    run.add_argument(
        "--max-restarts", default="3", metavar="N", help="restarts at most (default 3)"
    )
    run.add_argument("job", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")


def handle(name: str, args: argparse.Namespace, config: LauncherConfig) -> int:
    """Run ``recommend`` or ``run``, turning failures into a one-line message and exit code."""
    handler = {"recommend": cmd_recommend, "run": cmd_run}[name]
    try:
        return handler(args, config)
    except UsageError as exc:
        print(f"gpu-exporter: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (LauncherError, LockError) as exc:
        print(f"gpu-exporter: {exc}", file=sys.stderr)
        return EXIT_FAILURE


__all__: Sequence[str] = ("add_parsers", "handle")
