"""Concurrency sweeps: one load test per level, a table, and the curves people ask for.

Files in the result dir: c<N>.json / .requests.jsonl / .md per level, sweep.json, sweep.md,
sweep_throughput_tpot.png (output tok/s and TPOT vs concurrency) and sweep_pareto.png
(tok/s per user vs total tok/s - or per GPU with --num-gpus - one point per level).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.outputs import output_dir, save_figure, write_text_atomic

SWEEP_COLUMNS = (
    ("max_concurrency", "concurrency", "{}"),
    ("completed", "ok", "{}"),
    ("failed", "failed", "{}"),
    ("request_throughput", "req/s", "{:.3f}"),
    ("output_throughput", "out tok/s", "{:.1f}"),
    ("output_throughput_per_user", "tok/s/user", "{:.2f}"),
    ("mean_ttft_ms", "mean TTFT ms", "{:.1f}"),
    ("p99_ttft_ms", "p99 TTFT ms", "{:.1f}"),
    ("mean_tpot_ms", "mean TPOT ms", "{:.2f}"),
    ("p99_tpot_ms", "p99 TPOT ms", "{:.2f}"),
    ("p99_itl_ms", "p99 ITL ms", "{:.2f}"),
)

_SUMMARY_DROP = ("metadata", "first_errors", "telemetry")


def run_sweep(base: Mapping[str, Any], levels: Sequence[int]) -> dict[str, Any]:
    """Run `base` (LoadTestConfig fields) once per concurrency level; write files and plots.

    A level that cannot run at all (the server stopped answering, most often: the way a sweep finds its limit) ends
    the sweep: it is recorded as a failed level with its reason, the levels after it as not run, and the sweep's files
    are written from what ran. Only when the first level cannot run is there nothing to write: its error is raised."""
    from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest

    if not levels:
        raise Glm5Fp4Error("--concurrency: a sweep needs at least one level")
    results: list[dict[str, Any]] = []
    for level in levels:
        fields = dict(base)
        fields.update(concurrency=int(level), result_filename=f"c{level}.json", print_summary=True)
        try:
            results.append(run_loadtest(LoadTestConfig(**fields)))
        except Glm5Fp4Error as exc:
            if not results:
                raise
            results.append({"max_concurrency": int(level), "completed": 0, "failed": None, "partial": True,
                            "run_failed": True, "failure_reason": f"the level could not run: {exc}"})
            break
        except KeyboardInterrupt:
            # outside a level's measured phase (its warm-up, its tokenizer lookup): nothing of this level to keep,
            # but the levels before it are the sweep's result; the interrupt still ends the command (130 / 143)
            if results:
                _write_sweep(base, results, [int(x) for x in levels[len(results):]])
            raise
        if results[-1].get("stopped_by"):  # Ctrl-C or SIGTERM: this level's results are written; run no more
            break
    return _write_sweep(base, results, [int(x) for x in levels[len(results):]])


def _write_sweep(base: Mapping[str, Any], results: list[dict[str, Any]], not_run: list[int]) -> dict[str, Any]:
    result_dir = base.get("result_dir")
    summary = [{k: v for k, v in r.items() if k not in _SUMMARY_DROP} for r in results]
    out: dict[str, Any] = {"results": results, "summary": summary, "files": {}, "not_run": not_run}
    if result_dir:
        d = output_dir(result_dir, "--result-dir")
        write_text_atomic(d / "sweep.json", json.dumps(summary, indent=2, default=str) + "\n")
        write_text_atomic(d / "sweep.md", sweep_markdown(results, not_run) + "\n")
        out["files"] = {"json": d / "sweep.json", "markdown": d / "sweep.md", **plot_sweep(results, d)}
    return out


def sweep_markdown(results: Sequence[Mapping[str, Any]], not_run: Sequence[int] = ()) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in SWEEP_COLUMNS) + " |", "|" + "---:|" * len(SWEEP_COLUMNS)]
    for r in results:
        cells = []
        for key, _, fmt in SWEEP_COLUMNS:
            v = r.get(key)
            cells.append("-" if v is None else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    failed = [f"- concurrency {r['max_concurrency']}: {r.get('failure_reason')}"
              for r in results if r.get("run_failed")]
    if failed:
        lines += ["", "Failed levels:", *failed]
    if not_run:
        lines += ["", f"Levels not run (the sweep stopped): {', '.join(map(str, not_run))}"]
    return "\n".join(lines)


def _points(rs: Sequence[Mapping[str, Any]], xkey: str, ykey: str) -> tuple[list, list]:
    """The (x, y) pairs of the levels that measured both (a level with no TPOT sample has no tokens/s per user)."""
    pts = [(r.get(xkey), r.get(ykey)) for r in rs]
    pts = [(x, y) for x, y in pts if x is not None and y is not None]
    return [x for x, _ in pts], [y for _, y in pts]


def plot_sweep(results: Sequence[Mapping[str, Any]], out_dir: str | Path) -> dict[str, Path]:
    """Two PNGs (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    rs = sorted(results, key=lambda r: r["max_concurrency"])
    label = next((r.get("label") or r.get("model_id") for r in rs if r.get("label") or r.get("model_id")), "")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(*_points(rs, "max_concurrency", "output_throughput"), "o-", label="output tok/s")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("output tokens/s (total)")
    ax1.set_title("Throughput vs concurrency")
    ax1.grid(True, alpha=0.3)
    drawn = False
    for key, style, what in (("mean_tpot_ms", "o-", "mean TPOT"), ("p99_tpot_ms", "s--", "p99 TPOT")):
        xs, ys = _points(rs, "max_concurrency", key)
        if xs:
            ax2.plot(xs, ys, style, label=what)
            drawn = True
    if not drawn:  # --percentile-metrics without tpot, or one-token outputs
        ax2.text(0.5, 0.5, "no TPOT measured", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("TPOT (ms)")
    ax2.set_title("TPOT vs concurrency")
    ax2.grid(True, alpha=0.3)
    if drawn:
        ax2.legend()
    fig.suptitle(label)
    fig.tight_layout()
    p1 = out / "sweep_throughput_tpot.png"
    save_figure(fig, p1)
    plt.close(fig)

    ran = [r for r in rs if r.get("output_throughput") is not None]  # a level that could not run has no rates
    per_gpu = bool(ran) and all(r.get("output_throughput_per_gpu") is not None for r in ran)
    ykey = "output_throughput_per_gpu" if per_gpu else "output_throughput"
    fig, ax = plt.subplots(figsize=(6, 4.5))
    measured = [r for r in rs if r.get("output_throughput_per_user") is not None and r.get(ykey) is not None]
    xs, ys = [r["output_throughput_per_user"] for r in measured], [r[ykey] for r in measured]
    ax.plot(xs, ys, "o-")
    for x, y, r in zip(xs, ys, measured):
        ax.annotate(f"c={r['max_concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if not measured:
        ax.text(0.5, 0.5, "no TPOT measured", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("output tokens/s per user (1000 / mean TPOT)")
    ax.set_ylabel("output tokens/s per GPU" if per_gpu else "output tokens/s (total)")
    ax.set_title(f"Throughput vs interactivity {label}".strip())
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    p2 = out / "sweep_pareto.png"
    save_figure(fig, p2)
    plt.close(fig)
    return {"throughput_tpot_png": p1, "pareto_png": p2}
