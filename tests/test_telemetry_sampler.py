"""TelemetrySampler lifecycle: with a fake NVML, with pynvml missing, with NVML failing to start."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.telemetry import TelemetrySampler, load_run
from glm5_fp4.telemetry import sampler as sampler_mod
from glm5_fp4.telemetry.fake_nvml import FakeNvml, FakeNvmlError
from glm5_fp4.telemetry.nvml_reader import THROTTLE_BITS, counter_rate, decode_throttle
from glm5_fp4.telemetry.series import MARKDOWN_FILE, META_FILE, PNG_FILE, SAMPLES_FILE, SUMMARY_FILE


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.fixture(autouse=True)
def _fresh_warning(monkeypatch):
    monkeypatch.setattr(sampler_mod, "_warned", False)


def test_lifecycle_with_fake_nvml(tmp_path):
    fake = FakeNvml(n_gpus=3)
    interval, seconds = 0.02, 0.4
    with TelemetrySampler(tmp_path, interval_s=interval, nvml=fake) as s:
        entered = time.monotonic() - s.run.start_monotonic  # start() takes the first sample before returning
        assert s.available and s.reason is None
        assert "glm5-fp4-telemetry" in _threads()
        time.sleep(seconds)
    assert "glm5-fp4-telemetry" not in _threads()
    assert fake.initialised == 1 and fake.shutdowns == 1
    run = s.run
    assert [g.index for g in run.gpus] == [0, 1, 2]
    expected = seconds / interval
    for g in run.gpus:
        # start and stop add one sample each; the loop ticks on an absolute schedule and skips the ticks it
        # missed (a loaded CI box), so it never takes more than one per interval of the run
        assert 0.5 * expected <= len(g) <= int(run.end_s / interval) + 2
        assert list(g.t) == sorted(g.t)
        assert g.t[0] <= entered and g.t[-1] >= seconds
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

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,1")
    with TelemetrySampler(tmp_path / "env-twice", interval_s=0.05, nvml=FakeNvml(n_gpus=4)) as s:
        pass
    assert [g.index for g in s.run.gpus] == [1]  # a GPU recorded twice would count its energy twice


def test_a_gpu_that_does_not_exist_is_an_error_not_a_machine_without_nvml(tmp_path):
    """Before: gpus=[7] on a 2-GPU machine recorded nothing and said "no GPU telemetry", as if NVML were missing."""
    fake = FakeNvml(n_gpus=2)
    with pytest.raises(Glm5Fp4Error, match=r"GPU 7 does not exist.*2 GPU\(s\): 0, 1"):
        TelemetrySampler(tmp_path / "bad", gpus=[1, 7], nvml=fake).start()
    assert fake.initialised == fake.shutdowns == 1
    assert not (tmp_path / "bad").exists()  # refused before anything was written


def test_a_gpu_listed_twice_is_refused(tmp_path):
    with pytest.raises(Glm5Fp4Error, match="GPU 0 is listed twice"):
        TelemetrySampler(tmp_path, gpus=[0, 1, 0])


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


def test_legacy_pcie_throughput_is_opt_in_and_round_robin(tmp_path):
    fake = FakeNvml(n_gpus=2, unsupported={"pcie_counters"})
    with TelemetrySampler(tmp_path / "default", interval_s=0.05, nvml=fake) as s:
        time.sleep(0.1)
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0  # not even probed: it blocks ~20 ms a call
    assert {"pcie_tx_mbs", "pcie_rx_mbs"} <= set(s.run.gpus[0].unsupported)

    fake = FakeNvml(n_gpus=2, unsupported={"pcie_counters"})
    with TelemetrySampler(tmp_path, interval_s=0.05, nvml=fake, pcie_legacy=True):
        time.sleep(0.5)
    rows = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    with_pcie = [r for r in rows if "pcie_tx_mbs" in r]
    # one GPU per second of ticks: far fewer PCIe readings than samples, each the fake's 1000 KB/s
    assert 1 <= len(with_pcie) <= len(rows) // 4
    assert all(r["pcie_tx_mbs"] == pytest.approx(1000 * 1024 / 1e6) for r in with_pcie)
    assert all(r["pcie_rx_mbs"] == pytest.approx(2000 * 1024 / 1e6) for r in with_pcie)


def test_pcie_counter_throughput_across_the_wrap(tmp_path):
    # The fake's 32-bit counters start 50 MB below the wrap and grow at 2e9 and 1e9 bytes/s, so both
    # wrap during the run; every reading (not just the median) must still be the true rate.
    fake = FakeNvml(n_gpus=1, pcie_start=2**32 - 50_000_000)
    with TelemetrySampler(tmp_path, interval_s=0.02, nvml=fake) as s:
        time.sleep(0.2)
    assert fake.pcie_counter(0, 0) < 50_000_000 + 2e9 * 0.2 and fake.elapsed() > 0.05  # it did wrap
    g = s.run.gpus[0]
    tx = [v for v in g.values["pcie_tx_mbs"] if v == v]
    rx = [v for v in g.values["pcie_rx_mbs"] if v == v]
    assert len(tx) >= len(g) - 1 and len(rx) >= len(g) - 1
    assert tx == pytest.approx([2000.0] * len(tx), rel=0.01)
    assert rx == pytest.approx([1000.0] * len(rx), rel=0.01)
    assert s.summary()["sampler"]["pcie_alias_above_mbs"] == pytest.approx(2**32 / 0.02 / 1e6, rel=1e-3)


def test_counter_rate_modulo_wrap():
    rng = random.Random(11)
    wrap = 2**32
    for _ in range(2000):
        start = rng.randrange(wrap)
        moved = rng.randrange(wrap)  # anything under one wrap per interval is recoverable
        t0, dt = rng.randrange(2 * 10**15), rng.randrange(1, 2 * 10**6)  # µs stamps, as NVML gives them
        assert counter_rate((t0, start), (t0 + dt, (start + moved) % wrap), wrap) == pytest.approx(moved / dt)
    assert counter_rate(None, (1.0, 5), wrap) is None
    assert counter_rate((2.0, 5), (2.0, 9), wrap) is None  # no time passed: no rate


class _Flaky(FakeNvml):
    """The field-values read (power, energy, PCIe) fails on every third call after the probe's two."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.field_calls = 0

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        self.field_calls += 1
        if self.field_calls > 2 and self.field_calls % 3 == 0:
            raise FakeNvmlError(15, "Unknown Error")
        return super().nvmlDeviceGetFieldValues(h, field_ids)


def test_transient_read_failures_leave_nulls(tmp_path):
    with TelemetrySampler(tmp_path, interval_s=0.02, nvml=_Flaky(n_gpus=1)) as s:
        time.sleep(0.2)
    rows = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    missing = [r for r in rows if r["power_w"] is None]
    assert missing and len(missing) < len(rows)
    # one failed call nulls everything it reads, nothing else
    assert all(r["energy_j"] is None and r["power_inst_w"] is None and r["util_gpu"] is not None for r in missing)
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
    assert set(s.run.gpus[0].throttle) - {None} == {("sw_power_cap",)}


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


READS = (
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetPcieThroughput",
)


def _calls_while_sampling(fake, n_gpus, **kw):
    """NVML calls per GPU per loop tick, counted by the fake between the start and stop samples."""
    s = TelemetrySampler(kw.pop("out"), nvml=fake, **kw).start()
    before, ticks0 = fake.calls.copy(), s._ticks
    time.sleep(0.6)
    after, ticks1 = fake.calls.copy(), s._ticks  # a tick in flight is within the tolerances below
    s.stop()
    ticks = ticks1 - ticks0
    per = {name: (after[name] - before[name]) / (ticks * n_gpus) for name in READS}
    return s, per, ticks


def test_three_calls_per_gpu_per_tick_plus_slow_metrics(tmp_path):
    fake = FakeNvml(n_gpus=2)
    s, per, ticks = _calls_while_sampling(fake, 2, out=tmp_path, interval_s=0.02, slow_s=0.2)
    assert ticks >= 10
    # every tick: one field read (power, instant power, energy, PCIe), utilisation, and the SM clock
    assert per["nvmlDeviceGetFieldValues"] == pytest.approx(1.0, abs=0.15)
    assert per["nvmlDeviceGetUtilizationRates"] == pytest.approx(1.0, abs=0.15)
    # the clock call serves SM (every tick) and memory clock (slow): 1 + 1/10
    assert per["nvmlDeviceGetClockInfo"] == pytest.approx(1.1, abs=0.15)
    for name in ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperature", "nvmlDeviceGetCurrentClocksEventReasons"):
        assert per[name] == pytest.approx(0.1, abs=0.06), name  # slow_s 0.2 s = every 10th tick
    for name in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetPcieThroughput"):
        assert per[name] == 0, name  # served by the field read
    total = sum(per.values())
    assert total == pytest.approx(3.4, abs=0.3)
    # the sampler counts its own calls (start and stop samples read everything, so slightly more)
    assert s.summary()["sampler"]["nvml_calls_per_gpu_tick"] == pytest.approx(total, abs=0.5)
    g = s.run.gpus[0]
    assert {"power_w", "power_inst_w", "energy_j", "pcie_tx_mbs", "pcie_rx_mbs"} <= set(g.metrics)


@pytest.mark.parametrize(
    "missing, fallback_call, lost",
    [
        ({"power_average"}, "nvmlDeviceGetPowerUsage", set()),
        ({"fields"}, "nvmlDeviceGetPowerUsage", {"power_inst_w", "pcie_tx_mbs", "pcie_rx_mbs"}),
        ({"energy"}, None, {"energy_j"}),
        ({"pcie_counters"}, None, {"pcie_tx_mbs", "pcie_rx_mbs"}),
    ],
)
def test_each_field_falls_back_on_its_own(tmp_path, missing, fallback_call, lost):
    fake = FakeNvml(n_gpus=1, unsupported=missing)
    s, per, _ = _calls_while_sampling(fake, 1, out=tmp_path, interval_s=0.02)
    g = s.run.gpus[0]
    assert set(g.unsupported) == lost
    assert {"power_w", "sm_mhz", "util_gpu"} <= set(g.metrics)
    assert "energy_j" in g.metrics or "energy" in missing
    if fallback_call:
        assert per[fallback_call] == pytest.approx(1.0, abs=0.15)
        powers = [v for v in g.values["power_w"] if v == v]
        assert len(powers) == len(g) and min(powers) >= 100
    if "fields" in missing:  # energy comes from its own call then
        assert per["nvmlDeviceGetTotalEnergyConsumption"] == pytest.approx(1.0, abs=0.15)
        assert per["nvmlDeviceGetFieldValues"] == 0


def _expected_interval(n_gpus, cost_s, fast_calls=3, slow_calls=4):
    """The ladder walked with the fake's known per-call cost (not with anything the sampler measured)
    plus the sampler's stated Python overhead; slow reads every max(5, 1 s / interval) ticks."""
    fast = n_gpus * fast_calls * cost_s + sampler_mod.PY_TICK_S + n_gpus * sampler_mod.PY_SAMPLE_S
    slow = n_gpus * slow_calls * cost_s
    for interval in sampler_mod.AUTO_INTERVALS:
        if fast / interval + slow / (max(5, round(1.0 / interval)) * interval) <= 0.01:
            return interval
    return sampler_mod.AUTO_INTERVALS[-1]


def test_auto_interval_keeps_sampling_within_budget(tmp_path):
    # NVML about as costly per call as the H200's driver: 2 GPUs cannot be read every 0.1 s for 1 %
    fake = FakeNvml(n_gpus=2, call_cost_s=0.4e-3)
    with TelemetrySampler(tmp_path / "slow", nvml=fake) as s:
        pass
    expected = _expected_interval(2, 0.4e-3)
    assert expected == 0.5  # by hand: 0.25 s would cost ~1.3 % of a core, 0.5 s ~0.65 %
    assert s.interval_s == expected and s.run.interval_s == expected
    auto = json.loads((tmp_path / "slow" / META_FILE).read_text())["sampler"]["auto_interval"]
    assert auto["chosen_s"] == expected
    assert auto["read_cpu_ms_per_tick"] == pytest.approx(2 * 3 * 0.4, rel=0.3)
    assert auto["slow_read_cpu_ms_per_round"] == pytest.approx(2 * 4 * 0.4, rel=0.3)
    # the slow metrics: every 5th tick at most, so every 2.5 s here
    assert s.run.sampler["slow_s"] == pytest.approx(2.5)

    with TelemetrySampler(tmp_path / "cheap", nvml=FakeNvml(n_gpus=2)) as s:
        pass
    assert s.interval_s == 0.1  # NVML in pure Python costs microseconds: the 100 ms default holds

    with TelemetrySampler(tmp_path / "forced", interval_s=0.05, nvml=FakeNvml(n_gpus=2, call_cost_s=0.3e-3)) as s:
        pass
    assert s.interval_s == 0.05 and "auto_interval" not in s.run.sampler  # a number is obeyed


def test_pick_interval_is_the_shortest_within_budget():
    rng = random.Random(5)
    ladder = sampler_mod.AUTO_INTERVALS
    for _ in range(500):
        fast, slow = rng.uniform(0, 0.02), rng.uniform(0, 0.05)
        chosen = sampler_mod.pick_interval(fast, slow, slow_s=1.0, budget=0.01)

        def cost(iv):
            return fast / iv + slow / (max(5, round(1.0 / iv)) * iv)

        i = ladder.index(chosen)
        assert cost(chosen) <= 0.01 or chosen == ladder[-1]
        assert all(cost(iv) > 0.01 for iv in ladder[:i])


def test_bad_interval_and_slow_s(tmp_path):
    for bad in ("fast", True, -1, 0.0):
        with pytest.raises(Glm5Fp4Error, match="interval_s"):
            TelemetrySampler(tmp_path, interval_s=bad)
    with pytest.raises(Glm5Fp4Error, match="slow_s"):
        TelemetrySampler(tmp_path, slow_s=0)


class _WideCounters(FakeNvml):
    """A GPU whose PCIe byte counters are 64-bit: they already read above 2**32."""

    PCIE_WRAP = 2**64


def test_wide_pcie_counters_are_not_taken_modulo_4gib(tmp_path):
    # 300 GB/s moves 6 GB per 20 ms tick: modulo 2**32 that would alias, modulo 2**64 it is exact
    fake = _WideCounters(n_gpus=1, pcie_start=2**40, pcie_bytes_per_s=(3e11, 1e9))
    with TelemetrySampler(tmp_path, interval_s=0.02, nvml=fake) as s:
        time.sleep(0.1)
    tx = [v for v in s.run.gpus[0].values["pcie_tx_mbs"] if v == v]
    assert tx and tx == pytest.approx([300_000.0] * len(tx), rel=0.01)
    sampler = s.summary()["sampler"]
    assert sampler["pcie_counter_wrap_bytes"] == 2**64 and sampler["pcie_alias_above_mbs"] is None


class _FullDisk:
    """The samples file on a disk that fills up: the `room`-th write and everything after it fail with ENOSPC, and
    so do flush and close (what was buffered cannot be written either)."""

    def __init__(self, f, room: int):
        self.f, self.room, self.full = f, room, False

    def _check(self):
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(self, text):
        self.room -= 1
        self.full = self.full or self.room <= 0
        self._check()
        return self.f.write(text)

    def flush(self):
        self._check()
        self.f.flush()

    def close(self):
        self.f.close()
        self._check()


@pytest.fixture
def full_disk(monkeypatch):
    """telemetry.jsonl opened for writing fills the disk on its third write (the start's sample is the first)."""
    real_open = Path.open

    def open_(self, mode="r", *args, **kw):
        f = real_open(self, mode, *args, **kw)
        return _FullDisk(f, room=3) if self.name == SAMPLES_FILE and "w" in mode else f

    monkeypatch.setattr(Path, "open", open_)


def test_a_full_disk_while_recording_does_not_break_the_workload(tmp_path, full_disk):
    """Before: the sampling thread died, then stop() wrote the last sample again and raised OSError out of the
    `with` block: the workload's own result was lost and NVML stayed open."""
    fake = FakeNvml(n_gpus=2)
    with TelemetrySampler(tmp_path, interval_s=0.01, flush_s=0.0, nvml=fake) as s:
        s.mark("measure")
        time.sleep(0.8)  # past the 0.5 s that makes a gap
    assert fake.shutdowns == 1
    assert "No space left on device" in s.run.sampler["error"]
    written = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert written["complete"] is False
    assert any("recording failed" in w and "No space left" in w for w in written["warnings"])
    assert json.loads((tmp_path / META_FILE).read_text())["sampler"]["error"] == s.run.sampler["error"]
    # the samples stop where the disk filled: that is a gap at the end of the run, not a shorter run
    assert written["gpus"][0]["gaps"] and written["gpus"][0]["gaps"][-1]["end_s"] == pytest.approx(s.run.end_s)
    assert s.stop()["complete"] is False  # and a second stop() is as quiet


def test_stop_that_cannot_write_its_summary_logs_it_and_returns(tmp_path, monkeypatch, caplog):
    fake = FakeNvml(n_gpus=1)
    s = TelemetrySampler(tmp_path, interval_s=0.02, nvml=fake).start()
    time.sleep(0.05)

    def no_room(path, data):
        raise Glm5Fp4Error(f"{path}: cannot write (No space left on device)")

    monkeypatch.setattr(sampler_mod, "write_json_atomic", no_room)
    caplog.set_level(logging.WARNING, logger="glm5_fp4.telemetry")
    s.mark("measure")  # the workload's own call: a full disk must not raise out of it either
    summary = s.stop()
    assert fake.shutdowns == 1
    assert summary["complete"] is False and "No space left" in s.run.sampler["error"]
    assert any(META_FILE in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize("blocker", ["samples file is a folder", "folder is read-only"])
def test_an_output_folder_that_cannot_be_written_is_one_clear_error(tmp_path, blocker):
    """Before: IsADirectoryError / PermissionError tracebacks, with NVML left open."""
    out = tmp_path / "out"
    out.mkdir()
    if blocker == "samples file is a folder":
        (out / SAMPLES_FILE / "x").mkdir(parents=True)
        culprit = str(out / SAMPLES_FILE)
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        out.chmod(0o555)
        culprit = str(out)
    fake = FakeNvml(n_gpus=2)
    try:
        with pytest.raises(Glm5Fp4Error, match="cannot write") as e:
            TelemetrySampler(out, interval_s=0.05, nvml=fake).start()
    finally:
        out.chmod(0o755)
    assert culprit in str(e.value)
    assert fake.initialised == fake.shutdowns == 1


@pytest.mark.parametrize("nvml", [FakeNvml(n_gpus=1), FakeNvml(n_gpus=2, init_error="Driver Not Loaded")])
def test_a_new_recording_removes_an_earlier_runs_files(tmp_path, nvml):
    """Before: a report, plot and (without NVML) samples of an earlier run stayed beside the new recording."""
    with TelemetrySampler(tmp_path, interval_s=0.05, nvml=FakeNvml(n_gpus=2)):
        pass
    for name in (MARKDOWN_FILE, PNG_FILE):
        (tmp_path / name).write_text("an earlier run's")
    with TelemetrySampler(tmp_path, interval_s=0.05, nvml=nvml) as s:
        pass
    assert not (tmp_path / MARKDOWN_FILE).exists() and not (tmp_path / PNG_FILE).exists()
    assert (tmp_path / SAMPLES_FILE).exists() == s.available
    assert load_run(tmp_path).available == s.available


@pytest.mark.parametrize(
    ("visible", "expect"),
    [
        ("GPU-fake-0002", [2]),
        ("GPU-fake-0003,GPU-nope,GPU-fake-0000", [3]),  # CUDA stops at the first entry it cannot match
        ("GPU-fake-0001", [1]),
        ("GPU-fake-0", None),  # a prefix four GPUs share: ambiguous, CUDA matches none
        ("2,9,1", [2]),  # an index past the count ends the list as an unknown UUID does
        ("1,GPU-fake-0003", [1, 3]),  # CUDA takes indices and UUIDs mixed
    ],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(tmp_path, monkeypatch, visible, expect):
    """Before: a UUID NVML does not know was a traceback from NVML's lookup, an index past the count was dropped
    while the entries after it were kept, and a mixed list (index and UUID) recorded every GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if expect is None:
        with pytest.raises(Glm5Fp4Error, match=r"CUDA_VISIBLE_DEVICES='GPU-fake-0' names no GPU.*--gpus"):
            TelemetrySampler(tmp_path, interval_s=0.05, nvml=FakeNvml(n_gpus=4)).start()
        return
    with TelemetrySampler(tmp_path, interval_s=0.05, nvml=FakeNvml(n_gpus=4)) as s:
        pass
    assert [g.index for g in s.run.gpus] == expect


def test_cuda_visible_devices_that_names_no_gpu_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0badc0de")
    fake = FakeNvml(n_gpus=2)
    with pytest.raises(Glm5Fp4Error, match=r"CUDA_VISIBLE_DEVICES='GPU-0badc0de' names no GPU NVML sees"):
        TelemetrySampler(tmp_path / "bad", nvml=fake).start()
    assert fake.initialised == fake.shutdowns == 1
    assert not (tmp_path / "bad").exists()
