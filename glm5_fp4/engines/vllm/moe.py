"""The `glm5_nvfp4` MoE method: ModelOpt NVFP4 experts executed by a glm5-fp4 backend.

It loads exactly what vLLM's ``ModelOptNvFp4FusedMoE`` loads (inherits its ``create_weights``), then hands the
experts to the backend :mod:`glm5_fp4.backends` selects for this layer. When none can serve the layer
(device, shape, dtype, LoRA) it logs one line with the reason and becomes vLLM's own
``ModelOptNvFp4FusedMoE`` (vLLM's NVFP4 backend selection: Marlin, FlashInfer CUTLASS, ...).

Constraint kept on purpose, the class name contains ``ModelOpt``:
  What: ``Glm5ModelOptNvFp4FusedMoE``, not e.g. ``Glm5NvFp4MoE``.
  Why: ``RoutedExperts.weight_loader`` picks the loader that understands ModelOpt's per-tensor
  ``weight_scale_2`` / per-shard ``input_scale`` layout by ``"ModelOpt" in quant_method_name``; any other
  name fails with ``ValueError: quant method must be one of [...]``.
  Upstream: vllm/model_executor/layers/fused_moe/routed_experts.py (``TODO @dsikka: ModelOpt should follow
  the proper MoE loading pattern``), 0.32 and 0.33.
  Remove when: the loader keys off a method attribute (e.g. ``uses_weight_scale_2_pattern``) instead.
"""

from __future__ import annotations

import math

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase, FusedMoEQuantConfig
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config, ModelOptNvFp4FusedMoE
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from glm5_fp4 import backends, settings as common_settings
from glm5_fp4.engines.vllm import settings as plugin_settings
from glm5_fp4.engines.vllm.loading import checked_expert_loader
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.reference import NvFp4Experts

logger = init_logger(f"vllm.{__name__}")
_LOGGED: set[tuple] = set()


def _log_once(level: str, msg: str, *args) -> None:
    key = (level, msg, args)
    if key not in _LOGGED:
        _LOGGED.add(key)
        getattr(logger, level)(msg, *args)


def _warn_once(msg: str) -> None:
    _log_once("warning", "%s", msg)


def moe_shape(moe: FusedMoEConfig) -> backends.MoEShape:
    return backends.MoEShape(
        num_experts=moe.num_local_experts,
        hidden_size=moe.hidden_dim,
        intermediate_size=moe.intermediate_size_per_partition,
        top_k=moe.experts_per_token,
        activation=getattr(moe.activation, "value", str(moe.activation)),
        gated=moe.is_act_and_mul,
        has_bias=moe.has_bias,
        expert_parallel=moe.moe_parallel_config.use_ep,
    )


# The expert-parallel dispatch our method runs under. With data parallelism vLLM hands a method without a modular
# kernel (ours) its "naive" dispatch: get_ep_group().dispatch_router_logits() before apply() and combine() after
# (runner/moe_runner.py do_naive_dispatch_combine), which only the allgather_reducescatter manager implements
# (DeepEP's raises NotImplementedError; the others expect a modular kernel).
GATHER_ALL2ALL = "allgather_reducescatter"


def _gathers(moe: FusedMoEConfig) -> bool:
    """Data parallelism: vLLM gathers every DP rank's tokens into this layer (the naive dispatch)."""
    return getattr(moe.moe_parallel_config, "dp_size", 1) > 1


def _refusal(moe: FusedMoEConfig) -> str:
    """Why vLLM's configuration rules our backends out for this layer ('' if it does not)."""
    if getattr(moe, "is_lora_enabled", False):
        return "LoRA on MoE layers is not supported"
    par = moe.moe_parallel_config
    backend = getattr(par, "all2all_backend", GATHER_ALL2ALL)
    if _gathers(moe) and backend != GATHER_ALL2ALL:
        return (f"--all2all-backend {backend}: behind data parallelism our MoE runs only under {GATHER_ALL2ALL} "
                "(tokens all-gathered, partial sums reduce-scattered)")
    return ""


def choose(settings: plugin_settings.PluginSettings, moe: FusedMoEConfig, has_activation_scales: bool,
           device: torch.device, capability: int | None) -> backends.Selection:
    """Backend and mode for one MoE layer; a selection without a backend carries the reason."""
    return backends.choose(settings, device, moe_shape(moe), moe.in_dtype, has_activation_scales, capability,
                           _refusal(moe))


def describe_parallelism(moe: FusedMoEConfig) -> str:
    """The layer's expert parallelism as our log line states it ('' without EP)."""
    par = moe.moe_parallel_config
    if not par.use_ep:
        return ""
    how = (f"tokens of {par.dp_size} DP ranks all-gathered, partial sums reduce-scattered" if _gathers(moe)
           else "partial sums all-reduced")
    return (f"; expert parallel: {moe.num_local_experts} of {moe.num_experts} experts on this rank "
            f"(EP{par.ep_size}), {how}")


def _device_capability() -> int | None:
    cap = current_platform.get_device_capability()
    return cap.to_int() if cap is not None else None


def _max_batched_tokens(moe: FusedMoEConfig) -> int:
    """The most tokens one call can carry: a rank's batch, times the DP ranks whose tokens are gathered to it."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    scheduler = getattr(config, "scheduler_config", None)
    per_rank = getattr(scheduler, "max_num_batched_tokens", None)
    if isinstance(per_rank, int) and _gathers(moe):
        per_rank *= moe.moe_parallel_config.dp_size
    return common_settings.reserve_tokens(per_rank)


class Glm5ModelOptNvFp4FusedMoE(ModelOptNvFp4FusedMoE):
    """ModelOpt NVFP4 experts on a glm5-fp4 backend, or vLLM's own NVFP4 MoE when ours cannot serve the layer."""

    def __init__(self, quant_config: ModelOptNvFp4Config, moe_config: FusedMoEConfig) -> None:
        settings = plugin_settings.current()
        device = torch.device(moe_config.device or current_platform.device_type)
        has_scales = quant_config.quant_method == "NVFP4"
        selection = choose(settings, moe_config, has_scales, device, _device_capability())
        self.glm5_selection = selection
        self.glm5_backend: backends.Backend | None = selection.backend
        self.glm5_mode = mode = selection.mode
        if selection.backend is None:
            _log_once("warning", "glm5_fp4: MoE backend %r cannot serve these layers: %s; falling back to vLLM's own "
                      "NVFP4 MoE backend selection", settings.backend, selection.reason)
            super().__init__(quant_config, moe_config)
            return
        override = getattr(quant_config, "moe_activation_override", None)
        if override is not None:
            raise Glm5Fp4Error(f"glm5_fp4 backend {selection.backend.name}: the MoE activation override {override} "
                               "(--quantization-config) is not one it implements (per-tensor NVFP4 or BF16 activations "
                               "only); drop it, or serve with vLLM's own NVFP4 MoE (glm5-fp4 serve --stock)")
        # What: ModelOptNvFp4FusedMoE.__init__ is skipped; FusedMoEMethodBase's runs and the attributes vLLM's other
        #   code reads of this method (use_a16, per_token_activation, use_global_sf, nvfp4_backend) are set here.
        # Why: the parent's __init__ picks and builds one of vLLM's NVFP4 kernels (and refuses platforms without
        #   one: CPU, Hopper), which we would discard.
        # How: the parent's attribute list as of vLLM 0.26-0.33 (tests/test_vllm_versions.py loads our layers
        #   under each); an attribute vLLM adds later surfaces there.
        # Remove when: vLLM lets an out-of-tree quantization supply the MoE kernel without the parent's selection.
        FusedMoEMethodBase.__init__(self, moe_config)
        self.quant_config = quant_config
        self.use_a16 = quant_config.quant_method == "W4A16_NVFP4"
        self.per_token_activation = False
        self.use_global_sf = False
        self.nvfp4_backend = None
        self._routed_key: str | None = None
        self._prepared = None
        self._dense_method = None
        if selection.backend.engine_dense_w4a16 and mode == "w4a16":
            from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

            # Built now, inside vLLM's model-construction context; it runs the dequantized experts.
            self._dense_method = UnquantizedFusedMoEMethod(moe_config)
        _log_once("info", "glm5_fp4: NVFP4 MoE layers run on backend %s in %s mode (%s)%s", selection.backend.name,
                  mode, settings.describe(), describe_parallelism(moe_config))

    @property
    def method_name(self) -> str:
        if self.glm5_backend is None:
            return super().method_name
        return f"{type(self).__name__}[{self.glm5_backend.name},{self.glm5_mode}]"

    @property
    def supports_eplb(self) -> bool:
        # EPLB moves experts between ranks at run time (rewriting expert_map and the weights); our prepared
        # copies would go stale, so vLLM must not rebalance layers we serve.
        return self.glm5_backend is None

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        moe = self.moe
        extra_weight_attrs["weight_loader"] = checked_expert_loader(
            extra_weight_attrs["weight_loader"], moe.hidden_dim_unpadded or hidden_size, moe.intermediate_size)
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs)
        # Sentinels: a scale still NaN after loading was never in the checkpoint (torch.empty would be garbage).
        for name in ("w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale"):
            getattr(layer, name).data.fill_(math.nan)

    def _check_loaded(self, layer) -> None:
        where = getattr(layer, "layer_name", "experts")
        checks = [("w13_weight_scale_2", ("gate_proj", "up_proj")), ("w2_weight_scale_2", ("down_proj",))]
        if self.glm5_mode == "w4a4":
            checks += [("w13_input_scale", ("gate_proj", "up_proj")), ("w2_input_scale", ("down_proj",))]
        for name, projs in checks:
            t = getattr(layer, name).data
            missing = torch.isnan(t.view(t.shape[0], -1)).nonzero()
            if len(missing):
                expert, shard = missing[0].tolist()
                raise Glm5Fp4Error(f"checkpoint tensor {where}.{expert}.{projs[shard]}.{name.split('_', 1)[1]} was "
                                   "never loaded (missing from the checkpoint)")

    def process_weights_after_loading(self, layer) -> None:
        if self.glm5_backend is None:
            return super().process_weights_after_loading(layer)
        self._check_loaded(layer)
        where = getattr(layer, "layer_name", "experts")
        if self._dense_method is not None:
            self._to_engine_dense(layer, backends.experts_from_layer(layer, self.glm5_mode, where, _warn_once))
            return
        self._prepared = prepared = backends.prepare_layer(
            self.glm5_selection, layer, self.moe.in_dtype, self.moe.experts_per_token, _max_batched_tokens(self.moe),
            where,
            replace_parameter, _warn_once, expert_map=getattr(layer, "expert_map", None))
        backend, mode = self.glm5_backend, self.glm5_mode
        # Expert parallelism: vLLM routes to global ids and keeps the -1/local-id map on the layer
        # (RoutedExperts.expert_map, None without EP); our backends take it as is.
        self._routed = lambda x, w, ids: backend.forward(x, w, ids, prepared, mode, getattr(layer, "expert_map", None))
        if not current_platform.is_cuda_alike():
            from glm5_fp4.engines.vllm import ops

            self._routed_key = f"{where}#{id(self)}"
            ops.register_layer(self._routed_key, self._routed)
        self.moe_quant_config = FusedMoEQuantConfig.make()

    def _to_engine_dense(self, layer, experts: NvFp4Experts) -> None:
        """W4A16 on the dequant backend: dense experts in the model dtype, run by vLLM's unquantized MoE method."""
        dense = backends.dequantize_experts(experts, self.moe.in_dtype)
        replace_parameter(layer, "w13_weight", dense.w13)
        replace_parameter(layer, "w2_weight", dense.w2)
        for name in backends.SCALE_PARAMS:
            delattr(layer, name)
        self._dense_method.process_weights_after_loading(layer)
        self.moe_kernel = self._dense_method.moe_kernel
        self.moe_quant_config = self._dense_method.moe_quant_config

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig:
        if self.glm5_backend is None:
            return super().get_fused_moe_quant_config(layer)
        if self._dense_method is not None:
            return self._dense_method.get_fused_moe_quant_config(layer)
        return FusedMoEQuantConfig.make()

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if self.glm5_backend is None:
            return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        if self._dense_method is not None:
            return self._dense_method.apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        # Shared experts: with no modular kernel (moe_kernel is None) vLLM's runner computes them itself.
        if self._routed_key is None:
            # CUDA: already inside vLLM's opaque moe_forward op; call the backend (its own custom op) directly.
            return self._routed(x, topk_weights, topk_ids)
        return torch.ops.glm5_fp4_vllm.moe_routed(x, topk_weights, topk_ids, self._routed_key)
