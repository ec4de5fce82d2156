"""HTTPS and client-certificate authentication, with certificates the test makes."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from exporter.core.nvml import Nvml
from exporter.core.procfs import ProcFs
from exporter.exposition.metrics import render
from exporter.sampling.collect import Collector
from exporter.sampling.sampler import Sampler
from exporter.web.routes import App, serve

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _make_pki(tmp: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        str(tmp / "ca.key"),
        "-out",
        str(tmp / "ca.pem"),
    )
    _issue(tmp, "server", "subjectAltName=IP:127.0.0.1")
    _issue(tmp, "client", "extendedKeyUsage=clientAuth")
    return {p.stem + p.suffix: str(p) for p in tmp.iterdir()}


def _issue(tmp: Path, name: str, ext: str = "subjectAltName=IP:127.0.0.1") -> tuple[str, str]:
    """A new key and a certificate for it with subject ``CN=name``, signed by ``tmp``'s CA
    (a serial of its own): ``tmp/name.pem`` and ``tmp/name.key``. A server's, by default."""
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        str(tmp / f"{name}.key"),
        "-out",
        str(tmp / f"{name}.csr"),
    )
    (tmp / f"{name}.ext").write_text(ext + "\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(tmp / f"{name}.csr"),
        "-CA",
        str(tmp / "ca.pem"),
        "-CAkey",
        str(tmp / "ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(tmp / f"{name}.ext"),
        "-out",
        str(tmp / f"{name}.pem"),
    )
    return str(tmp / f"{name}.pem"), str(tmp / f"{name}.key")


@pytest.fixture
def pki(tmp_path):
    return _make_pki(tmp_path)


def _start(simulated, **tls):
    driver = simulated("gpus: [{name: GPU A}]\n")
    sampler = Sampler(
        Collector(Nvml(library=driver), ProcFs()), interval=1, deadline=1, render=render
    )
    sampler.sample_once()
    return serve(App(sampler), "127.0.0.1", 0, **tls)


def _get(port: int, context: ssl.SSLContext) -> bytes:
    with urllib.request.urlopen(
        f"https://127.0.0.1:{port}/metrics", context=context, timeout=5
    ) as r:
        return r.read()


def test_https(simulated, pki):
    server = _start(simulated, cert_file=pki["server.pem"], key_file=pki["server.key"])
    try:
        context = ssl.create_default_context(cafile=pki["ca.pem"])
        assert b"gpu_up" in _get(server.port, context)
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP on TLS
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
    finally:
        server.close()


def test_client_certificate_required(simulated, pki):
    server = _start(
        simulated,
        cert_file=pki["server.pem"],
        key_file=pki["server.key"],
        client_ca_file=pki["ca.pem"],
    )
    try:
        anonymous = ssl.create_default_context(cafile=pki["ca.pem"])
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _get(server.port, anonymous)
        trusted = ssl.create_default_context(cafile=pki["ca.pem"])
        trusted.load_cert_chain(pki["client.pem"], pki["client.key"])
        assert b"gpu_up" in _get(server.port, trusted)
    finally:
        server.close()


def test_client_certificate_of_another_ca_is_refused(simulated, pki, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    stranger = _make_pki(other)  # its own CA: a client certificate the server never trusted
    server = _start(
        simulated,
        cert_file=pki["server.pem"],
        key_file=pki["server.key"],
        client_ca_file=pki["ca.pem"],
    )
    try:
        context = ssl.create_default_context(cafile=pki["ca.pem"])
        context.load_cert_chain(stranger["client.pem"], stranger["client.key"])
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _get(server.port, context)
        trusted = ssl.create_default_context(cafile=pki["ca.pem"])
        trusted.load_cert_chain(pki["client.pem"], pki["client.key"])
        with urllib.request.urlopen(
            f"https://127.0.0.1:{server.port}/healthz", context=trusted, timeout=5
        ) as response:
            assert response.status == 200  # the server is fine: only the stranger was refused
    finally:
        server.close()
