"""One GPU's ``nvmlDeviceGetFieldValues`` answer decoded in a few C calls, once its shape is known.

A GPU asks for the same fields sample after sample (some 170 on an NVLink GPU, most of them per
link), and every entry of the answer has the same value type each time. Decoding entry by entry
costs a dozen Python operations per entry; a :class:`FieldPlan`, made from one answer whose
entries all succeeded, reads the whole array with one ``struct`` format, checks that the types
are the same and that no entry failed, and scales and sorts the values into readings with
``map`` and ``itemgetter``. An answer of another shape (an entry failed, a type changed) is not
decoded by the plan: the caller decodes it entry by entry, with its errors.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any

from exporter.core.fields import Reading
from exporter.core.snapshot import LinkReadings

#: ``c_nvmlValue_t``'s members by ``valueType`` (``usVal``: nvidia-ml-py 13 and newer).
VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
#: One entry of a GPU's field-value call: the reading, its link (None: the GPU's), and what
#: the entry is remembered under when the GPU lacks it ((GPU index, key or key@link)).
FieldEntry = tuple[Reading, int | None, tuple[int, str]]


def gatherer(positions: Sequence[int]) -> Callable[[Sequence[float]], Sequence[float]]:
    """``values -> values at positions``, as a tuple whatever the count."""
    if len(positions) == 1:
        only = positions[0]
        return lambda values: (values[only],)
    if not positions:
        return lambda values: ()
    return operator.itemgetter(*positions)


class _Part:
    """The readings of one kind (per GPU, or per link) in an answer: where they are, their keys,
    scales and the positions of those compared with a state (``equals``)."""

    __slots__ = ("equals", "gather", "keys", "scales")

    def __init__(self, positions: list[int], keys: list[Any], readings: list[Reading]) -> None:
        self.gather = gatherer(positions)
        self.keys = tuple(keys)
        self.scales = tuple(reading.scale for reading in readings)
        self.equals = tuple(
            (at, reading.equals, reading.scale)
            for at, reading in enumerate(readings)
            if reading.equals is not None
        )

    def values(self, answered: Sequence[float]) -> list[float]:
        raw = self.gather(answered)
        scaled = list(map(operator.mul, raw, self.scales))
        for at, equals, scale in self.equals:
            scaled[at] = (1.0 if raw[at] == equals else 0.0) * scale
        return scaled


class FieldPlan:
    """How to decode the answers to one request (``entries``) of one GPU, made from one answer
    (``raw``: its bytes, an array of ``value_class``, pynvml's ``c_nvmlFieldValue_t``) whose
    entries all succeeded: each entry's value type is the one it had there."""

    __slots__ = ("_linked", "_links", "_size", "_struct", "_types", "_values", "entries")

    def __init__(self, entries: list[FieldEntry], raw: memoryview, value_class: Any) -> None:
        size, head_at, head, value_at, decoders = field_layout(value_class)
        types = [head.unpack_from(raw, base + head_at)[0] for base in range(0, len(raw), size)]
        parts = []
        for kind in types:
            decoder = decoders[kind]
            parts.append(
                _pad(head_at)
                + "II"
                + _pad(value_at - head_at - 8)
                + decoder.format.lstrip("=")
                + _pad(size - value_at - decoder.size)
            )
        self.entries = entries
        self._struct = struct.Struct("=" + "".join(parts))
        self._size = size * len(entries)
        self._types = tuple(types)
        plain = [at for at, (_, link, _) in enumerate(entries) if link is None]
        # per link, link by link, each link's readings in the request's order (LinkReadings')
        linked = sorted(
            (at for at, (_, link, _) in enumerate(entries) if link is not None),
            key=lambda at: (entries[at][1], at),
        )
        self._values = _Part(
            plain, [entries[at][0].key for at in plain], [entries[at][0] for at in plain]
        )
        self._links = _Part(
            linked,
            [(entries[at][1], entries[at][0].key) for at in linked],
            [entries[at][0] for at in linked],
        )
        self._linked = tuple(dict.fromkeys(link for link, _ in self._links.keys))

    def decode(self, raw: memoryview) -> tuple[dict[str, float], LinkReadings] | None:
        """The readings (per GPU, per link) of an answer's bytes; None when the answer is not of
        this plan's shape (another length, an entry that failed, a value of another type)."""
        if len(raw) != self._size:
            return None
        flat = self._struct.unpack_from(raw)
        if flat[0::3] != self._types or any(flat[1::3]):
            return None
        answered = flat[2::3]
        values = dict(zip(self._values.keys, self._values.values(answered), strict=True))
        links = LinkReadings.of(self._links.keys, self._links.values(answered), self._linked)
        return values, links


def _struct_character(ctype: Any) -> str:
    """The ``struct`` character (standard size, ``=``) of a ctypes number type."""
    if issubclass(ctype, ctypes.c_double):
        return "d"
    size, signed = ctypes.sizeof(ctype), ctype(-1).value < 0
    return {2: "h", 4: "i", 8: "q"}[size] if signed else {2: "H", 4: "I", 8: "Q"}[size]


@functools.cache
def field_layout(cls: Any) -> tuple[int, int, struct.Struct, int, dict[int, struct.Struct]]:
    """Size of one ``c_nvmlFieldValue_t``, the offset of its (valueType, nvmlReturn) pair and a
    Struct for it, the value's offset, and the value's Struct by value type (``c_nvmlValue_t``'s
    member of that type, its size as ctypes has it: ``ulVal`` is 8 bytes on 64-bit Linux): from
    the ctypes class itself."""
    kind, code, value = cls.valueType, cls.nvmlReturn, cls.value
    if code.offset != kind.offset + kind.size or kind.size != 4 or code.size != 4:
        raise ValueError("unexpected c_nvmlFieldValue_t layout")
    members = dict(cls._fields_[-1][1]._fields_)
    decoders = {
        number: struct.Struct("=" + _struct_character(members[name]))
        for number, name in enumerate(VALUE_FIELDS)
        if name in members
    }
    return ctypes.sizeof(cls), kind.offset, struct.Struct("=II"), value.offset, decoders


def _pad(count: int) -> str:
    return f"{count}x" if count else ""
