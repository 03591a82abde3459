"""GEMM1 of the grouped schedule as a warp-specialised Gluon kernel (sm_90, W4A16; opt-in, Gemm1Config.ws).

Why: the Triton GEMM1 issues the next stage's copies only after the iteration's last wgmma (the activation ring's
write-after-read), so about one stage of weights is in flight while a CTA decodes (improvements/18); on the H200 the
same kernels reach less of the copy bandwidth than on the H100 (improvements/12, 02). Here one producer warp keeps
``STAGES`` K tiles in flight whatever the consumer does: per stage it asks TMA for the tile's gate and up word rows
(two boxes of [BN, BK/8] int32 over the "tiled" layout's K-tile-major runs), and copies the block scales (BK/16
bytes a row: under TMA's 16-byte box row at BK = 128) and the gathered activation rows (fp16 in merged K order, as
the align kernel writes them) by cp.async, all arriving on the stage's ``full`` barrier. The consumer warpgroup
loads the words and scales from shared memory straight into the registers of the wgmma A operand
(:func:`word_layout`: the eight decoded K sets of a word, concatenated, are that operand with no data movement),
decodes them with the same bit operations as triton_moe (_PLACED_WORD), runs the tile's wgmma chain and frees the
stage. The grid is persistent (CTAs stride over the work list's (block, N tile) items), so the producer runs into
the next item's tiles while the consumer stores this one's act rows.

Gluon is Triton's explicit-layout dialect (``triton.experimental.gluon``); its API moves between Triton releases.
This module is written against Triton 3.6 (the lent GPUs'); it compiles for sm_90 under 3.6, 3.8 (the engines') and
3.9; the compile matrix builds the opt-in forms' launches for sm_90 (Gluon's own front end: sm120/build.py).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from glm5_fp4.kernels.configs import gemm2_k_chunk, ws_x_pass_rows
# (plain @triton.jit helpers of arithmetic and stores are callable from Gluon: the Triton kernel's own, not copies)
from glm5_fp4.kernels.triton_moe import (BLOCK_FIELDS as _FIELDS, _PLACED_WORD, _cat_sets, _store_act,
                                         _two_words_asm, _w13_k_offset)

PLACED_ASM = gl.constexpr(_two_words_asm(_PLACED_WORD))
# Triton 3.9 renamed both asynchronous copies to async_load (the old names raise there); 3.6 has only the old ones.
_tma_load = getattr(tma, "async_load", tma.async_copy_global_to_shared)
_cp_async = getattr(async_copy, "async_load", async_copy.async_copy_global_to_shared)
BLOCK_FIELDS = gl.constexpr(_FIELDS.value)


@gluon.constexpr_function
def _fragment_layout(R, C, per_col):
    """4 warps over [R, C] columns of ``per_col`` word columns each: word column bit 0 in a register, bits 1-2 in
    lanes 0-1, higher bits in registers; rows in lanes 2-4, in registers by 8 and by 64, in warps by 16."""
    reg, lane = [], []
    b = 0
    while (1 << b) < C * per_col:
        v = (1 << b) // per_col
        if b in (1, 2):
            lane.append([0, v])
        elif v:
            reg.append([0, v])
        if b == 0:
            reg.append([8, 0])
        b += 1
    m = 64
    while m < R:
        reg.append([m, 0])
        m *= 2
    return gl.DistributedLinearLayout(reg, lane + [[1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [], [R, C])


@gluon.constexpr_function
def word_layout(R, NW):
    """Layout (4 warps) of the [R, NW] words whose eight decoded K sets, concatenated (_cat_sets), are the wgmma A
    operand [R, 8*NW] (k_width 2): register bit 0 and lane bits 0-1 walk a set's columns as the operand walks K within
    16, register bit 2 (NW >= 16) the next 8 columns; rows as the operand's; the set index itself is in the registers,
    so the concatenation moves no data."""
    return _fragment_layout(R, NW, 1)


@gluon.constexpr_function
def scale_layout(R, NB):
    """The block scales [R, NB] of the same threads' words (one scale per pair of word columns)."""
    return _fragment_layout(R, NB, 2)


@gluon.jit
def _decode(wt, sb, R: gl.constexpr, BK: gl.constexpr, WL: gl.constexpr):
    NW: gl.constexpr = BK // 8
    sf = sb.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    s2 = gl.convert_layout(gl.reshape(gl.join(sf, sf), (R, NW)), WL)
    d0, d1, d2, d3, d4, d5, d6, d7 = gl.inline_asm_elementwise(
        PLACED_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [wt, s2],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True, pack=2)
    return _cat_sets(d0, d1, d2, d3, d4, d5, d6, d7, R, NW)


@gluon.jit
def _items(nblk_ptr, I: gl.constexpr, BN: gl.constexpr):
    """The persistent walk both partitions take: (first item, stride, work-list blocks, items)."""
    nb = gl.load(nblk_ptr)
    return gl.program_id(0), gl.num_programs(0), nb, nb * (I // BN)


@gluon.jit
def _item(item, nb, blk_ptr):
    """(expert, first sorted row, rows, N tile) of persistent work item ``item``: blocks fastest, so that the CTAs
    working at one time share N tiles of neighbouring experts' blocks."""
    b = item % nb
    n = item // nb
    p = blk_ptr + b * BLOCK_FIELDS
    return gl.load(p), gl.load(p + 1), gl.load(p + 2), n


@gluon.jit
def _x_rows(xq_ptr, slots_ptr, start, count, rows, TOPK, H: gl.constexpr):
    """Row pointers [R, 1] of the activations of sorted rows ``rows`` of a block (row 0's past ``count``)."""
    slot = gl.load(slots_ptr + start + rows, mask=rows < count, other=0)
    return xq_ptr + ((slot // TOPK).to(gl.int64) * H)[:, None]


@gluon.jit
def _producer(w_desc, s_ptr, xq_ptr, slots_ptr, blk_ptr, nblk_ptr, w_smem, s_smem, x_smem, full, empty, TOPK,
              H: gl.constexpr, I: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
              KT: gl.constexpr, STAGES: gl.constexpr, RCH: gl.constexpr):
    pid, nprog, nb, total = _items(nblk_ptr, I, BN)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BK, BK // 8], [1, 1], [1, 0])
    offs_r = gl.arange(0, RCH, layout=gl.SliceLayout(1, XL))
    offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, XL))
    TX: gl.constexpr = 2 * BN * BK // 2
    # the scales' [2*BN, BK/16] rows (BK/16 bytes each: under TMA's 16-byte box rows at BK = 128) by cp.async
    SLY: gl.constexpr = gl.BlockedLayout([1, BK // 16], [32, 1], [1, 1], [1, 0])
    sr = gl.arange(0, 2 * BN, layout=gl.SliceLayout(1, SLY))
    sc = gl.arange(0, BK // 16, layout=gl.SliceLayout(0, SLY))
    s_rows = gl.where(sr < BN, sr, I + sr - BN) * (KT // 16)
    it = 0
    for item in range(pid, total, nprog):
        e, start, count, n = _item(item, nb, blk_ptr)
        # the block's activation rows, looked up once per item (not per K tile: each lookup is a round trip)
        x0 = _x_rows(xq_ptr, slots_ptr, start, count, offs_r, TOPK, H)
        if BM // RCH > 1:
            x1 = _x_rows(xq_ptr, slots_ptr, start, count, offs_r + RCH, TOPK, H)
        if BM // RCH > 2:
            x2 = _x_rows(xq_ptr, slots_ptr, start, count, offs_r + 2 * RCH, TOPK, H)
            x3 = _x_rows(xq_ptr, slots_ptr, start, count, offs_r + 3 * RCH, TOPK, H)
        for k0 in range(0, H, BK):
            s = it % STAGES
            ph = (it // STAGES) & 1
            mbarrier.wait(empty.index(s), ph ^ 1)
            mbarrier.expect(full.index(s), TX)
            row = (e * (H // KT) + k0 // KT) * (2 * I) + n * BN
            _tma_load(w_desc, [row, (k0 % KT) // 8], full.index(s), w_smem.index(s).slice(0, BN))
            _tma_load(w_desc, [row + I, (k0 % KT) // 8], full.index(s), w_smem.index(s).slice(BN, BN))
            s_base = e.to(gl.int64) * (2 * I * (H // 16)) + n * BN * (KT // 16) + _w13_k_offset(k0, KT, 2 * I, H, 16)
            _cp_async(s_smem.index(s), s_ptr + s_base + s_rows[:, None] + sc[None, :])
            kk = (k0 + offs_k)[None, :]
            _cp_async(x_smem.index(s).slice(0, RCH), x0 + kk)
            if BM // RCH > 1:
                _cp_async(x_smem.index(s).slice(RCH, RCH), x1 + kk)
            if BM // RCH > 2:
                _cp_async(x_smem.index(s).slice(2 * RCH, RCH), x2 + kk)
                _cp_async(x_smem.index(s).slice(3 * RCH, RCH), x3 + kk)
            async_copy.mbarrier_arrive(full.index(s), increment_count=False)
            it += 1


@gluon.jit
def _consumer(alpha_ptr, act_ptr, blk_ptr, nblk_ptr, w_smem, s_smem, x_smem, full, empty,
              H: gl.constexpr, I: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, KC: gl.constexpr):
    pid, nprog, nb, total = _items(nblk_ptr, I, BN)
    R: gl.constexpr = 2 * BN
    NW: gl.constexpr = BK // 8
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    WL: gl.constexpr = word_layout(R, NW)
    SL: gl.constexpr = scale_layout(R, BK // 16)
    it = 0
    for item in range(pid, total, nprog):
        e, start, count, n = _item(item, nb, blk_ptr)
        alpha = gl.load(alpha_ptr + e)
        acc = gl.zeros([R, BM], gl.float32, layout=MMA)
        for k0 in range(0, H, BK):
            s = it % STAGES
            ph = (it // STAGES) & 1
            mbarrier.wait(full.index(s), ph)
            fence_async_shared()  # the activations came by cp.async (generic proxy); wgmma reads by the async proxy
            wt = w_smem.index(s).load(WL)
            sb = s_smem.index(s).load(SL)
            a = gl.convert_layout(_decode(wt, sb, R, BK, WL), AL)
            acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, is_async=True)
            # retired before the next tile decodes: ``a`` lives in registers the decode may reuse (with a wgmma left in
            # flight over them, act rows came out wrong, likely from reading the next tile's operand: improvements/30)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index(s))
            it += 1
        gate, up = gl.split(gl.permute(gl.reshape(acc, (2, BN, BM)), (1, 2, 0)))
        OL: gl.constexpr = gate.type.layout
        offs_i = n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, OL))
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, OL))
        _store_act(gate * alpha, up * alpha, 1.0, act_ptr, (start + offs_m).to(gl.int64), offs_i, offs_m < count, I,
                   BN, BM, KC, False)


@gluon.jit
def moe_gemm1_ws_kernel(w_desc, s_ptr, xq_ptr, alpha_ptr, act_ptr, slots_ptr, blk_ptr, nblk_ptr, TOPK,
                        H: gl.constexpr, I: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
                        KT: gl.constexpr, STAGES: gl.constexpr, KC: gl.constexpr, RCH: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr):
    R: gl.constexpr = 2 * BN
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, BK // 8], w_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, R, BK // 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BM, BK], XS)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # full: the producer's expect (one arrival, plus the TMA bytes) and each of its 32 lanes' cp.async arrival
        # (noinc); empty: the consumer's one arrival per stage (Gluon arrives from one thread after a warpgroup barrier)
        mbarrier.init(full.index(i), count=1 + 32)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [(_consumer, (alpha_ptr, act_ptr, blk_ptr, nblk_ptr, w_smem, s_smem, x_smem, full, empty, H, I, BN, BM, BK,
                      STAGES, KC)),
         (_producer, (w_desc, s_ptr, xq_ptr, slots_ptr, blk_ptr, nblk_ptr, w_smem, s_smem, x_smem, full, empty, TOPK,
                      H, I, BN, BM, BK, KT, STAGES, RCH))],
        [1], [PRODUCER_REGS])


# Registers of the producer's warpgroup (the producer warp and the idle warps that pad it to a warpgroup) under
# setmaxnreg; the consumer warpgroup gets the rest of the launch's budget (maxnreg x 8 warps).
PRODUCER_REGS = 56
# Swizzle of the word tiles TMA writes: the consumer's 8-byte loads (word_layout) hit no bank twice under 32 B (Gluon's
# bank_conflicts: 64 B left a 2-way conflict at BK = 128).
WORD_SWIZZLE = 32
# CTAs per SM the launch budgets registers for where the tile does not cap them (Gemm1Config.maxnreg: the launch's
# registers per thread, 65,536 / (CTAs x 256 threads)); the persistent grid is that many CTAs per SM.
CTAS_PER_SM = 2


def launch_regs(g1) -> int:
    """Registers per thread the launch asks for: the tile's cap, else the budget of CTAS_PER_SM CTAs."""
    return g1.maxnreg or 65536 // (256 * CTAS_PER_SM)


def ctas_per_sm(g1) -> int:
    return 65536 // (256 * launch_regs(g1))


def launch_args(call, g1, sm_count: int) -> tuple[tuple, tuple, dict]:
    """(grid, args, kwargs) of one GEMM1 launch of the grouped schedule (the align kernel has run)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from glm5_fp4.kernels.layout import w13_k_tile
    from glm5_fp4.kernels.launch import max_blocks

    p, ws = call.prepared, call.workspace
    h, i = p.hidden_size, p.intermediate_size
    kt = w13_k_tile(p.layout, h)
    words = p.w13.view(torch.int32).reshape(-1, kt // 8)
    wl = gl.NVMMASharedLayout(swizzle_byte_width=WORD_SWIZZLE, element_bitwidth=32, rank=2)
    wd = TensorDescriptor.from_tensor(words, [g1.bn, g1.bk // 8], wl)
    items = max_blocks(call.num_slots, p.num_experts, g1.bm) * (i // g1.bn)
    grid = (max(1, min(items, ctas_per_sm(g1) * sm_count)),)
    args = (wd, p.w13_scale, ws.xq, p.w13_alpha, ws.act, ws.slots, ws.blocks, ws.num_blocks, call.top_k)
    kwargs = dict(H=h, I=i, BN=g1.bn, BM=g1.bm, BK=g1.bk, KT=kt, STAGES=g1.num_stages, KC=gemm2_k_chunk(i),
                  RCH=ws_x_pass_rows(g1), PRODUCER_REGS=PRODUCER_REGS, num_warps=g1.num_warps,
                  maxnreg=launch_regs(g1))
    return grid, args, kwargs
