"""Plugin options: which MoE backend and which activation mode, chosen at launch.

Two spellings, the first one set wins:

1. ``--additional-config '{"glm5_fp4": {"backend": "triton", "mode": "w4a16"}}'`` (vLLM hashes
   ``additional_config`` into its compile cache, so a changed backend never reuses a stale graph);
2. environment variables ``GLM5_FP4_BACKEND`` and ``GLM5_FP4_MODE``.

``backend``: ``auto`` (default), ``triton``, ``dequant``, ``reference`` (see :mod:`glm5_fp4.backends`).
``mode``: ``auto`` (default: W4A4 on GPUs with FP4 tensor cores when the checkpoint has activation scales,
else W4A16), ``w4a16`` (weight-only) or ``w4a4`` (activation quantization emulated / executed as Blackwell
kernels do it).

Importable without vLLM; :func:`current` reads vLLM's config only when vLLM has one set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from glm5_fp4.errors import Glm5Fp4Error

CONFIG_KEY = "glm5_fp4"
_KNOWN_KEYS = ("backend", "mode")


@dataclass(frozen=True)
class PluginSettings:
    backend: str = "auto"
    mode: str = "auto"
    source: str = "default"  # where the values came from, for log lines

    def describe(self) -> str:
        return f"backend={self.backend} mode={self.mode} (from {self.source})"


def _check(field: str, value: object, choices: tuple[str, ...], where: str) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise Glm5Fp4Error(f"{where}: {field} {value!r} is not one of {', '.join(choices)}")
    return value.lower()


def from_sources(additional_config: Mapping | None, environ: Mapping[str, str] | None = None) -> PluginSettings:
    """Resolve the settings from vLLM's ``additional_config`` dict and the environment."""
    from glm5_fp4 import backends  # torch: only when settings are actually resolved

    environ = os.environ if environ is None else environ
    ours = (additional_config or {}).get(CONFIG_KEY)
    if ours is not None and not isinstance(ours, Mapping):
        raise Glm5Fp4Error(f"--additional-config: {CONFIG_KEY!r} must be an object, e.g. "
                           f'{{"{CONFIG_KEY}": {{"backend": "triton"}}}}, got {ours!r}')
    ours = dict(ours or {})
    unknown = sorted(set(ours) - set(_KNOWN_KEYS))
    if unknown:
        raise Glm5Fp4Error(f"--additional-config {CONFIG_KEY}: unknown key(s) {unknown}; known: {list(_KNOWN_KEYS)}")
    values, sources = {}, []
    for field, env, choices in (("backend", backends.ENV_BACKEND, backends.names()),
                                ("mode", backends.ENV_MODE, backends.MODE_CHOICES)):
        if field in ours:
            values[field] = _check(field, ours[field], choices, f"--additional-config {CONFIG_KEY}")
            sources.append(f"additional_config.{field}")
        elif environ.get(env):
            values[field] = _check(field, environ[env], choices, f"environment variable {env}")
            sources.append(env)
    return PluginSettings(**values, source=", ".join(sources) or "default")


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
    return from_sources(additional)
