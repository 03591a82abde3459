"""Background GPU telemetry sampler: power, clocks, utilisation, memory, temperature, throttling.

    with TelemetrySampler("out/telemetry") as sampler:
        sampler.mark("warmup"); warm_up()
        sampler.mark("measure"); tokens = run_load()
    result["telemetry"] = sampler.summary(tokens=tokens)

One daemon thread reads NVML every `interval_s` for each GPU and appends a line per GPU to
telemetry.jsonl (format in series.py). Without NVML or GPUs the sampler logs one warning per
process, writes metadata saying "no GPU telemetry", and every call still works. Starting removes
the files an earlier run left in the directory (its report, plot, samples), so they never pass for
this run's. Once started, telemetry's own failures (a full disk) never reach the workload: sampling
stops, the error is logged and kept in the metadata's sampler.error, and the summary says the
telemetry is incomplete. Bad arguments and an output directory that cannot be written are refused
at start(), before the workload runs.

Cost: each NVML query costs the driver ~0.36 ms of CPU on an H200 (see nvml_reader.py); with 3.4
queries per GPU per tick the sampler takes ~1.3 % of one core per GPU at 0.1 s, ten times the 1 %
for 8 GPUs it aims at. interval_s="auto" (the default) therefore times the reads once at start and
takes the shortest interval in AUTO_INTERVALS whose cost (the measured reads plus PY_TICK_S and
PY_SAMPLE_S for the Python side) stays within AUTO_CPU_BUDGET: 0.1 s where NVML is cheap (and with
FakeNvml), longer with several GPUs on a GSP-based driver (projected: 2 s for 8 H200s). A number
forces that interval whatever it costs; the chosen one and its measured cost are in the metadata.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.telemetry.nvml_reader import PCIE_COUNTER_WRAP, SLOW, NvmlReader, TelemetryUnavailable
from glm5_fp4.telemetry.series import (
    MARKDOWN_FILE,
    META_FILE,
    NO_TELEMETRY,
    PNG_FILE,
    SAMPLES_FILE,
    SUMMARY_FILE,
    GpuSeries,
    TelemetryRun,
    sample_line,
    write_json_atomic,
)
from glm5_fp4.telemetry.summary import summarize

log = logging.getLogger("glm5_fp4.telemetry")

AUTO = "auto"
AUTO_INTERVALS = (0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
AUTO_CPU_BUDGET = 0.01  # of one core, for everything the sampling thread does
# The sampling thread's Python work besides the NVML calls, which "auto" adds to the measured reads:
# per tick waking up and writing (50-80 µs on a 2-core VM), per GPU sample the JSON line, the columns
# and the reader's bookkeeping (~25 µs with FakeNvml).
PY_TICK_S = 100e-6
PY_SAMPLE_S = 30e-6
SLOW_S = 1.0  # memory clock, memory used, temperature and clock-event reasons: once per second...
SLOW_MIN_TICKS = 5  # ...but at most every 5th tick, so at long intervals they never outweigh the rest


def slow_every(interval_s: float, slow_s: float = SLOW_S) -> int:
    """Ticks between two reads of the slow metrics."""
    return max(SLOW_MIN_TICKS, round(slow_s / interval_s))


def pick_interval(
    fast_cpu_s: float, slow_cpu_s: float, slow_s: float = SLOW_S, budget: float = AUTO_CPU_BUDGET
) -> float:
    """The shortest interval in AUTO_INTERVALS whose sampling costs at most `budget` of one core.

    fast_cpu_s: CPU of one tick without its slow reads, all GPUs; slow_cpu_s: CPU of one round of
    the slow reads, which run every slow_every(interval, slow_s) ticks.
    """
    for interval in AUTO_INTERVALS:
        if fast_cpu_s / interval + slow_cpu_s / (slow_every(interval, slow_s) * interval) <= budget:
            return interval
    return AUTO_INTERVALS[-1]


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

    interval_s: seconds between samples, or "auto" (see the module docstring).
    gpus: NVML indices to record (default: those CUDA_VISIBLE_DEVICES names, else all).
    nvml: a pynvml-compatible object; None imports pynvml when the sampler starts (tests pass FakeNvml).
    pcie: also record PCIe TX/RX throughput from NVML's byte counters (part of the every-tick field
          read). The counters wrap every 4 GiB, so rates above 2**32 B / interval alias; the
          metadata's sampler.pcie_alias_above_mbs says where that is.
    pcie_legacy: where the counters are missing, use nvmlDeviceGetPcieThroughput instead, which
          blocks ~20 ms per call (read once per second, one GPU at a time). Off by default.
    slow_s: how often the slow metrics (memory clock, memory used, temperature, throttle) are read;
          at most every SLOW_MIN_TICKS-th tick.
    """

    def __init__(
        self,
        out_dir: str | Path,
        interval_s: float | str = AUTO,
        gpus: list[int] | None = None,
        *,
        nvml: Any = None,
        pcie: bool = True,
        pcie_legacy: bool = False,
        slow_s: float = SLOW_S,
        flush_s: float = 1.0,
    ):
        self.auto = interval_s == AUTO
        if not self.auto and (
            isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not 0.001 <= interval_s <= 3600
        ):
            raise Glm5Fp4Error(
                f"telemetry interval_s must be 'auto' or between 0.001 and 3600 seconds, got {interval_s!r}"
            )
        if isinstance(slow_s, bool) or not isinstance(slow_s, (int, float)) or not 0.001 <= slow_s <= 3600:
            raise Glm5Fp4Error(f"telemetry slow_s must be between 0.001 and 3600 seconds, got {slow_s!r}")
        if gpus is not None and not all(isinstance(g, int) and g >= 0 for g in gpus):
            raise Glm5Fp4Error(f"telemetry gpus must be non-negative NVML indices, got {gpus!r}")
        twice = next((g for i, g in enumerate(gpus or []) if g in gpus[:i]), None)
        if twice is not None:  # it would be sampled twice and its energy counted twice
            raise Glm5Fp4Error(f"telemetry gpus {gpus!r}: GPU {twice} is listed twice")
        self.out_dir = Path(out_dir)
        self.interval_s = AUTO_INTERVALS[0] if self.auto else float(interval_s)
        self.gpus = list(gpus) if gpus is not None else None
        self.pcie = pcie
        self.pcie_legacy = pcie_legacy
        self.slow_s = float(slow_s)
        self._slow_every = 1
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
        self._calls = 0
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
        self._t0 = time.monotonic()
        self.run.start_monotonic = self._t0
        self.run.start_unix = time.time()
        try:
            self._reader = NvmlReader(self._nvml, self.gpus, pcie=self.pcie, pcie_legacy=self.pcie_legacy)
        except TelemetryUnavailable as exc:
            self.run.reason = str(exc)
        try:
            self._open_output()
            if self._reader is None:
                _warn_unavailable(self.run.reason)
                self._write_meta()
                return self
            self._start_sampling()
        except BaseException:
            self._stopped = True  # nothing to stop: NVML and the file are closed here
            self._release()
            raise
        self._thread = threading.Thread(target=self._loop, name="glm5-fp4-telemetry", daemon=True)
        self._thread.start()
        return self

    def _open_output(self) -> None:
        """Make the directory, remove an earlier run's files, open the samples file: a failure is one error naming
        the path, raised before the workload starts."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Glm5Fp4Error(f"{self.out_dir}: cannot create telemetry directory ({exc.strerror or exc})") from None
        path = self.out_dir
        try:
            for name in (SAMPLES_FILE, SUMMARY_FILE, MARKDOWN_FILE, PNG_FILE):
                path = self.out_dir / name
                path.unlink(missing_ok=True)
            if self._reader is not None:
                path = self.out_dir / SAMPLES_FILE
                self._file = path.open("w", buffering=1 << 16)
        except OSError as exc:
            raise Glm5Fp4Error(f"{path}: cannot write telemetry there ({exc.strerror or exc})") from None

    def _start_sampling(self) -> None:
        self.run.available = True
        self.run.driver = self._reader.driver
        self._configure_interval()
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
        # t=0 once NVML is open and timed, so the first sample is at t≈0 and marks line up with it
        self._t0 = time.monotonic()
        self.run.start_monotonic = self._t0
        self.run.start_unix = time.time()
        self._write_meta()
        self._tick(full=True)  # a sample at t≈0 with every metric, so the series spans the whole block

    def stop(self) -> dict[str, Any]:
        """Stop sampling, close the files, write the summary; returns summary(). Safe to call twice.

        Never raises for telemetry's own failures: it runs in the workload's `finally` (or `with`), where an
        exception would replace the workload's result. They are logged and kept in sampler.error instead.
        """
        if not self._started:
            raise Glm5Fp4Error("TelemetrySampler.stop() before start()")
        if not self._stopped:
            self._stopped = True
            try:
                if self._thread is not None:
                    self._stop.set()
                    self._thread.join()
                if self._reader is not None and "error" not in self.run.sampler:  # not into a file that failed
                    self._tick(full=True)  # and one at the end
            except Exception as exc:
                self._fail("the last sample", exc)
            finally:
                self._release()
            self.run.end_s = time.monotonic() - self._t0
            try:
                self._write_meta()
                self.write_summary()
            except Exception as exc:
                self._fail("writing the metadata and summary", exc)
        return self.summary()

    def _release(self) -> None:
        """Close NVML and the samples file, each whatever became of the other."""
        try:
            if self._reader is not None:
                self._reader.close()
        finally:
            f, self._file = self._file, None
            if f is not None:
                try:
                    f.close()  # flushes what was buffered: the disk may be full
                except Exception as exc:
                    self._fail(f"closing {self.out_dir / SAMPLES_FILE}", exc)

    def _fail(self, what: str, exc: Exception) -> None:
        """Telemetry failed mid-run: the first failure is logged and kept (the summary reports it); the workload
        goes on."""
        with self._lock:  # the metadata may be being copied in another thread
            first = "error" not in self.run.sampler
            if first:
                self.run.sampler["error"] = f"{what}: {exc}"
        if first:
            log.warning("GPU telemetry stopped early: %s: %s", what, exc)
        else:
            log.debug("GPU telemetry: %s also failed: %s", what, exc)

    def mark(self, name: str) -> None:
        """Start a named load phase now (e.g. "warmup", "measure"); plots and summary split on it."""
        if not isinstance(name, str) or not name.strip():
            raise Glm5Fp4Error(f"telemetry phase name must be a non-empty string, got {name!r}")
        if not self._started or self._stopped:
            raise Glm5Fp4Error(f"mark({name!r}) outside a running TelemetrySampler")
        with self._lock:
            self.run.marks.append((time.monotonic() - self._t0, name.strip()))
        try:
            self._write_meta()
        except Exception as exc:  # the mark is kept in memory; stop() writes the metadata again
            log.warning("GPU telemetry: %s", exc)

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
            self._fail("sampling", exc)
        finally:
            self._cpu_s = time.thread_time() - cpu0

    def _configure_interval(self) -> None:
        """Pick the interval ("auto") and spread the slow reads over the ticks of each slow_s."""
        reader = self._reader
        if self.auto:
            fast, slow = reader.measure_cost()
            python = PY_TICK_S + PY_SAMPLE_S * len(reader.devices)
            self.interval_s = pick_interval(fast + python, slow, self.slow_s)
            self.run.sampler["auto_interval"] = {
                "chosen_s": self.interval_s,
                "read_cpu_ms_per_tick": round(1e3 * fast, 4),
                "slow_read_cpu_ms_per_round": round(1e3 * slow, 4),
                "python_cpu_ms_per_tick": round(1e3 * python, 4),
                "budget_of_one_core": AUTO_CPU_BUDGET,
                "candidates_s": list(AUTO_INTERVALS),
            }
        self.run.interval_s = self.interval_s
        self._slow_every = slow_every(self.interval_s, self.slow_s)
        reader.schedule(self._slow_every)
        slow_metrics = sorted({k for dev in reader.devices for k in dev.metrics_of(SLOW)})
        self.run.sampler["slow_metrics"] = slow_metrics
        self.run.sampler["slow_s"] = self._slow_every * self.interval_s
        self._update_pcie_note()

    def _update_pcie_note(self) -> None:
        """Where PCIe counter readings stop being exact at this interval (none for 64-bit counters)."""
        counted = [d for d in self._reader.devices if "pcie_tx_mbs" in d.metrics and d.slow_reader is None]
        if counted:
            wrap = min(d.pcie_wrap for d in counted)
            self.run.sampler["pcie_counter_wrap_bytes"] = wrap
            self.run.sampler["pcie_alias_above_mbs"] = (
                round(wrap / self.interval_s / 1e6, 1) if wrap == PCIE_COUNTER_WRAP else None
            )

    def _tick(self, full: bool = False) -> None:
        reader = self._reader
        devices = reader.devices
        tick = None if full else self._ticks
        # Legacy PCIe throughput (opt-in) blocks ~20 ms per call: one GPU per second, round robin.
        legacy_every = max(1, round(1.0 / self.interval_s))
        legacy_dev = (self._ticks // legacy_every) % len(devices) if self._ticks % legacy_every == 0 else -1
        lines = []
        for i, dev in enumerate(devices):
            sample, failures, calls = reader.read(dev, tick, slow=(i == legacy_dev))
            t = time.monotonic() - self._t0
            self._failures += failures
            self._calls += calls
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
        if self._reader is not None:
            self._update_pcie_note()
        gpu_ticks = self._ticks * len(self.run.gpus)
        self.run.sampler.update(
            {
                "interval_s": self.interval_s,
                "ticks": self._ticks,
                "late_ticks": self._late_ticks,
                "read_failures": self._failures,
                "nvml_calls": self._calls,
                "nvml_calls_per_gpu_tick": round(self._calls / gpu_ticks, 3) if gpu_ticks else None,
                "cpu_s": round(self._cpu_s, 6),
            }
        )

    def _write_meta(self) -> None:
        with self._lock:
            self._update_sampler_stats()
            meta = self.run.meta()
        write_json_atomic(self.out_dir / META_FILE, meta)
