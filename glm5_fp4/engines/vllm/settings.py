"""The plugin settings (:mod:`glm5_fp4.settings`) as vLLM spells them: ``--additional-config
'{"glm5_fp4": {"backend": "triton", "mode": "w4a16"}}'``, then ``GLM5_FP4_BACKEND`` / ``GLM5_FP4_MODE``.

Importable without vLLM; :func:`current` reads vLLM's config only when vLLM has one set.
"""

from __future__ import annotations

from glm5_fp4.settings import CONFIG_KEY, PluginSettings, from_sources

ORIGIN = "--additional-config"

__all__ = ["CONFIG_KEY", "ORIGIN", "PluginSettings", "current"]


def current() -> PluginSettings:
    """Settings for the vLLM config being built or run in this process (environment only outside vLLM)."""
    additional = None
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        get_current_vllm_config_or_none = None
    if get_current_vllm_config_or_none is not None:
        config = get_current_vllm_config_or_none()
        additional = getattr(config, "additional_config", None) if config is not None else None
    return from_sources(additional, origin=ORIGIN)
