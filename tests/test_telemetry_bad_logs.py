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
