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
ignored.

The file is read at start (and by ``check-config``), then watched (:class:`WebConfigReloader`):
once a second the file and the certificate, key and client CA files it names are stat'ed (device,
inode, size, modification and change times); when one changed, and stayed so for one more check,
the file is loaded again and, when it is good, the new TLS context (for new connections), users
and headers replace the running ones. A file that does not load keeps the running configuration.
SIGHUP reloads it at once, the same way.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from exporter.config.validate import boolean
from exporter.config.yamlconf import ConfigError, Section, load_document
from exporter.web.server import load_certificate, load_client_ca
from exporter.web.stats import ReloadStats

log = logging.getLogger(__name__)

#: Seconds between two looks at the web config's files.
RELOAD_INTERVAL = 1.0

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


#: What says a file changed: (device, inode, size, mtime ns, ctime ns), or (-1, errno) when it
#: cannot be stat'ed (a missing file mid-rotation).
Stamp = tuple[int, ...]


def stamp(path: str) -> Stamp:
    """``path``'s :data:`Stamp` now (links followed, as a Kubernetes volume's are)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return (-1, exc.errno or 0)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class WebConfig:
    """A loaded web configuration: the TLS context (None: plain HTTP), the basic-auth users
    (name to bcrypt hash; none: no authentication) and the extra response headers.

    ``stamps``: the files it was read from (the file itself, then the TLS files it names), each
    with its :data:`Stamp` taken before it was read."""

    path: str
    ssl_context: ssl.SSLContext | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: tuple[tuple[str, str], ...] = ()
    stamps: tuple[tuple[str, Stamp], ...] = ()


def load_web_config(path: str, seen: MutableMapping[str, Stamp] | None = None) -> WebConfig:
    """Read and check the web configuration at ``path``; ConfigError with file:line.

    ``seen`` gets each file read (or named) so far with its :data:`Stamp` taken before reading,
    also when the load fails: what to watch for a change that may fix it."""
    seen = {} if seen is None else seen
    seen[path] = stamp(path)
    doc = load_document(path)
    root = doc.root()
    folder = os.path.dirname(os.path.abspath(path))
    _refuse_unsupported(root, "")
    tls = root.section("tls_server_config")
    _refuse_unsupported(tls, "tls_server_config")
    context = _tls_context(tls, folder, seen)
    http = root.section("http_server_config")
    http.get("http2", boolean, True)  # HTTP/2 is never offered: true or false, all the same
    headers = _headers(http.section("headers"))
    users = _users(root.section("basic_auth_users"))
    for section in (root, http):
        section.done()
    return WebConfig(path, context, users, headers, tuple(seen.items()))


def _refuse_unsupported(section: Section, name: str) -> None:
    for key, instead in _UNSUPPORTED[name].items():
        if section.has(key):
            raise section.error(key, f"not supported by gpu-exporter; {instead}")


def _text(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"expected a string, got {raw!r}")
    return raw


def _file_in(folder: str, seen: MutableMapping[str, Stamp]) -> Any:
    def parse(raw: Any) -> str:
        path = os.path.join(folder, _text(raw))
        seen[path] = stamp(path)
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


def _tls_context(
    tls: Section, folder: str, seen: MutableMapping[str, Stamp]
) -> ssl.SSLContext | None:
    """The server's TLS context; None when the section names no certificate (plain HTTP)."""
    cert_file = tls.get("cert_file", _file_in(folder, seen), None)
    key_file = tls.get("key_file", _file_in(folder, seen), None)
    auth = tls.get("client_auth_type", _choice(CLIENT_AUTH_TYPES, _NOT_OFFERED), "NoClientCert")
    client_ca = tls.get("client_ca_file", _file_in(folder, seen), None)
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


class WebConfigReloader:
    """Keeps a running server's web configuration up to date with its files, without a restart.

    ``check`` (from the reloader's thread, once every ``interval`` seconds at most) stats the
    files the last load read: the web config file and the certificate, key and client CA files
    it names. When one changed, and is the same at the next check (so a certificate and a key
    written one after the other are read together), the file is loaded again (``reload``):

    - a good file goes to ``apply`` (which swaps the server's TLS context, users and headers)
      and is counted as a success;
    - a file that does not load (bad YAML, an unknown key, a certificate that does not load or a
      key that does not match it, a file missing mid-rotation) keeps the running configuration
      and is counted as a failure, logged at ERROR once per distinct message (again at DEBUG);
      a change to one of the files it read tries again;
    - a file that would switch TLS on or off is refused the same way: the listener was made with
      or without TLS, and its scrapers with it (a restart does it).

    ``reload`` is also SIGHUP's, unconditional. Checks and reloads hold one lock, so SIGHUP and
    the thread never load at once; loading (YAML, certificates, bcrypt for a new stand-in hash)
    never runs on the server's event loop.
    """

    def __init__(
        self,
        loaded: WebConfig,
        apply: Callable[[WebConfig], None],
        *,
        interval: float = RELOAD_INTERVAL,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.current = loaded
        self.apply = apply
        self.interval = interval
        self._monotonic, self._wall = monotonic, wall
        self.stats = ReloadStats(wall())
        #: The files the last load read, as it found them; a change to any one is a change.
        self._seen: dict[str, Stamp] = dict(loaded.stamps) or {loaded.path: stamp(loaded.path)}
        self._pending: dict[str, Stamp] | None = None  # a change seen once, not applied yet
        self._checked = monotonic()
        self._last_error: str | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> WebConfigReloader:
        self._thread = threading.Thread(target=self._run, name="web-config-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.wait(max(0.0, self._checked + self.interval - self._monotonic())):
            try:
                self.check()
            except Exception:  # a bug: the watch goes on, the server is not touched
                log.exception("web config watch failed")

    def check(self) -> bool:
        """Look at the files (at most once every ``interval`` seconds); reload when a change
        has settled. Whether it reloaded."""
        with self._lock:
            now = self._monotonic()
            if now - self._checked < self.interval:
                return False
            self._checked = now
            found = {path: stamp(path) for path in self._seen}
            if found == self._seen:
                self._pending = None
                return False
            if found != self._pending:  # changed since the last look: let it settle
                self._pending = found
                return False
            log.debug("web config files changed: %s", _changed(self._seen, found))
            return self._reload("its files changed")

    def reload(self, why: str = "SIGHUP") -> bool:
        """Load the web config file again now and apply it when good; whether it was."""
        with self._lock:
            self._checked = self._monotonic()
            return self._reload(why)

    def _reload(self, why: str) -> bool:
        seen: dict[str, Stamp] = {}
        old = self.current
        try:
            new = load_web_config(old.path, seen)
            if (new.ssl_context is None) != (old.ssl_context is None):
                raise ConfigError(
                    old.path,
                    "tls_server_config",
                    "TLS cannot be switched on by a reload (the agent serves plain HTTP): "
                    "restart the agent to serve HTTPS"
                    if old.ssl_context is None
                    else "TLS cannot be switched off by a reload (the agent serves HTTPS): "
                    "restart the agent to serve plain HTTP",
                )
            self.apply(new)
        except ConfigError as exc:
            return self._failed(str(exc), seen, why)
        except Exception as exc:  # a bug, or an error the loader does not turn into a message
            log.debug("web config reload failed", exc_info=True)
            return self._failed(f"{old.path}: {type(exc).__name__}: {exc}", seen, why)
        finally:
            self._seen = seen or {old.path: stamp(old.path)}
            self._pending = None
        self.current = new
        self.stats.success(self._wall())
        self._last_error = None
        log.info("web config %s reloaded (%s): %s", old.path, why, _summary(old, new))
        return True

    def _failed(self, message: str, seen: Mapping[str, Stamp], why: str) -> bool:
        self.stats.failure()
        if message != self._last_error:
            log.error(
                "web config reload (%s) failed, the running configuration stays: %s",
                why,
                message,
            )
            self._last_error = message
        else:
            log.debug("web config reload (%s) failed again: %s", why, message)
        return False


def _changed(before: Mapping[str, Stamp], after: Mapping[str, Stamp]) -> str:
    return ", ".join(path for path in after if before.get(path) != after[path])


def _summary(old: WebConfig, new: WebConfig) -> str:
    """What a reload changed, in words."""
    before, after = dict(old.stamps), dict(new.stamps)
    tls = [path for path in after if path != new.path and before.get(path) != after[path]]
    parts = []
    if new.ssl_context is not None:
        parts.append(f"TLS files changed: {', '.join(tls)}" if tls else "TLS files unchanged")
    if dict(new.users) != dict(old.users):
        parts.append(f"basic_auth_users changed ({len(new.users)} users)")
    if new.headers != old.headers:
        parts.append("headers changed")
    return "; ".join(parts) or "nothing else changed"
