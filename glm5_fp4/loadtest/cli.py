"""`glm5-fp4 loadtest`: decode load test against an OpenAI-compatible server.

  glm5-fp4 loadtest --url http://127.0.0.1:8000 --concurrency 512 --num-prompts 2048 \\
      --input-len 1024 --output-len 1024 --result-dir results/
  glm5-fp4 loadtest ... --concurrency 1,8,32,128,512     # a sweep: one result per level + PNG curves
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from typing import Any

from glm5_fp4.argtypes import comma_list
from glm5_fp4.errors import Glm5Fp4Error


def _int_list(text: str) -> list[int]:
    try:  # (a level given twice wrote one c2.json for two rows of the sweep)
        values = [int(x) for x in comma_list(text, "--concurrency")]
    except Glm5Fp4Error as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need integers >= 1")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers") from None


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.replace(" ", "").split(",") if x)


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only by default)")
    t.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url")
    t.add_argument("--model", default=None, help="served model name (default: first of GET /v1/models)")
    t.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions")
    t.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")

    w = p.add_argument_group("workload")
    w.add_argument("--concurrency", type=_int_list, default=[1],
                   help="max in-flight requests; a comma list runs a sweep (e.g. 1,8,32,128,512)")
    w.add_argument("--num-prompts", type=int, default=None, help="requests per level (default 4 x concurrency, >= 16)")
    w.add_argument("--input-len", type=int, default=1024, help="prompt tokens as the server counts them")
    w.add_argument("--output-len", type=int, default=128, help="output tokens per request (fixed via ignore_eos)")
    w.add_argument("--range-ratio", type=float, default=0.0, help="vLLM-style length spread: U[L(1-r), L(1+r)]")
    w.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf = closed loop)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    w.add_argument("--num-warmups", type=int, default=None, help="warm-up requests, sent at the level's concurrency before the clock starts (default: one full wave, = concurrency)")
    w.add_argument("--warmup-output-len", type=int, default=16)
    w.add_argument("--tokenizer", default=None,
                   help="local Hugging Face tokenizer dir for exact-length prompts (default: server /tokenize)")
    w.add_argument("--trust-remote-code", action="store_true")
    w.add_argument("--prompt-format", choices=("text", "ids"), default="text",
                   help="ids sends token-id prompts (completions only): exact length, no re-tokenisation")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="do not send ignore_eos")
    w.add_argument("--no-min-tokens", dest="min_tokens", action="store_false", help="do not send min_tokens")
    w.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    r = p.add_argument_group("limits")
    r.add_argument("--timeout", type=float, default=3600.0, help="deadline (s) for each measured phase; 0 = none")
    r.add_argument("--request-timeout", type=float, default=None, help="per-request total timeout (s)")
    r.add_argument("--read-timeout", type=float, default=600.0, help="max silence (s) inside one stream")
    r.add_argument("--stall-timeout", type=float, default=None,
                   help="max gap (s) between two tokens of a stream before it fails as stalled (default: "
                        "max(10 s, 50 x the p99 chunk gap seen so far); 0 = off)")
    r.add_argument("--max-failed-fraction", type=float, default=0.0,
                   help="share of failed requests a run may have and still exit 0 (default 0: any failure fails it)")

    o = p.add_argument_group("metrics and output")
    o.add_argument("--metric-percentiles", type=_float_list, default=(50.0, 90.0, 99.0))
    o.add_argument("--percentile-metrics", type=_str_list, default=("ttft", "tpot", "itl", "e2el"))
    o.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs, e.g. ttft:2000 tpot:50 e2el:60000 (requests meeting all, per second)")
    o.add_argument("--result-dir", default="loadtest-results", help="where results go ('' = write nothing)")
    o.add_argument("--result-filename", default=None, help="summary file name (single level only)")
    o.add_argument("--label", default=None)
    o.add_argument("--metadata", nargs="+", default=[], metavar="KEY=VALUE", help="extra k=v saved in the result")
    o.add_argument("--num-gpus", type=int, default=None, help="for tok/s/GPU in results and Pareto plots")
    o.add_argument("--no-progress", dest="progress", action="store_false")
    o.add_argument("--no-telemetry", dest="telemetry", action="store_false",
                   help="do not wrap the measured phase in glm5_fp4.telemetry's sampler")
    o.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    o.add_argument("--json", action="store_true", help="also print the summary JSON to stdout")


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from glm5_fp4.loadtest.metrics import parse_goodput

    try:
        goodput = parse_goodput(args.goodput)
    except ValueError as exc:
        raise Glm5Fp4Error(str(exc)) from None
    extra: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as exc:
            raise Glm5Fp4Error(f"--extra-body is not valid JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise Glm5Fp4Error("--extra-body must be a JSON object")
    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise Glm5Fp4Error(f"--metadata {item!r}: expected KEY=VALUE")
        metadata[key.strip()] = value.strip()
    return dict(
        url=args.url, model=args.model, endpoint=args.endpoint, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        request_rate=args.request_rate, burstiness=args.burstiness, num_warmups=args.num_warmups,
        warmup_output_len=args.warmup_output_len, tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code,
        prompt_format=args.prompt_format, seed=args.seed, ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
        extra_body=extra, timeout_s=args.timeout, request_timeout_s=args.request_timeout,
        read_timeout_s=args.read_timeout, stall_timeout_s=args.stall_timeout,
        max_failed_fraction=args.max_failed_fraction, allow_remote=args.allow_remote, percentiles=args.metric_percentiles,
        percentile_metrics=args.percentile_metrics, goodput=goodput, result_dir=args.result_dir or None,
        label=args.label, metadata=metadata, num_gpus=args.num_gpus, progress=args.progress,
        telemetry=args.telemetry, api_key=args.api_key, event_loop=args.event_loop,
    )


def run(args: argparse.Namespace) -> int:
    from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest
    from glm5_fp4.loadtest.sweep import run_sweep

    kwargs = config_kwargs(args)
    levels: list[int] = args.concurrency
    if len(levels) > 1:
        if args.result_filename:
            raise Glm5Fp4Error("--result-filename names one result; a sweep writes c<N>.json per level")
        sweep = run_sweep(kwargs, levels)
        results = sweep["results"]
        if args.json:
            print(json.dumps(sweep["summary"], indent=2))
    else:
        cfg = LoadTestConfig(concurrency=levels[0], result_filename=args.result_filename, print_summary=True,
                             **kwargs)
        results = [run_loadtest(cfg)]
        if args.json:
            print(json.dumps(results[0], indent=2, default=str))
        if results[0].get("result_file"):
            print(f"results: {results[0]['result_file']}", file=sys.stderr)
    failed = [r for r in results if r.get("run_failed")]
    for r in failed:
        print(f"loadtest: run failed at concurrency {r['max_concurrency']}: {r['failure_reason']}", file=sys.stderr)
    if len(levels) > 1 and sweep["not_run"]:
        print(f"loadtest: the sweep stopped; levels not run: {', '.join(map(str, sweep['not_run']))}", file=sys.stderr)
    stopped = next((r["stopped_by"] for r in results if r.get("stopped_by")), None)
    if stopped:
        return 128 + signal.Signals[stopped].value  # as if the signal had ended us, after writing the results
    return 1 if failed else 0
