"""The package's environment variables: the one home for their names, defaults and parsing.

A switch read as "anything but 0 is on" turns ``GLM5_FP4_NATIVE_FP4=false`` into *on*, and a number that falls back
to its default when it does not parse hides the typo: an A/B comparison then compares the same thing twice. So a
flag takes 1/0, true/false, yes/no, on/off (any case; unset or empty: its default), a number must be finite and in
range, and anything else is an error naming the variable. :func:`check` reads them all at once, where a plugin
registers and before ``serve`` launches, so a bad value stops the start rather than the first request.

The variables whose values are names (backend, mode, layout: :mod:`glm5_fp4.settings`,
:mod:`glm5_fp4.kernels.layout`) keep their own validators; :func:`check` runs those too.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from glm5_fp4.errors import Glm5Fp4Error

PREFIX = "GLM5_FP4_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Var:
    name: str
    kind: str  # "flag", "number" or "text" (parsed where it is used)
    default: object = None
    minimum: float | None = None  # numbers
    doc: str = ""
    # changes what an engine compiles (the prepared weights, which kernels a layer calls): part of vLLM's compile
    # hash (compiled_values)
    compiled: bool = False


VARS: dict[str, Var] = {v.name: v for v in (
    Var("GLM5_FP4_BACKEND", "text", "auto", doc="MoE backend (glm5_fp4.settings)", compiled=True),
    Var("GLM5_FP4_MODE", "text", "auto", doc="activation mode (glm5_fp4.settings)", compiled=True),
    Var("GLM5_FP4_EXPERT_LAYOUT", "text", "tiled", doc="prepared expert layout (glm5_fp4.kernels.layout)",
        compiled=True),
    Var("GLM5_FP4_NATIVE_FP4", "flag", False, doc="the opt-in native FP4-MMA path on Blackwell", compiled=True),
    Var("GLM5_FP4_WARMUP", "flag", True, doc="compile the MoE kernels at load time"),
    Var("GLM5_FP4_MOE_NO_ASM", "flag", False, doc="the decode without inline PTX (a diagnostic)", compiled=True),
    Var("GLM5_FP4_LAYER_TIMERS", "flag", False, doc="per-layer GPU timers in the engines"),
    Var("GLM5_FP4_LAYER_TIMERS_OUT", "text", doc="where the layer timers write"),
    Var("GLM5_FP4_SLOW_CALL_MS", "number", 50.0, minimum=0.0, doc="slow MoE call warning threshold; 0: off"),
    Var("GLM5_FP4_HOST_SAMPLES", "text", doc="folder for the host sampler's files (on when set)"),
    Var("GLM5_FP4_HOST_SAMPLE_MS", "number", 20.0, minimum=0.5, doc="the host sampler's interval"),
    Var("GLM5_FP4_HARDWARE", "text", doc="a YAML file of extra GPUs (glm5_fp4.hardware)"),
    Var("GLM5_FP4_GIT_SHA", "text", doc="the commit results record, where .git is stale"),
)}


def _var(name: str, kind: str) -> Var:
    v = VARS.get(name)
    if v is None or v.kind != kind:
        raise KeyError(f"{name} is not a registered {kind} (glm5_fp4.envvars.VARS)")
    return v


def _raw(name: str, environ: Mapping[str, str] | None) -> str | None:
    raw = (os.environ if environ is None else environ).get(name)
    return None if raw is None or not raw.strip() else raw


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    v = _var(name, "flag")
    raw = _raw(name, environ)
    if raw is None:
        return bool(v.default)
    word = raw.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise Glm5Fp4Error(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off ({v.doc}; unset: "
                       f"{'on' if v.default else 'off'})")


def number(name: str, environ: Mapping[str, str] | None = None) -> float:
    v = _var(name, "number")
    raw = _raw(name, environ)
    if raw is None:
        return float(v.default)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (v.minimum is not None and value < v.minimum):
        raise Glm5Fp4Error(f"{name}={raw!r}: expected a number >= {v.minimum:g} ({v.doc}; unset: {v.default:g})")
    return value


def compiled_values(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The variables that change what an engine compiles, as read (a flag as a bool, so "on" and "1" are one value;
    a name as given, its default where unset). The backend and mode are left to the caller, which has them resolved
    together with the engine's own config (glm5_fp4.settings)."""
    out: dict[str, object] = {}
    for v in VARS.values():
        if v.compiled and v.name not in ("GLM5_FP4_BACKEND", "GLM5_FP4_MODE"):
            out[v.name] = flag(v.name, environ) if v.kind == "flag" else (_raw(v.name, environ) or v.default)
    return out


def unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """Set variables that look like a misspelt one of ours (a close match), each with its likely meaning. Other
    GLM5_FP4_* names (the test suite's, the benchmarks') are not ours to judge."""
    environ = os.environ if environ is None else environ
    out = []
    for name in sorted(environ):
        if name.startswith(PREFIX) and name not in VARS:
            close = difflib.get_close_matches(name, VARS, n=1, cutoff=0.85)
            if close:
                out.append(f"{name} (did you mean {close[0]}?)")
    return out


def report(log) -> None:
    """At a plugin's registration, in every engine process: what :func:`check` and :func:`unknown` find, logged (an
    engine dies in every process on a plugin's exception, also where glm5-fp4 is not asked for); the MoE layers'
    construction raises it (settings.from_sources)."""
    try:
        check()
    except Glm5Fp4Error as exc:
        log.error("glm5_fp4: %s (a glm5-fp4 MoE layer will refuse to load)", exc)
    for name in unknown():
        log.warning("glm5_fp4: unknown environment variable %s", name)


def check(environ: Mapping[str, str] | None = None) -> None:
    """Every variable of ours that is set, read as its user will: one error naming each one that cannot be. No torch
    (the launcher calls it): the backend and mode names from :mod:`glm5_fp4.settings`, the layout's
    module only where that variable is set."""
    from glm5_fp4 import settings

    environ = os.environ if environ is None else environ
    bad = []
    for v in VARS.values():
        try:
            if v.kind == "flag":
                flag(v.name, environ)
            elif v.kind == "number":
                number(v.name, environ)
            elif v.name in (settings.ENV_BACKEND, settings.ENV_MODE) and _raw(v.name, environ) is not None:
                field, choices = (("backend", settings.BACKEND_CHOICES) if v.name == settings.ENV_BACKEND
                                   else ("mode", settings.MODE_CHOICES))
                settings.check_choice(field, environ[v.name], tuple(choices), f"environment variable {v.name}")
            elif v.name == "GLM5_FP4_EXPERT_LAYOUT" and _raw(v.name, environ) is not None:
                from glm5_fp4.kernels.layout import layout_from_env

                layout_from_env(environ)
        except Glm5Fp4Error as exc:
            bad.append(str(exc))
    if bad:
        raise Glm5Fp4Error("bad environment: " + "; ".join(bad))
