"""Splitting one rank's GPU timeline into decode steps, by GPU timestamps, and lining ranks up.

CUDA-graph replays carry no CPU op names, so steps are found from the GPU side, in this order ("auto"):

1. ``annotation``: ranges that mark steps, GPU side (``gpu_user_annotation``, Kineto's projection of a CPU
   range onto the kernels it launched) or CPU side (mapped to kernels through each kernel's launch call, by
   correlation id): the profiler's ``ProfilerStep#N`` and vLLM's execute ranges first (the execute ranges where
   they outnumber the ``ProfilerStep#`` ones: one ``prof.step()`` per generate call holds many steps); else the
   user's own ``record_function`` ranges: the top-level family of names (digits aside: ``decode_step_3`` is
   ``decode_step_N``) that repeats and holds at least half of the kernels. ``--step-annotation REGEX`` picks
   the ranges instead. A step ends where its range ends, so the last annotated step is complete;
2. ``graph``: CUDA-graph replays (kernels sharing a ``cudaGraphLaunch`` correlation id). A decode step is one
   full-graph replay (SGLang) or a run of breakable / piecewise replays (vLLM breaks the graph at every
   attention). The replay kind that occurs the fewest times (at least twice) starts a step: the first piece
   of each step; kinds are told apart by their first kernel;
3. ``gap``: idle gaps on the GPU. The threshold is the largest jump in the sorted gap lengths (a gap at
   least 3x longer than the next shorter one), unless ``gap_us`` gives it. A split found this way is only
   trusted if its steps run the same kernels: an eager step has idle gaps of its own (host syncs, slow
   launches), and pieces of steps are not steps;
4. ``whole``: the whole trace is one step.

A step's window runs from its first kernel to the next step's first kernel, so the idle time between steps
belongs to the step before it and step time is the step period; a step with no following step ends with its
last kernel. Kernels before the first step, a last step no annotation closed, and steps with far fewer
kernels than the median (a trace cut mid-step) are partial; per-step statistics use complete steps only.

Ranks of one tensor-parallel group run the same steps. :func:`line_up` gives every rank of a group the step
boundaries of its most reliable rank, mapped through the collectives matched across ranks (the k-th
kernel after the i-th all-reduce on one rank is the k-th after it on another), so a rank without
annotations, or one that waited inside an all-reduce instead of idling, is split where its peers are.
A split that no method makes reliable is marked so, and the reports then show no per-step figures.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling.collectives import GroupMatch, RankCollectives
from glm5_fp4.profiling.intervals import merge
from glm5_fp4.profiling.traces import KIND_MEMCPY, KIND_MEMSET, STEP_PREFIX, RankTrace, is_engine_step

METHODS = ("auto", "annotation", "graph", "gap", "whole")
PRIORITY = {"annotation": 3, "graph": 2, "gap": 1, "whole": 0}
MIN_GAP_US = {"gpu": 20.0, "cpu": 200.0}
GAP_JUMP = 3.0
PARTIAL_KERNEL_FRACTION = 0.8
MIN_ANNOTATION_COVERAGE = 0.5  # a user's range family marks steps only if it holds this share of the kernels
ALIKE_FRACTION = 2 / 3  # gap-found steps are trusted if this share of them run the same kernels
HINT = ("pass --step-annotation REGEX (your record_function range around each step), --step-gap-us N, "
        "or --steps-by whole")


@dataclass
class StepSplit:
    method: str
    detail: str
    step_of_kernel: np.ndarray  # step index per kernel
    window_start: np.ndarray
    window_end: np.ndarray
    n_kernels: np.ndarray
    partial: np.ndarray
    first_kernel: np.ndarray  # index (time order) of each step's first kernel
    reliable: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def n_steps(self) -> int:
        return int(self.window_start.size)

    @property
    def complete(self) -> np.ndarray:
        """Indices of the steps per-step statistics use (all steps when none is complete)."""
        idx = np.flatnonzero(~self.partial)
        return idx if idx.size else np.arange(self.n_steps)


def family(name: str) -> str:
    """An annotation's name with its numbers taken out: the ranges of one kind (``decode_step_N``)."""
    return re.sub(r"\d+", "N", name)


def _split_from_first(trace: RankTrace, first, method: str, detail: str, *, partial=None,
                      tail: int | None = None, reliable: bool = True) -> StepSplit | None:
    """Steps beginning at the kernel indices ``first`` (time order).

    ``partial``: a flag per given step; by default the last step is partial (nothing says where it ends) and,
    with more than two steps, so is any with far fewer kernels than the median. ``tail``: index of the first
    kernel after the last step (a range closed it): the last step then ends with its own kernels, the
    kernels from ``tail`` on form a partial step, and only the first and last steps can be short because the
    trace cut them (ranges say where the others begin and end). Kernels before the first step form a partial
    step too.
    """
    n = trace.n_kernels
    first = np.asarray(first, dtype=np.int64)
    flags = np.zeros(first.size, dtype=bool) if partial is None else np.asarray(partial, dtype=bool).copy()
    keep = (first >= 0) & (first < n)
    first, flags = first[keep], flags[keep]
    order = np.argsort(first, kind="stable")
    first, flags = first[order], flags[order]
    distinct = np.append(first[1:] != first[:-1], True)  # of equal starts keep the last: the others are empty
    first, flags = first[distinct], flags[distinct]
    if first.size == 0:
        return None
    closed = tail is not None
    if partial is None and not closed:
        flags[-1] = True
    has_tail = closed and first[-1] < tail < n
    if has_tail:
        first, flags = np.append(first, tail), np.append(flags, True)
    if first[0] > 0:
        first, flags = np.concatenate([[0], first]), np.concatenate([[True], flags])
    step = np.searchsorted(first, np.arange(n), side="right") - 1
    counts = np.bincount(step, minlength=first.size)
    if partial is None and first.size > 2:
        med = np.median(counts[~flags]) if (~flags).any() else np.median(counts)
        short = counts < PARTIAL_KERNEL_FRACTION * med
        if closed:
            short[1:-1] = False
        flags |= short
    ws = trace.start[first]
    own_end = np.maximum.reduceat(trace.end, first)
    we = np.append(ws[1:], own_end[-1])
    if has_tail:
        we[-2] = own_end[-2]
    return StepSplit(method, detail, step.astype(np.int64), ws, we, counts, flags, first, reliable)


def _from_anchor_starts(trace: RankTrace, anchors: np.ndarray, method: str, detail: str) -> StepSplit | None:
    """Steps beginning at the first kernel at or after each of the given times."""
    first = np.searchsorted(trace.start, np.unique(anchors), side="left")
    return _split_from_first(trace, first, method, detail)


def _top_level(marks: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The ranges not inside another one, in time order."""
    out: list[tuple[float, float, str]] = []
    outer_end = -math.inf
    for mark in sorted(marks, key=lambda m: (m[0], -m[1])):
        if mark[1] <= outer_end:
            continue
        out.append(mark)
        outer_end = mark[1]
    return out


def _engine_ranges(marks: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The top-level step ranges of the profiler and the engine. A ProfilerStep# holding several of the engine's
    ranges (one prof.step() per generate call, or none in the whole capture) is no decode step: where the engine's
    ranges outnumber the ProfilerStep# ones, they are the steps."""
    profiler = _top_level([m for m in marks if m[2].startswith(STEP_PREFIX)])
    engine = _top_level([m for m in marks if is_engine_step(m[2]) and not m[2].startswith(STEP_PREFIX)])
    return engine if len(engine) > len(profiler) else _top_level(profiler + engine)


def _kernel_marks(trace: RankTrace, marks: list[tuple[float, float, str]], gpu_side: bool) -> np.ndarray | None:
    """Index of the range holding each kernel (-1: none): by the kernel's start for GPU-side ranges and for a CPU
    run's ops, by the time of its launch call for CPU-side ranges of a GPU trace."""
    bounds = np.array([(s, e) for s, e, _ in marks], dtype=np.float64).reshape(-1, 2)
    if gpu_side or trace.mode == "cpu":
        t = trace.start
    else:
        if trace.launch_corr.size == 0:
            return None
        pos = np.clip(np.searchsorted(trace.launch_corr, trace.corr), 0, trace.launch_corr.size - 1)
        found = trace.launch_corr[pos] == trace.corr
        if found.mean() < 0.5:
            return None
        t = np.where(found, trace.launch_ts[pos], np.nan)
    idx = np.searchsorted(bounds[:, 0], t, side="right") - 1
    inside = (idx >= 0) & (t <= bounds[np.clip(idx, 0, None), 1])
    return np.where(inside, idx, -1)


def _split_by_ranges(trace: RankTrace, marks: list[tuple[float, float, str]], gpu_side: bool,
                     what: str) -> tuple[StepSplit, float] | None:
    """Steps from top-level ranges, and the share of the kernels they hold."""
    owner = _kernel_marks(trace, marks, gpu_side)
    if owner is None or not (owner >= 0).any():
        return None
    held = np.flatnonzero(owner >= 0)
    _, first_pos = np.unique(owner[held], return_index=True)
    first = held[first_pos]
    last_range = owner[held[-1]]
    tail = int(np.flatnonzero(owner == last_range)[-1]) + 1
    side = "GPU" if gpu_side else ("CPU" if trace.mode == "cpu" else "CPU (kernels by launch call)")
    split = _split_from_first(trace, first, "annotation", f"{first.size} {side} ranges {what}", tail=tail)
    return (split, float(held.size / trace.n_kernels)) if split is not None else None


def annotation_families(trace: RankTrace) -> Counter:
    """How often each top-level range family occurs (the user's ranges nested in a ProfilerStep# count too)."""
    counts: Counter = Counter()
    for marks in (trace.annotations_gpu, trace.annotations_cpu):
        ours = [m for m in marks if not is_engine_step(m[2])]
        for m in _top_level(ours) + _engine_ranges(marks):
            counts[family(m[2])] += 1
        if counts:
            break  # the GPU projections repeat the CPU ranges
    return counts


def _split_by_annotation(trace: RankTrace, pattern: re.Pattern | None = None) -> StepSplit | None:
    sides = ((True, trace.annotations_gpu), (False, trace.annotations_cpu))
    if pattern is not None:
        for gpu_side, marks in sides:
            chosen = _top_level([m for m in marks if pattern.search(m[2])])
            found = _split_by_ranges(trace, chosen, gpu_side, f"matching '{pattern.pattern}'") if chosen else None
            if found is not None:
                return found[0]
        return None
    for gpu_side, marks in sides:  # the profiler's and the engine's own step ranges
        chosen = _engine_ranges(marks)
        names = sorted({family(m[2]) for m in chosen})
        found = _split_by_ranges(trace, chosen, gpu_side, " / ".join(f"'{n}'" for n in names)) if chosen else None
        if found is not None and found[0].n_steps >= 2:
            return found[0]
    best: tuple[StepSplit, float] | None = None
    for gpu_side, marks in sides:  # else the user's own: the repeating family holding the most kernels
        groups: dict[str, list[tuple[float, float, str]]] = {}
        for m in _top_level([m for m in marks if not is_engine_step(m[2])]):
            groups.setdefault(family(m[2]), []).append(m)
        for name, members in groups.items():
            if len(members) < 2:
                continue
            found = _split_by_ranges(trace, members, gpu_side, f"'{name}' (repeating top-level annotation)")
            if found is not None and found[1] >= MIN_ANNOTATION_COVERAGE and (best is None or found[1] > best[1]):
                best = found
        if best is not None:
            break
    return best[0] if best is not None else None


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


def _unlike_steps(trace: RankTrace, split: StepSplit) -> str | None:
    """Why the complete steps of a split cannot all be decode steps (None if they can): a decode step runs the
    whole model, so the steps run the same kernels (copies aside), and no kernel of the steps between the first
    and the last (short ones included: they are not cut by the trace's ends) is missing from most of them."""
    complete = np.flatnonzero(~split.partial)
    if complete.size < 2:
        return f"{complete.size} complete step(s) from idle gaps: too few to tell steps from pieces of steps"
    compute = (trace.kind != KIND_MEMCPY) & (trace.kind != KIND_MEMSET)
    mixes: Counter = Counter()
    for s in complete:
        ids, counts = np.unique(trace.name_id[(split.step_of_kernel == s) & compute], return_counts=True)
        mixes[(tuple(ids), tuple(counts))] += 1
    (modal_ids, _), alike = mixes.most_common(1)[0]
    inner = (split.step_of_kernel > 0) & (split.step_of_kernel < split.n_steps - 1) & compute
    missing = set(np.unique(trace.name_id[inner]).tolist()) - set(modal_ids)
    if missing:
        return (f"kernels such as {trace.names[min(missing)][:60]!r} run in only some of the {split.n_steps} steps "
                "found at idle gaps: they are pieces of steps, not steps")
    if alike < ALIKE_FRACTION * complete.size:
        return (f"the {complete.size} complete steps found at idle gaps do not run the same kernels "
                f"(only {alike} alike)")
    return None


def _whole(trace: RankTrace, detail: str, reliable: bool) -> StepSplit:
    n = trace.n_kernels
    return StepSplit(
        "whole", detail, np.zeros(n, dtype=np.int64), np.array([trace.start.min()]), np.array([trace.end.max()]),
        np.array([n]), np.array([True]), np.array([0]), reliable,
    )


def compile_step_annotation(pattern: str | None) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise Glm5Fp4Error(f"--step-annotation {pattern!r} is not a valid regular expression ({exc})") from None


def split_steps(trace: RankTrace, method: str = "auto", gap_us: float | None = None,
                annotation: re.Pattern | None = None) -> StepSplit:
    """One rank's steps; ``annotation`` (a compiled regex) picks the ranges that are steps."""
    if method not in METHODS:
        raise Glm5Fp4Error(f"unknown step method {method!r}; choose one of {', '.join(METHODS)}")
    if trace.n_kernels == 0:
        raise Glm5Fp4Error(f"{trace.path}: no kernels to split into steps")
    if method == "whole":
        return _whole(trace, "the whole trace as one window (--steps-by whole)", True)
    if annotation is not None:
        split = _split_by_annotation(trace, annotation)
        if split is not None:
            return split
        return _whole(trace, f"no annotation matches '{annotation.pattern}' in this trace", False)
    if gap_us is not None and method in ("auto", "gap"):
        split = _split_by_gap(trace, gap_us)
        # asked for gaps of gap_us: a trace with none is not one step, so nothing is priced per step
        return split or _whole(trace, f"no idle gap >= {gap_us:g} us: the whole trace is one window", False)
    order = {"auto": ("annotation", "graph", "gap"), "annotation": ("annotation",), "graph": ("graph",), "gap": ("gap",)}
    finders = {"annotation": _split_by_annotation, "graph": _split_by_graph, "gap": lambda t: _split_by_gap(t, None)}
    for m in order[method]:
        split = finders[m](trace)
        if split is not None and split.n_steps >= 2:
            if m == "gap":
                why = _unlike_steps(trace, split)
                if why is not None:
                    split.reliable = False
                    split.detail = f"{split.detail}; {why}"
            return split
    tried = "step annotations, graph replays or idle gaps" if method == "auto" else f"--steps-by {method}"
    return _whole(trace, f"no step boundaries found ({tried}): the whole trace is one window", False)


def _project(ref: StepSplit, ref_t: RankTrace, ref_c: RankCollectives, t: RankTrace, c: RankCollectives,
             ref_rank: int) -> StepSplit | None:
    """The reference rank's steps on another rank of its group: the k-th kernel after (or before) collective
    instance i on the reference is the k-th after (before) instance i on this rank."""
    ref_k, ref_i = ref_c.kernel_index[ref_c.matched], ref_c.instance[ref_c.matched]
    where = dict(zip(c.instance[c.matched].tolist(), c.kernel_index[c.matched].tolist()))
    if ref_k.size == 0 or not where:
        return None
    ref_names, names = ref_t.names, t.names

    def mapped(a: int) -> int | None:
        p = int(np.searchsorted(ref_k, a, side="right")) - 1
        p = max(p, 0)  # before the first collective: count back from it
        inst = int(ref_i[p])
        if inst not in where:
            return None
        b = where[inst] + (a - int(ref_k[p]))
        if not 0 <= b < t.n_kernels:
            return None
        want = ref_names[ref_t.name_id[a]]
        if names[t.name_id[b]] == want:
            return b
        for d in range(1, 8):  # a side-stream kernel can swap places with its neighbours
            for cand in (b - d, b + d):
                if 0 <= cand < t.n_kernels and names[t.name_id[cand]] == want:
                    return cand
        return None

    firsts: list[int] = []
    flags: list[bool] = []
    lost = 0
    for s in range(ref.n_steps):
        b = mapped(int(ref.first_kernel[s]))
        if b is None:
            lost += 1
            if flags:
                flags[-1] = True  # the step before now runs into this one
            continue
        firsts.append(b)
        flags.append(bool(ref.partial[s]))
    if len(firsts) < 2 or lost > ref.n_steps // 2:
        return None
    last = mapped(ref_t.n_kernels - 1)
    tail = last + 1 if last is not None else None
    if tail is None:
        flags[-1] = True
    detail = (f"{ref.n_steps} steps of rank {ref_rank} ({ref.method}: {ref.detail}), lined up through "
              f"{int(c.matched.sum())} matched collectives")
    return _split_from_first(t, firsts, ref.method, detail, partial=flags, tail=tail, reliable=True)


def line_up(traces: list[RankTrace], splits: dict[int, StepSplit], matches: list[GroupMatch]) -> list[str]:
    """Give every rank of each TP group the steps of its most reliable rank (in place); returns notes."""
    by_rank = {t.rank: t for t in traces}
    notes = []
    for m in matches:
        if len(m.ranks) < 2 or m.matched_instances == 0:
            continue
        ref = max(m.ranks, key=lambda r: (splits[r].reliable, PRIORITY[splits[r].method], -r))
        base = splits[ref]
        if not base.reliable:
            continue
        for r in m.ranks:
            own = splits[r]
            if r == ref or (own.reliable and PRIORITY[own.method] >= PRIORITY[base.method]):
                continue
            projected = _project(base, by_rank[ref], m.per_rank[ref], by_rank[r], m.per_rank[r], ref)
            if projected is None:
                notes.append(f"rank {r}: its collectives do not line up with rank {ref}'s steps; "
                             f"keeping its own ({own.method})")
                continue
            projected.notes.append(f"own step detection gave {own.method}: {own.detail}")
            splits[r] = projected
    return notes
