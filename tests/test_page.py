"""The status page without a browser: its size, headers, escaping and routes
(tests/test_page_browser.py drives it in Chromium)."""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator

import pytest

from exporter.exposition.metrics import render
from exporter.sampling.sampler import Sampler
from exporter.web import page
from exporter.web.routes import App, serve
from tests.agent import healthz_until
from tests.agent import serve as serve_agent
from tests.helpers import until

ACTIONS = ("zombie_reaper", "thermal", "health", "recommend", "waste")

HOSTILE = "<img src=x onerror=alert(1)>"


def big_host(gpus: int = 8, per_gpu: int = 16, spawn: bool = False) -> str:
    """GPUs x processes: real ``sleep`` children with ``spawn``, else PIDs this host does not
    have (as another container's)."""
    lines = ["gpus:"]
    for g in range(gpus):
        lines.append("  - name: NVIDIA H100 80GB HBM3\n    utilization: 0.5\n    processes:")
        for p in range(per_gpu):
            holder = 'spawn: [sleep, "600"]' if spawn else f"pid: {5_000_000 + g * 100 + p}"
            lines.append(f"      - {{{holder}, memory: 1GiB}}")
    return "\n".join(lines) + "\n"


def get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


@pytest.fixture
def agent(simulated, collector) -> Iterator[Callable[[str], int]]:
    servers = []

    def start(scenario: str) -> int:
        simulated(scenario)
        sampler = Sampler(collector, interval=1.0, deadline=1.0, render=render)
        sampler.sample_once()
        servers.append(serve(App(sampler), "127.0.0.1", 0))
        return servers[-1].port

    yield start
    for server in servers:
        server.close()


def test_the_page_and_its_assets_stay_under_60_kb_on_8_gpus_by_16_processes(tmp_path):
    scenario = tmp_path / "big.yaml"
    scenario.write_text(big_host(spawn=True))
    config = tmp_path / "config.yaml"  # every action's finding on the page from the start
    config.write_text("actions:\n" + "".join(f"  {a}: {{every: 100ms}}\n" for a in ACTIONS))
    args = ("--simulate", str(scenario), "--config", str(config), "--interval", "0.2")
    with serve_agent(tmp_path, *args) as (process, port):
        healthz_until(process, port)
        until(lambda: b"dry run" in get(port, "/")[2], "the reaper's first run")
        status, _, body = get(port, "/")
        assets = sum(len(get(port, path)[2]) for path in page.STATIC)
    assert status == 200 and body.count(b"<tr data-uuid=") == 8  # every row is there
    assert body.count(b"<tr data-gpu=") == 8 * 16
    assert b">sleep<" in body and b">yes<" in body  # names, and the recommend action's pick
    assert len(body) + assets <= 60 * 1024, (len(body), assets)


def test_the_page_and_its_assets_allow_only_their_own_origin(agent):
    port = agent(big_host(1, 1))
    for path in ("/", *page.STATIC):
        status, headers, _ = get(port, path)
        assert status == 200, path
        assert headers["Content-Security-Policy"] == page.CONTENT_SECURITY_POLICY, path
        assert headers["X-Content-Type-Options"] == "nosniff"
    body = get(port, "/")[2].decode()
    assert "<script>" not in body and " style=" not in body and "http://" not in body
    assert '<script src="static/page.js" defer></script>' in body


def test_strings_from_processes_are_escaped(tmp_path, agent):
    hostile = tmp_path / HOSTILE  # the process's name comes from the file it runs
    hostile.symlink_to("/bin/sleep")
    port = agent(f'gpus:\n  - processes: [{{spawn: ["{hostile}", "60"], memory: 1GiB}}]\n')
    body = get(port, "/")[2].decode()
    assert "&lt;img src=x onerror=alert(1)&gt;" in body and HOSTILE not in body


def test_before_the_first_sample_the_page_lists_the_routes(simulated, collector):
    simulated(big_host(1, 0))
    server = serve(App(Sampler(collector, interval=1.0, deadline=1.0)), "127.0.0.1", 0)
    try:
        status, headers, body = get(server.port, "/")
        assert status == 503 and b"/metrics" in body and b"/history" in body
        assert headers["Content-Security-Policy"] == page.CONTENT_SECURITY_POLICY
        assert get(server.port, "/peers")[0] == 404  # no peers configured
    finally:
        server.close()


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "-"), (0.0, "0 %"), (0.125, "13 %"), (0.994, "99 %"), (0.995, "100 %")],
)
def test_percentages_round_half_up_as_the_script_does(value, text):
    assert page.pct(value) == text


def test_sizes_round_half_up_as_the_script_does():
    assert page.size(20.25 * 1024**3) == "20.3 GiB"  # Python's format would say 20.2
    assert (page.size(0), page.size(1023), page.size(1536)) == ("0 B", "1023 B", "1.5 KiB")
    assert page.size(None) == "-" and page.size(3 * 1024**4) == "3.0 TiB"
