"""glm5-fp4 inside vLLM: the `glm5_nvfp4` quantization config, its MoE method and CPU NVFP4 linear
kernel, the plugin options, the vLLM 0.32 (CPU) / 0.33 (GPU) compatibility shim and the server launcher.

`serve`, `settings` and `compat` import neither vLLM nor torch (the launcher runs before either is needed);
the rest imports vLLM.
"""
