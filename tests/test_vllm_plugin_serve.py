"""The launcher without a vLLM server: the command it builds, pre-flight checks, the handle's failure path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from glm5_fp4.checkpoint.make import make_checkpoint
from glm5_fp4.cli import main as cli_main
from glm5_fp4.engines.vllm import compat, serve
from glm5_fp4.errors import Glm5Fp4Error


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_command_runs_the_api_server_module_with_our_options(tmp_path):
    spec = serve.build_launch(tmp_path, 8123, "reference", ["--max-model-len", "512"], env={}, mode="w4a4")
    argv = spec.argv
    assert argv[:3] == [sys.executable, "-m", compat.API_SERVER_MODULE]  # not the `vllm` console script
    assert _arg(argv, "--host") == "127.0.0.1" and _arg(argv, "--port") == "8123"
    assert _arg(argv, "--quantization") == "glm5_nvfp4"
    assert json.loads(_arg(argv, "--additional-config")) == {"glm5_fp4": {"backend": "reference", "mode": "w4a4"}}
    assert argv[-2:] == ["--max-model-len", "512"]
    assert spec.env_overrides["HF_HUB_OFFLINE"] == "1"  # a local directory: no hub lookups
    if compat.detect_install().is_cpu_build:
        assert spec.env_overrides["VLLM_TARGET_DEVICE"] == "cpu"
        assert spec.env_overrides["VLLM_CPU_KVCACHE_SPACE"] == serve.DEFAULT_CPU_KV_GIB
    assert "VLLM_PLUGINS" not in spec.env_overrides


def test_user_additional_config_is_merged_not_duplicated(tmp_path):
    extra = ["--additional-config", '{"other": 1, "glm5_fp4": {"mode": "w4a16"}}', "--enforce-eager"]
    argv = serve.build_launch(tmp_path, 8000, "dequant", extra, env={}).argv
    assert argv.count("--additional-config") == 1 and "--enforce-eager" in argv
    assert json.loads(_arg(argv, "--additional-config")) == {"other": 1,
                                                             "glm5_fp4": {"mode": "w4a16", "backend": "dequant"}}


def test_stock_runs_disable_every_plugin_and_an_allow_list_keeps_ours(tmp_path):
    stock = serve.build_launch(tmp_path, 8000, quantization="none", plugin=False, env={})
    assert stock.env_overrides["VLLM_PLUGINS"] == "" and "--quantization" not in stock.argv
    assert "--additional-config" not in stock.argv
    ours = serve.build_launch(tmp_path, 8000, env={"VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert ours.env_overrides["VLLM_PLUGINS"] == "lora_filesystem_resolver,glm5_fp4"
    sized = serve.build_launch(tmp_path, 8000, extra_args=["--kv-cache-memory-bytes=1000000"], env={})
    assert "VLLM_CPU_KVCACHE_SPACE" not in sized.env_overrides


@pytest.mark.parametrize("kwargs,needle", [
    ({"backend": "cutlass"}, "--backend 'cutlass'"),
    ({"quantization": "fp8"}, "--quantization 'fp8'"),
    ({"mode": "w8a8"}, "--mode 'w8a8'"),
    ({"plugin": False}, "needs the glm5_fp4 plugin"),
    ({"extra_args": ["--additional-config", "{oops"]}, "not valid JSON"),
])
def test_bad_launch_options_fail_before_anything_starts(tmp_path, kwargs, needle):
    with pytest.raises(Glm5Fp4Error, match=needle.replace("(", r"\(")):
        serve.build_launch(tmp_path, 8000, env={}, **kwargs)


def test_preflight_names_a_bf16_tensor_in_a_checkpoint_served_as_nvfp4(tmp_path):
    twin = make_checkpoint(tmp_path / "bf16", arch="glm4moe", dequantized=True, sizes={"num_hidden_layers": 2})
    with pytest.raises(Glm5Fp4Error, match="not an NVFP4 checkpoint"):
        serve.preflight(twin, "glm5_nvfp4")
    serve.preflight(twin, "none")  # fine when not asked to be NVFP4


def test_cli_dry_run_prints_the_exact_command(tmp_path, capsys):
    assert cli_main(["serve", "--model", str(tmp_path), "--backend", "reference", "--port", "8124", "--dry-run",
                     "--", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out.strip()
    assert compat.API_SERVER_MODULE in out and "--port 8124" in out and out.endswith("--max-model-len 256")
    assert "'{\"glm5_fp4\":{\"backend\":\"reference\"}}'" in out


def test_a_server_that_dies_reports_the_error_from_its_log(tmp_path):
    log = tmp_path / "server.log"
    code = ("import sys; print('INFO starting'); "
            "print('glm5_fp4.errors.Glm5Fp4Error: checkpoint tensor model.layers.1.mlp.experts.3.up_proj.weight "
            "is uint8 [48, 64], expected uint8 [64, 64]'); sys.exit(1)")
    spec = serve.LaunchSpec([sys.executable, "-c", code], {}, "127.0.0.1", 1)
    import subprocess

    with log.open("wb") as f:
        proc = subprocess.Popen(spec.argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    handle = serve.ServerHandle(proc, spec, log)
    with pytest.raises(Glm5Fp4Error, match=r"exited with code 1 before becoming healthy: checkpoint tensor "
                                           r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight is uint8 \[48, 64\]"):
        handle.wait_healthy(timeout=30)


def test_stop_ends_the_whole_process_group(tmp_path):
    import subprocess
    import time

    # A parent that spawns a child, as vLLM's API server spawns its engine core.
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); " \
           "print('child started', flush=True); time.sleep(300)"
    log = tmp_path / "s.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    handle = serve.ServerHandle(proc, serve.LaunchSpec([], {}, "127.0.0.1", 1), Path(log))
    deadline = time.monotonic() + 20
    while "child started" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    with handle:
        pass  # __exit__ stops it
    assert proc.poll() is not None

    def live_members() -> list[str]:  # zombies awaiting their reaper count as gone
        out = subprocess.run(["ps", "-o", "pid=,stat=", "-s", str(proc.pid)], capture_output=True, text=True).stdout
        return [line for line in out.splitlines() if line.split() and not line.split()[1].startswith("Z")]

    deadline = time.monotonic() + 10
    while live_members() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_members() == []
