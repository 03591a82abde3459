"""The telemetry time series: in-memory columns, the on-disk files, and loading them back.

A run directory holds
  telemetry.jsonl          one JSON object per sample per GPU: {"t": s since start, "gpu": i, metric: value...}
  telemetry_meta.json      GPUs, which metrics each reports, phase marks, sampler cost; rewritten as the run goes
  telemetry_summary.json   summary() at the end of the run (see summary.py)
  telemetry.png / .md      written by report.py
Metrics a GPU does not support are absent from its lines (the metadata lists them), and so are the
slow metrics (sampler.slow_metrics: memory clock, memory used, temperature, throttle) in the ticks
that do not read them; a metric whose read failed in one sample is null there.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.inputs import read_json, read_text
from glm5_fp4.outputs import write_text_atomic

FORMAT = "glm5-fp4-telemetry/1"
SAMPLES_FILE = "telemetry.jsonl"
META_FILE = "telemetry_meta.json"
SUMMARY_FILE = "telemetry_summary.json"
PNG_FILE = "telemetry.png"
MARKDOWN_FILE = "telemetry.md"
NO_TELEMETRY = "no GPU telemetry"

# numeric metric -> (unit label, decimals kept in the JSONL file)
METRICS: dict[str, tuple[str, int]] = {
    "power_w": ("W", 2),  # nvmlDeviceGetPowerUsage (averaged over ~1 s on Ampere and newer)
    "power_inst_w": ("W", 2),  # NVML_FI_DEV_POWER_INSTANT, where the driver has it
    "sm_mhz": ("MHz", 0),
    "mem_mhz": ("MHz", 0),
    "util_gpu": ("%", 0),
    "util_mem": ("%", 0),  # memory-controller busy time, NVML's "memory utilisation"
    "mem_used_mib": ("MiB", 1),
    "temp_c": ("C", 0),
    "pcie_tx_mbs": ("MB/s", 3),  # from NVML's 32-bit byte counters (wrap every 4 GiB; see nvml_reader.py)
    "pcie_rx_mbs": ("MB/s", 3),
    "energy_j": ("J", 3),  # NVML total-energy counter, relative to the run's first sample
}
NAN = float("nan")
_ABSENT = object()
_isfinite = math.isfinite


@dataclass
class GpuSeries:
    """All samples of one GPU as columns; NaN where a sample lacks a metric."""

    index: int
    name: str = ""
    uuid: str = ""
    metrics: list[str] = field(default_factory=list)  # the metrics this GPU reports
    unsupported: list[str] = field(default_factory=list)
    t: array = field(default_factory=lambda: array("d"))
    values: dict[str, array] = field(default_factory=lambda: {m: array("d") for m in METRICS})
    throttle: list[tuple[str, ...] | None] = field(default_factory=list)  # None: not read in that sample
    # metric -> readings present but null/NaN/inf; absent metrics (slow, unsupported) are not counted
    nonfinite: dict[str, int] = field(default_factory=dict)

    def append(self, t: float, sample: dict[str, Any]) -> None:
        self.t.append(t)
        get = sample.get
        for key, column in self.values.items():
            v = get(key, _ABSENT)
            if v is _ABSENT:
                column.append(NAN)
            elif v is None or not _isfinite(v):
                self.nonfinite[key] = self.nonfinite.get(key, 0) + 1
                column.append(NAN)
            else:
                column.append(v)
        reasons = get("throttle")
        self.throttle.append(None if reasons is None else tuple(reasons))

    def __len__(self) -> int:
        return len(self.t)

    def copy(self) -> GpuSeries:
        return replace(
            self,
            metrics=list(self.metrics),
            unsupported=list(self.unsupported),
            t=self.t[:],
            values={k: v[:] for k, v in self.values.items()},
            throttle=self.throttle[:],
            nonfinite=dict(self.nonfinite),
        )

    def info(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "uuid": self.uuid,
            "metrics": list(self.metrics),
            "unsupported": list(self.unsupported),
        }


@dataclass
class TelemetryRun:
    """One recording: metadata, phase marks and per-GPU series (empty when telemetry was unavailable)."""

    available: bool
    reason: str | None = None
    interval_s: float = 0.1
    start_unix: float | None = None
    start_monotonic: float | None = None  # time.monotonic() at t=0, to align with other monotonic logs
    end_s: float | None = None
    driver: str | None = None
    gpus: list[GpuSeries] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)
    sampler: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # problems found while loading, for the summary

    @property
    def duration_s(self) -> float:
        if self.end_s is not None:
            return self.end_s
        ends = [g.t[-1] for g in self.gpus if len(g)]
        marks = [t for t, _ in self.marks]
        return max(ends + marks + [0.0])

    def snapshot(self) -> TelemetryRun:
        """A copy that later samples and marks do not change."""
        return replace(
            self,
            gpus=[g.copy() for g in self.gpus],
            marks=list(self.marks),
            sampler=dict(self.sampler),
            warnings=list(self.warnings),
        )

    def meta(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "available": self.available,
            "reason": self.reason,
            "interval_s": self.interval_s,
            "start_unix": self.start_unix,
            "start_monotonic": self.start_monotonic,
            "end_s": self.end_s,
            "driver": self.driver,
            "gpus": [g.info() for g in self.gpus],
            "marks": [{"t": round(t, 4), "name": name} for t, name in self.marks],
            "sampler": dict(self.sampler),  # a copy: it is written out after the lock is let go
        }


# key -> formatter of its value as a JSON number, rounded to what the sensor resolves
_FORMAT = {key: ("{:.%df}" % decimals).format for key, (_, decimals) in METRICS.items()}


def sample_line(t: float, gpu: int, sample: dict[str, Any]) -> str:
    """One compact JSONL line. Runs for every sample of every GPU, so it formats by hand (~7 µs,
    against ~12 µs for round() + json); keys are our own identifiers and throttle names are
    [a-z0-9_], so nothing needs escaping."""
    parts = ['{"t":', f"{t:.4f}", ',"gpu":', str(gpu)]
    for key, value in sample.items():
        parts.append(f',"{key}":')
        fmt = _FORMAT.get(key)
        if fmt is None:  # "throttle": a tuple of reason names
            parts.append("null" if value is None else "[" + ",".join(f'"{name}"' for name in value) + "]")
        elif value is None or not _isfinite(value):
            parts.append("null")
        else:
            parts.append(fmt(value))
    parts.append("}")
    return "".join(parts)


def write_json_atomic(path: Path, data: Any) -> None:
    """Readers (a report run while recording) never see a half-written file."""
    write_text_atomic(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def _number(value: Any, where: str, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Glm5Fp4Error(f"{where} is {value!r}, expected a number")
    return float(value)


def _run_from_meta(meta: Any, meta_path: Path) -> TelemetryRun:
    """The run described by telemetry_meta.json, every field checked: a hand-edited or foreign file
    gets one error naming the field instead of a TypeError from deep in the summary."""
    if not isinstance(meta, dict):
        raise Glm5Fp4Error(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise Glm5Fp4Error(f"{meta_path}: field 'format' is {meta.get('format')!r}, expected {FORMAT!r}")
    interval = _number(meta.get("interval_s"), f"{meta_path}: field 'interval_s'", allow_none=True)
    if interval is not None and interval <= 0:
        raise Glm5Fp4Error(f"{meta_path}: field 'interval_s' is {interval!r}, expected a positive number")
    marks_raw = meta.get("marks") or []
    gpus_raw = meta.get("gpus") or []
    if not isinstance(marks_raw, list):
        raise Glm5Fp4Error(f"{meta_path}: field 'marks' is {marks_raw!r}, expected a list of {{t, name}}")
    if not isinstance(gpus_raw, list):
        raise Glm5Fp4Error(f"{meta_path}: field 'gpus' is {gpus_raw!r}, expected a list of GPU objects")
    marks = []
    for i, m in enumerate(marks_raw):
        if not isinstance(m, dict) or not isinstance(m.get("name"), str):
            raise Glm5Fp4Error(f"{meta_path}: marks[{i}] is {m!r}, expected {{\"t\": seconds, \"name\": text}}")
        marks.append((_number(m.get("t"), f"{meta_path}: marks[{i}].t"), m["name"]))
    sampler = meta.get("sampler") or {}
    if not isinstance(sampler, dict):
        raise Glm5Fp4Error(f"{meta_path}: field 'sampler' is {sampler!r}, expected an object")
    run = TelemetryRun(
        available=bool(meta.get("available")),
        reason=meta.get("reason"),
        interval_s=interval or 0.1,
        start_unix=_number(meta.get("start_unix"), f"{meta_path}: field 'start_unix'", allow_none=True),
        start_monotonic=_number(meta.get("start_monotonic"), f"{meta_path}: field 'start_monotonic'", allow_none=True),
        end_s=_number(meta.get("end_s"), f"{meta_path}: field 'end_s'", allow_none=True),
        driver=meta.get("driver"),
        marks=marks,
        sampler=sampler,
    )
    seen: set[int] = set()
    for i, g in enumerate(gpus_raw):
        where = f"{meta_path}: gpus[{i}]"
        if not isinstance(g, dict):
            raise Glm5Fp4Error(f"{where} is {g!r}, expected an object with 'index'")
        index = g.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            raise Glm5Fp4Error(f"{where}.index is {index!r}, expected an integer")
        if index in seen:
            raise Glm5Fp4Error(f"{where}.index {index} is listed twice")
        seen.add(index)
        lists = {}
        for key in ("metrics", "unsupported"):
            value = g.get(key, [])
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise Glm5Fp4Error(f"{where}.{key} is {value!r}, expected a list of metric names")
            lists[key] = value
        run.gpus.append(
            GpuSeries(
                index=index,
                name=str(g.get("name", "")),
                uuid=str(g.get("uuid", "")),
                metrics=list(lists["metrics"]),
                unsupported=list(lists["unsupported"]),
            )
        )
    return run


def load_run(run_dir: str | os.PathLike) -> TelemetryRun:
    """Read a run directory written by TelemetrySampler (or `glm5-fp4 telemetry record`)."""
    run_dir = Path(run_dir)
    meta_path = run_dir / META_FILE
    if not run_dir.is_dir():
        raise Glm5Fp4Error(f"{run_dir}: not a directory with telemetry")
    if not meta_path.is_file():
        raise Glm5Fp4Error(f"{meta_path}: missing; is {run_dir} a telemetry directory?")
    run = _run_from_meta(read_json(meta_path, "telemetry meta file"), meta_path)
    by_index = {g.index: g for g in run.gpus}
    samples_path = run_dir / SAMPLES_FILE
    if run.available:
        if not samples_path.is_file():
            raise Glm5Fp4Error(f"{samples_path}: missing, but {meta_path} says telemetry was recorded")
        lines = read_text(samples_path, "telemetry samples file").splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                gpu = int(row["gpu"])
                t = float(row["t"])
                if not _isfinite(t):
                    raise ValueError(f"time {row['t']!r} is not finite")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                # A recording killed mid-write leaves a torn last line; anything else is corruption.
                if lineno == len(lines):
                    break
                raise Glm5Fp4Error(f"{samples_path}:{lineno}: not a telemetry sample ({exc})") from exc
            if gpu not in by_index:
                raise Glm5Fp4Error(f"{samples_path}:{lineno}: GPU {gpu} is not listed in {meta_path}")
            bad = [k for k in METRICS if k in row and row[k] is not None and not isinstance(row[k], (int, float))]
            if bad:
                raise Glm5Fp4Error(f"{samples_path}:{lineno}: field {bad[0]!r} is {row[bad[0]]!r}, expected a number")
            by_index[gpu].append(t, row)
    return run
