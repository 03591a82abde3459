"""Ahead-of-time compilation of the MoE kernels for a chosen GPU target, without a GPU.

Used by tests (shared memory and registers of SM120 configs, read from Triton's own metadata) and by
developers to read the PTX/SASS-level resource use of a config on a CPU machine:

    python -m glm5_fp4.kernels.aot --cc 120 --bn 64 --bm 32 --bk 128 --warps 4 --stages 3
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from glm5_fp4.kernels.configs import Gemm1Config, Gemm2Config


@dataclass
class Compiled:
    name: str
    shared: int
    n_regs: int | None
    n_spills: int | None
    asm: dict

    def summary(self) -> str:
        return f"{self.name}: shared={self.shared} B regs={self.n_regs} stack={self.n_spills} B"


def _compile(fn, signature: dict, constexprs: dict, cc: int, num_warps: int, num_stages: int) -> Compiled:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full_sig = {name: ("constexpr" if name in constexprs else signature[name]) for name in fn.arg_names}
    # What the JIT would specialise at launch: torch allocations are 16-byte aligned, and strides of
    # GLM-5-sized tensors are multiples of 16.
    aligned = [["tt.divisibility", 16]]
    attrs = {
        (i,): aligned
        for i, name in enumerate(fn.arg_names)
        if name not in constexprs and (signature[name].startswith("*") or name.startswith("stride"))
    }
    src = ASTSource(fn=fn, signature=full_sig, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", cc, 32)
    kernel = triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
    md = kernel.metadata
    regs, stack = _resource_usage(kernel.asm.get("cubin"))
    return Compiled(
        name=fn.__name__,
        shared=int(md.shared),
        n_regs=regs,
        n_spills=stack,
        asm=dict(kernel.asm),
    )


def _resource_usage(cubin: bytes | None) -> tuple[int | None, int | None]:
    """(registers, stack bytes) from ``cuobjdump -res-usage`` of Triton's bundled CUDA tools, if present."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    if not cubin:
        return None, None
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


_PTR = {
    "x_ptr": "*bf16",
    "xq_ptr": "*fp16",
    "part_ptr": "*fp32",
    "w_ptr": "*i32",
    "actq_ptr": "*u8",
    "acts_ptr": "*u8",
    "w_global_ptr": "*fp32",
    "s_ptr": "*u8",
    "alpha_ptr": "*fp32",
    "a_scale_ptr": "*fp32",
    "a_gscale_ptr": "*fp32",
    "o_gscale_ptr": "*fp32",
    "o_scale_ptr": "*fp32",
    "act_ptr": "*fp16",
    "ids_ptr": "*i32",
    "slots_ptr": "*i32",
    "counts_ptr": "*i32",
    "offsets_ptr": "*i32",
    "active_ptr": "*i32",
    "num_active_ptr": "*i32",
    "topk_w_ptr": "*fp32",
    "ws_ptr": "*fp32",
    "out_ptr": "*bf16",
}


def _signature(fn) -> dict:
    sig = {name: _PTR.get(name, "i32") for name in fn.arg_names}
    if fn.__name__.endswith("_native_kernel"):
        sig["w_ptr"] = "*u8"  # checkpoint packing, bytes
    return sig


def compile_gemm1(
    cfg: Gemm1Config,
    cc: int,
    hidden: int = 6144,
    intermediate: int = 256,
    slot_mode: bool = False,
    w4a4: bool = False,
    use_asm: bool = True,
    x_prep: bool | None = None,
    split_k: int = 1,
) -> Compiled:
    from glm5_fp4.kernels.triton_moe import moe_gemm1_kernel

    if x_prep is None:  # what the launcher does: grouped W4A16 reads the prepared activations
        x_prep = not slot_mode and not w4a4
    constexprs = dict(
        H=hidden, I=intermediate, BN=cfg.bn, BM=cfg.bm, BK=cfg.bk, SLOT_MODE=slot_mode, W4A4=w4a4, USE_ASM=use_asm,
        X_PREP=x_prep, SPLIT_K=split_k, MERGED=cfg.merged, DIAG=0,
    )
    return _compile(moe_gemm1_kernel, _signature(moe_gemm1_kernel), constexprs, cc, cfg.num_warps, cfg.num_stages)


def compile_gemm2(
    cfg: Gemm2Config,
    cc: int,
    hidden: int = 6144,
    intermediate: int = 256,
    n_split: int = 4,
    w4a4: bool = False,
    use_asm: bool = True,
    slot: bool = False,
) -> Compiled:
    from glm5_fp4.kernels.triton_moe import moe_gemm2_grouped_kernel, moe_gemm2_slot_kernel

    if slot:
        fn = moe_gemm2_slot_kernel
        constexprs = dict(TOPK=8, H=hidden, I=intermediate, BN=cfg.bn, N_SPLIT=n_split, W4A4=w4a4, USE_ASM=use_asm,
                          MERGED=cfg.merged)
    else:
        fn = moe_gemm2_grouped_kernel
        constexprs = dict(
            H=hidden, I=intermediate, BN=cfg.bn, BM=cfg.bm, N_SPLIT=n_split, W4A4=w4a4, USE_ASM=use_asm, MERGED=cfg.merged
        )
    return _compile(fn, _signature(fn), constexprs, cc, cfg.num_warps, cfg.num_stages)


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
    p.add_argument("--dump", choices=("ttgir", "ptx", "llir", "ttir"), help="print this stage")
    args = p.parse_args(argv)
    if args.gemm == 1:
        c = compile_gemm1(
            Gemm1Config(args.bn, args.bm, args.bk, args.warps, args.stages, not args.unmerged), args.cc, args.hidden,
            args.intermediate, args.slot, args.w4a4, not args.no_asm, False if args.no_prep else None, args.split_k,
        )
    else:
        c = compile_gemm2(
            Gemm2Config(args.bn, args.bm, args.warps, args.stages, merged=not args.unmerged), args.cc, args.hidden,
            args.intermediate, w4a4=args.w4a4, use_asm=not args.no_asm, slot=args.slot,
        )
    if args.dump:
        print(c.asm[args.dump])
    print(c.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
