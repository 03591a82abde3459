"""Synthetic multi-rank Kineto traces of a decode loop, with the ground truth that produced them.

A test double (it lives under tests/, not in the package): used by the profiling tests and by
``benchmarks/trace_analysis.py``. The ranks run in lock step: a collective kernel
starts on each rank when that rank gets there and ends on every rank when the last one has arrived plus the
collective's own work, so the true wait of every rank is known. Options add what real traces have: CUDA
graph replays (full or broken at attention, with no CPU op names), ProfilerStep annotations, clock offsets
between ranks, traces that start at different steps, a rank with slower expert GEMMs, a copy overlapping
compute on a side stream, an unknown kernel, and CPU-side filler events up to a target file size.

Kernel names are real ones (NCCL, FlashMLA sparse decode, the DSA indexer, nvjet, this project's MoE).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

NCCL_AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RMSNORM = "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16*, c10::BFloat16 const*, float, int, int)"
INDEXER = "_fp8_paged_mqa_logits_kernel"
SPARSE_MLA = (
    "void sm90::decode::sparse_fp8::flash_fwd_splitkv_mla_fp8_sparse_kernel<sm90::decode::sparse_fp8::"
    "KernelTemplate<(ModelType)1, 64>>(DecodingParams, TmaParams)"
)
PROJ_GEMM = "nvjet_tst_64x8_64x16_1x1_v_bz_TNT"
LM_HEAD = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
MOE_ALIGN = "glm5_fp4_moe_align_kernel"
MOE_GEMM1 = "glm5_fp4_moe_gemm1_kernel"
MOE_GEMM2 = "glm5_fp4_moe_gemm2_kernel"
ARGMAX = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>>(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)"
UNKNOWN = "mystery_kernel_xyz"
MEMCPY_DTOH = "Memcpy DtoH (Device -> Pinned)"
MEMCPY_HTOD = "Memcpy HtoD (Pinned -> Device)"

CATEGORY = {
    NCCL_AR: "allreduce",
    RMSNORM: "other",
    INDEXER: "attention",
    SPARSE_MLA: "attention",
    PROJ_GEMM: "other_gemm",
    LM_HEAD: "other_gemm",
    MOE_ALIGN: "expert_gemm",
    MOE_GEMM1: "expert_gemm",
    MOE_GEMM2: "expert_gemm",
    ARGMAX: "other",
    UNKNOWN: "other",
    MEMCPY_DTOH: "memcpy",
    MEMCPY_HTOD: "memcpy",
}
ATTENTION_KERNELS = {INDEXER, SPARSE_MLA}
BASE_NS = 1_764_000_000_000_000_000


@dataclass
class Truth:
    """What the generator did, per rank (times in µs, over the events that made it into the trace)."""

    summed_us: dict[int, dict[str, float]] = field(default_factory=dict)
    wait_us: dict[int, float] = field(default_factory=dict)
    wait_by_step: dict[int, list[float]] = field(default_factory=dict)
    allreduce_kernels: dict[int, int] = field(default_factory=dict)
    step_period_us: float = 0.0
    steps_in_trace: dict[int, int] = field(default_factory=dict)
    overlap_memcpy_us: dict[int, float] = field(default_factory=dict)
    clock_offset_us: dict[int, float] = field(default_factory=dict)
    # per rank and step in the trace: first kernel start -> next step's first kernel start (the last step: to
    # its last kernel's end), in the rank's own clock
    step_time_us: dict[int, list[float]] = field(default_factory=dict)
    allreduce_per_step: int = 0


def _step_ops(layers: int, slow: float) -> list[tuple[str, float]]:
    ops: list[tuple[str, float]] = []
    for _ in range(layers):
        ops += [(RMSNORM, 4.0), (PROJ_GEMM, 9.0), (INDEXER, 8.0), (SPARSE_MLA, 21.0), (PROJ_GEMM, 12.0), (NCCL_AR, 11.0)]
        ops += [(RMSNORM, 4.0), (PROJ_GEMM, 3.0), (MOE_ALIGN, 3.0), (MOE_GEMM1, 34.0 * slow), (MOE_GEMM2, 20.0 * slow), (NCCL_AR, 11.0)]
    ops += [(UNKNOWN, 2.0), (LM_HEAD, 28.0), (ARGMAX, 5.0)]
    return ops


def make_decode_traces(
    n_ranks: int = 2,
    n_steps: int = 6,
    layers: int = 3,
    graph: str | None = "full",
    slow_rank: int | None = None,
    slow_factor: float = 1.5,
    clock_offset_us: dict[int, float] | None = None,
    first_step: dict[int, int] | None = None,
    profiler_steps: str | None = None,
    step_name: str = "ProfilerStep#{}",
    annotated_ranks: set[int] | None = None,
    hold_us: dict[tuple[int, int], float] | None = None,
    sync_gap_us: float = 0.0,
    side_stream_copy: bool = False,
    copy_stream: int | None = None,
    step_gap_us: float = 150.0,
    launch_gap_us: float = 1.0,
    jitter_us: float = 0.0,
    target_bytes: int = 0,
    naming: str = "vllm",
    seed: int = 0,
) -> tuple[list[tuple[str, dict]], Truth]:
    """(file name, trace dict) per rank, and the ground truth.

    graph: None (eager: one launch per kernel), "full" (one cudaGraphLaunch per step) or "breakable"
    (replays broken at the attention kernels, which launch eagerly; vLLM's default for GLM-5).
    profiler_steps: None, "cpu" (user_annotation), "gpu" (gpu_user_annotation, the GPU projection Kineto
    writes) or "both", named ``step_name.format(step)`` (``ProfilerStep#N``, or a user's own record_function
    name such as ``decode_step_{}``), on ``annotated_ranks`` (default: all).
    hold_us: {(rank, step): µs} the rank's CPU stalls before launching that step (inside its annotation), so
    its GPU idles and its peers wait that long in the step's first all-reduce.
    sync_gap_us: eager MoE routing synced to the host: the GPU idles about this long (x0.5..1.5) before every
    layer's expert GEMMs, on every rank.
    copy_stream: the sampled tokens' copy that ends every step runs on this stream (vLLM's async output copy);
    Kineto projects a GPU-side range once per stream, so each step's range then comes in two pieces, the copy's
    after the main stream's. GPU-side ranges carry their CPU range's External id, as Kineto writes them.
    """
    rng = random.Random(seed)
    offsets = {r: 0.0 for r in range(n_ranks)} | dict(clock_offset_us or {})
    first = {r: 0 for r in range(n_ranks)} | dict(first_step or {})
    truth = Truth(clock_offset_us=offsets, allreduce_per_step=2 * layers)
    annotated = set(range(n_ranks)) if annotated_ranks is None else set(annotated_ranks)
    holds = dict(hold_us or {})
    first_kernel: dict[int, list[float]] = {r: [] for r in range(n_ranks)}
    last_end: dict[int, float] = {}
    events: dict[int, list[dict]] = {r: [] for r in range(n_ranks)}
    clock = {r: 1000.0 for r in range(n_ranks)}
    corr = {r: 1000 for r in range(n_ranks)}
    for r in range(n_ranks):
        truth.summed_us[r] = {c: 0.0 for c in set(CATEGORY.values()) | {"allreduce_wait"}}
        truth.wait_us[r] = 0.0
        truth.wait_by_step[r] = [0.0] * n_steps
        truth.allreduce_kernels[r] = 0
        truth.steps_in_trace[r] = n_steps - first[r]
        truth.overlap_memcpy_us[r] = 0.0

    def new_corr(r: int) -> int:
        corr[r] += 1
        return corr[r]

    def add_kernel(r: int, name: str, ts: float, dur: float, c: int, stream: int = 7, wait: float = 0.0) -> None:
        kind = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        events[r].append(
            {
                "ph": "X",
                "cat": kind,
                "name": name,
                "pid": r,
                "tid": stream,
                "ts": round(ts + offsets[r], 3),
                "dur": round(dur, 3),
                "args": {
                    "External id": c,
                    "queued": 0,
                    "device": r,
                    "context": 1,
                    "stream": stream,
                    "correlation": c,
                    "registers per thread": 128,
                    "shared memory": 0,
                    "blocks per SM": 1.5,
                    "warps per SM": 6.0,
                    "grid": [132, 1, 1],
                    "block": [128, 1, 1],
                    "est. achieved occupancy %": 9,
                },
            }
        )

    def add_runtime(r: int, name: str, ts: float, c: int) -> None:
        events[r].append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": name,
                "pid": 4242 + r,
                "tid": 4242 + r,
                "ts": round(ts + offsets[r], 3),
                "dur": 3.0,
                "args": {"External id": c, "cbid": 211, "correlation": c},
            }
        )

    cpu_lag = 80.0
    for step in range(n_steps):
        in_trace = {r: step >= first[r] for r in range(n_ranks)}
        hold = {r: holds.get((r, step), 0.0) for r in range(n_ranks)}
        for r in range(n_ranks):
            clock[r] += hold[r]
        step_start = dict(clock)
        graph_corr = {r: new_corr(r) for r in range(n_ranks)}
        piece_corr = dict(graph_corr)
        launches: dict[int, list[float]] = {r: [] for r in range(n_ranks)}
        ops = {r: _step_ops(layers, slow_factor if r == slow_rank else 1.0) for r in range(n_ranks)}
        prev_attention = False
        for i in range(len(ops[0])):
            name = ops[0][i][0]
            is_attention = name in ATTENTION_KERNELS
            starts = {}
            for r in range(n_ranks):
                starts[r] = clock[r] + launch_gap_us + (rng.random() * jitter_us if jitter_us else 0.0)
                if sync_gap_us and name == MOE_ALIGN:
                    starts[r] += sync_gap_us * (0.5 + rng.random())
            if name == NCCL_AR:
                last = max(starts.values())
                end = last + ops[0][i][1]
            for r in range(n_ranks):
                dur = (end - starts[r]) if name == NCCL_AR else ops[r][i][1]
                if graph == "full":
                    c = graph_corr[r]
                elif graph == "breakable":
                    if is_attention:
                        c = new_corr(r)
                        add_runtime(r, "cudaLaunchKernel", starts[r] - cpu_lag, c) if in_trace[r] else None
                    else:
                        if prev_attention or i == 0:
                            piece_corr[r] = new_corr(r)
                            if in_trace[r]:
                                add_runtime(r, "cudaGraphLaunch", starts[r] - cpu_lag, piece_corr[r])
                        c = piece_corr[r]
                else:
                    c = new_corr(r)
                    if in_trace[r]:
                        add_runtime(r, "cudaLaunchKernel", starts[r] - cpu_lag, c)
                launches[r].append(starts[r] - cpu_lag)
                if in_trace[r]:
                    add_kernel(r, name, starts[r], dur, c)
                    if i == 0:
                        first_kernel[r].append(starts[r])
                    cat = CATEGORY[name]
                    if name == NCCL_AR:
                        wait = last - starts[r]
                        truth.summed_us[r]["allreduce_wait"] += wait
                        truth.summed_us[r]["allreduce"] += dur - wait
                        truth.wait_us[r] += wait
                        truth.wait_by_step[r][step] += wait
                        truth.allreduce_kernels[r] += 1
                    else:
                        truth.summed_us[r][cat] += dur
                    if side_stream_copy and name == MOE_GEMM1:
                        # an input copy on another stream, fully hidden under the expert GEMM
                        cc = new_corr(r)
                        add_runtime(r, "cudaMemcpyAsync", starts[r] - cpu_lag, cc)
                        add_kernel(r, MEMCPY_HTOD, starts[r] + 2.0, min(8.0, dur - 4.0), cc, stream=9)
                        truth.summed_us[r]["memcpy"] += min(8.0, dur - 4.0)
                        truth.overlap_memcpy_us[r] += min(8.0, dur - 4.0)
                clock[r] = starts[r] + dur
            prev_attention = is_attention
        for r in range(n_ranks):
            if graph == "full" and in_trace[r]:
                add_runtime(r, "cudaGraphLaunch", step_start[r] - cpu_lag, graph_corr[r])
            # the sampled tokens go back to the host: an eager copy ends every step
            c = new_corr(r)
            main_end = clock[r]
            ts = clock[r] + 2.0
            if in_trace[r]:
                add_runtime(r, "cudaMemcpyAsync", ts - cpu_lag, c)
                add_kernel(r, MEMCPY_DTOH, ts, 3.0, c, stream=copy_stream or 7)
                truth.summed_us[r]["memcpy"] += 3.0
                last_end[r] = ts + 3.0
            launches[r].append(ts - cpu_lag)
            clock[r] = ts + 3.0
            annotate = in_trace[r] and r in annotated and profiler_steps is not None
            range_id = new_corr(r) if annotate else 0
            if annotate and profiler_steps in ("cpu", "both"):
                lo, hi = min(launches[r]) - 1.0 - hold[r], max(launches[r]) + 5.0
                events[r].append(
                    {"ph": "X", "cat": "user_annotation", "name": step_name.format(step), "pid": 4242 + r, "tid": 4242 + r,
                     "ts": round(lo + offsets[r], 3), "dur": round(hi - lo, 3), "args": {"External id": range_id}}
                )
            if annotate and profiler_steps in ("gpu", "both"):
                pieces = [(7, step_start[r] + launch_gap_us, clock[r])]
                if copy_stream is not None:
                    pieces = [(7, step_start[r] + launch_gap_us, main_end), (copy_stream, ts, clock[r])]
                for stream, lo, hi in pieces:
                    events[r].append(
                        {"ph": "X", "cat": "gpu_user_annotation", "name": step_name.format(step), "pid": r,
                         "tid": stream, "ts": round(lo + offsets[r], 3), "dur": round(hi - lo, 3),
                         "args": {"External id": range_id}}
                    )
            clock[r] += step_gap_us
        if step == 0:
            truth.step_period_us = clock[0] - step_start[0]
    for r in range(n_ranks):
        starts_r = first_kernel[r]
        truth.step_time_us[r] = [b - a for a, b in zip(starts_r, starts_r[1:])] + [last_end[r] - starts_r[-1]]

    files = []
    for r in range(n_ranks):
        evs = events[r]
        if target_bytes:
            real = len(json.dumps(evs))
            evs = evs + _filler(r, target_bytes - real, rng, clock[r])
        trace = {
            "schemaVersion": 1,
            "deviceProperties": [{"id": r, "name": "NVIDIA H200", "totalGlobalMem": 150_000_000_000, "computeMajor": 9, "computeMinor": 0}],
            "distributedInfo": {"backend": "nccl", "rank": r, "world_size": n_ranks},
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": BASE_NS,
            "traceEvents": evs,
            "traceName": f"rank{r}",
        }
        files.append((_file_name(naming, r, n_ranks), trace))
    return files, truth


def _file_name(naming: str, r: int, n_ranks: int) -> str:
    if naming == "vllm":
        return f"dp0_pp0_tp{r}_dcp0_ep0_rank{r}.1764000000123456789.pt.trace.json.gz"
    if naming == "sglang":
        return f"1764000000.123-TP-{r}-DECODE.trace.json.gz"
    if naming == "plain":
        return f"trace_{chr(ord('a') + r)}.json"
    raise ValueError(naming)


def _filler(r: int, target_bytes: int, rng: random.Random, t_end: float) -> list[dict]:
    """CPU-side events (ops, python frames) like the bulk of a real server trace, about ``target_bytes`` of JSON."""
    sample_funcs = ["execute_model", "_prepare_inputs", "forward", "__call__", "_sample", "update_states", "_call_impl"]
    sample_ops = ["aten::empty", "aten::copy_", "aten::to", "aten::slice", "aten::view", "aten::add_", "aten::index_select"]
    out = []
    size = 0
    i = 0
    while size < target_bytes:
        i += 1
        ts = rng.uniform(1000.0, t_end)
        if i % 3:
            ev = {
                "ph": "X", "cat": "python_function", "name": f"vllm/v1/worker/gpu_model_runner.py({rng.randint(1, 4000)}): {rng.choice(sample_funcs)}",
                "pid": 4242 + r, "tid": 4242 + r, "ts": round(ts, 3), "dur": round(rng.uniform(0.5, 40.0), 3),
                "args": {"Python parent id": i - 1, "Python id": i, "Ev Idx": i},
            }
        else:
            ev = {
                "ph": "X", "cat": "cpu_op", "name": sample_ops[i % len(sample_ops)], "pid": 4242 + r, "tid": 4242 + r,
                "ts": round(ts, 3), "dur": round(rng.uniform(0.5, 20.0), 3),
                "args": {"External id": 10_000_000 + i, "Record function id": 0, "Sequence number": i, "Fwd thread id": 0,
                         "Ev Idx": i, "Input Dims": [[rng.randint(1, 4096), rng.choice((576, 2048, 6144))], [rng.randint(1, 6144)]], "Input type": ["c10::BFloat16", "c10::BFloat16"]},
            }
        out.append(ev)
        size += len(json.dumps(ev)) + 2
    return out
