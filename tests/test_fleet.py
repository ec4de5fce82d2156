"""``recommend --prometheus``: the best host and GPUs of a fleet, through Prometheus.

The first part runs the real CLI against a fake Prometheus (canned ``/api/v1/query`` answers
by query text, on loopback): ranking, count per host, ``--spread``, fresh hosts only, the flags
that keep a GPU out, exit 75, bad input, the number of queries, and a fleet of 1,000 hosts.
The last test is end to end: a real Prometheus scraping three simulated agents on 127.0.0.1,
.2 and .3, with docs/fleet.md's fleet questions asked of it.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from exporter.core.selection import Policy
from exporter.launcher import fleet
from tests.agent import clean_env, exporter_cli, free_port, http_get, running, stop
from tests.helpers import until
from tests.kubelet import fake_kubelet

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024**3
#: The evaluation time of the fake's answers.
NOW = 1_700_000_000.0
NO_GPUS = 75  # exporter/launcher/errors.py: EXIT_NO_GPUS
DEFAULT = Policy("default")


# -- a fake Prometheus --------------------------------------------------------------------------


@dataclass
class FakeGpu:
    """One GPU's series: gauges, and flags as (metric, labels, value)."""

    uuid: str
    used: float = 0.0  # GiB
    utilization: float = 0.0
    temperature: float = 40.0
    up: int = 1
    processes: int | None = None
    flags: Sequence[tuple[str, dict[str, str], float]] = ()
    #: What avg_over_time answers, by metric (the gauge's value where not given).
    averaged: dict[str, float] = field(default_factory=dict)

    def gauges(self) -> dict[str, float]:
        if not self.up:
            return {"gpu_up": 0.0}
        out = {
            "gpu_up": 1.0,
            "gpu_memory_total_bytes": 80.0 * GiB,
            "gpu_memory_free_bytes": (80.0 - self.used) * GiB,
            "gpu_utilization_ratio": self.utilization,
            "gpu_temperature_celsius": self.temperature,
        }
        if self.processes is not None:
            out["gpu_processes"] = float(self.processes)
        return out


@dataclass
class FakeHost:
    instance: str
    gpus: Sequence[FakeGpu]
    up: bool = True
    stale: bool = False


def _series(labels: dict[str, str], value: float) -> dict:
    return {"metric": labels, "value": [NOW, repr(value)]}


def _vector(result: list[dict]) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


def answers(hosts: Sequence[FakeHost], policy: Policy, matchers: str = "") -> dict[str, bytes]:
    """What Prometheus answers to each query of ``fleet.queries``. Only ``fresh`` keeps to the
    fresh hosts: the others answer for every host, as when a host went stale between the first
    query and the others, so the client must keep to the fresh ones itself."""
    asked = fleet.queries(policy, matchers)
    wanted = re.search(r'__name__=~"([^"]+)"', asked["gauges"]).group(1).split("|")
    fresh = [_series({"instance": h.instance}, 1) for h in hosts if h.up and not h.stale]
    gauges, flags, averaged = [], [], {name: [] for name in asked if name.startswith("gpu_")}
    for host in hosts:
        for index, gpu in enumerate(host.gpus):
            ids = {"instance": host.instance, "gpu": str(index), "uuid": gpu.uuid}
            values = gpu.gauges()
            for name, value in values.items():
                if name in wanted:
                    gauges.append(_series({"__name__": name, **ids}, value))
                if name in averaged:
                    averaged[name].append(_series(ids, gpu.averaged.get(name, value)))
            for name, labels, value in gpu.flags:
                flags.append(_series({"__name__": name, **ids, **labels}, value))
    out = {asked["fresh"]: fresh, asked["gauges"]: gauges, asked["flags"]: flags}
    out.update({asked[name]: series for name, series in averaged.items()})
    return {query: _vector(result).encode() for query, result in out.items()}


def _bad_data(error: str) -> bytes:
    return json.dumps({"status": "error", "errorType": "bad_data", "error": error}).encode()


class FakePrometheus:
    """``/api/v1/query`` on loopback: the canned ``answers`` by query text (any other query is
    Prometheus' 400 bad_data), or ``reply`` (status, body) to every query. ``asked`` holds the
    parameters of each query received."""

    def __init__(self) -> None:
        self.answers: dict[str, bytes] = {}
        self.reply: tuple[int, bytes] | None = None
        self.asked: list[dict[str, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                params = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
                fake.asked.append(params)
                status, body = fake.reply or (200, fake.answers.get(params.get("query", "")))
                if url.path != "/api/v1/query":
                    status, body = 404, b"404 page not found\n"
                elif body is None:
                    status, body = 400, _bad_data(f"unknown query {params.get('query')!r}")
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def serve(self, hosts: Sequence[FakeHost], policy: Policy = DEFAULT, matchers: str = ""):
        self.answers = answers(hosts, policy, matchers)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    yield fake
    fake.close()


def recommend(prometheus: FakePrometheus, *args: str) -> subprocess.CompletedProcess[str]:
    return exporter_cli("recommend", "--prometheus", prometheus.url, *args)


def lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout.splitlines()


def uuid(host: str, index: int) -> str:
    return f"GPU-{host}0000000-0000-4000-8000-00000000000{index}"


def gpus(host: str, *specs: dict) -> list[FakeGpu]:
    return [FakeGpu(uuid(host, i), **spec) for i, spec in enumerate(specs)]


# -- choosing -----------------------------------------------------------------------------------


def test_the_best_host_by_the_policy_and_its_flags(prometheus):
    # weighted (0.7 free share + 0.3 idleness): a 0.5, b 0.8825, c 0.7375
    prometheus.serve(
        [
            FakeHost("a:9402", gpus("a", {"used": 40, "utilization": 0.5})),
            FakeHost("b:9402", gpus("b", {"used": 10, "utilization": 0.1})),
            FakeHost("c:9402", gpus("c", {"used": 30, "utilization": 0.0, "temperature": 30})),
        ]
    )
    assert lines(recommend(prometheus)) == [f"b:9402 {uuid('b', 0)}"]
    assert lines(recommend(prometheus, "--strategy", "least_utilized")) == [
        f"c:9402 {uuid('c', 0)}"
    ]
    assert lines(recommend(prometheus, "--strategy", "coolest")) == [f"c:9402 {uuid('c', 0)}"]
    assert lines(recommend(prometheus, "--max-utilization", "5%")) == [f"c:9402 {uuid('c', 0)}"]
    done = json.loads("\n".join(lines(recommend(prometheus, "--format", "json"))))
    assert done["ok"] and done["count"] == 1 and done["spread"] is False
    assert done["chosen"] == [
        {"instance": "b:9402", "index": 0, "uuid": uuid("b", 0), "score": pytest.approx(0.8825)}
    ]
    assert [h["instance"] for h in done["hosts"]] == ["b:9402", "c:9402", "a:9402"]  # best first
    assert done["hosts"][2]["qualified"][0]["score"] == pytest.approx(0.5)


def test_count_is_per_host_unless_spread(prometheus):
    idle, busy, half = {}, {"used": 72, "utilization": 0.9}, {"used": 20, "utilization": 0.2}
    prometheus.serve(
        [
            FakeHost("a:9402", gpus("a", idle, busy)),  # 1.0 + 0.1
            FakeHost("b:9402", gpus("b", half, half)),  # 0.765 + 0.765: the best pair
            FakeHost("c:9402", gpus("c", idle)),  # 1.0, but one GPU
        ]
    )
    assert lines(recommend(prometheus, "--count", "2")) == [
        f"b:9402 {uuid('b', 0)}",
        f"b:9402 {uuid('b', 1)}",
    ]
    assert lines(recommend(prometheus)) == [f"a:9402 {uuid('a', 0)}"]  # a tie: lowest instance
    assert lines(recommend(prometheus, "--count", "3", "--spread")) == [
        f"a:9402 {uuid('a', 0)}",
        f"c:9402 {uuid('c', 0)}",
        f"b:9402 {uuid('b', 0)}",
    ]


def test_stale_and_down_targets_are_never_chosen(prometheus):
    best = {"used": 0}
    hosts = [
        FakeHost("a:9402", gpus("a", best), stale=True),  # up, but its sample is old
        FakeHost("b:9402", gpus("b", best), up=False),
        FakeHost("c:9402", gpus("c", {"used": 60, "utilization": 0.7}, {"up": 0})),
    ]
    prometheus.serve(hosts)
    done = json.loads("\n".join(lines(recommend(prometheus, "--format", "json"))))
    assert [pick["instance"] for pick in done["chosen"]] == ["c:9402"]
    assert [h["instance"] for h in done["hosts"]] == ["c:9402"]
    assert done["hosts"][0]["rejected"] == [{"index": 1, "uuid": uuid("c", 1), "reason": "down"}]

    prometheus.serve([*hosts[:2], FakeHost("c:9402", gpus("c", best), stale=True)])
    done = recommend(prometheus)
    assert (done.returncode, done.stdout) == (NO_GPUS, "")
    assert done.stderr == (
        f"gpu-exporter: no fresh agent in Prometheus {prometheus.url}: no target has up == 1 "
        "and gpu_exporter_snapshot_stale == 0\n"
    )


@pytest.mark.parametrize(
    ("flag", "reason"),
    [
        (("gpu_reserved", {}, 1), "reserved by a launcher lock"),
        (("gpu_clock_event_active", {"reason": "hw_thermal_slowdown"}, 1), "thermal throttling"),
        (("gpu_thermal_hotspot", {}, 2), "thermal hotspot level 2"),
        (("gpu_zombie_processes", {"class": "orphan"}, 1), "zombie holders: 1 orphan"),
        (("gpu_health_check", {"check": "memory_repair"}, 2), "unhealthy: memory_repair"),
    ],
    ids=lambda v: v[0] if isinstance(v, tuple) else "",
)
def test_a_flagged_gpu_is_left_out(prometheus, flag, reason):
    prometheus.serve(
        [
            FakeHost("a:9402", gpus("a", {"flags": [flag]})),
            FakeHost("b:9402", gpus("b", {"used": 50, "utilization": 0.5})),
        ]
    )
    done = json.loads("\n".join(lines(recommend(prometheus, "--format", "json"))))
    assert [pick["instance"] for pick in done["chosen"]] == ["b:9402"]
    rejected = {h["instance"]: h["rejected"] for h in done["hosts"]}["a:9402"]
    assert rejected == [{"index": 0, "uuid": uuid("a", 0), "reason": reason}]


def test_health_warnings_count_as_the_policy_says(prometheus):
    warning = ("gpu_health_check", {"check": "pcie"}, 1)
    prometheus.serve(
        [
            FakeHost("a:9402", gpus("a", {"flags": [warning]})),
            FakeHost("b:9402", gpus("b", {"used": 50})),
        ]
    )
    assert lines(recommend(prometheus))[0].startswith("a:9402 ")  # critical only, by default
    assert lines(recommend(prometheus, "--exclude-unhealthy", "warning"))[0].startswith("b:9402")


def test_exclusive_counts_the_processes_the_agent_lists(prometheus):
    policy = Policy("default", exclusive=True)
    prometheus.serve(
        [
            FakeHost("a:9402", gpus("a", {"processes": 2}, {})),  # the second: processes unknown
            FakeHost("b:9402", gpus("b", {"used": 50, "processes": 0})),
        ],
        policy,
    )
    done = json.loads("\n".join(lines(recommend(prometheus, "--exclusive", "--format", "json"))))
    assert [pick["instance"] for pick in done["chosen"]] == ["b:9402"]
    rejected = {h["instance"]: h["rejected"] for h in done["hosts"]}["a:9402"]
    assert [r["reason"] for r in rejected] == [
        "not exclusive: 2 processes on it",
        "processes unknown",
    ]


def test_a_window_ranks_on_the_averages(prometheus, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("actions:\n  recommend:\n    policies:\n      steady: {window: 4}\n")
    averaged = {"gpu_utilization_ratio": 1.0, "gpu_memory_free_bytes": 10.0 * GiB}
    prometheus.serve(
        [
            FakeHost("a:9402", gpus("a", {"averaged": averaged})),  # idle now, busy before
            FakeHost("b:9402", gpus("b", {"used": 20, "utilization": 0.3})),
        ],
        Policy("steady", window=4),
    )
    done = recommend(prometheus, "--config", str(config), "--policy", "steady")
    assert lines(done) == [f"b:9402 {uuid('b', 0)}"]
    ranged = [q["query"] for q in prometheus.asked if "avg_over_time" in q["query"]]
    assert len(ranged) == 3 and all("[60s]" in q for q in ranged)  # 4 scrapes of 15 s


def test_too_few_is_exit_75_with_nothing_on_stdout(prometheus):
    reserved = {"flags": [("gpu_reserved", {}, 1)]}
    prometheus.serve(
        [
            FakeHost("a:9402", gpus("a", {}, reserved)),
            FakeHost("b:9402", gpus("b", {"used": 70}, {"used": 75})),
        ]
    )
    done = recommend(prometheus, "--count", "2", "--min-free-memory", "20GiB")
    assert (done.returncode, done.stdout) == (NO_GPUS, "")
    assert done.stderr.splitlines() == [
        f"gpu-exporter: none of 2 host(s) has 2 GPU(s) that qualify in Prometheus "
        f"{prometheus.url} (policy 'default', strategy weighted)",
        "  a:9402: 1 of 2 GPU(s) qualify",
        f"    GPU 1 ({uuid('a', 1)}): reserved by a launcher lock",
        "  b:9402: 0 of 2 GPU(s) qualify",
        f"    GPU 0 ({uuid('b', 0)}): free memory 10.0GiB below 20.0GiB",
        f"    GPU 1 ({uuid('b', 1)}): free memory 5.0GiB below 20.0GiB",
    ]
    done = recommend(prometheus, "--count", "2", "--spread", "--min-free-memory", "20GiB")
    assert (done.returncode, done.stdout) == (NO_GPUS, "")
    assert done.stderr.splitlines()[0].startswith(
        "gpu-exporter: 1 of the 2 GPU(s) asked for qualify on 2 host(s)"
    )


# -- few queries --------------------------------------------------------------------------------


@pytest.mark.parametrize("hosts", [3, 60])
def test_the_same_few_queries_whatever_the_fleet_size(prometheus, hosts):
    prometheus.serve([FakeHost(f"h{n:03}:9402", gpus(f"{n:03}", {}, {})) for n in range(hosts)])
    lines(recommend(prometheus))
    assert len(prometheus.asked) == 3
    first, *rest = prometheus.asked
    assert "time" not in first  # Prometheus' now; the others at the instant it answered
    assert [float(q["time"]) for q in rest] == [NOW, NOW]
    assert not any("gpu_process_" in q["query"] for q in prometheus.asked)


def test_the_selector_is_in_every_query(prometheus):
    matchers = 'cluster="a",zone=~"eu-.*"'
    prometheus.serve([FakeHost("a:9402", gpus("a", {}))], matchers=matchers)
    assert lines(recommend(prometheus, "--selector", "{" + matchers + ",}")) == [
        f"a:9402 {uuid('a', 0)}"
    ]
    for asked in prometheus.asked:
        assert asked["query"].count(matchers) == asked["query"].count("{")


def test_the_docs_show_the_queries_that_are_asked():
    text = (ROOT / "docs" / "fleet.md").read_text()
    section = text.split("\n## The queries\n", 1)[1].split("\n## ", 1)[0]
    shown = re.findall(r"```promql\n(.*?)```", section, re.S)

    def flat(query: str) -> str:
        return re.sub(r"\s+\)", ")", re.sub(r"\(\s+", "(", " ".join(query.split())))

    asked = fleet.queries(DEFAULT, 'cluster="a"')
    assert [flat(q) for q in shown] == [flat(q) for q in asked.values()]


def test_a_thousand_hosts_are_ranked_with_the_same_few_queries(prometheus):
    """Correct at fleet size; how fast is measured by bench/scale.py (docs/scale.md), not
    asserted here."""
    hosts = [
        FakeHost(
            f"gpu-node-{n:04}.example.com:9402",
            [
                FakeGpu(
                    f"GPU-{n:08x}-{i:04x}-4000-8000-000000000000",
                    used=(n * 7 + i * 13) % 80,
                    utilization=((n + i) % 10) / 10,
                    flags=[("gpu_reserved", {}, 1)] if (n + i) % 5 == 0 else (),
                )
                for i in range(8)
            ],
        )
        for n in range(1000)
    ]
    prometheus.serve(hosts)
    source = fleet.Prometheus(prometheus.url)
    choice = fleet.recommend_fleet(source, Policy("default", count=4))
    assert choice.ok and len(choice.hosts) == 1000
    assert len({c.instance for c in choice.chosen}) == 1  # count per host


# -- bad input ----------------------------------------------------------------------------------

_REFUSED = _bad_data('invalid parameter "query": 1:50: parse error: error parsing regexp')
_UNAVAILABLE = json.dumps(
    {"status": "error", "errorType": "unavailable", "error": "TSDB not ready"}
).encode()


@pytest.mark.parametrize(
    ("reply", "args", "code", "says"),
    [
        (None, ["--prometheus", "http://127.0.0.1:{port}"], 1, "cannot reach Prometheus at"),
        ((500, b"<html>\n<b>Internal\nServer Error</b>\n</html>"), [], 1, "HTTP 500: <html>"),
        ((503, _UNAVAILABLE), [], 1, "HTTP 503: unavailable: TSDB not ready"),
        ((200, b"<html>not JSON</html>"), [], 1, "not an answer of Prometheus' query API"),
        ((200, b'{"status": "success"}'), [], 1, "not an answer of Prometheus' query API"),
        ((400, _REFUSED), ["--selector", '{cluster=~"("}'], 2, '--selector {cluster=~"("}: '),
        ((400, _REFUSED), [], 1, "HTTP 400: bad_data: invalid parameter"),
        (None, ["--prometheus", "prometheus:9090"], 2, "--prometheus: expected an http://"),
        (None, ["--prometheus", "http://[::1:9090"], 2, "--prometheus: expected an http://"),
        (None, ["--selector", "cluster=a"], 2, "--selector: expected label matchers in braces"),
        (None, ["--selector", "{cluster=a}"], 2, "--selector: no label matcher at 'cluster=a'"),
        (None, ["--selector", '{__name__="up"}'], 2, "--selector: it selects targets"),
        (None, ["--from", "http://127.0.0.1:9"], 2, "--prometheus: not with --from"),
        (None, ["--mig"], 2, "--mig: not with --prometheus"),
        (None, ["--format", "env"], 2, "--format: with --prometheus, uuid or json"),
        (None, ["--count", "0"], 2, "--count: "),
    ],
    ids=lambda v: str(v)[:30],
)
def test_bad_input_is_one_line_and_an_exit_code(prometheus, reply, args, code, says):
    prometheus.reply = reply
    argv = ["--prometheus", prometheus.url] if "--prometheus" not in args else []
    argv += [arg.replace("{port}", str(free_port())) for arg in args]
    done = exporter_cli("recommend", *argv)
    assert (done.returncode, done.stdout) == (code, ""), done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("gpu-exporter: ") and says in done.stderr, done.stderr


@pytest.mark.parametrize("flag", [["--spread"], ["--selector", '{cluster="a"}']])
def test_fleet_flags_need_prometheus(flag):
    done = exporter_cli("recommend", "--simulate", *flag)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"gpu-exporter: {flag[0]}: only with --prometheus URL\n"


# -- end to end ---------------------------------------------------------------------------------

PROMETHEUS = shutil.which("prometheus")
#: Scenario time (seconds since each agent started) at which host A gets busy.
BUSY_AT = 8


def _scenario(host: str, gpu: str) -> str:
    """Two GPUs of ``host`` (UUIDs of its own), each with the YAML of ``gpu``."""
    return "gpus:\n" + "".join(f"  - {{uuid: {uuid(host, i)}, {gpu}}}\n" for i in range(2))


#: A is best (C looks better, but its sampler hangs after a second: stale) until BUSY_AT; then
#: B is. Weighted scores: A 0.972, then 0.083; B 0.731; C 0.996.
SCENARIOS = {
    "a": _scenario(
        "a",
        f"memory_used: {{points: [[0s, 2GiB], [{BUSY_AT}s, 2GiB], [{BUSY_AT}.5s, 70GiB]]}}, "
        f"utilization: {{points: [[0s, 0.02], [{BUSY_AT}s, 0.02], [{BUSY_AT}.5s, 1.0]]}}",
    ),
    "b": _scenario("b", "memory_used: 20GiB, utilization: 0.3"),
    "c": _scenario("c", "errors: [{field: '*', hang: 60s, from: 1s}]"),
}
ADDRESSES = {"a": "127.0.0.1", "b": "127.0.0.2", "c": "127.0.0.3"}
PODS = {
    "a": [("team-a", "train", "main", "nvidia.com/gpu", [uuid("a", 0), uuid("a", 1)])],
    "b": [("team-b", "serve", "main", "nvidia.com/gpu", [uuid("b", 0)])],
}


@contextlib.contextmanager
def _agent(tmp_path: Path, name: str, instance: str, *flags: str) -> Iterator[subprocess.Popen]:
    """``serve`` of host ``name``, listening on ``instance`` (its own loopback address)."""
    scenario, locks = tmp_path / f"{name}.yaml", tmp_path / f"{name}-locks"
    scenario.write_text(SCENARIOS[name])
    locks.mkdir()
    argv = [sys.executable, "-m", "exporter", "serve", "--simulate", str(scenario)]
    argv += ["--listen", instance, "--interval", "0.5", "--lock-dir", str(locks), *flags]
    with (tmp_path / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=clean_env(TMPDIR=str(tmp_path)),
        )  # fmt: skip
        try:
            yield proc
        finally:
            stop(proc, 3)


@contextlib.contextmanager
def _prometheus(tmp_path: Path, targets: Sequence[str]) -> Iterator[str]:
    """A real Prometheus scraping ``targets`` every second (label cluster="a"): its URL, once
    it has discovered them (Prometheus hands new targets to its scrapers after about 5 s: the
    agents start after that, so that their scenarios' time is spent being scraped)."""
    port = free_port()
    quoted = ", ".join(f"'{target}'" for target in targets)
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: gpu-exporter\n"
        f"    static_configs: [{{targets: [{quoted}], labels: {{cluster: a}}}}]\n"
    )
    argv = [
        PROMETHEUS,
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'prom-data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with running(argv, tmp_path / "prometheus.log"):
        url = f"http://127.0.0.1:{port}"
        until(lambda: _answers(f"{url}/-/ready", ready=True), "Prometheus ready")
        until(lambda: len(_active_targets(url)) == len(targets), "the targets discovered")
        yield url


def _active_targets(url: str) -> list[dict]:
    status, body = http_get(f"{url}/api/v1/targets?state=active")
    return json.loads(body)["data"]["activeTargets"] if status == 200 else []


def _answers(url: str, ready: bool = False) -> bool:
    """Whether ``url`` answers at all (with 200, when ``ready``)."""
    try:
        status, _ = http_get(url)
    except OSError:
        return False
    return status == 200 or not ready


def _query(port: int, expr: str) -> dict[str, float]:
    """instance (or namespace) -> value of each series ``expr`` evaluates to now."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, body = http_get(url)
    assert status == 200, body
    result = json.loads(body)["data"]["result"]
    return {
        (s["metric"].get("instance") or s["metric"].get("namespace", "")): float(s["value"][1])
        for s in result
    }


def _fleet_questions() -> dict[str, str]:
    """docs/fleet.md's fleet questions: heading -> its query."""
    text = (ROOT / "docs" / "fleet.md").read_text().split("\n## Fleet questions\n", 1)[1]
    found = re.findall(r"\n### (.+?)\n.*?```promql\n(.*?)```", text, re.S)
    return dict(found)


@pytest.mark.slow
@pytest.mark.skipif(not PROMETHEUS, reason="needs Debian's prometheus (test.sh installs it)")
def test_fleet_against_real_prometheus(tmp_path):
    instances = {name: f"{address}:{free_port()}" for name, address in ADDRESSES.items()}
    a, b, c = instances.values()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(_prometheus(tmp_path, [a, b, c]))
        port = int(url.rsplit(":", 1)[1])
        agents = {}
        for name, instance in instances.items():
            flags = []
            if name in PODS:
                (tmp_path / name).mkdir()
                kubelet = stack.enter_context(fake_kubelet(tmp_path / name, PODS[name]))
                flags = ["--kubelet-socket", kubelet.path]
            agents[name] = stack.enter_context(_agent(tmp_path, name, instance, *flags))

        def best(*args: str) -> list[str]:
            done = exporter_cli(
                "recommend", "--prometheus", url, "--selector", '{cluster="a"}', *args
            )
            assert "Traceback" not in done.stderr
            return [line.split()[0] for line in done.stdout.splitlines()]

        # A is the answer once Prometheus has all three: C, which would be best, is stale
        until(lambda: _query(port, "up") == {a: 1, b: 1, c: 1}, "three agents scraped")
        until(lambda: _query(port, "gpu_exporter_snapshot_stale") == {a: 0, b: 0, c: 1}, "C stale")
        assert _query(port, f'max by (instance) (gpu_memory_free_bytes{{instance="{c}"}})')
        until(lambda: best() == [a], "A recommended")
        assert best("--count", "3", "--spread") == [a, a, b]
        _ask_the_fleet_questions(port, a, b)

        # A gets busy: B is the answer
        until(lambda: best() == [b], "B recommended once A is busy", timeout=BUSY_AT + 10)

        # B stops: skipped from the scrape that fails on, never recommended
        stop(agents["b"], 3)
        until(lambda: _query(port, "up")[b] == 0, "B down in Prometheus")
        assert best() == [a]
        assert best("--count", "3", "--spread") == []

        refused = exporter_cli("recommend", "--prometheus", url, "--selector", '{cluster=~"("}')
        assert refused.returncode == 2 and refused.stdout == "", refused.stderr
        assert len(refused.stderr.splitlines()) == 1 and "bad_data" in refused.stderr


def _ask_the_fleet_questions(port: int, a: str, b: str) -> None:
    """docs/fleet.md's questions, asked of the e2e Prometheus while A is idle."""
    questions = _fleet_questions()
    assert set(questions) == {
        "Which node has a free 80 GB GPU",
        "GPU memory by namespace",
        "Idle GPU-hours by team",
    }
    # A's GPUs have 77.5 GiB free; B's 59.5 GiB; C's 79.5 GiB, but C is stale
    assert _query(port, questions["Which node has a free 80 GB GPU"]) == {a: 2}

    allocated = "|".join([uuid("a", 0), uuid("a", 1), uuid("b", 0)])
    used = _query(port, f'sum by (instance) (gpu_memory_used_bytes{{uuid=~"{allocated}"}})')
    by_namespace = until(
        lambda: (
            (found := _query(port, questions["GPU memory by namespace"])).keys()
            == {"team-a", "team-b"}
            and found
        ),
        "memory by namespace",
    )
    assert by_namespace == {"team-a": used[a], "team-b": used[b]}

    # the last minute, a step a second: hours = idle steps / 3600
    idle = questions["Idle GPU-hours by team"].replace("[1d:1m]", "[1m:1s]")
    idle = idle.replace(") / 60", ") / 3600")
    hours = until(
        lambda: (found := _query(port, idle)).get("team-a", 0) > 0 and found, "idle hours"
    )
    assert hours.keys() == {"team-a", "team-b"} and hours["team-b"] == 0
