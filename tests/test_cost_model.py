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
DENSE, DENSE_I = 3, 12288  # first_k_dense_replace, intermediate_size
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


@pytest.mark.parametrize("tp", [1, 8])
def test_bf16_dense_weights_are_two_bytes_a_param_and_leave_the_routed_experts_alone(tp):
    """A routed-only checkpoint (GLM-5.1/5.2-NVFP4) keeps the shared experts and dense MLPs in BF16."""
    plain = cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(tp), 64, 2048)
    bf16 = cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(tp), 64, 2048, cost_model.Precisions(dense="bf16"))
    params = {"shared experts": MOE * 3 * H * I / tp, "dense MLPs": DENSE * 3 * H * DENSE_I / tp}
    for name, n in params.items():
        was, now = plain.stages[0].component(name), bf16.stages[0].component(name)
        assert was.weights == pytest.approx(n * NVFP4, rel=1e-12), name
        assert now.weights == pytest.approx(n * 2, rel=1e-12), name
        # streamed once per step: the weights, plus the same activations as before
        assert now.bytes - now.weights == pytest.approx(was.bytes - was.weights, rel=1e-12), name
        assert (was.compute_dtype, now.compute_dtype) == ("nvfp4", "bf16"), name  # BF16 storage: BF16 MMA
    routed = plain.stages[0].component("routed experts"), bf16.stages[0].component("routed experts")
    assert [(c.weights, c.bytes, c.flops, c.compute_dtype) for c in routed] == \
        [(c.weights, c.bytes, c.flops, c.compute_dtype) for c in routed[::-1]]
    said = cost_model.assumptions(bf16)
    assert any(a.startswith("weights: routed experts nvfp4 (0.5625 B/param") and
               "shared experts and dense MLPs bf16 (2 B/param)" in a for a in said)
    assert any(a.startswith("shared experts as separate BF16 linears") for a in said)
    assert any("shared experts and dense MLPs on the bf16 roof" in a for a in said)
    default = cost_model.assumptions(plain)
    assert any(a.startswith("weights: experts, shared experts and dense MLPs nvfp4") for a in default)
    with pytest.raises(Glm5Fp4Error, match="dense weights"):
        cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(tp), 8, 0, cost_model.Precisions(dense="int4"))


SMALL = {"n_routed_experts": 4, "num_hidden_layers": 4, "first_k_dense_replace": 2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from glm5_fp4.checkpoint.make import make_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    return {name: make_checkpoint(root / name, "glm5", seed=1, sizes=SMALL, recipe=recipe, dequantized=twin)
            for name, recipe, twin in [("routed-only", "routed-only", False), ("glm5", "glm5", False),
                                       ("bf16-twin", "routed-only", True)]}


def _other_gemm_bytes(spec: Glm5Spec, dense: str | None) -> float:
    prec = cost_model.Precisions(kv="bf16", dense=dense)
    return cost_model.decode_step(spec, RTX, cost_model.Layout(2), 8, 1024, prec).category_mean("other_gemm")[0]


@pytest.mark.parametrize("config", ["config.json", ""])
def test_profile_analyze_reads_a_routed_only_checkpoints_bf16_dense_mlps(tmp_path, checkpoints, config):
    ckpt = checkpoints["routed-only"]
    c = _ceilings(tmp_path, "--gpu", "rtx-pro-6000-ws", "--batch", "8", "--context", "1024", "--tp", "2",
                  "--config", str(ckpt / config))
    assert (c["shape"]["expert_dtype"], c["shape"]["dense_dtype"]) == ("nvfp4", "bf16")
    spec = Glm5Spec.from_config_json(ckpt / "config.json")
    assert c["categories"]["other_gemm"]["bytes"] == pytest.approx(_other_gemm_bytes(spec, "bf16"), rel=1e-12)
    assert c["categories"]["other_gemm"]["bytes"] > _other_gemm_bytes(spec, None)
    said = c["assumptions"]
    assert any(a.startswith("weights: routed experts nvfp4") and "dense MLPs bf16" in a for a in said)
    assert f"weight dtypes (from {ckpt / 'hf_quant_config.json'}, quant_algo NVFP4): routed experts nvfp4; shared " \
           "experts and dense MLPs bf16" in said


def test_profile_analyze_flags_win_over_the_checkpoint_and_defaults_are_said(tmp_path, checkpoints):
    args = ("--gpu", "rtx-pro-6000-ws", "--batch", "8", "--context", "1024", "--tp", "2")
    c = _ceilings(tmp_path / "a", *args, "--config", str(checkpoints["routed-only"]), "--dense-dtype", "nvfp4")
    assert c["shape"]["dense_dtype"] == "nvfp4"
    assert any("shared experts and dense MLPs nvfp4 (--dense-dtype)" in a for a in c["assumptions"])
    c = _ceilings(tmp_path / "b", *args, "--config", str(checkpoints["glm5"]))
    assert (c["shape"]["expert_dtype"], c["shape"]["dense_dtype"]) == ("nvfp4", "nvfp4")
    twin = checkpoints["bf16-twin"]  # no quantization config: nothing known, today's defaults, said so
    c = _ceilings(tmp_path / "c", *args, "--config", str(twin))
    assert (c["shape"]["expert_dtype"], c["shape"]["dense_dtype"]) == ("nvfp4", None)
    assert any(a.startswith(f"weight dtypes: the defaults ({twin}: no quantization config)") for a in c["assumptions"])


@pytest.mark.parametrize("spelled,kind", [("fp8_e4m3", "fp8"), ("auto", "fp8"), ("fp8_ds_mla", "fp8"),
                                          ("bfloat16", "bf16"), ("fp8", "fp8")])
def test_profile_analyze_takes_the_engines_kv_cache_dtype_spellings(tmp_path, spelled, kind):
    args = ("--gpu", "rtx-pro-6000-ws", "--batch", "32", "--context", "4096", "--tp", "8")
    c = _ceilings(tmp_path / "a", *args, "--kv-dtype", spelled)
    row = _ceilings(tmp_path / "b", *args, "--kv-dtype", kind)
    assert c["categories"]["attention"]["bytes"] == row["categories"]["attention"]["bytes"]
    assert any(a.startswith(f"KV cache ({kind}):") for a in c["assumptions"])
    assert any(a.startswith(f"KV cache dtype: {spelled}") and "(--kv-dtype)" in a for a in c["assumptions"])


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


# -- data-parallel attention + expert parallelism (issue 17) --------------------------------------------------

def _simulated_distinct_gpus(e, k, gpus, trials=4000, seed=3):
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(trials, e, generator=g).topk(k, dim=1).indices // (e // gpus)
    return sum(len(set(row)) for row in picks.tolist()) / trials


def test_distinct_destination_gpus_per_token_match_simulated_routing():
    from glm5_fp4.spec import expected_distinct_groups

    assert expected_distinct_groups(E, K, 8) == pytest.approx(_simulated_distinct_gpus(E, K, 8), rel=0.01)
    assert expected_distinct_groups(E, K, 1) == pytest.approx(1.0)
    assert expected_distinct_groups(E, K, E) == pytest.approx(K)  # one expert per GPU: k GPUs


def _dp8(batch=512, context=2048, skew=0.0):
    return cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(8, dp=8, ep=8), batch, context,
                                  expert_skew=skew)


def test_dp_attention_reads_only_its_own_sequences_and_holds_whole_attention():
    b, ctx, heads = 512 // 8, 2048, 64
    st = _dp8(512, ctx).stages[0]
    assert _dp8().micro_batch == b and _dp8().kv_tokens_per_gpu == b * ctx  # no KV replication
    mla = st.component("MLA core")
    assert mla.bytes == pytest.approx(LAYERS * (b * 2048 * 656 + b * 656 + b * heads * (512 + 64 + 512) * 2), rel=1e-12)
    attention = Glm5Spec().attention_params  # every projection whole on every GPU, BF16
    assert st.component("attention projections").weights == pytest.approx(LAYERS * attention * 2, rel=1e-12)
    assert st.component("all-reduce").calls == 0  # attention TP1: nothing to reduce


def test_expert_parallel_gpus_hold_whole_experts_and_tokens_travel_by_all_to_all():
    cost = _dp8()
    st = cost.stages[0]
    routed = st.component("routed experts")
    assert routed.weights == pytest.approx(MOE * (E // 8) * 3 * H * I * NVFP4, rel=1e-12)  # 32 whole experts
    assert routed.flops == pytest.approx(MOE * 2 * 512 * K / 8 * 3 * H * I, rel=1e-12)  # a balanced eighth of the slots
    remote = _simulated_distinct_gpus(E, K, 8) * 7 / 8
    a2a = st.component("all-to-all")
    assert a2a.calls == 2 * MOE
    # each GPU's 64 tokens to their remote GPUs in BF16, and back in BF16
    assert a2a.bytes == pytest.approx(MOE * 64 * remote * (H * 2 + H * 2), rel=0.01)
    assert a2a.seconds == pytest.approx(2 * MOE * 24e-6 + a2a.bytes / 55e9, rel=1e-12)
    fp8 = cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(8, dp=8, ep=8), 512, 2048,
                                 cost_model.Precisions(dispatch="fp8")).stages[0].component("all-to-all")
    assert fp8.bytes == pytest.approx(a2a.bytes * (H + H / 128 * 4 + 2 * H) / (4 * H), rel=1e-12)


def test_a_hot_expert_parallel_gpu_sets_the_pace_and_tp_does_not_care():
    even, hot = _dp8(), _dp8(skew=0.5)
    assert hot.stages[0].component("routed experts").flops == pytest.approx(
        1.5 * even.stages[0].component("routed experts").flops)
    assert hot.stages[0].component("all-to-all").bytes == pytest.approx(1.5 * even.stages[0].component("all-to-all").bytes)
    tp8 = [cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(8), 512, 2048, expert_skew=s) for s in (0, 0.5)]
    assert tp8[0].step_s == tp8[1].step_s  # every TP rank holds a slice of the hot expert


@pytest.mark.parametrize("layout,needle", [(cost_model.Layout(8, dp=4, ep=8), "dp=1 or dp=8"),
                                           (cost_model.Layout(8, dp=8, ep=1), "ep=8"),
                                           (cost_model.Layout(8, ep=3), "must divide")])
def test_layouts_the_model_does_not_cover_are_refused(layout, needle):
    with pytest.raises(Glm5Fp4Error, match=needle):
        cost_model.decode_step(Glm5Spec(), RTX, layout, 64, 1024)


def test_plan_shows_dp_attention_with_ep_next_to_tp8():
    data = _plan_json("--layouts", "tp8,tp8ep8,dp8ep8", "--concurrency", "512", "--context", "1024",
                      "--expert-skew", "0.2")
    assert list(data["layouts"]) == ["TP8", "TP8+EP8", "DP8+EP8"]
    dp = data["layouts"]["DP8+EP8"]
    assert (dp["dp"], dp["ep"], dp["kv_tokens_needed"]) == (8, 8, 64 * 1024)
    assert dp["components_ms"]["all-to-all"] > 0 and dp["allreduce_calls_per_step"] == 0
    assert any("all-to-all" in a for a in dp["assumptions"]) and any("1.2x" in a for a in dp["assumptions"])
    assert data["layouts"]["TP8"]["components_ms"].get("all-to-all") is None


# -- DP attention + EP as the engines run it over PCIe: all-gather + reduce-scatter (issue 17) ---------------------

def _dp8_agrs(batch=512, context=2048, skew=0.0):
    return cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(8, dp=8, ep=8, ep_comm="agrs"), batch, context,
                                  expert_skew=skew)


def test_gathered_ep_moves_every_token_of_the_group_whatever_the_routing():
    cost = _dp8_agrs()
    st = cost.stages[0]
    assert cost.layout.name == "DP8+EP8(AG/RS)" and st.component("all-reduce").calls == 0
    comm = st.component("all-gather + reduce-scatter")
    # per MoE layer: each GPU receives 7/8 of the 512 gathered BF16 hidden states and sends 7/8 of the 512 BF16
    # partial sums in the reduce-scatter (ring collectives), on the NCCL bus bandwidth, 24 us each
    assert comm.bytes == pytest.approx(MOE * 7 / 8 * 512 * (H * 2 + H * 2), rel=1e-12)
    assert comm.calls == 2 * MOE
    assert comm.seconds == pytest.approx(2 * MOE * 24e-6 + comm.bytes / 38e9, rel=1e-12)
    hot = _dp8_agrs(skew=0.5).stages[0]
    assert hot.component("all-gather + reduce-scatter").bytes == comm.bytes  # skew moves compute, not traffic
    assert hot.component("routed experts").flops == pytest.approx(1.5 * st.component("routed experts").flops)
    # the kernel reads every gathered token and writes its partial sum (zeros for tokens with no local expert)
    routed = st.component("routed experts")
    a2a = _dp8().stages[0].component("routed experts")
    assert routed.weights == a2a.weights and routed.flops == a2a.flops
    assert routed.bytes - a2a.bytes == pytest.approx(
        MOE * 2 * H * 2 * (512 - 512 * _simulated_distinct_gpus(E, K, 8) / 8), rel=0.01)
    # attention, KV and the other GEMMs are the DP layout's whatever the MoE communication
    for name in ("MLA core", "DSA indexer scan", "attention projections", "shared experts"):
        assert st.component(name).bytes == _dp8().stages[0].component(name).bytes, name
    said = cost_model.assumptions(cost)
    assert any("allgather_reducescatter" in a and "--moe-a2a-backend none" in a for a in said)
    # what the step has, not TP's all-reduce; the experts see the tokens of all 8 GPUs, not one GPU's 64
    assert "no all-reduce (attention TP1: data-parallel attention)" in said
    assert not any(a.startswith("all-reduce: 2 per layer") for a in said)
    assert any("= 256.0 of 256" in a and "the 512 tokens of all 8 GPUs" in a for a in said)


def test_gathering_applies_to_data_parallel_attention_only():
    with pytest.raises(Glm5Fp4Error, match="data-parallel attention only"):
        cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(8, ep=8, ep_comm="agrs"), 64, 1024)
    with pytest.raises(Glm5Fp4Error, match="a2a, agrs"):
        cost_model.decode_step(Glm5Spec(), RTX, cost_model.Layout(8, dp=8, ep=8, ep_comm="deepep"), 64, 1024)


@pytest.mark.parametrize("layout,skew", [("dp8ep8", 0.0), ("dp8ep8agrs", 0.3), ("tp8ep8", 0.2)])
def test_plan_and_profile_analyze_agree_on_expert_parallel_layouts(tmp_path, layout, skew):
    plan = _plan_json("--layouts", layout, "--concurrency", "512", "--context", "2048", "--kv-cache-dtype", "fp8",
                      "--expert-skew", str(skew))
    (row,) = plan["layouts"].values()
    ceilings = _ceilings(tmp_path, "--gpu", "rtx-pro-6000-ws", "--batch", "512", "--context", "2048",
                         "--layout", layout, "--expert-skew", str(skew), "--kv-dtype", "fp8")
    assert (ceilings["shape"]["dp"], ceilings["shape"]["ep"]) == (row["dp"], row["ep"])
    for category, cat in ceilings["categories"].items():
        assert row["step_ms"][category] * 1e3 == pytest.approx(cat["floor_us"], rel=1e-9), category
    assert row["step_ms"]["total"] * 1e3 == pytest.approx(ceilings["step_floor_us"], rel=1e-9)
    assert any("expert load" in a for a in ceilings["assumptions"])


def test_profile_analyze_layout_and_tp_do_not_mix(tmp_path, capsys):
    rc = main(["profile", "analyze", str(TRACES), "--out", str(tmp_path / "a"), "--no-png", "--jobs", "1",
               "--batch", "8", "--layout", "dp8ep8", "--tp", "8"])
    assert rc == 1 and "--layout" in capsys.readouterr().err
    rc = main(["profile", "analyze", str(TRACES), "--out", str(tmp_path / "b"), "--no-png", "--jobs", "1",
               "--batch", "8", "--layout", "dp8xx"])
    assert rc == 1 and "--layout: 'dp8xx'" in capsys.readouterr().err


@pytest.mark.parametrize("skew", [float("nan"), float("inf"), -0.1])
def test_expert_skew_must_be_finite_and_non_negative(skew):
    from glm5_fp4.cost_model import Layout, decode_step
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.hardware import get_gpu
    from glm5_fp4.spec import Glm5Spec

    with pytest.raises(Glm5Fp4Error, match="expert skew"):
        decode_step(Glm5Spec(), get_gpu("rtx-pro-6000-ws"), Layout(8, ep=8), 8, 128, expert_skew=skew)
