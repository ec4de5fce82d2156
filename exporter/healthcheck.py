"""``gpu-exporter health``: one verdict per GPU, for Slurm prologs and epilogs, Kubernetes
pre-flight Jobs and node-problem-detector.

It asks a running agent (``--from URL``: its ``/health/gpus``, which knows the XID history and
the thermal action's levels) or samples NVML once itself (what one sample can know). Exit
status as a node-problem-detector custom plugin expects: 0 every GPU ok, 1 any critical (or any
warning with ``--strict``), 2 could not decide (no driver, agent unreachable, no such GPU).
The JSON (``--json``) is the document :func:`exporter.core.health.health_document` makes,
described by ``exporter/schemas/health.schema.json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from exporter.core.health import CRITICAL, LEVELS, UNKNOWN_VERDICT, WARNING, health_document

EXIT_OK, EXIT_UNHEALTHY, EXIT_UNKNOWN = 0, 1, 2


class CannotDecide(Exception):
    """No verdict: the message says why, in one line."""


def check_agent_url(url: str) -> None:
    """ValueError (naming ``--from``) unless ``url`` is an http:// or https:// URL (``health``
    and ``status`` ask an agent there)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--from: expected an http:// or https:// URL, got {url!r}")


def from_agent(url: str, gpus: str | None, timeout: float) -> dict[str, Any]:
    """The agent's ``/health/gpus`` document; CannotDecide when it cannot be had."""
    from exporter.web.client import AgentError, get_json  # only --from pays for HTTP

    try:
        check_agent_url(url)
    except ValueError as exc:
        raise CannotDecide(str(exc)) from None
    target = url.rstrip("/") + "/health/gpus"
    try:
        document = get_json(target, timeout)
    except AgentError as exc:
        raise CannotDecide(str(exc)) from None
    try:
        verdicts = document["gpus"]
        if not isinstance(verdicts, list) or not all(
            isinstance(v, dict) and isinstance(v["index"], int) and isinstance(v["uuid"], str)
            for v in verdicts
        ):
            raise ValueError("gpus is not a list of verdicts")
    except (ValueError, KeyError, TypeError) as exc:
        raise CannotDecide(f"{target}: not an answer of /health/gpus ({exc})") from None
    document["gpus"] = _only(verdicts, gpus)
    document["verdict"] = _worst(document["gpus"])
    document["from"] = url
    return document


def from_sample(
    sample: Callable[[], Any], gpus: str | None, timestamp: Callable[[], float]
) -> dict[str, Any]:
    """The verdict one Snapshot from ``sample()`` supports (no XID history)."""
    from exporter.core.health import assess

    snapshot = sample()
    if not snapshot.nvml_up:
        raise CannotDecide(
            f"NVML is not available: {snapshot.nvml_error}. Is the NVIDIA driver installed and "
            "loaded? (--from URL asks a running agent instead)"
        )
    verdicts = sorted(assess([snapshot]).values(), key=lambda v: (v.index, v.uuid))
    chosen = _only([v.to_dict() for v in verdicts], gpus)
    return health_document(chosen, snapshot.timestamp, source="nvml")


def check_gpu_list(wanted: str) -> None:
    """ValueError (naming ``--gpu``) unless ``wanted`` is a list CUDA could read."""
    from exporter.core.visible import check_well_formed

    if not any(entry.strip() for entry in wanted.split(",")):
        raise ValueError("--gpu: names no GPU")
    try:
        check_well_formed(wanted)
    except ValueError as exc:
        raise ValueError(f"--gpu: {exc}") from None


def _only(verdicts: list[dict[str, Any]], wanted: str | None) -> list[dict[str, Any]]:
    """The verdicts of the GPUs ``wanted`` names (as CUDA reads CUDA_VISIBLE_DEVICES: indices,
    UUIDs or their prefixes, MIG UUIDs); every entry must name a GPU here."""
    if wanted is None:
        if not verdicts:
            raise CannotDecide("no GPUs to judge")
        return verdicts
    from exporter.core.snapshot import Gpu
    from exporter.core.visible import visible_uuids

    try:
        check_gpu_list(wanted)
    except ValueError as exc:
        raise CannotDecide(str(exc)) from None
    gpus = [Gpu(v["index"], v["uuid"], up=True) for v in verdicts]
    chosen: list[str] = []
    for entry in (e.strip() for e in wanted.split(",")):
        if not entry:
            continue
        found, _ = visible_uuids(entry, gpus)
        if not found:
            raise CannotDecide(f"--gpu: no GPU {entry!r} here")
        chosen.extend(uuid for uuid in found if uuid not in chosen)
    if not chosen:
        raise CannotDecide("--gpu names no GPU")
    by_uuid = {v["uuid"]: v for v in verdicts}
    return [by_uuid[uuid] for uuid in chosen]


def _worst(verdicts: Sequence[dict[str, Any]]) -> str:
    levels = [v.get("level") for v in verdicts]
    known = [level for level in levels if isinstance(level, int) and 0 <= level < len(LEVELS)]
    if not verdicts or len(known) != len(levels):
        return UNKNOWN_VERDICT
    return LEVELS[max(known)]


def format_lines(document: dict[str, Any]) -> str:
    """One line per GPU: ``GPU 1 GPU-...: critical: memory_repair: row remap pending``."""
    lines = []
    for verdict in document["gpus"]:
        line = f"GPU {verdict['index']} {verdict['uuid']}: {verdict['verdict']}"
        if verdict.get("reasons"):
            line += ": " + "; ".join(verdict["reasons"])
        lines.append(line)
    return "\n".join(lines)


def exit_status(document: dict[str, Any], strict: bool) -> int:
    """0 ok, 1 unhealthy (critical, or warning with ``strict``), 2 unknown."""
    verdicts = document["gpus"]
    if document.get("verdict") == UNKNOWN_VERDICT or not verdicts:
        return EXIT_UNKNOWN
    worst = max(v["level"] for v in verdicts)
    return EXIT_UNHEALTHY if worst >= (WARNING if strict else CRITICAL) else EXIT_OK


def report(document: dict[str, Any], as_json: bool, strict: bool) -> int:
    """Print ``document`` and give the exit status."""
    print(json.dumps(document, indent=1) if as_json else format_lines(document))
    return exit_status(document, strict)


def cannot_decide(why: str, as_json: bool, source: str, url: str | None) -> int:
    """Say why there is no verdict (stderr; and the JSON document with ``--json``): exit 2."""
    print(f"gpu-exporter health: {why}", file=sys.stderr)
    if as_json:
        document = health_document([], None, source=source, error=why)
        if url is not None:
            document["from"] = url
        print(json.dumps(document, indent=1))
    return EXIT_UNKNOWN
