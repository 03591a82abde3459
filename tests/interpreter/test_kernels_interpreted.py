"""The fused MoE's Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1), tiny shapes.

Run by `make test` in its own process (the interpreter must be on before the kernels are decorated). fp16
activations (the interpreter's bf16 tl.dot is broken, shared/reference/kernel-notes.md section 4) and the
portable decode (the interpreter cannot run the inline PTX; tests/gpu checks that the PTX decode equals
it). Covered: both schedules, several work-list blocks per hot expert, skewed routings, expert
parallelism (remote slots, all-remote tokens, a rank without tokens), the "placed" weight layout, W4A16
and W4A4 against a float64 reference, NaN-poisoned outputs, int32 ids, and the kernels' E4M3 / E2M1 rounding helpers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from glm5_fp4 import nvfp4
from glm5_fp4.bench.routing import make_routing
from glm5_fp4.kernels import configs as C
from glm5_fp4.kernels import prepare_experts
from glm5_fp4.kernels.moe import fused_moe_triton
from glm5_fp4.kernels.native_fp4 import _quant_fp4
from glm5_fp4.kernels.triton_moe import _decode_code, _group_slots, _round_e4m3, _slot_group
from glm5_fp4.reference import moe_reference, random_experts
from glm5_fp4.tolerances import moe_tolerance, rel_error

E, H, I, K = 8, 128, 128, 2


def _experts(gen, h=H):
    ex = random_experts(E, h, I, generator=gen)
    return ex, prepare_experts(ex)


def _plan(t, schedule, h=H, bm=16, merged=True, bk=128, tma=False, stacked=False, **flags):
    """A pinned plan: the per-slot / unsplit forms unless ``flags`` ask for dedup or split-K (the defaults moved
    to them at T >= 3 / short grouped lists; each test here names the form it checks). At T <= 2 the slot plans
    are sm_90's defaults there: GEMM2 split by slots, a fused split-K reduce where K splits (PDL, in the plan, runs
    as plain launches in the interpreter); test_gemm2_split_slots pins the one-program GEMM2 against it."""
    plan = C.plan("sm90", t, E, K, h, I, schedule=schedule, gemm1=C.Gemm1Config(16, bm, bk, 4, 2, merged, tma=tma,
                                                                                 stacked=stacked),
                  gemm2=C.Gemm2Config(32, 16, 4, 2, merged=merged),
                  form="per_slot" if schedule == "slot" else "grouped_unsplit")
    return dataclasses.replace(plan, **flags)


def _run(gen, t, mode, schedule, routing="balanced", ids_dtype=torch.int64, expert_map=None, h=H, **plan_kw):
    ex, prep = _experts(gen, h)
    x = torch.randn(t, h, generator=gen).half()
    w, ids = make_routing(routing, t, E if expert_map is None else expert_map.numel(), K, gen)
    ids = ids.to(ids_dtype)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=_plan(t, schedule, h, **plan_kw), expert_map=expert_map)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, mode=mode, compute_dtype=torch.float64,
                        expert_map=expert_map)
    return out, ref


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("schedule,t", [("slot", 3), ("grouped", 40)])
def test_schedules_match_reference(gen, schedule, t, mode):
    out, ref = _run(gen, t, mode, schedule)
    assert torch.isfinite(out).all(), "NaN-poisoned output not fully written"
    assert rel_error(out, ref) < moe_tolerance(mode, out.dtype)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("schedule,t,routing,bk", [("slot", 3, "balanced", 256), ("grouped", 40, "same_k", 256),
                                                   ("grouped", 40, "balanced", 128)])
def test_gemm1_weight_tiles_by_tensor_descriptor(gen, schedule, t, routing, bk, mode):
    """Gemm1Config.tma: the words (and at BK = 256 the scales: a TMA box row of 16 bytes) read through tensor
    descriptors of the [E*2I, .] views give the float64 reference's layer; four K tiles, three blocks per hot
    expert, slot and grouped schedules."""
    out, ref = _run(gen, t, mode, schedule, routing, h=1024, bk=bk, tma=True)
    assert torch.isfinite(out).all(), "NaN-poisoned output not fully written"
    assert rel_error(out, ref) < moe_tolerance(mode, out.dtype)


@pytest.mark.parametrize("schedule,t", [("slot", 3), ("grouped", 40)])
def test_gemm1_tensor_descriptor_with_expert_map(gen, schedule, t):
    """Under expert parallelism the descriptors cover this rank's experts only: local ids address their rows;
    a token whose experts are all remote gets an exactly zero row."""
    emap = _emap()
    ex, prep = _experts(gen, 256)
    x = torch.randn(t, 256, generator=gen).half()
    w, ids = make_routing("balanced", t, 16, K, gen)
    ids[0] = torch.tensor([0, 2])  # both experts remote
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, "w4a16", out=out, plan=_plan(t, schedule, 256, bk=256, tma=True),
                     expert_map=emap)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, compute_dtype=torch.float64, expert_map=emap)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    assert rel_error(out, ref) < moe_tolerance("w4a16", out.dtype)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("schedule,t,routing,merged,bm,split", [
    ("grouped", 40, "same_k", True, 16, 1), ("grouped", 40, "zipf2", False, 32, 1), ("slot", 3, "balanced", True, 16, 2)])
def test_gemm1_stacked_gate_and_up_rows(gen, schedule, t, routing, merged, bm, split, mode):
    """Gemm1Config.stacked: the gate and up rows of a tile as one [2*BN, BK] weight tile (one load, one decode, one
    MMA whose accumulator is split in two after the K loop) give the float64 reference's layer: four K tiles of the
    tiled layout's 256-wide runs, three blocks per hot expert, both operand forms, the slot schedule's split K
    reduced by GEMM1's last program."""
    out, ref = _run(gen, t, mode, schedule, routing, h=512, bm=bm, merged=merged, stacked=True,
                    gemm1_split_k=split, gemm1_fused_reduce=split > 1)
    assert torch.isfinite(out).all(), "NaN-poisoned output not fully written"
    assert rel_error(out, ref) < moe_tolerance(mode, out.dtype)


@pytest.mark.parametrize("routing", ["same_k", "one_hot", "zipf2"])
def test_skewed_routing_spans_several_blocks(gen, routing):
    """40 tokens, block 16: a hot expert owns three work-list blocks, the last one partial."""
    out, ref = _run(gen, 40, "w4a16", "grouped", routing, ids_dtype=torch.int32)
    assert rel_error(out, ref) < moe_tolerance("w4a16", out.dtype)


@pytest.mark.parametrize("variant", [dict(merged=False), dict(prep_x=False), dict(bm=32)])
def test_grouped_kernel_forms(gen, variant):
    mode = "w4a16"
    out, ref = _run(gen, 40, mode, "grouped", **variant)
    assert rel_error(out, ref) < moe_tolerance(mode, out.dtype)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("schedule,t", [("grouped", 40), ("slot", 3)])
def test_gemm1_k_tile_of_64(gen, mode, schedule, t):
    """The prefill candidates' 64-wide K tile (eight code columns per decoded set): two K tiles at H = 128."""
    out, ref = _run(gen, t, mode, schedule, bk=64)
    assert torch.isfinite(out).all(), "NaN-poisoned output not fully written"
    assert rel_error(out, ref) < moe_tolerance(mode, out.dtype)


@pytest.mark.parametrize("mode,merged", [("w4a16", True), ("w4a4", False)])
def test_slot_split_k(gen, mode, merged):
    """Split-K needs two K tiles: H = 256."""
    out, ref = _run(gen, 3, mode, "slot", h=256, merged=merged, gemm1_split_k=2)
    assert rel_error(out, ref) < moe_tolerance(mode, out.dtype)


@pytest.mark.parametrize("schedule,t,mode,h,split", [("grouped", 20, "w4a16", 128, 1), ("slot", 2, "w4a4", 256, 2)])
def test_placed_layout_gives_the_split_layouts_operands(gen, schedule, t, mode, h, split):
    """layout="placed" (cheaper decode): the portable twin of its asm decode yields the same fp16 operands as
    the split layout's, so the outputs are equal bit for bit (interpreter: no atomics reordering), and match
    the float64 reference."""
    ex = random_experts(E, h, I, generator=gen)
    x = torch.randn(t, h, generator=gen).half()
    w, ids = make_routing("zipf2", t, E, K, gen)
    plan = _plan(t, schedule, h, gemm1_split_k=split)
    outs = {}
    for layout in ("split", "placed"):
        outs[layout] = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prepare_experts(ex, layout=layout), mode, out=outs[layout], plan=plan)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, mode=mode, compute_dtype=torch.float64)
    assert torch.isfinite(outs["placed"]).all()
    assert torch.equal(outs["placed"], outs["split"])
    assert rel_error(outs["placed"], ref) < moe_tolerance(mode, x.dtype)


@pytest.mark.parametrize("schedule,t,h,bk,tma,split", [
    ("grouped", 40, 512, 128, False, 1),   # two K tiles per 256-wide run
    ("grouped", 20, 1024, 512, False, 1),  # one K tile spans two runs
    ("grouped", 20, 384, 128, False, 1),   # H not a multiple of 256: 128-wide runs
    ("slot", 3, 1024, 256, False, 2),      # split K: each range starts at a run
    ("slot", 2, 512, 128, False, 4),       # split K: ranges start in the middle of a run
    ("slot", 2, 512, 128, True, 1),        # descriptors of the [E*(H/KT)*2I, KT/8] view
    ("slot", 2, 384, 128, True, 1),        # ... with 128-wide runs
    ("grouped", 40, 1024, 256, True, 1),   # ... with the scales by descriptor too
])
def test_tiled_layout_computes_what_the_placed_layout_computes(gen, schedule, t, h, bk, tma, split):
    """layout="tiled" (w13 K-tile-major, layout.tile_k): the same operands as "placed" at the addresses of the
    runs, so the outputs are equal bit for bit (interpreter: no atomics reordering) and match float64; tile
    sizes that divide a run, span runs, and runs of 128 where H is not a multiple of 256."""
    ex = random_experts(E, h, I, generator=gen)
    x = torch.randn(t, h, generator=gen).half()
    w, ids = make_routing("zipf2", t, E, K, gen)
    plan = _plan(t, schedule, h, bk=bk, tma=tma, gemm1_split_k=split)
    outs = {}
    for layout in ("placed", "tiled"):
        prep = prepare_experts(ex, layout=layout)
        outs[layout] = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prep, "w4a16", out=outs[layout], plan=plan)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, compute_dtype=torch.float64)
    assert torch.isfinite(outs["tiled"]).all()
    assert torch.equal(outs["tiled"], outs["placed"])
    assert rel_error(outs["tiled"], ref) < moe_tolerance("w4a16", x.dtype)


@pytest.mark.parametrize("mode", ["w4a4"])  # (W4A16's epilogue is W4A4's without the quantizer; one case: CI time)
def test_slot_split_k_fused_reduce(gen, mode):
    """plan.gemm1_fused_reduce: the last GEMM1 program of each (N tile, slot) reduces the split-K partials
    itself. Bitwise the reduce kernel's result, and the arrival counters are zero again after a call (the
    second call would otherwise reduce too early or never)."""
    from glm5_fp4.kernels import launch as L
    from glm5_fp4.kernels.moe import get_workspace

    ex, prep = _experts(gen, 256)
    x = torch.randn(2, 256, generator=gen).half()
    w, ids = make_routing("balanced", 2, E, K, gen)
    plan = _plan(2, "slot", 256, gemm1_split_k=2, gemm1_fused_reduce=False)
    fused = dataclasses.replace(plan, gemm1_fused_reduce=True)
    assert L.count(fused) == 2 and L.count(plan) == 3
    want = fused_moe_triton(x, w, ids, prep, mode, plan=plan)
    for _ in range(2):
        out = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prep, mode, out=out, plan=fused)
        assert torch.equal(out, want)
        assert not get_workspace(x.device, E, K, 256, I, 2).split_count.any()
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, mode=mode, compute_dtype=torch.float64)
    assert rel_error(out, ref) < moe_tolerance(mode, x.dtype)


@pytest.mark.parametrize("mode,t,n_split,with_map", [("w4a16", 2, 4, False), ("w4a4", 1, 8, False),
                                                     ("w4a16", 2, 8, True)])
def test_gemm2_split_slots(gen, mode, t, n_split, with_map):
    """plan.gemm2_split_slots: one GEMM2 program per (N range, token, slot), the token's k rows added by the last
    to arrive. Bitwise the one-program form (same products, added in slot order), unrolled or not; against float64;
    the arrival counters zero again after each call (a second call would add too early or never); N ranges of
    two tiles (n_split 4 of 8 tiles); with an expert map, remote slots add nothing, and a
    token whose experts are all remote gets an exact zero row."""
    from glm5_fp4.kernels import launch as L

    emap = _emap() if with_map else None
    ex, prep = _experts(gen, 256)
    x = torch.randn(t, 256, generator=gen).half()
    w, ids = make_routing("balanced", t, 16 if with_map else E, K, gen)
    if with_map:
        ids[0] = torch.tensor([0, 2])
        ids[1] = torch.tensor([1, 5])  # one local expert, one remote
    base = _plan(t, "slot", 256, gemm2_n_split=n_split, gemm2_split_slots=False)
    split = dataclasses.replace(base, gemm2_split_slots=True)
    assert L.count(split) == L.count(base)
    (g2,) = [la for la in L.launches(split, _call(x, w, ids, prep, mode, emap)) if la.name == "moe_gemm2_slot_kernel"]
    assert g2.grid == (n_split, t, K) and g2.kwargs["SPLIT_SLOTS"]
    for unroll in (False, True):
        want = fused_moe_triton(x, w, ids, prep, mode, plan=dataclasses.replace(base, gemm2_unroll=unroll),
                                expert_map=emap)
        _arrivals_checked(x, w, ids, ex, prep, mode, emap, split, want)


def _arrivals_checked(x, w, ids, ex, prep, mode, emap, plan, want):
    """``plan`` (a form whose last program to arrive adds a token's rows) gives ``want`` bit for bit twice in a row,
    its arrival counters zero again after each call (a second call would add too early or never); within the float64
    tolerance; under an expert map, token 0 (all its experts remote) exactly zero."""
    from glm5_fp4.kernels.moe import get_workspace

    t, h = x.shape
    for _ in range(2):
        out = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan, expert_map=emap)
        assert torch.equal(out, want)
        assert not get_workspace(x.device, E, K, h, I, t).slot_count.any()
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, mode=mode, compute_dtype=torch.float64,
                        expert_map=emap)
    assert rel_error(out, ref) < moe_tolerance(mode, x.dtype)
    if emap is not None:
        assert out[0].abs().max() == 0


def _call(x, w, ids, prep, mode, emap):
    from glm5_fp4.kernels.moe import make_call

    return make_call(x, w, ids, prep, mode, expert_map=emap)


def _emap(global_e=16, local=(1, 3, 4, 6, 9, 11, 12, 15)):
    m = torch.full((global_e,), -1, dtype=torch.int32)
    m[list(local)] = torch.arange(len(local), dtype=torch.int32)
    return m


@pytest.mark.parametrize("schedule,t,split", [("grouped", 40, 1), ("slot", 3, 1), ("slot", 3, 2)])
def test_expert_parallel_remote_slots(gen, schedule, t, split):
    emap = _emap()
    ex, prep = _experts(gen, 256)
    x = torch.randn(t, 256, generator=gen).half()
    w, ids = make_routing("balanced", t, 16, K, gen)
    ids[0] = torch.tensor([0, 2])  # both experts remote: the row must be exactly zero
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, "w4a16", out=out, plan=_plan(t, schedule, 256, gemm1_split_k=split),
                     expert_map=emap)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, compute_dtype=torch.float64, expert_map=emap)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    assert rel_error(out, ref) < moe_tolerance("w4a16", out.dtype)


def test_parallel_align(gen):
    """plan.parallel_align: many programs count (the last scans and writes the work list), a scatter kernel
    places the slots. Skewed routings with remote slots, twice (the counts and the arrival counter must be
    zero again after a call): the work list and slot grouping against ones computed here, the layer against
    the float64 reference (first call; the second runs the align stage alone)."""
    from glm5_fp4.kernels import launch as L
    from glm5_fp4.kernels.moe import get_workspace

    emap = _emap()
    ex, prep = _experts(gen)
    t = 150  # 300 slots: two counting programs of PAR_BLOCK
    assert L.PAR_BLOCK < t * K <= 2 * L.PAR_BLOCK
    x = torch.randn(t, H, generator=gen).half()
    plan = dataclasses.replace(_plan(t, "grouped"), parallel_align=True)
    assert L.count(plan) == 5
    for stages in (("align", "gemm1", "gemm2"), ("align",)):
        w, ids = make_routing("zipf2", t, 16, K, gen)
        out = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prep, "w4a16", out=out, plan=plan, expert_map=emap, stages=stages)
        ws = get_workspace(x.device, E, K, H, I, t)
        assert not ws.par_counts.any()
        local = emap[ids.flatten().long()]
        counts = torch.bincount(local[local >= 0].long(), minlength=E)
        want = [(ex_, int(counts[:ex_].sum()) + j * 16, min(16, int(counts[ex_]) - j * 16))
                for ex_ in range(E) for j in range(-(-int(counts[ex_]) // 16))]
        got = [tuple(int(v) for v in b[:3]) for b in ws.blocks[: int(ws.num_blocks)]]
        assert got == want
        for ex_, first, n in want:
            assert (local[ws.slots[first:first + n].long()] == ex_).all()
        if len(stages) == 3:
            ref = moe_reference(x.double(), w.double(), ids.long(), ex, compute_dtype=torch.float64, expert_map=emap)
            assert torch.isfinite(out).all()
            assert rel_error(out, ref) < moe_tolerance("w4a16", out.dtype)


@pytest.mark.parametrize("schedule,t", [("grouped", 24), ("slot", 2)])
def test_expert_parallel_rank_without_tokens(gen, schedule, t):
    emap = _emap()
    _, prep = _experts(gen)
    x = torch.randn(t, H, generator=gen).half()
    ids = torch.tensor([[0, 2]] * t)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, torch.rand(t, K, generator=gen), ids, prep, "w4a16", out=out, plan=_plan(t, schedule),
                     expert_map=emap)
    assert (out == 0).all()


# -- rounding helpers ---------------------------------------------------------------------------------

@triton.jit
def _e4m3_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + o, _round_e4m3(tl.load(x_ptr + o, mask=o < n)), mask=o < n)


@triton.jit
def _decode_kernel(c_ptr, y_ptr):
    o = tl.arange(0, 16)
    tl.store(y_ptr + o, _decode_code(tl.load(c_ptr + o)).to(tl.float32))


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, g, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    q, s = _quant_fp4(tl.load(x_ptr + r * C + c), g, R, C)
    tl.store(q_ptr + r * (C // 2) + tl.arange(0, C // 2)[None, :], q)
    tl.store(s_ptr + r * (C // 16) + tl.arange(0, C // 16)[None, :], s.to(tl.uint8, bitcast=True))


def test_kernel_e4m3_rounding_matches_torch(gen):
    grid = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                      torch.rand(4000, generator=gen) * 500, torch.rand(1000, generator=gen) * 0.03])
    y = torch.empty_like(vals)
    _e4m3_kernel[(triton.cdiv(vals.numel(), 1024),)](vals, y, vals.numel(), BLOCK=1024)
    assert torch.equal(y, vals.clamp(max=448).to(torch.float8_e4m3fn).float())


def test_portable_decode_is_exact():
    codes = torch.arange(16, dtype=torch.int32)
    y = torch.empty(16)
    _decode_kernel[(1,)](codes, y)
    assert torch.equal(y * 64, nvfp4.e2m1_decode(codes.to(torch.uint8)))


def test_native_path_activation_quantizer_matches_nvfp4(gen):
    """native_fp4._quant_fp4 (the FP4-MMA path's in-kernel quantizer): codes and scales equal
    glm5_fp4.nvfp4.quantize_activation's, ties and saturation included."""
    r, c = 16, 64
    x = torch.randn(r, c, generator=gen) * 3
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, -0.25, -0.75, -2.5, 0.0, 1.0, 2.0, 4.0])
    g = 448 * 6 / float(x.abs().max())
    q = torch.empty(r, c // 2, dtype=torch.uint8)
    s = torch.empty(r, c // 16, dtype=torch.uint8)
    _quant_kernel[(1,)](x, q, s, g, R=r, C=c)
    codes, scales = nvfp4.quantize_activation(x, g)
    assert torch.equal(s.view(torch.float8_e4m3fn).float(), scales.float())
    assert torch.equal(nvfp4.unpack_fp4(q), codes)


@pytest.mark.parametrize("schedule,t,form,merged", [("grouped", 20, None, False), ("grouped", 20, None, True),
                                                    ("slot", 2, None, True), ("slot", 3, "slot_dedup", True)])
def test_gemm2_takes_whole_experts_k_in_chunks(gen, schedule, t, form, merged):
    """I > GEMM2_MAX_K_CHUNK (whole experts: TP1 and expert parallelism have I = 2048): GEMM2 loops over K
    chunks and GEMM1 stores act in the chunked merged order; here I = 1024, two chunks of 512. Both operand forms
    of the grouped GEMM2 (sm_120's whole-expert tiles are merged, sm_90's eight MMAs)."""
    assert C.gemm2_k_chunk(1024) == 512
    e, h, i, k = 4, 128, 1024, 2
    ex = random_experts(e, h, i, generator=gen)
    prep = prepare_experts(ex)
    x = torch.randn(t, h, generator=gen).half()
    w, ids = make_routing("zipf2", t, e, k, gen)
    plan = C.plan("sm90", t, e, k, h, i, schedule=schedule, gemm1=C.Gemm1Config(16, 16, 128, 4, 2),
                  gemm2=C.Gemm2Config(32, 16, 4, 2, merged=merged), form=form)
    assert plan.slot_dedup == (form == "slot_dedup") and plan.gemm2.merged == merged
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, "w4a16", out=out, plan=plan)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, compute_dtype=torch.float64)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < moe_tolerance("w4a16", out.dtype)


@pytest.mark.parametrize("routing,split", [("balanced", 2), ("same_k", 2), ("one_hot", 2), ("zipf2", 2)])
def test_grouped_split_k(gen, routing, split):
    """Plan.gemm1_split_k on the grouped schedule (opt-in): GEMM1 programs per (block, N tile, K range) store fp32
    partials by sorted position, the reduce adds them in split order and applies SwiGLU; a hot expert's several
    blocks included (40 tokens, block 16)."""
    out, ref = _run(gen, 40, "w4a16", "grouped", routing, h=256, gemm1_split_k=split)
    assert torch.isfinite(out).all(), "NaN-poisoned output not fully written"
    assert rel_error(out, ref) < moe_tolerance("w4a16", out.dtype)


def test_grouped_split_k_equals_unsplit_up_to_fp32_order(gen):
    ex, prep = _experts(gen, 256)
    x = torch.randn(24, 256, generator=gen).half()
    w, ids = make_routing("same_k", 24, E, K, gen)
    outs = []
    for split in (1, 2):
        out = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prep, "w4a16", out=out, plan=_plan(24, "grouped", 256, gemm1_split_k=split))
        outs.append(out.float())
    # the same products summed in another fp32 order, then rounded to fp16 activations: within a few fp16 ulps
    assert (outs[0] - outs[1]).abs().max() <= 4e-3 * outs[0].abs().max()


def test_grouped_split_k_under_expert_parallelism(gen):
    emap = _emap()
    ex, prep = _experts(gen, 256)
    x = torch.randn(20, 256, generator=gen).half()
    w, ids = make_routing("balanced", 20, 16, K, gen)
    ids[0] = torch.tensor([0, 2])  # both experts remote: the row must be exactly zero
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, "w4a16", out=out, plan=_plan(20, "grouped", 256, gemm1_split_k=2),
                     expert_map=emap)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, compute_dtype=torch.float64, expert_map=emap)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    assert rel_error(out, ref) < moe_tolerance("w4a16", out.dtype)


def test_grouped_split_k_refuses_what_it_does_not_serve(gen):
    from glm5_fp4.errors import Glm5Fp4Error

    ex, prep = _experts(gen, 256)
    x = torch.randn(8, 256, generator=gen).half()
    w, ids = make_routing("balanced", 8, E, K, gen)
    with pytest.raises(Glm5Fp4Error, match="grouped GEMM1 split-K 2 needs W4A16"):
        fused_moe_triton(x, w, ids, prep, "w4a4", plan=_plan(8, "grouped", 256, gemm1_split_k=2))
    with pytest.raises(Glm5Fp4Error, match="whole 128-wide K tiles"):
        fused_moe_triton(x, w, ids, prep, "w4a16", plan=_plan(8, "grouped", 256, gemm1_split_k=4))


# -- slot dedup (Plan.slot_dedup, opt-in) -------------------------------------------------------------

@pytest.mark.parametrize("routing,mode,split", [("same_k", "w4a16", 1), ("one_hot", "w4a4", 1), ("zipf2", "w4a16", 2),
                                                ("balanced", "w4a4", 2)])
def test_slot_dedup_matches_reference(gen, routing, mode, split):
    """Each group of slots sharing an expert is computed by its first slot's programs, GEMM1 and GEMM2 alike;
    GEMM2 stores per-slot rows that the finalize adds per token. Skewed routings put all 4 tokens on the same
    experts (groups of 4), balanced ones form groups of one; with split-K the partial sums go by slot id."""
    out, ref = _run(gen, 4, mode, "slot", routing, h=256, gemm1_split_k=split, slot_dedup=True)
    assert torch.isfinite(out).all(), "NaN-poisoned output not fully written"
    assert rel_error(out, ref) < moe_tolerance(mode, out.dtype)


def test_slot_dedup_computes_what_the_slot_form_computes(gen):
    """The same products in the same order (each column's MMA is its own; the k rows added in slot order):
    equal to the per-slot form bit for bit, with the fused split-K reduce too."""
    from glm5_fp4.kernels import launch as L

    ex, prep = _experts(gen, 256)
    x = torch.randn(3, 256, generator=gen).half()
    w, ids = make_routing("same_k", 3, E, K, gen)
    base = _plan(3, "slot", 256, gemm1_split_k=2, gemm1_fused_reduce=True)
    dedup = dataclasses.replace(base, slot_dedup=True)
    assert L.count(dedup) == L.count(base) + 1
    want = fused_moe_triton(x, w, ids, prep, "w4a16", plan=base)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, "w4a16", out=out, plan=dedup)
    assert torch.equal(out, want)


@pytest.mark.parametrize("split,fused", [(1, False), (2, True)])
def test_slot_dedup_groups_longer_than_a_block(gen, split, fused):
    """A group of more slots than GEMM's token block (20 tokens on the same experts, block 16) is walked a block
    at a time; 40 slots round up to 64 in the group search. With GEMM1's split-K reduce fused, each block of the
    group counts its own arrivals (one counter per leader once let the first block's last arrival reduce partial
    sums the other programs had not written yet: NaN)."""
    out, ref = _run(gen, 20, "w4a16", "slot", "same_k", h=256, slot_dedup=True, gemm1_split_k=split,
                    gemm1_fused_reduce=fused)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < moe_tolerance("w4a16", out.dtype)


@pytest.mark.parametrize("split", [1, 2])
def test_slot_dedup_under_expert_parallelism(gen, split):
    """Remote slots are in no group and their rows are skipped by the finalize; a token with only remote
    experts comes out exactly zero."""
    emap = _emap()
    ex, prep = _experts(gen, 256)
    x = torch.randn(4, 256, generator=gen).half()
    w, ids = make_routing("same_k", 4, 16, K, gen)
    ids[1:] = torch.tensor([3, 9])  # three tokens share two local experts
    ids[0] = torch.tensor([0, 2])  # both experts remote
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, "w4a16", out=out,
                     plan=_plan(4, "slot", 256, gemm1_split_k=split, slot_dedup=True), expert_map=emap)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, compute_dtype=torch.float64, expert_map=emap)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    assert rel_error(out, ref) < moe_tolerance("w4a16", out.dtype)


@pytest.mark.parametrize("t,routing,mode,n_split,with_map", [
    (4, "same_k", "w4a16", 4, False), (4, "zipf2", "w4a4", 8, False), (3, "balanced", "w4a16", 8, False),
    (4, "same_k", "w4a16", 2, True), (20, "same_k", "w4a16", 2, False)])
def test_dedup_by_arrival_is_the_finalize_launchs_sum(gen, t, routing, mode, n_split, with_map):
    """plan.dedup_fused_finalize: GEMM2's program that writes the last of a token's k per-slot rows of an N range
    adds them, instead of the finalize launch. The same rows added in the same order: bit for bit the dedup form
    with the finalize launch (skewed routings make groups of up to T slots, balanced ones groups of one; 20 tokens
    on the same experts make groups longer than the 16-token block; N ranges of one to four tiles); against float64;
    the arrival counters zero again after each call (a second call would add too early or never); under an expert
    map a remote slot arrives by its own program and a token whose experts are all remote comes out exactly zero."""
    from glm5_fp4.kernels import launch as L

    emap = _emap() if with_map else None
    ex, prep = _experts(gen, 256)
    x = torch.randn(t, 256, generator=gen).half()
    w, ids = make_routing(routing, t, 16 if with_map else E, K, gen)
    if with_map:
        ids[1:] = torch.tensor([3, 9])  # three tokens share two local experts
        ids[0] = torch.tensor([0, 2])  # both experts remote
        ids[2] = torch.tensor([3, 5])  # one local expert (in the group of 3), one remote
    base = _plan(t, "slot", 256, gemm1_split_k=2, gemm1_fused_reduce=True, slot_dedup=True, gemm2_n_split=n_split)
    fused = dataclasses.replace(base, dedup_fused_finalize=True)
    assert L.count(fused) == L.count(base) - 1 == 2
    names = [la.name for la in L.launches(fused, _call(x, w, ids, prep, mode, emap))]
    assert names == ["moe_gemm1_kernel", "moe_gemm2_grouped_kernel"]
    _arrivals_checked(x, w, ids, ex, prep, mode, emap, fused,
                      fused_moe_triton(x, w, ids, prep, mode, plan=base, expert_map=emap))


@pytest.mark.parametrize("form", ["dedup_by_arrival", "per_slot_split"])
def test_two_launch_forms_at_t4_match_reference(gen, form):
    """The opt-in two-launch forms of T = 3-4 as plan() makes them (sm_90, T = 4 on the same 2 of 8 experts: GEMM1
    split along K with its reduce fused; GEMM2 finalizing by arrival after the dedup, or split by slots without
    it), against float64."""
    ex, prep = _experts(gen, 512)
    x = torch.randn(4, 512, generator=gen).half()
    w, ids = make_routing("same_k", 4, E, K, gen)
    plan = C.plan("sm90", 4, E, K, 512, I, sm_count=16, form=form)
    assert plan.gemm1_fused_reduce and plan.gemm1_split_k > 1
    assert (plan.slot_dedup, plan.dedup_fused_finalize, plan.gemm2_split_slots) == (
        (True, True, False) if form == "dedup_by_arrival" else (False, False, True))
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, "w4a16", out=out, plan=plan)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, compute_dtype=torch.float64)
    assert rel_error(out, ref) < moe_tolerance("w4a16", x.dtype)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("t,bk,routing", [(1, 128, "balanced"), (4, 256, "same_k"), (3, 128, "zipf2")])
def test_x_in_natural_order_is_the_gathered_operand(gen, t, bk, routing, mode):
    """Plan.x_natural (the slot GEMM1 loads x in natural K order and merges the rows in registers; the default with
    slot dedup on sm_90): the same operand as the merged-order gather, so the layer is bit for bit the gathered one's
    (slot schedule with and without dedup, split K), and near float64."""
    h = 512
    ex, prep = _experts(gen, h)
    x = torch.randn(t, h, generator=gen).half()
    w, ids = make_routing(routing, t, E, K, gen)
    plan = dataclasses.replace(C.plan("sm90", t, E, K, h, I, sm_count=16, gemm1=C.Gemm1Config(16, 16, bk, 4, 2)),
                               x_natural=False)
    want = fused_moe_triton(x, w, ids, prep, mode, plan=plan)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=dataclasses.replace(plan, x_natural=True))
    assert torch.equal(out, want)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, mode=mode, compute_dtype=torch.float64)
    assert rel_error(out, ref) < moe_tolerance(mode, x.dtype)


@pytest.mark.parametrize("t,routing,mode,fused", [(4, "same_k", "w4a16", False), (4, "distinct", "w4a4", False),
                                                 (3, "zipf2", "w4a16", True), (4, "one_hot", "w4a16", True),
                                                 (4, "same_k", "w4a4", True)])
def test_dedup_split_picked_from_the_routing(gen, t, routing, mode, fused):
    """Plan.gemm1_split_cap (the slot dedup GEMM1's split-K raised at run time where the routing makes few groups, the
    default on sm_90): bit for bit the plan with that split fixed: the plan's split, or the largest divisor of the K
    tiles (at most dedup_split_max) keeping groups x N tiles x split programs within the cap; near float64; with the
    reduce launch or GEMM1's fused reduce; the compact grid (Plan.gemm1_compact_grid, rows of group and K range found
    from the counted groups) bit for bit the full one (a program per slot and K range of the largest split)."""
    h = 512
    ex, prep = _experts(gen, h)
    x = torch.randn(t, h, generator=gen).half()
    w, ids = make_routing("balanced" if routing == "distinct" else routing, t, E, K, gen)
    if routing == "distinct":  # every slot on its own expert: 8 groups, the most this layer can have
        ids = torch.randperm(E, generator=gen)[: t * K].reshape(t, K).to(ids.dtype)
    # 64 SMs and 64-wide K tiles: the plan splits K 4 ways, a call with few groups raises it to 8, one whose plan
    # split overfills a wave lowers it (down to the floor, 1: 8 K tiles a program)
    sm_count, bk = 64, 64
    plan = C.plan("sm90", t, E, K, h, I, sm_count=sm_count, gemm1=C.Gemm1Config(16, 16, bk, 4, 2))
    # (``fused``: GEMM1's last program of each tile reduces, counting the run-time split's arrivals)
    plan = dataclasses.replace(plan, gemm1_fused_reduce=fused)
    cap = C.SLOT_SPLIT_PROGRAMS_PER_SM * sm_count
    assert plan.slot_dedup and plan.gemm1_split_cap == cap
    # no routing could raise the split on 2 SMs: the plan keeps its own
    assert C.plan("sm90", t, E, K, h, I, sm_count=2, gemm1=plan.gemm1).gemm1_split_cap == 0
    k_tiles, groups = h // bk, len(set(ids.flatten().tolist()))
    most = C.dedup_split_max(h, bk, I // 16, K, cap)
    assert most > plan.gemm1_split_k
    want_split = max([s for s in range(plan.gemm1_split_floor or plan.gemm1_split_k, most + 1)
                      if k_tiles % s == 0 and groups * (I // 16) * s <= cap], default=plan.gemm1_split_k)
    fixed = dataclasses.replace(plan, gemm1_split_cap=0, gemm1_split_k=want_split, gemm1_compact_grid=False,
                                gemm1_split_floor=0)
    assert plan.gemm1_compact_grid
    from glm5_fp4.kernels.moe import get_workspace

    # GEMM1 writes partial sums of exactly the picked split's ranges (the output alone may not tell splits apart:
    # fp16 rounds away their different fp32 summation orders); each leader slot's rows, in poisoned ranges
    part = get_workspace(x.device, E, K, h, I, t).part
    part.fill_(float("nan"))
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan)
    slots = t * K
    ranges = part[: most * slots * 2 * I].view(most, slots, 2 * I)
    flat = ids.flatten().tolist()
    leaders = [s for s in range(slots) if flat[s] not in flat[:s]]
    written = [int(r) for r in range(most) if torch.isfinite(ranges[r, leaders]).all()]
    assert written == list(range(want_split)), (written, want_split)
    assert torch.equal(out, fused_moe_triton(x, w, ids, prep, mode, plan=fixed))
    full = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=full, plan=dataclasses.replace(plan, gemm1_compact_grid=False))
    assert torch.equal(out, full)
    assert routing != "same_k" or want_split > plan.gemm1_split_k  # (the case that raises it)
    assert routing != "distinct" or want_split < plan.gemm1_split_k  # (the one that lowers it: 8 groups x 8 N tiles
    # x 4 = 256 programs over the cap of 192, 2 ranges fit)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, mode=mode, compute_dtype=torch.float64)
    assert rel_error(out, ref) < moe_tolerance(mode, x.dtype)


@triton.jit
def _group_kernel(ids_ptr, emap_ptr, count_ptr, rows_ptr, SP: tl.constexpr, BM: tl.constexpr, HAS_MAP: tl.constexpr):
    s = tl.program_id(0)
    _, count, same, rank = _slot_group(s, ids_ptr, emap_ptr, tl.num_programs(0), SP, HAS_MAP)
    tl.store(count_ptr + s, count)
    offs_m = tl.arange(0, BM)
    tl.store(rows_ptr + s * BM + offs_m, tl.where(offs_m < count, _group_slots(offs_m, same, rank, SP), -1))


@pytest.mark.parametrize("with_map", [False, True])
def test_slot_groups_have_one_leader_each(gen, with_map):
    """The first slot of each expert leads a group of every slot routed to that expert, in slot order; every
    other slot (and every remote one) leads none. Checked against groups formed here."""
    emap = _emap() if with_map else None
    n_exp = 16 if with_map else E
    _, ids = make_routing("zipf2", 12, n_exp, K, gen)
    ids[:2] = torch.tensor([[1, 3], [1, 4]])  # one group of two for certain (1, 3, 4 are local under the map)
    ids = ids.to(torch.int32).flatten().contiguous()
    n = ids.numel()
    count = torch.full((n,), -7, dtype=torch.int32)
    rows = torch.full((n, 32), -7, dtype=torch.int32)
    _group_kernel[(n,)](ids, emap if with_map else ids, count, rows, SP=32, BM=32, HAS_MAP=with_map)
    local = emap[ids.long()] if with_map else ids
    want_count, want_rows = [], []
    for s in range(n):
        members = [j for j in range(n) if local[j] == local[s]] if local[s] >= 0 else []
        lead = bool(members) and members[0] == s
        want_count.append(len(members) if lead else 0)
        want_rows.append((members if lead else []) + [-1] * (32 - (len(members) if lead else 0)))
    assert count.tolist() == want_count
    assert rows.tolist() == want_rows
    assert sum(want_count) == int((local >= 0).sum()) and max(want_count) > 1


@pytest.mark.parametrize("form", [None, "sm120_former"])
@pytest.mark.parametrize("t,routing,mode", [(1, "balanced", "w4a16"), (2, "same_k", "w4a4"), (4, "one_hot", "w4a16"),
                                            (40, "same_k", "w4a16"), (300, "zipf1.2", "w4a4")])
def test_sm120_plans_match_reference(gen, t, routing, mode, form):
    """sm_120's own plans (its tiles, schedule rules and 188 SMs, as an RTX PRO 6000 would launch them; "sm120_former":
    the tables before the H200 stand-in picked them), which no other test here runs: the GPU suite plans for its own
    arch and the cases above pin sm_90 plans. 16 experts, H = 512: each tile sees several K tiles and blocks."""
    e, h, i, k = 16, 512, 128, 4
    ex = random_experts(e, h, i, generator=gen)
    prep = prepare_experts(ex)
    plan = C.plan("sm120", t, e, k, h, i, sm_count=C.sm_count_guess("sm120"), mode=mode, form=form)
    x = torch.randn(t, h, generator=gen).half()
    w, ids = make_routing(routing, t, e, k, gen)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, mode, out=out, plan=plan)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, mode=mode, compute_dtype=torch.float64)
    assert torch.isfinite(out).all(), "NaN-poisoned output not fully written"
    assert rel_error(out, ref) < moe_tolerance(mode, out.dtype), plan


@pytest.mark.parametrize("arch,t,routing,bm", [("sm100", 2, "same_k", 16), ("sm90", 100, "balanced", 32),
                                               ("sm100", 100, "zipf1.2", 32), ("sm90", 340, "zipf1.2", 128)])
def test_w4a4_tiles_of_sm90_sm100_match_reference(gen, arch, t, routing, bm):
    """The W4A4 GEMM1 tiles sm_90 / sm_100 take where the W4A16 ones spill (configs._W4A4_GEMM1: the uncapped slot
    tile on sm_100, 64x32x128 in 4 stages, 64x128x128 on 8 warps), in the picker's own plans against the float64
    reference: 16 experts, H = 512 (four K tiles of 128), skewed and balanced routings, NaN-poisoned outputs."""
    e, h, i, k = 16, 512, 128, 4
    ex = random_experts(e, h, i, generator=gen)
    prep = prepare_experts(ex)
    plan = C.plan(arch, t, e, k, h, i, mode="w4a4")
    assert plan.gemm1 == C._W4A4_GEMM1[arch][(plan.schedule, bm)]
    x = torch.randn(t, h, generator=gen).half()
    w, ids = make_routing(routing, t, e, k, gen)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w, ids, prep, "w4a4", out=out, plan=plan)
    ref = moe_reference(x.double(), w.double(), ids.long(), ex, mode="w4a4", compute_dtype=torch.float64)
    assert torch.isfinite(out).all(), "NaN-poisoned output not fully written"
    assert rel_error(out, ref) < moe_tolerance("w4a4", out.dtype), plan


@pytest.mark.parametrize("t", [2, 6])
def test_a_column_major_x_gives_row_major_results(gen, t):
    """fused_moe allocated out with empty_like(x): a transposed x made a transposed out, and the kernels (rows
    contiguous) wrote each token's row down a column (error 4.2 on outputs of 1.8)."""
    from glm5_fp4.kernels import fused_moe

    ex, prep = _experts(gen)
    x = torch.randn(H, t, generator=gen).half().t()
    w, ids = make_routing("balanced", t, E, K, gen)
    got = fused_moe(x, w, ids, prep)
    want = moe_reference(x.double(), w.double(), ids.long(), ex, compute_dtype=torch.float64)
    assert got.is_contiguous() and rel_error(got, want) < moe_tolerance("w4a16", torch.float16)


@pytest.mark.parametrize("bad", [E, -1, -2])
def test_ids_the_kernels_cannot_index_are_refused_before_they_run(gen, bad):
    """An id past the experts segfaulted; -1 without an expert map corrupted the heap (the kernels skip a slot only
    through a map). Host tensors are checked; on a GPU the engines' routers are trusted (a check would synchronise)."""
    ex, prep = _experts(gen)
    x = torch.randn(6, H, generator=gen).half()
    w, ids = make_routing("balanced", 6, E, K, gen)
    ids[2, 1] = bad
    with pytest.raises(Exception, match="topk_ids"):
        fused_moe_triton(x, w, ids, prep, "w4a16")
