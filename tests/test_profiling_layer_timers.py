"""Per-layer timers on CPU (perf_counter_ns fallback), the custom op under torch.compile, aggregation."""

import json
import time

import numpy as np
import pytest
import torch

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling.layer_timers import (
    LayerTimer,
    NullTimer,
    TimerStats,
    read_dumps,
    report_from_files,
    timer_from_env,
    wrap_module_forward,
)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_marks_give_ordered_regions_that_cover_the_step():
    timer = LayerTimer(device="cpu")
    waits = {"layer0": 0.004, "layer1": 0.001, "layer2": 0.003}
    t0 = time.perf_counter_ns()
    for name, s in waits.items():
        timer.mark(name)
        _spin(s)
    timer.stop()
    wall_us = (time.perf_counter_ns() - t0) / 1000
    regions = timer.collect()
    assert list(regions) == list(waits)  # time order
    for name, s in waits.items():
        assert regions[name] >= s * 1e6 * 0.99
    assert sum(regions.values()) <= wall_us
    assert sum(regions.values()) >= sum(waits.values()) * 1e6 * 0.99


def test_ranges_nest_and_modules_can_be_wrapped():
    timer = LayerTimer(device="cpu")
    layer = torch.nn.Linear(16, 16)
    handles = wrap_module_forward(layer, "layer0/linear", timer)
    with timer.range("layer0"):
        _spin(0.001)
        layer(torch.randn(4, 16))
        with timer.range("layer0/inner"):
            _spin(0.002)
    regions = timer.collect()
    assert set(regions) == {"layer0", "layer0/linear", "layer0/inner"}
    assert regions["layer0"] >= regions["layer0/inner"] + regions["layer0/linear"]
    assert regions["layer0/inner"] >= 2000 * 0.99
    for h in handles:
        h.remove()
    layer(torch.randn(4, 16))
    assert "layer0/linear" not in timer.collect()


def test_collect_clears_and_regions_that_did_not_run_are_dropped():
    timer = LayerTimer(device="cpu")
    timer.mark("a")
    timer.mark("b")
    timer.stop()
    assert set(timer.collect()) == {"a", "b"}
    timer.mark("a")
    timer.stop()
    assert set(timer.collect()) == {"a"}  # "b" kept its slot but did not run this step
    assert timer.collect() == {}


def test_stats_median_and_p90_over_steps(tmp_path):
    dump = tmp_path / "t.jsonl"
    timer = LayerTimer(device="cpu", dump_path=dump)
    for i in range(9):
        timer.mark("x")
        _spin(0.0002 * (1 + i % 3))
        timer.stop()
        timer.collect()
    samples = timer.stats.samples["x"]
    assert len(samples) == 9
    row = timer.stats.summary()[0]
    assert row["median_us"] == pytest.approx(np.median(samples))
    assert row["p90_us"] == pytest.approx(np.percentile(samples, 90))
    # the JSON-lines dump round-trips into the same statistics and a report
    assert read_dumps([dump]).samples["x"] == pytest.approx(samples)
    paths = report_from_files([dump], tmp_path / "rep")
    assert json.loads(paths["json"].read_text())["steps"] == 9
    assert "| x | 9 |" in paths["markdown"].read_text()
    assert paths["png"].stat().st_size > 0


def test_bad_dump_line_is_named(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"regions_us": {"a": 1}}\nnot json\n')
    with pytest.raises(Glm5Fp4Error, match="bad.jsonl:2"):
        read_dumps([f])


def test_env_switch(monkeypatch, tmp_path):
    monkeypatch.delenv("GLM5_FP4_LAYER_TIMERS", raising=False)
    assert isinstance(timer_from_env("cpu"), NullTimer)
    monkeypatch.setenv("GLM5_FP4_LAYER_TIMERS", "1")
    monkeypatch.setenv("GLM5_FP4_LAYER_TIMERS_OUT", str(tmp_path / "timers.rank{rank}.jsonl"))
    t = timer_from_env("cpu", rank=3)
    assert isinstance(t, LayerTimer) and t.dump_path == tmp_path / "timers.rank3.jsonl"
    null = NullTimer()
    with null.range("x"):
        null.mark("y")
    assert null.collect() == {} and wrap_module_forward(torch.nn.Linear(2, 2), "m", null) == []


def test_capacity_is_enforced():
    timer = LayerTimer(device="cpu", capacity=2)
    timer.mark("a")
    timer.mark("b")
    with pytest.raises(Glm5Fp4Error, match="capacity"):
        timer.mark("c")


def test_stamp_op_survives_torch_compile():
    """The op has a fake implementation, so a traced graph keeps the stamps (no graph break, fullgraph)."""
    assert hasattr(torch.ops.glm5_fp4, "timer_stamp")
    timer = LayerTimer(device="cpu")

    def step(x):
        timer.mark("first", after=x)
        y = torch.sin(x) @ x
        timer.mark("second", after=y)
        y = y.relu()
        timer.stop(after=y)
        return y

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.randn(64, 64)
    compiled(x)
    timer.collect()
    compiled(x)  # the second call runs the traced graph, with no Python marks executing
    regions = timer.collect()
    assert list(regions) == ["first", "second"] and all(v > 0 for v in regions.values())


def test_stats_ignore_empty():
    assert TimerStats().steps == 0


def test_reset_drops_warmup_stamps_and_stats():
    timer = LayerTimer(device="cpu")
    timer.mark("warmup")
    timer.stop()
    timer.collect()
    timer.mark("warmup")
    timer.stop()  # e.g. a graph-capture pass that nobody collected
    timer.reset()
    assert timer.stats.steps == 0 and timer.collect() == {}


def test_null_timer_reads_nothing():
    from glm5_fp4.profiling.layer_timers import NullTimer

    t = NullTimer()
    t.mark("layer00")
    t.stop()
    assert t.read() == {} and t.collect() == {}


def _dump(path, steps):
    with path.open("w") as f:
        for i, (key, val, moe) in enumerate(steps, 1):
            f.write(json.dumps({"step": i, key: val, "rows": val if key == "tokens" else val,
                                "regions_us": {"layer03/moe": moe, "all layers": moe + 100.0}}) + "\n")


def test_report_keeps_decode_and_prefill_steps_apart(tmp_path):
    """A timer wave mixes prefill chunks and decode steps (H200, 2026-12-01: 73 steps of 1 to ~4,000 tokens in one
    SGLang dump, reported as one median). Each batch size gets its own table; the pooled one says it is pooled."""
    rng = np.random.default_rng(0)
    steps = [("tokens", 512, 2000.0 + rng.normal(0, 20)) for _ in range(20)]
    steps += [("tokens", 8192, 17000.0 + rng.normal(0, 100)) for _ in range(5)]
    steps += [("tokens", 700, 2600.0)]
    rng.shuffle(steps)
    _dump(tmp_path / "rank0.jsonl", steps)
    paths = report_from_files([tmp_path / "rank0.jsonl"], tmp_path / "rep")
    doc = json.loads(paths["json"].read_text())
    assert doc["group_by"] == "tokens" and doc["steps"] == 26
    groups = {g["value"]: g for g in doc["groups"]}
    assert groups[512]["steps"] == 20 and groups[8192]["steps"] == 5 and groups[700]["steps"] == 1
    med = {v: next(r["median_us"] for r in g["regions"] if r["region"] == "layer03/moe") for v, g in groups.items()}
    assert abs(med[512] - 2000) < 30 and abs(med[8192] - 17000) < 150
    assert [g["value"] for g in doc["groups"]][:2] == [512, 8192]  # most steps first
    md = paths["markdown"].read_text()
    assert "## 512 tokens per step (20 steps)" in md and "## 8192 tokens per step (5 steps)" in md
    assert "pools 3 batch sizes" in md


def test_report_of_old_dumps_groups_by_rows(tmp_path):
    _dump(tmp_path / "old.jsonl", [("rows", 64, 1000.0)] * 4 + [("rows", 512, 2000.0)] * 4)
    for line in (tmp_path / "old.jsonl").read_text().splitlines():
        assert "tokens" not in json.loads(line)
    doc = json.loads(report_from_files([tmp_path / "old.jsonl"], tmp_path / "rep")["json"].read_text())
    assert doc["group_by"] == "rows" and {g["value"] for g in doc["groups"]} == {64, 512}


def _stage_dump(path, layers, per_layer_us, steps=5):
    with path.open("w") as f:
        for s in range(steps):
            regions = {f"layer{i:02d}": per_layer_us + s for i in layers}
            regions["all layers"] = sum(regions.values())
            f.write(json.dumps({"step": s, "tokens": 8, "regions_us": regions}) + "\n")


def test_dumps_of_pipeline_stages_are_reported_per_dump(tmp_path):
    """PP2: rank 0 times layers 0-1 (~300 us), rank 1 layers 2-3 (~700 us). Pooled, the report said "10 step(s)" for
    5 and a median `all layers` of ~500 us that no rank and not the model (~1,000 us) ever took. Each dump is now
    counted and summarised on its own, and the pooled `all layers` is said to mix different layers."""
    _stage_dump(tmp_path / "rank0.jsonl", [0, 1], 150.0)
    _stage_dump(tmp_path / "rank1.jsonl", [2, 3], 350.0)
    paths = report_from_files([tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl"], tmp_path / "rep")
    doc = json.loads(paths["json"].read_text())
    dumps = {d["file"]: d for d in doc["dumps"]}
    assert dumps["rank0.jsonl"]["steps"] == 5 and dumps["rank1.jsonl"]["steps"] == 5
    assert abs(dumps["rank0.jsonl"]["all_layers_median_us"] - 304) < 1
    assert abs(dumps["rank1.jsonl"]["all_layers_median_us"] - 704) < 1
    md = paths["markdown"].read_text()
    assert "10 step(s)" not in md and "2 dumps" in md and "different layers" in md, md
    assert "| rank1.jsonl | 5 | layer02-layer03 |" in md, md


def test_dumps_of_the_same_layers_say_how_many_steps_each(tmp_path):
    """TP: every rank times the same layers; pooling them is fine, but the step count is per dump, not their sum."""
    _stage_dump(tmp_path / "rank0.jsonl", [0, 1], 150.0)
    _stage_dump(tmp_path / "rank1.jsonl", [0, 1], 151.0)
    md = report_from_files([tmp_path / "rank0.jsonl", tmp_path / "rank1.jsonl"], tmp_path / "rep")["markdown"]
    text = md.read_text()
    assert "5 step(s) in each of 2 dumps" in text and "different layers" not in text, text


def test_dumps_of_two_runs_with_one_name_are_not_pooled(tmp_path):
    """The writer names dumps rank<r>.jsonl: run A's and run B's rank0.jsonl are one rank of two runs. Once merged
    under one name (steps counted twice), then kept as two dumps whose regions were pooled as if two ranks (a median
    of neither run): now refused (test_profiling_layer_timers_report.py has the message)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _stage_dump(tmp_path / "a" / "rank0.jsonl", [0, 1], 150.0)
    _stage_dump(tmp_path / "b" / "rank0.jsonl", [0, 1], 151.0)
    with pytest.raises(Glm5Fp4Error, match="one rank's dump of two runs"):
        report_from_files([tmp_path / "a" / "rank0.jsonl", tmp_path / "b" / "rank0.jsonl"], tmp_path / "rep")
