"""`glm5-fp4 profile`: analyze torch-profiler traces against the hardware ceilings, or capture them.

    glm5-fp4 profile analyze DIR [--out DIR] [--gpu NAME] [--batch N --context N --tp N --pp N | --layout dp8ep8agrs]
    glm5-fp4 profile capture --url http://127.0.0.1:8000 --steps N --trace-dir DIR [--out DIR] [--analyze]
    glm5-fp4 profile timers FILE [FILE ...] --out DIR     (per-layer timer dumps -> median / p90 table)
    glm5-fp4 profile trim SRC DST                         (keep only what the analysis reads: small fixtures)
    glm5-fp4 profile stalls DIR [--requests FILE ...]     (host samples: what each process did, and in stalls)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NamedTuple

from glm5_fp4.argtypes import nonneg_float, nonneg_int, positive_float, positive_int
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.outputs import output_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="{analyze,capture,timers,trim,stalls}")

    a = sub.add_parser("analyze", help="decode-time breakdown of Kineto traces (one per rank) vs hardware ceilings")
    a.add_argument("path", help="directory of traces (.json / .json.gz, one per rank) or one trace file")
    _analysis_args(a)

    c = sub.add_parser("capture", help="drive a running server's /start_profile and /stop_profile during a decode load")
    c.add_argument("--url", required=True, help="server base URL (loopback only), e.g. http://127.0.0.1:8000")
    c.add_argument("--steps", type=positive_int, required=True, help="decode steps to profile")
    c.add_argument("--trace-dir", required=True, help="the server's profiler output directory (torch_profiler_dir / SGLANG_TORCH_PROFILER_DIR)")
    c.add_argument("--engine", choices=["auto", "vllm", "sglang"], default="auto")
    c.add_argument("--concurrency", type=positive_int, default=8, help="decode streams kept running during the capture")
    c.add_argument("--prompt-len", type=positive_int, default=64, help="prompt length in words")
    c.add_argument("--output-len", type=positive_int, default=4096, help="max_tokens per request (ignore_eos)")
    c.add_argument("--model", help="model name (default: the first of /v1/models)")
    c.add_argument("--warmup-s", type=positive_float, default=120.0, help="longest wait for every stream to be decoding")
    c.add_argument("--flush-timeout-s", type=positive_float, default=900.0,
                   help="longest wait for the server to write its traces")
    c.add_argument("--analyze", action="store_true", help="run `profile analyze` on the collected traces")
    _analysis_args(c, positional=False)

    t = sub.add_parser("timers", help="aggregate per-layer timer dumps (JSON lines from LayerTimer) into median/p90 tables")
    t.add_argument("files", nargs="+", help="JSONL files written by LayerTimer.dump / GLM5_FP4_LAYER_TIMERS")
    t.add_argument("--out", default="profile-timers", help="output directory (JSON, markdown, PNG)")

    h = sub.add_parser("stalls", help="host samples (GLM5_FP4_HOST_SAMPLES) of a server's processes: busy stacks, GC, "
                                      "and what each process did while no token reached a client")
    h.add_argument("path", help="folder of host-<pid>.jsonl files")
    h.add_argument("--requests", nargs="*", default=[], metavar="FILE",
                   help="load-test per-request records (*.requests.jsonl[.gz]) run against the server meanwhile")
    h.add_argument("--min-gap-ms", type=positive_float, default=300.0, help="shortest delivery gap reported as a stall")
    h.add_argument("--out", default=None, help="output directory (default: PATH/stalls)")

    m = sub.add_parser("trim", help="copy traces keeping only what the analysis reads (small fixtures to commit)")
    m.add_argument("src", help="trace file or directory of traces")
    m.add_argument("dst", help="output directory")
    m.add_argument("--keep-cpu-ops", action="store_true", help="keep every cpu_op event (a CPU run's, and the step ranges among a "
                        "GPU trace's, are kept anyway: the analysis reads them)")


def _analysis_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    p.add_argument("--out", default=None if positional else "profile-capture", help="output directory (default: PATH/breakdown)")
    g = p.add_argument_group("step detection and classification")
    g.add_argument("--steps-by", dest="steps_by", choices=["auto", "annotation", "graph", "gap", "whole"], default="auto",
                   help="how decode steps are found (default: step annotations, else graph replays, else idle gaps)")
    g.add_argument("--step-annotation", metavar="REGEX",
                   help="annotations (record_function ranges) whose names match REGEX are the steps, e.g. 'decode_step_\\d+' "
                        "(default: ProfilerStep#/vLLM's ranges, else a repeating top-level annotation)")
    g.add_argument("--step-gap-us", type=positive_float, help="idle gap that separates steps (implies --steps-by gap)")
    g.add_argument("--stage", help="SGLang per-stage traces: DECODE (default when both exist), EXTEND or all")
    g.add_argument("--taxonomy", help="kernel taxonomy YAML (default: the packaged glm5_fp4/data/taxonomy.yaml)")
    g.add_argument("--mode", choices=["auto", "gpu", "cpu"], default="auto", help="gpu kernels, or cpu ops for a CPU run")
    g.add_argument("--jobs", type=positive_int, help="processes parsing traces in parallel (default: CPUs, at most 4)")
    g.add_argument("--no-png", action="store_true", help="skip the PNG plots")
    h = p.add_argument_group("ceilings (FLOPs / bytes of the step vs the GPU's peaks)")
    h.add_argument("--gpu", help="hardware table entry (default: detected from the trace's device name)")
    h.add_argument("--batch", type=positive_int, help="sequences decoding per step (all data-parallel ranks together, as plan's "
                                          "--concurrency); needed for the ceilings")
    h.add_argument("--context", type=nonneg_int, default=0, help="mean context length of those sequences")
    h.add_argument("--tp", type=positive_int, help="tensor-parallel size (default: ranks per pipeline stage in the traces)")
    h.add_argument("--pp", type=positive_int, help="pipeline-parallel size (default: stages in the traces)")
    h.add_argument("--layout", help="the layout as `glm5-fp4 plan --layouts` names it (tp8, tp4pp2, tp8ep8, dp8ep8, "
                                    "dp8ep8agrs) instead of --tp/--pp: expert parallelism, data-parallel attention")
    h.add_argument("--expert-skew", type=nonneg_float, default=0.0,
                   help="expert parallelism: the hottest GPU's token-slots over the mean, minus 1 (as plan)")
    h.add_argument("--tokens-per-seq", type=positive_int, default=1, help="tokens per sequence per step (>1 with MTP)")
    h.add_argument("--config", help="the served checkpoint's config.json or directory (default: GLM-5); its "
                                    "quantization config (hf_quant_config.json, else config.json's) sets the MLP "
                                    "weight dtypes that --expert-dtype / --dense-dtype leave unset")
    h.add_argument("--expert-dtype", choices=["nvfp4", "fp8", "bf16"],
                   help="routed experts' weights (default: the --config checkpoint's, else nvfp4)")
    h.add_argument("--dense-dtype", choices=["nvfp4", "fp8", "bf16"],
                   help="shared experts' and dense MLPs' weights (default: the --config checkpoint's, e.g. bf16 in a "
                        "make-checkpoint --recipe routed-only one or GLM-5.1/5.2-NVFP4; else as --expert-dtype)")
    h.add_argument("--attention-dtype", choices=["nvfp4", "fp8", "bf16"], default="bf16")
    # checked by StepShape.validate (the spellings live with plan's, whose import would import torch here)
    h.add_argument("--kv-dtype",
                   help="the server's KV cache: its --kv-cache-dtype as vLLM or SGLang spell it (auto, fp8, "
                        "fp8_e4m3, fp8_e5m2, fp8_ds_mla, bf16, bfloat16, nvfp4_ds_mla) or the row priced: fp8 (the "
                        "scaled DSA row of vLLM fp8_ds_mla and SGLang), bf16, nvfp4_ds_mla (default: what `capture` "
                        "read from an SGLang server's /get_server_info; vLLM does not tell, so pass it; else bf16)")


def _weight_dtypes(args) -> tuple[str, str | None, str]:
    from glm5_fp4.checkpoint.inspect import resolve_mlp_dtypes

    return resolve_mlp_dtypes(args.config, args.expert_dtype, args.dense_dtype)


def _kv_dtype(args, server_kv: str | None, gpu=None) -> tuple[str, str]:
    """The KV cache dtype of the ceilings (--kv-dtype, else the server's own, else bf16) and a line saying which."""
    from glm5_fp4.launch.plan import KV_SPELLINGS, resolve_kv

    if args.kv_dtype is not None:
        kv, origin = args.kv_dtype, "--kv-dtype"
    elif server_kv in KV_SPELLINGS:
        kv, origin = server_kv, "the server's kv_cache_dtype, from its /get_server_info"
    elif server_kv:
        kv, origin = "bf16", f"default: the server's kv_cache_dtype {server_kv!r} is not modelled"
    else:
        kv, origin = "bf16", ("default; pass the server's --kv-cache-dtype as --kv-dtype: only an SGLang server "
                              "tells capture --analyze its own")
    resolved = resolve_kv(None, kv, gpu) if kv in KV_SPELLINGS else kv  # StepShape names a bad --kv-dtype
    return kv, f"KV cache dtype: {kv}" + (f" -> {resolved}" if resolved != kv else "") + f" ({origin})"


def _ceilings(breakdown, args, checked: "CheckedArgs", server_kv: str | None = None) -> dict | None:
    from glm5_fp4.hardware import detect_gpu_name, get_gpu
    from glm5_fp4.profiling.ceilings import StepShape, ceilings

    if breakdown.prefill_only:
        breakdown.notes.append("no ceilings: they price one decode step (--batch sequences each reading the weights and "
                               "its context for one new token), and these traces hold prefill steps only")
        return None
    if args.batch is None:
        breakdown.notes.append("no ceilings: pass --batch (and --context) to compare with the hardware's peaks")
        return None
    if not breakdown.across_ranks["steps_reliable"]:
        breakdown.notes.append("no ceilings: they compare one decode step with the peaks, and no reliable step "
                               "boundaries were found")
        return None
    gpu_name = args.gpu
    if gpu_name is None:
        if breakdown.mode == "cpu":
            breakdown.notes.append("no ceilings for a CPU run unless --gpu names a GPU to compare against")
            return None
        devices = sorted({r.device_name for r in breakdown.ranks if r.device_name})
        if len(devices) > 1:  # one GPU's ceilings against kernel times averaged over two kinds of GPU
            raise Glm5Fp4Error(f"the ranks ran on different GPUs ({', '.join(devices)}): pass --gpu NAME to say "
                               "whose ceilings to compare against")
        device = devices[0] if devices else None
        gpu_name = detect_gpu_name(device) if device else None
        if gpu_name is None:
            raise Glm5Fp4Error(f"cannot tell the GPU from the trace (device name {device!r}); pass --gpu NAME")
    gpu = get_gpu(gpu_name)
    spec = checked.spec
    world = max((r.world_size for r in breakdown.ranks if r.world_size), default=None)
    if checked.layout is not None:  # (combined with --tp/--pp: refused by check_analysis_args before any trace was read)
        tp, pp, dp, ep, ep_comm = checked.layout
        if world is not None and tp * pp != world:
            breakdown.notes.append(f"WARNING, ceilings: --layout {args.layout} has {tp * pp} GPUs, the traces' capture "
                                   f"world_size {world} (distributedInfo): the floors price another layout than the "
                                   "one measured")
    else:
        if args.tp is None and world is not None and world > len(breakdown.ranks):
            # the layout is not in the files: TP8, TP4+PP2 and DP8 differ 8x in the per-GPU work the floors assume
            breakdown.notes.append(f"no ceilings: the traces are {len(breakdown.ranks)} of the capture's {world} ranks "
                                   "(distributedInfo.world_size), so the layout is unknown; pass --layout (e.g. "
                                   "--layout tp8) or --tp/--pp")
            return None
        # a rank the files name (not their order) that is past their count: the capture had more ranks
        named = [r.rank for r in breakdown.ranks if r.rank_source != "file order"]
        if args.tp is None and world is None and named and max(named) >= len(breakdown.ranks):
            breakdown.notes.append(f"no ceilings: the traces include rank {max(named)}, so the capture had at least "
                                   f"{max(named) + 1} ranks, and they carry no distributedInfo.world_size: the "
                                   "layout is unknown; pass --layout (e.g. --layout tp8) or --tp/--pp")
            return None
        pp = args.pp or len({r.pp_rank for r in breakdown.ranks})
        tp, dp, ep, ep_comm = args.tp or max(1, len(breakdown.ranks) // pp), 1, 1, "a2a"
        if args.tp is None and world is None:
            breakdown.notes.append(f"WARNING, ceilings: the layout TP{tp}" + (f"+PP{pp}" if pp > 1 else "")
                                   + f" is inferred from the {len(breakdown.ranks)} trace file(s), which carry no "
                                   "distributedInfo.world_size: if the capture had more ranks, pass --layout")
    if args.expert_skew and ep == 1:
        breakdown.notes.append(f"--expert-skew {args.expert_skew:g} changes nothing: it applies to expert parallelism, "
                               "and this layout shards every expert over every GPU")
    expert, dense, weights_from = _weight_dtypes(args)
    kv, kv_from = _kv_dtype(args, server_kv, gpu)
    shape = StepShape(
        batch=args.batch, context=args.context, tp=tp, pp=pp, tokens_per_seq=args.tokens_per_seq,
        expert_dtype=expert, attention_dtype=args.attention_dtype, kv_dtype=kv,
        dp=dp, ep=ep, ep_comm=ep_comm, expert_skew=args.expert_skew, dense_dtype=dense,
    )
    across = breakdown.across_ranks
    summed = {c: v["mean"] for c, v in across["summed_us"].items()}
    exposed = {c: v["mean"] for c, v in across["exposed_us"].items()}
    # the work of an all-reduce is what the hardware can speed up; waiting is another rank's slowness
    result = ceilings(spec, shape, gpu, summed, exposed, across["step_time_us"]["mean"])
    said = result["assumptions"]
    # where each dtype came from, next to the model's line that uses it
    said.insert(next(i for i, a in enumerate(said) if a.startswith("weights:")) + 1, weights_from)
    said.insert(next(i for i, a in enumerate(said) if a.startswith("KV cache (")) + 1, kv_from)
    breakdown.notes.extend(f"ceilings assume: {a}" for a in result["assumptions"])
    breakdown.notes.extend(f"WARNING, ceilings: {w}" for w in result["warnings"])
    return result


class CheckedArgs(NamedTuple):
    """What check_analysis_args read from the options: the model (--config) and the --layout, parsed once."""

    spec: Any
    layout: tuple | None  # glm5_fp4.launch.plan_cli.LayoutTuple


def check_analysis_args(args) -> CheckedArgs:
    """The analysis options, checked before anything is read or (capture --analyze) any load is sent: a bad one
    failed only after minutes of load, profiling and flushing."""
    from glm5_fp4.profiling.steps import compile_step_annotation

    from glm5_fp4.cost_model import check_expert_skew
    from glm5_fp4.hardware import get_gpu
    from glm5_fp4.launch.plan import KV_SPELLINGS
    from glm5_fp4.launch.plan_cli import parse_layout
    from glm5_fp4.spec import Glm5Spec

    if args.step_annotation is not None and (args.step_gap_us is not None or args.steps_by not in ("auto", "annotation")):
        raise Glm5Fp4Error("--step-annotation chooses annotation ranges as steps: do not combine it with "
                           "--step-gap-us or another --steps-by")
    compile_step_annotation(args.step_annotation)
    spec = Glm5Spec.from_config_json(args.config) if args.config else Glm5Spec()
    layout = None
    if args.layout is not None:
        if args.tp is not None or args.pp is not None:
            raise Glm5Fp4Error("--layout names the whole layout: do not combine it with --tp/--pp")
        layout = parse_layout(args.layout, "--layout")
        check_expert_skew(spec, layout[3], args.expert_skew)
    if args.gpu is not None:
        get_gpu(args.gpu)
    if args.kv_dtype is not None and args.kv_dtype not in KV_SPELLINGS:
        raise Glm5Fp4Error(f"--kv-dtype must be one of {', '.join(KV_SPELLINGS)}, got {args.kv_dtype!r}")
    return CheckedArgs(spec, layout)


def analyze(path: str, args, server_kv: str | None = None) -> dict[str, Path]:
    """``server_kv``: the server's kv_cache_dtype where ``capture`` learnt it."""
    from glm5_fp4.profiling.breakdown import analyze_path
    from glm5_fp4.profiling.report import write_reports

    checked = check_analysis_args(args)
    out = Path(args.out) if args.out else (Path(path) if Path(path).is_dir() else Path(path).parent) / "breakdown"
    output_dir(out, create=False)  # before reading gigabytes of traces
    method = "gap" if args.step_gap_us is not None else args.steps_by
    breakdown = analyze_path(path, args.taxonomy, method, args.step_gap_us, args.mode, args.stage, args.jobs,
                             step_annotation=args.step_annotation)
    breakdown.ceilings = _ceilings(breakdown, args, checked, server_kv)
    paths = write_reports(breakdown, out, png=not args.no_png)
    _print_summary(breakdown)
    for kind, p in paths.items():
        print(f"{kind:>9}: {p}")
    return paths


def _print_summary(b) -> None:
    from glm5_fp4.profiling.report import title

    print(title(b))
    cats = b.categories
    reliable = [r for r in b.ranks if r.steps_reliable]
    if reliable:
        print("median step, exposed time (us; the complete step of median time, whole):")
        print(f"{'rank':>4} {'steps':>5} {'step us':>9} {'idle':>7} " + " ".join(f"{c:>14}" for c in cats))
        for r in reliable:
            ms = r.median_step
            print(f"{r.rank:>4} {r.n_complete_steps:>5} {ms['time_us']:>9.0f} {ms['idle_us']:>7.0f} "
                  + " ".join(f"{ms['exposed_us'][c]:>14.0f}" for c in cats))
    for r in b.ranks:  # the few-steps caveat and the like belong beside the figures, not only in the markdown
        for note in r.notes:
            if "complete step" in note:
                print(f"note: rank {r.rank}: {note}")
    if len(reliable) < len(b.ranks):
        from glm5_fp4.profiling.steps import HINT

        bad = [r.rank for r in b.ranks if not r.steps_reliable]
        print(f"no reliable step boundaries on rank(s) {bad}: per-step figures withheld; {HINT}")
        print("whole trace, exposed time (us):")
        print(f"{'rank':>4} {'window us':>11} {'idle':>9} " + " ".join(f"{c:>14}" for c in cats))
        for r in b.ranks:
            print(f"{r.rank:>4} {r.trace_window_us:>11.0f} {r.idle_us:>9.0f} " + " ".join(f"{r.exposed_us[c]:>14.0f}" for c in cats))
    from glm5_fp4.profiling.report import host_summary_lines

    for line in host_summary_lines(b):
        print(line)
    unknown = len({row.name for r in b.ranks for row in r.unknown_kernels})  # one kernel on every rank is one name
    if unknown:
        print(f"{unknown} unknown kernel name(s) (listed in the markdown report)")
    for note in b.notes:
        print(f"note: {note}")


def run(args) -> int:
    if args.action == "analyze":
        analyze(args.path, args)
        return 0
    if args.action == "capture":
        from glm5_fp4.profiling.capture import CaptureConfig, capture

        # before any load is sent: the traces would be lost (where they are copied, and the analysis' folder)
        for sub in ("traces", *(("breakdown",) if args.analyze else ())):
            output_dir(Path(args.out) / sub, "--out", create=False)
        if args.analyze:
            check_analysis_args(args)
        cfg = CaptureConfig(
            url=args.url, steps=args.steps, trace_dir=Path(args.trace_dir), out=Path(args.out) / "traces",
            engine=args.engine, concurrency=args.concurrency, prompt_len=args.prompt_len, output_len=args.output_len,
            warmup_s=args.warmup_s, flush_timeout_s=args.flush_timeout_s, model=args.model,
        )
        captured = capture(cfg)
        if args.analyze:
            args.out = str(Path(args.out) / "breakdown")
            analyze(str(cfg.out), args, server_kv=captured.kv_cache_dtype)
        return 0
    if args.action == "timers":
        from glm5_fp4.profiling.layer_timers import read_dumps

        report = read_dumps([Path(f) for f in args.files])
        paths = report.write(Path(args.out))
        for note in report.all_notes():  # what was skipped or set apart: said here as well as in the files
            print(f"note: {note}")
        for kind, p in paths.items():
            print(f"{kind:>9}: {p}")
        return 0
    if args.action == "stalls":
        from glm5_fp4.profiling import stalls

        stalls.check_folder(args.path)  # (the default --out lies inside PATH: a wrong PATH is named as such)
        out = args.out or str(Path(args.path) / "stalls")
        output_dir(out, "--out", create=False)  # before reading every sample file
        result = stalls.analyze(Path(args.path), [Path(f) for f in args.requests], args.min_gap_ms)
        paths = stalls.write_report(result, output_dir(out, "--out"))
        for rf in result["request_files"]:
            longest = max((w["ms"] for w in rf["windows"]), default=0.0)
            print(f"{rf['path']}: {rf['stalls']} stall(s) >= {rf['min_gap_ms']:g} ms, {rf['stalled_s']:.2f} s in all, "
                  f"longest {longest:.0f} ms")
        for kind, p in paths.items():
            print(f"{kind:>9}: {p}")
        return 0
    if args.action == "trim":
        from glm5_fp4.profiling.traces import trim_traces

        for name, kept, total, size in trim_traces(args.src, args.dst, keep_cpu_ops=args.keep_cpu_ops):
            print(f"{name}: kept {kept} of {total} events -> {size / 1e3:.0f} kB")
        return 0
    raise Glm5Fp4Error(f"unknown action {args.action!r}")
