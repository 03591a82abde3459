"""The real pynvml wrappers (ctypes structs, byref outputs, field values) over a fake libnvidia-ml.

FakeNvml replaces pynvml wholesale; this test instead keeps pynvml and swaps only the C library
underneath it, so the sampler's use of pynvml's return types is exercised without a GPU.
"""

from __future__ import annotations

import time

import pytest

from glm5_fp4.telemetry import TelemetrySampler

pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py not installed")

SUCCESS, NOT_SUPPORTED = 0, 3


class FakeLib:
    """Python stand-ins for the C entry points pynvml calls; outputs written through byref()."""

    def __init__(self, power_mw: int = 250_000):
        self.power_mw = power_mw
        self.energy_mj = 10_000_000  # counters start far from zero, as on a real board
        self.pcie_tx = 5_000_000
        self.shut = 0

    def nvmlInitWithFlags(self, flags):
        return SUCCESS

    def nvmlShutdown(self):
        self.shut += 1
        return SUCCESS

    def nvmlSystemGetDriverVersion(self, buf, size):
        buf.value = b"575.57.08"
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
        ref._obj.value = self.power_mw
        return SUCCESS

    def nvmlDeviceGetTotalEnergyConsumption(self, handle, ref):
        self.energy_mj += 25_000  # 25 J per read
        ref._obj.value = self.energy_mj
        return SUCCESS

    def nvmlDeviceGetClockInfo(self, handle, kind, ref):
        ref._obj.value = 1980 if kind.value == pynvml.NVML_CLOCK_SM else 2619
        return SUCCESS

    def nvmlDeviceGetUtilizationRates(self, handle, ref):
        ref._obj.gpu, ref._obj.memory = 97, 41
        return SUCCESS

    def nvmlDeviceGetMemoryInfo(self, handle, ref):
        ref._obj.total, ref._obj.used, ref._obj.free = 141 * 2**30, 3 * 2**30, 138 * 2**30
        return SUCCESS

    def nvmlDeviceGetTemperature(self, handle, sensor, ref):
        ref._obj.value = 54
        return SUCCESS

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, ref):
        ref._obj.value = 0x4 | 0x20
        return SUCCESS

    def nvmlDeviceGetPcieThroughput(self, handle, counter, ref):
        return NOT_SUPPORTED

    def nvmlDeviceGetFieldValues(self, handle, count, ref):
        self.pcie_tx += 1_000_000
        for v in ref._obj[: count.value]:
            if v.fieldId == pynvml.NVML_FI_DEV_POWER_INSTANT:
                v.nvmlReturn, v.valueType = SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                v.value.uiVal = 251_500
            elif v.fieldId == pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
                v.nvmlReturn, v.valueType = SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = self.pcie_tx
            else:  # RX bytes: this "driver" lacks it, so PCIe counters are unusable
                v.nvmlReturn = NOT_SUPPORTED
        return SUCCESS


@pytest.fixture
def fake_lib(monkeypatch):
    lib = FakeLib()
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    return lib


def test_sampler_through_real_pynvml(tmp_path, fake_lib):
    with TelemetrySampler(tmp_path, interval_s=0.02) as s:
        time.sleep(0.1)
    assert s.available, s.reason
    assert fake_lib.shut == 1
    assert s.run.driver == "575.57.08"
    g = s.run.gpus[0]
    assert (g.name, g.uuid) == ("NVIDIA H200", "GPU-12345678-aaaa-bbbb-cccc-0123456789ab")
    # TX without RX is no PCIe reading; the legacy call says NOT_SUPPORTED
    assert {"pcie_tx_mbs", "pcie_rx_mbs"} <= set(g.unsupported)
    assert "power_inst_w" in g.metrics
    n = len(g)
    assert set(g.values["power_w"]) == {250.0}
    assert set(g.values["power_inst_w"]) == {251.5}
    assert set(g.values["sm_mhz"]) == {1980} and set(g.values["mem_mhz"]) == {2619}
    assert set(g.values["util_gpu"]) == {97} and set(g.values["util_mem"]) == {41}
    assert set(g.values["mem_used_mib"]) == {3072.0}
    assert set(g.values["temp_c"]) == {54}
    assert set(g.throttle) == {("sw_power_cap", "sw_thermal")}
    # relative energy counter: 25 J per read, from 0 at the first sample
    assert list(g.values["energy_j"]) == [25.0 * i for i in range(n)]
