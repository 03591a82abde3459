"""A broken run says so: non-zero exit and partial/run_failed flags, stalled streams cut early, SIGTERM
handled like Ctrl-C (results written), and no empty directories left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glm5_fp4.cli import main as cli_main
from glm5_fp4.loadtest import runner as runner_module
from glm5_fp4.loadtest.fake_server import spawn_fake_server
from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest_detailed

ROOT = Path(__file__).resolve().parents[1]


def _summary(result_dir: Path) -> dict:
    (path,) = sorted(result_dir.glob("*.json"))
    return json.loads(path.read_text())


def _cli(url: str, result_dir: Path, *extra: str) -> int:
    return cli_main(["loadtest", "--url", url, "--model", "fake-model", "--concurrency", "4", "--num-prompts", "16",
                     "--input-len", "8", "--output-len", "20", "--num-warmups", "0", "--prompt-format", "ids",
                     "--no-progress", "--no-telemetry", "--timeout", "30", "--result-dir", str(result_dir), *extra])


def test_server_dying_mid_run_is_a_failed_run(tmp_path):
    with spawn_fake_server("--ttft-ms", "20", "--itl-ms", "20", "--die-after-chunks", "60") as srv:
        rc = _cli(srv.url, tmp_path)
    s = _summary(tmp_path)
    assert s["failed"] >= 8 and s["completed"] < 16
    assert rc == 1
    assert s["partial"] is True and s["run_failed"] is True
    assert f"{s['failed']} of 16 requests failed" in s["failure_reason"]


@pytest.mark.parametrize("threshold,want_rc", [(None, 1), ("0.2", 0)])
def test_failed_requests_fail_the_run_above_the_threshold(tmp_path, threshold, want_rc):
    extra = ("--max-failed-fraction", threshold) if threshold else ()
    with spawn_fake_server("--ttft-ms", "5", "--itl-ms", "5", "--http-error-every", "8") as srv:  # 2 of 16 fail
        rc = _cli(srv.url, tmp_path, *extra)
    s = _summary(tmp_path)
    assert s["failed"] == 2 and s["completed"] == 14
    assert s["partial"] is True  # always: 2 requests are missing from the figures
    assert s["run_failed"] is (want_rc == 1) and rc == want_rc
    md = next(tmp_path.glob("*.md")).read_text()
    assert "2 of 16 requests failed" in md


def test_a_hung_stream_is_cut_at_the_stall_limit_from_the_observed_itl(tmp_path, monkeypatch):
    """Hung streams (after 3 tokens) fail as `stalled` within about the limit, not after the read timeout."""
    monkeypatch.setattr(runner_module, "STALL_MIN_S", 0.5)  # the floor; 50 x p99 ITL (10 ms) is below it
    n = 12
    with spawn_fake_server("--ttft-ms", "10", "--itl-ms", "10", "--hang-every", "4", "--fail-after-chunks", "3") as srv:
        cfg = LoadTestConfig(url=srv.url, model="fake-model", concurrency=4, num_prompts=n, input_len=8,
                             output_len=20, num_warmups=0, prompt_format="ids", timeout_s=20, progress=False,
                             telemetry=False, result_dir=str(tmp_path))
        t = time.monotonic()
        res, rows = run_loadtest_detailed(cfg)
        elapsed = time.monotonic() - t
    assert elapsed < 5.0, elapsed
    assert res["errors_by_kind"] == {"stalled": 3} and res["completed"] == n - 3
    stalled = [r for r in rows if r["error_kind"] == "stalled"]
    assert all(r["streamed_tokens"] == 3 and "no token for" in r["error"] for r in stalled)
    assert res["run_failed"] is True
    # the limit in force: the floor, or 50 x the p99 of the chunk gaps the watch saw when that is longer. The watch
    # sees the gaps of the streams running at each check (a subset of all), so its p99 can sit above the summary's
    # p99 (one scheduling hiccup on a loaded CPU) but never above the largest gap any stream had.
    gaps = [g for r in rows for g in (r.get("chunk_itl_ms") or r.get("itl_ms") or [])]
    assert gaps and 0.5 <= res["stall_timeout_s"] <= max(0.5, runner_module.STALL_FACTOR * max(gaps) / 1e3 * 1.001)
    # the run's duration is not stretched by the hung streams to anything near the read timeout
    assert res["duration"] < 5.0


def test_stall_limit_follows_the_itl_and_can_be_set(monkeypatch):
    watch = runner_module.StallWatch(None)
    assert watch.limit() == runner_module.STALL_MIN_S  # nothing observed yet
    watch.gaps.extend([0.4] * 100)
    assert watch.limit() == pytest.approx(runner_module.STALL_FACTOR * 0.4)
    assert runner_module.StallWatch(3.0).limit() == 3.0
    assert runner_module.StallWatch(0.0).limit() is None  # off


def _no_empty_dirs(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_dir() and not any(p.iterdir())]


def _signalled(cmd, srv, ready, what: str, signum) -> tuple[subprocess.Popen, str, float]:
    """Run ``cmd`` (this checkout on its path), send ``signum`` once the fake server's stats are ``ready``; the
    finished process, its stderr and when the signal went (time.monotonic)."""
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    srv.wait_for(ready, 60, what)
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc, err, sent


def test_sigterm_writes_partial_results_like_ctrl_c(tmp_path):
    out = tmp_path / "results"
    with spawn_fake_server("--ttft-ms", "20", "--itl-ms", "100") as srv:
        cmd = [sys.executable, "-m", "glm5_fp4.cli", "loadtest", "--url", srv.url, "--model", "fake-model",
               "--concurrency", "4", "--num-prompts", "16", "--input-len", "8", "--output-len", "100",
               "--num-warmups", "0", "--prompt-format", "ids", "--no-progress", "--result-dir", str(out)]
        # the measured phase is running (its SIGTERM handler in place) once its 4 streams decode; a cold child
        # on a loaded VM takes seconds to get there, so wait for the server to see them rather than a clock
        proc, err, _ = _signalled(cmd, srv, lambda st: st["active"] == 4 and st["tokens_sent"] >= 4,
                                  "4 streams decoding", signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    s = _summary(out)
    assert s["partial"] is True and "SIGTERM" in s["abort_reason"] and s["run_failed"] is True
    rows = (out / s["requests_file"]).read_text().splitlines()
    assert len(rows) == 16  # every request accounted for
    assert _no_empty_dirs(out) == []
    assert "Traceback" not in err


def test_a_run_that_fails_before_measuring_leaves_no_directories(tmp_path):
    out = tmp_path / "results"
    with spawn_fake_server("--http-error-every", "1") as srv:  # every request fails: warm-ups too
        rc = cli_main(["loadtest", "--url", srv.url, "--model", "fake-model", "--num-prompts", "4", "--input-len", "8",
                       "--output-len", "4", "--num-warmups", "2", "--prompt-format", "ids", "--no-progress",
                       "--result-dir", str(out)])
    assert rc == 1 and not out.exists()


def test_a_server_that_died_is_named_as_the_cause(tmp_path):
    """When requests fail and the server no longer answers at all, the reason says so (the H200 SGLang run's
    log said only 'response payload broken' for a server that had crashed)."""
    with spawn_fake_server("--ttft-ms", "20", "--itl-ms", "20", "--die-after-chunks", "60") as srv:
        rc = _cli(srv.url, tmp_path)
    s = _summary(tmp_path)
    assert rc == 1 and s["server_gone"]
    assert "the server no longer answers" in s["failure_reason"] and "crashed, hung or was stopped" in s["failure_reason"]


def test_warm_up_against_a_dead_server_says_it_died(tmp_path, capsys):
    with spawn_fake_server("--ttft-ms", "5", "--itl-ms", "5", "--die-after-chunks", "3") as srv:
        rc = cli_main(["loadtest", "--url", srv.url, "--model", "fake-model", "--concurrency", "4",
                       "--num-prompts", "8", "--input-len", "8", "--output-len", "20", "--num-warmups", "4",
                       "--prompt-format", "ids", "--no-progress", "--no-telemetry", "--timeout", "30",
                       "--result-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc != 0 and "warm-up requests" in err and "the server no longer answers" in err, err


def test_failures_on_a_live_server_do_not_blame_its_death(tmp_path):
    with spawn_fake_server("--ttft-ms", "5", "--itl-ms", "5", "--http-error-every", "8") as srv:
        _cli(srv.url, tmp_path)
    s = _summary(tmp_path)
    assert s["failed"] == 2 and s["server_gone"] is None and "no longer answers" not in s["failure_reason"]


# The child must get Python's own SIGINT handler even when started with SIGINT ignored (a background job of a
# non-interactive shell): it is what turns Ctrl-C into KeyboardInterrupt, and asyncio.Runner into a cancel.
_CTRL_C_CLI = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "from glm5_fp4.cli import main; sys.exit(main())")


@pytest.mark.parametrize("levels", ["2", "2,4"])
def test_ctrl_c_stops_the_run_and_the_sweep_at_once(tmp_path, levels):
    """Ctrl-C was recorded as an abort with stopped_by null: a sweep ran its next level in full after it, and the
    exit code was 1. Now it is stopped_by SIGINT, the sweep stops there, and the exit code is 130 (SIGTERM: 143)."""
    out = tmp_path / "results"
    with spawn_fake_server("--ttft-ms", "20", "--itl-ms", "100") as srv:
        cmd = [sys.executable, "-c", _CTRL_C_CLI, "loadtest", "--url", srv.url, "--model", "fake-model",
               "--concurrency", levels, "--num-prompts", "8", "--input-len", "8", "--output-len", "100",
               "--num-warmups", "0", "--prompt-format", "ids", "--no-progress", "--no-telemetry",
               "--result-dir", str(out)]
        proc, err, t = _signalled(cmd, srv, lambda st: st["active"] == 2 and st["tokens_sent"] >= 2,
                                  "2 streams decoding", signal.SIGINT)
        arrivals = srv.stats()["arrivals"]
    assert proc.returncode == 128 + signal.SIGINT, err
    assert time.monotonic() - t < 10 and arrivals <= 8, "the next level ran after Ctrl-C"
    name = "c2.json" if "," in levels else None
    s = json.loads((out / name).read_text()) if name else _summary(out)
    assert s["stopped_by"] == "SIGINT" and "Ctrl-C" in s["abort_reason"] and s["run_failed"] is True
    rows = [json.loads(line) for line in (out / s["requests_file"]).read_text().splitlines()]
    assert len(rows) == 8
    # the requests never sent stay 'not_sent', without times (they were 'failed' rows starting at -49,224 s)
    unsent = [r for r in rows if r["status"] == "not_sent"]
    assert unsent and s["not_sent"] == len(unsent) and all(r.get("start_s") is None for r in unsent), unsent[:1]
    if name:
        assert not (out / "c4.json").exists()
        assert "Levels not run (the sweep stopped): 4" in (out / "sweep.md").read_text()
    assert "Traceback" not in err


def test_a_telemetry_sampler_that_cannot_start_does_not_stop_the_load_test(tmp_path, monkeypatch, capsys):
    """Telemetry must never break a load test: building the sampler was guarded, starting it (an unwritable
    folder, NVML failing) was not, and the run died before its first request."""
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.telemetry import sampler as sampler_module

    def refuse(self):
        raise Glm5Fp4Error(f"{self.out_dir}: cannot write telemetry.jsonl (Permission denied)")

    monkeypatch.setattr(sampler_module.TelemetrySampler, "start", refuse)
    with spawn_fake_server("--ttft-ms", "1", "--itl-ms", "1") as srv:
        cfg = LoadTestConfig(url=srv.url, model="fake-model", concurrency=2, num_prompts=4, input_len=8,
                             output_len=4, num_warmups=0, prompt_format="ids", timeout_s=20, progress=False,
                             telemetry=True, result_dir=str(tmp_path))
        res, rows = run_loadtest_detailed(cfg)
    assert res["completed"] == 4 and not res["run_failed"], res
    assert "telemetry disabled" in capsys.readouterr().err


def test_sigterm_before_the_measured_phase_exits_143(tmp_path):
    """SIGTERM in the warm-up exited 1 as an error (and a sweep blamed it on the level); Ctrl-C there exits 130."""
    out = tmp_path / "results"
    with spawn_fake_server("--ttft-ms", "3000", "--itl-ms", "50") as srv:
        cmd = [sys.executable, "-m", "glm5_fp4.cli", "loadtest", "--url", srv.url, "--model", "fake-model",
               "--concurrency", "2", "--num-prompts", "4", "--input-len", "8", "--output-len", "8",
               "--num-warmups", "2", "--prompt-format", "ids", "--no-progress", "--no-telemetry",
               "--result-dir", str(out)]
        proc, err, _ = _signalled(cmd, srv, lambda st: st["active"] >= 1, "the warm-up under way", signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "nothing was written" in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())
