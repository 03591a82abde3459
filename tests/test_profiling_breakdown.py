"""The decode-time breakdown on synthetic multi-rank traces whose ground truth is known."""

import pytest

from glm5_fp4.profiling.breakdown import analyze_path
from glm5_fp4.profiling.traces import write_trace

from profiling_synthetic import MOE_GEMM1, UNKNOWN, make_decode_traces


def _write(tmp_path, files):
    for name, trace in files:
        write_trace(trace, tmp_path / name)
    return tmp_path


def _raw_kernel_time(trace):
    return sum(e["dur"] for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """3 ranks, rank 1 slower in its expert GEMMs, full CUDA graphs, a copy hidden on a side stream."""
    files, truth = make_decode_traces(n_ranks=3, n_steps=7, layers=3, graph="full", slow_rank=1, slow_factor=1.6,
                                      side_stream_copy=True, jitter_us=0.7, seed=3)
    d = _write(tmp_path_factory.mktemp("skewed"), files)
    return files, truth, analyze_path(d, jobs=1)


def test_categories_sum_to_total_kernel_time(skewed):
    files, _, b = skewed
    raw = {int(name.split("rank")[1].split(".")[0]): _raw_kernel_time(t) for name, t in files}
    for r in b.ranks:
        assert sum(r.summed_us.values()) == pytest.approx(raw[r.rank], rel=1e-9)
        assert r.total_kernel_us == pytest.approx(raw[r.rank], rel=1e-9)
        for s in r.steps:  # per step, too
            assert sum(s.summed_us.values()) > 0


def test_summed_time_per_category_matches_the_generator(skewed):
    _, truth, b = skewed
    for r in b.ranks:
        for cat, want in truth.summed_us[r.rank].items():
            assert r.summed_us[cat] == pytest.approx(want, abs=0.05), (r.rank, cat)


def test_allreduce_found_on_every_rank(skewed):
    _, truth, b = skewed
    for r in b.ranks:
        assert r.allreduce["kernels"] == truth.allreduce_kernels[r.rank] > 0
        assert r.allreduce["matched"] == r.allreduce["kernels"]
        assert r.median_step["summed_us"]["allreduce"] > 0


def test_rank_skew_shows_as_wait_not_work(skewed):
    _, truth, b = skewed
    by_rank = {r.rank: r for r in b.ranks}
    assert by_rank[1].allreduce["wait_us"] == pytest.approx(truth.wait_us[1], abs=0.05)
    assert truth.wait_us[1] < 0.1 * truth.wait_us[0]  # the slow rank hardly waits (only jitter)
    for rank in (0, 2):
        assert by_rank[rank].allreduce["wait_us"] == pytest.approx(truth.wait_us[rank], abs=0.05)
        assert by_rank[rank].median_step["exposed_us"]["allreduce_wait"] > 0
    # the collective's own work is the same on every rank: only the waiting differs
    works = [r.allreduce["work_us"] for r in b.ranks]
    assert max(works) - min(works) < 0.05
    assert b.across_ranks["slowest_rank"] == 1


def test_exposed_time_plus_idle_is_the_step(skewed):
    _, truth, b = skewed
    for r in b.ranks:
        for s in r.steps:
            assert sum(s.exposed_us.values()) + s.idle_us == pytest.approx(s.time_us, rel=1e-9)
            for cat in s.summed_us:
                assert s.exposed_us[cat] <= s.summed_us[cat] + 1e-9
        assert r.median_step["time_us"] == pytest.approx(truth.step_period_us, rel=0.01)


def test_copy_hidden_under_compute_is_not_exposed(skewed):
    _, truth, b = skewed
    for r in b.ranks:
        hidden = truth.overlap_memcpy_us[r.rank]
        assert hidden > 0
        assert r.exposed_us["memcpy"] == pytest.approx(r.summed_us["memcpy"] - hidden, abs=0.05)


def test_exposed_time_by_hand(tmp_path):
    """Two streams: expert GEMM [0,100); copy [20,50) and all-reduce [90,130) on another; norm [130,140)."""
    def k(name, ts, dur, stream, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                "args": {"stream": stream, "correlation": int(ts) + 1}}

    events = [
        k("glm5_fp4_moe_gemm1_kernel", 1000.0, 100.0, 7),
        k("Memcpy HtoD (Pinned -> Device)", 1020.0, 30.0, 9, "gpu_memcpy"),
        k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 1090.0, 40.0, 9),
        k("void vllm::rms_norm_kernel<c10::BFloat16>(...)", 1130.0, 10.0, 7),
    ]
    write_trace({"traceEvents": events}, tmp_path / "one.json")
    r = analyze_path(tmp_path, jobs=1).ranks[0]
    assert r.summed_us["expert_gemm"] == 100 and r.summed_us["memcpy"] == 30 and r.summed_us["allreduce"] == 40
    assert r.exposed_us["expert_gemm"] == 100
    assert r.exposed_us["memcpy"] == 0  # hidden under the GEMM
    assert r.exposed_us["allreduce"] == 30  # 100..130: only its tail is exposed
    assert r.exposed_us["other"] == 10
    assert r.idle_us == 0 and r.trace_window_us == 140


@pytest.mark.parametrize("graph", ["full", "breakable"])
def test_graph_replays_without_cpu_ops_are_split_into_steps(tmp_path, graph):
    files, truth = make_decode_traces(n_ranks=2, n_steps=6, layers=4, graph=graph, step_gap_us=5.0, seed=1)
    for _, t in files:
        assert not any(e["cat"] in ("cpu_op", "user_annotation") for e in t["traceEvents"])
    b = analyze_path(_write(tmp_path, files), jobs=1)
    for r in b.ranks:
        assert r.step_method == "graph"
        assert r.n_steps == 6
        assert r.median_step["time_us"] == pytest.approx(truth.step_period_us, rel=0.01)


@pytest.mark.parametrize("where", ["cpu", "gpu"])
def test_profiler_step_annotations(tmp_path, where):
    files, truth = make_decode_traces(n_ranks=1, n_steps=5, layers=2, graph="full", profiler_steps=where)
    r = analyze_path(_write(tmp_path, files), jobs=1).ranks[0]
    assert r.step_method == "annotation" and r.n_steps == 5
    assert r.median_step["time_us"] == pytest.approx(truth.step_period_us, rel=0.01)


def test_eager_steps_from_idle_gaps(tmp_path):
    files, truth = make_decode_traces(n_ranks=1, n_steps=6, layers=3, graph=None, step_gap_us=120.0, launch_gap_us=4.0)
    d = _write(tmp_path, files)
    r = analyze_path(d, jobs=1).ranks[0]
    assert r.step_method == "gap" and r.n_steps == 6
    assert r.median_step["time_us"] == pytest.approx(truth.step_period_us, rel=0.01)
    # a given threshold below the launch gaps splits every kernel apart; one above the step gap finds none
    assert analyze_path(d, step_method="gap", step_gap_us=3.0, jobs=1).ranks[0].n_steps > 6
    assert analyze_path(d, step_method="gap", step_gap_us=10_000.0, jobs=1).ranks[0].n_steps == 1


def test_different_trace_windows_and_clock_offsets(tmp_path):
    """Rank 1 starts profiling one step late; rank 2's clock is 5 ms ahead: collectives still line up."""
    files, truth = make_decode_traces(n_ranks=3, n_steps=6, layers=2, graph="full", slow_rank=2,
                                      first_step={1: 1}, clock_offset_us={2: 5000.0}, seed=4)
    b = analyze_path(_write(tmp_path, files), jobs=1)
    by_rank = {r.rank: r for r in b.ranks}
    per_step = truth.allreduce_kernels[1] // 5
    assert b.collective_groups[0]["matched_instances"] == 5 * per_step
    assert by_rank[0].allreduce["matched"] == 5 * per_step < by_rank[0].allreduce["kernels"]
    # over the matched steps (1..5) the wait is exact
    assert by_rank[0].allreduce["wait_us"] == pytest.approx(sum(truth.wait_by_step[0][1:]), abs=0.05)
    assert by_rank[1].allreduce["wait_us"] == pytest.approx(sum(truth.wait_by_step[1][1:]), abs=0.05)
    assert by_rank[2].allreduce["clock_skew_us"] == pytest.approx(5000.0, abs=0.01)
    assert by_rank[0].allreduce["clock_skew_us"] == 0.0


def test_unknown_kernels_are_listed_not_dropped(skewed):
    _, truth, b = skewed
    for r in b.ranks:
        names = {u.name: u for u in r.unknown_kernels}
        assert set(names) == {UNKNOWN}
        assert names[UNKNOWN].count == truth.steps_in_trace[r.rank]
        assert names[UNKNOWN].total_us > 0
        assert any(row.name == MOE_GEMM1 for row in r.top_kernels["expert_gemm"])


def test_cpu_run_uses_cpu_ops_without_double_counting_nesting(tmp_path):
    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    events = []
    for step in range(4):
        t = 1000.0 * step
        events += [
            op("aten::linear", t, 10.0), op("aten::addmm", t + 1, 8.0),  # nested: 10 µs of GEMM, not 18
            op("vllm::unified_mla_attention_with_output", t + 10, 10.0), op("aten::bmm", t + 11, 8.0),
            op("_C::cpu_fused_moe", t + 20, 30.0),
            op("aten::add", t + 50, 2.0),
        ]
    write_trace({"traceEvents": events}, tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz")
    b = analyze_path(tmp_path, jobs=1)
    r = b.ranks[0]
    assert b.mode == "cpu" and r.device_name == "CPU"
    assert r.n_steps == 4 and r.median_step["time_us"] == pytest.approx(1000.0)
    ms = r.median_step
    # summed = the union of each category's ops: linear+addmm count 10 µs, the bmm inside attention 8 more
    assert ms["summed_us"]["other_gemm"] == pytest.approx(18.0)
    assert ms["exposed_us"]["other_gemm"] == pytest.approx(10.0)
    assert ms["exposed_us"]["attention"] == pytest.approx(10.0)  # the bmm inside attention counts as attention
    assert ms["exposed_us"]["expert_gemm"] == pytest.approx(30.0)
    assert ms["exposed_us"]["other"] == pytest.approx(2.0)
    assert ms["idle_us"] == pytest.approx(1000.0 - 52.0)


def test_the_median_steps_parts_add_up_to_its_time(tmp_path):
    """Ranks stalling in alternate steps: rank 0 idles while rank 1 waits in its all-reduce and the other way round.
    A per-category median over steps dropped the 400 us wait from every category (its median is 0) while the median
    step kept it: the parts summed to 649 of 849 us. The median step is now one real step, so exposed + idle = time,
    and it is a step of the median's time."""
    holds = {(0, 1): 400, (0, 3): 400, (0, 5): 400, (1, 2): 400, (1, 4): 400, (1, 6): 400}
    files, _ = make_decode_traces(n_ranks=2, n_steps=8, graph="full", profiler_steps="gpu", hold_us=holds)
    b = analyze_path(_write(tmp_path, files), jobs=1)
    for r in b.ranks:
        ms = r.median_step
        assert sum(ms["exposed_us"].values()) + ms["idle_us"] == pytest.approx(ms["time_us"], rel=1e-9), r.rank
        times = sorted(s.time_us for s in r.steps if not s.partial)
        assert ms["time_us"] == times[(len(times) - 1) // 2]
        step = r.steps[ms["step_index"]]
        assert step.time_us == ms["time_us"] and step.exposed_us == ms["exposed_us"]


@pytest.mark.parametrize("n_steps", [2, 3, 8])
def test_few_complete_steps_are_said_and_get_no_p90(tmp_path, n_steps):
    """A median over one or two steps is that step; a p90 over fewer than five is the maximum. Both were printed as if
    from a distribution: now the count is said in a note and the p90 is left out."""
    files, _ = make_decode_traces(n_ranks=1, n_steps=n_steps, graph="full", profiler_steps="gpu")
    r = analyze_path(_write(tmp_path, files), jobs=1).ranks[0]
    few = [n for n in r.notes if "complete step" in n and "--steps" in n]
    if r.n_complete_steps < 3:
        assert few and f"only {r.n_complete_steps} complete step" in few[0], r.notes
    else:
        assert not few, r.notes
    assert (r.p90_step_time_us is None) == (r.n_complete_steps < 5)


def test_vllm_steps_that_carried_prefill_are_left_out_of_the_median_step(tmp_path):
    """vLLM names each forward `execute_context_<prefill reqs>(<tokens>)_generation_<decode reqs>(<tokens>)`: steps
    with a prefill chunk are not decode steps. 3 of 5 mixed steps (700 us) made the "median decode step" 700 us while
    the decode steps took 130; the counts are now read from the name and the median step is a decode-only one."""
    ev, t, corr = [], 0.0, 1
    plan = [(0, 8, 100, 20), (1, 7, 400, 300), (0, 8, 100, 20), (1, 7, 400, 300), (1, 7, 400, 300), (0, 8, 100, 20)]
    for i, (ctx, gen, expert, attn) in enumerate(plan):
        s = t
        for name, dur in (("flash_mla_decode_kernel", attn), (MOE_GEMM1, expert)):
            ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": t, "dur": dur,
                       "args": {"stream": 7, "correlation": corr, "device": 0}})
            t, corr = t + dur, corr + 1
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"execute_context_{ctx}({ctx * 2000})_generation_"
                   f"{gen}({gen})", "pid": 0, "tid": 1, "ts": s, "dur": t - s})
        t += 10
    write_trace({"traceEvents": ev, "deviceProperties": [{"name": "NVIDIA H200"}]},
                tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz")
    r = analyze_path(tmp_path, jobs=1).ranks[0]
    assert r.median_step["time_us"] == pytest.approx(130.0)
    assert [s.batch["prefill_reqs"] for s in r.steps if s.batch] == [0, 1, 0, 1, 1, 0]
    assert any("3 of 6 complete steps carried prefill" in n for n in r.notes), r.notes


def test_a_file_with_kernels_of_several_gpus_is_refused(tmp_path):
    """One process driving two GPUs writes both into one file; merged onto one timeline their kernel times added up
    and each GPU's idle time vanished (a 200 us step, 0 idle, for two GPUs half busy). Refused, naming the GPUs."""
    ev = []
    for step in range(4):
        for dev, offset in ((0, 0.0), (1, 50.0)):
            ev.append({"ph": "X", "cat": "kernel", "name": MOE_GEMM1, "pid": dev, "tid": 7, "ts": 200.0 * step + offset,
                       "dur": 50.0, "args": {"stream": 7, "correlation": 10 * step + dev, "device": dev}})
    write_trace({"traceEvents": ev}, tmp_path / "trace.json")
    with pytest.raises(Exception, match=r"kernels of 2 GPUs \(devices 0, 1\)"):
        analyze_path(tmp_path, jobs=1)


def test_a_broad_pattern_catching_much_of_the_time_is_flagged(tmp_path):
    """A new MoE GEMM family (say `trtllm_moe_new_kernel`) matches the routing catch-all 'moe|expert' before it can be
    called unknown: filed under other / moe_routing with "Unknown kernels: None". Families the taxonomy marks small
    (max_share) that take more of the kernel time than that are named in a note."""
    ev, t = [], 0.0
    for step in range(4):
        for i, (name, dur) in enumerate((("trtllm_moe_new_kernel", 300.0), ("flash_mla_decode_kernel", 100.0),
                                         ("moe_align_block_size_kernel", 5.0))):
            ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": t, "dur": dur,
                       "args": {"stream": 7, "correlation": 10 * step + i, "device": 0}})
            t += dur
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{step}", "pid": 0, "tid": 1,
                   "ts": t - 405.0, "dur": 405.0})
        t += 20.0
    write_trace({"traceEvents": ev}, tmp_path / "trace.json")
    r = analyze_path(tmp_path, jobs=1).ranks[0]
    flagged = [n for n in r.notes if "moe_routing" in n]
    assert flagged and "trtllm_moe_new_kernel" in flagged[0] and "74%" in flagged[0], r.notes
    assert "--taxonomy" in flagged[0]


def test_when_every_step_carried_prefill_the_median_step_says_so(tmp_path):
    ev, t, corr = [], 0.0, 1
    for i in range(4):
        s = t
        ev.append({"ph": "X", "cat": "kernel", "name": MOE_GEMM1, "pid": 0, "tid": 7, "ts": t, "dur": 100.0,
                   "args": {"stream": 7, "correlation": corr, "device": 0}})
        t, corr = t + 100.0, corr + 1
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": "execute_context_1(512)_generation_7(7)",
                   "pid": 0, "tid": 1, "ts": s, "dur": t - s})
        t += 10
    write_trace({"traceEvents": ev}, tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz")
    r = analyze_path(tmp_path, jobs=1).ranks[0]
    assert any("all 4 complete steps carried prefill" in n for n in r.notes), r.notes


def test_steps_some_rank_did_not_capture_are_said_and_left_out_of_the_median(tmp_path):
    """Rank 1's trace starts 3 steps late: rank 0's first 3 steps' all-reduces have no counterpart, so their wait
    cannot be told from work (it counts as work). Rank 1 stalls in steps 3-5, making them rank 0's long ones: the
    median step (the lower middle by time) fell on a step whose all-reduce wait was unknown."""
    files, truth = make_decode_traces(n_ranks=2, n_steps=6, layers=2, graph="full", first_step={1: 3},
                                      hold_us={(1, 3): 300.0, (1, 4): 300.0, (1, 5): 300.0}, seed=5)
    b = analyze_path(_write(tmp_path, files), jobs=1)
    r0 = next(r for r in b.ranks if r.rank == 0)
    assert r0.n_steps == 6
    unknown = [s.index for s in r0.steps if s.allreduce_unmatched]
    assert unknown == [0, 1, 2]
    assert r0.median_step["step_index"] in (3, 4, 5)
    said = [n for n in b.notes + r0.notes if "rank 0" in n and "counted as work" in n]
    assert said and "3 of 6 steps" in said[0], b.notes + r0.notes
    r1 = next(r for r in b.ranks if r.rank == 1)
    assert not any(s.allreduce_unmatched for s in r1.steps)
