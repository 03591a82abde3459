"""Predicted floors on RTX PRO 6000: checked against a routing simulation and hand arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from glm5_fp4.hardware import get_gpu
from glm5_fp4.sm120.floors import expected_padded_columns, floors, mma_flops
from glm5_fp4.spec import Glm5Spec


def _simulated_padded_columns(tokens, e, k, bm, trials=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(trials):
        ids = torch.rand(tokens, e, generator=g).topk(k, dim=1).indices  # k distinct experts, uniform
        counts = torch.bincount(ids.flatten(), minlength=e).double()
        total += (torch.ceil(counts / bm) * bm).sum().item()
    return total / trials


def _simulated_counts(tokens, e, k, trials=200, seed=1):
    """Tokens per expert, [trials, e], under uniform routing of ``tokens`` tokens to ``k`` distinct experts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(trials, tokens, e, generator=g).topk(k, dim=2).indices
    return torch.stack([torch.bincount(t.flatten(), minlength=e) for t in ids]).double()


@pytest.mark.parametrize("tokens,bm", [(16, 16), (64, 16), (256, 32), (512, 64)])
def test_padded_columns_match_simulated_routing(tokens, bm):
    exact = expected_padded_columns(tokens, 256, 8, bm)
    sim = _simulated_padded_columns(tokens, 256, 8, bm)
    assert exact == pytest.approx(sim, rel=0.02)
    assert exact >= tokens * 8  # padding only adds columns


def test_floors_on_rtx_pro_6000():
    gpu = get_gpu("rtx-pro-6000-ws")
    spec = Glm5Spec()
    rows = floors(gpu, (1, 4, 16, 256, 1024), tps=(8,), spec=spec)
    by_t = {r.tokens: r for r in rows}
    i, h = 256, 6144
    # T=1: 8 experts, each 3*I*H weights at 4.5 bits, plus x and out in bf16, at 1792 GB/s
    one = by_t[1]
    assert one.experts_touched == pytest.approx(8.0)
    assert one.bytes_needed == pytest.approx(8 * 3 * i * h * 9 / 16 + 4 * h)
    assert one.bandwidth_floor_us == pytest.approx(one.bytes_needed / 1792e9 * 1e6)
    assert one.bandwidth_floor_us == pytest.approx(11.8, abs=0.1)
    # slot schedule: every slot is one 16-wide MMA block in both GEMMs
    assert one.schedule == "slot"
    assert one.mma_gflop == pytest.approx(2 * 8 * 16 * 3 * i * h / 1e9)
    assert one.limiter == "bandwidth"
    # every expert touched from a few hundred tokens on: the bandwidth floor stops growing with T
    assert by_t[1024].experts_touched == pytest.approx(256, abs=0.01)
    w_all = 256 * 3 * i * h * 9 / 16
    assert by_t[1024].bytes_needed == pytest.approx(w_all + 4 * 1024 * h)
    # the compute floor is at least the useful work at the 16-bit peak
    for r in rows:
        assert r.compute_floor_us >= r.useful_gflop * 1e9 / (gpu.peak_tflops("bf16") * 1e12) * 1e6 - 1e-9
        assert r.bound_us == max(r.bandwidth_floor_us, r.compute_floor_us)
        assert r.fp4_mma_floor_us >= r.useful_gflop * 1e9 / (gpu.peak_tflops("nvfp4") * 1e12) * 1e6 - 1e-9
    # T=256 runs the grouped schedule: its compute floor counts each expert's tokens padded to the row's own bm,
    # and GEMM1 launches one program per (N tile, expert with tokens); both against simulated routing
    row = by_t[256]
    assert row.schedule == "grouped"
    counts = _simulated_counts(256, 256, 8)
    cols1, cols2 = ((torch.ceil(counts / bm) * bm).sum(1).mean().item() for bm in (row.gemm1["bm"], row.gemm2["bm"]))
    mma = 2.0 * cols1 * 2 * i * h + 2.0 * cols2 * h * i
    assert row.compute_floor_us == pytest.approx(mma / (gpu.peak_tflops("bf16") * 1e12) * 1e6, rel=0.02)
    active = (counts > 0).sum(1).double().mean().item()
    assert row.programs_gemm1 == pytest.approx((i // row.gemm1["bn"]) * active, rel=0.01)
    # the small-batch defaults (configs.SLOT_DEDUP_MIN_TOKENS, pick_grouped_split_k): at T=4 one program group
    # per touched expert, at T=16 GEMM1's K in ranges; the programs with work count them
    from glm5_fp4.kernels import configs as C

    for t in (4, 16):
        r = by_t[t]
        p = C.plan("sm120", t, 256, 8, h, i, sm_count=gpu.sm_count)
        assert (p.slot_dedup, p.gemm1_split_k > 1) == ((True, True) if t == 4 else (False, True))
        assert r.programs_gemm1 == pytest.approx((i // r.gemm1["bn"]) * r.experts_touched * p.gemm1_split_k)
        assert r.programs_gemm2 == pytest.approx(r.gemm2_n_split * r.experts_touched)


def test_mma_flops_grouped_pads_per_expert():
    # one token: its 8 experts each get one bm-wide block
    f = mma_flops(1, 256, 8, 6144, 256, "grouped", 32, 16)
    assert f == pytest.approx(2 * 8 * 32 * 2 * 256 * 6144 + 2 * 8 * 16 * 6144 * 256)
    assert math.isfinite(f)
