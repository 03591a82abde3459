"""The NVFP4 MoE layer both SGLang test paths build: the pytest tests (tests/sglang/test_sglang_plugin.py, the venv's
SGLang) and the per-version probe (versions_probe.py, run in a fresh interpreter with another SGLang on its path).
It imports SGLang only inside the function, so it serves whichever version is importable."""

from __future__ import annotations

import torch


def make_layer(experts, top_k: int):
    """A MoE layer with SGLang's own NVFP4 parameters, filled with ``experts`` as a checkpoint load would."""
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config, ModelOptNvFp4FusedMoEMethod

    method = ModelOptNvFp4FusedMoEMethod(ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16,
                                                           exclude_modules=[]))
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size  # noqa: N806
    layer = torch.nn.Module()
    layer.num_local_experts = layer.num_experts = E
    layer._mega_moe_nvfp4 = False  # FusedMoE attribute the original apply() reads
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H, intermediate_size_per_partition=I,
                          layer_id=3, top_k=top_k, params_dtype=torch.bfloat16, activation="silu", is_gated=True,
                          routed_scaling_factor=2.5)
    layer.moe_runner_config = cfg

    def never(*args, **kwargs):
        raise AssertionError("no checkpoint loading here")

    method.create_weights(layer, E, H, I, torch.bfloat16, weight_loader=never)
    layer.w13_weight.data.copy_(experts.w13)
    layer.w13_weight_scale.data.copy_(experts.w13_scale)
    layer.w13_weight_scale_2.data.copy_(experts.w13_global[:, None].expand(E, 2))
    layer.w2_weight.data.copy_(experts.w2)
    layer.w2_weight_scale.data.copy_(experts.w2_scale)
    layer.w2_weight_scale_2.data.copy_(experts.w2_global)
    layer.w13_input_scale.data.copy_(experts.a13_scale[:, None].expand(E, 2))
    layer.w2_input_scale.data.copy_(experts.a2_scale)
    method.create_moe_runner(layer, cfg)
    return method, layer


def dispatch(x, weights, ids, logits):
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return StandardDispatchOutput(hidden_states=x, hidden_states_scale=None,
                                  topk_output=StandardTopKOutput(weights, ids.to(torch.int32), logits))
