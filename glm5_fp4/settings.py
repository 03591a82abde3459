"""What the user chose for our MoE layers (backend, activation mode) and the defaults every engine adapter shares.

Two spellings, the first one set wins per field:

1. the engine's own configuration where it has one for plugins (vLLM: ``--additional-config
   '{"glm5_fp4": {"backend": "triton", "mode": "w4a16"}}'``, hashed into vLLM's compile cache so a changed
   backend never reuses a stale graph);
2. environment variables ``GLM5_FP4_BACKEND`` and ``GLM5_FP4_MODE`` (the only spelling under SGLang).

``backend``: ``auto`` (default), ``triton``, ``dequant``, ``reference`` (see :mod:`glm5_fp4.backends`).
``mode``: ``auto`` (default: W4A4 where FP4 tensor cores multiply it -- a Blackwell GPU with the native FP4 path
on, ``GLM5_FP4_NATIVE_FP4=1`` -- when the checkpoint has activation scales, else W4A16), ``w4a16`` (weight-only) or ``w4a4`` (activation quantization emulated / executed as Blackwell
kernels do it); :func:`glm5_fp4.backends.resolve_mode` turns it into the layer's mode.

No engine import here: adapters read their engine's config and pass it to :func:`from_sources`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from glm5_fp4.errors import Glm5Fp4Error

CONFIG_KEY = "glm5_fp4"
ENV_BACKEND = "GLM5_FP4_BACKEND"
ENV_MODE = "GLM5_FP4_MODE"
_KNOWN_KEYS = ("backend", "mode")
# The choices as every torch-free reader (launcher, profiles, environment check) spells them; glm5_fp4.backends
# (which imports torch) holds the registry they name, and tests/test_launch_profile.py checks the two agree.
BACKEND_CHOICES = ("auto", "triton", "dequant", "reference")
MODE_CHOICES = ("auto", "w4a16", "w4a4")
# Buffers for the largest forward are reserved before CUDA-graph capture (never allocated inside it). When the
# engine does not say how many tokens one forward may carry, reserve for vLLM's default max_num_batched_tokens.
DEFAULT_RESERVE_TOKENS = 8192


@dataclass(frozen=True)
class PluginSettings:
    backend: str = "auto"
    mode: str = "auto"
    source: str = "default"  # where the values came from, for log lines

    def describe(self) -> str:
        return f"backend={self.backend} mode={self.mode} (from {self.source})"


def check_choice(field: str, value: object, choices: tuple[str, ...], where: str) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise Glm5Fp4Error(f"{where}: {field} {value!r} is not one of {', '.join(choices)}")
    return value.lower()


def from_sources(engine_config: Mapping | None, environ: Mapping[str, str] | None = None,
                 origin: str = "engine config") -> PluginSettings:
    """Settings from the engine's plugin config dict (``{"glm5_fp4": {...}}``, named ``origin`` in errors) and
    the environment."""
    from glm5_fp4 import backends  # torch: only when settings are actually resolved

    if environ is None:
        # where the settings are resolved (a layer's construction, before any weight is read), every GLM5_FP4_*
        # value of the process is read too: a bad flag stops the start, not the first request
        from glm5_fp4 import envvars

        envvars.check()
    environ = os.environ if environ is None else environ
    ours = (engine_config or {}).get(CONFIG_KEY)
    if ours is not None and not isinstance(ours, Mapping):
        raise Glm5Fp4Error(f"{origin}: {CONFIG_KEY!r} must be an object, e.g. "
                           f'{{"{CONFIG_KEY}": {{"backend": "triton"}}}}, got {ours!r}')
    ours = dict(ours or {})
    unknown = sorted(set(ours) - set(_KNOWN_KEYS))
    if unknown:
        raise Glm5Fp4Error(f"{origin} {CONFIG_KEY}: unknown key(s) {unknown}; known: {list(_KNOWN_KEYS)}")
    values, sources = {}, []
    for field, env, choices in (("backend", ENV_BACKEND, backends.names()), ("mode", ENV_MODE, backends.MODE_CHOICES)):
        if field in ours:
            values[field] = check_choice(field, ours[field], choices, f"{origin} {CONFIG_KEY}")
            sources.append(f"{origin} {CONFIG_KEY}.{field}")
        elif environ.get(env):
            values[field] = check_choice(field, environ[env], choices, f"environment variable {env}")
            sources.append(env)
    return PluginSettings(**values, source=", ".join(sources) or "default")


def reserve_tokens(*sizes: object) -> int:
    """Tokens to reserve buffers for: the largest positive size the engine reports, else the default."""
    known = [s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0]
    return max(known) if known else DEFAULT_RESERVE_TOKENS
