"""Per-request timings and run aggregates, with `vllm bench serve`'s definitions and key names.

Per request (successful ones only enter the aggregates, as in vLLM):
- TTFT  = arrival of the first chunk carrying a token - send time.
- E2EL  = arrival of the last chunk carrying a token - send time.
- TPOT  = (E2EL - TTFT) / (output_tokens - 1), only for output_tokens > 1 (vLLM counts 0 for goodput).
- ITL   = gaps between token arrivals. A chunk that carries k tokens after a gap g contributes k
          ITLs of g/k (vLLM would record one gap g: inflated and bimodal under MTP). Extra tokens in
          the first chunk arrived together with the first token and count as gaps of 0, so the ITLs
          of a request always sum to E2EL - TTFT and number output_tokens - 1 (mean ITL ~ TPOT).
- chunk ITL = the raw gaps between chunks (what vLLM reports as ITL), kept as `*_chunk_itl_ms`.
Tokens per chunk (`token_count_source` per request, `token_count_method` per run): `usage` when every
chunk carried the running usage (vLLM's continuous_usage_stats); else `tokenizer`, each chunk's text
counted with the run's tokenizer (`tokenizer+usage` when those counts were scaled to the final usage);
else `spread`, the final usage spread evenly over the chunks; else `chunks`, one token per chunk.
Aggregates: mean/median/std (numpy, population std)/percentiles (numpy linear) in ms, keys
`mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, ...; throughputs divide by the
measured duration; input tokens are the server's `usage.prompt_tokens` when it reports them (as
vLLM does), else (none, or 0) the prompt lengths the client built, and `input_tokens_source` says which;
goodput counts requests meeting every SLO (`<=`) per second, as vLLM does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # only annotations: reading result files (compare, profile stalls) needs no HTTP client
    from glm5_fp4.loadtest.client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def _ms(x: float) -> float:
    return round(x * 1e3, 4)  # 0.1 us resolution keeps the JSONL small without losing anything real


def _scale_to(counts: list[int], total: int) -> list[int] | None:
    """Integer counts, one at least each, summing to ``total``: the tokens beyond one per chunk shared in
    proportion to each chunk's own beyond one (evenly if none has any), rounded cumulatively so the
    remainder is spread out. None if ``total`` is below one token per chunk."""
    n = len(counts)
    if total < n:
        return None
    weights = [c - 1 for c in counts]
    if not any(weights):
        weights = [1] * n
    share = (total - n) / sum(weights)
    out, acc, given = [], 0.0, 0
    for w in weights:
        acc += w * share
        now = math.floor(acc + 0.5)
        out.append(1 + now - given)
        given = now
    return out


def chunk_token_counts(rec: RequestRecord, text_tokens: dict[str, int] | None) -> tuple[list[int], str]:
    """Tokens per chunk and how they were counted (see the module docstring); ``text_tokens`` maps a
    chunk's text to its token count under the run's tokenizer, None when there is none."""
    n = len(rec.chunk_times)
    final = rec.output_tokens
    if rec.running_usage:
        return list(rec.chunk_tokens), "usage"
    if text_tokens is not None and len(rec.chunk_texts) == n and all(t in text_tokens for t in rec.chunk_texts):
        counts = [max(1, text_tokens[t]) for t in rec.chunk_texts]
        if final is None or sum(counts) == final:
            return counts, "tokenizer"
        scaled = _scale_to(counts, final)
        if scaled is not None:
            return scaled, "tokenizer+usage"
    if final is not None:
        scaled = _scale_to([1] * n, final)
        if scaled is not None:
            return scaled, "spread"
    return [1] * n, "chunks"


def finalize_request(rec: RequestRecord, t0: float, t0_unix: float,
                     text_tokens: dict[str, int] | None = None) -> dict[str, Any]:
    """One JSONL row: the request's outcome, token counts and every latency, in ms."""
    row: dict[str, Any] = {
        "index": rec.index,
        "status": "ok" if rec.status == "ok" else ("not_sent" if rec.status == "not_sent" else "failed"),
        "error_kind": rec.error_kind,
        "error": rec.error,
        "prompt_len": rec.prompt_len,
        "server_prompt_tokens": rec.server_prompt_tokens,
        "requested_output_len": rec.requested_output_len,
    }
    if rec.status == "not_sent":
        row["error_kind"] = rec.error_kind or "not_sent"
        row["error"] = rec.error or "never sent: the run stopped first"
        return row
    times = rec.chunk_times
    toks, source = chunk_token_counts(rec, text_tokens) if times else ([], "none")
    streamed = sum(toks)
    # The final usage is the authority on the count; without one, the counts of the chunks.
    output_tokens = rec.output_tokens if rec.output_tokens is not None else streamed
    row.update({
        "start_s": round(rec.start - t0, 6),
        "start_unix": round(t0_unix + (rec.start - t0), 6),
        "end_s": round(rec.end - t0, 6),
        "output_tokens": output_tokens,
        "streamed_tokens": streamed,
        "num_chunks": len(times),
        "token_count_source": source,
        "response_id": rec.response_id,
        "finish_reason": rec.finish_reason,
    })
    if not times:
        return row
    ttft = times[0] - rec.start
    e2el = times[-1] - rec.start
    row["ttft_ms"] = _ms(ttft)
    row["e2el_ms"] = _ms(e2el)
    row["tpot_ms"] = _ms((e2el - ttft) / (output_tokens - 1)) if output_tokens > 1 else 0.0
    itl: list[float] = [0.0] * (toks[0] - 1)
    chunk_itl: list[float] = []
    multi = toks[0] > 1
    for j in range(1, len(times)):
        gap = times[j] - times[j - 1]
        k = toks[j]
        chunk_itl.append(_ms(gap))
        if k == 1:
            itl.append(_ms(gap))
        else:
            multi = True
            itl.extend([_ms(gap / k)] * k)
    row["itl_ms"] = itl
    if multi:  # otherwise chunk gaps equal the ITLs; don't store them twice
        row["chunk_itl_ms"] = chunk_itl
        row["chunk_tokens"] = list(toks)
    return row


def chunk_itls_of(row: dict[str, Any]) -> list[float]:
    return row["chunk_itl_ms"] if "chunk_itl_ms" in row else row.get("itl_ms", [])


def _stats(name: str, values_ms: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std/percentiles of one latency; None for each when nothing was measured.

    vLLM's benchmark reports 0 for an empty list (it feeds `values or 0` to numpy); we do not follow it there: a run in
    which no request finished, or a TTFT-only run's TPOT, would show 0 ms and pass any latency check."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms",
            *(f"p{percentile_word(p)}_{name}_ms" for p in percentiles)]
    if not len(values_ms):
        return dict.fromkeys(keys)
    arr = np.asarray(values_ms, dtype=np.float64)
    out = {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
    }
    for p, v in zip(percentiles, np.percentile(arr, list(percentiles))):
        out[f"p{percentile_word(p)}_{name}_ms"] = float(v)
    return out


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def slo_ok(ms: object) -> bool:
    """A goodput SLO is a finite number of milliseconds >= 0 (NaN made every request miss it: goodput 0)."""
    return isinstance(ms, (int, float)) and ms >= 0 and math.isfinite(ms)


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:30000` (ms) -> {"ttft": 500.0, ...}, with vLLM's names."""
    slos: dict[str, float] = {}
    for item in items:
        for part in str(item).replace(",", " ").split():
            name, sep, value = part.partition(":")
            if not sep or name not in GOODPUT_METRICS:
                raise ValueError(f"--goodput {part!r}: expected NAME:MS with NAME in {', '.join(GOODPUT_METRICS)}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput {part!r}: {value!r} is not a number of milliseconds") from None
            if not slo_ok(ms):
                raise ValueError(f"--goodput {part!r}: SLO must be a finite number of ms >= 0")
            slos[name] = ms
    return slos


def _peak_rates(rows: list[dict[str, Any]]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s / max_concurrent_requests over 1 s buckets."""
    if not rows:
        return 0.0, 0
    t_min = min(r["start_s"] for r in rows)
    t_max = max(r["start_s"] + r["e2el_ms"] / 1e3 for r in rows)
    n = int(math.ceil(t_max - t_min)) + 1
    tokens = np.zeros(n)
    conc = np.zeros(n)
    for r in rows:
        t = r["start_s"] + r["ttft_ms"] / 1e3 + np.concatenate([[0.0], np.cumsum(r["itl_ms"]) / 1e3])
        idx = (t - t_min).astype(np.int64)
        idx = idx[(idx >= 0) & (idx < n)]
        np.add.at(tokens, idx, 1)
        a = int(r["start_s"] - t_min)
        b = min(int(r["start_s"] + r["e2el_ms"] / 1e3 - t_min), n - 1)
        conc[a:b + 1] += 1
    return float(tokens.max()), int(conc.max())


# A delivery gap this long while requests are in flight is a pause of the server (a first-use compile, a full
# garbage collection, a lock), not decode speed: a decode step of GLM-5 at 512 streams is ~10-40 ms.
STALL_MS = 300.0


def delivery_times(row: dict[str, Any]) -> list[float]:
    """Seconds (the run's clock, like ``start_s``) at which each token chunk of a request reached the client."""
    if row.get("ttft_ms") is None:
        return []
    t = float(row["start_s"]) + float(row["ttft_ms"]) / 1e3
    out = [t]
    for gap in chunk_itls_of(row) or []:  # chunk arrivals: itl_ms spreads a multi-token chunk over its gap
        t += float(gap) / 1e3
        out.append(t)
    return out


def stall_windows(spans: Sequence[tuple[float, float, Sequence[float]]],
                  min_gap_ms: float = STALL_MS) -> list[tuple[float, float, int]]:
    """(start, end, requests in flight) of each gap of at least ``min_gap_ms`` between two consecutive deliveries
    to any client (or from the first request's start to the first delivery) throughout which some request was in
    flight. ``spans``: (start, end, delivery times) per request, all on one clock in seconds."""
    spans = [s for s in spans if len(s[2])]
    if not spans:
        return []
    deliveries = sorted({t for _, _, ts in spans for t in ts})
    marks = [min(s[0] for s in spans)] + deliveries
    starts = np.array([s[0] for s in spans])
    ends = np.array([max(s[1], s[2][-1]) for s in spans])
    out = []
    for a, b in zip(marks, marks[1:]):
        if (b - a) * 1e3 < min_gap_ms:
            continue
        flying = int(np.count_nonzero((starts <= a) & (ends >= b)))
        if flying:
            out.append((a, b, flying))
    return out


def stall_metrics(ok: list[dict[str, Any]], min_gap_ms: float = STALL_MS) -> dict[str, Any]:
    spans = [(float(r["start_s"]), float(r["start_s"]) + float(r["e2el_ms"]) / 1e3, delivery_times(r)) for r in ok]
    wins = stall_windows(spans, min_gap_ms)
    return {"stalls": len(wins), "stalled_s": float(sum(b - a for a, b, _ in wins)),
            "longest_stall_ms": float(max(((b - a) * 1e3 for a, b, _ in wins), default=0.0))}


def compute_metrics(rows: list[dict[str, Any]], duration_s: float, *,
                    percentiles: Sequence[float] = (50, 90, 99),
                    selected: Sequence[str] = METRICS,
                    goodput: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] != "ok"]
    dur = max(duration_s, 1e-9)
    # A server that reports no prompt count, or 0, has not counted: the client built the prompts to length.
    counted = [r for r in ok if r.get("server_prompt_tokens")]
    total_in = sum(int(r["server_prompt_tokens"] if r.get("server_prompt_tokens") else r["prompt_len"]) for r in ok)
    zero = sum(1 for r in ok if r.get("server_prompt_tokens") == 0)
    if len(counted) == len(ok):
        input_source = "server usage.prompt_tokens"
    else:
        why = "reported prompt_tokens 0" if zero else "reported no prompt_tokens"
        input_source = (f"the client's prompt lengths for {len(ok) - len(counted)} of {len(ok)} requests "
                        f"(the server {why})")
    total_out = sum(int(r["output_tokens"]) for r in ok)
    ttfts = [r["ttft_ms"] for r in ok]
    e2els = [r["e2el_ms"] for r in ok]
    tpots = [r["tpot_ms"] for r in ok if r["output_tokens"] > 1]
    itls = [x for r in ok for x in r["itl_ms"]]
    chunk_itls = [x for r in ok for x in chunk_itls_of(r)]
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_in,
        "input_tokens_source": input_source,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": [r["tpot_ms"] for r in ok], "e2el": e2els}
        good = sum(1 for vals in zip(*(per_metric[m] for m in goodput))
                   if all(v <= goodput[m] for v, m in zip(vals, goodput)))
        out["request_goodput"] = good / dur
        out["good_requests"] = good
    out["max_output_tokens_per_s"], out["max_concurrent_requests"] = _peak_rates(ok)
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in selected:
        out.update(_stats(name, values[name], percentiles))
    out.update(_stats("chunk_itl", chunk_itls, percentiles))
    n_chunks = sum(r["num_chunks"] for r in ok)
    streamed = sum(r["streamed_tokens"] for r in ok)
    out["mean_tokens_per_chunk"] = streamed / n_chunks if n_chunks else None
    mean_tpot = float(np.mean(tpots)) if tpots else 0.0
    # Pareto axes: tokens/s seen by one user vs tokens/s of the whole server (undefined without a TPOT sample).
    out["output_throughput_per_user"] = 1e3 / mean_tpot if mean_tpot > 0 else None
    out["errors_by_kind"] = dict(Counter(r.get("error_kind") or "unknown" for r in failed))
    out["not_sent"] = sum(1 for r in failed if r["status"] == "not_sent")
    out["short_outputs"] = sum(1 for r in ok if r["output_tokens"] < r["requested_output_len"])
    out["token_count_method"] = dict(Counter(r.get("token_count_source", "usage") for r in ok))
    out.update(stall_metrics(ok))
    mismatched = [r for r in counted if r["server_prompt_tokens"] != r["prompt_len"]]
    out["prompt_len_mismatches"] = len(mismatched)
    return out
