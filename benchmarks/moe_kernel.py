"""Benchmark the fused NVFP4 MoE kernel at GLM-5 expert shapes against the bandwidth floor and torch baselines.

Shapes: E=256 experts, H=6144, I=2048 sharded TP8 (I=256) and TP4 (I=512), top-8 routing from the GLM-5
router (``glm5_fp4.reference.route``) on random logits, T in {1, 4, 16, 64, 128, 256, 512, 1024, 4096}.

Per row: median time of CUDA-graph replays (the graph runs ``--layers`` distinct layers back to back, like a
model step, so small-T weights are not served from L2), bytes actually needed (NVFP4 weights of the experts
the routing touched + reading x + writing the output), achieved GB/s and % of the device-copy bandwidth
measured in the same run, TFLOP/s, and the same-run baselines: ``torch._grouped_mm`` on bf16 weights,
``torch._scaled_grouped_mm`` on fp8 weights (row-wise scales, dynamic activation quantization), and
dequantize-all-experts-then-bf16. Baselines include the token gather, SwiGLU and the weighted combine
(``index_add_``); their routing sort (argsort, padded group offsets) is precomputed outside the timing.

    python benchmarks/moe_kernel.py                      # full table -> benchmarks/results/moe_kernel_h200.{json,md}
    python benchmarks/moe_kernel.py --sweep --tokens 16,512 --tp 8   # per-stage config sweep
    python benchmarks/moe_kernel.py --variants --tokens 1,16,512,4096 --tp 8 --json sweep.json
        # whole-layer time of the default plan and one-change variants (merged MMA, prepared x, split-K);
        # --plans sweep.json then benchmarks the best plan per regime
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from glm5_fp4 import nvfp4
from glm5_fp4.kernels import configs as C
from glm5_fp4.kernels.layout import DECODE_FACTOR, PreparedExperts
from glm5_fp4.kernels.moe import fused_moe_triton, launches_per_call
from glm5_fp4.reference import route
from glm5_fp4.spec import Glm5Spec

TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 4096)
RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------------------------------------
# Timing helpers
# ----------------------------------------------------------------------------------------------------------
def graph_time_us(fn, replays: int = 20, warmup: int = 3) -> float:
    """Median time of one replay of a CUDA graph capturing ``fn()`` (each replay timed with events)."""
    fn()  # compile / first-touch outside capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del graph
    return statistics.median(times)


def event_time_us(fn, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    us = event_time_us(lambda: b.copy_(a), iters=20, warmup=5)
    del a, b
    return 2 * n / (us * 1e-6) / 1e9


def bf16_gemm_tflops() -> float:
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = event_time_us(lambda: x @ w, iters=20, warmup=10)
    return 2 * n**3 / (us * 1e-6) / 1e12


# ----------------------------------------------------------------------------------------------------------
# Random experts straight in the kernel layout (content is irrelevant for timing; scales kept finite)
# ----------------------------------------------------------------------------------------------------------
def random_prepared(e: int, h: int, i: int, gen: torch.Generator) -> PreparedExperts:
    dev = "cuda"

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)

    def scales(*shape):
        # e4m3 bytes 0x28..0x48: 2^-2 .. 2^2, no NaN encodings
        return torch.randint(0x28, 0x48, shape, dtype=torch.uint8, device=dev, generator=gen)

    def glob():
        return torch.rand(e, device=dev, generator=gen) * 1e-3 + 1e-3

    a13 = torch.full((e,), 3.5 / 2688, device=dev)
    a2 = torch.full((e,), 1.5 / 2688, device=dev)
    return PreparedExperts(
        w13=codes(e, 2 * i, h // 2), w13_scale=scales(e, 2 * i, h // 16), w13_alpha=glob() * DECODE_FACTOR,
        w2=codes(e, h, i // 2), w2_scale=scales(e, h, i // 16), w2_alpha=glob() * DECODE_FACTOR,
        a13_scale=a13, a2_scale=a2, a13_gscale=1 / a13, a2_gscale=1 / a2,
    )


def glm5_routing(t: int, spec: Glm5Spec, gen: torch.Generator):
    logits = torch.randn(t, spec.n_routed_experts, device="cuda", generator=gen)
    bias = torch.randn(spec.n_routed_experts, device="cuda", generator=gen) * 0.01
    return route(logits, bias, spec.num_experts_per_tok, spec.n_group, spec.topk_group, spec.routed_scaling_factor)


# ----------------------------------------------------------------------------------------------------------
# Baselines
# ----------------------------------------------------------------------------------------------------------
class Baselines:
    """bf16 / fp8 grouped GEMMs over padded, pre-sorted token groups (sort outside the timing)."""

    def __init__(self, e: int, h: int, i: int, gen: torch.Generator):
        self.e, self.h, self.i = e, h, i
        self.w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h**0.5).to(torch.bfloat16)
        self.w2 = (torch.randn(e, h, i, device="cuda", generator=gen) / i**0.5).to(torch.bfloat16)
        fp8 = torch.float8_e4m3fn
        s13 = self.w13.float().abs().amax(-1) / 448
        s2 = self.w2.float().abs().amax(-1) / 448
        self.w13_f8 = (self.w13.float() / s13[..., None]).to(fp8)
        self.w2_f8 = (self.w2.float() / s2[..., None]).to(fp8)
        self.s13, self.s2 = s13.float(), s2.float()

    @staticmethod
    def groups(topk_ids: torch.Tensor, e: int, align: int = 16):
        """Padded gather order: each expert's rows padded to a multiple of ``align`` (pad rows repeat row 0)."""
        flat = topk_ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e).cpu()
        padded = ((counts + align - 1) // align) * align
        rows, starts = [], 0
        idx = []
        pos = 0
        for ex in range(e):
            c, p = int(counts[ex]), int(padded[ex])
            seg = order[pos : pos + c]
            pos += c
            if p > c:
                seg = torch.cat([seg, seg.new_zeros(p - c)]) if c else seg.new_zeros(p)
            idx.append(seg)
        slot_idx = torch.cat(idx)
        valid = torch.cat([torch.arange(int(padded[x])) < int(counts[x]) for x in range(e)]).cuda()
        offs = torch.cumsum(padded, 0).to(torch.int32).cuda()
        return slot_idx, valid, offs

    def bf16(self, x, tw, topk_ids, slot_idx, valid, offs, w13=None, w2=None):
        k = topk_ids.shape[1]
        tok = slot_idx // k
        w13 = self.w13 if w13 is None else w13
        w2 = self.w2 if w2 is None else w2
        wt = torch.where(valid, tw.flatten()[slot_idx], 0.0)

        def run():
            xg = x.index_select(0, tok)
            gu = torch._grouped_mm(xg, w13.transpose(1, 2), offs=offs)
            g, u = gu.chunk(2, dim=-1)
            act = torch.nn.functional.silu(g) * u
            y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
            out = torch.zeros_like(x)
            out.index_add_(0, tok, (y.float() * wt[:, None]).to(x.dtype))
            return out

        return run

    def fp8(self, x, tw, topk_ids, slot_idx, valid, offs):
        k = topk_ids.shape[1]
        tok = slot_idx // k
        wt = torch.where(valid, tw.flatten()[slot_idx], 0.0)
        fp8 = torch.float8_e4m3fn

        def q(a):
            s = a.float().abs().amax(-1).clamp(min=1e-12) / 448
            return (a.float() / s[:, None]).to(fp8), s

        def run():
            xg = x.index_select(0, tok)
            xq, xs = q(xg)
            gu = torch._scaled_grouped_mm(
                xq, self.w13_f8.transpose(1, 2), xs, self.s13, offs=offs, out_dtype=torch.bfloat16
            )
            g, u = gu.chunk(2, dim=-1)
            aq, as_ = q(torch.nn.functional.silu(g) * u)
            y = torch._scaled_grouped_mm(aq, self.w2_f8.transpose(1, 2), as_, self.s2, offs=offs, out_dtype=torch.bfloat16)
            out = torch.zeros_like(x)
            out.index_add_(0, tok, (y.float() * wt[:, None]).to(x.dtype))
            return out

        return run


def dequant_all_us(prepared: PreparedExperts) -> float:
    """Time to dequantize every expert of one layer to bf16 with torch ops (the naive NVFP4 path)."""
    f8 = torch.float8_e4m3fn

    def run():
        a = nvfp4.dequantize(prepared.w13, prepared.w13_scale.view(f8), prepared.w13_alpha, torch.bfloat16)
        b = nvfp4.dequantize(prepared.w2, prepared.w2_scale.view(f8), prepared.w2_alpha, torch.bfloat16)
        return a, b

    return event_time_us(run, iters=3, warmup=1)


# ----------------------------------------------------------------------------------------------------------
# Main table
# ----------------------------------------------------------------------------------------------------------
def bench_kernel(layers, x, tw, ids, mode="w4a16", plan=None, stages=("align", "gemm1", "gemm2"), diag=0) -> float:
    outs = [torch.empty_like(x) for _ in layers]

    def run():
        for p, o in zip(layers, outs):
            fused_moe_triton(x, tw, ids, p, mode, out=o, plan=plan, stages=stages, diag=diag)

    return graph_time_us(run) / len(layers)


def row_for(t, tp, spec, layers, base, copy_gbs, gen, args, plan_override=None):
    e, h = spec.n_routed_experts, spec.hidden_size
    i = spec.moe_intermediate_size // tp
    k = spec.num_experts_per_tok
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    tw, ids = glm5_routing(t, spec, gen)
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * nvfp4.nvfp4_bytes(3 * i * h)
    act_bytes = 2 * t * h * 2
    need = weight_bytes + act_bytes
    flops = 2 * t * k * 3 * i * h
    arch = C.arch_of(torch.cuda.get_device_capability())
    plan = plan_override or C.plan(arch, t, e, k, h, i, sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    row = dict(tp=tp, intermediate=i, tokens=t, experts_touched=touched, bytes_needed=need, gflop=flops / 1e9,
               floor_us=need / (copy_gbs * 1e9) * 1e6, schedule=plan.schedule, launches=launches_per_call(plan),
               gemm1=plan.gemm1.__dict__, gemm2=plan.gemm2.__dict__, gemm2_n_split=plan.gemm2_n_split,
               gemm1_split_k=plan.gemm1_split_k, prep_x=plan.prep_x)
    us = bench_kernel(layers, x, tw, ids, plan=plan)
    row["sm_clock_mhz"] = sm_clock_mhz()
    row.update(us=us, gbs=need / (us * 1e-6) / 1e9, pct_copy_bw=100 * need / (us * 1e-6) / (copy_gbs * 1e9),
               tflops=flops / (us * 1e-6) / 1e12, pct_floor=100 * row["floor_us"] / us)
    if args.stages and plan.schedule == "grouped":
        try:
            row["stage_us"] = {
                "align": bench_kernel(layers, x, tw, ids, plan=plan, stages=("align",)),
                "align+gemm1": bench_kernel(layers, x, tw, ids, plan=plan, stages=("align", "gemm1")),
            }
            if args.nodecode:  # the same without decoding the weights (wrong results): the decode's cost
                row["stage_us"]["align+gemm1_nodecode"] = bench_kernel(
                    layers, x, tw, ids, plan=plan, stages=("align", "gemm1"), diag=1
                )
        except Exception as exc:  # noqa: BLE001
            row["stage_us"] = {"error": repr(exc)}
    if args.w4a4:
        try:
            row["us_w4a4"] = bench_kernel(layers, x, tw, ids, mode="w4a4", plan=plan)
        except Exception as exc:  # noqa: BLE001
            row["us_w4a4"] = repr(exc)
    if base is not None:
        slot_idx, valid, offs = Baselines.groups(ids, e)
        for name, make in (("bf16_grouped_mm", base.bf16), ("fp8_scaled_grouped_mm", base.fp8)):
            try:
                row[f"{name}_us"] = graph_time_us(make(x, tw, ids, slot_idx, valid, offs), replays=10)
            except Exception as exc:  # noqa: BLE001
                row[f"{name}_us"] = None
                row[f"{name}_error"] = repr(exc)[:300]
        if args.dequant_us is not None and row.get("bf16_grouped_mm_us"):
            row["dequant_then_bf16_us"] = args.dequant_us[tp] + row["bf16_grouped_mm_us"]
        if row.get("bf16_grouped_mm_us"):
            row["speedup_vs_bf16"] = row["bf16_grouped_mm_us"] / us
        # the same kernel again after the heavy baselines: how much the GPU's state moves the number
        row["us_after_baselines"] = bench_kernel(layers, x, tw, ids, plan=plan)
        row["sm_clock_mhz_after"] = sm_clock_mhz()
    return row


def sm_clock_mhz():
    """Current SM clock (nvidia-smi), or None."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0])
    except Exception:  # noqa: BLE001
        return None


def sweep(tp, t, spec, layers, copy_gbs, gen, arch):
    """Time each GEMM stage for every candidate config of the regime; returns the rows (fastest first)."""
    e, h = spec.n_routed_experts, spec.hidden_size
    i = spec.moe_intermediate_size // tp
    k = spec.num_experts_per_tok
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    tw, ids = glm5_routing(t, spec, gen)
    base_plan = C.plan(arch, t, e, k, h, i)
    sched = base_plan.schedule
    bm0 = base_plan.gemm1.bm
    res = {"tp": tp, "tokens": t, "schedule": sched, "gemm1": [], "gemm2": []}
    bms = {16} if sched == "slot" else {bm0, max(16, bm0 // 2), min(128, bm0 * 2)}
    for g1 in C.GEMM1_CANDIDATES[arch]:
        if g1.bm not in bms or i % g1.bn:
            continue
        plan = C.Plan(sched, g1, base_plan.gemm2, base_plan.gemm2_n_split)
        try:
            st = ("gemm1",) if sched == "slot" else ("align", "gemm1")
            us = bench_kernel(layers, x, tw, ids, plan=plan, stages=st)
            res["gemm1"].append({"cfg": g1.__dict__, "us": us})
        except Exception as exc:  # noqa: BLE001
            res["gemm1"].append({"cfg": g1.__dict__, "error": repr(exc)[:300]})
        print(f"  sweep tp{tp} T={t} gemm1 {g1} -> {res['gemm1'][-1].get('us', 'ERR')}", flush=True)
    for g2 in C.GEMM2_CANDIDATES[arch]:
        if (sched == "slot" and g2.bm != 16) or (sched == "grouped" and g2.bm not in bms):
            continue
        for n_split in sorted({C.plan(arch, t, e, k, h, i, gemm2=g2).gemm2_n_split,
                               max(1, C.plan(arch, t, e, k, h, i, gemm2=g2).gemm2_n_split // 2)}):
            plan = C.Plan(sched, base_plan.gemm1, g2, n_split)
            if (h // g2.bn) % n_split:
                continue
            try:
                us = bench_kernel(layers, x, tw, ids, plan=plan, stages=("gemm2",))
                res["gemm2"].append({"cfg": g2.__dict__, "n_split": n_split, "us": us})
            except Exception as exc:  # noqa: BLE001
                res["gemm2"].append({"cfg": g2.__dict__, "n_split": n_split, "error": repr(exc)[:300]})
            print(f"  sweep tp{tp} T={t} gemm2 {g2} split={n_split} -> {res['gemm2'][-1].get('us', 'ERR')}", flush=True)
    for key in ("gemm1", "gemm2"):
        res[key].sort(key=lambda r: r.get("us", math.inf))
    return res


def variant_plans(base: C.Plan, hidden: int) -> dict[str, C.Plan]:
    """The default plan and one-change variants of it (GEMM1 and GEMM2 kernels are independent, so the
    best of each GEMM's variants can be combined)."""
    g1, g2 = base.gemm1, base.gemm2
    rep = dataclasses.replace
    out = {
        "default": base,
        "g1_unmerged": rep(base, gemm1=rep(g1, merged=False)),
    }
    if base.schedule == "grouped":
        out["g1_noprep"] = rep(base, prep_x=False)
    elif base.gemm1_split_k > 1:
        out["g1_nosplit"] = rep(base, gemm1_split_k=1)
    if base.gemm2.merged:
        out["g2_unmerged"] = rep(base, gemm2=rep(g2, merged=False))
    else:
        out["g2_merged"] = rep(base, gemm2=rep(g2, merged=True))
    if base.schedule == "slot":  # split-K: more or fewer programs than the picker's choice
        for s in (base.gemm1_split_k * 2, base.gemm1_split_k // 2):
            if 2 <= s <= C.SPLIT_K_MAX and (hidden // base.gemm1.bk) % s == 0:
                out[f"g1_split{s}"] = rep(base, gemm1_split_k=s)
    if g1.bk >= 256:  # half the decoded tile held in registers at once
        out["g1_bk_half"] = rep(base, gemm1=rep(g1, bk=g1.bk // 2, num_stages=g1.num_stages + 1))
    if g1.bm >= 128:  # half the accumulators
        out["g1_bm_half"] = rep(base, gemm1=rep(g1, bm=g1.bm // 2))
    return out


def variants(tp, t, spec, layers, gen, arch, sms):
    """Full-layer time of each variant plan at one (TP, T); the best GEMM1 and GEMM2 choices combined last."""
    e, h = spec.n_routed_experts, spec.hidden_size
    i = spec.moe_intermediate_size // tp
    k = spec.num_experts_per_tok
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    tw, ids = glm5_routing(t, spec, gen)
    base = C.plan(arch, t, e, k, h, i, sm_count=sms)
    res = {"tp": tp, "tokens": t, "schedule": base.schedule, "runs": []}
    timed = {}
    ref = None
    for name, plan in variant_plans(base, h).items():
        try:
            # every form must compute the same layer: compare with the default plan's output
            o = fused_moe_triton(x, tw, ids, layers[0], plan=plan)
            if ref is None:
                ref = o
            diff = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            if not diff < 2e-3:
                raise AssertionError(f"output differs from the default plan's by {diff:.2e}")
            timed[name] = bench_kernel(layers, x, tw, ids, plan=plan)
            res["runs"].append({"name": name, "plan": dataclasses.asdict(plan), "us": timed[name], "rel_diff": diff})
        except Exception as exc:  # noqa: BLE001
            res["runs"].append({"name": name, "plan": dataclasses.asdict(plan), "error": repr(exc)[:400]})
        print(f"  variants tp{tp} T={t} {name}: {timed.get(name, res['runs'][-1].get('error'))}", flush=True)
    all_plans = variant_plans(base, h)
    g1_names = [n for n in timed if n.startswith("g1_") or n == "default"]
    if not g1_names:
        return res
    g1_best = min(g1_names, key=timed.get)
    g2_alt = next((n for n in timed if n.startswith("g2_")), None)
    g2_best = g2_alt if g2_alt and timed[g2_alt] < timed.get("default", math.inf) else "default"
    best = dataclasses.replace(all_plans[g1_best], gemm2=all_plans[g2_best].gemm2)
    try:
        us = bench_kernel(layers, x, tw, ids, plan=best)
        res["runs"].append({"name": "best", "plan": dataclasses.asdict(best), "us": us})
        print(f"  variants tp{tp} T={t} best ({g1_best} + {g2_best}): {us}", flush=True)
    except Exception as exc:  # noqa: BLE001
        res["runs"].append({"name": "best", "plan": dataclasses.asdict(best), "error": repr(exc)[:400]})
    return res


def _plan_of(d: dict) -> C.Plan:
    return C.Plan(d["schedule"], C.Gemm1Config(**d["gemm1"]), C.Gemm2Config(**d["gemm2"]), d["gemm2_n_split"],
                  gemm1_split_k=d.get("gemm1_split_k", 1), prep_x=d.get("prep_x", True))


def plans_from_sweep(path: str, arch: str, spec: Glm5Spec):
    """Best (gemm1, gemm2, n_split) per swept (tp, T); used for rows of the same regime (schedule, bm)."""
    data = json.loads(Path(path).read_text())
    best = {}
    flags = {}
    for vr in data.get("variants", []):
        ok = [r for r in vr["runs"] if "us" in r]
        if ok:
            p = _plan_of(min(ok, key=lambda r: r["us"])["plan"])
            best[(vr["tp"], vr["tokens"])] = (p.gemm1, p.gemm2, p.gemm2_n_split)
            flags[(vr["tp"], vr["tokens"])] = p
    for sw in data.get("sweeps", []):
        g1 = [r for r in sw["gemm1"] if "us" in r]
        g2 = [r for r in sw["gemm2"] if "us" in r]
        if g1 and g2:
            best[(sw["tp"], sw["tokens"])] = (C.Gemm1Config(**g1[0]["cfg"]), C.Gemm2Config(**g2[0]["cfg"]), g2[0]["n_split"])

    def lookup(tp: int, t: int):
        e, k, h = spec.n_routed_experts, spec.num_experts_per_tok, spec.hidden_size
        i = spec.moe_intermediate_size // tp
        want = C.plan(arch, t, e, k, h, i)
        cands = []
        for (stp, st), (g1, g2, n_split) in best.items():
            fp = flags.get((stp, st))
            if st == t and stp == tp:
                if fp is not None:
                    return fp
                return C.Plan(want.schedule, g1, g2, n_split)
            same = C.plan(arch, st, e, k, h, i)
            if same.schedule == want.schedule and same.gemm1.bm == want.gemm1.bm and i % g1.bn == 0:
                # n_split (and split-K) were tuned for that T's expert count: re-derive them for this T
                p = C.plan(arch, t, e, k, h, i, gemm1=g1, gemm2=g2)
                if fp is not None:
                    p = dataclasses.replace(p, prep_x=fp.prep_x,
                                            gemm1_split_k=p.gemm1_split_k if fp.gemm1_split_k > 1 else 1)
                cands.append((abs(math.log(st / t)), stp != tp, p))
        return min(cands, key=lambda c: c[:2])[2] if cands else None

    return lookup


def plan_label(r) -> str:
    """GEMM1 bn x bm x bk / GEMM2 bn x bm, 'm' = merged MMA chain, 'u' = eight MMAs; prep / split-K."""
    g1, g2 = r.get("gemm1") or {}, r.get("gemm2") or {}
    if not g1:
        return ""
    m = lambda g: "m" if g.get("merged", True) else "u"  # noqa: E731
    extra = []
    if r.get("schedule") == "grouped" and r.get("prep_x", True):
        extra.append("prep")
    if r.get("gemm1_split_k", 1) > 1:
        extra.append(f"splitK{r['gemm1_split_k']}")
    return (f"{g1['bn']}x{g1['bm']}x{g1['bk']}{m(g1)} / {g2['bn']}x{g2['bm']}{m(g2)}"
            + (" " + " ".join(extra) if extra else ""))


def markdown(meta, rows) -> str:
    lines = [
        f"# Fused NVFP4 MoE kernel on {meta['gpu']} ({meta['date']})",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}; copy bandwidth {meta['copy_gbs']:.0f} GB/s, "
        f"bf16 dense GEMM {meta['bf16_tflops']:.0f} TFLOP/s (both measured in this run). "
        f"GLM-5 experts E=256, H=6144, top-8; {meta['layers']} distinct layers per CUDA graph. "
        "Floor = bytes needed / copy bandwidth; baselines include gather, SwiGLU and combine.",
        "",
        "| TP | T | experts | sched/launches | µs | floor µs | % of copy BW | GB/s | TFLOP/s | W4A4 emul. µs | bf16 grouped µs | fp8 grouped µs | dequant+bf16 µs | × vs bf16 | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt="{:.1f}"):
        return "—" if v is None or isinstance(v, str) else fmt.format(v)

    for r in rows:
        lines.append(
            f"| TP{r['tp']} | {r['tokens']} | {r['experts_touched']} | {r['schedule']}/{r['launches']} | {f(r.get('us'))} | "
            f"{f(r['floor_us'])} | {f(r.get('pct_copy_bw'), '{:.0f} %')} | {f(r.get('gbs'), '{:.0f}')} | {f(r.get('tflops'))} | "
            f"{f(r.get('us_w4a4'))} | "
            f"{f(r.get('bf16_grouped_mm_us'))} | {f(r.get('fp8_scaled_grouped_mm_us'))} | {f(r.get('dequant_then_bf16_us'))} | "
            f"{f(r.get('speedup_vs_bf16'), '{:.2f}')} | {plan_label(r)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--tp", default="8,4")
    ap.add_argument("--layers", type=int, default=4, help="distinct expert sets per graph (defeats L2 reuse)")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="per-stage config sweep instead of the table")
    ap.add_argument("--variants", action="store_true",
                    help="time the default plan and one-change variants (merged MMA, prepared x, split-K, tiles)")
    ap.add_argument("--prior", help="with --variants: a JSON of earlier variant runs to keep (not re-measured)")
    ap.add_argument("--stages", action="store_true", help="also time align and align+gemm1 alone")
    ap.add_argument("--nodecode", action="store_true", help="with --stages: also GEMM1 without the decode")
    ap.add_argument("--w4a4", action="store_true", help="also time the W4A4 emulation mode")
    ap.add_argument("--plans", help="sweep JSON whose best configs replace the built-in defaults")
    ap.add_argument("--json", default=str(RESULTS / "moe_kernel_h200.json"))
    ap.add_argument("--md", default=str(RESULTS / "moe_kernel_h200.md"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernel benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    spec = Glm5Spec()
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    arch = C.arch_of((props.major, props.minor))
    meta = dict(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), torch=torch.__version__,
                triton=triton.__version__, layers=args.layers)
    args.plan_lookup = plans_from_sweep(args.plans, arch, spec) if args.plans and Path(args.plans).exists() else None
    meta["plans"] = "sweep " + args.plans if args.plan_lookup else "built-in defaults (glm5_fp4/kernels/configs.py)"
    meta["copy_gbs"] = copy_bandwidth_gbs()
    meta["bf16_tflops"] = bf16_gemm_tflops()
    print(f"copy {meta['copy_gbs']:.0f} GB/s, bf16 {meta['bf16_tflops']:.0f} TFLOP/s", flush=True)
    tokens = [int(v) for v in args.tokens.split(",")]
    tps = [int(v) for v in args.tp.split(",")]
    rows, sweeps, variant_runs = [], [], []
    sms = props.multi_processor_count
    if args.prior:  # earlier variant runs, kept unless this run measures the same (TP, T)
        redo = {(tp, t) for tp in (int(v) for v in args.tp.split(",")) for t in (int(v) for v in args.tokens.split(","))}
        for vr in json.loads(Path(args.prior).read_text()).get("variants", []):
            if (vr["tp"], vr["tokens"]) not in redo:
                variant_runs.append(dict(vr, prior=str(args.prior)))
    args.dequant_us = {}

    def save():  # after every row: a time-boxed run still leaves what it measured
        out = dict(meta=meta, rows=rows, sweeps=sweeps, variants=variant_runs, dequant_all_experts_us=args.dequant_us)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        ok = [r for r in rows if "us" in r]
        if ok and not (args.sweep or args.variants):
            Path(args.md).write_text(markdown(meta, ok))

    for tp in tps:
        i = spec.moe_intermediate_size // tp
        layers = [random_prepared(spec.n_routed_experts, spec.hidden_size, i, gen) for _ in range(args.layers)]
        base = None
        if not args.no_baselines and not (args.sweep or args.variants):
            try:
                base = Baselines(spec.n_routed_experts, spec.hidden_size, i, gen)
                args.dequant_us[tp] = dequant_all_us(layers[0])
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                args.dequant_us[tp] = None
        for t in tokens:
            t0 = time.time()
            try:
                if args.sweep:
                    sweeps.append(sweep(tp, t, spec, layers, meta["copy_gbs"], gen, arch))
                    save()
                    continue
                if args.variants:
                    variant_runs.append(variants(tp, t, spec, layers, gen, arch, sms))
                    save()
                    continue
                override = args.plan_lookup(tp, t) if args.plan_lookup else None
                r = row_for(t, tp, spec, layers, base, meta["copy_gbs"], gen, args, plan_override=override)
                rows.append(r)
                print(f"TP{tp} T={t}: {r['us']:.1f} us, floor {r['floor_us']:.1f}, {r['pct_copy_bw']:.0f}% BW, "
                      f"bf16 {r.get('bf16_grouped_mm_us')}, fp8 {r.get('fp8_scaled_grouped_mm_us')} "
                      f"[{time.time() - t0:.0f}s]", flush=True)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                rows.append(dict(tp=tp, tokens=t, error=traceback.format_exc()[-800:]))
            save()
        del layers, base
        torch.cuda.empty_cache()
    save()
    ok = [r for r in rows if "us" in r]
    if ok and not (args.sweep or args.variants):
        print(markdown(meta, ok))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
