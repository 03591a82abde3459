"""Capture torch-profiler traces from a running vLLM or SGLang server during a decode load.

The server must have its profiler enabled at launch (vLLM: ``--profiler-config '{"profiler":"torch",
"torch_profiler_dir":DIR}'``; SGLang: ``SGLANG_TORCH_PROFILER_DIR=DIR``; the launch profiles set these).
Steps: start a small streaming load (``ignore_eos`` completions, so every stream keeps decoding), wait until
all streams are decoding, POST ``/start_profile``, let ``steps`` decode steps pass (timed from the streams'
own token gaps), POST ``/stop_profile`` (vLLM flushes here, which can take minutes), stop the load and copy
the trace files the server wrote into ``out``. Loopback servers only.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import statistics
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loopback import is_loopback


@dataclass
class CaptureConfig:
    url: str
    steps: int
    trace_dir: Path
    out: Path
    engine: str = "auto"
    concurrency: int = 8
    prompt_len: int = 64
    output_len: int = 4096
    warmup_s: float = 60.0
    flush_timeout_s: float = 900.0
    request_timeout_s: float = 30.0
    model: str | None = None


@dataclass
class Captured:
    files: list[Path]  # the trace files copied into ``out``
    engine: str
    kv_cache_dtype: str | None  # the server's --kv-cache-dtype where it tells (SGLang; vLLM does not)


@dataclass
class LoadStats:
    tokens: int = 0
    first_token: int = 0
    gaps: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _check_url(url: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise Glm5Fp4Error(f"--url {url!r}: expected http://HOST:PORT")
    if not is_loopback(parsed.hostname):
        raise Glm5Fp4Error(f"--url {url!r}: capture drives load against loopback servers only (127.0.0.1 / localhost)")
    return url.rstrip("/")


def _request(url: str, body: dict | None = None, timeout: float = 30.0, method: str | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
            # connected but no answer in time: slow (a profiler flushing), not unreachable
            raise Glm5Fp4Error(f"{url}: no answer within {timeout:g} s (the server may still be working on it; "
                               + ("raise --flush-timeout-s; traces may still appear" if url.endswith("/stop_profile")
                                  else "is it overloaded?") + ")") from None
        raise Glm5Fp4Error(f"{url}: server not reachable ({reason})") from None


def detect_engine(base: str, timeout: float) -> str:
    status, _ = _request(f"{base}/get_server_info", timeout=timeout)
    if status == 200:
        return "sglang"
    status, _ = _request(f"{base}/version", timeout=timeout)
    if status == 200:
        return "vllm"
    raise Glm5Fp4Error(f"{base}: neither SGLang (/get_server_info) nor vLLM (/version) answered; is the server up?")


def server_kv_cache_dtype(base: str, timeout: float) -> str | None:
    """The server's --kv-cache-dtype: SGLang's /get_server_info answers with its server args (vLLM has no such
    route), None where it does not say."""
    status, body = _request(f"{base}/get_server_info", timeout=timeout)
    try:
        value = json.loads(body).get("kv_cache_dtype") if status == 200 else None
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def first_model(base: str, timeout: float) -> str:
    status, body = _request(f"{base}/v1/models", timeout=timeout)
    try:
        return json.loads(body)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise Glm5Fp4Error(f"{base}/v1/models: unexpected answer (HTTP {status}): {body[:200]!r}") from None


def _stream(base: str, model: str, cfg: CaptureConfig, stats: LoadStats, stop: threading.Event) -> None:
    """One client: streaming completions, back to back, until told to stop."""
    body = {
        "model": model,
        "prompt": " ".join(["hello"] * cfg.prompt_len),
        "max_tokens": cfg.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    while not stop.is_set():
        req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=cfg.request_timeout_s) as resp:
                last = None
                first = True
                for raw in resp:
                    if stop.is_set():
                        return
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    now = time.perf_counter()
                    with stats.lock:
                        stats.tokens += 1
                        if first:
                            stats.first_token += 1
                        elif last is not None:
                            stats.gaps.append(now - last)
                    first, last = False, now
        except (urllib.error.URLError, OSError, ValueError) as exc:
            with stats.lock:
                stats.errors.append(str(exc))
            if stop.wait(0.5):
                return


def _snapshot(trace_dir: Path) -> dict[Path, float]:
    if not trace_dir.is_dir():
        return {}
    return {p: p.stat().st_mtime for p in trace_dir.iterdir() if p.is_file() and p.name.endswith((".json", ".json.gz"))}


def _new_files(trace_dir: Path, before: dict[Path, float]) -> list[Path]:
    now = _snapshot(trace_dir)
    return sorted(p for p, m in now.items() if p not in before or m > before[p])


_WORLD_SIZE = re.compile(rb'"world_size"\s*:\s*(\d+)')


def declared_world_size(path: Path) -> int | None:
    """The rank count a Kineto trace declares (distributedInfo.world_size, written before the events), read from the
    file's head only; None where it says none or cannot be read yet (a rank still writing it)."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rb") as f:
            head = f.read(1 << 20)
    except (OSError, EOFError, zlib.error):
        return None
    m = _WORLD_SIZE.search(head)
    return int(m[1]) if m else None


def _wait_for_traces(trace_dir: Path, before: dict[Path, float], timeout: float, settle_s: float = 3.0) -> list[Path]:
    """New trace files, once their number and sizes stop changing (servers write them one rank at a time) and there
    are as many as the traces declare ranks: a rank written later than the others' quiet spell was left out, and the
    analysis read the ranks that came as the whole group."""
    deadline = time.monotonic() + timeout
    last_state = None
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        files = _new_files(trace_dir, before)
        state = tuple((p.name, p.stat().st_size) for p in files if p.exists())
        if state != last_state:
            last_state, stable_since = state, time.monotonic()
        elif files and time.monotonic() - stable_since >= settle_s:
            world = max((w for w in map(declared_world_size, files) if w), default=None)
            if world is None or len(files) >= world:
                return files
        time.sleep(0.5)
    files = _new_files(trace_dir, before)
    if not files:
        raise Glm5Fp4Error(
            f"{trace_dir}: no new trace files after {timeout:.0f} s; is this the server's profiler directory "
            "(vLLM torch_profiler_dir / SGLANG_TORCH_PROFILER_DIR)?"
        )
    world = max((w for w in map(declared_world_size, files) if w), default=None)
    if world is not None and len(files) < world:
        raise Glm5Fp4Error(
            f"{trace_dir}: {len(files)} of the {world} ranks' traces the capture declares (distributedInfo.world_size) "
            f"after {timeout:.0f} s ({', '.join(p.name for p in files)}); a rank still writing? raise "
            "--flush-timeout-s, or analyze the folder once every rank's file is there"
        )
    return files


def _stop_after_interruption(base: str, cfg: CaptureConfig) -> None:
    try:
        status, _ = _request(f"{base}/stop_profile", {}, timeout=min(cfg.flush_timeout_s, 60.0))
        said = f"HTTP {status}"
    except Exception as exc:  # noqa: BLE001 - best effort on the way out; the original error is what propagates
        said = f"no answer ({exc})"
    print(f"capture stopped while the server was profiling: sent {base}/stop_profile ({said}); its traces may "
          f"still appear in {cfg.trace_dir}", file=sys.stderr, flush=True)


def capture(cfg: CaptureConfig, log=print) -> Captured:
    """Run the capture; returns the trace files copied into ``cfg.out`` and what the server said of itself."""
    base = _check_url(cfg.url)
    if cfg.steps < 1:
        raise Glm5Fp4Error(f"--steps must be >= 1, got {cfg.steps}")
    # One capture per folder: engines name traces by time, so an earlier capture's files would be read as a
    # second trace of the same rank by the analysis. Checked before any load is sent.
    # The server's own folder as --out/traces is no exception: its earlier captures would be analysed too.
    earlier = list(_snapshot(cfg.out))
    if earlier:
        same = cfg.out.resolve() == cfg.trace_dir.resolve()
        raise Glm5Fp4Error(f"{cfg.out} already holds {len(earlier)} trace file(s) of an earlier capture"
                           + (" (it is the server's --trace-dir too)" if same else "")
                           + "; choose another --out or remove them")
    engine = detect_engine(base, cfg.request_timeout_s) if cfg.engine == "auto" else cfg.engine
    model = cfg.model or first_model(base, cfg.request_timeout_s)
    kv = server_kv_cache_dtype(base, cfg.request_timeout_s) if engine == "sglang" else None
    log(f"server {base}: {engine}, model {model}" + (f", kv_cache_dtype {kv}" if kv else ""))

    stats, stop = LoadStats(), threading.Event()
    threads = [threading.Thread(target=_stream, args=(base, model, cfg, stats, stop), daemon=True) for _ in range(cfg.concurrency)]
    for t in threads:
        t.start()
    profiling = False
    try:
        deadline = time.monotonic() + cfg.warmup_s
        while time.monotonic() < deadline:
            with stats.lock:
                decoding = stats.first_token >= cfg.concurrency and len(stats.gaps) >= 4 * cfg.concurrency
                errors = list(stats.errors)
            if decoding:
                break
            if len(errors) > 4 * cfg.concurrency:
                raise Glm5Fp4Error(f"{base}/v1/completions: load requests keep failing: {errors[-1]}")
            time.sleep(0.2)
        with stats.lock:
            gaps = list(stats.gaps[-200:])
        if not gaps:
            raise Glm5Fp4Error(f"{base}: no streamed tokens within {cfg.warmup_s:.0f} s of load; cannot profile decode")
        step_s = statistics.median(gaps)
        log(f"decoding: {cfg.concurrency} streams, median token gap {step_s * 1e3:.1f} ms")

        before = _snapshot(cfg.trace_dir)
        body: dict = {}
        if engine == "sglang":
            body = {"num_steps": cfg.steps, "activities": ["CPU", "GPU"], "output_dir": str(cfg.trace_dir)}
        profiling = True  # until the server answers: a start left unanswered (a timeout, Ctrl-C) may be recording
        status, answer = _request(f"{base}/start_profile", body, timeout=cfg.request_timeout_s)
        profiling = status < 400
        if status == 404:
            raise Glm5Fp4Error(f"{base}/start_profile: 404; start the server with its profiler enabled (see the launch profile)")
        if status >= 400:
            raise Glm5Fp4Error(f"{base}/start_profile: HTTP {status}: {answer[:300]!r}")
        log(f"profiling {cfg.steps} decode steps (~{cfg.steps * step_s:.1f} s)")
        time.sleep(max(cfg.steps * step_s * 1.5, 0.5))
        profiling = False  # asked to stop; a refusal below is the server's answer, not ours to repeat
        status, answer = _request(f"{base}/stop_profile", {}, timeout=cfg.flush_timeout_s)
        if status >= 400 and engine != "sglang":  # SGLang stops by itself after num_steps and may say so
            raise Glm5Fp4Error(f"{base}/stop_profile: HTTP {status}: {answer[:300]!r}")
    finally:
        stop.set()
        if profiling:  # interrupted or failed while the server records: left on, its profiler would keep growing
            _stop_after_interruption(base, cfg)
    files = _wait_for_traces(cfg.trace_dir, before, cfg.flush_timeout_s)
    cfg.out.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in files:
        dest = cfg.out / p.name
        if p.resolve() != dest.resolve():
            shutil.copy2(p, dest)
        copied.append(dest)
    log(f"collected {len(copied)} trace file(s) into {cfg.out}")
    return Captured(copied, engine, kv)
