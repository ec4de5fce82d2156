"""The soak's CI version: the real agent, processes churning every sample, thousands of scrapes.

``bench/soak.py --quick`` runs the agent for 600 samples at 20 ms with 5,000 scrapes and reads
it from outside. Asserted here: what does not depend on the machine's speed (every scrape
answered 200, no series left behind for ended processes, descriptors and threads the same
after warm-up as at the end, RSS growth bounded, no process left). Timing is not asserted.
The soak's own checks are tested on made-up answers too, so that a check that could never
fail would be noticed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script, pids_running

REPO = Path(__file__).resolve().parent.parent
SOAK = REPO / "bench" / "soak.py"

pytestmark = pytest.mark.slow


def _soak_processes() -> set[int]:
    """PIDs of processes that look like the soak's real processes (``sleep 604800``)."""
    return pids_running(b"sleep\x00604800\x00")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    """One quick soak for the module: (the finished process, its JSON figures)."""
    before = _soak_processes()
    report = tmp_path_factory.mktemp("soak") / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SOAK), "--quick", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert report.exists(), done.stdout + done.stderr
    figures = json.loads(report.read_text())
    figures["left_running"] = sorted(_soak_processes() - before)
    return done, figures


def test_quick_soak_meets_every_goal(quick):
    done, figures = quick
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert figures["missed"] == []
    assert "RSS growth after warm-up" in done.stdout and "MISSED" not in done.stdout


def test_every_scrape_is_answered_200(quick):
    _, f = quick
    assert f["failures"] == 0, f["failure_examples"]
    assert f["scrapes"] >= 5000 and f["samples"] >= 600


def test_processes_churned_and_no_series_is_left_behind(quick):
    _, f = quick
    gpus = f["options"]["gpus"]
    # churn happened: far more PIDs came and went than can be listed at once
    assert f["invisible_pids_seen"] > 10 * gpus and f["visible_pids_seen"] > 10 * gpus
    assert f["last_invisible_pid_per_sample"] > 300  # a new invisible PID per interval
    # never more per-process series than the scenario lists at one time
    assert f["max_process_series"] <= f["series_limit"] == 4 * gpus
    assert f["over_limit"] == 0 and f["monitored"] > 0
    # at the end, /metrics has exactly the processes /snapshot lists, as the scenario says
    assert f["final_extra_in_metrics"] == [] and f["final_missing_from_metrics"] == []
    assert f["final_shape_errors"] == []
    assert f["final_metrics_pids"] == 4 * gpus


def test_descriptors_threads_and_children_stay_constant(quick):
    _, f = quick
    warm, end = f["checkpoints"][f["warmup_index"]], f["checkpoints"][-1]
    assert warm["samples"] >= 120  # the agent's history is full before the baseline
    assert (warm["fds"], warm["threads"]) == (end["fds"], end["threads"])
    # the kept procfs descriptors follow the listed processes: 2 a process, never piling up
    kept = [c["procfs_fds"] for c in f["checkpoints"][f["warmup_index"] :]]
    assert 2 * 2 * f["options"]["gpus"] <= max(kept) <= 2 * 3 * f["options"]["gpus"], kept
    assert end["children"] == 2 * f["options"]["gpus"]
    assert all(c["defunct"] == 0 for c in f["checkpoints"])  # ended ones are reaped at once


def test_rss_growth_after_warm_up_is_bounded(quick):
    _, f = quick
    assert f["rss_growth_mb"] < 2.0, [c["rss_mb"] for c in f["checkpoints"]]


def test_the_agent_stops_cleanly_and_leaves_no_process(quick):
    _, f = quick
    assert f["exit_code"] == 0 and f["left_after_stop"] == 0
    assert f["left_running"] == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpus", "0"], "--gpus: 0 is less than 1"),
        (["--interval", "5ms"], "--interval: '5ms' is not from 10ms to 10s"),
        (["--interval", "soon"], "--interval"),
        (["--samples", "50"], "--samples: 50 is less than 140"),
        (["--warmup", "1.5"], "--warmup: 1.5 is not from 0 to below 1"),
    ],
)
def test_bad_options_exit_2_with_a_message(args, needle):
    done = subprocess.run(
        [sys.executable, str(SOAK), *args], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr and "Traceback" not in done.stderr, done.stderr


def _soak_module():
    return load_script(SOAK)


class _Answers:
    """Stands in for the soak's clients: fixed /metrics and /snapshot answers."""

    def __init__(self, metrics: bytes, snapshot: dict) -> None:
        self.answers = {"/metrics": metrics, "/snapshot": json.dumps(snapshot).encode()}

    def get(self, path: str = "/metrics") -> bytes:
        return self.answers[path]


def _one_gpu(pids: list[int], extra_series: list[int]) -> tuple[bytes, dict]:
    agent = 4242
    lines = [b"gpu_exporter_last_sample_timestamp_seconds 1.7e+09"]
    for pid in [*pids, *extra_series]:
        lines.append(
            f'gpu_process_memory_used_bytes{{gpu="0",uuid="GPU-x",pid="{pid}",user="u",'
            f'process="sleep",type="compute"}} 1.0'.encode()
        )
    processes = [{"pid": pid, "ppid": agent, "name": "sleep"} for pid in pids]
    return b"\n".join(lines) + b"\n", {
        "timestamp": 1.7e9,
        "gpus": [{"index": 0, "processes": processes}],
    }


def test_the_final_check_finds_series_left_behind_and_a_wrong_shape():
    soak = _soak_module()
    options = soak.Options(1, 600, 5000, 0.02, 1, 1, 0.4, 1, 2.0, 60.0)
    base = soak.INVISIBLE_BASE
    listed = [101, 102, base + 7, base + soak.INVISIBLE_STRIDE // 2 + 1]

    def check(pids, extra=()):
        outcome = soak.Outcome(options)
        soak.final_checks(outcome, _Answers(*_one_gpu(pids, list(extra))), 4242)
        return outcome

    good = check(listed)
    assert (good.final_extra_in_metrics, good.final_shape_errors) == ([], [])
    assert good.last_invisible_pid_per_sample == 7
    stale = check(listed, extra=[base + 6])  # the PID before, still exported
    assert stale.final_extra_in_metrics == [f"gpu 0 pid {base + 6}"]
    assert stale.final_shape_errors  # two PIDs of one churning entry
    assert check(listed[:3]).final_shape_errors  # the five-interval entry is missing


def test_a_descriptor_more_at_the_end_is_a_missed_goal():
    soak = _soak_module()
    options = soak.Options(1, 600, 5000, 0.02, 1, 1, 0.4, 1, 2.0, 60.0)
    point = dict(samples=300, scrapes=3000, rss_mb=40.0, threads=7, fds=8, procfs_fds=4)
    point.update(children=2, defunct=0, cpu_s=1.0)
    outcome = soak.Outcome(options, warmup_index=1, exit_code=0, action_runs={"thermal": [9, 0]})
    outcome.checkpoints = [
        soak.Checkpoint(at_s=1, **{**point, "samples": 2}),
        soak.Checkpoint(at_s=6, **point),
        soak.Checkpoint(at_s=9, **{**point, "samples": 600, "rss_mb": 40.5}),
    ]
    verdicts = {name: met for name, _, _, met in soak.rows(outcome)}
    assert verdicts["open fds, warm-up -> end"] is True
    assert verdicts["RSS growth after warm-up, max (MB)"] is True
    assert verdicts["kept procfs fds of GPU processes, most after warm-up"] is True
    outcome.checkpoints[-1].fds = 9
    outcome.checkpoints[-1].procfs_fds = 7  # 6 at most for one GPU: kept ones piling up
    outcome.checkpoints[-1].rss_mb = 42.5
    verdicts = {name: met for name, _, _, met in soak.rows(outcome)}
    assert verdicts["open fds, warm-up -> end"] is False
    assert verdicts["RSS growth after warm-up, max (MB)"] is False
    assert verdicts["kept procfs fds of GPU processes, most after warm-up"] is False
