"""A dying, hanging or misbehaving server ends the run cleanly, with every request accounted for."""

from __future__ import annotations

import json
import threading
import time

import pytest

from glm5_fp4.cli import main as cli_main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.loadtest.fake_server import spawn_fake_server
from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest_detailed


def _files(tmp_path):
    jsons = sorted(tmp_path.glob("*.json"))
    assert len(jsons) == 1, jsons
    summary = json.loads(jsons[0].read_text())
    lines = (tmp_path / summary["requests_file"]).read_text().splitlines()
    return summary, [json.loads(x) for x in lines]


def _accounted(rows, n):
    assert sorted(r["index"] for r in rows) == list(range(n))
    for r in rows:
        assert r["status"] in ("ok", "failed", "not_sent")
        if r["status"] != "ok":
            assert r["error_kind"] and r["error"], r


def test_server_killed_mid_run(tmp_path) -> None:
    n = 24
    with spawn_fake_server("--ttft-ms", "50", "--itl-ms", "50") as srv:
        cfg = LoadTestConfig(url=srv.url, model="fake-model", concurrency=8, num_prompts=n, input_len=16,
                             output_len=30, num_warmups=0, prompt_format="ids", timeout_s=20, progress=False,
                             telemetry=False, result_dir=str(tmp_path))
        def kill_mid_stream():  # SIGKILL once all 8 streams are decoding (~5 of 30 tokens each), not on a clock
            srv.wait_for(lambda st: st["active"] == 8 and st["tokens_sent"] >= 8 * 5, 60, "8 streams decoding")
            srv.kill()

        killer = threading.Thread(target=kill_mid_stream, daemon=True)
        killer.start()
        t = time.monotonic()
        res, rows = run_loadtest_detailed(cfg)
        elapsed = time.monotonic() - t
        killer.join()
    assert elapsed < 10, f"run took {elapsed:.1f} s after the server died"
    _accounted(rows, n)
    assert res["completed"] == 0 and res["failed"] == n
    kinds = res["errors_by_kind"]
    # the in-flight streams lose their connection; what is sent after the death cannot connect
    # (or, racing the teardown, is accepted and reset: also "disconnected")
    assert set(kinds) <= {"disconnected", "connect_error"}, kinds
    assert kinds.get("disconnected", 0) >= 8 and kinds.get("connect_error", 0) >= 1, kinds
    summary, file_rows = _files(tmp_path)
    assert summary["failed"] == n and len(file_rows) == n
    _accounted(file_rows, n)
    # the dead streams still report what arrived before the cut
    cut = [r for r in file_rows if r.get("streamed_tokens")]
    assert len(cut) == 8 and all(r["streamed_tokens"] < 30 and r["ttft_ms"] > 0 for r in cut)


def test_server_dying_by_itself(tmp_path) -> None:
    n = 12
    with spawn_fake_server("--ttft-ms", "20", "--itl-ms", "20", "--die-after-chunks", "40") as srv:
        res, rows = run_loadtest_detailed(LoadTestConfig(
            url=srv.url, model="fake-model", concurrency=4, num_prompts=n, input_len=8, output_len=20,
            num_warmups=0, prompt_format="ids", timeout_s=20, progress=False, telemetry=False))
    _accounted(rows, n)
    assert res["completed"] + res["failed"] == n and res["failed"] >= n - 4


def test_hung_streams_end_at_the_run_timeout(tmp_path) -> None:
    n = 10
    with spawn_fake_server("--ttft-ms", "10", "--itl-ms", "10", "--hang-every", "1", "--fail-after-chunks", "3") as srv:
        cfg = LoadTestConfig(url=srv.url, model="fake-model", concurrency=4, num_prompts=n, input_len=8,
                             output_len=20, num_warmups=0, prompt_format="ids", timeout_s=1.5, progress=False,
                             telemetry=False, result_dir=str(tmp_path))
        t = time.monotonic()
        res, rows = run_loadtest_detailed(cfg)
        elapsed = time.monotonic() - t
    assert elapsed < 1.5 + 3.0, elapsed
    assert res["partial"] is True and "timeout" in res["abort_reason"]
    _accounted(rows, n)
    assert res["errors_by_kind"] == {"timeout": 4, "not_sent": n - 4}
    hung = [r for r in rows if r["error_kind"] == "timeout"]
    assert all(r["streamed_tokens"] == 3 for r in hung)  # partial streams are kept
    summary, file_rows = _files(tmp_path)
    assert summary["partial"] is True and len(file_rows) == n


def _expected_kind(n: int, every: dict[str, int]) -> str:
    hit = {k: v and n % v == v - 1 for k, v in every.items()}
    if hit["http"]:
        return "http_500"
    if hit["malformed"]:
        return "malformed_sse"
    if hit["error_event"]:
        return "server_error_event"
    if hit["truncate"]:
        return "disconnected"
    return "ok"


def test_malformed_sse_and_http_errors_are_counted(tmp_path) -> None:
    n = 40
    every = {"http": 5, "malformed": 7, "error_event": 9, "truncate": 11}
    with spawn_fake_server("--ttft-ms", "5", "--itl-ms", "5", "--http-error-every", "5", "--malformed-every", "7",
                           "--error-event-every", "9", "--truncate-every", "11") as srv:
        res, rows = run_loadtest_detailed(LoadTestConfig(
            url=srv.url, model="fake-model", concurrency=4, num_prompts=n, input_len=8, output_len=6,
            num_warmups=0, prompt_format="ids", timeout_s=30, progress=False, telemetry=False,
            result_dir=str(tmp_path)))
    expected: dict[str, int] = {}
    for i in range(n):
        k = _expected_kind(i, every)
        expected[k] = expected.get(k, 0) + 1
    ok = expected.pop("ok")
    assert res["completed"] == ok and res["failed"] == n - ok
    assert res["errors_by_kind"] == expected
    _accounted(rows, n)
    assert "HTTP 500" in res["first_errors"]["http_500"]
    assert "malformed" in res["first_errors"]["malformed_sse"]
    # the good requests are measured as usual
    assert res["total_output_tokens"] == ok * 6


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://example.com:8000", "http://192.168.1.2",
                                 "http://[2001:db8::1]:8000"])
def test_non_loopback_url_is_refused(url: str, capsys) -> None:
    with pytest.raises(Glm5Fp4Error, match="--allow-remote"):
        LoadTestConfig(url=url)
    LoadTestConfig(url=url, allow_remote=True)  # explicit consent is enough to build the config
    assert cli_main(["loadtest", "--url", url, "--no-progress", "--result-dir", ""]) == 1
    assert "--allow-remote" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000",
                                 "http://127.0.0.2:9"])
def test_loopback_urls_are_accepted(url: str) -> None:
    LoadTestConfig(url=url)


def test_bad_url_and_unreachable_server(capsys) -> None:
    with pytest.raises(Glm5Fp4Error, match="not an http"):
        LoadTestConfig(url="127.0.0.1:8000")
    # nothing listens on port 9 (discard): a clear error, not a traceback
    assert cli_main(["loadtest", "--url", "http://127.0.0.1:9", "--no-progress", "--result-dir", ""]) == 1
    assert "cannot reach" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:notaport", "http://127.0.0.1:99999"])
def test_an_unparsable_url_is_one_error_naming_url(url: str, capsys) -> None:
    """`--url 'http://[::1'` was a ValueError traceback from urlsplit."""
    with pytest.raises(Glm5Fp4Error, match="--url"):
        LoadTestConfig(url=url)
    assert cli_main(["loadtest", "--url", url, "--no-progress", "--result-dir", ""]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--url" in err and "not a valid URL" in err and "Traceback" not in err, err
