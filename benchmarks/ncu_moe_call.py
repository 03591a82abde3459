"""One fused MoE call under Nsight Compute: what limits the kernels at a given shape (issue 13's "what limits
it, from ncu"). Compiles and runs the call once outside the profiled range, then once inside it
(torch.cuda.profiler.start/stop, so ncu's --profile-from-start off skips the warm-up and the weight set-up).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats --csv --page details \\
        python3 benchmarks/ncu_moe_call.py --shard tp8 --tokens 8192 --routing balanced > ncu.csv

``--plans SWEEP.json`` profiles the sweep's best plan at that (shard, T) instead of the default, ``--form NAME``
an opt-in form of the default.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard", default="tp8")
    ap.add_argument("--tokens", default="8192", help="one token count")
    ap.add_argument("--routing", default="balanced")
    ap.add_argument("--plans", help="a moe_kernel.py --sweep JSON: its best plan at this (shard, T)")
    ap.add_argument("--form", help="an opt-in plan form of glm5_fp4.kernels.configs.OPT_IN instead of the default")
    ap.add_argument("--diag", type=int, default=0, help="launch.DIAG_* bits (wrong results: e.g. 1 = the decode "
                    "left out, to see which pipes it keeps busy)")
    args = ap.parse_args(argv)
    from glm5_fp4.bench import moe as B
    from glm5_fp4.bench import routing as R
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.kernels import configs as C

    try:  # every value before the layer is built (each died after it, with a traceback)
        B.glm5_shard(args.shard)
        tokens = B.token_counts(args.tokens)
        if len(tokens) != 1:
            raise Glm5Fp4Error(f"--tokens {args.tokens!r}: one token count (one call is profiled)")
        R.check(args.routing)
        if args.form is not None and args.form not in C.OPT_IN:
            raise Glm5Fp4Error(f"--form {args.form!r}: not an opt-in form; choose from {sorted(C.OPT_IN)}")
        if args.diag < 0:
            raise Glm5Fp4Error(f"--diag {args.diag}: launch.DIAG_* bits, 0 or more")
        if args.plans and not Path(args.plans).is_file():
            raise Glm5Fp4Error(f"--plans {args.plans}: no such sweep JSON (moe_kernel.py --sweep --json writes one)")
    except Glm5Fp4Error as exc:
        ap.error(str(exc))
    args.tokens = tokens[0]
    import torch

    if not torch.cuda.is_available():
        print("ncu_moe_call needs a CUDA GPU", file=sys.stderr)
        return 2
    from glm5_fp4.kernels.moe import fused_moe_triton

    sh, lay, gen = B.one_cuda_layer(args.shard)
    # the benchmarks' call builder: on an expert-parallel shard rank 0's expert map and the hot experts on it
    call = B.call_inputs(sh, args.tokens, args.routing, gen)
    if call.no_work():
        print(f"ncu_moe_call: {call.no_work()}", file=sys.stderr)
        return 2
    plan = call.plan(lay.prepared[0], form=args.form)
    if args.plans:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from moe_kernel import plans_from_sweep

        plan = plans_from_sweep(args.plans)(sh, args.tokens) or plan
    print(f"plan: {plan}", file=sys.stderr)
    run = lambda: fused_moe_triton(call.x, call.tw, call.ids, lay.prepared[0], plan=plan, diag=args.diag,  # noqa: E731
                                   expert_map=call.expert_map)
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
