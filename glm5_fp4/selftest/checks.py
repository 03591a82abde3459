"""Correctness on this GPU: the fused MoE backend against the float64 reference, GLM-5 shapes, random inputs.

Same rules as ``tests/gpu/test_moe_kernel_gpu.py``: experts are random weights ~ N(0, 1/fan_in) quantized to
NVFP4; outputs are filled with NaN first (an unwritten element fails); the reference is
:func:`glm5_fp4.reference.moe_reference` in float64 on the same quantized experts (W4A4 against the
reference's own W4A4 mode); relative Frobenius error below :func:`glm5_fp4.tolerances.moe_tolerance` for the
mode and the BF16 output (the one tolerance table the tests use too). Routings: GLM-5-like balanced ones and
skewed ones (all tokens on the same k experts, heavy-tailed hot experts), since real serving is skewed.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field

from glm5_fp4.sm120.launches import ShapeClass, shape_classes

ROUTED_SCALING = 2.5  # GLM-5's routed_scaling_factor, as the GPU tests use


def _serving_layout() -> str:
    """The layout the engines prepare experts in (kernels.layout.default_layout), named in every case's result."""
    from glm5_fp4.kernels.layout import default_layout

    return default_layout()


@dataclass(frozen=True)
class Case:
    shape: str
    tokens: int
    mode: str
    ids_dtype: str = "int64"
    # the decoding kernels on the layout the engines use; "checkpoint": the native FP4-MMA path (W4A4 on SM100/
    # SM120, opt-in)
    layout: str = field(default_factory=_serving_layout)
    routing: str = "balanced"  # glm5_fp4.bench.routing name


def native_archs() -> set[str]:
    """Architectures with a native FP4-MMA path in configs.py (none if the kernels have no such path)."""
    from glm5_fp4.kernels import configs as C

    return set(getattr(C, "NATIVE_GEMM1", {}))


def native_enabled() -> bool:
    """Whether the engines would use the native path on this GPU (GLM5_FP4_NATIVE_FP4=1 there)."""
    import torch

    from glm5_fp4.kernels import moe

    fn = getattr(moe, "native_fp4_enabled", None)
    return bool(fn and fn(torch.device("cuda", torch.cuda.current_device())))


def cases(quick: bool, arch: str = "sm90") -> list[Case]:
    """Quick: the slot schedule and two grouped sizes on the TP8 shard, both modes. Full: TP8, TP4 and the
    small shape over the slot and every grouped token tile, both modes, int32 and int64 expert ids. On a GPU
    with a native FP4 path, W4A4 cases through it too."""
    if quick:
        spec = [("tp8", (1, 16, 512)), ("tiny", (37,))]
    else:
        spec = [("tp8", (1, 3, 16, 64, 512)), ("tp4", (1, 16, 128)), ("tiny", (3, 300))]
    out = []
    for shape, tokens in spec:
        for t in tokens:
            for mode in ("w4a16", "w4a4"):
                out.append(Case(shape, t, mode))
            if arch in native_archs():
                out.append(Case(shape, t, "w4a4", layout="checkpoint"))
    out.append(Case("tp8", 40, "w4a16", "int32"))  # engines pass int32 ids
    # skew: a hot expert spread over many work-list blocks, and heavy-tailed loads
    out.append(Case("tp8", 512, "w4a16", "int32", routing="same_k"))
    if not quick:
        out += [Case("tp8", 1024, "w4a16", "int32", routing="zipf1.2"), Case("tp8", 4096, "w4a16", "int32", routing="same_k"),
                Case("tp4", 512, "w4a4", "int32", routing="one_hot")]
    return out


def make_experts(shape: ShapeClass, seed: int = 0, chunk: int = 32, layouts: tuple[str, ...] | None = None,
                 device: str = "cuda"):
    """Random NVFP4 experts on the GPU and their prepared form per layout (default: the engines' layout);
    quantized a few experts at a time so the float32 originals never exist for the whole layer at once."""
    import torch

    from glm5_fp4.kernels import prepare_experts
    from glm5_fp4.reference import NvFp4Experts

    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    g = torch.Generator(device=device).manual_seed(seed)
    parts = []
    for start in range(0, e, chunk):
        n = min(chunk, e - start)
        w13 = torch.randn(n, 2 * i, h, device=device, generator=g) / h**0.5
        w2 = torch.randn(n, h, i, device=device, generator=g) / i**0.5
        parts.append(NvFp4Experts.from_float(w13, w2))
        del w13, w2
    cat = {f: torch.cat([getattr(p, f) for p in parts]) for f in ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")}
    a13 = (3.0 + torch.rand(e, device=device, generator=g)) / (6 * 448)
    a2 = (1.0 + torch.rand(e, device=device, generator=g)) / (6 * 448)
    ex = NvFp4Experts(**cat, a13_scale=a13, a2_scale=a2)
    prepared = {lay: prepare_experts(ex, layout=lay) for lay in (layouts or (_serving_layout(),))}
    return ex, prepared


def touched_experts(experts, ids):
    """The experts ``ids`` routes to, as their own NvFp4Experts, and ``ids`` renumbered into them (the
    reference dequantizes every expert it is given: this keeps small-T references small)."""
    import torch

    from glm5_fp4.reference import NvFp4Experts

    used = torch.unique(ids.long())
    fields = {k: (v[used] if isinstance(v, torch.Tensor) else v) for k, v in vars(experts).items()}
    return NvFp4Experts(**fields), torch.searchsorted(used, ids.long())


def rel_err(a, b) -> float:
    from glm5_fp4.tolerances import rel_error

    return rel_error(a, b)


def run_case(case: Case, shape: ShapeClass, experts, prepared, sm_count: int, arch: str, seed: int,
             device: str = "cuda") -> dict:
    import torch

    from glm5_fp4.kernels import configs as C
    from glm5_fp4.kernels import fused_moe
    from glm5_fp4.kernels.slow_calls import WATCH
    from glm5_fp4.reference import moe_reference

    from glm5_fp4.bench.routing import make_routing
    from glm5_fp4.tolerances import moe_tolerance

    res = {**asdict(case), "tolerance": moe_tolerance(case.mode, torch.bfloat16)}
    if case.layout == "checkpoint":
        res["plan"] = {"schedule": "native", "gemm1": asdict(C.NATIVE_GEMM1[arch]), "gemm2": asdict(C.NATIVE_GEMM2[arch])}
    else:
        from glm5_fp4.kernels.moe import plan_for  # the plan fused_moe will pick for this case (its one home)

        p = plan_for(arch, sm_count, case.tokens, shape.top_k, prepared, case.mode)
        res["plan"] = {"schedule": p.schedule, "gemm1": asdict(p.gemm1), "gemm2": asdict(p.gemm2),
                       "gemm2_n_split": p.gemm2_n_split, "gemm1_split_k": p.gemm1_split_k, "slot_dedup": p.slot_dedup}
    try:
        gen = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(case.tokens, shape.hidden, device=device, generator=gen).to(torch.bfloat16)
        w, ids = make_routing(case.routing, case.tokens, shape.num_experts, shape.top_k, gen, device,
                              routed_scaling_factor=ROUTED_SCALING)
        ids = ids.to(getattr(torch, case.ids_dtype))
        out = torch.full_like(x, float("nan"))
        t0 = time.perf_counter()
        # The first call compiles on purpose (first_call_s); the slow-call watch is for a server's calls.
        with WATCH.quiet():
            fused_moe(x, w, ids, prepared, mode=case.mode, out=out)
            if out.is_cuda:
                torch.cuda.synchronize()
        res["first_call_s"] = round(time.perf_counter() - t0, 3)  # includes Triton compilation
        res["finite"] = bool(torch.isfinite(out).all().item())
        sub, local_ids = touched_experts(experts, ids)
        ref = moe_reference(x.double(), w.double(), local_ids, sub, mode=case.mode, compute_dtype=torch.float64)
        res["rel_err"] = rel_err(out, ref)
        res["passed"] = res["finite"] and res["rel_err"] < res["tolerance"]
    except Exception as exc:  # noqa: BLE001 - a crash is a failed case with its traceback in the report
        res["passed"] = False
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-2000:]
    return res


def run_all(quick: bool, env: dict, progress=None) -> dict:
    """Every case, shape by shape (one layer of experts resident at a time). Native-FP4 cases gate the
    verdict only when the engines would use that path here (``gating``); otherwise they are informational."""
    import torch

    shapes = {s.name: s for s in shape_classes()}
    todo = cases(quick, env["arch"])
    native_gates = any(c.layout == "checkpoint" for c in todo) and native_enabled()
    results = []
    for name in dict.fromkeys(c.shape for c in todo):
        shape = shapes[name]
        mine = [c for c in todo if c.shape == name]
        try:
            experts, prepared = make_experts(shape, layouts=tuple(dict.fromkeys(c.layout for c in mine)))
        except Exception as exc:  # noqa: BLE001
            for c in mine:
                results.append({**asdict(c), "passed": False, "gating": c.layout != "checkpoint" or native_gates,
                                "error": f"making experts: {type(exc).__name__}: {exc}"})
            continue
        for c in mine:
            r = run_case(c, shape, experts, prepared[c.layout], env["sm_count"], env["arch"], seed=1000 + len(results))
            r["gating"] = c.layout != "checkpoint" or native_gates
            results.append(r)
            if progress:
                progress(r)
        del experts, prepared
        torch.cuda.empty_cache()
    gating = [r for r in results if r["gating"]]
    passed = sum(1 for r in gating if r["passed"])
    info = [r for r in results if not r["gating"]]
    from glm5_fp4.tolerances import moe_tolerance

    tolerance = {m: moe_tolerance(m, torch.bfloat16) for m in dict.fromkeys(c.mode for c in todo)}
    return {"tolerance": tolerance, "cases": results, "passed": passed, "failed": len(gating) - passed,
            "informational_passed": sum(1 for r in info if r["passed"]), "informational_failed": sum(1 for r in info if not r["passed"]),
            "native_fp4_enabled": native_gates}


def observed_kernels() -> list[dict] | dict:
    """The MoE kernels Triton compiled in this process, with what the GPU's loader reported (registers,
    spills, shared memory). Reads Triton's JIT caches; returns ``{"error": ...}`` if their layout differs."""
    try:
        from glm5_fp4.kernels.launch import kernel_functions

        out = []
        fns = kernel_functions()
        for name, fn in fns.items():
            for caches in fn.device_caches.values():
                for kernel in caches[0].values():
                    k = kernel.result() if hasattr(kernel, "result") else kernel
                    md = k.metadata
                    consts = {}
                    for path, v in getattr(k.src, "constants", {}).items():
                        idx = path[0] if isinstance(path, tuple) else path
                        if isinstance(idx, int) and idx < len(fn.arg_names):
                            consts[fn.arg_names[idx]] = getattr(v, "value", v)
                    out.append({
                        "kernel": name,
                        "constexprs": {a: b for a, b in consts.items() if isinstance(b, (int, float, bool, str))},
                        "num_warps": md.num_warps,
                        "num_stages": getattr(md, "num_stages", None),
                        "shared_bytes": md.shared,
                        "registers": getattr(k, "n_regs", None),
                        "spills": getattr(k, "n_spills", None),
                    })
        return out
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        return {"error": f"{type(exc).__name__}: {exc}"}
