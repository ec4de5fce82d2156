"""exporter.core.nvml on simulated drivers: version fallbacks, remembered gaps, failure classes."""

from __future__ import annotations

import os

import pynvml
import pytest

from exporter.core.fields import BY_KEY, NVLINK_LINK_COUNT
from exporter.core.nvml import (
    GpuFailed,
    Nvml,
    NvmlUnavailable,
    ProcessUtilization,
    utilization_peaks,
)

ONE_GPU = """
gpus:
  - name: NVIDIA H100 80GB HBM3
    memory_total: 80GiB
    memory_reserved: 1GiB
    memory_used: 10GiB
    temperature: 61
    power: 300
    power_limit: 700
    utilization: 0.5
    memory_utilization: 0.25
    fan_speed: 0.4
    clock_event_reasons: [sw_power_cap, hw_power_brake_slowdown]
    ecc: {corrected: 3, uncorrected: 1}
    processes:
      - pid: self
        memory: 2GiB
      - pid: self
        memory: 1GiB
        type: graphics
"""


MEMORY_TEMP = BY_KEY["memory_temperature"].field_id(None)


def _field_requests(driver) -> list[list[int]]:
    """The field ids of each ``nvmlDeviceGetFieldValues`` call made on ``driver`` from now on
    (the static NVLink link count read left out)."""
    requested: list[list[int]] = []
    real = driver.nvmlDeviceGetFieldValues

    def recording(handle, ids):
        plain = [i if isinstance(i, int) else i[0] for i in ids]
        if plain != [NVLINK_LINK_COUNT]:
            requested.append(plain)
        return real(handle, ids)

    driver.nvmlDeviceGetFieldValues = recording
    return requested


def _read(nvml: Nvml, index: int = 0):
    info = nvml.read_info(index)
    return info, nvml.read_gpu(info)


def test_reads_every_field_with_current_driver(simulated):
    driver = simulated(ONE_GPU)
    nvml = Nvml(library=driver)
    host = nvml.init()
    assert host.driver_version == "550.54.15"
    assert host.cuda_version == "12.4"
    info, reading = _read(nvml)
    gpu = reading.gpu
    assert info.uuid.startswith("GPU-")
    assert info.memory_total_bytes == 80 * 1024**3
    assert info.temperature_thresholds == {
        "shutdown": 92.0,
        "slowdown": 89.0,
        "gpu_max": 87.0,
        "memory_max": 95.0,
    }
    assert info.power_limit_watts == 700.0
    assert info.ecc_enabled is True
    assert gpu.memory_reserved_bytes == 1024**3
    # v2 memory info: reserved memory is not counted as used
    assert gpu.memory_used_bytes == 13 * 1024**3
    assert gpu.memory_free_bytes == (80 - 1 - 13) * 1024**3
    assert gpu.temperature_celsius == 61.0
    assert gpu.power_watts == 300.0
    assert gpu.utilization_ratio == 0.5
    assert gpu.memory_utilization_ratio == 0.25
    assert gpu.fan_speed_ratio == 0.4
    assert gpu.clocks_hz["graphics"] == 1755e6
    assert gpu.clock_events_active()["hw_power_brake_slowdown"] is True
    assert gpu.clock_events_active()["hw_thermal_slowdown"] is False
    assert dict(gpu.ecc_errors) == {"corrected": 3, "uncorrected": 1}
    kinds = sorted((p.type, p.used_memory_bytes) for p in reading.processes)
    assert kinds == [("compute", 2 * 1024**3), ("graphics", 1024**3)]
    assert reading.errors == []


@pytest.mark.parametrize(
    ("missing", "expect_reserved", "process_call"),
    [
        ([], True, "nvmlDeviceGetComputeRunningProcesses_v3"),
        (["nvmlDeviceGetMemoryInfo_v2"], False, "nvmlDeviceGetComputeRunningProcesses_v3"),
        (
            ["nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3"],
            True,
            "nvmlDeviceGetComputeRunningProcesses_v2",
        ),
        (
            [
                "nvmlDeviceGetMemoryInfo_v2",
                "nvmlDeviceGetComputeRunningProcesses_v3",
                "nvmlDeviceGetGraphicsRunningProcesses_v3",
                "nvmlDeviceGetCurrentClocksEventReasons",
                "nvmlDeviceGetTemperatureV",
                "nvmlSystemGetCudaDriverVersion_v2",
            ],
            False,
            "nvmlDeviceGetComputeRunningProcesses_v2",
        ),
    ],
    ids=["r550", "no-memory-v2", "no-process-v3", "old-driver"],
)
def test_driver_matrix_falls_back_and_stops_asking(
    simulated, missing, expect_reserved, process_call
):
    driver = simulated(ONE_GPU + f"driver: {{missing_functions: {missing}}}\n")
    nvml = Nvml(library=driver)
    host = nvml.init()
    assert host.cuda_version == "12.4"
    info, first = _read(nvml)
    second = nvml.read_gpu(info)
    for reading in (first, second):
        gpu = reading.gpu
        assert (gpu.memory_reserved_bytes is not None) is expect_reserved
        # v1 counts reserved memory as used; either way used + free + reserved == total
        reserved = gpu.memory_reserved_bytes or 0
        assert gpu.memory_used_bytes + gpu.memory_free_bytes + reserved == info.memory_total_bytes
        assert gpu.temperature_celsius == 61.0
        assert gpu.clock_event_reasons is not None
        if callable(getattr(pynvml, process_call, None)):
            assert len(reading.processes) == 2
        else:  # nvidia-ml-py 12.535 has no _v2 function: with a driver without v3, the
            # process lists are unknown (absent), never an error or a short list
            assert reading.processes is None and reading.errors == []
    if callable(getattr(pynvml, process_call, None)):
        assert driver.calls[process_call] == 2
    for name in missing:  # each missing function was tried once, then remembered
        assert driver.calls.get(name, 0) <= 1


def test_unsupported_field_is_absent_and_not_retried(simulated):
    driver = simulated(
        ONE_GPU.replace(
            "power_limit: 700",
            "power_limit: 700\n    unsupported: [fan_speed, memory_temperature, ecc, serial]",
        )
    )
    requested = _field_requests(driver)
    nvml = Nvml(library=driver)
    nvml.init()
    info, first = _read(nvml)
    for _ in range(3):
        reading = nvml.read_gpu(info)
        assert reading.gpu.fan_speed_ratio is None
        assert reading.gpu.memory_temperature_celsius is None
        assert reading.gpu.temperature_celsius == 61.0
        assert reading.errors == []
    assert info.serial == ""
    assert info.ecc_enabled is None
    assert dict(first.gpu.ecc_errors) == {}
    assert driver.calls["nvmlDeviceGetFanSpeed"] == 1
    # the memory temperature's entry was asked for once: later calls leave it out
    assert [MEMORY_TEMP in ids for ids in requested] == [True, False, False, False]


def test_transient_field_error_is_reported_and_retried(simulated, clock):
    driver = simulated(
        ONE_GPU + "    errors: [{field: power, error: Timeout, from: 0s, until: 10s}]\n"
    )
    nvml = Nvml(library=driver)
    nvml.init()
    info, reading = _read(nvml)
    assert reading.gpu.power_watts is None
    assert [(e.field, e.error) for e in reading.errors] == [("power", "Timeout")]
    clock.advance(10)
    reading = nvml.read_gpu(info)
    assert reading.gpu.power_watts == 300.0
    assert reading.errors == []
    # the field's own entry failed, not the call: no fallback, and the other fields answered
    assert driver.calls["nvmlDeviceGetPowerUsage"] == 0


@pytest.mark.parametrize("error", ["GpuIsLost", "Unknown", "ResetRequired"])
def test_gpu_level_errors_fail_the_gpu(simulated, error):
    driver = simulated(ONE_GPU + f"    errors: [{{field: temperature, error: {error}}}]\n")
    nvml = Nvml(library=driver)
    nvml.init()
    info = nvml.read_info(0)
    with pytest.raises(GpuFailed) as failed:
        nvml.read_gpu(info)
    assert failed.value.error == error


def test_library_level_errors_make_nvml_unavailable(simulated, clock):
    driver = simulated(
        ONE_GPU + "    errors: [{field: memory, error: DriverNotLoaded, from: 1s}]\n"
    )
    nvml = Nvml(library=driver)
    nvml.init()
    info = nvml.read_info(0)
    clock.advance(1)
    with pytest.raises(NvmlUnavailable) as failed:
        nvml.read_gpu(info)
    assert failed.value.error == "DriverNotLoaded"


def test_init_failure_names_the_cause(simulated):
    driver = simulated("driver: {errors: [{field: init, error: DriverNotLoaded}]}\ngpus: [{}]\n")
    with pytest.raises(NvmlUnavailable) as failed:
        Nvml(library=driver).init()
    assert failed.value.error == "DriverNotLoaded"
    assert "DriverNotLoaded" in str(failed.value)


def test_calls_are_counted(simulated):
    driver = simulated(ONE_GPU)
    nvml = Nvml(library=driver)
    nvml.init()
    info = nvml.read_info(0)
    before = nvml.calls
    nvml.read_gpu(info)
    assert 10 <= nvml.calls - before <= 20


def test_mig_devices_are_read_with_the_static_facts(simulated):
    driver = simulated("gpus:\n  - {mig_devices: [MIG-1111, MIG-2222]}\n  - {}\n")
    nvml = Nvml(library=driver)
    nvml.init()
    assert nvml.read_info(0).mig_uuids == ("MIG-1111", "MIG-2222")
    assert nvml.read_info(1).mig_uuids == ()


# -- per-process SM utilization ------------------------------------------------------------------

#: The per-process utilization call the agent uses with this nvidia-ml-py: the R550 one, where
#: pynvml has it (13), else the older one (12.535).
UTILIZATION_CALL = (
    "nvmlDeviceGetProcessesUtilizationInfo"
    if hasattr(pynvml, "nvmlDeviceGetProcessesUtilizationInfo")
    else "nvmlDeviceGetProcessUtilization"
)

BUSY_AND_IDLE = """
gpus:
  - processes:
      - {pid: self, memory: 1GiB, sm_utilization: %s}
      - {pid: parent, memory: 1GiB}
"""


def _utilization(reading) -> dict[int, float | None]:
    return {p.pid: p.utilization.sm for p in reading.processes}


def test_process_utilization_is_the_busiest_moment_per_process(simulated, clock):
    driver = simulated(BUSY_AND_IDLE % "{base: 0.5, amplitude: 0.2, period: 4s}")
    nvml = Nvml(library=driver, wall=driver.wall)
    nvml.init()
    info, first = _read(nvml)
    clock.advance(1.5)
    second = nvml.read_gpu(info)  # its window holds the crest of the wave, at 1 s
    assert _utilization(first) == {os.getpid(): 0.5, os.getppid(): 0.0}  # t=0: sin(0)
    assert _utilization(second) == {os.getpid(): 0.7, os.getppid(): 0.0}
    assert first.errors == second.errors == []
    assert driver.calls[UTILIZATION_CALL] == 2


def test_no_busy_process_is_not_found_and_reads_zero_for_all(simulated, clock):
    driver = simulated(BUSY_AND_IDLE % "0")
    nvml = Nvml(library=driver, wall=driver.wall)
    nvml.init()
    info, reading = _read(nvml)
    clock.advance(5)
    again = nvml.read_gpu(info)
    for found in (reading, again):
        assert _utilization(found) == {os.getpid(): 0.0, os.getppid(): 0.0}
        assert found.errors == []
    assert driver.calls[UTILIZATION_CALL] == 2  # asked each sample all the same


def test_a_read_without_busy_samples_moves_the_next_one_forward(simulated, clock):
    """Once the driver said no process was busy, the next read does not ask for its whole
    buffer again (a second before the previous read, for samples written late), and a
    process busy since then is still seen."""
    driver = simulated(BUSY_AND_IDLE % "{points: [[0s, 0], [9.5s, 0], [9.6s, 0.3]]}")
    asked: list[int] = []
    real = getattr(driver, UTILIZATION_CALL)

    def recording(handle, since):
        asked.append(since)
        return real(handle, since)

    setattr(driver, UTILIZATION_CALL, recording)
    nvml = Nvml(library=driver, wall=driver.wall)
    nvml.init()
    info, reading = _read(nvml)
    for _ in range(2):
        clock.advance(5)
        reading = nvml.read_gpu(info)
    first_read_us = round(driver.wall() * 1e6) - 10_000_000
    assert asked[0] == 0
    assert asked[1:] == [first_read_us - 1_000_000, first_read_us + 4_000_000]
    assert _utilization(reading) == {os.getpid(): 0.3, os.getppid(): 0.0}


OTHER_NAMESPACE = """
driver: {utilization_pid_offset: %d}
gpus:
  - processes:
      - {pid: self, memory: 1GiB, sm_utilization: 0.4}
      - {pid: parent, memory: 1GiB}
"""


@pytest.mark.parametrize(
    ("initial", "offset", "expected"),
    [
        (False, 0, (0.4, 0.0)),  # a pod's sidecar, PIDs translated in both answers
        (False, 4000000, (None, None)),  # samples in host PIDs: nothing reads as idle
        (True, 4000000, (0.0, 0.0)),  # on the host an unmatched sample is a process gone
    ],
)
def test_utilization_in_another_pid_namespace_is_unknown_when_its_pids_do_not_match(
    simulated, clock, initial, offset, expected
):
    driver = simulated(OTHER_NAMESPACE % offset)
    nvml = Nvml(library=driver, wall=driver.wall, initial_pid_namespace=initial)
    nvml.init()
    _, reading = _read(nvml)
    assert _utilization(reading) == dict(zip((os.getpid(), os.getppid()), expected, strict=True))
    assert reading.errors == []


def test_each_read_covers_the_time_since_the_previous_one(simulated, clock):
    # busy at 60 % until 10 s, idle after; the driver keeps about 17 s of samples
    driver = simulated(BUSY_AND_IDLE % "{from: 0.6, to: 0, start: 10s}")
    nvml = Nvml(library=driver, wall=driver.wall)
    nvml.init()
    info = nvml.read_info(0)
    seen = []
    for advance in (0, 5, 7, 2, 3):  # at 0, 5, 12, 14 and 17 s
        clock.advance(advance)
        seen.append(_utilization(nvml.read_gpu(info))[os.getpid()])
    # 5 -> 12 s still holds busy moments; 12 -> 14 s does not, though the buffer does
    assert seen == [0.6, 0.6, 0.6, 0.0, 0.0]


def test_a_timestamp_ahead_of_the_clock_reads_the_whole_buffer_again(simulated, clock):
    driver = simulated(BUSY_AND_IDLE % "{from: 0.6, to: 0, start: 10s}")
    # The host's clock was set back an hour.
    nvml = Nvml(library=driver, wall=lambda: driver.wall() - 3600)
    nvml.init()
    info = nvml.read_info(0)
    for advance in (0, 12, 2):
        clock.advance(advance)
        reading = nvml.read_gpu(info)
    assert _utilization(reading)[os.getpid()] == 0.6  # not 0: never newer than a future stamp


@pytest.mark.parametrize(
    ("driver_line", "gpu_line"),
    [
        ("", "    unsupported: [process_utilization]\n"),
        (
            "driver: {missing_functions: [nvmlDeviceGetProcessesUtilizationInfo, "
            "nvmlDeviceGetProcessUtilization]}\n",
            "",
        ),
    ],
    ids=["not-supported", "driver-lacks-it"],
)
def test_unsupported_process_utilization_is_none_and_not_retried(simulated, driver_line, gpu_line):
    driver = simulated(driver_line + BUSY_AND_IDLE % "0.5" + gpu_line)
    nvml = Nvml(library=driver, wall=driver.wall)
    nvml.init()
    info, first = _read(nvml)
    for reading in (first, nvml.read_gpu(info), nvml.read_gpu(info)):
        assert set(_utilization(reading).values()) == {None}
        assert reading.errors == []
        assert reading.gpu.memory_used_bytes is not None
    if gpu_line:  # the GPU says no, once
        assert driver.calls[UTILIZATION_CALL] == 1
    assert driver.calls["nvmlDeviceGetProcessUtilization"] <= 1


@pytest.mark.parametrize("error", ["Timeout", "Unknown"])
def test_failed_process_utilization_is_none_for_that_sample_only(simulated, clock, error):
    driver = simulated(
        BUSY_AND_IDLE % "0.5"
        + f"    errors: [{{field: process_utilization, error: {error}, until: 5s}}]\n"
    )
    nvml = Nvml(library=driver, wall=driver.wall)
    nvml.init()
    info, reading = _read(nvml)  # the GPU stays up: every other call on it answered
    assert set(_utilization(reading).values()) == {None}
    assert [(e.source, e.error, e.field) for e in reading.errors] == [
        ("field", error, "process_utilization")
    ]
    assert reading.gpu.memory_used_bytes is not None and len(reading.processes) == 2
    clock.advance(5)
    reading = nvml.read_gpu(info)
    assert _utilization(reading) == {os.getpid(): 0.5, os.getppid(): 0.0}
    assert reading.errors == []


def test_lost_gpu_during_process_utilization_still_fails_the_gpu(simulated):
    driver = simulated(
        BUSY_AND_IDLE % "0.5" + "    errors: [{field: process_utilization, error: GpuIsLost}]\n"
    )
    nvml = Nvml(library=driver)
    nvml.init()
    info = nvml.read_info(0)
    with pytest.raises(GpuFailed) as failed:
        nvml.read_gpu(info)
    assert failed.value.error == "GpuIsLost"


def test_a_gpu_without_processes_is_not_asked_for_their_utilization(simulated):
    driver = simulated("gpus: [{utilization: 0.9}]\n")
    nvml = Nvml(library=driver)
    nvml.init()
    info, reading = _read(nvml)
    nvml.read_gpu(info)
    assert reading.processes == []
    assert driver.calls[UTILIZATION_CALL] == driver.calls["nvmlDeviceGetProcessUtilization"] == 0


ALL_FOUR = """
gpus:
  - processes:
      - pid: self
        sm_utilization: 0.4
        memory_utilization: 0.25
        encoder_utilization: 0.1
        decoder_utilization: 0.6
      - {pid: parent}
"""


@pytest.mark.parametrize("older", [False, True], ids=["processes-utilization-info", "older-call"])
def test_memory_encoder_and_decoder_utilization_come_with_the_sms(simulated, older):
    lacks = "driver: {missing_functions: [nvmlDeviceGetProcessesUtilizationInfo]}\n"
    driver = simulated((lacks if older else "") + ALL_FOUR)
    nvml = Nvml(library=driver, wall=driver.wall)
    nvml.init()
    _, reading = _read(nvml)
    found = {p.pid: p.utilization for p in reading.processes}
    assert found[os.getpid()] == ProcessUtilization(0.4, 0.25, 0.1, 0.6)
    assert found[os.getppid()] == ProcessUtilization(0.0, 0.0, 0.0, 0.0)  # no sample: idle
    nvml.read_gpu(nvml.read_info(0))
    new, old = "nvmlDeviceGetProcessesUtilizationInfo", "nvmlDeviceGetProcessUtilization"
    if older or not hasattr(pynvml, new):  # asked once (FunctionNotFound), then never again
        assert (driver.calls[new], driver.calls[old]) == (int(hasattr(pynvml, new)), 2)
    else:
        assert (driver.calls[new], driver.calls[old]) == (2, 0)


def _sample(
    pid: int, stamp: int, sm: int, mem: int = 0, enc: int = 0, dec: int = 0
) -> pynvml.c_nvmlProcessUtilizationSample_t:
    sample = pynvml.c_nvmlProcessUtilizationSample_t()
    sample.pid, sample.timeStamp, sample.smUtil = pid, stamp, sm
    sample.memUtil, sample.encUtil, sample.decUtil = mem, enc, dec
    return sample


def test_utilization_peaks_keep_the_newest_valid_samples_and_drop_garbage():
    samples = [
        _sample(1, 150, 20, mem=30, enc=1),
        _sample(1, 160, 70, mem=10, dec=9),
        _sample(1, 90, 100, mem=100),  # older than asked for
        _sample(2, 170, 4294967295),  # garbage: unknown, not busy and not idle
        _sample(3, 140, 101),
        _sample(3, 130, 5, enc=200),  # one value of garbage makes the sample garbage
        _sample(3, 120, 6),
        _sample(0, 0, 0),  # an unwritten slot
    ]
    peaks, newest = utilization_peaks(samples, since=100)
    assert peaks == {
        1: ProcessUtilization(0.7, 0.3, 0.01, 0.09),
        2: ProcessUtilization(),
        3: ProcessUtilization(0.06, 0.0, 0.0, 0.0),
    }
    assert newest == 160  # garbage timestamps are not trusted
    assert utilization_peaks([], since=100) == ({}, 100)


def test_field_values_read_by_plan_match_a_read_entry_by_entry(simulated, clock):
    """After one answer decoded entry by entry, a GPU's answers are decoded by its plan
    (core.fieldplan): the same readings as a fresh read, sample after sample, while values
    move; an entry that fails falls back to entry by entry, with its error, and the plan is
    made again after it."""
    driver = simulated(
        ONE_GPU.replace("power: 300", "power: {base: 300, amplitude: 50, period: 7s}")
        + "    nvlink: {links: 14}\n"
        + "    errors: [{field: power, error: Timeout, from: 2s, until: 3s}]\n"
    )
    nvml = Nvml(library=driver)
    nvml.init()
    info = nvml.read_info(0)
    powers = set()
    for second in range(6):
        reading = nvml.read_gpu(info)
        powers.add(reading.gpu.power_watts)
        fresh = Nvml(library=driver)
        fresh.init()
        expected = fresh.read_gpu(fresh.read_info(0))  # its first read: entry by entry
        assert dict(reading.gpu.fields) == dict(expected.gpu.fields), second
        assert list(reading.gpu.fields) == list(expected.gpu.fields), second
        assert list(reading.gpu.nvlink.pairs()) == list(expected.gpu.nvlink.pairs()), second
        assert reading.errors == expected.errors, second
        if second == 2:
            assert [(e.field, e.error) for e in reading.errors] == [("power", "Timeout")]
            assert "power" not in reading.gpu.fields
        else:
            assert reading.gpu.power_watts == pytest.approx(expected.gpu.power_watts)
        clock.advance(1)
    assert len(powers) >= 4  # the values moved: no answer was taken for the one before
