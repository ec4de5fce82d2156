"""CUDA_VISIBLE_DEVICES as the launcher reads it: every form, odd digits and whitespace, and what
``recommend`` and ``run`` make of an entry they cannot use (CUDA's rule, never a traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.core.snapshot import Gpu, GpuInfo
from exporter.core.visible import (
    as_cuda_reads,
    check_well_formed,
    visible_mig_devices,
    visible_uuids,
)
from tests.agent import clean_env, healthz_until, http_get, serve
from tests.agent import exporter_cli as cli

GPUS = [
    Gpu(0, "GPU-aaaa-1", True, GpuInfo(0, "GPU-aaaa-1")),
    Gpu(1, "GPU-aaab-2", True, GpuInfo(1, "GPU-aaab-2", mig_uuids=("MIG-xyz-1",))),
]
FIRST, SECOND = "GPU-aaaa-1", "GPU-aaab-2"
#: Not indices, whatever str.isdigit() says: only ASCII digits are.
NOT_INDICES = ["²", "\u0660", "\u0661", "\uff11", "\u09e7", "0x1", "+1", "1_0", "1.0", "1e0"]
NO_GPU_NOTE = "names no GPU here; it hides the rest"
NO_FORM_NOTE = "is no GPU index (ASCII digits), GPU UUID or MIG device; it hides the rest"


def visible(value: str | None) -> list[str] | None:
    """The UUIDs ``value`` makes visible, in order (None: all)."""
    uuids, _ = visible_uuids(value, GPUS)
    return None if uuids is None else list(uuids)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("0", [FIRST]),
        ("1,0", [SECOND, FIRST]),
        ("00", [FIRST]),
        ("01", [SECOND]),
        (" 1", [SECOND]),
        ("1 ", [SECOND]),
        ("\t1 , 0\n", [SECOND, FIRST]),
        ("1,1", [SECOND]),
        ("GPU-aaab-2", [SECOND]),
        ("GPU-aaab", [SECOND]),
        ("GPU-aaa", []),  # a prefix of both: ambiguous, so CUDA stops there
        ("MIG-xyz-1", [SECOND]),
        ("MIG-xyz", [SECOND]),
        ("MIG-GPU-aaaa-1/1/0", [FIRST]),
        ("MIG-nope", []),
        ("GPU-zzz,0", []),
        ("2", []),
        ("0,2,1", [FIRST]),  # CUDA stops at the first invalid entry
        ("0,-1,1", [FIRST]),
        ("-1", []),
        ("0,,1", [FIRST]),
        ("1" * 5000, []),  # int() would refuse so many digits
        ("0" * 5000, [FIRST]),
        ("\u00a01", []),  # only ASCII whitespace is stripped
        ("gpu-aaab-2", []),
    ],
)
def test_forms(value, expected):
    assert visible(value) == expected


@pytest.mark.parametrize("entry", NOT_INDICES)
def test_only_ascii_digits_are_indices(entry):
    uuids, note = visible_uuids(entry, GPUS)
    assert uuids == {} and note == f"CUDA_VISIBLE_DEVICES: {entry!r} {NO_FORM_NOTE}"
    assert visible(f"1,{entry},0") == [SECOND]  # CUDA's rule: what follows is ignored


def test_mig_entries_name_the_mig_device_to_cuda():
    assert visible_uuids("MIG-xyz-1,0", GPUS)[0] == {SECOND: "MIG-xyz-1", FIRST: FIRST}


def test_every_mig_device_named_is_visible_up_to_the_first_unknown_entry():
    two = [
        Gpu(0, "GPU-aaaa-1", True, GpuInfo(0, "GPU-aaaa-1", mig_uuids=("MIG-one", "MIG-two"))),
    ]
    assert visible_mig_devices("MIG-one,MIG-tw", two) == {"MIG-one", "MIG-two"}  # a prefix
    assert visible_mig_devices("MIG-one,7,MIG-two", two) == {"MIG-one"}  # CUDA stops at 7
    assert visible_mig_devices("0", two) == set()  # a whole GPU: visible_uuids says so
    assert visible_mig_devices(None, two) == set()


@pytest.mark.parametrize(
    ("value", "note"),
    [
        ("2", f"CUDA_VISIBLE_DEVICES: '2' {NO_GPU_NOTE}"),
        ("-1", f"CUDA_VISIBLE_DEVICES: '-1' {NO_GPU_NOTE}"),
        ("0,GPU-aaa", f"CUDA_VISIBLE_DEVICES: 'GPU-aaa' {NO_GPU_NOTE}"),
        ("1" * 5000, f"CUDA_VISIBLE_DEVICES: '{'1' * 60}...' {NO_GPU_NOTE}"),
        ("", ""),
        ("0,,1", ""),
    ],
)
def test_notes(value, note):
    assert visible_uuids(value, GPUS)[1] == note


def test_index_order_note_only_for_ascii_indices():
    assert "CUDA_DEVICE_ORDER" in visible_uuids("0", GPUS, order=None)[1]
    assert "CUDA_DEVICE_ORDER" not in visible_uuids("²", GPUS, order=None)[1]
    assert "CUDA_DEVICE_ORDER" not in visible_uuids("0", GPUS)[1]


@pytest.mark.parametrize(
    "value",
    ["", "0", "7", "-1", " 1", "1 ", "0,,1", "GPU-zzz", "GPU-aaab", "MIG-xyz", "MIG-GPU-a/1/0"],
)
def test_well_formed(value):
    check_well_formed(value)


@pytest.mark.parametrize("entry", [*NOT_INDICES, "foo", "gpu-aaab", "GPU-é", "\u00a01", "0 1"])
def test_malformed_entries_are_named(entry):
    with pytest.raises(ValueError, match="is no GPU index") as raised:
        check_well_formed(f"0,{entry}")
    assert repr(entry) in str(raised.value)


@pytest.mark.parametrize(
    ("value", "sent"),
    [("0, 1", "0, 1"), ("1,²,0", "1"), ("²,0", ""), ("GPU-aaab,foo", "GPU-aaab"), ("", "")],
)
def test_what_an_agent_is_asked_is_what_cuda_reads(value, sent):
    read, note = as_cuda_reads(value)
    assert read == sent
    assert (note == "") == (read == value), note
    if note:
        assert note.startswith("CUDA_VISIBLE_DEVICES: ") and note.endswith("hides the rest")


# -- the CLI ---------------------------------------------------------------------------------------

TWO_GPUS = "gpus:\n  - {name: GPU A}\n  - {name: GPU B}\n"
NO_GPUS = 75  # exporter/launcher/cli.py


@pytest.fixture
def host(tmp_path) -> tuple[Path, Path]:
    """A two-GPU scenario and an empty lock directory."""
    scenario = tmp_path / "two.yaml"
    scenario.write_text(TWO_GPUS)
    locks = tmp_path / "locks"
    locks.mkdir()
    return scenario, locks


def launcher(host: tuple[Path, Path], command: str, value: str, *args: str):
    scenario, locks = host
    env = clean_env(CUDA_VISIBLE_DEVICES=value, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    return cli(command, "--simulate", str(scenario), "--lock-dir", str(locks), *args, env=env)


@pytest.mark.parametrize("value", ["²", "\u0660", "\uff11", "0x1"])
def test_recommend_hides_everything_after_an_entry_it_cannot_read(host, value):
    result = launcher(host, "recommend", value)
    assert result.returncode == NO_GPUS and result.stdout == ""
    assert "Traceback" not in result.stderr
    assert f"CUDA_VISIBLE_DEVICES: {value!r} {NO_FORM_NOTE}" in result.stderr
    assert result.stderr.count("hidden by CUDA_VISIBLE_DEVICES") == 2


def test_recommend_keeps_what_comes_before_a_bad_entry(host):
    result = launcher(host, "recommend", "1,²,0", "--format", "index")
    assert result.returncode == 0 and result.stdout.strip() == "1", result.stderr
    assert f"'²' {NO_FORM_NOTE}" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(("value", "status"), [("²", NO_GPUS), ("1,²", 0)])
def test_run_follows_cuda_rule(host, value, status):
    result = launcher(host, "run", value, "--", "sh", "-c", 'echo "job: $GPU_EXPORTER_GPUS"')
    assert result.returncode == status and "Traceback" not in result.stderr, result.stderr
    if status == 0:  # run names the note only when it explains why no GPU qualifies
        assert result.stdout == "job: 1\n"
    else:
        assert f"'²' {NO_FORM_NOTE}" in result.stderr and result.stdout == ""


def test_the_launchers_read_it_as_cuda_does_when_an_agent_chooses(host, tmp_path):
    """``--from``: the launcher sends what CUDA reads (up to a malformed entry) and notes the
    rest, as without an agent; the agent's /recommend itself refuses a malformed entry (400)."""
    scenario, locks = host
    with serve(tmp_path, "--simulate", str(scenario), "--lock-dir", str(locks)) as (agent, port):
        healthz_until(agent, port)
        url = f"http://127.0.0.1:{port}"

        def from_agent(command: str, value: str, *args: str):
            env = clean_env(CUDA_VISIBLE_DEVICES=value)
            return cli(command, "--from", url, *args, env=env)

        result = from_agent("recommend", "1,²,0", "--format", "index")
        assert result.returncode == 0 and result.stdout.strip() == "1", result.stderr
        assert f"'²' {NO_FORM_NOTE}" in result.stderr and "Traceback" not in result.stderr
        hidden = from_agent("recommend", "²,0")
        assert hidden.returncode == NO_GPUS and hidden.stdout == "", hidden.stderr
        good = from_agent("recommend", "1,-1,0", "--format", "index")
        assert good.returncode == 0 and good.stdout.strip() == "1", good.stderr
        job = ("--", "sh", "-c", 'echo "job: $GPU_EXPORTER_GPUS"')
        run = cli(
            "run",
            "--simulate",
            str(scenario),
            "--lock-dir",
            str(locks),
            "--from",
            url,
            *job,
            env=clean_env(CUDA_VISIBLE_DEVICES="1,²"),
        )
        assert run.returncode == 0 and run.stdout == "job: 1\n", run.stderr
        status, body = http_get(f"{url}/recommend?visible=1,%C2%B2")
        assert status == 400 and f"visible: '²' {NO_FORM_NOTE.split(';')[0]}" in body
