"""The agent's settings: defaults, YAML file, environment variables and flags, in that order.

Every setting has a YAML key, a flag and an environment variable: ``GPU_EXPORTER_`` + the key in
upper case, dots as underscores (``paths.locks`` alone is ``GPU_EXPORTER_LOCK_DIR``). Flags
override variables, which override the file. Each bad value raises ConfigError naming where it
came from (file:line, flag or variable) and why.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from exporter.config.validate import duration_between, peer_urls, switch, whole
from exporter.config.yamlconf import ConfigError, Document, Section, load_document
from exporter.core.kubelet import DEFAULT_SOCKET as DEFAULT_KUBELET_SOCKET
from exporter.core.kubelet import resource_names

#: What the ``actions:`` section parses to: the agent's action settings, or (for the launcher)
#: just the recommendation policies. The parser is handed in, so config never imports actions.
A = TypeVar("A")

DEFAULT_PORT = 9402
BUILTIN_SCENARIO = "builtin"
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Listen:
    """Where the HTTP server binds; an empty host means every interface."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class WebSettings:
    """The HTTP server's settings (``web.*``): the exporter-toolkit web config file and the
    server's limits."""

    config_file: str | None = None
    healthz_without_auth: bool = False
    max_connections: int = 1024
    head_timeout: float = 10.0
    keepalive_timeout: float = 120.0
    write_timeout: float = 30.0
    max_head_bytes: int = 65536


@dataclass(frozen=True)
class Config(Generic[A]):
    """Validated settings of one agent; ``actions`` as the caller's parser made them."""

    listen: Listen
    interval: float
    deadline: float
    log_level: str
    simulate: str | None  # None, "builtin", or a scenario file
    proc_root: str
    dev_root: str
    lock_dir: str | None  # None: the default, resolved when used (launcher.locks)
    #: the health action's state file; None: the default, "": none (memory only)
    state_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    tls_client_ca_file: str | None
    history: int
    actions: A
    expose_cmdline: bool = False  # command lines in /snapshot and status (they may hold secrets)
    web: WebSettings = WebSettings()
    slurm_job_dir: str | None = None  # a prolog's job-mapping directory (core.jobmap)
    kubelet_socket: str | None = None  # the kubelet's pod-resources socket (core.kubelet)
    kubelet_resources: tuple[str, ...] = ()  # resource names beside core.kubelet.GPU_RESOURCES
    peers: tuple[str, ...] = ()  # other agents' base URLs, for the status page (web.peers)
    peer_timeout: float = 2.0


def parse_listen(value: Any) -> Listen:
    """``HOST:PORT``, ``:PORT`` (every interface) or ``[IPV6]:PORT``."""
    text = str(value).strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT such as 0.0.0.0:{DEFAULT_PORT}, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"write IPv6 addresses in brackets, like [::]:{DEFAULT_PORT}")
    try:
        port = whole(1, 65535)(port_text)
    except ValueError:
        raise ValueError(f"port must be a number from 1 to 65535, got {port_text!r}") from None
    if any(ch.isspace() for ch in host):
        raise ValueError(f"invalid host {host!r}")
    return Listen(host, port)


#: Bounds of interval and deadline: a sample at least every hour, or the exporter says nothing
#: useful (and /healthz, which waits interval + deadline, would hide a dead sampler for days).
MIN_INTERVAL, MAX_INTERVAL = 0.01, 3600.0
_interval = duration_between(MIN_INTERVAL, MAX_INTERVAL)


def _optional_duration(value: Any) -> float | None:
    return None if value in (None, "", "auto") else _interval(value)


def _log_level(value: Any) -> str:
    text = str(value).strip().lower()
    if text not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return text


def _simulate(value: Any) -> str | None:
    if value is None or value is False or str(value).strip().lower() in ("", "false", "no", "off"):
        return None
    if value is True or str(value).strip().lower() in ("true", "yes", "on", BUILTIN_SCENARIO):
        return BUILTIN_SCENARIO
    path = str(value)
    if not os.path.exists(path):  # the scenario loader refuses what is not a regular file
        raise ValueError(f"scenario file {path!r} does not exist")
    return path  # its contents: load_config's ``scenario`` check


def _directory(value: Any) -> str:
    path = str(value)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory")
    return path


def _optional_file(value: Any) -> str | None:
    if value in (None, ""):
        return None
    path = str(value)
    if not os.path.isfile(path):
        raise ValueError(f"file {path!r} does not exist")
    return path


def _optional_absolute(value: Any) -> str | None:
    """An absolute path, or None: what it names is looked at when used (it may come later)."""
    if value in (None, ""):
        return None
    path = str(value)
    if not os.path.isabs(path):
        raise ValueError(f"{path!r} is not an absolute path")
    return path


def _state_file(value: Any) -> str:
    text = str(value).strip()
    if text.lower() in ("", "off", "none", "false"):
        return ""  # kept in memory only
    if text.endswith("/") or os.path.isdir(text):
        raise ValueError(f"{text!r} is a directory; name the state file (like .../health.json)")
    return text


_history = whole(1, 100_000)


@dataclass(frozen=True)
class Setting:
    """One setting, declared once: its YAML key (dotted), flag, parser, default and meaning;
    the :class:`Config` attribute it fills; whether a reload (SIGHUP) may change it; whether
    only ``serve`` reads it; whether its flag alone means true."""

    key: str
    flag: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    env_name: str = ""  # when the variable is not GPU_EXPORTER_ + the key
    attr: str = ""  # when the attribute is not the key with dots as underscores
    reloadable: bool = False
    serve_only: bool = False
    switch: bool = False

    @property
    def env(self) -> str:
        return self.env_name or "GPU_EXPORTER_" + self.key.replace(".", "_").upper()

    @property
    def field(self) -> str:
        """The attribute of Config (of WebSettings for ``web.*``) it fills."""
        return (
            self.attr or self.key.partition(".")[2]
            if self.key.startswith("web.")
            else (self.attr or self.key.replace(".", "_"))
        )


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "listen",
        "--listen",
        parse_listen,
        f"0.0.0.0:{DEFAULT_PORT}",
        f"HOST:PORT to serve HTTP on (default all interfaces, port {DEFAULT_PORT})",
        serve_only=True,
    ),
    Setting(
        "interval",
        "--interval",
        _interval,
        "5s",
        "time between samples (default 5s)",
        reloadable=True,
        serve_only=True,
    ),
    Setting(
        "deadline",
        "--deadline",
        _optional_duration,
        None,
        "how long a sample may take before the Snapshot counts as stale; default: the interval",
        reloadable=True,
        serve_only=True,
    ),
    Setting(
        "log_level",
        "--log-level",
        _log_level,
        "info",
        "debug, info, warning or error",
        reloadable=True,
        serve_only=True,
    ),
    Setting(
        "simulate",
        "--simulate",
        _simulate,
        None,
        "run on simulated GPUs: 'builtin' or a scenario YAML file",
    ),
    Setting(
        "paths.proc",
        "--proc",
        _directory,
        "/proc",
        "procfs root (/host/proc in a container)",
        attr="proc_root",
    ),
    Setting(
        "paths.locks",
        "--lock-dir",
        _directory,
        None,
        "launcher lock directory (default /run/gpu-exporter/locks, else a per-user one)",
        env_name="GPU_EXPORTER_LOCK_DIR",
        attr="lock_dir",
    ),
    Setting(
        "paths.state",
        "--state-file",
        _state_file,
        None,
        "file where the health verdict's critical XIDs outlive a restart (default "
        "/var/lib/gpu-exporter/health.json as root, else ~/.local/state/gpu-exporter/; "
        "'off': kept in memory only; off by default with --simulate)",
        attr="state_file",
    ),
    Setting(
        "paths.slurm_job_dir",
        "--slurm-job-dir",
        _optional_absolute,
        None,
        "a prolog's job-mapping directory: one file per GPU naming its Slurm job (off by default)",
        attr="slurm_job_dir",
        serve_only=True,
    ),
    Setting(
        "paths.kubelet_socket",
        "--kubelet-socket",
        _optional_absolute,
        DEFAULT_KUBELET_SOCKET,
        "the kubelet's pod-resources socket, to name the pod of each GPU and process; off where "
        f"it does not exist, or set to '' (default {DEFAULT_KUBELET_SOCKET})",
        attr="kubelet_socket",
        serve_only=True,
    ),
    Setting(
        "kubelet.resources",
        "--kubelet.resources",
        resource_names,
        (),
        "device-plugin resources that are GPUs beside nvidia.com/gpu, nvidia.com/gpu.shared and "
        "nvidia.com/mig-*: a list, or names separated by commas ('*' ends a prefix)",
        serve_only=True,
    ),
    Setting(
        "paths.dev",
        "--dev",
        _directory,
        "/dev",
        "device root holding nvidiaN nodes (/host/dev in a container)",
        attr="dev_root",
        serve_only=True,
    ),
    Setting(
        "tls.cert_file",
        "--tls-cert-file",
        _optional_file,
        None,
        "serve HTTPS with this certificate",
        serve_only=True,
    ),
    Setting(
        "tls.key_file",
        "--tls-key-file",
        _optional_file,
        None,
        "private key of --tls-cert-file",
        serve_only=True,
    ),
    Setting(
        "tls.client_ca_file",
        "--tls-client-ca-file",
        _optional_file,
        None,
        "require client certificates signed by this CA",
        serve_only=True,
    ),
    Setting(
        "history", "--history", _history, 120, "Snapshots kept for rules over time", serve_only=True
    ),
    Setting(
        "expose_cmdline",
        "--expose-cmdline",
        switch,
        False,
        "show processes' full command lines in /snapshot and status (they may hold secrets; "
        "default: the process name only)",
        reloadable=True,
        switch=True,
    ),
    Setting(
        "peers",
        "--peers",
        peer_urls,
        "",
        "other agents' base URLs (comma-separated) for the status page's Hosts table; the agent "
        "fetches their /snapshot itself",
        serve_only=True,
    ),
    Setting(
        "peer_timeout",
        "--peer-timeout",
        duration_between(0.1, 30.0),
        "2s",
        "time each fetch of a peer's /snapshot may take: 100ms to 30s (default 2s)",
        serve_only=True,
    ),
)
#: The HTTP server's settings, with their bounds (docs: README.md, docs/security.md).
WEB_SETTINGS: tuple[Setting, ...] = (
    Setting(
        "web.config_file",
        "--web.config.file",
        _optional_file,
        None,
        "exporter-toolkit web config file: TLS, basic auth, response headers (instead of --tls-*)",
        serve_only=True,
    ),
    Setting(
        "web.healthz_without_auth",
        "--web.healthz-without-auth",
        switch,
        False,
        "serve /healthz without basic auth, for liveness probes (default false)",
        serve_only=True,
        switch=True,
    ),
    Setting(
        "web.max_connections",
        "--web.max-connections",
        whole(1, 65536),
        1024,
        "HTTP connections open at once, idle keep-alive ones included: 1 to 65536 (default 1024)",
        serve_only=True,
    ),
    Setting(
        "web.head_timeout",
        "--web.head-timeout",
        duration_between(0.1, 300.0),
        "10s",
        "time a client has to send a request head, TLS handshake included: 100ms to 5m "
        "(default 10s)",
        serve_only=True,
    ),
    Setting(
        "web.keepalive_timeout",
        "--web.keepalive-timeout",
        duration_between(0.0, 3600.0),
        "2m",
        "time an idle keep-alive connection stays open: 0s (no keep-alive) to 1h (default 2m)",
        serve_only=True,
    ),
    Setting(
        "web.write_timeout",
        "--web.write-timeout",
        duration_between(1.0, 600.0),
        "30s",
        "time to send a whole response: 1s to 10m (default 30s)",
        serve_only=True,
    ),
    Setting(
        "web.max_head_bytes",
        "--web.max-head-bytes",
        whole(1024, 1048576),
        65536,
        "largest request head in bytes: 1024 to 1048576 (default 65536)",
        serve_only=True,
    ),
)
SETTINGS += WEB_SETTINGS
BY_KEY = {setting.key: setting for setting in SETTINGS}


def skip_actions(section: Section) -> None:
    """An ``actions:`` parser for callers that use none of it (the section is not checked)."""
    del section


def _from_file(path: str, actions: Callable[[Section], A]) -> tuple[dict[str, tuple[Any, str]], A]:
    """Each setting the file sets, as (value, file:line), and the actions."""
    doc = load_document(path)
    root = doc.root()
    sections: dict[str, Section] = {"": root}
    values: dict[str, tuple[Any, str]] = {}
    for setting in SETTINGS:
        prefix, _, name = setting.key.rpartition(".")
        if prefix not in sections:
            sections[prefix] = root.section(prefix)
        section = sections[prefix]
        if section.has(name):
            where = doc.where((*section.keys, name))
            values[setting.key] = (section.get(name, setting.parse), where)
        else:
            section.get(name, str, None)  # known, absent
    parsed = actions(root.section("actions"))
    for section in sections.values():
        section.done()
    return values, parsed


def load_config(
    path: str | None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    actions: Callable[[Section], A],
    scenario: Callable[[str], object] | None = None,
) -> Config[A]:
    """Merge defaults, the file at ``path``, ``environ`` and ``flags`` (by setting key).

    ``actions`` parses the ``actions:`` section (an empty one without a file); ``scenario``,
    when given, checks a scenario file named by ``simulate`` (raising ConfigError).
    """
    environ = os.environ if environ is None else environ
    flags = flags or {}
    values: dict[str, Any] = {
        s.key: s.parse(s.default) if s.default is not None else None for s in SETTINGS
    }
    origin = {s.key: "default" for s in SETTINGS}  # where each value came from, for errors
    if path:
        from_file, parsed = _from_file(path, actions)
        for key, (value, where) in from_file.items():
            values[key], origin[key] = value, where
    else:
        parsed = actions(Document("defaults", {}, {}).root().section("actions"))  # no YAML to read
    for setting in SETTINGS:
        if setting.env in environ:
            origin[setting.key] = f"environment variable {setting.env}"
            values[setting.key] = _parse(setting, environ[setting.env], origin[setting.key])
    for setting in SETTINGS:
        if flags.get(setting.key) is not None:
            origin[setting.key] = f"flag {setting.flag}"
            values[setting.key] = _parse(setting, flags[setting.key], origin[setting.key])
    for given, needed in (
        ("tls.cert_file", "tls.key_file"),
        ("tls.key_file", "tls.cert_file"),
        ("tls.client_ca_file", "tls.cert_file"),
    ):
        if values[given] and not values[needed]:
            raise ConfigError(
                origin[given], given, f"needs {needed} too (flag {BY_KEY[needed].flag})"
            )
    if values["web.config_file"] and values["tls.cert_file"]:
        raise ConfigError(
            origin["web.config_file"],
            "web.config_file",
            f"and tls.cert_file ({origin['tls.cert_file']}) both configure the server: pick one "
            "(the web config's tls_server_config, or --tls-cert-file/--tls-key-file)",
        )
    if scenario is not None and values["simulate"] not in (None, BUILTIN_SCENARIO):
        try:  # a broken scenario fails check-config too, with its own file:line
            scenario(values["simulate"])
        except ConfigError as exc:  # after the flag, variable or file:line that named it
            raise ConfigError(origin["simulate"], "simulate", str(exc)) from None
    plain = {s.field: values[s.key] for s in SETTINGS if not s.key.startswith("web.")}
    if plain["deadline"] is None:
        plain["deadline"] = plain["interval"]
    web = WebSettings(**{s.field: values[s.key] for s in WEB_SETTINGS})
    return Config(**plain, actions=parsed, web=web)


def _parse(setting: Setting, raw: Any, where: str) -> Any:
    try:
        return setting.parse(raw)
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise ConfigError(where, "", str(exc)) from None
