"""Every kernel launch the fused MoE backend can make on an architecture, found without a GPU.

Nothing here restates the kernels' argument lists or the tile configurations: the configurations come
from :mod:`glm5_fp4.kernels.configs` (the per-arch candidate lists the sweep explores, plus the picker's
defaults and what :func:`~glm5_fp4.kernels.configs.plan` selects for each batch size), and the launches are
what :func:`glm5_fp4.kernels.launch.launches` returns for a call built on meta tensors: the launcher is
data, so the compile matrix sees exactly what would run. When the kernel author adds an argument, a
constexpr or a config, the compile matrix follows without an edit here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5_fp4.kernels.layout import default_layout
from glm5_fp4.spec import Glm5Spec

# Batch sizes whose picker choice is compiled: the decode range (slot and grouped regimes, odd and even
# slot counts) and prefill-sized batches (the largest token tiles).
DECODE_TOKENS = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512, 1024)
PREFILL_TOKENS = (2048, 4096, 8192)
# Engines pass int32 expert ids and bf16 hidden states (vLLM and SGLang both do).
IDS_DTYPE = torch.int32
X_DTYPE = torch.bfloat16
ARCHS = ("sm120", "sm100", "sm90")
CAPABILITY = {"sm120": 120, "sm100": 100, "sm90": 90}


@dataclass(frozen=True)
class ShapeClass:
    """One expert shape the backend serves."""

    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    note: str = ""
    # Whether the sweep's candidate configs are compiled for it too (they are tuned on the TP shards; a shape
    # without a sweep gets only what the picker would launch).
    candidates: bool = True


def shape_classes(spec: Glm5Spec | None = None) -> list[ShapeClass]:
    """GLM-5's TP8 and TP4 expert shards, its whole experts, and the small shape the GPU tests (and tiny
    checkpoints) use."""
    spec = spec or Glm5Spec()
    e, k, h = spec.n_routed_experts, spec.num_experts_per_tok, spec.hidden_size
    out = [
        ShapeClass(f"tp{tp}", e, k, h, spec.moe_intermediate_size // tp, f"GLM-5 routed experts, TP{tp} shard")
        for tp in (8, 4)
    ]
    # Whole experts: TP1 (the H200 true-dimension servers) and expert parallelism keep I unsplit, so GEMM2
    # walks K in chunks (configs.GEMM2_MAX_K_CHUNK) and the tiles' shared memory differs from the shards'.
    out.append(ShapeClass("tp1", e, k, h, spec.moe_intermediate_size, "GLM-5 routed experts, whole (TP1, EP)",
                          candidates=False))
    out.append(ShapeClass("tiny", 16, 4, 512, 128, "small test shape (tests/gpu, tiny checkpoints)"))
    return out


@dataclass(frozen=True)
class Selection:
    """One way the backend may run: an architecture, a shape, a mode and a launch plan."""

    arch: str
    shape: ShapeClass
    mode: str
    plan: object  # glm5_fp4.kernels.configs.Plan (schedule "native" for the FP4-MMA path)
    tokens: int
    stages: tuple[str, ...]
    origin: str  # why it is in the matrix: "picked T=16", "gemm1 candidate", ...
    use_asm: bool = True
    layout: str | None = None  # weight layout; None: "checkpoint" for the native path, else what prepare_experts picks

    @property
    def native(self) -> bool:
        return self.plan.schedule == "native"


from glm5_fp4.kernels.launch import Launch  # noqa: E402  (re-exported: the compile matrix's unit)


def _unique(items):
    seen, out = set(), []
    for it in items:
        if it not in seen:
            seen.add(it)
            out.append(it)
    return out


def selections(
    arch: str,
    shapes: list[ShapeClass] | None = None,
    modes: tuple[str, ...] = ("w4a16", "w4a4"),
    tokens: tuple[int, ...] = DECODE_TOKENS + PREFILL_TOKENS,
    candidates: bool = True,
    use_asm: bool = True,
    opt_ins: bool = True,
) -> list[Selection]:
    """Everything the backend may launch on ``arch``: the picker's plan for each batch size in ``tokens``,
    (``opt_ins``) each opt-in plan form, and (``candidates``) every GEMM config of the arch's lists under each
    schedule it can serve."""
    from glm5_fp4.kernels import configs as C

    shapes = shapes or shape_classes()
    g1_all, g2_all = (_unique(c) for c in C.all_configs(arch))
    slot_tokens = C.SLOT_MAX_TOKENS.get(arch, 4)
    out: list[Selection] = []
    for shape in shapes:
        dims = (shape.num_experts, shape.top_k, shape.hidden, shape.intermediate)
        for mode in modes:
            for t in tokens:
                p = C.plan(arch, t, *dims, mode=mode)
                out.append(Selection(arch, shape, mode, p, t, ("align", "gemm1", "gemm2"), f"picked T={t}", use_asm))
            if opt_ins:
                out += opt_in_selections(arch, shape, mode, use_asm)
            if not (candidates and shape.candidates):
                continue
            # The sweep (benchmarks/moe_kernel.py) runs a candidate under the slot schedule only with 16
            # tokens per MMA; the grouped schedule takes any.
            for g1 in g1_all:
                for sched in ("slot", "grouped") if g1.bm == 16 else ("grouped",):
                    t = slot_tokens if sched == "slot" else 64
                    p = C.plan(arch, t, *dims, schedule=sched, gemm1=g1, mode=mode)
                    out.append(Selection(arch, shape, mode, p, t, ("gemm1",), "gemm1 candidate", use_asm))
            for g2 in g2_all:
                for sched in ("slot", "grouped") if g2.bm == 16 else ("grouped",):
                    t = slot_tokens if sched == "slot" else 64
                    p = C.plan(arch, t, *dims, schedule=sched, gemm2=g2, mode=mode)
                    out.append(Selection(arch, shape, mode, p, t, ("gemm2",), "gemm2 candidate", use_asm))
        out += native_selections(arch, shape, modes, tokens)
    return out


def opt_in_selections(arch: str, shape: ShapeClass, mode: str, use_asm: bool = True) -> list[Selection]:
    """Each opt-in plan form (configs.OPT_IN) at the batch sizes it is built for, where it serves the picker's
    plan: a form must compile and fit before the H200 can make it a default."""
    from glm5_fp4.kernels import configs as C

    dims = (shape.num_experts, shape.top_k, shape.hidden, shape.intermediate)
    out = []
    for name, o in C.OPT_IN.items():
        if mode not in o.modes:
            continue
        for t in o.compile_tokens:
            p = C.plan(arch, t, *dims, form=name, mode=mode)
            if p != C.plan(arch, t, *dims, mode=mode):  # the form applies here
                out.append(Selection(arch, shape, mode, p, t, ("align", "gemm1", "gemm2"), f"opt-in {name} T={t}",
                                     use_asm))
    return out


def native_selections(arch: str, shape: ShapeClass, modes, tokens) -> list[Selection]:
    """The native FP4-MMA path (W4A4 only, opt-in with GLM5_FP4_NATIVE_FP4=1) where configs.py has one."""
    from glm5_fp4.kernels import configs as C

    if arch not in C.NATIVE_GEMM1 or "w4a4" not in modes or shape.intermediate > C.GEMM2_MAX_K_CHUNK:
        return []  # (whole experts: native_plan refuses them, nothing of the native path would run)
    dims = (shape.num_experts, shape.top_k, shape.hidden, shape.intermediate)
    return [
        Selection(arch, shape, "w4a4", C.native_plan(arch, t, *dims), t, ("align", "gemm1", "gemm2"),
                  f"picked (native FP4 path) T={t}")
        for t in tokens if t > 1  # the native path has no slot schedule; T=1 exercises nothing new
    ]


# ---------------------------------------------------------------------------------------------------------
# The launches of a selection, on meta tensors
# ---------------------------------------------------------------------------------------------------------
def meta_prepared(shape: ShapeClass, layout: str | None = None):
    """Prepared experts of ``shape`` on the meta device (shapes and dtypes only, no memory)."""
    from glm5_fp4.kernels.layout import PreparedExperts

    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    meta = dict(device="meta")

    def u8(*s):
        return torch.empty(*s, dtype=torch.uint8, **meta)

    def f32():
        return torch.empty(e, dtype=torch.float32, **meta)

    kw = dict(
        w13=u8(e, 2 * i, h // 2), w13_scale=u8(e, 2 * i, h // 16), w13_alpha=f32(),
        w2=u8(e, h, i // 2), w2_scale=u8(e, h, i // 16), w2_alpha=f32(),
        a13_scale=f32(), a2_scale=f32(), a13_gscale=f32(), a2_gscale=f32(),
    )
    return PreparedExperts(**kw, layout=layout or default_layout())


def record(sel: Selection) -> list[Launch]:
    """The kernel launches the backend makes for ``sel`` (nothing runs, nothing is allocated)."""
    from glm5_fp4.kernels.launch import MoECall, launches
    from glm5_fp4.kernels.moe import Workspace

    shape = sel.shape
    meta = torch.device("meta")
    x = torch.empty(sel.tokens, shape.hidden, dtype=X_DTYPE, device=meta)
    tw = torch.empty(sel.tokens, shape.top_k, dtype=torch.float32, device=meta)
    ids = torch.empty(sel.tokens, shape.top_k, dtype=IDS_DTYPE, device=meta)
    prepared = meta_prepared(shape, layout=sel.layout or ("checkpoint" if sel.native else default_layout()))
    ws = Workspace(meta, shape.num_experts, shape.top_k, shape.hidden, shape.intermediate, sel.tokens)
    call = MoECall(x, tw, ids, prepared, sel.mode, torch.empty_like(x), ws, use_asm=sel.use_asm)
    return launches(sel.plan, call, sel.stages)
