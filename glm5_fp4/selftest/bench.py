"""The kernel benchmark on this GPU, through :mod:`glm5_fp4.bench.moe` (the same code as the project's
``benchmarks/moe_kernel.py``, inside the installed package, so a pip-installed self-test measures what the
project publishes): CUDA-graph timings of the fused kernel at GLM-5 shapes on balanced and skewed routings,
vLLM's Marlin MoE when vLLM's CUDA build is installed, torch's bf16/fp8 grouped GEMMs, and the copy
bandwidth and bf16 rate measured in the same process. Adds the percentage of the GPU's datasheet
bandwidth when the GPU is in the hardware table.
"""

from __future__ import annotations

import time
import traceback

QUICK = {"shards": ("tp8",), "tokens": (1, 16, 256), "routings": ("balanced", "same_k"), "layers": 2}
FULL = {"shards": ("tp8", "tp4"), "tokens": (1, 4, 16, 64, 256, 1024, 4096),
        "routings": ("balanced", "same_k", "zipf1.2"), "layers": 4}


def run(env: dict, quick: bool, progress=None) -> dict:
    """Benchmark rows (one per shard, batch size and routing) plus the same-run copy and bf16 GEMM rates."""
    from glm5_fp4.bench import moe as B

    plan = QUICK if quick else FULL
    out: dict = {"status": "ok", "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in plan.items()}}
    table_bw = (env.get("hardware_table") or {}).get("mem_bandwidth_gbs")
    t0 = time.perf_counter()
    try:
        res = B.run_table(plan["shards"], plan["tokens"], plan["routings"], layers=plan["layers"], marlin=True,
                          baselines=True, w4a4=True, on_row=None,
                          progress=None if progress is None else (lambda msg: progress({"message": msg})))
    except Exception as exc:  # noqa: BLE001 - reported; the correctness part still stands
        return {**out, "status": "error", "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-1500:], "rows": []}
    for r in res["rows"]:
        if table_bw and "gbs" in r:
            r["pct_table_bw"] = 100.0 * r["gbs"] / table_bw
    out.update(copy_gbs=res["copy_gbs"], bf16_tflops=res["bf16_tflops"], marlin=res.get("marlin"), rows=res["rows"])
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if any("error" in r for r in out["rows"]):
        out["status"] = "partial"
    return out
