"""Result files and human-readable summaries of one load-test run.

Files for a run with stem S, side by side so `compare` can find the per-request data:
  S.json            summary with vLLM's key names (+ metadata, errors, telemetry)
  S.requests.jsonl  one row per request: status/error, start time, TTFT, every ITL, token counts
  S.md              markdown tables of the same numbers
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest.metrics import METRICS
from glm5_fp4.outputs import output_dir, write_texts_together

LATENCY_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL", "chunk_itl": "chunk ITL"}
THROUGHPUT_ROWS = (
    ("completed", "Completed requests", "{:d}"),
    ("failed", "Failed requests", "{:d}"),
    ("duration", "Duration (s)", "{:.2f}"),
    ("total_input_tokens", "Input tokens", "{:d}"),
    ("total_output_tokens", "Output tokens", "{:d}"),
    ("request_throughput", "Request throughput (req/s)", "{:.3f}"),
    ("request_goodput", "Request goodput (req/s)", "{:.3f}"),
    ("output_throughput", "Output throughput (tok/s)", "{:.1f}"),
    ("total_token_throughput", "Total token throughput (tok/s)", "{:.1f}"),
    ("output_throughput_per_user", "Output tok/s per user (1/TPOT)", "{:.2f}"),
    ("max_output_tokens_per_s", "Peak output tok/s (1 s bins)", "{:.0f}"),
    ("max_concurrent_requests", "Peak requests in one 1 s bucket (vLLM's; counts finished ones too)", "{:d}"),
    ("mean_tokens_per_chunk", "Tokens per SSE chunk", "{:.3f}"),
    ("client_cpu_util", "Client CPU (share of one core)", "{:.0%}"),
)


def stem_for(result_path: str | Path) -> Path:
    p = Path(result_path)
    return p.with_suffix("") if p.suffix == ".json" else p


def requests_path_for(result_path: str | Path, result: dict[str, Any] | None = None) -> Path:
    p = Path(result_path)
    if result and result.get("requests_file"):
        return p.parent / result["requests_file"]
    return stem_for(p).with_name(stem_for(p).name + ".requests.jsonl")


def result_paths(result_path: str | Path) -> dict[str, Path]:
    """The three files of one run: S.json, S.requests.jsonl and S.md."""
    stem = stem_for(result_path)
    return {"json": stem.with_name(stem.name + ".json"), "requests": stem.with_name(stem.name + ".requests.jsonl"),
            "markdown": stem.with_name(stem.name + ".md")}


def write_results(result: dict[str, Any], rows: Iterable[dict[str, Any]], result_path: str | Path) -> dict[str, Path]:
    """Write S.json, S.requests.jsonl and S.md, all or none (a summary beside another run's requests reads as one
    run); returns their paths."""
    paths = result_paths(result_path)
    output_dir(paths["json"].parent, "--result-dir")
    result["requests_file"] = paths["requests"].name
    texts = {"requests": "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows),
             "json": json.dumps(result, indent=2, default=_json_default) + "\n",
             "markdown": markdown_summary(result) + "\n"}
    write_texts_together({paths[key]: text for key, text in texts.items()})
    return paths


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_requests(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a .requests.jsonl (or .jsonl.gz), each checked for what `compare` resamples; errors name
    file:line and the field. (`profile stalls` reads the same files for other fields, with its own checks.)"""
    path = Path(path)
    gz = path.name.endswith(".gz")
    rows = []
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if gz else path.open(encoding="utf-8")) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise Glm5Fp4Error(f"{path}:{n}: not JSON ({exc.msg}); the file is truncated or "
                                       "corrupt") from None
                check_request_row(row, f"{path}:{n}")
                rows.append(row)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        what = "corrupt or truncated gzip" if gz and not isinstance(exc, UnicodeDecodeError) else "unreadable"
        raise Glm5Fp4Error(f"{path}: {what} per-request file ({exc})") from None
    return rows


def check_request_row(row: Any, where: str) -> None:
    """An ok row needs every number the bootstrap resamples; a failed row only its status."""
    if not isinstance(row, dict):
        raise Glm5Fp4Error(f"{where}: a request row must be a JSON object, not {type(row).__name__}")
    if not isinstance(row.get("status"), str):
        raise Glm5Fp4Error(f"{where}: field 'status' is {json.dumps(row.get('status'))}, expected a string")
    if row["status"] != "ok":
        return
    for key in ("ttft_ms", "e2el_ms", "tpot_ms"):
        if key not in row:
            raise Glm5Fp4Error(f"{where}: an ok request has no field {key!r}")
        if not is_finite_number(row[key]):
            raise Glm5Fp4Error(f"{where}: field {key!r} is {json.dumps(row[key])}, expected a finite number")
    if not is_count(row.get("output_tokens")):
        raise Glm5Fp4Error(f"{where}: field 'output_tokens' is {json.dumps(row.get('output_tokens'))}, "
                           "expected a count (integer >= 0)")
    for key in ("itl_ms", "chunk_itl_ms"):
        if key in row and not (isinstance(row[key], list) and all(is_finite_number(x) for x in row[key])):
            raise Glm5Fp4Error(f"{where}: field {key!r} must be a list of finite numbers")


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def latency_names(result: dict[str, Any]) -> list[str]:
    return [m for m in (*METRICS, "chunk_itl") if f"mean_{m}_ms" in result]


def percentile_columns(result: dict[str, Any], name: str = "ttft") -> list[str]:
    """The percentile words present for a metric, e.g. ['50', '90', '99']."""
    suffix = f"_{name}_ms"
    words = [k[1:-len(suffix)] for k in result if k.startswith("p") and k.endswith(suffix)]
    return sorted(words, key=float)


def describe_run(result: dict[str, Any]) -> str:
    meta = result.get("metadata", {})
    parts = [
        f"model `{result.get('model_id')}`",
        f"endpoint {meta.get('endpoint', '?')}",
        f"concurrency {result.get('max_concurrency')}",
        f"rate {result.get('request_rate')}",
        f"input {meta.get('input_len')} / output {meta.get('output_len')} tokens",
        f"{result.get('num_prompts')} prompts",
    ]
    return ", ".join(parts)


def counting_notes(result: dict[str, Any]) -> list[str]:
    """Where the token counts came from, when it is not the server's usage on every chunk."""
    notes = []
    source = result.get("input_tokens_source")
    if source and not source.startswith("server"):
        notes.append(f"Input tokens: {source}")
    methods = result.get("token_count_method") or {}
    if set(methods) - {"usage"}:
        listed = ", ".join(f"{k} ({v})" for k, v in sorted(methods.items()))
        notes.append(f"Tokens per chunk counted from: {listed} requests (no running usage from the server)")
    if result.get("token_count_note"):
        notes.append(f"Token counting: {result['token_count_note']}")
    return notes


def short_outputs_note(result: dict[str, Any]) -> str | None:
    """How many completed requests ended before their requested output length, and what that means here."""
    n, done = result.get("short_outputs"), result.get("completed")
    if not n or not done:
        return None
    meta = result.get("metadata") or {}
    share = f"{n} of {done} ({n / done:.0%}) completed requests ended before the requested output length"
    if meta.get("ignore_eos") or meta.get("min_tokens"):
        return (f"{share}, although ignore_eos / min_tokens asked for it: the server did not honour them, so the "
                "run measured a lighter workload than asked (compare refuses it)")
    return f"{share} (no ignore_eos / min_tokens: the model stopped where it liked)"


def markdown_summary(result: dict[str, Any]) -> str:
    lines = [f"### Load test {result.get('label') or ''}".rstrip(), "", describe_run(result) + f" ({result.get('date')})", ""]
    if result.get("partial"):
        verdict = "Run failed" if result.get("run_failed") else "Partial result"
        lines += [f"**{verdict}:** {result.get('failure_reason') or result.get('abort_reason')}", ""]
    short = short_outputs_note(result)
    if short:
        lines += [f"**Short outputs:** {short}", ""]
    lines += ["| Metric | Value |", "|---|---|"]
    for key, label, fmt in THROUGHPUT_ROWS:
        if key in result:
            lines.append(f"| {label} | {_fmt(result[key], fmt)} |")
    pcts = percentile_columns(result)
    lines += ["", "| Latency (ms) | mean | median | std | " + " | ".join(f"p{p}" for p in pcts) + " |",
              "|---|" + "---:|" * (3 + len(pcts))]
    for m in latency_names(result):
        cells = [result.get(f"{s}_{m}_ms") for s in ("mean", "median", "std")]
        cells += [result.get(f"p{p}_{m}_ms") for p in pcts]
        lines.append(f"| {LATENCY_LABELS[m]} | " + " | ".join(_fmt(c, "{:.2f}") for c in cells) + " |")
    notes = counting_notes(result)
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    if result.get("errors_by_kind"):
        lines += ["", "| Failure | Requests |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(result["errors_by_kind"].items())]
    return "\n".join(lines)


def print_summary(result: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(stderr=False)
    title = "Load test" + (f" - {result['label']}" if result.get("label") else "")
    t = Table(title=title, caption=describe_run(result), show_header=True, header_style="bold")
    t.add_column("Metric")
    t.add_column("Value", justify="right")
    for key, label, fmt in THROUGHPUT_ROWS:
        if key in result:
            t.add_row(label, _fmt(result[key], fmt))
    console.print(t)
    pcts = percentile_columns(result)
    lt = Table(show_header=True, header_style="bold")
    lt.add_column("Latency (ms)")
    for c in ("mean", "median", "std", *(f"p{p}" for p in pcts)):
        lt.add_column(c, justify="right")
    for m in latency_names(result):
        cells = [result.get(f"{s}_{m}_ms") for s in ("mean", "median", "std")]
        cells += [result.get(f"p{p}_{m}_ms") for p in pcts]
        lt.add_row(LATENCY_LABELS[m], *(_fmt(c, "{:.2f}") for c in cells))
    console.print(lt)
    for note in counting_notes(result):
        console.print(f"[yellow]note:[/] {note}")
    if result.get("errors_by_kind"):
        et = Table(title="Failures", show_header=True, header_style="bold red")
        et.add_column("kind")
        et.add_column("requests", justify="right")
        et.add_column("first message")
        for k, v in sorted(result["errors_by_kind"].items()):
            et.add_row(k, str(v), (result.get("first_errors") or {}).get(k, "")[:100])
        console.print(et)
    short = short_outputs_note(result)
    if short:
        console.print(f"[bold yellow]Short outputs:[/] {short}", highlight=False)
    if result.get("partial"):
        verdict = "[bold red]run failed:[/]" if result.get("run_failed") else "[bold yellow]partial result:[/]"
        console.print(f"{verdict} {result.get('failure_reason') or result.get('abort_reason')}")


class ProgressBar:
    """tqdm over requests, with live output tok/s, in-flight and failures in the postfix."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, leave=True)
        self._last_done = 0
        self._last_tokens = 0
        self._last_t: float | None = None

    def update(self, done: int, tokens: int, in_flight: int, failed: int, now: float) -> None:
        if self.bar is None:
            return
        if self._last_t is not None and now > self._last_t:
            rate = (tokens - self._last_tokens) / (now - self._last_t)
            self.bar.set_postfix_str(f"out {rate:,.0f} tok/s, running {in_flight}, failed {failed}", refresh=False)
        self._last_t, self._last_tokens = now, tokens
        self.bar.update(done - self._last_done)
        self._last_done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
