"""What the hardware allows for each category of one decode step: FLOPs, bytes, and the bound that applies.

The work is :func:`glm5_fp4.cost_model.decode_step` (the model ``glm5-fp4 plan`` uses: every component placed in the
profiler category its kernels fall in; :func:`glm5_fp4.cost_model.assumptions` lists every choice). This module
turns the engine's step shape (``profile analyze --batch --context --tp --pp ...``) into that model's inputs and
puts each category's floor next to the measured kernel time: % of the memory roof, % of the dense and the sparse
compute peak of the dtype its MMAs run in (NVFP4 on a GPU without FP4 tensor cores is weight-only W4A16 and runs in
BF16; for NVFP4 NVIDIA's headline figure is the sparse one, 2x dense: "4 PFLOPS" on RTX PRO 6000).

With PP, a category's floor is the mean over stages (measured category times are means over ranks); the step
floor of the pipeline (PP x slowest stage, what ``plan`` prints) is ``pipeline_step_floor_us``.
other / memcpy have no model (norms, activations, routing and sampling are small and launch-bound at decode).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from glm5_fp4 import cost_model
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.hardware import GpuSpec
from glm5_fp4.launch.plan import KV_SPELLINGS, resolve_kv
from glm5_fp4.spec import Glm5Spec

WEIGHT_BYTES = cost_model.WEIGHT_BYTES
MODELLED = cost_model.CATEGORIES


@dataclass(frozen=True)
class StepShape:
    """One decode step as the engine ran it."""

    batch: int
    context: int
    tp: int = 1  # GPUs per pipeline stage
    pp: int = 1
    tokens_per_seq: int = 1  # >1 with MTP / speculative verification
    expert_dtype: str = "nvfp4"  # routed experts
    attention_dtype: str = "bf16"
    kv_dtype: str = "bf16"  # a row kind (spec.KV_KINDS) or the engine's --kv-cache-dtype (fp8_e4m3, auto, ...)
    dp: int = 1  # data-parallel attention over the stage's GPUs (``--layout dp8ep8``)
    ep: int = 1  # expert parallelism
    ep_comm: str = "a2a"  # behind DP attention: a2a or agrs (cost_model.EP_COMMS)
    expert_skew: float = 0.0
    dense_dtype: str | None = None  # shared experts and dense MLPs (None: as expert_dtype)

    def validate(self) -> None:
        for name in ("batch", "tp", "pp", "tokens_per_seq"):
            if getattr(self, name) < 1:
                raise Glm5Fp4Error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.expert_skew < 0:
            raise Glm5Fp4Error(f"--expert-skew must be >= 0, got {self.expert_skew}")
        if self.context < 0:
            raise Glm5Fp4Error(f"--context must be >= 0, got {self.context}")
        for name in ("expert_dtype", "attention_dtype", "dense_dtype"):
            value = getattr(self, name)
            if value not in WEIGHT_BYTES and not (name == "dense_dtype" and value is None):
                raise Glm5Fp4Error(f"--{name.replace('_', '-')} must be one of {sorted(WEIGHT_BYTES)}, got {value!r}")
        if self.kv_dtype not in KV_SPELLINGS:
            raise Glm5Fp4Error(f"--kv-dtype must be one of {', '.join(KV_SPELLINGS)}, got {self.kv_dtype!r}")

    @property
    def tokens(self) -> int:
        return self.batch * self.tokens_per_seq


@dataclass
class CategoryWork:
    category: str
    flops: float
    bytes: float
    compute_dtype: str | None
    notes: str = ""

    @property
    def intensity(self) -> float | None:
        return self.flops / self.bytes if self.bytes else None


def step_cost(spec: Glm5Spec, shape: StepShape, gpu: GpuSpec) -> cost_model.StepCost:
    """The cost model's decode step for this shape."""
    shape.validate()
    precisions = cost_model.Precisions(experts=shape.expert_dtype, dense=shape.dense_dtype,
                                       attention=shape.attention_dtype, kv=resolve_kv(None, shape.kv_dtype, gpu))
    layout = cost_model.Layout(shape.tp, shape.pp, shape.dp, shape.ep, shape.ep_comm)
    return cost_model.decode_step(spec, gpu, layout, shape.batch, shape.context, precisions, shape.tokens_per_seq,
                                  expert_skew=shape.expert_skew)


def step_work(spec: Glm5Spec, shape: StepShape, gpu: GpuSpec) -> dict[str, CategoryWork]:
    """FLOPs and bytes per modelled category for one decode step on one rank (mean over PP stages)."""
    return _work(step_cost(spec, shape, gpu))


def _work(cost: cost_model.StepCost) -> dict[str, CategoryWork]:
    out = {}
    for cat in MODELLED:
        nbytes, flops = cost.category_mean(cat)
        comps = [c for c in cost.bottleneck.category(cat).components if c.bytes or c.flops]
        notes = "; ".join(f"{c.name}: {c.note}" if c.note else c.name for c in comps)
        out[cat] = CategoryWork(cat, flops, nbytes, cost.bottleneck.category(cat).compute_dtype, notes)
    return out


def _pct(num: float | None, den: float | None) -> float | None:
    return None if not num or not den else 100.0 * num / den


def ceilings(
    spec: Glm5Spec,
    shape: StepShape,
    gpu: GpuSpec,
    measured_summed_us: dict[str, float],
    measured_exposed_us: dict[str, float],
    measured_step_us: float,
) -> dict:
    """Per-category roofline table for one decode step, against measured median-step kernel times."""
    cost = step_cost(spec, shape, gpu)
    work = _work(cost)
    pp = shape.pp
    rows = {}
    floor_total = 0.0
    floor_complete = True
    for cat, w in work.items():
        measured = measured_summed_us.get(cat, 0.0)
        floor_s = cost.per_step(cat, stages="mean")
        floor = None if floor_s is None else floor_s * 1e6
        if cat == "allreduce":
            t_mem = t_cmp = None
            bound = "latency + bus bandwidth" if floor else ("none (TP=1)" if shape.tp == 1 else "unknown")
            peak_dense = peak_sparse = None
        else:
            cats = [st.category(cat) for st in cost.stages]
            t_mem = pp * sum(c.t_memory or 0.0 for c in cats) / len(cats) * 1e6
            t_cmp = pp * sum(c.t_compute or 0.0 for c in cats) / len(cats) * 1e6
            peak_dense = gpu.peak_tflops(w.compute_dtype) if w.compute_dtype else None
            peak_sparse = gpu.peak_tflops(w.compute_dtype, sparse=True) if w.compute_dtype else None
            bound = cost.bottleneck.category(cat).bound
        if floor is None:
            floor_complete = False
        else:
            floor_total += floor
        seconds = measured * 1e-6
        achieved_tflops = w.flops / seconds / 1e12 if seconds and w.flops else None
        achieved_gbs = w.bytes / seconds / 1e9 if seconds and w.bytes else None
        rows[cat] = {
            "flops": w.flops,
            "bytes": w.bytes,
            "intensity_flop_per_byte": w.intensity,
            "compute_dtype": w.compute_dtype,
            "peak_tflops_dense": peak_dense,
            "peak_tflops_sparse": peak_sparse,
            "t_memory_us": t_mem,
            "t_compute_us": t_cmp,
            "floor_us": floor,
            "bound": bound,
            "measured_summed_us": measured,
            "measured_exposed_us": measured_exposed_us.get(cat, 0.0),
            "achieved_tflops": achieved_tflops,
            "achieved_gbs": achieved_gbs,
            "pct_of_compute_dense": _pct(achieved_tflops, peak_dense),
            "pct_of_compute_sparse": _pct(achieved_tflops, peak_sparse),
            "pct_of_bandwidth": _pct(achieved_gbs, gpu.mem_bandwidth_gbs) if cat != "allreduce" else None,
            "floor_over_measured_pct": _pct(floor, measured),
            "notes": w.notes,
        }
    pipeline = cost.step_s
    warnings = [f"{cat}: measured {r['measured_summed_us']:,.1f} us is below its floor {r['floor_us']:,.1f} us "
                f"({r['floor_over_measured_pct']:.0f} %): the modelled work is not the traced step's; check --batch, "
                "--context, the layout (--layout / --tp / --pp) and the dtypes"
                for cat, r in rows.items() if (r["floor_over_measured_pct"] or 0.0) > 100.0]
    # a modelled category the traces hold nothing of: its kernels were named otherwise (unknown to the taxonomy)
    # or not captured, and the ratio of a 0 us measurement is no number, so it said nothing
    warnings += [f"{cat}: no kernel of this category was measured, against a floor of {r['floor_us']:,.1f} us: its "
                 "kernels are unknown to the taxonomy (see the unknown kernel names; --taxonomy adds them) or were "
                 "not captured" for cat, r in rows.items()
                 if (r["floor_us"] or 0.0) > 0.0 and not r["measured_summed_us"] and cat != "allreduce"]
    return {
        "gpu": gpu.name,
        "gpu_display_name": gpu.display_name,
        "bandwidth_gbs": gpu.mem_bandwidth_gbs,
        "peaks_tflops": {d: {"dense": p.dense, "sparse": p.sparse} for d, p in gpu.peaks_tflops.items()},
        "shape": asdict(shape),
        "model": spec.name,
        "categories": rows,
        "step_floor_us": floor_total if floor_complete else None,
        "step_floor_partial_us": floor_total,
        "pipeline_step_floor_us": None if pipeline is None else pipeline * 1e6,
        "measured_step_us": measured_step_us,
        "step_floor_over_measured_pct": _pct(floor_total, measured_step_us) if floor_complete else None,
        "assumptions": cost_model.assumptions(cost),
        "warnings": warnings,
    }
