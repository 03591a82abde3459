"""GPU gate for the fused NVFP4 MoE kernel: accuracy against a float64 reference on balanced and skewed
routings (all tokens on k experts, one expert in every token, heavy-tailed hot experts) from T=1 to
T=8192, expert parallelism, poisoned outputs, CUDA-graph replay across routings, torch.compile. Run on a
CUDA machine (the lent H200):

    python -m pytest tests/gpu/test_moe_kernel_gpu.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glm5_fp4.bench.routing import SKEWED, make_routing
from glm5_fp4.kernels import fused_moe, prepare_experts, reserve_workspace
from glm5_fp4.reference import NvFp4Experts, moe_reference
from glm5_fp4.tolerances import moe_tolerance, rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SMALL = dict(e=16, h=512, i=128, k=4)
GLM_TP8 = dict(e=256, h=6144, i=256, k=8)
GLM_TP4 = dict(e=256, h=6144, i=512, k=8)
# expert parallel over 8 GPUs: 32 whole experts (I = 2048) of GLM-5's 256 on this rank
GLM_EP8 = dict(e=32, h=6144, i=2048, k=8, global_e=256)
# whole experts on one GPU (TP1: the H200 true-dimension servers); GEMM2 walks I in chunks
GLM_TP1 = dict(e=256, h=6144, i=2048, k=8)

_EXPERTS: dict[tuple, tuple] = {}


def experts(e, h, i, k=None, seed=0, **_):
    """Quantized random experts on the GPU (+ prepared), cached per shape; weights ~ N(0, 1/fan_in)."""
    key = (e, h, i, seed)
    if key not in _EXPERTS:
        if e * 3 * i * h * 4 > 8 * 2**30:
            # Whole experts (TP1): 39 GB of float weights plus the quantizer's ~48 GB of scratch do not fit
            # beside the other shapes' cached experts (the first H200 run of these tests died of OOM there).
            _EXPERTS.clear()
            torch.cuda.empty_cache()
        g = torch.Generator(device="cuda").manual_seed(seed)
        w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5
        w2 = torch.randn(e, h, i, device="cuda", generator=g) / i**0.5
        a13 = (3.0 + torch.rand(e, device="cuda", generator=g)) / (6 * 448)
        a2 = (1.0 + torch.rand(e, device="cuda", generator=g)) / (6 * 448)
        ex = NvFp4Experts.from_float(w13, w2, a13, a2)
        del w13, w2
        _EXPERTS[key] = (ex, prepare_experts(ex))
    return _EXPERTS[key]


def inputs(t, e, h, k, dtype=torch.bfloat16, routing="balanced", global_e=None):
    x = torch.randn(t, h, device="cuda", dtype=torch.float32).to(dtype)
    w, ids = make_routing(routing, t, global_e or e, k, device="cuda")
    return x, w, ids


def reference(x, w, ids, ex, mode, expert_map=None):
    """The same NVFP4 codes evaluated in float64 (float32 for prefill-sized batches, where float64 GEMMs
    would dominate the suite's time; its 1e-6 rounding is far under every tolerance), no final rounding."""
    dtype = torch.float64 if x.shape[0] <= 1024 else torch.float32
    return moe_reference(x.to(dtype), w.to(dtype), ids.long(), ex, mode=mode, compute_dtype=dtype,
                         expert_map=expert_map)


def run_checked(x, w, ids, prep, mode, expert_map=None):
    out = torch.full_like(x, float("nan"))
    fused_moe(x, w, ids, prep, mode=mode, out=out, expert_map=expert_map)
    assert torch.isfinite(out).all(), "kernel left unwritten (NaN-poisoned) or non-finite outputs"
    return out


def replays_with_new_routings(call, w, ids, out, num_experts, n):
    """Capture ``call`` in a CUDA graph, then ``n`` times: a fresh heavy-tailed routing into ``w``/``ids`` (in
    place, as an engine's graph inputs), ``out`` NaN-poisoned, replay; yields after each so the caller checks
    ``out`` against an eager call."""
    t, k = ids.shape
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for i in range(n):
        nw, nids = make_routing("zipf1.2", t, num_experts, k, device="cuda")
        w.copy_(nw)
        ids.copy_(nids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        yield i


def strided_map(shape):
    """The expert map of an expert-parallel shape (one with global_e): every (global_e / e)-th global expert local,
    in order; None for the others."""
    if "global_e" not in shape:
        return None
    e, global_e = shape["e"], shape["global_e"]
    emap = torch.full((global_e,), -1, dtype=torch.int32, device="cuda")
    emap[:: global_e // e] = torch.arange(e, dtype=torch.int32, device="cuda")
    return emap


def check(x, w, ids, shape, mode, expert_map=None):
    ex, prep = experts(**shape)
    out = run_checked(x, w, ids, prep, mode, expert_map)
    err = rel_error(out, reference(x, w, ids, ex, mode, expert_map))
    assert err < moe_tolerance(mode, x.dtype), err
    return err


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize(
    "shape,t",
    [(SMALL, 1), (SMALL, 3), (SMALL, 37), (SMALL, 300), (GLM_TP8, 1), (GLM_TP8, 4), (GLM_TP8, 16), (GLM_TP8, 512),
     (GLM_TP4, 128), (GLM_TP8, 8192)],
)
def test_balanced_matches_reference(shape, t, mode):
    x, w, ids = inputs(t, shape["e"], shape["h"], shape["k"])
    check(x, w, ids, shape, mode)


@pytest.mark.parametrize("routing", SKEWED)
@pytest.mark.parametrize("t", [16, 512, 1024, 8192])
def test_skewed_routings_match_reference(routing, t):
    """Hot experts with many token blocks each: the work list must cover every block exactly once."""
    x, w, ids = inputs(t, GLM_TP8["e"], GLM_TP8["h"], GLM_TP8["k"], routing=routing)
    check(x, w, ids, GLM_TP8, "w4a16")


@pytest.mark.parametrize("routing,t", [("same_k", 1024), ("zipf1.2", 4096), ("one_hot", 3)])
def test_skewed_w4a4(routing, t):
    x, w, ids = inputs(t, GLM_TP8["e"], GLM_TP8["h"], GLM_TP8["k"], routing=routing)
    check(x, w, ids, GLM_TP8, "w4a4")


@pytest.mark.parametrize("t,routing", [(1, "balanced"), (64, "balanced"), (1664, "balanced"), (4096, "balanced"),
                                       (2048, "same_k"), (4096, "zipf1.2")])
def test_whole_experts_match_reference(t, routing):
    """TP1 (I = 2048) at prefill sizes: the large-block GEMM2 tiles must fit shared memory at this I (a TP1
    SGLang server died on a 270,336-byte GEMM2 at its first prefill above ~2,600 tokens, 2026-12-01)."""
    x, w, ids = inputs(t, GLM_TP1["e"], GLM_TP1["h"], GLM_TP1["k"], routing=routing)
    check(x, w, ids, GLM_TP1, "w4a16")


def _ep_map(global_e, local):
    m = torch.full((global_e,), -1, dtype=torch.int32, device="cuda")
    m[local] = torch.arange(len(local), dtype=torch.int32, device="cuda")
    return m


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("t", [1, 3, 64, 512, 8192])
def test_expert_parallel(t, mode):
    """EP8 rank: 32 whole experts of 256 (strided, as vLLM's round-robin placement may lay them out); the
    first token's 8 experts are all remote (its row must be zero), the others mix local and remote."""
    s = GLM_EP8
    local = torch.arange(3, 256, 8, device="cuda")[: s["e"]]
    emap = _ep_map(s["global_e"], local)
    x, w, ids = inputs(t, s["e"], s["h"], s["k"], global_e=s["global_e"])
    remote = torch.tensor([v for v in range(256) if v % 8 != 3][:8], device="cuda", dtype=ids.dtype)
    ids[0] = remote
    ex, prep = experts(**s)
    out = run_checked(x, w, ids, prep, mode, emap)
    assert out[0].abs().max() == 0
    err = rel_error(out, reference(x, w, ids, ex, mode, emap))
    assert err < moe_tolerance(mode, x.dtype), err


@pytest.mark.parametrize("t", [2, 40])
def test_expert_parallel_rank_without_tokens(t):
    s = GLM_EP8
    emap = _ep_map(s["global_e"], torch.arange(0, 32, device="cuda"))
    x, _, _ = inputs(t, s["e"], s["h"], s["k"], global_e=s["global_e"])
    ids = (torch.arange(8, device="cuda") + 100).repeat(t, 1).to(torch.int32)  # all on experts 100..107
    w = torch.rand(t, 8, device="cuda")
    _, prep = experts(**s)
    out = run_checked(x, w, ids, prep, "w4a16", emap)
    assert out.abs().max() == 0


@pytest.mark.parametrize("t", [2, 40])
def test_plain_triton_decode_matches_asm(t):
    """The portable decode (no inline PTX) computes the same operands as the PTX one."""
    from glm5_fp4.kernels.moe import fused_moe_triton

    ex, prep = experts(**SMALL)
    x, w, ids = inputs(t, SMALL["e"], SMALL["h"], SMALL["k"])
    a = fused_moe_triton(x, w, ids, prep, use_asm=True)
    b = fused_moe_triton(x, w, ids, prep, use_asm=False)
    assert rel_error(a, b) < moe_tolerance("w4a16", x.dtype)
    assert rel_error(b, reference(x, w, ids, ex, "w4a16")) < moe_tolerance("w4a16", x.dtype)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("shape,t", [(SMALL, 1), (SMALL, 3), (SMALL, 40), (SMALL, 300), (GLM_TP8, 4), (GLM_TP8, 512)])
def test_variant_placed_layout_matches_reference(shape, t, mode):
    """layout="placed" (the cheaper asm decode; "tiled" is it K-tile-major): every schedule against the float64 reference, and
    its PTX decode against its portable twin (the interpreter tests check that twin equals the split
    layout's decode bit for bit)."""
    from glm5_fp4.kernels.moe import fused_moe_triton

    ex, _ = experts(**shape)
    prep = prepare_experts(ex, layout="placed")
    x, w, ids = inputs(t, shape["e"], shape["h"], shape["k"], routing="zipf1.2" if t > 4 else "balanced")
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out)
    assert torch.isfinite(out).all()
    assert rel_error(out, reference(x, w, ids, ex, mode)) < moe_tolerance(mode, x.dtype)
    plain = fused_moe_triton(x, w, ids, prep, mode, use_asm=False)
    assert rel_error(out, plain) < moe_tolerance(mode, x.dtype)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("shape,t,routing", [(SMALL, 1, "balanced"), (SMALL, 40, "same_k"), (GLM_TP8, 1, "balanced"),
                                             (GLM_TP8, 4, "same_k"), (GLM_TP8, 64, "zipf1.2"),
                                             (GLM_TP8, 512, "balanced"), (GLM_TP4, 2, "balanced"),
                                             (GLM_TP8, 4096, "same_k")])
def test_variant_tiled_layout_matches_placed_and_reference(shape, t, routing, mode):
    """layout="tiled" (GEMM1's weights K-tile-major): the default plan at each T against the float64 reference
    and against "placed" (the same operands: bit for bit on the slot schedule, up to the fp32 atomics' order on the
    grouped one), and a CUDA-graph replay against the eager call (the same)."""
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton
    from glm5_fp4.tolerances import ATOMICS_ORDER

    ex, _ = experts(**shape)
    x, w, ids = inputs(t, shape["e"], shape["h"], shape["k"], routing=routing)
    tiled, placed = prepare_experts(ex, layout="tiled"), prepare_experts(ex, layout="placed")
    plan = default_plan(x, ids, tiled, mode)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, tiled, mode, out=out, plan=plan)
    assert torch.isfinite(out).all()
    assert rel_error(out, reference(x, w, ids, ex, mode)) < moe_tolerance(mode, x.dtype)

    def same(a, b):
        return torch.equal(a, b) if plan.schedule == "slot" else rel_error(a, b) < ATOMICS_ORDER

    assert same(out, fused_moe_triton(x, w, ids, placed, mode, plan=plan))
    graph_out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, tiled, mode, out=graph_out, plan=plan)  # warm the workspace before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe_triton(x, w, ids, tiled, mode, out=graph_out, plan=plan)
    graph_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert same(graph_out, out)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("shape,t", [(SMALL, 1), (SMALL, 4), (GLM_TP8, 1), (GLM_TP8, 4), (GLM_TP4, 1)])
def test_variant_fused_split_k_reduce(shape, t, mode):
    """plan.gemm1_fused_reduce (opt-in): the last GEMM1 program of each (N tile, slot) reduces the split-K
    partials. Against the reduce kernel's result and the float64 reference, and under CUDA-graph replays
    with new routings equal bit for bit to eager calls (deterministic: the last arrival adds in split order;
    a counter not reset would leave act unwritten or stale)."""
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k)
    plan = default_plan(x, ids, prep, "w4a16")  # the plan a call would use (mode does not change it)
    if plan.gemm1_split_k == 1:
        plan = dataclasses.replace(plan, gemm1_split_k=2)
    fused = dataclasses.replace(plan, gemm1_fused_reduce=True)
    want = fused_moe_triton(x, w, ids, prep, mode, plan=plan)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=fused)
    assert rel_error(out, want) < moe_tolerance(mode, x.dtype)
    assert rel_error(out, reference(x, w, ids, ex, mode)) < moe_tolerance(mode, x.dtype)
    for _ in replays_with_new_routings(lambda: fused_moe_triton(x, w, ids, prep, mode, out=out, plan=fused),
                                       w, ids, out, e, 3):
        assert torch.equal(out, fused_moe_triton(x, w, ids, prep, mode, plan=fused))


@pytest.mark.parametrize("shape,t,routing", [(SMALL, 40, "balanced"), (SMALL, 40, "same_k"), (SMALL, 300, "zipf1.2"),
                                             (GLM_TP8, 512, "balanced"), (GLM_TP8, 4096, "same_k")])
def test_variant_parallel_align(shape, t, routing):
    """plan.parallel_align (the default from configs.PARALLEL_ALIGN_MIN_TOKENS on): many-program count + scan,
    then a scatter kernel. The work list equals the serial align's, the layer matches the float64 reference, and
    CUDA-graph replays with new routings match eager calls (the counts and the arrival counter reset)."""
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton, get_workspace

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing)
    # the plan a call would use (mode does not change it), with each align
    plan = dataclasses.replace(default_plan(x, ids, prep, "w4a16"), parallel_align=False)
    par = dataclasses.replace(plan, parallel_align=True)
    ws = get_workspace(x.device, e, k, h, i, t)
    fused_moe_triton(x, w, ids, prep, plan=plan, stages=("align",))
    serial = ws.blocks[: int(ws.num_blocks)].clone()
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, out=out, plan=par)
    assert torch.equal(ws.blocks[: int(ws.num_blocks)], serial)
    assert not ws.par_counts.any()
    assert torch.isfinite(out).all()
    assert rel_error(out, reference(x, w, ids, ex, "w4a16")) < moe_tolerance("w4a16", x.dtype)
    for _ in replays_with_new_routings(lambda: fused_moe_triton(x, w, ids, prep, out=out, plan=par), w, ids, out, e, 2):
        assert rel_error(out, fused_moe_triton(x, w, ids, prep, plan=plan)) < moe_tolerance("w4a16", x.dtype)


# SMALL's H = 512 is two 256-wide K tiles: it splits in 2 only (4 was refused by the launcher: a test bug, H200 2026-12-02)
@pytest.mark.parametrize("shape,t,routing,split", [
    (SMALL, 40, "same_k", 2), *[(GLM_TP8, t, r, s) for t, r in ((16, "same_k"), (64, "balanced"), (64, "zipf1.2"))
                                for s in (2, 4)]])
def test_variant_grouped_split_k(shape, t, routing, split):
    """plan.gemm1_split_k on the grouped schedule (W4A16; the default where the skewed work list would not fill
    the GPU): against the float64 reference and the unsplit plan, and under CUDA-graph replays with new routings
    equal to eager calls."""
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing)
    plan = default_plan(x, ids, prep, "w4a16", form="grouped_unsplit")
    assert plan.schedule == "grouped" and plan.gemm1_split_k == 1
    sp = dataclasses.replace(plan, gemm1_split_k=split)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, out=out, plan=sp)
    assert torch.isfinite(out).all()
    assert rel_error(out, reference(x, w, ids, ex, "w4a16")) < moe_tolerance("w4a16", x.dtype)
    assert rel_error(out, fused_moe_triton(x, w, ids, prep, plan=plan)) < moe_tolerance("w4a16", x.dtype)
    for _ in replays_with_new_routings(lambda: fused_moe_triton(x, w, ids, prep, out=out, plan=sp), w, ids, out, e, 2):
        assert rel_error(out, fused_moe_triton(x, w, ids, prep, plan=plan)) < moe_tolerance("w4a16", x.dtype)


@pytest.mark.parametrize("shape,t,routing,mode,fused", [
    *[(sh, t, r, m, None) for sh, t, r, m in (
        (SMALL, 1, "balanced", "w4a16"), (SMALL, 3, "same_k", "w4a4"), (SMALL, 40, "zipf2", "w4a16"),
        (GLM_TP8, 1, "balanced", "w4a16"), (GLM_TP8, 4, "same_k", "w4a16"), (GLM_TP8, 64, "zipf1.2", "w4a16"),
        (GLM_TP8, 512, "balanced", "w4a4"), (GLM_TP8, 4096, "same_k", "w4a16"), (GLM_TP4, 1, "balanced", "w4a4"),
        (GLM_EP8, 64, "zipf1.2", "w4a16"))],
    # the slot schedule's split-K with and without its reduce launch (T <= 2: fused is the default)
    (GLM_TP8, 1, "balanced", "w4a16", False), (GLM_TP8, 2, "same_k", "w4a4", False),
    (GLM_TP4, 1, "balanced", "w4a16", False)])
def test_pdl_matches_reference_and_plain_launches(shape, t, routing, mode, fused):
    """Plan.pdl (the default from configs.PDL_MIN_TOKENS on): every kernel launched under its predecessor's
    tail, GEMM2 prefetching weight rows before it waits. Against the float64 reference and the same plan launched
    plainly (the same arithmetic: equal bit for bit where no atomics add, within tolerance where they do), and in
    one CUDA graph of three chained calls (each call's x is the previous call's output, so a kernel that read
    before its wait would see a stale or NaN row), replayed with new routings and equal to the plain plan run
    eagerly. ``fused``: the slot split-K reduce in GEMM1 (True) or its own launch (False); None: the plan's."""
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing, global_e=shape.get("global_e"))
    emap = None
    if "global_e" in shape:  # this rank holds every 8th expert (the others' slots are remote)
        emap = torch.full((shape["global_e"],), -1, dtype=torch.int32, device="cuda")
        emap[:: shape["global_e"] // e] = torch.arange(e, dtype=torch.int32, device="cuda")
    base = default_plan(x, ids, prep, mode, expert_map=emap)
    if fused is not None:
        assert base.schedule == "slot" and base.gemm1_split_k > 1
        base = dataclasses.replace(base, gemm1_fused_reduce=fused)
    plan, plain = dataclasses.replace(base, pdl=True), dataclasses.replace(base, pdl=False)
    ref = reference(x, w, ids, ex, mode, emap)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan, expert_map=emap)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < moe_tolerance(mode, x.dtype)
    want = fused_moe_triton(x, w, ids, prep, mode, plan=plain, expert_map=emap)
    deterministic = plan.schedule == "slot" and not plan.slot_dedup
    if deterministic and not plan.gemm1_fused_reduce:
        assert torch.equal(out, want)
    else:
        assert rel_error(out, want) < moe_tolerance(mode, x.dtype)

    outs = [torch.full_like(x, float("nan")) for _ in range(3)]

    def chain(p):
        src = x
        for o in outs:
            fused_moe_triton(src, w, ids, prep, mode, out=o, plan=p, expert_map=emap)
            src = o

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(plan)
    for _ in range(2):
        nw, nids = make_routing("zipf1.2", t, shape.get("global_e") or e, k, device="cuda")
        w.copy_(nw)
        ids.copy_(nids)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in outs]
        chain(plain)
        for a, b in zip(got, outs):
            assert torch.isfinite(a).all()
            assert rel_error(a, b) < 2 * moe_tolerance(mode, x.dtype)  # chained: each call's rounding feeds the next


@pytest.mark.parametrize("shape,t,routing,mode,pdl", [
    (SMALL, 1, "balanced", "w4a16", False), (SMALL, 2, "same_k", "w4a4", True),
    (GLM_TP8, 1, "balanced", "w4a16", False), (GLM_TP8, 1, "balanced", "w4a16", True),
    (GLM_TP8, 2, "same_k", "w4a4", True), (GLM_TP8, 2, "zipf2", "w4a16", False),
    (GLM_TP4, 1, "balanced", "w4a4", True), (GLM_TP1, 2, "balanced", "w4a16", False),
    (GLM_EP8, 1, "balanced", "w4a16", True)])
def test_gemm2_split_slots(shape, t, routing, mode, pdl):
    """Plan.gemm2_split_slots (one slot GEMM2 program per slot, the token's k rows added by the last to arrive; the
    sm90 default at T <= 2, asked for by its form here so that the test means the same on every arch): against
    float64 and the one-program form (within tolerance: on the GPU the two compile to different code, bit-equal only
    in the interpreter), bit for bit the same plan launched with and without PDL (deterministic: no atomics add);
    whole experts (K in chunks) and an expert map (remote slots); a CUDA graph replayed with new routings equals
    eager calls bit for bit (the arrival counters are zero again after each call)."""
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing, global_e=shape.get("global_e"))
    emap = strided_map(shape)
    split = dataclasses.replace(default_plan(x, ids, prep, mode, expert_map=emap, form="split_slots"), pdl=pdl)
    base = dataclasses.replace(default_plan(x, ids, prep, mode, expert_map=emap, form="one_program_gemm2"), pdl=pdl)
    assert split.gemm2_split_slots and not base.gemm2_split_slots and base.schedule == "slot"
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=split, expert_map=emap)
    assert torch.isfinite(out).all()
    assert rel_error(out, reference(x, w, ids, ex, mode, emap)) < moe_tolerance(mode, x.dtype)
    one = fused_moe_triton(x, w, ids, prep, mode, plan=base, expert_map=emap)
    assert rel_error(out, one) < moe_tolerance(mode, x.dtype)
    other = dataclasses.replace(split, pdl=not pdl)
    assert torch.equal(out, fused_moe_triton(x, w, ids, prep, mode, plan=other, expert_map=emap))
    for _ in replays_with_new_routings(lambda: fused_moe_triton(x, w, ids, prep, mode, out=out, plan=split,
                                                                expert_map=emap), w, ids, out,
                                       shape.get("global_e") or e, 2):
        assert torch.equal(out, fused_moe_triton(x, w, ids, prep, mode, plan=split, expert_map=emap))


@pytest.mark.parametrize("shape,t,routing,mode", [
    (SMALL, 4, "same_k", "w4a16"), (SMALL, 3, "zipf2", "w4a4"), (GLM_TP8, 4, "same_k", "w4a16"),
    (GLM_TP8, 4, "balanced", "w4a4"), (GLM_TP8, 2, "one_hot", "w4a16"), (GLM_TP4, 4, "same_k", "w4a4"),
    (GLM_TP1, 4, "same_k", "w4a16")])
def test_variant_slot_dedup(shape, t, routing, mode):
    """Plan.slot_dedup (the default at T = 3-4, the slot_dedup form below): against the float64 reference and the
    per-slot form (the same products in the same order: equal, up to the fp32 MMA's own column independence), and
    under CUDA-graph replays with new routings equal to eager calls of the per-slot form."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing)
    plan = default_plan(x, ids, prep, mode, form="per_slot")
    dedup = default_plan(x, ids, prep, mode, form=None if t >= C.SLOT_DEDUP_MIN_TOKENS else "slot_dedup")
    assert plan.schedule == "slot" and not plan.slot_dedup and dedup.slot_dedup
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=dedup)
    assert torch.isfinite(out).all()
    assert rel_error(out, reference(x, w, ids, ex, mode)) < moe_tolerance(mode, x.dtype)
    assert rel_error(out, fused_moe_triton(x, w, ids, prep, mode, plan=plan)) < moe_tolerance(mode, x.dtype)
    for _ in replays_with_new_routings(lambda: fused_moe_triton(x, w, ids, prep, mode, out=out, plan=dedup), w, ids,
                                       out, e, 2):
        assert rel_error(out, fused_moe_triton(x, w, ids, prep, mode, plan=plan)) < moe_tolerance(mode, x.dtype)


@pytest.mark.parametrize("shape,t,routing,mode", [
    (SMALL, 4, "same_k", "w4a16"), (GLM_TP8, 4, "same_k", "w4a16"), (GLM_TP8, 4, "balanced", "w4a4"),
    (GLM_TP8, 3, "zipf1.2", "w4a16"), (GLM_TP8, 2, "one_hot", "w4a16"), (GLM_TP4, 4, "same_k", "w4a16"),
    (GLM_EP8, 4, "same_k", "w4a16")])
def test_dedup_by_arrival(shape, t, routing, mode):
    """The opt-in "dedup_by_arrival" (Plan.dedup_fused_finalize: GEMM2's last writer of a token's k per-slot rows
    adds them, no finalize launch; GEMM1 split along K with its reduce fused): against float64 with NaN-poisoned
    outputs; bit for bit the same plan with the finalize launch (the same GEMM1, the same rows added in the same
    order; the GEMM2 rows come from the same kernel body); whole experts (K in chunks) and an expert map (remote
    slots, which arrive by their own programs); CUDA graphs replayed with new routings equal eager calls bit for bit
    (the arrival counters are zero again after each call)."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.moe import default_plan, device_arch, fused_moe_triton, get_workspace

    if device_arch(torch.device("cuda"))[0] not in C.OPT_IN["dedup_by_arrival"].archs:
        pytest.skip("the dedup_by_arrival form serves sm_90 / sm_100 only")
    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing, global_e=shape.get("global_e"))
    emap = strided_map(shape)
    plan = default_plan(x, ids, prep, mode, expert_map=emap, form="dedup_by_arrival")
    assert plan.slot_dedup and plan.dedup_fused_finalize
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan, expert_map=emap)
    assert torch.isfinite(out).all()
    assert rel_error(out, reference(x, w, ids, ex, mode, emap)) < moe_tolerance(mode, x.dtype)
    with_finalize = dataclasses.replace(plan, dedup_fused_finalize=False)
    assert torch.equal(out, fused_moe_triton(x, w, ids, prep, mode, plan=with_finalize, expert_map=emap))
    assert not get_workspace(x.device, prep.num_experts, k, h, i, t).slot_count.any()
    for _ in replays_with_new_routings(lambda: fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan,
                                                                expert_map=emap), w, ids, out,
                                       shape.get("global_e") or e, 2):
        assert torch.equal(out, fused_moe_triton(x, w, ids, prep, mode, plan=with_finalize, expert_map=emap))


@pytest.mark.parametrize("shape,t,mode", [(GLM_TP8, 4, "w4a16"), (GLM_TP8, 3, "w4a4"), (GLM_TP4, 4, "w4a16"),
                                          (GLM_TP4, 3, "w4a4")])
def test_dedup_split_picked_from_the_routing(shape, t, mode):
    """Plan.gemm1_split_cap (the slot dedup GEMM1's split-K picked from the routing at run time, the default on
    sm_90/sm_100: raised, or lowered to fit one wave; GEMM1's compact grid): one CUDA graph replayed over routings
    with 8 to 32 groups (a different split each) equals, bit for bit, eager calls of the plan with that routing's
    split fixed on the full grid; near float64; NaN-poisoned outputs."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing="balanced")
    plan = default_plan(x, ids, prep, mode)
    assert plan.slot_dedup and plan.gemm1_split_cap > 0

    def fixed_split():
        k_tiles, groups = h // plan.gemm1.bk, len(set(ids.flatten().tolist()))
        most = C.dedup_split_max(h, plan.gemm1.bk, i // plan.gemm1.bn, k, plan.gemm1_split_cap)
        split = max([s for s in range(plan.gemm1_split_floor or plan.gemm1_split_k, most + 1)
                     if k_tiles % s == 0 and groups * (i // plan.gemm1.bn) * s <= plan.gemm1_split_cap],
                    default=plan.gemm1_split_k)
        return dataclasses.replace(plan, gemm1_split_cap=0, gemm1_split_k=split, gemm1_compact_grid=False,
                                   gemm1_split_floor=0)

    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan)
    assert torch.equal(out, fused_moe_triton(x, w, ids, prep, mode, plan=fixed_split()))
    assert rel_error(out, reference(x, w, ids, ex, mode)) < moe_tolerance(mode, x.dtype)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan)
    for routing in ("same_k", "balanced", "zipf1.2", "one_hot"):
        nw, nids = make_routing(routing, t, e, k, device="cuda")
        w.copy_(nw)
        ids.copy_(nids.to(ids.dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_moe_triton(x, w, ids, prep, mode, plan=fixed_split())), routing


@pytest.mark.parametrize("shape,t,routing,mode", [
    (GLM_TP8, 1, "balanced", "w4a16"), (GLM_TP8, 2, "same_k", "w4a4"), (GLM_TP8, 4, "balanced", "w4a16"),
    (GLM_TP8, 3, "zipf1.2", "w4a4"), (GLM_TP4, 4, "same_k", "w4a16"), (GLM_TP1, 1, "balanced", "w4a16"),
    (SMALL, 4, "same_k", "w4a16")])
def test_gemm1_x_in_natural_order(shape, t, routing, mode):
    """Plan.x_natural (the slot GEMM1 loads x in natural K order and merges the rows in registers; the default with
    slot dedup on sm_90): the same MMA operand as the merged-order gather, so the output is the gathered plan's bit
    for bit (NaN-poisoned), near float64, and the same again from a CUDA graph replayed with new routings."""
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing)
    base = dataclasses.replace(default_plan(x, ids, prep, mode), x_natural=False)
    plan = dataclasses.replace(base, x_natural=True)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan)
    assert torch.isfinite(out).all()
    assert torch.equal(out, fused_moe_triton(x, w, ids, prep, mode, plan=base))
    assert rel_error(out, reference(x, w, ids, ex, mode)) < moe_tolerance(mode, x.dtype)
    for _ in replays_with_new_routings(lambda: fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan), w, ids,
                                       out, e, 2):
        assert torch.equal(out, fused_moe_triton(x, w, ids, prep, mode, plan=base))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("t,variant", [(3, "unmerged"), (3, "nosplit"), (40, "unmerged"), (40, "noprep"),
                                       (300, "unmerged"), (300, "bm64")])
def test_plan_variants_match_reference(t, variant, mode):
    """Every kernel form a plan can pick: eight MMAs per tile instead of one merged chain, activations
    converted per K tile instead of by the align kernel, the slot GEMM1 without split-K, larger blocks."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton

    e, h, i, k = (SMALL[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**SMALL)
    x, w, ids = inputs(t, e, h, k)
    # the plan a call in this mode would use: W4A4 never splits the grouped GEMM1 (the launcher refuses it; the
    # W4A16 plan ran here until the H200 said so, 2026-12-02)
    plan = default_plan(x, ids, prep, mode)
    rep = dataclasses.replace
    if variant == "unmerged":
        plan = rep(plan, gemm1=rep(plan.gemm1, merged=False), gemm2=rep(plan.gemm2, merged=False))
    elif variant == "noprep":
        plan = rep(plan, prep_x=False)
    elif variant == "bm64":
        plan = rep(plan, gemm1=C.Gemm1Config(64, 64, 128, 4, 3), gemm2=C.Gemm2Config(64, 32, 4, 3, merged=False))
    else:
        assert plan.gemm1_split_k > 1, plan  # the default at t=3 splits K
        plan = rep(plan, gemm1_split_k=1)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan)
    assert torch.isfinite(out).all()
    assert rel_error(out, reference(x, w, ids, ex, mode)) < moe_tolerance(mode, x.dtype)


def test_fp16_activations():
    x, w, ids = inputs(64, SMALL["e"], SMALL["h"], SMALL["k"], dtype=torch.float16)
    check(x, w, ids, SMALL, "w4a16")


@pytest.mark.parametrize("t", [2, 96, 1024])
def test_cuda_graph_replay_follows_the_routing(t):
    """One graph captured on a balanced routing replays skewed ones: the work list lives on the GPU."""
    shape = SMALL if t < 1000 else GLM_TP8
    e, h, k = shape["e"], shape["h"], shape["k"]
    _, prep = experts(**shape)
    reserve_workspace(prep, k, 4096)
    x, w, ids = inputs(t, e, h, k)
    out = torch.empty_like(x)
    fused_moe(x, w, ids, prep, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w, ids, prep, out=out)
    for routing in ("same_k", "balanced", "zipf2", "one_hot"):
        x2, w2, ids2 = inputs(t, e, h, k, routing=routing)
        x.copy_(x2), w.copy_(w2), ids.copy_(ids2.to(ids.dtype))
        out.fill_(float("nan"))
        graph.replay()
        eager = fused_moe(x2, w2, ids2, prep)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), routing
        # fp32 atomics may add a token's experts in another order: equal up to fp32 rounding, then bf16
        assert rel_error(out, eager) < moe_tolerance("w4a16", x.dtype), routing


def test_torch_compile_module():
    import glm5_fp4.kernels.op as op

    _, prep = experts(**SMALL)
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
    assert rel_error(compiled, eager) < moe_tolerance("w4a16", x.dtype)


@pytest.mark.parametrize("shape,t,routing,mode", [
    (GLM_TP8, 1, "balanced", "w4a16"), (GLM_TP8, 4, "same_k", "w4a16"), (GLM_TP8, 4, "balanced", "w4a4"),
    (GLM_TP4, 3, "zipf1.2", "w4a16"), (GLM_TP8, 512, "balanced", "w4a16"), (GLM_TP8, 1024, "zipf1.2", "w4a16"),
    (GLM_TP8, 512, "same_k", "w4a4")])
def test_register_capped_tiles_and_l2_prefetch(shape, t, routing, mode):
    """The 2026-12-03 defaults (slot GEMM1 in 2 stages capped at 168 registers; the TP8 shard's 32-token GEMM2 in
    4-warp 64x32 tiles, 6 programs along H) and Plan.l2_prefetch against the float64 reference, NaN-poisoned
    outputs; their former forms (opt-in) give the same layer; CUDA-graph replays with new routings match eager."""
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing)
    ref = reference(x, w, ids, ex, mode)
    plan = default_plan(x, ids, prep, mode)
    plans = [plan, dataclasses.replace(plan, l2_prefetch=4)]
    plans += [p for p in (default_plan(x, ids, prep, mode, form=f) for f in ("slot_stages4", "gemm2_128x32")) if p != plan]
    for p in plans:
        out = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prep, mode=mode, out=out, plan=p)
        assert torch.isfinite(out).all(), p
        assert rel_error(out, ref) < moe_tolerance(mode, x.dtype), p
    pf = plans[1]
    out = torch.full_like(x, float("nan"))
    for _ in replays_with_new_routings(lambda: fused_moe_triton(x, w, ids, prep, mode=mode, out=out, plan=pf),
                                       w, ids, out, e, 2):
        assert rel_error(out, fused_moe_triton(x, w, ids, prep, mode=mode, plan=plan)) < moe_tolerance(mode, x.dtype)


@pytest.mark.parametrize("shape,t,routing,mode", [
    (GLM_TP8, 1, "balanced", "w4a16"), (GLM_TP8, 4, "same_k", "w4a4"), (GLM_TP8, 64, "zipf1.2", "w4a16"),
    (GLM_TP8, 512, "balanced", "w4a16"), (GLM_TP8, 1024, "same_k", "w4a16"), (GLM_TP4, 512, "zipf1.2", "w4a4"),
    (GLM_TP8, 4096, "balanced", "w4a16")])
def test_gemm1_weight_tiles_by_tma(shape, t, routing, mode):
    """Gemm1Config.tma (weight tiles by TMA; scales too at BK = 256) against the float64 reference, NaN-poisoned
    outputs, for every TMA candidate at the plan's token block; a CUDA-graph replay with new routings matches
    eager."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.moe import default_plan, device_arch, fused_moe_triton

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing)
    ref = reference(x, w, ids, ex, mode)
    base = default_plan(x, ids, prep, mode)
    arch, _ = device_arch(x.device)
    tiles = [g for g in C.GEMM1_CANDIDATES[arch] if g.tma and g.bm == base.gemm1.bm and i % g.bn == 0]
    assert tiles, f"no TMA tile at bm={base.gemm1.bm}"
    for g1 in tiles:
        p = dataclasses.replace(base, gemm1=g1)
        out = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prep, mode=mode, out=out, plan=p)
        assert torch.isfinite(out).all(), g1
        assert rel_error(out, ref) < moe_tolerance(mode, x.dtype), g1
    p = dataclasses.replace(base, gemm1=tiles[0])
    out = torch.full_like(x, float("nan"))
    for _ in replays_with_new_routings(lambda: fused_moe_triton(x, w, ids, prep, mode=mode, out=out, plan=p),
                                       w, ids, out, e, 2):
        assert rel_error(out, fused_moe_triton(x, w, ids, prep, mode=mode, plan=base)) < moe_tolerance(mode, x.dtype)


@pytest.mark.parametrize("shape,t,routing,mode", [
    (GLM_TP8, 16, "same_k", "w4a16"), (GLM_TP8, 64, "zipf1.2", "w4a16"), (GLM_TP8, 512, "balanced", "w4a16"),
    (GLM_TP8, 1024, "same_k", "w4a16"), (GLM_TP4, 512, "zipf1.2", "w4a4"), (GLM_TP8, 4096, "balanced", "w4a16"),
    (GLM_EP8, 512, "balanced", "w4a16")])
def test_gemm1_stacked_gate_and_up_rows(shape, t, routing, mode):
    """Gemm1Config.stacked (gate and up rows as one tile, the wgmmas alternating between the accumulator's halves)
    against the float64 reference, NaN-poisoned outputs: the default tile stacked (W4A16: the opt-in 'stacked' form)
    and every stacked candidate at the plan's token block; a CUDA-graph replay with new routings matches eager."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.moe import default_plan, device_arch, fused_moe_triton

    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing, global_e=shape.get("global_e"))
    emap = _ep_map(shape["global_e"], torch.arange(3, 256, 8, device="cuda")[:e]) if "global_e" in shape else None
    ref = reference(x, w, ids, ex, mode, expert_map=emap)
    base = default_plan(x, ids, prep, mode, expert_map=emap)
    form = dataclasses.replace(base, gemm1=dataclasses.replace(base.gemm1, stacked=True))
    if mode == "w4a16":  # the opt-in form stacks the default tile (W4A4 keeps it unstacked: configs.plan)
        assert default_plan(x, ids, prep, mode, expert_map=emap, form="stacked") == form
    arch, _ = device_arch(x.device)
    tiles = [g for g in C.GEMM1_CANDIDATES[arch] if g.stacked and g.bm == base.gemm1.bm and i % g.bn == 0]
    for p in [form] + [dataclasses.replace(base, gemm1=g1) for g1 in tiles]:
        out = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prep, mode=mode, out=out, plan=p, expert_map=emap)
        assert torch.isfinite(out).all(), p.gemm1
        assert rel_error(out, ref) < moe_tolerance(mode, x.dtype), p.gemm1
    out = torch.full_like(x, float("nan"))
    for _ in replays_with_new_routings(
            lambda: fused_moe_triton(x, w, ids, prep, mode=mode, out=out, plan=form, expert_map=emap), w, ids, out,
            shape.get("global_e", e), 2):
        assert rel_error(out, fused_moe_triton(x, w, ids, prep, mode=mode, plan=base, expert_map=emap)) < \
            moe_tolerance(mode, x.dtype)


@pytest.mark.parametrize("t,routing,mode", [(8, "balanced", "w4a16"), (64, "same_k", "w4a16"), (128, "zipf1.2", "w4a4"),
                                            (256, "balanced", "w4a16"), (256, "one_hot", "w4a16")])
def test_gemm2_split_along_h_of_16_token_blocks(t, routing, mode):
    """The TP8 shard's GEMM2 of 16-token blocks split 12 ways in 4 stages (the sm90 default) and the former form
    (opt-in gemm2_split_rule), each GEMM2 candidate of the same tile at every split the sweep tries, against the
    float64 reference with NaN-poisoned outputs; a CUDA-graph replay with new routings matches eager."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.moe import default_plan, device_arch, fused_moe_triton

    e, h, i, k = (GLM_TP8[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**GLM_TP8)
    x, w, ids = inputs(t, e, h, k, routing=routing)
    ref = reference(x, w, ids, ex, mode)
    base = default_plan(x, ids, prep, mode)
    assert base.schedule == "grouped" and base.gemm2.bm == 16
    arch, _ = device_arch(x.device)
    plans = [base, default_plan(x, ids, prep, mode, form="gemm2_split_rule")]
    plans += [dataclasses.replace(base, gemm2=g2, gemm2_n_split=ns) for g2 in C.GEMM2_CANDIDATES[arch]
              if (g2.bn, g2.bm, g2.merged) == (64, 16, False) and not g2.maxnreg for ns in (2, 3, 12)]
    for p in plans:
        out = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prep, mode=mode, out=out, plan=p)
        assert torch.isfinite(out).all(), (p.gemm2, p.gemm2_n_split)
        assert rel_error(out, ref) < moe_tolerance(mode, x.dtype), (p.gemm2, p.gemm2_n_split)
    out = torch.full_like(x, float("nan"))
    for _ in replays_with_new_routings(lambda: fused_moe_triton(x, w, ids, prep, mode=mode, out=out, plan=base), w, ids,
                                       out, e, 2):
        assert rel_error(out, fused_moe_triton(x, w, ids, prep, mode=mode, plan=plans[1])) < moe_tolerance(mode, x.dtype)


@pytest.mark.parametrize("form,shape,t,routing", [
    ("gemm1_ws", GLM_TP8, 512, "balanced"), ("gemm1_ws", GLM_TP8, 1024, "same_k"),
    ("gemm1_ws", GLM_TP8, 512, "zipf1.2"), ("gemm1_ws", GLM_TP4, 512, "one_hot"),
    ("gemm1_ws64", GLM_TP8, 384, "balanced"), ("gemm1_ws64", GLM_TP8, 1024, "zipf1.2"),
    ("gemm1_ws16", GLM_TP8, 64, "balanced"), ("gemm1_ws16", GLM_TP8, 16, "same_k"),
    ("gemm1_ws", GLM_EP8, 512, "balanced")])
def test_gemm1_warp_specialized(form, shape, t, routing):
    """The warp-specialised Gluon GEMM1 (Gemm1Config.ws: producer warp, persistent CTAs) against the float64
    reference, NaN-poisoned outputs, skewed routings and an expert map; a CUDA-graph replay with new routings
    matches the default plan."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.moe import default_plan, device_arch, fused_moe_triton

    if device_arch(torch.device("cuda"))[0] not in C.OPT_IN[form].archs:
        pytest.skip(f"{form} serves {C.OPT_IN[form].archs}")
    e, h, i, k = (shape[n] for n in ("e", "h", "i", "k"))
    ex, prep = experts(**shape)
    x, w, ids = inputs(t, e, h, k, routing=routing, global_e=shape.get("global_e"))
    emap = _ep_map(shape["global_e"], torch.arange(3, 256, 8, device="cuda")[:e]) if "global_e" in shape else None
    ref = reference(x, w, ids, ex, "w4a16", expert_map=emap)
    p = default_plan(x, ids, prep, "w4a16", expert_map=emap, form=form)
    assert p.gemm1.ws, p
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode="w4a16", out=out, plan=p, expert_map=emap)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < moe_tolerance("w4a16", x.dtype)
    out = torch.full_like(x, float("nan"))
    base = default_plan(x, ids, prep, "w4a16", expert_map=emap)
    for _ in replays_with_new_routings(
            lambda: fused_moe_triton(x, w, ids, prep, mode="w4a16", out=out, plan=p, expert_map=emap), w, ids, out,
            shape.get("global_e", e), 2):
        assert rel_error(out, fused_moe_triton(x, w, ids, prep, mode="w4a16", plan=base, expert_map=emap)) < \
            moe_tolerance("w4a16", x.dtype)
