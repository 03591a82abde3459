"""Compile only the kernels the opt-in plan forms (configs.OPT_IN) add, for sm_120/sm_100/sm_90, on a CPU: the rows
of the compile matrix whose every origin is an opt-in selection (the full matrix takes over 25 min on 2 cores).

    python benchmarks/compile_opt_in.py [sm120,sm100,sm90 [kernel,...]]   # exit 1 if any fails to compile, spills or
                                                                        # overflows
"""

from __future__ import annotations

import sys
import tempfile
import time

from triton import knobs

from glm5_fp4.sm120 import matrix as M

SHOWN = ("DEDUP", "SLOT_DEDUP", "SPLIT_K", "SP", "ROWS", "FUSED_REDUCE", "PAR", "BM", "BN", "KC", "I", "NT", "BN2")


def main(argv: list[str]) -> int:
    archs = tuple(argv[0].split(",")) if argv else ("sm120", "sm100", "sm90")
    t0 = time.time()
    todo = M.plan_rows(archs, candidates=False)
    opt = [(r, sp) for r, sp in todo if r.origins and all("opt-in" in o for o in r.origins)]
    if len(argv) > 1:  # only these kernels
        opt = [(r, sp) for r, sp in opt if r.kernel in argv[1].split(",")]
    print(len(todo), "rows;", len(opt), "only from opt-in forms", flush=True)
    with tempfile.TemporaryDirectory() as tmp, knobs.cache.scope():
        knobs.cache.dir = tmp  # an empty cache: every kernel really built
        rows = M._compile_all(opt, 2)
    bad = 0
    for r in rows:
        b = r.build or {}
        cx = sorted((k, v) for k, v in r.constexprs.items() if k in SHOWN)
        print(f"{r.arch} {r.kernel} {cx} w={r.num_warps} s={r.num_stages} smem={b.get('shared_bytes')} "
              f"regs={b.get('registers')} spill={b.get('spill_store_bytes')} err={r.error and r.error[:200]} "
              f"problems={r.problems}", flush=True)
        bad += bool(r.error or r.problems)
    print("elapsed", round(time.time() - t0), "s; bad", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
