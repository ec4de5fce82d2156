"""The Prometheus exporter-toolkit web configuration file (``--web.config.file``).

The format node_exporter, dcgm-exporter and every exporter built on exporter-toolkit read
(https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md):

- ``tls_server_config``: ``cert_file``, ``key_file``, ``client_auth_type``, ``client_ca_file``,
  ``min_version``, ``max_version``, ``prefer_server_cipher_suites``;
- ``http_server_config``: ``headers`` (the five the toolkit allows), ``http2`` (accepted; HTTP/2 is
  never offered);
- ``basic_auth_users``: user name to bcrypt hash.

Relative paths are relative to the file's folder, as the toolkit has them. Unknown keys are
errors naming file and line; keys the toolkit has but gpu-exporter does not implement (inline
PEM, cipher and curve lists, allowed SANs, ``rate_limit``) are errors that say so, never silently
ignored. The file is read once, at start (and by ``check-config``); a change needs a restart.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from exporter.config.validate import boolean
from exporter.config.yamlconf import Section, load_document
from exporter.web.server import load_certificate, load_client_ca

#: client_auth_type -> what the server's TLS context asks of a client. The toolkit's
#: RequestClientCert asks for a certificate and checks nothing, so no client is refused: the
#: same as not asking. RequireAnyClientCert (any certificate, checked by nobody) is not offered:
#: Python's ssl module checks every certificate it asks for.
CLIENT_AUTH_TYPES: Mapping[str, ssl.VerifyMode] = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_NOT_OFFERED = {
    "RequireAnyClientCert": "not supported: it takes any certificate, checked by nobody "
    "(Python's ssl module checks every certificate it asks for); use RequireAndVerifyClientCert "
    "with client_ca_file",
}
TLS_VERSIONS: Mapping[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
#: The response headers the toolkit lets a web config set, with their allowed values (None:
#: any). Content-Type, Content-Length and the rest stay the server's.
HEADERS: Mapping[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
#: Keys of the toolkit's format that gpu-exporter does not implement, and what to do instead.
_UNSUPPORTED = {
    "tls_server_config": {
        "cert": "use cert_file",
        "key": "use key_file",
        "client_ca": "use client_ca_file",
        "client_allowed_sans": "check client certificates with client_ca_file",
        "cipher_suites": "the system's OpenSSL defaults apply",
        "curve_preferences": "the system's OpenSSL defaults apply",
    },
    "": {"rate_limit": "limit connections with web.max_connections"},
}
#: A bcrypt hash as htpasswd -B, Go's bcrypt and Python's bcrypt write it.
_BCRYPT = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
#: A header value: visible ASCII and spaces, no line breaks.
_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")


@dataclass(frozen=True)
class WebConfig:
    """A loaded web configuration: the TLS context (None: plain HTTP), the basic-auth users
    (name to bcrypt hash; none: no authentication) and the extra response headers."""

    path: str
    ssl_context: ssl.SSLContext | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: tuple[tuple[str, str], ...] = ()


def load_web_config(path: str) -> WebConfig:
    """Read and check the web configuration at ``path``; ConfigError with file:line."""
    doc = load_document(path)
    root = doc.root()
    folder = os.path.dirname(os.path.abspath(path))
    _refuse_unsupported(root, "")
    tls = root.section("tls_server_config")
    _refuse_unsupported(tls, "tls_server_config")
    context = _tls_context(tls, folder)
    http = root.section("http_server_config")
    http.get("http2", boolean, True)  # HTTP/2 is never offered: true or false, all the same
    headers = _headers(http.section("headers"))
    users = _users(root.section("basic_auth_users"))
    for section in (root, http):
        section.done()
    return WebConfig(path, context, users, headers)


def _refuse_unsupported(section: Section, name: str) -> None:
    for key, instead in _UNSUPPORTED[name].items():
        if section.has(key):
            raise section.error(key, f"not supported by gpu-exporter; {instead}")


def _text(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"expected a string, got {raw!r}")
    return raw


def _file_in(folder: str) -> Any:
    def parse(raw: Any) -> str:
        path = os.path.join(folder, _text(raw))
        if not os.path.isfile(path):
            raise ValueError(f"file {path!r} does not exist")
        return path

    return parse


def _choice(choices: Mapping[str, Any], refused: Mapping[str, str] | None = None) -> Any:
    def parse(raw: Any) -> str:
        text = _text(raw)
        if refused and text in refused:
            raise ValueError(refused[text])
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def _tls_context(tls: Section, folder: str) -> ssl.SSLContext | None:
    """The server's TLS context; None when the section names no certificate (plain HTTP)."""
    cert_file = tls.get("cert_file", _file_in(folder), None)
    key_file = tls.get("key_file", _file_in(folder), None)
    auth = tls.get("client_auth_type", _choice(CLIENT_AUTH_TYPES, _NOT_OFFERED), "NoClientCert")
    client_ca = tls.get("client_ca_file", _file_in(folder), None)
    minimum = tls.get("min_version", _choice(TLS_VERSIONS), "TLS12")
    maximum = tls.get("max_version", _choice(TLS_VERSIONS), "TLS13")
    prefer_server = tls.get("prefer_server_cipher_suites", boolean, True)
    tls.done()
    if cert_file is None and key_file is None:
        if tls.data:
            given = next(iter(tls.data))
            raise tls.error(given, "needs cert_file and key_file (without them, plain HTTP)")
        return None
    if cert_file is None or key_file is None:
        missing = "cert_file" if cert_file is None else "key_file"
        raise tls.error(None, f"needs {missing} too")
    if TLS_VERSIONS[minimum] > TLS_VERSIONS[maximum]:
        raise tls.error("min_version", f"{minimum} is above max_version {maximum}")
    verify = CLIENT_AUTH_TYPES[auth]
    if verify != ssl.CERT_NONE and client_ca is None:
        raise tls.error("client_auth_type", f"{auth} needs client_ca_file")
    if auth == "NoClientCert" and client_ca is not None:
        raise tls.error(
            "client_ca_file",
            "set client_auth_type to RequireAndVerifyClientCert (or VerifyClientCertIfGiven) "
            "for it to be used",
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[minimum]
    context.maximum_version = TLS_VERSIONS[maximum]
    if prefer_server:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    try:
        if client_ca is not None and verify != ssl.CERT_NONE:
            load_client_ca(context, client_ca)
            context.verify_mode = verify
        load_certificate(context, cert_file, key_file)
    except OSError as exc:  # ssl.SSLError included
        key = "cert_file" if "certificate" in str(exc) else "client_ca_file"
        raise tls.error(key, str(exc)) from None
    return context


def _headers(section: Section) -> tuple[tuple[str, str], ...]:
    out = []
    for name in list(section.data):
        if name not in HEADERS:
            raise section.error(
                name, f"cannot be set (the headers a web config may set: {', '.join(HEADERS)})"
            )
        allowed = HEADERS[name]

        def parse(raw: Any, allowed: tuple[str, ...] | None = allowed) -> str:
            text = _text(raw)
            if not _HEADER_VALUE.fullmatch(text):
                raise ValueError("must be visible ASCII characters and spaces")
            if allowed is not None and text not in allowed:
                raise ValueError(f"must be one of {', '.join(allowed)}, got {text!r}")
            return text

        value = section.get(name, parse)
        if value:  # blank: unset, as the toolkit has it
            out.append((name, value))
    section.done()
    return tuple(out)


def _bcrypt_hash(raw: Any) -> bytes:
    text = _text(raw).strip()
    match = _BCRYPT.fullmatch(text)
    if match is None:
        raise ValueError(
            "must be a bcrypt hash ($2y$10$ and 53 more characters; make one with "
            "htpasswd -nBC 10 \"\" | tr -d ':\\n')"
        )
    if not 4 <= int(match.group(1)) <= 31:
        raise ValueError(f"bcrypt cost must be from 4 to 31, got {match.group(1)}")
    return text.encode("ascii")


def _users(section: Section) -> dict[str, bytes]:
    users = {}
    for name in list(section.data):
        if not isinstance(name, str) or ":" in name:
            raise section.error(name, "a user name must be a string without ':'")
        users[name] = section.get(name, _bcrypt_hash)
    section.done()
    return users
