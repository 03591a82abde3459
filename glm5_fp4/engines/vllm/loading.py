"""Checks on checkpoint tensors as vLLM hands them to our layers, so bad input fails with one clear message.

vLLM's loaders copy a checkpoint tensor into a parameter with ``copy_``: a wrong shape fails with a bare
size-mismatch (or, for experts, is silently narrowed by the padding logic) and a BF16 tensor is silently
cast into a packed uint8 parameter. We wrap the loader vLLM passes to ``create_weights`` and check dtype
and shape first, raising :class:`Glm5Fp4Error` with the checkpoint tensor's own name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.nvfp4 import BLOCK_SIZE, shape_matches

_DTYPE_NAMES = {torch.uint8: "uint8 (packed NVFP4)", torch.float8_e4m3fn: "float8_e4m3fn", torch.float32: "float32"}
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Fused vLLM module -> checkpoint modules by shard id, for the models this plugin serves (DeepSeek-V2/V3
# family incl. GLM-5, GLM-4.5); the quant config's packed_modules_mapping is consulted first.
_FUSED = {
    "gate_up_proj": ["gate_proj", "up_proj"],
    "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
}
_QKV_INDEX = {"q": 0, "k": 1, "v": 2}

NOT_NVFP4_HINT = (
    "this checkpoint declares no ModelOpt quantization config (no quantization_config in config.json, no "
    "hf_quant_config.json), so it is not an NVFP4 checkpoint: serve it without --quantization glm5_nvfp4"
)


def _describe(dtype: torch.dtype, shape) -> str:
    return f"{_DTYPE_NAMES.get(dtype, str(dtype).removeprefix('torch.'))} {list(shape)}"


def _mismatch(name: str, got: torch.Tensor, dtype: torch.dtype, shape, context: str) -> Glm5Fp4Error:
    return Glm5Fp4Error(
        f"checkpoint tensor {name} is {_describe(got.dtype, got.shape)}, expected {_describe(dtype, shape)}"
        + (f" ({context})" if context else "")
    )


def _check(name: str, got: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None, context: str) -> None:
    if got.dtype != dtype:
        raise _mismatch(name, got, dtype, shape if shape is not None else got.shape, context)
    if shape is None:
        return
    if not shape_matches(tuple(got.shape), shape):
        raise _mismatch(name, got, dtype, shape, context)


# -- experts --------------------------------------------------------------------------------------

def expert_tensor_name(mapped_name: str, expert_id: int, shard_id: str) -> str:
    """``model.layers.3.mlp.experts.w13_weight_scale`` (+ expert 5, shard w3) ->
    ``model.layers.3.mlp.experts.5.up_proj.weight_scale``: the checkpoint's own name."""
    proj = _EXPERT_PROJ.get(shard_id, shard_id)
    for fused in ("experts.w13_", "experts.w2_"):
        if fused in mapped_name:
            return mapped_name.replace(fused, f"experts.{expert_id}.{proj}.")
    return f"{mapped_name} (expert {expert_id}, {proj})"


def expected_expert_tensor(param_suffix: str, shard_id: str, hidden: int, inter: int):
    """(dtype, shape) of one expert's checkpoint tensor; ``inter`` is the full (unsharded) intermediate size."""
    out_f, in_f = (hidden, inter) if shard_id == "w2" else (inter, hidden)
    if param_suffix == "weight":
        return torch.uint8, (out_f, in_f // 2)
    if param_suffix == "weight_scale":
        return torch.float8_e4m3fn, (out_f, in_f // BLOCK_SIZE)
    if param_suffix in ("weight_scale_2", "input_scale"):
        return torch.float32, ()
    return None


def checked_expert_loader(loader: Callable, hidden: int, inter: int) -> Callable:
    """Wrap RoutedExperts.weight_loader: check each per-expert NVFP4 tensor before vLLM copies it."""

    context = f"config.json: hidden_size={hidden}, moe_intermediate_size={inter}"

    @functools.wraps(loader)
    def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        # 3-D tensors are whole stacks of experts (other layouts); only per-expert 2-D/0-D ones are checked.
        if loaded_weight.dim() <= 2 and shard_id in _EXPERT_PROJ:
            suffix = weight_name.rsplit(f"{'w2' if shard_id == 'w2' else 'w13'}_", 1)[-1]
            expected = expected_expert_tensor(suffix, shard_id, hidden, inter)
            if expected is not None:
                _check(expert_tensor_name(weight_name, expert_id, shard_id), loaded_weight, *expected, context)
        return loader(param, loaded_weight, weight_name, shard_id=shard_id, expert_id=expert_id,
                      return_success=return_success)

    return load


# -- linears --------------------------------------------------------------------------------------

def linear_tensor_name(prefix: str, param_name: str, shard_id, packed: dict | None = None) -> str:
    """Checkpoint name of the tensor a fused linear's shard loads, e.g. ``...mlp.gate_proj.weight``."""
    module, _, last = prefix.rpartition(".")
    parts = (packed or {}).get(last) or _FUSED.get(last)
    if shard_id is not None and parts:
        index = _QKV_INDEX.get(shard_id, shard_id) if isinstance(shard_id, str) else shard_id
        if isinstance(index, int) and 0 <= index < len(parts):
            last = parts[index]
    return f"{module + '.' if module else ''}{last}.{param_name}"


def checked_linear_loader(loader: Callable, layer: torch.nn.Module, prefix: str, input_size: int,
                          output_partition_sizes: list[int], packed: dict | None, hint: str = "") -> Callable:
    """Wrap a linear layer's v2 weight loader: check NVFP4 tensors' dtype and (without TP) shape."""

    @functools.wraps(loader)
    def load(param, loaded_weight, loaded_shard_id=None, *args, **kwargs):
        param_name = next((n for n, p in layer.named_parameters(recurse=False) if p is param), None)
        if param_name in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            tp = getattr(layer, "tp_size", 1)
            index = _QKV_INDEX.get(loaded_shard_id, loaded_shard_id)
            out_f = None
            if tp == 1:
                out_f = output_partition_sizes[index] if isinstance(index, int) else sum(output_partition_sizes)
            if param_name == "weight":
                dtype, shape = torch.uint8, None if out_f is None else (out_f, input_size // 2)
            elif param_name == "weight_scale":
                dtype, shape = torch.float8_e4m3fn, None if out_f is None else (out_f, input_size // BLOCK_SIZE)
            else:
                dtype, shape = torch.float32, ()
            _check(linear_tensor_name(prefix, param_name, loaded_shard_id, packed), loaded_weight, dtype, shape,
                   hint)
        return loader(param, loaded_weight, loaded_shard_id, *args, **kwargs) if loaded_shard_id is not None \
            else loader(param, loaded_weight, *args, **kwargs)

    return load
