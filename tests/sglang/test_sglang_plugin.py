"""The glm5_fp4 SGLang plugin against the real sglang 0.5.23 package, on CPU tensors.

The server state is built the way a scheduler process builds it: load_plugins(), ServerArgs parsed from
``--moe-runner-backend glm5_fp4 --device cpu``, published, ``initialize_moe_config()``. The MoE layer is given
its parameters by SGLang's own ``ModelOptNvFp4FusedMoEMethod.create_weights``; the runner by its own
``create_moe_runner``. Results are compared with glm5_fp4.reference.moe_reference on the same NVFP4 experts.
"""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
import torch

from glm5_fp4.reference import moe_reference, random_experts
from glm5_fp4.tolerances import moe_tolerance, rel_error
from nvfp4_moe_case import E, H, T, dispatch, inputs, make_layer



@pytest.fixture(scope="module")
def published(sglang_plugins, tmp_path_factory):
    from sglang.srt.layers.moe.utils import get_moe_runner_backend, initialize_moe_config
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    from glm5_fp4.checkpoint.configs import build_config, dense_attention_view

    model = tmp_path_factory.mktemp("model")
    # the dense-attention view: SGLang's DSA setup would initialise CUDA
    (model / "config.json").write_text(json.dumps(dense_attention_view(build_config("glm5"))))
    args = prepare_server_args(["--model-path", str(model), "--moe-runner-backend", "glm5_fp4", "--device", "cpu"])
    publish(args, role="scheduler")
    initialize_moe_config()
    return get_moe_runner_backend()


def test_entry_point_is_declared_and_loaded(sglang_plugins):
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get("glm5_fp4") == "glm5_fp4.engines.sglang_plugin:register"
    from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod as M

    assert MOE_RUNNER_BACKEND_CHOICES.count("glm5_fp4") == 1
    from sglang.srt.plugins.hook_registry import HookRegistry

    from glm5_fp4.engines.sglang.hooks import HOOKS, TARGET

    for method, hook in HOOKS.items():
        assert getattr(M, method).__wrapped__.__qualname__ == f"ModelOptNvFp4FusedMoEMethod.{method}"
        assert [h for _, h, _ in HookRegistry._hooks[f"{TARGET}.{method}"]] == [hook]


def test_register_is_idempotent(sglang_plugins):
    from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES

    from glm5_fp4.engines import sglang_plugin

    sglang_plugin.register()
    sglang_plugin.register()
    assert MOE_RUNNER_BACKEND_CHOICES.count("glm5_fp4") == 1


def test_server_args_resolve_to_our_registered_backend(published):
    from sglang.srt.layers.moe.utils import RegisteredMoeRunnerBackend

    assert published == RegisteredMoeRunnerBackend("glm5_fp4")



def test_runner_core_is_built(published):
    from glm5_fp4.engines.sglang.runner import Glm5Fp4RunnerCore

    method, _ = make_layer(inputs(0)[0])
    assert isinstance(method.runner.runner_core, Glm5Fp4RunnerCore)
    assert method.runner.runner_core.runner_backend.value == "glm5_fp4"


@pytest.mark.parametrize("backend,mode", [("reference", "w4a16"), ("reference", "w4a4"), ("dequant", "w4a16"),
                                          ("auto", "auto")])
def test_hooked_apply_equals_reference(published, monkeypatch, backend, mode):
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

    monkeypatch.setenv("GLM5_FP4_BACKEND", backend)
    monkeypatch.setenv("GLM5_FP4_MODE", mode)
    experts, x, logits, weights, ids = inputs(1)
    method, layer = make_layer(experts)
    method.process_weights_after_loading(layer)
    info = layer._glm5_fp4
    assert info.backend.name == ("dequant" if backend == "auto" else backend)  # auto on CPU = dequant
    assert info.mode == ("w4a16" if mode == "auto" else mode)  # auto on CPU: no FP4 tensor cores
    out = method.apply(layer, dispatch(x, weights, ids, logits))
    assert isinstance(out, StandardCombineInput) and out.hidden_states.shape == (T, H)
    ref = moe_reference(x, weights, ids, experts, mode=info.mode)
    if backend == "reference":
        torch.testing.assert_close(out.hidden_states, ref, rtol=0, atol=0)
    else:  # dequant keeps BF16 weights: one BF16 rounding of each dequantized weight
        assert rel_error(out.hidden_states, ref) < moe_tolerance(info.mode, torch.bfloat16)
    # the checkpoint-layout copies the reference does not need are freed; the reference keeps its views
    assert (layer.w13_weight.numel() == 0) == (info.backend.name != "reference")


def test_routed_scaling_factor_is_not_applied_twice(published, monkeypatch):
    monkeypatch.setenv("GLM5_FP4_BACKEND", "reference")
    experts, x, logits, weights, ids = inputs(2)
    method, layer = make_layer(experts)
    method.process_weights_after_loading(layer)
    out = method.apply(layer, dispatch(x, weights, ids, logits)).hidden_states
    unscaled = moe_reference(x, weights / 2.5, ids, experts)
    torch.testing.assert_close(out.float(), 2.5 * unscaled.float(), rtol=2e-2, atol=1e-3)


def test_dropped_slots_contribute_nothing(published, monkeypatch):
    monkeypatch.setenv("GLM5_FP4_BACKEND", "reference")
    experts, x, logits, weights, ids = inputs(3)
    method, layer = make_layer(experts)
    method.process_weights_after_loading(layer)
    dropped = ids.clone()
    dropped[::3, 1] = -1
    out = method.apply(layer, dispatch(x, weights, dropped, logits)).hidden_states
    kept = weights.clone()
    kept[::3, 1] = 0.0
    torch.testing.assert_close(out, moe_reference(x, kept, ids, experts), rtol=0, atol=0)


def test_other_backends_reach_sglangs_own_code(published, monkeypatch):
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    monkeypatch.setenv("GLM5_FP4_BACKEND", "reference")
    experts, x, logits, weights, ids = inputs(4)
    method, layer = make_layer(experts)
    method.process_weights_after_loading(layer)
    method._moe_runner_backend = MoeRunnerBackend.TRITON  # what create_moe_runner caches for another backend
    with pytest.raises(NotImplementedError, match="Unsupported moe_runner_backend for NVFP4 MoE"):
        method.apply(layer, dispatch(x, weights, ids, logits))


def test_init_hook_sets_what_the_original_sets(published, monkeypatch):
    """On a Blackwell-like platform the original __init__ runs; our CPU/Hopper stand-in must set the same."""
    import types

    from sglang.srt.layers.quantization import modelopt_quant
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config, ModelOptNvFp4FusedMoEMethod as M

    from glm5_fp4.engines.sglang.hooks import init_without_platform_check

    qc = ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16, exclude_modules=[])
    ours = object.__new__(M)
    init_without_platform_check(ours, qc)
    monkeypatch.setattr(modelopt_quant, "get_platform", lambda: types.SimpleNamespace(is_blackwell=True))
    original = object.__new__(M)
    M.__init__.__wrapped__(original, qc)
    assert vars(ours) == vars(original)
    # and without the fake platform, constructing on CPU works only through our hook
    monkeypatch.undo()
    assert vars(M(qc)) == vars(original)
    with pytest.raises(ValueError, match="does not support NVFP4"):
        M.__init__.__wrapped__(object.__new__(M), qc)


def test_bf16_draft_layers_get_a_clear_error(published):
    from glm5_fp4.engines.sglang.runner import make_runner_core
    from glm5_fp4.errors import Glm5Fp4Error

    core = make_runner_core(make_layer(inputs(5)[0])[0].moe_runner_config)
    with pytest.raises(Glm5Fp4Error, match="speculative-moe-runner-backend"):
        core.run_from_dispatch(None, object(), core.config)


# (backend, mode) on a CUDA GPU of each capability, for a checkpoint with input scales: our kernel needs SM89+
# (FP8 hardware conversion); auto = W4A4 only on FP4 tensor cores (SM100+) with the native FP4 path on
# (GLM5_FP4_NATIVE_FP4=1), emulated W4A4 being slower than W4A16. SGLang has no fallback once
# --moe-runner-backend glm5_fp4 is chosen, so Ampere gets the reason as one clear error.
DECISIONS = {80: (None, "w4a16"), 86: (None, "w4a16"), 89: ("triton", "w4a16"), 90: ("triton", "w4a16"),
             100: ("triton", "w4a16"), 120: ("triton", "w4a16")}
NATIVE_DECISIONS = {**DECISIONS, 100: ("triton", "w4a4"), 120: ("triton", "w4a4")}


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("capability", sorted(DECISIONS))
def test_the_adapter_decision_per_gpu_capability(published, capability, native, monkeypatch):
    from glm5_fp4.engines.sglang.hooks import choose
    from glm5_fp4.settings import PluginSettings

    monkeypatch.setenv("GLM5_FP4_NATIVE_FP4", "1" if native else "0")
    g = torch.Generator().manual_seed(7)
    method, layer = make_layer(random_experts(E, 256, 128, generator=g))  # a shape the real kernel tiles
    sel = choose(method, layer, PluginSettings(), torch.device("cuda"), capability)
    want = (NATIVE_DECISIONS if native else DECISIONS)[capability]
    assert (sel.backend.name if sel.backend else None, sel.mode) == want, sel.reason
    if sel.backend is None:
        assert "sm_89" in sel.reason and f"sm_{capability}" in sel.reason


def test_gpu_only_paths_are_not_silently_taken(published):
    # the reference runs anywhere; the Triton backend must refuse CPU tensors with its reason
    from glm5_fp4.errors import Glm5Fp4Error

    os.environ["GLM5_FP4_BACKEND"] = "triton"
    try:
        method, layer = make_layer(inputs(6)[0])
        with pytest.raises(Glm5Fp4Error, match="CUDA"):
            method.process_weights_after_loading(layer)
    finally:
        del os.environ["GLM5_FP4_BACKEND"]


def test_expert_parallel_rank_serves_its_local_experts(published, monkeypatch):
    """--ep-size 2: the dispatcher hands local ids (-1 for the other rank's experts); the layer is ours (no
    refusal) and returns this rank's partial sum, the remote slots skipped rather than computed at weight 0."""
    from glm5_fp4 import backends

    monkeypatch.setenv("GLM5_FP4_BACKEND", "reference")
    experts, x, logits, weights, ids = inputs(5)
    method, layer = make_layer(experts)
    layer.moe_ep_size = 2
    seen = {}
    real = backends.Backend.forward

    def spy(self, x, w, i, prepared, mode, expert_map=None):
        seen["map"] = expert_map
        return real(self, x, w, i, prepared, mode, expert_map)

    monkeypatch.setattr(backends.Backend, "forward", spy)
    method.process_weights_after_loading(layer)
    remote = ids.clone()
    remote[1::2] = -1  # odd tokens: both experts live on the other rank
    out = method.apply(layer, dispatch(x, weights, remote, logits)).hidden_states
    assert seen["map"] is not None and int(seen["map"][-1]) == -1
    assert (out[1::2] == 0).all()
    kept = torch.where(remote < 0, 0.0, weights)
    torch.testing.assert_close(out, moe_reference(x, kept, ids, experts), rtol=0, atol=0)


def test_another_all_to_all_backend_stops_loading_with_the_reason(published, monkeypatch):
    """--moe-a2a-backend deepep (or any but none) hands the runner DeepEP's dispatch format: one clear error at
    load time naming the flag, not a failure inside the first forward."""
    from sglang.srt.layers.moe.utils import MoeA2ABackend
    from sglang.srt.runtime_context import get_flags

    from glm5_fp4.errors import Glm5Fp4Error

    monkeypatch.setenv("GLM5_FP4_BACKEND", "reference")
    method, layer = make_layer(inputs(8)[0])
    monkeypatch.setattr(get_flags().moe, "a2a_backend", MoeA2ABackend.DEEPEP)
    with pytest.raises(Glm5Fp4Error, match="--moe-a2a-backend deepep: our runner reads the standard dispatch only"):
        method.process_weights_after_loading(layer)
    monkeypatch.setattr(get_flags().moe, "a2a_backend", MoeA2ABackend.NONE)
    method.process_weights_after_loading(layer)
    assert layer._glm5_fp4.backend.name == "reference"


def test_expert_parallel_layers_log_their_local_experts(published, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("GLM5_FP4_BACKEND", "reference")
    method, layer = make_layer(inputs(9)[0])
    layer.moe_ep_size = 8
    with caplog.at_level(logging.INFO, logger="sglang.glm5_fp4"):
        method.process_weights_after_loading(layer)
    assert any("run on backend reference" in r.getMessage() and f"expert parallel: {E} local experts (EP8)"
               in r.getMessage() for r in caplog.records)


def test_a_bad_environment_stops_the_moe_method_before_any_weight_is_read(published, monkeypatch):
    """GLM5_FP4_BACKEND / _MODE were read only in process_weights_after_loading, after the whole checkpoint had
    loaded (GLM-5: minutes); any bad GLM5_FP4_* value now stops the method's construction, by name."""
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config, ModelOptNvFp4FusedMoEMethod as M

    from glm5_fp4.errors import Glm5Fp4Error

    qc = ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16, exclude_modules=[])
    for name, raw in (("GLM5_FP4_BACKEND", "tritn"), ("GLM5_FP4_NATIVE_FP4", "maybe")):
        monkeypatch.setenv(name, raw)
        with pytest.raises(Glm5Fp4Error, match=name):
            M(qc)
        monkeypatch.delenv(name)
    M(qc)


def test_a_missing_hook_target_stops_the_registration_by_name(sglang_plugins, monkeypatch):
    """SGLang's HookRegistry logs a target it cannot find and goes on: with ModelOptNvFp4FusedMoEMethod renamed
    upstream, `--moe-runner-backend glm5_fp4` was still accepted and the server died later in SGLang's own NVFP4
    check, naming neither glm5-fp4 nor the version. Every target is resolved before anything is registered."""
    from sglang.srt.layers.quantization import modelopt_quant

    from glm5_fp4.engines.sglang import compat
    from glm5_fp4.engines.sglang.registration import register_all
    from glm5_fp4.errors import Glm5Fp4Error

    monkeypatch.delattr(modelopt_quant, "ModelOptNvFp4FusedMoEMethod")
    with pytest.raises(Glm5Fp4Error) as e:
        register_all()
    msg = str(e.value)
    assert "ModelOptNvFp4FusedMoEMethod" in msg and compat.PRIMARY in msg and compat.VEHICLE in msg
    assert compat.running_version() in msg
