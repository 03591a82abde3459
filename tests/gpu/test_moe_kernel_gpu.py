"""GPU gate for the fused NVFP4 MoE kernel: accuracy vs the float32 reference, skewed routings, poisoned
outputs, CUDA-graph replay and torch.compile. Run on a CUDA machine (the lent H200):

    python -m pytest tests/gpu/test_moe_kernel_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from glm5_fp4.kernels import fused_moe, prepare_experts, reserve_workspace
from glm5_fp4.reference import NvFp4Experts, moe_reference, route

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SMALL = dict(e=16, h=512, i=128, k=4)
GLM_TP8 = dict(e=256, h=6144, i=256, k=8)
GLM_TP4 = dict(e=256, h=6144, i=512, k=8)

_EXPERTS: dict[tuple, tuple] = {}


def experts(e, h, i, k=None, seed=0):
    """Quantized random experts on the GPU (+ prepared), cached per shape; weights ~ N(0, 1/fan_in)."""
    key = (e, h, i, seed)
    if key not in _EXPERTS:
        g = torch.Generator(device="cuda").manual_seed(seed)
        w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5
        w2 = torch.randn(e, h, i, device="cuda", generator=g) / i**0.5
        a13 = (3.0 + torch.rand(e, device="cuda", generator=g)) / (6 * 448)
        a2 = (1.0 + torch.rand(e, device="cuda", generator=g)) / (6 * 448)
        ex = NvFp4Experts.from_float(w13, w2, a13, a2)
        del w13, w2
        _EXPERTS[key] = (ex, prepare_experts(ex))
    return _EXPERTS[key]


def inputs(t, e, h, k, dtype=torch.bfloat16):
    x = torch.randn(t, h, device="cuda", dtype=torch.float32).to(dtype)
    logits = torch.randn(t, e, device="cuda")
    w, ids = route(logits, None, k, routed_scaling_factor=2.5)
    return x, w, ids


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_checked(x, w, ids, prep, mode):
    out = torch.full_like(x, float("nan"))
    fused_moe(x, w, ids, prep, mode=mode, out=out)
    assert torch.isfinite(out).all(), "kernel left unwritten (NaN-poisoned) or non-finite outputs"
    return out


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize(
    "shape,t",
    [(SMALL, 1), (SMALL, 3), (SMALL, 37), (SMALL, 300), (GLM_TP8, 1), (GLM_TP8, 16), (GLM_TP8, 512), (GLM_TP4, 128)],
)
def test_matches_reference(shape, t, mode):
    ex, prep = experts(shape["e"], shape["h"], shape["i"])
    x, w, ids = inputs(t, shape["e"], shape["h"], shape["k"])
    out = run_checked(x, w, ids, prep, mode)
    ref = moe_reference(x.float(), w, ids, ex, mode=mode)  # float32 throughout, no final bf16 rounding
    assert rel_err(out, ref) < 1e-2, rel_err(out, ref)


@pytest.mark.parametrize("t", [2, 40])
def test_plain_triton_decode_matches_asm(t):
    """The portable decode (no inline PTX) computes the same operands as the PTX one."""
    from glm5_fp4.kernels.moe import fused_moe_triton

    ex, prep = experts(**{k: SMALL[k] for k in ("e", "h", "i")})
    x, w, ids = inputs(t, SMALL["e"], SMALL["h"], SMALL["k"])
    a = fused_moe_triton(x, w, ids, prep, use_asm=True)
    b = fused_moe_triton(x, w, ids, prep, use_asm=False)
    assert rel_err(a, b) < 2e-3
    assert rel_err(b, moe_reference(x.float(), w, ids, ex)) < 1e-2


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("t,variant", [(3, "unmerged"), (3, "nosplit"), (40, "unmerged"), (40, "noprep"),
                                       (300, "unmerged")])
def test_plan_variants_match_reference(t, variant, mode):
    """Every kernel form a plan can pick: eight MMAs per tile instead of one merged chain, activations
    converted per K tile instead of by the align kernel, the slot GEMM1 without split-K (h=512: 2 splits)."""
    import dataclasses

    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.moe import fused_moe_triton

    e, h, i, k = (SMALL[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(e, h, i)
    x, w, ids = inputs(t, e, h, k)
    cap = torch.cuda.get_device_capability()
    plan = C.plan(C.arch_of(cap), t, e, k, h, i, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    rep = dataclasses.replace
    if variant == "unmerged":
        plan = rep(plan, gemm1=rep(plan.gemm1, merged=False), gemm2=rep(plan.gemm2, merged=False))
    elif variant == "noprep":
        plan = rep(plan, prep_x=False)
    else:
        assert plan.gemm1_split_k > 1, plan  # the default at t=3 splits K
        plan = rep(plan, gemm1_split_k=1)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan)
    assert torch.isfinite(out).all()
    assert rel_err(out, moe_reference(x.float(), w, ids, ex, mode=mode)) < 1e-2


def test_fp16_activations():
    ex, prep = experts(**{k: SMALL[k] for k in ("e", "h", "i")})
    x, w, ids = inputs(64, SMALL["e"], SMALL["h"], SMALL["k"], dtype=torch.float16)
    out = run_checked(x, w, ids, prep, "w4a16")
    assert rel_err(out, moe_reference(x.float(), w, ids, ex)) < 1e-2


def _distinct_ids(t, k, pool, first=None):
    """Per token, k distinct experts drawn from ``pool`` (optionally forcing ``first`` into slot 0)."""
    scores = torch.rand(t, len(pool), device="cuda")
    if first is not None:
        scores[:, pool.index(first)] = 2.0
    order = scores.argsort(dim=1, descending=True)[:, :k]
    return torch.tensor(pool, device="cuda")[order]


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_skewed_all_tokens_one_expert_t8192(mode):
    ex, prep = experts(**{k: GLM_TP8[k] for k in ("e", "h", "i")})
    t, k = 8192, GLM_TP8["k"]
    x = torch.randn(t, GLM_TP8["h"], device="cuda").to(torch.bfloat16)
    ids = _distinct_ids(t, k, list(range(GLM_TP8["e"])), first=7)
    w = torch.rand(t, k, device="cuda")
    w = w / w.sum(1, keepdim=True) * 2.5
    out = run_checked(x, w, ids, prep, mode)
    assert rel_err(out, moe_reference(x.float(), w, ids, ex, mode=mode)) < 1e-2


@pytest.mark.parametrize("t", [1, 5, 40, 700])
def test_most_experts_empty(t):
    ex, prep = experts(**{k: GLM_TP8[k] for k in ("e", "h", "i")})
    k = GLM_TP8["k"]
    pool = [3, 17, 64, 100, 128, 200, 254, 255]  # 248 of 256 experts get nothing
    x = torch.randn(t, GLM_TP8["h"], device="cuda").to(torch.bfloat16)
    ids = _distinct_ids(t, k, pool).to(torch.int32)  # int32 ids as vLLM passes them
    w = torch.rand(t, k, device="cuda")
    out = run_checked(x, w, ids, prep, "w4a16")
    assert rel_err(out, moe_reference(x.float(), w, ids.long(), ex)) < 1e-2


@pytest.mark.parametrize("t", [2, 96])
def test_cuda_graph_replay_matches_eager(t):
    _, prep = experts(**{k: SMALL[k] for k in ("e", "h", "i")})
    e, h, k = SMALL["e"], SMALL["h"], SMALL["k"]
    reserve_workspace(prep, k, 4096)
    x, w, ids = inputs(t, e, h, k)
    out = torch.empty_like(x)
    fused_moe(x, w, ids, prep, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w, ids, prep, out=out)
    for _ in range(3):  # fresh inputs each replay, same buffers
        x2, w2, ids2 = inputs(t, e, h, k)
        x.copy_(x2), w.copy_(w2), ids.copy_(ids2)
        out.fill_(float("nan"))
        graph.replay()
        eager = fused_moe(x2, w2, ids2, prep)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        # fp32 atomics may add a token's experts in another order: equal up to fp32 rounding, then bf16
        assert rel_err(out, eager) < 2e-3


def test_torch_compile_module():
    import glm5_fp4.kernels.op as op

    ex, prep = experts(**{k: SMALL[k] for k in ("e", "h", "i")})
    e, h, k = SMALL["e"], SMALL["h"], SMALL["k"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(h, e, bias=False, device="cuda")

        def forward(self, x):
            logits = self.router(x.float())
            w, ids = torch.topk(torch.sigmoid(logits), k, dim=-1)
            return op.moe_nvfp4(x, w, ids, prep) + x

    m = Block()
    x = torch.randn(33, h, device="cuda").to(torch.bfloat16)
    eager = m(x)
    compiled = torch.compile(m, fullgraph=True)(x)
    assert torch.isfinite(compiled).all()
    assert rel_err(compiled, eager) < 2e-3
