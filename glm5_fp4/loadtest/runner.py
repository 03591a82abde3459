"""One load-test run: build prompts, warm up, run the measured phase, compute and write results.

`run_loadtest(config) -> dict` is the Python API (the CLI and sweeps call it too). The measured
phase is closed-loop: `concurrency` workers each send their next request as soon as the previous
one ends (`--request-rate inf`, the default); with a finite rate, arrivals follow a Poisson (or
gamma, `burstiness`) process and the concurrency is an upper bound, as in `vllm bench serve`.

Every prompt ends up in the per-request file as ok or failed with a reason, including the ones a
run timeout or a dead server kept from being sent, and results are written even when the run
stops early (the summary then says `"partial": true` and why).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as _dt
import gc
import math
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest import client as _client
from glm5_fp4.loadtest.client import RequestRecord, TokenCounter
from glm5_fp4.loadtest.metrics import METRICS, compute_metrics, finalize_request
from glm5_fp4.loadtest.prompts import HfTokenizer, Prompt, ServerTokenizer, Tokenizer, build_prompts
from glm5_fp4.loadtest.report import ProgressBar, print_summary, write_results


MAX_SERVER_TOKENIZE = 50_000  # distinct chunk texts counted through the server's /tokenize after a run
COUNT_TIMEOUT_S = 120.0


@dataclass
class LoadTestConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: str = "completions"  # completions | chat
    concurrency: int = 1
    num_prompts: int | None = None  # None: 4 x concurrency (at least 16)
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    num_warmups: int | None = None  # None: min(concurrency, 64)
    warmup_output_len: int = 16
    tokenizer: str | None = None  # HF tokenizer dir; None: the server's /tokenize
    trust_remote_code: bool = False
    prompt_format: str = "text"  # text | ids (token-id prompts, completions only)
    seed: int = 0
    ignore_eos: bool = True
    min_tokens: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = 3600.0  # deadline for the measured phase; None/0: none
    request_timeout_s: float | None = None
    read_timeout_s: float | None = 600.0  # max silence inside one stream
    allow_remote: bool = False
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    percentile_metrics: tuple[str, ...] = METRICS
    goodput: dict[str, float] = field(default_factory=dict)
    result_dir: str | None = None  # None: write nothing
    result_filename: str | None = None
    label: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    num_gpus: int | None = None
    progress: bool = True
    print_summary: bool = False
    telemetry: bool = True
    api_key: str | None = None
    event_loop: str = "auto"  # auto | asyncio | uvloop

    def __post_init__(self) -> None:
        if self.endpoint not in _client.ENDPOINT_PATHS:
            raise Glm5Fp4Error(f"--endpoint {self.endpoint!r}: choose one of {', '.join(_client.ENDPOINT_PATHS)}")
        if self.prompt_format not in ("text", "ids"):
            raise Glm5Fp4Error(f"--prompt-format {self.prompt_format!r}: choose text or ids")
        if self.concurrency < 1:
            raise Glm5Fp4Error(f"--concurrency {self.concurrency} must be >= 1")
        if not (self.request_rate > 0):
            raise Glm5Fp4Error(f"--request-rate {self.request_rate} must be > 0 (inf for closed loop)")
        if self.burstiness <= 0:
            raise Glm5Fp4Error(f"--burstiness {self.burstiness} must be > 0")
        bad = [m for m in self.percentile_metrics if m not in METRICS]
        if bad:
            raise Glm5Fp4Error(f"--percentile-metrics: unknown {bad}; choose from {', '.join(METRICS)}")
        if any(not 0 < p <= 100 for p in self.percentiles):
            raise Glm5Fp4Error(f"--metric-percentiles {self.percentiles}: each must be in (0, 100]")
        if self.num_prompts is None:
            self.num_prompts = max(16, 4 * self.concurrency)
        if self.num_warmups is None:
            self.num_warmups = min(self.concurrency, 64)
        if self.timeout_s is not None and self.timeout_s <= 0:
            self.timeout_s = None
        _client.check_loopback(self.url, self.allow_remote)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> LoadTestConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise Glm5Fp4Error(f"load-test config: unknown field(s) {unknown}")
        return cls(**dict(values))


def _arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from start): gamma-distributed gaps with mean 1/rate (burstiness 1 = Poisson)."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _versions() -> dict[str, str]:
    import aiohttp

    from glm5_fp4 import __version__

    return {"glm5_fp4": __version__, "python": platform.python_version(), "aiohttp": aiohttp.__version__,
            "numpy": np.__version__}


def _telemetry_sampler(cfg: LoadTestConfig, out_dir: Path | None,
                       scratch: contextlib.ExitStack) -> Any:
    """The telemetry package's sampler if it is installed and wanted, else None (never fatal).

    Its samples go next to the results; without a result dir only its summary is kept (the
    samples land in a temporary directory that `scratch` removes).
    """
    if not cfg.telemetry:
        return None
    try:
        from glm5_fp4.telemetry.sampler import TelemetrySampler
    except ImportError:
        return None
    if out_dir is not None:
        target = out_dir / "telemetry"
    else:
        target = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="glm5fp4-telemetry-")))
    try:
        return TelemetrySampler(target, interval_s=0.1)
    except Exception as exc:  # noqa: BLE001 - telemetry must never break a load test
        print(f"loadtest: telemetry disabled ({exc})", file=sys.stderr)
        return None


class _Run:
    def __init__(self, cfg: LoadTestConfig):
        self.cfg = cfg
        self.base = _client.base_url(cfg.url)
        self.api_url = self.base + _client.ENDPOINT_PATHS[cfg.endpoint]
        self.client_cpu_s: float | None = None
        self.t_start: float | None = None

    async def prepare(self, session: Any) -> tuple[str, list[Prompt], Tokenizer]:
        cfg = self.cfg
        model = cfg.model or await _client.get_first_model(session, self.base)
        tok = (HfTokenizer(cfg.tokenizer, cfg.trust_remote_code) if cfg.tokenizer
               else ServerTokenizer(session, self.base, model))
        prompts = await build_prompts(tok, int(cfg.num_prompts), cfg.input_len, cfg.output_len,
                                      endpoint=cfg.endpoint, range_ratio=cfg.range_ratio, seed=cfg.seed,
                                      token_ids=cfg.prompt_format == "ids")
        return model, prompts, tok

    def _body(self, model: str, p: Prompt, output_len: int) -> bytes:
        c = self.cfg
        return _client.build_payload(c.endpoint, model, p.prompt, output_len, ignore_eos=c.ignore_eos,
                                     min_tokens=c.min_tokens, extra_body=c.extra_body)

    async def warmup(self, session: Any, model: str, prompts: list[Prompt]) -> dict[str, Any]:
        n = int(self.cfg.num_warmups or 0)
        if n <= 0:
            return {"num_warmups": 0}
        recs = [RequestRecord(i, prompts[i % len(prompts)].prompt_len, self.cfg.warmup_output_len) for i in range(n)]
        bodies = [self._body(model, prompts[i % len(prompts)], self.cfg.warmup_output_len) for i in range(n)]
        it = iter(range(n))

        async def worker() -> None:
            for i in it:
                await _client.stream_request(session, self.api_url, bodies[i], recs[i])

        t = time.perf_counter()
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                await asyncio.gather(*(worker() for _ in range(min(n, self.cfg.concurrency))))
        except TimeoutError:
            raise Glm5Fp4Error(f"the {n} warm-up requests to {self.api_url} did not finish within --timeout "
                               f"{self.cfg.timeout_s:g} s; is the server stuck?") from None
        failed = [r for r in recs if r.status != "ok"]
        if len(failed) == n:
            raise Glm5Fp4Error(f"all {n} warm-up requests to {self.api_url} failed; first: {failed[0].error}")
        return {"num_warmups": n, "warmup_failed": len(failed), "warmup_s": time.perf_counter() - t}

    async def measure(self, session: Any, model: str, prompts: list[Prompt],
                      recs: list[RequestRecord]) -> tuple[float, str | None]:
        """The measured phase. Returns (duration_s, abort reason or None)."""
        cfg = self.cfg
        bodies = [self._body(model, p, p.output_len) for p in prompts]
        counter = TokenCounter()
        bar = ProgressBar(len(recs), f"c={cfg.concurrency}", cfg.progress)
        offsets = _arrival_offsets(len(recs), cfg.request_rate, cfg.burstiness, np.random.default_rng(cfg.seed + 1))
        abort: str | None = None

        async def one(i: int) -> None:
            counter.in_flight += 1
            try:
                await _client.stream_request(session, self.api_url, bodies[i], recs[i], counter)
            finally:
                counter.in_flight -= 1

        async def closed_loop() -> None:
            it = iter(range(len(recs)))

            async def worker() -> None:
                for i in it:
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, len(recs)))))

        async def open_loop() -> None:
            sem = asyncio.Semaphore(cfg.concurrency)

            async def gated(i: int) -> None:
                async with sem:
                    await one(i)

            tasks = []
            for i, off in enumerate(offsets):
                delay = t_start + off - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(gated(i)))
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0.5)
                bar.update(counter.ok + counter.failed, counter.tokens, counter.in_flight, counter.failed,
                           time.perf_counter())

        tick = asyncio.create_task(ticker())
        # A full garbage collection over tens of thousands of live objects stalls the loop for
        # tens of ms, which would show up as ITL; collect before and after, not during.
        gc.collect()
        gc.freeze()
        gc.disable()
        t_start = time.perf_counter()
        cpu_start = time.process_time()
        try:
            main = closed_loop() if math.isinf(cfg.request_rate) else open_loop()
            if cfg.timeout_s:
                async with asyncio.timeout(cfg.timeout_s):
                    await main
            else:
                await main
        except TimeoutError:
            abort = f"run timeout: the measured phase hit --timeout {cfg.timeout_s:g} s"
        finally:
            gc.enable()
            gc.unfreeze()
            tick.cancel()
            bar.update(counter.ok + counter.failed, counter.tokens, counter.in_flight, counter.failed,
                       time.perf_counter())
            bar.close()
        duration = time.perf_counter() - t_start
        self.client_cpu_s = time.process_time() - cpu_start
        self.t_start = t_start
        for r in recs:  # whatever the deadline cut short
            if r.status == "running" or (abort and r.error_kind == "cancelled"):
                r.status = "running"  # let fail() replace the generic cancellation with the cause
                r.fail("timeout", f"in flight when the run stopped: {abort or 'still running at the end'}")
            elif r.status == "not_sent":
                r.error_kind, r.error = "not_sent", f"never sent: {abort or 'the run stopped first'}"
        return duration, abort


async def _chunk_text_tokens(tok: Tokenizer, recs: list[RequestRecord]) -> tuple[dict[str, int] | None, str | None]:
    """Token count of every distinct chunk text of the streams that did not carry running usage, with the
    run's own tokenizer (after the run: nothing on the hot path); (None, why) if they cannot be counted."""
    texts = sorted({t for r in recs if r.chunk_times and not r.running_usage for t in r.chunk_texts})
    if not texts:
        return None, None
    if isinstance(tok, ServerTokenizer) and len(texts) > MAX_SERVER_TOKENIZE:
        return None, (f"{len(texts)} distinct chunk texts are too many to count through {tok.name}; pass --tokenizer "
                      "DIR to count them locally")
    try:
        async with asyncio.timeout(COUNT_TIMEOUT_S):
            await tok.encode(texts[:1])  # one probe, so a dead server fails once, not once per text
            ids = await tok.encode(texts)
    except (Glm5Fp4Error, TimeoutError) as exc:
        return None, f"chunk texts could not be counted with {tok.name} ({exc or 'timed out'})"
    return {t: len(i) for t, i in zip(texts, ids)}, None


def _result_path(cfg: LoadTestConfig, model: str, date: str) -> Path | None:
    if not cfg.result_dir:
        return None
    name = cfg.result_filename
    if not name:
        safe_model = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model.split("/")[-1])
        name = f"{cfg.label + '-' if cfg.label else ''}c{cfg.concurrency}-{safe_model}-{date}.json"
    return Path(cfg.result_dir) / name


async def _run_async(cfg: LoadTestConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    run = _Run(cfg)
    api_key = cfg.api_key or os.environ.get("OPENAI_API_KEY")
    session = _client.make_session(cfg.concurrency, request_timeout_s=cfg.request_timeout_s,
                                   read_timeout_s=cfg.read_timeout_s, api_key=api_key)
    async with session:
        model, prompts, tokenizer = await run.prepare(session)
        warm = await run.warmup(session, model, prompts)
        recs = [RequestRecord(i, p.prompt_len, p.output_len) for i, p in enumerate(prompts)]
        now = _dt.datetime.now()
        date = now.strftime("%Y%m%d-%H%M%S")
        result_path = _result_path(cfg, model, date)
        scratch = contextlib.ExitStack()
        sampler = _telemetry_sampler(cfg, result_path.parent if result_path else None, scratch)
        telemetry: dict[str, Any] | None = None
        t0, t0_unix = time.perf_counter(), time.time()
        abort: str | None = None
        duration = 0.0
        try:
            with sampler if sampler is not None else contextlib.nullcontext():
                t0, t0_unix = time.perf_counter(), time.time()
                duration, abort = await run.measure(session, model, prompts, recs)
        except (asyncio.CancelledError, KeyboardInterrupt):
            abort = "interrupted"
            duration = time.perf_counter() - t0
            for r in recs:
                if r.status in ("running", "not_sent"):
                    r.fail("cancelled" if r.status == "running" else "not_sent", "interrupted by the user")
        finally:
            if sampler is not None:
                try:
                    telemetry = sampler.summary()
                except Exception as exc:  # noqa: BLE001
                    telemetry = {"error": f"telemetry summary failed: {exc}"}
            scratch.close()
        if run.t_start is not None:  # rows' start_s count from the start of the measured phase
            t0_unix += run.t_start - t0
            t0 = run.t_start
        text_tokens, count_note = await _chunk_text_tokens(tokenizer, recs)
        rows = [finalize_request(r, t0, t0_unix, text_tokens) for r in recs]
        metrics = compute_metrics(rows, duration, percentiles=cfg.percentiles, selected=cfg.percentile_metrics,
                                  goodput=cfg.goodput or None)
        first_errors: dict[str, str] = {}
        for row in rows:
            if row["status"] != "ok" and row["error_kind"] not in first_errors:
                first_errors[row["error_kind"]] = row["error"] or ""
        result: dict[str, Any] = {
            "date": now.strftime("%Y%m%d-%H%M%S"),
            "endpoint_type": "openai-chat" if cfg.endpoint == "chat" else "openai",
            "backend": "openai-chat" if cfg.endpoint == "chat" else "openai",
            "label": cfg.label,
            "model_id": model,
            "tokenizer_id": tokenizer.name,
            "num_prompts": len(prompts),
            **{k: v for k, v in cfg.metadata.items()},
            "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
            "burstiness": cfg.burstiness,
            "max_concurrency": cfg.concurrency,
            **metrics,
            "partial": abort is not None,
            "abort_reason": abort,
            "first_errors": first_errors,
        }
        if count_note:
            result["token_count_note"] = count_note
        if run.client_cpu_s is not None and duration > 0:
            # One asyncio process is one core: near 1.0 the client, not the server, sets the pace.
            result["client_cpu_util"] = run.client_cpu_s / duration
            if result["client_cpu_util"] > 0.8:
                print(f"loadtest: warning: the client used {result['client_cpu_util']:.0%} of a core during the "
                      "run; latencies may include client queueing", file=sys.stderr)
        if cfg.num_gpus:
            result["output_throughput_per_gpu"] = result["output_throughput"] / cfg.num_gpus
        if telemetry is not None:
            result["telemetry"] = telemetry
        result["metadata"] = {
            "tool": "glm5-fp4 loadtest",
            "url": cfg.url,
            "endpoint": cfg.endpoint,
            "input_len": cfg.input_len,
            "output_len": cfg.output_len,
            "range_ratio": cfg.range_ratio,
            "seed": cfg.seed,
            "ignore_eos": cfg.ignore_eos,
            "min_tokens": cfg.min_tokens,
            "prompt_format": cfg.prompt_format,
            "prompt_len_misses": sum(1 for p in prompts if p.mismatch),
            "percentiles": list(cfg.percentiles),
            "goodput_slo_ms": cfg.goodput or None,
            "timeout_s": cfg.timeout_s,
            "num_gpus": cfg.num_gpus,
            "start_unix": t0_unix,
            "start_perf_counter": t0,  # time.perf_counter() at start_s = 0 (CLOCK_MONOTONIC on Linux)
            "client_cpu_s": run.client_cpu_s,
            "host": socket.gethostname(),
            "versions": _versions(),
            "argv": sys.argv,
            **warm,
        }
        if result_path is not None:
            paths = write_results(result, rows, result_path)
            result["result_file"] = str(paths["json"])
        if cfg.print_summary:
            print_summary(result)
        return result, rows


def _run_coroutine(cfg: LoadTestConfig, coro: Any) -> Any:
    """uvloop when available: its faster I/O path is what lets one core follow 512 streams."""
    factory = None
    if cfg.event_loop != "asyncio":
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            if cfg.event_loop == "uvloop":
                coro.close()
                raise Glm5Fp4Error("--event-loop uvloop: uvloop is not installed") from None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def run_loadtest_detailed(config: LoadTestConfig | Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Like run_loadtest, also returning the per-request rows."""
    cfg = config if isinstance(config, LoadTestConfig) else LoadTestConfig.from_mapping(config)
    return _run_coroutine(cfg, _run_async(cfg))


def run_loadtest(config: LoadTestConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Run one load test and return the summary dict (vLLM key names); writes files if result_dir is set."""
    return run_loadtest_detailed(config)[0]
