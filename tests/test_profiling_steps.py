"""Decode-step detection on eager multi-rank traces: user annotations, ranks lined up, honest failure.

The case from the field: 2 ranks, eager (no CUDA graphs), 3 decode steps of ~14 ms of GPU work, the steps
wrapped in the user's own ``record_function("decode_step_N")``, one rank held back ~148 ms so its peer waits
that long inside an all-reduce, and the MoE routing synced to the host so the GPU idles before every
layer's expert GEMMs (idle gaps inside a step that a gap-based split takes for step boundaries).
"""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from glm5_fp4.cli import main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling.breakdown import analyze_path
from glm5_fp4.profiling.traces import write_trace

from profiling_synthetic import make_decode_traces

HOLD_US = 148_000.0
LAYERS = 100  # 140 µs of kernels per layer: ~14 ms of GPU work per step
HELD_BACK = dict(n_ranks=2, n_steps=3, layers=LAYERS, graph=None, launch_gap_us=1.0, jitter_us=4.0, sync_gap_us=40.0,
                 step_gap_us=60.0, hold_us={(0, 0): HOLD_US}, seed=5)
KERNELS_PER_STEP = 12 * LAYERS + 3 + 1  # per layer 12, then unknown + lm_head + argmax, and the DtoH copy


def _write(d, files):
    d.mkdir(parents=True, exist_ok=True)
    for name, trace in files:
        write_trace(trace, d / name)
    return d


def _steps_held_back(**extra):
    return make_decode_traces(**(HELD_BACK | extra))


@pytest.mark.parametrize("where", ["cpu", "gpu", "both"])
def test_user_step_annotations_give_the_steps_on_every_rank(tmp_path, where):
    files, truth = _steps_held_back(profiler_steps=where, step_name="decode_step_{}")
    b = analyze_path(_write(tmp_path, files), jobs=1)
    for r in b.ranks:
        assert r.step_method == "annotation" and r.steps_reliable, (r.rank, r.step_detail)
        assert "decode_step" in r.step_detail
        assert r.n_steps == 3 and r.n_complete_steps == 3  # the last annotated step ended inside the trace
        assert [s.n_kernels for s in r.steps] == [KERNELS_PER_STEP] * 3
        assert [s.time_us for s in r.steps] == pytest.approx(truth.step_time_us[r.rank], rel=1e-6)
        assert r.median_step["time_us"] == pytest.approx(np.median(truth.step_time_us[r.rank]), rel=1e-6)
        assert 10_000 < r.median_step["time_us"] < 30_000  # a decode step, not the whole trace or a layer
    waiting = b.ranks[1]  # rank 0 was held back: rank 1 waits in step 0's first all-reduce
    assert waiting.steps[0].exposed_us["allreduce_wait"] == pytest.approx(HOLD_US, rel=0.01)
    assert waiting.steps[1].exposed_us["allreduce_wait"] < 0.01 * HOLD_US


def test_steps_line_up_across_ranks_through_the_collectives(tmp_path):
    """Only rank 0 carries the annotations: rank 1 gets the same steps, found through the matched all-reduces."""
    files, truth = _steps_held_back(profiler_steps="cpu", step_name="decode_step_{}", annotated_ranks={0})
    b = analyze_path(_write(tmp_path, files), jobs=1)
    r0, r1 = b.ranks
    assert r0.step_method == "annotation"
    assert r1.steps_reliable and "rank 0" in r1.step_detail and "collective" in r1.step_detail
    assert r1.n_steps == 3 and r1.n_complete_steps == 3
    assert [s.n_kernels for s in r1.steps] == [KERNELS_PER_STEP] * 3
    assert [s.time_us for s in r1.steps] == pytest.approx(truth.step_time_us[1], rel=1e-6)
    # step by step the same collective instances: all of step 0's waiting lands in rank 1's step 0
    assert [s.summed_us["allreduce_wait"] > 0.5 * HOLD_US for s in r1.steps] == [True, False, False]


def test_no_reliable_step_method_is_said_and_no_per_step_table_is_shown(tmp_path, capsys):
    files, _ = _steps_held_back()  # no annotations; idle gaps before every layer's experts
    d = _write(tmp_path / "traces", files)
    b = analyze_path(d, jobs=1)
    for r in b.ranks:
        assert not r.steps_reliable
        assert r.median_step is None  # no per-step figures that look authoritative
        assert "pieces of steps" in r.step_detail  # and why
    out = tmp_path / "out"
    assert main(["profile", "analyze", str(d), "--out", str(out), "--no-png", "--batch", "8"]) == 0
    printed = capsys.readouterr().out
    assert "median step" not in printed
    assert "no reliable step boundaries" in printed and "--step-annotation REGEX" in printed
    md = (out / "breakdown.md").read_text()
    assert "Median decode step" not in md and "no reliable step boundaries" in md.lower()
    assert "--step-annotation REGEX" in md and "pieces of steps" in md
    assert "Whole trace per rank" in md  # the totals are still right and still shown
    data = json.loads((out / "breakdown.json").read_text())
    assert data["ceilings"] is None and data["across_ranks"]["steps_reliable"] is False
    # the whole-trace totals are unaffected: every kernel is still counted
    raw = {n: sum(e["dur"] for e in t["traceEvents"] if e["cat"] in ("kernel", "gpu_memcpy")) for n, t in files}
    for r in b.ranks:
        assert sum(r.summed_us.values()) == pytest.approx(raw[r.file], rel=1e-9)


def _add_profiler_steps(files, steps_per_window):
    """Wrap every `steps_per_window` decode_step annotations of each rank in one CPU ProfilerStep# range."""
    for _, trace in files:
        marks = sorted((e for e in trace["traceEvents"] if e["cat"] == "user_annotation"), key=lambda e: e["ts"])
        for w in range(0, len(marks), steps_per_window):
            group = marks[w:w + steps_per_window]
            lo, hi = group[0]["ts"] - 1.0, max(e["ts"] + e["dur"] for e in group) + 1.0
            trace["traceEvents"].append({**group[0], "name": f"ProfilerStep#{w // steps_per_window}", "ts": lo, "dur": hi - lo})
    return files


def test_step_annotation_regex_chooses_the_step_ranges(tmp_path, capsys):
    files, truth = make_decode_traces(n_ranks=2, n_steps=6, layers=3, graph=None, profiler_steps="cpu",
                                      step_name="decode_step_{}", step_gap_us=0.0, seed=2)
    d = _write(tmp_path / "traces", _add_profiler_steps(files, 3))
    auto = analyze_path(d, jobs=1)
    assert all(r.n_steps == 2 and "ProfilerStep" in r.step_detail for r in auto.ranks)  # the profiler's own steps
    chosen = analyze_path(d, step_annotation=r"decode_step_\d+", jobs=1)
    for r in chosen.ranks:
        assert r.step_method == "annotation" and r.n_steps == 6 and r.n_complete_steps == 6
        assert [s.time_us for s in r.steps] == pytest.approx(truth.step_time_us[r.rank], rel=1e-6)
    out = tmp_path / "out"
    assert main(["profile", "analyze", str(d), "--out", str(out), "--no-png", "--step-annotation", "decode_step"]) == 0
    assert json.loads((out / "breakdown.json").read_text())["ranks"][0]["n_steps"] == 6
    with pytest.raises(Glm5Fp4Error, match=r"no annotation matches 'prefill_\\d\+'.*decode_step_N \(6x\), ProfilerStep#N \(2x\)"):
        analyze_path(d, step_annotation=r"prefill_\d+", jobs=1)
    with pytest.raises(Glm5Fp4Error, match="--step-annotation"):
        analyze_path(d, step_annotation="(unclosed", jobs=1)


REAL_TP2_EAGER = Path(__file__).resolve().parent / "fixtures" / "profiling" / "traces" / "tp2" / "eager"


def _renamed_real_traces(d, keep_gpu_ranges: bool, unannotated_rank: int | None = None):
    """The real 2-rank eager H200 traces with their ProfilerStep#N ranges renamed decode_step_N (a user's own
    record_function), optionally without the GPU projections or without any ranges on one rank."""
    d.mkdir()
    for f in sorted(REAL_TP2_EAGER.glob("*.json.gz")):
        data = json.loads(gzip.decompress(f.read_bytes()))
        events = []
        for e in data["traceEvents"]:
            if e.get("cat") in ("user_annotation", "gpu_user_annotation") and e["name"].startswith("ProfilerStep#"):
                if f"rank{unannotated_rank}." in f.name or (e["cat"] == "gpu_user_annotation" and not keep_gpu_ranges):
                    continue
                e = {**e, "name": "decode_step_" + e["name"].removeprefix("ProfilerStep#")}
            events.append(e)
        write_trace({**data, "traceEvents": events}, d / f.name)
    return d


@pytest.mark.skipif(not REAL_TP2_EAGER.is_dir(), reason="real H200 trace fixtures not present")
@pytest.mark.parametrize("keep_gpu_ranges,unannotated_rank", [(True, None), (False, None), (True, 1), (False, 0)])
def test_real_h200_traces_with_user_step_names(tmp_path, keep_gpu_ranges, unannotated_rank):
    """Each rank's own ProfilerStep# ranges are the reference: user-named ranges (GPU side or CPU side by launch),
    and steps lined up from the other rank through the collectives, must give the same steps."""
    want = {r.rank: r for r in analyze_path(REAL_TP2_EAGER, jobs=1).ranks}
    got = analyze_path(_renamed_real_traces(tmp_path / "t", keep_gpu_ranges, unannotated_rank), jobs=1)
    for r in got.ranks:
        assert r.step_method == "annotation" and r.steps_reliable
        assert ("lined up" in r.step_detail) == (r.rank == unannotated_rank)
        assert [s.n_kernels for s in r.steps] == [s.n_kernels for s in want[r.rank].steps]
        assert [s.time_us for s in r.steps] == pytest.approx([s.time_us for s in want[r.rank].steps], abs=0.01)
        for key in ("summed_us", "exposed_us"):
            assert r.median_step[key] == pytest.approx(want[r.rank].median_step[key], abs=0.01)


def _strip_gpu_range_ids(files):
    for _, trace in files:
        for e in trace["traceEvents"]:
            if e["cat"] == "gpu_user_annotation":
                e["args"] = {}
    return files


@pytest.mark.parametrize("step_name", ["ProfilerStep#{}", "execute_context_0(0)_generation_8(8)"])
@pytest.mark.parametrize("ids", [True, False])
def test_a_step_range_kineto_split_over_two_streams_is_one_step(tmp_path, step_name, ids):
    """Kineto writes a GPU-side range once per (device, stream): with the sampled tokens' copy on its own stream every
    step's range came in two pieces and each piece became a step (16 steps of 8, median 495 us for 649, idle 40 for
    191). The pieces of one range are one range: by External id where the trace has it, else by name and time."""
    files, truth = make_decode_traces(n_ranks=1, n_steps=8, graph="full", profiler_steps="gpu", step_name=step_name,
                                      copy_stream=9)
    assert sum(e["cat"] == "gpu_user_annotation" for e in files[0][1]["traceEvents"]) == 16
    r = analyze_path(_write(tmp_path, files if ids else _strip_gpu_range_ids(files)), jobs=1).ranks[0]
    assert r.step_method == "annotation" and r.steps_reliable and r.n_steps == 8 and r.n_complete_steps == 8
    assert [s.time_us for s in r.steps] == pytest.approx(truth.step_time_us[0], rel=1e-6)
    assert [s.n_kernels for s in r.steps] == [12 * 3 + 3 + 1] * 8  # the copy is in its step
    assert [s.summed_us["memcpy"] for s in r.steps] == pytest.approx([3.0] * 8)
    assert r.median_step["time_us"] == pytest.approx(truth.step_period_us)
    busy = sum(v for c, v in truth.summed_us[0].items() if c != "allreduce_wait") / 8  # one stream at a time
    assert r.median_step["idle_us"] == pytest.approx(truth.step_period_us - busy, abs=0.01)


@pytest.mark.parametrize("variant", ["around", "inside"])
def test_engine_step_ranges_inside_one_profiler_step_are_the_steps(tmp_path, variant):
    """One prof.step() per generate call puts a single ProfilerStep# around vLLM's per-step execute ranges: it hid them
    (the whole trace one window, per-step figures withheld), or, with a step outside it, gave 2 "steps" of 1 and 7."""
    files, truth = make_decode_traces(n_ranks=1, n_steps=8, graph=None, profiler_steps="both",
                                      step_name="execute_context_0(0)_generation_8(8)", step_gap_us=5.0)
    ev = files[0][1]["traceEvents"]
    for cat, tid in (("user_annotation", 4242), ("gpu_user_annotation", 7)):
        ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e["cat"] == cat)
        lo, hi = ranges[0 if variant == "around" else 1][0] - 1.0, ranges[-1][1] + 1.0
        ev.append({"ph": "X", "cat": cat, "name": "ProfilerStep#0", "pid": 0, "tid": tid, "ts": lo, "dur": hi - lo,
                   "args": {"External id": 1}})
    r = analyze_path(_write(tmp_path, files), jobs=1).ranks[0]
    assert r.step_method == "annotation" and r.steps_reliable and "execute_context" in r.step_detail
    assert r.n_steps == 8 and r.n_complete_steps == 8
    assert [s.time_us for s in r.steps] == pytest.approx(truth.step_time_us[0], rel=1e-6)
