"""Memory per GPU and the predicted decode step of a launch layout of GLM-5 (TP x PP, TP + EP, DP attention + EP).

The step is :func:`glm5_fp4.cost_model.decode_step` (the same model the profiler's ceilings use: bytes, FLOPs and
floor time per component, grouped by the profiler's categories); this module adds what a launch needs on top: the
engine's KV-cache dtype spelled as the engine spells it, usable memory per GPU, KV capacity and whether the running
sequences fit. Every modelling choice is an entry of :attr:`Plan.assumptions`, printed with the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from glm5_fp4 import cost_model
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.hardware import GpuSpec
from glm5_fp4.spec import Glm5Spec

GIB = 1024**3
# KV-cache dtype -> the latent row kind the cost model prices. Every FP8 spelling lands on the scaled DSA row for
# GLM-5: vLLM canonicalises sparse-MLA FP8 to `fp8_ds_mla`, SGLang's DSA pool uses the same scaled layout. `auto`
# depends on the GPU (auto_kv); "fp8" here is its value on the target GPU, where no GPU is given.
VLLM_KV = {"auto": "fp8", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "fp8_ds_mla": "fp8",
           "bfloat16": "bf16", "float16": "bf16", "nvfp4_ds_mla": "nvfp4_ds_mla"}
SGLANG_KV = {"auto": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "bf16": "bf16", "bfloat16": "bf16"}
# Either engine's spelling (they agree wherever both have one; every row kind is a spelling of one of them).
KV_SPELLINGS = {**SGLANG_KV, **VLLM_KV}


def resolve_kv(engine: str | None, kv_cache_dtype: str, gpu: GpuSpec | None = None) -> str:
    """The row kind (spec.KV_KINDS) of a kv_cache_dtype as ``engine`` spells it (None: as either engine does);
    ``auto`` as the engine resolves it on ``gpu`` (:func:`auto_kv`) where the GPU is given."""
    table = KV_SPELLINGS if engine is None else VLLM_KV if engine == "vllm" else SGLANG_KV
    if kv_cache_dtype not in table:
        raise Glm5Fp4Error(f"plan does not model kv_cache_dtype {kv_cache_dtype!r} for {engine or 'vLLM or SGLang'}; "
                           f"modelled: {', '.join(table)}")
    if kv_cache_dtype == "auto" and gpu is not None:
        return auto_kv(engine, gpu)
    kind = table[kv_cache_dtype]
    if kind == "nvfp4_ds_mla" and gpu is not None and gpu.compute_capability[0] != 10:
        cc = gpu.compute_capability
        raise Glm5Fp4Error(f"kv_cache_dtype nvfp4_ds_mla is the row of vLLM's FlashMLA on sm_100 only; {gpu.name} "
                           f"(sm_{cc[0]}{cc[1]}) cannot serve it")
    return kind


def auto_kv(engine: str | None, gpu: GpuSpec) -> str:
    """What ``auto`` becomes for GLM-5's sparse MLA: vLLM turns it into fp8_ds_mla only on its SM120 backend
    (FLASHINFER_MLA_SPARSE_SM120; FLASHMLA_SPARSE keeps the model's BF16, vLLM 0.33 mla_attention.py), SGLang into
    fp8_e4m3 on SM >= 10 (shared/reference/sglang.md). Either engine (None): the two agree except on SM100, where
    vLLM's BF16 is taken (the larger rows: capacity not overstated)."""
    major = gpu.compute_capability[0]
    fp8 = major >= 10 if engine == "sglang" else major == 12
    return "fp8" if fp8 else "bf16"


@dataclass(frozen=True)
class PlanInputs:
    tp: int
    pp: int
    concurrency: int
    context: int
    engine: str = "vllm"
    kv_cache_dtype: str = "auto"
    mem_util: float = 0.90
    reserve_gib: float = 2.0
    efficiency: float = 1.0
    expert_math: str | None = None  # nvfp4 (W4A4) | bf16 (W4A16); None: nvfp4 where the GPU has FP4 MMA
    allreduce_gbs: float | None = None
    allreduce_latency_us: float | None = None
    dp: int = 1  # data-parallel attention over the stage's GPUs (1 or tp)
    ep: int = 1  # expert parallelism over the stage's GPUs
    expert_skew: float = 0.0  # the hottest EP GPU's token-slots over the mean, - 1
    dispatch: str = "bf16"  # all-to-all dispatch precision (DP attention + EP)
    ep_comm: str = "a2a"  # DP attention + EP: a2a (to each token's experts' GPUs) or agrs (all-gather + reduce-scatter)
    dense: str | None = None  # storage of shared experts and dense MLPs; None: as the routed experts
    experts: str = "nvfp4"  # storage of the routed experts


@dataclass
class Plan:
    inputs: PlanInputs
    cost: cost_model.StepCost
    kv_kind: str
    usable_bytes: float
    assumptions: list[str]

    @property
    def gpu(self) -> GpuSpec:
        return self.cost.gpu

    @property
    def spec(self) -> Glm5Spec:
        return self.cost.spec

    @property
    def stages(self) -> list[cost_model.StageCost]:
        return self.cost.stages

    @property
    def micro_batch(self) -> int:
        return self.cost.micro_batch

    @property
    def layout(self) -> str:
        return self.cost.layout.name

    @property
    def bottleneck(self) -> cost_model.StageCost:
        """The stage that sets the pace (slowest); memory figures use the heaviest stage instead."""
        return self.cost.bottleneck

    @property
    def heaviest(self) -> cost_model.StageCost:
        return self.cost.heaviest

    @property
    def step_s(self) -> float:
        """Decode step time: every running sequence gets one token per step."""
        return self.cost.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.inputs.concurrency / self.step_s

    def per_step(self, category: str) -> float:
        """A category's floor on the bottleneck stage over one whole decode step (PP: every micro-batch)."""
        return self.cost.per_step(category)

    def component_per_step(self, name: str, attr: str = "seconds") -> float:
        """A bottleneck-stage component's time (or ``bytes``, ``calls``) over one decode step; 0 if it has none."""
        comp = next((c for c in self.bottleneck.components if c.name == name), None)
        return 0.0 if comp is None else self.inputs.pp * getattr(comp, attr)

    @property
    def routed_expert_bytes_per_step(self) -> float:
        return self.component_per_step("routed experts", "bytes")

    @property
    def kv_read_bytes_per_step(self) -> float:
        """Latent KV and indexer keys the bottleneck stage's GPU reads per step."""
        b, ctx, spec = self.micro_batch, self.inputs.context, self.spec
        layers = self.bottleneck.layers[1] - self.bottleneck.layers[0]
        per_seq = spec.selected_tokens(ctx) * spec.kv_row_bytes(self.kv_kind) + ctx * spec.indexer_row_bytes()
        return self.inputs.pp * layers * b * per_seq

    @property
    def allreduce_one_s(self) -> float:
        ar = self.bottleneck.component("all-reduce")
        return ar.seconds / ar.calls if ar.calls else 0.0

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the tightest stage can hold after weights and the runtime reserve."""
        caps = [(self.usable_bytes - s.weights_total) / s.kv_bytes_per_token for s in self.stages]
        return max(0, int(min(caps)))

    @property
    def kv_tokens_needed(self) -> int:
        """KV tokens ``concurrency`` sequences at ``context`` keep on each GPU (every stage, its own layers)."""
        return self.cost.kv_tokens_per_gpu

    def weights_fit(self) -> bool:
        return all(s.weights_total < self.usable_bytes for s in self.stages)

    def fits(self) -> bool:
        """Weights fit and the KV cache holds every running sequence at the full context."""
        return self.weights_fit() and self.kv_capacity_tokens() >= self.kv_tokens_needed

    def max_sequences(self) -> int:
        """Sequences at the full context the server holds: per GPU, times the data-parallel replicas (each GPU of a
        DP-attention stage holds its own sequences; under TP every GPU holds every sequence's latent)."""
        return self.kv_capacity_tokens() // max(1, self.inputs.context) * self.cost.layout.attn_dp


def make_plan(spec: Glm5Spec, gpu: GpuSpec, inputs: PlanInputs) -> Plan:
    tp, pp = inputs.tp, inputs.pp
    if tp < 1 or pp < 1 or inputs.concurrency < 1 or inputs.context < 1:
        raise Glm5Fp4Error("tp, pp, concurrency and context must be positive")
    if inputs.context > spec.max_position_embeddings:
        raise Glm5Fp4Error(f"context {inputs.context} exceeds the model's max_position_embeddings "
                           f"{spec.max_position_embeddings} (config.json); the engines refuse a longer max_model_len")
    if not 0 < inputs.mem_util <= 1:
        raise Glm5Fp4Error(f"--mem-util {inputs.mem_util} must be in (0, 1]")
    # `not x >= 0` rather than `x < 0`: NaN compares false either way and would pass as a reserve or a link speed
    if not 0 <= inputs.reserve_gib < math.inf:
        raise Glm5Fp4Error(f"--reserve-gib {inputs.reserve_gib} must be a finite number >= 0")
    if inputs.allreduce_gbs is not None and not 0 < inputs.allreduce_gbs < math.inf:
        raise Glm5Fp4Error(f"all-reduce bandwidth (--allreduce-gbs) {inputs.allreduce_gbs} must be a finite number > 0")
    if inputs.allreduce_latency_us is not None and not 0 <= inputs.allreduce_latency_us < math.inf:
        raise Glm5Fp4Error(f"all-reduce latency (--allreduce-latency-us) {inputs.allreduce_latency_us} must be a "
                           "finite number >= 0")
    net = cost_model.Interconnect.of(gpu, inputs.allreduce_gbs, inputs.allreduce_latency_us)
    if (tp > 1 or pp > 1) and not net.known:
        raise Glm5Fp4Error(f"the hardware table has no all-reduce numbers for {gpu.name}; pass --allreduce-gbs "
                           "and --allreduce-latency-us")
    kv_kind = resolve_kv(inputs.engine, inputs.kv_cache_dtype, gpu)
    precisions = cost_model.Precisions(experts=inputs.experts, kv=kv_kind, expert_math=inputs.expert_math,
                                       dispatch=inputs.dispatch, dense=inputs.dense)
    layout = cost_model.Layout(tp, pp, inputs.dp, inputs.ep, inputs.ep_comm)
    cost = cost_model.decode_step(spec, gpu, layout, inputs.concurrency, inputs.context, precisions,
                                  efficiency=inputs.efficiency, interconnect=net, expert_skew=inputs.expert_skew)
    total, said = ((gpu.memory_total_bytes, f"the {gpu.memory_total_bytes / 1e9:.1f} GB the driver reports")
                   if gpu.memory_total_bytes else
                   (gpu.memory_gb * GIB, f"the datasheet's {gpu.memory_gb:g} GB read as GiB (no driver figure in the "
                    "hardware table: memory_total_bytes)"))
    usable = total * inputs.mem_util - inputs.reserve_gib * GIB
    assumptions = cost_model.assumptions(cost) + [
        f"KV cache: {inputs.engine} kv_cache_dtype={inputs.kv_cache_dtype} -> {kv_kind}"
        + (f" (what {inputs.engine} makes of auto on sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]})"
           if inputs.kv_cache_dtype == "auto" else "") + "; each stage holds its "
        f"layers' KV of " + (f"its GPU's {cost.micro_batch * pp} sequences" if inputs.dp > 1
                             else f"all {inputs.concurrency} sequences"),
        f"memory: {inputs.mem_util:.2f} x {said} minus {inputs.reserve_gib:g} GiB runtime reserve "
        f"(activations, CUDA graphs, NCCL buffers) = {usable / 1e9:.2f} GB usable; KV gets what weights leave",
    ]
    if inputs.expert_skew and inputs.ep == 1:  # TP shards every expert over every GPU: none is hotter
        assumptions.append(f"expert skew {inputs.expert_skew:g}: applies to expert parallelism only; this layout "
                           "shards every expert over every GPU, so it changes nothing here")
    return Plan(inputs, cost, kv_kind, usable, assumptions)
