"""`glm5-fp4 make-checkpoint`: write a random checkpoint in the ModelOpt NVFP4 layout."""

from __future__ import annotations

import argparse
import re

from glm5_fp4.checkpoint.configs import ARCHS, TINY_SIZES
from glm5_fp4.checkpoint.layout import RECIPES
from glm5_fp4.errors import Glm5Fp4Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arch", choices=ARCHS, default="glm5",
                        help="glm5: GlmMoeDsaForCausalLM (MLA + DSA); glm4moe: same MoE block, GQA attention")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dequantized", action="store_true",
                        help="write the BF16 twin (every NVFP4 weight replaced by its dequantized value)")
    parser.add_argument("--dense-attention", action="store_true",
                        help="glm5 only: write the dense-attention view (no DSA indexer in config) vLLM's CPU backend serves")
    parser.add_argument("--size", action="append", default=[], metavar="FIELD=N",
                        help=f"override a size (repeatable); fields: {', '.join(TINY_SIZES)}")
    parser.add_argument("--recipe", choices=RECIPES, default="glm5",
                        help="which MLPs are NVFP4: glm5 (nvidia/GLM-5-NVFP4: dense MLPs, shared and routed experts) or "
                             "routed-only (GLM-5.1/5.2-NVFP4: routed experts only; dense MLPs and shared experts BF16)")
    parser.add_argument("--overwrite", action="store_true", help="replace files in a non-empty --out")
    parser.add_argument("--device", default="cpu",
                        help="where tensors are drawn and quantized: cpu (default) or cuda (seconds instead of CPU "
                             "minutes at GLM-5's true sizes; CUDA's generator gives other random values)")


def parse_sizes(items: list[str]) -> dict[str, int]:
    sizes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"-?[0-9]+", value.strip()):  # isdigit() takes "²", lstrip took "--"
            raise Glm5Fp4Error(f"--size {item!r}: expected FIELD=INTEGER, e.g. --size n_routed_experts=8")
        sizes[key.strip()] = int(value)
    return sizes


def run(args: argparse.Namespace) -> int:
    from glm5_fp4.checkpoint.inspect import inspect_checkpoint
    from glm5_fp4.checkpoint.make import make_checkpoint
    from glm5_fp4.server_process import install_stop_signals

    # SIGTERM / SIGHUP (timeout, a CI cancel) clean up like Ctrl-C: no half-made directory; under nohup, SIGHUP stays
    # ignored
    install_stop_signals(keep_ignored=True)
    out = make_checkpoint(args.out, arch=args.arch, seed=args.seed, dequantized=args.dequantized,
                          dense_attention=args.dense_attention, sizes=parse_sizes(args.size),
                          overwrite=args.overwrite, device=args.device, recipe=args.recipe)
    print(inspect_checkpoint(out).to_text())
    return 0
