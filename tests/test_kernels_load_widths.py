"""GEMM1's weight tiles arrive in 16-byte copies, and every decode layout loads exactly as wide as "placed" (AOT
PTX for sm_90 at the TP8 shard's default plans, no GPU).

A tile whose addresses Triton cannot prove contiguous and aligned is copied in narrower pieces: on the H200 that
made every layer ~3x slower (a column vector written (8 * offs) // 8, 6044a63: this test fails on that kernel) and,
with Triton 3.6 only, the tiled layout ~45 % slower (offsets through k % KT, fixed in e06a25f; Triton 3.9 here
vectorised that form, so only benchmarks/aot_ptx.py run on the lent GPU shows such a case). Widths are the
compiler's: `make test` runs this file under the test venv's Triton and again under the engines' (Triton 3.8,
Makefile ENGINE_TRITON_TESTS; improvements/16).
"""

from __future__ import annotations

import pytest

from glm5_fp4.kernels.layout import DECODE_LAYOUTS
from glm5_fp4.sm120.aot import compile_default_gemm1
from glm5_fp4.sm120.build import global_load_widths


# T=1: slot schedule, K split; 512: grouped 64x32x256; 4096: grouped 128x128x128 (half a run per K tile, whose
# 8 scale bytes per row come in 4-byte copies in every layout)
@pytest.mark.parametrize("t,narrow_scales", [(1, False), (512, False), (4096, True)])
def test_gemm1_weight_tiles_come_in_16_byte_copies_in_every_layout(t, narrow_scales):
    placed = global_load_widths(compile_default_gemm1(90, t, "placed").ptx)
    assert placed.get("cp.async 16", 0) >= 16, placed  # the pipelined weight tiles
    assert bool(placed.get("cp.async 4")) == narrow_scales, placed
    for layout in DECODE_LAYOUTS:
        assert global_load_widths(compile_default_gemm1(90, t, layout).ptx) == placed, layout


def test_load_widths_are_read_from_ptx():
    ptx = "\n".join([
        "cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;",
        "cp.async.ca.shared.global [ %r3 + 0 ], [ %rd2 + 0 ], 0x4, %r4;",
        "ld.global.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd3 + 0 ];",
        "ld.global.L1::evict_last.b16 { %rs1 }, [ %rd4 + 0 ];",
        "@%p1 ld.global.b32 { %r9 }, [ %rd5 + 0 ];",
    ])
    assert global_load_widths(ptx) == {"cp.async 16": 1, "cp.async 4": 1, "ld 16": 1, "ld 2": 1, "ld 4": 1}
