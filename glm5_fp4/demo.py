"""`glm5-fp4 demo`: the whole pipeline on CPU with a tiny GLM-5 checkpoint.

Steps: write a tiny NVFP4 checkpoint (dense-attention view, the only GLM-5 attention vLLM's CPU backend runs)
and its BF16 twin, validate it, check one MoE layer against a float64 evaluation, serve it through real vLLM
(CPU build) with the glm5-fp4 plugin and per-layer timers on, send completion/chat/streaming requests, run a
short decode load test, capture a torch-profiler trace and break the step time down. Everything lands under
``--out`` (default ``out/demo``). All numbers are from this CPU machine and say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from rich.console import Console

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.outputs import output_dir
from glm5_fp4.server_process import free_port

console = Console()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out/demo", help="working directory for the demo's files")
    parser.add_argument("--arch", choices=("glm5", "glm4moe"), default="glm5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-serve", action="store_true", help="stop after the offline steps (no vLLM server)")
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    parser.add_argument("--backend", default="auto", help="glm5-fp4 MoE backend (auto, dequant, reference, triton)")


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


def send_requests(url: str, model: str) -> None:
    import openai

    _step("4. requests through the OpenAI API: completion, chat, streaming")
    try:
        _send_requests(url, model)
    except openai.APIError as exc:  # an error reply or a lost connection: name the step and the log, no traceback
        raise Glm5Fp4Error(f"step 4: the server answered {type(exc).__name__}: {exc}; see its log") from None


def _send_requests(url: str, model: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="demo")
    c = client.completions.create(model=model, prompt="The model streams weights", max_tokens=16, temperature=0)
    console.print(f"completion: {c.choices[0].text!r} ({c.usage.completion_tokens} tokens)")
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=16, temperature=0)
    console.print(f"chat: {chat.choices[0].message.content!r}")
    pieces = [ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="A small expert", max_tokens=16, temperature=0, stream=True) if ch.choices]
    console.print(f"streaming: {len(pieces)} chunks, {''.join(pieces)!r}")
    console.print("[dim](random weights: the text is gibberish by design)")


def serve_and_measure(ckpt: Path, out: Path, args: argparse.Namespace) -> None:
    from glm5_fp4.cli import main as cli
    from glm5_fp4.engines.vllm.serve import launch_vllm

    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    traces = (out / "traces").resolve()
    timers = (out / "layer-timers").resolve()
    for d in (traces, timers):
        d.mkdir(parents=True, exist_ok=True)
        for f in d.iterdir():
            f.unlink()
    profiler = {"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False}
    env = {**os.environ, "GLM5_FP4_LAYER_TIMERS": "1", "GLM5_FP4_LAYER_TIMERS_OUT": str(timers)}
    t0 = _step(f"3. vLLM (CPU build) serving {ckpt.name} with --quantization glm5_nvfp4 on {url}")
    server = launch_vllm(ckpt, port=port, backend=args.backend, env=env, log_path=out / "vllm.log",
                         extra_args=["--max-model-len", "512", "--profiler-config", json.dumps(profiler)])
    console.print(f"$ {server.spec.shell_command()}")
    try:
        with console.status("waiting for /health (vLLM starts three processes; ~30-60 s on 2 cores)"):
            server.wait_healthy(timeout=600)
        console.print(f"healthy after {time.perf_counter() - t0:.0f} s; log: {out / 'vllm.log'}")
        model = str(ckpt)
        send_requests(url, model)
        _step("5. decode load test (8 streams, 32 requests, 64 prompt tokens, 32 output tokens)")
        rc = cli(["loadtest", "--url", url, "--model", model, "--concurrency", "8", "--num-prompts", "32",
                  "--input-len", "64", "--output-len", "32", "--tokenizer", str(ckpt), "--timeout", "600",
                  "--result-dir", str(out / "loadtest"), "--label", "demo-cpu"])
        if rc:
            raise Glm5Fp4Error(f"load test failed (exit {rc}); see {out / 'loadtest'}")
        _step("6. profile: capture a torch-profiler trace under load and break the step down (CPU run)")
        shutil.rmtree(out / "profile", ignore_errors=True)  # the demo's own output of an earlier run
        rc = cli(["profile", "capture", "--url", url, "--steps", "6", "--trace-dir", str(traces), "--engine", "vllm",
                  "--concurrency", "4", "--output-len", "256", "--flush-timeout-s", "300", "--analyze",
                  "--out", str(out / "profile"), "--batch", "4", "--context", "64",
                  "--config", str(ckpt / "config.json")])
        if rc:
            raise Glm5Fp4Error(f"profile capture failed (exit {rc}); see {out / 'profile'}")
    finally:
        with console.status("stopping the server"):
            server.stop()
    dumps = sorted(timers.glob("*.jsonl"))
    _step("7. per-layer timers (GLM5_FP4_LAYER_TIMERS=1): median and p90 over the served steps (CPU clock)")
    if not dumps:
        raise Glm5Fp4Error(f"no layer-timer dump in {timers}; see {out / 'vllm.log'}")
    rc = cli(["profile", "timers", *map(str, dumps), "--out", str(out / "layer-timers-report")])
    if rc:
        raise Glm5Fp4Error(f"the layer-timer report failed (exit {rc}); its dumps: {timers}")


def run(args: argparse.Namespace) -> int:
    out = output_dir(args.out)
    ckpt = make_and_inspect(out, args.arch, args.seed)
    check_moe_layer(ckpt, args.seed)
    if not args.skip_serve:
        serve_and_measure(ckpt, out, args)
    console.rule("[bold green]demo finished")
    console.print(f"files under {out.resolve()}")
    return 0
