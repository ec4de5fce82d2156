"""The recommend action: strategies, exclusions, unknown values, windows, config and metrics."""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.actions.recommend import RecommendAction, RecommendConfig, parse_recommend
from exporter.config.policies import policy_with
from exporter.config.yamlconf import ConfigError, parse_document
from exporter.core.findings import Findings, ThermalLevels
from exporter.core.selection import STRATEGIES, Policy, Weights, recommend
from exporter.core.snapshot import Gpu, GpuInfo, GpuProcess, HostInfo, Snapshot

GIB = 1024**3


BUILTIN = Path(__file__).resolve().parent.parent / "exporter" / "scenarios" / "builtin.yaml"


def sample(simulated, collector, scenario: str) -> list[Snapshot]:
    """One Snapshot of a simulated scenario, as the list an action is given."""
    simulated(scenario)
    return [collector.sample()]


def gpu(index: int, **values) -> Gpu:
    """An up GPU with 80GiB, all values known and idle unless given."""
    thresholds = values.pop("thresholds", {"slowdown": 89.0})
    info = GpuInfo(
        index=index,
        uuid=f"GPU-{index}",
        memory_total_bytes=values.pop("total", 80 * GIB),
        temperature_thresholds=thresholds,
    )
    defaults = {
        "memory_free_bytes": 40 * GIB,
        "utilization_ratio": 0.0,
        "temperature_celsius": 40.0,
        "clock_event_reasons": 0,
        "processes": (),
    }
    return Gpu(index=index, uuid=f"GPU-{index}", up=True, info=info, **{**defaults, **values})


def snap(*gpus: Gpu, seq: int = 1) -> Snapshot:
    return Snapshot(
        seq=seq,
        timestamp=1.7e9 + seq,
        monotonic=float(seq),
        duration_seconds=0.01,
        nvml_up=True,
        host=HostInfo("host"),
        gpus=gpus,
    )


def chosen_indexes(rec) -> list[int]:
    return [choice.index for choice in rec.chosen]


def uuid_of(snapshots: list[Snapshot], index: int) -> str:
    return snapshots[-1].gpus[index].uuid


# -- strategies ------------------------------------------------------------------------------------

THREE_GPUS = """
gpus:
  - {memory_used: 60GiB, utilization: 0.2, temperature: 50}
  - {memory_used: 10GiB, utilization: 0.7, temperature: 45}
  - {memory_used: 30GiB, utilization: 0.1, temperature: 60}
  - {memory_used: 40GiB, utilization: 0.5, temperature: 30}
"""


@pytest.mark.parametrize(
    ("strategy", "best"),
    [("most_free_memory", 1), ("least_utilized", 2), ("coolest", 3)],
)
def test_each_strategy_picks_the_right_gpu(simulated, collector, strategy, best):
    snapshots = sample(simulated, collector, THREE_GPUS)
    rec = recommend(Policy("p", strategy=strategy), snapshots)
    assert rec.ok and chosen_indexes(rec) == [best]
    assert len(rec.qualified) == 4 and not rec.rejected
    assert rec.chosen[0].uuid == uuid_of(snapshots, best)


def test_scores_of_the_simple_strategies():
    gpus = snap(gpu(0, memory_free_bytes=5 * GIB, utilization_ratio=0.25, temperature_celsius=61))
    assert recommend(Policy("p", strategy="most_free_memory"), [gpus]).scores["GPU-0"] == 5 * GIB
    assert recommend(Policy("p", strategy="least_utilized"), [gpus]).scores["GPU-0"] == 0.75
    assert recommend(Policy("p", strategy="coolest"), [gpus]).scores["GPU-0"] == -61


def test_weighted_score_formula():
    one = gpu(0, memory_free_bytes=20 * GIB, utilization_ratio=0.5, temperature_celsius=45)
    unknown_limit = gpu(1, utilization_ratio=0.5, temperature_celsius=45, thresholds={})
    weights = Weights(free_memory=2.0, idle=1.0, temperature_headroom=1.0)
    rec = recommend(Policy("p", strategy="weighted", weights=weights), [snap(one, unknown_limit)])
    headroom = (89 - 45) / 89
    assert rec.scores["GPU-0"] == pytest.approx((2 * 0.25 + 0.5 + headroom) / 4)
    headroom_90 = (90 - 45) / 90  # no slowdown threshold: 90 celsius
    assert rec.scores["GPU-1"] == pytest.approx((2 * 0.5 + 0.5 + headroom_90) / 4)


def test_weighted_headroom_is_clamped_and_weights_steer_the_choice():
    roomy_hot = gpu(0, memory_free_bytes=70 * GIB, temperature_celsius=95)
    full_cool = gpu(1, memory_free_bytes=10 * GIB, temperature_celsius=30)
    gpus = [snap(roomy_hot, full_cool)]
    memory_only = Weights(free_memory=1, idle=0, temperature_headroom=0)
    heat_only = Weights(free_memory=0, idle=0, temperature_headroom=1)
    rec = recommend(Policy("p", strategy="weighted", weights=memory_only), gpus)
    assert chosen_indexes(rec) == [0]
    rec = recommend(Policy("p", strategy="weighted", weights=heat_only), gpus)
    assert chosen_indexes(rec) == [1]
    assert rec.scores["GPU-0"] == 0.0  # 95 > 89: headroom clamped at 0, not negative


def test_weighted_needs_only_the_values_of_nonzero_weights():
    no_util = gpu(0, utilization_ratio=None)
    rec = recommend(Policy("p", strategy="weighted"), [snap(no_util)])
    assert not rec.chosen and rec.rejected["GPU-0"] == "cannot score: utilization unknown"
    idle_off = Weights(idle=0)
    rec = recommend(Policy("p", strategy="weighted", weights=idle_off), [snap(no_util)])
    assert chosen_indexes(rec) == [0]


def test_the_sm_active_weight_prefers_idle_sms_and_falls_back_to_utilization():
    from exporter.core.snapshot import Readings

    # busy but inefficient (98 % utilization, 10 % of its SMs) against busy and full
    small_batches = gpu(0, utilization_ratio=0.98, fields=Readings({"sm_active": 0.1}))
    full = gpu(1, utilization_ratio=0.6, fields=Readings({"sm_active": 0.9}))
    no_gpm = gpu(2, utilization_ratio=0.3)  # before Hopper: its utilization stands in
    weights = Weights(free_memory=0, idle=0, sm_active=1)
    rec = recommend(
        Policy("p", strategy="weighted", weights=weights, count=3),
        [snap(small_batches, full, no_gpm)],
    )
    assert rec.scores == pytest.approx({"GPU-0": 0.9, "GPU-1": 0.1, "GPU-2": 0.7})
    assert chosen_indexes(rec) == [0, 2, 1]
    by_idle = recommend(Policy("p", strategy="weighted", count=2), [snap(small_batches, full)])
    assert chosen_indexes(by_idle) == [1, 0]  # utilization alone ranks them the other way


def test_the_sm_active_weight_is_a_policy_key(tmp_path):
    text = "policies:\n  shareable:\n    weights: {free_memory: 0.5, idle: 0, sm_active: 0.5}\n"
    config = parse_recommend(parse_document(text, "c.yaml").root())
    weights = config.policies["shareable"].weights
    assert (weights.free_memory, weights.idle, weights.sm_active) == (0.5, 0, 0.5)


def test_weighted_needs_total_memory():
    no_total = gpu(0, total=None)
    rec = recommend(Policy("p", strategy="weighted"), [snap(no_total)])
    assert not rec.chosen and rec.rejected["GPU-0"] == "cannot score: total memory unknown"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ties_break_by_lowest_index(strategy):
    gpus = snap(gpu(3), gpu(1), gpu(2), gpu(0))  # identical values, listed out of order
    rec = recommend(Policy("p", strategy=strategy, count=3), [gpus])
    assert chosen_indexes(rec) == [0, 1, 2]
    assert [choice.index for choice in rec.qualified] == [0, 1, 2, 3]


# -- unknown values --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("unsupported", "policy", "reason"),
    [
        ("memory", Policy("p", strategy="least_utilized", min_free_memory=GIB), "free memory"),
        ("utilization", Policy("p", max_utilization=0.9), "utilization"),
        ("temperature", Policy("p", max_temperature=80), "temperature"),
    ],
)
def test_unknown_value_fails_its_filter(simulated, collector, unsupported, policy, reason):
    # GPU 0 would win on every other count: most free memory, idle, cool.
    snapshots = sample(
        simulated,
        collector,
        f"""
        gpus:
          - {{unsupported: [{unsupported}]}}
          - {{memory_used: 10GiB, utilization: 0.5, temperature: 50}}
        """,
    )
    rec = recommend(policy, snapshots)
    assert chosen_indexes(rec) == [1]
    assert rec.rejected[uuid_of(snapshots, 0)] == f"{reason} unknown"
    assert [choice.index for choice in rec.qualified] == [1]


@pytest.mark.parametrize(
    ("field", "strategy", "what"),
    [
        ("memory_free_bytes", "most_free_memory", "free memory"),
        ("utilization_ratio", "least_utilized", "utilization"),
        ("temperature_celsius", "coolest", "temperature"),
    ],
)
def test_unknown_value_a_strategy_needs_is_never_recommended(field, strategy, what):
    gpus = snap(gpu(0, **{field: None}), gpu(1, memory_free_bytes=GIB, utilization_ratio=0.9))
    rec = recommend(Policy("p", strategy=strategy), [gpus])
    assert chosen_indexes(rec) == [1]
    assert rec.rejected["GPU-0"] == f"cannot score: {what} unknown"
    assert "GPU-0" not in rec.scores


def test_unknown_value_is_named_once_when_filter_and_strategy_both_need_it():
    policy = Policy("p", strategy="least_utilized", max_utilization=0.5)
    rec = recommend(policy, [snap(gpu(0, utilization_ratio=None))])
    assert rec.rejected == {"GPU-0": "utilization unknown"}


def test_unknown_in_every_snapshot_of_the_window_is_unknown():
    history = [snap(gpu(0, utilization_ratio=None), seq=n) for n in range(3)]
    rec = recommend(Policy("p", max_utilization=1.0, window=3), history)
    assert not rec.chosen and rec.rejected["GPU-0"] == "utilization unknown"


def test_a_value_known_only_before_the_window_is_unknown():
    history = [snap(gpu(0, utilization_ratio=0.0), seq=1), snap(gpu(0, utilization_ratio=None))]
    assert recommend(Policy("p", max_utilization=1.0, window=1), history).rejected
    assert recommend(Policy("p", max_utilization=1.0, window=2), history).ok


# -- exclusions ------------------------------------------------------------------------------------


def test_down_gpu_is_excluded(simulated, collector, clock):
    simulated(
        """
        gpus:
          - {memory_used: 0, errors: [{error: GpuIsLost, from: 1s}]}
          - {memory_used: 20GiB}
        """
    )
    history = [collector.sample()]
    clock.advance(1)
    history.append(collector.sample())
    assert not history[-1].gpus[0].up and history[-1].gpus[0].uuid
    rec = recommend(Policy("p", window=2), history)  # up with the most free memory before
    assert chosen_indexes(rec) == [1]
    assert rec.rejected[uuid_of(history, 0)] == "down"
    assert uuid_of(history, 0) not in rec.scores


def test_gpu_missing_from_the_latest_snapshot_is_not_considered():
    history = [
        snap(gpu(0), gpu(1, memory_free_bytes=GIB), seq=1),
        snap(gpu(1, memory_free_bytes=GIB)),
    ]
    rec = recommend(Policy("p", window=2), history)
    assert chosen_indexes(rec) == [1] and "GPU-0" not in rec.rejected


@pytest.mark.parametrize("reason", ["sw_thermal_slowdown", "hw_thermal_slowdown"])
def test_thermally_throttling_gpu_is_excluded(simulated, collector, reason):
    snapshots = sample(
        simulated,
        collector,
        f"""
        gpus:
          - {{clock_event_reasons: [{reason}]}}
          - {{memory_used: 20GiB, clock_event_reasons: [sw_power_cap, gpu_idle]}}
        """,
    )
    rec = recommend(Policy("p"), snapshots)
    assert chosen_indexes(rec) == [1]  # other clock-event reasons do not exclude
    assert rec.rejected[uuid_of(snapshots, 0)] == "thermal throttling"


def test_locked_gpu_is_excluded(simulated, collector):
    snapshots = sample(simulated, collector, "gpus: [{}, {memory_used: 20GiB}]")
    locked = {uuid_of(snapshots, 0)}
    rec = recommend(Policy("p"), snapshots, locked=locked)
    assert chosen_indexes(rec) == [1]
    assert rec.rejected[uuid_of(snapshots, 0)] == "reserved by a launcher lock"
    assert chosen_indexes(recommend(Policy("p"), snapshots)) == [0]


def test_hotspot_is_excluded_unless_the_policy_allows_it():
    gpus = [snap(gpu(0), gpu(1, memory_free_bytes=GIB), gpu(2, memory_free_bytes=0))]
    hotspots = {"GPU-0": 2, "GPU-1": 0}
    rec = recommend(Policy("p", count=2), gpus, hotspots=hotspots)
    assert chosen_indexes(rec) == [1, 2]
    assert rec.rejected == {"GPU-0": "thermal hotspot level 2"}
    allowed = recommend(Policy("p", exclude_hotspots=False), gpus, hotspots=hotspots)
    assert chosen_indexes(allowed) == [0]


def test_exclusive_wants_no_processes_and_unknown_processes_fail(simulated, collector):
    snapshots = sample(
        simulated,
        collector,
        """
        gpus:
          - {processes: [{pid: self, memory: 1GiB}]}
          - {unsupported: [processes]}
          - {memory_used: 30GiB}
        """,
    )
    rec = recommend(Policy("p", exclusive=True), snapshots)
    assert chosen_indexes(rec) == [2]
    assert rec.rejected[uuid_of(snapshots, 0)] == "not exclusive: 1 process on it"
    assert rec.rejected[uuid_of(snapshots, 1)] == "processes unknown"
    assert chosen_indexes(recommend(Policy("p"), snapshots)) == [1]


def test_exclusive_counts_processes_by_pid():
    procs = tuple(
        GpuProcess(pid, kind, GIB, True)
        for pid, kind in ((7, "compute"), (7, "graphics"), (9, "compute"))
    )
    rec = recommend(Policy("p", exclusive=True), [snap(gpu(0, processes=procs))])
    assert rec.rejected == {"GPU-0": "not exclusive: 2 processes on it"}


def test_filters_on_known_values_with_reasons():
    gpus = snap(
        gpu(0, memory_free_bytes=2 * GIB),
        gpu(1, utilization_ratio=0.9),
        gpu(2, temperature_celsius=85),
        gpu(3, memory_free_bytes=8 * GIB, utilization_ratio=0.5, temperature_celsius=80),
    )
    policy = Policy("p", min_free_memory=8 * GIB, max_utilization=0.5, max_temperature=80)
    rec = recommend(policy, [gpus])
    assert chosen_indexes(rec) == [3]  # the limits themselves pass
    assert rec.rejected == {
        "GPU-0": "free memory 2.0GiB below 8.0GiB",
        "GPU-1": "utilization 90% above 50%",
        "GPU-2": "temperature 85 °C above 80 °C",
    }


def test_every_reason_is_listed_on_one_line():
    hot = gpu(0, clock_event_reasons=0x20, utilization_ratio=0.9)
    rec = recommend(Policy("p", max_utilization=0.5), [snap(hot)], locked={"GPU-0"})
    assert rec.rejected["GPU-0"] == (
        "thermal throttling; reserved by a launcher lock; utilization 90% above 50%"
    )


# -- count and window -----------------------------------------------------------------------------


def test_count_two_picks_the_best_two(simulated, collector):
    snapshots = sample(simulated, collector, THREE_GPUS)
    rec = recommend(Policy("p", strategy="most_free_memory", count=2), snapshots)
    assert rec.ok and chosen_indexes(rec) == [1, 2]  # 70GiB and 50GiB free
    assert rec.chosen[0].score > rec.chosen[1].score


def test_too_few_qualifying_gpus_means_none_chosen(simulated, collector):
    snapshots = sample(simulated, collector, THREE_GPUS)
    rec = recommend(Policy("p", count=3, max_utilization=0.3), snapshots)
    assert rec.chosen == () and not rec.ok
    assert [choice.index for choice in rec.qualified] == [2, 0]
    assert set(rec.rejected) == {uuid_of(snapshots, 1), uuid_of(snapshots, 3)}


def test_window_steadily_idle_beats_momentarily_idle(simulated, collector, clock):
    simulated(
        """
        gpus:
          - {utilization: {from: 0.9, to: 0, start: 1500ms}}
          - {utilization: 0.1}
        """
    )
    history = []
    for _ in range(3):
        history.append(collector.sample())
        clock.advance(1)
    assert history[-1].gpus[0].utilization_ratio == 0 and history[0].gpus[0].utilization_ratio
    latest_only = recommend(Policy("p", strategy="least_utilized"), history)
    assert chosen_indexes(latest_only) == [0]
    windowed = recommend(Policy("p", strategy="least_utilized", window=3), history)
    assert chosen_indexes(windowed) == [1]
    assert windowed.scores[uuid_of(history, 0)] == pytest.approx(1 - 0.6)
    filtered = recommend(Policy("p", max_utilization=0.5, window=3), history)
    assert chosen_indexes(filtered) == [1]


def test_window_skips_snapshots_where_the_gpu_was_down():
    down = replace(gpu(0, utilization_ratio=1.0), up=False)  # a down GPU's values never count
    history = [
        snap(gpu(0, utilization_ratio=0.2), seq=1),
        snap(down, seq=2),
        snap(gpu(0, utilization_ratio=0.4), seq=3),
    ]
    rec = recommend(Policy("p", strategy="least_utilized", window=3), history)
    assert rec.scores["GPU-0"] == pytest.approx(1 - 0.3)


def test_no_snapshots_or_no_gpus_chooses_nothing():
    assert recommend(Policy("p"), []).chosen == ()
    nvml_down = Snapshot(1, 0.0, 0.0, 0.0, nvml_up=False, host=HostInfo("h"))
    rec = recommend(Policy("p"), [nvml_down])
    assert not rec.ok and rec.to_dict()["chosen"] == []


def test_to_dict_is_json_ready():
    gpus = snap(gpu(0, memory_free_bytes=GIB), gpu(1), gpu(2, utilization_ratio=None))
    rec = recommend(Policy("fit", strategy="least_utilized"), [gpus], locked={"GPU-0"})
    out = json.loads(json.dumps(rec.to_dict()))
    assert out == {
        "policy": "fit",
        "count": 1,
        "ok": True,
        "chosen": [{"index": 1, "uuid": "GPU-1", "score": 1.0}],
        "qualified": [{"index": 1, "uuid": "GPU-1", "score": 1.0}],
        "rejected": [
            {"index": 0, "uuid": "GPU-0", "reason": "reserved by a launcher lock"},
            {"index": 2, "uuid": "GPU-2", "reason": "cannot score: utilization unknown"},
        ],
    }


# -- config ----------------------------------------------------------------------------------------


def section(text: str):
    return parse_document(textwrap.dedent(text), "c.yaml").root().section("recommend")


def test_default_policy_exists_without_config():
    assert RecommendConfig().policies == {"default": Policy("default")}
    config = parse_recommend(section("recommend: {enabled: true, every: 30s, cron: '* * * * *'}"))
    assert config.policies == {"default": Policy("default")}
    action = RecommendAction(config)
    action.run([snap(gpu(0))], now=0.0)
    assert chosen_indexes(action.latest()["default"]) == [0]


def test_parse_recommend_reads_every_setting():
    config = parse_recommend(
        section(
            """
            recommend:
              every: 1m
              policies:
                default: {strategy: coolest}
                training:
                  strategy: weighted
                  count: 4
                  min_free_memory: 8GiB
                  max_utilization: 0.2
                  max_temperature: 75
                  exclude_hotspots: false
                  exclusive: true
                  window: 12
                  weights: {free_memory: 2, idle: 0.5, temperature_headroom: 0}
            """
        )
    )
    assert config.policies["default"] == Policy("default", strategy="coolest")
    assert config.policies["training"] == Policy(
        "training",
        strategy="weighted",
        count=4,
        min_free_memory=8 * GIB,
        max_utilization=0.2,
        max_temperature=75.0,
        exclude_hotspots=False,
        exclusive=True,
        window=12,
        weights=Weights(free_memory=2.0, idle=0.5, temperature_headroom=0.0),
    )


@pytest.mark.parametrize(
    ("policy", "line", "key", "needle"),
    [
        ("strategy: biggest", 4, "p.strategy", "must be one of most_free_memory"),
        ("count: 0", 4, "p.count", "must be from 1 to 64"),
        ("count: 65", 4, "p.count", "must be from 1 to 64"),
        ("window: 0", 4, "p.window", "must be from 1 to 1000"),
        ("min_free_memory: 8 gigs", 4, "p.min_free_memory", "unknown size unit"),
        ("max_utilization: 50", 4, "p.max_utilization", "from 0 to 1"),
        ("max_temperature: hot", 4, "p.max_temperature", "expected a number"),
        ("exclusive: 'yes'", 4, "p.exclusive", "expected true or false"),
        ("stratgy: coolest", 4, "p.stratgy", "unknown key"),
        ("weights: {idle: -1}", 4, "p.weights.idle", "must be 0 or more"),
        ("weights: {heat: 1}", 4, "p.weights.heat", "unknown key"),
        (
            "weights: {free_memory: 0, idle: 0, temperature_headroom: 0}",
            4,
            "p.weights",
            "at least one weight",
        ),
    ],
)
def test_parse_recommend_errors_name_file_line_and_key(policy, line, key, needle):
    text = f"recommend:\n  policies:\n    p:\n      {policy}\n"
    with pytest.raises(ConfigError) as failed:
        parse_recommend(section(text))
    assert failed.value.where == f"c.yaml:{line}"
    assert failed.value.key == f"recommend.policies.{key}"
    assert needle in failed.value.why, failed.value.why


@pytest.mark.parametrize(
    ("text", "key", "needle"),
    [
        ("recommend:\n  policies:\n    p: 3\n", "recommend.policies.p", "must be a mapping"),
        ("recommend:\n  policies:\n    p:\n", "recommend.policies.p", "must be a mapping"),
        ("recommend:\n  policies:\n    '': {}\n", "recommend.policies.", "non-empty string"),
        ("recommend:\n  policies: [a]\n", "recommend.policies", "must be a mapping"),
    ],
)
def test_parse_recommend_rejects_bad_policies(text, key, needle):
    with pytest.raises(ConfigError) as failed:
        parse_recommend(section(text))
    assert failed.value.where.startswith("c.yaml:") and failed.value.key == key
    assert needle in failed.value.why


# -- overrides -----------------------------------------------------------------------------------


def test_policy_with_overrides():
    base = Policy("training", window=5, exclusive=True)
    changed = policy_with(
        base,
        {
            "count": "2",
            "min_free_memory": "8GiB",
            "max_utilization": "0.25",
            "max_temperature": "70.5",
            "strategy": "coolest",
        },
    )
    assert changed == Policy(
        "training",
        strategy="coolest",
        count=2,
        min_free_memory=8 * GIB,
        max_utilization=0.25,
        max_temperature=70.5,
        window=5,
        exclusive=True,
    )
    assert policy_with(base, {}) == base


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"count": "0"}, "count: must be from 1 to 64"),
        ({"count": "two"}, "count: expected a whole number"),
        ({"count": "1.5"}, "count: expected a whole number"),
        ({"count": "٣"}, "count: expected a whole number"),
        ({"min_free_memory": "lots"}, "min_free_memory: expected a size"),
        ({"max_utilization": "1.5"}, "max_utilization: must be from 0 to 1"),
        ({"max_utilization": "nan"}, "max_utilization: expected a number"),
        ({"max_utilization": "150%"}, "max_utilization: must be from 0% to 100%"),
        (
            {"max_utilization": "50"},
            "max_utilization: must be from 0 to 1, got '50' (did you mean 50%?)",
        ),
        ({"exclusive": "maybe"}, "exclusive: expected true or false"),
        ({"max_temperature": "warm"}, "max_temperature: expected a number"),
        ({"max_temperature": "999"}, "max_temperature: must be a temperature"),
        ({"strategy": "fastest"}, "strategy: must be one of"),
        ({"colour": "red"}, "unknown parameter 'colour'"),
    ],
)
def test_policy_with_errors_name_the_parameter(params, needle):
    with pytest.raises(ValueError) as failed:
        policy_with(Policy("p"), params)
    message = str(failed.value)
    assert message.startswith(needle) and "\n" not in message, message


# -- the action and its metrics --------------------------------------------------------------------


def samples_of(families) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in families:
        for s in family.samples:
            key = tuple(sorted(s.labels.items()))
            out.setdefault(s.name, {})[key] = s.value
    return out


def labels(**values: str) -> tuple:
    return tuple(sorted(values.items()))


def test_action_metrics(simulated, collector):
    snapshots = sample(simulated, collector, THREE_GPUS)
    most_free = "most_free_memory"
    config = RecommendConfig(
        {
            "pair": Policy("pair", strategy=most_free, count=2),
            "cool": Policy("cool", strategy=most_free, count=5),
        }
    )
    action = RecommendAction(config, locked=lambda: {uuid_of(snapshots, 2)})
    assert action.families() == [] and action.latest() == {}
    action.run(snapshots, now=1.7e9)
    assert set(action.latest()) == {"default", "pair", "cool"}
    found = samples_of(action.families())
    recommended = found["gpu_recommended"]
    uuids = [uuid_of(snapshots, i) for i in range(4)]
    assert len(recommended) == 3 * 4
    for index, uuid in enumerate(uuids):
        wanted = 1.0 if index in (1, 3) else 0.0  # 2 is locked: 1 and 3 have the most free next
        assert recommended[labels(gpu=str(index), uuid=uuid, policy="pair")] == wanted
        assert recommended[labels(gpu=str(index), uuid=uuid, policy="cool")] == 0.0
        default = recommended[labels(gpu=str(index), uuid=uuid, policy="default")]
        assert default == (1.0 if index == 1 else 0.0)
    score = found["gpu_recommendation_score"]
    assert (
        score[labels(gpu="1", uuid=uuids[1], policy="pair")]
        == snapshots[0].gpus[1].memory_free_bytes
    )
    devices = found["gpu_recommended_devices"]
    assert devices == {
        labels(policy="default"): 1.0,
        labels(policy="pair"): 2.0,
        labels(policy="cool"): 0.0,  # asks for 5: too few qualify
    }


def test_action_metrics_when_nothing_qualifies_and_scores_unknown():
    gpus = snap(gpu(0, utilization_ratio=None), Gpu(index=1, uuid="GPU-1", up=False))
    findings = Findings()
    findings.publish(ThermalLevels({"GPU-0": 1}))  # as the thermal action does
    action = RecommendAction(
        RecommendConfig({"default": Policy("default", strategy="least_utilized")}), findings
    )
    action.run([gpus], now=0.0)
    found = samples_of(action.families())
    assert found["gpu_recommended_devices"] == {labels(policy="default"): 0.0}
    assert set(found["gpu_recommended"].values()) == {0.0} and len(found["gpu_recommended"]) == 2
    assert "gpu_recommendation_score" not in found  # neither GPU could be scored
    assert action.latest()["default"].rejected == {
        "GPU-0": "thermal hotspot level 1; cannot score: utilization unknown",
        "GPU-1": "down",
    }


def test_the_default_policy_prefers_the_idle_gpu_as_the_seeds_teach(simulated, collector):
    """On the built-in scenario: the idle 40 GB A100 over the 80 GB H100 another user keeps
    30 % busy with 20 GiB (the one with the most free bytes)."""
    with open(BUILTIN) as handle:
        snapshots = sample(simulated, collector, handle.read())
    rec = recommend(Policy("default"), snapshots)
    by_free = max(
        (g for g in snapshots[-1].gpus if not g.thermal_throttling() and g.index != 0),
        key=lambda g: g.memory_free_bytes or 0,
    )
    assert by_free.index == 1  # the H100 has the most free bytes
    assert [g.info.name for g in snapshots[-1].gpus if g.index == chosen_indexes(rec)[0]] == [
        "NVIDIA A100-SXM4-40GB"
    ]


def test_gpus_with_zombie_holders_are_left_out_unless_asked(simulated, collector):
    snapshots = sample(simulated, collector, THREE_GPUS)
    best = recommend(Policy("p"), snapshots).chosen[0].uuid
    zombies = {best: "1 orphan"}
    rec = recommend(Policy("p"), snapshots, zombies=zombies)
    assert best not in {c.uuid for c in rec.chosen}
    assert rec.rejected[best] == "zombie holders: 1 orphan"
    kept = recommend(
        policy_with(Policy("p"), {"exclude_zombies": "false"}), snapshots, zombies=zombies
    )
    assert kept.chosen[0].uuid == best
