"""All-reduce wait versus work, across the ranks of one tensor-parallel group.

A collective kernel starts on each rank when that rank arrives and ends on all ranks at (nearly) the same
moment. Its true work is the time from the LAST rank's arrival to the end; on every other rank the time
before that is waiting for a slower rank. So a rank that is fast elsewhere shows large all-reduce *wait*,
and the slow rank shows none.

That needs the ranks' clocks aligned and the k-th collective of one rank matched with the k-th of another
even though each rank's trace window starts at a different step. Collectives are matched as sequences:
first assuming the traces share a clock (one host), pairing each collective with the one ending nearest
in time; if that does not line up, by searching the index shift whose end times agree best (kernel names
must agree too). The clock offset is then the median difference of matched end times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NAME_AGREEMENT = 0.9
MIN_OVERLAP = 3


@dataclass
class RankCollectives:
    rank: int
    kernel_index: np.ndarray  # indices into the rank's kernel arrays, time order
    wait_us: np.ndarray  # per collective kernel
    matched: np.ndarray  # bool per collective kernel
    instance: np.ndarray  # the collective's number, the same on every rank of the group (-1: not matched)
    clock_skew_us: float = 0.0  # how far this rank's clock runs ahead of the reference rank's, from end times


@dataclass
class GroupMatch:
    ranks: list[int]
    reference: int
    matched_instances: int
    method: str
    per_rank: dict[int, RankCollectives] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _spread(d: np.ndarray) -> tuple[float, float]:
    med = float(np.median(d))
    return med, float(np.median(np.abs(d - med)))


def _nearest_shift(ref_end: np.ndarray, other_end: np.ndarray) -> tuple[int, float, float] | None:
    """Index shift k (ref i <-> other i-k) pairing each collective with the one ending nearest in time."""
    pos = np.searchsorted(other_end, ref_end)
    lo = np.clip(pos - 1, 0, other_end.size - 1)
    hi = np.clip(pos, 0, other_end.size - 1)
    nearest = np.where(np.abs(other_end[lo] - ref_end) <= np.abs(other_end[hi] - ref_end), lo, hi)
    shifts = np.arange(ref_end.size) - nearest
    values, counts = np.unique(shifts, return_counts=True)
    k = int(values[np.argmax(counts)])
    i = np.arange(max(0, k), min(ref_end.size, other_end.size + k))
    if i.size < MIN_OVERLAP:
        return None
    med, spread = _spread(ref_end[i] - other_end[i - k])
    return k, med, spread


def _search_shift(ref_end, other_end, ref_names, other_names) -> tuple[int, float, float] | None:
    """Best index shift by name agreement and end-time consistency; prefers the smallest clock offset on ties."""
    n0, n1 = ref_end.size, other_end.size
    min_overlap = max(MIN_OVERLAP, min(n0, n1) // 2)
    best: list[tuple[float, float, int]] = []
    for k in range(-(n1 - min_overlap), n0 - min_overlap + 1):
        i = np.arange(max(0, k), min(n0, n1 + k))
        if i.size < min_overlap:
            continue
        if np.mean(ref_names[i] == other_names[i - k]) < NAME_AGREEMENT:
            continue
        med, spread = _spread(ref_end[i] - other_end[i - k])
        best.append((spread, med, k))
    if not best:
        return None
    lowest = min(b[0] for b in best)
    tied = [b for b in best if b[0] <= max(2.0, 1.5 * lowest)]
    spread, med, k = min(tied, key=lambda b: abs(b[1]))
    return k, med, spread


def match_group(
    ranks: list[int],
    starts: dict[int, np.ndarray],
    ends: dict[int, np.ndarray],
    names: dict[int, np.ndarray],
    kernel_index: dict[int, np.ndarray],
    coarse_offset_us: dict[int, float],
) -> GroupMatch:
    """Wait/work split for the collective kernels of ranks that run the same collectives.

    ``starts``/``ends``/``names`` per rank hold that rank's collective kernels in time order, in its own
    clock; ``coarse_offset_us`` maps each rank's clock onto the reference rank's (from the traces' absolute
    time bases; refined here from the collective end times).
    """
    ref = ranks[0]
    group = GroupMatch(ranks=list(ranks), reference=ref, matched_instances=0, method="none")
    for r in ranks:
        n = starts[r].size
        group.per_rank[r] = RankCollectives(r, kernel_index[r], np.zeros(n), np.zeros(n, dtype=bool),
                                            np.full(n, -1, dtype=np.int64))
    if len(ranks) < 2:
        group.notes.append("one rank in the group: all-reduce wait cannot be told from work")
        return group
    if any(starts[r].size == 0 for r in ranks):
        missing = [r for r in ranks if starts[r].size == 0]
        group.notes.append(f"no all-reduce kernels on rank(s) {missing}: wait not computed for this group")
        return group

    ref_end = ends[ref]
    typical = float(np.median(np.diff(ref_end))) if ref_end.size > 1 else 1.0
    shifts = {ref: (0, 0.0, 0.0)}
    methods = set()
    for r in ranks[1:]:
        other_end = ends[r] + coarse_offset_us[r]
        found = _nearest_shift(ref_end, other_end)
        if found is not None and found[2] <= max(1.0, 0.1 * typical):
            k, med, _ = found
            methods.add("nearest end time")
        else:
            found = _search_shift(ref_end, other_end, names[ref], names[r])
            if found is None:
                group.notes.append(f"rank {r}: its collectives could not be matched with rank {ref}'s")
                continue
            k, med, _ = found
            methods.add("sequence search")
        shifts[r] = (k, coarse_offset_us[r] + med, med)

    matched_ranks = [r for r in ranks if r in shifts]
    if len(matched_ranks) < 2:
        return group
    lo = max(max(0, k) for k, _, _ in shifts.values())
    hi = min(min(ref_end.size, starts[r].size + shifts[r][0]) for r in matched_ranks)
    if hi - lo < 1:
        group.notes.append("the ranks' traces share no collective instances (windows do not overlap)")
        return group
    i = np.arange(lo, hi)
    aligned_start = np.stack([starts[r][i - shifts[r][0]] + shifts[r][1] for r in matched_ranks])
    last_arrival = aligned_start.max(axis=0)
    for row, r in enumerate(matched_ranks):
        k, _, residual = shifts[r]
        j = i - k
        dur = ends[r][j] - starts[r][j]
        rc = group.per_rank[r]
        rc.wait_us[j] = np.clip(last_arrival - aligned_start[row], 0.0, dur)
        rc.matched[j] = True
        rc.instance[j] = i
        rc.clock_skew_us = -residual
    group.matched_instances = int(i.size)
    group.method = " + ".join(sorted(methods)) or "reference"
    return group
