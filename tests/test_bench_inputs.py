"""What the MoE benchmarks are asked to measure, checked before and around the GPU work (no GPU, no kernel): shard
names and token counts refused up front, skewed routings that load the measured rank of an expert-parallel shard,
expert-parallel calls counted over the local experts, rows and sweep points with no local work marked instead of
timed, the L2 layer rule in every script, the sweep's exit status and what --plans accepts."""

from __future__ import annotations

import json

import pytest
import torch
from script_modules import load_script

from glm5_fp4.bench import moe as B
from glm5_fp4.bench import routing as R
from glm5_fp4.bench.experts import nvfp4_weight_bytes
from glm5_fp4.errors import Glm5Fp4Error

MB = 1024**2


@pytest.fixture(scope="module")
def mk():
    return load_script("benchmarks/moe_kernel.py", "moe_kernel_bench")


# -- shard names and token counts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,why", [
    ("tpx", "tpN or epN"), ("dp8", "tpN or epN"), ("tp", "tpN or epN"), ("tp-2", "tpN or epN"),
    ("tp0", "I=2048"), ("tp3", "16-element"), ("tp256", "16-element"),  # 682.7 and 8 columns: no whole NVFP4 blocks
    ("ep0", "256 experts"), ("ep3", "256 experts"), ("ep512", "256 experts"),
])
def test_a_shard_that_glm5_cannot_have_is_one_clear_error(name, why):
    with pytest.raises(Glm5Fp4Error) as e:
        B.glm5_shard(name)
    assert repr(name) in str(e.value) and why in str(e.value)


@pytest.mark.parametrize("name,experts,inter", [("tp8", 256, 256), ("tp4", 256, 512), ("tp1", 256, 2048),
                                                ("tp128", 256, 16), ("ep8", 32, 2048), ("ep256", 1, 2048)])
def test_the_shards_glm5_can_have(name, experts, inter):
    sh = B.glm5_shard(name)
    assert (sh.num_experts, sh.intermediate, sh.global_experts) == (experts, inter, 256)


@pytest.mark.parametrize("text,culprit", [("1,0", "0"), ("4,-1", "-1"), ("1,x", "'x'"), ("", "no token count"),
                                          ("2.5", "'2.5'")])
def test_token_counts_are_whole_and_positive(text, culprit):
    with pytest.raises(Glm5Fp4Error) as e:
        B.token_counts(text)
    assert culprit in str(e.value)
    assert B.token_counts("1,4,8192") == [1, 4, 8192]


def test_the_table_refuses_every_bad_value_before_it_measures(monkeypatch):
    """'tp8,tpx' measured tp8 (ceilings, layers, rows) and then died on tpx with a traceback."""
    def measured(*a, **k):
        raise AssertionError("measured before the inputs were checked")

    monkeypatch.setattr(B, "copy_bandwidth_gbs", measured)
    monkeypatch.setattr(B, "make_layers", measured)
    for shards, tokens, routings, culprit in ((["tp8", "tpx"], [1], ["balanced"], "'tpx'"),
                                              (["tp8"], [1, 0], ["balanced"], "0"),
                                              (["tp8"], [1], ["balanced", "nope"], "'nope'")):
        with pytest.raises(Glm5Fp4Error, match=culprit):
            B.run_table(shards, tokens, routings, layers=1, marlin=False, baselines=False, device="cpu")


@pytest.mark.parametrize("script,argv,culprit", [
    ("benchmarks/moe_kernel.py", ["--shards", "tp8,tpx"], "tpx"),
    ("benchmarks/moe_kernel.py", ["--shards", "tp3"], "tp3"),
    ("benchmarks/moe_kernel.py", ["--tokens", "0"], "0"),
    ("benchmarks/moe_kernel.py", ["--routings", "balanced,nope"], "nope"),
    ("benchmarks/moe_kernel.py", ["--sweep", "--sweep-routing", "nope"], "nope"),
    ("benchmarks/moe_kernel.py", ["--layers", "0"], "--layers"),
    ("benchmarks/moe_variants.py", ["--shards", "ep3"], "ep3"),
    ("benchmarks/moe_variants.py", ["--tokens", "1,x"], "'x'"),
    ("benchmarks/small_t_floor.py", ["--shard", "tp0"], "tp0"),
    ("benchmarks/small_t_floor.py", ["--tokens", "-1"], "-1"),
    ("benchmarks/small_t_floor.py", ["--shard", "ep8"], "ep8"),  # its kernel reads experts by the router's ids
])
def test_scripts_refuse_bad_values_before_any_gpu_work(capsys, script, argv, culprit):
    mod = load_script(script, "bench_script_" + script.split("/")[-1][:-3])
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and culprit in err and "Traceback" not in err, err


@pytest.mark.parametrize("script", ["benchmarks/moe_kernel.py", "benchmarks/moe_variants.py",
                                    "benchmarks/small_t_floor.py"])
def test_scripts_refuse_a_commit_override_that_names_no_commit(monkeypatch, capsys, script):
    monkeypatch.setenv("GLM5_FP4_GIT_SHA", "abc")
    mod = load_script(script, "bench_script_" + script.split("/")[-1][:-3])
    with pytest.raises(SystemExit) as e:
        mod.main([])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "GLM5_FP4_GIT_SHA='abc'" in err and "Traceback" not in err, err


# -- skewed routings on an expert-parallel shard ----------------------------------------------------------------------
@pytest.mark.parametrize("name", R.SKEWED)
def test_skewed_routings_put_their_hot_experts_on_the_measured_rank(name):
    """The measured rank holds experts 0..31 of 256 (EP8): its worst case is every hot expert being its own. Drawn over
    all 256, same_k left it with nothing in about a third of the draws."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        w, ids = R.make_routing(name, 64, 256, 8, gen, hot_experts=32)
        loads = R.loads(ids, 256)
        assert int(loads.argmax()) < 32, name  # the busiest expert is the rank's
        assert torch.allclose(w.sum(-1), torch.full((64,), 2.5)) and (ids.sort(-1).values.diff(dim=-1) > 0).all()
        if name == "same_k":
            assert (ids < 32).all()
        if name == "one_hot":
            assert (ids[:, :1] == ids[0, 0]).all() and int(ids[0, 0]) < 32


def test_same_k_on_a_rank_with_fewer_experts_than_k_takes_them_all():
    _, ids = R.make_routing("same_k", 5, 256, 8, torch.Generator().manual_seed(1), hot_experts=4)
    assert set(range(4)) <= set(ids[0].tolist()) and (ids == ids[0]).all()


def test_hot_experts_must_be_some_of_the_experts():
    for bad in (0, 257):
        with pytest.raises(Glm5Fp4Error, match="hot_experts"):
            R.make_routing("same_k", 4, 256, 8, hot_experts=bad)


def test_the_tensor_parallel_draws_are_unchanged():
    """Hot experts only move where asked: the committed TP rows' routings are drawn as before."""
    for name in R.SKEWED:
        a = R.make_routing(name, 16, 256, 8, torch.Generator().manual_seed(3))
        b = R.make_routing(name, 16, 256, 8, torch.Generator().manual_seed(3), hot_experts=None)
        assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


@pytest.mark.parametrize("routing", R.SKEWED)
def test_an_expert_parallel_call_gives_the_measured_rank_work(routing):
    sh = B.glm5_shard("ep8")
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        call = B.call_inputs(sh, 1, routing, gen, "cpu")
        assert call.local_slots > 0 and call.desc["experts_touched"] >= 1
        assert torch.equal(call.expert_map, B.expert_map_for(sh, "cpu"))


# -- expert-parallel accounting ---------------------------------------------------------------------------------------
def test_sweep_points_count_the_local_experts(mk):
    """A sweep point of ep8 counted the global experts the routing touched (7 where the rank held 4) and their bytes."""
    sh = B.glm5_shard("ep8")
    ids = torch.tensor([[0, 1, 2, 40, 50, 60, 70, 80], [2, 1, 0, 41, 51, 61, 71, 81]])
    point = mk.sweep_point(sh, 2, "balanced", "slot", 1, ids, 50 * MB)
    assert point["experts_touched"] == 3
    assert point["l2_may_serve"] is B.l2_may_serve(1, nvfp4_weight_bytes(3, sh.hidden, sh.intermediate), 50 * MB)
    tp = mk.sweep_point(B.glm5_shard("tp8"), 2, "balanced", "slot", 1, ids, 50 * MB)
    assert tp["experts_touched"] == 13


def test_a_row_with_no_local_work_is_marked_not_timed(monkeypatch):
    """A committed 'ep8 T=1 same_k' row timed an empty call and reported it as 0 % of bandwidth."""
    sh = B.Shard("ep4", 2, 128, 128, 2, 8)

    def remote_only(name, t, e, k, gen=None, device="cpu", routed_scaling_factor=2.5, spec=None, hot_experts=None):
        return torch.full((t, k), 1.25), torch.tensor([[4, 5]] * t, dtype=torch.int32)

    def timed(*a, **k):
        raise AssertionError("timed a call that has no work")

    monkeypatch.setattr(R, "make_routing", remote_only)
    monkeypatch.setattr(B, "time_ours", timed)
    monkeypatch.setattr(B, "copy_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(B, "bf16_gemm_tflops", lambda: 800.0)
    res = B.run_table([sh], [1], ["balanced"], layers=1, marlin=False, baselines=False, device="cpu")
    (r,) = res["rows"]
    assert "no token" in r["skipped"] and "us" not in r and "pct_copy_bw" not in r and "error" not in r
    assert "no token" in B.summary_line(r)
    md = B.markdown(dict(copy_gbs=1.0, bf16_tflops=1.0), res["rows"])
    assert "| ep4 | 1 | balanced | 0 | not timed: " in md


# -- distinct layers per graph in every script ------------------------------------------------------------------------
def test_layer_count_is_the_tables_rule():
    sh = B.glm5_shard("tp8")
    assert B.layer_count(sh, None, 50 * MB, device="cpu") == B.layers_for(sh, 50 * MB) == 5
    assert B.layer_count(sh, 7, 50 * MB, device="cpu") == 7
    with pytest.raises(Glm5Fp4Error, match="--layers 0"):
        B.layer_count(sh, 0, 50 * MB, device="cpu")


@pytest.mark.parametrize("script", ["benchmarks/moe_variants.py", "benchmarks/small_t_floor.py"])
def test_the_variant_scripts_default_to_the_l2_rule(script):
    """4 fixed layers: 85 MB of TP8 T=1 weights, under twice a 50 MB L2."""
    mod = load_script(script, "bench_script_" + script.split("/")[-1][:-3])
    ap = mod.parser()
    assert ap.parse_args([]).layers is None
    assert "defeats L2 reuse" not in ap.format_help()


def _cpu_script(monkeypatch, script, l2):
    """A variant script run on the CPU: a tiny shard for its GLM-5 shard, the torch reference for the kernel."""
    import glm5_fp4.bench.timing as T
    import glm5_fp4.kernels.moe as KM

    mod = load_script(script, "bench_script_" + script.split("/")[-1][:-3])
    mod.DEVICE = "cpu"
    tiny = B.Shard("tp8", 4, 128, 128, 2, 4)
    monkeypatch.setattr(B, "glm5_shard", lambda name, spec=None: tiny)
    monkeypatch.setattr(B, "l2_cache_bytes", lambda device="cuda": l2)
    monkeypatch.setattr(B, "time_ours", lambda layers, *a, **k: 10.0 * len(layers.prepared))
    monkeypatch.setattr(T, "copy_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(T, "graph_time_us", lambda fn, replays=20, warmup=3: 5.0)

    def kernel(x, tw, ids, prepared, mode="w4a16", out=None, plan=None, stages=(), diag=0, expert_map=None, **k):
        return KM.fused_moe_torch(x, tw, ids, prepared, mode, out, expert_map)

    monkeypatch.setattr(KM, "fused_moe_triton", kernel)
    return mod, tiny


def test_moe_variants_records_its_layers_and_the_l2_mark(monkeypatch, tmp_path):
    l2 = nvfp4_weight_bytes(2, 128, 128) * 3  # the tiny shard's k experts: 3 layers' worth of L2, 6 layers wanted
    mod, tiny = _cpu_script(monkeypatch, "benchmarks/moe_variants.py", l2)
    out = tmp_path / "v.json"
    assert mod.main(["--tokens", "1,8", "--routings", "same_k", "--forms", "parallel_align", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    want = B.layers_for(tiny, l2)
    assert want == 6 and doc["meta"]["layers"] == {"tp8": want} and doc["meta"]["l2_bytes"] == l2
    for r in doc["rows"]:
        assert r["layers"] == want and r["l2_may_serve"] is False and r["experts_touched"] == 2
    assert doc["rows"][0]["us"]["default"] == 60.0  # the fake timer's 10 per layer: all 6 layers were timed


def test_small_t_floor_records_its_layers_and_the_l2_mark(monkeypatch, tmp_path):
    l2 = nvfp4_weight_bytes(2, 128, 128) * 3
    mod, tiny = _cpu_script(monkeypatch, "benchmarks/small_t_floor.py", l2)

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    monkeypatch.setattr(mod, "_floor_kernel", NoLaunch())
    out = tmp_path / "f.json"
    assert mod.main(["--tokens", "1", "--chunk", "64", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["layers"] == 6 and doc["meta"]["l2_bytes"] == l2
    (r,) = doc["rows"]
    assert r["layers"] == 6 and r["l2_may_serve"] is False


# -- the sweep's exit status and --plans ------------------------------------------------------------------------------
def _point(runs, shard="tp8", tokens=512):
    return {"shard": shard, "tokens": tokens, "routing": "balanced", "schedule": "grouped", "layers": 5,
            "experts_touched": 256, "l2_may_serve": False, "runs": runs}


def _plan_dict(t=512):
    import dataclasses

    from glm5_fp4.kernels import configs as C

    return dataclasses.asdict(C.plan("sm90", t, 256, 8, 6144, 256, sm_count=132))


@pytest.mark.parametrize("runs,code,said", [
    ([{"name": "default", "plan": {}, "error": "RuntimeError('illegal memory access')"},
      {"name": "g1 x", "plan": {}, "error": "RuntimeError('illegal memory access')"}], 1, "no variant ran"),
    ([{"name": "default", "plan": {}, "us": 250.0}, {"name": "g1 x", "plan": {}, "error": "OutOfResources"}], 1,
     "1 of 2 runs failed"),
    ([{"name": "default", "plan": {}, "us": 250.0}], 0, ""),
])
def test_the_sweeps_exit_status_says_what_failed(mk, monkeypatch, tmp_path, capsys, runs, code, said):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(B, "l2_cache_bytes", lambda device="cuda": None)

    def fake_sweep(shards, tokens, routing, layers_n, progress, on_point=None, **kw):
        out = [_point(runs)]
        on_point(out)
        return out

    monkeypatch.setattr(mk, "run_sweep", fake_sweep)
    assert mk.main(["--sweep", "--shards", "tp8", "--tokens", "512", "--json", str(tmp_path / "sw.json")]) == code
    assert said in capsys.readouterr().err


def test_plans_from_a_sweep_without_a_usable_plan_are_refused(mk, monkeypatch, tmp_path, capsys):
    """A sweep whose variants all failed gave no plan, and the table then ran the built-in defaults under a meta.plans
    that named the sweep file."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def table(*a, **k):
        raise AssertionError("ran the table")

    monkeypatch.setattr(B, "run_table", table)
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps({"sweeps": [_point([{"name": "default", "plan": _plan_dict(), "error": "boom"}])]}))
    assert mk.main(["--plans", str(failed), "--shards", "tp8", "--tokens", "512"]) == 2
    err = capsys.readouterr().err
    assert "failed.json" in err and "tp8 T=512" in err and "Traceback" not in err
    table_json = tmp_path / "table.json"
    table_json.write_text(json.dumps({"meta": {}, "rows": []}))
    assert mk.main(["--plans", str(table_json), "--shards", "tp8", "--tokens", "512"]) == 2
    assert "no sweep points" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert mk.main(["--plans", str(bad)]) == 2
    assert "bad.json" in capsys.readouterr().err
    with pytest.raises(Glm5Fp4Error, match="tp8 T=512"):
        mk.plans_from_sweep(str(failed), [("tp8", 512)])


def test_plans_from_a_sweep_give_the_best_plan_and_defaults_where_not_swept(mk, tmp_path):
    good = tmp_path / "good.json"
    fast, slow = _plan_dict(512), dict(_plan_dict(512), gemm2_n_split=3)
    good.write_text(json.dumps({"sweeps": [_point([{"name": "a", "plan": slow, "us": 300.0},
                                                   {"name": "b", "plan": fast, "us": 250.0}])]}))
    look = mk.plans_from_sweep(str(good), [("tp8", 512), ("tp8", 64)])
    assert look(B.glm5_shard("tp8"), 512) == mk._plan_of(fast) and look(B.glm5_shard("tp8"), 64) is None


def test_a_table_with_a_failed_row_exits_non_zero(mk, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rows = [{"shard": "tp8", "tokens": 1, "routing": "balanced", "error": "AssertionError: output differs"}]
    monkeypatch.setattr(B, "run_table", lambda *a, **k: {"rows": rows, "copy_gbs": 1.0, "bf16_tflops": 1.0,
                                                           "layers": {"tp8": 5}, "l2_bytes": None, "marlin": None})
    assert mk.main(["--shards", "tp8", "--tokens", "1", "--routings", "balanced", "--json",
                    str(tmp_path / "t.json"), "--md", str(tmp_path / "t.md")]) == 1


# -- the single-call GPU probes build their call as the benchmarks do ------------------------------------------------
def test_ncu_moe_call_gives_an_expert_parallel_shard_its_map_and_hot_experts(monkeypatch):
    """ncu_moe_call drew its routing over all 256 experts and passed no expert map: on ep8 the kernel read ids up to
    255 against a 32-expert layer, and a skewed routing put its hot experts on other ranks."""
    import glm5_fp4.kernels.moe as KM

    tiny = B.Shard("ep8", 4, 128, 128, 2, 32)
    gen = torch.Generator().manual_seed(0)
    layers = B.make_layers(tiny, 1, gen, device="cpu")
    monkeypatch.setattr(B, "one_cuda_layer", lambda name, seed=1: (tiny, layers, gen))
    real_inputs = B.call_inputs
    monkeypatch.setattr(B, "call_inputs", lambda sh, t, routing, g, device="cuda", **k: real_inputs(
        sh, t, routing, g, "cpu", **k))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: None)
    monkeypatch.setattr(KM, "default_plan", lambda *a, **k: "plan")
    seen = []

    def kernel(x, tw, ids, prepared, mode="w4a16", out=None, plan=None, diag=0, expert_map=None, **k):
        seen.append((ids, expert_map))
        return KM.fused_moe_torch(x, tw, ids, prepared, mode, out, expert_map)

    monkeypatch.setattr(KM, "fused_moe_triton", kernel)
    mod = load_script("benchmarks/ncu_moe_call.py", "ncu_moe_call_probe")
    assert mod.main(["--shard", "ep8", "--tokens", "16", "--routing", "same_k"]) == 0
    assert len(seen) == 2
    for ids, emap in seen:
        assert emap is not None and emap.tolist()[:4] == [0, 1, 2, 3] and set(emap.tolist()[4:]) == {-1}
        assert (emap[ids.long()] >= 0).all()  # all tokens on k experts: the k hot experts are the measured rank's


# -- every argument refused before GPU work, output paths included (found by running each script with bad values) --
@pytest.fixture()
def a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    return f


@pytest.mark.parametrize("script,argv,culprit", [
    ("benchmarks/moe_kernel.py", ["--json", "{dir}"], "--json"),
    ("benchmarks/moe_kernel.py", ["--json", "{file}/x.json"], "--json"),
    ("benchmarks/moe_kernel.py", ["--md", "{dir}"], "--md"),
    ("benchmarks/moe_kernel.py", ["--precompile", "-1"], "--precompile"),
    ("benchmarks/moe_kernel.py", ["--tokens", "1,,4"], "--tokens"),
    ("benchmarks/moe_kernel.py", ["--tokens", "4,4"], "4"),
    ("benchmarks/moe_kernel.py", ["--routings", "zipfnan"], "zipfnan"),
    ("benchmarks/moe_variants.py", ["--json", "{dir}"], "--json"),
    ("benchmarks/moe_variants.py", ["--precompile", "-1"], "--precompile"),
    ("benchmarks/small_t_floor.py", ["--chunk", "0"], "--chunk"),
    ("benchmarks/small_t_floor.py", ["--chunk", "-64"], "--chunk"),
    ("benchmarks/small_t_floor.py", ["--chunk", "48"], "--chunk"),
    ("benchmarks/small_t_floor.py", ["--json", "{file}/x.json"], "--json"),
    ("benchmarks/align_probe.py", ["--tokens", "1,,4"], "--tokens"),
    ("benchmarks/align_probe.py", ["--tokens", "0"], "0"),
    ("benchmarks/align_probe.py", ["--shard", "tpx"], "tpx"),
    ("benchmarks/align_probe.py", ["--json", "{dir}"], "--json"),
    ("benchmarks/ncu_moe_call.py", ["--routing", "bogus"], "bogus"),
    ("benchmarks/ncu_moe_call.py", ["--form", "nope"], "nope"),
    ("benchmarks/ncu_moe_call.py", ["--tokens", "-3"], "-3"),
    ("benchmarks/ncu_moe_call.py", ["--diag", "-5"], "--diag"),
    ("benchmarks/ncu_moe_call.py", ["--plans", "{dir}/none.json"], "--plans"),
    ("benchmarks/ncu_moe_call.py", ["--shard", "tp3"], "tp3"),
])
def test_every_script_refuses_before_gpu_work(tmp_path, a_file, capsys, script, argv, culprit):
    argv = [a.format(dir=tmp_path, file=a_file) for a in argv]
    mod = load_script(script, "bench_script_" + script.split("/")[-1][:-3])
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and culprit in err and "Traceback" not in err, err


@pytest.mark.parametrize("name", ["zipfnan", "zipfinf", "zipf-1", "zipf0", "zipf"])
def test_a_zipf_routing_needs_a_finite_positive_exponent(name):
    with pytest.raises(Glm5Fp4Error, match=repr(name)):
        R.check(name)
    R.check("zipf1.2")


@pytest.mark.parametrize("text,culprit", [("1,,4", "empty"), ("4,1,4", "twice")])
def test_token_lists_have_no_holes_or_repeats(text, culprit):
    with pytest.raises(Glm5Fp4Error, match=culprit):
        B.token_counts(text)
