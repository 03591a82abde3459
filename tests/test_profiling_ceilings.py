"""Per-step FLOPs / bytes of a GLM-5 decode step and the roofline bound, against hand-derived formulas."""

import math

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.hardware import get_gpu
from glm5_fp4.profiling.ceilings import StepShape, ceilings, step_work
from glm5_fp4.spec import Glm5Spec

# GLM-5 config.json values, restated here so the test does not read them back from the code under test
H, I, E, K, SHARED, LAYERS, DENSE = 6144, 2048, 256, 8, 1, 78, 3
MOE = LAYERS - DENSE
NVFP4 = 0.5 + 1 / 16


def _measured(value_us: float) -> dict:
    return {c: value_us for c in ("expert_gemm", "attention", "other_gemm", "allreduce", "other", "memcpy", "allreduce_wait")}


@pytest.mark.parametrize("batch,tp", [(1, 8), (64, 8), (512, 8), (512, 4)])
def test_expert_bytes_and_flops(batch, tp):
    """expert_gemm is the routed experts (the shared expert runs as separate linears: other_gemm)."""
    w = step_work(Glm5Spec(), StepShape(batch=batch, context=1024, tp=tp), get_gpu("rtx-pro-6000-ws"))["expert_gemm"]
    touched = E * (1 - (1 - K / E) ** batch)
    weights = MOE * touched * 3 * H * I * NVFP4 / tp
    acts = MOE * 2 * batch * H * 2  # x read and the output written once per layer
    assert w.bytes == pytest.approx(weights + acts, rel=1e-9)
    assert w.flops == pytest.approx(MOE * 2 * batch * K * 3 * H * I / tp, rel=1e-9)


def test_all_experts_stream_at_512_and_intensity_matches_the_reference_estimate():
    w = step_work(Glm5Spec(), StepShape(batch=512, context=0, tp=8), get_gpu("h200"))["expert_gemm"]
    all_experts = MOE * E * 3 * H * I * NVFP4 / 8
    assert w.bytes > all_experts * 0.999  # every expert is touched
    # profiling-and-loadtest.md §6.2: AI ≈ 2 * (B*k/E) / 0.5625 ≈ 57 FLOP/B (routed experts, weights only)
    assert w.flops / all_experts == pytest.approx(2 * 512 * K / (E * NVFP4), rel=1e-9)
    assert 45 < w.intensity < 57  # activations in and out lower it a little


def test_bound_is_memory_at_decode_and_compute_at_huge_batches():
    spec, gpu = Glm5Spec(), get_gpu("h200")
    small = ceilings(spec, StepShape(batch=64, context=2048, tp=8), gpu, _measured(1000.0), _measured(1000.0), 20000.0)
    assert small["categories"]["expert_gemm"]["bound"] == "memory"
    huge = ceilings(spec, StepShape(batch=200_000, context=0, tp=8), gpu, _measured(1000.0), _measured(1000.0), 20000.0)
    assert huge["categories"]["expert_gemm"]["bound"] == "compute"
    row = small["categories"]["expert_gemm"]
    assert row["floor_us"] == pytest.approx(max(row["t_memory_us"], row["t_compute_us"]))
    assert row["t_memory_us"] == pytest.approx(row["bytes"] / 4800e9 * 1e6)


def test_rtx_pro_reports_dense_and_sparse_fp4_peaks():
    c = ceilings(Glm5Spec(), StepShape(batch=512, context=4096, tp=8), get_gpu("rtx-pro-6000-ws"), _measured(5000.0), _measured(4000.0), 30000.0)
    row = c["categories"]["expert_gemm"]
    assert row["compute_dtype"] == "nvfp4"
    assert (row["peak_tflops_dense"], row["peak_tflops_sparse"]) == (2015, 4000)
    achieved = row["flops"] / 5000e-6 / 1e12
    assert row["pct_of_compute_dense"] == pytest.approx(100 * achieved / 2015)
    assert row["pct_of_compute_sparse"] == pytest.approx(100 * achieved / 4000)
    assert row["pct_of_bandwidth"] == pytest.approx(100 * row["bytes"] / 5000e-6 / 1792e9)


def test_h200_runs_nvfp4_weight_only_on_bf16():
    c = ceilings(Glm5Spec(), StepShape(batch=512, context=4096, tp=8), get_gpu("h200"), _measured(5000.0), _measured(4000.0), 30000.0)
    row = c["categories"]["expert_gemm"]
    assert row["compute_dtype"] == "bf16" and row["peak_tflops_dense"] == 989


def test_allreduce_floor_uses_measured_latency_and_bus_bandwidth():
    gpu = get_gpu("rtx-pro-6000-ws")
    batch, tp = 32, 8
    c = ceilings(Glm5Spec(), StepShape(batch=batch, context=1024, tp=tp), gpu, _measured(100.0), _measured(100.0), 20000.0)
    n_ar = 2 * LAYERS + 1
    size = batch * H * 2
    want = n_ar * gpu.allreduce_latency_us + n_ar * 2 * (tp - 1) / tp * size / (gpu.allreduce_bus_bandwidth_gbs * 1e9) * 1e6
    assert c["categories"]["allreduce"]["floor_us"] == pytest.approx(want)
    # H200 has no all-reduce figures in the table: no floor rather than a made-up one
    h = ceilings(Glm5Spec(), StepShape(batch=batch, context=1024, tp=tp), get_gpu("h200"), _measured(100.0), _measured(100.0), 20000.0)
    assert h["categories"]["allreduce"]["floor_us"] is None and h["step_floor_us"] is None


def test_attention_reads_selected_latents_and_scans_indexer_keys():
    spec = Glm5Spec()
    batch, ctx = 16, 10_000
    w = step_work(spec, StepShape(batch=batch, context=ctx, tp=8), get_gpu("h200"))["attention"]
    latent = (512 + 64) * 2
    index_key = 128 + 4
    per_layer = batch * 2048 * latent + batch * ctx * index_key + batch * (latent + index_key) + batch * 8 * (512 + 64 + 512) * 2
    assert w.bytes == pytest.approx(LAYERS * per_layer, rel=1e-9)
    core = 2 * 64 / 8 * batch * 2048 * (2 * 512 + 64)
    indexer = 2 * batch * ctx * 32 * 128
    assert w.flops == pytest.approx(LAYERS * (core + indexer), rel=1e-9)
    # context shorter than index_topk: every cached token is selected
    short = step_work(spec, StepShape(batch=batch, context=100, tp=8), get_gpu("h200"))["attention"]
    assert short.bytes < w.bytes and math.isfinite(short.intensity)


@pytest.mark.parametrize("kwargs,needle", [({"batch": 0}, "--batch"), ({"tp": 0}, "--tp"), ({"context": -1}, "--context"),
                                           ({"expert_dtype": "int4"}, "--expert-dtype"), ({"kv_dtype": "fp4"}, "--kv-dtype")])
def test_bad_shapes_are_named(kwargs, needle):
    shape = StepShape(**({"batch": 8, "context": 0} | kwargs))
    with pytest.raises(Glm5Fp4Error, match=needle):
        step_work(Glm5Spec(), shape, get_gpu("h200"))
