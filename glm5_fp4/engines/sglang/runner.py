"""The ``glm5_fp4`` MoE runner core: SGLang's ``MoeRunner`` builds it for ``--moe-runner-backend glm5_fp4``.

Contract (SGLang 0.5.23 and 0.5.15 alike, ``StandardDispatcher``):

* in: ``StandardDispatchOutput`` -- ``hidden_states`` [T, H] bf16, ``topk_output.topk_weights`` fp32 [T, K]
  that **already include** ``routed_scaling_factor`` (folded in by ``TopK`` for every ModelOpt NVFP4 layer in
  0.5.15, for every non-Marlin one in 0.5.23: ``_fuses_routed_scaling_factor_in_topk``; ours is not Marlin, so
  never scale again here), ``topk_ids`` int32 [T, K] of **local** expert ids, -1 for a slot
  this rank does not serve (with ``--ep-size`` > 1 the dispatcher maps global ids through its
  ``local_expert_mapping``; -1 also marks dropped pad rows);
* out: ``StandardCombineInput(hidden_states=[T, H])``, the **local partial sum** of this rank's experts (or
  slice of every expert): ``FusedMoE.forward_impl`` all-reduces it across the MoE group itself;
* the shared expert is not ours (``--disable-shared-experts-fusion`` keeps it a separate module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.moe.moe_runner.base import MoeQuantInfo, MoeRunnerConfig
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

from glm5_fp4.backends import Backend
from glm5_fp4.engines.sglang import NAME, compat
from glm5_fp4.errors import Glm5Fp4Error

DispatchMoeRunnerCore = compat.dispatch_runner_core_base()


@dataclass
class Glm5Fp4QuantInfo(MoeQuantInfo):
    """What ``process_weights_after_loading`` prepared for one layer: backend, its weights, activation mode."""

    backend: Backend
    prepared: Any
    mode: str
    where: str = "experts"
    num_experts: int = 0  # local experts (the prepared weights' first dimension)
    _skip_map: torch.Tensor | None = None

    def skip_map(self, device: torch.device) -> torch.Tensor:
        """:func:`make_skip_map` of this layer's experts, built once per device."""
        if self._skip_map is None or self._skip_map.device != device:
            self._skip_map = make_skip_map(self.num_experts, device)
        return self._skip_map


def make_skip_map(num_experts: int, device: torch.device) -> torch.Tensor:
    """``[0, 1, ..., E-1, -1]``: the expert map under which id E means "not on this rank"."""
    m = torch.arange(num_experts + 1, dtype=torch.int32, device=device)
    m[-1] = -1
    return m


def local_slots(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots SGLang marks -1 (remote expert, dropped row) become id ``num_experts``, which
    :meth:`Glm5Fp4QuantInfo.skip_map` sends to -1: the backends skip them instead of computing an expert
    with weight 0. One elementwise op, no host sync (CUDA-graph safe)."""
    return torch.where(topk_ids < 0, num_experts, topk_ids)


class Glm5Fp4RunnerCore(DispatchMoeRunnerCore):
    """Runs the routed experts of a ModelOpt NVFP4 layer on a glm5-fp4 backend."""

    def __init__(self, config: MoeRunnerConfig):
        super().__init__(config)
        unsupported = {
            "apply_router_weight_on_input": config.apply_router_weight_on_input,
            "no_combine": config.no_combine,
            "gemm1_alpha/gemm1_clamp_limit/swiglu_limit": (config.gemm1_alpha is not None
                                                          or config.gemm1_clamp_limit is not None
                                                          or config.swiglu_limit is not None),
        }
        bad = [k for k, v in unsupported.items() if v]
        if config.activation != "silu" or not config.is_gated:
            bad.append(f"activation {config.activation} (gated={config.is_gated})")
        if bad:
            raise Glm5Fp4Error(f"--moe-runner-backend {NAME} runs SwiGLU experts with the standard combine; "
                               f"layer {config.layer_id} needs: {', '.join(bad)}")

    @property
    def runner_backend(self):
        return compat.registered_backend(NAME)

    def run_from_dispatch(self, dispatch_output, quant_info: MoeQuantInfo, runner_config: MoeRunnerConfig,
                          hooks: Any = None) -> StandardCombineInput:
        if not isinstance(quant_info, Glm5Fp4QuantInfo):
            raise Glm5Fp4Error(
                f"--moe-runner-backend {NAME} runs ModelOpt NVFP4 experts only; layer {runner_config.layer_id} "
                f"handed it {type(quant_info).__name__} (a BF16 MTP draft? then pass "
                "--speculative-moe-runner-backend triton)")
        if hooks is not None:
            raise Glm5Fp4Error(f"--moe-runner-backend {NAME} does not support MoE LoRA")
        if getattr(dispatch_output, "hidden_states_scale", None) is not None:
            raise Glm5Fp4Error(f"--moe-runner-backend {NAME} takes BF16 hidden states, not the pre-quantized "
                               "FP4 dp-allgather path")
        topk = dispatch_output.topk_output
        if not hasattr(topk, "topk_ids") or not hasattr(topk, "topk_weights"):
            raise Glm5Fp4Error(f"--moe-runner-backend {NAME} needs the standard top-k output, got "
                               f"{type(topk).__name__}")
        x = dispatch_output.hidden_states
        ids = local_slots(topk.topk_ids, quant_info.num_experts)
        out = quant_info.backend.forward(x, topk.topk_weights, ids, quant_info.prepared, quant_info.mode,
                                         quant_info.skip_map(ids.device))
        return StandardCombineInput(hidden_states=out)


def make_runner_core(config: MoeRunnerConfig) -> Glm5Fp4RunnerCore:
    """The factory ``register_moe_runner_core`` stores; ``MoeRunner.__init__`` calls it per layer."""
    return Glm5Fp4RunnerCore(config)
