"""The Prometheus text format (0.0.4) of metric families, byte for byte what prometheus_client's
``generate_latest`` writes, at a fraction of its cost.

The sampler renders every family once per sample: with NVLink links and PCIe error types that is
some two thousand series on an 8-GPU host, and ``generate_latest`` checks and escapes every label
name of every sample anew. Here a family's label names are escaped once, label values only when
they hold a character that needs it, and families of a kind this module does not write (with
timestamps, ``_created`` samples, histograms) go to ``generate_latest`` as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_TYPES = {"gauge": "gauge", "counter": "counter", "unknown": "untyped", "untyped": "untyped"}


class Family:
    """A gauge or counter family as rows of label values and a value: what prometheus_client's
    families are, less the per-series objects (a sample's dict of labels and Sample tuple are
    made only when something asks for ``samples``: the OpenMetrics rendering, done at most
    once per sample, and tests). Quacks like prometheus_client's ``Metric``."""

    __slots__ = ("documentation", "label_names", "name", "rows", "type", "unit")

    def __init__(self, name: str, documentation: str, kind: str, label_names: Sequence[str]):
        if kind not in ("gauge", "counter"):
            raise ValueError(f"a Family is a gauge or a counter, not {kind!r}")
        self.name, self.documentation, self.type, self.unit = name, documentation, kind, ""
        self.label_names = tuple(label_names)
        self.rows: list[tuple[tuple[str, ...], float]] = []

    def add(self, values: tuple[str, ...], value: float) -> None:
        """One series: its label values (in ``label_names`` order) and its value."""
        self.rows.append((values, value))

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """:meth:`add`, called as on prometheus_client's families."""
        self.rows.append((tuple(labels), value))

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.type == "counter" else self.name

    @property
    def samples(self) -> list[Any]:
        """The series as prometheus_client's Samples."""
        name, names = self.sample_name, self.label_names
        return [Sample(name, dict(zip(names, v, strict=True)), x, None, None) for v, x in self.rows]


class _One:
    """The ``collect()`` interface generate_latest expects, over one family."""

    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> Iterator[Metric]:
        return iter((self._family,))


def _label_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def _prefix(name: str, keys: tuple[str, ...], values: tuple[str, ...]) -> str | None:
    """``name{label="value",...} `` with the labels in name order; None for a label name the
    text format would have to escape."""
    if not keys:
        return f"{name} "
    pairs = sorted(zip(keys, values, strict=True))
    if not all(key.isidentifier() and key.isascii() for key, _ in pairs):
        return None
    text = ",".join(f'{key}="{_label_value(value)}"' for key, value in pairs)
    return f"{name}{{{text}}} "


def _family(family: Metric, out: list[str]) -> bool:
    """Append the lines of ``family``; False (nothing appended) when it is not one of ours."""
    kind = _TYPES.get(family.type)
    if kind is None:
        return False
    name = family.name + "_total" if family.type == "counter" else family.name
    lines = []
    for sample in family.samples:
        if sample.timestamp is not None or sample.exemplar is not None:
            return False
        if sample.name != name and not (family.type != "counter" and sample.name == family.name):
            return False  # _created and the like
        labels = sample.labels
        # not kept: these families hold the processes' series, which come and go
        prefix = _prefix(sample.name, tuple(labels), tuple(labels.values())) if labels else None
        if labels and prefix is None:
            return False
        lines.append((prefix or f"{sample.name} ") + floatToGoString(sample.value) + "\n")
    documentation = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    out.append(f"# HELP {name} {documentation}\n# TYPE {name} {kind}\n")
    out.extend(lines)
    return True


class _Written(NamedTuple):
    """What one family wrote last time."""

    rows: list[tuple[tuple[str, ...], float]]
    text: str
    label_names: tuple[str, ...]
    #: label values -> the series' line up to its value, for the series of ``rows`` only
    prefixes: dict[tuple[str, ...], str]


#: family name -> what it wrote last time. Most readings do not change from one sample to the
#: next (error counters at 0, links up, link widths): equal rows are written as before without
#: formatting a number. The same series come back sample after sample: their label text is
#: written once. Only the series of the last write are kept, so series that come and go
#: (processes, GPUs renumbered) leave nothing behind.
_WRITTEN: dict[str, _Written] = {}


def _rows(family: Family, out: list[str]) -> None:
    """Append the lines of one of our own families."""
    name, names = family.sample_name, family.label_names
    written = _WRITTEN.get(family.name)
    if written is not None and written.rows == family.rows and written.label_names == names:
        out.append(written.text)
        return
    known = written.prefixes if written is not None and written.label_names == names else {}
    prefixes: dict[tuple[str, ...], str] = {}
    documentation = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    lines = [f"# HELP {name} {documentation}\n# TYPE {name} {family.type}\n"]
    for values, value in family.rows:
        prefix = known.get(values)
        if prefix is None:
            prefix = _prefix(name, names, values)
            if prefix is None:
                raise ValueError(f"{name}: a label name the text format cannot hold: {names}")
        prefixes[values] = prefix
        lines.append(prefix + floatToGoString(value) + "\n")
    text = "".join(lines)
    _WRITTEN[family.name] = _Written(family.rows, text, names, prefixes)
    out.append(text)


def has_samples(family: Any) -> bool:
    """Whether ``family`` has a series (without making Samples of one of ours)."""
    return bool(family.rows if isinstance(family, Family) else family.samples)


def render_text(families: Iterable[Any]) -> bytes:
    """The text exposition of ``families`` (prometheus_client's, or :class:`Family`)."""
    out: list[str] = []
    for family in families:
        if isinstance(family, Family):
            _rows(family, out)
        elif not _family(family, out):
            out.append(generate_latest(_One(family)).decode("utf-8"))
    return "".join(out).encode("utf-8")
