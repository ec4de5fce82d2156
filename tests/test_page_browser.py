"""The status page in a real browser: Debian's headless Chromium driven by selenium through
chromium-driver (test.sh installs both), against agents on simulated hosts.

Each case saves a screenshot next to its temporary files (``page-*.png`` under the test's
tmp_path). What it checks: the page shows what /snapshot holds; it updates by itself; a hostile
process name is text and runs nothing; no request leaves the agent's origin; the tables are there
with JavaScript off; a peer that is down shows as down.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.web import page
from tests.agent import free_port, healthz_until, http_get, serve, stderr_of
from tests.helpers import until

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    pytest.skip(
        "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
        allow_module_level=True,
    )
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import UnexpectedAlertPresentException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

HOSTILE = "<img src=x onerror=alert(1)>"
#: Values that stay put: the page and /snapshot can be compared cell by cell.
STEADY = """\
driver: {{call_latency: 0s}}
gpus:
  - name: NVIDIA H100 80GB HBM3
    memory_total: 80GiB
    utilization: 0.42
    temperature: 61
    power: 350
    processes:
      - {{spawn: [{hostile}, "600"], memory: 3GiB, sm_utilization: 0.3}}
  - name: NVIDIA A100-SXM4-40GB
    memory_total: 40GiB
    utilization: 0.0
    temperature: 35
    power: 60
    processes:
      - {{spawn: [sleep, "600"], memory: 1GiB, from: {later}}}
"""


@contextlib.contextmanager
def browser(tmp_path: Path, javascript: bool = True) -> Iterator[Any]:
    """Headless Chromium, its performance log on (every request it makes)."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",  # root in CI: Chromium's sandbox needs a user namespace it may not get
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / f'chromium-{time.monotonic_ns()}'}",
    ):
        options.add_argument(flag)
    if not javascript:
        options.add_experimental_option(
            "prefs", {"profile.managed_default_content_settings.javascript": 2}
        )
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    service = webdriver.ChromeService(
        executable_path=DRIVER, log_output=str(tmp_path / "chromedriver.log")
    )
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def redrawn(driver: Any) -> bool:
    """Whether the page's script has redrawn it from /snapshot at least once."""
    return driver.find_element(By.TAG_NAME, "body").get_attribute("data-js") == "1"


def requested_urls(driver: Any, origin: str) -> list[str]:
    """Every URL the browser asked for (DevTools' Network events) from a page of ``origin``,
    and every one over the network (http, https, ws, wss) from any page: not the browser's own
    new tab it starts with (``chrome://``, its inline images)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            url = message["params"]["request"]["url"]
            ours = message["params"].get("documentURL", "").startswith(origin)
            if ours or url.split(":", 1)[0] in ("http", "https", "ws", "wss"):
                urls.append(url)
    return urls


def snapshot(port: int) -> dict[str, Any]:
    status, body = http_get(f"http://127.0.0.1:{port}/snapshot")
    assert status == 200, body
    return json.loads(body)


#: The rows of a table, read in one go: the page's script redraws them every interval, and
#: elements found one by one go stale in between.
_READ_ROWS = """
const table = document.getElementById(arguments[0]);
const named = [...table.querySelectorAll("thead th")].map((th) => th.dataset.field);
const out = {};
for (const row of table.querySelectorAll(`tbody tr[${arguments[1]}]`)) {
  let key = row.getAttribute(arguments[1]);
  if (row.dataset.pid) key += "/" + row.dataset.pid;
  out[key] = {};
  [...row.children].forEach((cell, i) => {
    const field = cell.dataset.field || named[i];
    if (field) out[key][field] = cell.innerText.split(/\\s+/).join(" ").trim();
  });
}
return out;
"""


def cells(driver: Any, table: str, key: str = "data-uuid") -> dict[str, dict[str, str]]:
    """Each row of ``table`` by its ``key`` attribute (``uuid``; ``gpu/pid`` for processes) ->
    field (the cell's own ``data-field``, else its column header's) -> the cell's text."""
    return driver.execute_script(_READ_ROWS, table, key)


def expected_gpu_cells(doc: dict[str, Any]) -> dict[str, dict[str, str]]:
    """What the GPU table must say, from /snapshot, by the page's own formatting rules."""
    out = {}
    for gpu in doc["gpus"]:
        info = gpu["info"]
        level = f" {page.LEVELS[gpu['thermal']['level']]}" if gpu.get("thermal") else ""
        out[gpu["uuid"]] = {
            "utilization": page.pct(gpu["utilization_ratio"]),
            "memory": f"{page.size(gpu['memory_used_bytes'])} / "
            f"{page.size(info['memory_total_bytes'])}",
            "temperature": page.number(gpu["temperature_celsius"], " °C") + level,
            "power": f"{page.number(gpu['power_watts'], '')} / "
            f"{page.number(info['power_limit_watts'], ' W')}",
            "lock": "free" if gpu["reserved_by"] is None else f"PID {gpu['reserved_by']}",
            "recommended": {None: "-", True: "yes", False: "no"}[gpu.get("recommended")],
        }
    return out


def subset(shown: dict[str, dict[str, str]], wanted: dict[str, dict[str, str]]) -> bool:
    return shown.keys() == wanted.keys() and all(
        {k: shown[u].get(k) for k in wanted[u]} == wanted[u] for u in wanted
    )


@pytest.fixture
def steady_host(tmp_path: Path) -> Iterator[int]:
    """An agent on two GPUs with fixed readings: a hostile process name on GPU 0, a second
    process on GPU 1 that starts 6 s in."""
    hostile = tmp_path / HOSTILE  # the name the kernel gives the process comes from its file
    hostile.symlink_to(shutil.which("sleep") or "/bin/sleep")
    scenario = tmp_path / "steady.yaml"
    scenario.write_text(STEADY.format(hostile=json.dumps(str(hostile)), later="6s"))
    config = tmp_path / "config.yaml"
    config.write_text(
        "actions:\n  recommend: {every: 200ms}\n  thermal: {every: 200ms}\n"
        "  zombie_reaper: {every: 200ms}\n"
    )
    args = ("--simulate", str(scenario), "--config", str(config), "--interval", "0.5")
    with serve(tmp_path, *args) as (agent, port):
        healthz_until(agent, port)
        try:
            yield port
        finally:
            if agent.poll() is not None:
                print(stderr_of(agent))


def test_the_page_shows_what_snapshot_holds_and_updates_by_itself(tmp_path, steady_host):
    port = steady_host
    with browser(tmp_path) as driver:
        driver.get(f"http://127.0.0.1:{port}/")
        until(lambda: redrawn(driver), "the script's first redraw")
        doc = snapshot(port)
        wanted = expected_gpu_cells(doc)
        until(lambda: subset(cells(driver, "gpus"), wanted), f"the GPU rows {wanted}")
        driver.save_screenshot(str(tmp_path / "page-values.png"))
        mode = driver.find_element(By.ID, "reaper-mode")
        until(lambda: mode.text.startswith("dry run"), "the reaper's mode")
        # the second process starts 6 s in: the table grows without a reload
        before = driver.execute_script("return performance.getEntriesByType('navigation').length")
        until(lambda: len(cells(driver, "processes", "data-gpu")) == 2, "process 2", 30)
        after = driver.execute_script("return performance.getEntriesByType('navigation').length")
        assert before == after == 1  # no reload
        rows = cells(driver, "processes", "data-gpu")
        pids = {p["pid"] for g in snapshot(port)["gpus"] for p in g["processes"]}
        assert {key.split("/")[1] for key in rows} == {str(p) for p in pids}
        charts = driver.find_elements(By.CSS_SELECTOR, "#charts figure polyline")
        assert len(charts) == 2 * 3 and all(c.get_attribute("points") for c in charts)
        driver.save_screenshot(str(tmp_path / "page-updated.png"))


def test_a_hostile_process_name_is_text_and_runs_nothing(tmp_path, steady_host):
    port = steady_host
    for javascript in (True, False):
        with browser(tmp_path, javascript) as driver:
            try:
                driver.get(f"http://127.0.0.1:{port}/")
                if javascript:
                    until(lambda: redrawn(driver), "the script's redraw")
                names = [row["name"] for row in cells(driver, "processes", "data-gpu").values()]
                assert HOSTILE in names, names
                assert not driver.find_elements(By.CSS_SELECTOR, "main img")
                assert driver.execute_script("return typeof window.__pwned") == "undefined"
            except UnexpectedAlertPresentException:
                pytest.fail("the process name ran as script")
            driver.save_screenshot(str(tmp_path / f"page-hostile-js-{javascript}.png"))
            logged = driver.get_log("browser")
            errors = [e for e in logged if "Content Security Policy" in e["message"]]
            assert not errors, errors  # nothing of the page's own needed an exception


def test_no_request_leaves_the_agents_origin(tmp_path, steady_host):
    port = steady_host
    origin = f"http://127.0.0.1:{port}/"
    with browser(tmp_path) as driver:
        driver.get(origin)
        body = driver.find_element(By.TAG_NAME, "body")
        first = until(lambda: body.get_attribute("data-updated"), "a redraw")
        until(lambda: body.get_attribute("data-updated") != first, "a second redraw")
        urls = requested_urls(driver, origin)
        assert any(u.endswith("/snapshot") for u in urls) and any("/history" in u for u in urls)
        elsewhere = [u for u in urls if not u.startswith(origin)]
        assert not elsewhere
    status, headers = _headers(port, "/")
    assert status == 200 and headers["content-security-policy"] == page.CONTENT_SECURITY_POLICY


def test_without_javascript_the_tables_are_there(tmp_path, steady_host):
    port = steady_host
    with browser(tmp_path, javascript=False) as driver:
        driver.get(f"http://127.0.0.1:{port}/")
        assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-js") is None
        doc = snapshot(port)
        assert subset(cells(driver, "gpus"), expected_gpu_cells(doc))
        assert cells(driver, "processes", "data-gpu")
        assert not driver.find_element(By.ID, "charts").is_displayed()
        driver.save_screenshot(str(tmp_path / "page-no-js.png"))


def test_a_peer_that_is_down_is_shown_as_down(tmp_path):
    closed = free_port()
    with serve(tmp_path, "--simulate", "--interval", "0.5") as (peer, peer_port):
        healthz_until(peer, peer_port)
        peers = f"http://127.0.0.1:{peer_port},http://127.0.0.1:{closed}"
        args = ("--simulate", "--interval", "0.5", "--peers", peers, "--peer-timeout", "1s")
        with serve(tmp_path, *args) as (agent, port), browser(tmp_path) as driver:
            healthz_until(agent, port)
            driver.get(f"http://127.0.0.1:{port}/")

            def states() -> dict[str, str]:
                return {
                    url: row["state"] for url, row in cells(driver, "hosts", "data-url").items()
                }

            found = until(
                lambda: (
                    (s := states())
                    and s.get(f"http://127.0.0.1:{peer_port}") == "up"
                    and s.get(f"http://127.0.0.1:{closed}", "").startswith("down")
                ),
                "one peer up and one down",
            )
            assert found
            down = states()[f"http://127.0.0.1:{closed}"]
            assert "cannot reach" in down or "refused" in down, down
            driver.save_screenshot(str(tmp_path / "page-peers.png"))


def _headers(port: int, path: str) -> tuple[int, dict[str, str]]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def screenshot_builtin(tmp_path: Path, out: Path, samples: int = 20) -> None:
    """A full-page screenshot of the page on the built-in scenario, once the charts have
    ``samples`` of history: ``out``."""
    with serve(tmp_path, "--simulate", "--interval", "1") as (agent, port):
        healthz_until(agent, port)
        with browser(tmp_path) as driver:
            driver.set_window_size(1280, 900)
            driver.get(f"http://127.0.0.1:{port}/")
            until(lambda: redrawn(driver), "the script's first redraw")
            body = driver.find_element(By.TAG_NAME, "body")
            seq = lambda: int(body.get_attribute("data-updated"))  # noqa: E731
            until(lambda: seq() >= samples, f"{samples} samples", samples + 20)
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(1280, height + 20)
            driver.save_screenshot(str(out))


def test_the_built_in_host(tmp_path):
    out = tmp_path / "page-builtin.png"
    screenshot_builtin(tmp_path, out, samples=3)
    assert out.stat().st_size > 10_000


if __name__ == "__main__":  # docs/status-page.png: python -m tests.test_page_browser OUT.png
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        screenshot_builtin(Path(folder), Path(sys.argv[1]).resolve())
