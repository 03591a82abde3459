"""`glm5-fp4 improvements new|index`: numbered write-ups and their generated index."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    new = sub.add_parser("new", help="create the next numbered write-up from TEMPLATE.md")
    new.add_argument("--title", required=True)
    new.add_argument("--from", dest="compare_md", type=Path, help="markdown written by `glm5-fp4 compare`")
    new.add_argument("--status", default=None,
                     help="proposed | measured | adopted | rejected (default: measured when --from holds comparable "
                          "runs, else proposed)")
    new.add_argument("--dir", type=Path, default=Path("improvements"))
    index = sub.add_parser("index", help="regenerate improvements/README.md's index from the files")
    index.add_argument("--check", action="store_true", help="fail if the index is out of date")
    index.add_argument("--dir", type=Path, default=Path("improvements"))


def run(args: argparse.Namespace) -> int:
    from glm5_fp4.improvements.writeups import new_writeup, read_writeup, regenerate_index

    if args.action == "new":
        path = new_writeup(args.dir, args.title, args.compare_md, args.status)
        print(f"created {path}; index regenerated")
        if args.compare_md is not None and args.status is None and read_writeup(path).status == "proposed":
            print(f"status left 'proposed': {args.compare_md} says the runs are not comparable")
        return 0
    ok = regenerate_index(args.dir, check=args.check)
    if args.check and not ok:
        print(f"{args.dir}/README.md index is out of date: run `glm5-fp4 improvements index`")
        return 1
    print("index up to date" if args.check else "index regenerated")
    return 0
