"""Engine adapters: vLLM (`vllm_plugin`, `vllm/`) and SGLang (`sglang_plugin`).

Engines load these modules in every process they start, so nothing here imports an engine, torch or
CUDA at import time; each adapter imports its engine inside the function the engine calls.
"""
