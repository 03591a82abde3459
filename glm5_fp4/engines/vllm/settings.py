"""The plugin settings (:mod:`glm5_fp4.settings`) as vLLM spells them: ``--additional-config
'{"glm5_fp4": {"backend": "triton", "mode": "w4a16"}}'``, then ``GLM5_FP4_BACKEND`` / ``GLM5_FP4_MODE``.

Importable without vLLM; :func:`current` reads vLLM's config only when vLLM has one set.
"""

from __future__ import annotations

from glm5_fp4.settings import CONFIG_KEY, PluginSettings, from_sources

ORIGIN = "--additional-config"

__all__ = ["CONFIG_KEY", "ORIGIN", "PluginSettings", "current"]


# additional_config's key for what the plugin folded into vLLM's compile hash (fold_into_compile_hash)
COMPILED_KEY = "glm5_fp4_compiled"


def current() -> PluginSettings:
    """Settings for the vLLM config being built or run in this process (environment only outside vLLM)."""
    additional = None
    config = None
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        get_current_vllm_config_or_none = None
    if get_current_vllm_config_or_none is not None:
        config = get_current_vllm_config_or_none()
        additional = getattr(config, "additional_config", None) if config is not None else None
    settings = from_sources(additional, origin=ORIGIN)
    if config is not None:
        fold_into_compile_hash(config, settings)
    return settings


def fold_into_compile_hash(config, settings: PluginSettings) -> None:
    """What: the settings in use and the variables that change the compiled model (envvars.compiled_values) go into
    ``config.additional_config[COMPILED_KEY]``.
    Why: vLLM keys its compile cache and AOT-compiled bytecode by the config's hash, which covers additional_config
    but not our environment: a server started by hand with GLM5_FP4_BACKEND or GLM5_FP4_EXPERT_LAYOUT changed (not
    through ``glm5-fp4 serve``, which writes the backend into --additional-config) would load a graph compiled for
    other weights.
    How: the layers resolve their settings (here) while the model is built, before vLLM compiles it and computes
    the hash, in every worker alike. An additional_config that is not a dict (an object with its own compute_hash)
    is left alone.
    Remove when: vLLM lets a plugin add factors to its compile hash."""
    additional = getattr(config, "additional_config", None)
    if isinstance(additional, dict):
        from glm5_fp4 import envvars

        additional[COMPILED_KEY] = {"backend": settings.backend, "mode": settings.mode, **envvars.compiled_values()}
