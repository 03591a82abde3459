"""One load-test run: build prompts, warm up, run the measured phase, compute and write results.

`run_loadtest(config) -> dict` is the Python API (the CLI and sweeps call it too). The measured
phase is closed-loop: `concurrency` workers each send their next request as soon as the previous
one ends (`--request-rate inf`, the default); with a finite rate, arrivals follow a Poisson (or
gamma, `burstiness`) process and the concurrency is an upper bound, as in `vllm bench serve`.

Every prompt ends up in the per-request file as ok or failed with a reason, including the ones a
run timeout or a dead server kept from being sent, and results are written even when the run
stops early: on the run timeout, Ctrl-C or SIGTERM (CI, `timeout`). The summary says
`"partial": true` whenever a request is missing from the figures (the run stopped early or requests
failed), and `"run_failed": true`, with `failure_reason`, when it stopped early, nothing completed, or
more than `max_failed_fraction` (default 0: any) of the requests failed; the CLI then exits 1. A run
stopped by a signal records it (`stopped_by`: SIGINT for Ctrl-C, or SIGTERM): a sweep runs no more
levels and the CLI exits 128 + the signal (130, 143).

What a run records has no secrets (results get committed): the --api-key value in `argv` and the
password of a user:password `--url` are replaced by `***`; the password reaches the server as basic auth.

A stream that stops sending tokens is cut at the stall limit: `stall_timeout_s`, or by default
max(STALL_MIN_S, STALL_FACTOR x the p99 gap between chunks seen so far in the run), so one hung
stream cannot hold a run for the whole read timeout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime as _dt
import gc
import math
import os
import platform
import shutil
import signal
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
from glm5_fp4.loadtest.metrics import METRICS, compute_metrics, finalize_request, slo_ok
from glm5_fp4.loadtest.prompts import HfTokenizer, Prompt, ServerTokenizer, Tokenizer, build_prompts
from glm5_fp4.loadtest.report import ProgressBar, print_summary, write_results
from glm5_fp4.outputs import output_dir


# Longer than any served context (GLM-5: 202,752 tokens); larger values are typos that would exhaust host memory.
MAX_SEQUENCE_TOKENS = 1 << 20
MAX_SERVER_TOKENIZE = 50_000  # distinct chunk texts counted through the server's /tokenize after a run
COUNT_TIMEOUT_S = 120.0
# A stream is stalled after no token for max(STALL_MIN_S, STALL_FACTOR x p99 chunk gap): 50 x the p99
# rides out an engine's own pauses (prefill bursts, preemption) at any decode speed; the floor keeps a
# fast stream's stall limit from falling to where a scheduling hiccup would trip it.
STALL_MIN_S = 10.0
STALL_FACTOR = 50.0
STALL_GAPS_KEPT = 20_000


class StallWatch:
    """The per-token stall limit, from the chunk gaps observed so far (or fixed: ``fixed_s``; 0 = off)."""

    def __init__(self, fixed_s: float | None):
        self.fixed = fixed_s
        self.gaps: collections.deque[float] = collections.deque(maxlen=STALL_GAPS_KEPT)
        self._seen: dict[int, int] = {}

    def limit(self) -> float | None:
        if self.fixed is not None:
            return self.fixed or None
        if not self.gaps:
            return STALL_MIN_S
        return max(STALL_MIN_S, STALL_FACTOR * float(np.percentile(np.fromiter(self.gaps, float), 99)))

    def describe(self) -> str:
        if self.fixed is not None:
            return f"--stall-timeout {self.fixed:g} s"
        p99 = float(np.percentile(np.fromiter(self.gaps, float), 99)) * 1e3 if self.gaps else 0.0
        return f"max({STALL_MIN_S:g} s, {STALL_FACTOR:g} x p99 chunk gap {p99:.1f} ms); set with --stall-timeout"

    def check(self, running: dict[int, tuple[RequestRecord, asyncio.Task]], now: float) -> list[int]:
        """Fold in the new chunk gaps of the running streams; return the streams past the limit."""
        for i, (rec, _) in running.items():
            times, k = rec.chunk_times, self._seen.get(i, 0)
            for j in range(max(k, 1), len(times)):
                self.gaps.append(times[j] - times[j - 1])
            self._seen[i] = len(times)
        limit = self.limit()
        if limit is None:
            return []
        return [i for i, (rec, _) in running.items() if rec.chunk_times and now - rec.chunk_times[-1] > limit]


@dataclass
class _Stop:
    """Why the run was stopped from outside (a signal), shared with the handler."""

    signal: str | None = None
    task: asyncio.Task | None = None


# Request fields the load test sets (client.build_payload) and what sets them: --extra-body may not replace them
# ({"stream": false} failed every request as 'connection closed early', {"model": ...} was recorded as another model).
OWN_BODY_FIELDS = {"model": "--model", "stream": "it streams every request", "max_tokens": "--output-len",
                   "max_completion_tokens": "--output-len", "prompt": "--input-len and --prompt-format",
                   "messages": "--input-len and --endpoint", "stream_options": "its usage counting",
                   "ignore_eos": "on unless --no-ignore-eos", "min_tokens": "on unless --no-min-tokens"}

# The result's own top-level fields besides its metrics (see _run_async): --metadata may not overwrite them.
RESULT_FIELDS = ("date", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts",
                 "request_rate", "burstiness", "max_concurrency", "partial", "run_failed", "failure_reason",
                 "abort_reason", "stopped_by", "stall_timeout_s", "first_errors", "server_gone", "token_count_note",
                 "client_cpu_util", "output_throughput_per_gpu", "telemetry", "metadata", "requests_file",
                 "result_file")  # (not "backend": vLLM's bench serve lets metadata name it, and nothing reads ours)


def result_keys(cfg: "LoadTestConfig") -> set[str]:
    """Every top-level key a run's result has: its own fields and the metrics the config asks for."""
    metrics = compute_metrics([], 1.0, percentiles=cfg.percentiles, selected=cfg.percentile_metrics,
                              goodput=cfg.goodput or None)
    return set(RESULT_FIELDS) | set(metrics)


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
    num_warmups: int | None = None  # None: one full wave (= concurrency)
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
    read_timeout_s: float | None = 600.0  # max silence inside one stream (before its first token too)
    stall_timeout_s: float | None = None  # max gap between tokens; None: from the observed ITL; 0: off
    max_failed_fraction: float = 0.0  # the run fails (exit 1) when more than this share of requests failed
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
        if not (0 < self.burstiness < math.inf):  # inf and NaN drew NaN gaps: every request at t=0, the rate ignored
            raise Glm5Fp4Error(f"--burstiness {self.burstiness} must be a finite number > 0 (1: Poisson arrivals; "
                               "larger: more even)")
        bad = [m for m in self.percentile_metrics if m not in METRICS]
        if bad:
            raise Glm5Fp4Error(f"--percentile-metrics: unknown {bad}; choose from {', '.join(METRICS)}")
        if any(not 0 < p <= 100 for p in self.percentiles):
            raise Glm5Fp4Error(f"--metric-percentiles {self.percentiles}: each must be in (0, 100]")
        if self.num_prompts is None:
            self.num_prompts = max(16, 4 * self.concurrency)
        if self.num_warmups is None:
            # One full wave: the batch sizes the measured phase brings (decode up to the concurrency, its prefill
            # chunks) then compile before the clock starts. 64 left vLLM 0.26's DeepGEMM JIT compiling the DSA
            # indexer's metadata kernel for each new 512-stream batch size inside the measurement (~1.7 s each,
            # 12 stalls in one 26 s run on the H200, 2026-12-01).
            self.num_warmups = self.concurrency
        if self.timeout_s is not None and self.timeout_s < 0:  # (read as no deadline)
            raise Glm5Fp4Error(f"--timeout {self.timeout_s} must be a number of seconds >= 0 (0: no deadline)")
        if self.timeout_s == 0:
            self.timeout_s = None
        if self.stall_timeout_s is not None and not self.stall_timeout_s >= 0:  # (NaN turned stall detection off)
            raise Glm5Fp4Error(f"--stall-timeout {self.stall_timeout_s} must be >= 0 (0 = off)")
        for name, ms in self.goodput.items():
            if not slo_ok(ms):
                raise Glm5Fp4Error(f"--goodput {name}:{ms}: an SLO is a finite number of milliseconds >= 0")
        for key in sorted(set(self.extra_body) & set(OWN_BODY_FIELDS)):
            raise Glm5Fp4Error(f"--extra-body {key}: the load test sends it itself ({OWN_BODY_FIELDS[key]})")
        reserved = sorted(set(self.metadata) & result_keys(self))
        if reserved:  # (num_prompts=16 crashed the verdict after the run; model_id=foo relabelled it)
            raise Glm5Fp4Error(f"--metadata {reserved[0]}: a field the result sets itself; name yours otherwise")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise Glm5Fp4Error(f"--max-failed-fraction {self.max_failed_fraction} must be in [0, 1]")
        self._check_counts_and_times()
        if self.result_filename is not None and (not self.result_filename or Path(self.result_filename).name
                                                 != self.result_filename or self.result_filename in (".", "..")):
            raise Glm5Fp4Error(f"--result-filename {self.result_filename!r}: a file name inside --result-dir, "
                               "not a path")
        if self.result_dir:
            # before the measurement, not after it: a result that cannot be written is a run lost
            output_dir(self.result_dir, "--result-dir", create=False)
            if self.result_filename:
                from glm5_fp4.loadtest.report import result_paths

                for path in result_paths(Path(self.result_dir) / self.result_filename).values():
                    if path.is_dir():
                        raise Glm5Fp4Error(f"{path}: a folder where the result file goes; move it or pass another "
                                           "--result-filename")
        _client.check_loopback(self.url, self.allow_remote)
        if self.api_key and _client.url_auth(self.url) is not None:
            # both would be an Authorization header; aiohttp refuses the pair on every request
            raise Glm5Fp4Error("--api-key and a user:password in --url are two credentials; give one")

    def _check_counts_and_times(self) -> None:
        for flag, value, least in (("--num-prompts", self.num_prompts, 1), ("--num-warmups", self.num_warmups, 0),
                                   ("--input-len", self.input_len, 1), ("--output-len", self.output_len, 1),
                                   ("--warmup-output-len", self.warmup_output_len, 1),
                                   ("--num-gpus", self.num_gpus, 1)):
            if value is not None and value < least:
                raise Glm5Fp4Error(f"{flag} {value} must be >= {least}")
        for flag, value in (("--input-len", self.input_len), ("--output-len", self.output_len)):
            if value > MAX_SEQUENCE_TOKENS:  # (the prompt builder holds input_len ids per prompt: 1e11 took 792 GiB)
                raise Glm5Fp4Error(f"{flag} {value}: more than {MAX_SEQUENCE_TOKENS:,} tokens per request")
        for flag, value in (("--request-timeout", self.request_timeout_s), ("--read-timeout", self.read_timeout_s)):
            if value is not None and not value > 0:  # (NaN too)
                raise Glm5Fp4Error(f"{flag} {value} must be a number of seconds > 0")
        if self.timeout_s is not None and math.isnan(self.timeout_s):
            raise Glm5Fp4Error("--timeout nan must be a number of seconds (0: no deadline)")

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
    """The telemetry package's sampler, started, if it is installed and wanted, else None (never fatal: building
    or starting it may fail, on an unwritable folder or a failing NVML, and the load test runs on without it).

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
        return TelemetrySampler(target, interval_s=0.1).start()
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
        self.stall = StallWatch(cfg.stall_timeout_s)

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
            gone = await _client.server_gone(session, self.base)
            raise Glm5Fp4Error(f"all {n} warm-up requests to {self.api_url} failed; first: {failed[0].error}"
                               + (f"; {died(gone)}" if gone else ""))
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
        running: dict[int, tuple[RequestRecord, asyncio.Task]] = {}

        async def one(i: int) -> None:
            counter.in_flight += 1
            task = asyncio.ensure_future(_client.stream_request(session, self.api_url, bodies[i], recs[i], counter))
            running[i] = (recs[i], task)
            try:
                await task
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if recs[i].error_kind != "stalled" or (me is not None and me.cancelling()):
                    raise
                counter.failed += 1  # the watchdog cut this stream; the run goes on
            finally:
                running.pop(i, None)
                counter.in_flight -= 1

        async def watchdog() -> None:
            while True:
                limit = self.stall.limit()
                await asyncio.sleep(min(0.5, max(0.05, (limit or 0.5) / 5)))
                now = time.perf_counter()
                for i in self.stall.check(running, now):
                    rec, task = running[i]
                    rec.fail("stalled", f"no token for {now - rec.chunk_times[-1]:.1f} s after {sum(rec.chunk_tokens)} "
                                        f"token(s) (stall limit {self.stall.limit():.1f} s: {self.stall.describe()})")
                    task.cancel()

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
        watch = asyncio.create_task(watchdog())
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
            watch.cancel()
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


def redact_argv(argv: list[str]) -> list[str]:
    """The command line as results record it: the --api-key value (either form) and URL passwords replaced."""
    out, secret_next = [], False
    for arg in argv:
        opt, eq, _ = arg.partition("=")
        is_key = len(opt) >= 4 and "--api-key".startswith(opt)  # argparse takes an unambiguous prefix ("--ap") too
        if secret_next:
            out.append(_client.REDACTED)
        elif is_key and eq:
            out.append(f"{opt}={_client.REDACTED}")
        else:
            out.append(_client.redact_url(arg))
        secret_next = is_key and not eq and not secret_next
    return out


def _result_path(cfg: LoadTestConfig, model: str, date: str) -> Path | None:
    if not cfg.result_dir:
        return None
    name = cfg.result_filename
    if not name:
        safe_model = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model.split("/")[-1])
        name = f"{cfg.label + '-' if cfg.label else ''}c{cfg.concurrency}-{safe_model}-{date}.json"
    return Path(cfg.result_dir) / name


def _missing_dirs(d: Path) -> list[Path]:
    """``d`` and its parents that do not exist yet, deepest first: what this run will have created."""
    out = []
    for p in (d, *d.parents):
        if p.exists():
            break
        out.append(p)
    return out


def _remove_what_we_made(made: list[Path], telemetry_dir: Path | None) -> None:
    """A run that wrote no result leaves nothing behind: its telemetry, then the directories it created."""
    if telemetry_dir is not None:
        shutil.rmtree(telemetry_dir, ignore_errors=True)
    for d in made:
        with contextlib.suppress(OSError):
            d.rmdir()  # only if empty


def died(gone: str) -> str:
    return f"the server no longer answers ({gone}): it crashed, hung or was stopped; see its log"


def _verdict(result: dict[str, Any], cfg: LoadTestConfig, abort: str | None) -> None:
    """partial / run_failed / failure_reason: a run that lost requests says so, in its flags and exit code."""
    n, failed = result["num_prompts"], result["failed"]
    reasons = []
    if abort:
        reasons.append(f"the run stopped early ({abort})")
    if failed:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(result["errors_by_kind"].items()))
        reasons.append(f"{failed} of {n} requests failed ({kinds})")
    if result.get("server_gone"):
        reasons.append(died(result["server_gone"]))
    result["partial"] = bool(abort or failed)
    result["run_failed"] = bool(abort) or result["completed"] == 0 or failed > cfg.max_failed_fraction * n
    if failed and not result["run_failed"]:
        reasons.append(f"within --max-failed-fraction {cfg.max_failed_fraction:g}")
    result["failure_reason"] = "; ".join(reasons) or None


# Descriptors beyond one socket per stream: the results, telemetry, the tokenizer's files, the interpreter's own.
FD_MARGIN = 64


def ensure_file_room(concurrency: int) -> None:
    """One socket per stream stays open until the results are written: at a soft descriptor limit below that, a
    run finished and was then lost ('Too many open files', naming the results file). Raise the soft limit to what
    is needed where the hard limit allows (as servers do); else refuse before any request."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    need = concurrency + FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
            return
        except (ValueError, OSError):
            pass
    raise Glm5Fp4Error(f"--concurrency {concurrency}: needs about {need} open files (a socket per stream), and this "
                       f"process may open {hard} (ulimit -n); raise the limit (ulimit -n {need}) or lower --concurrency")


async def _run_async(cfg: LoadTestConfig, stop: _Stop) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    stop.task = asyncio.current_task()
    ensure_file_room(cfg.concurrency)
    run = _Run(cfg)
    auth = _client.url_auth(cfg.url)
    # credentials in --url are explicit; $OPENAI_API_KEY is ambient and would be a second Authorization header
    api_key = cfg.api_key or (None if auth else os.environ.get("OPENAI_API_KEY"))
    session = _client.make_session(cfg.concurrency, request_timeout_s=cfg.request_timeout_s,
                                   read_timeout_s=cfg.read_timeout_s, api_key=api_key, auth=auth)
    async with session:
        model, prompts, tokenizer = await run.prepare(session)
        warm = await run.warmup(session, model, prompts)
        recs = [RequestRecord(i, p.prompt_len, p.output_len) for i, p in enumerate(prompts)]
        now = _dt.datetime.now()
        date = now.strftime("%Y%m%d-%H%M%S")
        result_path = _result_path(cfg, model, date)
        made = _missing_dirs(result_path.parent) if result_path else []
        new_telemetry = result_path.parent / "telemetry" if result_path else None
        if new_telemetry is not None and new_telemetry.exists():
            new_telemetry = None  # an earlier run's: not ours to remove
        try:
            return await _measure_and_report(cfg, run, session, model, prompts, tokenizer, warm, recs, now,
                                             result_path, stop)
        except BaseException:
            _remove_what_we_made(made, new_telemetry)
            raise


async def _measure_and_report(cfg: LoadTestConfig, run: _Run, session: Any, model: str, prompts: list[Prompt],
                              tokenizer: Tokenizer, warm: dict[str, Any], recs: list[RequestRecord],
                              now: _dt.datetime, result_path: Path | None,
                              stop: _Stop) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    scratch = contextlib.ExitStack()
    sampler = _telemetry_sampler(cfg, result_path.parent if result_path else None, scratch)
    telemetry: dict[str, Any] | None = None
    t0, t0_unix = time.perf_counter(), time.time()
    abort: str | None = None
    duration = 0.0
    try:
        try:
            t0, t0_unix = time.perf_counter(), time.time()
            duration, abort = await run.measure(session, model, prompts, recs)
        finally:
            if sampler is not None:
                try:
                    sampler.stop()  # a failure while sampling is kept in its summary, read below
                except Exception as exc:  # noqa: BLE001 - its summary is computed again below, guarded
                    print(f"loadtest: stopping telemetry failed ({exc})", file=sys.stderr)
    except (asyncio.CancelledError, KeyboardInterrupt):
        abort = f"terminated by {stop.signal}" if stop.signal else "interrupted by the user (Ctrl-C)"
        if stop.signal and stop.task is not None:
            stop.task.uncancel()  # handled: the results are written below (Ctrl-C: asyncio.Runner does this)
        # Only the two handlers cancel this task: without SIGTERM's mark it was Ctrl-C (asyncio.Runner's SIGINT
        # handler, or a KeyboardInterrupt). Recorded, so a sweep stops and the CLI exits 130.
        stop.signal = stop.signal or "SIGINT"
        duration = time.perf_counter() - t0
        for r in recs:
            if r.status == "running":
                r.fail("cancelled", abort)
            elif r.status == "not_sent":  # never sent: no times (fail() made them sent rows starting at 0)
                r.error_kind, r.error = "not_sent", f"never sent: {abort}"
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
        "run_failed": False,
        "failure_reason": None,
        "abort_reason": abort,
        "stopped_by": stop.signal,
        "stall_timeout_s": run.stall.limit(),
        "first_errors": first_errors,
        # asked only when requests failed: a crashed server, not a slow or erroring one
        "server_gone": await _client.server_gone(session, run.base) if metrics.get("failed") else None,
    }
    _verdict(result, cfg, abort)
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
        "url": _client.redact_url(cfg.url),
        "endpoint": cfg.endpoint,
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "range_ratio": cfg.range_ratio,
        "seed": cfg.seed,
        "ignore_eos": cfg.ignore_eos,
        "min_tokens": cfg.min_tokens,
        # null, not {}, when none: results written before this was recorded have no key and compare alike
        "extra_body": cfg.extra_body or None,
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
        "argv": redact_argv(sys.argv),
        **warm,
    }
    if result_path is not None:
        paths = write_results(result, rows, result_path)
        result["result_file"] = str(paths["json"])
    if cfg.print_summary:
        print_summary(result)
    return result, rows


def _run_coroutine(cfg: LoadTestConfig) -> Any:
    """uvloop when available: its faster I/O path is what lets one core follow 512 streams.

    SIGTERM (a CI job's timeout, `timeout`, a supervisor) stops the run like Ctrl-C: the measured phase ends,
    the results are written and marked; before the measured phase there is nothing to write.
    """
    factory = None
    if cfg.event_loop != "asyncio":
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            if cfg.event_loop == "uvloop":
                raise Glm5Fp4Error("--event-loop uvloop: uvloop is not installed") from None
    stop = _Stop()

    def on_sigterm() -> None:
        stop.signal = "SIGTERM"
        if stop.task is not None:
            stop.task.cancel()

    with asyncio.Runner(loop_factory=factory) as runner:
        loop = runner.get_loop()
        try:
            loop.add_signal_handler(signal.SIGTERM, on_sigterm)
            handled = True
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            handled = False
        try:
            return runner.run(_run_async(cfg, stop))
        except asyncio.CancelledError:
            if stop.signal:  # a stop, not an error: exit 128 + N, and a sweep keeps the levels before it
                from glm5_fp4.server_process import StopSignal

                print(f"loadtest: terminated by {stop.signal} before the measured phase; nothing was written",
                      file=sys.stderr)
                raise StopSignal(getattr(signal, stop.signal)) from None
            raise
        finally:
            if handled:
                loop.remove_signal_handler(signal.SIGTERM)


def run_loadtest_detailed(config: LoadTestConfig | Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Like run_loadtest, also returning the per-request rows."""
    cfg = config if isinstance(config, LoadTestConfig) else LoadTestConfig.from_mapping(config)
    return _run_coroutine(cfg)


def run_loadtest(config: LoadTestConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Run one load test and return the summary dict (vLLM key names); writes files if result_dir is set."""
    return run_loadtest_detailed(config)[0]
