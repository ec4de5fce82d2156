"""The action engine: config, scheduling, failures, metrics, /recommend and SIGHUP reloads."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.actions.base import Action
from exporter.actions.engine import ActionEngine, ActionsConfig, parse_actions
from exporter.actions.registry import ACTIONS
from exporter.config.yamlconf import ConfigError, parse_document
from exporter.core.procfs import ProcFs
from exporter.exposition.metrics import render
from exporter.sampling.sampler import Sampler
from exporter.web import routes as agent_http
from exporter.web.routes import App
from tests.agent import healthz_until, http_get, logged_until, serve, stderr_of
from tests.helpers import agent_config, one, samples

SCENARIO = """
gpus:
  - {name: GPU A, memory_total: 80GiB, utilization: 0.9, temperature: 60}
  - {name: GPU B, memory_total: 80GiB, utilization: 0.1, temperature: 50}
"""


def actions(text: str) -> ActionsConfig:
    return parse_actions(parse_document(text, "c.yaml").root().section("actions"))


@pytest.fixture
def make_engine(simulated, collector, clock, tmp_path):
    """An engine over a sampled simulated host; ``thermal=`` swaps the thermal action for
    another object (the registry is the seam)."""
    simulated(SCENARIO)
    sampler = Sampler(collector, interval=5, deadline=5, monotonic=clock, render=render)
    sampler.sample_once()
    made: list[ActionEngine] = []

    def make(thermal: Any = None) -> ActionEngine:
        registry = [
            replace(kind, make=lambda settings, context: thermal)
            if thermal is not None and kind.name == "thermal"
            else kind
            for kind in ACTIONS
        ]
        engine = ActionEngine(
            sampler,
            ActionsConfig(),
            ProcFs(),
            str(tmp_path),
            clock=lambda: 1.7e9,
            registry=registry,
        )
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.stop()


@pytest.fixture
def engine(make_engine):
    return make_engine()


# -- config ----------------------------------------------------------------------------------------


def test_defaults_without_config():
    config = ActionsConfig()
    assert set(config.actions) == {"zombie_reaper", "thermal", "health", "recommend", "waste"}
    assert all(a.enabled for a in config.actions.values())
    assert config.actions["zombie_reaper"].options.dry_run is True
    assert "default" in config.actions["recommend"].options.policies


def test_schedule_keys():
    config = actions(
        "actions:\n"
        "  thermal: {every: 500ms}\n"
        "  zombie_reaper: {cron: '*/5 * * * *'}\n"
        "  recommend: {enabled: false}\n"
    )
    assert config.actions["thermal"].every == 0.5
    assert config.actions["zombie_reaper"].cron == "*/5 * * * *"
    assert config.actions["zombie_reaper"].every is None
    assert not config.actions["recommend"].enabled


@pytest.mark.parametrize(
    ("text", "where", "needle"),
    [
        (
            "actions:\n  thermal:\n    everry: 5s\n",
            "c.yaml:3",
            "actions.thermal.everry: unknown key",
        ),
        ("actions:\n  reaper: {}\n", "c.yaml:2", "actions.reaper: unknown key"),
        ("actions:\n  zombie_reaper:\n    dry_runn: false\n", "c.yaml:3", "dry_runn: unknown key"),
        ("actions:\n  thermal:\n    cron: 'every day'\n", "c.yaml:3", "actions.thermal.cron"),
        ("actions:\n  thermal: {every: 5s, cron: '* * * * *'}\n", "c.yaml:2", "every or cron"),
        ("actions:\n  thermal: {every: 0s}\n", "c.yaml:2", "more than 0s"),
        ("actions:\n  thermal: {enabled: 'yes'}\n", "c.yaml:2", "true or false"),
        (
            "actions:\n  recommend:\n    policies:\n      big: {strategy: biggest}\n",
            "c.yaml:4",
            "strategy",
        ),
    ],
)
def test_config_errors_name_file_line_and_key(text, where, needle):
    with pytest.raises(ConfigError) as failed:
        actions(text)
    assert str(failed.value).startswith(where) and needle in str(failed.value), str(failed.value)


def test_check_config_rejects_a_typo_in_a_safety_setting(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("actions:\n  zombie_reaper:\n    dryrun: false\n")
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert f"{path}:3: actions.zombie_reaper.dryrun: unknown key" in result.stderr
    assert "Traceback" not in result.stderr


def test_example_config_is_valid():
    config = agent_config(str(Path(__file__).parent.parent / "config.example.yaml"), environ={})
    assert config.actions.actions["zombie_reaper"].options.dry_run is True


# -- running ---------------------------------------------------------------------------------------


def test_every_action_runs_and_publishes_metrics(engine):
    for name in ("thermal", "recommend", "zombie_reaper"):
        assert engine.run(name)
    found = samples(engine.exposition())
    for name in ("thermal", "recommend", "zombie_reaper"):
        assert one(found, "gpu_exporter_action_runs_total", action=name) == 1
        assert one(found, "gpu_exporter_action_failures_total", action=name) == 0
        assert (
            one(found, "gpu_exporter_action_last_success_timestamp_seconds", action=name) == 1.7e9
        )
        assert one(found, "gpu_exporter_action_duration_seconds", action=name) >= 0
    assert one(found, "gpu_thermal_hotspot", gpu="0") == 0
    # the default policy weighs idleness: GPU 1 (10 % busy) over GPU 0 (90 %)
    assert one(found, "gpu_recommended", gpu="0", policy="default") == 0
    assert one(found, "gpu_recommended", gpu="1", policy="default") == 1
    assert one(found, "gpu_recommended_devices", policy="default") == 1
    assert one(found, "gpu_zombie_processes", gpu="0", **{"class": "orphan"}) == 0


def test_a_failing_action_is_counted_and_the_others_go_on(make_engine, caplog):
    class Broken(Action):
        name = "thermal"

        def run(self, snapshots, now):
            raise RuntimeError("bug in an action")

        def families(self):
            return []

    engine = make_engine(thermal=Broken())
    assert not engine.run("thermal")
    assert not engine.run("thermal")
    assert engine.run("recommend")
    found = samples(engine.exposition())
    assert one(found, "gpu_exporter_action_failures_total", action="thermal") == 2
    assert one(found, "gpu_exporter_action_runs_total", action="thermal") == 2
    assert "gpu_exporter_action_last_success_timestamp_seconds" not in {
        n for n, s in found.items() if any(x.labels.get("action") == "thermal" for x in s)
    }
    assert caplog.text.count("action thermal failed") == 1  # logged once per failing episode


def test_runs_of_one_action_never_overlap(make_engine):
    active, most = [0], [0]

    class Slow(Action):
        name = "thermal"

        def run(self, snapshots, now):
            active[0] += 1
            most[0] = max(most[0], active[0])
            time.sleep(0.05)
            active[0] -= 1

        def families(self):
            return []

    engine = make_engine(thermal=Slow())
    threads = [threading.Thread(target=engine.run, args=("thermal",)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1


def test_scheduler_runs_jobs_on_their_interval(engine):
    engine.reload(actions("actions:\n  thermal: {every: 100ms}\n"))
    engine.start()
    deadline = time.monotonic() + 3
    while engine.stats("thermal").runs < 3:
        assert time.monotonic() < deadline, "the job did not run"
        time.sleep(0.05)
    engine.stop()


def test_reload_keeps_unchanged_actions_and_disables_others(engine):
    engine.run("thermal")
    thermal = engine.action("thermal")
    engine.reload(actions("actions:\n  recommend: {enabled: false}\n"))
    assert engine.action("thermal") is thermal  # unchanged: state kept
    assert engine.action("recommend") is None
    assert not engine.run("recommend")
    found = samples(engine.exposition())
    assert one(found, "gpu_exporter_action_enabled", action="recommend") == 0
    engine.reload(actions("actions:\n  thermal: {warning_celsius: 70}\n"))
    assert engine.action("thermal") is not thermal


# -- /recommend ------------------------------------------------------------------------------------


@pytest.fixture
def server(engine):
    running = agent_http.serve(App(engine.sampler, engine), "127.0.0.1", 0)
    yield running
    running.close()


def get(server, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        try:
            return response.status, json.loads(body)
        except ValueError:
            return response.status, {"text": body.decode()}
    finally:
        conn.close()


def test_recommend_endpoint(server):
    status, body = get(server, "/recommend")
    # the default policy weighs idleness: GPU 1 (10 % busy) over GPU 0 (90 %), same free memory
    assert status == 200 and body["ok"] and [c["index"] for c in body["chosen"]] == [1]
    status, body = get(server, "/recommend?count=2&max_utilization=0.5")
    assert status == 409 and not body["ok"] and body["chosen"] == []
    (rejected,) = body["rejected"]
    assert rejected["index"] == 0 and "utilization 90% above 50%" in rejected["reason"]
    status, body = get(server, "/recommend?strategy=least_utilized")
    assert status == 200 and body["chosen"][0]["index"] == 1
    status, body = get(server, "/recommend?min_free_memory=100GiB")
    assert status == 409


@pytest.mark.parametrize(
    ("query", "status", "needle"),
    [
        ("count=0", 400, "count"),
        ("count=two", 400, "count"),
        ("min_free_memory=lots", 400, "min_free_memory"),
        ("max_utilization=2", 400, "max_utilization"),
        ("max_temperature=hot", 400, "max_temperature"),
        ("policy=nope", 404, "no policy 'nope'"),
        ("bogus=1", 400, "unknown query parameter 'bogus'"),
        ("count=1&count=2", 400, "more than once"),
    ],
)
def test_recommend_bad_parameters(server, query, status, needle):
    got, body = get(server, f"/recommend?{query}")
    assert got == status and needle in body["text"], body


def test_metrics_include_the_actions(server, engine):
    engine.run("thermal")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/metrics")
    names = {f.name for f in text_string_to_metric_families(conn.getresponse().read().decode())}
    conn.close()
    assert {"gpu_up", "gpu_thermal_hotspot", "gpu_exporter_action_runs"} <= names


# -- SIGHUP ----------------------------------------------------------------------------------------


def test_sighup_reloads_and_rejects_an_invalid_file(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("actions:\n  thermal: {every: 1s}\n")
    with serve(tmp_path, "--simulate", "--config", str(config), "--interval", "0.2") as (
        agent,
        port,
    ):
        healthz_until(agent, port)
        config.write_text("actions:\n  thermal: {evry: 1s}\n")
        agent.send_signal(signal.SIGHUP)
        logged_until(agent, "reload rejected")
        assert healthz_until(agent, port) == 200  # still serving, on the old config
        config.write_text("interval: 1s\nactions:\n  recommend: {enabled: false}\n")
        agent.send_signal(signal.SIGHUP)
        logged_until(agent, "config reloaded")
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=5) == 0
        stderr = stderr_of(agent)
    rejected = [line for line in stderr.splitlines() if "reload rejected" in line]
    assert len(rejected) == 1 and "config.yaml:2: actions.thermal.evry: unknown key" in rejected[0]
    assert "config reloaded" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "kill"])
def test_agent_finds_the_orphan_of_a_simulated_job(tmp_path, dry_run):
    scenario = tmp_path / "orphan.yaml"
    scenario.write_text(
        "gpus:\n"
        "  - processes:\n"
        '      - {spawn: [sleep, "60"], orphan: true, memory: 3GiB}\n'
        '      - {spawn: [sleep, "60"], memory: 1GiB}\n'
    )
    audit = tmp_path / "audit.jsonl"
    config = tmp_path / "config.yaml"
    config.write_text(
        "actions:\n"
        "  zombie_reaper:\n"
        "    every: 200ms\n"
        "    min_age: 500ms\n"
        "    protect_users: []\n"
        f"    dry_run: {str(dry_run).lower()}\n"
        f"    audit_log: {audit}\n"
    )
    args = ("--simulate", str(scenario), "--config", str(config), "--interval", "0.2")
    with serve(tmp_path, *args) as (agent, port):
        healthz_until(agent, port)
        wanted = "signalling" if not dry_run else "skipped"
        deadline = time.monotonic() + 10
        while not audit.exists() or wanted not in audit.read_text():
            assert time.monotonic() < deadline, stderr_of(agent)
            time.sleep(0.1)
        # The metrics are rendered when the run that wrote the line ends: poll for them.
        # The gauge counts the orphan while it lives (always, in a dry run); the counters last.
        wanted_metrics = {("gpu_exporter_zombie_actions_total", "report", "orphan"): 1}
        if dry_run:
            wanted_metrics[("gpu_zombie_processes", "0", "orphan")] = 1
        else:
            wanted_metrics[("gpu_exporter_zombie_actions_total", "signal", "sigterm")] = 1
        while True:
            status, body = http_get(f"http://127.0.0.1:{port}/metrics")
            assert status == 200
            found = samples(body.encode())
            seen = {key: _reaper_value(found, *key) for key in wanted_metrics}
            if all(seen[key] == value for key, value in wanted_metrics.items()):
                break
            assert time.monotonic() < deadline + 10, (seen, stderr_of(agent))
            time.sleep(0.05)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=5) == 0
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    orphans = [e for e in events if e.get("class") == "orphan"]
    assert orphans[0]["event"] == "found" and len({e["pid"] for e in orphans}) == 1
    # the only other record is of the job's leader, listed by NVML in the Snapshot taken as it
    # exited; the job's live process is left alone
    others = [e for e in events if e.get("class", "orphan") != "orphan"]
    assert all(e["class"] == "unverifiable" and "not visible" in e["why"] for e in others), others


def _reaper_value(found: dict, name: str, first: str, second: str) -> float | None:
    """The value of a reaper series, or None while it is not exported yet."""
    if name == "gpu_zombie_processes":
        labels = {"gpu": first, "class": second}
    else:
        labels = {"action": first, "outcome": second}
    values = [s.value for s in found.get(name, []) if labels.items() <= s.labels.items()]
    return values[0] if values else None


@pytest.mark.parametrize(
    ("expression", "weekday"),
    [("0 12 * * 0", "Sun"), ("0 12 * * 7", "Sun"), ("0 12 * * 1", "Mon"), ("0 12 * * 6", "Sat")],
)
def test_cron_weekdays_mean_what_they_mean_to_cron(expression, weekday):
    import datetime

    from exporter.actions.engine import cron_trigger

    monday = datetime.datetime(2026, 11, 30, 13, tzinfo=datetime.timezone.utc)
    fire = cron_trigger(expression).get_next_fire_time(None, monday)
    assert fire.strftime("%a") == weekday


def test_reloading_reaper_settings_keeps_a_kill_in_progress(engine):
    reaper = engine.action("zombie_reaper")
    engine.reload(actions("actions:\n  zombie_reaper: {min_age: 5s}\n"))
    assert engine.action("zombie_reaper") is reaper
    assert reaper.config.min_age == 5


def test_snapshot_gives_each_process_its_reaper_class_and_last_decision(tmp_path):
    scenario = tmp_path / "orphan.yaml"
    scenario.write_text(
        "gpus:\n  - processes:\n"
        '      - {spawn: [sleep, "60"], orphan: true, orphan_after: 500ms, memory: 3GiB}\n'
    )
    config = tmp_path / "config.yaml"
    config.write_text(
        "actions:\n  zombie_reaper: {every: 200ms, min_age: 300ms, protect_users: []}\n"
    )
    args = ("--simulate", str(scenario), "--config", str(config), "--interval", "0.2")
    with serve(tmp_path, *args) as (agent, port):
        healthz_until(agent, port)
        deadline = time.monotonic() + 15
        while True:
            status, body = http_get(f"http://127.0.0.1:{port}/snapshot")
            assert status == 200
            (gpu,) = json.loads(body)["gpus"]
            verdicts = [p["reaper"] for p in gpu["processes"]]
            if {"class": "orphan", "decision": "skipped dry_run"} in verdicts:
                break
            assert time.monotonic() < deadline, (verdicts, stderr_of(agent))
            time.sleep(0.1)
