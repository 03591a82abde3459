"""What to expect before running: the floors the fused MoE kernels face on a GPU, per decode shape.

* **bandwidth floor** = bytes the layer must move / the GPU's memory bandwidth: NVFP4 weights of the
  experts the routing touches (expected count ``E(1-(1-k/E)^T)``, :func:`glm5_fp4.spec.expected_distinct_experts`)
  plus reading the hidden states and writing the output: the routed-expert component of the decode-step cost
  model (:func:`glm5_fp4.cost_model.routed_experts`), the same byte count as ``benchmarks/moe_kernel.py``, so
  measured rows, these floors, ``plan`` and the profiler's ceilings compare directly.
* **compute floor** = MMA work the selected plan issues / the GPU's dense 16-bit tensor peak. The kernels
  decode NVFP4 to fp16 and run 16-bit MMAs with tokens on the MMA's N side, padded to the plan's ``bm``
  per expert (slot schedule: every routing slot is its own ``bm`` block), so the floor counts the padded
  columns, expected over uniform routing (per-expert token counts ~ Binomial(T, k/E)).
* **FP4-MMA floor**: the native FP4 path's MMA FLOPs (tokens padded to its ``bm``; the useful FLOPs if
  configs.py has no native path for the arch) at the dense NVFP4 peak: what the opt-in ``mxf4nvf4`` kernels
  face.

These are floors, not predictions of achieved time: on H200 the same kernels reach a fraction of their
bandwidth floor (``benchmarks/results/moe_kernel_h200.md``), and nothing here was measured on an SM120 GPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from glm5_fp4.cost_model import Layout, routed_experts
from glm5_fp4.hardware import GpuSpec
from glm5_fp4.spec import Glm5Spec


def expected_padded_columns(tokens: int, num_experts: int, top_k: int, bm: int) -> float:
    """E[sum over experts of ceil(c_e / bm) * bm], c_e ~ Binomial(tokens, k/E) (uniform routing)."""
    p = top_k / num_experts
    if p >= 1.0:
        return num_experts * math.ceil(tokens / bm) * bm
    total = 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    for c in range(1, tokens + 1):
        log_pmf = math.lgamma(tokens + 1) - math.lgamma(c + 1) - math.lgamma(tokens - c + 1) + c * log_p + (tokens - c) * log_q
        if log_pmf < -60 and c > tokens * p:
            break
        total += math.exp(log_pmf) * math.ceil(c / bm) * bm
    return num_experts * total


@dataclass
class Floor:
    tp: int
    tokens: int
    experts_touched: float
    bytes_needed: float
    bandwidth_floor_us: float
    useful_gflop: float
    schedule: str
    gemm1: dict
    gemm2: dict
    gemm2_n_split: int
    mma_gflop: float
    compute_floor_us: float
    fp4_mma_floor_us: float | None
    programs_gemm1: float
    programs_gemm2: float
    limiter: str
    bound_us: float
    compute_floor_us_by_bm: dict = field(default_factory=dict)
    bandwidth_floor_us_alt: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def mma_flops(tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int, schedule: str,
              bm1: int, bm2: int) -> float:
    """MMA FLOPs a plan issues, padding included (GEMM1 N=2I, K=H; GEMM2 N=H, K=I)."""
    if schedule == "slot":
        cols1 = tokens * top_k * bm1
        cols2 = tokens * top_k * 16  # the slot GEMM2 always runs 16-token MMAs
    else:
        cols1 = expected_padded_columns(tokens, num_experts, top_k, bm1)
        cols2 = expected_padded_columns(tokens, num_experts, top_k, bm2)
    return 2.0 * cols1 * 2 * intermediate * hidden + 2.0 * cols2 * hidden * intermediate


def native_flops(arch: str, tokens: int, e: int, k: int, h: int, i: int, useful: float) -> float:
    """MMA FLOPs of the native FP4 path where configs.py has one (tokens padded to its bm), else the
    useful FLOPs (what any native path must at least do)."""
    from glm5_fp4.kernels import configs as C

    g1, g2 = getattr(C, "NATIVE_GEMM1", {}).get(arch), getattr(C, "NATIVE_GEMM2", {}).get(arch)
    if g1 is None or g2 is None:
        return useful
    return mma_flops(tokens, e, k, h, i, "grouped", g1.bm, g2.bm)


def floors(
    gpu: GpuSpec,
    tokens: tuple[int, ...],
    tps: tuple[int, ...] = (8, 4),
    spec: Glm5Spec | None = None,
    arch: str | None = None,
    alt_gpus: tuple[GpuSpec, ...] = (),
) -> list[Floor]:
    """Floors of the routed-expert MoE layer on ``gpu`` for GLM-5 TP shards and batch sizes ``tokens``."""
    from glm5_fp4.kernels import configs as C

    spec = spec or Glm5Spec()
    arch = arch or C.arch_of(gpu.compute_capability)
    e, k, h = spec.n_routed_experts, spec.num_experts_per_tok, spec.hidden_size
    peak16 = gpu.peak_tflops("bf16")  # fp16 MMA with fp32 accumulate runs at the bf16 rate
    peak4 = gpu.peak_tflops("nvfp4")
    bms = sorted({c.bm for c in C.all_configs(arch)[0]})
    out = []
    for tp in tps:
        i = spec.moe_intermediate_size // tp
        for t in tokens:
            touched = spec.expected_experts_touched(t)
            layer = routed_experts(spec, t, Layout(tp=tp))
            need, useful = layer.bytes, layer.flops
            p = C.plan(arch, t, e, k, h, i, sm_count=gpu.sm_count)
            # per slot: every routing slot its own block; slot dedup and the grouped schedule: one per expert
            per_slot = p.schedule == "slot" and not p.slot_dedup
            mma = mma_flops(t, e, k, h, i, "slot" if per_slot else "grouped", p.gemm1.bm, p.gemm2.bm)
            bw_us = need / gpu.bandwidth_bytes_per_s * 1e6
            cf_us = mma / (peak16 * 1e12) * 1e6
            slot = p.schedule == "slot"
            # programs with work: GEMM1 per (N tile, slot or expert, K range), GEMM2 per (N range, token or expert)
            prog1 = (i // p.gemm1.bn) * (t * k if per_slot else touched) * p.gemm1_split_k
            prog2 = p.gemm2_n_split * (t if per_slot else touched)
            by_bm = {}
            if not slot:
                for bm in bms:
                    by_bm[str(bm)] = mma_flops(t, e, k, h, i, "grouped", bm, bm) / (peak16 * 1e12) * 1e6
            out.append(
                Floor(
                    tp=tp, tokens=t, experts_touched=touched, bytes_needed=need, bandwidth_floor_us=bw_us,
                    useful_gflop=useful / 1e9, schedule=p.schedule, gemm1=asdict(p.gemm1), gemm2=asdict(p.gemm2),
                    gemm2_n_split=p.gemm2_n_split, mma_gflop=mma / 1e9, compute_floor_us=cf_us,
                    fp4_mma_floor_us=None if not peak4 else native_flops(arch, t, e, k, h, i, useful) / (peak4 * 1e12) * 1e6,
                    programs_gemm1=prog1, programs_gemm2=prog2,
                    limiter="bandwidth" if bw_us >= cf_us else "compute", bound_us=max(bw_us, cf_us),
                    compute_floor_us_by_bm=by_bm,
                    bandwidth_floor_us_alt={g.name: need / g.bandwidth_bytes_per_s * 1e6 for g in alt_gpus},
                )
            )
    return out
