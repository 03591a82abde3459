"""Workload shape: fixed output length via ignore_eos/min_tokens, open-loop arrivals, warm-ups, config input."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest.fake_server import spawn_fake_server
from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest, run_loadtest_detailed


def test_ignore_eos_and_min_tokens_fix_the_output_length() -> None:
    # The server stops after 3 tokens unless told to ignore EOS (or given min_tokens), like a model would.
    with spawn_fake_server("--ttft-ms", "2", "--itl-ms", "2", "--eos-after", "3") as srv:
        common = dict(url=srv.url, model="fake-model", concurrency=2, num_prompts=4, input_len=8, output_len=12,
                      num_warmups=0, prompt_format="ids", progress=False, telemetry=False)
        fixed = run_loadtest(LoadTestConfig(**common))
        only_min = run_loadtest(LoadTestConfig(**common, ignore_eos=False))
        free = run_loadtest(LoadTestConfig(**common, ignore_eos=False, min_tokens=False))
    assert fixed["total_output_tokens"] == 4 * 12 and fixed["short_outputs"] == 0
    assert only_min["total_output_tokens"] == 4 * 12
    assert free["total_output_tokens"] == 4 * 3 and free["short_outputs"] == 4
    assert fixed["metadata"]["ignore_eos"] is True and free["metadata"]["min_tokens"] is False


def test_open_loop_arrivals_follow_the_request_rate() -> None:
    rate = 25.0
    with spawn_fake_server("--ttft-ms", "5", "--itl-ms", "5") as srv:
        # burstiness -> infinity makes gamma gaps constant (1/rate): send times are predictable
        res, rows = run_loadtest_detailed(LoadTestConfig(
            url=srv.url, model="fake-model", concurrency=16, num_prompts=12, input_len=8, output_len=4,
            request_rate=rate, burstiness=1e6, num_warmups=0, prompt_format="ids", progress=True,
            telemetry=False))
    starts = np.array(sorted(r["start_s"] for r in rows))
    assert res["completed"] == 12 and res["request_rate"] == rate
    late = starts - np.arange(len(starts)) / rate
    # never early; a stalled machine may send late, but typically on time
    assert late.min() > -0.002 and np.median(late) < 0.01, late


def test_warmups_run_before_the_measured_phase() -> None:
    with spawn_fake_server("--ttft-ms", "1", "--itl-ms", "1") as srv:
        res = run_loadtest(LoadTestConfig(url=srv.url, model="fake-model", concurrency=2, num_prompts=4,
                                          input_len=8, output_len=3, num_warmups=5, warmup_output_len=2,
                                          prompt_format="ids", progress=False, telemetry=False))
        stats = json.load(urllib.request.urlopen(srv.url + "/fake/stats"))
    assert res["metadata"]["num_warmups"] == 5 and res["metadata"]["warmup_failed"] == 0
    assert stats["arrivals"] == 5 + 4 and res["num_prompts"] == 4
    assert stats["tokens_sent"] == 5 * 2 + 4 * 3


def test_all_warmups_failing_is_a_clear_error() -> None:
    with spawn_fake_server("--http-error-every", "1", "--http-error-status", "404") as srv:
        with pytest.raises(Glm5Fp4Error, match="warm-up requests .* failed.*HTTP 404"):
            run_loadtest(LoadTestConfig(url=srv.url, model="nope", concurrency=2, num_prompts=4, input_len=8,
                                        output_len=3, num_warmups=2, prompt_format="ids", progress=False,
                                        telemetry=False))


def test_config_from_a_mapping_and_bad_fields() -> None:
    cfg = LoadTestConfig.from_mapping({"url": "http://127.0.0.1:1", "concurrency": 8})
    assert cfg.num_prompts == 32 and cfg.num_warmups == 8
    with pytest.raises(Glm5Fp4Error, match="unknown field"):
        LoadTestConfig.from_mapping({"concurency": 8})
    for bad in ({"concurrency": 0}, {"endpoint": "embeddings"}, {"percentile_metrics": ("ttft", "foo")},
                {"request_rate": 0.0}, {"percentiles": (0.0,)}):
        with pytest.raises(Glm5Fp4Error):
            LoadTestConfig(**bad)


def test_hung_warmup_hits_the_timeout() -> None:
    with spawn_fake_server("--ttft-ms", "1", "--itl-ms", "1", "--hang-every", "1") as srv:
        with pytest.raises(Glm5Fp4Error, match="warm-up requests .* did not finish within --timeout"):
            run_loadtest(LoadTestConfig(url=srv.url, model="fake-model", concurrency=2, num_prompts=4, input_len=8,
                                        output_len=6, num_warmups=2, warmup_output_len=6, timeout_s=1.0,
                                        prompt_format="ids", progress=False, telemetry=False))


def test_telemetry_sampler_wraps_the_measured_phase(tmp_path, monkeypatch) -> None:
    import sys
    import time
    import types

    events: dict = {}

    class FakeSampler:
        def __init__(self, out_dir, interval_s=0.1):
            events["out_dir"], events["interval_s"] = out_dir, interval_s

        def start(self):  # the runner starts it where it builds it, under the same guard
            events["enter"] = time.perf_counter()
            return self

        def stop(self):
            events["exit"] = time.perf_counter()
            return self.summary()

        def summary(self):
            return {"available": True, "energy_j": 12.5}

    fake = types.ModuleType("glm5_fp4.telemetry.sampler")
    fake.TelemetrySampler = FakeSampler
    monkeypatch.setitem(sys.modules, "glm5_fp4.telemetry.sampler", fake)
    with spawn_fake_server("--ttft-ms", "5", "--itl-ms", "5") as srv:
        common = dict(url=srv.url, model="fake-model", concurrency=2, num_prompts=4, input_len=8, output_len=4,
                      num_warmups=2, prompt_format="ids", progress=False, result_dir=str(tmp_path))
        res, rows = run_loadtest_detailed(LoadTestConfig(**common))
        off = run_loadtest(LoadTestConfig(**common, telemetry=False, result_filename="off.json"))
    t0 = res["metadata"]["start_perf_counter"]
    assert res["telemetry"] == {"available": True, "energy_j": 12.5}
    assert events["out_dir"] == tmp_path / "telemetry" and events["interval_s"] == 0.1
    # entered before the first measured request, left after the last one
    assert events["enter"] <= t0 + min(r["start_s"] for r in rows)
    assert events["exit"] >= t0 + max(r["end_s"] for r in rows)
    assert "telemetry" not in off
