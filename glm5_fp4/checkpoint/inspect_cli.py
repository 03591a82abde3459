"""`glm5-fp4 inspect DIR`: validate an NVFP4 checkpoint and print a summary."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--require-nvfp4", action="store_true", help="fail unless the checkpoint is NVFP4")


def run(args: argparse.Namespace) -> int:
    from glm5_fp4.checkpoint.inspect import inspect_checkpoint

    report = inspect_checkpoint(args.checkpoint, require_nvfp4=args.require_nvfp4)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    return 0
