"""The per-GPU readings declared as data: one entry per metric, as dcgm-exporter's counters CSV.

Each :class:`Reading` names where a value comes from (an ``nvmlDeviceGetFieldValues`` field id,
a pynvml function of the GPU's handle, or a GPM metric id), how to scale it to base units, the
metric it is exported as (name, type, help, fixed labels), how often it is read, and the value
the simulated driver answers by default. The one table drives the NVML read (``core.nvml``: every
field value of a GPU in one call per sample), the exposition, the simulated driver and the rows
of ``docs/metrics.md``; adding a metric is adding an entry.

NVML's field ids live here and nowhere else: pynvml names them ``NVML_FI_DEV_*`` (``constant``,
for the docs), but older nvidia-ml-py releases lack the newer names, and the ids are NVML's ABI,
so the numbers are written out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Cadence = Literal["sample", "slow", "static"]
Kind = Literal["gauge", "counter"]

#: Readings of the ``slow`` cadence are read at most this often (and at every sample when the
#: interval is longer): values that change over tens of seconds or not until a reset.
SLOW_SECONDS = 30.0
#: A reading with ``idle_recheck`` that read 0 is read again after this long (and at every
#: sample while it reads more than 0, or when the interval is longer).
IDLE_RECHECK_SECONDS = 5.0
#: NVML's ``NVML_FI_DEV_NVLINK_LINK_COUNT``: how many NVLink links a GPU has (read at start).
NVLINK_LINK_COUNT = 91


@dataclass(frozen=True, slots=True)
class FieldValue:
    """A field of ``nvmlDeviceGetFieldValues`` (``id``, pynvml's ``constant`` name)."""

    id: int
    constant: str


@dataclass(frozen=True, slots=True)
class Function:
    """A pynvml function of the GPU's handle; ``item``: the element of a list answer."""

    name: str
    item: int | None = None


@dataclass(frozen=True, slots=True)
class GpmMetric:
    """A metric of NVML's GPU Performance Monitoring (``nvmlGpmMetricsGet`` over two
    ``nvmlGpmSampleGet`` samples; Hopper and later): its ``id``, pynvml's ``constant``."""

    id: int
    constant: str


@dataclass(frozen=True, slots=True)
class Reading:
    """One metric read per GPU (or per GPU and NVLink link)."""

    key: str  # the Snapshot's key (``Gpu.fields``), the scenario's key, unique
    metric: str  # the exported name, ``_total`` included on counters
    kind: Kind
    help: str
    unit: str  # for the docs
    source: FieldValue | Function | GpmMetric
    scale: float = 1.0  # NVML's unit to the base unit
    labels: tuple[tuple[str, str], ...] = ()  # fixed extra labels
    cadence: Cadence = "sample"
    #: One value per NVLink link: the field is scoped by link (``scopeId``), or, with
    #: ``link_ids``, a field of its own per link (link N is ``link_ids[N]``).
    per_link: bool = False
    link_ids: tuple[int, ...] = ()
    requires_ecc: bool = False  # read only while ECC is on
    #: Read instead while the field is not supported (older drivers and GPUs).
    fallback: Function | None = None
    #: 1 when NVML's value equals this, else 0 (states such as NVLink's active).
    equals: int | None = None
    absent: str = ""  # for the docs: when it is absent beyond the general rules
    simulated: float = 0.0  # the simulated driver's default, in base units
    #: An engine that is mostly idle (the video encoder on an ML host): while it reads 0, read
    #: it only every ``IDLE_RECHECK_SECONDS``; once it reads more, at every sample.
    idle_recheck: bool = False

    @property
    def family(self) -> str:
        """The metric family's name (a counter's without ``_total``)."""
        if self.kind == "counter" and self.metric.endswith("_total"):
            return self.metric[: -len("_total")]
        return self.metric

    def field_id(self, link: int | None) -> int | None:
        """The field id to ask for (for ``link`` of a per-link reading); None: none exists."""
        assert isinstance(self.source, FieldValue)
        if self.link_ids:
            return self.link_ids[link] if link is not None and link < len(self.link_ids) else None
        return self.source.id


def _fv(number: int, constant: str) -> FieldValue:
    return FieldValue(number, "NVML_FI_DEV_" + constant)


def _lanes(first_six: int, next_six: int) -> tuple[int, ...]:
    """Per-link field ids of the L0-L5 and L6-L11 blocks."""
    return tuple(range(first_six, first_six + 6)) + tuple(range(next_six, next_six + 6))


_PCIE_ERRORS = (
    ("correctable", 173, "PCIE_COUNT_CORRECTABLE_ERRORS"),
    ("naks_received", 174, "PCIE_COUNT_NAKS_RECEIVED"),
    ("receiver_error", 175, "PCIE_COUNT_RECEIVER_ERROR"),
    ("bad_tlp", 176, "PCIE_COUNT_BAD_TLP"),
    ("naks_sent", 177, "PCIE_COUNT_NAKS_SENT"),
    ("bad_dllp", 178, "PCIE_COUNT_BAD_DLLP"),
    ("non_fatal", 179, "PCIE_COUNT_NON_FATAL_ERROR"),
    ("fatal", 180, "PCIE_COUNT_FATAL_ERROR"),
    ("unsupported_request", 181, "PCIE_COUNT_UNSUPPORTED_REQ"),
    ("lcrc", 182, "PCIE_COUNT_LCRC_ERROR"),
    ("lane", 183, "PCIE_COUNT_LANE_ERROR"),
    ("l0_to_recovery", 169, "PCIE_L0_TO_RECOVERY_COUNTER"),
    ("replay_rollover", 95, "PCIE_REPLAY_ROLLOVER_COUNTER"),
)
#: Time spent in each clock-event (throttle) reason: the ``reason`` values of
#: ``gpu_clock_event_active`` where the two overlap, NVML's policy names elsewhere.
_CLOCK_EVENT_TIMES = (
    ("sw_power_cap", 74, "PERF_POLICY_POWER"),
    ("sync_boost", 76, "PERF_POLICY_SYNC_BOOST"),
    ("sw_thermal_slowdown", 269, "CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN"),
    ("hw_thermal_slowdown", 270, "CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN"),
    ("hw_power_brake_slowdown", 271, "CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN"),
    ("thermal", 75, "PERF_POLICY_THERMAL"),
    ("board_limit", 77, "PERF_POLICY_BOARD_LIMIT"),
    ("low_utilization", 78, "PERF_POLICY_LOW_UTILIZATION"),
    ("reliability", 79, "PERF_POLICY_RELIABILITY"),
    ("total_applications_clocks", 80, "PERF_POLICY_TOTAL_APP_CLOCKS"),
    ("total_base_clocks", 81, "PERF_POLICY_TOTAL_BASE_CLOCKS"),
)
_NVLINK_ERRORS = (
    ("crc_flit", _fv(163, "NVLINK_ERROR_DL_CRC"), ()),
    ("crc_data", _fv(39, "NVLINK_CRC_DATA_ERROR_COUNT_L0"), _lanes(39, 102)),
    ("replay", _fv(161, "NVLINK_ERROR_DL_REPLAY"), ()),
    ("recovery", _fv(162, "NVLINK_ERROR_DL_RECOVERY"), ()),
)
_NS = 1e-9
_MILLI = 1e-3
_KIB = 1024.0
_MIB = 1048576.0
_PERCENT = 0.01
#: GPM's activities: (key, metric, NVML_GPM_METRIC_ id and name, what it measures).
_GPM_ACTIVITIES = (
    ("sm_active", "gpu_sm_active_ratio", 2, "SM_UTIL", "Share of the SMs busy"),
    (
        "sm_occupancy",
        "gpu_sm_occupancy_ratio",
        3,
        "SM_OCCUPANCY",
        "Resident warps against the SMs' maximum",
    ),
    (
        "tensor_active",
        "gpu_tensor_active_ratio",
        5,
        "ANY_TENSOR_UTIL",
        "Share of time the SMs ran any tensor-core instruction",
    ),
    (
        "dram_active",
        "gpu_dram_active_ratio",
        10,
        "DRAM_BW_UTIL",
        "Memory bandwidth used against its maximum",
    ),
    (
        "fp64_active",
        "gpu_fp64_active_ratio",
        11,
        "FP64_UTIL",
        "Share of time in FP64 (not tensor) math",
    ),
    (
        "fp32_active",
        "gpu_fp32_active_ratio",
        12,
        "FP32_UTIL",
        "Share of time in FP32 (not tensor) math",
    ),
    (
        "fp16_active",
        "gpu_fp16_active_ratio",
        13,
        "FP16_UTIL",
        "Share of time in FP16 (not tensor) math",
    ),
    (
        "graphics_engine_active",
        "gpu_graphics_engine_active_ratio",
        1,
        "GRAPHICS_UTIL",
        "Share of time the graphics or compute engine was active",
    ),
)
#: GPM's bandwidths, in MiB/s: (key, metric, id and name, direction and bus).
_GPM_RATES = (
    (
        "pcie_transmit_rate",
        "gpu_pcie_transmit_bytes_per_second",
        20,
        "PCIE_TX_PER_SEC",
        "PCIe, sent",
    ),
    (
        "pcie_receive_rate",
        "gpu_pcie_receive_bytes_per_second",
        21,
        "PCIE_RX_PER_SEC",
        "PCIe, received",
    ),
    (
        "nvlink_transmit_rate",
        "gpu_nvlink_transmit_bytes_per_second",
        61,
        "NVLINK_TOTAL_TX_PER_SEC",
        "NVLink, all links, written",
    ),
    (
        "nvlink_receive_rate",
        "gpu_nvlink_receive_bytes_per_second",
        60,
        "NVLINK_TOTAL_RX_PER_SEC",
        "NVLink, all links, read",
    ),
)
_SINCE = "since the previous sample, from GPM"
_GPM_ABSENT = (
    "GPUs without GPM (gpu_gpm_supported 0: before Hopper, most consumer GPUs), GPUs whose "
    "GPM lacks the metric, the first sample after start, while the counters are busy"
)


def _gpm(
    key: str, metric: str, number: int, constant: str, doc: str, unit: str, scale: float
) -> Reading:
    """A GPM reading from NVML's ``NVML_GPM_METRIC_<constant>`` (``number``)."""
    return Reading(
        key,
        metric,
        "gauge",
        doc,
        unit,
        GpmMetric(number, "NVML_GPM_METRIC_" + constant),
        scale,
        absent=_GPM_ABSENT,
    )


READINGS: tuple[Reading, ...] = (
    # -- power and temperature -------------------------------------------------------------
    Reading(
        "power",
        "gpu_power_watts",
        "gauge",
        "Power draw (averaged over one second where the driver has that field).",
        "W",
        _fv(185, "POWER_AVERAGE"),
        _MILLI,
        fallback=Function("nvmlDeviceGetPowerUsage"),
        absent="neither the field nor `nvmlDeviceGetPowerUsage` is supported",
        simulated=70.0,
    ),
    Reading(
        "power_instant",
        "gpu_power_instant_watts",
        "gauge",
        "Instantaneous power draw.",
        "W",
        _fv(186, "POWER_INSTANT"),
        _MILLI,
        absent="drivers or GPUs without the field",
        simulated=70.0,
    ),
    Reading(
        "energy",
        "gpu_energy_joules_total",
        "counter",
        "Energy consumed since the driver was loaded.",
        "J",
        _fv(83, "TOTAL_ENERGY_CONSUMPTION"),
        _MILLI,
        absent="GPUs before Volta",
    ),
    Reading(
        "memory_temperature",
        "gpu_memory_temperature_celsius",
        "gauge",
        "GPU memory (HBM) temperature.",
        "°C",
        _fv(82, "MEMORY_TEMP"),
        absent="no memory sensor (most GeForce cards)",
        simulated=40.0,
    ),
    # -- ECC and memory repair -------------------------------------------------------------
    Reading(
        "ecc_corrected",
        "gpu_ecc_errors_total",
        "counter",
        "ECC errors since the driver was loaded (volatile counters), where ECC is on.",
        "errors",
        _fv(3, "ECC_SBE_VOL_TOTAL"),
        labels=(("type", "corrected"),),
        requires_ecc=True,
        absent="ECC off or its mode unknown (GeForce cards)",
    ),
    Reading(
        "ecc_uncorrected",
        "gpu_ecc_errors_total",
        "counter",
        "ECC errors since the driver was loaded (volatile counters), where ECC is on.",
        "errors",
        _fv(4, "ECC_DBE_VOL_TOTAL"),
        labels=(("type", "uncorrected"),),
        requires_ecc=True,
        absent="ECC off or its mode unknown (GeForce cards)",
    ),
    Reading(
        "ecc_aggregate_corrected",
        "gpu_ecc_errors_aggregate_total",
        "counter",
        "ECC errors over the GPU's life (the InfoROM's aggregate counters), where ECC is on.",
        "errors",
        _fv(5, "ECC_SBE_AGG_TOTAL"),
        labels=(("type", "corrected"),),
        requires_ecc=True,
        absent="ECC off or its mode unknown",
    ),
    Reading(
        "ecc_aggregate_uncorrected",
        "gpu_ecc_errors_aggregate_total",
        "counter",
        "ECC errors over the GPU's life (the InfoROM's aggregate counters), where ECC is on.",
        "errors",
        _fv(6, "ECC_DBE_AGG_TOTAL"),
        labels=(("type", "uncorrected"),),
        requires_ecc=True,
        absent="ECC off or its mode unknown",
    ),
    Reading(
        "remapped_rows_correctable",
        "gpu_remapped_rows",
        "gauge",
        "Memory rows remapped (row remapping, Ampere and newer), by the kind of error behind it.",
        "rows",
        _fv(142, "REMAPPED_COR"),
        labels=(("cause", "correctable"),),
        absent="GPUs before Ampere (they retire pages instead)",
    ),
    Reading(
        "remapped_rows_uncorrectable",
        "gpu_remapped_rows",
        "gauge",
        "Memory rows remapped (row remapping, Ampere and newer), by the kind of error behind it.",
        "rows",
        _fv(143, "REMAPPED_UNC"),
        labels=(("cause", "uncorrectable"),),
        absent="GPUs before Ampere (they retire pages instead)",
    ),
    Reading(
        "row_remap_pending",
        "gpu_row_remap_pending",
        "gauge",
        "1 while a row remapping waits for a GPU reset to take effect.",
        "1 or 0",
        _fv(144, "REMAPPED_PENDING"),
        absent="GPUs before Ampere",
    ),
    Reading(
        "row_remap_failed",
        "gpu_row_remap_failed",
        "gauge",
        "1 when a row remapping failed: the board should be replaced.",
        "1 or 0",
        _fv(145, "REMAPPED_FAILURE"),
        absent="GPUs before Ampere",
    ),
    Reading(
        "remapped_rows_inactive_correctable",
        "gpu_remapped_rows_inactive",
        "gauge",
        "Row remappings recorded but not active yet (NVML 13), by the kind of error behind it.",
        "rows",
        _fv(301, "REMAPPED_ROWS_COR_INACTIVE"),
        labels=(("cause", "correctable"),),
        absent="drivers before NVML 13",
    ),
    Reading(
        "remapped_rows_inactive_uncorrectable",
        "gpu_remapped_rows_inactive",
        "gauge",
        "Row remappings recorded but not active yet (NVML 13), by the kind of error behind it.",
        "rows",
        _fv(302, "REMAPPED_ROWS_UNC_INACTIVE"),
        labels=(("cause", "uncorrectable"),),
        absent="drivers before NVML 13",
    ),
    Reading(
        "bank_remappings_active",
        "gpu_bank_remappings",
        "gauge",
        "Memory bank remappings (NVML 13), active or waiting for a reset (inactive).",
        "banks",
        _fv(303, "ACTIVE_BANK_REMAPPINGS"),
        labels=(("state", "active"),),
        absent="drivers before NVML 13, GPUs without bank remapping",
    ),
    Reading(
        "bank_remappings_inactive",
        "gpu_bank_remappings",
        "gauge",
        "Memory bank remappings (NVML 13), active or waiting for a reset (inactive).",
        "banks",
        _fv(304, "INACTIVE_BANK_REMAPPINGS"),
        labels=(("state", "inactive"),),
        absent="drivers before NVML 13, GPUs without bank remapping",
    ),
    Reading(
        "bank_remapper_groups_full",
        "gpu_bank_remapper_groups",
        "gauge",
        "Memory groups by spare banks left for remapping (NVML 13): full, or none left.",
        "groups",
        _fv(305, "BANK_REMAPPER_HISTOGRAM_MAX"),
        labels=(("availability", "full"),),
        absent="drivers before NVML 13, GPUs without bank remapping",
    ),
    Reading(
        "bank_remapper_groups_none",
        "gpu_bank_remapper_groups",
        "gauge",
        "Memory groups by spare banks left for remapping (NVML 13): full, or none left.",
        "groups",
        _fv(306, "BANK_REMAPPER_HISTOGRAM_NONE"),
        labels=(("availability", "none"),),
        absent="drivers before NVML 13, GPUs without bank remapping",
    ),
    Reading(
        "bank_remap_pending",
        "gpu_bank_remap_pending",
        "gauge",
        "1 while a bank remapping waits for a GPU reset (NVML 13).",
        "1 or 0",
        _fv(307, "PENDING_BANK_REMAPPING"),
        absent="drivers before NVML 13, GPUs without bank remapping",
    ),
    Reading(
        "retired_pages_single_bit",
        "gpu_retired_pages",
        "gauge",
        "Memory pages retired (page retirement, GPUs before Ampere), by the error behind it.",
        "pages",
        _fv(29, "RETIRED_SBE"),
        labels=(("cause", "single_bit"),),
        absent="Ampere and newer (they remap rows instead)",
    ),
    Reading(
        "retired_pages_double_bit",
        "gpu_retired_pages",
        "gauge",
        "Memory pages retired (page retirement, GPUs before Ampere), by the error behind it.",
        "pages",
        _fv(30, "RETIRED_DBE"),
        labels=(("cause", "double_bit"),),
        absent="Ampere and newer (they remap rows instead)",
    ),
    Reading(
        "retired_pages_pending",
        "gpu_retired_pages_pending",
        "gauge",
        "1 while a page retirement waits for the driver to be reloaded.",
        "1 or 0",
        _fv(31, "RETIRED_PENDING"),
        absent="Ampere and newer",
    ),
    Reading(
        "memory_unrepairable",
        "gpu_memory_unrepairable",
        "gauge",
        "1 when the driver marks the GPU's memory unrepairable (NVML 13).",
        "1 or 0",
        Function("nvmlDeviceGetUnrepairableMemoryFlag_v1"),
        cadence="slow",
        absent="drivers before NVML 13",
    ),
    Reading(
        "repair_pending_channel",
        "gpu_repair_pending",
        "gauge",
        "1 while a channel or TPC repair waits for a GPU reset (NVML 13).",
        "1 or 0",
        Function("nvmlDeviceGetRepairStatus", item=0),
        labels=(("kind", "channel"),),
        cadence="slow",
        absent="drivers before NVML 13",
    ),
    Reading(
        "repair_pending_tpc",
        "gpu_repair_pending",
        "gauge",
        "1 while a channel or TPC repair waits for a GPU reset (NVML 13).",
        "1 or 0",
        Function("nvmlDeviceGetRepairStatus", item=1),
        labels=(("kind", "tpc"),),
        cadence="slow",
        absent="drivers before NVML 13",
    ),
    Reading(
        "recovery_action",
        "gpu_recovery_action",
        "gauge",
        "What the driver says the GPU needs: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, "
        "4 drain and reset, 5-7 NVML 13's (NVML's numbers; see docs/metrics.md).",
        "NVML's number",
        _fv(230, "GET_GPU_RECOVERY_ACTION"),
        absent="drivers without the field",
    ),
    # -- PCIe ------------------------------------------------------------------------------
    Reading(
        "pcie_link_generation",
        "gpu_pcie_link_generation",
        "gauge",
        "PCIe generation the link runs at now (it drops at idle to save power).",
        "generation",
        Function("nvmlDeviceGetCurrPcieLinkGeneration"),
        cadence="slow",
        simulated=5.0,
    ),
    Reading(
        "pcie_link_generation_max",
        "gpu_pcie_link_generation_max",
        "gauge",
        "Highest PCIe generation the GPU and its slot support together.",
        "generation",
        Function("nvmlDeviceGetMaxPcieLinkGeneration"),
        cadence="static",
        simulated=5.0,
    ),
    Reading(
        "pcie_link_width",
        "gpu_pcie_link_width",
        "gauge",
        "PCIe lanes the link runs with now.",
        "lanes",
        Function("nvmlDeviceGetCurrPcieLinkWidth"),
        cadence="slow",
        simulated=16.0,
    ),
    Reading(
        "pcie_link_width_max",
        "gpu_pcie_link_width_max",
        "gauge",
        "Most PCIe lanes the GPU and its slot support together.",
        "lanes",
        Function("nvmlDeviceGetMaxPcieLinkWidth"),
        cadence="static",
        simulated=16.0,
    ),
    Reading(
        "pcie_replays",
        "gpu_pcie_replay_errors_total",
        "counter",
        "PCIe replays (packets sent again after a link error) since the driver was loaded.",
        "replays",
        _fv(94, "PCIE_REPLAY_COUNTER"),
    ),
    *(
        Reading(
            f"pcie_errors_{name}",
            "gpu_pcie_errors_total",
            "counter",
            "PCIe errors by type, since the driver was loaded, where the GPU counts that type.",
            "errors",
            _fv(number, constant),
            labels=(("type", name),),
            absent="drivers or GPUs that do not count that type",
        )
        for name, number, constant in _PCIE_ERRORS
    ),
    Reading(
        "pcie_transmit_bytes",
        "gpu_pcie_transmit_bytes_total",
        "counter",
        "Bytes the GPU sent over PCIe.",
        "bytes",
        _fv(197, "PCIE_COUNT_TX_BYTES"),
        absent="drivers without the field",
    ),
    Reading(
        "pcie_receive_bytes",
        "gpu_pcie_receive_bytes_total",
        "counter",
        "Bytes the GPU received over PCIe.",
        "bytes",
        _fv(198, "PCIE_COUNT_RX_BYTES"),
        absent="drivers without the field",
    ),
    # -- NVLink (per link; none at all on GPUs without NVLink) -----------------------------
    Reading(
        "nvlink_up",
        "gpu_nvlink_up",
        "gauge",
        "1 while the NVLink link is active, else 0.",
        "1 or 0",
        _fv(165, "NVLINK_GET_STATE"),
        per_link=True,
        equals=1,
        simulated=1.0,
    ),
    Reading(
        "nvlink_transmit_bytes",
        "gpu_nvlink_transmit_bytes_total",
        "counter",
        "Data bytes sent over the NVLink link.",
        "bytes",
        _fv(138, "NVLINK_THROUGHPUT_DATA_TX"),
        _KIB,
        per_link=True,
    ),
    Reading(
        "nvlink_receive_bytes",
        "gpu_nvlink_receive_bytes_total",
        "counter",
        "Data bytes received over the NVLink link.",
        "bytes",
        _fv(139, "NVLINK_THROUGHPUT_DATA_RX"),
        _KIB,
        per_link=True,
    ),
    *(
        Reading(
            f"nvlink_errors_{name}",
            "gpu_nvlink_errors_total",
            "counter",
            "NVLink errors of the link by type: flit and data CRC errors, replays, recoveries.",
            "errors",
            source,
            labels=(("type", name),),
            per_link=True,
            link_ids=ids,
            absent="`crc_data`: links 12 and up (NVML has a field for links 0-11 only)"
            if ids
            else "",
        )
        for name, source, ids in _NVLINK_ERRORS
    ),
    # -- time lost to clock limits ---------------------------------------------------------
    *(
        Reading(
            f"clock_event_seconds_{name}",
            "gpu_clock_event_seconds_total",
            "counter",
            "Time clocks were held down by each clock-event (throttle) reason; rate() of it is "
            "the share of time throttled.",
            "s",
            _fv(number, constant),
            _NS,
            labels=(("reason", name),),
            absent="per reason, drivers without the field (the three slowdown reasons are "
            "recent: NVML 12.8 and newer)",
        )
        for name, number, constant in _CLOCK_EVENT_TIMES
    ),
    # -- media engines ---------------------------------------------------------------------
    Reading(
        "encoder_utilization",
        "gpu_encoder_utilization_ratio",
        "gauge",
        "Fraction of the driver's last sampling period the video encoder was busy (0-1).",
        "0-1",
        Function("nvmlDeviceGetEncoderUtilization", item=0),
        0.01,
        absent="GPUs without NVENC where the driver says so",
        idle_recheck=True,
    ),
    Reading(
        "decoder_utilization",
        "gpu_decoder_utilization_ratio",
        "gauge",
        "Fraction of the driver's last sampling period the video decoder was busy (0-1).",
        "0-1",
        Function("nvmlDeviceGetDecoderUtilization", item=0),
        0.01,
        absent="GPUs without NVDEC where the driver says so",
        idle_recheck=True,
    ),
    # -- GPU Performance Monitoring: between this sample and the previous one ---------------
    *(
        _gpm(key, metric, n, constant, f"{what} {_SINCE} (0-1).", "0-1", _PERCENT)
        for key, metric, n, constant, what in _GPM_ACTIVITIES
    ),
    *(
        _gpm(key, metric, n, constant, f"Bytes a second over {what}, {_SINCE}.", "bytes/s", _MIB)
        for key, metric, n, constant, what in _GPM_RATES
    ),
)

BY_KEY: dict[str, Reading] = {reading.key: reading for reading in READINGS}
#: The field-value readings, and the function readings, of each cadence.
FIELD_READINGS = tuple(r for r in READINGS if isinstance(r.source, FieldValue))
FUNCTION_READINGS = tuple(r for r in READINGS if isinstance(r.source, Function))
#: The GPM readings: one ``nvmlGpmMetricsGet`` per GPU and sample asks for all of them.
GPM_READINGS = tuple(r for r in READINGS if isinstance(r.source, GpmMetric))

#: ``gpu_recovery_action``'s values, as NVML numbers them (``nvmlDeviceGpuRecoveryAction_t``).
RECOVERY_ACTIONS = (
    (0, "none", "nothing to do"),
    (1, "gpu_reset", "reset the GPU"),
    (2, "node_reboot", "reboot the node"),
    (3, "drain_p2p", "drain peer-to-peer traffic"),
    (4, "drain_and_reset", "drain peer-to-peer traffic, then reset the GPU"),
    (5, "recover_imex_domain", "recover the IMEX domain (NVML 13)"),
    (6, "bus_reset", "reset the GPU's PCIe bus (NVML 13)"),
    (7, "system_reboot", "reboot the system (NVML 13)"),
)

assert len(BY_KEY) == len(READINGS), "reading keys must be unique"
