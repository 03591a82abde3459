"""The vLLM entry point: lazy, idempotent, no CUDA, failures logged instead of raised.

Run in fresh interpreters: whether vLLM/torch are imported and what vLLM's registries hold is process state.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, timeout: int = 240) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_entry_point_imports_neither_vllm_nor_torch():
    out = _run("""
        import json, sys
        import glm5_fp4.engines.vllm_plugin
        print(json.dumps({m: m in sys.modules for m in ("vllm", "torch")}))
    """)
    assert out == {"vllm": False, "torch": False}


def test_register_is_idempotent_and_never_initialises_cuda():
    out = _run("""
        import json, torch
        def no_cuda(*a, **k):
            raise AssertionError("CUDA initialised during plugin registration")
        torch.cuda._lazy_init = no_cuda
        torch.cuda.init = no_cuda

        from vllm.plugins import load_general_plugins
        load_general_plugins()                       # vLLM's own entry-point loader
        from glm5_fp4.engines import vllm_plugin
        vllm_plugin.register(); vllm_plugin.register()
        vllm_plugin._registered = False              # a second import path / reload: registries must not grow
        vllm_plugin.register()

        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
        from vllm.model_executor.kernels.linear import _POSSIBLE_NVFP4_KERNELS
        from vllm.platforms import PlatformEnum
        from glm5_fp4.engines.vllm.config import Glm5NvFp4Config
        from glm5_fp4.engines.vllm.linear import Glm5CpuNvFp4LinearKernel
        print(json.dumps({
            "names": QUANTIZATION_METHODS.count("glm5_nvfp4"),
            "config_is_ours": get_quantization_config("glm5_nvfp4") is Glm5NvFp4Config,
            "cpu_kernels": _POSSIBLE_NVFP4_KERNELS[PlatformEnum.CPU].count(Glm5CpuNvFp4LinearKernel),
            "cuda_initialised": torch.cuda.is_initialized(),
        }))
    """)
    assert out == {"names": 1, "config_is_ours": True, "cpu_kernels": 1, "cuda_initialised": False}


def test_a_failing_registration_is_logged_not_raised(monkeypatch):
    import logging

    from glm5_fp4.engines import vllm_plugin

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # attached directly: vLLM's "vllm" logger may not propagate to pytest's

    def boom():
        raise RuntimeError("simulated vLLM API change")

    monkeypatch.setattr(vllm_plugin, "_registered", False)
    monkeypatch.setattr(vllm_plugin, "_register", boom)
    logger = logging.getLogger("vllm.glm5_fp4")
    logger.addHandler(handler)
    try:
        vllm_plugin.register()  # must not raise: vLLM would die in every process
        vllm_plugin.register()
    finally:
        logger.removeHandler(handler)
    errors = [r for r in records if "registration failed" in r.getMessage()]
    assert len(errors) == 1 and "simulated vLLM API change" in str(errors[0].exc_info[1])


@pytest.mark.parametrize("module", ["glm5_fp4.serve_cli", "glm5_fp4.engines.vllm.serve",
                                    "glm5_fp4.engines.vllm.compat"])
def test_launcher_modules_do_not_import_vllm_or_torch(module):
    out = _run(f"""
        import json, sys
        import {module}
        print(json.dumps({{m: m in sys.modules for m in ("vllm", "torch")}}))
    """)
    assert out == {"vllm": False, "torch": False}


def test_a_broken_profiling_extra_or_environment_keeps_the_quantization_registered(tmp_path):
    """An unusable GLM5_FP4_HOST_SAMPLES folder made the registration fail before --quantization glm5_nvfp4 was
    registered (2026-12-07): the quantization comes first, each extra fails on its own with its name, and a bad
    GLM5_FP4_* value is logged by name at registration (the MoE layer's construction raises it)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = _run(f"""
        import json, logging, os
        os.environ["GLM5_FP4_HOST_SAMPLES"] = {str(blocker / "sub")!r}  # a folder under a file: cannot be made
        os.environ["GLM5_FP4_WARMUP"] = "perhaps"
        records = []
        h = logging.Handler(); h.emit = records.append
        logging.getLogger("vllm.glm5_fp4").addHandler(h)
        from glm5_fp4.engines import vllm_plugin
        vllm_plugin.register()
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
        msgs = [r.getMessage() for r in records]
        print(json.dumps({{"registered": "glm5_nvfp4" in QUANTIZATION_METHODS,
                          "sampler": any("host sampler" in m and "GLM5_FP4_HOST_SAMPLES" in m for m in msgs),
                          "env": any("GLM5_FP4_WARMUP='perhaps'" in m for m in msgs),
                          "failed": any("registration failed" in m for m in msgs)}}))
    """)
    assert out == {"registered": True, "sampler": True, "env": True, "failed": False}
