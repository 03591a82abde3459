"""The ``glm5_fp4`` MoE runner core: SGLang's ``MoeRunner`` builds it for ``--moe-runner-backend glm5_fp4``.

Contract (SGLang 0.5.23, ``StandardDispatcher`` without expert parallelism):

* in: ``StandardDispatchOutput`` -- ``hidden_states`` [T, H] bf16, ``topk_output.topk_weights`` fp32 [T, K]
  that **already include** ``routed_scaling_factor`` (``_fuses_routed_scaling_factor_in_topk`` is True for
  ModelOpt NVFP4 on non-Marlin runners), ``topk_ids`` int32 [T, K] with -1 for a dropped slot;
* out: ``StandardCombineInput(hidden_states=[T, H])``, the **local partial sum** of this rank's slice of every
  expert: ``FusedMoE.forward_impl`` all-reduces it across the MoE TP group itself;
* the shared expert is not ours (``--disable-shared-experts-fusion`` keeps it a separate module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.moe.moe_runner.base import DispatchMoeRunnerCore, MoeQuantInfo, MoeRunnerConfig
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
from sglang.srt.layers.moe.utils import resolve_moe_runner_backend

from glm5_fp4.backends import Backend
from glm5_fp4.engines.sglang import NAME
from glm5_fp4.errors import Glm5Fp4Error


@dataclass
class Glm5Fp4QuantInfo(MoeQuantInfo):
    """What ``process_weights_after_loading`` prepared for one layer: backend, its weights, activation mode."""

    backend: Backend
    prepared: Any
    mode: str
    where: str = "experts"


def sanitize_topk(topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropped slots (id -1) become expert 0 with weight 0: same result, no out-of-range index, no host sync."""
    dropped = topk_ids < 0
    return topk_weights.masked_fill(dropped, 0.0), topk_ids.clamp_min(0)


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
        return resolve_moe_runner_backend(NAME)

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
        weights, ids = sanitize_topk(topk.topk_weights, topk.topk_ids)
        out = quant_info.backend.forward(dispatch_output.hidden_states, weights, ids, quant_info.prepared,
                                         quant_info.mode)
        return StandardCombineInput(hidden_states=out)


def make_runner_core(config: MoeRunnerConfig) -> Glm5Fp4RunnerCore:
    """The factory ``register_moe_runner_core`` stores; ``MoeRunner.__init__`` calls it per layer."""
    return Glm5Fp4RunnerCore(config)
