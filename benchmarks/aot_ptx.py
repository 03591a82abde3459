"""Vector widths of GEMM1's global loads for the placed and the tiled layout at the sm_90 default plans (AOT, this
machine's Triton; on the lent H200 its Triton 3.6): python benchmarks/aot_ptx.py 1,512"""
import re, sys, collections
from glm5_fp4.kernels import configs as C
from glm5_fp4.sm120.aot import compile_plan
for t in [int(v) for v in sys.argv[1].split(",")]:
    plan = C.plan("sm90", t, 256, 8, 6144, 256, sm_count=132)
    for layout in ("placed", "tiled"):
        b = [x for x in compile_plan(plan, 90, tokens=t, layout=layout) if "gemm1" in x.kernel][0]
        cp = collections.Counter(re.findall(r"cp\.async\.(c[ag])\.shared\.global(?:\.L2::\w+)?\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)", b.ptx))
        ld = collections.Counter(re.findall(r"ld\.global[\w.:]*?\.(v\d\.)?([bu]\d+)", b.ptx))
        print(t, layout, "regs", b.registers, "cp.async", dict(cp), "ld.global", dict(ld), flush=True)
