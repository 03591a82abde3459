"""GPU check of the per-layer timers inside a CUDA graph, and real Kineto traces for the analyzer's fixtures.

Runs on a CUDA machine (no engine needed; torch + Triton only):

1. Layer timers: a small stack of decoder-like layers (RMSNorm, projections, SDPA attention over a KV cache,
   this project's fused NVFP4 MoE kernel behind a router) is captured in a CUDA graph with a LayerTimer mark per layer and ranges
   for attention and MoE. Over many replays it checks that every region is non-zero, that the layer marks
   come back in layer order, and that the layers sum to within a few % of the replay time measured with CUDA
   events; it measures the overhead against the same graph captured without timers. Eager mode too.
2. Traces: torch.profiler traces of eager steps (with ProfilerStep# annotations) and of CUDA-graph replays
   (no CPU op names), single GPU; with more than one GPU, the same on every rank of a torch.distributed NCCL
   group with two all-reduces per layer and the last rank made slower (a GPU sleep before its expert GEMMs),
   so the other ranks wait in all-reduce. The MoE is this project's Triton kernel (moe_gemm1_kernel, moe_gemm2_*_kernel, ...)
   and torch._grouped_mm adds a real CUTLASS grouped GEMM.

Output (``$OUT`` if set, else ./out/gpu_layer_timers): gpu_layer_timers.json (all numbers and checks),
layer_timers.md, traces.tar.gz (single/{eager,graph}/..., tp<N>/{eager,graph}/..., vLLM file names).
Exit code 0 only if every check passed.

    python benchmarks/gpu_layer_timers.py [--layers 8] [--replays 50] [--world auto|1|2|4] [--timeout-s 480]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import signal
import socket
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from glm5_fp4.bench.meta import result_metadata  # noqa: E402
from glm5_fp4.kernels import fused_moe  # noqa: E402
from glm5_fp4.profiling.layer_timers import LayerTimer, NullTimer  # noqa: E402
from glm5_fp4.reference import route  # noqa: E402

SUM_TOLERANCE = 0.05
OVERHEAD_GOAL = 0.02


try:
    import triton
except ImportError:  # checked in main(): CUDA builds of torch ship Triton
    triton = None


def random_prepared_experts(experts: int, hidden: int, inter: int, top_k: int, max_tokens: int, device):
    """This project's NVFP4 experts (random valid codes and scales) in the fused kernel's layout."""
    from glm5_fp4.kernels import prepare_experts, reserve_workspace
    from glm5_fp4.reference import NvFp4Experts

    def arrays(n, k):
        packed = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device=device)
        scale = (torch.rand(experts, n, k // 16, device=device) * 2 + 0.5).to(torch.float8_e4m3fn)
        return packed, scale, torch.full((experts,), 1.0 / (6 * 448) / k**0.5, device=device)

    prepared = prepare_experts(NvFp4Experts(*arrays(2 * inter, hidden), *arrays(hidden, inter)))
    reserve_workspace(prepared, top_k, max_tokens)
    return prepared


class DecoderStandIn(nn.Module):
    def __init__(self, idx: int, hidden: int, heads: int, batch: int, context: int, experts: int, per_expert: int,
                 inter: int, device, dtype, grouped_mm: bool):
        super().__init__()
        self.idx, self.heads, self.head_dim = idx, heads, hidden // heads
        self.experts, self.per_expert = experts, per_expert
        self.norm1 = nn.RMSNorm(hidden, device=device, dtype=dtype)
        self.q = nn.Linear(hidden, hidden, bias=False, device=device, dtype=dtype)
        self.o = nn.Linear(hidden, hidden, bias=False, device=device, dtype=dtype)
        self.norm2 = nn.RMSNorm(hidden, device=device, dtype=dtype)
        self.router = nn.Linear(hidden, experts, bias=False, device=device, dtype=dtype)
        scale = hidden ** -0.5
        self.k_cache = torch.randn(batch, heads, context, self.head_dim, device=device, dtype=dtype)
        self.v_cache = torch.randn(batch, heads, context, self.head_dim, device=device, dtype=dtype)
        # The real fused NVFP4 MoE kernel (glm5_fp4.kernels), top-k chosen so each expert gets ~per_expert tokens.
        self.top_k = max(1, min(experts, experts * per_expert // batch))
        self.prepared = random_prepared_experts(experts, hidden, inter, self.top_k, batch, device)
        self.grouped_mm = grouped_mm
        if grouped_mm:  # the shared expert through torch._grouped_mm: a real CUTLASS GroupProblemShape kernel
            self.ws = nn.Parameter(torch.randn(experts, hidden, inter, device=device, dtype=dtype) * scale)
            tokens = experts * per_expert
            self.offs = torch.arange(per_expert, tokens + 1, per_expert, device=device, dtype=torch.int32)

    def forward(self, x: torch.Tensor, timer, group=None, skew_cycles: int = 0) -> torch.Tensor:
        b, h = x.shape
        name = f"layer{self.idx:02d}"
        timer.mark(name)
        with timer.range(f"{name}/attention"):
            q = self.q(self.norm1(x)).view(b, self.heads, 1, self.head_dim)
            attn = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache)
            y = self.o(attn.reshape(b, h))
        if group is not None:
            with timer.range(f"{name}/allreduce_attn"):
                torch.distributed.all_reduce(y, group=group)
        x = x + y
        with timer.range(f"{name}/moe"):
            hn = self.norm2(x)
            weights, ids = route(self.router(hn).float(), None, self.top_k)
            if skew_cycles:
                torch.cuda._sleep(skew_cycles)  # this rank is the slow one: the others wait in all-reduce
            y = fused_moe(hn, weights, ids, self.prepared)
            if self.grouped_mm:
                xe = hn.repeat(self.experts * self.per_expert // b + 1, 1)[: self.experts * self.per_expert]
                shared = torch._grouped_mm(xe, self.ws, offs=self.offs)
                y = y + shared.sum() * 0
        if group is not None:
            with timer.range(f"{name}/allreduce_moe"):
                torch.distributed.all_reduce(y, group=group)
        return x + y


class Stack(nn.Module):
    def __init__(self, layers: list[DecoderStandIn]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x, timer, group=None, skew_cycles: int = 0):
        for layer in self.layers:
            x = layer(x, timer, group, skew_cycles)
        timer.stop()
        return x


def _grouped_mm_works(device) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
        w = torch.randn(2, 64, 32, device=device, dtype=torch.bfloat16)
        torch._grouped_mm(x, w, offs=torch.tensor([16, 32], device=device, dtype=torch.int32))
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - any failure just means "leave it out"
        return False


def build(args, device, grouped_mm: bool) -> Stack:
    torch.manual_seed(0)
    layers = [
        DecoderStandIn(i, args.hidden, args.heads, args.batch, args.context, args.experts, args.per_expert, args.inter,
                       device, torch.bfloat16, grouped_mm)
        for i in range(args.layers)
    ]
    return Stack(layers).eval()


def capture(model: Stack, x: torch.Tensor, timer, group=None, skew_cycles: int = 0) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):  # compile Triton kernels and warm up NCCL outside capture
            model(x, timer, group, skew_cycles)
            if isinstance(timer, LayerTimer):
                timer.collect()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = model(x, timer, group, skew_cycles)
    torch.cuda.synchronize()
    if isinstance(timer, LayerTimer):
        timer.buf.zero_()
    return graph, out


def timed_replays(graph, n: int, timer=None) -> tuple[list[float], list[dict]]:
    times, regions = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(n):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
        if timer is not None:
            regions.append(timer.collect())
    return times, regions


def median(values):
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


# -- 1. layer timers in a CUDA graph --------------------------------------------------------------------
def check_layer_timers(args, device) -> dict:
    grouped = _grouped_mm_works(device)
    model = build(args, device, grouped)
    x = torch.randn(args.batch, args.hidden, device=device, dtype=torch.bfloat16)
    timer = LayerTimer(device=device)
    graph_t, _ = capture(model, x, timer)
    graph_n, _ = capture(model, x, NullTimer())
    # interleave so clock drift and thermal state hit both alike
    times_t, times_n, regions = [], [], []
    for _ in range(args.replays):
        t, r = timed_replays(graph_t, 1, timer)
        times_t += t
        regions += r
        times_n += timed_replays(graph_n, 1)[0]
    layer_names = [f"layer{i:02d}" for i in range(args.layers)]
    checks = {}
    nonzero = all(all(r.get(n, 0.0) > 0 for n in layer_names) for r in regions)
    sub = [k for k in regions[0] if "/" in k]
    checks["all_regions_nonzero"] = nonzero and all(all(r.get(k, 0.0) > 0 for k in sub) for r in regions)
    checks["layers_in_order"] = all([k for k in r if k in layer_names] == layer_names for r in regions)
    sums = [sum(r[n] for n in layer_names) for r in regions]
    ratio = [s / t for s, t in zip(sums, times_t)]
    checks["layers_sum_within_tolerance"] = abs(median(ratio) - 1.0) <= SUM_TOLERANCE
    inner = [r[f"{n}/attention"] + r[f"{n}/moe"] <= r[n] * 1.001 + 0.5 for r in regions for n in layer_names]
    checks["ranges_inside_layers"] = all(inner)
    overhead = (median(times_t) - median(times_n)) / median(times_n)
    checks["overhead_below_goal"] = overhead <= OVERHEAD_GOAL
    stamps = len(timer._slot)

    # eager: the same timer without a graph
    eager_timer = LayerTimer(device=device)
    with torch.no_grad():
        for _ in range(3):
            model(x, eager_timer)
            eager_timer.collect()
        eager_regions = []
        for _ in range(10):
            model(x, eager_timer)
            eager_regions.append(eager_timer.collect())
    checks["eager_regions_nonzero"] = all(all(r.get(n, 0.0) > 0 for n in layer_names) for r in eager_regions)

    summary = {n: {"median_us": median([r[n] for r in regions]), "p90_us": sorted(r[n] for r in regions)[int(0.9 * (len(regions) - 1))]}
               for n in regions[0]}
    return {
        "config": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "batch", "context", "experts", "per_expert", "inter", "replays")},
        "grouped_mm_shared_expert": grouped,
        "stamps_per_step": stamps,
        "replay_us_with_timers_median": median(times_t),
        "replay_us_without_timers_median": median(times_n),
        "overhead_fraction": overhead,
        "overhead_us_per_stamp": (median(times_t) - median(times_n)) / stamps,
        "layers_sum_over_replay_median": median(ratio),
        "regions_graph": summary,
        "regions_eager_median_us": {n: median([r[n] for r in eager_regions]) for n in eager_regions[0]},
        "checks": checks,
        "_stats_timer": timer,
    }


# -- 2. traces ------------------------------------------------------------------------------------------
def _export(prof, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name.removesuffix(".gz"))
    prof.export_chrome_trace(str(tmp))
    with open(tmp, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    tmp.unlink()
    return path


def trace_name(rank: int, pp: int = 0) -> str:
    return f"dp0_pp{pp}_tp{rank}_dcp0_ep0_rank{rank}.{time.time_ns()}.pt.trace.json.gz"


def write_traces(model, x, out: Path, rank: int, group=None, skew_cycles: int = 0, steps: int = 4) -> dict:
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    null = NullTimer()
    written = {}
    with torch.no_grad():
        for _ in range(2):
            model(x, null, group, skew_cycles)
        torch.cuda.synchronize()
        # A schedule makes prof.step() record the ProfilerStep#N annotations step detection uses; one
        # active step more than run keeps the cycle open until the context exits (a closed cycle is dropped).
        with profile(activities=acts, schedule=schedule(wait=0, warmup=0, active=steps + 1)) as prof:
            for _ in range(steps):
                model(x, null, group, skew_cycles)
                torch.cuda.synchronize()
                prof.step()
        written["eager"] = str(_export(prof, out / "eager" / trace_name(rank)))
    graph, _ = capture(model, x, null, group, skew_cycles)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            graph.replay()
            torch.cuda.synchronize()  # an idle gap between steps, as a server's scheduler leaves
            time.sleep(0.0002)
    written["graph"] = str(_export(prof, out / "graph" / trace_name(rank)))
    return written


def _sleep_cycles_per_us(device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / (start.elapsed_time(end) * 1000.0)


def _dist_worker(rank: int, world: int, port: int, args, out: str, result_dir: str) -> None:
    import torch.distributed as dist

    result = {"rank": rank}
    try:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        grouped = _grouped_mm_works(device)
        model = build(args, device, grouped)
        x = torch.randn(args.batch, args.hidden, device=device, dtype=torch.bfloat16)
        skew = int(args.skew_us * _sleep_cycles_per_us(device)) if rank == world - 1 else 0
        result["skew_cycles"] = skew
        dist.barrier()
        try:
            result["files"] = write_traces(model, x, Path(out), rank, dist.group.WORLD, skew)
        except Exception as exc:  # noqa: BLE001 - NCCL capture may be unsupported: keep the eager trace
            result["graph_error"] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_distributed(args, world: int, out: Path, timeout_s: float) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result_dir = tempfile.mkdtemp(prefix="glm5fp4-dist-")
    ctx = mp.start_processes(_dist_worker, args=(world, port, args, str(out), result_dir), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    finished = False
    while time.monotonic() < deadline:
        try:
            if ctx.join(timeout=5):
                finished = True
                break
        except Exception as exc:  # noqa: BLE001 - a rank died (NCCL abort, segfault): stop the others
            print(f"distributed run: {exc}", file=sys.stderr)
            break
    if not finished:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    ranks = []
    for r in range(world):
        f = Path(result_dir, f"rank{r}.json")
        ranks.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "error": "no result (timed out or crashed)"})
    shutil.rmtree(result_dir, ignore_errors=True)
    return {"world": world, "finished": finished, "ranks": ranks}


def analyze_if_possible(trace_dir: Path) -> dict:
    """Run this project's analyzer on the traces when its dependencies are on this machine."""
    try:
        from glm5_fp4.profiling.breakdown import analyze_path
    except Exception as exc:  # noqa: BLE001 - e.g. PyYAML missing on the GPU box
        return {"skipped": f"analyzer not importable here: {exc}"}
    out = {}
    for sub in sorted(p for p in trace_dir.rglob("*") if p.is_dir() and any(p.glob("*.json.gz"))):
        try:
            b = analyze_path(sub, jobs=1)
        except Exception as exc:  # noqa: BLE001
            out[str(sub.relative_to(trace_dir))] = {"error": str(exc)}
            continue
        out[str(sub.relative_to(trace_dir))] = {
            f"rank{r.rank}": {
                "steps": r.n_steps, "method": r.step_method, "median_step_us": round(r.median_step["time_us"], 1) if r.median_step else None,
                "allreduce_kernels": r.allreduce["kernels"], "allreduce_wait_us": round(r.allreduce["wait_us"], 1),
                "summed_us": {k: round(v, 1) for k, v in r.summed_us.items()},
                "unknown": [u.name[:80] for u in r.unknown_kernels][:10],
            }
            for r in b.ranks
        }
    return out


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    def handler(signum, frame):
        raise TimeoutError(f"{what} took longer than {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--per-expert", type=int, default=16)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--skew-us", type=float, default=30.0, help="extra GPU time before each MoE on the last rank")
    ap.add_argument("--world", default="auto", help="ranks for the NCCL traces: auto (all GPUs, at most 8) or a number; 1 = skip")
    ap.add_argument("--timeout-s", type=float, default=480.0, help="limit for the whole run")
    ap.add_argument("--out", default=os.environ.get("OUT") or "out/gpu_layer_timers")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available() or triton is None:
        print("gpu_layer_timers: needs a CUDA device and Triton", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traces = Path(tempfile.mkdtemp(prefix="glm5fp4-traces-"))
    device = torch.device("cuda", 0)
    began = time.monotonic()
    result = result_metadata(benchmark="gpu_layer_timers", cuda=torch.version.cuda)
    ok = True
    stats_timer = None
    try:
        with time_limit(args.timeout_s * 0.4, "layer-timer checks"):
            lt = check_layer_timers(args, device)
        stats_timer = lt.pop("_stats_timer")
        result["layer_timers"] = lt
        ok &= all(lt["checks"].values())
    except Exception as exc:  # noqa: BLE001
        result["layer_timers"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        ok = False
    try:
        with time_limit(args.timeout_s * 0.2, "single-GPU traces"):
            model = build(args, device, _grouped_mm_works(device))
            x = torch.randn(args.batch, args.hidden, device=device, dtype=torch.bfloat16)
            result["traces_single"] = write_traces(model, x, traces / "single", 0)
            del model
            torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001
        result["traces_single"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        ok = False
    world = min(torch.cuda.device_count(), 8) if args.world == "auto" else int(args.world)
    if world > 1:
        remaining = args.timeout_s - (time.monotonic() - began) - 30
        dist_result = run_distributed(args, world, traces / f"tp{world}", max(remaining, 60))
        result["distributed"] = dist_result
        ok &= dist_result["finished"] and not any("error" in r for r in dist_result["ranks"])
    result["analysis"] = analyze_if_possible(traces)

    with tarfile.open(out / "traces.tar.gz", "w:gz") as tar:
        tar.add(traces, arcname="traces")
    shutil.rmtree(traces, ignore_errors=True)
    if stats_timer is not None:
        (out / "layer_timers.md").write_text(stats_timer.stats.to_markdown("Per-layer timers in a CUDA graph (stand-in stack)"))
    result["all_checks_passed"] = ok
    result["seconds"] = round(time.monotonic() - began, 1)
    (out / "gpu_layer_timers.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    lt = result.get("layer_timers", {})
    print(f"GPU {result['gpu']} x{result['gpus']}, torch {result['torch']}")
    if "checks" in lt:
        print(f"replay with timers {lt['replay_us_with_timers_median']:.1f} us, without {lt['replay_us_without_timers_median']:.1f} us, "
              f"overhead {100 * lt['overhead_fraction']:.2f} % ({lt['stamps_per_step']} stamps, {lt['overhead_us_per_stamp']:.2f} us/stamp); "
              f"layers sum / replay {lt['layers_sum_over_replay_median']:.3f}")
        for k, v in lt["checks"].items():
            print(f"  {'PASS' if v else 'FAIL'} {k}")
    else:
        print(f"layer timers: {lt.get('error')}")
    print(f"traces: {out / 'traces.tar.gz'}; results: {out / 'gpu_layer_timers.json'}; {'ALL PASS' if ok else 'SOME CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
