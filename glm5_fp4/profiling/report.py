"""Breakdown reports: JSON (everything), markdown (what a person reads), PNG (stacked bars, roofline)."""

from __future__ import annotations

import json
from pathlib import Path

from glm5_fp4.outputs import output_dir, save_figure, write_text_atomic
from glm5_fp4.profiling.breakdown import Breakdown
from glm5_fp4.profiling.host import TOP_RANGES
from glm5_fp4.profiling.steps import HINT
from glm5_fp4.profiling.taxonomy import ALLREDUCE_WAIT

COLORS = {
    "expert_gemm": "#d62728",
    "attention": "#1f77b4",
    "other_gemm": "#ff7f0e",
    "other": "#9467bd",
    "memcpy": "#8c564b",
    "allreduce": "#2ca02c",
    ALLREDUCE_WAIT: "#98df8a",
    "idle": "#d9d9d9",
}


def _us(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} %"


def _sci(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def title(b: Breakdown) -> str:
    what = "Prefill-only breakdown" if b.prefill_only else "Decode-time breakdown"
    if b.mode == "cpu":
        return f"{what}: CPU run (CPU ops stand in for GPU kernels)"
    names = {r.device_name for r in b.ranks if r.device_name}
    return f"{what}: {', '.join(sorted(names)) or 'GPU'}"


def _step_kind(b: Breakdown) -> str:
    return "prefill" if b.prefill_only else "decode"


def markdown(b: Breakdown) -> str:
    cats = b.categories
    kind = _step_kind(b)
    lines = [f"# {title(b)}", ""]
    lines.append(f"Source `{b.source}`: {len(b.ranks)} rank(s); taxonomy `{b.taxonomy}`.")
    if b.mode == "cpu":
        lines.append("Times are CPU op times of a CPU run, labelled with the GPU kernel taxonomy; summed time per category is the union of its ops (CPU ops nest).")
    lines.append(
        "Exposed time charges each instant to the first busy category in the order "
        + " > ".join(b.exposed_priority)
        + "; exposed + idle = step time. `allreduce_wait` is the part of all-reduce kernels spent waiting for the last rank."
    )
    lines.append("")

    reliable = [r for r in b.ranks if r.steps_reliable]
    if len(reliable) < len(b.ranks):
        bad = ", ".join(f"{r.rank} ({r.step_method}: {r.step_detail})" for r in b.ranks if not r.steps_reliable)
        lines += [f"## {kind.capitalize()} steps: no reliable step boundaries", "",
                  f"No reliable step boundaries on rank(s) {bad}. Per-step figures are withheld for them (the "
                  f"whole-trace figures below count every kernel); {HINT}.", ""]
    if reliable:
        lines += [f"## Median {kind} step per rank: exposed time (µs)", "",
                  "The median step is one real step, the complete step of median time (the lower middle one of an "
                  "even count), so its parts add up to its time; p90 is of the complete steps' times (n/a under 5).", ""]
        lines.append("| rank | steps (complete) | median step # | step time | p90 step | idle | " + " | ".join(cats) + " |")
        lines.append("|---:|---:|---:|---:|---:|---:|" + "---:|" * len(cats))
        for r in reliable:
            ms = r.median_step
            lines.append(
                f"| {r.rank} | {r.n_steps} ({r.n_complete_steps}) | {ms['step_index']} | {_us(ms['time_us'])} | "
                f"{_us(r.p90_step_time_us)} | {_us(ms['idle_us'])} | "
                + " | ".join(_us(ms["exposed_us"][c]) for c in cats)
                + " |"
            )
        lines += ["", f"## Median {kind} step per rank: summed kernel time (µs)", ""]
        lines.append("| rank | kernels/step | total | " + " | ".join(cats) + " |")
        lines.append("|---:|---:|---:|" + "---:|" * len(cats))
        for r in reliable:
            ms = r.median_step
            total = sum(ms["summed_us"].values())
            lines.append(f"| {r.rank} | {ms['n_kernels']:.0f} | {_us(total)} | " + " | ".join(_us(ms["summed_us"][c]) for c in cats) + " |")
        lines.append("")
    lines += host_markdown(b)
    lines += ["## Whole trace per rank: exposed time (µs), summed kernel time in brackets", ""]
    lines.append("| rank | kernels | window | idle | " + " | ".join(cats) + " |")
    lines.append("|---:|---:|---:|---:|" + "---:|" * len(cats))
    for r in b.ranks:
        lines.append(f"| {r.rank} | {r.n_kernels} | {_us(r.trace_window_us)} | {_us(r.idle_us)} | "
                     + " | ".join(f"{_us(r.exposed_us[c])} ({_us(r.summed_us[c])})" for c in cats) + " |")

    a = b.across_ranks
    if len(b.ranks) > 1 and a["steps_reliable"]:
        lines += ["", "## Across ranks (median step, µs): mean [min, max]", ""]
        lines.append("| quantity | exposed | summed |")
        lines.append("|---|---|---|")
        st = a["step_time_us"]
        lines.append(f"| step time | {_us(st['mean'])} [{_us(st['min'])}, {_us(st['max'])}] | |")
        idle = a["idle_us"]
        lines.append(f"| idle | {_us(idle['mean'])} [{_us(idle['min'])}, {_us(idle['max'])}] | |")
        for c in cats:
            e, s = a["exposed_us"][c], a["summed_us"][c]
            lines.append(f"| {c} | {_us(e['mean'])} [{_us(e['min'])}, {_us(e['max'])}] | {_us(s['mean'])} [{_us(s['min'])}, {_us(s['max'])}] |")
        if "slowest_rank" in a:
            lines += ["", f"Slowest rank (the one the others wait for in all-reduce): **{a['slowest_rank']}**; "
                      f"spread of all-reduce wait across ranks {_us(a['wait_spread_us'])} µs per step."]

    lines += ["", "## All-reduce: wait vs work (whole trace)", ""]
    lines.append("| rank | kernels | matched across ranks | wait (µs) | work (µs) | clock skew vs reference (µs) |")
    lines.append("|---:|---:|---:|---:|---:|---:|")
    for r in b.ranks:
        ar = r.allreduce
        lines.append(f"| {r.rank} | {ar['kernels']} | {ar['matched']} | {_us(ar['wait_us'])} | {_us(ar['work_us'])} | {ar['clock_skew_us'] + 0.0:.1f} |")
    for g in b.collective_groups:
        lines.append(f"\nTP group {g['ranks']}: {g['matched_instances']} collective instances matched ({g['method']}).")

    if b.ceilings:
        lines += ["", *ceilings_markdown(b.ceilings)]

    lines += ["", "## Top kernels per category (rank %d)" % b.ranks[0].rank, ""]
    lines.append("| category | label | kernel | count | total (µs) | mean (µs) |")
    lines.append("|---|---|---|---:|---:|---:|")
    for c, rows in b.ranks[0].top_kernels.items():
        for row in rows:
            lines.append(f"| {c} | {row.label} | `{_short(row.name)}` | {row.count} | {_us(row.total_us)} | {_us(row.mean_us)} |")

    unknown: dict[str, list[float]] = {}
    for r in b.ranks:
        for row in r.unknown_kernels:
            u = unknown.setdefault(row.name, [0, 0.0])
            u[0] += row.count
            u[1] += row.total_us
    lines += ["", "## Unknown kernels (no taxonomy rule matched; counted as `other`)", ""]
    if unknown:
        lines.append("| kernel | count (all ranks) | total (µs, all ranks) |")
        lines.append("|---|---:|---:|")
        for name, (count, total) in sorted(unknown.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"| `{_short(name, 160)}` | {count} | {_us(total)} |")
        lines.append(f"\nAdd a rule for them to a copy of the taxonomy file ({b.taxonomy}, whose header says how) "
                     "and pass it as `--taxonomy FILE`.")
    else:
        lines.append("None: every kernel matched a taxonomy rule.")

    lines += ["", "## Step detection", ""]
    for r in b.ranks:
        trust = "" if r.steps_reliable else " (**not reliable**)"
        lines.append(f"- rank {r.rank} (`{r.file}`, rank from {r.rank_source}): {r.step_method}{trust}: {r.step_detail}")
    notes = list(b.notes) + [f"rank {r.rank}: {n}" for r in b.ranks for n in r.notes]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _ms(us: float | None) -> str:
    if us is None:
        return "n/a"
    ms = us / 1000.0
    return f"{ms:,.1f}" if abs(ms) >= 10 else f"{ms:.2f}" if abs(ms) >= 1 else f"{ms:.3f}"


def _host_flags(h: dict) -> list[str]:
    """The lines that say whether a rank's host figures can be read at all (none, inflated)."""
    flags = []
    if not h["ranges"] and any(n.startswith("no host ranges") for n in h["notes"]):
        flags.append("no host ranges in the trace")
    if h["python_function_events"]:
        flags.append(f"Python tracing was on ({h['python_function_events']:,} python_function events): "
                     "host times are inflated")
    return flags


def host_markdown(b: Breakdown) -> list[str]:
    ranks = [r for r in b.ranks if r.host is not None]
    if not ranks:
        return []
    lines = [f"## Host side per {_step_kind(b)} step", "",
             "The CPU-side `record_function` ranges (`user_annotation`) of the thread that launches the GPU work. A step's "
             "host side runs from the start of the outermost range around the launch of its first kernel to the same "
             "point of the next step; a range counts in the step in which it starts, with its whole duration (not "
             "clipped). ms/step: the median over the steps of the summed duration of a range name's calls (numbers in "
             "names ignored); share: of the median step time above. A range enclosing others keeps its whole duration "
             "and lists them under *encloses*; its self time is that duration minus the ranges inside it, so self times "
             "never count an instant twice. `ProfilerStep#` ranges are left out (they are the step).", ""]
    for r in ranks:
        h = r.host
        if len(ranks) > 1:
            lines += [f"### rank {r.rank}", ""]
        if h["ranges"]:
            lines.append(f"Rank {r.rank}, {h['thread']} ({h['thread_is']}), median of {h['steps_used']} step(s):")
            lines += ["", "| range | calls/step | ms/step | share of step | self ms/step | encloses |",
                      "|---|---:|---:|---:|---:|---|"]
            for row in h["ranges"][:TOP_RANGES]:
                lines.append(f"| `{_short(row['name'])}` | {row['calls_per_step']:g} | {_ms(row['us_per_step'])} | "
                             f"{_pct(None if row['share_of_step'] is None else 100 * row['share_of_step'])} | "
                             f"{_ms(row['self_us_per_step'])} | {', '.join(_short(n, 60) for n in row['encloses'])} |")
            lines.append("")
            more = len(h["ranges"]) - TOP_RANGES
            tail = f"; {more} more range name(s) in breakdown.json" if more > 0 else ""
            if h["host_step_us"] is not None:
                lines.append(f"Host step {_ms(h['host_step_us'])} ms, of which {_ms(h['outside_ranges_us'])} ms in no range{tail}.")
            elif tail:
                lines.append(tail[2:].capitalize() + ".")
        flags = _host_flags(h)
        notes = [n for n in h["notes"] if not n.startswith("no host ranges")]
        lines += [f"- {n}" for n in flags + notes]
        lines.append("")
    return lines


def host_summary_lines(b: Breakdown, top: int = 5) -> list[str]:
    """Console lines: each rank's heaviest host ranges per step, and whether those figures are inflated or absent."""
    out = []
    for r in b.ranks:
        h = r.host
        if h is None:
            continue
        if h["ranges"]:
            parts = [f"{row['name']} {_ms(row['us_per_step'])}" + (" (encloses others)" if row["encloses"] else "")
                     for row in h["ranges"][:top]]
            out.append(f"host side per step, ms (rank {r.rank}, median of {h['steps_used']}): " + ", ".join(parts))
        elif h["notes"]:
            out.append(f"host side (rank {r.rank}): {h['notes'][0]}")
        flags = [f for f in _host_flags(h) if not f.startswith("no host ranges")]
        out += [f"host side (rank {r.rank}): {f}" for f in flags]
    return out


def ceilings_markdown(c: dict) -> list[str]:
    shape = c["shape"]
    lines = [
        f"## Against the ceilings: {c['gpu_display_name']} ({c['model']}, batch {shape['batch']}, context {shape['context']}, "
        f"TP{shape['tp']} PP{shape['pp']}, experts {shape['expert_dtype']}"
        + (f", shared experts and dense MLPs {shape['dense_dtype']}"
           if shape.get("dense_dtype") not in (None, shape["expert_dtype"]) else "")
        + f", attention {shape['attention_dtype']}, KV {shape['kv_dtype']})",
        "",
    ]
    peaks = ", ".join(
        f"{d} {p['dense']:g} dense" + (f" / {p['sparse']:g} sparse" if p.get("sparse") else "")
        for d, p in c["peaks_tflops"].items()
        if p.get("dense")
    )
    lines.append(f"Peaks (TFLOPS): {peaks}; memory bandwidth {c['bandwidth_gbs']:g} GB/s. "
                 "The sparse figures are NVIDIA's headline numbers (2:4 structured sparsity); dense is what a GEMM can reach.")
    lines.append("")
    lines.append("| category | GFLOP | MB | FLOP/B | compute dtype | t mem (µs) | t compute (µs) | floor (µs) | bound | measured (µs) | % of BW | % of dense peak | % of sparse peak | floor / measured |")
    lines.append("|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for cat, row in c["categories"].items():
        lines.append(
            f"| {cat} | {row['flops'] / 1e9:.2f} | {row['bytes'] / 1e6:.2f} | {_sci(row['intensity_flop_per_byte'])} | {row['compute_dtype'] or '-'} | "
            f"{_us(row['t_memory_us'])} | {_us(row['t_compute_us'])} | {_us(row['floor_us'])} | {row['bound']} | {_us(row['measured_summed_us'])} | "
            f"{_pct(row['pct_of_bandwidth'])} | {_pct(row['pct_of_compute_dense'])} | {_pct(row['pct_of_compute_sparse'])} | {_pct(row['floor_over_measured_pct'])} |"
        )
    lines.append("")
    if c["step_floor_us"] is not None:
        lines.append(f"Step floor (sum of category floors; other/memcpy not modelled): {_us(c['step_floor_us'])} µs vs measured median step "
                     f"{_us(c['measured_step_us'])} µs ({_pct(c['step_floor_over_measured_pct'])}).")
    else:
        lines.append(f"Step floor without all-reduce (no all-reduce figures for this GPU in hardware.yaml): {_us(c['step_floor_partial_us'])} µs; "
                     f"measured median step {_us(c['measured_step_us'])} µs.")
    lines.append("")
    for cat, row in c["categories"].items():
        if row.get("notes"):
            lines.append(f"- {cat}: {row['notes']}")
    return lines


def _short(name: str, limit: int = 110) -> str:
    name = name.replace("|", "\\|")
    return name if len(name) <= limit else name[: limit - 3] + "..."


def plot_breakdown(b: Breakdown, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = b.categories
    ranks = [f"rank {r.rank}" for r in b.ranks]
    per_step = all(r.steps_reliable for r in b.ranks)
    # without reliable steps, the whole trace: bars that are right rather than per-step bars that look right
    figures = [r.median_step if per_step else {"idle_us": r.idle_us, "exposed_us": r.exposed_us, "summed_us": r.summed_us}
               for r in b.ranks]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.6 * len(ranks) + 2.8), sharey=True)
    for ax, key, label in ((axes[0], "exposed_us", "exposed time + idle"), (axes[1], "summed_us", "summed kernel time")):
        left = [0.0] * len(ranks)
        parts = cats + (["idle"] if key == "exposed_us" else [])
        for c in parts:
            vals = [(f["idle_us"] if c == "idle" else f[key][c]) / 1000.0 for f in figures]
            ax.barh(ranks, vals, left=left, color=COLORS.get(c, "#7f7f7f"), label=c)
            left = [x + v for x, v in zip(left, vals)]
        ax.set_xlabel(f"ms per {_step_kind(b)} step (median)" if per_step else "ms, whole trace (no reliable step boundaries)")
        ax.set_title(label)
        ax.invert_yaxis()
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.suptitle(title(b), fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def plot_roofline(c: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    bw = c["bandwidth_gbs"] * 1e9
    fig, ax = plt.subplots(figsize=(8, 5.5))
    x = np.logspace(-1, 4, 200)
    styles = {"nvfp4": "-", "fp8": "--", "bf16": ":"}
    for dtype, peak in c["peaks_tflops"].items():
        if not peak.get("dense") or dtype not in styles:
            continue
        for kind in ("dense", "sparse"):
            p = peak.get(kind)
            if not p:
                continue
            y = np.minimum(x * bw, p * 1e12) / 1e12
            ax.plot(x, y, styles[dtype], color="black" if kind == "dense" else "grey", lw=1.2 if kind == "dense" else 0.8,
                    label=f"{dtype} {kind} {p:g} TFLOPS")
    for cat, row in c["categories"].items():
        if row["intensity_flop_per_byte"] and row["achieved_tflops"]:
            ax.scatter([row["intensity_flop_per_byte"]], [row["achieved_tflops"]], s=60, color=COLORS.get(cat, "#333"), zorder=5,
                       label=f"{cat} ({_pct(row['pct_of_bandwidth'])} of BW)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s (summed kernel time)")
    shape = c["shape"]
    ax.set_title(f"{c['gpu_display_name']}: decode step, batch {shape['batch']}, context {shape['context']}, TP{shape['tp']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def write_reports(b: Breakdown, out: str | Path, png: bool = True) -> dict[str, Path]:
    out = output_dir(out)
    paths = {"json": out / "breakdown.json", "markdown": out / "breakdown.md"}
    write_text_atomic(paths["json"], json.dumps(b.to_dict(), indent=1) + "\n")
    write_text_atomic(paths["markdown"], markdown(b))
    written = set(paths.values())
    if png:
        try:
            paths["png"] = plot_breakdown(b, out / "breakdown.png")
            if b.ceilings:
                paths["roofline"] = plot_roofline(b.ceilings, out / "roofline.png")
        except ImportError:
            write_text_atomic(out / "PLOTS_SKIPPED.txt", "matplotlib is not installed: pip install 'glm5-fp4[profiling]'\n")
            written.add(out / "PLOTS_SKIPPED.txt")
    # an earlier run's plots beside this run's JSON would be read as this run's (a roofline of other ceilings)
    for name in ("breakdown.png", "roofline.png", "PLOTS_SKIPPED.txt"):
        if out / name not in written | set(paths.values()):
            (out / name).unlink(missing_ok=True)
    return paths
