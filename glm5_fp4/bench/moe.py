"""The fused NVFP4 MoE benchmark: GLM-5 expert shards, balanced and skewed routings, same-run ceilings.

One row per (TP shard, tokens T, routing): the median time of CUDA-graph replays of ``layers`` distinct
layers back to back (so small-T weights are not served from L2: by default enough layers that even the fewest
experts a routing can touch overflow twice the GPU's L2, :func:`layers_for`; a row whose layers still fit is
marked), the bytes the call must move (NVFP4
weights of the experts the routing touched, x read, output written), the floor = bytes / copy bandwidth
measured in the same run, % of that bandwidth, TFLOP/s and % of the bf16 dense GEMM rate measured in the
same run, the ratio to the balanced routing's time at the same (TP, T) ("skew ratio"), and same-run
baselines: vLLM's Marlin MoE (when vLLM's CUDA build is importable), torch's bf16 and fp8 grouped GEMMs.

Each row's first call is checked against the float64 reference (:func:`glm5_fp4.reference.moe_reference`) within the
GPU tests' tolerance before it is timed; a row that fails carries ``error``. An expert-parallel shard is timed as rank
0 (experts 0..E_local-1, :func:`expert_map_for`), its bytes and experts counted over its local experts, its skewed
routings' hot experts on that rank (:mod:`glm5_fp4.bench.routing`); a row whose routing gives it no token is marked
``skipped`` and not timed.

Used by ``benchmarks/moe_kernel.py`` (the project's published table) and ``glm5-fp4 selftest`` (a user's
own GPU), so both measure the same thing.
"""

from __future__ import annotations

import math
import re
import time
import traceback
from dataclasses import dataclass, field

import torch

from glm5_fp4.bench import routing as R
from glm5_fp4.bench.experts import GroupedBaselines, nvfp4_weight_bytes, random_nvfp4_experts
from glm5_fp4.bench.timing import bf16_gemm_tflops, copy_bandwidth_gbs, graph_time_us, sm_clock_mhz
from glm5_fp4.argtypes import comma_list
from glm5_fp4.errors import Glm5Fp4Error
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
    """``tp8``/``tp4``/``tp2``/``tp1`` (experts sharded along I) or ``ep8`` (32 whole experts of 256). A name GLM-5
    cannot have is a Glm5Fp4Error: tpN must cut I into whole 16-element NVFP4 blocks (tp3 gave I=682), epN the
    experts into equal whole sets (ep3 gave 85 of 256)."""
    from glm5_fp4.nvfp4 import BLOCK_SIZE

    spec = spec or Glm5Spec()
    e, h, k, i = spec.n_routed_experts, spec.hidden_size, spec.num_experts_per_tok, spec.moe_intermediate_size
    m = re.fullmatch(r"(tp|ep)([0-9]+)", name)
    if not m:
        raise Glm5Fp4Error(f"shard {name!r}: not tpN or epN (e.g. tp8, tp4, ep8)")
    n = int(m.group(2))
    if m.group(1) == "tp":
        if n < 1 or i % (n * BLOCK_SIZE):
            raise Glm5Fp4Error(f"shard {name!r}: TP{n} does not cut I={i} into whole {BLOCK_SIZE}-element NVFP4 "
                               f"blocks (N must divide {i // BLOCK_SIZE})")
        return Shard(name, e, h, i // n, k, e)
    if n < 1 or e % n:
        raise Glm5Fp4Error(f"shard {name!r}: EP{n} does not split GLM-5's {e} experts into equal whole sets")
    return Shard(name, e // n, h, i, k, e)


def shard_names(text: str) -> list[str]:
    """A comma-separated ``--shards`` list, every name checked (:func:`glm5_shard`) before anything runs."""
    names = comma_list(text, "--shards")
    if not names:
        raise Glm5Fp4Error("--shards: no shard given (e.g. tp8,tp4)")
    for name in names:
        glm5_shard(name)
    return names


def token_counts(text: str) -> list[int]:
    """A comma-separated ``--tokens`` list of positive whole numbers (T=0 made a 0-byte row that looked measured)."""
    out = []
    for v in comma_list(text, "--tokens"):
        try:
            out.append(int(v))
        except ValueError:
            raise Glm5Fp4Error(f"--tokens: {v!r} is not a whole number of tokens") from None
    return check_token_counts(out)


def check_token_counts(tokens) -> list[int]:
    tokens = list(tokens)
    if not tokens:
        raise Glm5Fp4Error("--tokens: no token count given (e.g. 1,512)")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise Glm5Fp4Error(f"--tokens: {t!r} is not a positive whole token count")
    return tokens


def routing_names(text: str) -> list[str]:
    """A comma-separated ``--routings`` list, every name checked (:func:`routing.check`)."""
    names = comma_list(text, "--routings")
    if not names:
        raise Glm5Fp4Error("--routings: no routing given (e.g. balanced,same_k)")
    for name in names:
        R.check(name)
    return names


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


def layer_count(shard: Shard, asked: int | None, l2_bytes: int | None, device: str = "cuda",
                floor: int = DEFAULT_LAYERS) -> int:
    """``asked`` distinct layers, or where None the table's rule (:func:`layers_for` from the GPU's L2 and free memory):
    the one place the table, the sweep and the variant scripts get their layer counts."""
    if asked is not None:
        if asked < 1:
            raise Glm5Fp4Error(f"--layers {asked}: at least one layer per CUDA graph")
        return asked
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    return layers_for(shard, l2_bytes, floor, free)


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


def local_load(shard: Shard, ids: torch.Tensor) -> dict:
    """What a routing (global ids) gives the measured rank: ``desc`` (:func:`routing.describe` over its local experts)
    and ``local_slots``. On an expert-parallel shard experts of other ranks are neither read nor counted."""
    emap = expert_map_for(shard, ids.device)
    local = ids.long() if emap is None else emap[ids.long()]
    mine = local[local >= 0]
    return {"desc": R.describe(mine.view(-1, 1), shard.num_experts), "local_slots": int(mine.numel())}


@dataclass
class CallInputs:
    """One (shard, T, routing) call as every MoE benchmark makes it: ``x``, the router's weights and global ids, rank
    0's ``expert_map`` (None unless expert parallel) and what the routing gives that rank (:func:`local_load`).
    ``run`` / ``time`` / ``plan`` pass the map, so no caller can leave it out (the sweep once ran ids up to 255
    against a 32-expert layer)."""

    shard: Shard
    x: torch.Tensor
    tw: torch.Tensor
    ids: torch.Tensor
    expert_map: torch.Tensor | None
    desc: dict
    local_slots: int

    @property
    def weight_bytes(self) -> int:
        """NVFP4 bytes of the local experts the routing touches."""
        sh = self.shard
        return nvfp4_weight_bytes(self.desc["experts_touched"], sh.hidden, sh.intermediate)

    def no_work(self) -> str | None:
        """Why there is nothing to time (the routing sends no token to this rank's experts), else None."""
        if self.local_slots:
            return None
        return (f"the routing gives rank 0 no token (all {self.ids.numel()} slots on other ranks' experts): "
                "nothing to time")

    def plan(self, prepared, mode="w4a16", form=None):
        from glm5_fp4.kernels.moe import default_plan

        return default_plan(self.x, self.ids, prepared, mode, self.expert_map, form=form)

    def run(self, prepared, plan=None, mode="w4a16", out=None):
        from glm5_fp4.kernels.moe import fused_moe_triton

        return fused_moe_triton(self.x, self.tw, self.ids, prepared, mode, out=out, plan=plan,
                                expert_map=self.expert_map)

    def time(self, layers: Layers, plan=None, mode="w4a16", stages=("align", "gemm1", "gemm2"), diag=0) -> float:
        return time_ours(layers, self.x, self.tw, self.ids, mode, plan, stages, diag, expert_map=self.expert_map)


def call_inputs(shard: Shard, t: int, routing: str, gen: torch.Generator, device="cuda", spec: Glm5Spec | None = None,
                dtype: torch.dtype | None = None) -> CallInputs:
    """Draw ``x`` and the routing of one call (hot experts on the measured rank of an expert-parallel shard)."""
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float16)  # the interpreter's bf16 dot is broken
    x = torch.randn(t, shard.hidden, device=device, generator=gen).to(dtype)
    tw, ids = R.make_routing(routing, t, shard.global_experts, shard.top_k, gen, device, spec=spec or Glm5Spec(),
                             hot_experts=shard.num_experts if shard.expert_parallel else None)
    return CallInputs(shard, x, tw, ids, expert_map_for(shard, device), **local_load(shard, ids))


# Tokens of a row checked against the float64 reference, spread over the batch: the reference goes expert by expert
# in float64, which at T=8192 would take longer than the row's timing; a wrong block, slot or expert still shows.
CHECK_TOKENS = 64


def check_against_reference(call: CallInputs, out: torch.Tensor, experts, mode: str = "w4a16") -> tuple[float, int]:
    """(relative error, tokens checked) of ``out`` against the float64 reference of the same codes, on up to
    CHECK_TOKENS tokens; an error over the GPU tests' tolerance (tolerances.moe_tolerance) raises."""
    from glm5_fp4.reference import moe_reference
    from glm5_fp4.tolerances import moe_tolerance, rel_error

    t = call.x.shape[0]
    sub = torch.linspace(0, t - 1, min(t, CHECK_TOKENS), device=call.x.device).round().long().unique()
    ref = moe_reference(call.x[sub].double(), call.tw[sub].double(), call.ids[sub].long(), experts, mode=mode,
                        compute_dtype=torch.float64, expert_map=call.expert_map)
    err, tol = rel_error(out[sub], ref), moe_tolerance(mode, call.x.dtype)
    if not err < tol:
        raise AssertionError(f"output differs from the float64 reference by {err:.2e} (tolerance {tol:.0e}, "
                             f"{sub.numel()} of {t} tokens checked)")
    return err, int(sub.numel())


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
    check: bool = True  # each row's first call against the float64 reference (and Marlin's, where it ran)
    plan_for: object = None  # callable (shard, T) -> Plan | None overriding the defaults
    balanced_us: dict = field(default_factory=dict)
    l2_bytes: int | None = None  # the GPU's L2, to mark rows whose layers' weights fit in it
    device: str = "cuda"  # "cpu" only under Triton's interpreter (tests)


def row(ctx: Context, layers: Layers, t: int, routing: str, grouped: GroupedBaselines | None = None) -> dict:
    """Time one (shard, T, routing)."""
    from glm5_fp4.kernels.moe import launches_per_call

    sh = layers.shard
    call = call_inputs(sh, t, routing, ctx.gen, ctx.device, ctx.spec)
    x, tw, ids, emap, desc = call.x, call.tw, call.ids, call.expert_map, call.desc
    head = dict(shard=sh.name, tp=int(sh.name[2:]) if sh.name.startswith("tp") else None, experts=sh.num_experts,
                intermediate=sh.intermediate, tokens=t, routing=routing, **desc)
    if call.no_work():
        return dict(head, skipped=call.no_work())
    weight_bytes = call.weight_bytes
    need = weight_bytes + 2 * t * sh.hidden * 2
    flops = 2 * call.local_slots * 3 * sh.intermediate * sh.hidden
    plan = ctx.plan_for(sh, t) if ctx.plan_for else None
    plan = plan or call.plan(layers.prepared[0])
    r = dict(head, bytes_needed=need, gflop=flops / 1e9,
             floor_us=need / (ctx.copy_gbs * 1e9) * 1e6, compute_floor_us=flops / (ctx.bf16_tflops * 1e12) * 1e6,
             schedule=plan.schedule, launches=launches_per_call(plan), gemm1=plan.gemm1.__dict__,
             gemm2=plan.gemm2.__dict__, gemm2_n_split=plan.gemm2_n_split, gemm1_split_k=plan.gemm1_split_k,
             prep_x=plan.prep_x, parallel_align=plan.parallel_align, slot_dedup=plan.slot_dedup,
             gemm1_fused_reduce=plan.gemm1_fused_reduce, pdl=plan.pdl, l2_prefetch=plan.l2_prefetch,
             gemm2_split_slots=plan.gemm2_split_slots, dedup_fused_finalize=plan.dedup_fused_finalize,
             finalize_block=plan.finalize_block)
    if ctx.check:
        out = call.run(layers.prepared[0], plan)
        r["rel_err_vs_reference"], r["checked_tokens"] = check_against_reference(call, out, layers.experts[0])
        if layers.marlin and emap is None:
            r["rel_diff_vs_marlin"] = rel_err(out, layers.marlin[0].run(x, tw, ids))
    us = call.time(layers, plan)
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
            r["stage_us"] = {"align": call.time(layers, plan, stages=("align",)),
                             "align+gemm1": call.time(layers, plan, stages=("align", "gemm1"))}
        except Exception as exc:  # noqa: BLE001
            r["stage_us"] = {"error": repr(exc)[:300]}
    if ctx.w4a4:
        try:
            r["us_w4a4"] = call.time(layers, mode="w4a4")
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
    shard from the GPU's L2 (:func:`layers_for`, at least ``min_layers``). The counts used: ``out["layers"]``.
    Every shard name, token count and routing is checked before anything is measured (a Glm5Fp4Error names it)."""
    spec = Glm5Spec()
    shards = [glm5_shard(name, spec) if isinstance(name, str) else name for name in shards]
    check_token_counts(tokens)
    for rt in routings:
        R.check(rt)
    if layers is not None and layers < 1:
        raise Glm5Fp4Error(f"--layers {layers}: at least one layer per CUDA graph")
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
    for sh in shards:
        count = layer_count(sh, layers, ctx.l2_bytes, device, min_layers)
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
    if "skipped" in r:
        return f"{r['shard']} T={r['tokens']} {r['routing']}: not timed, {r['skipped']}"
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
        *(["Expert-parallel shards are timed as rank 0, and their skewed routings put the hot experts on it: that rank "
           "then has up to EP times a balanced rank's slots, so their skew is the ranks' load imbalance, not the "
           "kernel's schedule (read their % of bf16)."] if any(str(r.get("shard", "")).startswith("ep") for r in rows)
          else []),
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
        if "skipped" in r:
            lines.append(f"| {r['shard']} | {r['tokens']} | {r['routing']} | {r.get('experts_touched')} | "
                         f"not timed: {r['skipped'][:80]} |" + " |" * 10)
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
