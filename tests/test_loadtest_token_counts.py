"""Token counts when the server does not send usage on every chunk (continuous_usage_stats is vLLM's own).

The fake server sends 2 tokens per chunk every 10 ms, so every per-token ITL is 5 ms; with usage only in
the last chunk, or none at all, the tester must still see 2 tokens per chunk (from each chunk's text, with
the run's tokenizer) or, without a tokenizer, spread the final count evenly; and it says which it did.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from glm5_fp4.loadtest.client import RequestRecord
from glm5_fp4.loadtest.fake_server import spawn_fake_server
from glm5_fp4.loadtest.metrics import chunk_token_counts, compute_metrics, finalize_request
from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest_detailed

OUT = 64  # 32 chunks of 2 tokens


def _run(tmp_path, *server_args, **cfg):
    with spawn_fake_server("--ttft-ms", "30", "--itl-ms", "10", "--tokens-per-chunk", "2", *server_args) as srv:
        return run_loadtest_detailed(LoadTestConfig(
            url=srv.url, concurrency=4, num_prompts=8, input_len=16, output_len=OUT, num_warmups=0,
            progress=False, telemetry=False, result_dir=str(tmp_path), **cfg))


@pytest.mark.parametrize("usage", ["last", "none"])
def test_itl_without_running_usage_counts_each_chunk_from_its_text(tmp_path, usage):
    res, rows = _run(tmp_path, "--usage", usage)
    assert res["completed"] == 8 and res["failed"] == 0
    assert res["token_count_method"] == {"tokenizer": 8}
    for r in rows:
        assert r["token_count_source"] == "tokenizer"
        assert r["output_tokens"] == OUT and r["chunk_tokens"] == [2] * (OUT // 2)
        assert len(r["itl_ms"]) == OUT - 1
    assert res["total_output_tokens"] == 8 * OUT
    # each 10 ms gap holds 2 tokens: 5 ms per token (and one 0 for the first chunk's second token)
    assert res["median_itl_ms"] == pytest.approx(5.0, rel=0.15)
    assert 4.0 < res["p90_itl_ms"] < 7.5
    assert res["median_chunk_itl_ms"] == pytest.approx(10.0, rel=0.15)
    md = (tmp_path / res["result_file"]).with_suffix(".md").read_text()
    assert "Tokens per chunk counted from: tokenizer (8)" in md


def test_prompt_tokens_zero_falls_back_to_the_client_count_and_says_so(tmp_path):
    res, rows = _run(tmp_path, "--prompt-tokens-zero")
    assert all(r["server_prompt_tokens"] == 0 for r in rows)
    assert res["total_input_tokens"] == 8 * 16
    assert "client" in res["input_tokens_source"] and "prompt_tokens 0" in res["input_tokens_source"]
    assert res["prompt_len_mismatches"] == 0
    summary = json.loads((tmp_path / res["result_file"]).read_text())
    assert summary["total_input_tokens"] == 8 * 16
    md = (tmp_path / res["result_file"]).with_suffix(".md").read_text()
    assert "Input tokens: the client's prompt lengths for 8 of 8 requests (the server reported prompt_tokens 0)" in md


def _record(n_chunks: int, final: int | None, texts=None, usage=False) -> RequestRecord:
    rec = RequestRecord(0, 5, final or n_chunks)
    rec.status, rec.start, rec.end = "ok", 0.0, 1.0
    rec.chunk_times = [0.1 + 0.01 * j for j in range(n_chunks)]
    rec.chunk_tokens = [1] * n_chunks
    rec.chunk_texts = texts if texts is not None else ["x"] * n_chunks
    rec.output_tokens = final
    rec.running_usage = usage
    return rec


def test_without_a_tokenizer_the_final_usage_is_spread_evenly():
    rec = _record(32, 64)
    counts, source = chunk_token_counts(rec, None)
    assert source == "spread" and counts == [2] * 32
    row = finalize_request(rec, 0.0, 0.0)
    assert row["token_count_source"] == "spread" and row["output_tokens"] == 64
    assert row["itl_ms"] == pytest.approx([0.0] + [5.0] * 62)  # each 10 ms gap holds two tokens
    res = compute_metrics([row], 1.0)
    assert res["median_itl_ms"] == pytest.approx(5.0) and res["token_count_method"] == {"spread": 1}


@pytest.mark.parametrize("seed", range(5))
def test_spreading_keeps_one_token_per_chunk_and_the_total(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    counts = rng.integers(1, 5, size=n).tolist()
    total = int(rng.integers(n, 4 * n + 1))
    rec = _record(n, total, texts=[f"t{j}" for j in range(n)])
    got, source = chunk_token_counts(rec, {f"t{j}": c for j, c in enumerate(counts)})
    assert sum(got) == total and min(got) >= 1
    assert source == ("tokenizer" if sum(counts) == total else "tokenizer+usage")
    spread, _ = chunk_token_counts(_record(n, total), None)
    assert sum(spread) == total and max(spread) - min(spread) <= 1  # evenly


def test_running_usage_wins_and_no_usage_no_tokenizer_counts_chunks():
    rec = _record(3, 6, usage=True)
    rec.chunk_tokens = [1, 2, 3]
    assert chunk_token_counts(rec, {"x": 9}) == ([1, 2, 3], "usage")
    assert chunk_token_counts(_record(3, None), None) == ([1, 1, 1], "chunks")
