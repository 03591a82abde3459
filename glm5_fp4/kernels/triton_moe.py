"""Triton kernels of the fused NVFP4 MoE: routing alignment, gate/up GEMM + SwiGLU, down GEMM + combine.

Weights stay NVFP4 in memory (0.5625 B per weight) and are decoded in registers right before a 16-bit MMA:
each E2M1 nibble is moved into the bit positions of an E4M3 byte (exact: value / 64), the FP8 hardware
conversion (``cvt.rn.f16x2.e4m3x2``, SM89+) turns byte pairs into fp16 pairs, and one fp16 multiply per
value applies the E4M3 block scale; the per-expert global scale and the factor 64 are applied to the fp32
accumulator. Products are exact in fp16, so the MMA sees exactly ``e2m1 * block_scale / 64``. Weights prepared in the
"placed" or "tiled" layout (layout.place_nibbles; "tiled", the default, also stores GEMM1's weights K-tile-major)
take the same route with 5 instead of 7 bit operations per word.

GEMMs are "swap-AB": the weight tile is the MMA's M side (64+ rows for wgmma), tokens the N side (16+), so
a handful of tokens per expert wastes little.

Two schedules (see :mod:`glm5_fp4.kernels.configs` for when each is used):

* ``slot`` (tiny batches): no sorting. GEMM1 runs one program per (N-tile, token-slot[, K range]); with
  split-K a reduce kernel adds the partial sums and applies SwiGLU once per slot; GEMM2 runs one program
  per (N-range, token) and sums the token's ``top_k`` experts in registers, writing the output directly:
  2 launches (3 with split-K; 2 again when the last GEMM1 program of each tile does the reduce,
  ``Plan.gemm1_fused_reduce``, opt-in), deterministic.
* ``grouped``: an alignment kernel counts tokens per expert, writes each expert's slots contiguously and
  builds a **work list** of token blocks: expert ``e`` with ``c`` tokens contributes ``ceil(c / BM)`` blocks
  of at most ``BM`` rows, listed expert by expert. GEMM1 and GEMM2 run one program per (block, N tile), so
  the work of a hot expert spreads over as many SMs as it has blocks, and the blocks of one expert sit next
  to each other in launch order (their weight tiles are read from DRAM once and from L2 after). The grid
  is sized from a static bound on the number of blocks; programs past the list's end exit at once. Under
  balanced decode an expert has about one block, so each weight is read once per layer call. The align
  kernel also zeroes the fp32 combine workspace and (W4A16) writes the activations as fp16 in the merged K
  order below; GEMM2 multiplies by the router weight and adds into the workspace with fp32 atomics; a last
  kernel converts the workspace to the output dtype. 4 launches.

Expert parallelism: with an expert map (global expert id -> local id, -1 where the expert lives on another
rank), slots routed to remote experts are dropped by the alignment (grouped) or skipped (slot schedule):
they cost nothing, and a token whose experts are all remote gets a zero row.

Merged K order: the decode yields eight operands per weight tile, set j holding the K offsets
16*(c//2) + 2*j + c%2 (c = 0 .. BK/8-1). Concatenating them (set j in columns j*BK/8 ..) is free in
registers, so one MMA chain covers the tile; the activation tile is stored in that same order (x by the
align kernel per BK tile, act by GEMM1 per I-wide row), so it is one contiguous load. ``merged=False``
configs keep eight MMAs per tile (fewer registers; better for GEMM2 on sm90).

The combine uses atomics rather than a deterministic [T*k, H] reduce because the reduce would move
``T*k*H*2*2`` bytes (100 MB at T=512, ~24 us at 4.2 TB/s, 15 % of the layer's floor) while the fp32
workspace (``T*H*4`` bytes, 12.6 MB at T=512) stays in L2. The price: fp32 sums of a token's 8 expert
outputs are added in a run-dependent order (differences far below bf16 rounding).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda  # griddepcontrol (programmatic dependent launch, SM90+)

from glm5_fp4 import nvfp4

# Two 32-bit words = one 16-element scale block of one weight row (layout.py): word A holds K offsets 0..7
# (byte j: k=j low nibble, k=4+j high nibble), word B offsets 8..15. Outputs $0..$7 are the fp16 pairs
# (k=2j, k=2j+1) for j = 0..7, i.e. set j of the eight K subsets, each times the block scale pair $10.
# Each nibble becomes an E4M3 byte (magnitude bits -> bits 2-4, sign -> bit 7: exactly value / 64) and
# cvt.rn.f16x2.e4m3x2 converts two bytes at once.
_DECODE_WORD = """
shl.b32 a, {w}, 2;
and.b32 a, a, 0x1C1C1C1C;
shl.b32 b, {w}, 4;
and.b32 b, b, 0x80808080;
or.b32 lo, a, b;
shr.b32 a, {w}, 2;
and.b32 a, a, 0x1C1C1C1C;
and.b32 b, {w}, 0x80808080;
or.b32 hi, a, b;
"""
# Both layouts end alike: the two E4M3 byte registers -> four fp16 pairs, each times the block-scale pair $10.
_CONVERT_WORD = """mov.b32 {{l0, l1}}, lo;
mov.b32 {{h0, h1}}, hi;
cvt.rn.f16x2.e4m3x2 t, l0;
mul.rn.f16x2 {o0}, t, $10;
cvt.rn.f16x2.e4m3x2 t, l1;
mul.rn.f16x2 {o1}, t, $10;
cvt.rn.f16x2.e4m3x2 t, h0;
mul.rn.f16x2 {o2}, t, $10;
cvt.rn.f16x2.e4m3x2 t, h1;
mul.rn.f16x2 {o3}, t, $10;
"""


def _two_words_asm(word: str) -> str:
    """The inline asm decoding words $8 and $9 into outputs $0..$7 with ``word``'s bit operations."""
    body = word + _CONVERT_WORD
    return ("{\n.reg .b32 a, b, lo, hi, t;\n.reg .b16 l0, l1, h0, h1;\n"
            + body.format(w="$8", o0="$0", o1="$1", o2="$2", o3="$3")
            + body.format(w="$9", o0="$4", o1="$5", o2="$6", o3="$7") + "}\n")


_DECODE_ASM = tl.constexpr(_two_words_asm(_DECODE_WORD))

# The same decode for the "placed" layout (layout.place_nibbles): the codes of K offsets 0..3 already sit at
# the E4M3 bit positions (sign 7, magnitude 4..2 of byte j), so one AND yields them; the other four codes'
# bits are spread over the remaining bit positions so that a rotate by 6 puts sign and top two magnitude bits
# in place and a shift by 2 the lowest one: 5 bit operations per word instead of 7 (SASS: one LOP3 for lo;
# SHF, SHF/IMAD.SHL and two LOP3 for hi). Two shift classes are the minimum: no single shift of the free
# bit positions {6,5,1,0} lands on {7,4,3,2} in every byte.
_PLACED_WORD = """
and.b32 lo, {w}, 0x9C9C9C9C;
shf.l.wrap.b32 a, {w}, {w}, 6;
and.b32 a, a, 0x98989898;
shl.b32 b, {w}, 2;
and.b32 b, b, 0x04040404;
or.b32 hi, a, b;
"""
_PLACED_ASM = tl.constexpr(_two_words_asm(_PLACED_WORD))

# Benchmarks only (DIAG=1, wrong results): each word itself, read as an fp16 pair, combined with the block-scale
# pair into four different outputs by one multiply or fused multiply-add each: the weight and scale bytes, the scale
# conversion, one scale instruction per output pair and the MMA operands stay as in the real decode; the bit
# operations and E4M3 conversions go. The time difference to the real decode is what any cheaper decode could gain
# at most. (The outputs must differ: four identical multiplies were merged into one by ptxas, so the H200 run of
# 2026-12-03 at 52c7f17 also left out three quarters of the scale multiplies: 32 HMUL2 per K tile instead of 128.)
_FREE_WORD = """mul.rn.f16x2 {o0}, {w}, $10;
fma.rn.f16x2 {o1}, {w}, $10, {w};
fma.rn.f16x2 {o2}, {w}, $10, $10;
fma.rn.f16x2 {o3}, $10, $10, {w};
"""
_FREE_ASM = tl.constexpr("{\n" + _FREE_WORD.format(w="$8", o0="$0", o1="$1", o2="$2", o3="$3")
                         + _FREE_WORD.format(w="$9", o0="$4", o1="$5", o2="$6", o3="$7") + "}\n")


@triton.jit
def _decode_code(v):
    """E2M1 codes (int, 0..15) -> fp16 value / 64, through the same E4M3 bit trick as the asm."""
    e8 = (((v & 0x7) << 2) | ((v & 0x8) << 4)).to(tl.uint8)
    return e8.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _set_pair(src, byte0: tl.constexpr, nib: tl.constexpr, sf, BN: tl.constexpr, NW: tl.constexpr):
    v0 = _decode_code((src >> (8 * byte0 + 4 * nib)) & 0xF) * sf
    v1 = _decode_code((src >> (8 * byte0 + 8 + 4 * nib)) & 0xF) * sf
    return tl.reshape(tl.join(v0, v1), (BN, NW))


@triton.jit
def _byte_pair(reg, byte0: tl.constexpr, sf, BN: tl.constexpr, NW: tl.constexpr):
    """Bytes byte0, byte0+1 of ``reg`` (uint32, each an E4M3 pattern) -> fp16 pair times ``sf``, like
    cvt.rn.f16x2.e4m3x2 on the register half."""
    v0 = ((reg >> (8 * byte0)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16) * sf
    v1 = ((reg >> (8 * byte0 + 8)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16) * sf
    return tl.reshape(tl.join(v0, v1), (BN, NW))


@triton.jit
def _placed_regs(w):
    """The two E4M3-pattern registers of a placed-layout word (uint32), the same bit operations as the asm."""
    lo = w & 0x9C9C9C9C
    hi = (((w << 6) | (w >> 26)) & 0x98989898) | ((w << 2) & 0x04040404)
    return lo, hi


@triton.jit
def _dequant_tile(wt, sb, BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr, PLACED: tl.constexpr = False):
    """Words [BN, BK/8] (int32) + scales [BN, BK/16] (e4m3 bytes) -> 8 fp16 operands W_j [BN, BK/8].

    W_j[n, c] is the weight at K offset 16*(c//2) + 2*j + c%2 of the tile, times its block scale / 64.
    ``PLACED``: the words are in layout.place_nibbles order (fewer bit operations, same operands).
    """
    sf = sb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    if USE_ASM:
        s2 = tl.reshape(tl.join(sf, sf), (BN, BK // 8))
        d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
            _PLACED_ASM if PLACED else _DECODE_ASM,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
            [wt, s2],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    elif PLACED:
        wa, wb = tl.split(tl.reshape(wt.to(tl.uint32, bitcast=True), (BN, BK // 16, 2)))
        la, ha = _placed_regs(wa)
        lb, hb = _placed_regs(wb)
        d0 = _byte_pair(la, 0, sf, BN, BK // 8)
        d1 = _byte_pair(la, 2, sf, BN, BK // 8)
        d2 = _byte_pair(ha, 0, sf, BN, BK // 8)
        d3 = _byte_pair(ha, 2, sf, BN, BK // 8)
        d4 = _byte_pair(lb, 0, sf, BN, BK // 8)
        d5 = _byte_pair(lb, 2, sf, BN, BK // 8)
        d6 = _byte_pair(hb, 0, sf, BN, BK // 8)
        d7 = _byte_pair(hb, 2, sf, BN, BK // 8)
    else:
        wa, wb = tl.split(tl.reshape(wt, (BN, BK // 16, 2)))
        d0 = _set_pair(wa, 0, 0, sf, BN, BK // 8)
        d1 = _set_pair(wa, 2, 0, sf, BN, BK // 8)
        d2 = _set_pair(wa, 0, 1, sf, BN, BK // 8)
        d3 = _set_pair(wa, 2, 1, sf, BN, BK // 8)
        d4 = _set_pair(wb, 0, 0, sf, BN, BK // 8)
        d5 = _set_pair(wb, 2, 0, sf, BN, BK // 8)
        d6 = _set_pair(wb, 0, 1, sf, BN, BK // 8)
        d7 = _set_pair(wb, 2, 1, sf, BN, BK // 8)
    return d0, d1, d2, d3, d4, d5, d6, d7


@triton.jit
def _cat_sets(d0, d1, d2, d3, d4, d5, d6, d7, R: tl.constexpr, NW: tl.constexpr):
    """Eight [R, NW] set operands -> one [R, 8*NW] operand, set j in columns j*NW .. j*NW+NW-1.

    Every thread already holds the same (row, column) of all eight sets, so this is a register renaming
    (no data movement) and the tile feeds one MMA chain instead of eight waited-for MMAs.
    """
    a = tl.join(tl.join(d0, d1), tl.join(d2, d3))
    b = tl.join(tl.join(d4, d5), tl.join(d6, d7))
    v = tl.permute(tl.join(a, b), (0, 4, 3, 2, 1))  # [R, j>>2, (j>>1)&1, j&1, NW]
    return tl.reshape(v, (R, 8 * NW))


@triton.jit
def _split_sets(x, NW: tl.constexpr, BM: tl.constexpr):
    """Inverse of :func:`_cat_sets` along dim 0: [8*NW, BM] -> eight [NW, BM] operands."""
    v = tl.permute(tl.reshape(x, (2, 2, 2, NW, BM)), (3, 4, 0, 1, 2))  # [NW, BM, j>>2, (j>>1)&1, j&1]
    ev, od = tl.split(v)
    e0, e1 = tl.split(ev)
    o0, o1 = tl.split(od)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _dot8(d0, d1, d2, d3, d4, d5, d6, d7, x0, x1, x2, x3, x4, x5, x6, x7, acc):
    acc = tl.dot(d0, x0, acc)
    acc = tl.dot(d1, x1, acc)
    acc = tl.dot(d2, x2, acc)
    acc = tl.dot(d3, x3, acc)
    acc = tl.dot(d4, x4, acc)
    acc = tl.dot(d5, x5, acc)
    acc = tl.dot(d6, x6, acc)
    acc = tl.dot(d7, x7, acc)
    return acc


@triton.jit
def _load_sets(p, mask, NW: tl.constexpr):
    """Eight [NW, BM] loads of the sets of a merged-order tile (``p``: the tile's row-0 pointers)."""
    return (tl.load(p, mask=mask, other=0.0), tl.load(p + NW, mask=mask, other=0.0),
            tl.load(p + 2 * NW, mask=mask, other=0.0), tl.load(p + 3 * NW, mask=mask, other=0.0),
            tl.load(p + 4 * NW, mask=mask, other=0.0), tl.load(p + 5 * NW, mask=mask, other=0.0),
            tl.load(p + 6 * NW, mask=mask, other=0.0), tl.load(p + 7 * NW, mask=mask, other=0.0))


@triton.jit
def _decode_sets(wt, sb, BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr, DIAG: tl.constexpr,
                 PLACED: tl.constexpr = False):
    """The eight decoded set operands of a weight tile; DIAG=1 (benchmarks only, wrong results) skips the
    decode: each word, read as an fp16 pair, times its block scales (_FREE_ASM), so the time difference is the
    cost of the decode's bit operations and E4M3 conversions (the interpreter's stand-in converts instead)."""
    if DIAG == 0:
        d0, d1, d2, d3, d4, d5, d6, d7 = _dequant_tile(wt, sb, BN, BK, USE_ASM, PLACED)
    elif USE_ASM:
        sf = sb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s2 = tl.reshape(tl.join(sf, sf), (BN, BK // 8))
        d0, d1, d2, d3, d4, d5, d6, d7 = tl.inline_asm_elementwise(
            _FREE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [wt, s2],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=2)
    else:
        d0 = wt.to(tl.float16) + sb.to(tl.float16).sum(1)[:, None]
        d1 = d0 + 1.0
        d2 = d0 + 2.0
        d3 = d0 + 3.0
        d4 = d0 + 4.0
        d5 = d0 + 5.0
        d6 = d0 + 6.0
        d7 = d0 + 7.0
    return d0, d1, d2, d3, d4, d5, d6, d7


@triton.jit
def _merged_k_of(r, NW: tl.constexpr):
    """K offset within a tile of row ``r`` of the merged operand: row j*NW + c holds 16*(c//2) + 2*j + c%2."""
    c = r % NW
    return (c // 2) * 16 + 2 * (r // NW) + c % 2


@triton.jit
def _merged_k(BK: tl.constexpr):
    return _merged_k_of(tl.arange(0, BK), BK // 8)


@triton.jit
def _merge_rows(x, BK: tl.constexpr, C: tl.constexpr):
    """A tile [BK, C] with its rows in natural K order -> the same rows in merged order (row j*NW + 2b + r holds
    K offset 16b + 2j + r): (b, j, r) -> (j, b, r)."""
    return tl.reshape(tl.permute(tl.reshape(x, (BK // 16, 8, 2, C)), (1, 0, 2, 3)), (BK, C))


@triton.jit
def _merged_pos(i, NW: tl.constexpr):
    """Inverse of :func:`_merged_k_of` (tile of 8*NW): merged row of K offset ``i``."""
    return ((i % 16) // 2) * NW + (i // 16) * 2 + i % 2


# E2M1 rounding, from the one home of its midpoints and tie rule (glm5_fp4.nvfp4): magnitude code k is the
# number of midpoints a value lies above (at a tie, above when the upper code is even).
_MID = [tl.constexpr(m) for m in nvfp4._MIDPOINTS]
_TIE_UP = [tl.constexpr(u) for u in nvfp4._TIE_GOES_UP]
_VAL = [tl.constexpr(v) for v in nvfp4.E2M1_VALUES]
_M0, _M1, _M2, _M3, _M4, _M5, _M6 = _MID
_U0, _U1, _U2, _U3, _U4, _U5, _U6 = _TIE_UP
_V1, _V2, _V3, _V4, _V5, _V6, _V7 = _VAL[1:]


@triton.jit
def _above(v, mid: tl.constexpr, tie_up: tl.constexpr):
    if tie_up:
        return v >= mid
    else:
        return v > mid


@triton.jit
def _e2m1_index(v):
    """Non-negative fp32 -> E2M1 magnitude code 0..7 (nearest, ties to even, saturating at 6)."""
    return (_above(v, _M0, _U0).to(tl.int32) + _above(v, _M1, _U1).to(tl.int32) + _above(v, _M2, _U2).to(tl.int32)
            + _above(v, _M3, _U3).to(tl.int32) + _above(v, _M4, _U4).to(tl.int32)
            + _above(v, _M5, _U5).to(tl.int32) + _above(v, _M6, _U6).to(tl.int32))


@triton.jit
def _act_pos(i, KC: tl.constexpr):
    """Where GEMM1 stores act element ``i`` of a row: GEMM2 reads K in chunks of KC, each chunk in merged order."""
    return (i // KC) * KC + _merged_pos(i % KC, KC // 8)


@triton.jit
def _e2m1_round(v):
    """Round non-negative fp32 to the nearest E2M1 magnitude, ties to the even code, saturating at 6."""
    r = tl.where(_above(v, _M0, _U0), _V1, 0.0)
    r = tl.where(_above(v, _M1, _U1), _V2, r)
    r = tl.where(_above(v, _M2, _U2), _V3, r)
    r = tl.where(_above(v, _M3, _U3), _V4, r)
    r = tl.where(_above(v, _M4, _U4), _V5, r)
    r = tl.where(_above(v, _M5, _U5), _V6, r)
    r = tl.where(_above(v, _M6, _U6), _V7, r)
    return r


@triton.jit
def _round_e4m3(v):
    """Round non-negative fp32 to E4M3 (nearest, ties even), after clamping to its maximum 448.

    Written with integer arithmetic because Triton's interpreter mis-rounds fp32->fp8 casts whose
    mantissa carry bumps the exponent (126.5 -> 256); on GPUs it equals ``cvt.rn.satfinite.e4m3x2``.
    """
    v = tl.minimum(v, 448.0)
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Below 2^-6 E4M3 is subnormal with a fixed step of 2^-9: adding 2^14 rounds to that step.
    subnormal = (v + 16384.0) - 16384.0
    return tl.where(v < 0.015625, subnormal, normal)


@triton.jit
def _fake_quant_rows(x, g, R: tl.constexpr, C: tl.constexpr):
    """NVFP4-quantize fp32 ``x`` [R, C] in 16-row blocks along dim 0 with global scale ``g``, Blackwell-style.

    Returns ``e2m1 * block_scale`` (exact in fp16); the true dequantized value is that divided by ``g``,
    which callers fold into their epilogue.
    """
    xb = tl.reshape(x, (R // 16, 16, C))
    amax = tl.max(tl.abs(xb), axis=1)
    s = _round_e4m3(tl.math.div_rn(g * amax, 6.0))
    pos = s > 0
    s_safe = tl.where(pos, s, 1.0)
    y = tl.math.div_rn(xb * g, s_safe[:, None, :])
    q = _e2m1_round(tl.abs(y))
    q = tl.where(y < 0, -q, q)
    q = tl.where(pos[:, None, :], q * s[:, None, :], 0.0)
    return tl.reshape(q, (R, C))


@triton.jit
def _quant_with(x, g, s):
    """NVFP4 codes of fp32 ``x`` for given block scales ``s`` (same shape), returned as e2m1 * s in fp16."""
    pos = s > 0
    y = tl.math.div_rn(x * g, tl.where(pos, s, 1.0))
    q = _e2m1_round(tl.abs(y))
    q = tl.where(y < 0, -q, q)
    return tl.where(pos, q * s, 0.0).to(tl.float16)


@triton.jit
def _quant_merged(x, g, BK: tl.constexpr, BM: tl.constexpr):
    """NVFP4-quantize fp32 ``x`` [BK, BM] whose rows are in merged K order (one 16-block of K = the rows
    j*NW + 2b + p for all j, p) with global scale ``g``, Blackwell-style; returns e2m1 * block_scale in fp16."""
    NW: tl.constexpr = BK // 8
    xb = tl.reshape(x, (8, NW // 2, 2, BM))
    amax = tl.max(tl.max(tl.abs(xb), axis=2), axis=0)
    s = _round_e4m3(tl.math.div_rn(g * amax, 6.0))
    s4 = tl.broadcast_to(tl.expand_dims(tl.expand_dims(s, 0), 2), (8, NW // 2, 2, BM))
    return tl.reshape(_quant_with(xb, g, s4), (BK, BM))


@triton.jit
def _to_fp16(x):
    """16-bit activations -> fp16 for the MMA: bf16 values in fp16's normal range convert exactly; the rare larger
    ones saturate at fp16's largest finite value instead of becoming inf."""
    return tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _x_operand(xt, g, W4A4: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr):
    """A loaded 16-bit activation tile [BK, BM] (merged K order) -> the fp16 MMA operand.

    W4A4: quantized Blackwell-style with per-16 dynamic block scales; the result is e2m1 * block_scale, the
    global ``g`` being folded into the epilogue. W4A16: bf16 -> fp16 keeps every bf16 value in fp16's
    normal range exactly; the rare huge ones are clamped.
    """
    if W4A4:
        return _quant_merged(xt.to(tl.float32), g, BK, BM)
    else:
        return _to_fp16(xt)


@triton.jit
def _slot_expert(slot, ids_ptr, emap_ptr, HAS_MAP: tl.constexpr):
    """(local expert, rows) of one routing slot: rows is 0 for a slot whose expert lives on another rank."""
    e = tl.load(ids_ptr + slot).to(tl.int32)
    if HAS_MAP:
        e = tl.load(emap_ptr + e)
    count = tl.where(e >= 0, 1, 0)
    return tl.maximum(e, 0), count


@triton.jit
def _slot_group(s, ids_ptr, emap_ptr, nslots, SP: tl.constexpr, HAS_MAP: tl.constexpr):
    """The slots that share slot ``s``'s expert, for the slot schedule's dedup form (Plan.slot_dedup).

    Returns (local expert, count, same, rank): ``same`` [SP] marks the slots routed to that expert, ``rank``
    their order; ``count`` is how many there are when ``s`` is the first of them (the group's leader, which
    computes all its rows, so the expert's weights are read and decoded once per call) and 0 otherwise (a
    remote slot is in no group). No sorting launch: at most SLOT_MAX_TOKENS * k slots, read by every program.
    """
    offs = tl.arange(0, SP)
    ids, m = _local_ids(ids_ptr, emap_ptr, offs, offs < nslots, HAS_MAP)
    e, local = _slot_expert(s, ids_ptr, emap_ptr, HAS_MAP)
    same = m & (ids == e) & (local > 0)
    earlier = tl.sum((same & (offs < s)).to(tl.int32), axis=0)
    count = tl.where(earlier == 0, tl.sum(same.to(tl.int32), axis=0), 0)
    rank = tl.cumsum(same.to(tl.int32), axis=0) - 1
    return e, count, same, rank


@triton.jit
def _group_leaders(ids_ptr, emap_ptr, nslots, SP: tl.constexpr, HAS_MAP: tl.constexpr):
    """[SP] mask of the slots that lead a group: local, and no earlier local slot has their expert."""
    offs = tl.arange(0, SP)
    ids, m = _local_ids(ids_ptr, emap_ptr, offs, offs < nslots, HAS_MAP)
    dup = (ids[:, None] == ids[None, :]) & m[None, :] & (offs[None, :] < offs[:, None])
    return m & (tl.max(dup.to(tl.int32), axis=1) == 0)


@triton.jit
def _dedup_split(groups, N_TILES: tl.constexpr, KT: tl.constexpr, SPLIT_FLOOR: tl.constexpr, SPLIT_MIN: tl.constexpr,
                 SPLIT_MAX: tl.constexpr, CAP: tl.constexpr):
    """The slot dedup GEMM1's split-K for a call whose routing leaves ``groups`` groups (:func:`_group_leaders`,
    counted by GEMM1 and its reduce launch alike): the largest divisor of the KT K tiles from SPLIT_FLOOR to SPLIT_MAX
    that keeps groups x N_TILES x split programs within CAP (one wave; configs.pick_slot_split_k's rule, on the groups
    counted at run time, which no plan can know), or the plan's split SPLIT_MIN where none does. Few groups (skew)
    raise it; a wave just overfull at the plan's split lowers it, not below SPLIT_FLOOR (configs.DEDUP_SPLIT_K_TILES)."""
    sk = groups * 0 + SPLIT_MIN
    for s in tl.static_range(SPLIT_FLOOR, SPLIT_MAX + 1):
        if KT % s == 0:
            sk = tl.where(groups * N_TILES * s <= CAP, s, sk)
    return sk


@triton.jit
def _dedup_row(r, lead, groups, SP: tl.constexpr):
    """Row ``r`` of the compact GEMM1 grid (Plan.gemm1_compact_grid) -> (leader slot of its group, K range), ``lead``
    the call's leader mask (:func:`_group_leaders`), ``groups`` its count: rows 0 .. groups-1 are the groups' first K
    range (in slot order), the next ``groups`` rows their second, ...; a row past the call's split gets a K range the
    caller finds idle."""
    offs = tl.arange(0, SP)
    groups = tl.maximum(groups, 1)  # (no local slot: slot 0, idle as a remote slot)
    g = r % groups
    nth = tl.cumsum(lead.to(tl.int32), axis=0) - 1
    return tl.sum(tl.where(lead & (nth == g), offs, 0), axis=0), r // groups


@triton.jit
def _group_slots(offs_m, same, rank, SP: tl.constexpr):
    """Slot ids of a group's rows ``offs_m`` (0 past its end: those columns are masked)."""
    offs = tl.arange(0, SP)
    hit = same[None, :] & (rank[None, :] == offs_m[:, None])
    return tl.sum(tl.where(hit, offs[None, :], 0), axis=1)


# The work list: one int32 quadruple per block, (expert, first sorted row, row count, unused).
BLOCK_FIELDS = tl.constexpr(4)


@triton.jit
def _block_rows(pid_b, blk_ptr, num_blocks_ptr):
    """(expert, row count, first sorted row) of work-list block ``pid_b``; 0 rows past the list's end."""
    n = tl.load(num_blocks_ptr)
    # past the end: read block 0 (always written when the list is non-empty, and the workspace is zeroed at
    # creation otherwise) and run no rows
    p = blk_ptr + tl.where(pid_b < n, pid_b, 0) * BLOCK_FIELDS
    e = tl.load(p)
    start = tl.load(p + 1)
    count = tl.where(pid_b < n, tl.load(p + 2), 0)
    return e, count, start


@triton.jit
def _store_act(gate, up, g_out, act_ptr, rows, offs_i, mmask, I: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
               KC: tl.constexpr, W4A4: tl.constexpr):
    """GEMM1's epilogue: act = silu(gate) * up ([BN, BM], W4A4: NVFP4-quantized) stored in GEMM2's K order."""
    act = gate / (1.0 + tl.exp(-gate)) * up
    if W4A4:
        act = _fake_quant_rows(act, g_out, BN, BM)
    pos = _act_pos(offs_i, KC)
    tl.store(act_ptr + rows[None, :] * I + pos[:, None], act.to(tl.float16), mask=mmask[None, :])


@triton.jit
def _last_arrival(cnt_ptr, arrivals):
    """Whether this program is the last of ``arrivals`` to arrive at counter ``cnt_ptr`` (which it then zeroes for the
    next call or graph replay). The classic semaphore: a CTA barrier orders every thread's stores before the
    gpu-scope release, so the last arrival sees (acquire) everything the others stored before arriving; it should
    read that through L2 (``.cg`` or atomics: an L1 line may be stale)."""
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _pdl_enter(USE_PDL: tl.constexpr):
    """Plan.pdl: wait until the previous kernel has finished (its writes visible), then let the next one launch.

    Every kernel of a call does this first (only weight prefetches come before it), so code before it in the
    next kernel may read the weights and what kernels two or more launches back wrote, never the previous
    kernel's output; and a kernel's completion implies its predecessors' (each waited on the one before)."""
    if USE_PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()


@triton.jit
def _prefetch_l2(base, span, LINES: tl.constexpr, STEP: tl.constexpr):
    """Ask L2 for ``span`` elements from ``base`` (a contiguous run), one request per STEP elements (128 B) up to
    LINES requests (a run longer than LINES * STEP is prefetched only in part). Fire and forget: nothing waits."""
    offs = tl.minimum(tl.arange(0, LINES) * STEP, span - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [base + offs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_w2_rows(w_ptr, s_ptr, e64, n, ROWS: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                      LINES_W: tl.constexpr, LINES_S: tl.constexpr):
    """Ask L2 for ``ROWS`` down-projection rows of expert ``e64`` from row ``n``: its words and its scales (each a
    contiguous run at whole K tiles), LINES_W / LINES_S 128-byte requests (launch._w2_row_requests)."""
    _prefetch_l2(w_ptr + e64 * (H * (I // 8)) + n * (I // 8), ROWS * (I // 8), LINES_W, 32)
    _prefetch_l2(s_ptr + e64 * (H * (I // 16)) + n * (I // 16), ROWS * (I // 16), LINES_S, 128)


@triton.jit
def _prefetch_l2_at(ptrs):
    """Ask L2 for the line of every pointer of ``ptrs`` (fire and forget)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _w13_k_offset(k, KT: tl.constexpr, ROWS: tl.constexpr, H: tl.constexpr, U: tl.constexpr):
    """Offset (in stored elements of U K values: 8 per word, 16 per scale byte) of K element ``k`` of row 0 of
    one expert's w13 (``ROWS`` = 2I rows): row-major (``KT`` = 0) or K-tile-major in runs of ``KT``
    (layout.tile_k). Row ``r`` adds ``r * H/U`` (row-major) or ``r * KT/U`` (tiled). A tile of BK, BK dividing KT
    or a multiple of it, starting at a multiple of BK, is this offset of its first K plus that of its columns."""
    if KT == 0:
        return k // U
    # = (k // KT) * ROWS * KT/U + (k % KT) / U, written without the remainder: Triton 3.6 cannot tell the
    # alignment of k % KT and loads such tiles in 4-byte pieces (H200, 2026-12-03: the layer ~45 % slower)
    return k // U + (k // KT) * ((ROWS - 1) * (KT // U))


@triton.jit
def _w13_cols(offs, N: tl.constexpr, KT: tl.constexpr, ROWS: tl.constexpr, U: tl.constexpr):
    """Offsets of a tile's ``N`` stored columns ``offs`` (arange, units of U K values) in row 0 of one expert's
    w13, relative to the tile's first K (:func:`_w13_k_offset`). Written so that Triton still sees the runs as
    contiguous and aligned (a column vector computed as (8 * offs) // 8 is not: its loads lose their 16-byte
    vectors and the layer runs ~3x slower, H200 2026-12-03)."""
    RUN: tl.constexpr = KT // U
    if KT == 0 or N <= RUN:
        return offs
    return offs + (offs // RUN) * ((ROWS - 1) * RUN)


@triton.jit
def _w13_tile(w_ptr, s_ptr, w_rows, s_rows, k_w, k_s, d_row, d_col, W_DESC: tl.constexpr, S_DESC: tl.constexpr):
    """One K tile of GEMM1's gate or up weight tile: its words and scales, by pointer (``w_rows``/``s_rows`` plus the
    K tile's offsets) or by descriptor (row ``d_row``, column ``d_col`` of the views)."""
    if W_DESC:
        wt = w_ptr.load([d_row, d_col // 8])
    else:
        wt = tl.load(w_rows + k_w)
    if S_DESC:
        st = s_ptr.load([d_row, d_col // 16])
    else:
        st = tl.load(s_rows + k_s)
    return wt, st


@triton.jit
def _mma_tile(wt, st, xs, acc, R: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr, DIAG: tl.constexpr,
              PLACED: tl.constexpr, MERGED: tl.constexpr):
    """acc + (decoded [R, BK] weight tile) @ activations: one merged MMA chain (``xs`` the [BK, BM] tile) or eight
    MMAs (``xs`` its eight sets)."""
    NW: tl.constexpr = BK // 8
    d0, d1, d2, d3, d4, d5, d6, d7 = _decode_sets(wt, st, R, BK, USE_ASM, DIAG, PLACED)
    if MERGED:
        return tl.dot(_cat_sets(d0, d1, d2, d3, d4, d5, d6, d7, R, NW), xs, acc)
    else:
        return _dot8(d0, d1, d2, d3, d4, d5, d6, d7, xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7], acc)


@triton.jit
def moe_gemm1_kernel(
    x_ptr,
    stride_xt,
    xq_ptr,
    w_ptr,
    s_ptr,
    alpha_ptr,
    a_scale_ptr,
    a_gscale_ptr,
    o_gscale_ptr,
    act_ptr,
    part_ptr,
    part_stride,
    cnt_ptr,
    ids_ptr,
    emap_ptr,
    slots_ptr,
    blk_ptr,
    num_blocks_ptr,
    TOPK,
    H: tl.constexpr,
    I: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    SLOT_MODE: tl.constexpr,
    W4A4: tl.constexpr,
    USE_ASM: tl.constexpr,
    X_PREP: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
    MERGED: tl.constexpr = True,
    DIAG: tl.constexpr = 0,
    HAS_MAP: tl.constexpr = False,
    KC: tl.constexpr = 0,
    PLACED: tl.constexpr = False,
    FUSED_REDUCE: tl.constexpr = False,
    DEDUP: tl.constexpr = False,
    SP: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False,
    PF_DIST: tl.constexpr = 0,
    W_DESC: tl.constexpr = False,
    S_DESC: tl.constexpr = False,
    KT: tl.constexpr = 0,
    STACK: tl.constexpr = False,
    X_NAT: tl.constexpr = False,
    SPLIT_CAP: tl.constexpr = 0,
    SPLIT_MIN: tl.constexpr = 1,
    SPLIT_FLOOR: tl.constexpr = 1,
    DEDUP_ROWS: tl.constexpr = 0,
    NSLOTS: tl.constexpr = 0,
):
    """act[row, i] = silu(x W_gate^T) * (x W_up^T) for rows of one expert, i in this program's N tile.

    ``DEDUP_ROWS > 0`` (with SPLIT_CAP; Plan.gemm1_compact_grid): the grid is (N tile, DEDUP_ROWS) and row r is
    the (group, K range) :func:`_dedup_row` finds from the counted groups, instead of (N tile, slot, K range);
    ``NSLOTS`` is then the call's slot count.

    ``SPLIT_CAP > 0`` (slot dedup, Plan.gemm1_split_cap): SPLIT_K is the grid's largest split; the split used is
    picked from the routing (:func:`_dedup_split`: the groups the call has; the plan's SPLIT_MIN, raised, or lowered
    to SPLIT_FLOOR at least), and programs past it do nothing.

    ``X_NAT`` (not X_PREP; Plan.x_natural): each K tile of x is loaded in natural K order (contiguous rows: 16-byte
    copies, which the pipeliner then issues stages ahead like the weights') and put in merged order in registers
    (:func:`_merge_rows`), instead of gathered 2 bytes at a time in merged order in the iteration that uses it.

    ``KT > 0`` (layout "tiled"): the weights and scales are K-tile-major in runs of KT (layout.tile_k), so each
    K tile of the program's [BN, BK] weight tile is one contiguous run (:func:`_w13_k_offset`); the descriptors
    of ``W_DESC``/``S_DESC`` then view them as [E*(H/KT)*2I, KT/8] (/16) with BK <= KT.

    ``W_DESC`` (Gemm1Config.tma): ``w_ptr`` is a tensor descriptor of the words [E*2I, H/8] with [BN, BK/8]
    blocks, so the weight tiles arrive by TMA (one instruction per tile, no per-thread addresses) instead of
    per-thread cp.async copies; ``S_DESC`` likewise ``s_ptr`` for the scales [E*2I, H/16] in [BN, BK/16] blocks
    (a TMA box row must be a multiple of 16 bytes: BK >= 256). The activations stay pointer loads.

    ``PF_DIST > 0`` (Plan.l2_prefetch): at each K tile the program asks L2 for the gate/up words and scales
    PF_DIST K tiles ahead (one request per row and matrix), so more of the weight stream is in flight than the
    pipeline's shared-memory stages hold.

    ``STACK`` (Gemm1Config.stacked): the tile's gate rows and up rows are one [2*BN, BK] weight tile (one load, one
    decode, one MMA of M = 2*BN), so the MMA instructions alternate between the gate and the up accumulator (one
    accumulator, its two halves) instead of running one dependent chain per matrix after the other.

    ``DEDUP`` (slot mode, Plan.slot_dedup): the program of a group's leader slot computes every slot routed to
    the same expert, the others none (:func:`_slot_group`; ``SP`` = the slot count rounded up to a power of 2).

    ``X_PREP``: read the activations from ``xq_ptr``, fp16 already in the merged K order (the align kernel
    wrote them), so each K tile is one contiguous [BK] run per token that the pipeliner copies straight into
    the MMA's shared-memory operand; otherwise gather them from ``x_ptr`` and convert (or quantize) per tile.

    ``SPLIT_K > 1``: program (n, slot, k) (grouped: (block, n, k)) sums 1/SPLIT_K of K and stores alpha *
    (gate, up) partial sums in fp32 to ``part_ptr`` [SPLIT_K, rows, 2I] (natural i order; rows are slot ids or
    sorted positions as below);
    :func:`moe_splitk_reduce_kernel` adds them and applies SwiGLU, or (``FUSED_REDUCE``, plan option
    ``gemm1_fused_reduce``) the last program of each (N tile, slot) does, counting arrivals in ``cnt_ptr``
    [slots, I/BN] (zero between calls). Otherwise ``act`` is fp16 [T*k, I] with each row in merged K order of one
    I-wide tile (W4A4: the NVFP4-quantized act times the quantizer's global scale).

    ``PLACED``: the weights are in layout.place_nibbles order (5 instead of 7 bit operations per word).

    ``DIAG=1`` (benchmarks only, wrong results) skips the decode (:func:`_decode_sets`), so the time difference
    to ``DIAG=0`` is the cost of decoding.

    Grid: slot mode (N tile, slot, K range); grouped (work-list block, N tile), blocks fastest so that the
    blocks of one expert, which share weight tiles, run side by side. Rows are sorted slot positions
    (grouped) or slot ids (slot mode). ``w_ptr`` is the packed weight as int32 words.
    """
    tl.static_assert(not (X_PREP and W4A4), "prepared activations are W4A16 only")
    tl.static_assert(not ((W_DESC or S_DESC) and PF_DIST > 0), "the L2 prefetch addresses rows by pointer")
    tl.static_assert(KT == 0 or BK % KT == 0 or KT % BK == 0, "a K tile must divide the layout's runs or span them")
    tl.static_assert(not (KT > 0 and (W_DESC or S_DESC)) or BK <= KT, "a descriptor box lies within one run")
    tl.static_assert(not (STACK and (W_DESC or S_DESC)), "a stacked tile's rows are two runs, not one box")
    tl.static_assert(SPLIT_CAP == 0 or (SLOT_MODE and DEDUP), "the split picked at run time is the slot dedup's")
    tl.static_assert(DEDUP_ROWS == 0 or SPLIT_CAP > 0, "the compact grid's rows follow the split picked at run time")
    _pdl_enter(USE_PDL)
    NW: tl.constexpr = BK // 8
    K_PER = H // SPLIT_K  # (run-time values where the split is picked from the routing)
    splits = SPLIT_K
    pid_k = tl.program_id(2)
    if SLOT_MODE:
        pid_n = tl.program_id(0)
        start = tl.program_id(1)
        if DEDUP:
            nslots = tl.num_programs(1) if DEDUP_ROWS == 0 else NSLOTS
            if SPLIT_CAP > 0:
                # the call's groups, counted once: the compact grid's rows and the split both follow from them
                lead = _group_leaders(ids_ptr, emap_ptr, nslots, SP, HAS_MAP)
                groups = tl.sum(lead.to(tl.int32), axis=0)
                if DEDUP_ROWS > 0:
                    start, pid_k = _dedup_row(tl.program_id(1), lead, groups, SP)
                splits = _dedup_split(groups, I // BN, H // BK, SPLIT_FLOOR, SPLIT_MIN, SPLIT_K, SPLIT_CAP)
            e, count, same, rank = _slot_group(start, ids_ptr, emap_ptr, nslots, SP, HAS_MAP)
            if SPLIT_CAP > 0:
                count = tl.where(pid_k < splits, count, 0)
                K_PER = (H // BK // splits) * BK
        else:
            e, count = _slot_expert(start, ids_ptr, emap_ptr, HAS_MAP)
    else:
        pid_n = tl.program_id(1)
        e, count, start = _block_rows(tl.program_id(0), blk_ptr, num_blocks_ptr)
    k_begin = pid_k * K_PER
    e64 = e.to(tl.int64)

    offs_i = pid_n * BN + tl.arange(0, BN)
    offs_w = tl.arange(0, NW)
    offs_ks = tl.arange(0, BK // 16)
    offs_k = tl.arange(0, BK)
    mk = _merged_k(BK)

    # first gate row of the tile in the [E*2I, .] views of the descriptors (tiled: [E*(H/KT)*2I, .])
    row_g = e * (2 * I) * (1 if KT == 0 else H // KT) + pid_n * BN
    if STACK:
        rr = tl.arange(0, 2 * BN)
        offs_r = pid_n * BN + rr % BN + (rr // BN) * I  # the tile's gate rows, then its up rows
    else:
        offs_r = offs_i
    W_ROW: tl.constexpr = H // 8 if KT == 0 else KT // 8  # stored words between consecutive rows
    S_ROW: tl.constexpr = H // 16 if KT == 0 else KT // 16
    if not W_DESC:
        w_gate = w_ptr + e64 * (2 * I * (H // 8)) + offs_r[:, None] * W_ROW + _w13_cols(offs_w, NW, KT, 2 * I, 8)[None, :]
        w_up = w_gate + I * W_ROW
    else:  # (not read: _w13_tile takes the descriptor)
        w_gate = w_ptr
        w_up = w_ptr
    if not S_DESC:
        s_gate = (s_ptr + e64 * (2 * I * (H // 16)) + offs_r[:, None] * S_ROW
                  + _w13_cols(offs_ks, BK // 16, KT, 2 * I, 16)[None, :])
        s_up = s_gate + I * S_ROW
    else:
        s_gate = s_ptr
        s_up = s_ptr
    if PF_DIST > 0:
        # rows of this tile's gate half then its up half; the last K tile's address stands in past the end
        pr = tl.arange(0, 2 * BN)
        prow = tl.where(pr < BN, pid_n * BN + pr, I + pid_n * BN + pr - BN)
        pf_w = w_ptr + e64 * (2 * I * (H // 8)) + prow * W_ROW
        pf_s = s_ptr + e64 * (2 * I * (H // 16)) + prow * S_ROW
        k_last = k_begin + K_PER - BK
    alpha = tl.load(alpha_ptr + e)
    g_in = 1.0
    g_out = 1.0
    if W4A4:
        g_in = tl.load(a_gscale_ptr + e)
        alpha = alpha * tl.load(a_scale_ptr + e)
        g_out = tl.load(o_gscale_ptr + e)

    for m0 in range(0, count, BM):
        offs_m = m0 + tl.arange(0, BM)
        mmask = offs_m < count
        if SLOT_MODE and DEDUP:
            slot = _group_slots(offs_m, same, rank, SP)
        elif SLOT_MODE:
            slot = start + offs_m
        else:
            slot = tl.load(slots_ptr + start + offs_m, mask=mmask, other=0)
        tok = (slot // TOPK).to(tl.int64)
        if X_PREP and not MERGED:
            xp = xq_ptr + tok[None, :] * H + offs_w[:, None]
        elif X_PREP:
            xp = xq_ptr + tok[None, :] * H + offs_k[:, None]
        else:
            xp = x_ptr + tok[None, :] * stride_xt + (offs_k if X_NAT else mk)[:, None]
        if STACK:
            acc = tl.zeros((2 * BN, BM), dtype=tl.float32)
        else:
            acc_g = tl.zeros((BN, BM), dtype=tl.float32)
            acc_u = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + K_PER, BK):
            if PF_DIST > 0:
                kp = tl.minimum(k0 + PF_DIST * BK, k_last)
                _prefetch_l2_at(pf_w + _w13_k_offset(kp, KT, 2 * I, H, 8))
                _prefetch_l2_at(pf_s + _w13_k_offset(kp, KT, 2 * I, H, 16))
            # the activation tile: whole (one merged MMA chain) or its eight sets
            if X_PREP and not MERGED:
                xs = _load_sets(xp + k0, mmask[None, :], NW)
            else:
                xs = tl.load(xp + k0, mask=mmask[None, :], other=0.0)
                if not X_PREP:
                    if X_NAT:
                        xs = _merge_rows(xs, BK, BM)
                    xs = _x_operand(xs, g_in, W4A4, BK, BM)
                if not MERGED:
                    xs = _split_sets(xs, NW, BM)
            # this K tile in the gate and up tiles alike: pointer offsets of its words and scales, or its row and
            # column in the descriptors' views
            k_w = _w13_k_offset(k0, KT, 2 * I, H, 8)
            k_s = _w13_k_offset(k0, KT, 2 * I, H, 16)
            if KT == 0:
                d_row = 0
                d_col = k0
            else:
                d_row = (k0 // KT) * (2 * I)
                d_col = k0 % KT
            if STACK:
                acc = _mma_tile(tl.load(w_gate + k_w), tl.load(s_gate + k_s), xs, acc, 2 * BN, BK, USE_ASM, DIAG,
                                PLACED, MERGED)
            else:
                wg, sg = _w13_tile(w_ptr, s_ptr, w_gate, s_gate, k_w, k_s, row_g + d_row, d_col, W_DESC, S_DESC)
                acc_g = _mma_tile(wg, sg, xs, acc_g, BN, BK, USE_ASM, DIAG, PLACED, MERGED)
                wu, su = _w13_tile(w_ptr, s_ptr, w_up, s_up, k_w, k_s, row_g + d_row + I, d_col, W_DESC, S_DESC)
                acc_u = _mma_tile(wu, su, xs, acc_u, BN, BK, USE_ASM, DIAG, PLACED, MERGED)
        if STACK:
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BN, BM)), (1, 2, 0)))
        gate = acc_g * alpha
        up = acc_u * alpha
        if SLOT_MODE:
            rows = slot.to(tl.int64)  # act / partial-sum rows are slot ids
        else:
            rows = (start + offs_m).to(tl.int64)  # sorted positions
        if SPLIT_K > 1:
            pp = part_ptr + pid_k.to(tl.int64) * part_stride + rows[None, :] * (2 * I) + offs_i[:, None]
            tl.store(pp, gate, mask=mmask[None, :])
            tl.store(pp + I, up, mask=mmask[None, :])
            if FUSED_REDUCE:
                # The last of the SPLIT_K programs of this (N tile, rows) to finish adds the partial sums in
                # split order (bitwise what moe_splitk_reduce_kernel computes) and applies SwiGLU, so the slot
                # schedule needs no reduce launch. One counter per block of rows, its first row's: a slot dedup
                # group longer than BM rows is several blocks, each with its own SPLIT_K arrivals.
                if SLOT_MODE and DEDUP:
                    first_row = tl.min(tl.where(mmask, rows, 2**31 - 1), axis=0)
                else:
                    first_row = start
                if _last_arrival(cnt_ptr + first_row * (I // BN) + pid_n, splits):
                    p0 = part_ptr + rows[None, :] * (2 * I) + offs_i[:, None]
                    gate = tl.load(p0, mask=mmask[None, :], other=0.0, cache_modifier=".cg")
                    up = tl.load(p0 + I, mask=mmask[None, :], other=0.0, cache_modifier=".cg")
                    for sk in tl.static_range(1, SPLIT_K):
                        ms = mmask & (offs_m * 0 + sk < splits)  # (a split past the call's: nothing to add)
                        gate += tl.load(p0 + sk * part_stride, mask=ms[None, :], other=0.0, cache_modifier=".cg")
                        up += tl.load(p0 + (sk * part_stride + I), mask=ms[None, :], other=0.0,
                                      cache_modifier=".cg")
                    _store_act(gate, up, g_out, act_ptr, rows, offs_i, mmask, I, BN, BM, KC, W4A4)
        else:
            _store_act(gate, up, g_out, act_ptr, rows, offs_i, mmask, I, BN, BM, KC, W4A4)


@triton.jit
def _store_part(ptrs, v, mmask, OWN_ROWS: tl.constexpr, DIAG: tl.constexpr = 0):
    """GEMM2's output tile: stored where each row is this program's alone (slot dedup), else added atomically.
    DIAG (launch.DIAG_PLAIN_STORES; benchmarks only, wrong sums) stores anyway: the time difference is the
    atomics' cost over plain stores of the same bytes."""
    if OWN_ROWS or DIAG != 0:
        tl.store(ptrs, v, mask=mmask[None, :])
    else:
        tl.atomic_add(ptrs, v, mask=mmask[None, :], sem="relaxed")


@triton.jit
def moe_gemm2_grouped_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    alpha_ptr,
    o_scale_ptr,
    topk_w_ptr,
    ws_ptr,
    slots_ptr,
    blk_ptr,
    num_blocks_ptr,
    ids_ptr,
    emap_ptr,
    out_ptr,
    stride_ot,
    cnt_ptr,
    TOPK,
    H: tl.constexpr,
    I: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
    N_SPLIT: tl.constexpr,
    W4A4: tl.constexpr,
    USE_ASM: tl.constexpr,
    MERGED: tl.constexpr = True,
    KC: tl.constexpr = 0,
    PLACED: tl.constexpr = False,
    SLOT_DEDUP: tl.constexpr = False,
    ARRIVE_K: tl.constexpr = 0,
    SP: tl.constexpr = 1,
    HAS_MAP: tl.constexpr = False,
    DIAG: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False,
    PF_ROWS: tl.constexpr = 0,
    PF_W: tl.constexpr = 1,
    PF_S: tl.constexpr = 1,
    PF_DIST: tl.constexpr = 0,
    PF_DW: tl.constexpr = 1,
    PF_DS: tl.constexpr = 1,
):
    """ws[token, n] += router_weight * (act W_down^T)[row, n] for one work-list block's rows (walked BM at a
    time) over 1/N_SPLIT of H. Grid: (block, N range), blocks fastest.

    ``PF_DIST > 0`` (Plan.l2_prefetch; whole K tiles only, KC == I): at each N tile the program asks L2 for the
    words and scales of the N tile PF_DIST tiles ahead in its range (contiguous rows: ``PF_DW`` / ``PF_DS``
    128-byte requests).

    ``USE_PDL``: before it waits for GEMM1, the program asks L2 for its expert's first ``PF_ROWS`` weight rows
    (``PF_W`` / ``PF_S`` 128-byte requests of words / scales): the work list it reads for that was written two
    or more launches back (the align kernel).

    ``SLOT_DEDUP`` (the slot schedule's dedup form): program (slot, N range) computes the group of slots that
    share its slot's expert when it leads the group (:func:`_slot_group`), and stores ws[slot, n] (no atomics:
    every local slot's row is written once); moe_finalize_kernel then adds each token's k rows in slot order, or
    (``ARRIVE_K`` = k > 0, Plan.dedup_fused_finalize) the program that writes a token's last row of an N range does
    (:func:`_arrive_and_add`; ``cnt_ptr`` [T, N_SPLIT] counts each token's k slots, a remote slot's own program
    arrives for it), into ``out_ptr``: no finalize launch.

    K (= I) is taken KC at a time: KC == I (GLM-5's TP shards, I <= 512) loads the act tile once per token
    block and reuses it for every N tile; whole experts (I = 2048: TP1, expert parallelism) loop over K
    chunks, whose decoded weight tiles would not fit registers or shared memory at once."""
    ARRIVE: tl.constexpr = ARRIVE_K > 0
    tl.static_assert(SLOT_DEDUP or not ARRIVE, "arrivals count the slot dedup's per-slot rows")
    NW: tl.constexpr = KC // 8
    pid_s = tl.program_id(1)
    if SLOT_DEDUP:
        start = tl.program_id(0)
        e, count, same, rank = _slot_group(start, ids_ptr, emap_ptr, tl.num_programs(0), SP, HAS_MAP)
    else:
        e, count, start = _block_rows(tl.program_id(0), blk_ptr, num_blocks_ptr)
    e64 = e.to(tl.int64)
    n_per: tl.constexpr = H // N_SPLIT
    n_begin = pid_s * n_per
    if PF_ROWS > 0:
        if count > 0:
            _prefetch_w2_rows(w_ptr, s_ptr, e64, n_begin, PF_ROWS, H, I, PF_W, PF_S)
    _pdl_enter(USE_PDL)
    alpha = tl.load(alpha_ptr + e)
    if W4A4:
        alpha = alpha * tl.load(o_scale_ptr + e)

    offs_w = tl.arange(0, NW)
    offs_ks = tl.arange(0, KC // 16)
    offs_k = tl.arange(0, KC)
    offs_bn = tl.arange(0, BN)
    w_base = w_ptr + e64 * (H * (I // 8)) + offs_bn[:, None] * (I // 8) + offs_w[None, :]
    s_base = s_ptr + e64 * (H * (I // 16)) + offs_bn[:, None] * (I // 16) + offs_ks[None, :]

    for m0 in range(0, count, BM):
        offs_m = m0 + tl.arange(0, BM)
        mmask = offs_m < count
        if SLOT_DEDUP:
            slot = _group_slots(offs_m, same, rank, SP)
            rows = slot.to(tl.int64)
            out_row = rows
        else:
            rows = (start + offs_m).to(tl.int64)
            slot = tl.load(slots_ptr + start + offs_m, mask=mmask, other=0)
            out_row = (slot // TOPK).to(tl.int64)
        scale = tl.load(topk_w_ptr + slot, mask=mmask, other=0.0) * alpha
        a_rows = act_ptr + rows[None, :] * I
        out_ptrs = ws_ptr + out_row[None, :] * H + offs_bn[:, None]
        if KC == I:
            if MERGED:
                a = tl.load(a_rows + offs_k[:, None], mask=mmask[None, :], other=0.0)
            else:
                a0, a1, a2, a3, a4, a5, a6, a7 = _load_sets(a_rows + offs_w[:, None], mmask[None, :], NW)
            for n0 in range(n_begin, n_begin + n_per, BN):
                if PF_DIST > 0:
                    np_ = tl.minimum(n0 + PF_DIST * BN, n_begin + n_per - BN)
                    _prefetch_w2_rows(w_ptr, s_ptr, e64, np_, BN, H, I, PF_DW, PF_DS)
                d0, d1, d2, d3, d4, d5, d6, d7 = _decode_sets(
                    tl.load(w_base + n0 * (I // 8)), tl.load(s_base + n0 * (I // 16)), BN, KC, USE_ASM, DIAG & 1,
                    PLACED)
                acc = tl.zeros((BN, BM), dtype=tl.float32)
                if MERGED:
                    acc = tl.dot(_cat_sets(d0, d1, d2, d3, d4, d5, d6, d7, BN, NW), a, acc)
                else:
                    acc = _dot8(d0, d1, d2, d3, d4, d5, d6, d7, a0, a1, a2, a3, a4, a5, a6, a7, acc)
                _store_part(out_ptrs + n0, acc * scale[None, :], mmask, SLOT_DEDUP, DIAG & 2)
        else:
            for n0 in range(n_begin, n_begin + n_per, BN):
                acc = tl.zeros((BN, BM), dtype=tl.float32)
                for k0 in range(0, I, KC):
                    d0, d1, d2, d3, d4, d5, d6, d7 = _decode_sets(
                        tl.load(w_base + n0 * (I // 8) + k0 // 8), tl.load(s_base + n0 * (I // 16) + k0 // 16),
                        BN, KC, USE_ASM, DIAG & 1, PLACED,
                    )
                    if MERGED:
                        a = tl.load(a_rows + k0 + offs_k[:, None], mask=mmask[None, :], other=0.0)
                        acc = tl.dot(_cat_sets(d0, d1, d2, d3, d4, d5, d6, d7, BN, NW), a, acc)
                    else:
                        a0, a1, a2, a3, a4, a5, a6, a7 = _load_sets(a_rows + k0 + offs_w[:, None], mmask[None, :], NW)
                        acc = _dot8(d0, d1, d2, d3, d4, d5, d6, d7, a0, a1, a2, a3, a4, a5, a6, a7, acc)
                _store_part(out_ptrs + n0, acc * scale[None, :], mmask, SLOT_DEDUP, DIAG & 2)
        if ARRIVE:
            _arrive_and_add(ws_ptr, out_ptr, stride_ot, cnt_ptr, ids_ptr, emap_ptr, slot, mmask, pid_s, n_begin,
                            ARRIVE_K, H, BN, BM, N_SPLIT, HAS_MAP)
    if ARRIVE:
        # a remote slot is in no group and its row is never written: its own program arrives for it
        _, here = _slot_expert(start, ids_ptr, emap_ptr, HAS_MAP)
        if here == 0:
            first = tl.arange(0, BM)
            _arrive_and_add(ws_ptr, out_ptr, stride_ot, cnt_ptr, ids_ptr, emap_ptr, start + first * 0, first < 1,
                            pid_s, n_begin, ARRIVE_K, H, BN, BM, N_SPLIT, HAS_MAP)


@triton.jit
def _arrive_and_add(ws_ptr, out_ptr, stride_ot, cnt_ptr, ids_ptr, emap_ptr, slot, smask, pid_s, n_begin,
                    TOPK: tl.constexpr, H: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, N_SPLIT: tl.constexpr,
                    HAS_MAP: tl.constexpr):
    """The slot dedup's finalize by arrival (Plan.dedup_fused_finalize): after this program stored the rows of
    ``slot`` [BM] (``smask``) over N range ``pid_s``, each of those slots arrives at its token's counter; where it
    is the token's k-th arrival, this program adds the token's k rows in slot order (a remote slot's, never
    written, skipped) as moe_finalize_kernel would, bit for bit, and stores them. :func:`_last_arrival`'s pattern
    per lane: a CTA barrier, then gpu-scope acq_rel atomics; the rows read back through L2 (``.cg``), the k rows of an
    N tile unrolled (TOPK a constexpr: the launcher's ARRIVE_K) so their loads are in flight together, not k L2
    round trips one after another."""
    tok = slot // TOPK
    cnt = cnt_ptr + tok * N_SPLIT + pid_s
    tl.debug_barrier()
    old = tl.atomic_add(cnt, tl.full((BM,), 1, tl.int32), mask=smask, sem="acq_rel", scope="gpu")
    last = smask & (old == TOPK - 1)
    tl.atomic_xchg(cnt, tl.zeros((BM,), tl.int32), mask=last, sem="relaxed", scope="gpu")
    if tl.max(last.to(tl.int32), axis=0) > 0:
        offs_bn = tl.arange(0, BN)
        tok64 = tok.to(tl.int64)
        n_per: tl.constexpr = H // N_SPLIT
        for n0 in range(n_begin, n_begin + n_per, BN):
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for j in tl.static_range(TOPK):
                s_j = tok64 * TOPK + j
                _, local = _slot_expert(s_j, ids_ptr, emap_ptr, HAS_MAP)
                acc += tl.load(ws_ptr + s_j[None, :] * H + n0 + offs_bn[:, None], mask=(last & (local > 0))[None, :],
                               other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tok64[None, :] * stride_ot + n0 + offs_bn[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=last[None, :])


@triton.jit
def _slot_part(act_ptr, w_ptr, s_ptr, alpha_ptr, o_scale_ptr, topk_w_ptr, ids_ptr, emap_ptr, slot, n0, cols,
               H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, KC: tl.constexpr,
               W4A4: tl.constexpr, USE_ASM: tl.constexpr, MERGED: tl.constexpr, HAS_MAP: tl.constexpr,
               PLACED: tl.constexpr = False):
    """router weight * (act[slot] W_down[e]^T)[n0 : n0 + BN] of one slot (zero for a remote expert's slot)."""
    NW: tl.constexpr = KC // 8
    offs_w = tl.arange(0, NW)
    offs_ks = tl.arange(0, KC // 16)
    offs_k = tl.arange(0, KC)
    offs_bn = tl.arange(0, BN)
    e32, local = _slot_expert(slot, ids_ptr, emap_ptr, HAS_MAP)
    e64 = e32.to(tl.int64)
    # a remote slot's act row is garbage: zero its weight and mask its load (no NaN * 0)
    alpha = tl.load(alpha_ptr + e64) * tl.where(local > 0, tl.load(topk_w_ptr + slot), 0.0)
    if W4A4:
        alpha = alpha * tl.load(o_scale_ptr + e64)
    use = cols < local  # column 0 of a local slot (local is 0 or 1)
    part = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, I, KC):
        if MERGED:
            a = tl.load(act_ptr + slot.to(tl.int64) * I + k0 + offs_k[:, None] + cols[None, :] * 0,
                        mask=use[None, :], other=0.0)
        else:
            ap = act_ptr + slot.to(tl.int64) * I + k0 + offs_w[:, None] + cols[None, :] * 0
            a0, a1, a2, a3, a4, a5, a6, a7 = _load_sets(ap, use[None, :], NW)
        w_off = e64 * (H * (I // 8)) + (n0 + offs_bn[:, None]) * (I // 8) + k0 // 8 + offs_w[None, :]
        s_off = e64 * (H * (I // 16)) + (n0 + offs_bn[:, None]) * (I // 16) + k0 // 16 + offs_ks[None, :]
        d0, d1, d2, d3, d4, d5, d6, d7 = _dequant_tile(tl.load(w_ptr + w_off), tl.load(s_ptr + s_off), BN, KC, USE_ASM, PLACED)
        if MERGED:
            part = tl.dot(_cat_sets(d0, d1, d2, d3, d4, d5, d6, d7, BN, NW), a, part)
        else:
            part = _dot8(d0, d1, d2, d3, d4, d5, d6, d7, a0, a1, a2, a3, a4, a5, a6, a7, part)
    return part * alpha


@triton.jit
def _slot_split_part(act_ptr, w_ptr, s_ptr, alpha_ptr, o_scale_ptr, topk_w_ptr, ids_ptr, emap_ptr, out_ptr, stride_ot,
                     sum_ptr, cnt_ptr, pid_s, tok, TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                     BN: tl.constexpr, N_SPLIT: tl.constexpr, W4A4: tl.constexpr, USE_ASM: tl.constexpr,
                     MERGED: tl.constexpr, HAS_MAP: tl.constexpr, KC: tl.constexpr, PLACED: tl.constexpr,
                     USE_PDL: tl.constexpr, PF_ROWS: tl.constexpr, PF_W: tl.constexpr, PF_S: tl.constexpr):
    """moe_gemm2_slot_kernel's SPLIT_SLOTS program (N range ``pid_s``, token ``tok``, slot program_id(2))."""
    BM: tl.constexpr = 16
    j = tl.program_id(2)
    slot = tok * TOPK + j
    offs_bn = tl.arange(0, BN)
    cols = tl.arange(0, BM)
    first = cols < 1
    n_per: tl.constexpr = H // N_SPLIT
    n_begin = pid_s * n_per
    e_j, local_j = _slot_expert(slot, ids_ptr, emap_ptr, HAS_MAP)
    if PF_ROWS > 0:
        if local_j > 0:
            _prefetch_w2_rows(w_ptr, s_ptr, e_j.to(tl.int64), n_begin, PF_ROWS, H, I, PF_W, PF_S)
    _pdl_enter(USE_PDL)
    srow = sum_ptr + slot.to(tl.int64) * H
    for n0 in range(n_begin, n_begin + n_per, BN):
        if local_j > 0:
            part = _slot_part(act_ptr, w_ptr, s_ptr, alpha_ptr, o_scale_ptr, topk_w_ptr, ids_ptr, emap_ptr, slot,
                              n0, cols, H, I, BN, BM, KC, W4A4, USE_ASM, MERGED, HAS_MAP, PLACED)
        else:
            part = tl.zeros((BN, BM), dtype=tl.float32)  # a remote expert's slot adds nothing (no weight read)
        tl.store(srow + n0 + offs_bn[:, None] + cols[None, :] * 0, part, mask=first[None, :])
    if _last_arrival(cnt_ptr + tok * N_SPLIT + pid_s, TOPK):
        rows = sum_ptr + (tok * TOPK).to(tl.int64) * H
        for n0 in range(n_begin, n_begin + n_per, BN):
            acc = tl.zeros((BN,), dtype=tl.float32)
            for jj in tl.static_range(TOPK):
                acc += tl.load(rows + jj * H + n0 + offs_bn, cache_modifier=".cg")
            tl.store(out_ptr + tok.to(tl.int64) * stride_ot + n0 + offs_bn, acc.to(out_ptr.dtype.element_ty))


@triton.jit
def moe_gemm2_slot_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    alpha_ptr,
    o_scale_ptr,
    topk_w_ptr,
    ids_ptr,
    emap_ptr,
    out_ptr,
    stride_ot,
    sum_ptr,
    cnt_ptr,
    TOPK: tl.constexpr,
    H: tl.constexpr,
    I: tl.constexpr,
    BN: tl.constexpr,
    N_SPLIT: tl.constexpr,
    W4A4: tl.constexpr,
    USE_ASM: tl.constexpr,
    MERGED: tl.constexpr = True,
    HAS_MAP: tl.constexpr = False,
    KC: tl.constexpr = 0,
    UNROLL: tl.constexpr = False,
    PLACED: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    PF_ROWS: tl.constexpr = 0,
    PF_W: tl.constexpr = 1,
    PF_S: tl.constexpr = 1,
    SPLIT_SLOTS: tl.constexpr = False,
):
    """out[token, n] = sum over the token's local slots of weight * (act[slot] W_down[e]^T)[n], written once
    (slots of remote experts are skipped: their act rows were never computed). K (= I) in chunks of KC.
    ``UNROLL``: the k experts unrolled, their weight loads all in flight at once (at T=1 this kernel is
    latency-bound: a few programs, k dependent load-decode-MMA rounds otherwise); the plan asks for it only
    where k pipelined tiles fit the arch's shared memory (configs.plan).

    ``SPLIT_SLOTS`` (Plan.gemm2_split_slots): grid (N range, token, slot j) instead of (N range, token): each
    program computes one slot's rows into ``sum_ptr`` (fp32 [T*k, H], the combine buffer; a remote slot's are zero)
    and the last of the token's k programs of an N range to arrive (counted in ``cnt_ptr`` [T, N_SPLIT], zero
    between calls) adds the k rows in slot order and stores them: the same order as the one-program form's sum
    (bit-equal to it in the interpreter; on the GPU the two compile to different code and agree to rounding). k
    times the programs, each with one expert's tile in flight instead of k in turn.

    ``USE_PDL``: before it waits for the act rows, the program asks L2 for the first ``PF_ROWS`` of its rows of
    each of the token's experts (SPLIT_SLOTS: of its slot's expert; the routing is the call's input, written
    before GEMM1 waited)."""
    BM: tl.constexpr = 16  # the MMA's smallest token side; only column 0 is real
    pid_s = tl.program_id(0)
    tok = tl.program_id(1)
    offs_bn = tl.arange(0, BN)
    cols = tl.arange(0, BM)
    first = cols < 1
    n_per: tl.constexpr = H // N_SPLIT
    n_begin = pid_s * n_per
    if SPLIT_SLOTS:
        _slot_split_part(act_ptr, w_ptr, s_ptr, alpha_ptr, o_scale_ptr, topk_w_ptr, ids_ptr, emap_ptr, out_ptr,
                         stride_ot, sum_ptr, cnt_ptr, pid_s, tok, TOPK, H, I, BN, N_SPLIT, W4A4, USE_ASM, MERGED,
                         HAS_MAP, KC, PLACED, USE_PDL, PF_ROWS, PF_W, PF_S)
        return
    if PF_ROWS > 0:
        for jp in tl.static_range(TOPK):  # (not j: the loops below carry a runtime j)
            e_j, local_j = _slot_expert(tok * TOPK + jp, ids_ptr, emap_ptr, HAS_MAP)
            if local_j > 0:
                _prefetch_w2_rows(w_ptr, s_ptr, e_j.to(tl.int64), n_begin, PF_ROWS, H, I, PF_W, PF_S)
    _pdl_enter(USE_PDL)
    for n0 in range(n_begin, n_begin + n_per, BN):
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        if UNROLL:
            for j in tl.static_range(TOPK):
                acc += _slot_part(act_ptr, w_ptr, s_ptr, alpha_ptr, o_scale_ptr, topk_w_ptr, ids_ptr, emap_ptr,
                                  tok * TOPK + j, n0, cols, H, I, BN, BM, KC, W4A4, USE_ASM, MERGED, HAS_MAP, PLACED)
        else:
            for j in range(TOPK):
                acc += _slot_part(act_ptr, w_ptr, s_ptr, alpha_ptr, o_scale_ptr, topk_w_ptr, ids_ptr, emap_ptr,
                                  tok * TOPK + j, n0, cols, H, I, BN, BM, KC, W4A4, USE_ASM, MERGED, HAS_MAP, PLACED)
        o_ptrs = out_ptr + tok.to(tl.int64) * stride_ot + n0 + offs_bn[:, None] + cols[None, :] * 0
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=first[None, :])


@triton.jit
def moe_splitk_reduce_kernel(
    part_ptr,
    part_stride,
    act_ptr,
    ids_ptr,
    emap_ptr,
    o_gscale_ptr,
    I: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    W4A4: tl.constexpr,
    HAS_MAP: tl.constexpr = False,
    KC: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False,
    SPLIT_CAP: tl.constexpr = 0,
    SPLIT_MIN: tl.constexpr = 1,
    SPLIT_FLOOR: tl.constexpr = 1,
    SP: tl.constexpr = 1,
    N_TILES: tl.constexpr = 1,
    KT: tl.constexpr = 1,
):
    """act[slot] = silu(gate) * up from GEMM1's split-K partial sums (added in split order, so the result
    does not depend on which split finished first), stored like GEMM1's own epilogue would (merged order,
    W4A4: NVFP4-quantized). One program per (slot, BLOCK of I); once per slot, not once per GEMM2 program. For
    the grouped schedule the rows are sorted slot positions (W4A16 only, HAS_MAP off: no expert is looked up).
    ``SPLIT_CAP > 0``: the slot dedup's split picked from the routing (:func:`_dedup_split`, counted as GEMM1 did);
    SPLIT_K is the largest it can be, SPLIT_MIN the plan's, SPLIT_FLOOR the least."""
    _pdl_enter(USE_PDL)
    slot = tl.program_id(0).to(tl.int64)
    # a remote slot (expert map): GEMM1 wrote no partial sums and GEMM2 skips it; write nothing
    e, local = _slot_expert(slot, ids_ptr, emap_ptr, HAS_MAP)
    offs_i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs_i < local * I  # local is 0 or 1
    pp = part_ptr + slot * (2 * I) + offs_i
    gate = tl.load(pp, mask=live, other=0.0)
    up = tl.load(pp + I, mask=live, other=0.0)
    splits = SPLIT_K
    if SPLIT_CAP > 0:
        groups = tl.sum(_group_leaders(ids_ptr, emap_ptr, tl.num_programs(0), SP, HAS_MAP).to(tl.int32), axis=0)
        splits = _dedup_split(groups, N_TILES, KT, SPLIT_FLOOR, SPLIT_MIN, SPLIT_K, SPLIT_CAP)
    for sk in tl.static_range(1, SPLIT_K):
        # (every split's loads issued at once; those past the call's split masked off)
        ms = live & (offs_i * 0 + sk < splits)
        gate += tl.load(pp + sk * part_stride, mask=ms, other=0.0)
        up += tl.load(pp + (sk * part_stride + I), mask=ms, other=0.0)
    act = tl.reshape(gate / (1.0 + tl.exp(-gate)) * up, (BLOCK, 1))
    if W4A4:
        act = _fake_quant_rows(act, tl.load(o_gscale_ptr + e), BLOCK, 1)
    pos = _act_pos(offs_i, KC)
    tl.store(act_ptr + slot * I + pos, tl.reshape(act, (BLOCK,)).to(tl.float16), mask=live)


@triton.jit
def _local_ids(ids_ptr, emap_ptr, offs, m, HAS_MAP: tl.constexpr):
    """(local expert ids, mask) of slots ``offs``: remote slots (expert map -1) masked out."""
    ids = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
    if HAS_MAP:
        ids = tl.load(emap_ptr + ids, mask=m, other=-1)
        m = m & (ids >= 0)
    return ids, m


@triton.jit
def _write_work_list(counts, offs_e, emask, offsets_ptr, cursor_ptr, blk_ptr, num_blocks_ptr, BM: tl.constexpr):
    """Offsets, scatter cursors and the work list of BM-row blocks from the per-expert counts."""
    counts = tl.where(emask, counts, 0)
    excl = tl.cumsum(counts, 0) - counts
    tl.store(offsets_ptr + offs_e, excl, mask=emask)
    tl.store(cursor_ptr + offs_e, excl, mask=emask)
    nblk = (counts + (BM - 1)) // BM
    first_blk = tl.cumsum(nblk, 0) - nblk
    tl.store(num_blocks_ptr, tl.sum(nblk, 0))
    # Block j of every expert at once: as many passes as the busiest expert has blocks.
    for j in range(0, tl.max(nblk, 0)):
        mj = emask & (j < nblk)
        b = (first_blk + j) * BLOCK_FIELDS
        tl.store(blk_ptr + b, offs_e, mask=mj)
        tl.store(blk_ptr + b + 1, excl + j * BM, mask=mj)
        tl.store(blk_ptr + b + 2, tl.minimum(counts - j * BM, BM), mask=mj)


@triton.jit
def moe_align_kernel(
    ids_ptr,
    num_slots,
    emap_ptr,
    counts_ptr,
    offsets_ptr,
    cursor_ptr,
    slots_ptr,
    blk_ptr,
    num_blocks_ptr,
    ws_ptr,
    ws_numel,
    x_ptr,
    stride_xt,
    xq_ptr,
    pcounts_ptr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
    ZBLOCK: tl.constexpr,
    BM: tl.constexpr = 16,
    H: tl.constexpr = 128,
    BK: tl.constexpr = 128,
    PREP_X: tl.constexpr = False,
    HAS_MAP: tl.constexpr = False,
    PAR: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """Program 0: per-expert counts and offsets, slots grouped by expert, and the work list of BM-row blocks.

    With ``HAS_MAP`` the ids are global and ``emap_ptr`` maps them to local experts (-1: remote, dropped).
    Programs 1..: zero the fp32 combine workspace (GEMM2 adds into it) and, with ``PREP_X``, write the
    activations as fp16 in GEMM1's merged K order (tiles of BK) to ``xq_ptr`` [T, H], gathered in 4-byte pairs. (Reading
    whole K tiles and transposing them on chip instead, 633f7dc, saved 0.1-0.6 us of 8-15 us at TP8 T = 256-512 and
    cost 4.7 us at T=1024 on the H100, 2026-12-06: removed; program 0's serial routing is the launch's long pole.)

    ``PAR`` (plan option ``parallel_align``): the first ceil(num_slots / BLOCK) programs each count BLOCK slots
    into ``pcounts_ptr`` ([E] counts + 1 arrival counter, zero between calls); the last to arrive writes offsets,
    cursors and the work list and zeroes the counts again; :func:`moe_scatter_kernel` (the next launch) then places the slots
    with many programs instead of program 0's serial passes.
    """
    _pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    offs_e = tl.arange(0, E_POW2)
    emask = offs_e < E
    if PAR:
        # a runtime count, not a constexpr: one compiled kernel for every batch size (as a constexpr it made a
        # new kernel every BLOCK / k tokens, which the load-time warm-up cannot cover: tests/test_kernels_warmup.py)
        hprog = tl.cdiv(num_slots, BLOCK)
        if pid < hprog:
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            ids, m = _local_ids(ids_ptr, emap_ptr, offs, offs < num_slots, HAS_MAP)
            tl.atomic_add(pcounts_ptr + ids, tl.full((BLOCK,), 1, tl.int32), mask=m, sem="relaxed")
            if _last_arrival(pcounts_ptr + E, hprog):
                # read through the atomic unit (no stale L1 line) and leave zeros for the next call
                counts = tl.atomic_xchg(pcounts_ptr + offs_e, tl.zeros((E_POW2,), dtype=tl.int32), mask=emask,
                                        sem="relaxed", scope="gpu")
                _write_work_list(counts, offs_e, emask, offsets_ptr, cursor_ptr, blk_ptr, num_blocks_ptr, BM)
    elif pid == 0:
        tl.store(counts_ptr + offs_e, tl.zeros((E_POW2,), dtype=tl.int32), mask=emask)
        tl.debug_barrier()
        for s0 in range(0, num_slots, BLOCK):
            offs = s0 + tl.arange(0, BLOCK)
            ids, m = _local_ids(ids_ptr, emap_ptr, offs, offs < num_slots, HAS_MAP)
            tl.atomic_add(counts_ptr + ids, tl.full((BLOCK,), 1, tl.int32), mask=m, sem="relaxed")
        tl.debug_barrier()
        # Read the counts back through the atomic unit: plain loads could see a stale L1 line.
        counts = tl.atomic_add(counts_ptr + offs_e, tl.zeros((E_POW2,), dtype=tl.int32), mask=emask, sem="relaxed")
        _write_work_list(counts, offs_e, emask, offsets_ptr, cursor_ptr, blk_ptr, num_blocks_ptr, BM)
        tl.debug_barrier()
        for s0 in range(0, num_slots, BLOCK):
            offs = s0 + tl.arange(0, BLOCK)
            ids, m = _local_ids(ids_ptr, emap_ptr, offs, offs < num_slots, HAS_MAP)
            dst = tl.atomic_add(cursor_ptr + ids, tl.full((BLOCK,), 1, tl.int32), mask=m, sem="relaxed")
            tl.store(slots_ptr + dst, offs, mask=m)
    if pid > 0:
        offs = (pid - 1).to(tl.int64) * ZBLOCK + tl.arange(0, ZBLOCK)
        m = offs < ws_numel
        tl.store(ws_ptr + offs, tl.zeros((ZBLOCK,), dtype=tl.float32), mask=m)
        if PREP_X:
            # ws is [T, H] like x: the same flat range, written in merged order, read gathered in pairs.
            # 32-bit index math (the launcher keeps T*H < 2^31): fewer registers than the 64-bit offsets.
            o32 = (pid - 1) * ZBLOCK + tl.arange(0, ZBLOCK)
            t = o32 // H
            r = o32 % H
            src = t.to(tl.int64) * stride_xt + (r - r % BK + _merged_k_of(r % BK, BK // 8))
            xv = tl.load(x_ptr + src, mask=m, other=0.0)
            tl.store(xq_ptr + offs, _to_fp16(xv), mask=m)


@triton.jit
def moe_scatter_kernel(ids_ptr, num_slots, emap_ptr, cursor_ptr, slots_ptr, BLOCK: tl.constexpr,
                       HAS_MAP: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """Slots grouped by expert (the parallel align's second half): each program places BLOCK slots at their
    expert's cursor (written by moe_align_kernel with PAR)."""
    _pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids, m = _local_ids(ids_ptr, emap_ptr, offs, offs < num_slots, HAS_MAP)
    dst = tl.atomic_add(cursor_ptr + ids, tl.full((BLOCK,), 1, tl.int32), mask=m, sem="relaxed")
    tl.store(slots_ptr + dst, offs, mask=m)


@triton.jit
def moe_finalize_kernel(ws_ptr, out_ptr, stride_ot, ids_ptr, emap_ptr, H: tl.constexpr, BLOCK: tl.constexpr,
                        ROWS: tl.constexpr = 1, HAS_MAP: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """out[t, :] = the sum of ws rows t*ROWS .. t*ROWS + ROWS - 1 in the output dtype. ROWS = 1: the grouped
    schedule's combine buffer; ROWS = k: the slot dedup's per-slot rows, added in slot order (a remote slot's
    row was never written: skipped)."""
    _pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    if ROWS == 1:
        v = tl.load(ws_ptr + t * H + offs, mask=m)
    else:
        v = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(ROWS):
            slot = t * ROWS + j
            _, local = _slot_expert(slot, ids_ptr, emap_ptr, HAS_MAP)
            v += tl.load(ws_ptr + slot * H + offs, mask=offs < local * H, other=0.0)  # local is 0 or 1
    tl.store(out_ptr + t * stride_ot + offs, v.to(out_ptr.dtype.element_ty), mask=m)
