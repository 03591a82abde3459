"""TelemetrySampler lifecycle: with a fake NVML, with pynvml missing, with NVML failing to start."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.telemetry import TelemetrySampler, load_run
from glm5_fp4.telemetry import sampler as sampler_mod
from glm5_fp4.telemetry.fake_nvml import FakeNvml, FakeNvmlError
from glm5_fp4.telemetry.nvml_reader import THROTTLE_BITS, decode_throttle
from glm5_fp4.telemetry.series import META_FILE, SAMPLES_FILE, SUMMARY_FILE


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.fixture(autouse=True)
def _fresh_warning(monkeypatch):
    monkeypatch.setattr(sampler_mod, "_warned", False)


def test_lifecycle_with_fake_nvml(tmp_path):
    fake = FakeNvml(n_gpus=3)
    interval, seconds = 0.02, 0.4
    with TelemetrySampler(tmp_path, interval_s=interval, nvml=fake) as s:
        assert s.available and s.reason is None
        assert "glm5-fp4-telemetry" in _threads()
        time.sleep(seconds)
    assert "glm5-fp4-telemetry" not in _threads()
    assert fake.initialised == 1 and fake.shutdowns == 1
    run = s.run
    assert [g.index for g in run.gpus] == [0, 1, 2]
    expected = seconds / interval
    for g in run.gpus:
        # start and stop each add one sample; a loaded CI box may miss ticks but never adds extra ones
        assert 0.5 * expected <= len(g) <= expected + 3
        assert list(g.t) == sorted(g.t)
        assert g.t[0] < interval and g.t[-1] >= seconds
    for name in (SAMPLES_FILE, META_FILE, SUMMARY_FILE):
        assert (tmp_path / name).is_file()
    assert json.loads((tmp_path / SUMMARY_FILE).read_text())["available"] is True


def test_stop_is_idempotent_and_start_twice_fails(tmp_path):
    s = TelemetrySampler(tmp_path, interval_s=0.05, nvml=FakeNvml(n_gpus=1)).start()
    with pytest.raises(Glm5Fp4Error, match="twice"):
        s.start()
    first = s.stop()
    second = s.stop()
    assert first == second
    with pytest.raises(Glm5Fp4Error, match="outside"):
        s.mark("late")


def test_stop_before_start_and_bad_arguments(tmp_path):
    with pytest.raises(Glm5Fp4Error, match="before start"):
        TelemetrySampler(tmp_path).stop()
    with pytest.raises(Glm5Fp4Error, match="interval_s"):
        TelemetrySampler(tmp_path, interval_s=0)
    with pytest.raises(Glm5Fp4Error, match="gpus"):
        TelemetrySampler(tmp_path, gpus=[-1])
    with TelemetrySampler(tmp_path, interval_s=0.05, nvml=FakeNvml(n_gpus=1)) as s:
        with pytest.raises(Glm5Fp4Error, match="phase name"):
            s.mark("  ")


def test_marks_are_recorded_in_order(tmp_path):
    with TelemetrySampler(tmp_path, interval_s=0.02, nvml=FakeNvml(n_gpus=2)) as s:
        s.mark("warmup")
        time.sleep(0.1)
        s.mark("measure")
        time.sleep(0.1)
    names = [name for _, name in s.run.marks]
    times = [t for t, _ in s.run.marks]
    assert names == ["warmup", "measure"]
    assert times[1] - times[0] >= 0.09
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert [m["name"] for m in meta["marks"]] == names
    assert [p["name"] for p in s.summary()["phases"]] == ["warmup", "measure"]


def test_exception_in_block_still_writes_files(tmp_path):
    fake = FakeNvml(n_gpus=1)
    with pytest.raises(RuntimeError, match="boom"):
        with TelemetrySampler(tmp_path, interval_s=0.02, nvml=fake):
            time.sleep(0.05)
            raise RuntimeError("boom")
    assert fake.shutdowns == 1
    assert len(load_run(tmp_path).gpus[0]) >= 2


def test_nvml_module_missing(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now raises ImportError
    caplog.set_level(logging.WARNING, logger="glm5_fp4.telemetry")
    with TelemetrySampler(tmp_path / "a") as s:
        s.mark("measure")
    assert not s.available
    assert "nvidia-ml-py" in s.reason
    summary = s.summary(tokens=100)
    assert summary["available"] is False and summary["energy_j"] is None
    assert summary["message"].startswith("no GPU telemetry")
    assert summary["tokens"] == 100 and summary["tokens_per_joule"] is None
    assert not (tmp_path / "a" / SAMPLES_FILE).exists()
    assert json.loads((tmp_path / "a" / META_FILE).read_text())["available"] is False
    # said once per process, not once per sampler
    with TelemetrySampler(tmp_path / "b"):
        pass
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "no GPU telemetry" in r.getMessage()]
    assert len(warnings) == 1


def test_nvml_init_failure_is_not_fatal(tmp_path):
    fake = FakeNvml(n_gpus=2, init_error="Driver Not Loaded")
    with TelemetrySampler(tmp_path, nvml=fake) as s:
        pass
    assert not s.available and "Driver Not Loaded" in s.reason


def test_real_pynvml_without_driver(tmp_path):
    """On this CPU machine the real binding imports but finds no library or GPU."""
    pytest.importorskip("pynvml", reason="nvidia-ml-py not installed in this environment")
    with TelemetrySampler(tmp_path) as s:
        pass
    if s.available:  # pragma: no cover - only on a GPU machine
        assert len(s.run.gpus) >= 1
    else:
        assert s.summary()["message"].startswith("no GPU telemetry")


def test_zero_gpus(tmp_path):
    with TelemetrySampler(tmp_path, nvml=FakeNvml(n_gpus=0, curves=[])) as s:
        pass
    assert not s.available and "no NVIDIA GPUs" in s.reason


def test_gpu_selection_and_cuda_visible_devices(tmp_path, monkeypatch):
    fake = FakeNvml(n_gpus=4)
    with TelemetrySampler(tmp_path / "explicit", interval_s=0.05, gpus=[3, 1], nvml=fake) as s:
        pass
    assert [g.index for g in s.run.gpus] == [3, 1]

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with TelemetrySampler(tmp_path / "env", interval_s=0.05, nvml=FakeNvml(n_gpus=4)) as s:
        pass
    assert [g.index for g in s.run.gpus] == [2]

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-0003,GPU-fake-0000")
    with TelemetrySampler(tmp_path / "uuid", interval_s=0.05, nvml=FakeNvml(n_gpus=4)) as s:
        pass
    assert [g.index for g in s.run.gpus] == [3, 0]

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with TelemetrySampler(tmp_path / "bad", gpus=[7], nvml=FakeNvml(n_gpus=2)) as s:
        pass
    assert not s.available and "index 7" in s.reason


def test_unsupported_metrics_are_dropped(tmp_path):
    fake = FakeNvml(n_gpus=2, unsupported={"energy", "fields", "pcie_legacy", "throttle", "temperature"})
    with TelemetrySampler(tmp_path, interval_s=0.02, nvml=fake) as s:
        time.sleep(0.1)
    g = s.run.gpus[0]
    for key in ("energy_j", "power_inst_w", "pcie_tx_mbs", "throttle", "temp_c"):
        assert key not in g.metrics and key in g.unsupported
    assert "power_w" in g.metrics and "sm_mhz" in g.metrics
    for line in (tmp_path / SAMPLES_FILE).read_text().splitlines():
        row = json.loads(line)
        assert "energy_j" not in row and "temp_c" not in row and "throttle" not in row
    summary = s.summary()
    assert summary["energy_counter_j"] is None and summary["energy_source"] == "power_trapezoid"
    assert summary["energy_j"] == pytest.approx(summary["energy_trapezoid_j"])


def test_legacy_pcie_throughput_round_robin(tmp_path):
    fake = FakeNvml(n_gpus=2, unsupported={"pcie_counters"})
    with TelemetrySampler(tmp_path, interval_s=0.05, nvml=fake):
        time.sleep(0.5)
    rows = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    with_pcie = [r for r in rows if "pcie_tx_mbs" in r]
    # one GPU per second of ticks: far fewer PCIe readings than samples, each the fake's 1000 KB/s
    assert 1 <= len(with_pcie) <= len(rows) // 4
    assert all(r["pcie_tx_mbs"] == pytest.approx(1000 * 1024 / 1e6) for r in with_pcie)
    assert all(r["pcie_rx_mbs"] == pytest.approx(2000 * 1024 / 1e6) for r in with_pcie)


def test_pcie_counter_throughput(tmp_path):
    with TelemetrySampler(tmp_path, interval_s=0.02, nvml=FakeNvml(n_gpus=1)) as s:
        time.sleep(0.2)
    summary = s.summary()
    # the fake's counters grow at 2e9 and 1e9 bytes/s
    assert summary["gpus"][0]["metrics"]["pcie_tx_mbs"]["median"] == pytest.approx(2000, rel=0.02)
    assert summary["gpus"][0]["metrics"]["pcie_rx_mbs"]["median"] == pytest.approx(1000, rel=0.02)


class _Flaky(FakeNvml):
    """Power reads fail on every third call after start: a transient NVML error."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0

    def nvmlDeviceGetPowerUsage(self, h):
        self.calls += 1
        if self.calls > 2 and self.calls % 3 == 0:
            raise FakeNvmlError(15, "Unknown Error")
        return super().nvmlDeviceGetPowerUsage(h)


def test_transient_read_failures_leave_nulls(tmp_path):
    with TelemetrySampler(tmp_path, interval_s=0.02, nvml=_Flaky(n_gpus=1)) as s:
        time.sleep(0.2)
    rows = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    missing = [r for r in rows if r["power_w"] is None]
    assert missing and len(missing) < len(rows)
    assert s.summary()["sampler"]["read_failures"] == len(missing)
    assert s.summary()["gpus"][0]["metrics"]["power_w"]["median"] > 0


def test_decode_throttle():
    assert decode_throttle(0) == ()
    assert decode_throttle(0x4 | 0x40) == ("sw_power_cap", "hw_thermal")
    every = sum(THROTTLE_BITS)
    assert len(decode_throttle(every)) == len(THROTTLE_BITS)
    assert decode_throttle(0x1 | 0x10000) == ("gpu_idle", "other_0x10000")


class _OldDriver(FakeNvml):
    """A driver from before R535: only the deprecated throttle-reasons call answers."""

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        raise FakeNvmlError(13, "Function Not Found")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return 0x4


def test_throttle_reasons_fall_back_to_the_old_call(tmp_path):
    with TelemetrySampler(tmp_path, interval_s=0.05, nvml=_OldDriver(n_gpus=1)) as s:
        time.sleep(0.1)
    assert "throttle" in s.run.gpus[0].metrics
    assert set(s.run.gpus[0].throttle) == {("sw_power_cap",)}


def test_summary_while_running_is_a_snapshot(tmp_path):
    with TelemetrySampler(tmp_path, interval_s=0.02, nvml=FakeNvml(n_gpus=2)) as s:
        time.sleep(0.1)
        s.mark("measure")
        mid = s.summary(tokens=10)
        n_mid = mid["gpus"][0]["samples"]
        time.sleep(0.1)
    final = s.summary(tokens=10)
    assert mid["gpus"][0]["samples"] == n_mid  # not mutated by later samples
    assert final["gpus"][0]["samples"] > n_mid
    assert final["energy_j"] > mid["energy_j"] > 0
    json.dumps(final, allow_nan=False)  # goes straight into a load test's result JSON
