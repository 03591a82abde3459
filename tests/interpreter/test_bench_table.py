"""The benchmark table's code path (glm5_fp4.bench.moe, shared by benchmarks/moe_kernel.py and the
self-test) on a tiny shard under the interpreter, with the GPU-only timers replaced: every routing, the
expert-parallel shard, the skew ratios, the markdown. The timings are fake; the routing, byte and FLOP
accounting and the kernel calls are real, each row's first call checked inside ``row`` against the float64 reference
(glm5_fp4.reference) within the GPU tests' tolerance (a wrong layer failing that check: test_bench_checks.py)."""

from __future__ import annotations

import pytest
import torch

from glm5_fp4.bench import moe as B
from glm5_fp4.bench.routing import ROUTINGS


@pytest.fixture
def fake_timers(monkeypatch):
    calls = []

    def graph_time_us(fn, replays=20, warmup=3):
        fn()  # the timed region must run
        calls.append(fn)
        return 100.0 + 10.0 * len(calls)

    monkeypatch.setattr(B, "graph_time_us", graph_time_us)
    monkeypatch.setattr(B, "copy_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(B, "bf16_gemm_tflops", lambda: 800.0)
    return calls


def test_table_rows_for_every_routing_and_an_expert_parallel_shard(fake_timers):
    tiny = B.Shard("tiny", 8, 128, 128, 2, 8)
    ep = B.Shard("ep2", 4, 128, 128, 2, 8)
    res = B.run_table([tiny, ep], [3, 24], list(ROUTINGS), layers=1, marlin=False, baselines=False, device="cpu")
    rows = res["rows"]
    assert [r for r in rows if "error" in r] == []
    assert len(rows) == 2 * 2 * len(ROUTINGS)
    for r in rows:
        assert r["floor_us"] > 0 and r["us"] > 0 and 0 < r["experts_touched"] <= r["experts"]
        assert r["schedule"] == ("slot" if r["tokens"] <= 4 else "grouped")
        assert r["skew_ratio"] == pytest.approx(r["us"] / next(
            b["us"] for b in rows if b["shard"] == r["shard"] and b["tokens"] == r["tokens"] and b["routing"] == "balanced"))
    same_k = next(r for r in rows if r["shard"] == "tiny" and r["tokens"] == 24 and r["routing"] == "same_k")
    assert same_k["experts_touched"] == 2 and same_k["max_tokens_per_expert"] == 24
    # bytes: touched experts' NVFP4 weights + x read + output written
    from glm5_fp4 import nvfp4

    assert same_k["bytes_needed"] == 2 * nvfp4.nvfp4_bytes(3 * 128 * 128) + 2 * 24 * 128 * 2
    meta = dict(gpu="test", date="d", git_sha="s", copy_gbs=res["copy_gbs"], bf16_tflops=res["bf16_tflops"], layers=1)
    md = B.markdown(meta, rows)
    assert md.count("\n| tiny |") == 2 * len(ROUTINGS) and "| ep2 | 24 | same_k |" in md


def test_failed_row_is_recorded_not_raised(fake_timers, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(B, "time_ours", boom)
    res = B.run_table([B.Shard("tiny", 8, 128, 128, 2, 8)], [24], ["balanced"], layers=1, marlin=False,
                      baselines=False, device="cpu")
    assert "out of memory" in res["rows"][0]["error"]
    assert "error: RuntimeError" in B.markdown(dict(copy_gbs=1.0, bf16_tflops=1.0), res["rows"])


def test_marlin_unavailable_says_why(fake_timers):
    from glm5_fp4.bench import marlin

    ok, why = marlin.available()
    assert not ok and why  # no GPU here
    res = B.run_table([B.Shard("tiny", 8, 128, 128, 2, 8)], [3], ["balanced"], layers=1, marlin=True,
                      baselines=False, device="cpu")
    assert res["marlin"] == why
    assert torch.isfinite(torch.tensor(res["rows"][0]["us"]))


def test_selftest_times_the_former_sm120_plans_beside_the_defaults(fake_timers):
    """On an sm_120 the self-test times the former plan tables (opt-in "sm120_former") on the first shard's balanced
    rows of the same run (former / default; tests/test_selftest_report.py renders it); on an arch without former tables
    it times nothing."""
    from glm5_fp4.selftest import bench as SB

    assert SB.former_forms("sm120") == ["sm120_former"] and SB.former_forms("sm90") == []
    tiny = B.Shard("tiny", 8, 256, 128, 2, 8)
    plan = {"shards": (tiny,), "tokens": (1, 24), "routings": ("balanced",), "layers": 1}
    rows = [{"shard": "tiny", "tokens": 1, "routing": "balanced", "us": 50.0},
            {"shard": "tiny", "tokens": 24, "routing": "balanced", "us": 200.0}]
    (entry,) = SB.former_plans("sm120", 188, plan, rows, device="cpu")
    assert entry["form"] == "sm120_former" and "error" not in entry
    assert [r["tokens"] for r in entry["rows"]] == [1, 24]
    for r in entry["rows"]:
        assert "error" not in r and r["former_over_default"] == pytest.approx(r["former_us"] / r["default_us"])
    assert SB.former_plans("sm90", 132, plan, rows, device="cpu") == []
