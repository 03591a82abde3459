"""Summary of a telemetry run: median/p90 per metric per GPU, energy, phases, tokens per joule.

Energy comes two ways. `trapezoid` integrates the power samples (linear between samples), which
works on any GPU; `counter` is the difference of NVML's own total-energy counter, which is what
the board measured and is preferred as the headline `energy_j` when every GPU has it. Both are
integrated over the same window, interpolating at window edges, so phase energies add up to the
run's total, and a phase marked more than once is the sum of its own intervals. Pure Python on
purpose: it runs wherever the sampler runs (numpy or not), and a few hundred thousand samples
summarise in about a second.

Logs are not always clean: lines duplicated by a copy, a hole where the sampler stalled, NaN
readings, a counter that jumped back. Each GPU's samples are therefore put in time order with
repeated timestamps dropped before anything is computed, and every such repair (and every gap,
including time at the start or end of the run that a GPU has no samples for) is listed in the
summary's `warnings`, so a number is never silently made from a broken log. A hole between samples
is bridged linearly; uncovered time at either end holds the nearest reading flat, so that energy
and mean power describe the same window; the energy counter cannot be carried over such an edge,
so a GPU with one falls back to its power-sample integral.
Statistics are time-weighted (each sample stands for the time to halfway to its neighbours), the
same linear bridging the energy integral uses: without that, a hole in a busy phase would leave
the idle samples a majority and drag the median down to idle power.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.telemetry.series import FORMAT, METRICS, NO_TELEMETRY, GpuSeries, TelemetryRun

STAT_METRICS = [m for m in METRICS if m != "energy_j"]  # a cumulative counter has no useful median


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """q in [0, 100], linear interpolation between order statistics (numpy's default)."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def weighted_percentile(pairs: Sequence[tuple[float, float]], q: float) -> float:
    """q in [0, 100] of (value, weight) pairs sorted by value.

    Each value sits at the centre of its weight's share of the cumulative total, and positions are
    rescaled so the first value is q=0 and the last q=100: with equal weights this is exactly
    numpy's default linear interpolation, so uniformly sampled runs give the familiar numbers.
    """
    n = len(pairs)
    if n == 0:
        return math.nan
    if n == 1:
        return pairs[0][0]
    centres, acc = [], 0.0
    for _, w in pairs:
        centres.append(acc + w / 2)
        acc += w
    lo_c, hi_c = centres[0], centres[-1]
    if hi_c <= lo_c:
        return percentile([v for v, _ in pairs], q)
    x = lo_c + (hi_c - lo_c) * q / 100.0
    i = min(max(bisect.bisect_right(centres, x), 1), n - 1)
    c0, c1 = centres[i - 1], centres[i]
    v0, v1 = pairs[i - 1][0], pairs[i][0]
    return v0 if c1 == c0 else v0 + (v1 - v0) * (x - c0) / (c1 - c0)


def _finite_points(t: Sequence[float], y: Sequence[float]) -> tuple[list[float], list[float]]:
    pts = [(a, b) for a, b in zip(t, y) if math.isfinite(b)]
    return [a for a, _ in pts], [b for _, b in pts]


def _interp(t: list[float], y: list[float], x: float) -> float:
    """y at x, linear between samples; clamps outside the sampled range."""
    if x <= t[0]:
        return y[0]
    if x >= t[-1]:
        return y[-1]
    i = bisect.bisect_right(t, x)
    t0, t1, y0, y1 = t[i - 1], t[i], y[i - 1], y[i]
    return y0 if t1 == t0 else y0 + (y1 - y0) * (x - t0) / (t1 - t0)


def integrate(t: Sequence[float], y: Sequence[float], start: float | None = None, end: float | None = None) -> float:
    """Integral of the piecewise-linear curve through the finite (t, y) points over [start, end].

    Outside the sampled range nothing is extrapolated: the window is clipped to the samples.
    """
    ts, ys = _finite_points(t, y)
    if len(ts) < 2:
        return 0.0
    a = ts[0] if start is None else max(start, ts[0])
    b = ts[-1] if end is None else min(end, ts[-1])
    if b <= a:
        return 0.0
    # The window's edge values are interpolated so adjacent windows share them exactly.
    inner = [(tt, yy) for tt, yy in zip(ts, ys) if a < tt < b]
    pts = [(a, _interp(ts, ys, a))] + inner + [(b, _interp(ts, ys, b))]
    return sum((t1 - t0) * (y0 + y1) / 2 for (t0, y0), (t1, y1) in zip(pts, pts[1:]))


def counter_delta(
    t: Sequence[float], y: Sequence[float], start: float | None = None, end: float | None = None
) -> float | None:
    """Increase of a cumulative counter over [start, end], interpolating at the edges."""
    ts, ys = _finite_points(t, y)
    if len(ts) < 2:
        return None
    a = ts[0] if start is None else max(start, ts[0])
    b = ts[-1] if end is None else min(end, ts[-1])
    if b <= a:
        return 0.0
    return _interp(ts, ys, b) - _interp(ts, ys, a)


def phases(run: TelemetryRun) -> list[tuple[str, float, float]]:
    """(name, start_s, end_s) for each load phase; time before the first mark is "unmarked".

    A first mark within `sliver_s(interval)` of the start opens the run (no sliver of "unmarked").
    """
    end = run.duration_s
    marks = sorted(run.marks)
    if not marks:
        return [("all", 0.0, end)]
    out = []
    if marks[0][0] <= sliver_s(run.interval_s):
        marks[0] = (0.0, marks[0][1])
    else:
        out.append(("unmarked", 0.0, marks[0][0]))
    for (t, name), nxt in zip(marks, marks[1:] + [(end, "")]):
        out.append((name, t, max(nxt[0], t)))
    return [p for p in out if p[2] > p[1]] or [(marks[-1][1], marks[-1][0], end)]


def _clean(x: Any) -> Any:
    """JSON-safe: NaN/inf become None, floats keep a sensible number of digits."""
    if isinstance(x, float):
        return round(x, 6) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def sliver_s(interval_s: float) -> float:
    """Longest stretch before the first mark that is start-up, not a phase of its own.

    The time between entering the sampler and the caller's first mark is thread start-up and scheduling: tens of
    milliseconds on a loaded CPU whatever the interval. NVML's power readings average over ~0.1-1 s, so a pre-mark
    stretch shorter than a quarter second carries no energy figure worth a row.
    """
    return max(interval_s, 0.25)


def gap_threshold_s(interval_s: float) -> float:
    """A hole between samples longer than this is reported: well past a late tick or two."""
    return max(5.0 * interval_s, 0.5)


def _spans(t: list[float], lo: float | None = None, hi: float | None = None) -> list[float]:
    """The time each sample stands for: halfway to each neighbour; the ends mirror their one neighbour,
    so uniformly spaced samples all weigh the same, or reach to `lo` / `hi` where the run goes on
    further without samples (the reading held flat there, as in the energy)."""
    n = len(t)
    if n < 2:
        return [1.0] * n
    spans = [
        ((t[1] - t[0]) if i == 0 else (t[i] - t[i - 1])) / 2 + ((t[-1] - t[-2]) if i == n - 1 else (t[i + 1] - t[i])) / 2
        for i in range(n)
    ]
    if lo is not None:
        spans[0] += max(t[0] - lo - (t[1] - t[0]) / 2, 0.0)
    if hi is not None:
        spans[-1] += max(hi - t[-1] - (t[-1] - t[-2]) / 2, 0.0)
    return spans


def _inside(tt: float, intervals: Sequence[tuple[float, float]], end: float) -> bool:
    """Whether time tt is in one of the half-open intervals; the run's end belongs to its last one."""
    return any(a <= tt < b or (b >= end and tt == b) for a, b in intervals)


def _window_values(
    t: Sequence[float], y: Sequence[float], intervals: Sequence[tuple[float, float]], lo: float, hi: float
) -> list[tuple[float, float]]:
    """(value, weight) of the finite samples inside `intervals` of the run [lo, hi], sorted by value; weights
    come from the finite samples only, so a NaN reading's time goes to its neighbours as in the integral."""
    ts, ys = _finite_points(t, y)
    return sorted((v, w) for tt, v, w in zip(ts, ys, _spans(ts, lo, hi)) if _inside(tt, intervals, hi))


def _stats(pairs: list[tuple[float, float]]) -> dict[str, float] | None:
    if not pairs:
        return None
    return {"median": weighted_percentile(pairs, 50), "p90": weighted_percentile(pairs, 90), "max": pairs[-1][0]}


def _median(pairs: list[tuple[float, float]]) -> float | None:
    return weighted_percentile(pairs, 50) if pairs else None


class _Samples:
    """One GPU's samples in time order without repeated timestamps, plus what was wrong with them.

    lo, hi: the run's start and end, which the samples should reach.
    """

    def __init__(self, g: GpuSeries, interval_s: float, warnings: list[str], lo: float, hi: float):
        n = len(g.t)
        order = sorted(range(n), key=g.t.__getitem__)  # stable: of equal timestamps the first line wins
        who = f"GPU {g.index}"
        keep, last = [], None
        for i in order:
            if last is not None and g.t[i] == last:
                continue
            keep.append(i)
            last = g.t[i]
        # a log repeated wholesale goes back in time only through its repeats; that is reported below
        if any(j < i for i, j in zip(keep, keep[1:])):
            warnings.append(f"{who}: samples are not in time order in the log; sorted them")
        if len(keep) < n:
            warnings.append(
                f"{who}: {n - len(keep)} sample(s) repeat an earlier timestamp (duplicated lines?); "
                "kept the first of each, so they are not counted twice"
            )
        self.t = [g.t[i] for i in keep]
        self.values = {k: [col[i] for i in keep] for k, col in g.values.items()}
        self.throttle = [g.throttle[i] for i in keep]
        for metric, count in sorted(g.nonfinite.items()):
            warnings.append(f"{who}: {count} {metric} reading(s) were null, NaN or infinite; left out")
        self.lo, self.hi = lo, hi
        self.gaps: list[tuple[float, float]] = []
        limit = gap_threshold_s(interval_s)
        holes = [(t0, t1, "", "bridge the gap linearly") for t0, t1 in zip(self.t, self.t[1:])]
        if self.t:
            holes.insert(0, (lo, self.t[0], ", the start of the run", "hold the first reading over it"))
            holes.append((self.t[-1], hi, ", the end of the run", "hold the last reading over it"))
        edge_gap = False
        for t0, t1, where, bridge in holes:
            if t1 - t0 > limit:
                self.gaps.append((t0, t1))
                edge_gap = edge_gap or bool(where)
                warnings.append(
                    f"{who}: no samples for {t1 - t0:.2f} s ({t0:.2f}-{t1:.2f} s{where}); "
                    f"energy and statistics {bridge}"
                )
        self.counter_ok = "energy_j" in g.metrics
        if self.counter_ok and edge_gap:
            # the counter has no reading at the run's start or end, and a power reading held there is no counter
            self.counter_ok = False
            warnings.append(
                f"{who}: the NVML energy counter does not cover the whole run; using the power-sample integral instead"
            )
        if self.counter_ok:
            _, e = _finite_points(self.t, self.values["energy_j"])
            drops = sum(1 for e0, e1 in zip(e, e[1:]) if e1 < e0)
            if drops:
                # a cumulative counter that decreases was reset or misread: no difference of it is energy
                self.counter_ok = False
                warnings.append(
                    f"{who}: the NVML energy counter goes backwards {drops} time(s); "
                    "using the power-sample integral instead"
                )
        self.finite_power = len(_finite_points(self.t, self.values["power_w"])[0])

    def energy(self, metric: str, intervals: Sequence[tuple[float, float]]) -> float:
        """Integral of a power metric over the intervals, its first and last readings held flat to the run's
        start and end: integrate() alone stops at the samples, and the run's mean power would count that as 0 W."""
        ts, ys = _finite_points(self.t, self.values[metric])
        if len(ts) >= 2:
            if ts[0] > self.lo:
                ts, ys = [self.lo, *ts], [ys[0], *ys]
            if ts[-1] < self.hi:
                ts, ys = [*ts, self.hi], [*ys, ys[-1]]
        return sum(integrate(ts, ys, a, b) for a, b in intervals)

    def counter(self, intervals: Sequence[tuple[float, float]]) -> float | None:
        deltas = [counter_delta(self.t, self.values["energy_j"], a, b) for a, b in intervals]
        return None if any(d is None for d in deltas) else sum(deltas)

    def window_values(self, metric: str, intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
        return _window_values(self.t, self.values[metric], intervals, self.lo, self.hi)


def unavailable_summary(reason: str | None, tokens: int | None = None, complete: bool = True) -> dict[str, Any]:
    """`complete` is False when telemetry was recorded but holds nothing to summarise: a failure,
    unlike a machine without NVML, where having no telemetry is the expected outcome."""
    return {
        "format": FORMAT,
        "available": False,
        "complete": complete,
        "reason": reason,
        "message": f"{NO_TELEMETRY}: {reason}" if reason else NO_TELEMETRY,
        "warnings": [],
        "gpus": [],
        "phases": [],
        "energy_j": None,
        "energy_source": None,
        "tokens": tokens,
        "tokens_per_joule": None,
        "joules_per_token": None,
    }


# counter and integral further apart than this are worth a look (they agree to ~1 % on a sound log)
COUNTER_MISMATCH_PCT = 10.0


def summarize(run: TelemetryRun, tokens: int | None = None, phase: str | None = None) -> dict[str, Any]:
    """Summary dict (JSON-ready). `phase` restricts stats and energy to that marked phase."""
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
        raise Glm5Fp4Error(f"tokens must be a non-negative integer, got {tokens!r}")
    if not run.available:
        return unavailable_summary(run.reason, tokens)
    if not any(len(g) for g in run.gpus):
        return unavailable_summary("telemetry was recorded but the log holds no samples", tokens, complete=False)

    warnings: list[str] = list(run.warnings)
    failed = run.sampler.get("error")
    if failed:
        warnings.append(f"the recording failed ({failed}); telemetry is incomplete")
    end = run.duration_s
    clean = {g.index: _Samples(g, run.interval_s, warnings, 0.0, end) for g in run.gpus}
    # Fewer than two power readings integrate to nothing: a 0 J headline would be a made-up number.
    short = [g.index for g in run.gpus if clean[g.index].finite_power < 2]
    for i in short:
        warnings.append(f"GPU {i}: fewer than two power samples; no energy or rate can be computed")

    all_phases = phases(run)
    if phase is None:
        window = [(0.0, end)]
    else:
        # a phase marked more than once is its own intervals, not what was marked between them
        window = [(pa, pb) for name, pa, pb in all_phases if name == phase]
        if not window:
            names = ", ".join(sorted({p[0] for p in all_phases}))
            raise Glm5Fp4Error(f"phase {phase!r} was not marked in this run (phases: {names})")

    gpus = []
    for g in run.gpus:
        c = clean[g.index]
        t = c.t
        metrics = {}
        for m in STAT_METRICS:
            if m in g.metrics:
                metrics[m] = _stats(c.window_values(m, window))
        in_window = [i for i, tt in enumerate(t) if _inside(tt, window, end)]
        # clock-event reasons are a slow metric: shares are of the samples that read them
        throttle_read = [c.throttle[i] for i in in_window if c.throttle[i] is not None]
        throttle: dict[str, float] = {}
        for reasons in throttle_read:
            for name in reasons:
                throttle[name] = throttle.get(name, 0) + 1
        trap = c.energy("power_w", window) if g.index not in short else None
        counter = c.counter(window) if c.counter_ok else None
        inst = c.energy("power_inst_w", window) if "power_inst_w" in g.metrics else None
        mismatch = (100.0 * (trap - counter) / counter) if counter and trap is not None else None
        if mismatch is not None and abs(mismatch) > COUNTER_MISMATCH_PCT:
            warnings.append(
                f"GPU {g.index}: the NVML energy counter ({counter:,.0f} J) and the power-sample integral "
                f"({trap:,.0f} J) differ by {mismatch:+.0f} %; one of them is wrong"
            )
        gpus.append(
            {
                "index": g.index,
                "name": g.name,
                "uuid": g.uuid,
                "samples": len(in_window),
                "gaps": [
                    {"start_s": g0, "end_s": g1} for g0, g1 in c.gaps if any(g1 > a and g0 < b for a, b in window)
                ],
                "metrics": metrics,
                "energy_j": {"trapezoid": trap, "counter": counter, "trapezoid_instant_power": inst},
                "counter_vs_trapezoid_pct": mismatch,
                "throttle_fraction": {k: v / len(throttle_read) for k, v in sorted(throttle.items())},
                "throttle_samples": len(throttle_read),
                "unsupported": list(g.unsupported),
            }
        )

    duration = sum(max(b - a, 0.0) for a, b in window)
    traps = [g["energy_j"]["trapezoid"] for g in gpus]
    trap_total = sum(traps) if gpus and all(x is not None for x in traps) else None
    counters = [g["energy_j"]["counter"] for g in gpus]
    counter_total = sum(counters) if gpus and all(c is not None for c in counters) else None
    energy = counter_total if counter_total is not None else trap_total

    phase_rows = []
    for name, pa, pb in all_phases:
        per_gpu = []
        for g in run.gpus:
            c = clean[g.index]
            if counter_total is not None:
                e = c.counter([(pa, pb)])
            else:
                e = c.energy("power_w", [(pa, pb)]) if g.index not in short else None
            pw = c.window_values("power_w", [(pa, pb)])
            sm = c.window_values("sm_mhz", [(pa, pb)])
            per_gpu.append(
                {"index": g.index, "energy_j": e, "median_power_w": _median(pw), "median_sm_mhz": _median(sm)}
            )
        energies = [x["energy_j"] for x in per_gpu]
        e_total = sum(energies) if all(x is not None for x in energies) else None
        phase_rows.append(
            {
                "name": name,
                "start_s": pa,
                "end_s": pb,
                "duration_s": pb - pa,
                "energy_j": e_total,
                "mean_power_w": e_total / (pb - pa) if e_total is not None and pb > pa else None,
                "gpus": per_gpu,
            }
        )

    cpu_s = run.sampler.get("cpu_s")
    wall = run.duration_s
    out = {
        "format": FORMAT,
        "available": True,
        "complete": energy is not None and not failed,
        "reason": None,
        "message": None,
        "warnings": warnings,
        "window": {
            "phase": phase,
            "start_s": window[0][0],
            "end_s": window[-1][1],
            "duration_s": duration,
            "intervals": window,
        },
        "interval_s": run.interval_s,
        "start_unix": run.start_unix,
        "driver": run.driver,
        "gpus": gpus,
        "phases": phase_rows,
        "energy_j": energy,
        "energy_source": None if energy is None else "nvml_counter" if counter_total is not None else "power_trapezoid",
        "energy_trapezoid_j": trap_total,
        "energy_counter_j": counter_total,
        "mean_power_w": energy / duration if energy is not None and duration > 0 else None,
        "tokens": tokens,
        "tokens_per_joule": (tokens / energy) if tokens is not None and energy else None,
        "joules_per_token": (energy / tokens) if tokens and energy is not None else None,
        "sampler": {
            **run.sampler,
            "cpu_fraction_of_one_core": (cpu_s / wall) if cpu_s is not None and wall > 0 else None,
        },
    }
    return _clean(out)


def energy_per_token(summary: dict[str, Any] | None, tokens: int | None = None) -> float | None:
    """Joules per generated token from a telemetry summary, or None when there is no telemetry.

    `tokens` defaults to the count stored in the summary (summary(tokens=N)); for `compare`,
    pass the load test's output-token count.
    """
    if not summary or not summary.get("available"):
        return None
    if tokens is None:
        tokens = summary.get("tokens")
    if tokens is None:
        return None
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or tokens < 0:
        raise Glm5Fp4Error(f"tokens must be a non-negative number, got {tokens!r}")
    energy = summary.get("energy_j")
    if energy is None or tokens == 0:
        return None
    return float(energy) / tokens
