"""NVML access for the telemetry sampler: lazy import, one probe per device, few calls per sample.

What a sample costs. On the first H200 run (driver 580) every NVML query cost about 0.35 ms of CPU,
nearly all of it inside the driver (on GSP-based GPUs the kernel polls until the GPU's firmware
answers); pynvml's Python side is a few microseconds. So the reader makes as few queries as it can:

  every tick   one nvmlDeviceGetFieldValues call: power (1 s average and instant), the total-energy
               counter and the PCIe byte counters; nvmlDeviceGetUtilizationRates (GPU and memory
               controller); the SM clock (NVML has no field id for clocks or utilisation)
  every slow_s memory clock, memory used, temperature, clock-event ("throttle") reasons: slow-moving
               or only read as a share of samples; spread over the ticks so no tick pays for all

That is 3 calls per GPU per tick plus 4 per GPU per second, where the first version made 9 per tick.
A metric whose field id the driver refuses falls back to its own call; a metric NVML refuses
altogether is dropped for that device when the reader opens, so the loop never pays for exceptions.
`pynvml` (PyPI package `nvidia-ml-py`) is imported only when a sampler starts.
"""

from __future__ import annotations

import ctypes
import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from glm5_fp4.errors import Glm5Fp4Error

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

# Field ids (nvml.h; present in nvidia-ml-py 12.535 and later, checked against 13.615.71).
FI_TOTAL_ENERGY = 83  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: mJ since the driver loaded
FI_POWER_AVERAGE = 185  # NVML_FI_DEV_POWER_AVERAGE: mW over 1 s; nvmlDeviceGetPowerUsage's value on Ampere+
FI_POWER_INSTANT = 186  # NVML_FI_DEV_POWER_INSTANT: mW
FI_PCIE_TX_BYTES = 197  # NVML_FI_DEV_PCIE_COUNT_TX_BYTES: cumulative bytes, "value can be wrapped"
FI_PCIE_RX_BYTES = 198  # NVML_FI_DEV_PCIE_COUNT_RX_BYTES

# The PCIe byte counters wrap at 2**32 although NVML hands them out as 64-bit values: on the H200
# run, copies at 55 GB/s read as ~17 GB/s in ~60 % of samples and as 0 in the rest, which is a
# 4 GiB counter wrapping once (17 GB/s) or twice (negative, clipped to 0) per 100 ms. Deltas are
# therefore taken modulo 2**32, which is exact while less than 4 GiB moves between two samples. A
# counter seen above 2**32 is a wider one (some other GPU or driver) and is taken modulo 2**64.
PCIE_COUNTER_WRAP = 2**32
WIDE_COUNTER_WRAP = 2**64

# c_nvmlValue_t union member for each NVML_VALUE_TYPE_*.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_TEMPERATURE_GPU = 0
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1

FAST, SLOW = "fast", "slow"


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


def visible_gpu_selection(count: int, uuid_of: Callable[[int], str]) -> list[int] | None:
    """NVML ignores CUDA_VISIBLE_DEVICES, so honour it here, read as CUDA reads it: NVML indices or GPU UUIDs (a
    unique prefix will do), mixed, the list ending at the first entry that matches no GPU.

    Returns None (meaning all GPUs) when the variable is unset or names MIG instances, which we cannot map (erring
    on the side of recording more GPUs, never fewer). `uuid_of(index)` is asked only when an entry is not an index.
    Raises Glm5Fp4Error when the first entry already matches nothing: the job it watches would see no GPU either.
    """
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        return None
    items = [s.strip() for s in raw.split(",") if s.strip()]
    if any(s.startswith("MIG-") for s in items):
        return None
    uuids: list[str] | None = None
    picked: list[int] = []
    for item in items:
        if item.isdigit():
            index = int(item) if int(item) < count else None
        else:
            if uuids is None:
                uuids = [uuid_of(i) for i in range(count)]
            hits = [i for i, u in enumerate(uuids) if u and u.startswith(item)]
            index = hits[0] if len(hits) == 1 else None
        if index is None:
            break
        if index not in picked:  # a GPU named twice is one GPU
            picked.append(index)
    if not picked:
        known = ", ".join(uuids) if uuids is not None else f"indices 0-{count - 1}"
        raise Glm5Fp4Error(
            f"CUDA_VISIBLE_DEVICES={raw!r} names no GPU NVML sees ({count} GPU(s): {known}); a job started with it "
            "would see no GPU either: fix it, or pass --gpus to choose the GPUs to record"
        )
    return picked


def visible_gpu_count(nvml: Any = None) -> int | None:
    """How many GPUs a CUDA program started now would see (NVML's count under CUDA_VISIBLE_DEVICES, read as CUDA
    reads it; an empty variable hides them all); None where that cannot be known: no NVML binding or driver, or
    MIG instances named. Torch-free, so that a launcher can check a layout before an engine starts."""
    try:
        nvml = import_nvml(nvml)
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        count = int(nvml.nvmlDeviceGetCount())
        raw = os.environ.get("CUDA_VISIBLE_DEVICES")
        if raw is not None and not raw.strip():
            return 0
        if raw is not None and any(s.strip().startswith("MIG-") for s in raw.split(",")):
            return None

        def uuid_of(index: int) -> str:  # a failed lookup raises: unknown, not "no such GPU" (an undercount)
            return _as_str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index)))

        try:
            picked = visible_gpu_selection(count, uuid_of)
        except Glm5Fp4Error:  # names no GPU: CUDA sees none
            return 0
        return count if picked is None else len(picked)
    except Exception:  # NVML failed partway: the count cannot be known
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def counter_rate(prev: tuple[float, int] | None, now: tuple[float, int], wrap: int) -> float | None:
    """Counts per time unit between two (time, counter) readings of a counter that wraps at `wrap`.

    Exact while the counter moves less than one `wrap` between the readings; beyond that it aliases.
    """
    if prev is None or now[0] <= prev[0]:
        return None
    return ((now[1] - prev[1]) % wrap) / (now[0] - prev[0])


@dataclass
class Reader:
    """One NVML call that fills `keys` of a sample; slow readers run every `every` ticks at `phase`."""

    keys: tuple[str, ...]
    fn: Callable[[dict], None]
    tier: str = FAST
    every: int = 1
    phase: int = 0

    def due(self, tick: int | None) -> bool:
        return tick is None or self.every == 1 or tick % self.every == self.phase


@dataclass
class Device:
    index: int
    name: str
    uuid: str
    handle: Any
    metrics: list[str] = field(default_factory=list)  # what this device reports
    unsupported: list[str] = field(default_factory=list)
    readers: list[Reader] = field(default_factory=list)
    slow_reader: Callable[[dict], None] | None = None  # legacy PCIe throughput (opt-in): blocks ~20 ms
    energy_base: list[float] = field(default_factory=list)  # the energy counter's first reading, J
    pcie_prev: dict[str, tuple[float, int]] = field(default_factory=dict)
    pcie_wrap: int = PCIE_COUNTER_WRAP  # WIDE_COUNTER_WRAP once a raw value above 2**32 was seen

    def metrics_of(self, tier: str) -> list[str]:
        return [k for r in self.readers if r.tier == tier for k in r.keys]


class FieldBatch:
    """One nvmlDeviceGetFieldValues call for a fixed list of field ids.

    With the real pynvml the ctypes array is built once and the C function called directly, which
    skips pynvml's per-call array construction; any other binding (FakeNvml) goes through its
    public nvmlDeviceGetFieldValues.
    """

    def __init__(self, nvml: Any, handle: Any, ids: list[int]):
        self.ids = list(ids)
        self._call = self._direct(nvml, handle) or (lambda: nvml.nvmlDeviceGetFieldValues(handle, self.ids))

    def _direct(self, nvml: Any, handle: Any) -> Callable[[], Any] | None:
        struct = getattr(nvml, "c_nvmlFieldValue_t", None)
        get_fn = getattr(nvml, "_nvmlGetFunctionPointer", None)
        check = getattr(nvml, "_nvmlCheckReturn", None)
        if struct is None or get_fn is None or check is None:
            return None
        try:
            fn = get_fn("nvmlDeviceGetFieldValues")
            values = (struct * len(self.ids))()
            for slot, fid in zip(values, self.ids):
                slot.fieldId = fid
            count, ref = ctypes.c_int32(len(self.ids)), ctypes.byref(values)
        except Exception:
            return None

        def call() -> Any:
            check(fn(handle, count, ref))
            return values

        return call

    def read(self) -> dict[int, tuple[Any, int]]:
        """{field id: (value, timestamp in µs)} for the fields NVML answered this time."""
        return self.read_values(self._call())

    def read_values(self, values: Any) -> dict[int, tuple[Any, int]]:
        got = {}
        for fid, v in zip(self.ids, values):
            if int(v.nvmlReturn) == 0:
                got[fid] = (getattr(v.value, _VALUE_MEMBER.get(int(v.valueType), "ullVal")), int(v.timestamp))
        return got


def _as_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Opens NVML, picks the GPUs, probes what each one supports, and reads samples.

    pcie: PCIe TX/RX rates from NVML's byte counters (a field read; no extra call).
    pcie_legacy: where those counters are missing, fall back to nvmlDeviceGetPcieThroughput, which
                 blocks ~20 ms per call (the sampler reads it once per second, one GPU at a time).
    """

    def __init__(self, nvml: Any = None, gpus: list[int] | None = None, pcie: bool = True, pcie_legacy: bool = False):
        self.nvml = import_nvml(nvml)
        try:
            self.nvml.nvmlInit()
        except Exception as exc:  # any failure here means "no telemetry", never a crash
            raise TelemetryUnavailable(f"NVML did not start ({exc})") from exc
        self._open = True
        try:
            self.driver = self._driver_version()
            self.devices = self._open_devices(gpus, pcie, pcie_legacy)
        except BaseException:
            self.close()
            raise
        self.schedule(1)

    def _driver_version(self) -> str | None:
        try:
            return _as_str(self.nvml.nvmlSystemGetDriverVersion())
        except Exception:
            return None

    def _open_devices(self, gpus: list[int] | None, pcie: bool, pcie_legacy: bool) -> list[Device]:
        try:
            count = int(self.nvml.nvmlDeviceGetCount())
        except Exception as exc:
            raise TelemetryUnavailable(f"NVML could not count GPUs ({exc})") from exc
        if count == 0:
            raise TelemetryUnavailable("NVML sees no NVIDIA GPUs")
        selection = list(gpus) if gpus is not None else visible_gpu_selection(count, self._uuid_at)
        if selection is None:
            selection = list(range(count))
        devices = []
        for item in selection:
            if not 0 <= int(item) < count:
                # asked for by the caller, unlike a machine without NVML: an error, not "no telemetry"
                raise Glm5Fp4Error(
                    f"GPU {item} does not exist: NVML sees {count} GPU(s): {', '.join(map(str, range(count)))}"
                )
            index = int(item)
            handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
            name = _as_str(self.nvml.nvmlDeviceGetName(handle))
            try:
                uuid = _as_str(self.nvml.nvmlDeviceGetUUID(handle))
            except Exception:
                uuid = ""
            dev = Device(index=index, name=name, uuid=uuid, handle=handle)
            self._probe(dev, pcie, pcie_legacy)
            devices.append(dev)
        return devices

    def _uuid_at(self, index: int) -> str:
        try:
            return _as_str(self.nvml.nvmlDeviceGetUUID(self.nvml.nvmlDeviceGetHandleByIndex(index)))
        except Exception:
            return ""  # matches no CUDA_VISIBLE_DEVICES entry

    # -- probing: one reader per NVML call that this device answers ---------------------------

    def _probe(self, dev: Device, pcie: bool, pcie_legacy: bool) -> None:
        nv, h = self.nvml, dev.handle
        fields = self._probe_fields(dev, pcie)
        has: set[int] = set(fields.ids) if fields else set()

        def energy_from(mj: float, out: dict) -> None:
            # NVML's counter is mJ since the driver loaded; keep it relative to the first read.
            if not dev.energy_base:
                dev.energy_base.append(mj)
            out["energy_j"] = (mj - dev.energy_base[0]) / 1000.0

        def pcie_from(key: str, value: int, stamp_us: int, now: float, out: dict) -> None:
            # Time the rate by the driver's own read stamp (integer µs since 1970) when it gives one;
            # the two clocks are kept apart so that a reading with a stamp never meets one without.
            clock_key = key if stamp_us > 0 else key + "@monotonic"
            t_us = stamp_us if stamp_us > 0 else now * 1e6
            if value >= PCIE_COUNTER_WRAP:
                dev.pcie_wrap = WIDE_COUNTER_WRAP
            rate = counter_rate(dev.pcie_prev.get(clock_key), (t_us, value), dev.pcie_wrap)
            dev.pcie_prev[clock_key] = (t_us, value)
            out[key] = rate  # bytes per µs = MB/s

        def read_fields(out: dict) -> None:
            got = fields.read()
            now = time.monotonic()
            for fid, key in ((FI_POWER_AVERAGE, "power_w"), (FI_POWER_INSTANT, "power_inst_w")):
                if fid in has:
                    out[key] = got[fid][0] / 1000.0 if fid in got else None
            if FI_TOTAL_ENERGY in has:
                if FI_TOTAL_ENERGY in got:
                    energy_from(got[FI_TOTAL_ENERGY][0], out)
                else:
                    out["energy_j"] = None
            for fid, key in ((FI_PCIE_TX_BYTES, "pcie_tx_mbs"), (FI_PCIE_RX_BYTES, "pcie_rx_mbs")):
                if fid in has:
                    if fid in got:
                        pcie_from(key, int(got[fid][0]), got[fid][1], now, out)
                    else:
                        out[key] = None

        def power(out: dict) -> None:
            out["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0

        def energy(out: dict) -> None:
            energy_from(nv.nvmlDeviceGetTotalEnergyConsumption(h), out)

        def utilisation(out: dict) -> None:
            u = nv.nvmlDeviceGetUtilizationRates(h)
            out["util_gpu"] = u.gpu
            out["util_mem"] = u.memory

        def sm_clock(out: dict) -> None:
            out["sm_mhz"] = nv.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM)

        def mem_clock(out: dict) -> None:
            out["mem_mhz"] = nv.nvmlDeviceGetClockInfo(h, NVML_CLOCK_MEM)

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

        if fields is not None and not self._try(read_fields):  # answered once, refused now: use the calls
            fields, has = None, set()
        field_keys = tuple(
            key
            for fid, key in (
                (FI_POWER_AVERAGE, "power_w"),
                (FI_POWER_INSTANT, "power_inst_w"),
                (FI_TOTAL_ENERGY, "energy_j"),
                (FI_PCIE_TX_BYTES, "pcie_tx_mbs"),
                (FI_PCIE_RX_BYTES, "pcie_rx_mbs"),
            )
            if fid in has
        )
        candidates: list[tuple[tuple[str, ...], Callable[[dict], None] | None, str]] = [
            (field_keys, read_fields if field_keys else None, FAST),
            (("power_w",), None if FI_POWER_AVERAGE in has else power, FAST),
            (("energy_j",), None if FI_TOTAL_ENERGY in has else energy, FAST),
            (("util_gpu", "util_mem"), utilisation, FAST),
            (("sm_mhz",), sm_clock, FAST),
            (("mem_mhz",), mem_clock, SLOW),
            (("mem_used_mib",), memory, SLOW),
            (("temp_c",), temperature, SLOW),
            (("throttle",), throttle if reasons_fn else None, SLOW),
        ]
        for keys, fn, tier in candidates:
            if fn is None:
                continue
            if fn is read_fields or self._try(fn):
                dev.readers.append(Reader(keys, fn, tier))
                dev.metrics.extend(keys)
            else:
                dev.unsupported.extend(keys)
        dev.energy_base.clear()  # the probe read must not become the zero point

        if pcie and pcie_legacy and "pcie_tx_mbs" not in dev.metrics:
            dev.slow_reader = self._probe_legacy_pcie(dev)
            if dev.slow_reader is not None:
                dev.metrics.extend(["pcie_tx_mbs", "pcie_rx_mbs"])
        wanted = ["power_w", "energy_j", "throttle", "power_inst_w"] + (["pcie_tx_mbs", "pcie_rx_mbs"] if pcie else [])
        for key in wanted:
            if key not in dev.metrics and key not in dev.unsupported:
                dev.unsupported.append(key)

    def _try(self, fn: Callable[[dict], None]) -> bool:
        try:
            fn({})
            return True
        except Exception:
            return False

    def _probe_fields(self, dev: Device, pcie: bool) -> FieldBatch | None:
        """The field ids this device answers, as one batch; None when the call itself is missing or fails."""
        if getattr(self.nvml, "nvmlDeviceGetFieldValues", None) is None:
            return None
        wanted = [FI_POWER_AVERAGE, FI_POWER_INSTANT, FI_TOTAL_ENERGY]
        if pcie:
            wanted += [FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES]
        try:
            ok = set(FieldBatch(self.nvml, dev.handle, wanted).read())
        except Exception:
            return None
        if not (FI_PCIE_TX_BYTES in ok and FI_PCIE_RX_BYTES in ok):  # one direction alone is no reading
            ok -= {FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES}
        ids = [fid for fid in wanted if fid in ok]
        return FieldBatch(self.nvml, dev.handle, ids) if ids else None

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

    # -- scheduling and cost ---------------------------------------------------------------------

    def schedule(self, slow_every: int) -> None:
        """Read slow metrics every `slow_every` ticks, staggered over GPUs and metrics so that each
        tick carries about the same number of calls."""
        slow = [r for dev in self.devices for r in dev.readers if r.tier == SLOW]
        for k, r in enumerate(slow):
            r.every = max(1, int(slow_every))
            r.phase = (k * r.every) // len(slow)

    def calls_per_tick(self, tick: int | None) -> int:
        return sum(r.due(tick) for dev in self.devices for r in dev.readers)

    def measure_cost(self, rounds: int = 3) -> tuple[float, float]:
        """CPU seconds (this thread) of one tick's fast reads and of one round of slow reads, all GPUs.

        The median of `rounds`; afterwards the energy zero point is reset, as after the probe.
        """
        fast, slow = [], []
        for _ in range(rounds):
            per = {FAST: 0.0, SLOW: 0.0}
            for dev in self.devices:
                for r in dev.readers:
                    t0 = time.thread_time()
                    try:
                        r.fn({})
                    except Exception:
                        pass
                    per[r.tier] += time.thread_time() - t0
            fast.append(per[FAST])
            slow.append(per[SLOW])
        for dev in self.devices:
            dev.energy_base.clear()
        return statistics.median(fast), statistics.median(slow)

    # -- reading -------------------------------------------------------------------------------

    def read(self, dev: Device, tick: int | None = None, slow: bool = False) -> tuple[dict, int, int]:
        """One sample of `dev` at `tick` (None: every metric): the metrics NVML answered, how many
        calls failed, and how many calls were made."""
        out: dict = {}
        failures = calls = 0
        for r in dev.readers:
            if not r.due(tick):
                continue
            calls += 1
            try:
                r.fn(out)
            except Exception:
                failures += 1  # a transient failure: the metric is null in this one sample
                for key in r.keys:
                    out.setdefault(key, None)
        if slow and dev.slow_reader is not None:
            calls += 2
            try:
                dev.slow_reader(out)
            except Exception:
                failures += 1
        return out, failures, calls

    def close(self) -> None:
        if getattr(self, "_open", False):
            self._open = False
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
