"""One cost model of a decode step: `glm5-fp4 plan` and `glm5-fp4 profile analyze` give the same floors."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from glm5_fp4 import cost_model
from glm5_fp4.cli import main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.hardware import get_gpu
from glm5_fp4.spec import Glm5Spec, expected_distinct_experts

# GLM-5 config.json values, restated so the tests do not read them back from the code under test
H, I, E, K, LAYERS, MOE = 6144, 2048, 256, 8, 78, 75
NVFP4 = 0.5 + 1 / 16
RTX = get_gpu("rtx-pro-6000-ws")
TRACES = Path(__file__).resolve().parent / "fixtures" / "profiling" / "traces" / "tp2" / "graph"


def _plan_json(*args: str) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", "--json", *args]) == 0
    return json.loads(out.getvalue())


def _ceilings(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "analysis"
    with redirect_stdout(io.StringIO()):
        assert main(["profile", "analyze", str(TRACES), "--out", str(out), "--no-png", "--jobs", "1", *args]) == 0
    return json.loads((out / "breakdown.json").read_text())["ceilings"]


@pytest.mark.parametrize("tp,batch,context,kv", [(8, 512, 2048, "fp8"), (8, 16, 8192, "bf16"), (4, 64, 1024, "fp8")])
def test_plan_and_profile_analyze_give_the_same_floors(tmp_path, tp, batch, context, kv):
    gpu = "rtx-pro-6000-ws"
    plan = _plan_json("--gpu", gpu, "--layouts", f"tp{tp}", "--concurrency", str(batch), "--context", str(context),
                      "--kv-cache-dtype", {"fp8": "fp8", "bf16": "bfloat16"}[kv])
    (layout,) = plan["layouts"].values()
    ceilings = _ceilings(tmp_path, "--gpu", gpu, "--batch", str(batch), "--context", str(context), "--tp", str(tp),
                         "--pp", "1", "--kv-dtype", kv)
    assert set(ceilings["categories"]) <= set(layout["step_ms"])
    for category, row in ceilings["categories"].items():
        assert layout["step_ms"][category] * 1e3 == pytest.approx(row["floor_us"], rel=1e-9), category
    assert layout["step_ms"]["total"] * 1e3 == pytest.approx(ceilings["step_floor_us"], rel=1e-9)


# -- the model's facts, each against an independent derivation ----------------------------------------------


@pytest.mark.parametrize("tokens", [1, 3, 16, 64, 300])
def test_touched_experts_formula_matches_simulated_routing(tokens):
    g = torch.Generator().manual_seed(tokens)
    trials = 300
    distinct = sum(torch.rand(tokens, E, generator=g).topk(K, dim=1).indices.unique().numel() for _ in range(trials))
    assert expected_distinct_experts(tokens, E, K) == pytest.approx(distinct / trials, rel=0.01)
    assert Glm5Spec().expected_experts_touched(tokens) == expected_distinct_experts(tokens, E, K)


def test_fp8_kv_row_is_the_scaled_dsa_row():
    # vLLM flashmla_sparse.py: 512 float8_e4m3 NoPE values, 4 float32 scales (one per 128), 64 bfloat16 RoPE values
    assert Glm5Spec().kv_row_bytes("fp8") == 512 + 4 * 4 + 64 * 2 == 656
    assert Glm5Spec().kv_row_bytes("bf16") == (512 + 64) * 2
    assert Glm5Spec().indexer_row_bytes() == 128 + 4
    b, ctx = 32, 4096
    cost = cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(8), b, ctx, cost_model.Precisions(kv="fp8"))
    mla = cost.stages[0].component("MLA core")
    # per layer: 2048 selected 656-byte rows per sequence, one new row per token, q in / out BF16 (8 heads per GPU)
    assert mla.bytes == pytest.approx(LAYERS * (b * 2048 * 656 + b * 656 + b * 8 * (512 + 64 + 512) * 2), rel=1e-12)


def test_each_component_sits_in_the_category_its_kernels_are_traced_in():
    cost = cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(8), 1, 1024)
    st = cost.stages[0]
    # one token touches exactly its 8 routed experts; the shared expert is not in expert_gemm
    assert st.category("expert_gemm").bytes == pytest.approx(MOE * (8 * 3 * H * I / 8 * NVFP4 + 2 * H * 2), rel=1e-12)
    other = {c.name for c in st.category("other_gemm").components}
    assert {"shared experts", "attention projections", "DSA indexer projections", "router", "lm_head"} <= other
    assert {c.name for c in st.category("attention").components} == {"MLA core", "DSA indexer scan"}
    assert st.component("embedding").category is None and st.component("embedding").seconds == 0.0


def test_pipeline_ceilings_average_the_stages_and_keep_the_pipeline_step(tmp_path):
    from glm5_fp4.profiling.ceilings import StepShape, ceilings

    spec = Glm5Spec()
    shape = StepShape(batch=64, context=2048, tp=4, pp=2, kv_dtype="fp8")
    c = ceilings(spec, shape, RTX, {}, {}, 1.0)
    cost = cost_model.decode_step(spec, RTX, cost_model.Layout(4, 2), 64, 2048, cost_model.Precisions(kv="fp8"))
    for cat, row in c["categories"].items():
        stages = [st.category(cat).seconds for st in cost.stages]
        assert row["floor_us"] == pytest.approx(2 * sum(stages) / 2 * 1e6, rel=1e-12), cat
    assert c["pipeline_step_floor_us"] == pytest.approx(2 * max(st.seconds for st in cost.stages) * 1e6)
    assert c["step_floor_us"] <= c["pipeline_step_floor_us"]


def test_plan_and_the_breakdown_print_the_same_assumptions(tmp_path):
    text = io.StringIO()
    with redirect_stdout(text):
        assert main(["plan", "--layouts", "tp8", "--concurrency", "32", "--context", "4096", "--kv-cache-dtype", "fp8"]) == 0
    out = tmp_path / "analysis"
    with redirect_stdout(io.StringIO()):
        assert main(["profile", "analyze", str(TRACES), "--out", str(out), "--no-png", "--jobs", "1", "--gpu",
                     "rtx-pro-6000-ws", "--batch", "32", "--context", "4096", "--tp", "8", "--kv-dtype", "fp8"]) == 0
    md = (out / "breakdown.md").read_text()
    cost = cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(8), 32, 4096)
    for line in cost_model.assumptions(cost):
        assert line in text.getvalue() and f"ceilings assume: {line}" in md, line


@pytest.mark.parametrize("layout,batch,needle", [(cost_model.Layout(3), 8, "does not divide"),
                                                 (cost_model.Layout(8, 79), 8, "exceeds"),
                                                 (cost_model.Layout(8), 0, "batch")])
def test_bad_inputs_are_named(layout, batch, needle):
    with pytest.raises(Glm5Fp4Error, match=needle):
        cost_model.decode_step(Glm5Spec(), RTX, layout, batch, 1024)
