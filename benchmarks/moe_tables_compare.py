"""Side by side: MoE kernel tables (benchmarks/moe_kernel.py JSON) measured in one device call, row by row.

For each (shard, T, routing) present in the first table: every table's µs and % of its own run's copy bandwidth,
and its time over the first table's (below 1: faster). Tables from separate processes of one call (the way to
compare compiler settings Triton caches per process, benchmarks/h200/mma_sync_job.sh) differ also by the run's
drift: the copy bandwidth each measured is printed so that can be judged.

    python benchmarks/moe_tables_compare.py a.json b.json [c.json ...] --labels "A,B,C" --md compare.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{path}: not a readable moe_kernel.py result ({exc})") from None
    if "rows" not in doc or "meta" not in doc:
        raise SystemExit(f"{path}: no 'rows'/'meta' (is it a moe_kernel.py table JSON?)")
    return doc


def compare(docs: list[dict], labels: list[str]) -> str:
    keyed = [{(r.get("shard"), r.get("tokens"), r.get("routing")): r for r in d["rows"]} for d in docs]
    head = " | ".join(f"{lab} µs (% BW)" for lab in labels)
    ratios = " | ".join(f"{lab} / {labels[0]}" for lab in labels[1:])
    lines = ["| shard | T | routing | " + head + " | " + ratios + " |",
             "|---|---|---|" + "---|" * (2 * len(labels) - 1)]
    for key, first in keyed[0].items():
        if key[0] == "-":
            continue  # a whole-run error row (e.g. --mma-sync's check), listed under the table
        cells, times = [], []
        for table in keyed:
            r = table.get(key)
            if r is None or "us" not in r:
                cells.append("error" if r is not None else "—")
                times.append(None)
            else:
                cells.append(f"{r['us']:.1f} ({r['pct_copy_bw']:.0f} %)")
                times.append(r["us"])
        base = times[0]
        rel = [f"{t / base:.2f}" if t is not None and base else "—" for t in times[1:]]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " | " + " | ".join(rel) + " |")
    notes = []
    for lab, d in zip(labels, docs):
        m = d["meta"]
        errs = [r["error"][:160] for r in d["rows"] if "error" in r]
        notes.append(f"- {lab}: {m.get('gpu')}, git {m.get('git_sha')}, triton {m.get('versions', {}).get('triton')}, "
                     f"copy {m.get('copy_gbs') or 0:.0f} GB/s, plans {m.get('plan_arch') or 'this GPU'}'s, "
                     f"MMA {m.get('mma', '?')}"
                     + (f", built {m['compiled_mma']}" if m.get("compiled_mma") else "")
                     + (f"; errors: {errs}" if errs else ""))
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="+")
    ap.add_argument("--labels", help="comma-separated, one per table (default: the file names)")
    ap.add_argument("--md", help="also write the comparison here")
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [Path(t).stem for t in args.tables]
    if len(labels) != len(args.tables):
        ap.error(f"{len(labels)} labels for {len(args.tables)} tables")
    docs = []
    for t in args.tables:
        if not Path(t).is_file():
            print(f"{t}: missing (its run failed or was cut short); comparing the others", file=sys.stderr)
            continue
        docs.append(load(t))
    if not docs:
        return 1
    kept = [lab for lab, t in zip(labels, args.tables) if Path(t).is_file()]
    text = compare(docs, kept)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    return 0 if len(docs) == len(args.tables) else 1


if __name__ == "__main__":
    raise SystemExit(main())
