"""Memory per GPU and a roofline decode step time for a launch layout (TP x PP) of GLM-5.

Everything is computed from the model spec (:class:`glm5_fp4.spec.Glm5Spec`) and the hardware table
(:func:`glm5_fp4.hardware.get_gpu`); every modelling choice is an entry of :attr:`Plan.assumptions`, printed
with the numbers. The model, per GPU and per pipeline stage, for ``b`` sequences in one micro-batch:

* **expert GEMM** (routed): bytes = MoE layers x E(1-(1-k/E)^b) distinct experts x expert params x 0.5625 / TP;
  FLOPs = 2 b k expert params / TP per layer; time = max(bytes / BW, FLOPs / peak).
* **attention** (MLA + DSA indexer): BF16 projection weights (q_a, kv_a and the indexer replicated on every
  TP rank, q_b, kv_b, o split by heads), the latent KV of min(context, index_topk) selected tokens (every
  TP rank reads the whole latent), the indexer's FP8 keys of the whole context; FLOPs of the projections,
  absorbed MLA over the selected tokens and the indexer scores.
* **all-reduce**: 2 per layer (attention output, MLP/MoE output) of b x hidden BF16 values when TP > 1, each
  ``alpha + 2 (n-1)/n x bytes / busBW`` (ring model, nccl-tests bus-bandwidth convention).
* **PP send/recv**: hidden states + residual (BF16) per stage boundary, ``alpha + bytes / P2P bandwidth``.
* **other**: shared expert, dense MLPs, router, lm_head (last stage).

With PP, ``p`` micro-batches of B/p sequences are in flight; every sequence gets a token once each micro-batch
has passed the slowest stage, so the step time per token is ``p x max over stages (stage time + hop)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.hardware import GpuSpec
from glm5_fp4.nvfp4 import BYTES_PER_ELEMENT as NVFP4_BYTES
from glm5_fp4.spec import BF16_BYTES, Glm5Spec

GIB = 1024**3
# KV-cache dtype -> the latent row kind this plan models. Every FP8 spelling lands on the scaled DSA row for
# GLM-5: vLLM canonicalises sparse-MLA FP8 to `fp8_ds_mla`, SGLang's DSA pool uses the same scaled layout.
VLLM_KV = {"auto": "fp8", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "fp8_ds_mla": "fp8",
           "bfloat16": "bf16", "float16": "bf16", "nvfp4_ds_mla": "nvfp4_ds_mla"}
SGLANG_KV = {"auto": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "bf16": "bf16", "bfloat16": "bf16"}


NVFP4_DS_MLA_ROW_BYTES = 352.0  # vLLM `nvfp4_ds_mla` (mla_attention.py state_content_bytes)


def kv_row_bytes(spec: Glm5Spec, kind: str) -> float:
    """Latent KV bytes per token per layer for ``kind`` (fp8 | bf16 | nvfp4_ds_mla).

    fp8: kv_lora in FP8 + one FP32 scale per 128 values + the rope part kept in BF16 (512 + 16 + 128 = 656 B
    for GLM-5: vLLM's `fp8_ds_mla` row, SGLang's DSA FP8 row).
    """
    if kind == "fp8":
        return spec.kv_lora_rank + spec.kv_lora_rank // 128 * 4 + spec.qk_rope_head_dim * BF16_BYTES
    if kind == "bf16":
        return (spec.kv_lora_rank + spec.qk_rope_head_dim) * BF16_BYTES
    return NVFP4_DS_MLA_ROW_BYTES


def indexer_row_bytes(spec: Glm5Spec) -> float:
    """DSA indexer key cache per token per layer: FP8 keys plus one FP32 scale per 128 (0 without DSA)."""
    if spec.index_topk is None:
        return 0.0
    return spec.index_head_dim + math.ceil(spec.index_head_dim / 128) * 4


def resolve_kv(engine: str, kv_cache_dtype: str) -> str:
    table = VLLM_KV if engine == "vllm" else SGLANG_KV
    if kv_cache_dtype not in table:
        raise Glm5Fp4Error(f"plan does not model kv_cache_dtype {kv_cache_dtype!r} for {engine}; "
                           f"modelled: {', '.join(table)}")
    return table[kv_cache_dtype]


def pp_partition(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Layer ranges per stage as vLLM splits them (even; a remainder goes to the stages before the last)."""
    if pp > num_layers:
        raise Glm5Fp4Error(f"pipeline_parallel={pp} exceeds the model's {num_layers} layers")
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


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


@dataclass
class Roof:
    """One kernel class on one GPU: bytes moved, FLOPs, and the time the roofline allows."""

    bytes: float = 0.0
    flops: float = 0.0
    seconds: float = 0.0
    memory_seconds: float = 0.0  # the part of `seconds` spent on memory-bound items

    def add(self, nbytes: float, flops: float, bw: float, peak: float) -> None:
        self.bytes += nbytes
        self.flops += flops
        t_mem, t_cmp = nbytes / bw, flops / peak
        self.seconds += max(t_mem, t_cmp)
        if t_mem >= t_cmp:
            self.memory_seconds += t_mem

    @property
    def bound(self) -> str:
        return "memory" if self.memory_seconds >= self.seconds / 2 else "compute"


@dataclass
class StagePlan:
    index: int
    layers: tuple[int, int]
    moe_layers: int
    dense_layers: int
    weights_bytes: dict[str, float]  # category -> bytes per GPU
    kv_bytes_per_token: float
    expert: Roof = field(default_factory=Roof)
    attention: Roof = field(default_factory=Roof)
    other: Roof = field(default_factory=Roof)
    allreduce_s: float = 0.0
    hop_s: float = 0.0
    kv_read_bytes: float = 0.0  # part of attention.bytes
    allreduce_calls: int = 0

    @property
    def weights_total(self) -> float:
        return sum(self.weights_bytes.values())

    @property
    def compute_s(self) -> float:
        return self.expert.seconds + self.attention.seconds + self.other.seconds

    @property
    def time_s(self) -> float:
        return self.compute_s + self.allreduce_s + self.hop_s


@dataclass
class Plan:
    inputs: PlanInputs
    gpu: GpuSpec
    spec: Glm5Spec
    stages: list[StagePlan]
    micro_batch: int
    kv_kind: str
    usable_bytes: float
    assumptions: list[str]

    @property
    def layout(self) -> str:
        return f"TP{self.inputs.tp}" + (f"+PP{self.inputs.pp}" if self.inputs.pp > 1 else "")

    @property
    def bottleneck(self) -> StagePlan:
        """The stage that sets the pace (slowest); memory figures use the heaviest stage instead."""
        return max(self.stages, key=lambda s: s.time_s)

    @property
    def heaviest(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.weights_total)

    @property
    def step_s(self) -> float:
        """Decode step time: every running sequence gets one token per step."""
        return self.inputs.pp * self.bottleneck.time_s

    @property
    def tokens_per_s(self) -> float:
        return self.inputs.concurrency / self.step_s

    @property
    def allreduce_one_s(self) -> float:
        s = self.bottleneck
        return s.allreduce_s / s.allreduce_calls if s.allreduce_calls else 0.0

    def per_step(self, attr: str) -> float:
        """A bottleneck-stage quantity over one whole decode step (PP: every micro-batch passes the stage)."""
        s = self.bottleneck
        value = getattr(s, attr)
        value = value.seconds if isinstance(value, Roof) else value
        return self.inputs.pp * value

    @property
    def routed_expert_bytes_per_step(self) -> float:
        return self.inputs.pp * self.bottleneck.expert.bytes

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the tightest stage can hold after weights and the runtime reserve."""
        caps = [(self.usable_bytes - s.weights_total) / s.kv_bytes_per_token for s in self.stages]
        return max(0, int(min(caps)))

    @property
    def kv_tokens_needed(self) -> int:
        """KV tokens ``concurrency`` sequences at ``context`` hold (each stage holds all of them for its layers)."""
        return self.inputs.concurrency * self.inputs.context

    def weights_fit(self) -> bool:
        return all(s.weights_total < self.usable_bytes for s in self.stages)

    def fits(self) -> bool:
        """Weights fit and the KV cache holds every running sequence at the full context."""
        return self.weights_fit() and self.kv_capacity_tokens() >= self.kv_tokens_needed

    def max_sequences(self) -> int:
        return self.kv_capacity_tokens() // max(1, self.inputs.context)


def _attention_split(spec: Glm5Spec) -> tuple[int, int]:
    """(replicated, split-by-heads) MLA projection parameters of one layer."""
    replicated = spec.hidden_size * spec.q_lora_rank + spec.hidden_size * (spec.kv_lora_rank + spec.qk_rope_head_dim)
    return replicated, spec.attention_params - replicated


def make_plan(spec: Glm5Spec, gpu: GpuSpec, inputs: PlanInputs) -> Plan:
    tp, pp, b_total = inputs.tp, inputs.pp, inputs.concurrency
    if tp < 1 or pp < 1 or b_total < 1 or inputs.context < 1:
        raise Glm5Fp4Error("tp, pp, concurrency and context must be positive")
    if spec.num_attention_heads % tp:
        raise Glm5Fp4Error(f"tensor_parallel={tp} does not divide the {spec.num_attention_heads} attention heads")
    if not 0 < inputs.mem_util <= 1:
        raise Glm5Fp4Error(f"--mem-util {inputs.mem_util} must be in (0, 1]")
    ar_bw = inputs.allreduce_gbs or gpu.allreduce_bus_bandwidth_gbs
    ar_lat = inputs.allreduce_latency_us if inputs.allreduce_latency_us is not None else gpu.allreduce_latency_us
    if (tp > 1 or pp > 1) and (ar_bw is None or ar_lat is None):
        raise Glm5Fp4Error(f"the hardware table has no all-reduce numbers for {gpu.name}; pass --allreduce-gbs "
                           "and --allreduce-latency-us")
    p2p_bw = gpu.p2p_bandwidth_gbs or ar_bw
    expert_math = inputs.expert_math or ("nvfp4" if gpu.peak_tflops("nvfp4") else "bf16")
    expert_peak = gpu.peak_tflops(expert_math)
    bf16_peak = gpu.peak_tflops("bf16")
    if expert_peak is None or bf16_peak is None:
        raise Glm5Fp4Error(f"{gpu.name} has no dense {expert_math}/bf16 peak in the hardware table")
    eff = inputs.efficiency
    bw = gpu.bandwidth_bytes_per_s * eff
    expert_peak, bf16_peak = expert_peak * 1e12 * eff, bf16_peak * 1e12 * eff
    kv_kind = resolve_kv(inputs.engine, inputs.kv_cache_dtype)
    kv_row = kv_row_bytes(spec, kv_kind) + indexer_row_bytes(spec)

    b = math.ceil(b_total / pp)  # sequences per micro-batch
    ctx = inputs.context
    selected = min(ctx, spec.index_topk) if spec.index_topk is not None else ctx
    rep_attn, split_attn = _attention_split(spec)
    attn_params_rank = rep_attn + split_attn / tp + spec.indexer_params
    heads_rank = spec.num_attention_heads // tp
    touched = spec.expected_experts_touched(b)
    msg_bytes = b * spec.hidden_size * BF16_BYTES
    ar_one = 0.0 if tp == 1 else ar_lat * 1e-6 + 2 * (tp - 1) / tp * msg_bytes / (ar_bw * 1e9)

    stages = []
    for i, (lo, hi) in enumerate(pp_partition(spec.num_layers, pp)):
        n = hi - lo
        n_moe = sum(spec.is_moe_layer(layer) for layer in range(lo, hi))
        n_dense = n - n_moe
        first, last = i == 0, i == pp - 1
        w = {
            "routed experts (NVFP4)": n_moe * spec.n_routed_experts * spec.expert_params * NVFP4_BYTES / tp,
            "shared experts + dense MLPs (NVFP4)": (n_moe * spec.n_shared_experts * spec.expert_params
                                                   + n_dense * spec.dense_mlp_params) * NVFP4_BYTES / tp,
            "attention + DSA indexer (BF16)": n * attn_params_rank * BF16_BYTES,
            "router (BF16)": n_moe * spec.n_routed_experts * spec.hidden_size * BF16_BYTES,
            "embedding + lm_head (BF16)": ((spec.embedding_params if first else 0)
                                           + (spec.lm_head_params if last else 0)) * BF16_BYTES / tp,
        }
        st = StagePlan(i, (lo, hi), n_moe, n_dense, w, n * kv_row)
        # expert GEMM (routed)
        st.expert.add(n_moe * touched * spec.expert_params * NVFP4_BYTES / tp,
                      n_moe * 2 * b * spec.num_experts_per_tok * spec.expert_params / tp, bw, expert_peak)
        # attention: weights, selected latent KV, indexer keys over the whole context
        kv_read = b * (selected * kv_row_bytes(spec, kv_kind) + ctx * indexer_row_bytes(spec))
        mla = b * heads_rank * selected * 2 * (2 * spec.kv_lora_rank + spec.qk_rope_head_dim)
        index = b * ctx * spec.index_n_heads * spec.index_head_dim * 2 if spec.index_topk is not None else 0
        st.kv_read_bytes = n * kv_read
        st.attention.add(n * (attn_params_rank * BF16_BYTES + kv_read),
                         n * (2 * b * attn_params_rank + mla + index), bw, bf16_peak)
        # other: shared expert and dense MLPs (NVFP4), router and lm_head (BF16)
        mlp_params = (n_moe * spec.n_shared_experts * spec.expert_params + n_dense * spec.dense_mlp_params) / tp
        st.other.add(mlp_params * NVFP4_BYTES, 2 * b * mlp_params, bw, expert_peak)
        router = n_moe * spec.n_routed_experts * spec.hidden_size
        head = spec.lm_head_params / tp if last else 0
        st.other.add((router + head) * BF16_BYTES, 2 * b * (router + head), bw, bf16_peak)
        st.allreduce_calls = 2 * n if tp > 1 else 0
        st.allreduce_s = st.allreduce_calls * ar_one
        if not last:
            st.hop_s = ar_lat * 1e-6 + 2 * msg_bytes / (p2p_bw * 1e9)
        stages.append(st)

    usable = gpu.memory_gb * GIB * inputs.mem_util - inputs.reserve_gib * GIB
    kv_note = {"fp8": f"FP8 DSA latent row {kv_row_bytes(spec, 'fp8'):.0f} B/layer (kv_lora FP8 + FP32 scale per "
                      f"128 + rope BF16)",
               "bf16": f"BF16 latent {kv_row_bytes(spec, 'bf16'):.0f} B/layer",
               "nvfp4_ds_mla": "nvfp4_ds_mla row 352 B/layer (vLLM, SM100 FlashMLA only)"}[kv_kind]
    assumptions = [
        f"model: {spec.name} ({spec.num_layers} layers, {spec.moe_layers} MoE, {spec.n_routed_experts} experts top-"
        f"{spec.num_experts_per_tok}); no MTP layer, no speculative decoding",
        "precisions as nvidia/GLM-5-NVFP4: routed + shared experts and dense MLPs NVFP4 "
        f"({NVFP4_BYTES} B/param: 4-bit code + E4M3 scale per 16); attention, DSA indexer, router, embedding, "
        "lm_head BF16; norms ignored",
        "TP layout: experts split along the intermediate dim; q_a/kv_a projections and the DSA indexer replicated "
        "on every TP rank, q_b/kv_b/o split by heads; embedding and lm_head split by vocabulary",
        f"PP layout: layers split as vLLM does ({', '.join(f'{lo}-{hi - 1}' for lo, hi in pp_partition(spec.num_layers, pp))}); "
        f"{pp} micro-batch(es) of {b} sequences; step = PP x slowest stage",
        f"GPU: {gpu.display_name}, {gpu.memory_gb:g} GiB, {gpu.mem_bandwidth_gbs:g} GB/s, dense peaks "
        f"{expert_math} {gpu.peak_tflops(expert_math):g} / bf16 {gpu.peak_tflops('bf16'):g} TFLOPS"
        + (f", all roofs x{eff:g} efficiency" if eff != 1 else " (100 % of peak: a floor, not a forecast)"),
        f"expert GEMMs on the {expert_math} roof ({'W4A4: activations quantized to NVFP4' if expert_math == 'nvfp4' else 'W4A16: weights dequantized to BF16 MMA'}); "
        "attention on the BF16 roof",
        f"KV cache ({inputs.engine} kv_cache_dtype={inputs.kv_cache_dtype} -> {kv_kind}): {kv_note} + DSA indexer "
        f"key {indexer_row_bytes(spec):.0f} B/layer; latent replicated on every TP rank; each stage holds its layers'",
        f"attention reads the latent of min(context, index_topk) = {selected} selected tokens and the indexer keys "
        f"of all {ctx} tokens per sequence (every sequence at context {ctx})",
        f"distinct experts per MoE layer per micro-batch: E(1-(1-k/E)^b) = {touched:.1f} of {spec.n_routed_experts}",
        (f"all-reduce: 2 per layer of b x hidden BF16 = {msg_bytes / 1e6:.2f} MB, alpha {ar_lat:g} us + "
         f"2(n-1)/n x bytes / {ar_bw:g} GB/s bus bandwidth (measured NCCL on 8x RTX PRO 6000 PCIe, hardware.md "
         "section 3), not overlapped with compute" if tp > 1 else "no all-reduce (TP1)"),
        (f"PP hop: hidden + residual BF16 ({2 * msg_bytes / 1e6:.2f} MB) per stage boundary, alpha {ar_lat:g} us + "
         f"bytes / {p2p_bw:g} GB/s P2P" if pp > 1 else "no PP hop (PP1)"),
        f"memory: {inputs.mem_util:.2f} x {gpu.memory_gb:g} GiB minus {inputs.reserve_gib:g} GiB runtime reserve "
        "(activations, CUDA graphs, NCCL buffers) = usable; KV gets what weights leave",
        "kernels run back to back at their roofline time: no launch gaps, no overlap, no scheduler or sampling time",
    ]
    return Plan(inputs, gpu, spec, stages, b, kv_kind, usable, assumptions)
