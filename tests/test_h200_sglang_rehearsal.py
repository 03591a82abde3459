"""The SGLang H200 scripts rehearsed on CPU: every phase against fake SGLang servers (benchmarks/h200/fake_sglang.py).

SGLang cannot serve on a CPU, so what is rehearsed is the orchestration: routed-only checkpoints, servers started in
stages (the stock one after the JIT pre-warm's status says done) and stopped, the SGLang client calls (``/generate`` greedy and teacher-forced logprobs, the OpenAI stream the load
tester uses, ``/start_profile``), the verdicts and their failure paths (a server that does not start, one that
computes far off, the GLM-5 DSA servers failing and the dense view taking over), the sweep, ``compare``,
``profile capture --analyze``, the result bundle. The real commands are recorded beside each fake and parsed by
SGLang 0.5.15's own ServerArgs in tests/sglang/test_sglang_versions.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "benchmarks" / "h200_sglang"


def _start(script: str, tmp: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "GLM5_FP4_TRACE_ROOT": str(tmp / "traces"), **(env or {})}
    return subprocess.Popen([sys.executable, str(SCRIPTS / script), "--out", str(tmp / "out"), "--fake-servers",
                             "--start-timeout-s", "60", *args], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def rehearsals(tmp_path_factory):
    """Three rehearsals at once (two cores): tiny as planned, tiny with failures injected, true dimensions."""
    base = tmp_path_factory.mktemp("rehearsal")
    ckpts = base / "ckpt"
    done = base / "prewarm-done.json"  # a finished pre-warm, as prewarm_jit.py writes it
    done.write_text(json.dumps({"state": "done", "pid": 1, "modules": {"moe_wna16_marlin": {"ok": True, "s": 1.0}}}))
    # Deadlines far above a rehearsal's own time (15 s alone): the runs budget each stage with the H200's
    # estimates (the dense-view wave needs ~150 s), and three at once on a loaded 2-core CI machine took 172 s to
    # reach that wave, which a 300 s deadline then skipped.
    runs = {
        "tiny": _start("run_tiny.py", base / "tiny", "--ckpt-root", str(ckpts / "a"), "--deadline-s", "900",
                       env={"GLM5_FP4_PREWARM_STATUS": str(done)}),
        "tiny_failing": _start("run_tiny.py", base / "failing", "--ckpt-root", str(ckpts / "b"), "--deadline-s", "900",
                               env={"GLM5_FP4_FAKE_SGLANG_FAIL": "^glm5-", "GLM5_FP4_FAKE_SGLANG_OFF": "^glm4moe-ours$"}),
        "true": _start("run_true_dims.py", base / "true", "--ckpt", str(ckpts / "glm5-true"), "--deadline-s", "900",
                       "--levels", "4", "--capture-concurrency", "4", "--input-len", "16", "--output-len", "8",
                       "--start-together", "1", env={"GLM5_FP4_PREWARM_STATUS": str(base / "none.json")}),
    }
    out = {}
    for name, proc in runs.items():
        log, _ = proc.communicate(timeout=1200)
        folder = base / {"tiny": "tiny", "tiny_failing": "failing", "true": "true"}[name] / "out"
        run = "h200_sglang_true_dims" if name == "true" else "h200_sglang_tiny"
        out[name] = {"rc": proc.returncode, "log": log, "out": folder, "run": run,
                     "summary": json.loads((folder / f"{run}_summary.json").read_text())}
    return out


def test_tiny_rehearsal_compares_every_path_and_passes(rehearsals):
    r = rehearsals["tiny"]
    assert r["rc"] == 0, r["log"][-3000:]
    s = r["summary"]
    assert s["engine"] == "sglang" and s["fake_servers"] and s["problems"] == []
    assert set(s["archs"]) == {"glm5", "glm4moe"}  # real DSA planned first; no fallback needed
    for arch, report in s["archs"].items():
        assert report["verdict"]["ok"]
        assert set(report["checks"]) == {"marlin_vs_bf16 (yardstick)", "bf16_graphs_vs_eager (yardstick)",
                                         "ours_eager_vs_bf16", "ours_graphs_vs_bf16_graphs", "ours_graphs_vs_eager"}
        assert report["checks"]["ours_eager_vs_bf16"]["positions"] == 4 * 32
        servers = report["servers"]
        assert len(servers) == 5 and all(v["ready_s"] is not None for v in servers.values())
        ours = servers[f"{arch}-ours"]["stands_in_for"]
        assert "--moe-runner-backend glm5_fp4" in ours and "--disable-shared-experts-fusion" in ours
        assert ("--attention-backend dsa" in ours) == (arch == "glm5")
        marlin = servers[f"{arch}-marlin"]["stands_in_for"]
        assert "--moe-runner-backend marlin" in marlin and "--disable-shared-experts-fusion" in marlin
        assert "--cuda-graph-bs-prefill 16 64 192 512" in ours  # a few prefill graphs, not SGLang's 30
        assert "/routed-only/" in ours  # the routed-only checkpoints, in their own folder
    assert s["phases"]["checkpoints"]["recipe"] == "routed-only"
    assert s["prewarm"]["state"] == "done" and s["prewarm"]["before"].endswith("-marlin")
    # Two stages: every stage-1 server (references, ours with graphs) ready before any stage-2 server starts
    lines = r["log"].splitlines()
    started = {ln.split()[1].rstrip(":"): i for i, ln in enumerate(lines) if ln.startswith("[fleet] ") and " --" in ln}
    ready = {ln.split()[1].rstrip(":"): i for i, ln in enumerate(lines) if "ready after" in ln}
    first = [n for n in started if n.endswith(("-bf16", "-ours"))]
    second = [n for n in started if n.endswith(("-ours-eager", "-bf16-graphs", "-marlin"))]
    assert len(first) == 4 and len(second) == 6
    assert max(ready[n] for n in first) < min(started[n] for n in second)
    with tarfile.open(r["out"] / f"{r['run']}.tar.gz") as tar:
        names = tar.getnames()
    assert f"{r['run']}/summary.json" in names and sum(n.endswith(".log") for n in names) == 10


def test_tiny_rehearsal_reports_failures_and_falls_back_to_the_dense_view(rehearsals):
    r = rehearsals["tiny_failing"]
    assert r["rc"] == 1  # a check failed: the exit code says so
    s = r["summary"]
    assert set(s["archs"]) == {"glm5", "glm4moe", "glm5dense"}
    assert s["archs"]["glm5dense"]["verdict"]["ok"]  # the closest thing that runs, ran
    assert "fake SGLang: this server was told to fail at start" in s["archs"]["glm5"]["verdict"]["why"][0]
    why = " ".join(s["archs"]["glm4moe"]["verdict"]["why"])
    assert "ours_graphs_vs_bf16_graphs: mean |Δ logprob|" in why and "ours_eager_vs_bf16" not in why
    assert len(s["problems"]) == 2


def test_true_dims_rehearsal_runs_every_phase(rehearsals):
    r = rehearsals["true"]
    assert r["rc"] == 0, r["log"][-3000:]
    s = r["summary"]
    assert s["problems"] == [] and s["skipped"] == []
    phases = s["phases"]
    for phase in ("servers", "logprobs_ours_vs_marlin", "loadtest_ours", "loadtest_marlin", "profile_ours",
                  "profile_marlin", "compare_c4"):
        assert phase in phases, phase
    assert phases["logprobs_ours_vs_marlin"]["ok"]
    # Both sweeps before either profile (so the deadline never takes Marlin's sweep and the compare table)
    order = list(phases)
    assert max(order.index("loadtest_ours"), order.index("loadtest_marlin")) < order.index("compare_c4") \
        < order.index("profile_ours") < order.index("profile_marlin")
    assert set(s["servers"]) == {"ours", "marlin"}  # no layer timers on fakes
    assert "SGLANG_TORCH_PROFILER_DIR" in s["servers"]["marlin"]["stands_in_for"]
    assert "--disable-shared-experts-fusion" in s["servers"]["marlin"]["stands_in_for"]
    from glm5_fp4.checkpoint.inspect import inspect_checkpoint

    assert inspect_checkpoint(s["checkpoint_served"]).recipe == "routed-only"
    assert s["prewarm"]["state"] == "absent"  # no pre-warm started: nothing to wait for
    with tarfile.open(r["out"] / f"{r['run']}.tar.gz") as tar:
        names = set(tar.getnames())
    assert f"{r['run']}/compare_c4.md" in names
    assert any(n.endswith("profile/ours/breakdown/breakdown.json") for n in names)
    # One level: the load tester writes <label>-c<N>-<model>-<time>.json, not a sweep
    assert any("loadtest/marlin/marlin-c4-" in n and n.endswith(".json") for n in names)


def _true_dims():
    """benchmarks/h200/true_dims.py, its Run and its argument parser (the scripts import them by folder)."""
    import argparse

    sys.path[:0] = [str(ROOT / "benchmarks" / "h200")]
    try:
        import true_dims
        from common import Run
    finally:
        del sys.path[0]
    ap = argparse.ArgumentParser()
    true_dims.add_arguments(ap)
    return true_dims, Run, ap


def test_servers_option_selects_and_orders_the_servers():
    true_dims, _, ap = _true_dims()
    assert true_dims.selected(ap.parse_args([])) == ["ours", "marlin", "ours-timers", "marlin-timers"]
    assert true_dims.selected(ap.parse_args(["--servers", "marlin-timers,ours"])) == ["ours", "marlin-timers"]
    assert true_dims.selected(ap.parse_args(["--no-timers"])) == ["ours", "marlin"]
    assert ap.parse_args([]).start_timeout_s == 420 and ap.parse_args([]).start_together == 2
    with pytest.raises(SystemExit, match="unknown"):
        true_dims.selected(ap.parse_args(["--servers", "ours,stock"]))


def test_fleet_gives_sglang_servers_ports_its_vehicle_accepts(monkeypatch):
    """The H200 fleet took ephemeral ports (up to ~61000) and SGLang 0.5.15 refused those above 55535; every
    SGLang server now gets a port the vehicle's own rule accepts, however high the ephemeral range runs."""
    import socket

    from glm5_fp4.engines.sglang.compat import server_flags
    from glm5_fp4.server_process import free_port

    highest = server_flags("0.5.15").max_port
    ports = {free_port(highest=highest) for _ in range(50)}
    assert all(1024 < p <= highest for p in ports)
    for p in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when handed out


def test_short_sweep_beside_the_timer_twins(tmp_path, monkeypatch):
    """``--levels 1,8,32 --no-profile --timers-concurrency 512``: the measured servers' sweep and compare at the
    low levels, no profile capture, and the timer twins still loaded at 512 streams."""
    true_dims, Run, ap = _true_dims()
    args = ap.parse_args(["--levels", "1,8,32", "--no-profile", "--timers-concurrency", "512"])
    calls = []
    monkeypatch.setattr(true_dims, "cli", lambda run, name, argv, timeout, log=None: calls.append((name, argv)) or 0)
    monkeypatch.setattr(true_dims, "check_logprobs", lambda *a, **k: None)
    monkeypatch.setattr(true_dims, "loadtest_result", lambda folder, lvl: folder / f"c{lvl}.json")
    run = Run("rehearsal", tmp_path, 600)
    true_dims.measure_group(run, {"ours": "u1", "marlin": "u2"}, tmp_path, 1000, "sglang", args)
    names = [n for n, _ in calls]
    # both servers run the sweep once unmeasured before either is measured (first-use compiles land there)
    assert names == ["prewarm_ours", "prewarm_marlin", "loadtest_ours", "loadtest_marlin", "compare_c1", "compare_c8",
                     "compare_c32"]
    prewarm = dict(calls)["prewarm_ours"]
    assert prewarm[prewarm.index("--result-dir") + 1] == "" and prewarm[prewarm.index("--concurrency") + 1] == "1,8,32"
    calls.clear()
    true_dims.measure_group(run, {"ours": "u1", "marlin": "u2"}, tmp_path, 1000, "sglang",
                            ap.parse_args(["--levels", "1,8,32", "--no-profile", "--no-prewarm"]))
    assert [n for n, _ in calls][:2] == ["loadtest_ours", "loadtest_marlin"]

    class _Fleet:
        def by_name(self, name):
            return name

        def stop(self, server):
            calls.append(("stop", [server]))

    calls.clear()
    true_dims.timers(run, _Fleet(), "ours", "u3", tmp_path, args)
    load = dict(calls)["timers_load_ours"]
    assert load[load.index("--concurrency") + 1] == "512" and load[load.index("--num-prompts") + 1] == "512"
    assert ap.parse_args([]).timers_concurrency == 0 and not ap.parse_args([]).no_profile


def test_sweeps_come_before_profiles_when_time_is_short(tmp_path, monkeypatch):
    """With ~270 s left for two sweeps and two profiles, each sweep used to get 60 s and die inside its 512-stream
    level (H200, 2026-12-01); now each gets its half and the deadline takes the profiles."""
    true_dims, Run, ap = _true_dims()
    args = ap.parse_args(["--no-prewarm"])  # the shares of the sweeps against the profiles (prewarm: its own test)
    timeouts = {}
    monkeypatch.setattr(true_dims, "check_logprobs", lambda *a, **k: None)
    monkeypatch.setattr(true_dims, "loadtest", lambda run, name, url, ckpt, args, timeout=300.0:
                        timeouts.__setitem__(name, timeout))
    monkeypatch.setattr(true_dims, "profile", lambda *a, **k: None)
    monkeypatch.setattr(true_dims, "cli", lambda *a, **k: 0)
    run = Run("rehearsal", tmp_path, 270)
    true_dims.measure_group(run, {"ours": "u1", "marlin": "u2"}, tmp_path, 1000, "vllm", args)
    assert timeouts["ours"] >= (270 - 30) / 2 - 1 and timeouts["marlin"] >= timeouts["ours"], timeouts  # was 60 and 60
