"""HTTP routes over the latest Snapshot: ``/metrics``, ``/healthz``, ``/snapshot``, ``/history``,
``/health/gpus``, ``/recommend``, ``/peers``, the status page ``/`` and its assets.

No route calls NVML or procfs: they read ``sampler.latest`` (and ``sampler.history()``). Each
route is one :class:`Route` in ``App.routes``, which says where the server runs it: on its event
loop (``inline``, only for a route that hands out bytes made before) or, by default, on a worker
thread. The server is
``exporter.web.server``: one event loop thread, llhttp for parsing, deadlines and limits
against hostile clients, keep-alive, TLS and client-certificate authentication; basic
authentication and extra headers come from the web config (``exporter.web.webconfig``).

``/metrics`` speaks the Prometheus text format, or OpenMetrics when the scraper asks for it in
``Accept`` (Prometheus does), gzipped when it asks for that in ``Accept-Encoding``.
"""

from __future__ import annotations

import json
import logging
import re
import ssl
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from html import escape
from types import MappingProxyType
from typing import Any, Protocol
from urllib.parse import parse_qs

from exporter import __version__
from exporter.config.validate import positive
from exporter.core.findings import (
    Findings,
    HealthVerdicts,
    Recommendations,
    ThermalLevels,
    Waste,
    ZombieHolders,
)
from exporter.core.health import health_document
from exporter.core.selection import Policy, Recommendation
from exporter.core.visible import check_well_formed, visible_uuids
from exporter.exposition.metrics import (
    CONTENT_TYPE,
    OPENMETRICS_CONTENT_TYPE,
    OPENMETRICS_EOF,
    openmetrics,
    render_http,
    render_liveness,
    render_web_config,
)
from exporter.sampling.sampler import Sampler
from exporter.web import page
from exporter.web.auth import BasicAuth
from exporter.web.compress import GzipCache
from exporter.web.history import history_document
from exporter.web.peers import PeerWatcher
from exporter.web.server import HttpServer, Options, WsgiApp, tls_context
from exporter.web.stats import HttpStats, ReloadStats
from exporter.web.webconfig import RELOAD_INTERVAL, WebConfig, WebConfigReloader


class Actions(Protocol):
    """What the routes need of the action engine (web never imports actions: the composition
    root hands the engine in)."""

    def exposition(self) -> bytes:
        """The actions' metrics as rendered after their last runs."""

    def policies(self) -> Mapping[str, Policy]:
        """The configured recommendation policies by name."""

    def recommend(
        self, policy_name: str, params: Mapping[str, str], visible: Collection[str] | None = None
    ) -> Recommendation:
        """Recommend now under a known policy with overrides; ValueError for a bad one."""

    @property
    def findings(self) -> Findings:
        """What the actions found (``core.findings``), by kind."""


log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
_MAX_QUERY = 4096
#: A ``%`` not followed by two hex digits (parse_qs would keep it as is).
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
#: A control character (NUL included), raw or %-escaped.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]|%[01][0-9A-Fa-f]|%7[Ff]")
LISTEN_BACKLOG = 128
_LANDING = """<!doctype html>
<html><head><meta charset="utf-8"><title>gpu-exporter</title></head>
<body><h1>gpu-exporter {version}</h1>
<p>{status}</p>
<ul>
<li><a href="metrics">/metrics</a>: Prometheus metrics</li>
<li><a href="healthz">/healthz</a>: 200 while the Snapshot is fresh and NVML answers</li>
<li><a href="snapshot">/snapshot</a>: the latest Snapshot as JSON
(<code>?gpu=INDEX|UUID</code>, repeatable)</li>
<li><a href="health/gpus">/health/gpus</a>: each GPU's health verdict as JSON
(<code>?gpu=INDEX|UUID</code>, repeatable)</li>
<li><a href="history">/history</a>: the last minutes of each GPU as JSON
(<code>?seconds=S&amp;gpu=INDEX|UUID</code>)</li>
<li><a href="recommend">/recommend</a>: the GPUs to use now
(<code>?policy=NAME&amp;count=N&amp;min_free_memory=8GiB&amp;max_utilization=0.1&amp;max_temperature=80&amp;exclusive=true&amp;mig=false&amp;visible=0,1</code>)</li>
</ul></body></html>
"""


class BadRequest(Exception):
    """A client error: status line and a one-line message."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Response:
    """A route's answer; ``parts``, when given, are the body (sent in order, never joined)."""

    status: str
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    parts: tuple[bytes, ...] = ()


#: A route's handler: the parsed query parameters and the WSGI environ to the answer.
Handler = Callable[[dict[str, list[str]], dict[str, Any]], Response]


@dataclass(frozen=True)
class Route:
    """One route of the table: its handler, the query parameters it takes (any other is a
    400), and whether it answers at once on the server's event loop.

    ``inline=True`` only for a route that hands out bytes made before (the exposition rendered
    once per sample, the status page's files): the loop serves every connection, and a route
    that builds its answer per request there would stall them all. The default is a worker
    thread, so a route that says nothing cannot.
    """

    handler: Handler
    params: frozenset[str] = frozenset()
    inline: bool = False


def _text(status: str, message: str) -> Response:
    return Response(status, "text/plain; charset=utf-8", (message + "\n").encode())


class App:
    """The WSGI application; every route reads the sampler's latest publication."""

    def __init__(
        self,
        sampler: Sampler,
        engine: Actions | None = None,
        peers: PeerWatcher | None = None,
        routes: Mapping[str, Route] | None = None,
    ) -> None:
        """``routes``: more routes by path (another module's), beside the app's own; a path
        the app serves already is a ValueError."""
        self.sampler = sampler
        self.engine = engine
        self.peers = peers
        own = {
            "/": Route(self.landing),
            "/metrics": Route(self.metrics, inline=True),
            "/healthz": Route(self.healthz, inline=True),
            "/snapshot": Route(self.snapshot, frozenset({"gpu"})),
            "/history": Route(self.history, frozenset({"gpu", "seconds"})),
            "/health/gpus": Route(self.health_gpus, frozenset({"gpu"})),
            "/recommend": Route(self.recommend, RECOMMEND_PARAMS),
            "/peers": Route(self.peer_list),  # JSON made per request, small as it is
            **{path: Route(self.asset, inline=True) for path in page.STATIC},
        }
        taken = sorted(own.keys() & (routes or {}).keys())
        if taken:
            raise ValueError(f"route {taken[0]!r} is one of the app's own")
        #: Every route by path (read-only: the counters below take its paths once).
        self.routes: Mapping[str, Route] = MappingProxyType({**own, **(routes or {})})
        #: The server's counters (``gpu_exporter_http_*``); requests by route, else ``other``.
        self.http = HttpStats(self.routes)
        #: The web config's reloads (``gpu_exporter_web_config_*``); None: no web config.
        self.web_config: ReloadStats | None = None
        self._gzip = {False: GzipCache(), True: GzipCache()}  # by OpenMetrics or not

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        try:
            response = self._dispatch(environ)
        except BadRequest as exc:
            response = _text(exc.status, str(exc))
        except Exception:  # never a traceback to the client, and the server goes on
            log.exception("error serving %s", environ.get("PATH_INFO"))
            response = _text("500 Internal Server Error", "internal error; see the agent's log")
        parts = response.parts or (response.body,)
        headers = [
            ("Content-Type", response.content_type),
            *response.headers,
            ("Content-Length", str(sum(map(len, parts)))),
        ]
        start_response(response.status, headers)
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else list(parts)

    def inline(self, environ: dict[str, Any]) -> bool:
        """Whether the server may call the app for ``environ`` on its event loop: a route that
        says so (``Route.inline``), and a path that is none (a 404 costs nothing); every other
        route runs on a worker thread, so a slow one never stalls the other connections."""
        route = self.routes.get(environ.get("PATH_INFO") or "/")
        return route.inline if route is not None else True

    def _dispatch(self, environ: dict[str, Any]) -> Response:
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):  # on every path: no route takes another method
            response = _text("405 Method Not Allowed", f"{method} is not allowed; use GET")
            return Response(
                response.status, response.content_type, response.body, (("Allow", "GET, HEAD"),)
            )
        path = environ.get("PATH_INFO") or "/"
        route = self.routes.get(path)
        if route is None:
            raise BadRequest("404 Not Found", f"no such path {path!r}; see / for the routes")
        return route.handler(self._params(environ.get("QUERY_STRING", ""), route.params), environ)

    @staticmethod
    def _params(query: str, allowed: frozenset[str]) -> dict[str, list[str]]:
        if not query:
            return {}
        if len(query) > _MAX_QUERY:
            raise BadRequest("414 URI Too Long", f"query string longer than {_MAX_QUERY} bytes")
        if _BAD_ESCAPE.search(query):
            raise BadRequest("400 Bad Request", "malformed query string: bad %-escape")
        if _CONTROL.search(query):
            raise BadRequest("400 Bad Request", "malformed query string: control character")
        try:
            params = parse_qs(
                query,
                keep_blank_values=True,
                strict_parsing=bool(query),
                errors="strict",
                max_num_fields=64,
            )
        except ValueError as exc:  # UnicodeDecodeError included
            raise BadRequest("400 Bad Request", f"malformed query string: {exc}") from None
        for name in params:
            if name not in allowed:
                accepted = ", ".join(sorted(allowed)) or "none"
                raise BadRequest(
                    "400 Bad Request",
                    f"unknown query parameter {name!r} (accepted here: {accepted})",
                )
        return params

    # -- routes ---------------------------------------------------------------------------

    def landing(self, params: dict[str, list[str]], environ: dict[str, Any]) -> Response:
        """The status page (``web.page``) of the latest Snapshot; before the first sample,
        the list of routes and why there is nothing to show yet."""
        if self.sampler.latest is None:
            health = self.sampler.health()
            status = escape(f"Not healthy: {health.reason}")  # NVML's words, among others
            text = _LANDING.format(version=__version__, status=status)
            return Response(
                "503 Service Unavailable", "text/html; charset=utf-8", text.encode(), page.HEADERS
            )
        body = page.render(
            self.document(),
            version=__version__,
            interval=self.sampler.interval,
            peers=self.peers.summaries() if self.peers is not None else None,
        )
        return Response("200 OK", "text/html; charset=utf-8", body, page.HEADERS)

    def asset(self, params: dict[str, list[str]], environ: dict[str, Any]) -> Response:
        """The status page's script and stylesheet (``web/static``)."""
        content_type, body = page.STATIC[environ.get("PATH_INFO", "")]
        return Response("200 OK", content_type, body, page.HEADERS)

    def peer_list(self, params: dict[str, list[str]], environ: dict[str, Any]) -> Response:
        """The peers' summary rows (``web.peers``), as the agent last fetched them."""
        if self.peers is None:
            raise BadRequest("404 Not Found", "no peers configured (setting peers)")
        return Response("200 OK", "application/json", self.peers.document())

    def metrics(self, params: dict[str, list[str]], environ: dict[str, Any]) -> Response:
        """The sample's exposition and the actions' (both rendered before, in either format),
        then the lines of this scrape: the Snapshot's age and the HTTP server's counters."""
        published = self.sampler.latest
        health = self.sampler.health()
        om = openmetrics_preferred(environ.get("HTTP_ACCEPT"))
        kept = (
            published.exposition if published else b"",
            self.engine.exposition() if self.engine else b"",
        )
        if om:
            kept = (openmetrics(kept[0]), openmetrics(kept[1]))
        connections, rejected, requests = self.http.snapshot()
        tail = render_liveness(health.age_seconds, health.stale) + render_http(
            connections, rejected, requests, openmetrics=om
        )
        if self.web_config is not None:
            tail += render_web_config(*self.web_config.snapshot(), openmetrics=om)
        if om:
            tail += OPENMETRICS_EOF
        content_type = OPENMETRICS_CONTENT_TYPE if om else CONTENT_TYPE
        headers: tuple[tuple[str, str], ...] = (("Vary", "Accept, Accept-Encoding"),)
        if gzip_preferred(environ.get("HTTP_ACCEPT_ENCODING")):
            parts = tuple(self._gzip[om].compress(kept, tail))
            headers += (("Content-Encoding", "gzip"),)
        else:
            parts = (*kept, tail)
        return Response("200 OK", content_type, b"", headers, parts)

    def healthz(self, params: dict[str, list[str]], environ: dict[str, Any]) -> Response:
        health = self.sampler.health()
        return _text("200 OK" if health.ok else "503 Service Unavailable", health.reason)

    def recommend(self, params: dict[str, list[str]], environ: dict[str, Any]) -> Response:
        if self.engine is None:
            raise BadRequest("404 Not Found", "recommendations need the action engine")
        if self.sampler.latest is None:
            raise BadRequest("503 Service Unavailable", "no sample yet")
        single = {}
        for name, values in params.items():
            if len(values) > 1:
                raise BadRequest(
                    "400 Bad Request", f"query parameter {name!r} given more than once"
                )
            single[name] = values[0]
        policy = single.pop("policy", "default")
        visible_env = single.pop("visible", None)
        visible = None
        if visible_env is not None:  # the client's CUDA_VISIBLE_DEVICES
            try:
                check_well_formed(visible_env)
            except ValueError as exc:
                raise BadRequest("400 Bad Request", f"visible: {exc}") from None
            visible, _ = visible_uuids(visible_env, self.sampler.latest.snapshot.gpus)
        known = self.engine.policies()
        if policy not in known:
            names = ", ".join(sorted(known))
            raise BadRequest("404 Not Found", f"no policy {policy!r} (known: {names})")
        try:
            result = self.engine.recommend(policy, single, visible)
        except ValueError as exc:
            raise BadRequest("400 Bad Request", str(exc)) from None
        body = json.dumps(result.to_dict(), indent=1).encode()
        return Response("200 OK" if result.ok else NOT_ENOUGH_GPUS, "application/json", body)

    def snapshot(self, params: dict[str, list[str]], environ: dict[str, Any]) -> Response:
        if self.sampler.latest is None:
            raise BadRequest("503 Service Unavailable", "no sample yet")
        data = self.document()
        wanted = params.get("gpu")
        if wanted:
            gpus = [g for g in data["gpus"] if str(g["index"]) in wanted or g["uuid"] in wanted]
            missing = set(wanted) - {str(g["index"]) for g in gpus} - {g["uuid"] for g in gpus}
            if missing:
                raise BadRequest(
                    "404 Not Found", f"no GPU {sorted(missing)[0]!r} in the latest Snapshot"
                )
            data["gpus"] = gpus
        body = json.dumps(data, indent=1, sort_keys=False).encode()
        return Response("200 OK", "application/json", body)

    def document(self) -> dict[str, Any]:
        """The latest Snapshot as ``/snapshot`` serves it (and the status page shows it): with
        what the actions found of each GPU and process, and the agent's health."""
        published = self.sampler.latest
        if published is None:
            raise BadRequest("503 Service Unavailable", "no sample yet")
        data = published.snapshot.to_dict()
        findings = self.engine.findings if self.engine is not None else Findings()
        zombies = findings.get(ZombieHolders)
        verdicts = zombies.verdicts if zombies is not None else {}
        health = findings.get(HealthVerdicts)
        waste = findings.get(Waste)
        thermal = findings.get(ThermalLevels)
        chosen = findings.get(Recommendations)
        default = chosen.by_policy.get("default") if chosen is not None else None
        picked = {c.uuid for c in default.chosen} if default is not None else set()
        for gpu in data["gpus"]:
            verdict = health.verdicts.get(gpu["uuid"]) if health is not None else None
            gpu["health"] = verdict.to_dict() if verdict is not None else None
            wasted = waste.gpus.get(gpu["uuid"]) if waste is not None else None
            gpu["waste"] = wasted.to_dict() if wasted is not None else None
            level = thermal.levels.get(gpu["uuid"]) if thermal is not None else None
            gpu["thermal"] = {"level": level} if level is not None else None
            gpu["recommended"] = gpu["uuid"] in picked if default is not None else None
            for proc in gpu["processes"] or ():
                cls, decision = verdicts.get((gpu["uuid"], proc["pid"]), (None, None))
                proc["reaper"] = {"class": cls, "decision": decision}
                found = wasted.processes.get(proc["pid"]) if wasted is not None else None
                proc["waste"] = found.to_dict() if found is not None else None
        data["reaper"] = (
            {"dry_run": zombies.dry_run, "recent": [dict(d) for d in zombies.recent]}
            if zombies is not None
            else None
        )
        agent = self.sampler.health()
        data["health"] = {"ok": agent.ok, "reason": agent.reason, "stale": agent.stale}
        return data

    def history(self, params: dict[str, list[str]], environ: dict[str, Any]) -> Response:
        """The last minutes of each GPU (``web.history``): ``?seconds=S`` (at most what the
        sampler keeps), ``?gpu=INDEX|UUID`` (repeatable)."""
        snapshots = self.sampler.history()
        if not snapshots:
            raise BadRequest("503 Service Unavailable", "no sample yet")
        seconds = None
        given = params.get("seconds")
        if given:
            if len(given) > 1:
                raise BadRequest(
                    "400 Bad Request", "query parameter 'seconds' given more than once"
                )
            try:
                seconds = positive(given[0])
            except ValueError as exc:
                raise BadRequest("400 Bad Request", f"seconds: {exc}") from None
        try:
            data = history_document(
                snapshots, self.sampler.interval, seconds, params.get("gpu", ())
            )
        except KeyError as exc:
            raise BadRequest(
                "404 Not Found", f"no GPU {exc.args[0]!r} in the latest Snapshot"
            ) from None
        return Response("200 OK", "application/json", json.dumps(data).encode())

    def _verdicts(self) -> HealthVerdicts | None:
        return self.engine.findings.get(HealthVerdicts) if self.engine is not None else None

    def health_gpus(self, params: dict[str, list[str]], environ: dict[str, Any]) -> Response:
        """The health action's verdicts (``?gpu=INDEX|UUID``, repeatable): for probes and
        ``gpu-exporter health --from``."""
        found = self._verdicts()
        if found is None:
            raise BadRequest(
                "503 Service Unavailable",
                "no health verdict: the health action is off or has not run yet",
            )
        verdicts = sorted(found.verdicts.values(), key=lambda v: (v.index, v.uuid))
        wanted = params.get("gpu")
        if wanted:
            chosen = [v for v in verdicts if str(v.index) in wanted or v.uuid in wanted]
            missing = set(wanted) - {str(v.index) for v in chosen} - {v.uuid for v in chosen}
            if missing:
                raise BadRequest("404 Not Found", f"no GPU {sorted(missing)[0]!r} has a verdict")
            verdicts = chosen
        data = health_document(verdicts, found.timestamp, source="agent")
        return Response("200 OK", "application/json", json.dumps(data, indent=1).encode())


def openmetrics_preferred(accept: str | None) -> bool:
    """Whether a client sending ``Accept: accept`` gets OpenMetrics rather than the text format.

    Only when it names ``application/openmetrics-text`` (any version) with a weight above 0 and
    at least the text format's, which ``text/plain``, else ``text/*``, else ``*/*`` gives (a
    client that accepts anything, as curl's ``*/*``, gets the text format). Prometheus asks for
    OpenMetrics first and the text format at q=0.5.
    """
    if not accept:
        return False
    weights: dict[str, float] = {}
    for element in accept.split(","):
        media, *params = (part.strip(" \t") for part in element.split(";"))
        media = media.lower()
        weight = _q(params)
        weights[media] = max(weight, weights.get(media, weight))
    om = weights.get("application/openmetrics-text", 0.0)
    text = next((weights[m] for m in ("text/plain", "text/*", "*/*") if m in weights), 0.0)
    return om > 0 and om >= text


def _q(params: list[str]) -> float:
    """The ``q`` among a media range's parameters (1 without one; 0 when it is malformed)."""
    for param in params:
        name, equals, value = param.partition("=")
        if name.strip(" \t").lower() == "q":
            value = value.strip(" \t")
            return float(value) if equals and _QVALUE.fullmatch(value) else 0.0
    return 1.0


#: A weight (RFC 9110 12.4.2): 0 to 1, at most three decimals, ASCII digits only.
_QVALUE = re.compile(r"0(\.[0-9]{0,3})?|1(\.0{0,3})?")
_CODING = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: x-gzip is gzip (RFC 9110 8.4.1.3).
_ALIASES = {"x-gzip": "gzip"}


def gzip_preferred(accept_encoding: str | None) -> bool:
    """Whether a client sending ``Accept-Encoding: accept_encoding`` gets gzip (RFC 9110 12.5.3).

    Only when gzip (or ``*``, gzip unnamed) has a weight above 0 and at least identity's. An
    identity that is neither named nor covered by ``*`` stays acceptable but loses to any coding
    named (``gzip;q=0.5`` alone gets gzip). No header, or an empty one: identity.
    """
    if not accept_encoding:
        return False
    weights = accept_encoding_weights(accept_encoding)
    star = weights.get("*")
    gzip_q = weights.get("gzip", star if star is not None else 0.0)
    identity_q = weights.get("identity", star if star is not None else 0.0)
    return gzip_q > 0 and gzip_q >= identity_q


def accept_encoding_weights(accept_encoding: str) -> dict[str, float]:
    """Each coding named in an Accept-Encoding value (lower case, aliases resolved) with its
    weight. A malformed weight or parameter makes 0 (not acceptable); a coding named twice gets
    the lower weight; malformed names and empty list elements are skipped."""
    weights: dict[str, float] = {}
    for element in accept_encoding.split(","):
        coding, *params = (part.strip(" \t") for part in element.split(";"))
        if not _CODING.fullmatch(coding):
            continue
        name = _ALIASES.get(coding.lower(), coding.lower())
        weight = _weight(params)
        weights[name] = min(weight, weights.get(name, weight))
    return weights


def _weight(params: list[str]) -> float:
    """The q of a coding's parameters: 1 when there are none, 0 when they are not one q."""
    if not params:
        return 1.0
    name, equals, value = params[0].partition("=")
    if len(params) > 1 or not equals or name.strip(" \t").lower() != "q":
        return 0.0
    value = value.strip(" \t")
    return float(value) if _QVALUE.fullmatch(value) else 0.0


RECOMMEND_PARAMS = frozenset(
    {
        "policy",
        "count",
        "min_free_memory",
        "max_utilization",
        "max_temperature",
        "strategy",
        "exclusive",
        "exclude_unhealthy",
        "mig",
        "visible",
    }
)
#: /recommend answers this when fewer GPUs than asked for qualify (the body still says why).
NOT_ENOUGH_GPUS = "409 Conflict"


@dataclass
class Server:
    """A running HTTP server; ``close`` stops it. ``reloader``: its web config's watch (None
    without a web config)."""

    httpd: HttpServer
    reloader: WebConfigReloader | None = None

    @property
    def port(self) -> int:
        return self.httpd.port

    def reload_web_config(self) -> bool | None:
        """Load the web config file again now (SIGHUP): whether it was applied; None without
        one."""
        return self.reloader.reload() if self.reloader is not None else None

    def close(self) -> None:
        if self.reloader is not None:
            self.reloader.stop()
        self.httpd.close()


class _Users:
    """What a web config makes of ``app``: it wrapped in basic auth when there are users. A
    reload with the same users keeps the wrapper (and its cache of passed checks); other users
    get a new one, so a password that passed before is checked again."""

    def __init__(self, app: App, open_paths: Collection[str]) -> None:
        self.app, self.open_paths = app, tuple(open_paths)
        self.users: dict[str, bytes] = {}
        self.wsgi: WsgiApp = app

    def wsgi_for(self, users: Mapping[str, bytes]) -> WsgiApp:
        """The app for ``users``; not yet kept (``keep``: once it serves)."""
        if dict(users) == self.users:
            return self.wsgi
        return BasicAuth(self.app, users, self.open_paths) if users else self.app

    def keep(self, users: Mapping[str, bytes], wsgi: WsgiApp) -> None:
        self.users, self.wsgi = dict(users), wsgi


def serve(
    app: App,
    host: str,
    port: int,
    *,
    cert_file: str | None = None,
    key_file: str | None = None,
    client_ca_file: str | None = None,
    web: WebConfig | None = None,
    options: Options | None = None,
    healthz_without_auth: bool = False,
    reload_interval: float = RELOAD_INTERVAL,
) -> Server:
    """Serve ``app`` on a daemon thread, with TLS when ``cert_file`` and ``key_file`` are given
    (and a client certificate signed by ``client_ca_file`` required when that is given), or as
    the web config ``web`` says (TLS, basic authentication, extra headers; not with
    ``cert_file``). ``options``: the server's limits. ``healthz_without_auth``: ``/healthz``
    needs no password (for liveness probes). The web config's files are watched every
    ``reload_interval`` seconds and reloaded when they change (``WebConfigReloader``).

    Raises OSError when the address cannot be bound or a TLS file cannot be loaded.
    """
    if bool(cert_file) != bool(key_file) or (client_ca_file and not cert_file):
        raise ValueError("TLS needs cert_file and key_file, and client_ca_file needs both")
    if web is not None and cert_file:
        raise ValueError("TLS from cert_file or from the web config: pick one")
    context: ssl.SSLContext | None
    if cert_file and key_file:
        context = tls_context(cert_file, key_file, client_ca_file)
    else:
        context = web.ssl_context if web is not None else None
    wsgi: WsgiApp = app
    options = options or Options()
    users = _Users(app, ("/healthz",) if healthz_without_auth else ())
    if web is not None:
        wsgi = users.wsgi_for(web.users)
        users.keep(web.users, wsgi)
        options = replace(options, headers=web.headers)
    # The backlog: with socketserver's 5, under 16 concurrent scrapers about 1 % of connections
    # overflowed and waited a 1 s SYN retransmission (docs/benchmarks.md).
    httpd = HttpServer(
        wsgi,
        host,
        port,
        ssl_context=context,
        backlog=LISTEN_BACKLOG,
        options=options,
        stats=app.http,
    )
    if web is None:
        return Server(httpd.start())

    def apply(new: WebConfig) -> None:  # on the reloader's thread (or SIGHUP's)
        wsgi = users.wsgi_for(new.users)
        httpd.reconfigure(wsgi, new.ssl_context, new.headers)
        users.keep(new.users, wsgi)

    reloader = WebConfigReloader(web, apply, interval=reload_interval)
    app.web_config = reloader.stats
    server = Server(httpd.start(), reloader)
    reloader.start()
    return server
