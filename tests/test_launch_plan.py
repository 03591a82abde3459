"""`glm5-fp4 plan` against numbers computed by hand from GLM-5's config and the 8x RTX PRO 6000 table.

Hand values use the raw config numbers (not Glm5Spec), NVFP4 = 4 bits + one E4M3 scale per 16 = 0.5625 B/param,
RTX PRO 6000 WS: 1792 GB/s, 96 GiB; PCIe NCCL all-reduce 38 GB/s bus bandwidth, 24 us (hardware.md section 3).
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.hardware import get_gpu
from glm5_fp4.cost_model import CATEGORIES, pp_partition
from glm5_fp4.launch.plan import PlanInputs, make_plan
from glm5_fp4.spec import Glm5Spec

LAUNCH = Path(__file__).resolve().parents[1] / "launch"
H, I, E, K, MOE_LAYERS, LAYERS = 6144, 2048, 256, 8, 75, 78
EXPERT_PARAMS = 3 * H * I
NVFP4 = 0.5 + 1 / 16
BW = 1792e9


def plan(tp, pp, c=512, ctx=2048, **kw):
    return make_plan(Glm5Spec(), get_gpu("rtx-pro-6000-ws"), PlanInputs(tp, pp, c, ctx, **kw))


def touched(b):
    return E * (1 - (1 - K / E) ** b)


def x_in_out(tokens):
    """The MoE layer's BF16 input read and output written once (any MoE kernel's minimum traffic)."""
    return 2 * tokens * H * 2


def test_tp8_c512_routed_expert_floor_matches_hand_value():
    p = plan(8, 1)
    routed_bytes = MOE_LAYERS * E * EXPERT_PARAMS * NVFP4 / 8  # every expert is touched at c512
    assert routed_bytes == pytest.approx(50.96e9, rel=1e-3)  # the "~51 GB per GPU per step"
    assert p.heaviest.weights["routed experts"] == pytest.approx(routed_bytes, rel=1e-9)
    step_bytes = routed_bytes * touched(512) / E + MOE_LAYERS * x_in_out(512)
    assert p.routed_expert_bytes_per_step == pytest.approx(step_bytes, rel=1e-9)
    assert step_bytes / BW == pytest.approx(0.0290, rel=1e-2)  # "floor ~28 ms at 1.79 TB/s" + activations
    assert p.per_step("expert_gemm") == pytest.approx(step_bytes / BW, rel=1e-9)
    assert p.bottleneck.category("expert_gemm").bound == "memory"  # AI ~ 2*16/0.5625 = 57 FLOP/B << ridge ~1124


def test_tp4pp2_streams_each_stage_once_per_micro_batch():
    p = plan(4, 2)
    assert p.micro_batch == 256
    # stage 1 (layers 39..77) is all MoE; each GPU holds a quarter of each expert and reads it per micro-batch
    assert p.bottleneck.index == 1 and p.bottleneck.moe_layers == 39
    per_micro_batch = 39 * (touched(256) * EXPERT_PARAMS * NVFP4 / 4 + x_in_out(256))
    assert p.routed_expert_bytes_per_step == pytest.approx(2 * per_micro_batch, rel=1e-9)
    assert p.per_step("expert_gemm") == pytest.approx(2 * per_micro_batch / BW, rel=1e-9)


def test_allreduce_latency_bandwidth_model():
    msg = 512 * H * 2
    one = 24e-6 + 2 * 7 / 8 * msg / 38e9
    # 2 per layer and the vocab-parallel embedding's
    assert plan(8, 1).per_step("allreduce") == pytest.approx((2 * LAYERS + 1) * one, rel=1e-9)
    msg2 = 256 * H * 2
    one2 = 24e-6 + 2 * 3 / 4 * msg2 / 38e9
    # bottleneck stage (the last: no embedding, no hop): 39 layers, 2 all-reduces each, once per micro-batch
    assert plan(4, 2).per_step("allreduce") == pytest.approx(2 * 2 * 39 * one2, rel=1e-9)
    first = plan(4, 2).stages[0]
    hop = 24e-6 + 2 * msg2 / 55e9  # hidden + residual over P2P
    assert first.category("allreduce").seconds == pytest.approx((2 * 39 + 1) * one2 + hop, rel=1e-9)
    assert plan(1, 1, c=8).per_step("allreduce") == 0.0


def test_memory_per_gpu_and_fit():
    tp8 = plan(8, 1)
    w = tp8.heaviest.weights
    assert w["routed experts"] == pytest.approx(MOE_LAYERS * E * EXPERT_PARAMS * NVFP4 / 8, rel=1e-9)
    # attention: q_a (H x 2048) and kv_a (H x 576) replicated, the rest split 8 ways, BF16
    replicated = H * 2048 + H * 576
    split = 2048 * 64 * 256 + 512 * 64 * (192 + 256) + 64 * 256 * H
    assert w["attention projections"] == pytest.approx(LAYERS * (replicated + split / 8) * 2, rel=1e-9)
    # the DSA indexer (wq_b, wk, weights_proj) is replicated: vLLM builds it with ReplicatedLinear
    indexer = 2048 * 32 * 128 + H * 128 + H * 32
    assert w["DSA indexer projections"] == pytest.approx(LAYERS * indexer * 2, rel=1e-9)
    assert w["shared experts"] == pytest.approx(MOE_LAYERS * EXPERT_PARAMS * NVFP4 / 8, rel=1e-9)
    # public figure: ~56-57 GB of weights per GPU at TP8 (hardware/glm5 notes); ours is within that neighbourhood
    assert 52e9 < tp8.heaviest.weights_total < 62e9
    assert tp8.weights_fit()
    assert not plan(4, 1).weights_fit()  # "TP4 alone does not fit"
    usable = 96 * 2**30 * 0.90 - 2 * 2**30
    assert tp8.usable_bytes == pytest.approx(usable)


def test_kv_cache_bytes_and_capacity():
    fp8_row = 512 + 512 // 128 * 4 + 64 * 2  # 656: vLLM fp8_ds_mla / SGLang DSA FP8 row
    indexer = 128 + 4
    tp8 = plan(8, 1)
    assert tp8.heaviest.kv_bytes_per_token == LAYERS * (fp8_row + indexer)
    cap = int((tp8.usable_bytes - tp8.heaviest.weights_total) / (LAYERS * (fp8_row + indexer)))
    assert tp8.kv_capacity_tokens() == cap
    # TP4+PP2: each stage holds only its 39 layers' KV -> about twice the tokens
    assert plan(4, 2).heaviest.kv_bytes_per_token == 39 * (fp8_row + indexer)
    bf16 = plan(8, 1, kv_cache_dtype="bfloat16")
    assert bf16.heaviest.kv_bytes_per_token == LAYERS * ((512 + 64) * 2 + indexer)
    # TP4+PP2 holds about twice TP8's tokens; 512 sequences at 1024 tokens (524,288) fit only there
    assert plan(4, 2).kv_capacity_tokens() == pytest.approx(2 * cap, rel=0.02)
    assert not plan(8, 1, ctx=1024).fits() and plan(4, 2, ctx=1024).fits()


def test_attention_kv_read_grows_with_context():
    short, long = plan(8, 1, ctx=1024), plan(8, 1, ctx=2048)
    assert long.kv_read_bytes_per_step == pytest.approx(2 * short.kv_read_bytes_per_step)
    # beyond index_topk only the indexer keys keep growing (DSA selects 2048 tokens)
    a, b = plan(8, 1, ctx=4096), plan(8, 1, ctx=8192)
    per_token_ctx = 512 * LAYERS * 132
    assert b.kv_read_bytes_per_step - a.kv_read_bytes_per_step == pytest.approx(4096 * per_token_ctx)
    # the attention category streams those reads (plus the new rows and the queries)
    grown = b.bottleneck.category("attention").bytes - a.bottleneck.category("attention").bytes
    assert grown == pytest.approx(4096 * per_token_ctx)


def test_pp_partition_matches_vllm():
    from vllm.distributed.utils import get_pp_indices

    for layers, pp in ((78, 2), (78, 4), (78, 3), (61, 4), (5, 5)):
        assert pp_partition(layers, pp) == [get_pp_indices(layers, r, pp) for r in range(pp)]


def test_step_time_is_the_sum_of_parts_and_tokens_per_s():
    p = plan(8, 1)
    parts = sum(p.per_step(cat) for cat in CATEGORIES)
    assert p.step_s == pytest.approx(parts)
    assert p.tokens_per_s == pytest.approx(512 / p.step_s)
    pp = plan(4, 2)
    assert pp.step_s == pytest.approx(2 * max(s.seconds for s in pp.stages))


def test_every_assumption_is_stated():
    text = "\n".join(plan(4, 2).assumptions)
    for needle in ("0.5625", "38 GB/s", "24 us", "55 GB/s", "656 B", "index_topk", "micro-batch", "0.90 x the datasheet's 96 GB read as GiB",
                   "replicated", "BF16", "no launch gaps"):
        assert needle in text, needle


def test_gpu_without_interconnect_numbers_needs_flags():
    with pytest.raises(Glm5Fp4Error, match="--allreduce-gbs"):
        make_plan(Glm5Spec(), get_gpu("h200"), PlanInputs(8, 1, 512, 2048))
    h200 = make_plan(Glm5Spec(), get_gpu("h200"), PlanInputs(8, 1, 512, 2048, allreduce_gbs=360,
                                                              allreduce_latency_us=10))
    assert any("expert GEMMs on the bf16 roof" in a for a in h200.assumptions)  # no FP4 tensor cores: W4A16


def test_plan_cli_side_by_side_and_json():
    from glm5_fp4.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", "--profile", str(LAUNCH / "tp8.yaml")]) == 0
    text = out.getvalue()
    header = next(line for line in text.splitlines() if "TP8" in line and "TP4+PP2" in line)
    assert header.index("TP8") < header.index("TP4+PP2")
    assert "Assumptions:" in text and "expert GEMM (routed)" in text and "50.96" in text
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", "--profile", str(LAUNCH / "tp4pp2-sglang.yaml"), "--json", "--layouts", "tp8",
                     "--concurrency", "64", "--context", "4096"]) == 0
    data = json.loads(out.getvalue())
    assert list(data["layouts"]) == ["TP8"]
    tp8 = data["layouts"]["TP8"]
    assert tp8["concurrency"] == 64 and tp8["context"] == 4096
    assert tp8["routed_expert_bytes_per_step"] == pytest.approx(
        MOE_LAYERS * (touched(64) * EXPERT_PARAMS * NVFP4 / 8 + x_in_out(64)))


def test_plan_cli_rejects_bad_layout(capsys):
    from glm5_fp4.cli import main

    assert main(["plan", "--layouts", "tp8,pp2"]) == 1
    assert "pp2" in capsys.readouterr().err


# -- the layouts of the expert-parallel profiles (issue 17) -----------------------------------------------------

def _plan_json(*args: str) -> dict:
    from glm5_fp4.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", "--json", *args]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("name,layout,dp,ep,comm", [
    ("dp8ep8.yaml", "DP8+EP8(AG/RS)", 8, 8, "agrs"), ("dp8ep8-sglang.yaml", "DP8+EP8(AG/RS)", 8, 8, "agrs"),
    ("tp8ep8.yaml", "TP8+EP8", 1, 8, "a2a"), ("tp8ep8-sglang.yaml", "TP8+EP8", 1, 8, "a2a")])
def test_plan_profile_uses_the_layout_the_profile_serves(name, layout, dp, ep, comm):
    data = _plan_json("--profile", str(LAUNCH / name), "--context", "1024")
    assert list(data["layouts"])[0] == layout and list(data["layouts"])[1:] == ["TP8", "TP4+PP2"]
    row = data["layouts"][layout]
    assert (row["tp"], row["dp"], row["ep"], row["ep_comm"], row["concurrency"]) == (8, dp, ep, comm, 512)
    assert (row["components_ms"].get("all-gather + reduce-scatter", 0) > 0) == (comm == "agrs")
    assert row["components_ms"].get("all-to-all", 0) == 0


def test_a_dp_profile_with_a_true_all_to_all_is_planned_as_one():
    from glm5_fp4.launch.profile import profile_from_dict
    from glm5_fp4.launch.plan_cli import profile_layout

    p = profile_from_dict({"model": "/m", "data_parallel": 8, "expert_parallel": True, "moe_backend": "cutlass",
                           "extra_args": ["--all2all-backend", "deepep_low_latency"]})
    assert profile_layout(p) == (8, 1, 8, 8, "a2a")
    assert profile_layout(p.model_copy(update={"extra_args": []})) == (8, 1, 8, 8, "agrs")
    sg = profile_from_dict({"model": "/m", "engine": "sglang", "data_parallel": 8, "expert_parallel": True,
                            "moe_backend": "flashinfer_cutlass", "extra_args": ["--moe-a2a-backend=deepep"]})
    assert profile_layout(sg)[-1] == "a2a"


def test_dp_attention_sequences_that_fit_count_every_gpu():
    dp = plan(8, 1, ctx=2048, dp=8, ep=8, ep_comm="agrs")
    fp8_row, indexer = 656, 132
    per_gpu = int((dp.usable_bytes - dp.heaviest.weights_total) / (LAYERS * (fp8_row + indexer)))
    assert dp.kv_capacity_tokens() == per_gpu
    assert dp.kv_tokens_needed == 512 // 8 * 2048  # each GPU keeps only its own 64 sequences
    assert dp.max_sequences() == per_gpu // 2048 * 8
    assert plan(8, 1, ctx=2048).max_sequences() == plan(8, 1, ctx=2048).kv_capacity_tokens() // 2048  # TP: replicated


def _plan_one_json(*argv: str, layout: str = "tp8") -> dict:
    from glm5_fp4.cli import main as cli_main

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli_main(["plan", "--layouts", layout, "--json", *argv]) == 0
    return json.loads(buf.getvalue())


def _weights_gib(out: dict) -> float:
    (layout,) = out["layouts"].values()
    return sum(layout["weights_bytes_per_gpu"].values()) / 2**30


def test_plan_prices_bf16_shared_experts_and_dense_mlps(tmp_path):
    """GLM-5.1/5.2-NVFP4 (the routed-only recipe) keep shared experts and dense MLPs in BF16: given by flag or read
    from the checkpoint, each GPU holds their params x (2 - 0.5625) B more than nvidia/GLM-5-NVFP4's layout."""
    from glm5_fp4.checkpoint.make import make_checkpoint

    spec = Glm5Spec()
    extra = (spec.dense_layers * spec.dense_mlp_params + spec.moe_layers * spec.n_shared_experts
             * spec.expert_params) * (2 - 0.5625) / 8 / 2**30
    base, flagged = _plan_one_json(), _plan_one_json("--dense-dtype", "bf16")
    assert _weights_gib(flagged) - _weights_gib(base) == pytest.approx(extra, rel=1e-3)
    ckpt = make_checkpoint(tmp_path / "ro", recipe="routed-only")
    cfg = str(ckpt / "config.json")  # the tiny model has 4 heads: TP2
    from_ckpt = _plan_one_json("--config", cfg, layout="tp2")
    assert _weights_gib(from_ckpt) == pytest.approx(_weights_gib(_plan_one_json("--config", cfg, "--dense-dtype", "bf16",
                                                                                 layout="tp2")))
    assert _weights_gib(_plan_one_json("--config", cfg, "--dense-dtype", "nvfp4", layout="tp2")) < _weights_gib(from_ckpt)


# -- bad input: one clear error, never a plan of some other model or an impossible number --------------------------

@pytest.mark.parametrize("content,culprit", [
    ({}, "hidden_size"),
    # a load-test summary: valid JSON, no model in it
    ({"num_prompts": 512, "duration": 26.1, "output_throughput": 4100.0}, "hidden_size"),
    ([1, 2], "not a JSON object"),
])
def test_plan_config_that_is_not_a_model_config_is_one_error(tmp_path, capsys, content, culprit):
    from glm5_fp4.cli import main

    cfg = tmp_path / "summary.json"
    cfg.write_text(json.dumps(content))
    assert main(["plan", "--config", str(cfg)]) == 1
    out, err = capsys.readouterr()
    assert not out and str(cfg) in err and culprit in err and "Traceback" not in err


def test_plan_config_missing_a_required_field_names_it(tmp_path, capsys):
    from glm5_fp4.cli import main

    cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 256,
           "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128, "kv_lora_rank": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "num_hidden_layers" in err
    path.write_text(json.dumps({**cfg, "num_hidden_layers": "78"}))
    assert main(["plan", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "num_hidden_layers" in err and "integer" in err


@pytest.mark.parametrize("argv,option", [
    (["--allreduce-gbs", "-1"], "--allreduce-gbs"),
    (["--allreduce-gbs", "0"], "--allreduce-gbs"),
    (["--allreduce-gbs", "nan"], "--allreduce-gbs"),
    (["--allreduce-latency-us", "-100"], "--allreduce-latency-us"),
    (["--allreduce-latency-us", "inf"], "--allreduce-latency-us"),
    (["--expert-skew", "inf", "--layouts", "tp8ep8"], "--expert-skew"),
    (["--expert-skew", "-0.5", "--layouts", "tp8ep8"], "--expert-skew"),
    (["--reserve-gib", "-50"], "--reserve-gib"),
    (["--reserve-gib", "nan"], "--reserve-gib"),
    (["--concurrency", "0"], "--concurrency"),
    (["--context", "-1"], "--context"),
    (["--mem-util", "nan"], "--mem-util"),
    (["--efficiency", "1.5"], "--efficiency"),
])
def test_plan_rejects_impossible_numbers_while_parsing(capsys, argv, option):
    from glm5_fp4.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["plan", *argv])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert not out and option in err and "Traceback" not in err


@pytest.mark.parametrize("layouts", [",", " , ,", ""])
def test_plan_layouts_naming_no_layout_is_one_error(capsys, layouts):
    from glm5_fp4.cli import main

    assert main(["plan", "--layouts", layouts]) == 1
    out, err = capsys.readouterr()
    assert not out and "--layouts" in err


def test_make_plan_rejects_impossible_inputs_given_programmatically():
    for kw, culprit in (({"reserve_gib": float("nan")}, "reserve"), ({"reserve_gib": -1.0}, "reserve"),
                        ({"allreduce_gbs": -1.0, "allreduce_latency_us": 10.0}, "all-reduce"),
                        ({"allreduce_gbs": 0.0, "allreduce_latency_us": 10.0}, "all-reduce"),
                        ({"allreduce_gbs": 38.0, "allreduce_latency_us": -100.0}, "all-reduce"),
                        ({"allreduce_gbs": float("nan"), "allreduce_latency_us": 10.0}, "all-reduce")):
        with pytest.raises(Glm5Fp4Error, match=culprit):
            plan(8, 1, **kw)


@pytest.mark.parametrize("gpu,engine,want", [
    ("rtx-pro-6000-ws", "vllm", "fp8"),    # FLASHINFER_MLA_SPARSE_SM120 turns auto into fp8_ds_mla
    ("h200", "vllm", "bf16"),              # FLASHMLA_SPARSE keeps auto: the model's dtype
    ("b200", "vllm", "bf16"),
    ("rtx-pro-6000-ws", "sglang", "fp8"),  # SGLang: fp8_e4m3 on SM >= 10, else bfloat16
    ("b200", "sglang", "fp8"),
    ("h200", "sglang", "bf16"),
])
def test_auto_kv_cache_dtype_resolves_as_the_engine_does_on_that_gpu(gpu, engine, want):
    """kv_cache_dtype=auto was priced as FP8 everywhere; on an H200 both engines keep BF16 rows (1.63x the bytes:
    capacity overstated by that much). Resolved per engine and GPU, and said in the assumptions."""
    p = make_plan(Glm5Spec(), get_gpu(gpu), PlanInputs(8, 1, 128, 8192, engine=engine,
                                                       allreduce_gbs=300, allreduce_latency_us=10))
    assert p.kv_kind == want
    said = next(a for a in p.assumptions if a.startswith("KV cache:"))
    assert f"kv_cache_dtype=auto -> {want}" in said and "auto" in said


def test_a_context_past_the_models_maximum_is_refused():
    """GLM-5's max_position_embeddings is 202,752 (config.json); vLLM refuses a longer max_model_len, and plan said a
    400,000-token context 'fits'. A config's own limit is taken from it."""
    with pytest.raises(Glm5Fp4Error, match="context 400000 exceeds the model's max_position_embeddings 202752"):
        plan(8, 1, c=1, ctx=400_000)
    assert plan(8, 1, c=1, ctx=202_752).kv_kind
    assert Glm5Spec.from_config({"hidden_size": 64, "num_hidden_layers": 2, "moe_intermediate_size": 32,
                                 "n_routed_experts": 4, "num_experts_per_tok": 2, "kv_lora_rank": 16, "first_k_dense_replace": 1,
                                 "max_position_embeddings": 8192}).max_position_embeddings == 8192


def test_expert_skew_on_a_layout_without_ep_is_said_to_do_nothing():
    p = plan(8, 1, c=64, expert_skew=0.5)
    assert any("expert skew 0.5" in a and "expert parallelism only" in a for a in p.assumptions), p.assumptions
    assert not any("expert skew" in a for a in plan(8, 1, c=64).assumptions)


def test_nvfp4_ds_mla_only_where_flashmla_serves_it():
    """vLLM's nvfp4_ds_mla row is SM100 FlashMLA's; plan priced it on an RTX PRO 6000 (+63 % capacity) with only a
    parenthesis in the assumptions to say it cannot run there."""
    with pytest.raises(Glm5Fp4Error, match="nvfp4_ds_mla.*sm_100"):
        plan(8, 1, kv_cache_dtype="nvfp4_ds_mla")
    b200 = make_plan(Glm5Spec(), get_gpu("b200"), PlanInputs(8, 1, 64, 2048, kv_cache_dtype="nvfp4_ds_mla",
                                                             allreduce_gbs=300, allreduce_latency_us=10))
    assert b200.kv_kind == "nvfp4_ds_mla"


def test_plan_prices_the_routed_experts_in_the_checkpoints_dtype(tmp_path):
    """An FP8 checkpoint was planned with NVFP4 routed experts (the dtype read from --config was thrown away, only
    the dense one kept), while `profile analyze` on the same config priced them FP8."""
    from glm5_fp4.checkpoint.make import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8",
                                  "exclude_modules": ["lm_head", "model.layers.*.self_attn*"]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "hf_quant_config.json").unlink()
    fp8 = _plan_one_json("--config", str(ckpt), layout="tp2")
    flagged = _plan_one_json("--config", str(ckpt), "--expert-dtype", "fp8", "--dense-dtype", "fp8", layout="tp2")
    nvfp4 = _plan_one_json("--config", str(ckpt), "--expert-dtype", "nvfp4", layout="tp2")
    assert _weights_gib(fp8) == pytest.approx(_weights_gib(flagged))
    (routed8,), (routed4,) = ([lay["weights_bytes_per_gpu"]["routed experts"] for lay in o["layouts"].values()]
                              for o in (fp8, nvfp4))
    assert routed8 / routed4 == pytest.approx(1 / 0.5625)  # 1 B a parameter against 4 bits + an E4M3 per 16
    (layout,) = fp8["layouts"].values()
    assert any("routed experts fp8" in a for a in layout["assumptions"]), layout["assumptions"]


@pytest.mark.parametrize("skew", [7.5, 100.0])
def test_expert_skew_past_every_slot_on_one_gpu_is_refused(skew):
    """--expert-skew 1e300 planned an infinite step (JSON 'Infinity'); the hottest of 8 EP GPUs can hold at most all
    token-slots: 8x the mean, a skew of 7."""
    with pytest.raises(Glm5Fp4Error, match=r"expert skew .* at most 7 with 8-way expert parallelism"):
        plan(8, 1, c=512, dp=8, ep=8, expert_skew=skew)
    plan(8, 1, c=512, dp=8, ep=8, expert_skew=7.0)


def test_the_all_to_all_never_moves_more_than_every_other_gpus_tokens():
    """The hottest GPU receives each other GPU's token at most once: at skew 3 the all-to-all (43 ms) cost more than
    gathering every token to every GPU (25 ms), which moves exactly that."""
    def moved(skew, comm="a2a"):
        p = plan(8, 1, c=512, dp=8, ep=8, expert_skew=skew, ep_comm=comm)
        (c,) = [c for c in p.heaviest.components if c.name in ("all-to-all", "all-gather + reduce-scatter")]
        return c.bytes

    every_other = moved(0.0, "agrs")  # (ep - 1) / ep of all tokens: each other GPU's 64, once
    assert moved(0.0) < moved(0.3) <= every_other
    for skew in (1.0, 3.0, 7.0):
        assert moved(skew) == pytest.approx(every_other, rel=1e-9)


def test_usable_memory_starts_from_what_the_driver_reports_where_the_table_has_it():
    """The H200's '141 GB' was taken as 141 GiB (151.4e9 B) while its driver reports 150,109,880,320 B (the committed
    traces' totalGlobalMem): 1.16 GB of KV the engine never gets. vLLM sizes from the driver's figure."""
    h200 = get_gpu("h200")
    assert h200.memory_total_bytes == 150_109_880_320
    p = make_plan(Glm5Spec(), h200, PlanInputs(8, 1, 64, 2048, allreduce_gbs=300.0, allreduce_latency_us=10.0))
    assert p.usable_bytes == pytest.approx(150_109_880_320 * 0.90 - 2.0 * 2**30)
    assert any("150.1 GB the driver reports" in a for a in p.assumptions), p.assumptions
    rtx = get_gpu("rtx-pro-6000-ws")  # no driver figure in the table: the datasheet's, said as such
    p = plan(8, 1)
    assert rtx.memory_total_bytes is None
    assert p.usable_bytes == pytest.approx(rtx.memory_gb * 2**30 * 0.90 - 2.0 * 2**30)
    assert any("datasheet" in a for a in p.assumptions), p.assumptions


def test_the_skew_cap_counts_the_experts_a_gpu_holds():
    """With fewer experts per GPU than top-k, the hottest GPU holds at most E/ep of a token's k slots: 16 experts,
    top-4, EP8 hold 2 a GPU, so the hottest has at most 2/4 x 8 = 4x the mean (skew 3); 7 was accepted."""
    spec = Glm5Spec.from_config({"hidden_size": 64, "num_hidden_layers": 2, "moe_intermediate_size": 32,
                                 "n_routed_experts": 16, "num_experts_per_tok": 4, "kv_lora_rank": 16,
                                 "first_k_dense_replace": 1, "num_attention_heads": 8})
    inputs = dict(allreduce_gbs=30.0, allreduce_latency_us=10.0, dp=8, ep=8)
    make_plan(spec, get_gpu("rtx-pro-6000-ws"), PlanInputs(8, 1, 64, 512, expert_skew=3.0, **inputs))
    with pytest.raises(Glm5Fp4Error, match=r"at most 3 with 8-way expert parallelism"):
        make_plan(spec, get_gpu("rtx-pro-6000-ws"), PlanInputs(8, 1, 64, 512, expert_skew=3.5, **inputs))
