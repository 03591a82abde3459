"""Static checks of the MoE kernel tile configurations: shared memory per arch, tiling of GLM-5 shapes, and
(ahead-of-time, no GPU) Triton's own shared-memory/register figures for SM120 and the native FP4 MMA."""

import dataclasses
import json
from pathlib import Path

import pytest

from glm5_fp4.kernels import configs as C
from glm5_fp4.spec import Glm5Spec

SM120_LIMIT = 101_376  # 99 KB opt-in maximum per block on RTX PRO 6000 / RTX 5090


def test_sm120_limit_is_the_documented_one():
    assert C.smem_limit("sm120") == SM120_LIMIT


@pytest.mark.parametrize("arch", ["sm80", "sm90", "sm100", "sm120"])
def test_every_config_fits_shared_memory(arch):
    g1s, g2s = C.all_configs(arch)
    limit = C.smem_limit(arch)
    for cfg in g1s:
        assert C.gemm1_smem_bytes(cfg) <= limit, (arch, cfg, C.gemm1_smem_bytes(cfg))
    for cfg in g2s:
        for intermediate in (256, 512):  # GLM-5 TP8 and TP4 shards
            need = C.gemm2_smem_bytes(cfg, intermediate)
            assert need <= limit, (arch, cfg, intermediate, need)


@pytest.mark.parametrize("arch", ["sm80", "sm90", "sm100", "sm120"])
@pytest.mark.parametrize("tp", [4, 8])
def test_plans_tile_glm5_shapes(arch, tp):
    spec = Glm5Spec()
    h, i = spec.hidden_size, spec.moe_intermediate_size // tp
    for t in (1, 2, 3, 4, 5, 16, 64, 100, 512, 1000, 4096, 8192):
        p = C.plan(arch, t, spec.n_routed_experts, spec.num_experts_per_tok, h, i)
        assert i % p.gemm1.bn == 0 and h % p.gemm1.bk == 0 and p.gemm1.bk // 8 >= 16
        assert h % p.gemm2.bn == 0 and (h // p.gemm2.bn) % p.gemm2_n_split == 0
        assert p.schedule == ("slot" if t <= C.SLOT_MAX_TOKENS[arch] else "grouped")


@pytest.mark.parametrize("arch", ["sm80", "sm90", "sm100", "sm120"])
@pytest.mark.parametrize("tp", [1, 4, 8])
def test_picked_plans_fit_shared_memory(arch, tp):
    """Whole experts (TP1, expert parallelism: I = 2048) too: GEMM2 then walks K in chunks and pipelines the
    activation tile as well (the H200 TP1 server died at a prefill on a 270,336-byte GEMM2, 2026-12-01)."""
    spec = Glm5Spec()
    h, i = spec.hidden_size, spec.moe_intermediate_size // tp
    limit = C.smem_limit(arch)
    for t in (1, 4, 16, 64, 512, 1024, 2048, 4096, 8192, 16384):
        p = C.plan(arch, t, spec.n_routed_experts, spec.num_experts_per_tok, h, i)
        assert C.gemm1_smem_bytes(p.gemm1) <= limit, (t, p.gemm1)
        assert C.gemm2_smem_bytes(p.gemm2, i) <= limit, (t, p.gemm2, C.gemm2_smem_bytes(p.gemm2, i))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_gemm2_defaults_follow_the_intermediate_size(arch):
    """Prefill GEMM2 tiles are picked per shard width: the TP8 shard (I = 256) the shards' table, the TP4 shard
    (I = 512) its own 128-row tiles, whole experts (I = 2048) theirs; at 32-token blocks (T=512) the TP8 shard
    runs 4-warp 64x32 tiles in 6 programs along H, the others the former 8-warp 128x32 tiles (H200, 2026-12-03)."""
    spec = Glm5Spec()
    h, e, k = spec.hidden_size, spec.n_routed_experts, spec.num_experts_per_tok
    g2 = {tp: {t: C.plan(arch, t, e, k, h, spec.moe_intermediate_size // tp).gemm2 for t in (512, 2048, 8192)}
          for tp in (1, 4, 8)}
    assert g2[8][8192] == C._DEFAULT_GEMM2[arch][("grouped", 128)] and g2[8][8192].n_split == 6
    assert (g2[4][2048].bn, g2[4][2048].bm, g2[4][8192].bn, g2[4][8192].bm) == (128, 64, 128, 64)
    assert g2[1][8192].bm == 64 and g2[1][8192].num_stages == 2  # the whole-expert tile, fitted to shared memory
    assert g2[8][512] == C._DEFAULT_GEMM2[arch][("grouped", 32)] and (g2[8][512].bn, g2[8][512].n_split) == (64, 6)
    assert g2[4][512] == g2[1][512] == C.OPT_IN["gemm2_128x32"].change["gemm2"]
    assert len({g2[1][8192], g2[4][8192], g2[8][8192]}) == 3


def test_parallel_align_from_its_threshold_in_the_grouped_schedule_only():
    spec = Glm5Spec()
    h, i, e, k = spec.hidden_size, spec.moe_intermediate_size // 8, spec.n_routed_experts, spec.num_experts_per_tok
    lo = C.PARALLEL_ALIGN_MIN_TOKENS
    assert not C.plan("sm90", lo - 1, e, k, h, i).parallel_align and C.plan("sm90", lo, e, k, h, i).parallel_align
    assert not C.plan("sm90", 2, e, k, h, i).parallel_align
    # the replaced form stays reachable by name, and changes the plan where the default uses the parallel form
    assert not C.plan("sm90", 4096, e, k, h, i, form="serial_align").parallel_align
    assert C.plan("sm90", 512, e, k, h, i, form="parallel_align").parallel_align


def test_bm_grows_with_tokens_per_expert():
    bms = [C.pick_bm(t, 256, 8) for t in (1, 16, 256, 512, 1024, 4096)]
    assert bms == sorted(bms) and bms[0] == 16 and bms[-1] == 128


def _aot_available():
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.mark.skipif(not _aot_available(), reason="Triton's NVIDIA backend (with ptxas) is not installed")
@pytest.mark.parametrize("which", ["gemm1", "gemm2"])
def test_sm120_default_kernel_compiles_within_limits(which):
    """Compile the default SM120 grouped configs for sm_120 on this CPU and read Triton's metadata."""
    from glm5_fp4.sm120.aot import compile_gemm1, compile_gemm2

    spec = Glm5Spec()
    i = spec.moe_intermediate_size // 4
    p = C.plan("sm120", 512, spec.n_routed_experts, spec.num_experts_per_tok, spec.hidden_size, i)
    if which == "gemm1":
        c = compile_gemm1(p.gemm1, 120, spec.hidden_size, i)
        estimate = C.gemm1_smem_bytes(p.gemm1)
    else:
        c = compile_gemm2(p.gemm2, 120, spec.hidden_size, i, n_split=p.gemm2_n_split)
        estimate = C.gemm2_smem_bytes(p.gemm2, i)
    assert 0 < c.shared_bytes <= min(estimate, SM120_LIMIT), (c.shared_bytes, estimate)
    assert "mma.sync.aligned" in c.ptx  # SM120 has no wgmma: warp-level MMA
    if c.registers is not None:
        assert c.registers <= 255 and c.spill_store_bytes == 0, c


@pytest.mark.skipif(not _aot_available(), reason="Triton's NVIDIA backend (with ptxas) is not installed")
@pytest.mark.parametrize("cc,cfg,intermediate", [
    (90, C.Gemm2Config(128, 64, 8, 3, merged=False), 2048),  # what killed the TP1 server: Triton 3.6 says 270,336 B
    (90, C.Gemm2Config(64, 16, 4, 3, merged=False), 2048),
    (90, C.Gemm2Config(128, 64, 8, 3, merged=False), 256),
    # eight MMAs per tile, which Triton 3.8 feeds through shared memory (triton_stages_mma_sets): 167,936 B there
    (120, C.Gemm2Config(128, 16, 4, 2, merged=False), 512),
    (120, C.Gemm2Config(64, 16, 4, 2, merged=False), 512),
    (120, C.Gemm2Config(64, 16, 4, 2, merged=True), 512),
])
def test_gemm2_estimate_bounds_tritons_figure(cc, cfg, intermediate):
    """Under the installed Triton: `make test` runs it with .venv's and with the engines' (Makefile, ENGINE_TRITON_TESTS)."""
    from glm5_fp4.sm120.aot import compile_gemm2

    c = compile_gemm2(cfg, cc, 6144, intermediate, n_split=3)
    assert 0 < c.shared_bytes <= C.gemm2_smem_bytes(cfg, intermediate), (c.shared_bytes, C.gemm2_smem_bytes(cfg, intermediate))


FORMS = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("gemm2_forms_triton*.json"))


@pytest.mark.parametrize("path", FORMS, ids=[p.stem for p in FORMS])
def test_the_shared_memory_estimate_bounds_each_tritons_gemm2(path):
    """Compile-free, so in any venv: the AOT figures of both GEMM2 forms under Triton 3.6, 3.7.1, 3.8 and 3.9
    (benchmarks/gemm2_forms_by_triton.py) against the estimate for that version, which must bound every one of
    them (Triton 3.8's eight-MMA form is 2.4x larger at 64x16, I = 512; over-estimates only shrink a plan)."""
    data = json.loads(path.read_text())
    version, rows = data["meta"]["triton"], [r for r in data["rows"] if "shared_bytes" in r]
    assert len(rows) == len(data["rows"]) >= 48
    for r in rows:
        cfg = C.Gemm2Config(r["bn"], r["bm"], r["num_warps"], r["num_stages"], merged=r["merged"])
        est = C.gemm2_smem_bytes(cfg, r["intermediate"], triton_version=version)
        assert r["shared_bytes"] <= est, (version, r, est)


def test_the_gemm2_forms_cover_a_triton_that_stages_the_operand_sets_and_ones_that_do_not():
    staged = [C.triton_stages_mma_sets(json.loads(p.read_text())["meta"]["triton"]) for p in FORMS]
    assert len(FORMS) >= 4 and any(staged) and not all(staged), FORMS


@pytest.mark.skipif(not _aot_available(), reason="Triton's NVIDIA backend (with ptxas) is not installed")
@pytest.mark.parametrize("cc,arch,marker", [(120, "sm120", "kind::mxf4nvf4.block_scale.scale_vec::4X"),
                                            (100, "sm100", "kind::mxf4nvf4.block_scale.block16")])
def test_native_fp4_kernels_lower_to_the_fp4_block_scaled_mma(cc, arch, marker):
    """The unverified native path at least compiles to the FP4 x FP4 E4M3-scaled tensor-core instruction, under
    .venv's Triton and the engines' (make test runs it in both: Triton 3.8 failed sm_100's GEMM2 in its
    TritonGPUOptimizeAccumulatorInit pass, 2026-12-06)."""
    from glm5_fp4.sm120.aot import compile_native

    builds = compile_native(arch)
    assert len(builds) == 2
    for k in builds:
        assert marker in k.ptx, k.kernel
        assert k.shared_bytes <= C.smem_limit(arch)


def test_grouped_split_k_launches_a_reduce_after_gemm1():
    """Plan.gemm1_split_k on the grouped schedule (the TP8 shard's default at T <= 64): GEMM1's grid gains the K ranges, the split-K reduce follows it
    (rows = sorted positions, no expert lookup), and the launch count says five."""
    import dataclasses

    import torch

    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.launch import MoECall, count, launches
    from glm5_fp4.kernels.moe import Workspace
    from glm5_fp4.sm120 import launches as SL

    shape = {s.name: s for s in SL.shape_classes()}["tp8"]
    prep = SL.meta_prepared(shape, layout="placed")
    meta, t, k = torch.device("meta"), 16, 8
    x = torch.empty(t, prep.hidden_size, dtype=torch.bfloat16, device=meta)
    call = MoECall(x, torch.empty(t, k, device=meta), torch.empty(t, k, dtype=torch.int32, device=meta), prep, "w4a16",
                   torch.empty_like(x), Workspace(meta, prep.num_experts, k, prep.hidden_size, prep.intermediate_size, t))
    dims = (prep.num_experts, k, prep.hidden_size, prep.intermediate_size)
    base = C.plan("sm90", t, *dims, sm_count=132, form="grouped_unsplit")
    assert base.schedule == "grouped" and base.gemm1_split_k == 1
    split = dataclasses.replace(base, gemm1_split_k=4)
    assert C.plan("sm90", t, *dims, sm_count=132) == split  # the default at the TP8 shard
    names = [ln.name for ln in launches(split, call)]
    assert names == ["moe_align_kernel", "moe_gemm1_kernel", "moe_splitk_reduce_kernel", "moe_gemm2_grouped_kernel",
                     "moe_finalize_kernel"] and count(split) == 5 == len(names) and count(base) == 4
    g1 = launches(split, call)[1]
    assert g1.grid[2] == 4 and g1.kwargs["SPLIT_K"] == 4 and g1.args[11] == t * k * 2 * prep.intermediate_size
    red = launches(split, call)[2]
    assert red.grid[0] == t * k and not red.kwargs["HAS_MAP"] and not red.kwargs["W4A4"]


def _meta_tp8_call(t: int = 4, k: int = 8):
    """A TP8-shard call on meta tensors (nothing allocated): what launches() plans for, and (t, k, e, h, i)."""
    import torch

    from glm5_fp4.kernels.launch import MoECall
    from glm5_fp4.kernels.moe import Workspace
    from glm5_fp4.sm120 import launches as SL

    shape = {s.name: s for s in SL.shape_classes()}["tp8"]
    prep = SL.meta_prepared(shape, layout="placed")
    meta = torch.device("meta")
    e, h, i = prep.num_experts, prep.hidden_size, prep.intermediate_size
    x = torch.empty(t, h, dtype=torch.bfloat16, device=meta)
    call = MoECall(x, torch.empty(t, k, device=meta), torch.empty(t, k, dtype=torch.int32, device=meta), prep, "w4a16",
                   torch.empty_like(x), Workspace(meta, e, k, h, i, t))
    return call, (t, k, e, h, i)


def test_dedup_grid_and_split_forms_refused_where_they_do_not_apply():
    """The launcher names the plan when its run-time split or compact grid cannot run: a compact GEMM1 grid needs
    the split picked at run time (its rows follow it), which needs the slot dedup."""
    import dataclasses

    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.launch import launches

    call, (t, k, e, h, i) = _meta_tp8_call()
    plan = C.plan("sm90", t, e, k, h, i, sm_count=132)
    with pytest.raises(Glm5Fp4Error, match="compact grid needs its split picked at run time"):
        launches(dataclasses.replace(plan, gemm1_split_cap=0), call)
    with pytest.raises(Glm5Fp4Error, match="split picked at run time is a form of the slot dedup"):
        launches(dataclasses.replace(plan, slot_dedup=False), call)


def test_slot_dedup_launches_gemm2_per_slot_group_and_a_k_row_finalize():
    """Plan.slot_dedup (the default at T = 3-4): GEMM1 keeps the slot grid with DEDUP on; GEMM2 is the grouped kernel over
    (slot, N range) storing per-slot rows, split along H for the experts a call touches (not per token); the
    finalize adds k rows per token; one launch more than the slot form."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.launch import count, launches

    call, (t, k, e, h, i) = _meta_tp8_call()
    base = C.plan("sm90", t, e, k, h, i, sm_count=132, form="per_slot")
    dedup = C.plan("sm90", t, e, k, h, i, sm_count=132)
    assert base.schedule == "slot" and not base.slot_dedup and dedup.slot_dedup and not dedup.gemm2_unroll
    n_tiles = h // dedup.gemm2.bn
    assert dedup.gemm2_n_split == C.pick_n_split(n_tiles, min(C.expected_active_experts(t, e, k), t * k), 132)
    assert dedup.gemm2_n_split < base.gemm2_n_split  # 32 groups share the GPU, not 4 tokens
    todo = launches(dedup, call)
    names = [ln.name for ln in todo]
    tail = ["moe_gemm2_grouped_kernel", "moe_finalize_kernel"]
    assert names == ["moe_gemm1_kernel"] + (["moe_splitk_reduce_kernel"] if dedup.gemm1_split_k > 1 else []) + tail
    assert count(dedup) == len(names) == count(base) + 1
    g1, g2, fin = todo[0], todo[-2], todo[-1]
    # the split is picked at run time from the routing (Plan.gemm1_split_cap): the plan's 4, raised, or lowered to fit
    # one wave down to the floor (3: 8 K tiles a program); GEMM1 and the reduce with the same constexprs; GEMM1's
    # compact grid holds only the (group, K range) rows some routing uses: the cap's where the split fits one wave
    # (396 // 4 N tiles), every slot's group at the plan's split otherwise (32 x 4)
    most = C.dedup_split_max(h, dedup.gemm1.bk, i // dedup.gemm1.bn, k, dedup.gemm1_split_cap)
    cap = C.SLOT_SPLIT_PROGRAMS_PER_SM * 132
    assert dedup.gemm1_split_cap == cap and most == 12 > dedup.gemm1_split_k == 4
    assert dedup.gemm1_split_floor == 3 == C.dedup_split_floor(h, 256)
    n1 = i // dedup.gemm1.bn
    assert dedup.gemm1_compact_grid and g1.grid == (n1, max(cap // n1, t * k * 4), 1) == (4, 128, 1)
    assert g1.kwargs["DEDUP"] and g1.kwargs["SP"] == 32 and (g1.kwargs["DEDUP_ROWS"], g1.kwargs["NSLOTS"]) == (128, 32)
    split_kw = ("SPLIT_K", "SPLIT_MIN", "SPLIT_FLOOR", "SPLIT_CAP")
    assert tuple(g1.kwargs[n] for n in split_kw) == (most, 4, 3, cap)
    red = todo[1].kwargs
    assert tuple(red[n] for n in split_kw) + (red["KT"],) == (most, 4, 3, cap, h // 256)
    # the full grid (opt-in dedup_grid_full): a program per (N tile, slot, K range of the largest split)
    full = C.plan("sm90", t, e, k, h, i, sm_count=132, form="dedup_grid_full")
    assert not full.gemm1_compact_grid and launches(full, call)[0].grid == (n1, t * k, most)
    assert "DEDUP_ROWS" not in launches(full, call)[0].kwargs
    # the former rule (opt-in dedup_split_raise) never lowers it; the fixed form keeps it
    raise_ = C.plan("sm90", t, e, k, h, i, sm_count=132, form="dedup_split_raise")
    assert (raise_.gemm1_split_k, raise_.gemm1_split_cap, raise_.gemm1_split_floor) == (4, cap, 0)
    assert launches(raise_, call)[0].kwargs["SPLIT_FLOOR"] == 4
    fixed = C.plan("sm90", t, e, k, h, i, sm_count=132, form="dedup_split_fixed")
    assert fixed.gemm1_split_cap == 0 and not fixed.gemm1_compact_grid
    assert launches(fixed, call)[0].grid[2] == 4 == fixed.gemm1_split_k
    assert g2.grid == (t * k, dedup.gemm2_n_split) and g2.kwargs["SLOT_DEDUP"] and g2.kwargs["SP"] == 32
    assert fin.grid[0] == t and fin.kwargs["ROWS"] == k
    assert C.plan("sm90", 64, e, k, h, i, sm_count=132, form="slot_dedup").slot_dedup is False  # grouped: no effect


@pytest.mark.parametrize("t", [2, 3, 4])
def test_dedup_by_arrival_launches_two_kernels(t):
    """The opt-in "dedup_by_arrival" (Plan.dedup_fused_finalize): the slot dedup in two launches, GEMM1 with its K
    split by pick_slot_split_k and the reduce fused (as where GEMM2 is split by slots), the grouped GEMM2 over (slot,
    N range) with ARRIVE_K = k, the output and the per-(token, N range) counters, and no finalize; PDL on both. Refused
    without slot dedup, and where the workspace holds fewer counters than T x N ranges."""
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.kernels.launch import count, launches

    call = _meta_call("tp8", t, use_asm=True)
    p = call.prepared
    dims = (p.num_experts, 8, p.hidden_size, p.intermediate_size)
    plan = C.plan("sm90", t, *dims, sm_count=132, form="dedup_by_arrival")
    g1_cfg = plan.gemm1
    want_split = C.pick_slot_split_k((dims[3] // g1_cfg.bn) * t * 8, dims[2] // g1_cfg.bk, 132)
    assert plan.slot_dedup and plan.dedup_fused_finalize and not plan.gemm2_split_slots and plan.pdl
    assert plan.gemm1_split_k == want_split > 1 and plan.gemm1_fused_reduce
    todo = launches(plan, call)
    assert [ln.name for ln in todo] == ["moe_gemm1_kernel", "moe_gemm2_grouped_kernel"] and count(plan) == 2
    g1, g2 = todo
    assert g1.kwargs["DEDUP"] and g1.kwargs["FUSED_REDUCE"] and g1.grid == (dims[3] // g1_cfg.bn, t * 8, want_split)
    assert g2.grid == (t * 8, plan.gemm2_n_split) and g2.kwargs["SLOT_DEDUP"] and g2.kwargs["ARRIVE_K"] == 8
    assert g2.args[12] is call.out and g2.args[14] is call.workspace.slot_count
    assert all(ln.kwargs.get("launch_pdl") for ln in todo)
    default = C.plan("sm90", t, *dims, sm_count=132)
    assert not default.dedup_fused_finalize and not launches(default, call)[-1].kwargs.get("ARRIVE_K", 0)
    with pytest.raises(Glm5Fp4Error, match="form of the slot dedup"):
        launches(dataclasses.replace(plan, slot_dedup=False), call)
    ws = call.workspace
    ws.slot_count = ws.slot_count[:plan.gemm2_n_split * t - 1]
    with pytest.raises(Glm5Fp4Error, match="arrivals per token"):
        launches(plan, call)


@pytest.mark.parametrize("t", [3, 4])
def test_per_slot_split_form_runs_t4_as_t2_runs(t):
    """The opt-in "per_slot_split" at T = 3-4: no dedup, GEMM2 split by slots over (N ranges, T, k), GEMM1's K split by
    pick_slot_split_k with the reduce fused, PDL: the two launches of the T <= 2 default; at T <= 2 it changes
    nothing; sm_120 keeps its default."""
    from glm5_fp4.kernels.launch import launches

    call = _meta_call("tp8", t, use_asm=True)
    p = call.prepared
    dims = (p.num_experts, 8, p.hidden_size, p.intermediate_size)
    plan = C.plan("sm90", t, *dims, sm_count=132, form="per_slot_split")
    assert not plan.slot_dedup and plan.gemm2_split_slots and plan.gemm1_fused_reduce and plan.pdl
    assert plan.gemm1_split_k == C.pick_slot_split_k((dims[3] // plan.gemm1.bn) * t * 8, dims[2] // plan.gemm1.bk, 132)
    g1, g2 = launches(plan, call)
    assert g2.name == "moe_gemm2_slot_kernel" and g2.grid == (plan.gemm2_n_split, t, 8) and g2.kwargs["SPLIT_SLOTS"]
    assert C.plan("sm90", 2, *dims, sm_count=132, form="per_slot_split") == C.plan("sm90", 2, *dims, sm_count=132)
    assert C.plan("sm120", t, *dims, sm_count=188, form="per_slot_split") == C.plan("sm120", t, *dims, sm_count=188)


@pytest.mark.parametrize("arch,sms", [("sm90", 132), ("sm120", 188)])
def test_default_forms_are_sized_for_skewed_routing(arch, sms):
    """The plan is fixed per batch size before the routing is known (CUDA graphs), so it is sized for skew
    (configs.SLOT_DEDUP_MIN_TOKENS, pick_grouped_split_k; H200 2026-12-02): one program group per expert at
    T = 3-4, never at T <= 2; grouped GEMM1 split along K (W4A16, T <= 64) until the all-on-k work list fills the
    SMs: the TP8 shard (I/BN = 4 tiles per expert) in 4, never whole experts (TP1: 32 tiles x 8 experts > SMs);
    W4A4 never (the launcher refuses it), nor past T = 64."""
    from glm5_fp4.kernels import configs as C

    dims = {"tp8": (256, 8, 6144, 256), "tp4": (256, 8, 6144, 512), "tp1": (256, 8, 6144, 2048)}
    for t in (1, 2, 3, 4):
        for name, d in dims.items():
            p = C.plan(arch, t, *d, sm_count=sms)
            assert p.schedule == "slot" and p.slot_dedup == (t >= 3), (name, t)
            assert C.plan(arch, t, *d, sm_count=sms, form="per_slot").slot_dedup is False
            if t <= 2:
                assert C.plan(arch, t, *d, sm_count=sms, form="slot_dedup").slot_dedup
    for t in (8, 16, 64, 65, 512):
        for name, d in dims.items():
            p = C.plan(arch, t, *d, sm_count=sms)
            tiles = d[3] // p.gemm1.bn
            want = 1
            while t <= C.GROUPED_SPLIT_K_MAX_TOKENS and want < C.SPLIT_K_MAX and 8 * tiles * want < sms \
                    and C.split_k_fits(want * 2, 6144, p.gemm1.bk):
                want *= 2
            assert p.gemm1_split_k == want, (name, t, tiles)
            assert C.plan(arch, t, *d, sm_count=sms, mode="w4a4").gemm1_split_k == 1
            if name == "tp1" or t > 64:
                assert want == 1
            if name == "tp8" and t <= 64:
                assert want == 4


def _meta_call(shape_name: str, t: int, use_asm: bool, layout: str = "placed"):
    import torch

    from glm5_fp4.kernels.launch import MoECall
    from glm5_fp4.kernels.moe import Workspace
    from glm5_fp4.sm120 import launches as SL

    shape = {s.name: s for s in SL.shape_classes()}[shape_name]
    prep = SL.meta_prepared(shape, layout=layout)
    meta, k = torch.device("meta"), 8
    x = torch.empty(t, prep.hidden_size, dtype=torch.bfloat16, device=meta)
    return MoECall(x, torch.empty(t, k, device=meta), torch.empty(t, k, dtype=torch.int32, device=meta), prep, "w4a16",
                   torch.empty_like(x), Workspace(meta, prep.num_experts, k, prep.hidden_size, prep.intermediate_size, t),
                   use_asm=use_asm)


@pytest.mark.parametrize("t,form", [(1, "pdl"), (2, "pdl"), (4, None), (64, None), (4096, None)])
def test_pdl_launches_every_kernel_dependent_and_prefetches_gemm2_rows(t, form):
    """Plan.pdl (the default from PDL_MIN_TOKENS on and where GEMM2 is split by slots, the "pdl" form below it
    otherwise): every launch of the call carries
    launch_pdl and USE_PDL (each kernel waits at its top); GEMM2 prefetches whole rows of its experts (slot: all of
    a program's rows; grouped: its first N tile) in 128-byte requests; where inline PTX is off (the interpreter)
    the same plan launches plainly, and the "nopdl" form launches plainly everywhere."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.launch import count, launches

    call = _meta_call("tp8", t, use_asm=True)
    p = call.prepared
    h, i = p.hidden_size, p.intermediate_size
    dims = (p.num_experts, 8, h, i)
    default = C.plan("sm90", t, *dims, sm_count=132)
    # below PDL_MIN_TOKENS where GEMM2 is split by slots and takes K whole (whole experts: plainly)
    assert default.pdl == (t >= C.PDL_MIN_TOKENS or (default.gemm2_split_slots and i <= C.GEMM2_MAX_K_CHUNK))
    plan = C.plan("sm90", t, *dims, sm_count=132, form=form)
    assert plan.pdl and plan == dataclasses.replace(default, pdl=True)
    todo = launches(plan, call)
    assert len(todo) == count(plan)
    assert all(ln.kwargs.get("launch_pdl") is True and ln.kwargs.get("USE_PDL") is True for ln in todo), \
        [ln.name for ln in todo if not ln.kwargs.get("launch_pdl")]
    g2 = [ln for ln in todo if ln.name.startswith("moe_gemm2")]
    assert len(g2) == 1
    rows = h // plan.gemm2_n_split if g2[0].name == "moe_gemm2_slot_kernel" else min(plan.gemm2.bn, h // plan.gemm2_n_split)
    assert g2[0].kwargs["PF_ROWS"] == rows
    lines_w, lines_s = rows * (i // 2) / 128, rows * (i // 16) / 128  # bytes per row / 128-byte requests
    assert lines_w <= g2[0].kwargs["PF_W"] < 2 * lines_w and max(lines_s, 1) <= g2[0].kwargs["PF_S"] < 2 * max(lines_s, 1)
    if t == 1:  # the fused split-K reduce: 2 launches
        assert [ln.name for ln in todo] == ["moe_gemm1_kernel", "moe_gemm2_slot_kernel"]
    plain = launches(plan, _meta_call("tp8", t, use_asm=False))
    assert [ln.name for ln in plain] == [ln.name for ln in todo]
    assert not any("launch_pdl" in ln.kwargs or "USE_PDL" in ln.kwargs or "PF_ROWS" in ln.kwargs for ln in plain)
    nopdl = C.plan("sm90", t, *dims, sm_count=132, form="nopdl")
    assert not nopdl.pdl and not any("launch_pdl" in ln.kwargs for ln in launches(nopdl, call))
    assert not C.plan("sm80", t, *dims, sm_count=108).pdl  # griddepcontrol is SM90+


def test_slot_defaults_split_k_up_to_the_pick_limit_and_fuse_its_reduce():
    """T <= 2 (GEMM2 split by slots): GEMM1's K in any whole number of K tiles that keeps about
    SLOT_SPLIT_PROGRAMS_PER_SM programs per SM, the reduce fused into GEMM1 (2 launches), PDL; the former picks
    (opt-in "slot_split_pow2": powers of two up to SLOT_SPLIT_K_PICK fused at T = 1, up to SPLIT_K_MAX and a reduce
    launch at T = 2) and T = 3-4 as before; sm_120 splits GEMM2 by slots at T <= 2 too (its merged split tile, picked
    on the H200 stand-in), but keeps GEMM1's former split (up to SPLIT_K_MAX, a reduce launch) and no PDL there; its
    former tables ("sm120_former") keep the one-program GEMM2."""
    from glm5_fp4.kernels import configs as C

    # TP8 / TP4 / whole experts: 32, 64, 256 GEMM1 programs per token, 24 K tiles of 256, 132 SMs
    for t, i, split in ((1, 256, 12), (2, 256, 6), (1, 512, 6), (2, 512, 3), (1, 2048, 1), (2, 2048, 1)):
        p = C.plan("sm90", t, 256, 8, 6144, i, sm_count=132)
        # PDL where GEMM2 takes K whole (its rows prefetched before it waits), not for whole experts
        assert (p.gemm1_split_k, p.gemm1_fused_reduce, p.pdl) == (split, split > 1, i <= C.GEMM2_MAX_K_CHUNK), (t, i, p)
        assert split == 1 or (i // p.gemm1.bn) * t * 8 * split <= C.SLOT_SPLIT_PROGRAMS_PER_SM * 132
    for t, split, fused in ((1, 8, True), (2, 4, False)):
        old = C.plan("sm90", t, 256, 8, 6144, 256, sm_count=132, form="slot_split_pow2")
        assert (old.gemm1_split_k, old.gemm1_fused_reduce, old.pdl, old.gemm2_split_slots) == (split, fused, False, True)
        one = C.plan("sm90", t, 256, 8, 6144, 256, sm_count=132, form="one_program_gemm2")
        assert (one.gemm1_split_k, one.gemm1_fused_reduce, one.pdl, one.gemm2_split_slots) == (split, fused, False, False)
    for t in (3, 4):
        p = C.plan("sm90", t, 256, 8, 6144, 256, sm_count=132)
        assert (p.gemm1_split_k, p.gemm1_fused_reduce, p.gemm2_split_slots) == (4, False, False)
        # slot dedup: the split picked at run time, lowered to fit one wave down to 8 of the 24 K tiles a program
        assert p.gemm1_split_cap > 0 and p.gemm1_compact_grid and p.gemm1_split_floor == 3
    # the T=1 plan before 2026-12-02: 4 K ranges, a reduce launch, one GEMM2 program per token, plain launches
    old = C.plan("sm90", 1, 256, 8, 6144, 256, sm_count=132, form="slot_split4")
    assert (old.gemm1_split_k, old.gemm1_fused_reduce, old.gemm2_split_slots, old.pdl) == (4, False, False, False)
    assert old.gemm2_unroll
    for t in (1, 2, 3, 4):
        sm120 = C.plan("sm120", t, 256, 8, 6144, 256, sm_count=188)
        assert sm120.gemm1_split_k <= C.SPLIT_K_MAX and not sm120.gemm1_fused_reduce
        assert (sm120.gemm2_split_slots, sm120.pdl) == (t <= 2, t >= C.PDL_MIN_TOKENS), (t, sm120)
        if t <= 2:
            assert sm120.gemm2 == C.SPLIT_SLOTS_GEMM2["sm120"] and sm120.gemm2.merged
        former = C.plan("sm120", t, 256, 8, 6144, 256, sm_count=188, form="sm120_former")
        assert not former.gemm2_split_slots and former.gemm1 == C._FORMER_GEMM1["sm120"][("slot", 16)]


def test_gemm2_split_by_slots_launch_and_refusals():
    """The split slot GEMM2 launches (N ranges, tokens, k) programs with the combine rows and arrival counters; the
    launcher refuses it on the grouped schedule, with slot dedup, and where the workspace lacks the rows or the
    counters (a workspace sized for fewer tokens than the call)."""
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.launch import launches

    call = _meta_call("tp8", 2, use_asm=True)
    p = call.prepared
    dims = (p.num_experts, 8, p.hidden_size, p.intermediate_size)
    plan = C.plan("sm90", 2, *dims, sm_count=132)
    assert plan.gemm2_split_slots
    (g2,) = [ln for ln in launches(plan, call) if ln.name == "moe_gemm2_slot_kernel"]
    assert g2.grid == (plan.gemm2_n_split, 2, 8) and g2.kwargs["SPLIT_SLOTS"] and not g2.kwargs["UNROLL"]
    assert g2.args[-2] is call.workspace.combine and g2.args[-1] is call.workspace.slot_count
    with pytest.raises(Glm5Fp4Error, match="split by slots"):
        launches(dataclasses.replace(plan, slot_dedup=True), call)
    big = _meta_call("tp8", 64, use_asm=True)
    with pytest.raises(Glm5Fp4Error, match="split by slots"):
        launches(dataclasses.replace(C.plan("sm90", 64, *dims, sm_count=132), gemm2_split_slots=True), big)
    ws = call.workspace
    full_count, full_combine = ws.slot_count, ws.combine
    ws.slot_count = full_count[:plan.gemm2_n_split]  # counters for one token
    with pytest.raises(Glm5Fp4Error, match="arrivals per token"):
        launches(plan, call)
    ws.slot_count, ws.combine = full_count, full_combine[:8]  # rows for one token's slots
    with pytest.raises(Glm5Fp4Error, match="combine rows"):
        launches(plan, call)
    ws.combine = full_combine
    assert launches(plan, call)


def test_pick_slot_split_k_keeps_a_few_programs_per_sm():
    from glm5_fp4.kernels import configs as C

    per_sm = C.SLOT_SPLIT_PROGRAMS_PER_SM
    for programs, k_tiles, sms in ((32, 24, 132), (64, 24, 132), (128, 24, 132), (256, 24, 132), (4, 24, 132),
                                   (1000, 24, 132), (32, 12, 188), (50, 7, 10)):
        s = C.pick_slot_split_k(programs, k_tiles, sms)
        assert k_tiles % s == 0 and s <= C.SLOT_SPLIT_K_MAX
        bigger = [d for d in range(s + 1, min(k_tiles, C.SLOT_SPLIT_K_MAX) + 1) if k_tiles % d == 0]
        assert s == 1 or programs * s <= per_sm * sms
        assert all(programs * d > per_sm * sms for d in bigger), (programs, k_tiles, sms, s)
    assert [C.pick_slot_split_k(p, 24, 132) for p in (32, 64, 128, 256)] == [12, 6, 3, 1]


def test_pdl_gemm2_prefetches_nothing_for_whole_experts():
    """Whole experts (I = 2048) take GEMM2's K in chunks: a row's first chunk is no contiguous run, so no prefetch."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.launch import launches

    call = _meta_call("tp1", 64, use_asm=True)
    p = call.prepared
    assert p.intermediate_size > C.GEMM2_MAX_K_CHUNK
    plan = C.plan("sm90", 64, p.num_experts, 8, p.hidden_size, p.intermediate_size, sm_count=132, form="pdl")
    todo = launches(plan, call)
    assert all(ln.kwargs.get("launch_pdl") for ln in todo)
    assert not any("PF_ROWS" in ln.kwargs for ln in todo)


@pytest.mark.parametrize("t", [1, 4])
def test_slot_split_k_beyond_the_grouped_limit_fits_the_workspace(t):
    """The slot schedule takes up to SLOT_SPLIT_K_MAX K ranges (sweep candidates: one K tile per program at T=1);
    the workspace's partial sums hold them at the largest slot T; more ranges, or ranges of part tiles, are refused."""
    import dataclasses

    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.launch import launches

    call = _meta_call("tp8", t, use_asm=True)
    p = call.prepared
    h, i = p.hidden_size, p.intermediate_size
    base = C.plan("sm90", t, p.num_experts, 8, h, i, sm_count=132, form="per_slot")
    assert base.schedule == "slot" and base.gemm1_split_k < C.SLOT_SPLIT_K_MAX
    k_tiles = h // base.gemm1.bk
    for s in (8, 12, C.SLOT_SPLIT_K_MAX):
        assert k_tiles % s == 0
        g1 = launches(dataclasses.replace(base, gemm1_split_k=s), call)[0]
        assert g1.grid[2] == s and g1.kwargs["SPLIT_K"] == s
        assert s * t * 8 * 2 * i <= call.workspace.part.numel()
    with pytest.raises(Glm5Fp4Error, match="split-K"):
        launches(dataclasses.replace(base, gemm1_split_k=2 * C.SLOT_SPLIT_K_MAX), call)
    with pytest.raises(Glm5Fp4Error, match="split-K"):
        launches(dataclasses.replace(base, gemm1_split_k=16), call)  # 24 K tiles do not split 16 ways
    with pytest.raises(Glm5Fp4Error, match="split-K"):  # the grouped schedule keeps SPLIT_K_MAX
        launches(dataclasses.replace(C.plan("sm90", 16, p.num_experts, 8, h, i, sm_count=132), gemm1_split_k=8),
                 _meta_call("tp8", 16, use_asm=True))


@pytest.mark.parametrize("t", [1, 4, 512])
def test_register_caps_and_l2_prefetch_reach_the_launches_only_where_ptx_is_compiled(t):
    """Gemm1Config/Gemm2Config.maxnreg become the launch option maxnreg, Plan.l2_prefetch the GEMM1 constexpr
    PF_DIST (and the grouped GEMM2's PF_DIST/PF_DW/PF_DS request counts), on the compiled path; the interpreter
    gets neither (no ptxas, no inline PTX) and launches the same kernels."""
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.launch import launches

    call = _meta_call("tp8", t, use_asm=True)
    p = call.prepared
    h, i = p.hidden_size, p.intermediate_size
    plan = dataclasses.replace(C.plan("sm90", t, p.num_experts, 8, h, i, sm_count=132),
                               gemm1=C.Gemm1Config(64, 16 if t <= 4 else 32, 256, 4, 2, maxnreg=168),
                               gemm2=dataclasses.replace(C.plan("sm90", t, p.num_experts, 8, h, i).gemm2, maxnreg=96),
                               l2_prefetch=4)
    todo = {ln.name: ln for ln in launches(plan, call)}
    assert todo["moe_gemm1_kernel"].kwargs["maxnreg"] == 168 and todo["moe_gemm1_kernel"].kwargs["PF_DIST"] == 4
    g2 = next(ln for name, ln in todo.items() if name.startswith("moe_gemm2"))
    assert g2.kwargs["maxnreg"] == 96
    if g2.name == "moe_gemm2_grouped_kernel":
        assert g2.kwargs["PF_DIST"] == 4
        bn = plan.gemm2.bn  # one 128-byte request per row of words (I/2 = 128 bytes), a row's scales are 16 bytes
        assert (g2.kwargs["PF_DW"], g2.kwargs["PF_DS"]) == (bn * (i // 2) // 128, bn * (i // 16) // 128)
    plain = launches(plan, _meta_call("tp8", t, use_asm=False))
    assert [ln.name for ln in plain] == list(todo)
    assert not any(key in ln.kwargs for ln in plain for key in ("maxnreg", "PF_DIST", "PF_DW", "PF_DS"))


@pytest.mark.parametrize("t,bk", [(4, 256), (512, 256), (512, 128)])
def test_tma_tiles_hand_gemm1_descriptors_of_one_tile(t, bk):
    """Gemm1Config.tma: GEMM1 gets a descriptor of the [E*2I, H/8] words with one [BN, BK/8] box, and one of the
    [E*2I, H/16] scales where the [BN, BK/16] box row is 16 bytes (BK >= 256), else the scales' pointer; plans that
    TMA cannot serve (the pointer-addressed L2 prefetch, a box of more than 256 rows) are refused by name."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.launch import launches

    call = _meta_call("tp8", t, use_asm=True)
    p = call.prepared
    e, h, i = p.num_experts, p.hidden_size, p.intermediate_size
    g1 = C.Gemm1Config(64, 16 if t <= 4 else 32, bk, 4, 2, tma=True)
    plan = dataclasses.replace(C.plan("sm90", t, e, 8, h, i, sm_count=132), gemm1=g1)
    g = next(ln for ln in launches(plan, call) if ln.name == "moe_gemm1_kernel")
    words, scales = g.args[3], g.args[4]
    assert isinstance(words, TensorDescriptor) and g.kwargs["W_DESC"]
    assert list(words.shape) == [e * 2 * i, h // 8] and list(words.block_shape) == [64, bk // 8]
    if bk >= 256:
        assert isinstance(scales, TensorDescriptor) and g.kwargs["S_DESC"]
        assert list(scales.shape) == [e * 2 * i, h // 16] and list(scales.block_shape) == [64, bk // 16]
    else:
        assert scales is p.w13_scale and "S_DESC" not in g.kwargs
    plain = next(ln for ln in launches(dataclasses.replace(plan, gemm1=dataclasses.replace(g1, tma=False)), call)
                 if ln.name == "moe_gemm1_kernel")
    assert "W_DESC" not in plain.kwargs and not isinstance(plain.args[3], TensorDescriptor)
    with pytest.raises(Glm5Fp4Error, match="L2 prefetch"):
        launches(dataclasses.replace(plan, l2_prefetch=4), call)
    from glm5_fp4.kernels.capability import has_tma

    assert has_tma((9, 0)) and has_tma(120) and not has_tma((8, 9)) and not has_tma(None)  # SM90+ (refused below)
    tp4 = _meta_call("tp4", t, use_asm=True)  # I = 512: a 512-row tile divides it
    with pytest.raises(Glm5Fp4Error, match="at most 256 rows"):
        launches(dataclasses.replace(C.plan("sm90", t, e, 8, h, 512), gemm1=dataclasses.replace(g1, bn=512)), tp4)


def test_former_tile_defaults_are_opt_in_on_the_archs_they_were_defaults_on():
    """slot_stages4 / gemm2_128x32 restore the sm90 (and sm100, which shares its tables) tiles of 2026-12-02 and
    change nothing on sm120, whose own defaults they never were; the new sm90 defaults are what the H200 measured."""
    from glm5_fp4.kernels import configs as C

    dims = (256, 8, 6144, 256)
    for arch in ("sm90", "sm100"):
        assert C.plan(arch, 4, *dims).gemm1 == C.Gemm1Config(64, 16, 256, 4, 2, maxnreg=168)
        assert C.plan(arch, 4, *dims, form="slot_stages4").gemm1 == C.Gemm1Config(64, 16, 256, 4, 4)
        new, old = C.plan(arch, 512, *dims), C.plan(arch, 512, *dims, form="gemm2_128x32")
        assert (new.gemm2.bn, new.gemm2.num_warps, new.gemm2_n_split) == (64, 4, 6)
        assert (old.gemm2, old.gemm2_n_split) == (C.Gemm2Config(128, 32, 8, 3, merged=False), 3)
        assert new.gemm2.bn * new.gemm2_n_split == old.gemm2.bn * old.gemm2_n_split  # N tiles per program
    for form in ("slot_stages4", "gemm2_128x32"):
        for t in (4, 512):
            assert C.plan("sm120", t, *dims, form=form) == C.plan("sm120", t, *dims)
    # a form whose split cannot cut H into whole tiles does not serve (H = 512: 4 tiles of 128 rows, split 3), nor
    # one at another token block or intermediate size than the default it restores
    assert C.plan("sm90", 40, 16, 4, 512, 128, form="gemm2_128x32").gemm1.bm == 32
    assert C.plan("sm90", 40, 16, 4, 512, 128, form="gemm2_128x32") == C.plan("sm90", 40, 16, 4, 512, 128)
    for t, i in ((64, 256), (4096, 256), (512, 2048), (512, 512)):
        assert C.plan("sm90", t, 256, 8, 6144, i, form="gemm2_128x32") == C.plan("sm90", t, 256, 8, 6144, i), (t, i)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_tp8_gemm2_of_16_token_blocks_splits_12_ways_and_the_former_rule_is_opt_in(arch):
    """The TP8 shard's GEMM2 of 16-token blocks: 12 programs along H in 4 stages; "gemm2_split_rule" restores the
    3-stage tile split by pick_n_split (3 ways at T = 64-256, more at small T). The TP4 shard, whole experts and
    slot dedup (T = 3-4) keep the former tile and rule whatever the form, as does every other token block."""
    dims = (256, 8, 6144)
    former = C.Gemm2Config(64, 16, 4, 3, merged=False)
    for t in (8, 16, 64, 256):
        new, old = C.plan(arch, t, *dims, 256), C.plan(arch, t, *dims, 256, form="gemm2_split_rule")
        assert (new.gemm2.bm, new.gemm2.num_stages, new.gemm2_n_split) == (16, 4, 12), t
        assert old.gemm2 == former and old.gemm2_n_split == C.pick_n_split(
            6144 // 64, min(C.expected_active_experts(t, 256, 8), t * 8), 132), t
        assert dataclasses.replace(old, gemm2=new.gemm2, gemm2_n_split=12) == new  # nothing else differs
    assert [C.plan(arch, t, *dims, 256, form="gemm2_split_rule").gemm2_n_split for t in (16, 64)] == [6, 3]
    for t, i in ((3, 256), (4, 256), (64, 512), (256, 512), (64, 2048)):
        p = C.plan(arch, t, *dims, i)
        assert p.gemm2 == former and p.gemm2_n_split == C.plan(arch, t, *dims, i, form="gemm2_split_rule").gemm2_n_split
    for t, i in ((512, 256), (4096, 256), (3, 256), (64, 512)):  # the form serves none of these: plan unchanged
        assert C.plan(arch, t, *dims, i, form="gemm2_split_rule") == C.plan(arch, t, *dims, i), (t, i)
    assert C.plan("sm120", 64, *dims, 256, form="gemm2_split_rule") == C.plan("sm120", 64, *dims, 256)


def test_free_decode_bound_keeps_one_scale_instruction_per_output():
    """DIAG_NO_DECODE's stand-in (benchmarks' free-decode bound) computes each of a word's four outputs by a
    different expression of the word and the scale pair: ptxas merged four identical multiplies into one (SASS,
    sm_90: 32 instead of 128 HMUL2 per K tile), which left most of the scale work out of the bound too."""
    from glm5_fp4.kernels.triton_moe import _FREE_WORD

    lines = [ln.strip() for ln in _FREE_WORD.strip().splitlines()]
    assert len(lines) == 4 and all(ln.split()[0] in ("mul.rn.f16x2", "fma.rn.f16x2") for ln in lines)
    rhs = [ln.split(",", 1)[1] for ln in lines]
    assert len(set(rhs)) == 4, rhs


@pytest.mark.parametrize("t", [1, 4, 512, 4096])
def test_tiled_layout_passes_its_runs_to_gemm1_only_and_refuses_what_cannot_read_them(t):
    """layout="tiled": GEMM1 gets KT (the layout's run width) and the placed decode, every other kernel the launch
    it gets for "placed" (the L2 prefetch too, addressing the runs); a TMA box wider than a run is refused by name."""
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.launch import launches
    from glm5_fp4.kernels.layout import W13_K_TILE

    call, placed = _meta_call("tp8", t, use_asm=True, layout="tiled"), _meta_call("tp8", t, use_asm=True)
    p = call.prepared
    plan = C.plan("sm90", t, p.num_experts, 8, p.hidden_size, p.intermediate_size, sm_count=132)
    todo, ref = launches(plan, call), launches(plan, placed)
    assert [ln.name for ln in todo] == [ln.name for ln in ref]
    for ln, rl in zip(todo, ref):
        if ln.name == "moe_gemm1_kernel":
            assert ln.kwargs["KT"] == W13_K_TILE and ln.kwargs["PLACED"] and "KT" not in rl.kwargs
            assert {k: v for k, v in ln.kwargs.items() if k != "KT"} == rl.kwargs
        else:
            assert ln.kwargs == rl.kwargs
    with pytest.raises(Glm5Fp4Error, match="TMA box of 512 K"):
        launches(dataclasses.replace(plan, gemm1=dataclasses.replace(plan.gemm1, bk=512, tma=True)), call)
    pf = [ln for ln in launches(dataclasses.replace(plan, l2_prefetch=4), call) if ln.name == "moe_gemm1_kernel"]
    assert pf[0].kwargs["PF_DIST"] == 4 and pf[0].kwargs["KT"] == W13_K_TILE


def test_every_form_plans_on_every_arch():
    """An opt-in form asked for on an arch it does not serve gives that arch's default plan, never an error (the
    compile matrix builds every form for every arch: "sm120_former" once raised KeyError on sm90/sm100)."""
    from glm5_fp4.kernels import configs as C

    for arch in C.arch_tables():
        for form, o in C.OPT_IN.items():
            for t in (1, 2, 4, 64, 512, 4096):
                for i in (256, 2048):
                    p = C.plan(arch, t, 256, 8, 6144, i, form=form)
                    if o.archs is not None and arch not in o.archs:
                        assert p == C.plan(arch, t, 256, 8, 6144, i), (arch, form, t, i)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_stacked_gemm1_tile_is_a_w4a16_default(arch):
    """The 32-token GEMM1 tile is stacked (gate and up rows as one) in W4A16, where it was measured; W4A4 takes its
    own table's unstacked tile (the W4A16 one spills with W4A4's quantizer under the engines' Triton, stacked or
    not), also under the opt-in 'stacked' form; explicit configs are kept as given."""
    w16 = C.plan(arch, 512, 256, 8, 6144, 256, mode="w4a16")
    w4 = C.plan(arch, 512, 256, 8, 6144, 256, mode="w4a4")
    assert w16.gemm1.stacked and not w4.gemm1.stacked
    assert w4.gemm1 == C._W4A4_GEMM1[arch][("grouped", 32)]
    assert not C.plan(arch, 512, 256, 8, 6144, 256, mode="w4a4", form="stacked").gemm1.stacked
    assert C.plan(arch, 64, 256, 8, 6144, 256, mode="w4a16", form="stacked").gemm1.stacked
    assert not C.plan(arch, 64, 256, 8, 6144, 256, mode="w4a16").gemm1.stacked
    assert C.plan(arch, 512, 256, 8, 6144, 256, mode="w4a4", gemm1=w16.gemm1).gemm1.stacked
    assert not C.plan("sm120", 512, 256, 8, 6144, 256, mode="w4a16", form="stacked").gemm1.stacked


def test_w4a4_tiles_replace_only_where_the_w4a16_tile_spills():
    """_W4A4_GEMM1: sm_90 and sm_100 W4A4 take a non-spilling tile at 32- and 128-token blocks (and sm_100 at the
    slot schedule); every other tile, every W4A16 tile and sm_120's are the W4A16 tables'; an explicit config or a
    form's former tables win."""
    for arch in ("sm90", "sm100", "sm120"):
        for t in (1, 2, 4, 16, 64, 512, 1024, 2048, 4096, 8192):
            w16 = C.plan(arch, t, 256, 8, 6144, 256, mode="w4a16")
            w4 = C.plan(arch, t, 256, 8, 6144, 256, mode="w4a4")
            key = (w16.schedule, w16.gemm1.bm)
            table = C._W4A4_GEMM1.get(arch, {})
            assert w4.gemm1 == (table[key] if key in table else dataclasses.replace(w16.gemm1, stacked=False)), (arch, t)
    assert C.plan("sm100", 1, 256, 8, 6144, 256, mode="w4a4").gemm1.maxnreg is None
    assert C.plan("sm90", 1, 256, 8, 6144, 256, mode="w4a4").gemm1.maxnreg == 168
    g = C.Gemm1Config(128, 128, 128, 8, 3)
    assert C.plan("sm90", 4096, 256, 8, 6144, 256, mode="w4a4", gemm1=g).gemm1 == g


@pytest.mark.parametrize("form,t", [("gemm1_ws", 512), ("gemm1_ws64", 1024), ("gemm1_ws16", 64)])
def test_warp_specialized_gemm1_launch_and_what_it_refuses(form, t):
    """The opt-in Gluon GEMM1 (Gemm1Config.ws): one persistent launch of at most two CTAs per SM in place of the Triton
    GEMM1, its register budget for two CTAs, the token block's rows in cp.async passes of 8 rows; the other launches as
    the default's. Refused with a reason for W4A4, a layout other than "tiled" and an L2-prefetch plan."""
    import torch

    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.kernels import gluon_moe as G
    from glm5_fp4.kernels.launch import launches, max_blocks

    call = _meta_call("tp8", t, use_asm=True, layout="tiled")
    p = call.prepared
    dims = (p.num_experts, 8, p.hidden_size, p.intermediate_size)
    plan = C.plan("sm90", t, *dims, sm_count=132, form=form)
    g1 = plan.gemm1
    assert g1.ws and g1.stacked and plan.gemm1_split_k == 1
    names = [ln.name for ln in launches(plan, call)]
    default = [ln.name for ln in launches(C.plan("sm90", t, *dims, sm_count=132), call)]
    assert names == [n if n != "moe_gemm1_kernel" else "moe_gemm1_ws_kernel" for n in default
                     if n != "moe_splitk_reduce_kernel"]
    with torch.device("meta"):
        gemm1 = next(ln for ln in launches(plan, call) if ln.name == "moe_gemm1_ws_kernel")
    items = max_blocks(t * 8, p.num_experts, g1.bm) * (p.intermediate_size // g1.bn)
    assert gemm1.grid == (min(items, G.ctas_per_sm(g1) * 132),)
    assert gemm1.kwargs["maxnreg"] * 256 * G.ctas_per_sm(g1) <= 65536
    assert gemm1.kwargs["RCH"] == C.WS_X_ROWS_VERIFIED and gemm1.kwargs["STAGES"] == g1.num_stages
    with pytest.raises(Glm5Fp4Error, match="activation passes of 8 rows"):  # 64-token blocks: passes of 16
        launches(dataclasses.replace(plan, gemm1=dataclasses.replace(g1, bm=64)), call)
    with pytest.raises(Glm5Fp4Error, match="layout='tiled'"):
        launches(plan, _meta_call("tp8", t, use_asm=True, layout="placed"))
    with pytest.raises(Glm5Fp4Error, match="walking all of K"):
        launches(dataclasses.replace(plan, l2_prefetch=2), call)
    with pytest.raises(Glm5Fp4Error, match="W4A16"):
        launches(plan, dataclasses.replace(call, mode="w4a4"))
