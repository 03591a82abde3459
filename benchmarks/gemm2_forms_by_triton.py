"""GEMM2's two operand forms compiled ahead of time (no GPU) under the installed Triton: shared memory, registers
and spills per (target, I, tile, form). Run it once per Triton (one venv each) and compare the JSON files: Triton
3.8 feeds the eight-MMA form's (merged=False) decoded operands through shared memory, 3.6 / 3.7.1 / 3.9 do not
(glm5_fp4/kernels/configs.py, triton_stages_mma_sets; README, SM120 section).

    python benchmarks/gemm2_forms_by_triton.py --json benchmarks/results/gemm2_forms_triton38.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

TILES = [(64, 16, 4, 2), (64, 32, 8, 2), (128, 16, 4, 2), (128, 64, 8, 3)]
INTERMEDIATE = (256, 512, 2048)  # the TP8 and TP4 shards, whole experts
TARGETS = (90, 120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="where the rows and the versions go")
    args = ap.parse_args(argv)

    import triton

    from glm5_fp4.bench.meta import result_metadata
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.sm120 import aot

    rows = []
    for cc, i, (bn, bm, w, s), merged in itertools.product(TARGETS, INTERMEDIATE, TILES, (False, True)):
        cfg = C.Gemm2Config(bn, bm, w, s, merged=merged)
        row = dict(cc=cc, intermediate=i, bn=bn, bm=bm, num_warps=w, num_stages=s, merged=merged)
        try:
            b = aot.compile_gemm2(cfg, cc, intermediate=i, n_split=4)
            row.update(shared_bytes=b.shared_bytes, registers=b.registers, spill_store_bytes=b.spill_store_bytes,
                       estimate_bytes=C.gemm2_smem_bytes(cfg, i))
        except Exception as e:  # a form this Triton cannot build is a result too
            row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"meta": result_metadata(("triton",), triton=triton.__version__,
                                      stages_mma_sets=C.triton_stages_mma_sets()), "rows": rows}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    over = [r for r in rows if "shared_bytes" in r and r["shared_bytes"] > r["estimate_bytes"]]
    print(f"triton {triton.__version__}: {len(rows)} kernels, {len(over)} above the shared-memory estimate",
          file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
