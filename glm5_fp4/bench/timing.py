"""GPU timing and the two same-run ceilings (copy bandwidth, bf16 GEMM rate), per the measuring method:
events around the region, warm-up first, medians of repeats, CUDA-graph replays for small launches."""

from __future__ import annotations

import statistics
import subprocess


def graph_time_us(fn, replays: int = 20, warmup: int = 3) -> float:
    """Median time of one replay of a CUDA graph capturing ``fn()`` (each replay timed with events)."""
    import torch

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
    import torch

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


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy of random bytes, counting bytes read plus written."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    us = event_time_us(lambda: b.copy_(a), iters=20, warmup=5)
    return 2 * nbytes / (us * 1e-6) / 1e9


def bf16_gemm_tflops(n: int = 8192) -> float:
    """Dense bf16 n x n x n product on random data through torch (cuBLAS)."""
    import torch

    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = event_time_us(lambda: x @ w, iters=20, warmup=10)
    return 2 * n**3 / (us * 1e-6) / 1e12


def sm_clock_mhz() -> int | None:
    """Current SM clock of GPU 0 (nvidia-smi), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0])
    except Exception:  # noqa: BLE001 - the clock is context, not a result
        return None
