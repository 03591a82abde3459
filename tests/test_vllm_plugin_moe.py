"""The `glm5_nvfp4` MoE method at layer level: backend choice, fallback, loading checks, W4A4 emulation.

Layers are built by hand (parameters as vLLM holds them after loading ModelOpt NVFP4 experts), so these run
without a server; tests/server/ covers the same code inside real vLLM.
"""

from __future__ import annotations

import logging
import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from glm5_fp4 import backends  # noqa: E402
from glm5_fp4.engines import vllm_plugin  # noqa: E402
from glm5_fp4.errors import Glm5Fp4Error  # noqa: E402
from glm5_fp4.reference import moe_reference, random_experts, route  # noqa: E402
from glm5_fp4.tolerances import moe_tolerance  # noqa: E402

vllm_plugin.register()

import vllm.model_executor.layers.quantization.modelopt as modelopt  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402

from glm5_fp4.engines.vllm import loading, moe as moe_mod  # noqa: E402
from glm5_fp4.engines.vllm.config import Glm5NvFp4Config  # noqa: E402
from glm5_fp4.settings import PluginSettings  # noqa: E402

E, H, I, K = 8, 128, 64, 2
NVFP4_FLAT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": []}


def fake_moe_config(device="cpu", **over):
    cfg = dict(num_local_experts=E, num_experts=E, hidden_dim=H, hidden_dim_unpadded=H, intermediate_size=I,
               intermediate_size_per_partition=I, experts_per_token=K, activation=MoEActivation.SILU,
               is_act_and_mul=True, has_bias=False, in_dtype=torch.bfloat16, device=device, is_lora_enabled=False,
               moe_parallel_config=SimpleNamespace(use_ep=False, tp_size=1))
    cfg.update(over)
    return SimpleNamespace(**cfg)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def moe_log():
    handler = _Records()
    logger = logging.getLogger(moe_mod.logger.name)
    logger.addHandler(handler)
    moe_mod._LOGGED.clear()
    yield handler.records
    logger.removeHandler(handler)


@pytest.fixture
def fake_kernels(monkeypatch):
    module = types.ModuleType("glm5_fp4.kernels")
    module.prepare_experts = lambda experts: None
    monkeypatch.setitem(sys.modules, "glm5_fp4.kernels", module)
    real = backends.importlib.util.find_spec
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda n, *a: object() if n == "triton" else real(n, *a))


# -- choice of backend and mode -------------------------------------------------------------------

@pytest.mark.parametrize("native,mode", [("0", "w4a16"), ("1", "w4a4")])
def test_fake_cuda_device_selects_triton_on_sm120_w4a4_only_with_the_native_path(fake_kernels, monkeypatch, native,
                                                                                  mode):
    monkeypatch.setenv("GLM5_FP4_NATIVE_FP4", native)
    sel = moe_mod.choose(PluginSettings(), fake_moe_config("cuda"), True, torch.device("cuda"), 120)
    assert sel.backend.name == "triton" and sel.mode == mode


# (backend, mode) the adapter must decide on a CUDA GPU of each capability, for a checkpoint with input scales:
# Ampere falls back to vLLM's own NVFP4 path (Marlin), Ada/Hopper run our kernel weight-only, Blackwell too
# unless the native FP4 path is on (GLM5_FP4_NATIVE_FP4=1: W4A4 on its FP4 tensor cores; emulated W4A4 is slower
# than W4A16, glm5_fp4.kernels.capability.fp4_mma_serves).
DECISIONS = {80: (None, "w4a16"), 86: (None, "w4a16"), 89: ("triton", "w4a16"), 90: ("triton", "w4a16"),
             100: ("triton", "w4a16"), 120: ("triton", "w4a16")}
NATIVE_DECISIONS = {**DECISIONS, 100: ("triton", "w4a4"), 120: ("triton", "w4a4")}


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("capability", sorted(DECISIONS))
def test_the_adapter_decision_per_gpu_capability(capability, native, monkeypatch):
    monkeypatch.setenv("GLM5_FP4_NATIVE_FP4", "1" if native else "0")
    moe = fake_moe_config("cuda", hidden_dim=256, hidden_dim_unpadded=256, intermediate_size=128,
                          intermediate_size_per_partition=128)  # a shape the real kernel tiles
    sel = moe_mod.choose(PluginSettings(), moe, True, torch.device("cuda"), capability)
    want = (NATIVE_DECISIONS if native else DECISIONS)[capability]
    assert (sel.backend.name if sel.backend else None, sel.mode) == want, sel.reason
    if sel.backend is None:
        assert "sm_89" in sel.reason


def test_fake_cuda_device_without_the_kernel_falls_back_with_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "glm5_fp4.kernels", None)  # import fails as if the kernel were absent
    real = backends.importlib.util.find_spec
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda n, *a: object() if n == "triton" else real(n, *a))
    sel = moe_mod.choose(PluginSettings(), fake_moe_config("cuda"), True, torch.device("cuda"), 120)
    assert sel.backend is None and "triton: glm5_fp4.kernels cannot be imported" in sel.reason


def test_lora_layers_are_not_ours_expert_parallel_ones_are():
    sel = moe_mod.choose(PluginSettings(), fake_moe_config(is_lora_enabled=True), True, torch.device("cpu"), None)
    assert sel.backend is None and "LoRA" in sel.reason
    ep = fake_moe_config(moe_parallel_config=SimpleNamespace(use_ep=True, tp_size=1))
    sel = moe_mod.choose(PluginSettings(), ep, True, torch.device("cpu"), None)
    assert sel.backend is not None, sel.reason


def _ep_config(dp=8, backend="allgather_reducescatter", **over):
    par = SimpleNamespace(use_ep=True, tp_size=1, dp_size=dp, ep_size=8, all2all_backend=backend)
    return fake_moe_config(moe_parallel_config=par, num_experts=8 * E, **over)


@pytest.mark.parametrize("backend", ["deepep_low_latency", "deepep_high_throughput", "flashinfer_nvlink_two_sided"])
def test_dp_expert_parallel_under_another_all_to_all_falls_back_with_the_reason(backend):
    """Behind data parallelism vLLM hands our method (no modular kernel) its naive dispatch, which only the
    allgather_reducescatter manager implements: any other backend is vLLM's own kernels' job."""
    sel = moe_mod.choose(PluginSettings(), _ep_config(backend=backend), True, torch.device("cpu"), None)
    assert sel.backend is None and f"--all2all-backend {backend}" in sel.reason
    assert moe_mod.choose(PluginSettings(), _ep_config(), True, torch.device("cpu"), None).backend is not None
    # without data parallelism the all2all backend is never used: TP + EP is ours whatever it says
    assert moe_mod.choose(PluginSettings(), _ep_config(dp=1, backend=backend), True, torch.device("cpu"),
                          None).backend is not None


def test_dp_expert_parallel_layers_log_their_expert_split(monkeypatch, moe_log):
    monkeypatch.setenv("GLM5_FP4_BACKEND", "reference")
    logger = logging.getLogger(moe_mod.logger.name)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        moe_mod.Glm5ModelOptNvFp4FusedMoE(Glm5NvFp4Config.from_config(NVFP4_FLAT), _ep_config())
    finally:
        logger.setLevel(level)
    (line,) = [r.getMessage() for r in moe_log if r.levelno == logging.INFO]
    assert "run on backend reference" in line
    assert f"expert parallel: {E} of {8 * E} experts on this rank (EP8), tokens of 8 DP ranks all-gathered" in line
    assert moe_mod.describe_parallelism(_ep_config(dp=1)).endswith("partial sums all-reduced")
    assert moe_mod.describe_parallelism(fake_moe_config()) == ""


def test_buffers_are_reserved_for_the_tokens_every_dp_rank_gathers(monkeypatch):
    import vllm.config

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=2048))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)
    assert moe_mod._max_batched_tokens(_ep_config()) == 8 * 2048
    assert moe_mod._max_batched_tokens(_ep_config(dp=1)) == 2048
    assert moe_mod._max_batched_tokens(fake_moe_config()) == 2048


def test_expert_parallel_layer_uses_the_layers_expert_map(monkeypatch):
    """vLLM routes to global ids and keeps RoutedExperts.expert_map (global -> local or -1) on the layer; the
    method hands it to the backend, so a rank with half the experts returns its local partial sum."""
    layer, ex, x, w, ids = _loaded_layer(8)
    emap = torch.full((2 * E,), -1, dtype=torch.int32)  # 2E global experts, this rank holds the odd ones
    emap[1::2] = torch.arange(E, dtype=torch.int32)
    layer.expert_map = emap
    g = torch.Generator().manual_seed(9)
    gids = torch.stack([torch.randperm(2 * E, generator=g)[:K] for _ in range(x.shape[0])]).to(torch.int32)
    method = _method(monkeypatch, "reference", "w4a16")
    method.process_weights_after_loading(layer)
    got = method.apply(layer, x, w, gids, None, None)
    local = emap[gids.long()]
    want = moe_reference(x, torch.where(local >= 0, w, 0.0), local.clamp_min(0), ex, mode="w4a16")
    assert _rel(got, want) < 1e-6


def test_unsupported_layer_falls_back_to_vllm_selection_with_one_logged_reason(monkeypatch, moe_log):
    calls = []

    def fake_select(config, weight_key, activation_key):
        calls.append(config)
        return modelopt.NvFp4MoeBackend.MARLIN, None

    monkeypatch.setattr(modelopt, "select_nvfp4_moe_backend", fake_select)
    monkeypatch.setenv("GLM5_FP4_BACKEND", "triton")  # the Triton kernel cannot serve a CPU layer
    qc = Glm5NvFp4Config.from_config(NVFP4_FLAT)
    methods = [moe_mod.Glm5ModelOptNvFp4FusedMoE(qc, fake_moe_config()) for _ in range(3)]
    assert len(calls) == 3 and all(m.glm5_backend is None for m in methods)
    assert methods[0].nvfp4_backend == modelopt.NvFp4MoeBackend.MARLIN  # vLLM's own choice is in charge
    lines = [r.getMessage() for r in moe_log if r.levelno == logging.WARNING]
    assert len(lines) == 1, lines  # one line, not one per layer
    assert "falling back to vLLM's own NVFP4 MoE backend selection" in lines[0] and "CUDA" in lines[0]


# -- the method on a hand-built layer -------------------------------------------------------------

def _loaded_layer(seed: int, h: int = H, i: int = I):
    """A module holding ModelOpt NVFP4 expert parameters as vLLM's loader leaves them, and the experts."""
    g = torch.Generator().manual_seed(seed)
    ex = random_experts(E, h, i, generator=g)
    layer = torch.nn.Module()
    params = {
        "w13_weight": ex.w13, "w13_weight_scale": ex.w13_scale,
        "w13_weight_scale_2": ex.w13_global[:, None].repeat(1, 2),
        "w2_weight": ex.w2, "w2_weight_scale": ex.w2_scale, "w2_weight_scale_2": ex.w2_global,
        "w13_input_scale": ex.a13_scale[:, None].repeat(1, 2), "w2_input_scale": ex.a2_scale,
    }
    for name, t in params.items():
        layer.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    layer.layer_name = "model.layers.1.mlp.experts"
    x = torch.randn(48, h, generator=g).to(torch.bfloat16)
    w, ids = route(torch.randn(48, E, generator=g), None, top_k=K, routed_scaling_factor=2.5)
    return layer, ex, x, w.float(), ids.to(torch.int32)


def _method(monkeypatch, backend: str, mode: str):
    monkeypatch.setenv("GLM5_FP4_BACKEND", backend)
    monkeypatch.setenv("GLM5_FP4_MODE", mode)
    return moe_mod.Glm5ModelOptNvFp4FusedMoE(Glm5NvFp4Config.from_config(NVFP4_FLAT), fake_moe_config())


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# W4A4 emulation inside vLLM vs the float32 reference MoE in W4A4 mode (glm5_fp4/tolerances.py says why the bound
# is what it is). The plugin computes in float32 from exact FP4 weights (as Blackwell's FP4 MMA does), so the only
# difference is the layer output being rounded to the model dtype (BF16): measured 0.16-0.17 %.
# For scale, W4A4 and W4A16 outputs of these layers differ by ~40 %.
W4A4_TOLERANCE = moe_tolerance("w4a4", torch.bfloat16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_w4a4_emulation_matches_the_reference_moe_w4a4(monkeypatch, seed):
    layer, ex, x, w, ids = _loaded_layer(seed)
    method = _method(monkeypatch, "dequant", "w4a4")
    assert method.glm5_backend.name == "dequant" and method.glm5_mode == "w4a4"
    method.process_weights_after_loading(layer)
    got = method.apply(layer, x, w, ids, None, None)
    assert got.dtype == x.dtype and got.shape == x.shape
    ref_a4 = moe_reference(x, w, ids, ex, mode="w4a4")
    ref_a16 = moe_reference(x, w, ids, ex, mode="w4a16")
    err = _rel(got, ref_a4)
    assert err < W4A4_TOLERANCE, err
    assert _rel(got, ref_a16) > 10 * W4A4_TOLERANCE  # and it is W4A4, not weight-only


def test_reference_backend_inside_the_method_is_the_reference(monkeypatch):
    layer, ex, x, w, ids = _loaded_layer(3)
    method = _method(monkeypatch, "reference", "w4a16")
    method.process_weights_after_loading(layer)
    got = method.apply(layer, x, w, ids, None, None)
    assert torch.equal(got, moe_reference(x, w, ids, ex, mode="w4a16"))


def test_a_scale_missing_from_the_checkpoint_is_named(monkeypatch):
    layer, *_ = _loaded_layer(4)
    layer.w2_weight_scale_2.data[5] = math.nan  # the sentinel create_weights leaves in never-loaded scales
    method = _method(monkeypatch, "reference", "w4a16")
    with pytest.raises(Glm5Fp4Error, match=r"model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight_scale_2 was "
                                           r"never loaded"):
        method.process_weights_after_loading(layer)


# -- loader checks --------------------------------------------------------------------------------

def _expert_loader():
    seen = []
    return loading.checked_expert_loader(lambda *a, **k: seen.append((a, k)) or True, hidden=H, inter=I), seen


def test_expert_loader_passes_well_formed_tensors_through():
    load, seen = _expert_loader()
    name = "model.layers.1.mlp.experts.w13_weight"
    assert load(None, torch.zeros(I, H // 2, dtype=torch.uint8), name, shard_id="w3", expert_id=3, return_success=True)
    load(None, torch.zeros(H, I // 16, dtype=torch.float8_e4m3fn), "model.layers.1.mlp.experts.w2_weight_scale",
         shard_id="w2", expert_id=0)
    for scalar in (torch.tensor(1.0), torch.tensor([1.0])):
        load(None, scalar, "model.layers.1.mlp.experts.w13_weight_scale_2", shard_id="w1", expert_id=0)
    assert len(seen) == 4


@pytest.mark.parametrize("tensor,param,shard,needle", [
    (torch.zeros(I - 16, H // 2, dtype=torch.uint8), "w13_weight", "w3",
     r"experts\.3\.up_proj\.weight is uint8 \(packed NVFP4\) \[48, 64\], expected uint8 \(packed NVFP4\) \[64, 64\]"),
    (torch.zeros(H, I, dtype=torch.bfloat16), "w2_weight", "w2",
     r"experts\.3\.down_proj\.weight is bfloat16 \[128, 64\], expected uint8"),
    (torch.zeros(I, H // 32, dtype=torch.float8_e4m3fn), "w13_weight_scale", "w1",
     r"experts\.3\.gate_proj\.weight_scale is float8_e4m3fn \[64, 4\], expected float8_e4m3fn \[64, 8\]"),
])
def test_expert_shape_or_dtype_mismatch_names_the_checkpoint_tensor(tensor, param, shard, needle):
    load, seen = _expert_loader()
    with pytest.raises(Glm5Fp4Error, match=r"checkpoint tensor model\.layers\.1\.mlp\." + needle):
        load(None, tensor, f"model.layers.1.mlp.experts.{param}", shard_id=shard, expert_id=3)
    assert not seen


def test_linear_names_follow_vllms_fused_modules():
    assert loading.linear_tensor_name("model.layers.0.mlp.gate_up_proj", "weight", 1) == "model.layers.0.mlp.up_proj.weight"
    assert loading.linear_tensor_name("model.layers.0.self_attn.qkv_proj", "weight_scale", "k") == \
        "model.layers.0.self_attn.k_proj.weight_scale"
    assert loading.linear_tensor_name("model.layers.2.mlp.shared_experts.down_proj", "input_scale", None) == \
        "model.layers.2.mlp.shared_experts.down_proj.input_scale"
    assert loading.linear_tensor_name("lm_head", "weight", None) == "lm_head.weight"


def test_a_bf16_linear_in_an_nvfp4_slot_is_named_with_the_hint():
    layer = torch.nn.Module()
    layer.register_parameter("weight", torch.nn.Parameter(torch.empty(2 * 512, 128, dtype=torch.uint8),
                                                          requires_grad=False))
    layer.tp_size = 1
    seen = []
    load = loading.checked_linear_loader(lambda *a: seen.append(a), layer, "model.layers.0.mlp.gate_up_proj", 256,
                                         [512, 512], None, loading.NOT_NVFP4_HINT)
    load(layer.weight, torch.zeros(512, 128, dtype=torch.uint8), 1)
    assert len(seen) == 1
    with pytest.raises(Glm5Fp4Error, match=r"checkpoint tensor model\.layers\.0\.mlp\.gate_proj\.weight is bfloat16 "
                                           r"\[512, 256\], expected uint8 \(packed NVFP4\) \[512, 128\] \(this "
                                           r"checkpoint declares no ModelOpt quantization config"):
        load(layer.weight, torch.zeros(512, 256, dtype=torch.bfloat16), 0)


def test_triton_backend_through_the_method_on_a_fake_cuda_layer(monkeypatch):
    """The GPU path's plumbing (prepare -> reserve -> forward) with the kernel package's CPU fallback."""
    layer, ex, x, w, ids = _loaded_layer(6, h=256, i=128)  # a shape the kernel tiles
    monkeypatch.setenv("GLM5_FP4_MODE", "w4a16")
    real = backends.importlib.util.find_spec
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda n, *a: object() if n == "triton" else real(n, *a))
    monkeypatch.setattr(moe_mod, "_device_capability", lambda: 120)
    monkeypatch.setenv("GLM5_FP4_BACKEND", "triton")
    moe_config = fake_moe_config("cuda", hidden_dim=256, hidden_dim_unpadded=256, intermediate_size=128,
                                 intermediate_size_per_partition=128)
    method = moe_mod.Glm5ModelOptNvFp4FusedMoE(Glm5NvFp4Config.from_config(NVFP4_FLAT), moe_config)
    assert method.glm5_backend.name == "triton"
    method.process_weights_after_loading(layer)
    # Every checkpoint parameter is freed unless the prepared experts still read it (on CPU tensors the kernel
    # package computes from the checkpoint-layout source; on a GPU it holds only its repacked copy).
    used = backends._storages(method._prepared)
    for name in backends.CHECKPOINT_PARAMS:
        t = getattr(layer, name)
        assert t.numel() == 0 or t.untyped_storage().data_ptr() in used, name
    assert layer.w13_weight_scale_2.numel() == 0  # [E, 2] -> the gate's column, copied
    got = method.apply(layer, x, w, ids, None, None)
    assert _rel(got, moe_reference(x, w, ids, ex, mode="w4a16")) < moe_tolerance("w4a16", torch.bfloat16)


def test_a_per_token_activation_override_is_refused_not_dropped(monkeypatch):
    """vLLM's --quantization-config moe activation override (per-token NVFP4 activations) was silently dropped when
    our backend served the layer (stock vLLM refuses it unless its backend implements it): refused by name now."""
    pytest.importorskip("vllm.config.quantization")
    from vllm.config.quantization import QuantizationConfigArgs, QuantSpec

    args = QuantizationConfigArgs(moe=QuantSpec(activation="nvfp4_per_token"))
    qc = Glm5NvFp4Config.from_config({**NVFP4_FLAT, "_online_quantization_args": args})
    if getattr(qc, "moe_activation_override", None) is None:
        pytest.skip("this vLLM has no MoE activation override")
    monkeypatch.setenv("GLM5_FP4_BACKEND", "reference")
    with pytest.raises(Glm5Fp4Error, match="activation"):
        moe_mod.Glm5ModelOptNvFp4FusedMoE(qc, fake_moe_config())
