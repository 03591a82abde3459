"""GPU gate for the load-time warm-up (glm5_fp4.kernels.warmup): after it, no batch size up to the engine's
largest compiles a kernel at serving time. The CPU test (tests/test_kernels_warmup.py) checks the claim on the
launch signatures the warm-up derives; this one counts what Triton actually compiles on the device, so a
specialisation the signature misses (an argument Triton keys on that ``signature`` ignores) fails here.

Run in a process of its own (a kernel some earlier test compiled would hide a missed one):

    python -m pytest tests/gpu/test_warmup_gpu.py -q
"""

from __future__ import annotations

import random

import pytest
import torch

from glm5_fp4.bench.routing import make_routing
from glm5_fp4.kernels import fused_moe, prepare_experts
from glm5_fp4.kernels import warmup as W
from glm5_fp4.kernels.slow_calls import compiled_kernels
from glm5_fp4.reference import NvFp4Experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# GLM-5's TP8 shard; H and I are constexprs of the kernels, so no other GPU test's compile of these shapes
# can stand in for the warm-up's when this file runs alone.
E, H, I, K = 256, 6144, 256, 8
MAX_TOKENS = 600  # past the slot -> grouped switch and several align-block sizes, yet a short warm-up


def _compiled() -> int:
    """Kernels compiled so far in this process, over every Triton kernel of the MoE (in-memory caches)."""
    import triton

    from glm5_fp4.kernels import triton_moe

    jit = [o for o in vars(triton_moe).values() if isinstance(o, triton.runtime.jit.JITFunction)]
    assert jit and all(getattr(o, "device_caches", None) is not None for o in jit), \
        "this Triton keeps no device_caches: the test cannot count compiles"
    return sum(compiled_kernels().values())


@pytest.fixture(scope="module")
def prepared():
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=g) / I**0.5
    return prepare_experts(NvFp4Experts.from_float(w13, w2))


@pytest.mark.parametrize("map_size", [None, E + 1])  # vLLM without EP / SGLang's skip map on every call
def test_no_compile_after_warm_up(prepared, map_size, monkeypatch):
    monkeypatch.setattr(W, "_DONE", set())
    emap = None
    if map_size is not None:
        emap = torch.cat([torch.arange(E, dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)]).cuda()
    before = _compiled()
    counts = W.warm_up(prepared, "w4a16", K, MAX_TOKENS, torch.bfloat16, expert_map=emap)
    warmed = _compiled()
    assert counts and warmed > before, (counts, before, warmed)
    rng = random.Random(1)
    sizes = sorted({1, 2, 3, 16, 17, MAX_TOKENS - 1, MAX_TOKENS, *rng.sample(range(1, MAX_TOKENS + 1), 40)})
    for t in sizes:
        for routing in ("balanced", "same_k", "zipf1.2"):
            x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
            w, ids = make_routing(routing, t, E, K, device="cuda")
            out = torch.full_like(x, float("nan"))
            fused_moe(x, w, ids, prepared, mode="w4a16", out=out, expert_map=emap)
            assert torch.isfinite(out).all(), (t, routing)
            assert _compiled() == warmed, f"T={t} ({routing}) compiled a kernel the warm-up did not"
    torch.cuda.synchronize()
