"""``torch.ops.glm5_fp4.moe_nvfp4``: the fused MoE as a registered custom op (torch.compile, CUDA graphs).

The op writes into ``out`` (``mutates_args=("out",)``) so engines can hand it a preallocated buffer; the
fake implementation only checks shapes. It never synchronises with the host and allocates nothing whose
size depends on routing: the workspace is static per (device, stream, shapes) and must exist before a
CUDA-graph capture (:func:`glm5_fp4.kernels.reserve_workspace`, or one eager call at the largest size).

    import glm5_fp4.kernels.op  # registers the op
    out = glm5_fp4.kernels.op.moe_nvfp4(x, topk_weights, topk_ids, prepared, mode="w4a16")
"""

from __future__ import annotations

import torch

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.kernels.layout import PreparedExperts
from glm5_fp4.kernels.moe import check_inputs, check_out, fused_moe_torch, fused_moe_triton, _interpreting

OP_NAME = "glm5_fp4::moe_nvfp4"


def _prepared_from(w13, w13_scale, w13_alpha, w2, w2_scale, w2_alpha, a13_scale, a2_scale, a13_gscale, a2_gscale,
                   layout):
    return PreparedExperts(
        w13=w13, w13_scale=w13_scale, w13_alpha=w13_alpha, w2=w2, w2_scale=w2_scale, w2_alpha=w2_alpha,
        a13_scale=a13_scale, a2_scale=a2_scale, a13_gscale=a13_gscale, a2_gscale=a2_gscale, layout=layout,
    )


@torch.library.custom_op(OP_NAME, mutates_args=("out",))
def _moe_nvfp4(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_alpha: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_alpha: torch.Tensor,
    a13_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
    a13_gscale: torch.Tensor | None,
    a2_gscale: torch.Tensor | None,
    quant_mode: str,
    out: torch.Tensor,
    layout: str,  # required: the tensors look alike in every layout (a default of "split" decoded "tiled" wrong)
    expert_map: torch.Tensor | None = None,
) -> None:
    # (named quant_mode: torch's dispatch machinery reserves a keyword called "mode")
    prepared = _prepared_from(
        w13, w13_scale, w13_alpha, w2, w2_scale, w2_alpha, a13_scale, a2_scale, a13_gscale, a2_gscale, layout
    )
    check_inputs(x, topk_weights, topk_ids, prepared, quant_mode, expert_map)
    if x.device.type == "cuda" or _interpreting():
        fused_moe_triton(x, topk_weights, topk_ids, prepared, quant_mode, out=out, expert_map=expert_map)
    else:
        fused_moe_torch(x, topk_weights, topk_ids, prepared, quant_mode, out=out, expert_map=expert_map)


@_moe_nvfp4.register_fake
def _moe_nvfp4_fake(x, topk_weights, topk_ids, w13, w13_scale, w13_alpha, w2, w2_scale, w2_alpha,
                    a13_scale, a2_scale, a13_gscale, a2_gscale, quant_mode, out, layout,
                    expert_map=None) -> None:
    # the real op's checks (shapes and dtypes; values only on host tensors, which fake ones are not): what compiles
    # is what runs
    prepared = _prepared_from(
        w13, w13_scale, w13_alpha, w2, w2_scale, w2_alpha, a13_scale, a2_scale, a13_gscale, a2_gscale, layout
    )
    check_inputs(x, topk_weights, topk_ids, prepared, quant_mode, expert_map)
    check_out(x, out)
    return None


def moe_nvfp4(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    prepared: PreparedExperts,
    mode: str = "w4a16",
    out: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Call the registered op on prepared experts; allocates ``out`` when not given. ``expert_map``:
    expert parallelism (``prepared`` holds the local experts; global id -> local id or -1)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # row-major whatever x's strides
    t = prepared.tensors()
    torch.ops.glm5_fp4.moe_nvfp4(
        x, topk_weights, topk_ids, t["w13"], t["w13_scale"], t["w13_alpha"], t["w2"], t["w2_scale"],
        t["w2_alpha"], t["a13_scale"], t["a2_scale"], t["a13_gscale"], t["a2_gscale"], mode, out, prepared.layout,
        expert_map,
    )
    return out
