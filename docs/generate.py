#!/usr/bin/env python3
"""Writes the rows of docs/metrics.md that come from exporter/core/fields.py's table.

    .venv/bin/python docs/generate.py          # rewrite the block in docs/metrics.md
    .venv/bin/python docs/generate.py --check  # exit 1 when the block is out of date

The block lies between the ``<!-- readings:begin -->`` and ``<!-- readings:end -->`` lines;
tests/test_fields.py fails when it differs from what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from exporter.core.fields import (  # noqa: E402
    IDLE_RECHECK_SECONDS,
    READINGS,
    FieldValue,
    GpmMetric,
    Reading,
)

DOC = ROOT / "docs" / "metrics.md"
BEGIN, END = "<!-- readings:begin -->", "<!-- readings:end -->"
_CADENCE = {
    "sample": "every sample",
    "slow": "every 30 s (slow cadence)",
    "static": "once, with the static facts",
}


def _source(reading: Reading) -> str:
    source = reading.source
    if isinstance(source, FieldValue):
        if reading.link_ids:
            first, last = reading.link_ids[0], reading.link_ids[-1]
            text = f"`{source.constant}` and the next links' fields ({first}-{last}, per link)"
        else:
            scope = ", `scopeId` = link" if reading.per_link else ""
            text = f"field `{source.constant}` ({source.id}{scope})"
        if reading.fallback is not None:
            text += f", else `{reading.fallback.name}`"
        return text
    if isinstance(source, GpmMetric):
        return f"GPM metric `{source.constant}` ({source.id}), [between two samples](#gpm)"
    item = f"[{source.item}]" if source.item is not None else ""
    return f"`{source.name}`{item}"


def _scale(reading: Reading) -> str:
    if reading.equals is not None:
        return f", 1 when NVML says {reading.equals}"
    return "" if reading.scale == 1 else f" \N{MULTIPLICATION SIGN} {reading.scale:g}"


def rows() -> str:
    """The table of every reading metric, one row per metric family."""
    families: dict[str, list[Reading]] = {}
    for reading in READINGS:
        families.setdefault(reading.metric, []).append(reading)
    lines = [
        "| Metric | Type | Unit | Extra labels | NVML source (pynvml) | Read | Absent when |",
        "|---|---|---|---|---|---|---|",
    ]
    for metric, members in families.items():
        first = members[0]
        labels = ["`link`"] if first.per_link else []
        if first.labels:
            name = first.labels[0][0]
            labels.append(f"`{name}`: " + ", ".join(f"`{r.labels[0][1]}`" for r in members))
        if len(members) > 1:
            source = "; ".join(
                f"`{r.labels[0][1]}`: {_source(r)}{_scale(r)}" if r.labels else _source(r)
                for r in members
            )
        else:
            source = _source(first) + _scale(first)
        absent = sorted({r.absent for r in members if r.absent})
        ecc = " Read only while ECC is on." if first.requires_ecc else ""
        cadence = _CADENCE[first.cadence]
        if first.idle_recheck:
            cadence += f"; every {IDLE_RECHECK_SECONDS:g} s while it reads 0"
        lines.append(
            f"| `{metric}` | {first.kind} | {first.unit} | {', '.join(labels)} | {source} | "
            f"{cadence} | {'; '.join(absent) or 'unsupported'}.{ecc} |"
        )
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    """``text`` (docs/metrics.md) with its block replaced by :func:`rows`."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{DOC}: the {BEGIN} ... {END} block is missing")
    return f"{head}{BEGIN}\n{rows()}{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    args = parser.parse_args()
    text = DOC.read_text()
    wanted = render(text)
    if args.check:
        if wanted != text:
            print(f"{DOC} is out of date: run docs/generate.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
