"""The fused NVFP4 MoE benchmark: GLM-5 expert shards, balanced and skewed routings, same-run ceilings.

One row per (TP shard, tokens T, routing): the median time of CUDA-graph replays of ``layers`` distinct
layers back to back (so small-T weights are not served from L2: by default enough layers that even the fewest
experts a routing can touch overflow twice the GPU's L2, :func:`layers_for`; a row whose layers still fit is
marked), the bytes the call must move (NVFP4
weights of the experts the routing touched, x read, output written), the floor = bytes / copy bandwidth
measured in the same run, % of that bandwidth, TFLOP/s and % of the bf16 dense GEMM rate measured in the
same run, the ratio to the balanced routing's time at the same (TP, T) ("skew ratio"), and same-run
baselines: vLLM's Marlin MoE (when vLLM's CUDA build is importable), torch's bf16 and fp8 grouped GEMMs.

Used by ``benchmarks/moe_kernel.py`` (the project's published table) and ``glm5-fp4 selftest`` (a user's
own GPU), so both measure the same thing.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field

import torch

from glm5_fp4.bench import routing as R
from glm5_fp4.bench.experts import GroupedBaselines, nvfp4_weight_bytes, random_nvfp4_experts
from glm5_fp4.bench.timing import bf16_gemm_tflops, copy_bandwidth_gbs, graph_time_us, sm_clock_mhz
from glm5_fp4.spec import Glm5Spec


@dataclass
class Shard:
    """One expert shape: GLM-5's TP8/TP4 shards or an expert-parallel slice of whole experts."""

    name: str
    num_experts: int  # experts held by this GPU
    hidden: int
    intermediate: int
    top_k: int
    global_experts: int  # the router's expert count (== num_experts unless expert parallel)

    @property
    def expert_parallel(self) -> bool:
        return self.global_experts != self.num_experts


def glm5_shard(name: str, spec: Glm5Spec | None = None) -> Shard:
    """``tp8``/``tp4``/``tp2``/``tp1`` (experts sharded along I) or ``ep8`` (32 whole experts of 256)."""
    spec = spec or Glm5Spec()
    e, h, k, i = spec.n_routed_experts, spec.hidden_size, spec.num_experts_per_tok, spec.moe_intermediate_size
    if name.startswith("tp"):
        return Shard(name, e, h, i // int(name[2:]), k, e)
    if name.startswith("ep"):
        return Shard(name, e // int(name[2:]), h, i, k, e)
    raise ValueError(f"unknown shard {name!r}: tpN or epN")


# Distinct layers per CUDA graph: at least DEFAULT_LAYERS, and enough that one replay's weights are L2_MARGIN x the
# L2 even where the routing touches the fewest experts (top_k of them): cycling through twice the L2 leaves a
# replay no weight to find there. LAYER_COPIES: device copies of a layer's weights the benchmark holds (the
# checkpoint layout, the prepared one, Marlin's repack), for the memory cap.
DEFAULT_LAYERS = 4
L2_MARGIN = 2.0
LAYER_COPIES = 3


def l2_cache_bytes(device: str = "cuda") -> int | None:
    """The GPU's L2 size in bytes (None off CUDA, or where torch does not say)."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    n = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", None)
    return int(n) if n else None


def layers_for(shard: Shard, l2_bytes: int | None, floor: int = DEFAULT_LAYERS, free_bytes: int | None = None) -> int:
    """Distinct layers for ``shard`` so that the fewest experts any routing touches (top_k; one for an expert-parallel
    slice) overflow L2_MARGIN x the L2, never below ``floor``; capped so the layers take at most half of
    ``free_bytes`` (a row whose layers then fit in L2 is marked, see :func:`row`)."""
    if not l2_bytes:
        return floor
    fewest = 1 if shard.expert_parallel else min(shard.top_k, shard.num_experts)
    need = math.ceil(L2_MARGIN * l2_bytes / nvfp4_weight_bytes(fewest, shard.hidden, shard.intermediate))
    if free_bytes is not None:
        per_layer = LAYER_COPIES * nvfp4_weight_bytes(shard.num_experts, shard.hidden, shard.intermediate)
        need = min(need, int(free_bytes // 2 // per_layer))
    return max(floor, need)


def l2_may_serve(layers: int, weight_bytes: int, l2_bytes: int | None) -> bool | None:
    """Whether ``layers`` replays of ``weight_bytes`` of touched weights each hold less than L2_MARGIN x the L2, so the
    figure may be L2's rather than DRAM's (the table's † and the sweep's points); None where the L2 is unknown."""
    if not l2_bytes:
        return None
    return layers * weight_bytes < L2_MARGIN * l2_bytes


@dataclass
class Layers:
    """``count`` distinct random layers of one shard, prepared for our kernel (and for Marlin if asked)."""

    shard: Shard
    prepared: list
    experts: list  # checkpoint-layout NvFp4Experts (the oracle's and Marlin's input)
    marlin: list = field(default_factory=list)
    marlin_error: str | None = None


def make_layers(shard: Shard, count: int, gen: torch.Generator, marlin: bool = False, device="cuda") -> Layers:
    from glm5_fp4.bench import marlin as M
    from glm5_fp4.kernels import prepare_experts

    experts = [random_nvfp4_experts(shard.num_experts, shard.hidden, shard.intermediate, gen, device)
               for _ in range(count)]
    out = Layers(shard, [prepare_experts(e) for e in experts], experts)
    if marlin:
        ok, why = M.available()
        if ok:
            try:
                out.marlin = [M.MarlinMoE(e) for e in experts]
            except Exception as exc:  # noqa: BLE001 - the baseline is context; say why it is missing
                out.marlin_error = f"{type(exc).__name__}: {str(exc)[:300]}"
        else:
            out.marlin_error = why
    return out


def one_cuda_layer(shard_name: str, seed: int = 1) -> tuple[Shard, Layers, torch.Generator]:
    """The one-layer set-up of the single-call GPU probes (benchmarks/ncu_moe_call.py, align_probe.py): the GLM-5
    shard, one random NVFP4 layer on the GPU, and the seeded generator that drew it (for the probe's inputs)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sh = glm5_shard(shard_name)
    return sh, make_layers(sh, 1, gen), gen


def expert_map_for(shard: Shard, device="cuda") -> torch.Tensor | None:
    """Rank 0's map of an expert-parallel shard: global experts 0..E_local-1 are local."""
    if not shard.expert_parallel:
        return None
    m = torch.full((shard.global_experts,), -1, dtype=torch.int32, device=device)
    m[: shard.num_experts] = torch.arange(shard.num_experts, dtype=torch.int32, device=device)
    return m


def time_ours(layers: Layers, x, tw, ids, mode="w4a16", plan=None, stages=("align", "gemm1", "gemm2"), diag=0,
              expert_map=None) -> float:
    from glm5_fp4.kernels.moe import fused_moe_triton

    outs = [torch.empty_like(x) for _ in layers.prepared]

    def run():
        for p, o in zip(layers.prepared, outs):
            fused_moe_triton(x, tw, ids, p, mode, out=o, plan=plan, stages=stages, diag=diag, expert_map=expert_map)

    return graph_time_us(run) / len(layers.prepared)


def time_marlin(layers: Layers, x, tw, ids) -> float:
    outs = [torch.empty_like(x) for _ in layers.marlin]

    def run():
        for m, o in zip(layers.marlin, outs):
            m.run(x, tw, ids, out=o)

    return graph_time_us(run) / len(layers.marlin)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@dataclass
class Context:
    """Same-run ceilings and settings shared by every row."""

    copy_gbs: float
    bf16_tflops: float
    spec: Glm5Spec
    gen: torch.Generator
    baselines: bool = True
    w4a4: bool = False
    stages: bool = False
    check: bool = True  # compare ours (and Marlin) with each other on the first row of each shard
    plan_for: object = None  # callable (shard, T) -> Plan | None overriding the defaults
    balanced_us: dict = field(default_factory=dict)
    l2_bytes: int | None = None  # the GPU's L2, to mark rows whose layers' weights fit in it
    device: str = "cuda"  # "cpu" only under Triton's interpreter (tests)


def row(ctx: Context, layers: Layers, t: int, routing: str, grouped: GroupedBaselines | None = None) -> dict:
    """Time one (shard, T, routing)."""
    from glm5_fp4.kernels.moe import default_plan, fused_moe_triton, launches_per_call

    sh = layers.shard
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float16  # the interpreter's bf16 dot is broken
    x = torch.randn(t, sh.hidden, device=ctx.device, generator=ctx.gen).to(dtype)
    tw, ids = R.make_routing(routing, t, sh.global_experts, sh.top_k, ctx.gen, ctx.device, spec=ctx.spec)
    emap = expert_map_for(sh, ctx.device)
    local_ids = ids if emap is None else emap[ids.long()]
    desc = R.describe(local_ids[local_ids >= 0].view(-1, 1) if emap is not None else ids, sh.num_experts)
    weight_bytes = nvfp4_weight_bytes(desc["experts_touched"], sh.hidden, sh.intermediate)
    need = weight_bytes + 2 * t * sh.hidden * 2
    local_slots = int((local_ids >= 0).sum())
    flops = 2 * local_slots * 3 * sh.intermediate * sh.hidden
    plan = ctx.plan_for(sh, t) if ctx.plan_for else None
    plan = plan or default_plan(x, ids, layers.prepared[0], "w4a16", emap)
    r = dict(shard=sh.name, tp=int(sh.name[2:]) if sh.name.startswith("tp") else None, experts=sh.num_experts,
             intermediate=sh.intermediate, tokens=t, routing=routing, **desc, bytes_needed=need, gflop=flops / 1e9,
             floor_us=need / (ctx.copy_gbs * 1e9) * 1e6, compute_floor_us=flops / (ctx.bf16_tflops * 1e12) * 1e6,
             schedule=plan.schedule, launches=launches_per_call(plan), gemm1=plan.gemm1.__dict__,
             gemm2=plan.gemm2.__dict__, gemm2_n_split=plan.gemm2_n_split, gemm1_split_k=plan.gemm1_split_k,
             prep_x=plan.prep_x, parallel_align=plan.parallel_align, slot_dedup=plan.slot_dedup,
             gemm1_fused_reduce=plan.gemm1_fused_reduce, pdl=plan.pdl, l2_prefetch=plan.l2_prefetch,
             gemm2_split_slots=plan.gemm2_split_slots, dedup_fused_finalize=plan.dedup_fused_finalize,
             finalize_block=plan.finalize_block)
    if ctx.check:
        out = fused_moe_triton(x, tw, ids, layers.prepared[0], plan=plan, expert_map=emap)
        if not torch.isfinite(out).all():
            raise AssertionError("non-finite output")
        if layers.marlin and emap is None:
            r["rel_diff_vs_marlin"] = rel_err(out, layers.marlin[0].run(x, tw, ids))
    us = time_ours(layers, x, tw, ids, plan=plan, expert_map=emap)
    r["sm_clock_mhz"] = sm_clock_mhz() if ctx.device == "cuda" else None
    if ctx.l2_bytes:
        r["l2_may_serve"] = l2_may_serve(len(layers.prepared), weight_bytes, ctx.l2_bytes)
    r.update(us=us, gbs=need / (us * 1e-6) / 1e9, pct_copy_bw=100 * need / (us * 1e-6) / (ctx.copy_gbs * 1e9),
             tflops=flops / (us * 1e-6) / 1e12, pct_bf16=100 * flops / (us * 1e-6) / (ctx.bf16_tflops * 1e12),
             pct_floor=100 * r["floor_us"] / us)
    key = (sh.name, t)
    if routing == "balanced":
        ctx.balanced_us[key] = us
    if key in ctx.balanced_us:
        r["skew_ratio"] = us / ctx.balanced_us[key]
    if ctx.stages and plan.schedule == "grouped":
        try:
            r["stage_us"] = {
                "align": time_ours(layers, x, tw, ids, plan=plan, stages=("align",), expert_map=emap),
                "align+gemm1": time_ours(layers, x, tw, ids, plan=plan, stages=("align", "gemm1"), expert_map=emap),
            }
        except Exception as exc:  # noqa: BLE001
            r["stage_us"] = {"error": repr(exc)[:300]}
    if ctx.w4a4:
        try:
            r["us_w4a4"] = time_ours(layers, x, tw, ids, mode="w4a4", expert_map=emap)
        except Exception as exc:  # noqa: BLE001
            r["us_w4a4"] = repr(exc)[:300]
    if layers.marlin and emap is None:
        try:
            r["marlin_us"] = time_marlin(layers, x, tw, ids)
            r["speedup_vs_marlin"] = r["marlin_us"] / us
        except Exception as exc:  # noqa: BLE001
            r["marlin_error"] = repr(exc)[:300]
    if grouped is not None and emap is None and routing == "balanced":  # (their cost hardly moves with skew)
        slot_idx, valid, offs = GroupedBaselines.groups(ids, sh.num_experts)
        for name, make in (("bf16_grouped_mm", grouped.bf16), ("fp8_scaled_grouped_mm", grouped.fp8)):
            try:
                r[f"{name}_us"] = graph_time_us(make(x, tw, ids, slot_idx, valid, offs), replays=10)
            except Exception as exc:  # noqa: BLE001
                r[f"{name}_error"] = repr(exc)[:300]
        if r.get("bf16_grouped_mm_us"):
            r["speedup_vs_bf16"] = r["bf16_grouped_mm_us"] / us
    return r


def run_table(shards, tokens, routings, layers: int | None = None, marlin: bool = True, baselines: bool = True,
              w4a4=False, stages=False, plan_for=None, progress=None, on_row=None, seed: int = 0, device: str = "cuda",
              min_layers: int = DEFAULT_LAYERS) -> dict:
    """Every (shard, T, routing) row plus the same-run ceilings; rows that fail carry ``error``. ``shards``:
    names for :func:`glm5_shard` or :class:`Shard` objects. ``layers``: distinct layers per CUDA graph; None: per
    shard from the GPU's L2 (:func:`layers_for`, at least ``min_layers``). The counts used: ``out["layers"]``."""
    spec = Glm5Spec()
    gen = torch.Generator(device=device).manual_seed(seed)
    ctx = Context(copy_bandwidth_gbs(), bf16_gemm_tflops(), spec, gen, baselines, w4a4, stages, True, plan_for,
                  device=device)
    ctx.l2_bytes = l2_cache_bytes(device)
    out = {"copy_gbs": ctx.copy_gbs, "bf16_tflops": ctx.bf16_tflops, "rows": [], "marlin": None, "layers": {},
           "l2_bytes": ctx.l2_bytes}
    if progress:
        progress(f"copy {ctx.copy_gbs:.0f} GB/s, bf16 {ctx.bf16_tflops:.0f} TFLOP/s")
    # balanced first: the skew ratios of a (shard, T) refer to its balanced row
    routings = sorted(routings, key=lambda r: r != "balanced")
    for name in shards:
        sh = glm5_shard(name, spec) if isinstance(name, str) else name
        count = layers
        if count is None:
            free = torch.cuda.mem_get_info()[0] if device == "cuda" else None
            count = layers_for(sh, ctx.l2_bytes, min_layers, free)
        out["layers"][sh.name] = count
        lay = make_layers(sh, count, gen, marlin=marlin and not sh.expert_parallel, device=device)
        if marlin and out["marlin"] is None:
            out["marlin"] = "vLLM fused_marlin_moe" if lay.marlin else lay.marlin_error
        grouped = None
        if baselines and not sh.expert_parallel and device == "cuda":
            try:
                grouped = GroupedBaselines(sh.num_experts, sh.hidden, sh.intermediate, gen)
            except Exception:  # noqa: BLE001
                out.setdefault("baseline_errors", []).append(traceback.format_exc()[-500:])
        for t in tokens:
            for rt in routings:
                t0 = time.time()
                try:
                    r = row(ctx, lay, t, rt, grouped)
                except Exception as exc:  # noqa: BLE001 - one failed row must not lose the others
                    r = dict(shard=sh.name, tokens=t, routing=rt, error=f"{type(exc).__name__}: {exc}",
                             traceback=traceback.format_exc()[-1200:])
                r["wall_s"] = round(time.time() - t0, 1)
                out["rows"].append(r)
                if on_row:
                    on_row(out)
                if progress:
                    progress(summary_line(r))
        del lay, grouped
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def summary_line(r: dict) -> str:
    if "error" in r:
        return f"{r['shard']} T={r['tokens']} {r['routing']}: ERROR {r['error'][:200]}"
    s = (f"{r['shard']} T={r['tokens']} {r['routing']}: {r['us']:.1f} us, floor {r['floor_us']:.1f} "
         f"({r['pct_copy_bw']:.0f} % BW, {r['pct_bf16']:.0f} % bf16)")
    if "skew_ratio" in r and r["routing"] != "balanced":
        s += f", {r['skew_ratio']:.2f}x balanced"
    if "marlin_us" in r:
        s += f", Marlin {r['marlin_us']:.1f} us ({r['speedup_vs_marlin']:.2f}x)"
    return s


def markdown(meta: dict, rows: list[dict]) -> str:
    """The result table (one line per row) under a header naming GPU, versions and same-run ceilings."""

    def f(v, fmt="{:.1f}"):
        return "—" if v is None or isinstance(v, str) else fmt.format(v)

    lines = [
        f"# Fused NVFP4 MoE kernel on {meta.get('gpu')} ({meta.get('date')}, git {meta.get('git_sha')})",
        "",
        f"torch {meta.get('versions', {}).get('torch')}, triton {meta.get('versions', {}).get('triton')}; "
        f"copy bandwidth {meta['copy_gbs']:.0f} GB/s, bf16 dense GEMM {meta['bf16_tflops']:.0f} TFLOP/s (both "
        f"measured in this run). GLM-5 experts H=6144, top-8; {_layers_said(meta.get('layers'))} distinct layers per "
        "CUDA graph. "
        "Floor = bytes needed / copy bandwidth. Skew = time / balanced time at the same shard and T. "
        f"Marlin: {meta.get('marlin') or 'not run'}.",
        *([f"Plans: {meta['plan_arch']}'s (its tables and SM count), not this GPU's."] if meta.get("plan_arch") else []),
        *([f"Tensor-core instruction: {meta['mma']}; built: "
           + "; ".join(f"{k} {', '.join(v)}" for k, v in meta.get("compiled_mma", {}).items()) + "."]
          if meta.get("mma", "").startswith("mma.sync") else []),
        "",
        "| shard | T | routing | experts | max tok/expert | µs | floor µs | % copy BW | TFLOP/s | % bf16 | skew | "
        "Marlin µs | × vs Marlin | bf16 grouped µs | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shard_order = {name: i for i, name in enumerate(dict.fromkeys(r.get("shard") for r in rows))}
    routing_order = {name: i for i, name in enumerate(R.ROUTINGS)}
    rows = sorted(rows, key=lambda r: (shard_order.get(r.get("shard"), 99), r.get("tokens", 0),
                                       routing_order.get(r.get("routing"), 99)))
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('shard')} | {r.get('tokens')} | {r.get('routing')} | error: {r['error'][:80]} |"
                         + " |" * 11)
            continue
        lines.append(
            f"| {r['shard']} | {r['tokens']} | {r['routing']} | {r['experts_touched']} | {r['max_tokens_per_expert']} | "
            f"{f(r.get('us'))}{l2_mark(r)} | {f(r['floor_us'])} | "
            f"{f(r.get('pct_copy_bw'), '{:.0f} %')} | {f(r.get('tflops'))} | "
            f"{f(r.get('pct_bf16'), '{:.0f} %')} | {f(r.get('skew_ratio'), '{:.2f}')} | {f(r.get('marlin_us'))} | "
            f"{f(r.get('speedup_vs_marlin'), '{:.2f}')} | {f(r.get('bf16_grouped_mm_us'))} | {plan_label(r)} |"
        )
    return "\n".join(lines + l2_footnote(rows, meta.get("l2_bytes"))) + "\n"


def l2_mark(r: dict) -> str:
    """The table mark of a row whose layers' weights may have been read from L2 (:func:`l2_footnote`)."""
    return " †" if r.get("l2_may_serve") else ""


def l2_footnote(rows: list[dict], l2_bytes: int | None) -> list[str]:
    if not any(r.get("l2_may_serve") for r in rows):
        return []
    return ["", f"† The layers of this row hold less than {L2_MARGIN:g}x the GPU's L2"
            + (f" ({l2_bytes / 2**20:.0f} MB)" if l2_bytes else "") + " of touched weights: replays may read them "
            "from L2, so the time may be below what DRAM allows (more layers: --layers, or the memory for them)."]


def _layers_said(layers) -> str:
    """The distinct-layer count(s) of a table: one number, or per shard where they differ."""
    if not isinstance(layers, dict):
        return str(layers)
    counts = set(layers.values())
    return str(counts.pop()) if len(counts) == 1 else "(" + ", ".join(f"{k}: {v}" for k, v in layers.items()) + ")"


def plan_label(r: dict) -> str:
    """GEMM1 bn x bm x bk / GEMM2 bn x bm, 'm' = merged MMA chain, 'u' = eight MMAs, rN = register cap, t = weight
    tiles by TMA, gu = gate and up rows as one tile (Gemm1Config.stacked), ws = the warp-specialised Gluon GEMM1
    (Gemm1Config.ws); prep /
    split-K / palign
    (routing counted by many programs) / dedup (slot schedule, one program group per expert) / fused (the split-K
    reduce in GEMM1) / pdl (programmatic dependent launch) / pfN (L2 prefetch N tiles ahead) / slots (the slot
    GEMM2 one program per slot)."""
    g1, g2 = r.get("gemm1") or {}, r.get("gemm2") or {}
    if not g1:
        return ""

    def m(g):
        return "m" if g.get("merged", True) else "u"

    extra = []
    if r.get("schedule") == "grouped" and r.get("prep_x", True):
        extra.append("prep")
    if r.get("gemm1_split_k", 1) > 1:
        extra.append(f"splitK{r['gemm1_split_k']}")
    if r.get("parallel_align"):
        extra.append("palign")
    if r.get("slot_dedup"):
        extra.append("dedup-arrive" if r.get("dedup_fused_finalize") else "dedup")
        if r.get("finalize_block"):
            extra.append(f"fin{r['finalize_block']}")
    if r.get("gemm1_fused_reduce"):
        extra.append("fused")
    if r.get("pdl"):
        extra.append("pdl")
    if r.get("l2_prefetch"):
        extra.append(f"pf{r['l2_prefetch']}")
    if r.get("gemm2_split_slots"):
        extra.append("slots")

    def _ws(g):  # the warp-specialised Gluon GEMM1 (Gemm1Config.ws)
        return "ws" if g.get("ws") else ""

    def regs(g):  # a register cap (Gemm1Config.maxnreg)
        return f"r{g['maxnreg']}" if g.get("maxnreg") else ""

    return (f"{g1['bn']}x{g1['bm']}x{g1['bk']}{m(g1)}w{g1['num_warps']}s{g1['num_stages']}{regs(g1)}"
            f"{'t' if g1.get('tma') else ''}{'gu' if g1.get('stacked') else ''}{_ws(g1)} / "
            f"{g2['bn']}x{g2['bm']}{m(g2)}w{g2['num_warps']}{regs(g2)} n{r.get('gemm2_n_split')}"
            + (" " + " ".join(extra) if extra else ""))
