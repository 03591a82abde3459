"""vLLM's Marlin MoE on the same NVFP4 experts: the stock peer on GPUs without FP4 tensor cores.

What vLLM runs for ModelOpt NVFP4 MoE on Hopper (``--quantization modelopt_fp4``): weights repacked by
vLLM's own ``prepare_nvfp4_moe_layer_for_marlin`` and multiplied by ``fused_marlin_moe`` (float4_e2m1f
codes, group 16, e4m3 scales, bf16 activations). Needs a CUDA build of vLLM (its ``_moe_C`` library);
:func:`available` says why not when it cannot run. Written against vLLM 0.26 (the H200 test vehicle) and
0.33, whose signatures of these two functions are the same.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from glm5_fp4.reference import NvFp4Experts


def available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    try:
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe  # noqa: F401
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (  # noqa: F401
            prepare_nvfp4_moe_layer_for_marlin,
        )
    except Exception as exc:  # noqa: BLE001 - any import failure means no baseline, said once
        return False, f"vLLM's Marlin MoE is not importable here ({type(exc).__name__}: {str(exc)[:200]})"
    return True, ""


class MarlinMoE:
    """One layer's experts in Marlin's layout; ``run(x, topk_weights, topk_ids)`` -> [T, H] (x.dtype)."""

    def __init__(self, experts: NvFp4Experts, dtype: torch.dtype = torch.bfloat16):
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_nvfp4_moe_layer_for_marlin
        from vllm.scalar_type import scalar_types

        e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_size
        # the attributes vLLM's preparation reads from its FusedMoE layer (and the workspace it sets)
        layer = SimpleNamespace(num_experts=e, hidden_size=h, intermediate_size_per_partition=i, params_dtype=dtype)
        g13 = experts.w13_global.float().contiguous()
        g2 = experts.w2_global.float().contiguous()
        (self.w13, self.s13, self.g13, self.w2, self.s2, self.g2) = prepare_nvfp4_moe_layer_for_marlin(
            layer, experts.w13, experts.w13_scale, g13, experts.w2, experts.w2_scale, g2, True
        )
        self.workspace = layer.workspace
        self.quant_type_id = scalar_types.float4_e2m1f.id
        self.num_experts = e

    def run(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor | None = None):
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe

        return fused_marlin_moe(
            x, self.w13, self.w2, None, None, self.s13, self.s2, topk_weights, topk_ids,
            quant_type_id=self.quant_type_id, global_num_experts=self.num_experts, global_scale1=self.g13,
            global_scale2=self.g2, workspace=self.workspace, output=out,
        )
