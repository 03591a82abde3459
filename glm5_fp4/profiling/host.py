"""What the host was doing in each decode step: the CPU-side ``record_function`` ranges (``user_annotation``).

A GPU that idles most of a step is waiting for the host; the engine's own ranges say where the host's time
went: SGLang's ``scheduler.run_batch`` / ``scheduler.process_batch_result`` / ..., vLLM's
``execute_context_...`` (the worker's ``execute_model``) and, with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``,
``gpu_model_runner: ...`` / ``llm_engine step: ...``. Per rank:

- only the thread that launched the steps' first kernels counts (a trace can hold other threads' ranges);
  ``ProfilerStep#`` ranges are left out: the profiler writes them around the whole step;
- a step's host side runs from the start of the outermost range around the launch of its first kernel (that
  holds no neighbouring step's first launch) to the same point of the next step; without launch calls in the
  trace, from the step's first kernel. Aligning on the launch keeps the call that launched a step's graph in
  that step, not in the step before it, whose GPU window it starts in (the host runs ahead of the GPU);
- a range belongs to the step in whose host side it starts, with its whole duration (not clipped), so every
  call is counted once;
- ranges of one kind are added up per step: the name with its numbers taken out (``step[DECODE bs=N]``);
- a range enclosing others (``scheduler.run_batch`` holds the graph launch) keeps its whole duration and is
  marked as enclosing; its self time (duration minus the ranges directly inside it) is given too, so self
  times of nested ranges never count an instant twice;
- figures are medians over the complete steps whose host side the next step's start closes.

``python_function`` events (``with_stack`` / Python tracing) are counted: where they exist the profiler hooked
every Python call and the host times above are inflated by its overhead.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from glm5_fp4.profiling.steps import StepSplit, family
from glm5_fp4.profiling.traces import STEP_PREFIX, RankTrace

TOP_RANGES = 10


def _first_launches(trace: RankTrace, split: StepSplit) -> tuple[np.ndarray, np.ndarray]:
    """Launch time and thread of each step's first kernel (NaN / -1 where the trace has no launch call for it)."""
    corr = trace.corr[split.first_kernel]
    ts = np.full(corr.size, np.nan)
    thread = np.full(corr.size, -1, dtype=np.int64)
    if trace.launch_corr.size and trace.launch_thread is not None:
        pos = np.clip(np.searchsorted(trace.launch_corr, corr), 0, trace.launch_corr.size - 1)
        found = (trace.launch_corr[pos] == corr) & (corr >= 0)
        ts[found] = trace.launch_ts[pos[found]]
        thread[found] = trace.launch_thread[pos[found]]
    return ts, thread


def _launching_thread(trace: RankTrace, first_threads: np.ndarray, ranges: list) -> tuple[int, str]:
    known = first_threads[first_threads >= 0]
    if known.size:
        return int(np.bincount(known).argmax()), "launched the steps' first kernels"
    if trace.launch_thread is not None and trace.launch_thread.size:
        return int(np.bincount(trace.launch_thread).argmax()), "made the most launch calls"
    return Counter(r[3] for r in ranges).most_common(1)[0][0], "holds the most ranges (no launch calls in the trace)"


def _host_starts(launch: np.ndarray, s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Per step, the start of the outermost range around its first launch that holds no neighbour's first launch."""
    n = launch.size
    out = launch.copy()
    for i in range(n):
        lo = launch[i - 1] if i > 0 else -np.inf
        hi = launch[i + 1] if i + 1 < n else np.inf
        around = (s <= launch[i]) & (e >= launch[i]) & (s > lo) & (e < hi)
        if around.any():
            out[i] = s[around].min()
    return np.maximum.accumulate(out)  # a step's host side cannot begin before the previous one's


def _self_times(s: np.ndarray, e: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Self time of each range (duration minus the ranges directly inside it) and each range's parent (-1: none).

    record_function ranges of one thread nest like the calls they wrap; a range that overlaps another without
    fitting inside it (an async range) is nobody's child."""
    self_us = dur.copy()
    parent = np.full(s.size, -1, dtype=np.int64)
    stack: list[int] = []
    eps = 1e-6  # start + duration of a child ending with its parent can round past the parent's end
    for i in np.lexsort((-e, s)):  # by start, the longer of equal starts first: parents before children
        while stack and e[i] > e[stack[-1]] + eps:  # not inside the top (ended, or overlapping): look further out
            stack.pop()
        if stack:
            parent[i] = stack[-1]
            self_us[stack[-1]] -= dur[i]
        stack.append(int(i))
    return np.maximum(self_us, 0.0), parent


def host_side(trace: RankTrace, split: StepSplit, step_time_us: float | None) -> dict:
    """The host-side ranges per decode step of one rank (see the module docstring); ``step_time_us``: the
    median step the shares are of (None: steps not reliable, no per-step figures)."""
    out: dict = {
        "thread": None,
        "thread_is": None,  # why that thread: the one that launched the steps' first kernels, ...
        "steps_used": 0,
        "host_step_us": None,
        "outside_ranges_us": None,  # host step minus its top-level ranges: host time no range accounts for
        "python_function_events": int(trace.n_python_events),
        "ranges": [],
        "other_thread_ranges": 0,
        "notes": [],
    }
    ranges = [r for r in trace.host_ranges if not r[2].startswith(STEP_PREFIX)]
    if not ranges:
        out["notes"].append("no host ranges in the trace (no CPU-side user_annotation besides ProfilerStep#)")
        return out
    if step_time_us is None:
        out["notes"].append("no reliable step boundaries: host ranges per step withheld")
        return out

    launch, first_threads = _first_launches(trace, split)
    thread, why = _launching_thread(trace, first_threads, ranges)
    out["thread"] = trace.threads[thread] if thread < len(trace.threads) else str(thread)
    out["thread_is"] = f"the thread that {why}"
    mine = [r for r in ranges if r[3] == thread]
    out["other_thread_ranges"] = len(ranges) - len(mine)
    if not mine:
        out["notes"].append("no host ranges on the launching thread")
        return out
    if np.isnan(launch).any():
        out["notes"].append(f"{int(np.isnan(launch).sum())} step(s) without a launch call for their first "
                            "kernel: their host side starts at that kernel")
    launch = np.where(np.isnan(launch), trace.start[split.first_kernel], launch)

    s = np.array([r[0] for r in mine])
    dur = np.array([r[1] for r in mine])
    e = s + dur
    kinds = [family(r[2]) for r in mine]
    h = _host_starts(launch, s, e)
    step = np.searchsorted(h, s, side="right") - 1
    # the last step's host side has no closing start: use it only when it is the one complete step
    used = [int(i) for i in split.complete if i + 1 < split.n_steps] or [int(i) for i in split.complete]
    self_us, parent = _self_times(s, e, dur)

    slot = {st: k for k, st in enumerate(used)}
    names: dict[str, set[str]] = {}
    total: dict[str, np.ndarray] = {}
    own: dict[str, np.ndarray] = {}
    calls: dict[str, np.ndarray] = {}
    inner: dict[str, Counter] = {}
    top_level = np.zeros(len(used))
    for i, kind in enumerate(kinds):
        if parent[i] >= 0:
            inner.setdefault(kinds[parent[i]], Counter())[kind] += dur[i]
        k = slot.get(int(step[i]))
        if k is None:
            continue
        if kind not in total:
            total[kind], own[kind], calls[kind] = np.zeros(len(used)), np.zeros(len(used)), np.zeros(len(used))
            names[kind] = set()
        names[kind].add(mine[i][2])
        total[kind][k] += dur[i]
        own[kind][k] += self_us[i]
        calls[kind][k] += 1
        if parent[i] < 0 or step[parent[i]] != step[i]:  # outermost in its step (a loop-long range holds them all)
            top_level[k] += dur[i]

    def shown(kind: str) -> str:  # the name itself when every range of the kind has the same one
        return next(iter(names[kind])) if len(names[kind]) == 1 else kind

    ends = np.append(h[1:], np.inf)
    window = np.array([ends[i] - h[i] for i in used])
    out["steps_used"] = len(used)
    if np.isfinite(window).all():
        out["host_step_us"] = float(np.median(window))
        out["outside_ranges_us"] = float(np.median(np.maximum(window - top_level, 0.0)))
    rows = []
    for kind in total:
        per_step = float(np.median(total[kind]))
        rows.append({
            "name": shown(kind),
            "us_per_step": per_step,
            "self_us_per_step": float(np.median(own[kind])),
            "calls_per_step": float(np.median(calls[kind])),
            "share_of_step": per_step / step_time_us if step_time_us > 0 else None,
            "encloses": [shown(c) for c, _ in inner.get(kind, Counter()).most_common() if c in total],
        })
    out["ranges"] = sorted(rows, key=lambda r: (-r["us_per_step"], r["name"]))
    if out["other_thread_ranges"]:
        out["notes"].append(f"{out['other_thread_ranges']} range(s) on other threads not counted")
    return out
