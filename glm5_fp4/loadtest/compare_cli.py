"""`glm5-fp4 compare`: load-test results side by side, with deltas and a noise verdict.

  glm5-fp4 compare base.json candidate.json                 # per-request bootstrap noise
  glm5-fp4 compare a1.json,a2.json,a3.json b1.json,b2.json  # repeat runs: run-to-run noise
  glm5-fp4 compare base=a.json flag=b.json --out improvement.md
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", metavar="RESULT",
                   help="summary JSON files, baseline first; comma-join repeats; optional LABEL= prefix")
    p.add_argument("--out", default=None, help="write the markdown block(s) to this file")
    p.add_argument("--bootstrap", type=int, default=300, help="bootstrap resamples for per-request noise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--labels", default=None, help="comma list of labels, one per RESULT")
    p.add_argument("--markdown", action="store_true", help="print the markdown block instead of the table")


def run(args: argparse.Namespace) -> int:
    import sys

    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.loadtest.compare import compare_files, not_comparable, print_table

    if args.bootstrap < 50:
        raise Glm5Fp4Error(f"--bootstrap {args.bootstrap}: use at least 50 resamples")
    labels = [x for x in args.labels.split(",")] if args.labels else None
    groups, tables, md = compare_files(args.results, n_boot=args.bootstrap, seed=args.seed, labels=labels)
    if args.markdown:
        print(md)
    else:
        for g, rows in zip(groups[1:], tables):
            print_table(groups[0], g, rows)
    if args.out:
        Path(args.out).write_text(md + "\n")
        print(f"markdown: {args.out}")
    blocked = [(g, not_comparable(groups[0], g)) for g in groups[1:]]
    for g, reasons in blocked:
        if reasons:
            print(f"compare: {g.label} vs {groups[0].label} not comparable, no verdicts: {'; '.join(reasons)}",
                  file=sys.stderr)
    return 1 if any(reasons for _, reasons in blocked) else 0
