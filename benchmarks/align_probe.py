"""What the grouped schedule's align launch spends its time on (issue 13; improvements/19 found it at 17.7 us of a
TP8 T=512 layer on an H100, 6 %). The align kernel's program 0 counts and places the routing serially while the
other programs zero the fp32 combine buffer and, with prepared activations, write x in GEMM1's merged K order;
this times the planned launch beside variants of it (CUDA-graph replays of the align launch alone, 8 per graph):

* ``planned``: the launch as the default plan makes it;
* ``program0``: its program 0 only (the routing: counts, work list, slot placement);
* ``no_prep``: every program, without the activation conversion (zeroing only beside program 0);
* ``zero_rows``: the same grid with a one-slot routing count, so program 0 has almost nothing to count or place:
  the zeroing and conversion alone.

Wrong results by design (the variants leave parts undone); nothing here checks outputs.

    python3 benchmarks/align_probe.py --tokens 64,256,512,1024 --json align_probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard", default="tp8")
    ap.add_argument("--tokens", default="64,256,512,1024")
    ap.add_argument("--json", default="align_probe.json")
    args = ap.parse_args(argv)
    from glm5_fp4.bench import moe as B
    from glm5_fp4.bench.meta import git_sha, result_metadata
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.outputs import output_file, write_file

    try:  # every value before any GPU work (a bad one died after the layer was built, or after timing)
        B.glm5_shard(args.shard)
        tokens = B.token_counts(args.tokens)
        output_file(args.json, "--json")
        git_sha()  # a GLM5_FP4_GIT_SHA that names no commit
    except Glm5Fp4Error as exc:
        ap.error(str(exc))
    import torch

    if not torch.cuda.is_available():
        print("align_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    from glm5_fp4.bench.timing import graph_time_us
    from glm5_fp4.kernels import launch as L
    from glm5_fp4.kernels.moe import make_call

    sh, lay, gen = B.one_cuda_layer(args.shard)
    rows = []
    for t in tokens:
        # the benchmarks' call builder: on an expert-parallel shard rank 0's expert map goes into plan and call
        inputs = B.call_inputs(sh, t, "balanced", gen)
        plan = inputs.plan(lay.prepared[0])
        if plan.schedule != "grouped":  # the slot schedule of small T has no align kernel to probe: said
            print(f"T={t}: {plan.schedule} schedule, no grouped align to probe: skipped", flush=True)
            rows.append({"tokens": t, "skipped": f"{plan.schedule} schedule (no grouped align)"})
            continue
        call = make_call(inputs.x, inputs.tw, inputs.ids, lay.prepared[0], "w4a16", expert_map=inputs.expert_map)
        (base,) = L.launches(dataclasses.replace(plan, parallel_align=False), call, stages=("align",))
        forms = {
            "planned": [base],
            "program0": [dataclasses.replace(base, grid=(1,))],
            "no_prep": [dataclasses.replace(base, kwargs=dict(base.kwargs, PREP_X=False))],
            # num_slots (the second argument) = 1: program 0 counts and places one slot, the rest is unchanged
            "zero_rows": [dataclasses.replace(base, args=base.args[:1] + (1,) + base.args[2:])],
        }
        if plan.parallel_align:
            forms["parallel_align"] = L.launches(plan, call, stages=("align",))
        row = {"tokens": t, "grid": base.grid[0], "plan_parallel_align": plan.parallel_align}
        for name, todo in forms.items():
            row[name] = graph_time_us(lambda: [[la() for la in todo] for _ in range(8)]) / 8
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = result_metadata(benchmark="align_probe", shard=args.shard)
    write_file(args.json, json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
