"""The kernel benchmark on this GPU, through :mod:`glm5_fp4.bench.moe` (the same code as the project's
``benchmarks/moe_kernel.py``, inside the installed package, so a pip-installed self-test measures what the
project publishes): CUDA-graph timings of the fused kernel at GLM-5 shapes on balanced and skewed routings,
vLLM's Marlin MoE when vLLM's CUDA build is installed, torch's bf16/fp8 grouped GEMMs, and the copy
bandwidth and bf16 rate measured in the same process. Adds the percentage of the GPU's datasheet
bandwidth when the GPU is in the hardware table.

Where this GPU's plan tables were picked on another GPU (sm_120's on an H200 standing in for it, improvements/17), the
former tables (an opt-in form with ``tables="former"``) are timed beside the defaults on balanced routing: the check,
on the user's GPU, of a choice the project could not measure there.
"""

from __future__ import annotations

import time
import traceback

# layers: distinct layers per CUDA graph, at least min_layers and enough to overflow this GPU's L2 (bench.moe.layers_for:
# an RTX PRO 6000's 128 MB L2 holds 4 TP8 layers' weights at T=1, which would then time L2, not DRAM)
QUICK = {"shards": ("tp8",), "tokens": (1, 16, 256), "routings": ("balanced", "same_k"), "layers": None,
         "min_layers": 2}
FULL = {"shards": ("tp8", "tp4"), "tokens": (1, 4, 16, 64, 256, 1024, 4096),
        "routings": ("balanced", "same_k", "zipf1.2"), "layers": None, "min_layers": 4}


def run(env: dict, quick: bool, progress=None) -> dict:
    """Benchmark rows (one per shard, batch size and routing) plus the same-run copy and bf16 GEMM rates."""
    from glm5_fp4.bench import moe as B

    plan = QUICK if quick else FULL
    out: dict = {"status": "ok", "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in plan.items()}}
    table_bw = (env.get("hardware_table") or {}).get("mem_bandwidth_gbs")
    t0 = time.perf_counter()
    try:
        res = B.run_table(plan["shards"], plan["tokens"], plan["routings"], layers=plan["layers"], marlin=True,
                          baselines=True, w4a4=True, on_row=None, min_layers=plan.get("min_layers", B.DEFAULT_LAYERS),
                          progress=None if progress is None else (lambda msg: progress({"message": msg})))
    except Exception as exc:  # noqa: BLE001 - reported; the correctness part still stands
        return {**out, "status": "error", "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-1500:], "rows": []}
    for r in res["rows"]:
        if table_bw and "gbs" in r:
            r["pct_table_bw"] = 100.0 * r["gbs"] / table_bw
    out.update(copy_gbs=res["copy_gbs"], bf16_tflops=res["bf16_tflops"], marlin=res.get("marlin"), rows=res["rows"],
               layers=res.get("layers"), l2_bytes=res.get("l2_bytes"))
    former = former_plans(env.get("arch"), env.get("sm_count"), plan, res["rows"], progress=progress)
    if former:
        out["former_plans"] = former
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if any("error" in r for r in out["rows"]):
        out["status"] = "partial"
    return out


def former_forms(arch: str | None) -> list[str]:
    """The opt-in forms that bring back ``arch``'s former plan tables (configs.OPT_IN entries with tables="former")."""
    from glm5_fp4.kernels import configs as C

    return [n for n, o in C.OPT_IN.items() if o.change.get("tables") == "former" and o.archs and arch in o.archs]


def former_plans(arch: str | None, sm_count: int | None, plan: dict, rows: list[dict], progress=None,
                 device: str = "cuda") -> list[dict]:
    """Each former-table form of ``arch`` timed on the benchmark's first shard, balanced routing, at its batch sizes,
    beside the default rows of the same run: one entry per form with its rows (``default_us``, ``former_us``,
    ``former_over_default``: below 1, the former plan is faster on this GPU). Empty where ``arch`` has none."""
    from glm5_fp4.bench import moe as B
    from glm5_fp4.kernels import configs as C

    out = []
    shard = plan["shards"][0]
    default = {(r["shard"], r["tokens"]): r.get("us") for r in rows if r.get("routing") == "balanced"}
    for form in former_forms(arch):
        def plan_for(sh, t, form=form):
            return C.plan(arch, t, sh.num_experts, sh.top_k, sh.hidden, sh.intermediate, sm_count=sm_count,
                          global_experts=sh.global_experts if sh.expert_parallel else None, form=form)

        entry = {"form": form, "purpose": C.OPT_IN[form].purpose, "rows": []}
        try:
            res = B.run_table((shard,), plan["tokens"], ("balanced",), layers=plan["layers"], marlin=False,
                              baselines=False, plan_for=plan_for, device=device,
                              min_layers=plan.get("min_layers", B.DEFAULT_LAYERS),
                              progress=None if progress is None else (lambda msg: progress({"message": f"{form}: {msg}"})))
        except Exception as exc:  # noqa: BLE001 - reported beside the defaults, which stand
            entry["error"] = f"{type(exc).__name__}: {exc}"
            out.append(entry)
            continue
        for r in res["rows"]:
            d = default.get((r["shard"], r["tokens"]))
            row = {"shard": r["shard"], "tokens": r["tokens"], "default_us": d, "former_us": r.get("us")}
            if "error" in r:
                row["error"] = r["error"]
            elif d:
                row["former_over_default"] = r["us"] / d
            entry["rows"].append(row)
        out.append(entry)
    return out
