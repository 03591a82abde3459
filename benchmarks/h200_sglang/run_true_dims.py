"""Issue 19 item 3: GLM-5 layers at their true dimensions in SGLang 0.5.15 on one H200, our runner vs stock Marlin.

One device call; the engine-free part (checkpoint, phases, dense-view fallback) is benchmarks/h200/true_dims.py,
the same as vLLM's, with the same weights' shapes in the ``routed-only`` recipe (/tmp/ckpt/glm5-true-routed, made in
the background during shipping by ``benchmarks/h200/make_true_ckpt.sh routed-only``; vLLM's glm5-recipe one is
/tmp/ckpt/glm5-true): only routed experts NVFP4, so no server runs SGLang 0.5.15's JIT-built Marlin *linear* GEMM
(run_tiny.py, prewarm_jit.py say why). Stock Marlin starts only after the JIT pre-warm is done (fleet.PrewarmGate,
bounded), ours at once. Up to four servers at TP1, two at a time (``--servers``, ``--start-together``:
true_dims.py), each a launch profile spelled for SGLang 0.5.15 (decode full CUDA graphs at the load test's
batch sizes up to 512, prefill breakable graphs at a few token counts):

* ``ours`` / ``marlin``: ``--moe-runner-backend glm5_fp4`` (backend triton) / stock ``marlin``, both under
  ``modelopt_fp4``, both with ``--disable-shared-experts-fusion`` (ours always; Marlin because the shared expert is
  BF16 in a routed-only checkpoint and GLM-5's 256 experts would otherwise fuse it as a 257th NVFP4 one); they carry the load test and the traces (``/start_profile`` writes to
  ``SGLANG_TORCH_PROFILER_DIR``; ``profile capture --engine sglang`` asks for the steps and collects the files);
* ``ours-timers`` / ``marlin-timers``: the same with ``GLM5_FP4_LAYER_TIMERS=1`` (stock Marlin keeps our plugin
  loaded for the timers only: its runner is SGLang's own).

Real DSA (GLM-5's indexer + sparse MLA): SGLang's ``dsa`` backend with an FP8 KV cache (FlashMLA on SM90: see
run_tiny.py); if ours and stock both fail to start, the dense-attention view of the same weights with Triton MLA.
``--mem-fraction-static`` is high and each KV pool capped by ``--max-total-tokens`` (SGLang's start-up check
against memory the other servers take meanwhile; run_tiny.py says why).

On a CPU machine ``--fake-servers`` (default there) rehearses every phase against benchmarks/h200/fake_sglang.py
stand-ins (a scaled-down checkpoint, no layer timers); no number it prints is a measurement.

    OUT=/dir python benchmarks/h200_sglang/run_true_dims.py [--deadline-s 530] [--layers 5 --dense 3]
Output: $OUT/h200_sglang_true_dims_summary.json, $OUT/h200_sglang_true_dims.tar.gz (sweeps, compare tables, trace
analysis, layer-timer report, telemetry, server logs). Exit 1 if a phase failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "h200")]

import true_dims  # noqa: E402
from common import Run, env_versions  # noqa: E402
from fleet import DSA_KV_CACHE, Fleet, PrewarmGate, SglangSpec, add_fake_servers_option, gpu_and_fake  # noqa: E402
from true_dims import trace_dir  # noqa: E402

# Two servers of ~17 GB weights each at a time; a KV pool of 262,144 tokens (512 streams x 448 + room; ~1.5 GB
# at FP8 MLA).
MEM_FRACTION, MAX_TOTAL_TOKENS, MAX_RUNNING = 0.9, 262144, 512
# Decode graphs at powers of two only: SGLang's own list up to 512 has 52 sizes, each captured at start-up (minutes
# with DSA); a batch between two sizes runs padded to the next one.
DECODE_GRAPH_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# Prefill (breakable) graphs: SGLang captures ~28 token counts up to the context length; a few suffice here (prefill
# is not what is measured, and every capture lengthens the start that has to fit in the call).
PREFILL_GRAPH_TOKENS = [32, 128, 256]
PREWARM_WAIT_S = 240.0  # the longest a stock server waits for the JIT pre-warm


def prefill_graph_tokens(context: int) -> list[int]:
    return [t for t in PREFILL_GRAPH_TOKENS if t < context] + [context]


def context_length(input_len: int, output_len: int) -> int:
    # Room for the load test's prompts + outputs and the profile capture's 256-token streams.
    return input_len + max(output_len, 256) + 64


def specs_for(ckpt: Path, gpu: bool, work: Path, timers: bool, input_len: int = 128,
              output_len: int = 32) -> list[SglangSpec]:
    dense = ckpt.name.endswith("-dense")
    context = context_length(input_len, output_len)
    extra = ["--disable-radix-cache", "--max-total-tokens", str(MAX_TOTAL_TOKENS),
             "--cuda-graph-bs-decode", *map(str, DECODE_GRAPH_BATCHES),
             "--cuda-graph-bs-prefill", *map(str, prefill_graph_tokens(context))]
    common = dict(attention_backend="triton" if dense else "dsa", kv_cache_dtype="auto" if dense else DSA_KV_CACHE,
                  mem_fraction=MEM_FRACTION, max_running=MAX_RUNNING, context_length=context)
    out = []
    for name, backend in (("ours", "glm5_fp4"), ("marlin", "marlin")):
        # ours gets the flag from its launch profile (glm5_fp4.launch.commands); the stock runner from here
        args = extra if backend == "glm5_fp4" else [*extra, "--disable-shared-experts-fusion"]
        out.append(SglangSpec(name, ckpt, backend, "modelopt_fp4", extra_args=args,
                              env={"SGLANG_TORCH_PROFILER_DIR": str(trace_dir(name))}, **common))
        if timers:
            out.append(SglangSpec(f"{name}-timers", ckpt, backend, "modelopt_fp4", extra_args=args,
                                  env=true_dims.timer_env(work, name), load_plugin=True, **common))
    return out


def all_specs(root: Path, work: Path | None = None) -> list[SglangSpec]:
    """Every server this script can start (DSA, then the dense view as ``dense-*``), checkpoint folder ``root``."""
    import tempfile

    work = work or Path(tempfile.gettempdir()) / "h200_sglang_specs"
    dsa = specs_for(root, True, work, True)
    dense = specs_for(root.parent / f"{root.name}-dense", True, work, True)
    for s in dense:
        s.name = f"dense-{s.name}"
    return dsa + dense


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    true_dims.add_arguments(ap, recipe="routed-only")
    add_fake_servers_option(ap)
    args = true_dims.parse_arguments(ap, argv)
    gpu, fake = gpu_and_fake(ap, args)
    if fake:
        args.no_timers = True  # a fake has no layers to time

    run = Run("h200_sglang_true_dims", args.out, args.deadline_s)
    run.summary.update(env=env_versions(), gpu_mode=gpu, engine="sglang", fake_servers=fake)
    ckpt, sizes = true_dims.run_checkpoint(run, args, gpu)
    if not (ckpt / ".complete").is_file():
        return run.finish()
    if args.dense_attention:
        ckpt = true_dims.dense_view(ckpt)
    # Bounded: past it Marlin starts anyway and builds its kernels itself (its own start-up timeout then applies).
    gate = PrewarmGate(lambda: min(PREWARM_WAIT_S, run.left() - 300),
                       on_record=lambda r: run.summary.__setitem__("prewarm", r))
    fleet = Fleet(run.work / "logs", gpu, fake=fake, gate=gate)
    if fake:
        fleet.trace_dirs = {n: trace_dir(n) for n in ("ours", "marlin")}

    def specs(c: Path, g: bool, work: Path, timers: bool) -> list[SglangSpec]:
        return specs_for(c, g, work, timers, args.input_len, args.output_len)

    with fleet:
        true_dims.parallel_run(run, fleet, ckpt, sizes["vocab_size"], specs, "sglang", args, gpu)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
