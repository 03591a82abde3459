"""Fused NVFP4 MoE kernels (Triton) with no engine imports: the engines' vLLM/SGLang glue calls these.

* :func:`prepare_experts` once after weight loading (repacks into the kernel layout),
* :func:`fused_moe` per layer call (Triton on CUDA, the torch reference path on CPU),
* ``torch.ops.glm5_fp4.moe_nvfp4`` (registered by importing :mod:`glm5_fp4.kernels.op`) for
  torch.compile / CUDA graphs.
"""

from glm5_fp4.kernels.capability import has_fp4_mma, supports
from glm5_fp4.kernels.layout import PreparedExperts, prepare_experts
from glm5_fp4.kernels.moe import fused_moe, native_fp4_enabled, reserve_workspace

__all__ = [
    "PreparedExperts", "prepare_experts", "fused_moe", "reserve_workspace", "native_fp4_enabled", "supports", "has_fp4_mma",
]
