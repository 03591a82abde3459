"""NVFP4 linear layers: a CPU kernel for vLLM's NVFP4 linear registry, and our ModelOpt linear method.

vLLM's CPU build has no NVFP4 linear kernel (``_POSSIBLE_NVFP4_KERNELS`` lists CUDA and ROCm only), so a
ModelOpt NVFP4 checkpoint fails with "Failed to find a kernel that can implement the NVFP4 linear layer".
:class:`Glm5CpuNvFp4LinearKernel` is registered for the CPU platform with vLLM's own
``register_linear_kernel``. It dequantizes the weight once after loading (e2m1 x block scale x global scale
in float32, rounded once to the model dtype: exactly the checkpoint's ``--dequantized`` BF16 twin) and then
runs vLLM's own unquantized GEMM on it, so W4A16 output equals stock vLLM serving that twin bit for bit.
In W4A4 mode the input is first quantized to NVFP4 and back with the checkpoint's static input scale.
"""

from __future__ import annotations

import torch

from vllm.logger import init_logger
from vllm.model_executor.kernels.linear.nvfp4 import NvFp4LinearKernel, NvFp4LinearLayerConfig
from vllm.model_executor.layers.linear import UnquantizedLinearMethod, register_weight_loader_v2_supported_method
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from glm5_fp4 import backends, nvfp4
from glm5_fp4.engines.vllm import settings as plugin_settings
from glm5_fp4.engines.vllm.loading import checked_linear_loader

logger = init_logger(f"vllm.{__name__}")


def _model_dtype() -> torch.dtype:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    model_config = getattr(config, "model_config", None)
    return model_config.dtype if model_config is not None else torch.bfloat16


class Glm5CpuNvFp4LinearKernel(NvFp4LinearKernel):
    """NVFP4 linear on CPU: dequantize once after loading, then vLLM's unquantized CPU GEMM."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if current_platform.is_cpu():
            return True, None
        return False, "glm5_fp4's NVFP4 linear kernel is for the CPU platform"

    @classmethod
    def can_implement(cls, config: NvFp4LinearLayerConfig) -> tuple[bool, str | None]:
        return True, None

    def __init__(self, config: NvFp4LinearLayerConfig) -> None:
        super().__init__(config)
        # Built now, inside vLLM's model-construction context, as UnquantizedLinearMethod reads that config.
        self._dense = UnquantizedLinearMethod()
        self._dtype = _model_dtype()
        self.mode = "w4a16"

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # A CPU kernel: ``auto`` resolves to W4A16 (no FP4 tensor cores).
        self.mode = backends.resolve_mode(plugin_settings.current().mode, "cpu", hasattr(layer, "input_global_scale"),
                                          where=getattr(layer, "prefix", None) or "linear")
        dense = nvfp4.dequantize(layer.weight.data, layer.weight_scale.data, layer.weight_global_scale.data,
                                 dtype=self._dtype)
        replace_parameter(layer, "weight", dense)
        # The packed weight is gone; its scales would only hold memory.
        for name in ("weight_scale", "weight_global_scale", "alpha"):
            if hasattr(layer, name):
                delattr(layer, name)
        if self.mode == "w4a4":
            # ModelOpt's input_scale (amax / 2688); vLLM keeps it as input_global_scale.
            layer.glm5_input_scale = layer.input_global_scale.data.float().clone()
        self._dense.process_weights_after_loading(layer)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode == "w4a4":
            x = nvfp4.fake_quantize_activation(x, layer.glm5_input_scale)
        return self._dense.apply(layer, x, bias)


class _CheckedNvFp4Linear:
    """Mixed in front of vLLM's ModelOpt NVFP4 linear method: checked loading, a CPU kernel for weight-only.

    vLLM's class differs by version (0.32/0.33: one generic ``ModelOptLinearMethod``; 0.26: one class per
    algorithm, see :func:`compat.modelopt_nvfp4_linear_methods`), so the concrete classes are made per base
    class by :func:`glm5_linear_method`.
    """

    prefix: str
    packed: dict | None
    hint: str
    weight_only: bool

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        extra_weight_attrs["weight_loader"] = checked_linear_loader(
            extra_weight_attrs["weight_loader"], layer, self.prefix, input_size, list(output_partition_sizes),
            self.packed, self.hint)
        # Workaround (not a patch: nothing of vLLM's is replaced).
        # What: on CPU, a weight-only (W4A16_NVFP4) layer gets our CPU kernel after vLLM's selection fails.
        # Why: init_nvfp4_linear_kernel(use_a16=True) forces MarlinNvFp4LinearKernel with --linear-backend auto
        #   and filters the registry through a fixed tuple of CUDA W4A16 kernels, so a registered CPU kernel
        #   is never considered and create_weights raises ValueError (W4A4 "NVFP4" checkpoints do use the
        #   registry and need none of this).
        # How: vLLM registers the parameters before selecting the kernel; catch that ValueError on CPU only and
        #   set the kernel; anything else re-raises.
        # Upstream: vllm/model_executor/kernels/linear/__init__.py init_nvfp4_linear_kernel (0.32 and 0.33;
        #   0.26 pins Marlin for W4A16 in the method's constructor and is served on GPUs only here).
        # Remove when: init_nvfp4_linear_kernel consults _POSSIBLE_NVFP4_KERNELS[platform] for W4A16.
        try:
            super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                                   output_size, params_dtype, **extra_weight_attrs)
        except ValueError:
            if not (current_platform.is_cpu() and self.weight_only and hasattr(layer, "weight")):
                raise
            self.kernel = Glm5CpuNvFp4LinearKernel(NvFp4LinearLayerConfig())


_CLASSES: dict[type, type] = {}


def glm5_linear_class(base_cls: type) -> type:
    """``Glm5<vLLM class name>``: the checked subclass of one of vLLM's ModelOpt NVFP4 linear methods.

    The name keeps the ``ModelOpt`` part vLLM's own ModelOpt linear methods use, and the class is
    registered for vLLM's v2 (BasevLLMParameter) weight loader like them (vLLM matches it by name).
    """
    cls = _CLASSES.get(base_cls)
    if cls is None:
        cls = type(f"Glm5{base_cls.__name__}", (_CheckedNvFp4Linear, base_cls),
                   {"__module__": __name__, "__doc__": f"{base_cls.__name__} with glm5-fp4's checked loading."})
        register_weight_loader_v2_supported_method(cls)
        _CLASSES[base_cls] = cls
    return cls


def glm5_linear_method(base, prefix: str, packed: dict | None, weight_only: bool, hint: str = ""):
    """``base`` (the method vLLM's ModelOpt config chose for a layer) as its checked subclass.

    What: a new object of the subclass holding ``base``'s attributes; ``base`` itself is dropped.
    Why: the constructors differ by version (0.33: quantization spec, checkpoint context and format;
      0.26: the quant config) and pick the kernel; copying the state needs neither signature and keeps
      vLLM's kernel choice as it was made.
    """
    method = object.__new__(glm5_linear_class(type(base)))
    method.__dict__.update(vars(base))
    method.prefix, method.packed, method.hint, method.weight_only = prefix, packed, hint, weight_only
    return method


def register_cpu_kernel() -> bool:
    """Add the CPU kernel to vLLM's NVFP4 linear registry once; returns whether it was added now."""
    from vllm.model_executor.kernels.linear import _POSSIBLE_NVFP4_KERNELS, register_linear_kernel
    from vllm.platforms import PlatformEnum

    if Glm5CpuNvFp4LinearKernel in _POSSIBLE_NVFP4_KERNELS.get(PlatformEnum.CPU, []):
        return False
    register_linear_kernel(Glm5CpuNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    return True
