"""Decode load tester for OpenAI-compatible servers (vLLM, SGLang, ours).

`run_loadtest(LoadTestConfig(...)) -> dict` is the Python entry point; `glm5-fp4 loadtest` and
`glm5-fp4 compare` are the command-line ones. Metric definitions follow `vllm bench serve`
(see metrics.py). Nothing heavy is imported here so `import glm5_fp4.loadtest` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LoadTestConfig", "run_loadtest"]


def __getattr__(name: str) -> Any:
    # Lazy re-exports: the runner pulls in aiohttp/numpy, which the CLI help path does not need.
    if name in ("LoadTestConfig", "run_loadtest"):
        from glm5_fp4.loadtest import runner

        return getattr(runner, name)
    raise AttributeError(name)
