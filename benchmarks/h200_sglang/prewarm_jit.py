"""Build the JIT kernels stock SGLang 0.5.15's NVFP4 servers need, once, before those servers start (issue 19).

Why: on the H200 (2026-12-01) every modelopt_fp4 server, ours and stock Marlin, eager or with graphs, tiny or at
true dimensions, stayed at /health 503 for > 5 min while the BF16 servers of the same models were ready in
142-172 s. On SM90 SGLang 0.5.15 runs NVFP4 through Marlin kernels that are not in ``sgl_kernel`` but compiled at
first use by ``sglang.jit_kernel.utils.load_jit`` (tvm-ffi + ninja + nvcc): one translation unit per module and
scalar type, holding every template variant of Marlin (all weight types, tile shapes, thread counts), so minutes
of single-threaded nvcc, started by each server at its first forward (the warm-up request, or the first CUDA-graph
capture), with 10 servers competing for 16 cores. The build is shared safely: the build folder is content-
addressed (``$TVM_FFI_CACHE_DIR/<module>__arch_<cc>__tvmffi_<version>``) and tvm-ffi builds under a ``FileLock``
in it, so a second process waits for the first and then loads the finished ``.so``. That is what makes a pre-warm
work: one process builds, every later server finds the ``.so`` and loads it in milliseconds.

The modules (``MODULES``): the stock Marlin MoE path (``fused_marlin_moe``: ``moe_wna16_marlin`` GEMM, the
``silu_and_mul`` activation; ``gptq_marlin_repack`` at weight load) and, only with ``--linear`` (a checkpoint
of the ``glm5`` recipe, whose dense MLPs and shared experts are NVFP4 *linear* layers: ``apply_fp4_marlin_linear``),
``gptq_marlin``. Our servers serve ``routed-only`` checkpoints (no NVFP4 linear at all) and run the MoE on our own
Triton kernels, so they neither need nor wait for this.

Started once, in the background, right after install in the shipping call (``--background``: a new session that
outlives the call while the machine stays warm); the modules build in parallel threads (each is one nvcc).
It writes ``/tmp/sglang/prewarm.json`` at the start and after each module: ``state`` running / done, per module
seconds, ok, error. The run scripts wait for ``done`` (bounded: fleet.PrewarmGate) before starting a stock
server and start ours at once.

``--seed-from DIR`` (default ``.jit-seed`` in the tree, when present: carried to the device, see the README): the
same modules built off the device (``--build-here``, on a machine with nvcc 13 and SGLang 0.5.15's sources, no
GPU), as ``DIR/<build folder>/<module>.so``. Each is copied into the cache under its own (content-addressed) folder
name before the build; ``load_jit`` then loads it instead of compiling, or, if it does not load there, logs
"Cached JIT module ... failed to load; rebuilding" and compiles as without the seed. ``seeded`` in the status
lists what was copied.

    . benchmarks/h200/env.sh sglang && python3 benchmarks/h200_sglang/prewarm_jit.py --background [--linear]
    # here, once: CUDA_HOME=/usr/local/cuda-13.0 PYTHONPATH=<sglang-0.5.15 sources> python prewarm_jit.py --build-here
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

STATUS = Path("/tmp/sglang/prewarm.json")
SEED = Path(__file__).resolve().parents[2] / ".jit-seed"
H200 = (9, 0)  # the compute capability --build-here builds for
# name -> (module, builder function, why). Each builder is cache_once-decorated in SGLang 0.5.15 and takes the
# activation dtype when it has a parameter (the servers run BF16 activations); names checked against 0.5.15's
# sources by tests/test_h200_sglang_prewarm.py.
MODULES = {
    "moe_wna16_marlin": ("sglang.jit_kernel.moe_wna16_marlin", "_jit_moe_wna16_marlin_module",
                         "stock Marlin MoE GEMM (fused_marlin_moe, both projections)"),
    "activation": ("sglang.jit_kernel.activation", "_jit_activation_module",
                   "silu_and_mul between the two Marlin MoE GEMMs"),
    "gptq_marlin_repack": ("sglang.jit_kernel.gptq_marlin_repack", "_jit_gptq_marlin_repack_module",
                           "NVFP4 weights to Marlin's layout at load (MoE and linear)"),
    "gptq_marlin": ("sglang.jit_kernel.gptq_marlin", "_jit_gptq_marlin_module",
                    "NVFP4 linear layers (apply_fp4_marlin_linear): glm5-recipe checkpoints only"),
}
STOCK_MOE = ("moe_wna16_marlin", "activation", "gptq_marlin_repack")
LINEAR = ("gptq_marlin",)


def wanted(linear: bool) -> list[str]:
    return [*STOCK_MOE, *(LINEAR if linear else ())]


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def write_status(path: Path, status: dict) -> None:
    """Atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status, indent=1))
    tmp.replace(path)


def build_one(name: str) -> dict:
    import importlib

    import torch

    mod_name, fn_name, why = MODULES[name]
    t = time.monotonic()
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
        fn(*([torch.bfloat16] if inspect.signature(fn).parameters else []))
        return {"ok": True, "s": round(time.monotonic() - t, 1), "why": why}
    except Exception as exc:  # noqa: BLE001 - recorded: the server then builds (or fails) itself
        return {"ok": False, "s": round(time.monotonic() - t, 1), "why": why,
                "error": f"{type(exc).__name__}: {str(exc)[:2000]}", "traceback": traceback.format_exc()[-4000:]}


def cache_dir() -> Path:
    return Path(os.environ.get("TVM_FFI_CACHE_DIR", "~/.cache/tvm-ffi")).expanduser()


def seed(src: Path, dst: Path) -> list[str]:
    """Copy every ``<build folder>/<module>.so`` of ``src`` into ``dst`` where that folder has none yet."""
    copied = []
    for so in sorted(src.glob("*/*.so")) if src.is_dir() else []:
        target = dst / so.parent.name / so.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, target.with_suffix(".so.part"))
            target.with_suffix(".so.part").replace(target)  # a reader never sees half a file
            copied.append(f"{so.parent.name}/{so.name}")
    return copied


def build_here(names: list[str], out: Path) -> int:
    """Build the modules without a GPU for SM90 (the compute capability pinned instead of read from a device),
    keep only each ``.so`` under its build folder's name in ``out``."""
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (cuda / "lib64" / "libcudart.so").exists():
        # tvm-ffi links -L$CUDA_HOME/lib64 -lcudart; without CUDA_HOME it guesses from nvcc's folder, which a
        # wrapper script (/usr/local/bin/nvcc here) gets wrong: every link then fails
        raise SystemExit(f"--build-here: no {cuda}/lib64/libcudart.so; set CUDA_HOME (e.g. /usr/local/cuda-13.0)")
    os.environ["CUDA_HOME"] = str(cuda)
    import sglang.jit_kernel.utils as u

    u.get_jit_cuda_arch = lambda: u.ArchInfo(*H200, "")
    u.is_arch_support_pdl = lambda: True  # what it answers on SM90 (capability >= 9)
    os.environ["TVM_FFI_CACHE_DIR"] = str(out / ".build")
    results = {n: build_one(n) for n in names}
    for so in (out / ".build").glob("*/*.so"):
        (out / so.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, out / so.parent.name / so.name)
    shutil.rmtree(out / ".build", ignore_errors=True)
    (out / "built.json").write_text(json.dumps({"built_utc": _now(), "for": "sm_%d%d" % H200, "modules": {
        n: {k: v for k, v in r.items() if k != "traceback"} for n, r in results.items()}}, indent=1))
    print(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results.values()) else 1


def run(names: list[str], status_path: Path, seed_from: Path | None = None) -> int:
    t0 = time.monotonic()
    status = {"state": "running", "pid": os.getpid(), "started_utc": _now(), "modules": {n: None for n in names},
              "cache_dir": str(cache_dir()), "max_jobs": os.environ.get("MAX_JOBS")}
    if seed_from is not None:
        status["seeded"] = seed(seed_from, cache_dir())
    write_status(status_path, status)
    try:
        import torch

        torch.cuda.init()  # load_jit keys the build on the device's compute capability
        status["device"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # noqa: BLE001
        status.update(state="done", error=f"no CUDA device: {exc}", total_s=round(time.monotonic() - t0, 1))
        write_status(status_path, status)
        return 1
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        futures = {n: pool.submit(build_one, n) for n in names}
        for n, f in futures.items():
            status["modules"][n] = f.result()
            print(f"[prewarm] {n}: {status['modules'][n]}", flush=True)
            write_status(status_path, status)
    status.update(state="done", finished_utc=_now(), total_s=round(time.monotonic() - t0, 1))
    write_status(status_path, status)
    return 0 if all(m and m["ok"] for m in status["modules"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--linear", action="store_true",
                    help="also the NVFP4 linear GEMM (only when a glm5-recipe checkpoint is served by a stock server)")
    ap.add_argument("--status", type=Path, default=STATUS)
    ap.add_argument("--background", action="store_true",
                    help="start in a new session (log next to the status file) and return at once")
    ap.add_argument("--seed-from", type=Path, default=SEED if SEED.is_dir() else None,
                    help="prebuilt modules to copy into the cache first (default .jit-seed when present)")
    ap.add_argument("--seed-only", action="store_true",
                    help="only copy --seed-from into the cache (no SGLang needed: the first shipping call, before install)")
    ap.add_argument("--build-here", action="store_true", help="build the modules for SM90 without a GPU into --out")
    ap.add_argument("--out", type=Path, default=SEED)
    args = ap.parse_args(argv)
    names = wanted(args.linear)
    if args.build_here:
        return build_here(list(MODULES), args.out)
    if args.seed_only:
        copied = seed(args.seed_from, cache_dir()) if args.seed_from else []
        print(f"[prewarm] seeded {cache_dir()}: {copied or 'nothing (no seed, or already there)'}", flush=True)
        return 0
    if args.background:
        log = args.status.with_suffix(".log")
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--status", str(args.status),
               *(["--linear"] if args.linear else []),
               *(["--seed-from", str(args.seed_from)] if args.seed_from else [])]
        with log.open("w") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        # "running" before returning: a run script started right after must see it and wait
        write_status(args.status, {"state": "running", "pid": p.pid, "started_utc": _now(),
                                   "modules": {n: None for n in names}})
        print(f"[prewarm] building {', '.join(names)} in the background (pid {p.pid}, log {log}, "
              f"status {args.status})", flush=True)
        return 0
    return run(names, args.status, args.seed_from)


if __name__ == "__main__":
    sys.exit(main())
