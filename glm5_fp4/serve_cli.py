"""`glm5-fp4 serve`: vLLM's OpenAI-compatible server with the glm5-fp4 NVFP4 MoE backend.

    glm5-fp4 serve --model DIR [--backend auto|triton|dequant|reference] [--mode auto|w4a16|w4a4]
                   [--quantization glm5_nvfp4|modelopt_fp4|none] [--stock] [--port 8000] [--host 127.0.0.1]
                   [--allow-remote] [--log-file PATH] [--dry-run] [-- extra vLLM args]
    glm5-fp4 serve --profile launch/tp8.yaml [--engine vllm|sglang] [--moe-backend NAME]
                   [--cuda-graphs piecewise|full|off] [--model ...] [--port ...] [--dry-run]   (glm5_fp4/data/launch/README.md)

Prints the exact command (environment included), streams the server's output to a log file, waits for
/health, then serves until Ctrl-C. Comparing with stock vLLM is the same command with
``--quantization modelopt_fp4`` (vLLM's ModelOpt NVFP4 path, extra args such as ``--moe-backend marlin``
after ``--``), or ``--stock --quantization none`` for a BF16 checkpoint with the plugin not loaded at all.
"""

from __future__ import annotations

import argparse
import os
import sys

from glm5_fp4.argtypes import int_in, positive_float
from glm5_fp4.engines.vllm.serve import BACKENDS, MODES, QUANTIZATIONS
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loopback import check_bind_host, is_loopback


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory or Hugging Face id (required without "
                        "--profile; with it, overrides the profile's model)")
    # Launch profiles (glm5_fp4.launch): these flags override the profile's fields; see launch/*.yaml.
    parser.add_argument("--profile", default=None, help="launch profile YAML, or a packaged one by name (tp8, tp4pp2, "
                        "tp8ep8, dp8ep8, cpu-demo, ...-sglang); any engine")
    parser.add_argument("--engine", choices=("vllm", "sglang"), default=None, help="with --profile: engine override")
    parser.add_argument("--moe-backend", default=None, help="with --profile: glm5_fp4 or a stock name of the engine")
    parser.add_argument("--cuda-graphs", choices=("piecewise", "full", "off"), default=None,
                        help="with --profile: CUDA-graph mode override")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="glm5-fp4 MoE backend (auto: triton on CUDA, dequant on CPU); default: GLM5_FP4_BACKEND "
                             "or auto")
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="activations: w4a16 (weight-only), w4a4 (NVFP4-quantized), auto (W4A4 only on FP4 "
                             "tensor cores with GLM5_FP4_NATIVE_FP4=1, else W4A16); default: GLM5_FP4_MODE or auto")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="glm5_nvfp4",
                        help="glm5_nvfp4: this plugin; modelopt_fp4: stock vLLM NVFP4; none: as the checkpoint says")
    parser.add_argument("--stock", action="store_true",
                        help="do not load the glm5_fp4 plugin at all (VLLM_PLUGINS='')")
    parser.add_argument("--port", type=int_in("port", 1, 65535), default=None, help="default 8000 (or the profile's)")
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1, loopback only, or the profile's)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a --host (or profile host) other than loopback: the OpenAI API is then open to "
                             "other machines; give it an API key (vLLM: -- --api-key KEY)")
    parser.add_argument("--log-file", default=None, help="server log (default ./glm5-fp4-vllm-PORT.log)")
    parser.add_argument("--timeout", type=positive_float, default=900.0, help="seconds to wait for /health")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: passed to vLLM unchanged")


def run(args: argparse.Namespace) -> int:
    from glm5_fp4.engines.vllm.serve import build_launch, launch_vllm
    from glm5_fp4.launch.spelling import read_as, spelled
    from glm5_fp4.server_process import install_stop_signals, local_model_dir, serve_until_stopped

    extra = list(args.vllm_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    from glm5_fp4 import envvars

    envvars.check()  # the server inherits the environment: a value the plugin cannot read, named before it starts
    for name in envvars.unknown():
        print(f"warning: unknown environment variable {name}", file=sys.stderr)
    if args.profile:
        return _serve_profile(args, extra)
    if args.model is None:
        raise Glm5Fp4Error("--model (or --profile) is required")
    if args.engine not in (None, "vllm") or args.moe_backend or args.cuda_graphs:
        raise Glm5Fp4Error("--engine/--moe-backend/--cuda-graphs need --profile (e.g. --profile launch/cpu-demo.yaml)")
    args.port = 8000 if args.port is None else args.port
    args.host = args.host or "127.0.0.1"
    from glm5_fp4.launch.commands import refuse_config_file

    refuse_config_file("vllm", extra, "after --")
    for arg in extra:  # vLLM reads --hos as --host too: any spelling of it would dodge the bind check
        for flag in read_as("vllm", arg, ("--host", "--port")):
            raise Glm5Fp4Error(f"{spelled('vllm', arg, flag)} after --: pass {flag} to glm5-fp4 serve itself, not "
                               f"after --, so its {'bind' if flag == '--host' else 'port'} check applies")
    check_bind_host(args.host, args.allow_remote)
    local_model_dir(args.model)
    has_key = any(read_as("vllm", a, ("--api-key",)) for a in extra)
    if not is_loopback(args.host) and not has_key and not os.environ.get("VLLM_API_KEY"):
        print(f"warning: serving on {args.host} without an API key (add -- --api-key KEY)", file=sys.stderr)
    plugin = not args.stock
    if args.stock and (args.backend is not None or args.mode is not None):
        raise Glm5Fp4Error("--backend/--mode choose the glm5_fp4 MoE backend, which --stock does not load; drop them, "
                           "or drop --stock")
    if args.stock and args.quantization == "glm5_nvfp4":
        raise Glm5Fp4Error("--stock serves without the glm5_fp4 plugin, whose --quantization glm5_nvfp4 is the default: "
                           "add --quantization modelopt_fp4 (vLLM's NVFP4) or none (as the checkpoint says)")
    spec = build_launch(args.model, args.port, args.backend, extra, host=args.host, quantization=args.quantization,
                        mode=args.mode, plugin=plugin)
    print(spec.shell_command(), flush=True)
    if args.dry_run:
        return 0
    install_stop_signals()
    log = args.log_file or f"glm5-fp4-vllm-{args.port}.log"
    handle = launch_vllm(args.model, args.port, args.backend, extra, host=args.host, quantization=args.quantization,
                         mode=args.mode, plugin=plugin, log_path=log)
    return serve_until_stopped(handle, args.timeout, handle.api_url)


def _serve_profile(args: argparse.Namespace, extra: list[str]) -> int:
    """Delegate to glm5_fp4.launch: profile (+ overrides) -> engine command -> run and wait for /health."""
    from glm5_fp4.launch.serve import serve_profile

    if args.stock or args.quantization != "glm5_nvfp4":
        raise Glm5Fp4Error("with --profile, choose stock vs ours with --moe-backend (and the profile's quantization)")
    ours = {k: v for k, v in (("backend", args.backend), ("mode", args.mode)) if v is not None}
    overrides = {"engine": args.engine, "model": args.model, "moe_backend": args.moe_backend,
                 "cuda_graphs": args.cuda_graphs, "host": args.host, "port": args.port,
                 "glm5_fp4": ours or None}
    return serve_profile(args.profile, overrides, dry_run=args.dry_run, log_file=args.log_file,
                         timeout=args.timeout, extra_args=extra, allow_remote=args.allow_remote)
