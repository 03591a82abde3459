"""Stall samples per SASS instruction from an ncu source-page export (no GPU needed): per kernel, the samples by
opcode and the hottest instructions with their share, from the files ``benchmarks/h200/small_t_two_launch_job.sh
source`` keeps under benchmarks/results (``*_ncu_source_*.csv.gz``). The shares the write-ups cite come from here.

    python3 benchmarks/ncu_stalls.py benchmarks/results/moe_kernel_h100_ncu_source_tp8_t1024_7635a60.csv.gz \\
        --kernel gemm2 --top 12                       # one kernel (name substring), its 12 hottest instructions
    python3 benchmarks/ncu_stalls.py FILE --kernel gemm2 --listing 495:520    # instructions 495..519 in order
    python3 benchmarks/ncu_stalls.py FILE --json stalls.json --md stalls.md  # every kernel
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling import ncu_source as N


def _span(text: str) -> tuple[int, int]:
    try:
        a, b = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--listing wants FIRST:END (instruction indices), got {text!r}") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"--listing {text}: want 0 <= FIRST < END")
    return a, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="ncu --page source --csv --print-source sass export (.csv or .csv.gz)")
    ap.add_argument("--kernel", help="only kernels whose name contains this")
    ap.add_argument("--top", type=int, default=20, help="hottest instructions shown per kernel (default 20)")
    ap.add_argument("--listing", type=_span, help="FIRST:END: also print these instructions in listing order")
    ap.add_argument("--json", help="write the summaries here")
    ap.add_argument("--md", help="write the markdown here")
    args = ap.parse_args(argv)
    if args.top < 1:
        ap.error("--top must be at least 1")
    try:
        kernels = N.read(args.file)
        if args.kernel:
            kernels = N.pick(kernels, args.kernel)
    except Glm5Fp4Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summaries = [N.summary(k, args.top) for k in kernels]
    md = "".join(N.markdown(s) + "\n" for s in summaries)
    print(md, end="")
    if args.listing:
        a, b = args.listing
        for k in kernels:
            print(f"{k.name}, instructions {a}..{b - 1}:")
            for i in k.instructions[a:b]:
                print(f"  {i.index:5d} {i.samples:7,d} {100 * k.share(i):5.1f} % {i.executed:10,d}  {i.source}")
    if args.json:
        Path(args.json).write_text(json.dumps({"file": args.file, "kernels": summaries}, indent=1))
    if args.md:
        Path(args.md).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
