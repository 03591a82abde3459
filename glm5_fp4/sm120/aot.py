"""Ahead-of-time compilation of one MoE kernel configuration for a chosen GPU target, without a GPU.

For developers reading the PTX/SASS-level resource use of a config on a CPU machine, and for tests. The
kernel and its arguments are what :func:`glm5_fp4.kernels.launch.launches` would launch for a plan (on
meta tensors), compiled by :mod:`glm5_fp4.sm120.build` exactly as the JIT would on that GPU:

    python -m glm5_fp4.sm120.aot --cc 120 --bn 64 --bm 32 --bk 128 --warps 4 --stages 3
    python -m glm5_fp4.sm120.aot --cc 90 --gemm 2 --bn 128 --bm 32 --warps 8 --stages 3 --dump ptx
"""

from __future__ import annotations

import argparse
import dataclasses

from glm5_fp4.kernels import configs as C
from glm5_fp4.sm120 import launches as L
from glm5_fp4.sm120.build import Build, compile_specialized, specialize

ARCH_OF_CC = {80: "sm80", 90: "sm90", 100: "sm100", 120: "sm120"}


def _shape(hidden: int, intermediate: int, num_experts: int = 256, top_k: int = 8) -> L.ShapeClass:
    return L.ShapeClass(f"h{hidden}i{intermediate}", num_experts, top_k, hidden, intermediate)


def compile_plan(plan: C.Plan, cc: int, hidden: int = 6144, intermediate: int = 256, tokens: int | None = None,
                 mode: str = "w4a16", stage: str = "gemm1", use_asm: bool = True,
                 layout: str | None = None) -> list[Build]:
    """Compile the launches of ``stage`` that ``plan`` makes for one call (default T: the slot schedule's
    largest batch, or 64 tokens for the grouped and native schedules) on weights in ``layout``."""
    if tokens is None:
        tokens = C.SLOT_MAX_TOKENS.get(ARCH_OF_CC.get(cc, "sm90"), 4) if plan.schedule == "slot" else 64
    sel = L.Selection(ARCH_OF_CC.get(cc, "sm90"), _shape(hidden, intermediate), mode, plan, tokens, (stage,),
                      "aot", use_asm, layout)
    return [compile_specialized(specialize(launch, cc)) for launch in L.record(sel)]


def compile_default_gemm1(cc: int, tokens: int, layout: str, hidden: int = 6144, intermediate: int = 256) -> Build:
    """GEMM1 of the default plan at ``tokens`` (the TP8 shard unless told) on weights in ``layout``."""
    plan = C.plan(ARCH_OF_CC.get(cc, "sm90"), tokens, 256, 8, hidden, intermediate, sm_count=132)
    return next(b for b in compile_plan(plan, cc, hidden, intermediate, tokens=tokens, layout=layout)
                if "gemm1" in b.kernel)


def compile_gemm1(cfg: C.Gemm1Config, cc: int, hidden: int = 6144, intermediate: int = 256, slot_mode: bool = False,
                  w4a4: bool = False, use_asm: bool = True, x_prep: bool = True, split_k: int = 1) -> Build:
    arch = ARCH_OF_CC.get(cc, "sm90")
    plan = C.plan(arch, 4 if slot_mode else 64, 256, 8, hidden, intermediate, schedule="slot" if slot_mode else "grouped",
                  gemm1=cfg)
    plan = dataclasses.replace(plan, prep_x=x_prep, gemm1_split_k=split_k if slot_mode else 1)
    builds = compile_plan(plan, cc, hidden, intermediate, mode="w4a4" if w4a4 else "w4a16", stage="gemm1",
                          use_asm=use_asm)
    return next(b for b in builds if "gemm1" in b.kernel)


def compile_gemm2(cfg: C.Gemm2Config, cc: int, hidden: int = 6144, intermediate: int = 256, n_split: int = 4,
                  w4a4: bool = False, use_asm: bool = True, slot: bool = False) -> Build:
    arch = ARCH_OF_CC.get(cc, "sm90")
    plan = C.plan(arch, 4 if slot else 64, 256, 8, hidden, intermediate, schedule="slot" if slot else "grouped",
                  gemm2=cfg)
    plan = dataclasses.replace(plan, gemm2_n_split=n_split, gemm1_split_k=1)
    builds = compile_plan(plan, cc, hidden, intermediate, mode="w4a4" if w4a4 else "w4a16", stage="gemm2",
                          use_asm=use_asm)
    return next(b for b in builds if "gemm2" in b.kernel)


def compile_native(arch: str, hidden: int = 6144, intermediate: int = 512) -> list[Build]:
    """The native FP4-MMA path's two GEMMs (W4A4, SM100/SM120)."""
    cc = {v: k for k, v in ARCH_OF_CC.items()}[arch]
    plan = C.native_plan(arch, 64, 256, 8, hidden, intermediate)
    return [b for stage in ("gemm1", "gemm2") for b in compile_plan(plan, cc, hidden, intermediate, mode="w4a4",
                                                                   stage=stage) if "native" in b.kernel]


def summary(b: Build) -> str:
    return (f"{b.kernel}: shared={b.shared_bytes} B regs={b.registers} spills={b.spill_store_bytes}/"
            f"{b.spill_load_bytes} B mma={b.instructions.mma_summary()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cc", type=int, default=120, help="compute capability as an integer (90, 100, 120)")
    p.add_argument("--gemm", type=int, choices=(1, 2), default=1)
    p.add_argument("--bn", type=int, default=64)
    p.add_argument("--bm", type=int, default=32)
    p.add_argument("--bk", type=int, default=128)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--w4a4", action="store_true")
    p.add_argument("--slot", action="store_true")
    p.add_argument("--no-asm", action="store_true")
    p.add_argument("--no-prep", action="store_true", help="GEMM1 converts the activations per K tile")
    p.add_argument("--split-k", type=int, default=1)
    p.add_argument("--unmerged", action="store_true", help="eight MMAs per weight tile (the old form)")
    p.add_argument("--dump", choices=("ptx",), help="print the PTX")
    args = p.parse_args(argv)
    if args.gemm == 1:
        b = compile_gemm1(C.Gemm1Config(args.bn, args.bm, args.bk, args.warps, args.stages, not args.unmerged), args.cc,
                          args.hidden, args.intermediate, args.slot, args.w4a4, not args.no_asm, not args.no_prep,
                          args.split_k)
    else:
        b = compile_gemm2(C.Gemm2Config(args.bn, args.bm, args.warps, args.stages, merged=not args.unmerged), args.cc,
                          args.hidden, args.intermediate, w4a4=args.w4a4, use_asm=not args.no_asm, slot=args.slot)
    if args.dump:
        print(b.ptx)
    print(summary(b))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
