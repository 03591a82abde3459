"""The on-disk format: JSONL samples, metadata, and loading a run back."""

from __future__ import annotations

import json
import math
import time

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.telemetry import TelemetrySampler, load_run
from glm5_fp4.telemetry.fake_nvml import FakeNvml
from glm5_fp4.telemetry.series import FORMAT, META_FILE, METRICS, SAMPLES_FILE
from glm5_fp4.telemetry.summary import summarize


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("tel")
    fake = FakeNvml(n_gpus=2)
    with TelemetrySampler(out, interval_s=0.02, nvml=fake, slow_s=0.1) as s:
        s.mark("warmup")
        time.sleep(0.1)
        s.mark("measure")
        time.sleep(0.2)
    return out, s


def test_every_line_is_one_sample_of_one_gpu(recorded):
    out, s = recorded
    lines = (out / SAMPLES_FILE).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    allowed = set(METRICS) | {"t", "gpu", "throttle"}
    per_gpu: dict[int, list[float]] = {}
    for line, row in zip(lines, rows):
        assert " " not in line  # compact separators
        assert set(row) <= allowed
        assert isinstance(row["t"], float) and row["t"] >= 0
        assert all(isinstance(x, str) for x in row.get("throttle", []))
        per_gpu.setdefault(row["gpu"], []).append(row["t"])
    assert sorted(per_gpu) == [0, 1]
    assert len(per_gpu[0]) == len(per_gpu[1]) == len(s.run.gpus[0])
    for ts in per_gpu.values():
        assert ts == sorted(ts)
    # what the fake reports is what the file holds: power in W, memory in MiB, energy from 0
    assert {r["mem_used_mib"] for r in rows if r["gpu"] == 1 and "mem_used_mib" in r} == {2048.0}
    first = [r for r in rows if r["gpu"] == 0][0]
    assert first["energy_j"] == 0.0
    assert 100 <= first["power_w"] <= 500
    # slow metrics (every 0.1 s = 5 ticks here) sit in the first and last line and in about 1 line in 5
    meta = json.loads((out / META_FILE).read_text())
    slow = set(meta["sampler"]["slow_metrics"])
    assert slow == {"mem_mhz", "mem_used_mib", "temp_c", "throttle"}
    gpu0 = [r for r in rows if r["gpu"] == 0]
    assert slow <= set(gpu0[0]) and slow <= set(gpu0[-1])
    for key in slow:  # each read in its own tick, staggered, so ticks carry equal work
        with_key = [r for r in gpu0 if key in r]
        assert len(gpu0) / 5 - 1 <= len(with_key) <= len(gpu0) / 5 + 3
    assert all("power_w" in r and "sm_mhz" in r and "util_gpu" in r for r in gpu0)


def test_meta_lists_gpus_metrics_and_marks(recorded):
    out, _ = recorded
    meta = json.loads((out / META_FILE).read_text())
    assert meta["format"] == FORMAT and meta["available"] is True
    assert meta["end_s"] > 0.3 and meta["start_unix"] > 1e9
    assert [g["uuid"] for g in meta["gpus"]] == ["GPU-fake-0000", "GPU-fake-0001"]
    assert {"power_w", "sm_mhz", "energy_j", "pcie_tx_mbs"} <= set(meta["gpus"][0]["metrics"])
    assert [m["name"] for m in meta["marks"]] == ["warmup", "measure"]
    assert meta["sampler"]["ticks"] >= 5


def test_load_run_matches_memory(recorded):
    out, s = recorded
    run = load_run(out)
    assert [g.index for g in run.gpus] == [g.index for g in s.run.gpus]
    for mem, disk in zip(s.run.gpus, run.gpus):
        assert len(mem) == len(disk)
        for key, (_, decimals) in METRICS.items():
            for a, b in zip(mem.values[key], disk.values[key]):
                assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 0.5 * 10**-decimals + 1e-9
        assert mem.throttle == disk.throttle
    # the summary from disk equals the one from memory up to the file's rounding
    assert summarize(run)["energy_j"] == pytest.approx(s.summary()["energy_j"], rel=1e-4)


def test_torn_last_line_is_tolerated(recorded, tmp_path):
    out, s = recorded
    for name in (META_FILE, SAMPLES_FILE):
        (tmp_path / name).write_text((out / name).read_text())
    with (tmp_path / SAMPLES_FILE).open("a") as f:
        f.write('{"t":9.9,"gpu":0,"pow')
    assert len(load_run(tmp_path).gpus[0]) == len(s.run.gpus[0])


def test_bad_files_name_the_culprit(recorded, tmp_path):
    out, _ = recorded
    with pytest.raises(Glm5Fp4Error, match="not a directory"):
        load_run(tmp_path / "nope")
    with pytest.raises(Glm5Fp4Error, match=META_FILE):
        load_run(tmp_path)
    (tmp_path / META_FILE).write_text((out / META_FILE).read_text())
    with pytest.raises(Glm5Fp4Error, match=f"{SAMPLES_FILE}: missing"):
        load_run(tmp_path)
    lines = (out / SAMPLES_FILE).read_text().splitlines()
    (tmp_path / SAMPLES_FILE).write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(Glm5Fp4Error, match=f"{SAMPLES_FILE}:2"):
        load_run(tmp_path)
    (tmp_path / SAMPLES_FILE).write_text('{"t":0.1,"gpu":5,"power_w":1}\n{"t":0.2,"gpu":0}\n')
    with pytest.raises(Glm5Fp4Error, match="GPU 5"):
        load_run(tmp_path)
    (tmp_path / SAMPLES_FILE).write_text('{"t":0.1,"gpu":0,"power_w":"hot"}\n{"t":0.2,"gpu":0}\n')
    with pytest.raises(Glm5Fp4Error, match="power_w"):
        load_run(tmp_path)
    meta = json.loads((out / META_FILE).read_text())
    meta["format"] = "something-else/9"
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(Glm5Fp4Error, match="format"):
        load_run(tmp_path)
