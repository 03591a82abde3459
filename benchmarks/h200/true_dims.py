"""The true-dimension item of both engines' H200 runs (vLLM issue 16 item 3, SGLang issue 19 item 3), engine-free.

The checkpoint: GLM-5's own hidden size, experts, intermediate sizes, MLA and DSA indexer shapes and vocabulary
(glm5_fp4.spec.Glm5Spec) with ``--layers`` layers, the first ``--dense`` of them dense (default 3 + 2 MoE, ~17 GB
NVFP4), made on the GPU by ``make-checkpoint --device cuda`` (seconds; skipped when the folder is complete, e.g.
made in the background by make_true_ckpt.sh during shipping). vLLM's run serves the ``glm5`` recipe at
/tmp/ckpt/glm5-true (``CKPT``), SGLang's the ``routed-only`` recipe at /tmp/ckpt/glm5-true-routed
(``ckpt_for``): two folders, so neither run mistakes the other's complete checkpoint for its own.

An engine's run script gives ``specs_for(ckpt, gpu, work, timers)``: ``ours`` and ``marlin`` (stock NVFP4 MoE,
Marlin on SM90) with their profilers on, and, with timers, ``ours-timers`` / ``marlin-timers`` with
``GLM5_FP4_LAYER_TIMERS=1`` (the timers synchronise once per step, so they stay off the servers whose throughput
is measured). ``--servers`` picks which of the four start (e.g. ``ours,marlin`` in one call, the timer twins in
the next), ``--start-together`` (default 2) at a time, each group given ``--start-timeout-s`` (420 s): four DSA
servers capturing CUDA graphs at once ran past 239 s on the H200. Then, as time allows (each phase skipped, and
said so, when the deadline is near): a short teacher-forced logprob check ours vs Marlin; ``glm5-fp4 loadtest``
sweeps (concurrency up to 512, short outputs) on each, each given its share of the time left; ``glm5-fp4
compare`` per level; ``glm5-fp4 profile capture --analyze`` of real decode steps on each (the engine's
``/start_profile``); the measured servers stop, the timer twins start, take one wave of load, and ``glm5-fp4
profile timers`` reports their dumps. GPU telemetry comes with every load test (NVML). If the engine cannot
start DSA at these sizes (every server of the group fails), the same weights are served as the dense-attention
view instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from common import ROOT, Run, evidence, traceback_summary
from fleet import Fleet

import served_compare

CKPT = Path("/tmp/ckpt/glm5-true")


def ckpt_for(recipe: str) -> Path:
    """The true-dimension checkpoint folder of a make-checkpoint recipe (make_true_ckpt.sh spells the same)."""
    return CKPT if recipe == "glm5" else CKPT.parent / f"{CKPT.name}-{'routed' if recipe == 'routed-only' else recipe}"

LEVELS = "1,8,32,128,512"
# Rehearsals: the same layer structure at tiny widths (vLLM's CPU MLA needs kv_lora 512 / rope 64).
CPU_SIZES = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 16,
             "num_experts_per_tok": 4, "num_attention_heads": 4, "vocab_size": 2048, "q_lora_rank": 128,
             "qk_nope_head_dim": 64, "v_head_dim": 64, "index_n_heads": 4, "index_head_dim": 64}


def true_sizes(layers: int, dense: int) -> dict[str, int]:
    """GLM-5's own dimensions (the one home: glm5_fp4.spec) as make-checkpoint --size fields."""
    from glm5_fp4.checkpoint.configs import TINY_SIZES
    from glm5_fp4.spec import Glm5Spec

    spec = Glm5Spec()
    renamed = {"num_hidden_layers": "num_layers", "first_k_dense_replace": "first_k_dense"}
    sizes = {k: getattr(spec, renamed.get(k, k)) for k in TINY_SIZES if hasattr(spec, renamed.get(k, k))}
    sizes.update(num_hidden_layers=layers, first_k_dense_replace=dense)
    return {k: v for k, v in sizes.items() if k in TINY_SIZES and v is not None}


def cli(run: Run, name: str, args: list[str], timeout: float, log: Path | None = None) -> int:
    """``glm5-fp4 ARGS`` as a subprocess (its own timeout; output to a log in the bundle)."""
    log = log or run.work / f"{name}.log"
    t = time.monotonic()
    with log.open("w") as f:
        try:
            rc = subprocess.run([sys.executable, "-m", "glm5_fp4.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    run.phase(name, t, rc=rc, log=log.name)
    if rc:
        run.problem(f"{name}: exit {rc} (see {log.name}): " + " | ".join(log.read_text(errors="replace").splitlines()[-3:]))
    return rc


def ensure_checkpoint(run: Run, path: Path, sizes: dict, device: str, wait_s: float, recipe: str = "glm5") -> Path:
    done = path / ".complete"
    pid_file = path.parent / f"{path.name}.pid"
    t = time.monotonic()
    while not done.is_file() and pid_file.is_file() and time.monotonic() - t < wait_s:
        try:
            os.kill(int(pid_file.read_text()), 0)  # the background maker still runs
        except (OSError, ValueError):
            break
        time.sleep(2)
    if done.is_file():
        run.phase("checkpoint", t, reused=True, waited_s=round(time.monotonic() - t, 1), recipe=recipe)
        return path
    if path.exists():
        shutil.rmtree(path)  # a half-written folder fails validation later
    args = ["make-checkpoint", "--arch", "glm5", "--out", str(path), "--device", device, "--recipe", recipe]
    for k, v in sizes.items():
        args += ["--size", f"{k}={v}"]
    if cli(run, "make_checkpoint", args, timeout=max(60.0, run.left() - 300)) == 0:
        done.write_text("ok\n")
    return path


def run_checkpoint(run: Run, args, gpu: bool) -> tuple[Path, dict]:
    """This run's checkpoint and its sizes: GLM-5's own on a GPU, the CPU widths (CPU_SIZES) in a rehearsal; made,
    or waited for while make_true_ckpt.sh makes it (``.complete`` says whether it is there)."""
    sizes = true_sizes(args.layers, args.dense) if gpu else {**true_sizes(args.layers, args.dense), **CPU_SIZES}
    run.summary["sizes"] = sizes
    ckpt = ensure_checkpoint(run, args.ckpt or ckpt_for(args.recipe), sizes, "cuda" if gpu else "cpu", wait_s=240,
                             recipe=args.recipe)
    return ckpt, sizes


def dense_view(path: Path) -> Path:
    """The dense-attention view of ``path``: its own config.json, every other file linked (no copy)."""
    from glm5_fp4.checkpoint.configs import dense_attention_view

    view = path.parent / f"{path.name}-dense"
    view.mkdir(exist_ok=True)
    for f in path.iterdir():
        if f.name != "config.json" and not (view / f.name).exists():
            (view / f.name).symlink_to(f)
    cfg = json.loads((path / "config.json").read_text())
    (view / "config.json").write_text(json.dumps(dense_attention_view(cfg), indent=2))
    return view


def check_logprobs(run: Run, urls: dict[str, str], vocab: int, engine: str) -> None:
    """Ours vs Marlin on the same tokens at true dimensions (informational: random weights, 2 layers of MoE)."""
    from tiny import prompts

    t = time.monotonic()
    ps = prompts(vocab, 2, length=32)
    ref = served_compare.collect(urls["marlin"], ps, 16, engine=engine)
    ours = served_compare.collect(urls["ours"], ps, 16, ref["greedy"], engine=engine)
    c = served_compare.compare(ref, ours)
    (run.work / "logprobs_ours_vs_marlin.json").write_text(json.dumps({"marlin": ref, "ours": ours}, indent=1))
    extra = {}
    if engine == "sglang":
        from glm5_fp4.engines.sglang import compat

        if compat.stock_marlin_nvfp4_scales_twice():
            extra["stock_finding"] = (f"stock Marlin NVFP4 in SGLang {compat.installed_version()} applies "
                                      "routed_scaling_factor twice (compat.stock_marlin_nvfp4_scales_twice): this "
                                      "difference measures that, not our backend")
    run.phase("logprobs_ours_vs_marlin", t, **c.to_dict(), **extra)


def record_servers(run: Run, up: list) -> None:
    servers = run.summary.setdefault("servers", {})
    for s in up:
        servers[s.spec.name] = {**s.summary(), "evidence": evidence(s.handle.log_path)}
        if s.error:
            servers[s.spec.name]["traceback"] = traceback_summary(s.handle.log_path)
            run.problem(f"server {s.spec.name}: {s.error}")
    run.save()


SpecsFor = Callable[[Path, bool, Path, bool], list]
MEASURED = ("ours", "marlin")  # the servers whose throughput and traces are measured
TIMED = ("ours-timers", "marlin-timers")  # the layer-timer twins (they synchronise once per step)
SWEEP_MIN_S = 150.0  # a sweep to 512 streams at input 128 / output 32 on one H200: ~100-130 s


def selected(args) -> list[str]:
    """The servers ``--servers`` names, in start order (the timer twins only without ``--no-timers``)."""
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MEASURED + TIMED))
    if unknown:
        raise SystemExit(f"--servers: unknown {unknown}; choose from {', '.join(MEASURED + TIMED)}")
    return [n for n in MEASURED + TIMED if n in names and not (args.no_timers and n in TIMED)]


def start_servers(run: Run, fleet: Fleet, specs: list, args, label: str) -> dict:
    """``specs`` started ``--start-together`` at a time (each chunk waits until healthy, failed or late before
    the next starts: four DSA servers capturing CUDA graphs at once ran past 239 s on the H200); name -> URL."""
    t = time.monotonic()
    up = []
    step = args.start_together
    for i in range(0, len(specs), step):
        chunk = [fleet.launch(s) for s in specs[i:i + step]]
        fleet.wait(chunk, max(60.0, min(args.start_timeout_s, run.left() - 60)))
        up += chunk
    run.phase(label, t, ready={s.spec.name: None if s.ready_s is None else round(s.ready_s, 1) for s in up})
    record_servers(run, up)
    return {s.spec.name: s.url for s in up if s.error is None}


def stop_named(fleet: Fleet, names) -> None:
    for name in names:
        s = fleet.by_name(name)
        if s is not None:
            fleet.stop(s)


def parallel_run(run: Run, fleet: Fleet, ckpt: Path, vocab: int, specs_for: SpecsFor, engine: str, args,
                 gpu: bool) -> None:
    """The measured servers (``ours``, ``marlin``), then the timer twins, each group stopped before the next starts.

    Order within the measured group, so that Marlin's numbers are not the ones the deadline takes: the logprob
    check, both load-test sweeps (each given its share of the time left), ``compare`` per level, then the two
    profile captures.
    """
    names = selected(args)
    chosen = lambda c, group: [s for s in specs_for(c, gpu, run.work, any(n in TIMED for n in names))  # noqa: E731
                               if s.name in names and s.name in group]
    measured = host_samples(run, chosen(ckpt, MEASURED), args)
    if measured:
        label = "servers"
        ready = start_servers(run, fleet, measured, args, label)
        # DSA that the engine cannot start fails ours and stock alike; one failing alone is recorded, not retried.
        if not ready and "-dense" not in ckpt.name and not run.skip("dense view", 240):
            run.summary["dsa_failure"] = {n: run.summary["servers"][n] for n in (s.name for s in measured)}
            stop_named(fleet, [s.name for s in measured])
            ckpt = dense_view(ckpt)
            measured = host_samples(run, chosen(ckpt, MEASURED), args)
            ready = start_servers(run, fleet, measured, args, "servers_dense_view")
        run.summary["checkpoint_served"] = str(ckpt)
        measure_group(run, ready, ckpt, vocab, engine, args)
        stop_named(fleet, [s.name for s in measured])
        if args.host_samples:  # after the stop: each process has written its last records
            for s in measured:
                stalls_report(run, s.name)
    timed = chosen(ckpt, TIMED)
    if timed and not run.skip("layer-timer servers", 150):
        ready = start_servers(run, fleet, timed, args, "servers_timers")
        if not ready and "-dense" not in ckpt.name and not measured and not run.skip("dense view (timers)", 200):
            stop_named(fleet, [s.name for s in timed])
            ckpt = dense_view(ckpt)
            timed = chosen(ckpt, TIMED)
            ready = start_servers(run, fleet, timed, args, "servers_timers_dense_view")
        for name in ("ours", "marlin"):
            if f"{name}-timers" in ready:
                timers(run, fleet, name, ready[f"{name}-timers"], ckpt, args)
        stop_named(fleet, [s.name for s in timed])


def host_samples(run: Run, specs: list, args) -> list:
    """With --host-samples, each server's processes sample their host side into work/host_samples/<name> (the plugin
    is loaded into the stock server too: without our quantization flag it claims nothing)."""
    if args.host_samples:
        for s in specs:
            folder = run.work / "host_samples" / s.name
            folder.mkdir(parents=True, exist_ok=True)
            s.env = {**s.env, "GLM5_FP4_HOST_SAMPLES": str(folder)}
            for attr in ("plugin", "load_plugin"):  # vLLM's and SGLang's spec spell it differently
                if hasattr(s, attr):
                    setattr(s, attr, True)
    return specs


def stalls_report(run: Run, name: str) -> None:
    """``profile stalls`` of one server's host samples against its load-test request records."""
    folder = run.work / "host_samples" / name
    if not any(folder.glob("host-*.jsonl")):
        run.problem(f"host samples {name}: no host-<pid>.jsonl in {folder}")
        return
    requests = sorted((run.work / "loadtest" / name).glob("*.requests.jsonl*"))
    cli(run, f"stalls_{name}", ["profile", "stalls", str(folder), *(["--requests", *map(str, requests)] if requests else []),
                                "--out", str(run.work / "stalls" / name)], timeout=120)


def measure_group(run: Run, ready: dict, ckpt: Path, vocab: int, engine: str, args) -> None:
    if {"ours", "marlin"} <= set(ready) and not run.skip("logprob check", 60):
        try:
            check_logprobs(run, ready, vocab, engine)
        except Exception as exc:  # noqa: BLE001 - recorded; the measurements still run
            run.problem(f"logprob check: {type(exc).__name__}: {exc}")
    up = [n for n in MEASURED if n in ready]
    # Every server runs the whole sweep once unmeasured before any server is measured: engines compile kernels at
    # the first batch of a new size, and some (vLLM 0.26's DeepGEMM, the DSA indexer's metadata kernel: ~1.7 s with
    # the GIL held, per new batch size) keep them in a cache on disk that every server shares, so the server measured
    # first paid the compiles and the one measured second found them done (H200, 2026-12-01: ours 12 stalls / 18 s
    # at 512 streams, Marlin none; with a one-wave warm-up per level still 6 / 9.5 s against 2 / 0.9 s).
    rounds = sweep_rounds(up, args)
    for i, (kind, name) in enumerate(rounds):
        (prewarm if kind == "prewarm" else loadtest)(run, name, ready[name], ckpt, args,
                                                     timeout=round_timeout(run.left(), len(rounds) - i, len(up), args))
    if args.prewarm_only:
        return
    for lvl in [lvl for lvl in args.levels.split(",") if lvl]:
        a, b = (loadtest_result(run.work / "loadtest" / n, lvl) for n in ("marlin", "ours"))
        if a is not None and b is not None:
            cli(run, f"compare_c{lvl}", ["compare", f"marlin={a}", f"ours={b}", "--out",
                                         str(run.work / f"compare_c{lvl}.md")], timeout=60)
        elif {"loadtest_ours", "loadtest_marlin"} <= set(run.summary["phases"]):
            run.problem(f"compare c{lvl}: no load-test result at concurrency {lvl} for "
                        + " and ".join(n for n, f in (("marlin", a), ("ours", b)) if f is None))
    if not args.no_profile:
        for name in up:
            profile(run, name, ready[name], ckpt, engine, args)


def sweep_rounds(up: list[str], args) -> list[tuple[str, str]]:
    """The sweeps in order: every server's unmeasured prewarm (unless --no-prewarm), then every measured sweep
    (unless --prewarm-only: a cold machine's call that starts the servers and fills the shared compile caches, so
    the next call on the warm machine measures; on 2026-12-02 a cold start took 327 s of a 555 s call and left each
    prewarm 60 s and no measurement)."""
    rounds = [("prewarm", n) for n in up] if not args.no_prewarm else []
    if not args.prewarm_only:
        rounds += [("loadtest", n) for n in up]
    return rounds


def round_timeout(left_s: float, rounds_left: int, servers: int, args) -> float:
    """A sweep's time limit: its share of what is left after the profiles (~90 s each), unless that share is under
    SWEEP_MIN_S: then the sweeps come first and the deadline takes the profiles (on 2026-12-01 a 60 s share killed
    both sweeps inside their 512-stream level, so no compare at 512 while both profiles ran)."""
    left = left_s - 30
    profiles = 0 if (args.no_profile or args.prewarm_only) else 90 * servers
    share = (left - profiles) / rounds_left
    if share < SWEEP_MIN_S:
        share = left / rounds_left
    return min(300.0, max(60.0, share))


def loadtest_result(folder: Path, level: str) -> Path | None:
    """The result JSON of one concurrency level: ``c<N>.json`` in a sweep, ``<label>-c<N>-<model>-<time>.json``
    when the load test ran a single level."""
    sweep = folder / f"c{level}.json"
    if sweep.is_file():
        return sweep
    single = sorted(folder.glob(f"*-c{level}-*.json"))
    return single[-1] if single else None


def _workload(url: str, ckpt: Path, args) -> list[str]:
    """The sweep's load-test workload (prewarm and measurement must be the same one)."""
    return ["loadtest", "--url", url, "--concurrency", args.levels, "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--tokenizer", str(ckpt), "--prompt-format", "ids",
            "--timeout", "120", "--no-progress"]


def loadtest(run: Run, name: str, url: str, ckpt: Path, args, timeout: float = 300.0) -> None:
    """The load-test sweep (telemetry included)."""
    if not run.skip(f"loadtest {name}", 90):
        cli(run, f"loadtest_{name}", [*_workload(url, ckpt, args), "--result-dir", str(run.work / "loadtest" / name),
                                      "--label", name], timeout=min(timeout, run.left() - 60))


def prewarm(run: Run, name: str, url: str, ckpt: Path, args, timeout: float = 300.0) -> None:
    """The sweep's workload once, nothing recorded: the batch sizes the measured sweeps bring compile here."""
    if not run.skip(f"prewarm {name}", 90):
        cli(run, f"prewarm_{name}", [*_workload(url, ckpt, args), "--result-dir", "", "--no-telemetry"],
            timeout=min(timeout, run.left() - 60))


def profile(run: Run, name: str, url: str, ckpt: Path, engine: str, args) -> None:
    """A profile capture of real decode steps through the engine's ``/start_profile``, analysed."""
    if not run.skip(f"profile {name}", 75):
        conc = args.capture_concurrency
        cli(run, f"profile_{name}", ["profile", "capture", "--url", url, "--steps", "8",
                                     "--trace-dir", str(trace_dir(name)), "--engine", engine,
                                     "--concurrency", str(conc), "--prompt-len", "32", "--output-len", "256",
                                     "--warmup-s", "90", "--flush-timeout-s", "120", "--analyze",
                                     "--out", str(run.work / "profile" / name), "--batch", str(conc),
                                     "--context", "160", "--config", str(ckpt / "config.json")],
            timeout=min(240.0, run.left() - 30))


def measure(run: Run, name: str, url: str, ckpt: Path, engine: str, args) -> None:
    """One server alone (the CPU rehearsal): its sweep, then its profile capture."""
    loadtest(run, name, url, ckpt, args)
    if not args.no_profile:
        profile(run, name, url, ckpt, engine, args)


def timers(run: Run, fleet: Fleet, name: str, url: str, ckpt: Path, args) -> None:
    """One wave of streams at the highest level on the timer server, then ``profile timers`` of its dump."""
    if run.skip(f"layer timers {name}", 45):
        return
    top = args.timers_concurrency or max(int(x) for x in args.levels.split(",") if x)
    cli(run, f"timers_load_{name}", ["loadtest", "--url", url, "--concurrency", str(top), "--num-prompts", str(top),
                                     "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                                     "--tokenizer", str(ckpt), "--prompt-format", "ids", "--timeout", "90",
                                     "--result-dir", "", "--no-progress", "--no-telemetry"],
        timeout=min(150.0, run.left() - 20))
    fleet.stop(fleet.by_name(f"{name}-timers"))  # the dump is line-buffered; stopping closes it
    dumps = sorted((run.work / "layer_timers" / name).glob("*.jsonl"))
    if dumps:
        cli(run, f"timers_report_{name}", ["profile", "timers", *map(str, dumps), "--out",
                                           str(run.work / "layer_timers_report" / name)], timeout=60)
    else:
        run.problem(f"layer timers {name}: no dump in {run.work / 'layer_timers' / name}")


def trace_dir(name: str) -> Path:
    """Where the server writes its traces: outside the bundle (capture copies what it collects into it)."""
    d = Path(os.environ.get("GLM5_FP4_TRACE_ROOT", "/tmp/h200_traces")) / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def timer_env(work: Path, name: str) -> dict[str, str]:
    """The environment of a layer-timer server (its dump folder made)."""
    dump = work / "layer_timers" / name
    dump.mkdir(parents=True, exist_ok=True)
    return {"GLM5_FP4_LAYER_TIMERS": "1", "GLM5_FP4_LAYER_TIMERS_OUT": str(dump)}


def add_arguments(ap, deadline_s: float = 530.0, recipe: str = "glm5") -> None:
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--recipe", default=recipe, choices=("glm5", "routed-only"),
                    help=f"make-checkpoint recipe of the checkpoint (default {recipe})")
    ap.add_argument("--ckpt", type=Path, default=None,
                    help=f"checkpoint folder (default: by recipe, {CKPT} for glm5, {ckpt_for('routed-only')} for "
                         "routed-only)")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--dense", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=deadline_s)
    ap.add_argument("--start-timeout-s", type=float, default=420.0,
                    help="per group of servers started together (a DSA start with CUDA graphs took > 239 s)")
    ap.add_argument("--servers", default=",".join(MEASURED + TIMED),
                    help="which servers start, of ours, marlin (load test, compare, profile) and ours-timers, "
                         "marlin-timers (layer timers, started after the first two stop); e.g. ours,marlin")
    ap.add_argument("--start-together", type=int, default=2,
                    help="servers started at once (each group waits until its servers are up before the next)")
    ap.add_argument("--levels", default=LEVELS, help="load-test concurrency levels")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--capture-concurrency", type=int, default=512)
    ap.add_argument("--no-profile", action="store_true",
                    help="no profile capture on the measured servers (e.g. a short sweep beside the timer twins)")
    ap.add_argument("--timers-concurrency", type=int, default=0,
                    help="streams of the timer twins' wave (default: the highest of --levels)")
    ap.add_argument("--no-timers", action="store_true", help="skip the two layer-timer servers (as --servers ours,marlin)")
    ap.add_argument("--dense-attention", action="store_true", help="serve the dense-attention view from the start")
    ap.add_argument("--no-prewarm", action="store_true",
                    help="measure without first running the sweep once unmeasured on every server (first-use compiles "
                         "then land in whichever server is measured first)")
    ap.add_argument("--prewarm-only", action="store_true",
                    help="start the servers, run the logprob check and every server's prewarm sweep, measure nothing "
                         "(the first call on a cold machine; the next call on the warm machine measures)")
    ap.add_argument("--host-samples", action="store_true",
                    help="sample the measured servers' host side (GLM5_FP4_HOST_SAMPLES) and report what each process "
                         "did while no token was delivered (profile stalls)")


def parse_arguments(ap, argv=None):
    """``ap.parse_args`` plus the combinations add_arguments' options refuse (one usage error, exit 2)."""
    args = ap.parse_args(argv)
    if args.prewarm_only and args.no_prewarm:
        ap.error("--prewarm-only and --no-prewarm together would run no sweep at all")
    # every value before any device time: these were read after the checkpoint, or after the load tests
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MEASURED + TIMED))
    if unknown:
        ap.error(f"--servers: unknown {unknown}; choose from {', '.join(MEASURED + TIMED)}")
    levels = args.levels.split(",")
    if not all(v.strip().isdigit() and int(v) > 0 for v in levels) or len(set(levels)) < len(levels):
        ap.error(f"--levels {args.levels!r}: distinct whole concurrency levels > 0, e.g. 8,64,512")
    if args.start_together < 1:
        ap.error(f"--start-together {args.start_together}: at least one server per group")
    return args
