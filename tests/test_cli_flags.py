"""Every flag of every subcommand with bad values: exit 2, a message naming the flag, no traceback.

The flags are read from the argparse parsers, so a flag added later fails
``test_every_flag_has_bad_values`` until it gets bad values in ``BAD`` (or a reason in
``NO_BAD_VALUE``). The cases run ``main(argv)`` in this process; a handful run the real command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import exporter.cli
import exporter.launcher.cli
from exporter.cli import build_parser, main
from tests.agent import clean_env, exporter_cli

#: Bad values of each flag, the same in every subcommand that has it. Placeholders: {missing} a
#: path that does not exist, {dir} a directory, {file} a file, {garbage} a file of junk bytes,
#: {bad_config} a config with an unknown key, {bad_scenario} a scenario with one, {big} a file
#: over 1 MiB, {long_every} a config with an ``every`` past its maximum. (A FIFO and /dev/zero,
#: which would hang or fill this process if they were read, are tested as real commands in
#: test_fuzz.py.)
BAD: dict[str, list[str]] = {
    "--config": [
        "{missing}",
        "{dir}",
        "{garbage}",
        "{bad_config}",
        "{big}",
        "{long_every}",
    ],
    "--listen": [
        "nonsense",
        "127.0.0.1:70000",
        "127.0.0.1:0",
        "127.0.0.1:-1",
        "127.0.0.1:http",
        "::1:9402",
        "my host:9402",
        "",
    ],
    "--interval": [
        "5 parsecs",
        "-1s",
        "0",
        "5ms",
        "nan",
        "inf",
        "1e999",
        "9" * 400,
        "",
        "61m",
        "99999999999999999999999999999d",
    ],
    "--deadline": ["5 parsecs", "-1s", "0", "nan", "soon", "inf", "2h", "9" * 400 + "d"],
    "--log-level": ["loud", "", "INFO2"],
    "--simulate": [
        "{missing}",
        "{dir}",
        "{garbage}",
        "{bad_scenario}",
        "{big}",
    ],
    "--proc": ["{missing}", "{file}", ""],
    "--lock-dir": ["{missing}", "{file}", ""],
    "--state-file": ["{dir}"],
    "--exclude-unhealthy": ["maybe", "critical!"],
    "--gpu": ["", ",,", "GPU 0", "0;1"],
    "--timeout": ["0", "-1s", "soon", "", "nan"],
    "--watch": ["0", "0s", "-1s", "soon", "nan", "1e999"],
    "--dev": ["{missing}", "{file}", ""],
    "--slurm-job-dir": ["relative/jobs", "jobs"],
    "--prometheus": ["nonsense", "ftp://localhost/", ""],
    "--selector": ["cluster=a", ""],
    "--kubelet-socket": ["relative/kubelet.sock", "kubelet.sock"],
    "--kubelet.resources": ["nvidia.com", "a b/c", "/gpu", "x/y/z", ",,example.com/*x"],
    "--tls-cert-file": ["{missing}", "{dir}"],
    "--tls-key-file": ["{missing}", "{dir}"],
    "--tls-client-ca-file": ["{missing}", "{dir}"],
    "--history": ["0", "-1", "100001", "lots", "1.5", "", "9" * 400],
    "--peers": [
        "ftp://h:1",
        "h:9402",
        "http://",
        "http://u:p@h:1",
        "http://h:1/?q=1",
        "http://h:99999",
        "http://a:1,http://a:1",
        ",".join(f"http://h{i}:1" for i in range(65)),
    ],
    "--peer-timeout": ["0s", "50ms", "31s", "-1s", "soon", ""],
    "--web.config.file": ["{missing}", "{dir}", "{garbage}", "{bad_config}", "{big}"],
    "--web.healthz-without-auth": ["maybe", "", "2"],
    "--web.max-connections": ["0", "-1", "65537", "lots", "1.5", "", "9" * 400],
    "--web.head-timeout": ["5 parsecs", "-1s", "0", "50ms", "nan", "inf", "6m", ""],
    "--web.keepalive-timeout": ["5 parsecs", "-1s", "nan", "inf", "2h", ""],
    "--web.write-timeout": ["5 parsecs", "0", "500ms", "nan", "11m", ""],
    "--web.max-head-bytes": ["1023", "1048577", "64KiB", "-1", "", "lots"],
    "--expose-cmdline": ["maybe", "", "2"],
    "--count": ["0", "-1", "65", "abc", "1.5", "", "9" * 400],
    "--policy": ["nope", ""],
    "--min-free-memory": ["lots", "-1GiB", "8 parsecs", "8GiBs", "", "1" * 400, "2PiB", "nan"],
    "--max-utilization": ["1.5", "-0.1", "nan", "inf", "abc", ""],
    "--max-temperature": ["500", "-100", "hot", "inf", ""],
    "--strategy": ["random", "", "MOST_FREE_MEMORY"],
    "--format": ["xml", ""],
    "--from": ["nonsense", "ftp://localhost/", ""],
    "--wait": ["5 parsecs", "-1s", "nan", "", "inf", "367d", "99999999999999999999999999999d"],
    "--restart": ["sometimes", "", "NEVER"],
    "--max-restarts": ["-1", "many", "1.5", "", "\u00b2"],
    "--restart-reset": ["soon", "-1s", "0", "nan", "", "inf", "367d"],
}
#: Flags that take no value, or whose every value is fine.
NO_BAD_VALUE = {
    "--help": "prints help",
    "--version": "prints the version",
    "--json": "a switch without a value",
    "--exclusive": "a switch without a value",
    "--mig": "a switch without a value",
    "--spread": "a switch without a value",
    "--strict": "a switch without a value",
}
#: Where the message names the file the user gave instead of the flag.
NAMES_THE_FILE = {"--config", "--web.config.file"}
#: Arguments each subcommand needs besides the flag under test.
TAIL = {"run": ["--", "true"]}


def _options() -> dict[str, dict[str, argparse.Action]]:
    """Every option of the top-level parser ("") and of each subcommand, by its long name."""
    parser = build_parser()
    return {"": parser.options} | {name: sub.options for name, sub in parser.commands.items()}


OPTIONS = _options()
#: Of ``actions:``, status reads nothing and recommend and run only the recommendation policies
#: (they load no action code); serve and check-config check all of it.
ACTIONS_ONLY = {"{long_every}"}
CASES = [
    (command, flag, value)
    for command, options in OPTIONS.items()
    for flag in options
    for value in BAD.get(flag, [])
    if command == "serve" or value not in ACTIONS_ONLY
]
#: Options that need a value: leaving it out is an argparse error naming the flag.
VALUED = [
    (command, flag)
    for command, options in OPTIONS.items()
    for flag, action in options.items()
    if action.nargs is None
]


class Accepted(Exception):
    """The command got past validation: the bad value was taken."""


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"\x00\xff\xfe not a certificate, not YAML: [\x07\n")
    bad_config = tmp_path / "bad-config.yaml"
    bad_config.write_text("interval: 1s\nintervall: 2s\n")
    bad_scenario = tmp_path / "bad-scenario.yaml"
    bad_scenario.write_text("gpus:\n  - temprature: 50\n")
    afile = tmp_path / "file"
    afile.write_text("")
    (tmp_path / "big.yaml").write_bytes(b"#" * (2 * 1024 * 1024) + b"\n")
    long_every = tmp_path / "long-every.yaml"
    long_every.write_text("actions:\n  thermal:\n    every: 99999999999999999999999999999d\n")
    return {
        "big": str(tmp_path / "big.yaml"),
        "long_every": str(long_every),
        "missing": str(tmp_path / "missing"),
        "dir": str(tmp_path),
        "file": str(afile),
        "garbage": str(garbage),
        "bad_config": str(bad_config),
        "bad_scenario": str(bad_scenario),
    }


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A clean environment, and every step after validation raises Accepted instead of sampling,
    serving, locking GPUs or calling an agent."""
    for name in list(os.environ):
        if name.startswith("GPU_EXPORTER_"):
            monkeypatch.delenv(name)

    def accepted(*_: Any, **__: Any) -> Any:
        raise Accepted

    def setup_logging(level: str) -> None:
        if level != "critical":  # serve, once its config is valid
            raise Accepted

    monkeypatch.setattr(exporter.cli, "_setup_logging", setup_logging)
    monkeypatch.setattr(exporter.cli, "_simulation", accepted)
    monkeypatch.setattr(exporter.launcher.cli, "LocalGpus", accepted)
    monkeypatch.setattr(urllib.request, "urlopen", accepted)
    yield


def invoke(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``main(argv)`` in this process."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Accepted:
        code = None  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert code is not None, f"{argv} was accepted"
    return code, out, err


def test_every_flag_has_bad_values() -> None:
    flags = {flag for options in OPTIONS.values() for flag in options}
    assert sorted(flags - BAD.keys() - NO_BAD_VALUE.keys()) == [], "flags without bad values"
    assert sorted((BAD.keys() | NO_BAD_VALUE.keys()) - flags) == [], "entries for no flag"
    assert len(CASES) > 150  # every subcommand's flags, not only the first parser's


@pytest.mark.usefixtures("guarded")
@pytest.mark.parametrize(("command", "flag", "value"), CASES, ids=lambda v: repr(v)[:40])
def test_bad_value(
    command: str,
    flag: str,
    value: str,
    paths: dict[str, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    value = value.format(**paths)
    code, out, err = invoke([command, f"{flag}={value}", *TAIL.get(command, [])], capsys)
    assert "Traceback" not in err
    assert code == 2, (code, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 or lines[0].startswith("usage:"), err  # one line, or argparse's
    needle = value if flag in NAMES_THE_FILE else flag
    assert needle in lines[-1], (needle, err)


@pytest.mark.usefixtures("guarded")
@pytest.mark.parametrize(("command", "flag"), VALUED)
def test_missing_value(command: str, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = invoke([command, flag], capsys)
    assert code == 2, (code, err)
    assert f"argument {flag}: expected one argument" in err


@pytest.mark.usefixtures("guarded")
@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--tls-cert-file={garbage}", "--tls-key-file={garbage}"],
        ["serve", "--tls-cert-file={file}", "--tls-key-file={file}"],
        ["serve", "--tls-cert-file={file}"],
        ["serve", "--tls-key-file={file}"],
        ["serve", "--tls-client-ca-file={file}"],
    ],
    ids=["garbage pem", "empty pem", "cert without key", "key without cert", "ca without cert"],
)
def test_bad_tls_files(argv: list[str], paths: dict[str, str], capsys: pytest.CaptureFixture[str]):
    code, _, err = invoke([arg.format(**paths) for arg in argv], capsys)
    assert code == 2, (code, err)
    assert "--tls-" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.usefixtures("guarded")
@pytest.mark.parametrize("name", ["missing", "dir", "garbage", "bad_config", "big"])
def test_check_config_bad_file(
    name: str, paths: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = invoke(["check-config", paths[name]], capsys)
    assert (code, out) == (2, ""), err
    assert paths[name] in err and len(err.strip().splitlines()) == 1, err


def test_check_config_rejects_bad_tls_material(tmp_path: Path, paths: dict[str, str]) -> None:
    config = tmp_path / "tls.yaml"
    config.write_text(f"tls:\n  cert_file: {paths['garbage']}\n  key_file: {paths['garbage']}\n")
    with pytest.raises(exporter.cli.ConfigError, match=r"tls\.cert_file.*cannot load"):
        exporter.cli.cmd_check_config(argparse.Namespace(file=str(config)))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    from tests.test_tls import _make_pki

    return _make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.usefixtures("guarded")
def test_good_tls_files_pass_and_a_mismatched_key_does_not(
    pki: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    good = ["--tls-cert-file", pki["server.pem"], "--tls-key-file", pki["server.key"]]
    with pytest.raises(Accepted):  # past the TLS check, on to serving
        main(["serve", *good, "--tls-client-ca-file", pki["ca.pem"]])
    mismatched = ["--tls-cert-file", pki["server.pem"], "--tls-key-file", pki["client.key"]]
    code, _, err = invoke(["serve", *mismatched], capsys)
    assert code == 2 and "--tls-cert-file" in err and pki["client.key"] in err, err
    code, _, err = invoke(["serve", *good, "--tls-client-ca-file", pki["server.key"]], capsys)
    assert code == 2 and "--tls-client-ca-file" in err, err


@pytest.mark.usefixtures("guarded")
@pytest.mark.parametrize(
    "argv",
    [["run"], ["run", "--"], ["run", "--simulate", "--"]],
    ids=["no command", "only --", "flags and no command"],
)
def test_run_without_a_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = invoke(argv, capsys)
    assert code == 2 and "no command to run" in err, err


@pytest.mark.usefixtures("guarded")
def test_the_guard_catches_an_accepted_value(capsys: pytest.CaptureFixture[str]) -> None:
    """Without this, a bad value taken as good would pass as long as something failed later."""
    for argv in (["serve", "--simulate"], ["status", "--simulate"], ["recommend", "--simulate"]):
        with pytest.raises(AssertionError, match="was accepted"):
            invoke(argv, capsys)


# -- the real command, a few cases ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--interval", "5 parsecs"],
        ["serve", "--listen", "127.0.0.1:70000"],
        ["serve", "--tls-cert-file", "{garbage}", "--tls-key-file", "{garbage}"],
        ["status", "--simulate", "{bad_scenario}"],
        ["recommend", "--simulate", "--count", "0"],
        ["run", "--simulate", "--wait", "5 parsecs", "--", "true"],
        ["serve", "--interval", "99999999999999999999999999999d"],
        ["serve", "--deadline", "1e999"],
        ["run", "--simulate", "--wait", "99999999999999999999999999999d", "--", "true"],
        ["recommend", "--simulate", "--min-free-memory", "99999999999999999999999999999PiB"],
    ],
    ids=lambda argv: " ".join(argv[:3]),
)
def test_real_command(argv: list[str], paths: dict[str, str]) -> None:
    argv = [arg.format(**paths) for arg in argv]
    flag = next(arg for arg in reversed(argv) if arg.startswith("--") and arg != "--")
    result = exporter_cli(*argv)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert flag in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("variable", "value", "maximum"),
    [
        ("GPU_EXPORTER_INTERVAL", "99999999999999999999999999999d", "1h"),
        ("GPU_EXPORTER_DEADLINE", "1e999", "1h"),
    ],
)
def test_real_command_too_long_variable(variable: str, value: str, maximum: str) -> None:
    result = exporter_cli("serve", "--simulate", env=clean_env(**{variable: value}))
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr == (
        f"gpu-exporter: environment variable {variable}: {value} is longer than the maximum "
        f"{maximum}\n"
    )


@pytest.mark.parametrize("command", ["recommend", "run"])
def test_the_launcher_checks_the_policies_it_reads(tmp_path, command):
    config = tmp_path / "config.yaml"
    config.write_text("actions:\n  recommend:\n    policies:\n      big: {count: 0}\n")
    extra = ["--", "true"] if command == "run" else []
    done = exporter_cli(command, "--simulate", "--config", str(config), *extra)
    assert done.returncode == 2, done.stderr
    assert f"{config}:4: actions.recommend.policies.big.count" in done.stderr
    assert "Traceback" not in done.stderr
