"""The exporter-toolkit web config (``--web.config.file``): TLS, basic auth and headers, on the
real server; its errors name file and line and exit 2."""

from __future__ import annotations

import base64
import http.client
import itertools
import logging
import os
import shutil
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import bcrypt
import pytest

import exporter.cli
from exporter.config.yamlconf import ConfigError
from exporter.exposition.metrics import render
from exporter.sampling.sampler import Sampler
from exporter.web import webconfig
from exporter.web.auth import BasicAuth
from exporter.web.routes import App, Server, serve
from exporter.web.webconfig import WebConfig, load_web_config
from tests import agent
from tests.helpers import line_of, one, samples, until, write

ALICE = bcrypt.hashpw(b"wonderland", bcrypt.gensalt(4)).decode()
BOB = bcrypt.hashpw(b"builder", bcrypt.gensalt(4)).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    from tests.test_tls import _make_pki

    return _make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, str]) -> dict[str, str]:
    """A client certificate of another CA, one the server never trusted."""
    from tests.test_tls import _make_pki

    return _make_pki(tmp_path_factory.mktemp("stranger"))


@pytest.fixture
def start(simulated, collector) -> Iterator[Callable[..., Server]]:
    """``start(web_config_text, **serve_kwargs)``: the real server with that web config."""
    simulated("gpus: [{name: GPU A}]\n")
    sampler = Sampler(collector, interval=60, deadline=60, render=render)
    sampler.sample_once()
    started: list[Server] = []

    def run(text: str, tmp: Path, **kwargs) -> Server:
        web = load_web_config(write(tmp, text, "web.yml"))
        server = serve(App(sampler), "127.0.0.1", 0, web=web, **kwargs)
        started.append(server)
        return server

    yield run
    for server in started:
        server.close()


def request(
    port: int,
    path: str = "/metrics",
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request with ``Connection: close``; (status, headers in lower case, body)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    data = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        sock = context.wrap_socket(raw, server_hostname="127.0.0.1") if context else raw
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in fields.items()}, body


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def client_context(pki: dict[str, str], cert: dict[str, str] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki["ca.pem"])
    if cert is not None:
        context.load_cert_chain(cert["client.pem"], cert["client.key"])
    return context


# -- basic auth -----------------------------------------------------------------------------


USERS = f"basic_auth_users:\n  alice: {ALICE}\n  bob: '{BOB}'\n"


def test_basic_auth_right_and_wrong(start, tmp_path):
    server = start(USERS, tmp_path)
    status, _, body = request(server.port, headers=basic("alice", "wonderland"))
    assert status == 200 and b"gpu_up{" in body
    assert request(server.port, headers=basic("bob", "builder"))[0] == 200
    refusals = [
        request(server.port),  # no header
        request(server.port, headers=basic("alice", "wrong")),  # wrong password
        request(server.port, headers=basic("mallory", "wonderland")),  # unknown user
        request(server.port, headers=basic("bob", "wonderland")),  # another user's password
        request(server.port, headers={"Authorization": "Basic !!!not base64"}),
        request(server.port, headers={"Authorization": "Bearer abc"}),
        request(server.port, path="/healthz"),  # not open unless configured
    ]
    for status, headers, body in refusals:
        assert status == 401
        assert headers["www-authenticate"] == 'Basic realm="gpu-exporter"'
        assert (headers["content-length"], body) == (str(len(body)), b"401 Unauthorized\n")
    assert len({(h["content-type"], b) for _, h, b in refusals}) == 1  # nothing tells them apart


def test_healthz_open_when_configured(start, tmp_path):
    server = start(USERS, tmp_path, healthz_without_auth=True)
    assert request(server.port, path="/healthz")[0] in (200, 503)  # no 401: the probe's answer
    assert request(server.port, path="/metrics")[0] == 401
    assert request(server.port, path="/snapshot")[0] == 401


def test_success_is_cached_and_unknown_users_cost_a_bcrypt_check():
    def app(environ, start_response):
        start_response("200 OK", [("Content-Length", "0")])
        return [b""]

    now = [100.0]
    auth = BasicAuth(app, {"alice": ALICE.encode()}, ttl=60, size=2, monotonic=lambda: now[0])
    right = basic("alice", "wonderland")["Authorization"]
    assert auth.allowed(right) and auth.checks == 1
    assert auth.allowed(right) and auth.checks == 1  # cached: no bcrypt
    now[0] += 61
    assert auth.allowed(right) and auth.checks == 2  # expired: checked again
    assert not auth.allowed(basic("mallory", "x")["Authorization"]) and auth.checks == 3
    assert not auth.allowed(basic("alice", "x")["Authorization"]) and auth.checks == 4
    assert not auth.allowed(basic("alice", "x")["Authorization"]) and auth.checks == 5  # never
    assert not auth.allowed(basic("alice", "w" * 100)["Authorization"])  # over 72 bytes
    assert auth.cached() <= 2


def test_inline_only_when_no_bcrypt_check_is_due():
    """The server calls the app on its event loop only when ``inline`` says so: never when a
    bcrypt check is due (tens of milliseconds), and as the wrapped app says otherwise."""

    class App:
        def __init__(self, inline: bool) -> None:
            self.answer = inline

        def __call__(self, environ, start_response):
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]

        def inline(self, environ) -> bool:
            return self.answer

    right = basic("alice", "wonderland")["Authorization"]
    auth = BasicAuth(App(True), {"alice": ALICE.encode()}, open_paths=("/healthz",))
    metrics = {"PATH_INFO": "/metrics"}
    assert auth.inline(metrics)  # no credentials: a 401 at once
    assert auth.inline({**metrics, "HTTP_AUTHORIZATION": "Bearer x"})
    assert not auth.inline({**metrics, "HTTP_AUTHORIZATION": right})  # not checked yet
    assert auth.allowed(right) and auth.checks == 1
    assert auth.inline({**metrics, "HTTP_AUTHORIZATION": right})  # remembered
    assert not auth.inline({**metrics, "HTTP_AUTHORIZATION": basic("alice", "x")["Authorization"]})
    assert auth.inline({"PATH_INFO": "/healthz"}) and auth.checks == 1
    slow = BasicAuth(App(False), {"alice": ALICE.encode()})
    assert slow.allowed(right) and not slow.inline({**metrics, "HTTP_AUTHORIZATION": right})


# -- headers --------------------------------------------------------------------------------


def test_headers_are_added_to_every_response(start, tmp_path):
    server = start(
        "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
        "    X-Content-Type-Options: nosniff\n    Content-Security-Policy: default-src 'none'\n"
        "    Strict-Transport-Security: ''\n" + USERS,
        tmp_path,
    )
    for path, auth, status in (
        ("/metrics", basic("alice", "wonderland"), 200),
        ("/nope", basic("alice", "wonderland"), 404),
        ("/metrics", {}, 401),
    ):
        got, headers, _ = request(server.port, path, auth)
        assert got == status
        assert headers["x-frame-options"] == "deny"
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["content-security-policy"] == "default-src 'none'"
        assert "strict-transport-security" not in headers  # blank: unset


# -- TLS ------------------------------------------------------------------------------------


def tls_config(pki: dict[str, str], auth: str | None, ca: bool, extra: str = "") -> str:
    lines = [
        "tls_server_config:",
        f"  cert_file: {pki['server.pem']}",
        f"  key_file: {pki['server.key']}",
    ]
    if auth:
        lines.append(f"  client_auth_type: {auth}")
    if ca:
        lines.append(f"  client_ca_file: {pki['ca.pem']}")
    return "\n".join(lines) + "\n" + extra


@pytest.mark.parametrize(
    ("auth", "ca", "anonymous", "stranger_ok"),
    [
        (None, False, True, True),  # NoClientCert: no certificate asked for
        ("NoClientCert", False, True, True),
        ("RequestClientCert", False, True, True),  # asks, checks nothing: the same
        ("VerifyClientCertIfGiven", True, True, False),
        ("RequireAndVerifyClientCert", True, False, False),
    ],
)
def test_tls_from_the_web_config(start, tmp_path, pki, stranger, auth, ca, anonymous, stranger_ok):
    server = start(tls_config(pki, auth, ca), tmp_path)
    trusted = request(server.port, context=client_context(pki, pki))
    assert trusted[0] == 200 and b"gpu_up{" in trusted[2]
    for context, allowed in (
        (client_context(pki), anonymous),
        (client_context(pki, stranger), stranger_ok),
    ):
        if allowed:
            assert request(server.port, context=context)[0] == 200
        else:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                request(server.port, context=context)
    with pytest.raises((ssl.SSLError, ConnectionError, ValueError, IndexError)):
        request(server.port)  # plain HTTP on TLS


def test_min_version(start, tmp_path, pki):
    server = start(tls_config(pki, None, False, "  min_version: TLS13\n"), tmp_path)
    old = client_context(pki)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionError)):
        request(server.port, context=old)
    assert request(server.port, context=client_context(pki))[0] == 200


def test_tls_and_basic_auth_together(start, tmp_path, pki):
    server = start(tls_config(pki, None, False) + USERS, tmp_path)
    context = client_context(pki)
    assert request(server.port, context=context)[0] == 401
    assert request(server.port, headers=basic("alice", "wonderland"), context=context)[0] == 200


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle", "key"),
    [
        ("tls_server_config:\n  cert_fil: x\n", "unknown key", "cert_fil"),
        ("basic_auth_user:\n  alice: x\n", "unknown key", "basic_auth_user"),
        ("http_server_config:\n  http3: true\n", "unknown key", "http3"),
        ("http_server_config:\n  headers:\n    Content-Type: x\n", "cannot be set", "Content-Type"),
        ("http_server_config:\n  headers:\n    Server: x\n", "cannot be set", "Server"),
        ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n", "deny", "X-Frame"),
        ("basic_auth_users:\n  alice: secret\n", "bcrypt hash", "alice"),
        ("basic_auth_users:\n  'a:b': " + ALICE + "\n", "without ':'", "a:b"),
        ("rate_limit:\n  burst: 1\n", "not supported", "rate_limit"),
        ("tls_server_config:\n  cert: x\n", "use cert_file", "cert"),
        ("tls_server_config:\n  cipher_suites: [x]\n", "not supported", "cipher_suites"),
        ("tls_server_config:\n  min_version: TLS14\n", "TLS13", "min_version"),
        ("tls_server_config:\n  cert_file: /nonexistent\n", "does not exist", "cert_file"),
    ],
)
def test_bad_web_configs_name_file_and_line(tmp_path, text, needle, key):
    path = write(tmp_path, text, "web.yml")
    with pytest.raises(ConfigError) as info:
        load_web_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line_of(path, key)}: "), message
    assert needle in message


@pytest.mark.parametrize(
    ("auth", "ca", "needle"),
    [
        ("RequireAnyClientCert", True, "not supported"),
        ("NoClientCert", True, "set client_auth_type"),
        ("VerifyClientCertIfGiven", False, "needs client_ca_file"),
        ("RequireAndVerifyClientCert", False, "needs client_ca_file"),
        ("Sometimes", True, "must be one of"),
    ],
)
def test_client_auth_type_errors(tmp_path, pki, auth, ca, needle):
    path = write(tmp_path, tls_config(pki, auth, ca), "web.yml")
    with pytest.raises(ConfigError, match=needle):
        load_web_config(path)


def test_a_key_without_its_certificate(tmp_path, pki):
    path = write(tmp_path, f"tls_server_config:\n  key_file: {pki['server.key']}\n", "web.yml")
    with pytest.raises(ConfigError, match="needs cert_file too"):
        load_web_config(path)


def test_relative_paths_are_relative_to_the_file(tmp_path, pki):
    for name in ("server.pem", "server.key"):
        shutil.copy(pki[name], tmp_path / name)
    path = write(
        tmp_path, "tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n", "w.yml"
    )
    config = load_web_config(path)
    assert isinstance(config, WebConfig) and config.ssl_context is not None


# -- the command line -----------------------------------------------------------------------


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = exporter.cli.main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def test_the_flag_loads_the_file(tmp_path):
    """``serve --web.config.file``: the agent it starts asks for the file's passwords."""
    path = write(tmp_path, USERS, "web.yml")
    with agent.serve(tmp_path, "--simulate", "--web.config.file", path) as (proc, port):
        until(lambda: request_or_none(port), "the agent to listen")
        status, headers, _ = request(port)
        assert status == 401 and headers["www-authenticate"].startswith("Basic"), headers
        alice = basic("alice", "wonderland")
        until(lambda: b"gpu_up{" in request(port, headers=alice)[2], "the first sample")
        assert request(port, headers=alice)[0] == 200, agent.stderr_of(proc)


def request_or_none(port: int) -> tuple[int, dict[str, str], bytes] | None:
    """:func:`request`, or None while nothing listens on ``port``."""
    try:
        return request(port)
    except ConnectionRefusedError:
        return None


def test_an_unknown_key_exits_2_naming_file_and_line(tmp_path, capsys):
    path = write(tmp_path, "basic_auth_users: {}\ntls_server_konfig: {}\n", "web.yml")
    code, err = run(["check-config", write(tmp_path, f"web:\n  config_file: {path}\n")], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"gpu-exporter: {path}:2: tls_server_konfig: unknown key"), err
    assert len(err.strip().splitlines()) == 1


def test_both_tls_sources_are_an_error(tmp_path, pki, capsys, monkeypatch):
    monkeypatch.delenv("GPU_EXPORTER_CONFIG", raising=False)
    web = write(tmp_path, tls_config(pki, None, False), "web.yml")
    code, err = run(
        [
            "serve",
            "--web.config.file",
            web,
            "--tls-cert-file",
            pki["server.pem"],
            "--tls-key-file",
            pki["server.key"],
        ],
        capsys,
    )
    assert code == 2 and "pick one" in err and "--web.config.file" in err, err
    assert len(err.strip().splitlines()) == 1


# -- reloads --------------------------------------------------------------------------------

FAST = 0.05  # seconds between looks at the files, for the tests that need not wait a second


@pytest.fixture(scope="module")
def rotated(pki: dict[str, str]) -> dict[str, str]:
    """A second server certificate of the same CA (``CN=rotated``, a serial of its own)."""
    from tests.test_tls import _issue

    pem, key = _issue(Path(pki["ca.pem"]).parent, "rotated")
    return {"server.pem": pem, "server.key": key}


def publish(folder: Path, version: str, files: dict[str, bytes]) -> None:
    """Publish ``files`` in ``folder`` as a Kubernetes secret volume (cert-manager's) does:
    in a new ``..VERSION`` folder, then one atomic rename of the ``..data`` link, which the
    ``tls.crt`` and ``tls.key`` links go through."""
    target = folder / f"..{version}"
    target.mkdir()
    for name, data in files.items():
        (target / name).write_bytes(data)
    (folder / "..data_tmp").symlink_to(target.name)
    os.replace(folder / "..data_tmp", folder / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")


def pair(pki: dict[str, str], key_of: dict[str, str] | None = None) -> dict[str, bytes]:
    """The certificate of ``pki`` and the key of ``key_of`` (its own by default)."""
    return {
        "tls.crt": Path(pki["server.pem"]).read_bytes(),
        "tls.key": Path((key_of or pki)["server.key"]).read_bytes(),
    }


TLS_FILES = "tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n"


def scrape(port: int, context: ssl.SSLContext) -> tuple[int, str, str]:
    """One request on a new connection: (status, the server certificate's CN, its serial)."""
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
    try:
        conn.request("GET", "/metrics")
        status = conn.getresponse()
        status.read()
        return status.status, *peer(conn)
    finally:
        conn.close()


def peer(conn: http.client.HTTPSConnection) -> tuple[str, str]:
    """The CN and the serial of the certificate ``conn``'s server presented."""
    assert isinstance(conn.sock, ssl.SSLSocket)
    cert = conn.sock.getpeercert()
    assert cert
    subject = dict(field[0] for field in cert["subject"])
    return str(subject["commonName"]), str(cert["serialNumber"])


def web_config_samples(
    port: int, context: ssl.SSLContext | None = None, headers: dict[str, str] | None = None
) -> dict[str, float]:
    """The ``gpu_exporter_web_config_*`` samples of one scrape, by name and result."""
    status, _, body = request(port, headers=headers, context=context)
    assert status == 200
    out = {}
    for name, found in samples(body).items():
        for sample in found:
            if name.startswith("gpu_exporter_web_config_"):
                out[name + sample.labels.get("result", "")] = sample.value
    return out


def test_a_certificate_replaced_while_a_client_scrapes(start, tmp_path, pki, rotated):
    """cert-manager renews the certificate: a client scraping in a loop gets 200 throughout,
    a new connection gets the new certificate, and a keep-alive one opened before keeps going
    with the old one."""
    publish(tmp_path, "v1", pair(pki))
    server = start(TLS_FILES, tmp_path, reload_interval=FAST)
    context = client_context(pki)
    kept = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=5)
    kept.request("GET", "/metrics")
    assert kept.getresponse().read() and peer(kept)[0] == "server"
    old_serial = peer(kept)[1]
    seen: list[tuple[int, str, str]] = []
    stop = threading.Event()

    def scraper() -> None:
        while not stop.is_set():
            seen.append(scrape(server.port, context))

    thread = threading.Thread(target=scraper)
    thread.start()
    try:
        until(lambda: len(seen) >= 3, "scrapes before the renewal")
        publish(tmp_path, "v2", pair(rotated))
        until(lambda: seen[-1][1] == "rotated", "a scrape that sees the new certificate")
        count = len(seen)
        until(lambda: len(seen) >= count + 3, "scrapes after the renewal")
    finally:
        stop.set()
        thread.join()
    assert {status for status, _, _ in seen} == {200}, seen
    assert seen[0][1:] == ("server", old_serial)
    status, name, serial = scrape(server.port, context)
    assert (status, name) == (200, "rotated") and serial != old_serial
    kept.request("GET", "/metrics")  # the connection opened before: still served, old session
    assert kept.getresponse().status == 200 and peer(kept) == ("server", old_serial)
    kept.close()
    found = web_config_samples(server.port, context)
    assert found["gpu_exporter_web_config_reloads_totalsuccess"] == 1
    assert found["gpu_exporter_web_config_reloads_totalfailure"] == 0
    assert found["gpu_exporter_web_config_last_reload_successful"] == 1


def test_a_broken_replacement_keeps_the_old_certificate_and_counts_a_failure(
    start, tmp_path, pki, rotated, caplog
):
    """Each broken state is a failure, counted, logged at ERROR once per distinct problem; the
    running certificate stays until a good pair comes."""
    publish(tmp_path, "v1", pair(pki))
    server = start(TLS_FILES, tmp_path, reload_interval=FAST)
    reloader = server.reloader
    assert reloader is not None
    context = client_context(pki)
    _, _, serial = scrape(server.port, context)
    garbage = {
        "tls.crt": b"-----BEGIN CERTIFICATE-----\nnot one\n",
        "tls.key": pair(pki)["tls.key"],
    }
    steps = [
        (garbage, "cannot load the certificate"),
        (garbage, None),  # the same problem again: counted, not logged at ERROR again
        (pair(pki, key_of=rotated), "cannot load the certificate"),  # a key of another
        ({"tls.crt": pair(rotated)["tls.crt"]}, "does not exist"),  # the key missing
    ]
    with caplog.at_level(logging.INFO, logger="exporter.web.webconfig"):
        for number, (files, logged) in enumerate(steps, 1):
            caplog.clear()
            publish(tmp_path, f"broken{number}", files)
            until(lambda n=number: reloader.stats.failures == n, f"failure {number}")
            errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            if logged is None:
                assert errors == [], errors
            else:
                assert len(errors) == 1 and logged in errors[0], errors
                assert "the running configuration stays" in errors[0]
            assert scrape(server.port, context) == (200, "server", serial)  # the old one
        found = web_config_samples(server.port, context)
        assert found["gpu_exporter_web_config_reloads_totalfailure"] == len(steps)
        assert found["gpu_exporter_web_config_reloads_totalsuccess"] == 0
        assert found["gpu_exporter_web_config_last_reload_successful"] == 0
        before = found["gpu_exporter_web_config_last_reload_success_timestamp_seconds"]
        publish(tmp_path, "fixed", pair(rotated))
        until(lambda: reloader.stats.successes == 1, "the good pair")
    assert scrape(server.port, context)[:2] == (200, "rotated")
    found = web_config_samples(server.port, context)
    assert found["gpu_exporter_web_config_last_reload_successful"] == 1
    assert found["gpu_exporter_web_config_last_reload_success_timestamp_seconds"] > before


def test_changed_users_and_headers_take_effect(start, tmp_path):
    """A new password, a removed user and a new one, new headers: from the next request on,
    with a password that passed before (and is cached) checked again."""
    server = start(USERS, tmp_path, reload_interval=FAST)
    assert request(server.port, headers=basic("alice", "wonderland"))[0] == 200  # now cached
    carol = bcrypt.hashpw(b"carol's", bcrypt.gensalt(4)).decode()
    alice = bcrypt.hashpw(b"new password", bcrypt.gensalt(4)).decode()
    write(
        tmp_path,
        f"basic_auth_users:\n  alice: {alice}\n  carol: {carol}\n"
        "http_server_config:\n  headers:\n    X-Frame-Options: deny\n",
        "web.yml",
    )
    until(lambda: request(server.port, headers=basic("carol", "carol's"))[0] == 200, "carol")
    assert request(server.port, headers=basic("alice", "wonderland"))[0] == 401
    status, headers, _ = request(server.port, headers=basic("alice", "new password"))
    assert status == 200 and headers["x-frame-options"] == "deny"
    assert request(server.port, headers=basic("bob", "builder"))[0] == 401
    assert request(server.port)[1]["x-frame-options"] == "deny"  # on a 401 too


def test_tls_is_not_switched_on_or_off_by_a_reload(start, tmp_path, pki, caplog):
    """A plain listener stays plain (and a TLS one TLS): the reload is refused, counted and
    logged with what to do, and the rest of the file is not applied either."""
    server = start(USERS, tmp_path, reload_interval=3600)
    write(tmp_path, tls_config(pki, None, False), "web.yml")  # TLS, and no users
    with caplog.at_level(logging.ERROR, logger="exporter.web.webconfig"):
        assert server.reload_web_config() is False
    assert "TLS cannot be switched on by a reload" in caplog.text
    assert "restart the agent" in caplog.text
    assert request(server.port)[0] == 401  # plain HTTP, and the users still asked for
    found = web_config_samples(server.port, headers=basic("alice", "wonderland"))
    assert found["gpu_exporter_web_config_reloads_totalfailure"] == 1
    (tmp_path / "tls").mkdir()
    tls = start(tls_config(pki, None, False), tmp_path / "tls", reload_interval=3600)
    write(tmp_path / "tls", USERS, "web.yml")  # plain HTTP, with users
    assert tls.reload_web_config() is False
    assert request(tls.port, context=client_context(pki))[0] == 200


def test_the_files_are_looked_at_at_most_once_a_second(start, tmp_path, pki, monkeypatch):
    """However many requests come, the watch stats its files once a second (the default)."""
    calls: list[tuple[float, str]] = []
    real = webconfig.stamp

    def counting(path: str) -> webconfig.Stamp:
        calls.append((time.monotonic(), path))
        return real(path)

    publish(tmp_path, "v1", pair(pki))
    server = start(TLS_FILES, tmp_path)  # the default interval
    monkeypatch.setattr(webconfig, "stamp", counting)
    files = 3  # web.yml, tls.crt, tls.key
    context = client_context(pki)
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=context, timeout=5)
    started = time.monotonic()
    for _ in range(200):
        conn.request("GET", "/metrics")
        conn.getresponse().read()
    elapsed = time.monotonic() - started
    conn.close()
    assert len(calls) <= files * (1 + int(elapsed)), (len(calls), elapsed)
    until(lambda: len(calls) >= 2 * files, "two looks at the files")
    looks = [when for when, path in calls if path.endswith("web.yml")]
    assert {path for _, path in calls} == {
        str(tmp_path / n) for n in ("web.yml", "tls.crt", "tls.key")
    }
    assert all(b - a >= webconfig.RELOAD_INTERVAL * 0.99 for a, b in itertools.pairwise(looks)), (
        looks
    )
    assert server.reloader is not None and server.reloader.stats.snapshot()[:2] == (0, 0)


def test_a_change_is_applied_once_it_settled(tmp_path):
    """The clock seam: no look before ``interval``; a change seen once waits for the next look
    (a certificate and its key written one after the other are read together)."""
    now = [1000.0]
    applied: list[WebConfig] = []
    path = write(tmp_path, USERS, "web.yml")
    reloader = webconfig.WebConfigReloader(
        load_web_config(path), applied.append, interval=1.0, monotonic=lambda: now[0]
    )
    assert not any(reloader.check() for _ in range(100)) and not applied
    write(tmp_path, "basic_auth_users: {}\n", "web.yml")
    now[0] += 0.999
    assert not reloader.check()  # not a second yet: not even looked at
    now[0] += 0.001
    assert not reloader.check() and not applied  # seen once: let it settle
    now[0] += 0.5
    assert not reloader.check()
    now[0] += 0.5
    assert reloader.check() and len(applied) == 1 and applied[0].users == {}
    now[0] += 1
    assert not reloader.check() and len(applied) == 1  # nothing new
    assert reloader.reload() and len(applied) == 2  # SIGHUP: at once, whatever the clock
    assert reloader.stats.snapshot()[:3] == (2, 0, True)


def test_sighup_reloads_the_web_config(tmp_path):
    """``kill -HUP``: the agent loads the web config file again at once (the watch's path)."""
    path = write(tmp_path, USERS, "web.yml")
    with agent.serve(tmp_path, "--simulate", "--web.config.file", path) as (proc, port):
        until(lambda: request_or_none(port), "the agent to listen")
        carol = bcrypt.hashpw(b"carol's", bcrypt.gensalt(4)).decode()
        write(tmp_path, f"basic_auth_users:\n  carol: {carol}\n", "web.yml")
        proc.send_signal(signal.SIGHUP)
        agent.logged_until(proc, "reloaded (SIGHUP)")
        assert request(port, headers=basic("carol", "carol's"))[0] == 200
        assert request(port, headers=basic("alice", "wonderland"))[0] == 401
        assert "only after a restart" not in agent.stderr_of(proc)


def test_the_reload_metrics_are_documented_and_parse_as_openmetrics():
    """The ``gpu_exporter_web_config_*`` lines (rendered per scrape, so not in the sample's
    exposition that test_fields checks) are in docs/metrics.md, and well formed in both
    formats."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from exporter.exposition.metrics import render_web_config

    text = render_web_config(2, 1, False, 1700000000.25).decode()
    doc = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert names and all(f"`{name}`" in doc for name in names), names
    found = samples(text.encode())
    assert one(found, "gpu_exporter_web_config_reloads_total", result="failure") == 1
    assert one(found, "gpu_exporter_web_config_last_reload_success_timestamp_seconds") == (
        1700000000.25
    )
    om = render_web_config(2, 1, False, 0.0, openmetrics=True).decode() + "# EOF\n"
    families = {f.name: f.type for f in text_string_to_metric_families(om)}
    assert families["gpu_exporter_web_config_reloads"] == "counter"
