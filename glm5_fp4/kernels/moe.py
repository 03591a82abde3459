"""``fused_moe``: the routed-experts forward on prepared NVFP4 experts, Triton on GPU, torch on CPU.

Launches per MoE layer call (see :mod:`glm5_fp4.kernels.triton_moe`): 2 for tiny batches (slot schedule;
3 when GEMM1 is split along K: GEMM1 partials, split-K reduce + SwiGLU, GEMM2 + combine), 4 otherwise
(align + zero + activation conversion, GEMM1+SwiGLU, GEMM2+combine, convert). No host synchronisation: all
routing-dependent sizes live on the GPU and the grids are sized from static bounds.
"""

from __future__ import annotations

import os
import threading

import torch

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.kernels import configs as cfgs
from glm5_fp4.kernels.layout import PreparedExperts
from glm5_fp4.reference import MODES, moe_reference

# Set to run the Triton kernels on CPU tensors through Triton's interpreter (tests only; slow).
INTERPRET_ENV = "TRITON_INTERPRET"


def _interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def check_inputs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, prepared: PreparedExperts, mode: str):
    if mode not in MODES:
        raise Glm5Fp4Error(f"unknown MoE mode {mode!r}; choose one of {MODES}")
    h = prepared.hidden_size
    if x.dim() != 2 or x.shape[1] != h:
        raise Glm5Fp4Error(f"hidden states must be [T, {h}], got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise Glm5Fp4Error(f"hidden states must be bfloat16 or float16, got {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise Glm5Fp4Error(
            f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both be [T={x.shape[0]}, k]"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise Glm5Fp4Error(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if mode == "w4a4" and not prepared.has_input_scales:
        raise Glm5Fp4Error("w4a4 mode needs the experts' input scales (a13_scale, a2_scale)")


# ---------------------------------------------------------------------------------------------------------
# Workspace: one set of buffers per (device, stream, shape family), grown eagerly, never inside capture.
# ---------------------------------------------------------------------------------------------------------
class Workspace:
    def __init__(self, device: torch.device, num_experts: int, top_k: int, hidden: int, intermediate: int, max_tokens: int):
        i32 = dict(dtype=torch.int32, device=device)
        self.max_tokens = max_tokens
        self.counts = torch.zeros(num_experts, **i32)
        self.offsets = torch.zeros(num_experts, **i32)
        self.cursor = torch.zeros(num_experts, **i32)
        self.active = torch.zeros(num_experts, **i32)
        self.num_active = torch.zeros(1, **i32)
        self.slots = torch.zeros(max_tokens * top_k, **i32)
        self.act = torch.empty(max_tokens * top_k, intermediate, dtype=torch.float16, device=device)
        self.combine = torch.zeros(max_tokens, hidden, dtype=torch.float32, device=device)
        # the activations in fp16, GEMM1's merged K order (grouped W4A16; written by the align kernel)
        self.xq = torch.empty(max_tokens, hidden, dtype=torch.float16, device=device)
        # split-K partial sums of the slot schedule's GEMM1: [split, slot, gate|up]
        self.part_rows = min(max_tokens, cfgs.SPLIT_K_MAX_TOKENS) * top_k
        self.part = torch.empty(cfgs.SPLIT_K_MAX * self.part_rows * 2 * intermediate, dtype=torch.float32, device=device)
        # NVFP4 act (codes + scales) between the native FP4 GEMMs; allocated on first native use
        self.act_q: torch.Tensor | None = None
        self.act_s: torch.Tensor | None = None

    def native_buffers(self, top_k: int, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.act_q is None:
            rows = self.max_tokens * top_k
            self.act_q = torch.empty(rows, intermediate // 2, dtype=torch.uint8, device=self.combine.device)
            self.act_s = torch.empty(rows, intermediate // 16, dtype=torch.uint8, device=self.combine.device)
        return self.act_q, self.act_s


_WORKSPACES: dict[tuple, Workspace] = {}
# Replaced workspaces stay referenced: a CUDA graph captured earlier keeps their addresses and would
# otherwise write into memory the allocator has handed to someone else.
_RETIRED: list[Workspace] = []
_WS_LOCK = threading.Lock()


def get_workspace(device: torch.device, num_experts: int, top_k: int, hidden: int, intermediate: int, tokens: int) -> Workspace:
    """The shared workspace for these shapes, grown (by doubling) when ``tokens`` exceeds it.

    One workspace per device and shape family, not per stream: calls that use it must not overlap in time
    (one stream, or streams ordered by events). Growing inside a CUDA-graph capture is allowed (the memory
    comes from the graph's pool) but wastes memory; reserve the maximum up front instead.
    """
    key = (str(device), num_experts, top_k, hidden, intermediate)
    with _WS_LOCK:
        ws = _WORKSPACES.get(key)
        if ws is None or ws.max_tokens < tokens:
            if ws is not None:
                _RETIRED.append(ws)
            cap = max(tokens, 256 if ws is None else 2 * ws.max_tokens)
            ws = Workspace(device, num_experts, top_k, hidden, intermediate, cap)
            _WORKSPACES[key] = ws
        return ws


def reserve_workspace(prepared: PreparedExperts, top_k: int, max_tokens: int) -> None:
    """Allocate the static workspace for up to ``max_tokens`` on the current device/stream (before capture)."""
    get_workspace(
        prepared.device, prepared.num_experts, top_k, prepared.hidden_size, prepared.intermediate_size, max_tokens
    )


# ---------------------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------------------
def _arch(device: torch.device) -> tuple[str, int]:
    if device.type != "cuda":
        return "sm90", 132  # interpreter runs: any consistent plan
    props = torch.cuda.get_device_properties(device)
    return cfgs.arch_of((props.major, props.minor)), props.multi_processor_count


def _use_asm(device: torch.device) -> bool:
    # The decode's inline PTX needs cvt.*.e4m3x2 (SM89+) and a real GPU; the interpreter runs plain Triton.
    if device.type != "cuda" or _interpreting():
        return False
    if os.environ.get("GLM5_FP4_MOE_NO_ASM", "0") not in ("", "0"):
        return False
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor) >= (8, 9)


def fused_moe_triton(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    prepared: PreparedExperts,
    mode: str = "w4a16",
    out: torch.Tensor | None = None,
    plan: cfgs.Plan | None = None,
    use_asm: bool | None = None,
    stages: tuple[str, ...] = ("align", "gemm1", "gemm2"),
    diag: int = 0,
) -> torch.Tensor:
    """Launch the Triton schedule. ``plan`` overrides the per-arch default; ``stages`` (benchmarks only)
    runs a subset so stage times can be isolated."""
    import triton

    from glm5_fp4.kernels import triton_moe as K

    t, h = x.shape
    k = topk_ids.shape[1]
    e, i = prepared.num_experts, prepared.intermediate_size
    device = x.device
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise Glm5Fp4Error(f"out must be a row-contiguous {x.dtype} {list(x.shape)}, got {out.dtype} {list(out.shape)}")
    if t == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = topk_ids.contiguous()
    tw = topk_weights.float().contiguous() if topk_weights.dtype != torch.float32 else topk_weights.contiguous()
    arch, sms = _arch(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise Glm5Fp4Error(
            f"the fused NVFP4 MoE kernel needs an SM89+ GPU (hardware FP8 conversion); {torch.cuda.get_device_name(device)} "
            "is older -- use the engine's Marlin path"
        )
    if prepared.layout == "checkpoint":
        return _fused_moe_native(x, tw, ids, prepared, mode, out, arch, sms, stages)
    if plan is None:
        plan = cfgs.plan(arch, t, e, k, h, i, sm_count=sms)
    asm = _use_asm(device) if use_asm is None else use_asm
    w4a4 = mode == "w4a4"
    ws = get_workspace(device, e, k, h, i, t)
    a13, a2 = prepared.a13_scale, prepared.a2_scale
    g13, g2 = prepared.a13_gscale, prepared.a2_gscale
    if not w4a4:  # unused pointers; any float32 tensor will do
        a13 = a2 = g13 = g2 = prepared.w13_alpha
    g1c, g2c = plan.gemm1, plan.gemm2
    if i % g1c.bn or h % g1c.bk or h % g2c.bn or (h // g2c.bn) % plan.gemm2_n_split:
        raise Glm5Fp4Error(f"MoE tile plan {plan} does not divide H={h}, I={i}")
    slot_mode = plan.schedule == "slot"
    num_slots = t * k
    split_k = plan.gemm1_split_k if slot_mode else 1
    if split_k > 1 and (split_k > cfgs.SPLIT_K_MAX or h % (split_k * g1c.bk) or num_slots > ws.part_rows):
        raise Glm5Fp4Error(
            f"MoE plan {plan}: GEMM1 split-K {split_k} needs the slot schedule, <= {cfgs.SPLIT_K_MAX} splits of whole "
            f"{g1c.bk}-wide K tiles of H={h}, and <= {cfgs.SPLIT_K_MAX_TOKENS} tokens"
        )
    # grouped W4A16: the align kernel also writes x as fp16 in GEMM1's K order (no per-tile conversion)
    prep_x = plan.prep_x and not slot_mode and not w4a4
    if prep_x and t * h >= 2**31:
        raise Glm5Fp4Error(f"{t} tokens x hidden {h} exceed the align kernel's 32-bit activation indexing")
    part_stride = num_slots * 2 * i

    if not slot_mode and "align" in stages:
        zblock = 4096
        zprogs = triton.cdiv(t * h, zblock)
        # One program sorts the routing; enough threads to cover all slots in one or a few passes.
        ablock = max(128, min(8192, triton.next_power_of_2(num_slots)))
        K.moe_align_kernel[(1 + zprogs,)](
            ids, num_slots, ws.counts, ws.offsets, ws.cursor, ws.slots, ws.active, ws.num_active,
            ws.combine, t * h, x, x.stride(0), ws.xq,
            E=e, E_POW2=triton.next_power_of_2(e), BLOCK=ablock, ZBLOCK=zblock, H=h, BK=g1c.bk, PREP_X=prep_x,
            num_warps=4 if ablock <= 1024 else (8 if ablock <= 4096 else 16),
        )
    grid1 = (i // g1c.bn, num_slots if slot_mode else min(e, num_slots), split_k)
    if "gemm1" in stages:
        K.moe_gemm1_kernel[grid1](
            x, x.stride(0), ws.xq, prepared.w13.view(torch.int32), prepared.w13_scale, prepared.w13_alpha, a13, g13, g2,
            ws.act, ws.part, part_stride, ids, ws.slots, ws.counts, ws.offsets, ws.active, ws.num_active, k,
            H=h, I=i, BN=g1c.bn, BM=g1c.bm, BK=g1c.bk, SLOT_MODE=slot_mode, W4A4=w4a4, USE_ASM=asm,
            X_PREP=prep_x, SPLIT_K=split_k, MERGED=g1c.merged, DIAG=diag,
            num_warps=g1c.num_warps, num_stages=g1c.num_stages,
        )
    if "gemm2" not in stages:
        return out
    if slot_mode:
        if split_k > 1:
            rblock = min(i, 256)
            K.moe_splitk_reduce_kernel[(num_slots, i // rblock)](
                ws.part, part_stride, ws.act, ids, g2, I=i, SPLIT_K=split_k, BLOCK=rblock, W4A4=w4a4, num_warps=4,
            )
        K.moe_gemm2_slot_kernel[(plan.gemm2_n_split, t)](
            ws.act, prepared.w2.view(torch.int32), prepared.w2_scale, prepared.w2_alpha, a2, tw, ids, out, out.stride(0),
            TOPK=k, H=h, I=i, BN=g2c.bn, N_SPLIT=plan.gemm2_n_split, W4A4=w4a4, USE_ASM=asm,
            MERGED=g2c.merged, num_warps=g2c.num_warps, num_stages=g2c.num_stages,
        )
    else:
        K.moe_gemm2_grouped_kernel[(plan.gemm2_n_split, min(e, num_slots))](
            ws.act, prepared.w2.view(torch.int32), prepared.w2_scale, prepared.w2_alpha, a2, tw, ws.combine,
            ws.slots, ws.counts, ws.offsets, ws.active, ws.num_active, k,
            H=h, I=i, BN=g2c.bn, BM=g2c.bm, N_SPLIT=plan.gemm2_n_split, W4A4=w4a4, USE_ASM=asm, MERGED=g2c.merged,
            num_warps=g2c.num_warps, num_stages=g2c.num_stages,
        )
        fblock = min(4096, triton.next_power_of_2(h))
        K.moe_finalize_kernel[(t, triton.cdiv(h, fblock))](ws.combine, out, out.stride(0), H=h, BLOCK=fblock, num_warps=4)
    return out


def native_fp4_enabled(device: torch.device) -> bool:
    """Whether ``prepare_experts`` should keep the checkpoint layout for the native FP4 path (opt-in)."""
    from glm5_fp4.kernels.native_fp4 import ENV

    if os.environ.get(ENV, "0") in ("", "0") or device.type != "cuda":
        return False
    return cfgs.arch_of(torch.cuda.get_device_capability(device)) in cfgs.NATIVE_GEMM1


def _fused_moe_native(x, tw, ids, prepared, mode, out, arch, sms, stages):
    """W4A4 with FP4 tensor cores (SM100/SM120); UNVERIFIED, see native_fp4.py."""
    import triton

    from glm5_fp4.kernels import native_fp4 as N
    from glm5_fp4.kernels import triton_moe as K

    if mode != "w4a4" or arch not in cfgs.NATIVE_GEMM1:
        raise Glm5Fp4Error(
            f"experts prepared with layout='checkpoint' serve only mode='w4a4' on SM100/SM120 (native FP4 MMA); "
            f"got mode={mode!r} on {arch}. Prepare with layout='split' for W4A16 or other GPUs."
        )
    t, h = x.shape
    k = ids.shape[1]
    e, i = prepared.num_experts, prepared.intermediate_size
    g1, g2 = cfgs.NATIVE_GEMM1[arch], cfgs.NATIVE_GEMM2[arch]
    ws = get_workspace(x.device, e, k, h, i, t)
    act_q, act_s = ws.native_buffers(k, i)
    num_slots = t * k
    if "align" in stages:
        zblock = 4096
        ablock = max(128, min(8192, triton.next_power_of_2(num_slots)))
        K.moe_align_kernel[(1 + triton.cdiv(t * h, zblock),)](
            ids, num_slots, ws.counts, ws.offsets, ws.cursor, ws.slots, ws.active, ws.num_active, ws.combine, t * h,
            x, x.stride(0), ws.xq, E=e, E_POW2=triton.next_power_of_2(e), BLOCK=ablock, ZBLOCK=zblock,
            num_warps=4 if ablock <= 1024 else (8 if ablock <= 4096 else 16),
        )
    active = min(e, num_slots)
    if "gemm1" in stages:
        N.moe_gemm1_native_kernel[(i // g1.bn, active)](
            x, x.stride(0), prepared.w13, prepared.w13_scale, prepared.w13_alpha, prepared.a13_scale,
            prepared.a13_gscale, prepared.a2_gscale, act_q, act_s, ws.slots, ws.counts, ws.offsets, ws.active,
            ws.num_active, k, H=h, I=i, BN=g1.bn, BM=g1.bm, BK=g1.bk, num_warps=g1.num_warps, num_stages=g1.num_stages,
        )
    if "gemm2" in stages:
        n_split = cfgs.pick_n_split(h // g2.bn, cfgs.expected_active_experts(t, e, k), sms)
        N.moe_gemm2_native_kernel[(n_split, active)](
            act_q, act_s, prepared.w2, prepared.w2_scale, prepared.w2_alpha, prepared.a2_scale, tw, ws.combine,
            ws.slots, ws.counts, ws.offsets, ws.active, ws.num_active, k,
            H=h, I=i, BN=g2.bn, BM=g2.bm, N_SPLIT=n_split, num_warps=g2.num_warps, num_stages=g2.num_stages,
        )
        fblock = min(4096, triton.next_power_of_2(h))
        K.moe_finalize_kernel[(t, triton.cdiv(h, fblock))](ws.combine, out, out.stride(0), H=h, BLOCK=fblock, num_warps=4)
    return out


def launches_per_call(plan: cfgs.Plan) -> int:
    if plan.schedule == "slot":
        return 3 if plan.gemm1_split_k > 1 else 2
    return 4


def fused_moe_torch(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    prepared: PreparedExperts,
    mode: str = "w4a16",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU path: the reference MoE (float32 accumulation) on the checkpoint-layout experts."""
    y = moe_reference(x, topk_weights.float(), topk_ids.long(), prepared.to_experts(), mode=mode)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    prepared: PreparedExperts,
    mode: str = "w4a16",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts on NVFP4 weights: ``sum_k w[t,k] * down(silu(gate(x_t)) * up(x_t))`` -> [T, H].

    ``topk_weights`` already include ``routed_scaling_factor``. CUDA tensors run the Triton kernels; CPU
    tensors the torch reference path (or the Triton interpreter when ``TRITON_INTERPRET=1``).
    """
    check_inputs(x, topk_weights, topk_ids, prepared, mode)
    if x.device.type == "cuda" or _interpreting():
        return fused_moe_triton(x, topk_weights, topk_ids, prepared, mode, out)
    return fused_moe_torch(x, topk_weights, topk_ids, prepared, mode, out)

