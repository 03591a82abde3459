"""The real pynvml wrappers (ctypes structs, byref outputs, field values) over a fake libnvidia-ml.

FakeNvml replaces pynvml wholesale; this test instead keeps pynvml and swaps only the C library
underneath it, so the sampler's use of pynvml's return types is exercised without a GPU, including
the field-values read that calls the C function directly with a ctypes array built once.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from glm5_fp4.telemetry import TelemetrySampler

pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py not installed")

SUCCESS, NOT_SUPPORTED = 0, 3


class FakeLib:
    """Python stand-ins for the C entry points pynvml calls; outputs written through byref().

    `fields`: the field ids this "driver" answers (the H200 with driver 580 answered all five).
    """

    ALL_FIELDS = frozenset({83, 185, 186, 197, 198})

    def __init__(self, fields=ALL_FIELDS):
        self.fields = set(fields)
        self.energy_mj = 10_000_000  # counters start far from zero, as on a real board
        self.pcie = [2**32 - 3_000_000, 7_000]  # TX just below the 32-bit wrap
        self.stamp_us = 1_790_000_000_000_000
        self.shut = 0
        self.calls = Counter()
        self.field_arrays = []  # the ctypes arrays passed in, kept alive so that their ids stay distinct

    def nvmlInitWithFlags(self, flags):
        return SUCCESS

    def nvmlShutdown(self):
        self.shut += 1
        return SUCCESS

    def nvmlSystemGetDriverVersion(self, buf, size):
        buf.value = b"580.159.04"
        return SUCCESS

    def nvmlDeviceGetCount_v2(self, ref):
        ref._obj.value = 1
        return SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index, ref):
        return SUCCESS

    def nvmlDeviceGetName(self, handle, buf, size):
        buf.value = b"NVIDIA H200"
        return SUCCESS

    def nvmlDeviceGetUUID(self, handle, buf, size):
        buf.value = b"GPU-12345678-aaaa-bbbb-cccc-0123456789ab"
        return SUCCESS

    def nvmlDeviceGetPowerUsage(self, handle, ref):
        self.calls["power"] += 1
        ref._obj.value = 111_000  # differs from the field value, so the test sees which path ran
        return SUCCESS

    def nvmlDeviceGetTotalEnergyConsumption(self, handle, ref):
        self.calls["energy"] += 1
        self.energy_mj += 25_000  # 25 J per read
        ref._obj.value = self.energy_mj
        return SUCCESS

    def nvmlDeviceGetClockInfo(self, handle, kind, ref):
        self.calls["clock"] += 1
        ref._obj.value = 1980 if kind.value == pynvml.NVML_CLOCK_SM else 2619
        return SUCCESS

    def nvmlDeviceGetUtilizationRates(self, handle, ref):
        self.calls["util"] += 1
        ref._obj.gpu, ref._obj.memory = 97, 41
        return SUCCESS

    def nvmlDeviceGetMemoryInfo(self, handle, ref):
        self.calls["memory"] += 1
        ref._obj.total, ref._obj.used, ref._obj.free = 141 * 2**30, 3 * 2**30, 138 * 2**30
        return SUCCESS

    def nvmlDeviceGetTemperature(self, handle, sensor, ref):
        self.calls["temp"] += 1
        ref._obj.value = 54
        return SUCCESS

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, ref):
        self.calls["throttle"] += 1
        ref._obj.value = 0x4 | 0x20
        return SUCCESS

    def nvmlDeviceGetPcieThroughput(self, handle, counter, ref):
        return NOT_SUPPORTED

    def nvmlDeviceGetFieldValues(self, handle, count, ref):
        self.calls["fields"] += 1
        self.field_arrays.append(ref._obj)
        # between two reads: 100 µs pass, 25 J are used, 3 MB go out (across the 4 GiB wrap) and 1 MB in
        self.stamp_us += 100
        if pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION in self.fields:
            self.energy_mj += 25_000
        self.pcie = [(self.pcie[0] + 3_000_000) % 2**32, (self.pcie[1] + 1_000_000) % 2**32]
        for v in ref._obj[: count.value]:
            v.timestamp = self.stamp_us
            if v.fieldId not in self.fields:
                v.nvmlReturn = NOT_SUPPORTED
                continue
            v.nvmlReturn = SUCCESS
            if v.fieldId in (pynvml.NVML_FI_DEV_POWER_AVERAGE, pynvml.NVML_FI_DEV_POWER_INSTANT):
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                v.value.uiVal = 250_000 if v.fieldId == pynvml.NVML_FI_DEV_POWER_AVERAGE else 251_500
            elif v.fieldId == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = self.energy_mj
            else:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = self.pcie[v.fieldId - pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES]
        return SUCCESS


def _install(monkeypatch, lib):
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    return lib


def _finite(column):
    return [v for v in column if v == v]


def test_field_ids_exist_in_this_pynvml():
    """The ids the reader hard-codes are pynvml's (13.615.71 is what the GPU machines run)."""
    from glm5_fp4.telemetry import nvml_reader as r

    assert r.FI_TOTAL_ENERGY == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
    assert r.FI_POWER_AVERAGE == pynvml.NVML_FI_DEV_POWER_AVERAGE
    assert r.FI_POWER_INSTANT == pynvml.NVML_FI_DEV_POWER_INSTANT
    assert r.FI_PCIE_TX_BYTES == pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    assert r.FI_PCIE_RX_BYTES == pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES


def test_sampler_through_real_pynvml(tmp_path, monkeypatch):
    lib = _install(monkeypatch, FakeLib())
    with TelemetrySampler(tmp_path, interval_s=0.02, slow_s=0.1) as s:
        time.sleep(0.12)
    assert s.available, s.reason
    assert lib.shut == 1
    assert s.run.driver == "580.159.04"
    g = s.run.gpus[0]
    assert (g.name, g.uuid) == ("NVIDIA H200", "GPU-12345678-aaaa-bbbb-cccc-0123456789ab")
    assert g.unsupported == []
    n = len(g)
    # one field read per sample gives power, instant power, energy and PCIe; the calls it replaces never run
    assert lib.calls["power"] == 0 and lib.calls["energy"] == 0
    assert lib.calls["fields"] == n + 2  # + the probe's two reads
    # the probe's array and the reader's, reused for every sample
    assert len({id(a) for a in lib.field_arrays}) == 2
    assert set(g.values["power_w"]) == {250.0}
    assert set(g.values["power_inst_w"]) == {251.5}
    assert list(g.values["energy_j"]) == [25.0 * i for i in range(n)]  # relative to the first sample
    # 3 MB and 1 MB per 100 µs of driver time: 30000 and 10000 MB/s, straight across TX's wrap
    assert set(_finite(g.values["pcie_tx_mbs"])) == {30000.0}
    assert set(_finite(g.values["pcie_rx_mbs"])) == {10000.0}
    assert set(_finite(g.values["sm_mhz"])) == {1980} and set(_finite(g.values["mem_mhz"])) == {2619}
    assert set(_finite(g.values["util_gpu"])) == {97} and set(_finite(g.values["util_mem"])) == {41}
    assert set(_finite(g.values["mem_used_mib"])) == {3072.0}
    assert set(_finite(g.values["temp_c"])) == {54}
    assert set(g.throttle) - {None} == {("sw_power_cap", "sw_thermal")}
    assert lib.calls["util"] == n + 1 and lib.calls["memory"] < n  # slow metrics: not every sample


def test_missing_fields_fall_back_to_calls(tmp_path, monkeypatch):
    """An older driver: instant power and TX bytes only, so power and energy need their own calls."""
    lib = _install(
        monkeypatch, FakeLib(fields={pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES})
    )
    with TelemetrySampler(tmp_path, interval_s=0.02) as s:
        time.sleep(0.1)
    g = s.run.gpus[0]
    # TX without RX is no PCIe reading; the legacy call is opt-in and says NOT_SUPPORTED anyway
    assert {"pcie_tx_mbs", "pcie_rx_mbs"} <= set(g.unsupported)
    assert set(g.values["power_w"]) == {111.0}  # nvmlDeviceGetPowerUsage's value
    assert set(g.values["power_inst_w"]) == {251.5}
    n = len(g)
    assert lib.calls["power"] == n + 1 and lib.calls["energy"] == n + 1
    assert list(g.values["energy_j"]) == [25.0 * i for i in range(n)]
