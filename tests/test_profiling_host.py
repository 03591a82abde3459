"""Host side per decode step: the CPU-side record_function ranges of the launching thread, on synthetic traces
whose ranges are placed around each step's graph launch with known durations."""

import gzip
import json

import pytest

from glm5_fp4.cli import main
from glm5_fp4.profiling.breakdown import analyze_path
from glm5_fp4.profiling.report import markdown
from glm5_fp4.profiling.traces import write_trace

from profiling_synthetic import make_decode_traces

THREAD = 4242  # pid and tid of the generator's launch calls on rank 0
N_STEPS = 6


def _ua(name, ts, dur, tid=THREAD):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": THREAD, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": 0}}


def _with_host_ranges(trace: dict) -> dict:
    """An SGLang-like loop around every step's graph launch L (durations in µs, exact in binary):

    run_batch [L-10, +50+2*step] encloses launch_graph [L-2, +10] (holds L) and copy_to_cpu [L+20, +10];
    process_result [L+60, +200+10*step] encloses two poll ranges of 7; prefetch [L'-30, +25] starts before the
    next step's run_batch and ends inside it (L' = the next launch); a range on another thread; one around
    them all, starting before the first step (so in none); three
    python_function events per step."""
    events = trace["traceEvents"]
    launches = sorted(e["ts"] for e in events if e.get("name") == "cudaGraphLaunch")
    assert len(launches) == N_STEPS and min(b - a for a, b in zip(launches, launches[1:])) > 400
    extra = []
    for i, L in enumerate(launches):
        extra += [_ua("run_batch", L - 10, 50 + 2 * i), _ua("launch_graph", L - 2, 10), _ua("copy_to_cpu", L + 20, 10),
                  _ua("process_result", L + 60, 200 + 10 * i), _ua("poll", L + 65, 7), _ua("poll", L + 75, 7),
                  _ua("other_thread_work", L, 300, tid=77)]
        if i + 1 < N_STEPS:
            extra.append(_ua("prefetch", launches[i + 1] - 30, 25))
        extra += [{"ph": "X", "cat": "python_function", "name": f"sglang/srt/managers/scheduler.py({k}): f",
                   "pid": THREAD, "tid": THREAD, "ts": L + 90 + k, "dur": 0.5, "args": {"Python id": k}}
                  for k in range(3)]
    # a range around the whole loop holds every launch: it must not become the start of a step's host side
    extra.append(_ua("serve_forever", launches[0] - 50, launches[-1] + 1000 - (launches[0] - 50)))
    return {**trace, "traceEvents": events + extra}


@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    # ProfilerStep# CPU ranges (on the same thread) mark the steps: they must not show up as host ranges
    files, _ = make_decode_traces(n_ranks=1, n_steps=N_STEPS, layers=3, graph="full", profiler_steps="cpu")
    d = tmp_path_factory.mktemp("hosted")
    (name, trace), = files
    write_trace(_with_host_ranges(trace), d / name)
    return d, analyze_path(d, jobs=1)


def test_per_step_host_times_are_exact(hosted):
    _, b = hosted
    r = b.ranks[0]
    h = r.host
    assert r.step_method == "annotation" and r.n_steps == N_STEPS
    # the last step's host side has no next step to close it: steps 0..4
    assert h["steps_used"] == N_STEPS - 1
    rows = {row["name"]: row for row in h["ranges"]}
    assert [row["name"] for row in h["ranges"]] == [
        "process_result", "run_batch", "prefetch", "poll", "copy_to_cpu", "launch_graph"]
    want = {  # name: (ms/step, self, calls/step)
        "process_result": (220.0, 206.0, 1.0),  # median of 200..240; two polls inside
        "run_batch": (54.0, 34.0, 1.0),  # the run_batch that launched the step's graph, not the next one's
        "prefetch": (25.0, 25.0, 1.0),  # across the boundary: whole duration, in the step it starts in
        "poll": (14.0, 14.0, 2.0),
        "copy_to_cpu": (10.0, 10.0, 1.0),
        "launch_graph": (10.0, 10.0, 1.0),
    }
    for name, (total, own, calls) in want.items():
        got = rows[name]
        assert (got["us_per_step"], got["self_us_per_step"], got["calls_per_step"]) == (total, own, calls), name
        assert got["share_of_step"] == total / r.median_step["time_us"]
    assert set(rows["run_batch"]["encloses"]) == {"launch_graph", "copy_to_cpu"}
    assert rows["process_result"]["encloses"] == ["poll"]
    assert rows["prefetch"]["encloses"] == [] and rows["poll"]["encloses"] == []


def test_only_the_launching_thread_counts_and_profiler_steps_are_left_out(hosted):
    _, b = hosted
    h = b.ranks[0].host
    names = {row["name"] for row in h["ranges"]}
    assert "other_thread_work" not in names and not any(n.startswith("ProfilerStep") for n in names)
    assert h["thread"] == f"pid {THREAD} tid {THREAD}" and h["other_thread_ranges"] == N_STEPS


def test_host_step_and_time_in_no_range(hosted):
    d, b = hosted
    h = b.ranks[0].host
    trace = json.loads(gzip.open(next(d.iterdir())).read())
    launches = sorted(e["ts"] for e in trace["traceEvents"] if e.get("name") == "cudaGraphLaunch")
    periods = [b_ - a for a, b_ in zip(launches, launches[1:])]  # every step's host side starts at L-10
    assert h["host_step_us"] == pytest.approx(sorted(periods)[2], abs=1e-6)
    # in no range: the period minus the top-level ranges run_batch, process_result and prefetch
    gaps = sorted(p - (50 + 2 * i) - (200 + 10 * i) - 25 for i, p in enumerate(periods))
    assert h["outside_ranges_us"] == pytest.approx(gaps[2], abs=1e-6)


def test_report_shows_the_section_and_the_python_tracing_line(hosted, tmp_path, capsys):
    d, b = hosted
    md = markdown(b)
    head = md.index("## Host side per decode step")
    assert md.index("## Median decode step per rank: summed kernel time") < head < md.index("## Whole trace per rank")
    section = md[head:md.index("## Whole trace per rank")]
    assert "| `process_result` | 1 | 0.220 | " in section
    assert "| `run_batch` | 1 | 0.054 | " in section and "| 0.034 | " in section
    line = f"Python tracing was on ({3 * N_STEPS} python_function events): host times are inflated"
    assert line in section and "no host ranges" not in section

    out = tmp_path / "r"
    assert main(["profile", "analyze", str(d), "--out", str(out), "--no-png", "--jobs", "1"]) == 0
    console = capsys.readouterr().out
    assert ("host side per step, ms (rank 0, median of 5): process_result 0.220 (encloses others), "
            "run_batch 0.054 (encloses others), prefetch 0.025") in console
    assert line in console
    data = json.loads((out / "breakdown.json").read_text())
    assert data["ranks"][0]["host"]["ranges"][0]["us_per_step"] == 220.0
    assert line in (out / "breakdown.md").read_text()


def test_trace_without_host_ranges_says_so(tmp_path, capsys):
    files, _ = make_decode_traces(n_ranks=1, n_steps=5, layers=2, graph="full", profiler_steps="cpu")
    for name, trace in files:
        write_trace(trace, tmp_path / name)
    b = analyze_path(tmp_path, jobs=1)
    h = b.ranks[0].host
    assert h["ranges"] == [] and h["python_function_events"] == 0
    section = markdown(b).split("## Host side per decode step")[1].split("## Whole trace")[0]
    assert "- no host ranges in the trace" in section and "Python tracing" not in section
    assert main(["profile", "analyze", str(tmp_path), "--out", str(tmp_path / "r"), "--no-png", "--jobs", "1"]) == 0
    assert "host side (rank 0): no host ranges in the trace" in capsys.readouterr().out
