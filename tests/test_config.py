"""Settings: defaults, YAML file, environment variables, flags, and where each error points."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from exporter.config import Listen, load_config, parse_listen
from exporter.yamlconf import ConfigError
from tests.helpers import line_of, write


def config_error(path: str | None, flags: dict | None = None, environ: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, flags or {}, environ=environ or {})
    return str(info.value)


# -- defaults and the file ------------------------------------------------------------------------


def test_defaults() -> None:
    config = load_config(None, {}, environ={})
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
    config = load_config(None, {}, environ={"GPU_EXPORTER": "x", "INTERVAL": "1s", "PATH": "/"})
    assert config.interval == 5.0


def test_process_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_EXPORTER_INTERVAL", "7s")
    assert load_config(None, {}).interval == 7.0


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
    config = load_config(path, {}, environ={})
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
    assert load_config(write(tmp_path, "interval: 2s\n"), {}, environ={}).deadline == 2.0
    auto = write(tmp_path, "interval: 2s\ndeadline: auto\n", "auto.yaml")
    assert load_config(auto, {}, environ={}).deadline == 2.0
    assert load_config(None, {"interval": "3s"}, environ={}).deadline == 3.0


def test_simulate_scenario_file(tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("gpus: []\n")
    path = write(tmp_path, f"simulate: {scenario}\n")
    assert load_config(path, {}, environ={}).simulate == str(scenario)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", "builtin"), ("yes", "builtin"), ("false", None), ("off", None), ("''", None)],
)
def test_simulate_booleans(tmp_path: Path, value: str, expected: str | None) -> None:
    path = write(tmp_path, f"simulate: {value}\n")
    assert load_config(path, {}, environ={}).simulate == expected


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file_is_defaults(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert load_config(str(path), {}, environ={}) == load_config(None, {}, environ={})


def test_empty_sections_are_fine(tmp_path: Path) -> None:
    path = write(tmp_path, "paths:\ntls: {}\n")
    assert load_config(path, {}, environ={}).proc_root == "/proc"


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

    only_file = load_config(path, {}, environ={})
    assert (only_file.listen.port, only_file.interval, only_file.proc_root) == (
        1001,
        2.0,
        str(file_proc),
    )
    assert only_file.log_level == "warning"
    assert only_file.history == 120  # default: the file does not set it

    with_env = load_config(path, {}, environ=environ)
    assert (with_env.listen.port, with_env.interval, with_env.proc_root) == (
        1002,
        3.0,
        str(env_proc),
    )
    assert with_env.history == 55
    assert with_env.log_level == "warning"  # the file still counts where env is silent

    with_flags = load_config(path, flags, environ=environ)
    assert (with_flags.listen.port, with_flags.interval, with_flags.proc_root) == (
        1003,
        4.0,
        str(flag_proc),
    )
    assert with_flags.history == 55  # env where no flag is given
    assert with_flags.log_level == "warning"


def test_none_flags_do_not_override(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: 2s\n")
    config = load_config(path, {"interval": None, "listen": None}, environ={})
    assert config.interval == 2.0


def test_env_overrides_default_without_file() -> None:
    config = load_config(None, {}, environ={"GPU_EXPORTER_LOG_LEVEL": "ERROR"})
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
        load_config(path, {}, environ={})
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


def test_tls_cert_without_key(tmp_path: Path, pem_files: tuple[str, str, str]) -> None:
    cert, _, _ = pem_files
    path = write(tmp_path, f"interval: 5s\ntls:\n  cert_file: {cert}\n")
    message = config_error(path)
    assert "config.yaml" in message
    assert "cert_file" in message
    assert "key_file" in message


def test_tls_key_without_cert(tmp_path: Path, pem_files: tuple[str, str, str]) -> None:
    _, key, _ = pem_files
    path = write(tmp_path, f"tls:\n  key_file: {key}\n")
    message = config_error(path)
    assert "config.yaml" in message
    assert "cert_file" in message


def test_tls_client_ca_without_cert(tmp_path: Path, pem_files: tuple[str, str, str]) -> None:
    _, _, ca = pem_files
    path = write(tmp_path, f"tls:\n  client_ca_file: {ca}\n")
    message = config_error(path)
    assert "config.yaml" in message
    assert "client_ca_file" in message
    assert "cert_file" in message


def test_tls_complete_is_accepted(pem_files: tuple[str, str, str]) -> None:
    cert, key, ca = pem_files
    flags = {"tls.cert_file": cert, "tls.key_file": key, "tls.client_ca_file": ca}
    config = load_config(None, flags, environ={})
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
        assert load_config(path, {}, environ={}).listen == expected


def test_config_error_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "interval: [1, 2]\n")
    message = config_error(path)
    assert "\n" not in message
    assert os.path.basename(path) in message


def test_huge_integer_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "history: 5\ninterval: " + "1" * 400 + "\n")
    message = config_error(path)
    assert "config.yaml:2: interval:" in message
    assert "too large" in message


def test_huge_integer_in_a_flag_is_a_config_error() -> None:
    message = config_error(None, flags={"interval": 10**400})
    assert message.startswith("flag --interval: ")
