"""Summary of a telemetry run: median/p90 per metric per GPU, energy, phases, tokens per joule.

Energy comes two ways. `trapezoid` integrates the power samples (linear between samples), which
works on any GPU; `counter` is the difference of NVML's own total-energy counter, which is what
the board measured and is preferred as the headline `energy_j` when every GPU has it. Both are
integrated over the same window, interpolating at window edges, so phase energies add up to the
run's total. Pure Python on purpose: it runs wherever the sampler runs (numpy or not), and a few
hundred thousand samples summarise in about a second.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.telemetry.series import FORMAT, METRICS, NO_TELEMETRY, TelemetryRun

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

    A first mark within one sampling interval of the start opens the run (no sliver of "unmarked").
    """
    end = run.duration_s
    marks = sorted(run.marks)
    if not marks:
        return [("all", 0.0, end)]
    out = []
    if marks[0][0] <= run.interval_s:
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


def _window_values(t: Sequence[float], y: Sequence[float], a: float, b: float, last: bool) -> list[float]:
    return sorted(v for tt, v in zip(t, y) if (a <= tt < b or (last and tt == b)) and math.isfinite(v))


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": percentile(values, 50), "p90": percentile(values, 90), "max": values[-1]}


def unavailable_summary(reason: str | None, tokens: int | None = None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "available": False,
        "reason": reason,
        "message": f"{NO_TELEMETRY}: {reason}" if reason else NO_TELEMETRY,
        "gpus": [],
        "phases": [],
        "energy_j": None,
        "energy_source": None,
        "tokens": tokens,
        "tokens_per_joule": None,
        "joules_per_token": None,
    }


def summarize(run: TelemetryRun, tokens: int | None = None, phase: str | None = None) -> dict[str, Any]:
    """Summary dict (JSON-ready). `phase` restricts stats and energy to that marked phase."""
    if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
        raise Glm5Fp4Error(f"tokens must be a non-negative integer, got {tokens!r}")
    if not run.available:
        return unavailable_summary(run.reason, tokens)

    all_phases = phases(run)
    if phase is None:
        a, b = 0.0, run.duration_s
    else:
        found = [p for p in all_phases if p[0] == phase]
        if not found:
            names = ", ".join(sorted({p[0] for p in all_phases}))
            raise Glm5Fp4Error(f"phase {phase!r} was not marked in this run (phases: {names})")
        # A phase marked more than once is taken from its first start to its last end.
        a, b = min(p[1] for p in found), max(p[2] for p in found)

    gpus = []
    for g in run.gpus:
        t = list(g.t)
        metrics = {}
        for m in STAT_METRICS:
            if m in g.metrics:
                metrics[m] = _stats(_window_values(t, g.values[m], a, b, last=True))
        in_window = [i for i, tt in enumerate(t) if a <= tt <= b]
        # clock-event reasons are a slow metric: shares are of the samples that read them
        throttle_read = [g.throttle[i] for i in in_window if g.throttle[i] is not None]
        throttle: dict[str, float] = {}
        for reasons in throttle_read:
            for name in reasons:
                throttle[name] = throttle.get(name, 0) + 1
        trap = integrate(t, g.values["power_w"], a, b)
        counter = counter_delta(t, g.values["energy_j"], a, b) if "energy_j" in g.metrics else None
        inst = integrate(t, g.values["power_inst_w"], a, b) if "power_inst_w" in g.metrics else None
        gpus.append(
            {
                "index": g.index,
                "name": g.name,
                "uuid": g.uuid,
                "samples": len(in_window),
                "metrics": metrics,
                "energy_j": {"trapezoid": trap, "counter": counter, "trapezoid_instant_power": inst},
                "counter_vs_trapezoid_pct": (100.0 * (trap - counter) / counter) if counter else None,
                "throttle_fraction": {k: v / len(throttle_read) for k, v in sorted(throttle.items())},
                "throttle_samples": len(throttle_read),
                "unsupported": list(g.unsupported),
            }
        )

    duration = max(b - a, 0.0)
    trap_total = sum(g["energy_j"]["trapezoid"] for g in gpus)
    counters = [g["energy_j"]["counter"] for g in gpus]
    counter_total = sum(counters) if gpus and all(c is not None for c in counters) else None
    energy = counter_total if counter_total is not None else trap_total

    phase_rows = []
    for name, pa, pb in all_phases:
        per_gpu = []
        for g in run.gpus:
            t = list(g.t)
            e = (
                counter_delta(t, g.values["energy_j"], pa, pb)
                if counter_total is not None
                else integrate(t, g.values["power_w"], pa, pb)
            )
            pw = _window_values(t, g.values["power_w"], pa, pb, last=pb >= run.duration_s)
            sm = _window_values(t, g.values["sm_mhz"], pa, pb, last=pb >= run.duration_s)
            per_gpu.append(
                {
                    "index": g.index,
                    "energy_j": e,
                    "median_power_w": percentile(pw, 50) if pw else None,
                    "median_sm_mhz": percentile(sm, 50) if sm else None,
                }
            )
        e_total = sum(x["energy_j"] or 0.0 for x in per_gpu)
        phase_rows.append(
            {
                "name": name,
                "start_s": pa,
                "end_s": pb,
                "duration_s": pb - pa,
                "energy_j": e_total,
                "mean_power_w": e_total / (pb - pa) if pb > pa else None,
                "gpus": per_gpu,
            }
        )

    cpu_s = run.sampler.get("cpu_s")
    wall = run.duration_s
    out = {
        "format": FORMAT,
        "available": True,
        "reason": None,
        "message": None,
        "window": {"phase": phase, "start_s": a, "end_s": b, "duration_s": duration},
        "interval_s": run.interval_s,
        "start_unix": run.start_unix,
        "driver": run.driver,
        "gpus": gpus,
        "phases": phase_rows,
        "energy_j": energy,
        "energy_source": "nvml_counter" if counter_total is not None else "power_trapezoid",
        "energy_trapezoid_j": trap_total,
        "energy_counter_j": counter_total,
        "mean_power_w": energy / duration if duration > 0 else None,
        "tokens": tokens,
        "tokens_per_joule": (tokens / energy) if tokens is not None and energy > 0 else None,
        "joules_per_token": (energy / tokens) if tokens else None,
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
