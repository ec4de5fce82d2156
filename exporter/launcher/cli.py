"""``gpu-exporter recommend`` and ``gpu-exporter run``.

Exit codes: 0 success (``run``: the job's own status, 128+N when signal N ended it, or stopped
the launcher between two attempts or while it waited); 75 fewer GPUs than asked for are
available now, or no GPUs of this host ever could be; 124 ``--wait`` ran out; 1 the launcher
could not work (NVML unavailable, agent unreachable, a bad lock directory, lock files that cannot
be used on too many GPUs; ``recommend --prometheus``: Prometheus unreachable or failing); 2 bad
usage (``--prometheus`` with a URL that is not http(s), a ``--selector`` that is not label
matchers in braces or that Prometheus refuses); 126/127 the command could not be run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from exporter.config.policies import policy_with
from exporter.config.settings import Config
from exporter.config.validate import (
    duration_or_forever,
    positive_duration_or_never,
    whole_or_unlimited,
)
from exporter.core.locks import LockError, default_lock_dir, open_lock_dir
from exporter.core.selection import Policy, Recommendation
from exporter.core.visible import as_cuda_reads, job_environment
from exporter.launcher.acquire import Advisor, Device, LocalGpus, acquire, choose
from exporter.launcher.errors import (
    EXIT_FAILURE,
    EXIT_USAGE,
    AgentError,
    BadArgument,
    ImpossibleRequest,
    LaunchError,
    LockDirError,
    NoGpusAvailable,
)
from exporter.launcher.flags import FORMATS

#: The most restarts --max-restarts takes as a number (``unlimited`` has no bound).
MAX_RESTARTS = 1_000_000

#: The settings the launcher reads: the agent's, with only the recommendation policies of
#: ``actions:`` (see ``config.policies.recommend_policies``).
if TYPE_CHECKING:
    from exporter.launcher.run import RunOptions

LauncherConfig = Config[Mapping[str, Policy]]
#: Of the agent's settings, those ``recommend`` and ``run`` use (by ``dest``): the only ones
#: their flags offer.


_FLAGS = {
    "count": "--count",
    "min_free_memory": "--min-free-memory",
    "max_utilization": "--max-utilization",
    "max_temperature": "--max-temperature",
    "strategy": "--strategy",
    "exclusive": "--exclusive",
    "exclude_unhealthy": "--exclude-unhealthy",
    "mig": "--mig",
}
#: What ``run --from`` checks here, under the lock, of the GPUs the agent chose: up, not
#: throttling, not locked by another launcher, and the filter flags given. Its count is the
#: agent's; free memory ranks (any strategy would do: one GPU set is checked).
AGENT_CHOICE = Policy("--from", strategy="most_free_memory", exclude_zombies=False)


class UsageError(BadArgument):
    """A bad flag value: exit 2 with this message."""


class Stopped(LaunchError):
    """A signal stopped the launcher before the job was started: exit 128+N."""

    def __init__(self, signum: int) -> None:
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} while choosing GPUs; nothing was started")


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
        for key in (
            "count",
            "min_free_memory",
            "max_utilization",
            "max_temperature",
            "strategy",
            "exclude_unhealthy",
        )
        if getattr(args, key) is not None
    }
    if args.exclusive:
        overrides["exclusive"] = "true"
    if args.mig:
        overrides["mig"] = "true"
    return overrides


def _lock_dir(config: LauncherConfig) -> str:
    try:
        return config.lock_dir or default_lock_dir()
    except LockError as exc:
        raise LockDirError(str(exc)) from None


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
        import json  # here: the other formats need not load it

        print(json.dumps(recommendation.to_dict(), indent=1))
    else:
        for key, value in env.items():
            print(f"export {key}={value}")


def cmd_recommend(args: argparse.Namespace, config: LauncherConfig) -> int:
    """Print the GPUs to use, or why there are not enough (exit 75)."""
    if args.format not in FORMATS:
        raise UsageError(f"--format: one of {', '.join(FORMATS)}, got {args.format!r}")
    _check_fleet_flags(args)
    if args.prometheus is not None:
        return _recommend_fleet(args, config)
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    cuda_ids: Mapping[str, str] = {}
    never = ""
    if args.source is not None:  # the agent knows its own policies: check the flags only
        _with_flags(Policy("flags"), args)
        ask = _advisor(args.source, args.policy, _overrides(args))
        note = ""
        if visible_env is not None:  # read as CUDA reads it, as a local recommend does
            visible_env, note = as_cuda_reads(visible_env)
        recommendation = ask(visible_env)
    else:
        policy = _policy(config, args)
        with LocalGpus(
            simulate=config.simulate, proc_root=config.proc_root, lock_dir=_lock_dir(config)
        ) as gpus:
            choosing = choose(policy, gpus.samples(policy.window), visible_env)
        recommendation, note, cuda_ids = choosing.recommendation, choosing.note, choosing.cuda_ids
        never = choosing.never
    if note:
        print(f"gpu-exporter: {note}", file=sys.stderr)
    if never:
        raise ImpossibleRequest(recommendation, "", never)
    if not recommendation.ok:
        raise NoGpusAvailable(recommendation)
    _print_choice(recommendation, args.format, cuda_ids)
    return 0


def _check_fleet_flags(args: argparse.Namespace) -> None:
    """``--prometheus`` excludes ``--from``; ``--selector`` and ``--spread`` need it."""
    if args.prometheus is not None and args.source is not None:
        raise UsageError(
            "--prometheus: not with --from (--from asks one agent, --prometheus the fleet)"
        )
    if args.prometheus is None:
        for flag, given in (("--selector", args.selector is not None), ("--spread", args.spread)):
            if given:
                raise UsageError(f"{flag}: only with --prometheus URL")


def _recommend_fleet(args: argparse.Namespace, config: LauncherConfig) -> int:
    """``recommend --prometheus``: the best host's GPUs, one ``INSTANCE UUID`` line each."""
    from exporter.launcher import fleet  # only --prometheus pays for it

    prometheus = fleet.Prometheus(args.prometheus)
    matchers = fleet.parse_selector(args.selector)
    if args.format not in fleet.FORMATS:
        raise UsageError(f"--format: with --prometheus, uuid or json, got {args.format!r}")
    if args.mig:  # the agent exports no launcher locks of MIG devices: they would be missed
        raise UsageError("--mig: not with --prometheus (MIG devices are chosen on their host)")
    choice = fleet.recommend_fleet(prometheus, _policy(config, args), matchers, spread=args.spread)
    if not choice.ok:
        where = f"Prometheus {args.prometheus}" + (f" {{{matchers}}}" if matchers else "")
        raise fleet.FleetShortage(choice, where)
    print(fleet.render(choice, args.format))
    return 0


def _advisor(url: str, policy: str, overrides: dict[str, str]) -> Advisor:
    """Asks the agent at ``url`` (checked now: UsageError unless http:// or https://)."""
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--from: expected an http:// or https:// URL, got {url!r}")
    return lambda visible: _from_agent(url, policy, overrides, visible)


def _from_agent(
    url: str, policy: str, overrides: dict[str, str], visible_env: str | None
) -> Recommendation:
    """Ask a running agent's /recommend (it applies its own policies, locks and hotspots)."""
    import urllib.error  # only --from pays for the HTTP client
    import urllib.parse
    import urllib.request

    params = {"policy": policy, **overrides}
    if visible_env is not None:
        params["visible"] = visible_env
    target = url.rstrip("/") + "/recommend?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(target, timeout=10) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
        if exc.code != 409:  # 409: answered, but too few GPUs qualify
            text = body.decode(errors="replace").strip()
            raise AgentError(f"{url}: HTTP {exc.code}: {text}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AgentError(f"cannot reach the agent at {url}: {reason}") from None
    import json

    try:
        return _recommendation_from_json(json.loads(body))
    except (ValueError, KeyError, TypeError) as exc:
        raise AgentError(f"{url}: not an answer of /recommend: {exc!r}") from None


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
    from exporter.launcher.run import Supervisor  # subprocess and threads: only run needs them

    command = _command(args.job)
    options = _run_options(args, command)
    wait = _parse(args.wait, "--wait", duration_or_forever) if args.wait is not None else None
    advisor: Advisor | None = None
    if args.source is not None:  # the agent chooses; the flags are checked here under the lock
        policy = _with_flags(AGENT_CHOICE, args)
        advisor = _advisor(args.source, args.policy, _overrides(args))
    else:
        policy = _policy(config, args)
    with (
        open_lock_dir(_lock_dir(config)) as lock_dir,  # resolved once: see locks.open_lock_dir
        LocalGpus(simulate=config.simulate, proc_root=config.proc_root, lock_dir=lock_dir) as gpus,
    ):
        with _stopped_by_signals():
            reservation, devices = acquire(
                gpus,
                policy,
                visible_env=os.environ.get("CUDA_VISIBLE_DEVICES"),
                wait=wait,
                advisor=advisor,
            )
        names = ", ".join(f"{d.index} ({d.uuid})" for d in devices)
        print(f"gpu-exporter: running on GPU {names}", file=sys.stderr)
        return Supervisor(gpus, reservation, devices, options).run()


def _command(job: Sequence[str]) -> list[str]:
    command = list(job)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command to run: gpu-exporter run [FLAGS] -- CMD ARGS...")
    return command


def _run_options(args: argparse.Namespace, command: list[str]) -> RunOptions:
    from exporter.launcher.run import RESTART_POLICIES, RunOptions

    """The supervision flags of ``run``, checked."""
    if args.restart not in RESTART_POLICIES:
        raise UsageError(f"--restart: one of {', '.join(RESTART_POLICIES)}, got {args.restart!r}")
    return RunOptions(
        command,
        restart=args.restart,
        max_restarts=_parse(
            args.max_restarts, "--max-restarts", whole_or_unlimited(0, MAX_RESTARTS)
        ),
        restart_reset=_parse(args.restart_reset, "--restart-reset", positive_duration_or_never),
    )


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """While choosing and waiting for GPUs, SIGINT, SIGTERM and SIGHUP stop the launcher with a
    message (raise Stopped) instead of a traceback or a silent death."""

    def stop(signum: int, _frame: Any) -> None:
        raise Stopped(signum)

    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, stop) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _parse(raw: str, flag: str, parse: Callable[[str], Any]) -> Any:
    try:
        return parse(raw)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def handle(name: str, args: argparse.Namespace, config: LauncherConfig) -> int:
    """Run ``recommend`` or ``run``, turning failures into a one-line message and exit code."""
    handler = {"recommend": cmd_recommend, "run": cmd_run}[name]
    try:
        return handler(args, config)
    except LaunchError as exc:
        print(f"gpu-exporter: {exc}", file=sys.stderr)
        return exc.exit_code
    except LockError as exc:
        print(f"gpu-exporter: {exc}", file=sys.stderr)
        return EXIT_FAILURE


__all__: Sequence[str] = ("EXIT_USAGE", "handle")
