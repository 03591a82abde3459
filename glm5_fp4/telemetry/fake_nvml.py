"""A stand-in for `pynvml` with deterministic readings, for tests, the overhead benchmark and demos.

It has the same function names as pynvml, so `TelemetrySampler(..., nvml=FakeNvml())` runs the
real sampling code without a GPU. Power follows a curve whose integral is known in closed form,
and the fake's total-energy counter reports that integral, so energy computed from samples can
be checked against an answer that was not computed from samples.

It also models what made the real sampler expensive: `calls` counts every NVML call by name, and
`call_cost_s` makes each device query burn that much CPU (the driver's share on a real GPU; about
0.35 ms per call on the H200 run), and `field_cost_s` more for each field id of a field-values call.
Field values come as pynvml returns them (valueType, value union, timestamp in µs), and the PCIe
byte counters wrap at 2**32 as the H200's do.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

NOT_SUPPORTED = 3


class FakeNvmlError(Exception):
    def __init__(self, value: int = NOT_SUPPORTED, message: str = "Not Supported"):
        super().__init__(message)
        self.value = value


@dataclass(frozen=True)
class SineSquaredPower:
    """p(t) = base + amp * sin^2(pi t / period): smooth, always positive, integrable exactly."""

    base_w: float = 100.0
    amp_w: float = 400.0
    period_s: float = 2.0

    def power(self, t: float) -> float:
        return self.base_w + self.amp_w * math.sin(math.pi * t / self.period_s) ** 2

    def energy(self, t: float) -> float:
        """Joules from 0 to t."""
        w = 2 * math.pi / self.period_s
        return self.base_w * t + self.amp_w * (t / 2 - math.sin(w * t) / (2 * w))


@dataclass(frozen=True)
class StepPower:
    """Idle, then a load plateau from `start_s` to `stop_s`, then idle again (the shape of a load test)."""

    idle_w: float = 80.0
    load_w: float = 550.0
    start_s: float = 1.0
    stop_s: float = 3.0

    def power(self, t: float) -> float:
        return self.load_w if self.start_s <= t < self.stop_s else self.idle_w

    def energy(self, t: float) -> float:
        on = min(max(t, self.start_s), self.stop_s) - self.start_s
        return self.idle_w * t + (self.load_w - self.idle_w) * on


class SwitchedPower:
    """Idle or load, switched while the sampler runs (next to sampler.mark), so phases and power line up
    however late a sleeping test wakes up. `switch(on, t)` takes the fake's own time, fake.elapsed()."""

    def __init__(self, idle_w: float = 80.0, load_w: float = 550.0):
        self.idle_w, self.load_w = idle_w, load_w
        self._switches: list[tuple[float, bool]] = [(0.0, False)]

    def switch(self, on: bool, t: float) -> None:
        if t < self._switches[-1][0]:
            raise ValueError("SwitchedPower: switches must come in time order")
        self._switches.append((t, on))

    def _level(self, on: bool) -> float:
        return self.load_w if on else self.idle_w

    def power(self, t: float) -> float:
        level = self.idle_w
        for when, on in self._switches:
            if when > t:
                break
            level = self._level(on)
        return level

    def energy(self, t: float) -> float:
        total = 0.0
        switches = self._switches + [(math.inf, False)]
        for (a, on), (b, _) in zip(switches, switches[1:]):
            if a >= t:
                break
            total += self._level(on) * (min(b, t) - a)
        return total


class FakeNvml:
    """Module-like object answering the pynvml calls the sampler makes.

    `curves[i]` drives GPU i (power, clocks and utilisation all follow its power); `unsupported`
    names call groups that answer NOT_SUPPORTED: "energy", "fields", "pcie_counters",
    "pcie_legacy", "throttle", "utilization", "memory", "temperature", "clocks", "power_instant",
    "power_average" (the last two are field ids only; nvmlDeviceGetPowerUsage always answers).
    clock_model "follows_load": the SM clock rises with power (most GPUs); "power_capped": it stays
    at 1980 MHz until power reaches 95 % of max_power_w, then drops to 1485 MHz with sw_power_cap
    set, as the H200 did under a heavy matmul.
    """

    NVMLError = FakeNvmlError
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    PCIE_WRAP = 2**32

    def __init__(
        self,
        n_gpus: int = 2,
        curves: list | None = None,
        unsupported: tuple[str, ...] | set[str] = (),
        init_error: str | None = None,
        name: str = "Fake GPU",
        clock: Callable[[], float] = time.monotonic,
        max_power_w: float = 700.0,
        clock_model: str = "follows_load",
        pcie_bytes_per_s: tuple[float, float] = (2e9, 1e9),
        pcie_start: int = 2**32 - 50_000_000,
        call_cost_s: float = 0.0,
        field_cost_s: float = 0.0,
    ):
        self.n_gpus = n_gpus
        self.curves = curves or [SineSquaredPower(base_w=100.0 + 10 * i) for i in range(n_gpus)]
        if len(self.curves) != n_gpus:
            raise ValueError(f"FakeNvml: {len(self.curves)} curves for {n_gpus} GPUs")
        if clock_model not in ("follows_load", "power_capped"):
            raise ValueError(f"FakeNvml: clock_model {clock_model!r} is not follows_load or power_capped")
        self.unsupported = set(unsupported)
        self.init_error = init_error
        self.name = name
        self.clock = clock
        self.max_power_w = max_power_w
        self.clock_model = clock_model
        self.pcie_bytes_per_s = pcie_bytes_per_s  # (TX, RX); the counters start near the wrap
        self.pcie_start = pcie_start
        self.call_cost_s = call_cost_s
        self.field_cost_s = field_cost_s
        self.t0 = clock()
        self.unix0 = time.time()
        self.initialised = 0
        self.shutdowns = 0
        self.calls: Counter[str] = Counter()

    # -- helpers -------------------------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds on the fake's clock since construction: the `t` its curves are evaluated at."""
        return self.clock() - self.t0

    def _query(self, name: str, group: str | None = None, fields: int = 0) -> None:
        """Count the call, burn its modelled CPU cost, and refuse it when its group is unsupported."""
        self.calls[name] += 1
        cost = self.call_cost_s + fields * self.field_cost_s
        if cost > 0:
            end = time.thread_time() + cost
            while time.thread_time() < end:
                pass
        if group is not None and group in self.unsupported:
            raise FakeNvmlError()

    def _power(self, h: int) -> float:
        return self.curves[h].power(self.elapsed())

    def _load(self, h: int) -> float:
        """0..1 fraction of full power, which clocks and utilisation follow."""
        return min(max(self._power(h) / self.max_power_w, 0.0), 1.0)

    def _capped(self, h: int) -> bool:
        return self.clock_model == "power_capped" and self._load(h) >= 0.95

    def pcie_counter(self, h: int, direction: int, t: float | None = None) -> int:
        """The raw (wrapped) byte counter for direction 0 = TX, 1 = RX at fake time t."""
        t = self.elapsed() if t is None else t
        return int(self.pcie_start + self.pcie_bytes_per_s[direction] * t) % self.PCIE_WRAP

    # -- pynvml surface ------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise FakeNvmlError(9, self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "000.00-fake"

    def nvmlDeviceGetCount(self) -> int:
        return self.n_gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < self.n_gpus:
            raise FakeNvmlError(2, "Invalid Argument")
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for i in range(self.n_gpus):
            if self.nvmlDeviceGetUUID(i) == uuid:
                return i
        raise FakeNvmlError(6, "Not Found")

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.name

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-fake-{h:04d}"

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self._query("nvmlDeviceGetPowerUsage")
        return int(round(self._power(h) * 1000))

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        self._query("nvmlDeviceGetTotalEnergyConsumption", "energy")
        return int(round(self.curves[h].energy(self.elapsed()) * 1000))

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        self._query("nvmlDeviceGetClockInfo", "clocks")
        if kind != 1:
            return 2619
        if self.clock_model == "power_capped":
            return 1485 if self._capped(h) else 1980
        return int(345 + (1980 - 345) * self._load(h))

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        self._query("nvmlDeviceGetUtilizationRates", "utilization")
        load = self._load(h)
        return SimpleNamespace(gpu=int(100 * load), memory=int(80 * load))

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        self._query("nvmlDeviceGetMemoryInfo", "memory")
        total = 141 * 2**30
        used = 2**30 * (1 + h)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        self._query("nvmlDeviceGetTemperature", "temperature")
        return int(30 + 40 * self._load(h))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        self._query("nvmlDeviceGetCurrentClocksEventReasons", "throttle")
        load = self._load(h)
        if self.clock_model == "power_capped":
            return 0x4 if self._capped(h) else (0x1 if load < 0.2 else 0x0)
        return 0x1 if load < 0.2 else (0x4 if load > 0.7 else 0x0)

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        self._query("nvmlDeviceGetPcieThroughput", "pcie_legacy")
        return 1000 * (counter + 1)  # KB/s

    def nvmlDeviceGetFieldValues(self, h: int, field_ids: list[int]) -> list[SimpleNamespace]:
        self._query("nvmlDeviceGetFieldValues", "fields", fields=len(field_ids))
        t = self.elapsed()
        stamp = int((self.unix0 + t) * 1e6)
        out = []
        for fid in field_ids:
            ret, vtype, member, value = 0, 3, "ullVal", 0
            if fid == 83 and "energy" not in self.unsupported:
                value = int(round(self.curves[h].energy(t) * 1000))
            elif fid == 185 and "power_average" not in self.unsupported:
                vtype, member, value = 1, "uiVal", int(round(self.curves[h].power(t) * 1000))
            elif fid == 186 and "power_instant" not in self.unsupported:
                vtype, member, value = 1, "uiVal", int(round(self.curves[h].power(t) * 1000))
            elif fid in (197, 198) and "pcie_counters" not in self.unsupported:
                value = self.pcie_counter(h, fid - 197, t)
            else:
                ret = NOT_SUPPORTED
            out.append(
                SimpleNamespace(
                    fieldId=fid,
                    scopeId=0,
                    timestamp=stamp,
                    latencyUsec=0,
                    nvmlReturn=ret,
                    valueType=vtype,
                    value=SimpleNamespace(**{member: value}),
                )
            )
        return out
