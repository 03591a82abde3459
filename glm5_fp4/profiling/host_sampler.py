"""A sampling profiler of the host side of a server process: what each Python thread was doing, every few ms.

Why: served on the H200 (vLLM 0.26, GLM-5 at true dimensions, 2026-12-01), our servers stopped delivering tokens for
~1.5 s at a time with the GPU idle, stock Marlin's did not, and the GPU-side tools (traces, layer timers) see nothing
when nothing runs on the GPU. The question is what the host was doing then; this answers it for every process the
engine starts, at a cost a diagnostic run can pay.

``GLM5_FP4_HOST_SAMPLES=DIR`` (read by both engine plugins at registration, in every process they load into; forked
children restart it) starts one daemon thread per process that, every ``GLM5_FP4_HOST_SAMPLE_MS`` (default 20 ms):

* takes every other thread's Python stack (``sys._current_frames``) and stores it run-length encoded per thread
  (an idle thread waiting on a queue is one record however long it waits);
* notes when it itself woke late: a wake-up that came over :data:`LATE_MS` after it was due means no Python code
  could run in the process for that long (a C call holding the GIL, the process descheduled);
* every :data:`CPU_EVERY_MS`, reads each thread's CPU time from ``/proc/self/task/<tid>/schedstat`` (``stat``
  where the kernel has no schedstat), so a stack can be told apart as running (Python code, or a spin-wait such
  as CUDA's default synchronisation) or blocked (a C call that sleeps, e.g. ``time.sleep`` from Python, which the
  Python stack alone cannot show);
* records every garbage collection (generation, duration, objects collected) through ``gc.callbacks``;
* and, every :data:`FLUSH_S` and at exit, appends what it gathered to ``DIR/host-<pid>-<start ms>.jsonl`` (process name,
  command line, the eager MoE calls per token count of :mod:`glm5_fp4.kernels.slow_calls`).

``glm5-fp4 profile stalls DIR [--requests FILE]`` (:mod:`glm5_fp4.profiling.stalls`) reads the files: per process,
the threads' busy stacks, GC pauses, late wake-ups, and, with a load test's per-request records, what each process
was doing in the windows where no token reached any client.

Overhead: a sample walks the frames of every thread while holding the GIL (tens of µs for a few dozen threads), and a
thread that wants the GIL makes the running one hand it over at its next switch interval. vLLM 0.26's engine core is
host-bound at small batches, and with 5 ms sampling its decode steps at 1-8 streams took ~8.5-9.5 ms on the H200 where
runs without the sampler took ~5-7 ms (different runs, both servers alike; 2026-12-01). Hence the 20 ms default: a 1 s
stall still gets ~50 samples. A diagnostic: find causes with it, take throughput numbers without it.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from glm5_fp4 import envvars

ENV = "GLM5_FP4_HOST_SAMPLES"
INTERVAL_ENV = "GLM5_FP4_HOST_SAMPLE_MS"
DEFAULT_INTERVAL_MS = envvars.VARS[INTERVAL_ENV].default
LATE_MS = 50.0  # a wake-up this much past due is recorded as a gap in which no Python code ran
FLUSH_S = 2.0
CPU_EVERY_MS = 100.0
MAX_FRAMES = 48  # innermost frames kept per stack
FILE_PREFIX = "host-"
_LOG = logging.getLogger("glm5_fp4")


def _interval_ms() -> float:
    return envvars.number(INTERVAL_ENV)


def _comm() -> str:
    try:
        return Path("/proc/self/comm").read_text().strip()
    except OSError:  # not Linux
        return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"


# Linux's CPU clock of one thread of this process, by its kernel id (the kernel's MAKE_THREAD_CPUCLOCK: the id
# complemented and shifted, then the per-thread bit and CPUCLOCK_SCHED)
_THREAD_CPUCLOCK = 0b110


def thread_cpu_ns(native_id: int) -> int | None:
    """CPU time a thread of this process has used (ns), or None once it has ended.

    Read through the thread's CPU clock, a call that keeps the GIL. The /proc files read before gave the GIL up and
    took it back once per thread, and behind a main thread running Python each retake waits a switch interval
    (5 ms): with 60 threads alive one pass over them took ~600 ms, in which no stack was sampled."""
    try:
        return time.clock_gettime_ns(((~native_id) << 3) | _THREAD_CPUCLOCK)
    except OSError:  # EINVAL: no such thread in this process any more
        return None


def _live_threads() -> dict[int, threading.Thread]:
    return {t.ident: t for t in threading.enumerate() if t.ident is not None}


def _key(ident: int | None, live: dict[int, threading.Thread]) -> int | None:
    """A thread's key in the file: the kernel's thread id where Python knows it. Python's ident is the address of
    the thread's pthread structure, which glibc hands to the next thread (pool workers get the same one every
    time), so keyed by ident two threads shared a name, a run of stacks and one CPU curve that fell back to 0.
    A thread Python did not start (no Thread object) keeps its ident: addresses and kernel ids do not meet."""
    t = live.get(ident)
    native = getattr(t, "native_id", None)
    return ident if native is None else native


def _stack(frame) -> tuple:
    out = []
    while frame is not None and len(out) < MAX_FRAMES:
        code = getattr(frame, "f_code", None)
        if code is None:  # seen in vLLM's worker under torch.compile: a frame chain ending in a code object
            out.append(("<unknown>", type(frame).__name__, 0))
            break
        out.append((code.co_filename, code.co_name, frame.f_lineno or 0))
        frame = frame.f_back
    return tuple(out)


class HostSampler:
    """One per process (see :func:`start`); ``sample_once`` and ``flush`` are separate so tests can drive them."""

    def __init__(self, folder: Path, interval_ms: float):
        self.folder = folder
        self.interval = interval_ms / 1e3
        self.pid = os.getpid()
        # the wall clock read once, for the file's t0 (processes' files share it); every time after it is the
        # monotonic clock's, so an NTP or VM clock step neither reverses runs nor invents gaps
        self.t0 = time.time()
        self._m0 = time.monotonic()
        # the start time in the name: a reused pid (containers restart the engine as pid 1, 7, ...) gets a file of
        # its own instead of appending a second run, with stack ids from 0 again, to the first's
        self.path = folder / f"{FILE_PREFIX}{self.pid}-{int(self.t0 * 1e3)}.jsonl"
        self._header_written = False
        self._stack_ids: dict[tuple, int] = {}
        self._new_stacks: dict[int, list] = {}
        self._open: dict[int, list] = {}  # tid -> [stack id, first ms, last ms, samples, weight ms]
        self._closed: list[list] = []
        self._gaps: list[list] = []
        self._gcs: list[list] = []
        self._cpu: list[list] = []  # [ms, {tid: cpu ns}]
        self._next_cpu = 0.0
        self._gc_start: float | None = None
        self._threads: dict[int, str | None] = {}  # thread key -> the name last written
        self._pending_names: dict[int, str] = {}  # names seen by a sample, for the next flush
        self._comm: str | None = None  # the process name last written
        # re-entrant: a collection can start inside sample_once (it allocates) and its callback takes the lock too
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_wake: float | None = None
        self.samples = 0

    # -- clock: ms since t0 (monotonic since the wall-clock t0), so files of different processes share one time base
    def _ms(self, t: float | None = None) -> float:
        return round(((time.monotonic() if t is None else t) - self._m0) * 1e3, 3)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.monotonic()
        elif self._gc_start is not None:
            start, self._gc_start = self._gc_start, None
            with self._lock:
                self._gcs.append([self._ms(start), round((time.monotonic() - start) * 1e3, 3), info.get("generation", -1),
                                  info.get("collected", 0)])

    def sample_once(self) -> None:
        now = time.monotonic()
        ms = self._ms(now)
        me = threading.get_ident()
        frames = sys._current_frames()
        live = _live_threads()
        with self._lock:
            # each sample stands for the time since the one before (a busy thread that held the GIL longer than
            # the interval was seen less often but for longer)
            weight = self.interval * 1e3 if self._last_wake is None else (now - self._last_wake) * 1e3
            if self._last_wake is not None:
                late = (now - self._last_wake - self.interval) * 1e3
                if late > LATE_MS:
                    self._gaps.append([self._ms(self._last_wake), round(late, 3)])
            self._last_wake = now
            seen = set()
            for ident, frame in frames.items():
                if ident == me:
                    continue
                tid = _key(ident, live)
                if tid not in self._threads and ident in live:
                    self._threads[tid] = None  # named at the next flush, even if it ends before that
                    self._pending_names[tid] = live[ident].name
                seen.add(tid)
                key = _stack(frame)
                sid = self._stack_ids.get(key)
                if sid is None:
                    sid = self._stack_ids[key] = len(self._stack_ids)
                    self._new_stacks[sid] = [list(f) for f in key]
                run = self._open.get(tid)
                if run is not None and run[0] == sid:
                    run[2] = ms
                    run[3] += 1
                    run[4] = round(run[4] + weight, 3)
                    continue
                if run is not None:
                    self._closed.append([tid, *run])
                self._open[tid] = [sid, ms, ms, 1, round(weight, 3)]
            for tid in [t for t in self._open if t not in seen]:  # the thread ended
                self._closed.append([tid, *self._open.pop(tid)])
            self.samples += 1
        if now >= self._next_cpu:
            self._next_cpu = now + CPU_EVERY_MS / 1e3
            cpu = {}
            for ident, t in live.items():
                if ident != me and t.native_id is not None:
                    ns = thread_cpu_ns(t.native_id)
                    if ns is not None:
                        cpu[str(t.native_id)] = ns
            if cpu:
                with self._lock:
                    self._cpu.append([ms, cpu])

    def _thread_names(self) -> dict[int, str]:
        live = _live_threads()
        with self._lock:  # the sampling thread adds names under it: none is dropped between the read and the reset
            pending, self._pending_names = self._pending_names, {}
        names = {**pending, **{_key(i, live): t.name for i, t in live.items()}}
        main = _key(threading.main_thread().ident, live)
        if main is not None:
            names[main] = "MainThread"
        return names

    def _watch_calls(self) -> dict:
        mod = sys.modules.get("glm5_fp4.kernels.slow_calls")
        if mod is None:
            return {}
        return {str(k): v for k, v in sorted(mod.WATCH.tokens.items())}

    def flush(self, final: bool = False) -> None:
        with self._lock:
            # every flush writes the open runs as they stand (the next sample opens new ones): a call that hangs
            # until the process is killed is on disk up to the last flush
            self._closed.extend([tid, *run] for tid, run in self._open.items())
            self._open.clear()
            stacks, self._new_stacks = self._new_stacks, {}
            runs, self._closed = self._closed, []
            gaps, self._gaps = self._gaps, []
            gcs, self._gcs = self._gcs, []
            cpu, self._cpu = self._cpu, []
        names = self._thread_names()
        new_names = {tid: n for tid, n in names.items() if self._threads.get(tid) != n}
        self._threads.update(new_names)
        lines = []
        if not self._header_written:
            self._header_written = True
            lines.append({"kind": "process", "pid": self.pid, "ppid": os.getppid(), "comm": _comm(),
                          "argv": sys.argv[:8], "main_tid": _key(threading.main_thread().ident, _live_threads()),
                          "t0_unix": self.t0, "interval_ms": self.interval * 1e3, "late_ms": LATE_MS})
        comm = _comm()
        if comm != self._comm:  # engines rename their processes after start-up
            lines.append({"kind": "comm", "comm": comm})
            self._comm = comm
        if new_names:
            lines.append({"kind": "threads", "threads": {str(k): v for k, v in new_names.items()}})
        if stacks:
            lines.append({"kind": "stacks", "stacks": {str(k): v for k, v in stacks.items()}})
        if runs:
            lines.append({"kind": "runs", "runs": runs})
        if gaps:
            lines.append({"kind": "gaps", "gaps": gaps})
        if gcs:
            lines.append({"kind": "gc", "gc": gcs})
        if cpu:
            lines.append({"kind": "cpu", "cpu": cpu})
        calls = self._watch_calls()
        if calls:
            lines.append({"kind": "moe_calls", "calls": calls})
        lines.append({"kind": "end" if final else "flush", "t_ms": self._ms(), "samples": self.samples})
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))

    def _loop(self) -> None:
        next_flush = time.monotonic() + FLUSH_S
        errors = 0
        while not self._stop.wait(self.interval):
            try:
                self.sample_once()
                if time.monotonic() >= next_flush:
                    self.flush()
                    next_flush = time.monotonic() + FLUSH_S
            except Exception:  # noqa: BLE001 - a diagnostic must never take the server down, nor stop at one odd frame
                errors += 1
                if errors == 1:
                    _LOG.exception("glm5_fp4: host sampler: a sample failed (further failures are counted)")
                if errors >= 1000:
                    _LOG.error("glm5_fp4: host sampler stopped after %d failed samples", errors)
                    return

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._loop, name="glm5_fp4-host-sampler", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """Stop sampling and write the final records (idempotent; registered with atexit)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        try:
            gc.callbacks.remove(self._on_gc)
        except ValueError:
            pass
        if os.getpid() == self.pid:  # a forked child must not write its parent's file
            self.flush(final=True)


_SAMPLER: HostSampler | None = None
_START_LOCK = threading.Lock()


def start(folder: str | Path, interval_ms: float | None = None) -> HostSampler:
    """Start this process's sampler writing under ``folder`` (once per process; a forked child starts its own)."""
    global _SAMPLER
    with _START_LOCK:
        if _SAMPLER is not None and _SAMPLER.pid == os.getpid():
            return _SAMPLER
        _SAMPLER = HostSampler(Path(folder), interval_ms or _interval_ms())
        _SAMPLER.start()
        _LOG.info("glm5_fp4: host sampler every %.1f ms -> %s", _SAMPLER.interval * 1e3, _SAMPLER.path)
        return _SAMPLER


def _restart_in_child() -> None:
    global _SAMPLER
    parent = _SAMPLER
    if parent is None:
        return
    _SAMPLER = None  # the parent's thread did not survive the fork; its buffers are the parent's to write
    start(parent.folder, parent.interval * 1e3)


def start_from_env() -> HostSampler | None:
    """What the engine plugins call: start when ``GLM5_FP4_HOST_SAMPLES`` names a folder, else nothing."""
    folder = os.environ.get(ENV, "").strip()
    if not folder:
        return None
    return start(folder)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restart_in_child)
