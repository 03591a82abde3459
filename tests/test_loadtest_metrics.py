"""Metric definitions on synthetic streams, against independent formulations (no server, no timing)."""

from __future__ import annotations

import numpy as np
import pytest

from glm5_fp4.loadtest.client import RequestRecord
from glm5_fp4.loadtest.metrics import compute_metrics, finalize_request, parse_goodput


def _random_record(rng: np.random.Generator, index: int, t0: float) -> RequestRecord:
    n_chunks = int(rng.integers(1, 40))
    tokens = rng.integers(1, 5, size=n_chunks).tolist()  # MTP-like: 1..4 tokens per chunk
    start = t0 + float(rng.uniform(0, 3))
    ttft = float(rng.uniform(0.05, 0.5))
    gaps = rng.uniform(0.005, 0.08, size=n_chunks - 1)
    times = (start + ttft + np.concatenate([[0.0], np.cumsum(gaps)])).tolist()
    rec = RequestRecord(index, prompt_len=int(rng.integers(10, 100)), requested_output_len=sum(tokens))
    rec.status = "ok"
    rec.start, rec.end = start, times[-1] + 0.001
    rec.chunk_times, rec.chunk_tokens = times, tokens
    rec.output_tokens = sum(tokens)
    rec.server_prompt_tokens = rec.prompt_len
    rec.running_usage = True
    return rec


def _token_times(rec: RequestRecord) -> list[float]:
    """Independent view: tokens of a chunk spread evenly over the gap before it; first chunk's all at once."""
    out = [rec.chunk_times[0]] * rec.chunk_tokens[0]
    for j in range(1, len(rec.chunk_times)):
        prev, cur, k = rec.chunk_times[j - 1], rec.chunk_times[j], rec.chunk_tokens[j]
        out += [prev + (cur - prev) * m / k for m in range(1, k + 1)]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aggregates_match_independent_computation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t0 = 1000.0
    recs = [_random_record(rng, i, t0) for i in range(int(rng.integers(20, 60)))]
    # a few failures that must not enter any latency statistic
    for r in recs[:3]:
        r.status, r.error_kind, r.error = "failed", "disconnected", "boom"
    rows = [finalize_request(r, t0, 1.7e9) for r in recs]
    duration = 7.5
    pcts = (50.0, 90.0, 99.0, 99.9)
    res = compute_metrics(rows, duration, percentiles=pcts)
    # rows keep ms to 4 decimals (0.1 us), hence abs=2e-4 below

    ok = [r for r in recs if r.status == "ok"]
    ttft = np.array([(r.chunk_times[0] - r.start) * 1e3 for r in ok])
    e2el = np.array([(r.chunk_times[-1] - r.start) * 1e3 for r in ok])
    tpot = np.array([(e - t) / (r.output_tokens - 1) for r, e, t in zip(ok, e2el, ttft) if r.output_tokens > 1])
    itl = np.concatenate([np.diff(_token_times(r)) * 1e3 for r in ok])
    chunk_itl = np.concatenate([np.diff(r.chunk_times) * 1e3 for r in ok])
    for name, ref in (("ttft", ttft), ("e2el", e2el), ("tpot", tpot), ("itl", itl), ("chunk_itl", chunk_itl)):
        assert res[f"mean_{name}_ms"] == pytest.approx(ref.mean(), rel=1e-6, abs=2e-4)
        assert res[f"median_{name}_ms"] == pytest.approx(np.median(ref), rel=1e-6, abs=2e-4)
        assert res[f"std_{name}_ms"] == pytest.approx(ref.std(), rel=1e-5, abs=2e-4)
        for p in pcts:
            word = str(int(p)) if int(p) == p else str(p)
            assert res[f"p{word}_{name}_ms"] == pytest.approx(np.percentile(ref, p), rel=1e-6, abs=2e-4)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    assert res["completed"] == len(ok) and res["failed"] == 3
    assert res["total_output_tokens"] == out_tokens and res["total_input_tokens"] == in_tokens
    assert res["request_throughput"] == pytest.approx(len(ok) / duration)
    assert res["output_throughput"] == pytest.approx(out_tokens / duration)
    assert res["total_token_throughput"] == pytest.approx((in_tokens + out_tokens) / duration)
    assert res["mean_tokens_per_chunk"] == pytest.approx(out_tokens / sum(len(r.chunk_times) for r in ok))
    assert res["errors_by_kind"] == {"disconnected": 3}
    # ITLs of one request sum to E2EL - TTFT and number output_tokens - 1: mean ITL per request = TPOT.
    for r, row in zip(recs, rows):
        if r.status == "ok":
            assert len(row["itl_ms"]) == r.output_tokens - 1
            assert sum(row["itl_ms"]) == pytest.approx(row["e2el_ms"] - row["ttft_ms"], abs=1e-3)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    rng = np.random.default_rng(5)
    recs = [_random_record(rng, i, 0.0) for i in range(80)]
    rows = [finalize_request(r, 0.0, 0.0) for r in recs]
    slo = {"ttft": 250.0, "tpot": 20.0}
    res = compute_metrics(rows, 4.0, goodput=slo)
    good = sum(1 for r in rows if r["ttft_ms"] <= 250.0 and r["tpot_ms"] <= 20.0)
    assert 0 < good < len(rows)  # the SLO actually separates requests
    assert res["good_requests"] == good
    assert res["request_goodput"] == pytest.approx(good / 4.0)
    assert compute_metrics(rows, 4.0)["request_goodput"] is None


def test_peak_rates_follow_vllm_buckets() -> None:
    rec = RequestRecord(0, 5, 4)
    rec.status, rec.start, rec.end = "ok", 0.0, 2.6
    rec.chunk_times, rec.chunk_tokens, rec.output_tokens = [0.5, 0.9, 1.2, 2.5], [1, 1, 1, 1], 4
    res = compute_metrics([finalize_request(rec, 0.0, 0.0)], 3.0)
    assert res["max_output_tokens_per_s"] == 2.0  # tokens at 0.5, 0.9 fall in second 0
    assert res["max_concurrent_requests"] == 1


def test_stream_without_running_usage_spreads_the_final_count_over_its_chunks() -> None:
    rec = RequestRecord(0, 5, 6)
    rec.status, rec.start = "ok", 0.0
    rec.chunk_times, rec.chunk_tokens = [0.1, 0.2, 0.35], [1, 1, 1]
    rec.output_tokens = 6  # final usage says 6 although only 3 chunks came
    rec.running_usage = False
    row = finalize_request(rec, 0.0, 0.0)  # no tokenizer counts: 2 tokens per chunk
    assert row["token_count_source"] == "spread"
    assert row["output_tokens"] == 6
    assert row["tpot_ms"] == pytest.approx((350 - 100) / 5)
    assert row["itl_ms"] == pytest.approx([0.0, 50.0, 50.0, 75.0, 75.0])


def test_empty_and_failed_runs_do_not_crash() -> None:
    rec = RequestRecord(0, 5, 6)  # never sent
    res = compute_metrics([finalize_request(rec, 0.0, 0.0)], 1.0)
    assert res["completed"] == 0 and res["failed"] == 1 and res["not_sent"] == 1
    # no request finished: no latency was measured, so none is reported (a 0 ms TTFT would pass any SLO check)
    for name in ("ttft", "tpot", "itl", "e2el", "chunk_itl"):
        for stat in ("mean", "median", "std", "p99"):
            assert res[f"{stat}_{name}_ms"] is None, (stat, name)
    assert res["output_throughput_per_user"] is None and res["mean_tokens_per_chunk"] is None


def test_one_token_outputs_have_no_tpot_or_itl() -> None:
    """--output-len 1 (a TTFT-only test): TPOT and ITL are undefined, not 0 ms; TTFT and E2EL are measured."""
    rows = []
    for i in range(4):
        rec = RequestRecord(i, 5, 1)
        rec.status, rec.start, rec.end = "ok", 0.1 * i, 0.1 * i + 0.05
        rec.chunk_times, rec.chunk_tokens, rec.output_tokens = [0.1 * i + 0.04], [1], 1
        rows.append(finalize_request(rec, 0.0, 0.0))
    res = compute_metrics(rows, 1.0)
    assert res["completed"] == 4 and res["mean_ttft_ms"] == pytest.approx(40.0)
    assert res["mean_tpot_ms"] is None and res["p99_itl_ms"] is None and res["output_throughput_per_user"] is None
    from glm5_fp4.loadtest.report import markdown_summary

    md = markdown_summary({**res, "max_concurrency": 1})
    tpot_row = next(line for line in md.splitlines() if line.startswith("| TPOT"))
    assert "0.00" not in tpot_row and "-" in tpot_row, tpot_row


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50,e2el:1e4"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def _stream(index: int, start: float, chunk_times: list[float], tokens: list[int] | None = None) -> dict:
    rec = RequestRecord(index, prompt_len=8, requested_output_len=sum(tokens or [1] * len(chunk_times)))
    rec.status = "ok"
    rec.start, rec.end = start, chunk_times[-1] + 0.001
    rec.chunk_times, rec.chunk_tokens = chunk_times, tokens or [1] * len(chunk_times)
    rec.output_tokens = sum(rec.chunk_tokens)
    rec.server_prompt_tokens = 8
    rec.running_usage = True
    return finalize_request(rec, 0.0, 0.0)


def test_a_delivery_gap_with_requests_in_flight_is_counted_as_a_stall() -> None:
    ticks = [0.05 + 0.02 * i for i in range(20)]  # up to 0.43 s
    late = [1.43 + 0.02 * i for i in range(10)]  # nothing reached any client for 1.0 s
    # a multi-token chunk stream (MTP-like) sees the same gap: its chunk arrivals count, not its spread ITLs
    rows = [_stream(0, 0.0, ticks + late), _stream(1, 0.01, [t + 0.005 for t in ticks + late], [2] * 30)]
    res = compute_metrics(rows, 2.0)
    assert res["stalls"] == 1 and res["stalled_s"] == pytest.approx(0.995, abs=0.01)
    assert res["longest_stall_ms"] == pytest.approx(995, abs=10)
    steady = compute_metrics([_stream(0, 0.0, ticks)], 1.0)
    assert steady["stalls"] == 0 and steady["stalled_s"] == 0.0
    # an idle gap between two requests is no stall: nothing was in flight
    idle = compute_metrics([_stream(0, 0.0, ticks), _stream(1, 2.0, [2.05 + 0.02 * i for i in range(5)])], 3.0)
    assert idle["stalls"] == 0
