"""Install a simulated driver as the ``pynvml`` module's own functions, for the benchmark only.

gpu-exporter takes its NVML library as a parameter (``Nvml(library=driver)``), but nvitop calls
``pynvml`` itself, and some NVML C symbols directly (through ``pynvml._nvmlGetFunctionPointer``,
for the process and memory structs). To run it on simulated GPUs, ``bench/run_simulated.py``
replaces them in its process with :func:`install_globally`; nothing in ``exporter/`` does this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml

_ABSENT = object()


def _calls_library(obj: Any) -> bool:
    """True for the pynvml functions that call into libnvidia-ml (wrappers call those)."""
    code = getattr(obj, "__code__", None)
    return code is not None and (
        "_nvmlGetFunctionPointer" in code.co_names or "_LoadNvmlLibrary" in code.co_names
    )


def install_globally(driver: Any) -> Callable[[], None]:
    """Put ``driver``'s functions (a started ``SimulatedDriver``) on the pynvml module: those it
    implements or the scenario names missing, and for every other pynvml function that calls
    libnvidia-ml its FunctionNotFound (or NotSupported) answer; serve the C symbols from the
    same functions. Returns the function that puts pynvml's own back."""
    answered = driver.implemented | driver.scenario.missing_functions
    names = {
        name
        for name in driver.function_names
        if name in answered or _calls_library(getattr(pynvml, name, None))
    }
    saved = {name: vars(pynvml).get(name, _ABSENT) for name in names}
    saved["_nvmlGetFunctionPointer"] = pynvml._nvmlGetFunctionPointer
    for name in names:
        setattr(pynvml, name, getattr(driver, name))
    shims = c_symbols(driver)

    def function_pointer(symbol: str) -> Callable[..., int]:
        if symbol not in shims:
            raise pynvml.NVMLError_FunctionNotFound()
        return shims[symbol]

    pynvml._nvmlGetFunctionPointer = function_pointer

    def uninstall() -> None:
        for name, original in saved.items():
            if original is _ABSENT:
                delattr(pynvml, name)
            else:
                setattr(pynvml, name, original)

    return uninstall


def c_symbols(driver: Any) -> dict[str, Callable[..., int]]:
    """C-style stand-ins for the NVML symbols some tools call directly: they fill the ctypes
    out-parameters from the driver's functions and return NVML return codes instead of
    raising."""
    implemented = driver.implemented

    def c_call(fill: Callable[..., int | None]) -> Callable[..., int]:
        def symbol(*args: Any) -> int:
            try:
                return fill(*args) or pynvml.NVML_SUCCESS
            except pynvml.NVMLError as exc:
                return exc.value

        return symbol

    def processes(name: str) -> Callable[..., int]:
        def fill(handle: Any, count_ref: Any, array: Any) -> int:
            listed = getattr(driver, name)(handle)
            count = count_ref._obj
            if array is None or len(array) < len(listed):
                count.value = len(listed)
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE if listed else pynvml.NVML_SUCCESS
            for item, proc in zip(array, listed, strict=False):
                for key, value in vars(proc).items():
                    if hasattr(item, key):
                        setattr(item, key, value)
            count.value = len(listed)
            return pynvml.NVML_SUCCESS

        return c_call(fill)

    def memory(versioned: bool) -> Callable[..., int]:
        def fill(handle: Any, ref: Any) -> None:
            out = ref._obj
            got = driver.nvmlDeviceGetMemoryInfo(handle, version=out.version if versioned else None)
            for key, _ in got._fields_:
                if key != "version":
                    setattr(out, key, getattr(got, key))

        return c_call(fill)

    def field_values(handle: Any, count: Any, ref: Any) -> None:
        values = ref._obj
        got = driver.nvmlDeviceGetFieldValues(
            handle, [values[i].fieldId for i in range(count.value)]
        )
        for i in range(count.value):
            values[i].valueType, values[i].nvmlReturn = got[i].valueType, got[i].nvmlReturn
            values[i].value = got[i].value

    def no_mps(handle: Any, count_ref: Any, array: Any) -> None:
        count_ref._obj.value = 0  # the simulation runs no MPS server

    def temperature_v(handle: Any, ref: Any) -> None:
        ref._obj.temperature = driver.nvmlDeviceGetTemperatureV(handle, ref._obj.sensorType)

    def temperature(handle: Any, sensor: Any, ref: Any) -> None:
        ref._obj.value = driver.nvmlDeviceGetTemperature(handle, getattr(sensor, "value", sensor))

    shims = {
        "nvmlDeviceGetMemoryInfo": memory(False),
        "nvmlDeviceGetMemoryInfo_v2": memory(True),
        "nvmlDeviceGetFieldValues": c_call(field_values),
        "nvmlDeviceGetTemperatureV": c_call(temperature_v),
        "nvmlDeviceGetTemperature": c_call(temperature),
    }
    for version in ("_v2", "_v3"):
        for kind in ("Compute", "Graphics"):
            name = f"nvmlDeviceGet{kind}RunningProcesses{version}"
            if name in implemented:
                shims[name] = processes(name)
        shims[f"nvmlDeviceGetMPSComputeRunningProcesses{version}"] = c_call(no_mps)
    missing = driver.scenario.missing_functions
    return {name: shim for name, shim in shims.items() if name not in missing}
