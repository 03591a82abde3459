"""W4A4 emulation and the reference backend in a real vLLM server, with torch.compile on.

GLM-4.5's architecture is compiled by vLLM on CPU (Dynamo, DYNAMO_TRACE_ONCE); our MoE runs behind the
opaque ``glm5_fp4_vllm::moe_routed`` op there, so this also checks that the traced model serves. Numerics
of W4A4 emulation are checked at layer level against the reference MoE (tests/test_vllm_plugin_moe.py);
here: it serves, it is the requested backend and mode, and activation quantization changes the output.
"""

from __future__ import annotations

import pytest
from openai import OpenAI
from vllm_servers import PROMPTS, greedy, stock_greedy

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def w4a4_server(pool, checkpoints):
    stock_greedy(pool, checkpoints, "glm4moe")  # the W4A16 reference, collected first (one server at a time)
    return pool.get("glm4moe-reference-w4a4-compiled", checkpoints["glm4moe"], eager=False,
                    quantization="glm5_nvfp4", backend="reference", mode="w4a4")


def test_w4a4_reference_backend_serves_compiled(w4a4_server):
    log = w4a4_server.log_path.read_text(errors="replace")
    assert "glm5_fp4: NVFP4 MoE layers run on backend reference in w4a4 mode" in log
    assert "DYNAMO_TRACE_ONCE" in log and "enforce_eager=False" in log
    client = OpenAI(base_url=w4a4_server.api_url, api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    chunks = [c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if c.choices]
    assert len(chunks) > 5 and "".join(chunks)


def test_activation_quantization_changes_greedy_output(w4a4_server, pool, checkpoints):
    a4 = [ids for _, ids in greedy(w4a4_server)]
    a16 = [ids for _, ids in stock_greedy(pool, checkpoints, "glm4moe")]  # == the plugin in W4A16 mode
    assert any(x != y for x, y in zip(a4, a16))
