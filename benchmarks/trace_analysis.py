"""How long `glm5-fp4 profile analyze` takes on 8 ranks x 50 MB traces (goal: <= 30 s on a 2-core machine).

Synthesises GLM-5-shaped decode traces (78 layers, NCCL all-reduce, CUDA-graph replays, a slow rank) padded
with CPU-side events to the target size, writes them once as .json and once as .json.gz, and times the full
analysis (load + classify + steps + collectives + exposed time) of each set. Prints a table and writes
benchmarks/results/trace_analysis.json (trace_analysis_stdlib_json.json with --stdlib-json).

    python benchmarks/trace_analysis.py [--ranks 8] [--mb 50] [--keep DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from glm5_fp4.bench.meta import result_metadata
from glm5_fp4.profiling import traces as traces_module
from glm5_fp4.profiling.breakdown import analyze_path
from glm5_fp4.spec import GLM5

# The trace generator is a test double: it lives with the tests, not in the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from profiling_synthetic import make_decode_traces  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def synthesise(out: Path, ranks: int, mb: float, steps: int) -> dict:
    """Write `ranks` traces of about `mb` MB each; returns sizes."""
    layers = GLM5.num_layers
    kernels_per_step = layers * 12 + 4
    files, _ = make_decode_traces(
        n_ranks=ranks, n_steps=steps, layers=layers, graph="breakable", slow_rank=ranks - 1, target_bytes=int(mb * 1e6), seed=1
    )
    json_dir, gz_dir = out / "json", out / "gz"
    json_dir.mkdir(parents=True)
    gz_dir.mkdir(parents=True)
    sizes = {"json": [], "gz": []}
    for name, trace in files:
        payload = json.dumps(trace).encode()
        plain = json_dir / name.removesuffix(".gz")
        plain.write_bytes(payload)
        packed = gz_dir / name
        with gzip.open(packed, "wb", compresslevel=6) as fh:
            fh.write(payload)
        sizes["json"].append(plain.stat().st_size)
        sizes["gz"].append(packed.stat().st_size)
    return {"kernels_per_rank": steps * kernels_per_step, **sizes}


def time_analysis(path: Path) -> tuple[float, object]:
    t0 = time.perf_counter()
    breakdown = analyze_path(path)
    return time.perf_counter() - t0, breakdown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--mb", type=float, default=50.0, help="uncompressed size of each rank's trace")
    ap.add_argument("--steps", type=int, default=40, help="decode steps per trace (kernel records), the rest is CPU filler")
    ap.add_argument("--keep", help="write the synthetic traces here and keep them")
    ap.add_argument("--goal-s", type=float, default=30.0)
    ap.add_argument("--stdlib-json", action="store_true", help="parse with the standard json module even if orjson is installed")
    args = ap.parse_args(argv)
    if args.stdlib_json:
        traces_module._orjson = None

    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="glm5fp4-trace-bench-"))
    try:
        t0 = time.perf_counter()
        sizes = synthesise(workdir, args.ranks, args.mb, args.steps)
        synth_s = time.perf_counter() - t0
        rows = {}
        for kind in ("json", "gz"):
            seconds, breakdown = time_analysis(workdir / kind)
            rows[kind] = {
                "seconds": round(seconds, 2),
                "total_mb_on_disk": round(sum(sizes[kind]) / 1e6, 1),
                "mb_per_rank_on_disk": round(sum(sizes[kind]) / len(sizes[kind]) / 1e6, 1),
                "steps_found_rank0": breakdown.ranks[0].n_steps,
                "allreduce_matched_rank0": breakdown.ranks[0].allreduce["matched"],
            }
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    result = {
        **result_metadata(packages=("orjson",), benchmark="trace_analysis"),
        "json_parser": "orjson" if traces_module._orjson is not None else "json (stdlib)",
        "ranks": args.ranks,
        "uncompressed_mb_per_rank": args.mb,
        "kernels_per_rank": sizes["kernels_per_rank"],
        "synthesis_seconds": round(synth_s, 1),
        "goal_seconds": args.goal_s,
        "results": rows,
        "meets_goal": all(r["seconds"] <= args.goal_s for r in rows.values()),
    }
    results_path = RESULTS_DIR / ("trace_analysis_stdlib_json.json" if args.stdlib_json else "trace_analysis.json")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'input':<6} {'MB/rank':>8} {'total MB':>9} {'seconds':>8}  goal {args.goal_s:.0f} s  ({result['json_parser']})")
    for kind, row in rows.items():
        print(f"{kind:<6} {row['mb_per_rank_on_disk']:>8.1f} {row['total_mb_on_disk']:>9.1f} {row['seconds']:>8.2f}")
    print(f"wrote {results_path}")
    return 0 if result["meets_goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
