"""Load widths of GEMM1 for each decode layout at the default plans (AOT for sm_90 with this machine's Triton; run
it on the lent H200 to see its Triton 3.6): the "tiled" layout must load as wide as "placed".

    python benchmarks/aot_ptx.py 1,512          # T values; --cc 120 for sm_120
"""

import argparse

from glm5_fp4.kernels import configs as C
from glm5_fp4.sm120.aot import ARCH_OF_CC, compile_plan
from glm5_fp4.sm120.build import global_load_widths

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("tokens", nargs="?", default="1,512")
ap.add_argument("--cc", type=int, default=90)
args = ap.parse_args()
for t in [int(v) for v in args.tokens.split(",")]:
    plan = C.plan(ARCH_OF_CC[args.cc], t, 256, 8, 6144, 256, sm_count=132)
    for layout in ("split", "placed", "tiled"):
        b = next(x for x in compile_plan(plan, args.cc, tokens=t, layout=layout) if "gemm1" in x.kernel)
        print(t, layout, "regs", b.registers, dict(sorted(global_load_widths(b.ptx).items())), flush=True)
