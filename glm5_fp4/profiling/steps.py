"""Splitting one rank's GPU timeline into decode steps, by GPU timestamps.

CUDA-graph replays carry no CPU op names, so steps are found from the GPU side, in this order ("auto"):

1. ``annotation``: ``ProfilerStep#N`` windows projected on the GPU (``gpu_user_annotation``), or CPU
   ``ProfilerStep#N`` ranges mapped to kernels through the launch call's correlation id;
2. ``graph``: CUDA-graph replays (kernels sharing a ``cudaGraphLaunch`` correlation id). A decode step is one
   full-graph replay (SGLang) or a run of breakable / piecewise replays (vLLM breaks the graph at every
   attention). The replay kind that occurs the fewest times (at least twice) starts a step: the first piece
   of each step; kinds are told apart by their first kernel;
3. ``gap``: idle gaps on the GPU. The threshold is the largest jump in the sorted gap lengths (a gap at
   least 3x longer than the next shorter one), unless ``gap_us`` gives it;
4. ``whole``: the whole trace is one step.

A step's window runs from its first kernel to the next step's first kernel, so the idle time between steps
belongs to the step before it and step time is the step period. The last step has no following step and
steps with far fewer kernels than the median (a trace cut mid-step) are marked partial; per-step statistics
use complete steps only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling.intervals import merge
from glm5_fp4.profiling.traces import RankTrace

METHODS = ("auto", "annotation", "graph", "gap", "whole")
MIN_GAP_US = {"gpu": 20.0, "cpu": 200.0}
GAP_JUMP = 3.0
PARTIAL_KERNEL_FRACTION = 0.8


@dataclass
class StepSplit:
    method: str
    detail: str
    step_of_kernel: np.ndarray  # step index per kernel
    window_start: np.ndarray
    window_end: np.ndarray
    n_kernels: np.ndarray
    partial: np.ndarray
    notes: list[str] = field(default_factory=list)

    @property
    def n_steps(self) -> int:
        return int(self.window_start.size)

    @property
    def complete(self) -> np.ndarray:
        """Indices of the steps per-step statistics use (all steps when none is complete)."""
        idx = np.flatnonzero(~self.partial)
        return idx if idx.size else np.arange(self.n_steps)


def _from_anchor_starts(trace: RankTrace, anchors: np.ndarray, method: str, detail: str) -> StepSplit:
    """Steps beginning at the given times; kernels before the first anchor form a leading partial step."""
    start, end = trace.start, trace.end
    anchors = np.unique(anchors)
    if anchors.size == 0 or anchors[0] > start[0]:
        anchors = np.concatenate([[start[0]], anchors])
        leading_partial = True
    else:
        leading_partial = False
    step = np.searchsorted(anchors, start, side="right") - 1
    step = np.clip(step, 0, anchors.size - 1)
    n = np.bincount(step, minlength=anchors.size)
    keep = n > 0
    if not keep.all():  # drop anchors with no kernels and renumber
        remap = np.cumsum(keep) - 1
        step = remap[step]
        anchors = anchors[keep]
        n = n[keep]
        leading_partial = leading_partial and bool(keep[0])
    ws = _first_start(step, start, anchors.size)
    last_end = float(end.max())
    we = np.append(ws[1:], last_end)
    partial = np.zeros(anchors.size, dtype=bool)
    partial[-1] = True
    if leading_partial:
        partial[0] = True
    if anchors.size > 2:
        med = np.median(n[~partial]) if (~partial).any() else np.median(n)
        partial |= n < PARTIAL_KERNEL_FRACTION * med
    return StepSplit(method, detail, step.astype(np.int64), ws, we, n, partial)


def _first_start(step: np.ndarray, start: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, np.inf)
    np.minimum.at(out, step, start)
    return out


def _split_by_annotation(trace: RankTrace) -> StepSplit | None:
    if trace.step_marks_gpu:
        anchors = np.array([s for s, _, _ in trace.step_marks_gpu])
        return _from_anchor_starts(trace, anchors, "annotation", f"{len(anchors)} GPU ProfilerStep# ranges")
    if not trace.step_marks_cpu:
        return None
    if trace.launch_corr.size == 0:
        # A CPU run: its "kernels" are the CPU ops themselves, so each step starts at its annotation.
        marks = np.array(sorted((s, e) for s, e, _ in trace.step_marks_cpu))
        starts = np.sort(trace.start)
        first = np.searchsorted(starts, marks[:, 0])  # first op starting inside each annotation
        ok = first < starts.size
        ok[ok] &= starts[first[ok]] <= marks[ok, 1]
        anchors = starts[first[ok]]
        if anchors.size == 0:
            return None
        return _from_anchor_starts(trace, anchors, "annotation", f"{len(anchors)} CPU step annotations")
    # map each kernel to the CPU step range that contains its launch call
    marks = np.array([(s, e) for s, e, _ in trace.step_marks_cpu])
    pos = np.searchsorted(trace.launch_corr, trace.corr)
    pos = np.clip(pos, 0, max(trace.launch_corr.size - 1, 0))
    found = trace.launch_corr[pos] == trace.corr
    if found.mean() < 0.5:
        return None
    launch_t = np.where(found, trace.launch_ts[pos], np.nan)
    idx = np.searchsorted(marks[:, 0], launch_t, side="right") - 1
    inside = found & (idx >= 0) & (launch_t <= marks[np.clip(idx, 0, None), 1])
    if not inside.any():
        return None
    anchors = [trace.start[inside & (idx == i)].min() for i in np.unique(idx[inside])]
    return _from_anchor_starts(trace, np.array(anchors), "annotation", f"{len(anchors)} CPU ProfilerStep# ranges (by launch)")


def _split_by_graph(trace: RankTrace) -> StepSplit | None:
    corr = trace.corr
    if trace.graph_corrs.size:
        in_graph = np.isin(corr, trace.graph_corrs)
    else:  # no runtime events kept: a correlation id shared by several kernels is a graph replay
        uniq, counts = np.unique(corr[corr >= 0], return_counts=True)
        in_graph = np.isin(corr, uniq[counts > 1])
    if in_graph.sum() < 2:
        return None
    g_corr = corr[in_graph]
    g_start = trace.start[in_graph]
    g_name = trace.name_id[in_graph]
    replay_ids, first_idx = np.unique(g_corr, return_index=True)  # kernels are time-sorted: first index = first kernel
    if replay_ids.size < 3:
        return None
    first_name = g_name[first_idx]
    replay_start = g_start[first_idx]
    kinds, kind_counts = np.unique(first_name, return_counts=True)
    usable = kind_counts >= 2
    if not usable.any():
        return None
    rarest = kinds[usable][np.argmin(kind_counts[usable])]
    anchors = replay_start[first_name == rarest]
    if anchors.size < 3:
        return None
    label = trace.names[int(rarest)]
    detail = f"{replay_ids.size} graph replays; step starts at the replay beginning with {label[:60]!r} ({anchors.size}x)"
    return _from_anchor_starts(trace, anchors, "graph", detail)


def _split_by_gap(trace: RankTrace, gap_us: float | None) -> StepSplit | None:
    ms, me = merge(trace.start, trace.end)
    if ms.size < 2:
        return None
    gaps = ms[1:] - me[:-1]
    if gap_us is None:
        floor = MIN_GAP_US[trace.mode]
        # a trailing zero stands for the back-to-back kernels: all gaps may be step gaps
        ordered = np.append(np.sort(gaps)[::-1], 0.0)
        if ordered[0] < floor:
            return None
        lower = np.maximum(ordered[1:], 0.5)
        ratio = ordered[:-1] / lower
        ok = np.flatnonzero((ratio >= GAP_JUMP) & (ordered[:-1] >= floor))
        if ok.size == 0:
            return None
        # the cut with the fewest boundaries that still yields >= 3 segments (one stray long pause would
        # otherwise give two "steps"); fall back to the first jump
        k = next((int(i) for i in ok if i + 2 >= 3), int(ok[0]))
        threshold = float(np.sqrt(ordered[k] * max(ordered[k + 1], 0.5)))
        detail = f"idle gaps >= {threshold:.1f} us (auto: the largest jump in gap lengths)"
    else:
        threshold = float(gap_us)
        detail = f"idle gaps >= {threshold:.1f} us (given)"
    anchors = ms[1:][gaps >= threshold]
    if anchors.size == 0:
        return None
    return _from_anchor_starts(trace, np.concatenate([[ms[0]], anchors]), "gap", detail)


def _whole(trace: RankTrace) -> StepSplit:
    n = trace.n_kernels
    return StepSplit(
        "whole",
        "no step boundaries found: the whole trace is one window",
        np.zeros(n, dtype=np.int64),
        np.array([trace.start.min()]),
        np.array([trace.end.max()]),
        np.array([n]),
        np.array([True]),
    )


def split_steps(trace: RankTrace, method: str = "auto", gap_us: float | None = None) -> StepSplit:
    if method not in METHODS:
        raise Glm5Fp4Error(f"unknown step method {method!r}; choose one of {', '.join(METHODS)}")
    if trace.n_kernels == 0:
        raise Glm5Fp4Error(f"{trace.path}: no kernels to split into steps")
    if method == "whole":
        return _whole(trace)
    if gap_us is not None and method in ("auto", "gap"):
        split = _split_by_gap(trace, gap_us)
        return split or _whole(trace)
    order = {"auto": ("annotation", "graph", "gap"), "annotation": ("annotation",), "graph": ("graph",), "gap": ("gap",)}
    for m in order[method]:
        split = {"annotation": _split_by_annotation, "graph": _split_by_graph, "gap": lambda t: _split_by_gap(t, None)}[m](trace)
        if split is not None and split.n_steps >= 2:
            return split
    whole = _whole(trace)
    if method != "auto":
        whole.notes.append(f"{trace.path.name}: step method {method!r} found no steps; using the whole trace")
    return whole
