"""The host sampler (glm5_fp4.profiling.host_sampler) and `profile stalls` (glm5_fp4.profiling.stalls): a busy
function, a garbage collection, a GIL-holding C call and a sleep are each seen for what they are; stall windows
come from load-test request records and name what each process's main thread did in them; bad files get one
error naming file and line."""

from __future__ import annotations

import gc
import gzip
import json
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest

from glm5_fp4.cli import main as cli_main
from glm5_fp4.errors import Glm5Fp4Error
from glm5_fp4.profiling import host_sampler as H
from glm5_fp4.profiling import stalls as S


def _spin_in_here(seconds: float) -> int:
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def _sleep_in_here(seconds: float) -> None:
    time.sleep(seconds)


def _hold_the_gil(n: int) -> float:
    values = [random.random() for _ in range(n)]
    t = time.perf_counter()
    values.sort()  # one C call that never releases the GIL
    return time.perf_counter() - t


@pytest.fixture()
def sampled(tmp_path):
    """A real sampler over: spin 0.3 s, a full collection, a GIL-holding sort, sleep 0.3 s (unix marks kept)."""
    sampler = H.HostSampler(tmp_path, 2.0)
    sampler.start()
    marks = {}
    try:
        # no automatic collection inside the spin: late in the full suite the heap is large, and a generation-2
        # collection started by the spin's allocations ran weakref callbacks for 634 of its 300 ms
        gc.disable()
        try:
            marks["spin"] = (time.time(), None)
            _spin_in_here(0.3)
            marks["spin"] = (marks["spin"][0], time.time())
        finally:
            gc.enable()
        gc.collect()
        marks["sort_s"] = _hold_the_gil(700_000)
        t = time.time()
        _sleep_in_here(0.3)
        marks["sleep"] = (t, time.time())
    finally:
        sampler.stop()
    return tmp_path, sampler, marks


def test_the_sampler_sees_busy_code_collections_gil_gaps_and_cpu(sampled):
    folder, sampler, marks = sampled
    (proc,) = S.load(folder)
    assert proc.pid == os.getpid() and proc.complete and not proc.notes
    summary = S.process_summary(proc)
    spin = [r for r in summary["main_top_busy"] if "_spin_in_here" in r["stack"]]
    # A sample stands for the time since the one before; a sampler kept off the CPU (a loaded 2-core CI box:
    # 154 ms of a 300 ms spin were seen, the rest landed on the next stack) sees less, never more than the spin
    # plus the longest wait before a sample.
    spin_ms = (marks["spin"][1] - marks["spin"][0]) * 1e3
    longest = max([d for _, d in proc.gaps] + [0.0]) + 2 * sampler.interval * 1e3
    assert spin and 0.25 * spin_ms <= spin[0]["ms"] <= spin_ms + longest, (spin_ms, longest, summary["main_top_busy"])
    assert any(g == 2 for _, _, g, _ in proc.gcs)  # gc.collect() is a generation-2 collection
    if marks["sort_s"] > 0.1:  # the sort held the GIL past the gap threshold: no sample could be taken meanwhile
        assert max(d for _, d in proc.gaps) >= 0.5 * marks["sort_s"] * 1e3
    spin_cpu = S.cpu_share(proc, proc.main_tid, *marks["spin"])
    sleep_cpu = S.cpu_share(proc, proc.main_tid, *marks["sleep"])
    assert spin_cpu is not None and sleep_cpu is not None
    assert spin_cpu > sleep_cpu + 0.3, (spin_cpu, sleep_cpu)  # the Python stack alone cannot tell a sleep


def _cpu_process(readings):
    """A process whose main thread (tid 1) has the CPU readings ``[(seconds, cpu seconds so far)]``."""
    proc = S.Process(Path("x"), 1, "x", [], 1000.0, 20.0, 1)
    proc.cpu = [(t * 1e3, {1: int(round(c * 1e9))}) for t, c in readings]
    return proc


def test_a_windows_cpu_share_comes_from_the_readings_inside_it():
    # Busy 0.2 s with no reading (a C call held the GIL), then idle through the window [1000.2, 1000.5]: the
    # readings around the window would charge it the busy time before it (0.2 / 0.55 = 0.36); those inside say 0.
    proc = _cpu_process([(0.0, 0.0), (0.25, 0.2), (0.35, 0.2), (0.45, 0.2), (0.55, 0.2)])
    assert S.cpu_share(proc, 1, 1000.2, 1000.5) == pytest.approx(0.0, abs=1e-9)
    # The whole run, and a window with no reading inside it, still get the bracketing readings.
    assert S.cpu_share(proc, 1) == pytest.approx(0.2 / 0.55)
    assert S.cpu_share(proc, 1, 1000.26, 1000.34) == pytest.approx(0.0, abs=1e-9)
    assert S.cpu_share(proc, 1, 1000.05, 1000.2) == pytest.approx(0.2 / 0.25)
    busy = _cpu_process([(0.0, 0.0), (0.1, 0.1), (0.2, 0.2), (0.3, 0.3), (0.4, 0.3)])
    assert S.cpu_share(busy, 1, 1000.05, 1000.32) == pytest.approx(1.0)


def test_stopping_twice_writes_one_final_record(sampled):
    folder, sampler, _ = sampled
    sampler.stop()
    kinds = [json.loads(line)["kind"] for line in sampler.path.read_text().splitlines()]
    assert kinds.count("end") == 1 and kinds[0] == "process"


def test_start_from_env_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(H.ENV, raising=False)
    assert H.start_from_env() is None


def test_a_forked_child_samples_into_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setattr(H, "_SAMPLER", None)
    parent = H.start(tmp_path, 2.0)
    try:
        pid = os.fork()
        if pid == 0:  # child: its own sampler, its own file; never return into pytest
            ok = H._SAMPLER is not None and H._SAMPLER.pid == os.getpid() and H._SAMPLER is not parent
            _spin_in_here(0.05)
            if ok:
                H._SAMPLER.stop()
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        parent.stop()
        monkeypatch.setattr(H, "_SAMPLER", None)
    names = sorted(p.name.split("-")[1] for p in tmp_path.glob("host-*.jsonl"))  # host-<pid>-<start ms>.jsonl
    assert names == sorted([str(os.getpid()), str(pid)])
    (child_file,) = tmp_path.glob(f"host-{pid}-*.jsonl")
    child = S.load_process(child_file)
    assert child.complete and child.runs


# ---- synthetic files: stall windows and their attribution --------------------------------------------------------
T0 = 1_700_000_000.0
COMPILE = [["/x/triton/compiler.py", "compile", 300], ["/x/glm5_fp4/kernels/moe.py", "fused_moe", 260]]
STEP = [["/x/vllm/v1/engine/core.py", "step", 220]]
WAIT = [["/usr/lib/python3.12/threading.py", "wait", 331], ["/x/vllm/v1/engine/core.py", "run_busy_loop", 700]]


def _host_file(folder: Path, pid=4242, runs=None, cpu=None, gcs=None, end=True) -> Path:
    recs = [
        {"kind": "process", "pid": pid, "ppid": 1, "comm": "VLLM::EngineCore", "argv": ["x"], "main_tid": 1,
         "t0_unix": T0, "interval_ms": 5.0, "late_ms": 50.0},
        {"kind": "threads", "threads": {"1": "MainThread", "2": "worker"}},
        {"kind": "stacks", "stacks": {"0": STEP, "1": COMPILE, "2": WAIT}},
        # main: stepping 0-1 s, compiling 1-2.5 s, stepping 2.5-4 s; thread 2 waits throughout
        {"kind": "runs", "runs": runs or [[1, 0, 0, 1000, 200, 1000], [1, 1, 1005, 2500, 300, 1500],
                                          [1, 0, 2505, 4000, 300, 1500], [2, 2, 0, 4000, 800, 4000]]},
        {"kind": "cpu", "cpu": cpu or [[0, {"1": 0}], [1000, {"1": 9 * 10**8}], [2500, {"1": 24 * 10**8}],
                                       [4000, {"1": 39 * 10**8}]]},
        {"kind": "gc", "gc": gcs or [[1100, 40.0, 2, 10]]},
        {"kind": "moe_calls", "calls": {"8192": 3}},
    ]
    if end:
        recs.append({"kind": "end", "t_ms": 4000, "samples": 800})
    path = folder / f"host-{pid}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _requests(path: Path, starts_and_tokens) -> Path:
    rows = []
    for i, (start, tokens) in enumerate(starts_and_tokens):
        ttft = (tokens[0] - start) * 1e3
        itl = [(b - a) * 1e3 for a, b in zip(tokens, tokens[1:])]
        rows.append({"index": i, "status": "ok", "start_unix": T0 + start, "ttft_ms": ttft, "itl_ms": itl,
                     "e2el_ms": (tokens[-1] - start) * 1e3})
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def test_a_delivery_gap_is_a_stall_and_names_the_main_threads_work(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.mkdir()
    _host_file(hosts)
    # two streams: tokens every 50 ms, except nothing between 1.0 and 2.5 s
    ticks = [0.1 + 0.05 * i for i in range(19)] + [2.5 + 0.05 * i for i in range(20)]
    req = _requests(tmp_path / "c2.requests.jsonl.gz", [(0.0, ticks), (0.02, [t + 0.01 for t in ticks])])
    result = S.analyze(hosts, [req], min_gap_ms=300)
    (rf,) = result["request_files"]
    assert rf["stalls"] == 1
    (w,) = rf["windows"]
    assert w["in_flight"] == 2 and 1450 <= w["ms"] <= 1500 and abs(w["start_s"] - 1.01) < 0.02
    (p,) = w["processes"]
    assert "compile (x/triton/compiler.py:300)" in p["top"][0]["stack"] and p["top"][0]["share"] > 0.9
    assert abs(p["main_cpu"] - 1.0) < 0.01 and abs(p["gc_ms"] - 40.0) < 1e-3  # unix-time float rounding
    md = S.markdown(result)
    assert "1 window(s)" in md and "compile" in md and "8192: 3" in md


def test_waiting_threads_are_not_busy(tmp_path):
    (proc,) = S.load(_host_file(tmp_path).parent)
    summary = S.process_summary(proc)
    assert summary["threads"][2]["busy"] == 0.0 and summary["threads"][1]["busy"] == 1.0
    assert S.is_waiting([tuple(f) for f in WAIT]) and not S.is_waiting([tuple(f) for f in STEP])


def test_no_stall_when_tokens_keep_coming_or_nothing_is_in_flight(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.mkdir()
    _host_file(hosts)
    steady = [0.1 + 0.05 * i for i in range(60)]
    # a second request that starts after a 2 s idle period: nothing was in flight in the idle period
    req = _requests(tmp_path / "r.requests.jsonl.gz", [(0.0, steady[:20]), (3.0, [3.05 + 0.05 * i for i in range(10)])])
    (rf,) = S.analyze(hosts, [req])["request_files"]
    assert rf["stalls"] == 0


def test_a_truncated_last_line_is_kept_with_a_note_and_bad_lines_are_named(tmp_path):
    path = _host_file(tmp_path, end=False)
    with path.open("a") as f:
        f.write('{"kind": "runs", "ru')
    proc = S.load_process(path)
    assert proc.runs and any("truncated" in n for n in proc.notes) and any("did not exit" in n for n in proc.notes)
    lines = path.read_text().splitlines()
    lines[2] = "not json"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(Glm5Fp4Error, match=rf"{path.name}:3: not a JSON line"):
        S.load_process(path)


def test_bad_inputs_get_one_clear_error(tmp_path):
    with pytest.raises(Glm5Fp4Error, match="does not exist"):
        S.load(tmp_path / "nope")
    with pytest.raises(Glm5Fp4Error, match="holds no host-"):
        S.load(tmp_path)
    path = _host_file(tmp_path, runs=[[1, 9, 0, 10, 2, 10]])
    with pytest.raises(Glm5Fp4Error, match="never defined"):
        S.load_process(path)
    bad = tmp_path / "bad.requests.jsonl"
    bad.write_text('{"status": "ok", "ttft_ms": 3}\n')
    with pytest.raises(Glm5Fp4Error, match=r"bad.requests.jsonl:1: not a load-test request record"):
        S.load_requests(bad)


def test_cli_writes_the_report(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.mkdir()
    _host_file(hosts)
    ticks = [0.1 + 0.05 * i for i in range(19)] + [2.5 + 0.05 * i for i in range(20)]
    req = _requests(tmp_path / "c1.requests.jsonl.gz", [(0.0, ticks)])
    assert cli_main(["profile", "stalls", str(hosts), "--requests", str(req), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "1 stall(s)" in out and (tmp_path / "rep" / "stalls.md").is_file()
    assert json.loads((tmp_path / "rep" / "stalls.json").read_text())["request_files"][0]["stalls"] == 1
    assert cli_main(["profile", "stalls", str(tmp_path / "missing")]) != 0


def test_an_odd_frame_chain_ends_the_stack_instead_of_the_sampler():
    class Frame:  # what vLLM's worker under torch.compile handed back once: a chain ending in a code object
        f_code = _spin_in_here.__code__
        f_lineno = 3
        f_back = _spin_in_here.__code__

    stack = H._stack(Frame())
    assert stack[0][1] == "_spin_in_here" and stack[-1] == ("<unknown>", "code", 0)


# ---- bad inputs: one clear error (or what was read, with a note), never numbers from impossible data -------------
STEADY = [0.1 + 0.05 * i for i in range(19)] + [2.5 + 0.05 * i for i in range(20)]


@pytest.mark.parametrize("gap", ["nan", "0", "-5", "inf"])
def test_min_gap_must_be_a_positive_number(tmp_path, capsys, gap):
    with pytest.raises(SystemExit) as exc:
        cli_main(["profile", "stalls", str(tmp_path), "--min-gap-ms", gap])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert not out and "--min-gap-ms" in err and "Traceback" not in err


@pytest.mark.parametrize("field,value", [("itl_ms", [50.0, float("nan"), 50.0]), ("ttft_ms", float("inf")),
                                         ("start_unix", float("nan")), ("e2el_ms", float("nan")),
                                         ("itl_ms", [50.0, -20.0, 50.0])])
def test_non_finite_request_times_are_refused_naming_file_and_line(tmp_path, field, value):
    good = {"status": "ok", "start_unix": T0, "ttft_ms": 100.0, "itl_ms": [50.0, 50.0, 50.0], "e2el_ms": 250.0}
    path = tmp_path / "r.requests.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, field: value}) + "\n")
    with pytest.raises(Glm5Fp4Error, match=rf"r.requests.jsonl:2: .*{field}"):
        S.load_requests(path)


def test_requests_outside_every_sampled_process_are_refused(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.mkdir()
    _host_file(hosts)  # sampled T0 .. T0 + 4 s
    late = _requests(tmp_path / "late.requests.jsonl.gz", [(3600.0, [3600.1 + t for t in STEADY])])
    with pytest.raises(Glm5Fp4Error, match="late.requests.jsonl.gz.*outside"):
        S.analyze(hosts, [late])
    assert cli_main(["profile", "stalls", str(hosts), "--requests", str(late), "--out", str(tmp_path / "rep")]) == 1
    assert "outside" in capsys.readouterr().err and not (tmp_path / "rep").exists()


@pytest.mark.parametrize("copy_name", ["host-4242.jsonl.gz", "host-4243.jsonl"])
def test_one_process_saved_twice_is_one_error_naming_both_files(tmp_path, copy_name):
    path = _host_file(tmp_path)
    data = path.read_bytes()
    if copy_name.endswith(".gz"):
        with gzip.open(tmp_path / copy_name, "wb") as f:
            f.write(data)
    else:
        (tmp_path / copy_name).write_bytes(data)
    with pytest.raises(Glm5Fp4Error, match=rf"{path.name}.*{copy_name}|{copy_name}.*{path.name}"):
        S.load(tmp_path)


def test_a_truncated_gzip_host_file_keeps_what_was_read_with_a_note(tmp_path):
    rng = random.Random(0)
    cpu = [[i * 5, {"1": i * 10**6 + rng.randrange(10**6)}] for i in range(20_000)]  # incompressible enough
    path = _host_file(tmp_path, cpu=cpu, end=False)
    gz = tmp_path / "host-4242.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write(path.read_bytes())
    path.unlink()
    data = gz.read_bytes()
    gz.write_bytes(data[: len(data) * 2 // 3])
    (proc,) = S.load(tmp_path)
    assert proc.pid == 4242 and proc.stacks and any("truncated" in n for n in proc.notes)


def test_a_corrupt_gzip_requests_file_is_one_error(tmp_path):
    req = _requests(tmp_path / "r.requests.jsonl.gz", [(0.0, STEADY)] * 200)
    data = req.read_bytes()
    req.write_bytes(data[: len(data) // 2])
    with pytest.raises(Glm5Fp4Error, match="r.requests.jsonl.gz"):
        S.load_requests(req)


def test_a_directory_named_like_a_host_file_is_one_error(tmp_path):
    _host_file(tmp_path)
    (tmp_path / "host-1.jsonl").mkdir()
    with pytest.raises(Glm5Fp4Error, match="host-1.jsonl.*directory"):
        S.load(tmp_path)


@pytest.mark.parametrize("line,field,value,culprit", [
    (1, "stacks", "x", "malformed 'stacks' record (AttributeError"),
    (1, "threads", [1], "malformed 'threads' record (AttributeError"),
    (0, "pid", "x", "malformed 'process' record (invalid literal"),
    (0, "t0_unix", float("nan"), "malformed 'process' record (t0_unix nan"),
    (0, "interval_ms", -2, "interval_ms -2 (a finite time and a positive interval)"),
    (3, "runs", [[1, 0, 100, 50, 3, 10]], "ends before it starts"),
])
def test_malformed_records_are_one_error_naming_file_and_line(tmp_path, line, field, value, culprit):
    """Before: AttributeError tracebacks (stacks / threads not objects), or a report 'sampled every -2 ms' with
    'CPU nan %' and runs of -0.8 s, exit 0."""
    path = _host_file(tmp_path)
    recs = [json.loads(r) for r in path.read_text().splitlines()]
    if line == 1 and field == "threads":
        recs[1]["threads"] = value
    elif field == "stacks":
        recs[2]["stacks"] = value
    else:
        recs[line][field] = value
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(Glm5Fp4Error, match=re.escape(f"{path}:") + r"\d+: .*" + re.escape(culprit)):
        S.load_process(path)


def test_a_path_that_is_a_file_and_requests_that_are_a_folder_are_named(tmp_path, capsys):
    """Before: a host file given as PATH was blamed on --out (PATH/stalls), a folder of requests 'did not exist'."""
    from glm5_fp4.cli import main

    host = _host_file(tmp_path)
    assert main(["profile", "stalls", str(host)]) == 1
    assert f"{host} is a file; PATH is the folder of host-<pid>.jsonl files" in capsys.readouterr().err
    assert main(["profile", "stalls", str(tmp_path), "--requests", str(tmp_path)]) == 1
    assert f"request records {tmp_path} is a directory" in capsys.readouterr().err


def _hung_in_here(seconds):
    time.sleep(seconds)


def test_a_call_still_hanging_at_a_flush_is_on_disk(tmp_path):
    """The sampler wrote a thread's run only when its stack changed or at exit: a call that hung and was then killed
    (the case this tool exists for) left no trace, though flushes ran during it. Each flush now writes the open
    runs as they stand."""
    sampler = H.HostSampler(tmp_path, 5.0)
    hang = threading.Thread(target=_hung_in_here, args=(0.4,), name="hung")
    hang.start()
    try:
        for _ in range(20):
            sampler.sample_once()
            time.sleep(0.005)
        sampler.flush()  # no final flush: the process is killed here
    finally:
        hang.join()
    (proc,) = S.load(tmp_path)
    tid = hang.native_id  # the file keys threads by the kernel thread id
    stacks = [proc.stacks[sid] for _, sid, *_ in proc.thread_runs(tid)]
    assert any(any(f[1] == "_hung_in_here" for f in st) for st in stacks), stacks
    assert sum(r[4] for r in proc.thread_runs(tid)) >= 15


def test_two_samplers_of_one_pid_write_two_files(tmp_path):
    """A reused pid (containers give the engine the same one) appended a second run to the first's host-<pid>
    file, with no header and stack ids from 0 again, relabelling the first run's stacks."""
    for work in (_spin_in_here, _sleep_in_here):
        s = H.HostSampler(tmp_path, 5.0)
        s.start()
        work(0.1)
        s.stop()
        time.sleep(0.01)
    procs = S.load(tmp_path)
    assert len(procs) == 2 and all(p.complete for p in procs)
    names = [{f[1] for sid in p.stacks for f in p.stacks[sid]} for p in sorted(procs, key=lambda p: p.t0_unix)]
    assert "_spin_in_here" in names[0] and "_sleep_in_here" not in names[0]
    assert "_sleep_in_here" in names[1]


def test_records_after_the_end_record_are_refused(tmp_path):
    s = H.HostSampler(tmp_path, 5.0)
    s.sample_once()
    s.flush(final=True)
    (path,) = tmp_path.glob("host-*.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"kind": "runs", "runs": [[1, 0, 0.0, 1.0, 1, 5.0]]}) + "\n")
    with pytest.raises(Glm5Fp4Error, match=r"after its 'end' record"):
        S.load(tmp_path)


def test_a_window_the_samples_barely_cover_is_not_reported_as_certain(tmp_path):
    """Host samples cover T0 .. T0+4 s. A 2 s stall from 3.5 s (a quarter sampled) printed "main thread busy
    100 %, CPU 100 %" (the CPU from readings before the window), and a stall after sampling ended printed its
    heading and nothing. Each window now says how much of it was sampled; shares are n/a where under half was,
    and a window no process covers says so."""
    hosts = tmp_path / "hosts"
    hosts.mkdir()
    _host_file(hosts)

    def tok(a, b):
        return [a + 0.05 * i for i in range(int((b - a) / 0.05))]

    reqs = _requests(tmp_path / "r.requests.jsonl.gz", [(0.0, tok(0.1, 3.5) + tok(5.5, 6.5) + tok(9.0, 9.5))])
    res = S.analyze(hosts, [reqs], min_gap_ms=1000)
    wins = sorted(res["request_files"][0]["windows"], key=lambda w: w["start_s"])
    partly, after = wins
    (p,) = partly["processes"]
    assert p["sampled_share"] == pytest.approx(0.5 / 2.0, abs=0.05)
    assert p["main_busy_share"] is None and p["main_cpu"] is None
    assert after["processes"] == []
    md = S.markdown(res)
    assert re.search(r"sampled 2[0-9] % of the window", md) and "busy n/a" in md, md
    assert "no process was sampled in this window" in md


def test_only_the_longest_windows_are_listed_and_the_report_says_so(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.mkdir()
    _host_file(hosts)
    tokens = [0.1 + 0.15 * i for i in range(25)]  # 24 gaps of 150 ms inside the sampled 4 s
    res = S.analyze(hosts, [_requests(tmp_path / "r.requests.jsonl.gz", [(0.0, tokens)])], min_gap_ms=100)
    rf = res["request_files"][0]
    assert rf["stalls"] == 24 and len(rf["windows"]) == S.MAX_WINDOWS
    assert f"the longest {S.MAX_WINDOWS} are listed" in S.markdown(res)


@pytest.mark.parametrize("damage", ["frame", "argv"])
def test_malformed_stacks_and_argv_are_one_error_naming_the_file(tmp_path, damage):
    """A frame without its line number crashed in is_waiting (ValueError), an argv entry that is not a string in
    markdown (TypeError) after stalls.json had been written."""
    path = _host_file(tmp_path)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for r in recs:
        if damage == "frame" and r["kind"] == "stacks":
            r["stacks"]["0"] = [["/x/core.py", "step"]]
        if damage == "argv" and r["kind"] == "process":
            r["argv"] = ["python", 3]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(Glm5Fp4Error, match=path.name):
        S.load(tmp_path)


@pytest.mark.parametrize("step_s", [-1.0, 600.0])
def test_a_wall_clock_step_does_not_break_the_samples(tmp_path, monkeypatch, step_s):
    """The sampler timed samples with time.time(): an NTP or VM clock step of -1 s made the whole file 'malformed'
    (runs ending before they start), +600 s invented a 600 s gap with no Python running. It now times on the
    monotonic clock, the wall clock read once for the file's t0."""
    s = H.HostSampler(tmp_path, 5.0)
    real = time.time
    other = threading.Thread(target=_hung_in_here, args=(0.3,))  # a thread to sample (the caller's own is skipped)
    other.start()
    for i in range(10):
        if i == 5:
            monkeypatch.setattr(H.time, "time", lambda: real() + step_s)
        s.sample_once()
        time.sleep(0.005)
    s.flush(final=True)
    monkeypatch.setattr(H.time, "time", real)
    other.join()
    (proc,) = S.load(tmp_path)
    assert proc.runs and all(r[3] >= r[2] and r[5] >= 0 for r in proc.runs)
    assert not proc.gaps and proc.end_ms < 5_000


def test_two_threads_that_reuse_one_python_ident_stay_two_threads(tmp_path, monkeypatch):
    """glibc hands a finished thread's stack (and so its Python ident) to the next one: keyed by ident, a pool
    worker that spun and the one after it that slept were one thread, with one name and one CPU curve that fell
    back to 0 (its share could come out negative). Keyed by the kernel's thread id they stay apart. The test
    drives the samples itself (a CPU reading each), so a loaded machine cannot starve the sampler of readings."""
    monkeypatch.setattr(H, "CPU_EVERY_MS", 0.0)
    sampler = H.HostSampler(tmp_path, 2.0)

    def watch(done: threading.Event) -> None:
        for _ in range(30):
            sampler.sample_once()
            time.sleep(0.01)
        done.set()

    def spin_until(done: threading.Event) -> None:
        while not done.is_set():
            pass

    spun = threading.Event()
    spinner = threading.Thread(target=spin_until, args=(spun,), name="spinner")
    spinner.start()
    watch(spun)
    spinner.join()
    # the next thread usually gets the spinner's ident; start short-lived probes until one does, and only that
    # one stays (asleep) while the samples are taken
    for _ in range(100):
        go, told, slept = [False], threading.Event(), threading.Event()
        probe = threading.Thread(target=lambda: told.wait() and go[0] and slept.wait(), name="probe")
        probe.start()
        if probe.ident == spinner.ident:
            probe.name, go[0] = "sleeper", True
        told.set()
        if go[0]:
            watch(slept)
        probe.join()
        if go[0]:
            break
    sampler.flush(final=True)
    assert go[0], "no thread reused the spinner's ident"  # what makes the case
    (proc,) = S.load(tmp_path)
    by_name = {t["name"]: t for t in S.process_summary(proc)["threads"].values()}
    assert {"spinner", "sleeper"} <= set(by_name), by_name
    spin, sleep = by_name["spinner"]["cpu"], by_name["sleeper"]["cpu"]
    assert spin is not None and sleep is not None and spin > 2 * sleep + 0.05 and sleep >= 0, (spin, sleep)


def test_a_busy_main_thread_among_many_threads_is_still_sampled(tmp_path):
    """The CPU readings read /proc once per thread; each read gives the GIL up and, behind a main thread running
    Python, waits a switch interval (5 ms) to get it back: with 60 idle threads (an engine has dozens) a 300 ms busy
    stretch got 1 sample instead of ~60, so the sampler was blind where it exists to look (and the full test suite,
    its threads left alive, failed the sampler's own test)."""
    done = threading.Event()
    idle = [threading.Thread(target=done.wait, daemon=True) for _ in range(60)]
    for t in idle:
        t.start()
    sampler = H.HostSampler(tmp_path, 2.0)
    sampler.start()
    try:
        _spin_in_here(0.3)
    finally:
        sampler.stop()
        done.set()
    assert sampler.samples >= 10, sampler.samples
