"""Native NVFP4 x NVFP4 MoE GEMMs for SM100/SM120 through ``tl.dot_scaled`` -- UNVERIFIED.

Status: compiles (ahead of time, Triton 3.9) to ``mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4X
... .ue4m3`` on sm_120 and ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`` on sm_100
(tests/test_kernels_configs.py), but has never run: no SM100/SM120 GPU was available and Triton's
interpreter does not emulate E4M3-scaled ``dot_scaled``. Off unless ``GLM5_FP4_NATIVE_FP4=1``.

This is the W4A4 mode for real: activations are quantized in-kernel exactly like the W4A4 emulation
(global ``1 / input_scale``, E4M3 scale per 16, E2M1 round-to-nearest-even), the weights stay in the
checkpoint packing (``prepare_experts(..., layout="checkpoint")``: two codes per byte, even K in the low
nibble, which is what ``dot_scaled`` reads), and the tensor cores multiply FP4 by FP4 with the block scales.
GEMM1 writes the SwiGLU output already quantized (codes + scales) for GEMM2. Routing alignment, combine
workspace and the final conversion are shared with the W4A16 kernels (``triton_moe``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5_fp4.kernels.triton_moe import _block_rows, _e2m1_index, _round_e4m3


@triton.jit
def _quant_fp4(x, g, R: tl.constexpr, C: tl.constexpr):
    """fp32 ``x`` [R, C] -> (E2M1 codes packed along C [R, C/2] uint8, E4M3 scales [R, C/16])."""
    xb = tl.reshape(x, (R, C // 16, 16))
    amax = tl.max(tl.abs(xb), axis=2)
    s = _round_e4m3(tl.math.div_rn(g * amax, 6.0))
    y = tl.math.div_rn(xb * g, tl.where(s > 0, s, 1.0)[:, :, None])
    v = tl.where(s[:, :, None] > 0, tl.abs(y), 0.0)
    code = _e2m1_index(v) | ((y < 0).to(tl.int32) << 3)
    lo, hi = tl.split(tl.reshape(code, (R, C // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    return packed, s.to(tl.float8e4nv)


@triton.jit
def moe_gemm1_native_kernel(
    x_ptr, stride_xt, w_ptr, s_ptr, w_global_ptr, a_scale_ptr, a_gscale_ptr, o_gscale_ptr,
    actq_ptr, acts_ptr, slots_ptr, blk_ptr, num_blocks_ptr, TOPK,
    H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """act = NVFP4(silu(xq Wg^T) * (xq Wu^T)) for one work-list block's rows and this program's I tile.
    Grid: (block, I tile)."""
    pid_n = tl.program_id(1)
    e, count, start = _block_rows(tl.program_id(0), blk_ptr, num_blocks_ptr)
    e64 = e.to(tl.int64)
    offs_i = pid_n * BN + tl.arange(0, BN)
    offs_kb = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // 16)
    offs_k = tl.arange(0, BK)
    w_gate = w_ptr + e64 * (2 * I * (H // 2)) + offs_i[:, None] * (H // 2) + offs_kb[None, :]
    w_up = w_gate + I * (H // 2)
    s_gate = s_ptr + e64 * (2 * I * (H // 16)) + offs_i[:, None] * (H // 16) + offs_ks[None, :]
    s_up = s_gate + I * (H // 16)
    g_in = tl.load(a_gscale_ptr + e)
    g_out = tl.load(o_gscale_ptr + e)
    alpha = tl.load(w_global_ptr + e) * tl.load(a_scale_ptr + e)
    for m0 in range(0, count, BM):
        offs_m = m0 + tl.arange(0, BM)
        mmask = offs_m < count
        slot = tl.load(slots_ptr + start + offs_m, mask=mmask, other=0)
        tok = (slot // TOPK).to(tl.int64)
        xp = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
        acc_g = tl.zeros((BN, BM), dtype=tl.float32)
        acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, H, BK):
            xq, xs = _quant_fp4(tl.load(xp + k0, mask=mmask[:, None], other=0.0).to(tl.float32), g_in, BM, BK)
            xq_t = tl.trans(xq)
            wg = tl.load(w_gate + k0 // 2)
            sg = tl.load(s_gate + k0 // 16).to(tl.float8e4nv, bitcast=True)
            acc_g = tl.dot_scaled(wg, sg, "e2m1", xq_t, xs, "e2m1", acc_g)
            wu = tl.load(w_up + k0 // 2)
            su = tl.load(s_up + k0 // 16).to(tl.float8e4nv, bitcast=True)
            acc_u = tl.dot_scaled(wu, su, "e2m1", xq_t, xs, "e2m1", acc_u)
        gate = acc_g * alpha
        up = acc_u * alpha
        act = tl.trans(gate / (1.0 + tl.exp(-gate)) * up)  # [BM, BN]
        aq, as_ = _quant_fp4(act, g_out, BM, BN)
        rows = (start + offs_m).to(tl.int64)
        offs_q = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        offs_s = pid_n * (BN // 16) + tl.arange(0, BN // 16)
        tl.store(actq_ptr + rows[:, None] * (I // 2) + offs_q[None, :], aq, mask=mmask[:, None])
        tl.store(acts_ptr + rows[:, None] * (I // 16) + offs_s[None, :], as_.to(tl.uint8, bitcast=True),
                 mask=mmask[:, None])


@triton.jit
def moe_gemm2_native_kernel(
    actq_ptr, acts_ptr, w_ptr, s_ptr, w_global_ptr, a_scale_ptr, topk_w_ptr, ws_ptr,
    slots_ptr, blk_ptr, num_blocks_ptr, TOPK,
    H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, N_SPLIT: tl.constexpr,
):
    """ws[token, n] += router_weight * (act W_down^T)[row, n], FP4 x FP4 with block scales, for one work-list
    block's rows (walked BM at a time). Grid: (N range, block)."""
    pid_s = tl.program_id(0)
    e, count, start = _block_rows(tl.program_id(1), blk_ptr, num_blocks_ptr)
    e64 = e.to(tl.int64)
    alpha = tl.load(w_global_ptr + e) * tl.load(a_scale_ptr + e)
    # Triton 3.8 (vLLM 0.33's, SGLang 0.5.23's) fails sm_100's build of this kernel in its
    # TritonGPUOptimizeAccumulatorInit pass ("'ttng.tmem_alloc' op uninitialized alloc must have a mutable memdesc
    # type") when the dot starts from no accumulator or a constant zero; a zero it cannot prove at compile time
    # (alpha * 0.0: not folded, alpha is finite) keeps the pass away. 3.9 builds either form; drop this once the
    # engines ship a Triton past 3.8 (tests/test_kernels_configs.py compiles it under both).
    zero = alpha * 0.0
    offs_kb = tl.arange(0, I // 2)
    offs_ks = tl.arange(0, I // 16)
    offs_bn = tl.arange(0, BN)
    n_per: tl.constexpr = H // N_SPLIT
    n_begin = pid_s * n_per
    w_base = w_ptr + e64 * (H * (I // 2)) + offs_bn[:, None] * (I // 2) + offs_kb[None, :]
    s_base = s_ptr + e64 * (H * (I // 16)) + offs_bn[:, None] * (I // 16) + offs_ks[None, :]
    for m0 in range(0, count, BM):
        offs_m = m0 + tl.arange(0, BM)
        mmask = offs_m < count
        rows = (start + offs_m).to(tl.int64)
        slot = tl.load(slots_ptr + start + offs_m, mask=mmask, other=0)
        tok = (slot // TOPK).to(tl.int64)
        scale = tl.load(topk_w_ptr + slot, mask=mmask, other=0.0) * alpha
        aq = tl.load(actq_ptr + rows[:, None] * (I // 2) + offs_kb[None, :], mask=mmask[:, None], other=0)
        as_ = tl.load(acts_ptr + rows[:, None] * (I // 16) + offs_ks[None, :], mask=mmask[:, None], other=0)
        aq_t = tl.trans(aq)
        as_ = as_.to(tl.float8e4nv, bitcast=True)
        out_ptrs = ws_ptr + tok[None, :] * H + offs_bn[:, None]
        for n0 in range(n_begin, n_begin + n_per, BN):
            w = tl.load(w_base + n0 * (I // 2))
            ws = tl.load(s_base + n0 * (I // 16)).to(tl.float8e4nv, bitcast=True)
            acc = tl.dot_scaled(w, ws, "e2m1", aq_t, as_, "e2m1", acc=tl.full((BN, BM), zero, tl.float32))
            tl.atomic_add(out_ptrs + n0, acc * scale[None, :], mask=mmask[None, :], sem="relaxed")
