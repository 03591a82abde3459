"""Tile configurations of the fused NVFP4 MoE kernels, per GPU architecture, and how one is picked.

Picking is a pure function of static shapes (tokens T, experts E, top-k, hidden H, intermediate I) and the
architecture, so a CUDA graph captured for a batch size always replays the kernels it was captured with,
and no autotuning runs inside capture. The per-arch defaults below were chosen from the sweep in
``benchmarks/moe_kernel.py --sweep`` on an H200 (SM90); SM120 and SM100 entries are untested on such GPUs
and are sized to fit their shared memory (SM120: 99 KB per block, checked by
``tests/test_kernels_configs.py``).

Vocabulary: GEMM1 computes ``act = silu(x Wg^T) * (x Wu^T)`` (N = I per gate/up half, K = H); GEMM2
computes ``act W2^T`` (N = H, K = I). ``bn`` is the weight-tile rows (the MMA M side after swapping A/B),
``bm`` the tokens per MMA (N side), ``bk`` the K tile. GEMM2 takes the whole K = I in one tile.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.spec import expected_distinct_experts

def smem_limit(arch: str) -> int:
    """Shared memory one block may use (opt-in maximum), bytes: the hardware table's per-arch limit."""
    from glm5_fp4.hardware import smem_limit as limit  # (lazy: the launch path never needs the table)

    return limit(arch)


def sm_count_guess(arch: str) -> int:
    """SMs to plan for when the caller does not know the GPU (compile-time plans, the interpreter)."""
    from glm5_fp4.hardware import sm_count_guess as guess

    return guess(arch)


@dataclass(frozen=True)
class Gemm1Config:
    bn: int  # gate rows per tile (the same number of up rows ride along)
    bm: int  # tokens per MMA
    bk: int  # K tile (multiple of 32)
    num_warps: int
    num_stages: int
    # One MMA chain per weight tile (the eight decoded K subsets concatenated in registers) instead of
    # eight MMAs each waited for; costs registers (the whole decoded tile is live at once).
    merged: bool = True
    # Register cap per thread (ptxas .maxnreg; None: the compiler's choice), so that more CTAs fit an SM: the
    # decode loops are latency-bound at two CTAs of four warps per SM (ncu, H200, 2026-12-03).
    maxnreg: int | None = None
    # The gate/up weight and scale tiles by TMA (tensor descriptors over the [E*2I, .] words and scales; SM90+)
    # instead of per-thread cp.async copies: the K loop then holds no per-element pointer tensors (sm_90, Triton
    # 3.6, 64x32x256 in 3 stages: 126 instead of 199 registers), so shared memory alone bounds the CTAs per SM.
    # The activations stay pointer loads (their rows are a gather). Sweep candidates, no default: no faster on the
    # H200 (improvements/13).
    tma: bool = False
    # The tile's gate and up rows as one [2*bn, bk] weight tile: one load, one decode and one MMA of M = 2*bn per K
    # tile, so the wgmmas alternate between two accumulators. Otherwise each matrix's K tile is one dependent chain
    # of bk/16 wgmmas (N = bm) after the other's. Not with tma (two runs per K tile, not one box).
    stacked: bool = False
    # The warp-specialised Gluon kernel (kernels/gluon_moe.py; sm_90, W4A16, stacked, layout "tiled"): a producer
    # warp keeps num_stages K tiles in flight (weights by TMA, scales and activations by cp.async) while the consumer
    # warpgroup decodes and multiplies; persistent CTAs walk the work list. Opt-in forms only (gemm1_ws*).
    ws: bool = False


@dataclass(frozen=True)
class Gemm2Config:
    bn: int  # output features per tile
    bm: int  # tokens per MMA (grouped schedule; the slot schedule always uses 16)
    num_warps: int
    num_stages: int
    # Programs per expert along H (grouped) or per token along H (slot). None: pick to fill the GPU.
    n_split: int | None = None
    merged: bool = True  # as Gemm1Config.merged
    maxnreg: int | None = None  # as Gemm1Config.maxnreg


@dataclass(frozen=True)
class Plan:
    """Everything the launcher needs for one call shape."""

    schedule: str  # "slot" or "grouped"
    gemm1: Gemm1Config
    gemm2: Gemm2Config
    gemm2_n_split: int
    # GEMM1 programs per (N tile, rows) along K, their fp32 partial sums added (in split order) and SwiGLU
    # applied by moe_splitk_reduce_kernel (one launch more). Slot schedule: the default for T <= 4. Grouped
    # schedule (W4A16, T <= GROUPED_SPLIT_K_MAX_TOKENS): the default where the skewed case's work list would not
    # fill the GPU (pick_grouped_split_k). A short work list (all tokens on a few experts: 8 blocks x I/BN tiles
    # = 32 programs at TP8 T=16) leaves most SMs idle with each program walking all of K.
    gemm1_split_k: int = 1
    # Grouped W4A16: the align kernel converts x to fp16 in GEMM1's K order once (False: GEMM1 converts
    # every K tile itself; kept for comparison).
    prep_x: bool = True
    # Slot schedule, GEMM2 one program per (N range, token): it unrolls the token's k experts (all weight loads in
    # flight), where they fit (the plans that split GEMM2 by slots have nothing to unroll).
    gemm2_unroll: bool = False
    # Slot schedule with split-K: the last GEMM1 program of each (N tile, slot) adds the partial sums and
    # applies SwiGLU (an arrival counter), instead of a reduce launch: 2 dependent launches instead of 3.
    # The default where GEMM2 is split by slots (T <= 2 on sm_90/sm_100: pick_slot_split_k) and at T <=
    # SLOT_WIDE_SPLIT_MAX_TOKENS under the former picks; elsewhere the opt-in "fused_reduce".
    gemm1_fused_reduce: bool = False
    # Grouped schedule: the routing is counted by many programs (the last one scans and writes the work list)
    # and placed by a second, many-program kernel, instead of one program's serial passes (15 us at T=512,
    # 97 us at T=4096 on the H200). One launch more. The default from PARALLEL_ALIGN_MIN_TOKENS on.
    parallel_align: bool = False
    # Slot schedule: the programs of a group of slots routed to the same expert are one (its first slot's), which
    # computes all of them, GEMM1 and GEMM2 alike; GEMM2 then writes per-slot fp32 rows and the finalize kernel
    # adds each token's k rows (one launch more). Under skew the slot form reads and decodes an expert's weights
    # once per token routed to it: TP1 T=4 same_k 290 us against Marlin's 87 (H200, 2026-12-01); balanced
    # routing forms groups of one. The default from SLOT_DEDUP_MIN_TOKENS on.
    slot_dedup: bool = False
    # Programmatic dependent launch (SM90+): every kernel of the call after the first is launched before its
    # predecessor ends; each waits (griddepcontrol.wait) at its top and then lets its own successor launch, so
    # launch latency and the next kernel's ramp overlap the current one's tail, and the GEMM2 kernels prefetch
    # their first weight tiles into L2 before they wait. The default from PDL_MIN_TOKENS on (SM90+), and below it
    # where GEMM2 is split by slots and takes K whole (configs.plan).
    pdl: bool = False
    # Software L2 prefetch (inline PTX; off in the interpreter): GEMM1 asks L2 for its weight rows this many K tiles
    # ahead, the grouped GEMM2 (whole K tiles) this many N tiles ahead, beyond what the pipeline's shared-memory
    # stages hold in flight. 0: none.
    l2_prefetch: int = 0
    # Slot schedule without dedup: GEMM2 runs one program per (N range, token, slot) instead of one per (N range,
    # token) walking the token's k experts, each slot's rows to the fp32 combine buffer; the last program of a
    # token's N range to arrive (a counter) adds the k rows in slot order (the one-program form's order: bit-equal
    # in the interpreter, equal to rounding on the GPU). The default at T <= 2 on SPLIT_SLOTS_ARCHS.
    gemm2_split_slots: bool = False
    # Slot dedup (Plan.slot_dedup): GEMM2's program that writes the last of a token's k per-slot rows of an N range
    # (an arrival counter per token and N range) adds them in slot order into the output, instead of the finalize
    # launch: GEMM1 and GEMM2 only, as at T <= 2, with dedup's one read of each expert's weights under skew.
    # GEMM1's K then splits by pick_slot_split_k with the reduce fused, as where GEMM2 is split by slots.
    # Opt-in "dedup_by_arrival" (H100 2026-12-06, improvements/20: slower than the default with its finalize launch
    # everywhere but whole experts at T=2 under skew).
    dedup_fused_finalize: bool = False
    # Slot dedup's finalize launch: output elements per program (0: launch.FBLOCK_ROWS). The former 4096 is the
    # opt-in "finalize_4096", kept to measure the rule against.
    finalize_block: int = 0
    # The slot GEMM1 (which loads and converts x itself): each K tile of x in natural K order (16-byte copies, issued
    # stages ahead by the pipeliner), put in merged order in registers, instead of gathered 2 bytes at a time in
    # merged order in the iteration that uses it. The default with slot dedup on X_NATURAL_ARCHS.
    x_natural: bool = False
    # Slot dedup: GEMM1's split-K picked at run time from the groups the routing leaves (triton_moe._dedup_split: the
    # largest divisor of the K tiles, from gemm1_split_floor (or gemm1_split_k) to dedup_split_max, that keeps groups
    # x N tiles x split programs within this many, one wave: the rule pick_slot_split_k applies at plan time where the
    # programs are known, T <= 2; gemm1_split_k where none does); 0: the plan's split.
    gemm1_split_cap: int = 0
    # With gemm1_split_cap: GEMM1's grid holds only as many (group, K range) rows as some routing can use
    # (launch.dedup_rows), each program finding its group's leader and K range from the counted groups, instead of a
    # program per (slot, K range) of the largest split, most of them idle (TP8 T=4: 512 programs against 1,536).
    gemm1_compact_grid: bool = False
    # With gemm1_split_cap: the run-time pick may also lower the split below gemm1_split_k, to the largest divisor
    # of the K tiles from this one up that keeps the call's programs within the cap (one wave); 0: never lowered.
    gemm1_split_floor: int = 0


# ---------------------------------------------------------------------------------------------------------
# Candidate lists (the sweep explores these; SM120's must each fit 99 KB).
# ---------------------------------------------------------------------------------------------------------
GEMM1_CANDIDATES: dict[str, list[Gemm1Config]] = {
    "sm90": [
        Gemm1Config(bn, bm, bk, w, s)
        for bn, bm, bk, w, s in [
            (16, 16, 256, 4, 4),
            (32, 16, 256, 4, 4),
            (64, 16, 256, 4, 3),
            (64, 16, 256, 4, 4),
            (64, 16, 128, 4, 4),
            (128, 16, 256, 8, 3),
            (64, 32, 256, 4, 3),
            (64, 32, 128, 4, 4),
            (128, 32, 256, 8, 3),
            (128, 32, 128, 8, 4),
            (128, 32, 256, 8, 2),
            (64, 64, 128, 4, 3),
            (128, 64, 128, 8, 3),
            (128, 64, 128, 8, 2),
            (128, 128, 128, 8, 3),
            (128, 128, 128, 8, 2),
            # Prefill tiles that do not spill on sm_90 (the 128x128x128 one above spills 172 B at 255
            # registers: two 128x128 fp32 accumulators and the decoded operand; ahead-of-time compile, Triton
            # 3.9, 2026-12-02): half the gate/up rows per tile, or 64-wide K tiles.
            (64, 64, 64, 4, 4),
            (64, 64, 128, 8, 3),
            (64, 128, 128, 8, 3),
            (64, 128, 64, 8, 4),
            (64, 128, 64, 8, 3),
            (64, 128, 64, 4, 4),
            (32, 128, 64, 4, 4),
            (128, 128, 64, 8, 4),
        ]
    ] + [
        # Decode tiles capped in registers (and shared memory: <= 75 KB) so that 3-4 CTAs fit an SM where the
        # uncapped ones fit 2 (199 registers, 86 KB at 64x32x256 s3 on the H200)
        Gemm1Config(bn, bm, bk, w, s, maxnreg=r)
        for bn, bm, bk, w, s, r in [
            (64, 16, 256, 4, 2, 168),
            (64, 16, 256, 4, 3, 128),
            (64, 32, 256, 4, 2, 128),
            (64, 16, 128, 4, 3, 128),
            (64, 16, 128, 4, 4, 128),
            (64, 32, 256, 4, 2, 168),
            (64, 32, 128, 4, 3, 128),
            (64, 32, 128, 4, 4, 128),
            (64, 32, 128, 4, 4, 168),
            (64, 64, 128, 4, 3, 168),
        ]
    ] + [
        # Weight tiles by TMA: no per-element pointer tensors, so registers no longer bound the CTAs per SM
        # (Triton 3.6, sm_90, TP8 shard, benchmarks/results/moe_kernel_sass_sm90_tma_tiles.json: 64x32x256 s2 127
        # registers / 51 KB -> 4 CTAs per SM; 64x32x128 s3 87 / 43 KB -> 5; s4 87 / 60 KB -> 3), where 3-4 CTAs by
        # register caps spilled. No faster on the H200 (2026-12-03, improvements/13: ~12 % more instructions per weight
        # and a per-stage barrier stall). sm100 shares this list: compiled there, never run.
        Gemm1Config(bn, bm, bk, w, s, tma=True)
        for bn, bm, bk, w, s in [
            (64, 16, 256, 4, 2),
            (64, 16, 256, 4, 3),
            (64, 16, 128, 4, 3),
            (64, 32, 256, 4, 2),
            (64, 32, 256, 4, 3),
            (64, 32, 128, 4, 3),
            (64, 32, 128, 4, 4),
            (128, 32, 128, 4, 3),
            (64, 64, 128, 4, 3),
            (64, 64, 128, 4, 4),
            (128, 64, 128, 8, 3),
            (128, 128, 128, 8, 3),
            (64, 128, 64, 4, 4),
        ]
    ] + [
        # Gate and up rows as one tile (Gemm1Config.stacked): the wgmmas alternate between the two accumulators.
        # (32x32x256 and the 128x128x128 prefill tile stacked were slower in the 2026-12-05 sweep / A/B and spill under
        # Triton 3.8 like their unstacked twins: left out.)
        Gemm1Config(bn, bm, bk, w, s, stacked=True)
        for bn, bm, bk, w, s in [
            (64, 16, 256, 4, 3),
            (64, 32, 256, 4, 3),
            (64, 32, 128, 4, 4),
            (64, 64, 128, 4, 3),
        ]
    ],
    "sm120": [
        Gemm1Config(bn, bm, bk, w, s)
        for bn, bm, bk, w, s in [
            (16, 16, 256, 4, 3),
            (32, 16, 256, 4, 3),
            (64, 16, 128, 4, 3),
            (64, 32, 128, 4, 3),
            # 64 x 64 tiles spill on sm_120 once the decoded tile is one merged operand
            (32, 64, 128, 8, 2),
            # the sm90 list's tiles that pass the sm_120 gate at the TP8 / TP4 shards (AOT, Triton 3.9, 2026-12-04:
            # 64x32x256, 64x64 and 128-token tiles of 128 rows spill, 32x16x256 in 2 stages in W4A4), swept on the
            # H200 stand-in (mma.sync, sm_120's plans: benchmarks/h200/mma_sync_job.sh)
            (64, 16, 256, 4, 2),
            (64, 16, 256, 4, 3),
            (64, 32, 128, 4, 4),
            (128, 32, 128, 8, 3),
            (64, 128, 64, 8, 3),
        ]
    ],
}
GEMM1_CANDIDATES["sm100"] = GEMM1_CANDIDATES["sm90"]
GEMM1_CANDIDATES["sm80"] = GEMM1_CANDIDATES["sm120"]

GEMM2_CANDIDATES: dict[str, list[Gemm2Config]] = {
    "sm90": [
        Gemm2Config(bn, bm, w, s, merged=m)
        for bn, bm, w, s, m in [
            (32, 16, 4, 3, True),
            (64, 16, 4, 3, True),
            (64, 16, 4, 3, False),
            (128, 16, 8, 3, False),
            # one MMA chain per 32-token tile: the whole tile decoded, then its 16 wgmmas and one wait (the eight-MMA
            # form waits after every pair: sm_90 SASS, Triton 3.6, 2026-12-05)
            (64, 32, 4, 3, True),
            (64, 32, 8, 3, False),
            (128, 32, 8, 3, False),
            (128, 32, 4, 3, False),
            (64, 64, 8, 2, False),
            (128, 64, 8, 2, False),
            (128, 64, 8, 3, False),
            # prefill: 128-token blocks in one pass (the work list's block at T >= 4096)
            (64, 128, 8, 2, False),
            (64, 128, 8, 3, False),
            (64, 128, 4, 3, False),
            (256, 64, 8, 2, False),
            # deeper rings along H (GEMM2 takes I whole at the TP8 shard: its stages are N tiles)
            (64, 16, 4, 4, False),
            (64, 16, 4, 5, False),
            (64, 16, 4, 6, False),
            (64, 16, 4, 8, False),
            (64, 32, 4, 4, False),
            (64, 32, 4, 5, False),
            (64, 32, 4, 6, False),
        ]
    ] + [
        Gemm2Config(bn, bm, w, s, merged=False, maxnreg=r)  # capped as GEMM1's above: 3-4 CTAs per SM
        for bn, bm, w, s, r in [
            (64, 16, 4, 3, 128),
            (64, 16, 4, 4, 128),
            (128, 32, 8, 3, 80),
            (128, 32, 8, 2, 80),
            (64, 32, 4, 3, 128),
        ]
    ],
    # sm_120: one MMA chain per tile (merged), which every Triton compiles alike; the eight-MMA form does not fit
    # under Triton 3.8, the engines' (triton_stages_mma_sets; improvements/16). Compile evidence only, unmeasured on
    # an SM120 GPU.
    "sm120": [
        Gemm2Config(bn, bm, w, s, merged=True)
        for bn, bm, w, s in [
            (64, 16, 4, 2),
            (64, 32, 8, 2),
            (128, 16, 4, 2),
            (64, 64, 8, 2),
            # merged forms of sm90 tiles that pass the sm_120 gate at the TP8 / TP4 shards (as GEMM1's above)
            (32, 16, 4, 3),
            (64, 16, 4, 3),
            (64, 32, 4, 3),
        ]
    ],
}
GEMM2_CANDIDATES["sm100"] = GEMM2_CANDIDATES["sm90"]
GEMM2_CANDIDATES["sm80"] = GEMM2_CANDIDATES["sm120"]

# Native FP4 MMA path (native_fp4.py, W4A4 on SM100/SM120, unverified): (bn, bm, bk, warps, stages) of
# GEMM1 and (bn, bm, warps, stages) of GEMM2. SM100's tcgen05 path needs 128-row weight tiles.
# sm_120 GEMM1 uses 32-row tiles: 64 x 32 spills 4-8 B per thread with Triton 3.9's ptxas.
NATIVE_GEMM1 = {"sm120": Gemm1Config(32, 32, 128, 4, 2), "sm100": Gemm1Config(128, 32, 128, 4, 2)}
NATIVE_GEMM2 = {"sm120": Gemm2Config(64, 32, 4, 2), "sm100": Gemm2Config(128, 32, 4, 2)}

# Split-K of GEMM1: at most SPLIT_K_MAX K ranges (grouped schedule) or SLOT_SPLIT_K_MAX (slot schedule, at most
# SPLIT_K_MAX_TOKENS tokens), each of whole K tiles. The partial sums live in a static workspace
# (kernels/moe.py Workspace.part) sized for the larger of the two. The slot picker goes up to SLOT_SPLIT_K_PICK
# at T=1 (below) and SPLIT_K_MAX otherwise; more ranges are sweep candidates (benchmarks/moe_kernel.py --sweep).
SPLIT_K_MAX = 4
SLOT_SPLIT_K_MAX = 24
SPLIT_K_MAX_TOKENS = 8
# Grouped schedule with split-K (Plan.gemm1_split_k; pick_grouped_split_k): the partial-sum workspace holds this
# many tokens.
GROUPED_SPLIT_K_MAX_TOKENS = 64
# Slot schedule: one program group per expert (Plan.slot_dedup) from this many tokens on. The plan is fixed per
# batch size (CUDA graphs) before the routing is known, so it is sized for skew, which costs little on balanced
# routing (H200, 2026-12-02, benchmarks/results/moe_variants_h200_dedup_split.json, us per layer, per-slot ->
# dedup): TP8 T=4 same_k 52.1 -> 37.6, balanced 59.5 -> 60.2; TP1 T=4 same_k 287.9 -> 105.5, balanced
# 286.3 -> 309.2. At T=2 the TP8 shard loses both ways (33.5 -> 35.7 same_k: the finalize launch costs more than
# one token's re-read of 8 small experts); at T=1 no two slots share an expert.
SLOT_DEDUP_MIN_TOKENS = 3
# Slot schedule without dedup (T < SLOT_DEDUP_MIN_TOKENS): GEMM2 one program per slot (Plan.gemm2_split_slots) on
# these archs, in SPLIT_SLOTS_GEMM2's tile. H200, 2026-12-03, 8deb18e: the one-program form (each program walks the
# token's k experts, unrolled) runs its GEMM2 at TP8 T=1 in 9.6 us at 15 % of DRAM peak on 96 programs (ncu); split
# by slots the sweep (benchmarks/results/moe_kernel_h200_sweep_split_slots_8deb18e.json, TP8 whole layer, us) has T=1
# 19.0 vs 21.3 and T=2 29.0 vs 33.5 with eight MMAs per tile (18.7-19.0 for three of the four unmerged candidates,
# 21.5 for the 3-stage 128-register one; 19.6 / 30.1 with the merged one); the same-run A/B of the defaults:
# write-up 14. sm_120 splits too, in its merged slot tile (never run on an SM120; the H200 stand-in, 2026-12-04 sweep,
# TP8 T=1 with the new slot GEMM1 tile: 26.8 -> 22.7 us; benchmarks/h200/mma_sync_job.sh), but not with the wide
# GEMM1 split nor PDL (SLOT_WIDE_SPLIT_ARCHS: the sweep had PDL at 25.9, PDL and the fused reduce at 24.3); the former
# is opt-in "one_program_gemm2".
SPLIT_SLOTS_ARCHS = ("sm90", "sm100", "sm120")
SPLIT_SLOTS_GEMM2 = {"sm90": Gemm2Config(64, 16, 4, 3, merged=False), "sm120": Gemm2Config(64, 16, 4, 2, merged=True)}
SPLIT_SLOTS_GEMM2["sm100"] = SPLIT_SLOTS_GEMM2["sm90"]
# Programmatic dependent launch (Plan.pdl) from this many tokens on, on SM90+ (griddepcontrol). H200,
# 2026-12-02, benchmarks/results/moe_variants_h200_pdl.json, TP8 us per layer, plain -> pdl: T=4 same_k 37.2 ->
# 34.8, balanced 59.6 -> 58.0; T=16 same_k 45.9 -> 39.6, balanced 110.8 -> 107.4; T=64 same_k 76.8 -> 65.0,
# balanced 209.6 -> 208.1; T=512 balanced 307.2 -> 298.1, same_k 169.0 -> 171.5; T=4096 within 0.4 %. At T=1
# (3 launches, split-K 4) it lost 3 us (25.4 -> 28.3): not below this, except where GEMM2 is split by slots
# (SLOT_SPLIT_PROGRAMS_PER_SM).
PDL_MIN_TOKENS = 3
PDL_ARCHS = ("sm90", "sm100", "sm120")
# The former picks (since 2026-12-03 only under the opt-in forms that keep them on sm_90/sm_100, and on the other
# archs): up to SLOT_WIDE_SPLIT_MAX_TOKENS tokens the slot schedule's split-K picker goes up to SLOT_SPLIT_K_PICK K ranges
# (elsewhere SPLIT_K_MAX; SLOT_SPLIT_K_MAX is the launcher's limit) and the last GEMM1 program of each tile reduces
# them (Plan.gemm1_fused_reduce: 2 launches). H200, 2026-12-02, TP8 T=1, us per layer: the sweep
# (benchmarks/results/moe_kernel_h200_sweep_t1_pdl.json) split 4 + reduce launch 23.6 (the default before), split 8
# 21.7, split 8 fused 20.6, split 12 fused 23.8, split 24 fused 24.2; the same-run A/B
# (moe_variants_h200_pdl_defaults.json) 21.5 / 21.6 against 24.8 / 24.8 (balanced / same_k). At T=2 the former
# form stayed faster (35.9 / 33.4 against 37.6 / 34.7): not there.
SLOT_WIDE_SPLIT_MAX_TOKENS = 1
# Where GEMM2 is split by slots (Plan.gemm2_split_slots, T <= 2) on SLOT_WIDE_SPLIT_ARCHS, the slot GEMM1 splits K
# into any whole number of K tiles that keeps about this many programs per SM (pick_slot_split_k), reduces them in
# its last program and launches with PDL where GEMM2 takes K whole. H200, 2026-12-03, the sweep at 811a4d6
# (benchmarks/results/moe_kernel_h200_sweep_small_t_811a4d6.json, whole layer, us; the best split at 384 programs on
# the 132 SMs each time): TP8 T=1 split 12 18.3 (8: 19.3, 24: 20.7), T=2 split 6 28.1 (4: 29.0, 8: 30.5), fused +
# PDL 26.1; TP4 T=1 split 6 28.5 (4: 29.8, 8: 30.4), + PDL 25.2. Not swept alone: TP4 T=2 (split 3; the plan with it
# 41.8 us against 47.7 for the former picks, same run) and whole experts, where the rule leaves K unsplit: TP1 T=1
# 78.2 us, the same as split 4 fused (78.2, moe_variants_h200_small_t_tp1_33dd51b.json). The same-run A/B against
# the former picks (opt-in "slot_split_pow2"): write-up 14.
SLOT_SPLIT_PROGRAMS_PER_SM = 3
SLOT_SPLIT_K_PICK = 8
# where that was measured (sm_120 keeps split 4 + a reduce launch: unmeasured there, and its 16-row slot tile in
# W4A4 spills 8 B with 8 ranges and a reduce launch, benchmarks/results/compile_matrix.md)
SLOT_WIDE_SPLIT_ARCHS = ("sm90", "sm100")

# GEMM2 takes K (= I) in chunks of at most this many: GLM-5's TP shards (I = 256, 512) in one tile, whole
# experts (I = 2048: TP1, expert parallelism) in 4, since a [BN, 2048] decoded tile fits neither registers nor
# shared memory.
GEMM2_MAX_K_CHUNK = 512


def gemm2_k_chunk(intermediate: int) -> int:
    return intermediate if intermediate <= GEMM2_MAX_K_CHUNK else GEMM2_MAX_K_CHUNK


# Smallest work-list block (tokens per MMA) any plan uses; the workspace's work list is sized for it.
MIN_BLOCK_M = 16

# Largest T (tokens) served by the slot schedule (no sorting, 2 launches) per arch.
SLOT_MAX_TOKENS = {"sm90": 4, "sm100": 4, "sm120": 4, "sm80": 4}


def arch_of(capability: tuple[int, int]) -> str:
    major, _ = capability
    if major >= 12:
        return "sm120"
    if major == 10 or major == 11:
        return "sm100"
    if major == 9:
        return "sm90"
    return "sm80"


# ---------------------------------------------------------------------------------------------------------
# Shared-memory estimate. Triton's pipeliner keeps num_stages - 1 copies of every tile the loop loads (packed
# weights, scales, activations); on top come the 16-bit activation operands / W4A4 quantizer scratch and the
# epilogue's layout conversion. An upper bound of Triton's own figure (exact for several sm_90/sm_120 TP-shard
# configs, within 12 % above it for whole experts); tests/test_kernels_configs.py checks it against AOT-compiled
# sm_120 and sm_90 kernels.
# ---------------------------------------------------------------------------------------------------------
def triton_stages_mma_sets(version: str | None = None) -> bool:
    """Whether this Triton (default: the installed one) puts a GEMM's eight per-set MMA operands (merged=False)
    through shared memory. Triton 3.8 does (torch 2.14's, so vLLM 0.33's and SGLang 0.5.23's): sm_90 and sm_120
    GEMM2 64x16 at I = 512 needs 92,160 B there against 38,912 with 3.6, 3.7.1 and 3.9 (AOT compiles,
    2026-12-03); the merged operand compiles alike under all four."""
    if version is None:
        try:
            import triton
        except ImportError:  # no compiler, no kernel: nothing to size
            return False
        version = triton.__version__
    return version.split(".")[:2] == ["3", "8"]


def gemm1_smem_bytes(cfg: Gemm1Config, act_bytes: int = 2) -> int:
    per_stage = 2 * cfg.bn * cfg.bk // 2 + 2 * cfg.bn * cfg.bk // 16 + cfg.bm * cfg.bk * act_bytes
    return max(cfg.num_stages - 1, 1) * per_stage + cfg.bm * cfg.bk * 4 + cfg.bn * cfg.bm * 2


def gemm2_slot_unrolled_smem_bytes(cfg: Gemm2Config, intermediate: int, top_k: int) -> int:
    """Shared memory of the slot GEMM2 with its k experts unrolled: every expert's pipelined weight tile and
    its act tile are buffered at once (matches Triton 3.6 within 3 % at I = 256 and 512 on sm_90)."""
    kc = gemm2_k_chunk(intermediate)
    per_expert = max(cfg.num_stages - 1, 1) * (cfg.bn * kc // 2 + cfg.bn * kc // 16) + kc * 16 * 2
    return top_k * per_expert * (intermediate // kc)


def gemm2_slot_unrolls(arch: str, cfg: Gemm2Config, intermediate: int, top_k: int) -> bool:
    """Whether the one-program slot GEMM2 unrolls the token's k experts (Plan.gemm2_unroll): where all their tiles
    fit the arch's shared memory at once."""
    return gemm2_slot_unrolled_smem_bytes(cfg, intermediate, top_k) <= smem_limit(arch)


def gemm2_smem_bytes(cfg: Gemm2Config, intermediate: int, bm: int | None = None,
                     triton_version: str | None = None) -> int:
    """One K chunk's weight tile per pipeline stage, its activation tile, the epilogue; with more than one
    chunk (whole experts, I > GEMM2_MAX_K_CHUNK) the activation tile is loaded inside the loop and pipelined
    too. Bounds Triton 3.6's sm_90 figure from above within 12 % at I = 2048 (e.g. 128x64, 3 stages: 270,336 B
    measured, 303,104 B here; the estimate without the pipelined activations said 172,032 and a TP1 server
    died on it)."""
    bm = cfg.bm if bm is None else bm
    kc = gemm2_k_chunk(intermediate)
    stages = max(cfg.num_stages - 1, 1)
    per_stage = cfg.bn * kc // 2 + cfg.bn * kc // 16
    pipelined_act = stages * bm * kc * 2 if intermediate > kc else 0
    # the decoded tile in fp16 (an upper bound: 3.8 stages seven of the eight subsets, fewer at some small tiles)
    staged_sets = cfg.bn * kc * 2 if not cfg.merged and triton_stages_mma_sets(triton_version) else 0
    return stages * per_stage + bm * kc * 2 + cfg.bn * bm * 4 + pipelined_act + staged_sets


def fit_shared_memory(arch: str, g1: Gemm1Config, g2: Gemm2Config, intermediate: int) -> tuple[Gemm1Config, Gemm2Config]:
    """Shrink a default config until it fits ``arch``'s shared memory: pipeline stages first (down to 2), then
    GEMM2's own token block (it walks its own blocks, any bm <= the work list's), then the N tile. The tables
    are tuned for the TP shards; whole experts (I = 2048) need more per GEMM2 stage."""
    limit = smem_limit(arch)
    while gemm1_smem_bytes(g1) > limit:
        if g1.num_stages > 2:
            g1 = dataclasses.replace(g1, num_stages=g1.num_stages - 1)
        elif g1.bk > 64:
            g1 = dataclasses.replace(g1, bk=g1.bk // 2)
        else:
            break
    while gemm2_smem_bytes(g2, intermediate) > limit:
        if g2.num_stages > 2:
            g2 = dataclasses.replace(g2, num_stages=g2.num_stages - 1)
        elif g2.bm > 16:
            g2 = dataclasses.replace(g2, bm=g2.bm // 2)
        elif g2.bn > 16:
            g2 = dataclasses.replace(g2, bn=g2.bn // 2)
        else:
            break
    return g1, g2


# ---------------------------------------------------------------------------------------------------------
# Defaults per regime (picked from the H200 sweep; see the module docstring).
# ---------------------------------------------------------------------------------------------------------
_DEFAULT_GEMM1 = {
    # key: (schedule, bm) -> config; bm picks itself from tokens per expert.
    # sm90 entries: tiles from the first 2026-11-29 H200 per-stage sweep; kernel forms (merged, prepared
    # activations, split-K) from the later variants run (benchmarks/results/moe_kernel_h200_sweep.json).
    "sm90": {
        # merged MMA chain everywhere (the 2026-11-29 variants run: 1-5 % faster than eight MMAs per tile)
        # slot and grouped-32 tiles: the 2026-12-01 work-list sweep (benchmarks/results/moe_kernel_h200_sweep.json,
        # whole-layer time): TP8 T=1 64x16x256/4 warps 24.8 us vs 28.6 for 32x16; T=512 64x32x256/4 warps 314.6
        # vs 348.0 for 128x32/8 warps, T=1024 468 vs 524 (two 4-warp CTAs per SM hide more latency than one of 8)
        # slot tiles in 2 stages instead of 4 (a smaller shared-memory ring: more of the 512 programs of T=4 resident
        # at once), capped at 168 registers as measured: the 2026-12-03 sweep (benchmarks/results/
        # moe_kernel_h200_sweep_caps_f796498.json, TP8 whole layer) T=4 54.6 vs 59.7 us, and the same-run A/B
        # (moe_variants_h200_caps_8e79e8f.json, ..._tp1_...): T = 1-4 4-13 % faster balanced at TP8/TP4/TP1, 5-7 %
        # slower with all tokens on 8 experts at T=4; the former is opt-in "slot_stages4"
        ("slot", 16): Gemm1Config(64, 16, 256, 4, 2, maxnreg=168),
        ("grouped", 16): Gemm1Config(64, 16, 256, 4, 3),
        # 32-token blocks (T ~ 260-1,300 on the TP8 shard): gate and up rows as one tile (Gemm1Config.stacked, its
        # wgmmas alternating between two accumulators). Same-run A/B on the H200, 2026-12-05 (benchmarks/results/
        # moe_variants_h200_stacked_*_61c6dbd.json, us per layer, former twice / stacked): TP8 T=512 273.5, 273.1 /
        # 262.5, T=1024 412.0, 417.1 / 393.3, TP4 T=512 552.4, 553.2 / 529.7, TP1 T=1024 3,297, 3,451 / 3,191. The
        # 128-wide K tile in 4 stages (3 CTAs per SM) was faster still on the H200 at T=1024 (388.3 against 398.5 us)
        # but 7 % slower than the former tile on an H100 at T=512 (335.2 against 316.2; this one 314.0): sweeps
        # benchmarks/results/moe_kernel_h{200,100}_sweep_stacked_*.json. The former tile is opt-in "gemm1_64x32x256".
        ("grouped", 32): Gemm1Config(64, 32, 256, 4, 3, stacked=True),
        # 64-token blocks (T ~ 1,300-2,560 on the shards): the 2026-12-02 prefill sweep
        # (benchmarks/results/moe_kernel_h200_prefill_sweep.json, whole layer, TP8 T=2048): 64x64x128/4 warps 868 us
        # vs 911 for 128x64x128/8 warps (TP1 T=2048, moe_kernel_h200_prefill_sweep_tp1.json: 5,292 vs 5,538)
        ("grouped", 64): Gemm1Config(64, 64, 128, 4, 3),
        # 128-token blocks: the 2026-12-02 sweep's non-spilling tiles (64-row or 64-wide K) all lost to this one,
        # which spills 172 B (TP8 T=4096: 64x128x64/4 warps 1,527 us vs 1,306)
        ("grouped", 128): Gemm1Config(128, 128, 128, 8, 3),
    },
    # sm120: never run on an SM120. Picked on the H200 stand-in (sm_120's plans, SM count and gate-passing
    # candidates, the dots as mma.sync like sm_120's: benchmarks/h200/mma_sync_job.sh), 2026-12-04 sweep
    # (benchmarks/results/moe_kernel_h200_standin_sweep_sm120_d4ee23a.json, TP8 whole layer, us, former -> this tile
    # alone): T=1 44.9 -> 26.8, T=4 156.8 -> 58.5 (the former 16x16x256 slot tile), T=16 141.0 -> 130.7, T=64 281.1
    # -> 251.4, T=512 500.4 -> 495.2, T=1024 780.9 -> 770.9, T=4096 4,619 -> 2,196 (32-token blocks at prefill: the
    # gate-passing 64-token tile is 32 rows wide, 32x64x128, and re-reads the activations twice as often); the
    # 64-token entry (T ~ 1,300-2,560) is unmeasured and follows its neighbours. The former tiles: opt-in
    # "sm120_former".
    "sm120": {
        ("slot", 16): Gemm1Config(64, 16, 256, 4, 2),
        ("grouped", 16): Gemm1Config(64, 16, 256, 4, 3),
        ("grouped", 32): Gemm1Config(64, 32, 128, 4, 4),
        ("grouped", 64): Gemm1Config(64, 32, 128, 4, 4),
        ("grouped", 128): Gemm1Config(64, 32, 128, 4, 4),
    },
}
_DEFAULT_GEMM1["sm100"] = _DEFAULT_GEMM1["sm90"]
_DEFAULT_GEMM1["sm80"] = _DEFAULT_GEMM1["sm120"]

# W4A4 (emulated: the activation quantizer runs inside GEMM1) where the W4A16 tile spills with it. The tables
# above were measured in W4A16; with W4A4's quantizer, under Triton 3.8 (the engines'), the 32-token tile spills
# 44-64 B on sm_90 and 344-708 B on sm_100 (stacked: 140 B on sm_90), the 128-token one 180-304 B / 108 B, and
# sm_100's capped slot tile 36-92 B (compile matrix, 2026-12-06). Picked by compiling alone: the non-spilling tile
# nearest the W4A16 one at every shape (TP8, TP4, whole experts, the test shape), which the compile matrix then gates
# (tests/test_compile_matrix_sm90_sm100.py). W4A4 on these GPUs is a fidelity mode (SM120's numerics without FP4
# MMAs); these tiles were never timed against the spilling ones.
_W4A4_GEMM1 = {
    "sm90": {
        ("grouped", 32): Gemm1Config(64, 32, 128, 4, 4),  # 64x32x256/4 warps: 44-64 B
        ("grouped", 128): Gemm1Config(64, 128, 128, 8, 3),  # 128x128x128/8 warps: 180-304 B
    },
}
_W4A4_GEMM1["sm100"] = {
    **_W4A4_GEMM1["sm90"],  # there 344-708 B and 108 B
    ("slot", 16): Gemm1Config(64, 16, 256, 4, 3),  # the 168-register cap: 36-92 B at TP8 / TP4 T = 1-2
}


@dataclass(frozen=True)
class SpillWaiver:
    """A default kernel that spills registers on one arch and ships there anyway, and why. The compile matrix
    reports its rows as waived rather than failing while the spill stays within ``max_bytes`` (Triton 3.8, the
    engines'); a spill above it, or in another config, mode or hidden size, fails as any other. sm_120 has none:
    nothing can be measured there."""

    arch: str
    kernel: str
    gemm1: Gemm1Config | None  # the GEMM1 config of the rows it covers (None: a kernel without one)
    modes: tuple[str, ...]
    max_bytes: int
    why: str
    hidden: int | None = None  # only at this hidden size (None: any)


SPILL_WAIVERS: tuple[SpillWaiver, ...] = (
    SpillWaiver("sm90", "moe_gemm1_kernel", _DEFAULT_GEMM1["sm90"][("grouped", 128)], ("w4a16",), 76,
                "measured fastest: every non-spilling prefill tile was 17-92 % slower on the H200 (TP8 T=4096 "
                "64x128x64/4 warps 1,527 us against this one's 1,306; improvements/10); 76 B at TP8, 12 B at TP4 / TP1"),
    SpillWaiver("sm90", "moe_align_kernel", None, ("w4a16", "w4a4"), 8,
                "ptxas allocates 40 registers and spills 8 B at the test shape's H = 512 with 4 warps only (none with "
                "2 or 8 warps, none at GLM-5's H = 6144, none on sm_100 / sm_120); one sorting program per call",
                hidden=512),
)

# GEMM2's 16-token tile split along H by pick_n_split: the sm90 default of the grouped schedule before 2026-12-05,
# which the TP4 shard, whole experts and slot dedup still run (_DEFAULT_GEMM2, _GEMM2_BY_INTERMEDIATE) and the opt-in
# "gemm2_split_rule" restores for the TP8 shard
_GEMM2_16_BY_RULE = Gemm2Config(64, 16, 4, 3, merged=False)

_DEFAULT_GEMM2 = {
    # sm90, grouped: eight MMAs per tile (merged=False) beat one merged chain in the 2026-11-29 variants run
    # (T=512: 347 vs 378 us per layer): the merged operand raises registers from 126 to 161 per thread,
    # which halves the CTAs per SM for 8-warp tiles.
    "sm90": {
        ("slot", 16): Gemm2Config(64, 16, 4, 3),
        # 16-token blocks (T ~ 5-260 on the TP8 shard): 12 programs per block along H (8 N tiles each), 4 stages. The
        # split rule (pick_n_split: ~4 programs per SM) gave 3 at T = 64-256, ~1.2 waves of this 92-register tile (5
        # CTAs per SM), so most SMs idled through the last one. H100 sweep, 2026-12-05 (benchmarks/results/
        # moe_kernel_h100_sweep_gemm2_split_cce8db9.json, TP8 whole layer, us, split 3 s3 -> this): T=64 252.7 -> 233.2,
        # T=128 291.7 -> 262.8, T=256 308.4 -> 281.6; 3 stages at split 12 235.4 / 263.9 / 283.8. Same-run A/B
        # (moe_variants_h100_gemm2_split_9c6cd0d.json, former -> this): T=128 291.7 -> 261.6, T=256 306.9 -> 282.6,
        # all tokens on 8 experts T = 16-256 -11 to -26 %, T = 8-16 balanced within +1.2 % (improvements/19). The TP4
        # shard keeps the rule (T=64 444 -> 432 at split 12 but T=256 522 -> 532: _GEMM2_BY_INTERMEDIATE), as does
        # slot dedup ("dedup"). The former is opt-in "gemm2_split_rule".
        ("grouped", 16): Gemm2Config(64, 16, 4, 4, n_split=12, merged=False),
        ("dedup", 16): _GEMM2_16_BY_RULE,
        # 4-warp 64x32 tiles, 6 programs per block along H (each walks as many N tiles as the former 128x32 8-warp
        # tiles split 3 ways, opt-in "gemm2_128x32", over half the rows): found by the 2026-12-03 sweeps (a
        # 128-register cap that does not bind, moe_kernel_h200_sweep_caps_08c041b.json), measured uncapped in the
        # same-run A/B (moe_variants_h200_caps_8e79e8f.json, TP8 whole layer): T=512 294.2 / 297.2 vs 302.4 us,
        # T=1024 431.5 / 438.8 vs 446.1; TP4 (I = 512) keeps the former (602 vs 593 in the sweep:
        # _GEMM2_BY_INTERMEDIATE)
        ("grouped", 32): Gemm2Config(64, 32, 4, 3, n_split=6, merged=False),
        # GEMM2 walks its own token blocks, any bm up to the work list's. 2026-12-02 prefill sweep
        # (benchmarks/results/moe_kernel_h200_prefill_sweep.json, TP8 whole layer): T=2048 32-token steps 816 us vs
        # 911 (128x64/8 warps/2 stages); T=4096 a 64x128 tile of 4 warps split 6 ways along H 1,203 us vs 1,306
        # (128x64/8 warps/3 stages, split 3), T=8192 2,083 vs 2,343. TP4 and whole experts: _GEMM2_BY_INTERMEDIATE.
        ("grouped", 64): Gemm2Config(128, 32, 8, 3, merged=False),
        ("grouped", 128): Gemm2Config(64, 128, 4, 3, n_split=6, merged=False),
    },
    # sm120: one MMA chain per tile (see GEMM2_CANDIDATES["sm120"]); picked on the H200 stand-in as GEMM1's above
    # (TP8, this tile alone, us): T=4 156.8 -> 155.2, T=16 141.0 -> 129.0, T=64 281.1 -> 250.2 (3 stages instead of
    # 2); T=512 500.4 -> 429.6, T=1024 780.9 -> 662.0, T=4096 4,619 -> 4,319 (4 warps instead of 8); with GEMM1's
    # tile T=4096 1,922. The 64-token entry is unmeasured.
    "sm120": {
        ("slot", 16): Gemm2Config(64, 16, 4, 2, merged=True),
        ("grouped", 16): Gemm2Config(64, 16, 4, 3, merged=True),
        ("grouped", 32): Gemm2Config(64, 32, 4, 3, merged=True),
        ("grouped", 64): Gemm2Config(64, 32, 4, 3, merged=True),
        ("grouped", 128): Gemm2Config(64, 32, 4, 3, merged=True),
    },
}
_DEFAULT_GEMM2["sm100"] = _DEFAULT_GEMM2["sm90"]
_DEFAULT_GEMM2["sm80"] = _DEFAULT_GEMM2["sm120"]

# The sm_120 (and sm80) tables before the H200 stand-in picked the ones above (2026-12-04): chosen to fit 99 KB, never
# timed anywhere. Opt-in "sm120_former", so that a run on an SM120 (glm5-fp4 selftest) can time both.
_FORMER_GEMM1 = {"sm120": {
    ("slot", 16): Gemm1Config(16, 16, 256, 4, 3),
    ("grouped", 16): Gemm1Config(64, 16, 128, 4, 3),
    ("grouped", 32): Gemm1Config(64, 32, 128, 4, 3),
    ("grouped", 64): Gemm1Config(32, 64, 128, 8, 2),
    ("grouped", 128): Gemm1Config(32, 64, 128, 8, 2),
}}
_FORMER_GEMM2 = {"sm120": {
    ("slot", 16): Gemm2Config(64, 16, 4, 2, merged=True),
    ("grouped", 16): Gemm2Config(64, 16, 4, 2, merged=True),
    ("grouped", 32): Gemm2Config(64, 32, 8, 2, merged=True),
    ("grouped", 64): Gemm2Config(64, 32, 8, 2, merged=True),
    ("grouped", 128): Gemm2Config(64, 32, 8, 2, merged=True),
}}
_FORMER_GEMM1["sm80"], _FORMER_GEMM2["sm80"] = _FORMER_GEMM1["sm120"], _FORMER_GEMM2["sm120"]

# GEMM2 where the expert's intermediate size I (GEMM2's K) changes the best tile: (above, up to, table) for I in
# (above, up to] (None: no upper bound); keys a table lacks, and sizes no range covers (the TP8 shard, I = 256, on
# which _DEFAULT_GEMM2 is tuned), use _DEFAULT_GEMM2.
_GEMM2_BY_INTERMEDIATE = {
    "sm90": [
        # the TP4 shard: 8-warp 128x64 tiles in 3 stages beat the TP8 shard's prefill picks (2026-12-02 sweep,
        # benchmarks/results/moe_kernel_h200_prefill_sweep_tp4.json, whole layer: T=2048 1,338 us vs 1,444 for
        # 32-token steps, T=4096 2,202 vs 2,250 for the 64x128 tile); 32-token blocks keep the shards' former
        # 128x32 tile (the TP8 shard's 64x32 one lost here: 602 vs 593 us at T=512, 2026-12-03 sweep)
        (256, GEMM2_MAX_K_CHUNK, {("grouped", 16): _GEMM2_16_BY_RULE,
                                  ("grouped", 32): Gemm2Config(128, 32, 8, 3, merged=False),
                                  ("grouped", 64): Gemm2Config(128, 64, 8, 3, merged=False),
                                  ("grouped", 128): Gemm2Config(128, 64, 8, 3, merged=False)}),
        # whole experts (TP1, the EP layouts): the shards' prefill tiles lose (moe_kernel_h200_prefill_sweep_tp1.json,
        # TP1 T=2048: 32-token steps 5,846 us vs 5,538; the 64x128 tiles do not fit shared memory at I = 2048): the
        # former defaults, in the 2 stages that fit at I = 2048 (the 128-token entry said 3, which plan() cut to 2);
        # 32-token blocks keep the shards' former 128x32 tile (3 stages fit: the 64x32 one is unmeasured here)
        (GEMM2_MAX_K_CHUNK, None, {("grouped", 16): _GEMM2_16_BY_RULE,
                                   ("grouped", 32): Gemm2Config(128, 32, 8, 3, merged=False),
                                   ("grouped", 64): Gemm2Config(128, 64, 8, 2, merged=False),
                                   ("grouped", 128): Gemm2Config(128, 64, 8, 2, merged=False)}),
    ],
    # sm120 whole experts: K in 512-wide chunks, whose merged 64-row decoded tile leaves no registers to spare: 64x16
    # in 4 warps spills 32-64 B, in 8 warps 8-20 B in the slot-dedup form; 64x32 in 8 warps takes 255 registers and
    # spills 68 B at N_SPLIT 4 (Triton 3.8 and 3.9 alike). 32-row tiles in 8 warps: 121-180 registers, no spill
    # (AOT, 2026-12-03: the compile matrix). Unmeasured on an SM120 GPU.
    "sm120": [(GEMM2_MAX_K_CHUNK, None, {("grouped", 16): Gemm2Config(32, 16, 8, 3, merged=True),
                                         ("grouped", 32): Gemm2Config(32, 32, 8, 2, merged=True),
                                         ("grouped", 64): Gemm2Config(32, 32, 8, 2, merged=True),
                                         ("grouped", 128): Gemm2Config(32, 32, 8, 2, merged=True)})],
}
_GEMM2_BY_INTERMEDIATE["sm100"] = _GEMM2_BY_INTERMEDIATE["sm90"]
_GEMM2_BY_INTERMEDIATE["sm80"] = _GEMM2_BY_INTERMEDIATE["sm120"]  # as its other tables


def _gemm2_override(arch: str, intermediate: int, key: tuple) -> Gemm2Config | None:
    """The intermediate-size-specific GEMM2 default for ``key``, if any (see _GEMM2_BY_INTERMEDIATE)."""
    for above, up_to, table in _GEMM2_BY_INTERMEDIATE.get(arch, []):
        if intermediate > above and (up_to is None or intermediate <= up_to):
            return table.get(key)
    return None


# Grouped schedule: the routing counted and placed by many programs (Plan.parallel_align) from this many tokens
# on. H200, 2026-12-02 (benchmarks/results/moe_variants_h200_prefill.json, TP8, us per layer, serial -> parallel):
# T=2048 balanced 775.4 -> 766.3, same_k 555.1 -> 541.0; T=4096 1,211.7 -> 1,187.0, 892.4 -> 867.0; T=8192
# 2,104.2 -> 2,058.8, 1,824.6 -> 1,817.7 (the serial align took 181 us of T=8192's 2,071). At T=512 the two were
# within noise (moe_variants_h200.json); whole experts (TP1) within noise at T=2048 and 8192 either way
# (moe_variants_h200_prefill_tp1.json); TP4 0.2-0.5 % faster at T=2048 and 8192 (moe_variants_h200_prefill_tp4.json,
# where the 2026-12-01 run, older tiles, had it 4 % slower at T=8192: not reproduced). The align's work does not
# depend on the expert shard at all. From T=1024 since 2026-12-03 (moe_variants_h200_palign_813c60f.json, TP8, us per
# layer, serial twice -> parallel): T=1024 balanced 437.4 / 436.3 -> 431.4, same_k 303.4 / 299.3 -> 299.1; T=768
# balanced 358.7 / 362.3 -> 354.5 but same_k 239.3 / 238.4 -> 241.3, so not below 1024 (the serial align took 26.6 us
# of T=1024's ~430 in ncu, 2026-12-03). A second run (moe_variants_h200_serial_align_9e539f4.json, parallel twice /
# serial, TP8 and TP4 at T=1024 and 1536) had the two within its noise (the default's two runs differ by up to 19 us):
# TP8 T=1024 balanced 431.4 / 441.0 vs 436.1, TP4 T=1024 balanced 869.1 / 887.9 vs 901.1, same_k either way.
PARALLEL_ALIGN_MIN_TOKENS = 1024


# The warp-specialised Gluon GEMM1 (kernels/gluon_moe.py): its producer copies a work item's gathered activation
# rows in WS_X_PASSES cp.async passes per K tile (it holds each pass's row pointers), each of at least the 8 rows of the
# activation tile's 128-byte swizzle pattern (a shared-memory slice keeps it whole). 8 rows is the only pass height a
# GPU has verified: one pass of 16 rows (16-token blocks) gave wrong act rows in write-up 30's probe
# (benchmarks/h200/ws16_probe.py), two passes of 8 were right; launch._check_ws refuses tiles with other heights.
WS_X_PASSES = 4
WS_X_ROWS_MIN = 8
WS_X_ROWS_VERIFIED = 8


def ws_x_pass_rows(g1: Gemm1Config) -> int:
    """Activation rows per cp.async pass of the Gluon GEMM1 for tile ``g1``'s token block."""
    return max(WS_X_ROWS_MIN, g1.bm // WS_X_PASSES)


# Experts receiving at least one token under uniform random routing (the one home of the formula: spec.py).
expected_active_experts = expected_distinct_experts


# (largest mean tokens per active expert, bm): a block should hold most of an expert's tokens (the maximum
# over 256 experts runs near twice the mean at decode sizes) without paying for a wide MMA. From the H200
# sweep: bm 16 up to T=256 (8 per expert), 32 at T=512-1024 (16-32), 128 at T=4096 (128).
BM_BY_TOKENS_PER_EXPERT = ((8.5, 16), (40.0, 32), (80.0, 64))


def pick_bm(tokens: int, num_experts: int, top_k: int) -> int:
    """Tokens per MMA from the expected tokens per active expert."""
    per_expert = tokens * top_k / max(expected_active_experts(tokens, num_experts, top_k), 1.0)
    for limit, bm in BM_BY_TOKENS_PER_EXPERT:
        if per_expert <= limit:
            return bm
    return 128


def pick_n_split(n_tiles: int, programs_per_split: float, sm_count: int, waves: float = 4.0) -> int:
    """Smallest divisor of ``n_tiles`` giving at least ``waves`` programs per SM (or all tiles split)."""
    want = waves * sm_count / max(programs_per_split, 1.0)
    for d in range(1, n_tiles + 1):
        if n_tiles % d == 0 and d >= want:
            return d
    return n_tiles


def split_k_fits(split: int, hidden: int, bk: int, slot: bool = False) -> bool:
    """Whether GEMM1 can take K (= H) in ``split`` ranges: at most SPLIT_K_MAX (``slot`` schedule:
    SLOT_SPLIT_K_MAX), each of whole ``bk``-wide tiles."""
    return split <= (SLOT_SPLIT_K_MAX if slot else SPLIT_K_MAX) and hidden % (split * bk) == 0


def pick_split_k(programs: int, k_tiles: int, sm_count: int, waves: float = 8.0, most: int = SPLIT_K_MAX) -> int:
    """Largest power of two <= ``most`` dividing ``k_tiles`` that keeps programs <= ``waves`` per SM.

    Tiny batches have a handful of experts: (N tiles x slots) programs each walking all of K serially leave
    most SMs idle and every program latency-bound; split K until the GPU holds a few programs per SM.
    H200 variants run (2026-11-29, whole layer): TP8 T=1 31 us with 4 splits vs 55 us unsplit; TP4 T=1 49
    vs 61; at T=4 (256-512 programs) 2-4 splits are within 3 % of none (TP8) or 2 % better (TP4).
    """
    s = 1
    while s * 2 <= most and k_tiles % (s * 2) == 0 and programs * s * 2 <= waves * sm_count:
        s *= 2
    return s


def _largest_split(k_tiles: int, most: int, programs: int, cap: int) -> int:
    """Largest divisor of ``k_tiles`` (at most ``most``) that keeps ``programs`` x split within ``cap``; 1 where
    none does."""
    return max((s for s in range(1, min(k_tiles, most) + 1) if k_tiles % s == 0 and programs * s <= cap), default=1)


def pick_slot_split_k(programs: int, k_tiles: int, sm_count: int) -> int:
    """Largest divisor of ``k_tiles`` (at most SLOT_SPLIT_K_MAX) that keeps the slot GEMM1's programs within
    SLOT_SPLIT_PROGRAMS_PER_SM per SM; 1 where even one range per program exceeds that."""
    return _largest_split(k_tiles, SLOT_SPLIT_K_MAX, programs, SLOT_SPLIT_PROGRAMS_PER_SM * sm_count)


def pick_grouped_split_k(top_k: int, n_tiles: int, hidden: int, bk: int, sm_count: int) -> int:
    """GEMM1 split-K of the grouped schedule (W4A16, T <= GROUPED_SPLIT_K_MAX_TOKENS), sized for the skewed case.

    All tokens on ``top_k`` experts make a work list of ``top_k`` blocks x ``n_tiles`` (I / BN) programs; where
    that does not fill the SMs, split K (powers of two up to SPLIT_K_MAX) until it does. H200, 2026-12-02
    (benchmarks/results/moe_variants_h200_dedup_split.json, us per layer, unsplit -> 4 splits): the TP8 shard (32
    programs) same_k T=8 56.1 -> 37.6, T=16 81.1 -> 46.4, T=32 74.6 -> 56.4, T=64 99.2 -> 78.1; balanced T=8
    73.3 -> 77.1, T=16 125.3 -> 117.3, T=32 154.5 -> 167.0, T=64 225.0 -> 231.4 (still 1.19-1.41x Marlin's).
    Whole experts (TP1: 256 programs) lost 4-7 % balanced and gained <= 5 % skewed: not split.
    """
    s = 1
    while s < SPLIT_K_MAX and top_k * n_tiles * s < sm_count and split_k_fits(s * 2, hidden, bk):
        s *= 2
    return s


def plan(
    arch: str,
    tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    sm_count: int | None = None,
    schedule: str | None = None,
    gemm1: Gemm1Config | None = None,
    gemm2: Gemm2Config | None = None,
    global_experts: int | None = None,
    form: str | None = None,
    mode: str = "w4a16",
) -> Plan:
    """The launch plan for one call shape; explicit ``schedule``/``gemm1``/``gemm2`` override the defaults.

    ``form``: one of :data:`OPT_IN` (an alternative to the default form), applied where it serves this call (see
    :func:`opt_in_serves`; elsewhere the plan is the default one). slot_dedup's GEMM2 is split along H for the
    experts a call touches rather than per token. ``mode``: the grouped split-K serves W4A16 only.

    ``global_experts`` (expert parallelism): the router's expert count when this GPU holds only
    ``num_experts`` of them; the block size then follows the tokens a local expert really gets
    (T k / E_global), not T k / E_local -- 8x too many at EP8.
    """
    if form is not None and form not in OPT_IN:
        raise Glm5Fp4Error(f"unknown MoE plan form {form!r}; choose one of {sorted(OPT_IN)}")
    # a form changes nothing on an arch it does not serve (its rules, e.g. an arch's former tables, may not exist there)
    serves_arch = form is not None and (OPT_IN[form].archs is None or arch in OPT_IN[form].archs)
    change = OPT_IN[form].change if serves_arch else {}
    sm_count = sm_count or sm_count_guess(arch)
    if schedule is None:
        schedule = "slot" if tokens <= SLOT_MAX_TOKENS.get(arch, 4) else "grouped"
    routed = tokens if not global_experts else tokens * num_experts / global_experts  # tokens that stay here
    bm = 16 if schedule == "slot" else pick_bm(routed, num_experts, top_k)
    # a form that asks for an arch's former tables (PLAN_RULES "tables")
    tables1, tables2 = (_FORMER_GEMM1, _FORMER_GEMM2) if change.get("tables") == "former" else (_DEFAULT_GEMM1,
                                                                                                _DEFAULT_GEMM2)
    w4a4_tile = (_W4A4_GEMM1.get(arch, {}).get((schedule, bm)) if mode == "w4a4" and tables1 is _DEFAULT_GEMM1
                 else None)
    g1 = gemm1 or w4a4_tile or tables1[arch][(schedule, bm)]
    if change.get("gemm1_stacked") and schedule == "grouped" and mode == "w4a16" and not g1.tma:  # (PLAN_RULES)
        g1 = dataclasses.replace(g1, stacked=True)
    # A form that sets slot_dedup decides it here: GEMM2's config, split and unroll below follow from it.
    slot_dedup = schedule == "slot" and change.get("slot_dedup", tokens >= SLOT_DEDUP_MIN_TOKENS)
    # slot dedup's GEMM2 is the grouped kernel: its grouped config (the slot one's merged operand spills there
    # on sm_90: 255 registers, 36 B, at I = 512 and whole experts), or a table's own "dedup" entry
    g2_key = (("dedup" if ("dedup", 16) in tables2[arch] else "grouped"), 16) if slot_dedup else (schedule, bm)
    # so does one that sets gemm2_split_slots (its tile, and no unrolled k experts, follow), or the split-K rule
    # (PLAN_RULES). (Read before opt_in_serves below: the forms that set them serve only the slot calls without
    # dedup, T < SLOT_DEDUP_MIN_TOKENS, where these decisions are made.)
    split_slots = schedule == "slot" and not slot_dedup and change.get(
        "gemm2_split_slots", arch in SPLIT_SLOTS_ARCHS and tokens < SLOT_DEDUP_MIN_TOKENS)
    # (likewise: GEMM1's split below follows from it)
    fused_finalize = slot_dedup and change.get("dedup_fused_finalize", False)
    g2 = (gemm2 or (split_slots and SPLIT_SLOTS_GEMM2.get(arch)) or _gemm2_override(arch, intermediate, g2_key)
          or tables2[arch][g2_key])
    # Explicit configs are what the sweep and the compile matrix ask for: kept as given (a misfit then fails
    # there, by name); the defaults must fit any shape the backend serves.
    fg1, fg2 = fit_shared_memory(arch, g1, g2, intermediate)
    g1, g2 = (g1 if gemm1 else fg1), (g2 if gemm2 else fg2)
    # Tiles must divide the problem; shrink for small test shapes.
    while intermediate % g1.bn and g1.bn > 16:
        g1 = dataclasses.replace(g1, bn=g1.bn // 2)
    while hidden % g1.bk and g1.bk > 128:
        g1 = dataclasses.replace(g1, bk=g1.bk // 2)
    while hidden % g2.bn and g2.bn > 16:
        g2 = dataclasses.replace(g2, bn=g2.bn // 2)
    n_tiles = hidden // g2.bn
    if schedule == "slot" and not slot_dedup:
        rule_split = pick_n_split(n_tiles, tokens, sm_count)
    else:
        rule_split = pick_n_split(n_tiles, min(expected_active_experts(tokens, num_experts, top_k), tokens * top_k),
                                  sm_count)
    n_split = g2.n_split if g2.n_split is not None and n_tiles % g2.n_split == 0 else rule_split
    split_k = 1
    unroll = False
    # GEMM2 split by slots on a wide-split arch: GEMM1's K in as many ranges as keep SLOT_SPLIT_PROGRAMS_PER_SM
    # programs per SM, reduced by its last program, launched with PDL where GEMM2 takes K whole (its weight rows then
    # prefetched before it waits; whole experts lost with PDL: TP1 T=1 94.2 vs 78.3 us, 2c13851) (the "pow2" rule:
    # the former picks)
    spread = ((split_slots or fused_finalize) and arch in SLOT_WIDE_SPLIT_ARCHS
              and change.get("split_k_rule", "spread") == "spread")
    few = (not spread and schedule == "slot" and not slot_dedup and tokens <= SLOT_WIDE_SPLIT_MAX_TOKENS
           and arch in SLOT_WIDE_SPLIT_ARCHS)
    if spread:
        split_k = pick_slot_split_k((intermediate // g1.bn) * tokens * top_k, hidden // g1.bk, sm_count)
    elif schedule == "slot" and tokens <= SPLIT_K_MAX_TOKENS:
        split_k = pick_split_k((intermediate // g1.bn) * tokens * top_k, hidden // g1.bk, sm_count,
                               most=SLOT_SPLIT_K_PICK if few else SPLIT_K_MAX)
    elif schedule == "grouped" and mode == "w4a16" and tokens <= GROUPED_SPLIT_K_MAX_TOKENS:
        split_k = pick_grouped_split_k(top_k, intermediate // g1.bn, hidden, g1.bk, sm_count)
    split_cap = split_floor = 0
    dedup_rule = change.get("dedup_split", "runtime")
    if slot_dedup and not fused_finalize and arch in DEDUP_RUNTIME_SPLIT_ARCHS and dedup_rule != "fixed":
        cap = SLOT_SPLIT_PROGRAMS_PER_SM * sm_count
        # only where some routing can raise it (whole experts: even k groups fill the GPU at the plan's split)
        if dedup_split_max(hidden, g1.bk, intermediate // g1.bn, top_k, cap) > split_k:
            split_cap = cap
            # ... and lower it, to fit one wave, down to the fewest K ranges of at most DEDUP_SPLIT_K_TILES tiles
            # (not "raise", the former rule)
            floor = dedup_split_floor(hidden, g1.bk)
            split_floor = floor if dedup_rule != "raise" and floor < split_k else 0
    if schedule == "slot" and not split_slots:
        unroll = gemm2_slot_unrolls(arch, g2, intermediate, top_k)
    p = Plan(schedule, g1, g2, n_split, gemm1_split_k=split_k, gemm2_unroll=unroll and not slot_dedup,
             gemm2_split_slots=split_slots, dedup_fused_finalize=fused_finalize,
             gemm1_fused_reduce=(few or spread) and split_k > 1,
             slot_dedup=slot_dedup, x_natural=slot_dedup and arch in X_NATURAL_ARCHS, gemm1_split_cap=split_cap,
             gemm1_compact_grid=split_cap > 0, gemm1_split_floor=split_floor,
             parallel_align=schedule == "grouped" and tokens >= PARALLEL_ALIGN_MIN_TOKENS,
             pdl=arch in PDL_ARCHS and (tokens >= PDL_MIN_TOKENS
                                        or (spread and gemm2_k_chunk(intermediate) == intermediate)))
    if serves_arch and opt_in_serves(form, p, tokens, hidden, mode, intermediate):
        p = dataclasses.replace(p, **{k: v for k, v in change.items() if k not in PLAN_RULES})
        if change.get("gemm2_split") == "rule":  # (PLAN_RULES) GEMM2's split by pick_n_split, not its config's
            p = dataclasses.replace(p, gemm2_n_split=rule_split)
    return p


# The slot GEMM1 loads x in natural K order (Plan.x_natural) where slot dedup runs, on these archs. H100, 2026-12-06,
# same run (benchmarks/results/moe_variants_h100_x_natural_*_1bb0455.json, us per layer, gathered -> natural): TP8
# T=3 36.0 -> 35.4 balanced, 26.5 -> 25.7 same_k, 32.5 -> 31.7 zipf1.2; T=4 47.9 -> 46.7, 29.1 -> 28.0, 33.8 -> 33.0;
# TP4 T=4 81.7 -> 79.4, 35.4 -> 34.4; TP1 T=4 263.2 -> 257.6, 100.7 -> 96.0. Without dedup (T <= 2, GEMM1 split to
# 2-8 K tiles a program with its reduce fused) it lost everywhere but one noisy row: TP8 T=1 18.1 -> 18.6, T=2
# 26.0 -> 26.5, TP4 T=2 same_k 39.2 -> 40.9 (opt-in "x_natural"). Unmeasured on sm_120 (it keeps the gather).
X_NATURAL_ARCHS = ("sm90", "sm100")


# Slot dedup's GEMM1 split-K picked from the routing (Plan.gemm1_split_cap) on these archs, at most this many ranges.
# The best fixed split depends on the routing, which no plan knows (H100, 2026-12-06, TP8 sweep of the fixed splits,
# benchmarks/results/moe_kernel_h100_sweep_t34_splitk_*_584e6b1.json, us per layer, split 4 (the former) / best):
# T=4 balanced (26 groups) 47.8 / 43.8 at 6, all tokens on 8 experts 28.0 / 22.2 at 12, heavy-tailed (21 groups) 35.8
# at 4 (6: 39.6); T=3 balanced 33.2 at 4, on 8 experts 25.8 / 20.8 at 12. The rule of T <= 2 (pick_slot_split_k: as
# many ranges as keep about SLOT_SPLIT_PROGRAMS_PER_SM programs per SM) picks 4, 12, 4, 4, 12 for these, 3 for T=4
# balanced; split 24 lost everywhere (too many partial sums), hence the cap. It is raised from the plan's where few
# groups leave room, and lowered only into one wave, down to DEDUP_SPLIT_K_TILES (below): the one-wave rule's split of
# 1 at TP4 T=4 balanced cost +17 % (90.2 against 76.8 us, 9eff0ad). The rule and its measurements: improvements/23, 24.
DEDUP_RUNTIME_SPLIT_ARCHS = ("sm90", "sm100")
DEDUP_SPLIT_K_MAX = 12
# Where even the plan's split leaves more programs than one wave holds, the pick lowers it to the largest split that
# fits one wave, but never to programs of more than this many K tiles (dedup_split_floor). A few programs past a wave
# are a whole extra round: H100, 2026-12-06, same run (benchmarks/results/moe_variants_h100_dedup_floor_*_4d7bc51.json,
# us per layer), TP8 T=4 balanced (26 groups: split 4 = 416 programs on 396 slots) 46.9 raised only, 41.8 lowered to
# 3 (312 programs); where no split from the floor fits one wave, lowering lost: TP4 T=3 balanced (~24 groups x 8 N
# tiles) 60.4 at 4 against 64.7 at 3 (1.8 against 1.4 waves), TP4 T=3 / 4 heavy-tailed 52.3 / 62.3 against 56.9 /
# 67.0; and a split of 1 (24 K tiles a program) cost TP4 T=4 balanced +17 % (improvements/23).
DEDUP_SPLIT_K_TILES = 8


def dedup_split_floor(hidden: int, bk: int) -> int:
    """The least split the slot dedup's GEMM1 may lower to at run time (to fit one wave): the fewest K ranges (a
    divisor of the K tiles, at most DEDUP_SPLIT_K_MAX) of at most DEDUP_SPLIT_K_TILES tiles each."""
    k_tiles = hidden // bk
    return min((s for s in range(1, min(k_tiles, DEDUP_SPLIT_K_MAX) + 1)
                if k_tiles % s == 0 and k_tiles // s <= DEDUP_SPLIT_K_TILES), default=min(k_tiles, DEDUP_SPLIT_K_MAX))


def dedup_split_max(hidden: int, bk: int, n_tiles: int, top_k: int, cap: int) -> int:
    """The largest split the slot dedup's GEMM1 may pick at run time (the grid's K dimension): the largest divisor of
    the K tiles, at most DEDUP_SPLIT_K_MAX, that the fewest groups a call can have (top_k: every token's k experts
    are distinct) keep within ``cap`` programs (1 where none does)."""
    return _largest_split(hidden // bk, DEDUP_SPLIT_K_MAX, top_k * n_tiles, cap)


# Keys of an OptIn's change that pick a rule inside plan() rather than set a Plan field.
PLAN_RULES = ("split_k_rule", "tables", "gemm1_stacked", "gemm2_split", "dedup_split")


@dataclass(frozen=True)
class OptIn:
    """A plan form other than the default (one not yet a default, or a former default kept to measure the
    default against): what it changes, where it can run, what it is for."""

    change: dict
    schedule: str | tuple[str, ...]  # the schedule(s) it modifies
    max_tokens: int | None  # largest T it serves (None: the schedule's range)
    modes: tuple[str, ...]
    needs_split_k: bool = False  # modifies GEMM1's split-K (the plan must already split K)
    compile_tokens: tuple[int, ...] = ()  # batch sizes the compile matrix builds it for
    purpose: str = ""
    archs: tuple[str, ...] | None = None  # where it serves (None: every arch); a former tile default is per arch
    bm: int | None = None  # the token block it serves at (None: any): a former tile default is per block
    max_intermediate: int | None = None  # the largest expert intermediate size it serves (None: any)


# The one list of alternative forms: benchmarks/moe_variants.py times each against the default in the same run,
# the compile matrix builds each for every arch, tests/gpu checks each against the reference. One becomes a
# default when the H200 says so; the form it replaces stays here while the choice rests on a trade-off.
OPT_IN: dict[str, OptIn] = {
    "fused_reduce": OptIn(dict(gemm1_fused_reduce=True), "slot", None, ("w4a16", "w4a4"), needs_split_k=True,
                          compile_tokens=(4,), purpose="split-K partials reduced by GEMM1's last program (2 launches; "
                                                       "the default at T <= 2 on sm_90/sm_100)"),
    "split_reduce": OptIn(dict(gemm1_fused_reduce=False), "slot", SLOT_WIDE_SPLIT_MAX_TOKENS, ("w4a16", "w4a4"),
                          needs_split_k=True, compile_tokens=(1,),
                          purpose="the default's split-K partials added by a reduce launch instead of GEMM1's last "
                                  "program (2026-12-02, the former T=1 plan: 23.7 against the fused 21.5 us)"),
    "slot_split4": OptIn(dict(gemm1_split_k=4, gemm1_fused_reduce=False, gemm2_split_slots=False, pdl=False,
                              split_k_rule="pow2"), "slot", SLOT_WIDE_SPLIT_MAX_TOKENS,
                         ("w4a16", "w4a4"), needs_split_k=True, compile_tokens=(1,),
                         purpose="GEMM1 in 4 K ranges + a reduce launch, GEMM2 one program per token (the T=1 default "
                                 "before 2026-12-02: 24.8 us against 21.5)"),
    "slot_dedup": OptIn(dict(slot_dedup=True), "slot", SLOT_DEDUP_MIN_TOKENS - 1, ("w4a16", "w4a4"),
                        compile_tokens=(2,), purpose="one program group per expert below SLOT_DEDUP_MIN_TOKENS"),
    "dedup_by_arrival": OptIn(dict(slot_dedup=True, dedup_fused_finalize=True), "slot", None, ("w4a16", "w4a4"),
                              compile_tokens=(2, 4), archs=SLOT_WIDE_SPLIT_ARCHS,
                              purpose="slot dedup with the finalize fused into GEMM2 by arrival counters and GEMM1's K "
                                      "split to ~3 programs per SM, its reduce fused: 2 launches (H100 2026-12-06: TP8 T=4 "
                                      "47.0 / 34.7 / 44.0 us balanced / same_k / zipf1.2 against the default's 48.8 / "
                                      "30.0 / 36.6; TP4 T=4 +15-89 %; TP1 T=2 same_k 101 against 123)"),
    "per_slot_split": OptIn(dict(slot_dedup=False, gemm2_split_slots=True), "slot", None, ("w4a16", "w4a4"),
                            compile_tokens=(4,), archs=SLOT_WIDE_SPLIT_ARCHS,
                            purpose="T = 3-4 as T <= 2 runs: no dedup, GEMM2 split by slots, GEMM1's K split to ~3 "
                                    "programs per SM, its reduce fused: 2 launches, each token's experts read for it "
                                    "(H100 2026-12-06: TP8 T=4 44.3 / 38.7 / 41.7 us balanced / same_k / zipf1.2 "
                                    "against the default's 48.8 / 30.0 / 36.6; TP4 T=4 same_k 2.2x slower)"),
    "finalize_4096": OptIn(dict(finalize_block=4096), "slot", None, ("w4a16", "w4a4"), compile_tokens=(4,),
                           purpose="slot dedup's finalize in 4096-wide programs (the default before 2026-12-06: 8 "
                                   "programs at T=4, their row loads one after another; H100: TP8 T=3/4 balanced "
                                   "40.2/55.5 us against 33.9/48.8)"),
    "per_slot": OptIn(dict(slot_dedup=False), "slot", None, ("w4a16", "w4a4"), compile_tokens=(4,),
                      purpose="one program group per slot (the default before 2026-12-02; costs skewed T=3-4 up to 2.7x)"),
    "parallel_align": OptIn(dict(parallel_align=True), "grouped", None, ("w4a16", "w4a4"), compile_tokens=(512,),
                            purpose="routing counted and placed by many programs (the default from "
                                    "PARALLEL_ALIGN_MIN_TOKENS on)"),
    "serial_align": OptIn(dict(parallel_align=False), "grouped", None, ("w4a16", "w4a4"), compile_tokens=(4096,),
                          purpose="routing counted and placed by one program (the default below "
                                  "PARALLEL_ALIGN_MIN_TOKENS; 0-3 % slower at T = 1,024-8,192)"),
    "grouped_split2": OptIn(dict(gemm1_split_k=2), "grouped", GROUPED_SPLIT_K_MAX_TOKENS, ("w4a16",),
                            compile_tokens=(16, 64), purpose="GEMM1 along K in 2 ranges (short work lists)"),
    "pdl": OptIn(dict(pdl=True), "slot", PDL_MIN_TOKENS - 1, ("w4a16", "w4a4"), compile_tokens=(1,),
                 purpose="programmatic dependent launch below PDL_MIN_TOKENS where the default launches plainly "
                         "(whole experts: TP1 T=1 95.2 against 78.2 us; sm_120)"),
    "split_slots": OptIn(dict(gemm2_split_slots=True), "slot", SLOT_DEDUP_MIN_TOKENS - 1, ("w4a16", "w4a4"),
                         compile_tokens=(1, 2), purpose="slot GEMM2 with one program per slot, the k rows added by the "
                                                        "last to arrive (the default on SPLIT_SLOTS_ARCHS)"),
    "slot_split_pow2": OptIn(dict(split_k_rule="pow2", pdl=False), "slot", SLOT_DEDUP_MIN_TOKENS - 1,
                             ("w4a16", "w4a4"), compile_tokens=(1, 2), archs=SLOT_WIDE_SPLIT_ARCHS,
                             purpose="slot GEMM1 split in powers of two (8 fused at T=1, 4 + a reduce launch at T=2), "
                                     "no PDL (the sm90 picks before 2026-12-03)"),
    "one_program_gemm2": OptIn(dict(gemm2_split_slots=False), "slot", SLOT_DEDUP_MIN_TOKENS - 1, ("w4a16", "w4a4"),
                               compile_tokens=(1,), purpose="slot GEMM2 one program per (N range, token) walking the "
                                                            "token's k experts (the sm90 default before 2026-12-03)"),
    "nopdl": OptIn(dict(pdl=False), ("slot", "grouped"), None, ("w4a16", "w4a4"), compile_tokens=(4, 64),
                   purpose="plain stream-ordered launches (the default before 2026-12-02; 0-15 % slower at T = 4-512)"),
    "slot_stages4": OptIn(dict(gemm1=Gemm1Config(64, 16, 256, 4, 4)), "slot", None, ("w4a16", "w4a4"),
                          compile_tokens=(4,), archs=("sm90", "sm100"), bm=16,
                          purpose="slot GEMM1 in 4 stages, uncapped (the sm90 default before 2026-12-03)"),
    "gemm2_128x32": OptIn(dict(gemm2=Gemm2Config(128, 32, 8, 3, merged=False), gemm2_n_split=3), "grouped", None,
                          ("w4a16", "w4a4"), compile_tokens=(512,), archs=("sm90", "sm100"), bm=32, max_intermediate=256,
                          purpose="GEMM2 in 8-warp 128x32 tiles split 3 ways (the sm90 default for 32-token blocks "
                                  "before 2026-12-03)"),
    "sm120_former": OptIn(dict(tables="former", gemm2_split_slots=False), ("slot", "grouped"), None, ("w4a16", "w4a4"),
                          compile_tokens=(1, 4, 64, 512, 4096), archs=("sm120", "sm80"),
                          purpose="sm_120's tiles and one-program slot GEMM2 before the H200 stand-in picked the "
                                  "defaults (2026-12-04; never timed on an SM120: selftest times both there)"),
    "stacked": OptIn(dict(gemm1_stacked=True), "grouped", 2048, ("w4a16",), compile_tokens=(64,),
                     archs=("sm90", "sm100"),
                     purpose="GEMM1's gate and up rows as one tile, its wgmmas alternating between two accumulators "
                             "(Gemm1Config.stacked), in the default tile where it is not stacked, up to the 64-token "
                             "blocks (H200 2026-12-05, same run: TP8 T=16/64 +3-5 % balanced; the 32-token default is; "
                             "the 128-token prefill tile stacked was 2-7 % slower and spills under Triton 3.8)"),
    "gemm1_64x32x256": OptIn(dict(gemm1=Gemm1Config(64, 32, 256, 4, 3)), "grouped", None, ("w4a16", "w4a4"),
                             compile_tokens=(512,), archs=("sm90", "sm100"), bm=32,
                             purpose="GEMM1 in 64x32x256 tiles of gate rows then up rows, 3 stages (the sm90 default "
                                     "for 32-token blocks before 2026-12-05)"),
    "gemm2_split_rule": OptIn(dict(gemm2=_GEMM2_16_BY_RULE, gemm2_split="rule"), "grouped", None,
                              ("w4a16", "w4a4"), compile_tokens=(64,), archs=("sm90", "sm100"), bm=16,
                              max_intermediate=256,
                              purpose="GEMM2 of 16-token blocks in 3 stages, split along H by pick_n_split (the sm90 "
                                      "default before 2026-12-05)"),
    "x_natural": OptIn(dict(x_natural=True), "slot", SLOT_DEDUP_MIN_TOKENS - 1, ("w4a16", "w4a4"),
                       compile_tokens=(1, 2), archs=X_NATURAL_ARCHS,
                       purpose="the slot GEMM1 loads x in natural K order below slot dedup too (H100 2026-12-06: "
                               "TP8 T=1/2 +0.3-0.5 us, TP4 T=1/2 +0.6-1.7 us)"),
    "dedup_split_fixed": OptIn(dict(dedup_split="fixed"), "slot", None, ("w4a16", "w4a4"), compile_tokens=(4,),
                               archs=DEDUP_RUNTIME_SPLIT_ARCHS,
                               purpose="the slot dedup GEMM1's split-K fixed by the plan (pick_split_k: 4 at T = 3-4 "
                                       "on the TP8 shard), not picked from the routing"),
    "dedup_split_raise": OptIn(dict(dedup_split="raise"), "slot", None, ("w4a16", "w4a4"), compile_tokens=(4,),
                               archs=DEDUP_RUNTIME_SPLIT_ARCHS,
                               purpose="the slot dedup GEMM1's split picked from the routing but never below the "
                                       "plan's power of two (4 on the TP shards; the default before 2026-12-06)"),
    "dedup_grid_full": OptIn(dict(gemm1_compact_grid=False), "slot", None, ("w4a16", "w4a4"), compile_tokens=(4,),
                             archs=DEDUP_RUNTIME_SPLIT_ARCHS,
                             purpose="the slot dedup GEMM1 with the split picked at run time launches a program per "
                                     "(N tile, slot, K range of the largest split), most of them idle (the default "
                                     "before 2026-12-06)"),
    "x_gathered": OptIn(dict(x_natural=False), "slot", None, ("w4a16", "w4a4"), compile_tokens=(4,),
                        archs=X_NATURAL_ARCHS,
                        purpose="the slot dedup GEMM1 gathers x in merged K order, 2 bytes at a time (the default "
                                "before 2026-12-06: H100 TP8 T=3/4 +0.6-1.2 us, TP4 T=4 +1.0-2.3, TP1 T=4 +4.7-5.6)"),
    "gemm1_ws": OptIn(dict(gemm1=Gemm1Config(64, 32, 128, 4, 4, stacked=True, ws=True)), "grouped", None, ("w4a16",),
                      compile_tokens=(512,), archs=("sm90",), bm=32,
                      purpose="GEMM1 as the warp-specialised Gluon kernel (a producer warp keeps 4 K tiles of 128 in "
                              "flight; 32-token blocks; 4 or 6 stages alike on an H100)"),
    "gemm1_ws64": OptIn(dict(gemm1=Gemm1Config(64, 32, 64, 4, 8, maxnreg=80, stacked=True, ws=True)), "grouped", None,
                        ("w4a16",), compile_tokens=(512,), archs=("sm90",), bm=32,
                        purpose="gemm1_ws in K tiles of 64 with 8 in flight, registers for 3 CTAs per SM (12 consumer "
                                "warps instead of 8)"),
    "gemm1_ws16": OptIn(dict(gemm1=Gemm1Config(64, 16, 128, 4, 4, stacked=True, ws=True), gemm1_split_k=1),
                        "grouped", None, ("w4a16",), compile_tokens=(64,), archs=("sm90",), bm=16,
                        purpose="GEMM1 as the warp-specialised Gluon kernel for 16-token blocks, K unsplit"),
    "grouped_unsplit": OptIn(dict(gemm1_split_k=1), "grouped", GROUPED_SPLIT_K_MAX_TOKENS, ("w4a16",),
                             compile_tokens=(64,), purpose="GEMM1 walks all of K (the default before 2026-12-02; "
                                                           "3-8 % faster balanced at TP8 T=8/32/64, 1.3-1.75x slower skewed)"),
}


def opt_in_serves(form: str, p: Plan, tokens: int, hidden: int, mode: str | None = None,
                  intermediate: int | None = None) -> bool:
    """Whether opt-in ``form`` can modify plan ``p`` of a ``tokens`` call (in ``mode``, when given): its
    schedule, batch sizes, token block, intermediate size (when given), mode, and a split-K it sets must cut H into
    whole K tiles, a GEMM2 split it sets H into whole N tiles."""
    o = OPT_IN[form]
    if o.bm is not None and p.gemm1.bm != o.bm:
        return False
    if o.max_intermediate is not None and intermediate is not None and intermediate > o.max_intermediate:
        return False
    schedules = (o.schedule,) if isinstance(o.schedule, str) else o.schedule
    g2 = o.change.get("gemm2", p.gemm2)
    return (p.schedule in schedules and (o.max_tokens is None or tokens <= o.max_tokens)
            and (mode is None or mode in o.modes) and (not o.needs_split_k or p.gemm1_split_k > 1)
            # a finalize block matters only where the finalize adds slot dedup's k rows
            and ("finalize_block" not in o.change or (p.slot_dedup and not p.dedup_fused_finalize))
            and split_k_fits(o.change.get("gemm1_split_k", 1), hidden, p.gemm1.bk, p.schedule == "slot")
            and hidden % g2.bn == 0 and (hidden // g2.bn) % o.change.get("gemm2_n_split", p.gemm2_n_split) == 0)


def native_plan(arch: str, tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                sm_count: int | None = None) -> Plan:
    """The native FP4-MMA path's plan (SM100/SM120 W4A4, unverified): fixed tiles, GEMM2 split to fill the GPU."""
    if intermediate > GEMM2_MAX_K_CHUNK:
        # Its GEMM2 holds a whole [BN, I] FP4 tile: at I = 2048 that is 114,688 B on sm_120 (over 99 KB) and
        # does not lower on sm_100 (compile matrix, tp1 shape); the decoding kernels walk K in chunks instead.
        raise Glm5Fp4Error(
            f"the native FP4-MMA path serves expert shards with intermediate size <= {GEMM2_MAX_K_CHUNK} (TP4/TP8); "
            f"got {intermediate} (whole experts: TP1 or expert parallelism). Prepare the experts with the default layout (decoding kernels)."
        )
    sm_count = sm_count or sm_count_guess(arch)
    g1, g2 = NATIVE_GEMM1[arch], NATIVE_GEMM2[arch]
    active = min(expected_active_experts(tokens, num_experts, top_k), tokens * top_k)
    return Plan("native", g1, g2, pick_n_split(hidden // g2.bn, active, sm_count), prep_x=False)


def all_configs(arch: str) -> tuple[list[Gemm1Config], list[Gemm2Config]]:
    """Every configuration the picker or the sweep may use on ``arch`` (for the static smem check)."""
    g1 = list(GEMM1_CANDIDATES[arch]) + list(_DEFAULT_GEMM1[arch].values()) + list(_W4A4_GEMM1.get(arch, {}).values())
    g2 = (list(GEMM2_CANDIDATES[arch]) + list(_DEFAULT_GEMM2[arch].values()) + ([SPLIT_SLOTS_GEMM2[arch]] if arch in SPLIT_SLOTS_GEMM2 else [])
          + [c for _, _, table in _GEMM2_BY_INTERMEDIATE.get(arch, []) for c in table.values()])
    return g1, g2


def arch_tables() -> list[str]:
    """The architectures with plan tables (what ``plan``'s ``arch`` accepts)."""
    return sorted(_DEFAULT_GEMM1)


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
