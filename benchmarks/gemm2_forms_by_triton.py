"""GEMM2's two operand forms compiled ahead of time (no GPU) under the installed Triton: shared memory, registers
and spills per (target, I, tile, form). Run it once per Triton (one venv each) and compare the JSON files: Triton
3.8 feeds the eight-MMA form's (merged=False) decoded operands through shared memory, 3.6 / 3.7.1 / 3.9 do not
(glm5_fp4/kernels/configs.py, triton_stages_mma_sets; README, SM120 section).

    python benchmarks/gemm2_forms_by_triton.py --json benchmarks/results/gemm2_forms_triton38.json
    python benchmarks/gemm2_forms_by_triton.py --compare benchmarks/results/gemm2_forms_triton3*.json \
        --md benchmarks/results/gemm2_forms_by_triton.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from packaging.version import Version

TILES = [(64, 16, 4, 2), (64, 32, 8, 2), (128, 16, 4, 2), (128, 64, 8, 3)]
INTERMEDIATE = (256, 512, 2048)  # the TP8 and TP4 shards, whole experts
TARGETS = (90, 120)


def _cell(r: dict) -> str:
    if "error" in r:
        return r["error"][:40]
    spill = f" / spill {r['spill_store_bytes']} B" if r["spill_store_bytes"] else ""
    return f"{r['shared_bytes']:,} B / {r['registers']} regs{spill}"


def compare(paths: list[str]) -> str:
    """One markdown table: a row per kernel, a column per Triton (the files of earlier runs)."""
    runs = [json.load(open(p)) for p in paths]
    runs.sort(key=lambda d: Version(d["meta"]["triton"]))
    key = ("cc", "intermediate", "bn", "bm", "num_warps", "num_stages", "merged")
    table: dict[tuple, dict[str, dict]] = {}
    for d in runs:
        for r in d["rows"]:
            table.setdefault(tuple(r[k] for k in key), {})[d["meta"]["triton"]] = r
    versions = [d["meta"]["triton"] for d in runs]
    lines = ["# GEMM2's operand forms by Triton version (AOT, no GPU)", "",
             "Shared memory per block / registers per thread (/ ptxas spill stores) of `moe_gemm2_grouped_kernel`, "
             "compiled for the target without a GPU by `benchmarks/gemm2_forms_by_triton.py` under each Triton "
             "(one venv each). " + "; ".join(f"Triton {d['meta']['triton']}: {d['meta']['date']}, git "
                                             f"{d['meta']['git_sha']}" for d in runs) + ".", "",
             "| target | I | tile (bn x bm, warps, stages) | form | " + " | ".join(versions) + " |",
             "|---|---|---|---|" + "---|" * len(versions)]
    for (cc, i, bn, bm, w, s, merged), by_version in table.items():
        cells = [_cell(by_version[v]) if v in by_version else "-" for v in versions]
        lines.append(f"| sm_{cc} | {i} | {bn}x{bm}, {w}, {s} | {'merged' if merged else 'eight MMAs'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="where the rows and the versions go")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="tabulate earlier runs instead of compiling")
    ap.add_argument("--md", help="with --compare: write the table here (default: print it)")
    args = ap.parse_args(argv)
    if args.compare:
        md = compare(args.compare)
        if args.md:
            open(args.md, "w").write(md)
        else:
            print(md, end="")
        return 0
    if not args.json:
        ap.error("--json (where the results go) or --compare")

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
