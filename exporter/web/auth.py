"""HTTP basic authentication against the web config's bcrypt hashes, as a WSGI wrapper.

Every way to fail (no header, another scheme, bad base64, unknown user, wrong password) gets the
same ``401`` with ``WWW-Authenticate: Basic realm="gpu-exporter"`` and the same body: nothing says
which part was wrong. An unknown user's password is checked against a stand-in hash of the
highest cost among the configured ones, so the time taken does not tell users apart either;
bcrypt compares in constant time. One bcrypt check runs at a time (as exporter-toolkit's), so a
flood of bad passwords holds one CPU, not all.

A successful check is remembered for ``ttl`` seconds, keyed by an HMAC (with a key made at start)
of the user and password, at most ``size`` of them: scrapes do not pay bcrypt (tens of
milliseconds) every time, and the cache holds no password.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import bcrypt

REALM = "gpu-exporter"
UNAUTHORIZED_BODY = b"401 Unauthorized\n"
#: How long a successful check is remembered, and how many are.
CACHE_SECONDS = 60.0
CACHE_SIZE = 64

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class BasicAuth:
    """Wraps ``app``: a request passes with a right user and password, or to ``open_paths``."""

    def __init__(
        self,
        app: WsgiApp,
        users: Mapping[str, bytes],
        open_paths: Collection[str] = (),
        *,
        ttl: float = CACHE_SECONDS,
        size: int = CACHE_SIZE,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.users = {name.encode("utf-8"): hashed for name, hashed in users.items()}
        self.open_paths = frozenset(open_paths)
        self.ttl, self.size, self._monotonic = ttl, size, monotonic
        cost = max((int(h.split(b"$")[2]) for h in self.users.values()), default=10)
        self._stand_in = bcrypt.hashpw(os.urandom(16).hex().encode(), bcrypt.gensalt(cost))
        self._key = os.urandom(32)
        self._passed: OrderedDict[bytes, float] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()
        #: bcrypt checks made (cache misses): for tests and curiosity.
        self.checks = 0

    def inline(self, environ: dict[str, Any]) -> bool:
        """Whether a request is answered without blocking: no bcrypt check to make (an open
        path, no credentials, or credentials that passed lately) and the app says so too."""
        if environ.get("PATH_INFO") not in self.open_paths:
            credentials = _credentials(environ.get("HTTP_AUTHORIZATION"))
            if credentials is None:
                return True  # a 401 at once
            if not self._remembered(credentials, self._monotonic()):
                return False
        inline = getattr(self.app, "inline", None)
        return bool(inline(environ)) if callable(inline) else False

    def cached(self) -> int:
        """How many passed checks are remembered now (at most ``size``)."""
        return len(self._passed)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") in self.open_paths or self.allowed(
            environ.get("HTTP_AUTHORIZATION")
        ):
            return self.app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", f'Basic realm="{REALM}"'),
                ("Content-Length", str(len(UNAUTHORIZED_BODY))),
            ],
        )
        return [UNAUTHORIZED_BODY]

    def allowed(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value names a user with the right password."""
        credentials = _credentials(authorization)
        if credentials is None:
            return False
        now = self._monotonic()
        if self._remembered(credentials, now):
            return True
        user, _, password = credentials.partition(b":")
        stored = self.users.get(user)
        hashed = stored if stored is not None else self._stand_in
        with self._bcrypt_lock:
            self.checks += 1
            try:
                right = bcrypt.checkpw(password, hashed)
            except ValueError:  # over 72 bytes, say: no hash matches it
                right = False
        if not (right and stored is not None):
            return False
        key = self._cache_key(credentials)
        with self._cache_lock:
            self._passed[key] = now + self.ttl
            self._passed.move_to_end(key)
            while len(self._passed) > self.size:
                self._passed.popitem(last=False)
        return True

    def _cache_key(self, credentials: bytes) -> bytes:
        return hmac.new(self._key, credentials, hashlib.sha256).digest()

    def _remembered(self, credentials: bytes, now: float) -> bool:
        """Whether ``credentials`` passed a check less than ``ttl`` seconds before ``now``."""
        key = self._cache_key(credentials)
        with self._cache_lock:
            until = self._passed.get(key)
            return until is not None and until > now


def _credentials(authorization: str | None) -> bytes | None:
    """``user:password`` of a Basic ``Authorization`` value; None when it is not one."""
    if not authorization:
        return None
    scheme, _, encoded = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    return decoded if b":" in decoded else None
