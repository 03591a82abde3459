"""``torch.ops.glm5_fp4_vllm.moe_routed``: our MoE methods' routed-expert computation as an opaque op.

Why an op: on CUDA vLLM already runs the whole MoE inside its opaque ``vllm::moe_forward`` op, but on CPU
it calls the Python MoE path directly, so Dynamo (vLLM's default compile mode for non-GLM-5 models such
as glm4moe) would trace into our backends' data-dependent loops. Behind this op Dynamo sees one node with
a known output shape. Layers are looked up by a string key, as vLLM does for ``moe_forward``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RoutedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_LAYERS: dict[str, RoutedFn] = {}


def register_layer(key: str, fn: RoutedFn) -> None:
    _LAYERS[key] = fn


@torch.library.custom_op("glm5_fp4_vllm::moe_routed", mutates_args=())
def moe_routed(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_key: str) -> torch.Tensor:
    return _LAYERS[layer_key](x, topk_weights, topk_ids)


@moe_routed.register_fake
def _moe_routed_fake(x, topk_weights, topk_ids, layer_key):
    return torch.empty_like(x)
