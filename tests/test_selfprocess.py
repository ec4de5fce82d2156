"""The agent's own process_* families: prometheus_client's process collector's, read cheaper."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client.process_collector import ProcessCollector

from exporter.exposition.selfprocess import SelfProcess


def _by_name(families) -> dict[str, tuple[str, str, float]]:
    out = {}
    for family in families:
        (sample,) = family.samples
        out[sample.name] = (family.documentation, family.type, sample.value)
    return out


def test_the_families_are_prometheus_clients_process_collectors():
    ours = _by_name(SelfProcess().families())
    theirs = _by_name(ProcessCollector(registry=None).collect())
    assert list(ours) == list(theirs)
    for name, (doc, kind, value) in theirs.items():
        assert ours[name][:2] == (doc, kind), name
        if name == "process_open_fds":  # theirs counts its own listing's descriptor
            assert abs(ours[name][2] - value) <= 1
        elif name != "process_cpu_seconds_total":
            assert ours[name][2] == pytest.approx(value, rel=0.05), name


def test_open_descriptors_are_counted(tmp_path: Path):
    before = _by_name(SelfProcess().families())["process_open_fds"][2]
    opened = [os.open(os.devnull, os.O_RDONLY) for _ in range(10)]
    try:
        assert _by_name(SelfProcess().families())["process_open_fds"][2] == before + 10
    finally:
        for fd in opened:
            os.close(fd)


def test_a_copied_proc_is_listed_and_an_unreadable_one_has_no_families(tmp_path: Path):
    (tmp_path / "stat").write_bytes(b"cpu 1 2 3\nbtime 1700000000\n")
    me = tmp_path / "self"
    (me / "fd").mkdir(parents=True)
    for fd in range(3):
        (me / "fd" / str(fd)).write_text("")
    fields = ["S"] + ["0"] * 10 + ["300", "200"] + ["0"] * 6 + ["1000", "4096", "10"]
    (me / "stat").write_text("42 (agent) " + " ".join(fields) + " 0 0\n")
    (me / "limits").write_text(
        "Limit                     Soft Limit           Hard Limit           Units\n"
        "Max open files            1024                 4096                 files\n"
    )
    found = _by_name(SelfProcess(str(me)).families())
    ticks = os.sysconf("SC_CLK_TCK")
    assert found["process_open_fds"][2] == 3  # a directory's size is not its count here
    assert found["process_max_fds"][2] == 1024
    assert found["process_cpu_seconds_total"][2] == pytest.approx(500 / ticks)
    assert found["process_start_time_seconds"][2] == pytest.approx(1_700_000_000 + 1000 / ticks)
    assert found["process_virtual_memory_bytes"][2] == 4096
    assert SelfProcess(str(tmp_path / "gone")).families() == []
