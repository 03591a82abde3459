"""Benchmark the fused NVFP4 MoE kernel at GLM-5 expert shapes: balanced and skewed routings, same-run
ceilings and baselines (vLLM's Marlin MoE when vLLM's CUDA build is importable, torch bf16/fp8 grouped GEMMs).

The table itself is :mod:`glm5_fp4.bench.moe` (shared with ``glm5-fp4 selftest``); this script adds the
config sweep, plan overrides from a sweep, parallel pre-compilation and the result files.

    python benchmarks/moe_kernel.py                                  # table -> benchmarks/results/moe_kernel_h200.{json,md}
    python benchmarks/moe_kernel.py --shards tp8 --tokens 512 --routings balanced,same_k
    python benchmarks/moe_kernel.py --sweep --shards tp8 --tokens 1,512,4096 --json sweep.json
    python benchmarks/moe_kernel.py --sweep --only 't$' --tokens 512  # the default and the TMA GEMM1 tiles only
    python benchmarks/moe_kernel.py --plans sweep.json               # the table with the sweep's best plans
    python benchmarks/moe_kernel.py --plan-arch sm120 --mma-sync     # an RTX PRO 6000's plans and MMA on this GPU

``--plan-arch ARCH`` makes every plan ARCH's (its tile tables, schedule rules and SM count,
``configs.sm_count_guess``) instead of this GPU's; ``--mma-sync`` compiles the dots to mma.sync instead of
Hopper's wgmma (:mod:`glm5_fp4.bench.mma`). Together, on an H200, they run the W4A16 kernels an RTX PRO 6000
would launch, on an H200's memory and SM count: a check of the sm_120 plans' logic and instruction selection on
real hardware, never a measurement of an SM120.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS = (1, 4, 16, 64, 256, 512, 1024, 4096, 8192)


def _plan_of(d: dict):
    from glm5_fp4.kernels import configs as C

    # every Plan field the JSON has (a field added later defaults where an older JSON lacks it)
    kw = {f.name: d[f.name] for f in dataclasses.fields(C.Plan) if f.name in d}
    kw.update(gemm1=C.Gemm1Config(**d["gemm1"]), gemm2=C.Gemm2Config(**d["gemm2"]))
    return C.Plan(**kw)


def sweep_variants(base, hidden: int, intermediate: int, arch: str) -> dict:
    """The default plan and one-change variants: every GEMM1 / GEMM2 candidate of the arch (GEMM1 at the
    same token block, the next larger one: fewer blocks per expert, each weight decoded fewer times, or the next
    smaller one: smaller tiles, more CTAs per SM), split-K around the pick for the slot schedule, the slot GEMM2
    split by slots with each slot GEMM2 candidate."""
    from glm5_fp4.kernels import configs as C

    rep = dataclasses.replace
    out = {"default": base}
    bm = base.gemm1.bm
    # GEMM2 one program per slot (Plan.gemm2_split_slots): the slot schedule without dedup; "slots" in the name
    split_slots = base.schedule == "slot" and not base.slot_dedup
    largest = max(g.bm for g in C.GEMM1_CANDIDATES[arch])
    bms = {bm} if base.schedule == "slot" else {bm, min(largest, bm * 2), max(C.MIN_BLOCK_M, bm // 2)}
    for g1 in C.GEMM1_CANDIDATES[arch]:
        if g1.bm in bms and intermediate % g1.bn == 0 and hidden % g1.bk == 0 and g1 != base.gemm1:
            if base.schedule == "slot" and (hidden // g1.bk) % base.gemm1_split_k:
                continue
            out[f"g1 {g1.bn}x{g1.bm}x{g1.bk}w{g1.num_warps}s{g1.num_stages}{'' if g1.merged else 'u'}"
                f"{f'r{g1.maxnreg}' if g1.maxnreg else ''}{'t' if g1.tma else ''}{'gu' if g1.stacked else ''}"] = rep(
                    base, gemm1=g1)
    for g2 in C.GEMM2_CANDIDATES[arch]:
        if base.schedule == "slot" and g2.bm != 16:
            continue
        if hidden % g2.bn or g2 == base.gemm2:
            continue
        # the split that gives each program as many N tiles (loop iterations) as the default's
        n_split = max(1, min(hidden // g2.bn, base.gemm2_n_split * base.gemm2.bn // g2.bn))
        while (hidden // g2.bn) % n_split:
            n_split -= 1
        unroll = base.schedule == "slot" and C.gemm2_slot_unrolls(arch, g2, intermediate, 8)
        name = (f"g2 {g2.bn}x{g2.bm}w{g2.num_warps}s{g2.num_stages}{'' if g2.merged else 'u'}"
                f"{f'r{g2.maxnreg}' if g2.maxnreg else ''} n{n_split}")
        out[name] = rep(base, gemm2=g2, gemm2_n_split=n_split, gemm2_unroll=unroll, gemm2_split_slots=False)
        if _by_blocks(base) and (g2.bn, g2.bm) == (base.gemm2.bn, base.gemm2.bm):
            # the same tile's other splits along H (program count against tiles walked per program)
            for ns in gemm2_splits(base):
                if ns != n_split and (hidden // g2.bn) % ns == 0:
                    out[name.rsplit(" n", 1)[0] + f" n{ns}"] = rep(base, gemm2=g2, gemm2_n_split=ns,
                                                                   gemm2_split_slots=False)
        if split_slots:
            out[name + " slots"] = rep(base, gemm2=g2, gemm2_n_split=n_split, gemm2_unroll=False,
                                       gemm2_split_slots=True)
    if _by_blocks(base):
        for ns in gemm2_splits(base):
            if ns != base.gemm2_n_split and (hidden // base.gemm2.bn) % ns == 0:
                out[f"g2 n{ns}"] = rep(base, gemm2_n_split=ns)
    for dist in L2_PREFETCH_DISTANCES:
        if dist != base.l2_prefetch:
            out[f"pf{dist}"] = rep(base, l2_prefetch=dist)
    if base.schedule == "slot" and base.gemm2_unroll:
        out["g2 not unrolled"] = rep(base, gemm2_unroll=False)
    if split_slots:  # the other GEMM2 form in the base's tile
        out["g2 slots" if not base.gemm2_split_slots else "g2 one program"] = rep(
            base, gemm2_split_slots=not base.gemm2_split_slots,
            gemm2_unroll=base.gemm2_split_slots and C.gemm2_slot_unrolls(arch, base.gemm2, intermediate, 8))
    if base.schedule == "slot":
        # up to SLOT_SPLIT_K_MAX ranges: at T=1 a program per 1-2 K tiles (the picker stops at SPLIT_K_MAX)
        for s in (1, 2, 3, 4, 6, 8, 12, 24):
            if s != base.gemm1_split_k and C.split_k_fits(s, hidden, base.gemm1.bk, slot=True):
                out[f"splitK{s}"] = rep(base, gemm1_split_k=s, gemm1_fused_reduce=False)
                if s >= 2:
                    out[f"splitK{s} fused"] = rep(base, gemm1_split_k=s, gemm1_fused_reduce=True)
    return out


# GEMM2 splits along H the sweep tries for the default tile and its same-shape candidates (grouped schedule)
GEMM2_SPLITS = (2, 3, 4, 6, 8, 12)
# ... and for the slot dedup's grouped GEMM2 (T = 3-4: ~30 groups at most, each few tokens)
DEDUP_GEMM2_SPLITS = (6, 12, 24, 48, 96)
# Plan.l2_prefetch distances the sweep tries (K tiles of GEMM1, N tiles of the grouped GEMM2 ahead)
L2_PREFETCH_DISTANCES = (2, 4, 8)


def _by_blocks(base) -> bool:
    """Whether GEMM2 is the grouped kernel, whose programs walk N tiles of a block (or a slot dedup group)."""
    return base.schedule == "grouped" or base.slot_dedup


def gemm2_splits(base) -> tuple[int, ...]:
    return DEDUP_GEMM2_SPLITS if base.slot_dedup else GEMM2_SPLITS


def launch_forms(plan) -> dict:
    """The best plan with programmatic dependent launch, and (split-K slot schedule) with the fused reduce too;
    with each L2 prefetch distance."""
    rep = dataclasses.replace
    out = {"+pdl": rep(plan, pdl=True)}
    for dist in L2_PREFETCH_DISTANCES if not plan.gemm1.tma else ():  # (a TMA tile has no pointer rows to prefetch)
        out[f"+pdl pf{dist}"] = rep(plan, pdl=True, l2_prefetch=dist)
    if plan.schedule == "slot" and plan.gemm1_split_k > 1:
        out["+pdl fused"] = rep(plan, pdl=True, gemm1_fused_reduce=True)
    if plan.schedule == "slot" and not plan.slot_dedup and not plan.gemm2_split_slots:
        out["+pdl slots"] = rep(plan, pdl=True, gemm2_split_slots=True)
    return out


def selected(variants: dict, only: str | None) -> dict:
    """The default plan and the variants whose name matches regular expression ``only`` (None: all)."""
    if not only:
        return variants
    pattern = re.compile(only)
    return {n: p for n, p in variants.items() if n == "default" or pattern.search(n)}


def run_sweep(shards, tokens, routing, layers_n, progress, on_point=None, only=None, plan_arch=None,
              form=None, device="cuda") -> list[dict]:
    """Whole-layer time of each variant at each (shard, T); the best GEMM1 and GEMM2 choices combined last.
    ``on_point(results so far)`` after each (shard, T), so a run cut by its time limit keeps what it measured.
    ``only``: a regular expression the variants' names must match (the default plan always runs). ``plan_arch``:
    sweep that architecture's default plans and candidate lists instead of this GPU's. ``form``: sweep around an
    opt-in form's plan (configs.OPT_IN) instead of the default one. The calls are the table's (B.call_inputs: the same
    routing, expert map and local accounting); ``device`` "cpu" only under Triton's interpreter (tests)."""
    import torch

    from glm5_fp4.bench import moe as B
    from glm5_fp4.kernels.moe import device_arch
    from glm5_fp4.spec import Glm5Spec

    arch = plan_arch or device_arch(torch.device(device))[0]
    gen = torch.Generator(device=device).manual_seed(1)
    spec = Glm5Spec()
    l2 = B.l2_cache_bytes(device)
    out = []
    for name in shards:
        sh = B.glm5_shard(name) if isinstance(name, str) else name
        count = B.layer_count(sh, layers_n, l2, device)
        lay = B.make_layers(sh, count, gen, device=device)
        for t in tokens:
            call = B.call_inputs(sh, t, routing, gen, device, spec)
            base = arch_plans(plan_arch)(sh, t) if plan_arch else call.plan(lay.prepared[0], form=form)
            res = sweep_point(sh, t, routing, base.schedule, count, call.ids, l2)
            if call.no_work():
                res["skipped"] = call.no_work()
                progress(f"  sweep {sh.name} T={t}: not timed, {res['skipped']}")
                out.append(res)
                if on_point:
                    on_point(out)
                continue
            ref = call.run(lay.prepared[0], base)
            timed = {}
            for vname, plan in selected(sweep_variants(base, sh.hidden, sh.intermediate, arch), only).items():
                t0 = time.time()
                try:
                    o = call.run(lay.prepared[0], plan)
                    diff = B.rel_err(o, ref)
                    if not diff < 2e-3:  # every variant computes the same layer
                        raise AssertionError(f"output differs from the default plan's by {diff:.2e}")
                    timed[vname] = call.time(lay, plan)
                    res["runs"].append({"name": vname, "plan": dataclasses.asdict(plan), "us": timed[vname],
                                        "rel_diff": diff, "wall_s": round(time.time() - t0, 1)})
                except Exception as exc:  # noqa: BLE001
                    res["runs"].append({"name": vname, "plan": dataclasses.asdict(plan), "error": repr(exc)[:400]})
                progress(f"  sweep {sh.name} T={t} {vname}: {timed.get(vname, res['runs'][-1].get('error'))} "
                         f"[{time.time() - t0:.0f}s]")
            if timed:
                plans = sweep_variants(base, sh.hidden, sh.intermediate, arch)
                g1 = min((n for n in timed if n == "default" or n.startswith(("g1", "splitK"))), key=timed.get)
                g2 = min((n for n in timed if n == "default" or n.startswith("g2")), key=timed.get)
                best = dataclasses.replace(plans[g1], gemm2=plans[g2].gemm2, gemm2_n_split=plans[g2].gemm2_n_split,
                                           gemm2_unroll=plans[g2].gemm2_unroll,
                                           gemm2_split_slots=plans[g2].gemm2_split_slots)
                try:
                    us = call.time(lay, best)
                    res["runs"].append({"name": f"best ({g1} + {g2})", "plan": dataclasses.asdict(best), "us": us})
                    progress(f"  sweep {sh.name} T={t} best ({g1} + {g2}): {us:.1f} (default {timed.get('default')})"
                             + (" † layers may be served from L2" if res["l2_may_serve"] else ""))
                except Exception as exc:  # noqa: BLE001
                    res["runs"].append({"name": "best", "plan": dataclasses.asdict(best), "error": repr(exc)[:400]})
                for fname, fplan in launch_forms(best).items():
                    try:
                        diff = B.rel_err(call.run(lay.prepared[0], fplan), ref)
                        if not diff < 2e-3:
                            raise AssertionError(f"output differs from the default plan's by {diff:.2e}")
                        us = call.time(lay, fplan)
                        res["runs"].append({"name": f"best {fname}", "plan": dataclasses.asdict(fplan), "us": us,
                                            "rel_diff": diff})
                        progress(f"  sweep {sh.name} T={t} best {fname}: {us:.1f}")
                    except Exception as exc:  # noqa: BLE001
                        res["runs"].append({"name": f"best {fname}", "plan": dataclasses.asdict(fplan),
                                            "error": repr(exc)[:400]})
            out.append(res)
            if on_point:
                on_point(out)
        del lay
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def sweep_point(sh, t: int, routing: str, schedule: str, layers: int, ids, l2_bytes: int | None) -> dict:
    """A sweep point's header: what it ran and whether its layers' touched weights may sit in L2 (the table's rule,
    B.l2_may_serve: the variants' times may then be L2's, though their ranking still compares like with like). Experts
    and bytes are the measured rank's (B.local_load), as in the table."""
    from glm5_fp4.bench import moe as B
    from glm5_fp4.bench.experts import nvfp4_weight_bytes

    touched = B.local_load(sh, ids)["desc"]["experts_touched"]
    return {"shard": sh.name, "tokens": t, "routing": routing, "schedule": schedule, "layers": layers,
            "experts_touched": touched,
            "l2_may_serve": B.l2_may_serve(layers, nvfp4_weight_bytes(touched, sh.hidden, sh.intermediate), l2_bytes),
            "runs": []}


def sweep_failures(sweeps: list[dict]) -> tuple[int, int]:
    """(runs that failed, runs in all) of a sweep's points (a point skipped for want of local work has none)."""
    runs = [r for p in sweeps for r in p.get("runs", [])]
    return sum("error" in r for r in runs), len(runs)


def plans_from_sweep(path: str, shapes=None):
    """(shard, T) -> the sweep's best plan there, else None (the defaults: a shape the sweep did not visit). A file
    that is no sweep, or one whose point at a (shard name, T) of ``shapes`` has no plan that ran, is a Glm5Fp4Error:
    the table would otherwise time the defaults under a meta.plans naming the sweep."""
    from glm5_fp4.errors import Glm5Fp4Error

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise Glm5Fp4Error(f"--plans {path}: not a readable sweep JSON ({exc})") from None
    sweeps = doc.get("sweeps") if isinstance(doc, dict) else None
    if not sweeps:
        raise Glm5Fp4Error(f"--plans {path}: no sweep points in it (moe_kernel.py --sweep --json writes them)")
    best, empty = {}, set()
    for res in sweeps:
        key = (res["shard"], res["tokens"])
        ok = [r for r in res["runs"] if "us" in r]
        if ok:
            best[key] = _plan_of(min(ok, key=lambda r: r["us"])["plan"])
        else:
            empty.add(key)
    empty -= set(best)
    asked = sorted(empty if shapes is None else empty & set(shapes)) if best else sorted(empty)
    if asked:
        raise Glm5Fp4Error(f"--plans {path}: no plan ran at {', '.join(f'{s} T={t}' for s, t in asked)} (every variant "
                           "failed or was not timed there; the errors are in the file): sweep those shapes again or "
                           "leave them out of --shards/--tokens")

    def lookup(shard, t):
        return best.get((shard.name, t))

    return lookup


def arch_plans(arch: str):
    """(shard, T) -> the plan ``arch`` would make for that call (its tables, rules and SM count), W4A16."""
    from glm5_fp4.kernels import configs as C

    def lookup(shard, t):
        return C.plan(arch, t, shard.num_experts, shard.top_k, shard.hidden, shard.intermediate,
                      sm_count=C.sm_count_guess(arch),
                      global_experts=shard.global_experts if shard.expert_parallel else None)

    lookup.arch = arch
    return lookup


def precompile(shards, tokens, jobs: int, progress, sweep: bool = False, only: str | None = None,
               plan_for=None, form: str | None = None) -> None:
    """Compile every kernel the default plans will launch (``sweep``: every sweep variant's too), ``jobs``
    processes at a time, into Triton's on-disk cache (the timed runs then load them): compilation dominates a
    short benchmark's wall time, and a sweep compiles ~20 plans per (shard, T) one after another."""
    import torch

    from glm5_fp4.bench import moe as B

    # the plans are made here once and handed to the workers (None: the worker's default plan)
    work = [(s, t, plan_for(B.glm5_shard(s), t) if plan_for else None) for s in shards for t in tokens]
    if sweep:
        work = [(s, t, plan) for s, t, _ in work
                for plan in selected(_sweep_plans(s, t, plan_for, form), only).values()]
        torch.cuda.empty_cache()  # the plans' empty weights: nothing of them is needed past this point
    precompile_plans(work, jobs, progress)


def precompile_plans(work, jobs: int, progress) -> None:
    """Compile the launches of each (shard name, T, plan or None for the default plan) of ``work``, ``jobs``
    spawned processes at a time (they inherit this process's environment: its Triton cache and settings)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        kernels = sum(ex.map(_precompile_one, work))
    progress(f"precompiled {kernels} launches of {len(work)} plans with {jobs} processes in {time.time() - t0:.0f}s")


def _empty_call(shard: str, t: int):
    """A call of ``shard``'s shapes at ``t`` tokens with uninitialised weights: the kernels specialise on shapes,
    dtypes, alignment and the expert layout, not on values."""
    import torch

    from glm5_fp4.bench import moe as B
    from glm5_fp4.kernels.layout import PreparedExperts, default_layout
    from glm5_fp4.kernels.moe import Workspace, make_call

    sh = B.glm5_shard(shard)
    dev = torch.device("cuda")
    e, h, i, k = sh.num_experts, sh.hidden, sh.intermediate, sh.top_k
    u8 = lambda *s: torch.empty(*s, dtype=torch.uint8, device=dev)  # noqa: E731
    f32 = lambda: torch.ones(e, dtype=torch.float32, device=dev)  # noqa: E731
    # the layout the timed runs prepare (layout.default_layout()): a kernel specialised for another one is a
    # cache miss there
    prep = PreparedExperts(u8(e, 2 * i, h // 2), u8(e, 2 * i, h // 16), f32(), u8(e, h, i // 2), u8(e, h, i // 16),
                           f32(), f32(), f32(), f32(), f32(), layout=default_layout())
    x = torch.zeros(t, h, dtype=torch.bfloat16, device=dev)
    ids = torch.zeros(t, k, dtype=torch.int32, device=dev)
    tw = torch.zeros(t, k, dtype=torch.float32, device=dev)
    return sh, x, ids, prep, make_call(x, tw, ids, prep, "w4a16", expert_map=B.expert_map_for(sh, dev),
                                       workspace=Workspace(dev, e, k, h, i, t))


def _sweep_plans(shard: str, t: int, plan_for=None, form: str | None = None) -> dict:
    """The sweep's plans at (``shard``, ``t``) by name (``plan_for``: an :func:`arch_plans` lookup; ``form``: around
    that opt-in form's plan)."""
    import torch

    from glm5_fp4.kernels.moe import default_plan, device_arch

    sh, x, ids, prep, call = _empty_call(shard, t)
    if plan_for is not None:
        return sweep_variants(plan_for(sh, t), sh.hidden, sh.intermediate, plan_for.arch)
    arch, _ = device_arch(torch.device("cuda"))
    return sweep_variants(default_plan(x, ids, prep, "w4a16", call.expert_map, form=form), sh.hidden,
                          sh.intermediate, arch)


def _precompile_one(item) -> int:
    from glm5_fp4.kernels.launch import launches
    from glm5_fp4.kernels.moe import default_plan

    shard, t, plan = item
    _, x, ids, prep, call = _empty_call(shard, t)
    n = 0
    try:
        for launch in launches(plan or default_plan(x, ids, prep, "w4a16", call.expert_map), call):
            launch.fn.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
            n += 1
    except Exception as exc:  # noqa: BLE001 - a plan that does not build fails again, by name, in the sweep
        print(f"precompile {shard} T={t} {plan or 'default plan'}: {exc!r}"[:300], flush=True)
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="tp8,tp4", help="tp8, tp4, ... and/or ep8 (32 whole experts)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--routings", default="balanced,same_k,one_hot,zipf1.2,zipf2")
    ap.add_argument("--layers", type=int, default=None,
                    help="distinct expert sets per graph; default: per shard, enough that the fewest experts a "
                         "routing touches overflow twice the GPU's L2 (at least 4)")
    ap.add_argument("--no-baselines", action="store_true", help="skip torch's bf16/fp8 grouped GEMMs")
    ap.add_argument("--no-marlin", action="store_true", help="skip vLLM's Marlin MoE")
    ap.add_argument("--w4a4", action="store_true", help="also time the W4A4 emulation mode")
    ap.add_argument("--stages", action="store_true", help="also time align and align+gemm1 alone")
    ap.add_argument("--sweep", action="store_true", help="config sweep (whole-layer time per variant)")
    ap.add_argument("--sweep-routing", default="balanced")
    ap.add_argument("--only", metavar="REGEX", help="sweep only the variants whose names match (and the default)")
    ap.add_argument("--plans", help="a --sweep JSON whose best plans replace the defaults where swept")
    ap.add_argument("--form", help="with --sweep: sweep around this opt-in form's plan (glm5_fp4/kernels/configs.py "
                    "OPT_IN) instead of the default plan")
    from glm5_fp4.bench import mma as MMA

    MMA.add_standin_arguments(ap)
    ap.add_argument("--precompile", type=int, default=0, metavar="JOBS", help="compile the default plans' kernels "
                    "(with --sweep: every variant's) in JOBS processes first")
    ap.add_argument("--json", default=None, help="results (default: benchmarks/results/moe_kernel_<gpu>.json, the GPU "
                    "as the hardware table names it)")
    ap.add_argument("--md", default=None, help="the table (default: the --json path with .md)")
    args = ap.parse_args(argv)
    if args.plan_arch and args.plans:
        ap.error("--plan-arch replaces the plans: it does not combine with --plans")
    if args.form and (not args.sweep or args.plan_arch):
        ap.error("--form picks the plan a --sweep varies (on this GPU's arch): it needs --sweep, not --plan-arch")
    from glm5_fp4.kernels import configs as C

    if args.form and args.form not in C.OPT_IN:
        ap.error(f"unknown --form {args.form!r}; choose from {sorted(C.OPT_IN)}")
    from glm5_fp4.bench import moe as B
    from glm5_fp4.bench import routing as R
    from glm5_fp4.bench.meta import git_sha
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.outputs import output_file, write_file

    try:  # every value before any GPU work ('tp8,tpx' measured tp8, then died on tpx)
        shards, tokens = B.shard_names(args.shards), B.token_counts(args.tokens)
        routings = B.routing_names(args.routings)
        R.check(args.sweep_routing)
        if args.layers is not None and args.layers < 1:
            raise Glm5Fp4Error(f"--layers {args.layers}: at least one layer per CUDA graph")
        if args.precompile < 0:
            raise Glm5Fp4Error(f"--precompile {args.precompile}: a number of compile jobs (0: none)")
        for flag, path in (("--json", args.json), ("--md", args.md)):
            if path is not None:  # (written after the whole run: a bad path lost every row)
                output_file(path, flag)
        git_sha()  # a GLM5_FP4_GIT_SHA that names no commit
    except Glm5Fp4Error as exc:
        ap.error(str(exc))
    if args.plans and not Path(args.plans).is_file():
        print(f"--plans {args.plans}: no such sweep JSON (moe_kernel.py --sweep --json writes one)", file=sys.stderr)
        return 2
    lookup = arch_plans(args.plan_arch) if args.plan_arch else None
    if args.plans and not args.sweep:
        try:
            lookup = plans_from_sweep(args.plans, [(s, t) for s in shards for t in tokens])
        except Glm5Fp4Error as exc:
            print(exc, file=sys.stderr)
            return 2

    cache = MMA.force_mma_sync() if args.mma_sync else None  # before anything compiles (the workers inherit it)
    import torch

    if not torch.cuda.is_available():
        print("moe_kernel benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.json is None:  # one file per GPU: an H100's run no longer overwrites the committed H200 table
        from glm5_fp4.hardware import detect_gpu_name

        args.json = str(RESULTS / f"moe_kernel_{detect_gpu_name(torch.cuda.get_device_name()) or 'gpu'}.json")
    args.md = args.md or str(Path(args.json).with_suffix(".md"))
    from glm5_fp4.bench.meta import result_metadata

    meta = result_metadata(benchmark="moe_kernel", layers=args.layers, shards=shards, tokens=tokens, routings=routings,
                           plans=args.plans or "built-in defaults (glm5_fp4/kernels/configs.py)",
                           plan_arch=args.plan_arch, form=args.form,
                           mma="mma.sync (forced)" if args.mma_sync else "Triton's choice")

    def progress(msg):
        print(msg, flush=True)

    def save(out):
        doc = dict(meta=dict(meta, copy_gbs=out.get("copy_gbs"), bf16_tflops=out.get("bf16_tflops"),
                             marlin=out.get("marlin"), l2_bytes=out.get("l2_bytes"),
                             layers=out.get("layers") or {s["shard"]: s["layers"] for s in out.get("sweeps", [])}
                             or meta["layers"]),
                   rows=out.get("rows", []), sweeps=out.get("sweeps", []))
        write_file(args.json, json.dumps(doc, indent=1, default=str))
        ok = [r for r in doc["rows"] if "us" in r or "error" in r or "skipped" in r]
        if ok and not args.sweep:
            write_file(args.md, B.markdown(doc["meta"], ok))

    if args.precompile:
        try:
            precompile(shards, tokens, args.precompile, progress, sweep=args.sweep, only=args.only, plan_for=lookup,
                       form=args.form)
        except Exception:  # noqa: BLE001 - compiling in the timed run instead only costs time
            traceback.print_exc()
    def built_as_asked(out) -> bool:
        """--mma-sync: record what Triton built; False (and an error row) where a kernel still uses wgmma, since
        a Triton that ignores the variable would time wgmma under an mma.sync label."""
        if cache is None:
            return True
        meta["compiled_mma"], still = MMA.what_was_built(cache)
        if still:
            out.setdefault("rows", []).append({"shard": "-", "tokens": 0, "routing": "-",
                                               "error": f"--mma-sync: still wgmma in {still}"})
        return not still

    if args.sweep:
        out = {"sweeps": run_sweep(shards, tokens, args.sweep_routing, args.layers, progress,
                                   on_point=lambda sw: save({"sweeps": sw}), only=args.only,
                                   plan_arch=args.plan_arch, form=args.form), "l2_bytes": B.l2_cache_bytes()}
        ok = built_as_asked(out)
        save(out)
        failed, runs = sweep_failures(out["sweeps"])
        if failed == runs:
            print(f"--sweep: no variant ran at any point ({failed} runs failed; their errors are in {args.json})",
                  file=sys.stderr)
            return 1
        if failed:
            print(f"--sweep: {failed} of {runs} runs failed (their errors are in {args.json})", file=sys.stderr)
        return 0 if ok and not failed else 1
    out = B.run_table(shards, tokens, routings, layers=args.layers, marlin=not args.no_marlin,
                      baselines=not args.no_baselines, w4a4=args.w4a4, stages=args.stages, plan_for=lookup,
                      progress=progress, on_row=save)
    built_as_asked(out)
    save(out)
    bad = [r for r in out["rows"] if "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
