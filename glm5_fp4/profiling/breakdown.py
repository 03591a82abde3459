"""Decode-time breakdown of torch-profiler traces: per rank, per step and across ranks.

For every rank: kernels classified by the taxonomy; the timeline split into decode steps; per category the
summed kernel time and the exposed (non-overlapped) time; idle time; step time; the host-side ranges per step
(:mod:`glm5_fp4.profiling.host`). All-reduce kernels are split
into wait (for the last rank to arrive) and work across the ranks of each tensor-parallel group. Categories'
summed times add up to the total kernel time; exposed times plus idle add up to the step window.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling.collectives import GroupMatch, match_group
from glm5_fp4.profiling.host import host_side
from glm5_fp4.profiling.intervals import covered_in_windows, exposed_by_priority, merge
from glm5_fp4.profiling.steps import HINT, StepSplit, annotation_families, compile_step_annotation, line_up, split_steps
from glm5_fp4.profiling.taxonomy import ALLREDUCE_WAIT, UNKNOWN_LABEL, Taxonomy, load_taxonomy
from glm5_fp4.profiling.traces import RankTrace, load_rank_traces, vllm_step_batch

TOP_KERNELS = 8


@dataclass
class KernelRow:
    name: str
    category: str
    label: str
    count: int
    total_us: float
    mean_us: float


@dataclass
class StepRow:
    index: int
    start_us: float
    time_us: float
    n_kernels: int
    partial: bool
    idle_us: float
    summed_us: dict[str, float]
    exposed_us: dict[str, float]
    batch: dict[str, int] | None = None  # what vLLM's execute range over the step names (traces.vllm_step_batch)
    # an all-reduce of this step has no counterpart on some rank of its group (that rank's trace did not capture
    # the step): its wait cannot be told from work, so it counts as work; left out of the median step and p90
    allreduce_unmatched: bool = False


@dataclass
class RankBreakdown:
    rank: int
    file: str
    rank_source: str
    tp_rank: int | None
    pp_rank: int | None
    mode: str
    device_name: str | None
    n_kernels: int
    trace_window_us: float
    total_kernel_us: float
    summed_us: dict[str, float]
    exposed_us: dict[str, float]
    idle_us: float
    step_method: str
    step_detail: str
    steps_reliable: bool  # False: no method found trustworthy steps; per-step figures are withheld
    n_steps: int
    n_complete_steps: int
    median_step: dict | None  # time_us, idle_us, n_kernels, summed_us{}, exposed_us{}; None if not reliable
    p90_step_time_us: float | None
    steps: list[StepRow]
    allreduce: dict  # kernels, matched, wait_us, work_us, clock_skew_us
    top_kernels: dict[str, list[KernelRow]]
    unknown_kernels: list[KernelRow]
    notes: list[str] = field(default_factory=list)
    host: dict | None = None  # CPU-side ranges per decode step (profiling.host)
    world_size: int | None = None  # the capture's rank count (distributedInfo), where the trace says it
    prefill_only: bool = False  # no step holds a decode request (vLLM's execute ranges, SGLang's EXTEND traces)


@dataclass
class Breakdown:
    source: str
    mode: str
    categories: list[str]
    exposed_priority: list[str]
    taxonomy: str
    ranks: list[RankBreakdown]
    across_ranks: dict
    collective_groups: list[dict]
    notes: list[str] = field(default_factory=list)
    ceilings: dict | None = None
    prefill_only: bool = False  # every rank's: the steps are prefill forwards, the ceilings (of a decode step) do not apply

    def to_dict(self) -> dict:
        return asdict(self)


def _category_codes(trace: RankTrace, taxonomy: Taxonomy, categories: list[str]) -> tuple[np.ndarray, list[str]]:
    code_of = {c: i for i, c in enumerate(categories)}
    labels = []
    per_name = np.empty(len(trace.names), dtype=np.int16)
    for i, name in enumerate(trace.names):
        cat, label = taxonomy.classify(name)
        per_name[i] = code_of[cat]
        labels.append(label)
    return per_name[trace.name_id], labels


def _kernel_rows(trace, codes, labels, categories, mask) -> list[KernelRow]:
    ids = trace.name_id[mask]
    if ids.size == 0:
        return []
    count = np.bincount(ids, minlength=len(trace.names))
    total = np.bincount(ids, weights=trace.dur[mask], minlength=len(trace.names))
    code_of_name = np.zeros(len(trace.names), dtype=np.int16)
    code_of_name[trace.name_id] = codes
    rows = [
        KernelRow(trace.names[i], categories[code_of_name[i]], labels[i], int(count[i]), float(total[i]), float(total[i] / count[i]))
        for i in np.flatnonzero(count)
    ]
    return sorted(rows, key=lambda r: -r.total_us)


# Fewer complete steps than these: the median step is one of a handful (said in a note), and a p90 would be the
# maximum (left out).
MIN_STEPS_FOR_MEDIAN = 3
MIN_STEPS_FOR_P90 = 5


def _analyze_rank(
    trace: RankTrace,
    split: StepSplit,
    codes: np.ndarray,
    labels: list[str],
    wait: np.ndarray,
    taxonomy: Taxonomy,
    ar_info: dict,
    unmatched_ar: np.ndarray | None = None,
) -> RankBreakdown:
    """``unmatched_ar``: indices of the all-reduce kernels without a counterpart on the group's other ranks, where
    the group's other collectives were matched (their wait is unknown)."""
    categories = taxonomy.report_categories
    code_of = {c: i for i, c in enumerate(categories)}
    ar, wait_code = code_of["allreduce"], code_of[ALLREDUCE_WAIT]
    start, dur = trace.start, trace.dur
    end = start + dur

    # all-reduce kernels become two intervals: [start, start+wait) waiting, the rest working
    is_wait = wait > 0
    iv_start = np.concatenate([np.where(is_wait, start + wait, start), start[is_wait]])
    iv_end = np.concatenate([end, start[is_wait] + wait[is_wait]])
    iv_code = np.concatenate([codes, np.full(int(is_wait.sum()), wait_code, dtype=codes.dtype)])
    iv_step = np.concatenate([split.step_of_kernel, split.step_of_kernel[is_wait]])
    iv_dur = iv_end - iv_start

    n_steps = split.n_steps
    ws, we = split.window_start, split.window_end
    full_ws, full_we = np.array([start.min()]), np.array([end.max()])
    priority = [code_of[c] for c in taxonomy.priority]

    def summed(owner: np.ndarray, w_start: np.ndarray, w_end: np.ndarray) -> dict[str, np.ndarray]:
        n = w_start.size
        out = {}
        for c, code in code_of.items():
            sel = iv_code == code
            if trace.mode == "cpu":
                # CPU ops nest (aten::linear contains aten::addmm): count each category's union, not the sum
                ms, me = merge(iv_start[sel], iv_end[sel])
                out[c] = covered_in_windows(ms, me, w_start, w_end)
            else:
                out[c] = np.bincount(owner[sel], weights=iv_dur[sel], minlength=n)[:n]
        return out

    step_summed = summed(iv_step, ws, we)
    total_summed = summed(np.zeros(iv_code.size, dtype=np.int64), full_ws, full_we)
    step_exposed, step_busy = exposed_by_priority(iv_start, iv_end, iv_code, priority, ws, we)
    tot_exposed, tot_busy = exposed_by_priority(iv_start, iv_end, iv_code, priority, full_ws, full_we)

    steps = []
    for i in range(n_steps):
        steps.append(
            StepRow(
                index=i,
                start_us=float(ws[i]),
                time_us=float(we[i] - ws[i]),
                n_kernels=int(split.n_kernels[i]),
                partial=bool(split.partial[i]),
                idle_us=float(max(we[i] - ws[i] - step_busy[i], 0.0)),
                summed_us={c: float(step_summed[c][i]) for c in categories},
                exposed_us={c: float(step_exposed[code_of[c]][i]) for c in categories},
            )
        )
    _name_batches(trace, steps)
    complete = [steps[i] for i in split.complete]
    unmatched_note = None
    if unmatched_ar is not None and unmatched_ar.size:
        flagged = sorted(set(split.step_of_kernel[unmatched_ar].tolist()))
        for i in flagged:
            steps[i].allreduce_unmatched = True
        kept = [s for s in complete if not s.allreduce_unmatched]
        shown = ", ".join(map(str, flagged[:8])) + (", ..." if len(flagged) > 8 else "")
        unmatched_note = (f"rank {trace.rank}: {unmatched_ar.size} of {ar_info['kernels']} all-reduce kernels, in "
                          f"{len(flagged)} of {n_steps} steps (step {shown}), have no counterpart on the other ranks "
                          "of its group (their traces cover other steps): their wait cannot be told from work and is "
                          "counted as work; " + ("the median step and p90 leave those steps out" if kept else
                                                 "no step is free of them, so the median step includes that work"))
        complete = kept or complete
    decode = [s for s in complete if s.batch is None or s.batch["prefill_reqs"] == 0]
    mixed_note = None
    prefill_only = trace.stage == "EXTEND" or bool(complete) and all(
        s.batch is not None and s.batch["decode_reqs"] == 0 and s.batch["prefill_reqs"] > 0 for s in complete)
    if prefill_only:
        mixed_note = ("prefill only: " + ("an SGLang EXTEND-stage trace (prefill forwards)" if trace.stage == "EXTEND"
                      else f"none of the {len(complete)} complete steps holds a decode request (vLLM's "
                      "execute_context_N(T)_generation_0(0))") + ": the median step is a prefill step")
    elif decode and len(decode) < len(complete):  # a prefill chunk in a forward makes it no decode step
        mixed_note = (f"{len(complete) - len(decode)} of {len(complete)} complete steps carried prefill (vLLM's "
                      "execute_context_N with N > 0): left out of the median step and p90")
        complete = decode
    elif complete and not decode:  # chunked prefill under steady arrivals: no pure decode step to show
        mixed_note = (f"all {len(complete)} complete steps carried prefill (vLLM's execute_context_N with N > 0): the "
                      "median step is a mixed prefill + decode step, not a decode step")
    times = np.array([s.time_us for s in complete])
    median_step = p90 = None
    if split.reliable:
        # One real step, the (lower) middle one by time: its parts add up to its time. Per-category medians over steps
        # need not: a wait in every other step has median 0 in its category while the median step time keeps it.
        typical = complete[int(np.argsort(times, kind="stable")[(len(times) - 1) // 2])]
        median_step = {
            "time_us": typical.time_us,
            "idle_us": typical.idle_us,
            "n_kernels": float(typical.n_kernels),
            "summed_us": dict(typical.summed_us),
            "exposed_us": dict(typical.exposed_us),
            "step_index": typical.index,
        }
        p90 = float(np.percentile(times, 90)) if len(times) >= MIN_STEPS_FOR_P90 else None

    everything = np.ones(trace.n_kernels, dtype=bool)
    rows = _kernel_rows(trace, codes, labels, categories, everything)
    top = {c: [r for r in rows if r.category == c][:TOP_KERNELS] for c in taxonomy.categories}
    unknown = [r for r in rows if r.label == UNKNOWN_LABEL]
    kernel_us = float(dur.sum())

    window = float(full_we[0] - full_ws[0])
    notes = list(trace.notes) + list(split.notes) + [n for n in (unmatched_note, mixed_note) if n]
    for label, limit in taxonomy.small_families.items():
        family = [r for r in rows if r.label == label]
        share = sum(r.total_us for r in family) / kernel_us if kernel_us else 0.0
        if share > limit:
            names = ", ".join(f"{r.name[:80]} ({r.total_us / kernel_us:.0%})" for r in family[:3])
            notes.append(f"{share:.0%} of the kernel time is in kernels filed as '{label}' ({family[0].category}), a "
                         f"family of small kernels (at most {limit:.0%} expected): {names}; if one of them is a GEMM "
                         "or attention kernel, give it a rule of its own (--taxonomy FILE)")
    sizes = sorted({s.batch["decode_reqs"] for s in complete if s.batch})
    if len(sizes) > 1:
        notes.append(f"decode requests per step vary from {sizes[0]} to {sizes[-1]} across the steps used: the "
                     "median step is of one of them")
    if split.reliable and (split.n_steps == 1 or all(s.partial for s in steps)):
        notes.append("no complete step found: per-step figures use the whole trace window")
    elif split.reliable and len(complete) < MIN_STEPS_FOR_MEDIAN:
        notes.append(f"only {len(complete)} complete step(s): the median step is that step, not a typical one of many; "
                     f"capture more (--steps)" + ("" if p90 is not None else "; no p90"))
    return RankBreakdown(
        rank=trace.rank,
        file=trace.path.name,
        rank_source=trace.rank_source,
        tp_rank=trace.tp_rank,
        pp_rank=trace.pp_rank,
        mode=trace.mode,
        device_name=trace.device_name,
        n_kernels=trace.n_kernels,
        trace_window_us=window,
        total_kernel_us=float(dur.sum()),
        summed_us={c: float(total_summed[c][0]) for c in categories},
        exposed_us={c: float(tot_exposed[code_of[c]][0]) for c in categories},
        idle_us=float(max(window - tot_busy[0], 0.0)),
        step_method=split.method,
        step_detail=split.detail,
        steps_reliable=split.reliable,
        n_steps=split.n_steps,
        n_complete_steps=int(len(split.complete)) if (~split.partial).any() else 0,
        median_step=median_step,
        p90_step_time_us=p90,
        steps=steps,
        allreduce=ar_info,
        top_kernels=top,
        unknown_kernels=unknown,
        notes=notes,
        host=host_side(trace, split, median_step["time_us"] if median_step else None),
        world_size=_world_size(trace),
        prefill_only=prefill_only,
    )


def _name_batches(trace: RankTrace, steps: list[StepRow]) -> None:
    """Each step's batch from the vLLM execute range overlapping it most (GPU-side ranges first: they cover the
    kernels; CPU-side ones sit a launch latency earlier on the same clock)."""
    for marks in (trace.annotations_gpu, trace.annotations_cpu):
        named = [(a, b, batch) for a, b, name in marks if (batch := vllm_step_batch(name)) is not None]
        if not named:
            continue
        starts = np.array([a for a, _, _ in named])
        ends = np.array([b for _, b, _ in named])
        for s in steps:
            overlap = np.minimum(ends, s.start_us + s.time_us) - np.maximum(starts, s.start_us)
            best = int(np.argmax(overlap))
            if overlap[best] > 0:
                s.batch = named[best][2]
        return


def _world_size(trace: RankTrace) -> int | None:
    n = (trace.distributed or {}).get("world_size")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _collectives(traces: list[RankTrace], codes: dict[int, np.ndarray], ar_code: int) -> tuple[dict[int, np.ndarray], list[GroupMatch]]:
    """Per-kernel wait time for every rank, from matching each TP group's all-reduce kernels."""
    wait = {t.rank: np.zeros(t.n_kernels) for t in traces}
    groups: dict[int, list[RankTrace]] = {}
    for t in traces:
        groups.setdefault(t.pp_rank or 0, []).append(t)
    matches = []
    for _, members in sorted(groups.items()):
        members.sort(key=lambda t: t.rank)
        ranks = [t.rank for t in members]
        starts, ends, names, index, offset = {}, {}, {}, {}, {}
        for t in members:
            idx = np.flatnonzero(codes[t.rank] == ar_code)
            index[t.rank] = idx
            starts[t.rank] = t.start[idx]
            ends[t.rank] = t.start[idx] + t.dur[idx]
            # compare kernel names across ranks by text, not by per-file ids
            names[t.rank] = np.array([t.names[i] for i in t.name_id[idx]], dtype=object)
            offset[t.rank] = (t.origin_ns - members[0].origin_ns) / 1000.0
        match = match_group(ranks, starts, ends, names, index, offset)
        for r, rc in match.per_rank.items():
            wait[r][rc.kernel_index] = rc.wait_us
        matches.append(match)
    return wait, matches


def analyze_traces(
    traces: list[RankTrace],
    taxonomy: Taxonomy | None = None,
    step_method: str = "auto",
    step_gap_us: float | None = None,
    source: str = "",
    notes: list[str] | None = None,
    step_annotation: str | None = None,
) -> Breakdown:
    """``step_annotation``: a regex naming the annotation ranges that are steps (default: detected)."""
    taxonomy = taxonomy or load_taxonomy()
    categories = taxonomy.report_categories
    ar_code = categories.index("allreduce")
    pattern = compile_step_annotation(step_annotation)
    codes, labels, splits = {}, {}, {}
    for t in traces:
        codes[t.rank], labels[t.rank] = _category_codes(t, taxonomy, categories)
        splits[t.rank] = split_steps(t, step_method, step_gap_us, pattern)
    if pattern is not None and not any(s.method == "annotation" for s in splits.values()):
        seen = annotation_families(traces[0])
        listed = ", ".join(f"{name} ({n}x)" for name, n in seen.most_common(12)) or "none"
        raise Glm5Fp4Error(f"--step-annotation: no annotation matches '{pattern.pattern}' in any trace; "
                           f"top-level annotations in {traces[0].path.name}: {listed}")
    wait, matches = _collectives(traces, codes, ar_code)
    line_up_notes = line_up(traces, splits, matches)

    ranks = []
    for t in traces:
        group = next(m for m in matches if t.rank in m.per_rank)
        rc = group.per_rank[t.rank]
        ar_mask = codes[t.rank] == ar_code
        ar_info = {
            "kernels": int(ar_mask.sum()),
            "matched": int(rc.matched.sum()),
            "wait_us": float(rc.wait_us.sum()),
            "work_us": float(t.dur[ar_mask].sum() - rc.wait_us.sum()),
            "clock_skew_us": float(rc.clock_skew_us),
        }
        # a rank lined up with the group but missing some of its instances (other trace windows); a rank that could
        # not be lined up at all is the group note's ("could not be matched"), not a window's
        unmatched = rc.kernel_index[~rc.matched] if group.matched_instances and rc.matched.any() else None
        ranks.append(_analyze_rank(t, splits[t.rank], codes[t.rank], labels[t.rank], wait[t.rank], taxonomy, ar_info,
                                   unmatched))

    across = _across_ranks(ranks, categories)
    groups = [
        {
            "ranks": m.ranks,
            "reference_rank": m.reference,
            "matched_instances": m.matched_instances,
            "method": m.method,
            "notes": m.notes,
        }
        for m in matches
    ]
    all_notes = list(notes or [])
    for m in matches:
        all_notes += m.notes
    all_notes += line_up_notes
    return Breakdown(
        source=source,
        mode=traces[0].mode,
        categories=categories,
        exposed_priority=taxonomy.priority,
        taxonomy=taxonomy.source,
        ranks=ranks,
        across_ranks=across,
        collective_groups=groups,
        notes=all_notes,
        prefill_only=bool(ranks) and all(r.prefill_only for r in ranks),
    )


def _across_ranks(ranks: list[RankBreakdown], categories: list[str]) -> dict:
    """Per-rank median-step figures summarised over ranks (mean, min, max) and the slowest rank; none unless
    every rank's steps are reliable."""
    def stats(values: list[float]) -> dict[str, float]:
        a = np.array(values, dtype=float)
        return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}

    unreliable = [r.rank for r in ranks if not r.steps_reliable]
    if unreliable:
        return {"n_ranks": len(ranks), "steps_reliable": False, "unreliable_ranks": unreliable,
                "hint": HINT, "step_time_us": None, "idle_us": None, "summed_us": None, "exposed_us": None}
    out = {
        "n_ranks": len(ranks),
        "steps_reliable": True,
        "step_time_us": stats([r.median_step["time_us"] for r in ranks]),
        "idle_us": stats([r.median_step["idle_us"] for r in ranks]),
        "summed_us": {c: stats([r.median_step["summed_us"][c] for r in ranks]) for c in categories},
        "exposed_us": {c: stats([r.median_step["exposed_us"][c] for r in ranks]) for c in categories},
    }
    if len(ranks) > 1:
        waits = [r.median_step["exposed_us"].get(ALLREDUCE_WAIT, 0.0) for r in ranks]
        # the rank everyone waits for waits least itself
        out["slowest_rank"] = ranks[int(np.argmin(waits))].rank
        out["wait_spread_us"] = float(max(waits) - min(waits))
    return out


def analyze_path(
    path: str | Path,
    taxonomy_path: str | Path | None = None,
    step_method: str = "auto",
    step_gap_us: float | None = None,
    mode: str = "auto",
    stage: str | None = None,
    jobs: int | None = None,
    step_annotation: str | None = None,
) -> Breakdown:
    """Load every rank's trace under ``path`` and analyse them together."""
    compile_step_annotation(step_annotation)  # a bad regex is reported before the traces are read
    traces, notes = load_rank_traces(path, mode=mode, stage=stage, jobs=jobs)
    taxonomy = load_taxonomy(taxonomy_path)
    return analyze_traces(traces, taxonomy, step_method, step_gap_us, source=str(path), notes=notes,
                          step_annotation=step_annotation)
