"""``glm5-fp4 profile stalls``: what each server process's host was doing, from :mod:`host_sampler` files, and in
particular while no token reached any client.

Input: a folder of ``host-<pid>.jsonl`` files (``GLM5_FP4_HOST_SAMPLES``), optionally the per-request records of
load tests run against the server meanwhile (``*.requests.jsonl[.gz]``: start time, TTFT, inter-token latencies).

Per process (named by its process title, e.g. vLLM's ``VLLM::EngineCore``): each thread's samples split into
*waiting* (the innermost frame is a blocking wait: a lock, a queue, select/poll, sleep, a socket receive) and
*busy* (anything else, which includes C calls made from the innermost frame: a device synchronisation shows as the
Python line that asked for it), the most frequent busy stacks of the main thread, garbage collections, and gaps in
which the sampler itself could not run (no Python code ran in the process: a C call held the GIL).

Stall windows: from the request records, every interval of at least ``min_gap_ms`` in which no token was delivered
to any client while some request was in flight (it had started before and ended after). For each window and
process: what the main thread was doing (sample shares of its stacks), the GC time and the sampler gaps inside.
Times are on one clock: the samplers and the load-test client run on the same machine and record unix time.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import math
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest import metrics
from glm5_fp4.outputs import output_dir, write_text_atomic
from glm5_fp4.profiling.host_sampler import ENV, FILE_PREFIX

DEFAULT_MIN_GAP_MS = metrics.STALL_MS
TOP_STACKS = 8
STACK_SHOWN = 7  # innermost frames printed per stack
MAX_WINDOWS = 12
MIN_WINDOW_SAMPLED = 0.5  # a window's share a process's samples must span for its shares to be reported

# Innermost frames that block: (file name, function) pairs, a function of any file, or any function of a file.
_WAIT_FUNCS = {"sleep", "sched_yield", "select", "poll", "epoll", "wait", "wait_for", "_wait", "acquire", "recv", "recv_multipart",
               "recv_pyobj", "_recv", "_recv_bytes", "accept", "get", "_poll", "_wait_for_tstate_lock", "readinto",
               "_handle_workers", "poll_for_event"}
_WAIT_FILES = {"threading.py", "selectors.py", "queue.py", "synchronize.py"}


def _base(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


# An event loop whose innermost Python frame is its run call is inside the C loop (uvloop, or asyncio's selector):
# waiting for I/O unless a C callback is running, which its CPU share then shows.
_LOOP_FRAMES = {("runners.py", "run"), ("base_events.py", "run_forever"), ("base_events.py", "run_until_complete")}


def is_waiting(stack: list[tuple]) -> bool:
    if not stack:
        return True
    file, func, _ = stack[0]
    return (func in _WAIT_FUNCS or _base(file) in _WAIT_FILES or (_base(file), func) in _LOOP_FRAMES
            or ("uvloop" in file and func == "run"))


def format_stack(stack: list[tuple], frames: int = STACK_SHOWN) -> str:
    """Innermost first: ``func (file:line) < caller (file:line) < ...``."""
    parts = [f"{func} ({_short(file)}:{line})" for file, func, line in stack[:frames]]
    return " < ".join(parts) + (" < ..." if len(stack) > frames else "")


def _short(path: str) -> str:
    p = path.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/", "/lib/python"):
        if marker in p:
            p = p.split(marker, 1)[1]
            break
    return p if p.count("/") <= 2 else "/".join(p.split("/")[-3:])


@dataclass
class Process:
    path: Path
    pid: int
    comm: str
    argv: list[str]
    t0_unix: float
    interval_ms: float
    main_tid: int | None
    threads: dict[int, str] = field(default_factory=dict)
    stacks: dict[int, list[tuple]] = field(default_factory=dict)
    runs: list[tuple[int, int, float, float, int, float]] = field(default_factory=list)  # tid, stack, first ms, last ms, samples, weight ms
    cpu: list[tuple[float, dict[int, int]]] = field(default_factory=list)  # ms, thread -> CPU ns so far
    gaps: list[tuple[float, float]] = field(default_factory=list)  # start ms, length ms
    gcs: list[tuple[float, float, int, int]] = field(default_factory=list)  # start ms, ms, generation, collected
    moe_calls: dict[str, int] = field(default_factory=dict)
    end_ms: float = 0.0
    complete: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.comm} (pid {self.pid})"

    def unix(self, ms: float) -> float:
        return self.t0_unix + ms / 1e3

    def thread_runs(self, tid: int | None):
        return [r for r in self.runs if r[0] == tid]


def _open_text(path: Path):
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def _read_lines(path: Path) -> tuple[list[str], bool]:
    """The file's lines (.jsonl, or .jsonl.gz as committed beside results) and whether a gzip stream ended early:
    what a process killed mid-write (or a copy cut short) leaves, whose lines up to there are still good."""
    lines: list[str] = []
    try:
        with _open_text(path) as f:
            for line in f:
                lines.append(line)
    except EOFError:
        return lines, True
    except (OSError, zlib.error, UnicodeDecodeError) as exc:
        raise Glm5Fp4Error(f"{path}: cannot read ({exc})") from None
    return lines, False


def load_process(path: Path) -> Process:
    proc = None
    lines, cut = _read_lines(path)
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as exc:
            if no == len(lines) and proc is not None:  # the process was killed mid-write: keep what came before
                proc.notes.append(f"last line truncated ({exc.msg})")
                break
            raise Glm5Fp4Error(f"{path}:{no}: not a JSON line ({exc.msg})") from None
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if proc is not None and proc.complete:
            raise Glm5Fp4Error(f"{path}:{no}: a {kind!r} record after its 'end' record: two runs wrote this file "
                               "(an older sampler appending under a reused pid); split or remove it")
        if proc is None:
            if kind != "process":
                raise Glm5Fp4Error(f"{path}:{no}: a host-sample file starts with a 'process' record, found {kind!r}")
            try:
                argv = rec.get("argv", [])
                if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                    raise ValueError(f"argv {argv!r} (a list of strings)")
                proc = Process(path, int(rec["pid"]), str(rec.get("comm", "?")), argv,
                               float(rec["t0_unix"]), float(rec["interval_ms"]), rec.get("main_tid"))
                if not (math.isfinite(proc.t0_unix) and math.isfinite(proc.interval_ms) and proc.interval_ms > 0):
                    raise ValueError(f"t0_unix {rec['t0_unix']!r}, interval_ms {rec['interval_ms']!r} "
                                     "(a finite time and a positive interval)")
            except KeyError as exc:
                raise Glm5Fp4Error(f"{path}:{no}: process record lacks {exc}") from None
            except (TypeError, ValueError) as exc:
                raise Glm5Fp4Error(f"{path}:{no}: malformed 'process' record ({exc})") from None
            continue
        try:
            if kind == "comm":
                proc.comm = str(rec["comm"])
            elif kind == "threads":
                proc.threads.update({int(k): v for k, v in rec["threads"].items()})
            elif kind == "stacks":
                stacks = {int(k): [tuple(f) for f in v] for k, v in rec["stacks"].items()}
                for sid, frames in stacks.items():  # (file, function, line) each, as host_sampler._stack writes
                    if not all(len(f) == 3 and isinstance(f[0], str) and isinstance(f[1], str)
                               and isinstance(f[2], int) for f in frames):
                        raise ValueError(f"stack {sid} has a frame that is not (file, function, line)")
                proc.stacks.update(stacks)
            elif kind == "runs":
                runs = [(int(t), int(s), float(a), float(b), int(n), float(w)) for t, s, a, b, n, w in rec["runs"]]
                bad = next((r for r in runs if not (r[3] >= r[2] and r[5] >= 0 and r[4] >= 0)), None)
                if bad is not None:
                    raise ValueError(f"run {list(bad)} ends before it starts or has a negative count or weight")
                proc.runs.extend(runs)
            elif kind == "cpu":
                proc.cpu.extend((float(ms), {int(k): int(v) for k, v in d.items()}) for ms, d in rec["cpu"])
            elif kind == "gaps":
                proc.gaps.extend((float(a), float(d)) for a, d in rec["gaps"])
            elif kind == "gc":
                proc.gcs.extend((float(a), float(d), int(g), int(c)) for a, d, g, c in rec["gc"])
            elif kind == "moe_calls":
                proc.moe_calls = {str(k): int(v) for k, v in rec["calls"].items()}
            elif kind in ("flush", "end"):
                proc.end_ms = max(proc.end_ms, float(rec["t_ms"]))
                proc.complete = proc.complete or kind == "end"
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise Glm5Fp4Error(f"{path}:{no}: malformed {kind!r} record ({type(exc).__name__}: {exc})") from None
    if proc is None:
        raise Glm5Fp4Error(f"{path}: empty host-sample file" + (" (or truncated before its first record)" if cut else ""))
    if cut:
        proc.notes.append("file truncated (its gzip stream ends early): samples up to the last complete line")
    proc.cpu.sort(key=lambda c: c[0])
    missing = {s for _, s, *_ in proc.runs} - set(proc.stacks)
    if missing:
        raise Glm5Fp4Error(f"{path}: runs refer to {len(missing)} stack id(s) never defined (e.g. {min(missing)})")
    if not proc.complete:
        proc.notes.append("no final record: the process did not exit normally (samples up to its last flush)")
    return proc


def check_folder(folder: Path) -> Path:
    """``folder`` as a host-sample folder: one error if it is a file (say, one of its host-<pid>.jsonl) or missing."""
    folder = Path(folder)
    if folder.is_file():
        raise Glm5Fp4Error(f"{folder} is a file; PATH is the folder of host-<pid>.jsonl files (its parent: "
                           f"{folder.parent})")
    if not folder.is_dir():
        raise Glm5Fp4Error(f"host-sample folder {folder} does not exist")
    return folder


def load(folder: Path) -> list[Process]:
    folder = check_folder(folder)
    files = sorted([*folder.glob(f"{FILE_PREFIX}*.jsonl"), *folder.glob(f"{FILE_PREFIX}*.jsonl.gz")])
    if not files:
        raise Glm5Fp4Error(f"{folder} holds no {FILE_PREFIX}<pid>.jsonl files (was {ENV} set for the server?)")
    for f in files:
        if f.is_dir():
            raise Glm5Fp4Error(f"{f}: a directory, not a host-sample file")
    procs = [load_process(f) for f in files]
    # one process saved twice (.jsonl beside its .jsonl.gz, a renamed copy) would be reported twice, and its samples
    # counted twice in every stall window
    seen: dict[tuple[int, float], Process] = {}
    for p in procs:
        first = seen.setdefault((p.pid, p.t0_unix), p)
        if first is not p:
            raise Glm5Fp4Error(f"{first.path.name} and {p.path.name} hold the same process (pid {p.pid}, sampled "
                               f"from unix time {p.t0_unix:.3f}); keep one of them")
    return procs


# ---------------------------------------------------------------------------------------------------------------
# Requests -> stall windows
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Request:
    start: float  # unix s
    end: float
    tokens: list[float]  # unix s of each delivery


def load_requests(path: Path) -> list[Request]:
    path = Path(path)
    if path.is_dir():
        raise Glm5Fp4Error(f"request records {path} is a directory; give a load test's .requests.jsonl(.gz) file")
    if not path.is_file():
        raise Glm5Fp4Error(f"request records {path} do not exist")
    out = []
    lines, cut = _read_lines(path)
    if cut:
        raise Glm5Fp4Error(f"{path}: truncated (its gzip stream ends early)")
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            r = json.loads(raw)
            if r.get("status", "ok") != "ok" or r.get("ttft_ms") is None:
                continue
            start = float(r["start_unix"])
            bad = _bad_time(r, start)
            times = metrics.delivery_times({**r, "start_s": start})
            end = start + float(r["e2el_ms"]) / 1e3 if r.get("e2el_ms") is not None else times[-1]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise Glm5Fp4Error(f"{path}:{no}: not a load-test request record ({type(exc).__name__}: {exc})") from None
        if bad:
            raise Glm5Fp4Error(f"{path}:{no}: {bad}")
        out.append(Request(start, max(end, times[-1]), times))
    if not out:
        raise Glm5Fp4Error(f"{path}: no successful request with a first token")
    return out


def _bad_time(r: dict, start: float) -> str | None:
    """What makes a record's times unusable, or None. One NaN gap puts every later delivery of the request at NaN,
    which sorts anywhere and turns into minutes of invented stall."""
    if not math.isfinite(start):
        return f"start_unix is {start!r}, not a finite time"
    key = "chunk_itl_ms" if "chunk_itl_ms" in r else "itl_ms"
    named = [("ttft_ms", r["ttft_ms"]), ("e2el_ms", r.get("e2el_ms"))]
    named += [(f"{key}[{i}]", v) for i, v in enumerate(metrics.chunk_itls_of(r) or [])]
    for name, value in named:
        if value is not None and not 0 <= float(value) < math.inf:
            return f"{name} is {value!r}, not a finite time >= 0"
    return None


def stall_windows(requests: list[Request], min_gap_ms: float = DEFAULT_MIN_GAP_MS) -> list[tuple[float, float, int]]:
    """The load test's stall windows (:func:`glm5_fp4.loadtest.metrics.stall_windows`) on unix time."""
    return metrics.stall_windows([(r.start, r.end, r.tokens) for r in requests], min_gap_ms)


# ---------------------------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------------------------
def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _window_weights(proc: Process, tid: int | None, w0: float, w1: float) -> Counter:
    """Sampled ms of thread ``tid`` per stack id inside unix window [w0, w1] (runs clipped pro rata)."""
    out: Counter = Counter()
    half = proc.interval_ms / 2
    for _, sid, first, last, _, weight in proc.thread_runs(tid):
        r0, r1 = proc.unix(first - half), proc.unix(last + half)
        ov = _overlap(r0, r1, w0, w1)
        if ov > 0:
            out[sid] += weight * ov / max(r1 - r0, 1e-9)
    return out


def cpu_share(proc: Process, tid: int | None, w0: float | None = None, w1: float | None = None) -> float | None:
    """CPU time / wall time of thread ``tid`` over [w0, w1] (unix s; None: the whole run).

    Readings come every CPU_EVERY_MS, except while a C call holds the GIL (the sampler cannot run), so the readings
    around a window can reach far back into busy time before it. The readings inside the window are used when they
    span at least half of it; the ones bracketing it otherwise.
    """
    pts = [(proc.unix(ms), d[tid]) for ms, d in proc.cpu if tid in d]
    if len(pts) < 2:
        return None
    if w0 is not None and w1 is not None:
        inside = [p for p in pts if w0 <= p[0] <= w1]
        if len(inside) >= 2 and inside[-1][0] - inside[0][0] >= 0.5 * (w1 - w0):
            pts = inside
            w0 = w1 = None
    lo = 0 if w0 is None else max([i for i, (t, _) in enumerate(pts) if t <= w0] or [0])
    hi = len(pts) - 1 if w1 is None else min([i for i, (t, _) in enumerate(pts) if t >= w1] or [len(pts) - 1])
    if hi <= lo:
        return None
    return (pts[hi][1] - pts[lo][1]) / 1e9 / (pts[hi][0] - pts[lo][0])


def _stack_rows(proc: Process, counts: Counter, total: float, top: int = TOP_STACKS) -> list[dict]:
    rows = []
    for sid, ms in counts.most_common(top):
        st = proc.stacks[sid]
        rows.append({"share": ms / total if total else 0.0, "ms": ms, "waiting": is_waiting(st),
                     "stack": format_stack(st)})
    return rows


def process_summary(proc: Process) -> dict:
    threads = {}
    for tid in sorted({r[0] for r in proc.runs}):
        runs = proc.thread_runs(tid)
        ms = sum(r[5] for r in runs)
        busy = sum(r[5] for r in runs if not is_waiting(proc.stacks[r[1]]))
        threads[tid] = {"name": proc.threads.get(tid, str(tid)), "ms": ms, "busy": busy / ms if ms else 0.0,
                        "cpu": cpu_share(proc, tid)}
    main = proc.main_tid
    main_busy = Counter()
    for _, sid, _, _, _, weight in proc.thread_runs(main):
        if not is_waiting(proc.stacks[sid]):
            main_busy[sid] += weight
    main_ms = sum(r[5] for r in proc.thread_runs(main))
    gens = defaultdict(list)
    for _, ms, gen, _ in proc.gcs:
        gens[gen].append(ms)
    gc = {str(g): {"count": len(v), "total_ms": sum(v), "max_ms": max(v)} for g, v in sorted(gens.items())}
    return {
        "pid": proc.pid, "label": proc.label, "argv": proc.argv, "seconds": proc.end_ms / 1e3,
        "interval_ms": proc.interval_ms, "threads": threads,
        "main_busy_share": (sum(main_busy.values()) / main_ms) if main_ms else 0.0,
        "main_cpu": cpu_share(proc, main),
        "main_top_busy": _stack_rows(proc, main_busy, main_ms),
        "gc": gc,
        "gaps": {"count": len(proc.gaps), "total_ms": sum(d for _, d in proc.gaps),
                 "max_ms": max((d for _, d in proc.gaps), default=0.0)},
        "moe_eager_calls": proc.moe_calls, "notes": proc.notes,
    }


def window_summary(procs: list[Process], window: tuple[float, float, int], t_ref: float) -> dict:
    w0, w1, flying = window
    per = []
    for proc in procs:
        if proc.unix(0) > w1 or proc.unix(proc.end_ms) < w0:
            continue
        weights = _window_weights(proc, proc.main_tid, w0, w1)
        total = sum(weights.values())
        gc_ms = sum(_overlap(proc.unix(a), proc.unix(a + d), w0, w1) for a, d, _, _ in proc.gcs) * 1e3
        gap_ms = sum(_overlap(proc.unix(a), proc.unix(a + d), w0, w1) for a, d in proc.gaps) * 1e3
        busy = sum(ms for sid, ms in weights.items() if not is_waiting(proc.stacks[sid]))
        sampled = _overlap(proc.unix(0), proc.unix(proc.end_ms), w0, w1) / max(w1 - w0, 1e-9)
        # under half the window sampled (or no main thread known): its shares would be a guess, not a measurement
        known = sampled >= MIN_WINDOW_SAMPLED and proc.main_tid is not None and total > 0
        per.append({"label": proc.label, "sampled_share": sampled, "main_sampled_ms": total,
                    "main_busy_share": busy / total if known else None,
                    "main_cpu": cpu_share(proc, proc.main_tid, w0, w1) if known else None,
                    "gc_ms": gc_ms, "sampler_gap_ms": gap_ms, "top": _stack_rows(proc, weights, total, 3)})
    # the process whose main thread ran most in the window first: the likeliest holder of the stall
    per.sort(key=lambda p: -(p["main_cpu"] or 0.0) * (p["main_busy_share"] or 0.0))
    return {"start_s": w0 - t_ref, "ms": (w1 - w0) * 1e3, "in_flight": flying, "processes": per}


def analyze(folder: Path, request_files: list[Path] = (), min_gap_ms: float = DEFAULT_MIN_GAP_MS) -> dict:
    procs = load(folder)
    out: dict = {"folder": str(folder), "processes": [process_summary(p) for p in procs], "request_files": []}
    for path in request_files:
        reqs = load_requests(path)
        t_ref = min(r.start for r in reqs)
        span = max(r.end for r in reqs) - t_ref
        if not any(_overlap(p.unix(0), p.unix(p.end_ms), t_ref, t_ref + span) > 0 for p in procs):
            # every window would list no process: a report of stalls with nothing to say about them
            lo, hi = min(p.unix(0) for p in procs), max(p.unix(p.end_ms) for p in procs)
            raise Glm5Fp4Error(f"{path}: its requests ({_utc(t_ref)} + {span:.0f} s) lie outside the sampled time of "
                               f"every process in {folder} ({_utc(lo)} + {hi - lo:.0f} s); records of another run?")
        wins = stall_windows(reqs, min_gap_ms)
        covered = [p.label for p in procs if p.unix(0) <= t_ref and p.unix(p.end_ms) >= t_ref + span]
        out["request_files"].append({
            "path": str(path), "requests": len(reqs), "seconds": span, "min_gap_ms": min_gap_ms,
            "stalls": len(wins), "stalled_s": sum(b - a for a, b, _ in wins), "processes_covering": covered,
            "windows": [window_summary(procs, w, t_ref) for w in sorted(wins, key=lambda w: w[0] - w[1])[:MAX_WINDOWS]],
        })
    return out


def _utc(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _pct_or_na(x: float | None) -> str:
    return "n/a" if x is None else _pct(x)


def markdown(result: dict) -> str:
    lines = [f"# Host samples: {result['folder']}", ""]
    for p in result["processes"]:
        lines += [f"## {p['label']}", "", f"`{' '.join(p['argv'])[:160]}`; {p['seconds']:.1f} s sampled every "
                  f"{p['interval_ms']:g} ms.", ""]
        for note in p["notes"]:
            lines.append(f"- note: {note}")
        lines += ["| thread | sampled s | busy (not in a wait) | CPU |", "|---|---:|---:|---:|"]
        for tid, t in sorted(p["threads"].items(), key=lambda kv: -(kv[1]["cpu"] or 0.0)):
            lines.append(f"| {t['name']} | {t['ms'] / 1e3:.1f} | {_pct(t['busy'])} | {_pct_or_na(t['cpu'])} |")
        gc = ", ".join(f"gen {g}: {v['count']} ({v['total_ms']:.0f} ms, max {v['max_ms']:.1f})" for g, v in p["gc"].items())
        gaps = p["gaps"]
        lines += ["", f"Garbage collections: {gc or 'none'}. Sampler gaps (no Python ran for > its threshold): "
                      f"{gaps['count']} ({gaps['total_ms']:.0f} ms, longest {gaps['max_ms']:.0f} ms)."]
        if p["moe_eager_calls"]:
            calls = ", ".join(f"{k}: {v}" for k, v in p["moe_eager_calls"].items())
            lines += ["", f"Eager MoE calls per token count (CUDA-graph replays are not calls): {calls}."]
        if p["main_top_busy"]:
            lines += ["", f"Main thread busy {_pct(p['main_busy_share'])} of its sampled time (CPU {_pct_or_na(p['main_cpu'])}); "
                          "its busiest stacks "
                          "(innermost first):", "", "| share | ms | stack |", "|---:|---:|---|"]
            lines += [f"| {_pct(r['share'])} | {r['ms']:.0f} | `{r['stack']}` |" for r in p["main_top_busy"]]
        lines.append("")
    for rf in result["request_files"]:
        lines += [f"## Stalls in {rf['path']}", "",
                  f"{rf['requests']} requests over {rf['seconds']:.1f} s; {rf['stalls']} window(s) of >= "
                  f"{rf['min_gap_ms']:g} ms with no token delivered while requests were in flight, "
                  f"{rf['stalled_s']:.2f} s in all. Processes sampled throughout: "
                  f"{', '.join(rf['processes_covering']) or 'none'}."
                  + (f" Of the {rf['stalls']} windows the longest {len(rf['windows'])} are listed."
                     if rf["stalls"] > len(rf["windows"]) else ""), ""]
        for w in rf["windows"]:
            lines += [f"### {w['ms']:.0f} ms from t = {w['start_s']:.2f} s ({w['in_flight']} requests in flight)", ""]
            if not w["processes"]:
                lines.append("- no process was sampled in this window")
            for p in w["processes"]:
                lines.append(f"- **{p['label']}** (sampled {_pct(p['sampled_share'])} of the window) main thread busy "
                             f"{_pct_or_na(p['main_busy_share'])}, CPU {_pct_or_na(p['main_cpu'])}, GC "
                             f"{p['gc_ms']:.0f} ms, sampler gaps {p['sampler_gap_ms']:.0f} ms")
                for r in p["top"]:
                    lines.append(f"  - {_pct(r['share'])}{' (waiting)' if r['waiting'] else ''}: `{r['stack']}`")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_report(result: dict, out: Path) -> dict[str, Path]:
    out = output_dir(out)
    paths = {"json": out / "stalls.json", "markdown": out / "stalls.md"}
    write_text_atomic(paths["json"], json.dumps(result, indent=1, default=str))
    write_text_atomic(paths["markdown"], markdown(result))
    return paths
