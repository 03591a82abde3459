"""Fixtures for the `server`-marked tests: tiny checkpoints and the session's vLLM server pool (vllm_servers.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from vllm_servers import ServerPool

from glm5_fp4.checkpoint.make import make_checkpoint


@pytest.fixture(scope="session")
def pool(tmp_path_factory):
    p = ServerPool(tmp_path_factory.mktemp("vllm-servers"))
    yield p
    p.stop_active()
    out = os.environ.get("GLM5_FP4_SERVER_TIMINGS")
    if out:
        Path(out).write_text(json.dumps(p.timings, indent=1))
    print("\nvLLM server timings (s):", json.dumps(p.timings, indent=1))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny NVFP4 checkpoints (GLM-5 dense-attention view, GLM-4.5 MoE) and their dequantized BF16 twins."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    out = {}
    for arch, dense in (("glm5", True), ("glm4moe", False)):
        out[arch] = make_checkpoint(root / arch, arch=arch, dense_attention=dense)
        out[f"{arch}-bf16"] = make_checkpoint(root / f"{arch}-bf16", arch=arch, dense_attention=dense,
                                              dequantized=True)
    return out
