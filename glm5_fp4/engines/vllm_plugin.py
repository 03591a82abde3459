"""vLLM entry point (group ``vllm.general_plugins``, name ``glm5_fp4``): registers ``--quantization glm5_nvfp4``.

vLLM calls :func:`register` in every process it starts (API server, engine core, each worker), possibly
more than once per process, and does not catch exceptions it raises. So it is idempotent, imports vLLM
only inside the call, never touches CUDA, and turns a failure into one logged error instead of taking
down a server that was not even asked to use glm5-fp4.

What it registers:

* quantization config ``glm5_nvfp4`` (:class:`glm5_fp4.engines.vllm.config.Glm5NvFp4Config`);
* on the CPU platform, an NVFP4 linear kernel in vLLM's kernel registry (vLLM's CPU build has none).
* with ``GLM5_FP4_LAYER_TIMERS=1``, per-layer timers on the model each worker loads
  (:mod:`glm5_fp4.engines.layer_timers`; works with any ``--quantization``).
* with ``GLM5_FP4_HOST_SAMPLES=DIR``, the host sampler in every process (:mod:`glm5_fp4.profiling.host_sampler`;
  any ``--quantization`` too).

Backend choice: ``--additional-config '{"glm5_fp4": {"backend": "triton|dequant|reference|auto",
"mode": "auto|w4a16|w4a4"}}'`` or ``GLM5_FP4_BACKEND`` / ``GLM5_FP4_MODE`` (see ``settings``).
"""

from __future__ import annotations

import logging

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True  # set first: a failing registration is reported once, not retried per call
    try:
        _register()
    except Exception:  # noqa: BLE001 - vLLM does not catch plugin errors; one clear line instead of a dead server
        logging.getLogger("vllm.glm5_fp4").exception(
            "glm5_fp4: vLLM plugin registration failed; --quantization glm5_nvfp4 is unavailable")


def _register() -> None:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
    from vllm.platforms import current_platform

    from glm5_fp4.engines.logs import route_to
    from glm5_fp4.engines.vllm.config import NAME, Glm5NvFp4Config

    route_to("vllm.glm5_fp4")
    if NAME not in QUANTIZATION_METHODS:
        register_quantization_config(NAME)(Glm5NvFp4Config)
    if current_platform.is_cpu():
        from glm5_fp4.engines.vllm.linear import register_cpu_kernel

        register_cpu_kernel()
    log = logging.getLogger("vllm.glm5_fp4")
    from glm5_fp4 import envvars

    envvars.report(log)
    # The profiling extras last and each on its own: a bad GLM5_FP4_HOST_SAMPLES folder once took
    # --quantization glm5_nvfp4 away with it.
    from glm5_fp4.engines.layer_timers import install_vllm
    from glm5_fp4.profiling.host_sampler import start_from_env

    for what, start in (("the host sampler (GLM5_FP4_HOST_SAMPLES)", start_from_env),
                        ("the layer timers (GLM5_FP4_LAYER_TIMERS)", install_vllm)):
        try:
            start()
        except Exception:  # noqa: BLE001 - the quantization stays registered; the extra is named
            log.exception("glm5_fp4: %s did not start; --quantization glm5_nvfp4 is registered without it", what)
