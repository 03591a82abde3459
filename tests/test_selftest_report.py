"""The self-test report: rendering from a fake result, the verdict rule, and the benchmark script contract."""

from __future__ import annotations

import dataclasses
import inspect
import json

import torch

from glm5_fp4.selftest import bench, checks, report
from glm5_fp4.tolerances import moe_tolerance


def fake_result(fail_case: bool = False, bench_status: str = "ok") -> dict:
    case = {"shape": "tp8", "tokens": 16, "mode": "w4a4", "ids_dtype": "int64", "tolerance": moe_tolerance("w4a4"),
            "plan": {"schedule": "grouped", "gemm1": {"bn": 64, "bm": 16, "bk": 128, "num_warps": 4, "num_stages": 3},
                     "gemm2": {"bn": 64, "bm": 16, "num_warps": 4, "num_stages": 2}, "gemm2_n_split": 24},
            "finite": True, "rel_err": 3.1e-3, "passed": True}
    bad = {**case, "tokens": 512, "finite": False, "rel_err": float("nan"), "passed": False}
    cases = [case, bad] if fail_case else [case]
    passed = sum(c["passed"] for c in cases)
    return {
        "schema": 1,
        "meta": {"date": "2026-11-29T20:00:00+00:00", "command": "glm5-fp4 selftest --quick", "quick": True, "elapsed_s": 61.0},
        "env": {"gpu": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "device_index": 0, "device_count": 8,
                "compute_capability": "12.0", "arch": "sm120", "sm_count": 188, "memory_gb": 97.9, "driver": "580.65",
                "cuda_runtime": "13.0", "torch": "2.11.0", "triton": "3.6.0", "glm5_fp4": "0.1.0", "python": "3.11",
                "platform": "Linux", "engines": {"vllm": None, "sglang": None, "flashinfer": None},
                "hardware_table": {"name": "rtx-pro-6000-ws", "mem_bandwidth_gbs": 1792.0}},
        "correctness": {"tolerance": {"w4a4": moe_tolerance("w4a4")}, "cases": cases, "passed": passed,
                        "failed": len(cases) - passed},
        "kernels": [{"kernel": "moe_gemm1_kernel", "constexprs": {"BN": 64, "BM": 16}, "num_warps": 4, "num_stages": 3,
                     "shared_bytes": 26624, "registers": 94, "spills": 0}],
        "benchmark": {"status": bench_status, "copy_gbs": 1500.0, "bf16_tflops": 400.0, "marlin": "vLLM fused_marlin_moe",
                      "rows": [
            {"shard": "tp8", "tp": 8, "tokens": 16, "routing": "balanced", "experts_touched": 101, "us": 150.0,
             "floor_us": 45.0, "pct_copy_bw": 30.0, "pct_table_bw": 25.1, "gbs": 450.0, "tflops": 2.0, "skew_ratio": 1.0,
             "us_w4a4": 200.0, "marlin_us": 180.0, "speedup_vs_marlin": 1.2, "bf16_grouped_mm_us": 400.0,
             "speedup_vs_bf16": 2.67},
            {"shard": "tp8", "tp": 8, "tokens": 256, "routing": "same_k", "error": "RuntimeError: out of memory"},
        ]},
    }


def test_markdown_carries_gpu_versions_results_and_bandwidth(tmp_path):
    res = fake_result()
    res["verdict"] = report.verdict(res)
    js, md = report.write(res, tmp_path / "out")
    text = md.read_text()
    assert res["verdict"] == "pass" and "**Verdict: PASS**" in text
    for needle in ("RTX PRO 6000", "580.65", "2.11.0 / 3.6.0", "sm120", "1792 GB/s datasheet", "3.10e-03",
                   "| tp8 | 16 | balanced | 101 | 150.0 | 45.0 | 30 % | 25 % |", "| 180.0 | 1.20 |", "64/16/128/4/3", "out of memory",
                   "| moe_gemm1_kernel | BN=64, BM=16 | 4/3 | 26624 | 94 | 0 |"):
        assert needle in text, needle
    assert json.loads(js.read_text())["env"]["driver"] == "580.65"


def test_a_failed_case_fails_the_verdict_and_shows():
    res = fake_result(fail_case=True)
    res["verdict"] = report.verdict(res)
    text = report.markdown(res)
    assert res["verdict"] == "fail" and "**Verdict: FAIL**" in text and "**FAIL**" in text
    assert report.verdict({"correctness": {"cases": [], "failed": 0}}) == "fail"  # nothing ran is not a pass


def test_report_without_benchmark_or_table_entry():
    res = fake_result()
    res["benchmark"] = None
    res["env"]["hardware_table"] = None
    res["verdict"] = report.verdict(res)
    text = report.markdown(res)
    assert "Not run (--no-bench)" in text and "no entry" in text
    # the heading names the shape selftest.bench times: GLM-5's routed experts (config.json values)
    assert "GLM-5 experts E=256, H=6144, top-8" in text


def test_selftest_benchmark_lives_in_the_package():
    """The self-test's benchmark is package code (glm5_fp4.bench), never a file of the source checkout."""
    from glm5_fp4.bench import moe

    params = list(inspect.signature(moe.run_table).parameters)
    assert params[:3] == ["shards", "tokens", "routings"], params
    src = inspect.getsource(bench)
    assert "spec_from_file_location" not in src and "__file__" not in src
    assert set(bench.QUICK["routings"]) - {"balanced"}, "the quick benchmark must include a skewed routing"


def test_selftest_runs_from_a_wheel_install(tmp_path):
    """Build the wheel, install it into an empty folder and import the self-test there, away from the
    checkout: every module it needs must be inside the package."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(root)], check=True, capture_output=True, timeout=600)
    whl = next(wheels.glob("glm5_fp4-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(whl)],
                   check=True, capture_output=True, timeout=600)
    code = ("import glm5_fp4, glm5_fp4.selftest.bench as b, glm5_fp4.bench.moe, glm5_fp4.bench.marlin, "
            "glm5_fp4.bench.routing; print(glm5_fp4.__file__)")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert str(target) in out.stdout  # the wheel's copy, not the checkout's
    cli = subprocess.run([sys.executable, "-m", "glm5_fp4.cli", "selftest", "--quick", "--out", str(tmp_path / "r")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    # no GPU here: the documented exit code 2 and its one-line reason, not an import error
    assert cli.returncode == 2 and "no CUDA GPU" in cli.stderr, (cli.returncode, cli.stderr[-2000:])


def test_quick_cases_cover_both_modes_and_the_slot_schedule():
    quick = checks.cases(quick=True)
    assert not any(c.layout == "checkpoint" for c in quick)  # sm90 default: no native FP4 path
    assert {c.mode for c in quick} == {"w4a16", "w4a4"}
    assert any(c.tokens == 1 for c in quick) and any(c.ids_dtype == "int32" for c in quick)
    assert len(checks.cases(quick=False)) > len(quick)


def test_native_fp4_cases_where_configs_has_a_native_path():
    archs = checks.native_archs()
    for arch in archs:
        native = [c for c in checks.cases(quick=True, arch=arch) if c.layout == "checkpoint"]
        assert native and all(c.mode == "w4a4" for c in native)
    assert not [c for c in checks.cases(quick=False, arch="sm90") if c.layout == "checkpoint"]


def test_informational_native_failures_show_but_do_not_fail_the_verdict():
    res = fake_result()
    bad_native = {**res["correctness"]["cases"][0], "layout": "checkpoint", "passed": False, "gating": False,
                  "error": "wrong results"}
    res["correctness"]["cases"].append(bad_native)
    res["correctness"].update(informational_failed=1, informational_passed=0, native_fp4_enabled=False)
    res["verdict"] = report.verdict(res)
    text = report.markdown(res)
    assert res["verdict"] == "pass"
    assert "informational" in text and "0 passed, 1 failed" in text


def test_a_case_runs_end_to_end_on_the_cpu_path():
    """The case plumbing (experts, routing, NaN poisoning, reference, error) on fused_moe's CPU path, which is
    the reference itself: it must pass with bf16-rounding error, and a broken backend must fail the case."""
    from glm5_fp4.sm120.launches import shape_classes

    shape = next(s for s in shape_classes() if s.name == "tiny")
    ex, prepared = checks.make_experts(shape, device="cpu")
    case = checks.Case("tiny", 5, "w4a4", "int32")
    assert case.layout == "tiled" and set(prepared) == {"tiled"}  # the engines' layout, named as such
    r = checks.run_case(case, shape, ex, prepared[case.layout], sm_count=188, arch="sm120", seed=0, device="cpu")
    assert r["passed"] and r["finite"] and r["tolerance"] == moe_tolerance("w4a4", torch.bfloat16)
    # the CPU path is the reference rounded to bf16: only that rounding, within even the (tighter) W4A16 bound
    assert r["rel_err"] < moe_tolerance("w4a16", torch.bfloat16), r
    assert r["plan"]["schedule"] in ("slot", "grouped")
    # the plan reported is the one this mode runs: W4A4 never splits the grouped GEMM1's K, W4A16 may
    assert r["plan"]["schedule"] == "grouped" and r["plan"]["gemm1_split_k"] == 1 and not r["plan"]["slot_dedup"]
    from glm5_fp4.kernels import configs as C

    w16 = checks.run_case(checks.Case("tiny", 5, "w4a16", "int32"), shape, ex, prepared[case.layout], sm_count=188,
                          arch="sm120", seed=0, device="cpu")
    want = C.plan("sm120", 5, shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, sm_count=188)
    assert w16["plan"]["gemm1_split_k"] == want.gemm1_split_k > 1

    import glm5_fp4.kernels as K

    orig = K.fused_moe
    K.fused_moe = lambda x, w, ids, p, mode, out: out  # leaves the NaN poison in place
    try:
        bad = checks.run_case(case, shape, ex, prepared[case.layout], sm_count=188, arch="sm120", seed=0, device="cpu")
    finally:
        K.fused_moe = orig
    assert not bad["passed"] and bad["finite"] is False


def test_touched_experts_reference_equals_the_full_reference():
    import torch

    from glm5_fp4.reference import moe_reference, random_experts, route

    g = torch.Generator().manual_seed(3)
    ex = random_experts(16, 256, 128, generator=g)
    x = torch.randn(2, 256, generator=g)
    w, ids = route(torch.randn(2, 16, generator=g), None, 4)  # at most 8 of 16 experts touched
    sub, local = checks.touched_experts(ex, ids)
    assert sub.num_experts == len(torch.unique(ids)) < 16
    for mode in ("w4a16", "w4a4"):
        torch.testing.assert_close(moe_reference(x, w, local, sub, mode=mode), moe_reference(x, w, ids, ex, mode=mode))


def test_the_report_names_the_plans_form():
    """The correctness table says which form ran (slot dedup, GEMM1 split-K), not only the schedule; older results
    without those fields still render."""
    from glm5_fp4.selftest.report import _schedule

    assert _schedule({"schedule": "slot", "slot_dedup": True, "gemm1_split_k": 4}) == "slot dedup K/4"
    assert _schedule({"schedule": "grouped", "gemm1_split_k": 1}) == "grouped"
    assert _schedule({"schedule": "grouped"}) == "grouped" and _schedule({}) == "—"


def test_former_plans_table_shows_each_ratio_and_failures():
    res = fake_result()
    res["verdict"] = report.verdict(res)
    res["benchmark"]["former_plans"] = [
        {"form": "sm120_former", "purpose": "the former tables", "rows": [
            {"shard": "tp8", "tokens": 1, "default_us": 20.0, "former_us": 40.0, "former_over_default": 2.0},
            {"shard": "tp8", "tokens": 256, "default_us": 200.0, "former_us": None, "error": "RuntimeError: boom"}]},
        {"form": "other_former", "purpose": "x", "rows": [], "error": "ValueError: no plan"}]
    text = report.markdown(res)
    assert "### Former plans: `sm120_former`" in text and "| tp8 | 1 | 20.0 | 40.0 | 2.00 |" in text
    assert "| tp8 | 256 | 200.0 | — | **error**: RuntimeError: boom |" in text
    assert "### Former plans: `other_former`" in text and "Failed: ValueError: no plan" in text


def test_config_label_names_the_tile_forms():
    """The report's tile column tells a register cap, TMA tiles and a stacked gate/up tile apart (they time apart)."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.selftest.report import _cfg

    plain = dataclasses.asdict(C.Gemm1Config(64, 32, 256, 4, 3))
    assert _cfg(plain) == "64/32/256/4/3"
    assert _cfg(dataclasses.asdict(C.Gemm1Config(64, 32, 256, 4, 3, stacked=True))) == "64/32/256/4/3 gate+up"
    assert _cfg(dataclasses.asdict(C.Gemm1Config(64, 32, 256, 4, 2, maxnreg=168, tma=True))) == "64/32/256/4/2 r168 tma"


def test_a_case_s_first_call_compiles_without_a_slow_call_warning(monkeypatch, caplog):
    """H100, 2026-12-07: `selftest --quick` printed the slow-call watch's warning, with a stack of import frames,
    for its first case: the compile it times on purpose (first_call_s). Its calls are not a server's."""
    import logging
    import time

    import glm5_fp4.kernels as K
    from glm5_fp4.kernels import slow_calls as S
    from glm5_fp4.sm120.launches import shape_classes

    shape = next(s for s in shape_classes() if s.name == "tiny")
    ex, prepared = checks.make_experts(shape, device="cpu")
    monkeypatch.setenv(S.ENV, "20")
    orig = K.fused_moe

    def held_like_a_compile(x, w, ids, p, mode, out):
        with S.WATCH.call(x.shape[0], torch.device("cuda")):  # as fused_moe's watch sees a GPU call
            time.sleep(0.05)
        return orig(x, w, ids, p, mode=mode, out=out)

    monkeypatch.setattr(K, "fused_moe", held_like_a_compile)
    before = S.WATCH.slow_count
    with caplog.at_level(logging.WARNING, logger="glm5_fp4"):
        r = checks.run_case(checks.Case("tiny", 5, "w4a16", "int32"), shape, ex, prepared["tiled"], sm_count=188,
                            arch="sm120", seed=0, device="cpu")
    assert r["passed"], r
    assert S.WATCH.slow_count == before and not [m for m in caplog.messages if "held the host" in m]


def test_a_benchmark_that_failed_makes_the_run_partial_not_a_pass():
    """A run whose correctness passed but whose benchmark failed exited 0 with 'verdict: PASS'."""
    for status in ("error", "partial"):
        res = fake_result(bench_status=status)
        res["verdict"] = report.verdict(res)
        assert res["verdict"] == "partial" and "**Verdict: PARTIAL**" in report.markdown(res)
        assert "benchmark " + status in report.summary_line(res, "r.md", "r.json")
    assert report.verdict(fake_result(fail_case=True, bench_status="error")) == "fail"
    res = fake_result()
    res["benchmark"] = None  # --no-bench: not run is no failure
    assert report.verdict(res) == "pass"


def test_the_console_line_counts_the_cases_that_gate():
    """8 gating cases passed and 3 informational ones read 'PASS (8/11 cases)', as if 3 had failed."""
    res = fake_result()
    info = {**res["correctness"]["cases"][0], "layout": "checkpoint", "passed": True, "gating": False}
    res["correctness"]["cases"] += [info, info, info]
    res["correctness"].update(informational_passed=3, informational_failed=0)
    res["verdict"] = report.verdict(res)
    line = report.summary_line(res, "r.md", "r.json")
    assert "PASS" in line and "1/1 correctness cases" in line and "3 informational" in line and "/4" not in line, line
