"""A watch on the host side of each eager MoE call, so that a request stall is named where it happens.

Served on the H200 (2026-12-01, GLM-5 at true dimensions), our servers showed first-token stalls that stock Marlin
did not: ~0.4 s on single requests in SGLang 0.5.15, 2-4 s on the first wave of 512 streams in vLLM 0.26, although
the load-time warm-up (:mod:`glm5_fp4.kernels.warmup`) had compiled every launch signature and vLLM's own JIT
monitor reported no compile of ours. A kernel launch costs microseconds of host time; a call that holds the host for
tens of milliseconds was stopped by something: a Triton compile, a full garbage collection, a device
synchronisation or an allocation. This watch times every MoE call made outside CUDA-graph capture with
``perf_counter`` (no device sync) and, for a call over ``GLM5_FP4_SLOW_CALL_MS`` (default 50; 0 switches it off),
logs one warning that says which of the first two happened during it (the kernels Triton compiled since the last
check, and whether a generation-2 collection ran); neither means the host waited on the device or the allocator.
A sampler thread (started with the first watched call; while a call is open it wakes every ``SAMPLE_S``, otherwise
it waits on an event) takes the calling thread's Python stack once a call has run past the threshold, so the
warning also shows where the host was held.

Calls replayed from a CUDA graph never run this code; the warm-up's own (compiling) calls are not reported.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch

from glm5_fp4 import envvars

ENV = "GLM5_FP4_SLOW_CALL_MS"
DEFAULT_MS = envvars.VARS[ENV].default
_LOG = logging.getLogger("glm5_fp4")
LOGGED_IN_FULL = 20  # the first slow calls are logged one by one, then every 100th
SAMPLE_S = 0.01
STACK_FRAMES = 12  # innermost frames kept


def threshold_ms() -> float:
    return envvars.number(ENV)


def compiled_kernels() -> dict[str, int]:
    """Kernels Triton has compiled in this process, per MoE kernel (its in-memory caches; cheap: a few dozen dicts)."""
    try:
        import triton
    except ImportError:  # pragma: no cover - the CPU path has no Triton kernels to compile
        return {}
    from glm5_fp4.kernels import native_fp4, triton_moe

    out: dict[str, int] = {}
    for mod in (triton_moe, native_fp4):
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.jit.JITFunction):
                caches = getattr(obj, "device_caches", None) or {}
                out[name] = sum(len(c[0]) for c in caches.values())
    return out


def _capturing() -> bool:
    # a CPU build of torch has no capture state to ask
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _gen2_collections() -> int:
    return gc.get_stats()[2]["collections"]


@dataclass
class SlowCall:
    tokens: int
    ms: float
    compiled: dict[str, int]  # kernel -> new compiles during the call
    full_gc: int  # generation-2 collections during the call
    stack: list[str] = field(default_factory=list)  # where the calling thread was once past the threshold
    after_warm_up: bool = True  # a load-time warm-up had finished in this process before the call

    def cause(self) -> str:
        parts = []
        if self.compiled:
            # Only a warm-up that ran can have missed something; a process that never ran one (selftest, a
            # script calling fused_moe) compiles on its first calls by design.
            why = ("a specialisation the load-time warm-up missed" if self.after_warm_up else
                   "no load-time warm-up has run in this process: glm5_fp4.kernels.warmup")
            parts.append("Triton compiled " + ", ".join(f"{k} x{v}" for k, v in sorted(self.compiled.items()))
                         + f" ({why})")
        if self.full_gc:
            parts.append(f"{self.full_gc} full (generation-2) garbage collection(s) ran")
        return "; ".join(parts) or ("no compile and no full garbage collection: the host waited on the device "
                                    "(a synchronisation) or on the allocator")


@dataclass
class Watch:
    """Process-wide: the compile snapshot, the counters and the log policy."""

    snapshot: dict[str, int] | None = None
    calls: int = 0
    slow: list[SlowCall] = field(default_factory=list)
    slow_count: int = 0
    quiet_depth: int = 0
    warm_ups: int = 0  # load-time warm-ups finished in this process (warmed_up)
    tokens: Counter = field(default_factory=Counter)  # eager calls per token count (the host sampler reports it)
    _open: dict = field(default_factory=dict)  # thread id -> [start, limit_s, stack or None]
    _sampler: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _wake: threading.Event = field(default_factory=threading.Event)

    def _sample(self) -> None:
        while True:
            self._wake.wait()  # asleep (no GIL wanted) while no call is open
            time.sleep(SAMPLE_S)
            now = time.perf_counter()
            with self._lock:
                if not self._open:
                    self._wake.clear()
                late = [(tid, entry) for tid, entry in self._open.items()
                        if entry[2] is None and now - entry[0] > entry[1]]
            if not late:
                continue
            frames = sys._current_frames()
            for tid, entry in late:
                frame = frames.get(tid)
                if frame is not None:
                    entry[2] = [line.rstrip() for line in traceback.format_stack(frame)[-STACK_FRAMES:]]

    def _start_sampler(self) -> None:
        with self._lock:
            if self._sampler is None:
                self._sampler = threading.Thread(target=self._sample, name="glm5_fp4-slow-calls", daemon=True)
                self._sampler.start()

    def warmed_up(self) -> None:
        """A load-time warm-up finished: later compiles are what it missed."""
        self.warm_ups += 1

    def resnapshot(self) -> None:
        self.snapshot = compiled_kernels()

    @contextlib.contextmanager
    def quiet(self):
        """Calls inside are not reported (the warm-up compiles on purpose); the snapshot is retaken after."""
        self.quiet_depth += 1
        try:
            yield
        finally:
            self.quiet_depth -= 1
            if self.quiet_depth == 0:
                self.resnapshot()

    @contextlib.contextmanager
    def call(self, tokens: int, device: torch.device):
        if self.quiet_depth or device.type != "cuda" or _capturing():
            yield
            return
        self.tokens[tokens] += 1
        limit = threshold_ms()
        if limit <= 0:
            yield
            return
        if self.snapshot is None:
            self.resnapshot()
        self.calls += 1
        if self._sampler is None:
            self._start_sampler()
        tid = threading.get_ident()
        gc0, t0 = _gen2_collections(), time.perf_counter()
        entry = [t0, limit / 1e3, None]
        with self._lock:  # the sampler iterates the open calls
            self._open[tid] = entry
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._open.pop(tid, None)
        ms = (time.perf_counter() - t0) * 1e3
        if ms > limit:
            self.record(tokens, ms, _gen2_collections() - gc0, limit, entry[2] or [])

    def record(self, tokens: int, ms: float, full_gc: int, limit: float, stack: list[str] | None = None) -> SlowCall:
        now = compiled_kernels()
        before = self.snapshot or {}
        compiled = {k: v - before.get(k, 0) for k, v in now.items() if v > before.get(k, 0)}
        self.snapshot = now
        slow = SlowCall(tokens, ms, compiled, full_gc, stack or [], after_warm_up=self.warm_ups > 0)
        self.slow_count += 1
        if len(self.slow) < 200:
            self.slow.append(slow)
        if self.slow_count <= LOGGED_IN_FULL or self.slow_count % 100 == 0:
            where = ("\n  where the host was past the threshold (innermost last):\n" + "\n".join(slow.stack)
                     if slow.stack else "")
            _LOG.warning("glm5_fp4: an MoE call of %d tokens held the host %.0f ms (over %s=%g; slow call %d of "
                         "%d watched): %s%s", tokens, ms, ENV, limit, self.slow_count, self.calls, slow.cause(), where)
        return slow


WATCH = Watch()
