"""Hostile config and scenario files: every one is a valid config or a ConfigError (exit 2) with a
one-line message naming the file; nothing else raises, nothing hangs, nothing is half applied.

Hypothesis drives the parsers the CLI uses (``load_config`` for ``--config`` and ``check-config``,
``load_scenario`` for ``--simulate FILE``) with arbitrary bytes and with documents built from the
real schema whose values are replaced by wrong types, out-of-range, huge and non-finite numbers,
unknown keys, YAML tags, aliases, duplicate keys, control characters and other encodings. A few
files then go through the real command, and a file that is valid in its first half and bad in
its second is sent to a running agent with SIGHUP.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import math
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.config.settings import (
    LOG_LEVELS,
    MAX_INTERVAL,
    MIN_INTERVAL,
    SETTINGS,
    Config,
)
from exporter.config.yamlconf import ConfigError
from exporter.config.yamlparse import MAX_DEPTH
from exporter.core.units import MAX_DURATION, MAX_SIZE
from exporter.simulate.driver import FIELD_FUNCTIONS, load_scenario
from tests.agent import exporter_cli as _run
from tests.agent import free_port, healthz_until, http_get, serve, stderr_of
from tests.helpers import agent_config, one, samples

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI is deterministic
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- what is checked ------------------------------------------------------------------------------


def _finite(value: Any, where: str = "") -> None:
    """Every float anywhere inside a parsed config or scenario is finite."""
    if isinstance(value, float):
        assert math.isfinite(value), where
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _finite(getattr(value, f.name), f"{where}.{f.name}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _finite(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple, frozenset, set)):
        for item in value:
            _finite(item, where)


def _valid_config(config: Config) -> None:
    assert 1 <= config.listen.port <= 65535
    assert MIN_INTERVAL <= config.interval <= MAX_INTERVAL
    assert MIN_INTERVAL <= config.deadline <= MAX_INTERVAL
    _bounded(config)
    assert config.log_level in LOG_LEVELS
    assert 1 <= config.history <= 100_000
    for name, action in config.actions.actions.items():
        assert isinstance(action.enabled, bool), name
        assert action.cron is not None or (action.every is not None and action.every > 0), name
    for policy in config.actions.actions["recommend"].options.policies.values():
        assert 1 <= policy.count <= 64 and policy.window >= 1
        assert policy.min_free_memory is None or policy.min_free_memory >= 0
        assert policy.max_utilization is None or 0 <= policy.max_utilization <= 1
    _finite(config)


def _bounded(config: Config) -> None:
    """Every duration and size of the actions is within the validators' maximum."""
    actions = config.actions.actions
    reaper, thermal = actions["zombie_reaper"].options, actions["thermal"].options
    durations = [a.every for a in actions.values() if a.every is not None]
    durations += [reaper.min_age, reaper.grace_period, reaper.kill_timeout, thermal.for_seconds]
    assert all(0 <= seconds <= MAX_DURATION for seconds in durations), durations
    sizes = [reaper.leaked_min_memory]
    sizes += [p.min_free_memory or 0 for p in actions["recommend"].options.policies.values()]
    assert all(0 <= size <= MAX_SIZE for size in sizes), sizes


def _error_is_clear(exc: ConfigError, path: str) -> None:
    message = str(exc)
    assert message.strip(), "an empty message"
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith(path), message  # names the file (with its line where known)
    assert len(message) < 2000, message[:200]


def check_config(path: str) -> Config | None:
    """What ``check-config`` and ``--config`` do with ``path``: a valid Config or None after a
    clear ConfigError; any other exception fails the test."""
    try:
        config = agent_config(path, {}, environ={})
    except ConfigError as exc:
        _error_is_clear(exc, path)
        return None
    _valid_config(config)
    return config


def check_scenario(path: str) -> None:
    """What ``--simulate FILE`` parses: a finite Scenario or a clear ConfigError."""
    try:
        scenario = load_scenario(path)
    except ConfigError as exc:
        _error_is_clear(exc, path)
        return
    assert all(gpu.memory_reserved < gpu.memory_total for gpu in scenario.gpus)
    _finite(scenario)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file each example is written to (one per module: hypothesis reuses it)."""
    return tmp_path_factory.mktemp("fuzz") / "fuzzed.yaml"


# -- values -------------------------------------------------------------------------------------

WORDS = [
    "",
    " ",
    "-5s",
    "5 parsecs",
    "1e999",
    "nan",
    ".nan",
    "inf",
    "-inf",
    "-1",
    "0",
    "1h-5m",
    "9" * 400,
    "8GiBs",
    "-1GiB",
    "\u00b2",
    "99999999999999999999999999999d",
    "367d",
    "61m",
    "2PiB",
    "\u0661\u0662",
    "0x10",
    "1_000",
    "127.0.0.1:70000",
    "* * * * * *",
    "61 * * * *",
    "/nonexistent/file",
    "builtin",
    "auto",
]
HOSTILE_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63), 10**400, -(10**400)]),
    st.floats(),  # NaN and infinities included
    st.text(max_size=12),
    st.sampled_from(WORDS),
    st.dates(),
    st.binary(max_size=6),
)
HOSTILE_KEY = st.one_of(st.text(max_size=10), st.integers(), st.none(), st.booleans(), st.floats())
HOSTILE = st.recursive(
    HOSTILE_SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(HOSTILE_KEY, inner, max_size=3),
    max_leaves=6,
)
DURATION = st.sampled_from(["10ms", "500ms", "1s", "5s", "2m", "1h30m", 0.5, 30])
SIZE = st.sampled_from(["512MiB", "8GiB", "80GB", 0, 1024])
CELSIUS = st.integers(-50, 200)
RATIO = st.floats(0, 1)
BOOL = st.booleans()
NAMES = st.lists(st.sampled_from(["root", "nobody", "python*", "Xorg", 0]), max_size=3)
CRON = st.sampled_from(["* * * * *", "*/5 * * * *", "0 12 * * mon-fri", "0 0 1 1 *"])


# -- documents built from the real schema ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Many:
    """In a schema: a list of sections of ``schema``."""

    schema: dict[str, Any]
    max_size: int = 2


def _value(schema: Any, hostile: bool) -> st.SearchStrategy[Any]:
    """A good value of ``schema`` (a section, a list of them, or a strategy or constant); with
    ``hostile``, anything at all now and then, at every level."""
    if isinstance(schema, dict):
        good = _section(schema, hostile)
    elif isinstance(schema, Many):
        good = st.lists(_section(schema.schema, hostile), max_size=schema.max_size)
    else:
        good = schema if isinstance(schema, st.SearchStrategy) else st.just(schema)
    return st.one_of(good, good, good, HOSTILE) if hostile else good


def _section(schema: dict[str, Any], hostile: bool) -> st.SearchStrategy[dict[Any, Any]]:
    """Some of ``schema``'s keys; with ``hostile``, now and then an unknown one too."""
    known = st.fixed_dictionaries(
        {}, optional={key: _value(value, hostile) for key, value in schema.items()}
    )
    if not hostile:
        return known
    unknown = st.dictionaries(HOSTILE_KEY, HOSTILE, max_size=1)
    return st.builds(lambda a, b: {**a, **b}, known, st.one_of(st.just({}), st.just({}), unknown))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every value inside ``value``, sections and lists included."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        yield (*prefix, key)
        if isinstance(item, (dict, list)):
            yield from _paths(item, (*prefix, key))


@st.composite
def _one_bad_value(draw: st.DrawFn, documents: st.SearchStrategy[Any]) -> Any:
    """A good document with one value, anywhere in it, replaced by anything at all: each
    setting's parser meets it with everything before it valid."""
    document = copy.deepcopy(draw(documents))
    bad = draw(HOSTILE)
    paths = list(_paths(document))
    if not paths:
        return {draw(HOSTILE_KEY): bad}
    *parents, last = draw(st.sampled_from(paths))
    where = document
    for key in parents:
        where = where[key]
    where[last] = bad
    return document


def documents(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Good documents, good ones with one bad value, and ones with bad values anywhere."""
    good = _section(schema, hostile=False)
    return st.one_of(good, _one_bad_value(good), _section(schema, hostile=True))


def _action(own: dict[str, Any]) -> dict[str, Any]:
    return {"enabled": BOOL, "every": DURATION, "cron": CRON, **own}


POLICY = {
    "strategy": st.sampled_from(["most_free_memory", "least_utilized", "coolest", "weighted"]),
    "count": st.integers(1, 64),
    "min_free_memory": SIZE,
    "max_utilization": RATIO,
    "max_temperature": CELSIUS,
    "exclude_hotspots": BOOL,
    "exclusive": BOOL,
    "window": st.integers(1, 1000),
    "weights": {"free_memory": RATIO, "idle": RATIO, "temperature_headroom": RATIO},
}
ACTIONS = {
    "zombie_reaper": _action(
        {
            "dry_run": BOOL,
            "min_age": DURATION,
            "grace_period": DURATION,
            "kill_timeout": DURATION,
            "max_kills_per_run": st.integers(0, 1000),
            "protect_names": NAMES,
            "protect_users": NAMES,
            "audit_log": st.sampled_from(["", "/tmp/gpu-exporter-fuzz-audit.jsonl"]),
            "leaked_min_memory": SIZE,
        }
    ),
    "thermal": _action(
        {
            "warning_celsius": CELSIUS,
            "critical_celsius": CELSIUS,
            "hysteresis_celsius": st.integers(0, 20),
            "for": DURATION,
            "outlier_celsius": st.integers(1, 30),
            "outlier_utilization_band": RATIO,
        }
    ),
    "recommend": _action({"policies": {"default": POLICY, "training": POLICY}}),
}
GOOD_SETTINGS: dict[str, Any] = {
    "listen": st.sampled_from(["127.0.0.1:9402", ":9402", "[::1]:9402", "localhost:1"]),
    "interval": DURATION,
    "deadline": st.one_of(DURATION, st.just("auto")),
    "log_level": st.sampled_from([*LOG_LEVELS, "DEBUG"]),
    "simulate": st.sampled_from([False, True, "builtin", "off"]),
    "paths.proc": "/proc",
    "paths.dev": "/dev",
    "paths.locks": "/tmp",
    "tls.cert_file": "",
    "tls.key_file": "",
    "tls.client_ca_file": "",
    "history": st.integers(1, 100_000),
}


def _config_schema() -> dict[str, Any]:
    """Every setting in exporter.config.settings.SETTINGS (a new one is fuzzed with its default)
    and the actions."""
    schema: dict[str, Any] = {}
    for setting in SETTINGS:
        *sections, name = setting.key.split(".")
        where = schema
        for section in sections:
            where = where.setdefault(section, {})
        where[name] = GOOD_SETTINGS.get(setting.key, setting.default)
    schema["actions"] = ACTIONS
    return schema


VALUE = st.one_of(st.integers(0, 100), st.fixed_dictionaries({"from": RATIO, "to": RATIO}))
WINDOW = {"from": DURATION, "until": DURATION}
ERRORS = Many(
    {
        "field": st.sampled_from(["*", *FIELD_FUNCTIONS]),
        "error": st.sampled_from(["Unknown", "GpuIsLost", "NotSupported", "Bogus"]),
        "hang": DURATION,
        **WINDOW,
    }
)
PROCESS = {
    "pid": st.integers(1, 2**22),
    "memory": SIZE,
    "type": st.sampled_from(["compute", "graphics"]),
    "holds_device": BOOL,
    "churn": DURATION,
    **WINDOW,
}
GPU = {
    "name": st.text(max_size=20),
    "uuid": st.text(max_size=20),
    "memory_total": SIZE,
    "memory_reserved": SIZE,
    "memory_used": st.one_of(SIZE, st.fixed_dictionaries({"points": st.just([[0, 0], [10, 1]])})),
    "utilization": st.one_of(RATIO, st.fixed_dictionaries({"base": RATIO, "period": DURATION})),
    "memory_utilization": RATIO,
    "temperature": VALUE,
    "memory_temperature": VALUE,
    "power": VALUE,
    "power_limit": st.integers(1, 1000),
    "fan_speed": RATIO,
    "performance_state": st.integers(0, 15),
    "clock_event_reasons": st.integers(0, 255),
    "minor_number": st.integers(0, 16),
    "thresholds": {"slowdown": CELSIUS, "shutdown": CELSIUS},
    "clocks_mhz": {"graphics": VALUE, "memory": VALUE},
    "ecc": {"enabled": BOOL, "corrected": VALUE},
    "present": WINDOW,
    "unsupported": st.lists(st.sampled_from(list(FIELD_FUNCTIONS)), max_size=2),
    "processes": Many(PROCESS),
    "errors": ERRORS,
    "mig_devices": st.lists(st.sampled_from(["MIG-1", "GPU-1"]), max_size=2),
}
SCENARIO = {
    "driver": {
        "version": st.text(max_size=10),
        "cuda_version": st.sampled_from(["12.4", "11", 12.4]),
        "missing_functions": st.lists(st.sampled_from(["nvmlDeviceGetFanSpeed"]), max_size=1),
        "call_latency": DURATION,
        "unimplemented": st.sampled_from(["FunctionNotFound", "NotSupported"]),
        "errors": ERRORS,
    },
    "gpus": Many(GPU, max_size=3),
}

# -- changes to the text that a dict cannot express ------------------------------------------------

TAGS = [
    "!!python/object/apply:os.system ['true']",
    "!!python/object:os.system",
    "!!python/name:os.system",
    "!!int",
    "!!float",
    "!!bool",
    "!!timestamp",
    "!!binary",
    "!!set",
    "!!omap",
    "!!pairs",
    "!!str",
    "!!null",
    "!!map",
    "!!seq",
    "!foo",
    "!<tag:yaml.org,2002:int>",
]
#: Aliases that expand to 10**9 values if anything expanded them ("billion laughs").
BOMB = "".join(
    f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}" if i else "lol"] * 10) + "]\n"
    for i in range(9)
)
INSERTS = [b"\x00", b"\x07", b"\x1b[31m", b"\xff\xfe", b"\xed\xa0\x80", b"\xc3", b"\t", b"{", b"["]
INSERTS += [b"'", b'"', b"&a ", b"*a", b"*nope", b"<<: {}\n", b"%YAML 1.1\n---\n", b"\n---\n"]
INSERTS += [b": :", b"? [a]\n: 1\n", b"- ", b"\r", b"\xef\xbb\xbf", b"\\u0000", b"2001-13-45"]
MUTATION = st.tuples(
    st.sampled_from(["tag", "dup", "insert", "truncate", "bom", "crlf", "utf16", "latin1", "bomb"]),
    st.integers(0, 10**6),
    st.sampled_from(TAGS),
    st.sampled_from(INSERTS),
)


def _value_lines(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if ": " in line and not line.rstrip().endswith(":")]


def mutate(text: str, mutations: list[tuple[str, int, str, bytes]]) -> bytes:
    """``text`` with each mutation applied, as the bytes of a file."""
    encoding = "utf-8"
    for kind, n, tag, insert in mutations:
        lines = text.split("\n")
        values = _value_lines(lines)
        if kind == "tag" and values:
            i = values[n % len(values)]
            key, _, value = lines[i].partition(": ")
            lines[i] = f"{key}: {tag} {value}"
        elif kind == "bomb" and values:
            i = values[n % len(values)]
            lines[i] = lines[i].partition(": ")[0] + ": *lol8"
            lines.insert(0, BOMB.rstrip("\n"))
        elif kind == "dup" and lines:
            i = n % len(lines)
            lines.insert(i, lines[i])
        text = "\n".join(lines)
        if kind == "insert":
            i = n % (len(text) + 1)
            text = text[:i] + insert.decode("latin-1") + text[i:]
        elif kind == "truncate":
            text = text[: n % (len(text) + 1)]
        elif kind == "bom":
            text = "\ufeff" + text
        elif kind == "crlf":
            text = text.replace("\n", "\r\n")
        elif kind in ("utf16", "latin1"):
            encoding = {"utf16": "utf-16", "latin1": "latin-1"}[kind]
    return text.encode(encoding, errors="surrogatepass" if encoding != "latin-1" else "replace")


def dump(document: Any) -> str:
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=10**6)


CONFIG_DOCUMENTS = documents(_config_schema())
SCENARIO_DOCUMENTS = documents(SCENARIO)
MUTATIONS = st.lists(MUTATION, max_size=2)


# -- hypothesis ----------------------------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=400))
def test_arbitrary_bytes(target: Path, data: bytes) -> None:
    target.write_bytes(data)
    check_config(str(target))
    check_scenario(str(target))


@FUZZ
@given(text=st.text(max_size=300))
def test_arbitrary_text(target: Path, text: str) -> None:
    target.write_bytes(text.encode("utf-8", errors="surrogatepass"))
    check_config(str(target))
    check_scenario(str(target))


@settings(FUZZ, max_examples=300)
@given(document=CONFIG_DOCUMENTS, mutations=MUTATIONS)
def test_config_documents(target: Path, document: dict[Any, Any], mutations: list[Any]) -> None:
    target.write_bytes(mutate(dump(document), mutations))
    check_config(str(target))


@settings(FUZZ, max_examples=300)
@given(document=SCENARIO_DOCUMENTS, mutations=MUTATIONS)
def test_scenario_documents(target: Path, document: dict[Any, Any], mutations: list[Any]) -> None:
    target.write_bytes(mutate(dump(document), mutations))
    check_scenario(str(target))


def test_the_schema_reaches_valid_configs(target: Path) -> None:
    """The generated documents are not all rejected at the first key: many are valid, so the
    fuzzing reaches every setting's parser."""
    valid: list[Config] = []

    @FUZZ
    @given(document=_section(_config_schema(), hostile=False))
    def collect(document: dict[Any, Any]) -> None:
        target.write_bytes(dump(document).encode())
        config = check_config(str(target))
        if config is not None:
            valid.append(config)

    collect()
    assert len(valid) >= 50  # of 150; the others break a rule between settings
    assert any(
        config.actions.actions["recommend"].options.policies.keys() - {"default"}
        for config in valid
    )


# -- named hostile files ---------------------------------------------------------------------------

VALID = "interval: 1s\nactions:\n  thermal: {every: 2s}\n"
HOSTILE_FILES: dict[str, bytes] = {
    "billion laughs": (BOMB + "interval: *lol8\n").encode(),
    "billion laughs, unused": (BOMB + "interval: 1s\n").encode(),
    "wide alias fan-out": (
        "a: &a [" + ", ".join(["x"] * 1000) + "]\nb: [" + ", ".join(["*a"] * 1000) + "]\n"
    ).encode(),
    "alias inside itself": b"actions: &a {thermal: *a}\n",
    "recursive sequence": b"history: &h [*h]\n",
    "undefined alias": b"history: *nope\n",
    "deep sequence": b"history: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "deep mapping": b"actions: " + b"{a: " * 2000 + b"1" + b"}" * 2000 + b"\n",
    "just past the depth limit": b"a: " + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"\n",
    "python object": b"interval: !!python/object/apply:os.system ['touch /tmp/pwned']\n",
    "python name": b"interval: !!python/name:os.system\n",
    "int tag, not an int": b"history: !!int abc\n",
    "float tag, not a float": b"interval: !!float abc\n",
    "bool tag, not a bool": b"actions:\n  thermal:\n    enabled: !!bool maybe\n",
    "timestamp tag, not a time": b"interval: !!timestamp abc\n",
    "a date that is no date": b"interval: 2001-13-45\n",
    "a date key that is no date": b"2001-02-30: 1\n",
    "set key": b"? !!set {a: null}\n: 1\n",
    "sequence key": b"? [a, b]\n: 1\n",
    "binary key": b"? !!binary aGVsbG8=\n: 1\n",
    "merge key": b"base: &b {every: 1s}\nactions:\n  thermal:\n    <<: *b\n",
    "duplicate key": b"interval: 1s\ninterval: 2s\n",
    "duplicate nested key": b"actions:\n  thermal: {every: 1s, every: 2s}\n",
    "key with a newline": b'"inter\\nval": 1s\n',
    "non-UTF-8": b"log_level: caf\xe9\n",
    "UTF-16": VALID.encode("utf-16"),
    "UTF-8 BOM": b"\xef\xbb\xbf" + VALID.encode(),
    "NUL byte": b"interval: 1s\x00\n",
    "escape sequence": b"log_level: \x1b[31mred\n",
    "empty": b"",
    "only a BOM": b"\xef\xbb\xbf",
    "only whitespace": b" \n\t\n",
    "two documents": b"interval: 1s\n---\ninterval: 2s\n",
    "a sequence": b"- interval: 1s\n",
    "a scalar": b"interval\n",
    "null document": b"~\n",
    "huge integer": b"history: " + b"9" * 5000 + b"\n",
    "huge float": b"interval: 1e999\n",
    "nan": b"actions:\n  thermal: {hysteresis_celsius: .nan}\n",
    "negative duration": b"actions:\n  zombie_reaper: {grace_period: -5s}\n",
    "negative zero": b"interval: -0.0\n",
    "a megabyte string": b"log_level: " + b"x" * 1_000_000 + b"\n",
    "many unknown keys": "".join(f"k{i}: {i}\n" for i in range(20_000)).encode(),
    "CRLF": VALID.replace("\n", "\r\n").encode(),
    "CR only": VALID.replace("\n", "\r").encode(),
    "tabs": b"actions:\n\tthermal: {}\n",
    "directive": b"%YAML 9.9\n---\ninterval: 1s\n",
    "unterminated": b"interval: '1s\n",
    "an every past its maximum": (
        b"actions:\n  zombie_reaper:\n    every: 99999999999999999999999999999d\n"
    ),
    "an interval past its maximum": b"interval: 99999999999999999999999999999d\n",
    "a size past its maximum": b"actions:\n  zombie_reaper: {leaked_min_memory: 2PiB}\n",
    "an infinite duration": b"actions:\n  thermal: {for: .inf}\n",
}


@pytest.mark.parametrize("name", list(HOSTILE_FILES))
def test_hostile_file(target: Path, name: str) -> None:
    target.write_bytes(HOSTILE_FILES[name])
    check_config(str(target))
    check_scenario(str(target))


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("billion laughs", "alias"),
        ("alias inside itself", "alias inside itself"),
        ("deep sequence", "nested too deeply"),
        ("just past the depth limit", f"more than {MAX_DEPTH} levels"),
        ("python object", "python/object"),
        ("int tag, not an int", "'abc' is not a valid int"),
        ("a date that is no date", "'2001-13-45' is not a valid timestamp"),
        ("set key", "keys must be scalars"),
        ("merge key", "merge keys (<<) are not supported"),
        ("key with a newline", "'inter\\nval'"),
        ("NUL byte", "#x0000"),
        ("non-UTF-8", "cannot read"),
        ("an every past its maximum", ":3: actions.zombie_reaper.every: 9999"),
        ("an every past its maximum", "d is longer than the maximum 366d"),
        ("an interval past its maximum", "is longer than the maximum 1h"),
        ("a size past its maximum", "2PiB is larger than the maximum 1PiB"),
        ("an infinite duration", "expected a finite duration"),
    ],
)
def test_hostile_file_messages(target: Path, name: str, needle: str) -> None:
    """The precise reasons, and the line where there is one."""
    target.write_bytes(HOSTILE_FILES[name])
    with pytest.raises(ConfigError) as info:
        agent_config(str(target), {}, environ={})
    assert needle in str(info.value), str(info.value)


def test_bom_and_crlf_files_are_valid(target: Path) -> None:
    for name in ("UTF-8 BOM", "CRLF", "CR only"):
        target.write_bytes(HOSTILE_FILES[name])
        config = check_config(str(target))
        assert config is not None and config.interval == 1.0, name


# -- the real command ------------------------------------------------------------------------------

COMMAND_CASES = [
    "billion laughs",
    "python object",
    "a date that is no date",
    "non-UTF-8",
    "deep sequence",
    "NUL byte",
    "an every past its maximum",
    "an interval past its maximum",
]


def _usage_error(result: subprocess.CompletedProcess[str], path: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and path in lines[0], result.stderr


@pytest.mark.parametrize("name", COMMAND_CASES)
def test_real_command_rejects(tmp_path: Path, name: str) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(HOSTILE_FILES[name])
    listen = f"127.0.0.1:{free_port()}"
    _usage_error(_run("check-config", str(path)), str(path))
    _usage_error(_run("serve", "--config", str(path), "--simulate", "--listen", listen), str(path))
    _usage_error(_run("serve", "--simulate", str(path), "--listen", listen), str(path))


# -- reload: all or nothing ------------------------------------------------------------------------

OLD = """\
interval: 200ms
actions:
  zombie_reaper:
    enabled: false
  thermal:
    every: 1s
"""
#: The first half of every new file: valid, and visibly different from OLD in /metrics.
NEW_FIRST_HALF = """\
interval: 300ms
actions:
  zombie_reaper:
    enabled: true
  thermal:
    every: 1s
"""
BAD_SECOND_HALVES = {
    "bad value": "history: lots\n",
    "unknown key": "  recommend:\n    evry: 1s\n",
    "invalid YAML": "listen: [oops\n",
    "alias bomb": BOMB.replace("lol", "x-lol") + "log_level: *x-lol8\n",
    "non-UTF-8": "log_level: caf\udce9\n",
}


def _state(port: int) -> tuple[float, float]:
    """(sample interval, zombie_reaper enabled) as /metrics shows them."""
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    found = samples(body.encode())
    return (
        one(found, "gpu_exporter_sample_interval_seconds"),
        one(found, "gpu_exporter_action_enabled", action="zombie_reaper"),
    )


def _until(predicate: Callable[[], bool], agent: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert agent.poll() is None, stderr_of(agent)
        assert time.monotonic() < deadline, f"never {what}: {stderr_of(agent)}"
        time.sleep(0.05)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    config = tmp_path / "config.yaml"
    config.write_text(OLD)
    with serve(tmp_path, "--simulate", "--config", str(config)) as (proc, port):
        healthz_until(proc, port)
        yield proc, port, config


def test_reload_of_a_half_bad_file_changes_nothing(
    agent: tuple[subprocess.Popen[str], int, Path],
) -> None:
    proc, port, config = agent
    assert _state(port) == (0.2, 0.0)
    for count, (name, second_half) in enumerate(BAD_SECOND_HALVES.items(), 1):
        config.write_bytes((NEW_FIRST_HALF + second_half).encode("utf-8", "surrogateescape"))
        proc.send_signal(signal.SIGHUP)

        def rejected(count: int = count) -> bool:
            return stderr_of(proc).count("config reload rejected") == count

        _until(rejected, proc, f"rejected the {name} file")
        last = [line for line in stderr_of(proc).splitlines() if "reload rejected" in line][-1]
        assert str(config) in last, last
        assert _state(port) == (0.2, 0.0), name  # not one setting of the first half taken

    # The same first half with a good second half is taken whole: the check above can fail.
    config.write_text(NEW_FIRST_HALF + "history: 50\n")
    proc.send_signal(signal.SIGHUP)
    _until(lambda: _state(port) == (0.3, 1.0), proc, "applied the good file")
    assert "Traceback" not in stderr_of(proc)
    assert healthz_until(proc, port) == 200


def test_reload_after_the_file_is_replaced_by_a_directory_or_removed(
    agent: tuple[subprocess.Popen[str], int, Path],
) -> None:
    proc, port, config = agent
    config.unlink()
    proc.send_signal(signal.SIGHUP)
    _until(lambda: "config reload rejected" in stderr_of(proc), proc, "rejected a missing file")
    config.mkdir()
    proc.send_signal(signal.SIGHUP)
    _until(lambda: stderr_of(proc).count("reload rejected") == 2, proc, "rejected a directory")
    assert _state(port) == (0.2, 0.0)
    assert "Traceback" not in stderr_of(proc)


def test_dates_are_not_durations(target: Path) -> None:
    """A YAML date where a duration belongs is a clear error, not a crash."""
    target.write_text(f"interval: {datetime.date(2024, 1, 1).isoformat()}\n")
    assert check_config(str(target)) is None


def test_plain_aliases_still_work(target: Path) -> None:
    """The limits stop bombs, not the ordinary reuse of a value."""
    target.write_text(
        "actions:\n"
        "  recommend:\n"
        "    policies:\n"
        "      default: {weights: &w {free_memory: 2, idle: 1, temperature_headroom: 1}}\n"
        "      training: {count: 2, weights: *w}\n"
    )
    config = check_config(str(target))
    assert config is not None
    policies = config.actions.actions["recommend"].options.policies
    assert policies["training"].weights.free_memory == 2 == policies["default"].weights.free_memory


# -- what is not a small regular file --------------------------------------------------------------


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 * 1024**3, 2 * 1024**3))


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return str(path)


def _link_to_fifo(path: Path) -> str:
    path.symlink_to(_fifo(path.with_suffix(".fifo")))
    return str(path)


def _big(path: Path) -> str:
    path.write_bytes(b"interval: 1s\n" + b"#" * (2 * 1024 * 1024) + b"\n")
    return str(path)


#: How each file is made at a path, and why it is refused.
NOT_SMALL_REGULAR_FILES: dict[str, tuple[Callable[[Path], str], str]] = {
    "a FIFO": (_fifo, "is not a regular file (a FIFO)"),
    "a link to a FIFO": (_link_to_fifo, "is not a regular file (a FIFO)"),
    "/dev/zero": (lambda _: "/dev/zero", "is not a regular file (a character device)"),
    "a 2 MiB file": (_big, "is larger than 1 MiB"),
}


@pytest.mark.parametrize("name", list(NOT_SMALL_REGULAR_FILES))
def test_real_command_refuses_what_is_not_a_small_regular_file(tmp_path: Path, name: str) -> None:
    make, why = NOT_SMALL_REGULAR_FILES[name]
    path = make(tmp_path / "config.yaml")
    listen = f"127.0.0.1:{free_port()}"
    for argv in (
        ("check-config", path),
        ("serve", "--config", path, "--simulate", "--listen", listen),
        ("serve", "--simulate", path, "--listen", listen),
    ):
        # A blocked read is a TimeoutExpired, and reading /dev/zero a MemoryError: no hang, and
        # no machine out of memory, when the refusal is gone.
        result = _run(*argv, timeout=20, preexec_fn=_limit_memory)
        _usage_error(result, path)
        assert why in result.stderr, result.stderr


def test_reload_of_a_fifo_a_huge_file_or_a_bound_past_keeps_serving(
    agent: tuple[subprocess.Popen[str], int, Path],
) -> None:
    """The running config stays, samples go on, and SIGTERM still ends the agent at once."""
    proc, port, config = agent
    replacements: list[tuple[Callable[[], object], str]] = [
        (lambda: _fifo(config), "is not a regular file (a FIFO)"),
        (lambda: _big(config), "is larger than 1 MiB"),
        (lambda: config.write_bytes(HOSTILE_FILES["an every past its maximum"]), "366d"),
        (lambda: config.write_bytes(HOSTILE_FILES["an interval past its maximum"]), "1h"),
    ]
    for count, (replace, why) in enumerate(replacements, 1):
        config.unlink()
        replace()
        proc.send_signal(signal.SIGHUP)

        def rejected(count: int = count) -> bool:
            return stderr_of(proc).count("config reload rejected") == count

        _until(rejected, proc, f"rejected {why}")
        last = [line for line in stderr_of(proc).splitlines() if "reload rejected" in line][-1]
        assert str(config) in last and why in last, last
        assert _state(port) == (0.2, 0.0)
    taken = _samples_taken(port)
    _until(lambda: _samples_taken(port) >= taken + 2, proc, "sampled after the reloads")
    assert healthz_until(proc, port) == 200
    sent = time.monotonic()
    proc.terminate()
    assert proc.wait(timeout=5) == 0, stderr_of(proc)
    assert time.monotonic() - sent < 3
    assert "Traceback" not in stderr_of(proc)


def _samples_taken(port: int) -> float:
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    return one(samples(body.encode()), "gpu_exporter_samples_total")
