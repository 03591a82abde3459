"""SGLang entry point (group ``sglang.srt.plugins``, name ``glm5_fp4``): ``--moe-runner-backend glm5_fp4``.

SGLang calls :func:`register` through ``load_plugins()`` in the launcher, the tokenizer/detokenizer and every
scheduler (TP/PP rank) process, once per process; subprocesses are spawned, so registration must happen here
and not in the launcher. It is idempotent, imports SGLang only inside the call, never touches CUDA, and
turns a failure into one logged error (SGLang logs and continues, so the server would otherwise start with
the name missing and fail later with a less clear argparse error).

What it registers (details and the What/Why/How/Upstream/Remove-when of each hook in
``glm5_fp4/engines/sglang/hooks.py``):

* the name ``glm5_fp4`` in SGLang's public ``--moe-runner-backend`` choice list;
* a MoE runner core for that name (:class:`glm5_fp4.engines.sglang.runner.Glm5Fp4RunnerCore`);
* AROUND hooks on ``ModelOptNvFp4FusedMoEMethod.__init__``, ``.process_weights_after_loading`` and
  ``.apply`` that route ModelOpt NVFP4 experts to a glm5-fp4 backend when the runner is ``glm5_fp4`` and
  call SGLang's own code for every other backend.

* with ``GLM5_FP4_HOST_SAMPLES=DIR``, the host sampler in every process (:mod:`glm5_fp4.profiling.host_sampler`).

Backend choice: ``GLM5_FP4_BACKEND`` (auto | triton | dequant | reference) and ``GLM5_FP4_MODE``
(auto | w4a16 | w4a4), as for vLLM.
"""

from __future__ import annotations

import logging

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True  # set first: a failing registration is reported once, not retried
    try:
        from glm5_fp4.engines.sglang.registration import register_all

        register_all()
    except Exception:  # noqa: BLE001 - one clear line instead of a half-registered backend
        logging.getLogger("sglang.glm5_fp4").exception(
            "glm5_fp4: SGLang plugin registration failed; --moe-runner-backend glm5_fp4 is unavailable")
