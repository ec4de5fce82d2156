"""Command line: ``serve``, ``status`` and ``check-config``.

Exit codes: 0 success; 1 a runtime failure (NVML unavailable for ``status``, the port taken);
2 bad usage (flags, config or scenario), always with a one-line message and no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import select
import signal
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, TypeVar

from exporter import __version__
from exporter.config.settings import BY_KEY, SETTINGS, Config, load_config, skip_actions
from exporter.config.validate import positive_duration
from exporter.config.yamlconf import ConfigError, Section
from exporter.launcher import flags as launcher_flags

log = logging.getLogger("exporter")
A = TypeVar("A")
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
_SERVE_ONLY = {s.key for s in SETTINGS if s.serve_only}
#: Switches: the flag alone means true.
_SWITCHES = {s.key for s in SETTINGS if s.switch}


def _add_settings(
    parser: argparse.ArgumentParser, serve: bool, keys: Collection[str] | None = None
) -> None:
    """The flags of the settings a subcommand reads: all for ``serve``, not the serve-only ones
    otherwise, and only ``keys`` when given (so ``run --help`` lists only flags ``run`` uses)."""
    parser.add_argument(
        "--config", metavar="FILE", help="YAML config file (env GPU_EXPORTER_CONFIG)"
    )
    for setting in SETTINGS:
        if (setting.key in _SERVE_ONLY and not serve) or (
            keys is not None and setting.key not in keys
        ):
            continue
        help_text = f"{setting.help} (config {setting.key}, env {setting.env})"
        if setting.key == "simulate":
            parser.add_argument(
                "--simulate",
                nargs="?",
                const="builtin",
                metavar="SCENARIO",
                dest="simulate",
                help="run on simulated GPUs: the built-in scenario, or SCENARIO.yaml "
                f"(config simulate, env {setting.env})",
            )
        elif setting.key in _SWITCHES:
            parser.add_argument(
                setting.flag,
                nargs="?",
                const="true",
                metavar="true|false",
                dest=setting.key,
                help=help_text,
            )
        else:
            parser.add_argument(
                setting.flag,
                dest=setting.key,
                metavar=setting.key.split(".")[-1].upper(),
                help=help_text,
            )


def build_parser() -> launcher_flags.CommandParser:
    """The argument parser of every subcommand."""
    parser = launcher_flags.CommandParser(
        prog="gpu-exporter",
        description="NVIDIA GPU exporter: one NVML sample per interval, served as Prometheus "
        "metrics and JSON.",
    )
    parser.add_argument("--version", action="version", version=f"gpu-exporter {__version__}")
    commands = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        required=True,
        parser_class=launcher_flags.SubcommandParser,
    )
    serve = commands.add_parser(
        "serve",
        help="sample GPUs and serve /metrics, /healthz, /snapshot",
        usage="%(prog)s [FLAGS]  (see --help)",
    )
    _add_settings(serve, serve=True)
    status = commands.add_parser(
        "status",
        help="print every GPU and its processes, once or redrawn (--watch)",
        usage="%(prog)s [--watch [SECONDS]] [--from URL] [--json] [FLAGS]",
        epilog="Colours (the verdicts, temperatures near the slowdown threshold, memory near "
        "full) only on a terminal, and not with NO_COLOR set or TERM=dumb; the text says the "
        "same without them.",
    )
    _add_settings(status, serve=False)
    status.add_argument(
        "--json",
        action="store_true",
        help="print the Snapshot as JSON (with --from: the agent's /snapshot document)",
    )
    status.add_argument(
        "--watch",
        nargs="?",
        const="2s",
        metavar="SECONDS",
        help="redraw every SECONDS (default 2; or a duration: 500ms, 1m) until Ctrl-C: in "
        "place on a terminal, frames one after another otherwise",
    )
    status.add_argument(
        "--from",
        dest="from_url",
        metavar="URL",
        help="show the agent at URL (its /snapshot) instead of sampling NVML here; HEALTH "
        "shows the agent's verdicts (XID history included) where it has them",
    )
    status.add_argument(
        "--timeout", default="10s", metavar="DURATION", help="for --from (default 10s)"
    )
    health = commands.add_parser(
        "health",
        help="print each GPU's health verdict (exit 0 ok, 1 unhealthy, 2 could not decide)",
        usage="%(prog)s [--from URL] [--gpu LIST] [--strict] [--json] [FLAGS]",
    )
    health.add_argument(
        "--from",
        dest="from_url",
        metavar="URL",
        help="ask the agent at URL (its /health/gpus: XID history included) instead of "
        "sampling NVML once",
    )
    health.add_argument(
        "--gpu",
        metavar="LIST",
        help="only these GPUs: indices, UUIDs or MIG UUIDs, comma-separated, as CUDA reads "
        "CUDA_VISIBLE_DEVICES",
    )
    health.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    health.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    health.add_argument(
        "--timeout", default="10s", metavar="DURATION", help="for --from (default 10s)"
    )
    _add_settings(health, serve=False, keys={"simulate", "paths.proc", "paths.locks"})
    check = commands.add_parser("check-config", help="validate a config file (exit 0 or 2)")
    check.add_argument("file", metavar="FILE")
    launcher_flags.add_parsers(
        commands, lambda sub: _add_settings(sub, serve=False, keys=launcher_flags.USED_SETTINGS)
    )
    return parser


def _config(args: argparse.Namespace, actions: Callable[[Section], A]) -> Config[A]:
    """The settings from ``args``' flags, the environment and the config file, with the
    ``actions:`` section as ``actions`` parses it."""
    import os

    flags = {s.key: getattr(args, s.key, None) for s in SETTINGS}
    path = args.config or os.environ.get("GPU_EXPORTER_CONFIG")
    return load_config(path, flags, actions=actions, scenario=_check_scenario)


def _check_scenario(path: str) -> None:
    from exporter.simulate.scenario import load_scenario  # only configs that simulate pay

    load_scenario(path)  # kept while the file is unchanged: simulating reads it once


def _agent_actions(section: Section) -> Any:
    """The agent's ``actions:`` parser (imports the action engine only when called)."""
    from exporter.actions.engine import parse_actions

    return parse_actions(section)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@contextlib.contextmanager
def _simulation(config: Config) -> Iterator[Any]:
    """The configured simulated driver (None: none), started for the duration of the block: the
    library for ``Nvml(library=...)``."""
    if not config.simulate:
        yield None
        return
    from exporter.simulate.driver import SimulatedDriver
    from exporter.simulate.scenario import load_scenario

    scenario = load_scenario(config.simulate)
    driver = SimulatedDriver(scenario).start()
    try:
        yield driver
    finally:
        driver.stop()


@contextlib.contextmanager
def _open_collector(config: Config) -> Iterator[Any]:
    """A Collector of this host (or of the simulation ``config`` names), open for the block:
    one NVML session for as many samples as the block takes."""
    from exporter.core.nvml import Nvml
    from exporter.core.procfs import ProcFs
    from exporter.sampling.collect import Collector

    with _simulation(config) as driver:
        collector = Collector(
            Nvml(library=driver),
            ProcFs(config.proc_root),
            lock_dir=_agent_lock_dir(config),
            expose_cmdline=config.expose_cmdline,
        )
        try:
            yield collector
        finally:
            collector.close()


def _sample_once(config: Config) -> Any:
    """One Snapshot of this host (or of the simulation ``config`` names)."""
    with _open_collector(config) as collector:
        return collector.sample()


def _parse(parse: Callable[[Any], Any], raw: Any, flag: str) -> Any:
    try:
        return parse(raw)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def cmd_health(args: argparse.Namespace) -> int:
    """One verdict per GPU, from a running agent (``--from``) or one sample of NVML."""
    import time

    from exporter import healthcheck

    source = "agent" if args.from_url is not None else "nvml"
    try:
        timeout = _parse(positive_duration, args.timeout, "--timeout")
        if args.gpu is not None:
            healthcheck.check_gpu_list(args.gpu)
    except ValueError as exc:
        return healthcheck.cannot_decide(str(exc), args.json, source, args.from_url)
    try:
        if args.from_url is not None:
            document = healthcheck.from_agent(args.from_url, args.gpu, timeout)
        else:
            config = _config(args, skip_actions)
            _setup_logging("critical")  # reported in one line below
            document = healthcheck.from_sample(lambda: _sample_once(config), args.gpu, time.time)
    except healthcheck.CannotDecide as exc:
        return healthcheck.cannot_decide(str(exc), args.json, source, args.from_url)
    except ConfigError as exc:
        return healthcheck.cannot_decide(str(exc), args.json, source, None)
    return healthcheck.report(document, args.json, args.strict)


def cmd_status(args: argparse.Namespace) -> int:
    """Print one Snapshot, this host's or a running agent's (``--from``), as a table or JSON;
    with ``--watch``, redraw the table every interval until SIGINT or SIGTERM (exit 0)."""
    from exporter import status

    try:
        every, timeout = _status_flags(args)
    except ValueError as exc:
        print(f"gpu-exporter status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.from_url is not None:
        command = f"gpu-exporter status --from {args.from_url}"
        if every is not None:
            status.watch(status.fetched(args.from_url, timeout), every, command, sys.stdout)
            return EXIT_OK
        try:
            document, snapshot = status.fetch(args.from_url, timeout)
        except status.Unavailable as exc:
            print(f"gpu-exporter status: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        if args.json:
            import json

            print(json.dumps(document, indent=1))
        else:
            verdicts = status.agent_verdicts(document)
            print(status.format_status(snapshot, verdicts, status.colour_wanted(sys.stdout)))
        return EXIT_OK
    config = _config(args, skip_actions)
    _setup_logging("critical")  # status reports failures itself, in one line
    if every is not None:
        command = "gpu-exporter status" + (" --simulate" if config.simulate else "")
        with _open_collector(config) as collector:
            status.watch(status.sampled(collector), every, command, sys.stdout)
        return EXIT_OK
    snapshot = _sample_once(config)
    if not snapshot.nvml_up:
        print(f"gpu-exporter: {status.nvml_unavailable(snapshot)}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        import json

        from exporter.core.health import assess

        data = snapshot.to_dict()
        verdicts = assess([snapshot])  # as /snapshot carries the agent's
        for gpu in data["gpus"]:
            verdict = verdicts.get(gpu["uuid"])
            gpu["health"] = verdict.to_dict() if verdict is not None else None
        print(json.dumps(data, indent=1))
    else:
        print(status.format_status(snapshot, colour=status.colour_wanted(sys.stdout)))
    return EXIT_OK


def _status_flags(args: argparse.Namespace) -> tuple[float | None, float]:
    """``status``'s ``--watch`` interval (None: once) and ``--timeout``; ValueError naming the
    flag on a bad value or a combination that means nothing."""
    timeout = _parse(positive_duration, args.timeout, "--timeout")
    every = None if args.watch is None else _parse(positive_duration, args.watch, "--watch")
    if args.from_url is not None:
        from exporter.healthcheck import check_agent_url

        check_agent_url(args.from_url)
        if args.simulate is not None:
            raise ValueError(
                "--from shows a running agent's GPUs and --simulate samples simulated ones "
                "here: give one of them"
            )
    if every is not None and args.json:
        raise ValueError("--watch redraws the table and --json prints one document: not both")
    return every, timeout


def _peers(config: Config) -> Any:
    """The status page's peer watcher (``web.peers``), or None without ``peers``: it fetches
    each peer's /snapshot every interval (at least every second) within ``peer_timeout``."""
    if not config.peers:
        return None
    from exporter.web.client import get_json
    from exporter.web.peers import PeerWatcher

    interval = max(config.interval, 1.0)
    return PeerWatcher(config.peers, get_json, interval, config.peer_timeout)


def _kubelet(config: Config) -> Any:
    """The kubelet's pod-resources client, or None when the socket is set off. Its call's
    timeout is half the interval (at most 1 s): a hung kubelet never costs a sample more."""
    if not config.kubelet_socket:
        return None
    from exporter.core.kubelet import PodResourcesClient

    timeout = min(1.0, config.interval / 2)
    return PodResourcesClient(config.kubelet_socket, config.kubelet_resources, timeout)


def _agent_lock_dir(config: Config) -> str | None:
    """The launchers' lock directory the agent watches (None when there is none to watch)."""
    from exporter.core.locks import LockError, default_lock_dir

    try:
        return config.lock_dir or default_lock_dir()
    except LockError as exc:
        log.warning("not watching launcher locks: %s", exc)
        return None


def _check_tls(config: Config) -> Any:
    """Load the TLS files (or the web config file) once, so that a bad one is a usage error
    (exit 2) naming its setting, or its file and line, rather than a failure to serve. The
    loaded web config (None without one)."""
    from exporter.web.server import tls_context
    from exporter.web.webconfig import load_web_config

    if config.web.config_file:
        return load_web_config(config.web.config_file)
    if not config.tls_cert_file:
        return None
    checks: list[tuple[str, str | None]] = [
        ("--tls-cert-file/--tls-key-file (tls.cert_file, tls.key_file)", None)
    ]
    if config.tls_client_ca_file:  # checked second: the certificate is known good by then
        checks.append(("--tls-client-ca-file (tls.client_ca_file)", config.tls_client_ca_file))
    for settings, client_ca in checks:
        try:
            tls_context(config.tls_cert_file, config.tls_key_file or "", client_ca)
        except OSError as exc:  # ssl.SSLError included
            raise ConfigError(settings, "", str(exc)) from None
    return None


class Signals:
    """SIGTERM and SIGINT (stop) and SIGHUP (reload) for the main thread, which sleeps until
    one comes: no periodic wake-up (each one costs the agent a GIL hand-over with the sampler).
    The handlers only set flags (no lock a handler could find held); the wake-up is
    ``signal.set_wakeup_fd``'s byte on a pipe."""

    def __init__(self) -> None:
        self.stopping = False
        self._reloads = self._taken = 0
        self._read_fd = self._write_fd = -1
        self._previous: list[tuple[int, Any]] = []
        self._previous_fd = -1

    def __enter__(self) -> Signals:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._previous.append((signum, signal.signal(signum, self._on_signal)))
        return self

    def __exit__(self, *_exc: object) -> None:
        for signum, handler in self._previous:
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGHUP:
            self._reloads += 1
            return
        if not self.stopping:
            log.info("received %s, stopping", signal.Signals(signum).name)
        self.stopping = True

    def wait(self, timeout: float | None) -> bool:
        """Sleep until a signal came (or ``timeout`` passed); True once a stop was asked."""
        if not self.stopping and self._reloads == self._taken:
            ready, _, _ = select.select([self._read_fd], [], [], timeout)
            if ready:
                os.read(self._read_fd, 512)
        return self.stopping

    def take_reload(self) -> bool:
        """Whether a SIGHUP came since the last call."""
        reloads = self._reloads
        taken, self._taken = self._taken, reloads
        return reloads != taken


def cmd_serve(args: argparse.Namespace) -> int:
    """Sample and serve until SIGTERM or SIGINT; SIGHUP reloads the config and the web config
    file (which is also reloaded when it or its TLS files change)."""
    from exporter.actions.engine import ActionEngine
    from exporter.core.nvml import Nvml
    from exporter.core.procfs import ProcFs
    from exporter.core.xid import XidLog
    from exporter.exposition.metrics import render_with_process
    from exporter.sampling.collect import Collector
    from exporter.sampling.events import XidWatcher
    from exporter.sampling.sampler import Sampler
    from exporter.web.routes import App, serve
    from exporter.web.server import Options

    config = _config(args, _agent_actions)
    web = _check_tls(config)
    _setup_logging(config.log_level)
    signals = Signals()
    with signals, _simulation(config) as driver:
        procfs = ProcFs(config.proc_root)
        lock_dir = _agent_lock_dir(config)
        nvml = Nvml(library=driver)
        xids = XidWatcher(nvml, XidLog())
        collector = Collector(
            nvml,
            procfs,
            lock_dir=lock_dir,
            expose_cmdline=config.expose_cmdline,
            provision_locks=True,  # the agent makes each GPU's lock file its own
            xids=xids,
            slurm_job_dir=config.slurm_job_dir,
            kubelet=_kubelet(config),
        )
        sampler = Sampler(
            collector,
            interval=config.interval,
            deadline=config.deadline,
            history=config.history,
            render=render_with_process,
        )
        dev_root = config.dev_root
        if driver is not None and dev_root == BY_KEY["paths.dev"].default:
            dev_root = driver.dev_root  # the simulation's stand-ins for /dev/nvidiaN
        state_file = config.state_file
        if state_file is None and driver is not None:
            state_file = ""  # simulated XIDs never enter the host's real state file
        engine = ActionEngine(
            sampler,
            config.actions,
            procfs,
            dev_root,
            lock_dir=lock_dir,
            state_file=state_file,
        )
        peers = _peers(config)
        try:
            server = serve(
                App(sampler, engine, peers),
                config.listen.host,
                config.listen.port,
                cert_file=config.tls_cert_file,
                key_file=config.tls_key_file,
                client_ca_file=config.tls_client_ca_file,
                web=web,
                options=Options(
                    max_connections=config.web.max_connections,
                    head_timeout=config.web.head_timeout,
                    keepalive_timeout=config.web.keepalive_timeout,
                    write_timeout=config.web.write_timeout,
                    max_head=config.web.max_head_bytes,
                ),
                healthz_without_auth=config.web.healthz_without_auth,
            )
        except OSError as exc:
            print(
                f"gpu-exporter: cannot serve on {config.listen}: {exc.strerror or exc}",
                file=sys.stderr,
            )
            return EXIT_FAILURE
        tune_collector()
        sampler.start()
        xids.start()
        engine.start()
        if peers is not None:
            peers.start()
        scheme = "https" if config.tls_cert_file or (web and web.ssl_context) else "http"
        log.info(
            "serving on %s://%s (interval %gs%s)",
            scheme,
            config.listen,
            config.interval,
            f", simulated GPUs: {config.simulate}" if driver else "",
        )
        waiting = False  # a reload waits for a running action, a second at a time
        while not signals.wait(1.0 if waiting else None):
            reload = signals.take_reload()
            if reload or waiting:
                if reload:
                    server.reload_web_config()  # as its watch does; logs what it did
                reloaded = _reload(args, config, sampler, engine, waiting)
                waiting = reloaded is None
                config = reloaded or config
        xids.request_stop()  # its wait ends meanwhile (within a second)
        server.close()
        if peers is not None:
            peers.stop()
        engine.stop()
        if not sampler.stop(timeout=0.5):
            log.warning("a sample is still running (NVML hung?); exiting without waiting for it")
        if not xids.stop(timeout=1.1):  # a wait lasts at most 1 s
            log.warning("the XID thread is still waiting in NVML; exiting without it")
        collector.close(timeout=0.5)
    log.info("stopped")
    return EXIT_OK


#: Config attributes that a reload cannot change, with their config keys (the web server's
#: settings as one: its listener is made once).
_RESTART_ONLY = {
    **{s.field: s.key for s in SETTINGS if not s.reloadable and not s.key.startswith("web.")},
    "web": "web.*",
}


#: The garbage collector's youngest generation threshold while serving (CPython's is 700).
YOUNG_GC_THRESHOLD = 10_000


def tune_collector() -> None:
    """Tune CPython's garbage collector for serving: what start-up made (modules, the
    configuration) goes to the permanent generation, never traversed again, and the youngest
    generation is collected after 10,000 net new containers instead of 700.

    A sample makes a few thousand containers that reference counting frees when it ends, so
    at 700 a collection came in nearly every sample and traversed the half-built Snapshot:
    0.19 ms of CPU a second on the 8 x 16 benchmark host, 0.04 at this threshold (see
    docs/benchmarks.md). Cycles, which only the collector frees, are rare here."""
    import gc

    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


def _reload(
    args: argparse.Namespace, running: Config, sampler: Any, engine: Any, waiting: bool = False
) -> Config | None:
    """Apply the config file again; an invalid one is rejected and the running config stays.

    None when an action's run is still in progress after a second: nothing was applied, and the
    caller tries again (so SIGTERM is still heard while a run takes long).
    """
    from exporter.actions.engine import ActionBusy

    try:
        new = _config(args, _agent_actions)
    except ConfigError as exc:
        log.error("config reload rejected, the running config stays: %s", exc)
        return running
    try:
        engine.reload(new.actions, timeout=1.0)  # first: the only part that can be busy
    except ActionBusy as exc:
        if not waiting:
            log.info("config reload waits for the %s action's run to end", exc)
        return None
    logging.getLogger().setLevel(new.log_level.upper())
    sampler.interval, sampler.deadline = new.interval, new.deadline
    sampler.stats.interval_seconds = new.interval
    sampler.collector.expose_cmdline = new.expose_cmdline  # from the next sample on
    changed = [
        key for attr, key in _RESTART_ONLY.items() if getattr(new, attr) != getattr(running, attr)
    ]
    if changed:
        log.warning("config reloaded; %s change only after a restart", ", ".join(changed))
    else:
        log.info("config reloaded")
    return dataclasses.replace(new, **{attr: getattr(running, attr) for attr in _RESTART_ONLY})


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate a config file."""
    from exporter.core import privileges

    config = load_config(args.file, environ={}, actions=_agent_actions, scenario=_check_scenario)
    _check_tls(config)
    print(f"{args.file}: ok")
    reaper = config.actions.actions["zombie_reaper"]
    if reaper.enabled:  # valid, but what this process could not do if it ran the agent
        for line in privileges.reaper_warnings(reaper.options.dry_run, privileges.effective()):
            print(f"gpu-exporter: warning (as this command runs): {line}", file=sys.stderr)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpu-exporter`` command."""
    if (sys.argv[1:] if argv is None else list(argv)) == ["--version"]:
        print(f"gpu-exporter {__version__}")  # before the parser: it loads every setting
        return EXIT_OK
    args = build_parser().parse_args(argv)
    handlers = {
        "serve": cmd_serve,
        "status": cmd_status,
        "health": cmd_health,
        "check-config": cmd_check_config,
    }
    try:
        if args.command in ("recommend", "run"):
            _setup_logging("critical")  # they report failures themselves, in one line
            from exporter.config.policies import recommend_policies
            from exporter.launcher import cli as launcher_cli

            return launcher_cli.handle(args.command, args, _config(args, recommend_policies))
        return handlers[args.command](args)
    except ConfigError as exc:
        print(f"gpu-exporter: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `status | head -1`: the reader has what it wanted
        _quiet_stdout()
        return EXIT_OK


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's own flush at exit does not
    fail again on the closed pipe (and print a traceback)."""
    import os

    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
