"""The fused MoE's kernel launches as data: :func:`launches` decides, :func:`run` launches.

``launches(plan, call)`` is a pure function of a launch plan (:class:`glm5_fp4.kernels.configs.Plan`) and
one call's tensors (:class:`MoECall`): it returns the list of :class:`Launch` records (kernel, grid,
arguments) and touches nothing, so the same list can be launched on a GPU, run by Triton's interpreter,
or compiled ahead of time for another architecture (``glm5-fp4 compile-matrix`` builds calls on meta
tensors and compiles exactly what would run). Grids come from static bounds (tokens, experts, tile sizes),
never from routing, so a CUDA graph captured for a batch size replays the same launches.

Per schedule:

* ``slot``: [split-K GEMM1 + reduce | GEMM1 (split-K with the reduce fused: plan.gemm1_fused_reduce)],
  GEMM2-with-combine (2-3 launches, no workspace zeroing); with plan.slot_dedup, GEMM1 and GEMM2 per group of
  slots sharing an expert, GEMM2 into per-slot rows, then the finalize adding each token's k rows (3-4), or
  GEMM2's last writer of a token's rows adding them (plan.dedup_fused_finalize: 2-3).
* ``grouped``: align (+ zero + activation conversion), GEMM1 over the work list, GEMM2 over the work list
  (atomics into the fp32 workspace), finalize (4 launches; one more with plan.parallel_align: count + scan,
  scatter; one more with plan.gemm1_split_k > 1: the split-K reduce after GEMM1).
* ``native`` (SM100/SM120 FP4 MMA, unverified): align, native GEMM1, native GEMM2, finalize.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.kernels import capability
from glm5_fp4.kernels import configs as cfgs
from glm5_fp4.kernels.layout import DECODE_LAYOUTS, PLACED_LAYOUTS, PreparedExperts, w13_k_tile

STAGES = ("align", "gemm1", "gemm2")
# Elements per program of the zeroing / conversion part of the align kernel and of the finalize kernel.
ZBLOCK = 4096
FBLOCK = 4096
# Slot dedup's finalize (k fp32 rows per token added): elements per program and its warps. A 4096-wide block gave
# T=4 eight programs whose threads each held 8 rows x 32 values, more than their registers: the row loads went one
# after another, one DRAM round trip each (14 us under ncu on the H100, 2026-12-06). 256 wide: T x 24 programs
# (TP8), every row load of a thread in flight at once: TP8 T=3 / 4 balanced 40.2 / 55.5 -> 33.9 / 48.8 us per layer,
# TP4 T=4 90.4 -> 80.4 (H100, same run; improvements/20).
FBLOCK_ROWS = 256
# finalize elements per warp (at most 4 warps): the 256-wide k-row programs run 2 warps, the 4,096-wide ones 4
FBLOCK_WARP_SPAN = 128
# Parallel align (plan.parallel_align): slots counted per program, and placed per program of the scatter.
PAR_BLOCK = 256
SCATTER_BLOCK = 1024


@dataclass
class Launch:
    """One ``fn[grid](*args, **kwargs)`` call; ``kwargs`` include the constexprs and launch options."""

    fn: object  # triton JITFunction
    grid: tuple
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    stage: str = ""  # which of STAGES it belongs to (benchmarks time stages alone)

    @property
    def name(self) -> str:
        return self.fn.__name__

    def __call__(self) -> None:
        try:
            self.fn[self.grid](*self.args, **self.kwargs)
        except Exception as e:
            from triton.runtime.errors import OutOfResources  # (only once a launch failed)

            if not isinstance(e, OutOfResources):
                raise
            raise Glm5Fp4Error(out_of_resources_message(self, e)) from e


# The constexprs that size a kernel's shared memory and registers (the rest are shapes and switches).
_SIZING = ("H", "I", "BN", "BM", "BK", "KC", "MERGED", "STACK", "SPLIT_K", "N_SPLIT", "W4A4", "num_warps", "num_stages", "maxnreg")


def out_of_resources_message(launch: Launch, e) -> str:
    """What to tell a user whose GPU refused a compiled kernel: Triton's numbers, the config, the compiler.

    The CPU compile matrix checks every config against the sm_120 / sm_100 / sm_90 limits under the test venv's and
    the engines' Triton (README, SM120); a refusal means a compiler or GPU it did not cover."""
    import triton

    sizing = ", ".join(f"{k}={launch.kwargs[k]}" for k in _SIZING if k in launch.kwargs)
    return (f"the GPU refused {launch.name} ({sizing}): it needs {e.required} of {e.name}, the limit is {e.limit} "
            f"(Triton {triton.__version__}, "
            f"which compiles some configs larger than the versions glm5-fp4 was checked with). Please report it with "
            f"this line; meanwhile serve with the engine's own NVFP4 MoE "
            f"(glm5-fp4 serve --stock --quantization modelopt_fp4)")


# MoECall.diag bits (benchmarks only; the results are wrong): time a stage's share by leaving its work out.
DIAG_NO_DECODE = 1  # GEMM1 and the grouped GEMM2 feed the packed words (times the block scales) to the MMA
DIAG_PLAIN_STORES = 2  # the grouped GEMM2 stores its tiles instead of adding them atomically into the workspace


@dataclass
class MoECall:
    """Everything one layer call hands the kernels (tensors already contiguous / in the kernel dtypes)."""

    x: torch.Tensor  # [T, H] bf16/fp16
    topk_weights: torch.Tensor  # [T, k] float32
    topk_ids: torch.Tensor  # [T, k] int32/int64, global expert ids
    prepared: PreparedExperts  # the local experts
    mode: str
    out: torch.Tensor  # [T, H]
    workspace: object  # glm5_fp4.kernels.moe.Workspace
    expert_map: torch.Tensor | None = None  # [E_global] int32: local id or -1 (expert parallelism)
    use_asm: bool = True
    diag: int = 0  # benchmarks only, wrong results: DIAG_* bits

    @property
    def tokens(self) -> int:
        return self.x.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def num_slots(self) -> int:
        return self.tokens * self.top_k


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Static bound on the work list's length: sum over experts of ceil(count / BM), counts summing to
    ``num_slots`` over at most ``min(E, slots)`` experts."""
    return min(num_slots, (num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _pdl(plan: cfgs.Plan, call: MoECall) -> dict:
    """Launch options and constexpr of Plan.pdl: griddepcontrol is PTX (SM90+), so not where inline PTX is off
    (the interpreter: the plan then runs as plain stream-ordered launches)."""
    return dict(USE_PDL=True, launch_pdl=True) if plan.pdl and call.use_asm else {}


def _l2_prefetch(plan: cfgs.Plan, call: MoECall) -> dict:
    """GEMM1's constexpr of Plan.l2_prefetch (PTX: not where inline PTX is off)."""
    return dict(PF_DIST=plan.l2_prefetch) if plan.l2_prefetch and call.use_asm else {}


def _w2_row_requests(rows: int, i: int) -> tuple[int, int]:
    """128-byte L2 requests (powers of two) covering ``rows`` down-projection rows of words / of scales, which
    are contiguous runs only at whole K tiles (triton_moe._prefetch_w2_rows)."""
    return _pow2(-(-rows * (i // 8) // 32)), _pow2(-(-rows * (i // 16) // 128))


def _l2_prefetch2(plan: cfgs.Plan, call: MoECall, bn: int) -> dict:
    """The grouped GEMM2's: distance and 128-byte requests per N tile of ``bn`` rows (whole K tiles only)."""
    i = call.prepared.intermediate_size
    if not (plan.l2_prefetch and call.use_asm) or cfgs.gemm2_k_chunk(i) != i:
        return {}
    words, scales = _w2_row_requests(bn, i)
    return dict(PF_DIST=plan.l2_prefetch, PF_DW=words, PF_DS=scales)


def _regs(cfg, call: MoECall) -> dict:
    """Launch option of a config's register cap, where the PTX path compiles (not in the interpreter, nor under
    GLM5_FP4_MOE_NO_ASM=1, whose plain decode the caps were not measured with)."""
    return dict(maxnreg=cfg.maxnreg) if cfg.maxnreg and call.use_asm else {}


def _prefetch(plan: cfgs.Plan, call: MoECall, rows: int) -> dict:
    """GEMM2's L2 prefetch before it waits (Plan.pdl): ``rows`` weight rows of each expert it reads, as
    128-byte requests; none for whole experts (K in chunks: a row's first chunk is not one contiguous run)."""
    i = call.prepared.intermediate_size
    if not _pdl(plan, call) or cfgs.gemm2_k_chunk(i) != i:
        return {}
    words, scales = _w2_row_requests(rows, i)
    return dict(PF_ROWS=rows, PF_W=words, PF_S=scales)


# A TMA box row (its inner dimension) must be a multiple of 16 bytes: the words' BK/8 int32 always are (BK is a
# multiple of 32), the scales' BK/16 bytes at BK >= 256 only; a box dimension holds at most 256 elements.
TMA_ROW_BYTES = 16
TMA_BOX_MAX = 256


def scales_by_tma(g1: cfgs.Gemm1Config) -> bool:
    """Whether a TMA tile's scales come by descriptor too (their [BN, BK/16] box row is a whole TMA row)."""
    return g1.tma and (g1.bk // 16) % TMA_ROW_BYTES == 0


def _w13(plan: cfgs.Plan, call: MoECall) -> tuple[tuple, dict]:
    """GEMM1's weight and scale operands: pointers, or (Gemm1Config.tma) a tensor descriptor of the [E*2I, H/8]
    words with one tile's box, and of the [E*2I, H/16] scales where :func:`scales_by_tma` (layout "tiled":
    [E*(H/KT)*2I, KT/8] and [E*(H/KT)*2I, KT/16], one run per row); and the kernel's constexprs for them."""
    p, g1 = call.prepared, plan.gemm1
    w, s = p.w13.view(torch.int32), p.w13_scale
    kt = w13_k_tile(p.layout, p.hidden_size)
    tiled = dict(KT=kt) if kt else {}
    if not g1.tma:
        return (w, s), tiled
    from triton.tools.tensor_descriptor import TensorDescriptor

    # rows of the descriptors: [E*2I, H/8] row-major, [E*(H/KT)*2I, KT/8] K-tile-major ("tiled")
    wd = TensorDescriptor.from_tensor(w.reshape(-1, kt // 8 if kt else w.shape[-1]), [g1.bn, g1.bk // 8])
    if not scales_by_tma(g1):
        return (wd, s), dict(W_DESC=True, **tiled)
    sd = TensorDescriptor.from_tensor(s.reshape(-1, kt // 16 if kt else s.shape[-1]), [g1.bn, g1.bk // 16])
    return (wd, sd), dict(W_DESC=True, S_DESC=True, **tiled)


def _stack(g1: cfgs.Gemm1Config) -> dict:
    return dict(STACK=True) if g1.stacked else {}


def _emap(call: MoECall):
    # Kernels take a pointer either way; without a map the ids pointer stands in (never read: HAS_MAP=False).
    return call.expert_map if call.expert_map is not None else call.topk_ids


# The align kernel indexes x (tokens x hidden) with 32-bit offsets.
MAX_TOKENS_X_HIDDEN = 2**31


def align_block(num_slots: int) -> int:
    """Threads of the one program that sorts the routing: enough for all slots in one or a few passes."""
    return max(128, min(8192, _pow2(num_slots)))


def _align(call: MoECall, block_m: int, prep_x: bool, bk: int, parallel: bool = False, pdl: dict | None = None
           ) -> list[Launch]:
    from glm5_fp4.kernels import triton_moe as K

    ws, prep = call.workspace, call.prepared
    t, h = call.x.shape
    num_slots = call.num_slots
    e = prep.num_experts
    has_map = call.expert_map is not None
    grid = 1 + -(-t * h // ZBLOCK)
    args = (call.topk_ids, num_slots, _emap(call), ws.counts, ws.offsets, ws.cursor, ws.slots, ws.blocks,
            ws.num_blocks, ws.combine, t * h, call.x, call.x.stride(0), ws.xq, ws.par_counts)
    pdl = pdl or {}
    common = dict(E=e, E_POW2=_pow2(e), ZBLOCK=ZBLOCK, BM=block_m, H=h, BK=bk, PREP_X=prep_x, HAS_MAP=has_map, **pdl)
    if parallel:
        # PAR_BLOCK slots counted per program (the last arrival scans), then a scatter kernel
        hprog = -(-num_slots // PAR_BLOCK)
        return [
            Launch(K.moe_align_kernel, (max(grid, hprog),), args,
                   dict(common, BLOCK=PAR_BLOCK, PAR=True, num_warps=4), stage="align"),
            Launch(K.moe_scatter_kernel, (-(-num_slots // SCATTER_BLOCK),),
                   (call.topk_ids, num_slots, _emap(call), ws.cursor, ws.slots),
                   dict(BLOCK=SCATTER_BLOCK, HAS_MAP=has_map, num_warps=4, **pdl), stage="align"),
        ]
    # One program sorts the routing with enough threads to cover all slots in one or a few passes; the
    # others zero the combine workspace (and convert x) in ZBLOCK pieces.
    ablock = align_block(num_slots)
    return [Launch(K.moe_align_kernel, (grid,), args,
                   dict(common, BLOCK=ablock, num_warps=4 if ablock <= 1024 else (8 if ablock <= 4096 else 16)),
                   stage="align")]


def _finalize(call: MoECall, rows: int = 1, pdl: dict | None = None, block: int = 0) -> Launch:
    """The fp32 combine buffer to the output: one row per token (grouped), or k per-slot rows added (slot dedup).
    ``block``: elements per program (Plan.finalize_block; 0: FBLOCK for one row, FBLOCK_ROWS for k rows)."""
    from glm5_fp4.kernels import triton_moe as K

    t, h = call.x.shape
    block = block or (FBLOCK if rows == 1 else FBLOCK_ROWS)
    fblock = min(block, _pow2(h))
    warps = max(1, min(4, fblock // FBLOCK_WARP_SPAN))
    return Launch(K.moe_finalize_kernel, (t, -(-h // fblock)),
                  (call.workspace.combine, call.out, call.out.stride(0), call.topk_ids, _emap(call)),
                  dict(H=h, BLOCK=fblock, ROWS=rows, HAS_MAP=rows > 1 and call.expert_map is not None,
                       num_warps=warps, **(pdl or {})),
                  stage="gemm2")


def _scales(call: MoECall):
    p = call.prepared
    if call.mode == "w4a4":
        return p.a13_scale, p.a2_scale, p.a13_gscale, p.a2_gscale
    a = p.w13_alpha  # unused pointers (W4A4=False); any float32 tensor will do
    return a, a, a, a


def _check(plan: cfgs.Plan, call: MoECall) -> None:
    h, i = call.prepared.hidden_size, call.prepared.intermediate_size
    g1, g2 = plan.gemm1, plan.gemm2
    if i % g1.bn or h % g1.bk or h % g2.bn or (h // g2.bn) % max(plan.gemm2_n_split, 1):
        raise Glm5Fp4Error(f"MoE tile plan {plan} does not divide H={h}, I={i}")
    if plan.schedule == "slot" and plan.slot_dedup and call.num_slots > call.workspace.combine.shape[0]:
        raise Glm5Fp4Error(f"MoE plan {plan}: slot dedup needs {call.num_slots} combine rows (T x k), the workspace "
                           f"holds {call.workspace.combine.shape[0]}")
    if plan.gemm2_split_slots and (plan.schedule != "slot" or plan.slot_dedup):
        raise Glm5Fp4Error(f"MoE plan {plan}: GEMM2 split by slots is a form of the slot schedule without slot dedup")
    if plan.gemm2_split_slots and call.num_slots > call.workspace.combine.shape[0]:
        raise Glm5Fp4Error(f"MoE plan {plan}: GEMM2 split by slots needs {call.num_slots} combine rows (T x k), the "
                           f"workspace holds {call.workspace.combine.shape[0]}")
    if plan.dedup_fused_finalize and not (plan.schedule == "slot" and plan.slot_dedup):
        raise Glm5Fp4Error(f"MoE plan {plan}: the finalize fused into GEMM2 by arrival is a form of the slot dedup")
    if ((plan.gemm2_split_slots or plan.dedup_fused_finalize)
            and call.tokens * plan.gemm2_n_split > call.workspace.slot_count.numel()):
        raise Glm5Fp4Error(f"MoE plan {plan}: GEMM2's arrivals per token need {call.tokens * plan.gemm2_n_split} "
                           f"counters (T x N ranges), the workspace holds {call.workspace.slot_count.numel()}")
    if plan.schedule == "slot" and _gemm1_splits(plan, call) > 1:
        ws = call.workspace
        if (not cfgs.split_k_fits(plan.gemm1_split_k, h, g1.bk, slot=True)
                or _gemm1_splits(plan, call) * call.num_slots * 2 * i > ws.part.numel()
                or call.num_slots * (i // g1.bn) > ws.split_count.numel()):
            raise Glm5Fp4Error(
                f"MoE plan {plan}: GEMM1 split-K {plan.gemm1_split_k} needs <= {cfgs.SLOT_SPLIT_K_MAX} splits of whole "
                f"{g1.bk}-wide K tiles of H={h}, and <= {cfgs.SPLIT_K_MAX_TOKENS} tokens"
            )
    if plan.schedule == "grouped" and plan.gemm1_split_k > 1:
        k, ws = plan.gemm1_split_k, call.workspace
        if (not cfgs.split_k_fits(k, h, g1.bk) or k * call.num_slots * 2 * i > ws.part.numel() or call.mode != "w4a16"
                or call.tokens > cfgs.GROUPED_SPLIT_K_MAX_TOKENS):
            raise Glm5Fp4Error(
                f"MoE plan {plan}: grouped GEMM1 split-K {k} needs W4A16 (got {call.mode}), <= {cfgs.SPLIT_K_MAX} "
                f"splits of whole {g1.bk}-wide K tiles of H={h}, and <= {cfgs.GROUPED_SPLIT_K_MAX_TOKENS} tokens "
                f"(got {call.tokens})"
            )
    kt = w13_k_tile(call.prepared.layout, h)
    if kt and plan.schedule != "native":
        if g1.bk % kt and kt % g1.bk:
            raise Glm5Fp4Error(f"MoE plan {plan}: GEMM1's {g1.bk}-wide K tiles neither divide nor span the "
                               f"{kt}-wide runs of experts prepared with layout={call.prepared.layout!r}")
        if g1.tma and g1.bk > kt:
            raise Glm5Fp4Error(f"MoE plan {plan}: a TMA box of {g1.bk} K lies across the {kt}-wide runs of experts "
                               f"prepared with layout={call.prepared.layout!r}")
    if plan.gemm1_split_cap and not (plan.schedule == "slot" and plan.slot_dedup):
        raise Glm5Fp4Error(f"MoE plan {plan}: GEMM1's split picked at run time is a form of the slot dedup")
    if plan.gemm1_compact_grid and not plan.gemm1_split_cap:
        raise Glm5Fp4Error(f"MoE plan {plan}: GEMM1's compact grid needs its split picked at run time "
                           "(gemm1_split_cap)")
    if g1.tma and g1.stacked:
        raise Glm5Fp4Error(f"MoE plan {plan}: a stacked GEMM1 tile (gate and up rows as one) has no TMA form")
    if g1.tma:
        _check_tma(plan, call)
    if g1.ws:
        _check_ws(plan, call)
    if plan.schedule != "slot":
        if call.workspace.block_capacity < max_blocks(call.num_slots, call.prepared.num_experts, g1.bm):
            raise Glm5Fp4Error(f"workspace holds {call.workspace.block_capacity} work-list blocks, this call needs "
                               f"{max_blocks(call.num_slots, call.prepared.num_experts, g1.bm)}")
        if call.x.shape[0] * h >= MAX_TOKENS_X_HIDDEN:
            raise Glm5Fp4Error(f"{call.x.shape[0]} tokens x hidden {h} exceed the align kernel's 32-bit indexing")


def _check_tma(plan: cfgs.Plan, call: MoECall) -> None:
    """What a TMA GEMM1 tile needs beyond any tile (the 16-byte rows hold whenever the tile divides H)."""
    g1, w = plan.gemm1, call.prepared.w13
    if plan.l2_prefetch:
        raise Glm5Fp4Error(f"MoE plan {plan}: GEMM1 by TMA has no L2 prefetch (it addresses rows by pointer)")
    if g1.bn > TMA_BOX_MAX:
        raise Glm5Fp4Error(f"MoE plan {plan}: a TMA box holds at most {TMA_BOX_MAX} rows, the GEMM1 tile has {g1.bn}")
    cap = capability.device_capability(w.device)
    if cap is not None and not capability.has_tma(cap):
        raise Glm5Fp4Error(f"MoE plan {plan}: GEMM1 by TMA needs sm_{capability.TMA_MIN_CAPABILITY[0]}0 or newer, "
                           f"{w.device} is sm_{cap[0]}{cap[1]}")
    for name, t in (("w13", w), ("w13_scale", call.prepared.w13_scale)):
        if t.device.type != "meta" and t.data_ptr() % TMA_ROW_BYTES:
            raise Glm5Fp4Error(f"MoE plan {plan}: GEMM1 by TMA needs {name} at a {TMA_ROW_BYTES}-byte aligned address")


def _check_ws(plan: cfgs.Plan, call: MoECall) -> None:
    """What the warp-specialised Gluon GEMM1 (Gemm1Config.ws) serves."""
    g1, p = plan.gemm1, call.prepared
    kt = w13_k_tile(p.layout, p.hidden_size)
    why = []
    if plan.schedule != "grouped" or call.mode != "w4a16" or not plan.prep_x:
        why.append("the grouped schedule in W4A16 with prepared activations")
    if not kt or g1.bk > kt:
        why.append(f"experts prepared with layout='tiled' and K tiles within its runs (got {p.layout!r})")
    if not g1.stacked or plan.gemm1_split_k != 1 or plan.l2_prefetch or g1.tma:
        why.append("a stacked tile walking all of K (no split-K, L2 prefetch or TMA form)")
    cap = capability.device_capability(p.w13.device)
    if cap is not None and cap[0] != 9:
        why.append(f"sm_90 (wgmma; {p.w13.device} is sm_{cap[0]}{cap[1]})")
    if cfgs.ws_x_pass_rows(g1) != cfgs.WS_X_ROWS_VERIFIED:
        why.append(f"token blocks of at most {cfgs.WS_X_PASSES * cfgs.WS_X_ROWS_VERIFIED} rows (activation passes of "
                   f"{cfgs.WS_X_ROWS_VERIFIED} rows, the only height verified on a GPU; bm={g1.bm} gives passes of "
                   f"{cfgs.ws_x_pass_rows(g1)} rows: improvements/30)")
    if why:
        raise Glm5Fp4Error(f"MoE plan {plan}: the warp-specialised GEMM1 needs " + "; ".join(why))


def _split_cap(plan: cfgs.Plan) -> dict:
    """The constexprs with which the slot dedup's GEMM1 and its reduce launch pick the split from the routing
    (Plan.gemm1_split_cap; triton_moe._dedup_split)."""
    if not plan.gemm1_split_cap:
        return {}
    return dict(SPLIT_CAP=plan.gemm1_split_cap, SPLIT_MIN=plan.gemm1_split_k,
                SPLIT_FLOOR=plan.gemm1_split_floor or plan.gemm1_split_k)


def dedup_rows(plan: cfgs.Plan, call: MoECall) -> int:
    """Plan.gemm1_compact_grid: the (group, K range) rows of GEMM1's grid, the most any routing uses: a split raised
    above the plan's keeps groups x N tiles x split within the cap; at the plan's split, every group (at most one
    per slot or per local expert) takes that many rows."""
    p = call.prepared
    n_tiles = p.intermediate_size // plan.gemm1.bn
    return max(plan.gemm1_split_cap // n_tiles, min(call.num_slots, p.num_experts) * plan.gemm1_split_k)


def _gemm1_splits(plan: cfgs.Plan, call: MoECall) -> int:
    """GEMM1's grid along K: the plan's split, or the largest one picked at run time (Plan.gemm1_split_cap)."""
    if plan.gemm1_split_cap:
        p = call.prepared
        return max(plan.gemm1_split_k, cfgs.dedup_split_max(p.hidden_size, plan.gemm1.bk,
                                                            p.intermediate_size // plan.gemm1.bn, call.top_k,
                                                            plan.gemm1_split_cap))
    return plan.gemm1_split_k


def _splitk_reduce(call: MoECall, split_k: int, w4a4: bool, has_map: bool, stage: str, pdl: dict,
                   plan: cfgs.Plan | None = None) -> Launch:
    """GEMM1's split-K partial sums added per row (slot id, or sorted position in the grouped schedule); ``plan``:
    the slot dedup's, whose split may be picked at run time (the reduce then counts the groups as GEMM1 does, with
    GEMM1's tile shape)."""
    from glm5_fp4.kernels import triton_moe as K

    ws, i = call.workspace, call.prepared.intermediate_size
    rblock = min(i, 256)
    split_cap = _split_cap(plan) if plan else {}
    if split_cap:
        split_cap.update(SP=_pow2(call.num_slots), N_TILES=i // plan.gemm1.bn,
                         KT=call.prepared.hidden_size // plan.gemm1.bk)
    return Launch(
        K.moe_splitk_reduce_kernel, (call.num_slots, i // rblock),
        (ws.part, call.num_slots * 2 * i, ws.act, call.topk_ids, _emap(call), _scales(call)[3]),
        dict(I=i, SPLIT_K=split_k, BLOCK=rblock, W4A4=w4a4, HAS_MAP=has_map, KC=cfgs.gemm2_k_chunk(i), num_warps=4,
             **pdl, **split_cap),
        stage=stage,
    )


def _gemm2_grouped(plan: cfgs.Plan, call: MoECall, rows: int, slot_dedup: bool = False) -> Launch:
    """The grouped GEMM2 over ``rows`` work-list blocks, or (``slot_dedup``) over the call's slots, each leading
    a group or idle; into the fp32 combine buffer (atomics per token, or stores per slot; with
    plan.dedup_fused_finalize the last writer of a token's rows adds them into the output)."""
    from glm5_fp4.kernels import triton_moe as K

    p, ws, g2 = call.prepared, call.workspace, plan.gemm2
    h, i = p.hidden_size, p.intermediate_size
    a2 = _scales(call)[1]
    return Launch(
        K.moe_gemm2_grouped_kernel, (rows, plan.gemm2_n_split),
        (ws.act, p.w2.view(torch.int32), p.w2_scale, p.w2_alpha, a2, call.topk_weights, ws.combine, ws.slots,
         ws.blocks, ws.num_blocks, call.topk_ids, _emap(call), call.out, call.out.stride(0), ws.slot_count,
         call.top_k),
        dict(H=h, I=i, BN=g2.bn, BM=g2.bm, N_SPLIT=plan.gemm2_n_split, W4A4=call.mode == "w4a4",
             USE_ASM=call.use_asm, MERGED=g2.merged, KC=cfgs.gemm2_k_chunk(i), PLACED=p.layout in PLACED_LAYOUTS,
             SLOT_DEDUP=slot_dedup, ARRIVE_K=call.top_k if slot_dedup and plan.dedup_fused_finalize else 0,
             SP=_pow2(call.num_slots) if slot_dedup else 1,
             HAS_MAP=slot_dedup and call.expert_map is not None, DIAG=call.diag & (DIAG_PLAIN_STORES | DIAG_NO_DECODE),
             num_warps=g2.num_warps, num_stages=g2.num_stages, **_regs(g2, call), **_pdl(plan, call),
             **_l2_prefetch2(plan, call, g2.bn),
             **_prefetch(plan, call, min(g2.bn, h // plan.gemm2_n_split))),
        stage="gemm2",
    )


def _slot_launches(plan: cfgs.Plan, call: MoECall) -> list[Launch]:
    from glm5_fp4.kernels import triton_moe as K

    p, ws = call.prepared, call.workspace
    t, h = call.x.shape
    k, i = call.top_k, p.intermediate_size
    g1, g2 = plan.gemm1, plan.gemm2
    w4a4 = call.mode == "w4a4"
    a13, a2, g13, g2s = _scales(call)
    split_k = _gemm1_splits(plan, call)  # (the largest, where the split is picked at run time)
    num_slots = call.num_slots
    # (N tile, slot, K range), or (N tile, row of group and K range): Plan.gemm1_compact_grid
    compact = dict(DEDUP_ROWS=dedup_rows(plan, call), NSLOTS=num_slots) if plan.gemm1_compact_grid else {}
    grid1 = (i // g1.bn, compact["DEDUP_ROWS"], 1) if compact else (i // g1.bn, num_slots, split_k)
    has_map = call.expert_map is not None
    emap = _emap(call)
    placed = p.layout in PLACED_LAYOUTS
    fused = split_k > 1 and plan.gemm1_fused_reduce
    dedup = plan.slot_dedup
    pdl = _pdl(plan, call)
    w13, w13_kw = _w13(plan, call)
    out = [
        Launch(
            K.moe_gemm1_kernel, grid1,
            (call.x, call.x.stride(0), ws.xq, *w13, p.w13_alpha, a13, g13, g2s,
             ws.act, ws.part, num_slots * 2 * i, ws.split_count, call.topk_ids, emap, ws.slots, ws.blocks,
             ws.num_blocks, k),
            dict(H=h, I=i, BN=g1.bn, BM=g1.bm, BK=g1.bk, SLOT_MODE=True, W4A4=w4a4, USE_ASM=call.use_asm,
                 X_PREP=False, SPLIT_K=split_k, MERGED=g1.merged, DIAG=call.diag & DIAG_NO_DECODE, HAS_MAP=has_map,
                 KC=cfgs.gemm2_k_chunk(i), PLACED=placed, FUSED_REDUCE=fused, DEDUP=dedup, SP=_pow2(num_slots),
                 num_warps=g1.num_warps, num_stages=g1.num_stages, **_regs(g1, call), **pdl,
                 **_l2_prefetch(plan, call), **w13_kw, **_stack(g1), **({"X_NAT": True} if plan.x_natural else {}),
                 **_split_cap(plan), **compact),
            stage="gemm1",
        )
    ]
    if split_k > 1 and not fused:
        out.append(_splitk_reduce(call, split_k, w4a4, has_map, "gemm2", pdl, plan))
    if dedup:
        # GEMM2 per (slot group, N range) into per-slot fp32 rows of the combine buffer, then each token's k rows
        # added in slot order (by the finalize, or by GEMM2's last writer of each token's rows): every expert's W2
        # read and decoded once however many tokens share it
        g2 = _gemm2_grouped(plan, call, num_slots, slot_dedup=True)
        if plan.dedup_fused_finalize:
            return out + [g2]
        return out + [g2, _finalize(call, rows=k, pdl=pdl, block=plan.finalize_block)]
    # Plan.gemm2_split_slots: one program per (N range, token, slot), the k rows added by the last to arrive
    split_slots = plan.gemm2_split_slots
    out.append(Launch(
        K.moe_gemm2_slot_kernel, (plan.gemm2_n_split, t, k) if split_slots else (plan.gemm2_n_split, t),
        (ws.act, p.w2.view(torch.int32), p.w2_scale, p.w2_alpha, a2, call.topk_weights, call.topk_ids, emap,
         call.out, call.out.stride(0), ws.combine, ws.slot_count),
        dict(TOPK=k, H=h, I=i, BN=g2.bn, N_SPLIT=plan.gemm2_n_split, W4A4=w4a4, USE_ASM=call.use_asm,
             MERGED=g2.merged, HAS_MAP=has_map, KC=cfgs.gemm2_k_chunk(i), UNROLL=plan.gemm2_unroll and not split_slots,
             PLACED=placed, SPLIT_SLOTS=split_slots, num_warps=g2.num_warps, num_stages=g2.num_stages,
             **_regs(g2, call), **pdl, **_prefetch(plan, call, h // plan.gemm2_n_split)),
        stage="gemm2",
    ))
    return out


def _grouped_launches(plan: cfgs.Plan, call: MoECall) -> list[Launch]:
    from glm5_fp4.kernels import triton_moe as K

    p, ws = call.prepared, call.workspace
    t, h = call.x.shape
    k, i, e = call.top_k, p.intermediate_size, p.num_experts
    g1 = plan.gemm1
    w4a4 = call.mode == "w4a4"
    a13, _, g13, g2s = _scales(call)
    prep_x = plan.prep_x and not w4a4
    nblk = max_blocks(call.num_slots, e, g1.bm)
    blocks = (ws.blocks, ws.num_blocks)
    placed = p.layout in PLACED_LAYOUTS
    split = plan.gemm1_split_k
    # Split-K partial rows are sorted slot positions; the reduce runs over all T*k positions (with an expert map
    # the tail past the placed slots holds stale sums whose act rows no GEMM2 block reads).
    pdl = _pdl(plan, call)
    reduce = [] if split == 1 else [_splitk_reduce(call, split, False, False, "gemm1", pdl)]
    if g1.ws:
        from glm5_fp4.kernels import gluon_moe as G

        from glm5_fp4.kernels.moe import device_arch

        grid, args, kwargs = G.launch_args(call, g1, device_arch(call.x.device)[1])
        gemm1 = Launch(G.moe_gemm1_ws_kernel, grid, args, kwargs, stage="gemm1")
        # (the Gluon kernel takes no PDL: it starts once the align kernel has finished)
        return [*_align(call, g1.bm, prep_x, g1.bk, plan.parallel_align, pdl), gemm1,
                _gemm2_grouped(plan, call, nblk), _finalize(call, pdl=pdl)]
    w13, w13_kw = _w13(plan, call)
    return [
        *_align(call, g1.bm, prep_x, g1.bk, plan.parallel_align, pdl),
        Launch(
            K.moe_gemm1_kernel, (nblk, i // g1.bn, split),
            (call.x, call.x.stride(0), ws.xq, *w13, p.w13_alpha, a13, g13, g2s,
             ws.act, ws.part, call.num_slots * 2 * i if split > 1 else 0, ws.split_count, call.topk_ids,
             _emap(call), ws.slots, *blocks, k),
            dict(H=h, I=i, BN=g1.bn, BM=g1.bm, BK=g1.bk, SLOT_MODE=False, W4A4=w4a4, USE_ASM=call.use_asm,
                 X_PREP=prep_x, SPLIT_K=split, MERGED=g1.merged, DIAG=call.diag & DIAG_NO_DECODE, HAS_MAP=False,
                 KC=cfgs.gemm2_k_chunk(i), PLACED=placed,
                 num_warps=g1.num_warps, num_stages=g1.num_stages, **_regs(g1, call), **pdl,
                 **_l2_prefetch(plan, call), **w13_kw, **_stack(g1)),
            stage="gemm1",
        ),
        *reduce,
        _gemm2_grouped(plan, call, nblk),
        _finalize(call, pdl=pdl),
    ]


def _native_launches(plan: cfgs.Plan, call: MoECall) -> list[Launch]:
    from glm5_fp4.kernels import native_fp4 as N

    p, ws = call.prepared, call.workspace
    t, h = call.x.shape
    k, i, e = call.top_k, p.intermediate_size, p.num_experts
    g1, g2 = plan.gemm1, plan.gemm2
    act_q, act_s = ws.native_buffers(k, i)
    nblk = max_blocks(call.num_slots, e, g1.bm)
    blocks = (ws.blocks, ws.num_blocks)
    return [
        *_align(call, g1.bm, False, g1.bk),
        Launch(
            N.moe_gemm1_native_kernel, (nblk, i // g1.bn),
            (call.x, call.x.stride(0), p.w13, p.w13_scale, p.w13_alpha, p.a13_scale, p.a13_gscale, p.a2_gscale,
             act_q, act_s, ws.slots, *blocks, k),
            dict(H=h, I=i, BN=g1.bn, BM=g1.bm, BK=g1.bk, num_warps=g1.num_warps, num_stages=g1.num_stages,
                 **_regs(g1, call)),
            stage="gemm1",
        ),
        Launch(
            N.moe_gemm2_native_kernel, (plan.gemm2_n_split, nblk),
            (act_q, act_s, p.w2, p.w2_scale, p.w2_alpha, p.a2_scale, call.topk_weights, ws.combine, ws.slots,
             *blocks, k),
            dict(H=h, I=i, BN=g2.bn, BM=g2.bm, N_SPLIT=plan.gemm2_n_split, num_warps=g2.num_warps,
                 num_stages=g2.num_stages),
            stage="gemm2",
        ),
        _finalize(call),
    ]


def launches(plan: cfgs.Plan, call: MoECall, stages: tuple[str, ...] = STAGES) -> list[Launch]:
    """The kernel launches of one layer call under ``plan``; ``stages`` (benchmarks) keeps a subset."""
    if call.tokens == 0:
        return []
    if plan.schedule == "native":
        if call.mode != "w4a4" or call.prepared.layout != "checkpoint":
            raise Glm5Fp4Error(
                "the native FP4-MMA path serves mode='w4a4' on experts prepared with layout='checkpoint' "
                f"(got mode={call.mode!r}, layout={call.prepared.layout!r})"
            )
        if call.expert_map is not None:
            raise Glm5Fp4Error("the native FP4-MMA path has no expert-parallel support yet")
        out = _native_launches(plan, call)
    else:
        if call.prepared.layout not in DECODE_LAYOUTS:
            raise Glm5Fp4Error(
                f"experts prepared with layout={call.prepared.layout!r} serve only the native FP4 path; "
                "prepare with layout='split' (or 'placed') for this plan"
            )
        _check(plan, call)
        out = _slot_launches(plan, call) if plan.schedule == "slot" else _grouped_launches(plan, call)
    return [launch for launch in out if launch.stage in stages]


def run(todo: list[Launch]) -> None:
    """Launch each record in order (on the current stream)."""
    for launch in todo:
        launch()


def count(plan: cfgs.Plan) -> int:
    """Kernel launches per layer call under ``plan``."""
    if plan.schedule == "slot":
        return (2 + (plan.gemm1_split_k > 1 and not plan.gemm1_fused_reduce)
                + (plan.slot_dedup and not plan.dedup_fused_finalize))
    grouped = plan.schedule == "grouped"
    return 4 + (plan.parallel_align and grouped) + (grouped and plan.gemm1_split_k > 1)


def kernel_functions() -> dict:
    """Every Triton kernel of the fused MoE by name (for reports of what was compiled)."""
    from triton.runtime.jit import JITFunction

    from glm5_fp4.kernels import native_fp4, triton_moe

    return {n: f for mod in (triton_moe, native_fp4) for n, f in vars(mod).items() if isinstance(f, JITFunction)}
