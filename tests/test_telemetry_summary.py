"""Summary math: percentiles, integration, phases, energy against closed-form integrals, tokens per joule."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.telemetry import TelemetrySampler, energy_per_token, summarize
from glm5_fp4.telemetry.fake_nvml import FakeNvml, SineSquaredPower, StepPower, SwitchedPower
from glm5_fp4.telemetry.series import GpuSeries, TelemetryRun
from glm5_fp4.telemetry.summary import counter_delta, integrate, percentile, phases, sliver_s


def test_percentile_matches_numpy():
    rng = random.Random(7)
    for n in (1, 2, 5, 100, 1001):
        values = sorted(rng.uniform(-50, 500) for _ in range(n))
        for q in (0, 10, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)
    assert math.isnan(percentile([], 50))


def test_integrate_linear_function_over_random_windows():
    """The trapezoid rule is exact for a line, including interpolated window edges."""
    rng = random.Random(3)
    t = sorted(rng.uniform(0, 10) for _ in range(60))
    m, c = 37.0, 120.0
    y = [m * x + c for x in t]
    for _ in range(50):
        a, b = sorted(rng.uniform(t[0], t[-1]) for _ in range(2))
        exact = m / 2 * (b * b - a * a) + c * (b - a)
        assert integrate(t, y, a, b) == pytest.approx(exact, rel=1e-9)
    # windows beyond the samples are clipped, not extrapolated
    assert integrate(t, y, -5, 50) == pytest.approx(integrate(t, y))
    assert integrate(t, y, 20, 30) == 0.0


def test_integrate_smooth_curve_converges_to_closed_form():
    curve = SineSquaredPower(base_w=90, amp_w=500, period_s=1.7)
    for dt, tol in ((0.1, 2e-3), (0.01, 2e-5)):
        t = [i * dt for i in range(int(6.0 / dt) + 1)]
        y = [curve.power(x) for x in t]
        exact = curve.energy(t[-1]) - curve.energy(t[0])
        assert integrate(t, y) == pytest.approx(exact, rel=tol)


def test_integrate_skips_gaps_and_adds_over_windows():
    t = [0.0, 1.0, 2.0, 3.0, 4.0]
    y = [100.0, float("nan"), 300.0, 300.0, 100.0]
    # the NaN sample is bridged linearly from (0,100) to (2,300)
    assert integrate(t, y) == pytest.approx(400 + 300 + 200)
    cuts = [0.0, 0.7, 2.5, 4.0]
    parts = [integrate(t, y, a, b) for a, b in zip(cuts, cuts[1:])]
    assert sum(parts) == pytest.approx(integrate(t, y))
    assert counter_delta([0, 1, 2], [5.0, 7.0, 11.0], 0.5, 1.5) == pytest.approx(9.0 - 6.0)  # 7+0.5*4 minus 5+0.5*2


def _synthetic_run(curves, dt=0.05, seconds=6.0, marks=()):
    """A run built directly (no thread): power from the curve, counter from its exact integral."""
    run = TelemetryRun(available=True, interval_s=dt, end_s=seconds, marks=list(marks))
    for i, curve in enumerate(curves):
        g = GpuSeries(index=i, name="synthetic", metrics=["power_w", "sm_mhz", "energy_j"])
        for k in range(int(round(seconds / dt)) + 1):
            t = k * dt
            g.append(
                t,
                {
                    "power_w": curve.power(t),
                    "sm_mhz": 1000 + curve.power(t),
                    "energy_j": curve.energy(t) - curve.energy(0),
                },
            )
        run.gpus.append(g)
    return run


def test_summary_energy_stats_and_tokens():
    curves = [
        StepPower(idle_w=80, load_w=600, start_s=1.0, stop_s=4.0),
        StepPower(idle_w=70, load_w=500, start_s=1.0, stop_s=4.0),
    ]
    run = _synthetic_run(curves, marks=[(0.0, "idle"), (1.0, "measure"), (4.0, "cooldown")])
    s = summarize(run, tokens=12_000)
    exact = [c.energy(6.0) for c in curves]
    for g, curve, e in zip(s["gpus"], curves, exact):
        assert g["energy_j"]["counter"] == pytest.approx(e)
        # a step sampled every 50 ms: the trapezoid is off by at most one half-step per edge
        assert g["energy_j"]["trapezoid"] == pytest.approx(e, abs=2 * 520 * 0.05)
        samples = [curve.power(k * 0.05) for k in range(121)]
        assert g["metrics"]["power_w"]["median"] == pytest.approx(float(np.median(samples)))
        assert g["metrics"]["power_w"]["p90"] == pytest.approx(float(np.percentile(samples, 90)))
    assert s["energy_source"] == "nvml_counter"
    assert s["energy_j"] == pytest.approx(sum(exact))
    assert s["tokens_per_joule"] == pytest.approx(12_000 / sum(exact))
    assert s["joules_per_token"] == pytest.approx(sum(exact) / 12_000)
    assert energy_per_token(s) == pytest.approx(sum(exact) / 12_000)
    assert energy_per_token(s, 6_000) == pytest.approx(sum(exact) / 6_000)
    assert s["mean_power_w"] == pytest.approx(sum(exact) / 6.0)

    by_name = {p["name"]: p for p in s["phases"]}
    assert list(by_name) == ["idle", "measure", "cooldown"]
    assert by_name["measure"]["energy_j"] == pytest.approx(3.0 * (600 + 500), rel=0.02)
    assert sum(p["energy_j"] for p in s["phases"]) == pytest.approx(s["energy_j"])
    assert by_name["measure"]["gpus"][0]["median_power_w"] == 600
    assert by_name["idle"]["gpus"][1]["median_power_w"] == 70

    m = summarize(run, tokens=12_000, phase="measure")
    assert m["window"] == {
        "phase": "measure", "start_s": 1.0, "end_s": 4.0, "duration_s": 3.0, "intervals": [[1.0, 4.0]]
    }
    assert m["energy_j"] == pytest.approx(3.0 * 1100, rel=0.02)
    assert m["gpus"][0]["metrics"]["power_w"]["median"] == 600
    assert m["gpus"][0]["metrics"]["sm_mhz"]["p90"] == 1600
    with pytest.raises(Glm5Fp4Error, match="'decode'.*cooldown, idle, measure"):
        summarize(run, phase="decode")


def test_summary_percentiles_per_gpu_against_numpy():
    rng = np.random.default_rng(11)
    run = TelemetryRun(available=True, interval_s=0.1, end_s=9.9)
    values = rng.uniform(50, 700, size=100)
    g = GpuSeries(index=0, metrics=["power_w", "util_gpu"])
    for k, v in enumerate(values):
        g.append(k * 0.1, {"power_w": float(v), "util_gpu": float(k % 100)})
    run.gpus.append(g)
    stats = summarize(run)["gpus"][0]["metrics"]
    assert stats["power_w"]["median"] == pytest.approx(float(np.median(values)), rel=1e-6)
    assert stats["power_w"]["p90"] == pytest.approx(float(np.percentile(values, 90)), rel=1e-6)
    assert stats["power_w"]["max"] == pytest.approx(float(values.max()), rel=1e-6)
    assert "sm_mhz" not in stats  # not reported by this GPU


def test_sampler_energy_matches_closed_form_integral(tmp_path):
    """End to end through the sampling thread: fake power curve -> samples -> joules."""
    curves = [
        SineSquaredPower(base_w=100, amp_w=400, period_s=0.5),
        SineSquaredPower(base_w=150, amp_w=200, period_s=0.3),
    ]
    fake = FakeNvml(n_gpus=2, curves=curves)
    with TelemetrySampler(tmp_path, interval_s=0.01, nvml=fake) as s:
        time.sleep(1.0)
    offset = s.run.start_monotonic - fake.t0  # sampler time -> fake's curve time
    summary = s.summary()
    for g, curve, series in zip(summary["gpus"], curves, s.run.gpus):
        a, b = series.t[0] + offset, series.t[-1] + offset
        exact = curve.energy(b) - curve.energy(a)
        assert g["energy_j"]["counter"] == pytest.approx(exact, rel=0.01)
        assert g["energy_j"]["trapezoid"] == pytest.approx(exact, rel=0.02)
        assert abs(g["counter_vs_trapezoid_pct"]) < 2


def test_no_marks_means_one_phase_and_late_first_mark_leaves_unmarked():
    run = _synthetic_run([StepPower()], seconds=2.0)
    assert phases(run) == [("all", 0.0, 2.0)]
    run.marks = [(0.5, "measure")]
    assert phases(run) == [("unmarked", 0.0, 0.5), ("measure", 0.5, 2.0)]
    run.marks = [(0.01, "measure")]  # within one interval of the start
    assert phases(run) == [("measure", 0.0, 2.0)]
    # a first mark late by start-up jitter on a loaded CPU (several intervals) is still no phase of its own
    run.marks = [(0.2, "measure")]
    assert run.interval_s <= 0.05 and phases(run) == [("measure", 0.0, 2.0)]
    run.marks = [(0.3, "measure")]  # past the quarter second: a phase of its own again
    assert phases(run) == [("unmarked", 0.0, 0.3), ("measure", 0.3, 2.0)]
    assert sliver_s(0.01) == 0.25 and sliver_s(1.0) == 1.0  # a slow sampling interval is its own start-up allowance


def test_energy_per_token_edge_cases():
    assert energy_per_token(None, 10) is None
    assert energy_per_token({"available": False, "energy_j": None}, 10) is None
    s = {"available": True, "energy_j": 500.0, "tokens": None}
    assert energy_per_token(s) is None
    assert energy_per_token(s, 0) is None
    assert energy_per_token(s, 250) == 2.0
    with pytest.raises(Glm5Fp4Error, match="tokens"):
        energy_per_token(s, -1)
    with pytest.raises(Glm5Fp4Error, match="tokens"):
        summarize(_synthetic_run([StepPower()], seconds=1.0), tokens=-5)


def test_unavailable_summary():
    s = summarize(TelemetryRun(available=False, reason="NVML sees no NVIDIA GPUs"), tokens=7)
    assert s["available"] is False
    assert s["message"] == "no GPU telemetry: NVML sees no NVIDIA GPUs"
    assert s["tokens"] == 7 and s["tokens_per_joule"] is None and s["gpus"] == []


def test_switched_power_energy_is_its_integral():
    curve = SwitchedPower(idle_w=50, load_w=300)
    curve.switch(True, 1.0)
    curve.switch(False, 3.5)
    curve.switch(True, 4.0)
    t = [i * 0.001 for i in range(5001)]
    numeric = integrate(t, [curve.power(x) for x in t])
    assert curve.energy(5.0) == pytest.approx(50 * 5 + 250 * (2.5 + 1.0))
    assert numeric == pytest.approx(curve.energy(5.0), rel=1e-3)
