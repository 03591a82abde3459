"""What the MoE benchmarks check before they time, on tiny shards under the interpreter: the table's rows against the
float64 reference (a kernel returning a finite wrong layer was timed and published), and the sweep's calls on an
expert-parallel shard with the shard's expert map (the sweep ran global ids up to 255 against the local experts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the benchmark scripts' loader
from script_modules import load_script  # noqa: E402

import glm5_fp4.kernels.moe as KM
from glm5_fp4.bench import moe as B
from glm5_fp4.reference import moe_reference
from glm5_fp4.tolerances import moe_tolerance, rel_error


@pytest.fixture
def fake_timers(monkeypatch):
    def graph_time_us(fn, replays=20, warmup=3):
        fn()
        return 100.0

    monkeypatch.setattr(B, "graph_time_us", graph_time_us)
    monkeypatch.setattr(B, "copy_bandwidth_gbs", lambda: 4000.0)
    monkeypatch.setattr(B, "bf16_gemm_tflops", lambda: 800.0)


@pytest.mark.parametrize("wrong", ["constant", "one_token", "dropped_slot"])
def test_a_row_whose_kernel_computes_the_wrong_layer_fails(fake_timers, monkeypatch, wrong):
    """Finite but wrong outputs: a constant, one token's row off, each token's second expert left out."""
    real = KM.fused_moe_triton

    def kernel(x, tw, ids, prepared, mode="w4a16", out=None, **kw):
        if wrong == "dropped_slot":
            tw = tw.clone()
            tw[:, 1] = 0
        y = real(x, tw, ids, prepared, mode, **kw)
        if wrong == "constant":
            y = torch.full_like(x, 0.123)
        elif wrong == "one_token":
            y[-1] += 0.5 * y[-1].abs().max()
        if out is not None:
            out.copy_(y)
            return out
        return y

    monkeypatch.setattr(KM, "fused_moe_triton", kernel)
    res = B.run_table([B.Shard("tiny", 8, 128, 128, 2, 8)], [24], ["balanced"], layers=1, marlin=False,
                      baselines=False, device="cpu")
    (r,) = res["rows"]
    assert "differs from the float64 reference" in r.get("error", ""), r
    assert "us" not in r


def test_rows_record_their_check_against_the_reference(fake_timers):
    shards = [B.Shard("tiny", 8, 128, 128, 2, 8), B.Shard("ep2", 4, 128, 128, 2, 8)]
    res = B.run_table(shards, [3], ["balanced", "zipf2"], layers=1, marlin=False, baselines=False, device="cpu")
    for r in res["rows"]:
        assert "error" not in r, r
        assert r["checked_tokens"] == 3 and r["rel_err_vs_reference"] < moe_tolerance("w4a16", torch.float16)


def test_the_sweep_runs_an_expert_parallel_shard_with_its_expert_map(fake_timers, monkeypatch):
    """Every kernel call of the sweep (the reference plan, each variant, the timed layers) gets rank 0's expert map,
    and computes the layer the float64 reference computes with that map."""
    mk = load_script("benchmarks/moe_kernel.py", "moe_kernel_bench")
    real = KM.fused_moe_triton
    sh = B.Shard("ep2", 4, 128, 128, 2, 8)
    want = B.expert_map_for(sh, "cpu")
    seen = []

    def spy(x, tw, ids, prepared, mode="w4a16", out=None, plan=None, expert_map=None, **kw):
        y = real(x, tw, ids, prepared, mode, out=out, plan=plan, expert_map=expert_map, **kw)
        experts = next(e for p, e in zip(lay.prepared, lay.experts) if p is prepared)
        ref = moe_reference(x.double(), tw.double(), ids.long(), experts, compute_dtype=torch.float64, expert_map=want)
        seen.append((expert_map, rel_error(y, ref)))
        return y

    made = B.make_layers
    lay = None

    def make_layers(*a, **k):
        nonlocal lay
        lay = made(*a, **k)
        return lay

    monkeypatch.setattr(KM, "fused_moe_triton", spy)
    monkeypatch.setattr(B, "make_layers", make_layers)
    monkeypatch.setattr(mk, "launch_forms", lambda plan: {})  # (PDL and prefetch forms: the GPU's)
    points = mk.run_sweep([sh], [6], "balanced", 1, lambda msg: None, only="^$", device="cpu")
    (point,) = points
    assert point["experts_touched"] <= 4
    assert [r for r in point["runs"] if "error" in r] == [] and len(point["runs"]) >= 2
    assert len(seen) >= 3
    for emap, err in seen:
        assert emap is not None and torch.equal(emap.to(want.dtype), want)
        assert err < moe_tolerance("w4a16", torch.float16)
