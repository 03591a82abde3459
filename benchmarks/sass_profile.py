"""Instruction mix of the MoE kernels' hot loops, compiled ahead of time (no GPU), for the plans the
picker chooses at GLM-5 shapes: registers, spills, shared memory, and per main-loop iteration the SASS
instructions by class and per weight decoded. Run with the Triton of the GPU image (3.6 with torch 2.11)
to read the code the H200 runs:

    python benchmarks/sass_profile.py --cc 90 --tp 8 --tokens 1,16,512,1024,4096 --json benchmarks/results/moe_kernel_sass_sm90.json
    python benchmarks/sass_profile.py --layout placed --json benchmarks/results/moe_kernel_sass_sm90_placed.json
    python benchmarks/sass_profile.py --tokens 512 --gemm1 64,32,256,4,3 --gemm1 64,32,128,4,3 --tma   # TMA tiles
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

CLASSES = {
    "decode (F2FP e4m3->f16, bit ops)": ("F2FP", "LOP3", "SHF", "IMAD.SHL", "PRMT"),
    "scale multiply (HMUL2/HFMA2)": ("HMUL2", "HFMA2"),
    "tensor core (HGMMA/HMMA + warpgroup sync)": ("HGMMA", "HMMA", "WARPGROUP"),
    "memory (LDG/LDGSTS/LDS/STS/STG/RED/ATOM)": ("LDG", "LDGSTS", "LDS", "STS", "STG", "RED", "ATOM", "LDSM", "UTMALDG"),
}


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass_of(cubin: bytes) -> list[tuple[int, str]]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2) + m.group(3)))
    return out


def hottest_loop(ins: list[tuple[int, str]]) -> list[str]:
    """The innermost loop holding tensor-core instructions: the smallest body between a backward branch and
    its target that contains an HGMMA/HMMA (the K loop), else the largest loop. Bodies holding an EXIT are no
    loops: TMA kernels keep their mbarrier retry stubs after the function's end, each branching back into the
    middle of the K loop (taken as the loop, that span held half the K tile's MMAs)."""
    best, best_key = [], (-1, -1)
    for addr, text in ins:
        m = re.match(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text.split(";")[0].replace("`", ""))
        if not m:
            m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr:
            continue
        body = [t for a, t in ins if target <= a <= addr]
        if any(t.startswith("EXIT") for t in body):
            continue
        mma = any(t.startswith(("HGMMA", "HMMA")) for t in body)
        key = (1, -len(body)) if mma else (0, len(body))
        if key > best_key:
            best, best_key = body, key
    return best


def classify(body: list[str]) -> dict:
    counts = collections.Counter(t.split()[0] for t in body)
    out = {name: 0 for name in CLASSES}
    out["other (addresses, predicates, moves)"] = 0
    for op, n in counts.items():
        for name, prefixes in CLASSES.items():
            if op.startswith(prefixes):
                out[name] += n
                break
        else:
            out["other (addresses, predicates, moves)"] += n
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", type=int, default=90)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--tokens", default="1,16,512,1024,4096")
    ap.add_argument("--layout", default="split", help="weight layout: split (default here: the baseline counts), placed (cheaper decode) or tiled (placed, GEMM1 K-tile-major: the same instructions)")
    ap.add_argument("--tma", action="store_true", help="GEMM1 weight tiles by TMA (Gemm1Config.tma)")
    ap.add_argument("--gemm1", action="append", default=[], metavar="BN,BM,BK,WARPS,STAGES",
                    help="GEMM1 tile instead of the picker's (repeatable: one row each)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import triton
    import triton.compiler  # noqa: F401

    from glm5_fp4.bench.meta import result_metadata
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.sm120 import aot
    from glm5_fp4.spec import Glm5Spec

    spec = Glm5Spec()
    e, h, k = spec.n_routed_experts, spec.hidden_size, spec.num_experts_per_tok
    i = spec.moe_intermediate_size // args.tp
    arch = aot.ARCH_OF_CC[args.cc]
    rows = []
    tiles = [C.Gemm1Config(*(int(v) for v in g.split(",")), tma=args.tma) for g in args.gemm1] or [None]
    for t, tile in ((int(v), g) for v in args.tokens.split(",") for g in tiles):
        plan = C.plan(arch, t, e, k, h, i, gemm1=tile)
        if args.tma and tile is None:
            plan = dataclasses.replace(plan, gemm1=dataclasses.replace(plan.gemm1, tma=True))
        for stage in ("gemm1", "gemm2") if tile is None else ("gemm1",):
            for b in aot.compile_plan(plan, args.cc, h, i, tokens=t, stage=stage, layout=args.layout):
                if stage not in b.kernel:
                    continue
                cubin = b.cubin
                body = hottest_loop(sass_of(cubin))
                cfg = plan.gemm1 if stage == "gemm1" else plan.gemm2
                threads = 32 * cfg.num_warps
                if stage == "gemm1":  # one K tile of gate and up rows
                    weights = 2 * cfg.bn * cfg.bk
                else:  # one [BN, I] tile of the down projection
                    weights = cfg.bn * i
                per_thread = weights / threads
                mix = classify(body)
                rows.append(dict(tokens=t, kernel=b.kernel, layout=args.layout, schedule=plan.schedule, config=cfg.__dict__,
                                 registers=b.registers, spill_bytes=b.spill_store_bytes, shared_bytes=b.shared_bytes,
                                 loop_instructions=len(body), weights_per_thread_per_iteration=per_thread,
                                 instructions_per_weight=round(len(body) / per_thread, 2) if per_thread else None,
                                 mix=mix, mix_per_weight={k_: round(v / per_thread, 2) for k_, v in mix.items()}))
                print(f"T={t} {b.kernel} {cfg}: regs {b.registers}, spill {b.spill_store_bytes}, smem {b.shared_bytes}, "
                      f"loop {len(body)} instr = {rows[-1]['instructions_per_weight']} / weight  {rows[-1]['mix_per_weight']}")
    if args.json:
        doc = dict(meta=result_metadata(benchmark="sass_profile", cc=args.cc, tp=args.tp, triton=triton.__version__,
                                        layout=args.layout, tma=args.tma, gemm1=args.gemm1),
                   rows=rows)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
