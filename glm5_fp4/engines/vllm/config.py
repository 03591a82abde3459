"""The ``glm5_nvfp4`` quantization config: vLLM's ModelOpt NVFP4 config with our MoE method.

Checkpoints in ModelOpt's NVFP4 layout (nvidia/GLM-5-NVFP4 and the tiny ones `glm5-fp4 make-checkpoint`
writes) load unchanged: parsing, exclusions, linear and KV-cache methods are inherited. What changes:

* experts run on a glm5-fp4 backend (:class:`Glm5ModelOptNvFp4FusedMoE`);
* linears get checked loading and, on CPU, a kernel (:mod:`.linear`);
* the name is claimed only when asked. vLLM asks every registered config's
  ``override_quantization_method`` about every checkpoint, custom ones first, and the first non-None
  answer becomes the quantization method. Answering for ModelOpt checkpoints without being asked would
  hijack stock ``modelopt_fp4`` serving; answering None when asked would let the built-in ``modelopt_fp4``
  override silently replace ``glm5_nvfp4``. So: ``glm5_nvfp4`` exactly when the user passed
  ``--quantization glm5_nvfp4`` and the checkpoint is ModelOpt NVFP4, a clear error when the user passed
  it for any other checkpoint, None otherwise.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

from glm5_fp4.engines.vllm import compat
from glm5_fp4.engines.vllm.linear import glm5_linear_method
from glm5_fp4.engines.vllm.loading import NOT_NVFP4_HINT
from glm5_fp4.engines.vllm.moe import Glm5ModelOptNvFp4FusedMoE
from glm5_fp4.errors import Glm5Fp4Error

NAME = "glm5_nvfp4"


class Glm5NvFp4Config(ModelOptNvFp4Config):
    """ModelOpt NVFP4 (W4A4 ``NVFP4`` or weight-only ``W4A16_NVFP4``) with glm5-fp4's MoE backends."""

    FusedMoEMethodCls = Glm5ModelOptNvFp4FusedMoE

    def __init__(self, quant_method: str = "NVFP4", is_checkpoint_nvfp4_serialized: bool = False,
                 kv_cache_quant_algo: str | None = None, exclude_modules: list[str] | None = None,
                 group_size: int = 16, **kwargs: Any) -> None:
        # Constructed without arguments only when the checkpoint declares no quantization config at all
        # (get_config_filenames() is empty): remember it, so loading names the first non-NVFP4 tensor.
        self.declared_by_checkpoint = is_checkpoint_nvfp4_serialized
        super().__init__(quant_method, True, kv_cache_quant_algo, exclude_modules, group_size, **kwargs)

    def get_name(self) -> str:
        return NAME

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if user_quant != NAME:
            return None  # never claim a checkpoint the user did not ask us for
        algo = cls._extract_modelopt_quant_algo(hf_quant_cfg)
        if algo is not None and "FP4" in algo:
            return NAME
        method = (hf_quant_cfg or {}).get("quant_method")
        raise Glm5Fp4Error(
            f"--quantization {NAME} needs a ModelOpt NVFP4 checkpoint, but its quantization config has "
            f"quant_method={method!r}, quant_algo={algo!r} (config.json quantization_config / hf_quant_config.json)"
        )

    @staticmethod
    def get_config_filenames() -> list[str]:
        # What: no config file names, unlike ModelOptNvFp4Config's ["hf_quant_config.json"].
        # Why: vLLM folds hf_quant_config.json into hf_config.quantization_config when it loads config.json
        #   (transformers_utils/config.py), so a ModelOpt checkpoint never reaches the file lookup; only a
        #   checkpoint with no quantization config does, and there vLLM's answer would be the bare
        #   "Cannot find the config file for glm5_nvfp4". With [] vLLM builds Glm5NvFp4Config() instead and
        #   loading stops at the first tensor that is not NVFP4, naming it (loading.NOT_NVFP4_HINT).
        # Upstream: vllm/model_executor/model_loader/weight_utils.py get_quant_config (0.32 and 0.33).
        # Remove when: vLLM lets a config validate a checkpoint that declares no quantization itself.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Glm5NvFp4Config":
        return super().from_config(compat.normalise_modelopt_config(config))

    def get_quant_method(self, layer, prefix: str):
        method = super().get_quant_method(layer, prefix)
        if isinstance(method, compat.modelopt_nvfp4_linear_methods()):  # linears and an NVFP4 lm_head
            return glm5_linear_method(method, prefix, getattr(self, "packed_modules_mapping", None),
                                      self.quant_method == "W4A16_NVFP4",
                                      "" if self.declared_by_checkpoint else NOT_NVFP4_HINT)
        return method
