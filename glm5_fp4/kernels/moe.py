"""``fused_moe``: the routed-experts forward on prepared NVFP4 experts, Triton on GPU, torch on CPU.

Which kernels run, with which grids and arguments, is decided by :func:`glm5_fp4.kernels.launch.launches`
(a pure function of the plan and the call); this module validates inputs, owns the static workspace and
launches. Launches per MoE layer call: 2 for tiny batches (slot schedule; 3 when GEMM1 is split along K),
4 otherwise (align + zero + activation conversion, GEMM1+SwiGLU, GEMM2+combine, convert). No host
synchronisation: all routing-dependent sizes live on the GPU and the grids are sized from static bounds.
"""

from __future__ import annotations

import os
import threading

import torch

from glm5_fp4 import envvars
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.kernels import capability
from glm5_fp4.kernels import configs as cfgs
from glm5_fp4.kernels import launch as L
from glm5_fp4.kernels.layout import LAYOUTS, PreparedExperts
from glm5_fp4.kernels.slow_calls import WATCH
from glm5_fp4.reference import check_call, check_routing, moe_reference

# Set to run the Triton kernels on CPU tensors through Triton's interpreter (tests only; slow).
INTERPRET_ENV = "TRITON_INTERPRET"


def _interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def check_inputs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, prepared: PreparedExperts, mode: str,
                 expert_map: torch.Tensor | None = None):
    check_call(x, topk_weights, topk_ids, prepared.hidden_size, mode)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise Glm5Fp4Error(f"hidden states must be bfloat16 or float16, got {x.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise Glm5Fp4Error(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.shape[1] == 0:  # (the Triton path left out uninitialised)
        raise Glm5Fp4Error(f"topk_ids {list(topk_ids.shape)}: k = 0, no expert per token")
    if not topk_weights.dtype.is_floating_point:
        raise Glm5Fp4Error(f"topk_weights must be floating point (router weights), got {topk_weights.dtype}")
    check_prepared(prepared)
    if mode == "w4a4" and not prepared.has_input_scales:
        raise Glm5Fp4Error("w4a4 mode needs the experts' input scales (a13_scale, a2_scale)")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64)):
        raise Glm5Fp4Error(
            f"expert_map must be a 1-D int32/int64 tensor (global expert id -> local id or -1), got "
            f"{expert_map.dtype} {list(expert_map.shape)}"
        )
    # the kernels skip a slot only through an expert map: without one, -1 is refused (it indexed out of bounds)
    check_routing(topk_ids, expert_map, prepared.num_experts, dropped_without_map=False)


def check_prepared(prepared: PreparedExperts) -> None:
    """One layer's tensors as the kernels index them (shapes only: fake tensors too). A w13_alpha of 2 of 4
    experts was read out of bounds; a w2 of another layer's I failed in a matmul."""
    if prepared.layout not in LAYOUTS:
        raise Glm5Fp4Error(f"unknown expert layout {prepared.layout!r}; choose one of {LAYOUTS}")
    if prepared.w13.dim() != 3:
        raise Glm5Fp4Error(f"w13 must be [E, 2I, H/2] packed NVFP4, got {list(prepared.w13.shape)}")
    e, two_i, h_half = prepared.w13.shape
    h, i = 2 * h_half, two_i // 2
    want = {"w13_scale": (e, two_i, h // 16), "w13_alpha": (e,), "w2": (e, h, i // 2), "w2_scale": (e, h, i // 16),
            "w2_alpha": (e,), "a13_scale": (e,), "a2_scale": (e,), "a13_gscale": (e,), "a2_gscale": (e,)}
    for name, shape in want.items():
        t = getattr(prepared, name)
        if t is not None and tuple(t.shape) != shape:
            raise Glm5Fp4Error(f"{name} must be {list(shape)} for w13 {list(prepared.w13.shape)} (E={e}, H={h}, "
                               f"I={i}), got {list(t.shape)}")


def check_out(x: torch.Tensor, out: torch.Tensor | None) -> None:
    """Every path writes ``out`` in place as it is (no cast, no copy): the op's fake implementation says the same.
    Each path checks it once: the Triton path in make_call, the CPU path in fused_moe_torch."""
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1):
        raise Glm5Fp4Error(f"out must be a row-contiguous {x.dtype} {list(x.shape)}, got {out.dtype} {list(out.shape)} "
                           f"with strides {tuple(out.stride())}")


# ---------------------------------------------------------------------------------------------------------
# Workspace: one set of buffers per (device, stream, shape family), grown eagerly, never inside capture.
# ---------------------------------------------------------------------------------------------------------
class Workspace:
    def __init__(self, device: torch.device, num_experts: int, top_k: int, hidden: int, intermediate: int, max_tokens: int):
        i32 = dict(dtype=torch.int32, device=device)
        self.max_tokens = max_tokens
        self.counts = torch.zeros(num_experts, **i32)
        self.offsets = torch.zeros(num_experts, **i32)
        # the parallel align's counts and arrival counter, zero between calls (its last program zeroes them)
        self.par_counts = torch.zeros(num_experts + 1, **i32)
        self.cursor = torch.zeros(num_experts, **i32)
        self.slots = torch.zeros(max_tokens * top_k, **i32)
        # the work list (experts, first rows, row counts), sized for the smallest token block
        self.block_capacity = L.max_blocks(max_tokens * top_k, num_experts, cfgs.MIN_BLOCK_M)
        self.blocks = torch.zeros(self.block_capacity, 4, **i32)  # triton_moe.BLOCK_FIELDS per block
        self.num_blocks = torch.zeros(1, **i32)
        self.act = torch.empty(max_tokens * top_k, intermediate, dtype=torch.float16, device=device)
        # one fp32 row per token (grouped), or per slot of a slot-schedule call (Plan.slot_dedup)
        slot_tokens = min(max_tokens, max(cfgs.SLOT_MAX_TOKENS.values()))
        slot_rows = slot_tokens * top_k
        self.combine = torch.zeros(max(max_tokens, slot_rows), hidden, dtype=torch.float32, device=device)
        # the activations in fp16, GEMM1's merged K order (grouped W4A16; written by the align kernel)
        self.xq = torch.empty(max_tokens, hidden, dtype=torch.float16, device=device)
        # split-K partial sums of GEMM1: [split, row, gate|up], rows = slots (slot schedule) or sorted positions
        # (grouped); sized for the larger of the two schedules' (splits x rows)
        self.part_rows = min(max_tokens, max(cfgs.SPLIT_K_MAX_TOKENS, cfgs.GROUPED_SPLIT_K_MAX_TOKENS)) * top_k
        part_ranges = max(cfgs.SPLIT_K_MAX * self.part_rows,
                          cfgs.SLOT_SPLIT_K_MAX * min(max_tokens, cfgs.SPLIT_K_MAX_TOKENS) * top_k)
        self.part = torch.empty(part_ranges * 2 * intermediate, dtype=torch.float32, device=device)
        # arrivals per (slot, GEMM1 N tile) of the fused split-K reduce; the last arrival sets it back to zero
        self.split_count = torch.zeros(self.part_rows * (intermediate // 16), **i32)
        # arrivals per (token, GEMM2 N range) of the slot GEMM2 split by slots (Plan.gemm2_split_slots), whose
        # per-slot rows go to ``combine``; the last arrival sets it back to zero
        self.slot_count = torch.zeros(slot_tokens * (hidden // 16), **i32)
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
def device_arch(device: torch.device) -> tuple[str, int]:
    """(arch, SM count) the plan is made for; CPU tensors (interpreter runs) get any consistent answer."""
    if device.type != "cuda":
        return "sm90", 132  # any consistent plan: the interpreter has no SMs (an H200's count)
    props = torch.cuda.get_device_properties(device)
    return cfgs.arch_of((props.major, props.minor)), props.multi_processor_count


def _use_asm(device: torch.device) -> bool:
    # The decode's inline PTX needs cvt.*.e4m3x2 (SM89+) and a real GPU; the interpreter runs plain Triton.
    if device.type != "cuda" or _interpreting():
        return False
    if envvars.flag("GLM5_FP4_MOE_NO_ASM"):
        return False
    return capability.supports(device)[0]


def plan_for(arch: str, sm_count: int, tokens: int, top_k: int, prepared: PreparedExperts, mode: str,
             expert_map: torch.Tensor | None = None, form: str | None = None) -> cfgs.Plan:
    """The per-arch default plan for a call of ``tokens`` (the native FP4 path for checkpoint layout); with an
    expert map, sized for the share of tokens the local experts get. The one home of that choice: calls and the
    load-time warm-up (kernels/warmup.py) both plan here. ``form``: an opt-in form (configs.OPT_IN), benchmarks."""
    e, h, i = prepared.num_experts, prepared.hidden_size, prepared.intermediate_size
    if prepared.layout == "checkpoint":
        if mode != "w4a4" or arch not in cfgs.NATIVE_GEMM1:
            raise Glm5Fp4Error(
                f"experts prepared with layout='checkpoint' serve only mode='w4a4' on SM100/SM120 (native FP4 MMA); "
                f"got mode={mode!r} on {arch}. Prepare with the default layout for W4A16 or other GPUs."
            )
        return cfgs.native_plan(arch, tokens, e, top_k, h, i, sm_count=sm_count)
    return cfgs.plan(arch, tokens, e, top_k, h, i, sm_count=sm_count,
                     global_experts=None if expert_map is None else int(expert_map.numel()), form=form, mode=mode)


def default_plan(x: torch.Tensor, topk_ids: torch.Tensor, prepared: PreparedExperts, mode: str,
                 expert_map: torch.Tensor | None = None, form: str | None = None) -> cfgs.Plan:
    """:func:`plan_for` this call's device and static shapes."""
    arch, sms = device_arch(x.device)
    t, k = topk_ids.shape
    return plan_for(arch, sms, t, k, prepared, mode, expert_map, form)


def make_call(x, topk_weights, topk_ids, prepared, mode="w4a16", out=None, expert_map=None, use_asm=None, diag=0,
              workspace=None) -> L.MoECall:
    """Normalise one call's tensors (contiguity, dtypes) and attach the shared workspace."""
    check_out(x, out)
    # every caller of the kernels comes through here (fused_moe, the op, the benchmarks): ids they cannot index
    check_routing(topk_ids, expert_map, prepared.num_experts, dropped_without_map=False)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # row-major whatever x's strides (empty_like
        # kept a transposed x's, and the kernels wrote rows into columns)
    if x.stride(1) != 1:
        x = x.contiguous()
    tw = topk_weights.float().contiguous() if topk_weights.dtype != torch.float32 else topk_weights.contiguous()
    emap = None if expert_map is None else expert_map.to(torch.int32).contiguous()
    if workspace is None:
        e, k = prepared.num_experts, topk_ids.shape[1]
        workspace = get_workspace(x.device, e, k, prepared.hidden_size, prepared.intermediate_size, x.shape[0])
    # int32 ids whatever the router gave: one dtype for the kernels to specialise on (the load-time warm-up
    # compiles for it), and a no-op for both engines' routers
    ids = topk_ids.to(torch.int32).contiguous()
    return L.MoECall(x, tw, ids, prepared, mode, out, workspace, emap,
                     _use_asm(x.device) if use_asm is None else use_asm, diag)


def fused_moe_triton(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    prepared: PreparedExperts,
    mode: str = "w4a16",
    out: torch.Tensor | None = None,
    plan: cfgs.Plan | None = None,
    use_asm: bool | None = None,
    stages: tuple[str, ...] = L.STAGES,
    diag: int = 0,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the Triton schedule. ``plan`` overrides the per-arch default; ``stages`` (benchmarks only)
    runs a subset so stage times can be isolated; ``expert_map`` serves the local experts of an
    expert-parallel layer (global id -> local id, -1 remote)."""
    if x.device.type == "cuda":
        ok, reason = capability.supports(x.device)
        if not ok:
            raise Glm5Fp4Error(f"{reason} -- use the engine's Marlin path")
    call = make_call(x, topk_weights, topk_ids, prepared, mode, out, expert_map, use_asm, diag)
    if call.tokens == 0:
        return call.out
    L.run(L.launches(plan or default_plan(call.x, call.topk_ids, prepared, mode, call.expert_map), call, stages))
    return call.out


def native_fp4_enabled(device: torch.device) -> bool:
    """Whether ``prepare_experts`` should keep the checkpoint layout for the native FP4 path (opt-in)."""
    if not capability.native_fp4_requested() or device.type != "cuda":
        return False
    return cfgs.arch_of(torch.cuda.get_device_capability(device)) in cfgs.NATIVE_GEMM1


def launches_per_call(plan: cfgs.Plan) -> int:
    return L.count(plan)


def fused_moe_torch(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    prepared: PreparedExperts,
    mode: str = "w4a16",
    out: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU path: the reference MoE (float32 accumulation) on the checkpoint-layout experts."""
    check_out(x, out)
    y = moe_reference(x, topk_weights.float(), topk_ids.long(), prepared.to_experts(), mode=mode, expert_map=expert_map)
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
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts on NVFP4 weights: ``sum_k w[t,k] * down(silu(gate(x_t)) * up(x_t))`` -> [T, H].

    ``topk_weights`` already include ``routed_scaling_factor``. With ``expert_map`` (expert parallelism)
    ``prepared`` holds this rank's experts, ``topk_ids`` are global ids and only local experts contribute.
    CUDA tensors run the Triton kernels; CPU tensors the torch reference path (or the Triton interpreter
    when ``TRITON_INTERPRET=1``).
    """
    check_inputs(x, topk_weights, topk_ids, prepared, mode, expert_map)
    if x.device.type == "cuda" or _interpreting():
        with WATCH.call(x.shape[0], x.device):
            return fused_moe_triton(x, topk_weights, topk_ids, prepared, mode, out, expert_map=expert_map)
    return fused_moe_torch(x, topk_weights, topk_ids, prepared, mode, out, expert_map)

