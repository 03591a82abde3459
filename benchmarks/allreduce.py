"""NCCL all-reduce latency and bandwidth for decode-size messages, on every GPU count from 2 to what is visible.

A GLM-5 decode step all-reduces the hidden states twice per layer (after attention and after the MoE) under
tensor parallelism: B x 6144 x 2 bytes each, 12 KiB at B=1 to 6 MiB at B=512. This measures the time per
all-reduce (median over CUDA-event-timed, CUDA-graph-replayed batches, so launch overhead is excluded as in
an engine's decode graph) and reports algorithm and bus bandwidth (nccl-tests convention:
busBW = algBW x 2(n-1)/n).

    python benchmarks/allreduce.py --out benchmarks/results/allreduce_h200.json

No engine imports; torch and the glm5_fp4 package (GLM-5's hidden size, the result metadata). Runs on the lent
H200 machines (NVLink) — the RTX PRO 6000 figures (PCIe) come from the hardware table, not from this script.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from glm5_fp4.bench.meta import result_metadata  # noqa: E402
from glm5_fp4.spec import GLM5  # noqa: E402

HIDDEN = GLM5.hidden_size  # each decode all-reduce carries batch x hidden BF16 values
BATCHES = (1, 8, 32, 64, 128, 256, 512)
EXTRA_BYTES = (4 * 1024, 64 * 1024, 16 * 1024**2, 64 * 1024**2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, sizes: list[int], iters: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    results = []
    stream = torch.cuda.Stream()
    for nbytes in sizes:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        # Capture `iters` all-reduces in one graph: replay time / iters is the per-call device time.
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            dist.all_reduce(x)
            stream.synchronize()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(iters):
                    dist.all_reduce(x)
        torch.cuda.synchronize()
        times = []
        for _ in range(7):
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / iters)
        us = statistics.median(times)
        alg = nbytes / (us * 1e-6) / 1e9
        results.append({"bytes": nbytes, "us": us, "alg_bw_gbs": alg, "bus_bw_gbs": alg * 2 * (world - 1) / world})
        del g
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, sizes: list[int], iters: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, sizes, iters, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=120)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "allreduce_h200.json"))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--max-gpus", type=int, default=8)
    args = parser.parse_args()
    n = min(torch.cuda.device_count(), args.max_gpus)
    if n < 2:
        print("needs at least 2 GPUs", file=sys.stderr)
        return 2
    sizes = sorted({b * HIDDEN * 2 for b in BATCHES} | set(EXTRA_BYTES))
    worlds = sorted({w for w in (2, 4, 8) if w <= n} | {n})
    result = {
        **result_metadata(benchmark="allreduce", gpus_visible=n, nccl=".".join(map(str, torch.cuda.nccl.version()))),
        "method": f"median of 7 CUDA-graph replays of {args.iters} back-to-back all-reduces (bf16, sum)",
        "hidden_size": HIDDEN, "runs": {},
    }
    for w in worlds:
        rows = measure(w, sizes, args.iters)
        for r in rows:
            r["decode_batch"] = r["bytes"] // (HIDDEN * 2) if r["bytes"] % (HIDDEN * 2) == 0 else None
        result["runs"][str(w)] = rows
        print(f"\n{w} GPUs ({result['gpu']}):")
        print(f"{'bytes':>10} {'batch':>6} {'us':>9} {'algBW GB/s':>11} {'busBW GB/s':>11}")
        for r in rows:
            print(f"{r['bytes']:>10} {str(r['decode_batch'] or ''):>6} {r['us']:>9.2f} {r['alg_bw_gbs']:>11.1f} {r['bus_bw_gbs']:>11.1f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
