"""The plugin against every SGLang version it targets: 0.5.23 (this venv's own) and 0.5.15 (the H200 test vehicle).

0.5.15 is its wheel's Python sources (with the transformers 5.12.1 / tokenizers 0.22.2 it pins), named by
GLM5_FP4_SGLANG0515_SRC (``make test`` unpacks them into .cache/), first on sys.path inside this venv (torch
2.14.1 here; 0.5.15 pins 2.11). Each version runs tests/sglang/versions_probe.py in its own interpreter: plugin
loading, ``--moe-runner-backend glm5_fp4`` resolved after publishing the parsed args, the runner core built by
``create_moe_runner``, the hooked ``apply`` against the float32 reference MoE, SGLang's own code for other
backends, the ``__init__`` stand-in's attributes, the all-to-all refusal, the choice lists, and every server
command the launch profiles generate for that version parsed by its ServerArgs. The differences it meets live in
glm5_fp4/engines/sglang/compat.py.

What 0.5.15's sources cannot import on this CPU machine (recorded by the probe, asserted below so a change shows):
``sglang.srt.models.glm4_moe`` / ``deepseek_v2`` (they reach ``import cutlass`` through the DSA indexer:
nvidia-cutlass-dsl has cp312 wheels only, this venv is Python 3.11) and the HTTP server (jsonschema, absent from
the slim venv for 0.5.23 too). Everything the plugin touches imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm5_fp4.engines.sglang import compat
from glm5_fp4.launch.commands import build_command
from glm5_fp4.launch.engine_choices import SGLANG_KV_CACHE_DTYPES, SGLANG_MOE_BACKENDS
from glm5_fp4.launch.profile import load_profile
from glm5_fp4.tolerances import moe_tolerance

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "sglang" / "versions_probe.py"
SRC_0515 = os.environ.get("GLM5_FP4_SGLANG0515_SRC")
VERSIONS = {"0.5.23": None, "0.5.15": SRC_0515}
PROFILES = sorted(p.name for p in (ROOT / "launch").glob("*.yaml") if p.name != "cpu-demo.yaml")


def profile_cases(version: str) -> dict[str, list[str]]:
    """Every launch profile as an SGLang command spelled for ``version`` (vLLM profiles via --engine sglang)."""
    return {name: list(build_command(load_profile(ROOT / "launch" / name, {"engine": "sglang"}),
                                     sglang_version=version).engine_args) for name in PROFILES}


def _h200_specs(tmp: Path) -> dict:
    """name -> spec of every server benchmarks/h200_sglang starts on the H200 (SGLang 0.5.15)."""
    os.environ["GLM5_FP4_TRACE_ROOT"] = str(tmp / "traces")
    sys.path.insert(0, str(ROOT / "benchmarks" / "h200_sglang"))
    try:
        import run_tiny
        import run_true_dims
    finally:
        sys.path.pop(0)
    specs = run_tiny.all_specs(Path("/m")) + run_true_dims.all_specs(Path("/m-true"), tmp / "work")
    return {f"h200:{s.name}": s for s in specs}


# The names SGLang gives the linears of a GLM-5 layer (merged gate_up_proj) -> whether routed-only leaves them BF16
ROUTED_ONLY_PREFIXES = {"model.layers.0.mlp.gate_up_proj": True, "model.layers.2.mlp.down_proj": True,
                        "model.layers.3.mlp.shared_experts.gate_up_proj": True,
                        "model.layers.4.mlp.shared_experts.down_proj": True, "model.layers.3.mlp.experts": False,
                        "model.layers.4.mlp.experts": False, "model.layers.3.self_attn.kv_b_proj": True,
                        "lm_head": True}


def _exclusion_case() -> dict:
    """A routed-only checkpoint's quantization config in both forms make-checkpoint writes, and the prefixes."""
    from glm5_fp4.checkpoint.configs import build_config
    from glm5_fp4.checkpoint.layout import exclude_modules

    ex = exclude_modules(build_config("glm5", {"num_hidden_layers": 5, "first_k_dense_replace": 3}), "routed-only")
    return {"flat": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ex},
            "nested": {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ex}},
            "prefixes": list(ROUTED_ONLY_PREFIXES)}


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, dict]:
    """Both versions at once (about 15 s each; the CI machine has two cores)."""
    from glm5_fp4.checkpoint.configs import build_config, dense_attention_view

    tmp = tmp_path_factory.mktemp("probe")
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dense_attention_view(build_config("glm5"))))
    exclusions = tmp / "exclusions.json"
    exclusions.write_text(json.dumps(_exclusion_case()))
    procs = {}
    for version, src in VERSIONS.items():
        if version != "0.5.23" and not src:
            continue
        cases = profile_cases(version)
        if version == compat.VEHICLE:
            cases.update({name: list(spec.command(30000).engine_args) for name, spec in _h200_specs(tmp).items()})
        (tmp / f"cases-{version}.json").write_text(json.dumps(cases))
        path = [p for p in (src, str(ROOT)) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "GLM5_FP4_PROBE_EXCLUSIONS": str(exclusions)}
        procs[version] = (subprocess.Popen([sys.executable, str(PROBE), str(model), str(tmp / f"cases-{version}.json")],
                                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), cases)
    out = {}
    for version, (proc, cases) in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"SGLang {version}:\n{stderr[-4000:]}"
        out[version] = json.loads(stdout.strip().splitlines()[-1]) | {"sent_cases": cases}
    return out


def _got(probes, version):
    if version not in probes:
        pytest.skip(f"set GLM5_FP4_SGLANG0515_SRC to unpacked sglang-{version} sources (make test does)")
    got = probes[version]
    assert got["version"] == version, got["sglang_file"]
    return got


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_routed_only_exclusions_read_by_sglang(probes, version):
    """SGLang's own ModelOpt config keeps a routed-only checkpoint's dense MLPs and shared experts unquantized."""
    got = _got(probes, version)
    assert "exclusions" not in got["errors"], got["errors"].get("exclusions")
    for form in ("flat", "nested"):
        assert got["exclusions"][form] == ROUTED_ONLY_PREFIXES, form


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_plugin_runs_under_sglang_version(probes, version):
    got = _got(probes, version)
    assert got["errors"] == {}, "\n\n".join(got["errors"].values())
    assert got["registry"] == (version == "0.5.23")
    target = "sglang.srt.layers.quantization.modelopt_quant.ModelOptNvFp4FusedMoEMethod"
    ours = {f"{target}.{m}" for m in ("__init__", "process_weights_after_loading", "apply")}
    legacy = set(compat.legacy_hooks())
    assert set(got["hooked"]) == (ours | legacy if version == compat.VEHICLE else ours)
    assert got["resolved"] == {"backend": "glm5_fp4", "speculative": "glm5_fp4", "type": (
        "LegacyRegisteredBackend" if version == compat.VEHICLE else "RegisteredMoeRunnerBackend")}
    runner = got["runner"]
    assert runner["is_ours"] and runner["backend_value"] == "glm5_fp4" and not runner["fused_func"]
    assert runner["attributes"] == got["builtin_runner_attributes"]  # the 0.5.15 stand-in sets what SGLang sets
    apply = got["apply"]
    assert apply["combine_type"] == "StandardCombineInput" and apply["shape"] == [24, 64]
    assert apply["equals_reference"] and apply["dropped_slots_equal_reference"] and apply["backend"] == "reference"
    assert apply["dequant_rel_error"] < moe_tolerance("w4a16")
    other = got["other_backend"]
    assert other["raised"] and other["sglang_apply_frame"] and not other["our_backend_called"]
    if version == "0.5.23":
        assert other["raised"] == "NotImplementedError"
    init = got["init"]
    assert init["equal"] and init["hooked_equals_original"] and "does not support NVFP4" in init["original_refuses_cpu"]
    assert ("_lora_marlin" in init["original"]) == (version == "0.5.23")
    assert "--moe-a2a-backend deepep: our runner reads the standard dispatch only" in got["a2a_refusal"]
    assert got["timer_targets"] == {"load_model": True, "forward": True}
    fields = got["protocol"]
    assert {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num"} <= \
        set(fields["GenerateReqInput"])
    assert {"num_steps", "activities", "output_dir"} <= set(fields["ProfileReq"])


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_choice_lists_equal_the_versions(probes, version):
    got = _got(probes, version)
    flags = compat.server_flags(version)
    assert set(got["choices"]["moe_runner_backend"]) == {*flags.moe_runner_backends, "glm5_fp4"}
    assert set(got["choices"]["kv_cache_dtype"]) == set(flags.kv_cache_dtypes)
    if version == "0.5.23":
        assert flags.moe_runner_backends == SGLANG_MOE_BACKENDS and flags.kv_cache_dtypes == SGLANG_KV_CACHE_DTYPES
    assert "modelopt_fp4" in got["choices"]["quantization"]
    assert ("--attn-dp-size" in got["options"]) == (version == "0.5.23")
    assert {"--dp-size", "--enable-dp-attention", "--grammar-backend", "--sampling-backend"} <= set(got["options"])


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_every_profile_command_parses(probes, version):
    got = _got(probes, version)
    for name in PROFILES:
        g = got["cases"][name]
        assert "error" not in g, (name, g, got["sent_cases"][name])
        profile = load_profile(ROOT / "launch" / name, {"engine": "sglang"})
        assert (g["tp_size"], g["pp_size"], g["moe_runner_backend"]) == (
            profile.stage_gpus, profile.pipeline_parallel, profile.moe_backend), name
        assert g["ep_size"] == (profile.ep_size if profile.expert_parallel else 1), name
        dp = profile.data_parallel
        if version == compat.VEHICLE:  # --dp-size N --enable-dp-attention
            assert (g["dp_size"], g["enable_dp_attention"]) == (dp, dp > 1), name
        else:  # 0.5.23: attention DP is attn_dp_size; dp_size stays whole-model replicas
            assert (g.get("attn_dp_size"), g["dp_size"]) == (dp, 1), name
        assert g["disable_shared_experts_fusion"] is True and g["quantization"] == "modelopt_fp4"
        assert g["max_running_requests"] == profile.max_concurrency


def test_h200_commands_parse_with_sglang_0515(probes, tmp_path):
    """Every server benchmarks/h200_sglang starts, through 0.5.15's own parser, with what the matrices asked."""
    got = _got(probes, compat.VEHICLE)
    specs = _h200_specs(tmp_path)
    assert len(specs) == 23 and set(specs) <= set(got["cases"])
    for name, spec in specs.items():
        g = got["cases"][name]
        assert "error" not in g, (name, g, got["sent_cases"][name])
        assert g["model_path"] == str(spec.model) and g["host"] == "127.0.0.1" and g["tp_size"] == 1
        assert g["moe_runner_backend"] == spec.moe_backend, name
        assert g["quantization"] == (None if spec.quantization == "none" else spec.quantization), name
        graphs = (g["cuda_graph_backend_decode"], g["cuda_graph_backend_prefill"])
        assert (graphs == ("disabled", "disabled")) == spec.eager, (name, graphs)
        # ours always; stock Marlin too (routed-only checkpoints: the shared expert is BF16); the BF16 twin fuses
        assert g["disable_shared_experts_fusion"] == (spec.quantization != "none"), name
        assert g["attention_backend"] == spec.attention_backend and g["sampling_backend"] == "pytorch", name
        assert g["grammar_backend"] == "none" and g["mem_fraction_static"] == spec.mem_fraction, name
        dsa = spec.attention_backend == "dsa"
        assert g["kv_cache_dtype"] == ("fp8_e4m3" if dsa else "auto"), name
        # DSA on SM90 without FlashAttention 3: FlashMLA both ways, no dense-MHA prefill (fleet.DSA_ARGS/DSA_ENV)
        assert (g["dsa_prefill_backend"], g["dsa_decode_backend"]) == (("flashmla_kv",) * 2 if dsa else (None, None))
        assert (spec.command(30000).env.get("SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD") == "0") == dsa, name
        if "-true" in str(spec.model) and not spec.eager:  # decode graphs at the load test's sizes only
            assert g["cuda_graph_bs_decode"] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], name
            assert g["cuda_graph_bs_prefill"] == [32, 128, 256, spec.context_length], name
        assert g["disable_radix_cache"] is True and g["max_running_requests"] == spec.max_running, name
        env = spec.command(30000).env
        assert (env.get("SGLANG_PLUGINS") == "none") == (not spec.plugin), name  # stock: nothing of ours loaded
        assert ("GLM5_FP4_BACKEND" in env) == (spec.moe_backend == "glm5_fp4"), name


def _layer_source(version: str) -> str:
    if version == "0.5.15":
        if not SRC_0515:
            pytest.skip("set GLM5_FP4_SGLANG0515_SRC to unpacked sglang-0.5.15 sources (make test does)")
        root = Path(SRC_0515) / "sglang"
    else:
        import importlib.util

        root = Path(importlib.util.find_spec("sglang").origin).parent
    return (root / "srt" / "layers" / "moe" / "fused_moe_triton" / "layer.py").read_text()


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_marlin_double_scaling_fact_matches_the_sources(version):
    """compat's record of stock Marlin NVFP4 scaling twice, against what each version's FusedMoE decides: 0.5.15
    folds the factor into the top-k weights for every ModelOpt NVFP4 layer (Marlin scales again); 0.5.23 leaves
    Marlin out (sgl-project/sglang#31762)."""
    src = _layer_source(version)
    excludes_marlin = "def _fuses_routed_scaling_factor_in_topk" in src and "runner_backend.is_marlin()" in src
    assert "should_fuse_routed_scaling_factor_in_topk" in src
    assert compat.stock_marlin_nvfp4_scales_twice(version) is (not excludes_marlin)


@pytest.mark.parametrize("version,want", [("0.5.15", True), ("0.5.15.post1", True), ("0.5.14", None),
                                          ("0.5.16rc1", None), ("0.5.23rc1", None), ("0.5.23", False),
                                          ("0.6.0", False), ("not-a-version", None)])
def test_marlin_double_scaling_claims_only_the_versions_checked(version, want):
    assert compat.stock_marlin_nvfp4_scales_twice(version) is want
