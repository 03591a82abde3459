"""Interval arithmetic against a brute-force reference on an integer time grid."""

import numpy as np
import pytest

from glm5_fp4.profiling.intervals import covered_in_windows, exposed_by_priority, merge, union_length


def _grid(starts, ends, horizon):
    busy = np.zeros(horizon, dtype=bool)
    for s, e in zip(starts, ends):
        busy[int(s):int(e)] = True
    return busy


@pytest.mark.parametrize("seed", range(6))
def test_union_and_coverage_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, horizon = 60, 400
    starts = rng.integers(0, horizon - 20, n).astype(float)
    ends = starts + rng.integers(0, 25, n)
    busy = _grid(starts, ends, horizon)
    ms, me = merge(starts, ends)
    assert np.all(np.diff(ms) > 0) and np.all(ms[1:] > me[:-1])  # sorted, disjoint, not touching
    assert union_length(starts, ends) == busy.sum()
    ws = np.sort(rng.integers(0, horizon, 10)).astype(float)
    we = ws + rng.integers(0, 80, 10)
    got = covered_in_windows(ms, me, ws, we)
    want = [busy[int(a):int(b)].sum() for a, b in zip(ws, we)]
    np.testing.assert_allclose(got, want)


@pytest.mark.parametrize("seed", range(6))
def test_exposed_by_priority_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    n, horizon, n_cat = 80, 500, 4
    starts = rng.integers(0, horizon - 30, n).astype(float)
    ends = starts + rng.integers(1, 30, n)
    cat = rng.integers(0, n_cat, n)
    priority = list(rng.permutation(n_cat))
    # reference: every time cell goes to the highest-priority category active in it
    owner = np.full(horizon, -1)
    for code in reversed(priority):
        for s, e, c in zip(starts, ends, cat):
            if c == code:
                owner[int(s):int(e)] = code
    ws = np.array([0.0, 100.0, 250.0])
    we = np.array([100.0, 250.0, float(horizon)])
    exposed, busy = exposed_by_priority(starts, ends, cat, priority, ws, we)
    for code in range(n_cat):
        want = [(owner[int(a):int(b)] == code).sum() for a, b in zip(ws, we)]
        np.testing.assert_allclose(exposed[code], want)
    np.testing.assert_allclose(busy, [(owner[int(a):int(b)] >= 0).sum() for a, b in zip(ws, we)])
    # exposed times of all categories add up to the busy time of each window
    np.testing.assert_allclose(sum(exposed.values()), busy)


def test_empty_inputs():
    ms, me = merge(np.array([]), np.array([]))
    assert ms.size == 0
    np.testing.assert_array_equal(covered_in_windows(ms, me, np.array([0.0]), np.array([5.0])), [0.0])
