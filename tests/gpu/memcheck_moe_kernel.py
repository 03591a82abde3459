"""Small fused-MoE cases for compute-sanitizer (not a pytest module):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/gpu/memcheck_moe_kernel.py
"""

import torch

from glm5_fp4.kernels import fused_moe, prepare_experts
from glm5_fp4.reference import moe_reference, random_experts, route


def main() -> int:
    g = torch.Generator().manual_seed(0)
    ex = random_experts(8, 256, 128, generator=g)
    prep = prepare_experts(ex.to("cuda"))
    worst = 0.0
    for t in (1, 3, 20):  # slot schedule, then grouped
        x = torch.randn(t, 256, generator=g).to(torch.bfloat16).cuda()
        w, ids = route(torch.randn(t, 8, generator=g), None, 2)
        w, ids = w.cuda(), ids.cuda()
        for mode in ("w4a16", "w4a4"):
            out = fused_moe(x, w, ids, prep, mode=mode)
            ref = moe_reference(x.float().cpu(), w.cpu(), ids.cpu(), ex, mode=mode)
            worst = max(worst, ((out.float().cpu() - ref).norm() / ref.norm()).item())
    torch.cuda.synchronize()
    print(f"memcheck cases done, worst relative error {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
