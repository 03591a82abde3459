"""Same-run timing of the fused MoE's default form against its opt-in variants (issue 13), one GPU call.

For each (TP shard, T, routing): the default (layout.default_layout(), the built-in plan), and each variant on the
same layers, inputs and plan, each checked against the default's output first (a variant that computes a
different layer is reported as an error, never timed). Timed in the order default, variants, default again:
the two default times bound the drift within the row. Variants:

* ``other layouts``: weights in each decode layout that is not the default ("split": the plain nibble order,
  2 more bit operations per decoded word than "placed", SASS counts in
  benchmarks/results/moe_kernel_sass_sm90_placed.json; "tiled": "placed" with GEMM1's weights K-tile-major).
* each alternative plan form of ``glm5_fp4.kernels.configs.OPT_IN`` where it serves and changes the default
  plan (its schedule, batch sizes and mode): ``fused_reduce`` (slot split-K reduced by GEMM1's last program),
  ``slot_dedup`` (one program group per expert below T = 3, where it is not the default), ``per_slot`` (the
  per-slot form the dedup default replaced), ``parallel_align``, ``grouped_split2`` and ``grouped_unsplit``
  (grouped GEMM1 in 2 K ranges / all of K, against the skew-sized default). The table is the one home of the
  alternatives; this script follows it.
* ``nodecode`` (wrong results, not checked; --nodecode): the decode of GEMM1 and the grouped GEMM2 left out
  (DIAG=1: each packed word, read as an fp16 pair, times its block scales), so the difference to the default is
  the most any cheaper decode could gain: 8-11 % at TP8 T = 64-1,024 on the H200 (2026-12-03, improvements/12).
  The stand-in before 52c7f17 (int->fp16 conversions) ran slower than the real decode and was no bound.
* ``noatomic`` (wrong results, not checked; --noatomic): the grouped GEMM2 stores its output tiles where it
  would add them atomically into the fp32 combine workspace (DIAG_PLAIN_STORES): the same bytes, so the
  difference is what the atomics cost (at prefill sizes the workspace, T*H*4 bytes, outgrows L2).

The H200 run that made "placed" the default: benchmarks/results/moe_variants_h200.json (its layout names
are absolute: "default" there was split).

    python benchmarks/moe_variants.py --json variants.json   # TP8, T=1,4,64,512,4096, balanced + same_k
    python benchmarks/moe_variants.py --plan-arch sm120 --mma-sync --forms sm120_former   # sm_120's plans, H200

``--plan-arch`` / ``--mma-sync``: as benchmarks/moe_kernel.py's (another arch's plans; the dots as mma.sync).
Distinct layers per CUDA graph, inputs and expert maps are the table's (glm5_fp4.bench.moe: ``layer_count``,
``call_inputs``); each row records its layers and whether they may be served from L2 (``l2_may_serve``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

DEVICE = "cuda"  # the tests run the script's bookkeeping on the CPU


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="tp8")
    ap.add_argument("--tokens", default="1,4,64,512,4096")
    ap.add_argument("--routings", default="balanced,same_k")
    ap.add_argument("--layers", type=int, default=None,
                    help="distinct expert sets per graph; default: the table's rule, enough that the fewest experts a "
                         "routing touches overflow twice the GPU's L2 (at least 4)")
    ap.add_argument("--json", default="moe_variants.json")
    ap.add_argument("--forms", help="comma-separated opt-in forms to time (default: all of configs.OPT_IN and the "
                    "other weight layout)")
    ap.add_argument("--nodecode", action="store_true", help="also time the layer with its decode left out (see above)")
    from glm5_fp4.bench import mma as MMA

    MMA.add_standin_arguments(ap)
    ap.add_argument("--precompile", type=int, default=0, metavar="JOBS", help="compile every plan the run will time "
                    "in JOBS processes first (benchmarks/moe_kernel.py's precompile)")
    ap.add_argument("--noatomic", action="store_true", help="also time GEMM2 with plain stores instead of its "
                    "atomic adds (wrong results, not checked): the combine's cost")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    from glm5_fp4.bench import moe as B
    from glm5_fp4.bench.meta import git_sha
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.kernels import configs as C  # (a bad --forms is refused before any GPU work)
    from glm5_fp4.outputs import output_file, write_file
    from glm5_fp4.kernels.layout import DECODE_LAYOUTS as layouts

    forms = set(args.forms.split(",")) if args.forms else None
    unknown = forms - set(C.OPT_IN) - set(layouts) if forms else set()
    if unknown:
        ap.error(f"unknown --forms {sorted(unknown)}; choose from {sorted(C.OPT_IN)} or a weight layout {layouts}")
    try:
        shards, tokens = B.shard_names(args.shards), B.token_counts(args.tokens)
        routings = B.routing_names(args.routings)
        if args.layers is not None and args.layers < 1:
            raise Glm5Fp4Error(f"--layers {args.layers}: at least one layer per CUDA graph")
        if args.precompile < 0:
            raise Glm5Fp4Error(f"--precompile {args.precompile}: a number of compile jobs (0: none)")
        output_file(args.json, "--json")  # (written after the timed rows)
        git_sha()  # a GLM5_FP4_GIT_SHA that names no commit
    except Glm5Fp4Error as exc:
        ap.error(str(exc))
    cache = MMA.force_mma_sync() if args.mma_sync else None  # before anything compiles
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("moe_variants needs a CUDA GPU", file=sys.stderr)
        return 2
    from glm5_fp4.bench.meta import result_metadata
    from glm5_fp4.bench.timing import copy_bandwidth_gbs
    from glm5_fp4.kernels import prepare_experts
    from glm5_fp4.kernels.moe import device_arch, plan_for
    from glm5_fp4.kernels.launch import DIAG_NO_DECODE, DIAG_PLAIN_STORES
    from glm5_fp4.kernels.layout import default_layout

    l2 = B.l2_cache_bytes(DEVICE)
    meta = result_metadata(benchmark="moe_variants", layers={}, l2_bytes=l2, shards=shards, tokens=tokens,
                           routings=routings, copy_gbs=round(copy_bandwidth_gbs(), 1),
                           opt_in={name: o.purpose for name, o in C.OPT_IN.items()},  # what each variant is for
                           plan_arch=args.plan_arch, mma="mma.sync (forced)" if args.mma_sync else "Triton's choice")
    arch, sms = device_arch(torch.device(DEVICE))
    if args.plan_arch:
        arch, sms = args.plan_arch, C.sm_count_guess(args.plan_arch)
    rows: list[dict] = []

    def save():
        write_file(args.json, json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))

    if args.precompile:  # the default and every form's plan at each (shard, T): plans do not depend on the routing
        from moe_kernel import _empty_call, precompile_plans

        work = []
        for name in shards:
            for t in tokens:
                sh, _, _, prep, call = _empty_call(name, t)
                base = plan_for(arch, sms, t, sh.top_k, prep, "w4a16", call.expert_map)
                work.append((name, t, base))
                for form in (forms or C.OPT_IN):
                    if form in C.OPT_IN:
                        vplan = plan_for(arch, sms, t, sh.top_k, prep, "w4a16", call.expert_map, form=form)
                        if vplan != base:
                            work.append((name, t, vplan))
        precompile_plans(work, args.precompile, lambda m: print(m, flush=True))
    gen = torch.Generator(device=DEVICE).manual_seed(13)
    for name in shards:
        sh = B.glm5_shard(name)
        count = meta["layers"][name] = B.layer_count(sh, args.layers, l2, DEVICE)
        lay = B.make_layers(sh, count, gen, device=DEVICE)
        others = [lo for lo in layouts if lo != default_layout() and (not forms or lo in forms)]
        alts = {lo: B.Layers(sh, [prepare_experts(e, layout=lo) for e in lay.experts], lay.experts) for lo in others}
        # name -> (layers, DIAG, checked against the default, opt-in form or None)
        variants = {**{lo: (alt, 0, True, None) for lo, alt in alts.items()},
                    **{form: (lay, 0, True, form) for form in C.OPT_IN}}
        if forms:
            variants = {n: v for n, v in variants.items() if n in forms}
        if args.nodecode:
            variants["nodecode"] = (lay, DIAG_NO_DECODE, False, None)
        if args.noatomic:
            variants["noatomic"] = (lay, DIAG_PLAIN_STORES, False, None)
        for t in tokens:
            for routing in routings:
                t0 = time.time()
                call = B.call_inputs(sh, t, routing, gen, DEVICE)
                plan = plan_for(arch, sms, t, sh.top_k, lay.prepared[0], "w4a16", call.expert_map)
                row = {"shard": name, "tokens": t, "routing": routing, "plan": dataclasses.asdict(plan),
                       "plan_label": B.plan_label(dataclasses.asdict(plan)), "layers": count,
                       "experts_touched": call.desc["experts_touched"],
                       "l2_may_serve": B.l2_may_serve(count, call.weight_bytes, l2), "us": {}, "errors": {}}
                if call.no_work():
                    row["skipped"] = call.no_work()
                    variants_here = {}
                else:
                    variants_here = variants
                    try:
                        ref = call.run(lay.prepared[0], plan)
                        row["us"]["default"] = call.time(lay, plan)
                    except Exception as exc:  # noqa: BLE001 - the row records it
                        row["errors"]["default"] = repr(exc)[:400]
                for vname, (layers, diag, check, form) in variants_here.items():
                    vplan = (plan_for(arch, sms, t, sh.top_k, lay.prepared[0], "w4a16", call.expert_map, form=form)
                             if form else plan)
                    if form and vplan == plan:
                        continue  # the form does not serve here, or is the default: nothing to compare
                    try:
                        if check:
                            o = call.run(layers.prepared[0], vplan)
                            diff = B.rel_err(o, ref)
                            row.setdefault("rel_diff", {})[vname] = diff
                            if not diff < 2e-3:  # the same layer, up to fp32 atomics order
                                raise AssertionError(f"output differs from the default's by {diff:.2e}")
                        row["us"][vname] = call.time(layers, vplan, diag=diag)
                    except Exception as exc:  # noqa: BLE001
                        row["errors"][vname] = repr(exc)[:400]
                if "default" in row["us"]:
                    row["us"]["default_again"] = call.time(lay, plan)
                row["wall_s"] = round(time.time() - t0, 1)
                rows.append(row)
                save()
                us = {k: round(v, 1) for k, v in row["us"].items()}
                print(f"{name} T={t} {routing}: {us} {row['errors'] or row.get('skipped') or ''} [{row['wall_s']}s]",
                      flush=True)
        del lay, alts
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if cache is not None:
        meta["compiled_mma"], meta["still_wgmma"] = MMA.what_was_built(cache)
    save()
    return 1 if any(r["errors"] for r in rows) or meta.get("still_wgmma") else 0


if __name__ == "__main__":
    raise SystemExit(main())
