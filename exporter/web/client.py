"""Fetching another agent's JSON (``/snapshot``, ``/health/gpus``): one GET with a timeout,
every failure one line. Redirects are not followed: a configured URL means that host."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

#: The largest answer read (an 8-GPU host's /snapshot is some 100 KB).
MAX_BYTES = 8 << 20


class AgentError(Exception):
    """The document could not be had; the message says why in one line."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 3xx comes back as an HTTPError


_OPENER = urllib.request.build_opener(_NoRedirect)


def _line(text: str, limit: int = 200) -> str:
    words = " ".join(text.split())
    return words if len(words) <= limit else words[: limit - 3] + "..."


def get_json(url: str, timeout: float) -> Any:
    """The JSON document at ``url``; AgentError saying why it cannot be had (unreachable,
    timed out, an HTTP error with the agent's own one-line message, too large, not JSON)."""
    try:
        with _OPENER.open(url, timeout=timeout) as response:
            body = response.read(MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        text = exc.read(500).decode(errors="replace")
        raise AgentError(f"{url}: HTTP {exc.code}: {_line(text) or exc.reason}") from None
    except TimeoutError:
        raise AgentError(f"{url}: no answer within {timeout:g}s") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AgentError(f"cannot reach the agent at {url}: {_line(str(reason))}") from None
    if len(body) > MAX_BYTES:
        raise AgentError(f"{url}: answer larger than {MAX_BYTES >> 20} MiB")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise AgentError(f"{url}: not JSON ({_line(str(exc))})") from None
