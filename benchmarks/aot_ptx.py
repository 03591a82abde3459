"""Load widths of GEMM1 for each decode layout at the default plans (AOT with this machine's Triton; run it on the
lent H200 to see its Triton 3.6, which vectorises less than 3.9 does): "tiled" must load as wide as "placed".

    python benchmarks/aot_ptx.py 1,512,4096          # T values; --cc 120 for sm_120
"""

import argparse

from glm5_fp4.kernels.layout import DECODE_LAYOUTS
from glm5_fp4.sm120.aot import compile_default_gemm1
from glm5_fp4.sm120.build import global_load_widths

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("tokens", nargs="?", default="1,512")
ap.add_argument("--cc", type=int, default=90)
args = ap.parse_args()
for t in [int(v) for v in args.tokens.split(",")]:
    for layout in DECODE_LAYOUTS:
        b = compile_default_gemm1(args.cc, t, layout)
        print(t, layout, "regs", b.registers, dict(sorted(global_load_widths(b.ptx).items())), flush=True)
