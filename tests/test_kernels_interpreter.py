"""The fused MoE's Triton kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny shapes.

The interpreter must be switched on before triton is imported, so the cases run in a subprocess. They use
fp16 activations (the interpreter's bf16 tl.dot is broken) and the portable decode (the interpreter cannot
run the inline PTX; tests/gpu checks that the PTX decode equals it). Covered: both schedules (slot, grouped
with several token blocks per expert), W4A16 and W4A4 against the reference, NaN-poisoned outputs, skewed
routings (one expert gets every token, most experts empty), int32 ids, and the kernel's E4M3 rounding.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import dataclasses, json, os
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch, triton, triton.language as tl
    from glm5_fp4.reference import random_experts, route, moe_reference
    from glm5_fp4.kernels import prepare_experts
    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels.moe import fused_moe_triton
    from glm5_fp4.kernels.triton_moe import _round_e4m3, _decode_code

    res = {}
    g = torch.Generator().manual_seed(int(os.environ.get("SEED", "0")))
    E, H, I, K = 8, 128, 128, 2
    ex = random_experts(E, H, I, generator=g)
    prep = prepare_experts(ex)

    def run(name, x, w, ids, mode, schedule, experts=None, merged=True, **flags):
        ex_, prep_ = experts or (ex, prep)
        h = x.shape[1]
        plan = C.plan("sm90", x.shape[0], E, K, h, I, schedule=schedule,
                      gemm1=C.Gemm1Config(16, 16, 128, 4, 2, merged), gemm2=C.Gemm2Config(32, 16, 4, 2, merged=merged))
        plan = dataclasses.replace(plan, **flags)
        out = torch.full_like(x, float("nan"))
        fused_moe_triton(x, w, ids, prep_, mode, out=out, plan=plan)
        ref = moe_reference(x.float(), w.float(), ids.long(), ex_, mode=mode)
        res[name] = dict(err=((out.float() - ref).norm() / ref.norm()).item(), finite=bool(torch.isfinite(out).all()))

    x = torch.randn(3, H, generator=g).half()
    w, ids = route(torch.randn(3, E, generator=g), None, K)
    run("slot_w4a16", x, w, ids, "w4a16", "slot")
    run("slot_w4a4", x, w, ids, "w4a4", "slot")

    x = torch.randn(40, H, generator=g).half()
    w, ids = route(torch.randn(40, E, generator=g), None, K)
    run("grouped_w4a16", x, w, ids.to(torch.int32), "w4a16", "grouped")
    run("grouped_w4a4", x, w, ids, "w4a4", "grouped")

    # every token's first expert is 5 (24 > 16 tokens: two token blocks); only experts 5 and 2 used
    t = 24
    ids = torch.stack([torch.full((t,), 5), torch.full((t,), 2)], dim=1)
    w = torch.rand(t, K, generator=g)
    x = torch.randn(t, H, generator=g).half()
    run("skewed_grouped", x, w, ids, "w4a16", "grouped")

    # eight MMAs per tile instead of one chain; x converted per K tile instead of by the align kernel
    x = torch.randn(40, H, generator=g).half()
    w, ids = route(torch.randn(40, E, generator=g), None, K)
    run("grouped_w4a16_unmerged", x, w, ids, "w4a16", "grouped", merged=False)
    run("grouped_w4a16_noprep", x, w, ids, "w4a16", "grouped", prep_x=False)
    run("grouped_w4a4_unmerged", x, w, ids, "w4a4", "grouped", merged=False)

    # split-K of the slot GEMM1 needs two K tiles: H = 256
    ex2 = random_experts(E, 256, I, generator=g)
    both = (ex2, prepare_experts(ex2))
    x = torch.randn(3, 256, generator=g).half()
    w, ids = route(torch.randn(3, E, generator=g), None, K)
    run("slot_w4a16_splitk", x, w, ids, "w4a16", "slot", experts=both, gemm1_split_k=2)
    run("slot_w4a4_splitk_unmerged", x, w, ids, "w4a4", "slot", experts=both, merged=False, gemm1_split_k=2)

    @triton.jit
    def rk(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + o, _round_e4m3(tl.load(x_ptr + o, mask=o < n)), mask=o < n)

    grid = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                      torch.rand(4000, generator=g) * 500, torch.rand(1000, generator=g) * 0.03])
    y = torch.empty_like(vals)
    rk[(triton.cdiv(vals.numel(), 1024),)](vals, y, vals.numel(), BLOCK=1024)
    want = vals.clamp(max=448).to(torch.float8_e4m3fn).float()
    res["round_e4m3_mismatches"] = int((y != want).sum())

    @triton.jit
    def dk(c_ptr, y_ptr):
        o = tl.arange(0, 16)
        tl.store(y_ptr + o, _decode_code(tl.load(c_ptr + o)).to(tl.float32))
    codes = torch.arange(16, dtype=torch.int32)
    yy = torch.empty(16)
    dk[(1,)](codes, yy)
    from glm5_fp4 import nvfp4
    res["decode_max_err"] = float((yy * 64 - nvfp4.e2m1_decode(codes.to(torch.uint8))).abs().max())
    print("RESULT" + json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", SEED=str(int.from_bytes(os.urandom(2), "little")))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize(
    "case",
    ["slot_w4a16", "slot_w4a4", "grouped_w4a16", "grouped_w4a4", "skewed_grouped", "grouped_w4a16_unmerged",
     "grouped_w4a16_noprep", "grouped_w4a4_unmerged", "slot_w4a16_splitk", "slot_w4a4_splitk_unmerged"],
)
def test_interpreted_kernel_matches_reference(interpreted, case):
    r = interpreted[case]
    assert r["finite"], f"{case}: NaN-poisoned output not fully written"
    assert r["err"] < 1e-2, f"{case}: relative error {r['err']:.3e}"


def test_kernel_e4m3_rounding_matches_torch(interpreted):
    assert interpreted["round_e4m3_mismatches"] == 0


def test_portable_decode_is_exact(interpreted):
    assert interpreted["decode_max_err"] == 0.0
