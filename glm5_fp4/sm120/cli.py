"""``glm5-fp4 compile-matrix``: compile every MoE kernel configuration for sm_120/sm_100/sm_90 on this machine
(no GPU needed), check shared memory, spills and instructions, and write JSON + markdown with the predicted
floors on an RTX PRO 6000.

    glm5-fp4 compile-matrix --out benchmarks/results            # full matrix, ~minutes on 2 cores
    glm5-fp4 compile-matrix --arch sm120 --shapes tp8 --strict  # quick gate: exit 3 if a kernel fails a check

Exit status: 1 where a kernel could not be compiled at all (the compiler raised: it was not checked), else 3 with
--strict where a kernel fails a check, else 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from glm5_fp4.argtypes import positive_int
from glm5_fp4.errors import Glm5Fp4Error

FLOOR_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _csv(choices):
    def parse(text: str) -> list[str]:
        vals = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in vals if v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(choices)}")
        if not vals:  # an empty selection compiles nothing, and --strict would pass it
            raise argparse.ArgumentTypeError(f"{text!r} names nothing; choose from {', '.join(choices)}")
        # a repeat would compile and report the same kernels twice, each row naming its origins twice
        return list(dict.fromkeys(vals))

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from glm5_fp4.sm120.launches import ARCHS

    p.add_argument("--out", default=".", help="directory for compile_matrix.json and compile_matrix.md")
    p.add_argument("--arch", type=_csv(ARCHS), default=list(ARCHS), help="targets, comma-separated (default: all)")
    p.add_argument("--shapes", type=_csv(("tp8", "tp4", "tp1", "tiny")), default=["tp8", "tp4", "tp1", "tiny"],
                   help="expert shapes: GLM-5 TP8/TP4 shards, whole experts (TP1/EP), the small test shape (default: all)")
    p.add_argument("--modes", type=_csv(("w4a16", "w4a4")), default=["w4a16", "w4a4"], help="default: both")
    p.add_argument("--picked-only", action="store_true", help="only the picker's plans, not every candidate config")
    p.add_argument("--defaults-only", action="store_true",
                   help="only what the backend launches unless told otherwise: the picker's plans (and the native "
                        "FP4 path), no candidate configs, no opt-in forms (the sm_90 / sm_100 gate)")
    p.add_argument("--no-asm", action="store_true", help="compile the plain-Triton decode (GLM5_FP4_MOE_NO_ASM=1)")
    p.add_argument("--reuse-cache", action="store_true", help="use Triton's cache (faster reruns; compile times meaningless)")
    p.add_argument("--gpu", default="rtx-pro-6000-ws", help="hardware-table GPU for the predicted floors")
    p.add_argument("--alt-gpu", default="rtx-pro-6000-server", help="second GPU for a bandwidth-floor column ('' for none)")
    p.add_argument("--jobs", type=positive_int, default=1, help="parallel compiler processes (default 1)")
    p.add_argument("--strict", action="store_true", help="exit 3 if any kernel fails a check")
    p.add_argument("--quiet", action="store_true")


def _gpu(name: str, flag: str):
    from glm5_fp4.hardware import get_gpu

    try:
        return get_gpu(name)
    except Glm5Fp4Error as exc:
        raise Glm5Fp4Error(f"{flag}: {exc}") from None


def floors_section(gpu_name: str, alt_name: str | None) -> dict:
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.sm120.floors import floors

    gpu = _gpu(gpu_name, "--gpu")
    alt = (_gpu(alt_name, "--alt-gpu"),) if alt_name else ()
    arch = C.arch_of(gpu.compute_capability)
    return {
        "gpu": gpu.name, "gpu_display": gpu.display_name, "arch": arch, "bandwidth_gbs": gpu.mem_bandwidth_gbs,
        "peak_bf16_tflops": gpu.peak_tflops("bf16"), "peak_nvfp4_tflops": gpu.peak_tflops("nvfp4"),
        "sm_count": gpu.sm_count, "alt": [g.name for g in alt],
        "rows": [f.to_dict() for f in floors(gpu, FLOOR_TOKENS, arch=arch, alt_gpus=alt)],
    }


def write(result: dict, out: Path) -> tuple[Path, Path]:
    from glm5_fp4.bench.meta import write_result
    from glm5_fp4.sm120.report import markdown

    return write_result(out, "compile_matrix", result, markdown(result))


def run(args: argparse.Namespace) -> int:
    from glm5_fp4.sm120 import launches as L
    from glm5_fp4.sm120.matrix import run_matrix

    from glm5_fp4.outputs import output_dir

    # everything that can refuse the run is asked before the compiles, which take minutes
    output_dir(args.out, "--out", create=False)
    floors = floors_section(args.gpu, args.alt_gpu or None)
    shapes = [s for s in L.shape_classes() if s.name in args.shapes]
    t0 = time.time()

    def progress(n, total, row):
        if not args.quiet and (n == total or n % 10 == 0 or not row.ok):
            flag = "" if row.ok else "  FAIL " + "; ".join(row.problems)
            print(f"[{n}/{total} {time.time() - t0:.0f}s] {row.arch} {row.kernel} {row.constexprs}{flag}",
                  file=sys.stderr, flush=True)

    res = run_matrix(
        archs=tuple(args.arch), shapes=shapes, modes=tuple(args.modes),
        candidates=not (args.picked_only or args.defaults_only), opt_ins=not args.defaults_only, use_asm=not args.no_asm, fresh_cache=not args.reuse_cache, jobs=args.jobs, progress=progress,
    )
    if not res.rows:
        raise Glm5Fp4Error(f"no kernel to compile for --arch {','.join(args.arch)} --shapes {','.join(args.shapes)} "
                           f"--modes {','.join(args.modes)}" + (" --picked-only" if args.picked_only else "")
                           + (" --defaults-only" if args.defaults_only else "")
                           + ": nothing was checked")
    result = res.to_dict()
    result["floors"] = floors
    js, md = write(result, Path(args.out))
    failed = res.failures()
    for arch in args.arch:
        bad = [r for r in failed if r.arch == arch]
        n = sum(1 for r in res.rows if r.arch == arch)
        print(f"{arch}: {n - len(bad)}/{n} kernels ok" + ("" if not bad else f", {len(bad)} failing:"))
        for c in res.failing_configs(arch):
            probs = sorted({p for w in c["where"] for p in w["problems"]})
            print(f"  {c['config']}: {'; '.join(probs)}")
        for r in bad:
            if not r.configs:
                print(f"  {r.kernel} {r.constexprs}: {'; '.join(r.problems)}")
        waived = [r for r in res.rows if r.arch == arch and r.waived]
        if waived:
            print(f"  {len(waived)} kernels with a waived spill (configs.SPILL_WAIVERS): "
                  + "; ".join(sorted({f"{w} in {r.kernel}" for r in waived for w in r.waived})))
    print(f"{res.meta['distinct_kernels']} kernels in {res.meta['elapsed_s']:.0f} s -> {js}, {md}")
    broken = [r for r in res.rows if r.error]
    if broken:  # not a verdict on a kernel but a check that did not happen: the run is incomplete
        print(f"compile-matrix: {len(broken)} kernel(s) could not be compiled, so were not checked; first: "
              f"{broken[0].kernel} on {broken[0].arch}: {broken[0].error}", file=sys.stderr)
        return 1
    return 3 if (args.strict and failed) else 0
