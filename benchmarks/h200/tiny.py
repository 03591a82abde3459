"""The tiny-model item of both engines' H200 runs (vLLM issue 16 item 2, SGLang issue 19 item 2), engine-free.

Checkpoints are made here (seconds): tiny GLM-5 with its DSA indexer (index heads and head size at GLM-5's own
32 x 128, what DeepGEMM's indexer kernels take), its dense-attention view (the fallback if the engine cannot
start DSA), tiny GLM-4.5, each with its ``--dequantized`` BF16 twin. On the GPU the GLM-5 ones get GLM-5's own
MLA head dimensions too (vLLM 0.26's SM90 MLA prefill refuses the tiny CPU shape, seen on the H200 2026-12-01).

An engine's run script gives the server matrix, one ``ServerSpec``/``SglangSpec`` per name, named
``<arch>-bf16`` (the reference: stock, BF16 twin, eager), ``<arch>-bf16-graphs``, ``<arch>-ours`` (graphs),
``<arch>-ours-eager`` and, on GPU, ``<arch>-marlin`` (the engine's stock NVFP4 MoE, Marlin on SM90). All servers
of a wave start together; the reference's greedy continuations are scored by every server (teacher forcing;
served_compare.py) and the differences are bounded relative to yardsticks the stock engine shows on the same
tokens (glm5_fp4.tolerances): ours-eager vs the twin and ours-graphs vs the twin-graphs within twice Marlin's
distance from the twin (the MoE kernel), ours-graphs vs ours-eager within twice the twin's graphs-vs-eager
distance (compilation / graph capture), or the floor; top-1 equal at every decisive position. Where free-running
greedy continuations part is reported, not judged. If a GLM-5 DSA server does not start, its traceback summary
is kept and the dense-attention view runs instead.

``stages`` (SGLang's run): a wave's servers start in stages instead of all at once, each stage collected and
stopped before the next starts (ten SGLang servers starting together on 16 cores took 142-172 s to become
ready, H200 2026-12-01), the reference in the first. ``recipe``: which make-checkpoint recipe the NVFP4
checkpoints follow; one other than ``glm5`` (vLLM's) gets its own folder under ``--ckpt-root`` so the two
engines' checkpoints never stand in for each other.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Callable

from common import Run, env_versions, evidence, traceback_summary
from fleet import Fleet

from glm5_fp4.tolerances import yardstick_trusted

import served_compare

# GLM-5's own indexer shape; the rest stays at the tiny defaults (glm5_fp4.checkpoint.configs.TINY_SIZES).
GLM5_TINY_DSA = {"index_n_heads": 32, "index_head_dim": 128}
# On the GPU, GLM-5's own MLA head dimensions too: vLLM 0.26's SM90 MLA prefill backend (FlashAttention 3)
# refuses the tiny CPU shape (qk_nope 64, v 64: "Model does not have supported MLA dimensions", seen on the
# H200 2026-12-01); the CPU backend takes only the tiny one.
GLM5_GPU_MLA = {"qk_nope_head_dim": 192, "v_head_dim": 256}
SUFFIXES = ("bf16", "bf16-graphs", "ours", "ours-eager", "marlin")


def make_checkpoints(root: Path, gpu_dims: bool, dsa: bool, recipe: str = "glm5") -> dict[str, Path]:
    from glm5_fp4.checkpoint.make import make_checkpoint

    root = root if recipe == "glm5" else root / recipe
    glm5_sizes = {**GLM5_TINY_DSA, **(GLM5_GPU_MLA if gpu_dims else {})}
    wanted = {"glm4moe": ("glm4moe", False, {}), "glm5dense": ("glm5", True, glm5_sizes)}
    if dsa:
        wanted["glm5"] = ("glm5", False, glm5_sizes)
    out = {}
    for name, (arch, dense, sizes) in wanted.items():
        for twin in (False, True):
            key = f"{name}-bf16" if twin else name
            path = root / key
            if not (path / "config.json").is_file():  # fresh folders only (a stale one fails validation)
                make_checkpoint(path, arch=arch, dense_attention=dense, dequantized=twin, sizes=sizes, overwrite=True,
                                recipe=recipe)
            out[key] = path
    return out


def prompts(vocab: int, count: int, length: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(count)]


Matrix = Callable[[str, dict[str, Path]], list]


def stage_of(name: str, stages: tuple[tuple[str, ...], ...] | None) -> int:
    """The stage (index) a server named ``<arch>-<suffix>`` starts in; everything in stage 0 without stages."""
    if not stages:
        return 0
    return next((i for i, st in enumerate(stages) if any(name.endswith("-" + x) for x in st)), len(stages) - 1)


STAGE_RESERVE_S = 150.0


def _order_in_stage(name: str, stages, i: int) -> int:
    if not stages:
        return 0
    return next((j for j, x in enumerate(stages[i]) if name.endswith("-" + x)), len(stages[i]))


def run_wave(run: Run, fleet: Fleet, archs: list[str], ckpts: dict[str, Path], matrix: Matrix, engine: str,
             args, stages: tuple[tuple[str, ...], ...] | None = None) -> dict[str, dict]:
    """Every server of ``archs`` in one wave (references collected first), in ``stages`` if given (a stage
    starts when the one before is collected and stopped; a stage the deadline leaves no room for is skipped and
    said so); one report per architecture."""
    ps = {a: prompts(json.loads((ckpts[a] / "config.json").read_text())["vocab_size"], args.prompts) for a in archs}
    specs = [s for a in archs for s in matrix(a, ckpts)]
    specs.sort(key=lambda s: not s.name.endswith("-bf16"))  # references first: the others score their tokens
    arch_of = {s.name: a for a in archs for s in matrix(a, ckpts)}
    references: dict[str, dict] = {}

    def collect(started):
        arch = arch_of[started.spec.name]
        t = time.monotonic()
        ref = references.get(arch)
        data = served_compare.collect(started.url, ps[arch], args.tokens, ref["greedy"] if ref else None, engine)
        if ref is None and started.spec.name.endswith("-bf16"):
            references[arch] = data
        data["collect_s"] = round(time.monotonic() - t, 1)
        return data

    t0 = time.monotonic()
    results = {}
    n_stages = 1 + max(stage_of(s.name, stages) for s in specs)
    for i in range(n_stages):
        # In the stage's own order (a server that waits before its launch, e.g. stock SGLang for the JIT
        # pre-warm, is listed last so the others start first), references first
        group = sorted((s for s in specs if stage_of(s.name, stages) == i),
                       key=lambda s: (not s.name.endswith("-bf16"), _order_in_stage(s.name, stages, i)))
        if not group or (i and run.skip(f"stage {i + 1} of {','.join(archs)}: {[s.name for s in group]}", 120)):
            continue
        # Each later stage keeps STAGE_RESERVE_S of the time left (a server that never comes up in an early
        # stage must not take the later stages' time)
        later = n_stages - 1 - i
        timeout = min(args.start_timeout_s, run.left() - 60 - STAGE_RESERVE_S * later)
        results.update(fleet.run_each(group, timeout_s=max(60.0, timeout), collect=collect))
    (run.work / f"collections_{'_'.join(archs)}.json").write_text(json.dumps(results, indent=1))
    reports = {a: evaluate(a, {n: r for n, r in results.items() if arch_of[n] == a}, fleet, ps[a], args)
               for a in archs}
    run.phase("wave " + ",".join(archs), t0, ok={a: r["verdict"]["ok"] for a, r in reports.items()})
    return reports


def evaluate(arch: str, results: dict, fleet: Fleet, ps: list[list[int]], args) -> dict:
    servers = {}
    for name in results:
        s = fleet.by_name(name)
        servers[name] = {**s.summary(), "evidence": evidence(s.handle.log_path)}
        if s.error:
            servers[name]["traceback"] = traceback_summary(s.handle.log_path)
    report = {"servers": servers, "prompts": ps, "tokens": args.tokens}
    ref = results.get(f"{arch}-bf16")
    if ref is None:
        report["verdict"] = {"ok": False, "why": [f"reference {arch}-bf16 did not start: {servers[arch + '-bf16']['error']}"]}
        return report
    checks: dict[str, dict] = {}
    r = {k.removeprefix(arch + "-"): v for k, v in results.items() if v is not None}
    # Yardsticks: what the stock engine itself shows on the same tokens (informational, and the bounds' scale).
    kernel = served_compare.compare(ref, r["marlin"]) if "marlin" in r else None
    compile_ = served_compare.compare(ref, r["bf16-graphs"]) if "bf16-graphs" in r else None
    if kernel:
        checks["marlin_vs_bf16 (yardstick)"] = kernel.to_dict()
    if compile_:
        checks["bf16_graphs_vs_eager (yardstick)"] = compile_.to_dict()
    if "ours-eager" in r:
        checks["ours_eager_vs_bf16"] = served_compare.compare(ref, r["ours-eager"], kernel and kernel.stats).to_dict()
    if "ours" in r and "bf16-graphs" in r:
        checks["ours_graphs_vs_bf16_graphs"] = served_compare.compare(r["bf16-graphs"], r["ours"],
                                                                      kernel and kernel.stats).to_dict()
    if "ours" in r and "ours-eager" in r:
        checks["ours_graphs_vs_eager"] = served_compare.compare(r["ours-eager"], r["ours"],
                                                                compile_ and compile_.stats).to_dict()
    report["checks"] = checks
    # A stock path off its own BF16 twin is a finding about the engine, not a failure of ours; it is reported
    # here, and the bounds above fell back to the floor instead of scaling by it (tolerances.yardstick_trusted).
    report["stock_findings"] = [
        f"{label}: the stock path disagrees with the BF16 twin beyond rounding ({'; '.join(why)}); not used as a bound"
        for label, y in (("marlin_vs_bf16", kernel), ("bf16_graphs_vs_eager", compile_))
        if y and (why := yardstick_trusted(y.stats)[1])
    ]
    report["reference_decode_vs_prefill"] = served_compare.decode_vs_prefill(ref)
    why = []
    for name in servers:
        if results.get(name) is None:
            why.append(f"{name} did not start: {servers[name]['error']}")
    ours_lines = servers.get(f"{arch}-ours", {}).get("evidence", {}).get("ours", [])
    if fleet.gpu and results.get(f"{arch}-ours") is not None and not any("run on backend triton" in ln for ln in ours_lines):
        why.append(f"{arch}-ours: the log does not say our triton backend serves the MoE layers")
    for name, c in checks.items():
        if "yardstick" not in name and not c["ok"]:
            why += [f"{name}: {w}" for w in c["why"]]
    report["verdict"] = {"ok": not why, "why": why}
    return report


def run(name: str, engine: str, matrix: Matrix, fleet_kwargs: dict, gpu: bool, dsa: bool, gpu_dims: bool,
        default_archs: list[str], args, stages: tuple[tuple[str, ...], ...] | None = None, recipe: str = "glm5",
        on_fleet=None) -> int:
    """The whole item: checkpoints, a wave per architecture group (in ``stages``), the dense-view fallback, the
    verdicts. ``on_fleet(run)`` returns more of the fleet's arguments (a gate), given the run."""
    run_ = Run(name, args.out, args.deadline_s)
    run_.summary.update(env=env_versions(), gpu_mode=gpu, engine=engine, fake_servers=fleet_kwargs.get("fake", False))
    t = time.monotonic()
    ckpts = make_checkpoints(args.ckpt_root, gpu_dims, dsa, recipe)
    run_.phase("checkpoints", t, made=sorted(ckpts), recipe=recipe)
    if on_fleet is not None:
        fleet_kwargs = {**fleet_kwargs, **on_fleet(run_)}
    fleet = Fleet(run_.work / "logs", gpu, **fleet_kwargs)
    archs = args.arch or default_archs
    with fleet:
        reports = run_wave(run_, fleet, archs, ckpts, matrix, engine, args, stages)
        glm5 = reports.get("glm5")
        if glm5 is not None and any(v["error"] for k, v in glm5["servers"].items()) and "glm5dense" not in archs:
            # What cannot run is written down (tracebacks above); the closest thing that runs is run instead.
            if not run_.skip("glm5dense (the dense-attention view, instead of DSA)", 150):
                reports.update(run_wave(run_, fleet, ["glm5dense"], ckpts, matrix, engine, args, stages))
        run_.summary["archs"] = reports
        for arch, report in reports.items():
            if not report["verdict"]["ok"]:
                run_.problem(f"{arch}: " + "; ".join(report["verdict"]["why"]))
    return run_.finish()


def add_arguments(ap, deadline_s: float = 510.0, start_timeout_s: float = 330.0) -> None:
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--ckpt-root", type=Path, default=Path("/tmp/ckpt"))
    ap.add_argument("--deadline-s", type=float, default=deadline_s, help="the whole script, start-ups included")
    ap.add_argument("--start-timeout-s", type=float, default=start_timeout_s)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--arch", action="append", default=None, help="glm5, glm5dense, glm4moe (default: all)")
