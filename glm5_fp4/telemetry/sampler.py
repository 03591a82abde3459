"""Background GPU telemetry sampler: power, clocks, utilisation, memory, temperature, throttling.

    with TelemetrySampler("out/telemetry") as sampler:
        sampler.mark("warmup"); warm_up()
        sampler.mark("measure"); tokens = run_load()
    result["telemetry"] = sampler.summary(tokens=tokens)

One daemon thread reads NVML every `interval_s` for each GPU and appends a line per GPU to
telemetry.jsonl (format in series.py). Without NVML or GPUs the sampler logs one warning per
process, writes metadata saying "no GPU telemetry", and every call still works.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.telemetry.nvml_reader import NvmlReader, TelemetryUnavailable
from glm5_fp4.telemetry.series import (
    META_FILE,
    NO_TELEMETRY,
    SAMPLES_FILE,
    SUMMARY_FILE,
    GpuSeries,
    TelemetryRun,
    sample_line,
    write_json_atomic,
)
from glm5_fp4.telemetry.summary import summarize

log = logging.getLogger("glm5_fp4.telemetry")
_warned = False  # "no GPU telemetry" is said once per process, however many samplers start


def _warn_unavailable(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("%s: %s", NO_TELEMETRY, reason)
    else:
        log.debug("%s: %s", NO_TELEMETRY, reason)


class TelemetrySampler:
    """Context manager recording GPU telemetry into `out_dir` while the block runs.

    gpus: NVML indices to record (default: those CUDA_VISIBLE_DEVICES names, else all).
    nvml: a pynvml-compatible object; None imports pynvml when the sampler starts (tests pass FakeNvml).
    pcie: also record PCIe TX/RX throughput (counters when the driver has them; otherwise the
          slow legacy call, once per second for one GPU at a time).
    """

    def __init__(
        self,
        out_dir: str | Path,
        interval_s: float = 0.1,
        gpus: list[int] | None = None,
        *,
        nvml: Any = None,
        pcie: bool = True,
        flush_s: float = 1.0,
    ):
        if not isinstance(interval_s, (int, float)) or not 0.001 <= interval_s <= 3600:
            raise Glm5Fp4Error(f"telemetry interval_s must be between 0.001 and 3600 seconds, got {interval_s!r}")
        if gpus is not None and not all(isinstance(g, int) and g >= 0 for g in gpus):
            raise Glm5Fp4Error(f"telemetry gpus must be non-negative NVML indices, got {gpus!r}")
        self.out_dir = Path(out_dir)
        self.interval_s = float(interval_s)
        self.gpus = list(gpus) if gpus is not None else None
        self.pcie = pcie
        self.flush_s = flush_s
        self._nvml = nvml
        self._reader: NvmlReader | None = None
        self._file = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self._stopped = False
        self._t0 = 0.0
        self._ticks = 0
        self._late_ticks = 0
        self._failures = 0
        self._cpu_s = 0.0
        self._last_flush = 0.0
        self._series: dict[int, GpuSeries] = {}
        self.run = TelemetryRun(available=False, interval_s=self.interval_s)

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def available(self) -> bool:
        return self.run.available

    @property
    def reason(self) -> str | None:
        return self.run.reason

    def start(self) -> TelemetrySampler:
        if self._started:
            raise Glm5Fp4Error("TelemetrySampler.start() called twice; use a new sampler per recording")
        self._started = True
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Glm5Fp4Error(f"{self.out_dir}: cannot create telemetry directory ({exc})") from exc
        self._t0 = time.monotonic()
        self.run.start_monotonic = self._t0
        self.run.start_unix = time.time()
        try:
            self._reader = NvmlReader(self._nvml, self.gpus, pcie=self.pcie)
        except TelemetryUnavailable as exc:
            self.run.reason = str(exc)
            _warn_unavailable(self.run.reason)
            self._write_meta()
            return self
        self.run.available = True
        self.run.driver = self._reader.driver
        for dev in self._reader.devices:
            series = GpuSeries(
                index=dev.index,
                name=dev.name,
                uuid=dev.uuid,
                metrics=list(dev.metrics),
                unsupported=list(dev.unsupported),
            )
            self._series[dev.index] = series
            self.run.gpus.append(series)
        self._file = (self.out_dir / SAMPLES_FILE).open("w", buffering=1 << 16)
        self._write_meta()
        self._tick()  # a sample at t≈0 so the series spans the whole block
        self._thread = threading.Thread(target=self._loop, name="glm5-fp4-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stop sampling, close the files, write the summary; returns summary(). Safe to call twice."""
        if not self._started:
            raise Glm5Fp4Error("TelemetrySampler.stop() before start()")
        if not self._stopped:
            self._stopped = True
            if self._thread is not None:
                self._stop.set()
                self._thread.join()
            if self._reader is not None:
                self._tick()  # and one at the end
                self._reader.close()
            if self._file is not None:
                self._file.close()
            self.run.end_s = time.monotonic() - self._t0
            self._write_meta()
            self.write_summary()
        return self.summary()

    def mark(self, name: str) -> None:
        """Start a named load phase now (e.g. "warmup", "measure"); plots and summary split on it."""
        if not isinstance(name, str) or not name.strip():
            raise Glm5Fp4Error(f"telemetry phase name must be a non-empty string, got {name!r}")
        if not self._started or self._stopped:
            raise Glm5Fp4Error(f"mark({name!r}) outside a running TelemetrySampler")
        with self._lock:
            self.run.marks.append((time.monotonic() - self._t0, name.strip()))
        self._write_meta()

    def summary(self, tokens: int | None = None, phase: str | None = None) -> dict[str, Any]:
        """Summary dict (see summary.py); `tokens` adds tokens per joule, `phase` restricts to a phase."""
        with self._lock:  # copy under the lock, summarise outside it: the sampling thread never waits long
            self._update_sampler_stats()
            snapshot = self.run.snapshot()
        return summarize(snapshot, tokens=tokens, phase=phase)

    def write_summary(self, tokens: int | None = None, phase: str | None = None) -> dict[str, Any]:
        """summary() also written to telemetry_summary.json."""
        data = self.summary(tokens=tokens, phase=phase)
        write_json_atomic(self.out_dir / SUMMARY_FILE, data)
        return data

    # -- sampling thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        cpu0 = time.thread_time()
        next_t = self._t0 + self.interval_s
        try:
            while not self._stop.wait(max(next_t - time.monotonic(), 0.0)):
                self._tick()
                self._cpu_s = time.thread_time() - cpu0  # this thread's own CPU: the sampler's cost
                next_t += self.interval_s
                now = time.monotonic()
                if next_t <= now:
                    # Fell behind (slow NVML, starved CPU): skip the missed ticks rather than burst.
                    missed = int((now - next_t) / self.interval_s) + 1
                    self._late_ticks += missed
                    next_t += missed * self.interval_s
        except Exception as exc:  # the user's workload must never die because telemetry did
            log.warning("GPU telemetry sampling stopped early: %s", exc)
            self.run.sampler["error"] = str(exc)
        finally:
            self._cpu_s = time.thread_time() - cpu0

    def _tick(self) -> None:
        reader = self._reader
        devices = reader.devices
        # Legacy PCIe throughput blocks ~20 ms per call: one GPU per second, round robin.
        slow_every = max(1, round(1.0 / self.interval_s))
        slow_dev = (self._ticks // slow_every) % len(devices) if self._ticks % slow_every == 0 else -1
        lines = []
        for i, dev in enumerate(devices):
            sample, failures = reader.read(dev, slow=(i == slow_dev))
            t = time.monotonic() - self._t0
            self._failures += failures
            with self._lock:
                self._series[dev.index].append(t, sample)
            lines.append(sample_line(t, dev.index, sample))
        self._ticks += 1
        self._file.write("\n".join(lines) + "\n")
        now = time.monotonic()
        if now - self._last_flush >= self.flush_s:
            self._file.flush()
            self._last_flush = now

    # -- metadata --------------------------------------------------------------------------------

    def _update_sampler_stats(self) -> None:
        self.run.sampler.update(
            {
                "interval_s": self.interval_s,
                "ticks": self._ticks,
                "late_ticks": self._late_ticks,
                "read_failures": self._failures,
                "cpu_s": round(self._cpu_s, 6),
            }
        )

    def _write_meta(self) -> None:
        with self._lock:
            self._update_sampler_stats()
            meta = self.run.meta()
        write_json_atomic(self.out_dir / META_FILE, meta)
