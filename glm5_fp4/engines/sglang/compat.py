"""The one place where the SGLang versions this plugin runs on differ for it.

Targets: SGLang 0.5.23 (what users run: primary) and SGLang 0.5.15 (the newest release that pins torch 2.11,
the lent H200s' torch: the GPU test vehicle). Checked by diffing the wheels' sources (plugins/,
server_args.py, arg_groups/choices.py, layers/moe/{utils.py, moe_runner/{base,runner}.py,
token_dispatcher/standard.py, fused_moe_triton/layer.py, topk.py}, layers/quantization/modelopt_quant.py,
model_executor/model_runner.py, runtime_context.py, managers/io_struct.py, launch_server.py);
tests/sglang/test_sglang_versions.py runs the plugin against each version's sources. What differs:

* where the public ``--moe-runner-backend`` choice list lives: ``sglang.srt.arg_groups.choices`` (0.5.23),
  ``sglang.srt.server_args`` (0.5.15), same function name (:func:`add_moe_runner_backend_choice`);
* runner cores: 0.5.23 has ``register_moe_runner_core(name, factory)`` (a ``RegisteredMoeRunnerBackend``
  identifier; ``MoeRunner.__init__`` asks the registered factories first). 0.5.15 has no registry: its
  ``MoeRunnerBackend`` is a closed Enum, ``initialize_moe_config(server_args)`` raises ValueError for any other
  name and ``MoeRunner.__init__`` raises NotImplementedError. :func:`register_runner_core` returns two AROUND
  hooks that stand in for the registry there (documented at :func:`legacy_hooks`);
* the runner-core base class: ``DispatchMoeRunnerCore`` (0.5.23); 0.5.15 has none, and its ``MoeRunner.run``
  calls ``run_from_dispatch`` on any core that has one (:func:`dispatch_runner_core_base`);
* the attributes ``ModelOptNvFp4FusedMoEMethod.__init__`` sets (0.5.15 lacks ``_lora_marlin`` and
  ``use_flashinfer_trtllm_weight_layout``; :func:`nvfp4_moe_init_attributes`) and its platform check
  (``get_platform().is_blackwell`` vs ``is_blackwell_supported()``; both raise the same "does not support
  NVFP4" ValueError, which is what our ``__init__`` hook catches);
* ``MoeRunnerConfig``: 0.5.23 adds fields (``layer``, ``runner_backend``, ``gemm1_beta``, ...); every field the
  runner core reads (``activation``, ``is_gated``, ``apply_router_weight_on_input``, ``no_combine``,
  ``gemm1_alpha``, ``gemm1_clamp_limit``, ``swiglu_limit``, ``layer_id``, ``top_k``, ``params_dtype``) is in both;
* server flags our launch profiles generate (:func:`server_flags`): data-parallel attention is
  ``--attn-dp-size N`` (0.5.23) and ``--dp-size N --enable-dp-attention`` (0.5.15); the ``--kv-cache-dtype`` and
  ``--moe-runner-backend`` choice lists (:data:`KV_CACHE_DTYPES`, :data:`MOE_RUNNER_BACKENDS`).

The same in both (so nothing here): the ``sglang.srt.plugins`` entry point and ``load_plugins()`` in every
scheduler process; ``HookRegistry`` (AROUND hooks, ``__wrapped__``, propagation to ``from X import Y`` copies);
``ModelOptNvFp4FusedMoEMethod``'s ``create_weights`` / ``create_moe_runner`` / ``process_weights_after_loading``
/ ``apply`` signatures and its ``_moe_runner_backend`` cache; ``StandardDispatchOutput``,
``StandardCombineInput``, ``StandardTopKOutput``; the standard dispatcher's local expert ids (-1 for another
rank's) under ``--ep-size`` > 1; routed scaling already in the top-k weights for ModelOpt NVFP4;
``get_moe_a2a_backend()``; ``runtime_context.get_server_args()``; ``ModelRunner.load_model`` / ``forward``
(layer timers); ``/start_profile`` fields; ``python -m sglang.launch_server``; every other flag the profiles
generate.

Everything here is importable without SGLang; the functions that need it import it when called.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import re
from dataclasses import dataclass
from typing import Any, Callable

PRIMARY = "0.5.23"
VEHICLE = "0.5.15"

# -- stock-engine defects that bear on A/B comparisons ------------------------------------------------------------

# SGLang 0.5.15 multiplies the routed experts' sum by routed_scaling_factor twice on its Marlin NVFP4 MoE path:
# FusedMoE folds it into the top-k weights for every ModelOpt NVFP4 layer (fused_moe_triton/layer.py:337) and
# fused_marlin_moe applies it again in moe_sum_reduce. GLM-5 / GLM-4.5 (factor 2.5) come out 2.5x too large in
# every MoE layer: on the H200 (2026-12-01) stock Marlin was 0.76 nats off its own BF16 twin, ours 0.004.
# Fixed upstream by sgl-project/sglang#31762 (0.5.23's _fuses_routed_scaling_factor_in_topk excludes Marlin).
# Speed comparisons stay fair (one scalar multiply); accuracy comparisons against stock Marlin do not.
MARLIN_NVFP4_DOUBLE_SCALING_FIXED_IN = "0.5.23"  # the first release checked to have the fix (0.5.16-0.5.22 unchecked)
MARLIN_NVFP4_DOUBLE_SCALING_SEEN_IN = "0.5.15"


def stock_marlin_nvfp4_scales_twice(version: str | None = None) -> bool | None:
    """Whether this SGLang's stock Marlin NVFP4 MoE applies routed_scaling_factor twice: True for the release
    whose sources were read with the defect, False from the first one read with the fix, None otherwise (not
    checked; a pre-release counts as not yet its version)."""
    version = version or installed_version()
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(.*)$", version or "")
    if m is None:
        return None
    release, rest = tuple(int(g) for g in m.groups()[:3]), m.group(4)
    final = rest == "" or rest.startswith(("+", ".post"))
    if final and release == _key(MARLIN_NVFP4_DOUBLE_SCALING_SEEN_IN):
        return True
    if release > _key(MARLIN_NVFP4_DOUBLE_SCALING_FIXED_IN) or (final and release == _key(MARLIN_NVFP4_DOUBLE_SCALING_FIXED_IN)):
        return False
    return None


# -- server flags (launch profiles) ------------------------------------------------------------------------------

# 0.5.15's `--moe-runner-backend` and `--kv-cache-dtype` choices (server_args.py); 0.5.23's are the lists in
# glm5_fp4.launch.engine_choices. Tests compare both with each version's own parser.
MOE_RUNNER_BACKENDS_0515 = (
    "auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "experimental_sgl_trtllm",
    "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_cutedsl", "cutlass", "aiter",
    "marlin",
)
KV_CACHE_DTYPES_0515 = ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1")


def _key(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def spelling(version: str | None) -> str:
    """Which flag spelling a server of ``version`` takes: ``"0.5.15"`` for 0.5.15 and older, else ``"0.5.23"``
    (releases between the two are not checked and get the primary spelling)."""
    return VEHICLE if version is not None and _key(version) <= _key(VEHICLE) else PRIMARY


def installed_version() -> str | None:
    """The installed ``sglang`` distribution's version (metadata only: SGLang is not imported)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class ServerFlags:
    """The profile-generated flags whose spelling or choices differ between the two versions."""

    version: str
    moe_runner_backends: tuple[str, ...]
    kv_cache_dtypes: tuple[str, ...]
    # 0.5.15's ServerArgs derives a gRPC port as --port + 10000 and exits when that passes 65535, even when
    # gRPC is off; 0.5.23 derives none.
    max_port: int = 65535

    def attention_dp(self, size: int) -> tuple[str, ...]:
        if self.version == VEHICLE:
            return ("--dp-size", str(size), "--enable-dp-attention")
        return ("--attn-dp-size", str(size))

    @property
    def attention_dp_spelling(self) -> str:
        return "--dp-size N --enable-dp-attention" if self.version == VEHICLE else "--attn-dp-size N"


def server_flags(version: str | None = None) -> ServerFlags:
    """Flags for an SGLang server of ``version`` (default: the installed one, else the primary target)."""
    from glm5_fp4.launch.engine_choices import SGLANG_KV_CACHE_DTYPES, SGLANG_MOE_BACKENDS

    which = spelling(version or installed_version())
    if which == VEHICLE:
        return ServerFlags(VEHICLE, MOE_RUNNER_BACKENDS_0515, KV_CACHE_DTYPES_0515, max_port=65535 - 10000)
    return ServerFlags(PRIMARY, SGLANG_MOE_BACKENDS, SGLANG_KV_CACHE_DTYPES)


# -- inside SGLang: choice list, runner core ---------------------------------------------------------------------

def running_version() -> str:
    """``sglang.__version__`` of the imported package (the metadata can describe another copy on sys.path)."""
    import sglang

    return sglang.__version__


def add_moe_runner_backend_choice(name: str) -> None:
    """``--moe-runner-backend`` (and ``--speculative-moe-runner-backend``) accept ``name``; idempotent."""
    try:
        choices = importlib.import_module("sglang.srt.arg_groups.choices")  # 0.5.23
    except ModuleNotFoundError:
        choices = importlib.import_module("sglang.srt.server_args")  # 0.5.15
    if name not in choices.MOE_RUNNER_BACKEND_CHOICES:
        choices.add_moe_runner_backend_choices([name])


def has_runner_core_registry() -> bool:
    from sglang.srt.layers.moe.moe_runner import runner

    return hasattr(runner, "register_moe_runner_core")


@dataclass(frozen=True)
class LegacyRegisteredBackend:
    """The backend identifier SGLang 0.5.15 would have for a registered name (0.5.23's
    ``RegisteredMoeRunnerBackend``): ``value`` is the name and every built-in predicate (``is_marlin()``,
    ``is_flashinfer_trtllm()``, ...) is False, so SGLang's own branches treat it as no backend of theirs."""

    value: str

    @property
    def name(self) -> str:
        return self.value.upper()

    def __getattr__(self, attr: str):
        if attr.startswith("is_"):
            return _false
        raise AttributeError(attr)


def _false() -> bool:
    return False


_LEGACY_FACTORIES: dict[str, Callable] = {}


def registered_backend(name: str):
    """SGLang's identifier of the registered backend ``name``."""
    if has_runner_core_registry():
        from sglang.srt.layers.moe.utils import resolve_moe_runner_backend

        return resolve_moe_runner_backend(name)
    if name not in _LEGACY_FACTORIES:
        raise ValueError(f"MoE runner backend {name!r} is not registered")
    return LegacyRegisteredBackend(name)


def register_runner_core(name: str, factory: Callable) -> dict[str, Callable]:
    """Register ``factory(MoeRunnerConfig) -> core`` for ``--moe-runner-backend name``; idempotent.

    Returns the AROUND hooks (HookRegistry target -> function) the caller must register as well: none on
    0.5.23, :func:`legacy_hooks` on 0.5.15."""
    if has_runner_core_registry():
        from sglang.srt.layers.moe.moe_runner import register_moe_runner_core
        from sglang.srt.layers.moe.moe_runner.runner import _CUSTOM_RUNNER_CORE_FACTORIES

        if name not in _CUSTOM_RUNNER_CORE_FACTORIES:
            register_moe_runner_core(name, factory)
        return {}
    _LEGACY_FACTORIES[name] = factory
    return legacy_hooks()


def legacy_hooks() -> dict[str, Callable]:
    """SGLang 0.5.15 (no runner-core registry): two AROUND hooks in its place.

    1. ``sglang.srt.layers.moe.utils.initialize_moe_config``
       What: for a registered name in ``--moe-runner-backend`` / ``--speculative-moe-runner-backend``, runs the
       original on a copy of the server args with ``auto`` there, then sets the module's backend globals to
       :class:`LegacyRegisteredBackend` (the speculative one follows the main one when unset, as SGLang does).
       Why: the original does ``MoeRunnerBackend(name)``, a closed Enum: ValueError for any plugin name.
       How: ``copy.copy`` of the args (nothing else reads the copy); every other field is the original's work.
    2. ``sglang.srt.layers.moe.moe_runner.runner.MoeRunner.__init__``
       What: for a registered backend, sets the attributes the original sets, with the registered core as
       ``runner_core`` and no fused function (so ``run`` calls the core's ``run_from_dispatch``).
       Why: the original raises ``NotImplementedError("Unsupported runner backend")`` for any other backend.
       How: the original's attribute set (a test compares it with what the original sets for a built-in core).

    Upstream: SGLang 0.5.16+ (0.5.23 checked) has ``register_moe_runner_core``. Remove when: 0.5.15 is no longer
    a target (the H200 images move to torch 2.13).
    """
    return {"sglang.srt.layers.moe.utils.initialize_moe_config": around_initialize_moe_config,
            "sglang.srt.layers.moe.moe_runner.runner.MoeRunner.__init__": around_moe_runner_init}


_BACKEND_FIELDS = ("moe_runner_backend", "speculative_moe_runner_backend")


def around_initialize_moe_config(original, server_args, *args, **kwargs):
    ours = {f: getattr(server_args, f, None) for f in _BACKEND_FIELDS}
    ours = {f: v for f, v in ours.items() if v in _LEGACY_FACTORIES}
    if not ours:
        return original(server_args, *args, **kwargs)
    stand_in = copy.copy(server_args)
    for f in ours:
        setattr(stand_in, f, "auto")
    result = original(stand_in, *args, **kwargs)
    utils = importlib.import_module("sglang.srt.layers.moe.utils")
    if "moe_runner_backend" in ours:
        utils.MOE_RUNNER_BACKEND = LegacyRegisteredBackend(ours["moe_runner_backend"])
        if getattr(server_args, "speculative_moe_runner_backend", None) is None:
            utils.SPECULATIVE_MOE_RUNNER_BACKEND = utils.MOE_RUNNER_BACKEND
    if "speculative_moe_runner_backend" in ours:
        utils.SPECULATIVE_MOE_RUNNER_BACKEND = LegacyRegisteredBackend(ours["speculative_moe_runner_backend"])
    return result


def around_moe_runner_init(original, self, runner_backend, config, *args, **kwargs):
    factory = _LEGACY_FACTORIES.get(getattr(runner_backend, "value", None))
    if factory is None:
        return original(self, runner_backend, config, *args, **kwargs)
    lora = kwargs.get("lora_enabled", args[0] if args else False)
    if lora:
        from glm5_fp4.errors import Glm5Fp4Error

        raise Glm5Fp4Error(f"--moe-runner-backend {runner_backend.value} does not support MoE LoRA")
    self.runner_backend = runner_backend
    self.config = config
    self.lora_enabled = False
    self.fused_func = None
    self.runner_core = factory(config)
    self.down_gemm_overlap_args = None
    self.meta_overlap_args = None
    return None


class _LegacyDispatchMoeRunnerCore:
    """0.5.15 has no ``DispatchMoeRunnerCore``: its ``MoeRunner.run`` calls ``run_from_dispatch`` on any core
    that defines it. The same constructor as 0.5.23's base."""

    def __init__(self, config):
        self.config = config


def dispatch_runner_core_base() -> type:
    """The base class of a runner core that takes the standard dispatch output directly."""
    from sglang.srt.layers.moe.moe_runner import base

    return getattr(base, "DispatchMoeRunnerCore", _LegacyDispatchMoeRunnerCore)


# -- ModelOptNvFp4FusedMoEMethod.__init__ --------------------------------------------------------------------------

def nvfp4_moe_init_attributes(original_init: Callable, quant_config: Any) -> dict[str, Any]:
    """What ``ModelOptNvFp4FusedMoEMethod.__init__`` sets, for a runner that is no built-in one: no TRT-LLM
    weight layout, no LoRA-Marlin. Of the attributes some version sets, those this version's own ``__init__``
    assigns (read from its code object's names: 0.5.15 has no ``_lora_marlin`` /
    ``use_flashinfer_trtllm_weight_layout``)."""
    every = {"quant_config": quant_config, "_lora_marlin": False, "enable_flashinfer_trtllm_moe": False,
             "use_flashinfer_trtllm_weight_layout": False, "_cache_permute_indices": {}}
    names = set(getattr(getattr(original_init, "__code__", None), "co_names", ()))
    return {k: v for k, v in every.items() if k in names}


__all__ = ["KV_CACHE_DTYPES_0515", "LegacyRegisteredBackend", "MOE_RUNNER_BACKENDS_0515", "PRIMARY", "ServerFlags",
           "VEHICLE", "add_moe_runner_backend_choice", "dispatch_runner_core_base", "has_runner_core_registry",
           "installed_version", "legacy_hooks", "nvfp4_moe_init_attributes", "register_runner_core",
           "registered_backend", "running_version", "server_flags", "spelling"]
