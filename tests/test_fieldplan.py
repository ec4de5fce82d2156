"""core.fieldplan: a field-value answer decoded by its GPU's plan, and the answers it declines."""

from __future__ import annotations

import pynvml
import pytest

from exporter.core.fieldplan import FieldPlan, field_layout
from exporter.core.fields import BY_KEY

POWER, UP, TRANSMIT = BY_KEY["power"], BY_KEY["nvlink_up"], BY_KEY["nvlink_transmit_bytes"]
#: the power, then two links' state and transmitted bytes, in a request's order (reading, link)
ENTRIES = [
    (POWER, None, (0, "power")),
    (UP, 0, (0, "nvlink_up@0")),
    (UP, 1, (0, "nvlink_up@1")),
    (TRANSMIT, 0, (0, "nvlink_transmit_bytes@0")),
    (TRANSMIT, 1, (0, "nvlink_transmit_bytes@1")),
]
DOUBLE, UNSIGNED_INT, UNSIGNED_LONG_LONG = 0, 1, 3


def _answer(*entries: tuple[int, int, float]):
    """A ctypes answer of (value type, return code, value) entries."""
    answer = (pynvml.c_nvmlFieldValue_t * len(entries))()
    for item, (kind, code, value) in zip(answer, entries, strict=True):
        item.valueType, item.nvmlReturn, item.timestamp = kind, code, 1234
        member = {DOUBLE: "dVal", UNSIGNED_INT: "uiVal", UNSIGNED_LONG_LONG: "ullVal"}[kind]
        setattr(item.value, member, value)
    return answer


TYPES = [DOUBLE, UNSIGNED_INT, UNSIGNED_INT, UNSIGNED_LONG_LONG, UNSIGNED_LONG_LONG]


def _plan(types):
    """A plan made from an answer of these value types (every entry succeeded)."""
    made_from = _answer(*((kind, 0, 1) for kind in types))
    return FieldPlan(ENTRIES, memoryview(made_from).cast("B"), pynvml.c_nvmlFieldValue_t)


def test_an_answer_of_the_plans_shape_is_decoded_scaled_and_sorted_by_link():
    plan = _plan(TYPES)
    answer = _answer(
        (DOUBLE, 0, 350_000.0),  # milliwatts
        (UNSIGNED_INT, 0, 1),
        (UNSIGNED_INT, 0, 0),
        (UNSIGNED_LONG_LONG, 0, (1 << 40) + 3),  # KiB, past 32 bits
        (UNSIGNED_LONG_LONG, 0, 7),
    )
    values, links = plan.decode(memoryview(answer).cast("B"))
    assert values == {"power": pytest.approx(350_000.0 * POWER.scale)}
    assert list(links.pairs()) == [
        ((0, "nvlink_up"), 1.0),
        ((0, "nvlink_transmit_bytes"), ((1 << 40) + 3) * TRANSMIT.scale),
        ((1, "nvlink_up"), 0.0),
        ((1, "nvlink_transmit_bytes"), 7 * TRANSMIT.scale),
    ]
    assert list(links) == [0, 1]


@pytest.mark.parametrize(
    "entries",
    [
        [(DOUBLE, 0, 1.0), (UNSIGNED_INT, 3, 1), (UNSIGNED_INT, 0, 1), (3, 0, 1), (3, 0, 1)],
        [(UNSIGNED_INT, 0, 1), (UNSIGNED_INT, 0, 1), (UNSIGNED_INT, 0, 1), (3, 0, 1), (3, 0, 1)],
        [(DOUBLE, 0, 1.0), (UNSIGNED_INT, 0, 1)],
    ],
    ids=["an entry failed", "a value of another type", "another length"],
)
def test_an_answer_of_another_shape_is_left_to_the_caller(entries):
    assert _plan(TYPES).decode(memoryview(_answer(*entries)).cast("B")) is None


def test_an_unsigned_long_keeps_its_high_bits():
    """``ulVal`` is a C unsigned long: 8 bytes on 64-bit Linux, decoded whole."""
    import ctypes

    answer = (pynvml.c_nvmlFieldValue_t * 1)()
    answer[0].valueType, answer[0].nvmlReturn = 2, 0
    answer[0].value.ulVal = (1 << 40) + 5
    _, _, _, value_at, decoders = field_layout(pynvml.c_nvmlFieldValue_t)
    assert decoders[2].unpack_from(memoryview(answer).cast("B"), value_at)[0] == (1 << 40) + 5
    assert decoders[2].size == ctypes.sizeof(ctypes.c_ulong)
