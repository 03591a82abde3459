"""``glm5-fp4 selftest``: run the MoE backend on this GPU against the reference, benchmark it, write a report.

    glm5-fp4 selftest                    # full: ~minutes; writes selftest-report/selftest.{json,md}
    glm5-fp4 selftest --quick --out DIR  # a few cases and a short benchmark

Exit status: 0 all correctness cases passed and the benchmark ran whole (PASS), 1 a case failed (FAIL), the
benchmark failed or lost rows (PARTIAL) or --out cannot hold the report, 2 no CUDA GPU on this machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time
from pathlib import Path

from glm5_fp4.selftest import NO_GPU_EXIT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="selftest-report", help="directory for selftest.json and selftest.md")
    p.add_argument("--quick", action="store_true", help="fewer cases and a shorter benchmark (about a minute)")
    p.add_argument("--no-bench", action="store_true", help="correctness only")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")


def no_gpu_message() -> str | None:
    """The one-line explanation when this machine cannot run the self-test, else None."""
    import torch

    if torch.cuda.is_available():
        return None
    built = torch.version.cuda
    why = (f"torch {torch.__version__} is a CPU-only build" if not built
           else f"torch {torch.__version__} (CUDA {built}) sees no GPU - check the driver and CUDA_VISIBLE_DEVICES")
    return (f"glm5-fp4 selftest: no CUDA GPU available ({why}). The self-test runs the Triton MoE kernels and needs "
            "an NVIDIA GPU; without one, `glm5-fp4 compile-matrix` checks that every kernel compiles and fits for sm_120.")


def run(args: argparse.Namespace) -> int:
    from glm5_fp4.outputs import output_dir

    # Before the GPU work: a report that cannot be written would lose minutes of checks and benchmarks.
    output_dir(args.out, "--out", create=False)
    msg = no_gpu_message()
    if msg:
        print(msg, file=sys.stderr)
        return NO_GPU_EXIT
    import torch

    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.selftest import bench, checks, env, report

    if not 0 <= args.device < torch.cuda.device_count():
        raise Glm5Fp4Error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    torch.cuda.set_device(args.device)
    t0 = time.perf_counter()
    info = env.collect(args.device)
    print(f"selftest on {info['gpu']} ({info['arch']}, driver {info['driver']}, torch {info['torch']}, "
          f"triton {info['triton']})", flush=True)

    def case_progress(r):
        state = "pass" if r["passed"] else "FAIL"
        extra = f"rel err {r['rel_err']:.2e}" if "rel_err" in r else r.get("error", "")
        print(f"  {r['shape']} T={r['tokens']} {r['mode']} ({r.get('ids_dtype')}): {state} {extra}", flush=True)

    def bench_progress(r):
        print(f"  bench {r['message']}", flush=True)

    correctness = checks.run_all(args.quick, info, progress=case_progress)
    kernels = checks.observed_kernels()
    bench_result = None if args.no_bench else bench.run(info, args.quick, progress=bench_progress)
    result = {
        "schema": 1,
        "meta": {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "glm5-fp4 selftest " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
            "quick": args.quick,
            "elapsed_s": round(time.perf_counter() - t0, 1),
        },
        "env": info,
        "correctness": correctness,
        "kernels": kernels,
        "benchmark": bench_result,
    }
    result["verdict"] = report.verdict(result)
    js, md = report.write(result, Path(args.out))
    print(report.summary_line(result, md, js))
    return 0 if result["verdict"] == "pass" else 1
