"""Telemetry report: a PNG of power and SM clock per GPU with load phases, and a markdown table.

`summary_markdown(summary)` is what load-test and profile reports embed; `render_report(dir)`
writes telemetry.png, telemetry.md and telemetry_summary.json next to the samples.
matplotlib is imported only to draw, through its object API (no pyplot, no global backend),
so embedding a report never changes the caller's plotting state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.outputs import save_figure, write_text_atomic
from glm5_fp4.telemetry.series import (
    MARKDOWN_FILE,
    NO_TELEMETRY,
    PNG_FILE,
    SUMMARY_FILE,
    TelemetryRun,
    load_run,
    write_json_atomic,
)
from glm5_fp4.telemetry.summary import phases, summarize


@dataclass
class ReportFiles:
    summary: dict[str, Any]
    markdown_path: Path
    summary_path: Path
    png_path: Path | None  # None without telemetry or without matplotlib
    note: str | None = None  # why there is no plot


def _finite(t, y):
    pts = [(a, b) for a, b in zip(t, y) if math.isfinite(b)]
    return [a for a, _ in pts], [b for _, b in pts]


def plot_run(run: TelemetryRun, png_path: str | Path) -> Path | None:
    """Power and SM clock over time, one line per GPU, phases shaded and labelled. None without data."""
    if not run.available or not any(len(g) for g in run.gpus):
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_power, ax_clock = fig.subplots(2, 1, sharex=True)
    handles, tops = [], {ax_power: 1.0, ax_clock: 1.0}
    for g in run.gpus:
        power_key = "power_w" if "power_w" in g.metrics else "power_inst_w"
        label = f"GPU {g.index}"
        for ax, key in ((ax_power, power_key), (ax_clock, "sm_mhz")):
            t, y = _finite(g.t, g.values[key])
            (line,) = ax.plot(t, y, lw=1.2, label=label)
            tops[ax] = max([tops[ax], *y])
        handles.append(line)

    marked = [p for p in phases(run) if p[0] not in ("all", "unmarked")]
    for i, (name, start, end) in enumerate(marked):
        for ax in (ax_power, ax_clock):
            ax.axvspan(start, end, color="0.5" if i % 2 else "0.8", alpha=0.15, lw=0)
            ax.axvline(start, color="0.3", lw=0.8, ls="--")
        ax_power.annotate(
            name,
            xy=(start, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            fontsize=8,
            color="0.2",
        )

    ax_power.set_ylabel("power (W)")
    ax_clock.set_ylabel("SM clock (MHz)")
    ax_clock.set_xlabel("time since start (s)")
    # headroom above the highest line keeps the phase labels readable
    for ax, top in tops.items():
        ax.set_ylim(0, top * 1.15)
    names = sorted({g.name for g in run.gpus})
    ax_power.set_title(f"GPU power and SM clock ({', '.join(names)}; every {run.interval_s:g} s)", fontsize=10)
    for ax in (ax_power, ax_clock):
        ax.grid(alpha=0.3)
    fig.legend(handles=handles, fontsize=8, ncol=min(len(run.gpus), 8), loc="outside lower center")
    png_path = Path(png_path)
    save_figure(fig, png_path)
    return png_path


def _fmt(x: Any, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:,.{digits}f}"


def _pair(stats: dict | None, digits: int = 0, scale: float = 1.0) -> str:
    if not stats:
        return "–"
    return f"{_fmt(stats['median'] * scale, digits)} / {_fmt(stats['p90'] * scale, digits)}"


def summary_markdown(summary: dict[str, Any], png_name: str | None = None, heading: str = "## GPU telemetry") -> str:
    """Markdown for a report: headline energy, a table per GPU and a table per phase."""
    lines = [heading, ""]
    if not summary or not summary.get("available"):
        lines.append(f"_{(summary or {}).get('message') or NO_TELEMETRY}_")
        return "\n".join(lines) + "\n"
    # Problems with the log come first: they qualify every number below.
    for w in summary.get("warnings") or []:
        lines.append(f"**Warning:** {w}")
    if summary.get("warnings"):
        lines.append("")

    w = summary["window"]
    where = f"phase `{w['phase']}`" if w.get("phase") else "whole run"
    if len(w.get("intervals") or []) > 1:  # the duration is their sum, not end minus start
        where += f" ({len(w['intervals'])} intervals)"
    head = f"{where}, {_fmt(w['duration_s'], 1)} s, sampled every {summary['interval_s']:g} s. "
    if summary["energy_j"] is None:
        head += "Energy **not measurable** (see the warnings above)."
    else:
        source = "NVML energy counter" if summary["energy_source"] == "nvml_counter" else "integrated power samples"
        head += (
            f"Energy **{_fmt(summary['energy_j'], 0)} J** ({source}; power-sample integral "
            f"{_fmt(summary['energy_trapezoid_j'], 0)} J), mean power {_fmt(summary['mean_power_w'], 0)} W (all GPUs)."
        )
    lines.append(head)
    if summary.get("tokens") is not None and summary["energy_j"] is not None:
        lines.append(
            f"Tokens {summary['tokens']:,}: **{_fmt(summary['tokens_per_joule'], 3)} tokens/J**, "
            f"{_fmt(summary['joules_per_token'], 3)} J/token."
        )
    lines.append("")
    if png_name:
        lines += [f"![GPU power and SM clock]({png_name})", ""]

    lines.append(
        "| GPU | power W (med / p90) | SM MHz (med / p90) | mem MHz (med) | GPU util % (med / p90) "
        "| mem-ctrl util % (med / p90) | mem used GiB (max) | temp °C (max) | PCIe TX / RX MB/s (med) "
        "| energy J (counter / integral) | clock limits (share of reads) |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for g in summary["gpus"]:
        m = g["metrics"]
        mem_mhz = m.get("mem_mhz")
        mem_used = m.get("mem_used_mib")
        temp = m.get("temp_c")
        tx, rx = m.get("pcie_tx_mbs"), m.get("pcie_rx_mbs")
        pcie = f"{_fmt(tx['median'], 0)} / {_fmt(rx['median'], 0)}" if tx and rx else "–"
        e = g["energy_j"]
        limits = ", ".join(f"{k} {v:.0%}" for k, v in sorted(g["throttle_fraction"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {g['index']} {g['name']} | {_pair(m.get('power_w'))} | {_pair(m.get('sm_mhz'))} "
            f"| {_fmt(mem_mhz['median']) if mem_mhz else '–'} "
            f"| {_pair(m.get('util_gpu'))} | {_pair(m.get('util_mem'))} "
            f"| {_fmt(mem_used['max'] / 1024, 1) if mem_used else '–'} | {_fmt(temp['max']) if temp else '–'} "
            f"| {pcie} | {_fmt(e['counter'], 0)} / {_fmt(e['trapezoid'], 0)} | {limits or 'none'} |"
        )

    if summary["phases"] and not (len(summary["phases"]) == 1 and summary["phases"][0]["name"] == "all"):
        lines += [
            "",
            "| phase | start s | duration s | energy J | mean power W (all GPUs) "
            "| median power W per GPU | median SM MHz per GPU |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in summary["phases"]:
            per_power = " / ".join(_fmt(x["median_power_w"]) for x in p["gpus"])
            per_clock = " / ".join(_fmt(x["median_sm_mhz"]) for x in p["gpus"])
            lines.append(
                f"| {p['name']} | {_fmt(p['start_s'], 1)} | {_fmt(p['duration_s'], 1)} | {_fmt(p['energy_j'], 0)} "
                f"| {_fmt(p['mean_power_w'], 0)} | {per_power} | {per_clock} |"
            )

    s = summary.get("sampler") or {}
    cpu = s.get("cpu_fraction_of_one_core")
    calls = s.get("nvml_calls_per_gpu_tick")
    auto = s.get("auto_interval")
    sampler_line = (
        f"Sampler: {s.get('ticks', 0)} ticks, {s.get('late_ticks', 0)} late, {s.get('read_failures', 0)} failed reads, "
        + (f"{_fmt(calls, 1)} NVML calls per GPU per tick, " if calls is not None else "")
        + f"CPU {_fmt(None if cpu is None else 100 * cpu, 2)} % of one core."
    )
    if auto:
        sampler_line += (
            f" Interval {auto['chosen_s']:g} s chosen automatically: NVML reads measured "
            f"{_fmt(auto['read_cpu_ms_per_tick'], 2)} ms of CPU per tick, "
            f"budget {100 * auto['budget_of_one_core']:g} % of one core for the whole sampler."
        )
    if s.get("slow_metrics"):
        sampler_line += f" Read every {_fmt(s.get('slow_s'), 1)} s only: {', '.join(s['slow_metrics'])}."
    lines += ["", sampler_line]
    if s.get("pcie_alias_above_mbs"):
        lines.append(
            f"PCIe rates come from NVML's byte counters, which wrap every 4 GiB: above "
            f"{_fmt(s['pcie_alias_above_mbs'], 0)} MB/s a reading at this interval aliases to a lower one."
        )
    return "\n".join(lines) + "\n"


def render_report(
    run_dir: str | Path, tokens: int | None = None, phase: str | None = None, plot: bool = True
) -> ReportFiles:
    """Write telemetry.png (when there is data and matplotlib), telemetry.md and telemetry_summary.json."""
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    summary = summarize(run, tokens=tokens, phase=phase)
    png_path, note = None, None
    if plot and run.available:
        try:
            png_path = plot_run(run, run_dir / PNG_FILE)
        except ImportError:
            note = "plot skipped: matplotlib is not installed"
    if png_path is None:  # an earlier report's plot would pass for this one's
        stale = run_dir / PNG_FILE
        try:
            stale.unlink(missing_ok=True)
        except OSError as exc:
            raise Glm5Fp4Error(f"{stale}: cannot remove an earlier report's plot ({exc.strerror or exc})") from None
    md = summary_markdown(summary, png_name=png_path.name if png_path else None)
    if note:
        md += f"\n_{note}_\n"
    md_path = run_dir / MARKDOWN_FILE
    write_text_atomic(md_path, md)
    summary_path = run_dir / SUMMARY_FILE
    write_json_atomic(summary_path, summary)
    return ReportFiles(summary=summary, markdown_path=md_path, summary_path=summary_path, png_path=png_path, note=note)
