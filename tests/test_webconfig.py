"""The exporter-toolkit web config (``--web.config.file``): TLS, basic auth and headers, on the
real server; its errors name file and line and exit 2."""

from __future__ import annotations

import base64
import shutil
import socket
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import bcrypt
import pytest

import exporter.cli
from exporter.config.yamlconf import ConfigError
from exporter.exposition.metrics import render
from exporter.sampling.sampler import Sampler
from exporter.web.auth import BasicAuth
from exporter.web.routes import App, Server, serve
from exporter.web.webconfig import WebConfig, load_web_config
from tests import agent
from tests.helpers import line_of, until, write

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
