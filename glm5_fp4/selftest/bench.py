"""The kernel benchmark on this GPU, through ``benchmarks/moe_kernel.py`` (the kernel's own benchmark, so the
self-test's numbers are the ones the project publishes): CUDA-graph timings of the fused kernel at GLM-5
shapes, the same-run baselines (bf16 and fp8 grouped GEMMs, dequantize-then-bf16) and the device-copy
bandwidth measured in the same process. Adds the percentage of the GPU's datasheet bandwidth when the GPU is
in the hardware table.
"""

from __future__ import annotations

import importlib.util
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

QUICK = {"tps": (8,), "tokens": (1, 16, 256), "layers": 2}
FULL = {"tps": (8, 4), "tokens": (1, 4, 16, 64, 256, 1024), "layers": 4}


def default_script() -> Path:
    import glm5_fp4

    return Path(glm5_fp4.__file__).resolve().parent.parent / "benchmarks" / "moe_kernel.py"


def load_script(path: Path | None = None):
    """Import ``benchmarks/moe_kernel.py`` by path (it is a script, not part of the installed package)."""
    from glm5_fp4.errors import Glm5Fp4Error

    path = Path(path) if path else default_script()
    if not path.exists():
        raise Glm5Fp4Error(
            f"{path}: benchmark script not found; run from a source checkout or pass --bench-script PATH"
        )
    spec = importlib.util.spec_from_file_location("glm5_fp4_selftest_moe_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(env: dict, quick: bool, script: Path | None = None, progress=None) -> dict:
    """Benchmark rows (one per TP shard and batch size) plus the same-run copy and bf16 GEMM rates."""
    import torch

    from glm5_fp4.spec import Glm5Spec

    plan = QUICK if quick else FULL
    out: dict = {"status": "ok", "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in plan.items()}, "rows": []}
    try:
        mod = load_script(script)
    except Exception as exc:  # noqa: BLE001 - reported, the correctness part still stands
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}", "rows": []}
    out["script"] = str(Path(mod.__file__))
    table_bw = (env.get("hardware_table") or {}).get("mem_bandwidth_gbs")
    t0 = time.perf_counter()
    try:
        out["copy_gbs"] = mod.copy_bandwidth_gbs()
        out["bf16_tflops"] = mod.bf16_gemm_tflops()
    except Exception as exc:  # noqa: BLE001
        return {**out, "status": "error", "error": f"device rates: {type(exc).__name__}: {exc}"}
    spec = Glm5Spec()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tp in plan["tps"]:
        i = spec.moe_intermediate_size // tp
        layers = [mod.random_prepared(spec.n_routed_experts, spec.hidden_size, i, gen) for _ in range(plan["layers"])]
        base, dequant = None, {}
        try:
            base = mod.Baselines(spec.n_routed_experts, spec.hidden_size, i, gen)
            dequant[tp] = mod.dequant_all_us(layers[0])
        except Exception:  # noqa: BLE001 - baselines are context; note and go on
            out.setdefault("baseline_errors", []).append(traceback.format_exc()[-600:])
        for t in plan["tokens"]:
            args = SimpleNamespace(stages=False, w4a4=True, dequant_us=dequant, plan_lookup=None)
            try:
                row = mod.row_for(t, tp, spec, layers, base, out["copy_gbs"], gen, args)
                if table_bw:
                    row["pct_table_bw"] = 100.0 * row["gbs"] / table_bw
            except Exception as exc:  # noqa: BLE001
                row = {"tp": tp, "tokens": t, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-1500:]}
            out["rows"].append(row)
            if progress:
                progress(row)
        del layers, base
        torch.cuda.empty_cache()
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if any("error" in r for r in out["rows"]):
        out["status"] = "partial"
    return out
