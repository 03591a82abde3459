"""NVML access for the telemetry sampler: lazy import, one probe per device, cheap reads.

`pynvml` (PyPI package `nvidia-ml-py`) is imported only when a sampler starts, so importing
glm5_fp4 never needs it. Every metric is tried once per device when the reader opens; one that
NVML refuses there (not supported on this GPU, symbol missing from an old driver) is dropped for
that device, so the sampling loop never pays for exceptions on metrics that cannot work.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# NVML's clock-event ("throttle") reason bits. They are part of NVML's stable C API, so they are
# spelled out here rather than read from pynvml, whose constant names changed between releases.
THROTTLE_BITS: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal",
    0x040: "hw_thermal",
    0x080: "hw_power_brake",
    0x100: "display_clocks",
    0x200: "board_limit",
    0x400: "reliability",
}

# Field ids (nvml.h) read in one nvmlDeviceGetFieldValues call per device and sample.
FI_POWER_INSTANT = 186
FI_PCIE_TX_BYTES = 197
FI_PCIE_RX_BYTES = 198

# c_nvmlValue_t union member for each NVML_VALUE_TYPE_*.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_TEMPERATURE_GPU = 0
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1


class TelemetryUnavailable(Exception):
    """NVML cannot be used here; the message says why (missing package, no driver, no GPU)."""


@functools.lru_cache(maxsize=256)
def decode_throttle(mask: int) -> tuple[str, ...]:
    """Names of the set clock-event bits; unknown bits are kept as hex so nothing is hidden."""
    names = [name for bit, name in THROTTLE_BITS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_BITS)
    if unknown:
        names.append(f"other_0x{unknown:x}")
    return tuple(names)


def import_nvml(nvml: Any = None) -> Any:
    """The NVML binding to use: the one given (tests pass a fake) or `pynvml`, imported now."""
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError as exc:
        raise TelemetryUnavailable(
            "nvidia-ml-py is not installed (pip install nvidia-ml-py), so NVML cannot be read"
        ) from exc
    return pynvml


def visible_gpu_selection(count: int) -> list[int | str] | None:
    """NVML ignores CUDA_VISIBLE_DEVICES, so honour it here: indices or GPU UUIDs it names.

    Returns None (meaning all GPUs) when the variable is unset or in a form we cannot map
    (MIG instances), which errs on the side of recording more GPUs, never fewer.
    """
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        return None
    items = [s.strip() for s in raw.split(",") if s.strip()]
    if all(s.isdigit() for s in items):
        picked = [int(s) for s in items if int(s) < count]
        return picked or None
    if all(s.startswith("GPU-") for s in items):
        return list(items)
    return None


@dataclass
class Device:
    index: int
    name: str
    uuid: str
    handle: Any
    metrics: list[str] = field(default_factory=list)  # what this device reports
    unsupported: list[str] = field(default_factory=list)
    readers: list[tuple[tuple[str, ...], Callable[[dict], None]]] = field(default_factory=list)  # (keys, read)
    slow_reader: Callable[[dict], None] | None = None  # legacy PCIe throughput: blocks ~20 ms


def _as_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Opens NVML, picks the GPUs, probes what each one supports, and reads samples."""

    def __init__(self, nvml: Any = None, gpus: list[int] | None = None, pcie: bool = True):
        self.nvml = import_nvml(nvml)
        self._error = getattr(self.nvml, "NVMLError", Exception)
        try:
            self.nvml.nvmlInit()
        except Exception as exc:  # any failure here means "no telemetry", never a crash
            raise TelemetryUnavailable(f"NVML did not start ({exc})") from exc
        self._open = True
        try:
            self.driver = self._driver_version()
            self.devices = self._open_devices(gpus, pcie)
        except BaseException:
            self.close()
            raise

    def _driver_version(self) -> str | None:
        try:
            return _as_str(self.nvml.nvmlSystemGetDriverVersion())
        except Exception:
            return None

    def _open_devices(self, gpus: list[int] | None, pcie: bool) -> list[Device]:
        try:
            count = int(self.nvml.nvmlDeviceGetCount())
        except Exception as exc:
            raise TelemetryUnavailable(f"NVML could not count GPUs ({exc})") from exc
        if count == 0:
            raise TelemetryUnavailable("NVML sees no NVIDIA GPUs")
        selection: list[int | str] | None = list(gpus) if gpus is not None else visible_gpu_selection(count)
        if selection is None:
            selection = list(range(count))
        devices = []
        for item in selection:
            if isinstance(item, str):
                handle = self.nvml.nvmlDeviceGetHandleByUUID(item)
                index = int(self.nvml.nvmlDeviceGetIndex(handle))
            else:
                if not 0 <= int(item) < count:
                    raise TelemetryUnavailable(f"GPU index {item} does not exist (NVML sees {count} GPUs)")
                index = int(item)
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
            name = _as_str(self.nvml.nvmlDeviceGetName(handle))
            try:
                uuid = _as_str(self.nvml.nvmlDeviceGetUUID(handle))
            except Exception:
                uuid = ""
            dev = Device(index=index, name=name, uuid=uuid, handle=handle)
            self._probe(dev, pcie)
            devices.append(dev)
        return devices

    # -- probing: build one closure per metric group that NVML answers for this device --------

    def _probe(self, dev: Device, pcie: bool) -> None:
        nv, h = self.nvml, dev.handle

        def power(out: dict) -> None:
            out["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0

        def sm_clock(out: dict) -> None:
            out["sm_mhz"] = nv.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)

        def mem_clock(out: dict) -> None:
            out["mem_mhz"] = nv.nvmlDeviceGetClockInfo(h, NVML_CLOCK_MEM)

        def utilisation(out: dict) -> None:
            u = nv.nvmlDeviceGetUtilizationRates(h)
            out["util_gpu"] = u.gpu
            out["util_mem"] = u.memory

        def memory(out: dict) -> None:
            out["mem_used_mib"] = nv.nvmlDeviceGetMemoryInfo(h).used / 2**20

        def temperature(out: dict) -> None:
            out["temp_c"] = nv.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)

        # The "event reasons" call replaced "throttle reasons" in R535; older drivers only have the latter.
        reasons_fn = None
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            fn = getattr(nv, name, None)
            if fn is not None and self._try(lambda out, fn=fn: fn(h)):
                reasons_fn = fn
                break

        def throttle(out: dict) -> None:
            out["throttle"] = decode_throttle(int(reasons_fn(h)))

        energy_base: list[int] = []

        def energy(out: dict) -> None:
            # NVML's counter is mJ since the driver loaded; keep it relative to the first read.
            mj = nv.nvmlDeviceGetTotalEnergyConsumption(h)
            if not energy_base:
                energy_base.append(mj)
            out["energy_j"] = (mj - energy_base[0]) / 1000.0

        groups: list[tuple[tuple[str, ...], Callable[[dict], None] | None]] = [
            (("power_w",), power),
            (("sm_mhz",), sm_clock),
            (("mem_mhz",), mem_clock),
            (("util_gpu", "util_mem"), utilisation),
            (("mem_used_mib",), memory),
            (("temp_c",), temperature),
            (("throttle",), throttle if reasons_fn else None),
            (("energy_j",), energy),
        ]
        for keys, fn in groups:
            if fn is not None and self._try(fn):
                dev.readers.append((keys, fn))
                dev.metrics.extend(keys)
            else:
                dev.unsupported.extend(keys)
        energy_base.clear()  # the probe read must not become the zero point

        fields_reader, field_keys = self._probe_fields(dev, pcie)
        if fields_reader is not None:
            dev.readers.append((tuple(field_keys), fields_reader))
            dev.metrics.extend(field_keys)
        if pcie and "pcie_tx_mbs" not in field_keys:
            dev.slow_reader = self._probe_legacy_pcie(dev)
            if dev.slow_reader is not None:
                dev.metrics.extend(["pcie_tx_mbs", "pcie_rx_mbs"])
        for key in ("power_inst_w", "pcie_tx_mbs", "pcie_rx_mbs"):
            if key not in dev.metrics and (pcie or not key.startswith("pcie")):
                dev.unsupported.append(key)

    def _try(self, fn: Callable[[dict], None]) -> bool:
        try:
            fn({})
            return True
        except Exception:
            return False

    def _probe_fields(self, dev: Device, pcie: bool) -> tuple[Callable[[dict], None] | None, list[str]]:
        """Instant power and cumulative PCIe byte counters, when this driver has those fields."""
        get = getattr(self.nvml, "nvmlDeviceGetFieldValues", None)
        if get is None:
            return None, []
        wanted = [FI_POWER_INSTANT] + ([FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES] if pcie else [])
        try:
            values = get(dev.handle, wanted)
            ok = [fid for fid, v in zip(wanted, values) if int(v.nvmlReturn) == 0]
        except Exception:
            return None, []
        has_power = FI_POWER_INSTANT in ok
        has_pcie = FI_PCIE_TX_BYTES in ok and FI_PCIE_RX_BYTES in ok
        ids = ([FI_POWER_INSTANT] if has_power else []) + ([FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES] if has_pcie else [])
        if not ids:
            return None, []
        handle = dev.handle
        previous: list[tuple[float, int, int]] = []

        def read(out: dict) -> None:
            values = get(handle, ids)
            got = {fid: (_value_of(v) if int(v.nvmlReturn) == 0 else None) for fid, v in zip(ids, values)}
            if has_power and got[FI_POWER_INSTANT] is not None:
                out["power_inst_w"] = got[FI_POWER_INSTANT] / 1000.0
            if has_pcie:
                tx, rx = got[FI_PCIE_TX_BYTES], got[FI_PCIE_RX_BYTES]
                now = time.monotonic()
                if tx is not None and rx is not None:
                    if previous and now > previous[0][0]:
                        t0, tx0, rx0 = previous[0]
                        dt = now - t0
                        out["pcie_tx_mbs"] = max(tx - tx0, 0) / dt / 1e6
                        out["pcie_rx_mbs"] = max(rx - rx0, 0) / dt / 1e6
                    previous[:] = [(now, tx, rx)]

        keys = (["power_inst_w"] if has_power else []) + (["pcie_tx_mbs", "pcie_rx_mbs"] if has_pcie else [])
        return (read if self._try(read) else None), keys

    def _probe_legacy_pcie(self, dev: Device) -> Callable[[dict], None] | None:
        """nvmlDeviceGetPcieThroughput measures over ~20 ms per call, so it is read rarely."""
        nv, h = self.nvml, dev.handle
        fn = getattr(nv, "nvmlDeviceGetPcieThroughput", None)
        if fn is None:
            return None

        def read(out: dict) -> None:
            out["pcie_tx_mbs"] = fn(h, NVML_PCIE_UTIL_TX_BYTES) * 1024 / 1e6  # NVML reports KB/s
            out["pcie_rx_mbs"] = fn(h, NVML_PCIE_UTIL_RX_BYTES) * 1024 / 1e6

        return read if self._try(read) else None

    # -- reading -------------------------------------------------------------------------------

    def read(self, dev: Device, slow: bool = False) -> tuple[dict, int]:
        """One sample of `dev`: a dict of the metrics NVML answered, and how many calls failed."""
        out: dict = {}
        failures = 0
        for keys, fn in dev.readers:
            try:
                fn(out)
            except Exception:
                failures += 1  # a transient failure: the metric is null in this one sample
                for key in keys:
                    out.setdefault(key, None)
        if slow and dev.slow_reader is not None:
            try:
                dev.slow_reader(out)
            except Exception:
                failures += 1
        return out, failures

    def close(self) -> None:
        if getattr(self, "_open", False):
            self._open = False
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass


def _value_of(v: Any) -> float:
    return getattr(v.value, _VALUE_MEMBER.get(int(v.valueType), "ullVal"))
