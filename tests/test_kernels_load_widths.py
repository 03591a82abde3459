"""GEMM1's weight tiles arrive in 16-byte copies under every decode layout (AOT PTX for sm_90, no GPU).

A tile whose addresses Triton cannot prove contiguous and aligned is copied in 4-byte pieces: on the H200 that made
every layer ~3x slower (a column vector written (8 * offs) // 8, 6044a63) and, with Triton 3.6 only, the tiled
layout ~45 % slower (offsets through k % KT, fixed in e06a25f: Triton 3.9 here vectorised that form, so this test
could not have caught it; benchmarks/aot_ptx.py run on the lent GPU does). The layouts differ only in addresses,
so each must load exactly as wide as "placed".
"""

from __future__ import annotations

import pytest

from glm5_fp4.kernels import configs as C
from glm5_fp4.sm120.aot import compile_plan
from glm5_fp4.sm120.build import global_load_widths


def _gemm1_widths(t: int, layout: str) -> dict[str, int]:
    plan = C.plan("sm90", t, 256, 8, 6144, 256, sm_count=132)  # the TP8 shard's default plan at T
    build = next(b for b in compile_plan(plan, 90, tokens=t, layout=layout) if "gemm1" in b.kernel)
    return global_load_widths(build.ptx)


@pytest.mark.parametrize("t", [1, 512])
def test_gemm1_weight_tiles_come_in_16_byte_copies_in_every_layout(t):
    placed = _gemm1_widths(t, "placed")
    assert placed.get("cp.async 16", 0) >= 16, placed  # the pipelined weight tiles
    assert not placed.get("cp.async 4"), placed  # nothing of the stream in 4-byte pieces
    for layout in ("split", "tiled"):
        assert _gemm1_widths(t, layout) == placed, layout


def test_load_widths_are_read_from_ptx():
    ptx = "\n".join([
        "cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;",
        "cp.async.ca.shared.global [ %r3 + 0 ], [ %rd2 + 0 ], 0x4, %r4;",
        "ld.global.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd3 + 0 ];",
        "ld.global.L1::evict_last.b16 { %rs1 }, [ %rd4 + 0 ];",
        "@%p1 ld.global.b32 { %r9 }, [ %rd5 + 0 ];",
    ])
    assert global_load_widths(ptx) == {"cp.async 16": 1, "cp.async 4": 1, "ld 16": 1, "ld 2": 1, "ld 4": 1}
