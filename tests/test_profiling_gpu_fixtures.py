"""The analyzer on real GPU traces written by benchmarks/gpu_layer_timers.py on a lent H200 machine.

Expected layout (the script's traces.tar.gz, trimmed with `glm5-fp4 profile trim`):
tests/fixtures/profiling/traces/single/{eager,graph}/*.json.gz and traces/tp<N>/{eager,graph}/*.json.gz.
"""

import gzip
import json
from pathlib import Path

import pytest

from glm5_fp4.profiling.breakdown import analyze_path

ROOT = Path(__file__).resolve().parent / "fixtures" / "profiling" / "traces"
DIRS = sorted(p for p in ROOT.glob("*/*") if p.is_dir() and any(p.glob("*.json*"))) if ROOT.is_dir() else []

if not DIRS:
    pytest.skip(f"no GPU trace fixtures under {ROOT} yet: run benchmarks/gpu_layer_timers.py on a GPU machine", allow_module_level=True)


def _raw_kernel_us(path: Path) -> float:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    return sum(e.get("dur", 0) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


@pytest.mark.parametrize("trace_dir", DIRS, ids=[f"{p.parent.name}/{p.name}" for p in DIRS])
def test_real_traces(trace_dir):
    b = analyze_path(trace_dir, jobs=1)
    files = {p.name: p for p in trace_dir.glob("*.json*")}
    for r in b.ranks:
        # categories add up to the kernel time in the file, counted independently here
        assert sum(r.summed_us.values()) == pytest.approx(_raw_kernel_us(files[r.file]), rel=1e-6)
        assert r.summed_us["expert_gemm"] > 0  # this project's fused MoE kernels and torch._grouped_mm
        assert r.summed_us["attention"] > 0  # SDPA
        assert r.n_steps >= 3
        unknown = sum(u.total_us for u in r.unknown_kernels)
        assert unknown < 0.05 * r.total_kernel_us, [u.name for u in r.unknown_kernels]
        if trace_dir.name == "eager":
            assert r.step_method == "annotation"
    if trace_dir.parent.name.startswith("tp"):
        for r in b.ranks:
            assert r.allreduce["kernels"] > 0 and r.allreduce["matched"] > 0
        # the last rank sleeps before its expert GEMMs: in every decode step the others wait for it in all-reduce
        # (per-step medians: the whole-trace sum also holds the ranks' profiler start skew at the first collective)
        waits = {r.rank: r.median_step["exposed_us"]["allreduce_wait"] for r in b.ranks}
        last = max(waits)  # the slow rank
        assert waits[last] == min(waits.values())
        assert all(w > waits[last] for rank, w in waits.items() if rank != last)
