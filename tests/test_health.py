"""The health verdict: every check both ways, the action's metrics and transitions, the state
file across restarts, the launcher and /recommend leaving critical GPUs out, and the ``health``
command's output, JSON schema and exit codes."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from exporter.actions.health import HealthAction
from exporter.cli import main
from exporter.config.yamlconf import ConfigError
from exporter.core.findings import Findings, HealthVerdicts, ThermalLevels
from exporter.core.health import CHECKS, HealthConfig, HealthTracker, assess
from exporter.core.selection import Policy, recommend
from exporter.core.snapshot import Gpu, GpuInfo, HostInfo, LinkReadings, Snapshot
from exporter.core.xid import XidEvent
from tests.agent import free_port, http_get, serve, stderr_of
from tests.helpers import agent_config, line_of, samples, until, write

SCHEMA = json.loads(
    (Path(__file__).resolve().parent.parent / "exporter/schemas/health.schema.json").read_text()
)
T0 = 1.7e9


def gpu(index: int = 0, **values: Any) -> Gpu:
    info = GpuInfo(
        index,
        f"GPU-{index}",
        "NVIDIA H100",
        temperature_thresholds={"slowdown": 89.0},
        fields=values.pop("static", {"pcie_link_width_max": 16, "pcie_link_generation_max": 5}),
    )
    defaults: dict[str, Any] = {"temperature_celsius": 40.0, "clock_event_reasons": 0}
    if "nvlink" in values:
        values["nvlink"] = LinkReadings(values["nvlink"])
    return Gpu(index, f"GPU-{index}", True, info, **{**defaults, **values})


class Host:
    """Snapshots one second apart (or ``step`` seconds), fed to a tracker."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.tracker = HealthTracker(config)
        self.seq = 0
        self.at = 0.0

    def see(self, *gpus: Gpu, step: float = 1.0, nvml_up: bool = True) -> dict[str, Any]:
        self.seq += 1
        self.at += step
        snapshot = Snapshot(
            self.seq,
            T0 + self.at,
            self.at,
            0.01,
            nvml_up,
            HostInfo("h"),
            gpus,
            (),
            "" if nvml_up else "DriverNotLoaded",
        )
        self.tracker.observe(snapshot)
        return self.tracker.verdicts()

    def check(self, name: str, *gpus: Gpu, step: float = 1.0, **kwargs: Any) -> tuple[int, str]:
        found = self.see(*gpus, step=step, **kwargs)["GPU-0"].check(name)
        return found.level, found.reason


# -- every check, both ways --------------------------------------------------------------------


def test_memory_repair_warning_critical_and_back_after_the_reset():
    host = Host()
    assert host.check("memory_repair", gpu(fields={"remapped_rows_uncorrectable": 3})) == (0, "")
    level, reason = host.check("memory_repair", gpu(fields={"remapped_rows_uncorrectable": 512}))
    assert level == 1 and reason == "512 rows remapped for uncorrectable errors"
    assert host.check("memory_repair", gpu(fields={"row_remap_pending": 1})) == (
        2,
        "row remap pending",
    )
    failed = gpu(fields={"row_remap_failed": 1, "memory_unrepairable": 1})
    assert host.check("memory_repair", failed) == (
        2,
        "row remap failed, memory marked unrepairable",
    )
    pre_ampere = gpu(fields={"retired_pages_double_bit": 60, "retired_pages_single_bit": 3})
    assert host.check("memory_repair", pre_ampere) == (1, "63 pages retired")
    assert host.check("memory_repair", gpu(fields={"retired_pages_pending": 1}))[0] == 2
    assert host.check("memory_repair", gpu(fields={"row_remap_pending": 0})) == (0, "")


def test_ecc_and_recovery_action_critical_and_back():
    host = Host()
    assert host.check("ecc", gpu(fields={"ecc_uncorrected": 0, "ecc_corrected": 9})) == (0, "")
    assert host.check("ecc", gpu(fields={"ecc_uncorrected": 2})) == (
        2,
        "2 uncorrectable ECC errors since the last reset",
    )
    assert host.check("ecc", gpu(fields={"ecc_uncorrected": 0}))[0] == 0  # reset: volatile 0
    assert host.check("recovery_action", gpu(fields={"recovery_action": 2})) == (
        2,
        "the driver asks for node_reboot",
    )
    assert host.check("recovery_action", gpu(fields={"recovery_action": 0})) == (0, "")
    assert host.check("recovery_action", gpu()) == (0, "")  # the driver lacks the field


def test_pcie_width_and_replay_rate_warn_and_clear():
    host = Host(HealthConfig(rate_window=60))
    link = {"pcie_link_width": 16, "pcie_link_generation": 5}
    assert host.check("pcie", gpu(fields={**link, "pcie_replays": 0})) == (0, "")
    assert host.check("pcie", gpu(fields={**link, "pcie_link_width": 8, "pcie_replays": 0})) == (
        1,
        "link x8 of x16",
    )
    # Gen5 x16 allows 31 replays a minute: 1 a second (60 a minute) is above it
    replays = 0
    for _ in range(10):
        replays += 1
        level, reason = host.check("pcie", gpu(fields={**link, "pcie_replays": replays}))
    assert level == 1 and reason == "55 replays a minute above 31.0 (Gen5 x16)"  # 10 in 11 s
    # at Gen1 x1 the limit is 31/80 a minute: a replay every 30 s is above it too
    slow = {"pcie_link_width": 1, "pcie_link_generation": 1, "pcie_replays": replays + 1}
    slow_gpu = gpu(fields=slow, static={"pcie_link_width_max": 1})
    assert host.check("pcie", slow_gpu, step=30)[0] == 1
    for _ in range(4):  # no new replays for two minutes: the rate over the window falls to 0
        level, reason = host.check(
            "pcie", gpu(fields={**link, "pcie_replays": replays + 1}), step=30
        )
    assert (level, reason) == (0, "")


def test_nvlink_link_down_errors_and_crc_rates():
    host = Host(HealthConfig(error_window=60, rate_window=10))
    up = {0: {"nvlink_up": 1, "nvlink_errors_crc_flit": 0}, 1: {"nvlink_up": 1}}
    assert host.check("nvlink", gpu(nvlink=up)) == (0, "")
    some_crc = {**up, 0: {"nvlink_up": 1, "nvlink_errors_crc_flit": 5}}
    assert host.check("nvlink", gpu(nvlink=some_crc)) == (1, "5 CRC errors in 1m")
    many = {**up, 0: {"nvlink_up": 1, "nvlink_errors_crc_flit": 2000}}
    assert host.check("nvlink", gpu(nvlink=many)) == (2, "1000 CRC errors a second")  # 2000 in 2 s
    for _ in range(70):  # quiet for the error window: back to ok
        level, reason = host.check("nvlink", gpu(nvlink=many))
    assert (level, reason) == (0, "")
    down = {**many, 1: {"nvlink_up": 0}}
    assert host.check("nvlink", gpu(nvlink=down)) == (2, "link 1 down (was up)")
    assert host.check("nvlink", gpu(nvlink=many)) == (0, "")  # up again
    replay = {**many, 1: {"nvlink_up": 1, "nvlink_errors_replay": 1}}
    assert host.check("nvlink", gpu(nvlink=replay)) == (0, "")  # first reading: no growth yet
    replay = {**many, 1: {"nvlink_up": 1, "nvlink_errors_replay": 3}}
    assert host.check("nvlink", gpu(nvlink=replay)) == (2, "2 replay/recovery errors in 1m")


def test_a_link_never_seen_up_is_not_down():
    """GPUs with NVLink hardware but no bridge have every link inactive all along."""
    host = Host()
    idle = {link: {"nvlink_up": 0} for link in range(18)}
    assert host.check("nvlink", gpu(nvlink=idle)) == (0, "")
    assert host.check("nvlink", gpu(nvlink=idle)) == (0, "")


def test_thermal_from_the_thermal_action_or_one_sample():
    tracker = HealthTracker()
    tracker.observe(Snapshot(1, T0, 1.0, 0.01, True, HostInfo("h"), (gpu(temperature_celsius=86),)))
    by_action = {
        0: (0, ""),
        1: (1, "thermal hotspot warning (86 °C)"),
        2: (2, "thermal hotspot critical (86 °C)"),
    }
    for level, expected in by_action.items():
        check = tracker.verdicts({"GPU-0": level})["GPU-0"].check("thermal")
        assert (check.level, check.reason) == expected
    host = Host()
    assert host.check("thermal", gpu(temperature_celsius=70)) == (0, "")
    assert host.check("thermal", gpu(temperature_celsius=82)) == (1, "82 °C, at or above 80 °C")
    assert host.check("thermal", gpu(temperature_celsius=85)) == (2, "85 °C, at or above 85 °C")
    assert host.check("thermal", gpu(temperature_celsius=60)) == (0, "")


def test_clocks_share_of_hardware_slowdown():
    host = Host(HealthConfig(clocks_window=100))
    key = "clock_event_seconds_hw_power_brake_slowdown"
    assert host.check("clocks", gpu(fields={key: 0.0})) == (0, "")  # one reading: no share yet
    seconds = 0.0
    reasons = []
    for share, expected in ((0.05, 0), (0.2, 1), (0.6, 2), (0.0, 0)):
        for _ in range(200):
            seconds += share
            level, reason = host.check("clocks", gpu(fields={key: seconds}))
        assert level == expected, (share, reason)
        reasons.append(reason)
    assert reasons == [
        "",
        "20% of the last 100s in hardware slowdown",
        "60% of the last 100s in hardware slowdown",
        "",
    ]
    fresh = Host()
    brake = gpu(clock_event_reasons=0x80)  # no time counters: the reason bit, as a warning
    assert fresh.check("clocks", brake) == (1, "hw_power_brake_slowdown active")


def test_lost_gpu_critical_then_back():
    host = Host()
    assert host.check("lost", gpu()) == (0, "")
    down = replace(gpu(), up=False, error="GpuIsLost")
    assert host.check("lost", down) == (2, "not answering (GpuIsLost)")
    verdicts = host.see()  # gone from the device list: still judged, by its last index
    assert verdicts["GPU-0"].check("lost").reason == "gone from NVML's device list"
    assert (
        host.see(nvml_up=False)["GPU-0"].check("lost").reason
        == "NVML unavailable (DriverNotLoaded)"
    )
    assert host.check("lost", gpu()) == (0, "")


def _xids(**counts: int) -> dict[str, Any]:
    by_code = {int(code[1:]): count for code, count in counts.items()}
    return {"xid_counts": by_code}


def test_critical_xid_lasts_the_window_or_until_the_reset():
    host = Host(HealthConfig(xid_window=3600))
    assert host.check("xid", gpu(**_xids(x79=0))) == (0, "")
    event = XidEvent(T0 + 2, 79, "reboot")
    level, reason = host.check("xid", gpu(xid_counts={79: 1}, xids=(event,)))
    assert level == 2 and reason.startswith("XID 79 (reboot) at ")
    assert host.check("xid", gpu(xid_counts={79: 1}), step=3500)[0] == 2
    assert host.check("xid", gpu(xid_counts={79: 1}), step=200) == (0, "")  # past the window
    # a reset_gpu XID; the driver asks for a reset, then says none: the reset was done
    assert host.check("xid", gpu(xid_counts={79: 1, 48: 1}, fields={"recovery_action": 0}))[0] == 2
    assert host.check("xid", gpu(xid_counts={79: 1, 48: 1}, fields={"recovery_action": 1}))[0] == 2
    assert host.check("xid", gpu(xid_counts={79: 1, 48: 1}, fields={"recovery_action": 0}))[0] == 0
    # lost and back is a reset too
    assert host.check("xid", gpu(xid_counts={79: 1, 48: 2}))[0] == 2
    host.see(replace(gpu(), up=False, error="GpuIsLost"))
    assert host.check("xid", gpu(xid_counts={79: 1, 48: 2})) == (0, "")


def test_repeated_xids_warn_and_ignored_ones_do_not():
    host = Host()
    assert host.check("xid", gpu(xid_counts={13: 2, 43: 9})) == (0, "")
    assert host.check("xid", gpu(xid_counts={13: 3, 43: 20})) == (
        1,
        "XID 13 (restart_app) 3 times in 1d",
    )


def test_unknown_values_give_no_evidence_and_ignored_checks_stay_ok():
    verdict = assess(
        [Snapshot(1, T0, 1.0, 0.01, True, HostInfo("h"), (gpu(temperature_celsius=None),))]
    )
    assert verdict["GPU-0"].level == 0 and [c.name for c in verdict["GPU-0"].checks] == list(CHECKS)
    host = Host(HealthConfig(ignore=frozenset({"memory_repair"})))
    check = host.see(gpu(fields={"row_remap_pending": 1}))["GPU-0"].check("memory_repair")
    assert (check.level, check.reason) == (0, "ignored by config")


def test_verdict_json_matches_the_schema():
    host = Host()
    verdicts = host.see(gpu(fields={"row_remap_pending": 1, "pcie_link_width": 8}), gpu(1))
    from exporter.core.health import health_document

    document = health_document(list(verdicts.values()), T0, source="agent")
    jsonschema.validate(document, SCHEMA)
    sick = document["gpus"][0]
    assert sick["verdict"] == "critical" and sick["level"] == 2
    assert sick["reasons"] == ["memory_repair: row remap pending", "pcie: link x8 of x16"]
    assert document["verdict"] == "critical"


# -- the action ---------------------------------------------------------------------------------


def snapshot_of(seq: int, *gpus: Gpu) -> Snapshot:
    return Snapshot(seq, T0 + seq, float(seq), 0.01, True, HostInfo("h"), gpus)


def test_action_metrics_transitions_and_findings(caplog: pytest.LogCaptureFixture):
    findings = Findings()
    action = HealthAction(HealthConfig(), findings, state_file="")
    assert [f.name for f in action.families()] == ["gpu_exporter_health_transitions"]
    history = [snapshot_of(1, gpu(0), gpu(1))]
    with caplog.at_level(logging.INFO, logger="exporter.actions.health"):
        action.run(history, 1.0)
        history.append(snapshot_of(2, gpu(0, fields={"row_remap_pending": 1}), gpu(1)))
        action.run(history, 2.0)
        action.run(history, 3.0)  # nothing new: nothing logged or counted again
        history.append(snapshot_of(3, gpu(0), gpu(1)))
        action.run(history, 4.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "health: GPU 0 GPU-0: memory_repair ok -> critical: row remap pending",
        "health: GPU 0 GPU-0: memory_repair critical -> ok",
    ]
    found = samples(render_families(action.families()))
    assert [(s.labels, s.value) for s in found["gpu_health"]] == [
        ({"gpu": "0", "uuid": "GPU-0"}, 0.0),
        ({"gpu": "1", "uuid": "GPU-1"}, 0.0),
    ]
    assert len(found["gpu_health_check"]) == 2 * len(CHECKS)  # every check, every GPU
    assert [(s.labels, s.value) for s in found["gpu_exporter_health_transitions_total"]] == [
        ({"check": "memory_repair", "to": "critical"}, 1.0),
        ({"check": "memory_repair", "to": "ok"}, 1.0),
    ]
    published = findings.get(HealthVerdicts)
    assert published is not None and set(published.verdicts) == {"GPU-0", "GPU-1"}
    action.close()
    assert findings.get(HealthVerdicts) is None


def test_action_uses_the_thermal_actions_levels():
    findings = Findings()
    findings.publish(ThermalLevels({"GPU-0": 2}))
    action = HealthAction(HealthConfig(), findings, state_file="")
    action.run([snapshot_of(1, gpu(0, temperature_celsius=50))], 1.0)
    assert action.verdicts()["GPU-0"].check("thermal").level == 2


def render_families(families: list[Any]) -> bytes:
    from exporter.exposition.metrics import render_families as render

    return render(families)


# -- the state file ------------------------------------------------------------------------------


def _agent(state: Path, boot: str, clock: float) -> HealthAction:
    """A health action (an agent starting) with its state file, boot id and wall clock."""
    return HealthAction(
        HealthConfig(xid_window=3600),
        state_file=str(state),
        boot_id=lambda: boot,
        clock=lambda: clock,
    )


def _critical(state: Path, boot: str = "boot-1", clock: float = T0 + 10) -> HealthAction:
    action = _agent(state, boot, clock)
    action.run(
        [snapshot_of(5, gpu(0, xid_counts={79: 1}, xids=(XidEvent(T0 + 5, 79, "reboot"),)))], 5.0
    )
    return action


def _restarted(state: Path, boot: str = "boot-1", clock: float = T0 + 60) -> HealthAction:
    action = _agent(state, boot, clock)
    action.run([snapshot_of(1, gpu(0))], 1.0)  # the new agent's XID counts start at 0
    return action


def test_a_critical_xid_survives_a_restart_within_the_window(tmp_path: Path):
    state = tmp_path / "state" / "health.json"
    assert _critical(state).verdicts()["GPU-0"].check("xid").level == 2
    assert state.stat().st_mode & 0o777 == 0o600 and state.parent.stat().st_mode & 0o777 == 0o700
    restarted = _restarted(state)
    assert restarted.verdicts()["GPU-0"].check("xid").level == 2
    assert _restarted(state, clock=T0 + 5 + 3601).verdicts()["GPU-0"].check("xid").level == 0


def test_a_reboot_or_a_reset_drops_the_state(tmp_path: Path):
    state = tmp_path / "health.json"
    _critical(state)
    assert _restarted(state, boot="boot-2").verdicts()["GPU-0"].check("xid").level == 0
    _critical(state)
    action = _restarted(state)
    action.run(
        [snapshot_of(2, replace(gpu(0), up=False, error="GpuIsLost")), snapshot_of(3, gpu(0))], 3.0
    )
    assert action.verdicts()["GPU-0"].check("xid").level == 0
    assert json.loads(state.read_text())["gpus"] == {}  # the reset is written down too
    assert _restarted(state).verdicts()["GPU-0"].check("xid").level == 0


def test_a_corrupt_state_file_is_refused_with_a_clear_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    state = tmp_path / "health.json"
    state.write_text("{not json")
    with caplog.at_level(logging.ERROR):
        action = _restarted(state)
    assert action.verdicts()["GPU-0"].level == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"health: the state file {state} is not valid JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1)); ignoring it"
    ]
    state.write_text(json.dumps({"version": 7, "gpus": {}}))
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        _restarted(state)
    assert "is not ours (version 7, not 1); ignoring it" in caplog.records[0].getMessage()
    _critical(state)  # a corrupt file is replaced by a good one
    assert json.loads(state.read_text())["version"] == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user")
def test_a_foreign_owned_state_file_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    state = tmp_path / "health.json"
    _critical(state)
    os.chown(state, 65534, 65534)
    with caplog.at_level(logging.ERROR):
        action = _restarted(state)
    assert action.verdicts()["GPU-0"].check("xid").level == 0
    assert "belongs to uid 65534, not to this agent (uid 0); ignoring it" in caplog.text
    link = tmp_path / "link.json"
    link.symlink_to(state)
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        _restarted(link)
    assert "cannot read the state file" in caplog.text  # O_NOFOLLOW: a link is not followed


def test_an_unwritable_state_directory_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.ERROR):
        action = _critical(blocker / "health.json")
        action.run([snapshot_of(6, gpu(0, xid_counts={79: 2}))], 6.0)
        action.run([snapshot_of(7, gpu(0, xid_counts={79: 3}))], 7.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # reading it at start, then writing it: each said once
    assert "is not a directory" in lines[0]
    assert "the verdict will not survive a restart" in lines[1]


# -- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        ("ignore: [pcie, vibes]", "ignore", "unknown check 'vibes'"),
        ("xid_window: -1h", "xid_window", ""),
        ("error_window: 0s", "error_window", "more than 0s"),
        ("nvlink_crc_critical_rate: lots", "nvlink_crc_critical_rate", ""),
        ("remapped_rows_warning: 1.5", "remapped_rows_warning", "whole number"),
        (
            "clocks_warning_share: 0.5\n    clocks_critical_share: 0.2",
            "clocks_critical_share",
            "at least",
        ),
        ("typo_window: 1h", "typo_window", ""),
    ],
)
def test_bad_health_config_names_file_and_line(tmp_path: Path, text: str, key: str, why: str):
    path = write(tmp_path, f"actions:\n  health:\n    {text}\n")
    with pytest.raises(ConfigError) as caught:
        agent_config(path)
    message = str(caught.value)
    assert f"{path}:{line_of(path, key)}" in message and key in message and why in message


def test_good_health_config(tmp_path: Path):
    path = write(
        tmp_path,
        "actions:\n  health:\n    xid_window: 2h\n    xid_repeat: 5\n    ignore: [clocks]\n",
    )
    config = agent_config(path).actions.actions["health"].options
    assert config == HealthConfig(xid_window=7200, xid_repeat=5, ignore=frozenset({"clocks"}))


def test_policy_exclude_unhealthy_values(tmp_path: Path):
    path = write(
        tmp_path,
        "actions:\n  recommend:\n    policies:\n      a: {exclude_unhealthy: warning}\n"
        "      b: {exclude_unhealthy: false}\n      c: {exclude_unhealthy: sometimes}\n",
    )
    with pytest.raises(ConfigError) as caught:
        agent_config(path)
    assert f"{path}:{line_of(path, 'sometimes')}" in str(caught.value)


# -- acting on it ---------------------------------------------------------------------------


def test_recommend_skips_critical_and_optionally_warning_gpus():
    host = Host()
    verdicts = host.see(
        gpu(0, fields={"row_remap_pending": 1}),
        gpu(1, fields={"pcie_link_width": 8}),
        gpu(2),
    )
    gpus = tuple(
        replace(g, memory_free_bytes=2**30, utilization_ratio=0.0, processes=())
        for g in (gpu(0), gpu(1), gpu(2))
    )
    snapshots = [Snapshot(1, T0, 1.0, 0.01, True, HostInfo("h"), gpus)]
    rec = recommend(Policy("d", "least_utilized", count=2), snapshots, health=verdicts)
    assert [c.uuid for c in rec.chosen] == ["GPU-1", "GPU-2"]
    assert rec.rejected == {"GPU-0": "unhealthy: row remap pending"}
    strict = recommend(
        Policy("s", "least_utilized", exclude_unhealthy="warning"), snapshots, health=verdicts
    )
    assert strict.rejected["GPU-1"] == "unhealthy: link x8 of x16"
    anything = recommend(
        Policy("a", "least_utilized", count=3, exclude_unhealthy="off"), snapshots, health=verdicts
    )
    assert anything.ok


SICK = """
gpus:
  - name: NVIDIA H100 80GB HBM3
    memory_total: 80GiB
    fields: {row_remap_pending: 1}
  - name: NVIDIA H100 80GB HBM3
    memory_total: 80GiB
  - name: NVIDIA H100 80GB HBM3
    memory_total: 80GiB
    fields: {pcie_link_width: 8}
"""


def test_the_launcher_takes_a_healthy_gpu_and_says_why_not_the_critical_one(tmp_path: Path):
    from exporter.launcher.api import select_devices
    from exporter.launcher.errors import NoGpusAvailable

    scenario = write(tmp_path, SICK, "sick.yaml")
    locks = tmp_path / "locks"
    locks.mkdir()
    chosen = select_devices(2, simulate=scenario, lock_dir=str(locks))
    assert [d.index for d in chosen] == [1, 2]
    with pytest.raises(NoGpusAvailable) as caught:
        select_devices(3, simulate=scenario, lock_dir=str(locks))
    assert "unhealthy: row remap pending" in str(caught.value)
    chosen = select_devices(3, simulate=scenario, lock_dir=str(locks), exclude_unhealthy=False)
    assert len(chosen) == 3


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_health_command_from_its_own_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    scenario = write(tmp_path, SICK, "sick.yaml")
    code, out, err = run_main(["health", "--simulate", scenario], capsys)
    lines = out.splitlines()
    assert code == 1 and err == ""
    assert lines[0].endswith(": critical: memory_repair: row remap pending")
    assert lines[1].endswith(": ok") and lines[2].endswith(": warning: pcie: link x8 of x16")
    assert lines[0].startswith("GPU 0 GPU-")
    code, out, _ = run_main(["health", "--simulate", scenario, "--gpu", "1,2"], capsys)
    assert code == 0 and len(out.splitlines()) == 2
    code, out, _ = run_main(["health", "--simulate", scenario, "--gpu", "2", "--strict"], capsys)
    assert code == 1
    code, out, _ = run_main(["health", "--simulate", scenario, "--gpu", "1", "--json"], capsys)
    document = json.loads(out)
    jsonschema.validate(document, SCHEMA)
    assert code == 0 and document["source"] == "nvml" and document["verdict"] == "ok"
    assert [g["index"] for g in document["gpus"]] == [1]
    code, out, err = run_main(["health", "--simulate", scenario, "--gpu", "7"], capsys)
    assert code == 2 and out == "" and err == "gpu-exporter health: --gpu: no GPU '7' here\n"


def test_health_command_cannot_decide_without_an_agent_or_a_driver(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = run_main(["health", "--from", url, "--json"], capsys)
    assert code == 2 and err.startswith(f"gpu-exporter health: cannot reach the agent at {url}")
    document = json.loads(out)
    jsonschema.validate(document, SCHEMA)
    assert document["verdict"] == "unknown" and document["gpus"] == [] and document["error"]

    import exporter.cli

    monkeypatch.setattr(exporter.cli, "_sample_once", lambda config: _no_nvml())
    code, out, err = run_main(["health"], capsys)
    assert code == 2 and "NVML is not available" in err and out == ""


def _no_nvml() -> Snapshot:
    return Snapshot(1, T0, 1.0, 0.0, False, HostInfo("h"), nvml_error="DriverNotLoaded")


FATAL = """
gpus:
  - name: NVIDIA H100 80GB HBM3
    memory_total: 80GiB
    xids: [{at: 1s, code: 79}]
  - name: NVIDIA H100 80GB HBM3
    memory_total: 80GiB
"""


def test_the_agent_serves_verdicts_refuses_the_gpu_and_remembers_across_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    scenario = write(tmp_path, FATAL, "fatal.yaml")
    state = tmp_path / "state" / "health.json"
    flags = ["--simulate", scenario, "--interval", "200ms", "--state-file", str(state)]
    with serve(tmp_path, *flags) as (proc, port):
        url = f"http://127.0.0.1:{port}"
        document = until(lambda: critical_of(port), "the XID's critical verdict")
        jsonschema.validate(document, SCHEMA)
        sick = document["gpus"][0]
        assert sick["reasons"][0].startswith("xid: XID 79 (reboot) at ")
        status, body = http_get(f"{url}/recommend?count=2")
        assert status == 409 and "unhealthy: XID 79 (reboot)" in body
        status, body = http_get(f"{url}/recommend")
        assert status == 200 and json.loads(body)["chosen"][0]["index"] == 1
        code, out, _ = run_main(["health", "--from", url], capsys)
        assert (
            code == 1 and out.splitlines()[0].startswith("GPU 0 GPU-") and "critical: xid:" in out
        )
        code, out, _ = run_main(["health", "--from", url, "--gpu", "1"], capsys)
        assert code == 0
        status, body = http_get(f"{url}/health/gpus?gpu=5")
        assert status == 404
        status, body = http_get(f"{url}/health/gpus?colour=red")
        assert status == 400
        status, body = http_get(f"{url}/snapshot")
        assert json.loads(body)["gpus"][0]["health"]["verdict"] == "critical"
        status, metrics = http_get(f"{url}/metrics")
        assert (
            'gpu_health{gpu="0"' in metrics
            and 'gpu_exporter_health_transitions_total{check="xid",to="critical"} 1.0' in metrics
        )
    assert json.loads(state.read_text())["gpus"]  # written for the next agent
    quiet = write(tmp_path, FATAL.replace("    xids: [{at: 1s, code: 79}]\n", ""), "quiet.yaml")
    with serve(
        tmp_path, "--simulate", quiet, "--interval", "200ms", "--state-file", str(state)
    ) as (
        proc,
        port,
    ):
        document = until(lambda: critical_of(port), "the verdict kept across the restart")
        assert document["gpus"][0]["checks"]["xid"]["status"] == "critical"
        assert "critical XID(s) from before the restart are kept" in stderr_of(proc)


def critical_of(port: int) -> Any:
    try:
        status, body = http_get(f"http://127.0.0.1:{port}/health/gpus")
    except OSError:
        return None
    return status == 200 and json.loads(body)["verdict"] == "critical" and json.loads(body)


SWINGS = """
gpus:
  - name: NVIDIA H100 80GB HBM3
    memory_total: 80GiB
    fields:
      pcie_link_width_max: 16
      pcie_link_generation_max: 5
      row_remap_pending: {points: [[0, 0], [10, 0], [10.001, 1], [20, 1], [20.001, 0]]}
      recovery_action: {points: [[0, 0], [30, 0], [30.001, 1], [40, 1], [40.001, 0]]}
      pcie_link_width: {points: [[0, 16], [45, 16], [45.001, 8], [115, 8], [115.001, 16]]}
    ecc:
      enabled: true
      uncorrected: {points: [[0, 0], [130, 0], [130.001, 3], [140, 3], [140.001, 0]]}
    nvlink:
      links: 2
      down: [{link: 1, from: 150s, until: 160s}]
    errors:
      - {error: GpuIsLost, from: 170s, until: 180s}
"""


def test_the_simulated_host_drives_the_checks_both_ways(simulated, collector, clock):
    """Through the real NVML module and the simulated driver: each check goes bad and back."""
    simulated(SWINGS)
    tracker = HealthTracker()
    seen: dict[str, list[int]] = {name: [] for name in CHECKS}
    for _ in range(200):
        clock.advance(1.0)
        tracker.observe(collector.sample())
        (verdict,) = tracker.verdicts().values()
        for check in verdict.checks:
            if not seen[check.name] or seen[check.name][-1] != check.level:
                seen[check.name].append(check.level)
    assert seen["memory_repair"] == [0, 2, 0]
    assert seen["recovery_action"] == [0, 2, 0]
    assert seen["pcie"] == [0, 1, 0]
    assert seen["ecc"] == [0, 2, 0]
    assert seen["nvlink"] == [0, 2, 0]
    assert seen["lost"] == [0, 2, 0]
    assert seen["xid"] == seen["thermal"] == seen["clocks"] == [0]


def test_status_json_carries_the_verdict_of_its_sample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    scenario = write(tmp_path, SICK, "sick.yaml")
    code, out, _ = run_main(["status", "--simulate", scenario, "--json"], capsys)
    verdicts = [gpu["health"]["verdict"] for gpu in json.loads(out)["gpus"]]
    assert code == 0 and verdicts == ["critical", "ok", "warning"]
    code, out, _ = run_main(["status", "--simulate", scenario], capsys)
    assert "CRITICAL remap pending" in out.splitlines()[2]


def test_without_the_health_action_there_is_no_verdict_and_nothing_is_refused_for_health(
    tmp_path: Path,
):
    scenario = write(tmp_path, SICK, "sick.yaml")
    config = write(tmp_path, "actions:\n  health:\n    enabled: false\n")
    with serve(tmp_path, "--simulate", scenario, "--config", config, "--interval", "200ms") as (
        proc,
        port,
    ):
        url = f"http://127.0.0.1:{port}"

        def recommended() -> Any:
            try:
                return http_get(f"{url}/recommend?count=3")
            except OSError:
                return None

        status, body = until(lambda: (r := recommended()) and r[0] == 200 and r, "a choice")
        assert len(json.loads(body)["chosen"]) == 3  # the GPU with a remap pending too
        status, body = http_get(f"{url}/health/gpus")
        assert status == 503 and "the health action is off" in body
        _, metrics = http_get(f"{url}/metrics")
        assert "gpu_health{" not in metrics and "gpu_health_check{" not in metrics
        assert 'gpu_exporter_action_enabled{action="health"} 0.0' in metrics
        _, snapshot = http_get(f"{url}/snapshot")
        assert all(gpu["health"] is None for gpu in json.loads(snapshot)["gpus"])
        assert proc.poll() is None


def test_a_failing_health_run_is_counted_and_the_last_verdict_stays():
    findings = Findings()
    action = HealthAction(HealthConfig(), findings, state_file="")
    action.run([snapshot_of(1, gpu(0, fields={"row_remap_pending": 1}))], 1.0)
    broken = replace(gpu(0), fields=None)  # a Snapshot no sampler makes: the run raises
    with pytest.raises(AttributeError):  # the engine counts it in gpu_exporter_action_failures
        action.run([snapshot_of(2, broken)], 2.0)
    published = findings.get(HealthVerdicts)
    assert published is not None and published.verdicts["GPU-0"].level == 2
