"""The thermal action: levels with hysteresis, outliers, unknown temperatures, config errors."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.actions.thermal import ThermalAction, ThermalConfig, parse_thermal
from exporter.config.yamlconf import ConfigError, Section, parse_document
from exporter.core.snapshot import CLOCK_EVENT_REASONS, Gpu, GpuInfo, HostInfo, Snapshot, frozen_map

T0 = 1.7e9
LOGGER = "test.thermal"


def gpu(
    index: int,
    temp: float | None,
    util: float | None = 0.5,
    reasons: tuple[str, ...] = (),
    slowdown: float | None = None,
    up: bool = True,
) -> Gpu:
    """A GPU in one Snapshot; its uuid is derived from the index."""
    uuid = f"GPU-{index:08d}"
    thresholds = frozen_map({"slowdown": slowdown} if slowdown is not None else None)
    bits = sum(bit for name, bit in CLOCK_EVENT_REASONS if name in reasons)
    return Gpu(
        index=index,
        uuid=uuid,
        up=up,
        info=GpuInfo(index=index, uuid=uuid, temperature_thresholds=thresholds),
        utilization_ratio=util,
        temperature_celsius=temp,
        clock_event_reasons=bits,
    )


def snapshot(seq: int, t: float, *gpus: Gpu) -> Snapshot:
    return Snapshot(
        seq=seq,
        timestamp=T0 + t,
        monotonic=t,
        duration_seconds=0.01,
        nvml_up=True,
        host=HostInfo("host"),
        gpus=gpus,
    )


class Feeder:
    """Feeds one new Snapshot per run, passing the last few again as the engine does."""

    def __init__(self, config: ThermalConfig | None = None, window: int = 4) -> None:
        self.action = ThermalAction(config or ThermalConfig(), logging.getLogger(LOGGER))
        self.history: list[Snapshot] = []
        self.window = window

    def __call__(self, t: float, *gpus: Gpu) -> dict[str, int]:
        self.history.append(snapshot(len(self.history) + 1, t, *gpus))
        self.action.run(self.history[-self.window :], now=T0 + t + 1)
        return self.action.levels()

    def level(self, t: float, temp: float | None, **kwargs) -> int | None:
        """Feed GPU 0 alone; its level afterwards (None when unknown)."""
        return self(t, gpu(0, temp, **kwargs)).get("GPU-00000000")


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def exposed(action: ThermalAction) -> dict[tuple[str, str], float]:
    """(metric name, gpu label) -> value, parsed back from the text exposition."""
    text = generate_latest(_Families(action.families())).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, sample.labels["gpu"])] = sample.value
    return out


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


# -- levels ----------------------------------------------------------------------------------------


def test_warning_after_for_and_not_before():
    feed = Feeder()
    assert feed.action.families() == []
    assert [feed.level(t, 82) for t in (0, 10, 20, 29.9)] == [0, 0, 0, 0]
    assert exposed(feed.action)[("gpu_thermal_hotspot", "0")] == 0
    assert feed.level(30, 82) == 1
    found = exposed(feed.action)
    assert found[("gpu_thermal_hotspot", "0")] == 1
    assert found[("gpu_thermal_outlier", "0")] == 0


def test_a_dip_below_warning_restarts_the_timer():
    feed = Feeder()
    for t in (0, 10, 20):
        feed.level(t, 82)
    assert feed.level(25, 79) == 0
    assert [feed.level(t, 82) for t in (26, 40, 55)] == [0, 0, 0]
    assert feed.level(56, 82) == 1


def test_critical_by_temperature():
    feed = Feeder()
    assert [feed.level(t, 90) for t in (0, 15, 29)] == [0, 0, 0]
    assert feed.level(30, 90) == 2
    assert exposed(feed.action)[("gpu_thermal_hotspot", "0")] == 2


@pytest.mark.parametrize("reason", ["sw_thermal_slowdown", "hw_thermal_slowdown"])
def test_critical_by_a_thermal_reason_held_for(reason):
    feed = Feeder()
    hot = {"reasons": (reason,)}
    assert [feed.level(t, 60, **hot) for t in (0, 10)] == [0, 0]
    assert feed.level(15, 60) == 0  # the reason went away: its timer restarts
    assert [feed.level(t, 60, **hot) for t in (20, 30, 49)] == [0, 0, 0]
    assert feed.level(50, 60, **hot) == 2


def test_other_clock_event_reasons_are_not_thermal():
    feed = Feeder(ThermalConfig(for_seconds=0))
    assert feed.level(0, 60, reasons=("sw_power_cap", "hw_slowdown", "gpu_idle")) == 0


def test_hysteresis_no_flapping_and_clearing_after_for(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    feed = Feeder()  # warning 80, hysteresis 5: clears below 75
    hover = [79, 81, 78, 82, 76, 80, 75, 81]
    # At level 0, hovering around the warning level never stays above it for 30 s.
    assert {feed.level(t * 10, hover[t % len(hover)]) for t in range(20)} == {0}
    for t in range(200, 240, 10):
        feed.level(t, 81)
    assert feed.action.levels() == {"GPU-00000000": 1}
    # At level 1, hovering between 75 and 82 holds the level, for as long as it lasts.
    assert {feed.level(240 + t * 10, hover[t % len(hover)]) for t in range(40)} == {1}
    assert [feed.level(t, 74) for t in (700, 710, 729)] == [1, 1, 1]
    assert feed.level(735, 75) == 1  # not below 75: the clearing timer restarts
    assert [feed.level(t, 74) for t in (740, 760, 769)] == [1, 1, 1]
    assert feed.level(770, 74) == 0
    assert len(records(caplog, logging.WARNING)) == 1
    assert len(records(caplog, logging.INFO)) == 1


def test_critical_to_warning_to_ok(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    feed = Feeder()  # warning 80, critical 85, hysteresis 5
    for t in (0, 30):
        feed.level(t, 90)
    assert feed.action.levels() == {"GPU-00000000": 2}
    # 80 to 85 is above critical - hysteresis: the level holds.
    assert [feed.level(t, 82) for t in (40, 80, 120)] == [2, 2, 2]
    # Below 80 with no thermal reason for 30 s: down to warning, not to ok.
    assert [feed.level(t, 77) for t in (130, 150, 159)] == [2, 2, 2]
    assert feed.level(160, 77) == 1
    assert [feed.level(t, 77) for t in (200, 300)] == [1, 1]
    assert [feed.level(t, 70) for t in (310, 339)] == [1, 1]
    assert feed.level(340, 70) == 0
    transitions = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(transitions) == 3
    assert "ok -> critical" in transitions[0]
    assert "critical -> warning" in transitions[1]
    assert "warning -> ok" in transitions[2]
    assert [r.levelno for r in caplog.records if r.name == LOGGER] == [
        logging.WARNING,
        logging.INFO,
        logging.INFO,
    ]


def test_critical_does_not_clear_while_a_thermal_reason_is_active():
    feed = Feeder()
    for t in (0, 30):
        feed.level(t, 90)
    assert feed.level(40, 77, reasons=("sw_thermal_slowdown",)) == 2
    assert [feed.level(t, 77) for t in (45, 70, 74)] == [2, 2, 2]  # 40 + 30 is not enough
    assert feed.level(75, 77) == 1  # 45 + 30


def test_critical_straight_to_ok_when_cold_enough():
    feed = Feeder()
    for t in (0, 30):
        feed.level(t, 90)
    assert [feed.level(t, 60) for t in (40, 69)] == [2, 2]
    assert feed.level(70, 60) == 0


def test_for_zero_needs_one_snapshot():
    feed = Feeder(ThermalConfig(for_seconds=0))
    assert feed.level(0, 81) == 1
    assert feed.level(1, 86) == 2
    assert feed.level(2, 70) == 0


# -- thresholds ------------------------------------------------------------------------------------


def test_per_gpu_defaults_from_a_low_slowdown_threshold():
    feed = Feeder(ThermalConfig(for_seconds=0))
    low, normal = {"slowdown": 80}, {"slowdown": 89}
    assert feed.action.thresholds(gpu(0, 70, **low)) == (75, 80)
    assert feed.action.thresholds(gpu(0, 70, **normal)) == (80, 85)
    assert feed.action.thresholds(gpu(0, 70)) == (80, 85)
    assert feed(0, gpu(0, 76, **low), gpu(1, 76, **normal), gpu(2, 76)) == {
        "GPU-00000000": 1,
        "GPU-00000001": 0,
        "GPU-00000002": 0,
    }
    assert feed(1, gpu(0, 80, **low), gpu(1, 80, **normal), gpu(2, 80))["GPU-00000000"] == 2


def test_configured_thresholds_win_over_the_gpu_defaults():
    both = ThermalAction(ThermalConfig(warning_celsius=60, critical_celsius=70))
    assert both.thresholds(gpu(0, 50, slowdown=80)) == (60, 70)
    # Only one configured: the defaulted one gives way so that warning <= critical.
    assert ThermalAction(ThermalConfig(warning_celsius=90)).thresholds(gpu(0, 0, slowdown=80)) == (
        90,
        90,
    )
    assert ThermalAction(ThermalConfig(critical_celsius=70)).thresholds(gpu(0, 0)) == (70, 70)
    assert ThermalAction(ThermalConfig(critical_celsius=88)).thresholds(gpu(0, 0)) == (80, 88)


# -- unknown temperatures --------------------------------------------------------------------------


def test_unknown_temperature_has_no_series_and_is_not_ok():
    feed = Feeder(ThermalConfig(for_seconds=0))
    assert feed(0, gpu(0, None), gpu(1, 50)) == {"GPU-00000001": 0}
    found = exposed(feed.action)
    assert ("gpu_thermal_hotspot", "0") not in found
    assert ("gpu_thermal_outlier", "0") not in found
    assert found[("gpu_thermal_hotspot", "1")] == 0


def test_gpu_down_or_missing_has_no_series():
    feed = Feeder(ThermalConfig(for_seconds=0))
    feed(0, gpu(0, 90), gpu(1, 90))
    assert feed.action.levels() == {"GPU-00000000": 2, "GPU-00000001": 2}
    assert feed(1, gpu(0, 90, up=False)) == {}
    assert exposed(feed.action) == {}


def test_unknown_temperature_resets_the_timers(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    feed = Feeder()
    for t in (0, 30):
        feed.level(t, 82)
    assert feed.action.levels() == {"GPU-00000000": 1}
    assert feed.level(40, None) is None
    assert len(records(caplog, logging.INFO)) == 1  # "no longer known", once
    assert feed.level(50, None) is None
    assert len(records(caplog, logging.INFO)) == 1
    # Known again: from level 0, with a fresh timer.
    assert [feed.level(t, 82) for t in (60, 89)] == [0, 0]
    assert feed.level(90, 82) == 1


def test_simulated_gpus_thermal_reason_and_unsupported_temperature(simulated, collector, clock):
    simulated(
        """
        gpus:
          - temperature: 60
            clock_event_reasons: [hw_thermal_slowdown]
          - unsupported: [temperature]
          - temperature: {from: 70, to: 95, over: 100s}
        """
    )
    action = ThermalAction(ThermalConfig())
    history: list[Snapshot] = []
    levels = []
    for _ in range(8):
        history.append(collector.sample())
        action.run(history, now=history[-1].timestamp)
        levels.append(action.levels())
        clock.advance(10)
    assert history[-1].timestamp - history[0].timestamp == 70
    uuids = [g.uuid for g in history[0].gpus]
    assert [lv[uuids[0]] for lv in levels] == [0, 0, 0, 2, 2, 2, 2, 2]
    assert all(uuids[1] not in lv for lv in levels)
    # GPU 2 reaches 80 at 40 s (warning at 70 s) and 85 at 60 s (critical at 90 s).
    assert [lv[uuids[2]] for lv in levels] == [0, 0, 0, 0, 0, 0, 0, 1]
    found = exposed(action)
    assert ("gpu_thermal_hotspot", "1") not in found
    assert found[("gpu_thermal_hotspot", "0")] == 2


# -- outliers --------------------------------------------------------------------------------------


def outliers(action: ThermalAction) -> dict[str, float]:
    return {gpu: v for (name, gpu), v in exposed(action).items() if name == "gpu_thermal_outlier"}


def test_outlier_among_gpus_at_similar_utilization(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    feed = Feeder()
    busy = [gpu(0, 60, util=0.8), gpu(1, 61, util=0.9), gpu(2, 62, util=0.7)]
    for t in (0, 10, 29):
        feed(t, *busy, gpu(3, 73, util=0.8))  # 12 above the median 61
    assert outliers(feed.action) == {"0": 0, "1": 0, "2": 0, "3": 0}
    feed(30, *busy, gpu(3, 73, util=0.8))
    assert outliers(feed.action) == {"0": 0, "1": 0, "2": 0, "3": 1}
    feed(40, *busy, gpu(3, 73, util=0.8))
    feed(50, *busy, gpu(3, 70, util=0.8))  # 9 above: no longer an outlier
    assert outliers(feed.action)["3"] == 0
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 2
    assert "GPU 3 (GPU-00000003) is a thermal outlier: 73 C" in messages[0]
    assert "no longer" in messages[1]


def test_outlier_uses_the_median_and_includes_the_threshold():
    feed = Feeder(ThermalConfig(for_seconds=0))
    peers = [gpu(0, 60, util=0.8), gpu(1, 60, util=0.8), gpu(2, 69, util=0.8)]
    feed(0, *peers, gpu(3, 70, util=0.8))  # median 60 (the mean would be 63)
    assert outliers(feed.action) == {"0": 0, "1": 0, "2": 0, "3": 1}


def test_utilization_band_edge_is_comparable():
    feed = Feeder(ThermalConfig(for_seconds=0))
    feed(0, gpu(0, 60, util=0.6), gpu(1, 60, util=0.6), gpu(2, 60, util=1.0), gpu(3, 72, util=0.8))
    assert outliers(feed.action)["3"] == 1


def test_idle_hot_gpu_is_not_compared_with_busy_ones():
    feed = Feeder(ThermalConfig(for_seconds=0))
    busy = [gpu(i, 60 + i, util=0.9) for i in range(3)]
    feed(0, *busy, gpu(3, 75, util=0.0))
    assert outliers(feed.action) == {"0": 0, "1": 0, "2": 0, "3": 0}
    feed(1, *busy, gpu(3, 75, util=None))
    assert outliers(feed.action)["3"] == 0


def test_too_few_peers_is_not_an_outlier():
    feed = Feeder(ThermalConfig(for_seconds=0))
    feed(0, gpu(0, 60, util=0.8), gpu(1, 80, util=0.8), gpu(2, 40, util=0.0), gpu(3, 40, util=0.0))
    assert outliers(feed.action) == {"0": 0, "1": 0, "2": 0, "3": 0}
    feed(1, gpu(0, 60, util=0.8), gpu(1, 80, util=0.8), gpu(2, 60, util=0.75))
    assert outliers(feed.action)["1"] == 1  # exactly two peers are enough


def test_peers_with_unknown_temperature_do_not_count():
    feed = Feeder(ThermalConfig(for_seconds=0))
    feed(0, gpu(0, 60, util=0.8), gpu(1, None, util=0.8), gpu(2, 80, util=0.8))
    assert outliers(feed.action) == {"0": 0, "2": 0}


# -- runs, logging, Snapshots seen twice -----------------------------------------------------------


def test_a_transition_is_logged_once_across_runs(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    feed = Feeder()
    for t in range(0, 200, 10):
        feed.level(t, 82)
        feed.action.run(feed.history, now=T0 + t + 5)  # extra runs with nothing new
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "GPU 0 (GPU-00000000)" in message and "ok -> warning" in message
    assert "82 C" in message and "warning 80 C" in message and "critical 85 C" in message
    assert records(caplog, logging.INFO) == []


def test_the_same_snapshots_twice_are_not_double_counted(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    feed = Feeder(ThermalConfig(for_seconds=0), window=100)
    for t, temp in enumerate([82, 60, 82, 60]):
        feed.level(t, temp)  # each run sees every Snapshot so far again
    for _ in range(3):
        feed.action.run(feed.history, now=T0 + 10)
    assert feed.action.levels() == {"GPU-00000000": 0}
    assert len(records(caplog, logging.WARNING)) == 2
    assert len(records(caplog, logging.INFO)) == 2


def test_seq_going_backwards_starts_over():
    feed = Feeder()
    for t in (0, 10, 20, 30):
        feed.level(t, 82)
    assert feed.action.levels() == {"GPU-00000000": 1}
    restarted = [snapshot(1, 100, gpu(0, 82)), snapshot(2, 129, gpu(0, 82))]
    feed.action.run(restarted[:1], now=T0 + 100)
    assert feed.action.levels() == {"GPU-00000000": 0}
    feed.action.run(restarted, now=T0 + 129)
    assert feed.action.levels() == {"GPU-00000000": 0}
    feed.action.run([*restarted, snapshot(3, 130, gpu(0, 82))], now=T0 + 130)
    assert feed.action.levels() == {"GPU-00000000": 1}


def test_a_restart_inside_one_batch_starts_over():
    action = ThermalAction(ThermalConfig(for_seconds=0))
    action.run([snapshot(5, 0, gpu(0, 90)), snapshot(6, 1, gpu(0, 90))], now=T0 + 1)
    assert action.levels() == {"GPU-00000000": 2}
    batch = [snapshot(6, 1, gpu(0, 90)), snapshot(1, 2, gpu(1, 50))]
    action.run(batch, now=T0 + 2)
    assert action.levels() == {"GPU-00000001": 0}


# -- config ----------------------------------------------------------------------------------------


def thermal_section(body: str) -> Section:
    text = "actions:\n  thermal:\n" + "".join(f"    {line}\n" for line in body.splitlines())
    return parse_document(text, "c.yaml").root().section("actions").section("thermal")


def test_parse_thermal_reads_every_key():
    config = parse_thermal(
        thermal_section(
            "warning_celsius: 70\ncritical_celsius: 78\nhysteresis_celsius: 3\nfor: 1m30s\n"
            "outlier_celsius: 8\noutlier_utilization_band: 0.1"
        )
    )
    assert config == ThermalConfig(70, 78, 3, 90, 8, 0.1)
    assert parse_thermal(thermal_section("for: 0")).for_seconds == 0
    assert parse_thermal(thermal_section("")) == ThermalConfig()


def test_parse_thermal_leaves_the_engine_keys_alone():
    section = thermal_section("enabled: true\nfor: 10s")
    assert parse_thermal(section).for_seconds == 10
    with pytest.raises(ConfigError, match="enabled"):
        section.done()


@pytest.mark.parametrize(
    ("body", "line", "key"),
    [
        ("warning_celsius: 70\nfor: soon", 4, "actions.thermal.for"),
        ("warning_celsius: 80\ncritical_celsius: 75", 4, "actions.thermal.critical_celsius"),
        ("warning_celsius: hot", 3, "actions.thermal.warning_celsius"),
        ("hysteresis_celsius: -1", 3, "actions.thermal.hysteresis_celsius"),
        ("outlier_utilization_band: 2", 3, "actions.thermal.outlier_utilization_band"),
        ("outlier_celsius: 0", 3, "actions.thermal.outlier_celsius"),
    ],
)
def test_parse_thermal_errors_name_file_line_and_key(body, line, key):
    with pytest.raises(ConfigError) as caught:
        parse_thermal(thermal_section(body))
    assert f"c.yaml:{line}" in str(caught.value)
    assert caught.value.key == key
    assert key in str(caught.value)


def test_for_is_measured_on_the_monotonic_clock_not_the_wall_clock():
    """A wall-clock step (NTP, a resumed VM) between Snapshots never makes ``for`` pass early."""
    action = ThermalAction(ThermalConfig(), logging.getLogger(LOGGER))
    history = []
    for seq, (wall, mono) in enumerate([(0, 0), (3600, 1), (7200, 2)], start=1):
        history.append(
            Snapshot(
                seq=seq,
                timestamp=T0 + wall,  # the wall clock jumps an hour at each sample
                monotonic=mono,
                duration_seconds=0.01,
                nvml_up=True,
                host=HostInfo("host"),
                gpus=(gpu(0, 90.0),),
            )
        )
        action.run(history, now=mono)
    assert action.levels() == {"GPU-00000000": 0}  # hot for 2 s of 30: not yet


@pytest.mark.parametrize(("hot", "outlier"), [(50, 0), (69, 0), (70, 1)])
def test_an_outlier_must_be_hot_itself(hot, outlier):
    """50 C among peers idling at 38 C is no hotspot: outliers need outlier_min_celsius (70)."""
    feed = Feeder(ThermalConfig(for_seconds=0))
    idle = [gpu(0, 38, util=0.0), gpu(1, 38, util=0.0), gpu(2, 39, util=0.0)]
    feed(0, *idle, gpu(3, hot, util=0.0))
    assert outliers(feed.action)["3"] == outlier


def test_outlier_min_celsius_is_a_setting():
    section = parse_document("outlier_min_celsius: 60\n", "c.yaml").root()
    assert parse_thermal(section).outlier_min_celsius == 60
    with pytest.raises(ConfigError, match=r"c\.yaml:1: outlier_min_celsius"):
        parse_thermal(parse_document("outlier_min_celsius: hot\n", "c.yaml").root())
