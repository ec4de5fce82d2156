#!/usr/bin/env python3
"""Requests/s and p99 latency of gpu-exporter's ``/metrics`` next to nginx serving the same bytes.

On loopback, with ``wrk`` (Debian package ``wrk``), ``--connections`` connections for
``--duration`` seconds, twice per server: with keep-alive (wrk's default, as Prometheus scrapes)
and with ``Connection: close`` (a new connection per request). gpu-exporter runs on a simulated
host of ``--gpus`` GPUs x ``--processes`` processes per GPU, set up as ``bench/benchmark.py``
does (real ``sleep`` processes, NVML calls costing 50 us), as ``python -m exporter serve
--simulate SCENARIO`` with this interpreter and its default settings but ``--listen`` and
``--interval``.
nginx (Debian package ``nginx-light``) is started by this script on another loopback port with a
temporary config (one worker process, access log off) and serves one ``/metrics`` body taken from
gpu-exporter, as a static file with the same Content-Type; it is stopped at the end.

    .venv/bin/python bench/http_bench.py               # 8 GPUs x 16 processes, 16 connections, 10 s
    .venv/bin/python bench/http_bench.py --quick       # a smoke run: 2 x 2, 4 connections, 1 s

Everything it starts is stopped at the end, also on Ctrl-C and on errors. Results and the exact
command: docs/benchmarks.md, "HTTP server: wrk next to nginx".
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MODES = (("keep-alive", []), ("Connection: close", ["-H", "Connection: close"]))
NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    client_body_temp_path {folder}/nginx-body;
    proxy_temp_path {folder}/nginx-proxy;
    fastcgi_temp_path {folder}/nginx-fastcgi;
    uwsgi_temp_path {folder}/nginx-uwsgi;
    scgi_temp_path {folder}/nginx-scgi;
    server {{
        listen 127.0.0.1:{port};
        root {folder}/www;
        location = /metrics {{
            default_type "{content_type}";
            try_files /metrics =404;
        }}
    }}
}}
"""


def _load_benchmark() -> Any:
    """bench/benchmark.py as a module: its simulated host, process reaper and free ports."""
    spec = importlib.util.spec_from_file_location("http_bench_benchmark", HERE / "benchmark.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass
class WrkResult:
    requests_per_second: float
    p99_ms: float
    requests: int
    errors: int


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def parse_wrk(output: str) -> WrkResult:
    """Requests/s, p99 (ms), requests and errors (socket errors plus non-2xx) of wrk --latency."""
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", output, re.M)
    p99 = re.search(r"^\s+99%\s+([\d.]+)(us|ms|s|m)\s*$", output, re.M)
    total = re.search(r"^\s+(\d+) requests in", output, re.M)
    if not (rps and p99 and total):
        raise RuntimeError(f"cannot read wrk's output:\n{output}")
    errors = 0
    socket_errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    if socket_errors:
        errors += sum(int(n) for n in socket_errors.groups())
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    if non_2xx:
        errors += int(non_2xx.group(1))
    return WrkResult(
        float(rps.group(1)), float(p99.group(1)) * _UNITS[p99.group(2)], int(total.group(1)), errors
    )


def run_wrk(url: str, extra: list[str], args: argparse.Namespace) -> WrkResult:
    argv = [
        "wrk",
        f"-t{args.threads}",
        f"-c{args.connections}",
        f"-d{args.duration}s",
        "--latency",
        *extra,
        url,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.duration + 60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}{done.stderr}")
    return parse_wrk(done.stdout)


def start_nginx(bench: Any, reaper: Any, folder: str, body: bytes, started: list[Any]) -> int:
    """nginx serving ``body`` as /metrics on a free loopback port (appended to ``started``)."""
    www = Path(folder, "www")
    www.mkdir()
    (www / "metrics").write_bytes(body)
    # Run as root, nginx's worker runs as nobody: it must reach the file.
    for path in (folder, www, www / "metrics"):
        path_mode = 0o755 if Path(path).is_dir() else 0o644
        os.chmod(path, path_mode)
    port = bench._free_port()
    conf = Path(folder, "nginx.conf")
    conf.write_text(NGINX_CONF.format(folder=folder, port=port, content_type=CONTENT_TYPE))
    log = open(Path(folder, "nginx.out"), "wb")  # noqa: SIM115 (closed with the process)
    child = reaper.popen(
        ["nginx", "-p", folder, "-c", str(conf), "-e", f"{folder}/nginx-error.log"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    started.append(child)
    wait_for_body(bench, child, port, lambda got: got == body, "nginx", folder)
    return port


def wait_for_body(bench: Any, child: Any, port: int, good: Any, name: str, folder: str) -> bytes:
    """The first 200 body of /metrics that ``good`` accepts, within 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"{name} exited ({child.returncode}); see {folder}")
        with contextlib.suppress(OSError, bench.http.client.HTTPException):
            status, body, _ = bench.scrape(port, timeout=10)
            if status == 200 and good(body):
                return bytes(body)
        time.sleep(0.05)
    raise RuntimeError(f"{name}: no good /metrics within 60s; see {folder}")


def table(header: str, rows: dict[str, dict[str, WrkResult]]) -> str:
    ours, nginx = rows["gpu-exporter"], rows["nginx"]
    lines = [header, f"{'':34}{'gpu-exporter':>14}{'nginx':>12}{'ours/nginx':>12}"]
    for mode, _ in MODES:
        a, b = ours[mode], nginx[mode]
        lines.append(
            f"{mode + ': requests/s':34}{a.requests_per_second:>14.0f}"
            f"{b.requests_per_second:>12.0f}{a.requests_per_second / b.requests_per_second:>11.2f}x"
        )
        lines.append(
            f"{mode + ': p99 (ms)':34}{a.p99_ms:>14.2f}{b.p99_ms:>12.2f}"
            f"{a.p99_ms / b.p99_ms:>11.2f}x"
        )
        lines.append(f"{mode + ': errors':34}{a.errors:>14}{b.errors:>12}")
    return "\n".join(lines)


def targets(rows: dict[str, dict[str, WrkResult]]) -> list[str]:
    ours, nginx = rows["gpu-exporter"], rows["nginx"]
    keep, close = (mode for mode, _ in MODES)
    checks = [
        (
            "keep-alive requests/s at least half of nginx's",
            ours[keep].requests_per_second >= nginx[keep].requests_per_second / 2,
            f"{ours[keep].requests_per_second:.0f} vs {nginx[keep].requests_per_second:.0f}",
        )
    ]
    for mode in (keep, close):
        checks.append(
            (
                f"p99 within 3x of nginx's, {mode}",
                ours[mode].p99_ms <= 3 * nginx[mode].p99_ms,
                f"{ours[mode].p99_ms:.2f} vs {nginx[mode].p99_ms:.2f} ms",
            )
        )
    return [f"  [{'met' if ok else 'MISSED'}] {name}: {detail}" for name, ok, detail in checks]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=16, help="per GPU")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--interval", default="5s", help="gpu-exporter's sample interval")
    parser.add_argument("--quick", action="store_true", help="2 x 2, 4 connections, 1 s runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.gpus, args.processes, args.connections, args.duration = 2, 2, 4, 1
    args.threads = min(args.threads, args.connections)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [tool for tool in ("wrk", "nginx") if shutil.which(tool) is None]
    if missing:
        print(
            f"http_bench: {' and '.join(missing)} not found; on Debian: "
            "apt-get install wrk nginx-light",
            file=sys.stderr,
        )
        return 2
    bench = _load_benchmark()
    reaper = bench.Reaper()
    previous = signal.signal(signal.SIGTERM, bench._terminate)
    folder = tempfile.mkdtemp(prefix="gpu-exporter-http-bench-")
    started: list[Any] = []  # stopped with SIGTERM first: nginx's master then stops its worker
    try:
        host = bench.make_host(reaper, args.gpus, args.processes, folder)
        port = bench._free_port()
        locks = Path(folder, "locks")
        locks.mkdir()
        argv = [
            *(sys.executable, "-m", "exporter", "serve", "--simulate", host.scenario),
            *("--listen", f"127.0.0.1:{port}", "--interval", args.interval),
            *("--lock-dir", str(locks)),
        ]
        env = dict(os.environ, PYTHONPATH=str(HERE.parent), PYTHONUNBUFFERED="1")
        with open(Path(folder, "gpu-exporter.log"), "wb") as out:
            agent = reaper.popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        started.append(agent)
        wanted = [f'uuid="{uuid}"'.encode() for uuid in host.uuids]
        body = wait_for_body(
            bench, agent, port, lambda got: all(w in got for w in wanted), "gpu-exporter", folder
        )
        nginx_port = start_nginx(bench, reaper, folder, body, started)
        urls = {
            "gpu-exporter": f"http://127.0.0.1:{port}/metrics",
            "nginx": f"http://127.0.0.1:{nginx_port}/metrics",
        }
        rows: dict[str, dict[str, WrkResult]] = {name: {} for name in urls}
        for mode, extra in MODES:
            for name, url in urls.items():
                print(f"http_bench: {name}, {mode} ...", file=sys.stderr)
                rows[name][mode] = run_wrk(url, extra, args)
        header = (
            f"/metrics at {args.gpus} GPUs x {args.processes} processes ({len(body)} bytes); "
            f"wrk -t{args.threads} -c{args.connections} -d{args.duration}s --latency, loopback; "
            f"{bench.machine()}"
        )
        print(table(header, rows))
        print("targets:")
        print("\n".join(targets(rows)))
    except KeyboardInterrupt:
        print("\nhttp_bench: interrupted; stopping everything it started", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"http_bench: {exc}", file=sys.stderr)
        return 1
    finally:
        for child in reversed(started):
            reaper.stop(child)
        reaper.stop_all()
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
