"""`glm5-fp4 profile analyze` and `capture` end to end (capture against a fake loopback server)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from glm5_fp4.cli import main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling.capture import CaptureConfig, capture
from glm5_fp4.profiling.traces import write_trace

from profiling_synthetic import make_decode_traces


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    files, _ = make_decode_traces(n_ranks=2, n_steps=6, layers=3, graph="breakable", slow_rank=1)
    for name, trace in files:
        write_trace(trace, d / name)
    return d


def test_analyze_writes_markdown_json_and_pngs(trace_dir, tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(["profile", "analyze", str(trace_dir), "--out", str(out), "--batch", "64", "--context", "2048", "--gpu", "rtx-pro-6000-ws", "--jobs", "1"])
    assert rc == 0
    for name in ("breakdown.md", "breakdown.json", "breakdown.png", "roofline.png"):
        assert (out / name).stat().st_size > 0
    data = json.loads((out / "breakdown.json").read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["ceilings"]["categories"]["expert_gemm"]["peak_tflops_sparse"] == 4000
    md = (out / "breakdown.md").read_text()
    for needle in ("allreduce_wait", "Unknown kernels", "mystery_kernel_xyz", "% of sparse peak", "Slowest rank", "bound"):
        assert needle in md
    assert "median step, exposed time" in capsys.readouterr().out


def test_analyze_detects_the_gpu_from_the_trace(trace_dir, tmp_path):
    out = tmp_path / "r"
    assert main(["profile", "analyze", str(trace_dir), "--out", str(out), "--batch", "8", "--no-png", "--jobs", "1"]) == 0
    data = json.loads((out / "breakdown.json").read_text())
    assert data["ceilings"]["gpu"] == "h200"  # the synthetic traces say "NVIDIA H200"
    assert not (out / "breakdown.png").exists()


def test_analyze_without_batch_has_no_ceilings_and_says_so(trace_dir, tmp_path):
    out = tmp_path / "r"
    assert main(["profile", "analyze", str(trace_dir), "--out", str(out), "--no-png", "--jobs", "1"]) == 0
    data = json.loads((out / "breakdown.json").read_text())
    assert data["ceilings"] is None and any("--batch" in n for n in data["notes"])


def test_corrupt_trace_is_one_error_line_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz"
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage")
    assert main(["profile", "analyze", str(tmp_path), "--jobs", "1"]) == 1
    err = capsys.readouterr().err
    assert bad.name in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("naming", ["plain", "vllm"])
def test_analyze_skips_non_trace_json_including_its_own_output(tmp_path, capsys, naming):
    """--out DIR puts breakdown.json next to the traces; a second run (and any stray JSON) must not abort."""
    files, _ = make_decode_traces(n_ranks=2, n_steps=4, layers=2, graph="full", naming=naming)
    for name, trace in files:
        write_trace(trace, tmp_path / name)
    (tmp_path / "run-notes.json").write_text(json.dumps({"who": "me", "batch": 8}))
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    assert main(["profile", "analyze", str(tmp_path), "--out", str(tmp_path), "--no-png", "--jobs", "1"]) == 0
    first = json.loads((tmp_path / "breakdown.json").read_text())
    assert main(["profile", "analyze", str(tmp_path), "--out", str(tmp_path), "--no-png", "--jobs", "1"]) == 0
    again = json.loads((tmp_path / "breakdown.json").read_text())
    assert [r["file"] for r in again["ranks"]] == [r["file"] for r in first["ranks"]] == sorted(n for n, _ in files)
    assert again["ranks"][0]["summed_us"] == first["ranks"][0]["summed_us"]
    out = capsys.readouterr().out
    if naming == "plain":  # trace-named files (vLLM's *.pt.trace.json.gz) are picked without reading the rest
        skipped = [n for n in again["notes"] if n.startswith("skipped")]
        assert len(skipped) == 1 and all(f in skipped[0] for f in ("breakdown.json", "run-notes.json", "list.json"))
        assert "skipped" in out


def test_analyze_directory_of_only_non_trace_json_is_one_error(tmp_path, capsys):
    (tmp_path / "breakdown.json").write_text(json.dumps({"ranks": []}))
    assert main(["profile", "analyze", str(tmp_path), "--jobs", "1"]) == 1
    err = capsys.readouterr().err
    assert "no trace" in err and "breakdown.json" in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_analyze_out_that_cannot_be_a_directory_is_one_clear_error(trace_dir, tmp_path, capsys, where):
    existing = tmp_path / "report.md"
    existing.write_text("keep me")
    out = existing if where == "file" else existing / "sub"
    assert main(["profile", "analyze", str(trace_dir), "--out", str(out), "--no-png", "--jobs", "1"]) == 1
    err = capsys.readouterr().err
    assert str(existing) in err and "not a directory" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert existing.read_text() == "keep me"


def test_cpu_run_is_labelled_cpu(tmp_path):
    events = [{"ph": "X", "cat": "cpu_op", "name": n, "pid": 1, "tid": 1, "ts": 1000.0 * s + o, "dur": d}
              for s in range(3) for n, o, d in (("aten::addmm", 0, 10.0), ("_C::cpu_fused_moe", 12, 20.0))]
    write_trace({"traceEvents": events}, tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz")
    out = tmp_path / "r"
    assert main(["profile", "analyze", str(tmp_path), "--out", str(out), "--batch", "4", "--jobs", "1"]) == 0
    md = (out / "breakdown.md").read_text()
    assert md.startswith("# Decode-time breakdown: CPU run")
    assert "no ceilings for a CPU run" in md  # a CPU run is not compared with a GPU unless --gpu says which


# -- capture against a fake server --------------------------------------------------------------------
class FakeServer:
    """vLLM-like: /version, /v1/models, streaming /v1/completions, /start_profile, /stop_profile writing traces;
    with ``server_info`` SGLang-like: /get_server_info answers it (SGLang's server args)."""

    def __init__(self, trace_dir: Path, server_info: dict | None = None, start_delay_s: float = 0.0,
                 late_rank_s: float = 0.0):
        self.trace_dir = trace_dir
        self.server_info = server_info
        self.start_delay_s = start_delay_s  # /start_profile profiles at once but answers this much later
        self.late_rank_s = late_rank_s  # rank 1's trace is written this much after rank 0's
        self.calls: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def _json(self, code, body):
                payload = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                outer.calls.append(f"GET {self.path}")
                if self.path == "/version":
                    self._json(200, {"version": "0.33.0"})
                elif self.path == "/get_server_info" and outer.server_info is not None:
                    self._json(200, outer.server_info)
                elif self.path == "/v1/models":
                    self._json(200, {"data": [{"id": "glm-5-tiny"}]})
                else:
                    self._json(404, {"detail": "Not Found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                outer.calls.append(f"POST {self.path}")
                if self.path == "/v1/completions":
                    assert body["stream"] and body["ignore_eos"]
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    try:
                        for i in range(min(body["max_tokens"], 400)):
                            self.wfile.write(f'data: {{"choices": [{{"text": "t{i}"}}]}}\n\n'.encode())
                            self.wfile.flush()
                            time.sleep(0.005)
                        self.wfile.write(b"data: [DONE]\n\n")
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                elif self.path == "/start_profile":
                    time.sleep(outer.start_delay_s)
                    self._json(200, {})
                elif self.path == "/stop_profile":
                    files, _ = make_decode_traces(n_ranks=2, n_steps=4, layers=2)
                    for i, (name, trace) in enumerate(files):
                        if i and outer.late_rank_s:
                            threading.Timer(outer.late_rank_s, write_trace, (trace, outer.trace_dir / name)).start()
                        else:
                            write_trace(trace, outer.trace_dir / name)
                    self._json(200, {})
                else:
                    self._json(404, {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_capture_drives_the_profiler_during_decode_and_collects_traces(tmp_path):
    trace_dir = tmp_path / "server_traces"
    trace_dir.mkdir()
    (trace_dir / "old.pt.trace.json.gz").write_bytes(b"from an earlier capture")
    with FakeServer(trace_dir) as server:
        out = tmp_path / "cap"
        rc = main(["profile", "capture", "--url", server.url, "--steps", "5", "--trace-dir", str(trace_dir),
                   "--concurrency", "2", "--out", str(out), "--analyze", "--no-png", "--jobs", "1"])
        assert rc == 0
        calls = list(server.calls)
    start = calls.index("POST /start_profile")
    assert calls.index("POST /stop_profile") > start
    assert sum(c == "POST /v1/completions" for c in calls[:start]) >= 2  # decode load was running first
    copied = sorted(p.name for p in (out / "traces").iterdir())
    assert len(copied) == 2 and "old.pt.trace.json.gz" not in copied
    assert (out / "breakdown" / "breakdown.md").exists()


def test_a_capture_stopped_while_profiling_stops_the_servers_profiler(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or any error) after /start_profile stopped the load but never sent /stop_profile: vLLM's profiler
    kept recording (memory grows; the next capture's /start_profile fails). It is now stopped on the way out, and
    the run says so; an existing file where the traces go is refused before any load is sent."""
    from glm5_fp4.profiling import capture as C

    trace_dir = tmp_path / "server_traces"
    trace_dir.mkdir()
    real_sleep = time.sleep

    def interrupted(s):
        if s >= 0.5:  # the profiling wait (the warm-up polls in 0.2 s naps)
            raise KeyboardInterrupt
        real_sleep(s)

    monkeypatch.setattr(C.time, "sleep", interrupted)
    with FakeServer(trace_dir) as server:
        rc = main(["profile", "capture", "--url", server.url, "--steps", "200", "--trace-dir", str(trace_dir),
                   "--concurrency", "2", "--out", str(tmp_path / "cap")])
        calls = list(server.calls)
    assert rc == 130 and calls.index("POST /stop_profile") > calls.index("POST /start_profile")
    assert "/stop_profile" in capsys.readouterr().err
    monkeypatch.setattr(C.time, "sleep", real_sleep)
    (tmp_path / "cap2").mkdir()
    (tmp_path / "cap2" / "traces").write_text("a file")
    with FakeServer(trace_dir) as server:
        rc = main(["profile", "capture", "--url", server.url, "--steps", "5", "--trace-dir", str(trace_dir),
                   "--out", str(tmp_path / "cap2")])
        assert rc == 1 and not any("completions" in c for c in server.calls)
    assert "traces" in capsys.readouterr().err


@pytest.mark.parametrize("told,kind", [("fp8_e4m3", "fp8"), (None, "bf16"), ("fp4_e2m1", "bf16")])
def test_capture_hands_the_sglang_servers_kv_cache_dtype_to_the_ceilings(tmp_path, told, kind):
    trace_dir = tmp_path / "server_traces"
    trace_dir.mkdir()
    info = {"version": "0.5.15", "model_path": "/ckpt"} | ({"kv_cache_dtype": told} if told else {})
    with FakeServer(trace_dir, server_info=info) as server:
        out = tmp_path / "cap"
        assert main(["profile", "capture", "--url", server.url, "--steps", "5", "--trace-dir", str(trace_dir),
                     "--concurrency", "2", "--out", str(out), "--analyze", "--no-png", "--jobs", "1",
                     "--gpu", "rtx-pro-6000-ws", "--batch", "2", "--context", "512"]) == 0
    ceilings = json.loads((out / "breakdown" / "breakdown.json").read_text())["ceilings"]
    said = ceilings["assumptions"]
    assert any(a.startswith(f"KV cache ({kind}):") for a in said)
    if told == "fp8_e4m3":
        assert ceilings["shape"]["kv_dtype"] == told
        assert "KV cache dtype: fp8_e4m3 -> fp8 (the server's kv_cache_dtype, from its /get_server_info)" in said
    else:
        assert any(a.startswith("KV cache dtype: bf16 (default") and (told or "") in a for a in said)


def test_capture_refuses_an_out_folder_holding_an_earlier_capture(tmp_path):
    """vLLM names traces by time, so a second capture into the same --out used to leave two traces per rank there
    and `--analyze` stopped at "two traces for rank 0" (seen with `make demo` run twice). It is refused before
    any load is sent, naming the folder."""
    trace_dir = tmp_path / "server_traces"
    trace_dir.mkdir()
    out = tmp_path / "cap"
    (out / "traces").mkdir(parents=True)
    (out / "traces" / "dp0_pp0_tp0_rank0.1.pt.trace.json.gz").write_bytes(b"earlier")
    with FakeServer(trace_dir) as server:
        with pytest.raises(Glm5Fp4Error, match=r"cap/traces already holds 1 trace file"):
            capture(CaptureConfig(url=server.url, steps=3, trace_dir=trace_dir, out=out / "traces"))
        assert not any(c.startswith("POST") for c in server.calls)


def test_capture_refuses_non_loopback_urls(tmp_path):
    cfg = CaptureConfig(url="http://10.1.2.3:8000", steps=3, trace_dir=tmp_path, out=tmp_path / "o")
    with pytest.raises(Glm5Fp4Error, match="loopback"):
        capture(cfg)


def test_capture_reports_an_unreachable_server(tmp_path):
    cfg = CaptureConfig(url="http://127.0.0.1:9", steps=3, trace_dir=tmp_path, out=tmp_path / "o", request_timeout_s=2)
    with pytest.raises(Glm5Fp4Error, match="not reachable"):
        capture(cfg)


# -- traces that are not one capture: one error naming the files, not numbers from mismatched ranks -----------------

def _one_line_error(capsys) -> str:
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_ranks_from_captures_far_apart_in_time_are_refused(tmp_path, capsys):
    """Rank 1's trace starts a minute after rank 0's ends (another capture, e.g. eager vs graph): no wait/work
    split can be made from them."""
    files, _ = make_decode_traces(n_ranks=2, n_steps=4, layers=2, graph="full", clock_offset_us={1: 60e6})
    for name, trace in files:
        write_trace(trace, tmp_path / name)
    assert main(["profile", "analyze", str(tmp_path), "--no-png", "--jobs", "1"]) == 1
    err = _one_line_error(capsys)
    assert all(name in err for name, _ in files) and "overlap" in err
    assert not (tmp_path / "breakdown").exists()


def test_ranks_written_to_different_capture_folders_are_refused(tmp_path, capsys):
    """Disjoint windows a little apart could be clock skew between hosts, unless the profiler wrote the ranks into
    different folders: then they are two captures put side by side."""
    files, _ = make_decode_traces(n_ranks=2, n_steps=4, layers=2, graph="full", clock_offset_us={1: 20_000.0})
    for (name, trace), run in zip(files, ("eager", "graph")):
        trace["traceName"] = f"/tmp/traces/tp2/{run}/{name[:-3]}"
        write_trace(trace, tmp_path / name)
    assert main(["profile", "analyze", str(tmp_path), "--no-png", "--jobs", "1"]) == 1
    err = _one_line_error(capsys)
    assert all(name in err for name, _ in files) and "/tmp/traces/tp2/eager" in err and "/tmp/traces/tp2/graph" in err


@pytest.mark.parametrize("with_trace_id", [True, False])
def test_one_trace_saved_twice_is_not_two_ranks(tmp_path, capsys, with_trace_id):
    (name, trace), = make_decode_traces(n_ranks=1, n_steps=4, layers=2, graph="full")[0]
    del trace["distributedInfo"]  # nothing but the file order would tell the ranks apart
    if with_trace_id:
        trace["trace_id"] = "B35BDA7FF0BA4026B2D08F539343017D"
    write_trace(trace, tmp_path / "r.pt.trace.json")
    write_trace(trace, tmp_path / ("r.pt.trace.json.gz" if with_trace_id else "copy.pt.trace.json.gz"))
    assert main(["profile", "analyze", str(tmp_path), "--batch", "8", "--context", "128", "--no-png",
                 "--jobs", "1"]) == 1
    err = _one_line_error(capsys)
    assert "r.pt.trace.json" in err and ("r.pt.trace.json.gz" if with_trace_id else "copy.pt.trace.json.gz") in err
    assert "same trace" in err


@pytest.mark.parametrize("argv,option", [
    (["--batch", "8", "--layout", "tp8ep8", "--expert-skew", "nan"], "--expert-skew"),
    (["--batch", "8", "--layout", "tp8ep8", "--expert-skew", "-1"], "--expert-skew"),
    (["--step-gap-us", "0"], "--step-gap-us"),
    (["--step-gap-us", "-5"], "--step-gap-us"),
    (["--step-gap-us", "nan"], "--step-gap-us"),
    (["--batch", "0"], "--batch"),
    (["--batch", "8", "--context", "-1"], "--context"),
    (["--batch", "8", "--tp", "0"], "--tp"),
    (["--tokens-per-seq", "0"], "--tokens-per-seq"),
    (["--jobs", "0"], "--jobs"),
])
def test_analyze_rejects_impossible_numbers_while_parsing(tmp_path, capsys, argv, option):
    with pytest.raises(SystemExit) as exc:
        main(["profile", "analyze", str(tmp_path), "--no-png", *argv])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert not out and option in err and "Traceback" not in err


def test_ranks_of_different_world_sizes_are_refused(tmp_path, capsys):
    files, _ = make_decode_traces(n_ranks=2, n_steps=4, layers=2, graph="full")
    files[1][1]["distributedInfo"]["world_size"] = 4  # rank 1 of a TP4 run beside rank 0 of a TP2 one
    for name, trace in files:
        write_trace(trace, tmp_path / name)
    assert main(["profile", "analyze", str(tmp_path), "--no-png", "--jobs", "1"]) == 1
    err = _one_line_error(capsys)
    assert all(name in err for name, _ in files) and "world_size" in err


@pytest.mark.parametrize("argv,msg", [(["--concurrency", "-1"], "argument --concurrency: '-1' must be >= 1"),
                                      (["--warmup-s", "nan"], "argument --warmup-s: 'nan' is not a finite number"),
                                      (["--steps", "0"], "argument --steps: '0' must be >= 1")])
def test_capture_numbers_are_checked_while_parsing(capsys, argv, msg):
    from glm5_fp4.cli import main

    with pytest.raises(SystemExit) as e:
        main(["profile", "capture", "--url", "http://127.0.0.1:9", "--steps", "2", "--trace-dir", "t", *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_capture_refuses_an_out_it_cannot_write_before_sending_load(tmp_path, capsys, monkeypatch):
    from glm5_fp4.cli import main
    from glm5_fp4.profiling import capture as C

    monkeypatch.setattr(C, "capture", lambda cfg: pytest.fail("load sent before --out was checked"))
    (tmp_path / "f").write_text("x")
    rc = main(["profile", "capture", "--url", "http://127.0.0.1:9", "--steps", "2", "--trace-dir", str(tmp_path),
               "--out", str(tmp_path / "f" / "cap")])
    assert rc == 1 and "--out" in capsys.readouterr().err


def test_one_rank_of_many_gets_no_tp1_ceilings(tmp_path, capsys):
    """One rank's file of an 8-rank capture (common: each rank's trace is gigabytes): the ceilings used to assume
    TP1, an 8x error printed as "% of BW 73826 %". The trace says world_size 8, so without --tp / --layout there are
    no ceilings and a note says what to pass; with --layout tp8 they are computed for TP8."""
    files, _ = make_decode_traces(n_ranks=8, n_steps=6, layers=2, graph="full")
    name, trace = files[3]
    write_trace(trace, tmp_path / name)
    out = tmp_path / "r"
    assert main(["profile", "analyze", str(tmp_path), "--out", str(out), "--batch", "64", "--no-png", "--jobs", "1"]) == 0
    data = json.loads((out / "breakdown.json").read_text())
    assert data["ceilings"] is None
    assert any("1 of the capture's 8 ranks" in n and "--layout" in n for n in data["notes"]), data["notes"]
    assert main(["profile", "analyze", str(tmp_path), "--out", str(out), "--batch", "64", "--no-png", "--jobs", "1",
                 "--layout", "tp8"]) == 0
    data = json.loads((out / "breakdown.json").read_text())
    assert data["ceilings"]["shape"]["tp"] == 8


def test_a_rank_file_without_distributed_info_gets_no_tp1_ceilings(tmp_path):
    """A trace with no distributedInfo (a process that never set up torch.distributed, or a tool that dropped the
    key) said nothing of its world size, and the ceilings were costed as TP1 without a word. A file name that says
    rank 3 means at least 4 ranks: no ceilings without --layout. Rank 0 alone may be TP1 or one of many: ceilings
    for the layout the files give, and a warning that it was inferred."""
    files, _ = make_decode_traces(n_ranks=8, n_steps=6, layers=2, graph="full")
    for r, sub in ((3, "r3"), (0, "r0")):
        name, trace = files[r]
        del trace["distributedInfo"]
        (tmp_path / sub).mkdir()
        write_trace(trace, tmp_path / sub / name)
    out = tmp_path / "out"
    assert main(["profile", "analyze", str(tmp_path / "r3"), "--out", str(out), "--batch", "64", "--no-png",
                 "--jobs", "1"]) == 0
    data = json.loads((out / "breakdown.json").read_text())
    assert data["ceilings"] is None
    assert any("rank 3" in n and "at least 4 ranks" in n and "--layout" in n for n in data["notes"]), data["notes"]
    assert main(["profile", "analyze", str(tmp_path / "r0"), "--out", str(out), "--batch", "64", "--no-png",
                 "--jobs", "1"]) == 0
    data = json.loads((out / "breakdown.json").read_text())
    assert data["ceilings"]["shape"]["tp"] == 1
    assert any("inferred" in n and "--layout" in n for n in data["notes"]), data["notes"]
    assert main(["profile", "analyze", str(tmp_path / "r3"), "--out", str(out), "--batch", "64", "--no-png",
                 "--jobs", "1", "--layout", "tp8"]) == 0
    data = json.loads((out / "breakdown.json").read_text())
    assert data["ceilings"]["shape"]["tp"] == 8 and not any("inferred" in n for n in data["notes"])


def test_a_measurement_faster_than_its_floor_is_flagged(tmp_path):
    """A category measured faster than the hardware allows for the modelled work means the shape is not the traced
    run's (batch, context or layout): said as a warning beside the table, not left as "% of BW 2931 %"."""
    from glm5_fp4.hardware import get_gpu
    from glm5_fp4.profiling.ceilings import StepShape, ceilings
    from glm5_fp4.spec import Glm5Spec

    shape = StepShape(batch=512, context=4096, tp=8, pp=1, tokens_per_seq=1, expert_dtype="nvfp4",
                      attention_dtype="bf16", kv_dtype="bf16", dp=1, ep=1, ep_comm="a2a", expert_skew=1.0,
                      dense_dtype=None)
    measured = {"expert_gemm": 1.0, "attention": 1.0, "allreduce": 1.0, "other_gemm": 1.0, "other": 1.0}
    res = ceilings(Glm5Spec(), shape, get_gpu("h200"), measured, measured, 5.0)
    assert any(w.startswith("expert_gemm:") and "below its floor" in w for w in res["warnings"]), res["warnings"]
    sane = {c: (v["floor_us"] or 0.0) * 2 + 1.0 for c, v in res["categories"].items()}
    assert ceilings(Glm5Spec(), shape, get_gpu("h200"), sane, sane, sum(sane.values()))["warnings"] == []


def test_ceilings_price_auto_kv_as_the_engine_does_on_the_gpu():
    """The ceilings' KV rows follow plan's rule for auto (launch.plan.auto_kv): BF16 on an H200, FP8 on an RTX PRO
    6000; they priced FP8 everywhere."""
    from glm5_fp4.hardware import get_gpu
    from glm5_fp4.profiling.ceilings import StepShape, step_work
    from glm5_fp4.spec import Glm5Spec

    def attention_bytes(gpu, kv):
        shape = StepShape(batch=64, context=4096, tp=8, pp=1, tokens_per_seq=1, expert_dtype="nvfp4",
                          attention_dtype="bf16", kv_dtype=kv, dp=1, ep=1, ep_comm="a2a", expert_skew=0.0,
                          dense_dtype=None)
        return step_work(Glm5Spec(), shape, get_gpu(gpu))["attention"].bytes

    assert attention_bytes("h200", "auto") == attention_bytes("h200", "bfloat16")
    assert attention_bytes("rtx-pro-6000-ws", "auto") == attention_bytes("rtx-pro-6000-ws", "fp8")
    assert attention_bytes("h200", "auto") > attention_bytes("h200", "fp8")


def test_a_slow_stop_profile_is_not_called_unreachable(tmp_path, monkeypatch):
    """A server still flushing its traces when --flush-timeout-s ran out was reported "not reachable (timed out)"."""
    import socket
    import urllib.request

    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.profiling import capture as C

    def slow(req, timeout):
        raise urllib.error.URLError(socket.timeout("timed out"))

    monkeypatch.setattr(urllib.request, "urlopen", slow)
    with pytest.raises(Glm5Fp4Error, match=r"no answer within 7 s .*--flush-timeout-s"):
        C._request("http://127.0.0.1:9/stop_profile", {}, timeout=7)
    with pytest.raises(Glm5Fp4Error, match="no answer within 3 s"):
        C._request("http://127.0.0.1:9/version", timeout=3)


def test_one_unknown_kernel_on_two_ranks_is_one_name(trace_dir, tmp_path, capsys):
    """The console summed each rank's list: the synthetic traces' one unknown kernel, on 2 ranks, was "2 names"."""
    assert main(["profile", "analyze", str(trace_dir), "--out", str(tmp_path / "r"), "--no-png", "--jobs", "1"]) == 0
    assert "1 unknown kernel name(s)" in capsys.readouterr().out


def _analyze_json(d, out, *extra):
    assert main(["profile", "analyze", str(d), "--out", str(out), "--no-png", "--jobs", "1", "--batch", "8", *extra]) == 0
    return json.loads((out / "breakdown.json").read_text()), (out / "breakdown.md").read_text()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_prefill_only_trace_is_called_so_and_gets_no_decode_ceilings(tmp_path, capsys, engine):
    """vLLM forwards named execute_context_4(2048)_generation_0(0) got decode ceilings and a note calling them mixed;
    an SGLang capture of EXTEND traces only was a "Decode-time breakdown" without a word."""
    if engine == "vllm":
        files, _ = make_decode_traces(n_ranks=1, n_steps=6, profiler_steps="gpu",
                                      step_name="execute_context_4(2048)_generation_0(0)")
    else:
        files, _ = make_decode_traces(n_ranks=2, n_steps=6, naming="sglang")
        files = [(name.replace("-DECODE", "-EXTEND"), trace) for name, trace in files]
    d = tmp_path / "traces"
    d.mkdir()
    for name, trace in files:
        write_trace(trace, d / name)
    data, md = _analyze_json(d, tmp_path / "out")
    assert md.startswith("# Prefill-only breakdown: NVIDIA H200")
    assert "Median prefill step per rank" in md and "decode step" not in md.split("## Notes")[0]
    assert data["prefill_only"] is True and data["ceilings"] is None
    said = [n for n in data["notes"] if n.startswith("no ceilings")]
    assert said and "prefill" in said[0] and "decode step" in said[0]
    notes = [n for r in data["ranks"] for n in r["notes"]]
    assert any(n.startswith("prefill only") for n in notes), notes
    assert not any("mixed" in n for n in notes)
    assert capsys.readouterr().out.startswith("Prefill-only breakdown")


def test_decode_traces_keep_their_title_and_ceilings(tmp_path):
    files, _ = make_decode_traces(n_ranks=1, n_steps=6, profiler_steps="gpu",
                                  step_name="execute_context_0(0)_generation_8(8)")
    d = tmp_path / "traces"
    d.mkdir()
    for name, trace in files:
        write_trace(trace, d / name)
    data, md = _analyze_json(d, tmp_path / "out")
    assert md.startswith("# Decode-time breakdown: NVIDIA H200") and "Median decode step per rank" in md
    assert data["prefill_only"] is False and data["ceilings"] is not None



# -- review of 2026-12-07 ----------------------------------------------------------------------------------------------
def test_capture_waits_for_every_rank_the_traces_declare(tmp_path):
    """Rank 1's trace written 5 s after rank 0's: the capture returned after 3 quiet seconds with one trace, exit 0,
    and the analysis read rank 0's all-reduce waits as work."""
    from glm5_fp4.profiling.capture import CaptureConfig, capture

    trace_dir = tmp_path / "server_traces"
    trace_dir.mkdir()
    with FakeServer(trace_dir, late_rank_s=5.0) as server:
        got = capture(CaptureConfig(server.url, 5, trace_dir, tmp_path / "cap", concurrency=2, flush_timeout_s=60),
                      log=lambda *a: None)
    assert len(got.files) == 2


def test_a_start_profile_left_unanswered_is_stopped(tmp_path, capsys):
    """/start_profile timing out left the server profiling (no /stop_profile sent): its profiler kept growing."""
    from glm5_fp4.errors import Glm5Fp4Error
    from glm5_fp4.profiling.capture import CaptureConfig, capture

    trace_dir = tmp_path / "server_traces"
    trace_dir.mkdir()
    with FakeServer(trace_dir, start_delay_s=4.0) as server:
        with pytest.raises(Glm5Fp4Error, match="start_profile"):
            capture(CaptureConfig(server.url, 5, trace_dir, tmp_path / "cap", concurrency=2, request_timeout_s=1.0),
                    log=lambda *a: None)
        calls = list(server.calls)
    assert "POST /stop_profile" in calls[calls.index("POST /start_profile"):]


def test_expert_parallel_layouts_on_a_gpu_without_network_figures_are_priced_without_them(trace_dir, tmp_path):
    """--layout dp8ep8agrs on an H200 trace: a TypeError from formatting the missing all-reduce figures."""
    out = tmp_path / "o"
    for layout in ("dp8ep8agrs", "dp8ep8"):
        assert main(["profile", "analyze", str(trace_dir), "--out", str(out), "--no-png", "--jobs", "1",
                     "--batch", "8", "--layout", layout]) == 0
        md = (out / "breakdown.md").read_text()
        assert "no latency/bus-bandwidth figures for this GPU" in md, md


def test_no_gap_as_long_as_asked_is_no_step(trace_dir, tmp_path, capsys):
    """--step-gap-us past every gap priced the whole multi-step trace as one decode step against a one-step floor."""
    out = tmp_path / "o"
    assert main(["profile", "analyze", str(trace_dir), "--out", str(out), "--no-png", "--jobs", "1", "--batch", "8",
                 "--step-gap-us", "1e9"]) == 0
    doc = json.loads((out / "breakdown.json").read_text())
    assert doc["ceilings"] is None or not doc["ceilings"].get("measured_step_us"), doc["ceilings"]
    assert "no idle gap >= 1e+09 us" in (out / "breakdown.md").read_text()


def test_a_rerun_into_the_same_out_leaves_no_earlier_plot(trace_dir, tmp_path):
    out = tmp_path / "o"
    assert main(["profile", "analyze", str(trace_dir), "--out", str(out), "--jobs", "1", "--batch", "8"]) == 0
    assert (out / "breakdown.png").exists() and (out / "roofline.png").exists()
    assert main(["profile", "analyze", str(trace_dir), "--out", str(out), "--jobs", "1", "--no-png"]) == 0
    assert not list(out.glob("*.png")) and not (out / "PLOTS_SKIPPED.txt").exists()


@pytest.mark.parametrize("argv,said", [(["--layout", "tp9x"], "tp9x"), (["--step-annotation", "("], "--step-annotation"),
                                       (["--gpu", "nosuchgpu"], "nosuchgpu"),
                                       (["--layout", "dp8ep8", "--expert-skew", "20"], "expert skew 20"),
                                       (["--kv-dtype", "fp9"], "fp9")])
def test_capture_analyze_options_are_checked_before_any_load(tmp_path, capsys, argv, said):
    """A bad --layout / --step-annotation / --gpu failed after minutes of load, profiling and flushing."""
    trace_dir = tmp_path / "server_traces"
    trace_dir.mkdir()
    with FakeServer(trace_dir) as server:
        rc = main(["profile", "capture", "--url", server.url, "--steps", "5", "--trace-dir", str(trace_dir),
                   "--concurrency", "2", "--out", str(tmp_path / "cap"), "--analyze", "--batch", "8", *argv])
        calls = list(server.calls)
    assert rc == 1 and said in capsys.readouterr().err and calls == []


def test_capture_into_the_servers_own_folder_holding_earlier_traces_is_refused(tmp_path, capsys):
    """--out X with X/traces the server's folder: the analysis read every earlier capture's traces as well."""
    out = tmp_path / "cap"
    (out / "traces").mkdir(parents=True)
    (out / "traces" / "old.pt.trace.json.gz").write_bytes(b"an earlier capture")
    with FakeServer(out / "traces") as server:
        rc = main(["profile", "capture", "--url", server.url, "--steps", "5", "--trace-dir", str(out / "traces"),
                   "--concurrency", "2", "--out", str(out), "--analyze"])
        calls = list(server.calls)
    assert rc == 1 and "earlier capture" in capsys.readouterr().err and not any("completions" in c for c in calls)


def test_ranks_on_different_gpus_need_gpu_named(tmp_path, capsys):
    d = tmp_path / "t"
    d.mkdir()
    files, _ = make_decode_traces(n_ranks=2, n_steps=6, layers=3)
    for i, (name, trace) in enumerate(files):
        if i:
            trace["deviceProperties"][0]["name"] = "NVIDIA H100 80GB HBM3"
        write_trace(trace, d / name)
    assert main(["profile", "analyze", str(d), "--out", str(tmp_path / "o"), "--no-png", "--jobs", "1",
                 "--batch", "8"]) == 1
    err = capsys.readouterr().err
    assert "NVIDIA H100 80GB HBM3" in err and "NVIDIA H200" in err and "--gpu" in err
    assert main(["profile", "analyze", str(d), "--out", str(tmp_path / "o"), "--no-png", "--jobs", "1",
                 "--batch", "8", "--gpu", "h200"]) == 0


def test_a_layout_or_skew_the_traces_contradict_is_said(trace_dir, tmp_path):
    out = tmp_path / "o"
    assert main(["profile", "analyze", str(trace_dir), "--out", str(out), "--no-png", "--jobs", "1", "--batch", "8",
                 "--layout", "tp8", "--expert-skew", "2"]) == 0
    notes = "\n".join(json.loads((out / "breakdown.json").read_text())["notes"])
    assert "--layout tp8 has 8 GPUs" in notes and "world_size 2" in notes
    assert "--expert-skew 2 changes nothing" in notes


def test_a_kernel_longer_than_an_hour_is_a_corrupt_trace(tmp_path, capsys):
    d = tmp_path / "t"
    d.mkdir()
    files, _ = make_decode_traces(n_ranks=1, n_steps=4, layers=2)
    (name, trace), = files
    next(e for e in trace["traceEvents"] if e.get("cat") == "kernel")["dur"] = 1e12
    write_trace(trace, d / name)
    assert main(["profile", "analyze", str(d), "--out", str(tmp_path / "o"), "--no-png", "--jobs", "1"]) == 1
    assert "dur 1000000000000.0" in capsys.readouterr().err


def test_a_category_with_a_floor_but_no_kernel_is_flagged():
    """Every kernel unknown to the taxonomy: expert GEMM, attention and other GEMM 'measured 0.0 ... n/a' against
    a 19 ms floor, with no warning (the floor-over-measured ratio of 0 us is None)."""
    from glm5_fp4.hardware import get_gpu
    from glm5_fp4.profiling.ceilings import StepShape, ceilings
    from glm5_fp4.spec import Glm5Spec

    shape = StepShape(batch=512, context=4096, tp=8, pp=1, tokens_per_seq=1, expert_dtype="nvfp4",
                      attention_dtype="bf16", kv_dtype="bf16", dp=1, ep=1, ep_comm="a2a", expert_skew=0.0,
                      dense_dtype=None)
    none = {"expert_gemm": 0.0, "attention": 0.0, "allreduce": 0.0, "other_gemm": 0.0, "other": 5000.0}
    res = ceilings(Glm5Spec(), shape, get_gpu("h200"), none, none, 5000.0)
    flagged = [w for w in res["warnings"] if "no kernel of this category" in w]
    assert {w.split(":")[0] for w in flagged} >= {"expert_gemm", "attention", "other_gemm"}, res["warnings"]
