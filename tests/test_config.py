"""Settings: defaults, YAML file, environment variables, flags, and where each error points."""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from pathlib import Path

import pytest

from exporter.config.settings import Listen, parse_listen
from exporter.config.yamlconf import ConfigError
from tests.helpers import agent_config, line_of, write


def config_error(path: str | None, flags: dict | None = None, environ: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        agent_config(path, flags or {}, environ=environ or {})
    return str(info.value)


# -- defaults and the file ------------------------------------------------------------------------


def test_defaults() -> None:
    config = agent_config(None, {}, environ={})
    assert config.listen == Listen("0.0.0.0", 9402)
    assert str(config.listen) == "0.0.0.0:9402"
    assert config.interval == 5.0
    assert config.deadline == config.interval
    assert config.log_level == "info"
    assert config.simulate is None
    assert config.proc_root == "/proc"
    assert config.history == 120
    assert (config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file) == (
        None,
        None,
        None,
    )


def test_defaults_ignore_unrelated_environment() -> None:
    config = agent_config(None, {}, environ={"GPU_EXPORTER": "x", "INTERVAL": "1s", "PATH": "/"})
    assert config.interval == 5.0


def test_process_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_EXPORTER_INTERVAL", "7s")
    assert agent_config(None, {}).interval == 7.0


def test_file_sets_every_key(tmp_path: Path) -> None:
    proc = tmp_path / "hostproc"
    proc.mkdir()
    cert, key, ca = (tmp_path / n for n in ("cert.pem", "key.pem", "ca.pem"))
    for f in (cert, key, ca):
        f.write_text("x")
    path = write(
        tmp_path,
        f"""
        # a full config
        listen: 127.0.0.1:9500
        interval: 2s
        deadline: 1s
        log_level: DEBUG
        simulate: builtin
        paths:
          proc: {proc}
        tls:
          cert_file: {cert}
          key_file: {key}
          client_ca_file: {ca}
        history: 30
        """,
    )
    config = agent_config(path, {}, environ={})
    assert config.listen == Listen("127.0.0.1", 9500)
    assert config.interval == 2.0
    assert config.deadline == 1.0
    assert config.log_level == "debug"
    assert config.simulate == "builtin"
    assert config.proc_root == str(proc)
    assert (config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file) == (
        str(cert),
        str(key),
        str(ca),
    )
    assert config.history == 30


def test_deadline_follows_interval_unless_set(tmp_path: Path) -> None:
    assert agent_config(write(tmp_path, "interval: 2s\n"), {}, environ={}).deadline == 2.0
    auto = write(tmp_path, "interval: 2s\ndeadline: auto\n", "auto.yaml")
    assert agent_config(auto, {}, environ={}).deadline == 2.0
    assert agent_config(None, {"interval": "3s"}, environ={}).deadline == 3.0


def test_simulate_scenario_file(tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("gpus: []\n")
    path = write(tmp_path, f"simulate: {scenario}\n")
    assert agent_config(path, {}, environ={}).simulate == str(scenario)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", "builtin"), ("yes", "builtin"), ("false", None), ("off", None), ("''", None)],
)
def test_simulate_booleans(tmp_path: Path, value: str, expected: str | None) -> None:
    path = write(tmp_path, f"simulate: {value}\n")
    assert agent_config(path, {}, environ={}).simulate == expected


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file_is_defaults(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert agent_config(str(path), {}, environ={}) == agent_config(None, {}, environ={})


def test_empty_sections_are_fine(tmp_path: Path) -> None:
    path = write(tmp_path, "paths:\ntls: {}\n")
    assert agent_config(path, {}, environ={}).proc_root == "/proc"


# -- precedence -----------------------------------------------------------------------------------


def test_precedence_flags_over_env_over_file_over_default(tmp_path: Path) -> None:
    file_proc, env_proc, flag_proc = (tmp_path / n for n in ("fp", "ep", "gp"))
    for d in (file_proc, env_proc, flag_proc):
        d.mkdir()
    path = write(
        tmp_path,
        f"""
        listen: 127.0.0.1:1001
        interval: 2s
        log_level: warning
        paths:
          proc: {file_proc}
        """,
    )
    environ = {
        "GPU_EXPORTER_LISTEN": "127.0.0.1:1002",
        "GPU_EXPORTER_INTERVAL": "3s",
        "GPU_EXPORTER_PATHS_PROC": str(env_proc),
        "GPU_EXPORTER_HISTORY": "55",
    }
    flags = {"listen": "127.0.0.1:1003", "interval": "4s", "paths.proc": str(flag_proc)}

    only_file = agent_config(path, {}, environ={})
    assert (only_file.listen.port, only_file.interval, only_file.proc_root) == (
        1001,
        2.0,
        str(file_proc),
    )
    assert only_file.log_level == "warning"
    assert only_file.history == 120  # default: the file does not set it

    with_env = agent_config(path, {}, environ=environ)
    assert (with_env.listen.port, with_env.interval, with_env.proc_root) == (
        1002,
        3.0,
        str(env_proc),
    )
    assert with_env.history == 55
    assert with_env.log_level == "warning"  # the file still counts where env is silent

    with_flags = agent_config(path, flags, environ=environ)
    assert (with_flags.listen.port, with_flags.interval, with_flags.proc_root) == (
        1003,
        4.0,
        str(flag_proc),
    )
    assert with_flags.history == 55  # env where no flag is given
    assert with_flags.log_level == "warning"


def test_none_flags_do_not_override(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: 2s\n")
    config = agent_config(path, {"interval": None, "listen": None}, environ={})
    assert config.interval == 2.0


def test_env_overrides_default_without_file() -> None:
    config = agent_config(None, {}, environ={"GPU_EXPORTER_LOG_LEVEL": "ERROR"})
    assert config.log_level == "error"


# -- errors in the file: file:line, key, why -------------------------------------------------------


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, "listen: :9402\nintervall: 5s\nhistory: 10\n")
    message = config_error(path)
    assert f"config.yaml:{line_of(path, 'intervall')}" in message
    assert "intervall" in message
    assert "unknown key" in message
    assert message.startswith(path)


def test_unknown_key_error_attributes(tmp_path: Path) -> None:
    path = write(tmp_path, "intervall: 5s\n")
    with pytest.raises(ConfigError) as info:
        agent_config(path, {}, environ={})
    assert info.value.where == f"{path}:1"
    assert info.value.key == "intervall"
    assert "unknown key" in info.value.why


def test_unknown_nested_key(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: 5s\npaths:\n  prc: /proc\n")
    message = config_error(path)
    assert f"config.yaml:{line_of(path, 'prc')}:" in message
    assert "paths.prc" in message
    assert "unknown key" in message


def test_unknown_tls_key(tmp_path: Path) -> None:
    path = write(tmp_path, "tls:\n  cert: x.pem\n")
    message = config_error(path)
    assert "config.yaml:2:" in message
    assert "tls.cert" in message


@pytest.mark.parametrize(
    ("text", "key", "needle"),
    [
        ("interval: 5 seconds\n", "interval", "5 seconds"),
        ("interval: 0s\n", "interval", "at least"),
        ("interval: -1s\n", "interval", "-1s"),
        ("interval:\n", "interval", "None"),
        ("deadline: soon\n", "deadline", "soon"),
        ("deadline: 0\n", "deadline", "at least"),
        ("log_level: loud\n", "log_level", "loud"),
        ("history: 0\n", "history", "from 1"),
        ("history: many\n", "history", "many"),
        ("history: true\n", "history", "True"),
        ("history: 1.5\n", "history", "1.5"),
        ("listen: nope\n", "listen", "nope"),
        ("listen: 127.0.0.1\n", "listen", "HOST:PORT"),
        ("listen: '127.0.0.1:'\n", "listen", "port"),
        ("listen: 127.0.0.1:0\n", "listen", "port"),
        ("listen: 127.0.0.1:70000\n", "listen", "70000"),
        ("listen: ::1:9402\n", "listen", "brackets"),
        ("paths: /proc\n", "paths", "mapping"),
    ],
)
def test_bad_values_name_file_line_and_key(
    tmp_path: Path, text: str, key: str, needle: str
) -> None:
    path = write(tmp_path, "# settings\n\n" + text)
    message = config_error(path)
    assert message.startswith(f"{path}:3: {key}: "), message
    assert needle in message


def test_bad_value_on_a_later_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        listen: :9402
        log_level: info

        interval: 5x
        history: 10
        """,
    )
    message = config_error(path)
    assert f"config.yaml:{line_of(path, '5x')}: interval:" in message
    assert line_of(path, "5x") == 4


def test_nonexistent_simulate_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    path = write(tmp_path, f"interval: 1s\nsimulate: {missing}\n")
    message = config_error(path)
    assert "config.yaml:2: simulate:" in message
    assert str(missing) in message
    assert "does not exist" in message


def test_nonexistent_proc_directory(tmp_path: Path) -> None:
    path = write(tmp_path, f"paths:\n  proc: {tmp_path / 'nope'}\n")
    message = config_error(path)
    assert "config.yaml:2: paths.proc:" in message
    assert "not a directory" in message


def test_proc_that_is_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("")
    path = write(tmp_path, f"paths:\n  proc: {afile}\n")
    assert "paths.proc" in config_error(path)


def test_nonexistent_tls_file(tmp_path: Path) -> None:
    path = write(tmp_path, f"tls:\n  cert_file: {tmp_path / 'c.pem'}\n  key_file: k.pem\n")
    message = config_error(path)
    assert "config.yaml:2: tls.cert_file:" in message
    assert "does not exist" in message


def test_duplicate_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: 5s\nlisten: :1\ninterval: 10s\n")
    message = config_error(path)
    assert "config.yaml:3:" in message
    assert "interval" in message
    assert "duplicate key" in message


def test_duplicate_nested_key(tmp_path: Path) -> None:
    path = write(tmp_path, "paths:\n  proc: /proc\n  proc: /proc\n")
    message = config_error(path)
    assert "config.yaml:3:" in message
    assert "paths.proc" in message
    assert "duplicate key" in message


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("interval: 5s\nlisten: [oops\nhistory: 3\n", None),
        ("interval: 5s\n  listen: :1\n", 2),
        ("interval: 5s\nlog_level: 'unterminated\n", None),
        ("interval: 5s\n\tlisten: :1\n", 2),
    ],
)
def test_invalid_yaml_names_the_line(tmp_path: Path, text: str, line: int | None) -> None:
    path = write(tmp_path, text)
    message = config_error(path)
    assert "invalid YAML" in message
    match = re.match(re.escape(path) + r":(\d+): ", message)
    assert match, message
    if line is not None:
        assert int(match.group(1)) == line
    else:
        assert 2 <= int(match.group(1)) <= 3


@pytest.mark.parametrize("text", ["- interval: 5s\n- history: 3\n", "just a string\n", "42\n"])
def test_file_that_is_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    message = config_error(path)
    assert message.startswith(f"{path}:1:")
    assert "mapping" in message


def test_unreadable_file(tmp_path: Path) -> None:
    message = config_error(str(tmp_path / "missing.yaml"))
    assert "missing.yaml" in message
    assert "cannot read" in message


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"log_level: caf\xe9\n")
    message = config_error(str(path))
    assert "latin1.yaml" in message
    assert "cannot read" in message


def test_file_that_is_a_directory(tmp_path: Path) -> None:
    assert str(tmp_path) in config_error(str(tmp_path))


# -- TLS settings go together ---------------------------------------------------------------------


@pytest.fixture
def pem_files(tmp_path: Path) -> tuple[str, str, str]:
    files = [tmp_path / n for n in ("cert.pem", "key.pem", "ca.pem")]
    for f in files:
        f.write_text("x")
    return str(files[0]), str(files[1]), str(files[2])


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ("cert_file", ("cert_file", "key_file")),
        ("key_file", ("cert_file",)),
        ("client_ca_file", ("client_ca_file", "cert_file")),
    ],
)
def test_a_tls_file_without_its_partner_is_an_error(
    tmp_path: Path, pem_files: tuple[str, str, str], given: str, named: tuple[str, ...]
) -> None:
    cert, key, ca = pem_files
    value = {"cert_file": cert, "key_file": key, "client_ca_file": ca}[given]
    message = config_error(write(tmp_path, f"interval: 5s\ntls:\n  {given}: {value}\n"))
    assert "config.yaml" in message
    assert all(name in message for name in named), message


def test_tls_complete_is_accepted(pem_files: tuple[str, str, str]) -> None:
    cert, key, ca = pem_files
    flags = {"tls.cert_file": cert, "tls.key_file": key, "tls.client_ca_file": ca}
    config = agent_config(None, flags, environ={})
    assert (config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file) == (
        cert,
        key,
        ca,
    )


def test_tls_cert_without_key_names_the_line(
    tmp_path: Path, pem_files: tuple[str, str, str]
) -> None:
    cert, _, _ = pem_files
    path = write(tmp_path, f"interval: 5s\ntls:\n  cert_file: {cert}\n")
    message = config_error(path)
    assert re.search(r"config\.yaml:[23]:", message), message


def test_tls_cert_flag_without_key_names_the_flag(
    tmp_path: Path, pem_files: tuple[str, str, str]
) -> None:
    cert, _, _ = pem_files
    path = write(tmp_path, "interval: 5s\n")
    message = config_error(path, flags={"tls.cert_file": cert})
    assert "--tls-cert-file" in message or "--tls-key-file" in message, message


# -- errors from the environment and flags ---------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("GPU_EXPORTER_INTERVAL", "abc"),
        ("GPU_EXPORTER_DEADLINE", "-1s"),
        ("GPU_EXPORTER_LISTEN", "nope"),
        ("GPU_EXPORTER_LISTEN", ""),
        ("GPU_EXPORTER_LOG_LEVEL", "loud"),
        ("GPU_EXPORTER_HISTORY", "0"),
        ("GPU_EXPORTER_SIMULATE", "/nonexistent/scenario.yaml"),
        ("GPU_EXPORTER_PATHS_PROC", "/nonexistent/proc"),
        ("GPU_EXPORTER_TLS_CERT_FILE", "/nonexistent/cert.pem"),
    ],
)
def test_env_errors_name_the_variable(variable: str, value: str) -> None:
    message = config_error(None, environ={variable: value})
    assert f"environment variable {variable}" in message


def test_env_error_beats_a_good_file(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: 5s\n")
    message = config_error(path, environ={"GPU_EXPORTER_INTERVAL": "5x"})
    assert "GPU_EXPORTER_INTERVAL" in message
    assert "5x" in message


@pytest.mark.parametrize(
    ("key", "flag", "value", "needle"),
    [
        ("interval", "--interval", "abc", "abc"),
        ("deadline", "--deadline", "0", "at least"),
        ("listen", "--listen", "1.2.3.4:99999", "99999"),
        ("listen", "--listen", "nope", "nope"),
        ("log_level", "--log-level", "loud", "loud"),
        ("history", "--history", "lots", "lots"),
        ("simulate", "--simulate", "/nonexistent/scenario.yaml", "/nonexistent/scenario.yaml"),
        ("paths.proc", "--proc", "/nonexistent/proc", "/nonexistent/proc"),
        ("tls.key_file", "--tls-key-file", "/nonexistent/key.pem", "/nonexistent/key.pem"),
    ],
)
def test_flag_errors_name_the_flag(key: str, flag: str, value: str, needle: str) -> None:
    message = config_error(None, flags={key: value})
    assert message.startswith(f"flag {flag}: "), message
    assert needle in message


# -- listen -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host", "port", "shown"),
    [
        (":9402", "", 9402, ":9402"),
        ("[::1]:9402", "::1", 9402, "[::1]:9402"),
        ("[::]:80", "::", 80, "[::]:80"),
        ("127.0.0.1:1", "127.0.0.1", 1, "127.0.0.1:1"),
        ("0.0.0.0:65535", "0.0.0.0", 65535, "0.0.0.0:65535"),
        ("localhost:9402", "localhost", 9402, "localhost:9402"),
        ("  127.0.0.1:8080  ", "127.0.0.1", 8080, "127.0.0.1:8080"),
    ],
)
def test_parse_listen(text: str, host: str, port: int, shown: str) -> None:
    listen = parse_listen(text)
    assert listen == Listen(host, port)
    assert str(listen) == shown


@pytest.mark.parametrize(
    "text",
    [
        "nope",
        "9402",
        "127.0.0.1",
        "127.0.0.1:",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "127.0.0.1:70000",
        "127.0.0.1:-1",
        "127.0.0.1:http",
        "::1:9402",
        "::1",
        "my host:9402",
        "",
    ],
)
def test_parse_listen_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_listen(text)


def test_listen_from_file_forms(tmp_path: Path) -> None:
    for text, expected in [
        ("listen: ':9402'\n", Listen("", 9402)),
        ("listen: '[::1]:9402'\n", Listen("::1", 9402)),
        ("listen: 127.0.0.1:1\n", Listen("127.0.0.1", 1)),
    ]:
        path = write(tmp_path, text)
        assert agent_config(path, {}, environ={}).listen == expected


def test_config_error_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: [1, 2]\n")
    message = config_error(path)
    assert "\n" not in message
    assert os.path.basename(path) in message


def test_huge_integer_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "history: 5\ninterval: " + "1" * 400 + "\n")
    message = config_error(path)
    assert "config.yaml:2: interval:" in message
    assert "is longer than the maximum 1h" in message
    assert len(message) < len(path) + 100  # the value is cut short


def test_huge_integer_in_a_flag_is_a_config_error() -> None:
    message = config_error(None, flags={"interval": 10**400})
    assert message.startswith("flag --interval: ")


# -- upper bounds of durations and sizes ----------------------------------------------------------

HUGE_DURATION = "99999999999999999999999999999d"
HUGE_SIZE = "99999999999999999999999999999PiB"
#: Every duration and size key of the config file, with its maximum as the message says it.
DURATION_KEYS = {
    "interval": "1h",
    "deadline": "1h",
    "actions.zombie_reaper.every": "366d",
    "actions.zombie_reaper.min_age": "366d",
    "actions.zombie_reaper.grace_period": "366d",
    "actions.zombie_reaper.kill_timeout": "366d",
    "actions.thermal.every": "366d",
    "actions.thermal.for": "366d",
    "actions.health.every": "366d",
    "actions.health.xid_window": "366d",
    "actions.health.error_window": "366d",
    "actions.health.rate_window": "366d",
    "actions.health.clocks_window": "366d",
    "actions.recommend.every": "366d",
    "actions.waste.every": "366d",
    "actions.waste.for": "366d",
    "web.head_timeout": "5m",
    "web.keepalive_timeout": "1h",
    "web.write_timeout": "10m",
    "peer_timeout": "30s",
}
SIZE_KEYS = {
    "actions.zombie_reaper.leaked_min_memory": "1PiB",
    "actions.recommend.policies.default.min_free_memory": "1PiB",
    "actions.waste.min_memory": "1PiB",
    "actions.waste.orphaned_min_memory": "1PiB",
    "actions.waste.leak.min_growth": "1PiB",
}
EXAMPLE = Path(__file__).resolve().parent.parent / "config.example.yaml"


def nested(key: str, value: str) -> str:
    """YAML setting the dotted ``key`` to ``value``, one level per line."""
    *sections, name = key.split(".")
    lines = [f"{'  ' * depth}{section}:" for depth, section in enumerate(sections)]
    return "\n".join([*lines, f"{'  ' * len(sections)}{name}: {value}"]) + "\n"


def test_every_duration_and_size_key_of_the_example_is_covered() -> None:
    """A key added to config.example.yaml with a duration or a size joins the lists above."""
    value = re.compile(r"^[\s#]*(\w+): (\d+(?:ms|s|m|h|d)|\d+[KMGTP]i?B)\s*(#.*)?$")
    found = {m.group(1) for line in EXAMPLE.read_text().splitlines() if (m := value.match(line))}
    known = {key.rpartition(".")[2] for key in (*DURATION_KEYS, *SIZE_KEYS)}
    assert found == known


@pytest.mark.parametrize(("key", "maximum"), list(DURATION_KEYS.items()))
def test_every_duration_key_has_a_maximum(tmp_path: Path, key: str, maximum: str) -> None:
    path = write(tmp_path, "history: 5\n" + nested(key, HUGE_DURATION))
    message = config_error(path)
    line = len(key.split(".")) + 1
    assert message == (
        f"{path}:{line}: {key}: {HUGE_DURATION} is longer than the maximum {maximum}"
    )
    assert agent_config(write(tmp_path, nested(key, maximum), "max.yaml"), {}, environ={})


@pytest.mark.parametrize(("key", "maximum"), list(SIZE_KEYS.items()))
def test_every_size_key_has_a_maximum(tmp_path: Path, key: str, maximum: str) -> None:
    path = write(tmp_path, nested(key, HUGE_SIZE))
    message = config_error(path)
    line = len(key.split("."))
    assert message == f"{path}:{line}: {key}: {HUGE_SIZE} is larger than the maximum {maximum}"
    assert agent_config(write(tmp_path, nested(key, maximum), "max.yaml"), {}, environ={})


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        *((key, value, "finite") for key in DURATION_KEYS for value in (".nan", ".inf")),
        *((key, value, "finite") for key in SIZE_KEYS for value in (".nan", ".inf")),
        ("interval", "nan", "finite"),
        ("actions.thermal.for", "inf", "finite"),
        ("interval", "61m", "61m is longer than the maximum 1h"),
        ("deadline", "3601", "3601 is longer than the maximum 1h"),
        ("actions.thermal.every", "367d", "367d is longer than the maximum 366d"),
        ("actions.zombie_reaper.min_age", 10**400, "is longer than the maximum 366d"),
    ],
)
def test_non_finite_and_too_long_values(
    tmp_path: Path, key: str, value: object, needle: str
) -> None:
    path = write(tmp_path, nested(key, str(value)))
    message = config_error(path)
    assert message.startswith(f"{path}:{len(key.split('.'))}: {key}: "), message
    assert needle in message


@pytest.mark.parametrize(
    ("key", "flag", "value", "maximum"),
    [
        ("interval", "--interval", HUGE_DURATION, "1h"),
        ("interval", "--interval", "1e999", "1h"),
        ("deadline", "--deadline", "2h", "1h"),
        ("deadline", "--deadline", 10**400, "1h"),
    ],
)
def test_too_long_flags_and_variables(key: str, flag: str, value: object, maximum: str) -> None:
    why = f"is longer than the maximum {maximum}"
    assert config_error(None, flags={key: value}).startswith(f"flag {flag}: ")
    assert why in config_error(None, flags={key: value})
    variable = "GPU_EXPORTER_" + key.upper()
    message = config_error(None, environ={variable: str(value)})
    assert message.startswith(f"environment variable {variable}: "), message
    assert why in message


@pytest.mark.parametrize(("value", "ok"), [("1h", True), ("3600", True), ("3600.5", False)])
def test_interval_maximum_is_one_hour(value: str, ok: bool) -> None:
    if ok:
        config = agent_config(None, {"interval": value, "deadline": value}, environ={})
        assert config.interval == config.deadline == 3600
    else:
        assert "longer than the maximum 1h" in config_error(None, flags={"interval": value})


@pytest.mark.parametrize(
    ("scenario", "key", "why"),
    [
        ("driver:\n  call_latency: 367d\n", "driver.call_latency", "longer than the maximum 366d"),
        ("gpus:\n  - memory_total: 2PiB\n", "gpus[0].memory_total", "larger than the maximum 1PiB"),
        ("gpus:\n  - present: {from: 1e999}\n", "gpus[0].present.from", "longer than the maximum"),
        ("gpus:\n  - memory_used: .inf\n", "gpus[0].memory_used", "finite"),
    ],
)
def test_scenario_durations_and_sizes_have_a_maximum(
    tmp_path: Path, scenario: str, key: str, why: str
) -> None:
    scenario_path = write(tmp_path, scenario, "scenario.yaml")
    path = write(tmp_path, f"simulate: {scenario_path}\n")
    message = config_error(path)
    assert message.startswith(f"{path}:1: simulate: {scenario_path}:"), message
    assert f": {key}: " in message and why in message, message


# -- what a config file may be ---------------------------------------------------------------------


def load_in_time(path: str, fifo: Path, timeout: float = 10) -> str:
    """The ConfigError message of loading ``path``, failing (not hanging) if loading blocks on
    reading ``fifo``."""
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            agent_config(path, {}, environ={})
            outcome.append(None)
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():  # release the blocked reader
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome, f"loading {path} blocked"
    assert isinstance(outcome[0], ConfigError), outcome
    return str(outcome[0])


def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    assert load_in_time(str(fifo), fifo) == f"{fifo}: is not a regular file (a FIFO)"


def test_a_link_to_a_fifo_is_refused_and_a_link_to_a_file_is_followed(tmp_path: Path) -> None:
    fifo, link = tmp_path / "fifo", tmp_path / "config.yaml"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    assert load_in_time(str(link), fifo) == f"{link}: is not a regular file (a FIFO)"
    link.unlink()
    link.symlink_to(write(tmp_path, "interval: 2s\n", "real.yaml"))
    assert agent_config(str(link), {}, environ={}).interval == 2.0


def test_a_device_is_refused() -> None:
    # /dev/zero too, in test_fuzz.py, as a real command whose memory is limited
    assert config_error("/dev/null") == "/dev/null: is not a regular file (a character device)"


def test_a_directory_is_refused_as_such(tmp_path: Path) -> None:
    assert config_error(str(tmp_path)) == f"{tmp_path}: is not a regular file (a directory)"


@pytest.mark.parametrize("size", [2 * 1024 * 1024, 1024 * 1024 + 1])
def test_a_file_over_one_mib_is_refused(tmp_path: Path, size: int) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"# " + b"x" * (size - 3) + b"\n")
    assert config_error(str(path)) == f"{path}: is larger than 1 MiB"


def test_a_file_of_one_mib_is_read(tmp_path: Path) -> None:
    path = tmp_path / "full.yaml"
    head = b"interval: 3s\n"
    path.write_bytes(head + b"#" * (1024 * 1024 - len(head) - 1) + b"\n")
    assert agent_config(str(path), {}, environ={}).interval == 3.0


def test_a_scenario_fifo_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "scenario.yaml"
    os.mkfifo(fifo)
    path = write(tmp_path, f"simulate: {fifo}\n")
    message = load_in_time(path, fifo)
    assert message == f"{path}:1: simulate: {fifo}: is not a regular file (a FIFO)"


def test_each_setting_is_declared_once_and_fills_one_attribute():
    """A setting is one declaration: its Config (or WebSettings) attribute, flag, variable,
    reloadability; nothing else lists the settings."""
    from exporter.config.settings import SETTINGS, WEB_SETTINGS, Config, WebSettings

    config_fields = {f.name for f in dataclasses.fields(Config)} - {"actions", "web"}
    plain = [s.field for s in SETTINGS if s not in WEB_SETTINGS]
    assert sorted(plain) == sorted(config_fields)
    assert sorted(s.field for s in WEB_SETTINGS) == sorted(
        f.name for f in dataclasses.fields(WebSettings)
    )
    for attr in ("key", "flag", "env"):
        values = [getattr(s, attr) for s in SETTINGS]
        assert len(values) == len(set(values)), attr
