"""`telemetry report` on logs that are not the happy path: each problem is reported, no number is made up."""

from __future__ import annotations

import json

import pytest

from glm5_fp4 import cli
from glm5_fp4.telemetry.series import FORMAT, META_FILE, SAMPLES_FILE, SUMMARY_FILE

DT = 0.05


def _meta(n_gpus=1, **over):
    meta = {
        "format": FORMAT,
        "available": True,
        "interval_s": DT,
        "end_s": 3.0,
        "gpus": [{"index": i, "name": "g", "metrics": ["power_w", "energy_j", "sm_mhz"]} for i in range(n_gpus)],
        "marks": [],
        "sampler": {},
    }
    meta.update(over)
    return meta


def _rows(seconds=3.0, load=(1.0, 2.0)):
    """Idle 100 W, loaded 600 W between load[0] and load[1]; the counter is the exact integral."""
    rows, energy = [], 0.0
    n = int(round(seconds / DT))
    for k in range(n + 1):
        t = k * DT
        p = 600.0 if load[0] <= t < load[1] else 100.0
        if k:
            energy += DT * (p + rows[-1]["power_w"]) / 2
        rows.append({"t": round(t, 4), "gpu": 0, "power_w": p, "energy_j": energy, "sm_mhz": 1000.0})
    return rows


def _write(tmp_path, rows, meta=None, raw=None):
    d = tmp_path / "tel"
    d.mkdir()
    (d / META_FILE).write_text(json.dumps(meta or _meta()))
    (d / SAMPLES_FILE).write_text(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in rows))
    return d


def _report(d, capsys, *extra):
    rc = cli.main(["telemetry", "report", str(d), "--no-plot", *extra])
    out = capsys.readouterr()
    summary = json.loads((d / SUMMARY_FILE).read_text()) if (d / SUMMARY_FILE).exists() else None
    return rc, out.out + out.err, summary


def test_empty_log_is_a_failure_not_zero_joules(tmp_path, capsys):
    d = _write(tmp_path, [], raw="")
    rc, text, summary = _report(d, capsys, "--tokens", "1000")
    assert rc == 1
    assert "no samples" in text
    assert "0 J" not in text and "J/token" not in text
    assert summary["energy_j"] is None


def test_one_sample_gives_no_energy_or_rate(tmp_path, capsys):
    d = _write(tmp_path, _rows()[:1])
    rc, text, summary = _report(d, capsys, "--tokens", "1000")
    assert rc == 1
    assert "fewer than two power samples" in text
    assert summary["energy_j"] is None and summary["joules_per_token"] is None
    assert "0.000 J/token" not in text and "mean power 0 W" not in text


def test_gap_is_reported_and_does_not_drag_the_median_to_idle(tmp_path, capsys):
    # 3 s: idle 0-0.5, load 0.5-2.5, idle 2.5-3; then a 1.2 s hole in the loaded stretch
    rows = [r for r in _rows(load=(0.5, 2.5)) if not 1.0 < r["t"] < 2.2]
    d = _write(tmp_path, rows)
    rc, text, summary = _report(d, capsys)
    assert rc == 0
    assert "no samples for 1.2" in text
    g = summary["gpus"][0]
    assert g["gaps"] and g["gaps"][0]["start_s"] == pytest.approx(1.0)
    assert g["metrics"]["power_w"]["median"] == 600


def test_duplicated_lines_are_not_integrated_twice(tmp_path, capsys):
    rows = _rows()
    clean_dir = _write(tmp_path, rows)
    _, _, clean = _report(clean_dir, capsys)
    dup_dir = tmp_path / "dup"
    dup_dir.mkdir()
    (dup_dir / META_FILE).write_text(json.dumps(_meta()))
    (dup_dir / SAMPLES_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows + rows))
    rc, text, dup = _report(dup_dir, capsys)
    assert "repeat an earlier timestamp" in text
    assert dup["energy_trapezoid_j"] == pytest.approx(clean["energy_trapezoid_j"])
    assert dup["energy_j"] == pytest.approx(clean["energy_j"])


def test_energy_counter_going_backwards_is_not_the_headline(tmp_path, capsys):
    rows = _rows()
    for r in rows:
        if r["t"] >= 1.5:
            r["energy_j"] -= 500.0  # a reset in the middle of the run
    d = _write(tmp_path, rows)
    rc, text, summary = _report(d, capsys)
    assert "goes backwards" in text
    assert summary["energy_source"] == "power_trapezoid"
    assert summary["energy_j"] == pytest.approx(summary["energy_trapezoid_j"])
    assert summary["energy_j"] == pytest.approx(100 * 2 + 600 * 1, rel=0.05)


def test_counter_disagreeing_with_the_integral_is_warned(tmp_path, capsys):
    rows = _rows()
    for r in rows:
        r["energy_j"] *= 2  # monotonic, but twice what the power readings say
    d = _write(tmp_path, rows)
    rc, text, summary = _report(d, capsys)
    assert "differ by" in text


def test_nan_power_samples_are_dropped_with_a_note(tmp_path, capsys):
    rows = _rows()
    for r in rows:
        if 1.1 <= r["t"] < 1.6:
            r["power_w"] = float("nan")
    d = _write(tmp_path, rows)
    rc, text, summary = _report(d, capsys)
    assert rc == 0
    assert "power_w reading(s) were null, NaN or infinite" in text
    m = summary["gpus"][0]["metrics"]["power_w"]
    # 1 s of load against 2 s idle: by time the median is idle, and NaN did not leak into any number
    assert m["median"] == 100 and m["max"] == 600
    assert summary["energy_trapezoid_j"] == pytest.approx(800, rel=0.05)


@pytest.mark.parametrize(
    "over, culprit",
    [
        ({"gpus": "x"}, "'gpus'"),
        ({"gpus": [{"name": "no index"}]}, "gpus[0].index"),
        ({"marks": [{"t": "late", "name": "m"}]}, "marks[0].t"),
        ({"interval_s": "fast"}, "'interval_s'"),
    ],
)
def test_malformed_meta_is_one_clear_error(tmp_path, capsys, over, culprit):
    d = _write(tmp_path, _rows(), meta=_meta(**over))
    rc = cli.main(["telemetry", "report", str(d), "--no-plot"])
    err = capsys.readouterr().err
    assert rc == 1
    assert culprit in err and META_FILE in err
    assert "Traceback" not in err
    assert not (d / SUMMARY_FILE).exists()


def _flat_rows(gpu, watts, t0, t1, dt=0.1, counter=True):
    """Constant `watts` sampled every dt from t0 to t1; the counter (from t0) is the exact integral."""
    n = int(round((t1 - t0) / dt))
    rows = []
    for k in range(n + 1):
        t = round(t0 + k * dt, 4)
        row = {"t": t, "gpu": gpu, "power_w": watts, "sm_mhz": 1500.0}
        if counter:
            row["energy_j"] = watts * (t - t0)
        rows.append(row)
    return rows


def test_samples_ending_long_before_the_run_are_a_gap_held_flat(tmp_path, capsys):
    """Before: samples 0-10 s of a 100 s run gave "Energy 5,000 J, mean power 50 W" and no warning."""
    meta = _meta(interval_s=0.1, end_s=100.0)
    meta["gpus"][0]["metrics"] = ["power_w", "sm_mhz"]
    d = _write(tmp_path, _flat_rows(0, 500.0, 0.0, 10.0, counter=False), meta=meta)
    rc, text, summary = _report(d, capsys)
    assert rc == 0
    assert "no samples for 90.00 s" in text
    g = summary["gpus"][0]
    assert g["gaps"] == [{"start_s": 10.0, "end_s": 100.0}]
    assert g["samples"] == 101  # real samples only
    assert summary["energy_j"] == pytest.approx(500 * 100)
    assert summary["mean_power_w"] == pytest.approx(500)


def test_samples_starting_long_after_the_run_are_a_gap_held_flat(tmp_path, capsys):
    meta = _meta(interval_s=0.1, end_s=30.0)
    meta["gpus"][0]["metrics"] = ["power_w", "sm_mhz"]
    d = _write(tmp_path, _flat_rows(0, 500.0, 20.0, 30.0, counter=False), meta=meta)
    rc, text, summary = _report(d, capsys)
    assert "no samples for 20.00 s" in text
    assert summary["gpus"][0]["gaps"] == [{"start_s": 0.0, "end_s": 20.0}]
    assert summary["energy_j"] == pytest.approx(500 * 30)
    assert summary["mean_power_w"] == pytest.approx(500)


def test_a_gpu_whose_log_stops_early_counts_in_the_later_phases(tmp_path, capsys):
    """Before: GPU 1's log stopping at 5 s of 10 made it count 0 J in the 6-10 s phase; and its energy counter,
    which cannot be extrapolated, still made the headline."""
    rows = _flat_rows(0, 500.0, 0.0, 10.0) + _flat_rows(1, 400.0, 0.0, 5.0)
    marks = [{"t": 0.0, "name": "warmup"}, {"t": 6.0, "name": "measure"}]
    meta = _meta(n_gpus=2, interval_s=0.1, end_s=10.0, marks=marks)
    d = _write(tmp_path, rows, meta=meta)
    rc, text, summary = _report(d, capsys)
    assert "GPU 1: no samples for 5.00 s" in text and "GPU 0: no samples" not in text
    assert "GPU 1: the NVML energy counter" in text
    assert summary["energy_source"] == "power_trapezoid"
    assert summary["energy_j"] == pytest.approx(500 * 10 + 400 * 10)
    assert [g["samples"] for g in summary["gpus"]] == [101, 51]
    assert [g["gaps"] for g in summary["gpus"]] == [[], [{"start_s": 5.0, "end_s": 10.0}]]
    measure = {p["name"]: p for p in summary["phases"]}["measure"]
    assert [x["energy_j"] for x in measure["gpus"]] == pytest.approx([500 * 4, 400 * 4])
    assert measure["mean_power_w"] == pytest.approx(900)
    assert sum(p["energy_j"] for p in summary["phases"]) == pytest.approx(summary["energy_j"])
    rc, text, phase = _report(d, capsys, "--phase", "measure")
    assert phase["energy_j"] == pytest.approx(900 * 4)
    assert phase["gpus"][1]["gaps"] == [{"start_s": 5.0, "end_s": 10.0}]


def test_a_phase_marked_twice_is_its_own_intervals_only(tmp_path, capsys):
    """Before: `--phase measure` took 0-30 s (first start to last end), cooldown included: 100 W in the median."""
    rows = _flat_rows(0, 600.0, 0.0, 30.0, counter=False)
    for r in rows:
        if 10.0 <= r["t"] < 20.0:
            r["power_w"] = 100.0
    meta = _meta(interval_s=0.1, end_s=30.0,
                 marks=[{"t": 0.0, "name": "measure"}, {"t": 10.0, "name": "cooldown"}, {"t": 20.0, "name": "measure"}])
    meta["gpus"][0]["metrics"] = ["power_w", "sm_mhz"]
    d = _write(tmp_path, rows, meta=meta)
    _, _, whole = _report(d, capsys)
    rows_energy = sum(p["energy_j"] for p in whole["phases"] if p["name"] == "measure")
    rc, text, s = _report(d, capsys, "--phase", "measure")
    assert rc == 0
    assert s["window"]["duration_s"] == pytest.approx(20.0)
    assert s["window"]["intervals"] == [[0.0, 10.0], [20.0, 30.0]]
    assert s["energy_j"] == pytest.approx(rows_energy)  # the phase rows' own numbers
    assert s["energy_j"] == pytest.approx(600 * 20, rel=0.01)  # the 10 s step's trapezoid edge is off by 25 J
    assert s["mean_power_w"] == pytest.approx(600, rel=0.01)
    m = s["gpus"][0]["metrics"]["power_w"]
    assert m["median"] == 600 and m["p90"] == 600
    assert s["gpus"][0]["samples"] == 100 + 101  # [0, 10) and [20, 30], the run's last sample included
    assert "phase `measure` (2 intervals), 20.0 s" in text
