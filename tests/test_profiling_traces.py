"""Reading Kineto traces: ranks from file names, json / json.gz, and one clear error per bad file."""

import gzip
import json

import numpy as np
import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling.traces import load_rank_traces, load_trace, parse_trace_name, write_trace

from profiling_synthetic import make_decode_traces


def _kernel(name, ts, dur, corr=1, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": corr, "device": 0}}


def _trace(events, **top):
    return {"schemaVersion": 1, "traceEvents": events, **top}


@pytest.mark.parametrize(
    "name,rank,tp,pp,stage",
    [
        ("dp0_pp0_tp3_dcp0_ep0_rank3.1764000000123456789.pt.trace.json.gz", 3, 3, 0, None),
        ("myprefix_dp0_pp1_tp2_dcp0_ep0_rank6.1764000000123.pt.trace.json.gz", 6, 2, 1, None),
        ("1764000000.1-TP-3-DECODE.trace.json.gz", None, 3, 0, "DECODE"),
        ("1764000000.1-TP-2-PP-1-EXTEND.trace.json.gz", None, 2, 1, "EXTEND"),
        ("decode=512x1@4096.rank5.trace.json.gz", 5, None, None, None),
        ("bs_32_rank1.json.gz", 1, None, None, None),
        ("trace.json", None, None, None, None),
    ],
)
def test_rank_from_file_names(name, rank, tp, pp, stage):
    parsed = parse_trace_name(name)
    assert (parsed.rank, parsed.tp, parsed.pp, parsed.stage) == (rank, tp, pp, stage)


def test_json_and_gz_load_the_same(tmp_path):
    files, _ = make_decode_traces(n_ranks=1, n_steps=3, layers=2)
    name, trace = files[0]
    a = load_trace(write_trace(trace, tmp_path / name))
    b = load_trace(write_trace(trace, tmp_path / name.removesuffix(".gz")))
    kernels = [e for e in trace["traceEvents"] if e["cat"] in ("kernel", "gpu_memcpy")]
    assert a.n_kernels == b.n_kernels == len(kernels)
    np.testing.assert_allclose(a.dur.sum(), sum(e["dur"] for e in kernels))
    np.testing.assert_array_equal(a.start, b.start)
    assert a.mode == "gpu" and a.device_name == "NVIDIA H200"


def test_ranks_across_naming_schemes(tmp_path):
    # SGLang names with a PP stage: global rank = pp * tp_size + tp
    for tp in range(2):
        for pp in range(2):
            write_trace(_trace([_kernel("k", 10.0, 1.0)]), tmp_path / f"77-TP-{tp}-PP-{pp}.trace.json.gz")
    traces, _ = load_rank_traces(tmp_path)
    assert [(t.rank, t.tp_rank, t.pp_rank) for t in traces] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]


def test_rank_from_distributed_info_then_file_order(tmp_path):
    write_trace(_trace([_kernel("k", 1.0, 1.0)], distributedInfo={"rank": 1}), tmp_path / "a.json")
    write_trace(_trace([_kernel("k", 1.0, 1.0)], distributedInfo={"rank": 0}), tmp_path / "b.json")
    traces, _ = load_rank_traces(tmp_path)
    assert [(t.rank, t.path.name, t.rank_source) for t in traces] == [(0, "b.json", "distributedInfo"), (1, "a.json", "distributedInfo")]


def test_duplicate_rank_is_an_error_naming_both_files(tmp_path):
    for name in ("x_rank0.trace.json", "y_rank0.trace.json"):
        write_trace(_trace([_kernel("k", 1.0, 1.0)]), tmp_path / name)
    with pytest.raises(Glm5Fp4Error, match="rank 0.*x_rank0.*y_rank0"):
        load_rank_traces(tmp_path)


def test_sglang_stage_selection(tmp_path):
    write_trace(_trace([_kernel("decode_k", 1.0, 1.0)]), tmp_path / "9-TP-0-DECODE.trace.json.gz")
    write_trace(_trace([_kernel("extend_k", 1.0, 1.0)]), tmp_path / "9-TP-0-EXTEND.trace.json.gz")
    traces, notes = load_rank_traces(tmp_path)
    assert [t.names for t in traces] == [["decode_k"]] and "DECODE" in notes[0]
    traces, _ = load_rank_traces(tmp_path, stage="EXTEND")
    assert traces[0].names == ["extend_k"]


def test_non_trace_json_next_to_traces_is_ignored(tmp_path):
    write_trace(_trace([_kernel("k", 1.0, 1.0)]), tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz")
    (tmp_path / "breakdown.json").write_text("{}")
    (tmp_path / "case.rank0.kernels.json").write_text("[]")
    traces, _ = load_rank_traces(tmp_path)
    assert len(traces) == 1


def test_cpu_only_trace_uses_cpu_ops(tmp_path):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 1, "tid": 1, "ts": 5.0, "dur": 3.0},
        {"ph": "X", "cat": "cpu_op", "name": "vllm::unified_mla_attention_with_output", "pid": 1, "tid": 1, "ts": 9.0, "dur": 4.0},
        {"ph": "X", "cat": "python_function", "name": "forward", "pid": 1, "tid": 1, "ts": 1.0, "dur": 20.0},
    ]
    t = load_trace(write_trace(_trace(events), tmp_path / "cpu.json"))
    assert t.mode == "cpu" and t.device_name == "CPU" and sorted(t.names) == ["aten::addmm", "vllm::unified_mla_attention_with_output"]
    with pytest.raises(Glm5Fp4Error, match="no GPU kernel records"):
        load_trace(tmp_path / "cpu.json", mode="gpu")


def _good_bytes():
    files, _ = make_decode_traces(n_ranks=1, n_steps=2, layers=1)
    return json.dumps(files[0][1]).encode()


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("empty.json", b"", "empty trace file"),
        ("blank.json", b"   \n", "empty trace file"),
        ("truncated.json", _good_bytes()[: len(_good_bytes()) // 2], "corrupt or truncated trace JSON"),
        ("truncated.json.gz", gzip.compress(_good_bytes())[: len(gzip.compress(_good_bytes())) // 2], "corrupt or truncated gzip"),
        ("garbage.json.gz", b"this is not gzip at all", "not gzip"),
        ("empty.json.gz", gzip.compress(b""), "empty trace"),
        ("other.json", b'{"hello": 1}', "no 'traceEvents' list"),
        ("noevents.json", b'{"traceEvents": []}', "no events"),
        ("nothing.json", json.dumps({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 0}]}).encode(), "no GPU kernels and no CPU ops"),
    ],
)
def test_bad_trace_files_give_one_clear_error_naming_the_file(tmp_path, name, content, needle):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(Glm5Fp4Error) as err:
        load_trace(p)
    msg = str(err.value)
    assert str(p) in msg and needle in msg
    assert "\n" not in msg  # one line, no traceback text


def test_bad_file_among_good_ones_is_named(tmp_path):
    files, _ = make_decode_traces(n_ranks=2, n_steps=2, layers=1)
    write_trace(files[0][1], tmp_path / files[0][0])
    bad = tmp_path / files[1][0]
    bad.write_bytes(gzip.compress(json.dumps(files[1][1]).encode())[:-200])
    with pytest.raises(Glm5Fp4Error, match=bad.name):
        load_rank_traces(tmp_path, jobs=1)


def test_missing_directory_and_empty_directory(tmp_path):
    with pytest.raises(Glm5Fp4Error, match="no such trace file or directory"):
        load_rank_traces(tmp_path / "nope")
    with pytest.raises(Glm5Fp4Error, match="no .json or .json.gz trace files"):
        load_rank_traces(tmp_path)


def test_trim_keeps_what_the_analysis_reads(tmp_path):
    from glm5_fp4.profiling.breakdown import analyze_path
    from glm5_fp4.profiling.traces import trim_trace

    files, _ = make_decode_traces(n_ranks=2, n_steps=4, layers=2, graph="breakable", profiler_steps="cpu", target_bytes=400_000)
    full, small = tmp_path / "full", tmp_path / "small"
    full.mkdir()
    small.mkdir()
    for name, trace in files:
        write_trace(trace, full / name)
        kept, total = trim_trace(full / name, small / name)
        assert kept < total
        assert (small / name).stat().st_size < (full / name).stat().st_size / 2
    a, b = analyze_path(full, jobs=1), analyze_path(small, jobs=1)
    for x, y in zip(a.ranks, b.ranks):
        assert x.summed_us == y.summed_us and x.allreduce == y.allreduce
        assert (x.step_method, x.n_steps) == (y.step_method, y.n_steps) == ("annotation", 4)


def test_cpu_run_steps_follow_vllm_execute_annotations(tmp_path):
    """A CPU run has no launches to correlate: each `execute_context_*_generation_*` annotation starts a step."""
    import random

    from glm5_fp4.profiling.breakdown import analyze_path

    rng = random.Random(7)
    events, t = [], 0.0
    durations = []
    for step in range(5):
        start = t
        for _ in range(rng.randint(3, 8)):
            d = rng.uniform(5, 50)
            events.append({"ph": "X", "cat": "cpu_op", "name": rng.choice(["aten::addmm", "_C::cpu_fused_moe"]),
                           "pid": 1, "tid": 1, "ts": t + 1, "dur": d})
            t += d + 2
        events.append({"ph": "X", "cat": "user_annotation", "name": f"execute_context_0(0)_generation_4({step})",
                       "pid": 1, "tid": 1, "ts": start, "dur": t - start})
        durations.append(t - start)
        t += 1  # back to back: no idle gap a gap-based split could use
    d = tmp_path / "traces"
    d.mkdir()
    write_trace(_trace(events), d / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json")
    b = analyze_path(d)
    r = b.ranks[0]
    assert r.step_method == "annotation" and r.n_steps == 5
    assert r.n_complete_steps == 5  # the last annotation closed: the last step is complete too
    assert r.median_step["time_us"] == pytest.approx(sorted(durations)[2], rel=0.15)


def _steps(path):
    from glm5_fp4.profiling.breakdown import analyze_path

    return [(r.step_method, r.steps_reliable, [(s.start_us, s.time_us, s.n_kernels) for s in r.steps])
            for r in analyze_path(path, jobs=1).ranks]


def _cpu_run_events():
    events = []
    for step in range(4):
        t = 1000.0 * step
        events.append({"ph": "X", "cat": "user_annotation", "name": f"execute_context_0(0)_generation_4({step})",
                       "pid": 1, "tid": 1, "ts": t, "dur": 60.0})
        events += [{"ph": "X", "cat": "cpu_op", "name": n, "pid": 1, "tid": 1, "ts": t + o, "dur": 20.0}
                   for n, o in (("aten::addmm", 1.0), ("_C::cpu_fused_moe", 30.0))]
    return events


@pytest.mark.parametrize("case", ["profiler steps as cpu_op", "cpu run"])
def test_a_trimmed_trace_analyses_as_the_full_one(tmp_path, case):
    """Older torch writes ProfilerStep# as cpu_op, and a CPU run's cpu_ops are its kernels; trim dropped every cpu_op,
    so the trimmed GPU trace fell back to other steps and the trimmed CPU run could not be read at all."""
    from glm5_fp4.profiling.traces import trim_trace

    if case == "cpu run":
        name, trace = "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz", _trace(_cpu_run_events())
    else:
        files, _ = make_decode_traces(n_ranks=1, n_steps=6, layers=2, graph=None, profiler_steps="cpu",
                                      step_gap_us=0.0, target_bytes=300_000)
        name, trace = files[0]
        for e in trace["traceEvents"]:
            if e["cat"] == "user_annotation":
                e["cat"] = "cpu_op"
    full, small = tmp_path / "full", tmp_path / "small"
    full.mkdir()
    small.mkdir()
    write_trace(trace, full / name)
    kept, total = trim_trace(full / name, small / name)
    assert kept < total or case == "cpu run"
    want = _steps(full)
    assert want[0][0] == "annotation" and want[0][1]
    assert _steps(small) == want


@pytest.mark.parametrize("value", ["abc", [1], {"ns": 1}, True, "12:00"])
def test_a_bad_clock_origin_is_named(tmp_path, value):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(_trace([_kernel("k", 1.0, 1.0)], baseTimeNanoseconds=value)))
    with pytest.raises(Glm5Fp4Error) as err:
        load_trace(p)
    assert str(p) in str(err.value) and "baseTimeNanoseconds" in str(err.value)


def test_a_good_clock_origin_is_kept(tmp_path):
    for value, want in ((1_764_000_000_000_000_000, 1_764_000_000_000_000_000), ("5000", 5000), (None, 0)):
        p = write_trace(_trace([_kernel("k", 2.0, 1.0)], baseTimeNanoseconds=value), tmp_path / "t.json")
        assert load_trace(p).origin_ns == want + 2000


def test_every_gzip_member_is_read(tmp_path):
    """zlib read only a multi-member gzip's first member: the other members' events were dropped without a word."""
    files, _ = make_decode_traces(n_ranks=1, n_steps=3, layers=1)
    name, trace = files[0]
    whole = load_trace(write_trace(trace, tmp_path / name))
    text = json.dumps(trace).encode()
    cut = len(text) // 2
    split = tmp_path / "split" / name
    split.parent.mkdir()
    split.write_bytes(gzip.compress(text[:cut]) + gzip.compress(text[cut:]))
    t = load_trace(split)
    assert t.n_kernels == whole.n_kernels
    np.testing.assert_array_equal(t.start, whole.start)
    two = tmp_path / "two.json.gz"  # two whole traces, one after the other: no JSON, said so
    two.write_bytes(gzip.compress(text) + gzip.compress(text))
    with pytest.raises(Glm5Fp4Error, match=f"{two}: corrupt or truncated trace JSON"):
        load_trace(two)
