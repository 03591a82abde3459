"""Interval arithmetic on numpy arrays: unions, coverage inside windows, exposed time by priority.

Exposed time answers "how much of the step would go away if this category took zero time": an instant
covered by kernels of several categories is charged to the first of them in the priority order, so the
exposed times of all categories plus idle time add up to the window length exactly.
"""

from __future__ import annotations

import numpy as np


def merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals [s, e) as sorted, disjoint (starts, ends)."""
    if starts.size == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(starts, kind="stable")
    s = starts[order]
    e = np.maximum.accumulate(ends[order])
    # a new merged interval begins wherever a start lies beyond every earlier end
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > e[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, s.size - 1)
    return s[first], e[last]


def covered_in_windows(ms: np.ndarray, me: np.ndarray, ws: np.ndarray, we: np.ndarray) -> np.ndarray:
    """Length of the merged intervals (ms, me) inside each window [ws, we)."""
    out = np.zeros(ws.size)
    if ms.size == 0 or ws.size == 0:
        return out
    lengths = me - ms
    cum = np.concatenate([[0.0], np.cumsum(lengths)])
    i0 = np.searchsorted(me, ws, side="right")  # first interval ending after the window start
    i1 = np.searchsorted(ms, we, side="left")  # intervals starting before the window end
    has = i1 > i0
    total = cum[i1] - cum[i0]
    # trim the partial overlap of the first and last interval in each window
    first = np.minimum(i0, ms.size - 1)
    last = np.maximum(i1 - 1, 0)
    total -= np.where(has, np.clip(ws - ms[first], 0.0, None), 0.0)
    total -= np.where(has, np.clip(me[last] - we, 0.0, None), 0.0)
    out[has] = total[has]
    return np.clip(out, 0.0, None)


def union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    ms, me = merge(starts, ends)
    return float((me - ms).sum())


def exposed_by_priority(
    starts: np.ndarray,
    ends: np.ndarray,
    cat: np.ndarray,
    priority: list[int],
    ws: np.ndarray,
    we: np.ndarray,
) -> tuple[dict[int, np.ndarray], np.ndarray]:
    """Exposed time per category in each window, and the busy (union) time per window.

    ``cat`` holds integer category codes; ``priority`` lists the codes, highest priority first.
    """
    exposed: dict[int, np.ndarray] = {}
    previous = np.zeros(ws.size)
    included = np.zeros(cat.size, dtype=bool)
    for code in priority:
        included |= cat == code
        ms, me = merge(starts[included], ends[included])
        covered = covered_in_windows(ms, me, ws, we)
        exposed[code] = np.clip(covered - previous, 0.0, None)
        previous = covered
    return exposed, previous


def summed_in_windows(starts: np.ndarray, durs: np.ndarray, owner: np.ndarray, n_windows: int) -> np.ndarray:
    """Sum of durations per window, each interval counted in the window ``owner`` assigns it to."""
    return np.bincount(owner, weights=durs, minlength=n_windows)[:n_windows] if owner.size else np.zeros(n_windows)
