"""`glm5-fp4 compare`: load-test results side by side, with deltas and a noise verdict.

  glm5-fp4 compare base.json candidate.json                 # per-request bootstrap noise
  glm5-fp4 compare a1.json,a2.json,a3.json b1.json,b2.json  # repeat runs: run-to-run noise
  glm5-fp4 compare base=a.json flag=b.json --out improvement.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

from glm5_fp4.argtypes import int_in, nonneg_int
from glm5_fp4.outputs import output_dir

# Fewer resamples make the noise band itself noisy; more only cost memory (resamples x requests floats) and time.
MIN_RESAMPLES, MAX_RESAMPLES = 50, 100_000
_resamples = int_in("resamples", MIN_RESAMPLES, MAX_RESAMPLES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", metavar="RESULT",
                   help="summary JSON files, baseline first; comma-join repeats; optional LABEL= prefix")
    p.add_argument("--out", default=None, help="write the markdown block(s) to this file")
    p.add_argument("--bootstrap", type=_resamples, default=300,
                   help=f"bootstrap resamples for per-request noise ({MIN_RESAMPLES}..{MAX_RESAMPLES})")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--labels", default=None, help="comma list of labels, one per RESULT")
    p.add_argument("--markdown", action="store_true", help="print the markdown block instead of the table")


def run(args: argparse.Namespace) -> int:
    import sys

    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.loadtest.compare import compare_files, input_files, non_finite_notes, not_comparable, print_table
    from glm5_fp4.outputs import write_text_atomic

    out = Path(args.out) if args.out else None
    if out is not None:
        _check_out(out)  # before any work: a bad --out must not cost a table printed for nothing
    labels = [x for x in args.labels.split(",")] if args.labels else None
    if labels is not None and len(labels) != len(args.results):
        raise Glm5Fp4Error(f"--labels {args.labels!r}: {len(labels)} label(s) for {len(args.results)} RESULT(s); "
                           "give one per RESULT, in order")
    groups, tables, md = compare_files(args.results, n_boot=args.bootstrap, seed=args.seed, labels=labels)
    if out is not None:
        for p in input_files(groups):
            if p.resolve() == out.resolve():
                raise Glm5Fp4Error(f"--out {out} is one of the inputs ({p}); refusing to overwrite it")
    if args.markdown:
        print(md)
    else:
        for g, rows in zip(groups[1:], tables):
            print_table(groups[0], g, rows)
    if out is not None:
        write_text_atomic(out, md + "\n")
        print(f"markdown: {out}")
    status = 0
    for g in groups[1:]:
        reasons = not_comparable(groups[0], g)
        if reasons:
            print(f"compare: {g.label} vs {groups[0].label} not comparable, no verdicts: {'; '.join(reasons)}",
                  file=sys.stderr)
            status = 1
        bad = non_finite_notes(groups[0], g)
        if bad:
            print(f"compare: {g.label} vs {groups[0].label}: not finite, no verdict: {'; '.join(bad)}",
                  file=sys.stderr)
            status = 1
    return status


def _check_out(out: Path) -> None:
    import os

    from glm5_fp4.errors import Glm5Fp4Error

    if out.is_dir():
        raise Glm5Fp4Error(f"--out {out} is a directory; give a file name, e.g. {out / 'compare.md'}")
    parent = out.parent
    if not parent.exists():
        raise Glm5Fp4Error(f"--out {out}: its folder {parent} does not exist")
    if not parent.is_dir():
        raise Glm5Fp4Error(f"--out {out}: {parent} is not a folder")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise Glm5Fp4Error(f"--out {out}: not writable")
    output_dir(parent, "--out", create=False)  # tries it: root's permission bits (and /proc's) say yes
