"""The RTX PRO 6000's (sm_120's) plans run on this GPU: its tile tables, schedule rules and SM count (188), the
kernels an SM120 would launch for the W4A16 and emulated W4A4 paths, against the float64 reference on balanced
and skewed routings, T = 1 to 8,192, TP8 / TP4 / TP1 / EP8 shards, and CUDA-graph replays.

Run twice on an H200: as part of the GPU suite (the dots compile to wgmma there), and alone under
``DISABLE_MMA_V3=1`` (glm5_fp4.bench.mma), which makes Triton emit ``mma.sync m16n8k16``, sm_120's instruction:

    DISABLE_MMA_V3=1 TRITON_CACHE_DIR=/tmp/tc-mma-sync python -m pytest tests/gpu/test_sm120_plans_gpu.py -q

``test_dots_use_the_instruction_the_environment_asks_for`` checks which one was built, so a run says what it
verified. Neither run is an SM120 measurement: ptxas schedules for sm_90, and the memory system is the H200's.
"""

from __future__ import annotations

import pytest
import torch

from glm5_fp4.bench.mma import mma_sync_forced, ptx_mma
from glm5_fp4.bench.routing import make_routing
from glm5_fp4.kernels import configs as C
from glm5_fp4.tolerances import ATOMICS_ORDER, moe_tolerance, rel_error
from test_moe_kernel_gpu import GLM_EP8, GLM_TP1, GLM_TP4, GLM_TP8, SMALL, experts, inputs, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ARCH = "sm120"


def _emap(shape):
    """Expert-parallel shapes: this rank holds every 8th global expert (the others' slots are remote)."""
    if "global_e" not in shape:
        return None
    m = torch.full((shape["global_e"],), -1, dtype=torch.int32, device="cuda")
    m[:: shape["global_e"] // shape["e"]] = torch.arange(shape["e"], dtype=torch.int32, device="cuda")
    return m


def sm120_plan(shape, t, mode):
    return C.plan(ARCH, t, shape["e"], shape["k"], shape["h"], shape["i"], sm_count=C.sm_count_guess(ARCH),
                  global_experts=shape.get("global_e"), mode=mode)


def _run(x, w, ids, prep, mode, plan, emap, out=None):
    from glm5_fp4.kernels.moe import fused_moe_triton

    return fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan, expert_map=emap)


@pytest.mark.parametrize("shape,t,routing,mode", [
    (SMALL, 1, "balanced", "w4a16"), (SMALL, 3, "one_hot", "w4a4"), (SMALL, 40, "same_k", "w4a16"),
    (SMALL, 300, "zipf1.2", "w4a4"),
    (GLM_TP8, 1, "balanced", "w4a16"), (GLM_TP8, 2, "same_k", "w4a16"), (GLM_TP8, 4, "balanced", "w4a4"),
    (GLM_TP8, 16, "zipf1.2", "w4a16"), (GLM_TP8, 64, "same_k", "w4a16"), (GLM_TP8, 512, "balanced", "w4a16"),
    (GLM_TP8, 512, "zipf2", "w4a4"), (GLM_TP8, 1024, "one_hot", "w4a16"), (GLM_TP8, 4096, "same_k", "w4a16"),
    (GLM_TP8, 8192, "balanced", "w4a16"),
    (GLM_TP4, 1, "balanced", "w4a16"), (GLM_TP4, 512, "zipf1.2", "w4a16"),
    (GLM_EP8, 3, "balanced", "w4a16"), (GLM_EP8, 64, "zipf1.2", "w4a16"),
    (GLM_TP1, 1, "balanced", "w4a16"), (GLM_TP1, 2048, "same_k", "w4a16"),
])
def test_sm120_plans_match_reference(shape, t, routing, mode):
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, shape["e"], shape["h"], shape["k"], routing=routing, global_e=shape.get("global_e"))
    emap = _emap(shape)
    plan = sm120_plan(shape, t, mode)
    out = torch.full_like(x, float("nan"))
    _run(x, w, ids, prep, mode, plan, emap, out)
    assert torch.isfinite(out).all(), "kernel left unwritten (NaN-poisoned) or non-finite outputs"
    err = rel_error(out, reference(x, w, ids, ex, mode, emap))
    assert err < moe_tolerance(mode, x.dtype), (plan, err)


@pytest.mark.parametrize("shape,t", [(GLM_TP8, 1), (GLM_TP8, 4), (GLM_TP8, 512), (GLM_TP4, 64)])
def test_sm120_plans_replay_new_routings(shape, t):
    """One graph per plan, replayed on fresh heavy-tailed routings written into its inputs, equals eager calls
    (bit for bit on the slot schedule without dedup; the grouped one adds a token's experts by fp32 atomics)."""
    from glm5_fp4.kernels import reserve_workspace

    e, k = shape["e"], shape["k"]
    _, prep = experts(**shape)
    reserve_workspace(prep, k, max(t, 256))
    x, w, ids = inputs(t, e, shape["h"], k)
    plan = sm120_plan(shape, t, "w4a16")
    out = torch.empty_like(x)
    _run(x, w, ids, prep, "w4a16", plan, None, out)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(x, w, ids, prep, "w4a16", plan, None, out)
    exact = plan.schedule == "slot" and not plan.slot_dedup
    for _ in range(3):
        nw, nids = make_routing("zipf1.2", t, e, k, device="cuda")
        w.copy_(nw)
        ids.copy_(nids)
        out.fill_(float("nan"))
        graph.replay()
        eager = _run(x, w, ids, prep, "w4a16", plan, None)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        if exact:
            assert torch.equal(out, eager)
        else:
            assert rel_error(out, eager) < ATOMICS_ORDER


def test_dots_use_the_instruction_the_environment_asks_for():
    """Under DISABLE_MMA_V3=1 every kernel with a dot of the sm_120 plans is built with mma.sync m16n8k16 (what
    sm_120 runs); otherwise, on SM90, GEMM1 uses wgmma. A Triton that stopped honouring the variable fails here."""
    from glm5_fp4.kernels.launch import launches
    from glm5_fp4.kernels.moe import make_call

    shape = GLM_TP8
    _, prep = experts(**shape)
    built = {}
    for t in (1, 512):
        x, w, ids = inputs(t, shape["e"], shape["h"], shape["k"])
        call = make_call(x, w, ids, prep, "w4a16")
        for launch in launches(sm120_plan(shape, t, "w4a16"), call):
            kernel = launch.fn.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
            forms = ptx_mma(kernel.asm["ptx"])
            if forms:
                built[f"{launch.name} T={t}"] = forms
    assert any("gemm1" in k for k in built) and any("gemm2" in k for k in built), built
    if mma_sync_forced():
        assert all(v == ["mma.sync m16n8k16 f16"] for v in built.values()), built
    elif torch.cuda.get_device_capability()[0] == 9:
        assert any(f.startswith("wgmma") for k, v in built.items() if "gemm1" in k for f in v), built

