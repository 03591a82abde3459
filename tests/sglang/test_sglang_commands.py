"""Every SGLang command a profile produces parses with SGLang 0.5.23's own ServerArgs, with the right values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm5_fp4.launch.commands import build_command
from glm5_fp4.launch.engine_choices import SGLANG_KV_CACHE_DTYPES, SGLANG_MOE_BACKENDS
from glm5_fp4.launch.profile import load_profile, profile_from_dict

LAUNCH = Path(__file__).resolve().parents[2] / "launch"


@pytest.mark.parametrize("name,tp,pp", [("tp8-sglang.yaml", 8, 1), ("tp4pp2-sglang.yaml", 4, 2),
                                        ("tp8.yaml", 8, 1), ("tp4pp2.yaml", 4, 2)])
def test_profiles_parse_with_server_args(parse_server_args, name, tp, pp):
    cmd = build_command(load_profile(LAUNCH / name, {"engine": "sglang"}))
    sa = parse_server_args(list(cmd.engine_args))
    assert (sa.tp_size, sa.pp_size) == (tp, pp)
    assert sa.model_path == "nvidia/GLM-5-NVFP4"
    assert sa.moe_runner_backend == "glm5_fp4" and sa.disable_shared_experts_fusion is True
    assert sa.quantization == "modelopt_fp4" and sa.kv_cache_dtype == "auto"
    assert sa.max_running_requests == 512 and sa.cuda_graph_max_bs_decode == 512
    assert (sa.host, sa.port) == ("127.0.0.1", 30000)


# profile -> (tp_size, attn_dp_size, ep_size, enable_dp_lm_head, moe_dense_tp_size, graph batch per DP rank)
PARALLEL_PROFILES = {
    "dp8ep8-sglang.yaml": (8, 8, 8, True, 1, 64),
    "dp8ep8.yaml": (8, 8, 8, True, 1, 64),
    "tp8ep8-sglang.yaml": (8, 1, 8, False, None, 512),
    "tp8ep8.yaml": (8, 1, 8, False, None, 512),
}


@pytest.mark.parametrize("name", sorted(PARALLEL_PROFILES))
def test_expert_parallel_profiles_parse_with_server_args(parse_server_args, name):
    cmd = build_command(load_profile(LAUNCH / name, {"engine": "sglang"}))
    sa = parse_server_args(list(cmd.engine_args))
    got = (sa.tp_size, sa.attn_dp_size, sa.ep_size, sa.enable_dp_lm_head, sa.moe_dense_tp_size,
           sa.cuda_graph_max_bs_decode)
    assert got == PARALLEL_PROFILES[name]
    assert sa.dp_size == 1 and sa.pp_size == 1  # attention DP inside one 8-GPU group, not 8 replicas of 8 GPUs
    assert sa.moe_a2a_backend == "none"  # the standard dispatch our runner reads
    assert sa.moe_runner_backend == "glm5_fp4" and sa.disable_shared_experts_fusion is True
    assert sa.max_running_requests == 512 and sa.quantization == "modelopt_fp4"


def test_deprecated_dp_attention_spelling_is_refused_in_extra_args():
    from glm5_fp4.errors import Glm5Fp4Error

    p = profile_from_dict({"model": "/m", "engine": "sglang", "extra_args": ["--enable-dp-attention"]})
    with pytest.raises(Glm5Fp4Error, match="data_parallel"):
        build_command(p)


@pytest.mark.parametrize("mode,decode,prefill,max_bs", [("full", "full", "breakable", 64),
                                                        ("piecewise", "breakable", "breakable", 64),
                                                        ("off", "disabled", "disabled", None)])
def test_cuda_graph_modes(parse_server_args, mode, decode, prefill, max_bs):
    p = profile_from_dict({"model": "/m", "engine": "sglang", "cuda_graphs": mode, "max_concurrency": 64})
    sa = parse_server_args(list(build_command(p).engine_args))
    assert (sa.cuda_graph_backend_decode, sa.cuda_graph_backend_prefill) == (decode, prefill)
    assert sa.cuda_graph_max_bs_decode == max_bs and sa.max_running_requests == 64


def test_every_stock_backend_and_kv_dtype_parses(parse_server_args):
    for backend in SGLANG_MOE_BACKENDS:
        p = profile_from_dict({"model": "/m", "engine": "sglang", "moe_backend": backend})
        sa = parse_server_args(list(build_command(p).engine_args))
        assert sa.moe_runner_backend == backend and not sa.disable_shared_experts_fusion
    for kv in SGLANG_KV_CACHE_DTYPES:
        p = profile_from_dict({"model": "/m", "engine": "sglang", "kv_cache_dtype": kv})
        assert parse_server_args(list(build_command(p).engine_args)).kv_cache_dtype == kv


def test_choice_lists_equal_sglangs(sglang_plugins):
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    choices = {a.dest: a.choices for a in parser._actions}
    assert set(choices["moe_runner_backend"]) == {*SGLANG_MOE_BACKENDS, "glm5_fp4"}
    assert set(choices["kv_cache_dtype"]) == set(SGLANG_KV_CACHE_DTYPES)
    assert "modelopt_fp4" in choices["quantization"]


def test_extra_args_parse(parse_server_args):
    p = profile_from_dict({"model": "/m", "engine": "sglang", "extra_args": ["--random-seed", 3, "--mem-fraction-static",
                                                                            "0.85"]})
    sa = parse_server_args(list(build_command(p).engine_args))
    assert (sa.random_seed, sa.mem_fraction_static) == (3, 0.85)


def test_without_the_plugin_glm5_fp4_is_rejected():
    """The name parses only because our plugin registers it (a fresh process with plugins limited to none)."""
    code = ("from sglang.srt.plugins import load_plugins; load_plugins()\n"
            "from sglang.srt.server_args import prepare_server_args\n"
            "prepare_server_args(['--model-path', '/m', '--moe-runner-backend', 'glm5_fp4'])\n")
    env = {**os.environ, "SGLANG_PLUGINS": "no_such_plugin", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "glm5_fp4" in proc.stderr and "invalid choice" in proc.stderr
