"""An action's settings, declared once: each is a field of the action's frozen dataclass, with
its YAML key, parser (a ``config.validate`` function, which carries the bounds) and default in
one :func:`option`; :func:`parse_options` reads a config section into it. Every action setting
may change on reload (SIGHUP): the engine hands the new settings to the action, or makes it anew.

    @dataclass(frozen=True)
    class WasteConfig:
        for_seconds: float = option(duration, 1800.0, key="for")
        leak_samples: int = option(whole(2, 1000), 12, key="leak.samples")

``key`` defaults to the field's name; a dotted key is a key of a nested mapping
(``leak: {samples: 12}``), whose unknown keys are errors too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from exporter.config.yamlconf import Section

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """What :func:`option` records in a field's metadata."""

    parse: Callable[[Any], Any]
    key: str = ""


def option(parse: Callable[[Any], Any], default: Any, *, key: str = "") -> Any:
    """A dataclass field read from the config by ``parse`` at ``key`` (default: its name)."""
    return dataclasses.field(default=default, metadata={"option": Option(parse, key)})


def parse_options(cls: type[T], section: Section) -> T:
    """``cls`` (a dataclass of :func:`option` fields) from ``section``; absent keys take the
    defaults. The nested sections are finished here, ``section`` is left to the caller."""
    values: dict[str, Any] = {}
    nested: dict[str, Section] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        declared = f.metadata.get("option")
        if declared is None:
            continue
        prefix, _, name = (declared.key or f.name).rpartition(".")
        where = section
        if prefix:
            where = nested.get(prefix) or nested.setdefault(prefix, section.section(prefix))
        values[f.name] = where.get(name, declared.parse, f.default)
    for sub in nested.values():
        sub.done()
    return cls(**values)
