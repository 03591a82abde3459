"""One cost model of a GLM-5 decode step: bytes, FLOPs and floor time per component on one GPU, per layout.

Both views of a decode step are this model: ``glm5-fp4 plan`` (:mod:`glm5_fp4.launch.plan`: memory per GPU, KV
capacity and the predicted step per layout) and the ceilings of every ``profile analyze`` breakdown
(:mod:`glm5_fp4.profiling.ceilings`). :func:`assumptions` states every modelling choice; both print it. Model
dimensions come from :class:`glm5_fp4.spec.Glm5Spec`, peaks and interconnect figures from :mod:`glm5_fp4.hardware`.

Each component is placed in the profiler category (``glm5_fp4/data/taxonomy.yaml``) its kernels fall in, so a
floor and a measured category time are about the same kernels:

========================  ===========  ============================================================================
component                 category     per pass of one micro-batch of ``b`` sequences, ``t`` tokens, one GPU
========================  ===========  ============================================================================
routed experts            expert_gemm  NVFP4 weights of the distinct experts the tokens touch (E(1-(1-k/E)^t)),
                                       x read and the output written once (any MoE kernel's minimum)
shared experts            other_gemm   run as separate linears (our backend, ``--disable-shared-experts-fusion``),
                                       stored as ``Precisions.dense`` (BF16 in a ``routed-only`` checkpoint)
dense MLPs                other_gemm   the first_k_dense layers' MLPs, stored as the shared experts
router                    other_gemm   BF16 gate, replicated
attention projections     other_gemm   q_a / kv_a replicated, q_b / kv_b / o split by heads
DSA indexer projections   other_gemm   wq_b, wk, weights_proj, replicated (vLLM: "no tensor parallel")
lm_head                   other_gemm   last stage, split by vocabulary
MLA core                  attention    the latent of min(context, index_topk) selected tokens per sequence, new rows
DSA indexer scan          attention    every cached FP8 index key per sequence, new keys
all-reduce                allreduce    2 per layer (+ the embedding's on the first stage), ring model
all-to-all                allreduce    DP attention + EP (``a2a``): dispatch and combine to each token's experts' GPUs
all-gather + reduce-sc.   allreduce    DP attention + EP (``agrs``): every GPU gathers all tokens, partial sums
                                       reduce-scattered (what vLLM and SGLang run on PCIe without DeepEP)
PP send/recv              allreduce    hidden + residual per stage boundary
========================  ===========  ============================================================================

A compute component's floor is ``max(bytes / bandwidth, FLOPs / dense peak of its MMA dtype)``; a category's floor
is the sum of its components' (each runs as its own kernels). The step is ``PP x the slowest stage``.

Group sizes: every part of a layer is split over its own group (:class:`Layout`: heads over ``attn_tp``, sequences
over ``attn_dp``, shared experts / dense MLPs / vocabulary over ``mlp_tp``, expert intermediates over ``moe_tp``,
experts over ``ep``). Modelled layouts: TP x PP; TP with expert parallelism (``tp8ep8``: attention TP, 32 whole
experts per GPU, partial sums all-reduced as under TP); data-parallel attention with expert parallelism
(``dp8ep8``: each GPU its own sequences and whole attention, tokens travel to their experts' GPUs by all-to-all;
``dp8ep8agrs``: the same, but the tokens of all GPUs are all-gathered before the MoE and the partial sums
reduce-scattered after it, as vLLM's ``allgather_reducescatter`` and SGLang's ``--moe-a2a-backend none`` do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.hardware import GpuSpec
from glm5_fp4.nvfp4 import BYTES_PER_ELEMENT as NVFP4_BYTES
from glm5_fp4.spec import BF16_BYTES, FP8_BYTES, FP8_CACHE_SCALE_BLOCK, KV_KINDS, Glm5Spec, expected_distinct_groups

# Profiler categories the model covers (other / memcpy: norms, activations, routing, sampling are not modelled).
CATEGORIES = ("expert_gemm", "attention", "other_gemm", "allreduce")
# How tokens reach their experts with data-parallel attention: an all-to-all to the GPUs of each token's experts
# (DeepEP-style kernels; NVLink/RDMA) or an all-gather of every GPU's tokens + a reduce-scatter of the partial sums.
EP_COMMS = ("a2a", "agrs")
WEIGHT_BYTES = {"nvfp4": NVFP4_BYTES, "fp8": FP8_BYTES, "bf16": BF16_BYTES}
ACT_BYTES = BF16_BYTES  # activations between kernels


@dataclass(frozen=True)
class Layout:
    """How the model is spread over GPUs: ``tp`` GPUs per pipeline stage (the world of one stage), ``pp`` stages;
    of a stage's GPUs, ``dp`` run attention data-parallel (1 or all of them) and ``ep`` split the experts;
    ``ep_comm`` (:data:`EP_COMMS`): how tokens reach their experts behind data-parallel attention."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    ep_comm: str = "a2a"

    # The group each part of a layer is split over.
    @property
    def attn_tp(self) -> int:
        """Attention heads (and the vocabulary) are split over this many GPUs."""
        return self.tp // self.dp

    @property
    def attn_dp(self) -> int:
        """Sequences are split over this many GPUs (each holds and reads only its own sequences' KV)."""
        return self.dp

    @property
    def mlp_tp(self) -> int:
        """Shared experts and dense MLPs run on the attention's tokens, split like its heads."""
        return self.attn_tp

    @property
    def moe_tp(self) -> int:
        """Each routed expert's intermediate dim is split over this many GPUs (1: whole experts)."""
        return self.tp // self.ep

    @property
    def name(self) -> str:
        head = f"DP{self.dp}+EP{self.ep}" if self.dp > 1 else f"TP{self.tp}" + (f"+EP{self.ep}" if self.ep > 1 else "")
        head += "(AG/RS)" if self.gathers else ""
        return head + (f"+PP{self.pp}" if self.pp > 1 else "")

    @property
    def gathers(self) -> bool:
        """Data-parallel attention whose MoE all-gathers every GPU's tokens (and reduce-scatters the sums)."""
        return self.dp > 1 and self.ep_comm == "agrs"

    def validate(self, spec: Glm5Spec) -> None:
        if min(self.tp, self.pp, self.dp, self.ep) < 1:
            raise Glm5Fp4Error(f"layout {self.name}: tp, pp, dp and ep must be >= 1")
        if self.ep_comm not in EP_COMMS:
            raise Glm5Fp4Error(f"layout {self.name}: expert-parallel communication must be one of "
                               f"{', '.join(EP_COMMS)}, got {self.ep_comm!r}")
        if self.ep_comm != "a2a" and self.dp == 1:
            raise Glm5Fp4Error(f"layout {self.name}: {self.ep_comm} applies to data-parallel attention only (with "
                               "attention TP every GPU already holds every token; the partial sums are all-reduced)")
        if self.dp not in (1, self.tp):
            raise Glm5Fp4Error(f"layout {self.name}: data-parallel attention is modelled over all {self.tp} GPUs of a "
                               f"stage (dp=1 or dp={self.tp}), not dp={self.dp}")
        if self.dp > 1 and self.ep != self.tp:
            raise Glm5Fp4Error(f"layout {self.name}: data-parallel attention is modelled with expert parallelism over "
                               f"the same {self.tp} GPUs (ep={self.tp}); MoE tensor parallelism behind DP attention "
                               "(all-gather / reduce-scatter) is not")
        if self.tp % self.ep or spec.n_routed_experts % self.ep:
            raise Glm5Fp4Error(f"layout {self.name}: ep={self.ep} must divide tp={self.tp} and the "
                               f"{spec.n_routed_experts} experts")
        if spec.num_attention_heads % self.attn_tp:
            raise Glm5Fp4Error(f"tensor_parallel={self.tp} does not divide the {spec.num_attention_heads} attention heads")
        if self.pp > spec.num_layers:
            raise Glm5Fp4Error(f"pipeline_parallel={self.pp} exceeds the model's {spec.num_layers} layers")


@dataclass(frozen=True)
class Precisions:
    """Storage of each weight class and of the KV cache; the MMA dtype of the expert GEMMs."""

    experts: str = "nvfp4"  # routed experts
    # shared experts and dense MLPs; None: as the routed experts (make-checkpoint's glm5 recipe, nvidia/GLM-5-NVFP4);
    # the routed-only recipe (GLM-5.1/5.2-NVFP4) leaves them BF16
    dense: str | None = None
    attention: str = "bf16"  # attention and indexer projections
    kv: str = "fp8"  # latent KV row kind (spec.KV_KINDS)
    expert_math: str | None = None  # None: the storage dtype where the GPU has that tensor-core path, else bf16
    dispatch: str = "bf16"  # all-to-all dispatch of hidden states (fp8: E4M3 + an FP32 scale per 128, as DeepEP)

    @property
    def dense_dtype(self) -> str:
        """Storage of the shared experts and dense MLPs."""
        return self.dense or self.experts

    def dense_math(self, expert_math: str, gpu: GpuSpec) -> str:
        """The MMA dtype of the shared experts and dense MLPs: the routed experts' where they are stored alike."""
        return expert_math if self.dense_dtype == self.experts else math_dtype(self.dense_dtype, gpu)

    def validate(self) -> None:
        for name, dtype in (("experts", self.experts), ("dense", self.dense_dtype), ("attention", self.attention)):
            if dtype not in WEIGHT_BYTES:
                raise Glm5Fp4Error(f"{name} weights must be one of {sorted(WEIGHT_BYTES)}, got {dtype!r}")
        if self.kv not in KV_KINDS:
            raise Glm5Fp4Error(f"KV cache kind must be one of {', '.join(KV_KINDS)}, got {self.kv!r}")
        if self.dispatch not in ("bf16", "fp8"):
            raise Glm5Fp4Error(f"all-to-all dispatch dtype must be bf16 or fp8, got {self.dispatch!r}")

    def dispatch_bytes(self, hidden: int) -> float:
        """Bytes of one token's hidden state as dispatched."""
        if self.dispatch == "fp8":
            return hidden * FP8_BYTES + math.ceil(hidden / FP8_CACHE_SCALE_BLOCK) * 4
        return hidden * ACT_BYTES


@dataclass(frozen=True)
class Interconnect:
    allreduce_gbs: float | None  # NCCL bus bandwidth
    allreduce_latency_us: float | None
    p2p_gbs: float | None
    source: str = "hardware table"

    @classmethod
    def of(cls, gpu: GpuSpec, allreduce_gbs: float | None = None, allreduce_latency_us: float | None = None) -> "Interconnect":
        """The hardware table's figures (glm5_fp4/data/hardware.yaml, each with its source), with overrides."""
        ar = allreduce_gbs if allreduce_gbs is not None else gpu.allreduce_bus_bandwidth_gbs
        lat = allreduce_latency_us if allreduce_latency_us is not None else gpu.allreduce_latency_us
        overridden = allreduce_gbs is not None or allreduce_latency_us is not None
        return cls(ar, lat, gpu.p2p_bandwidth_gbs or ar,
                   "overridden on the command line" if overridden else f"hardware table entry {gpu.name}")

    @property
    def known(self) -> bool:
        return self.allreduce_gbs is not None and self.allreduce_latency_us is not None


@dataclass
class Component:
    """One part of a stage's work on one GPU, for one pass of a micro-batch through the stage."""

    name: str
    category: str | None  # None: held in memory only (embedding)
    weights: float = 0.0  # bytes resident per GPU
    bytes: float = 0.0  # bytes moved (communication: bytes on the wire)
    flops: float = 0.0
    compute_dtype: str | None = None
    calls: int = 0  # collectives
    note: str = ""
    # set by the costing: bytes / bandwidth, FLOPs / peak, the floor (None where the hardware table lacks a figure)
    t_memory: float | None = None
    t_compute: float | None = None
    seconds: float | None = 0.0
    memory_bound: bool = True


@dataclass
class CategoryCost:
    category: str
    components: list[Component]

    @property
    def bytes(self) -> float:
        return sum(c.bytes for c in self.components)

    @property
    def flops(self) -> float:
        return sum(c.flops for c in self.components)

    @property
    def seconds(self) -> float | None:
        parts = [c.seconds for c in self.components]
        return None if any(p is None for p in parts) else sum(parts)

    @property
    def t_memory(self) -> float | None:
        parts = [c.t_memory for c in self.components if c.t_memory is not None]
        return sum(parts) if parts else None

    @property
    def t_compute(self) -> float | None:
        parts = [c.t_compute for c in self.components if c.t_compute is not None]
        return sum(parts) if parts else None

    @property
    def compute_dtype(self) -> str | None:
        """The MMA dtype of most of the category's FLOPs."""
        dtypes = [c for c in self.components if c.compute_dtype]
        return max(dtypes, key=lambda c: c.flops).compute_dtype if dtypes else None

    @property
    def bound(self) -> str:
        mem = sum(c.seconds or 0.0 for c in self.components if c.memory_bound)
        return "memory" if mem >= (self.seconds or 0.0) / 2 else "compute"


@dataclass
class StageCost:
    index: int
    layers: tuple[int, int]
    moe_layers: int
    dense_layers: int
    components: list[Component]
    kv_bytes_per_token: float  # KV cache per cached token per GPU (this stage's layers)

    def component(self, name: str) -> Component:
        return next(c for c in self.components if c.name == name)

    def category(self, category: str) -> CategoryCost:
        return CategoryCost(category, [c for c in self.components if c.category == category])

    @property
    def weights(self) -> dict[str, float]:
        return {c.name: c.weights for c in self.components if c.weights}

    @property
    def weights_total(self) -> float:
        return sum(c.weights for c in self.components)

    @property
    def seconds(self) -> float | None:
        parts = [self.category(c).seconds for c in CATEGORIES]
        return None if any(p is None for p in parts) else sum(parts)


@dataclass
class StepCost:
    """One decode step of ``batch`` sequences on ``layout``: every stage's components on one of its GPUs."""

    spec: Glm5Spec
    gpu: GpuSpec
    layout: Layout
    precisions: Precisions
    batch: int
    context: int
    tokens_per_seq: int
    micro_batch: int  # sequences per micro-batch on one GPU (PP keeps ``pp`` in flight; DP splits them)
    expert_skew: float
    expert_math: str
    efficiency: float
    interconnect: Interconnect
    stages: list[StageCost]

    @property
    def bottleneck(self) -> StageCost:
        """The stage that sets the pace (slowest)."""
        return max(self.stages, key=lambda s: s.seconds or 0.0)

    @property
    def heaviest(self) -> StageCost:
        return max(self.stages, key=lambda s: s.weights_total)

    @property
    def step_s(self) -> float | None:
        """Decode step time: every sequence gets a token once each micro-batch has passed the slowest stage."""
        s = self.bottleneck.seconds
        return None if s is None else self.layout.pp * s

    def per_step(self, category: str, stages: str = "bottleneck") -> float | None:
        """A category's floor over one decode step on one GPU: of the slowest stage (``bottleneck``: what the
        step waits for) or averaged over stages (``mean``: what a rank's kernels take, on average)."""
        if stages == "bottleneck":
            s = self.bottleneck.category(category).seconds
            return None if s is None else self.layout.pp * s
        parts = [st.category(category).seconds for st in self.stages]
        return None if any(p is None for p in parts) else self.layout.pp * sum(parts) / len(parts)

    def category_mean(self, category: str) -> tuple[float, float]:
        """(bytes, FLOPs) of a category per step on one GPU, averaged over stages."""
        cats = [st.category(category) for st in self.stages]
        pp = self.layout.pp
        return pp * sum(c.bytes for c in cats) / len(cats), pp * sum(c.flops for c in cats) / len(cats)

    @property
    def kv_tokens_per_gpu(self) -> int:
        """KV tokens the running sequences keep on each GPU (MLA's latent is replicated over the heads' group)."""
        return math.ceil(self.batch / self.layout.attn_dp) * self.context


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


def math_dtype(storage: str, gpu: GpuSpec) -> str:
    """The MMA dtype a GEMM with weights stored as ``storage`` runs in (weight-only BF16 where the GPU lacks it)."""
    return storage if gpu.peak_tflops(storage) else "bf16"


def routed_experts(spec: Glm5Spec, tokens: float, layout: Layout, weight_bytes: float = NVFP4_BYTES,
                   expert_math: str | None = None, skew: float = 0.0) -> Component:
    """The routed experts of ONE MoE layer on one GPU, for ``tokens`` tokens routed through its expert group (the
    kernel floors use this too). With expert parallelism the GPU holds ``E / ep`` experts; ``skew``: its share of the
    token-slots over the mean - 1 (a hot GPU: the step waits for the hottest)."""
    e_local = spec.n_routed_experts / layout.ep
    load = tokens * (1.0 + skew) if layout.ep > 1 else tokens  # without EP a hot expert is on every GPU
    touched = min(e_local, spec.expected_experts_touched(load) / layout.ep)
    per_expert = spec.expert_params / layout.moe_tp
    # x read and the output written once per token this GPU sees: with an all-to-all the ones dispatched to it (the
    # hottest GPU more), otherwise every token of the group (attention TP, or all-gathered), whatever the routing
    a2a = layout.attn_dp > 1 and not layout.gathers
    seen = min(tokens, load * expected_distinct_groups(spec.n_routed_experts, spec.num_experts_per_tok, layout.ep)
               / layout.ep) if a2a else tokens  # a token reaches a GPU once, however many of its experts are there
    return Component(
        "routed experts", "expert_gemm", weights=e_local * per_expert * weight_bytes,
        bytes=touched * per_expert * weight_bytes + 2 * seen * spec.hidden_size * ACT_BYTES,
        flops=2.0 * load * spec.num_experts_per_tok * per_expert / layout.ep, compute_dtype=expert_math,
        note=f"{touched:.1f} of {e_local:g} experts touched per layer")


def _stage(spec: Glm5Spec, layout: Layout, prec: Precisions, gpu: GpuSpec, expert_math: str, skew: float, index: int,
           lo: int, hi: int, b: int, t: int, context: int) -> StageCost:
    n = hi - lo
    n_moe = sum(spec.is_moe_layer(layer) for layer in range(lo, hi))
    n_dense = n - n_moe
    first, last = index == 0, index == layout.pp - 1
    h, act = spec.hidden_size, ACT_BYTES
    we, wd, wa = WEIGHT_BYTES[prec.experts], WEIGHT_BYTES[prec.dense_dtype], WEIGHT_BYTES[prec.attention]
    dense_math = prec.dense_math(expert_math, gpu)
    heads = spec.num_attention_heads / layout.attn_tp
    dsa = spec.index_topk is not None
    attn_math = math_dtype(prec.attention, gpu)
    comps: list[Component] = []

    # -- MoE and MLP GEMMs
    one = routed_experts(spec, t * layout.attn_dp, layout, we, expert_math, skew)
    comps.append(Component(one.name, one.category, weights=n_moe * one.weights, bytes=n_moe * one.bytes,
                           flops=n_moe * one.flops, compute_dtype=expert_math, note=one.note))
    i_tp = spec.moe_intermediate_size / layout.mlp_tp
    shared = spec.n_shared_experts * spec.expert_params / layout.mlp_tp
    comps.append(Component("shared experts", "other_gemm", weights=n_moe * shared * wd,
                           bytes=n_moe * (shared * wd + t * spec.n_shared_experts * (2 * h + 3 * i_tp) * act),
                           flops=n_moe * 2.0 * t * shared, compute_dtype=dense_math))
    dense = spec.dense_mlp_params / layout.mlp_tp
    comps.append(Component("dense MLPs", "other_gemm", weights=n_dense * dense * wd,
                           bytes=n_dense * (dense * wd + t * (2 * h + 3 * spec.intermediate_size / layout.mlp_tp) * act),
                           flops=n_dense * 2.0 * t * dense, compute_dtype=dense_math))
    router = spec.n_routed_experts * h
    comps.append(Component("router", "other_gemm", weights=n_moe * router * BF16_BYTES,
                           bytes=n_moe * (router * BF16_BYTES + t * (h + spec.n_routed_experts) * act),
                           flops=n_moe * 2.0 * t * router, compute_dtype="bf16"))

    # -- attention projections (other GEMMs) and the attention kernels
    replicated = h * spec.q_lora_rank + h * (spec.kv_lora_rank + spec.qk_rope_head_dim)
    proj = replicated + (spec.attention_params - replicated) / layout.attn_tp
    lora, rope, nope, v = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.qk_nope_head_dim, spec.v_head_dim
    proj_act = ((h + spec.q_lora_rank) + (h + lora + rope) + (spec.q_lora_rank + heads * spec.qk_head_dim)  # q_a kv_a q_b
                + heads * (nope + lora) + heads * (lora + v) + (heads * v + h))  # absorbed kv_b (k and v side), o
    comps.append(Component("attention projections", "other_gemm", weights=n * proj * wa,
                           bytes=n * (proj * wa + t * proj_act * act), flops=n * 2.0 * t * proj,
                           compute_dtype=attn_math))
    if dsa:
        ni, di = spec.index_n_heads, spec.index_head_dim
        idx_act = (spec.q_lora_rank + ni * di) + (h + di) + (h + ni)
        comps.append(Component("DSA indexer projections", "other_gemm", weights=n * spec.indexer_params * wa,
                               bytes=n * (spec.indexer_params * wa + t * idx_act * act),
                               flops=n * 2.0 * t * spec.indexer_params, compute_dtype=attn_math))
    row, idx_row = spec.kv_row_bytes(prec.kv), spec.indexer_row_bytes()
    selected = spec.selected_tokens(context)
    comps.append(Component(
        "MLA core", "attention",
        # every query token of a sequence reads the same selected latents; new rows written; q in, out
        bytes=n * (b * selected * row + t * row + t * heads * (lora + rope + lora) * act),
        flops=n * t * spec.mla_flops_per_token_layer(context, heads), compute_dtype="bf16",
        note=f"{selected} selected of {context} cached tokens per sequence"))
    if dsa:
        comps.append(Component(
            "DSA indexer scan", "attention", bytes=n * (b * context * idx_row + t * idx_row),
            flops=n * 2.0 * t * context * spec.index_n_heads * spec.index_head_dim, compute_dtype=math_dtype("fp8", gpu),
            note="every cached index key of every sequence, on every rank"))
    if last:
        head = spec.lm_head_params / layout.mlp_tp
        comps.append(Component("lm_head", "other_gemm", weights=head * BF16_BYTES,
                               bytes=head * BF16_BYTES + t * (h + spec.vocab_size / layout.mlp_tp) * act,
                               flops=2.0 * t * head, compute_dtype="bf16"))
    if first:
        comps.append(Component("embedding", None, weights=spec.embedding_params / layout.mlp_tp * BF16_BYTES))

    # -- communication
    tp = layout.attn_tp
    calls = (2 * n + (1 if first else 0)) if tp > 1 else 0  # + the vocab-parallel embedding's all-reduce
    comps.append(Component("all-reduce", "allreduce", bytes=calls * 2 * (tp - 1) / tp * t * h * act, calls=calls,
                           note=f"{calls} of {t * h * act / 1e6:.2f} MB" if calls else f"none ({layout.name})"))
    if layout.gathers:
        # before each MoE layer every GPU gathers all GPUs' tokens; after it the BF16 partial sums of all tokens are
        # reduce-scattered back to the tokens' own GPUs: ring collectives, (n-1)/n of the buffer over each GPU's link,
        # whatever the routing
        n_ep, tokens = layout.ep, t * layout.attn_dp
        per_layer = (n_ep - 1) / n_ep * tokens * (prec.dispatch_bytes(h) + h * act)
        comps.append(Component("all-gather + reduce-scatter", "allreduce", bytes=n_moe * per_layer, calls=2 * n_moe,
                               note=f"{tokens} tokens gathered and reduce-scattered per MoE layer"))
    elif layout.attn_dp > 1:
        # each token goes to the distinct GPUs of its k experts (the local one over no link) and comes back in BF16;
        # the hottest GPU receives (1 + skew) x the mean, but each other GPU's token once at most: ep - 1 of them
        remote = expected_distinct_groups(spec.n_routed_experts, spec.num_experts_per_tok, layout.ep) \
            * (layout.ep - 1) / layout.ep
        per_layer = t * min(remote * (1.0 + skew), layout.ep - 1) * (prec.dispatch_bytes(h) + h * act)
        comps.append(Component("all-to-all", "allreduce", bytes=n_moe * per_layer, calls=2 * n_moe,
                               note=f"dispatch + combine, {remote:.2f} remote GPUs per token"))
    if not last:
        comps.append(Component("PP send/recv", "allreduce", bytes=2 * t * h * act, calls=1,
                               note="hidden + residual to the next stage"))
    kv = n * (row + idx_row)
    return StageCost(index, (lo, hi), n_moe, n_dense, comps, kv)


def _cost(c: Component, gpu: GpuSpec, eff: float, net: Interconnect) -> None:
    if c.category is None:
        c.seconds = 0.0
        return
    if c.category == "allreduce":
        c.memory_bound = False
        if not c.calls:
            c.seconds = 0.0
        elif not net.known:
            c.seconds = None
        elif c.name in ("PP send/recv", "all-to-all"):  # point to point: each GPU's own link
            c.seconds = c.calls * net.allreduce_latency_us * 1e-6 + c.bytes / (net.p2p_gbs * 1e9)
        else:
            c.seconds = c.calls * net.allreduce_latency_us * 1e-6 + c.bytes / (net.allreduce_gbs * 1e9)
        return
    peak = gpu.peak_tflops(c.compute_dtype)
    c.t_memory = c.bytes / (gpu.bandwidth_bytes_per_s * eff)
    c.t_compute = c.flops / (peak * 1e12 * eff)
    c.seconds = max(c.t_memory, c.t_compute)
    c.memory_bound = c.t_memory >= c.t_compute


def decode_step(spec: Glm5Spec, gpu: GpuSpec, layout: Layout, batch: int, context: int,
                precisions: Precisions = Precisions(), tokens_per_seq: int = 1, efficiency: float = 1.0,
                interconnect: Interconnect | None = None, expert_skew: float = 0.0) -> StepCost:
    """The cost of one decode step of ``batch`` sequences at ``context`` cached tokens each. ``expert_skew``: how
    much more than the mean the hottest expert-parallel GPU receives (0: uniform routing)."""
    layout.validate(spec)
    precisions.validate()
    if batch < 1 or context < 0 or tokens_per_seq < 1:
        raise Glm5Fp4Error(f"batch ({batch}) and tokens_per_seq ({tokens_per_seq}) must be >= 1, context ({context}) >= 0")
    if not 0 < efficiency <= 1:
        raise Glm5Fp4Error(f"efficiency {efficiency} must be in (0, 1]")
    if not 0 <= expert_skew < math.inf:  # NaN fails this test, where `expert_skew < 0` would let it through
        raise Glm5Fp4Error(f"expert skew {expert_skew} must be a finite number >= 0")
    check_expert_skew(spec, layout.ep, expert_skew)
    net = interconnect or Interconnect.of(gpu)
    expert_math = precisions.expert_math or math_dtype(precisions.experts, gpu)
    if gpu.peak_tflops(expert_math) is None or gpu.peak_tflops("bf16") is None:
        raise Glm5Fp4Error(f"{gpu.name} has no dense {expert_math}/bf16 peak in the hardware table")
    b = math.ceil(batch / layout.pp / layout.attn_dp)  # sequences per micro-batch on one GPU
    stages = [_stage(spec, layout, precisions, gpu, expert_math, expert_skew, i, lo, hi, b, b * tokens_per_seq, context)
              for i, (lo, hi) in enumerate(pp_partition(spec.num_layers, layout.pp))]
    for st in stages:
        for c in st.components:
            _cost(c, gpu, efficiency, net)
    return StepCost(spec, gpu, layout, precisions, batch, context, tokens_per_seq, b, expert_skew, expert_math,
                    efficiency, net, stages)


def assumptions(cost: StepCost) -> list[str]:
    """Every modelling choice of :func:`decode_step`, with this step's numbers."""
    spec, gpu, lay, prec, net = cost.spec, cost.gpu, cost.layout, cost.precisions, cost.interconnect
    b, t = cost.micro_batch, cost.micro_batch * cost.tokens_per_seq
    selected = spec.selected_tokens(cost.context)
    ar_size = t * spec.hidden_size * ACT_BYTES
    kv_note = {"fp8": "FP8 DSA latent row (kv_lora FP8 + FP32 scale per 128 + rope BF16; vLLM fp8_ds_mla, "
                      "SGLang's DSA FP8 pool)",
               "bf16": "BF16 latent row", "nvfp4_ds_mla": "vLLM nvfp4_ds_mla row (SM100 FlashMLA only)"}[prec.kv]
    eff = cost.efficiency
    dense_math = prec.dense_math(cost.expert_math, gpu)
    out = [
        f"model: {spec.name} ({spec.num_layers} layers, {spec.moe_layers} MoE, {spec.n_routed_experts} experts top-"
        f"{spec.num_experts_per_tok} + {spec.n_shared_experts} shared); no MTP layer, "
        + (f"{cost.tokens_per_seq} tokens per sequence per step" if cost.tokens_per_seq > 1 else "no speculative decoding"),
        "weights: " + (f"experts, shared experts and dense MLPs {_storage(prec.experts)}"
                       if prec.dense_dtype == prec.experts else
                       f"routed experts {_storage(prec.experts)}, shared experts and dense MLPs "
                       f"{_storage(prec.dense_dtype)}")
        + f"; attention and DSA indexer projections {prec.attention.upper()}; router, embedding, lm_head BF16; "
        "norms ignored",
        _layout_assumption(spec, lay, cost),
        (f"PP: layers split as vLLM does ({', '.join(f'{lo}-{hi - 1}' for lo, hi in pp_partition(spec.num_layers, lay.pp))}); "
         f"{lay.pp} micro-batches of {b} sequences; step = PP x slowest stage" if lay.pp > 1
         else f"one micro-batch of {b} sequences"),
        f"GPU: {gpu.display_name}, {gpu.mem_bandwidth_gbs:g} GB/s, dense peaks {cost.expert_math} "
        f"{gpu.peak_tflops(cost.expert_math):g}"
        + ("" if dense_math in (cost.expert_math, "bf16") else f" / {dense_math} {gpu.peak_tflops(dense_math):g}")
        + f" / bf16 {gpu.peak_tflops('bf16'):g} TFLOPS"
        + (f", all roofs x{eff:g} efficiency" if eff != 1 else " (100 % of peak: a floor, not a forecast)"),
        f"expert GEMMs on the {cost.expert_math} roof ("
        + ("W4A4: activations quantized to NVFP4" if cost.expert_math == "nvfp4" else "W4A16: weights dequantized to BF16 MMA"
           if cost.expert_math == "bf16" else f"{cost.expert_math} MMA")
        + ")" + ("" if dense_math == cost.expert_math else f", shared experts and dense MLPs on the {dense_math} roof")
        + "; MLA on the BF16 roof, the DSA indexer scan on FP8 where the GPU has it",
        f"routed experts: distinct experts per MoE layer per micro-batch E(1-(1-k/E)^t) = "
        f"{spec.expected_experts_touched(t * lay.attn_dp):.1f} of {spec.n_routed_experts} (uniform routing"
        + (f"; t = the {t * lay.attn_dp} tokens of all {lay.attn_dp} GPUs, which reach their experts' GPUs"
           if lay.attn_dp > 1 else "")
        + "), each streamed once; x read and the output written once",
        f"shared experts as separate {prec.dense_dtype.upper()} linears (other GEMM), as vLLM runs them outside the "
        "MoE kernel and our SGLang profiles with --disable-shared-experts-fusion",
        f"KV cache ({prec.kv}): {kv_note} {spec.kv_row_bytes(prec.kv):.0f} B/layer + DSA indexer key "
        f"{spec.indexer_row_bytes():.0f} B/layer (FP8 + FP32 scale per 128); "
        + ("each GPU holds only its own sequences' (DP attention)" if lay.attn_dp > 1
           else "latent replicated on every TP rank"),
        f"attention reads the latent of min(context, index_topk) = {selected} selected tokens and the indexer keys "
        f"of all {cost.context} tokens per sequence (every sequence at context {cost.context})",
        (f"all-reduce: 2 per layer + 1 for the embedding (first stage), b x hidden BF16 = {ar_size / 1e6:.2f} MB, alpha "
         f"{net.allreduce_latency_us:g} us + 2(n-1)/n x bytes / {net.allreduce_gbs:g} GB/s bus bandwidth ({net.source}), "
         "not overlapped with compute" if lay.attn_tp > 1 and net.known else
         "all-reduce: no latency/bus-bandwidth figures for this GPU (no floor)" if lay.attn_tp > 1 else
         "no all-reduce (attention TP1: data-parallel attention)" if lay.attn_dp > 1 else "no all-reduce (TP1)"),
        *_a2a_assumption(spec, lay, cost),
        (f"PP hop: hidden + residual BF16 ({2 * ar_size / 1e6:.2f} MB) per stage boundary, alpha "
         f"{net.allreduce_latency_us:g} us + bytes / {net.p2p_gbs:g} GB/s P2P" if lay.pp > 1 and net.known
         else "no PP hop (PP1)" if lay.pp == 1 else "PP hop: no P2P figures for this GPU (no floor)"),
        "kernels run back to back at their roofline time: no launch gaps, no overlap; norms, activations, routing "
        "and sampling not modelled",
    ]
    return out


def _storage(dtype: str) -> str:
    code = ": 4-bit code + E4M3 scale per 16" if dtype == "nvfp4" else ""
    return f"{dtype} ({WEIGHT_BYTES[dtype]:g} B/param{code})"


def _layout_assumption(spec: Glm5Spec, lay: Layout, cost: StepCost) -> str:
    e_local = spec.n_routed_experts // lay.ep
    experts = (f"{e_local} whole experts per GPU (EP{lay.ep})" if lay.moe_tp == 1 else
               f"{e_local} experts per GPU split {lay.moe_tp} ways along the intermediate dim" if lay.ep > 1 else
               "experts split along the intermediate dim")
    if lay.attn_dp > 1:
        return (f"{lay.name}: attention data-parallel: each GPU holds the whole attention and DSA indexer and runs its "
                f"own {cost.micro_batch} sequences; shared expert, dense MLPs, embedding and lm_head whole on every GPU "
                f"(vLLM --data-parallel-size {lay.dp} -tp 1; SGLang --attn-dp-size {lay.dp} --enable-dp-lm-head "
                f"--moe-dense-tp-size 1); {experts}")
    return (f"{lay.name}: {experts}; q_a/kv_a projections and the DSA indexer replicated on every TP rank, q_b/kv_b/o "
            "split by heads; shared expert and dense MLPs split like the heads; embedding and lm_head split by vocabulary"
            + ("; routed partial sums all-reduced as under TP" if lay.ep > 1 else ""))


def check_expert_skew(spec: Glm5Spec, ep: int, skew: float) -> None:
    """Refuse a skew no EP layout can have: the hottest GPU holds at most min(k, E/ep) of each token's k slots,
    against a mean of k/ep (GLM-5, EP8: every slot, a skew of ep - 1 = 7). Without expert parallelism any skew is
    allowed (it changes nothing, as the callers say)."""
    if ep <= 1:
        return
    k = spec.num_experts_per_tok
    held = min(k, spec.n_routed_experts // ep)
    most = ep * held / k - 1
    if skew > most:
        raise Glm5Fp4Error(f"expert skew {skew:g} is past what one GPU can hold: at most {most:g} with {ep}-way expert "
                           f"parallelism (the hottest GPU holds at most {held} of each token's {k} slots; skew: its "
                           "slots over the mean, minus 1)")


def _a2a_assumption(spec: Glm5Spec, lay: Layout, cost: StepCost) -> list[str]:
    out = []
    if lay.ep > 1:
        out.append(f"expert load: the hottest EP GPU gets {1 + cost.expert_skew:g}x the mean token-slots "
                   f"(--expert-skew {cost.expert_skew:g}; 0 = uniform routing) and the step waits for it")
    if (lay.gathers or lay.attn_dp > 1) and not cost.interconnect.known:
        out.append(f"{'all-gather + reduce-scatter' if lay.gathers else 'all-to-all'}: no latency/bus-bandwidth "
                   "figures for this GPU (no floor; add them with a GLM5_FP4_HARDWARE file)")
        return out
    if lay.gathers:
        net, tokens = cost.interconnect, cost.micro_batch * cost.tokens_per_seq * lay.attn_dp
        out.append(
            f"all-gather + reduce-scatter (vLLM --all2all-backend allgather_reducescatter, SGLang --moe-a2a-backend "
            f"none): per MoE layer every GPU gathers the hidden states of all {tokens} tokens of the {lay.ep} GPUs as "
            f"{cost.precisions.dispatch.upper()} ({cost.precisions.dispatch_bytes(spec.hidden_size):,.0f} B each) and "
            f"runs its experts on them; the BF16 partial sums ({spec.hidden_size * ACT_BYTES:,.0f} B per token) are "
            f"reduce-scattered back; ring collectives: alpha {net.allreduce_latency_us:g} us each + (n-1)/n x bytes / "
            f"{net.allreduce_gbs:g} GB/s bus bandwidth, the same for any routing skew, not overlapped with compute; "
            "not modelled: vLLM also gathers the router logits, SGLang runs the router and the shared expert "
            "(split over the GPUs) on the gathered tokens")
    elif lay.attn_dp > 1:
        d = expected_distinct_groups(spec.n_routed_experts, spec.num_experts_per_tok, lay.ep)
        net = cost.interconnect
        out.append(
            f"all-to-all: per token, dispatch to the distinct GPUs of its {spec.num_experts_per_tok} experts "
            f"({d:.2f} of {lay.ep} expected, {d * (lay.ep - 1) / lay.ep:.2f} remote) as "
            f"{cost.precisions.dispatch.upper()} ({cost.precisions.dispatch_bytes(spec.hidden_size):,.0f} B), "
            f"combine back as BF16 ({spec.hidden_size * ACT_BYTES:,.0f} B); 2 per MoE layer, alpha "
            f"{net.allreduce_latency_us:g} us each + bytes received by the hottest GPU / {net.p2p_gbs:g} GB/s P2P "
            "(each GPU's PCIe link, both directions at once), not overlapped with compute")
    return out
