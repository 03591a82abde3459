"""Which ceiling binds GLM-5 decode on 8x RTX PRO 6000 (TP8) at concurrency 1..512: the numbers behind write-up 01.

For each concurrency it takes one TP8 rank's decode step from the cost model `plan` and `profile analyze` share
(`glm5_fp4.cost_model`: bytes and FLOPs per component: routed experts, attention + DSA indexer, other GEMMs)
and divides by each roof of the hardware table:
memory bandwidth, NVFP4 sparse (the "4 PFLOPS" headline), NVFP4 dense, FP8 dense and BF16 dense. The
ceiling that binds is the largest time. Derived from the hardware table, not measured on an RTX PRO 6000.

    python benchmarks/ceilings_rtx6000.py   # writes benchmarks/results/ceilings_rtx_pro_6000.{json,png}
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_fp4 import cost_model  # noqa: E402
from glm5_fp4.bench.meta import result_metadata  # noqa: E402
from glm5_fp4.hardware import get_gpu  # noqa: E402
from glm5_fp4.spec import GLM5  # noqa: E402

GPU = "rtx-pro-6000-ws"
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTEXT = 2048
ROOFS = (("nvfp4", True), ("nvfp4", False), ("fp8", False), ("bf16", False))


def rows() -> list[dict]:
    gpu = get_gpu(GPU)
    out = []
    for c in CONCURRENCY:
        step = cost_model.decode_step(GLM5, gpu, cost_model.Layout(tp=8), c, CONTEXT)
        s = step.bottleneck
        compute = [s.category(cat) for cat in ("expert_gemm", "attention", "other_gemm")]
        nbytes, flops = sum(cat.bytes for cat in compute), sum(cat.flops for cat in compute)
        expert = s.category("expert_gemm")
        row = {
            "concurrency": c,
            "bytes_per_gpu_gb": nbytes / 1e9,
            "tflop_per_gpu": flops / 1e12,
            "arithmetic_intensity_flop_per_byte": flops / nbytes,
            "expert_intensity_flop_per_byte": expert.flops / expert.bytes,
            "memory_ms": nbytes / gpu.bandwidth_bytes_per_s * 1e3,
            "allreduce_ms": s.category("allreduce").seconds * 1e3,
        }
        for dtype, sparse in ROOFS:
            key = f"{dtype}_{'sparse' if sparse else 'dense'}_ms"
            row[key] = flops / (gpu.peak_tflops(dtype, sparse) * 1e12) * 1e3
        roofs = {k: v for k, v in row.items() if k.endswith("_ms") and k != "allreduce_ms"}
        # FP4 dense is the compute roof NVFP4 kernels can actually reach; the sparse figure needs 2:4 weights.
        row["binding"] = max(("memory_ms", "nvfp4_dense_ms"), key=lambda k: roofs[k]).removesuffix("_ms")
        row["floor_ms"] = max(roofs["memory_ms"], roofs["nvfp4_dense_ms"]) + row["allreduce_ms"]
        row["tokens_per_s_ceiling"] = c / row["floor_ms"] * 1e3
        out.append(row)
    return out


def plot(data: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in data]
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"memory_ms": ("memory bandwidth 1.79 TB/s", "k", "-"),
              "nvfp4_sparse_ms": ("NVFP4 sparse 4 PF (headline)", "tab:red", ":"),
              "nvfp4_dense_ms": ("NVFP4 dense ~2 PF", "tab:red", "-"),
              "fp8_dense_ms": ("FP8 dense ~1 PF", "tab:orange", "--"),
              "bf16_dense_ms": ("BF16 dense 504 TF", "tab:blue", "--"),
              "allreduce_ms": ("all-reduce (PCIe, NCCL model)", "tab:green", "-.")}
    for key, (label, color, ls) in styles.items():
        ax.plot(c, [r[key] for r in data], label=label, color=color, linestyle=ls, marker="o", ms=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency (sequences decoding together)")
    ax.set_ylabel("time per decode step per GPU (ms)")
    ax.set_title(f"GLM-5 NVFP4 decode, TP8 on 8x RTX PRO 6000, context {CONTEXT}: each ceiling")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    data = rows()
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    step = cost_model.decode_step(GLM5, get_gpu(GPU), cost_model.Layout(tp=8), CONCURRENCY[-1], CONTEXT)
    result = {
        **result_metadata(benchmark="ceilings", target_gpu=GPU, layout="TP8", context=CONTEXT),
        "source": "derived: glm5_fp4.cost_model bytes/FLOPs per step x glm5_fp4/data/hardware.yaml peaks (not measured)",
        "assumptions": cost_model.assumptions(step),
        "rows": data,
    }
    with open(os.path.join(out_dir, "ceilings_rtx_pro_6000.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(data, os.path.join(out_dir, "ceilings_rtx_pro_6000.png"))
    print(f"{'c':>4} {'GB/GPU':>7} {'FLOP/B':>7} {'mem ms':>7} {'fp4 sp':>7} {'fp4 dn':>7} {'fp8':>7} {'bf16':>7} {'AR ms':>7}  binds")
    for r in data:
        print(f"{r['concurrency']:>4} {r['bytes_per_gpu_gb']:>7.1f} {r['arithmetic_intensity_flop_per_byte']:>7.1f} "
              f"{r['memory_ms']:>7.2f} {r['nvfp4_sparse_ms']:>7.3f} {r['nvfp4_dense_ms']:>7.3f} {r['fp8_dense_ms']:>7.3f} "
              f"{r['bf16_dense_ms']:>7.3f} {r['allreduce_ms']:>7.2f}  {r['binding']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
