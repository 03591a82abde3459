"""Side-by-side comparison of load-test results, with a noise estimate for every difference.

A *group* is one configuration: a single result file, or several repeat runs of it. The first
group is the baseline; every other group is compared with it, metric by metric. Result files of
`vllm bench serve --save-result` work too (with `--save-detailed` they carry per-request data).

Whether a difference is real:
- with >= 2 repeats on both sides, from the run-to-run spread (Welch's t interval, 95 %);
- otherwise from per-request dispersion: the per-request JSONL next to each summary is
  resampled (bootstrap over requests, seeded) and each statistic recomputed, giving a 95 %
  interval for the difference. ITLs are resampled by request (cluster bootstrap), on at most
  `ITL_PER_REQUEST` ITLs per request - this widens the interval a little, never narrows it.
  Throughputs have no per-request sample; a closed loop obeys Little's law (throughput =
  concurrency / mean E2EL x tokens), so their interval scales with the bootstrap of mean E2EL
  (approximate, and marked so); not goodput's, which counts requests on either side of an SLO. An open loop (a finite request rate) does not: there the arrival
  schedule sets throughput, so it gets no bootstrap interval (the output says why). Each run needs
  at least `MIN_BOOTSTRAP_REQUESTS` (20) completed requests: with fewer the bootstrap interval is
  too narrow to trust (simulated on log-normal latencies, a nominal 95 % interval of a mean
  difference covers ~69 % at 2 requests, ~85 % at 5, ~89 % at 10, ~92 % at 20), and at 1 request
  it has zero width;
- with neither, the difference is shown without a verdict.
Runs under different goodput SLOs compare every metric but goodput (the SLO defines it, not the workload).
A difference whose interval contains 0 is reported as "within noise". An interval of zero width (no
spread between the repeats, or in the resamples) is no estimate: no verdict. Nor is there one for a
metric that is NaN or infinite in a summary (the field and file are named, the command exits 1).

The per-request file is the summary's `requests_file` beside it, or that name + `.gz` (how results
are committed). It must hold the summary's run: as many ok rows as `completed` and other rows as
`failed`, and no other summary may name it. A repeat must be a different run: the same file, or a
copy of it, is refused.

Runs that are not comparable get no verdict at all (every row says "not comparable", the reasons
head the table, the command exits 1): different workloads (model, concurrency, rate, burstiness when
either is an open loop, prompt count, endpoint, lengths, prompt format, ignore_eos, min_tokens,
extra_body), different numbers of failed requests, a run that stopped early or failed, or one with
short outputs although ignore_eos / min_tokens fixed the output length (the server did not honour
them: a lighter workload). A key missing from a result (older files, `vllm bench serve`'s) reads as
null: missing on both sides is no difference.
Groups are labelled with short unique names (the parts of the file names that differ, else A, B, ...).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest.metrics import STALL_MS
from glm5_fp4.loadtest.report import (check_request_row, describe_run, is_count, is_finite_number, read_requests,
                                      requests_path_for)

ITL_PER_REQUEST = 32
MIN_BOOTSTRAP_REQUESTS = 20  # see the module docstring for why 20
LATENCIES = ("ttft", "tpot", "itl", "e2el", "chunk_itl")
HIGHER_IS_BETTER = {"completed", "request_throughput", "request_goodput", "output_throughput",
                    "total_token_throughput", "output_throughput_per_user", "output_throughput_per_gpu",
                    "max_output_tokens_per_s", "good_requests"}
COUNT_KEYS = ("completed", "failed")
THROUGHPUT_KEYS = ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                   "output_throughput_per_user", "output_throughput_per_gpu", "max_output_tokens_per_s")
# The throughputs whose bootstrap interval comes from E2EL through Little's law (closed loop only). Not goodput: it
# counts requests on either side of an SLO, whose noise is not the mean E2EL's (two runs of one server 26 % apart in
# goodput read 'better' on a +-0.1 % interval); repeats give it one.
LITTLE_KEYS = tuple(k for k in THROUGHPUT_KEYS
                    if k not in ("max_output_tokens_per_s", "output_throughput_per_user", "request_goodput"))
OTHER_KEYS = ("duration", "total_input_tokens", "total_output_tokens", "mean_tokens_per_chunk", "stalls", "stalled_s",
              "longest_stall_ms")
CONFIG_KEYS = ("model_id", "max_concurrency", "request_rate", "burstiness", "num_prompts")
# What each request asks for: ignore_eos / min_tokens fix the output length, extra_body can change anything.
CONFIG_META = ("endpoint", "input_len", "output_len", "range_ratio", "prompt_format", "ignore_eos", "min_tokens",
               "extra_body")
# The SLO defines these, not the workload: under other SLOs only they are not comparable.
GOODPUT_KEYS = ("request_goodput", "good_requests")
NOT_COMPARABLE = "not comparable"
NOT_COMPARABLE_MARK = "**Not comparable**"  # heads a markdown block without verdicts (improvements reads it)
NOT_FINITE = "not finite"
MAX_LABEL = 20
# Student's t, 97.5 % quantile, by degrees of freedom (math.inf: the normal's)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980, math.inf: 1.960}


def _t95(df: float) -> float:
    """The quantile at a Welch df, which is fractional: linear in 1/df between listed df. The quantile is convex in
    1/df, so the chord lies above it: an interval a little wide, never too narrow (rounding df up to the next listed
    one took a smaller t: at df 1.02, 4.30 for the true 12.1)."""
    if not df >= 1:  # (Welch's df is at least 1; NaN too)
        return _T95[1]
    x = 1.0 / df
    for k0, k1 in itertools.pairwise(sorted(_T95, reverse=True)):  # 1/k ascending: inf, 120, ... 1
        x0, x1 = 1.0 / k0, 1.0 / k1
        if x0 <= x <= x1:
            return _T95[k0] + (_T95[k1] - _T95[k0]) * (x - x0) / (x1 - x0)
    return _T95[1]


@dataclass
class Group:
    label: str
    paths: list[Path]
    results: list[dict[str, Any]]
    rows: list[list[dict[str, Any]] | None] = field(default_factory=list)
    # Per run: the per-request file read (None: inline vLLM arrays or none), and why there is no data if so.
    requests_paths: list[Path | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)

    def value(self, key: str) -> float | None:
        vals = [r.get(key) for r in self.results]
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in vals):
            return None
        return float(np.mean(vals))

    def non_finite(self, key: str) -> list[str]:
        """'<value> in <file>' for each run whose `key` is NaN or infinite."""
        return [f"{r[key]} in `{p}`" for p, r in zip(self.paths, self.results)
                if isinstance(r.get(key), float) and not math.isfinite(r[key])]


def load_group(spec: str, label: str | None = None) -> Group:
    """`a.json`, `a1.json,a2.json` (repeats) or `label=a1.json,a2.json`."""
    if "=" in spec and not Path(spec).exists():
        label, _, spec = spec.partition("=")
    paths = [Path(p) for p in spec.split(",") if p]
    if not paths:
        raise Glm5Fp4Error(f"compare: empty result group {spec!r}")
    group = Group("", paths, [])
    seen: dict[Path, Path] = {}
    by_digest: dict[str, Path] = {}
    for p in paths:
        res, digest = _read_summary(p)
        real = p.resolve()
        # A repeat is there to show run-to-run spread; the same run twice shows none and fakes certainty.
        if real in seen:
            raise Glm5Fp4Error(f"compare: {p} is given twice in one group of repeats; give distinct runs")
        if digest in by_digest:
            raise Glm5Fp4Error(f"compare: {p} has the same content as {by_digest[digest]}: a copy is not a "
                               "repeat run; give distinct runs")
        seen[real], by_digest[digest] = p, p
        rows, req, note = _per_request_rows(p, res)
        group.results.append(res)
        group.rows.append(rows)
        group.requests_paths.append(req)
        group.digests.append(digest)
        if note:
            group.notes.append(note)
    given = group.results[0].get("label")
    group.label = label or (given if isinstance(given, str) and given else "") or paths[0].stem
    return group


def _read_summary(p: Path) -> tuple[dict[str, Any], str]:
    if p.is_dir():
        raise Glm5Fp4Error(f"compare: {p} is a directory; give the summary .json file of a run")
    if p.exists() and not p.is_file():
        raise Glm5Fp4Error(f"compare: {p} is not a regular file; give the summary .json file of a run")
    if not p.is_file():
        raise Glm5Fp4Error(f"compare: result file {str(p)!r} does not exist")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise Glm5Fp4Error(f"compare: cannot read {p} ({exc.strerror or exc})") from None
    if data[:2] == b"\x1f\x8b":
        raise Glm5Fp4Error(f"compare: {p} is gzip-compressed; give the summary .json (a .requests.jsonl.gz "
                           "beside it is found on its own)")
    try:
        res = json.loads(data.decode())
    except UnicodeDecodeError:
        raise Glm5Fp4Error(f"compare: {p} is binary, not a JSON summary") from None
    except json.JSONDecodeError as exc:
        raise Glm5Fp4Error(f"compare: {p} is not JSON ({exc})") from None
    if not isinstance(res, dict) or "completed" not in res:
        raise Glm5Fp4Error(f"compare: {p} is not a load-test summary (no 'completed' key)")
    _check_summary_fields(p, res)
    return res, hashlib.sha256(data).hexdigest()




def _check_summary_fields(p: Path, res: dict[str, Any]) -> None:
    """The fields compare relies on for comparability and for finding the per-request data."""
    for key in ("completed", "failed", "short_outputs"):
        if key in res and not is_count(res[key]):
            raise Glm5Fp4Error(f"compare: {p}: field {key!r} is {json.dumps(res[key])}, "
                               "expected a count (integer >= 0)")
    for key, value in res.items():
        if not (key in THROUGHPUT_KEYS or key in OTHER_KEYS or _is_latency_key(key)) or value is None:
            continue
        # (NaN / inf pass here: compare reports them as "not finite, no verdict" and fails the run)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise Glm5Fp4Error(f"compare: {p}: field {key!r} is {json.dumps(value)}, expected a number >= 0 "
                               "(a rate, a time or a count)")
    if "metadata" in res and not isinstance(res["metadata"], dict):
        raise Glm5Fp4Error(f"compare: {p}: field 'metadata' is {json.dumps(res['metadata'])}, expected an object")
    name = res.get("requests_file")
    if name is not None:
        if not isinstance(name, str) or not name:
            raise Glm5Fp4Error(f"compare: {p}: field 'requests_file' is {json.dumps(name)}, expected a file name")
        # The load test writes a bare name; a path would let a summary point compare at any file on the host.
        if Path(name).name != name or name in (".", ".."):
            raise Glm5Fp4Error(f"compare: {p}: field 'requests_file' is {name!r}; it must name a file beside "
                               "the summary, without folders")


def _per_request_rows(p: Path, res: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Path | None, str | None]:
    """(rows, file read, note when there are none): the per-request file, its .gz twin, or vLLM's inline arrays."""
    named = requests_path_for(p, res)
    candidates = [named] if named.name.endswith(".gz") else [named, named.with_name(named.name + ".gz")]
    found = next((c for c in candidates if c.is_file()), None)
    if found is not None:
        rows = read_requests(found)
    else:
        rows = rows_from_vllm_detailed(res, p)
        if rows is None:
            looked = " or ".join(f"`{c}`" for c in candidates)
            return None, None, f"no per-request file for `{p}` (looked for {looked})"
    _check_counts(p, res, rows, found)
    return rows, found, None


def _check_counts(p: Path, res: dict[str, Any], rows: list[dict[str, Any]], found: Path | None) -> None:
    ok = sum(1 for r in rows if r.get("status") == "ok")
    other = len(rows) - ok
    failed = res.get("failed")
    if ok != res["completed"] or (failed is not None and other != failed):
        where = str(found) if found else f"{p} (inline per-request arrays)"
        raise Glm5Fp4Error(f"compare: {where} has {len(rows)} rows ({ok} ok, {other} not), but {p} says "
                           f"completed {res['completed']}, failed {failed}: the per-request data is not this "
                           "run's, or is incomplete")


def _tokens(path: Path) -> list[str]:
    return [t for t in re.split(r"[-_.]+", f"{path.parent.name}-{path.stem}") if t]


def short_labels(groups: Sequence[Group], explicit: Sequence[bool]) -> None:
    """Give each group a short label no other group has (in place): the given labels as they are, else the
    part of its file name that differs from the others' (the common leading and trailing words dropped),
    else A, B, C, ..."""
    names = [g.label for g in groups]
    if len(set(names)) == len(names) and all(len(n) <= MAX_LABEL for n in names):
        return
    toks = [_tokens(g.paths[0]) for g in groups]
    lead = 0
    while all(len(t) > lead + 1 for t in toks) and len({t[lead] for t in toks}) == 1:
        lead += 1
    trail = 0
    while all(len(t) > lead + trail + 1 for t in toks) and len({t[-1 - trail] for t in toks}) == 1:
        trail += 1
    derived = ["-".join(t[lead:len(t) - trail]) for t in toks]
    if len(set(derived)) < len(derived) or any(len(d) > MAX_LABEL for d in derived):
        derived = [chr(ord("A") + i) if i < 26 else f"run{i + 1}" for i in range(len(groups))]
    seen: set[str] = set()
    for g, name, given, d in zip(groups, names, explicit, derived):
        label = name if given else d
        while label in seen:
            label += "'"
        seen.add(label)
        g.label = label


def rows_from_vllm_detailed(result: dict[str, Any], path: Path | str = "result") -> list[dict[str, Any]] | None:
    """Per-request rows from a `vllm bench serve --save-detailed` result (arrays inline, seconds)."""
    need = ("ttfts", "itls", "latencies", "output_lens", "errors")
    if not all(isinstance(result.get(k), list) for k in need):
        return None
    lengths = {k: len(result[k]) for k in need}
    if len(set(lengths.values())) != 1:  # zip would silently drop the tail of the longer arrays
        raise Glm5Fp4Error(f"compare: {path}: per-request arrays of different lengths "
                           f"({', '.join(f'{k} {n}' for k, n in lengths.items())})")
    rows = []
    for i, (ttft, itl, lat, out, err) in enumerate(zip(*(result[k] for k in need))):
        if err or not ttft:
            rows.append({"status": "failed", "error": err})
            continue
        where = f"{path}: request {i} of the inline arrays"
        if not (is_finite_number(ttft) and is_finite_number(lat) and is_count(out) and isinstance(itl, list)
                and all(is_finite_number(x) for x in itl)):
            raise Glm5Fp4Error(f"compare: {where}: ttft {ttft!r}, latency {lat!r}, output_len {out!r}, itls "
                               "must be finite numbers, a count and a list of numbers")
        row = {"status": "ok", "ttft_ms": ttft * 1e3, "e2el_ms": lat * 1e3, "output_tokens": out,
               "tpot_ms": (lat - ttft) * 1e3 / (out - 1) if out > 1 else 0.0,
               "itl_ms": [x * 1e3 for x in itl]}
        check_request_row(row, where)
        rows.append(row)
    return rows


def _latency_stats(result: dict[str, Any], m: str) -> list[str]:
    """Stat names present for metric m, in the order mean, median, std, p<low>..p<high>."""
    suffix = f"_{m}_ms"
    return _order_stats([k[: -len(suffix)] for k in result if k.endswith(suffix) and "_" not in k[: -len(suffix)]])


def _order_stats(stats: list[str]) -> list[str]:
    fixed = [s for s in ("mean", "median", "std") if s in stats]
    pcts = sorted((s for s in stats if s.startswith("p") and _is_number(s[1:])), key=lambda s: float(s[1:]))
    return fixed + pcts


def _is_latency_key(key: str) -> bool:
    """Whether ``key`` is a latency statistic of a summary: <stat>_<latency>_ms (mean_ttft_ms, p99_itl_ms...)."""
    return key.endswith("_ms") and any(key.endswith(f"_{m}_ms") for m in LATENCIES)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def metric_keys(*results: dict[str, Any]) -> list[str]:
    """The metrics some run of ``results`` measured (a number), in report order; a run where one is null (a statistic
    with no sample) then shows it as missing."""
    def has(k: str) -> bool:
        return any(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for r in results)

    keys = [k for k in COUNT_KEYS + THROUGHPUT_KEYS if has(k)]
    for m in LATENCIES:
        stats: list[str] = []
        for r in results:
            stats += [s for s in _latency_stats(r, m) if s not in stats and has(f"{s}_{m}_ms")]
        keys += [f"{s}_{m}_ms" for s in _order_stats(stats)]
    keys += [k for k in OTHER_KEYS if has(k)]
    return keys


def _all_stats(a: np.ndarray, pcts: list[float]) -> dict[str, np.ndarray]:
    """mean/median/std/p<q> along the last axis, NaNs (padding) ignored."""
    out = {"mean": np.nanmean(a, axis=-1), "median": np.nanmedian(a, axis=-1), "std": np.nanstd(a, axis=-1)}
    if pcts:
        qs = np.nanpercentile(a, pcts, axis=-1)
        for q, v in zip(pcts, qs):
            out[f"p{_pword(q)}"] = v
    return out


def _pword(q: float) -> str:
    return str(int(q)) if int(q) == q else str(q)


class _Bootstrap:
    """Bootstrap replicates (over requests) of every statistic of one run's per-request data."""

    def __init__(self, rows: list[dict[str, Any]], n_boot: int, rng: np.random.Generator, pcts: list[float]):
        ok = [r for r in rows if r.get("status") == "ok" and "ttft_ms" in r]
        self.n = len(ok)
        self.pcts = pcts
        self.idx = rng.integers(0, self.n, size=(n_boot, self.n)) if self.n else None
        self.per_request = {
            "ttft": np.array([r["ttft_ms"] for r in ok]),
            "e2el": np.array([r["e2el_ms"] for r in ok]),
            "tpot": np.array([r["tpot_ms"] if r["output_tokens"] > 1 else np.nan for r in ok]),
        }
        # ITLs: a fixed-size, seeded subsample per request (NaN-padded) so a resample is one index.
        self.itl: dict[str, np.ndarray] = {}
        has_chunks = any("chunk_itl_ms" in r for r in ok)
        for name in ("itl", "chunk_itl"):
            if name == "chunk_itl" and not has_chunks:
                continue
            mat = np.full((self.n, ITL_PER_REQUEST), np.nan)
            for i, r in enumerate(ok):
                v = np.asarray(r.get("chunk_itl_ms", r.get("itl_ms", [])) if name == "chunk_itl"
                               else r.get("itl_ms", []), dtype=float)
                if v.size > ITL_PER_REQUEST:
                    v = rng.choice(v, ITL_PER_REQUEST, replace=False)
                mat[i, : v.size] = v
            self.itl[name] = mat
        if not has_chunks and "itl" in self.itl:
            self.itl["chunk_itl"] = self.itl["itl"]  # single-token chunks: chunk gaps are the ITLs
        self._cache: dict[str, dict[str, np.ndarray]] = {}

    def replicates(self, metric: str, stat: str) -> np.ndarray | None:
        if self.idx is None:
            return None
        if metric not in self._cache:
            if metric in self.per_request:
                self._cache[metric] = _all_stats(self.per_request[metric][self.idx], self.pcts)
            elif metric in self.itl:
                mat = self.itl[metric]
                parts: dict[str, list[np.ndarray]] = {}
                for lo in range(0, self.idx.shape[0], 16):  # bounded memory: 16 replicates at a time
                    block = self.idx[lo:lo + 16]
                    sample = mat[block].reshape(block.shape[0], -1)
                    for k, v in _all_stats(sample, self.pcts).items():
                        parts.setdefault(k, []).append(v)
                self._cache[metric] = {k: np.concatenate(v) for k, v in parts.items()}
            else:
                return None
        return self._cache[metric].get(stat)


def open_loop(result: dict[str, Any]) -> bool:
    """Whether requests arrived on a schedule (a finite request rate; closed loop is "inf", or inf)."""
    rate = result.get("request_rate")
    return isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate)


def _throughput_replicates(value: float, boot: _Bootstrap) -> np.ndarray | None:
    reps = boot.replicates("e2el", "mean")
    if reps is None:
        return None
    base = float(np.mean(boot.per_request["e2el"]))
    return value * base / reps  # Little's law: throughput ~ 1 / mean E2EL at fixed concurrency


@dataclass
class Row:
    key: str
    base: float | None
    other: float | None
    delta: float | None
    rel: float | None
    ci: tuple[float, float] | None
    method: str
    verdict: str


def _direction(key: str) -> int:
    if key in HIGHER_IS_BETTER:
        return 1
    if key in ("duration", "total_input_tokens", "total_output_tokens", "mean_tokens_per_chunk") or key.startswith("std_"):
        return 0
    return -1  # latencies and failures: lower is better


def _replicates_for(key: str, group: Group, run: int, boot: _Bootstrap | None) -> np.ndarray | None:
    if boot is None:
        return None
    value = group.results[run].get(key)
    if key in LITTLE_KEYS:
        if open_loop(group.results[run]):  # the arrival schedule sets these, not E2EL: Little's law says nothing
            return None
        return _throughput_replicates(float(value), boot) if isinstance(value, (int, float)) else None
    if key == "output_throughput_per_user":
        reps = boot.replicates("tpot", "mean")
        return None if reps is None else 1e3 / reps
    for m in LATENCIES:
        stat = key[: -len(f"_{m}_ms")]
        if key.endswith(f"_{m}_ms") and "_" not in stat:  # "mean_chunk_itl_ms" is chunk_itl, not itl
            return boot.replicates(m, stat)
    return None


def not_comparable(base: Group, other: Group) -> list[str]:
    """Why better/worse verdicts between these groups would mislead (empty if they would not)."""
    reasons = []
    for g in (base, other):  # the repeats of one group must be runs of one workload too
        for p, r in zip(g.paths[1:], g.results[1:]):
            diffs = _config_diffs(g.results[0], r)
            if diffs:
                reasons.append(f"{g.label}: repeat {p.name} is another workload ({'; '.join(diffs)})")
    diffs = config_differences(base, other)
    if diffs:
        reasons.append(f"workloads differ: {'; '.join(diffs)}")
    fa = [r.get("failed") for r in base.results]
    fb = [r.get("failed") for r in other.results]
    # per run on average (as sets, [0, 2, 2] and [0, 0, 2] passed as alike); a missing count differs from any
    mean = lambda v: (sum(v) / len(v)) if all(is_count(x) for x in v) else tuple(map(str, v))  # noqa: E731
    if mean(fa) != mean(fb):
        show = lambda v: str(v[0]) if len(set(v)) == 1 else "/".join(map(str, v))  # noqa: E731
        reasons.append(f"failed requests differ: {show(fa)} vs {show(fb)}")
    for g in (base, other):
        for p, r in zip(g.paths, g.results):
            if r.get("abort_reason"):
                reasons.append(f"{g.label}: {p.name} stopped early ({r['abort_reason']})")
            elif r.get("run_failed"):
                reasons.append(f"{g.label}: {p.name} failed ({r.get('failure_reason')})")
            elif not r.get("completed"):
                reasons.append(f"{g.label}: {p.name} completed no request")
            meta = r.get("metadata") or {}
            if r.get("short_outputs") and (meta.get("ignore_eos") or meta.get("min_tokens")):
                # The output length was to be fixed; a server that stopped early ran a lighter workload.
                reasons.append(f"{g.label}: {p.name} has {r['short_outputs']} of {r.get('completed')} completed "
                               "requests shorter than asked (the server did not honour ignore_eos / min_tokens)")
    return reasons


def compare_groups(base: Group, other: Group, *, n_boot: int = 500, seed: int = 0) -> list[Row]:
    """Every metric of ``other`` against ``base``; verdict "not comparable" on every row if they are not."""
    blocked = bool(not_comparable(base, other))
    other_slo = bool(slo_differences(base, other))
    rng = np.random.default_rng(seed)
    repeats = len(base.results) >= 2 and len(other.results) >= 2
    boots: dict[int, _Bootstrap | None] = {}
    if not repeats and len(base.results) == 1 and len(other.results) == 1:
        for gi, g in enumerate((base, other)):
            pcts = sorted({float(s[1:]) for s in _latency_stats(g.results[0], "ttft") if s.startswith("p")})
            enough = bool(g.rows and g.rows[0]) and _ok_count(g.rows[0]) >= MIN_BOOTSTRAP_REQUESTS
            boots[gi] = _Bootstrap(g.rows[0], n_boot, rng, pcts) if enough else None
    rows = []
    for key in metric_keys(*base.results, *other.results):
        a, b = base.value(key), other.value(key)
        if a is None or b is None:
            rows.append(Row(key, a, b, None, None, None, "-", "missing"))
            continue
        if base.non_finite(key) or other.non_finite(key):
            rows.append(Row(key, a, b, None, None, None, "-", NOT_COMPARABLE if blocked else NOT_FINITE))
            continue
        delta = b - a
        rel = delta / abs(a) if a else None
        ci: tuple[float, float] | None = None
        method = "none"
        if repeats:
            va = np.array([r[key] for r in base.results], float)
            vb = np.array([r[key] for r in other.results], float)
            sa, sb = va.var(ddof=1) / va.size, vb.var(ddof=1) / vb.size
            se = math.sqrt(sa + sb)
            df = (sa + sb) ** 2 / ((sa**2 / (va.size - 1) if sa else 0) + (sb**2 / (vb.size - 1) if sb else 0)) \
                if (sa or sb) else math.inf
            method = f"repeats {va.size}v{vb.size}"
            if se > 0:
                h = _t95(df) * se
                ci = (delta - h, delta + h)
            else:
                method += " (no spread)"
        elif boots:
            ra = _replicates_for(key, base, 0, boots.get(0))
            rb = _replicates_for(key, other, 0, boots.get(1))
            if ra is not None and rb is not None:
                d = rb - ra
                d = d[np.isfinite(d)]
                if d.size:
                    # Percentile interval of the bootstrap differences, re-centred on the observed delta.
                    lo, hi = np.percentile(d - d.mean(), [2.5, 97.5])
                    approx = key in THROUGHPUT_KEYS and key != "output_throughput_per_user"
                    method = "bootstrap~" if approx else "bootstrap"
                    if hi > lo:
                        ci = (delta + lo, delta + hi)
                    else:
                        method += " (no spread)"
        direction = _direction(key)
        if key in COUNT_KEYS:
            verdict = "same" if delta == 0 else ("better" if delta * (1 if key == "completed" else -1) > 0 else "worse")
        elif ci is None:
            verdict = "no noise estimate" if delta else "same"
        elif ci[0] <= 0 <= ci[1]:
            verdict = "within noise"
        elif direction == 0:
            verdict = "changed"
        else:
            verdict = "better" if delta * direction > 0 else "worse"
        rows.append(Row(key, a, b, delta, rel, ci, method,
                        NOT_COMPARABLE if blocked or (other_slo and key in GOODPUT_KEYS) else verdict))
    return rows


def slo_differences(base: Group, other: Group) -> list[str]:
    """The goodput SLOs of the runs, where they are not all one (each run's ``metadata.goodput_slo_ms``)."""
    slos = {json.dumps((r.get("metadata") or {}).get("goodput_slo_ms"), sort_keys=True)
            for g in (base, other) for r in g.results}
    return sorted(slos) if len(slos) > 1 else []


def _ok_count(rows: list[dict[str, Any]]) -> int:
    return sum(1 for r in rows if r.get("status") == "ok")


def noise_notes(base: Group, other: Group, rows: list[Row]) -> list[str]:
    """Why some or all differences have no noise estimate, for the reader of the table."""
    notes = []
    if len(base.results) == 1 and len(other.results) == 1:
        for g in (base, other):
            notes += g.notes
            if g.rows and g.rows[0] is not None and _ok_count(g.rows[0]) < MIN_BOOTSTRAP_REQUESTS:
                n = _ok_count(g.rows[0])
                notes.append(f"`{g.paths[0]}` has {n} completed request{'' if n == 1 else 's'}, fewer than "
                             f"{MIN_BOOTSTRAP_REQUESTS}: too few for a bootstrap interval")
        if any(open_loop(g.results[0]) for g in (base, other)) and any(r.key in LITTLE_KEYS for r in rows):
            notes.append("open loop (finite --request-rate): throughputs follow the arrival schedule, not the "
                         "latencies, so Little's law gives no interval for them; give >= 2 repeat runs a side")
    elif (len(base.results) >= 2) != (len(other.results) >= 2):
        notes.append("repeat runs on one side only: give >= 2 runs on both sides for run-to-run noise")
    slos = slo_differences(base, other)
    if slos:
        notes.append(f"goodput SLOs differ ({' vs '.join(slos)}): {', '.join(GOODPUT_KEYS)} not compared")
    flat = [r.key for r in rows if r.method.endswith("(no spread)") and r.delta]
    if flat:
        src = "run-to-run" if rows and any(r.method.startswith("repeats") for r in rows) else "resampled"
        notes.append(f"no {src} spread for {', '.join(flat)}: a zero-width interval is no estimate, no verdict")
    return notes


def non_finite_notes(base: Group, other: Group) -> list[str]:
    """'<field> is <value> in <file>' for every metric that is NaN or infinite in either group."""
    out = []
    for key in metric_keys(*base.results, *other.results):
        bad = base.non_finite(key) + other.non_finite(key)
        if bad:
            out.append(f"{key} is {', '.join(bad)}")
    return out


def config_differences(base: Group, other: Group) -> list[str]:
    return _config_diffs(base.results[0], other.results[0])


def _config_diffs(ra: dict[str, Any], rb: dict[str, Any]) -> list[str]:
    diffs = []
    for k in CONFIG_KEYS:
        if k == "burstiness" and not (open_loop(ra) or open_loop(rb)):
            continue  # it shapes the gaps between arrivals; a closed loop has none
        if ra.get(k) != rb.get(k):
            diffs.append(f"{k}: {ra.get(k)} vs {rb.get(k)}")
    ma, mb = ra.get("metadata", {}), rb.get("metadata", {})
    for k in CONFIG_META:
        if ma.get(k) != mb.get(k):
            diffs.append(f"{k}: {ma.get(k)} vs {mb.get(k)}")
    return diffs


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.1f}"
    return f"{v:.3g}" if abs(v) < 1 and v != 0 else f"{v:.2f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.1f}%"


def _ci(row: Row) -> str:
    if row.ci is None:
        return "-"
    return f"[{row.ci[0]:+.3g}, {row.ci[1]:+.3g}]"


_BLOCK_HEAD = re.compile(r"^### .+ vs .+$", re.M)


def is_compare_block(text: str) -> bool:
    """Whether ``text`` holds a block :func:`markdown_block` wrote (improvements new --from pastes only those)."""
    return bool(_BLOCK_HEAD.search(text)) and "- Baseline **" in text and "|" in text


def markdown_block(base: Group, other: Group, rows: list[Row]) -> str:
    """A block ready to paste into an improvement write-up."""
    lines = [f"### {other.label} vs {base.label}", ""]
    blocked = not_comparable(base, other)
    if blocked:
        lines.append(f"{NOT_COMPARABLE_MARK}, so no verdicts: {'; '.join(blocked)}.")
        lines.append("")
    for role, g in (("Baseline", base), ("Candidate", other)):
        files = ", ".join(f"`{p}`" for p in g.paths)
        lines.append(f"- {role} **{g.label}**: {describe_run(g.results[0])} "
                     f"({len(g.results)} run{'s' if len(g.results) > 1 else ''}: {files})")
    stalled = [(g.label, [r.get("stalls") for r in g.results], [r.get("stalled_s") or 0.0 for r in g.results])
               for g in (base, other)]
    if any(any(n for n in counts if n) for _, counts, _ in stalled):
        told = "; ".join(f"{label} {'/'.join(str(n if n is not None else '?') for n in counts)} "
                         f"({sum(secs):.2f} s)" for label, counts, secs in stalled)
        lines.append(f"- **Stalls** (delivery gaps of >= {STALL_MS:g} ms with requests in flight): {told}. A stall is a "
                     "pause of the server (a first-use compile, a garbage collection, a lock), not decode speed: "
                     "throughput differences include them. Warm both servers alike first (the load test's "
                     "warm-up wave, `--num-warmups`); `glm5-fp4 profile stalls` names what held the host.")
    methods = sorted({r.method for r in rows if r.method not in ("-", "none")})
    notes = noise_notes(base, other, rows)
    if methods:
        lines.append(f"- Noise estimate: {', '.join(methods)}; 95 % interval of the difference; "
                     "`~` = Little's-law approximation")
    else:
        lines.append("- Noise estimate: none (differences shown without a verdict)")
    lines += [f"  - {n}" for n in notes]
    bad = non_finite_notes(base, other)
    if bad:
        lines.append(f"- **Not finite**, so no verdict: {'; '.join(bad)}")
    good = [r for r in rows if r.verdict in ("better", "worse") and r.key not in COUNT_KEYS
            and not r.key.startswith("std_")]
    if good:
        lines.append("- Significant: " + ", ".join(f"{r.key} {_pct(r.rel)} ({r.verdict})" for r in good))
    noise = [r.key for r in rows if r.verdict == "within noise" and not r.key.startswith("std_")]
    if noise:
        lines.append("- Within noise: " + ", ".join(noise))
    lines += ["", f"| Metric | {base.label} | {other.label} | Δ | Δ% | 95% CI of Δ | noise from | verdict |",
              "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r.key} | {_num(r.base)} | {_num(r.other)} | {_num(r.delta)} | {_pct(r.rel)} | {_ci(r)} "
                     f"| {r.method} | {r.verdict} |")
    return "\n".join(lines)


def print_table(base: Group, other: Group, rows: list[Row], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 132))
    t = Table(title=f"{other.label} vs {base.label}", header_style="bold")
    for c, j in (("metric", "left"), (base.label, "right"), (other.label, "right"), ("Δ", "right"),
                 ("Δ%", "right"), ("95% CI of Δ", "right"), ("noise", "left"), ("verdict", "left")):
        t.add_column(c, justify=j)  # type: ignore[arg-type]
    colour = {"better": "green", "worse": "red", "within noise": "dim", NOT_COMPARABLE: "yellow"}
    for r in rows:
        style = colour.get(r.verdict, "")
        t.add_row(r.key, _num(r.base), _num(r.other), _num(r.delta), _pct(r.rel), _ci(r), r.method,
                  f"[{style}]{r.verdict}[/]" if style else r.verdict)
    console.print(t)
    for g in (base, other):
        console.print(f"{g.label}: {', '.join(str(p) for p in g.paths)}", highlight=False)
    for note in noise_notes(base, other, rows):
        console.print(f"noise: {note}", highlight=False, markup=False)
    for note in non_finite_notes(base, other):
        console.print(f"not finite, no verdict: {note}", highlight=False, markup=False)


def compare_files(specs: Sequence[str], *, n_boot: int = 500, seed: int = 0,
                  labels: Sequence[str] | None = None) -> tuple[list[Group], list[list[Row]], str]:
    if len(specs) < 2:
        raise Glm5Fp4Error("compare: give at least two result files (baseline first)")
    groups = [load_group(s, labels[i] if labels and i < len(labels) else None) for i, s in enumerate(specs)]
    _check_shared_requests_files(groups)
    short_labels(groups, [bool(labels and i < len(labels)) or ("=" in s and not Path(s).exists())
                          for i, s in enumerate(specs)])
    tables = [compare_groups(groups[0], g, n_boot=n_boot, seed=seed) for g in groups[1:]]
    md = "\n\n".join(markdown_block(groups[0], g, rows) for g, rows in zip(groups[1:], tables))
    return groups, tables, md


def _check_shared_requests_files(groups: Sequence[Group]) -> None:
    """Two different summaries naming one per-request file would get the same bootstrap and look alike."""
    owners: dict[Path, tuple[str, Path]] = {}
    for g in groups:
        for p, req, digest in zip(g.paths, g.requests_paths, g.digests):
            if req is None:
                continue
            first = owners.setdefault(req.resolve(), (digest, p))
            if first[0] != digest:  # the same summary in two groups (a run against itself) is fine
                raise Glm5Fp4Error(f"compare: {req} is the per-request file of both {first[1]} and {p}; each "
                                   "summary needs its own run's file")


def input_files(groups: Sequence[Group]) -> list[Path]:
    """Every file compare read: summaries and per-request files."""
    return [p for g in groups for p in [*g.paths, *(r for r in g.requests_paths if r is not None)]]
