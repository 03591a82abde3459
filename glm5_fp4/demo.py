"""`glm5-fp4 demo`: the whole pipeline on CPU with a tiny GLM-5 checkpoint.

Steps: write a tiny NVFP4 checkpoint (dense-attention view, the only GLM-5 attention vLLM's CPU backend runs),
validate it, check one MoE layer of it against a float64 evaluation, then the later stages that exist in
this build. Everything lands under ``--out`` (default ``out/demo``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console

console = Console()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out/demo", help="working directory for the demo's files")
    parser.add_argument("--arch", choices=("glm5", "glm4moe"), default="glm5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-serve", action="store_true", help="stop after the offline steps (no vLLM server)")


def _step(title: str) -> float:
    console.rule(f"[bold]{title}")
    return time.perf_counter()


def make_and_inspect(out: Path, arch: str, seed: int) -> Path:
    from glm5_fp4.checkpoint.inspect import inspect_checkpoint
    from glm5_fp4.checkpoint.make import make_checkpoint

    ckpt = out / f"tiny-{arch}-nvfp4"
    t0 = _step(f"1. tiny {arch} checkpoint in the ModelOpt NVFP4 layout -> {ckpt}")
    make_checkpoint(ckpt, arch=arch, seed=seed, dense_attention=(arch == "glm5"), overwrite=True)
    make_checkpoint(out / f"tiny-{arch}-bf16", arch=arch, seed=seed, dense_attention=(arch == "glm5"),
                    dequantized=True, overwrite=True)
    console.print(inspect_checkpoint(ckpt, require_nvfp4=True).to_text())
    console.print(f"[dim]({time.perf_counter() - t0:.1f} s)")
    return ckpt


def check_moe_layer(ckpt: Path, seed: int) -> float:
    """Run the reference MoE on the first MoE layer's real tensors and compare with a float64 evaluation."""
    import torch

    from glm5_fp4.checkpoint.load import load_moe_layer
    from glm5_fp4.reference import moe_reference, route

    _step("2. reference MoE on the checkpoint's first MoE layer (W4A16 and W4A4)")
    layer = load_moe_layer(ckpt)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, layer.experts.hidden_size, generator=g).to(torch.bfloat16)
    logits = x.float() @ layer.router_weight.float().T
    w, ids = route(logits, layer.correction_bias, layer.top_k, routed_scaling_factor=layer.routed_scaling_factor)
    y = moe_reference(x, w, ids, layer.experts, layer.shared)
    y64 = moe_reference(x.double(), w, ids, layer.experts, layer.shared, compute_dtype=torch.float64)
    y4 = moe_reference(x, w, ids, layer.experts, layer.shared, mode="w4a4")
    rel = ((y.double() - y64).norm() / y64.norm()).item()
    rel4 = ((y4.double() - y64).norm() / y64.norm()).item()
    console.print(f"layer {layer.index}: {layer.experts.num_experts} experts, top-{layer.top_k}, 64 tokens")
    console.print(f"W4A16 (bf16 in/out) vs float64: relative error {rel:.2e}")
    console.print(f"W4A4 emulation vs W4A16 float64: relative difference {rel4:.2e} (activation quantization)")
    return rel


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_and_inspect(out, args.arch, args.seed)
    check_moe_layer(ckpt, args.seed)
    console.rule("[bold green]demo finished")
    console.print(f"files under {out.resolve()}")
    return 0
