"""Small fused-MoE cases for compute-sanitizer (not a pytest module): both schedules, both modes, a skewed
routing whose hot expert spans several work-list blocks, and expert parallelism with remote slots.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/gpu/memcheck_moe_kernel.py
    compute-sanitizer --tool racecheck python tests/gpu/memcheck_moe_kernel.py

The cases run on the default weight layout ("tiled"); GLM5_FP4_EXPERT_LAYOUT=placed / split runs them on another
(run_moe_h200.sh: memcheck = default, memcheck_placed forces placed).
"""

import torch

from glm5_fp4.bench.routing import make_routing
from glm5_fp4.kernels import fused_moe, prepare_experts
from glm5_fp4.reference import moe_reference, random_experts
from glm5_fp4.tolerances import moe_tolerance, rel_error


def _checked(out, x, w, ids, ex, mode, m) -> tuple[float, bool]:
    """The relative error of ``out`` against the float64 reference of the same call, and whether it is within tolerance."""
    ref = moe_reference(x.double().cpu(), w.double().cpu(), ids.long().cpu(), ex, mode=mode,
                        compute_dtype=torch.float64, expert_map=None if m is None else m.cpu())
    err = rel_error(out, ref)
    return err, err < moe_tolerance(mode, x.dtype)


def main() -> int:
    g = torch.Generator().manual_seed(0)
    e, h, i, k = 8, 768, 128, 2  # H = 3 runs of the tiled layout's 256 K: a run's bounds matter
    ex = random_experts(e, h, i, generator=g)
    prep = prepare_experts(ex.to("cuda"))
    failures = 0
    emap = torch.tensor([0, -1, 1, 2, -1, 3, 4, -1, 5, 6, 7, -1], dtype=torch.int32, device="cuda")
    for t, routing, use_map in ((1, "balanced", False), (3, "one_hot", False), (20, "balanced", False),
                                (40, "same_k", False), (3, "balanced", True), (40, "zipf2", True)):
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        w, ids = make_routing(routing, t, 12 if use_map else e, k, device="cuda")
        m = emap if use_map else None
        for mode in ("w4a16", "w4a4"):
            err, ok = _checked(fused_moe(x, w, ids, prep, mode=mode, expert_map=m), x, w, ids, ex, mode, m)
            failures += not ok
            print(f"T={t} {routing} map={use_map} {mode}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    # the slot schedule's fused split-K reduce (plan.gemm1_fused_reduce: arrival counters, last program reduces)
    import dataclasses

    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton

    for t in (1, 3):
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        w, ids = make_routing("balanced", t, e, k, device="cuda")
        plan = default_plan(x, ids, prep, "w4a16")
        # two K tiles of 128 (H = 256) so that K splits in two
        plan = dataclasses.replace(plan, gemm1=dataclasses.replace(plan.gemm1, bk=128), gemm1_split_k=2,
                                   gemm1_fused_reduce=True)
        for mode in ("w4a16", "w4a4"):
            err, ok = _checked(fused_moe_triton(x, w, ids, prep, mode, plan=plan), x, w, ids, ex, mode, None)
            failures += not ok
            print(f"T={t} fused split-K reduce {mode}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    # the parallel align (plan.parallel_align: count + scan by the last arrival, scatter kernel), remote slots
    for t, use_map in ((40, False), (200, True)):
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        w, ids = make_routing("zipf2", t, 12 if use_map else e, k, device="cuda")
        m = emap if use_map else None
        plan = dataclasses.replace(default_plan(x, ids, prep, "w4a16", m), parallel_align=True)
        err, ok = _checked(fused_moe_triton(x, w, ids, prep, "w4a16", plan=plan, expert_map=m), x, w, ids, ex,
                           "w4a16", m)
        failures += not ok
        print(f"T={t} parallel align map={use_map}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    # programmatic dependent launch (plan.pdl; its prefetches address the weights by the routing), both
    # schedules, remote slots, the fused reduce
    for t, use_map, form in ((1, False, "pdl"), (1, False, "pdl_fused"), (3, True, "pdl"), (40, False, "pdl"),
                             (200, True, "pdl")):
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        w, ids = make_routing("zipf2", t, 12 if use_map else e, k, device="cuda")
        m = emap if use_map else None
        plan = default_plan(x, ids, prep, "w4a16", m, form="pdl")
        if form == "pdl_fused":  # two K tiles of 128 (H = 256) so that K splits in two
            plan = dataclasses.replace(plan, gemm1=dataclasses.replace(plan.gemm1, bk=128), gemm1_split_k=2,
                                       gemm1_fused_reduce=True)
        err, ok = _checked(fused_moe_triton(x, w, ids, prep, "w4a16", plan=plan, expert_map=m), x, w, ids, ex,
                           "w4a16", m)
        ok = ok and plan.pdl
        failures += not ok
        print(f"T={t} {form} map={use_map}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    # GEMM1's weight tiles by TMA (Gemm1Config.tma): words and scales by descriptor (BK = 256), words only (BK = 128)
    from glm5_fp4.kernels import configs as C

    for t, routing, bk in ((3, "balanced", 256), (40, "same_k", 256), (40, "zipf2", 128)):
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        w, ids = make_routing(routing, t, e, k, device="cuda")
        base = default_plan(x, ids, prep, "w4a16")
        plan = dataclasses.replace(base, gemm1=C.Gemm1Config(16, base.gemm1.bm, bk, 4, 2, tma=True),
                                   gemm1_split_k=1, gemm1_fused_reduce=False)
        err, ok = _checked(fused_moe_triton(x, w, ids, prep, "w4a16", plan=plan), x, w, ids, ex, "w4a16", None)
        failures += not ok
        print(f"T={t} {routing} tma bk={bk}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    # GEMM1's stacked tile (Gemm1Config.stacked: gate and up rows as one tile, the accumulator split after the K
    # loop): the sm90 32-token default (64x32x256), a 128-wide K tile and a 16-row one, remote slots, both modes
    for t, routing, use_map, cfg in ((40, "same_k", False, C.Gemm1Config(64, 32, 256, 4, 3, stacked=True)),
                                     (40, "balanced", False, C.Gemm1Config(64, 32, 128, 4, 4, stacked=True)),
                                     (40, "zipf2", True, C.Gemm1Config(16, 16, 256, 4, 2, stacked=True))):
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        w, ids = make_routing(routing, t, 12 if use_map else e, k, device="cuda")
        m = emap if use_map else None
        plan = dataclasses.replace(default_plan(x, ids, prep, "w4a16", m), gemm1=cfg, gemm1_split_k=1)
        for mode in ("w4a16", "w4a4"):
            err, ok = _checked(fused_moe_triton(x, w, ids, prep, mode, plan=plan, expert_map=m), x, w, ids, ex, mode, m)
            failures += not ok
            print(f"T={t} {routing} stacked {cfg.bn}x{cfg.bm}x{cfg.bk} map={use_map} {mode}: rel err {err:.2e} "
                  f"{'ok' if ok else 'FAIL'}")
    # the slot GEMM2 split by slots (Plan.gemm2_split_slots: per-slot rows, the last arrival adds them), with PDL,
    # remote slots, and a token whose experts are all remote
    for t, use_map, pdl in ((1, False, False), (2, True, True)):
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        w, ids = make_routing("balanced", t, 12 if use_map else e, k, g)
        w, ids = w.cuda(), ids.cuda()
        if use_map:  # global 1 and 4 are remote, 0 and 3 local (emap above)
            ids[0] = torch.tensor([1, 4], device="cuda")
            ids[1] = torch.tensor([0, 1], device="cuda")
        m = emap if use_map else None
        plan = dataclasses.replace(default_plan(x, ids, prep, "w4a16", m), gemm2_split_slots=True, pdl=pdl)
        for mode in ("w4a16", "w4a4"):
            out = fused_moe_triton(x, w, ids, prep, mode, plan=plan, expert_map=m)
            ref = moe_reference(x.double().cpu(), w.double().cpu(), ids.long().cpu(), ex, mode=mode,
                                compute_dtype=torch.float64, expert_map=None if m is None else m.cpu())
            err = rel_error(out, ref)
            ok = err < moe_tolerance(mode, x.dtype) and bool(ref.abs().max() > 0)  # some slot must be local
            failures += not ok
            print(f"T={t} split slots map={use_map} pdl={pdl} {mode}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    # the slot dedup's finalize by arrival (opt-in dedup_by_arrival: per-token counters, the last writer adds the
    # token's rows), skewed groups, remote slots arriving by their own programs, both modes
    for t, routing, use_map in ((3, "same_k", False), (4, "zipf2", True)):
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        w, ids = make_routing(routing, t, 12 if use_map else e, k, device="cuda")
        m = emap if use_map else None
        plan = default_plan(x, ids, prep, "w4a16", m, form="dedup_by_arrival")
        if not plan.dedup_fused_finalize:  # (the form serves sm_90 / sm_100 only)
            print(f"T={t} dedup by arrival: not served on this GPU's arch, skipped")
            break
        for mode in ("w4a16", "w4a4"):
            err, ok = _checked(fused_moe_triton(x, w, ids, prep, mode, plan=plan, expert_map=m), x, w, ids, ex, mode, m)
            ok = ok and plan.dedup_fused_finalize
            failures += not ok
            print(f"T={t} {routing} dedup by arrival map={use_map} {mode}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    # sm_120's own plans (its tiles, rules and SM count: what an RTX PRO 6000 launches; with DISABLE_MMA_V3=1 also
    # its mma.sync instruction, glm5_fp4/bench/mma.py), both schedules, remote slots, the slot GEMM2 split by slots
    from glm5_fp4.kernels.moe import plan_for

    for t, routing, use_map in ((1, "balanced", False), (2, "same_k", True), (3, "one_hot", False),
                                (40, "same_k", False), (40, "zipf2", True)):
        x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
        w, ids = make_routing(routing, t, 12 if use_map else e, k, device="cuda")
        m = emap if use_map else None
        for mode in ("w4a16", "w4a4"):
            plan = plan_for("sm120", C.sm_count_guess("sm120"), t, k, prep, mode, m)
            err, ok = _checked(fused_moe_triton(x, w, ids, prep, mode, plan=plan, expert_map=m), x, w, ids, ex, mode, m)
            failures += not ok
            print(f"T={t} {routing} map={use_map} sm_120 plan {mode}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    torch.cuda.synchronize()
    print(f"memcheck cases done, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
