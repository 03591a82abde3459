"""What the hardware allows for each category of one decode step: FLOPs, bytes, and the bound that applies.

Model and parameter counts come from ``glm5_fp4.spec.Glm5Spec`` and peaks from ``glm5_fp4.hardware``; this
module only turns them into per-step, per-rank work for one TP rank of one PP stage (layers, lm_head and the
embedding all-reduce averaged over stages):

* expert_gemm: the distinct routed experts the step's tokens touch (``expected_experts_touched``) plus the
  shared expert, streamed once each; FLOPs ``2 * tokens * (top_k + shared) * expert_params / tp``.
* attention: the MLA core over ``min(context, index_topk)`` selected latents (FLOPs from
  ``decode_flops_per_token``), the DSA indexer scanning every cached FP8 index key (FLOPs
  ``2 * index_heads * index_head_dim`` per cached token), KV reads and writes. The latent cache is
  replicated across TP ranks, so every rank reads all selected latents for its share of the heads.
* other_gemm: attention projections and indexer weights (``q_a``/``kv_a`` replicated as vLLM and SGLang
  do for DeepSeek-style MLA, the rest split over TP), router, dense MLP layers, lm_head; activations in and
  out of every projection.
* allreduce: two per layer plus one for the embedding, ``batch * hidden`` BF16 values each, at the GPU's
  measured all-reduce latency and bus bandwidth (ring: ``2 (n-1)/n * size / busBW``) where the hardware
  table has them.
* other / memcpy: no model (norms, activations, routing and sampling are small and launch-bound at decode).

For each modelled category: time at the memory roof (bytes / bandwidth) and at the compute roof (FLOPs /
dense peak of the dtype its MMA runs in; NVFP4 on a GPU without FP4 tensor cores is weight-only W4A16 and
runs in BF16); the larger is the floor and names the bound. Measured kernel time gives % of each roof; for
NVFP4 both the dense peak and NVIDIA's sparse headline figure (2x dense: "4 PFLOPS" on RTX PRO 6000) are shown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.hardware import GpuSpec
from glm5_fp4.nvfp4 import BYTES_PER_ELEMENT as NVFP4_BYTES
from glm5_fp4.spec import BF16_BYTES, FP8_BYTES, Glm5Spec

WEIGHT_BYTES = {"nvfp4": NVFP4_BYTES, "fp8": FP8_BYTES, "bf16": BF16_BYTES}
MODELLED = ("expert_gemm", "attention", "other_gemm", "allreduce")


@dataclass(frozen=True)
class StepShape:
    """One decode step as the engine ran it."""

    batch: int
    context: int
    tp: int = 1
    pp: int = 1
    tokens_per_seq: int = 1  # >1 with MTP / speculative verification
    expert_dtype: str = "nvfp4"
    attention_dtype: str = "bf16"
    kv_dtype: str = "bf16"

    def validate(self) -> None:
        for name in ("batch", "tp", "pp", "tokens_per_seq"):
            if getattr(self, name) < 1:
                raise Glm5Fp4Error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.context < 0:
            raise Glm5Fp4Error(f"--context must be >= 0, got {self.context}")
        for name in ("expert_dtype", "attention_dtype"):
            if getattr(self, name) not in WEIGHT_BYTES:
                raise Glm5Fp4Error(f"--{name.replace('_', '-')} must be one of {sorted(WEIGHT_BYTES)}, got {getattr(self, name)!r}")
        if self.kv_dtype not in ("bf16", "fp8"):
            raise Glm5Fp4Error(f"--kv-dtype must be bf16 or fp8, got {self.kv_dtype!r}")

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


def _compute_dtype(weight_dtype: str, gpu: GpuSpec) -> str:
    """The MMA dtype a GEMM with these weights runs in on this GPU (weight-only when the GPU lacks it)."""
    return weight_dtype if gpu.peak_tflops(weight_dtype) else "bf16"


def step_work(spec: Glm5Spec, shape: StepShape, gpu: GpuSpec) -> dict[str, CategoryWork]:
    """FLOPs and bytes per modelled category for one decode step on one rank."""
    shape.validate()
    t, tp, pp = shape.tokens, shape.tp, shape.pp
    h, act = spec.hidden_size, BF16_BYTES
    moe_layers = spec.moe_layers / pp
    dense_layers = spec.dense_layers / pp
    layers = spec.num_layers / pp
    k, shared = spec.num_experts_per_tok, spec.n_shared_experts
    i_tp = spec.moe_intermediate_size / tp

    # -- expert GEMMs --------------------------------------------------------------------------------
    touched = spec.expected_experts_touched(t) + shared
    expert_w = touched * spec.expert_bytes(tp, WEIGHT_BYTES[shape.expert_dtype])
    expert_act = t * (k + shared) * (h + 2 * i_tp + i_tp + h) * act
    expert = CategoryWork(
        "expert_gemm",
        flops=moe_layers * 2.0 * t * (k + shared) * spec.expert_params / tp,
        bytes=moe_layers * (expert_w + expert_act),
        compute_dtype=_compute_dtype(shape.expert_dtype, gpu),
        notes=f"{touched - shared:.0f} of {spec.n_routed_experts} routed experts touched per layer, + {shared} shared",
    )

    # -- attention core + DSA indexer ---------------------------------------------------------------
    kv_bytes = BF16_BYTES if shape.kv_dtype == "bf16" else FP8_BYTES
    latent = (spec.kv_lora_rank + spec.qk_rope_head_dim) * kv_bytes
    has_dsa = spec.index_topk is not None
    selected = min(shape.context, spec.index_topk) if has_dsa else shape.context
    index_key = spec.index_head_dim * FP8_BYTES + 4 if has_dsa else 0.0
    heads_tp = spec.num_attention_heads / tp
    core_flops_token = (spec.decode_flops_per_token(shape.context) - spec.decode_flops_per_token(0)) / spec.num_layers
    indexer_flops = 2.0 * t * shape.context * spec.index_n_heads * spec.index_head_dim if has_dsa else 0.0
    per_layer_bytes = (
        shape.batch * selected * latent  # selected latents, once per sequence (all query tokens share them)
        + shape.batch * shape.context * index_key  # the indexer scans every cached key
        + t * (latent + index_key)  # new KV written
        + t * heads_tp * (spec.kv_lora_rank + spec.qk_rope_head_dim + spec.kv_lora_rank) * act  # q in, out
    )
    attention = CategoryWork(
        "attention",
        flops=layers * (t * core_flops_token / tp + indexer_flops),
        bytes=layers * per_layer_bytes,
        compute_dtype=_compute_dtype("fp8" if shape.kv_dtype == "fp8" else "bf16", gpu),
        notes=f"{selected} selected of {shape.context} cached tokens per sequence; indexer counted on every rank",
    )

    # -- other GEMMs: projections, router, dense MLP, lm_head ---------------------------------------
    attn_w = WEIGHT_BYTES[shape.attention_dtype]
    replicated = h * spec.q_lora_rank + h * (spec.kv_lora_rank + spec.qk_rope_head_dim)
    sharded = spec.attention_params - replicated + spec.indexer_params
    proj_params_rank = replicated + sharded / tp
    router = spec.n_routed_experts * h
    dense_mlp_rank = spec.dense_mlp_params / tp
    lm_head_rank = spec.lm_head_params / tp / pp
    nh = spec.num_attention_heads
    # activations in + out of each projection on this rank
    proj_act = t * act * (
        (h + spec.q_lora_rank) + (h + spec.kv_lora_rank + spec.qk_rope_head_dim)  # q_a, kv_a (replicated)
        + (spec.q_lora_rank + nh * spec.qk_head_dim / tp)  # q_b
        + (nh * spec.v_head_dim / tp + h)  # o_proj
    )
    other = CategoryWork(
        "other_gemm",
        flops=2.0 * t * (layers * proj_params_rank + moe_layers * router + dense_layers * dense_mlp_rank + lm_head_rank),
        bytes=(
            layers * (proj_params_rank * attn_w + proj_act)
            + moe_layers * (router * BF16_BYTES + t * (h + spec.n_routed_experts) * act)
            + dense_layers * (dense_mlp_rank * WEIGHT_BYTES[shape.expert_dtype] + t * (2 * h + 3 * spec.intermediate_size / tp) * act)
            + lm_head_rank * BF16_BYTES
            + t * (h + spec.vocab_size / tp) * act / pp
        ),
        compute_dtype=_compute_dtype(shape.attention_dtype, gpu),
        notes="q_a/kv_a replicated, other projections split over TP; router BF16; lm_head BF16 on the last stage",
    )

    # -- all-reduce: bytes on the wire per rank ------------------------------------------------------
    n_ar = 2 * layers + 1.0 / pp
    size = t * h * act
    ring = 2.0 * (tp - 1) / tp if tp > 1 else 0.0
    allreduce = CategoryWork(
        "allreduce",
        flops=0.0,
        bytes=n_ar * ring * size,
        compute_dtype=None,
        notes=f"{n_ar:.0f} all-reduces of {size / 1024:.0f} KiB per step",
    )
    return {w.category: w for w in (expert, attention, other, allreduce)}


def allreduce_floor_us(work: CategoryWork, shape: StepShape, spec: Glm5Spec, gpu: GpuSpec) -> float | None:
    if shape.tp == 1:
        return 0.0
    if gpu.allreduce_bus_bandwidth_gbs is None or gpu.allreduce_latency_us is None:
        return None
    n_ar = 2 * spec.num_layers / shape.pp + 1.0 / shape.pp
    return n_ar * gpu.allreduce_latency_us + work.bytes / (gpu.allreduce_bus_bandwidth_gbs * 1e9) * 1e6


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
    work = step_work(spec, shape, gpu)
    bandwidth = gpu.bandwidth_bytes_per_s
    rows = {}
    floor_total = 0.0
    floor_complete = True
    for cat, w in work.items():
        measured = measured_summed_us.get(cat, 0.0)
        if cat == "allreduce":
            t_mem = None
            t_cmp = None
            floor = allreduce_floor_us(w, shape, spec, gpu)
            bound = "latency + bus bandwidth" if floor else ("none (TP=1)" if shape.tp == 1 else "unknown")
            peak_dense = peak_sparse = None
        else:
            peak_dense = gpu.peak_tflops(w.compute_dtype) if w.compute_dtype else None
            peak_sparse = gpu.peak_tflops(w.compute_dtype, sparse=True) if w.compute_dtype else None
            t_mem = w.bytes / bandwidth * 1e6
            t_cmp = w.flops / (peak_dense * 1e12) * 1e6 if peak_dense else None
            floor = max(t_mem, t_cmp or 0.0)
            bound = "memory" if t_mem >= (t_cmp or 0.0) else "compute"
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
        "measured_step_us": measured_step_us,
        "step_floor_over_measured_pct": _pct(floor_total, measured_step_us) if floor_complete else None,
    }
