"""Hooks on SGLang's ``ModelOptNvFp4FusedMoEMethod`` (``srt/layers/quantization/modelopt_quant.py``; 0.5.23 and
0.5.15, differences in :mod:`glm5_fp4.engines.sglang.compat`).

Each is an AROUND hook registered with ``HookRegistry`` (SGLang's own plugin mechanism, applied by
``load_plugins()`` in every process): it calls the original unchanged unless the layer's MoE runner backend is
``glm5_fp4``. The original stays reachable as ``<method>.__wrapped__``.

1. ``__init__``
   What: when the backend is ``glm5_fp4`` and the original refuses the platform, set the attributes the
   original sets, without its platform check.
   Why: the original raises "Current platform does not support NVFP4" unless the GPU is Blackwell or the runner
   is Marlin; our backend also runs W4A16 on Hopper/Ada (Triton, SM89+) and on CPU tensors (reference, dequant).
   How: call the original; only on that ValueError, set what this version's original sets
   (:func:`glm5_fp4.engines.sglang.compat.nvfp4_moe_init_attributes`: ``quant_config``, ``_lora_marlin``,
   ``enable_flashinfer_trtllm_moe``, ``use_flashinfer_trtllm_weight_layout``, ``_cache_permute_indices`` on
   0.5.23; a test compares it with what the original sets on a Blackwell-like platform, for both versions).
   Upstream: none filed; the check predates registered runner backends (sgl-project/sglang 0.5.23).
   Remove when: the check asks the registered runner whether it supports the platform.

2. ``process_weights_after_loading``
   What: for ``glm5_fp4``, lets :func:`glm5_fp4.backends.choose` pick our backend and mode (``GLM5_FP4_BACKEND``,
   ``GLM5_FP4_MODE``), hands the raw ModelOpt tensors to :func:`glm5_fp4.backends.prepare_layer` (which also
   frees the checkpoint-layout copies the backend no longer reads), and stores a ``Glm5Fp4QuantInfo`` on the
   layer.
   Why: for an unknown backend the original falls into its generic CUTLASS branch, which swizzles the block
   scales *in place of* ``w13_weight_scale``/``w2_weight_scale`` and computes alphas we do not use; our
   backends want the linear ModelOpt layout (``[gate; up]`` rows, linear E4M3 scales) and their own repacking.
   How: skip the original entirely for ``glm5_fp4``.
   Upstream: SGLang has no per-runner weight-processing hook for registered runner cores (0.5.23).
   Remove when: ``register_moe_runner_core`` gains a weight-processing callback.

3. ``apply``
   What: for ``glm5_fp4``, ``return self.runner.run(dispatch_output, layer._glm5_fp4)``.
   Why: the original ends in ``raise NotImplementedError("Unsupported moe_runner_backend for NVFP4 MoE")``
   for any backend it does not list, even though ``create_moe_runner`` built our registered core.
   How: hand the dispatch output and our quant info to the runner SGLang built (``MoeRunner`` dispatches to
   ``Glm5Fp4RunnerCore.run_from_dispatch``).
   Upstream: none filed (0.5.23).
   Remove when: ``apply`` defers unknown registered backends to ``self.runner.run`` with a quant-info factory.
"""

from __future__ import annotations

import logging

import torch

from glm5_fp4 import backends, settings
from glm5_fp4.engines.sglang import NAME, compat
from glm5_fp4.engines.sglang.runner import Glm5Fp4QuantInfo, make_skip_map
from glm5_fp4.errors import Glm5Fp4Error

logger = logging.getLogger("sglang.glm5_fp4")
TARGET = "sglang.srt.layers.quantization.modelopt_quant.ModelOptNvFp4FusedMoEMethod"
PLATFORM_REFUSAL = "does not support NVFP4"
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def _backend_name(backend) -> str | None:
    return getattr(backend, "value", backend)


def _global_backend_is_ours() -> bool:
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    return _backend_name(get_moe_runner_backend()) == NAME


def _method_is_ours(method) -> bool:
    # create_moe_runner caches the layer's backend; the global one differs under speculative decoding.
    backend = getattr(method, "_moe_runner_backend", None)
    return _backend_name(backend) == NAME if backend is not None else _global_backend_is_ours()


# -- 1. __init__ --------------------------------------------------------------------------------------

def init_without_platform_check(method, quant_config, original=None) -> None:
    """What the original ``__init__`` sets, for a ``glm5_fp4`` runner (no trtllm layout, no LoRA-Marlin)."""
    init = original or getattr(type(method).__init__, "__wrapped__", type(method).__init__)
    for name, value in compat.nvfp4_moe_init_attributes(init, quant_config).items():
        setattr(method, name, value)


def around_init(original, self, quant_config, *args, **kwargs):
    if not _global_backend_is_ours():
        return original(self, quant_config, *args, **kwargs)
    # GLM5_FP4_BACKEND / _MODE (and every GLM5_FP4_* value) read before any weight is: process_for_glm5 reads
    # them again only after the whole checkpoint has loaded
    settings.from_sources(None)
    try:
        return original(self, quant_config, *args, **kwargs)
    except ValueError as exc:
        if PLATFORM_REFUSAL not in str(exc):
            raise
        init_without_platform_check(self, quant_config, original)
        return None


# -- 2. process_weights_after_loading ---------------------------------------------------------------------

def _where(cfg) -> str:
    return f"layer {cfg.layer_id} experts" if cfg.layer_id is not None else "experts"


def _max_tokens() -> int:
    """The largest token count one forward can carry (buffers are reserved for it before graph capture).

    These are the operator's inputs, which already bound the tokens data-parallel attention gathers into one MoE
    call: SGLang divides ``--chunked-prefill-size`` by ``--attn-dp-size`` per rank only when it resolves it, and
    ``--max-running-requests`` is the total over the ranks."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # noqa: BLE001 - no server context (tests, offline use)
        return settings.reserve_tokens()
    return settings.reserve_tokens(*(getattr(args, n, None) for n in (
        "chunked_prefill_size", "max_prefill_tokens", "cuda_graph_max_bs_decode", "max_running_requests")))


def _refusal() -> str:
    """Why SGLang's configuration rules our runner out ('' if it does not): any all-to-all backend but ``none``
    hands the runner a dispatch format it does not read (DeepEP, Mooncake, ...)."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    a2a = get_moe_a2a_backend()
    if a2a.is_none():
        return ""
    return (f"--moe-a2a-backend {a2a.value}: our runner reads the standard dispatch only (--moe-a2a-backend none: "
            "tokens gathered, partial sums reduced by SGLang)")


def choose(method, layer, plugin: settings.PluginSettings, device: torch.device | None = None,
           capability=None) -> backends.Selection:
    """Backend and mode for this layer; device and capability default to where the layer's weights are."""
    cfg = getattr(method, "moe_runner_config", None) or layer.moe_runner_config
    n_local, two_i, h_half = layer.w13_weight.shape
    shape = backends.MoEShape(num_experts=n_local, hidden_size=h_half * 2, intermediate_size=two_i // 2,
                              top_k=cfg.top_k or 0, activation=cfg.activation, gated=cfg.is_gated,
                              expert_parallel=(getattr(layer, "moe_ep_size", 1) or 1) > 1)
    has_scales = not getattr(method.quant_config, "is_w4a16", False)
    return backends.choose(plugin, device or layer.w13_weight.device, shape, _dtype(cfg, layer), has_scales,
                           capability, _refusal(), where=_where(cfg))


def _dtype(cfg, layer) -> torch.dtype:
    return cfg.params_dtype or getattr(layer, "params_dtype", None) or torch.bfloat16


def process_for_glm5(method, layer) -> Glm5Fp4QuantInfo:
    """Our replacement for the original ``process_weights_after_loading`` (see the module docstring)."""
    cfg = getattr(method, "moe_runner_config", None) or layer.moe_runner_config
    where = _where(cfg)
    num_local = layer.w13_weight.shape[0]
    plugin = settings.from_sources(None)  # SGLang has no plugin config: GLM5_FP4_BACKEND, GLM5_FP4_MODE
    selection = choose(method, layer, plugin)
    if selection.backend is None:
        raise Glm5Fp4Error(f"--moe-runner-backend {NAME}: no glm5-fp4 backend can serve {where} "
                           f"({plugin.describe()}): {selection.reason}")
    # every call passes the skip map (runner.run_from_dispatch), so the kernels are compiled under one
    skip = make_skip_map(num_local, layer.w13_weight.device)
    prepared = backends.prepare_layer(selection, layer, _dtype(cfg, layer), cfg.top_k or 1, _max_tokens(), where,
                                      warn=_warn_once, expert_map=skip)
    # create_weights already made swizzled copies of the block scales for the CUTLASS branch; we never read them.
    layer.w13_blockscale_swizzled = None
    layer.w2_blockscale_swizzled = None
    info = Glm5Fp4QuantInfo(selection.backend, prepared, selection.mode, where, num_local, skip)
    layer._glm5_fp4 = info
    ep = getattr(layer, "moe_ep_size", 1) or 1
    logger.info("glm5_fp4: %s run on backend %s in %s mode (%s)%s", where, selection.backend.name, selection.mode,
                plugin.describe(), f"; expert parallel: {num_local} local experts (EP{ep})" if ep > 1 else "")
    return info


def around_process_weights_after_loading(original, self, layer, *args, **kwargs):
    if not _method_is_ours(self):
        return original(self, layer, *args, **kwargs)
    process_for_glm5(self, layer)
    return None


# -- 3. apply -------------------------------------------------------------------------------------------

def around_apply(original, self, layer, dispatch_output, *args, **kwargs):
    if not _method_is_ours(self):
        return original(self, layer, dispatch_output, *args, **kwargs)
    info = getattr(layer, "_glm5_fp4", None)
    if info is None:
        raise Glm5Fp4Error(f"--moe-runner-backend {NAME}: apply() before process_weights_after_loading() "
                           "prepared this layer")
    return self.runner.run(dispatch_output, info)


HOOKS = {
    "__init__": around_init,
    "process_weights_after_loading": around_process_weights_after_loading,
    "apply": around_apply,
}

__all__ = ["HOOKS", "TARGET", "choose", "process_for_glm5"]
