"""Reading torch-profiler (Kineto) Chrome traces: one file per rank, as vLLM and SGLang write them.

Only what the breakdown needs is kept, as numpy columns: GPU kernels / memcpy / memset records (name, start,
duration, stream, correlation id), the correlation ids of CUDA-graph launches, launch times of runtime calls
(to map kernels onto CPU-side annotations) and the annotations (``ProfilerStep#``, vLLM's step ranges and the
user's own ``record_function`` ranges, CPU side and their GPU projections, one range however many streams
Kineto projected it on) from which steps are found, the CPU-side ranges again with the thread that ran them
(what the host did in each step), and how many ``python_function`` events Python tracing left. A trace without
GPU records falls back to CPU mode: its ``cpu_op`` events stand in for kernels, so a CPU run gets the same report.

The rank comes from the file name (vLLM ``..._dp0_pp0_tp3_..._rank3.<ts>.pt.trace.json.gz``, SGLang
``...-TP-3[-PP-1][-DECODE].trace.json.gz``, ``....rank3.trace.json.gz``), else from ``distributedInfo``.
"""

from __future__ import annotations

import gc
import gzip
import hashlib
import json
import math
import os
import re
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

from glm5_fp4.errors import Glm5Fp4Error

try:  # optional: roughly 2x faster parsing of large traces
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET, KIND_CPU_OP = 0, 1, 2, 3
_GPU_CATS = {
    "kernel": KIND_KERNEL,
    "Kernel": KIND_KERNEL,
    "gpu_memcpy": KIND_MEMCPY,
    "Memcpy": KIND_MEMCPY,
    "gpu_memset": KIND_MEMSET,
    "Memset": KIND_MEMSET,
}
_RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "Runtime", "Driver"}
_ANNOTATION_CATS = {"user_annotation", "gpu_user_annotation", "cpu_op"}
STEP_PREFIX = "ProfilerStep#"
# vLLM's model runner annotates every forward as e.g. `execute_context_0(0)_generation_4(4)`: the requests (and
# their tokens) with a prefill chunk in this forward, then those decoding.
VLLM_STEP_RE = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")


def vllm_step_batch(name: str) -> dict[str, int] | None:
    """The batch a vLLM execute range names (prefill / decode requests and tokens), None for other names."""
    m = VLLM_STEP_RE.match(name)
    if m is None:
        return None
    return dict(zip(("prefill_reqs", "prefill_tokens", "decode_reqs", "decode_tokens"), map(int, m.groups())))


def is_engine_step(name: str) -> bool:
    """A step range written by the profiler (``ProfilerStep#N``) or the engine (vLLM's execute annotation)."""
    return name.startswith(STEP_PREFIX) or VLLM_STEP_RE.match(name) is not None

_VLLM_NAME = re.compile(r"dp(\d+)_pp(\d+)_tp(\d+)(?:_dcp\d+)?(?:_ep\d+)?_rank(\d+)")
_SGLANG_NAME = re.compile(r"-TP-(\d+)(?:-DP-(\d+))?(?:-PP-(\d+))?(?:-EP-(\d+))?(?:-(EXTEND|DECODE))?")
_RANK_NAME = re.compile(r"(?:^|[._-])rank[_-]?(\d+)(?:[._-]|$)")
_TRACE_SUFFIXES = (".json", ".json.gz")
MAX_JOBS = 4
# Hosts' clocks may disagree (collectives.py matches the ranks' collectives across that), so disjoint profiling
# windows closer than this are not taken for two captures on timing alone. One capture starts the profiler on every
# rank at once; two captures (another load, a restarted server) lie seconds to hours apart.
MAX_CLOCK_SKEW_S = 1.0
# One GPU record (kernel, memcpy) of a profiled capture: longer is a corrupt field
MAX_GPU_RECORD_US = 3600e6


@dataclass
class NameFromFile:
    rank: int | None = None
    tp: int | None = None
    pp: int | None = None
    stage: str | None = None
    scheme: str | None = None


def parse_trace_name(file_name: str) -> NameFromFile:
    """Rank / TP / PP / stage encoded in a trace file name by vLLM or SGLang (all None if none is)."""
    m = _VLLM_NAME.search(file_name)
    if m:
        return NameFromFile(rank=int(m[4]), tp=int(m[3]), pp=int(m[2]), scheme="vllm")
    m = _SGLANG_NAME.search(file_name)
    if m:
        pp = int(m[3]) if m[3] is not None else 0
        return NameFromFile(rank=None, tp=int(m[1]), pp=pp, stage=m[5], scheme="sglang")
    m = _RANK_NAME.search(file_name)
    if m:
        return NameFromFile(rank=int(m[1]), scheme="rank")
    return NameFromFile()


@dataclass
class RankTrace:
    """One rank's trace, reduced to the columns the analysis needs. Times are µs from ``origin_ns``."""

    path: Path
    rank: int
    rank_source: str
    tp_rank: int | None
    pp_rank: int | None
    stage: str | None
    mode: str  # "gpu" (kernels) or "cpu" (cpu_op events stand in for kernels)
    device_name: str | None
    names: list[str]
    name_id: np.ndarray
    start: np.ndarray
    dur: np.ndarray
    stream: np.ndarray
    corr: np.ndarray
    kind: np.ndarray
    graph_corrs: np.ndarray
    launch_corr: np.ndarray
    launch_ts: np.ndarray
    # annotations as (start, end, name), time-sorted: user_annotation (CPU side; also ProfilerStep# cpu_ops) and
    # gpu_user_annotation (Kineto's projection of a CPU range onto the GPU: from its first kernel to its last)
    annotations_gpu: list[tuple[float, float, str]]
    annotations_cpu: list[tuple[float, float, str]]
    origin_ns: int
    distributed: dict | None = None
    n_events: int = 0
    notes: list[str] = field(default_factory=list)
    # CPU-side user_annotation ranges as (start, dur, name, thread index into ``threads``), time-sorted; the
    # duration is the trace's own figure, so per-step sums of it are exact
    host_ranges: list[tuple[float, float, str, int]] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)  # "pid P tid T"
    launch_thread: np.ndarray | None = None  # thread index of each launch call, aligned with launch_corr
    n_python_events: int = 0
    digest: str = ""  # of the trace's JSON text
    trace_id: str | None = None  # Kineto's id of this trace (one per rank and capture)
    trace_name: str | None = None  # the path the profiler wrote the trace to, whatever it is called now

    @property
    def n_kernels(self) -> int:
        return int(self.start.size)

    @property
    def end(self) -> np.ndarray:
        return self.start + self.dur


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise Glm5Fp4Error(f"{path}: cannot read trace ({exc.strerror or exc})") from None
    if not raw.strip():
        raise Glm5Fp4Error(f"{path}: empty trace file")
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = _gunzip(raw)
        except zlib.error as exc:
            raise Glm5Fp4Error(f"{path}: corrupt or truncated gzip trace ({exc})") from None
        if not raw.strip():
            raise Glm5Fp4Error(f"{path}: empty trace (gzip holds no data)")
    elif path.name.endswith(".gz"):
        raise Glm5Fp4Error(f"{path}: named .gz but is not gzip data")
    return raw


def _gunzip(raw: bytes) -> bytes:
    """Every member of a gzip file, as gunzip reads them: zlib.decompress stops after the first without a word. One
    zlib call per member (wbits=47 reads the gzip header and checks the trailer) is faster than GzipFile."""
    members = []
    while raw:
        member = zlib.decompressobj(47)
        members.append(member.decompress(raw))
        if not member.eof:
            raise zlib.error("incomplete or truncated stream")
        raw = member.unused_data.lstrip(b"\x00")  # gzip allows zero padding between and after members
    return b"".join(members)


class NotATrace(Glm5Fp4Error):
    """Valid JSON that is not a Kineto/Chrome trace (a report, a config, notes next to the traces)."""


def _parse_json(raw: bytes, path: Path) -> dict:
    try:
        data = _orjson.loads(raw) if _orjson is not None else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        # json.JSONDecodeError and orjson.JSONDecodeError are both ValueErrors
        raise Glm5Fp4Error(f"{path}: corrupt or truncated trace JSON ({str(exc)[:200]})") from None
    if isinstance(data, list) and all(isinstance(e, dict) for e in data[:100]):  # the bare-array Chrome trace form
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise NotATrace(f"{path}: not a Kineto/Chrome trace (no 'traceEvents' list)")
    return data


def load_trace(path: str | Path, mode: str = "auto") -> RankTrace:
    """Read one trace file. ``mode``: "auto" (GPU records if any, else CPU ops), "gpu" or "cpu"."""
    # Parsing builds millions of small containers and the cyclic GC would rescan them over and over;
    # JSON has no cycles, so pausing it halves the load time of a large trace.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _load_trace(Path(path), mode)
    finally:
        if enabled:
            gc.enable()


def _load_trace(path: Path, mode: str) -> RankTrace:
    raw = _read_bytes(path)
    # of the JSON text, so a .json and its .json.gz (or a copy) agree; ranks of one capture never do (rank, device)
    digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
    data = _parse_json(raw, path)
    del raw  # the text of a large trace is gigabytes; free it before the columns are built
    events = data["traceEvents"]
    if not events:
        raise Glm5Fp4Error(f"{path}: trace has no events")

    name_index: dict[str, int] = {}
    names: list[str] = []
    gpu_rows: list[tuple] = []
    cpu_rows: list[tuple] = []
    graph_corrs: list[int] = []
    launch_rows: list[tuple[int, float, int]] = []
    pieces_gpu: list[tuple[float, float, str, str, object]] = []  # (start, end, name, stream, External id)
    marks_cpu: list[tuple[float, float, str]] = []
    host_rows: list[tuple[float, float, str, int]] = []
    thread_index: dict[tuple, int] = {}
    want_cpu = mode in ("auto", "cpu")
    n_python = 0

    def thread_of(ev: dict) -> int:
        key = (ev.get("pid"), ev.get("tid"))
        idx = thread_index.get(key)
        if idx is None:
            idx = thread_index[key] = len(thread_index)
        return idx

    def intern(name: str) -> int:
        idx = name_index.get(name)
        if idx is None:
            idx = name_index[name] = len(names)
            names.append(name)
        return idx

    bad = 0
    bad_gpu: list[str] = []  # the GPU records are what every figure is made of: one bad one fails the read
    devices: set = set()
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            bad += 1
            continue
        cat = ev.get("cat")
        if cat == "python_function":  # most events of a trace with Python tracing on: count them, keep nothing
            n_python += 1
            continue
        kind = _GPU_CATS.get(cat)
        try:
            if kind is not None:
                args = ev.get("args") or {}
                ts, dur = _time_field(ev, "ts"), _time_field(ev, "dur", 0.0)
                # a GPU record of a profiled step lasts far under an hour: longer is a corrupt field, which took
                # every idle microsecond of the steps it covered without a word
                if not 0 <= dur <= MAX_GPU_RECORD_US:
                    raise ValueError(f"dur {dur!r}")
                if not isinstance(args, dict):
                    raise ValueError(f"args {type(args).__name__}")
                if "device" in args:
                    devices.add(args["device"])
                gpu_rows.append(
                    (
                        intern(str(ev.get("name", "?"))),
                        ts,
                        dur,
                        int(args.get("stream", ev.get("tid", 0)) or 0),
                        int(args.get("correlation", -1)),
                        kind,
                    )
                )
            elif cat in _RUNTIME_CATS:
                args = ev.get("args") or {}
                corr = args.get("correlation")
                if corr is not None:
                    launch_rows.append((int(corr), float(ev["ts"]), thread_of(ev)))
                    if "GraphLaunch" in ev.get("name", ""):
                        graph_corrs.append(int(corr))
            elif cat in _ANNOTATION_CATS:
                name = str(ev.get("name", ""))
                if cat != "cpu_op" or is_engine_step(name):
                    mark = (float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)), name)
                    if cat == "gpu_user_annotation":
                        args = ev.get("args")
                        ext = args.get("External id") if isinstance(args, dict) else None
                        pieces_gpu.append((*mark, str(ev.get("tid")), ext))
                    else:
                        marks_cpu.append(mark)
                    if cat == "user_annotation" and ev.get("ph", "X") == "X":
                        host_rows.append((mark[0], max(float(ev.get("dur", 0.0)), 0.0), name, thread_of(ev)))
                elif want_cpu and ev.get("ph") == "X":
                    cpu_rows.append(
                        (intern(str(name)), float(ev["ts"]), float(ev.get("dur", 0.0)), int(ev.get("tid", 0) or 0), -1, KIND_CPU_OP)
                    )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            bad += 1
            if kind is not None:
                bad_gpu.append(f"event {i} ({cat} {str(ev.get('name', '?'))[:60]!r}): "
                               f"{'no ' + str(exc) if isinstance(exc, KeyError) else exc}")

    if bad_gpu:
        raise Glm5Fp4Error(f"{path}: {len(bad_gpu)} GPU records cannot be read (a missing or non-numeric time, a "
                           "negative duration or one over an hour, non-object args or a non-integer stream / "
                           f"correlation; first: {bad_gpu[0]}); torch.profiler writes none such, and every figure of "
                           "the breakdown is made of them")
    if len(devices) > 1:  # one timeline per GPU: merged, two GPUs' kernel times add up and their idle time vanishes
        listed = ", ".join(str(d) for d in sorted(devices, key=str))
        raise Glm5Fp4Error(f"{path}: kernels of {len(devices)} GPUs (devices {listed}) in one file; the breakdown "
                           "reads one GPU per file, as vLLM and SGLang write them (one process per GPU)")
    if mode == "gpu" and not gpu_rows:
        raise Glm5Fp4Error(
            f"{path}: no GPU kernel records (cat 'kernel'/'gpu_memcpy'/'gpu_memset'); "
            "was the profiler started with CUDA activities?"
        )
    if gpu_rows:
        rows, trace_mode = gpu_rows, "gpu"
    elif cpu_rows:
        rows, trace_mode = cpu_rows, "cpu"
    else:
        raise Glm5Fp4Error(
            f"{path}: no GPU kernels and no CPU ops in {len(events)} events; not a torch.profiler trace of a model run"
        )

    table = np.array(rows, dtype=np.float64)
    order = np.argsort(table[:, 1], kind="stable")
    table = table[order]
    t0 = float(table[0, 1])
    base_ns = _base_time_ns(data.get("baseTimeNanoseconds"), path)
    origin_ns = base_ns + int(round(t0 * 1000.0))

    launch = np.array(launch_rows, dtype=np.float64).reshape(-1, 3)
    launch = launch[np.argsort(launch[:, 0], kind="stable")]
    notes = []
    if bad:
        notes.append(f"{bad} malformed events skipped")
    device_name = None
    props = data.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict):
        name = props[0].get("name")
        device_name = name if isinstance(name, str) else None  # (a foreign value: the GPU is then not named)
    dist = data.get("distributedInfo") if isinstance(data.get("distributedInfo"), dict) else None

    def shift(marks: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
        return sorted((s - t0, e - t0, n) for s, e, n in marks)

    return RankTrace(
        path=path,
        rank=-1,
        rank_source="",
        tp_rank=None,
        pp_rank=None,
        stage=None,
        mode=trace_mode,
        device_name=device_name if trace_mode == "gpu" else "CPU",
        names=names,
        name_id=table[:, 0].astype(np.int32),
        start=table[:, 1] - t0,
        dur=np.maximum(table[:, 2], 0.0),
        stream=table[:, 3].astype(np.int64),
        corr=table[:, 4].astype(np.int64),
        kind=table[:, 5].astype(np.int8),
        graph_corrs=np.unique(np.array(graph_corrs, dtype=np.int64)),
        launch_corr=launch[:, 0].astype(np.int64),
        launch_ts=launch[:, 1] - t0,
        annotations_gpu=shift(_join_stream_pieces(pieces_gpu)),
        annotations_cpu=shift(marks_cpu),
        origin_ns=origin_ns,
        distributed=dist,
        n_events=len(events),
        notes=notes,
        host_ranges=sorted((s - t0, d, n, th) for s, d, n, th in host_rows),
        threads=[f"pid {pid} tid {tid}" for pid, tid in thread_index],
        launch_thread=launch[:, 2].astype(np.int64),
        n_python_events=n_python,
        digest=digest,
        trace_id=str(data["trace_id"]) if data.get("trace_id") else None,
        trace_name=data["traceName"] if isinstance(data.get("traceName"), str) else None,
    )


def _join_stream_pieces(pieces: list[tuple[float, float, str, str, object]]) -> list[tuple[float, float, str]]:
    """One range per CPU range from its GPU projections, which Kineto writes once per (device, stream): a step whose
    sampled tokens are copied back on another stream has a second piece, not inside the first, that would otherwise
    be a step of its own. Pieces sharing a name and an External id (the CPU range's) are one range; a piece without
    an id joins the range of its name before it if that holds nothing on its stream yet and the piece overlaps it
    or lies nearer to it than to the next piece of that name."""
    by_id: dict[tuple, list] = {}
    items: dict[str, list[list]] = {}  # per name: [start, end, streams, has id]
    for start, end, name, stream, ext in pieces:
        if ext and isinstance(ext, (int, str)):  # Kineto numbers ranges from 1: 0 or none is no id
            item = by_id.get((name, ext))
            if item is None:
                item = by_id[(name, ext)] = [start, end, set(), True]
                items.setdefault(name, []).append(item)
            item[0], item[1] = min(item[0], start), max(item[1], end)
            item[2].add(stream)
        else:
            items.setdefault(name, []).append([start, end, {stream}, False])
    out = []
    for name, members in items.items():
        members.sort(key=lambda m: (m[0], m[1]))
        ranges: list[list] = []
        for i, item in enumerate(members):
            prev = ranges[-1] if ranges else None
            next_start = members[i + 1][0] if i + 1 < len(members) else math.inf
            if (prev is not None and not item[3] and not item[2] & prev[2]
                    and (item[0] <= prev[1] or item[0] - prev[1] < next_start - item[1])):
                prev[1] = max(prev[1], item[1])
                prev[2] |= item[2]
            else:
                ranges.append(item)
        out += [(a, b, name) for a, b, *_ in ranges]
    return out


def find_trace_files(path: str | Path) -> list[Path]:
    """Trace files in a directory (not recursive) or the single file given."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise Glm5Fp4Error(f"{path}: no such trace file or directory")
    candidates = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(_TRACE_SUFFIXES))
    # vLLM's `bench forward` writes <case>.rank<r>.kernels.json next to its traces: not a Kineto trace
    candidates = [p for p in candidates if not p.name.endswith((".kernels.json", ".kernels.json.gz"))]
    named = [p for p in candidates if ".trace.json" in p.name]
    files = named or candidates
    if not files:
        raise Glm5Fp4Error(f"{path}: no .json or .json.gz trace files in this directory")
    return files


def _select_stage(files: list[Path], stage: str | None, notes: list[str]) -> list[Path]:
    stages = {parse_trace_name(p.name).stage for p in files}
    if stage is None and {"DECODE", "EXTEND"} <= stages:
        stage = "DECODE"
        notes.append("SGLang wrote per-stage traces; analysing the DECODE ones (use --stage to choose)")
    if stage is None or stage.lower() == "all":
        return files
    chosen = [p for p in files if (parse_trace_name(p.name).stage or "").upper() == stage.upper()]
    if not chosen:
        raise Glm5Fp4Error(f"no trace file with stage {stage!r} among {[p.name for p in files]}")
    return chosen


def _load_or_skip(path: Path, mode: str) -> RankTrace | None:
    """The trace, or None for a JSON file that is not one (a directory of traces also holds other files)."""
    try:
        return load_trace(path, mode=mode)
    except NotATrace:
        return None


def _load_all(files: list[Path], mode: str, jobs: int | None, notes: list[str]) -> list[RankTrace]:
    jobs = min(jobs or os.cpu_count() or 1, len(files), MAX_JOBS)
    if jobs <= 1:
        loaded = [_load_or_skip(p, mode) for p in files]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            loaded = list(pool.map(_load_or_skip, files, [mode] * len(files)))
    skipped = [p.name for p, t in zip(files, loaded) if t is None]
    if len(skipped) == len(files):
        raise Glm5Fp4Error(f"{files[0].parent}: no trace among its JSON files ({', '.join(skipped)} have no 'traceEvents')")
    if skipped:
        notes.append(f"skipped {len(skipped)} JSON file(s) that are not traces: {', '.join(skipped)}")
    return [t for t in loaded if t is not None]


def load_rank_traces(
    path: str | Path, mode: str = "auto", stage: str | None = None, jobs: int | None = None
) -> tuple[list[RankTrace], list[str]]:
    """All ranks' traces under ``path``, each with its rank; returns (traces sorted by rank, notes).

    ``jobs`` processes parse files in parallel (default: one per CPU, at most 4: each holds a parsed trace).
    """
    notes: list[str] = []
    files = find_trace_files(path)
    frontend = [p for p in files if "async_llm" in p.name]
    if frontend and len(frontend) < len(files):
        notes.append(f"skipped vLLM front-end trace(s) without GPU work: {', '.join(p.name for p in frontend)}")
        files = [p for p in files if p not in frontend]
    files = _select_stage(files, stage, notes)

    traces = _load_all(files, mode, jobs, notes) if len(files) > 1 or Path(path).is_dir() else [load_trace(files[0], mode)]
    modes = {t.mode for t in traces}
    if len(modes) > 1:
        cpu_files = [t.path.name for t in traces if t.mode == "cpu"]
        raise Glm5Fp4Error(f"mixed GPU and CPU-only traces; these have no GPU kernels: {', '.join(cpu_files)}")

    parsed = [parse_trace_name(t.path.name) for t in traces]
    tp_size = max((p.tp for p in parsed if p.tp is not None), default=-1) + 1
    for i, (t, p) in enumerate(zip(traces, parsed)):
        t.tp_rank, t.pp_rank, t.stage = p.tp, p.pp, p.stage
        dist_rank = t.distributed.get("rank") if t.distributed else None
        if p.rank is not None:
            t.rank, t.rank_source = p.rank, "file name"
        elif p.scheme == "sglang":
            t.rank, t.rank_source = (p.pp or 0) * tp_size + p.tp, "file name (TP/PP)"
        elif isinstance(dist_rank, int):
            t.rank, t.rank_source = dist_rank, "distributedInfo"
        else:
            t.rank, t.rank_source = i, "file order"
            if len(traces) > 1:
                notes.append(f"{t.path.name}: no rank in the file name or distributedInfo; using file order ({i})")
        if t.tp_rank is None:
            t.tp_rank = t.rank
        if t.pp_rank is None:
            t.pp_rank = 0

    _refuse_copies(traces)
    by_rank: dict[int, RankTrace] = {}
    for t in traces:
        if t.rank in by_rank:
            raise Glm5Fp4Error(
                f"two traces for rank {t.rank}: {by_rank[t.rank].path.name} and {t.path.name}; "
                "put each capture in its own directory"
            )
        by_rank[t.rank] = t
    ranked = [by_rank[r] for r in sorted(by_rank)]
    _refuse_mixed_captures(ranked)
    return ranked, notes


def _refuse_copies(traces: list[RankTrace]) -> None:
    """One trace saved twice (``x.json`` beside ``x.json.gz``, a copy) would be analysed as two ranks of a TP group
    whose collectives line up perfectly: ceilings for the wrong TP size, no wait at all. Kineto gives every trace
    its own trace_id; without one, equal JSON is looked for where only the file order numbers the ranks (a copy
    whose name or distributedInfo carries a rank collides on that rank instead)."""
    seen: dict[tuple[str, str], RankTrace] = {}
    for t in traces:
        keys = ([("trace_id", t.trace_id)] if t.trace_id else []) + \
            ([("content", t.digest)] if t.rank_source == "file order" else [])
        for key in keys:
            first = seen.setdefault(key, t)
            if first is not t:
                why = f"trace_id {t.trace_id}" if key[0] == "trace_id" else "the same JSON"
                raise Glm5Fp4Error(f"{first.path.name} and {t.path.name} are the same trace ({why}), saved twice; "
                                   "keep one of them")


def _window_ns(t: RankTrace) -> tuple[int, int]:
    """The span of the trace's records on the absolute clock the profiler writes (ns)."""
    return t.origin_ns, t.origin_ns + (int(float(t.end.max()) * 1000.0) if t.n_kernels else 0)


def _capture_dir(t: RankTrace) -> str | None:
    if not t.trace_name or "/" not in t.trace_name:
        return None
    return str(PurePosixPath(t.trace_name).parent)


def _refuse_mixed_captures(traces: list[RankTrace]) -> None:
    """Ranks of one capture were profiled together: a directory holding ranks of different captures (rank 0 of one
    run, rank 1 of another) would pair collectives that never met and report their timing gap as wait."""
    if len(traces) < 2:
        return
    sizes = {t.distributed.get("world_size"): t for t in traces if t.distributed and t.distributed.get("world_size")}
    if len(sizes) > 1:
        (na, a), (nb, b) = list(sizes.items())[:2]
        raise Glm5Fp4Error(f"{a.path.name} (world_size {na}) and {b.path.name} (world_size {nb}) come from "
                           "different captures; put each capture in its own directory")
    late = max(traces, key=lambda t: _window_ns(t)[0])
    early = min(traces, key=lambda t: _window_ns(t)[1])
    gap_s = (_window_ns(late)[0] - _window_ns(early)[1]) / 1e9
    if gap_s <= 0:
        return  # some moment every rank was being profiled: one capture, whatever else differs
    dirs = {d: t for t in traces if (d := _capture_dir(t)) is not None}
    if len(dirs) > 1:
        (da, a), (db, b) = list(dirs.items())[:2]
        raise Glm5Fp4Error(f"{a.path.name} (rank {a.rank}) and {b.path.name} (rank {b.rank}) come from different "
                           f"captures: their profiling windows do not overlap and the profiler wrote them to {da} and "
                           f"{db}; put each capture in its own directory")
    if gap_s > MAX_CLOCK_SKEW_S:
        raise Glm5Fp4Error(f"{early.path.name} (rank {early.rank}) and {late.path.name} (rank {late.rank}) do not "
                           f"overlap in time: the second starts {gap_s:.1f} s after the first ends, yet one capture "
                           "profiles all its ranks at once (or do the hosts' clocks differ by more than "
                           f"{MAX_CLOCK_SKEW_S:g} s?); put each capture in its own directory")


def _base_time_ns(value: object, path: Path) -> int:
    """The trace's clock origin (ns; absent: 0): ranks' clocks are lined up by it, so a foreign value is refused."""
    if value is None:
        return 0
    try:
        if isinstance(value, (bool, list, dict)):
            raise TypeError
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise Glm5Fp4Error(f"{path}: baseTimeNanoseconds {repr(value)[:60]} is not an integer (the trace's clock "
                           "origin in ns, as torch.profiler writes it)") from None


def _time_field(ev: dict, key: str, default: float | None = None) -> float:
    """A record's time field (µs) as a finite float; ValueError naming the field otherwise (KeyError if absent)."""
    v = ev[key] if default is None else ev.get(key, default)
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = math.nan
    if isinstance(v, bool) or not math.isfinite(f):
        raise ValueError(f"{key} {v!r}")
    return f


def trim_trace(src: str | Path, dst: str | Path, keep_cpu_ops: bool = False) -> tuple[int, int]:
    """Copy a trace keeping only what the analysis reads (GPU records, launch calls, annotations, the cpu_ops the
    loader reads and the header), e.g. to commit a small test fixture, so that the copy analyses as the source does.
    ``keep_cpu_ops``: every cpu_op, read or not. Returns (events kept, events in the source)."""
    src = Path(src)
    data = _parse_json(_read_bytes(src), src)
    keep_cats = set(_GPU_CATS) | _RUNTIME_CATS | {"user_annotation", "gpu_user_annotation"}
    events = data["traceEvents"]
    # a CPU run's cpu_ops are its kernels; in a GPU trace the loader reads only the step ranges among them
    # (older torch writes ProfilerStep# as a cpu_op)
    all_cpu_ops = keep_cpu_ops or not any(isinstance(e, dict) and e.get("cat") in _GPU_CATS for e in events)

    def read(e: dict) -> bool:
        if e.get("cat") == "cpu_op":
            return all_cpu_ops or is_engine_step(str(e.get("name", "")))
        return e.get("cat") in keep_cats or e.get("ph") == "M"

    kept = [e for e in events if isinstance(e, dict) and read(e)]
    write_trace({**data, "traceEvents": kept}, dst)
    return len(kept), len(events)


def trim_traces(src: str | Path, dst: str | Path, keep_cpu_ops: bool = False) -> list[tuple[str, int, int, int]]:
    """trim_trace for every trace of ``src`` into directory ``dst``, all or nothing: the files are written to a
    temporary directory next to ``dst`` and moved in only when every one trimmed. A capture missing a rank would
    otherwise be read later as a complete capture with fewer ranks. Returns (name, kept, total, bytes) per file."""
    import shutil
    import tempfile

    from glm5_fp4.outputs import output_dir

    files = find_trace_files(src)
    dst = output_dir(dst, "DST", create=False)
    if dst.exists() and any(f.parent.resolve() == dst.resolve() for f in files):
        # the trimmed files would replace the full ones they were read from
        raise Glm5Fp4Error(f"DST {dst} holds the traces being trimmed (SRC {src}); trim into another directory")
    created = next((p for p in reversed([dst, *dst.parents]) if not p.exists()), None)  # the topmost new one
    output_dir(dst.parent, "DST")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.trim-", dir=dst.parent))
    try:
        done = []
        for f in files:
            try:
                kept, total = trim_trace(f, tmp / f.name, keep_cpu_ops=keep_cpu_ops)
            except Glm5Fp4Error as exc:
                raise Glm5Fp4Error(f"{exc} (nothing written to {dst}: a trim keeps every rank or none)") from None
            done.append((f.name, kept, total, (tmp / f.name).stat().st_size))
        output_dir(dst, "DST")
        for name, *_ in done:
            os.replace(tmp / name, dst / name)
        return done
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_trace(data: dict, path: str | Path) -> Path:
    """Write a trace dict as JSON (gzip when the name ends in .gz), the way torch.profiler does."""
    path = Path(path)
    payload = json.dumps(data).encode()
    if path.name.endswith(".gz"):
        with gzip.open(path, "wb", compresslevel=1) as fh:
            fh.write(payload)
    else:
        path.write_bytes(payload)
    return path
